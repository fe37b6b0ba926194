//! End to end: every command of the `fastpath` CLI, a client of the daemon's management API
//! (gRPC on a Unix socket), against a daemon running in the `fp` node of [`lb_topology`] with
//! three real nginx backends, each effect checked with real traffic: curl from the client
//! namespace through the VIP (or the port forward), the backend that answered told by its
//! page (`backend N`).
//!
//! Covered: `info`, `interface`, `config check`, `service add|list|show|del`,
//! `backend drain|del|add`, `nat add|list|del`, `ct list|get|stats|watch|flush`,
//! `stats [--watch]`, `health [--watch]`, `apply -f [--dry-run] [--expected-generation]`, and
//! the exit codes 2 (usage), 3 (cannot connect) and 4 (refused), each error saying what to do.
//!
//! Root only (never skipped: without root it fails). Debian packages: iproute2, nginx-light,
//! curl, ethtool.

use std::{
    ffi::OsString,
    fs,
    path::Path,
    process::{Command, Output},
    thread,
    time::{Duration, Instant},
};

use fastpath::testkit::netns::{
    Daemon, HttpServer, LbTopology, Spawned, TempDir, prepare_test, test_lb_topology,
    unique_pin_dir,
};
use serde_json::Value;

use crate::bin;

const BACKENDS: usize = 3;
/// Added through `service add` (not in the config file).
const VIP_A: &str = "10.200.0.100";
const VIP6: &str = "fd00:200::100";
/// In the config file, with a TCP health check.
const VIP_H: &str = "10.200.0.101";
/// Created by `apply`.
const VIP_C: &str = "10.200.0.102";
/// The port forward's port on fp's client-facing address.
const FWD_PORT: u16 = 8080;
/// Size of the padding of the slowly downloaded page.
const BIG: usize = 600_000;

/// The service with a health check the daemon starts with: every backend, port 80.
fn health_service() -> String {
    let mut s = format!(
        "[[service]]\nvip = \"{VIP_H}\"\nport = 80\n[service.health_check]\nkind = \"tcp\"\ninterval_ms = 100\ntimeout_ms = 100\nrise = 2\nfall = 2\n"
    );
    for i in 0..BACKENDS {
        s += &format!(
            "[[service.backend]]\naddress = \"{}\"\nport = 80\n",
            LbTopology::backend_v4(i)
        );
    }
    s
}

fn b4(i: usize) -> String {
    format!("{}:80", LbTopology::backend_v4(i))
}

fn b6(i: usize) -> String {
    format!("[{}]:80", LbTopology::backend_v6(i))
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `fastpath --socket S ARGS -o json`, which must succeed: its parsed output.
fn json(daemon: &Daemon, args: &[&str]) -> Value {
    let mut a = args.to_vec();
    a.extend(["-o", "json"]);
    let out = daemon.cli_ok(&a);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("fastpath {args:?} -o json: {e}\n{out}"))
}

/// The desired state's generation (`info -o json`).
fn generation(daemon: &Daemon) -> u64 {
    json(daemon, &["info"])["generation"]
        .as_u64()
        .expect("info: generation")
}

/// Runs a change (with `-o json`), which must succeed and move the generation on by one;
/// returns its JSON report.
fn change(daemon: &Daemon, generation_now: &mut u64, args: &[&str]) -> Value {
    let r = json(daemon, args);
    let g = generation(daemon);
    assert_eq!(
        r["generation"].as_u64(),
        Some(g),
        "fastpath {args:?}: its report and `info` disagree on the generation: {r}"
    );
    assert_eq!(
        g,
        *generation_now + 1,
        "fastpath {args:?} must move the generation from {generation_now} to {}: {r}",
        *generation_now + 1
    );
    *generation_now = g;
    r
}

/// Runs a command expected to fail with `code`; returns its stderr, after checking it is an
/// `error: ...` line.
fn fails(out: Output, code: i32, what: &str) -> String {
    let err = text(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(code),
        "{what}: want exit {code}; stdout {:?}, stderr {err:?}",
        text(&out.stdout)
    );
    assert!(
        err.starts_with("error: "),
        "{what}: stderr should be an error line: {err:?}"
    );
    eprintln!("{what}: exit {code}: {}", err.trim());
    err
}

/// What one request got: (the backend whose page answered, the client's source port), or the
/// line curl wrote for it.
type Fetched = Result<(usize, u16), String>;

