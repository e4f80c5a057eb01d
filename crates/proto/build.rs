//! Compiles the protos with protox (there is no protoc on our machines).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let files = [
        "opendsec/v1/opendsec.proto",
        "opendsec/v1/iam.proto",
        "opendsec/v1/cluster.proto",
        "opendsec/v1/runtime.proto",
    ];
    for f in &files {
        println!("cargo:rerun-if-changed={}", root.join(f).display());
    }
    let fds = protox::compile(files, [&root])?;
    let descriptors = prost::Message::encode_to_vec(&fds);
    tonic_prost_build::configure().compile_fds(fds)?;
    // Canonical proto3 JSON (serde) for every message: proto field names, enums by name,
    // 64-bit integers as strings, every field present (defaults too), for `--json` output and
    // the gateways.
    pbjson_build::Builder::new()
        .register_descriptors(&descriptors)?
        .preserve_proto_field_names()
        .emit_fields()
        .build(&[".opendsec.v1"])?;
    Ok(())
}
