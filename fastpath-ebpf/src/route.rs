//! L3 stage: IPv4 and IPv6 routing in the fast path, on interfaces with `route = true`.
//!
//! A packet addressed to this interface's MAC address is looked up in the kernel's FIB
//! (`bpf_fib_lookup`, with its neighbour table, policy rules and egress MTU); when the route
//! leaves through another routing interface and the next hop is resolved, the TTL / hop limit
//! goes down by one (IPv4 checksum updated incrementally), the MAC addresses become the next
//! hop's and the egress interface's, and the packet is redirected there. Everything else is
//! the kernel's, with a reason: TTL expiry (it sends the ICMP error), local delivery and
//! broadcast, unresolved neighbours (it resolves them), unreachable routes, MTU exceeded,
//! IPv4 options and IPv6 extension headers, fragments, VLAN-tagged frames, martian addresses.
//!
//! The FIB's answer is cached per flow (`FP_ROUTE_CACHE`, see `fastpath_common::route`): a
//! flow's later packets take it from there, a hash lookup instead of the FIB's walk of
//! rules, tries and the neighbour table, until the generation changes (any route,
//! neighbour, link or configuration change) or a second passes. The per-packet checks above
//! (TTL, addresses, fragments, options, the egress interface's settings, the length against
//! what is known to fit) run on every packet, cached or not.

use fastpath_common::{
    Hook, TAIL_VLAN_FORWARD, TAIL_VXLAN_ENCAP, csum,
    ct::{
        CtHop, IFACE_F_ROUTE, IFACE_F_ROUTE_TC, IFACE_F_VLAN_TC, IFACE_F_VLAN_XDP, IFACE_F_VXLAN,
        hop_clock, hop_holds_at,
    },
    reason,
    route::{GEN_F_FIB_PER_DST, ROUTE_CACHE_TTL_NS, route_stat},
};

use aya_ebpf::{
    bindings::__sk_buff,
    helpers::{bpf_redirect, bpf_redirect_peer},
};

use crate::{
    clock,
    ctx::{
        BACKEND_HOP_SLOTS, BackendHop, FibParams, HopRef, NO_BACKEND, RouteLearning, copy_words,
        words,
    },
    fib,
    maps::{
        FP_BACKEND_HOP, FP_HOP, FP_IFACE, FP_NAT, FP_PEER, FP_ROUTE_CACHE, FP_ROUTE_LEARN,
        FP_ROUTE_STATS, FP_TX_PORTS,
    },
    packet::Packet,
    parse::{FAMILY_IPV4, IPPROTO_TCP, Parsed},
};

/// `ROUTE_CACHE_TTL_NS` in a kept hop's clock unit (`CtHop::until`), rounded down.
const HOP_TTL: u32 = hop_clock(ROUTE_CACHE_TTL_NS);

/// `bpf_fib_lookup` results (`BPF_FIB_LKUP_RET_*`).
const FIB_BLACKHOLE: i64 = 1;
const FIB_UNREACHABLE: i64 = 2;
const FIB_PROHIBIT: i64 = 3;
const FIB_NOT_FWDED: i64 = 4;
const FIB_FWD_DISABLED: i64 = 5;
const FIB_NO_NEIGH: i64 = 7;
const FIB_FRAG_NEEDED: i64 = 8;

