//! Services in the datapath: from the desired services (config) and what the maps hold now,
//! a plan that writes every new backend range and selection table into space no current
//! service uses, then switches each service with one write of its value, then removes the
//! services no longer wanted. Planning is pure; `datapath` writes the plan it is given with
//! batched map writes ([`ServicePlanner`] ties the two).
//!
//! Contract: applying a plan's steps in order never shows the datapath a service whose
//! backends or table are half written, and never overwrites what a current service points to.

use std::collections::{BTreeSet, HashMap};

use fastpath_common::lb::{
    BACKEND_F_ENABLED, Backend, LB_SLOTS, MAX_BACKENDS, MAX_SERVICES, SVC_F_DSR, SVC_F_FULL_NAT,
    SVC_F_LEASTCONN, SVC_F_MAGLEV, SVC_F_NO_BACKEND_DROP, SVC_F_NO_BACKEND_REJECT, SVC_F_WRR,
    Service, SvcKey, WRR_MAX_SLOTS,
};

use crate::{
    config::{ForwardMode, NoBackend, PortRange, Scheduler, ServiceConfig},
    datapath::{DatapathError, ServiceMaps, ServicesApplied},
    maglev::{self, MaglevBackend},
};

/// What to write, in order: backends and slots (into free space), then services, then
/// removals.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// (first index, backends) for `FP_BACKENDS`.
    pub backends: Vec<(u32, Vec<Backend>)>,
    /// (first slot, backend indexes) for `FP_LB_SLOTS`.
    pub slots: Vec<(u32, Vec<u32>)>,
    /// New values for `FP_SVC`, each switching one service.
    pub services: Vec<(SvcKey, Service)>,
    /// Keys to delete from `FP_SVC`.
    pub remove: Vec<SvcKey>,
    /// Services already applied as desired: nothing written for them.
    pub unchanged: usize,
    /// For each of `services`, the hash of its backend set (see `LbState::backend_sets`).
    pub backend_sets: Vec<u64>,
    /// Backend ranges (offset, length) newly given out: their connection counts start again
    /// from zero (the indexes may have served other backends before).
    pub fresh_backends: Vec<(u32, u32)>,
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error(
        "no room for {want} more {what} in the datapath ({capacity} in all, {used} in use by the running services); apply fewer or smaller services, or stop the datapath and start again"
    )]
    NoRoom {
        what: &'static str,
        want: u64,
        capacity: u32,
        used: u64,
    },
    #[error("service {vip} port {port}: {source}")]
    Maglev {
        vip: std::net::IpAddr,
        port: u16,
        source: maglev::MaglevError,
    },
}

/// The datapath key of a configured service.
pub fn svc_key(svc: &ServiceConfig) -> SvcKey {
    let (vip, family) = addr16(*svc.vip.get_ref());
    SvcKey {
        vip,
        port: *svc.port.get_ref(),
        proto: svc.protocol.number(),
        family,
        _pad: [0; 4],
    }
}

/// An address as the datapath stores it (IPv4 in the first 4 bytes) and its family.
pub fn addr16(a: std::net::IpAddr) -> ([u8; 16], u8) {
    match a {
        std::net::IpAddr::V4(v4) => {
            let mut out = [0u8; 16];
            out[..4].copy_from_slice(&v4.octets());
            (out, 4)
        }
        std::net::IpAddr::V6(v6) => (v6.octets(), 6),
    }
}

/// Next-fit allocator over `[0, capacity)` minus the ranges in use: the free gaps are computed
/// once, and allocations move forward through them (amortized O(1) each, so a plan of 10k
/// services does not rescan 10k ranges per service).
struct Space {
    capacity: u32,
    used_total: u64,
    /// Free gaps (start, end exclusive), in order.
    gaps: Vec<(u32, u32)>,
    /// The gap allocations continue from.
    at: usize,
}

impl Space {
    fn new(capacity: u32, used: impl IntoIterator<Item = (u32, u32)>) -> Space {
        let mut ranges: Vec<(u32, u32)> = used
            .into_iter()
            .filter(|&(_, len)| len > 0)
            .map(|(off, len)| (off, off.saturating_add(len).min(capacity)))
            .collect();
        ranges.sort_unstable();
        let used_total = ranges.iter().map(|&(a, b)| u64::from(b - a)).sum();
        let mut gaps = Vec::with_capacity(ranges.len() + 1);
        let mut start = 0u32;
        for (a, b) in ranges {
            if a > start {
                gaps.push((start, a));
            }
            start = start.max(b);
        }
        if start < capacity {
            gaps.push((start, capacity));
        }
        Space {
            capacity,
            used_total,
            gaps,
            at: 0,
        }
    }

