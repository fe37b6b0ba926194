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
        CT_F_LB, CT_F_LB_ALIAS, CtKey, DIR_ORIGINAL, FLOW_SLOTS, IFACE_F_CT_XDP, IFACE_F_ROUTE,
        IfaceConfig, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN, ct_stat, flow_hash, flow_tag,
        last_seen_moves, slot_of, tcp_flags_valid,
    },
    route::route_stat,
};

use crate::{
    clock, conntrack,
    ctx::Express,
    fib, flowcache,
    maps::{FP_CT_KEY, FP_EXPRESS, FP_FLOW, FP_FLOW_EPOCH, FP_FLOW_NOTE, FP_FLOW_TAG},
    packet::{Packet, be16},
    parse::{ETH_HLEN, FAMILY_IPV4, FAMILY_IPV6, IPPROTO_TCP, IPPROTO_UDP, Parsed},
    route, stats,
};

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
    let eth: [u8; 14] = pkt.load_now(0)?;
    // `hdr`: IPv4 TTL, protocol and header checksum; IPv6 next header and hop limit.
    let (family, l4, proto, hdr, l3_end) = match (eth[12], eth[13]) {
        (0x08, 0x00) => {
            let h: [u8; IPV4_LEN] = pkt.load_now(ETH_HLEN)?;
            // Version 4, no options; neither a fragment nor its first part (MF, offset).
            if h[0] != 0x45 || h[6] & 0x3f != 0 || h[7] != 0 {
                return None;
            }
            let total = usize::from(be16([h[2], h[3]]));
            (
                FAMILY_IPV4,
                ETH_HLEN + IPV4_LEN,
                h[9],
                [h[8], h[9], h[10], h[11]],
                ETH_HLEN + total,
            )
        }
        (0x86, 0xdd) => {
            let h: [u8; 8] = pkt.load_now(ETH_HLEN)?;
            let payload = usize::from(be16([h[4], h[5]]));
            // Not a jumbogram (payload 0: the parser's to judge).
            if h[0] >> 4 != 6 || payload == 0 {
                return None;
            }
            (
                FAMILY_IPV6,
                ETH_HLEN + IPV6_LEN,
                h[6],
                [h[6], h[7], 0, 0],
                ETH_HLEN + IPV6_LEN + payload,
            )
        }
        _ => return None,
    };
    // The parser's length rules: the IP packet within the frame, its L4 header within it.
    if l3_end > pkt.len || l3_end < l4 + 8 {
        return None;
    }
    let (ports, check_at) = match proto {
        IPPROTO_TCP => {
            let t: [u8; 20] = pkt.load_now(l4)?;
            let flags = t[13];
            let doff = usize::from(t[12] >> 4) * 4;
            if flags & (TCP_SYN | TCP_FIN | TCP_RST | TCP_ACK) != TCP_ACK
                || !tcp_flags_valid(flags)
                || doff < 20
                || l4 + doff > l3_end
            {
                return None;
            }
            ([t[0], t[1], t[2], t[3]], l4 + 16)
        }
        IPPROTO_UDP => (pkt.load_now(l4)?, l4 + 6),
        _ => return None,
    };
    // The connection's key, built in this CPU's key scratch (the pipeline builds it again
    // if the path declines).
    let key = FP_CT_KEY.get_ptr_mut(0)?;
    // SAFETY: this CPU's slot of a per-CPU array, used by this program run only.
    let key = unsafe { &mut *key };
    if !load_key(pkt, family, proto, ports, key) {
        return None;
    }
    let src_is_lo = key.normalize();
    let h = flow_hash(key);
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
    if s.key.words() != key.words() || !flowcache::leased(s, epoch, now) {
        return None;
    }
    let dir = flowcache::served_dir(&s.entry, src_is_lo) & 1;
    let r = &FP_EXPRESS.get(idx)?[dir];
    if r.filled_ns != s.filled_ns || r.family != family || r.proto != proto {
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
    let dst = [eth[0], eth[1], eth[2], eth[3], eth[4], eth[5]];
    if !route::kept_holds(hop, ifindex, now, fib::generation())
        || (routed
            && (iface.flags & IFACE_F_ROUTE == 0
                || dst != iface.mac
                || ttl <= 1
                || ip_len > hop.fits))
    {
        return None;
    }
    let out = u32::from(hop.out_ifindex);
    if route::egress_tail(out).is_some() {
        return None;
    }
    if !rewrite(pkt, r, hdr, l4, check_at, routed) {
        return None;
    }
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

/// Fills `key` (not normalized) from the packet's addresses and `ports` (as on the wire).
#[inline(always)]
fn load_key(pkt: &Packet, family: u8, proto: u8, ports: [u8; 4], key: &mut CtKey) -> bool {
    let w = (key as *mut CtKey).cast::<u64>();
    let (a, b, c, d) = if family == FAMILY_IPV4 {
        let Some(at) = pkt.words_at::<1>(ETH_HLEN + 12) else {
            return false;
        };
        // SAFETY: one word within the packet, checked by `words_at`.
        let both = unsafe { core::ptr::read_unaligned(at) }.to_ne_bytes();
        let src = u32::from_ne_bytes([both[0], both[1], both[2], both[3]]);
        let dst = u32::from_ne_bytes([both[4], both[5], both[6], both[7]]);
        (u64::from(src), 0, u64::from(dst), 0)
    } else {
        let Some(at) = pkt.words_at::<4>(ETH_HLEN + 8) else {
            return false;
        };
        // SAFETY: four words within the packet, checked by `words_at`.
        unsafe {
            (
                core::ptr::read_unaligned(at),
                core::ptr::read_unaligned(at.add(1)),
                core::ptr::read_unaligned(at.add(2)),
                core::ptr::read_unaligned(at.add(3)),
            )
        }
    };
    key.port_lo = be16([ports[0], ports[1]]);
    key.port_hi = be16([ports[2], ports[3]]);
    key.proto = proto;
    key.family = family;
    key._pad = [0; 2];
    // SAFETY: words 0-3 of the 8-aligned key are its two addresses.
    unsafe {
        w.write(a);
        w.add(1).write(b);
        w.add(2).write(c);
        w.add(3).write(d);
    }
    true
}

/// Rewrites the packet as recipe `r` says (IP header at `ETH_HLEN` with `hdr` as `serve`
/// read it, L4 at `l4`, its checksum at `check_at`); false: nothing readable there (nothing
/// written).
#[inline(always)]
fn rewrite(
    pkt: &Packet,
    r: &Express,
    hdr: [u8; 4],
    l4: usize,
    check_at: usize,
    routed: bool,
) -> bool {
    let v4 = r.family == FAMILY_IPV4;
    let udp = r.proto == IPPROTO_UDP;
    let Some(old) = pkt.load_now::<[u8; 2]>(check_at) else {
        return false;
    };
    let old = be16(old);
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
    r.family = if v4 { FAMILY_IPV4 } else { FAMILY_IPV6 };
    r.proto = p.l4_proto;
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
