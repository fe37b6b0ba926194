//! End to end: fp as a gateway with SNAT (masquerade) on its outside interface. Ten client
//! namespaces open 1000 TCP connections at once (100 each) through fp to an echo server
//! outside that has no route back to any client: every connection must reach it from fp's
//! outside address, each with its own source port, hold, and echo. IPv6 likewise (fewer).
//!
//! ```text
//!   client<i> (i < 10)                    fp                            net
//!  +--------+ 10.201.i.0/24     +----------------------+ 10.202.0.0/24 +----------------+
//!  |  eth0  |-------------------| c<i>           out0  |---------------|  eth0          |
//!  | .2/::2 | fd00:201:i::/64   | .1/::1   .1/::1 SNAT | fd00:202::/64 | .2/::2  echo   |
//!  +--------+                   +----------------------+               +----------------+
//!   default via fp                                                      no route to clients
//! ```
//!
//! fp's IPv6 forwarding is left off, as on a fresh host: the daemon turns it on for the
//! interfaces it translates on (`force_forwarding`, docs/kernel-settings.md).
//!
//! Checksums: offloads off on the clients and the server, as in `lb` (XDP sees full
//! checksums, as from a wire). Root only (never skipped). Debian packages: iproute2, python3,
//! ethtool.

use std::{collections::BTreeSet, path::Path, time::Duration};

use fastpath::testkit::netns::{
    Daemon, DaemonConfig, Spawned, TempDir, Topology, VethEnd, prepare_test, unique_pin_dir,
};

use crate::bin;

const CLIENTS: usize = 10;
const ECHO_PORT: u16 = 7000;
const SERVER4: &str = "10.202.0.2";
const SERVER6: &str = "fd00:202::2";
const SNAT4: &str = "10.202.0.1";
const SNAT6: &str = "fd00:202::1";

fn client_role(i: usize) -> String {
    format!("client{i}")
}

/// The topology above.
fn gateway_topology() -> Topology {
    let mut topo = Topology::new();
    let build = |topo: &mut Topology| -> Result<(), fastpath::testkit::netns::NetnsError> {
        topo.add_ns("fp")?;
        topo.add_ns("net")?;
        topo.ns("fp").sysctl("net.ipv4.ip_forward", "1")?;
        topo.veth(
            VethEnd::new("fp", "out0")
                .addr(&format!("{SNAT4}/24"))
                .addr(&format!("{SNAT6}/64")),
            VethEnd::new("net", "eth0")
                .addr(&format!("{SERVER4}/24"))
                .addr(&format!("{SERVER6}/64")),
        )?;
        for i in 0..CLIENTS {
            let role = client_role(i);
            topo.add_ns(&role)?;
            topo.veth(
                VethEnd::new(&role, "eth0")
                    .addr(&format!("10.201.{i}.2/24"))
                    .addr(&format!("fd00:201:{i}::2/64")),
                VethEnd::new("fp", &format!("c{i}"))
                    .addr(&format!("10.201.{i}.1/24"))
                    .addr(&format!("fd00:201:{i}::1/64")),
            )?;
            topo.ns(&role)
                .add_route("default", &format!("10.201.{i}.1"))?;
            topo.ns(&role)
                .add_route("default", &format!("fd00:201:{i}::1"))?;
        }
        Ok(())
    };
    build(&mut topo).unwrap_or_else(|e| panic!("building the gateway topology: {e}"));
    for role in std::iter::once("net".to_owned()).chain((0..CLIENTS).map(client_role)) {
        topo.ns(&role)
            .run(&["ethtool", "-K", "eth0", "tx", "off", "rx", "off"])
            .unwrap_or_else(|e| panic!("turning checksum offloads off in {role}: {e}"));
    }
    topo
}

/// The echo server on `addr`, recording the most connections it held at once in `stats`.
fn echo_server(topo: &Topology, script: &Path, addr: &str, stats: &Path) -> Spawned {
    let s = topo
        .ns("net")
        .spawn(&[
            "python3",
            script.to_str().expect("utf-8"),
            "server",
            addr,
            &ECHO_PORT.to_string(),
            stats.to_str().expect("utf-8"),
        ])
        .unwrap_or_else(|e| panic!("starting the echo server: {e}"));
    topo.ns("net")
        .wait_listening("tcp", ECHO_PORT, Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("{e}"));
    s
}

/// What one client process reported.
#[derive(serde::Deserialize)]
struct ClientReport {
    ok: usize,
    failed: Vec<String>,
    peers: Vec<(String, u16)>,
}

