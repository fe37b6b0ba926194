//! VXLAN stage (see `fastpath_common::vxlan`): the cache of outer headers learned from the
//! kernel's vxlan devices at the underlay's TC egress, encapsulation of packets the L3 stage
//! routed to a vxlan device, and decapsulation on the underlay of packets of a configured
//! network, whose inner packet the L3 stage then routes. Both where the L3 stage routes: at
//! XDP (`route = true` with XDP on) and at TC ingress (`xdp = "off"`, where a GRO aggregate
//! of many TCP segments is encapsulated once).
//!
//! TCP FIN and RST segments take the kernel's path both ways, so the kernel's own connection
//! tracking (netfilter) sees the end of a connection it tracked from the start (whose first
//! packets took the kernel's path before the next hop was learned). One that began in the
//! fast path is unknown to it: its FIN and RST are INVALID there.

use aya_ebpf::{
    EbpfContext as _,
    bindings::{
        __sk_buff, BPF_ADJ_ROOM_ENCAP_L2_SHIFT, BPF_F_ADJ_ROOM_ENCAP_L2_ETH,
        BPF_F_ADJ_ROOM_ENCAP_L3_IPV4, BPF_F_ADJ_ROOM_ENCAP_L3_IPV6, BPF_F_ADJ_ROOM_ENCAP_L4_UDP,
        BPF_F_ADJ_ROOM_FIXED_GSO, bpf_adj_room_mode::BPF_ADJ_ROOM_MAC,
    },
    helpers::bpf_xdp_adjust_head,
    programs::{TcContext, XdpContext},
};
use fastpath_common::{
    Hook,
    ct::{IFACE_F_CT_XDP, IFACE_F_VXLAN_UNDERLAY},
    reason,
    vxlan::{VXLAN_HDR_V4, VXLAN_HDR_V6, VxlanNet, VxlanPeer, vxlan_stat},
};

use crate::{
    fib,
    maps::{
        FP_FIB, FP_IFACE, FP_PKT_CTX, FP_VXLAN_KEY, FP_VXLAN_LEARN, FP_VXLAN_NET, FP_VXLAN_PEER,
        FP_VXLAN_STATS,
    },
    packet::{Packet, be16},
    parse::{ETH_P_IPV4, ETH_P_IPV6, FAMILY_IPV4, IPPROTO_TCP, IPPROTO_UDP, Parsed},
    pipeline, route, tc_packet, xdp_packet,
};

const TCP_FIN: u8 = 0x01;
const TCP_RST: u8 = 0x04;
/// VXLAN header flags: the VNI is valid.
const VXLAN_FLAG_VNI: u8 = 0x08;

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

/// An encapsulation, planned before the packet changes.
struct Plan {
    /// The learned entry for the next hop (a live entry of the cache).
    peer: *mut VxlanPeer,
    /// The inner IP header's bytes `route::rewrite` takes, as `route::forward` read them.
    hdr: [u8; 4],
    /// The next hop's and the vxlan device's MAC addresses.
    macs: [u8; 12],
    sport: u16,
    v4: bool,
    l3: usize,
}

/// The outer headers of one packet.
struct Outer {
    words: [u64; 9],
    /// The same, as bytes (the checksum reads them).
    bytes: [u8; 72],
    hdr_len: u32,
    underlay: u32,
    id: u16,
}

/// The encapsulation of the packet the L3 stage routed (`FP_PKT_CTX`, `FP_FIB`) to a vxlan
/// device (`route::out_ifindex`), or why it goes to the kernel unchanged.
#[inline(always)]
fn plan(pkt: &Packet) -> Result<Plan, u32> {
    let (Some(p), Some(fib)) = (FP_PKT_CTX.get(0), FP_FIB.get(0)) else {
        return Err(reason::VXLAN_MISS);
    };
    if p.l4_proto == IPPROTO_TCP && p.tcp_flags & (TCP_FIN | TCP_RST) != 0 {
        return Err(reason::VXLAN_TCP_CLOSE);
    }
    let macs = fib.macs();
    let peer = peer(
        route::out_ifindex(),
        [macs[0], macs[1], macs[2], macs[3], macs[4], macs[5]],
    )
    .ok_or(reason::VXLAN_MISS)?;
    // SAFETY: a live entry of the cache.
    if unsafe { (*peer).generation } != fib::generation() {
        return Err(reason::VXLAN_STALE);
    }
    let v4 = p.family == FAMILY_IPV4;
    let l3 = p.l3_off as usize;
    // What `route::forward` read: IPv4 TTL, protocol and checksum; IPv6 next header and hop
    // limit.
    let hdr: [u8; 4] = if v4 {
        pkt.load_now(l3 + 8).ok_or(reason::VXLAN_MISS)?
    } else {
        let h: [u8; 2] = pkt.load_now(l3 + 6).ok_or(reason::VXLAN_MISS)?;
        [h[1], h[0], 0, 0]
    };
    // SAFETY: as above.
    let (min, max) = unsafe { ((*peer).port_min, (*peer).port_max) };
    let sport = source_port(pkt, p, min, max).ok_or(reason::VXLAN_MISS)?;
    Ok(Plan {
        peer,
        hdr,
        macs,
        sport,
        v4,
        l3,
    })
}

