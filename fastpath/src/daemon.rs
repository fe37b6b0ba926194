//! `fastpath daemon`: load, attach, pin, forward datapath logs, and stop cleanly.
//!
//! Contract: the config is validated before the kernel is touched; any failure while attaching
//! undoes what this run attached (links it created are removed; links it found pinned are left
//! as they were), so a bad start never leaves the datapath half-updated.

use std::{
    io,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use fastpath_common::map_names;
use tokio::{
    io::unix::AsyncFd,
    signal::unix::{Signal, SignalKind, signal},
    sync::{mpsc, watch},
    task::JoinSet,
};
use tracing::{Instrument as _, info, info_span, warn};

use crate::{
    EBPF_OBJECT,
    api::server::{Api, Shared},
    config::Config,
    conntrack,
    ct_events::{self, EventHub},
    ct_gc::{self, GcStats},
    datapath::{self, CtTable, Datapath, DatapathError, KernelFeatures, TcPath},
    ifaces::{SysHost, plan_interfaces},
    rules::{Rules, StartState},
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
    #[error(transparent)]
    Interfaces(#[from] crate::ifaces::IfacePlanError),
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

/// How long a stopping HA node that detaches waits for its VIPs to move (see
/// `Datapath::detach_all`).
const HANDOVER_TIMEOUT: Duration = Duration::from_secs(5);

/// How long the daemon's tasks get to finish once the drain signal is sent; what is still
/// running then is aborted, so a stuck peer or client cannot hold the stop.
const DRAIN_DEADLINE: Duration = Duration::from_secs(10);

/// Runs until SIGINT/SIGTERM; SIGHUP reloads the config file. The steps, in order: signal
/// handlers, the pin-dir lock, the listeners, the datapath (attach, services), the tasks; then
/// the loop; then drain and detach (or leave attached).
pub async fn run(config: Config, opts: DaemonOptions) -> Result<(), DaemonError> {
    // Handlers first: a SIGINT/SIGTERM that arrives while attaching is held until the loop
    // and then detaches cleanly, instead of killing the process half-attached.
    let mut signals = Signals::install()?;
    let pin_dir = config.datapath.pin_dir.get_ref().clone();
    let _lock = datapath::lock_pin_dir(&pin_dir)?;
    // The listeners before the kernel is touched: a socket another daemon serves, or a port in
    // use, stops the start with nothing changed.
    let listeners = Listeners::bind(&config).await?;
    // Declared before the datapath, so a failed start drops the datapath first, then its pins.
    let mut fresh_pins = FreshPins {
        pin_dir: &pin_dir,
        armed: false,
    };
    let (rules, health_rx) = start_datapath(config, &opts, &mut fresh_pins)?;
    let mut running = start_tasks(rules, listeners, &opts, &pin_dir)?;
    fresh_pins.armed = false;
    running
        .serve(&mut signals, health_rx, &opts.config_path)
        .await;
    running.stop(&opts).await
}

/// SIGINT, SIGTERM (stop) and SIGHUP (reload).
struct Signals {
    int: Signal,
    term: Signal,
    hup: Signal,
}

impl Signals {
    fn install() -> Result<Signals, DaemonError> {
        let on = |kind| signal(kind).map_err(DaemonError::Signal);
        Ok(Signals {
            int: on(SignalKind::interrupt())?,
            term: on(SignalKind::terminate())?,
            hup: on(SignalKind::hangup())?,
        })
    }
}

/// The API socket file, removed when the daemon stops or fails to start.
struct SocketFile(PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The pins a first start created: removed if the start fails after creating them, so a failed
/// first start leaves nothing behind (a restart's pins are the running datapath's and stay).
struct FreshPins<'a> {
    pin_dir: &'a Path,
    armed: bool,
}

impl Drop for FreshPins<'_> {
    fn drop(&mut self) {
        if self.armed {
            let _ = datapath::remove_pins(self.pin_dir);
        }
    }
}

/// Every listener, bound.
struct Listeners {
    socket: SocketFile,
    unix: tokio::net::UnixListener,
    tcp: Option<(
        tokio::net::TcpListener,
        Option<tonic::transport::ServerTlsConfig>,
    )>,
    metrics: Option<tokio::net::TcpListener>,
    ha: Option<(tokio::net::TcpListener, tonic::transport::ServerTlsConfig)>,
    /// What they listen on, for the log and `GetInfo`.
    names: Vec<String>,
}

impl Listeners {
    async fn bind(config: &Config) -> Result<Listeners, DaemonError> {
        let path = config.api_socket();
        let unix = crate::api::server::bind_unix(&path).map_err(|e| DaemonError::Listen {
            what: format!("the API socket {}", path.display()),
            source: e,
        })?;
        let socket = SocketFile(path);
        let mut names = vec![format!("unix:{}", socket.0.display())];
        let (tcp, metrics) = bind_tcp(config, &mut names).await?;
        let ha = bind_ha(config, &mut names).await?;
        Ok(Listeners {
            socket,
            unix,
            tcp,
            metrics,
            ha,
            names,
        })
    }
}

/// Opens (or takes over) the pinned datapath, attaches it (all or nothing), makes the kernel
/// settings forwarding needs, applies the services and drops links the config no longer
/// names: on a restart the old datapath runs untouched until every new hook is in place.
fn start_datapath(
    config: Config,
    opts: &DaemonOptions,
    fresh_pins: &mut FreshPins<'_>,
) -> Result<(Rules, mpsc::Receiver<crate::health::Change>), DaemonError> {
    let pin_dir = fresh_pins.pin_dir;
    // Before the load: a config this kernel cannot run fails without touching the pins.
    let kernel = KernelFeatures::probe()?;
    let tc_path = TcPath::choose(config.datapath.tc_attach, kernel)?;
    let start = StartState::load(&config);
    start.check(kernel)?;
    let mut dp = Datapath::open(
        pin_dir,
        EBPF_OBJECT,
        *config.conntrack.capacity.get_ref(),
        kernel,
        tc_path,
    )?;
    fresh_pins.armed = !dp.maps_reused;
    if dp.maps_reused {
        info!(pin_dir = %pin_dir.display(), "Reusing pinned maps; counters and state continue");
    } else {
        info!(pin_dir = %pin_dir.display(), "Created and pinned maps");
    }
    if let Err(e) = dp.attach_all(&config.interfaces) {
        dp.discard_failed_load();
        return Err(e.into());
    }
    dp.write_interfaces(&plan_interfaces(&config.interfaces, &SysHost)?)?;
    if let Some(ipv6) = config.translates() {
        datapath::prepare_forwarding(&config.interfaces, ipv6)?;
    }
    // Services: the config file's, or the API's changes on top of this very file.
    let (health_tx, health_rx) = mpsc::channel(256);
    let (mut rules, applied) = Rules::start(dp, start, opts.config_path.clone(), health_tx)
        .map_err(|failed| DaemonError::from(failed.1))?;
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
    for pin in rules.datapath_mut().remove_stale_links()? {
        info!(pin = %pin.display(), "Detached a pinned link the config no longer names");
    }
    // No old program runs any more: a migration of the pinned tables can end.
    rules.datapath_mut().finish_migration()?;
    Ok((rules, health_rx))
}

/// The running daemon: its tasks, all under one drain signal, and what the main loop polls.
struct Running {
    shared: Arc<Shared>,
    hub: EventHub,
    /// The drain signal: every task stops when it turns true.
    stop_tx: watch::Sender<bool>,
    tasks: JoinSet<()>,
    ha: Option<crate::ha::Running>,
    socket: Option<SocketFile>,
    ct_ring: AsyncFd<datapath::CtEventRing>,
    logger: Option<AsyncFd<aya_log::EbpfLogger<&'static dyn log::Log>>>,
    pin_dir: PathBuf,
    /// `datapath.detach_on_exit` as the daemon started.
    detach_on_exit: bool,
}

/// Starts every task: the API and metrics servers, conntrack expiry, the route watcher, the
/// event log and HA replication; takes the datapath's log and event rings for the main loop.
fn start_tasks(
    mut rules: Rules,
    listeners: Listeners,
    opts: &DaemonOptions,
    pin_dir: &Path,
) -> Result<Running, DaemonError> {
    let logger = match rules.datapath_mut().take_logger() {
        Ok(l) => Some(l),
        Err(e) => {
            warn!(error = %e, "Datapath log ring unavailable; eBPF log records will not be shown");
            None
        }
    };
    let logger = logger.and_then(|l| {
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
    // Conntrack events: the main loop drains the ring into the hub; subscribers never slow it.
    let hub = EventHub::new();
    // SAFETY: the RingBuf owns its fd and keeps it open while the AsyncFd owns it.
    let ct_ring = unsafe {
        AsyncFd::register_with_interest(
            rules.datapath_mut().take_ct_events()?,
            tokio::io::Interest::READABLE,
        )
    }
    .map_err(|e| DaemonError::EventRing(e.into()))?;

    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = JoinSet::new();
    // Conntrack expiry; a pass runs on the blocking pool.
    let gc_stats = Arc::new(GcStats::default());
    tasks.spawn(
        gc_loop(
            rules.datapath_mut().take_ct_table()?,
            rules.config().conntrack.timeouts.to_slots(),
            hub.clone(),
            gc_stats.clone(),
            Duration::from_millis(*rules.config().conntrack.gc_interval_ms.get_ref()),
            stop_rx.clone(),
        )
        .instrument(info_span!("ct_gc")),
    );
    // Route, neighbour and link changes end the generation of learned VXLAN headers; link
    // changes refresh FP_PEER.
    tasks.spawn(
        watch_routes(pin_dir.to_path_buf(), stop_rx.clone()).instrument(info_span!("netwatch")),
    );
    if let Some(path) = opts.ct_events_log.clone() {
        let span = info_span!("ct_events_log", path = %path.display());
        tasks.spawn(
            ct_events::log_to_file(hub.subscribe(), hub.stats.clone(), path, stop_rx.clone())
                .instrument(span),
        );
    }
    // HA replication: the peers' streams in, this node's changes out.
    let ha = match (&rules.config().ha, listeners.ha) {
        (Some(cfg), Some((listener, tls))) => {
            let ha = crate::ha::Ha::new(
                cfg,
                pin_dir.to_path_buf(),
                rules.lb_index(),
                rules.datapath().ct_installer().ok(),
            )?;
            let listener = listener.into_std().map_err(crate::ha::HaError::Runtime)?;
            let running = ha.start(hub.subscribe(), listener, tls, stop_rx.clone())?;
            info!(
                node_id = *cfg.node_id.get_ref(),
                peers = cfg.peers.len(),
                "HA replication running"
            );
            Some((ha, running))
        }
        _ => None,
    };
    // Announcements start once the datapath is attached and the services applied (both
    // done by now); a stop withdraws them before the datapath is detached or left.
    let announce_cfg = rules.config().announce.clone();
    let (announce, announce_ends) = match &announce_cfg {
        Some(a) => {
            let (handle, status, drain) = crate::announce::channels(*a.table.get_ref());
            (Some(handle), Some((status, drain)))
        }
        None => (None, None),
    };
    let attachments = rules.datapath().attachments.len();
    let detach_on_exit = rules.config().datapath.detach_on_exit;
    let shared = Arc::new(Shared {
        rules: tokio::sync::Mutex::new(Some(rules)),
        pin_dir: pin_dir.to_path_buf(),
        hub: hub.clone(),
        gc: gc_stats,
        started: std::time::Instant::now(),
        listeners: listeners.names.clone(),
        latency: Default::default(),
        ha: ha.as_ref().map(|(h, _)| h.clone()),
        announce,
    });
    if let (Some(cfg), Some((status, drain))) = (announce_cfg, announce_ends) {
        tasks.spawn(
            crate::announce::run(cfg, shared.clone(), status, drain, stop_rx.clone())
                .instrument(info_span!("announce")),
        );
    }
    tasks.spawn(
        crate::api::server::serve(
            Api(shared.clone()),
            listeners.unix,
            listeners.tcp,
            stop_rx.clone(),
        )
        .instrument(info_span!("api")),
    );
    if let Some(l) = listeners.metrics {
        tasks.spawn(
            crate::metrics::serve(l, shared.clone(), stop_rx.clone())
                .instrument(info_span!("metrics")),
        );
    }
    info!(
        attachments,
        pin_dir = %pin_dir.display(),
        listeners = %listeners.names.join(" "),
        "Datapath running; SIGINT/SIGTERM stops the daemon, SIGHUP reloads the config"
    );
    Ok(Running {
        shared,
        hub,
        stop_tx,
        tasks,
        ha: ha.map(|(_, running)| running),
        socket: Some(listeners.socket),
        ct_ring,
        logger,
        pin_dir: pin_dir.to_path_buf(),
        detach_on_exit,
    })
}

/// Follows route, neighbour and link changes (see `netwatch`) until `stop`.
async fn watch_routes(pin_dir: PathBuf, stop: watch::Receiver<bool>) {
    let maps = pin_dir.join("maps");
    let generations = Arc::new(std::sync::atomic::AtomicU64::new(0));
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
}

impl Running {
    /// The main loop, until SIGINT/SIGTERM: reloads, health changes, the event and log rings.
    async fn serve(
        &mut self,
        signals: &mut Signals,
        mut health_rx: mpsc::Receiver<crate::health::Change>,
        config_path: &Path,
    ) {
        let mut ct_drain = ct_events::drain_timer(if self.ha.is_some() {
            ct_events::DRAIN_EVERY_HA
        } else {
            ct_events::DRAIN_EVERY
        });
        loop {
            tokio::select! {
                _ = signals.int.recv() => { info!("SIGINT received"); return; }
                _ = signals.term.recv() => { info!("SIGTERM received"); return; }
                _ = signals.hup.recv() => reload(&self.shared, config_path).await,
                Some(change) = health_rx.recv() => {
                    if let Ok(mut rules) = self.shared.rules().await {
                        tokio::task::block_in_place(|| rules.health_changed(change));
                    }
                }
                drained = ct_events::drain_next(&mut self.ct_ring, &mut ct_drain, &self.hub) => {
                    if let Err(e) = drained {
                        // Not expected (an epoll error on the ring's fd); the timer keeps draining.
                        warn!(error = %e, "Waiting for the conntrack event ring failed");
                        ct_drain.tick().await;
                    }
                }
                ready = async {
                    match self.logger.as_mut() {
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
    }

    /// Drains: the last conntrack events reach the subscribers (event log, HA), every task
    /// gets the drain signal and `DRAIN_DEADLINE` to end; then the datapath is detached (an
    /// HA node first hands its VIPs over) or left attached.
    async fn stop(mut self, opts: &DaemonOptions) -> Result<(), DaemonError> {
        ct_events::drain(self.ct_ring.get_mut(), &self.hub);
        let _ = self.stop_tx.send(true);
        let is_ha = self.ha.is_some();
        let drained = tokio::time::timeout(DRAIN_DEADLINE, async {
            while self.tasks.join_next().await.is_some() {}
            if let Some(ha) = self.ha.take() {
                ha.stopped().await;
            }
        })
        .await;
        if drained.is_err() {
            warn!(
                still_running = self.tasks.len(),
                deadline_s = DRAIN_DEADLINE.as_secs(),
                "Tasks did not stop by the deadline; aborting them"
            );
            self.tasks.shutdown().await;
        }
        drop(self.socket.take());
        // Clients still connected (their connections outlive the server) see UNAVAILABLE from here.
        let Some(rules) = self.shared.rules.lock().await.take() else {
            return Ok(());
        };
        let dp = rules.into_datapath();
        if self.detach_on_exit && !opts.leave_attached {
            let n = dp.attachments.len();
            // An HA node hands its VIPs to the standby before it stops forwarding.
            dp.detach_all(is_ha.then_some(HANDOVER_TIMEOUT))?;
            info!(detached = n, "Detached programs and removed pins");
        } else {
            info!(pin_dir = %self.pin_dir.display(), "Leaving the datapath attached; `fastpath detach` removes it");
            dp.leave_attached();
        }
        Ok(())
    }
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
#[tracing::instrument(name = "reload", skip_all, fields(config = %path.display()))]
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
    interval: Duration,
    mut stop: watch::Receiver<bool>,
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
