//! End to end: direct server return at L2 in the `fp` node of [`lb_topology`]. The backends
//! hold the VIP on their loopback (and do not answer ARP for it); fp sends each new
//! connection's packets to the backend the daemon's Maglev table predicts, changing nothing
//! but the MAC addresses (XDP redirect out of the backend's link); nginx on the backend sees
//! the client's address and the VIP as its own; its replies go straight back (through fp's
//! kernel routing in this topology, untranslated).
//!
//! Root only (never skipped). Debian packages: iproute2, nginx-light, curl, ethtool.

use std::{net::IpAddr, time::Duration};

use fastpath::testkit::netns::{
    Daemon, HttpServer, LbTopology, parse_services, predicted_backend, prepare_test,
    test_lb_topology, unique_pin_dir,
};

use crate::bin;

const BACKENDS: usize = 3;
const VIP4: &str = "10.200.0.100";
const VIP6: &str = "fd00:200::100";

fn backend_addr(i: usize, v6: bool) -> IpAddr {
    if v6 {
        LbTopology::backend_v6(i).into()
    } else {
        LbTopology::backend_v4(i).into()
    }
}

#[test]
fn dsr_sends_each_connection_to_its_backend_unchanged() {
    prepare_test(&["curl", "nginx", "ethtool"]);
    let lb = test_lb_topology(BACKENDS);
    lb.checksum_offloads_off()
        .unwrap_or_else(|e| panic!("turning checksum offloads off: {e}"));
    let mut servers: Vec<HttpServer> = Vec::new();
    for i in 0..BACKENDS {
        let ns = lb.backend(i);
        for cmd in [
            vec!["ip", "addr", "add", &format!("{VIP4}/32"), "dev", "lo"],
            vec!["ip", "addr", "add", &format!("{VIP6}/128"), "dev", "lo"],
            vec!["sysctl", "-qw", "net.ipv4.conf.all.arp_ignore=1"],
            vec!["sysctl", "-qw", "net.ipv4.conf.all.arp_announce=2"],
            // XDP-redirected frames reach a veth only in NAPI mode (GRO on).
            vec!["ethtool", "-K", LbTopology::HOST_IF, "gro", "on"],
        ] {
            ns.run(&cmd)
                .unwrap_or_else(|e| panic!("backend {i}: {cmd:?}: {e}"));
        }
        let s = ns
            .http_server(80)
            .unwrap_or_else(|e| panic!("starting nginx: {e}"));
        servers.push(s);
    }
    let mut svcs = String::new();
    for (vip, v6) in [(VIP4, false), (VIP6, true)] {
        svcs += &format!("[[service]]\nvip = \"{vip}\"\nport = 80\nmode = \"dsr\"\n");
        for i in 0..BACKENDS {
            svcs += &format!(
                "[[service.backend]]\naddress = \"{}\"\nport = 80\n",
                backend_addr(i, v6)
            );
        }
    }
    let parsed = parse_services(&svcs);
    let config = lb.fp_config(&unique_pin_dir("dsr")).services(&svcs);
    let daemon = Daemon::start(bin(), lb.fp(), &config);
    // The daemon made fp resolve every backend's MAC address; wait until the kernel has.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let neigh = lb.fp().run(&["ip", "neigh", "show"]).unwrap_or_default();
        let resolved = (0..BACKENDS).all(|i| {
            [false, true].iter().all(|&v6| {
                neigh.lines().any(|l| {
                    l.starts_with(&format!("{} ", backend_addr(i, v6))) && l.contains("lladdr")
                })
            })
        });
        if resolved {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "fp did not resolve the backends' MAC addresses:\n{neigh}\n{}",
            daemon.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut requests = 0u64;
    // Connections per (service, backend) as the daemon's Maglev tables predict them.
    let mut expected = std::collections::BTreeMap::new();
    for (svc, vip, v6, client, count) in [
        (0, VIP4, false, IpAddr::from(LbTopology::client_v4()), 24),
        (1, VIP6, true, IpAddr::from(LbTopology::client_v6()), 12),
    ] {
        let url = if v6 {
            format!("http://[{vip}]:80/peer")
        } else {
            format!("http://{vip}:80/peer")
        };
        let mut used = std::collections::BTreeSet::new();
        for n in 0..count {
            let body = lb
                .client()
                .run(&["curl", "-sS", "-g", "--fail", "--max-time", "5", &url])
                .unwrap_or_else(|e| panic!("curl {url} ({n}): {e}\n{}", daemon.log()));
            let words: Vec<&str> = body.split_whitespace().collect();
            let [addr, port, server] = words[..] else {
                panic!("unexpected /peer answer {body:?}");
            };
            assert_eq!(
                (addr, server),
                (client.to_string().as_str(), vip),
                "the backend must see the client's own address and the VIP as its address"
            );
            let port: u16 = port.parse().expect("a port");
            let vip_ip: IpAddr = vip.parse().expect("VIP");
            let want = predicted_backend(&parsed, svc, client, port, vip_ip, 80);
            *expected.entry((svc, want)).or_insert(0u64) += 1;
            used.insert(want);
            requests += 1;
        }
        assert!(
            used.len() >= 2,
            "{vip}: every connection went to one backend: {used:?}"
        );
    }
    // The backends the datapath gave the connections: its per-backend counters.
    let (json, rows) = fastpath::testkit::netns::service_list_json(bin(), daemon.pin_dir());
    for (svc, vip) in [(0, VIP4), (1, VIP6)] {
        let row = rows
            .as_array()
            .and_then(|r| r.iter().find(|r| r["vip"] == vip))
            .unwrap_or_else(|| panic!("{vip} not listed: {json}"));
        assert_eq!(row["mode"], "dsr", "{json}");
        for b in row["backends"].as_array().expect("backends") {
            let addr: IpAddr = b["address"].as_str().expect("address").parse().expect("ip");
            let want = expected.get(&(svc, addr)).copied().unwrap_or(0);
            assert_eq!(
                b["connections"], want,
                "{vip}: backend {addr} was given other connections than Maglev predicts: {json}"
            );
        }
    }
    eprintln!("connections per (service, backend), as predicted and counted: {expected:?}");
    let stats = fastpath::datapath::pinned_stats(daemon.pin_dir()).expect("stats");
    let dsr = stats.packets_for_reason(fastpath_common::reason::LB_DSR);
    let missing = stats.packets_for_reason(fastpath_common::reason::LB_DSR_NO_NEIGHBOR);
    eprintln!(
        "{requests} requests over DSR: {dsr} packets sent to backends by MAC, {missing} without a neighbour"
    );
    assert!(
        dsr >= requests * 5 && missing == 0,
        "every client packet of every request goes out by DSR: lb_dsr {dsr}, lb_dsr_no_neighbor {missing}"
    );
    drop(servers);
}

/// `no_backend = "reject"`: a new connection to a service with no backend is answered at XDP,
/// back out of the interface it came in on — curl fails at once with "connection refused" (a
/// TCP RST) and a UDP client gets "connection refused" (an ICMP / ICMPv6 port unreachable),
/// over IPv4 and IPv6, instead of waiting for a timeout.
#[test]
fn a_service_without_backends_rejects_at_once() {
    prepare_test(&["curl", "ethtool", "python3"]);
    let lb = test_lb_topology(1);
    lb.checksum_offloads_off()
        .unwrap_or_else(|e| panic!("turning checksum offloads off: {e}"));
    // The answer is redirected back into the client's veth: NAPI mode (GRO on) takes it.
    lb.client()
        .run(&["ethtool", "-K", LbTopology::HOST_IF, "gro", "on"])
        .unwrap_or_else(|e| panic!("gro on: {e}"));
    let mut svcs = String::new();
    for vip in [VIP4, VIP6] {
        for (port, proto) in [(80, "tcp"), (53, "udp")] {
            svcs += &format!(
                "[[service]]\nvip = \"{vip}\"\nport = {port}\nprotocol = \"{proto}\"\nno_backend = \"reject\"\n"
            );
        }
    }
    let config = lb.fp_config(&unique_pin_dir("reject")).services(&svcs);
    let daemon = Daemon::start(bin(), lb.fp(), &config);
    for vip in [VIP4, VIP6] {
        let url = if vip.contains(':') {
            format!("http://[{vip}]:80/")
        } else {
            format!("http://{vip}:80/")
        };
        let start = std::time::Instant::now();
        let out = lb
            .client()
            .run(&[
                "sh",
                "-c",
                &format!("curl -sS -g --max-time 5 {url}; echo \"exit=$?\""),
            ])
            .unwrap_or_else(|e| panic!("curl: {e}"));
        let took = start.elapsed();
        assert!(
            out.contains("exit=7") && took < Duration::from_secs(2),
            "curl {url} should be refused at once (exit 7); got {out:?} after {took:?}\n{}",
            fastpath::testkit::netns::host_run(&[
                bin().as_os_str(),
                "stats".as_ref(),
                "--pin-dir".as_ref(),
                daemon.pin_dir().as_os_str(),
            ])
            .unwrap_or_default()
        );
        let family = if vip.contains(':') {
            "AF_INET6"
        } else {
            "AF_INET"
        };
        let udp = lb
            .client()
            .run(&[
                "python3",
                "-c",
                &format!(
                    "import socket\ns = socket.socket(socket.{family}, socket.SOCK_DGRAM)\ns.connect(('{vip}', 53))\ns.send(b'q')\ns.settimeout(3)\ntry:\n    s.recv(100)\n    print('answered')\nexcept ConnectionRefusedError:\n    print('refused')\nexcept TimeoutError:\n    print('timeout')\n"
                ),
            ])
            .unwrap_or_else(|e| panic!("udp client: {e}"));
        assert_eq!(
            udp.trim(),
            "refused",
            "a UDP datagram to {vip}:53 should get a port unreachable"
        );
        eprintln!("{vip}: TCP refused after {took:?}, UDP refused");
    }
    let stats = fastpath::datapath::pinned_stats(daemon.pin_dir()).expect("stats");
    let rejected = stats.packets_for_reason(fastpath_common::reason::LB_REJECTED);
    assert!(
        rejected >= 4,
        "every first packet was answered (lb_rejected {rejected})"
    );
}