/// Routes the planned packet (TTL, the device's and the next hop's MAC addresses, as the
/// kernel's inner frame has them) and takes its outer headers from the cache. `None`: the
/// packet could not be rewritten.
#[inline(always)]
fn commit(pkt: &Packet, plan: &Plan) -> Option<Outer> {
    if !route::rewrite(pkt, plan.l3, plan.v4, plan.hdr, plan.macs) {
        return None;
    }
    // SAFETY: a live entry of the cache.
    let peer = unsafe { &mut *plan.peer };
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
    Some(Outer {
        words: peer.hdr,
        bytes: peer.hdr_bytes(),
        hdr_len: if peer.hdr_len == VXLAN_HDR_V4 {
            VXLAN_HDR_V4
        } else {
            VXLAN_HDR_V6
        },
        underlay: peer.underlay,
        id,
    })
}

/// Writes the outer headers in front of an inner frame of `inner_len` bytes (room made):
/// the learned ones, with this packet's lengths, IPv4 identification and checksum, and UDP
/// source port. (For a GRO aggregate at TC the kernel sets the lengths, identification and
/// checksum of each segment when it splits it.)
#[inline(always)]
fn write_outer(pkt: &Packet, o: &Outer, sport: u16, inner_len: u16) -> bool {
    let w = o.words;
    let h = o.bytes;
    let udp_len = inner_len.wrapping_add(16).to_be_bytes();
    let sport = sport.to_be_bytes();
    if o.hdr_len == VXLAN_HDR_V4 {
        let tot_len = inner_len.wrapping_add(36);
        let check = ipv4_check(&h, tot_len, o.id).to_be_bytes();
        let (l, i) = (tot_len.to_be_bytes(), o.id.to_be_bytes());
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
    }
}

/// XDP, in the tail program after the L3 stage routed the packet to a vxlan device: with the
/// outer headers learned for the next hop, the packet is routed and the headers put in front.
#[inline(always)]
pub fn encap(ctx: &XdpContext) -> Encap {
    let pkt = xdp_packet(ctx);
    let plan = match plan(&pkt) {
        Ok(plan) => plan,
        Err(why) => return Encap::Kernel(why),
    };
    let inner_len = pkt.len as u16;
    // From here the packet changes: a failure drops it.
    let Some(o) = commit(&pkt, &plan) else {
        return Encap::Drop;
    };
    // SAFETY: the context is the program's; a negative delta grows the frame into the
    // headroom, and fails if there is not enough.
    if unsafe { bpf_xdp_adjust_head(ctx.as_ptr() as *mut _, -(o.hdr_len as i32)) } != 0 {
        return Encap::Drop;
    }
    if write_outer(&xdp_packet(ctx), &o, plan.sport, inner_len) {
        Encap::Sent(o.underlay)
    } else {
        Encap::Drop
    }
}

