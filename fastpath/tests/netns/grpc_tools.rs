//! End to end: the management API with gRPC clients this project did not write — PyPI's
//! `grpcio` (channels made with its defaults), `grpcio-reflection` and
//! `grpcio-health-checking`, stubs compiled at test time by `grpcio-tools` from
//! fastpath/proto — against a daemon running in the `fp` node of [`test_lb_topology`].
//!
//! Over the Unix socket: GetInfo; a WatchHealth stream opened before a CreateServices and the
//! event that change causes (its health check finds nothing listening on the backend); a
//! change at the current generation (accepted) and one at a stale generation
//! (FAILED_PRECONDITION, nothing changed); server reflection v1alpha and v1 listing the
//! services; grpc.health.v1 SERVING for "" and `fastpath.v1.Fastpath`. Over the TCP listener:
//! reflection and health again. Then a health Watch sees NOT_SERVING when the daemon stops.
//!
//! The Python client is fastpath/tests/grpc_tools/client.py, run by the venv `.tools/py` that
//! `cargo xtask bootstrap` makes (pinned PyPI packages). Root only (never skipped: without root
//! or without the venv it fails, saying what to run). Debian packages: iproute2, python3.

use std::{
    path::{Path, PathBuf},
    process::Output,
    thread,
    time::{Duration, Instant},
};

use fastpath::testkit::netns::{
    Daemon, LbTopology, Spawned, prepare_test, test_lb_topology, unique_pin_dir,
};
use serde_json::{Value, json};

use crate::bin;

const VIP: &str = "10.200.0.100";
/// The daemon's plain TCP API listener, inside fp.
const TCP_PORT: u16 = 50_151;
const SERVICE: &str = "fastpath.v1.Fastpath";
const HEALTH: &str = "grpc.health.v1.Health";

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap_or_else(|| panic!("{} has no parent", env!("CARGO_MANIFEST_DIR")))
        .to_path_buf()
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/grpc_tools/client.py")
}

/// The Python of the venv `.tools/py` with the gRPC packages importable; panics saying to
/// run `cargo xtask bootstrap` when it is not there.
fn venv_python() -> PathBuf {
    let python = workspace().join(".tools/py/bin/python");
    let modules = "import grpc, grpc_tools.protoc, grpc_reflection.v1alpha, grpc_health.v1";
    let checked = std::process::Command::new(&python)
        .args(["-c", modules])
        .output();
    match checked {
        Ok(out) if out.status.success() => python,
        Ok(out) => panic!(
            "{} cannot import the gRPC packages ({}); run `cargo xtask bootstrap` to install them",
            python.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        ),
        Err(e) => panic!(
            "{}: {e}; run `cargo xtask bootstrap` to create the venv with the gRPC tools",
            python.display()
        ),
    }
}