/// GETs `url` `n` times from the client, one curl process, each request over a new
/// connection (`Connection: close`: nginx closes first, so the client keeps no TIME_WAIT).
fn fetch(lb: &LbTopology, dir: &TempDir, url: &str, n: usize) -> Vec<Fetched> {
    let mut cfg = String::new();
    for i in 0..n {
        if i > 0 {
            cfg += "next\n";
        }
        cfg += &format!(
            "url = \"{url}\"\ngloboff\nfail\nmax-time = 5\nconnect-timeout = 2\nheader = \"Connection: close\"\nwrite-out = \" %{{local_port}} %{{http_code}} %{{num_connects}}\\n\"\n"
        );
    }
    let path = dir.join("fetch.curlrc");
    fs::write(&path, cfg).expect("writing the curl config");
    let out = lb
        .client()
        .exec_timeout(
            &["curl", "-q", "-sS", "-K", path.to_str().expect("utf-8")],
            Duration::from_secs(60),
        )
        .unwrap_or_else(|e| panic!("curl: {e}"));
    if !out.stderr.is_empty() {
        eprintln!("curl {url} stderr: {}", text(&out.stderr));
    }
    let got: Vec<Fetched> = text(&out.stdout)
        .lines()
        .map(
            |line| match line.split_whitespace().collect::<Vec<_>>()[..] {
                ["backend", b, port, "200", "1"] => b
                    .parse()
                    .ok()
                    .zip(port.parse().ok())
                    .ok_or_else(|| line.to_owned()),
                _ => Err(line.to_owned()),
            },
        )
        .collect();
    assert_eq!(
        got.len(),
        n,
        "curl {url}: {n} requests, {} lines out: {}\n{}",
        got.len(),
        text(&out.stdout),
        text(&out.stderr)
    );
    got
}

/// [`fetch`] where every request must succeed: connections per backend, and the source ports.
fn fetch_ok(
    lb: &LbTopology,
    dir: &TempDir,
    daemon: &Daemon,
    url: &str,
    n: usize,
) -> ([usize; BACKENDS], Vec<u16>) {
    let got = fetch(lb, dir, url, n);
    let failed: Vec<&String> = got.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(
        failed.is_empty(),
        "curl {url}: {} of {n} requests failed, e.g. {:?}\nstats:\n{}\ndaemon log:\n{}",
        failed.len(),
        &failed[..failed.len().min(3)],
        text(&daemon.cli(&["stats"]).stdout),
        daemon.log()
    );
    let mut per = [0; BACKENDS];
    let mut ports = Vec::new();
    for (b, p) in got.into_iter().flatten() {
        per[b] += 1;
        ports.push(p);
    }
    eprintln!("curl {url} x{n}: connections per backend {per:?}");
    (per, ports)
}

/// [`fetch`] where no request may get an answer.
fn fetch_fails(lb: &LbTopology, dir: &TempDir, url: &str, n: usize) {
    let got = fetch(lb, dir, url, n);
    let answered: Vec<_> = got.iter().filter_map(|r| r.as_ref().ok()).collect();
    assert!(
        answered.is_empty(),
        "curl {url}: nothing should answer, but backends did: {answered:?}"
    );
}

fn url4(vip: &str) -> String {
    format!("http://{vip}/")
}

/// The rows of `service list -o json` for `vip` port 80.
fn listed<'a>(list: &'a Value, vip: &str) -> Option<&'a Value> {
    list.as_array()
        .expect("service list: an array")
        .iter()
        .find(|s| s["vip"] == vip && s["port"] == 80)
}

/// The `address:port` of every backend of a `service show -o json` (or list row).
fn backend_addrs(svc: &Value) -> Vec<String> {
    svc["backends"]
        .as_array()
        .expect("backends")
        .iter()
        .map(|b| {
            let a = b["address"].as_str().expect("address");
            if a.contains(':') {
                format!("[{a}]:{}", b["port"])
            } else {
                format!("{a}:{}", b["port"])
            }
        })
        .collect()
}

/// Connections in `ct list -o json` from the client.
fn client_connections(daemon: &Daemon) -> Vec<Value> {
    let client = LbTopology::client_v4().to_string();
    json(daemon, &["ct", "list"])
        .as_array()
        .expect("ct list: an array")
        .iter()
        .filter(|c| c["original"]["src"] == client.as_str())
        .cloned()
        .collect()
}

/// A CLI client left running (`ct watch`, `stats --watch`, `health --watch`) in fp.
fn spawn_cli(lb: &LbTopology, daemon: &Daemon, args: &[&str]) -> Spawned {
    let mut a: Vec<OsString> = vec![bin().into(), "--socket".into(), daemon.socket().into()];
    a.extend(args.iter().map(OsString::from));
    lb.fp().spawn(&a).expect("spawning the CLI")
}

