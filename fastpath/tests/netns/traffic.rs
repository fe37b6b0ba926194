//! End to end: real traffic (ping, curl against nginx, iperf3, UDP sockets) through the
//! datapath the daemon attaches to every interface of the `fp` node of [`lb_topology`],
//! checking that the reason-coded counters moved as the traffic says.
//!
//! Root only (never skipped: without root these tests fail). Tools, Debian packages that
//! `cargo xtask bootstrap` installs: iproute2, iputils-ping, curl, nginx-light, iperf3, ethtool,
//! bpftool.
//! Run with `--test-threads=1`: the tests share the kernel (bpffs, /run/fastpath); each still
//! has its own namespaces and pin directory.

use std::{
    collections::BTreeMap,
    ffi::CString,
    fs,
    net::{IpAddr, SocketAddr, UdpSocket},
    path::{Path, PathBuf},
    time::Duration,
};

use aya::{
    maps::{Array, Map, MapData},
    programs::{SchedClassifier, TcAttachType},
};
use fastpath::{
    stats::StatsSnapshot,
    testkit::netns::{
        Daemon, DaemonConfig, HookedInterface, LbTopology, Netns, PREFIX, TempDir, host_run,
        prepare_test, run_daemon_to_exit, sweep_stale, test_lb_topology, unique_pin_dir,
    },
};
use fastpath_common::{
    Counter, DatapathConfig, Hook, Verdict,
    ct::{CtEntry, CtKey},
    map_names, reason,
    stats::CONFIG_F_DROP_MALFORMED,
};

use crate::bin;

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
    prepare_test(&["ping"]);
    let lb = test_lb_topology(2);
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
    prepare_test(&["curl", "nginx"]);
    let lb = test_lb_topology(1);
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
    prepare_test(&["iperf3"]);
    let lb = test_lb_topology(1);
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

/// The counters once traffic has drained: a sender that exited may leave data in its socket
/// for the kernel to finish sending, so read until two reads 100 ms apart agree (at most 5 s;
/// then the latest read).
fn settled_stats(daemon: &Daemon) -> StatsSnapshot {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let mut last = daemon.stats();
    loop {
        std::thread::sleep(Duration::from_millis(100));
        let now = daemon.stats();
        if now == last || std::time::Instant::now() >= deadline {
            return now;
        }
        last = now;
    }
}

/// Frames up to this size fit one MTU-sized Ethernet frame (1500-byte IP packet + header).
const MTU_FRAME: u64 = 1514;

/// Whether `ethtool -k <dev>` in `ns` reports the offload `feature` (e.g.
/// `tcp-segmentation-offload`) on.
fn offload_on(ns: &Netns, dev: &str, feature: &str) -> bool {
    let out = ns
        .run(&["ethtool", "-k", dev])
        .unwrap_or_else(|e| panic!("{e}"));
    let prefix = format!("{feature}: ");
    let line = out
        .lines()
        .find_map(|l| l.trim().strip_prefix(&prefix))
        .unwrap_or_else(|| {
            panic!(
                "`ethtool -k {dev}` in {} lists no {feature}:\n{out}",
                ns.name()
            )
        });
    line.starts_with("on")
}

