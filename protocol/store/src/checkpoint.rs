//! Where a checkpoint's tensors are: a single safetensors file, a directory
//! holding `model.safetensors` or `model.safetensors.index.json`, or that
//! index itself (sharded checkpoints). One home for this, used by `pack`
//! (the Engram tables) and by the node's weight loader (fusion weights).

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

use thiserror::Error;

/// Largest `model.safetensors.index.json` read.
pub const MAX_INDEX_BYTES: u64 = 64 << 20;

/// Why a checkpoint's layout could not be read.
#[derive(Debug, Error)]
pub enum CheckpointError {
    /// Reading the index failed.
    #[error("{path}: {source}")]
    Io {
        /// The index file that could not be read.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The checkpoint is not laid out as expected.
    #[error("{path}: {reason}")]
    Layout {
        /// The checkpoint path (file, directory or index) at fault.
        path: PathBuf,
        /// What is not as expected.
        reason: String,
    },
}

/// A checkpoint's files: one, or shards named by an index.
#[derive(Debug, Clone)]
pub struct CheckpointFiles {
    /// The single file, or the directory shards are relative to.
    root: PathBuf,
    /// Tensor name -> shard file, for a sharded checkpoint.
    index: Option<BTreeMap<String, String>>,
}

impl CheckpointFiles {
    /// Read the layout of `path` (a file, a directory, or an index).
    pub fn open(path: &Path) -> Result<Self, CheckpointError> {
        let err = |reason: String| CheckpointError::Layout {
            path: path.to_path_buf(),
            reason,
        };
        let (root, index_path) = if path.is_dir() {
            let idx = path.join("model.safetensors.index.json");
            let single = path.join("model.safetensors");
            if idx.is_file() {
                (path.to_path_buf(), Some(idx))
            } else if single.is_file() {
                (single, None)
            } else {
                return Err(err(
                    "directory holds neither model.safetensors.index.json nor model.safetensors"
                        .into(),
                ));
            }
        } else if path.extension().is_some_and(|e| e == "json") {
            let dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
            (dir, Some(path.to_path_buf()))
        } else {
            (path.to_path_buf(), None)
        };
        let Some(idx) = index_path else {
            return Ok(Self { root, index: None });
        };
        let io = |source| CheckpointError::Io {
            path: idx.clone(),
            source,
        };
        let len = std::fs::metadata(&idx).map_err(io)?.len();
        if len > MAX_INDEX_BYTES {
            return Err(err(format!(
                "index is {len} bytes, more than the {MAX_INDEX_BYTES} accepted"
            )));
        }
        #[derive(serde::Deserialize)]
        struct Index {
            weight_map: BTreeMap<String, String>,
        }
        let text = std::fs::read(&idx).map_err(io)?;
        let parsed: Index = serde_json::from_slice(&text)
            .map_err(|e| err(format!("index is not valid JSON: {e}")))?;
        Ok(Self {
            root,
            index: Some(parsed.weight_map),
        })
    }

    /// The file holding tensor `name`; `None` when the index does not list
    /// it (a single file is assumed to hold every tensor).
    pub fn file_of(&self, name: &str) -> Result<Option<PathBuf>, CheckpointError> {
        let Some(index) = &self.index else {
            return Ok(Some(self.root.clone()));
        };
        let Some(file) = index.get(name) else {
            return Ok(None);
        };
        let rel = Path::new(file);
        if !rel.components().all(|c| matches!(c, Component::Normal(_))) {
            return Err(CheckpointError::Layout {
                path: self.root.clone(),
                reason: format!(
                    "index names shard {file:?}, which leaves the checkpoint directory"
                ),
            });
        }
        Ok(Some(self.root.join(rel)))
    }

    /// The file holding tensor `name`, or an error naming it.
    pub fn require(&self, name: &str) -> Result<PathBuf, CheckpointError> {
        self.file_of(name)?.ok_or_else(|| CheckpointError::Layout {
            path: self.root.clone(),
            reason: format!("index has no tensor `{name}`"),
        })
    }

    /// Every tensor name the index lists (`None` for a single file).
    pub fn indexed_names(&self) -> Option<Vec<String>> {
        self.index.as_ref().map(|i| i.keys().cloned().collect())
    }

    /// The file or directory this checkpoint was read from.
    pub fn root(&self) -> &Path {
        &self.root
    }
}

/// The `config.json` to check a checkpoint against: the one `named`, or
/// the one beside `checkpoint` where there is one (`None` otherwise).
pub fn config_to_check(checkpoint: &Path, named: Option<&Path>) -> Option<PathBuf> {
    match named {
        Some(p) => Some(p.to_path_buf()),
        None => Some(config_beside(checkpoint)).filter(|p| p.is_file()),
    }
}

/// Where a checkpoint's `config.json` is: in the checkpoint's directory
/// (the directory itself, or the one holding its file or index).
pub fn config_beside(checkpoint: &Path) -> PathBuf {
    let dir = if checkpoint.is_dir() {
        checkpoint
    } else {
        checkpoint.parent().unwrap_or(Path::new("."))
    };
    dir.join("config.json")
}

/// Read and parse the `config.json` at `path` (at most
/// [`MAX_CONFIG_BYTES`](engram_protocol::model_config::MAX_CONFIG_BYTES)).
pub fn read_model_config(
    path: &Path,
) -> Result<engram_protocol::model_config::ModelConfig, CheckpointError> {
    use engram_protocol::model_config::{MAX_CONFIG_BYTES, ModelConfig};
    let io = |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    };
    let len = std::fs::metadata(path).map_err(io)?.len();
    if len > MAX_CONFIG_BYTES {
        return Err(CheckpointError::Layout {
            path: path.to_path_buf(),
            reason: format!("{len} bytes, more than the {MAX_CONFIG_BYTES} accepted"),
        });
    }
    let bytes = std::fs::read(path).map_err(io)?;
    ModelConfig::parse(&bytes).map_err(|e| CheckpointError::Layout {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}
