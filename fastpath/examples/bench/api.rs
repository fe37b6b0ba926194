//! Config changes through the management API, as an operator makes them: one backend removed
//! and added again with the CLI (a process per command: start, connect, request, the daemon's
//! validation, map writes, answer), the same requests from a connected gRPC client, a whole
//! 10,000-service file through `fastpath apply`; and, measured in the same run on the same
//! box, the Linux alternative's one-rule change: `iptables -t nat -A/-D` of a DNAT rule
//! beside 100 others (what kube-proxy's iptables mode edits).

use std::{
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use fastpath::{
    api::{client, pb},
    testkit::netns::{Daemon, TempDir, test_lb_topology, unique_pin_dir},
};
use serde::{Deserialize, Serialize};

const CHANGES: usize = 200;
const BACKENDS: usize = 100;
const BIG: usize = 10_000;
const BIG_ROUNDS: usize = 5;
const VIP: &str = "10.200.0.100";

#[derive(Default, Serialize, Deserialize)]
pub struct ApiRow {
    pub what: String,
    pub samples: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    /// The daemon's own time for the change (validation, plan, map writes), median.
    pub daemon_p50_ms: Option<f64>,
}

#[derive(Default, Serialize, Deserialize)]
pub struct ApiReport {
    pub rows: Vec<ApiRow>,
    pub iptables_version: String,
}

fn row(what: String, mut ms: Vec<f64>, daemon_ms: Vec<f64>) -> ApiRow {
    ms.sort_by(f64::total_cmp);
    let pct = |v: &[f64], q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    let mut d = daemon_ms;
    d.sort_by(f64::total_cmp);
    ApiRow {
        what,
        samples: ms.len(),
        p50_ms: pct(&ms, 0.5),
        p99_ms: pct(&ms, 0.99),
        max_ms: ms[ms.len() - 1],
        daemon_p50_ms: (!d.is_empty()).then(|| pct(&d, 0.5)),
    }
}

fn backend(i: usize) -> String {
    format!("10.210.{}.{}:80", i / 250, 1 + i % 250)
}

fn services_toml(n: usize) -> String {
    let mut s = String::new();
    for i in 0..n {
        s += &format!(
            "[[service]]\nvip = \"10.220.{}.{}\"\nport = 80\n[[service.backend]]\naddress = \"10.210.0.1\"\nport = 80\n[[service.backend]]\naddress = \"10.210.0.2\"\nport = 80\n",
            i / 250,
            1 + i % 250
        );
    }
    s
}

/// Runs `cmd`, failing with its output unless it succeeds; its wall time in ms.
fn timed(mut cmd: Command) -> Result<f64> {
    let t = Instant::now();
    let out = cmd.output().context("running a command")?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    if !out.status.success() {
        bail!(
            "{cmd:?}: {}\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(ms)
}

pub fn run(bin: &Path) -> Result<ApiReport> {
    let lb = test_lb_topology(1);
    let dir = TempDir::new("bench-api")?;
    let mut svc = format!("[[service]]\nvip = \"{VIP}\"\nport = 80\n");
    for i in 0..BACKENDS {
        let b = backend(i);
        let (a, p) = b.rsplit_once(':').context("backend")?;
        svc += &format!("[[service.backend]]\naddress = \"{a}\"\nport = {p}\n");
    }
    let config = lb.fp_config(&unique_pin_dir("bench-api")).services(&svc);
    let daemon = Daemon::start(bin, lb.fp(), &config);
    let socket = daemon.socket();
    let cli = |args: &[&str]| {
        let mut c = Command::new(bin);
        c.arg("--socket").arg(&socket).args(args);
        c
    };
    let target = format!("{VIP}:80");
    let last = backend(BACKENDS - 1);
    let mut rows = Vec::new();

    // The CLI: del and add of one backend, alternately, a process each.
    let mut ms = Vec::new();
    for i in 0..CHANGES {
        let verb = if i % 2 == 0 { "del" } else { "add" };
        ms.push(timed(cli(&["backend", verb, &target, &last]))?);
    }
    rows.push(row(
        format!(
            "`fastpath backend del/add` of one backend (1 service, {BACKENDS} backends): the command's wall time"
        ),
        ms,
        Vec::new(),
    ));
    eprint!("a");

    // A connected client: the same requests, no process start.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (rtt, daemon_ms) = rt.block_on(async {
        let mut c = client::connect(&client::Target::Unix(socket.clone()))
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let (mut rtt, mut took) = (Vec::new(), Vec::new());
        let (addr, port) = last.rsplit_once(':').context("backend")?;
        let req = || pb::BackendsRequest {
            service: Some(pb::ServiceKey {
                vip: VIP.into(),
                port: 80,
                protocol: pb::Protocol::Tcp as i32,
            }),
            backends: vec![pb::BackendSpec {
                address: addr.into(),
                port: port.parse().unwrap_or(80),
                weight: None,
            }],
            expected_generation: 0,
            dry_run: false,
        };
        for i in 0..CHANGES {
            let t = Instant::now();
            let r = if i % 2 == 0 {
                c.remove_backends(req()).await
            } else {
                c.add_backends(req()).await
            }
            .map_err(|s| anyhow::anyhow!("{s}"))?
            .into_inner();
            rtt.push(t.elapsed().as_secs_f64() * 1e3);
            took.push(r.took_us as f64 / 1e3);
        }
        anyhow::Ok((rtt, took))
    })?;
    rows.push(row(
        format!(
            "RemoveBackends/AddBackends of one backend from a connected gRPC client (1 service, {BACKENDS} backends): request to answer"
        ),
        rtt,
        daemon_ms,
    ));
    eprint!("a");

    // A whole file: 10k services in, then the original file again (10k out), alternately.
    let big = dir.join("big.toml");
    let small = dir.join("small.toml");
    std::fs::write(&big, config.clone().services(&services_toml(BIG)).to_toml())?;
    std::fs::write(&small, config.to_toml())?;
    let (mut apply_in, mut apply_out) = (Vec::new(), Vec::new());
    for _ in 0..BIG_ROUNDS {
        apply_in.push(timed(cli(&[
            "apply",
            "-f",
            big.to_str().context("utf-8")?,
        ]))?);
        apply_out.push(timed(cli(&[
            "apply",
            "-f",
            small.to_str().context("utf-8")?,
        ]))?);
    }
    rows.push(row(
        format!(
            "`fastpath apply -f` of a file with {BIG} more services (2 backends each): parse, validate, diff, write, save"
        ),
        apply_in,
        Vec::new(),
    ));
    rows.push(row(
        format!("`fastpath apply -f` of the original file again ({BIG} services deleted)"),
        apply_out,
        Vec::new(),
    ));
    eprint!("a");
    drop(daemon);

    // The Linux alternative in the same namespace: one DNAT rule added and deleted beside 100.
    let fp = lb.fp();
    let ipt = |op: &str, i: usize| {
        let mut c = Command::new("ip");
        c.args([
            "netns",
            "exec",
            fp.name(),
            "iptables",
            "-w",
            "-t",
            "nat",
            op,
        ])
        .args(["PREROUTING", "-d", VIP, "-p", "tcp", "--dport", "80"])
        .args(["-m", "comment", "--comment", &format!("fp-bench-{i}")])
        .args(["-j", "DNAT", "--to-destination", &backend(i)]);
        c
    };
    for i in 0..BACKENDS - 1 {
        timed(ipt("-A", i))?;
    }
    let mut ms = Vec::new();
    for i in 0..CHANGES {
        let op = if i % 2 == 0 { "-A" } else { "-D" };
        ms.push(timed(ipt(op, BACKENDS - 1))?);
    }
    let _ = Command::new("ip")
        .args(["netns", "exec", fp.name(), "iptables", "-t", "nat", "-F"])
        .output();
    rows.push(row(
        format!(
            "Linux alternative: `iptables -t nat -A/-D` of one DNAT rule beside {} others: the command's wall time",
            BACKENDS - 1
        ),
        ms,
        Vec::new(),
    ));
    eprint!("a");
    let version = Command::new("iptables")
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    std::thread::sleep(Duration::from_millis(10));
    Ok(ApiReport {
        rows,
        iptables_version: version,
    })
}

pub fn markdown(r: &ApiReport) -> String {
    use std::fmt::Write as _;
    let mut md = format!(
        "1 service of {BACKENDS} backends · baseline: {}, same namespace\n\n| change | samples | p50 ms | p99 ms | max ms | daemon's own p50 ms |\n|---|---:|---:|---:|---:|---:|\n",
        r.iptables_version
    );
    for row in &r.rows {
        let _ = writeln!(
            md,
            "| {} | {} | {:.2} | {:.2} | {:.2} | {} |",
            row.what,
            row.samples,
            row.p50_ms,
            row.p99_ms,
            row.max_ms,
            row.daemon_p50_ms
                .map_or_else(|| "—".to_string(), |d| format!("{d:.2}"))
        );
    }
    if let (Some(cli), Some(ipt)) = (
        r.rows.first(),
        r.rows.iter().find(|x| x.what.starts_with("Linux")),
    ) {
        let _ = writeln!(
            md,
            "\n| one backend change, p50 | fastpath ÷ iptables |\n|---|---:|\n| command to effect | {:.2} |",
            cli.p50_ms / ipt.p50_ms,
        );
    }
    md.push('\n');
    md
}
