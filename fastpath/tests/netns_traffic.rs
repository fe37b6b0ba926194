//! End to end: real traffic (ping, curl against nginx, iperf3, UDP sockets) through the
//! datapath the daemon attaches to every interface of the `fp` node of [`lb_topology`],
//! checking that the reason-coded counters moved as the traffic says.
//!
//! Root only (never skipped: without root these tests fail). Tools, Debian packages that
//! `cargo xtask bootstrap` installs: iproute2, iputils-ping, curl, nginx-light, iperf3, bpftool.
//! Run with `--test-threads=1`: the tests share the kernel (bpffs, /run/fastpath); each still
//! has its own namespaces and pin directory.

use std::{
    fs,
    net::{IpAddr, SocketAddr, UdpSocket},
    path::{Path, PathBuf},
    time::Duration,
};

use fastpath::{
    stats::StatsSnapshot,
    testkit::netns::{
        Daemon, DaemonConfig, HookedInterface, LbTopology, Netns, PREFIX, TempDir, host_run,
        lb_topology, require_root, require_tools, run_daemon_to_exit, sweep_stale, unique_pin_dir,
    },
};
use fastpath_common::{Counter, Hook, Verdict, reason};

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_fastpath"))
}

/// Root and tools present, and leftovers of killed earlier runs removed.
fn setup(tools: &[&str]) {
    require_root();
    require_tools(&["ip", "ss"]);
    require_tools(tools);
    match sweep_stale(PREFIX) {
        Ok(removed) if !removed.is_empty() => {
            eprintln!("removed leftovers of dead runs: {removed:?}")
        }
        Ok(_) => {}
        Err(e) => panic!("sweeping leftovers of earlier runs: {e}"),
    }
}

fn topology(backends: usize) -> LbTopology {
    lb_topology(backends).unwrap_or_else(|e| panic!("building the lb topology: {e}"))
}

/// Frame sizes as the hooks count them (Ethernet header included, no FCS).
const ETH: u64 = 14;
const IPV4: u64 = 20;
const IPV6: u64 = 40;
const UDP: u64 = 8;
/// `ping` default: 56 bytes of data after the 8-byte ICMP header.
const PING_ICMP: u64 = 64;

