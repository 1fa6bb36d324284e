//! init -> issue -> check on a small rack, then one test per problem the
//! check must find.

use std::os::unix::fs::PermissionsExt;

use super::*;

const D1: &str = "1111111111111111111111111111111111111111111111111111111111111111";

/// Two donors (TLS + QUIC on a wildcard, QUIC on loopback with its own
/// file names), one node, one operator; `ca` overrides `[rack.tls] ca`.
fn rack_text(ca: Option<&str>) -> String {
    let ca = ca.map(|c| format!("ca = \"{c}\"\n")).unwrap_or_default();
    format!(
        r#"version = 1
[rack]
name = "lab"
[rack.tls]
operators = ["alice"]
{ca}
[[table]]
id = 1
layer = 1
path = "tables/layer1.etab"
rows = 1000
digest = "{D1}"

[[donor]]
name = "donor-a"
listen = ["tls://0.0.0.0:7410", "quic://0.0.0.0:7410"]
advertise = ["tls://10.0.0.11:7410", "quic://10.0.0.11:7410"]
control = "10.0.0.12:7411"
tables = [1]
ram_gib = 16.0

[[donor]]
name = "donor-b"
listen = ["quic://127.0.0.2:7410"]
tables = [1]
ram_gib = 16.0
tls_cert = "certs/b.pem"
tls_key = "certs/b.key"

[[node]]
name = "gpu-1"
[[node.route]]
table = 1
sources = ["donor-a", "donor-b", "ssd"]
"#
    )
}

struct Rack {
    dir: tempfile::TempDir,
    config: Config,
}

impl Rack {
    /// The rack with its CA made and every host issued.
    fn issued() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = Config::parse(&rack_text(None), &dir.path().join("rack.toml")).expect("valid");
        let ca = CaFiles::of(&config).expect("tls");
        init(&ca, Some(&config.rack), DEFAULT_CA_DAYS, false).expect("init");
        issue(&config, DEFAULT_DAYS, false).expect("issue");
        Self { dir, config }
    }

    fn pki(&self, file: &str) -> PathBuf {
        self.dir.path().join("pki").join(file)
    }

    fn errors(&self) -> Vec<Finding> {
        check(&self.config)
            .into_iter()
            .filter(|f| f.severity == Severity::Error)
            .collect()
    }
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).expect("metadata").permissions().mode() & 0o777
}

