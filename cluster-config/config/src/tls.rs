//! TLS material both daemons share: a host's certificate, key and the rack
//! CA loaded and checked, rustls configurations built from them (TLS 1.3
//! only, the ring provider, mutual authentication), the identity a peer's
//! certificate proves, and a holder that a SIGHUP reloads without ever
//! replacing good material with bad.
//!
//! Identities are DNS names: the first dNSName of a certificate's subject
//! alternative names is its holder's name in the config (a donor, a node
//! or an operator). `engram-cluster pki issue` writes certificates that way.

use std::path::Path;
use std::sync::Arc;

use engram_sync::RwLock;
use rustls::RootCertStore;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::sign::CertifiedKey;
use thiserror::Error;

use crate::TlsFiles;

/// The ALPN protocol of the data plane over TLS and QUIC.
pub const ALPN: &[u8] = b"engram/1";

/// Largest PEM file read (a certificate chain or a key).
pub const MAX_PEM_BYTES: u64 = 1 << 20;

/// Why TLS material was not accepted.
#[derive(Debug, Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("{path}: {message}")]
    File {
        /// The file.
        path: String,
        /// Why it could not be read or is refused.
        message: String,
    },
    /// The material is unusable (no certificate, a key of another certificate...).
    #[error("{path}: {message}")]
    Invalid {
        /// The certificate or key file at fault.
        path: String,
        /// Why the material is unusable.
        message: String,
    },
    /// rustls refused to build a configuration.
    #[error("TLS configuration: {0}")]
    Config(String),
}

/// A private key file must be its owner's alone: one that its group or
/// others may read or write is refused, with the command that fixes it.
fn private(path: &Path) -> Result<(), TlsError> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path)
        .map_err(|e| TlsError::File {
            path: path.display().to_string(),
            message: e.to_string(),
        })?
        .permissions()
        .mode();
    if mode & 0o077 != 0 {
        return Err(TlsError::File {
            path: path.display().to_string(),
            message: format!(
                "a private key open to its group or others (mode {:o}): run `chmod 600 {}`",
                mode & 0o777,
                path.display()
            ),
        });
    }
    Ok(())
}

fn read_pem(path: &Path) -> Result<Vec<u8>, TlsError> {
    use std::io::Read;
    let err = |message: String| TlsError::File {
        path: path.display().to_string(),
        message,
    };
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .map_err(|e| err(e.to_string()))?
        .take(MAX_PEM_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| err(e.to_string()))?;
    if bytes.len() as u64 > MAX_PEM_BYTES {
        return Err(err(format!("larger than {MAX_PEM_BYTES} bytes")));
    }
    Ok(bytes)
}

fn certs(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let invalid = |message: String| TlsError::Invalid {
        path: path.display().to_string(),
        message,
    };
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(format!("not a PEM certificate: {e}")))?;
    if certs.is_empty() {
        return Err(invalid("holds no certificate".into()));
    }
    Ok(certs)
}

/// The crypto provider of every TLS configuration here (ring).
/// AES-128-GCM first: a rack's rows need no more than 128-bit keys, and
/// it is the cheapest suite per byte on CPUs with AES instructions.
pub fn provider() -> Arc<CryptoProvider> {
    use rustls::crypto::ring::cipher_suite as cs;
    let mut p = rustls::crypto::ring::default_provider();
    p.cipher_suites = vec![
        cs::TLS13_AES_128_GCM_SHA256,
        cs::TLS13_AES_256_GCM_SHA384,
        cs::TLS13_CHACHA20_POLY1305_SHA256,
    ];
    Arc::new(p)
}

/// One host's loaded and checked TLS material. Its `Debug` shows where it
/// came from and whom it names, never the key.
#[derive(Clone)]
pub struct Material {
    /// Where it came from.
    pub files: TlsFiles,
    /// The host's certificate chain (its own certificate first).
    pub chain: Vec<CertificateDer<'static>>,
    /// The rack CA's certificates.
    pub ca: Vec<CertificateDer<'static>>,
    /// The PEM texts, for libraries that take PEM (tonic's client).
    pub cert_pem: Vec<u8>,
    /// The key, PEM.
    pub key_pem: Vec<u8>,
    /// The CA, PEM.
    pub ca_pem: Vec<u8>,
    /// The name the certificate proves (its first dNSName).
    pub identity: String,
    key: Arc<PrivateKeyDer<'static>>,
}

