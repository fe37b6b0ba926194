//! VXLAN stage (see `fastpath_common::vxlan`): the cache of outer headers learned from the
//! kernel's vxlan devices at the underlay's TC egress, encapsulation at XDP of packets the L3
//! stage routed to a vxlan device, and decapsulation at the underlay's XDP hook of packets of
//! a configured network, whose inner packet the L3 stage then routes.
//!
//! TCP FIN and RST segments take the kernel's path both ways, so the kernel's own connection
//! tracking (netfilter), which saw the connection start there, also sees it end.

use aya_ebpf::{EbpfContext as _, helpers::bpf_xdp_adjust_head, programs::XdpContext};
use fastpath_common::{
    Hook,
    ct::IFACE_F_VXLAN_UNDERLAY,
    reason,
    vxlan::{VXLAN_HDR_V4, VXLAN_HDR_V6, VxlanNet, VxlanPeer, vxlan_stat},
};

use crate::{
    maps::{
        FP_FIB, FP_IFACE, FP_PKT_CTX, FP_VXLAN_GEN, FP_VXLAN_KEY, FP_VXLAN_LEARN, FP_VXLAN_NET,
        FP_VXLAN_PEER, FP_VXLAN_STATS,
    },
    packet::{Packet, be16},
    parse::{ETH_P_IPV4, ETH_P_IPV6, FAMILY_IPV4, IPPROTO_TCP, IPPROTO_UDP, Parsed},
    pipeline, route, xdp_packet,
};

const TCP_FIN: u8 = 0x01;
const TCP_RST: u8 = 0x04;
/// VXLAN header flags: the VNI is valid.
const VXLAN_FLAG_VNI: u8 = 0x08;

/// The current generation of learned headers.
#[inline(always)]
fn generation() -> u64 {
    FP_VXLAN_GEN.get(0).copied().unwrap_or(0)
}

#[inline(always)]
fn count(slot: u32) {
    if let Some(c) = FP_VXLAN_STATS.get_ptr_mut(slot) {
        // SAFETY: this CPU's slot of a per-CPU array.
        unsafe { *c += 1 };
    }
}

/// The network of `vni`, if configured.
#[inline(always)]
fn net(vni: u32) -> Option<&'static VxlanNet> {
    // SAFETY: a live entry, read only; the daemon replaces entries whole.
    FP_VXLAN_NET.get_ptr(&vni).map(|n| unsafe { &*n })
}

/// The learned headers for inner destination `mac` on vxlan device `ifindex`.
#[inline(always)]
fn peer(ifindex: u32, mac: [u8; 6]) -> Option<*mut VxlanPeer> {
    let k = FP_VXLAN_KEY.get_ptr_mut(0)?;
    // SAFETY: this CPU's slot of a per-CPU array, used by this program run only; the key
    // lives in map memory (no stack).
    let k = unsafe {
        (*k).ifindex = ifindex;
        (*k).mac = mac;
        (*k)._pad = [0; 2];
        &*k
    };
    FP_VXLAN_PEER.get_ptr_mut(k)
}

/// The outer UDP source port for the inner packet `p`: from a hash of its addresses,
/// protocol and ports, within `min..max` as the kernel maps its flow hash (`udp_flow_src_port`),
/// so a flow keeps one port (the underlay's ECMP and RSS keep it on one path).
#[inline(always)]
fn source_port(pkt: &Packet, p: &Parsed, min: u16, max: u16) -> Option<u16> {
    let mix = |h: u32, w: u32| {
        (h ^ w
            .wrapping_mul(0xcc9e_2d51)
            .rotate_left(15)
            .wrapping_mul(0x1b87_3593))
        .rotate_left(13)
        .wrapping_mul(5)
        .wrapping_add(0xe654_6b64)
    };
    let l3 = p.l3_off as usize;
    let mut h = 0x7678_6c6e ^ u32::from(p.l4_proto);
    if p.family == FAMILY_IPV4 {
        let a: [u32; 2] = pkt.load_now(l3 + 12)?;
        h = mix(mix(h, a[0]), a[1]);
    } else {
        let a: [u32; 8] = pkt.load_now(l3 + 8)?;
        let mut i = 0;
        while i < 8 {
            h = mix(h, a[i]);
            i += 1;
        }
    }
    h = mix(h, u32::from(p.src_port) << 16 | u32::from(p.dst_port));
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^= h >> 16;
    // As the kernel: only the upper bits choose the port.
    h ^= h << 16;
    let span = u64::from(max.saturating_sub(min));
    Some(min + ((u64::from(h) * span) >> 32) as u16)
}

