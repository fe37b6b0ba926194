//! `fastpath daemon`: load, attach, pin, forward datapath logs, and stop cleanly.
//!
//! Contract: the config is validated before the kernel is touched; any failure while attaching
//! undoes what this run attached (links it created are removed; links it found pinned are left
//! as they were), so a bad start never leaves the datapath half-updated.

use std::{io, sync::Arc};

use fastpath_common::map_names;
use tokio::{
    io::unix::AsyncFd,
    signal::unix::{SignalKind, signal},
};
use tracing::{info, warn};

use crate::{
    EBPF_OBJECT,
    api::server::{Api, Shared},
    config::Config,
    conntrack,
    ct_events::{self, EventHub},
    ct_gc::{self, GcStats},
    datapath::{self, CtTable, Datapath, DatapathError},
    rules::Rules,
};

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Datapath(#[from] DatapathError),
    #[error("installing signal handlers: {0}")]
    Signal(#[source] io::Error),
    #[error("watching the datapath log ring: {0}")]
    LogRing(#[source] io::Error),
    #[error("watching the conntrack event ring: {0}")]
    EventRing(#[source] io::Error),
    #[error("listening on {what}: {source}")]
    Listen {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("TLS material of the API listener: {0}")]
    Tls(String),
    #[error("HA replication: {0}")]
    Ha(#[from] crate::ha::HaError),
}

/// Options from the command line (runtime behaviour; the config file describes the datapath).
pub struct DaemonOptions {
    /// The config file (reloaded on SIGHUP).
    pub config_path: std::path::PathBuf,
    /// Leave programs attached on a clean stop, whatever the config says.
    pub leave_attached: bool,
    /// Append every conntrack event to this file (`conntrack -E` style lines).
    pub ct_events_log: Option<std::path::PathBuf>,
}

/// Runs until SIGINT/SIGTERM; SIGHUP reloads the config file.
/// How long a stopping HA node that detaches waits for its VIPs to move (see
/// `Datapath::detach_all`).
const HANDOVER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

pub async fn run(config: Config, opts: DaemonOptions) -> Result<(), DaemonError> {
    // Handlers first: a SIGINT/SIGTERM that arrives while attaching is held until the loop
    // below and then detaches cleanly, instead of killing the process half-attached.
    let mut sigint = signal(SignalKind::interrupt()).map_err(DaemonError::Signal)?;
    let mut sigterm = signal(SignalKind::terminate()).map_err(DaemonError::Signal)?;
    let mut sighup = signal(SignalKind::hangup()).map_err(DaemonError::Signal)?;

    let pin_dir = config.datapath.pin_dir.get_ref().clone();
    let _lock = datapath::lock_pin_dir(&pin_dir)?;
    // The API's listeners before the kernel is touched: a socket another daemon serves, or a
    // port in use, stops the start with nothing changed.
    let socket = config.api_socket();
    let unix = crate::api::server::bind_unix(&socket).map_err(|e| DaemonError::Listen {
        what: format!("the API socket {}", socket.display()),
        source: e,
    })?;
    let mut listeners = vec![format!("unix:{}", socket.display())];
    let tcp_and_metrics = bind_tcp(&config, &mut listeners).await;
    let (tcp, metrics_listener) = match tcp_and_metrics {
        Ok(l) => l,
        Err(e) => {
            let _ = std::fs::remove_file(&socket);
            return Err(e);
        }
    };
    let ha_listener = match bind_ha(&config, &mut listeners).await {
        Ok(l) => l,
        Err(e) => {
            let _ = std::fs::remove_file(&socket);
            return Err(e);
        }
    };

    let mut dp = Datapath::open(&pin_dir, EBPF_OBJECT, *config.conntrack.capacity.get_ref())?;
    if dp.maps_reused {
        info!(pin_dir = %pin_dir.display(), "Reusing pinned maps; counters and state continue");
    } else {
        info!(pin_dir = %pin_dir.display(), "Created and pinned maps");
    }
    // Attach (all or nothing), then the runtime knobs, then drop links the config no longer
    // names: on a restart the old datapath runs untouched until every new hook is in place.
    let attached = dp
        .attach_all(&config.interfaces)
        .and_then(|()| dp.set_interfaces(&config.interfaces));
    let fail = |dp: Datapath, e: DaemonError| {
        // A first start that failed leaves nothing behind: its fresh maps go too.
        let fresh = !dp.maps_reused;
        drop(dp);
        if fresh {
            let _ = datapath::remove_pins(&pin_dir);
        }
        let _ = std::fs::remove_file(&socket);
        e
    };
    if let Err(e) = attached {
        return Err(fail(dp, e.into()));
    }
    if let Some(ipv6) = config.translates()
        && let Err(e) = datapath::prepare_forwarding(&config.interfaces, ipv6)
    {
        return Err(fail(dp, e.into()));
    }
    // Services: the config file's, or the API's changes on top of this very file.
    let (health_tx, mut health_rx) = tokio::sync::mpsc::channel(256);
    let (rules, applied) = match Rules::start(dp, config, opts.config_path.clone(), health_tx) {
        Ok(r) => r,
        Err(failed) => {
            let (dp, e) = *failed;
            return Err(fail(dp, e.into()));
        }
    };
    info!(
        services = applied.services,
        unchanged = applied.unchanged,
        removed = applied.removed,
        backends = applied.backends,
        slots = applied.slots,
        took_us = applied.took.as_micros() as u64,
        generation = rules.generation(),
        "Services applied"
    );
    let mut rules = rules;
    let stale = match rules.datapath_mut().remove_stale_links() {
        Ok(s) => s,
        Err(e) => return Err(fail(rules.into_datapath(), e.into())),
    };
    for pin in stale {
        info!(pin = %pin.display(), "Detached a pinned link the config no longer names");
    }

    let logger = match rules.datapath_mut().take_logger() {
        Ok(l) => Some(l),
        Err(e) => {
            warn!(error = %e, "Datapath log ring unavailable; eBPF log records will not be shown");
            None
        }
    };
    let mut logger = logger.and_then(|l| {
        // SAFETY: the logger owns its ring buffer fd and keeps it open until the AsyncFd (which
        // owns the logger) is dropped.
        match unsafe { AsyncFd::register_with_interest(l, tokio::io::Interest::READABLE) } {
            Ok(fd) => Some(fd),
            Err(e) => {
                warn!(error = %DaemonError::LogRing(e.into()), "eBPF log records will not be shown");
                None
            }
        }
    });

    // Conntrack events: drain the ring into the hub; subscribers never slow the drain.
    let hub = EventHub::new();
    // SAFETY: the RingBuf owns its fd and keeps it open while the AsyncFd owns it.
    let mut ct_ring = unsafe {
        AsyncFd::register_with_interest(
            rules.datapath_mut().take_ct_events()?,
            tokio::io::Interest::READABLE,
        )
    }
    .map_err(|e| DaemonError::EventRing(e.into()))?;
    let mut ct_drain = ct_events::drain_timer();
    // Conntrack expiry in its own task; a pass runs on the blocking pool.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let gc_stats = Arc::new(GcStats::default());
    let gc_task = tokio::spawn(gc_loop(
        rules.datapath_mut().take_ct_table()?,
        rules.config().conntrack.timeouts.to_slots(),
        hub.clone(),
        gc_stats.clone(),
        std::time::Duration::from_millis(*rules.config().conntrack.gc_interval_ms.get_ref()),
        stop_rx.clone(),
    ));
    // Route, neighbour and link changes end the generation of learned VXLAN headers; link
    // changes refresh FP_PEER.
    let vxlan_generations = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let netwatch_task = {
        let (pin_dir, generations, stop) =
            (pin_dir.clone(), vxlan_generations.clone(), stop_rx.clone());
        tokio::spawn(async move {
            let maps = pin_dir.join("maps");
            let watched = match (
                datapath::VxlanGeneration::open_pin(&maps.join(map_names::VXLAN_GEN)),
                datapath::PeerLinks::open_pin(&maps.join(map_names::PEER)),
            ) {
                (Ok(g), Ok(p)) => crate::netwatch::watch(g, p, generations, stop).await,
                (Err(e), _) | (_, Err(e)) => Err(e),
            };
            if let Err(e) = watched {
                warn!(error = %e, "Learned VXLAN headers will not follow route and neighbour changes, and packets forwarded at TC go out of their interface rather than straight to a veth's peer");
            }
        })
    };
    let event_log = opts.ct_events_log.clone().map(|path| {
        tokio::spawn(ct_events::log_to_file(
            hub.subscribe(),
            hub.stats.clone(),
            path,
        ))
    });
    // HA replication: the peers' streams in, this node's changes out.
    let ha = match (&rules.config().ha, ha_listener) {
        (Some(cfg), Some((listener, tls))) => {
            let ha = match crate::ha::Ha::new(
                cfg,
                pin_dir.clone(),
                rules.lb_index(),
                rules.datapath().ct_installer().ok(),
            ) {
                Ok(ha) => ha,
                Err(e) => return Err(fail(rules.into_datapath(), e.into())),
            };
            let running = listener
                .into_std()
                .map_err(crate::ha::HaError::Runtime)
                .and_then(|l| ha.start(hub.subscribe(), l, tls, stop_rx.clone()));
            let running = match running {
                Ok(r) => r,
                Err(e) => return Err(fail(rules.into_datapath(), e.into())),
            };
            info!(
                node_id = *cfg.node_id.get_ref(),
                peers = cfg.peers.len(),
                "HA replication running"
            );
            Some((ha, running))
        }
        _ => None,
    };
    let detach_on_exit = rules.config().datapath.detach_on_exit;
    let is_ha = ha.is_some();
    let attachments = rules.datapath().attachments.len();

    let shared = Arc::new(Shared {
        rules: tokio::sync::Mutex::new(Some(rules)),
        pin_dir: pin_dir.clone(),
        hub: hub.clone(),
        gc: gc_stats,
        started: std::time::Instant::now(),
        listeners: listeners.clone(),
        latency: Default::default(),
        ha: ha.as_ref().map(|(h, _)| h.clone()),
    });
    let api_task = tokio::spawn(crate::api::server::serve(
        Api(shared.clone()),
        unix,
        tcp,
        stop_rx.clone(),
    ));
    let metrics_task = metrics_listener
        .map(|l| tokio::spawn(crate::metrics::serve(l, shared.clone(), stop_rx.clone())));

    info!(
        attachments,
        pin_dir = %pin_dir.display(),
        listeners = %listeners.join(" "),
        "Datapath running; SIGINT/SIGTERM stops the daemon, SIGHUP reloads the config"
    );

    loop {
        tokio::select! {
            _ = sigint.recv() => { info!("SIGINT received"); break; }
            _ = sigterm.recv() => { info!("SIGTERM received"); break; }
            _ = sighup.recv() => {
                info!(config = %opts.config_path.display(), "SIGHUP received: reloading the config file");
                reload(&shared, &opts.config_path).await;
            }
            Some(change) = health_rx.recv() => {
                if let Ok(mut rules) = shared.rules().await {
                    tokio::task::block_in_place(|| rules.health_changed(change));
                }
            }
            drained = ct_events::drain_next(&mut ct_ring, &mut ct_drain, &hub) => {
                if let Err(e) = drained {
                    // Not expected (an epoll error on the ring's fd); the timer keeps draining.
                    warn!(error = %e, "Waiting for the conntrack event ring failed");
                    ct_drain.tick().await;
                }
            }
            ready = async {
                match logger.as_mut() {
                    Some(l) => l.readable_mut().await.map(Some),
                    None => std::future::pending().await,
                }
            } => {
                if let Ok(Some(mut guard)) = ready {
                    guard.get_inner_mut().flush();
                    guard.clear_ready();
                }
            }
        }
    }

    // The events since the last drain (up to `ct_events::DRAIN_EVERY` of them) reach the
    // subscribers (the event log, HA) before they stop.
    ct_events::drain(ct_ring.get_mut(), &hub);
    let _ = stop_tx.send(true);
    let _ = api_task.await;
    if let Some(t) = metrics_task {
        let _ = t.await;
    }
    let _ = std::fs::remove_file(&socket);
    let _ = gc_task.await;
    let _ = netwatch_task.await;
    if let Some((_, running)) = ha {
        running.stopped().await;
    }
    // Closing the hub ends the subscribers once they have written what they hold.
    drop(hub);
    if let Some(task) = event_log {
        let _ = task.await;
    }
    drop(ct_ring);
    // Clients still connected (their connections outlive the server) see UNAVAILABLE from here.
    let Some(rules) = shared.rules.lock().await.take() else {
        return Ok(());
    };
    let dp = rules.into_datapath();
    if detach_on_exit && !opts.leave_attached {
        let n = dp.attachments.len();
        // An HA node hands its VIPs to the standby before it stops forwarding.
        dp.detach_all(is_ha.then_some(HANDOVER_TIMEOUT))?;
        info!(detached = n, "Detached programs and removed pins");
    } else {
        info!(pin_dir = %pin_dir.display(), "Leaving the datapath attached; `fastpath detach` removes it");
        dp.leave_attached();
    }
    Ok(())
}

type TcpListeners = (
    Option<(
        tokio::net::TcpListener,
        Option<tonic::transport::ServerTlsConfig>,
    )>,
    Option<tokio::net::TcpListener>,
);

/// The API's TCP listener (with its TLS settings) and the metrics listener, if configured.
async fn bind_tcp(
    config: &Config,
    listeners: &mut Vec<String>,
) -> Result<TcpListeners, DaemonError> {
    let tcp = match &config.api.listen {
        Some(addr) => {
            let addr = *addr.get_ref();
            let tls = crate::api::server::server_tls(config).map_err(DaemonError::Tls)?;
            let l = bind(addr, "the API address").await?;
            listeners.push(format!(
                "{}://{addr}",
                if tls.is_some() { "https" } else { "http" }
            ));
            Some((l, tls))
        }
        None => None,
    };
    let metrics = match &config.api.metrics_listen {
        Some(addr) => {
            let addr = *addr.get_ref();
            let l = bind(addr, "the metrics address").await?;
            listeners.push(format!("metrics:http://{addr}/metrics"));
            Some(l)
        }
        None => None,
    };
    Ok((tcp, metrics))
}

/// A TCP listener on `addr`; an address in use names `what` it was for.
async fn bind(
    addr: std::net::SocketAddr,
    what: &str,
) -> Result<tokio::net::TcpListener, DaemonError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| DaemonError::Listen {
            what: format!("{what} {addr}"),
            source: e,
        })
}

/// The HA sync listener and its TLS, if `[ha]` is configured.
async fn bind_ha(
    config: &Config,
    listeners: &mut Vec<String>,
) -> Result<Option<(tokio::net::TcpListener, tonic::transport::ServerTlsConfig)>, DaemonError> {
    let Some(ha) = &config.ha else {
        return Ok(None);
    };
    let tls = crate::ha::server_tls(ha)?;
    let addr = *ha.listen.get_ref();
    let l = bind(addr, "the HA sync address (ha.listen)").await?;
    listeners.push(format!("ha:https://{addr}"));
    Ok(Some((l, tls)))
}

/// SIGHUP: the config file again; a bad file changes nothing and says why.
async fn reload(shared: &Arc<Shared>, path: &std::path::Path) {
    let new = match Config::load(path) {
        Ok(c) => c,
        Err(e) => {
            warn!(error = %e, "Reload refused: the config file is invalid; nothing was changed");
            return;
        }
    };
    let Ok(mut rules) = shared.rules().await else {
        return;
    };
    match tokio::task::block_in_place(|| rules.apply_config(new, 0, false, true)) {
        Ok(s) => info!(
            generation = s.generation,
            created = s.created.len(),
            updated = s.updated.len(),
            deleted = s.deleted.len(),
            unchanged = s.unchanged,
            notes = %s.notes.join("; "),
            "Config reloaded"
        ),
        Err(e) => warn!(error = %e, "Reload refused; nothing was changed"),
    }
}

/// Expires idle connections every `interval` until `stop` turns true.
async fn gc_loop(
    mut table: CtTable,
    timeouts: ct_gc::Timeouts,
    hub: EventHub,
    stats: Arc<GcStats>,
    interval: std::time::Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut wait = interval;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.changed() => return,
        }
        let (h, s) = (hub.clone(), stats.clone());
        let started = std::time::Instant::now();
        let done = tokio::task::spawn_blocking(move || {
            ct_gc::pass(&mut table, &timeouts, &h, &s, conntrack::monotonic_ns());
            table
        })
        .await;
        // A pass over a large table is not free (about 0.5 s at 1M entries here): rest at
        // least 9× as long as it took, so expiry never takes more than a tenth of a CPU.
        wait = interval.max(started.elapsed() * ct_gc::REST_FACTOR);
        match done {
            Ok(t) => table = t,
            Err(e) => {
                warn!(error = %e, "Conntrack expiry pass failed; expiry stops");
                return;
            }
        }
    }
}
