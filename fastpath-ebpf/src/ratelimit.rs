//! At most one log record per CPU per second, for rare error paths (never per packet).

use aya_ebpf::helpers::bpf_ktime_get_ns;

use crate::maps::FP_LOG_RATELIMIT;

const INTERVAL_NS: u64 = 1_000_000_000;

/// Whether a rare-event log record may be written now on this CPU.
#[inline(always)]
pub fn allow() -> bool {
    let Some(last) = FP_LOG_RATELIMIT.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: bpf_ktime_get_ns has no preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    // SAFETY: this CPU's slot of a per-CPU array; BPF programs do not preempt each other on one
    // CPU.
    unsafe {
        if now.wrapping_sub(*last) < INTERVAL_NS && *last != 0 {
            return false;
        }
        *last = now;
    }
    true
}
