//! Changing a running daemon's interfaces and services by `fastpath apply` and by SIGHUP:
//! hooks are attached and detached live, only the difference is applied, the API's changes
//! survive a reload of an unchanged file and a restart, and a file that changed wins.

use std::time::Duration;

use fastpath::testkit::netns::{
    Daemon, DaemonConfig, LbTopology, TempDir, prepare_test, test_lb_topology, unique_pin_dir,
};

use crate::bin;

/// `interface -o json`: interface name → its hooks.
fn hooks(daemon: &Daemon) -> Vec<(String, Vec<String>)> {
    let json: serde_json::Value =
        serde_json::from_str(&daemon.cli_ok(&["interface", "-o", "json"])).expect("JSON");
    json.as_array()
        .expect("a list")
        .iter()
        .map(|i| {
            (
                i["name"].as_str().unwrap_or("").to_string(),
                i["hooks"]
                    .as_array()
                    .expect("hooks")
                    .iter()
                    .map(|h| h.as_str().unwrap_or("").to_string())
                    .collect(),
            )
        })
        .collect()
}

/// The services the daemon reports, as `VIP:PORT/PROTO` strings.
fn services(daemon: &Daemon) -> Vec<String> {
    let rows: serde_json::Value =
        serde_json::from_str(&daemon.cli_ok(&["service", "list", "-o", "json"])).expect("JSON");
    let mut out: Vec<String> = rows
        .as_array()
        .expect("a list")
        .iter()
        .map(|r| {
            format!(
                "{}:{}/{}",
                r["vip"].as_str().unwrap_or(""),
                r["port"],
                r["protocol"].as_str().unwrap_or("")
            )
        })
        .collect();
    out.sort();
    out
}

fn sighup(daemon: &Daemon) {
    let pid = daemon.pid().expect("daemon running") as libc::pid_t;
    // SAFETY: a signal to our own child process.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGHUP) }, 0);
}

