//! The smoke test of a kernel: what an operator does first on a new node. The daemon comes up
//! on the `fp` node's veths with the default attach choice (`tc_attach = "auto"`: TCX links
//! where the kernel has them, netlink filters on a clsact qdisc where it does not); TCP and
//! UDP flows over IPv4 and IPv6 go through load-balanced VIPs to two backends; the daemon is
//! killed with SIGKILL under them and started again; a clean stop takes every program of ours
//! off the interfaces. Once with balancing at XDP, once at TC ingress (`xdp = "off"`). On a
//! kernel without a feature, a config asking for it must fail to start, naming it: TCX links
//! (`tc_attach = "tcx"`), `bpf_loop` (a least-connections service).
//!
//! The test command runs these on the host's kernel with every other test, and again on each
//! kernel of its matrix (`cargo xtask test`: Linux 6.1 and 6.12 under qemu), where they are
//! the only namespace tests. The `bpf_loop` refusal runs only on a kernel without it: by hand,
//! `cargo xtask vm 5.15` (see README "Kernels").
//!
//! Root only (never skipped: without root these tests fail). Debian packages: iproute2,
//! ethtool, bpftool.

use std::{
    fs,
    net::{IpAddr, SocketAddr},
    thread,
    time::Duration,
};

use fastpath::testkit::{
    netns::{
        Daemon, DaemonConfig, LbTopology, Netns, NetnsError, prepare_test, slowdown,
        test_lb_topology, unique_pin_dir,
    },
    traffic::{ConnPool, EchoServers, PoolOptions, Transport, tcp_resets},
};

use crate::{
    bin,
    lb::tc_filters,
    traffic::{assert_nothing_attached, kernel_has_bpf_loop, kernel_has_tcx},
};

const VIP4: &str = "10.200.0.100";
const VIP6: &str = "fd00:200::100";
/// The services' port, TCP and UDP alike (and the backends').
const PORT: u16 = 7000;
/// Flows per (transport, address family) opened at each step.
const FLOWS: usize = 6;
const BACKENDS: usize = 2;

#[test]
fn tcp_and_udp_through_a_vip_balanced_at_xdp_survive_kill_9_and_a_clean_stop_detaches() {
    smoke(false);
}

#[test]
fn tcp_and_udp_through_a_vip_balanced_at_tc_ingress_survive_kill_9_and_a_clean_stop_detaches() {
    smoke(true);
}

/// TCP and UDP services on [`VIP4`] and [`VIP6`] port [`PORT`], two backends each (Maglev,
/// NAT).
fn services() -> String {
    let mut s = String::new();
    for (vip, v6) in [(VIP4, false), (VIP6, true)] {
        for protocol in ["tcp", "udp"] {
            s += &format!(
                "[[service]]\nvip = \"{vip}\"\nport = {PORT}\nprotocol = \"{protocol}\"\n"
            );
            for i in 0..BACKENDS {
                s += &format!(
                    "[[service.backend]]\naddress = \"{}\"\nport = {PORT}\n",
                    backend(i, v6)
                );
            }
        }
    }
    s
}

fn backend(i: usize, v6: bool) -> IpAddr {
    if v6 {
        LbTopology::backend_v6(i).into()
    } else {
        LbTopology::backend_v4(i).into()
    }
}

/// One pool per transport and address family, [`FLOWS`] flows each.
fn open_pools(client: &Netns, when: &str) -> Vec<(Transport, ConnPool)> {
    [Transport::Tcp, Transport::Udp]
        .into_iter()
        .flat_map(|t| [(t, VIP4), (t, VIP6)])
        .map(|(transport, vip)| {
            let target = SocketAddr::new(vip.parse().expect("a VIP"), PORT);
            let pool = ConnPool::open_on(transport, client, target, FLOWS, PoolOptions::default())
                .unwrap_or_else(|e| panic!("{when}: {e}"));
            (transport, pool)
        })
        .collect()
}

/// Panics unless every flow of `pools` had an echo verified within 10 s (times the slowdown).
fn flowing(pools: &[(Transport, ConnPool)], when: &str) {
    let marks: Vec<_> = pools.iter().map(|(_, p)| p.mark()).collect();
    for ((_, pool), mark) in pools.iter().zip(&marks) {
        pool.check_progress(mark, Duration::from_secs(10) * slowdown(), when);
    }
}

