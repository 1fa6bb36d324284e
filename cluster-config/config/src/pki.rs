//! The rack PKI: `engram-cluster pki init`, `pki issue`, and the
//! certificate check `engram-cluster check` runs.
//!
//! What it is: one rack CA (ECDSA P-256, made with rcgen) and, signed by
//! it, one certificate per donor, node and operator of the config, each
//! naming its host (and, for a donor, every IP it is dialled at), usable
//! as a TLS server and client. Keys are created mode 0600 and never exist
//! with looser permissions; files are replaced by rename, so a daemon
//! reloading on SIGHUP reads either the old file or the new one.
//!
//! What it is not: no revocation and no renewal daemon. Rotation is
//! `pki issue --force` and a SIGHUP; a host's key is trusted for as long as
//! its certificate is valid.
//!
//! Layers: file helpers (bounded reads, writes at a mode) -> [`init`] and
//! [`issue`] (rcgen) -> [`check`] (x509-parser), in `check.rs`.

mod check;
mod files;

pub use check::{EXPIRY_WARNING, Finding, Severity, check, check_at};

use std::fmt;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, PKCS_ECDSA_P256_SHA256, SanType,
};
use thiserror::Error;
use x509_parser::certificate::X509Certificate;
use x509_parser::extensions::GeneralName;
use x509_parser::time::ASN1Time;

use crate::Config;
use files::{exists, read_key, read_pem_cert, write_file};

/// Days a rack CA is valid unless `--days` says otherwise.
pub const DEFAULT_CA_DAYS: u32 = 3650;
/// Days a host certificate is valid unless `--days` says otherwise.
pub const DEFAULT_DAYS: u32 = 365;
/// Longest validity accepted, in days (a century).
pub const MAX_DAYS: u32 = 36_500;
/// Largest certificate or key file read.
pub const MAX_PEM_BYTES: u64 = 1 << 20;

const DAY: Duration = Duration::from_secs(86_400);

/// Why a PKI command failed.
#[derive(Debug, Error)]
pub enum PkiError {
    /// The config has no `[rack.tls]`.
    #[error("{0}: the rack has no [rack.tls], so no PKI: add it (see docs/security.md)")]
    NoTls(PathBuf),
    /// A file that would be written already exists.
    #[error("{0}: exists; pass --force to replace it")]
    Exists(PathBuf),
    /// One of a certificate and its key exists, the other does not.
    #[error("{present} exists but {missing} does not: pass --force to replace both")]
    Unpaired {
        /// The file that exists.
        present: PathBuf,
        /// The file that does not.
        missing: PathBuf,
    },
    /// A file could not be read, written or created.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// A file is not what it should be (not PEM, a key that does not match).
    #[error("{path}: {why}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong and what would fix it.
        why: String,
    },
    /// A validity longer than [`MAX_DAYS`].
    #[error("{0} days is more than the {MAX_DAYS} accepted")]
    Days(u32),
    /// rcgen could not make a key or a certificate.
    #[error("{what}: {source}")]
    Generate {
        /// What was being made.
        what: String,
        /// rcgen's error.
        source: rcgen::Error,
    },
}

/// The rack CA's files: its certificate and, beside it, its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaFiles {
    /// The CA certificate (PEM), which every host gets.
    pub cert: PathBuf,
    /// The CA key (PEM, PKCS#8), which stays where certificates are issued.
    pub key: PathBuf,
}

impl CaFiles {
    /// `DIR/ca.pem` and `DIR/ca.key`.
    pub fn in_dir(dir: &Path) -> Self {
        Self::at(&dir.join("ca.pem"))
    }

    /// The certificate at `cert` and the key beside it (`.key` for its extension).
    pub fn at(cert: &Path) -> Self {
        Self {
            cert: cert.to_path_buf(),
            key: cert.with_extension("key"),
        }
    }

    /// The CA of a config's `[rack.tls]`, if it has one.
    pub fn of(config: &Config) -> Option<Self> {
        config.tls.as_ref().map(|t| Self::at(&t.ca))
    }
}

/// What a certificate holder is in the config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// A memory donor: a TLS and QUIC server.
    Donor,
    /// An inference node: a client of the donors.
    Node,
    /// An operator: a client of the donors' control plane.
    Operator,
}

