//! Compiles `dflash/v1/*.proto` with the pure-Rust `protox` (no protoc on the
//! machine needed) and generates tonic clients and servers. Payload fields are
//! `bytes::Bytes` so the broker relays tensors without copying them. The file
//! descriptor set is kept for server reflection (grpcurl).
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_files = ["dflash/v1/broker.proto"];
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
    tonic_prost_build::configure()
        .bytes(".")
        .file_descriptor_set_path(&descriptor_path)
        .compile_fds(descriptors)?;
    Ok(())
}
