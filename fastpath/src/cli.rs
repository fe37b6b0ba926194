//! The client commands: each one API call (or a stream), printed as a table or as JSON.

use std::{net::IpAddr, path::PathBuf, process::ExitCode};

use clap::Subcommand;
use fastpath::{
    api::{
        client::{self, Client, Target},
        convert, pb, read,
    },
    conntrack,
};
use serde_json::json;
use tokio_stream::StreamExt as _;

use crate::{
    ChangeArgs, CtCommand, EXIT_CONNECT, EXIT_DRAIN_DEADLINE, EXIT_FAILURE, EXIT_NOT_FORWARDING,
    EXIT_NOT_IN_SYNC, EXIT_REJECTED, EXIT_USAGE, Output, OutputArg, error_chain,
};

#[derive(Subcommand)]
pub enum ServiceCommand {
    /// Every service (VIP, port, protocol) with its packets, bytes, connections given a
    /// backend and new connections that found none; under each, its backends with their share
    /// of new connections (0% when drained or failing health checks), packets, bytes,
    /// connections given and connections active now.
    List {
        /// Read the pinned maps of this datapath directly, without the daemon (counters only).
        #[arg(long, value_name = "DIR")]
        pin_dir: Option<PathBuf>,
        #[command(flatten)]
        out: OutputArg,
    },
    /// One service: its configuration, counters and backends with their health.
    Show {
        /// VIP:PORT[/tcp|udp], e.g. 10.0.0.10:80 or [fd00::10]:53/udp.
        service: String,
        #[command(flatten)]
        out: OutputArg,
    },
    /// Create a service.
    ///
    /// Example: `fastpath service add 10.0.0.10:80 --backend 10.1.0.1:8080 --backend
    /// 10.1.0.2:8080@3 --scheduler wrr`.
    Add {
        /// VIP:PORT[/tcp|udp].
        service: String,
        /// A backend, ADDR:PORT[@WEIGHT] (weight default 1); repeat for more.
        #[arg(long = "backend", short = 'b', value_name = "ADDR:PORT[@WEIGHT]")]
        backends: Vec<String>,
        /// maglev (default), wrr or least_connections.
        #[arg(long, value_parser = ["maglev", "wrr", "least_connections"], default_value = "maglev")]
        scheduler: String,
        /// nat (default), full_nat or dsr.
        #[arg(long, value_parser = ["nat", "full_nat", "dsr"], default_value = "nat")]
        mode: String,
        /// full_nat: the source address backends see.
        #[arg(long, value_name = "ADDR")]
        snat_address: Option<String>,
        /// full_nat: the source ports, FIRST-LAST.
        #[arg(long, value_name = "FIRST-LAST")]
        snat_ports: Option<String>,
        /// With no backend available: kernel (default), drop or reject.
        #[arg(long, value_parser = ["kernel", "drop", "reject"], default_value = "kernel")]
        no_backend: String,
        /// Source-IP affinity, seconds (0: off).
        #[arg(long, value_name = "SECONDS", default_value_t = 0)]
        affinity_timeout: u32,
        /// Maglev table size (a prime); default automatic.
        #[arg(long, value_name = "PRIME")]
        maglev_table_size: Option<u32>,
        #[command(flatten)]
        change: ChangeArgs,
    },
    /// Delete services; their established connections keep flowing until they close.
    Del {
        /// VIP:PORT[/tcp|udp]; several for a batch.
        #[arg(required = true)]
        services: Vec<String>,
        #[command(flatten)]
        change: ChangeArgs,
    },
}

#[derive(Subcommand)]
pub enum BackendCommand {
    /// Add backends to a service: they get new connections at once.
    Add {
        /// VIP:PORT[/tcp|udp] of the service.
        service: String,
        /// ADDR:PORT[@WEIGHT]; several for a batch.
        #[arg(required = true)]
        backends: Vec<String>,
        #[command(flatten)]
        change: ChangeArgs,
    },
    /// Remove backends: no new connections; established ones keep them until they close.
    Del {
        service: String,
        /// ADDR:PORT; several for a batch.
        #[arg(required = true)]
        backends: Vec<String>,
        #[command(flatten)]
        change: ChangeArgs,
    },
    /// Drain backends (weight 0): no new connections, established ones continue; they stay
    /// listed until deleted.
    Drain {
        service: String,
        #[arg(required = true)]
        backends: Vec<String>,
        #[command(flatten)]
        change: ChangeArgs,
    },
}

#[derive(Subcommand)]
pub enum NatCommand {
    /// Port forwards and gateway SNAT interfaces.
    List {
        #[command(flatten)]
        out: OutputArg,
    },
    /// Add a port forward: connections to ADDR:PORT go to TO:TO_PORT, the client's address
    /// kept. Example: `fastpath nat add 192.0.2.1:2222 10.1.0.5:22`.
    Add {
        /// ADDR:PORT[/tcp|udp] clients connect to.
        from: String,
        /// ADDR[:PORT] it goes to (port default: the same).
        to: String,
        #[command(flatten)]
        change: ChangeArgs,
    },
    /// Delete port forwards.
    Del {
        /// ADDR:PORT[/tcp|udp]; several for a batch.
        #[arg(required = true)]
        forwards: Vec<String>,
        #[command(flatten)]
        change: ChangeArgs,
    },
}

/// A failed command: what to print and the exit code.
struct Failure(u8, String);

type Outcome = Result<(), Failure>;

fn usage(msg: impl Into<String>) -> Failure {
    Failure(EXIT_USAGE, msg.into())
}

fn from_status(s: tonic::Status) -> Failure {
    use tonic::Code as C;
    // A TLS handshake the server refused (a client certificate it does not trust) shows only
    // at the first request, as a transport error.
    // (A status the server sent has no source; one the client made from a failed connection
    // carries the transport's error.)
    if matches!(s.code(), C::Unknown | C::Unavailable | C::Cancelled)
        && std::error::Error::source(&s).is_some()
    {
        return Failure(
            EXIT_CONNECT,
            format!(
                "the connection to the daemon failed: {}; over TCP, check that the server trusts your client certificate (--cert, --key) and that --ca signed its certificate",
                error_chain(&s)
            ),
        );
    }
    let code = match s.code() {
        C::InvalidArgument | C::AlreadyExists | C::NotFound | C::FailedPrecondition => {
            EXIT_REJECTED
        }
        C::ResourceExhausted | C::OutOfRange => EXIT_REJECTED,
        C::Unavailable => EXIT_CONNECT,
        _ => EXIT_FAILURE,
    };
    let what = match s.code() {
        C::InvalidArgument => "invalid request",
        C::AlreadyExists => "already exists",
        C::NotFound => "not found",
        C::FailedPrecondition => "refused",
        C::ResourceExhausted => "too large",
        C::Unavailable => "daemon unavailable",
        _ => "server error",
    };
    let tail = if code == EXIT_REJECTED {
        "; nothing was changed"
    } else {
        ""
    };
    Failure(code, format!("{what}: {}{tail}", s.message()))
}

