//! The flow cache at XDP (`FP_FLOW`, see `fastpath_common::ct::FlowSlot`): a per-CPU,
//! direct-mapped copy of the entries of steady connections, probed before the conntrack
//! table. perf: the probe reads the slot's tag (`FP_FLOW_TAG`, which stays in the CPU's cache),
//! then, only where the tag matches, the slot and a five-word key compare: array lookups the
//! verifier inlines. The table's lookup is a call into the kernel's hash (jhash of the 40-byte
//! key, a bucket walk, a `memcmp`), about 30 ns more per packet here.
//!
//! Invariants:
//! - A copy serves only *steady* packets of a *steady* entry (see [`lookup`]), which change
//!   nothing in the entry but its counters, its last-seen stamp and its kept next hop. So the
//!   TCP state machine, events, flags and everything the daemon replicates run on the table
//!   only, and the copy's writes are limited to those three.
//! - A copy is valid while its slot's epoch (`FP_FLOW_EPOCH`, shared by all CPUs) is the one
//!   it was filled under and its lease has not ended. Whoever removes or replaces an entry, or
//!   moves it out of its steady state, does that first and bumps the epoch of the key's slot
//!   after ([`changed`]); a filler reads the epoch before it reads the entry. So a copy made
//!   from the entry as it was before a change is invalid once the change is visible.
//! - The packet that fills a slot runs on the table's entry (it is counted there), so an
//!   entry a copy serves has counted at least one packet of this node (`untouched` in HA
//!   installs stays exact).
//! - The copy's counters are deltas (zero at fill). They are added to the table's entry of the
//!   same connection (same `created_ns`) when a steady packet next finds the slot not serving
//!   (lease over, epoch bumped) and refills it or takes it for another connection, with a next
//!   hop the copy learned again; readers in the daemon add the counts meanwhile, whatever the
//!   epoch (`FlowSlot::deltas_for`). The lease is the last-seen step, so a busy connection's
//!   stamp in the table trails its last packet by at most two steps (`LAST_SEEN_SLACK_NS`, which
//!   the expiry allows for).

use fastpath_common::ct::{
    CT_F_ASSURED, CT_F_DSR, CT_F_LB_ALIAS, CT_F_SEEN_REPLY, CtEntry, CtKey, DIR_ORIGINAL,
    DIR_REPLY, FLOW_SLOTS, FlowSlot, LAST_SEEN_STEP_NS, ct_stat, flow_hash, flow_slot, flow_tag,
    hop_clock, hop_holds_at, slot_of, tcp_state,
};
use fastpath_common::route::ROUTE_CACHE_TTL_NS;

use crate::{
    fib,
    maps::{FP_CT, FP_CT_STATS, FP_FLOW, FP_FLOW_EPOCH, FP_FLOW_NOTE, FP_FLOW_TAG},
    parse::{IPPROTO_TCP, IPPROTO_UDP},
};