/// Routes the packet that arrived on `ifindex` at `hook` (XDP or TC ingress) at `now`
/// (`clock::now`; 0: not read yet), with the next hop its connection keeps for its direction (`hop`) when that
/// holds — else the route cache's or the FIB's answer, then kept there: `Ok` when it
/// is ready to be redirected to [`out_ifindex`] (TTL and MAC addresses rewritten), else the
/// reason it goes to the kernel unchanged — [`reason::NONE`] when `ifindex` does not route
/// at this hook.
#[inline(always)]
pub fn forward(
    pkt: &Packet,
    p: &Parsed,
    hook: Hook,
    ifindex: u32,
    now: u64,
    hop: &HopRef,
) -> Result<(), u32> {
    let Some(iface) = FP_IFACE.get(ifindex) else {
        return Err(reason::NONE);
    };
    let here = if hook == Hook::Xdp {
        IFACE_F_ROUTE
    } else {
        IFACE_F_ROUTE_TC
    };
    if iface.flags & here == 0 {
        return Err(reason::NONE);
    }
    // Not addressed to this interface (a frame seen in promiscuous mode, multicast,
    // broadcast) or tagged: the kernel decides.
    let dst: [u8; 6] = pkt.load(0).ok_or(reason::ROUTE_NOT_FOR_US)?;
    if dst != iface.mac || p.vlan_count != 0 {
        return Err(reason::ROUTE_NOT_FOR_US);
    }
    if p.fragment != 0 {
        return Err(reason::ROUTE_FRAGMENT);
    }
    let v4 = p.family == FAMILY_IPV4;
    let l3 = p.l3_off as usize;
    if p.l4_off - p.l3_off != if v4 { 20 } else { 40 } {
        return Err(reason::ROUTE_IP_OPTIONS);
    }
    // IPv4: TTL, protocol and the header checksum (bytes 8-11); IPv6: next header and hop
    // limit (bytes 6-7). verifier: loads of 2+ bytes (a 1-byte load's bounds check compiles
    // to a comparison the verifier does not take as a range).
    let hdr: [u8; 4] = if v4 {
        pkt.load(l3 + 8).ok_or(reason::ROUTE_OTHER)?
    } else {
        let h: [u8; 2] = pkt.load(l3 + 6).ok_or(reason::ROUTE_OTHER)?;
        [h[1], h[0], 0, 0]
    };
    let ttl = hdr[0];
    // verifier: after the loads above (read first, their bounds checks are not folded into
    // these wider ones).
    if martian(pkt, l3, v4).unwrap_or(true) {
        return Err(reason::ROUTE_MARTIAN);
    }
    if ttl <= 1 {
        return Err(reason::ROUTE_TTL_EXPIRED);
    }
    // A GRO aggregate (TC only) is many packets in one: the FIB checks the egress MTU
    // against its segments rather than its length (asked with no length, it checks the skb).
    let gso_size = gso_size(pkt, hook);
    let tot_len = if gso_size == 0 {
        (p.l3_end - p.l3_off) as u16
    } else {
        0
    };
    let now = if now == 0 { clock::now() } else { now };
    // SAFETY: a live conntrack entry's hop (valid for this program run) or this CPU's
    // scratch one; racing writers store whole answers of the same flow (see `keep`).
    let known = unsafe { &mut *hop.hop };
    let generation = fib::generation();
    if gso_size == 0 && holds_or_shared(hop, known, ifindex, now, generation, tot_len, p.family) {
        if !rewrite(pkt, l3, v4, hdr, known.macs) {
            return Err(reason::ROUTE_OTHER);
        }
        count(route_stat::HIT);
        redirect_to(u32::from(known.out_ifindex));
        return Ok(());
    }
    let f = fib::question(pkt, p, ifindex, false).ok_or(reason::ROUTE_OTHER)?;
    // A connection's direction keeps its route in its entry: the route cache serves the
    // packets that have none (untracked, or a GRO aggregate, whose segments the cache's
    // check covers).
    let via_cache = !hop.in_entry || gso_size != 0;
    // verifier: a hit writes its answer where the FIB writes its own, so both ways join with
    // the same state below.
    let fits =
        if via_cache && let Some(fits) = cached(f, pkt, p, gso_size, tot_len, now, generation) {
            fits
        } else {
            // The answer overwrites parts of the question (the next hop's address replaces the
            // destination): a route the cache learns has its key kept first.
            let learning = if via_cache {
                let Some(l) = FP_ROUTE_LEARN.get_ptr_mut(0) else {
                    return Err(reason::ROUTE_OTHER);
                };
                // SAFETY: this CPU's slot of a per-CPU array, used by this program run only.
                let l = unsafe { &mut *l };
                copy_words(&mut l.key, f.key());
                Some(l)
            } else {
                None
            };
            f.set_len(tot_len);
            match fib::answer(pkt, f, 0) {
                Ok(()) => {}
                Err(FIB_NOT_FWDED) => return Err(reason::ROUTE_NOT_FORWARDED),
                Err(FIB_NO_NEIGH) => return Err(reason::ROUTE_NO_NEIGHBOR),
                Err(FIB_FRAG_NEEDED) => return Err(reason::ROUTE_MTU),
                Err(FIB_BLACKHOLE | FIB_UNREACHABLE | FIB_PROHIBIT) => {
                    return Err(reason::ROUTE_UNREACHABLE);
                }
                Err(FIB_FWD_DISABLED) => return Err(reason::ROUTE_FORWARDING_OFF),
                Err(_) => return Err(reason::ROUTE_OTHER),
            }
            // The longest packet known to fit: the route's MTU when the answer has it (TC asked
            // with no length), else this packet's length.
            let fits = if f.mtu() > tot_len { f.mtu() } else { tot_len };
            if gso_size != 0 && !segments_fit(pkt, p, gso_size, fits) {
                return Err(reason::ROUTE_MTU);
            }
            match learning {
                Some(l) => learn(l, f, fits, now, generation),
                None => count(route_stat::MISS),
            }
            fits
        };
    let out = f.ifindex;
    match FP_IFACE.get(out) {
        // A VXLAN network's device: encapsulated by a tail program (the entry point's), when
        // the headers for the next hop are learned. The tail program checks for learned
        // headers and rewrites the packet itself (no stack room here); the FIB's answer
        // waits for it in this CPU's `FP_FIB`.
        Some(e) if e.flags & IFACE_F_VXLAN != 0 => {
            redirect_to(out);
            return Ok(());
        }
        Some(e) if e.flags & (IFACE_F_ROUTE | IFACE_F_ROUTE_TC) != 0 => {}
        _ => return Err(reason::ROUTE_EGRESS_NOT_ROUTED),
    }
    let macs = f.macs();
    if !rewrite(pkt, l3, v4, hdr, macs) {
        return Err(reason::ROUTE_OTHER);
    }
    if hop.in_entry {
        keep(
            hop,
            known,
            Kept {
                ifindex,
                out,
                fits,
                macs,
                now,
                generation,
                family: p.family,
            },
        );
    }
    redirect_to(out);
    Ok(())
}