    /// Returns `[off, off + len)` to the free space, merging it with neighbouring gaps.
    fn free(&mut self, off: u32, len: u32) {
        if len == 0 {
            return;
        }
        let end = off + len;
        let i = self.gaps.partition_point(|&(a, _)| a < off);
        let merge_prev = i > 0 && self.gaps[i - 1].1 == off;
        let merge_next = i < self.gaps.len() && self.gaps[i].0 == end;
        match (merge_prev, merge_next) {
            (true, true) => {
                self.gaps[i - 1].1 = self.gaps[i].1;
                self.gaps.remove(i);
                if self.at >= i && self.at > 0 {
                    self.at -= 1;
                }
            }
            (true, false) => self.gaps[i - 1].1 = end,
            (false, true) => self.gaps[i].0 = off,
            (false, false) => {
                self.gaps.insert(i, (off, end));
                if self.at >= i {
                    self.at += 1;
                }
            }
        }
        self.used_total -= u64::from(len);
    }

    fn alloc(&mut self, len: u32, what: &'static str) -> Result<u32, PlanError> {
        if len == 0 {
            return Ok(0);
        }
        // Forward from the last gap used, then once around from the start.
        let n = self.gaps.len();
        for step in 0..n {
            let i = (self.at + step) % n;
            let (a, b) = self.gaps[i];
            if b - a >= len {
                self.gaps[i].0 = a + len;
                self.at = i;
                self.used_total += u64::from(len);
                return Ok(a);
            }
        }
        Err(PlanError::NoRoom {
            what,
            want: u64::from(len),
            capacity: self.capacity,
            used: self.used_total,
        })
    }
}

/// Plans the switch from `current` (what `FP_SVC` holds) to `desired`, from scratch.
pub fn plan(current: &[(SvcKey, Service)], desired: &[ServiceConfig]) -> Result<Plan, PlanError> {
    LbState::new(current).plan(desired, None)
}

/// What the datapath's LB maps hold, as their one writer (the daemon) keeps track of it:
/// services by key, the free space of both arrays, the service ids in use, and the regions
/// the last switch left behind. Those are released only at the next plan: a packet that read
/// a service just before its switch may still be reading the old table, and the next update
/// comes long after any such packet (BPF programs run for microseconds).
pub struct LbState {
    current: HashMap<SvcKey, Service>,
    slots: Space,
    backends: Space,
    ids: BTreeSet<u32>,
    next_id: u32,
    /// Regions and ids to release at the next plan.
    pending: Vec<Released>,
    /// Per service, a hash of its backends' addresses and ports as last written: an update
    /// that changes only weights (a health change, a drain) keeps the backends where they are,
    /// so their indexes — and their counters — carry on.
    backend_sets: HashMap<SvcKey, u64>,
}

/// What a switched or removed service leaves behind: its slots and backends (offset,
/// length) and, if it was removed, its id.
type Released = ((u32, u32), (u32, u32), Option<u32>);

impl LbState {
    /// The state of maps holding `current`.
    pub fn new(current: &[(SvcKey, Service)]) -> LbState {
        LbState {
            current: current.iter().copied().collect(),
            slots: Space::new(
                LB_SLOTS,
                current.iter().map(|(_, s)| (s.slots_off, s.slots_len)),
            ),
            backends: Space::new(
                MAX_BACKENDS,
                current
                    .iter()
                    .map(|(_, s)| (s.backends_off, s.backends_len)),
            ),
            ids: current.iter().map(|(_, s)| s.id).collect(),
            next_id: 0,
            pending: Vec::new(),
            backend_sets: HashMap::new(),
        }
    }