/// `per_client` connections from each client at once to `server`, held 3 s: every one must
/// reach the server from `snat` with a port of the default range, all ports distinct; the
/// server must have held them all at once.
fn concurrent_flows(topo: &Topology, daemon: &Daemon, server: &str, snat: &str, per_client: usize) {
    let dir = TempDir::new("gw").expect("temp dir");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/gateway/echo.py");
    let stats = dir.join("max-concurrent");
    let _server = echo_server(topo, &script, server, &stats);
    let mut clients: Vec<Spawned> = (0..CLIENTS)
        .map(|i| {
            topo.ns(&client_role(i))
                .spawn(&[
                    "python3",
                    script.to_str().expect("utf-8"),
                    "client",
                    server,
                    &ECHO_PORT.to_string(),
                    &per_client.to_string(),
                    "3",
                ])
                .unwrap_or_else(|e| panic!("starting client {i}: {e}"))
        })
        .collect();
    let mut peers = BTreeSet::new();
    let mut ok = 0;
    for (i, c) in clients.iter_mut().enumerate() {
        let status = c.wait_exit(Duration::from_secs(60));
        let log = c.log();
        assert!(
            status.is_some_and(|s| s.success()),
            "client {i} did not finish cleanly ({status:?}):\n{log}\ndaemon log:\n{}",
            daemon.log()
        );
        let line = log.lines().last().unwrap_or_default();
        let r: ClientReport = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("client {i} report {line:?}: {e}\n{log}"));
        assert!(
            r.failed.is_empty() && r.ok == per_client,
            "client {i}: {} of {per_client} connections worked; failures: {:?}",
            r.ok,
            r.failed
        );
        for (addr, port) in r.peers {
            assert_eq!(
                addr, snat,
                "client {i}: the server saw {addr}, not the gateway's address"
            );
            assert!(
                (1024..=32767).contains(&port),
                "source port {port} is outside the default range 1024-32767"
            );
            assert!(
                peers.insert(port),
                "source port {port} was given to two connections open at once"
            );
            ok += 1;
        }
    }
    let max: usize = std::fs::read_to_string(&stats)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    let total = CLIENTS * per_client;
    assert_eq!(ok, total, "connections that worked");
    assert!(
        max >= total,
        "the server held at most {max} connections at once; the clients opened {total} at once"
    );
    eprintln!(
        "{total} concurrent flows from {CLIENTS} clients through {snat}: all echoed; {} distinct source ports; the server held {max} at once",
        peers.len()
    );
}

#[test]
fn a_thousand_concurrent_flows_share_one_snat_address() {
    prepare_test(&["python3", "ethtool"]);
    let topo = gateway_topology();
    let mut config = DaemonConfig::new(&unique_pin_dir("gw"))
        .interface("out0")
        .interface_key("out0", "snat = true");
    for i in 0..CLIENTS {
        config = config.interface(&format!("c{i}"));
    }
    let daemon = Daemon::start(bin(), topo.ns("fp"), &config);
    assert!(
        daemon.log().contains("Gateway SNAT on"),
        "the daemon did not set up SNAT:\n{}",
        daemon.log()
    );
    concurrent_flows(&topo, &daemon, SERVER4, SNAT4, 100);
    concurrent_flows(&topo, &daemon, SERVER6, SNAT6, 20);
    let stats = fastpath::testkit::netns::host_run(&[
        bin().as_os_str(),
        "ct".as_ref(),
        "stats".as_ref(),
        "--pin-dir".as_ref(),
        daemon.pin_dir().as_os_str(),
    ])
    .unwrap_or_else(|e| panic!("ct stats: {e}"));
    eprintln!("{stats}");
    assert!(
        stats
            .lines()
            .any(|l| l.split_whitespace().eq(["snat_exhausted", "0"])),
        "no connection may have been refused for want of a port:\n{stats}"
    );
}

/// A static port forward: the outside server connects to fp's outside address, port 8080,
/// and reaches nginx on client 0, port 80, which sees the server's own address (DNAT keeps
/// the client's); the reply comes back from fp's address.
#[test]
fn a_port_forward_reaches_the_inside_host() {
    prepare_test(&["python3", "ethtool", "nginx", "curl"]);
    let topo = gateway_topology();
    let nginx = topo
        .ns(&client_role(0))
        .http_server(80)
        .unwrap_or_else(|e| panic!("nginx: {e}"));
    let config = DaemonConfig::new(&unique_pin_dir("pf"))
        .interface("out0")
        .interface("c0")
        .services(&format!(
            "[[port_forward]]\naddress = \"{SNAT4}\"\nport = 8080\nto = \"10.201.0.2\"\nto_port = 80\n\
             [[port_forward]]\naddress = \"{SNAT6}\"\nport = 8080\nto = \"fd00:201:0::2\"\nto_port = 80\n"
        ));
    let daemon = Daemon::start(bin(), topo.ns("fp"), &config);
    for (outside, server) in [(SNAT4, SERVER4), (SNAT6, SERVER6)] {
        let url = if outside.contains(':') {
            format!("http://[{outside}]:8080/peer")
        } else {
            format!("http://{outside}:8080/peer")
        };
        for n in 0..5 {
            let body = topo
                .ns("net")
                .run(&["curl", "-sS", "-g", "--fail", "--max-time", "5", &url])
                .unwrap_or_else(|e| panic!("curl {url} ({n}): {e}\n{}", daemon.log()));
            assert!(
                body.starts_with(&format!("{server} ")),
                "nginx behind the port forward saw {body:?}, not the outside client {server}"
            );
        }
        eprintln!("{url}: 5 requests forwarded to client0's nginx, which saw {server}");
    }
    drop(nginx);
}