impl std::fmt::Debug for Material {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Material")
            .field("identity", &self.identity)
            .field("files", &self.files)
            .finish_non_exhaustive()
    }
}

impl Material {
    /// Load `files` and check them: the key is the certificate's, the
    /// certificate chains to the CA and is valid now, and it names a host.
    pub fn load(files: &TlsFiles) -> Result<Self, TlsError> {
        private(&files.key)?;
        let (cert_pem, key_pem, ca_pem) = (
            read_pem(&files.cert)?,
            read_pem(&files.key)?,
            read_pem(&files.ca)?,
        );
        let chain = certs(&files.cert, &cert_pem)?;
        let ca = certs(&files.ca, &ca_pem)?;
        let key_path = files.key.display().to_string();
        let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| TlsError::Invalid {
            path: key_path.clone(),
            message: format!("not a PEM private key: {e}"),
        })?;
        let signer = provider()
            .key_provider
            .load_private_key(key.clone_key())
            .map_err(|e| TlsError::Invalid {
                path: key_path.clone(),
                message: format!("unusable key: {e}"),
            })?;
        CertifiedKey::new(chain.clone(), signer)
            .keys_match()
            .map_err(|e| TlsError::Invalid {
                path: key_path,
                message: format!("this key is not the key of {}: {e}", files.cert.display()),
            })?;
        let cert_path = files.cert.display().to_string();
        let identity = identity(&chain[0]).ok_or_else(|| TlsError::Invalid {
            path: cert_path.clone(),
            message: "the certificate names no host (no dNSName subject alternative name)".into(),
        })?;
        let m = Self {
            files: files.clone(),
            chain,
            ca,
            cert_pem,
            key_pem,
            ca_pem,
            identity,
            key: Arc::new(key),
        };
        // Our own certificate must pass what peers will check.
        m.client_verifier()?
            .verify_client_cert(&m.chain[0], &m.chain[1..], UnixTime::now())
            .map_err(|e| TlsError::Invalid {
                path: cert_path,
                message: format!(
                    "does not verify against the rack CA {}: {e}",
                    files.ca.display()
                ),
            })?;
        Ok(m)
    }

    fn roots(&self) -> Result<RootCertStore, TlsError> {
        let mut roots = RootCertStore::empty();
        for c in &self.ca {
            roots.add(c.clone()).map_err(|e| TlsError::Invalid {
                path: self.files.ca.display().to_string(),
                message: format!("not a usable CA certificate: {e}"),
            })?;
        }
        Ok(roots)
    }

    /// Check a client's certificate chain (as a connection reported it)
    /// against this material's CA at the time `now`: the check a full
    /// handshake makes, for a session that is already open (a new CA, or
    /// the certificate's expiry, must reach it).
    pub fn verify_client_chain(
        &self,
        chain: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<(), String> {
        let (end, intermediates) = chain.split_first().ok_or("no certificate")?;
        self.client_verifier()
            .map_err(|e| e.to_string())?
            .verify_client_cert(end, intermediates, now)
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    fn client_verifier(
        &self,
    ) -> Result<Arc<dyn rustls::server::danger::ClientCertVerifier>, TlsError> {
        WebPkiClientVerifier::builder_with_provider(Arc::new(self.roots()?), provider())
            .build()
            .map_err(|e| TlsError::Config(e.to_string()))
    }

    /// A server configuration: TLS 1.3, client certificates required and
    /// chained to the rack CA, ALPN `alpn` (none when empty). Which names
    /// may connect is the caller's check, after the handshake
    /// ([`peer_identity`]).
    pub fn server_config(&self, alpn: &[&[u8]]) -> Result<Arc<rustls::ServerConfig>, TlsError> {
        let mut c = rustls::ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| TlsError::Config(e.to_string()))?
            .with_client_cert_verifier(self.client_verifier()?)
            .with_single_cert(self.chain.clone(), self.key.clone_key())
            .map_err(|e| TlsError::Config(e.to_string()))?;
        c.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        // No resumption: a resumed session is not verified again (its
        // client certificate could have expired, been revoked by a new CA,
        // or left `clients` since), so every connection, TLS or QUIC, makes
        // a full handshake with the certificate checked against the CA,
        // names and time of now. What that costs: docs/security.md.
        c.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
        c.send_tls13_tickets = 0;
        c.max_early_data_size = 0;
        // The data plane seals and opens its records itself, in place
        // (crate::records), with the keys rustls hands over.
        c.enable_secret_extraction = true;
        Ok(Arc::new(c))
    }

    /// A client configuration: TLS 1.3, the rack CA as the only root, this
    /// host's certificate as its client certificate, ALPN `alpn`.
    pub fn client_config(&self, alpn: &[&[u8]]) -> Result<Arc<rustls::ClientConfig>, TlsError> {
        let mut c = rustls::ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| TlsError::Config(e.to_string()))?
            .with_root_certificates(self.roots()?)
            .with_client_auth_cert(self.chain.clone(), self.key.clone_key())
            .map_err(|e| TlsError::Config(e.to_string()))?;
        c.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        c.enable_secret_extraction = true;
        Ok(Arc::new(c))
    }

    /// A gRPC client's TLS settings for the control plane of `server` (a
    /// donor's name, checked against its certificate): the rack CA as the
    /// only root, this host's certificate as its client certificate.
    pub fn grpc_client(&self, server: &str) -> tonic::transport::ClientTlsConfig {
        use tonic::transport::{Certificate, ClientTlsConfig, Identity};
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca_pem))
            .identity(Identity::from_pem(&self.cert_pem, &self.key_pem))
            .domain_name(server)
    }
}

