//! End to end: the load balancer (NAT mode, XDP) in front of three real nginx backends in the
//! `fp` node of [`lb_topology`]: curl against the VIP over IPv4 and IPv6 and UDP through
//! socat, each new connection landing on the backend the daemon's own Maglev table predicts
//! for its tuple, replies coming back from the VIP.
//!
//! Checksums: the client and backends send full checksums and verify what they receive
//! (`ethtool -K eth0 tx off rx off`), as traffic from a wire does. With offloads on, veth passes
//! partial checksums that XDP cannot tell apart and the receivers would not verify, which
//! would hide a wrong checksum.
//!
//! Root only (never skipped: without root these tests fail). Debian packages: iproute2,
//! nginx-light, curl, socat, ethtool.

use std::{collections::BTreeMap, fs, net::IpAddr, path::Path};

use fastpath::{
    config::{Config, InterfaceCheck},
    testkit::netns::{
        Daemon, HttpServer, LbTopology, TempDir, prepare_test, test_lb_topology, unique_pin_dir,
    },
};
use fastpath_common::ct::ct_key;

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_fastpath"))
}

const BACKENDS: usize = 3;
const VIP4: &str = "10.200.0.100";
const VIP6: &str = "fd00:200::100";

fn services() -> String {
    let mut s = String::new();
    for (vip, backend) in [
        (
            VIP4,
            (0..BACKENDS)
                .map(|i| LbTopology::backend_v4(i).to_string())
                .collect::<Vec<_>>(),
        ),
        (
            VIP6,
            (0..BACKENDS)
                .map(|i| LbTopology::backend_v6(i).to_string())
                .collect(),
        ),
    ] {
        s += &format!("[[service]]\nvip = \"{vip}\"\nport = 80\nprotocol = \"tcp\"\n");
        for b in backend {
            s += &format!("[[service.backend]]\naddress = \"{b}\"\nport = 80\n");
        }
    }
    s += &format!(
        "[[service]]\nvip = \"{VIP4}\"\nport = 53\nprotocol = \"udp\"\n[[service.backend]]\naddress = \"{}\"\nport = 9000\n",
        LbTopology::backend_v4(1)
    );
    s
}

/// The backend the daemon's table gives a connection from `client:port` to `vip:80`.
fn predicted(svcs: &str, svc: usize, client: IpAddr, port: u16, vip: IpAddr) -> IpAddr {
    predicted_in(svcs, svc, client, port, vip, 80)
}

