//! `fastpath`: the daemon and its command-line client, one binary.

use std::{fs::File, io::IsTerminal as _, os::fd::AsRawFd as _, path::PathBuf, process::ExitCode};

use clap::{Args, Parser, Subcommand, ValueEnum};
use fastpath::{
    config::{Config, DEFAULT_PIN_DIR, InterfaceCheck},
    daemon::{self, DaemonOptions},
    datapath,
};
use tracing_subscriber::EnvFilter;

/// `print!` for the CLI's output: a reader that went away (`fastpath ct list | head`) ends the
/// process as it ends every Unix tool, by SIGPIPE, quietly (Rust ignores SIGPIPE, so a plain
/// `print!` would panic with a backtrace instead).
macro_rules! out {
    ($($arg:tt)*) => { $crate::write_stdout(format_args!($($arg)*)) };
}

/// `println!` for the CLI's output, as [`out!`].
macro_rules! outln {
    () => { $crate::write_stdout(format_args!("\n")) };
    ($($arg:tt)*) => { $crate::write_stdout(format_args!("{}\n", format_args!($($arg)*))) };
}

mod cli;

/// Exit code for runtime failures (kernel refused, I/O, an unexpected server error).
const EXIT_FAILURE: u8 = 1;
/// Exit code for usage and configuration errors (as clap uses for usage errors).
const EXIT_USAGE: u8 = 2;
/// Exit code when the daemon cannot be reached.
const EXIT_CONNECT: u8 = 3;
/// Exit code when the daemon refused the request (invalid, conflicting, not found).
const EXIT_REJECTED: u8 = 4;
/// Exit code of `ha status --check` when this node does not hold its peers' state.
const EXIT_NOT_IN_SYNC: u8 = 5;
/// Exit code of `datapath --check` when the pinned datapath cannot forward.
const EXIT_NOT_FORWARDING: u8 = 6;
/// Exit code of `drain` when its deadline passed while load-balanced packets still arrived.
const EXIT_DRAIN_DEADLINE: u8 = 7;

/// fastpath — an eBPF fast path for Linux: XDP/TC programs run a forwarding pipeline (conntrack,
/// load balancing, NAT) and hand whatever they do not handle to the kernel (the slow path).
///
/// `fastpath daemon` loads the datapath, attaches it to the interfaces its config names, pins
/// maps and links under bpffs (a restart or a crash of the daemon leaves traffic flowing) and
/// serves the management API (gRPC, `fastpath.v1`) on a Unix socket. Every other command is a
/// client of that API; `--pin-dir` makes the read-only ones read the pinned maps directly,
/// without a daemon.
///
/// EXIT STATUS: 0 success; 1 runtime failure (kernel refused, I/O, server error); 2 usage or
/// configuration error (nothing was changed); 3 the daemon cannot be reached; 4 the daemon
/// refused the request (invalid, conflicting, not found: nothing was changed); 5 `ha status
/// --check`: this node is not in sync with its HA peers; 6 `datapath --check`: the datapath
/// cannot forward; 7 `drain`: its deadline passed while flows still arrived.
#[derive(Parser)]
#[command(
    name = "fastpath",
    version,
    about,
    long_about,
    propagate_version = true
)]
struct Cli {
    /// Run in the named network namespace (/run/netns/NAME, as made by `ip netns add`).
    /// Unlike `ip netns exec`, only the network namespace changes, so pins go to the host's
    /// bpffs and survive the process.
    #[arg(long, global = true, value_name = "NAME")]
    netns: Option<String>,

    /// Log format for the daemon.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,

    /// The daemon's TOML config file. `daemon` runs with it; every other command finds the
    /// daemon through it: its API socket (`[api] socket`, else the default that follows
    /// `datapath.pin_dir`) and its pin directory — so scripts (a keepalived track script)
    /// need only the file the daemon uses.
    #[arg(
        long,
        short = 'c',
        global = true,
        value_name = "FILE",
        env = "FASTPATH_CONFIG"
    )]
    config: Option<PathBuf>,

    #[command(flatten)]
    conn: Connection,

    #[command(subcommand)]
    command: Command,
}

