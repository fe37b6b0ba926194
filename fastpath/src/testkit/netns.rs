//! Network-namespace topologies for end-to-end tests, the demo and benchmarks: namespaces, veth
//! links, addresses, routes, sysctls, servers and a `fastpath daemon`, all removed on drop.
//!
//! Contract: everything created here is named `fpt-<pid>-<seq>-<role>` (namespaces, pin
//! directories, temp directories) and removed in `Drop`, which also runs when a test panics
//! (unwinding); [`sweep_stale`] removes what a killed run (a dead pid) left behind. Root only:
//! call [`prepare_test`] first. Addresses come from 10.200.0.0/16 and fd00:200::/32 only.
//!
//! Drop order matters where objects share a namespace: declare a [`Daemon`] or [`Spawned`]
//! server *after* the [`Topology`] it runs in, so it is dropped (cleanly stopped) first. A
//! topology dropped first still SIGTERMs whatever runs in its namespaces before deleting them.

use std::{
    ffi::{OsStr, OsString},
    fmt,
    fs::{self, File},
    io::{self, Read},
    net::{Ipv4Addr, Ipv6Addr},
    os::{fd::AsRawFd as _, unix::process::CommandExt as _},
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Output, Stdio},
    sync::atomic::{AtomicU64, Ordering},
    thread,
    time::{Duration, Instant},
};

use crate::{datapath, stats::StatsSnapshot};

/// Prefix of every namespace, pin directory and temp directory this module creates.
pub const PREFIX: &str = "fpt";

/// Default limit for one command run with [`Netns::exec`]: long enough for any tool the tests
/// run (they bound their own run time), short enough that a hang fails the test.
pub const EXEC_TIMEOUT: Duration = Duration::from_secs(60);

/// How long [`Daemon::start`] waits for "Datapath running", times [`slowdown`].
pub const DAEMON_START_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a SIGTERMed daemon gets to detach before it is SIGKILLed, times [`slowdown`].
const DAEMON_STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// `FASTPATH_TEST_SLOWDOWN` (a whole number, default 1): how many times longer a daemon may
/// take to start and stop, for a kernel under emulation (`cargo xtask vm`), where verifying
/// the programs alone takes tens of seconds.
pub fn slowdown() -> u32 {
    std::env::var("FASTPATH_TEST_SLOWDOWN")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n >= 1)
        .unwrap_or(1)
}

/// The line the daemon logs once every hook is attached.
pub const DAEMON_READY: &str = "Datapath running";

/// Where `ip netns add` puts namespace handles.
const NETNS_RUN_DIR: &str = "/run/netns";

/// The bpffs mount the pin directories live under.
const BPF_FS: &str = "/sys/fs/bpf";

#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    #[error(
        "starting `{cmd}`: {source}; is the tool installed? (`cargo xtask bootstrap` installs iproute2, iputils-ping, curl, nginx-light, iperf3, bpftool, ...)"
    )]
    Spawn {
        cmd: String,
        #[source]
        source: io::Error,
    },
    #[error("`{cmd}` failed ({status}); stderr: {stderr}; stdout: {stdout}")]
    Failed {
        cmd: String,
        status: ExitStatus,
        stdout: String,
        stderr: String,
    },
    #[error("`{cmd}` still running after {timeout:?}, killed; stderr so far: {stderr}")]
    Timeout {
        cmd: String,
        timeout: Duration,
        stderr: String,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("no namespace with role {role:?} in this topology (roles: {roles})")]
    NoSuchRole { role: String, roles: String },
    #[error("nothing listens on {proto} port {port} in namespace {netns} after {timeout:?}")]
    NotListening {
        netns: String,
        proto: &'static str,
        port: u16,
        timeout: Duration,
    },
    #[error(
        "required tool `{tool}` is not on PATH; install it with `apt-get install {package}` or run `cargo xtask bootstrap` (it installs every tool the tests, the demo and the benchmarks use)"
    )]
    MissingTool { tool: String, package: String },
    #[error("{} not found; build it with `cargo xtask build`", path.display())]
    NoBinary { path: PathBuf },
    #[error("fastpath daemon in namespace {netns} {what}; its log ({log_path}):\n{log}")]
    Daemon {
        netns: String,
        what: String,
        log_path: PathBuf,
        log: String,
    },
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> NetnsError {
    let what = what.into();
    move |source| NetnsError::Io { what, source }
}

/// The preamble of a namespace test: root, `ip`/`ss` and `tools` present, and whatever
/// killed earlier runs left behind removed.
pub fn prepare_test(tools: &[&str]) {
    super::require_root("this namespace test");
    require_tools(&["ip", "ss"]);
    require_tools(tools);
    match sweep_stale(PREFIX) {
        Ok(removed) if !removed.is_empty() => {
            eprintln!("removed leftovers of dead runs: {removed:?}")
        }
        Ok(_) => {}
        Err(e) => panic!("sweeping leftovers of earlier runs: {e}"),
    }
}

/// Panics naming the first of `tools` that is not on PATH, with the Debian package to install.
pub fn require_tools(tools: &[&str]) {
    if let Err(e) = find_tools(tools) {
        panic!("{e}");
    }
}

/// Fails naming the first of `tools` that is not on PATH, with the Debian package to install.
pub fn find_tools(tools: &[&str]) -> Result<(), NetnsError> {
    for tool in tools {
        let found = std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
            .unwrap_or(false);
        if !found {
            let package = match *tool {
                "ip" | "ss" => "iproute2",
                "sysctl" => "procps",
                "ping" => "iputils-ping",
                "nginx" => "nginx-light",
                "nc" => "netcat-openbsd",
                "nft" => "nftables",
                "ip6tables" => "iptables",
                other => other,
            };
            return Err(NetnsError::MissingTool {
                tool: (*tool).to_owned(),
                package: package.to_owned(),
            });
        }
    }
    Ok(())
}

/// The `fastpath` binary built beside the running example: `target/<profile>/examples/NAME`
/// runs `target/<profile>/fastpath` (`cargo xtask demo` and `bench` build both).
pub fn example_fastpath_bin() -> Result<PathBuf, NetnsError> {
    let exe = std::env::current_exe().map_err(io_err("locating the running executable"))?;
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .map(|p| p.join("fastpath"))
        .unwrap_or_else(|| PathBuf::from("fastpath"));
    if !bin.is_file() {
        return Err(NetnsError::NoBinary { path: bin });
    }
    Ok(bin)
}

/// `fpt-<pid>-<seq>-<role>`: unique across this process (seq) and across runs (pid), so an
/// earlier crashed run never collides with this one and [`sweep_stale`] can tell its leftovers
/// (dead pid) from a concurrent run's (live pid).
pub fn unique_name(role: &str) -> String {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let seq = SEQ.fetch_add(1, Ordering::Relaxed);
    format!("{PREFIX}-{}-{seq}-{role}", std::process::id())
}

/// A fresh pin directory under /sys/fs/bpf (not created: the daemon creates it).
pub fn unique_pin_dir(role: &str) -> PathBuf {
    Path::new(BPF_FS).join(unique_name(role))
}

