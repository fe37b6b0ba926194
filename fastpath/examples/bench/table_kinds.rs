//! Table kinds: the conntrack table's own work for a new load-balanced connection (a lookup
//! that misses, then two inserts: the connection and its alias), for a new connection of one
//! entry (DSR's, Katran's: a miss, one insert) and for an established packet (a lookup that
//! hits, a counter bumped), on the kernel's hash (`FP_CT`, with the calls the conntrack stage
//! makes), on an open-addressed array of slots claimed by compare-and-swap (`FP_BENCH_SLOTS`,
//! `fastpath_common::bench::CtSlot`) and on the kernel's LRU hash (`FP_BENCH_LRU`, the kind
//! Katran keeps its flows in), filled with the same keys, timed in the same rounds against the
//! empty program. It weighs the table kinds before the datapath is built on one.

use std::fmt::Write as _;

use anyhow::{Result, bail};
use fastpath::testkit::fixture::{Fixture, XDP_PASS};
use fastpath_common::{
    Hook,
    bench::{TABLE_HIT, TABLE_NEW, TABLE_NEW_ONE, TableRun},
    ct::{CtEntry, CtKey},
    program_names,
};
use serde::{Deserialize, Serialize};

use super::{CT_SIZES, CtRow, ct_row, report};

/// Buckets of the open-addressed table: 2 Mi slots, at most half of them used at the largest
/// size, 192 bytes each and 8 bytes of head (419 MB; the hash's 1 Mi entries take 268 MB).
const BUCKETS: u32 = 1 << 18;
/// The capacity of the fourth table of the smallest size's rows: the hash sized for the
/// connections it holds, not for the default's million (a table's memory sets how often a
/// new key's bucket misses the caches and the TLB).
const SMALL_CAPACITY: u32 = 32 * 1024;
/// Rounds of each measurement, interleaved (which kind goes first alternates).
const ROUNDS: usize = 5;
/// New connections per kind per round and work, each run once.
const NEW_RUNS: usize = 2_000;
/// Runs per call of an established packet's lookup (the kernel reports the mean).
const HIT_REPEAT: u32 = 100_000;
/// The kinds, in the order of a round's even turns (odd turns go in reverse): the hash, the
/// slots and the LRU of one fixture, and the small hash of another.
const KINDS: [(&str, &str); 4] = [
    ("hash", program_names::BENCH_TABLE_HASH),
    ("slots", program_names::BENCH_TABLE_SLOTS),
    ("LRU", program_names::BENCH_TABLE_LRU),
    ("small hash", program_names::BENCH_TABLE_HASH),
];
const SMALL: usize = 3;
/// The works, with their rows' names: each new connection takes entries in every table.
const WORKS: [(u32, &str); 3] = [
    (
        TABLE_NEW,
        "new connection: lookup (miss), insert, insert alias",
    ),
    (
        TABLE_NEW_ONE,
        "new connection of one entry (DSR's, Katran's): lookup (miss), insert",
    ),
    (TABLE_HIT, "established packet: lookup (hit), count"),
];

/// One kind of table work at one table size, on every table.
#[derive(Clone, Default, Serialize, Deserialize)]
pub(crate) struct KindRow {
    work: String,
    hash: CtRow,
    slots: CtRow,
    /// The LRU hash of the conntrack table's capacity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    lru: Option<CtRow>,
    /// The hash of [`SMALL_CAPACITY`] entries, where the rows' table fits in it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    small: Option<CtRow>,
}

/// The table-kind rows at every size of [`CT_SIZES`].
pub(crate) fn bench() -> Result<Vec<KindRow>> {
    let mut fx = Fixture::with_table_kinds(fastpath::config::DEFAULT_CT_CAPACITY, BUCKETS)?;
    let mut small = Fixture::with_table_kinds(SMALL_CAPACITY, 2)?;
    let mask = fx.buckets_mask()?;
    let entry = CtEntry::default();
    let mut rows = Vec::new();
    let mut next = 0u32;
    for size in CT_SIZES {
        fx.ct_clear()?;
        fx.ct_fill(size, 0)?;
        let keys: Vec<CtKey> = fx.ct_entries()?.into_keys().collect();
        fx.slots_fill(&keys, &entry)?;
        fx.lru_fill(&keys, &entry)?;
        // Room for the rows' own inserts beside the filled keys (three per run of the new
        // connections' works).
        let with_small = size as usize + 3 * ROUNDS * NEW_RUNS <= SMALL_CAPACITY as usize;
        if with_small {
            small.ct_clear()?;
            small.ct_fill(size, 0)?;
        }
        let kinds: Vec<usize> = (0..KINDS.len())
            .filter(|&k| k != SMALL || with_small)
            .collect();
        // Per work, per kind: samples; per work: the floor's.
        let mut samples = vec![vec![vec![]; KINDS.len()]; WORKS.len()];
        let mut floors = vec![vec![]; WORKS.len()];
        for round in 0..ROUNDS {
            let mut order = kinds.clone();
            if round % 2 == 1 {
                order.reverse();
            }
            for (w, &(op, _)) in WORKS.iter().enumerate() {
                let (runs, repeat) = if op == TABLE_HIT {
                    (1, HIT_REPEAT)
                } else {
                    (NEW_RUNS, 1)
                };
                for _ in 0..runs {
                    let key = if op == TABLE_HIT {
                        keys[keys.len() / 2]
                    } else {
                        next += 1;
                        new_key(next)
                    };
                    let run = TableRun {
                        key,
                        op,
                        mask,
                        ..TableRun::default()
                    };
                    floors[w].push(
                        fx.run_floor_repeat(Hook::Xdp, run.as_bytes(), repeat)?
                            .per_run
                            .as_nanos() as f64,
                    );
                    for &k in &order {
                        let f = if k == SMALL { &small } else { &fx };
                        samples[w][k].push(timed(f, k, &run, repeat)?);
                    }
                }
            }
        }
        for (w, &(op, work)) in WORKS.iter().enumerate() {
            let row = |k: usize| ct_row(KINDS[k].0, size, &samples[w][k], &floors[w]);
            let repeat = if op == TABLE_HIT { HIT_REPEAT } else { 1 };
            rows.push(KindRow {
                work: format!("{work} (repeat = {repeat})"),
                hash: row(0),
                slots: row(1),
                lru: Some(row(2)),
                small: with_small.then(|| row(SMALL)),
            });
        }
        eprint!("k");
    }
    Ok(rows)
}