/// The dNSName subject alternative names of a certificate, in order.
pub fn dns_names(cert: &CertificateDer<'_>) -> Vec<String> {
    use x509_parser::extensions::GeneralName;
    let Ok((_, x)) = x509_parser::parse_x509_certificate(cert.as_ref()) else {
        return Vec::new();
    };
    let Ok(Some(san)) = x.subject_alternative_name() else {
        return Vec::new();
    };
    san.value
        .general_names
        .iter()
        .filter_map(|n| match n {
            GeneralName::DNSName(d) => Some(d.to_string()),
            _ => None,
        })
        .collect()
}

/// The name a certificate proves: its first dNSName, in the one form every
/// comparison uses ([`normalize`]).
pub fn identity(cert: &CertificateDer<'_>) -> Option<String> {
    dns_names(cert).into_iter().next().map(|n| normalize(&n))
}

/// A host name in the form identities are compared in: DNS names are
/// case-blind, so ASCII lower case (the config's `check` refuses two names
/// that differ only in case, so this never joins two hosts).
pub fn normalize(name: &str) -> String {
    name.to_ascii_lowercase()
}

/// Whether `identity` (from a certificate) names the config's `name`.
pub fn same_identity(identity: &str, name: &str) -> bool {
    identity.eq_ignore_ascii_case(name)
}

/// The identity of a verified peer, from its certificate chain as a TLS
/// connection reports it (`None` when it presented none).
pub fn peer_identity(chain: Option<&[CertificateDer<'_>]>) -> Option<String> {
    chain.and_then(|c| c.first()).and_then(identity)
}

/// The server name a client checks a donor's certificate against.
pub fn server_name(name: &str) -> Result<ServerName<'static>, TlsError> {
    ServerName::try_from(name.to_string()).map_err(|e| TlsError::Config(format!("{name:?}: {e}")))
}

/// A host's TLS material, replaceable while running: a reload loads and
/// checks the files again and swaps them in only if they pass, so new
/// connections use new material and live ones keep theirs.
#[derive(Debug)]
pub struct Reloadable {
    current: RwLock<Arc<Material>>,
}

impl Reloadable {
    /// Load `files` now.
    pub fn load(files: &TlsFiles) -> Result<Self, TlsError> {
        Ok(Self {
            current: RwLock::new(Arc::new(Material::load(files)?)),
        })
    }

    /// The material now.
    pub fn get(&self) -> Arc<Material> {
        Arc::clone(&self.current.read())
    }