/// The pid in `<prefix>-<pid>-...`, if `name` has that shape.
fn owner_pid(name: &str, prefix: &str) -> Option<u32> {
    let rest = name.strip_prefix(prefix)?.strip_prefix('-')?;
    let pid = rest.split('-').next()?;
    pid.parse().ok()
}

fn pid_alive(pid: u32) -> bool {
    Path::new("/proc").join(pid.to_string()).exists()
}

/// Removes what runs with `prefix` left behind when their process died without unwinding
/// (SIGKILL, abort): namespaces (after killing what runs in them), pin directories and temp
/// directories whose owner pid is dead. Leaves this process's and other
/// live processes' objects alone. Returns what it removed.
pub fn sweep_stale(prefix: &str) -> Result<Vec<String>, NetnsError> {
    let mut removed = Vec::new();
    let stale = |name: &str| owner_pid(name, prefix).is_some_and(|pid| !pid_alive(pid));
    // Namespaces first: stopping a daemon that still runs in one lets it detach cleanly.
    for name in dir_names(Path::new(NETNS_RUN_DIR)) {
        if stale(&name) {
            let ns = Netns {
                name: name.clone(),
                role: String::new(),
            };
            drop(ns); // kills what runs in it and deletes it
            removed.push(format!("netns {name}"));
        }
    }
    for name in dir_names(Path::new(BPF_FS)) {
        if stale(&name) {
            let dir = Path::new(BPF_FS).join(&name);
            datapath::remove_pins(&dir).map_err(|e| NetnsError::Io {
                what: format!("removing stale pins under {}", dir.display()),
                source: io::Error::other(e.to_string()),
            })?;
            removed.push(dir.display().to_string());
        }
    }
    let tmp = std::env::temp_dir();
    for name in dir_names(&tmp) {
        if stale(&name) {
            let path = tmp.join(&name);
            let _ = fs::remove_dir_all(&path).or_else(|_| fs::remove_file(&path));
            removed.push(path.display().to_string());
        }
    }
    Ok(removed)
}

fn dir_names(dir: &Path) -> Vec<String> {
    fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// A private directory under the system temp dir, named like everything else here so
/// [`sweep_stale`] finds it after a crash; removed on drop.
#[derive(Debug)]
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    pub fn new(role: &str) -> Result<TempDir, NetnsError> {
        let path = std::env::temp_dir().join(unique_name(role));
        fs::create_dir_all(&path).map_err(io_err(format!("creating {}", path.display())))?;
        Ok(TempDir { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn join(&self, name: impl AsRef<Path>) -> PathBuf {
        self.path.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.path);
    }
}

/// `prog arg1 arg2`, for messages.
fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// Asks the kernel to send `sig` to the child when the thread that spawned it dies, so a test
/// process killed outright does not leave servers or daemons running.
fn die_with_parent(cmd: &mut Command, sig: libc::c_int) {
    // SAFETY: prctl is async-signal-safe and touches only the child's own attributes.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, sig as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Runs `cmd` to completion, capturing its output; kills it after `timeout`.
fn output_within(mut cmd: Command, timeout: Duration) -> Result<Output, NetnsError> {
    let desc = describe(&cmd);
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    die_with_parent(&mut cmd, libc::SIGKILL);
    let mut child = cmd.spawn().map_err(|source| NetnsError::Spawn {
        cmd: desc.clone(),
        source,
    })?;
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_end(&mut buf);
            }
            buf
        })
    };
    let out = drain(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let err = drain(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            Ok(None) => thread::sleep(Duration::from_millis(5)),
            Err(e) => return Err(io_err(format!("waiting for `{desc}`"))(e)),
        }
    };
    let stdout = out.join().unwrap_or_default();
    let stderr = err.join().unwrap_or_default();
    match status {
        Some(status) => Ok(Output {
            status,
            stdout,
            stderr,
        }),
        None => Err(NetnsError::Timeout {
            cmd: desc,
            timeout,
            stderr: String::from_utf8_lossy(&stderr).into_owned(),
        }),
    }
}

/// Fails unless `out` is a success; returns its stdout.
fn checked(cmd: String, out: Output) -> Result<String, NetnsError> {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if out.status.success() {
        Ok(stdout)
    } else {
        Err(NetnsError::Failed {
            cmd,
            status: out.status,
            stdout,
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        })
    }
}

/// Runs a host command (not in a namespace) and fails unless it succeeds.
pub fn host_run<S: AsRef<OsStr>>(args: &[S]) -> Result<String, NetnsError> {
    let (prog, rest) = args.split_first().expect("host_run needs a program");
    let mut cmd = Command::new(prog);
    cmd.args(rest);
    let desc = describe(&cmd);
    checked(desc, output_within(cmd, EXEC_TIMEOUT)?)
}

/// A network namespace (`/run/netns/<name>`), deleted on drop after everything running in it
/// is stopped (SIGTERM, then SIGKILL).
pub struct Netns {
    name: String,
    role: String,
}

impl fmt::Debug for Netns {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Netns({})", self.name)
    }
}

impl Netns {
    /// Creates `fpt-<pid>-<seq>-<role>` with its loopback up.
    pub fn create(role: &str) -> Result<Netns, NetnsError> {
        let name = unique_name(role);
        host_run(&["ip", "netns", "add", &name])?;
        // From here on, Drop deletes it even if the rest of the setup fails.
        let ns = Netns {
            name,
            role: role.to_owned(),
        };
        ns.ip(&["link", "set", "lo", "up"])?;
        // No duplicate address detection on the interfaces created later, link-local
        // addresses included: without it, neighbour discovery waits for DAD to finish
        // (about a second after link up) and the first IPv6 packets stall or are lost.
        ns.sysctl("net.ipv6.conf.default.accept_dad", "0")?;
        ns.sysctl("net.ipv6.conf.all.accept_dad", "0")?;
        Ok(ns)
    }

    /// The full namespace name, as `ip netns` and `fastpath --netns` take it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The role the topology gave it (`client`, `fp`, `backend0`, ...).
    pub fn role(&self) -> &str {
        &self.role
    }