/// A finding of `severity` for `key` about `file` whose message contains `msg`.
fn find(findings: &[Finding], severity: Severity, key: &str, file: &Path, msg: &str) {
    assert!(
        findings.iter().any(|f| f.severity == severity
            && f.key == key
            && f.file == file
            && f.message.contains(msg)),
        "no {severity} for {key} on {} containing {msg:?}; got:\n{}",
        file.display(),
        findings
            .iter()
            .map(|f| format!("{}: {f}", f.severity))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[test]
fn init_issue_check_round_trip() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = Config::parse(&rack_text(None), &dir.path().join("rack.toml")).expect("valid");
    let ca = CaFiles::of(&config).expect("tls");
    assert_eq!(ca, CaFiles::in_dir(&dir.path().join("pki")));
    let made = init(&ca, Some("lab"), DEFAULT_CA_DAYS, false).expect("init");
    assert_eq!(made.outcome, Outcome::Written);
    assert_eq!(mode(&ca.key), 0o600, "the CA key is private");
    assert_eq!(mode(&dir.path().join("pki")), 0o700);
    let der = read_pem_cert(&ca.cert).expect("ca.pem");
    let (_, cert) = x509_parser::parse_x509_certificate(&der).expect("x509");
    assert!(cert.is_ca());
    assert_eq!(cert.subject().to_string(), "CN=engram-rack CA lab");

    let report = issue(&config, DEFAULT_DAYS, false).expect("issue");
    let holders: Vec<&str> = report.iter().map(|r| r.holder.as_str()).collect();
    assert_eq!(
        holders,
        [
            "donor[0] (donor-a)",
            "donor[1] (donor-b)",
            "node[0] (gpu-1)",
            "rack.tls.operators[0] (alice)"
        ]
    );
    assert!(report.iter().all(|r| r.outcome == Outcome::Written));
    assert_eq!(
        report[0].sans,
        ["dns:donor-a", "ip:10.0.0.11", "ip:10.0.0.12"],
        "every concrete address of the donor, once; no wildcard"
    );
    assert_eq!(report[1].sans, ["dns:donor-b", "ip:127.0.0.2"]);
    assert_eq!(report[3].sans, ["dns:alice"]);
    assert_eq!(report[1].cert, dir.path().join("certs/b.pem"), "tls_cert");
    for r in &report {
        assert_eq!(mode(&r.key), 0o600, "{}", r.key.display());
        assert!(r.not_after.as_deref().is_some_and(|t| t.ends_with(" UTC")));
        assert!(r.to_string().starts_with("written "), "{r}");
    }
    assert_eq!(mode(&dir.path().join("certs")), 0o700, "made for the key");
    assert_eq!(check(&config), Vec::new(), "a freshly issued rack is clean");
}

#[test]
fn issue_keeps_existing_files_unless_forced() {
    let rack = Rack::issued();
    let before = std::fs::read(rack.pki("gpu-1.pem")).expect("read");
    let again = issue(&rack.config, DEFAULT_DAYS, false).expect("issue");
    assert!(again.iter().all(|r| r.outcome == Outcome::Kept));
    assert!(again[0].to_string().starts_with("kept "), "{}", again[0]);
    assert_eq!(
        again[0].sans[0], "dns:donor-a",
        "read back from the kept file"
    );
    assert_eq!(std::fs::read(rack.pki("gpu-1.pem")).expect("read"), before);

    let forced = issue(&rack.config, DEFAULT_DAYS, true).expect("issue --force");
    assert!(forced.iter().all(|r| r.outcome == Outcome::Written));
    assert_ne!(std::fs::read(rack.pki("gpu-1.pem")).expect("read"), before);
    assert_eq!(
        mode(&rack.pki("gpu-1.key")),
        0o600,
        "still private after replacing"
    );
    assert_eq!(check(&rack.config), Vec::new());

    // A certificate without its key is not silently paired with a new one.
    std::fs::remove_file(rack.pki("gpu-1.key")).expect("rm");
    match issue(&rack.config, DEFAULT_DAYS, false) {
        Err(e @ PkiError::Unpaired { .. }) => assert!(e.to_string().contains("--force"), "{e}"),
        other => panic!("expected Unpaired, got {other:?}"),
    }
    assert!(!rack.pki("gpu-1.key").exists(), "a refusal writes nothing");
    assert!(matches!(
        issue(&rack.config, MAX_DAYS + 1, true),
        Err(PkiError::Days(_))
    ));
}

#[test]
fn init_refuses_to_overwrite_a_ca_without_force() {
    let rack = Rack::issued();
    let ca = CaFiles::of(&rack.config).expect("tls");
    let before = std::fs::read(&ca.cert).expect("read");
    match init(&ca, None, DEFAULT_CA_DAYS, false) {
        Err(e @ PkiError::Exists(_)) => {
            let shown = e.to_string();
            assert!(
                shown.contains("ca.pem") && shown.contains("--force"),
                "{shown}"
            );
        }
        other => panic!("expected Exists, got {other:?}"),
    }
    assert_eq!(std::fs::read(&ca.cert).expect("read"), before);
    init(&ca, None, DEFAULT_CA_DAYS, true).expect("init --force");
    assert_eq!(mode(&ca.key), 0o600);
    // Every host certificate now chains to the old CA.
    let errors = rack.errors();
    assert_eq!(errors.len(), 4, "{errors:?}");
    assert!(
        errors
            .iter()
            .all(|f| f.message.contains("not signed by the rack CA"))
    );
}

#[test]
fn issue_needs_a_ca() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = Config::parse(&rack_text(None), &dir.path().join("rack.toml")).expect("valid");
    match issue(&config, DEFAULT_DAYS, false) {
        Err(e @ PkiError::Invalid { .. }) => {
            let shown = e.to_string();
            assert!(
                shown.contains("ca.pem: missing: run `engram-cluster pki init"),
                "{shown}"
            );
        }
        other => panic!("expected Invalid, got {other:?}"),
    }
    assert!(!dir.path().join("pki").exists(), "nothing written");
}

