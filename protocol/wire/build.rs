//! With the `control` feature: compile the control-plane and node API `.proto` files with
//! protox (pure Rust, no protoc) and generate the tonic client and server.

fn main() {
    #[cfg(feature = "control")]
    control();
}

#[cfg(feature = "control")]
fn control() {
    const PROTOS: [&str; 2] = [
        "proto/engram/control/v1/control.proto",
        "proto/engram/node/v1/node.proto",
    ];
    for p in PROTOS {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = match protox::compile(PROTOS, ["proto"]) {
        Ok(fds) => fds,
        Err(e) => panic!("{}: {e}", PROTOS.join(", ")),
    };
    if let Err(e) = tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .emit_rerun_if_changed(false)
        .compile_fds(fds)
    {
        panic!("generating code for {}: {e}", PROTOS.join(", "));
    }
}