    fn exec_command<S: AsRef<OsStr>>(&self, args: &[S]) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name]).args(args);
        cmd
    }

    /// Runs `args` inside the namespace (`ip netns exec`) and returns its output, whatever its
    /// exit status; killed after [`EXEC_TIMEOUT`].
    pub fn exec<S: AsRef<OsStr>>(&self, args: &[S]) -> Result<Output, NetnsError> {
        self.exec_timeout(args, EXEC_TIMEOUT)
    }

    /// [`Netns::exec`] with another time limit.
    pub fn exec_timeout<S: AsRef<OsStr>>(
        &self,
        args: &[S],
        timeout: Duration,
    ) -> Result<Output, NetnsError> {
        output_within(self.exec_command(args), timeout)
    }

    /// Runs `args` inside the namespace; fails unless it exits 0. Returns its stdout.
    pub fn run<S: AsRef<OsStr>>(&self, args: &[S]) -> Result<String, NetnsError> {
        let cmd = self.exec_command(args);
        let desc = describe(&cmd);
        checked(desc, output_within(cmd, EXEC_TIMEOUT)?)
    }

    /// The body of `url`, fetched with curl from this namespace (5 s at most, an HTTP error
    /// status fails).
    pub fn http_get(&self, url: &str) -> Result<String, NetnsError> {
        self.run(&["curl", "-sS", "--fail", "--max-time", "5", url])
    }

    /// `ip -n <name> args...`; fails unless it exits 0.
    pub fn ip<S: AsRef<OsStr>>(&self, args: &[S]) -> Result<String, NetnsError> {
        let mut cmd = Command::new("ip");
        cmd.args(["-n", &self.name]).args(args);
        let desc = describe(&cmd);
        checked(desc, output_within(cmd, EXEC_TIMEOUT)?)
    }

    /// Starts a long-running process (a server) inside the namespace, its stdout and stderr
    /// going to a log file. The returned guard kills it on drop.
    pub fn spawn<S: AsRef<OsStr>>(&self, args: &[S]) -> Result<Spawned, NetnsError> {
        let mut cmd = self.exec_command(args);
        let desc = describe(&cmd);
        let log = std::env::temp_dir().join(unique_name("spawn.log"));
        let out = File::create(&log).map_err(io_err(format!("creating {}", log.display())))?;
        let err = out.try_clone().map_err(io_err("duplicating a log fd"))?;
        cmd.stdin(Stdio::null()).stdout(out).stderr(err);
        die_with_parent(&mut cmd, libc::SIGKILL);
        match cmd.spawn() {
            Ok(child) => Ok(Spawned {
                child,
                cmd: desc,
                log,
            }),
            Err(source) => {
                let _ = fs::remove_file(&log);
                Err(NetnsError::Spawn { cmd: desc, source })
            }
        }
    }

    /// Sets a sysctl in this namespace (`net.ipv4.ip_forward`, ...), by writing
    /// /proc/sys from a thread inside it (net sysctls follow the writer's namespace).
    pub fn sysctl(&self, key: &str, value: &str) -> Result<(), NetnsError> {
        let path = Path::new("/proc/sys").join(key.replace('.', "/"));
        self.in_netns(|| fs::write(&path, value))?
            .map_err(io_err(format!("setting {key}={value} in {}", self.name)))
    }

    /// Adds an address; IPv6 ones with `nodad`, so they are usable at once.
    pub fn add_addr(&self, dev: &str, cidr: &str) -> Result<(), NetnsError> {
        if cidr.contains(':') {
            self.ip(&["-6", "addr", "add", cidr, "dev", dev, "nodad"])
                .map(drop)
        } else {
            self.ip(&["addr", "add", cidr, "dev", dev]).map(drop)
        }
    }

    /// Adds a route (`dst` may be `default`), IPv4 or IPv6 after the gateway's family.
    pub fn add_route(&self, dst: &str, via: &str) -> Result<(), NetnsError> {
        let family = if via.contains(':') { "-6" } else { "-4" };
        self.ip(&[family, "route", "add", dst, "via", via])
            .map(drop)
    }

    /// Brings `dev` up.
    pub fn link_up(&self, dev: &str) -> Result<(), NetnsError> {
        self.ip(&["link", "set", dev, "up"]).map(drop)
    }

    /// `ip -d link show dev` (shows `prog/xdp` while an XDP program is attached).
    pub fn link_show(&self, dev: &str) -> Result<String, NetnsError> {
        self.ip(&["-d", "link", "show", "dev", dev])
    }

    /// Whether an XDP program is attached to `dev`.
    pub fn xdp_attached(&self, dev: &str) -> Result<bool, NetnsError> {
        Ok(self.link_show(dev)?.contains("prog/xdp"))
    }

    /// Pids of every process in this namespace.
    pub fn pids(&self) -> Vec<i32> {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "pids", &self.name]);
        match output_within(cmd, EXEC_TIMEOUT) {
            Ok(out) => String::from_utf8_lossy(&out.stdout)
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect(),
            Err(_) => Vec::new(),
        }
    }

    /// Runs `f` on a thread that has entered this namespace (setns CLONE_NEWNET; the rest of
    /// the process stays where it is): sockets it opens live in the namespace. A panic in `f`
    /// is re-raised here.
    pub fn in_netns<F, R>(&self, f: F) -> Result<R, NetnsError>
    where
        F: FnOnce() -> R + Send,
        R: Send,
    {
        let path = Path::new(NETNS_RUN_DIR).join(&self.name);
        let handle = File::open(&path).map_err(io_err(format!("opening {}", path.display())))?;
        thread::scope(|s| {
            let joined = s
                .spawn(move || {
                    // SAFETY: setns on a valid namespace fd; CLONE_NEWNET affects only this thread.
                    if unsafe { libc::setns(handle.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                        return Err(io_err(format!("entering {}", path.display()))(
                            io::Error::last_os_error(),
                        ));
                    }
                    Ok(f())
                })
                .join();
            match joined {
                Ok(r) => r,
                Err(panic) => std::panic::resume_unwind(panic),
            }
        })
    }

    /// Waits until something listens on `port` (`proto` "tcp" or "udp") in this namespace.
    /// Looks with `ss` rather than connecting, so no probe traffic is counted or consumed.
    pub fn wait_listening(
        &self,
        proto: &'static str,
        port: u16,
        timeout: Duration,
    ) -> Result<(), NetnsError> {
        let flag = if proto == "udp" { "-Hlun" } else { "-Hltn" };
        let sport = format!(":{port}");
        let deadline = Instant::now() + timeout;
        loop {
            let out = self.run(&["ss", flag, "sport", "=", &sport])?;
            if !out.trim().is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(NetnsError::NotListening {
                    netns: self.name.clone(),
                    proto,
                    port,
                    timeout,
                });
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops everything running in the namespace: SIGTERM (a daemon detaches cleanly), then
    /// SIGKILL for whatever is left after 3 s.
    fn stop_processes(&self) {
        for (sig, grace) in [
            (libc::SIGTERM, Duration::from_secs(3)),
            (libc::SIGKILL, Duration::from_secs(2)),
        ] {
            let pids = self.pids();
            if pids.is_empty() {
                return;
            }
            for pid in pids {
                // SAFETY: kill with a pid read from the namespace; a stale pid just fails.
                unsafe { libc::kill(pid, sig) };
            }
            let deadline = Instant::now() + grace;
            while !self.pids().is_empty() && Instant::now() < deadline {
                thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        self.stop_processes();
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "del", &self.name]);
        match output_within(cmd, EXEC_TIMEOUT) {
            Ok(out) if out.status.success() => {}
            Ok(out) => eprintln!(
                "warning: deleting netns {}: {}",
                self.name,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
            Err(e) => eprintln!("warning: deleting netns {}: {e}", self.name),
        }
    }
}

/// A process started with [`Netns::spawn`]; SIGKILLed and reaped on drop.
pub struct Spawned {
    child: Child,
    cmd: String,
    log: PathBuf,
}

impl Spawned {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether it is still running (reaps it if it exited).
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Its stdout and stderr so far.
    pub fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The command line, for messages.
    pub fn command(&self) -> &str {
        &self.cmd
    }

    /// Waits for it to exit by itself, up to `timeout`; `None` if it is still running.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return Some(status),
                Ok(None) if Instant::now() < deadline => thread::sleep(Duration::from_millis(10)),
                _ => return None,
            }
        }
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        self.kill();
        if thread::panicking() {
            eprintln!("--- output of `{}` ---\n{}", self.cmd, self.log());
        }
        let _ = fs::remove_file(&self.log);
    }
}