    /// Plans `desired` — all of it, removing what it does not name; or, with `only`, just
    /// `desired[i]` for each listed `i`, leaving every other service as it is. Space for new
    /// tables comes out of this state; after writing the plan, call [`LbState::commit`]; if
    /// the plan fails or is not written, drop this state and start again from the maps.
    pub fn plan(
        &mut self,
        desired: &[ServiceConfig],
        only: Option<&[usize]>,
    ) -> Result<Plan, PlanError> {
        for ((so, sl), (bo, bl), id) in std::mem::take(&mut self.pending) {
            self.slots.free(so, sl);
            self.backends.free(bo, bl);
            if let Some(id) = id {
                self.ids.remove(&id);
            }
        }
        let mut plan = Plan::default();
        let picked: Vec<&ServiceConfig> = match only {
            None => desired.iter().collect(),
            Some(idx) => idx.iter().filter_map(|&i| desired.get(i)).collect(),
        };
        for svc in picked {
            let key = svc_key(svc);
            let fingerprint = fingerprint(svc);
            let existing = self.current.get(&key).copied();
            if existing.is_some_and(|s| s.fingerprint == fingerprint) {
                // Unchanged: keep its tables (nothing to write for it).
                plan.unchanged += 1;
                continue;
            }
            let id = match existing {
                Some(s) => s.id,
                None => self.new_id()?,
            };
            let set = backend_set(svc);
            let keep = existing.filter(|_| self.backend_sets.get(&key) == Some(&set));
            let (service, list, table) = self.layout(
                svc,
                id,
                existing.map_or(1, |s| s.generation.wrapping_add(1)),
                fingerprint,
                keep.map(|s| (s.backends_off, s.backends_len)),
            )?;
            plan.services.push((key, service));
            plan.backend_sets.push(set);
            if keep.is_none() && service.backends_len > 0 {
                plan.fresh_backends
                    .push((service.backends_off, service.backends_len));
            }
            // Kept in place, the backends are written again over themselves: the same
            // addresses, only their enabled flag may change (a byte, read whole by the
            // datapath).
            if !list.is_empty() {
                plan.backends.push((service.backends_off, list));
            }
            if !table.is_empty() {
                plan.slots.push((service.slots_off, table));
            }
        }
        if only.is_none() {
            let wanted: BTreeSet<SvcKey> = desired.iter().map(svc_key).collect();
            plan.remove = self
                .current
                .keys()
                .filter(|k| !wanted.contains(k))
                .copied()
                .collect();
            plan.remove.sort_unstable();
        } else {
            plan.unchanged += self
                .current
                .len()
                .saturating_sub(plan.services.len() + plan.unchanged);
        }
        Ok(plan)
    }

    /// Records that `plan` is in the maps: switched services' old regions and removed
    /// services' regions and ids are released at the next plan.
    pub fn commit(&mut self, plan: &Plan) {
        for ((key, svc), set) in plan.services.iter().zip(&plan.backend_sets) {
            if let Some(old) = self.current.insert(*key, *svc) {
                // Backends kept in place are not released.
                let old_backends = if old.backends_off == svc.backends_off && old.backends_len > 0 {
                    (0, 0)
                } else {
                    (old.backends_off, old.backends_len)
                };
                self.pending
                    .push(((old.slots_off, old.slots_len), old_backends, None));
            }
            self.backend_sets.insert(*key, *set);
        }
        for key in &plan.remove {
            self.backend_sets.remove(key);
            if let Some(old) = self.current.remove(key) {
                self.pending.push((
                    (old.slots_off, old.slots_len),
                    (old.backends_off, old.backends_len),
                    Some(old.id),
                ));
            }
        }
    }

    fn new_id(&mut self) -> Result<u32, PlanError> {
        for _ in 0..MAX_SERVICES {
            let id = self.next_id;
            self.next_id = (self.next_id + 1) % MAX_SERVICES;
            if self.ids.insert(id) {
                return Ok(id);
            }
        }
        Err(PlanError::NoRoom {
            what: "services",
            want: 1,
            capacity: MAX_SERVICES,
            used: self.ids.len() as u64,
        })
    }

