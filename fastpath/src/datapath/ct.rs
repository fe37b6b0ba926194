//! The conntrack table (`FP_CT`) as userspace sees it: walked in batches, read and deleted
//! by key, written one entry at a time or in runs through the installer program; and the
//! readers of a pinned datapath's table (`fastpath ct ...`).

use std::{io, os::fd::AsFd as _, path::Path};

use aya::{
    Ebpf,
    maps::{Array, HashMap, IterableMap as _, MapData, PerCpuArray},
    programs::{ProgramError, Xdp},
};
use fastpath_common::{
    ct::{
        CT_INSTALL_MAX, CT_RECORD_CREATE, CtEntry, CtKey, CtRecord, FLOW_SLOTS, FlowSlot, flow_slot,
    },
    map_names, program_names,
};
use tracing::warn;

use super::{DatapathError, map_at, pinned_map};
use crate::sys;

/// The conntrack table as the daemon's expiry sees it: walked in batches, deleted by key.
pub struct CtTable {
    table: HashMap<MapData, CtKey, CtEntry>,
    /// `FP_BACKEND_GONE`: the expiry counts load-balanced connections that went without
    /// closing, for least-connections (the datapath counts the ones that closed).
    gone: Option<Array<MapData, u64>>,
    /// The loaded `fastpath_ct_install` program, for [`CtTable::write_run`].
    installer: Option<CtInstaller>,
    /// Runs of it so far.
    installer_runs: u64,
    /// The XDP flow cache, told of every entry removed or replaced here.
    flow: Option<FlowCache>,
}

/// The datapath's flow cache (`FP_FLOW`, `FP_FLOW_EPOCH`; see `fastpath_common::ct::FlowSlot`)
/// as the daemon sees it: it never writes a slot, it bumps a slot's epoch after changing an
/// entry (so no CPU's copy of the old entry serves on), and it adds what the copies counted
/// to the entries it shows.
pub struct FlowCache {
    slots: PerCpuArray<MapData, FlowSlot>,
    epochs: sys::SharedArray<u64>,
}

impl FlowCache {
    /// The flow cache pinned in `maps_dir`; `None` for a datapath without one (built before
    /// it: nothing to tell).
    pub fn open(maps_dir: &Path) -> Option<FlowCache> {
        let slots = MapData::from_pin(maps_dir.join(map_names::FLOW)).ok()?;
        let slots = PerCpuArray::try_from(aya::maps::Map::PerCpuArray(slots)).ok()?;
        let epochs = MapData::from_pin(maps_dir.join(map_names::FLOW_EPOCH)).ok()?;
        let bytes = FLOW_SLOTS as usize * size_of::<u64>();
        let epochs = sys::SharedArray::map(epochs.fd().as_fd(), bytes.next_multiple_of(4096))
            .inspect_err(|e| warn!(error = %e, "Cannot map FP_FLOW_EPOCH; entries the daemon removes may be served from the flow cache for up to a lease"))
            .ok()?;
        Some(FlowCache { slots, epochs })
    }

    /// Says that the entry of `key` was just removed or replaced.
    pub fn changed(&self, key: &CtKey) {
        self.epochs.bump(flow_slot(key) as usize);
    }

    /// Adds to `entries` what the copies of their connections counted and the table does not
    /// have yet: one read (every CPU's copy) per slot their keys map to.
    pub fn add_counts(&self, entries: &mut [(CtKey, CtEntry)]) {
        let mut idxs: Vec<u32> = entries.iter().map(|(k, _)| flow_slot(k)).collect();
        idxs.sort_unstable();
        idxs.dedup();
        let mut by_key: std::collections::HashMap<CtKey, Vec<FlowSlot>> =
            std::collections::HashMap::new();
        for i in idxs {
            if let Ok(per_cpu) = self.slots.get(&i, 0) {
                for s in per_cpu.iter().filter(|s| s.filled_ns != 0) {
                    by_key.entry(s.key).or_default().push(*s);
                }
            }
        }
        if by_key.is_empty() {
            return;
        }
        for (k, e) in entries.iter_mut() {
            for s in by_key.get(k).into_iter().flatten() {
                add_slot(s, k, e);
            }
        }
    }
}

/// Adds one slot's counts to `e`, the entry of `key`, if the slot holds that connection.
fn add_slot(s: &FlowSlot, key: &CtKey, e: &mut CtEntry) {
    if let Some((packets, bytes, seen)) = s.deltas_for(key, e) {
        for d in 0..2 {
            e.packets[d] += packets[d];
            e.bytes[d] += bytes[d];
        }
        e.last_seen_ns = e.last_seen_ns.max(seen);
    }
}

/// The loaded `fastpath_ct_install` program, run with BPF_PROG_TEST_RUN on batches of
/// conntrack records (see [`CtTable::write_run`]). A handle of its own (another fd of the
/// program), so the table can outlive the object it came from.
pub struct CtInstaller(Xdp);

