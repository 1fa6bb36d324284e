//! With the `control` feature: compile the control-plane `.proto` with
//! protox (pure Rust, no protoc) and generate the tonic client and server.

fn main() {
    #[cfg(feature = "control")]
    control();
}

#[cfg(feature = "control")]
fn control() {
    const PROTO: &str = "proto/engram/control/v1/control.proto";
    println!("cargo:rerun-if-changed={PROTO}");
    let fds = match protox::compile([PROTO], ["proto"]) {
        Ok(fds) => fds,
        Err(e) => panic!("{PROTO}: {e}"),
    };
    if let Err(e) = tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .emit_rerun_if_changed(false)
        .compile_fds(fds)
    {
        panic!("generating code for {PROTO}: {e}");
    }
}