/// nginx serving a directory on one port, IPv4 and IPv6, in a namespace: a real HTTP
/// backend. Single process (`master_process off`), so killing it leaves no workers; its config,
/// temp paths and document root live in a private temp dir, removed on drop.
pub struct HttpServer {
    process: Spawned,
    dir: TempDir,
}

impl HttpServer {
    /// Directory served at `/`: put the files to download here.
    pub fn root(&self) -> PathBuf {
        self.dir.join("www")
    }

    pub fn process(&mut self) -> &mut Spawned {
        &mut self.process
    }

    /// Serves `/NAME`: `len` bytes that are not all alike, returned to compare a download
    /// with end to end.
    pub fn serve_blob(&self, name: &str, len: u32) -> Vec<u8> {
        let body: Vec<u8> = (0..len)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        std::fs::write(self.root().join(name), &body)
            .unwrap_or_else(|e| panic!("writing the download {name}: {e}"));
        body
    }
}

impl Netns {
    /// Downloads `url` with curl from here (20 s at most) and checks it is `body`, byte for
    /// byte; panics with curl's error or the sizes otherwise.
    pub fn download_exact(&self, url: &str, body: &[u8]) {
        let out = self
            .exec(&["curl", "-sS", "-g", "--fail", "--max-time", "20", url])
            .unwrap_or_else(|e| panic!("curl {url}: {e}"));
        assert!(
            out.status.success(),
            "curl {url}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.stdout == body,
            "{url}: {} bytes arrived, {} sent, or they differ",
            out.stdout.len(),
            body.len()
        );
    }
}

impl Netns {
    /// Starts nginx on `port` (all addresses, both families) and waits until it listens.
    /// Besides the files under [`HttpServer::root`], `/peer` answers with the client's address
    /// and port and the address it connected to, as the server sees them
    /// (`10.0.0.1 40000 10.0.0.2`).
    pub fn http_server(&self, port: u16) -> Result<HttpServer, NetnsError> {
        let dir = TempDir::new("nginx")?;
        let d = dir.path().display().to_string();
        for sub in ["www", "tmp"] {
            let p = dir.join(sub);
            fs::create_dir_all(&p).map_err(io_err(format!("creating {}", p.display())))?;
        }
        let conf = format!(
            r#"daemon off;
master_process off;
worker_processes 1;
pid {d}/nginx.pid;
error_log stderr;
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_body_temp_path {d}/tmp/body;
    proxy_temp_path {d}/tmp/proxy;
    fastcgi_temp_path {d}/tmp/fastcgi;
    uwsgi_temp_path {d}/tmp/uwsgi;
    scgi_temp_path {d}/tmp/scgi;
    server {{
        listen {port};
        listen [::]:{port} ipv6only=on;
        root {d}/www;
        location = /peer {{
            default_type text/plain;
            return 200 "$remote_addr $remote_port $server_addr\n";
        }}
    }}
}}
"#
        );
        let conf_path = dir.join("nginx.conf");
        fs::write(&conf_path, conf).map_err(io_err(format!("writing {}", conf_path.display())))?;
        let conf_s = conf_path.display().to_string();
        let process = self.spawn(&["nginx", "-e", "stderr", "-p", &d, "-c", &conf_s])?;
        let mut server = HttpServer { process, dir };
        if let Err(e) = self.wait_listening("tcp", port, Duration::from_secs(10)) {
            let log = server.process.log();
            let running = server.process.is_running();
            return Err(NetnsError::Io {
                what: format!(
                    "nginx in {} (running: {running}); its output:\n{log}",
                    self.name
                ),
                source: io::Error::other(e.to_string()),
            });
        }
        Ok(server)
    }
}

/// One end of a veth pair: namespace role, interface name, addresses (CIDR, v4 or v6).
#[derive(Clone, Debug)]
pub struct VethEnd {
    pub role: String,
    pub ifname: String,
    pub addrs: Vec<String>,
}

impl VethEnd {
    pub fn new(role: &str, ifname: &str) -> VethEnd {
        VethEnd {
            role: role.into(),
            ifname: ifname.into(),
            addrs: Vec::new(),
        }
    }

    /// Adds an address in CIDR form (`10.200.1.2/24`, `fd00:200:1::2/64`).
    pub fn addr(mut self, cidr: &str) -> VethEnd {
        self.addrs.push(cidr.into());
        self
    }
}

/// A veth pair the topology created (both ends vanish with either namespace).
#[derive(Clone, Debug)]
pub struct VethLink {
    pub a: VethEnd,
    pub b: VethEnd,
}

/// Namespaces and the links between them; deletes everything on drop (processes first, then
/// namespaces, newest first; deleting a namespace removes its veths).
#[derive(Debug, Default)]
pub struct Topology {
    namespaces: Vec<Netns>,
    links: Vec<VethLink>,
}

impl Topology {
    pub fn new() -> Topology {
        Topology::default()
    }

    /// Creates a namespace for `role` (unique within the topology).
    pub fn add_ns(&mut self, role: &str) -> Result<&Netns, NetnsError> {
        assert!(
            self.get(role).is_none(),
            "role {role:?} is already in this topology"
        );
        self.namespaces.push(Netns::create(role)?);
        Ok(self.namespaces.last().expect("just pushed"))
    }

    /// The namespace playing `role`; panics if there is none (a bug in the test).
    pub fn ns(&self, role: &str) -> &Netns {
        match self.try_ns(role) {
            Ok(ns) => ns,
            Err(e) => panic!("{e}"),
        }
    }

