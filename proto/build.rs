//! Compiles `dflash/v1/*.proto` with the pure-Rust `protox` (no protoc on the
//! machine needed) and generates tonic clients and servers. Payload fields are
//! `bytes::Bytes` so the broker relays tensors without copying them. The file
//! descriptor set is kept for server reflection (grpcurl).
use std::path::PathBuf;

/// Messages of the status snapshot, which derive `serde::Serialize`.
const STATUS_MESSAGES: [&str; 13] = [
    "dflash.v1.StatusSnapshot",
    "dflash.v1.TargetStatus",
    "dflash.v1.DrafterStatus",
    "dflash.v1.ProducerStats",
    "dflash.v1.ConsumerStats",
    "dflash.v1.Credit",
    "dflash.v1.DeadLetter",
    "dflash.v1.RunSummary",
    "dflash.v1.ModelSyncStatus",
    "dflash.v1.DrafterSyncStatus",
    "dflash.v1.TauPoint",
    "dflash.v1.LighthouseStatus",
    "dflash.v1.TraceExportStats",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_files = [
        "dflash/v1/broker.proto",
        "dflash/v1/model_sync.proto",
        "dflash/v1/lighthouse.proto",
    ];
    for file in proto_files {
        println!("cargo:rerun-if-changed={file}");
    }
    let descriptors = protox::compile(proto_files, ["."])?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    let descriptor_path = out_dir.join("dflash_descriptor.bin");
    std::fs::write(
        &descriptor_path,
        prost::Message::encode_to_vec(&descriptors),
    )?;
    let mut builder = tonic_prost_build::configure();
    // Status messages serialise to JSON (`dflash status --json`) with the
    // proto field names and enum values by name.
    for message in STATUS_MESSAGES {
        builder = builder.type_attribute(message, "#[derive(serde::Serialize)]");
    }
    builder
        .field_attribute(
            "dflash.v1.StatusSnapshot.state",
            "#[serde(serialize_with = \"crate::json::broker_state\")]",
        )
        .field_attribute(
            "dflash.v1.TargetStatus.state",
            "#[serde(serialize_with = \"crate::json::target_state\")]",
        )
        .bytes(".")
        // prost encoding into one exact-size buffer (src/codec.rs): no
        // reallocation copying a payload when small fields follow it.
        .codec_path("crate::codec::ExactCodec")
        .file_descriptor_set_path(&descriptor_path)
        .compile_fds(descriptors)?;
    Ok(())
}
