//! End to end: connection tracking of real traffic (curl against nginx, a UDP echo, ping, a
//! long-lived socat session) through the `fp` node of [`lb_topology`], with the kernel's own
//! conntrack in the same namespace as the reference: the same tuples, the same TCP states, the
//! same per-direction packet counts, and `conntrack -E` style events in the order Linux emits
//! them.
//!
//! Root only (never skipped: without root these tests fail). Tools, Debian packages: iproute2,
//! nftables (a rule that makes the kernel track the namespace), conntrack, curl, nginx-light,
//! socat, iputils-ping, ethtool.
//! Run with `--test-threads=1`: the tests share the kernel (bpffs); each still has its own
//! namespaces and pin directory.

use std::{
    collections::BTreeMap,
    fmt, fs,
    net::IpAddr,
    path::{Path, PathBuf},
    thread,
    time::{Duration, Instant},
};

use fastpath::testkit::netns::{
    Daemon, LbTopology, Netns, TempDir, host_run, prepare_test, test_lb_topology, unique_pin_dir,
};
use serde::Deserialize;

use crate::bin;

/// Our counters count the frame as the hook sees it (Ethernet header included); the kernel's
/// conntrack accounting counts the IP packet. Per packet the two differ by exactly this.
const ETH: u64 = 14;

/// How long events and states get to settle after the traffic that causes them.
const SETTLE: Duration = Duration::from_secs(2);

/// A connection as its originator sees it (`original` tuple). ICMP echo: both ports hold the
/// echo identifier, as in `fastpath ct list -o json`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Flow {
    proto: String,
    src: IpAddr,
    dst: IpAddr,
    sport: u16,
    dport: u16,
}

impl Flow {
    fn new(proto: &str, src: IpAddr, sport: u16, dst: IpAddr, dport: u16) -> Flow {
        Flow {
            proto: proto.into(),
            src,
            dst,
            sport,
            dport,
        }
    }

    /// ICMP or ICMPv6 echo with identifier `id`.
    fn echo(src: IpAddr, dst: IpAddr, id: u16) -> Flow {
        let proto = if src.is_ipv6() { "icmpv6" } else { "icmp" };
        Flow::new(proto, src, id, dst, id)
    }

    fn reversed(&self) -> Flow {
        Flow::new(&self.proto, self.dst, self.dport, self.src, self.sport)
    }

    /// The same connection, whichever side is the originator.
    fn same_connection(&self, other: &Flow) -> bool {
        self == other || *self == other.reversed()
    }
}

impl fmt::Display for Flow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} {}:{} -> {}:{}",
            self.proto,
            if self.src.is_ipv6() { "v6" } else { "v4" },
            self.src,
            self.sport,
            self.dst,
            self.dport
        )
    }
}

// ---------------------------------------------------------------------------------------------
// Our table: `fastpath ct list -o json`, `fastpath ct stats`, the event log.

/// One direction of a row of `fastpath ct list -o json`.
#[derive(Clone, Debug, Deserialize)]
struct Side {
    src: IpAddr,
    dst: IpAddr,
    sport: u16,
    dport: u16,
    packets: u64,
    bytes: u64,
}

/// A row of `fastpath ct list -o json`.
#[derive(Clone, Debug, Deserialize)]
struct Row {
    proto: String,
    state: String,
    original: Side,
    reply: Side,
    assured: bool,
    seen_reply: bool,
    timeout_s: u64,
}

impl Row {
    fn flow(&self) -> Flow {
        let o = &self.original;
        Flow::new(&self.proto, o.src, o.sport, o.dst, o.dport)
    }

    fn packets(&self) -> u64 {
        self.original.packets + self.reply.packets
    }
}

fn our_table(daemon: &Daemon) -> Vec<Row> {
    let json = host_run(&[
        bin().as_os_str(),
        "ct".as_ref(),
        "list".as_ref(),
        "--pin-dir".as_ref(),
        daemon.pin_dir().as_os_str(),
        "-o".as_ref(),
        "json".as_ref(),
    ])
    .unwrap_or_else(|e| panic!("fastpath ct list: {e}"));
    serde_json::from_str(&json)
        .unwrap_or_else(|e| panic!("`fastpath ct list -o json` is not a list of rows: {e}\n{json}"))
}

