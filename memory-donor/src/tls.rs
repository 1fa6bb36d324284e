//! The donor's TLS state: its certificate material (reloaded on SIGHUP)
//! and who may do what (from the config): which nodes may use the data
//! plane, which identities are nodes (health, ListTables, Stats on the
//! control plane) and which are operators (Drain, SwapTable too).

use std::sync::Arc;

use cluster_config::tls::{ALPN, Material, Reloadable, TlsError};
use cluster_config::{Config, TlsFiles};
use engram_sync::RwLock;

/// Who may do what on this donor.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Access {
    /// Identities allowed on the data plane (the donor's `clients`, or
    /// every node; and the donor itself, whose watchdog probes it).
    pub data_clients: Vec<String>,
    /// Every node of the rack (read-only control calls).
    pub nodes: Vec<String>,
    /// Operators (every control call).
    pub operators: Vec<String>,
}

impl Access {
    /// The access rules of donor `name` in `config`.
    pub fn from_config(config: &Config, name: &str) -> Self {
        let nodes: Vec<String> = config.nodes.iter().map(|n| n.name.clone()).collect();
        let mut data_clients = match config.donor(name) {
            Some(d) if !d.clients.is_empty() => d.clients.clone(),
            _ => nodes.clone(),
        };
        // The donor itself: its watchdog probes its own data plane.
        data_clients.push(name.to_string());
        Self {
            data_clients,
            nodes,
            operators: config
                .tls
                .as_ref()
                .map(|t| t.operators.clone())
                .unwrap_or_default(),
        }
    }
}

/// A plane a session lives on, for [`DonorTls::still_admits`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plane {
    /// Rows over TLS or QUIC.
    Data,
    /// The control plane.
    Control,
}

/// What an identity may do on the control plane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Health, ListTables, Stats.
    Node,
    /// Everything, Drain and SwapTable included.
    Operator,
}

/// The rustls server configurations built for one generation of material.
#[derive(Debug)]
struct ServerConfigs {
    material: Arc<Material>,
    data: Arc<rustls::ServerConfig>,
    control: Arc<rustls::ServerConfig>,
}

/// The donor's TLS state, shared by the data plane, the QUIC endpoint and
/// the control plane.
#[derive(Debug)]
pub struct DonorTls {
    material: Reloadable,
    built: RwLock<Arc<ServerConfigs>>,
    access: RwLock<Arc<Access>>,
}

fn build(material: Arc<Material>) -> Result<ServerConfigs, TlsError> {
    Ok(ServerConfigs {
        data: material.server_config(&[ALPN])?,
        control: material.server_config(&[b"h2"])?,
        material,
    })
}

impl DonorTls {
    /// Load `files` and build the configurations.
    pub fn load(files: &TlsFiles, access: Access) -> Result<Arc<Self>, TlsError> {
        let material = Reloadable::load(files)?;
        let built = build(material.get())?;
        Ok(Arc::new(Self {
            material,
            built: RwLock::new(Arc::new(built)),
            access: RwLock::new(Arc::new(access)),
        }))
    }

    /// Load the material again and take the new access rules; on a bad
    /// certificate or key the old material stays (the rules still change).
    pub fn reload(&self, files: &TlsFiles, access: Access) -> Result<Arc<Material>, TlsError> {
        *self.access.write() = Arc::new(access);
        let material = self.material.reload(files)?;
        let built = build(Arc::clone(&material))?;
        *self.built.write() = Arc::new(built);
        Ok(material)
    }

    fn built(&self) -> Arc<ServerConfigs> {
        Arc::clone(&self.built.read())
    }

    /// The material now.
    pub fn material(&self) -> Arc<Material> {
        Arc::clone(&self.built().material)
    }

    /// The data plane's server configuration now (ALPN `engram/1`).
    pub fn data_config(&self) -> Arc<rustls::ServerConfig> {
        Arc::clone(&self.built().data)
    }

    /// The control plane's server configuration now (ALPN `h2`).
    pub fn control_config(&self) -> Arc<rustls::ServerConfig> {
        Arc::clone(&self.built().control)
    }

    /// Whether a live session whose client showed `chain` may go on, on
    /// `plane`: its chain still verifies against the CA now loaded at this
    /// moment (not expired, not from a replaced CA), and its identity is
    /// still allowed there (a data client; on the control plane the gate
    /// checks the role itself). `Err` says why not.
    pub fn still_admits(
        &self,
        chain: &[rustls::pki_types::CertificateDer<'_>],
        plane: Plane,
    ) -> Result<String, String> {
        self.material()
            .verify_client_chain(chain, rustls::pki_types::UnixTime::now())
            .map_err(|e| format!("its certificate no longer verifies: {e}"))?;
        let identity = chain
            .first()
            .and_then(cluster_config::tls::identity)
            .ok_or("its certificate names no one")?;
        let allowed = match plane {
            Plane::Data => self.data_allowed(&identity),
            // Roles are the control gate's own check, made at every call.
            Plane::Control => true,
        };
        if allowed {
            Ok(identity)
        } else {
            Err(format!(
                "{identity} is no longer allowed on this donor's {plane:?} plane"
            ))
        }
    }

    /// The access rules now.
    pub fn access(&self) -> Arc<Access> {
        Arc::clone(&self.access.read())
    }

    /// May `identity` use the data plane?
    pub fn data_allowed(&self, identity: &str) -> bool {
        self.access()
            .data_clients
            .iter()
            .any(|c| cluster_config::tls::same_identity(identity, c))
    }

    /// What `identity` may do on the control plane, if anything.
    pub fn role(&self, identity: &str) -> Option<Role> {
        let a = self.access();
        if a.operators
            .iter()
            .any(|o| cluster_config::tls::same_identity(identity, o))
        {
            Some(Role::Operator)
        } else if a
            .nodes
            .iter()
            .any(|n| cluster_config::tls::same_identity(identity, n))
        {
            Some(Role::Node)
        } else {
            None
        }
    }
}