    /// Load `files` again (they may be new paths); on any problem the old
    /// material stays and the error says why.
    pub fn reload(&self, files: &TlsFiles) -> Result<Arc<Material>, TlsError> {
        let m = Arc::new(Material::load(files)?);
        *self.current.write() = Arc::clone(&m);
        Ok(m)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use rcgen::{
        BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    };

    struct Ca {
        pem: String,
        issuer: Issuer<'static, KeyPair>,
    }

    fn ca() -> Ca {
        let mut p = CertificateParams::new(Vec::<String>::new()).expect("params");
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let key = KeyPair::generate().expect("key");
        let cert = p.self_signed(&key).expect("self-signed");
        Ca {
            pem: cert.pem(),
            issuer: Issuer::new(p, key),
        }
    }

    fn leaf(ca: &Ca, name: &str) -> (String, String) {
        let mut p = CertificateParams::new(vec![name.to_string()]).expect("params");
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().expect("key");
        let cert = p.signed_by(&key, &ca.issuer).expect("signed");
        (cert.pem(), key.serialize_pem())
    }

    fn write(dir: &Path, name: &str, ca: &Ca, pair: &(String, String)) -> TlsFiles {
        let f = TlsFiles {
            ca: dir.join("ca.pem"),
            cert: dir.join(format!("{name}.pem")),
            key: dir.join(format!("{name}.key")),
        };
        std::fs::write(&f.ca, &ca.pem).expect("write");
        std::fs::write(&f.cert, &pair.0).expect("write");
        write_key(&f.key, &pair.1);
        f
    }

    /// A key file as `pki issue` writes one: its owner's alone.
    #[test]
    fn a_key_open_to_group_or_others_is_refused_with_the_fix() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let rack = ca();
        let files = write(dir.path(), "donor-a", &rack, &leaf(&rack, "donor-a"));
        Material::load(&files).expect("a 0600 key loads");
        for mode in [0o640, 0o604, 0o660] {
            std::fs::set_permissions(&files.key, std::fs::Permissions::from_mode(mode))
                .expect("chmod");
            let e = Material::load(&files).expect_err("an open key");
            let want = format!("(mode {mode:o}): run `chmod 600 {}`", files.key.display());
            assert!(e.to_string().contains(&want), "{e}");
        }
    }

    /// One handshake in memory between `client` and `server`; returns how
    /// it went (full or resumed) and how long it took.
    fn handshake(
        client: &Arc<rustls::ClientConfig>,
        server: &Arc<rustls::ServerConfig>,
    ) -> (rustls::HandshakeKind, std::time::Duration) {
        let t0 = std::time::Instant::now();
        let name = server_name("donor-a").expect("name");
        let mut c = rustls::ClientConnection::new(Arc::clone(client), name).expect("client");
        let mut s = rustls::ServerConnection::new(Arc::clone(server)).expect("server");
        let mut buf = Vec::new();
        for _ in 0..16 {
            buf.clear();
            while c.wants_write() {
                c.write_tls(&mut buf).expect("client writes");
            }
            let mut r = &buf[..];
            while !r.is_empty() {
                s.read_tls(&mut r).expect("server reads");
            }
            s.process_new_packets().expect("server handshake");
            buf.clear();
            while s.wants_write() {
                s.write_tls(&mut buf).expect("server writes");
            }
            let mut r = &buf[..];
            while !r.is_empty() {
                c.read_tls(&mut r).expect("client reads");
            }
            c.process_new_packets().expect("client handshake");
            if !c.is_handshaking() && !s.is_handshaking() && !s.wants_write() {
                break;
            }
        }
        assert!(!c.is_handshaking() && !s.is_handshaking(), "handshake done");
        (s.handshake_kind().expect("kind"), t0.elapsed())
    }

    /// A donor's and a node's material from one CA (the directory holds the files).
    pub(crate) fn donor_and_node() -> (tempfile::TempDir, Material, Material) {
        let dir = tempfile::tempdir().expect("tempdir");
        let rack = ca();
        let load = |name: &str| {
            Material::load(&write(dir.path(), name, &rack, &leaf(&rack, name))).expect(name)
        };
        let (donor, node) = (load("donor-a"), load("node-1"));
        (dir, donor, node)
    }

    #[test]
    fn a_donor_never_resumes_a_session_so_every_certificate_is_checked_again() {
        let (_dir, donor, node) = donor_and_node();
        let server = donor.server_config(&[b"x"]).expect("server");
        // The client keeps sessions (rustls' default): it would resume if
        // the donor let it.
        let client = node.client_config(&[b"x"]).expect("client");
        for _ in 0..3 {
            assert_eq!(handshake(&client, &server).0, rustls::HandshakeKind::Full);
        }
        // A server that allows resumption does resume with the same client:
        // the test would see it.
        let mut resuming = (*server).clone();
        resuming.session_storage = rustls::server::ServerSessionMemoryCache::new(16);
        resuming.send_tls13_tickets = 2;
        let resuming = Arc::new(resuming);
        let client = node.client_config(&[b"x"]).expect("client");
        assert_eq!(handshake(&client, &resuming).0, rustls::HandshakeKind::Full);
        assert_eq!(
            handshake(&client, &resuming).0,
            rustls::HandshakeKind::Resumed
        );
    }

