//! Certificates made per test run (rcgen). A CA writes its certificate to a PEM file; leaves it signs are written as `NAME.pem` and
//! `NAME.key` into a test's temp dir.

use std::path::PathBuf;

use super::netns::TempDir;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair,
};

/// A certificate authority of this run.
pub struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
    /// Its certificate (PEM): what a peer trusts.
    pub cert: PathBuf,
}

/// A certificate and its key, as PEM files.
#[derive(Clone, Debug)]
pub struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TestCa {
    /// A self-signed CA named `name`, written to `dir/<file>.pem`.
    pub fn new(dir: &TempDir, name: &str, file: &str) -> TestCa {
        let mut p = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name
            .push(DnType::CommonName, name.to_string());
        let issuer = CertifiedIssuer::self_signed(p, KeyPair::generate().expect("CA key"))
            .expect("self-signing the CA");
        let cert = dir.join(format!("{file}.pem"));
        std::fs::write(&cert, issuer.pem()).expect("writing the CA");
        TestCa { issuer, cert }
    }

    /// A leaf certificate for `names` (DNS names or IP addresses) with `usages`, written to
    /// `dir/<file>.pem` and `dir/<file>.key`.
    pub fn leaf(
        &self,
        dir: &TempDir,
        file: &str,
        names: &[&str],
        usages: &[ExtendedKeyUsagePurpose],
    ) -> CertFiles {
        let key = KeyPair::generate().expect("key");
        let mut p = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            .expect("leaf params");
        p.extended_key_usages = usages.to_vec();
        let cert = p.signed_by(&key, &self.issuer).expect("signing");
        let files = CertFiles {
            cert: dir.join(format!("{file}.pem")),
            key: dir.join(format!("{file}.key")),
        };
        std::fs::write(&files.cert, cert.pem()).expect("writing a certificate");
        std::fs::write(&files.key, key.serialize_pem()).expect("writing a key");
        files
    }
}