/// Waits until `pred` holds for `p`'s output, up to `timeout`; panics with the output if not.
fn wait_output(p: &Spawned, timeout: Duration, what: &str, pred: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + timeout;
    loop {
        let log = p.log();
        if pred(&log) {
            return log;
        }
        assert!(
            Instant::now() < deadline,
            "`{}`: {what} not seen within {timeout:?}; its output:\n{log}",
            p.command()
        );
        thread::sleep(Duration::from_millis(50));
    }
}

/// Sum of the packets of the `stats -o json` rows with `reason`.
fn packets(stats: &Value, reason: &str) -> u64 {
    stats
        .as_array()
        .expect("stats: an array")
        .iter()
        .filter(|r| r["reason"] == reason)
        .map(|r| r["packets"].as_u64().expect("packets"))
        .sum()
}

/// A download of the big page (`big`, `backend N\n` then padding) at 200 kB/s: a connection
/// that lasts about 3 s.
struct SlowDownload {
    curl: Spawned,
    out: std::path::PathBuf,
}

impl SlowDownload {
    fn start(lb: &LbTopology, dir: &TempDir, n: usize) -> SlowDownload {
        let out = dir.join(format!("slow-{n}"));
        let curl = lb
            .client()
            .spawn(&[
                "curl",
                "-q",
                "-sS",
                "--fail",
                "--max-time",
                "30",
                "--limit-rate",
                "200k",
                "-o",
                out.to_str().expect("utf-8"),
                &format!("http://{VIP_A}/big"),
            ])
            .expect("slow download");
        SlowDownload { curl, out }
    }

