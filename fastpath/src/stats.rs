//! Reading and presenting the datapath's reason-coded counters.

use std::{collections::BTreeMap, fmt::Write as _};

use aya::maps::{MapData, PerCpuArray};
use fastpath_common::{
    Counter, Hook, Verdict, reason,
    stats::{STATS_ENTRIES, stats_slot},
};
use serde::Serialize;

/// Summed-over-CPUs counters, keyed by (hook, verdict, reason); zero slots are left out.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    pub slots: BTreeMap<(u32, u32, u32), Counter>,
}

#[derive(Debug, thiserror::Error)]
pub enum StatsError {
    #[error("reading stats slot {index}: {source}")]
    Read {
        index: u32,
        #[source]
        source: aya::maps::MapError,
    },
}

/// One row of the human/JSON view.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct StatsRow {
    pub hook: String,
    pub verdict: String,
    pub reason: String,
    pub packets: u64,
    pub bytes: u64,
}

impl StatsSnapshot {
    /// Reads every slot of the per-CPU stats maps and sums the CPUs: `map` (`FP_STATS`, codes
    /// below 64) and `ext` (`FP_STATS_EXT`, the codes above; `None` where an older datapath
    /// without it runs).
    pub fn read<T: std::borrow::Borrow<MapData>, U: std::borrow::Borrow<MapData>>(
        map: &PerCpuArray<T, Counter>,
        ext: Option<&PerCpuArray<U, Counter>>,
    ) -> Result<Self, StatsError> {
        let mut slots = BTreeMap::new();
        read_map(map, 0, &mut slots)?;
        if let Some(ext) = ext {
            read_map(ext, 1, &mut slots)?;
        }
        Ok(StatsSnapshot { slots })
    }

    /// Counter of one (hook, verdict, reason), zero if never hit.
    pub fn get(&self, hook: Hook, verdict: Verdict, reason: u32) -> Counter {
        self.slots
            .get(&(hook as u32, verdict as u32, reason))
            .copied()
            .unwrap_or_default()
    }

    /// Packets counted under `reason` on any hook and verdict.
    pub fn packets_for_reason(&self, reason: u32) -> u64 {
        self.slots
            .iter()
            .filter(|((_, _, r), _)| *r == reason)
            .map(|(_, c)| c.packets)
            .sum()
    }

    /// Packets counted on `hook` (any verdict, any reason).
    pub fn packets_on_hook(&self, hook: Hook) -> u64 {
        self.slots
            .iter()
            .filter(|((h, _, _), _)| *h == hook as u32)
            .map(|(_, c)| c.packets)
            .sum()
    }

    /// `self - before`, slot by slot (counters only grow; a restart-reset shows as zero).
    pub fn delta(&self, before: &StatsSnapshot) -> StatsSnapshot {
        let mut slots = BTreeMap::new();
        for (k, now) in &self.slots {
            let was = before.slots.get(k).copied().unwrap_or_default();
            let d = Counter {
                packets: now.packets.saturating_sub(was.packets),
                bytes: now.bytes.saturating_sub(was.bytes),
            };
            if d.packets != 0 || d.bytes != 0 {
                slots.insert(*k, d);
            }
        }
        StatsSnapshot { slots }
    }

    pub fn rows(&self) -> Vec<StatsRow> {
        self.slots
            .iter()
            .map(|(&(h, v, r), c)| StatsRow {
                hook: Hook::ALL
                    .get(h as usize)
                    .map_or("unknown", |h| h.name())
                    .into(),
                verdict: Verdict::ALL
                    .get(v as usize)
                    .map_or("unknown", |v| v.name())
                    .into(),
                reason: reason::name(r).into(),
                packets: c.packets,
                bytes: c.bytes,
            })
            .collect()
    }

    /// A fixed-width table, one row per non-zero (hook, verdict, reason).
    pub fn render_table(&self) -> String {
        render_rows(&self.rows())
    }
}

/// Sums the CPUs of every slot of stats map number `which` (`stats::stats_map`) into `slots`,
/// leaving out the zero ones.
fn read_map<T: std::borrow::Borrow<MapData>>(
    map: &PerCpuArray<T, Counter>,
    which: u32,
    slots: &mut BTreeMap<(u32, u32, u32), Counter>,
) -> Result<(), StatsError> {
    for index in 0..STATS_ENTRIES {
        let per_cpu = map
            .get(&index, 0)
            .map_err(|source| StatsError::Read { index, source })?;
        let mut sum = Counter::default();
        for c in per_cpu.iter() {
            sum.packets += c.packets;
            sum.bytes += c.bytes;
        }
        if (sum.packets != 0 || sum.bytes != 0)
            && let Some((h, v, r)) = stats_slot(which, index)
        {
            slots.insert((h as u32, v as u32, r), sum);
        }
    }
    Ok(())
}

/// The `fastpath stats` table of `rows`.
pub fn render_rows(rows: &[StatsRow]) -> String {
    {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:<11} {:<8} {:<26} {:>12} {:>14}",
            "HOOK", "VERDICT", "REASON", "PACKETS", "BYTES"
        );
        for r in rows {
            let _ = writeln!(
                out,
                "{:<11} {:<8} {:<26} {:>12} {:>14}",
                r.hook, r.verdict, r.reason, r.packets, r.bytes
            );
        }
        if rows.is_empty() {
            let _ = writeln!(out, "(no packets counted yet)");
        }
        out
    }
}