#[test]
fn issue_needs_a_pki() {
    let dir = tempfile::tempdir().expect("tempdir");
    let text = rack_text(None)
        .replace(
            "[rack.tls]\noperators = [\"alice\"]\n",
            "plaintext = \"allow\"\n",
        )
        .replace("tls://", "tcp://")
        .replace("quic://", "tcp://")
        .replace(
            "tcp://0.0.0.0:7410\", \"tcp://0.0.0.0:7410",
            "tcp://0.0.0.0:7410",
        )
        .replace(
            "tcp://10.0.0.11:7410\", \"tcp://10.0.0.11:7410",
            "tcp://10.0.0.11:7410",
        )
        .replace(
            "tls_cert = \"certs/b.pem\"\ntls_key = \"certs/b.key\"\n",
            "",
        );
    let config = Config::parse(&text, &dir.path().join("rack.toml")).expect("valid");
    assert!(matches!(
        issue(&config, DEFAULT_DAYS, false),
        Err(PkiError::NoTls(_))
    ));
    assert_eq!(check(&config), Vec::new(), "no PKI, nothing to check");
}

#[test]
fn check_finds_a_certificate_from_another_ca() {
    let rack = Rack::issued();
    // The same hosts and files, issued by a CA of its own.
    let other = Config::parse(
        &rack_text(Some("other/ca.pem")),
        &rack.dir.path().join("rack.toml"),
    )
    .expect("valid");
    init(
        &CaFiles::of(&other).expect("tls"),
        None,
        DEFAULT_CA_DAYS,
        false,
    )
    .expect("init");
    issue(&other, DEFAULT_DAYS, true).expect("issue");
    let errors = rack.errors();
    find(
        &errors,
        Severity::Error,
        "donor[0] (donor-a)",
        &rack.pki("donor-a.pem"),
        "not signed by the rack CA",
    );
    assert!(
        errors[0].message.contains("pki issue --config"),
        "{}",
        errors[0]
    );
    assert_eq!(check(&other), Vec::new(), "clean against its own CA");
}

#[test]
fn check_finds_a_certificate_for_another_host() {
    let rack = Rack::issued();
    for ext in ["pem", "key"] {
        std::fs::copy(
            rack.pki(&format!("gpu-1.{ext}")),
            rack.pki(&format!("donor-a.{ext}")),
        )
        .expect("copy");
    }
    let errors = rack.errors();
    let cert = rack.pki("donor-a.pem");
    let key = "donor[0] (donor-a)";
    find(
        &errors,
        Severity::Error,
        key,
        &cert,
        "is for gpu-1, not \"donor-a\"",
    );
    find(
        &errors,
        Severity::Error,
        key,
        &cert,
        "does not name 10.0.0.11, 10.0.0.12",
    );
    assert!(
        errors.iter().all(|f| f.key == key),
        "only donor-a is wrong: {errors:?}"
    );
}

#[test]
fn check_finds_a_key_that_does_not_match() {
    let rack = Rack::issued();
    std::fs::copy(rack.pki("gpu-1.key"), rack.pki("alice.key")).expect("copy");
    let errors = rack.errors();
    find(
        &errors,
        Severity::Error,
        "rack.tls.operators[0] (alice)",
        &rack.pki("alice.key"),
        "does not match the certificate",
    );
    assert_eq!(errors.len(), 1, "{errors:?}");
}

#[test]
fn check_finds_missing_and_unreadable_files() {
    let rack = Rack::issued();
    std::fs::remove_file(rack.pki("gpu-1.key")).expect("rm");
    std::fs::remove_file(rack.pki("alice.pem")).expect("rm");
    std::fs::remove_file(rack.pki("alice.key")).expect("rm");
    let b = rack.dir.path().join("certs/b.pem");
    std::fs::write(&b, "not a certificate\n").expect("write");
    let errors = rack.errors();
    find(
        &errors,
        Severity::Error,
        "node[0] (gpu-1)",
        &rack.pki("gpu-1.key"),
        "missing: run `engram-cluster pki issue --config ",
    );
    assert!(
        errors[1].message.ends_with("--force`"),
        "a lone certificate needs --force: {}",
        errors[1]
    );
    find(
        &errors,
        Severity::Error,
        "rack.tls.operators[0] (alice)",
        &rack.pki("alice.pem"),
        "missing, as is its key",
    );
    assert!(
        errors[2].message.ends_with(".toml`"),
        "never issued: a plain issue: {}",
        errors[2]
    );
    find(
        &errors,
        Severity::Error,
        "donor[1] (donor-b)",
        &b,
        "not a PEM certificate",
    );

    // Without the CA, that is said once; the hosts are checked otherwise.
    let ca = CaFiles::of(&rack.config).expect("tls");
    std::fs::remove_file(&ca.cert).expect("rm");
    let errors = rack.errors();
    find(
        &errors,
        Severity::Error,
        "rack.tls.ca",
        &ca.cert,
        "missing: run `engram-cluster pki init --config",
    );
    assert_eq!(errors.len(), 4, "{errors:?}");
}

