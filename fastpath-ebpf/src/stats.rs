//! Reason-coded per-CPU counters: one map update per packet, no logging.

use fastpath_common::{Hook, Verdict, stats::stats_index};

use crate::maps::FP_STATS;

#[inline(always)]
pub fn count(hook: Hook, verdict: Verdict, reason: u32, bytes: usize) {
    if let Some(c) = FP_STATS.get_ptr_mut(stats_index(hook, verdict, reason)) {
        // SAFETY: the pointer is this CPU's slot of a per-CPU array; nothing else on this CPU
        // runs concurrently with us (BPF programs are not preempted by each other on one CPU).
        unsafe {
            (*c).packets += 1;
            (*c).bytes += bytes as u64;
        }
    }
}