/// A host that gets a certificate, and where the config names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Host {
    /// Donor, node or operator.
    pub role: Role,
    /// Its key in the config: `donor[0]`, `node[1]`, `rack.tls.operators[0]`.
    pub key: String,
    /// Its name, the certificate's DNS name.
    pub name: String,
    /// IPs its certificate names (a donor's addresses, none for others).
    pub ips: Vec<IpAddr>,
    /// IPs it is dialled at, which its certificate must name.
    pub dialled: Vec<IpAddr>,
}

impl fmt::Display for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.key, self.name)
    }
}

/// Every donor, node and operator of the config, in that order.
pub fn hosts(config: &Config) -> Vec<Host> {
    fn push(ips: &mut Vec<IpAddr>, ip: IpAddr) {
        if !ip.is_unspecified() && !ips.contains(&ip) {
            ips.push(ip);
        }
    }
    let mut out = Vec::new();
    for (i, d) in config.donors.iter().enumerate() {
        let mut dialled = Vec::new();
        for e in &d.advertise {
            push(&mut dialled, e.addr.ip());
        }
        if let Some(c) = d.control_endpoint() {
            push(&mut dialled, c.ip());
        }
        let mut ips = Vec::new();
        for e in d.listen.iter().chain(&d.advertise) {
            push(&mut ips, e.addr.ip());
        }
        for ip in d.control.iter().map(|c| c.ip()).chain(dialled.clone()) {
            push(&mut ips, ip);
        }
        out.push(Host {
            role: Role::Donor,
            key: format!("donor[{i}]"),
            name: d.name.clone(),
            ips,
            dialled,
        });
    }
    for (i, n) in config.nodes.iter().enumerate() {
        out.push(Host {
            role: Role::Node,
            key: format!("node[{i}]"),
            name: n.name.clone(),
            ips: Vec::new(),
            dialled: Vec::new(),
        });
    }
    let operators = config.tls.iter().flat_map(|t| &t.operators);
    for (i, o) in operators.enumerate() {
        out.push(Host {
            role: Role::Operator,
            key: format!("rack.tls.operators[{i}]"),
            name: o.clone(),
            ips: Vec::new(),
            dialled: Vec::new(),
        });
    }
    out
}

/// Whether `issue` wrote a host's files or kept the ones there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// A new key and certificate were written.
    Written,
    /// Both files existed and were left alone (no `--force`).
    Kept,
}

/// What `init` or `issue` did for one certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Issued {
    /// Whose certificate (`rack.tls.ca (CA)` for the CA).
    pub holder: String,
    /// Written or kept.
    pub outcome: Outcome,
    /// The certificate file.
    pub cert: PathBuf,
    /// The key file.
    pub key: PathBuf,
    /// Its subject alternative names (`dns:NAME`, `ip:ADDR`), when readable.
    pub sans: Vec<String>,
    /// Its end of validity (UTC), when readable.
    pub not_after: Option<String>,
}

impl fmt::Display for Issued {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let outcome = match self.outcome {
            Outcome::Written => "written",
            Outcome::Kept => "kept",
        };
        write!(f, "{outcome:<7} {}: {}", self.holder, self.cert.display())?;
        if !self.sans.is_empty() {
            write!(f, " [{}]", self.sans.join(", "))?;
        }
        match &self.not_after {
            Some(t) => write!(f, ", valid until {t}"),
            None => f.write_str(", unreadable (`engram-cluster check` says why)"),
        }
    }
}

/// Create a rack CA valid for `days`: `ca.cert` and `ca.key` (mode 0600),
/// and their directory (0700) when missing. Existing files are replaced
/// only with `force`.
pub fn init(ca: &CaFiles, rack: Option<&str>, days: u32, force: bool) -> Result<Issued, PkiError> {
    if !force && let Some(p) = [&ca.cert, &ca.key].into_iter().find(|p| exists(p)) {
        return Err(PkiError::Exists(p.clone()));
    }
    let key = generate_key("the CA key")?;
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(
        DnType::CommonName,
        format!("engram-rack CA {}", rack.unwrap_or("rack")),
    );
    // Path length 0: the CA signs host certificates, never another CA.
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    set_validity(&mut params, SystemTime::now(), days)?;
    let cert = params
        .self_signed(&key)
        .map_err(|source| PkiError::Generate {
            what: "the CA certificate".into(),
            source,
        })?;
    write_file(&ca.key, key.serialize_pem().as_bytes(), 0o600)?;
    write_file(&ca.cert, cert.pem().as_bytes(), 0o644)?;
    let (sans, not_after) = summary(cert.der());
    Ok(Issued {
        holder: "rack.tls.ca (CA)".into(),
        outcome: Outcome::Written,
        cert: ca.cert.clone(),
        key: ca.key.clone(),
        sans,
        not_after,
    })
}

