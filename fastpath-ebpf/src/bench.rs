//! Synthetic producers for `cargo xtask bench`, run only through BPF_PROG_TEST_RUN and never
//! attached. They go through the stages' own code paths, so a benchmark measures what the
//! datapath really does.

use fastpath_common::{
    bench::CT_EVENTS_PER_RUN,
    ct::{CtEntry, ct_event},
};

use crate::{
    conntrack,
    maps::{FP_BENCH_SEQ, FP_CT_KEY},
};

/// Emits `CT_EVENTS_PER_RUN` conntrack events through the conntrack stage's `emit` (ring
/// reserve, write in place, submit; counted as lost when the ring is full), numbered from
/// `FP_BENCH_SEQ` (see `fastpath_common::bench`).
#[inline(always)]
pub fn ct_events() {
    let (Some(next), Some(key)) = (FP_BENCH_SEQ.get_ptr_mut(0), FP_CT_KEY.get_ptr_mut(0)) else {
        return;
    };
    // SAFETY: valid map value pointers for this run. The benchmark runs one producer at a
    // time, so the non-atomic increment below is not raced; the key is this CPU's slot of a
    // per-CPU array, used by this program run only.
    let (next, key) = unsafe { (&mut *next, &mut *key) };
    // The key lives in the conntrack stage's per-CPU scratch, as on the real path: a constant
    // key on the stack would let LLVM turn its zero bytes into memset calls in the ring slot,
    // which the real path does not pay.
    key.addr_lo = [10, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    key.addr_hi = [10, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    key.proto = 17;
    key.family = 4;
    key._pad = [0; 2];
    let base = *next;
    let entry = CtEntry::default();
    let mut i = 0;
    // verifier: a constant trip count (a bounded loop).
    while i < CT_EVENTS_PER_RUN {
        let seq = base + u64::from(i);
        key.port_lo = seq as u16;
        key.port_hi = (seq >> 16) as u16;
        // The sequence number stands in for the timestamp: the consumer checks it.
        conntrack::emit(key, ct_event::NEW, &entry, seq);
        i += 1;
    }
    // Lost events still take their numbers, so the consumer sees the gap.
    *next = base + u64::from(CT_EVENTS_PER_RUN);
}
