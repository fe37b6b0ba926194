//! `fastpath`: the daemon and its command-line tools, one binary.

use std::{fs::File, io::IsTerminal as _, os::fd::AsRawFd as _, path::PathBuf, process::ExitCode};

use clap::{Parser, Subcommand, ValueEnum};
use fastpath::{
    config::{Config, DEFAULT_PIN_DIR, InterfaceCheck},
    conntrack,
    daemon::{self, DaemonOptions},
    datapath,
};
use tracing_subscriber::EnvFilter;

/// Exit code for usage and configuration errors (as clap uses for usage errors).
const EXIT_USAGE: u8 = 2;
/// Exit code for runtime failures (kernel refused, I/O).
const EXIT_FAILURE: u8 = 1;

/// fastpath — an eBPF fast path for Linux: XDP/TC programs run a forwarding pipeline and hand
/// whatever they do not handle to the kernel (the slow path).
///
/// The daemon loads the datapath, attaches it to the interfaces its config names and pins
/// maps and links under bpffs, so a restart or a crash of the daemon leaves traffic flowing.
///
/// EXIT STATUS: 0 success; 1 runtime failure (kernel refused, I/O); 2 usage or configuration
/// error (nothing was changed).
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

    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum Output {
    Table,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Load the datapath, attach it as configured and run until SIGINT/SIGTERM.
    ///
    /// Maps and links are pinned under `datapath.pin_dir`. Starting again on the same config
    /// reuses the pinned maps and swaps the programs in place. On SIGINT/SIGTERM the programs
    /// are detached and the pins removed, unless `datapath.detach_on_exit = false` or
    /// --leave-attached. Log verbosity: RUST_LOG (default `info`).
    Daemon {
        /// TOML config file (see config/README.md).
        #[arg(long, short = 'c', value_name = "FILE")]
        config: PathBuf,
        /// Keep programs attached and pins in place on exit.
        #[arg(long)]
        leave_attached: bool,
        /// Append every conntrack event (NEW, UPDATE on established/closed) to FILE, one
        /// `conntrack -E -o timestamp` style line each.
        #[arg(long, value_name = "FILE")]
        ct_events_log: Option<PathBuf>,
    },
    /// Print the datapath's per-reason packet and byte counters (read from the pinned map).
    Stats {
        /// Pin directory of the datapath to read.
        #[arg(long, value_name = "DIR", default_value = DEFAULT_PIN_DIR)]
        pin_dir: PathBuf,
        /// Output format.
        #[arg(long, short = 'o', value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Connection tracking: list, flush and count the connections the datapath tracks.
    Ct {
        #[command(subcommand)]
        command: CtCommand,
    },
    /// Load-balanced services: what the datapath has, with per-service and per-backend
    /// counters.
    Service {
        #[command(subcommand)]
        command: ServiceCommand,
    },
    /// Configuration tools.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
    /// Detach a datapath left running (after `kill -9`, or --leave-attached) and remove its pins.
    Detach {
        /// Pin directory of the datapath to remove.
        #[arg(long, value_name = "DIR", default_value = DEFAULT_PIN_DIR)]
        pin_dir: PathBuf,
    },
}

#[derive(Subcommand)]
enum CtCommand {
    /// List tracked connections, one per line as `conntrack -L` prints them (original and
    /// reply tuple, packets and bytes per direction, state, [ASSURED]/[UNREPLIED]).
    List {
        /// Pin directory of the datapath to read.
        #[arg(long, value_name = "DIR", default_value = DEFAULT_PIN_DIR)]
        pin_dir: PathBuf,
        /// Output format.
        #[arg(long, short = 'o', value_enum, default_value_t = Output::Table)]
        output: Output,
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
        /// Pin directory of the datapath to read.
        #[arg(long, value_name = "DIR", default_value = DEFAULT_PIN_DIR)]
        pin_dir: PathBuf,
        /// Output format.
        #[arg(long, short = 'o', value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// Delete every tracked connection (established flows are picked up again by their next
    /// ACK, as Linux does).
    Flush {
        /// Pin directory of the datapath.
        #[arg(long, value_name = "DIR", default_value = DEFAULT_PIN_DIR)]
        pin_dir: PathBuf,
    },
    /// Conntrack counters and the table's exact occupancy: `entries` (counted by reading the
    /// whole table, ~0.4 s at 1M entries) and `capacity`, then lookups, hits, new, insert
    /// failures, early drops, invalid and related packets, firewall drops, events lost.
    Stats {
        /// Pin directory of the datapath to read.
        #[arg(long, value_name = "DIR", default_value = DEFAULT_PIN_DIR)]
        pin_dir: PathBuf,
    },
}

#[derive(Subcommand)]
enum ServiceCommand {
    /// Every service (VIP, port, protocol) with its packets, bytes, connections given a
    /// backend and new connections that found none; under each, its backends with their share
    /// of new connections (0% when drained or failing health checks), packets, bytes,
    /// connections given and connections active now. Read from the pinned maps.
    List {
        /// Pin directory of the datapath to read.
        #[arg(long, value_name = "DIR", default_value = DEFAULT_PIN_DIR)]
        pin_dir: PathBuf,
        /// Output format.
        #[arg(long, short = 'o', value_enum, default_value_t = Output::Table)]
        output: Output,
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
    match cli.command {
        Command::Daemon {
            config,
            leave_attached,
            ct_events_log,
        } => {
            let config = match Config::load(&config) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("error: invalid config: {e}");
                    eprintln!("nothing was attached");
                    return ExitCode::from(EXIT_USAGE);
                }
            };
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
            let opts = DaemonOptions {
                leave_attached,
                ct_events_log,
            };
            match rt.block_on(daemon::run(config, opts)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: {}", error_chain(&e));
                    ExitCode::from(EXIT_FAILURE)
                }
            }
        }
        Command::Stats { pin_dir, output } => match datapath::pinned_stats(&pin_dir) {
            Ok(s) => {
                if output == Output::Json {
                    match serde_json::to_string_pretty(&s.rows()) {
                        Ok(j) => println!("{j}"),
                        Err(e) => {
                            eprintln!("error: encoding JSON: {e}");
                            return ExitCode::from(EXIT_FAILURE);
                        }
                    }
                } else {
                    print!("{}", s.render_table());
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {}", error_chain(&e));
                ExitCode::from(EXIT_FAILURE)
            }
        },
        Command::Service {
            command: ServiceCommand::List { pin_dir, output },
        } => match datapath::pinned_services(&pin_dir) {
            Ok(rows) => {
                if output == Output::Json {
                    match serde_json::to_string_pretty(&rows) {
                        Ok(j) => println!("{j}"),
                        Err(e) => {
                            eprintln!("error: encoding JSON: {e}");
                            return ExitCode::from(EXIT_FAILURE);
                        }
                    }
                } else {
                    print!("{}", render_services(&rows));
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {}", error_chain(&e));
                ExitCode::from(EXIT_FAILURE)
            }
        },
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
                println!(
                    "{}: ok ({} interface(s), pin_dir {})",
                    file.display(),
                    c.interfaces.len(),
                    c.datapath.pin_dir.get_ref().display()
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: invalid config: {e}");
                ExitCode::from(EXIT_USAGE)
            }
        },
        Command::Ct { command } => ct_command(command),
        Command::Detach { pin_dir } => {
            if !datapath::looks_like_pin_dir(&pin_dir) {
                eprintln!(
                    "error: {} does not look like a fastpath pin directory (expected only maps/ and links/): nothing removed",
                    pin_dir.display()
                );
                return ExitCode::from(EXIT_FAILURE);
            }
            let removed =
                datapath::lock_pin_dir(&pin_dir).and_then(|_lock| datapath::remove_pins(&pin_dir));
            match removed {
                Ok(()) => {
                    println!("detached and removed {}", pin_dir.display());
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("error: {}", error_chain(&e));
                    ExitCode::from(EXIT_FAILURE)
                }
            }
        }
    }
}

fn ct_command(command: CtCommand) -> ExitCode {
    let result = match command {
        CtCommand::List { pin_dir, output } => {
            let read = datapath::pinned_config(&pin_dir)
                .and_then(|cfg| Ok((cfg, datapath::pinned_ct_entries(&pin_dir)?)));
            read.map(|(cfg, entries)| {
                let now = conntrack::monotonic_ns();
                // A load-balanced connection's alias entry is shown through the connection.
                let mut rows: Vec<conntrack::CtRow> = entries
                    .iter()
                    .filter(|(_, e)| e.flags & fastpath_common::ct::CT_F_LB_ALIAS == 0)
                    .map(|(k, e)| conntrack::row(k, e, now, &cfg.ct_timeouts_s))
                    .collect();
                rows.sort_by(|a, b| {
                    (a.proto, &a.original.src, a.original.sport).cmp(&(
                        b.proto,
                        &b.original.src,
                        b.original.sport,
                    ))
                });
                if output == Output::Json {
                    match serde_json::to_string_pretty(&rows) {
                        Ok(j) => println!("{j}"),
                        Err(e) => eprintln!("error: encoding JSON: {e}"),
                    }
                } else {
                    for r in &rows {
                        println!("{}", conntrack::render(r));
                    }
                    eprintln!(
                        "fastpath conntrack: {} flow entries have been shown.",
                        rows.len()
                    );
                }
            })
        }
        CtCommand::Get {
            proto,
            src,
            dst,
            sport,
            dport,
            id,
            pin_dir,
            output,
        } => {
            let key = match conntrack::lookup_key(&proto, src, dst, sport, dport, id) {
                Ok(k) => k,
                Err(msg) => {
                    eprintln!("error: {msg}");
                    return ExitCode::from(EXIT_USAGE);
                }
            };
            let read = datapath::pinned_config(&pin_dir).and_then(|cfg| {
                let found = datapath::pinned_ct_get(&pin_dir, &key)?;
                // Asked by the backend's tuple: show the connection the alias belongs to.
                let found = match found.and_then(|e| {
                    fastpath_common::lb::lb_peer_key(&key, &e)
                        .filter(|_| e.flags & fastpath_common::ct::CT_F_LB_ALIAS != 0)
                }) {
                    Some(peer) => datapath::pinned_ct_get(&pin_dir, &peer)?.map(|e| (peer, e)),
                    None => found.map(|e| (key, e)),
                };
                Ok((cfg, found))
            });
            match read {
                Ok((cfg, Some((key, entry)))) => {
                    let r =
                        conntrack::row(&key, &entry, conntrack::monotonic_ns(), &cfg.ct_timeouts_s);
                    if output == Output::Json {
                        match serde_json::to_string_pretty(&r) {
                            Ok(j) => println!("{j}"),
                            Err(e) => eprintln!("error: encoding JSON: {e}"),
                        }
                    } else {
                        println!("{}", conntrack::render(&r));
                    }
                    Ok(())
                }
                Ok((_, None)) => {
                    eprintln!(
                        "fastpath conntrack: 0 flow entries: {proto} {src} -> {dst} is not tracked (either direction); `fastpath ct list` shows what is"
                    );
                    return ExitCode::from(EXIT_FAILURE);
                }
                Err(e) => Err(e),
            }
        }
        CtCommand::Flush { pin_dir } => datapath::flush_pinned_ct(&pin_dir).map(|n| {
            println!("fastpath conntrack: {n} flow entries have been deleted.");
        }),
        CtCommand::Stats { pin_dir } => datapath::pinned_ct_occupancy(&pin_dir)
            .and_then(|occ| Ok((occ, datapath::pinned_ct_stats(&pin_dir)?)))
            .map(|((entries, capacity), sums)| {
                print!("{}", conntrack::render_stats(entries, capacity, &sums));
            }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", error_chain(&e));
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

/// The `service list` table.
fn render_services(rows: &[datapath::ServiceRow]) -> String {
    let mut out = format!(
        "{:<32} {:>5} {:>12} {:>14} {:>11} {:>10}\n",
        "SERVICE / BACKEND", "SHARE", "PACKETS", "BYTES", "CONNS", "ACTIVE"
    );
    for r in rows {
        let vip = if r.vip.is_ipv6() {
            format!("[{}]:{} {}", r.vip, r.port, r.protocol)
        } else {
            format!("{}:{} {}", r.vip, r.port, r.protocol)
        };
        out += &format!(
            "{vip:<32} {:>5} {:>12} {:>14} {:>11} {:>10}\n",
            "", r.packets, r.bytes, r.connections, ""
        );
        for b in &r.backends {
            let addr = if b.address.is_ipv6() {
                format!("  [{}]:{}", b.address, b.port)
            } else {
                format!("  {}:{}", b.address, b.port)
            };
            out += &format!(
                "{addr:<32} {:>4.0}% {:>12} {:>14} {:>11} {:>10}\n",
                b.share_pct, b.packets, b.bytes, b.connections, b.active
            );
        }
        if let Some(snat) = &r.snat {
            out += &format!("  (full-NAT: backends see {snat})\n");
        }
        if r.no_backend > 0 {
            out += &format!("  (new connections with no backend: {})\n", r.no_backend);
        }
    }
    out
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

fn error_chain(e: &dyn std::error::Error) -> String {
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
