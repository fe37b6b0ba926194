//! Every map of the datapath, in one place. Pinned by name under `<pin_dir>/maps/` by the
//! daemon, so a daemon restart or crash keeps both the counters and the attached programs.

use aya_ebpf::{
    macros::map,
    maps::{Array, PerCpuArray},
};
use fastpath_common::{Counter, DatapathConfig, stats::STATS_ENTRIES};

/// Packet/byte counters, one slot per (hook, verdict, reason): see `stats_index`.
/// Written by every entry point exactly once per packet; read by the daemon and CLI.
/// Per-CPU so the hot path never contends; 3 hooks × 3 verdicts × 64 reason slots.
#[map(name = "FP_STATS")]
pub static FP_STATS: PerCpuArray<Counter> = PerCpuArray::pinned(STATS_ENTRIES, 0);

/// Runtime knobs (`DatapathConfig` at index 0), written by the daemon from its config file.
/// Read only on rare paths (malformed packets), never on the per-packet fast path.
#[map(name = "FP_CONFIG")]
pub static FP_CONFIG: Array<DatapathConfig> = Array::pinned(1, 0);

/// Time of the last rare-event log record on each CPU (ns, monotonic): see `ratelimit`.
/// Not pinned: losing it on restart only allows one early record.
#[map(name = "FP_LOG_RATELIMIT")]
pub static FP_LOG_RATELIMIT: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);
