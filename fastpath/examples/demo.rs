//! `cargo xtask demo`: the fast path in a self-contained namespace topology.
//!
//! Builds client — fp — 3 backends (nginx on each), starts `fastpath daemon` on fp with a
//! load-balanced, health-checked service on a VIP, sends real ping, HTTP (IPv4 and IPv6) and UDP
//! traffic, prints what the datapath counted and tracked, balances HTTP to the VIP and takes a
//! failed backend out, shows that a `kill -9` of the daemon leaves the datapath forwarding and
//! that a restart reuses the pinned maps; then runs a two-node VXLAN overlay whose pods talk
//! through the fast path's flow cache; and removes everything it created — also on Ctrl-C or
//! failure.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test code: a panic, with its message, is how a test fails"
)]

use std::{
    process::ExitCode,
    sync::atomic::{AtomicBool, Ordering},
};

use anyhow::{Context as _, Result, bail};
use fastpath::{
    stats::StatsSnapshot,
    testkit::{
        netns::{
            Daemon, HttpServer, LbTopology, PREFIX, example_fastpath_bin, host_run, lb_topology,
            sweep_stale, unique_pin_dir,
        },
        vxlan_cases::{OVERLAY_NODES, Underlay, overlay_daemon_config, two_node_overlay},
    },
};
use fastpath_common::{Hook, Verdict, reason};

const BACKENDS: usize = 3;
const HTTP_PORT: u16 = 80;

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_sig: libc::c_int) {
    // Only an atomic store: async-signal-safe. The demo checks it between steps and unwinds
    // through its guards, which remove the namespaces and stop the daemon.
    INTERRUPTED.store(true, Ordering::SeqCst);
}

fn main() -> ExitCode {
    // SAFETY: installs a handler that only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    fastpath::testkit::require_root("the demo");
    match sweep_stale(PREFIX) {
        Ok(swept) if !swept.is_empty() => {
            println!("removed leftovers of an earlier run: {}", swept.join(", "))
        }
        _ => {}
    }
    let result = run();
    // Every guard has been dropped by now: namespaces, servers, daemon, pins are gone.
    match result {
        Ok(()) => {
            println!("\nCleaned up: namespaces, servers, daemon and pins removed.");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!(
                "\ndemo failed: {e:#}\nCleaned up: namespaces, servers, daemon and pins removed."
            );
            ExitCode::FAILURE
        }
    }
}

fn step(title: &str) -> Result<()> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        bail!("interrupted");
    }
    println!("\n== {title}");
    Ok(())
}