/// Whether `known`, the next hop `hop` points at, holds for a packet that arrived on
/// `ifindex` at `now` in route `generation`: a connection's (not the scratch), learned for
/// that interface in that generation (its low 16 bits), not expired. The route cache's
/// rules; the length check is the caller's.
#[inline(always)]
pub fn holds(hop: &HopRef, known: &CtHop, ifindex: u32, now: u64, generation: u64) -> bool {
    hop.in_entry && kept_holds(known, ifindex, now, generation)
}

/// Whether a next hop kept for a connection's direction (`known`) holds for a packet that
/// arrived on `ifindex` at `now` in route `generation` (see [`holds`]).
#[inline(always)]
pub fn kept_holds(known: &CtHop, ifindex: u32, now: u64, generation: u64) -> bool {
    hop_holds_at(known.until, hop_clock(now), HOP_TTL)
        && known.generation == generation as u16
        && u32::from(known.in_ifindex) == ifindex
}

/// Whether the next hop `known` (which `hop` points at) holds for a packet that arrived on
/// `ifindex` at `now` in route `generation` and is `len` bytes long (IP; 0 for direct server
/// return, which keeps the frame's size) — or, for a new load-balanced connection's first
/// packet (of `family`), whether the route its backend's earlier new connections were told
/// holds ([`shared`]): copied into `known` then, as if this connection had asked the FIB.
#[inline(always)]
pub fn holds_or_shared(
    hop: &HopRef,
    known: &mut CtHop,
    ifindex: u32,
    now: u64,
    generation: u64,
    len: u16,
    family: u8,
) -> bool {
    if holds(hop, known, ifindex, now, generation) && len <= known.fits {
        return true;
    }
    let Some((s, to)) = shared(hop, generation) else {
        return false;
    };
    if !s.is_of(to, family) || !holds(hop, &s.hop, ifindex, now, generation) || len > s.hop.fits {
        return false;
    }
    *known = s.hop;
    true
}

/// This CPU's slot for the route of `hop`'s backend (`FP_BACKEND_HOP`) and the address the
/// packet is translated to (this CPU's NAT plan: the backend the LB stage picked, whatever the
/// daemon writes to the backend's index meanwhile), when the daemon says the FIB answers a forwarded packet by its arriving interface and
/// destination alone ([`GEN_F_FIB_PER_DST`] in `generation`: no policy rule selects by
/// source, ports, protocol or TOS, and no route is multipath). Then what one new connection
/// to a backend's address was told holds for the next, under a kept hop's rules (interface,
/// generation, a second); without it, every new connection asks the FIB.
#[inline(always)]
fn shared(hop: &HopRef, generation: u64) -> Option<(&'static mut BackendHop, [u64; 2])> {
    if hop.backend == NO_BACKEND || generation & GEN_F_FIB_PER_DST == 0 {
        return None;
    }
    let plan = FP_NAT.get(0)?;
    let s = FP_BACKEND_HOP.get_ptr_mut(hop.backend & (BACKEND_HOP_SLOTS - 1))?;
    // SAFETY: this CPU's slot of a per-CPU array; programs do not preempt each other on a CPU.
    Some((unsafe { &mut *s }, words(&plan.dst_addr)))
}

