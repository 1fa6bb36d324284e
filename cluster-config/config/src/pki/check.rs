//! The certificate check: every host's files exist, parse, belong
//! together, chain to the rack CA, name the host and are valid now.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use x509_parser::certificate::X509Certificate;

use super::{
    CaFiles, Host, PkiError, Role, hosts, key_matches, read_key, read_pem_cert, sans, unix, utc,
};
use crate::Config;

/// A certificate expiring sooner than this is warned about.
pub const EXPIRY_WARNING: Duration = Duration::from_secs(30 * 86_400);

/// How bad a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Severity {
    /// Works today; needs attention soon.
    Warning,
    /// A handshake with this certificate fails (or would, on some path).
    Error,
}

impl fmt::Display for Severity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Warning => "warning",
            Self::Error => "error",
        })
    }
}

/// One problem with the rack's certificate files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// Error or warning.
    pub severity: Severity,
    /// Whose file, as the config names it: `donor[0] (donor-a)`, `rack.tls.ca`.
    pub key: String,
    /// The file.
    pub file: PathBuf,
    /// What is wrong and what to do.
    pub message: String,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}: {}", self.key, self.file.display(), self.message)
    }
}

/// Check the CA and every host's certificate and key of `config` (nothing
/// when it has no `[rack.tls]`).
pub fn check(config: &Config) -> Vec<Finding> {
    check_at(config, SystemTime::now())
}

/// [`check`] as of `now`.
pub fn check_at(config: &Config, now: SystemTime) -> Vec<Finding> {
    let Some(ca) = CaFiles::of(config) else {
        return Vec::new();
    };
    let mut cx = Checker {
        config: config.path.display().to_string(),
        now: unix(now),
        out: Vec::new(),
    };
    let ca_der = cx.ca(&ca);
    let ca_cert = ca_der
        .as_deref()
        .and_then(|d| x509_parser::parse_x509_certificate(d).ok())
        .map(|(_, c)| c);
    for host in hosts(config) {
        if let Some(files) = config.tls_files(&host.name) {
            cx.host(&host, &files.cert, &files.key, ca_cert.as_ref(), &ca.cert);
        }
    }
    cx.out
}

struct Checker {
    config: String,
    now: i64,
    out: Vec<Finding>,
}

impl Checker {
    fn push(&mut self, severity: Severity, key: &str, file: &Path, message: String) {
        self.out.push(Finding {
            severity,
            key: key.to_string(),
            file: file.to_path_buf(),
            message,
        });
    }

    fn issue(&self, force: bool) -> String {
        let force = if force { " --force" } else { "" };
        format!(
            "run `engram-cluster pki issue --config {}{force}`",
            self.config
        )
    }

    /// The CA certificate's DER, when it exists and is a usable CA.
    fn ca(&mut self, ca: &CaFiles) -> Option<Vec<u8>> {
        let key = "rack.tls.ca";
        let init = format!(
            "run `engram-cluster pki init --config {} --force`, then issue every host again",
            self.config
        );
        let der = match read_pem_cert(&ca.cert) {
            Ok(d) => d,
            Err(PkiError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                let msg = format!(
                    "missing: run `engram-cluster pki init --config {}` (or copy the rack's ca.pem here)",
                    self.config
                );
                self.push(Severity::Error, key, &ca.cert, msg);
                return None;
            }
            Err(e) => {
                self.push(Severity::Error, key, &ca.cert, reason(e));
                return None;
            }
        };
        let Ok((_, cert)) = x509_parser::parse_x509_certificate(&der) else {
            let msg = format!("not an X.509 certificate: {init}");
            self.push(Severity::Error, key, &ca.cert, msg);
            return None;
        };
        if !cert.is_ca() {
            let msg = format!("not a CA certificate (no CA basic constraint): {init}");
            self.push(Severity::Error, key, &ca.cert, msg);
            return None;
        }
        self.validity(key, &ca.cert, &cert, &init);
        Some(der)
    }