/// Waits until `pred` holds for the daemon (a reload is asynchronous to the signal).
fn wait_for(daemon: &Daemon, what: &str, pred: impl Fn(&Daemon) -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !pred(daemon) {
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: not reached within 10 s; log:\n{}",
            daemon.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

const SVC_C: &str = "[[service]]\nvip = \"10.200.0.102\"\nport = 80\n[[service.backend]]\naddress = \"10.200.1.2\"\nport = 80\n";
const SVC_A: &str = "[[service]]\nvip = \"10.200.0.100\"\nport = 80\n[[service.backend]]\naddress = \"10.200.1.2\"\nport = 80\n";

#[test]
fn interfaces_and_services_change_live_by_apply_and_sighup() {
    prepare_test(&[]);
    let dir = TempDir::new("api-reload").expect("temp dir");
    let lb = test_lb_topology(1);
    let pin = unique_pin_dir("api-reload");
    let cl = LbTopology::FP_CLIENT_IF;
    let be = LbTopology::fp_backend_if(0);
    let only_cl = DaemonConfig::new(&pin).interface(cl).services(SVC_A);
    let both = lb.fp_config(&pin).services(SVC_A);
    let mut daemon = Daemon::start(bin(), lb.fp(), &only_cl);
    assert!(
        !lb.fp().xdp_attached(&be).expect("ip link"),
        "be0 not configured yet"
    );

    // apply: a file that names the backend interface too attaches it, live.
    let file = dir.join("both.toml");
    std::fs::write(&file, both.to_toml()).expect("writing");
    let dry = daemon.cli_ok(&["apply", "-f", file.to_str().unwrap(), "--dry-run"]);
    assert!(dry.contains("dry run"), "{dry}");
    assert!(
        !lb.fp().xdp_attached(&be).expect("ip link"),
        "a dry run attaches nothing"
    );
    let out = daemon.cli_ok(&["apply", "-f", file.to_str().unwrap()]);
    assert!(out.contains("interfaces now"), "{out}");
    assert!(
        lb.fp().xdp_attached(&be).expect("ip link"),
        "apply attached be0"
    );
    let h = hooks(&daemon);
    let be_hooks = h.iter().find(|(n, _)| *n == be).map(|(_, h)| h.clone());
    assert_eq!(
        be_hooks.map(|h| h.len()),
        Some(3),
        "be0 has xdp, tc_ingress and tc_egress: {h:?}"
    );

    // A file naming an interface that does not exist: refused, exit 4, nothing changes.
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, both.clone().interface("nosuch0").to_toml()).expect("writing");
    let out = daemon.cli(&["apply", "-f", bad.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{err}");
    assert!(err.contains("nosuch0") && err.contains("ip link"), "{err}");
    assert_eq!(hooks(&daemon), h, "a refused apply changes no hook");

    // An API change, then the config file edited: on SIGHUP the edited file wins — it
    // becomes the desired state (be0 detached, the API's service gone, its own new one there).
    daemon.cli_ok(&["service", "add", "10.200.0.101:443", "-b", "10.200.1.2:443"]);
    let edited = only_cl.clone().services(SVC_C);
    std::fs::write(daemon.config_path(), edited.to_toml()).expect("rewriting the config");
    sighup(&daemon);
    wait_for(&daemon, "be0 detached by the reload", |_| {
        !lb.fp().xdp_attached(&be).unwrap_or(true)
    });
    assert_eq!(
        services(&daemon),
        vec!["10.200.0.100:80/tcp", "10.200.0.102:80/tcp"]
    );

    // The API's change on top of this file survives a reload of the same file and a restart.
    daemon.cli_ok(&["service", "add", "10.200.0.101:443", "-b", "10.200.1.2:443"]);
    sighup(&daemon);
    wait_for(&daemon, "the reload of an unchanged file logged", |d| {
        d.log().contains("the config file is unchanged")
    });
    let want = vec![
        "10.200.0.100:80/tcp",
        "10.200.0.101:443/tcp",
        "10.200.0.102:80/tcp",
    ];
    assert_eq!(services(&daemon), want);
    let status = daemon.stop();
    assert!(status.success());
    daemon.restart();
    assert_eq!(
        services(&daemon),
        want,
        "a restart restores the API's change"
    );
    assert!(
        daemon
            .log()
            .contains("Restored the changes made through the API"),
        "{}",
        daemon.log()
    );

    // Clients that keep a stream open (`ct watch`, `stats --watch`) do not hold a stop: the
    // daemon exits within its grace period and detaches.
    let watchers: Vec<std::process::Child> = [
        vec!["ct", "watch"],
        vec!["stats", "--watch", "0.2"],
        vec!["health", "--watch"],
    ]
    .iter()
    .map(|args| {
        std::process::Command::new(bin())
            .arg("--socket")
            .arg(daemon.socket())
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("a watching client")
    })
    .collect();
    std::thread::sleep(Duration::from_millis(500));
    let t = std::time::Instant::now();
    let status = daemon.stop();
    assert!(status.success(), "stop with watchers: {status}");
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "the stop took {:?} with watching clients",
        t.elapsed()
    );
    assert!(
        !lb.fp().xdp_attached(cl).expect("ip link"),
        "a clean stop detaches even with clients connected; log:\n{}",
        daemon.log()
    );
    for mut w in watchers {
        let _ = w.kill();
        let _ = w.wait();
    }
    daemon.restart();
    assert_eq!(services(&daemon), want);

    // A bad file on SIGHUP: logged, nothing changes, the daemon keeps running.
    std::fs::write(
        daemon.config_path(),
        "[[interface]]\nname = \"cl0\"\nxdpp = 1\n",
    )
    .expect("rewriting the config");
    sighup(&daemon);
    wait_for(&daemon, "the refused reload logged", |d| {
        d.log().contains("Reload refused")
    });
    assert!(daemon.is_running(), "a bad file must not stop the daemon");
    assert_eq!(services(&daemon), want);
}
