//! `fastpath daemon`: load, attach, pin, forward datapath logs, and stop cleanly.
//!
//! Contract: the config is validated before the kernel is touched; any failure while attaching
//! undoes what this run attached (links it created are removed; links it found pinned are left
//! as they were), so a bad start never leaves the datapath half-updated.

use std::{
    fs::File,
    io,
    os::fd::AsRawFd as _,
    path::{Path, PathBuf},
};

use fastpath_common::{DatapathConfig, stats::CONFIG_F_DROP_MALFORMED};
use tokio::{
    io::unix::AsyncFd,
    signal::unix::{SignalKind, signal},
};
use tracing::{info, warn};

use crate::{
    EBPF_OBJECT,
    config::Config,
    datapath::{self, Datapath, DatapathError},
};

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Datapath(#[from] DatapathError),
    #[error(
        "another fastpath daemon already manages {pin_dir} (lock {lock}); stop it first, or give this one another datapath.pin_dir"
    )]
    AlreadyRunning { pin_dir: String, lock: String },
    #[error("creating lock file {path}: {source}")]
    Lock {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("installing signal handlers: {0}")]
    Signal(#[source] io::Error),
}

/// Options from the command line (runtime behaviour; the config file describes the datapath).
pub struct DaemonOptions {
    /// Leave programs attached on a clean stop, whatever the config says.
    pub leave_attached: bool,
}

/// Runs until SIGINT/SIGTERM.
pub async fn run(config: Config, opts: DaemonOptions) -> Result<(), DaemonError> {
    // Handlers first: a SIGINT/SIGTERM that arrives while attaching is held until the loop
    // below and then detaches cleanly, instead of killing the process half-attached.
    let mut sigint = signal(SignalKind::interrupt()).map_err(DaemonError::Signal)?;
    let mut sigterm = signal(SignalKind::terminate()).map_err(DaemonError::Signal)?;

    let pin_dir = config.datapath.pin_dir.get_ref().clone();
    let _lock = lock_pin_dir(&pin_dir)?;

    let mut dp = Datapath::open(&pin_dir, EBPF_OBJECT)?;
    if dp.maps_reused {
        info!(pin_dir = %pin_dir.display(), "Reusing pinned maps; counters and state continue");
    } else {
        info!(pin_dir = %pin_dir.display(), "Created and pinned maps");
    }
    let flags = if config.datapath.drop_malformed {
        CONFIG_F_DROP_MALFORMED
    } else {
        0
    };
    dp.set_config(DatapathConfig {
        flags,
        ..Default::default()
    })?;

    for iface in &config.interfaces {
        if let Err(e) = dp.attach_interface(iface) {
            // Undo only what this run created; reused pinned links keep the old datapath.
            let created: Vec<PathBuf> = dp
                .attachments
                .iter()
                .filter(|a| !a.reused)
                .map(|a| a.pin.clone())
                .collect();
            for p in created {
                let _ = std::fs::remove_file(p);
            }
            // A first start that failed leaves nothing behind: its fresh maps go too.
            let fresh = !dp.maps_reused;
            drop(dp);
            if fresh {
                let _ = datapath::remove_pins(&pin_dir);
            }
            return Err(e.into());
        }
    }
    for stale in dp.remove_stale_links()? {
        info!(pin = %stale.display(), "Detached a pinned link the config no longer names");
    }

    let logger = match dp.take_logger() {
        Ok(l) => Some(l),
        Err(e) => {
            warn!(error = %e, "Datapath log ring unavailable; eBPF log records will not be shown");
            None
        }
    };
    let mut logger = match logger {
        // SAFETY: the logger owns its ring buffer fd and keeps it open until the AsyncFd (which
        // owns the logger) is dropped.
        Some(l) => Some(
            unsafe { AsyncFd::register_with_interest(l, tokio::io::Interest::READABLE) }
                .map_err(|e| DaemonError::Signal(e.into()))?,
        ),
        None => None,
    };

    info!(
        attachments = dp.attachments.len(),
        pin_dir = %pin_dir.display(),
        "Datapath running; SIGINT/SIGTERM stops the daemon"
    );

    loop {
        tokio::select! {
            _ = sigint.recv() => { info!("SIGINT received"); break; }
            _ = sigterm.recv() => { info!("SIGTERM received"); break; }
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

/// An exclusive lock per pin directory, so two daemons never fight over one datapath.
/// Held for the daemon's life (released by the kernel even after a crash).
fn lock_pin_dir(pin_dir: &Path) -> Result<File, DaemonError> {
    let dir = Path::new("/run/fastpath");
    std::fs::create_dir_all(dir).map_err(|source| DaemonError::Lock {
        path: dir.into(),
        source,
    })?;
    let name: String = pin_dir
        .to_string_lossy()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let path = dir.join(format!("{name}.lock"));
    let file = File::create(&path).map_err(|source| DaemonError::Lock {
        path: path.clone(),
        source,
    })?;
    // SAFETY: flock on a valid open fd.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        return Err(DaemonError::AlreadyRunning {
            pin_dir: pin_dir.display().to_string(),
            lock: path.display().to_string(),
        });
    }
    Ok(file)
}