impl CtInstaller {
    /// One run on `records`: how many of them the program carried out.
    fn run(&self, records: &[CtRecord]) -> Result<u32, ProgramError> {
        use aya::programs::{TestRun as _, TestRunOptions};
        let opts = TestRunOptions {
            data_in: Some(sys::ct_records_bytes(records)),
            ..TestRunOptions::default()
        };
        Ok(self.0.test_run(opts)?.return_value)
    }
}

/// The loaded `fastpath_ct_install` program of `ebpf`, writing to that object's `FP_CT`.
pub fn ct_installer(ebpf: &Ebpf) -> Result<CtInstaller, DatapathError> {
    let name = program_names::CT_INSTALL;
    let prog: &Xdp = ebpf
        .program(name)
        .ok_or(DatapathError::MissingProgram { name })?
        .try_into()
        .map_err(|source| DatapathError::Program {
            what: format!("{name} is not an XDP program"),
            source,
        })?;
    prog.info()
        .and_then(|info| {
            Xdp::from_program_info(
                info,
                name.into(),
                aya_obj::programs::XdpAttachType::Interface,
            )
        })
        .map(CtInstaller)
        .map_err(|source| DatapathError::Program {
            what: format!("opening another handle of {name}"),
            source,
        })
}

impl CtTable {
    /// The table over `FP_CT` and (if open) `FP_BACKEND_GONE`, without an installer.
    pub(super) fn from_maps(
        table: HashMap<MapData, CtKey, CtEntry>,
        gone: Option<Array<MapData, u64>>,
    ) -> CtTable {
        CtTable {
            table,
            gone,
            installer: None,
            installer_runs: 0,
            flow: None,
        }
    }

    /// The table pinned at `map_path` (for tools and benchmarks; the daemon takes its own
    /// with [`super::Datapath::take_ct_table`]).
    pub fn open_pin(map_path: &Path) -> Result<CtTable, DatapathError> {
        let data = map_at(map_path)?;
        let table = HashMap::try_from(aya::maps::Map::HashMap(data)).map_err(|source| {
            DatapathError::Map {
                what: "opening FP_CT".into(),
                source,
            }
        })?;
        let gone = map_path
            .parent()
            .map(|dir| dir.join(map_names::BACKEND_GONE))
            .and_then(|p| MapData::from_pin(p).ok())
            .and_then(|d| Array::try_from(aya::maps::Map::Array(d)).ok());
        let flow = map_path.parent().and_then(FlowCache::open);
        Ok(CtTable::from_maps(table, gone).with_flow_cache(flow))
    }

    /// Tells `flow` of every entry removed or replaced through this table.
    pub(super) fn with_flow_cache(mut self, flow: Option<FlowCache>) -> CtTable {
        self.flow = flow;
        self
    }

    /// Creates entries with `installer` ([`ct_installer`] of the object whose `FP_CT` this
    /// is) in [`CtTable::write_run`]: one syscall per `CT_INSTALL_MAX` writes.
    pub fn with_installer(mut self, installer: CtInstaller) -> CtTable {
        self.installer = Some(installer);
        self
    }

    /// Every entry, read with BPF_MAP_LOOKUP_BATCH (about 4k entries per syscall instead of
    /// two syscalls per entry), handed to `visit` chunk by chunk.
    pub fn walk(&self, visit: impl FnMut(&[CtKey], &[CtEntry])) -> io::Result<()> {
        sys::map_walk_batches(self.table.map().fd().as_fd(), visit)
    }

    /// The table's size limit (max_entries).
    pub fn capacity(&self) -> Result<u32, DatapathError> {
        self.table
            .map()
            .info()
            .map(|i| i.max_entries())
            .map_err(|source| DatapathError::Map {
                what: "reading FP_CT's info".into(),
                source,
            })
    }

    /// The entry of `key` now, if any.
    pub fn get(&self, key: &CtKey) -> Option<CtEntry> {
        self.table.get(key, 0).ok()
    }

    pub fn remove(&mut self, key: &CtKey) -> bool {
        let removed = self.table.remove(key).is_ok();
        if removed && let Some(flow) = &self.flow {
            flow.changed(key);
        }
        removed
    }

    /// Creates or replaces the entry of `key` (a connection replicated from a peer).
    pub fn insert(&mut self, key: &CtKey, entry: &CtEntry) -> Result<(), DatapathError> {
        self.table
            .insert(key, entry, 0)
            .map_err(|source| DatapathError::Map {
                what: "writing an FP_CT entry".into(),
                source,
            })?;
        if let Some(flow) = &self.flow {
            flow.changed(key);
        }
        Ok(())
    }

    /// Creates the entry of `key` unless one exists: `Ok(false)` when it does (untouched).
    pub fn insert_new(&mut self, key: &CtKey, entry: &CtEntry) -> Result<bool, DatapathError> {
        /// The map update flag of `bpf(2)`: create only.
        const BPF_NOEXIST: u64 = 1;
        match self.table.insert(key, entry, BPF_NOEXIST) {
            Ok(()) => Ok(true),
            Err(aya::maps::MapError::SyscallError(e))
                if e.io_error.raw_os_error() == Some(libc::EEXIST) =>
            {
                Ok(false)
            }
            Err(source) => Err(DatapathError::Map {
                what: "writing an FP_CT entry".into(),
                source,
            }),
        }
    }

