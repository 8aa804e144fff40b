// Compiles proto/opendsec/v1 into Rust with a vendored protoc (no system protoc needed), and
// generates protobuf-JSON serde impls (pbjson) so the CLI prints the canonical JSON form.
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    std::env::set_var("PROTOC", protoc);
    let files = [
        "proto/opendsec/v1/types.proto",
        "proto/opendsec/v1/runtime.proto",
        "proto/opendsec/v1/opendsec.proto",
        "proto/opendsec/v1/iam.proto",
        "proto/opendsec/v1/cluster.proto",
    ];
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let descriptor = out.join("opendsec_descriptor.bin");
    tonic_prost_build::configure()
        .file_descriptor_set_path(&descriptor)
        .compile_protos(&files, &["proto"])?;
    let bytes = std::fs::read(&descriptor)?;
    pbjson_build::Builder::new()
        .register_descriptors(&bytes)?
        .preserve_proto_field_names()
        .build(&[".opendsec"])?;
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    Ok(())
}
