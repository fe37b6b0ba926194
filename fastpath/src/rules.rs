//! Desired state → realized state: the services (and runtime settings) the daemon should have,
//! how changes to them are checked, applied and persisted.
//!
//! Contract: every change — an API call, an applied config, a SIGHUP reload — is validated as a
//! whole (the same checks as a config file at start) before the datapath is touched; a
//! rejected change leaves desired state, maps and state file exactly as they were. Changes are
//! serialized by the owner (one `&mut Rules` at a time), each bumps `generation`, and each is
//! persisted to the state file so a restart (or crash) comes back with it.

use std::{
    collections::{BTreeSet, HashMap},
    net::SocketAddr,
    path::{Path, PathBuf},
};

use fastpath_common::{
    DatapathConfig,
    stats::{CONFIG_F_DROP_MALFORMED, CONFIG_F_SNAT, CONFIG_F_VXLAN},
};
use tokio::{sync::mpsc, task::JoinHandle};
use tracing::{info, warn};

use crate::{
    config::{Config, ConfigError, InterfaceCheck, ServiceConfig, ServiceId},
    datapath::{Datapath, DatapathError, DatapathOps, KernelFeatures, ServicesApplied},
    health::{self, ProbeKey},
    ifaces::{Host, SysHost, plan_interfaces},
    lb::ServicePlanner,
};

/// Why a change was refused (maps to a gRPC status and a CLI exit code).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RejectKind {
    Invalid,
    AlreadyExists,
    NotFound,
    /// `expected_generation` is stale, or the change needs a restart.
    Precondition,
    /// The kernel refused; nothing changed.
    Internal,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Rejected {
    pub kind: RejectKind,
    pub message: String,
}

impl Rejected {
    pub fn new(kind: RejectKind, message: impl Into<String>) -> Rejected {
        Rejected {
            kind,
            message: message.into(),
        }
    }
}

/// What a change did, or with `dry_run` would do.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChangeSummary {
    pub generation: u64,
    pub created: Vec<String>,
    pub updated: Vec<String>,
    pub deleted: Vec<String>,
    pub unchanged: u32,
    pub took_us: u64,
    pub dry_run: bool,
    /// Things the operator should know (settings that wait for a restart).
    pub notes: Vec<String>,
}

/// The difference between two service lists, by identity.
pub fn diff(old: &[ServiceConfig], new: &[ServiceConfig]) -> ChangeSummary {
    let before: HashMap<ServiceId, &ServiceConfig> = old.iter().map(|s| (s.id(), s)).collect();
    let after: HashMap<ServiceId, &ServiceConfig> = new.iter().map(|s| (s.id(), s)).collect();
    let mut out = ChangeSummary::default();
    for s in new {
        match before.get(&s.id()) {
            None => out.created.push(s.id().to_string()),
            Some(o) if *o != s => out.updated.push(s.id().to_string()),
            Some(_) => out.unchanged += 1,
        }
    }
    let gone: BTreeSet<ServiceId> = old
        .iter()
        .map(|s| s.id())
        .filter(|id| !after.contains_key(id))
        .collect();
    out.deleted = gone.iter().map(ToString::to_string).collect();
    out
}

/// Checks `services` in the context of `base` (its datapath, interfaces, limits), with the
/// checks a config file gets; errors name the service by its identity.
pub fn validate_services(
    base: &Config,
    services: Vec<ServiceConfig>,
    source: &str,
) -> Result<Config, Rejected> {
    let mut candidate = base.clone();
    candidate.services = services;
    candidate
        .validate(Path::new(source), "", InterfaceCheck::Skip)
        .map_err(|e| Rejected::new(RejectKind::Invalid, name_services(&e, &candidate)))?;
    Ok(candidate)
}

/// A config error about `service[i]` named by the service's identity instead of its index
/// (an API client never saw the index).
fn name_services(e: &ConfigError, config: &Config) -> String {
    let mut text = e.message.clone();
    if let Some(key) = &e.key {
        let named = key
            .strip_prefix("service[")
            .and_then(|rest| rest.split_once(']'))
            .and_then(|(i, rest)| {
                let svc = config.services.get(i.parse::<usize>().ok()?)?;
                Some(format!("service {}{rest}", svc.id()))
            })
            .unwrap_or_else(|| key.clone());
        text = format!("{named}: {text}");
    }
    text
}

/// What a start applies ([`Rules::start`]): the config file, or the changes made through
/// the API on top of this very file, restored from the state file. Read once, before the
/// daemon loads anything, so what the kernel cannot run is refused first.
pub struct StartState {
    config: Config,
    generation: u64,
    /// The config file's fingerprint.
    base: u64,
    /// The state file, when its services are the ones applied.
    restored_from: Option<PathBuf>,
}

impl StartState {
    pub fn load(file_config: &Config) -> StartState {
        let base = file_config.fingerprint();
        let state_path = file_config.state_file();
        let (config, generation, restored_from) = match load_state(&state_path) {
            Ok(Some(saved)) if saved.base == base => {
                info!(state = %state_path.display(), generation = saved.generation, "Restored the changes made through the API");
                (saved.config, saved.generation, Some(state_path))
            }
            Ok(Some(saved)) => {
                warn!(state = %state_path.display(), generation = saved.generation, "The config file changed since the API changes in the state file were made: the file wins");
                (file_config.clone(), saved.generation, None)
            }
            Ok(None) => (file_config.clone(), 0, None),
            Err(e) => {
                warn!(error = %e, "Ignoring an unreadable state file: starting from the config file");
                (file_config.clone(), 0, None)
            }
        };
        StartState {
            config,
            generation,
            base,
            restored_from,
        }
    }

