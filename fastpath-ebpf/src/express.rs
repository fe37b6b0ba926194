//! The express path at XDP: a steady packet of a connection whose flow-cache copy this CPU
//! holds (`flowcache.rs`) gets what the pipeline did to the connection's last packet in that
//! direction (`ctx::Express`, learned by [`learn`]): MAC addresses, addresses and ports, TTL,
//! checksums by their learned change, the same counters, the same redirect. perf: no parse
//! into the packet context, no stage dispatch, no NAT plan; a probe and one rewrite (the
//! pipeline's served packet costs about 1.6 times as much here: docs/BENCHMARKS.md).
//!
//! Invariants:
//! - The path takes only packets the pipeline would treat as the one the recipe was learned
//!   from: the same connection, direction and copy (the slot's `filled_ns`, under its lease
//!   and epoch, see `flowcache::leased`); untagged Ethernet, IPv4 without options or IPv6
//!   without extension headers, no fragment, TCP or UDP, a steady packet whose headers the
//!   parser would take (`parse.rs`: lengths, TCP data offset); the interface tracking at XDP
//!   (and routing, with the frame addressed to it, TTL > 1 and a length that fits, for a
//!   routed recipe); the next hop holding as the L3 stage checks it; no egress tail program.
//!   Every other packet takes the pipeline, which learns again when a copy serves it.
//! - It writes what the pipeline's served packet writes: the copy's counters and last-seen
//!   stamp, the same counters (`fp_stats`, conntrack's, the route's, the service's).
//! - Checksums change by the difference the pipeline made (mod 0xffff), so they come out
//!   as the pipeline's, and a UDP datagram without a checksum keeps none.

use fastpath_common::{
    Hook, Verdict, csum,
    ct::{
        CT_F_LB, CT_F_LB_ALIAS, DIR_ORIGINAL, FLOW_SLOTS, IFACE_F_CT_XDP, IFACE_F_ROUTE,
        IfaceConfig, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN, ct_stat, flow_hash_words, flow_tag,
        last_seen_moves, slot_of, tcp_flags_valid,
    },
    route::route_stat,
};

use crate::{
    clock, conntrack,
    ctx::Express,
    fib, flowcache,
    maps::{FP_EXPRESS, FP_FLOW, FP_FLOW_EPOCH, FP_FLOW_NOTE, FP_FLOW_TAG},
    packet::{Packet, be16, masked},
    parse::{ETH_HLEN, FAMILY_IPV4, FAMILY_IPV6, IPPROTO_TCP, IPPROTO_UDP, Parsed},
    route, stats,
};

/// Probes in a row that served nothing after which only every `PROBE_EVERY`th packet
/// probes (see `serve`).
const MISS_RUN: u32 = 256;
const PROBE_EVERY: u32 = 32;

/// IPv4 and IPv6 header lengths the path takes (no options, no extension headers).
const IPV4_LEN: usize = 20;
const IPV6_LEN: usize = 40;

