//! LB stage: finds the service a new connection is for, picks its backend from the service's
//! selection table, and counts per service and per backend. The conntrack stage calls it for
//! packets that have no connection yet and keeps the result (the NAT binding) in the entry, so
//! an established connection stays on its backend whatever happens to the service later.

use aya_ebpf::{cty::c_void, helpers::bpf_loop};
use fastpath_common::{
    ct::CtKey,
    lb::{
        Affinity, AffinityKey, BACKEND_F_ENABLED, Backend, BackendLoad, LEASTCONN_MAX_BACKENDS,
        SVC_F_GATEWAY, SVC_F_LEASTCONN, SVC_F_WRR, Service, flow_hash,
    },
};

use crate::{
    ctx::{End, LeastScan, NO_BACKEND},
    maps::{
        FP_AFF_KEY, FP_AFFINITY, FP_BACKEND_GONE, FP_BACKEND_LOAD, FP_BACKENDS, FP_LB_SLOTS,
        FP_NEW_SVC, FP_SVC, FP_SVC_KEY, FP_SVC_RR, array_at,
    },
    packet::Packet,
    parse::{FAMILY_IPV4, Parsed},
};

/// [`fastpath_common::global_names::HAVE_BPF_LOOP`]: 1 unless the loader says the kernel
/// lacks `bpf_loop`. Read through [`have_bpf_loop`] only.
#[unsafe(no_mangle)]
static FP_HAVE_BPF_LOOP: u8 = 1;

/// Whether the least-connections scan may run (see `FP_HAVE_BPF_LOOP`). verifier: a load
/// from the frozen read-only map, which it knows the value of, so where it is 0 the scan is
/// dead code it never checks; volatile, or LLVM would fold the object's initial value in.
#[inline(always)]
fn have_bpf_loop() -> bool {
    // SAFETY: a plain read of an immutable static.
    unsafe { core::ptr::read_volatile(&raw const FP_HAVE_BPF_LOOP) != 0 }
}

/// The service the packet's destination (address, port, protocol) names, if any.
#[inline(always)]
pub fn service(pkt: &Packet, p: &Parsed) -> Option<&'static Service> {
    let key = FP_SVC_KEY.get_ptr_mut(0)?;
    // SAFETY: this CPU's slot of a per-CPU array, used by this program run only.
    let key = unsafe { &mut *key };
    load_addr(pkt, p, End::Dst, &mut key.vip)?;
    key.port = p.dst_port;
    key.proto = p.l4_proto;
    key.family = p.family;
    key._pad = [0; 4];
    let key: &fastpath_common::lb::SvcKey = key;
    let found = FP_SVC.get_ptr(key)?;
    // verifier: the service is copied to the per-CPU scratch that gateway connections use
    // too, so the new-connection path after it sees one pointer type, not two: states from
    // both arrive alike and are pruned instead of doubled.
    let svc = FP_NEW_SVC.get_ptr_mut(0)?;
    let (from, to) = (found.cast::<u64>(), svc.cast::<u64>());
    let mut i = 0;
    while i < core::mem::size_of::<Service>() / 8 {
        // SAFETY: both are whole, 8-aligned `Service`s (a map value and this CPU's scratch
        // slot); any bits of a Service are valid.
        unsafe { core::ptr::write_volatile(to.add(i), core::ptr::read_volatile(from.add(i))) };
        i += 1;
    }
    // SAFETY: this CPU's slot, used by this program run only.
    Some(unsafe { &*svc })
}