/// Issue a certificate valid for `days` to every donor, node and operator
/// of `config`, signed by its CA, at each host's [`Config::tls_files`].
/// A host whose two files exist keeps them unless `force`.
pub fn issue(config: &Config, days: u32, force: bool) -> Result<Vec<Issued>, PkiError> {
    issue_at(config, SystemTime::now(), days, force)
}

/// [`issue`], with certificates valid from `not_before`.
pub fn issue_at(
    config: &Config,
    not_before: SystemTime,
    days: u32,
    force: bool,
) -> Result<Vec<Issued>, PkiError> {
    let ca = CaFiles::of(config).ok_or_else(|| PkiError::NoTls(config.path.clone()))?;
    let issuer = load_issuer(&ca, &config.path)?;
    // Decide every host before writing anything, so a refusal leaves no
    // half-issued rack behind.
    let mut plan = Vec::new();
    for host in hosts(config) {
        let files = config
            .tls_files(&host.name)
            .ok_or_else(|| PkiError::NoTls(config.path.clone()))?;
        let keep = match (exists(&files.cert), exists(&files.key)) {
            _ if force => false,
            (true, true) => true,
            (false, false) => false,
            (c, _) => {
                let (present, missing) = if c {
                    (files.cert, files.key)
                } else {
                    (files.key, files.cert)
                };
                return Err(PkiError::Unpaired { present, missing });
            }
        };
        plan.push((host, files, keep));
    }
    let mut out = Vec::new();
    for (host, files, keep) in plan {
        let outcome = if keep {
            Outcome::Kept
        } else {
            let (cert, key) = leaf(&host, &issuer, not_before, days)?;
            write_file(&files.key, key.as_bytes(), 0o600)?;
            write_file(&files.cert, cert.as_bytes(), 0o644)?;
            Outcome::Written
        };
        let (sans, not_after) = read_pem_cert(&files.cert)
            .ok()
            .map(|der| summary(&der))
            .unwrap_or_default();
        out.push(Issued {
            holder: host.to_string(),
            outcome,
            cert: files.cert,
            key: files.key,
            sans,
            not_after,
        });
    }
    Ok(out)
}

/// A host's certificate and key, PEM.
fn leaf(
    host: &Host,
    issuer: &Issuer<'_, KeyPair>,
    not_before: SystemTime,
    days: u32,
) -> Result<(String, String), PkiError> {
    let generate = |source| PkiError::Generate {
        what: format!("{host}'s certificate"),
        source,
    };
    let key = generate_key(&format!("{host}'s key"))?;
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params
        .distinguished_name
        .push(DnType::CommonName, host.name.as_str());
    let dns = host.name.clone().try_into().map_err(generate)?;
    params.subject_alt_names = std::iter::once(SanType::DnsName(dns))
        .chain(host.ips.iter().copied().map(SanType::IpAddress))
        .collect();
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    // Only a donor serves TLS: a node's or an operator's certificate is good
    // for client authentication alone, so it can never pass as a donor.
    params.extended_key_usages = match host.role {
        Role::Donor => vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ],
        Role::Node | Role::Operator => vec![ExtendedKeyUsagePurpose::ClientAuth],
    };
    params.use_authority_key_identifier_extension = true;
    set_validity(&mut params, not_before, days)?;
    let cert = params.signed_by(&key, issuer).map_err(generate)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// The CA as a signer: its certificate's name and key id, its key, which