/// The XDP action for the packet in `pkt`, which arrived on `ifindex` (configured as
/// `iface`, not an 802.1Q port), when the express path takes it (see the module's
/// invariants); `None`: the pipeline's.
#[inline(always)]
pub fn serve(pkt: &Packet, ifindex: u32, iface: &IfaceConfig) -> Option<u32> {
    if iface.flags & IFACE_F_CT_XDP == 0 {
        return None;
    }
    // perf: the headers as little-endian words at fixed offsets, one bounds check per
    // family and protocol (byte-array reads become a load per byte), and the key in
    // registers (no scratch, no narrow stores read back as words).
    // `len` bytes from the frame's start are there to read.
    let there = |len: usize| pkt.data + len <= pkt.data_end;
    if !there(ETH_HLEN + IPV4_LEN + 8) {
        return None;
    }
    let rd = |off: usize| {
        // SAFETY: an unaligned read of the 8 bytes at `off`, within the bytes the `there`
        // check before each call covers (unaligned access: see build.rs).
        unsafe { core::ptr::read_unaligned((pkt.data + off) as *const u64) }
    };
    let (w0, w1, w2) = (rd(0), rd(8), rd(16));
    // Ethernet: destination (bytes 0-5), type (12-13).
    let dst_mac = w0 & 0xffff_ffff_ffff;
    let ethertype = ((w1 >> 32) as u16).swap_bytes();
    // Per family: the L4 offset, protocol, IPv4 TTL/protocol/checksum or IPv6 next header
    // and hop limit (`hdr`, as they lie), the IP packet's end, the addresses as key words.
    let (family, l4, proto, hdr, l3_end, src, dst) = match ethertype {
        0x0800 => {
            let w3 = rd(24);
            // Version 4, no options (byte 14); neither a fragment nor its first part (MF,
            // offset: bytes 20-21 but DF).
            if (w1 >> 48) as u8 != 0x45 || (w2 >> 32) as u16 & 0xff3f != 0 {
                return None;
            }
            let total = usize::from((w2 as u16).swap_bytes());
            let addrs = rd(26);
            (
                FAMILY_IPV4,
                ETH_HLEN + IPV4_LEN,
                (w2 >> 56) as u8,
                (((w2 >> 48) & 0xffff) | ((w3 & 0xffff) << 16)) as u32,
                ETH_HLEN + total,
                [addrs & 0xffff_ffff, 0],
                [addrs >> 32, 0],
            )
        }
        0x86dd => {
            if !there(ETH_HLEN + IPV6_LEN + 8) {
                return None;
            }
            let payload = usize::from(((w2 >> 16) as u16).swap_bytes());
            // Version 6 (byte 14); not a jumbogram (payload 0: the parser's to judge).
            if ((w1 >> 52) & 0xf) != 6 || payload == 0 {
                return None;
            }
            (
                FAMILY_IPV6,
                ETH_HLEN + IPV6_LEN,
                (w2 >> 32) as u8,
                ((w2 >> 32) & 0xffff) as u32,
                ETH_HLEN + IPV6_LEN + payload,
                [rd(22), rd(30)],
                [rd(38), rd(46)],
            )
        }
        _ => return None,
    };
    // The parser's length rules: the IP packet within the frame, its L4 header within it.
    if l3_end > pkt.len || l3_end < l4 + 8 {
        return None;
    }
    let ports = rd(l4);
    let (sport, dport) = (
        (ports as u16).swap_bytes(),
        ((ports >> 16) as u16).swap_bytes(),
    );
    let hdr = hdr.to_le_bytes();
    let check_at = l4 + if proto == IPPROTO_TCP { 16 } else { 6 };
    let check = match proto {
        IPPROTO_TCP => {
            if !there(l4 + 20) {
                return None;
            }
            let t = rd(l4 + 12);
            let flags = (t >> 8) as u8;
            let doff = usize::from((t as u8) >> 4) * 4;
            if flags & (TCP_SYN | TCP_FIN | TCP_RST | TCP_ACK) != TCP_ACK
                || !tcp_flags_valid(flags)
                || doff < 20
                || l4 + doff > l3_end
            {
                return None;
            }
            ((t >> 32) as u16).swap_bytes()
        }
        IPPROTO_UDP => ((ports >> 48) as u16).swap_bytes(),
        _ => return None,
    };
    // perf: after a run of probes that served nothing (traffic no copy holds: datagrams that
    // are never answered, new flows), only every `PROBE_EVERY`th packet probes until one is
    // served; the others go to the pipeline without hashing their key.
    let note = FP_FLOW_NOTE.get_ptr_mut(0)?;
    // SAFETY: this CPU's slot of a per-CPU array, used by this program run only.
    let note = unsafe { &mut *note };
    let misses = note.misses;
    note.misses = misses.wrapping_add(1);
    if misses >= MISS_RUN && misses % PROBE_EVERY != 0 {
        return None;
    }
    // The connection's key (`CtKey::normalize`'s order: addresses as big-endian words, then
    // ports), as its five words.
    let be = |w: [u64; 2]| (u64::from_be(w[0]), u64::from_be(w[1]));
    let src_is_lo = match be(src).cmp(&be(dst)) {
        core::cmp::Ordering::Less => true,
        core::cmp::Ordering::Greater => false,
        core::cmp::Ordering::Equal => sport <= dport,
    };
    let ((lo, plo), (hi, phi)) = if src_is_lo {
        ((src, sport), (dst, dport))
    } else {
        ((dst, dport), (src, sport))
    };
    let words = [
        lo[0],
        lo[1],
        hi[0],
        hi[1],
        u64::from(plo) | u64::from(phi) << 16 | u64::from(proto) << 32 | u64::from(family) << 40,
    ];
    let h = flow_hash_words(words);
    let idx = slot_of(h);
    let tags = FP_FLOW_TAG.get_ptr(0)?;
    // SAFETY: this CPU's value of a per-CPU array; `idx` is masked to its length.
    if unsafe { (*tags)[idx as usize & (FLOW_SLOTS as usize - 1)] } != flow_tag(h) {
        return None;
    }
    let epoch = *FP_FLOW_EPOCH.get(idx)?;
    let s = FP_FLOW.get_ptr_mut(idx)?;
    // SAFETY: this CPU's slot (see `flowcache::lookup`).
    let s = unsafe { &mut *s };
    let now = clock::now();
    if s.key.words() != words || !flowcache::leased(s, epoch, now) {
        return None;
    }
    // verifier: masked where the index is used (see `packet::masked`).
    let dir = masked(flowcache::served_dir(&s.entry, src_is_lo), 1);
    let r = FP_EXPRESS.get(idx)?.get(dir)?;
    if r.filled_ns != s.filled_ns {
        return None;
    }
    let hop = &r.hop;
    let ip_len = (l3_end - ETH_HLEN) as u16;
    let routed = r.routed != 0;
    let ttl = if family == FAMILY_IPV4 {
        hdr[0]
    } else {
        hdr[1]
    };
    let m = iface.mac;
    let ours = u64::from_le_bytes([m[0], m[1], m[2], m[3], m[4], m[5], 0, 0]);
    if !route::kept_holds(hop, ifindex, now, fib::generation())
        || (routed
            && (iface.flags & IFACE_F_ROUTE == 0
                || dst_mac != ours
                || ttl <= 1
                || ip_len > hop.fits))
    {
        return None;
    }
    let out = u32::from(hop.out_ifindex);
    if route::egress_tail(out).is_some() {
        return None;
    }
    if !rewrite(pkt, r, (family, proto), hdr, l4, (check_at, check), routed) {
        return None;
    }
    note.misses = 0;
    // The counts of the pipeline's served packet.
    let len = pkt.len;
    let e = &mut s.entry;
    e.packets[dir] += 1;
    e.bytes[dir] += len as u64;
    if last_seen_moves(e.last_seen_ns, now) {
        e.last_seen_ns = now;
    }
    conntrack::count(ct_stat::FLOW_HITS);
    conntrack::count(ct_stat::EXPRESS_HITS);
    conntrack::count(ct_stat::LOOKUPS);
    conntrack::count(ct_stat::HITS);
    if r.lb != 0 {
        stats::service(r.service, r.backend, len, false);
    }
    if routed {
        route::count(route_stat::HIT);
    }
    stats::count(Hook::Xdp, Verdict::Forward, r.reason, len);
    Some(route::xdp_redirect(out))
}

