//! Migration of the pinned conntrack maps whose kind or size no longer match the object's:
//! a table pinned by an older version (another map flag) or with another
//! `conntrack.capacity`. The loader cannot reuse such a pin, so [`Migration::prepare`] moves
//! it aside (`<pin_dir>/migrating/<name>`) before the load, which then pins a new map under
//! the name; the old programs keep running on the old map meanwhile (a program holds its maps,
//! not their names).
//!
//! Until the new programs run, the new table is this process's alone: the copy before the
//! swap overwrites it with the old table as it is (one batched walk, so an entry is at most
//! that walk and the swap old). After the swap the old programs may still have added
//! connections (on links not yet swapped): the copy after inserts those keys only (a key the
//! new programs hold is theirs, the newer). Then the old map is unpinned.
//!
//! Failures: a start that fails before any new program runs moves the old map back under its
//! name (the running datapath is left as it was). Once one runs, the old map stays aside and
//! the next start resumes: if programs still use the old map (the start died before the
//! swap) it starts over with a fresh table; if not, it inserts what the new table lacks.

use std::{
    collections::HashSet,
    fs, io,
    os::fd::AsFd as _,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf,
    maps::{HashMap, IterableMap as _, Map, MapData, MapError, MapInfo, Queue},
    programs::loaded_programs,
};
use fastpath_common::{
    ct::{CtEntry, CtKey},
    map_names,
};
use tracing::{info, warn};

use super::DatapathError;
use crate::sys;

/// Where maps being migrated wait, under the pin directory.
pub(super) const MIGRATING_DIR: &str = "migrating";

/// The maps that may be migrated: the conntrack table (entries copied) and its early-drop
/// queue (keys moved, oldest first). Both are sized by `conntrack.capacity`.
const MIGRATABLE: [(&str, Kind); 2] = [
    (map_names::CT, Kind::Table),
    (map_names::CT_NEW, Kind::Queue),
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Table,
    Queue,
}

/// One map moved aside.
struct Aside {
    name: &'static str,
    kind: Kind,
    /// The old map (`Map::HashMap` or `Map::Queue`).
    old: Map,
    /// Under the name before this start, in effect: moved aside by it, or left aside by an
    /// interrupted start whose new map nothing used. A start that fails before a new program
    /// runs moves it back; false when new programs already run on the new map.
    moved_now: bool,
    /// The new map was created by this load: nothing else writes it until the new programs
    /// run, so the copy before the swap may overwrite. False when resuming onto a new map
    /// that new programs already use.
    fresh: bool,
    /// Its definition, for the log: (flags, max entries).
    was: (u32, u32),
}

/// The maps this start migrates; empty when every pin matches.
pub(super) struct Migration {
    maps_dir: PathBuf,
    aside_dir: PathBuf,
    aside: Vec<Aside>,
    /// A new program runs (a link swapped or attached): the new maps are live, and a failed
    /// start leaves the old ones aside for the next start.
    live: bool,
    /// The old table's keys as the copy before the swap found them: the copy after inserts
    /// only the others.
    copied: HashSet<CtKey>,
}

/// What copying one map did.
#[derive(Debug, Default, Clone, Copy)]
struct Copied {
    copied: u64,
    /// Keys the new map already held (kept: they are newer).
    present: u64,
    /// Entries the new map had no room for (a smaller capacity).
    no_room: u64,
}

