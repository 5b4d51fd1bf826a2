//! Every fuzz target's seed inputs, built from the broker's own encoders.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use dflash_proto::fuzzing::{schema_sample, ReceivedBody, Seed};
use dflash_proto::v1 as proto;
use prost::Message;

use super::model_files::{snapshot_requests, weights_file, F32Tensor};
use super::run_model::{model_checkpoint_input, model_sync_input, PINNED_CONFIG};
use crate::payload::WireItem;
use crate::run_model::checkpoint;
use crate::run_model::store::{ModelSyncState, Upload};

pub(super) fn hello(drafter_id: &str, config: &str) -> proto::SyncRequest {
    proto::SyncRequest {
        kind: Some(proto::sync_request::Kind::Hello(proto::SyncHello {
            drafter_id: drafter_id.to_string(),
            model_config_json: config.to_string(),
        })),
    }
}

pub(super) fn begin(kind: proto::SyncKind, steps: u64, samples: u64) -> proto::SyncRequest {
    proto::SyncRequest {
        kind: Some(proto::sync_request::Kind::Begin(proto::SyncBegin {
            kind: kind as i32,
            steps,
            samples,
            tokens: samples * 16,
        })),
    }
}

pub(super) fn commit(files: u32) -> proto::SyncRequest {
    proto::SyncRequest {
        kind: Some(proto::sync_request::Kind::Commit(proto::SyncCommit {
            files,
        })),
    }
}

/// bf16 bytes (truncated): what the broker refuses in a snapshot.
pub(super) fn bf16_bytes(values: impl IntoIterator<Item = f32>) -> Vec<u8> {
    values
        .into_iter()
        .flat_map(|value| ((value.to_bits() >> 16) as u16).to_le_bytes())
        .collect()
}

/// A snapshot's messages: begin (of `steps`), `config` and the model's
/// weights (`weight` [2, 3] and `bias` [3], f32 or, refused, bf16) as
/// files in chunks of `chunk_bytes`, commit.
pub(super) fn snapshot_messages(
    kind: proto::SyncKind,
    steps: u64,
    bf16: bool,
    scale: f32,
    chunk_bytes: usize,
    config: &str,
) -> Vec<proto::SyncRequest> {
    let tensors: Vec<F32Tensor> = [("bias", vec![3u64]), ("weight", vec![2, 3])]
        .into_iter()
        .map(|(name, shape)| {
            let elements = shape.iter().product::<u64>() as usize;
            let values = (0..elements)
                .map(|index| scale * (index as f32 - 2.5))
                .collect();
            (name.to_string(), shape, values)
        })
        .collect();
    let weights = if bf16 {
        let bytes: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(_, _, values)| bf16_bytes(values.iter().copied()))
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
            .iter()
            .zip(&bytes)
            .filter_map(|((name, shape, _), bytes)| {
                let shape = shape.iter().map(|&dim| dim as usize).collect();
                safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, shape, bytes)
                    .ok()
                    .map(|view| (name.clone(), view))
            })
            .collect();
        safetensors::serialize(views, None).unwrap_or_default()
    } else {
        weights_file(&tensors)
    };
    let begin = proto::SyncBegin {
        kind: kind as i32,
        steps,
        samples: 8 * steps,
        tokens: 128 * steps,
    };
    snapshot_requests(begin, config, Bytes::from(weights), chunk_bytes)
}