    /// The service's backends and Maglev table, placed in free space.
    fn layout(
        &mut self,
        svc: &ServiceConfig,
        id: u32,
        generation: u32,
        fingerprint: u32,
        keep_backends: Option<(u32, u32)>,
    ) -> Result<(Service, Vec<Backend>, Vec<u32>), PlanError> {
        let list: Vec<Backend> = svc
            .backends
            .iter()
            .map(|b| {
                let (addr, family) = addr16(*b.address.get_ref());
                Backend {
                    addr,
                    port: *b.port.get_ref(),
                    family,
                    flags: if *b.weight.get_ref() > 0 {
                        BACKEND_F_ENABLED
                    } else {
                        0
                    },
                    weight: (*b.weight.get_ref()).min(65_535) as u16,
                    _pad: [0; 2],
                }
            })
            .collect();
        let mag: Vec<MaglevBackend> = svc
            .backends
            .iter()
            .zip(&list)
            .map(|(b, be)| {
                let mut ident = [0u8; 18];
                ident[..16].copy_from_slice(&be.addr);
                ident[16..].copy_from_slice(&be.port.to_be_bytes());
                MaglevBackend {
                    id: ident,
                    weight: *b.weight.get_ref(),
                }
            })
            .collect();
        let table = match svc.scheduler {
            Scheduler::Maglev => {
                let weighted = mag.iter().filter(|b| b.weight > 0).count();
                let size = svc
                    .maglev_table_size
                    .as_ref()
                    .map_or_else(|| maglev::auto_size(weighted), |s| *s.get_ref());
                maglev::build(&mag, size).map_err(|source| PlanError::Maglev {
                    vip: *svc.vip.get_ref(),
                    port: *svc.port.get_ref(),
                    source,
                })?
            }
            Scheduler::Wrr => wrr_sequence(&mag.iter().map(|b| b.weight).collect::<Vec<_>>()),
            // The datapath looks at the backends themselves; a one-slot table says whether
            // any is enabled (no slot: no backend available).
            Scheduler::LeastConnections => {
                if mag.iter().any(|b| b.weight > 0) {
                    vec![0]
                } else {
                    Vec::new()
                }
            }
        };
        let backends_off = match keep_backends {
            Some((off, _)) => off,
            None => self.backends.alloc(list.len() as u32, "backends")?,
        };
        let slots_off = self.slots.alloc(table.len() as u32, "selection slots")?;
        let mut flags = match svc.scheduler {
            Scheduler::Maglev => SVC_F_MAGLEV,
            Scheduler::Wrr => SVC_F_WRR,
            Scheduler::LeastConnections => SVC_F_LEASTCONN,
        };
        match svc.no_backend {
            NoBackend::Drop => flags |= SVC_F_NO_BACKEND_DROP,
            NoBackend::Reject => flags |= SVC_F_NO_BACKEND_REJECT,
            NoBackend::Kernel => {}
        }
        if svc.mode == ForwardMode::Dsr {
            flags |= SVC_F_DSR;
        }
        let (mut snat_addr, mut ports) = ([0; 16], PortRange { first: 0, last: 0 });
        if let (ForwardMode::FullNat, Some(a)) = (svc.mode, &svc.snat_address) {
            flags |= SVC_F_FULL_NAT;
            snat_addr = addr16(*a.get_ref()).0;
            ports = svc
                .snat_ports
                .as_ref()
                .map_or(PortRange::DEFAULT_SNAT, |r| *r.get_ref());
        }
        let table: Vec<u32> = table.into_iter().map(|i| backends_off + i).collect();
        let service = Service {
            id,
            flags,
            slots_off,
            slots_len: table.len() as u32,
            generation,
            backends_off,
            backends_len: list.len() as u32,
            fingerprint,
            affinity_s: svc.affinity_timeout_s,
            snat_port_lo: ports.first,
            snat_port_hi: ports.last,
            snat_addr,
        };
        Ok((service, list, table))
    }
}

/// The backends whose link-layer addresses the kernel must know: direct server return sends
/// packets to the backends' MAC addresses, which the datapath takes from the kernel's
/// neighbour table, and a backend this node never talked to has no entry yet (see
/// [`crate::datapath::DatapathOps::resolve_neighbours`]).
pub fn dsr_backends(services: &[ServiceConfig]) -> Vec<std::net::IpAddr> {
    services
        .iter()
        .filter(|s| s.mode == ForwardMode::Dsr)
        .flat_map(|s| s.backends.iter().map(|b| *b.address.get_ref()))
        .collect()
}

/// The planning half of applying services, for the maps' one writer: the [`LbState`] of
/// what they hold, read from them when there is none (first use, or after a plan that failed
/// or was written in part), and each plan written through a [`ServiceMaps`].
#[derive(Default)]
pub struct ServicePlanner {
    state: Option<LbState>,
}