/// (c'') TC only, with GSO: with no XDP program on fp's veths, their peers keep TSO/GSO and
/// hand fp whole TCP super-packets (up to 64 KiB in one skb, the payload in page fragments),
/// which is what the TC entry must parse against the linear area (pulling only if headers
/// are beyond it). iperf3 TCP in both directions and both families: nothing may be counted as
/// malformed or non-linear, every data byte iperf3 sent must be counted on both TC hooks, and
/// the mean packet size there must exceed one Ethernet frame (super-packets were seen).
///
/// The counters are per hook, summed over fp's interfaces: client to backend, the data enters
/// at cl0 (tc_ingress) and leaves at be0 (tc_egress), the backend's ACKs the other way round;
/// with `-R` data and ACKs swap interfaces. Either way each TC hook sees all data once.
#[test]
fn tc_only_gso_superpackets_are_parsed_as_well_formed() {
    prepare_test(&["iperf3", "ethtool"]);
    let lb = test_lb_topology(1);
    let pin_dir = unique_pin_dir("gso");
    let config = lb
        .fp_interfaces()
        .iter()
        .fold(DaemonConfig::new(&pin_dir), |c, dev| {
            c.hooks(HookedInterface {
                name: dev.clone(),
                xdp: "off",
                tc_ingress: true,
                tc_egress: true,
            })
        });
    let daemon = Daemon::start(bin(), lb.fp(), &config);

    // Every sender's veth must offload segmentation, else no super-packet ever reaches fp.
    for (ns, dev) in [
        (lb.client(), LbTopology::HOST_IF.to_owned()),
        (lb.backend(0), LbTopology::HOST_IF.to_owned()),
        (lb.fp(), LbTopology::FP_CLIENT_IF.to_owned()),
        (lb.fp(), LbTopology::fp_backend_if(0)),
    ] {
        for feature in ["tcp-segmentation-offload", "generic-segmentation-offload"] {
            assert!(
                offload_on(ns, &dev, feature),
                "expected {feature} on {}/{dev} (veth without XDP keeps it)",
                ns.name()
            );
        }
    }

    let _server = lb
        .backend(0)
        .spawn(&["iperf3", "-s", "-p", "5201"])
        .expect("starting the iperf3 server");
    lb.backend(0)
        .wait_listening("tcp", 5201, Duration::from_secs(10))
        .expect("iperf3 server listening");

    for (family, target, code, reverse) in [
        (
            "IPv4",
            LbTopology::backend_v4(0).to_string(),
            reason::NO_STAGE_IPV4_TCP,
            false,
        ),
        (
            "IPv4",
            LbTopology::backend_v4(0).to_string(),
            reason::NO_STAGE_IPV4_TCP,
            true,
        ),
        (
            "IPv6",
            LbTopology::backend_v6(0).to_string(),
            reason::NO_STAGE_IPV6_TCP,
            false,
        ),
        (
            "IPv6",
            LbTopology::backend_v6(0).to_string(),
            reason::NO_STAGE_IPV6_TCP,
            true,
        ),
    ] {
        let run = format!(
            "{family} iperf3 {}",
            if reverse {
                "backend to client (-R)"
            } else {
                "client to backend"
            }
        );
        let mut args = vec!["iperf3", "-c", &target, "-p", "5201", "-t", "2", "-J"];
        if reverse {
            args.push("-R");
        }
        let before = daemon.stats();
        let report = lb
            .client()
            .run(&args)
            .unwrap_or_else(|e| panic!("{run}: {e}"));
        let delta = settled_stats(&daemon).delta(&before);
        let json: serde_json::Value = serde_json::from_str(&report)
            .unwrap_or_else(|e| panic!("{run}: iperf3 -J output: {e}\n{report}"));
        let sent = json["end"]["sum_sent"]["bytes"]
            .as_u64()
            .unwrap_or_else(|| panic!("{run}: no end.sum_sent.bytes in:\n{report}"));
        let received = json["end"]["sum_received"]["bytes"].as_u64().unwrap_or(0);
        let table = delta.render_table();

        for code in (0..reason::COUNT).filter(|&c| reason::is_malformed(c)) {
            assert_eq!(
                delta.packets_for_reason(code),
                0,
                "{run}: well-formed TCP counted as {}; counters moved by:\n{table}",
                reason::name(code)
            );
        }
        assert_eq!(
            delta.packets_for_reason(reason::HEADERS_NOT_LINEAR),
            0,
            "{run}: headers_not_linear means a TC packet stayed unparsed even after the pull; counters moved by:\n{table}"
        );
        assert_eq!(
            delta.packets_on_hook(Hook::Xdp),
            0,
            "{run}: xdp = \"off\" everywhere, yet XDP counted packets:\n{table}"
        );
        assert_all_to_kernel(&delta);
        for hook in [Hook::TcIngress, Hook::TcEgress] {
            let c = kernel(&delta, hook, code);
            let mean = c.bytes.checked_div(c.packets).unwrap_or(0);
            eprintln!(
                "{run} on {}: iperf3 sent {sent} bytes (received {received}); counted {} packets, {} bytes, mean {mean} bytes",
                hook.name(),
                c.packets,
                c.bytes
            );
            assert!(
                sent > 0 && c.bytes >= sent,
                "{run}: expected {} on {} to count at least the {sent} bytes iperf3 sent; counters moved by:\n{table}",
                reason::name(code),
                hook.name()
            );
            assert!(
                mean > MTU_FRAME,
                "{run}: expected GSO super-packets on {}, i.e. a mean {} packet above {MTU_FRAME} bytes, got {mean}; counters moved by:\n{table}",
                hook.name(),
                reason::name(code)
            );
        }
    }
}

/// (c') UDP, exactly: sockets opened inside the client and backend namespaces exchange a known
/// number of datagrams of a known size (one-way; each received before the next is sent, so
/// none is lost to a full socket buffer). Nothing else sends UDP in the topology, so every
/// hook counts exactly that many packets and bytes, for IPv4 and for IPv6.
#[test]
fn udp_datagrams_are_counted_exactly() {
    prepare_test(&[]);
    let lb = test_lb_topology(1);
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

/// Every link pinned under `<pin_dir>/links`: pin name (`<iface>@<hook>`) → the bpf_link id and
/// the id of the program it runs, read with bpftool.
fn pinned_links(pin_dir: &Path) -> BTreeMap<String, PinnedLinkIds> {
    let mut links = BTreeMap::new();
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
        let (Some(link), Some(prog)) = (v["id"].as_u64(), v["prog_id"].as_u64()) else {
            panic!("expected a link id and a prog_id from bpftool, got {json}");
        };
        links.insert(
            entry.file_name().to_string_lossy().into_owned(),
            PinnedLinkIds { link, prog },
        );
    }
    links
}

/// What bpftool says about one pinned link.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PinnedLinkIds {
    link: u64,
    prog: u64,
}

/// The bpf_link id behind every pin under `<pin_dir>/links`, sorted by pin name.
fn pinned_link_ids(pin_dir: &Path) -> Vec<(String, u64)> {
    pinned_links(pin_dir)
        .into_iter()
        .map(|(pin, ids)| (pin, ids.link))
        .collect()
}