/// A route to keep in a connection's entry (see [`keep`]): learned for packets arriving on
/// `ifindex` at `now`, in route generation `generation`.
pub struct Kept {
    pub ifindex: u32,
    pub out: u32,
    pub fits: u16,
    pub macs: [u8; 12],
    pub now: u64,
    pub generation: u64,
    /// The packet's family (`parse::FAMILY_*`).
    pub family: u8,
}

/// Keeps a route in a connection's entry (`CtEntry::hops`) for the direction's next
/// packets, under the route cache's rules (`ROUTE_CACHE_TTL_NS`, the generation), its
/// generation written last: a reader on another CPU that sees it sees the rest (x86 keeps
/// stores in order; two CPUs keeping one direction's route write the same answer). An
/// interface whose ifindex does not fit the hop (see `CtHop`) is not kept: the direction
/// asks the FIB again.
/// A new connection's first packet (`hop`) shares it with its backend's next new connections
/// ([`shared`]).
#[inline(always)]
pub fn keep(hop: &HopRef, known: &mut CtHop, k: Kept) {
    let (Ok(ifindex), Ok(out)) = (u16::try_from(k.ifindex), u16::try_from(k.out)) else {
        return;
    };
    known.until = hop_clock(k.now).wrapping_add(HOP_TTL);
    known.in_ifindex = ifindex;
    known.out_ifindex = out;
    known.fits = k.fits;
    known.macs = k.macs;
    // SAFETY: a volatile store keeps the compiler from moving it before the others.
    // The entry keeps the generation's low 16 bits (see `holds`).
    unsafe { core::ptr::write_volatile(&raw mut known.generation, k.generation as u16) };
    if let Some((s, to)) = shared(hop, k.generation) {
        s.keep(to, k.family, known);
    }
}

/// This CPU's stand-in hop (`ctx::HopRef`) for a packet without a connection entry.
#[inline(always)]
pub fn scratch_hop() -> Option<HopRef> {
    Some(HopRef {
        hop: FP_HOP.get_ptr_mut(0)?,
        in_entry: false,
        backend: NO_BACKEND,
    })
}

#[inline(always)]
pub fn count(outcome: u32) {
    if let Some(c) = FP_ROUTE_STATS.get_ptr_mut(outcome) {
        // SAFETY: this CPU's slot of a per-CPU array.
        unsafe { *c += 1 };
    }
}

/// Whether the route cache answers the FIB question in `f` — an answer of `generation`,
/// not expired, for which the packet (`tot_len` bytes, or a GRO aggregate of `gso_size`
/// segments) is known to fit — and then writes it into `f` as the FIB would, and gives the
/// longest packet known to fit. Counted.
#[inline(always)]
fn cached(
    f: &mut FibParams,
    pkt: &Packet,
    p: &Parsed,
    gso_size: u32,
    tot_len: u16,
    now: u64,
    generation: u64,
) -> Option<u16> {
    let (outcome, fits) = match FP_ROUTE_CACHE.get_ptr(f.key()) {
        None => (route_stat::MISS, 0),
        Some(hop) => {
            // SAFETY: a live entry; `learn` replaces entries whole (a racing reader may mix
            // fields of two answers for one flow, both the FIB's within a generation).
            let hop = unsafe { &*hop };
            if hop.generation != generation || now > hop.expires_ns {
                (route_stat::STALE, 0)
            } else if !(if gso_size == 0 {
                tot_len <= hop.fits
            } else {
                segments_fit(pkt, p, gso_size, hop.fits)
            }) {
                (route_stat::MISS, 0)
            } else {
                f.set_answer(hop.out, hop.tail);
                (route_stat::HIT, hop.fits)
            }
        }
    };
    count(outcome);
    (outcome == route_stat::HIT).then_some(fits)
}

