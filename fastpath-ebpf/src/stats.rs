//! Counters: reason-coded per-CPU packet counters (one map update per packet, no logging),
//! per service and per backend, and the connections given to and closed by each backend.

use fastpath_common::{
    Hook, Verdict,
    stats::{stats_index, stats_map},
};

use crate::maps::{FP_BACKEND_LOAD, FP_BACKEND_STATS, FP_STATS, FP_STATS_EXT, FP_SVC_STATS};

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

/// Adds 1 to `*p` atomically (a BPF atomic add: CPUs do not lose each other's increments).
/// `core::sync::atomic` has no fetch_add on this target; the intrinsic compiles to BPF's
/// atomic add instruction.
///
/// # Safety
/// `p` is a valid, 8-aligned pointer into map memory.
#[inline(always)]
unsafe fn atomic_add(p: *mut u64) {
    // SAFETY: as the caller promises.
    unsafe {
        core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(
            p, 1,
        );
    }
}

/// Records a connection given to backend `idx` (least-connections compares these counts).
#[inline(always)]
pub fn backend_opened(idx: u32) {
    if let Some(l) = FP_BACKEND_LOAD.get_ptr_mut(idx) {
        // SAFETY: a map value pointer; the add is atomic, so CPUs do not lose each other's.
        unsafe { atomic_add(&raw mut (*l).opened) };
    }
}

/// Records that a connection of backend `idx` closed (or went without closing).
#[inline(always)]
pub fn backend_closed(idx: u32) {
    if let Some(l) = FP_BACKEND_LOAD.get_ptr_mut(idx) {
        // SAFETY: as in `backend_opened`.
        unsafe { atomic_add(&raw mut (*l).closed) };
    }
}

/// Counts a packet (and a new connection) for its service and backend.
#[inline(always)]
pub fn service(service: u32, backend: u32, len: usize, new_connection: bool) {
    if let Some(c) = FP_SVC_STATS.get_ptr_mut(service) {
        // SAFETY: this CPU's slot of a per-CPU array.
        unsafe {
            (*c).packets += 1;
            (*c).bytes += len as u64;
            if new_connection {
                (*c).connections += 1;
            }
        }
    }
    if let Some(c) = FP_BACKEND_STATS.get_ptr_mut(backend) {
        // SAFETY: as above.
        unsafe {
            (*c).packets += 1;
            (*c).bytes += len as u64;
            if new_connection {
                (*c).connections += 1;
            }
        }
    }
}

/// Counts a new connection to a service that has no backend.
#[inline(always)]
pub fn service_no_backend(service: u32) {
    if let Some(c) = FP_SVC_STATS.get_ptr_mut(service) {
        // SAFETY: this CPU's slot of a per-CPU array.
        unsafe { (*c).no_backend += 1 };
    }
}