fn link_exists(id: u64) -> bool {
    host_run(&["bpftool", "link", "show", "id", &id.to_string()]).is_ok()
}

/// Whether the running kernel has TCX links (Linux 6.6 added them).
pub(crate) fn kernel_has_tcx() -> bool {
    fastpath::testkit::kernel_at_least(6, 6)
}

/// Whether the running kernel has the `bpf_loop` helper (Linux 5.17 added it).
pub(crate) fn kernel_has_bpf_loop() -> bool {
    fastpath::testkit::kernel_at_least(5, 17)
}

/// What runs on one interface, as the kernel reports it per device (not per pin).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct DeviceHooks {
    /// Ids of the XDP programs `bpftool net show` lists (one per mode; at most one here).
    xdp: Vec<u64>,
    /// Program ids at TCX ingress and egress, in run order, from BPF_PROG_QUERY: older
    /// bpftool (7.1 here) does not list TCX in `net show` at all.
    tcx_ingress: Vec<u64>,
    tcx_egress: Vec<u64>,
    /// `bpftool net show`'s `tc` (classic cls_bpf; newer bpftool lists TCX there too) and
    /// `tcx` entries, so a program attached any other way than the daemon's shows up as well.
    tc: Vec<serde_json::Value>,
    /// Whether `ip -d link show` says `prog/xdp` (a second witness for XDP).
    ip_link_xdp: bool,
}

impl DeviceHooks {
    fn is_empty(&self) -> bool {
        *self == DeviceHooks::default()
    }
}

/// The XDP and TC programs attached to `dev` in `ns` (no TCX query on a kernel without TCX).
pub(crate) fn device_hooks(ns: &Netns, dev: &str) -> DeviceHooks {
    let out = ns
        .run(&["bpftool", "-j", "net", "show", "dev", dev])
        .unwrap_or_else(|e| panic!("{e}"));
    let v: serde_json::Value = serde_json::from_str(&out)
        .unwrap_or_else(|e| panic!("`bpftool -j net show dev {dev}` json: {e}: {out}"));
    let section = |name: &str| -> Vec<serde_json::Value> {
        v.as_array()
            .into_iter()
            .flatten()
            .flat_map(|e| e[name].as_array().cloned().unwrap_or_default())
            .collect()
    };
    let xdp = section("xdp")
        .iter()
        .map(|x| {
            x["id"]
                .as_u64()
                .unwrap_or_else(|| panic!("XDP entry without a program id: {out}"))
        })
        .collect();
    let mut tc = section("tc");
    tc.extend(section("tcx"));
    let c_dev = CString::new(dev).expect("interface names have no NUL");
    let tcx = kernel_has_tcx();
    let query = |attach: TcAttachType| -> Vec<u64> {
        if !tcx {
            return Vec::new();
        }
        let (_revision, progs) = ns
            .in_netns(|| SchedClassifier::query_tcx(c_dev.as_c_str(), attach))
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_else(|e| {
                panic!(
                    "querying TCX {attach:?} programs on {dev} in {}: {e}",
                    ns.name()
                )
            });
        progs.iter().map(|p| u64::from(p.id())).collect()
    };
    DeviceHooks {
        xdp,
        tcx_ingress: query(TcAttachType::Ingress),
        tcx_egress: query(TcAttachType::Egress),
        tc,
        ip_link_xdp: ns.xdp_attached(dev).unwrap_or_else(|e| panic!("{e}")),
    }
}

/// Asserts that no XDP program and no TC program (TCX or classic) is attached to any of
/// `devs` in `ns`.
pub(crate) fn assert_nothing_attached<S: AsRef<str>>(ns: &Netns, devs: &[S], when: &str) {
    for dev in devs {
        let dev = dev.as_ref();
        let hooks = device_hooks(ns, dev);
        assert!(
            hooks.is_empty(),
            "{when}: expected no XDP or TC program on {}/{dev}, found {hooks:?}",
            ns.name()
        );
    }
}

/// Asserts that every fp interface runs the datapath on all three hooks, each program being
/// the one its pinned link holds; returns what each interface runs.
fn assert_datapath_on_every_fp_interface(
    lb: &LbTopology,
    links: &BTreeMap<String, PinnedLinkIds>,
    when: &str,
) -> BTreeMap<String, DeviceHooks> {
    let mut all = BTreeMap::new();
    for dev in lb.fp_interfaces() {
        let prog = |hook: &str| -> u64 {
            links
                .get(&format!("{dev}@{hook}"))
                .unwrap_or_else(|| panic!("{when}: no link pinned for {dev}@{hook}: {links:?}"))
                .prog
        };
        let hooks = device_hooks(lb.fp(), &dev);
        let (xdp, ingress, egress) = (prog("xdp"), prog("tc_ingress"), prog("tc_egress"));
        assert!(
            hooks.ip_link_xdp
                && hooks.xdp == [xdp]
                && hooks.tcx_ingress == [ingress]
                && hooks.tcx_egress == [egress],
            "{when}: expected fp/{dev} to run XDP program {xdp}, TCX ingress [{ingress}] and TCX egress [{egress}] (from the pinned links); the device runs {hooks:?}"
        );
        all.insert(dev, hooks);
    }
    all
}