/// The 16-bit one's complement sum of the IPv4 header in `hdr` (bytes 14..34), its checksum
/// field taken as zero, with the total length and identification given.
#[inline(always)]
fn ipv4_check(hdr: &[u8; 72], tot_len: u16, id: u16) -> u16 {
    let mut sum = u32::from(tot_len) + u32::from(id);
    let mut i = 14;
    while i < 34 {
        // Total length (16), identification (18) and checksum (24) are not the template's.
        if i != 16 && i != 18 && i != 24 {
            sum += u32::from(u16::from_be_bytes([hdr[i], hdr[i + 1]]));
        }
        i += 2;
    }
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    !(sum as u16)
}

/// What the encapsulation tail program did with a packet the L3 stage routed to a vxlan
/// device.
pub enum Encap {
    /// Routed and encapsulated: redirect it to this underlay interface.
    Sent(u32),
    /// To the kernel, unchanged, with this reason: no headers learned for the next hop
    /// (`vxlan_miss`), learned in an older generation (`vxlan_stale`), a TCP FIN or RST.
    Kernel(u32),
    /// Rewritten but not encapsulated (no headroom, the entry went in between): dropped,
    /// counted `route_other`.
    Drop,
}

/// XDP, in the tail program after the L3 stage routed the packet (`FP_PKT_CTX`) to a vxlan
/// device (`route::out_ifindex`), leaving the FIB's answer in `FP_FIB`: with the outer headers
/// learned for the next hop, the packet is routed (TTL, the device's and the next hop's MAC
/// addresses, as the kernel's inner frame has them) and the headers put in front.
#[inline(always)]
pub fn encap(ctx: &XdpContext) -> Encap {
    let pkt = xdp_packet(ctx);
    let (Some(p), Some(fib)) = (FP_PKT_CTX.get(0), FP_FIB.get(0)) else {
        return Encap::Kernel(reason::VXLAN_MISS);
    };
    if p.l4_proto == IPPROTO_TCP && p.tcp_flags & (TCP_FIN | TCP_RST) != 0 {
        return Encap::Kernel(reason::VXLAN_TCP_CLOSE);
    }
    let macs = fib.macs();
    let Some(peer) = peer(
        route::out_ifindex(),
        [macs[0], macs[1], macs[2], macs[3], macs[4], macs[5]],
    ) else {
        return Encap::Kernel(reason::VXLAN_MISS);
    };
    // SAFETY: a live entry of the cache.
    let peer = unsafe { &mut *peer };
    if peer.generation != generation() {
        return Encap::Kernel(reason::VXLAN_STALE);
    }
    let v4 = p.family == FAMILY_IPV4;
    let l3 = p.l3_off as usize;
    // What `route::forward` read: IPv4 TTL, protocol and checksum; IPv6 next header and hop
    // limit.
    let hdr: [u8; 4] = if v4 {
        match pkt.load_now(l3 + 8) {
            Some(h) => h,
            None => return Encap::Kernel(reason::VXLAN_MISS),
        }
    } else {
        match pkt.load_now::<[u8; 2]>(l3 + 6) {
            Some(h) => [h[1], h[0], 0, 0],
            None => return Encap::Kernel(reason::VXLAN_MISS),
        }
    };
    let Some(sport) = source_port(&pkt, p, peer.port_min, peer.port_max) else {
        return Encap::Kernel(reason::VXLAN_MISS);
    };
    // From here the packet changes: a failure drops it.
    if !route::rewrite(&pkt, l3, v4, hdr, macs) {
        return Encap::Drop;
    }
    // Per destination, shared by the CPUs: a race may give two packets one number, which
    // only matters to fragments (the kernel's counters are no stricter).
    let id = peer.ip_id as u16;
    // SAFETY: an atomic add to a field of a live map entry.
    unsafe {
        core::intrinsics::atomic_xadd::<u32, u32, { core::intrinsics::AtomicOrdering::Relaxed }>(
            &raw mut peer.ip_id,
            1,
        );
    }
    let inner_len = pkt.len as u16;
    let hdr_bytes = peer.hdr_bytes();
    let w = peer.hdr;
    let outer_v4 = peer.hdr_len == VXLAN_HDR_V4;
    let hdr_len = if outer_v4 { VXLAN_HDR_V4 } else { VXLAN_HDR_V6 };
    let underlay = peer.underlay;
    // SAFETY: the context is the program's; a negative delta grows the frame into the
    // headroom, and fails if there is not enough.
    if unsafe { bpf_xdp_adjust_head(ctx.as_ptr() as *mut _, -(hdr_len as i32)) } != 0 {
        return Encap::Drop;
    }
    let pkt = xdp_packet(ctx);
    let udp_len = (inner_len + 16).to_be_bytes();
    let sport = sport.to_be_bytes();
    let h = hdr_bytes;
    let written = if outer_v4 {
        let tot_len = inner_len + 36;
        let check = ipv4_check(&h, tot_len, id).to_be_bytes();
        let (l, i) = (tot_len.to_be_bytes(), id.to_be_bytes());
        pkt.store_words(0, [w[0], w[1], w[2], w[3], w[4], w[5]])
            && pkt.store(48, [h[48], h[49]])
            && pkt.store(16, [l[0], l[1], i[0], i[1]])
            && pkt.store(24, check)
            && pkt.store(34, sport)
            && pkt.store(38, [udp_len[0], udp_len[1], 0, 0])
    } else {
        pkt.store_words(0, [w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]])
            && pkt.store(64, [h[64], h[65], h[66], h[67], h[68], h[69]])
            && pkt.store(18, udp_len)
            && pkt.store(54, sport)
            && pkt.store(58, [udp_len[0], udp_len[1], 0, 0])
    };
    if written {
        Encap::Sent(underlay)
    } else {
        Encap::Drop
    }
}