    pub fn try_ns(&self, role: &str) -> Result<&Netns, NetnsError> {
        self.get(role).ok_or_else(|| NetnsError::NoSuchRole {
            role: role.into(),
            roles: self
                .namespaces
                .iter()
                .map(|n| n.role.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        })
    }

    fn get(&self, role: &str) -> Option<&Netns> {
        self.namespaces.iter().find(|n| n.role == role)
    }

    /// Every namespace, in creation order.
    pub fn namespaces(&self) -> &[Netns] {
        &self.namespaces
    }

    /// Every veth pair, in creation order.
    pub fn links(&self) -> &[VethLink] {
        &self.links
    }

    /// Creates a veth pair between two namespaces of this topology (created directly in
    /// them, never in the host namespace), gives each end its addresses and brings both up.
    pub fn veth(&mut self, a: VethEnd, b: VethEnd) -> Result<(), NetnsError> {
        let (na, nb) = (self.try_ns(&a.role)?, self.try_ns(&b.role)?);
        na.ip(&[
            "link",
            "add",
            &a.ifname,
            "type",
            "veth",
            "peer",
            "name",
            &b.ifname,
            "netns",
            nb.name(),
        ])?;
        for (ns, end) in [(na, &a), (nb, &b)] {
            for cidr in &end.addrs {
                ns.add_addr(&end.ifname, cidr)?;
            }
            ns.link_up(&end.ifname)?;
        }
        self.links.push(VethLink { a, b });
        Ok(())
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        while let Some(ns) = self.namespaces.pop() {
            drop(ns);
        }
    }
}

/// The standard load-balancer topology: a client, the fast-path node `fp` (forwarding on, the
/// daemon runs here) and `backends` backend namespaces, every link its own /24 and /64:
///
/// ```text
///                                  fp (ip_forward=1, ipv6 forwarding=1)
///   client                       +--------------------------------+              backend<i>
///  +----------+  10.200.1.0/24   |                                |  10.200.(10+i).0/24   +----------+
///  |   eth0   |------------------| cl0                      be<i> |-----------------------|   eth0   |
///  | .2 / ::2 | fd00:200:1::/64  | .1 / ::1              .1 / ::1 | fd00:200:(10+i)::/64  | .2 / ::2 |
///  +----------+                  +--------------------------------+                       +----------+
///   default via 10.200.1.1                                            default via 10.200.(10+i).1
///   default via fd00:200:1::1                                         default via fd00:200:(10+i)::1
/// ```
///
/// Every namespace has IPv6 DAD off (addresses usable at once) and its loopback up.
///
/// Address plan (only 10.200.0.0/16 and fd00:200::/32; the link number `x` is written as the
/// same decimal digits in both families): client link x = 1, backend `i` link x = 10 + i
/// (i < 200); the fp end of each link is `.1` / `::1`, the other end `.2` / `::2`.
pub fn lb_topology(backends: usize) -> Result<LbTopology, NetnsError> {
    assert!(
        backends < 200,
        "lb_topology supports up to 199 backends (link numbers 10..=208)"
    );
    let mut topo = Topology::new();
    topo.add_ns(LbTopology::CLIENT)?;
    topo.add_ns(LbTopology::FP)?;
    for i in 0..backends {
        topo.add_ns(&LbTopology::backend_role(i))?;
    }
    let fp = LbTopology::FP;
    topo.ns(fp).sysctl("net.ipv4.ip_forward", "1")?;
    topo.ns(fp).sysctl("net.ipv6.conf.all.forwarding", "1")?;

    let link = |x: usize, far_role: &str, fp_if: &str| -> (VethEnd, VethEnd) {
        let far = VethEnd::new(far_role, LbTopology::HOST_IF)
            .addr(&format!("10.200.{x}.2/24"))
            .addr(&format!("fd00:200:{x}::2/64"));
        let near = VethEnd::new(fp, fp_if)
            .addr(&format!("10.200.{x}.1/24"))
            .addr(&format!("fd00:200:{x}::1/64"));
        (far, near)
    };
    let (client, fp_end) = link(
        LbTopology::CLIENT_LINK,
        LbTopology::CLIENT,
        LbTopology::FP_CLIENT_IF,
    );
    topo.veth(client, fp_end)?;
    for i in 0..backends {
        let (backend, fp_end) = link(
            LbTopology::backend_link(i),
            &LbTopology::backend_role(i),
            &LbTopology::fp_backend_if(i),
        );
        topo.veth(backend, fp_end)?;
    }

    let routes = |role: &str, x: usize| -> Result<(), NetnsError> {
        let ns = topo.ns(role);
        ns.add_route("default", &format!("10.200.{x}.1"))?;
        ns.add_route("default", &format!("fd00:200:{x}::1"))
    };
    routes(LbTopology::CLIENT, LbTopology::CLIENT_LINK)?;
    for i in 0..backends {
        routes(&LbTopology::backend_role(i), LbTopology::backend_link(i))?;
    }
    Ok(LbTopology { topo, backends })
}

/// [`lb_topology`] for tests: panics saying why it could not be built.
pub fn test_lb_topology(backends: usize) -> LbTopology {
    lb_topology(backends).unwrap_or_else(|e| panic!("building the lb topology: {e}"))
}

/// `fastpath service list -o json` of the datapath pinned at `pin_dir`: the raw text (for
/// messages) and the parsed rows.
pub fn service_list_json(bin: &Path, pin_dir: &Path) -> (String, serde_json::Value) {
    let json = host_run(&[
        bin.as_os_str(),
        "service".as_ref(),
        "list".as_ref(),
        "--pin-dir".as_ref(),
        pin_dir.as_os_str(),
        "-o".as_ref(),
        "json".as_ref(),
    ])
    .unwrap_or_else(|e| panic!("service list: {e}"));
    let rows =
        serde_json::from_str(&json).unwrap_or_else(|e| panic!("service list JSON: {e}\n{json}"));
    (json, rows)
}

/// The `[[service]]` tables `services` (TOML), parsed and checked as the daemon does.
pub fn parse_services(services: &str) -> Vec<crate::config::ServiceConfig> {
    let text = format!("[[interface]]\nname = \"lo\"\n{services}");
    crate::config::Config::parse_with(
        Path::new("lb test"),
        &text,
        crate::config::InterfaceCheck::Skip,
    )
    .unwrap_or_else(|e| panic!("{e}"))
    .services
}

/// The backend the daemon's table gives a TCP connection from `client:sport` to
/// `vip:vport`, for service number `svc` of `services` (the same table and hash the
/// datapath uses).
pub fn predicted_backend(
    services: &[crate::config::ServiceConfig],
    svc: usize,
    client: std::net::IpAddr,
    sport: u16,
    vip: std::net::IpAddr,
    vport: u16,
) -> std::net::IpAddr {
    let (a, family) = crate::lb::addr16(client);
    let (v, _) = crate::lb::addr16(vip);
    let key = fastpath_common::ct::ct_key(family, 6, &a, sport, &v, vport).0;
    let b = crate::lb::predict(services, svc, &key)
        .unwrap_or_else(|e| panic!("{e}"))
        .expect("backends configured");
    if family == 4 {
        std::net::IpAddr::from([b.addr[0], b.addr[1], b.addr[2], b.addr[3]])
    } else {
        std::net::IpAddr::from(b.addr)
    }
}

/// What [`lb_topology`] built, with its address plan.
#[derive(Debug)]
pub struct LbTopology {
    pub topo: Topology,
    backends: usize,
}

impl LbTopology {
    pub const CLIENT: &'static str = "client";
    pub const FP: &'static str = "fp";
    /// Interface name of the client's and every backend's end of its link.
    pub const HOST_IF: &'static str = "eth0";
    /// fp's interface towards the client.
    pub const FP_CLIENT_IF: &'static str = "cl0";
    const CLIENT_LINK: usize = 1;

    pub fn backend_role(i: usize) -> String {
        format!("backend{i}")
    }

    /// fp's interface towards backend `i`.
    pub fn fp_backend_if(i: usize) -> String {
        format!("be{i}")
    }

    fn backend_link(i: usize) -> usize {
        10 + i
    }

    pub fn backends(&self) -> usize {
        self.backends
    }

    pub fn client(&self) -> &Netns {
        self.topo.ns(Self::CLIENT)
    }

    pub fn fp(&self) -> &Netns {
        self.topo.ns(Self::FP)
    }

    pub fn backend(&self, i: usize) -> &Netns {
        self.topo.ns(&Self::backend_role(i))
    }

    /// fp's interfaces: `cl0`, then `be0`, `be1`, ...
    pub fn fp_interfaces(&self) -> Vec<String> {
        std::iter::once(Self::FP_CLIENT_IF.to_owned())
            .chain((0..self.backends).map(Self::fp_backend_if))
            .collect()
    }