/// The pinned conntrack table's map id, capacity and flags (the pin a restart migrates when
/// `conntrack.capacity` or this version's table kind differ).
fn pinned_ct_table(pin_dir: &Path) -> (u32, u32, u32) {
    let info = pinned_map_info(pin_dir, map_names::CT);
    (info.id(), info.max_entries(), info.map_flags())
}

/// What the kernel says of the map pinned as `name`.
fn pinned_map_info(pin_dir: &Path, name: &str) -> aya::maps::MapInfo {
    let path = pin_dir.join("maps").join(name);
    aya::maps::MapInfo::from_pin(&path)
        .unwrap_or_else(|e| panic!("reading the pinned {}: {e}", path.display()))
}

/// Pins at `path` an empty hash of conntrack keys and entries (`bpftool map create`), as a
/// version or an interrupted start leaves one: `flags` its map flags.
fn pin_empty_ct_table(path: &Path, capacity: u32, flags: u32) {
    host_run(&[
        "bpftool",
        "map",
        "create",
        path.to_str().expect("utf-8"),
        "type",
        "hash",
        "key",
        &size_of::<CtKey>().to_string(),
        "value",
        &size_of::<CtEntry>().to_string(),
        "entries",
        &capacity.to_string(),
        "name",
        "FP_CT",
        "flags",
        &flags.to_string(),
    ])
    .unwrap_or_else(|e| panic!("pinning an empty table at {}: {e}", path.display()));
}

/// Replaces the pinned conntrack table with one of the kind versions up to 0ae8551 pinned
/// (`BPF_F_NO_PREALLOC`) holding the same entries, as an upgrade finds it;
/// returns their keys (at least one). The running programs keep their own table.
fn pin_table_of_the_older_kind(pin_dir: &Path) -> Vec<CtKey> {
    let entries = fastpath::datapath::pinned_ct_entries(pin_dir)
        .unwrap_or_else(|e| panic!("reading the pinned table: {e}"));
    assert!(!entries.is_empty(), "no conntrack entry to migrate");
    let pin = pin_dir.join("maps").join(map_names::CT);
    let (_, capacity, _) = pinned_ct_table(pin_dir);
    fs::remove_file(&pin).unwrap_or_else(|e| panic!("unpinning {}: {e}", pin.display()));
    pin_empty_ct_table(&pin, capacity, 1);
    let data = MapData::from_pin(&pin).unwrap_or_else(|e| panic!("opening it: {e}"));
    let mut table: aya::maps::HashMap<MapData, CtKey, CtEntry> =
        aya::maps::HashMap::try_from(Map::HashMap(data)).unwrap_or_else(|e| panic!("{e}"));
    for (k, e) in &entries {
        table
            .insert(k, e, 0)
            .unwrap_or_else(|e| panic!("filling the table of the older kind: {e}"));
    }
    entries.into_iter().map(|(k, _)| k).collect()
}

/// The pinned early-drop queue's oldest key (`bpftool map peek`, which leaves it queued);
/// panics if the queue is empty.
fn pinned_queue_head(pin_dir: &Path) -> String {
    let path = pin_dir.join("maps").join(map_names::CT_NEW);
    host_run(&[
        "bpftool",
        "-j",
        "map",
        "peek",
        "pinned",
        path.to_str().expect("utf-8"),
    ])
    .unwrap_or_else(|e| panic!("peeking {} (empty?): {e}", path.display()))
}

/// The capacity the restart tests migrate the conntrack table to (the default is 1 Mi).
const MIGRATED_CAPACITY: u32 = 1 << 16;

/// The runtime flags in the pinned FP_CONFIG map (index 0), read without a daemon.
fn pinned_config_flags(pin_dir: &Path) -> u32 {
    let path = pin_dir.join("maps").join(map_names::CONFIG);
    let data = MapData::from_pin(&path)
        .unwrap_or_else(|e| panic!("opening the pinned {}: {e}", path.display()));
    let array: Array<MapData, DatapathConfig> = Array::try_from(Map::Array(data))
        .unwrap_or_else(|e| panic!("{} as an array of DatapathConfig: {e}", path.display()));
    array
        .get(&0, 0)
        .unwrap_or_else(|e| panic!("reading index 0 of {}: {e}", path.display()))
        .flags
}

/// Asserts that `n` IPv4 pings from the client to a backend moved every hook by exactly one
/// echo request and one reply each.
fn assert_pings_counted(before: &StatsSnapshot, after: &StatsSnapshot, n: u32, when: &str) {
    let delta = after.delta(before);
    let frame = ETH + IPV4 + PING_ICMP;
    for hook in Hook::ALL {
        let c = kernel(&delta, hook, reason::NO_STAGE_IPV4_ICMP);
        assert_eq!(
            c,
            Counter {
                packets: 2 * u64::from(n),
                bytes: 2 * u64::from(n) * frame
            },
            "{when}: expected {} ICMP packets on {}; counters moved by:\n{}",
            2 * n,
            hook.name(),
            delta.render_table()
        );
    }
}