#[test]
fn curl_through_the_vip_reaches_the_predicted_backends() {
    prepare_test(&["curl", "nginx", "socat", "ethtool"]);
    let dir = TempDir::new("lb").expect("temp dir");
    let lb = test_lb_topology(BACKENDS);
    checksum_offloads_off(&lb);
    let servers: Vec<HttpServer> = nginx_backends(&lb, "index.html", |i| format!("backend {i}\n"));
    let _udp = lb
        .backend(1)
        .spawn(&["socat", "UDP4-LISTEN:9000,fork", "PIPE"])
        .expect("UDP echo server");
    let svcs = services();
    let config = lb.fp_config(&unique_pin_dir("lb")).services(&svcs);
    let daemon = Daemon::start(bin(), lb.fp(), &config);
    assert!(
        daemon.log().contains("Services applied"),
        "the daemon did not apply the services; log:\n{}",
        daemon.log()
    );
    lb.backend(1)
        .wait_listening("udp", 9000, std::time::Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("{e}"));

    let backend_of = |body: &str| -> usize {
        body.trim()
            .strip_prefix("backend ")
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("unexpected page {body:?}"))
    };
    let mut hits: BTreeMap<(bool, usize), u32> = BTreeMap::new();
    for (v6, svc, vip, client, count) in [
        (
            false,
            0,
            VIP4.parse::<IpAddr>().unwrap(),
            IpAddr::from(LbTopology::client_v4()),
            24,
        ),
        (
            true,
            1,
            VIP6.parse().unwrap(),
            LbTopology::client_v6().into(),
            12,
        ),
    ] {
        for n in 0..count {
            let url = if v6 {
                format!("http://[{vip}]:80/")
            } else {
                format!("http://{vip}:80/")
            };
            let out = dir.join(format!("page-{v6}-{n}"));
            let port = lb
                .client()
                .run(&[
                    "curl",
                    "-sS",
                    "-g",
                    "--fail",
                    "--max-time",
                    "5",
                    "-o",
                    out.to_str().expect("utf-8"),
                    "-w",
                    "%{local_port}",
                    &url,
                ])
                .unwrap_or_else(|e| {
                    panic!(
                        "curl {url} (request {n}): {e}\ndaemon log:\n{}",
                        daemon.log()
                    )
                });
            let port: u16 = port.trim().parse().expect("curl -w %{local_port}");
            let body = fs::read_to_string(&out).unwrap_or_default();
            let got = backend_of(&body);
            let want_addr = predicted(&svcs, svc, client, port, vip);
            let want = (0..BACKENDS)
                .find(|&i| {
                    let b: IpAddr = if v6 {
                        LbTopology::backend_v6(i).into()
                    } else {
                        LbTopology::backend_v4(i).into()
                    };
                    b == want_addr
                })
                .expect("the predicted backend is one of ours");
            assert_eq!(
                got, want,
                "{client}:{port} -> {vip}:80 was answered by backend {got}; the daemon's table says {want}"
            );
            *hits.entry((v6, got)).or_default() += 1;
        }
    }
    eprintln!("connections per (ipv6, backend): {hits:?}");
    for v6 in [false, true] {
        let used = (0..BACKENDS)
            .filter(|&i| hits.contains_key(&(v6, i)))
            .count();
        assert!(
            used >= 2,
            "ipv6={v6}: all connections went to {used} backend(s): {hits:?}"
        );
    }

    // UDP through the VIP to the echo server on backend 1.
    let echo = lb
        .client()
        .run(&[
            "sh",
            "-c",
            &format!("echo hello-lb | socat -t 2 - UDP4:{VIP4}:53"),
        ])
        .unwrap_or_else(|e| panic!("UDP via the VIP: {e}"));
    assert_eq!(echo.trim(), "hello-lb", "UDP echo through the VIP");

    // The table shows each connection once, its reply coming from the backend.
    let list = ct_list(&daemon);
    let to_vip = list
        .lines()
        .filter(|l| l.contains(&format!("dst={VIP4} ")))
        .count();
    assert!(
        to_vip >= 24
            && list.contains(&format!(
                "src={} dst={}",
                LbTopology::backend_v4(1),
                LbTopology::client_v4()
            )),
        "expected the 24 IPv4 connections and the UDP flow to the VIP, replies from backends:\n{list}"
    );
    let stats = fastpath::datapath::pinned_stats(daemon.pin_dir()).expect("stats");
    let (to, from) = (
        stats.packets_for_reason(fastpath_common::reason::LB_TO_BACKEND),
        stats.packets_for_reason(fastpath_common::reason::LB_FROM_BACKEND),
    );
    eprintln!("lb_to_backend {to} packets, lb_from_backend {from} packets");

    // Per-service and per-backend counters: the connections each backend was given are the
    // ones the curls saw it answer.
    let json = fastpath::testkit::netns::host_run(&[
        bin().as_os_str(),
        "service".as_ref(),
        "list".as_ref(),
        "--pin-dir".as_ref(),
        daemon.pin_dir().as_os_str(),
        "-o".as_ref(),
        "json".as_ref(),
    ])
    .unwrap_or_else(|e| panic!("service list: {e}"));
    let rows: serde_json::Value = serde_json::from_str(&json).expect("service list JSON");
    let rows = rows.as_array().expect("a list of services");
    assert_eq!(rows.len(), 3, "{json}");
    for (v6, vip) in [(false, VIP4), (true, VIP6)] {
        let svc = rows
            .iter()
            .find(|r| r["vip"] == vip && r["port"] == 80)
            .unwrap_or_else(|| panic!("{vip}:80 not listed: {json}"));
        let mut total = 0;
        for (i, b) in svc["backends"]
            .as_array()
            .expect("backends")
            .iter()
            .enumerate()
        {
            let want = u64::from(hits.get(&(v6, i)).copied().unwrap_or(0));
            assert_eq!(b["connections"], want, "{vip} backend {i}: {json}");
            total += want;
        }
        assert_eq!(svc["connections"], total, "{vip}: {json}");
    }
    let svc_packets: u64 = rows
        .iter()
        .map(|r| r["packets"].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(
        svc_packets,
        to + from,
        "service packet counters vs the lb_* reasons: {json}"
    );
    eprintln!(
        "{}",
        fastpath::testkit::netns::host_run(&[
            bin().as_os_str(),
            "service".as_ref(),
            "list".as_ref(),
            "--pin-dir".as_ref(),
            daemon.pin_dir().as_os_str(),
        ])
        .unwrap_or_default()
    );
    assert!(
        to >= 36 * 5 && from >= 36 * 4,
        "every curl exchange was translated both ways: to {to}, from {from}"
    );
    drop(servers);
}