/// `fastpath ct get` for `flow` (either direction), as JSON; `None` when it exits 1 (not
/// tracked).
fn our_get(daemon: &Daemon, flow: &Flow) -> Option<Row> {
    let (sport, dport) = (flow.sport.to_string(), flow.dport.to_string());
    let (src, dst) = (flow.src.to_string(), flow.dst.to_string());
    let mut args = vec!["ct", "get", "-p", &flow.proto, "-s", &src, "-d", &dst];
    if flow.proto.starts_with("icmp") {
        args.extend(["--id", &sport]);
    } else {
        args.extend(["--sport", &sport, "--dport", &dport]);
    }
    let pin_dir = daemon.pin_dir().to_str().expect("pin dirs are UTF-8");
    args.extend(["--pin-dir", pin_dir, "-o", "json"]);
    let out = std::process::Command::new(bin())
        .args(&args)
        .output()
        .unwrap_or_else(|e| panic!("running fastpath ct get: {e}"));
    match out.status.code() {
        Some(0) => Some(serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "`fastpath ct get -o json` printed no row: {e}\n{}",
                String::from_utf8_lossy(&out.stdout)
            )
        })),
        Some(1) if out.stdout.is_empty() => None,
        _ => panic!(
            "fastpath {}: {}\n{}{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

fn render_table(rows: &[Row]) -> String {
    if rows.is_empty() {
        return "  (empty)\n".into();
    }
    rows.iter()
        .map(|r| {
            format!(
                "  {} {} orig packets={} bytes={} reply packets={} bytes={} assured={} seen_reply={} timeout={}s\n",
                r.flow(),
                r.state,
                r.original.packets,
                r.original.bytes,
                r.reply.packets,
                r.reply.bytes,
                r.assured,
                r.seen_reply,
                r.timeout_s
            )
        })
        .collect()
}

/// `fastpath ct stats`: counter name to value.
fn our_stats(daemon: &Daemon) -> BTreeMap<String, u64> {
    let out = host_run(&[
        bin().as_os_str(),
        "ct".as_ref(),
        "stats".as_ref(),
        "--pin-dir".as_ref(),
        daemon.pin_dir().as_os_str(),
    ])
    .unwrap_or_else(|e| panic!("fastpath ct stats: {e}"));
    out.lines()
        .filter_map(|l| {
            let (name, value) = l.split_once(char::is_whitespace)?;
            Some((name.to_owned(), value.trim().parse().ok()?))
        })
        .collect()
}

fn stat(stats: &BTreeMap<String, u64>, name: &str) -> u64 {
    match stats.get(name) {
        Some(&v) => v,
        None => panic!("`fastpath ct stats` has no counter {name:?}: {stats:?}"),
    }
}

/// One line of the daemon's `--ct-events-log`.
#[derive(Clone, Debug)]
struct Event {
    /// Microseconds, as printed.
    ts_us: u64,
    /// `NEW`, `UPDATE`, `DESTROY`.
    kind: String,
    /// TCP state; empty for other protocols.
    state: String,
    flow: Flow,
    assured: bool,
    line: String,
}

/// `[4680.924606] [NEW] tcp 6 SYN_SENT src=.. dst=.. sport=.. dport=.. [ASSURED]` (ICMP:
/// `id=..` instead of the ports).
fn parse_event(line: &str) -> Option<Event> {
    let mut tokens = line.split_whitespace();
    let ts = tokens.next()?.strip_prefix('[')?.strip_suffix(']')?;
    let (sec, usec) = ts.split_once('.')?;
    let ts_us = sec.parse::<u64>().ok()? * 1_000_000 + usec.parse::<u64>().ok()?;
    let kind = tokens
        .next()?
        .strip_prefix('[')?
        .strip_suffix(']')?
        .to_owned();
    let proto = tokens.next()?.to_owned();
    let _num = tokens.next()?;
    let mut state = String::new();
    let mut kv = BTreeMap::new();
    let mut assured = false;
    for t in tokens {
        if let Some((k, v)) = t.split_once('=') {
            kv.insert(k, v);
        } else if t == "[ASSURED]" {
            assured = true;
        } else {
            state = t.to_owned();
        }
    }
    let addr = |k: &str| kv.get(k)?.parse::<IpAddr>().ok();
    let port = |k: &str| kv.get(k)?.parse::<u16>().ok();
    let (sport, dport) = match port("id") {
        Some(id) => (id, id),
        None => (port("sport")?, port("dport")?),
    };
    Some(Event {
        ts_us,
        kind,
        state,
        flow: Flow::new(&proto, addr("src")?, sport, addr("dst")?, dport),
        assured,
        line: line.to_owned(),
    })
}

/// Every complete line of the event log (a line still being written is left for later).
fn read_events(path: &Path) -> Vec<Event> {
    let text = fs::read_to_string(path).unwrap_or_default();
    let complete = match text.rfind('\n') {
        Some(end) => &text[..=end],
        None => "",
    };
    complete
        .lines()
        .map(|l| {
            parse_event(l).unwrap_or_else(|| {
                panic!(
                    "unparseable line in the conntrack event log {}: {l:?}",
                    path.display()
                )
            })
        })
        .collect()
}

fn render_events(events: &[Event]) -> String {
    if events.is_empty() {
        return "  (none)\n".into();
    }
    events.iter().map(|e| format!("  {}\n", e.line)).collect()
}

/// Prints the event log when the test panics (dropped before the temp dir holding it).
struct PrintEventsOnPanic(PathBuf);

impl Drop for PrintEventsOnPanic {
    fn drop(&mut self) {
        if thread::panicking() {
            eprintln!(
                "--- conntrack event log {} ---\n{}",
                self.0.display(),
                fs::read_to_string(&self.0).unwrap_or_default()
            );
        }
    }
}

/// The daemon on fp, every hook on every fp interface, logging conntrack events to
/// `events_log`.
fn start_daemon(lb: &LbTopology, role: &str, events_log: &Path) -> Daemon {
    let log = events_log.to_str().expect("temp paths are UTF-8");
    Daemon::start_with_args(
        bin(),
        lb.fp(),
        &lb.fp_config(&unique_pin_dir(role)),
        &["--ct-events-log", log],
    )
}

// ---------------------------------------------------------------------------------------------
// The kernel's table: `conntrack -L` in the fp namespace.

/// One direction of a `conntrack -L` entry.
#[derive(Clone, Debug)]
struct KernelSide {
    src: IpAddr,
    dst: IpAddr,
    sport: u16,
    dport: u16,
    /// With `nf_conntrack_acct=1` only.
    packets: Option<u64>,
    bytes: Option<u64>,
}

/// A `conntrack -L` line: `tcp 6 119 TIME_WAIT src=.. dst=.. sport=.. dport=.. packets=..
/// bytes=.. src=.. ... [ASSURED] mark=0 use=1`.
#[derive(Clone, Debug)]
struct KernelEntry {
    proto: String,
    /// TCP state; empty for other protocols.
    state: String,
    original: KernelSide,
    reply: KernelSide,
    assured: bool,
    unreplied: bool,
    line: String,
}

impl KernelEntry {
    fn flow(&self) -> Flow {
        let o = &self.original;
        Flow::new(&self.proto, o.src, o.sport, o.dst, o.dport)
    }
}

fn parse_conntrack_line(line: &str) -> Option<KernelEntry> {
    let tokens: Vec<&str> = line.split_whitespace().collect();
    let proto = (*tokens.first()?).to_owned();
    let mut state = String::new();
    // Two tuples, each a run of key=value starting at `src=`.
    let mut sides: Vec<BTreeMap<&str, &str>> = Vec::new();
    let (mut assured, mut unreplied) = (false, false);
    for (i, t) in tokens.iter().enumerate().skip(3) {
        match t.split_once('=') {
            Some(("src", v)) if sides.len() < 2 => {
                sides.push(BTreeMap::from([("src", v)]));
            }
            Some((k, v)) => {
                // Whatever follows the reply tuple (mark=, use=, zone=) is never looked up.
                if let Some(side) = sides.last_mut() {
                    side.entry(k).or_insert(v);
                }
            }
            None if *t == "[ASSURED]" => assured = true,
            None if *t == "[UNREPLIED]" => unreplied = true,
            None if i == 3 => state = (*t).to_owned(),
            None => {}
        }
    }
    let side = |m: &BTreeMap<&str, &str>| -> Option<KernelSide> {
        let port = |k: &str| m.get(k)?.parse::<u16>().ok();
        let (sport, dport) = match port("id") {
            Some(id) => (id, id),
            None => (port("sport")?, port("dport")?),
        };
        Some(KernelSide {
            src: m.get("src")?.parse().ok()?,
            dst: m.get("dst")?.parse().ok()?,
            sport,
            dport,
            packets: m.get("packets").and_then(|v| v.parse().ok()),
            bytes: m.get("bytes").and_then(|v| v.parse().ok()),
        })
    };
    Some(KernelEntry {
        proto,
        state,
        original: side(sides.first()?)?,
        reply: side(sides.get(1)?)?,
        assured,
        unreplied,
        line: line.to_owned(),
    })
}

/// `conntrack -L <filter>` in `ns`, parsed, in the order listed.
fn kernel_table(ns: &Netns, filter: &[&str]) -> Vec<KernelEntry> {
    let mut args = vec!["conntrack", "-L"];
    args.extend_from_slice(filter);
    let out = ns
        .run(&args)
        .unwrap_or_else(|e| panic!("kernel conntrack table: {e}"));
    out.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            parse_conntrack_line(l)
                .unwrap_or_else(|| panic!("unparseable `conntrack -L` line: {l:?}"))
        })
        .collect()
}