impl ServicePlanner {
    /// Plans `services` (all of them, or with `only` just those indexes: see
    /// [`LbState::plan`]) and writes the plan into `maps`.
    pub fn apply(
        &mut self,
        maps: &mut impl ServiceMaps,
        services: &[ServiceConfig],
        only: Option<&[usize]>,
    ) -> Result<ServicesApplied, DatapathError> {
        let started = std::time::Instant::now();
        let state = match &mut self.state {
            Some(s) => s,
            None => self.state.insert(LbState::new(&maps.current_services()?)),
        };
        let plan = match state.plan(services, only) {
            Ok(p) => p,
            Err(e) => {
                // The state handed out space for a plan that will not be written: start again
                // from the maps next time.
                self.state = None;
                return Err(DatapathError::Plan(e));
            }
        };
        if let Err(e) = maps.write_services(&plan) {
            // Written in part (nothing switched yet, or some services switched): the state no
            // longer matches the maps; read them again next time.
            self.state = None;
            return Err(e);
        }
        state.commit(&plan);
        Ok(ServicesApplied {
            services: plan.services.len(),
            unchanged: plan.unchanged,
            removed: plan.remove.len(),
            backends: plan.backends.iter().map(|(_, l)| l.len()).sum(),
            slots: plan.slots.iter().map(|(_, t)| t.len()).sum(),
            took: started.elapsed(),
        })
    }
}

/// The weighted round-robin sequence for `weights` (indexes into them), smoothly interleaved
/// (nginx's smooth WRR: each step every backend gains its weight, the richest is picked and pays
/// the total), one full cycle long: Σ weights / gcd, scaled down to fit [`WRR_MAX_SLOTS`].
pub fn wrr_sequence(weights: &[u32]) -> Vec<u32> {
    let g = weights
        .iter()
        .copied()
        .filter(|&w| w > 0)
        .fold(0, maglev::gcd);
    if g == 0 {
        return Vec::new();
    }
    let mut w: Vec<u64> = weights.iter().map(|&x| u64::from(x / g)).collect();
    let total: u64 = w.iter().sum();
    if total > u64::from(WRR_MAX_SLOTS) {
        // Scale down, keeping every weighted backend at least once.
        for x in w.iter_mut().filter(|x| **x > 0) {
            *x = (*x * u64::from(WRR_MAX_SLOTS) / total).max(1);
        }
    }
    let total: i64 = w.iter().sum::<u64>() as i64;
    let mut current = vec![0i64; w.len()];
    let mut seq = Vec::with_capacity(total as usize);
    for _ in 0..total {
        let mut best = 0;
        for i in 0..w.len() {
            current[i] += w[i] as i64;
            if current[i] > current[best] {
                best = i;
            }
        }
        current[best] -= total;
        seq.push(best as u32);
    }
    seq
}

/// FNV-1a (64) over a service's backends' addresses and ports, in order.
fn backend_set(svc: &ServiceConfig) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in &svc.backends {
        for &x in addr16(*b.address.get_ref())
            .0
            .iter()
            .chain(&b.port.get_ref().to_be_bytes())
        {
            h ^= u64::from(x);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// FNV-1a over what defines a service in the datapath: backends (address, port, weight) in
/// order, table size, no-backend action.
fn fingerprint(svc: &ServiceConfig) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h ^= u32::from(b);
            h = h.wrapping_mul(0x0100_0193);
        }
    };
    for b in &svc.backends {
        eat(&addr16(*b.address.get_ref()).0);
        eat(&b.port.get_ref().to_be_bytes());
        eat(&b.weight.get_ref().to_be_bytes());
    }
    let size = svc.maglev_table_size.as_ref().map_or(0, |m| *m.get_ref());
    eat(&size.to_be_bytes());
    eat(&[svc.scheduler as u8]);
    eat(&svc.affinity_timeout_s.to_be_bytes());
    eat(&[
        svc.no_backend as u8,
        svc.backends.len() as u8,
        svc.mode as u8,
    ]);
    if let Some(a) = &svc.snat_address {
        eat(&addr16(*a.get_ref()).0);
    }
    if let Some(r) = &svc.snat_ports {
        eat(&r.get_ref().first.to_be_bytes());
        eat(&r.get_ref().last.to_be_bytes());
    }
    // 0 never matches: a value written before fingerprints existed is always re-applied.
    h.max(1)
}

