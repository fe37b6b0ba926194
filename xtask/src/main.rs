//! `cargo xtask`: the project's one entry point for setting up a machine and running things.
//!
//! It builds with the machine's default stable Rust (it has no dependencies beyond anyhow), then
//! installs — idempotently, quickly the second time — what everything else needs: the pinned
//! userspace and eBPF toolchains, bpf-linker built against the eBPF nightly's LLVM (into
//! `.tools/`), and the Debian packages the tests and demo use. Every other command bootstraps
//! first, then drives `cargo +<pinned>`.

mod modules;
mod vm;

use std::{
    env,
    ffi::OsString,
    fs,
    path::{Path, PathBuf},
    process::{Command, ExitStatus},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

/// The userspace toolchain's pin, the one source (plain `cargo` in the tree reads it too).
const USER_TOOLCHAIN_FILE: &str = include_str!("../../rust-toolchain.toml");
/// The eBPF toolchain's pin, the one source (fastpath/build.rs reads it too).
const EBPF_TOOLCHAIN_FILE: &str = include_str!("../../fastpath-ebpf/rust-toolchain.toml");
const BPF_LINKER_VERSION: &str = "0.13.0";
/// PyPI packages of `.tools/py`, the venv whose stock gRPC clients (grpcio with reflection
/// and health checking, grpcio-tools to compile the protos) drive the API in the tests.
const PYTHON_PACKAGES: &[&str] = &[
    "grpcio==1.85.1",
    "grpcio-tools==1.85.1",
    "grpcio-reflection==1.85.1",
    "grpcio-health-checking==1.85.1",
    "protobuf==7.36.2",
];
/// Debian packages used by the tests, the demo and the benchmarks.
const DEBIAN_PACKAGES: &[&str] = &[
    "iproute2",
    "iputils-ping",
    "socat",
    "netcat-openbsd",
    "curl",
    "iperf3",
    "nginx-light",
    "ethtool",
    "bpftool",
    "tcpdump",
    "conntrack",
    "nftables",
    "hping3",
    // The gateway test's echo server and clients; the venv of `python_tools`.
    "python3",
    "python3-venv",
    // The load-balancer comparison of `bench`: its load generator and competitors.
    "wrk",
    "haproxy",
    "iptables",
    // The HA failover test: VRRP moves the VIP between the two fastpath nodes.
    "keepalived",
    // The announcement test: BIRD on the nodes, FRR as their router (BGP, BFD, ECMP).
    "bird2",
    "frr",
];

const USAGE: &str = "\
cargo xtask <command>

commands:
  demo        bootstrap, build, and run the namespace demo (client, fast-path node, 3 backends;
              then a two-node VXLAN overlay)
  test        bootstrap, check formatting, clippy and the docs (warnings denied), run every
              test (unit, datapath fixtures, namespaces)
  bench       bootstrap, build, run every benchmark section (BPF_PROG_TEST_RUN ns/packet,
              conntrack, updates, API, the comparisons with the kernel, iptables, nftables,
              HAProxy in namespaces, HA replication), each comparison side by side in one
              run; writes docs/bench/*.json, the plots docs/bench/*.svg and the generated
              tables of docs/BENCHMARKS.md (its hand-written prose is kept).
              `bench -- quick`: the per-packet paths and a short load-balancer comparison;
              `bench -- SECTION`: one section, the others' committed results kept;
              `--old-rev REV` (or `--old-object PATH`, an object built with fastpath-ebpf's
              `bench` feature): also the parse-only paths of REV's eBPF object, interleaved
              with this tree's in the same rounds;
              `bench -- lb --katran-object PATH`: also Katran's XDP load balancer (an
              object built from its source, see docs/BENCHMARKS.md) beside the LB rows;
              `bench -- --render`: tables and plots from the committed JSON alone;
              `bench -- --help` lists the sections
  build       bootstrap and build the release binary target/release/fastpath
  bootstrap   only install toolchains, bpf-linker and Debian packages (idempotent)
  lint        cargo fmt --check, no import cycle among the eBPF crate's modules, and clippy
              with warnings denied
  modules     list which of the eBPF crate's modules each one imports (and any cycle)
  vm          `vm <6.1|6.12|5.10> [--] CMD...`: CMD as root on Debian's kernel under qemu; `vm --help`

Everything that needs the kernel (demo, test, bench) must run as root.";

fn main() {
    let args: Vec<String> = env::args().skip(1).collect();
    let started = Instant::now();
    let result = match args.first().map(String::as_str) {
        Some("bootstrap") => bootstrap(Packages::Install),
        Some("build") => bootstrap(Packages::Skip).and_then(|()| build()),
        Some("test") => bootstrap(Packages::Install).and_then(|()| test(&args[1..])),
        Some("demo") => bootstrap(Packages::Install).and_then(|()| demo(&args[1..])),
        Some("bench") => bootstrap(Packages::Install).and_then(|()| bench(&args[1..])),
        Some("lint") => bootstrap(Packages::Skip).and_then(|()| lint()),
        Some("modules") => ebpf_modules(true),
        Some("vm") => vm::main(&args[1..]),
        Some("-h" | "--help" | "help") | None => {
            println!("{USAGE}");
            return;
        }
        Some(other) => {
            eprintln!("xtask: unknown command {other:?}\n\n{USAGE}");
            std::process::exit(2);
        }
    };
    match result {
        Ok(()) => eprintln!("xtask: done in {:.1} s", started.elapsed().as_secs_f64()),
        Err(e) => {
            eprintln!("xtask: error: {e:#}");
            std::process::exit(1);
        }
    }
}

fn root_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

fn tools_dir() -> PathBuf {
    root_dir().join(".tools")
}

/// PATH with `.tools/bin` first, so aya-build finds bpf-linker.
fn tool_path() -> OsString {
    let mut paths = vec![tools_dir().join("bin")];
    if let Some(p) = env::var_os("PATH") {
        paths.extend(env::split_paths(&p));
    }
    env::join_paths(paths).unwrap_or_default()
}

/// A command with the environment cleaned of what the outer (default-toolchain) cargo set.
fn cmd(program: &str) -> Command {
    let mut c = Command::new(program);
    for var in [
        "RUSTUP_TOOLCHAIN",
        "RUSTC",
        "RUSTDOC",
        "CARGO",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "CARGO_TARGET_DIR",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_BUILD_RUSTC",
        "CARGO_BUILD_RUSTC_WRAPPER",
        // The outer `cargo run` points this at the default toolchain's libraries.
        "LD_LIBRARY_PATH",
    ] {
        c.env_remove(var);
    }
    c.env("PATH", tool_path()).current_dir(root_dir());
    c
}

/// `cargo +<pinned userspace toolchain> args...`
fn cargo(args: &[&str]) -> Command {
    let mut c = cmd("cargo");
    c.arg(format!("+{}", Pin::user().channel)).args(args);
    c
}

fn run(c: &mut Command) -> Result<()> {
    let status: ExitStatus = c.status().with_context(|| format!("starting {c:?}"))?;
    if !status.success() {
        bail!("{c:?} failed with {status}");
    }
    Ok(())
}

fn output(c: &mut Command) -> Result<String> {
    let out = c.output().with_context(|| format!("starting {c:?}"))?;
    if !out.status.success() {
        bail!(
            "{c:?} failed with {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn is_root() -> bool {
    output(Command::new("id").arg("-u"))
        .map(|s| s.trim() == "0")
        .unwrap_or(false)
}

fn require_root(what: &str) -> Result<()> {
    if !is_root() {
        bail!(
            "{what} loads eBPF programs and creates network namespaces: run it as root (e.g. `sudo env PATH=\"$PATH\" cargo xtask {what}`)"
        );
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// bootstrap

/// Whether a command needs the Debian packages (tests, demo and bench run real programs).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Packages {
    Install,
    Skip,
}

fn bootstrap(packages: Packages) -> Result<()> {
    let t = Instant::now();
    if packages == Packages::Install {
        debian_packages(DEBIAN_PACKAGES)?;
        python_tools()?;
    }
    toolchains()?;
    bpf_linker()?;
    eprintln!("xtask: bootstrap ok in {:.1} s", t.elapsed().as_secs_f64());
    Ok(())
}

/// Installs those of `packages` that are missing (as root; otherwise says how).
fn debian_packages(packages: &[&str]) -> Result<()> {
    let missing: Vec<&str> = packages
        .iter()
        .copied()
        .filter(|p| {
            Command::new("dpkg-query")
                .args(["-W", "-f=${Status}", p])
                .output()
                .map(|o| !String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
                .unwrap_or(true)
        })
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    if !is_root() {
        bail!(
            "Debian packages missing: {}; install them with `sudo apt-get install {}` or run as root",
            missing.join(" "),
            missing.join(" ")
        );
    }
    eprintln!("xtask: installing Debian packages: {}", missing.join(" "));
    // Wait for a dpkg lock held by a boot-time apt job instead of failing at once.
    let lock_wait = ["-o", "DPkg::Lock::Timeout=300"];
    run(Command::new("apt-get")
        .env("DEBIAN_FRONTEND", "noninteractive")
        .args(lock_wait)
        .args(["update", "-qq"]))?;
    run(Command::new("apt-get")
        .env("DEBIAN_FRONTEND", "noninteractive")
        .args(lock_wait)
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(&missing))
}

/// The venv `.tools/py` with [`PYTHON_PACKAGES`]; its stamp lists what was installed, so a
/// second run with the same pins does nothing and changed pins reinstall.
fn python_tools() -> Result<()> {
    let venv = tools_dir().join("py");
    let stamp = venv.join("fastpath-packages.txt");
    let want = PYTHON_PACKAGES.join("\n") + "\n";
    let python = venv.join("bin").join("python");
    if python.exists() && fs::read_to_string(&stamp).ok().as_deref() == Some(want.as_str()) {
        return Ok(());
    }
    eprintln!(
        "xtask: creating the venv {} with {}",
        venv.display(),
        PYTHON_PACKAGES.join(" ")
    );
    run(cmd("python3").args(["-m", "venv", "--clear"]).arg(&venv)).context(
        "creating the Python venv for the gRPC tool tests; install python3 with its venv module (`apt-get install python3-venv`)",
    )?;
    run(Command::new(&python)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
        ])
        .args(PYTHON_PACKAGES))
    .context("installing the gRPC tools from PyPI into .tools/py")?;
    fs::write(&stamp, want).context("writing the Python tools stamp")?;
    Ok(())
}

fn installed_toolchains() -> Result<String> {
    output(cmd("rustup").args(["toolchain", "list"]))
}

/// A pinned toolchain, as its `rust-toolchain.toml` states it.
struct Pin {
    channel: &'static str,
    components: Vec<&'static str>,
}

impl Pin {
    fn user() -> Pin {
        Pin::parse(USER_TOOLCHAIN_FILE)
    }

    fn ebpf() -> Pin {
        Pin::parse(EBPF_TOOLCHAIN_FILE)
    }

    /// Reads `channel = "..."` and `components = ["...", ...]`, each on one line: the two files
    /// are ours, and `toolchain_files_state_a_channel` keeps them parseable.
    fn parse(text: &'static str) -> Pin {
        let value = |key: &str| {
            text.lines()
                .filter_map(|l| l.split_once('='))
                .find(|(k, _)| k.trim() == key)
                .map(|(_, v)| v.trim())
                .unwrap_or_default()
        };
        let strings =
            |v: &'static str| -> Vec<&'static str> { v.split('"').skip(1).step_by(2).collect() };
        Pin {
            channel: strings(value("channel"))
                .first()
                .copied()
                .unwrap_or_default(),
            components: strings(value("components")),
        }
    }
}

fn toolchains() -> Result<()> {
    for pin in [Pin::user(), Pin::ebpf()] {
        ensure_toolchain(pin.channel, &pin.components)?;
    }
    Ok(())
}

/// Installs `toolchain` with `components`, or adds the components it lacks.
fn ensure_toolchain(toolchain: &str, components: &[&str]) -> Result<()> {
    let installed = installed_toolchains()?
        .lines()
        .any(|l| l.starts_with(&format!("{toolchain}-")));
    if !installed {
        eprintln!(
            "xtask: installing Rust {toolchain} with {}",
            components.join(", ")
        );
        return run(cmd("rustup")
            .args(["toolchain", "install", toolchain, "--profile", "minimal"])
            .arg("-c")
            .arg(components.join(",")));
    }
    let have =
        output(cmd("rustup").args(["component", "list", "--installed", "--toolchain", toolchain]))?;
    let missing: Vec<&str> = components
        .iter()
        .copied()
        .filter(|c| {
            !have
                .lines()
                .any(|l| l == *c || l.starts_with(&format!("{c}-")))
        })
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("xtask: adding {} to Rust {toolchain}", missing.join(", "));
    run(cmd("rustup")
        .args(["component", "add", "--toolchain", toolchain])
        .args(&missing))
}

/// bpf-linker built against the eBPF nightly's own libLLVM, so no system LLVM is needed. The
/// stamp records which nightly it was built for; a changed nightly rebuilds it.
fn bpf_linker() -> Result<()> {
    let stamp = tools_dir().join("bpf-linker.stamp");
    let ebpf = Pin::ebpf().channel;
    let want = format!("bpf-linker {BPF_LINKER_VERSION} for {ebpf}\n");
    let bin = tools_dir().join("bin").join("bpf-linker");
    if bin.exists() && fs::read_to_string(&stamp).ok().as_deref() == Some(want.as_str()) {
        return Ok(());
    }
    let sysroot = output(
        cmd("rustc")
            .arg(format!("+{ebpf}"))
            .args(["--print", "sysroot"]),
    )?;
    let libdir = PathBuf::from(sysroot.trim()).join("lib");
    let llvm = fs::read_dir(&libdir)
        .with_context(|| format!("reading {}", libdir.display()))?
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .find(|n| n.starts_with("libLLVM-") && n.ends_with(".so"))
        .with_context(|| format!("no libLLVM-*.so in {}", libdir.display()))?;
    let llvm = llvm
        .trim_start_matches("lib")
        .trim_end_matches(".so")
        .to_string();
    let major = llvm
        .trim_start_matches("LLVM-")
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .filter(|m| !m.is_empty())
        .with_context(|| format!("cannot read the LLVM major version from {llvm}"))?
        .to_string();
    eprintln!("xtask: building bpf-linker {BPF_LINKER_VERSION} against {llvm} (about a minute)");
    let rustflags = format!(
        "-L {0} -l dylib={llvm} -C link-arg=-Wl,-rpath,{0}",
        libdir.display()
    );
    run(cargo(&[
        "install",
        "bpf-linker",
        "--version",
        BPF_LINKER_VERSION,
        "--locked",
        "--force",
        "--no-default-features",
        "--features",
        &format!("llvm-{major},no-llvm-linking"),
        "--root",
    ])
    .arg(tools_dir())
    .env("RUSTFLAGS", rustflags))?;
    fs::write(&stamp, want).context("writing the bpf-linker stamp")?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// commands

fn build() -> Result<()> {
    run(&mut cargo(&[
        "build",
        "--release",
        "-p",
        "fastpath",
        "--bins",
    ]))
}

fn test(extra: &[String]) -> Result<()> {
    require_root("test")?;
    step("rustfmt --check");
    run(&mut cargo(&["fmt", "--all", "--check"]))
        .context("code is not formatted: run `cargo fmt --all`")?;
    step("clippy, userspace crates, every target, -D warnings");
    clippy().context("clippy found something: run `cargo xtask lint` and fix what it says")?;
    step("clippy, eBPF crate for bpfel-unknown-none, -D warnings");
    clippy_ebpf().context("clippy found something: run `cargo xtask lint` and fix what it says")?;
    step("rustdoc, -D warnings");
    docs().context("the docs do not build without warnings: run `RUSTDOCFLAGS=\"-D warnings\" cargo doc --no-deps`")?;
    step("unit tests as an unprivileged user");
    unit_tests_unprivileged().context(
        "a unit test fails without root: it must not need the kernel (move it to a \
         `kernel_tests` module only if it tests the real datapath)",
    )?;
    step("every test as root: unit, fixtures (BPF_PROG_TEST_RUN), namespaces");
    // One thread: the datapath and namespace tests share kernel state (bpffs, interfaces).
    run(cargo(&["test", "--release", "--no-fail-fast"])
        .arg("--")
        .arg("--test-threads=1")
        .args(extra))?;
    kernel_matrix()?;
    step("the examples' unit tests");
    // The examples' own unit tests (the benchmark's parsers and readers): a plain
    // `cargo test` builds the examples but does not run their tests.
    run(
        cargo(&["test", "--release", "-p", "fastpath", "--examples"])
            .arg("--")
            .args(extra),
    )
}

/// Kernels the test command also runs the datapath on, under qemu (`cargo xtask vm`): Debian
/// 12's own 6.1 and its backported 6.12.
const KERNEL_MATRIX: &[&str] = &["6.1", "6.12"];
/// Longest a kernel's step may run under emulation (the fixtures take about 12 minutes).
const KERNEL_STEP_TIMEOUT: Duration = Duration::from_secs(40 * 60);
/// Guest memory for the matrix: the fixtures load two datapaths at once (the HA wire-format
/// pair), whose tables did not fit in the subcommand's default 1024 MB.
const KERNEL_MATRIX_MEM_MB: u32 = 4096;
/// Fixtures not run under emulation: they expect packets to follow each other within a
/// lifetime of cached state, and emulated packets (and the `ip` commands between them) come
/// farther apart than that. A flow-cache copy serves within its lease (2^28 ns, 268 ms): on
/// 6.12, "client packet 2 served from the copy" failed, every other step passed; on 6.1 (in
/// CI), "served" right after the handshake. A route-cache answer holds for a second: on 6.1,
/// under the load of two other guests, the step "within the generation and the second"
/// failed. They run on the host's kernel with the rest.
const EMULATION_SKIPS: &[&str] = &[
    "flowcache::steady_packets_are_served_from_the_flow_cache_byte_exact_and_counted_exactly",
    "flowcache::the_express_path_does_what_the_pipeline_did_and_leaves_it_what_it_would_treat_otherwise",
    "flowcache::a_copy_serves_for_one_lease_then_folds_its_counts_into_the_table",
    "route::route_cache_hits_until_a_new_generation_or_a_second",
];

/// The namespace tests run on each kernel of the matrix: the smoke test (the daemon on veths,
/// TCP and UDP through VIPs balanced at XDP and at TC ingress, kill -9, a start, a clean stop).
const MATRIX_NETNS_TESTS: &str = "smoke::";
/// `FASTPATH_TEST_SLOWDOWN` for the namespace tests under emulation: a daemon start verifies
/// every program, tens of seconds on 6.1 under qemu against a fraction of one on the host.
const MATRIX_SLOWDOWN: &str = "15";

/// On each kernel of [`KERNEL_MATRIX`]: `fastpath kernel` (every program through that kernel's
/// verifier, with its instruction counts), the datapath fixtures (BPF_PROG_TEST_RUN) and the
/// namespace smoke test ([`MATRIX_NETNS_TESTS`]).
fn kernel_matrix() -> Result<()> {
    run(&mut cargo(&[
        "build",
        "--release",
        "-p",
        "fastpath",
        "--bin",
        "fastpath",
    ]))?;
    let fixtures = test_executables(&mut cargo(&[
        "test",
        "--release",
        "-p",
        "fastpath",
        "--test",
        "fixtures",
        "--no-run",
        "--message-format=json",
    ]))?;
    let netns = test_executables(&mut cargo(&[
        "test",
        "--release",
        "-p",
        "fastpath",
        "--test",
        "netns",
        "--no-run",
        "--message-format=json",
    ]))?;
    let root = root_dir();
    let fastpath = root.join("target/release/fastpath");
    let mut steps = vec![vec![path_arg(&fastpath)?, "kernel".to_owned()]];
    for exe in &fixtures {
        let mut command = vec![path_arg(exe)?, "--test-threads=1".to_owned()];
        for skip in EMULATION_SKIPS {
            command.extend(["--skip".to_owned(), (*skip).to_owned()]);
        }
        steps.push(command);
    }
    for exe in &netns {
        steps.push(vec![
            "env".to_owned(),
            format!("FASTPATH_TEST_SLOWDOWN={MATRIX_SLOWDOWN}"),
            path_arg(exe)?,
            "--test-threads=1".to_owned(),
            // Their summary lines (the traffic each carried) are the step's evidence.
            "--nocapture".to_owned(),
            MATRIX_NETNS_TESTS.to_owned(),
        ]);
    }
    for series in KERNEL_MATRIX {
        step(&format!(
            "Linux {series} under qemu (emulated): every program through its verifier, the fixtures, the namespace smoke test"
        ));
        let t = Instant::now();
        for command in &steps {
            // The fixtures' package directory, as `cargo test` runs them.
            let code = vm::run_in(
                series,
                KERNEL_STEP_TIMEOUT,
                KERNEL_MATRIX_MEM_MB,
                &root.join("fastpath"),
                command,
            )?;
            if code != 0 {
                bail!(
                    "on Linux {series} (qemu): `{}` exited with {code}",
                    command.join(" ")
                );
            }
        }
        eprintln!(
            "xtask: Linux {series}: passed in {:.1} s",
            t.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

fn path_arg(path: &Path) -> Result<String> {
    Ok(path
        .to_str()
        .with_context(|| format!("{} is not UTF-8", path.display()))?
        .to_owned())
}

/// Whether a `compiler-artifact` message's profile is a test build (its target's own `"test"`
/// says only whether the target has tests).
fn test_profile(message: &str) -> bool {
    message.find("\"profile\":{").is_some_and(|at| {
        let profile = &message[at..];
        profile[..profile.find('}').unwrap_or(profile.len())].contains("\"test\":true")
    })
}

/// The test executables `cargo ... --no-run --message-format=json` built (test profile only:
/// an integration test's build also lists the binaries it runs).
fn test_executables(command: &mut Command) -> Result<Vec<PathBuf>> {
    let json = output(command)?;
    let exes: Vec<PathBuf> = json
        .lines()
        .filter(|l| l.contains("\"reason\":\"compiler-artifact\"") && test_profile(l))
        .filter_map(|l| {
            let rest = &l[l.find("\"executable\":\"")? + "\"executable\":\"".len()..];
            Some(PathBuf::from(&rest[..rest.find('"')?]))
        })
        .collect();
    if exes.is_empty() {
        bail!("cargo listed no test executables");
    }
    Ok(exes)
}

/// Names the step that starts, so a CI log shows what ran even where cargo prints nothing.
fn step(what: &str) {
    eprintln!("xtask: == {what}");
}

fn demo(extra: &[String]) -> Result<()> {
    require_root("demo")?;
    // The demo runs target/release/fastpath, so build the binary too.
    run_example("demo", &["--bins"], extra)
}

fn bench(extra: &[String]) -> Result<()> {
    if !extra.iter().any(|a| a == "--render" || a == "--help") {
        require_root("bench")?;
    }
    // `--old-rev REV`: build REV's eBPF object and hand it to the bench as `--old-object`.
    let mut args = Vec::new();
    let mut it = extra.iter();
    while let Some(arg) = it.next() {
        if arg == "--old-rev" {
            let rev = it
                .next()
                .context("--old-rev needs a git revision, e.g. `--old-rev main`")?;
            let object = old_object(rev)?;
            args.push("--old-object".to_owned());
            args.push(object.to_str().context("non-UTF-8 path")?.to_owned());
        } else {
            args.push(arg.clone());
        }
    }
    // The load-balancer comparison runs target/release/fastpath, so build the binary too.
    run_example("bench", &["--bins"], &args)
}

/// Builds the eBPF object of git revision `rev` with the benchmark's programs, in a detached
/// worktree under target/bench-old/, as aya-build builds it; returns the object's path.
fn old_object(rev: &str) -> Result<PathBuf> {
    let base = root_dir().join("target/bench-old");
    let src = base.join("src");
    fs::create_dir_all(&base).with_context(|| format!("creating {}", base.display()))?;
    if src.exists() {
        run(cmd("git").args(["worktree", "remove", "--force"]).arg(&src))?;
    }
    run(cmd("git")
        .args(["worktree", "add", "--detach"])
        .arg(&src)
        .arg(rev))?;
    // Trees from before the `bench` feature carry the benchmark's programs unconditionally.
    let manifest = fs::read_to_string(src.join("fastpath-ebpf/Cargo.toml"))
        .with_context(|| format!("reading fastpath-ebpf/Cargo.toml at {rev}"))?;
    let features: &[&str] = if manifest.contains("bench = [") {
        &["--features", "bench"]
    } else {
        &[]
    };
    let target_dir = base.join("target");
    let mut c = cmd("cargo");
    // This tree's eBPF pin: the old tree is built with today's compiler.
    c.arg(format!("+{}", Pin::ebpf().channel))
        .args([
            "build",
            "-p",
            "fastpath-ebpf",
            "--bins",
            "--release",
            "--target",
            "bpfel-unknown-none",
            "-Z",
            "build-std=core",
        ])
        .args(features)
        .arg("--target-dir")
        .arg(&target_dir)
        // As aya-build sets them (fields separated by 0x1f).
        .env(
            "CARGO_ENCODED_RUSTFLAGS",
            format!(
                "--cfg=bpf_target_arch=\"{}\"\x1f-Cdebuginfo=2\x1f-Clink-arg=--btf",
                env::consts::ARCH
            ),
        )
        .current_dir(&src);
    run(&mut c).with_context(|| format!("building the eBPF object of {rev}"))?;
    // Named after the commit, so the report says which object it timed.
    let commit = output(cmd("git").args(["rev-parse", "--short", rev]))?;
    let object = base.join(format!("fastpath-ebpf-{}.o", commit.trim()));
    let built = target_dir.join("bpfel-unknown-none/release/fastpath");
    fs::copy(&built, &object)
        .with_context(|| format!("copying {} to {}", built.display(), object.display()))?;
    // The worktree is registered in the repository: removed once built (its build cache in
    // target/bench-old/target stays for the next revision).
    run(cmd("git").args(["worktree", "remove", "--force"]).arg(&src))?;
    Ok(object)
}

/// Builds the fastpath examples (release) and runs example `name` with `extra` arguments.
fn run_example(name: &str, build_args: &[&str], extra: &[String]) -> Result<()> {
    run(cargo(&["build", "--release", "-p", "fastpath", "--examples"]).args(build_args))?;
    let exe = root_dir().join("target/release/examples").join(name);
    run(cmd(exe.to_str().context("non-UTF-8 path")?).args(extra))
}

fn lint() -> Result<()> {
    run(&mut cargo(&["fmt", "--all", "--check"]))?;
    ebpf_modules(false)?;
    clippy()?;
    clippy_ebpf()
}

/// The eBPF crate's module dependencies (`modules`): printed when `print`; an error naming the
/// modules of any import cycle.
fn ebpf_modules(print: bool) -> Result<()> {
    let g = modules::graph(&root_dir().join("fastpath-ebpf/src"))?;
    if print {
        for (m, deps) in &g {
            let deps: Vec<&str> = deps.iter().map(String::as_str).collect();
            println!("{m:<10} -> {}", deps.join(" "));
        }
    }
    let cyclic = modules::in_cycles(&g);
    if !cyclic.is_empty() {
        bail!(
            "fastpath-ebpf modules that import each other in a cycle: {} (`cargo xtask modules` lists the imports; a stage's result reaches the next stage through pipeline.rs, and shared types go to ctx.rs)",
            cyclic.join(" ")
        );
    }
    Ok(())
}

/// clippy on the userspace crates, every target, warnings denied.
fn clippy() -> Result<()> {
    // The workspace's default members: the eBPF crate builds only for bpfel (through
    // fastpath/build.rs); `--workspace` would build it for the host and fail.
    run(&mut cargo(&[
        "clippy",
        "--all-targets",
        "--release",
        "--",
        "-D",
        "warnings",
    ]))
}

/// clippy on the eBPF crate, for its real target with the flags aya-build gives it (a separate
/// target dir: these flags differ from the host build's).
fn clippy_ebpf() -> Result<()> {
    let ebpf = Pin::ebpf().channel;
    let target_dir = root_dir().join("target/ebpf-clippy");
    run(cmd("cargo")
        .arg(format!("+{ebpf}"))
        .args([
            "clippy",
            "--release",
            "--target",
            "bpfel-unknown-none",
            "-Z",
            "build-std=core",
            "--target-dir",
        ])
        .arg(&target_dir)
        .args(["--", "-D", "warnings"])
        .env(
            "CARGO_ENCODED_RUSTFLAGS",
            "--cfg=bpf_target_arch=\"x86_64\"",
        )
        .current_dir(root_dir().join("fastpath-ebpf")))
}

/// The user the unprivileged pass runs as: `nobody`.
const UNPRIVILEGED_UID: &str = "65534";

/// The unit tests of every userspace crate, run as an unprivileged user with no capabilities:
/// the logic (rules, rollback, expiry, config, sync) must be testable without root. Only the
/// `kernel_tests` modules, which drive the real datapath, are left to the root pass. The test
/// binaries are copied to a directory that user can enter: the checkout may not be.
fn unit_tests_unprivileged() -> Result<()> {
    let exes = test_executables(&mut cargo(&[
        "test",
        "--release",
        "--lib",
        "--bins",
        "--no-run",
        "--message-format=json",
    ]))?;
    let dir = env::temp_dir().join(format!("fastpath-unit-{}", std::process::id()));
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let result = (|| {
        use std::os::unix::fs::PermissionsExt as _;
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o755))?;
        for exe in &exes {
            let name = exe.file_name().context("an executable without a name")?;
            let copy = dir.join(name);
            fs::copy(exe, &copy).with_context(|| format!("copying {}", exe.display()))?;
            eprintln!(
                "xtask: unit tests as uid {UNPRIVILEGED_UID}: {}",
                copy.display()
            );
            run(Command::new("setpriv")
                .args(["--reuid", UNPRIVILEGED_UID, "--regid", UNPRIVILEGED_UID])
                .args(["--clear-groups", "--inh-caps=-all", "--"])
                .arg(&copy)
                .args(["--skip", "kernel_tests::"])
                .current_dir(&dir)
                .env("HOME", &dir))?;
        }
        Ok(())
    })();
    let _ = fs::remove_dir_all(&dir);
    result
}

/// The API docs of the userspace crates, rustdoc warnings denied (broken links, bad HTML).
fn docs() -> Result<()> {
    run(cargo(&[
        "doc",
        "--release",
        "--no-deps",
        "-p",
        "fastpath",
        "-p",
        "fastpath-common",
    ])
    .env("RUSTDOCFLAGS", "-D warnings"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_test_builds_count_as_test_executables() {
        // Cargo's messages for an integration test and for the binary it runs, shortened.
        let test = r#"{"reason":"compiler-artifact","target":{"kind":["test"],"name":"fixtures","test":true},"profile":{"opt_level":"3","test":true},"executable":"/t/deps/fixtures-1"}"#;
        let bin = r#"{"reason":"compiler-artifact","target":{"kind":["bin"],"name":"fastpath","doctest":false,"test":true},"profile":{"opt_level":"3","test":false},"executable":"/t/fastpath"}"#;
        assert!(test_profile(test));
        assert!(!test_profile(bin));
    }

    #[test]
    fn toolchain_files_state_a_channel() {
        let user = Pin::user();
        assert!(
            user.channel.starts_with("1."),
            "rust-toolchain.toml: expected a stable version as channel, got {:?}",
            user.channel
        );
        assert!(user.components.contains(&"clippy"), "{:?}", user.components);
        let ebpf = Pin::ebpf();
        assert!(
            ebpf.channel.starts_with("nightly-"),
            "fastpath-ebpf/rust-toolchain.toml: expected a dated nightly, got {:?}",
            ebpf.channel
        );
        assert!(
            ebpf.components.contains(&"rust-src"),
            "{:?}",
            ebpf.components
        );
    }
}