/// Flows, bytes echoed and verified, datagrams sent again: over the pools of one transport.
#[derive(Default)]
struct Sum {
    flows: usize,
    bytes: u64,
    resent: u64,
}

fn smoke(at_tc: bool) {
    prepare_test(&["ethtool", "bpftool"]);
    let lb = test_lb_topology(BACKENDS);
    lb.checksum_offloads_off()
        .unwrap_or_else(|e| panic!("turning checksum offloads off: {e}"));
    let listeners: Vec<(&Netns, SocketAddr)> = (0..BACKENDS)
        .flat_map(|i| {
            [false, true].map(|v6| (lb.backend(i), SocketAddr::new(backend(i, v6), PORT)))
        })
        .collect();
    let echo: Vec<EchoServers> = [Transport::Tcp, Transport::Udp]
        .into_iter()
        .map(|t| {
            EchoServers::start_on(t, &listeners)
                .unwrap_or_else(|e| panic!("{t:?} echo servers: {e}"))
        })
        .collect();
    let pin_dir = unique_pin_dir(if at_tc { "smoke-tc" } else { "smoke-xdp" });
    let config = if at_tc {
        lb.fp_config_tc(&pin_dir)
    } else {
        lb.fp_config(&pin_dir)
    }
    .services(&services());
    let expected_attach = if kernel_has_tcx() { "tcx" } else { "netlink" };
    if expected_attach == "netlink" {
        refused_before_the_load(
            &lb,
            &config.clone().datapath_key("tc_attach = \"tcx\""),
            "datapath.tc_attach = \"tcx\": this kernel has no TCX links (Linux 6.6 added them)",
        );
    }
    let has_bpf_loop = kernel_has_bpf_loop();
    if !has_bpf_loop {
        let least = config.clone().services(&format!(
            "[[service]]\nvip = \"{VIP4}\"\nport = {}\nscheduler = \"least_connections\"\n[[service.backend]]\naddress = \"{}\"\nport = {PORT}\n",
            PORT + 1,
            backend(0, false)
        ));
        refused_before_the_load(
            &lb,
            &least,
            &format!(
                "service {VIP4}:{}/tcp: scheduler = \"least_connections\" needs the bpf_loop helper, which this kernel lacks (Linux 5.17 added it)",
                PORT + 1
            ),
        );
    }

    let mut daemon = Daemon::start(bin(), lb.fp(), &config);
    let log = daemon.log();
    assert!(
        log.contains(&format!(
            "TC attach path chosen tc_attach=\"{expected_attach}\""
        )),
        "this kernel should get TC attach path {expected_attach:?}; log:\n{log}"
    );
    let info = daemon.cli_ok(&["info"]);
    assert!(
        info.lines()
            .any(|l| l.starts_with("tc attach") && l.trim_end().ends_with(expected_attach)),
        "`fastpath info` should say `tc attach {expected_attach}`; it says:\n{info}"
    );
    let bpf_loop_row = if has_bpf_loop {
        "yes"
    } else {
        "no (Linux 5.17 added it)"
    };
    assert!(
        info.lines().any(|l| {
            let l = l.trim_start();
            l.starts_with("bpf_loop")
                && l["bpf_loop".len()..].trim_start().starts_with(bpf_loop_row)
        }),
        "`fastpath info` should list bpf_loop: {bpf_loop_row}; it says:\n{info}"
    );
    if expected_attach == "netlink" {
        for dev in lb.fp_interfaces() {
            let f = tc_filters(lb.fp(), &dev);
            assert!(
                f.contains("fastpath_tc_ingress direct-action")
                    && f.contains("fastpath_tc_egress direct-action"),
                "{dev}: expected our cls_bpf filters on ingress and egress; tc says:\n{f}"
            );
        }
    }
    let resets = || {
        std::iter::once(lb.client())
            .chain((0..BACKENDS).map(|i| lb.backend(i)))
            .map(tcp_resets)
            .collect::<Vec<_>>()
    };
    let before = resets();
    let mut pools = open_pools(lb.client(), "with the daemon up");
    flowing(&pools, "with the daemon up");

    // SIGKILL: the datapath goes on alone; new flows are balanced without a daemon.
    daemon.kill9();
    thread::sleep(Duration::from_millis(500));
    flowing(&pools, "after kill -9, no daemon");
    pools.extend(open_pools(lb.client(), "after kill -9, no daemon"));
    flowing(&pools, "after kill -9, no daemon, new flows too");

    // A start takes the pinned maps and attachments over under the same flows.
    daemon.restart();
    let log = daemon.log();
    assert!(
        log.contains("Reusing pinned maps"),
        "the start after kill -9 must reuse the pinned maps; log:\n{log}"
    );
    flowing(&pools, "after the start that followed kill -9");
    pools.extend(open_pools(
        lb.client(),
        "after the start that followed kill -9",
    ));
    flowing(&pools, "after the start, new flows too");

    let (mut tcp, mut udp) = (Sum::default(), Sum::default());
    for (transport, pool) in pools {
        let totals = pool.finish_intact(&format!("{transport:?} flows at the end"));
        let sum = if transport == Transport::Tcp {
            &mut tcp
        } else {
            &mut udp
        };
        sum.flows += totals.connections;
        sum.bytes += totals.bytes_verified;
        sum.resent += totals.resent;
    }
    let after = resets();
    assert_eq!(
        before, after,
        "TCP resets (sent, established reset) on the client and the backends moved"
    );
    // Balanced: both backends served flows of each transport; no UDP flow moved between
    // backends (its conntrack entry kept it where it was through the kill and the start).
    let served = |t: usize| -> Vec<usize> {
        let peers = echo[t].peers();
        (0..BACKENDS)
            .map(|i| peers[2 * i].len() + peers[2 * i + 1].len())
            .collect()
    };
    let (tcp_served, udp_served) = (served(0), served(1));
    assert!(
        tcp_served.iter().chain(&udp_served).all(|&n| n > 0),
        "every backend should serve TCP and UDP flows: TCP {tcp_served:?}, UDP {udp_served:?}"
    );
    let moved = echo[1].peers_on_two_listeners();
    assert!(
        moved.is_empty(),
        "UDP flows served by two backends: {moved:?}"
    );

    // A clean stop (no --leave-attached): nothing of ours stays on the interfaces.
    let status = daemon.stop();
    assert!(status.success(), "daemon stop: {status}\n{}", daemon.log());
    assert_nothing_attached(lb.fp(), &lb.fp_interfaces(), "after a clean stop");
    for dev in lb.fp_interfaces() {
        let f = tc_filters(lb.fp(), &dev);
        assert!(
            !f.contains("fastpath") && !f.contains("0xfa57"),
            "{dev}: a clean stop must delete our filters; tc says:\n{f}"
        );
    }

    eprintln!(
        "smoke at {} on Linux {}, TC attach {expected_attach}: {} TCP connections ({} bytes echoed and verified) and {} UDP flows ({} bytes, {} datagrams sent again) over IPv4 and IPv6 through kill -9 and a start; backends served TCP {tcp_served:?}, UDP {udp_served:?}; 0 resets; a clean stop left no program of ours attached",
        if at_tc { "TC ingress" } else { "XDP" },
        fastpath::datapath::kernel::release(),
        tcp.flows,
        tcp.bytes,
        udp.flows,
        udp.bytes,
        udp.resent,
    );
}

/// A config asking for what this kernel lacks fails to start with a message naming the
/// feature (`expected`), before anything is loaded: no pin is left and no program is
/// attached.
fn refused_before_the_load(lb: &LbTopology, config: &DaemonConfig, expected: &str) {
    let refused = Daemon::try_start(bin(), lb.fp().name(), &config.pin_dir, &config.to_toml());
    let Err(NetnsError::Daemon { what, log, .. }) = refused else {
        panic!("a config this kernel cannot run must fail to start ({expected})");
    };
    assert!(
        log.contains(expected),
        "the refusal must name the feature and the kernel that has it ({what}): expected {expected:?}; log:\n{log}"
    );
    assert!(
        !log.contains("pinned maps"),
        "the refusal must come before the load; log:\n{log}"
    );
    let left: Vec<_> = fs::read_dir(&config.pin_dir)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "the refused start left pins: {left:?}");
    assert_nothing_attached(lb.fp(), &lb.fp_interfaces(), "after the refused start");
    eprintln!(
        "refused before the load: {}",
        log.lines()
            .find(|l| l.contains(expected))
            .unwrap_or_default()
            .trim()
    );
}