    /// What resumption would save per connection (CPU time of both ends
    /// in one process, ECDSA P-256): printed, never asserted.
    /// `cargo test --release -p cluster-config resumption_cost -- --ignored --nocapture`
    #[test]
    #[ignore = "a measurement"]
    fn resumption_cost() {
        let (_dir, donor, node) = donor_and_node();
        let full = donor.server_config(&[b"x"]).expect("server");
        let mut resuming = (*full).clone();
        resuming.session_storage = rustls::server::ServerSessionMemoryCache::new(1024);
        resuming.send_tls13_tickets = 2;
        let resuming = Arc::new(resuming);
        let median = |server: &Arc<rustls::ServerConfig>, want: rustls::HandshakeKind| {
            let client = node.client_config(&[b"x"]).expect("client");
            let _ = handshake(&client, server);
            let mut t: Vec<_> = (0..501)
                .map(|_| {
                    let (kind, took) = handshake(&client, server);
                    assert_eq!(kind, want);
                    took
                })
                .collect();
            t.sort();
            t[t.len() / 2]
        };
        let f = median(&full, rustls::HandshakeKind::Full);
        let r = median(&resuming, rustls::HandshakeKind::Resumed);
        println!(
            "full handshake {:.0} us, resumed {:.0} us (median of 501): resumption saves {:.0} us",
            f.as_secs_f64() * 1e6,
            r.as_secs_f64() * 1e6,
            (f.as_secs_f64() - r.as_secs_f64()) * 1e6
        );
    }

    fn write_key(path: &Path, pem: &str) {
        use std::os::unix::fs::PermissionsExt;
        std::fs::write(path, pem).expect("write");
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    }

    #[test]
    fn material_is_checked_and_a_bad_reload_keeps_the_old() {
        let dir = tempfile::tempdir().expect("tempdir");
        let rack = ca();
        let files = write(dir.path(), "donor-a", &rack, &leaf(&rack, "donor-a"));
        let held = Reloadable::load(&files).expect("good material loads");
        assert_eq!(held.get().identity, "donor-a");
        held.get().server_config(&[ALPN]).expect("server config");
        held.get().client_config(&[ALPN]).expect("client config");

        // A certificate from another CA is refused, and the old one kept.
        let other = ca();
        std::fs::write(&files.cert, leaf(&other, "donor-a").0).expect("write");
        let e = held.reload(&files).expect_err("another CA");
        assert!(e.to_string().contains("key"), "{e}");
        let (cert, key) = leaf(&other, "donor-a");
        std::fs::write(&files.cert, cert).expect("write");
        std::fs::write(&files.key, key).expect("write");
        let e = held.reload(&files).expect_err("another CA");
        assert!(
            e.to_string()
                .contains("does not verify against the rack CA"),
            "{e}"
        );
        assert_eq!(held.get().identity, "donor-a");

        // A key of another certificate is refused.
        let (cert, _) = leaf(&rack, "donor-a");
        std::fs::write(&files.cert, cert).expect("write");
        let e = held.reload(&files).expect_err("mismatched key");
        assert!(e.to_string().contains("is not the key of"), "{e}");

        // Garbage is refused with the file's name.
        std::fs::write(&files.ca, "not pem").expect("write");
        let e = held.reload(&files).expect_err("garbage");
        assert!(e.to_string().contains("ca.pem"), "{e}");

        // A good new pair replaces the old one.
        let rack2 = ca();
        let files2 = write(dir.path(), "donor-a", &rack2, &leaf(&rack2, "donor-a"));
        held.reload(&files2).expect("new material");
        assert_eq!(held.get().ca_pem, rack2.pem.as_bytes());
        // Printing the material never prints the key.
        let shown = format!("{:?}", held.get());
        assert!(
            shown.contains("donor-a") && !shown.contains("PRIVATE KEY"),
            "{shown}"
        );
    }
}