impl Migration {
    /// Moves aside every migratable pin under `maps_dir` that the object's definition (with
    /// `capacity` entries) cannot reuse. Refuses (changing nothing) a pin whose type, key or
    /// value differ: that is not a migration this version knows.
    pub(super) fn prepare(
        pin_dir: &Path,
        maps_dir: &Path,
        object: &[u8],
        capacity: u32,
    ) -> Result<Migration, DatapathError> {
        let aside_dir = pin_dir.join(MIGRATING_DIR);
        let mut migration = Migration {
            maps_dir: maps_dir.to_owned(),
            aside_dir: aside_dir.clone(),
            aside: Vec::new(),
            live: false,
            copied: HashSet::new(),
        };
        let parsed = aya_obj::Object::parse(object)
            .map_err(|e| DatapathError::Config(format!("parsing the eBPF object's maps: {e}")))?;
        // Decide for every map before moving any, so a refusal changes nothing.
        let mut plan = Vec::new();
        for (name, kind) in MIGRATABLE {
            let Some(def) = parsed.maps.get(name) else {
                return Err(DatapathError::MissingMap { name });
            };
            let want = Definition {
                map_type: def.map_type(),
                key_size: def.key_size(),
                value_size: def.value_size(),
                flags: def.map_flags(),
                max_entries: capacity,
            };
            let pinned = maps_dir.join(name);
            let left = aside_dir.join(name);
            if left.exists() {
                // An interrupted migration: the pin under the name (if any) is its new map.
                let aside = Definition::of(&left)?;
                if pinned.exists() {
                    let new = Definition::of(&pinned)?;
                    if new != want {
                        return Err(DatapathError::Config(format!(
                            "an interrupted migration left {} (capacity {}) aside for a new {} of capacity {}; start with conntrack.capacity = {} so it can finish, then change it; or remove the datapath with `fastpath detach --pin-dir {}` (its connections are lost)",
                            left.display(),
                            aside.max_entries,
                            pinned.display(),
                            new.max_entries,
                            new.max_entries,
                            pin_dir.display()
                        )));
                    }
                }
                plan.push((name, kind, false));
                continue;
            }
            if !pinned.exists() {
                continue;
            }
            let have = Definition::of(&pinned)?;
            if have == want {
                continue;
            }
            if (have.map_type, have.key_size, have.value_size)
                != (want.map_type, want.key_size, want.value_size)
            {
                return Err(DatapathError::Config(format!(
                    "the pinned map {} has another layout (type {}, key {} B, value {} B; this version: type {}, key {} B, value {} B) and cannot be migrated; remove the pins with `fastpath detach --pin-dir {}` (its connections are lost)",
                    pinned.display(),
                    have.map_type,
                    have.key_size,
                    have.value_size,
                    want.map_type,
                    want.key_size,
                    want.value_size,
                    pin_dir.display()
                )));
            }
            plan.push((name, kind, true));
        }
        if plan.is_empty() {
            return Ok(migration);
        }
        fs::create_dir_all(&aside_dir).map_err(|source| DatapathError::PinDir {
            path: aside_dir.clone(),
            source,
        })?;
        for (name, kind, move_now) in plan {
            let (pinned, left) = (maps_dir.join(name), aside_dir.join(name));
            if move_now {
                rename(&pinned, &left)?;
            }
            let aside = Definition::of(&left)?;
            // Resuming: unless a pinned link runs a program on the new map under the name (the
            // interrupted start swapped), that map is a partial copy nothing uses: start over,
            // as if this start had moved the old one aside.
            let fresh = move_now || !pinned.exists() || !linked(pin_dir, &pinned)?;
            if !move_now {
                info!(
                    map = %name,
                    over = fresh,
                    "Migration resumed (over: no link runs a program on its new map, a partial copy, which is dropped)"
                );
                if fresh {
                    super::remove_pin(&pinned)?;
                }
            }
            let data = MapData::from_pin(&left).map_err(|source| DatapathError::Map {
                what: format!("opening {}", left.display()),
                source,
            })?;
            let old = match kind {
                Kind::Table => Map::HashMap(data),
                Kind::Queue => Map::Queue(data),
            };
            migration.aside.push(Aside {
                name,
                kind,
                old,
                moved_now: fresh,
                fresh,
                was: (aside.flags, aside.max_entries),
            });
        }
        migration.live = migration.aside.iter().any(|a| !a.fresh);
        Ok(migration)
    }