/// Seed inputs for the broker's fuzz bodies, from its own encoders and
/// prost's (the drafter's encoder of sync messages): Produce bodies of real
/// items cut several ways; sessions that send snapshots (a later and an
/// older step) and final snapshots, and ones that are refused (a bf16
/// snapshot among them); checkpoints written by the model's writer.
/// Seed segments for [`wal_segment`]: what a run's log holds (epochs,
/// accepted items, deliveries, acks, a dead letter, done), a snapshot, and
/// an aborted run.
pub(super) fn wal_seeds() -> Vec<Seed> {
    use crate::queue::JournalEntry;
    let item = |seq: u64| {
        let proto_item = proto::Item {
            seq,
            sample: Some(schema_sample(2, 4)),
            trace_context: Default::default(),
        };
        let encoded = proto_item.encode_to_vec();
        <Arc<WireItem> as crate::wal::DurablePayload>::decode_payload(&encoded).ok()
    };
    let target = |index: usize| -> Arc<str> { Arc::from(format!("target-{index}").as_str()) };
    let mut run = Vec::new();
    for index in 0..2 {
        run.push(JournalEntry::Epoch {
            target_id: target(index),
            epoch: 1,
        });
        for seq in 0..3 {
            if let Some(payload) = item(seq) {
                run.push(JournalEntry::Accepted {
                    target_id: target(index),
                    seq,
                    payload,
                });
            }
        }
        run.push(JournalEntry::Delivered {
            target_id: target(index),
            seq: 0,
            deliveries: 1,
        });
        run.push(JournalEntry::Acked {
            target_id: target(index),
            seq: 0,
        });
    }
    run.push(JournalEntry::Done {
        target_id: target(0),
    });
    let mut aborted = run.clone();
    aborted.push(JournalEntry::Aborted {
        reason: "target target-1 failed".to_string(),
    });
    let config = crate::BrokerConfig::for_targets(2);
    let fingerprint = config.log_config().shape.fingerprint();
    // The run's log compacted: the queue rebuilt from it, as a snapshot.
    let snapshot =
        crate::wal::replay_bytes::<Arc<WireItem>>(&crate::wal::encode_segment(fingerprint, &run))
            .map(|(recovered, _)| {
                crate::queue::Queue::recover(config.queue_config(), recovered, Instant::now())
                    .snapshot_entries()
            })
            .unwrap_or_default();
    [("run", run), ("aborted", aborted), ("snapshot", snapshot)]
        .into_iter()
        .map(|(name, entries)| Seed {
            target: "wal_segment",
            name: name.to_string(),
            bytes: crate::wal::encode_segment(fingerprint, &entries),
        })
        .collect()
}