    fn host(
        &mut self,
        host: &Host,
        cert_path: &Path,
        key_path: &Path,
        ca: Option<&X509Certificate<'_>>,
        ca_path: &Path,
    ) {
        let key = host.to_string();
        let missing = |p: &Path| matches!(p.symlink_metadata(), Err(e) if e.kind() == std::io::ErrorKind::NotFound);
        let (no_cert, no_key) = (missing(cert_path), missing(key_path));
        match (no_cert, no_key) {
            // Never issued: a plain issue writes both.
            (true, true) => {
                let msg = format!(
                    "missing, as is its key {}: {}",
                    key_path.display(),
                    self.issue(false)
                );
                self.push(Severity::Error, &key, cert_path, msg);
                return;
            }
            // One without the other: issue replaces both only with --force.
            (true, false) | (false, true) => {
                let gone = if no_cert { cert_path } else { key_path };
                let msg = format!("missing: {}", self.issue(true));
                self.push(Severity::Error, &key, gone, msg);
                return;
            }
            (false, false) => {}
        }
        let reissue = self.issue(true);
        let der = match read_pem_cert(cert_path) {
            Ok(d) => d,
            Err(e) => {
                let msg = format!("{}: {reissue}", reason(e));
                self.push(Severity::Error, &key, cert_path, msg);
                return;
            }
        };
        let Ok((_, cert)) = x509_parser::parse_x509_certificate(&der) else {
            let msg = format!("not an X.509 certificate: {reissue}");
            self.push(Severity::Error, &key, cert_path, msg);
            return;
        };
        match read_key(key_path) {
            Ok(k) if key_matches(&cert, &k) => {}
            Ok(_) => {
                let msg = format!(
                    "this key does not match the certificate {}: {reissue}",
                    cert_path.display()
                );
                self.push(Severity::Error, &key, key_path, msg);
            }
            Err(e) => {
                let msg = format!("{}: {reissue}", reason(e));
                self.push(Severity::Error, &key, key_path, msg);
            }
        }
        if let Some(ca) = ca
            && cert.verify_signature(Some(ca.public_key())).is_err()
        {
            let msg = format!(
                "not signed by the rack CA {} (its issuer is {:?}): {reissue}",
                ca_path.display(),
                cert.issuer().to_string()
            );
            self.push(Severity::Error, &key, cert_path, msg);
        }
        if cert.is_ca() {
            let msg = format!("a CA certificate, not a host's: {reissue}");
            self.push(Severity::Error, &key, cert_path, msg);
        }
        self.names_and_usage(host, &key, cert_path, &cert, &reissue);
        self.validity(&key, cert_path, &cert, &reissue);
    }

    /// The certificate names the host and every address nodes dial, and
    /// may be used for the host's role.
    fn names_and_usage(
        &mut self,
        host: &Host,
        key: &str,
        cert_path: &Path,
        cert: &X509Certificate<'_>,
        reissue: &str,
    ) {
        let (dns, ips) = sans(cert);
        if !dns.iter().any(|d| d.eq_ignore_ascii_case(&host.name)) {
            let msg = format!(
                "the certificate is for {}, not {:?}: {reissue}",
                if dns.is_empty() {
                    "no DNS name".to_string()
                } else {
                    dns.join(", ")
                },
                host.name
            );
            self.push(Severity::Error, key, cert_path, msg);
        }
        let uncovered: Vec<String> = host
            .dialled
            .iter()
            .filter(|ip| !ips.contains(ip))
            .map(ToString::to_string)
            .collect();
        if !uncovered.is_empty() {
            let msg = format!(
                "the certificate does not name {}, which nodes dial: {reissue}",
                uncovered.join(", ")
            );
            self.push(Severity::Error, key, cert_path, msg);
        }
        if let Ok(Some(eku)) = cert.extended_key_usage() {
            let eku = eku.value;
            let (needed, ok) = match host.role {
                Role::Donor => ("serverAuth", eku.any || eku.server_auth),
                Role::Node | Role::Operator => ("clientAuth", eku.any || eku.client_auth),
            };
            if !ok {
                let msg = format!("its extended key usage lacks {needed}: {reissue}");
                self.push(Severity::Error, key, cert_path, msg);
            }
        }
    }

    /// Not yet valid or expired: errors; expiring within [`EXPIRY_WARNING`]: a warning.
    fn validity(&mut self, key: &str, path: &Path, cert: &X509Certificate<'_>, fix: &str) {
        let v = cert.validity();
        let (from, until) = (v.not_before.timestamp(), v.not_after.timestamp());
        if self.now < from {
            let msg = format!(
                "certificate not valid until {} (is this host's clock right?): {fix}",
                utc(&v.not_before)
            );
            self.push(Severity::Error, key, path, msg);
        } else if self.now > until {
            let msg = format!("certificate expired on {}: {fix}", utc(&v.not_after));
            self.push(Severity::Error, key, path, msg);
        } else if until - self.now < EXPIRY_WARNING.as_secs() as i64 {
            let days = (until - self.now) / 86_400;
            let msg = format!(
                "certificate expires on {} (in {days} days): {fix} before then",
                utc(&v.not_after)
            );
            self.push(Severity::Warning, key, path, msg);
        }
    }
}

/// A read or parse error without its path (the finding names the file).
fn reason(e: PkiError) -> String {
    match e {
        PkiError::Io { source, .. } => source.to_string(),
        PkiError::Invalid { why, .. } => why,
        other => other.to_string(),
    }
}
