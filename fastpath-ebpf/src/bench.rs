//! Synthetic producers for `cargo xtask bench`, run only through BPF_PROG_TEST_RUN and never
//! attached. They go through the stages' own code paths, so a benchmark measures what the
//! datapath really does.

use aya_ebpf::bindings::xdp_action;
use fastpath_common::{
    bench::{
        BENCH_FRAME_WORDS, BUCKET_SLOTS, CT_EVENTS_PER_RUN, CtBucket, CtSlot, FLOW_IP_CSUM,
        FLOW_SPORT, FLOW_SRC_LOW, FLOW_TCP_CSUM, SLOT_CLAIMED, SLOT_FREE, SLOT_LIVE, TABLE_HIT,
        TABLE_NEW_ONE, TableRun, flow_stamp, slot_buckets, table_alias,
    },
    csum,
    ct::{CtEntry, CtKey, DIR_ORIGINAL, ct_event},
};

use crate::{
    conntrack::{self, BPF_NOEXIST},
    maps::{
        FP_BENCH_FLOWS, FP_BENCH_FRAME, FP_BENCH_HEADS, FP_BENCH_LRU, FP_BENCH_SEQ, FP_BENCH_SLOTS,
        FP_CT, FP_CT_ENTRY, FP_CT_KEY, FP_CT_KEY2,
    },
    packet::Packet,
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

/// Writes the generator's frame (`FP_BENCH_FRAME`) over the packet, stamped as frame number
/// `FP_BENCH_FLOWS` (then counted): the source address's low bits and the source port of
/// `flow_stamp`, the IPv4 and TCP checksums updated for them (RFC 1624), all in the frame's
/// words before the one store.
#[inline(always)]
pub fn flow_frame(pkt: &Packet) {
    let (Some(template), Some(next)) = (FP_BENCH_FRAME.get(0), FP_BENCH_FLOWS.get_ptr_mut(0))
    else {
        return;
    };
    // SAFETY: a valid map value pointer; one generator thread per loaded object (see
    // FP_BENCH_FLOWS), so the increment is not raced.
    let n = unsafe {
        let n = *next;
        *next = n + 1;
        n
    };
    let mut w = *template;
    let (src, sport) = flow_stamp(n);
    let src_delta = csum::delta2(get16(&w, FLOW_SRC_LOW), src);
    let sport_delta = csum::delta2(get16(&w, FLOW_SPORT), sport);
    let ip = csum::apply(get16(&w, FLOW_IP_CSUM), src_delta);
    // The source address is in the TCP pseudo-header.
    let tcp = csum::apply(get16(&w, FLOW_TCP_CSUM), src_delta + sport_delta);
    set16(&mut w, FLOW_SRC_LOW, src);
    set16(&mut w, FLOW_SPORT, sport);
    set16(&mut w, FLOW_IP_CSUM, ip);
    set16(&mut w, FLOW_TCP_CSUM, tcp);
    pkt.store_words(0, w);
}

/// The big-endian 16-bit field at byte `off` of frame words (their bytes in memory order,
/// read native-endian): `off` even and `off % 8 <= 6`, so it lies inside one word.
#[inline(always)]
fn get16(w: &[u64; BENCH_FRAME_WORDS], off: usize) -> u16 {
    let b = w[off / 8].to_ne_bytes();
    u16::from_be_bytes([b[off % 8], b[off % 8 + 1]])
}

/// Writes the big-endian 16-bit field at byte `off` of frame words (as [`get16`]).
#[inline(always)]
fn set16(w: &mut [u64; BENCH_FRAME_WORDS], off: usize, v: u16) {
    let mut b = w[off / 8].to_ne_bytes();
    let [hi, lo] = v.to_be_bytes();
    b[off % 8] = hi;
    b[off % 8 + 1] = lo;
    w[off / 8] = u64::from_ne_bytes(b);
}

/// The input of a table-kind run (`fastpath_common::bench::TableRun`): (op, index mask, the
/// key in this CPU's scratch, the key's alias in the second scratch), or `None` if the frame
/// is too short.
#[inline(always)]
fn table_input(pkt: &Packet) -> Option<(u32, u32, &'static CtKey, &'static CtKey)> {
    let w = pkt.words_at::<{ size_of::<TableRun>() / 8 }>(0)?;
    let (key, alias) = (FP_CT_KEY.get_ptr_mut(0)?, FP_CT_KEY2.get_ptr_mut(0)?);
    // SAFETY: the frame's words were checked to lie in the packet (the target allows
    // unaligned loads); the keys are this CPU's slots of per-CPU arrays, 8-aligned, used by
    // this program run only.
    unsafe {
        let k = key.cast::<u64>();
        let mut i = 0;
        while i < 5 {
            k.add(i).write(w.add(i).read_unaligned());
            i += 1;
        }
        let op_mask = w.add(5).read_unaligned();
        *alias = table_alias(&*key);
        Some((op_mask as u32, (op_mask >> 32) as u32, &*key, &*alias))
    }
}

/// A table-kind run on the conntrack hash `FP_CT`, with the calls the conntrack stage makes
/// (see `TABLE_NEW`, `TABLE_NEW_ONE`, `TABLE_HIT`): the cost the other kinds are weighed
/// against.
#[inline(always)]
pub fn table_hash(pkt: &Packet) -> u32 {
    table_run(
        pkt,
        |key, _| FP_CT.get_ptr_mut(key),
        |key, entry, _| FP_CT.insert(key, entry, BPF_NOEXIST).is_ok(),
    )
}

/// The same run on the open-addressed table `FP_BENCH_SLOTS` (see `CtSlot`).
#[inline(always)]
pub fn table_slots(pkt: &Packet) -> u32 {
    table_run(
        pkt,
        // SAFETY: a live slot of the array; its entry's address.
        |key, mask| slot_find(key, mask).map(|s| unsafe { &raw mut (*s).entry }),
        slot_insert,
    )
}

/// The same run on the LRU hash `FP_BENCH_LRU`: a lookup marks the entry referenced, an
/// insert into a full table evicts one it was not.
#[inline(always)]
pub fn table_lru(pkt: &Packet) -> u32 {
    table_run(
        pkt,
        |key, _| FP_BENCH_LRU.get_ptr_mut(key),
        |key, entry, _| FP_BENCH_LRU.insert(key, entry, BPF_NOEXIST).is_ok(),
    )
}

/// The run of the frame's `TableRun` on a table given by its `lookup` and its `insert`
/// (`BPF_NOEXIST`), each told the bucket mask: XDP_PASS when it went as its op says (an op
/// other than `TABLE_HIT` and `TABLE_NEW_ONE` is `TABLE_NEW`).
#[inline(always)]
fn table_run(
    pkt: &Packet,
    lookup: impl Fn(&CtKey, u32) -> Option<*mut CtEntry>,
    insert: impl Fn(&CtKey, &CtEntry, u32) -> bool,
) -> u32 {
    let (Some((op, mask, key, alias)), Some(entry)) = (table_input(pkt), FP_CT_ENTRY.get(0)) else {
        return xdp_action::XDP_ABORTED;
    };
    // verifier: the hit's branch first and the new connections' in one expression (a
    // `match` of three arms let LLVM merge the hit's pointer into a path where it is unset).
    let done = if op == TABLE_HIT {
        match lookup(key, mask) {
            // SAFETY: a live entry of the table.
            Some(e) => unsafe {
                (*e).packets[DIR_ORIGINAL] += 1;
                true
            },
            None => false,
        }
    } else {
        lookup(key, mask).is_none()
            && insert(key, entry, mask)
            && (op == TABLE_NEW_ONE || insert(alias, entry, mask))
    };
    if done {
        xdp_action::XDP_PASS
    } else {
        xdp_action::XDP_DROP
    }
}

/// The live slot of `key`, if any: two buckets' heads (array lookups the verifier inlines),
/// then the key of a slot whose head matches.
#[inline(always)]
fn slot_find(key: &CtKey, mask: u32) -> Option<*mut CtSlot> {
    let (first, second, tag) = slot_buckets(key, mask);
    let words = key.words();
    let mut b = 0;
    // verifier: constant bounds.
    while b < 2 {
        let bucket = if b == 0 { first } else { second };
        let heads = FP_BENCH_HEADS.get_ptr(bucket)?;
        let mut i = 0;
        while i < BUCKET_SLOTS {
            // SAFETY: a valid, aligned array value; a head is read before its slot.
            if unsafe { core::ptr::read_volatile(&raw const (*heads)[i]) } == SLOT_LIVE | tag
                && let Some(s) = FP_BENCH_SLOTS.get_ptr_mut(bucket * BUCKET_SLOTS as u32 + i as u32)
                // SAFETY: as above; a live slot's key is not written while it is live.
                && unsafe { (*s).key.words() } == words
            {
                return Some(s);
            }
            i += 1;
        }
        b += 1;
    }
    None
}

/// Inserts `key` with `entry` unless it is there (`BPF_NOEXIST`): into the first free slot
/// of whichever of its two buckets has more of them, claimed by compare-and-swap on its head.
/// False if the key is there, or its bucket has no free slot left to claim (both full, or
/// other CPUs took the last ones first).
#[inline(always)]
fn slot_insert(key: &CtKey, entry: &CtEntry, mask: u32) -> bool {
    if slot_find(key, mask).is_some() {
        return false;
    }
    let (first, second, tag) = slot_buckets(key, mask);
    let (Some(a), Some(b)) = (
        FP_BENCH_HEADS.get_ptr_mut(first),
        FP_BENCH_HEADS.get_ptr_mut(second),
    ) else {
        return false;
    };
    let (bucket, heads) = if room(b) > room(a) {
        (second, b)
    } else {
        (first, a)
    };
    let mut i = 0;
    // verifier: a constant bound.
    while i < BUCKET_SLOTS {
        // SAFETY: an aligned word of a valid array value.
        let h = unsafe { &raw mut (*heads)[i] };
        // SAFETY: as above; BPF's compare-and-swap on map memory.
        let claimed = unsafe {
            core::ptr::read_volatile(h) == SLOT_FREE
                && core::intrinsics::atomic_cxchg::<
                    u64,
                    { core::intrinsics::AtomicOrdering::Relaxed },
                    { core::intrinsics::AtomicOrdering::Relaxed },
                >(h, SLOT_FREE, SLOT_CLAIMED)
                .1
        };
        if claimed {
            let Some(s) = FP_BENCH_SLOTS.get_ptr_mut(bucket * BUCKET_SLOTS as u32 + i as u32)
            else {
                // Cannot be (the slots are the heads' multiple); the claim is given back.
                // SAFETY: as above; the head is this CPU's.
                unsafe { core::ptr::write_volatile(h, SLOT_FREE) };
                return false;
            };
            // SAFETY: the slot is this CPU's until it is published below.
            unsafe {
                (*s).key = *key;
                (*s).entry = *entry;
                // Published after its contents: lookups read the head first (x86 keeps
                // stores in order; a weakly ordered CPU would want a release store here).
                core::sync::atomic::compiler_fence(core::sync::atomic::Ordering::Release);
                core::ptr::write_volatile(h, SLOT_LIVE | tag);
            }
            return true;
        }
        i += 1;
    }
    false
}

/// Free slots in a bucket, counted without branches: one verifier state whatever the heads.
#[inline(always)]
fn room(heads: *const CtBucket) -> u64 {
    let mut n = 0;
    let mut i = 0;
    while i < BUCKET_SLOTS {
        // SAFETY: an aligned word of a valid array value.
        let state = unsafe { core::ptr::read_volatile(&raw const (*heads)[i]) } & 0xffff_ffff;
        // 1 when the state is zero (free), by the borrow into the top bit.
        n += state.wrapping_sub(1) >> 63;
        i += 1;
    }
    n
}
