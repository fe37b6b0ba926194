//! The `/metrics` endpoint as an HTTP server, end to end in the `fp` node of the
//! load-balancer topology: the exposition with the text format's content type, scrapes that
//! share one kept-alive connection, 404 for other paths, 405 with `Allow: GET` for other
//! methods, and a client that never sends its request head is disconnected.
//!
//! Root only (never skipped). Debian packages: iproute2, curl.

use std::{
    io::Read as _,
    net::TcpStream,
    time::{Duration, Instant},
};

use fastpath::testkit::netns::{Daemon, prepare_test, test_lb_topology, unique_pin_dir};

use crate::bin;

const PORT: u16 = 9465;

#[test]
fn metrics_endpoint_speaks_http() {
    prepare_test(&["curl"]);
    let lb = test_lb_topology(1);
    let pin = unique_pin_dir("metrics-http");
    let config = lb
        .fp_config(&pin)
        .raw(&format!("[api]\nmetrics_listen = \"127.0.0.1:{PORT}\"\n"));
    let daemon = Daemon::start(bin(), lb.fp(), &config);
    lb.fp().link_up("lo").expect("lo up");
    lb.fp()
        .wait_listening("tcp", PORT, Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));
    let url = format!("http://127.0.0.1:{PORT}/metrics");
    let curl = |args: &[&str]| -> String {
        let mut all = vec!["curl", "-sS", "--max-time", "10"];
        all.extend_from_slice(args);
        lb.fp()
            .run(&all[..])
            .unwrap_or_else(|e| panic!("{all:?}: {e}\n{}", daemon.log()))
    };

    // The exposition, with the text format's content type.
    let head = curl(&["-D", "-", "-o", "/dev/null", &url]).to_ascii_lowercase();
    assert!(
        head.starts_with("http/1.1 200"),
        "expected 200 for GET /metrics, got:\n{head}"
    );
    assert!(
        head.contains("content-type: text/plain; version=0.0.4; charset=utf-8"),
        "expected the text format 0.0.4 content type, got:\n{head}"
    );
    let body = curl(&[&url]);
    assert!(
        body.contains("# TYPE fastpath_up gauge\nfastpath_up 1\n"),
        "expected fastpath_up 1 in:\n{body}"
    );

    // Two scrapes, one connection: the second makes no new connection.
    let connects = curl(&[
        "-o",
        "/dev/null",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code} %{num_connects}\n",
        &url,
        &url,
    ]);
    assert_eq!(
        connects, "200 1\n200 0\n",
        "expected two 200s over one connection (http_code num_connects per request)"
    );

    // Other paths and methods.
    let status = curl(&[
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        &format!("http://127.0.0.1:{PORT}/other"),
    ]);
    assert_eq!(status, "404", "GET /other");
    let head = curl(&["-X", "POST", "-D", "-", "-o", "/dev/null", &url]).to_ascii_lowercase();
    assert!(
        head.starts_with("http/1.1 405") && head.contains("allow: get"),
        "expected 405 with Allow: GET for POST /metrics, got:\n{head}"
    );

    // A client that connects and sends nothing is disconnected after the head timeout (5 s).
    let (waited, outcome) = lb
        .fp()
        .in_netns(|| {
            let mut sock = TcpStream::connect(("127.0.0.1", PORT))
                .unwrap_or_else(|e| panic!("connecting to the metrics port: {e}"));
            sock.set_read_timeout(Some(Duration::from_secs(15)))
                .expect("read timeout");
            let started = Instant::now();
            let mut buf = [0u8; 512];
            let outcome = sock.read(&mut buf);
            (started.elapsed(), outcome.map_err(|e| e.kind()))
        })
        .unwrap_or_else(|e| panic!("entering the fp namespace: {e}"));
    eprintln!("silent client: {outcome:?} after {waited:?}");
    match outcome {
        Ok(_) | Err(std::io::ErrorKind::ConnectionReset) => {}
        Err(kind) => panic!("expected the server to close a silent connection, got {kind:?}"),
    }
    assert!(
        (Duration::from_secs(4)..Duration::from_secs(10)).contains(&waited),
        "expected the silent connection closed after about 5 s, took {waited:?}"
    );
    assert!(
        curl(&[&url]).contains("fastpath_up 1"),
        "the endpoint still answers after a silent client"
    );
}