pub fn seeds() -> Vec<Seed> {
    let mut seeds = wal_seeds();
    let item = |seq: u64, tokens: usize, width: usize| proto::ProduceRequest {
        kind: Some(proto::produce_request::Kind::Item(proto::Item {
            seq,
            sample: Some(schema_sample(tokens, width)),
            trace_context: [("traceparent".to_string(), "00-ab-cd-01".to_string())]
                .into_iter()
                .collect(),
        })),
    };
    let hello_message = proto::ProduceRequest {
        kind: Some(proto::produce_request::Kind::Hello(proto::ProducerHello {
            target_id: "target-0".into(),
            run_id: String::new(),
        })),
    };
    let stats = proto::ProduceRequest {
        kind: Some(proto::produce_request::Kind::Stats(
            proto::ProducerStats::default(),
        )),
    };
    let body =
        dflash_proto::fuzzing::framed_body(&[hello_message, item(1, 4, 8), stats, item(2, 2, 4)]);
    for (name, cut_byte) in [
        ("stream-one-frame", 0u8),
        ("stream-small-frames", 11),
        ("stream-wide-frames", 131),
    ] {
        seeds.push(Seed {
            target: "broker_produce",
            name: name.to_string(),
            bytes: ReceivedBody::input(0x80, cut_byte, &body),
        });
    }
    // A tensor of 16 KiB and more is kept as its frames' slices.
    let large = dflash_proto::fuzzing::framed_body(&[item(3, 2, LARGE_WIDTH)]);
    seeds.push(Seed {
        target: "broker_produce",
        name: "large-tensor-across-frames".to_string(),
        bytes: ReceivedBody::input(0x80 | 100, 150, &large),
    });
    let mut duplicate = item(4, 2, 2);
    if let Some(proto::produce_request::Kind::Item(item)) = &mut duplicate.kind {
        if let Some(sample) = &mut item.sample {
            let first = sample.tensors[0].clone();
            sample.tensors.push(first);
        }
    }
    seeds.push(Seed {
        target: "broker_produce",
        name: "duplicate-tensor".to_string(),
        bytes: ReceivedBody::input(0x80, 0, &dflash_proto::fuzzing::framed_body(&[duplicate])),
    });

    use proto::SyncKind;
    let config = PINNED_CONFIG;
    let mut snapshots = vec![(0, hello("drafter-0", config))];
    snapshots.extend(
        snapshot_messages(SyncKind::Snapshot, 0, false, 1.0, 40, config)
            .into_iter()
            .map(|message| (0, message)),
    );
    snapshots.push((1, hello("drafter-1", config)));
    snapshots.extend(
        snapshot_messages(SyncKind::Snapshot, 2, false, 0.5, 16, config)
            .into_iter()
            .map(|message| (0, message)),
    );
    // A member behind the others: not applied.
    snapshots.extend(
        snapshot_messages(SyncKind::FinalSnapshot, 1, false, -0.25, 7, config)
            .into_iter()
            .map(|message| (1, message)),
    );
    snapshots.extend(
        snapshot_messages(SyncKind::FinalSnapshot, 3, false, 0.125, 1 << 20, config)
            .into_iter()
            .map(|message| (0, message)),
    );
    snapshots.push((0x80, commit(0)));
    for (name, settings) in [("sessions-snapshots", 0u8), ("sessions-pinned", 8)] {
        seeds.push(Seed {
            target: "model_sync",
            name: name.to_string(),
            bytes: model_sync_input(settings, &snapshots),
        });
    }
    let mut refused = vec![(2, hello("drafter-2", config))];
    refused.extend(
        snapshot_messages(SyncKind::Snapshot, 0, false, 1.0, 24, config)
            .into_iter()
            .map(|message| (2, message)),
    );
    // A bf16 snapshot (refused: a snapshot is the f32 master weights).
    refused.push((0, hello("drafter-0", config)));
    refused.extend(
        snapshot_messages(SyncKind::Snapshot, 4, true, 1.0, 24, config)
            .into_iter()
            .map(|message| (0, message)),
    );
    // A snapshot of another shape, then a retired kind (JOIN, 1).
    let reshaped = weights_file(&[("bias".to_string(), vec![4], vec![1.0, 2.0, 3.0, 4.0])]);
    let reshaped = snapshot_requests(
        proto::SyncBegin {
            kind: SyncKind::Snapshot as i32,
            steps: 1,
            samples: 8,
            tokens: 128,
        },
        config,
        Bytes::from(reshaped),
        1 << 20,
    );
    refused.extend(reshaped.into_iter().map(|message| (2, message)));
    refused.push((3, hello("drafter-3", config)));
    let mut retired = begin(SyncKind::Snapshot, 1, 8);
    if let Some(proto::sync_request::Kind::Begin(begin)) = &mut retired.kind {
        begin.kind = 1;
    }
    refused.push((3, retired));
    // Another model (its config.json is not the pinned one).
    refused.push((1, hello("drafter-1", r#"{"model_type": "other"}"#)));
    refused.extend(
        snapshot_messages(
            SyncKind::Snapshot,
            5,
            false,
            1.0,
            24,
            r#"{"model_type": "other"}"#,
        )
        .into_iter()
        .map(|message| (1, message)),
    );
    seeds.push(Seed {
        target: "model_sync",
        name: "sessions-refused".to_string(),
        bytes: model_sync_input(8, &refused),
    });

    for (name, steps, with_state) in [
        ("model-plain", 1, true),
        ("model-later-step", 7, true),
        ("model-without-state", 1, false),
    ] {
        let Some(files) = seed_model_files(steps) else {
            continue;
        };
        let file = |wanted: &str| {
            files
                .iter()
                .find(|(name, _)| *name == wanted)
                .map_or(&[][..], |(_, bytes)| bytes.as_slice())
        };
        let mut parts = vec![
            file(checkpoint::CONFIG_FILE_NAME),
            file(checkpoint::MODEL_FILE_NAME),
        ];
        if with_state {
            parts.push(file(checkpoint::STATE_FILE_NAME));
        }
        seeds.push(Seed {
            target: "model_checkpoint",
            name: name.to_string(),
            bytes: model_checkpoint_input(&parts),
        });
    }
    seeds
}

/// Width of the seed item whose hidden states span frames (2 tokens of
/// bf16: 16 KiB and more).
pub(super) const LARGE_WIDTH: usize = 4200;

/// A model made by a snapshot of step 0 and one of `steps` through the
/// state machine, as the broker writes it.
pub(super) fn seed_model_files(steps: u64) -> Option<Vec<(&'static str, Vec<u8>)>> {
    let mut state = ModelSyncState::new(None);
    let now = Instant::now();
    for (steps, scale) in [(0, 1.0), (steps, 0.5)] {
        let messages = snapshot_messages(
            proto::SyncKind::Snapshot,
            steps,
            false,
            scale,
            16,
            PINNED_CONFIG,
        );
        let mut upload = None;
        for message in messages {
            match message.kind {
                Some(proto::sync_request::Kind::Begin(begin)) => upload = Upload::new(&begin).ok(),
                Some(proto::sync_request::Kind::FileChunk(chunk)) => {
                    upload.as_mut()?.add_file_chunk(chunk).ok()?;
                }
                Some(proto::sync_request::Kind::Commit(commit)) => {
                    let finite = upload.take()?.into_finite(commit.files).ok()?;
                    state.commit("drafter-0", finite, now).ok()?;
                }
                _ => {}
            }
        }
    }
    let model = state.model()?;
    checkpoint::encode_model_files(model).ok()
}