fn render_kernel(entries: &[KernelEntry]) -> String {
    if entries.is_empty() {
        return "  (empty)\n".into();
    }
    entries.iter().map(|e| format!("  {}\n", e.line)).collect()
}

/// Makes the kernel track connections in `ns` (conntrack runs only once a rule there uses
/// it), with per-direction packet and byte accounting, starting from an empty table. The rule
/// accepts everything (forward policy accept), so it changes no traffic.
fn enable_kernel_conntrack(ns: &Netns) {
    let steps: [&[&str]; 4] = [
        &["nft", "add", "table", "inet", "fpt_ct"],
        &[
            "nft",
            "add",
            "chain",
            "inet",
            "fpt_ct",
            "ct_forward",
            "{ type filter hook forward priority 0; policy accept; }",
        ],
        &[
            "nft",
            "add",
            "rule",
            "inet",
            "fpt_ct",
            "ct_forward",
            "ct",
            "state",
            "established,related",
            "accept",
        ],
        &["conntrack", "-F"],
    ];
    for (i, args) in steps.iter().enumerate() {
        ns.run(args)
            .unwrap_or_else(|e| panic!("enabling kernel conntrack in {}: {e}", ns.name()));
        if i == 2 {
            // The sysctl exists once the rule has loaded conntrack into the namespace.
            ns.sysctl("net.netfilter.nf_conntrack_acct", "1")
                .unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

/// GRO off on `devs` in `ns`: XDP sees every segment as sent (and attaching XDP to a veth
/// turns GRO on), while the kernel's conntrack would count a GRO-merged train of segments as
/// one packet. Off, both count the same packets.
fn gro_off(ns: &Netns, devs: &[String]) {
    for dev in devs {
        ns.run(&["ethtool", "-K", dev, "gro", "off"])
            .unwrap_or_else(|e| panic!("turning GRO off on {dev}: {e}"));
    }
}

/// Calls `f` until it returns `Ok` or `timeout` passes; then the last `Err` (what was seen).
fn poll<T>(timeout: Duration, mut f: impl FnMut() -> Result<T, String>) -> Result<T, String> {
    let deadline = Instant::now() + timeout;
    loop {
        match f() {
            Ok(v) => return Ok(v),
            Err(seen) if Instant::now() >= deadline => return Err(seen),
            Err(_) => thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// curl from `client` with the connection closed after the response (HTTP/1.1,
/// `Connection: close`); checks the body and returns the client's source port.
fn curl(client: &Netns, url: &str, out: &Path, want_body: &str, ipv6: bool) -> u16 {
    let out_s = out.to_str().expect("temp paths are UTF-8");
    let mut args = vec!["curl", "-sS", "-g", "--fail", "--http1.1"];
    if ipv6 {
        args.push("-6");
    }
    args.extend([
        "-H",
        "Connection: close",
        "--max-time",
        "10",
        "-o",
        out_s,
        "-w",
        "%{local_port}",
        url,
    ]);
    let port = client
        .run(&args)
        .unwrap_or_else(|e| panic!("curl {url} through fp: {e}"));
    let body = fs::read_to_string(out).unwrap_or_default();
    assert_eq!(body, want_body, "curl {url}: unexpected body");
    port.trim()
        .parse()
        .unwrap_or_else(|e| panic!("curl -w %{{local_port}} printed {port:?}: {e}"))
}

const PAGE: &str = "<html><body>fastpath conntrack reference page</body></html>\n";

/// (1) A whole TCP connection (handshake, request, response, close) through fp, next to the
/// kernel's conntrack in the same namespace: the events come in Linux's order (NEW SYN_SENT,
/// ESTABLISHED and assured on the handshake's last ACK, TIME_WAIT after both FINs), our table
/// holds exactly that connection with the kernel's original tuple and the kernel's final
/// state, and with accounting on both count the same packets per direction (bytes differ by
/// the Ethernet header: our hooks count frames, the kernel IP packets).
#[test]
fn tcp_exchange_through_fp_matches_kernel_conntrack() {
    prepare_test(&["curl", "nginx", "nft", "conntrack", "ethtool"]);
    let dir = TempDir::new("ct-tcp").expect("temp dir");
    let events_log = dir.join("ct-events.log");
    let _print = PrintEventsOnPanic(events_log.clone());
    let lb = test_lb_topology(1);
    let fp = lb.fp();
    enable_kernel_conntrack(fp);
    let daemon = start_daemon(&lb, "ct-tcp", &events_log);
    gro_off(fp, &lb.fp_interfaces());
    let server = lb
        .backend(0)
        .http_server(80)
        .unwrap_or_else(|e| panic!("starting nginx: {e}"));
    fs::write(server.root().join("index.html"), PAGE).expect("writing the page");

    fp.run(&["conntrack", "-F"])
        .unwrap_or_else(|e| panic!("{e}"));
    let before = our_table(&daemon);
    assert!(
        before.is_empty(),
        "nothing has crossed fp yet, but our table holds:\n{}",
        render_table(&before)
    );

    let client = LbTopology::client_v4().into();
    let backend = LbTopology::backend_v4(0).into();
    let url = format!("http://{backend}:80/index.html");
    let port = curl(lb.client(), &url, &dir.join("page.html"), PAGE, false);
    let flow = Flow::new("tcp", client, port, backend, 80);

    // (a) The events of this flow, once it has closed.
    let closed = |e: &Event| e.kind == "UPDATE" && (e.state == "TIME_WAIT" || e.state == "CLOSE");
    let events = poll(SETTLE, || {
        let all = read_events(&events_log);
        let mine: Vec<Event> = all.iter().filter(|e| e.flow == flow).cloned().collect();
        if mine.iter().any(closed) {
            Ok(mine)
        } else {
            Err(format!(
                "no TIME_WAIT/CLOSE event for {flow} within {SETTLE:?}; the log:\n{}",
                render_events(&all)
            ))
        }
    })
    .unwrap_or_else(|seen| panic!("{seen}"));
    let summary: Vec<(&str, &str, bool)> = events
        .iter()
        .map(|e| (e.kind.as_str(), e.state.as_str(), e.assured))
        .collect();
    let last_state = events.last().map_or("", |e| e.state.as_str());
    assert_eq!(
        summary,
        [
            ("NEW", "SYN_SENT", false),
            ("UPDATE", "SYN_RECV", false),
            ("UPDATE", "ESTABLISHED", true),
            ("UPDATE", last_state, true)
        ],
        "expected NEW SYN_SENT, UPDATE SYN_RECV (the SYN-ACK, the first reply), UPDATE ESTABLISHED [ASSURED], UPDATE TIME_WAIT|CLOSE [ASSURED] for {flow}; its events:\n{}",
        render_events(&events)
    );
    assert!(
        events.windows(2).all(|w| w[0].ts_us < w[1].ts_us),
        "event timestamps of {flow} must increase:\n{}",
        render_events(&events)
    );

    // (b) Our table and the kernel's, once both have seen the close.
    let kernel_filter = ["-p", "tcp", "--dport", "80"];
    let (ours, kernel) = poll(SETTLE, || {
        let ours = our_table(&daemon);
        let kernel = kernel_table(fp, &kernel_filter);
        let our_state = ours.first().map(|r| r.state.clone());
        let kernel_state = kernel.first().map(|e| e.state.clone());
        if our_state.as_deref() == Some("TIME_WAIT") && kernel_state.as_deref() == Some("TIME_WAIT")
        {
            Ok((ours, kernel))
        } else {
            Err(format!(
                "after {SETTLE:?}, ours: {our_state:?}, kernel: {kernel_state:?}\nours:\n{}kernel:\n{}",
                render_table(&ours),
                render_kernel(&kernel)
            ))
        }
    })
    .unwrap_or_else(|seen| panic!("expected TIME_WAIT in both tables for {flow}; {seen}"));
    assert!(
        ours.len() == 1 && ours[0].flow() == flow && kernel.len() == 1,
        "expected exactly {flow} in both tables\nours:\n{}kernel:\n{}",
        render_table(&ours),
        render_kernel(&kernel)
    );
    let (row, k) = (&ours[0], &kernel[0]);
    assert_eq!(
        row.flow(),
        k.flow(),
        "original tuple: ours vs the kernel's\nours:\n{}kernel:\n{}",
        render_table(&ours),
        render_kernel(&kernel)
    );
    assert!(
        row.assured && row.seen_reply && k.assured,
        "a completed TCP connection is assured in both tables\nours:\n{}kernel:\n{}",
        render_table(&ours),
        render_kernel(&kernel)
    );

    // (c) Packets per direction: exactly the kernel's; bytes one Ethernet header more each.
    for (dir, our, theirs) in [
        ("original", &row.original, &k.original),
        ("reply", &row.reply, &k.reply),
    ] {
        assert!(
            our.packets >= 3,
            "{dir}: a handshake, a request or response and a close make at least 3 packets, ours counted {}",
            our.packets
        );
        assert_eq!(
            (Some(our.packets), Some(our.bytes)),
            (theirs.packets, theirs.bytes.map(|b| b + ETH * our.packets)),
            "{dir}: expected our packets = the kernel's and our bytes = the kernel's + {ETH} per packet\nours:\n{}kernel:\n{}",
            render_table(&ours),
            render_kernel(&kernel)
        );
    }

    // Each packet was looked up exactly once on fp (at the XDP hook where it came in; never
    // again at TC or egress): lookups = accounted packets + the ones accepted unaccounted.
    let stats = our_stats(&daemon);
    let lookups = stat(&stats, "lookups");
    let unaccounted = stat(&stats, "ignored");
    assert_eq!(
        (
            lookups,
            stat(&stats, "new"),
            stat(&stats, "assured"),
            stat(&stats, "closed"),
            stat(&stats, "invalid_new") + stat(&stats, "invalid_state"),
        ),
        (row.packets() + unaccounted, 1, 1, 1, 0),
        "expected lookups = {} packets + {unaccounted} ignored, one new, assured and closed connection, nothing invalid; ct stats: {stats:?}",
        row.packets()
    );
    eprintln!(
        "{flow}: ours {} orig {}p/{}B reply {}p/{}B | kernel {} orig {:?}p/{:?}B reply {:?}p/{:?}B\nevents:\n{}",
        row.state,
        row.original.packets,
        row.original.bytes,
        row.reply.packets,
        row.reply.bytes,
        k.state,
        k.original.packets,
        k.original.bytes,
        k.reply.packets,
        k.reply.bytes,
        render_events(&events)
    );
}

/// Waits until `flow` (UDP or ICMP echo, answered) has a NEW event in the log, an UPDATE for
/// its first reply, then (when `assured`) an assured UPDATE, and no other event; returns its
/// events.
fn wait_events(events_log: &Path, flow: &Flow, assured: bool) -> Vec<Event> {
    let want: &[(&str, bool)] = if assured {
        &[("NEW", false), ("UPDATE", false), ("UPDATE", true)]
    } else {
        &[("NEW", false), ("UPDATE", false)]
    };
    poll(SETTLE, || {
        let all = read_events(events_log);
        let mine: Vec<Event> = all.iter().filter(|e| e.flow == *flow).cloned().collect();
        let kinds: Vec<(&str, bool)> = mine.iter().map(|e| (e.kind.as_str(), e.assured)).collect();
        if kinds == want {
            Ok(mine)
        } else {
            Err(format!(
                "expected exactly {want:?} for {flow} within {SETTLE:?}; the log:\n{}",
                render_events(&all)
            ))
        }
    })
    .unwrap_or_else(|seen| panic!("{seen}"))
}

/// Pings `target` from `ns` `count` times with echo identifier `id`; all must be answered.
fn ping(ns: &Netns, target: IpAddr, id: u16, count: u32) {
    let (count_s, id_s, target_s) = (count.to_string(), id.to_string(), target.to_string());
    let mut args = vec!["ping", "-n", "-q", "-c", &count_s, "-i", "0.05", "-W", "2"];
    if target.is_ipv6() {
        args.push("-6");
    }
    args.extend(["-e", &id_s, &target_s]);
    let out = ns.exec(&args).unwrap_or_else(|e| panic!("{e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let want = format!("{count} packets transmitted, {count} received");
    assert!(
        out.status.success() && stdout.contains(&want),
        "expected `{want}` pinging {target} (id {id}); got {}:\n{stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Sends one datagram from `ns` (source port `sport`) to the UDP echo server at `target` and
/// checks the echo; with `again_after`, a second datagram on the same socket that much later.
fn udp_echo(ns: &Netns, target: IpAddr, port: u16, sport: u16, again_after: Option<f64>) {
    let msg = format!("fastpath-ct-{target}");
    let address = match target {
        IpAddr::V4(a) => format!("UDP4:{a}:{port},sourceport={sport}"),
        IpAddr::V6(a) => format!("UDP6:[{a}]:{port},sourceport={sport}"),
    };
    let (input, want) = match again_after {
        None => (format!("echo {msg}"), msg.clone()),
        Some(s) => (
            format!("(echo {msg}; sleep {s}; echo again)"),
            format!("{msg}\nagain"),
        ),
    };
    // -t 1: after sending, wait a second for the answer (UDP has no end of stream).
    let out = ns
        .run(&["sh", "-c", &format!("{input} | socat -t 1 - {address}")])
        .unwrap_or_else(|e| panic!("UDP echo via {address}: {e}"));
    assert_eq!(out.trim(), want, "UDP echo via {address}");
}

/// (2) UDP, ICMP echo (v4 and v6) and TCP over IPv6 through fp: each is tracked with the
/// tuple (and echo identifier) the traffic used, counts the packets the kernel's conntrack
/// counted for it, and is assured exactly when the kernel's entry is: TCP once established,
/// UDP only when answered and still active more than 2 s after it began (a single request
/// and reply is not), ICMP echo never.
#[test]
fn udp_and_icmp_through_fp_are_tracked_and_assured() {
    prepare_test(&["socat", "ping", "curl", "nginx", "nft", "conntrack"]);
    let dir = TempDir::new("ct-udp-icmp").expect("temp dir");
    let events_log = dir.join("ct-events.log");
    let _print = PrintEventsOnPanic(events_log.clone());
    let lb = test_lb_topology(1);
    let fp = lb.fp();
    enable_kernel_conntrack(fp);
    let daemon = start_daemon(&lb, "ct-udp-icmp", &events_log);
    const UDP_PORT: u16 = 9000;
    let backend_ns = lb.backend(0);
    let _udp4 = backend_ns
        .spawn(&["socat", "UDP4-LISTEN:9000,fork", "PIPE"])
        .expect("starting the IPv4 UDP echo server");
    let _udp6 = backend_ns
        .spawn(&["socat", "UDP6-LISTEN:9000,fork,ipv6only=1", "PIPE"])
        .expect("starting the IPv6 UDP echo server");
    poll(Duration::from_secs(10), || {
        let out = backend_ns
            .run(&["ss", "-Hlun", "sport", "=", ":9000"])
            .unwrap_or_else(|e| panic!("{e}"));
        if out.lines().count() == 2 {
            Ok(())
        } else {
            Err(format!(
                "expected an IPv4 and an IPv6 UDP socket on port {UDP_PORT}; ss:\n{out}"
            ))
        }
    })
    .unwrap_or_else(|seen| panic!("{seen}"));
    let server = backend_ns
        .http_server(80)
        .unwrap_or_else(|e| panic!("starting nginx: {e}"));
    fs::write(server.root().join("index.html"), PAGE).expect("writing the page");
    fp.run(&["conntrack", "-F"])
        .unwrap_or_else(|e| panic!("{e}"));

    let (c4, c6): (IpAddr, IpAddr) = (
        LbTopology::client_v4().into(),
        LbTopology::client_v6().into(),
    );
    let (b4, b6): (IpAddr, IpAddr) = (
        LbTopology::backend_v4(0).into(),
        LbTopology::backend_v6(0).into(),
    );
    const PINGS: u32 = 3;
    const ID4: u16 = 4242;
    const ID6: u16 = 4343;
    // Each datagram once, each way; each echo request and reply once.
    let udp4 = Flow::new("udp", c4, 40001, b4, UDP_PORT);
    let udp6 = Flow::new("udp", c6, 40002, b6, UDP_PORT);
    let stream4 = Flow::new("udp", c4, 40003, b4, UDP_PORT);
    let stream6 = Flow::new("udp", c6, 40004, b6, UDP_PORT);
    udp_echo(lb.client(), b4, UDP_PORT, udp4.sport, None);
    udp_echo(lb.client(), b6, UDP_PORT, udp6.sport, None);
    // Still active 2.5 s after the first datagram: a stream, assured.
    thread::scope(|scope| {
        for (flow, target) in [(&stream4, b4), (&stream6, b6)] {
            let ns = lb.client();
            scope.spawn(move || udp_echo(ns, target, UDP_PORT, flow.sport, Some(2.5)));
        }
    });
    ping(lb.client(), b4, ID4, PINGS);
    ping(lb.client(), b6, ID6, PINGS);
    let url6 = format!("http://[{b6}]:80/index.html");
    let port6 = curl(lb.client(), &url6, &dir.join("page6.html"), PAGE, true);
    let tcp6 = Flow::new("tcp", c6, port6, b6, 80);

    // (flow, packets each way, assured as in Linux)
    let expected: [(&Flow, Option<u64>, bool); 7] = [
        (&udp4, Some(1), false),
        (&udp6, Some(1), false),
        (&stream4, Some(2), true),
        (&stream6, Some(2), true),
        (&Flow::echo(c4, b4, ID4), Some(u64::from(PINGS)), false),
        (&Flow::echo(c6, b6, ID6), Some(u64::from(PINGS)), false),
        (&tcp6, None, true),
    ];
    for (flow, _, assured) in &expected {
        if flow.proto != "tcp" {
            wait_events(&events_log, flow, *assured);
        }
    }
    // The TCP connection's close has reached both tables (so its counts are final).
    let (ours, kernel) = poll(SETTLE, || {
        let ours = our_table(&daemon);
        let kernel = kernel_table(fp, &[]);
        let tw = |s: Option<&str>| s == Some("TIME_WAIT");
        let our_tcp = ours
            .iter()
            .find(|r| r.flow() == tcp6)
            .map(|r| r.state.as_str());
        let kernel_tcp = kernel
            .iter()
            .find(|e| e.flow() == tcp6)
            .map(|e| e.state.as_str());
        if tw(our_tcp) && tw(kernel_tcp) {
            Ok((ours, kernel))
        } else {
            Err(format!(
                "{tcp6}: ours {our_tcp:?}, kernel {kernel_tcp:?}\nours:\n{}kernel:\n{}",
                render_table(&ours),
                render_kernel(&kernel)
            ))
        }
    })
    .unwrap_or_else(|seen| panic!("expected TIME_WAIT in both tables within {SETTLE:?}; {seen}"));
    let tables = format!(
        "ours:\n{}kernel:\n{}",
        render_table(&ours),
        render_kernel(&kernel)
    );
    assert_eq!(
        ours.len(),
        expected.len(),
        "expected exactly the {} connections made; {tables}",
        expected.len()
    );

    let unknown = Flow::new("udp", c4, 1, b4, 1);
    assert!(
        our_get(&daemon, &unknown).is_none(),
        "`fastpath ct get` must exit 1 for a connection that is not tracked ({unknown})"
    );
    for (flow, packets, assured) in expected {
        let row = ours
            .iter()
            .find(|r| r.flow() == *flow)
            .unwrap_or_else(|| panic!("{flow} is not in our table (original tuple); {tables}"));
        assert!(
            row.seen_reply && row.assured == assured,
            "{flow}: answered, so expected seen_reply, and assured = {assured}; {tables}"
        );
        assert_eq!(
            (row.original.dst, row.original.sport, row.original.dport),
            (flow.dst, flow.sport, flow.dport),
            "{flow}: our tuple (ICMP: identifier in both ports)"
        );
        if let Some(n) = packets {
            assert_eq!(
                (row.original.packets, row.reply.packets),
                (n, n),
                "{flow}: expected {n} packets each way; {tables}"
            );
        }
        // `ct get` finds the same connection from the reply direction's tuple.
        let got = our_get(&daemon, &flow.reversed()).unwrap_or_else(|| {
            panic!(
                "`fastpath ct get` by {} found nothing; {tables}",
                flow.reversed()
            )
        });
        assert_eq!(
            (got.flow(), got.packets(), got.assured),
            (row.flow(), row.packets(), row.assured),
            "`fastpath ct get` by the reply tuple shows another row than `ct list`; {tables}"
        );
        let k = kernel
            .iter()
            .find(|e| e.flow() == *flow)
            .unwrap_or_else(|| panic!("{flow} is not in the kernel's table; {tables}"));
        assert!(
            !k.unreplied,
            "{flow}: the kernel must have seen the reply too; {tables}"
        );
        assert_eq!(
            k.assured, row.assured,
            "{flow}: assured must be the kernel's; {tables}"
        );
        for (dir, our, theirs) in [
            ("original", &row.original, &k.original),
            ("reply", &row.reply, &k.reply),
        ] {
            assert_eq!(
                (Some(our.packets), Some(our.bytes)),
                (theirs.packets, theirs.bytes.map(|b| b + ETH * our.packets)),
                "{flow} {dir}: expected the kernel's packets and its bytes + {ETH} per packet; {tables}"
            );
        }
        eprintln!(
            "{flow}: ours {} assured={} | kernel {} assured={} unreplied={}",
            row.state, row.assured, k.state, k.assured, k.unreplied
        );
    }
}

/// The client's side of a long-lived connection: a line every 100 ms for 2 s to an echo
/// server; socat then half-closes and exits when the server closes too.
const LINES: usize = 20;

/// (3) `fastpath ct flush` deletes every entry and reports how many; a connection that is in
/// the middle of its life is picked up again by its next packet (loose pickup, as Linux does:
/// ESTABLISHED at once, assured by the first packet after a reply), and the connection itself
/// never notices.
#[test]
fn ct_flush_empties_the_table_and_flows_are_picked_up_again() {
    prepare_test(&["socat"]);
    let dir = TempDir::new("ct-flush").expect("temp dir");
    let events_log = dir.join("ct-events.log");
    let _print = PrintEventsOnPanic(events_log.clone());
    let lb = test_lb_topology(1);
    let daemon = start_daemon(&lb, "ct-flush", &events_log);
    const PORT: u16 = 7000;
    let _server = lb
        .backend(0)
        .spawn(&["socat", "TCP4-LISTEN:7000,fork,reuseaddr", "PIPE"])
        .expect("starting the TCP echo server");
    lb.backend(0)
        .wait_listening("tcp", PORT, Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("{e}"));

    let (client, backend): (IpAddr, IpAddr) = (
        LbTopology::client_v4().into(),
        LbTopology::backend_v4(0).into(),
    );
    let script = format!(
        "for i in $(seq 1 {LINES}); do echo line$i; sleep 0.1; done | socat -t 2 - TCP4:{backend}:{PORT}"
    );
    let mut talker = lb
        .client()
        .spawn(&["sh", "-c", &script])
        .expect("starting the socat client");

    let established = poll(SETTLE, || {
        let rows = our_table(&daemon);
        match rows.iter().find(|r| r.original.dport == PORT) {
            Some(r) if r.state == "ESTABLISHED" && r.packets() >= 4 => Ok(r.clone()),
            _ => Err(format!(
                "no established connection to port {PORT} with a line exchanged; ours:\n{}",
                render_table(&rows)
            )),
        }
    })
    .unwrap_or_else(|seen| panic!("{seen}"));
    let flow = established.flow();
    assert_eq!(
        (flow.src, flow.dst, flow.proto.as_str()),
        (client, backend, "tcp"),
        "the connection opened with a SYN, so the client is the originator: {flow}"
    );
    thread::sleep(Duration::from_millis(300));

    let before = our_table(&daemon);
    let stats_before = our_stats(&daemon);
    let before_row = before
        .iter()
        .find(|r| r.flow() == flow)
        .cloned()
        .unwrap_or_else(|| {
            panic!(
                "{flow} vanished before the flush; ours:\n{}",
                render_table(&before)
            )
        });
    let out = host_run(&[
        bin().as_os_str(),
        "ct".as_ref(),
        "flush".as_ref(),
        "--pin-dir".as_ref(),
        daemon.pin_dir().as_os_str(),
    ])
    .unwrap_or_else(|e| panic!("fastpath ct flush: {e}"));
    let deleted: usize = out
        .trim()
        .strip_prefix("fastpath conntrack: ")
        .and_then(|s| s.strip_suffix(" flow entries have been deleted."))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("`fastpath ct flush` printed {out:?}"));
    let after = our_table(&daemon);
    assert_eq!(
        deleted,
        before.len(),
        "flush must delete every entry the table held; before:\n{}",
        render_table(&before)
    );
    // The flow keeps sending, so its next packet may already have re-created it: whatever is
    // there now must be new (fewer packets than before the flush), never a survivor.
    assert!(
        after.len() <= 1
            && after
                .iter()
                .all(|r| r.flow().same_connection(&flow) && r.packets() < before_row.packets()),
        "right after deleting {deleted} entries, expected an empty table or only the re-created {flow} with fewer than {} packets; before:\n{}after:\n{}",
        before_row.packets(),
        render_table(&before),
        render_table(&after)
    );

    // Picked up again by the next packet: established (loose pickup), assured.
    let picked = poll(SETTLE, || {
        let rows = our_table(&daemon);
        match rows.iter().find(|r| r.flow().same_connection(&flow)) {
            Some(r) if r.state == "ESTABLISHED" && r.assured && r.packets() >= 2 => Ok(r.clone()),
            _ => Err(format!(
                "{flow} not picked up again (ESTABLISHED, assured, 2+ packets); ours:\n{}",
                render_table(&rows)
            )),
        }
    })
    .unwrap_or_else(|seen| panic!("{seen}"));
    if picked.flow() != flow {
        // The first packet after the flush was the server's echo: like Linux's pickup, the
        // entry's originator is whoever sent the first packet seen.
        eprintln!(
            "note: {flow} was picked up from a reply-direction packet; its originator is now {}",
            picked.flow()
        );
    }
    let stats_picked = our_stats(&daemon);
    assert_eq!(
        (
            stat(&stats_picked, "new") - stat(&stats_before, "new"),
            stat(&stats_picked, "invalid_new") - stat(&stats_before, "invalid_new"),
        ),
        (1, 0),
        "the pickup creates exactly one entry and refuses no packet; ct stats before the flush {stats_before:?}, after the pickup {stats_picked:?}"
    );
    // Its ESTABLISHED events: the handshake's assured UPDATE (under `flow`; its first reply's
    // UPDATE was SYN_RECV), then the pickup's NEW, the UPDATE of the first packet the other way
    // (the reply is seen; the entry stays ESTABLISHED, not yet assured) and the assured UPDATE
    // of the packet after it — under the picked-up entry's originator, `flow` or its reverse.
    let want_pickup: &[(&str, bool)] = if picked.flow() == flow {
        &[
            ("UPDATE", true),
            ("NEW", false),
            ("UPDATE", false),
            ("UPDATE", true),
        ]
    } else {
        &[("NEW", false), ("UPDATE", false), ("UPDATE", true)]
    };
    poll(SETTLE, || {
        let all = read_events(&events_log);
        let established: Vec<Event> = all
            .into_iter()
            .filter(|e| e.flow == picked.flow() && e.state == "ESTABLISHED")
            .collect();
        let shape: Vec<(&str, bool)> = established
            .iter()
            .map(|e| (e.kind.as_str(), e.assured))
            .collect();
        if shape == want_pickup {
            Ok(())
        } else {
            Err(format!(
                "expected ESTABLISHED events {want_pickup:?} (kind, assured) for {}; got:\n{}",
                picked.flow(),
                render_events(&established)
            ))
        }
    })
    .unwrap_or_else(|seen| panic!("{seen}"));

    // The connection never noticed: every line came back, in order, and socat exited cleanly.
    let status = talker
        .wait_exit(Duration::from_secs(10))
        .unwrap_or_else(|| panic!("the socat client did not finish; output:\n{}", talker.log()));
    let log = talker.log();
    let want: Vec<String> = (1..=LINES).map(|i| format!("line{i}")).collect();
    assert!(
        status.success() && log.lines().collect::<Vec<_>>() == want,
        "expected socat to exit 0 after echoing line1..line{LINES}; it exited {status}; output:\n{log}"
    );
    let closed = poll(SETTLE, || {
        let rows = our_table(&daemon);
        match rows.iter().find(|r| r.flow() == picked.flow()) {
            Some(r) if r.state == "TIME_WAIT" => Ok(r.clone()),
            _ => Err(format!(
                "expected {} in TIME_WAIT after the close; ours:\n{}",
                picked.flow(),
                render_table(&rows)
            )),
        }
    })
    .unwrap_or_else(|seen| panic!("{seen}"));
    assert!(
        closed.packets() > picked.packets(),
        "the picked-up entry must go on counting: {} packets at pickup, {} at the end",
        picked.packets(),
        closed.packets()
    );
    eprintln!(
        "flush deleted {deleted}; {flow}: {} packets before the flush, {} at pickup ({}), {} at the end ({})",
        before_row.packets(),
        picked.packets(),
        picked.state,
        closed.packets(),
        closed.state
    );
}

/// Long-lived connections kept through the flood, and the lines each sends (one every 250 ms).
const FLOOD_TALKERS: usize = 16;
const FLOOD_LINES: usize = 48;
/// Table size for the flood: small, so a few thousand SYNs overfill it many times over.
const FLOOD_CAPACITY: u64 = 1024;

/// (4) Table pressure with a real SYN flood: a conntrack table of 1024 entries, the stateful
/// firewall on (so a connection whose entry went would have its packets dropped), 16
/// established TCP connections exchanging a line every 250 ms, then `hping3 --flood
/// --rand-source` SYNs for 5 s. The established connections keep their entries and every
/// byte of their echo; the table stays exactly full; occupancy and the counters add up
/// exactly (created − early-dropped − killed = entries); and the daemon answers throughout.
#[test]
fn syn_flood_past_capacity_keeps_established_connections() {
    prepare_test(&["socat", "hping3", "timeout"]);
    let dir = TempDir::new("ct-flood").expect("temp dir");
    let lb = test_lb_topology(1);
    let config = lb
        .fp_config(&unique_pin_dir("ct-flood"))
        .conntrack("capacity", FLOOD_CAPACITY)
        .stateful_firewall();
    let mut daemon = Daemon::start(bin(), lb.fp(), &config);
    const PORT: u16 = 7000;
    let _server = lb
        .backend(0)
        .spawn(&[
            "socat",
            "TCP4-LISTEN:7000,fork,reuseaddr,backlog=64",
            "PIPE",
        ])
        .expect("starting the TCP echo server");
    lb.backend(0)
        .wait_listening("tcp", PORT, Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("{e}"));
    let backend = LbTopology::backend_v4(0);

    // The long-lived connections: each echoes its lines back into its own file.
    let expected = |k: usize| -> String {
        (1..=FLOOD_LINES)
            .map(|i| format!("c{k}-line{i}\n"))
            .collect()
    };
    let mut talkers: Vec<_> = (0..FLOOD_TALKERS)
        .map(|k| {
            let out = dir.join(format!("talker{k}.out"));
            let script = format!(
                "for i in $(seq 1 {FLOOD_LINES}); do echo c{k}-line$i; sleep 0.25; done | socat -t 3 - TCP4:{backend}:{PORT} > {}",
                out.display()
            );
            (
                lb.client()
                    .spawn(&["sh", "-c", &script])
                    .expect("starting a socat client"),
                out,
            )
        })
        .collect();
    let established = poll(Duration::from_secs(10), || {
        let rows = our_table(&daemon);
        let est: Vec<Row> = rows
            .iter()
            .filter(|r| r.original.dport == PORT && r.state == "ESTABLISHED" && r.assured)
            .cloned()
            .collect();
        if est.len() == FLOOD_TALKERS {
            Ok(est)
        } else {
            Err(format!(
                "expected {FLOOD_TALKERS} established, assured connections to port {PORT}; ours:\n{}",
                render_table(&rows)
            ))
        }
    })
    .unwrap_or_else(|seen| panic!("{seen}"));

    // The flood, with `fastpath ct stats` timed while it runs.
    let flood_start = Instant::now();
    let (flood, stats_latencies) = thread::scope(|scope| {
        let flood = scope.spawn(|| {
            lb.client()
                .exec_timeout(
                    &[
                        "timeout",
                        "-s",
                        "INT",
                        "5",
                        "hping3",
                        "-S",
                        "-p",
                        "7000",
                        "--flood",
                        "--rand-source",
                        "-q",
                        &backend.to_string(),
                    ],
                    Duration::from_secs(20),
                )
                .unwrap_or_else(|e| panic!("hping3: {e}"))
        });
        let mut latencies = Vec::new();
        thread::sleep(Duration::from_millis(1000));
        for _ in 0..3 {
            let t = Instant::now();
            let s = our_stats(&daemon);
            latencies.push((t.elapsed(), stat(&s, "entries")));
            thread::sleep(Duration::from_millis(1000));
        }
        (flood.join().expect("flood thread"), latencies)
    });
    let flood_secs = flood_start.elapsed().as_secs_f64();
    let hping = format!(
        "{}{}",
        String::from_utf8_lossy(&flood.stdout),
        String::from_utf8_lossy(&flood.stderr)
    );
    let sent: u64 = hping
        .lines()
        .find_map(|l| {
            l.split(" packets transmitted")
                .next()
                .filter(|_| l.contains("packets transmitted"))
        })
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no hping3 statistics in its output:\n{hping}"));
    assert!(
        daemon.is_running(),
        "the daemon died during the flood; log:\n{}",
        daemon.log()
    );
    thread::sleep(Duration::from_millis(500));

    // Exact accounting once the flood has stopped: nothing expired yet (SYN timeouts are
    // minutes), nothing flushed, so every entry is a creation not undone.
    let s = our_stats(&daemon);
    let (entries, capacity) = (stat(&s, "entries"), stat(&s, "capacity"));
    let (new, early, killed) = (stat(&s, "new"), stat(&s, "early_drop"), stat(&s, "killed"));
    eprintln!(
        "flood: hping3 sent {sent} SYNs in {flood_secs:.1} s; ct stats after: {s:?}; `fastpath ct stats` during the flood took {:?}",
        stats_latencies
    );
    assert_eq!(capacity, FLOOD_CAPACITY, "{s:?}");
    assert!(
        new > 4 * FLOOD_CAPACITY && early > 0,
        "the flood must overfill the table many times (new {new}, early_drop {early}); {s:?}\n{hping}"
    );
    assert_eq!(
        entries, capacity,
        "a flood of new connections leaves the table exactly full; {s:?}"
    );
    assert_eq!(
        new - early - killed,
        entries,
        "occupancy must equal created − early-dropped − killed exactly; {s:?}"
    );
    for (took, _) in &stats_latencies {
        assert!(
            *took < Duration::from_secs(3),
            "`fastpath ct stats` took {took:?} during the flood: {stats_latencies:?}"
        );
    }

    // Every established connection kept its entry, assured, and every byte of its echo.
    for row in &established {
        let now = our_get(&daemon, &row.flow())
            .unwrap_or_else(|| panic!("{} lost its entry in the flood; {s:?}", row.flow()));
        assert!(
            now.state == "ESTABLISHED" && now.assured && now.packets() > row.packets(),
            "{}: expected still ESTABLISHED, assured and moving; before {row:?}, now {now:?}",
            row.flow()
        );
    }
    for (k, (talker, out)) in talkers.iter_mut().enumerate() {
        let status = talker
            .wait_exit(Duration::from_secs(30))
            .unwrap_or_else(|| panic!("talker {k} did not finish; {}", talker.log()));
        let got = fs::read_to_string(&*out).unwrap_or_default();
        assert!(
            status.success() && got == expected(k),
            "talker {k}: {status}, echoed {} of {} bytes; its log: {}",
            got.len(),
            expected(k).len(),
            talker.log()
        );
    }
    let reasons = host_run(&[
        bin().as_os_str(),
        "stats".as_ref(),
        "--pin-dir".as_ref(),
        daemon.pin_dir().as_os_str(),
    ])
    .unwrap_or_else(|e| panic!("fastpath stats: {e}"));
    eprintln!("fastpath stats after the flood:\n{reasons}");
    assert!(
        daemon.stop().success(),
        "the daemon must stop cleanly after the flood; log:\n{}",
        daemon.log()
    );
}

/// Sends `count` bare ACKs (no connection) from the client to `target:port` with hping3 and
/// returns how many replies came back (the backend answers a stray ACK with a RST).
fn stray_acks(client: &Netns, target: IpAddr, port: u16, count: u32) -> u64 {
    let (count_s, port_s, target_s) = (count.to_string(), port.to_string(), target.to_string());
    let out = client
        .exec(&[
            "hping3", "-A", "-p", &port_s, "-c", &count_s, "-i", "u100000", &target_s,
        ])
        .unwrap_or_else(|e| panic!("hping3: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    text.lines()
        .find(|l| l.contains("packets received"))
        .and_then(|l| l.split(", ").nth(1))
        .and_then(|s| s.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no hping3 statistics in its output:\n{text}"))
}

/// (5) The stateful firewall with real traffic, next to the same topology without it: curl
/// works either way; ACKs that belong to no connection reach the backend (which answers with
/// RSTs) only without the firewall, and are dropped with `fw_no_connection` with it; the ICMP
/// port unreachable answering a UDP datagram passes the firewall as related, so the client
/// sees "Connection refused" at once.
#[test]
fn stateful_firewall_drops_strays_and_passes_related_errors() {
    prepare_test(&["curl", "nginx", "hping3", "socat"]);
    let dir = TempDir::new("ct-firewall").expect("temp dir");
    let lb = test_lb_topology(1);
    let server = lb
        .backend(0)
        .http_server(80)
        .unwrap_or_else(|e| panic!("starting nginx: {e}"));
    fs::write(server.root().join("index.html"), PAGE).expect("writing the page");
    let backend: IpAddr = LbTopology::backend_v4(0).into();
    let url = format!("http://{backend}:80/index.html");
    const ACKS: u32 = 5;

    for firewall in [false, true] {
        let role = if firewall { "ct-fw-on" } else { "ct-fw-off" };
        let mut config = lb.fp_config(&unique_pin_dir(role));
        if firewall {
            config = config.stateful_firewall();
        }
        let mut daemon = Daemon::start(bin(), lb.fp(), &config);
        curl(
            lb.client(),
            &url,
            &dir.join(format!("{role}.html")),
            PAGE,
            false,
        );
        let replies = stray_acks(lb.client(), backend, 80, ACKS);
        let refused = lb
            .client()
            .exec(&[
                "sh",
                "-c",
                &format!("echo x | socat -t 2 - UDP4:{backend}:9999"),
            ])
            .unwrap_or_else(|e| panic!("socat: {e}"));
        let refused_text = String::from_utf8_lossy(&refused.stderr).to_string();
        let stats = fastpath::datapath::pinned_stats(daemon.pin_dir())
            .unwrap_or_else(|e| panic!("reading stats: {e}"));
        let ct = our_stats(&daemon);
        let fw_drops = stats.packets_for_reason(fastpath_common::reason::FW_NO_CONNECTION);
        eprintln!(
            "firewall {firewall}: {replies} of {ACKS} stray ACKs answered; fw_no_connection {fw_drops}; related {}; socat: {}",
            stat(&ct, "related"),
            refused_text.trim()
        );
        assert!(
            refused_text.contains("Connection refused"),
            "firewall {firewall}: the port unreachable must reach the client; socat said {refused_text:?}"
        );
        assert!(stat(&ct, "related") >= 1, "firewall {firewall}: {ct:?}");
        if firewall {
            assert_eq!(
                (replies, fw_drops),
                (0, u64::from(ACKS)),
                "with the firewall, every stray ACK is dropped at fp with fw_no_connection"
            );
        } else {
            assert_eq!(
                (replies, fw_drops),
                (u64::from(ACKS), 0),
                "without the firewall, the stray ACKs reach the backend, which answers each with a RST"
            );
        }
        assert!(daemon.stop().success(), "{}", daemon.log());
    }
}