/// What the decapsulation tail program did with a packet that arrived on a VXLAN underlay.
pub enum Decap {
    /// Decapsulated and routed: redirect to `route::out_ifindex` (through the egress tail
    /// program the main one would use, if the interface needs one).
    Forward(u32),
    /// To the kernel, unchanged, with this reason.
    Kernel(u32),
    /// The outer headers could not be put back (counted `route_other`).
    Drop,
}

/// XDP, in the tail program for UDP no stage took (`route::handed_over` says why): a packet
/// of a configured network, arriving on its underlay for this VTEP, loses its outer headers
/// and its inner packet is routed from the network's vxlan device by the L3 stage. Whatever
/// is not that goes to the kernel as it came: with its reason, or, if the inner packet is not
/// routed in the fast path (or is a TCP FIN or RST), with the inner packet's.
#[inline(always)]
pub fn decap(ctx: &XdpContext) -> Decap {
    let why = route::handed_over();
    let pkt = xdp_packet(ctx);
    let Some(outer) = FP_PKT_CTX.get(0) else {
        return Decap::Kernel(why);
    };
    let underlay = FP_IFACE
        .get(ctx.ingress_ifindex() as u32)
        .is_some_and(|i| i.flags & IFACE_F_VXLAN_UNDERLAY != 0);
    if !underlay || outer.l4_proto != IPPROTO_UDP || outer.fragment != 0 {
        return Decap::Kernel(why);
    }
    let Some((net, hdr_len)) = our_vxlan(&pkt, outer) else {
        return Decap::Kernel(why);
    };
    let v4 = hdr_len == VXLAN_HDR_V4;
    // The outer headers (and more), kept to put back if the kernel is to have the packet.
    let Some(words) = pkt.load_now::<[u64; 9]>(0) else {
        return Decap::Kernel(reason::VXLAN_MISS);
    };
    // SAFETY: the context is the program's; the frame is longer than `hdr_len` (read above).
    if unsafe { bpf_xdp_adjust_head(ctx.as_ptr() as *mut _, hdr_len as i32) } != 0 {
        return Decap::Kernel(reason::ROUTE_OTHER);
    }
    let inner = xdp_packet(ctx);
    let routed = match pipeline::parse(&inner) {
        Ok(p) if p.l4_proto == IPPROTO_TCP && p.tcp_flags & (TCP_FIN | TCP_RST) != 0 => {
            Err(reason::VXLAN_TCP_CLOSE)
        }
        Ok(p) => route::forward(&inner, p, Hook::Xdp, net),
        Err(_) => Err(reason::VXLAN_MISS),
    };
    match routed {
        Ok(()) => Decap::Forward(reason::VXLAN_DECAP),
        Err(why) => {
            // SAFETY: as above; growing back by what was taken.
            let back = unsafe { bpf_xdp_adjust_head(ctx.as_ptr() as *mut _, -(hdr_len as i32)) };
            let pkt = xdp_packet(ctx);
            let w = words;
            let restored = back == 0
                && if v4 {
                    let t = w[6].to_ne_bytes();
                    pkt.store_words(0, [w[0], w[1], w[2], w[3], w[4], w[5]])
                        && pkt.store(48, [t[0], t[1]])
                } else {
                    let t = w[8].to_ne_bytes();
                    pkt.store_words(0, [w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]])
                        && pkt.store(64, [t[0], t[1], t[2], t[3], t[4], t[5]])
                };
            if !restored {
                // Nothing to hand the kernel but a broken frame.
                return Decap::Drop;
            }
            // Not a stage's: the route stage had nothing to say about the inner packet.
            Decap::Kernel(if why == reason::NONE {
                reason::VXLAN_MISS
            } else {
                why
            })
        }
    }
}