    /// The services the start applies.
    pub fn services(&self) -> &[ServiceConfig] {
        &self.config.services
    }

    /// Whether `kernel` runs the services the start applies; the error names a service the
    /// API created as restored from the state file (the config file does not show it).
    pub fn check(&self, kernel: KernelFeatures) -> Result<(), DatapathError> {
        kernel
            .check_services(self.services())
            .map_err(|e| match (e, &self.restored_from) {
                (DatapathError::NoBpfLoop { service }, Some(state)) => DatapathError::NoBpfLoop {
                    service: format!(
                        "{service} (created through the API, restored from the state file {})",
                        state.display()
                    ),
                },
                (e, _) => e,
            })
    }
}

/// First line of a state file: what it was made from.
const STATE_MAGIC: &str = "# fastpath state:";

/// The runtime flags of the datapath for `config`.
pub fn datapath_config(config: &Config) -> DatapathConfig {
    let mut flags = if config.datapath.drop_malformed {
        CONFIG_F_DROP_MALFORMED
    } else {
        0
    };
    if config.interfaces.iter().any(|i| i.snat) {
        flags |= CONFIG_F_SNAT;
    }
    if config.interfaces.iter().any(|i| i.vxlan.is_some()) {
        flags |= CONFIG_F_VXLAN;
    }
    DatapathConfig {
        flags,
        ct_timeouts_s: config.conntrack.timeouts.to_slots(),
        ..Default::default()
    }
}

/// A state file: the desired config after API changes, the generation it reached, and the
/// fingerprint of the config file it was made on top of.
pub struct SavedState {
    pub generation: u64,
    pub base: u64,
    pub config: Config,
}

/// Reads a state file; `Ok(None)` if there is none.
pub fn load_state(path: &Path) -> Result<Option<SavedState>, ConfigError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(ConfigError {
                path: path.to_owned(),
                line: None,
                key: None,
                message: format!("cannot read the state file: {e}"),
            });
        }
    };
    let bad = |message: &str| ConfigError {
        path: path.to_owned(),
        line: Some(1),
        key: None,
        message: format!(
            "{message}; the state file is written by fastpath only: remove it to start from the config file"
        ),
    };
    let first = text.lines().next().unwrap_or("");
    let meta = first
        .strip_prefix(STATE_MAGIC)
        .ok_or_else(|| bad("no state header"))?;
    let field = |name: &str| {
        meta.split_whitespace()
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
            .ok_or_else(|| bad(&format!("no {name} in the state header")))
    };
    let generation: u64 = field("generation")?
        .parse()
        .map_err(|_| bad("bad generation"))?;
    let base = u64::from_str_radix(field("base")?, 16).map_err(|_| bad("bad base"))?;
    let config = Config::parse_with(path, &text, InterfaceCheck::Skip)?;
    Ok(Some(SavedState {
        generation,
        base,
        config,
    }))
}

/// Writes the state file atomically (a temporary file renamed over it).
fn save_state(path: &Path, generation: u64, base: u64, config: &Config) -> Result<(), String> {
    let body = config
        .to_toml()
        .map_err(|e| format!("encoding the state: {e}"))?;
    let text = format!(
        "{STATE_MAGIC} generation={generation} base={base:016x}\n# Written by the fastpath daemon: the desired state after API changes. Edit the config file instead.\n{body}"
    );
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    }
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).map_err(|e| format!("writing {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| format!("renaming to {}: {e}", path.display()))
}

/// A backend's health as last reported.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendHealth {
    pub service: ServiceId,
    pub backend: SocketAddr,
    pub up: bool,
    pub detail: String,
}

/// Why [`Rules::start`] failed, with the datapath handed back (for a clean shutdown).
pub type StartError<D> = Box<(D, DatapathError)>;

/// The daemon's desired state and the datapath it realizes it in (the real [`Datapath`], or
/// in unit tests an in-memory one).
pub struct Rules<D: DatapathOps = Datapath> {
    dp: D,
    /// Plans the services written into `dp` (this process is the LB maps' only writer).
    planner: ServicePlanner,
    /// The desired config: services as configured (health does not change them).
    config: Config,
    generation: u64,
    /// Fingerprint of the config file the current desired state grew from.
    base: u64,
    config_path: PathBuf,
    /// Backends the probes report down, with what the last probe saw.
    down: HashMap<(ServiceId, SocketAddr), String>,
    probes: HashMap<ProbeKey, JoinHandle<()>>,
    health_tx: mpsc::Sender<health::Change>,
    health_events: tokio::sync::broadcast::Sender<BackendHealth>,
    /// The datapath's service and backend numbering, republished after every change, for
    /// HA replication (which names services and backends by identity on the wire).
    lb_index: tokio::sync::watch::Sender<std::sync::Arc<crate::sync::LbIndex>>,
    /// What interface planning looks up (this host; a fake in tests).
    host: Box<dyn Host + Send + Sync>,
}