/// (d) kill -9 leaves the datapath running (pinned links keep programs attached, pinned maps
/// keep counting); a new daemon reuses the pinned maps and links, so counters continue, and
/// migrates a conntrack table pinned by an older version (of another kind) with its entries; a
/// clean stop then removes everything.
#[test]
fn kill9_keeps_the_datapath_and_a_restart_continues_its_counters() {
    prepare_test(&["ping", "bpftool"]);
    let lb = test_lb_topology(1);
    let pin_dir = unique_pin_dir("restart");
    let mut daemon = Daemon::start(bin(), lb.fp(), &lb.fp_config(&pin_dir));
    const N: u32 = 10;
    let backend: IpAddr = LbTopology::backend_v4(0).into();
    let s0 = daemon.stats();
    ping(lb.client(), backend, N);
    let s1 = daemon.stats();
    assert_pings_counted(&s0, &s1, N, "with the daemon running");
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
    assert_datapath_on_every_fp_interface(&lb, &pinned_links(&pin_dir), "after kill -9");
    ping(lb.client(), backend, N);
    let s2 = daemon.stats();
    assert_pings_counted(&s1, &s2, N, "after kill -9, with no daemon");

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

    // The table as an older version pinned it (allocated on insert): the restart migrates it.
    let old_kind = pin_table_of_the_older_kind(&pin_dir);
    daemon.restart();
    let log = daemon.log();
    let copied = format!(
        "Migration: copied before the new programs run map=FP_CT copied={} ",
        old_kind.len()
    );
    for want in [
        "Reusing pinned maps",
        "Reused pinned XDP link",
        "Reused pinned TCX link",
        &copied,
        "map=FP_CT copied=0 present=",
        "flags_before=0x1 flags_after=0x0",
    ] {
        assert!(
            log.contains(want),
            "expected the restarted daemon to log {want:?}; log:\n{log}"
        );
    }
    let (_, _, flags) = pinned_ct_table(&pin_dir);
    let kept = fastpath::datapath::pinned_ct_entries(&pin_dir)
        .unwrap_or_else(|e| panic!("reading the migrated table: {e}"));
    assert!(
        flags == 0
            && old_kind
                .iter()
                .all(|k| kept.iter().any(|(key, _)| key == k)),
        "after the restart: expected a preallocated table (flags {flags:#x}) holding the {} entries of the older kind's",
        old_kind.len()
    );
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
    assert_pings_counted(&s3, &s4, N, "after the restart");

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
    assert_nothing_attached(lb.fp(), &lb.fp_interfaces(), "after a clean stop");
    for (pin, id) in &links {
        assert!(
            !link_exists(*id),
            "link {id} ({pin}) still exists after a clean stop"
        );
    }
    // Without the datapath the kernel still forwards.
    ping(lb.client(), backend, 3);
}

/// Adds interface `name` in `ns`, up, of a kind whose driver has no native XDP: `dummy`, or
/// `ifb` on kernels built without the dummy driver (both lack `ndo_bpf`).
fn add_interface_without_native_xdp(ns: &Netns, name: &str) {
    let mut refused = Vec::new();
    for kind in ["dummy", "ifb"] {
        match ns.ip(&["link", "add", name, "type", kind]) {
            Ok(_) => {
                eprintln!("{}/{name} is a {kind} interface", ns.name());
                ns.link_up(name).unwrap_or_else(|e| panic!("{e}"));
                return;
            }
            Err(e) => refused.push(format!("{kind}: {e}")),
        }
    }
    panic!(
        "cannot create an interface without native XDP in {}; the kernel refused every kind: {refused:?}",
        ns.name()
    );
}

/// An interface without native XDP, added to fp by [`failed_restart_keeps_the_running_datapath`].
const DUMMY: &str = "dummy0";

/// (d') A restart that fails changes nothing. A daemon runs (XDP auto + TCX on every fp
/// interface, drop_malformed off) and is killed with -9; a new one is started on the same pin
/// dir with a config that also asks for native XDP on a dummy interface (no driver XDP) and
/// turns drop_malformed on. It must exit 1 naming the interface and the native-mode hint, and
/// leave the running datapath exactly as it was: same links running the same programs, traffic
/// counted, FP_CONFIG untouched, nothing on the dummy. A start with a good config then reuses
/// the links, and a clean stop removes everything.
/// [`DUMMY`] with native XDP only: what its driver cannot do, so a start asking for it
/// fails at runtime.
fn native_xdp_on_dummy() -> HookedInterface {
    HookedInterface {
        name: DUMMY.into(),
        xdp: "native",
        tc_ingress: false,
        tc_egress: false,
    }
}

/// Runs a daemon with `bad` in `fp` to its exit, which must be 1 (a runtime failure: here,
/// native XDP on [`DUMMY`]); returns its stderr.
fn start_fails_at_runtime(fp: &Netns, bad: &DaemonConfig) -> String {
    let (status, stderr) =
        run_daemon_to_exit(bin(), fp.name(), &bad.to_toml()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        status.code(),
        Some(1),
        "native XDP on {DUMMY}: expected exit code 1 (runtime failure); stderr:\n{stderr}"
    );
    stderr
}