    /// Whether any map is being migrated.
    pub(super) fn is_empty(&self) -> bool {
        self.aside.is_empty()
    }

    /// Records that a new program runs (see [`Migration::live`]).
    pub(super) fn set_live(&mut self) {
        self.live = true;
    }

    /// The copy before the swap, into a fresh new table: the old one as it is now. (The
    /// early-drop keys move at the end: a start that fails leaves them in the old queue.)
    pub(super) fn copy_before_attach(&mut self, ebpf: &mut Ebpf) -> Result<(), DatapathError> {
        for a in self
            .aside
            .iter()
            .filter(|a| a.kind == Kind::Table && a.fresh)
        {
            let started = std::time::Instant::now();
            let c = overwrite_table(ebpf, a, &mut self.copied)?;
            info!(
                map = %a.name,
                copied = c.copied,
                present = c.present,
                no_room = c.no_room,
                took_ms = started.elapsed().as_millis() as u64,
                "Migration: copied before the new programs run"
            );
        }
        Ok(())
    }

    /// Once the old programs are gone from every link: copies what they added since the copy
    /// before the swap, moves the early-drop keys, then unpins the old maps. Resuming onto a
    /// new table programs already ran on, the old table's remaining entries are not copied:
    /// which of them the new programs have since removed (closed, expired, flushed) is not
    /// known, and bringing those back would be worse than losing the few connections the old
    /// programs opened between the interrupted start's copy and its swap.
    pub(super) fn finish(mut self, ebpf: &mut Ebpf) -> Result<(), DatapathError> {
        let copied = std::mem::take(&mut self.copied);
        for mut a in std::mem::take(&mut self.aside) {
            let started = std::time::Instant::now();
            let c = match (a.kind, a.fresh) {
                (Kind::Table, true) => insert_missing(ebpf, &a, &copied)?,
                (Kind::Table, false) => {
                    warn!(
                        map = %a.name,
                        "Migration resumed onto a table in use: the old table's connections the interrupted start had not copied are dropped"
                    );
                    Copied::default()
                }
                (Kind::Queue, _) => move_queue(ebpf, &mut a)?,
            };
            let now = Definition::of(&self.maps_dir.join(a.name))?;
            if c.no_room > 0 {
                warn!(
                    map = %a.name,
                    no_room = c.no_room,
                    capacity = now.max_entries,
                    "Migration: entries did not fit the new capacity and were dropped"
                );
            }
            info!(
                map = %a.name,
                copied = c.copied,
                present = c.present,
                no_room = c.no_room,
                flags_before = format_args!("{:#x}", a.was.0),
                flags_after = format_args!("{:#x}", now.flags),
                capacity_before = a.was.1,
                capacity_after = now.max_entries,
                took_ms = started.elapsed().as_millis() as u64,
                "Migrated the pinned map to this version's kind and size"
            );
            super::remove_pin(&self.aside_dir.join(a.name))?;
        }
        let _ = fs::remove_dir(&self.aside_dir);
        Ok(())
    }
}

impl Drop for Migration {
    /// A start that did not finish. Before any new program runs, the maps this start moved
    /// aside go back under their names (the new ones are unpinned), so the running datapath's
    /// pins are as they were; after, they stay aside for the next start to resume.
    fn drop(&mut self) {
        if self.live {
            if !self.aside.is_empty() {
                warn!(
                    dir = %self.aside_dir.display(),
                    "Migration unfinished: the old maps stay aside; the next start finishes it"
                );
            }
            return;
        }
        for a in self.aside.iter().filter(|a| a.moved_now) {
            let pinned = self.maps_dir.join(a.name);
            let left = self.aside_dir.join(a.name);
            let back = super::remove_pin(&pinned).and_then(|()| rename(&left, &pinned));
            match back {
                Ok(()) => info!(map = %a.name, "Migration abandoned: the old map is pinned again"),
                Err(e) => {
                    warn!(map = %a.name, error = %e, "Migration abandoned, but the old map could not be pinned again; the next start resumes it")
                }
            }
        }
        let _ = fs::remove_dir(&self.aside_dir);
    }
}