/// Client and backends send full checksums and verify what they receive (see the module
/// comment).
fn checksum_offloads_off(lb: &LbTopology) {
    lb.checksum_offloads_off()
        .unwrap_or_else(|e| panic!("turning checksum offloads off: {e}"));
}

/// `fastpath ct list` of the daemon's datapath.
fn ct_list(daemon: &Daemon) -> String {
    fastpath::testkit::netns::host_run(&[
        bin().as_os_str(),
        "ct".as_ref(),
        "list".as_ref(),
        "--pin-dir".as_ref(),
        daemon.pin_dir().as_os_str(),
    ])
    .unwrap_or_else(|e| panic!("ct list: {e}"))
}

/// nginx on port 80 of every backend, serving `page(i)` as `name`.
fn nginx_backends(lb: &LbTopology, name: &str, page: impl Fn(usize) -> String) -> Vec<HttpServer> {
    (0..BACKENDS)
        .map(|i| {
            let s = lb
                .backend(i)
                .http_server(80)
                .unwrap_or_else(|e| panic!("starting nginx: {e}"));
            fs::write(s.root().join(name), page(i)).expect("writing the page");
            s
        })
        .collect()
}

/// GET `http://VIP4/` from the client: which backend answered (its page says `backend N`).
fn fetch_vip(lb: &LbTopology, daemon: &Daemon) -> usize {
    let body = lb
        .client()
        .run(&[
            "curl",
            "-sS",
            "--fail",
            "--max-time",
            "5",
            &format!("http://{VIP4}/"),
        ])
        .unwrap_or_else(|e| panic!("curl: {e}\n{}", daemon.log()));
    body.trim()
        .strip_prefix("backend ")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("page {body:?}"))
}

/// `[[service.backend]]` tables for every backend's IPv4 address, on `port`, weight 1.
fn backends_v4(port: u16) -> String {
    (0..BACKENDS)
        .map(|i| {
            format!(
                "[[service.backend]]\naddress = \"{}\"\nport = {port}\n",
                LbTopology::backend_v4(i)
            )
        })
        .collect()
}

/// On each backend, a TCP server on port 7000 that greets with `backend-N` and then echoes;
/// returns once all listen.
fn banner_servers(lb: &LbTopology) -> Vec<fastpath::testkit::netns::Spawned> {
    let servers = (0..BACKENDS)
        .map(|i| {
            lb.backend(i)
                .spawn(&[
                    "socat",
                    "TCP4-LISTEN:7000,fork,reuseaddr",
                    &format!("SYSTEM:echo backend-{i}; cat"),
                ])
                .expect("echo server")
        })
        .collect();
    for i in 0..BACKENDS {
        lb.backend(i)
            .wait_listening("tcp", 7000, std::time::Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("{e}"));
    }
    servers
}