/// Our netlink filters on `dev` in `ns` (`tc filter show`): (ingress or egress, the id of
/// the program each runs).
fn our_filters(ns: &Netns, dev: &str) -> Vec<(&'static str, u64)> {
    let mut found = Vec::new();
    for dir in ["ingress", "egress"] {
        let out = ns
            .run(&["tc", "filter", "show", "dev", dev, dir])
            .unwrap_or_else(|e| panic!("tc filter show dev {dev} {dir}: {e}"));
        for line in out.lines().filter(|l| l.contains("handle 0xfa57")) {
            let id = line
                .split_whitespace()
                .skip_while(|w| *w != "id")
                .nth(1)
                .and_then(|id| id.parse().ok())
                .unwrap_or_else(|| panic!("no program id in {line:?}"));
            found.push((dir, id));
        }
    }
    found
}

/// On the netlink path (`tc_attach = "netlink"`), a start that fails half-way — a new
/// interface's filter attached, the next interface refusing native XDP — deletes the filter
/// it attached and leaves the running filters' programs as they were (a swap only happens
/// once every fresh attach has worked); the datapath still forwards.
#[test]
fn failed_netlink_restart_keeps_the_running_filters() {
    prepare_test(&["ping"]);
    let lb = test_lb_topology(1);
    let fp = lb.fp();
    let pin_dir = unique_pin_dir("failed-nl-restart");
    let config = lb
        .fp_config_tc(&pin_dir)
        .datapath_key("tc_attach = \"netlink\"");
    let mut daemon = Daemon::start(bin(), fp, &config);
    let running: Vec<(String, Vec<(&str, u64)>)> = lb
        .fp_interfaces()
        .into_iter()
        .map(|dev| {
            let f = our_filters(fp, &dev);
            (dev, f)
        })
        .collect();
    assert!(
        running.iter().all(|(_, f)| f.len() == 2),
        "expected our ingress and egress filters on every fp interface: {running:?}"
    );
    daemon.kill9();
    const FRESH: &str = "dummy1";
    add_interface_without_native_xdp(fp, FRESH);
    add_interface_without_native_xdp(fp, DUMMY);
    let bad = config
        .clone()
        .hooks(HookedInterface {
            name: FRESH.into(),
            xdp: "off",
            tc_ingress: true,
            tc_egress: false,
        })
        .hooks(native_xdp_on_dummy());
    let stderr = start_fails_at_runtime(fp, &bad);
    let when = "after the failed netlink restart";
    assert!(
        stderr.contains(&format!("interface={FRESH}")) || stderr.contains(FRESH),
        "{when}: the failed start should have attached {FRESH}'s filter first; stderr:\n{stderr}"
    );
    assert_eq!(
        our_filters(fp, FRESH),
        [],
        "{when}: the filter the failed start attached must be deleted"
    );
    for (dev, was) in &running {
        assert_eq!(
            &our_filters(fp, dev),
            was,
            "{when}: {dev}'s filters must run the programs they ran"
        );
    }
    let s0 = daemon.stats();
    let backend: IpAddr = LbTopology::backend_v4(0).into();
    ping(lb.client(), backend, 5);
    let s1 = daemon.stats();
    let icmp = |s: &StatsSnapshot| kernel(s, Hook::TcIngress, reason::NO_STAGE_IPV4_ICMP).packets;
    assert!(
        icmp(&s1) - icmp(&s0) >= 10,
        "{when}: 5 pings (out and back) must pass our TC ingress filters: counted {}",
        icmp(&s1) - icmp(&s0)
    );
    eprintln!(
        "netlink: the failed start deleted {FRESH}'s filter; {} kept their filters' programs {running:?}",
        running.len()
    );
}