/// What the loader compares to reuse a pin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Definition {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    flags: u32,
    max_entries: u32,
}

impl Definition {
    fn of(pin: &Path) -> Result<Definition, DatapathError> {
        let info = MapInfo::from_pin(pin).map_err(|source| DatapathError::Map {
            what: format!("reading the definition of {}", pin.display()),
            source,
        })?;
        let map_type = info.map_type().map_err(|source| DatapathError::Map {
            what: format!("reading the type of {}", pin.display()),
            source,
        })?;
        Ok(Definition {
            map_type: map_type as u32,
            key_size: info.key_size(),
            value_size: info.value_size(),
            // Access modes describe the descriptor, not the map (as the loader ignores them).
            flags: info.map_flags() & !(BPF_F_RDONLY | BPF_F_WRONLY),
            max_entries: info.max_entries(),
        })
    }
}

const BPF_F_RDONLY: u32 = 1 << 3;
const BPF_F_WRONLY: u32 = 1 << 4;
/// `BPF_NOEXIST`: insert only a key the map does not hold.
const BPF_NOEXIST: u64 = 1;
/// `BPF_EXIST`, for a queue: a push onto a full queue overwrites its oldest element.
const BPF_EXIST: u64 = 2;

/// The copy into a table nothing else writes yet: the old table walked in batches (by
/// bucket: entries the old programs add or delete meanwhile neither restart nor stall the
/// walk) and written over the new one a batch at a time; `keys` gets every key copied.
fn overwrite_table(
    ebpf: &mut Ebpf,
    a: &Aside,
    keys: &mut HashSet<CtKey>,
) -> Result<Copied, DatapathError> {
    let name = a.name;
    let old: HashMap<&MapData, CtKey, CtEntry> =
        HashMap::try_from(&a.old).map_err(migration_error(name, "opening the old"))?;
    let new = ebpf
        .map_mut(name)
        .ok_or(DatapathError::MissingMap { name })?;
    let new: HashMap<&MapData, CtKey, CtEntry> =
        HashMap::try_from(&*new).map_err(migration_error(name, "opening the new"))?;
    let new_fd = new.map().fd().as_fd();
    let mut c = Copied::default();
    let mut failed = None;
    sys::map_walk_batches(old.map().fd().as_fd(), |k: &[CtKey], v: &[CtEntry]| {
        let mut at = 0;
        while at < k.len() && failed.is_none() {
            match sys::map_update_batch(new_fd, &k[at..], &v[at..]) {
                Ok(()) => {
                    c.copied += (k.len() - at) as u64;
                    keys.extend(&k[at..]);
                    at = k.len();
                }
                // A smaller capacity: the entry that did not fit is skipped.
                Err(e) if e.source.raw_os_error() == Some(libc::E2BIG) => {
                    c.copied += e.written as u64;
                    keys.extend(&k[at..at + e.written]);
                    c.no_room += 1;
                    at += e.written + 1;
                }
                Err(e) => failed = Some(e.source),
            }
        }
    })
    .map_err(|source| DatapathError::Io {
        what: format!("walking the old {name} for its migration"),
        source,
    })?;
    match failed {
        Some(source) => Err(DatapathError::Io {
            what: format!("writing the new {name} for its migration"),
            source,
        }),
        None => Ok(c),
    }
}

