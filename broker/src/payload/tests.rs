use bytes::Bytes;
use proptest::prelude::*;
use prost::Message;

use super::*;

use dflash_proto::testing::{item_request, patterned_bytes as data};

/// `bytes` as a rope of chunks cut at `cuts` (sorted positions).
fn chunked(bytes: &Bytes, cuts: &[usize]) -> Rope {
    let mut rope = Rope::new();
    let mut start = 0;
    for &cut in cuts {
        rope.push(bytes.slice(start..cut));
        start = cut;
    }
    rope.push(bytes.slice(start..));
    rope
}

/// Ours and prost's decoding of the same bytes agree: both fail, or both
/// give the same message.
fn agrees_with_prost(bytes: &Bytes, cuts: &[usize]) -> Result<(), String> {
    let ours = decode_produce_request(chunked(bytes, cuts));
    let prosts = proto::ProduceRequest::decode(bytes.clone());
    match (ours, prosts) {
        (Ok(ours), Ok(prosts)) if ours.to_proto() == prosts => Ok(()),
        (Err(_), Err(_)) => Ok(()),
        (ours, prosts) => Err(format!(
            "cuts {cuts:?}: ours {:?}, prost's {prosts:?}",
            ours.map(|message| message.to_proto())
        )),
    }
}

/// An item with a large and a small tensor, cut into two chunks at every
/// position: the same message as prost's decoding of the whole.
#[test]
fn an_item_split_at_every_boundary_decodes_as_prost_does() {
    let request = item_request(7, &[12, LARGE_PAYLOAD_BYTES + 100]);
    let bytes = Bytes::from(request.encode_to_vec());
    for cut in 0..=bytes.len() {
        agrees_with_prost(&bytes, &[cut]).unwrap();
        let ProduceIn::Item(item) = decode_produce_request(chunked(&bytes, &[cut])).unwrap() else {
            panic!("an item")
        };
        assert_eq!(item.to_proto(), *item_of(&request));
    }
}

fn item_of(request: &proto::ProduceRequest) -> &proto::Item {
    match &request.kind {
        Some(proto::produce_request::Kind::Item(item)) => item,
        _ => panic!("an item"),
    }
}

fn range_of(bytes: &Bytes) -> std::ops::Range<usize> {
    bytes.as_ptr() as usize..bytes.as_ptr() as usize + bytes.len()
}

/// A large payload in one frame is a slice of that frame; one across
/// frames is the slices of those frames: never a copy. A small one is
/// copied (it must not keep a frame alive).
#[test]
fn large_payloads_stay_in_the_frames_they_arrived_in() {
    let request = item_request(1, &[100, 1 << 20]);
    let bytes = Bytes::from(request.encode_to_vec());
    let frame = range_of(&bytes);
    let ProduceIn::Item(item) = decode_produce_request(chunked(&bytes, &[])).unwrap() else {
        panic!("an item")
    };
    let tensors = &item.sample.as_ref().unwrap().tensors;
    let large: Vec<&Bytes> = tensors[1].data.chunks().collect();
    assert_eq!(large.len(), 1);
    assert!(frame.contains(&(large[0].as_ptr() as usize)), "copied");
    let small = tensors[0].data.chunks().next().unwrap();
    assert!(
        !frame.contains(&(small.as_ptr() as usize)),
        "small data kept the frame"
    );
    assert_eq!(item.sample.as_ref().unwrap().spanning_tensors(), 0);

    // Cut into 1 MiB frames at arbitrary offsets: each piece of the payload
    // lies in the frame it came in.
    let cuts = [1000, 300_000, (1 << 20) - 7];
    let rope = chunked(&bytes, &cuts);
    let frames: Vec<std::ops::Range<usize>> = rope.chunks().map(range_of).collect();
    let ProduceIn::Item(item) = decode_produce_request(rope).unwrap() else {
        panic!("an item")
    };
    let sample = item.sample.as_ref().unwrap();
    assert_eq!(sample.spanning_tensors(), 1);
    assert_eq!(sample.tensors[1].data.chunk_count(), 4);
    for chunk in sample.tensors[1].data.chunks() {
        assert!(
            frames
                .iter()
                .any(|frame| frame.contains(&(chunk.as_ptr() as usize))),
            "a chunk was copied"
        );
    }
    assert_eq!(item.to_proto(), *item_of(&request));
}

