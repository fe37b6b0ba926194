//! The API over TCP: TLS with client certificates (rustls), and plain TCP refused unless the
//! config says so. A daemon in the fp namespace listens on 127.0.0.1; the CLI reaches it from
//! inside that namespace (`--netns`). Certificates are made per run (rcgen): a CA, a server
//! certificate for `fastpath.test`, a client certificate it signed, and a client certificate
//! of another CA.

use std::{
    path::{Path, PathBuf},
    process::Output,
};

use fastpath::testkit::netns::{
    Daemon, LbTopology, TempDir, prepare_test, test_lb_topology, unique_pin_dir,
};
use rcgen::ExtendedKeyUsagePurpose;

use fastpath::testkit::pki::{CertFiles, TestCa};

use crate::bin;

struct Pki {
    ca: PathBuf,
    server: (PathBuf, PathBuf),
    client: (PathBuf, PathBuf),
    stranger: (PathBuf, PathBuf),
}

fn make_pki(dir: &TempDir) -> Pki {
    let ca = TestCa::new(dir, "fastpath test CA", "ca");
    let other_ca = TestCa::new(dir, "another CA", "other-ca");
    let pair = |f: CertFiles| (f.cert, f.key);
    Pki {
        server: pair(ca.leaf(
            dir,
            "server",
            &["fastpath.test"],
            &[ExtendedKeyUsagePurpose::ServerAuth],
        )),
        client: pair(ca.leaf(
            dir,
            "client",
            &["operator"],
            &[ExtendedKeyUsagePurpose::ClientAuth],
        )),
        stranger: pair(other_ca.leaf(
            dir,
            "stranger",
            &["intruder"],
            &[ExtendedKeyUsagePurpose::ClientAuth],
        )),
        ca: ca.cert,
    }
}

/// `fastpath --netns fp --server https://127.0.0.1:PORT ... info -o json`.
fn info_over_tcp(lb: &LbTopology, url: &str, tls: &[&Path]) -> Output {
    let mut cmd = std::process::Command::new(bin());
    cmd.args(["--netns", lb.fp().name(), "--server", url]);
    if let [ca, cert, key] = tls {
        cmd.arg("--ca")
            .arg(ca)
            .arg("--cert")
            .arg(cert)
            .arg("--key")
            .arg(key)
            .args(["--server-name", "fastpath.test"]);
    }
    cmd.args(["info", "-o", "json"]);
    cmd.output().expect("running fastpath info")
}

#[test]
fn tcp_api_needs_a_client_certificate_and_plain_tcp_must_be_asked_for() {
    prepare_test(&[]);
    let dir = TempDir::new("api-tls").expect("temp dir");
    let pki = make_pki(&dir);
    let lb = test_lb_topology(1);
    lb.fp().link_up("lo").expect("lo up");
    let port = 50_443;
    let url = format!("https://127.0.0.1:{port}");
    let config = lb.fp_config(&unique_pin_dir("api-tls")).raw(&format!(
        "[api]\nlisten = \"127.0.0.1:{port}\"\ntls_cert = {:?}\ntls_key = {:?}\ntls_client_ca = {:?}\n",
        pki.server.0, pki.server.1, pki.ca
    ));
    let daemon = Daemon::start(bin(), lb.fp(), &config);

    // The operator's certificate: served.
    let ok = info_over_tcp(&lb, &url, &[&pki.ca, &pki.client.0, &pki.client.1]);
    let text = String::from_utf8_lossy(&ok.stdout);
    assert!(
        ok.status.success(),
        "info over TLS with a client certificate: {}\n{text}{}",
        ok.status,
        String::from_utf8_lossy(&ok.stderr)
    );
    let info: serde_json::Value = serde_json::from_str(&text).expect("info JSON");
    assert!(
        info["listeners"].as_array().is_some_and(|l| l
            .iter()
            .any(|x| x.as_str() == Some(format!("https://127.0.0.1:{port}").as_str()))),
        "{info}"
    );

    // A certificate of another CA, or none: the handshake fails, exit 3 (cannot connect).
    for (what, tls) in [
        (
            "another CA's client certificate",
            vec![pki.ca.as_path(), &pki.stranger.0, &pki.stranger.1],
        ),
        ("no client certificate", vec![]),
    ] {
        let out = info_over_tcp(&lb, &url, &tls);
        assert_eq!(
            out.status.code(),
            Some(3),
            "{what}: expected exit 3 (cannot connect); stdout {}\nstderr {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.stdout.is_empty(), "{what}: nothing may be served");
    }
    // Plain HTTP/2 to the TLS port: no answer either.
    let plain = info_over_tcp(&lb, &format!("http://127.0.0.1:{port}"), &[]);
    assert_ne!(plain.status.code(), Some(0), "plain TCP to the TLS port");
    drop(daemon);

    // A TCP listener without TLS is refused unless allow_insecure_tcp = true.
    let insecure = dir.join("insecure.toml");
    let base = lb.fp_config(&unique_pin_dir("api-plain"));
    std::fs::write(
        &insecure,
        base.clone()
            .raw(&format!("[api]\nlisten = \"127.0.0.1:{port}\"\n"))
            .to_toml(),
    )
    .expect("writing a config");
    let out = std::process::Command::new(bin())
        .args(["--netns", lb.fp().name(), "config", "check"])
        .arg(&insecure)
        .output()
        .expect("config check");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("api.listen") && err.contains("allow_insecure_tcp"),
        "the error must name the key and the way out: {err}"
    );
    let allowed = base.raw(&format!(
        "[api]\nlisten = \"127.0.0.1:{port}\"\nallow_insecure_tcp = true\n"
    ));
    let daemon = Daemon::start(bin(), lb.fp(), &allowed);
    let out = info_over_tcp(&lb, &format!("http://127.0.0.1:{port}"), &[]);
    assert!(
        out.status.success(),
        "plain TCP when allowed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    drop(daemon);
}