#[test]
fn check_finds_expired_and_not_yet_valid_certificates() {
    let rack = Rack::issued();
    let now = SystemTime::now();
    issue_at(&rack.config, now - DAY * 100, 30, true).expect("issue in the past");
    let errors = rack.errors();
    assert_eq!(errors.len(), 4, "{errors:?}");
    let cert = rack.pki("donor-a.pem");
    find(
        &errors,
        Severity::Error,
        "donor[0] (donor-a)",
        &cert,
        "certificate expired on ",
    );
    let shown = errors[0].to_string();
    assert!(
        shown.starts_with(&format!(
            "donor[0] (donor-a): {}: certificate expired on ",
            cert.display()
        )),
        "{shown}"
    );
    assert!(shown.ends_with("--force`"), "{shown}");

    issue_at(&rack.config, now + DAY * 2, 90, true).expect("issue in the future");
    find(
        &rack.errors(),
        Severity::Error,
        "node[0] (gpu-1)",
        &rack.pki("gpu-1.pem"),
        "not valid until",
    );
    // The same files, checked as of a day when they are valid.
    assert_eq!(check_at(&rack.config, now + DAY * 3), Vec::new());
}

#[test]
fn a_certificate_expiring_soon_is_a_warning() {
    let rack = Rack::issued();
    issue(&rack.config, 10, true).expect("issue");
    let findings = check(&rack.config);
    assert_eq!(findings.len(), 4, "{findings:?}");
    find(
        &findings,
        Severity::Warning,
        "donor[0] (donor-a)",
        &rack.pki("donor-a.pem"),
        "expires on ",
    );
    assert!(findings.iter().all(|f| f.severity == Severity::Warning));
    // The CA's own expiry is checked the same way.
    let late = SystemTime::now() + DAY * (DEFAULT_CA_DAYS - 10);
    let ca = CaFiles::of(&rack.config).expect("tls");
    find(
        &check_at(&rack.config, late),
        Severity::Warning,
        "rack.tls.ca",
        &ca.cert,
        "pki init --config",
    );
}

#[test]
fn rustls_accepts_the_issued_certificates() {
    use rustls::client::WebPkiServerVerifier;
    use rustls::client::danger::ServerCertVerifier;
    use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
    use rustls::server::WebPkiClientVerifier;
    use std::sync::Arc;

    let rack = Rack::issued();
    let ca = CaFiles::of(&rack.config).expect("tls");
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from(read_pem_cert(&ca.cert).expect("ca")))
        .expect("root");
    let roots = Arc::new(roots);
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let leaf = |f: &str| CertificateDer::from(read_pem_cert(&rack.pki(f)).expect("cert"));
    let server = WebPkiServerVerifier::builder_with_provider(roots.clone(), provider.clone())
        .build()
        .expect("server verifier");
    for name in ["donor-a", "10.0.0.11", "10.0.0.12"] {
        let name = ServerName::try_from(name).expect("name");
        server
            .verify_server_cert(&leaf("donor-a.pem"), &[], &name, &[], UnixTime::now())
            .unwrap_or_else(|e| panic!("donor-a as {name:?}: {e}"));
    }
    let other = ServerName::try_from("donor-b").expect("name");
    assert!(
        server
            .verify_server_cert(&leaf("donor-a.pem"), &[], &other, &[], UnixTime::now())
            .is_err()
    );
    let client = WebPkiClientVerifier::builder_with_provider(roots, provider)
        .build()
        .expect("client verifier");
    for f in ["gpu-1.pem", "alice.pem"] {
        client
            .verify_client_cert(&leaf(f), &[], UnixTime::now())
            .unwrap_or_else(|e| panic!("{f}: {e}"));
    }
}