fn finish(r: Outcome) -> ExitCode {
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure(code, msg)) => {
            if !msg.is_empty() {
                eprintln!("error: {msg}");
            }
            ExitCode::from(code)
        }
    }
}

async fn connect(target: &Target) -> Result<Client, Failure> {
    client::connect(target)
        .await
        .map_err(|e| Failure(EXIT_CONNECT, e.to_string()))
}

fn print_json(v: &impl serde::Serialize) -> Outcome {
    let text = serde_json::to_string_pretty(v)
        .map_err(|e| Failure(EXIT_FAILURE, format!("encoding JSON: {e}")))?;
    outln!("{text}");
    Ok(())
}

/// A mutation's answer, printed (or what refused it).
fn changed(
    answer: Result<tonic::Response<pb::ChangeResponse>, tonic::Status>,
    out: Output,
) -> Outcome {
    print_change(&answer.map_err(from_status)?.into_inner(), out, &[])
}

/// `VIP:PORT[/PROTO]` (IPv6 in brackets).
fn parse_service(s: &str) -> Result<pb::ServiceKey, Failure> {
    let (addr, proto) = match s.rsplit_once('/') {
        Some((a, p)) => (a, p),
        None => (s, "tcp"),
    };
    let protocol = match proto {
        "tcp" => pb::Protocol::Tcp,
        "udp" => pb::Protocol::Udp,
        p => return Err(usage(format!("{s:?}: protocol {p:?}; give tcp or udp"))),
    };
    let sa: std::net::SocketAddr = addr.parse().map_err(|_| {
        usage(format!(
            "{s:?} is not VIP:PORT[/tcp|udp]; e.g. 10.0.0.10:80 or [fd00::10]:53/udp"
        ))
    })?;
    Ok(pb::ServiceKey {
        vip: sa.ip().to_string(),
        port: u32::from(sa.port()),
        protocol: protocol as i32,
    })
}

/// `ADDR:PORT[@WEIGHT]`.
fn parse_backend(s: &str) -> Result<pb::BackendSpec, Failure> {
    let (addr, weight) = match s.split_once('@') {
        Some((a, w)) => (
            a,
            Some(
                w.parse::<u32>()
                    .map_err(|_| usage(format!("{s:?}: weight {w:?} is not a number 0..=65535")))?,
            ),
        ),
        None => (s, None),
    };
    let sa: std::net::SocketAddr = addr.parse().map_err(|_| {
        usage(format!(
            "{s:?} is not ADDR:PORT[@WEIGHT]; e.g. 10.1.0.1:8080@2 or [fd00::1]:80"
        ))
    })?;
    Ok(pb::BackendSpec {
        address: sa.ip().to_string(),
        port: u32::from(sa.port()),
        weight,
    })
}

fn key_text(k: &pb::ServiceKey) -> String {
    let proto = if k.protocol == pb::Protocol::Udp as i32 {
        "udp"
    } else {
        "tcp"
    };
    let vip = k.vip.parse::<IpAddr>().map_or_else(
        |_| k.vip.clone(),
        |ip| std::net::SocketAddr::new(ip, 0).ip().to_string(),
    );
    if vip.contains(':') {
        format!("[{vip}]:{}/{proto}", k.port)
    } else {
        format!("{vip}:{}/{proto}", k.port)
    }
}

fn print_change(r: &pb::ChangeResponse, out: Output, notes: &[String]) -> Outcome {
    if out == Output::Json {
        return print_json(&json!({
            "generation": r.generation,
            "created": r.created,
            "updated": r.updated,
            "deleted": r.deleted,
            "unchanged": r.unchanged,
            "took_us": r.took_us,
            "dry_run": r.dry_run,
            "notes": notes,
        }));
    }
    let verb = if r.dry_run { "would be " } else { "" };
    for (what, list) in [
        ("created", &r.created),
        ("updated", &r.updated),
        ("deleted", &r.deleted),
    ] {
        for s in list {
            outln!("{s}: {verb}{what}");
        }
    }
    for n in notes {
        outln!("note: {n}");
    }
    if r.dry_run {
        outln!(
            "dry run: nothing changed ({} unchanged; generation {})",
            r.unchanged,
            r.generation
        );
    } else {
        outln!(
            "generation {} ({} unchanged, applied in {} µs)",
            r.generation,
            r.unchanged,
            r.took_us
        );
    }
    Ok(())
}

pub async fn info(target: &Target, out: OutputArg) -> ExitCode {
    finish(
        async {
            let mut c = connect(target).await?;
            let i = c
                .get_info(pb::GetInfoRequest {})
                .await
                .map_err(from_status)?
                .into_inner();
            if out.output == Output::Json {
                return print_json(&json!({
                    "version": i.version, "api_version": i.api_version, "pid": i.pid,
                    "uptime_s": i.uptime_s, "pin_dir": i.pin_dir, "config_path": i.config_path,
                    "generation": i.generation, "services": i.services,
                    "interfaces": i.interfaces, "conntrack_capacity": i.conntrack_capacity,
                    "listeners": i.listeners, "tc_attach": i.tc_attach,
                    "kernel_release": i.kernel_release,
                    "kernel_features": i.kernel_features.iter().map(|f| json!({
                        "name": f.name, "since": f.since, "present": f.present,
                        "without": f.without,
                    })).collect::<Vec<_>>(),
                }));
            }
            outln!("version       {} ({})", i.version, i.api_version);
            outln!("pid           {}", i.pid);
            outln!("uptime        {} s", i.uptime_s);
            outln!("config        {}", i.config_path);
            outln!("pin_dir       {}", i.pin_dir);
            outln!("generation    {}", i.generation);
            outln!("services      {}", i.services);
            outln!("interfaces    {}", i.interfaces);
            outln!("ct capacity   {}", i.conntrack_capacity);
            outln!("listeners     {}", i.listeners.join(" "));
            outln!("tc attach     {}", i.tc_attach);
            outln!("kernel        {}", i.kernel_release);
            for f in &i.kernel_features {
                print_feature(&f.name, f.present, &f.since, &f.without);
            }
            Ok(())
        }
        .await,
    )
}