/// Copies the packet's source or destination address into a 16-byte key field (IPv4 in the
/// first 4 bytes, the rest zero) with two word stores. perf: a `[u8; 16]` copy or a `[0; 16]`
/// assignment compiles to an out-of-line memmove/memset call. `dst` must be 8-aligned (every
/// address field of the LB keys is, at offset 0 of an `align(8)` struct).
#[inline(always)]
fn load_addr(pkt: &Packet, p: &Parsed, end: End, dst: &mut [u8; 16]) -> Option<()> {
    let l3 = p.l3_off as usize;
    let words = (dst as *mut [u8; 16]).cast::<u64>();
    let (w0, w1) = if p.family == FAMILY_IPV4 {
        let a = pkt.load::<[u8; 4]>(l3 + if end == End::Dst { 16 } else { 12 })?;
        (u64::from_ne_bytes([a[0], a[1], a[2], a[3], 0, 0, 0, 0]), 0)
    } else {
        let off = l3 + if end == End::Dst { 24 } else { 8 };
        (
            u64::from_ne_bytes(pkt.load::<[u8; 8]>(off)?),
            u64::from_ne_bytes(pkt.load::<[u8; 8]>(off + 8)?),
        )
    };
    // SAFETY: `dst` is 16 bytes and 8-aligned (see above).
    unsafe {
        core::ptr::write_volatile(words, w0);
        core::ptr::write_volatile(words.add(1), w1);
    }
    Some(())
}

/// The backend for the connection with (normalized) key `key`: slot `hash(key) % slots_len`
/// of the service's selection table. `None` when the service has no backend.
#[inline(always)]
pub fn pick(svc: &Service, key: &CtKey) -> Option<(u32, &'static Backend)> {
    if svc.slots_len == 0 {
        return None;
    }
    // Without `bpf_loop` the daemon writes no least-connections service; should one be there
    // all the same, its one-slot table below sends every connection to its first backend,
    // whatever that backend's state.
    if svc.flags & SVC_F_LEASTCONN != 0 && have_bpf_loop() {
        return least_connections(svc);
    }
    let pick = if svc.flags & SVC_F_WRR != 0 {
        let rr = FP_SVC_RR.get_ptr_mut(svc.id)?;
        // SAFETY: this CPU's slot of a per-CPU array, which nothing else writes meanwhile.
        unsafe {
            let n = *rr;
            *rr = n.wrapping_add(1);
            n
        }
    } else {
        flow_hash(key)
    };
    let slot = svc.slots_off.wrapping_add(pick % svc.slots_len);
    let pair = FP_LB_SLOTS.get(slot >> 1)?;
    let idx = pair[(slot & 1) as usize];
    let b = FP_BACKENDS.get_ptr(idx)?;
    // SAFETY: an array map value pointer stays valid for this program run.
    Some((idx, unsafe { &*b }))
}

/// [`pick`], honouring the service's source-IP affinity: a client whose last new connection
/// to the service was less than `affinity_s` ago goes back to that backend if it still takes
/// connections; the choice is remembered either way.
#[inline(always)]
pub fn pick_for_client(
    svc: &Service,
    key: &CtKey,
    pkt: &Packet,
    p: &Parsed,
    now: u64,
) -> Option<(u32, &'static Backend)> {
    if svc.flags & SVC_F_GATEWAY != 0 {
        return crate::gateway::destination();
    }
    if svc.affinity_s == 0 {
        return pick(svc, key);
    }
    let ak = FP_AFF_KEY.get_ptr_mut(0)?;
    // SAFETY: this CPU's slot of a per-CPU array, used by this program run only.
    let ak = unsafe { &mut *ak };
    load_addr(pkt, p, End::Src, &mut ak.client)?;
    ak.service = svc.id;
    // perf: the family and the padding as one word (a 3-byte zeroing compiles to an
    // out-of-line `memset` call). SAFETY: `family` starts the key's last 4 bytes, 4-aligned
    // (asserted in fastpath-common); little-endian, so the family is the word's low byte.
    unsafe {
        (&raw mut ak.family)
            .cast::<u32>()
            .write(u32::from(p.family))
    };
    let ak: &AffinityKey = ak;
    let window = u64::from(svc.affinity_s) * 1_000_000_000;
    if let Some(a) = FP_AFFINITY.get_ptr_mut(ak) {
        // SAFETY: a valid map value pointer for this run.
        let a = unsafe { &mut *a };
        let idx = a.backend;
        let in_range = idx >= svc.backends_off && idx - svc.backends_off < svc.backends_len;
        if now.saturating_sub(a.last_ns) <= window
            && in_range
            && let Some(b) = FP_BACKENDS.get_ptr(idx)
        {
            // SAFETY: an array map value pointer stays valid for this program run.
            let b = unsafe { &*b };
            if b.flags & BACKEND_F_ENABLED != 0 {
                a.last_ns = now;
                return Some((idx, b));
            }
        }
    }
    let (idx, b) = pick(svc, key)?;
    let _ = FP_AFFINITY.insert(
        ak,
        &Affinity {
            backend: idx,
            _pad: 0,
            last_ns: now,
        },
        0,
    );
    Some((idx, b))
}

