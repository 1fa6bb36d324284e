//! The node's TLS state: its certificate material and the client
//! configuration built from it, replaced on SIGHUP (new connections use the
//! new material; live ones keep theirs; bad new material is refused and the
//! old one kept).

use std::sync::Arc;

use cluster_config::TlsFiles;
use cluster_config::tls::{ALPN, Material, Reloadable, TlsError};
use engram_sync::RwLock;

/// A node's certificate and the client configuration of its donor connections.
#[derive(Debug)]
pub struct NodeTls {
    files: RwLock<TlsFiles>,
    material: Reloadable,
    client: RwLock<Arc<rustls::ClientConfig>>,
}

impl NodeTls {
    /// Load `files` and build the client configuration (ALPN `engram/1`).
    pub fn load(files: &TlsFiles) -> Result<Arc<Self>, TlsError> {
        let material = Reloadable::load(files)?;
        let client = material.get().client_config(&[ALPN])?;
        Ok(Arc::new(Self {
            files: RwLock::new(files.clone()),
            material,
            client: RwLock::new(client),
        }))
    }

    /// Load `files` again; on any problem the old material stays.
    pub fn reload(&self, files: &TlsFiles) -> Result<Arc<Material>, TlsError> {
        let m = self.material.reload(files)?;
        let client = m.client_config(&[ALPN])?;
        *self.client.write() = client;
        *self.files.write() = files.clone();
        Ok(m)
    }

    /// The client configuration new connections use.
    pub fn client_config(&self) -> Arc<rustls::ClientConfig> {
        Arc::clone(&self.client.read())
    }

    /// The material now.
    pub fn material(&self) -> Arc<Material> {
        self.material.get()
    }

    /// The files it was last loaded from.
    pub fn files(&self) -> TlsFiles {
        self.files.read().clone()
    }
}