fn text(out: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Runs the session of client.py inside fp; its JSON report.
fn session(lb: &LbTopology, python: &Path, daemon: &Daemon, backend: &str) -> Value {
    let socket = daemon.socket();
    let proto = Path::new(env!("CARGO_MANIFEST_DIR")).join("proto");
    let tcp = format!("127.0.0.1:{TCP_PORT}");
    let script = script();
    let args = [
        python.as_os_str(),
        script.as_os_str(),
        "session".as_ref(),
        proto.as_os_str(),
        socket.as_os_str(),
        tcp.as_ref(),
        backend.as_ref(),
        "80".as_ref(),
        VIP.as_ref(),
    ];
    let out = lb
        .fp()
        .exec_timeout(&args, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
    assert!(
        out.status.success(),
        "client.py session failed: {}",
        text(&out)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("client.py session printed no JSON ({e}): {}", text(&out)))
}

/// The services a reflection listing must name: the API, health, and that reflection itself.
fn listed(reflection: &str) -> Value {
    let mut v = vec![SERVICE, HEALTH, reflection];
    v.sort_unstable();
    json!(v)
}

fn check_reflection_and_health(seen: &Value, listener: &str) {
    assert_eq!(
        seen["reflection_v1alpha"],
        listed("grpc.reflection.v1alpha.ServerReflection"),
        "{listener}: services listed by reflection v1alpha (grpcio-reflection's client)"
    );
    assert_eq!(
        seen["reflection_v1"],
        listed("grpc.reflection.v1.ServerReflection"),
        "{listener}: services listed by reflection v1"
    );
    assert_eq!(
        seen["health"],
        json!({"": "SERVING", SERVICE: "SERVING"}),
        "{listener}: grpc.health.v1 Check while the daemon runs"
    );
}

#[test]
fn stock_grpc_clients_use_the_api() {
    prepare_test(&[]);
    let python = venv_python();
    let lb = test_lb_topology(1);
    let pin = unique_pin_dir("grpctools");
    let config = lb.fp_config(&pin).raw(&format!(
        "[api]\nlisten = \"127.0.0.1:{TCP_PORT}\"\nallow_insecure_tcp = true\n"
    ));
    let mut daemon = Daemon::start(bin(), lb.fp(), &config);
    // No server runs on the backend: the health check of the service created below fails, and
    // that change of state is the event the watch must deliver.
    let backend = LbTopology::backend_v4(0).to_string();

    let started = Instant::now();
    let seen = session(&lb, &python, &daemon, &backend);
    eprintln!(
        "client.py session took {:.1} s: {seen}",
        started.elapsed().as_secs_f64()
    );

    let pid = daemon.pid().expect("the daemon runs");
    assert_eq!(
        (
            seen["info"]["api_version"].clone(),
            seen["info"]["pid"].clone()
        ),
        (json!("fastpath.v1"), json!(pid)),
        "GetInfo over the Unix socket with grpcio's default channel: {}",
        seen["info"]
    );
    let g0 = seen["info"]["generation"]
        .as_u64()
        .unwrap_or_else(|| panic!("GetInfo: no generation: {}", seen["info"]));
    assert_eq!(
        seen["create"],
        json!({"ok": true, "generation": g0 + 1, "created": [format!("{VIP}:80/tcp")]}),
        "CreateServices at the current generation"
    );
    let events = seen["watch_events"]
        .as_array()
        .unwrap_or_else(|| panic!("watch_events: {}", seen["watch_events"]));
    let first = events
        .first()
        .unwrap_or_else(|| panic!("WatchHealth delivered no event within 10 s of the change"));
    assert_eq!(
        (
            &first["vip"],
            &first["port"],
            &first["address"],
            &first["backend_port"],
            &first["up"]
        ),
        (
            &json!(VIP),
            &json!(80),
            &json!(backend),
            &json!(80),
            &json!(false)
        ),
        "WatchHealth event caused by the change (backend down: nothing listens): {first}"
    );
    assert_eq!(
        seen["create_current"],
        json!({"ok": true, "generation": g0 + 2, "created": [format!("{VIP}:81/tcp")]}),
        "CreateServices with expected_generation equal to the current one"
    );
    assert_eq!(
        seen["stale_create"]["code"], "FAILED_PRECONDITION",
        "CreateServices with a stale expected_generation: {}",
        seen["stale_create"]
    );
    let details = seen["stale_create"]["details"].as_str().unwrap_or_default();
    assert!(
        details.contains(&format!("generation {}", g0 + 2)) && details.contains("retry"),
        "the refusal names the current generation and says what to do: {details}"
    );
    assert_eq!(
        seen["generation_after"],
        json!(g0 + 2),
        "the refused change must not move the generation"
    );
    check_reflection_and_health(&seen["unix"], "unix socket");
    check_reflection_and_health(&seen["tcp"], "TCP listener");

    // A health watcher sees the daemon go: NOT_SERVING before its connection closes.
    let socket = daemon.socket();
    let script = script();
    let watch_args = [
        python.as_os_str(),
        script.as_os_str(),
        "watch-health".as_ref(),
        socket.as_os_str(),
    ];
    let watcher = lb
        .fp()
        .spawn(&watch_args)
        .unwrap_or_else(|e| panic!("spawning client.py watch-health: {e}"));
    wait_for(&watcher, "SERVING");
    let status = daemon.stop();
    assert!(status.success(), "daemon exit after SIGTERM: {status}");
    let log = wait_for(&watcher, "END");
    let statuses: Vec<&str> = log.lines().collect();
    assert_eq!(
        statuses.first().copied(),
        Some("SERVING"),
        "health Watch while running, then through the stop: {log}"
    );
    assert!(
        statuses.contains(&"NOT_SERVING"),
        "health Watch must see NOT_SERVING when the daemon stops; it saw:\n{log}"
    );
}

/// Polls `p`'s output until it has a line starting with `prefix` (10 s at most); the output.
fn wait_for(p: &Spawned, prefix: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let log = p.log();
        if log.lines().any(|line| line.starts_with(prefix)) {
            return log;
        }
        assert!(
            Instant::now() < deadline,
            "`{}`: no line starting with {prefix:?} within 10 s; its output:\n{log}",
            p.command()
        );
        thread::sleep(Duration::from_millis(50));
    }
}