/// Caches the FIB's answer in `f` (packets up to `fits` bytes fit) under the question's key
/// `learning` kept, for the flow's next packets.
#[inline(always)]
fn learn(learning: &mut RouteLearning, f: &FibParams, fits: u16, now: u64, generation: u64) {
    let hop = &mut learning.hop;
    hop.generation = generation;
    hop.expires_ns = now + ROUTE_CACHE_TTL_NS;
    hop.out = f.ifindex;
    copy_words(&mut hop.tail, &f.tail);
    hop.fits = fits;
    // perf: an entry of an earlier generation is written in place (an insert allocates an
    // element and frees the old one: ~4× the lookup's cost), its generation last, so a
    // reader on another CPU that sees the new generation sees the new answer (x86 keeps
    // stores in order; two CPUs learning one flow at once write the same answer).
    if let Some(e) = FP_ROUTE_CACHE.get_ptr_mut(&learning.key) {
        // SAFETY: a live entry of the cache.
        let e = unsafe { &mut *e };
        e.expires_ns = hop.expires_ns;
        e.out = hop.out;
        e.fits = hop.fits;
        copy_words(&mut e.tail, &hop.tail);
        // SAFETY: a volatile store keeps the compiler from moving it before the others.
        unsafe { core::ptr::write_volatile(&raw mut e.generation, hop.generation) };
        return;
    }
    // A full cache evicts its least recently used flow; an error leaves the flow uncached.
    let _ = FP_ROUTE_CACHE.insert(&learning.key, &learning.hop, 0);
}

/// The segment size of a GRO aggregate (`skb->gso_size`; 0 for any other packet, and always
/// at XDP).
#[inline(always)]
pub fn gso_size(pkt: &Packet, hook: Hook) -> u32 {
    if hook == Hook::Xdp {
        return 0;
    }
    // SAFETY: at TC, the context is the kernel's __sk_buff for the duration of the program.
    unsafe { (*(pkt.ctx as *const __sk_buff)).gso_size }
}

/// Whether the segments of a GRO aggregate of `gso_size` payload bytes fit the egress `mtu`
/// with their IP and TCP (or UDP) headers, as the kernel checks before forwarding one.
#[inline(always)]
fn segments_fit(pkt: &Packet, p: &Parsed, gso_size: u32, mtu: u16) -> bool {
    let l4_hdr = if p.l4_proto == IPPROTO_TCP {
        // The data offset (bytes 12-13 of the TCP header; a 2-byte load for the verifier).
        match pkt.load::<[u8; 2]>(p.l4_off as usize + 12) {
            Some(b) => u32::from(b[0] >> 4) * 4,
            None => return false,
        }
    } else {
        8
    };
    gso_size + (p.l4_off - p.l3_off) + l4_hdr <= u32::from(mtu)
}

/// A routed packet's rewrite: TTL / hop limit one lower (`hdr` as `forward` read it, IPv4
/// checksum updated incrementally) and the next hop's MAC addresses (`macs`: destination,
/// source). Every write is to bytes read before, so none can fail once the first succeeded
/// (the checks stay for the verifier).
#[inline(always)]
pub fn rewrite(pkt: &Packet, l3: usize, v4: bool, hdr: [u8; 4], macs: [u8; 12]) -> bool {
    let ttl = hdr[0];
    let written = if v4 {
        let old = u16::from_be_bytes([ttl, hdr[1]]);
        let check = csum::replace2(u16::from_be_bytes([hdr[2], hdr[3]]), old, old - 0x0100);
        let [c0, c1] = check.to_be_bytes();
        pkt.store(l3 + 8, [ttl - 1, hdr[1], c0, c1])
    } else {
        pkt.store(l3 + 6, [hdr[1], ttl - 1])
    };
    written && store_macs(pkt, macs)
}

/// Writes an Ethernet header's first 12 bytes (`macs`: destination, source). perf: as an 8-
/// and a 4-byte store (a 12-byte array store compiles to an out-of-line byte loop).
#[inline(always)]
pub fn store_macs(pkt: &Packet, m: [u8; 12]) -> bool {
    pkt.store(0, [m[0], m[1], m[2], m[3], m[4], m[5], m[6], m[7]])
        && pkt.store(8, [m[8], m[9], m[10], m[11]])
}

/// Whether the packet has an address the kernel never forwards (the FIB lookup does not
/// look at the source, nor refuse these destinations): IPv4 source in 0/8, 127/8 or
/// 224/3 (multicast, reserved, broadcast), destination in 0/8 or 127/8; IPv6 source or
/// destination in ::/8 (unspecified, loopback, IPv4-mapped) or fe80::/10 (link-local),
/// source in ff00::/8 (multicast). `None`: the addresses are not readable.
#[inline(always)]
fn martian(pkt: &Packet, l3: usize, v4: bool) -> Option<bool> {
    if v4 {
        // Source and destination: bytes 12-19.
        // verifier: `load_now` keeps each read next to its bounds check.
        let a: [u8; 8] = pkt.load_now(l3 + 12)?;
        let (src, dst) = (a[0], a[4]);
        Some(src == 0 || src == 127 || src >= 224 || dst == 0 || dst == 127)
    } else {
        let src: [u8; 2] = pkt.load_now(l3 + 8)?;
        let dst: [u8; 2] = pkt.load_now(l3 + 24)?;
        let link_local = |a: [u8; 2]| a[0] == 0xfe && a[1] & 0xc0 == 0x80;
        Some(src[0] == 0 || src[0] == 0xff || dst[0] == 0 || link_local(src) || link_local(dst))
    }
}