/// TC ingress, in the tail program after the L3 stage routed the packet to a vxlan device:
/// as [`encap`], the room made by `bpf_skb_adjust_room` as a UDP tunnel of an Ethernet frame,
/// so that a GRO aggregate (many TCP segments in one) is encapsulated once and split into
/// encapsulated segments by the kernel on its way out (its segment size kept: the inner
/// route's MTU, which the FIB checked, leaves room for the outer headers).
#[inline(always)]
pub fn encap_tc(ctx: &TcContext) -> Encap {
    let pkt = tc_packet(ctx);
    let plan = match plan(&pkt) {
        Ok(plan) => plan,
        Err(why) => return Encap::Kernel(why),
    };
    let inner_len = pkt.len as u16;
    let Some(o) = commit(&pkt, &plan) else {
        return Encap::Drop;
    };
    // The inner Ethernet header as routed: the room goes in after it.
    let Some(eth) = pkt.load_now::<[u8; 14]>(0) else {
        return Encap::Drop;
    };
    let l3 = if o.hdr_len == VXLAN_HDR_V4 {
        BPF_F_ADJ_ROOM_ENCAP_L3_IPV4
    } else {
        BPF_F_ADJ_ROOM_ENCAP_L3_IPV6
    };
    let flags = u64::from(
        BPF_F_ADJ_ROOM_FIXED_GSO | l3 | BPF_F_ADJ_ROOM_ENCAP_L4_UDP | BPF_F_ADJ_ROOM_ENCAP_L2_ETH,
    ) | (14u64 << BPF_ADJ_ROOM_ENCAP_L2_SHIFT);
    // The outer headers but the outer Ethernet header, plus the inner one.
    if ctx
        .adjust_room(o.hdr_len as i32, BPF_ADJ_ROOM_MAC, flags)
        .is_err()
    {
        return Encap::Drop;
    }
    let pkt = tc_packet(ctx);
    if write_outer(&pkt, &o, plan.sport, inner_len) && pkt.store(o.hdr_len as usize, eth) {
        Encap::Sent(o.underlay)
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

/// A packet of a configured network, arriving on its underlay for this VTEP: its vxlan
/// device and outer header length, and the outer headers (and more) to put back if the
/// kernel is to have it after all. Else why the kernel has it (`why`: the main program's
/// reason).
#[inline(always)]
fn arriving(pkt: &Packet, ifindex: u32, why: u32) -> Result<(u32, u32, [u64; 9]), u32> {
    let outer = FP_PKT_CTX.get(0).ok_or(why)?;
    let underlay = FP_IFACE
        .get(ifindex)
        .is_some_and(|i| i.flags & IFACE_F_VXLAN_UNDERLAY != 0);
    if !underlay || outer.l4_proto != IPPROTO_UDP || outer.fragment != 0 {
        return Err(why);
    }
    let (net, hdr_len) = our_vxlan(pkt, outer).ok_or(why)?;
    // A device that tracks connections (its XDP hook, generic mode, tracks, translates
    // and routes what the kernel decapsulated) has every packet pass there.
    if FP_IFACE
        .get(net)
        .is_some_and(|i| i.flags & IFACE_F_CT_XDP != 0)
    {
        return Err(reason::VXLAN_MISS);
    }
    let words = pkt.load_now::<[u64; 9]>(0).ok_or(reason::VXLAN_MISS)?;
    Ok((net, hdr_len, words))
}

/// Routes the decapsulated packet `inner` as arriving on vxlan device `net`; TCP FIN and RST
/// take the kernel's path.
#[inline(always)]
fn route_inner(inner: &Packet, hook: Hook, net: u32) -> Result<(), u32> {
    match pipeline::parse(inner) {
        // Not routed (see `reason::TCP_INVALID_FLAGS`): the kernel decapsulates it and the
        // device's own hooks judge it.
        Ok(p) if p.tcp_flags_invalid() => Err(reason::TCP_INVALID_FLAGS),
        Ok(p) if p.l4_proto == IPPROTO_TCP && p.tcp_flags & (TCP_FIN | TCP_RST) != 0 => {
            Err(reason::VXLAN_TCP_CLOSE)
        }
        // Not tracked here: the route cache's or the FIB's answer.
        Ok(p) => match route::scratch_hop() {
            Some(hop) => route::forward(inner, p, hook, net, 0, &hop),
            None => Err(reason::VXLAN_MISS),
        },
        Err(_) => Err(reason::VXLAN_MISS),
    }
}

/// Writes back the outer headers `words` taken off a packet (room made again), and the
/// reason it goes to the kernel: the route stage's, or `vxlan_miss` where it had none.
#[inline(always)]
fn put_back(pkt: &Packet, w: [u64; 9], hdr_len: u32, why: u32) -> Decap {
    let restored = if hdr_len == VXLAN_HDR_V4 {
        let t = w[6].to_ne_bytes();
        pkt.store_words(0, [w[0], w[1], w[2], w[3], w[4], w[5]]) && pkt.store(48, [t[0], t[1]])
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

/// XDP, in the tail program for UDP no stage took (`route::handed_over` says why): a packet
/// of a configured network, arriving on its underlay for this VTEP, loses its outer headers
/// and its inner packet is routed from the network's vxlan device by the L3 stage. Whatever
/// is not that goes to the kernel as it came: with its reason, or, if the inner packet is not
/// routed in the fast path (or is a TCP FIN or RST), with the inner packet's.
#[inline(always)]
pub fn decap(ctx: &XdpContext) -> Decap {
    let pkt = xdp_packet(ctx);
    let (net, hdr_len, words) =
        match arriving(&pkt, ctx.ingress_ifindex() as u32, route::handed_over()) {
            Ok(a) => a,
            Err(why) => return Decap::Kernel(why),
        };
    // SAFETY: the context is the program's; the frame is longer than `hdr_len` (read above).
    if unsafe { bpf_xdp_adjust_head(ctx.as_ptr() as *mut _, hdr_len as i32) } != 0 {
        return Decap::Kernel(reason::ROUTE_OTHER);
    }
    match route_inner(&xdp_packet(ctx), Hook::Xdp, net) {
        Ok(()) => Decap::Forward(reason::VXLAN_DECAP),
        Err(why) => {
            // SAFETY: as above; growing back by what was taken.
            if unsafe { bpf_xdp_adjust_head(ctx.as_ptr() as *mut _, -(hdr_len as i32)) } != 0 {
                return Decap::Drop;
            }
            put_back(&xdp_packet(ctx), words, hdr_len, why)
        }
    }
}

/// TC ingress, in the tail program for UDP no stage took: as [`decap`], the outer headers
/// taken out with `bpf_skb_adjust_room`, for packets whose inner packet is of the outer
/// one's family (the skb's protocol stays). A GRO aggregate goes to the kernel's vxlan
/// device (counted `gro_to_kernel` among the VXLAN counters): its tunnel offload state would
/// outlive the outer headers.
#[inline(always)]
pub fn decap_tc(ctx: &TcContext) -> Decap {
    let pkt = tc_packet(ctx);
    let why = route::handed_over();
    // SAFETY: the context is the kernel's __sk_buff for the duration of the program.
    let ifindex = unsafe { (*(ctx.as_ptr() as *const __sk_buff)).ifindex };
    let (net, hdr_len, words) = match arriving(&pkt, ifindex, why) {
        Ok(a) => a,
        Err(why) => return Decap::Kernel(why),
    };
    if route::gso_size(&pkt, Hook::TcIngress) != 0 {
        count(vxlan_stat::GRO_TO_KERNEL);
        return Decap::Kernel(why);
    }
    // The inner Ethernet header, and the outer one's type (the outer IP version's).
    let (Some(eth), Some(outer_type)) = (
        pkt.load_now::<[u8; 14]>(hdr_len as usize),
        pkt.load_now::<[u8; 2]>(12),
    ) else {
        return Decap::Kernel(reason::VXLAN_MISS);
    };
    if [eth[12], eth[13]] != outer_type {
        return Decap::Kernel(reason::VXLAN_MISS);
    }
    // Out: the outer IP, UDP and VXLAN headers and the inner Ethernet header, after the
    // outer Ethernet header, which then takes the inner one's bytes.
    if ctx
        .adjust_room(-(hdr_len as i32), BPF_ADJ_ROOM_MAC, 0)
        .is_err()
    {
        return Decap::Kernel(reason::ROUTE_OTHER);
    }
    let inner = tc_packet(ctx);
    let routed = if inner.store(0, eth) {
        route_inner(&inner, Hook::TcIngress, net)
    } else {
        Err(reason::ROUTE_OTHER)
    };
    match routed {
        Ok(()) => Decap::Forward(reason::VXLAN_DECAP),
        Err(why) => {
            // The room comes back zeroed: the inner Ethernet header too.
            if ctx
                .adjust_room(hdr_len as i32, BPF_ADJ_ROOM_MAC, 0)
                .is_err()
                || !tc_packet(ctx).store(hdr_len as usize, eth)
            {
                return Decap::Drop;
            }
            put_back(&tc_packet(ctx), words, hdr_len, why)
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
    // Known in this generation: nothing to learn (the fast path's own packets, encapsulated
    // at TC, leave through here too).
    let current = fib::generation();
    // SAFETY: a live entry of the cache, read only.
    if peer(net.ifindex, mac).is_some_and(|e| unsafe { (*e).generation } == current) {
        return None;
    }
    let key = FP_VXLAN_KEY.get_ptr_mut(0)?;
    let value = FP_VXLAN_LEARN.get_ptr_mut(0)?;
    // SAFETY: this CPU's slots of per-CPU arrays, used by this program run only.
    let (key, value) = unsafe {
        (*key).ifindex = net.ifindex;
        (*key).mac = mac;
        (*key)._pad = [0; 2];
        (*value).generation = current;
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