    pub fn client_v4() -> Ipv4Addr {
        v4(Self::CLIENT_LINK, 2)
    }

    pub fn client_v6() -> Ipv6Addr {
        v6(Self::CLIENT_LINK, 2)
    }

    /// fp's address on the client link.
    pub fn fp_client_v4() -> Ipv4Addr {
        v4(Self::CLIENT_LINK, 1)
    }

    pub fn fp_client_v6() -> Ipv6Addr {
        v6(Self::CLIENT_LINK, 1)
    }

    pub fn backend_v4(i: usize) -> Ipv4Addr {
        v4(Self::backend_link(i), 2)
    }

    pub fn backend_v6(i: usize) -> Ipv6Addr {
        v6(Self::backend_link(i), 2)
    }

    /// Turns checksum offloads off (`ethtool -K eth0 tx off rx off`) on the client and every
    /// backend: they send full checksums and verify what they receive, as traffic from a wire
    /// does. With offloads on, veth passes partial checksums that XDP cannot tell apart and
    /// the receivers would not verify, and 64 KiB GSO packets.
    pub fn checksum_offloads_off(&self) -> Result<(), NetnsError> {
        for ns in std::iter::once(self.client()).chain((0..self.backends).map(|i| self.backend(i)))
        {
            ns.run(&["ethtool", "-K", Self::HOST_IF, "tx", "off", "rx", "off"])?;
        }
        Ok(())
    }

    /// GRO on (`ethtool -K eth0 gro on`) on the client and every backend: a veth takes frames
    /// fp redirects into it at XDP (`route = true`) only when its peer is in NAPI mode (an XDP
    /// program or GRO there); otherwise the kernel drops them.
    pub fn take_xdp_redirects(&self) -> Result<(), NetnsError> {
        for ns in std::iter::once(self.client()).chain((0..self.backends).map(|i| self.backend(i)))
        {
            ns.run(&["ethtool", "-K", Self::HOST_IF, "gro", "on"])?;
        }
        Ok(())
    }

    /// A daemon config attaching every hook (XDP auto, TC ingress and egress) to every fp
    /// interface.
    pub fn fp_config(&self, pin_dir: &Path) -> DaemonConfig {
        self.fp_interfaces()
            .iter()
            .fold(DaemonConfig::new(pin_dir), |c, i| c.interface(i))
    }

    /// A daemon config with every fp interface tracking (and balancing) at TC ingress, TC
    /// egress attached, no XDP (`xdp = "off"`).
    pub fn fp_config_tc(&self, pin_dir: &Path) -> DaemonConfig {
        self.fp_interfaces()
            .iter()
            .fold(DaemonConfig::new(pin_dir), |c, name| {
                c.hooks(HookedInterface {
                    name: name.clone(),
                    xdp: "off",
                    tc_ingress: true,
                    tc_egress: true,
                })
            })
    }
}

fn v4(x: usize, host: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 200, x as u8, host)
}

/// `fd00:200:x::host`, `x` written in the same decimal digits as in the IPv4 plan.
fn v6(x: usize, host: u16) -> Ipv6Addr {
    let group =
        u16::from_str_radix(&x.to_string(), 16).expect("link numbers have at most 4 digits");
    Ipv6Addr::new(0xfd00, 0x200, group, 0, 0, 0, 0, host)
}

/// Hooks the daemon attaches on one interface.
#[derive(Clone, Debug)]
pub struct HookedInterface {
    pub name: String,
    /// `auto`, `native`, `generic` or `off`.
    pub xdp: &'static str,
    pub tc_ingress: bool,
    pub tc_egress: bool,
}

/// A daemon config file, rendered to TOML.
#[derive(Clone, Debug)]
pub struct DaemonConfig {
    pub pin_dir: PathBuf,
    /// `datapath.drop_malformed`; false (the daemon's default) unless set.
    pub drop_malformed: bool,
    /// More `key = value` lines for `[datapath]`.
    pub datapath_keys: Vec<String>,
    pub interfaces: Vec<HookedInterface>,
    /// `[conntrack]` keys and `[conntrack.timeouts]` keys, as TOML `key = value` lines.
    pub conntrack: Vec<String>,
    pub conntrack_timeouts: Vec<String>,
    /// Interfaces with `stateful_firewall = true`.
    pub firewall: Vec<String>,
    /// `[[service]]` tables, TOML.
    pub services: String,
    /// More `key = value` lines for an interface's table, by interface name.
    pub interface_keys: Vec<(String, String)>,
    /// Tables appended as they are (e.g. `[api]`).
    pub raw: String,
}

impl DaemonConfig {
    pub fn new(pin_dir: &Path) -> DaemonConfig {
        DaemonConfig {
            pin_dir: pin_dir.to_owned(),
            drop_malformed: false,
            datapath_keys: Vec::new(),
            interfaces: Vec::new(),
            conntrack: Vec::new(),
            conntrack_timeouts: Vec::new(),
            firewall: Vec::new(),
            services: String::new(),
            interface_keys: Vec::new(),
            raw: String::new(),
        }
    }

    /// Adds `line` (`key = value`) to the `[datapath]` table.
    pub fn datapath_key(mut self, line: &str) -> DaemonConfig {
        self.datapath_keys.push(line.into());
        self
    }

    /// Appends TOML tables as they are (e.g. an `[api]` table).
    pub fn raw(mut self, toml: &str) -> DaemonConfig {
        self.raw.push_str(toml);
        self
    }

    /// Adds `line` (`key = value`) to interface `name`'s table.
    pub fn interface_key(mut self, name: &str, line: &str) -> DaemonConfig {
        self.interface_keys.push((name.into(), line.into()));
        self
    }

    /// Adds `[[service]]` tables (TOML).
    pub fn services(mut self, toml: &str) -> DaemonConfig {
        self.services.push_str(toml);
        self
    }

    /// Sets a `[conntrack]` key (`capacity`, `gc_interval_ms`) to a TOML value.
    pub fn conntrack(mut self, key: &str, value: impl std::fmt::Display) -> DaemonConfig {
        self.conntrack.push(format!("{key} = {value}"));
        self
    }

    /// Sets a `[conntrack.timeouts]` key, in seconds.
    pub fn ct_timeout(mut self, key: &str, secs: u32) -> DaemonConfig {
        self.conntrack_timeouts.push(format!("{key} = {secs}"));
        self
    }

    /// Turns the stateful firewall on for every interface configured so far.
    pub fn stateful_firewall(mut self) -> DaemonConfig {
        self.firewall = self.interfaces.iter().map(|i| i.name.clone()).collect();
        self
    }

    /// Sets `datapath.drop_malformed`.
    pub fn drop_malformed(mut self, drop: bool) -> DaemonConfig {
        self.drop_malformed = drop;
        self
    }

    /// Every hook on `name`: XDP auto, TC ingress and egress.
    pub fn interface(self, name: &str) -> DaemonConfig {
        self.hooks(HookedInterface {
            name: name.into(),
            xdp: "auto",
            tc_ingress: true,
            tc_egress: true,
        })
    }

    pub fn hooks(mut self, iface: HookedInterface) -> DaemonConfig {
        self.interfaces.push(iface);
        self
    }