#[test]
fn failed_restart_keeps_the_running_datapath() {
    prepare_test(&["ping", "bpftool"]);
    let lb = test_lb_topology(1);
    let fp = lb.fp();
    let pin_dir = unique_pin_dir("failed-restart");
    let mut daemon = Daemon::start(bin(), fp, &lb.fp_config(&pin_dir));
    const N: u32 = 10;
    let backend: IpAddr = LbTopology::backend_v4(0).into();

    let s0 = daemon.stats();
    ping(lb.client(), backend, N);
    let s1 = daemon.stats();
    assert_pings_counted(&s0, &s1, N, "with the first daemon running");
    let links = pinned_links(&pin_dir);
    assert_eq!(
        links.len(),
        6,
        "expected 3 hooks on 2 interfaces pinned, got {links:?}"
    );
    let running = assert_datapath_on_every_fp_interface(&lb, &links, "with the first daemon");
    assert_eq!(
        pinned_config_flags(&pin_dir),
        0,
        "drop_malformed = false must leave FP_CONFIG flags at 0"
    );

    daemon.kill9();
    assert!(!daemon.is_running(), "daemon survived SIGKILL");
    add_interface_without_native_xdp(fp, DUMMY);
    let table = pinned_ct_table(&pin_dir);
    let queue = pinned_map_info(&pin_dir, map_names::CT_NEW).id();
    let early_drop_head = pinned_queue_head(&pin_dir);

    // It also resizes the conntrack table: the migration it begins must be undone.
    let bad = lb
        .fp_config(&pin_dir)
        .conntrack("capacity", MIGRATED_CAPACITY)
        .drop_malformed(true)
        .hooks(native_xdp_on_dummy());
    let stderr = start_fails_at_runtime(fp, &bad);
    assert!(
        stderr.contains(DUMMY) && stderr.contains("native mode needs driver support"),
        "expected stderr to name {DUMMY} and the native-mode hint; stderr:\n{stderr}"
    );

    let when = "after the failed restart";
    assert_eq!(
        pinned_links(&pin_dir),
        links,
        "{when}: expected the same pinned links running the same programs; stderr of the failed daemon:\n{stderr}"
    );
    for (pin, ids) in &links {
        let json = host_run(&["bpftool", "-j", "link", "show", "id", &ids.link.to_string()])
            .unwrap_or_else(|e| panic!("{when}: link {} ({pin}) is gone: {e}", ids.link));
        let v: serde_json::Value =
            serde_json::from_str(&json).unwrap_or_else(|e| panic!("bpftool json: {e}: {json}"));
        assert_eq!(
            v["prog_id"].as_u64(),
            Some(ids.prog),
            "{when}: link {} ({pin}) must still run program {}: {json}",
            ids.link,
            ids.prog
        );
    }
    assert_eq!(
        assert_datapath_on_every_fp_interface(&lb, &links, when),
        running,
        "{when}: fp's interfaces must run exactly what they ran before"
    );
    assert_nothing_attached(fp, &[DUMMY], when);
    let dummy_pins: Vec<String> = fs::read_dir(pin_dir.join("links"))
        .expect("links dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&format!("{DUMMY}@")))
        .collect();
    assert!(
        dummy_pins.is_empty(),
        "{when}: expected no pin for {DUMMY}, found {dummy_pins:?}"
    );
    assert_eq!(
        pinned_config_flags(&pin_dir),
        0,
        "{when}: FP_CONFIG is written only after a successful attach, yet drop_malformed = true reached it"
    );
    assert_eq!(
        pinned_ct_table(&pin_dir),
        table,
        "{when}: the table the running programs use must be pinned again (id, capacity, flags)"
    );
    assert!(
        !pin_dir.join("migrating").exists(),
        "{when}: the migration's directory must be gone"
    );
    assert_eq!(
        (
            pinned_map_info(&pin_dir, map_names::CT_NEW).id(),
            pinned_queue_head(&pin_dir)
        ),
        (queue, early_drop_head),
        "{when}: the running programs' early-drop queue must be pinned again, its keys kept"
    );
    let tails = fs::read_dir(pin_dir.join("tails"))
        .map(|d| d.count())
        .unwrap_or(0);
    assert_eq!(
        tails, 1,
        "{when}: the failed load's tail arrays must be unpinned"
    );
    let s2 = daemon.stats();
    ping(lb.client(), backend, N);
    let s3 = daemon.stats();
    assert_pings_counted(&s2, &s3, N, when);

    // As a start that died half-way through that migration leaves it: the running programs'
    // table aside, a new one (still empty, no link runs a program on it) under its name. The
    // next start starts it over.
    let before: Vec<CtKey> = fastpath::datapath::pinned_ct_entries(&pin_dir)
        .unwrap_or_else(|e| panic!("reading the table: {e}"))
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert!(!before.is_empty(), "the pings left no conntrack entry");
    let (maps, aside) = (pin_dir.join("maps"), pin_dir.join("migrating"));
    fs::create_dir_all(&aside).expect("creating migrating/");
    fs::rename(maps.join(map_names::CT), aside.join(map_names::CT)).expect("moving FP_CT aside");
    pin_empty_ct_table(&maps.join(map_names::CT), MIGRATED_CAPACITY, 0);

    // A good config (this time with drop_malformed on and the table resized) reuses the
    // links, swaps programs and migrates the table.
    let good = lb
        .fp_config(&pin_dir)
        .conntrack("capacity", MIGRATED_CAPACITY)
        .drop_malformed(true);
    fs::write(daemon.config_path(), good.to_toml()).expect("writing the good config");
    daemon.restart();
    let log = daemon.log();
    for want in [
        "Reusing pinned maps",
        "Reused pinned XDP link",
        "Reused pinned TCX link",
        "Migration resumed (over: no link runs a program on its new map, a partial copy, which is dropped) map=FP_CT over=true",
        "Migrated the pinned map to this version's kind and size map=FP_CT copied=",
        "Migrated the pinned map to this version's kind and size map=FP_CT_NEW copied=",
    ] {
        assert!(
            log.contains(want),
            "expected the restarted daemon to log {want:?}; log:\n{log}"
        );
    }
    let swapped = pinned_links(&pin_dir);
    assert_eq!(
        swapped.iter().map(|(p, i)| (p, i.link)).collect::<Vec<_>>(),
        links.iter().map(|(p, i)| (p, i.link)).collect::<Vec<_>>(),
        "a good restart must keep the same links"
    );
    for (pin, ids) in &swapped {
        assert_ne!(
            ids.prog, links[pin].prog,
            "a good restart must swap a new program into {pin}"
        );
    }
    assert_datapath_on_every_fp_interface(&lb, &swapped, "after the good restart");
    let (id, capacity, flags) = pinned_ct_table(&pin_dir);
    assert!(
        id != table.0 && capacity == MIGRATED_CAPACITY && flags == 0,
        "after the good restart: expected a new preallocated table of {MIGRATED_CAPACITY} entries pinned, got id {id} (was {}), capacity {capacity}, flags {flags:#x}",
        table.0
    );
    assert!(
        !pin_dir.join("migrating").exists(),
        "after the good restart: the migration's directory must be gone"
    );
    let after = fastpath::datapath::pinned_ct_entries(&pin_dir)
        .unwrap_or_else(|e| panic!("reading the migrated table: {e}"));
    assert!(
        before.iter().all(|k| after.iter().any(|(key, _)| key == k)),
        "after the good restart: the resumed migration lost entries: {before:?} -> {after:?}"
    );
    assert_nothing_attached(fp, &[DUMMY], "after the good restart");
    assert_eq!(
        pinned_config_flags(&pin_dir),
        CONFIG_F_DROP_MALFORMED,
        "after the good restart with drop_malformed = true"
    );
    let s4 = daemon.stats();
    ping(lb.client(), backend, N);
    let s5 = daemon.stats();
    assert_pings_counted(&s4, &s5, N, "after the good restart");

    let status = daemon.stop();
    assert!(
        status.success(),
        "clean stop should exit 0, got {status}; log:\n{}",
        daemon.log()
    );
    assert!(
        !pin_dir.exists(),
        "a clean stop must remove {}",
        pin_dir.display()
    );
    let mut devs = lb.fp_interfaces();
    devs.push(DUMMY.into());
    assert_nothing_attached(fp, &devs, "after a clean stop");
    for (pin, ids) in &swapped {
        assert!(
            !link_exists(ids.link),
            "link {} ({pin}) still exists after a clean stop",
            ids.link
        );
    }
    ping(lb.client(), backend, 3);
}

/// (d'') As (d'), with a stale pinned link: an interface the last run attached to was deleted
/// and re-created, so its pinned links are stale. The daemon must find that before swapping
/// anything, re-attach that interface afresh (native XDP, which the driver refuses) and, when
/// that fails, leave every other pinned link on its old program.
#[test]
fn failed_restart_after_a_stale_link_keeps_the_old_programs() {
    prepare_test(&["bpftool"]);
    let lb = test_lb_topology(1);
    let fp = lb.fp();
    let pin_dir = unique_pin_dir("stale-restart");
    add_interface_without_native_xdp(fp, DUMMY);
    // xdp = "auto": generic mode on the dummy.
    let mut daemon = Daemon::start(bin(), fp, &lb.fp_config(&pin_dir).interface(DUMMY));
    let links = pinned_links(&pin_dir);
    assert_eq!(
        links.len(),
        9,
        "expected 3 hooks on 3 interfaces pinned, got {links:?}"
    );
    daemon.kill9();
    fp.ip(&["link", "del", DUMMY])
        .unwrap_or_else(|e| panic!("{e}"));
    add_interface_without_native_xdp(fp, DUMMY);

    let bad = lb
        .fp_config(&pin_dir)
        .drop_malformed(true)
        .hooks(HookedInterface {
            name: DUMMY.into(),
            xdp: "native",
            tc_ingress: true,
            tc_egress: true,
        });
    let (status, stderr) =
        run_daemon_to_exit(bin(), fp.name(), &bad.to_toml()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        status.code(),
        Some(1),
        "native XDP on the re-created {DUMMY}: expected exit code 1; stderr:\n{stderr}"
    );
    let after = pinned_links(&pin_dir);
    for (pin, ids) in links.iter().filter(|(p, _)| !p.starts_with(DUMMY)) {
        assert_eq!(
            after.get(pin),
            Some(ids),
            "after a restart that failed on the stale {DUMMY}: {pin} must still run program {}; stderr of the failed daemon:\n{stderr}",
            ids.prog
        );
    }
    assert_eq!(
        pinned_config_flags(&pin_dir),
        0,
        "FP_CONFIG changed by a failed start"
    );
}

/// (e) A bad config changes nothing: a typo'd key and an interface that does not exist both
/// make `fastpath daemon` exit 2 naming the file, line and key, before any pin or program (no
/// XDP, no TCX or other TC program on any fp interface).
#[test]
fn bad_config_exits_2_and_attaches_nothing() {
    prepare_test(&["bpftool"]);
    let lb = test_lb_topology(1);

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
    assert_nothing_attached(lb.fp(), &lb.fp_interfaces(), "after a typo'd config");

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
    assert_nothing_attached(
        lb.fp(),
        &lb.fp_interfaces(),
        "after a config naming a missing interface",
    );
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
    prepare_test(&[]);
    let pin_dir = unique_pin_dir("panic");
    let mut namespaces = Vec::new();
    let mut server_pid = 0;
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let lb = test_lb_topology(1);
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
    prepare_test(&[]);
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
/// nothing attached (no XDP, no TC program, no pin): the daemon either dies before touching the
/// kernel or detaches cleanly.
/// (Before the fix, a SIGTERM during attach killed it with some links pinned.)
#[test]
fn sigterm_during_startup_leaves_nothing_attached() {
    prepare_test(&["bpftool"]);
    let lb = test_lb_topology(1);
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
        assert_nothing_attached(
            lb.fp(),
            &lb.fp_interfaces(),
            &format!("SIGTERM {delay_ms} ms after start ({status})"),
        );
    }
}