/// The vxlan device and outer header length of a packet of a configured network to this
/// VTEP (`outer` parsed: UDP, whole, no IPv4 options, no VLAN tag).
#[inline(always)]
fn our_vxlan(pkt: &Packet, outer: &Parsed) -> Option<(u32, u32)> {
    let v4 = outer.family == FAMILY_IPV4;
    let hdr_len = if v4 { VXLAN_HDR_V4 } else { VXLAN_HDR_V6 };
    if outer.vlan_count != 0 || outer.l4_off != hdr_len - 16 {
        return None;
    }
    let l4 = outer.l4_off as usize;
    let vx: [u8; 8] = pkt.load_now(l4 + 8)?;
    if vx[0] & VXLAN_FLAG_VNI == 0 {
        return None;
    }
    let net = net(u32::from_be_bytes([0, vx[4], vx[5], vx[6]]))?;
    if net.port != outer.dst_port || net.family != outer.family {
        return None;
    }
    let ours = if v4 {
        let a: [u8; 4] = pkt.load_now(outer.l3_off as usize + 16)?;
        a == [net.local[0], net.local[1], net.local[2], net.local[3]]
    } else {
        let a: [u64; 2] = pkt.load_now(outer.l3_off as usize + 24)?;
        let l: [u64; 2] = net.local_words();
        a == l
    };
    ours.then_some((net.ifindex, hdr_len))
}

/// TC egress of a VXLAN underlay (the caller checked): a packet the kernel's vxlan device
/// made for a configured network teaches the cache its outer headers, for the inner
/// destination MAC address it carries. A function of its own: called only on underlays, and
/// its stack is not the TC program's.
#[inline(never)]
pub fn learn(pkt: &Packet, ifindex: u32) {
    // verifier: one value at a time with `?` (a tuple of `Option`s let LLVM read an
    // uninitialised register on a `None` path).
    let _ = learn_from(pkt, ifindex);
}

#[inline(always)]
fn learn_from(pkt: &Packet, ifindex: u32) -> Option<()> {
    let eth: [u8; 2] = pkt.load_now(12)?;
    let v4 = match be16(eth) {
        ETH_P_IPV4 => true,
        ETH_P_IPV6 => false,
        _ => return None,
    };
    let (hdr_len, src_off, udp) = if v4 {
        (VXLAN_HDR_V4, 26, 34)
    } else {
        (VXLAN_HDR_V6, 22, 54)
    };
    // IPv4: version and header length, no fragment, UDP; IPv6: version, next header UDP.
    let vh: [u8; 2] = pkt.load_now(14)?;
    if v4 {
        let f: [u8; 4] = pkt.load_now(20)?;
        if vh[0] != 0x45 || f[0] & 0x3f != 0 || f[1] != 0 || f[3] != IPPROTO_UDP {
            return None;
        }
    } else {
        let nh: [u8; 2] = pkt.load_now(20)?;
        if vh[0] >> 4 != 6 || nh[0] != IPPROTO_UDP {
            return None;
        }
    }
    let u: [u8; 8] = pkt.load_now(udp)?;
    let vx: [u8; 8] = pkt.load_now(udp + 8)?;
    if vx[0] & VXLAN_FLAG_VNI == 0 {
        return None;
    }
    let net = net(u32::from_be_bytes([0, vx[4], vx[5], vx[6]]))?;
    let from_us = if v4 {
        let a: [u8; 4] = pkt.load_now(src_off)?;
        a == [net.local[0], net.local[1], net.local[2], net.local[3]]
    } else {
        let a: [u64; 2] = pkt.load_now(src_off)?;
        a == net.local_words()
    };
    if !from_us || be16([u[2], u[3]]) != net.port || net.underlay != ifindex {
        return None;
    }
    // The fast path sends no UDP checksum (zero over IPv4; over IPv6, the device must have
    // `udp6zerocsumtx`).
    if u[6] != 0 || u[7] != 0 {
        count(vxlan_stat::UNUSABLE);
        return None;
    }
    let mac: [u8; 6] = pkt.load_now(hdr_len as usize)?;
    let words: [u64; 9] = pkt.load_now(0)?;
    let ip_id: [u8; 2] = pkt.load_now(18)?;
    let key = FP_VXLAN_KEY.get_ptr_mut(0)?;
    let value = FP_VXLAN_LEARN.get_ptr_mut(0)?;
    // SAFETY: this CPU's slots of per-CPU arrays, used by this program run only.
    let (key, value) = unsafe {
        (*key).ifindex = net.ifindex;
        (*key).mac = mac;
        (*key)._pad = [0; 2];
        (*value).generation = generation();
        (*value).underlay = ifindex;
        (*value).hdr_len = hdr_len;
        // IPv4: the kernel's identification goes on from here.
        (*value).ip_id = if v4 { u32::from(be16(ip_id)) + 1 } else { 0 };
        (*value).port_min = net.port_min;
        (*value).port_max = net.port_max;
        (*value).hdr = words;
        (&*key, &*value)
    };
    if FP_VXLAN_PEER.insert(key, value, 0).is_ok() {
        count(vxlan_stat::LEARNED);
    }
    Some(())
}