/// Pings `target` `count` times from `ns` (fast interval, bounded by a deadline) and panics
/// unless every echo got its reply.
fn ping(ns: &Netns, target: IpAddr, count: u32) {
    let mut args = vec!["ping".to_owned()];
    if target.is_ipv6() {
        args.push("-6".into());
    }
    let count_s = count.to_string();
    let target_s = target.to_string();
    // No -w: with a deadline, ping keeps sending until it has `count` replies.
    args.extend(
        [
            "-q", "-n", "-c", &count_s, "-i", "0.01", "-W", "2", &target_s,
        ]
        .map(String::from),
    );
    let out = ns.exec(&args).unwrap_or_else(|e| panic!("{e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let want = format!("{count} packets transmitted, {count} received");
    assert!(
        out.status.success() && stdout.contains(&want),
        "expected `{want}` pinging {target} from {}; got {}:\n{stdout}{}",
        ns.name(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The counter of (hook, kernel verdict, reason).
fn kernel(s: &StatsSnapshot, hook: Hook, code: u32) -> Counter {
    s.get(hook, Verdict::Kernel, code)
}

/// Asserts nothing was dropped or forwarded: the datapath has no stage that claims traffic
/// yet, so every packet must go to the kernel.
fn assert_all_to_kernel(delta: &StatsSnapshot) {
    let claimed: Vec<_> = delta
        .rows()
        .into_iter()
        .filter(|r| r.verdict != "kernel")
        .collect();
    assert!(
        claimed.is_empty(),
        "expected every packet handed to the kernel, but some were claimed: {claimed:?}"
    );
}

/// Asserts `reason` counted exactly `packets` packets of `frame` bytes on every hook.
fn assert_exact_on_every_hook(delta: &StatsSnapshot, code: u32, packets: u64, frame: u64) {
    for hook in Hook::ALL {
        let got = kernel(delta, hook, code);
        let want = Counter {
            packets,
            bytes: packets * frame,
        };
        assert_eq!(
            got,
            want,
            "{} on {}: expected exactly {packets} packets of {frame} bytes; counters moved by:\n{}",
            reason::name(code),
            hook.name(),
            delta.render_table()
        );
    }
}

/// (a) ICMP: every echo request and reply crosses fp once in each direction, so with all hooks
/// on every fp interface each hook counts exactly 2 packets per ping (XDP and TC ingress where
/// it enters fp, TC egress where it leaves). IPv6 adds background MLD reports (also ICMPv6),
/// so there the count is bounded from both sides.
#[test]
fn ping_v4_and_v6_through_fp_is_counted_on_every_hook() {
    setup(&["ping"]);
    let lb = topology(2);
    let daemon = Daemon::start(bin(), lb.fp(), &lb.fp_config(&unique_pin_dir("icmp")));
    const N: u32 = 20;

    let before = daemon.stats();
    for i in 0..lb.backends() {
        ping(lb.client(), LbTopology::backend_v4(i).into(), N);
    }
    let delta = daemon.stats().delta(&before);
    let pings = u64::from(N) * lb.backends() as u64;
    assert_exact_on_every_hook(
        &delta,
        reason::NO_STAGE_IPV4_ICMP,
        2 * pings,
        ETH + IPV4 + PING_ICMP,
    );
    assert_all_to_kernel(&delta);

    let before = daemon.stats();
    for i in 0..lb.backends() {
        ping(lb.client(), LbTopology::backend_v6(i).into(), N);
    }
    let delta = daemon.stats().delta(&before);
    eprintln!("IPv6 pings moved:\n{}", delta.render_table());
    // Background ICMPv6 that may cross the same interfaces meanwhile: MLD reports after the
    // links came up. Generous, yet far below what double counting would add (2 * pings).
    const NOISE: u64 = 16;
    for hook in Hook::ALL {
        let got = kernel(&delta, hook, reason::NO_STAGE_IPV6_ICMP);
        assert!(
            (2 * pings..=2 * pings + NOISE).contains(&got.packets)
                && got.bytes >= 2 * pings * (ETH + IPV6 + PING_ICMP),
            "no_stage_ipv6_icmp on {}: expected {}..={} packets and at least {} bytes; counters moved by:\n{}",
            hook.name(),
            2 * pings,
            2 * pings + NOISE,
            2 * pings * (ETH + IPV6 + PING_ICMP),
            delta.render_table()
        );
        let v4 = kernel(&delta, hook, reason::NO_STAGE_IPV4_ICMP);
        assert_eq!(
            v4,
            Counter::default(),
            "no IPv4 ICMP was sent, yet {} counted {v4:?}",
            hook.name()
        );
    }
    assert_all_to_kernel(&delta);
}

/// A deterministic, incompressible payload.
fn payload(len: usize) -> Vec<u8> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// (b) TCP: a real HTTP download (nginx in backend0, curl in the client) over
/// IPv4 and IPv6. The body must arrive intact, and each hook must have counted at least the
/// handshake and data packets and at least the payload's bytes under the family's TCP reason.
#[test]
fn http_download_v4_and_v6_through_fp_is_counted_as_tcp() {
    setup(&["curl", "nginx"]);
    let lb = topology(1);
    let daemon = Daemon::start(bin(), lb.fp(), &lb.fp_config(&unique_pin_dir("tcp")));

    const PAYLOAD: usize = 256 * 1024;
    let server = lb
        .backend(0)
        .http_server(8080)
        .unwrap_or_else(|e| panic!("starting nginx: {e}"));
    let body = payload(PAYLOAD);
    fs::write(server.root().join("payload.bin"), &body).expect("writing the payload");
    let downloads = TempDir::new("downloads").expect("temp dir");

    for (family, addr, code) in [
        (
            "IPv4",
            LbTopology::backend_v4(0).to_string(),
            reason::NO_STAGE_IPV4_TCP,
        ),
        (
            "IPv6",
            format!("[{}]", LbTopology::backend_v6(0)),
            reason::NO_STAGE_IPV6_TCP,
        ),
    ] {
        let out_file = downloads.join(format!("download-{family}.bin"));
        let out_s = out_file.to_str().expect("utf-8 path").to_owned();
        let url = format!("http://{addr}:8080/payload.bin");
        let before = daemon.stats();
        lb.client()
            .run(&[
                "curl",
                "-sS",
                "-g",
                "--fail",
                "--max-time",
                "20",
                "-o",
                &out_s,
                &url,
            ])
            .unwrap_or_else(|e| panic!("{family} download through fp: {e}"));
        let delta = daemon.stats().delta(&before);
        eprintln!("{family} download moved:\n{}", delta.render_table());

        let got = fs::read(&out_file).unwrap_or_default();
        assert!(
            got == body,
            "{family}: expected the {PAYLOAD}-byte payload, got {} bytes that differ",
            got.len()
        );
        for hook in Hook::ALL {
            let c = kernel(&delta, hook, code);
            // At least SYN, ACK, request from the client and SYN-ACK, data, FIN from the server
            // (GRO may merge data segments before TC, so no more is promised per packet).
            assert!(
                c.packets >= 6 && c.bytes >= PAYLOAD as u64,
                "{family} {} on {}: expected at least 6 packets and {PAYLOAD} bytes; counters moved by:\n{}",
                reason::name(code),
                hook.name(),
                delta.render_table()
            );
        }
        // XDP sees every segment as sent (no GRO before XDP; a veth peer with XDP attached
        // sends no GSO): at least one packet per MTU of payload.
        let xdp = kernel(&delta, Hook::Xdp, code);
        assert!(
            xdp.packets >= (PAYLOAD / 1500) as u64,
            "{family}: expected at least {} TCP segments at XDP for {PAYLOAD} bytes, got {}; counters moved by:\n{}",
            PAYLOAD / 1500,
            xdp.packets,
            delta.render_table()
        );
        assert_all_to_kernel(&delta);
    }
}

/// (c) UDP with a real tool: iperf3 sends a known number of datagrams; XDP and both TC hooks
/// must count at least that many (iperf3 adds a few of its own: the UDP "connect" exchange)
/// and at least their bytes.
#[test]
fn iperf3_udp_datagrams_are_counted() {
    setup(&["iperf3"]);
    let lb = topology(1);
    let daemon = Daemon::start(bin(), lb.fp(), &lb.fp_config(&unique_pin_dir("iperf3")));
    let _server = lb
        .backend(0)
        .spawn(&["iperf3", "-s", "-p", "5201"])
        .expect("starting the iperf3 server");
    lb.backend(0)
        .wait_listening("tcp", 5201, Duration::from_secs(10))
        .expect("iperf3 server listening");

    const DATAGRAMS: u64 = 500;
    const LEN: u64 = 1000;
    let target = LbTopology::backend_v4(0).to_string();
    let before = daemon.stats();
    let report = lb
        .client()
        .run(&[
            "iperf3",
            "-c",
            &target,
            "-p",
            "5201",
            "-u",
            "-b",
            "20M",
            "-l",
            &LEN.to_string(),
            "-k",
            &DATAGRAMS.to_string(),
            "-J",
        ])
        .unwrap_or_else(|e| panic!("iperf3 client: {e}"));
    let delta = daemon.stats().delta(&before);
    eprintln!("iperf3 moved:\n{}", delta.render_table());

    let json: serde_json::Value =
        serde_json::from_str(&report).unwrap_or_else(|e| panic!("iperf3 -J output: {e}\n{report}"));
    let sent = json["end"]["sum"]["packets"]
        .as_u64()
        .unwrap_or_else(|| panic!("no end.sum.packets in:\n{report}"));
    assert_eq!(sent, DATAGRAMS, "iperf3 should send exactly -k datagrams");
    for hook in Hook::ALL {
        let c = kernel(&delta, hook, reason::NO_STAGE_IPV4_UDP);
        assert!(
            c.packets >= sent
                && c.packets <= sent + 8
                && c.bytes >= sent * (ETH + IPV4 + UDP + LEN),
            "no_stage_ipv4_udp on {}: expected {sent}..={} packets and at least {} bytes; counters moved by:\n{}",
            hook.name(),
            sent + 8,
            sent * (ETH + IPV4 + UDP + LEN),
            delta.render_table()
        );
        // iperf3's control connection is TCP.
        assert!(
            kernel(&delta, hook, reason::NO_STAGE_IPV4_TCP).packets >= 3,
            "iperf3 control connection not counted:\n{}",
            delta.render_table()
        );
    }
    assert_all_to_kernel(&delta);
}

/// (c') UDP, exactly: sockets opened inside the client and backend namespaces exchange a known
/// number of datagrams of a known size (one-way; each received before the next is sent, so
/// none is lost to a full socket buffer). Nothing else sends UDP in the topology, so every
/// hook counts exactly that many packets and bytes, for IPv4 and for IPv6.
#[test]
fn udp_datagrams_are_counted_exactly() {
    setup(&[]);
    let lb = topology(1);
    let daemon = Daemon::start(bin(), lb.fp(), &lb.fp_config(&unique_pin_dir("udp")));
    const N: u64 = 200;
    const LEN: usize = 512;

    for (client_addr, server_addr, code, ip) in [
        (
            IpAddr::from(LbTopology::client_v4()),
            IpAddr::from(LbTopology::backend_v4(0)),
            reason::NO_STAGE_IPV4_UDP,
            IPV4,
        ),
        (
            IpAddr::from(LbTopology::client_v6()),
            IpAddr::from(LbTopology::backend_v6(0)),
            reason::NO_STAGE_IPV6_UDP,
            IPV6,
        ),
    ] {
        let server = lb
            .backend(0)
            .in_netns(|| UdpSocket::bind(SocketAddr::new(server_addr, 9000)))
            .expect("entering backend0")
            .unwrap_or_else(|e| panic!("binding {server_addr}:9000 in backend0: {e}"));
        server
            .set_read_timeout(Some(Duration::from_secs(2)))
            .expect("read timeout");
        let client = lb
            .client()
            .in_netns(|| UdpSocket::bind(SocketAddr::new(client_addr, 0)))
            .expect("entering client")
            .unwrap_or_else(|e| panic!("binding {client_addr} in client: {e}"));

        let before = daemon.stats();
        let mut buf = [0u8; 2048];
        for i in 0..N {
            let msg = [i as u8; LEN];
            client
                .send_to(&msg, (server_addr, 9000))
                .unwrap_or_else(|e| panic!("sending datagram {i}: {e}"));
            let (n, from) = server
                .recv_from(&mut buf)
                .unwrap_or_else(|e| panic!("datagram {i} to {server_addr} never arrived: {e}"));
            assert_eq!(
                (n, from.ip(), buf[0]),
                (LEN, client_addr, i as u8),
                "datagram {i} arrived mangled"
            );
        }
        let delta = daemon.stats().delta(&before);
        assert_exact_on_every_hook(&delta, code, N, ETH + ip + UDP + LEN as u64);
        assert_all_to_kernel(&delta);
    }
}

/// The bpf_link id behind every pin under `<pin_dir>/links`, read with bpftool.
fn pinned_link_ids(pin_dir: &Path) -> Vec<(String, u64)> {
    let mut ids = Vec::new();
    for entry in fs::read_dir(pin_dir.join("links"))
        .expect("links dir")
        .flatten()
    {
        let path = entry.path();
        let json = host_run(&[
            "bpftool",
            "-j",
            "link",
            "show",
            "pinned",
            path.to_str().expect("utf-8"),
        ])
        .unwrap_or_else(|e| panic!("{e}"));
        let v: serde_json::Value =
            serde_json::from_str(&json).unwrap_or_else(|e| panic!("bpftool json: {e}: {json}"));
        let id = v["id"]
            .as_u64()
            .unwrap_or_else(|| panic!("no link id in {json}"));
        ids.push((entry.file_name().to_string_lossy().into_owned(), id));
    }
    ids.sort();
    ids
}

fn link_exists(id: u64) -> bool {
    host_run(&["bpftool", "link", "show", "id", &id.to_string()]).is_ok()
}

fn assert_xdp_on_every_fp_interface(lb: &LbTopology, attached: bool, when: &str) {
    for dev in lb.fp_interfaces() {
        let shown = lb.fp().link_show(&dev).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            shown.contains("prog/xdp"),
            attached,
            "{when}: expected XDP {} on fp/{dev}; `ip -d link show` says:\n{shown}",
            if attached { "attached" } else { "not attached" }
        );
    }
}

/// (d) kill -9 leaves the datapath running (pinned links keep programs attached, pinned maps
/// keep counting); a new daemon reuses the pinned maps and links, so counters continue; a clean
/// stop then removes everything.
#[test]
fn kill9_keeps_the_datapath_and_a_restart_continues_its_counters() {
    setup(&["ping", "bpftool"]);
    let lb = topology(1);
    let pin_dir = unique_pin_dir("restart");
    let mut daemon = Daemon::start(bin(), lb.fp(), &lb.fp_config(&pin_dir));
    const N: u32 = 10;
    let backend: IpAddr = LbTopology::backend_v4(0).into();
    let frame = ETH + IPV4 + PING_ICMP;
    let expect_pings = |before: &StatsSnapshot, after: &StatsSnapshot, when: &str| {
        let delta = after.delta(before);
        for hook in Hook::ALL {
            let c = kernel(&delta, hook, reason::NO_STAGE_IPV4_ICMP);
            assert_eq!(
                c,
                Counter {
                    packets: 2 * u64::from(N),
                    bytes: 2 * u64::from(N) * frame
                },
                "{when}: expected {} ICMP packets on {}; counters moved by:\n{}",
                2 * N,
                hook.name(),
                delta.render_table()
            );
        }
    };

    let s0 = daemon.stats();
    ping(lb.client(), backend, N);
    let s1 = daemon.stats();
    expect_pings(&s0, &s1, "with the daemon running");
    let links = pinned_link_ids(&pin_dir);
    assert_eq!(
        links.len(),
        6,
        "expected 3 hooks on 2 interfaces pinned, got {links:?}"
    );

    daemon.kill9();
    assert!(!daemon.is_running(), "daemon survived SIGKILL");
    assert!(
        pin_dir.join("maps").is_dir(),
        "kill -9 must leave the pins in place"
    );
    assert_xdp_on_every_fp_interface(&lb, true, "after kill -9");
    ping(lb.client(), backend, N);
    let s2 = daemon.stats();
    expect_pings(&s1, &s2, "after kill -9, with no daemon");

    // The CLI reads the same pinned map.
    let json = host_run(&[
        bin().to_str().expect("utf-8"),
        "stats",
        "--pin-dir",
        pin_dir.to_str().expect("utf-8"),
        "-o",
        "json",
    ])
    .unwrap_or_else(|e| panic!("{e}"));
    let rows: serde_json::Value =
        serde_json::from_str(&json).unwrap_or_else(|e| panic!("stats json: {e}\n{json}"));
    let xdp_icmp = rows
        .as_array()
        .and_then(|rows| {
            rows.iter().find(|r| {
                r["hook"] == "xdp"
                    && r["verdict"] == "kernel"
                    && r["reason"] == "no_stage_ipv4_icmp"
            })
        })
        .and_then(|r| r["packets"].as_u64());
    assert_eq!(
        xdp_icmp,
        Some(kernel(&s2, Hook::Xdp, reason::NO_STAGE_IPV4_ICMP).packets),
        "`fastpath stats -o json`:\n{json}"
    );

    daemon.restart();
    let log = daemon.log();
    for want in [
        "Reusing pinned maps",
        "Reused pinned XDP link",
        "Reused pinned TCX link",
    ] {
        assert!(
            log.contains(want),
            "expected the restarted daemon to log {want:?}; log:\n{log}"
        );
    }
    assert_eq!(
        pinned_link_ids(&pin_dir),
        links,
        "a restart must keep the same links (program swapped in place)"
    );
    let s3 = daemon.stats();
    for (slot, was) in &s2.slots {
        let now = s3.slots.get(slot).copied().unwrap_or_default();
        assert!(
            now.packets >= was.packets && now.bytes >= was.bytes,
            "counter {slot:?} went back from {was:?} to {now:?} across the restart:\nbefore\n{}after\n{}",
            s2.render_table(),
            s3.render_table()
        );
    }
    ping(lb.client(), backend, N);
    let s4 = daemon.stats();
    expect_pings(&s3, &s4, "after the restart");

    let status = daemon.stop();
    assert!(
        status.success(),
        "clean stop should exit 0, got {status}; log:\n{}",
        daemon.log()
    );
    assert!(
        daemon.log().contains("Detached programs and removed pins"),
        "log:\n{}",
        daemon.log()
    );
    assert!(
        !pin_dir.exists(),
        "a clean stop must remove {}",
        pin_dir.display()
    );
    assert_xdp_on_every_fp_interface(&lb, false, "after a clean stop");
    for (pin, id) in &links {
        assert!(
            !link_exists(*id),
            "link {id} ({pin}) still exists after a clean stop"
        );
    }
    // Without the datapath the kernel still forwards.
    ping(lb.client(), backend, 3);
}

/// (e) A bad config changes nothing: a typo'd key and an interface that does not exist both
/// make `fastpath daemon` exit 2 naming the file, line and key, before any pin or program.
#[test]
fn bad_config_exits_2_and_attaches_nothing() {
    setup(&[]);
    let lb = topology(1);

    let pin_dir = unique_pin_dir("typo");
    let _guard = DetachOnDrop(pin_dir.clone());
    let typo = format!(
        "[datapath]\npin_dir = {:?}\n\n[[interface]]\nname = \"cl0\"\nxdpp = \"auto\"\n",
        pin_dir.display().to_string()
    );
    let (status, stderr) =
        run_daemon_to_exit(bin(), lb.fp().name(), &typo).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        status.code(),
        Some(2),
        "typo'd key: expected exit code 2; stderr:\n{stderr}"
    );
    assert!(
        stderr.contains("xdpp") && stderr.contains(".toml:6"),
        "typo'd key: expected stderr to name `xdpp` at line 6:\n{stderr}"
    );
    assert!(stderr.contains("nothing was attached"), "stderr:\n{stderr}");
    assert!(
        !pin_dir.exists(),
        "typo'd key: {} must not be created",
        pin_dir.display()
    );
    assert_xdp_on_every_fp_interface(&lb, false, "after a typo'd config");

    // The first interface exists: validation must reject the file before attaching to it.
    let pin_dir = unique_pin_dir("missing");
    let _guard = DetachOnDrop(pin_dir.clone());
    let missing = DaemonConfig::new(&pin_dir)
        .interface(LbTopology::FP_CLIENT_IF)
        .hooks(HookedInterface {
            name: "nosuch0".into(),
            xdp: "auto",
            tc_ingress: true,
            tc_egress: false,
        })
        .to_toml();
    let line = missing
        .lines()
        .position(|l| l.contains("nosuch0"))
        .expect("name line")
        + 1;
    let (status, stderr) =
        run_daemon_to_exit(bin(), lb.fp().name(), &missing).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        status.code(),
        Some(2),
        "missing interface: expected exit code 2; stderr:\n{stderr}"
    );
    assert!(
        stderr.contains("nosuch0")
            && stderr.contains("interface[1].name")
            && stderr.contains(&format!(".toml:{line}")),
        "missing interface: expected stderr to name `interface[1].name` (nosuch0) at line {line}:\n{stderr}"
    );
    assert!(
        !pin_dir.exists(),
        "missing interface: {} must not be created",
        pin_dir.display()
    );
    assert_xdp_on_every_fp_interface(&lb, false, "after a config naming a missing interface");
}

/// Removes a datapath a daemon should never have created (so a failing check leaves no pins).
struct DetachOnDrop(PathBuf);

impl Drop for DetachOnDrop {
    fn drop(&mut self) {
        if self.0.exists() {
            let _ = host_run(&[
                bin().as_os_str(),
                "detach".as_ref(),
                "--pin-dir".as_ref(),
                self.0.as_os_str(),
            ]);
        }
    }
}

/// The cleanup guarantee itself: a test that panics midway (servers running, daemon attached)
/// still leaves no namespace, process or pin behind.
#[test]
fn a_panicking_test_leaves_nothing_behind() {
    setup(&[]);
    let pin_dir = unique_pin_dir("panic");
    let mut namespaces = Vec::new();
    let mut server_pid = 0;
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let lb = topology(1);
        namespaces = lb
            .topo
            .namespaces()
            .iter()
            .map(|n| n.name().to_owned())
            .collect();
        let server = lb
            .backend(0)
            .spawn(&["sleep", "600"])
            .expect("spawning sleep");
        server_pid = server.pid();
        let _daemon = Daemon::start(bin(), lb.fp(), &lb.fp_config(&pin_dir));
        assert!(pin_dir.exists());
        panic!("deliberate panic to exercise cleanup");
    }));
    assert!(result.is_err(), "the closure was meant to panic");
    assert_eq!(namespaces.len(), 3, "client, fp, backend0");
    for name in &namespaces {
        assert!(
            !Path::new("/run/netns").join(name).exists(),
            "namespace {name} survived the panic"
        );
    }
    assert!(
        !pin_dir.exists(),
        "pin dir {} survived the panic",
        pin_dir.display()
    );
    assert!(
        !Path::new("/proc").join(server_pid.to_string()).exists(),
        "server pid {server_pid} survived the panic"
    );
}