/// The entry a steady packet (see `conntrack::steady`; other packets go to the table without
/// this probe) of `key` (its source on the `lo` side if `src_is_lo`) works on at `now`: this
/// CPU's copy if the slot holds the connection under a live lease; otherwise the table's
/// entry, if any. On the way to the table it folds the slot's counts into their entry and, if
/// the entry is steady, fills the slot (when it is free, this connection's, or its lease is
/// over).
#[inline(always)]
pub fn lookup(key: &CtKey, src_is_lo: bool, now: u64) -> Option<*mut CtEntry> {
    let h = flow_hash(key);
    let (idx, tag) = (slot_of(h), flow_tag(h));
    let (Some(tags), Some(epoch)) = (FP_FLOW_TAG.get_ptr_mut(0), FP_FLOW_EPOCH.get_ptr(idx)) else {
        return FP_CT.get_ptr_mut(key);
    };
    // SAFETY: this CPU's value of a per-CPU array, written by this program run only (XDP runs
    // one packet at a time per CPU); `idx` is masked to the array's length.
    let tagged = unsafe { &mut (*tags)[idx as usize & (FLOW_SLOTS as usize - 1)] };
    // Read before the table (see the module's invariants).
    // SAFETY: a valid, aligned array value pointer.
    let epoch = unsafe { core::ptr::read_volatile(epoch) };
    let mine = *tagged == tag;
    if mine
        && let Some(slot) = FP_FLOW.get_ptr_mut(idx)
        // SAFETY: this CPU's slot, as the tags (the daemon only reads it).
        && let s = unsafe { &mut *slot }
        && s.key.words() == key.words()
        && leased(s, epoch, now)
        // A direct-server-return connection's first reply, if one comes this way, marks it
        // replied (an event): the table's to see.
        && (s.entry.flags & (CT_F_DSR | CT_F_SEEN_REPLY) != CT_F_DSR
            || s.entry.dir(src_is_lo) == DIR_ORIGINAL)
    {
        if let Some(c) = FP_CT_STATS.get_ptr_mut(ct_stat::FLOW_HITS) {
            // SAFETY: this CPU's slot of a per-CPU array.
            unsafe { *c += 1 };
        }
        // The pipeline learns what it does to the packet (`express::noted`), for the
        // connection's next packets.
        if let Some(n) = FP_FLOW_NOTE.get_ptr_mut(0) {
            // SAFETY: this CPU's slot of a per-CPU array, used by this program run only.
            unsafe {
                (*n).slot = idx + 1;
                (*n).dir = served_dir(&s.entry, src_is_lo) as u32;
            }
        }
        return Some(&raw mut s.entry);
    }
    let found = FP_CT.get_ptr_mut(key);
    // The slot matters only if it may hold this connection (to fold its counts) or this
    // packet's entry may take it; a new flow's probe ends here, having read the tag alone.
    let steady = match found {
        // SAFETY: a value pointer of the table, valid for this program run.
        Some(e) => steady_entry(unsafe { &*e }, key, src_is_lo, now),
        None => false,
    };
    if !mine && !steady {
        return found;
    }
    let Some(slot) = FP_FLOW.get_ptr_mut(idx) else {
        return found;
    };
    // SAFETY: as above.
    let s = unsafe { &mut *slot };
    let same = mine && s.key.words() == key.words();
    if !same && leased(s, epoch, now) {
        // Another connection's lease: it keeps the slot until the lease ends (two busy
        // connections on one slot do not take it from each other at every packet).
        return found;
    }
    if s.filled_ns != 0 {
        let into = if same {
            found
        } else if s.entry.packets[0] | s.entry.packets[1] != 0 {
            FP_CT.get_ptr_mut(&s.key)
        } else {
            None
        };
        fold(s, into);
        *tagged = 0;
    }
    if steady && let Some(e) = found {
        // SAFETY: as above.
        fill(s, key, unsafe { &*e }, epoch, now);
        *tagged = tag;
    }
    found
}

/// The direction of entry `e` a steady packet (its source on the key's `lo` side if
/// `src_is_lo`) counts in: an alias's packets are its reply direction's (see
/// `conntrack::lb_reply`).
#[inline(always)]
pub fn served_dir(e: &CtEntry, src_is_lo: bool) -> usize {
    if e.flags & CT_F_LB_ALIAS != 0 {
        DIR_REPLY
    } else {
        e.dir(src_is_lo)
    }
}

/// Whether slot `s` serves: filled under `epoch` (its slot's, read now) and within its lease.
#[inline(always)]
pub fn leased(s: &FlowSlot, epoch: u64, now: u64) -> bool {
    s.filled_ns != 0 && s.epoch == epoch && now.wrapping_sub(s.filled_ns) < LAST_SEEN_STEP_NS
}

/// Whether entry `e` of `key` may be served from a copy to a steady packet (its source on the
/// `lo` side if `src_is_lo`): an assured alias (`conntrack::lb_reply` takes the backend's
/// steady packets on it alone), or a connection that saw a reply and is assured and, for TCP,
/// established; and the packet's direction has a next hop kept that holds at `now` in the
/// current route generation (else the packet re-learns it in the table, after the copy was
/// made, and the copy's first packet would ask the FIB again).
#[inline(always)]
fn steady_entry(e: &CtEntry, key: &CtKey, src_is_lo: bool, now: u64) -> bool {
    let dir = if e.flags & CT_F_LB_ALIAS != 0 {
        if e.flags & CT_F_ASSURED == 0 {
            return false;
        }
        DIR_REPLY
    } else {
        // A direct-server-return connection sees no reply (its client's ACK established and
        // assured it); its replies, if any come this way, go to the table (see `lookup`).
        let need = if e.flags & CT_F_DSR != 0 {
            CT_F_ASSURED
        } else {
            CT_F_ASSURED | CT_F_SEEN_REPLY
        };
        if e.flags & need != need
            || !(key.proto == IPPROTO_UDP
                || (key.proto == IPPROTO_TCP && e.state == tcp_state::ESTABLISHED))
        {
            return false;
        }
        e.dir(src_is_lo)
    };
    let hop = &e.hops[dir & 1];
    hop.in_ifindex != 0
        && hop.generation == fib::generation() as u16
        && hop_holds_at(hop.until, hop_clock(now), hop_clock(ROUTE_CACHE_TTL_NS))
}