/// Records `ifindex` as where this CPU's packet is redirected on a forward verdict.
#[inline(always)]
pub fn redirect_to(ifindex: u32) {
    if let Some(plan) = FP_NAT.get_ptr_mut(0) {
        // SAFETY: this CPU's slot of a per-CPU array, used by this program run only.
        unsafe { (*plan).out_ifindex = ifindex };
    }
}

/// The XDP action that sends this packet out of `out`: through the device map of the
/// routing interfaces (`FP_TX_PORTS`, which holds the device), else by ifindex (a lookup of
/// the device per packet).
#[inline(always)]
pub fn xdp_redirect(out: u32) -> u32 {
    match FP_TX_PORTS.redirect(out, 0) {
        Ok(action) => action,
        // SAFETY: bpf_redirect has no preconditions; it returns the XDP action to take.
        Err(_) => unsafe { bpf_redirect(out, 0) as u32 },
    }
}

/// Records `reason` as this CPU's forward verdict's, for a tail program to count it.
#[inline(always)]
pub fn hand_over(reason: u32) {
    if let Some(plan) = FP_NAT.get_ptr_mut(0) {
        // SAFETY: this CPU's slot of a per-CPU array, used by this program run only.
        unsafe { (*plan).fwd_reason = reason };
    }
}

/// The reason [`hand_over`] recorded.
#[inline(always)]
pub fn handed_over() -> u32 {
    match FP_NAT.get(0) {
        Some(plan) => plan.fwd_reason,
        None => reason::NONE,
    }
}

/// The interface a stage chose for this packet's forward verdict ([`redirect_to`]).
#[inline(always)]
pub fn out_ifindex() -> u32 {
    match FP_NAT.get(0) {
        Some(plan) => plan.out_ifindex,
        None => 0,
    }
}

/// The TC action for a packet forwarded at TC ingress out of `out`. A veth (or netkit) whose
/// peer lives in another namespace — a pod's or container's link — gets it straight into the
/// peer's ingress (`bpf_redirect_peer`, as Cilium and ONCache send to pods): no transmit on
/// `out`, no queueing on a CPU's backlog and no second softirq pass, so each packet costs
/// less and waits less. Skipped on `out` then: its qdisc and TC egress, which forwarded
/// packets need only on an 802.1Q port (the tag goes on there), so a port gets a plain
/// redirect.
#[inline(always)]
pub fn tc_redirect(out: u32) -> i32 {
    let peer = FP_PEER.get(out).is_some_and(|&p| p != 0)
        && FP_IFACE
            .get(out)
            .is_none_or(|i| i.flags & (IFACE_F_VLAN_XDP | IFACE_F_VLAN_TC) == 0);
    // SAFETY: both helpers have no preconditions; they return the TC action to take (a peer
    // redirect is checked by the kernel once the program returned: a device without a peer
    // in another namespace drops it, which FP_PEER rules out).
    unsafe {
        if peer {
            bpf_redirect_peer(out, 0) as i32
        } else {
            bpf_redirect(out, 0) as i32
        }
    }
}

/// Whether `out` is a vxlan device (a packet routed there is encapsulated by a tail program).
#[inline(always)]
pub fn egress_is_vxlan(out: u32) -> bool {
    FP_IFACE
        .get(out)
        .is_some_and(|i| i.flags & IFACE_F_VXLAN != 0)
}

/// The tail program a frame forwarded at XDP out of `out` needs first: an 802.1Q port's tag
/// (`TAIL_VLAN_FORWARD`), a vxlan device's outer headers (`TAIL_VXLAN_ENCAP`).
#[inline(always)]
pub fn egress_tail(out: u32) -> Option<u32> {
    let flags = FP_IFACE.get(out)?.flags;
    if flags & IFACE_F_VXLAN != 0 {
        Some(TAIL_VXLAN_ENCAP)
    } else if flags & (IFACE_F_VLAN_XDP | IFACE_F_VLAN_TC) != 0 {
        Some(TAIL_VLAN_FORWARD)
    } else {
        None
    }
}