/// The backend the datapath gives the connection with key `key` to service `desired[svc]`:
/// the same table `plan` builds, the same hash the datapath uses. For tests and tools that
/// need to know where a connection goes (and for a peer to agree on it).
pub fn predict(
    desired: &[ServiceConfig],
    svc: usize,
    key: &fastpath_common::ct::CtKey,
) -> Result<Option<Backend>, PlanError> {
    let plan = plan(&[], desired)?;
    let Some((_, s)) = plan.services.get(svc) else {
        return Ok(None);
    };
    if s.slots_len == 0 {
        return Ok(None);
    }
    let slot = (fastpath_common::lb::flow_hash(key) % s.slots_len) as usize;
    let table = plan.slots.iter().find(|(off, _)| *off == s.slots_off);
    let backends = plan.backends.iter().find(|(off, _)| *off == s.backends_off);
    Ok(match (table, backends) {
        (Some((_, t)), Some((off, list))) => t
            .get(slot)
            .and_then(|&i| list.get((i - off) as usize))
            .copied(),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::config::{Config, InterfaceCheck};

    fn services(toml: &str) -> Vec<ServiceConfig> {
        let text = format!("[[interface]]\nname = \"lo\"\n{toml}");
        Config::parse_with(Path::new("t.toml"), &text, InterfaceCheck::Skip)
            .unwrap_or_else(|e| panic!("{e}"))
            .services
    }

    const TWO: &str = r#"
[[service]]
vip = "10.0.0.100"
port = 80
[[service.backend]]
address = "10.0.1.1"
port = 8080
[[service.backend]]
address = "10.0.1.2"
port = 8080
weight = 3

[[service]]
vip = "fd00::100"
port = 53
protocol = "udp"
no_backend = "drop"
"#;

    #[test]
    fn a_first_plan_lays_out_tables_and_ids() {
        let p = plan(&[], &services(TWO)).unwrap();
        assert_eq!(p.services.len(), 2);
        let (k0, s0) = p.services[0];
        assert_eq!((k0.port, k0.proto, k0.family), (80, 6, 4));
        assert_eq!((s0.id, s0.slots_len, s0.backends_len), (0, 251, 2));
        let (_, s1) = p.services[1];
        assert_eq!(
            (s1.id, s1.slots_len, s1.flags & SVC_F_NO_BACKEND_DROP != 0),
            (1, 0, true)
        );
        // The table names only the service's own backends, 1:3 by weight.
        let (off, table) = &p.slots[0];
        assert_eq!(*off, s0.slots_off);
        let ones = table.iter().filter(|&&b| b == s0.backends_off).count();
        assert!(
            (55..=70).contains(&ones),
            "{ones} of 251 slots for weight 1 of 4"
        );
        assert!(p.remove.is_empty());
    }

    #[test]
    fn an_unchanged_service_is_not_written_again() {
        let first = plan(&[], &services(TWO)).unwrap();
        let again = plan(&first.services, &services(TWO)).unwrap();
        assert_eq!((again.services.len(), again.unchanged), (0, 2));
        assert!(again.backends.is_empty() && again.slots.is_empty() && again.remove.is_empty());
    }

    #[test]
    fn a_second_plan_writes_beside_the_first_and_keeps_ids() {
        let first = plan(&[], &services(TWO)).unwrap();
        let current = first.services.clone();
        let changed = TWO
            .replace("weight = 3", "weight = 4")
            .replace("no_backend = \"drop\"", "");
        let second = plan(&current, &services(&changed)).unwrap();
        for ((k1, s1), (k2, s2)) in first.services.iter().zip(&second.services) {
            assert_eq!(k1, k2);
            assert_eq!(s1.id, s2.id, "ids stay");
            assert_eq!(s2.generation, s1.generation + 1);
            if s1.slots_len > 0 {
                let a = s1.slots_off..s1.slots_off + s1.slots_len;
                assert!(
                    !a.contains(&s2.slots_off),
                    "new table overlaps the live one"
                );
            }
            if s1.backends_len > 0 {
                assert_ne!(s1.backends_off, s2.backends_off);
            }
        }
    }

    #[test]
    fn services_not_wanted_are_removed_and_their_ids_reused_later() {
        let first = plan(&[], &services(TWO)).unwrap();
        let only_udp = services(
            r#"
[[service]]
vip = "fd00::100"
port = 53
protocol = "udp"
"#,
        );
        let p = plan(&first.services, &only_udp).unwrap();
        assert_eq!(p.remove, vec![first.services[0].0]);
        assert_eq!(p.services[0].1.id, 1, "the staying service keeps id 1");
    }

    #[test]
    fn a_kept_state_plans_one_service_and_reuses_space_after_a_grace() {
        let svcs = services(TWO);
        let mut state = LbState::new(&[]);
        let first = state.plan(&svcs, None).unwrap();
        state.commit(&first);
        let changed = services(&TWO.replace("weight = 3", "weight = 4"));
        let one = state.plan(&changed, Some(&[0])).unwrap();
        assert_eq!(
            (one.services.len(), one.unchanged, one.remove.len()),
            (1, 1, 0)
        );
        let (old, new) = (first.services[0].1, one.services[0].1);
        assert_ne!(
            old.slots_off, new.slots_off,
            "the live table is not overwritten"
        );
        state.commit(&one);
        // At the next plan the first table's space is free again (the grace is over); the
        // live table's is not.
        let back = state.plan(&svcs, Some(&[0])).unwrap();
        let (a, len) = (old.slots_off, old.slots_len);
        assert!(
            state
                .slots
                .gaps
                .iter()
                .any(|&(g0, g1)| g0 <= a && a + len <= g1)
                || back.services[0].1.slots_off == a,
            "{:?}",
            state.slots.gaps
        );
        let b = back.services[0].1.slots_off;
        assert!(
            b + back.services[0].1.slots_len <= new.slots_off || b >= new.slots_off + new.slots_len
        );
    }

    #[test]
    fn a_weight_change_keeps_the_backends_in_place() {
        let mut state = LbState::new(&[]);
        let first = state.plan(&services(TWO), None).unwrap();
        state.commit(&first);
        let drained = services(&TWO.replace("weight = 3", "weight = 0"));
        let p = state.plan(&drained, Some(&[0])).unwrap();
        let (old, new) = (first.services[0].1, p.services[0].1);
        assert_eq!(
            (new.backends_off, new.backends_len),
            (old.backends_off, old.backends_len)
        );
        assert_eq!(
            p.backends[0].0, old.backends_off,
            "backends rewritten in place"
        );
        assert_eq!(
            p.backends[0].1[1].flags, 0,
            "the drained backend is not enabled"
        );
        assert_ne!(
            new.slots_off, old.slots_off,
            "a new table, written beside the live one"
        );
        assert!(
            p.slots[0].1.iter().all(|&b| b == old.backends_off),
            "all slots to backend 0"
        );
        state.commit(&p);
        // A changed backend set moves the backends.
        let moved = services(&TWO.replace("10.0.1.2", "10.0.1.3"));
        let q = state.plan(&moved, Some(&[0])).unwrap();
        assert_ne!(q.services[0].1.backends_off, old.backends_off);
    }

    #[test]
    fn wrr_sequences_follow_the_weights_smoothly() {
        assert_eq!(wrr_sequence(&[5, 1, 1]), vec![0, 0, 1, 0, 2, 0, 0]);
        assert_eq!(wrr_sequence(&[2, 2, 4]), vec![2, 0, 1, 2]);
        assert_eq!(wrr_sequence(&[1, 0, 1]), vec![0, 2]);
        assert!(wrr_sequence(&[0, 0]).is_empty());
        let big = wrr_sequence(&[65_535, 65_535, 1]);
        assert!(
            big.len() <= WRR_MAX_SLOTS as usize && big.contains(&2),
            "{}",
            big.len()
        );
    }

    #[test]
    fn space_frees_merge_with_neighbours() {
        let mut s = Space::new(100, [(0, 10), (10, 10), (30, 10)]);
        assert_eq!(s.gaps, vec![(20, 30), (40, 100)]);
        s.free(10, 10);
        assert_eq!(s.gaps, vec![(10, 30), (40, 100)]);
        s.free(30, 10);
        assert_eq!(s.gaps, vec![(10, 100)]);
        s.free(0, 10);
        assert_eq!(s.gaps, vec![(0, 100)]);
        assert_eq!(s.used_total, 0);
    }

    #[test]
    fn space_runs_out_with_a_clear_error() {
        let mut s = Space::new(10, [(0, 4), (6, 2)]);
        assert_eq!(s.alloc(2, "x").unwrap(), 4);
        assert_eq!(s.alloc(2, "x").unwrap(), 8);
        let e = s.alloc(1, "selection slots").unwrap_err();
        assert!(
            e.to_string().contains("no room for 1 more selection slots"),
            "{e}"
        );
    }
}