/// Adds the slot's counts to `into` (their connection's entry in the table, if it is the same
/// connection) and empties the slot.
#[inline(always)]
fn fold(s: &mut FlowSlot, into: Option<*mut CtEntry>) {
    s.filled_ns = 0;
    let c = &s.entry;
    let Some(e) = into else {
        return;
    };
    // SAFETY: a value pointer of the table, valid for this program run.
    let e = unsafe { &mut *e };
    if e.created_ns != c.created_ns {
        // A later connection on the same tuple: the counts were its predecessor's.
        return;
    }
    // Atomic: other CPUs count this connection's packets in the entry meanwhile, and a lost
    // fold would lose a whole lease's packets, not one.
    for (to, add) in [
        (&raw mut e.packets[0], c.packets[0]),
        (&raw mut e.packets[1], c.packets[1]),
        (&raw mut e.bytes[0], c.bytes[0]),
        (&raw mut e.bytes[1], c.bytes[1]),
    ] {
        if add != 0 {
            // SAFETY: an 8-aligned word of a map value.
            unsafe {
                core::intrinsics::atomic_xadd::<
                    u64,
                    u64,
                    { core::intrinsics::AtomicOrdering::Relaxed },
                >(to, add);
            }
        }
    }
    if c.last_seen_ns > e.last_seen_ns {
        e.last_seen_ns = c.last_seen_ns;
    }
    // A next hop the copy learned again (a new route generation, its second ran out) goes to
    // the table too, or the packet that refills the slot would ask the FIB once more. The
    // later `until` wins; both are answers the route stage still checks before use.
    for d in 0..2 {
        let (from, to) = (&c.hops[d], &mut e.hops[d]);
        if from.in_ifindex != 0 && (from.until.wrapping_sub(to.until) as i32) > 0 {
            *to = *from;
        }
    }
}

/// Makes the slot a copy of entry `e` of `key` under `epoch`, its lease starting at `now`.
#[inline(always)]
fn fill(s: &mut FlowSlot, key: &CtKey, e: &CtEntry, epoch: u64, now: u64) {
    const WORDS: usize = core::mem::size_of::<CtEntry>() / 8;
    const _: () = assert!(core::mem::size_of::<CtEntry>() % 8 == 0);
    let from = (e as *const CtEntry).cast::<u64>();
    let to = (&raw mut s.entry).cast::<u64>();
    // perf: word by word (a struct copy this large is an out-of-line `memcpy` call).
    let mut i = 0;
    while i < WORDS {
        // SAFETY: both are 8-aligned `CtEntry`s in map memory; `i` stays within them.
        unsafe { core::ptr::write_volatile(to.add(i), core::ptr::read_volatile(from.add(i))) };
        i += 1;
    }
    s.entry.packets = [0; 2];
    s.entry.bytes = [0; 2];
    s.key = *key;
    s.epoch = epoch;
    // 0 means empty (the coarse clock is not 0 after boot). Never later than `now`: a packet
    // in the same tick reads the same time, and must find the lease live.
    s.filled_ns = now.max(1);
}

/// Says that the entry of `key` was just removed, replaced, or left its steady state: every
/// CPU's copy in its slot stops serving. Called after the change (see the module's
/// invariants).
#[inline(always)]
pub fn changed(key: &CtKey) {
    if let Some(w) = FP_FLOW_EPOCH.get_ptr_mut(flow_slot(key)) {
        // SAFETY: an aligned word of an array value; atomic, as other CPUs and the daemon bump
        // it too.
        unsafe {
            core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(
                w, 1,
            );
        }
    }
}
