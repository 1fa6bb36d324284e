//! A small rack PKI for tests: a CA and host certificates as the rack's
//! tools issue them (ECDSA P-256, the host's name as the only dNSName,
//! serverAuth and clientAuth), written where `[rack.tls]` reads them
//! (`DIR/ca.pem`, `DIR/NAME.pem`, `DIR/NAME.key`).

use std::path::{Path, PathBuf};

use anyhow::Result;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};

/// A CA that writes into one directory.
#[derive(Debug)]
pub struct TestPki {
    /// Where its files are.
    pub dir: PathBuf,
    /// The CA certificate, PEM.
    pub ca_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl TestPki {
    /// A new CA named `name`, its certificate written to `DIR/ca.pem`.
    pub fn new(dir: &Path, name: &str) -> Result<Self> {
        std::fs::create_dir_all(dir)?;
        let mut p = CertificateParams::new(Vec::<String>::new())?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, name);
        p.distinguished_name = dn;
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate()?;
        let cert = p.self_signed(&key)?;
        let ca_pem = cert.pem();
        std::fs::write(dir.join("ca.pem"), &ca_pem)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            ca_pem,
            issuer: Issuer::new(p, key),
        })
    }

    /// Issue `host`'s certificate and key, written to `DIR/HOST.pem` and
    /// `DIR/HOST.key`; returns their paths.
    pub fn issue(&self, host: &str) -> Result<(PathBuf, PathBuf)> {
        let mut p = CertificateParams::new(vec![host.to_string()])?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, host);
        p.distinguished_name = dn;
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let key = KeyPair::generate()?;
        let cert = p.signed_by(&key, &self.issuer)?;
        let (cert_path, key_path) = (
            self.dir.join(format!("{host}.pem")),
            self.dir.join(format!("{host}.key")),
        );
        std::fs::write(&cert_path, cert.pem())?;
        std::fs::write(&key_path, key.serialize_pem())?;
        // As `pki issue` writes it: the owner's alone (a key open to others
        // is refused).
        std::fs::set_permissions(
            &key_path,
            std::os::unix::fs::PermissionsExt::from_mode(0o600),
        )?;
        Ok((cert_path, key_path))
    }

    /// The PEM texts of `host`'s certificate and key (issued before).
    pub fn pems(&self, host: &str) -> Result<(String, String)> {
        Ok((
            std::fs::read_to_string(self.dir.join(format!("{host}.pem")))?,
            std::fs::read_to_string(self.dir.join(format!("{host}.key")))?,
        ))
    }
}