fn print_stats(s: &pb::Stats, out: Output) -> Outcome {
    let rows: Vec<_> = s.reasons.iter().map(convert::stats_row).collect();
    if out == Output::Json {
        print_json(&rows)
    } else {
        out!("{}", fastpath::stats::render_rows(&rows));
        let vxlan: Vec<String> = s
            .vxlan
            .iter()
            .map(|c| format!("{} {}", c.name, c.value))
            .collect();
        outln!(
            "vxlan flow cache: {}; generation {}",
            vxlan.join(", "),
            s.vxlan_generation
        );
        let routes: Vec<String> = s
            .route_cache
            .iter()
            .map(|c| format!("{} {}", c.name, c.value))
            .collect();
        outln!(
            "route cache: {}; new connections {}",
            routes.join(", "),
            if s.route_shared {
                "share their backend's route"
            } else {
                "ask the FIB each"
            }
        );
        Ok(())
    }
}

pub async fn stats(
    target: &Target,
    pin_dir: Option<PathBuf>,
    watch: Option<f64>,
    out: OutputArg,
) -> ExitCode {
    finish(
        async {
            if let Some(pin) = pin_dir {
                let s =
                    read::stats(&pin, true).map_err(|e| Failure(EXIT_FAILURE, error_chain(&e)))?;
                return print_stats(&s, out.output);
            }
            if let Some(secs) = watch
                && !(0.1..=3600.0).contains(&secs)
            {
                return Err(usage(format!("--watch {secs}: give 0.1 ..= 3600 seconds")));
            }
            let mut c = connect(target).await?;
            if let Some(secs) = watch {
                let mut stream = c
                    .watch_stats(pb::WatchStatsRequest {
                        interval_ms: (secs * 1000.0) as u32,
                        skip_conntrack_entries: true,
                    })
                    .await
                    .map_err(from_status)?
                    .into_inner();
                while let Some(s) = stream.next().await {
                    print_stats(&s.map_err(from_status)?, out.output)?;
                    outln!();
                }
                return Ok(());
            }
            let s = c
                .get_stats(pb::GetStatsRequest {
                    skip_conntrack_entries: true,
                })
                .await
                .map_err(from_status)?
                .into_inner();
            print_stats(&s, out.output)
        }
        .await,
    )
}

fn print_connections(conns: &[pb::Connection], out: Output) -> Outcome {
    let rows: Vec<_> = conns.iter().map(convert::ct_row).collect();
    if out == Output::Json {
        return print_json(&rows);
    }
    for r in &rows {
        outln!("{}", conntrack::render(r));
    }
    eprintln!(
        "fastpath conntrack: {} flow entries have been shown.",
        rows.len()
    );
    Ok(())
}

pub async fn ct(target: &Target, command: CtCommand) -> ExitCode {
    finish(
        async {
            match command {
                CtCommand::List { pin_dir, out } => {
                    let conns = match pin_dir {
                        Some(pin) => read::connections(&pin)
                            .map_err(|e| Failure(EXIT_FAILURE, error_chain(&e)))?,
                        None => {
                            connect(target)
                                .await?
                                .list_connections(pb::ListConnectionsRequest { limit: 0 })
                                .await
                                .map_err(from_status)?
                                .into_inner()
                                .connections
                        }
                    };
                    print_connections(&conns, out.output)
                }
                CtCommand::Get {
                    proto,
                    src,
                    dst,
                    sport,
                    dport,
                    id,
                    pin_dir,
                    out,
                } => {
                    let key = conntrack::lookup_key(&proto, src, dst, sport, dport, id)
                        .map_err(usage)?;
                    let not_found = || {
                        Failure(
                            EXIT_FAILURE,
                            format!(
                                "fastpath conntrack: 0 flow entries: {proto} {src} -> {dst} is not tracked (either direction); `fastpath ct list` shows what is"
                            ),
                        )
                    };
                    let found = match pin_dir {
                        Some(pin) => read::connection(&pin, &key)
                            .map_err(|e| Failure(EXIT_FAILURE, error_chain(&e)))?,
                        None => {
                            let q = pb::ConnectionQuery {
                                protocol: proto.clone(),
                                src: src.to_string(),
                                dst: dst.to_string(),
                                sport: sport.map_or(0, u32::from),
                                dport: dport.map_or(0, u32::from),
                                id: id.map_or(0, u32::from),
                            };
                            match connect(target).await?.get_connection(q).await {
                                Ok(c) => Some(c.into_inner()),
                                Err(s) if s.code() == tonic::Code::NotFound => None,
                                Err(s) => return Err(from_status(s)),
                            }
                        }
                    };
                    let Some(c) = found else {
                        return Err(not_found());
                    };
                    let row = convert::ct_row(&c);
                    if out.output == Output::Json {
                        print_json(&row)
                    } else {
                        outln!("{}", conntrack::render(&row));
                        Ok(())
                    }
                }
                CtCommand::Flush { pin_dir } => {
                    let n = match pin_dir {
                        Some(pin) => fastpath::datapath::flush_pinned_ct(&pin)
                            .map_err(|e| Failure(EXIT_FAILURE, error_chain(&e)))?
                            as u64,
                        None => {
                            connect(target)
                                .await?
                                .flush_connections(pb::FlushConnectionsRequest {})
                                .await
                                .map_err(from_status)?
                                .into_inner()
                                .deleted
                        }
                    };
                    outln!("fastpath conntrack: {n} flow entries have been deleted.");
                    Ok(())
                }
                CtCommand::Stats { pin_dir } => {
                    let s = match pin_dir {
                        Some(pin) => read::stats(&pin, false)
                            .map_err(|e| Failure(EXIT_FAILURE, error_chain(&e)))?,
                        None => connect(target)
                            .await?
                            .get_stats(pb::GetStatsRequest {
                                skip_conntrack_entries: false,
                            })
                            .await
                            .map_err(from_status)?
                            .into_inner(),
                    };
                    let sums: Vec<u64> = s.conntrack.iter().map(|c| c.value).collect();
                    out!(
                        "{}",
                        conntrack::render_stats(s.conntrack_entries, s.conntrack_capacity, &sums)
                    );
                    Ok(())
                }
                CtCommand::Watch { out } => {
                    let mut stream = connect(target)
                        .await?
                        .watch_connections(pb::WatchConnectionsRequest {})
                        .await
                        .map_err(from_status)?
                        .into_inner();
                    while let Some(ev) = stream.next().await {
                        let ev = ev.map_err(from_status)?;
                        if out.output == Output::Json {
                            outln!(
                                "{}",
                                json!({"kind": ev.kind, "timestamp_ns": ev.timestamp_ns,
                                       "protocol": ev.protocol, "src": ev.src, "dst": ev.dst,
                                       "sport": ev.sport, "dport": ev.dport, "state": ev.state})
                            );
                        } else {
                            outln!("{}", ev.line);
                        }
                    }
                    Ok(())
                }
            }
        }
        .await,
    )
}

