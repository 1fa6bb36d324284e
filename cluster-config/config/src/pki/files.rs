//! File helpers of the PKI: bounded reads, and writes that give a file
//! its mode from creation and replace the old one by rename.

use std::fs::{DirBuilder, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;

use rcgen::KeyPair;

use super::{MAX_PEM_BYTES, PkiError};

pub(super) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> PkiError + '_ {
    move |source| PkiError::Io {
        path: path.to_path_buf(),
        source,
    }
}

pub(super) fn exists(path: &Path) -> bool {
    path.symlink_metadata().is_ok()
}

/// A file of at most [`MAX_PEM_BYTES`].
pub(super) fn read_capped(path: &Path) -> Result<Vec<u8>, PkiError> {
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .map_err(io(path))?
        .take(MAX_PEM_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(io(path))?;
    if bytes.len() as u64 > MAX_PEM_BYTES {
        return Err(PkiError::Invalid {
            path: path.to_path_buf(),
            why: format!("larger than the {MAX_PEM_BYTES} bytes a PEM file may have"),
        });
    }
    Ok(bytes)
}

/// The DER of the first certificate in a PEM file.
pub(super) fn read_pem_cert(path: &Path) -> Result<Vec<u8>, PkiError> {
    let bytes = read_capped(path)?;
    match x509_parser::pem::parse_x509_pem(&bytes) {
        Ok((_, pem)) if pem.label == "CERTIFICATE" => Ok(pem.contents),
        Ok((_, pem)) => Err(PkiError::Invalid {
            path: path.to_path_buf(),
            why: format!("holds a {:?}, not a CERTIFICATE", pem.label),
        }),
        Err(e) => Err(PkiError::Invalid {
            path: path.to_path_buf(),
            why: format!("not a PEM certificate: {e}"),
        }),
    }
}

/// A PEM (PKCS#8) private key.
pub(super) fn read_key(path: &Path) -> Result<KeyPair, PkiError> {
    let bytes = read_capped(path)?;
    std::str::from_utf8(&bytes)
        .ok()
        .and_then(|s| KeyPair::from_pem(s).ok())
        .ok_or_else(|| PkiError::Invalid {
            path: path.to_path_buf(),
            why: "not a PEM PKCS#8 private key".into(),
        })
}

/// Write `bytes` to `path` with `mode` from creation: into a new file
/// beside it, then renamed over it. Missing directories are made 0700.
pub(super) fn write_file(path: &Path, bytes: &[u8], mode: u32) -> Result<(), PkiError> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io(dir))?;
    }
    let name = path
        .file_name()
        .map_or_else(|| "file".into(), |n| n.to_string_lossy().into_owned());
    let tmp = dir.join(format!(".{name}.new"));
    // A leftover from an interrupted run; create_new below refuses anything else.
    let _ = std::fs::remove_file(&tmp);
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(io(&tmp))?;
    f.write_all(bytes).map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))
}
