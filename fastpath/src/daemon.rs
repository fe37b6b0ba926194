//! `fastpath daemon`: load, attach, pin, forward datapath logs, and stop cleanly.
//!
//! Contract: the config is validated before the kernel is touched; any failure while attaching
//! undoes what this run attached (links it created are removed; links it found pinned are left
//! as they were), so a bad start never leaves the datapath half-updated.

use std::{io, sync::Arc};

use fastpath_common::{
    DatapathConfig,
    stats::{CONFIG_F_DROP_MALFORMED, CONFIG_F_SNAT},
};
use tokio::{
    io::unix::AsyncFd,
    signal::unix::{SignalKind, signal},
};
use tracing::{info, warn};

use crate::{
    EBPF_OBJECT,
    config::Config,
    conntrack,
    ct_events::{self, EventHub},
    ct_gc::{self, GcStats},
    datapath::{self, CtTable, Datapath, DatapathError},
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
}

/// Options from the command line (runtime behaviour; the config file describes the datapath).
pub struct DaemonOptions {
    /// Leave programs attached on a clean stop, whatever the config says.
    pub leave_attached: bool,
    /// Append every conntrack event to this file (`conntrack -E` style lines).
    pub ct_events_log: Option<std::path::PathBuf>,
}

/// Runs until SIGINT/SIGTERM.
pub async fn run(config: Config, opts: DaemonOptions) -> Result<(), DaemonError> {
    // Handlers first: a SIGINT/SIGTERM that arrives while attaching is held until the loop
    // below and then detaches cleanly, instead of killing the process half-attached.
    let mut sigint = signal(SignalKind::interrupt()).map_err(DaemonError::Signal)?;
    let mut sigterm = signal(SignalKind::terminate()).map_err(DaemonError::Signal)?;

    let pin_dir = config.datapath.pin_dir.get_ref().clone();
    let _lock = datapath::lock_pin_dir(&pin_dir)?;

    let mut dp = Datapath::open(&pin_dir, EBPF_OBJECT, *config.conntrack.capacity.get_ref())?;
    if dp.maps_reused {
        info!(pin_dir = %pin_dir.display(), "Reusing pinned maps; counters and state continue");
    } else {
        info!(pin_dir = %pin_dir.display(), "Created and pinned maps");
    }
    let mut flags = if config.datapath.drop_malformed {
        CONFIG_F_DROP_MALFORMED
    } else {
        0
    };
    if config.interfaces.iter().any(|i| i.snat) {
        flags |= CONFIG_F_SNAT;
    }
    // Attach (all or nothing), then the runtime knobs, then drop links the config no longer
    // names: on a restart the old datapath runs untouched until every new hook is in place.
    let started = dp
        .attach_all(&config.interfaces)
        .and_then(|()| {
            dp.set_config(DatapathConfig {
                flags,
                ct_timeouts_s: config.conntrack.timeouts.to_slots(),
                ..Default::default()
            })
        })
        .and_then(|()| dp.set_interfaces(&config.interfaces))
        .map(|()| {
            if config.interfaces.iter().any(|i| i.snat) || !config.port_forwards.is_empty() {
                datapath::allow_local_sources(&config.interfaces);
            }
        })
        .and_then(|()| {
            let applied = dp.set_services(&config.services)?;
            crate::lb::resolve_dsr_backends(&config.services);
            info!(
                services = applied.services,
                unchanged = applied.unchanged,
                removed = applied.removed,
                backends = applied.backends,
                slots = applied.slots,
                took_us = applied.took.as_micros() as u64,
                "Services applied"
            );
            Ok(())
        })
        .and_then(|()| dp.remove_stale_links());
    let stale = match started {
        Ok(stale) => stale,
        Err(e) => {
            // A first start that failed leaves nothing behind: its fresh maps go too.
            let fresh = !dp.maps_reused;
            drop(dp);
            if fresh {
                let _ = datapath::remove_pins(&pin_dir);
            }
            return Err(e.into());
        }
    };
    for pin in stale {
        info!(pin = %pin.display(), "Detached a pinned link the config no longer names");
    }

    let logger = match dp.take_logger() {
        Ok(l) => Some(l),
        Err(e) => {
            warn!(error = %e, "Datapath log ring unavailable; eBPF log records will not be shown");
            None
        }
    };
    // SAFETY: the logger owns its ring buffer fd and keeps it open until the AsyncFd (which
    // owns the logger) is dropped.
    let mut logger = logger.and_then(|l| {
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
        AsyncFd::register_with_interest(dp.take_ct_events()?, tokio::io::Interest::READABLE)
    }
    .map_err(|e| DaemonError::EventRing(e.into()))?;
    // Conntrack expiry in its own task; a pass runs on the blocking pool.
    let (stop_gc, gc_stop) = tokio::sync::watch::channel(false);
    let gc_task = tokio::spawn(gc_loop(
        dp.take_ct_table()?,
        config.conntrack.timeouts.to_slots(),
        hub.clone(),
        Arc::new(GcStats::default()),
        std::time::Duration::from_millis(*config.conntrack.gc_interval_ms.get_ref()),
        gc_stop,
    ));
    let event_log = opts.ct_events_log.clone().map(|path| {
        tokio::spawn(ct_events::log_to_file(
            hub.subscribe(),
            hub.stats.clone(),
            path,
        ))
    });

    // Health checks: a change re-applies the services with down backends at weight 0.
    let (health_tx, mut health_rx) = tokio::sync::mpsc::channel(256);
    let probes = crate::health::spawn(&config.services, health_tx);
    let mut effective = config.services.clone();

    info!(
        attachments = dp.attachments.len(),
        pin_dir = %pin_dir.display(),
        "Datapath running; SIGINT/SIGTERM stops the daemon"
    );

    loop {
        tokio::select! {
            _ = sigint.recv() => { info!("SIGINT received"); break; }
            _ = sigterm.recv() => { info!("SIGTERM received"); break; }
            Some(change) = health_rx.recv() => {
                crate::health::apply_change(&mut effective, &config.services, &change);
                match dp.update_services(&effective, &[change.service]) {
                    Ok(applied) => info!(
                        service = change.service,
                        backend = change.backend,
                        up = change.up,
                        took_us = applied.took.as_micros() as u64,
                        "Services re-applied after a health change"
                    ),
                    Err(e) => warn!(error = %e, "Could not re-apply the services after a health change; the datapath keeps the previous ones"),
                }
            }
            ready = ct_ring.readable_mut() => {
                if let Ok(mut guard) = ready {
                    ct_events::drain(guard.get_inner_mut(), &hub);
                    guard.clear_ready();
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

    for p in probes {
        p.abort();
    }
    let _ = stop_gc.send(true);
    let _ = gc_task.await;
    // Closing the hub ends the subscribers once they have written what they hold.
    drop(hub);
    if let Some(task) = event_log {
        let _ = task.await;
    }
    drop(ct_ring);

    if config.datapath.detach_on_exit && !opts.leave_attached {
        let n = dp.attachments.len();
        dp.detach_all()?;
        info!(detached = n, "Detached programs and removed pins");
    } else {
        info!(pin_dir = %pin_dir.display(), "Leaving the datapath attached; `fastpath detach` removes it");
        dp.leave_attached();
    }
    Ok(())
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