/// Rewrites the packet (of `family` and IP protocol `proto`) as recipe `r` says (IP header at `ETH_HLEN` with `hdr` as `serve`
/// read it, L4 at `l4`, its checksum `old` at `check_at`); false: nothing writable there
/// (nothing written).
#[inline(always)]
fn rewrite(
    pkt: &Packet,
    r: &Express,
    (family, proto): (u8, u8),
    hdr: [u8; 4],
    l4: usize,
    (check_at, old): (usize, u16),
    routed: bool,
) -> bool {
    let v4 = family == FAMILY_IPV4;
    let udp = proto == IPPROTO_UDP;
    if r.l4_delta != 0 && !(udp && v4 && old == 0) {
        let mut new = csum::apply(old, u64::from(r.l4_delta));
        if udp {
            new = csum::udp_fixup(old, new);
        }
        if !pkt.store(check_at, new.to_be_bytes()) {
            return false;
        }
    }
    let dec = u8::from(routed);
    let written = if v4 {
        let check = be16([hdr[2], hdr[3]]);
        let check = if r.l3_delta != 0 {
            csum::apply(check, u64::from(r.l3_delta))
        } else {
            check
        };
        let [c0, c1] = check.to_be_bytes();
        pkt.store(ETH_HLEN + 8, [hdr[0] - dec, hdr[1], c0, c1])
            && pkt.store_words(ETH_HLEN + 12, [r.addrs[0]])
    } else {
        pkt.store(ETH_HLEN + 6, [hdr[0], hdr[1] - dec]) && pkt.store_words(ETH_HLEN + 8, r.addrs)
    };
    written && pkt.store(l4, r.ports) && route::store_macs(pkt, r.hop.macs)
}