/// The encoding written back (pieces, and the log's one buffer) is prost's.
#[test]
fn encoding_is_prosts_bytes() {
    let request = item_request(3, &[0, 5, LARGE_PAYLOAD_BYTES * 3]);
    let bytes = Bytes::from(request.encode_to_vec());
    let cuts = [40, 20_000, 20_001];
    let ProduceIn::Item(item) = decode_produce_request(chunked(&bytes, &cuts)).unwrap() else {
        panic!("an item")
    };
    let expected = item_of(&request).encode_to_vec();
    assert_eq!(item.encoded_len(), expected.len());
    assert_eq!(item.encode_to_vec().unwrap(), expected);
    for seq in [0, 1, u64::MAX] {
        let item = WireItem {
            seq,
            sample: None,
            trace_context: HashMap::new(),
        };
        assert_eq!(
            item.encode_to_vec().unwrap(),
            item.to_proto().encode_to_vec()
        );
    }
}

/// Hello, stats, an empty message, and prost's merge rules: a second item
/// field merges into the first (tensors append, the last seq wins), a
/// different variant replaces it, unknown fields are skipped.
#[test]
fn other_messages_and_merge_rules_follow_prost() {
    let hello = proto::ProduceRequest {
        kind: Some(proto::produce_request::Kind::Hello(proto::ProducerHello {
            target_id: "target-0".into(),
            run_id: "run-1".into(),
        })),
    };
    let stats = proto::ProduceRequest {
        kind: Some(proto::produce_request::Kind::Stats(proto::ProducerStats {
            tokens_per_second: 12.5,
            device: "cpu".into(),
            samples_done: 4,
            ..Default::default()
        })),
    };
    let empty = proto::ProduceRequest { kind: None };
    let first = item_request(1, &[10]).encode_to_vec();
    let second = item_request(2, &[LARGE_PAYLOAD_BYTES]).encode_to_vec();
    let mut unknown = Vec::new();
    encoding::uint64::encode(9, &77, &mut unknown);
    encoding::string::encode(15, &"skip me".to_string(), &mut unknown);
    let concatenations: Vec<Vec<u8>> = vec![
        hello.encode_to_vec(),
        stats.encode_to_vec(),
        empty.encode_to_vec(),
        [first.clone(), second.clone()].concat(),
        [first.clone(), hello.encode_to_vec()].concat(),
        [hello.encode_to_vec(), first.clone()].concat(),
        [unknown.clone(), first.clone(), unknown.clone()].concat(),
    ];
    for bytes in concatenations {
        let bytes = Bytes::from(bytes);
        for cut in [0, 1, bytes.len() / 3, bytes.len() / 2, bytes.len()] {
            let cut = cut.min(bytes.len());
            agrees_with_prost(&bytes, &[cut]).unwrap();
        }
    }
    let merged = Bytes::from([first, second].concat());
    let ProduceIn::Item(item) = decode_produce_request(chunked(&merged, &[])).unwrap() else {
        panic!("an item")
    };
    assert_eq!(item.seq, 2);
    assert_eq!(item.sample.unwrap().tensors.len(), 2);
}

/// A trace context entry under another wire type than length-delimited
/// is refused, as prost refuses it (fuzz target `broker_produce` found the
/// decoder merging it: tests/fuzz/corpus/broker_produce/crash-*).
#[test]
fn a_trace_context_entry_of_another_wire_type_is_refused_as_prost_refuses_it() {
    let mut entry = Vec::new();
    encoding::string::encode(1, &"traceparent".to_string(), &mut entry);
    encoding::string::encode(2, &"00-ab-cd-01".to_string(), &mut entry);
    for wire_type in [WireType::Varint, WireType::EndGroup, WireType::ThirtyTwoBit] {
        let mut item = Vec::new();
        encoding::encode_key(ITEM_TRACE_CONTEXT, wire_type, &mut item);
        encoding::encode_varint(entry.len() as u64, &mut item);
        item.extend_from_slice(&entry);
        let mut request = Vec::new();
        encoding::bytes::encode(PRODUCE_REQUEST_ITEM, &item, &mut request);
        let bytes = Bytes::from(request);
        agrees_with_prost(&bytes, &[]).unwrap();
        assert!(decode_produce_request(chunked(&bytes, &[])).is_err());
    }
}