fn run() -> Result<()> {
    let bin = example_fastpath_bin()?;
    step("Topology")?;
    let lb = lb_topology(BACKENDS).context("building the namespace topology")?;
    println!(
        "  client {} / {}  --cl0-- [fp: fastpath] --be0..be{}-- backends {}",
        LbTopology::client_v4(),
        LbTopology::client_v6(),
        BACKENDS - 1,
        (0..BACKENDS)
            .map(|i| LbTopology::backend_v4(i).to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    for ns in lb.topo.namespaces() {
        println!("  namespace {} ({})", ns.name(), ns.role());
    }

    step("Backends: nginx on each")?;
    let mut servers: Vec<HttpServer> = Vec::new();
    for i in 0..BACKENDS {
        let server = lb
            .backend(i)
            .http_server(HTTP_PORT)
            .with_context(|| format!("starting nginx on backend {i}"))?;
        std::fs::write(
            server.root().join("index.html"),
            format!("hello from backend {i}\n"),
        )?;
        println!(
            "  backend{i}: nginx on {}:{HTTP_PORT} and [{}]:{HTTP_PORT}",
            LbTopology::backend_v4(i),
            LbTopology::backend_v6(i)
        );
        servers.push(server);
    }

    step(
        "fastpath daemon on fp (XDP + TCX ingress/egress on every interface, routing at XDP as an appliance does, a service on a VIP)",
    )?;
    // Routed at XDP, a frame keeps no checksum offload state: the hosts send full checksums
    // (as from a wire), and take the frames fp redirects into their veths.
    lb.checksum_offloads_off()
        .context("turning checksum offloads off on the client and the backends")?;
    lb.take_xdp_redirects()
        .context("turning GRO on where fp's routed frames arrive")?;
    let config = lb
        .fp_interfaces()
        .iter()
        .fold(lb.fp_config(&unique_pin_dir("demo")), |c, i| {
            c.interface_key(i, "route = true")
        })
        .services(&demo_services());
    println!("{}", indent(&config.to_toml()));
    let mut daemon = Daemon::start(&bin, lb.fp(), &config);
    println!(
        "  daemon up, pid {:?}, pins under {}",
        daemon.pid(),
        daemon.pin_dir().display()
    );

    step("Traffic: ping, HTTP over IPv4 and IPv6, UDP")?;
    let start = daemon.stats();
    traffic(&lb)?;
    let after_traffic = daemon.stats();
    print_counters("What the datapath did", &after_traffic.delta(&start));

    step("Conntrack: the connections the datapath tracked (fastpath ct list / stats)")?;
    let pin = daemon.pin_dir().to_string_lossy().into_owned();
    let list = ct(&bin, &pin, "list")?;
    println!("{}", indent(&list));
    let stats = ct(&bin, &pin, "stats")?;
    let wanted = [
        "entries",
        "capacity",
        "new",
        "assured",
        "closed",
        "related",
        "early_drop",
        "events_lost",
    ];
    let shown: Vec<&str> = stats
        .lines()
        .filter(|l| {
            wanted
                .iter()
                .any(|w| l.split_whitespace().next() == Some(*w))
        })
        .collect();
    println!("{}", indent(&shown.join("\n")));
    let tracked = list.lines().count();

    step("Load balancing: HTTP to the VIP, Maglev over 3 backends, health-checked")?;
    let spread = curl_vip(&lb, 30).with_context(|| format!("daemon log:\n{}", daemon.log()))?;
    println!("  30 connections to http://{VIP}/ answered by backends {spread:?} (index: count)");
    if spread.len() < 2 {
        bail!("the VIP's connections all went to one backend: {spread:?}");
    }
    println!(
        "{}",
        indent(&host_run(&[
            bin.as_os_str(),
            "service".as_ref(),
            "list".as_ref(),
            "--pin-dir".as_ref(),
            pin.as_ref()
        ])?)
    );
    servers[2].process().kill();
    println!("  nginx on backend 2 stopped; its HTTP health check fails (interval 300 ms, fall 2)");
    std::thread::sleep(std::time::Duration::from_millis(1200));
    let after = curl_vip(&lb, 20).with_context(|| format!("daemon log:\n{}", daemon.log()))?;
    if after.contains_key(&2) {
        bail!("backend 2 is down but still got new connections: {after:?}");
    }
    println!("  20 new connections: answered by {after:?} — none by backend 2, none failed");
    let log = daemon.log();
    if let Some(line) = log
        .lines()
        .find(|l| l.contains("Services re-applied after a health change"))
    {
        println!("  log: {}", strip_ansi(line));
    }

    step("Management API: a service added, drained and deleted live through the CLI")?;
    let vip2 = "10.200.0.101";
    let (b0, b1) = (LbTopology::backend_v4(0), LbTopology::backend_v4(1));
    let added = daemon.cli_ok(&[
        "service",
        "add",
        &format!("{vip2}:{HTTP_PORT}"),
        "-b",
        &format!("{b0}:{HTTP_PORT}"),
        "-b",
        &format!("{b1}:{HTTP_PORT}"),
    ]);
    println!("  $ fastpath service add {vip2}:{HTTP_PORT} -b {b0}:{HTTP_PORT} -b {b1}:{HTTP_PORT}");
    println!("{}", indent(added.trim_end()));
    let spread =
        curl_at(&lb, vip2, 20).with_context(|| format!("daemon log:\n{}", daemon.log()))?;
    println!("  20 connections to http://{vip2}/ answered by {spread:?}");
    if spread.keys().any(|b| *b > 1) || spread.len() != 2 {
        bail!("the new service's connections went elsewhere: {spread:?}");
    }
    daemon.cli_ok(&[
        "backend",
        "drain",
        &format!("{vip2}:{HTTP_PORT}"),
        &format!("{b0}:{HTTP_PORT}"),
    ]);
    let drained = curl_at(&lb, vip2, 20)?;
    println!("  $ fastpath backend drain {vip2}:{HTTP_PORT} {b0}:{HTTP_PORT}");
    println!("  20 new connections: answered by {drained:?} — none by the drained backend 0");
    if drained.contains_key(&0) {
        bail!("backend 0 is drained but got new connections: {drained:?}");
    }
    let bad = daemon.cli(&[
        "service",
        "add",
        &format!("{vip2}:{HTTP_PORT}"),
        "-b",
        "[fd00::9]:80",
    ]);
    println!(
        "  a bad request changes nothing (exit {}): {}",
        bad.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&bad.stderr).trim()
    );
    daemon.cli_ok(&["service", "del", &format!("{vip2}:{HTTP_PORT}")]);
    let info = daemon.cli_ok(&["info"]);
    if let Some(line) = info.lines().find(|l| l.starts_with("generation")) {
        println!("  $ fastpath service del {vip2}:{HTTP_PORT}; fastpath info: {line}");
    }

    step("kill -9 the daemon: the pinned programs keep running")?;
    daemon.kill9();
    let before = daemon.stats();
    curl(&lb, &LbTopology::backend_v4(1).to_string(), 1)?;
    let grew = daemon.stats().delta(&before);
    let seen: u64 = Hook::ALL.iter().map(|h| grew.packets_on_hook(*h)).sum();
    if seen == 0 {
        bail!("no packet counted while the daemon was dead: the datapath did not survive kill -9");
    }
    println!(
        "  daemon dead, HTTP still works and {seen} more packets were counted by the orphaned programs"
    );

    step("Restart: pinned maps and links are reused, programs swapped in place")?;
    daemon.restart();
    let log = daemon.log();
    let Some(line) = log.lines().find(|l| l.contains("Reusing pinned maps")) else {
        bail!("the restarted daemon did not reuse the pinned maps; its log:\n{log}");
    };
    println!("  log: {}", strip_ansi(line));
    let hooks = 3 * lb.fp_interfaces().len();
    let reused = log.lines().filter(|l| l.contains("Reused pinned")).count();
    if reused != hooks {
        bail!("expected all {hooks} pinned links to be reused, the log shows {reused}:\n{log}");
    }
    println!("  log: {reused} pinned links reused, programs replaced in place (bpf_link_update)");
    let continued = daemon.stats();
    let (was, now) = (
        after_traffic.packets_on_hook(Hook::Xdp),
        continued.packets_on_hook(Hook::Xdp),
    );
    if now < was {
        bail!("counters went back across the restart: {was} packets on xdp before, {now} after");
    }
    println!("  counters continue: {was} packets on xdp before the restart, {now} after");
    let list = ct(&bin, &pin, "list")?;
    let kept = list.lines().count();
    if kept < tracked {
        bail!(
            "the conntrack table lost entries across the restart: {tracked} before, {kept} after"
        );
    }
    println!("  conntrack table continues: {tracked} connections before the restart, {kept} after");

    step("Clean stop: SIGTERM detaches everything")?;
    let status = daemon.stop();
    let attached = lb
        .fp()
        .xdp_attached(LbTopology::FP_CLIENT_IF)
        .context("reading XDP state of cl0")?;
    let pins_left = daemon.pin_dir().exists();
    if !status.success() || attached || pins_left {
        bail!(
            "clean stop incomplete: exit {status}, XDP still on cl0: {attached}, pins left: {pins_left}"
        );
    }
    println!("  daemon exited with {status}; no XDP on cl0, pin directory removed");
    drop(servers);
    drop(lb);

    step("A VXLAN overlay: two nodes with a pod each, the kernel's vxlan devices accelerated")?;
    overlay(&bin)
}

/// Two nodes carry a kernel VXLAN overlay between their pods: the pods talk over the kernel's
/// overlay alone, then with a fastpath daemon on each node, which learns the outer headers
/// from the kernel's first packets and then encapsulates and decapsulates in the fast path.
fn overlay(bin: &std::path::Path) -> Result<()> {
    let topo = two_node_overlay(Underlay::V4).context("building the two-node overlay")?;
    let [a, b] = &OVERLAY_NODES;
    let (pod_a, pod_b) = (a.pod_addr(), b.pod_addr());
    println!(
        "  pod a {pod_a} -- [node a: vxlan0 {}, VTEP {}] == underlay == [node b: vxlan0 {}, VTEP {}] -- pod b {pod_b}",
        a.overlay, a.underlay, b.overlay, b.underlay
    );
    topo.ns(a.pod)
        .run(&["ping", "-c", "2", "-i", "0.2", "-W", "2", &pod_b])
        .context("ping over the kernel's overlay")?;
    println!("  the kernel's overlay alone: pod a pings pod b");
    let config = |n| overlay_daemon_config(n, Hook::Xdp, Underlay::V4);
    let (ca, cb) = (config(a), config(b));
    println!("  node a's daemon config:\n{}", indent(&ca.to_toml()));
    let da = Daemon::start(bin, topo.ns(a.role), &ca);
    let db = Daemon::start(bin, topo.ns(b.role), &cb);
    let mut nginx = topo
        .ns(b.pod)
        .http_server(HTTP_PORT)
        .context("starting nginx in pod b")?;
    let body = nginx.serve_blob("blob", 1 << 20);
    let _ = nginx.process();
    let (a0, b0) = (da.stats(), db.stats());
    for (from, to) in [(a.pod, &pod_b), (b.pod, &pod_a)] {
        let out = topo
            .ns(from)
            .run(&["ping", "-c", "5", "-i", "0.1", "-W", "2", to])
            .with_context(|| format!("ping {to} from {from}"))?;
        if !out.contains("5 received") {
            bail!("ping {to} from {from}:\n{out}");
        }
        println!("  ping {to} from {from}: 5 of 5 answered");
    }
    let url = format!("http://{pod_b}:{HTTP_PORT}/blob");
    let got = topo
        .ns(a.pod)
        .exec(&["curl", "-sS", "--fail", "--max-time", "20", &url])
        .with_context(|| format!("curl {url}"))?;
    if !got.status.success() || got.stdout != body {
        bail!(
            "curl {url}: {} bytes of {}, or they differ: {}",
            got.stdout.len(),
            body.len(),
            String::from_utf8_lossy(&got.stderr)
        );
    }
    println!("  curl {url}: {} bytes, byte for byte", body.len());
    for (name, daemon, before) in [("a", &da, &a0), ("b", &db, &b0)] {
        let d = daemon.stats().delta(before);
        let count = |code| d.get(Hook::Xdp, Verdict::Forward, code).packets;
        println!(
            "  node {name}: {} packets encapsulated and {} decapsulated in the fast path (vxlan_encap, vxlan_decap)",
            count(reason::VXLAN_ENCAP),
            count(reason::VXLAN_DECAP)
        );
        if count(reason::VXLAN_ENCAP) == 0 || count(reason::VXLAN_DECAP) == 0 {
            bail!(
                "node {name}: the overlay did not take the fast path:\n{}",
                d.render_table()
            );
        }
    }
    let stats = host_run(&[
        bin.as_os_str(),
        "stats".as_ref(),
        "--pin-dir".as_ref(),
        db.pin_dir().as_os_str(),
    ])
    .context("fastpath stats on node b")?;
    if let Some(line) = stats.lines().find(|l| l.starts_with("vxlan flow cache")) {
        println!("  node b, `fastpath stats`: {line}");
    }
    Ok(())
}

const VIP: &str = "10.200.0.100";

/// The demo's service: the three nginx backends behind a VIP, health-checked over HTTP.
fn demo_services() -> String {
    let mut s = format!(
        "[[service]]\nvip = \"{VIP}\"\nport = {HTTP_PORT}\n[service.health_check]\nkind = \"http\"\ninterval_ms = 300\ntimeout_ms = 250\nfall = 2\nrise = 2\n"
    );
    for i in 0..BACKENDS {
        s += &format!(
            "[[service.backend]]\naddress = \"{}\"\nport = {HTTP_PORT}\n",
            LbTopology::backend_v4(i)
        );
    }
    s
}

/// `n` curls to the VIP; how many each backend answered.
fn curl_vip(lb: &LbTopology, n: usize) -> Result<std::collections::BTreeMap<usize, usize>> {
    curl_at(lb, VIP, n)
}

/// `n` curls to `http://vip/`; how many each backend answered.
fn curl_at(
    lb: &LbTopology,
    vip: &str,
    n: usize,
) -> Result<std::collections::BTreeMap<usize, usize>> {
    let mut seen = std::collections::BTreeMap::new();
    for _ in 0..n {
        let url = format!("http://{vip}:{HTTP_PORT}/");
        let body = lb
            .client()
            .run(&["curl", "-sS", "--fail", "--max-time", "5", &url])
            .with_context(|| format!("curl {url}"))?;
        let backend: usize = body
            .trim()
            .strip_prefix("hello from backend ")
            .and_then(|n| n.parse().ok())
            .with_context(|| format!("unexpected page {body:?}"))?;
        *seen.entry(backend).or_default() += 1;
    }
    Ok(seen)
}

/// `fastpath ct <command> --pin-dir <pin>`: its output.
fn ct(bin: &std::path::Path, pin: &str, command: &str) -> Result<String> {
    host_run(&[
        bin.as_os_str(),
        "ct".as_ref(),
        command.as_ref(),
        "--pin-dir".as_ref(),
        pin.as_ref(),
    ])
    .with_context(|| format!("fastpath ct {command}"))
}

fn traffic(lb: &LbTopology) -> Result<()> {
    let b0v4 = LbTopology::backend_v4(0).to_string();
    let b0v6 = LbTopology::backend_v6(0).to_string();
    let out = lb
        .client()
        .run(&["ping", "-c", "3", "-i", "0.2", &b0v4])
        .context("ping")?;
    println!(
        "  ping {b0v4}: {}",
        out.lines()
            .filter(|l| l.contains("packet loss"))
            .collect::<String>()
    );
    let out = lb
        .client()
        .run(&["ping", "-6", "-c", "3", "-i", "0.2", &b0v6])
        .context("ping -6")?;
    println!(
        "  ping -6 {b0v6}: {}",
        out.lines()
            .filter(|l| l.contains("packet loss"))
            .collect::<String>()
    );
    for i in 0..BACKENDS {
        curl(lb, &LbTopology::backend_v4(i).to_string(), i)?;
        curl(lb, &format!("[{}]", LbTopology::backend_v6(i)), i)?;
    }
    // UDP: 20 datagrams to a socat sink on backend 2.
    let sink = lb
        .backend(2)
        .spawn(&["socat", "-u", "UDP4-RECV:9000", "OPEN:/dev/null"])?;
    std::thread::sleep(std::time::Duration::from_millis(200));
    let script = format!(
        "for i in $(seq 20); do echo datagram-$i | socat -u - UDP4-SENDTO:{}:9000; done",
        LbTopology::backend_v4(2)
    );
    lb.client().run(&["sh", "-c", &script])?;
    println!("  udp: 20 datagrams to {}:9000", LbTopology::backend_v4(2));
    drop(sink);
    // One datagram to a closed port: the backend's ICMP port unreachable is related to it.
    let script = format!("echo probe | socat -u - UDP4-SENDTO:{b0v4}:9999");
    lb.client().run(&["sh", "-c", &script])?;
    println!("  udp: 1 datagram to {b0v4}:9999 (closed: answered with ICMP port unreachable)");
    Ok(())
}

fn curl(lb: &LbTopology, host: &str, backend: usize) -> Result<()> {
    let url = format!("http://{host}:{HTTP_PORT}/");
    let body = lb
        .client()
        .run(&["curl", "-sS", "-g", "--fail", "--max-time", "10", &url])
        .with_context(|| format!("curl {url}"))?;
    let want = format!("hello from backend {backend}\n");
    if body != want {
        bail!("curl {url}: expected {want:?}, got {body:?}");
    }
    println!("  curl {url} -> {}", body.trim());
    Ok(())
}

fn print_counters(title: &str, delta: &StatsSnapshot) {
    println!("\n  {title} (per hook, verdict and reason; counted once per packet per hook):");
    println!("{}", indent(&delta.render_table()));
    let total: u64 = Hook::ALL.iter().map(|h| delta.packets_on_hook(*h)).sum();
    let kernel: u64 = delta
        .rows()
        .iter()
        .filter(|r| r.verdict == Verdict::Kernel.name())
        .map(|r| r.packets)
        .sum();
    println!(
        "  {total} packet-hook events, {kernel} handed to the kernel (the slow path): conntrack tracks them (below); connections to the VIP are translated to their backend at XDP (lb_to_backend / lb_from_backend) and sent on from there (forward); the kernel routes only what the fast path hands it (a next hop not yet resolved, traffic to fp itself)."
    );
}

fn indent(s: &str) -> String {
    s.lines()
        .map(|l| format!("    {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::new();
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
