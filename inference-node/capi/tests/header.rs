//! The committed header is what cbindgen makes of the library now. To
//! update it after changing the API: `ENGRAM_UPDATE_HEADER=1 cargo test -p
//! engram-rack-c --test header`.

use std::path::Path;

#[test]
fn header_is_current() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut made = Vec::new();
    cbindgen::Builder::new()
        .with_crate(dir)
        .with_config(config)
        .generate()
        .expect("cbindgen reads the crate")
        .write(&mut made);
    let path = dir.join("include/engram_rack.h");
    if std::env::var_os("ENGRAM_UPDATE_HEADER").is_some() {
        std::fs::write(&path, &made).expect("write the header");
    }
    let committed = std::fs::read(&path).unwrap_or_default();
    assert!(
        committed == made,
        "{} is not what cbindgen makes of src/lib.rs now: run \
         ENGRAM_UPDATE_HEADER=1 cargo test -p engram-rack-c --test header",
        path.display()
    );
}