    pub fn to_toml(&self) -> String {
        let mut s = format!(
            "[datapath]\npin_dir = {:?}\ndrop_malformed = {}\n",
            self.pin_dir.display().to_string(),
            self.drop_malformed
        );
        for line in &self.datapath_keys {
            s.push_str(&format!("{line}\n"));
        }
        if !self.conntrack.is_empty() {
            s.push_str(&format!("\n[conntrack]\n{}\n", self.conntrack.join("\n")));
        }
        if !self.conntrack_timeouts.is_empty() {
            s.push_str(&format!(
                "\n[conntrack.timeouts]\n{}\n",
                self.conntrack_timeouts.join("\n")
            ));
        }
        if !self.raw.is_empty() {
            s.push('\n');
            s.push_str(&self.raw);
            s.push('\n');
        }
        if !self.services.is_empty() {
            s.push('\n');
            s.push_str(&self.services);
        }
        for i in &self.interfaces {
            s.push_str(&format!(
                "\n[[interface]]\nname = {:?}\nxdp = {:?}\ntc_ingress = {}\ntc_egress = {}\nstateful_firewall = {}\n",
                i.name,
                i.xdp,
                i.tc_ingress,
                i.tc_egress,
                self.firewall.contains(&i.name)
            ));
            for (_, line) in self.interface_keys.iter().filter(|(n, _)| *n == i.name) {
                s.push_str(line);
                s.push('\n');
            }
        }
        s
    }
}