/// The ns per run of `run` through kind `k` of [`KINDS`] in `fx`, checked to have gone as
/// its op says.
fn timed(fx: &Fixture, k: usize, run: &TableRun, repeat: u32) -> Result<f64> {
    let (kind, program) = KINDS[k];
    let r = fx.run_table(program, run, repeat)?;
    if r.verdict != XDP_PASS {
        let what = if run.op == TABLE_HIT {
            "an existing key's lookup"
        } else {
            "a new key's lookup and inserts"
        };
        bail!(
            "{program} ({kind}): {what} did not succeed (verdict {})",
            r.verdict
        );
    }
    Ok(r.per_run.as_nanos() as f64)
}

/// The `i`th new connection's key: addresses no filled key has (`Fixture::ct_fill`'s are in
/// 10/8).
fn new_key(i: u32) -> CtKey {
    let b = i.to_be_bytes();
    let mut lo = [0u8; 16];
    let mut hi = [0u8; 16];
    lo[..4].copy_from_slice(&[11, b[1], b[2], b[3]]);
    hi[..4].copy_from_slice(&[12, b[1], b[2], b[3]]);
    CtKey {
        addr_lo: lo,
        addr_hi: hi,
        port_lo: 40000 + b[0] as u16,
        port_hi: 80,
        proto: 6,
        family: 4,
        _pad: [0; 2],
    }
}

/// The table-kind table: each kind's ns over the floor (median, mean), and its ratio to the
/// hash's.
pub(crate) fn markdown(rows: &[KindRow]) -> String {
    if rows.is_empty() {
        return String::new();
    }
    let over = |c: &CtRow| c.over_floor_ns;
    let mean_over = |c: &CtRow| c.mean_ns - c.floor_median_ns;
    // "value (÷ the hash's)", or a dash where the kind was not run.
    let vs = |c: Option<&CtRow>, h: &CtRow, f: &dyn Fn(&CtRow) -> f64| {
        c.map_or("–".into(), |c| {
            format!("{:+.1} ({:.2})", f(c), f(c) / f(h))
        })
    };
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let h = &r.hash;
            vec![
                r.work.clone(),
                h.table_entries.to_string(),
                format!("{:.1}", h.floor_median_ns),
                format!("{:+.1}", over(h)),
                vs(Some(&r.slots), h, &over),
                vs(r.lru.as_ref(), h, &over),
                format!("{:+.1}", mean_over(h)),
                vs(Some(&r.slots), h, &mean_over),
                vs(r.lru.as_ref(), h, &mean_over),
                vs(r.small.as_ref(), h, &over),
            ]
        })
        .collect();
    let mut md = format!(
        "{ROUNDS} interleaved rounds · new connections: {} per kind, work and round, each run once, floor also run once · established: {} runs per call · slots: {} buckets of {} · LRU: the conntrack table's capacity\n\n",
        NEW_RUNS,
        HIT_REPEAT,
        BUCKETS,
        fastpath_common::bench::BUCKET_SLOTS,
    );
    let small = format!("hash of {SMALL_CAPACITY} entries: median over floor ns (÷ hash)");
    md.push_str(&report::table(
        &[
            "table work",
            "table entries",
            "floor ns",
            "hash: median over floor ns",
            "slots: median over floor ns (÷ hash)",
            "LRU: median over floor ns (÷ hash)",
            "hash: mean over floor ns",
            "slots: mean over floor ns (÷ hash)",
            "LRU: mean over floor ns (÷ hash)",
            &small,
        ],
        &[false, true, true, true, true, true, true, true, true, true],
        &cells,
    ));
    let _ = writeln!(md);
    md
}