/// Bad protobuf gets an error naming the field and the value.
#[test]
fn malformed_items_name_the_field() {
    // An item field (2) sent as a varint.
    let mut bytes = Vec::new();
    encoding::uint64::encode(2, &5, &mut bytes);
    let error = decode_produce_request(chunked(&Bytes::from(bytes), &[])).unwrap_err();
    assert!(
        error
            .to_string()
            .contains("ProduceRequest.item has wire type Varint"),
        "{error}"
    );
    // A tensor whose data declares more bytes than its message holds.
    let mut tensor = Vec::new();
    encoding::encode_key(4, WireType::LengthDelimited, &mut tensor);
    encoding::encode_varint(1000, &mut tensor);
    tensor.extend_from_slice(&[1, 2, 3]);
    let mut sample = Vec::new();
    encoding::bytes::encode(1, &tensor, &mut sample);
    let mut item = Vec::new();
    encoding::bytes::encode(2, &sample, &mut item);
    let mut request = Vec::new();
    encoding::bytes::encode(2, &item, &mut request);
    let error = decode_produce_request(chunked(&Bytes::from(request), &[])).unwrap_err();
    assert_eq!(
        error.to_string(),
        "Tensor.data declares 1000 bytes, but only 3 remain in its message"
    );
    let status = tonic::Status::from(crate::rpc_error::RpcError::InvalidProduceMessage {
        message_number: 4,
        failure: error,
    });
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(status
        .message()
        .starts_with("Produce message 4 is not a valid ProduceRequest"));
}

fn arbitrary_request() -> impl Strategy<Value = proto::ProduceRequest> {
    let tensor = (
        "[a-z_]{0,12}",
        0i32..9,
        prop::collection::vec(0u64..70_000, 0..3),
        prop_oneof![
            0usize..64,
            (LARGE_PAYLOAD_BYTES - 2)..(LARGE_PAYLOAD_BYTES + 40_000)
        ],
        any::<u8>(),
    )
        .prop_map(|(name, dtype, shape, size, seed)| proto::Tensor {
            name,
            dtype,
            shape,
            data: data(size, seed),
        });
    let item = (
        any::<u64>(),
        prop::option::of(prop::collection::vec(tensor, 0..3)),
        prop::collection::hash_map("[a-z]{0,6}", "[a-z0-9-]{0,10}", 0..3),
    )
        .prop_map(|(seq, tensors, trace_context)| proto::Item {
            seq,
            sample: tensors.map(|tensors| proto::Sample { tensors }),
            trace_context,
        });
    prop_oneof![
        item.prop_map(|item| Some(proto::produce_request::Kind::Item(item))),
        ("[a-z0-9-]{0,10}", "[a-z0-9-]{0,10}").prop_map(|(target_id, run_id)| Some(
            proto::produce_request::Kind::Hello(proto::ProducerHello { target_id, run_id })
        )),
        (any::<f64>(), any::<u64>()).prop_map(|(tokens_per_second, samples_done)| Some(
            proto::produce_request::Kind::Stats(proto::ProducerStats {
                tokens_per_second,
                samples_done,
                ..Default::default()
            })
        )),
        Just(None),
    ]
    .prop_map(|kind| proto::ProduceRequest { kind })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Any message, cut into frames anywhere: prost's message, and the
    /// encoding written back is prost's.
    #[test]
    fn any_message_cut_anywhere_decodes_as_prost_does(
        request in arbitrary_request(),
        cut_fractions in prop::collection::vec(0.0f64..1.0, 0..6),
    ) {
        let bytes = Bytes::from(request.encode_to_vec());
        let mut cuts: Vec<usize> = cut_fractions
            .iter()
            .map(|fraction| (fraction * bytes.len() as f64) as usize)
            .collect();
        cuts.sort_unstable();
        let decoded = decode_produce_request(chunked(&bytes, &cuts)).unwrap();
        prop_assert_eq!(decoded.to_proto(), request.clone());
        if let ProduceIn::Item(item) = decoded {
            // The same map (prost writes a map in its iteration order).
            prop_assert_eq!(item.encode_to_vec().unwrap(), item.to_proto().encode_to_vec());
            prop_assert_eq!(item.encoded_len(), item_of(&request).encoded_len());
        }
    }

    /// Damaged bytes (flipped, cut short, garbage): never a panic, and
    /// failure or success exactly when prost fails or succeeds, with the
    /// same message.
    #[test]
    fn damaged_bytes_agree_with_prost_and_never_panic(
        request in arbitrary_request(),
        flips in prop::collection::vec((0.0f64..1.0, any::<u8>()), 0..4),
        keep in 0.0f64..=1.0,
        cut in 0.0f64..1.0,
    ) {
        let mut bytes = request.encode_to_vec();
        for (position, value) in flips {
            if !bytes.is_empty() {
                let last = bytes.len() - 1;
                let index = ((position * bytes.len() as f64) as usize).min(last);
                bytes[index] = value;
            }
        }
        bytes.truncate((keep * bytes.len() as f64) as usize);
        let bytes = Bytes::from(bytes);
        let cut = (cut * bytes.len() as f64) as usize;
        prop_assert!(agrees_with_prost(&bytes, &[cut]).is_ok(), "{:?}", agrees_with_prost(&bytes, &[cut]));
    }
}