/// Takes this CPU's note that a flow-cache copy served the packet being processed (see
/// `ctx::FlowNote`), keeping the packet's checksums before the stages rewrite it: whether
/// [`learn`] may learn from it once forwarded (a packet the express path would take the
/// shape of).
#[inline(always)]
pub fn noted(pkt: &Packet, p: &Parsed) -> bool {
    let Some(n) = FP_FLOW_NOTE.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: this CPU's slot of a per-CPU array, used by this program run only.
    let n = unsafe { &mut *n };
    if n.slot == 0 {
        return false;
    }
    let l3 = p.l3_off as usize;
    let l4 = p.l4_off as usize;
    let v4 = p.family == FAMILY_IPV4;
    let shaped = p.vlan_count == 0
        && p.fragment == 0
        && l3 == ETH_HLEN
        && l4 == l3 + if v4 { IPV4_LEN } else { IPV6_LEN };
    let check_at = if p.l4_proto == IPPROTO_TCP {
        l4 + 16
    } else {
        l4 + 6
    };
    let (Some(c3), Some(c4)) = (
        pkt.load_now::<[u8; 2]>(l3 + 10),
        pkt.load_now::<[u8; 2]>(check_at),
    ) else {
        n.slot = 0;
        return false;
    };
    if !shaped {
        n.slot = 0;
        return false;
    }
    n.l3_check = if v4 { be16(c3) } else { 0 };
    n.l4_check = be16(c4);
    true
}

/// Learns the recipe of the slot [`noted`] named from the packet as it leaves (forwarded,
/// counted under `reason`; `routed`: by the L3 stage, else by direct server return).
#[inline(always)]
pub fn learn(pkt: &Packet, p: &Parsed, reason: u32, routed: bool) {
    let Some(n) = FP_FLOW_NOTE.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: as in `noted`.
    let n = unsafe { &mut *n };
    let idx = n.slot.wrapping_sub(1);
    n.slot = 0;
    let dir = (n.dir & 1) as usize;
    let (Some(s), Some(r)) = (FP_FLOW.get(idx), FP_EXPRESS.get_ptr_mut(idx)) else {
        return;
    };
    // SAFETY: this CPU's slot of a per-CPU array, used by this program run only.
    let r = unsafe { &mut (*r)[dir] };
    let v4 = p.family == FAMILY_IPV4;
    let l3 = p.l3_off as usize;
    let l4 = p.l4_off as usize;
    let udp = p.l4_proto == IPPROTO_UDP;
    let check_at = if udp { l4 + 6 } else { l4 + 16 };
    let (Some(c3), Some(c4), Some(ports)) = (
        pkt.load_now::<[u8; 2]>(l3 + 10),
        pkt.load_now::<[u8; 2]>(check_at),
        pkt.load_now::<[u8; 4]>(l4),
    ) else {
        return;
    };
    // A datagram without a checksum tells nothing of the change.
    if udp && v4 && n.l4_check == 0 {
        return;
    }
    let out = route::out_ifindex();
    let hop = s.entry.hops[dir];
    if u32::from(hop.out_ifindex) != out || route::egress_tail(out).is_some() {
        return;
    }
    r.filled_ns = 0;
    if v4 {
        let Some(at) = pkt.words_at::<1>(l3 + 12) else {
            return;
        };
        // SAFETY: a word within the packet, checked by `words_at`.
        r.addrs[0] = unsafe { core::ptr::read_unaligned(at) };
        r.l3_delta = change(n.l3_check, be16(c3));
    } else {
        let Some(at) = pkt.words_at::<4>(l3 + 8) else {
            return;
        };
        // SAFETY: four words within the packet, checked by `words_at`.
        unsafe {
            r.addrs = [
                core::ptr::read_unaligned(at),
                core::ptr::read_unaligned(at.add(1)),
                core::ptr::read_unaligned(at.add(2)),
                core::ptr::read_unaligned(at.add(3)),
            ];
        }
        r.l3_delta = 0;
    }
    r.l4_delta = change(n.l4_check, be16(c4));
    r.ports = ports;
    r.hop = hop;
    r.reason = reason;
    let e = &s.entry;
    // As the conntrack stage counts a served packet for its service: an alias's, or a
    // load-balanced connection's original direction.
    r.lb =
        u8::from(e.flags & CT_F_LB_ALIAS != 0 || (e.flags & CT_F_LB != 0 && dir == DIR_ORIGINAL));
    r.service = e.nat.service;
    r.backend = e.nat.backend;
    r.routed = u8::from(routed);
    // Last: the recipe holds from here.
    r.filled_ns = s.filled_ns;
}

/// The checksum change from `old` to `new` as `csum::apply` takes it (`~HC' = ~HC + delta`,
/// so `delta = ~HC' - ~HC = ~HC' + HC`), folded; 0 when there is none (mod 0xffff).
#[inline(always)]
fn change(old: u16, new: u16) -> u16 {
    let d = csum::fold(u64::from(!new) + u64::from(old));
    if d == 0xffff { 0 } else { d }
}
