//! Bad input to a running daemon, end to end in the `fp` node of the load-balancer topology:
//! every refused change says what is wrong and what to do, leaves the daemon running and the
//! pinned service maps exactly as they were.
//!
//! - config files through `fastpath apply -f` (exit 4, `FILE:LINE` and the key) and through
//!   SIGHUP (the log says the reload was refused): malformed TOML, unknown keys, bad
//!   addresses, ports and ranges, duplicate services, a backend of the other family;
//! - a 10,000-service file: `config check`, `apply -f` (timed), and back to the original;
//! - garbage gRPC bodies, a request above `MAX_MESSAGE_BYTES`, invalid field values through
//!   the generated client;
//! - concurrent conflicting changes: one `CreateServices` wins, the rest get ALREADY_EXISTS;
//!   two `Apply`s at the same `expected_generation`: one wins, the other FAILED_PRECONDITION;
//! - `/metrics`, parsed with a Prometheus text-format parser, counts the traffic sent and the
//!   API calls made.
//!
//! "Unchanged maps" is checked twice: `fastpath service list --pin-dir DIR -o json` and the raw
//! rows of `fastpath::datapath::pinned_services`, before and after.
//!
//! What the daemon answers that is not ideal, pinned here as it is: garbage that does not
//! decode as protobuf gets tonic's INTERNAL ("failed to decode Protobuf message: ..."), before
//! the daemon's handlers see it (so it is neither logged nor counted in the API metrics); a
//! request above the limit gets tonic's OUT_OF_RANGE; the library client refuses one itself
//! only with an HTTP/2 reset (INTERNAL, "h2 protocol error"), so `fastpath apply -f` checks
//! the size before sending.
//!
//! Root only (never skipped). Debian packages: iproute2, curl, nginx-light, ethtool.

use std::{
    collections::BTreeSet,
    fs,
    io::{Read as _, Write as _},
    path::{Path, PathBuf},
    process::Output,
    sync::Arc,
    time::{Duration, Instant},
};

use fastpath::{
    api::{
        MAX_MESSAGE_BYTES,
        client::{self, Client, Target},
        pb::{self, fastpath_client::FastpathClient},
    },
    testkit::netns::{
        Daemon, DaemonConfig, HttpServer, LbTopology, TempDir, prepare_test, service_list_json,
        test_lb_topology, unique_pin_dir,
    },
};
use prost::bytes::{Buf as _, BufMut as _};
use tonic::{
    Code, Status,
    codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder},
    transport::{Channel, Endpoint},
};

use crate::bin;

const BACKENDS: usize = 2;
const VIP4: &str = "10.200.0.100";
const VIP6: &str = "fd00:200::100";
/// Exit code of the CLI when the daemon refused the request.
const EXIT_REJECTED: i32 = 4;

/// The services every daemon here starts with: an IPv4 and an IPv6 VIP, port 80, each with
/// every backend of its family.
fn base_services() -> String {
    let mut s = format!("[[service]]\nvip = \"{VIP4}\"\nport = 80\n");
    for i in 0..BACKENDS {
        s += &format!(
            "[[service.backend]]\naddress = \"{}\"\nport = 80\n",
            LbTopology::backend_v4(i)
        );
    }
    s += &format!("[[service]]\nvip = \"{VIP6}\"\nport = 80\n");
    for i in 0..BACKENDS {
        s += &format!(
            "[[service.backend]]\naddress = \"{}\"\nport = 80\n",
            LbTopology::backend_v6(i)
        );
    }
    s
}

/// The daemon's config with `extra` services after the base ones and `raw` tables.
fn config_with(lb: &LbTopology, pin_dir: &Path, raw: &str, extra: &str) -> DaemonConfig {
    lb.fp_config(pin_dir)
        .raw(raw)
        .services(&(base_services() + extra))
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// What the pinned service maps hold, two ways: the CLI's JSON and the raw rows.
#[derive(Debug, PartialEq)]
struct Maps {
    json: serde_json::Value,
    raw: String,
}

fn maps(d: &Daemon) -> Maps {
    let (_, json) = service_list_json(bin(), d.pin_dir());
    let rows = fastpath::datapath::pinned_services(d.pin_dir())
        .unwrap_or_else(|e| panic!("reading the pinned services: {e}"));
    Maps {
        json,
        raw: format!("{rows:#?}"),
    }
}

/// `(vip, port, protocol, sorted backends)` of every service in the pinned maps: what a
/// config describes, without datapath ids and counters.
fn service_set(d: &Daemon) -> BTreeSet<String> {
    fastpath::datapath::pinned_services(d.pin_dir())
        .unwrap_or_else(|e| panic!("reading the pinned services: {e}"))
        .iter()
        .map(|r| {
            let mut b: Vec<String> = r
                .backends
                .iter()
                .map(|b| std::net::SocketAddr::new(b.address, b.port).to_string())
                .collect();
            b.sort();
            format!(
                "{}/{} -> {}",
                std::net::SocketAddr::new(r.vip, r.port),
                r.protocol,
                b.join(",")
            )
        })
        .collect()
}

fn assert_maps_unchanged(d: &mut Daemon, before: &Maps, what: &str) {
    assert!(
        d.is_running(),
        "{what}: the daemon exited; log:\n{}",
        d.log()
    );
    let after = maps(d);
    assert!(
        after == *before,
        "{what}: the pinned service maps changed\nbefore: {}\nafter: {}",
        before.raw,
        after.raw
    );
}

fn generation(d: &Daemon) -> u64 {
    let out = d.cli_ok(&["info", "-o", "json"]);
    let v: serde_json::Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("info JSON: {e}\n{out}"));
    v["generation"].as_u64().expect("generation")
}

fn lossy(out: &[u8]) -> String {
    String::from_utf8_lossy(out).into_owned()
}

/// 1-based number of the last line of `text` that is `marker` (trimmed).
fn line_of(text: &str, marker: &str) -> usize {
    text.lines()
        .enumerate()
        .filter(|(_, l)| l.trim() == marker)
        .map(|(i, _)| i + 1)
        .last()
        .unwrap_or_else(|| panic!("no line {marker:?} in\n{text}"))
}