/// A run killed outright (no unwinding) leaves namespaces, pins and temp dirs behind;
/// `sweep_stale` removes those of dead pids and leaves live runs' alone.
#[test]
fn sweep_stale_removes_leftovers_of_dead_runs_only() {
    setup(&[]);
    // A pid that is certainly dead: a child started and reaped here.
    let mut child = std::process::Command::new("true")
        .spawn()
        .expect("spawning true");
    let _ = child.wait();
    let dead = child.id();
    let stale_ns = format!("{PREFIX}-{dead}-0-stale");
    host_run(&["ip", "netns", "add", &stale_ns]).unwrap_or_else(|e| panic!("{e}"));
    let stale_pins = Path::new("/sys/fs/bpf").join(format!("{PREFIX}-{dead}-1-stale"));
    fs::create_dir_all(stale_pins.join("maps")).expect("creating a fake stale pin dir");
    let stale_tmp = std::env::temp_dir().join(format!("{PREFIX}-{dead}-2-stale"));
    fs::create_dir_all(&stale_tmp).expect("creating a fake stale temp dir");
    let live = Netns::create("live").unwrap_or_else(|e| panic!("{e}"));

    let removed = sweep_stale(PREFIX).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        !Path::new("/run/netns").join(&stale_ns).exists(),
        "stale netns {stale_ns} survived; removed: {removed:?}"
    );
    assert!(
        !stale_pins.exists(),
        "stale pin dir {} survived; removed: {removed:?}",
        stale_pins.display()
    );
    assert!(
        !stale_tmp.exists(),
        "stale temp dir {} survived; removed: {removed:?}",
        stale_tmp.display()
    );
    assert!(
        Path::new("/run/netns").join(live.name()).exists(),
        "sweep_stale removed {}, which belongs to this live process",
        live.name()
    );
}