/// must be the certificate's.
fn load_issuer(ca: &CaFiles, config: &Path) -> Result<Issuer<'static, KeyPair>, PkiError> {
    let invalid = |path: &Path, why: String| PkiError::Invalid {
        path: path.to_path_buf(),
        why,
    };
    let missing = |e: PkiError| match e {
        PkiError::Io { path, source } if source.kind() == std::io::ErrorKind::NotFound => invalid(
            &path,
            format!(
                "missing: run `engram-cluster pki init --config {}` first",
                config.display()
            ),
        ),
        e => e,
    };
    let der = read_pem_cert(&ca.cert).map_err(missing)?;
    let key = read_key(&ca.key).map_err(missing)?;
    let (_, cert) = x509_parser::parse_x509_certificate(&der)
        .map_err(|e| invalid(&ca.cert, format!("not an X.509 certificate: {e}")))?;
    if !cert.is_ca() {
        return Err(invalid(
            &ca.cert,
            "not a CA certificate: run `engram-cluster pki init`".into(),
        ));
    }
    if !key_matches(&cert, &key) {
        return Err(invalid(
            &ca.key,
            format!(
                "this key is not the key of the CA certificate {}",
                ca.cert.display()
            ),
        ));
    }
    Issuer::from_ca_cert_der(&der.as_slice().into(), key)
        .map_err(|e| invalid(&ca.cert, format!("cannot sign with this CA: {e}")))
}

fn generate_key(what: &str) -> Result<KeyPair, PkiError> {
    KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256).map_err(|source| PkiError::Generate {
        what: what.into(),
        source,
    })
}

fn set_validity(
    params: &mut CertificateParams,
    not_before: SystemTime,
    days: u32,
) -> Result<(), PkiError> {
    // Bounded, so the dates stay within what an X.509 time can say.
    let not_after = (days <= MAX_DAYS)
        .then(|| not_before.checked_add(DAY * days))
        .flatten()
        .ok_or(PkiError::Days(days))?;
    params.not_before = not_before.into();
    params.not_after = not_after.into();
    Ok(())
}

/// A certificate's SANs (`dns:NAME`, `ip:ADDR`) and end of validity.
/// A DER certificate's end of validity in seconds since the Unix epoch
/// (what the donor's `/metrics` shows), when it parses.
pub fn not_after_unix(der: &[u8]) -> Option<i64> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    Some(cert.validity().not_after.timestamp())
}

fn summary(der: &[u8]) -> (Vec<String>, Option<String>) {
    match x509_parser::parse_x509_certificate(der) {
        Ok((_, cert)) => {
            let (dns, ips) = sans(&cert);
            let sans = dns
                .iter()
                .map(|d| format!("dns:{d}"))
                .chain(ips.iter().map(|i| format!("ip:{i}")))
                .collect();
            (sans, Some(utc(&cert.validity().not_after)))
        }
        Err(_) => (Vec::new(), None),
    }
}

/// A certificate's DNS names and IPs.
fn sans(cert: &X509Certificate<'_>) -> (Vec<String>, Vec<IpAddr>) {
    let mut dns = Vec::new();
    let mut ips = Vec::new();
    let names = cert
        .subject_alternative_name()
        .ok()
        .flatten()
        .map(|s| s.value.general_names.as_slice())
        .unwrap_or_default();
    for n in names {
        match n {
            GeneralName::DNSName(d) => dns.push((*d).to_string()),
            GeneralName::IPAddress(b) => {
                if let Ok(v4) = <[u8; 4]>::try_from(*b) {
                    ips.push(IpAddr::from(v4));
                } else if let Ok(v6) = <[u8; 16]>::try_from(*b) {
                    ips.push(IpAddr::from(v6));
                }
            }
            _ => {}
        }
    }
    (dns, ips)
}

/// True when `key` is the private half of `cert`'s public key.
fn key_matches(cert: &X509Certificate<'_>, key: &KeyPair) -> bool {
    cert.public_key().subject_public_key.data.as_ref() == key.public_key_raw()
}

/// `2027-11-30 16:40:45 UTC`.
fn utc(t: &ASN1Time) -> String {
    let t = t.to_datetime();
    format!(
        "{:04}-{:02}-{:02} {:02}:{:02}:{:02} UTC",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    )
}

/// Seconds since the Unix epoch (negative before it).
fn unix(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_secs() as i64,
        Err(e) => -(e.duration().as_secs() as i64),
    }
}

#[cfg(test)]
mod tests;