impl<D: DatapathOps> Rules<D> {
    /// Takes over a loaded, attached datapath whose services are not applied yet: applies
    /// `start`'s services (the config file's, or the API's restored) and starts the probes.
    pub fn start(
        mut dp: D,
        start: StartState,
        config_path: PathBuf,
        health_tx: mpsc::Sender<health::Change>,
    ) -> Result<(Rules<D>, ServicesApplied), StartError<D>> {
        let checked = start.check(dp.kernel());
        let StartState {
            config,
            generation,
            base,
            ..
        } = start;
        let mut planner = ServicePlanner::default();
        let applied = match checked
            .and_then(|()| dp.set_config(datapath_config(&config)))
            .and_then(|()| planner.apply(&mut dp, &config.services, None))
        {
            Ok(a) => a,
            Err(e) => return Err(Box::new((dp, e))),
        };
        dp.resolve_neighbours(&crate::lb::dsr_backends(&config.services));
        let mut rules = Rules {
            dp,
            planner,
            config,
            generation,
            base,
            config_path,
            down: HashMap::new(),
            probes: HashMap::new(),
            health_tx,
            health_events: tokio::sync::broadcast::channel(1024).0,
            lb_index: tokio::sync::watch::channel(Default::default()).0,
            host: Box::new(SysHost),
        };
        rules.publish_lb_index();
        rules.reconcile_probes();
        Ok((rules, applied))
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The datapath's current service and backend numbering, kept up to date.
    pub fn lb_index(&self) -> tokio::sync::watch::Receiver<std::sync::Arc<crate::sync::LbIndex>> {
        self.lb_index.subscribe()
    }

    fn publish_lb_index(&mut self) {
        match self.dp.lb_index() {
            Ok(ix) => {
                self.lb_index.send_replace(std::sync::Arc::new(ix));
            }
            Err(e) => {
                warn!(error = %e, "Could not read the service numbering; HA replication keeps the previous one")
            }
        }
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    pub fn config_path(&self) -> &Path {
        &self.config_path
    }

    pub fn datapath(&self) -> &D {
        &self.dp
    }

    pub fn datapath_mut(&mut self) -> &mut D {
        &mut self.dp
    }

    /// Gives the datapath back (shutdown): probes stop.
    pub fn into_datapath(self) -> D {
        for p in self.probes.values() {
            p.abort();
        }
        self.dp
    }

    pub fn health(&self) -> Vec<BackendHealth> {
        let mut out = Vec::new();
        for (key, _) in health::probes_of(&self.config.services) {
            let down = self.down.get(&(key.service, key.backend));
            out.push(BackendHealth {
                service: key.service,
                backend: key.backend,
                up: down.is_none(),
                detail: down.cloned().unwrap_or_else(|| "up".into()),
            });
        }
        out
    }

    /// Whether the health checks hold `backend` of `service` down (one lookup: the caller
    /// knows whether the service is checked; see [`Rules::backend_health`]).
    pub fn backend_down(&self, service: ServiceId, backend: SocketAddr) -> bool {
        self.down.contains_key(&(service, backend))
    }

    /// "up", "down" or "unchecked" for a backend.
    pub fn backend_health(&self, service: ServiceId, backend: SocketAddr) -> &'static str {
        let checked = self
            .config
            .services
            .iter()
            .any(|s| s.id() == service && s.health_check.is_some());
        match (checked, self.backend_down(service, backend)) {
            (false, _) => "unchecked",
            (true, true) => "down",
            (true, false) => "up",
        }
    }

    pub fn subscribe_health(&self) -> tokio::sync::broadcast::Receiver<BackendHealth> {
        self.health_events.subscribe()
    }

    fn check_generation(&self, expected: u64) -> Result<(), Rejected> {
        if expected != 0 && expected != self.generation {
            return Err(Rejected::new(
                RejectKind::Precondition,
                format!(
                    "the desired state is at generation {}, not {expected}: another change came first; read it again and retry",
                    self.generation
                ),
            ));
        }
        Ok(())
    }

    /// Changes the services with `edit`, checked and applied as one change.
    pub fn change_services(
        &mut self,
        expected_generation: u64,
        dry_run: bool,
        source: &str,
        edit: impl FnOnce(&mut Vec<ServiceConfig>) -> Result<(), Rejected>,
    ) -> Result<ChangeSummary, Rejected> {
        self.check_generation(expected_generation)?;
        let mut services = self.config.services.clone();
        edit(&mut services)?;
        let candidate = validate_services(&self.config, services, source)?;
        self.commit(candidate, dry_run, self.base)
    }

    /// Makes `candidate` (already validated) the desired state: services applied by
    /// difference, runtime settings written, state saved.
    fn commit(
        &mut self,
        candidate: Config,
        dry_run: bool,
        base: u64,
    ) -> Result<ChangeSummary, Rejected> {
        let started = std::time::Instant::now();
        // What this kernel cannot run is refused like an invalid config, dry run or not.
        self.dp
            .kernel()
            .check_services(&candidate.services)
            .map_err(|e| Rejected::new(RejectKind::Invalid, format!("{e}; nothing was changed")))?;
        let mut summary = diff(&self.config.services, &candidate.services);
        summary.dry_run = dry_run;
        if dry_run {
            summary.generation = self.generation;
            return Ok(summary);
        }
        let internal = |e: DatapathError| {
            Rejected::new(
                RejectKind::Internal,
                format!(
                    "the kernel refused the change: {e}; the datapath keeps the previous services"
                ),
            )
        };
        let attach_failed = |e: &dyn std::fmt::Display| {
            Rejected::new(
                RejectKind::Internal,
                format!(
                    "attaching to the new interfaces failed: {e}; the datapath keeps its previous interfaces, services and settings"
                ),
            )
        };
        // Planned before anything moves: interfaces that cannot be planned refuse the change
        // with nothing written.
        let interfaces = (candidate.interfaces != self.config.interfaces)
            .then(|| plan_interfaces(&candidate.interfaces, &*self.host))
            .transpose()
            .map_err(|e| attach_failed(&e))?;
        // The kernel's part first: a change it cannot carry is refused before anything moves.
        if let Some(ipv6) = candidate.translates() {
            self.dp
                .prepare_forwarding(&candidate.interfaces, ipv6)
                .map_err(|e| {
                    Rejected::new(RejectKind::Internal, format!("{e}; nothing was changed"))
                })?;
        }
        let changed = !(summary.created.is_empty()
            && summary.updated.is_empty()
            && summary.deleted.is_empty());
        if changed {
            let effective = health::effective(&candidate.services, &self.down);
            if let Err(e) = self.planner.apply(&mut self.dp, &effective, None) {
                // Written in part, perhaps (some services switched): back to what was.
                self.restore_services();
                return Err(internal(e));
            }
        }
        let settings = datapath_config(&candidate);
        let settings_changed = settings != datapath_config(&self.config);
        if settings_changed && let Err(e) = self.dp.set_config(settings) {
            // All or nothing: the services go back to what they were.
            if changed {
                self.restore_services();
            }
            return Err(internal(e));
        }
        if let Some(plan) = &interfaces {
            match self.dp.reattach(&candidate.interfaces, plan) {
                Ok(detached) => {
                    for pin in detached {
                        summary.notes.push(format!("detached {}", pin.display()));
                    }
                    summary.notes.push(format!(
                        "interfaces now: {}",
                        candidate
                            .interfaces
                            .iter()
                            .map(|i| i.name.get_ref().as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ));
                }
                Err(e) => {
                    if changed {
                        self.restore_services();
                    }
                    if settings_changed
                        && let Err(undo) = self.dp.set_config(datapath_config(&self.config))
                    {
                        warn!(error = %undo, "Could not restore the previous settings");
                    }
                    return Err(attach_failed(&e));
                }
            }
        }
        if changed {
            self.publish_lb_index();
            self.dp
                .resolve_neighbours(&crate::lb::dsr_backends(&candidate.services));
        }
        self.config = candidate;
        self.base = base;
        self.generation += 1;
        summary.generation = self.generation;
        if let Err(e) = save_state(
            &self.config.state_file(),
            self.generation,
            self.base,
            &self.config,
        ) {
            warn!(error = %e, "The change is applied but could not be saved; a restart would lose it");
            summary.notes.push(format!(
                "applied, but not saved ({e}): a restart would lose it"
            ));
        }
        self.reconcile_probes();
        summary.took_us = started.elapsed().as_micros() as u64;
        info!(
            generation = self.generation,
            created = summary.created.len(),
            updated = summary.updated.len(),
            deleted = summary.deleted.len(),
            unchanged = summary.unchanged,
            took_us = summary.took_us,
            "Desired state changed"
        );
        Ok(summary)
    }

    /// Writes the services of the current desired state again, after a refused change wrote
    /// some of its own.
    fn restore_services(&mut self) {
        let before = health::effective(&self.config.services, &self.down);
        if let Err(undo) = self.planner.apply(&mut self.dp, &before, None) {
            warn!(error = %undo, "Could not restore the previous services after a refused change");
        }
    }

    /// Makes a whole config the desired state (an Apply, or a reload of the file): refused if
    /// it changes what only a restart can (pin dir, table capacity). Interfaces are attached
    /// and detached as the config says.
    pub fn apply_config(
        &mut self,
        new: Config,
        expected_generation: u64,
        dry_run: bool,
        from_file: bool,
    ) -> Result<ChangeSummary, Rejected> {
        self.check_generation(expected_generation)?;
        let old = &self.config;
        let restart = |what: &str| {
            Rejected::new(
                RejectKind::Precondition,
                format!(
                    "{what} changed: that takes a restart (the datapath keeps forwarding across it; a restart with another capacity migrates the pinned table; a pin_dir change needs `fastpath detach` first); nothing was changed"
                ),
            )
        };
        if new.datapath.pin_dir != old.datapath.pin_dir {
            return Err(restart("datapath.pin_dir"));
        }
        if new.conntrack.capacity != old.conntrack.capacity {
            return Err(restart("conntrack.capacity"));
        }
        let mut notes = Vec::new();
        if new.api != old.api {
            notes.push("[api] changed: the listeners change at the next restart".to_string());
        }
        if new.ha != old.ha {
            notes.push(
                "[ha] changed: replication uses the new settings at the next restart".to_string(),
            );
        }
        if new.conntrack.gc_interval_ms != old.conntrack.gc_interval_ms {
            notes.push("conntrack.gc_interval_ms changes at the next restart".to_string());
        }
        // A reload keeps the API's changes unless the file itself changed.
        let (candidate, base) = if from_file {
            let fp = new.fingerprint();
            if fp == self.base {
                notes.push(
                    "the config file is unchanged: the changes made through the API stay".into(),
                );
                return Ok(ChangeSummary {
                    generation: self.generation,
                    unchanged: self.config.services.len() as u32,
                    dry_run,
                    notes,
                    ..ChangeSummary::default()
                });
            }
            (new, fp)
        } else {
            (new, self.base)
        };
        let mut summary = self.commit(candidate, dry_run, base)?;
        summary.notes.extend(notes);
        Ok(summary)
    }

    /// Applies a health change: the backend's weight in the datapath becomes 0 (down) or its
    /// configured weight (up); the desired state does not change.
    pub fn health_changed(&mut self, change: health::Change) {
        let key = (change.service, change.backend);
        let known = self.config.services.iter().any(|s| {
            s.id() == change.service
                && s.backends.iter().any(|b| {
                    SocketAddr::new(*b.address.get_ref(), *b.port.get_ref()) == change.backend
                })
        });
        if !known {
            return;
        }
        if change.up {
            self.down.remove(&key);
        } else {
            self.down.insert(key, change.detail.clone());
        }
        let _ = self.health_events.send(BackendHealth {
            service: change.service,
            backend: change.backend,
            up: change.up,
            detail: change.detail,
        });
        let effective = health::effective(&self.config.services, &self.down);
        let Some(idx) = effective.iter().position(|s| s.id() == change.service) else {
            return;
        };
        let updated = self.planner.apply(&mut self.dp, &effective, Some(&[idx]));
        self.publish_lb_index();
        match updated {
            Ok(applied) => info!(
                service = %change.service,
                backend = %change.backend,
                up = change.up,
                took_us = applied.took.as_micros() as u64,
                "Services re-applied after a health change"
            ),
            Err(e) => {
                warn!(error = %e, "Could not re-apply the services after a health change; the datapath keeps the previous ones")
            }
        }
    }

    /// Starts the probes the services ask for and stops the ones they no longer do; probes
    /// of unchanged backends keep running (and their state).
    fn reconcile_probes(&mut self) {
        let wanted: HashMap<ProbeKey, crate::config::HealthCheck> =
            health::probes_of(&self.config.services)
                .into_iter()
                .collect();
        self.probes.retain(|k, task| {
            let keep = wanted.contains_key(k);
            if !keep {
                task.abort();
            }
            keep
        });
        for (key, check) in wanted {
            if !self.probes.contains_key(&key) {
                let task = health::spawn_probe(key.clone(), check, self.health_tx.clone());
                self.probes.insert(key, task);
            }
        }
        let live: std::collections::HashSet<(ServiceId, SocketAddr)> =
            self.probes.keys().map(|k| (k.service, k.backend)).collect();
        self.down.retain(|k, _| live.contains(k));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn services(toml: &str) -> Vec<ServiceConfig> {
        crate::testkit::netns::parse_services(toml)
    }

    #[test]
    fn diff_names_created_updated_deleted_and_counts_unchanged() {
        let old = services(
            "[[service]]\nvip = \"10.0.0.1\"\nport = 80\n[[service.backend]]\naddress = \"10.1.0.1\"\nport = 80\n\
             [[service]]\nvip = \"10.0.0.1\"\nport = 443\n[[service.backend]]\naddress = \"10.1.0.1\"\nport = 443\n\
             [[service]]\nvip = \"10.0.0.2\"\nport = 53\nprotocol = \"udp\"\n",
        );
        let new = services(
            "[[service]]\nvip = \"10.0.0.1\"\nport = 80\n[[service.backend]]\naddress = \"10.1.0.1\"\nport = 80\n\
             [[service]]\nvip = \"10.0.0.1\"\nport = 443\n[[service.backend]]\naddress = \"10.1.0.2\"\nport = 443\n\
             [[service]]\nvip = \"fd00::1\"\nport = 80\n",
        );
        let d = diff(&old, &new);
        assert_eq!(d.created, vec!["[fd00::1]:80/tcp"]);
        assert_eq!(d.updated, vec!["10.0.0.1:443/tcp"]);
        assert_eq!(d.deleted, vec!["10.0.0.2:53/udp"]);
        assert_eq!(d.unchanged, 1);
    }

    #[test]
    fn validation_names_the_service_not_its_index() {
        let base = Config::parse_with(
            Path::new("t"),
            "[[interface]]\nname = \"lo\"\n",
            InterfaceCheck::Skip,
        )
        .unwrap();
        let mut svcs = services(
            "[[service]]\nvip = \"10.0.0.1\"\nport = 80\n[[service.backend]]\naddress = \"10.1.0.1\"\nport = 80\n",
        );
        svcs[0].backends[0].address = toml::Spanned::new(0..0, "fd00::2".parse().unwrap());
        let e = validate_services(&base, svcs, "<api>").unwrap_err();
        assert_eq!(e.kind, RejectKind::Invalid);
        assert!(
            e.message
                .starts_with("service 10.0.0.1:80/tcp.backend[0].address: backend fd00::2"),
            "{}",
            e.message
        );
    }

    #[test]
    fn state_round_trips_through_the_config_parser() {
        let text = "[[interface]]\nname = \"lo\"\n\
            [[service]]\nvip = \"10.0.0.1\"\nport = 80\nscheduler = \"wrr\"\nmode = \"full_nat\"\nsnat_address = \"10.9.0.1\"\nsnat_ports = \"2000-3000\"\n\
            [[service.backend]]\naddress = \"10.1.0.1\"\nport = 8080\nweight = 3\n\
            [service.health_check]\nkind = \"http\"\npath = \"/h\"\n\
            [[port_forward]]\naddress = \"10.0.0.9\"\nport = 2222\nto = \"10.1.0.5\"\nto_port = 22\n";
        let c = Config::parse_with(Path::new("t"), text, InterfaceCheck::Skip).unwrap();
        let dir = std::env::temp_dir().join(format!("fp-state-{}", std::process::id()));
        let path = dir.join("s.toml");
        save_state(&path, 7, 0xabc, &c).unwrap();
        let back = load_state(&path).unwrap().unwrap();
        assert_eq!((back.generation, back.base), (7, 0xabc));
        assert_eq!(back.config.services, c.services);
        assert!(back.config.services[1].port_forward);
        assert_eq!(back.config.fingerprint(), c.fingerprint());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    use crate::{
        datapath::{
            InterfacePlan,
            fake::{FakeDatapath, ServiceView, Step, Write},
        },
        ifaces::FakeHost,
    };

    /// A scratch directory for one test's state file, removed when dropped.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(name: &str) -> Scratch {
            let dir = std::env::temp_dir().join(format!("fp-rules-{}-{name}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {dir:?}: {e}"));
            Scratch(dir)
        }

        fn state(&self) -> PathBuf {
            self.0.join("state.toml")
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    const BEFORE: &str = "[[interface]]\nname = \"eth9\"\n\
        [[service]]\nvip = \"10.0.0.1\"\nport = 80\n\
        [[service.backend]]\naddress = \"10.1.0.1\"\nport = 80\n\
        [[service.backend]]\naddress = \"10.1.0.2\"\nport = 80\n\
        [[service]]\nvip = \"10.0.0.2\"\nport = 53\nprotocol = \"udp\"\nscheduler = \"wrr\"\n\
        [[service.backend]]\naddress = \"10.1.0.3\"\nport = 53\n";

    /// BEFORE with every kind of change: a service updated, one deleted, one created (in DSR
    /// mode), a runtime setting and the interfaces changed.
    const AFTER: &str = "[datapath]\ndrop_malformed = true\n\
        [[interface]]\nname = \"eth9\"\n[[interface]]\nname = \"eth8\"\n\
        [[service]]\nvip = \"10.0.0.1\"\nport = 80\n\
        [[service.backend]]\naddress = \"10.1.0.1\"\nport = 80\n\
        [[service.backend]]\naddress = \"10.1.0.4\"\nport = 80\n\
        [[service]]\nvip = \"10.0.0.3\"\nport = 443\nmode = \"dsr\"\n\
        [[service.backend]]\naddress = \"10.1.0.5\"\nport = 443\n";

    fn config(scratch: &Scratch, text: &str) -> Config {
        let text = format!(
            "[api]\nstate_file = {:?}\n{text}",
            scratch.state().display().to_string()
        );
        Config::parse_with(Path::new("t"), &text, InterfaceCheck::Skip)
            .unwrap_or_else(|e| panic!("test config: {e}"))
    }

    /// Rules over a fake datapath holding BEFORE, committed once (generation 1, state saved).
    fn started(scratch: &Scratch) -> Rules<FakeDatapath> {
        let (tx, _rx) = mpsc::channel(1);
        let fake = FakeDatapath::attached_to(&["eth9"]);
        let (mut rules, applied) = Rules::start(
            fake,
            StartState::load(&config(scratch, BEFORE)),
            scratch.0.join("config.toml"),
            tx,
        )
        .unwrap_or_else(|e| panic!("start on a fake datapath: {}", e.1));
        assert_eq!(applied.services, 2, "services written at start");
        rules.host = Box::new(FakeHost::with(&[("eth8", 8), ("eth9", 9)]));
        let mut services = rules.config().services.clone();
        services.reverse();
        rules
            .change_services(0, false, "<test>", |s| {
                *s = services;
                Ok(())
            })
            .unwrap_or_else(|e| panic!("a first change: {e}"));
        assert_eq!(rules.generation(), 1);
        rules
    }

    /// Everything a refused change must leave as it was.
    #[derive(Debug, PartialEq)]
    struct Snapshot {
        view: std::collections::BTreeMap<fastpath_common::lb::SvcKey, ServiceView>,
        settings: DatapathConfig,
        interfaces: Vec<String>,
        interface_plan: InterfacePlan,
        generation: u64,
        desired: (u64, Vec<ServiceConfig>),
        state_file: String,
    }

    fn snapshot(rules: &Rules<FakeDatapath>) -> Snapshot {
        let dp = rules.datapath();
        Snapshot {
            view: dp.view(),
            settings: dp.config,
            interfaces: dp.interfaces.clone(),
            interface_plan: dp.interface_plan.clone(),
            generation: rules.generation(),
            desired: (
                rules.config().fingerprint(),
                rules.config().services.clone(),
            ),
            state_file: std::fs::read_to_string(rules.config().state_file())
                .unwrap_or_else(|e| panic!("reading the state file: {e}")),
        }
    }

    #[test]
    fn a_commit_writes_services_settings_interfaces_and_state() {
        let scratch = Scratch::new("commit");
        let mut rules = started(&scratch);
        let summary = rules
            .apply_config(config(&scratch, AFTER), 1, false, false)
            .unwrap_or_else(|e| panic!("the change: {e}"));
        assert_eq!(
            (summary.created, summary.updated, summary.deleted),
            (
                vec!["10.0.0.3:443/tcp".to_string()],
                vec!["10.0.0.1:80/tcp".to_string()],
                vec!["10.0.0.2:53/udp".to_string()]
            )
        );
        let dp = rules.datapath();
        assert_eq!(dp.services.len(), 2, "services after the change");
        assert_eq!(dp.config, datapath_config(rules.config()));
        assert_ne!(dp.config.flags & CONFIG_F_DROP_MALFORMED, 0);
        assert_eq!(dp.interfaces, vec!["eth9", "eth8"]);
        let planned: Vec<u32> = dp.interface_plan.ifaces.keys().copied().collect();
        assert_eq!(
            planned,
            vec![8, 9],
            "the interface plan written with the attach"
        );
        let dsr: std::net::IpAddr = "10.1.0.5".parse().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(dp.resolved.last(), Some(&dsr), "DSR backend resolved");
        assert!(dp.violations.is_empty(), "{:?}", dp.violations);
        assert_eq!(rules.generation(), 2);
        let saved = load_state(&rules.config().state_file())
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_else(|| panic!("no state file"));
        assert_eq!(saved.generation, 2);
        assert_eq!(saved.config.services, rules.config().services);
    }

    /// A change refused at each write it makes leaves the datapath as a packet sees it, the
    /// settings, the interfaces, the desired state, its generation and the state file as
    /// they were; the next change goes through.
    #[test]
    fn a_refused_change_leaves_everything_as_before_at_each_failure_point() {
        let points = [
            (Step::Backends, 1),
            (Step::Slots, 1),
            (Step::Slots, 2),
            (Step::Switch, 1),
            (Step::Switch, 2),
            (Step::Remove, 1),
            (Step::Config, 1),
            (Step::Reattach, 1),
        ];
        for (step, nth) in points {
            let scratch = Scratch::new(&format!("fail-{step:?}-{nth}"));
            let mut rules = started(&scratch);
            let before = snapshot(&rules);
            rules.datapath_mut().fail_at(step, nth);
            let e = match rules.apply_config(config(&scratch, AFTER), 1, false, false) {
                Err(e) => e,
                Ok(s) => panic!("{step:?} {nth} failing: expected a refusal, got {s:?}"),
            };
            assert_eq!(e.kind, RejectKind::Internal, "{step:?} {nth}: {e}");
            assert_eq!(
                snapshot(&rules),
                before,
                "{step:?} {nth} failing: expected everything as before"
            );
            let dp = rules.datapath();
            assert!(
                dp.violations.is_empty(),
                "{step:?} {nth}: {:?}",
                dp.violations
            );
            rules
                .apply_config(config(&scratch, AFTER), 1, false, false)
                .unwrap_or_else(|e| panic!("{step:?} {nth}: the change again: {e}"));
            assert_eq!(rules.generation(), 2);
            assert_eq!(rules.datapath().services.len(), 2);
        }
    }

    /// Every commit writes a service's backends and table before the service points to
    /// them, switches services before it removes any, and never writes over what a service
    /// visible now (or switched away from in the same commit) points to.
    #[test]
    fn services_are_written_before_they_are_visible_and_removed_last() {
        let scratch = Scratch::new("order");
        let mut rules = started(&scratch);
        let removed = rules
            .datapath()
            .services
            .iter()
            .find(|(k, _)| k.port == 53)
            .map(|(_, s)| *s);
        let Some(removed) = removed else {
            panic!("expected 10.0.0.2:53/udp in the datapath");
        };
        let range = removed.backends_off..removed.backends_off + removed.backends_len;
        let removed_backends: Vec<_> = range
            .clone()
            .map(|i| rules.datapath().backends.get(&i).copied())
            .collect();
        rules.datapath_mut().log.clear();
        rules
            .apply_config(config(&scratch, AFTER), 1, false, false)
            .unwrap_or_else(|e| panic!("the change: {e}"));
        let dp = rules.datapath();
        assert!(dp.violations.is_empty(), "{:?}", dp.violations);
        let first = |f: &dyn Fn(&Write) -> bool| dp.log.iter().position(f);
        let last = |f: &dyn Fn(&Write) -> bool| dp.log.iter().rposition(f);
        let (Some(last_table), Some(first_switch), Some(last_switch), Some(first_remove)) = (
            last(&|w| matches!(w, Write::Backends { .. } | Write::Slots { .. })),
            first(&|w| matches!(w, Write::Switch(_))),
            last(&|w| matches!(w, Write::Switch(_))),
            first(&|w| matches!(w, Write::Remove(_))),
        ) else {
            panic!("expected tables, switches and a removal in {:?}", dp.log);
        };
        assert!(
            last_table < first_switch,
            "tables before switches: {:?}",
            dp.log
        );
        assert!(last_switch < first_remove, "removals last: {:?}", dp.log);
        // The removed service's backends are still there for a packet that read it just
        // before its removal.
        let still: Vec<_> = range.map(|i| dp.backends.get(&i).copied()).collect();
        assert_eq!(still, removed_backends, "the removed service's backends");
        // Then more changes, each checked by the fake as it writes.
        for text in [BEFORE, AFTER, BEFORE] {
            let g = rules.generation();
            rules
                .apply_config(config(&scratch, text), g, false, false)
                .unwrap_or_else(|e| panic!("change {g}: {e}"));
        }
        let dp = rules.datapath();
        assert!(dp.violations.is_empty(), "{:?}", dp.violations);
    }

    /// A backend reported down stays in its service's backends, disabled, and leaves the
    /// selection table; reported up again it is enabled and back in the table. The desired
    /// state does not change; a report of a backend no service has writes nothing.
    #[test]
    fn a_health_change_takes_a_backend_out_of_the_table_and_back() {
        let scratch = Scratch::new("health");
        let mut rules = started(&scratch);
        let Some(svc) = rules.config().services.iter().find(|s| s.id().port == 80) else {
            panic!("expected 10.0.0.1:80/tcp in the config");
        };
        let service = svc.id();
        let desired = rules.config().services.clone();
        let key = *rules
            .datapath()
            .services
            .keys()
            .find(|k| k.port == 80)
            .unwrap_or_else(|| panic!("expected 10.0.0.1:80/tcp in the datapath"));
        let view = |rules: &Rules<FakeDatapath>| {
            rules
                .datapath()
                .view()
                .remove(&key)
                .unwrap_or_else(|| panic!("expected {key:?} in the datapath"))
        };
        let addr = |a: &str| -> [u8; 16] {
            let ip: std::net::Ipv4Addr = a.parse().unwrap_or_else(|e| panic!("{a}: {e}"));
            let mut out = [0; 16];
            out[..4].copy_from_slice(&ip.octets());
            out
        };
        let (one, two) = (addr("10.1.0.1"), addr("10.1.0.2"));
        let enabled = fastpath_common::lb::BACKEND_F_ENABLED;
        let in_table = |v: &ServiceView, a: [u8; 16]| {
            v.table
                .iter()
                .filter(|b| b.is_some_and(|b| b.0 == a))
                .count()
        };
        let before = view(&rules);
        assert_eq!(
            before.backends,
            vec![Some((one, 80, enabled)), Some((two, 80, enabled))]
        );
        assert!(
            in_table(&before, two) > 0,
            "10.1.0.2 in the table: {before:?}"
        );
        let change = |up: bool| health::Change {
            service,
            backend: "10.1.0.2:80".parse().unwrap_or_else(|e| panic!("{e}")),
            up,
            detail: if up {
                "up".into()
            } else {
                "connection refused".into()
            },
        };

        rules.health_changed(change(false));
        let down = view(&rules);
        assert_eq!(
            down.backends,
            vec![Some((one, 80, enabled)), Some((two, 80, 0))],
            "10.1.0.2 down: kept, disabled"
        );
        assert_eq!(
            in_table(&down, two),
            0,
            "10.1.0.2 down, in no slot: {down:?}"
        );
        assert_eq!(
            in_table(&down, one),
            down.table.len(),
            "10.1.0.1 takes every slot: {down:?}"
        );
        assert_eq!(
            rules.backend_health(service, change(false).backend),
            "unchecked"
        );
        assert_eq!(rules.config().services, desired, "desired state unchanged");

        rules.health_changed(change(true));
        assert_eq!(view(&rules), before, "10.1.0.2 up again: as before");
        assert_eq!(rules.config().services, desired, "desired state unchanged");

        rules.datapath_mut().log.clear();
        rules.health_changed(health::Change {
            backend: "10.9.9.9:80".parse().unwrap_or_else(|e| panic!("{e}")),
            ..change(false)
        });
        assert_eq!(
            rules.datapath().log,
            vec![],
            "an unknown backend writes nothing"
        );
        assert!(
            rules.datapath().violations.is_empty(),
            "{:?}",
            rules.datapath().violations
        );
    }

    /// Interfaces that cannot be planned (SNAT on an interface without a global address)
    /// refuse the change before anything is written.
    #[test]
    fn an_interface_plan_that_cannot_be_made_refuses_the_change_before_any_write() {
        let scratch = Scratch::new("iface-plan");
        let mut rules = started(&scratch);
        let before = snapshot(&rules);
        rules.datapath_mut().log.clear();
        let text = AFTER.replace("name = \"eth8\"\n", "name = \"eth8\"\nsnat = true\n");
        let e = match rules.apply_config(config(&scratch, &text), 1, false, false) {
            Err(e) => e,
            Ok(s) => panic!("SNAT on eth8 without an address: expected a refusal, got {s:?}"),
        };
        assert_eq!(e.kind, RejectKind::Internal, "{e}");
        assert!(
            e.message
                .contains("interface eth8 has snat = true but no global address"),
            "expected the planner's reason, got: {e}"
        );
        assert_eq!(snapshot(&rules), before, "expected everything as before");
        assert_eq!(rules.datapath().log, vec![], "expected no write");
    }

    /// On a kernel without `bpf_loop`, a least-connections service is refused, through the
    /// API or a reload, dry run or not, with the feature named and nothing written; at start
    /// it is an error before any write; other schedulers go through.
    #[test]
    fn least_connections_is_refused_before_any_write_on_a_kernel_without_bpf_loop() {
        let no_loop = crate::datapath::KernelFeatures {
            bpf_loop: false,
            ..crate::datapath::KernelFeatures::ALL
        };
        let scratch = Scratch::new("no-bpf-loop");
        let mut rules = started(&scratch);
        rules.datapath_mut().kernel = no_loop;
        let before = snapshot(&rules);
        rules.datapath_mut().log.clear();
        let least = AFTER.replace(
            "mode = \"dsr\"",
            "mode = \"dsr\"\nscheduler = \"least_connections\"",
        );
        for dry_run in [true, false] {
            let e = match rules.apply_config(config(&scratch, &least), 1, dry_run, false) {
                Err(e) => e,
                Ok(s) => {
                    panic!("least_connections without bpf_loop: expected a refusal, got {s:?}")
                }
            };
            assert_eq!(e.kind, RejectKind::Invalid, "{e}");
            assert_eq!(
                e.message,
                "service 10.0.0.3:443/tcp: scheduler = \"least_connections\" needs the bpf_loop helper, which this kernel lacks (Linux 5.17 added it); use scheduler = \"maglev\" or \"wrr\" on this kernel; nothing was changed"
            );
            assert_eq!(
                snapshot(&rules),
                before,
                "dry run {dry_run}: expected everything as before"
            );
            assert_eq!(
                rules.datapath().log,
                vec![],
                "dry run {dry_run}: expected no write"
            );
        }
        rules
            .apply_config(config(&scratch, AFTER), 1, false, false)
            .unwrap_or_else(|e| panic!("the same change with maglev: {e}"));

        let (tx, _rx) = mpsc::channel(1);
        let mut fake = FakeDatapath::attached_to(&["eth9"]);
        fake.kernel = no_loop;
        let scratch = Scratch::new("no-bpf-loop-start");
        let failed = match Rules::start(
            fake,
            StartState::load(&config(&scratch, &least)),
            scratch.0.join("config.toml"),
            tx,
        ) {
            Err(failed) => failed,
            Ok(_) => panic!("a start with least_connections without bpf_loop: expected an error"),
        };
        let (dp, e) = *failed;
        assert!(e.to_string().contains("needs the bpf_loop helper"), "{e}");
        assert_eq!(dp.log, vec![], "expected no write at start");
    }

    /// What a start will apply is the state file's services when the file was made on top of
    /// this very config, else the config file's; the daemon checks them before it loads.
    #[test]
    fn services_at_start_are_the_state_files_only_on_top_of_the_same_file() {
        let scratch = Scratch::new("at-start");
        let rules = started(&scratch);
        let file = config(&scratch, BEFORE);
        let start = StartState::load(&file);
        let (services, from) = (start.services().to_vec(), start.restored_from);
        assert_eq!(
            services,
            rules.config().services,
            "the state file's services"
        );
        assert_eq!(from, Some(file.state_file()));
        let other = config(&scratch, AFTER);
        let start = StartState::load(&other);
        let (services, from) = (start.services().to_vec(), start.restored_from);
        assert_eq!(
            (services, from),
            (other.services.clone(), None),
            "a changed file wins"
        );
    }
}
