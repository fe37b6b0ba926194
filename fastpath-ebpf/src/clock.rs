//! The coarse monotonic clock the stages keep time with: the last tick's time (jiffies'
//! resolution, as Linux's own conntrack keeps time); userspace compares it with
//! CLOCK_MONOTONIC, which it trails by at most a tick or two.

use aya_ebpf::helpers::{bpf_jiffies64, bpf_ktime_get_coarse_ns};

use crate::maps::FP_CLOCK;

/// The coarse clock's time. perf: asked of the kernel once per tick on each CPU, not per
/// packet — `bpf_jiffies64` is a load the verifier inlines, `bpf_ktime_get_coarse_ns` a helper
/// call (tens of ns where `ret` is mitigated) — and kept in this CPU's `FP_CLOCK` with the
/// jiffies it was read at. Both move at the tick; a read between the two updates keeps the
/// previous tick's time for this tick.
#[inline(always)]
pub fn now() -> u64 {
    // SAFETY: bpf_jiffies64 has no preconditions.
    let jiffies = unsafe { bpf_jiffies64() };
    let Some(seen) = FP_CLOCK.get_ptr_mut(0) else {
        // SAFETY: bpf_ktime_get_coarse_ns has no preconditions.
        return unsafe { bpf_ktime_get_coarse_ns() };
    };
    // SAFETY: this CPU's slot of a per-CPU array, used by this program run only.
    let seen = unsafe { &mut *seen };
    if seen[0] != jiffies {
        // SAFETY: as above.
        seen[1] = unsafe { bpf_ktime_get_coarse_ns() };
        seen[0] = jiffies;
    }
    seen[1]
}