/// SIGTERM at any moment of the start-up (before, while and just after attaching) must leave
/// nothing attached: the daemon either dies before touching the kernel or detaches cleanly.
/// (Before the fix, a SIGTERM during attach killed it with some links pinned.)
#[test]
fn sigterm_during_startup_leaves_nothing_attached() {
    setup(&[]);
    let lb = topology(1);
    let dir = TempDir::new("sigterm").expect("temp dir");
    for delay_ms in (0..=150).step_by(10) {
        let pin_dir = unique_pin_dir("sigterm");
        let _guard = DetachOnDrop(pin_dir.clone());
        let config = dir.join(format!("fastpath-{delay_ms}.toml"));
        fs::write(&config, lb.fp_config(&pin_dir).to_toml()).expect("writing the config");
        let mut child = std::process::Command::new(bin())
            .args(["--netns", lb.fp().name(), "daemon", "--config"])
            .arg(&config)
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("starting the daemon");
        std::thread::sleep(Duration::from_millis(delay_ms));
        // SAFETY: kill on our own, not yet reaped child.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let status = child.wait().expect("waiting for the daemon");
        assert!(
            !pin_dir.exists(),
            "SIGTERM {delay_ms} ms after start ({status}): pins left under {}: {:?}",
            pin_dir.display(),
            fs::read_dir(pin_dir.join("links"))
                .map(|d| d.flatten().map(|e| e.file_name()).collect::<Vec<_>>())
        );
        assert_xdp_on_every_fp_interface(
            &lb,
            false,
            &format!("SIGTERM {delay_ms} ms after start ({status})"),
        );
    }
}