/// SIGHUP to the daemon; waits for a log line after this point that contains `needle`, and
/// returns the log written since.
fn sighup_until(d: &Daemon, needle: &str) -> String {
    let start = d.log().len();
    let pid = d.pid().expect("daemon running") as libc::pid_t;
    // SAFETY: kill on our own live child.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGHUP) }, 0, "kill -HUP");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let log = d.log();
        let new = log.get(start..).unwrap_or("").to_owned();
        if new.contains(needle) {
            return new;
        }
        assert!(
            Instant::now() < deadline,
            "no {needle:?} in the daemon's log within 20 s of SIGHUP; log since:\n{new}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One bad config file: what it is, and what its error must say.
struct Bad {
    name: &'static str,
    /// Services appended after the base ones.
    services: &'static str,
    /// `key = value` lines for the client-facing interface's table.
    iface: Option<&'static str>,
    /// The line the error must point at (the last line equal to this).
    marker: &'static str,
    /// Must appear in the error (the key); `None` where a syntax error has no key.
    key: Option<&'static str>,
    /// Must appear in the error: what is wrong or what to do.
    says: &'static [&'static str],
}

fn bad_cases() -> Vec<Bad> {
    vec![
        Bad {
            name: "malformed TOML: a doubled '='",
            services: "[[service]]\nvip = \"10.200.0.101\"\nport = = 80\n",
            iface: None,
            marker: "port = = 80",
            key: Some("service[2].port"),
            says: &["config/README.md"],
        },
        Bad {
            name: "malformed TOML: an unclosed table header",
            services: "[[service]\nvip = \"10.200.0.101\"\nport = 80\n",
            iface: None,
            marker: "[[service]",
            key: None,
            says: &["config/README.md"],
        },
        Bad {
            name: "malformed TOML: an unterminated string",
            services: "[[service]]\nvip = \"10.200.0.101\nport = 80\n",
            iface: None,
            marker: "vip = \"10.200.0.101",
            key: Some("service[2].vip"),
            says: &["config/README.md"],
        },
        Bad {
            name: "unknown key in a service",
            services: "[[service]]\nvip = \"10.200.0.101\"\nport = 80\ncolour = \"blue\"\n",
            iface: None,
            marker: "colour = \"blue\"",
            key: Some("colour"),
            says: &["unknown field", "config/README.md"],
        },
        Bad {
            name: "unknown key in a backend",
            services: "[[service]]\nvip = \"10.200.0.101\"\nport = 80\n[[service.backend]]\naddress = \"10.200.10.2\"\nport = 80\nweigth = 3\n",
            iface: None,
            marker: "weigth = 3",
            key: Some("service[2].backend[0].weigth"),
            says: &["unknown field", "weight"],
        },
        Bad {
            name: "invalid IPv4 VIP",
            services: "[[service]]\nvip = \"10.0.0.300\"\nport = 80\n",
            iface: None,
            marker: "vip = \"10.0.0.300\"",
            key: Some("service[2].vip"),
            says: &["invalid"],
        },
        Bad {
            name: "invalid IPv6 VIP",
            services: "[[service]]\nvip = \"fd00::zz\"\nport = 80\n",
            iface: None,
            marker: "vip = \"fd00::zz\"",
            key: Some("service[2].vip"),
            says: &["invalid"],
        },
        Bad {
            name: "invalid backend address",
            services: "[[service]]\nvip = \"10.200.0.101\"\nport = 80\n[[service.backend]]\naddress = \"10.200.10.256\"\nport = 80\n",
            iface: None,
            marker: "address = \"10.200.10.256\"",
            key: Some("service[2].backend[0].address"),
            says: &["invalid"],
        },
        Bad {
            name: "service port 70000",
            services: "[[service]]\nvip = \"10.200.0.101\"\nport = 70000\n",
            iface: None,
            marker: "port = 70000",
            key: Some("service[2].port"),
            says: &["70000"],
        },
        Bad {
            name: "service port 0",
            services: "[[service]]\nvip = \"10.200.0.101\"\nport = 0\n",
            iface: None,
            marker: "port = 0",
            key: Some("service[2].port"),
            says: &["1..=65535"],
        },
        Bad {
            name: "backend port 70000",
            services: "[[service]]\nvip = \"10.200.0.101\"\nport = 80\n[[service.backend]]\naddress = \"10.200.10.2\"\nport = 70000\n",
            iface: None,
            marker: "port = 70000",
            key: Some("service[2].backend[0].port"),
            says: &["70000"],
        },
        Bad {
            name: "backend port 0",
            services: "[[service]]\nvip = \"10.200.0.101\"\nport = 80\n[[service.backend]]\naddress = \"10.200.10.2\"\nport = 0\n",
            iface: None,
            marker: "port = 0",
            key: Some("service[2].backend[0].port"),
            says: &["1..=65535"],
        },
        Bad {
            name: "snat_ports range upside down",
            services: "[[service]]\nvip = \"10.200.0.101\"\nport = 80\nmode = \"full_nat\"\nsnat_address = \"10.200.10.1\"\nsnat_ports = \"2000-1000\"\n[[service.backend]]\naddress = \"10.200.10.2\"\nport = 80\n",
            iface: None,
            marker: "snat_ports = \"2000-1000\"",
            key: Some("snat_ports"),
            says: &["FIRST <= LAST"],
        },
        Bad {
            name: "interface snat_addresses multicast",
            services: "",
            iface: Some("snat = true\nsnat_addresses = [\"224.0.0.1\"]"),
            marker: "snat_addresses = [\"224.0.0.1\"]",
            key: Some("interface[0].snat_addresses"),
            says: &["224.0.0.1", "unicast"],
        },
        Bad {
            name: "multicast VIP",
            services: "[[service]]\nvip = \"239.1.1.1\"\nport = 80\n",
            iface: None,
            marker: "vip = \"239.1.1.1\"",
            key: Some("service[2].vip"),
            says: &["unicast"],
        },
        Bad {
            name: "duplicate service",
            services: "[[service]]\nvip = \"10.200.0.100\"\nport = 80\n[[service.backend]]\naddress = \"10.200.11.2\"\nport = 80\n",
            iface: None,
            marker: "vip = \"10.200.0.100\"",
            key: Some("service[2].vip"),
            says: &["defined twice", "merge"],
        },
        Bad {
            name: "IPv6 backend of an IPv4 VIP",
            services: "[[service]]\nvip = \"10.200.0.101\"\nport = 80\n[[service.backend]]\naddress = \"fd00:200:10::2\"\nport = 80\n",
            iface: None,
            marker: "address = \"fd00:200:10::2\"",
            key: Some("service[2].backend[0].address"),
            says: &["family"],
        },
        Bad {
            name: "IPv4 backend of an IPv6 VIP",
            services: "[[service]]\nvip = \"fd00:200::101\"\nport = 80\n[[service.backend]]\naddress = \"10.200.10.2\"\nport = 80\n",
            iface: None,
            marker: "address = \"10.200.10.2\"",
            key: Some("service[2].backend[0].address"),
            says: &["family"],
        },
    ]
}

fn bad_text(lb: &LbTopology, pin_dir: &Path, case: &Bad) -> String {
    let mut c = config_with(lb, pin_dir, "", case.services);
    if let Some(lines) = case.iface {
        c = c.interface_key(LbTopology::FP_CLIENT_IF, lines);
    }
    c.to_toml()
}

fn assert_says(what: &str, msg: &str, path: &Path, line: usize, case: &Bad) {
    let at = format!("{}:{line}", path.display());
    assert!(
        msg.contains(&at),
        "{what} ({}): the error does not point at {at}:\n{msg}",
        case.name
    );
    if let Some(key) = case.key {
        assert!(
            msg.contains(key),
            "{what} ({}): the error does not name the key {key}:\n{msg}",
            case.name
        );
    }
    for s in case.says {
        assert!(
            msg.contains(s),
            "{what} ({}): the error does not say {s:?}:\n{msg}",
            case.name
        );
    }
}

/// Every bad config through `fastpath apply -f` and through SIGHUP: refused with the file,
/// line and key, daemon alive, maps and generation unchanged. Then a good change through
/// each path is accepted (the refusals were not a dead path).
#[test]
fn bad_config_files_are_refused_by_apply_and_sighup() {
    prepare_test(&[]);
    let dir = TempDir::new("bad-apply").expect("temp dir");
    let lb = test_lb_topology(BACKENDS);
    let pin = unique_pin_dir("bad-apply");
    let good = config_with(&lb, &pin, "", "");
    let mut daemon = Daemon::start(bin(), lb.fp(), &good);
    let before = maps(&daemon);
    let gen0 = generation(&daemon);
    assert_eq!(
        before.json.as_array().map(Vec::len),
        Some(2),
        "the base services: {:?}",
        before.json
    );

    for (n, case) in bad_cases().iter().enumerate() {
        let text = bad_text(&lb, &pin, case);
        let line = line_of(&text, case.marker);

        // fastpath apply -f FILE
        let file = dir.join(format!("bad-{n}.toml"));
        fs::write(&file, &text).expect("writing the bad config");
        let out: Output = daemon.cli(&["apply".as_ref(), "-f".as_ref(), file.as_os_str()]);
        let stderr = lossy(&out.stderr);
        eprintln!(
            "[{}] apply -f: exit {:?}: {}",
            case.name,
            out.status.code(),
            stderr.trim()
        );
        assert_eq!(
            out.status.code(),
            Some(EXIT_REJECTED),
            "{}: apply -f exit status; stdout {}; stderr {stderr}",
            case.name,
            lossy(&out.stdout)
        );
        assert!(
            stderr.contains("nothing was changed"),
            "{}: {stderr}",
            case.name
        );
        assert_says("apply -f", &stderr, &file, line, case);
        assert_maps_unchanged(&mut daemon, &before, &format!("{} (apply -f)", case.name));
        assert_eq!(generation(&daemon), gen0, "{}: generation moved", case.name);

        // The same content as the daemon's own config file, then SIGHUP.
        fs::write(daemon.config_path(), &text).expect("writing the daemon's config");
        let log = sighup_until(&daemon, "Reload refused");
        let refused = log
            .lines()
            .find(|l| l.contains("Reload refused"))
            .expect("the refusal line");
        eprintln!("[{}] SIGHUP: {}", case.name, refused.trim());
        assert!(
            refused.contains("nothing was changed"),
            "{}: {refused}",
            case.name
        );
        assert_says("SIGHUP", refused, daemon.config_path(), line, case);
        assert_maps_unchanged(&mut daemon, &before, &format!("{} (SIGHUP)", case.name));
        assert_eq!(generation(&daemon), gen0, "{}: generation moved", case.name);
    }

    // Back to the good file: a reload of it changes nothing either.
    fs::write(daemon.config_path(), good.to_toml()).expect("restoring the config");
    sighup_until(&daemon, "Config reloaded");
    assert_maps_unchanged(&mut daemon, &before, "reloading the original file");

    // Positive controls: a good change is taken by both paths.
    let extra = "[[service]]\nvip = \"10.200.0.101\"\nport = 80\n[[service.backend]]\naddress = \"10.200.10.2\"\nport = 80\n";
    let file = dir.join("good.toml");
    fs::write(&file, config_with(&lb, &pin, "", extra).to_toml()).expect("writing");
    daemon.cli_ok(&["apply".as_ref(), "-f".as_ref(), file.as_os_str()]);
    assert_eq!(service_set(&daemon).len(), 3, "apply -f of a good file");
    fs::write(
        daemon.config_path(),
        config_with(
            &lb,
            &pin,
            "",
            &extra.replace("10.200.0.101", "10.200.0.102"),
        )
        .to_toml(),
    )
    .expect("writing");
    let log = sighup_until(&daemon, "Config reloaded");
    assert!(log.contains("created=1"), "{log}");
    let set = service_set(&daemon);
    assert!(
        set.iter().any(|s| s.starts_with("10.200.0.102:80/tcp")) && set.len() == 3,
        "after a good reload: {set:?}"
    );
    assert!(daemon.is_running());
}

/// `n` services 10.200.(128 + i / 250).(1 + i % 250):80, each with one or two backends.
fn many_services(n: usize) -> String {
    let mut s = String::with_capacity(n * 160);
    for i in 0..n {
        s += &format!(
            "[[service]]\nvip = \"10.200.{}.{}\"\nport = 80\n[[service.backend]]\naddress = \"{}\"\nport = 80\n",
            128 + i / 250,
            1 + i % 250,
            LbTopology::backend_v4(i % BACKENDS)
        );
        if i % 2 == 0 {
            s += &format!(
                "[[service.backend]]\naddress = \"{}\"\nport = 8080\n",
                LbTopology::backend_v4((i + 1) % BACKENDS)
            );
        }
    }
    s
}

/// 10,000 services in one file: `config check` takes it, `apply -f` applies it (timed) and
/// the maps then hold 10,000 more services; applying the original file removes them again.
#[test]
fn ten_thousand_services_apply_and_back() {
    const N: usize = 10_000;
    prepare_test(&[]);
    let dir = TempDir::new("bad-10k").expect("temp dir");
    let lb = test_lb_topology(BACKENDS);
    let pin = unique_pin_dir("bad-10k");
    let good = config_with(&lb, &pin, "", "");
    let mut daemon = Daemon::start(bin(), lb.fp(), &good);
    let original = service_set(&daemon);
    assert_eq!(original.len(), 2);

    let big = dir.join("10k.toml");
    fs::write(
        &big,
        config_with(&lb, &pin, "", &many_services(N)).to_toml(),
    )
    .expect("writing");
    let small = dir.join("original.toml");
    fs::write(&small, good.to_toml()).expect("writing");
    eprintln!(
        "10k-service file: {} bytes",
        fs::metadata(&big).expect("size").len()
    );

    // config check, in the fp namespace (its interfaces exist there).
    let t = Instant::now();
    let out = std::process::Command::new(bin())
        .arg("--netns")
        .arg(lb.fp().name())
        .arg("config")
        .arg("check")
        .arg(&big)
        .output()
        .expect("config check");
    let check_took = t.elapsed();
    let stdout = lossy(&out.stdout);
    eprintln!(
        "config check of {N} services: {check_took:.2?}: {}{}",
        stdout.trim(),
        lossy(&out.stderr).trim()
    );
    assert!(out.status.success(), "config check: {}", lossy(&out.stderr));
    assert!(
        stdout.contains(&format!("{} service(s)", N + 2)),
        "config check: {stdout}"
    );

    // A dry run changes nothing.
    let out = daemon.cli_ok(&[
        "apply".as_ref(),
        "-f".as_ref(),
        big.as_os_str(),
        "--dry-run".as_ref(),
        "-o".as_ref(),
        "json".as_ref(),
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(v["created"].as_array().map(Vec::len), Some(N), "dry run");
    assert_eq!(service_set(&daemon), original, "a dry run changed the maps");

    let t = Instant::now();
    let out = daemon.cli_ok(&[
        "apply".as_ref(),
        "-f".as_ref(),
        big.as_os_str(),
        "-o".as_ref(),
        "json".as_ref(),
    ]);
    let took = t.elapsed();
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    eprintln!(
        "apply -f of {N} new services: {took:.2?} (the daemon's own took_us: {} µs)",
        v["took_us"]
    );
    assert_eq!(v["created"].as_array().map(Vec::len), Some(N), "{out:.300}");
    assert_eq!(v["unchanged"].as_u64(), Some(2));
    assert!(
        took < Duration::from_secs(60),
        "applying {N} services took {took:?}"
    );
    assert!(daemon.is_running());

    let set = service_set(&daemon);
    assert_eq!(set.len(), N + 2, "services in the maps after the apply");
    assert!(set.is_superset(&original));
    for probe in [0, 1, 4_999, N - 1] {
        let vip = format!(
            "10.200.{}.{}:80/tcp -> ",
            128 + probe / 250,
            1 + probe % 250
        );
        let row = set
            .iter()
            .find(|s| s.starts_with(&vip))
            .unwrap_or_else(|| panic!("service {vip} missing"));
        let want = if probe % 2 == 0 { 2 } else { 1 };
        assert_eq!(row.split(',').count(), want, "{row}");
    }
    let (_, json) = service_list_json(bin(), daemon.pin_dir());
    assert_eq!(
        json.as_array().map(Vec::len),
        Some(N + 2),
        "service list --pin-dir"
    );
    let listed = daemon.cli_ok(&["service", "list", "-o", "json"]);
    let listed: serde_json::Value = serde_json::from_str(&listed).expect("JSON");
    assert_eq!(
        listed.as_array().map(Vec::len),
        Some(N + 2),
        "service list (API)"
    );

    // Reapplying the same file is a no-op.
    let t = Instant::now();
    let out = daemon.cli_ok(&[
        "apply".as_ref(),
        "-f".as_ref(),
        big.as_os_str(),
        "-o".as_ref(),
        "json".as_ref(),
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    eprintln!("re-apply of the same {N} services: {:.2?}", t.elapsed());
    assert_eq!(v["unchanged"].as_u64(), Some(N as u64 + 2));

    // Back to the original file.
    let t = Instant::now();
    let out = daemon.cli_ok(&[
        "apply".as_ref(),
        "-f".as_ref(),
        small.as_os_str(),
        "-o".as_ref(),
        "json".as_ref(),
    ]);
    let took = t.elapsed();
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    eprintln!("apply -f of the original (deleting {N}): {took:.2?}");
    assert_eq!(v["deleted"].as_array().map(Vec::len), Some(N));
    assert!(took < Duration::from_secs(60), "deleting took {took:?}");
    assert_eq!(
        service_set(&daemon),
        original,
        "after re-applying the original"
    );
    let (_, json) = service_list_json(bin(), daemon.pin_dir());
    assert_eq!(json.as_array().map(Vec::len), Some(2));
    assert!(daemon.is_running());
}

// ---- raw gRPC ----

/// A channel to the daemon's socket, with no message size limits of its own.
async fn channel(socket: &Path) -> Channel {
    let path: PathBuf = socket.to_owned();
    Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move {
                let s = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
            }
        }))
        .await
        .unwrap_or_else(|e| panic!("connecting to {}: {e}", socket.display()))
}

/// Sends and receives message bodies as they are: no protobuf in between.
#[derive(Clone, Copy, Default)]
struct RawCodec;
struct RawEncoder;
struct RawDecoder;

impl Encoder for RawEncoder {
    type Item = Vec<u8>;
    type Error = Status;
    fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for RawDecoder {
    type Item = Vec<u8>;
    type Error = Status;
    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
        let mut v = vec![0; src.remaining()];
        src.copy_to_slice(&mut v);
        Ok(Some(v))
    }
}

impl Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawEncoder;
    type Decoder = RawDecoder;
    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }
    fn decoder(&mut self) -> RawDecoder {
        RawDecoder
    }
}