fn cmd_text<S: AsRef<OsStr>>(args: &[S]) -> String {
    args.iter()
        .map(|a| a.as_ref().to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// A `fastpath --netns NS daemon --config FILE` process. Each start logs (stderr) to its own
/// file in a private temp directory. On drop: SIGTERM and wait (clean detach), SIGKILL if it
/// hangs, then `fastpath detach` if pins remain; when the test is panicking, the logs are
/// printed.
pub struct Daemon {
    bin: PathBuf,
    netns: String,
    pin_dir: PathBuf,
    dir: TempDir,
    config_path: PathBuf,
    /// Passed after `daemon --config FILE` on every start (e.g. `--ct-events-log FILE`).
    extra_args: Vec<OsString>,
    child: Option<Child>,
    /// Log of every start so far; the last is the current one.
    logs: Vec<PathBuf>,
}

impl Daemon {
    /// Starts the daemon with `config` in `netns` and waits for "Datapath running"; panics
    /// with the daemon's log if it exits or does not get there within 10 s.
    pub fn start(bin: impl AsRef<Path>, netns: &Netns, config: &DaemonConfig) -> Daemon {
        Daemon::start_with_args(bin, netns, config, &[] as &[&str])
    }

    /// [`Daemon::start`] with `args` appended to the daemon's command line on this and every
    /// later start (e.g. `["--ct-events-log", "/tmp/x/events.log"]`).
    pub fn start_with_args<S: AsRef<OsStr>>(
        bin: impl AsRef<Path>,
        netns: &Netns,
        config: &DaemonConfig,
        args: &[S],
    ) -> Daemon {
        match Daemon::try_start_with_args(
            bin.as_ref(),
            netns.name(),
            &config.pin_dir,
            &config.to_toml(),
            args,
        ) {
            Ok(d) => d,
            Err(e) => panic!("{e}"),
        }
    }

    /// Starts the daemon with a config file holding `config_text` (whose pin directory is
    /// `pin_dir`) and waits for "Datapath running".
    pub fn try_start(
        bin: &Path,
        netns: &str,
        pin_dir: &Path,
        config_text: &str,
    ) -> Result<Daemon, NetnsError> {
        Daemon::try_start_with_args(bin, netns, pin_dir, config_text, &[] as &[&str])
    }

    /// [`Daemon::try_start`] with `args` appended to the daemon's command line.
    pub fn try_start_with_args<S: AsRef<OsStr>>(
        bin: &Path,
        netns: &str,
        pin_dir: &Path,
        config_text: &str,
        args: &[S],
    ) -> Result<Daemon, NetnsError> {
        let dir = TempDir::new("daemon")?;
        let config_path = dir.join("fastpath.toml");
        let mut d = Daemon {
            bin: bin.to_owned(),
            netns: netns.to_owned(),
            pin_dir: pin_dir.to_owned(),
            dir,
            config_path,
            extra_args: args.iter().map(|a| a.as_ref().to_owned()).collect(),
            child: None,
            logs: Vec::new(),
        };
        fs::write(&d.config_path, config_text)
            .map_err(io_err(format!("writing {}", d.config_path.display())))?;
        d.launch()?;
        Ok(d)
    }

    /// Starts the daemon again (after [`Daemon::kill9`] or [`Daemon::stop`]) with the same
    /// config; panics if it does not come up.
    pub fn restart(&mut self) {
        assert!(
            self.child.is_none(),
            "restart() while the daemon is still running; stop or kill9 it first"
        );
        if let Err(e) = self.launch() {
            panic!("{e}");
        }
    }

    fn launch(&mut self) -> Result<(), NetnsError> {
        let log = self.dir.join(format!("daemon-{}.log", self.logs.len() + 1));
        let out = File::create(&log).map_err(io_err(format!("creating {}", log.display())))?;
        let err = out.try_clone().map_err(io_err("duplicating a log fd"))?;
        self.logs.push(log);
        let mut cmd = Command::new(&self.bin);
        cmd.arg("--netns")
            .arg(&self.netns)
            .arg("daemon")
            .arg("--config")
            .arg(&self.config_path)
            .args(&self.extra_args)
            .env("NO_COLOR", "1")
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        // A test process that dies outright still gets a clean detach.
        die_with_parent(&mut cmd, libc::SIGTERM);
        let desc = describe(&cmd);
        self.child = Some(
            cmd.spawn()
                .map_err(|source| NetnsError::Spawn { cmd: desc, source })?,
        );
        self.wait_ready()
    }

    fn wait_ready(&mut self) -> Result<(), NetnsError> {
        let deadline = Instant::now() + DAEMON_START_TIMEOUT * slowdown();
        loop {
            if self.log().contains(DAEMON_READY) {
                return Ok(());
            }
            let child = self.child.as_mut().expect("launched");
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                return Err(
                    self.error(format!("exited ({status}) before logging {DAEMON_READY:?}"))
                );
            }
            if Instant::now() >= deadline {
                return Err(self.error(format!(
                    "did not log {DAEMON_READY:?} within {:?}",
                    DAEMON_START_TIMEOUT * slowdown()
                )));
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    fn error(&self, what: String) -> NetnsError {
        NetnsError::Daemon {
            netns: self.netns.clone(),
            what,
            log_path: self.logs.last().cloned().unwrap_or_default(),
            log: self.log(),
        }
    }

    /// The current (latest) run's log.
    pub fn log(&self) -> String {
        self.logs
            .last()
            .and_then(|p| fs::read_to_string(p).ok())
            .unwrap_or_default()
    }

    /// Every run's log, oldest first.
    pub fn all_logs(&self) -> Vec<String> {
        self.logs
            .iter()
            .map(|p| fs::read_to_string(p).unwrap_or_default())
            .collect()
    }

    /// The API socket (the default for this pin dir: tests do not set `[api] socket`).
    pub fn socket(&self) -> PathBuf {
        crate::config::default_socket(&self.pin_dir)
    }

    /// `fastpath --socket <this daemon's> ARGS...`: its output, whatever the exit status.
    pub fn cli<S: AsRef<OsStr>>(&self, args: &[S]) -> Output {
        let mut cmd = Command::new(&self.bin);
        cmd.arg("--socket").arg(self.socket()).args(args);
        output_within(cmd, EXEC_TIMEOUT)
            .unwrap_or_else(|e| panic!("running fastpath {:?}: {e}", cmd_text(args)))
    }

    /// [`Daemon::cli`] that must succeed: its stdout.
    pub fn cli_ok<S: AsRef<OsStr>>(&self, args: &[S]) -> String {
        let out = self.cli(args);
        assert!(
            out.status.success(),
            "fastpath {} failed ({}):\n{}{}",
            cmd_text(args),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }

    pub fn config_path(&self) -> &Path {
        &self.config_path
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Whether the daemon process is alive.
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut().map(Child::try_wait) {
            Some(Ok(None)) => true,
            Some(_) => {
                self.child = None;
                false
            }
            None => false,
        }
    }

    /// The datapath's counters, read from the pinned map (works with or without a daemon).
    pub fn stats(&self) -> StatsSnapshot {
        match datapath::pinned_stats(&self.pin_dir) {
            Ok(s) => s,
            Err(e) => panic!(
                "reading counters pinned under {}: {e}",
                self.pin_dir.display()
            ),
        }
    }

    /// SIGKILL: a crash. Programs stay attached through their pinned links.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM and wait for a clean exit (panics if it takes more than 10 s); returns the
    /// exit status.
    pub fn stop(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("stop() without a running daemon");
        match terminate(&mut child, DAEMON_STOP_TIMEOUT * slowdown()) {
            Some(status) => status,
            None => panic!(
                "daemon did not exit within {:?} of SIGTERM (SIGKILLed); log:\n{}",
                DAEMON_STOP_TIMEOUT * slowdown(),
                self.log()
            ),
        }
    }
}

/// SIGTERM, wait up to `timeout`, else SIGKILL. `None` if it had to be killed.
fn terminate(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    if let Ok(Some(status)) = child.try_wait() {
        return Some(status);
    }
    // SAFETY: kill on our own child's pid, not yet reaped, so it cannot have been reused.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take()
            && terminate(&mut child, DAEMON_STOP_TIMEOUT * slowdown()).is_none()
        {
            eprintln!(
                "warning: fastpath daemon ignored SIGTERM for {:?}; SIGKILLed it",
                DAEMON_STOP_TIMEOUT * slowdown()
            );
        }
        if self.pin_dir.exists() {
            let mut cmd = Command::new(&self.bin);
            cmd.arg("detach").arg("--pin-dir").arg(&self.pin_dir);
            let detached = output_within(cmd, EXEC_TIMEOUT).is_ok_and(|o| o.status.success());
            if !detached || self.pin_dir.exists() {
                eprintln!(
                    "warning: `fastpath detach --pin-dir {}` failed; removing the pins directly",
                    self.pin_dir.display()
                );
                let _ = datapath::remove_pins(&self.pin_dir);
            }
        }
        // What the API persisted belongs to this test's datapath only.
        let _ = fs::remove_file(crate::config::default_state_file(&self.pin_dir));
        let _ = fs::remove_file(crate::config::default_socket(&self.pin_dir));
        if thread::panicking() {
            for (i, log) in self.all_logs().iter().enumerate() {
                eprintln!(
                    "--- fastpath daemon log, run {} (netns {}) ---\n{log}",
                    i + 1,
                    self.netns
                );
            }
        }
    }
}

/// Runs `fastpath --netns NS daemon --config <config_text>` expecting it to exit by itself
/// (a bad config). Returns its exit status and stderr. Kills it after 10 s. Cleans up only its
/// temp directory: whatever the daemon created is left for the caller to inspect.
pub fn run_daemon_to_exit(
    bin: &Path,
    netns: &str,
    config_text: &str,
) -> Result<(ExitStatus, String), NetnsError> {
    let dir = TempDir::new("daemon-exit")?;
    let config_path = dir.join("fastpath.toml");
    fs::write(&config_path, config_text)
        .map_err(io_err(format!("writing {}", config_path.display())))
        .and_then(|()| {
            let mut cmd = Command::new(bin);
            cmd.arg("--netns")
                .arg(netns)
                .arg("daemon")
                .arg("--config")
                .arg(&config_path)
                .env("NO_COLOR", "1");
            output_within(cmd, DAEMON_START_TIMEOUT * slowdown())
        })
        .map(|out| {
            (
                out.status,
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, XdpMode};

    #[test]
    fn owner_pid_parses_only_our_shape() {
        assert_eq!(owner_pid("fpt-1234-0-client", "fpt"), Some(1234));
        assert_eq!(owner_pid("fpt-99-12-daemon", "fpt"), Some(99));
        assert_eq!(owner_pid("fptx-1234-0-client", "fpt"), None);
        assert_eq!(owner_pid("fpt-abc-0", "fpt"), None);
        assert_eq!(owner_pid("t1", "fpt"), None);
        assert_eq!(owner_pid("fp_h", "fpt"), None);
    }

    #[test]
    fn unique_names_differ_and_carry_our_pid() {
        let (a, b) = (unique_name("x"), unique_name("x"));
        assert_ne!(a, b);
        assert_eq!(owner_pid(&a, PREFIX), Some(std::process::id()));
        assert!(unique_pin_dir("p").starts_with(BPF_FS));
    }

    #[test]
    fn address_plan_uses_the_same_digits_in_both_families() {
        assert_eq!(LbTopology::client_v4(), Ipv4Addr::new(10, 200, 1, 2));
        assert_eq!(LbTopology::client_v6().to_string(), "fd00:200:1::2");
        assert_eq!(LbTopology::backend_v4(3), Ipv4Addr::new(10, 200, 13, 2));
        assert_eq!(LbTopology::backend_v6(3).to_string(), "fd00:200:13::2");
        assert_eq!(LbTopology::fp_client_v6().to_string(), "fd00:200:1::1");
    }

    #[test]
    fn daemon_config_renders_a_config_the_daemon_accepts() {
        let text = DaemonConfig::new(Path::new("/sys/fs/bpf/fpt-1-0-x"))
            .interface("lo")
            .to_toml();
        let c = Config::parse(Path::new("t.toml"), &text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert_eq!(
            c.datapath.pin_dir.get_ref(),
            Path::new("/sys/fs/bpf/fpt-1-0-x")
        );
        assert_eq!(c.interfaces[0].xdp, XdpMode::Auto);
        assert!(c.interfaces[0].tc_ingress && c.interfaces[0].tc_egress);
        assert!(!c.datapath.drop_malformed);
        let text = DaemonConfig::new(Path::new("/sys/fs/bpf/fpt-1-0-x"))
            .drop_malformed(true)
            .interface("lo")
            .to_toml();
        let c = Config::parse(Path::new("t.toml"), &text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert!(c.datapath.drop_malformed, "{text}");
    }
}