/// The copy into a table new programs use: the old table's entries whose keys are not in
/// `skip`, each inserted only if the new table lacks its key.
fn insert_missing(
    ebpf: &mut Ebpf,
    a: &Aside,
    skip: &HashSet<CtKey>,
) -> Result<Copied, DatapathError> {
    let name = a.name;
    let new = ebpf
        .map_mut(name)
        .ok_or(DatapathError::MissingMap { name })?;
    let mut new: HashMap<&mut MapData, CtKey, CtEntry> =
        HashMap::try_from(new).map_err(migration_error(name, "opening the new"))?;
    let old: HashMap<&MapData, CtKey, CtEntry> =
        HashMap::try_from(&a.old).map_err(migration_error(name, "opening the old"))?;
    let mut c = Copied::default();
    let mut failed = None;
    sys::map_walk_batches(
        old.map().fd().as_fd(),
        |keys: &[CtKey], entries: &[CtEntry]| {
            for (key, entry) in keys.iter().zip(entries) {
                if failed.is_some() || skip.contains(key) {
                    continue;
                }
                match new.insert(key, entry, BPF_NOEXIST) {
                    Ok(()) => c.copied += 1,
                    Err(MapError::SyscallError(e)) => match e.io_error.raw_os_error() {
                        Some(libc::EEXIST) => c.present += 1,
                        Some(libc::E2BIG) => c.no_room += 1,
                        _ => failed = Some(MapError::SyscallError(e)),
                    },
                    Err(e) => failed = Some(e),
                }
            }
        },
    )
    .map_err(|source| DatapathError::Io {
        what: format!("walking the old {name} for its migration"),
        source,
    })?;
    match failed {
        Some(source) => Err(migration_error(name, "inserting into the new")(source)),
        None => Ok(c),
    }
}

/// Whether a program attached through a link pinned under `pin_dir` uses the map pinned at
/// `map`. A program that cannot be read (unloaded meanwhile) does not count.
fn linked(pin_dir: &Path, map: &Path) -> Result<bool, DatapathError> {
    let id = MapInfo::from_pin(map)
        .map_err(|source| DatapathError::Map {
            what: format!("reading the id of {}", map.display()),
            source,
        })?
        .id();
    let progs: HashSet<u32> = fs::read_dir(pin_dir.join("links"))
        .map(|dir| {
            dir.flatten()
                .filter_map(|e| sys::obj_get(&e.path()).ok())
                .filter_map(|fd| sys::link_info(fd.as_fd()).ok())
                .map(|l| l.prog_id)
                .collect()
        })
        .unwrap_or_default();
    Ok(loaded_programs()
        .flatten()
        .filter(|p| progs.contains(&p.id()))
        .any(|p| {
            p.map_ids()
                .ok()
                .flatten()
                .is_some_and(|ids| ids.contains(&id))
        }))
}

/// Moves the old queue's keys, oldest first, behind the new queue's.
fn move_queue(ebpf: &mut Ebpf, a: &mut Aside) -> Result<Copied, DatapathError> {
    let name = a.name;
    let mut old: Queue<&mut MapData, CtKey> =
        Queue::try_from(&mut a.old).map_err(migration_error(name, "opening the old"))?;
    let new = ebpf
        .map_mut(name)
        .ok_or(DatapathError::MissingMap { name })?;
    let mut new: Queue<&mut MapData, CtKey> =
        Queue::try_from(new).map_err(migration_error(name, "opening the new"))?;
    let mut c = Copied::default();
    while let Ok(key) = old.pop(0) {
        // As the datapath pushes: a full queue forgets its oldest key.
        new.push(&key, BPF_EXIST)
            .map_err(migration_error(name, "pushing into the new"))?;
        c.copied += 1;
    }
    Ok(c)
}

fn migration_error(
    name: &'static str,
    what: &str,
) -> impl FnOnce(MapError) -> DatapathError + use<> {
    let what = format!("{what} {name} for its migration");
    move |source| DatapathError::Map { what, source }
}

fn rename(from: &Path, to: &Path) -> Result<(), DatapathError> {
    fs::rename(from, to).map_err(|source| DatapathError::PinDir {
        path: to.to_owned(),
        source: io::Error::new(
            source.kind(),
            format!(
                "moving the pin {} to {}: {source}",
                from.display(),
                to.display()
            ),
        ),
    })
}