async fn raw_call(ch: &Channel, method: &'static str, body: Vec<u8>) -> Result<Vec<u8>, Status> {
    let mut grpc = tonic::client::Grpc::new(ch.clone())
        .max_encoding_message_size(usize::MAX)
        .max_decoding_message_size(usize::MAX);
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(format!("not ready: {e}")))?;
    grpc.unary(
        tonic::Request::new(body),
        tonic::codegen::http::uri::PathAndQuery::from_static(method),
        RawCodec,
    )
    .await
    .map(tonic::Response::into_inner)
}

/// xorshift64*: reproducible garbage.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

async fn connect(socket: &Path) -> Client {
    client::connect(&Target::Unix(socket.to_owned()))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

fn spec(vip: &str, port: u32, backends: &[(&str, u32)]) -> pb::ServiceSpec {
    pb::ServiceSpec {
        key: Some(pb::ServiceKey {
            vip: vip.into(),
            port,
            protocol: pb::Protocol::Tcp as i32,
        }),
        backends: backends
            .iter()
            .map(|(a, p)| pb::BackendSpec {
                address: (*a).into(),
                port: *p,
                weight: None,
            })
            .collect(),
        ..Default::default()
    }
}

fn create(services: Vec<pb::ServiceSpec>) -> pb::ServicesRequest {
    pb::ServicesRequest {
        services,
        expected_generation: 0,
        dry_run: false,
    }
}

/// Garbage bodies, a request above `MAX_MESSAGE_BYTES` and invalid field values: each an
/// error status, the daemon alive, the maps and the generation unchanged.
#[test]
fn garbage_oversized_and_invalid_grpc_requests_change_nothing() {
    prepare_test(&[]);
    let lb = test_lb_topology(BACKENDS);
    let pin = unique_pin_dir("bad-grpc");
    let good = config_with(&lb, &pin, "", "");
    let mut daemon = Daemon::start(bin(), lb.fp(), &good);
    let before = maps(&daemon);
    let gen0 = generation(&daemon);
    let rt = runtime();
    let socket = daemon.socket();
    let good_toml = good.to_toml();

    // (a) garbage
    let mut results = Vec::new();
    rt.block_on(async {
        let ch = channel(&socket).await;
        const METHODS: [&str; 8] = [
            "/fastpath.v1.Fastpath/Apply",
            "/fastpath.v1.Fastpath/CreateServices",
            "/fastpath.v1.Fastpath/UpdateServices",
            "/fastpath.v1.Fastpath/DeleteServices",
            "/fastpath.v1.Fastpath/AddBackends",
            "/fastpath.v1.Fastpath/RemoveBackends",
            "/fastpath.v1.Fastpath/DrainBackends",
            "/fastpath.v1.Fastpath/CreatePortForwards",
        ];
        let mut bodies: Vec<(String, Vec<u8>)> = vec![
            ("0xff x 64 (wire type 7)".into(), vec![0xff; 64]),
            // field 1 (string / message) sent as a varint
            ("field 1 as a varint".into(), vec![0x08, 0x96, 0x01]),
            // field 1 with a length past the end of the body
            ("length past the end".into(), vec![0x0a, 0x7f, 0x01, 0x02]),
            // field 1 as invalid UTF-8 / a message made of garbage
            ("field 1: bytes ff fe".into(), vec![0x0a, 0x02, 0xff, 0xfe]),
            // a varint that never ends
            ("unterminated varint".into(), vec![0x10, 0xff, 0xff, 0xff]),
            // field number 0
            ("field number 0".into(), vec![0x00, 0x01]),
        ];
        let mut rng = Rng(0x5eed_1234_abcd_0001);
        for n in [1usize, 7, 100, 1000, 65_536] {
            bodies.push((format!("{n} random bytes"), rng.bytes(n)));
        }
        for method in METHODS {
            for (what, body) in &bodies {
                let r = raw_call(&ch, method, body.clone()).await;
                results.push((method, what.clone(), r));
            }
        }
    });
    let mut codes = std::collections::BTreeMap::new();
    for (method, what, r) in &results {
        match r {
            Ok(body) => panic!("{method} with {what}: accepted (response {body:?})"),
            Err(s) => {
                assert!(
                    !s.message().is_empty(),
                    "{method} with {what}: {:?} without a message",
                    s.code()
                );
                *codes.entry(format!("{:?}", s.code())).or_insert(0) += 1;
            }
        }
    }
    for (method, what, r) in results.iter().take(11) {
        if let Err(s) = r {
            eprintln!(
                "garbage to {method} ({what}): {:?}: {}",
                s.code(),
                s.message()
            );
        }
    }
    eprintln!("garbage: {} requests, codes {codes:?}", results.len());
    assert_maps_unchanged(&mut daemon, &before, "garbage gRPC bodies");
    assert_eq!(generation(&daemon), gen0);

    // Not even HTTP/2: the connection is closed, the daemon carries on.
    {
        let mut s = std::os::unix::net::UnixStream::connect(&socket).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let _ = s.write_all(&Rng(42).bytes(16 * 1024));
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
        eprintln!(
            "raw garbage on the socket: {} bytes back, closed",
            sink.len()
        );
    }
    assert_maps_unchanged(&mut daemon, &before, "garbage on the socket");
    assert_eq!(generation(&daemon), gen0);

    // (b) above MAX_MESSAGE_BYTES
    let huge = {
        let mut t = good_toml.clone();
        t.push('#');
        t.push_str(&"x".repeat(MAX_MESSAGE_BYTES + (1 << 20)));
        t.push('\n');
        t
    };
    let (server_side, client_side) = rt.block_on(async {
        let ch = channel(&socket).await;
        let mut unlimited = FastpathClient::new(ch).max_encoding_message_size(usize::MAX);
        let server_side = unlimited
            .apply(pb::ApplyRequest {
                config_toml: huge.clone(),
                ..Default::default()
            })
            .await;
        let mut stock = connect(&socket).await;
        let client_side = stock
            .apply(pb::ApplyRequest {
                config_toml: huge.clone(),
                ..Default::default()
            })
            .await;
        (server_side, client_side)
    });
    let s = server_side.expect_err("a request above MAX_MESSAGE_BYTES was accepted");
    eprintln!(
        "{} MiB Apply, sent past the client's limit: {:?}: {}",
        huge.len() >> 20,
        s.code(),
        s.message()
    );
    assert!(
        matches!(s.code(), Code::ResourceExhausted | Code::OutOfRange),
        "oversized request: {:?}: {}",
        s.code(),
        s.message()
    );
    let s = client_side.expect_err("the stock client sent an oversized request");
    eprintln!(
        "the same through fastpath::api::client: {:?}: {}",
        s.code(),
        s.message()
    );
    // Refused before it reaches the daemon, but only as an HTTP/2 reset (INTERNAL, "h2
    // protocol error") that does not say the message was too large: see the CLI below.
    assert_maps_unchanged(&mut daemon, &before, "an oversized request");
    assert_eq!(generation(&daemon), gen0);

    // The same through the CLI.
    let dir = TempDir::new("bad-grpc").expect("temp dir");
    let file = dir.join("huge.toml");
    fs::write(&file, &huge).expect("writing");
    let out = daemon.cli(&["apply".as_ref(), "-f".as_ref(), file.as_os_str()]);
    eprintln!(
        "apply -f of a {} MiB file: exit {:?}: {}",
        huge.len() >> 20,
        out.status.code(),
        lossy(&out.stderr).trim()
    );
    let stderr = lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(EXIT_REJECTED), "{stderr}");
    assert!(
        stderr.contains("too large") && stderr.contains(&MAX_MESSAGE_BYTES.to_string()),
        "the CLI does not say the file is too large: {stderr}"
    );
    drop(huge);
    assert_maps_unchanged(&mut daemon, &before, "an oversized file");

    // Just under the limit is decoded (a dry run of the same services: nothing to do).
    let under = {
        let mut t = good_toml.clone();
        t.push('#');
        t.push_str(&"x".repeat(MAX_MESSAGE_BYTES - (1 << 20)));
        t.push('\n');
        t
    };
    let r = rt.block_on(async {
        connect(&socket)
            .await
            .apply(pb::ApplyRequest {
                config_toml: under,
                dry_run: true,
                ..Default::default()
            })
            .await
    });
    let r =
        r.unwrap_or_else(|s| panic!("a request under the limit: {:?}: {}", s.code(), s.message()));
    assert!(r.get_ref().change.as_ref().is_some_and(|c| c.dry_run));
    assert_maps_unchanged(&mut daemon, &before, "a dry run under the limit");
    assert_eq!(generation(&daemon), gen0);

    // (c) invalid field values through the generated client
    let b0 = LbTopology::backend_v4(0).to_string();
    let b0 = b0.as_str();
    let with = |f: &dyn Fn(&mut pb::ServiceSpec)| {
        let mut s = spec("10.200.0.101", 80, &[(b0, 80)]);
        f(&mut s);
        create(vec![s])
    };
    let key_of = |vip: &str, port: u32, protocol: i32| {
        Some(pb::ServiceKey {
            vip: vip.into(),
            port,
            protocol,
        })
    };
    type Call = (&'static str, pb::ServicesRequest, &'static str);
    let creates: Vec<Call> = vec![
        (
            "port 70000",
            with(&|s| s.key.as_mut().unwrap().port = 70_000),
            "services[0].key.port",
        ),
        (
            "port 0",
            with(&|s| s.key.as_mut().unwrap().port = 0),
            "services[0].key.port",
        ),
        (
            "vip \"x\"",
            with(&|s| s.key.as_mut().unwrap().vip = "x".into()),
            "services[0].key.vip",
        ),
        (
            "vip \"10.0.0.300\"",
            with(&|s| s.key.as_mut().unwrap().vip = "10.0.0.300".into()),
            "services[0].key.vip",
        ),
        (
            "protocol 99",
            with(&|s| s.key.as_mut().unwrap().protocol = 99),
            "services[0].key.protocol",
        ),
        (
            "scheduler 99",
            with(&|s| s.scheduler = 99),
            "services[0].scheduler",
        ),
        ("mode 99", with(&|s| s.mode = 99), "services[0].mode"),
        (
            "no_backend 99",
            with(&|s| s.no_backend = 99),
            "services[0].no_backend",
        ),
        ("no key", with(&|s| s.key = None), "services[0].key"),
        (
            "backend port 70000",
            with(&|s| s.backends[0].port = 70_000),
            "services[0].backends[0].port",
        ),
        (
            "backend address \"x\"",
            with(&|s| s.backends[0].address = "x".into()),
            "services[0].backends[0].address",
        ),
        (
            "backend weight 70000",
            with(&|s| s.backends[0].weight = Some(70_000)),
            "services[0].backends[0].weight",
        ),
        (
            "health check kind \"icmp\"",
            with(&|s| {
                s.health_check = Some(pb::HealthCheckSpec {
                    kind: "icmp".into(),
                    ..Default::default()
                })
            }),
            "services[0].health_check.kind",
        ),
        (
            "backend of the other family",
            with(&|s| s.backends[0].address = "fd00:200:10::2".into()),
            "service 10.200.0.101:80/tcp.backend[0].address",
        ),
        (
            "snat_ports 2000-1000",
            with(&|s| {
                s.mode = pb::ForwardMode::FullNat as i32;
                s.snat_address = "10.200.10.1".into();
                s.snat_ports = "2000-1000".into();
            }),
            "snat_ports",
        ),
        (
            "the second of two is bad",
            create(vec![
                spec("10.200.0.101", 80, &[(b0, 80)]),
                spec("10.200.0.102", 80, &[(b0, 0)]),
            ]),
            "services[1].backends[0].port",
        ),
        ("no services", create(vec![]), "services"),
    ];
    let results = rt.block_on(async {
        let mut c = connect(&socket).await;
        let mut out = Vec::new();
        for (what, req, field) in creates {
            out.push((what, field, c.create_services(req).await.map(drop)));
        }
        let mut add = |what: &'static str, field: &'static str, r: Result<(), Status>| {
            out.push((what, field, r));
        };
        add(
            "AddBackends without a service",
            "service",
            c.add_backends(pb::BackendsRequest {
                service: None,
                backends: vec![pb::BackendSpec {
                    address: b0.into(),
                    port: 80,
                    weight: None,
                }],
                ..Default::default()
            })
            .await
            .map(drop),
        );
        add(
            "AddBackends port 70000",
            "backends[0].port",
            c.add_backends(pb::BackendsRequest {
                service: key_of(VIP4, 80, 1),
                backends: vec![pb::BackendSpec {
                    address: "10.200.11.2".into(),
                    port: 70_000,
                    weight: None,
                }],
                ..Default::default()
            })
            .await
            .map(drop),
        );
        add(
            "DeleteServices protocol 99",
            "keys[0].protocol",
            c.delete_services(pb::DeleteServicesRequest {
                keys: vec![pb::ServiceKey {
                    vip: VIP4.into(),
                    port: 80,
                    protocol: 99,
                }],
                ..Default::default()
            })
            .await
            .map(drop),
        );
        add(
            "DrainBackends vip \"x\"",
            "service.vip",
            c.drain_backends(pb::BackendsRequest {
                service: key_of("x", 80, 1),
                backends: vec![pb::BackendSpec {
                    address: b0.into(),
                    port: 80,
                    weight: None,
                }],
                ..Default::default()
            })
            .await
            .map(drop),
        );
        add(
            "CreatePortForwards port 70000",
            "port",
            c.create_port_forwards(pb::PortForwardsRequest {
                port_forwards: vec![pb::PortForwardSpec {
                    address: "10.200.1.1".into(),
                    port: 70_000,
                    protocol: 1,
                    to: b0.into(),
                    to_port: 80,
                }],
                ..Default::default()
            })
            .await
            .map(drop),
        );
        add(
            "GetService port 70000",
            "key.port",
            c.get_service(pb::ServiceKey {
                vip: VIP4.into(),
                port: 70_000,
                protocol: 1,
            })
            .await
            .map(drop),
        );
        add(
            "Apply with a bad port",
            "api-test.toml:",
            c.apply(pb::ApplyRequest {
                config_toml: good_toml.replace("port = 80", "port = 70000"),
                source_name: "api-test.toml".into(),
                ..Default::default()
            })
            .await
            .map(drop),
        );
        add(
            "Apply of garbage text",
            "<apply>:",
            c.apply(pb::ApplyRequest {
                config_toml: "\u{0}\u{1}garbage = = =".into(),
                ..Default::default()
            })
            .await
            .map(drop),
        );
        out
    });
    for (what, field, r) in &results {
        let s = match r {
            Ok(()) => panic!("{what}: accepted"),
            Err(s) => s,
        };
        eprintln!("{what}: {:?}: {}", s.code(), s.message());
        assert_eq!(s.code(), Code::InvalidArgument, "{what}: {}", s.message());
        assert!(
            s.message().contains(field),
            "{what}: the message does not name {field}: {}",
            s.message()
        );
        assert!(
            s.message().contains("give")
                || s.message().contains("README")
                || s.message().contains("; "),
            "{what}: the message does not say what to do: {}",
            s.message()
        );
    }
    // A drain on a node that announces nothing is refused, saying why; a bad time never
    // leaves the CLI; the cluster status says announcements are off.
    for (args, code, says) in [
        (&["drain"][..], EXIT_REJECTED, "announces nothing"),
        (
            &["drain", "--quiet", "0"][..],
            2,
            "give a positive number of seconds",
        ),
        (
            &["drain", "--deadline", "nan"][..],
            2,
            "give a positive number of seconds",
        ),
    ] {
        let out = daemon.cli(args);
        let stderr = lossy(&out.stderr);
        eprintln!(
            "fastpath {}: exit {:?}: {}",
            args.join(" "),
            out.status.code(),
            stderr.trim()
        );
        assert_eq!(out.status.code(), Some(code), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
    let out = daemon.cli(&["cluster", "status"]);
    assert!(
        out.status.success() && lossy(&out.stdout).contains("announcements: off"),
        "cluster status: {}{}",
        lossy(&out.stdout),
        lossy(&out.stderr)
    );
    assert_maps_unchanged(&mut daemon, &before, "invalid field values");
    assert_eq!(
        generation(&daemon),
        gen0,
        "a refused request moved the generation"
    );
}

/// Conflicting changes at once: of many identical `CreateServices`, exactly one succeeds and
/// the rest get ALREADY_EXISTS; of two `Apply`s at the same `expected_generation`, exactly one
/// succeeds, the other gets FAILED_PRECONDITION, and the maps hold the winner's services.
#[test]
fn concurrent_conflicting_changes_one_wins() {
    prepare_test(&[]);
    let lb = test_lb_topology(BACKENDS);
    let pin = unique_pin_dir("bad-race");
    let good = config_with(&lb, &pin, "", "");
    let mut daemon = Daemon::start(bin(), lb.fp(), &good);
    let rt = runtime();
    let socket = daemon.socket();
    let b0 = LbTopology::backend_v4(0).to_string();
    let b1 = LbTopology::backend_v4(1).to_string();
    let (b0, b1) = (b0.as_str(), b1.as_str());
    const CLIENTS: usize = 8;

    for round in 0..5u32 {
        let vip = format!("10.200.0.{}", 150 + round);
        let gen_before = generation(&daemon);
        let results = rt.block_on(async {
            let barrier = Arc::new(tokio::sync::Barrier::new(CLIENTS));
            let mut tasks = Vec::new();
            for _ in 0..CLIENTS {
                let (socket, barrier) = (socket.clone(), barrier.clone());
                let s = spec(&vip, 80, &[(b0, 80), (b1, 80)]);
                tasks.push(tokio::spawn(async move {
                    let mut c = connect(&socket).await;
                    barrier.wait().await;
                    c.create_services(create(vec![s]))
                        .await
                        .map(|r| r.into_inner())
                }));
            }
            let mut out = Vec::new();
            for t in tasks {
                out.push(t.await.expect("task"));
            }
            out
        });
        let ok: Vec<_> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
        let exists: Vec<_> = results
            .iter()
            .filter_map(|r| r.as_ref().err())
            .filter(|s| s.code() == Code::AlreadyExists)
            .collect();
        eprintln!(
            "round {round}: {CLIENTS} concurrent CreateServices of {vip}:80: {} ok, {} ALREADY_EXISTS ({})",
            ok.len(),
            exists.len(),
            exists.first().map(|s| s.message()).unwrap_or("")
        );
        assert_eq!(ok.len(), 1, "exactly one create must win: {results:?}");
        assert_eq!(exists.len(), CLIENTS - 1, "{results:?}");
        assert!(
            exists
                .iter()
                .all(|s| s.message().contains("already exists") && s.message().contains(&vip))
        );
        assert_eq!(ok[0].created.len(), 1);
        assert_eq!(ok[0].generation, gen_before + 1);
        assert_eq!(generation(&daemon), gen_before + 1);
        let set = service_set(&daemon);
        assert!(
            set.contains(&format!("{vip}:80/tcp -> {b0}:80,{b1}:80")),
            "{set:?}"
        );
    }
    assert_eq!(service_set(&daemon).len(), 2 + 5);

    // Two different configs applied at once with the same expected generation.
    let extra = |vip: &str| {
        format!(
            "[[service]]\nvip = \"{vip}\"\nport = 80\n[[service.backend]]\naddress = \"{b0}\"\nport = 80\n"
        )
    };
    let mut winners = [0usize; 2];
    for round in 0..6u32 {
        let vips = [
            format!("10.200.0.{}", 170 + round),
            format!("10.200.0.{}", 190 + round),
        ];
        let configs: Vec<String> = vips
            .iter()
            .map(|v| config_with(&lb, &pin, "", &extra(v)).to_toml())
            .collect();
        let at_gen = generation(&daemon);
        let results = rt.block_on(async {
            let barrier = Arc::new(tokio::sync::Barrier::new(2));
            let mut tasks = Vec::new();
            for toml in configs.clone() {
                let (socket, barrier) = (socket.clone(), barrier.clone());
                tasks.push(tokio::spawn(async move {
                    let mut c = connect(&socket).await;
                    barrier.wait().await;
                    c.apply(pb::ApplyRequest {
                        config_toml: toml,
                        expected_generation: at_gen,
                        ..Default::default()
                    })
                    .await
                    .map(|r| r.into_inner())
                }));
            }
            let mut out = Vec::new();
            for t in tasks {
                out.push(t.await.expect("task"));
            }
            out
        });
        let won: Vec<usize> = (0..2).filter(|&i| results[i].is_ok()).collect();
        assert_eq!(won.len(), 1, "exactly one apply must win: {results:?}");
        let (w, l) = (won[0], 1 - won[0]);
        winners[w] += 1;
        let lost = results[l].as_ref().expect_err("the loser");
        eprintln!(
            "round {round}: two Applys at generation {at_gen}: #{w} won, #{l}: {:?}: {}",
            lost.code(),
            lost.message()
        );
        assert_eq!(lost.code(), Code::FailedPrecondition, "{}", lost.message());
        assert!(
            lost.message().contains(&format!("not {at_gen}")),
            "{}",
            lost.message()
        );
        assert_eq!(generation(&daemon), at_gen + 1);
        // The maps hold exactly the winner's config.
        let set = service_set(&daemon);
        let mut want: BTreeSet<String> = [
            format!(
                "{VIP4}:80/tcp -> {}:80,{}:80",
                LbTopology::backend_v4(0),
                LbTopology::backend_v4(1)
            ),
            format!(
                "[{VIP6}]:80/tcp -> [{}]:80,[{}]:80",
                LbTopology::backend_v6(0),
                LbTopology::backend_v6(1)
            ),
        ]
        .into_iter()
        .collect();
        want.insert(format!("{}:80/tcp -> {b0}:80", vips[w]));
        assert_eq!(set, want, "the maps are not the winner's config");
        // And so does the desired state.
        let listed = daemon.cli_ok(&["service", "list", "-o", "json"]);
        assert!(
            listed.contains(&vips[w]) && !listed.contains(&vips[l]),
            "{listed}"
        );
    }
    eprintln!("apply races won by config #0 / #1: {winners:?}");
    assert!(daemon.is_running());
}

/// `/metrics` of a daemon that forwarded a known number of connections and served a known
/// number of API calls, parsed as Prometheus text: the counters match.
#[test]
fn metrics_count_the_traffic_and_the_api_calls() {
    const PORT: u16 = 9464;
    const N: u64 = 24;
    prepare_test(&["curl", "nginx", "ethtool"]);
    let lb = test_lb_topology(BACKENDS);
    lb.checksum_offloads_off()
        .unwrap_or_else(|e| panic!("checksum offloads: {e}"));
    let _servers: Vec<HttpServer> = (0..BACKENDS)
        .map(|i| {
            let s = lb
                .backend(i)
                .http_server(80)
                .unwrap_or_else(|e| panic!("nginx: {e}"));
            fs::write(s.root().join("index.html"), format!("backend {i}\n")).expect("page");
            s
        })
        .collect();
    let pin = unique_pin_dir("bad-metrics");
    let raw = format!("[api]\nmetrics_listen = \"127.0.0.1:{PORT}\"\n");
    let good = config_with(&lb, &pin, &raw, "");
    let daemon = Daemon::start(bin(), lb.fp(), &good);
    lb.fp().link_up("lo").expect("lo up");
    lb.fp()
        .wait_listening("tcp", PORT, Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("{e}\n{}", daemon.log()));

    let scrape = || -> prometheus_parse::Scrape {
        let body = lb
            .fp()
            .run(&[
                "curl",
                "-sS",
                "--fail",
                "--max-time",
                "10",
                &format!("http://127.0.0.1:{PORT}/metrics"),
            ])
            .unwrap_or_else(|e| panic!("scraping /metrics: {e}"));
        prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_owned())))
            .unwrap_or_else(|e| panic!("parsing /metrics: {e}\n{body}"))
    };
    let first = scrape();
    let service = format!("{VIP4}:80/tcp");
    assert_eq!(value(&first, "fastpath_up", &[]), Some(1.0));
    assert_eq!(value(&first, "fastpath_services", &[]), Some(2.0));
    assert_eq!(
        value(
            &first,
            "fastpath_service_connections_total",
            &[("service", &service)]
        ),
        Some(0.0),
        "connections before any traffic"
    );
    let calls_before = api_calls(&first);
    eprintln!("API calls before: {calls_before:?}");

    // Known API calls.
    let rt = runtime();
    let socket = daemon.socket();
    rt.block_on(async {
        let mut c = connect(&socket).await;
        for _ in 0..3 {
            c.list_services(pb::ListServicesRequest {})
                .await
                .expect("ListServices");
        }
        for _ in 0..2 {
            let e = c
                .get_service(pb::ServiceKey {
                    vip: "10.200.0.222".into(),
                    port: 80,
                    protocol: 1,
                })
                .await
                .expect_err("no such service");
            assert_eq!(e.code(), Code::NotFound);
        }
        let e = c
            .create_services(create(vec![spec("x", 80, &[])]))
            .await
            .expect_err("invalid");
        assert_eq!(e.code(), Code::InvalidArgument);
        c.get_info(pb::GetInfoRequest {}).await.expect("GetInfo");
    });

    // Known traffic: N connections through the VIP.
    let mut per_backend = [0u64; BACKENDS];
    for n in 0..N {
        let body = lb
            .client()
            .http_get(&format!("http://{VIP4}/"))
            .unwrap_or_else(|e| panic!("curl {n}: {e}\n{}", daemon.log()));
        let b: usize = body
            .trim()
            .strip_prefix("backend ")
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("page {body:?}"));
        per_backend[b] += 1;
    }
    eprintln!("{N} connections, per backend (as the pages say): {per_backend:?}");

    let after = scrape();
    let conns = value(
        &after,
        "fastpath_service_connections_total",
        &[("service", &service)],
    );
    eprintln!("fastpath_service_connections_total{{service={service:?}}} = {conns:?}");
    assert_eq!(conns, Some(N as f64), "service connections");
    let mut sum = 0.0;
    for (i, served) in per_backend.iter().enumerate() {
        let backend = format!("{}:80", LbTopology::backend_v4(i));
        let v = value(
            &after,
            "fastpath_backend_connections_total",
            &[("service", &service), ("backend", &backend)],
        )
        .unwrap_or_else(|| panic!("no fastpath_backend_connections_total for {backend}"));
        eprintln!("fastpath_backend_connections_total{{backend={backend:?}}} = {v}");
        assert_eq!(
            v, *served as f64,
            "backend {i}: connections vs pages served"
        );
        sum += v;
    }
    assert_eq!(sum, N as f64, "per-backend connections sum");
    let packets = value(
        &after,
        "fastpath_service_packets_total",
        &[("service", &service)],
    )
    .expect("service packets");
    let bytes = value(
        &after,
        "fastpath_service_bytes_total",
        &[("service", &service)],
    )
    .expect("service bytes");
    eprintln!("service packets {packets}, bytes {bytes}");
    // Each HTTP exchange is at least SYN, SYN-ACK, ACK, request, response, FINs.
    assert!(packets >= (5 * N) as f64, "service packets {packets}");
    assert!(bytes >= packets * 40.0, "service bytes {bytes}");
    assert_eq!(
        value(
            &after,
            "fastpath_service_connections_total",
            &[("service", &format!("[{VIP6}]:80/tcp"))]
        ),
        Some(0.0),
        "no traffic went to the IPv6 VIP"
    );
    // The same numbers as the pinned maps.
    let (_, rows) = service_list_json(bin(), daemon.pin_dir());
    let row = rows
        .as_array()
        .and_then(|a| a.iter().find(|r| r["vip"] == VIP4))
        .unwrap_or_else(|| panic!("{rows}"));
    eprintln!("service list row: {row}");
    assert_eq!(row["connections"].as_f64(), Some(N as f64), "{row}");

    // The API calls, by method and code.
    let calls = api_calls(&after);
    eprintln!("API calls after: {calls:?}");
    for (method, code, n) in [
        ("ListServices", "OK", 3.0),
        ("GetService", "NOT_FOUND", 2.0),
        ("CreateServices", "INVALID_ARGUMENT", 1.0),
        ("GetInfo", "OK", 1.0),
    ] {
        let before = calls_before
            .get(&(method.to_string(), code.to_string()))
            .copied()
            .unwrap_or(0.0);
        let now = calls
            .get(&(method.to_string(), code.to_string()))
            .copied()
            .unwrap_or(0.0);
        assert_eq!(
            now - before,
            n,
            "fastpath_api_requests_total{{method={method},code={code}}}"
        );
    }
    let total_before: f64 = calls_before.values().sum();
    let total: f64 = calls.values().sum();
    assert_eq!(total - total_before, 7.0, "all API requests: {calls:?}");
    // The latency histogram counts the same calls.
    let hist_count = |s: &prometheus_parse::Scrape, method: &str| -> f64 {
        s.samples
            .iter()
            .find(|x| {
                x.metric == "fastpath_api_request_duration_seconds"
                    && x.labels.get("method") == Some(method)
            })
            .and_then(|x| match &x.value {
                prometheus_parse::Value::Histogram(b) => b
                    .iter()
                    .find(|c| c.less_than.is_infinite())
                    .map(|c| c.count),
                _ => None,
            })
            .unwrap_or(0.0)
    };
    assert_eq!(
        hist_count(&after, "ListServices") - hist_count(&first, "ListServices"),
        3.0,
        "latency histogram of ListServices"
    );
}

/// The value of the sample `name` whose labels include `labels`.
fn value(s: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    s.samples
        .iter()
        .find(|x| x.metric == name && labels.iter().all(|(k, v)| x.labels.get(k) == Some(*v)))
        .and_then(|x| match x.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => Some(v),
            _ => None,
        })
}

/// `fastpath_api_requests_total` by (method, code).
fn api_calls(s: &prometheus_parse::Scrape) -> std::collections::BTreeMap<(String, String), f64> {
    s.samples
        .iter()
        .filter(|x| x.metric == "fastpath_api_requests_total")
        .filter_map(|x| {
            let v = match x.value {
                prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Untyped(v) => v,
                _ => return None,
            };
            Some((
                (
                    x.labels.get("method")?.to_string(),
                    x.labels.get("code")?.to_string(),
                ),
                v,
            ))
        })
        .collect()
}