    /// Carries out `records` in order and stops at the first one that is not the simple case
    /// (see the installer program, `conntrack::install` in the datapath): returns how many
    /// were done. The caller does that one itself. With the installer program, one
    /// BPF_PROG_TEST_RUN per `CT_INSTALL_MAX` records; without it (or if it cannot run),
    /// creations are written one at a time and a removal stops the run.
    pub fn write_run(&mut self, records: &[CtRecord]) -> usize {
        let mut done = 0;
        if let Some(prog) = &self.installer {
            for chunk in records.chunks(CT_INSTALL_MAX) {
                match prog.run(chunk) {
                    Ok(n) => {
                        self.installer_runs += 1;
                        let n = (n as usize).min(chunk.len());
                        done += n;
                        if n < chunk.len() {
                            return done;
                        }
                    }
                    Err(e) => {
                        warn!(error = %e, "The conntrack installer program did not run; writing entries one by one");
                        self.installer = None;
                        break;
                    }
                }
            }
            if self.installer.is_some() {
                return done;
            }
        }
        for r in &records[done..] {
            if r.op != CT_RECORD_CREATE || !matches!(self.insert_new(&r.key, &r.entry), Ok(true)) {
                break;
            }
            done += 1;
        }
        done
    }

    /// Runs of the installer program so far (0 without it).
    pub fn installer_runs(&self) -> u64 {
        self.installer_runs
    }

    /// Counts a load-balanced connection of backend `idx` that went without closing (this
    /// process is the only writer of `FP_BACKEND_GONE`).
    pub fn backend_gone(&mut self, idx: u32) {
        if let Some(gone) = self.gone.as_mut() {
            let n = gone.get(&idx, 0).unwrap_or(0);
            let _ = gone.set(idx, &(n + 1), 0);
        }
    }
}

/// The conntrack table of a pinned datapath.
pub(super) fn pinned_ct_table(pin_dir: &Path) -> Result<CtTable, DatapathError> {
    let path = pin_dir.join("maps").join(map_names::CT);
    if !path.exists() {
        // Same message as every other pinned reader.
        pinned_map(pin_dir, map_names::CT)?;
    }
    CtTable::open_pin(&path)
}

/// Every tracked connection of a pinned datapath (`fastpath ct list`), read in batches.
pub fn pinned_ct_entries(pin_dir: &Path) -> Result<Vec<(CtKey, CtEntry)>, DatapathError> {
    let table = pinned_ct_table(pin_dir)?;
    let mut out = Vec::new();
    table
        .walk(|keys, values| out.extend(keys.iter().copied().zip(values.iter().copied())))
        .map_err(|e| DatapathError::Io {
            what: "walking FP_CT".into(),
            source: e,
        })?;
    if let Some(flow) = FlowCache::open(&pin_dir.join("maps")) {
        flow.add_counts(&mut out);
    }
    Ok(out)
}

/// The connection of `key` in a pinned datapath (`fastpath ct get`), if tracked.
pub fn pinned_ct_get(pin_dir: &Path, key: &CtKey) -> Result<Option<CtEntry>, DatapathError> {
    let Some(e) = pinned_ct_table(pin_dir)?.get(key) else {
        return Ok(None);
    };
    let mut one = [(*key, e)];
    if let Some(flow) = FlowCache::open(&pin_dir.join("maps")) {
        flow.add_counts(&mut one);
    }
    Ok(Some(one[0].1))
}

/// Exact occupancy of a pinned datapath's conntrack table: (entries, capacity). Entries are
/// counted by reading the whole table in batches (a hash map keeps no count userspace can
/// read), so this costs about as much as an expiry pass: ~0.4 s at 1M entries.
pub fn pinned_ct_occupancy(pin_dir: &Path) -> Result<(u64, u32), DatapathError> {
    let table = pinned_ct_table(pin_dir)?;
    let capacity = table.capacity()?;
    let mut entries = 0u64;
    table
        .walk(|keys, _| entries += keys.len() as u64)
        .map_err(|e| DatapathError::Io {
            what: "walking FP_CT".into(),
            source: e,
        })?;
    Ok((entries, capacity))
}

/// Deletes every tracked connection of a pinned datapath; returns how many went.
pub fn flush_pinned_ct(pin_dir: &Path) -> Result<usize, DatapathError> {
    let mut table = pinned_ct_table(pin_dir)?;
    let mut keys: Vec<CtKey> = Vec::new();
    table
        .walk(|k, _| keys.extend_from_slice(k))
        .map_err(|e| DatapathError::Io {
            what: "walking FP_CT".into(),
            source: e,
        })?;
    // `CtTable::remove` also tells the flow cache.
    Ok(keys.iter().filter(|k| table.remove(k)).count())
}
