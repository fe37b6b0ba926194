//! Reason-coded per-CPU counters: one map update per packet, no logging.

use fastpath_common::{
    Hook, Verdict,
    stats::{stats_index, stats_map},
};

use crate::maps::{FP_STATS, FP_STATS_EXT};

#[inline(always)]
pub fn count(hook: Hook, verdict: Verdict, reason: u32, bytes: usize) {
    let i = stats_index(hook, verdict, reason);
    // Most call sites pass a constant reason: the branch folds away there.
    let slot = if stats_map(reason) == 0 {
        FP_STATS.get_ptr_mut(i)
    } else {
        FP_STATS_EXT.get_ptr_mut(i)
    };
    if let Some(c) = slot {
        // SAFETY: the pointer is this CPU's slot of a per-CPU array; nothing else on this CPU
        // runs concurrently with us (BPF programs are not preempted by each other on one CPU).
        unsafe {
            (*c).packets += 1;
            (*c).bytes += bytes as u64;
        }
    }
}