/// How client commands reach the daemon.
#[derive(Args, Clone)]
struct Connection {
    /// The daemon's API socket ([api] socket in its config) [default: the one --config
    /// names, else /run/fastpath/fastpath.sock].
    #[arg(long, global = true, value_name = "PATH", env = "FASTPATH_SOCKET")]
    socket: Option<PathBuf>,
    /// Reach the daemon over TCP instead: https://HOST:PORT (with --ca, --cert, --key).
    #[arg(long, global = true, value_name = "URL", env = "FASTPATH_SERVER")]
    server: Option<String>,
    /// PEM CA certificate that signed the server's certificate.
    #[arg(long, global = true, value_name = "FILE", requires = "server")]
    ca: Option<PathBuf>,
    /// PEM client certificate.
    #[arg(long, global = true, value_name = "FILE", requires = "server")]
    cert: Option<PathBuf>,
    /// PEM private key of --cert.
    #[arg(long, global = true, value_name = "FILE", requires = "server")]
    key: Option<PathBuf>,
    /// Name the server's certificate must carry (default: the host of --server).
    #[arg(long, global = true, value_name = "NAME", requires = "server")]
    server_name: Option<String>,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
pub enum Output {
    Table,
    Json,
}

/// `-o table|json`.
#[derive(Args, Clone, Copy)]
pub struct OutputArg {
    /// Output format.
    #[arg(long, short = 'o', value_enum, default_value_t = Output::Table)]
    pub output: Output,
}

/// Options of every change.
#[derive(Args, Clone, Copy)]
pub struct ChangeArgs {
    /// Check the change and show what it would do; change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Refuse the change if the desired state is no longer at this generation (another client
    /// changed it since you read it). 0: no check.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub expected_generation: u64,
    #[command(flatten)]
    pub out: OutputArg,
}

#[derive(Subcommand)]
enum Command {
    /// Load the datapath, attach it as configured, serve the API and run until SIGINT/SIGTERM.
    ///
    /// Maps and links are pinned under `datapath.pin_dir`. Starting again on the same config
    /// reuses the pinned maps and swaps the programs in place: established connections never
    /// notice. On SIGINT/SIGTERM the programs are detached and the pins removed, unless
    /// `datapath.detach_on_exit = false` or --leave-attached (what a service manager should
    /// use, so that a stop/start keeps traffic flowing). SIGHUP reloads the config file and
    /// applies only the difference. Log verbosity: RUST_LOG (default `info`).
    ///
    /// Example: `fastpath daemon --config /etc/fastpath/fastpath.toml --leave-attached`.
    Daemon {
        /// Keep programs attached and pins in place on exit.
        #[arg(long)]
        leave_attached: bool,
        /// Append every conntrack event (NEW, UPDATE on the first reply and on
        /// established/closed) to FILE, one `conntrack -E -o timestamp` style line each.
        #[arg(long, value_name = "FILE")]
        ct_events_log: Option<PathBuf>,
    },
    /// Version, uptime, listeners and the desired state's generation of the running daemon;
    /// how its TC programs attach; the kernel's release and the features the daemon probed
    /// at start (yes, or no with the Linux release that added it and what the datapath does
    /// without it, as `fastpath kernel` prints them).
    Info {
        #[command(flatten)]
        out: OutputArg,
    },
    /// Print the datapath's per-reason packet and byte counters.
    Stats {
        /// Read the pinned maps of this datapath directly, without the daemon.
        #[arg(long, value_name = "DIR")]
        pin_dir: Option<PathBuf>,
        /// Print again every SECONDS (a stream from the daemon) until interrupted.
        #[arg(long, value_name = "SECONDS")]
        watch: Option<f64>,
        #[command(flatten)]
        out: OutputArg,
    },
    /// Connection tracking: list, look up, flush, count and watch connections.
    Ct {
        #[command(subcommand)]
        command: CtCommand,
    },
    /// Load-balanced services: list, show, add, delete.
    Service {
        #[command(subcommand)]
        command: cli::ServiceCommand,
    },
    /// The backends of a service: add, delete, drain.
    Backend {
        #[command(subcommand)]
        command: cli::BackendCommand,
    },
    /// NAT: port forwards (static DNAT) and the interfaces' gateway SNAT.
    Nat {
        #[command(subcommand)]
        command: cli::NatCommand,
    },
    /// The interfaces the datapath is attached to, with their hooks.
    Interface {
        #[command(flatten)]
        out: OutputArg,
    },
    /// HA replication: this node's conntrack streams to and from its peers.
    Ha {
        #[command(subcommand)]
        command: cli::HaCommand,
    },
    /// The cluster as this node sees it: its announcements ([announce]: readiness, the routes
    /// the routing daemon announces, a drain) and, with [ha], each peer's streams.
    Cluster {
        #[command(subcommand)]
        command: cli::ClusterCommand,
    },
    /// Take this node out of its ECMP set gracefully ([announce]): withdraw every announcement
    /// at once, keep forwarding the flows that still arrive (the other nodes hold this node's
    /// connections through replication, and the routers move the flows to them), and wait
    /// until no load-balanced packet has arrived for --quiet seconds, or --deadline passes.
    ///
    /// Prints how the drain ended and exits 0 when it went quiet, 7 when the deadline passed
    /// with packets still arriving. The node stays drained (forwarding what arrives,
    /// announcing nothing) until `drain --cancel` or a restart of the daemon; drain, stop,
    /// maintain, start is the way to take a node out and back.
    ///
    /// Example: `fastpath -c /etc/fastpath/fastpath.toml drain --deadline 600`.
    Drain {
        /// Seconds without a load-balanced packet that end the drain.
        #[arg(long, value_name = "SECONDS", default_value_t = 5.0)]
        quiet: f64,
        /// Seconds after which the drain ends whatever still arrives.
        #[arg(long, value_name = "SECONDS", default_value_t = 300.0)]
        deadline: f64,
        /// Start the drain and return at once (`cluster status` shows how it goes).
        #[arg(long)]
        no_wait: bool,
        /// End the drain: announce again what the node is ready to carry.
        #[arg(long, conflicts_with_all = ["quiet", "deadline", "no_wait"])]
        cancel: bool,
        #[command(flatten)]
        out: OutputArg,
    },
    /// Health of the probed backends.
    Health {
        /// Keep printing changes until interrupted.
        #[arg(long)]
        watch: bool,
        #[command(flatten)]
        out: OutputArg,
    },
    /// Make a config file the desired state — its services, port forwards, interfaces (hooks
    /// attached and detached live) and runtime settings — applying only the difference.
    /// `datapath.pin_dir` and `conntrack.capacity` change only with a restart (refused here).
    ///
    /// Example: `fastpath apply -f /etc/fastpath/fastpath.toml --dry-run`, then without.
    Apply {
        /// The config file (TOML, as `fastpath daemon --config`).
        #[arg(long, short = 'f', value_name = "FILE")]
        file: PathBuf,
        #[command(flatten)]
        change: ChangeArgs,
    },
    /// Configuration tools.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
    /// Detach a datapath left running (after `kill -9`, or --leave-attached) and remove its pins.
    ///
    /// While one of its services' VIPs is an address of this node (a VRRP master's), the
    /// links are unpinned first and held up to --handover-timeout seconds until the VIP has
    /// moved: keepalived's `fastpath datapath --check` script fails at once, the standby takes
    /// the VIP, and only then does this node stop forwarding — no connection meets a node
    /// that holds the VIP but no longer translates.
    Detach {
        /// Pin directory of the datapath to remove [default: --config's datapath.pin_dir, else
        /// /sys/fs/bpf/fastpath].
        #[arg(long, value_name = "DIR")]
        pin_dir: Option<PathBuf>,
        /// Seconds to wait for the VIPs to leave this node before detaching anyway.
        #[arg(long, value_name = "SECONDS", default_value_t = 5.0)]
        handover_timeout: f64,
    },
    /// The datapath as the kernel runs it, with or without a daemon: each pinned link (its
    /// interface, hook and whether the interface is up) and the tail-call arrays. Reads the
    /// pins only.
    ///
    /// `--check` exits 0 when the datapath forwards — links pinned, each attached to an
    /// interface that exists and is up (with carrier), the tail-call arrays pinned — and 6
    /// when it cannot, saying why on standard error. A daemon that is down or restarting does
    /// not count: the datapath forwards without it. This is keepalived's FAULT script (see
    /// config/keepalived/).
    ///
    /// Example: `fastpath -c /etc/fastpath/fastpath.toml datapath --check`.
    Datapath {
        /// Pin directory [default: --config's datapath.pin_dir, else /sys/fs/bpf/fastpath].
        #[arg(long, value_name = "DIR")]
        pin_dir: Option<PathBuf>,
        /// Exit 0 if the datapath can forward, 6 if not.
        #[arg(long)]
        check: bool,
        #[command(flatten)]
        out: OutputArg,
    },
    /// Whether this kernel runs the datapath: the kernel features the daemon probes at start
    /// (and what it does without each), and every program of the datapath loaded into the
    /// kernel's verifier — not attached, its maps in a scratch directory removed afterwards —
    /// with the instructions the verifier processed, or its refusal and the end of its log.
    /// Touches no running datapath. Needs root.
    ///
    /// Exit status 0 when every program loads, 1 when one is refused.
    ///
    /// Example: `fastpath kernel`; the whole log of a refusal: `fastpath kernel --full-log`.
    Kernel {
        /// Print a refusal's whole verifier log, not only its last lines.
        #[arg(long)]
        full_log: bool,
        #[command(flatten)]
        out: OutputArg,
    },
}

#[derive(Subcommand)]
pub enum CtCommand {
    /// List tracked connections, one per line as `conntrack -L` prints them (original and
    /// reply tuple, packets and bytes per direction, state, [ASSURED]/[UNREPLIED]).
    List {
        /// Read the pinned maps of this datapath directly, without the daemon.
        #[arg(long, value_name = "DIR")]
        pin_dir: Option<PathBuf>,
        #[command(flatten)]
        out: OutputArg,
    },
    /// Show one connection, found from either direction's tuple (as `conntrack -G`): prints
    /// its `conntrack -L` line. Exit status 1 if it is not tracked.
    ///
    /// Example: `fastpath ct get -p tcp -s 10.0.0.2 -d 10.0.0.1 --sport 40000 --dport 80`;
    /// ICMP echo: `fastpath ct get -p icmp -s 10.0.0.2 -d 10.0.0.1 --id 4242`.
    Get {
        /// Protocol: tcp, udp, icmp or icmpv6 (icmp with IPv6 addresses means icmpv6).
        #[arg(long, short = 'p', value_parser = ["tcp", "udp", "icmp", "icmpv6"])]
        proto: String,
        /// Source address (IPv4 or IPv6; both addresses of one family).
        #[arg(long = "src", short = 's', value_name = "ADDR")]
        src: std::net::IpAddr,
        /// Destination address.
        #[arg(long = "dst", short = 'd', value_name = "ADDR")]
        dst: std::net::IpAddr,
        /// Source port (tcp, udp).
        #[arg(long, value_name = "PORT", required_if_eq_any = [("proto", "tcp"), ("proto", "udp")])]
        sport: Option<u16>,
        /// Destination port (tcp, udp).
        #[arg(long, value_name = "PORT", required_if_eq_any = [("proto", "tcp"), ("proto", "udp")])]
        dport: Option<u16>,
        /// Echo identifier (icmp, icmpv6).
        #[arg(long, value_name = "ID", required_if_eq_any = [("proto", "icmp"), ("proto", "icmpv6")], conflicts_with_all = ["sport", "dport"])]
        id: Option<u16>,
        /// Read the pinned maps of this datapath directly, without the daemon.
        #[arg(long, value_name = "DIR")]
        pin_dir: Option<PathBuf>,
        #[command(flatten)]
        out: OutputArg,
    },
    /// Delete every tracked connection (established flows are picked up again by their next
    /// ACK, as Linux does).
    Flush {
        /// Flush the pinned table of this datapath directly, without the daemon.
        #[arg(long, value_name = "DIR")]
        pin_dir: Option<PathBuf>,
    },
    /// Conntrack counters and the table's exact occupancy: `entries` (counted by reading the
    /// whole table, ~0.4 s at 1M entries) and `capacity`, then lookups, hits, new, insert
    /// failures, early drops, invalid and related packets, firewall drops, events lost.
    #[command(after_long_help = ct_stats_help())]
    Stats {
        /// Read the pinned maps of this datapath directly, without the daemon.
        #[arg(long, value_name = "DIR")]
        pin_dir: Option<PathBuf>,
    },
    /// Print conntrack events (NEW, UPDATE, DESTROY) as they happen, `conntrack -E` style,
    /// until interrupted.
    Watch {
        #[command(flatten)]
        out: OutputArg,
    },
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// Validate a config file (syntax, keys, values, interfaces) without touching the kernel.
    Check {
        /// TOML config file.
        file: PathBuf,
        /// Do not require the interfaces to exist here (checking a file for another machine).
        #[arg(long)]
        skip_interfaces: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing(cli.log_format);
    if let Some(ns) = &cli.netns
        && let Err(e) = enter_netns(ns)
    {
        eprintln!(
            "error: entering network namespace {ns:?}: {e}; list namespaces with `ip netns list`"
        );
        return ExitCode::from(EXIT_USAGE);
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: starting the async runtime: {e}");
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    // A client finds the daemon through its config file, when given one.
    let client_config = match (&cli.command, &cli.config) {
        (Command::Daemon { .. }, _) | (_, None) => None,
        (_, Some(path)) => match Config::load_with(path, InterfaceCheck::Skip) {
            Ok(c) => Some(c),
            Err(e) => {
                eprintln!("error: invalid config: {e}");
                return ExitCode::from(EXIT_USAGE);
            }
        },
    };
    let target = cli.conn.target(client_config.as_ref());
    let pin_dir_or_default = |dir: Option<PathBuf>| {
        dir.or_else(|| {
            client_config
                .as_ref()
                .map(|c| c.datapath.pin_dir.get_ref().clone())
        })
        .unwrap_or_else(|| PathBuf::from(DEFAULT_PIN_DIR))
    };
    match cli.command {
        Command::Daemon {
            leave_attached,
            ct_events_log,
        } => {
            let Some(config) = cli.config else {
                eprintln!(
                    "error: `fastpath daemon` needs its config file: --config FILE (see config/README.md)"
                );
                return ExitCode::from(EXIT_USAGE);
            };
            let loaded = match Config::load(&config) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("error: invalid config: {e}");
                    eprintln!("nothing was attached");
                    return ExitCode::from(EXIT_USAGE);
                }
            };
            let opts = DaemonOptions {
                config_path: config,
                leave_attached,
                ct_events_log,
            };
            match rt.block_on(daemon::run(loaded, opts)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: {}", error_chain(&e));
                    ExitCode::from(EXIT_FAILURE)
                }
            }
        }
        Command::Config {
            command:
                ConfigCommand::Check {
                    file,
                    skip_interfaces,
                },
        } => match Config::load_with(
            &file,
            if skip_interfaces {
                InterfaceCheck::Skip
            } else {
                InterfaceCheck::MustExist
            },
        ) {
            Ok(c) => {
                outln!(
                    "{}: ok ({} interface(s), {} service(s), pin_dir {}, API socket {})",
                    file.display(),
                    c.interfaces.len(),
                    c.services.len(),
                    c.datapath.pin_dir.get_ref().display(),
                    c.api_socket().display()
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: invalid config: {e}");
                ExitCode::from(EXIT_USAGE)
            }
        },
        Command::Datapath {
            pin_dir,
            check,
            out,
        } => cli::datapath(&pin_dir_or_default(pin_dir), check, out),
        Command::Kernel { full_log, out } => cli::kernel(full_log, out),
        Command::Detach {
            pin_dir,
            handover_timeout,
        } => {
            let pin_dir = pin_dir_or_default(pin_dir);
            if !datapath::looks_like_pin_dir(&pin_dir) {
                eprintln!(
                    "error: {} does not look like a fastpath pin directory (expected only maps/, links/ and tails/): nothing removed",
                    pin_dir.display()
                );
                return ExitCode::from(EXIT_FAILURE);
            }
            let removed = datapath::lock_pin_dir(&pin_dir).and_then(|_lock| {
                datapath::remove_pins_after_handover(
                    &pin_dir,
                    std::time::Duration::from_secs_f64(handover_timeout.max(0.0)),
                )
            });
            match removed {
                Ok(()) => {
                    outln!("detached and removed {}", pin_dir.display());
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("error: {}", error_chain(&e));
                    ExitCode::from(EXIT_FAILURE)
                }
            }
        }
        Command::Info { out } => rt.block_on(cli::info(&target, out)),
        Command::Stats {
            pin_dir,
            watch,
            out,
        } => rt.block_on(cli::stats(&target, pin_dir, watch, out)),
        Command::Ct { command } => rt.block_on(cli::ct(&target, command)),
        Command::Service { command } => rt.block_on(cli::service(&target, command)),
        Command::Backend { command } => rt.block_on(cli::backend(&target, command)),
        Command::Nat { command } => rt.block_on(cli::nat(&target, command)),
        Command::Interface { out } => rt.block_on(cli::interfaces(&target, out)),
        Command::Health { watch, out } => rt.block_on(cli::health(&target, watch, out)),
        Command::Ha {
            command: cli::HaCommand::Status { check, out },
        } => rt.block_on(cli::ha_status(&target, check, out)),
        Command::Cluster {
            command: cli::ClusterCommand::Status { out },
        } => rt.block_on(cli::cluster_status(&target, out)),
        Command::Drain {
            quiet,
            deadline,
            no_wait,
            cancel,
            out,
        } => rt.block_on(cli::drain(
            &target,
            cli::DrainArgs {
                quiet,
                deadline,
                wait: !no_wait,
                cancel,
            },
            out,
        )),
        Command::Apply { file, change } => rt.block_on(cli::apply(&target, &file, change)),
    }
}

impl Connection {
    /// Where the daemon is: --server, else --socket, else the socket of `config` (the file
    /// --config names), else the default socket.
    fn target(&self, config: Option<&Config>) -> fastpath::api::client::Target {
        use fastpath::api::client::{Target, TlsFiles};
        match &self.server {
            Some(url) => Target::Tcp {
                url: url.clone(),
                tls: match (&self.ca, &self.cert, &self.key) {
                    (Some(ca), Some(cert), Some(key)) => Some(TlsFiles {
                        ca: ca.clone(),
                        cert: cert.clone(),
                        key: key.clone(),
                        server_name: self.server_name.clone(),
                    }),
                    _ => None,
                },
            },
            None => Target::Unix(self.socket.clone().unwrap_or_else(|| {
                config.map_or_else(
                    || PathBuf::from("/run/fastpath/fastpath.sock"),
                    Config::api_socket,
                )
            })),
        }
    }
}

fn init_tracing(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// `ct stats --help`: what each counter counts, in the order the command prints them.
fn ct_stats_help() -> String {
    use fastpath_common::ct::ct_stat::{HELP, NAMES};
    let width = NAMES.iter().map(|n| n.len()).max().unwrap_or(0);
    let mut s = String::from(
        "Counters (totals since the datapath was loaded; a restart with the same pin_dir keeps them):\n",
    );
    // Wrapped here with a hanging indent (clap would wrap these lines at column 0).
    const COLUMNS: usize = 96;
    let indent = " ".repeat(width + 4);
    for (name, help) in NAMES.iter().zip(HELP) {
        let mut line = format!("  {name:<width$} ");
        for word in help.split_whitespace() {
            if line.len() + 1 + word.len() > COLUMNS && line.len() > indent.len() {
                s += line.trim_end();
                s.push('\n');
                line = indent.clone();
            } else {
                line.push(' ');
            }
            line += word;
        }
        s += &line;
        s.push('\n');
    }
    s
}

/// Moves this thread (before any other is spawned) into /run/netns/NAME.
fn enter_netns(name: &str) -> std::io::Result<()> {
    let f = File::open(PathBuf::from("/run/netns").join(name))?;
    // SAFETY: setns on a valid namespace fd; called before the runtime spawns threads, so the
    // whole process ends up in the namespace.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Writes to standard output; on a closed pipe, dies of SIGPIPE as a Unix tool does.
pub fn write_stdout(args: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    match stdout.write_fmt(args).and_then(|()| stdout.flush()) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
            // SAFETY: restoring the default action of a signal and raising it; the default
            // action of SIGPIPE ends the process.
            unsafe {
                libc::signal(libc::SIGPIPE, libc::SIG_DFL);
                libc::raise(libc::SIGPIPE);
            }
            std::process::exit(EXIT_FAILURE.into());
        }
        Err(e) => {
            eprintln!("error: writing to standard output: {e}");
            std::process::exit(EXIT_FAILURE.into());
        }
    }
}

pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(src) = cur {
        let t = src.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = src.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    use super::*;

    #[test]
    fn ct_stats_help_explains_every_counter() {
        let mut cmd = Cli::command();
        let stats = cmd
            .find_subcommand_mut("ct")
            .and_then(|c| c.find_subcommand_mut("stats"))
            .expect("ct stats");
        let help = stats.render_long_help().to_string();
        for name in fastpath_common::ct::ct_stat::NAMES {
            assert!(
                help.lines()
                    .any(|l| l.trim_start().starts_with(&format!("{name} "))),
                "`ct stats --help` does not explain {name}:\n{help}"
            );
        }
    }
}
