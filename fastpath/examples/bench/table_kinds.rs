//! Table kinds: the conntrack table's own work for a new load-balanced connection (a lookup
//! that misses, then two inserts: the connection and its alias) and for an established packet
//! (a lookup that hits, a counter bumped), on the kernel's hash (`FP_CT`, with the calls the
//! conntrack stage makes) and on an open-addressed array of slots claimed by compare-and-swap
//! (`FP_BENCH_SLOTS`, `fastpath_common::bench::CtSlot`), filled with the same keys, timed in
//! the same rounds against the empty program. It weighs a table of our own before the datapath
//! is built on one.

use std::fmt::Write as _;

use anyhow::{Result, bail};
use fastpath::testkit::fixture::{Fixture, XDP_PASS};
use fastpath_common::{
    Hook,
    bench::{TABLE_HIT, TABLE_NEW, TableRun},
    ct::{CtEntry, CtKey},
    program_names,
};
use serde::{Deserialize, Serialize};

use super::{CT_SIZES, CtRow, ct_row, report};

/// Buckets of the open-addressed table: 2 Mi slots, at most half of them used at the largest
/// size, 192 bytes each and 8 bytes of head (419 MB; the hash's 1 Mi entries take 268 MB).
const BUCKETS: u32 = 1 << 18;
/// The capacity of the third table of the smallest size's rows: the hash sized for the
/// connections it holds, not for the default's million (a table's memory sets how often a
/// new key's bucket misses the caches and the TLB).
const SMALL_CAPACITY: u32 = 32 * 1024;
/// Rounds of each measurement, interleaved (which kind goes first alternates).
const ROUNDS: usize = 5;
/// New connections per kind per round, each run once.
const NEW_RUNS: usize = 2_000;
/// Runs per call of an established packet's lookup (the kernel reports the mean).
const HIT_REPEAT: u32 = 100_000;

/// One kind of table work at one table size, on both tables.
#[derive(Clone, Default, Serialize, Deserialize)]
pub(crate) struct KindRow {
    work: String,
    hash: CtRow,
    slots: CtRow,
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
        // Room for the rows' own inserts beside the filled keys.
        let with_small = size as usize + 2 * ROUNDS * NEW_RUNS <= SMALL_CAPACITY as usize;
        if with_small {
            small.ct_clear()?;
            small.ct_fill(size, 0)?;
        }
        let hit = TableRun {
            key: keys[keys.len() / 2],
            op: TABLE_HIT,
            mask,
            ..TableRun::default()
        };
        // Per kind (the last: the small hash): (new, hit) samples; floors: (repeat = 1,
        // repeat = HIT_REPEAT).
        let mut samples = [(vec![], vec![]), (vec![], vec![]), (vec![], vec![])];
        let (mut floor_new, mut floor_hit) = (vec![], vec![]);
        for round in 0..ROUNDS {
            let order = if round % 2 == 0 { [0, 1, 2] } else { [2, 1, 0] };
            for _ in 0..NEW_RUNS {
                let run = TableRun {
                    key: new_key(next),
                    op: TABLE_NEW,
                    mask,
                    ..TableRun::default()
                };
                next += 1;
                floor_new.push(
                    fx.run_floor_repeat(Hook::Xdp, run.as_bytes(), 1)?
                        .per_run
                        .as_nanos() as f64,
                );
                for k in order {
                    if let Some(ns) = timed(&fx, &small, with_small, k, &run, 1)? {
                        samples[k].0.push(ns);
                    }
                }
            }
            floor_hit.push(
                fx.run_floor_repeat(Hook::Xdp, hit.as_bytes(), HIT_REPEAT)?
                    .per_run
                    .as_nanos() as f64,
            );
            for k in order {
                if let Some(ns) = timed(&fx, &small, with_small, k, &hit, HIT_REPEAT)? {
                    samples[k].1.push(ns);
                }
            }
        }
        let [
            (hash_new, hash_hit),
            (slots_new, slots_hit),
            (small_new, small_hit),
        ] = &samples;
        rows.push(KindRow {
            work: "new connection: lookup (miss), insert, insert alias (repeat = 1)".into(),
            hash: ct_row("hash", size, hash_new, &floor_new),
            slots: ct_row("slots", size, slots_new, &floor_new),
            small: with_small.then(|| ct_row("small hash", size, small_new, &floor_new)),
        });
        rows.push(KindRow {
            work: format!("established packet: lookup (hit), count (repeat {HIT_REPEAT})"),
            hash: ct_row("hash", size, hash_hit, &floor_hit),
            slots: ct_row("slots", size, slots_hit, &floor_hit),
            small: with_small.then(|| ct_row("small hash", size, small_hit, &floor_hit)),
        });
        eprint!("k");
    }
    Ok(rows)
}

/// The ns per run of `run` through kind `k` (0: the hash, 1: the slots, both in `fx`; 2: the
/// hash of `small`, if `with_small`), checked to have gone as its op says; `None` when there
/// is nothing to run.
fn timed(
    fx: &Fixture,
    small: &Fixture,
    with_small: bool,
    k: usize,
    run: &TableRun,
    repeat: u32,
) -> Result<Option<f64>> {
    let (fx, program) = match k {
        0 => (fx, program_names::BENCH_TABLE_HASH),
        1 => (fx, program_names::BENCH_TABLE_SLOTS),
        _ if with_small => (small, program_names::BENCH_TABLE_HASH),
        _ => return Ok(None),
    };
    let r = fx.run_table(program, run, repeat)?;
    if r.verdict != XDP_PASS {
        let what = if run.op == TABLE_NEW {
            "a new key's lookup and inserts"
        } else {
            "an existing key's lookup"
        };
        bail!(
            "{program} (kind {k}): {what} did not succeed (verdict {})",
            r.verdict
        );
    }
    Ok(Some(r.per_run.as_nanos() as f64))
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

/// The table-kind table: both kinds' ns over the floor (median, mean) and their ratio, and
/// the small hash's.
pub(crate) fn markdown(rows: &[KindRow]) -> String {
    if rows.is_empty() {
        return String::new();
    }
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let (h, s) = (&r.hash, &r.slots);
            let mean_over = |c: &CtRow| c.mean_ns - c.floor_median_ns;
            vec![
                r.work.clone(),
                h.table_entries.to_string(),
                format!("{:.1}", h.floor_median_ns),
                format!("{:+.1}", h.over_floor_ns),
                format!("{:+.1}", s.over_floor_ns),
                format!("{:.2}", s.over_floor_ns / h.over_floor_ns),
                format!("{:+.1}", mean_over(h)),
                format!("{:+.1}", mean_over(s)),
                format!("{:.2}", mean_over(s) / mean_over(h)),
                r.small.as_ref().map_or("–".into(), |m| {
                    format!(
                        "{:+.1} ({:.2})",
                        m.over_floor_ns,
                        m.over_floor_ns / h.over_floor_ns
                    )
                }),
            ]
        })
        .collect();
    let mut md = format!(
        "{ROUNDS} interleaved rounds · new connections: {} per kind per round, each run once, floor also run once · established: {} runs per call · slots: {} buckets of {}\n\n",
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
            "slots: median over floor ns",
            "slots ÷ hash",
            "hash: mean over floor ns",
            "slots: mean over floor ns",
            "slots ÷ hash (means)",
            &small,
        ],
        &[false, true, true, true, true, true, true, true, true, true],
        &cells,
    ));
    let _ = writeln!(md);
    md
}