/// The `service list` table.
fn render_services(rows: &[fastpath::datapath::ServiceRow]) -> String {
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

fn enum_name(v: i32, names: &[&str]) -> String {
    names.get(v as usize).copied().unwrap_or("?").to_string()
}

fn status_json(s: &pb::ServiceStatus) -> serde_json::Value {
    let spec = s.spec.clone().unwrap_or_default();
    let key = spec.key.clone().unwrap_or_default();
    json!({
        "service": key_text(&key),
        "scheduler": enum_name(spec.scheduler, &["maglev", "maglev", "wrr", "least_connections"]),
        "mode": enum_name(spec.mode, &["nat", "nat", "full_nat", "dsr"]),
        "no_backend": enum_name(spec.no_backend, &["kernel", "kernel", "drop", "reject"]),
        "affinity_timeout_s": spec.affinity_timeout_s,
        "snat_address": spec.snat_address,
        "snat_ports": spec.snat_ports,
        "port_forward": s.port_forward,
        "health_check": spec.health_check.as_ref().map(|h| json!({
            "kind": h.kind, "interval_ms": h.interval_ms, "timeout_ms": h.timeout_ms,
            "rise": h.rise, "fall": h.fall, "path": h.path,
        })),
        "packets": s.packets, "bytes": s.bytes, "connections": s.connections,
        "no_backend_connections": s.no_backend,
        "backends": s.backends.iter().map(|b| json!({
            "address": b.address, "port": b.port, "weight": b.weight, "share_pct": b.share_pct,
            "packets": b.packets, "bytes": b.bytes, "connections": b.connections,
            "active": b.active, "health": b.health,
        })).collect::<Vec<_>>(),
    })
}

pub async fn service(target: &Target, command: ServiceCommand) -> ExitCode {
    finish(
        async {
            match command {
                ServiceCommand::List { pin_dir, out } => {
                    let statuses = match pin_dir {
                        Some(pin) => read::services(&pin)
                            .map_err(|e| Failure(EXIT_FAILURE, error_chain(&e)))?,
                        None => {
                            connect(target)
                                .await?
                                .list_services(pb::ListServicesRequest {})
                                .await
                                .map_err(from_status)?
                                .into_inner()
                                .services
                        }
                    };
                    let rows: Vec<_> = statuses.iter().map(convert::service_row).collect();
                    if out.output == Output::Json {
                        print_json(&rows)
                    } else {
                        out!("{}", render_services(&rows));
                        Ok(())
                    }
                }
                ServiceCommand::Show { service, out } => {
                    let key = parse_service(&service)?;
                    let s = connect(target)
                        .await?
                        .get_service(key)
                        .await
                        .map_err(from_status)?
                        .into_inner();
                    let j = status_json(&s);
                    if out.output == Output::Json {
                        return print_json(&j);
                    }
                    outln!("service      {}", j["service"].as_str().unwrap_or(""));
                    for k in ["scheduler", "mode", "no_backend"] {
                        outln!("{k:<12} {}", j[k].as_str().unwrap_or(""));
                    }
                    if s.port_forward {
                        outln!("(a port forward)");
                    }
                    outln!(
                        "traffic      {} packets, {} bytes, {} connections, {} without backend",
                        s.packets,
                        s.bytes,
                        s.connections,
                        s.no_backend
                    );
                    outln!(
                        "{:<32} {:>6} {:>5} {:>9} {:>10} {:>8}",
                        "BACKEND",
                        "WEIGHT",
                        "SHARE",
                        "HEALTH",
                        "CONNS",
                        "ACTIVE"
                    );
                    for b in &s.backends {
                        let addr = match b.address.parse::<IpAddr>() {
                            Ok(ip) => {
                                std::net::SocketAddr::new(ip, u16::try_from(b.port).unwrap_or(0))
                                    .to_string()
                            }
                            Err(_) => b.address.clone(),
                        };
                        outln!(
                            "{addr:<32} {:>6} {:>4.0}% {:>9} {:>10} {:>8}",
                            b.weight,
                            b.share_pct,
                            b.health,
                            b.connections,
                            b.active
                        );
                    }
                    Ok(())
                }
                ServiceCommand::Add {
                    service,
                    backends,
                    scheduler,
                    mode,
                    snat_address,
                    snat_ports,
                    no_backend,
                    affinity_timeout,
                    maglev_table_size,
                    change,
                } => {
                    let spec = pb::ServiceSpec {
                        key: Some(parse_service(&service)?),
                        scheduler: match scheduler.as_str() {
                            "wrr" => pb::Scheduler::Wrr,
                            "least_connections" => pb::Scheduler::LeastConnections,
                            _ => pb::Scheduler::Maglev,
                        } as i32,
                        mode: match mode.as_str() {
                            "full_nat" => pb::ForwardMode::FullNat,
                            "dsr" => pb::ForwardMode::Dsr,
                            _ => pb::ForwardMode::Nat,
                        } as i32,
                        no_backend: match no_backend.as_str() {
                            "drop" => pb::NoBackend::Drop,
                            "reject" => pb::NoBackend::Reject,
                            _ => pb::NoBackend::Kernel,
                        } as i32,
                        snat_address: snat_address.unwrap_or_default(),
                        snat_ports: snat_ports.unwrap_or_default(),
                        affinity_timeout_s: affinity_timeout,
                        maglev_table_size: maglev_table_size.unwrap_or(0),
                        backends: backends
                            .iter()
                            .map(|b| parse_backend(b))
                            .collect::<Result<_, _>>()?,
                        health_check: None,
                    };
                    changed(
                        connect(target)
                            .await?
                            .create_services(pb::ServicesRequest {
                                services: vec![spec],
                                expected_generation: change.expected_generation,
                                dry_run: change.dry_run,
                            })
                            .await,
                        change.out.output,
                    )
                }
                ServiceCommand::Del { services, change } => {
                    let keys = services
                        .iter()
                        .map(|s| parse_service(s))
                        .collect::<Result<_, _>>()?;
                    changed(
                        connect(target)
                            .await?
                            .delete_services(pb::DeleteServicesRequest {
                                keys,
                                expected_generation: change.expected_generation,
                                dry_run: change.dry_run,
                            })
                            .await,
                        change.out.output,
                    )
                }
            }
        }
        .await,
    )
}

pub async fn backend(target: &Target, command: BackendCommand) -> ExitCode {
    finish(
        async {
            let (service, backends, change) = match &command {
                BackendCommand::Add {
                    service,
                    backends,
                    change,
                }
                | BackendCommand::Del {
                    service,
                    backends,
                    change,
                }
                | BackendCommand::Drain {
                    service,
                    backends,
                    change,
                } => (service, backends, *change),
            };
            let req = pb::BackendsRequest {
                service: Some(parse_service(service)?),
                backends: backends
                    .iter()
                    .map(|b| parse_backend(b))
                    .collect::<Result<_, _>>()?,
                expected_generation: change.expected_generation,
                dry_run: change.dry_run,
            };
            let mut c = connect(target).await?;
            let answer = match command {
                BackendCommand::Add { .. } => c.add_backends(req).await,
                BackendCommand::Del { .. } => c.remove_backends(req).await,
                BackendCommand::Drain { .. } => c.drain_backends(req).await,
            };
            changed(answer, change.out.output)
        }
        .await,
    )
}

fn parse_forward(from: &str, to: Option<&str>) -> Result<pb::PortForwardSpec, Failure> {
    let key = parse_service(from)?;
    let (to_addr, to_port) = match to {
        None => (String::new(), 0),
        Some(t) => match t.parse::<std::net::SocketAddr>() {
            Ok(sa) => (sa.ip().to_string(), u32::from(sa.port())),
            Err(_) => match t.trim_matches(['[', ']']).parse::<IpAddr>() {
                Ok(ip) => (ip.to_string(), 0),
                Err(_) => {
                    return Err(usage(format!(
                        "{t:?} is not ADDR[:PORT]; e.g. 10.1.0.5:22 or [fd00::5]:22"
                    )));
                }
            },
        },
    };
    Ok(pb::PortForwardSpec {
        address: key.vip,
        port: key.port,
        protocol: key.protocol,
        to: to_addr,
        to_port,
    })
}

pub async fn nat(target: &Target, command: NatCommand) -> ExitCode {
    finish(
        async {
            match command {
                NatCommand::List { out } => {
                    let r = connect(target)
                        .await?
                        .list_nat_rules(pb::ListNatRulesRequest {})
                        .await
                        .map_err(from_status)?
                        .into_inner();
                    let forwards: Vec<_> = r
                        .port_forwards
                        .iter()
                        .map(|f| {
                            let from = key_text(&pb::ServiceKey {
                                vip: f.address.clone(),
                                port: f.port,
                                protocol: f.protocol,
                            });
                            let to = match f.to.parse::<IpAddr>() {
                                Ok(ip) => std::net::SocketAddr::new(
                                    ip,
                                    u16::try_from(f.to_port).unwrap_or(0),
                                )
                                .to_string(),
                                Err(_) => f.to.clone(),
                            };
                            (from, to)
                        })
                        .collect();
                    if out.output == Output::Json {
                        return print_json(&json!({
                            "port_forwards": forwards.iter().map(|(f, t)| json!({"from": f, "to": t})).collect::<Vec<_>>(),
                            "snat": r.snat.iter().map(|s| json!({"interface": s.interface, "addresses": s.addresses, "ports": s.ports})).collect::<Vec<_>>(),
                        }));
                    }
                    outln!("{:<32} TO", "PORT FORWARD");
                    for (f, t) in &forwards {
                        outln!("{f:<32} {t}");
                    }
                    outln!("{:<16} {:<40} PORTS", "SNAT INTERFACE", "ADDRESSES");
                    for s in &r.snat {
                        let addrs = if s.addresses.is_empty() {
                            "(its own)".to_string()
                        } else {
                            s.addresses.join(",")
                        };
                        outln!("{:<16} {addrs:<40} {}", s.interface, s.ports);
                    }
                    Ok(())
                }
                NatCommand::Add { from, to, change } => {
                    let f = parse_forward(&from, Some(&to))?;
                    changed(connect(target)
                        .await?
                        .create_port_forwards(pb::PortForwardsRequest {
                            port_forwards: vec![f],
                            expected_generation: change.expected_generation,
                            dry_run: change.dry_run,
                        })
                        .await, change.out.output)
                }
                NatCommand::Del { forwards, change } => {
                    let list = forwards
                        .iter()
                        .map(|f| parse_forward(f, None))
                        .collect::<Result<_, _>>()?;
                    changed(connect(target)
                        .await?
                        .delete_port_forwards(pb::PortForwardsRequest {
                            port_forwards: list,
                            expected_generation: change.expected_generation,
                            dry_run: change.dry_run,
                        })
                        .await, change.out.output)
                }
            }
        }
        .await,
    )
}

pub async fn interfaces(target: &Target, out: OutputArg) -> ExitCode {
    finish(
        async {
            let r = connect(target)
                .await?
                .list_interfaces(pb::ListInterfacesRequest {})
                .await
                .map_err(from_status)?
                .into_inner();
            if out.output == Output::Json {
                return print_json(
                    &r.interfaces
                        .iter()
                        .map(|i| {
                            json!({"name": i.name, "ifindex": i.ifindex, "xdp": i.xdp,
                               "tc_ingress": i.tc_ingress, "tc_egress": i.tc_egress,
                               "conntrack": i.conntrack, "stateful_firewall": i.stateful_firewall,
                               "snat": i.snat, "route": i.route, "vlan": i.vlan,
                               "hooks": i.hooks})
                        })
                        .collect::<Vec<_>>(),
                );
            }
            outln!(
                "{:<16} {:>7} {:<8} {:<5} {:<5} {:<5} {:<4} HOOKS",
                "INTERFACE",
                "IFINDEX",
                "XDP",
                "CT",
                "SNAT",
                "ROUTE",
                "VLAN"
            );
            for i in &r.interfaces {
                let vlan = if i.vlan == 0 {
                    "-".to_string()
                } else {
                    i.vlan.to_string()
                };
                outln!(
                    "{:<16} {:>7} {:<8} {:<5} {:<5} {:<5} {:<4} {}",
                    i.name,
                    i.ifindex,
                    i.xdp,
                    i.conntrack,
                    i.snat,
                    i.route,
                    vlan,
                    i.hooks.join(" ")
                );
            }
            Ok(())
        }
        .await,
    )
}

fn health_line(h: &pb::BackendHealth) -> String {
    let svc = h.service.as_ref().map(key_text).unwrap_or_default();
    let addr = match h.address.parse::<IpAddr>() {
        Ok(ip) => std::net::SocketAddr::new(ip, u16::try_from(h.port).unwrap_or(0)).to_string(),
        Err(_) => h.address.clone(),
    };
    format!(
        "{svc:<28} {addr:<28} {:<5} {}",
        if h.up { "up" } else { "down" },
        h.detail
    )
}

fn health_json(h: &pb::BackendHealth) -> serde_json::Value {
    json!({
        "service": h.service.as_ref().map(key_text),
        "address": h.address, "port": h.port, "up": h.up, "detail": h.detail,
    })
}

pub async fn health(target: &Target, watch: bool, out: OutputArg) -> ExitCode {
    finish(
        async {
            let mut c = connect(target).await?;
            if watch {
                let mut stream = c
                    .watch_health(pb::WatchHealthRequest {})
                    .await
                    .map_err(from_status)?
                    .into_inner();
                while let Some(ev) = stream.next().await {
                    let ev = ev.map_err(from_status)?;
                    if let Some(b) = &ev.backend {
                        if out.output == Output::Json {
                            outln!("{}", health_json(b));
                        } else {
                            outln!("{}", health_line(b));
                        }
                    }
                }
                return Ok(());
            }
            let r = c
                .get_health(pb::GetHealthRequest {})
                .await
                .map_err(from_status)?
                .into_inner();
            if out.output == Output::Json {
                return print_json(&r.backends.iter().map(health_json).collect::<Vec<_>>());
            }
            outln!("{:<28} {:<28} {:<5} DETAIL", "SERVICE", "BACKEND", "STATE");
            for b in &r.backends {
                outln!("{}", health_line(b));
            }
            if r.backends.is_empty() {
                outln!("(no service has a health check)");
            }
            Ok(())
        }
        .await,
    )
}

pub async fn apply(target: &Target, file: &std::path::Path, change: ChangeArgs) -> ExitCode {
    finish(
        async {
            let text = std::fs::read_to_string(file)
                .map_err(|e| usage(format!("reading {}: {e}", file.display())))?;
            let req = pb::ApplyRequest {
                config_toml: text,
                dry_run: change.dry_run,
                expected_generation: change.expected_generation,
                source_name: file.display().to_string(),
            };
            // Refused here with a message that says so: past the limit the client only
            // resets the HTTP/2 stream ("h2 protocol error").
            let size = prost::Message::encoded_len(&req);
            if size > fastpath::api::MAX_MESSAGE_BYTES {
                return Err(Failure(
                    EXIT_REJECTED,
                    format!(
                        "too large: {} makes a {size}-byte request; the API takes at most {} bytes: split the services over several smaller files or remove what is not needed; nothing was changed",
                        file.display(),
                        fastpath::api::MAX_MESSAGE_BYTES
                    ),
                ));
            }
            let r = connect(target)
                .await?
                .apply(req)
                .await
                .map_err(from_status)?
                .into_inner();
            print_change(&r.change.unwrap_or_default(), change.out.output, &r.notes)
        }
        .await,
    )
}

#[derive(Subcommand)]
pub enum HaCommand {
    /// Per peer: this node's stream to it (connected, queue, lag, resends, resyncs, refused
    /// messages) and its stream to this node (synced, applied seq, entries installed), and
    /// whether this node is "in sync": it received every peer's snapshot and applied its
    /// stream since, so it can take over the peers' connections.
    ///
    /// With --check, prints one line and exits 0 when in sync, 5 when not (3: no daemon) —
    /// for a failover manager's readiness check (keepalived `track_script`, see
    /// config/keepalived/).
    Status {
        /// Exit 0 when in sync, 5 when not.
        #[arg(long)]
        check: bool,
        #[command(flatten)]
        out: OutputArg,
    },
}

#[derive(Subcommand)]
pub enum ClusterCommand {
    /// This node's readiness to carry traffic ("settling health", "syncing with peers",
    /// "ready", "datapath down", "draining", "drained"), each route it has the routing daemon announce (its
    /// own at primary preference, other nodes' source prefixes as backups), a drain under way
    /// or ended, and with [ha] each peer: connected both ways, whether its state is here
    /// (synced), and the replication lag to it.
    Status {
        #[command(flatten)]
        out: OutputArg,
    },
}

/// `fastpath drain`'s options.
pub struct DrainArgs {
    pub quiet: f64,
    pub deadline: f64,
    pub wait: bool,
    pub cancel: bool,
}

fn announce_json(a: &pb::AnnounceStatus) -> serde_json::Value {
    json!({
        "enabled": a.enabled, "table": a.table, "readiness": a.readiness,
        "routes": a.routes.iter().map(|r| json!({"prefix": r.prefix, "backup": r.backup})).collect::<Vec<_>>(),
        "drain": a.drain.as_ref().map(|d| json!({
            "quiet_ms": d.quiet_ms, "deadline_ms": d.deadline_ms,
            "started_ms_ago": d.started_ms_ago, "packets": d.packets,
            "last_packet_ms_ago": d.last_packet_ms_ago, "ended": d.ended,
        })),
    })
}

/// One line on a drain: under way, or how it ended.
fn drain_line(d: &pb::DrainStatus) -> String {
    let secs = |ms: u64| ms as f64 / 1000.0;
    let how = match d.ended.as_str() {
        "" => "draining".to_string(),
        "quiet" => format!(
            "drained: no load-balanced packet for {:.1} s",
            secs(d.quiet_ms)
        ),
        _ => format!(
            "drained at the {:.1} s deadline, with packets still arriving",
            secs(d.deadline_ms)
        ),
    };
    format!(
        "{how} ({:.1} s since it started; {} load-balanced packets since, the last {:.1} s ago)",
        secs(d.started_ms_ago),
        d.packets,
        secs(d.last_packet_ms_ago)
    )
}

/// `fastpath drain`: asks for the drain (or its end), then waits for it to end.
pub async fn drain(target: &Target, args: DrainArgs, out: OutputArg) -> ExitCode {
    finish(
        async {
            let ms = |what: &str, s: f64| {
                if s.is_finite() && s > 0.0 {
                    Ok((s * 1000.0).round() as u64)
                } else {
                    Err(usage(format!("--{what} {s}: give a positive number of seconds")))
                }
            };
            let request = if args.cancel {
                pb::DrainRequest {
                    cancel: true,
                    ..Default::default()
                }
            } else {
                pb::DrainRequest {
                    cancel: false,
                    quiet_ms: ms("quiet", args.quiet)?,
                    deadline_ms: ms("deadline", args.deadline)?,
                }
            };
            let mut c = connect(target).await?;
            let mut s = c.drain(request).await.map_err(from_status)?.into_inner();
            if args.cancel {
                if out.output == Output::Json {
                    return print_json(&announce_json(&s));
                }
                outln!(
                    "drain cancelled: {}, announcing {} route(s)",
                    s.readiness,
                    s.routes.len()
                );
                return Ok(());
            }
            if args.wait {
                if out.output != Output::Json {
                    outln!(
                        "draining: every announcement withdrawn; waiting for the flows that still arrive (quiet {} s, deadline {} s)",
                        args.quiet,
                        args.deadline
                    );
                }
                while s.drain.as_ref().is_some_and(|d| d.ended.is_empty()) {
                    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                    s = c
                        .get_announce_status(pb::GetAnnounceStatusRequest {})
                        .await
                        .map_err(from_status)?
                        .into_inner();
                }
            }
            let d = s.drain.clone().unwrap_or_default();
            if out.output == Output::Json {
                print_json(&announce_json(&s))?;
            } else {
                outln!("{}", drain_line(&d));
            }
            if d.ended == "deadline" {
                return Err(Failure(EXIT_DRAIN_DEADLINE, String::new()));
            }
            Ok(())
        }
        .await,
    )
}

/// `fastpath cluster status`: the announcer's state and, with [ha], the peers'.
pub async fn cluster_status(target: &Target, out: OutputArg) -> ExitCode {
    finish(
        async {
            let mut c = connect(target).await?;
            let a = c
                .get_announce_status(pb::GetAnnounceStatusRequest {})
                .await
                .map_err(from_status)?
                .into_inner();
            let ha = c
                .get_ha_status(pb::GetHaStatusRequest {})
                .await
                .map_err(from_status)?
                .into_inner();
            if out.output == Output::Json {
                return print_json(&json!({
                    "announce": announce_json(&a),
                    "ha": ha.enabled.then(|| json!({
                        "node_id": ha.node_id, "in_sync": ha.in_sync,
                        "peers_out": ha.peers_out.iter().map(|p| json!({
                            "address": p.address, "connected": p.connected, "lag_ms": p.lag_ms,
                            "lag_p99_us": p.lag_p99_us,
                        })).collect::<Vec<_>>(),
                        "peers_in": ha.peers_in.iter().map(|p| json!({
                            "node_id": p.node_id, "connected": p.connected, "synced": p.synced,
                            "installed": p.installed,
                        })).collect::<Vec<_>>(),
                    })),
                }));
            }
            if a.enabled {
                outln!("announcements: {} (table {})", a.readiness, a.table);
                for r in &a.routes {
                    outln!(
                        "  {:<43} {}",
                        r.prefix,
                        if r.backup { "backup" } else { "primary" }
                    );
                }
                if let Some(d) = &a.drain {
                    outln!("{}", drain_line(d));
                }
            } else {
                outln!("announcements: off (no [announce] section)");
            }
            if !ha.enabled {
                outln!("replication: off (no [ha] section)");
                return Ok(());
            }
            outln!(
                "replication: node {}, {}",
                ha.node_id,
                if ha.in_sync {
                    "in sync with every peer"
                } else {
                    "NOT in sync"
                }
            );
            for p in &ha.peers_out {
                outln!(
                    "  to {:<22} {:<13} lag {} ms, p99 {} us",
                    p.address,
                    if p.connected {
                        "connected"
                    } else {
                        "not connected"
                    },
                    p.lag_ms,
                    p.lag_p99_us
                );
            }
            for p in &ha.peers_in {
                outln!(
                    "  from node {:<12} {:<13} {}, {} entries held",
                    p.node_id,
                    if p.connected {
                        "connected"
                    } else {
                        "not connected"
                    },
                    if p.synced { "synced" } else { "NOT synced" },
                    p.installed
                );
            }
            Ok(())
        }
        .await,
    )
}

/// `fastpath datapath [--check]`: the pinned datapath as the kernel runs it (no daemon).
pub fn datapath(pin_dir: &std::path::Path, check: bool, out: OutputArg) -> ExitCode {
    let (links, tails) = fastpath::datapath::pinned_datapath(pin_dir);
    let problems = fastpath::datapath::forwarding_problems(pin_dir, &links, tails);
    match out.output {
        Output::Json => {
            if let Err(f) = print_json(&json!({
                "pin_dir": pin_dir,
                "forwarding": problems.is_empty(),
                "links": links,
                "tail_arrays": tails,
                "problems": problems,
            })) {
                return finish(Err(f));
            }
        }
        Output::Table => {
            outln!(
                "{:<24} {:<16} {:>7} {:<4}",
                "LINK",
                "INTERFACE",
                "IFINDEX",
                "UP"
            );
            for l in &links {
                outln!(
                    "{:<24} {:<16} {:>7} {:<4}",
                    l.pin,
                    l.iface.as_deref().unwrap_or("-"),
                    l.ifindex,
                    if l.up { "yes" } else { "no" }
                );
            }
            outln!("tail-call arrays pinned: {tails}");
        }
    }
    if problems.is_empty() {
        return ExitCode::SUCCESS;
    }
    for p in &problems {
        eprintln!("not forwarding: {p}");
    }
    if check {
        ExitCode::from(EXIT_NOT_FORWARDING)
    } else {
        ExitCode::SUCCESS
    }
}

/// A kernel feature's row (`fastpath kernel`, `fastpath info`).
fn print_feature(name: &str, present: bool, since: &str, without: &str) {
    if present {
        outln!("  {name:<28} yes");
    } else {
        outln!("  {name:<28} no (Linux {since} added it): {without}");
    }
}

pub fn kernel(full_log: bool, out: OutputArg) -> ExitCode {
    let report = match fastpath::datapath::kernel::check(fastpath::EBPF_OBJECT, full_log) {
        Ok(r) => r,
        Err(e) => return finish(Err(Failure(EXIT_FAILURE, e.to_string()))),
    };
    match out.output {
        Output::Json => {
            if let Err(f) = print_json(&json!(report)) {
                return finish(Err(f));
            }
        }
        Output::Table => {
            outln!("kernel {}", report.release);
            for f in &report.features {
                print_feature(f.name, f.present, f.since, f.without);
            }
            outln!(
                "{:<36} {:<4} {:>14} {:>13}",
                "PROGRAM",
                "HOOK",
                "VERIFIED INSNS",
                "XLATED INSNS"
            );
            let n = |v: Option<u32>| v.map_or_else(|| "-".to_owned(), |v| v.to_string());
            for p in &report.programs {
                outln!(
                    "{:<36} {:<4} {:>14} {:>13}{}",
                    p.name,
                    p.hook,
                    n(p.verified_insns),
                    n(p.xlated_insns),
                    if p.refused.is_some() { "  REFUSED" } else { "" }
                );
            }
            let loaded = report
                .programs
                .iter()
                .filter(|p| p.refused.is_none())
                .count();
            outln!("{loaded} of {} programs loaded", report.programs.len());
        }
    }
    for p in report.programs.iter().filter(|p| p.refused.is_some()) {
        eprintln!(
            "{} refused: {}",
            p.name,
            p.refused.as_deref().unwrap_or_default()
        );
    }
    if report.all_loaded() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_FAILURE)
    }
}