/// Connects from `client` (source port `sport`) to `vip:7000` and returns the banner of the
/// backend that answered (`backend-N`), sending one line and expecting it back.
fn banner(lb: &LbTopology, vip: &str, sport: u16) -> Result<String, String> {
    let out = lb
        .client()
        .exec(&[
            "sh",
            "-c",
            &format!("echo ping | socat -t 1 - TCP4:{vip}:7000,sourceport={sport},reuseaddr"),
        ])
        .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let mut lines = text.lines();
    match (lines.next(), lines.next()) {
        (Some(b), Some("ping")) if b.starts_with("backend-") => Ok(b.to_owned()),
        _ => Err(format!(
            "unexpected answer {text:?} ({}; {})",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )),
    }
}

/// Health checks with real servers: a backend whose HTTP health check fails is taken out
/// within interval × fall — new connections go elsewhere — while a connection it already has
/// keeps flowing through it to the end; when the check passes again it takes new connections.
#[test]
fn a_failing_backend_gets_no_new_connections_and_keeps_its_established_ones() {
    prepare_test(&["nginx", "socat", "ethtool"]);
    let dir = TempDir::new("lb-health").expect("temp dir");
    let lb = test_lb_topology(BACKENDS);
    let servers: Vec<HttpServer> = nginx_backends(&lb, "health", |_| "ok\n".to_owned());
    let _echo = banner_servers(&lb);
    const INTERVAL_MS: u64 = 100;
    const FALL: u64 = 2;
    let mut svc = format!(
        "[[service]]\nvip = \"{VIP4}\"\nport = 7000\n[service.health_check]\nkind = \"http\"\nport = 80\npath = \"/health\"\ninterval_ms = {INTERVAL_MS}\ntimeout_ms = 50\nrise = 2\nfall = {FALL}\n"
    );
    svc += &backends_v4(7000);
    let config = lb.fp_config(&unique_pin_dir("lb-health")).services(&svc);
    let daemon = Daemon::start(bin(), lb.fp(), &config);

    // Source ports whose connections the full table sends to backend 2.
    let victim = 2usize;
    let victim_addr: IpAddr = LbTopology::backend_v4(victim).into();
    let client: IpAddr = LbTopology::client_v4().into();
    let vip: IpAddr = VIP4.parse().unwrap();
    let to_victim: Vec<u16> = (20000..21000u16)
        .filter(|&p| predicted_in(&svc, 0, client, p, vip, 7000) == victim_addr)
        .take(6)
        .collect();
    assert_eq!(to_victim.len(), 6, "ports mapping to the victim");
    assert_eq!(banner(&lb, VIP4, to_victim[0]).as_deref(), Ok("backend-2"));

    // A long-lived connection on the victim: a line every 100 ms for 3 s.
    let long_out = dir.join("long.out");
    let lines = 30;
    let script = format!(
        "for i in $(seq 1 {lines}); do echo line$i; sleep 0.1; done | socat -t 2 - TCP4:{VIP4}:7000,sourceport={},reuseaddr > {}",
        to_victim[1],
        long_out.display()
    );
    let mut long = lb
        .client()
        .spawn(&["sh", "-c", &script])
        .expect("long client");
    std::thread::sleep(std::time::Duration::from_millis(500));

    // The victim fails its health check.
    let failed_at = std::time::Instant::now();
    fs::remove_file(servers[victim].root().join("health")).expect("removing the health page");
    let mut moved = None;
    while failed_at.elapsed() < std::time::Duration::from_secs(3) {
        if let Ok(b) = banner(&lb, VIP4, to_victim[2])
            && b != "backend-2"
        {
            moved = Some(failed_at.elapsed());
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let moved = moved.unwrap_or_else(|| {
        panic!(
            "backend 2 still takes new connections 3 s after failing; log:\n{}",
            daemon.log()
        )
    });
    eprintln!(
        "backend 2 failed its check; new connections avoided it after {moved:?} (interval {INTERVAL_MS} ms × fall {FALL})"
    );
    for &p in &to_victim[3..] {
        let b = banner(&lb, VIP4, p).unwrap_or_else(|e| panic!("{e}"));
        assert_ne!(
            b, "backend-2",
            "a new connection went to the failed backend"
        );
    }
    assert!(
        moved < std::time::Duration::from_millis(INTERVAL_MS * (FALL + 2) + 200),
        "took {moved:?} to take the failed backend out"
    );

    // The established connection kept its backend to the end.
    let status = long
        .wait_exit(std::time::Duration::from_secs(15))
        .expect("long client ends");
    let got = fs::read_to_string(&long_out).unwrap_or_default();
    let want: String = std::iter::once("backend-2\n".to_owned())
        .chain((1..=lines).map(|i| format!("line{i}\n")))
        .collect();
    assert!(
        status.success() && got == want,
        "the established connection on the failed backend broke: {status}, got {got:?}"
    );

    // Healthy again: after `rise` good probes it takes new connections.
    fs::write(servers[victim].root().join("health"), "ok\n").expect("health page back");
    let back = std::time::Instant::now();
    let mut returned = false;
    while back.elapsed() < std::time::Duration::from_secs(3) {
        if banner(&lb, VIP4, to_victim[4]).as_deref() == Ok("backend-2") {
            returned = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(
        returned,
        "backend 2 did not come back; log:\n{}",
        daemon.log()
    );
    eprintln!("backend 2 back after {:?}", back.elapsed());
    let log = daemon.log();
    assert!(
        log.contains("Services re-applied after a health change"),
        "{log}"
    );
}

/// The backend the daemon's own table (`lb::predict`) gives a TCP connection from
/// `client:sport` to `vip:vport`, service `svc` of `svcs`.
fn predicted_in(
    svcs: &str,
    svc: usize,
    client: IpAddr,
    sport: u16,
    vip: IpAddr,
    vport: u16,
) -> IpAddr {
    let text = format!("[[interface]]\nname = \"lo\"\n{svcs}");
    let config = Config::parse_with(Path::new("lb test"), &text, InterfaceCheck::Skip)
        .unwrap_or_else(|e| panic!("{e}"));
    let (a, family) = fastpath::lb::addr16(client);
    let (v, _) = fastpath::lb::addr16(vip);
    let key = ct_key(family, 6, &a, sport, &v, vport).0;
    let b = fastpath::lb::predict(&config.services, svc, &key)
        .unwrap_or_else(|e| panic!("{e}"))
        .expect("backends configured");
    if family == 4 {
        IpAddr::from([b.addr[0], b.addr[1], b.addr[2], b.addr[3]])
    } else {
        IpAddr::from(b.addr)
    }
}

/// Weighted round robin with real connections: weights 1, 1, 2 over three nginx backends give
/// new connections in that proportion (each CPU walks the sequence on its own, so over 40
/// connections a backend is off by at most one cycle per CPU).
#[test]
fn weighted_round_robin_spreads_connections_by_weight() {
    prepare_test(&["curl", "nginx"]);
    let lb = test_lb_topology(BACKENDS);
    let servers: Vec<HttpServer> = nginx_backends(&lb, "index.html", |i| format!("backend {i}\n"));
    let mut svc = format!("[[service]]\nvip = \"{VIP4}\"\nport = 80\nscheduler = \"wrr\"\n");
    for (i, w) in [1, 1, 2].iter().enumerate() {
        svc += &format!(
            "[[service.backend]]\naddress = \"{}\"\nport = 80\nweight = {w}\n",
            LbTopology::backend_v4(i)
        );
    }
    let config = lb.fp_config(&unique_pin_dir("lb-wrr")).services(&svc);
    let daemon = Daemon::start(bin(), lb.fp(), &config);
    let mut seen = [0u32; BACKENDS];
    const N: u32 = 40;
    for _ in 0..N {
        seen[fetch_vip(&lb, &daemon)] += 1;
    }
    eprintln!("wrr 1:1:2 over {N} connections: {seen:?}");
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get()) as u32;
    for (i, want) in [N / 4, N / 4, N / 2].into_iter().enumerate() {
        assert!(
            seen[i].abs_diff(want) <= 2 * cpus,
            "backend {i}: {} connections, expected about {want}: {seen:?}",
            seen[i]
        );
    }
    drop(servers);
}

/// Source-IP affinity: every new connection of a client goes to the backend its first one got
/// (Maglev alone would spread them by source port); when that backend fails its health check,
/// the client moves to another one and sticks there.
#[test]
fn source_ip_affinity_keeps_a_client_on_one_backend() {
    prepare_test(&["curl", "nginx"]);
    let lb = test_lb_topology(BACKENDS);
    let mut servers: Vec<HttpServer> =
        nginx_backends(&lb, "index.html", |i| format!("backend {i}\n"));
    let mut svc = format!(
        "[[service]]\nvip = \"{VIP4}\"\nport = 80\naffinity_timeout_s = 60\n[service.health_check]\nkind = \"tcp\"\ninterval_ms = 100\ntimeout_ms = 50\nfall = 2\n"
    );
    svc += &backends_v4(80);
    let config = lb.fp_config(&unique_pin_dir("lb-aff")).services(&svc);
    let daemon = Daemon::start(bin(), lb.fp(), &config);
    let fetch = || fetch_vip(&lb, &daemon);
    let first = fetch();
    let rest: Vec<usize> = (0..15).map(|_| fetch()).collect();
    assert!(
        rest.iter().all(|&b| b == first),
        "with affinity every connection goes to backend {first}: {rest:?}"
    );
    // Its backend fails: the client moves on, and sticks to the new one.
    servers[first].process().kill();
    std::thread::sleep(std::time::Duration::from_millis(600));
    let moved: Vec<usize> = (0..10).map(|_| fetch()).collect();
    assert!(
        moved.iter().all(|&b| b == moved[0] && b != first),
        "after backend {first} failed: {moved:?}"
    );
    eprintln!(
        "affinity: 16 connections on backend {first}; after it failed, 10 on backend {}",
        moved[0]
    );
}

/// Least connections with real long-lived connections: each new connection goes to the
/// backend with the fewest open ones (ties: the first), so 9 connections opened one after the
/// other land 0, 1, 2, 0, 1, 2, ...; a connection that closes frees its backend's place.
#[test]
fn least_connections_fills_the_least_loaded_backend() {
    prepare_test(&["socat"]);
    let dir = TempDir::new("lb-lc").expect("temp dir");
    let lb = test_lb_topology(BACKENDS);
    let _echo = banner_servers(&lb);
    let mut svc =
        format!("[[service]]\nvip = \"{VIP4}\"\nport = 7000\nscheduler = \"least_connections\"\n");
    svc += &backends_v4(7000);
    let config = lb.fp_config(&unique_pin_dir("lb-lc")).services(&svc);
    let daemon = Daemon::start(bin(), lb.fp(), &config);
    // Opens a connection that stays open and returns its backend.
    let open = |n: usize| {
        let out = dir.join(format!("conn{n}"));
        // One process holding the connection (reads only, never ends it), so killing it
        // closes the connection.
        let script = format!("exec socat -u TCP4:{VIP4}:7000 CREATE:{}", out.display());
        let child = lb.client().spawn(&["sh", "-c", &script]).expect("client");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            let text = fs::read_to_string(&out).unwrap_or_default();
            if let Some(b) = text.lines().next().and_then(|l| l.strip_prefix("backend-")) {
                return (child, b.parse::<usize>().expect("backend number"));
            }
            assert!(
                std::time::Instant::now() < deadline,
                "connection {n} got no banner; log:\n{}",
                daemon.log()
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    };
    let mut conns = Vec::new();
    for n in 0..9 {
        conns.push(open(n));
    }
    let order: Vec<usize> = conns.iter().map(|(_, b)| *b).collect();
    eprintln!("least connections, 9 long-lived connections: {order:?}");
    assert_eq!(order, vec![0, 1, 2, 0, 1, 2, 0, 1, 2]);
    // Two of backend 1's connections close: the next two go there.
    for (child, _) in conns.iter_mut().filter(|(_, b)| *b == 1).take(2) {
        child.kill();
    }
    std::thread::sleep(std::time::Duration::from_millis(300));
    let next: Vec<usize> = (9..11).map(|n| open(n).1).collect();
    assert_eq!(
        next,
        vec![1, 1],
        "the freed places of backend 1 are taken first"
    );
}

/// Full-NAT: the backends see the load balancer's source address (`snat_address`, with a port
/// from the service's range), not the client's, and their replies come back through fp
/// although they cannot reach the client at all (a blackhole route to the client's network
/// on every backend). IPv4 and IPv6; every request must succeed.
#[test]
fn full_nat_backends_see_the_lb_address() {
    prepare_test(&["curl", "nginx", "ethtool"]);
    let lb = test_lb_topology(BACKENDS);
    checksum_offloads_off(&lb);
    for i in 0..BACKENDS {
        for net in ["10.200.1.0/24", "fd00:200:1::/64"] {
            lb.backend(i)
                .run(&["ip", "route", "add", "blackhole", net])
                .unwrap_or_else(|e| panic!("blackholing the client's network: {e}"));
        }
    }
    let servers = nginx_backends(&lb, "index.html", |i| format!("backend {i}\n"));
    const SNAT4: &str = "10.200.0.1";
    const SNAT6: &str = "fd00:200::1";
    let mut svcs = String::new();
    for (vip, snat, v6) in [(VIP4, SNAT4, false), (VIP6, SNAT6, true)] {
        svcs += &format!(
            "[[service]]\nvip = \"{vip}\"\nport = 80\nmode = \"full_nat\"\nsnat_address = \"{snat}\"\nsnat_ports = \"20000-29999\"\n"
        );
        for i in 0..BACKENDS {
            let b: IpAddr = if v6 {
                LbTopology::backend_v6(i).into()
            } else {
                LbTopology::backend_v4(i).into()
            };
            svcs += &format!("[[service.backend]]\naddress = \"{b}\"\nport = 80\n");
        }
    }
    let config = lb.fp_config(&unique_pin_dir("fullnat")).services(&svcs);
    let daemon = Daemon::start(bin(), lb.fp(), &config);
    let mut ports = std::collections::BTreeSet::new();
    for (vip, snat, n) in [(VIP4, SNAT4, 30), (VIP6, SNAT6, 10)] {
        let url = if vip.contains(':') {
            format!("http://[{vip}]:80/peer")
        } else {
            format!("http://{vip}:80/peer")
        };
        for req in 0..n {
            let body = lb
                .client()
                .run(&["curl", "-sS", "-g", "--fail", "--max-time", "5", &url])
                .unwrap_or_else(|e| panic!("curl {url} (request {req}): {e}\n{}", daemon.log()));
            let (addr, port) = body
                .trim()
                .split_once(' ')
                .unwrap_or_else(|| panic!("unexpected /peer answer {body:?}"));
            assert_eq!(
                addr, snat,
                "request {req} to {vip}: the backend saw {addr}, not the LB address {snat}"
            );
            let port: u16 = port.parse().expect("a port");
            assert!(
                (20000..=29999).contains(&port),
                "source port {port} is outside the service's range 20000-29999"
            );
            ports.insert((vip, port));
        }
    }
    eprintln!(
        "40 requests through full-NAT, all seen from the LB address, {} distinct source ports",
        ports.len()
    );
    // The table shows the replies going to the LB address (as `conntrack -L` shows SNAT).
    let list = ct_list(&daemon);
    let line = list
        .lines()
        .find(|l| l.contains(&format!("dst={VIP4} ")))
        .unwrap_or_else(|| panic!("no connection to {VIP4}:\n{list}"));
    assert!(
        line.contains(&format!("dst={SNAT4} sport=80 dport=2")),
        "the reply tuple goes to the LB address: {line}"
    );
    eprintln!("{line}");
    drop(servers);
}