    /// The backend it is downloading from, once the first line is in.
    fn backend(&self) -> usize {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let body = fs::read(&self.out).unwrap_or_default();
            if let Some(line) = body.split(|&c| c == b'\n').next()
                && body.contains(&b'\n')
            {
                let line = text(line);
                return line
                    .strip_prefix("backend ")
                    .and_then(|n| n.parse().ok())
                    .unwrap_or_else(|| panic!("unexpected first line {line:?}"));
            }
            assert!(
                Instant::now() < deadline,
                "the slow download got no first line in 5 s; curl: {}",
                self.curl.log()
            );
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for it to end: whether it got the whole page.
    fn finish(mut self) -> (bool, usize) {
        let status = self.curl.wait_exit(Duration::from_secs(30));
        let len = fs::read(&self.out).map(|b| b.len()).unwrap_or(0);
        let whole = status.is_some_and(|s| s.success()) && len == "backend 0\n".len() + BIG;
        if !whole {
            eprintln!(
                "slow download: {status:?}, {len} bytes; {}",
                self.curl.log()
            );
        }
        (whole, len)
    }
}

#[test]
fn every_cli_command_changes_real_traffic() {
    let started = Instant::now();
    prepare_test(&["curl", "nginx", "ethtool"]);
    let dir = TempDir::new("api-cli").expect("temp dir");
    let lb = test_lb_topology(BACKENDS);
    lb.checksum_offloads_off()
        .unwrap_or_else(|e| panic!("turning checksum offloads off: {e}"));
    let mut servers: Vec<HttpServer> = (0..BACKENDS)
        .map(|i| {
            let s = lb
                .backend(i)
                .http_server(80)
                .unwrap_or_else(|e| panic!("starting nginx: {e}"));
            fs::write(s.root().join("index.html"), format!("backend {i}")).expect("page");
            let mut big = format!("backend {i}\n").into_bytes();
            big.resize(big.len() + BIG, b'x');
            fs::write(s.root().join("big"), big).expect("big page");
            s
        })
        .collect();
    let pin_dir = unique_pin_dir("api-cli");
    let config = lb.fp_config(&pin_dir).services(&health_service());
    let daemon = Daemon::start(bin(), lb.fp(), &config);

    // info: the daemon's own view.
    let info = json(&daemon, &["info"]);
    assert_eq!(info["pid"].as_u64(), daemon.pid().map(u64::from), "{info}");
    assert_eq!(info["services"], 1, "{info}");
    assert_eq!(info["interfaces"], 1 + BACKENDS as u64, "{info}");
    let mut g = generation(&daemon);
    eprintln!("info: {info}");

    // interface: every fp interface with its hooks.
    let ifaces = json(&daemon, &["interface"]);
    let names: Vec<&str> = ifaces
        .as_array()
        .expect("interface: an array")
        .iter()
        .map(|i| i["name"].as_str().expect("name"))
        .collect();
    assert_eq!(names, lb.fp_interfaces(), "{ifaces}");
    for i in ifaces.as_array().unwrap() {
        let hooks: Vec<&str> = i["hooks"]
            .as_array()
            .expect("hooks")
            .iter()
            .map(|h| h.as_str().unwrap())
            .collect();
        assert!(
            i["ifindex"].as_u64().unwrap_or(0) > 0
                && hooks.len() == 3
                && ["xdp(", "tc_ingress(", "tc_egress("]
                    .iter()
                    .all(|h| hooks.iter().any(|x| x.starts_with(h))),
            "interface {}: expected XDP and both TC hooks: {i}",
            i["name"]
        );
    }

    // config check: the daemon's file is good (its interfaces exist in fp); a bad one is a
    // usage error naming the problem.
    let fp_ns = lb.fp().name().to_owned();
    let cfg_path = daemon.config_path().to_str().expect("utf-8").to_owned();
    let ok = daemon.cli_ok(&["--netns", &fp_ns, "config", "check", &cfg_path]);
    assert!(ok.contains(": ok ("), "{ok}");
    let bad_path = dir.join("bad.toml");
    fs::write(
        &bad_path,
        config.to_toml().replace(
            "port = 80\n[service.health_check]",
            "port = 99999\n[service.health_check]",
        ),
    )
    .expect("bad config");
    let err = fails(
        daemon.cli(&[
            "--netns",
            &fp_ns,
            "config",
            "check",
            bad_path.to_str().unwrap(),
        ]),
        2,
        "config check of a bad file",
    );
    assert!(err.contains("invalid config"), "{err}");

    // Exit codes: usage error, cannot connect, refused.
    let err = fails(
        daemon.cli(&["service", "add", "not-an-address", "-b", &b4(0)]),
        2,
        "service add not-an-address",
    );
    assert!(err.contains("e.g. 10.0.0.10:80"), "{err}");
    let mut cmd = Command::new(bin());
    cmd.args(["--socket", "/nonexistent/fastpath.sock", "info"]);
    let err = fails(
        cmd.output().expect("running fastpath"),
        3,
        "info --socket /nonexistent",
    );
    assert!(
        err.contains("/nonexistent/fastpath.sock") && err.contains("--socket"),
        "{err}"
    );
    // A usage error is a usage error even with no daemon to reach: it is found first.
    for args in [
        &["nat", "add", "bogus", "x"][..],
        &["stats", "--watch", "0.01"],
        &["backend", "add", "bogus", "10.0.0.1:80"],
        &["service", "show", "10.0.0.1"],
    ] {
        let mut cmd = Command::new(bin());
        cmd.args(["--socket", "/nonexistent/fastpath.sock"])
            .args(args);
        let err = fails(
            cmd.output().expect("running fastpath"),
            2,
            &format!("{args:?} without a daemon"),
        );
        assert!(err.contains("e.g.") || err.contains("give"), "{err}");
    }
    let info_table = daemon.cli_ok(&["info"]);
    assert!(
        info_table.contains(&format!("generation    {g}")),
        "{info_table}"
    );
    let if_table = daemon.cli_ok(&["interface"]);
    assert!(
        lb.fp_interfaces()
            .iter()
            .all(|i| if_table.contains(i.as_str()))
            && if_table.contains("xdp("),
        "{if_table}"
    );
    assert_eq!(generation(&daemon), g, "failed commands change nothing");

    // service add: a VIP not in the config file gets traffic to its two backends.
    fetch_fails(&lb, &dir, &url4(VIP_A), 1);
    let dry = json(
        &daemon,
        &[
            "service",
            "add",
            &format!("{VIP_A}:80"),
            "-b",
            &b4(0),
            "--dry-run",
        ],
    );
    assert!(
        dry["dry_run"] == true && dry["created"] == serde_json::json!([format!("{VIP_A}:80/tcp")]),
        "{dry}"
    );
    assert_eq!(generation(&daemon), g, "a dry run changes nothing");
    fetch_fails(&lb, &dir, &url4(VIP_A), 1);
    let stats0 = json(&daemon, &["stats"]);
    let r = change(
        &daemon,
        &mut g,
        &[
            "service",
            "add",
            &format!("{VIP_A}:80"),
            "-b",
            &b4(0),
            "-b",
            &b4(1),
        ],
    );
    assert_eq!(
        r["created"],
        serde_json::json!([format!("{VIP_A}:80/tcp")]),
        "{r}"
    );
    const N: usize = 30;
    let (per, ports) = fetch_ok(&lb, &dir, &daemon, &url4(VIP_A), N);
    assert!(per[0] > 0 && per[1] > 0 && per[2] == 0, "{per:?}");
    let stats1 = json(&daemon, &["stats"]);
    let (to0, to1) = (
        packets(&stats0, "lb_to_backend"),
        packets(&stats1, "lb_to_backend"),
    );
    let (from0, from1) = (
        packets(&stats0, "lb_from_backend"),
        packets(&stats1, "lb_from_backend"),
    );
    assert!(
        to1 >= to0 + 3 * N as u64 && from1 >= from0 + 3 * N as u64,
        "stats: lb_to_backend {to0} -> {to1}, lb_from_backend {from0} -> {from1} after {N} connections"
    );
    let list = json(&daemon, &["service", "list"]);
    let row = listed(&list, VIP_A).unwrap_or_else(|| panic!("{VIP_A} not listed: {list}"));
    assert_eq!(backend_addrs(row), [b4(0), b4(1)], "{row}");
    assert!(row["connections"].as_u64().unwrap() >= N as u64, "{row}");
    assert!(listed(&list, VIP_H).is_some(), "{list}");
    let show = json(&daemon, &["service", "show", &format!("{VIP_A}:80")]);
    assert_eq!(show["service"], format!("{VIP_A}:80/tcp"), "{show}");
    assert_eq!(backend_addrs(&show), [b4(0), b4(1)], "{show}");
    for (i, b) in show["backends"].as_array().unwrap().iter().enumerate() {
        assert_eq!(
            b["connections"].as_u64(),
            Some(per[i] as u64),
            "backend {i}: {show}"
        );
    }
    let table = daemon.cli_ok(&["service", "show", &format!("{VIP_A}:80")]);
    assert!(
        table.contains("maglev") && table.contains(&b4(1)),
        "{table}"
    );
    let table = daemon.cli_ok(&["service", "list"]);
    assert!(
        table.contains(&format!("{VIP_A}:80 tcp")) && table.contains(&format!("  {}", b4(0))),
        "{table}"
    );
    let table = daemon.cli_ok(&["ct", "list"]);
    assert!(
        table
            .lines()
            .filter(|l| l.contains(&format!("dst={VIP_A} ")))
            .count()
            >= N,
        "{table}"
    );

    // Refused: the service exists already; nothing changes.
    let err = fails(
        daemon.cli(&["service", "add", &format!("{VIP_A}:80"), "-b", &b4(2)]),
        4,
        "service add of an existing service",
    );
    assert!(
        err.contains("already exists") && err.contains("nothing was changed"),
        "{err}"
    );
    assert_eq!(generation(&daemon), g, "a refused change changes nothing");

    // ct list / get / stats: the connections just made.
    let conns = client_connections(&daemon);
    let to_vip: Vec<&Value> = conns
        .iter()
        .filter(|c| {
            c["original"]["dst"] == VIP_A
                && c["original"]["sport"]
                    .as_u64()
                    .is_some_and(|p| ports.iter().any(|&q| u64::from(q) == p))
        })
        .collect();
    assert!(
        to_vip.len() == N
            && to_vip.iter().all(|c| {
                [LbTopology::backend_v4(0), LbTopology::backend_v4(1)]
                    .iter()
                    .any(|b| c["reply"]["src"] == b.to_string().as_str())
            }),
        "ct list: expected {N} connections to {VIP_A}, replies from backend 0 or 1: {conns:#?}"
    );
    let port = ports[N - 1].to_string();
    let client = LbTopology::client_v4().to_string();
    let got = json(
        &daemon,
        &[
            "ct", "get", "-p", "tcp", "-s", &client, "-d", VIP_A, "--sport", &port, "--dport", "80",
        ],
    );
    assert_eq!(
        got["original"]["sport"].as_u64(),
        Some(u64::from(ports[N - 1])),
        "{got}"
    );
    assert_eq!(got["original"]["dst"], VIP_A, "{got}");
    assert!(got["original"]["packets"].as_u64().unwrap() >= 4, "{got}");
    let err = fails(
        daemon.cli(&[
            "ct", "get", "-p", "tcp", "-s", &client, "-d", VIP_A, "--sport", "1", "--dport", "80",
        ]),
        1,
        "ct get of an untracked connection",
    );
    assert!(err.contains("ct list"), "{err}");
    let ct_stats = daemon.cli_ok(&["ct", "stats"]);
    let entries: u64 = ct_stats
        .lines()
        .find_map(|l| l.strip_prefix("entries"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("ct stats: no entries line:\n{ct_stats}"));
    assert!(
        entries >= N as u64,
        "ct stats: {entries} entries:\n{ct_stats}"
    );

    // ct watch: a NEW event for a new connection.
    let watch = spawn_cli(&lb, &daemon, &["ct", "watch"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, ports) = fetch_ok(&lb, &dir, &daemon, &url4(VIP_A), 1);
        let want = format!("src={client} dst={VIP_A} sport={} dport=80", ports[0]);
        thread::sleep(Duration::from_millis(300));
        let log = watch.log();
        if log
            .lines()
            .any(|l| l.contains("[NEW]") && l.contains(&want))
        {
            eprintln!(
                "ct watch saw: {}",
                log.lines().find(|l| l.contains(&want)).unwrap()
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "ct watch printed no NEW line with {want:?}:\n{log}"
        );
    }
    drop(watch);

    // ct flush: reports how many it deleted; the client's connections are gone.
    let before = client_connections(&daemon).len();
    let out = daemon.cli_ok(&["ct", "flush"]);
    let deleted: usize = out
        .strip_prefix("fastpath conntrack: ")
        .and_then(|s| s.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("ct flush: {out:?}"));
    assert!(
        deleted >= before,
        "ct flush deleted {deleted}, the client had {before}: {out}"
    );
    let after = client_connections(&daemon);
    assert!(after.is_empty(), "after ct flush: {after:#?}");

    // IPv6: service add and curl through the VIP.
    let r = change(
        &daemon,
        &mut g,
        &[
            "service",
            "add",
            &format!("[{VIP6}]:80"),
            "-b",
            &b6(0),
            "-b",
            &b6(1),
        ],
    );
    assert_eq!(
        r["created"],
        serde_json::json!([format!("[{VIP6}]:80/tcp")]),
        "{r}"
    );
    let (per, _) = fetch_ok(&lb, &dir, &daemon, &format!("http://[{VIP6}]/"), 12);
    assert!(per[0] + per[1] == 12 && per[0] > 0 && per[1] > 0, "{per:?}");

    // backend drain: an established connection on the drained backend goes on to its end;
    // new ones never reach it.
    let slow = SlowDownload::start(&lb, &dir, 0);
    let drained = slow.backend();
    let kept = 1 - drained;
    eprintln!("slow download on backend {drained}: draining it");
    change(
        &daemon,
        &mut g,
        &["backend", "drain", &format!("{VIP_A}:80"), &b4(drained)],
    );
    let (per, _) = fetch_ok(&lb, &dir, &daemon, &url4(VIP_A), N);
    assert_eq!(
        per[kept], N,
        "drained backend {drained} got new connections: {per:?}"
    );
    let show = json(&daemon, &["service", "show", &format!("{VIP_A}:80")]);
    let d = &show["backends"][drained];
    assert!(
        d["weight"] == 0 && d["share_pct"].as_f64() == Some(0.0),
        "the drained backend stays listed with weight 0: {show}"
    );
    let (whole, len) = slow.finish();
    assert!(
        whole,
        "the connection established on backend {drained} before the drain broke after {len} bytes"
    );

    // backend del: none reach it; it is no longer listed.
    change(
        &daemon,
        &mut g,
        &["backend", "del", &format!("{VIP_A}:80"), &b4(drained)],
    );
    let (per, _) = fetch_ok(&lb, &dir, &daemon, &url4(VIP_A), N);
    assert_eq!(per[kept], N, "{per:?}");
    let show = json(&daemon, &["service", "show", &format!("{VIP_A}:80")]);
    assert_eq!(backend_addrs(&show), [b4(kept)], "{show}");
    // Refused: deleting it again.
    let err = fails(
        daemon.cli(&["backend", "del", &format!("{VIP_A}:80"), &b4(drained)]),
        4,
        "backend del of a backend no longer there",
    );
    assert!(err.contains("nothing was changed"), "{err}");

    // backend add: a third backend starts getting connections (not with a stale
    // generation).
    let stale = (g - 1).to_string();
    let err = fails(
        daemon.cli(&[
            "backend",
            "add",
            &format!("{VIP_A}:80"),
            &b4(2),
            "--expected-generation",
            &stale,
        ]),
        4,
        "backend add with a stale generation",
    );
    assert!(err.contains("retry"), "{err}");
    change(
        &daemon,
        &mut g,
        &["backend", "add", &format!("{VIP_A}:80"), &b4(2)],
    );
    let (per, _) = fetch_ok(&lb, &dir, &daemon, &url4(VIP_A), N);
    assert!(
        per[2] > 0 && per[kept] > 0 && per[kept] + per[2] == N,
        "after backend add: {per:?}"
    );

    // nat: a port forward on fp's client-facing address reaches backend 2, then stops.
    let fwd = format!("{}:{FWD_PORT}", LbTopology::fp_client_v4());
    let fwd_url = format!("http://{fwd}/");
    fetch_fails(&lb, &dir, &fwd_url, 1);
    change(&daemon, &mut g, &["nat", "add", &fwd, &b4(2)]);
    let (per, _) = fetch_ok(&lb, &dir, &daemon, &fwd_url, 5);
    assert_eq!(per, [0, 0, 5], "the port forward goes to backend 2");
    let nat = json(&daemon, &["nat", "list"]);
    assert_eq!(
        nat["port_forwards"],
        serde_json::json!([{"from": format!("{fwd}/tcp"), "to": b4(2)}]),
        "{nat}"
    );
    let table = daemon.cli_ok(&["nat", "list"]);
    assert!(
        table
            .lines()
            .any(|l| l.starts_with(&format!("{fwd}/tcp")) && l.ends_with(&b4(2))),
        "{table}"
    );
    change(&daemon, &mut g, &["nat", "del", &fwd]);
    fetch_fails(&lb, &dir, &fwd_url, 2);
    let nat = json(&daemon, &["nat", "list"]);
    assert_eq!(nat["port_forwards"], serde_json::json!([]), "{nat}");
    let err = fails(
        daemon.cli(&["nat", "del", &fwd]),
        4,
        "nat del of a forward not there",
    );
    assert!(err.contains("nothing was changed"), "{err}");

    // service del: the VIP no longer answers through the LB.
    let r = change(&daemon, &mut g, &["service", "del", &format!("{VIP_A}:80")]);
    assert_eq!(
        r["deleted"],
        serde_json::json!([format!("{VIP_A}:80/tcp")]),
        "{r}"
    );
    fetch_fails(&lb, &dir, &url4(VIP_A), 3);
    let list = json(&daemon, &["service", "list"]);
    assert!(listed(&list, VIP_A).is_none(), "{list}");

    // apply: the file's services become the desired state (VIP_H kept, VIP_C created, the
    // IPv6 service deleted). A dry run changes nothing; a stale generation is refused.
    let apply_path = dir.join("apply.toml");
    let svc_c = format!(
        "[[service]]\nvip = \"{VIP_C}\"\nport = 80\n[[service.backend]]\naddress = \"{}\"\nport = 80\n",
        LbTopology::backend_v4(0)
    );
    fs::write(&apply_path, config.clone().services(&svc_c).to_toml()).expect("apply file");
    let apply_file = apply_path.to_str().expect("utf-8");
    let dry = json(&daemon, &["apply", "-f", apply_file, "--dry-run"]);
    assert_eq!(dry["dry_run"], true, "{dry}");
    assert_eq!(
        dry["created"],
        serde_json::json!([format!("{VIP_C}:80/tcp")]),
        "{dry}"
    );
    assert_eq!(
        dry["deleted"],
        serde_json::json!([format!("[{VIP6}]:80/tcp")]),
        "{dry}"
    );
    assert_eq!(generation(&daemon), g, "a dry run changes nothing");
    let list = json(&daemon, &["service", "list"]);
    assert!(
        listed(&list, VIP_C).is_none() && listed(&list, VIP6).is_some(),
        "{list}"
    );
    fetch_fails(&lb, &dir, &url4(VIP_C), 1);
    let stale = (g - 1).to_string();
    let err = fails(
        daemon.cli(&["apply", "-f", apply_file, "--expected-generation", &stale]),
        4,
        "apply with a stale generation",
    );
    assert!(
        err.contains(&format!("generation {g}")) && err.contains("retry"),
        "{err}"
    );
    assert_eq!(generation(&daemon), g);
    let current = g.to_string();
    let r = change(
        &daemon,
        &mut g,
        &["apply", "-f", apply_file, "--expected-generation", &current],
    );
    assert_eq!(
        r["created"],
        serde_json::json!([format!("{VIP_C}:80/tcp")]),
        "{r}"
    );
    let (per, _) = fetch_ok(&lb, &dir, &daemon, &url4(VIP_C), 5);
    assert_eq!(per, [5, 0, 0], "{per:?}");
    fetch_fails(&lb, &dir, &format!("http://[{VIP6}]/"), 2);
    let info = json(&daemon, &["info"]);
    assert_eq!(info["services"], 2, "{info}");

    // health: every backend of VIP_H up; backend 2's nginx stops; it goes down within a
    // few seconds, `health --watch` prints it, and new connections avoid it.
    let health = json(&daemon, &["health"]);
    let states = |h: &Value| -> Vec<(String, bool)> {
        h.as_array()
            .expect("health: an array")
            .iter()
            .filter(|b| b["service"] == format!("{VIP_H}:80/tcp"))
            .map(|b| {
                (
                    format!("{}:{}", b["address"].as_str().unwrap(), b["port"]),
                    b["up"].as_bool().unwrap(),
                )
            })
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect()
    };
    assert_eq!(
        states(&health),
        (0..BACKENDS).map(|i| (b4(i), true)).collect::<Vec<_>>(),
        "{health}"
    );
    let (per, _) = fetch_ok(&lb, &dir, &daemon, &url4(VIP_H), N);
    assert!(per.iter().all(|&n| n > 0), "{per:?}");
    let health_watch = spawn_cli(&lb, &daemon, &["health", "--watch"]);
    thread::sleep(Duration::from_millis(300));
    servers[2].process().kill();
    let stopped = Instant::now();
    let deadline = stopped + Duration::from_secs(5);
    loop {
        let h = json(&daemon, &["health"]);
        if states(&h).contains(&(b4(2), false)) {
            eprintln!("health: backend 2 down after {:?}: {h}", stopped.elapsed());
            break;
        }
        assert!(
            Instant::now() < deadline,
            "backend 2 not down after 5 s: {h}"
        );
        thread::sleep(Duration::from_millis(100));
    }
    let (per, _) = fetch_ok(&lb, &dir, &daemon, &url4(VIP_H), N);
    assert!(per[2] == 0 && per[0] > 0 && per[1] > 0, "{per:?}");
    let want = b4(2);
    wait_output(
        &health_watch,
        Duration::from_secs(3),
        "backend 2 down",
        |log| log.lines().any(|l| l.contains(&want) && l.contains("down")),
    );
    drop(health_watch);
    let table = daemon.cli_ok(&["health"]);
    assert!(
        table
            .lines()
            .any(|l| l.contains(&b4(2)) && l.contains(" down ")),
        "{table}"
    );
    let show = json(&daemon, &["service", "show", &format!("{VIP_H}:80")]);
    assert_eq!(show["health_check"]["kind"], "tcp", "{show}");

    // stats --watch: a table every 0.2 s.
    let stats_watch = spawn_cli(&lb, &daemon, &["stats", "--watch", "0.2"]);
    let log = wait_output(&stats_watch, Duration::from_secs(5), "two tables", |log| {
        log.matches("HOOK").count() >= 2
    });
    assert!(log.contains("lb_to_backend"), "{log}");
    drop(stats_watch);
    let stats2 = json(&daemon, &["stats"]);
    assert!(packets(&stats2, "lb_to_backend") > to1, "{stats2}");

    eprintln!("generation now {g}; test took {:?}", started.elapsed());
    drop(servers);
}

/// A reader that goes away (`fastpath ct list | head`) ends the CLI as it ends any Unix tool:
/// killed by SIGPIPE, nothing on standard error — not a panic with a backtrace. The pipe's
/// reading end is closed before the command writes, so its first write meets EPIPE (every
/// command prints through the same writer).
#[test]
fn a_closed_pipe_ends_the_cli_quietly() {
    use std::os::{fd::FromRawFd as _, unix::process::ExitStatusExt as _};
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/appliance.toml");
    let mut fds = [0; 2];
    // SAFETY: pipe(2) fills the two descriptors, owned from here by the Files below.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0, "pipe(2)");
    // SAFETY: fresh descriptors from pipe(2), each owned once.
    let (read, write) = unsafe { (fs::File::from_raw_fd(fds[0]), fs::File::from_raw_fd(fds[1])) };
    drop(read);
    let out = Command::new(bin())
        .arg("config")
        .arg("check")
        .arg("--skip-interfaces")
        .arg(&config)
        .env("RUST_BACKTRACE", "1")
        .stdout(write)
        .output()
        .expect("running fastpath");
    assert_eq!(
        (out.status.signal(), text(&out.stderr).as_str()),
        (Some(libc::SIGPIPE), ""),
        "`fastpath config check` writing into a closed pipe: {}",
        out.status
    );
}
