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
        "proto/opendsec/v1/raft.proto",
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
    // E2B's envd services (docs/e2b.md): messages only, served over the Connect protocol by
    // the gateway; JSON in proto3's canonical form (lowerCamelCase, unknown fields ignored).
    let e2b = [
        "proto/e2b/process/process.proto",
        "proto/e2b/filesystem/filesystem.proto",
    ];
    let e2b_descriptor = out.join("e2b_descriptor.bin");
    prost_build::Config::new()
        .compile_well_known_types()
        .extern_path(".google.protobuf", "::pbjson_types")
        .file_descriptor_set_path(&e2b_descriptor)
        .compile_protos(&e2b, &["proto/e2b"])?;
    let bytes = std::fs::read(&e2b_descriptor)?;
    pbjson_build::Builder::new()
        .register_descriptors(&bytes)?
        .ignore_unknown_fields()
        .build(&[".process", ".filesystem"])?;
    for f in files.iter().chain(e2b.iter()) {
        println!("cargo:rerun-if-changed={f}");
    }
    Ok(())
}