pub async fn ha_status(target: &Target, check: bool, out: OutputArg) -> ExitCode {
    finish(
        async {
            let mut c = connect(target).await?;
            let s = c
                .get_ha_status(pb::GetHaStatusRequest {})
                .await
                .map_err(from_status)?
                .into_inner();
            if !s.enabled {
                return Err(Failure(
                    if check {
                        EXIT_NOT_IN_SYNC
                    } else {
                        EXIT_FAILURE
                    },
                    "HA replication is off: the daemon's config has no [ha] section".into(),
                ));
            }
            let waiting: Vec<String> = s
                .peers_in
                .iter()
                .filter(|p| !p.synced)
                .map(|p| format!("node {}", p.node_id))
                .collect();
            if check {
                let synced = s.peers_in.iter().filter(|p| p.synced).count();
                if s.in_sync {
                    outln!(
                        "in sync: node {} holds the state of {synced} peer(s)",
                        s.node_id
                    );
                    return Ok(());
                }
                return Err(Failure(
                    EXIT_NOT_IN_SYNC,
                    format!(
                        "not in sync: node {} has {synced} of {} peer snapshot(s){}",
                        s.node_id,
                        s.peers_out.len(),
                        if waiting.is_empty() {
                            String::new()
                        } else {
                            format!("; waiting for {}", waiting.join(", "))
                        }
                    ),
                ));
            }
            if out.output == Output::Json {
                let outs: Vec<_> = s
                    .peers_out
                    .iter()
                    .map(|p| {
                        json!({
                            "address": p.address, "connected": p.connected, "queued": p.queued,
                            "last_seq": p.last_seq, "acked_seq": p.acked_seq, "lag_ms": p.lag_ms,
                            "lag_p50_us": p.lag_p50_us, "lag_p99_us": p.lag_p99_us,
                            "sent_changes": p.sent_changes, "snapshots": p.snapshots,
                            "snapshot_entries": p.snapshot_entries, "resends": p.resends,
                            "rejected": p.rejected, "peer_rejected": p.peer_rejected,
                            "connects": p.connects, "last_error": p.last_error,
                        })
                    })
                    .collect();
                let ins: Vec<_> = s
                    .peers_in
                    .iter()
                    .map(|p| {
                        json!({
                            "node_id": p.node_id, "connected": p.connected, "epoch": p.epoch,
                            "applied_seq": p.applied_seq, "synced": p.synced,
                            "installed": p.installed, "received_changes": p.received_changes,
                            "snapshots": p.snapshots, "rejected": p.rejected,
                            "kept_local": p.kept_local,
                            "last_message_ms_ago": p.last_message_ms_ago,
                        })
                    })
                    .collect();
                return print_json(&json!({
                    "node_id": s.node_id, "epoch": s.epoch, "in_sync": s.in_sync,
                    "events_lost": s.events_lost, "rejected_messages": s.rejected_messages,
                    "peers_out": outs, "peers_in": ins,
                }));
            }
            outln!(
                "node {}  epoch {}  {}  events lost {}  messages refused {}",
                s.node_id,
                s.epoch,
                if s.in_sync { "IN SYNC" } else { "NOT IN SYNC" },
                s.events_lost,
                s.rejected_messages
            );
            outln!("to peers:");
            outln!(
                "  {:<22} {:<5} {:>8} {:>10} {:>10} {:>8} {:>9} {:>9} {:>6} {:>7} {:>8}",
                "PEER",
                "UP",
                "QUEUED",
                "SEQ",
                "ACKED",
                "LAG_MS",
                "P50_US",
                "P99_US",
                "SNAPS",
                "RESENDS",
                "REFUSED"
            );
            for p in &s.peers_out {
                outln!(
                    "  {:<22} {:<5} {:>8} {:>10} {:>10} {:>8} {:>9} {:>9} {:>6} {:>7} {:>8}{}",
                    p.address,
                    if p.connected { "yes" } else { "no" },
                    p.queued,
                    p.last_seq,
                    p.acked_seq,
                    p.lag_ms,
                    p.lag_p50_us,
                    p.lag_p99_us,
                    p.snapshots,
                    p.resends,
                    p.rejected + p.peer_rejected,
                    if p.last_error.is_empty() {
                        String::new()
                    } else {
                        format!("  ({})", p.last_error)
                    }
                );
            }
            outln!("from peers:");
            outln!(
                "  {:<8} {:<5} {:<7} {:>10} {:>10} {:>10} {:>6} {:>8} {:>10} {:>9}",
                "NODE",
                "UP",
                "SYNCED",
                "SEQ",
                "INSTALLED",
                "RECEIVED",
                "SNAPS",
                "REFUSED",
                "KEPT_LOCAL",
                "LAST_MS"
            );
            for p in &s.peers_in {
                outln!(
                    "  {:<8} {:<5} {:<7} {:>10} {:>10} {:>10} {:>6} {:>8} {:>10} {:>9}",
                    p.node_id,
                    if p.connected { "yes" } else { "no" },
                    if p.synced { "yes" } else { "no" },
                    p.applied_seq,
                    p.installed,
                    p.received_changes,
                    p.snapshots,
                    p.rejected,
                    p.kept_local,
                    p.last_message_ms_ago
                );
            }
            Ok(())
        }
        .await,
    )
}
