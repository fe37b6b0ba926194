//! Migration of the pinned conntrack maps whose kind or size no longer match the object's:
//! a table pinned by an older version (another map flag) or with another
//! `conntrack.capacity`. The loader cannot reuse such a pin, so [`Migration::prepare`] moves
//! it aside (`<pin_dir>/migrating/<name>`) before the load, which then pins a new map under
//! the name; the old programs keep running on the old map meanwhile (a program holds its maps,
//! not their names). The entries are copied twice: once before the new programs attach, and
//! once after, for the connections the old programs created in between; a key already in the
//! new map is never overwritten (the new programs' entry is the newer). Then the old map is
//! unpinned. A start that fails before [`Migration::finish`] moves the old map back under its
//! name (the running datapath is left as it was), and a start killed half-way leaves the old
//! map aside, where the next start finds it and copies what is missing.

use std::{
    fs, io,
    os::fd::AsFd as _,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf,
    maps::{HashMap, IterableMap as _, Map, MapData, MapError, MapInfo, Queue},
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
    /// Moved aside by this start (a failed start moves it back); false when an interrupted
    /// earlier start left it there.
    moved_now: bool,
    /// Its definition, for the log: (flags, max entries).
    was: (u32, u32),
}

/// The maps this start migrates; empty when every pin matches.
pub(super) struct Migration {
    maps_dir: PathBuf,
    aside_dir: PathBuf,
    aside: Vec<Aside>,
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
                // An interrupted migration: the pin under the name (if any) is the new map.
                if pinned.exists() && Definition::of(&pinned)? != want {
                    return Err(DatapathError::Config(format!(
                        "{} holds a map an interrupted migration left, and {} matches neither it nor this version; remove both with `fastpath detach --pin-dir {}`",
                        left.display(),
                        pinned.display(),
                        pin_dir.display()
                    )));
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
            let data = MapData::from_pin(&left).map_err(|source| DatapathError::Map {
                what: format!("opening {}", left.display()),
                source,
            })?;
            let old = match kind {
                Kind::Table => Map::HashMap(data),
                Kind::Queue => Map::Queue(data),
            };
            let was = Definition::of(&left).map(|d| (d.flags, d.max_entries))?;
            migration.aside.push(Aside {
                name,
                kind,
                old,
                moved_now: move_now,
                was,
            });
        }
        Ok(migration)
    }

    /// Whether any map is being migrated.
    pub(super) fn is_empty(&self) -> bool {
        self.aside.is_empty()
    }

    /// The first copy, before the new programs attach: the old table's entries into the new.
    pub(super) fn copy_before_attach(&self, ebpf: &mut Ebpf) -> Result<(), DatapathError> {
        for a in self.aside.iter().filter(|a| a.kind == Kind::Table) {
            let c = copy_table(ebpf, a)?;
            info!(
                map = %a.name,
                copied = c.copied,
                present = c.present,
                no_room = c.no_room,
                "Migration: first copy of the pinned table"
            );
        }
        Ok(())
    }

    /// After the new programs attached: copies what the old programs added meanwhile and
    /// moves the early-drop keys, then unpins the old maps.
    pub(super) fn finish(mut self, ebpf: &mut Ebpf) -> Result<(), DatapathError> {
        for mut a in std::mem::take(&mut self.aside) {
            let c = match a.kind {
                Kind::Table => copy_table(ebpf, &a)?,
                Kind::Queue => move_queue(ebpf, &mut a)?,
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
                "Migrated the pinned map to this version's kind and size"
            );
            super::remove_pin(&self.aside_dir.join(a.name))?;
        }
        let _ = fs::remove_dir(&self.aside_dir);
        Ok(())
    }
}

impl Drop for Migration {
    /// A start that did not finish: the maps this start moved aside go back under their
    /// names (the new ones are unpinned), so the running datapath's pins are as they were.
    fn drop(&mut self) {
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

/// Copies the old table's entries the new one lacks: the old one walked in batches (by
/// bucket, so entries the old programs add or delete meanwhile neither restart nor stall the
/// walk), each inserted only if absent.
fn copy_table(ebpf: &mut Ebpf, a: &Aside) -> Result<Copied, DatapathError> {
    let name = a.name;
    let new = ebpf
        .map_mut(name)
        .ok_or(DatapathError::MissingMap { name })?;
    let mut new: HashMap<&mut MapData, CtKey, CtEntry> =
        HashMap::try_from(new).map_err(migration_error(name, "opening the new"))?;
    let old: HashMap<&MapData, CtKey, CtEntry> =
        HashMap::try_from(&a.old).map_err(migration_error(name, "opening the old"))?;
    let old = old.map().fd().as_fd();
    let mut c = Copied::default();
    let mut failed = None;
    sys::map_walk_batches(old, |keys: &[CtKey], entries: &[CtEntry]| {
        for (key, entry) in keys.iter().zip(entries) {
            if failed.is_some() {
                return;
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
    })
    .map_err(|source| DatapathError::Io {
        what: format!("walking the old {name} for its migration"),
        source,
    })?;
    match failed {
        Some(source) => Err(migration_error(name, "inserting into the new")(source)),
        None => Ok(c),
    }
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