/// The active connections of a backend with counters `load` (none: counted as full) and
/// `gone` connections expired: given − closed − expired. Torn reads of the two counters,
/// which other CPUs add to, are harmless (a momentary ±1).
#[inline(always)]
fn active(load: Option<&BackendLoad>, gone: u64) -> u64 {
    match load {
        Some(l) => l.opened.saturating_sub(l.closed).saturating_sub(gone),
        None => u64::MAX,
    }
}

/// Weighted least connections over the service's backends (at most
/// `LEASTCONN_MAX_BACKENDS`, checked by the daemon): the enabled one with the smallest
/// active / weight; ties go to the first.
///
/// verifier: a `bpf_loop` (Linux 5.17), whose step the verifier checks once, not once per
/// backend and path: unrolled, the scan alone cost it about 110,000 instructions on 6.18 and
/// took `fastpath_tc_lb` past the million-instruction limit on 6.1.
#[inline(always)]
fn least_connections(svc: &Service) -> Option<(u32, &'static Backend)> {
    let mut scan = LeastScan {
        next: svc.backends_off,
        best: NO_BACKEND,
        best_load: 0,
    };
    let n = if svc.backends_len < LEASTCONN_MAX_BACKENDS {
        svc.backends_len
    } else {
        LEASTCONN_MAX_BACKENDS
    };
    // SAFETY: `least_step` has the callback's signature; `scan` outlives the call, which runs
    // the steps synchronously.
    unsafe {
        bpf_loop(
            n,
            least_step as *mut c_void,
            (&raw mut scan).cast::<c_void>(),
            0,
        )
    };
    if scan.best == NO_BACKEND {
        return None;
    }
    let b = FP_BACKENDS.get_ptr(scan.best)?;
    // SAFETY: an array map value pointer stays valid for this program run.
    Some((scan.best, unsafe { &*b }))
}

/// Active connections as a scan keeps them: 48 bits (a backend without counters, counted as
/// full, stays the largest).
const ACTIVE_MAX: u64 = (1 << 48) - 1;

/// One step of [`least_connections`]: the next backend of the scan `ctx` (a [`LeastScan`]).
/// Returns 0: the scan goes on.
#[inline(never)]
extern "C" fn least_step(_i: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `bpf_loop` passes the context `least_connections` gave it, a live LeastScan.
    let scan = unsafe { &mut *ctx.cast::<LeastScan>() };
    consider(scan);
    scan.next = scan.next.wrapping_add(1);
    0
}

/// Whether backend `scan.next` is better than the scan's best so far; if so, it becomes it.
#[inline(always)]
fn consider(scan: &mut LeastScan) {
    // verifier: every lookup's key is the context's (see `maps::array_at`).
    let key = &scan.next;
    let Some(b) = array_at(&FP_BACKENDS, key) else {
        return;
    };
    if b.flags & BACKEND_F_ENABLED == 0 || b.weight == 0 {
        return;
    }
    let gone = array_at(&FP_BACKEND_GONE, key).copied().unwrap_or(0);
    let a = active(array_at(&FP_BACKEND_LOAD, key), gone).min(ACTIVE_MAX);
    let w = u64::from(b.weight);
    let (best_a, best_w) = (scan.best_load >> 16, scan.best_load & 0xffff);
    // a / w < best_a / best_w, without division: below 2^48 times below 2^16, no overflow.
    if scan.best == NO_BACKEND || a * best_w < best_a * w {
        scan.best = scan.next;
        scan.best_load = a << 16 | w;
    }
}
