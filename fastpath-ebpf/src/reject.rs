//! `no_backend = "reject"`: a new connection to a service with no backend available is
//! answered, out of the interface it came in on — a TCP RST as RFC 793 builds one for a
//! segment that reaches a closed port, or for UDP an ICMP (type 3 code 3) / ICMPv6 (type 1
//! code 4) port unreachable quoting the datagram's IP header and first 8 bytes. The packet is
//! rewritten in place (trimmed, or grown at the head for the quote) with full checksums.
//!
//! Sent by a redirect to the ingress interface rather than XDP_TX: the same on a NIC, but a
//! veth flushes XDP_TX frames to its peer only when the peer runs XDP itself, while a redirect
//! is flushed at once.
//!
//! Runs as tail programs of `fastpath_xdp` (its stack has no room for this). Refuses (the
//! caller drops) what it does not answer: a RST, an IPv4 header with options, IPv6 extension
//! headers, a UDP datagram behind VLAN tags.

use aya_ebpf::{
    EbpfContext as _,
    bindings::xdp_action,
    helpers::{bpf_redirect, bpf_xdp_adjust_head, bpf_xdp_adjust_tail},
    programs::XdpContext,
};
use fastpath_common::{
    Hook, Verdict,
    csum::{finish, sum_bytes},
    reason,
};

use crate::{
    maps::FP_PKT_CTX,
    packet::{opaque, xdp_packet},
    parse::{FAMILY_IPV4, IPPROTO_TCP, IPPROTO_UDP, Parsed},
    stats, vlan,
};

const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;
const ETH_LEN: usize = 14;

/// Answers the packet (IPv4 if `v4`, else IPv6) and counts it: forward/`lb_rejected`, or
/// drop/`lb_no_backend` when it cannot be answered.
#[inline(always)]
pub fn answer(ctx: &XdpContext, v4: bool) -> u32 {
    let len = xdp_packet(ctx).len;
    let answered = match FP_PKT_CTX.get(0) {
        Some(p) if (p.family == FAMILY_IPV4) == v4 => match p.l4_proto {
            IPPROTO_TCP => rst(ctx, p, v4),
            IPPROTO_UDP => unreachable(ctx, p, v4),
            _ => false,
        },
        _ => false,
    };
    // SAFETY: the context is this program's; the ifindex is the one the packet came in on.
    let ifindex = unsafe { (*ctx.ctx).ingress_ifindex };
    // On an 802.1Q port the answer leaves with the tag the question came with.
    let answered = answered
        && match vlan::port(ifindex, vlan::ANY) {
            Some(vid) => vlan::push_xdp(ctx, vid),
            None => true,
        };
    if answered {
        stats::count(Hook::Xdp, Verdict::Forward, reason::LB_REJECTED, len);
        // SAFETY: bpf_redirect has no preconditions; it returns the XDP action to take.
        unsafe { bpf_redirect(ifindex, 0) as u32 }
    } else {
        stats::count(Hook::Xdp, Verdict::Drop, reason::LB_NO_BACKEND, len);
        xdp_action::XDP_DROP
    }
}

/// Trims the packet to `want` bytes (it is never grown here).
#[inline(always)]
fn trim(ctx: &XdpContext, have: usize, want: usize) -> bool {
    if have < want {
        return false;
    }
    let delta = want as i32 - have as i32;
    // SAFETY: the context is this program's; a negative delta shrinks the packet.
    delta == 0 || unsafe { bpf_xdp_adjust_tail(ctx.as_ptr().cast(), delta) } == 0
}

/// Writes the Ethernet addresses swapped (`macs` as the packet had them). verifier: two
/// 6-byte stores of loaded values, no 12-byte array assembled on the stack (its unaligned
/// slots are refused).
#[inline(always)]
fn store_swapped(pkt: &crate::packet::Packet, macs: [u8; 12]) -> bool {
    let dst = [macs[6], macs[7], macs[8], macs[9], macs[10], macs[11]];
    let src = [macs[0], macs[1], macs[2], macs[3], macs[4], macs[5]];
    pkt.store(0, dst) && pkt.store(6, src)
}

/// The TCP RST for the segment: from its destination to its source, `<SEQ=SEG.ACK><RST>` if it
/// carried an ACK, else `<SEQ=0><ACK=SEG.SEQ+SEG.LEN><RST,ACK>`.
#[inline(always)]
fn rst(ctx: &XdpContext, p: &Parsed, v4: bool) -> bool {
    let pkt = xdp_packet(ctx);
    let (l3, l4) = (opaque(p.l3_off as usize), opaque(p.l4_off as usize));
    // verifier: one load and its check at a time. Checked as a pair, LLVM kept the bytes of
    // the failed load's undefined value on the stack and read them back on a path where they
    // were never written, which Linux 5.15 refuses ("invalid read from stack"; 6.1 took it).
    let Some(macs) = pkt.load_now::<[u8; 12]>(0) else {
        return false;
    };
    let Some(th) = pkt.load_now::<[u8; 16]>(l4) else {
        return false;
    };
    let flags_in = th[13];
    if flags_in & TCP_RST != 0 {
        return false;
    }
    let doff = ((th[12] >> 4) as u32) * 4;
    // Source and destination addresses (16 bytes, IPv4 in the first 4) and the IP payload.
    let mut src = [0u8; 16];
    let mut dst = [0u8; 16];
    let ip_payload = if v4 {
        let Some(ih) = pkt.load_now::<[u8; 20]>(l3) else {
            return false;
        };
        if ih[0] != 0x45 {
            return false;
        }
        src[..4].copy_from_slice(&ih[12..16]);
        dst[..4].copy_from_slice(&ih[16..20]);
        u32::from(u16::from_be_bytes([ih[2], ih[3]])).saturating_sub(20)
    } else {
        let Some(ih) = pkt.load_now::<[u8; 40]>(l3) else {
            return false;
        };
        if l4 != l3 + 40 {
            return false;
        }
        src.copy_from_slice(&ih[8..24]);
        dst.copy_from_slice(&ih[24..40]);
        u32::from(u16::from_be_bytes([ih[4], ih[5]]))
    };
    let seg_len = ip_payload.saturating_sub(doff)
        + u32::from(flags_in & TCP_SYN != 0)
        + u32::from(flags_in & TCP_FIN != 0);
    let seq_in = u32::from_be_bytes([th[4], th[5], th[6], th[7]]);
    let ack_in = u32::from_be_bytes([th[8], th[9], th[10], th[11]]);
    let (seq, ack, flags) = if flags_in & TCP_ACK != 0 {
        (ack_in, 0, TCP_RST)
    } else {
        (0, seq_in.wrapping_add(seg_len), TCP_RST | TCP_ACK)
    };
    if !trim(ctx, pkt.len, l4 + 20) {
        return false;
    }
    let pkt = xdp_packet(ctx);
    let mut tcp = [0u8; 20];
    tcp[..2].copy_from_slice(&th[2..4]);
    tcp[2..4].copy_from_slice(&th[0..2]);
    tcp[4..8].copy_from_slice(&seq.to_be_bytes());
    tcp[8..12].copy_from_slice(&ack.to_be_bytes());
    tcp[12] = 0x50;
    tcp[13] = flags;
    // Pseudo-header: addresses, protocol, TCP length (20).
    let addrs = if v4 {
        sum_bytes(&src[..4]) + sum_bytes(&dst[..4])
    } else {
        sum_bytes(&src) + sum_bytes(&dst)
    };
    let c = finish(addrs + u64::from(IPPROTO_TCP) + 20 + sum_bytes(&tcp));
    tcp[16..18].copy_from_slice(&c.to_be_bytes());
    // verifier: the Ethernet store first — after the IP header's, LLVM would drop its bounds
    // check as implied (a header at any offset ends past byte 12).
    if !store_swapped(&pkt, macs) {
        return false;
    }
    let ip_ok = if v4 {
        let mut ip = [
            0x45,
            0,
            0,
            40,
            0,
            0,
            0x40,
            0,
            64,
            IPPROTO_TCP,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
        ];
        ip[12..16].copy_from_slice(&dst[..4]);
        ip[16..20].copy_from_slice(&src[..4]);
        let c = finish(sum_bytes(&ip));
        ip[10..12].copy_from_slice(&c.to_be_bytes());
        pkt.store(opaque(l3), ip)
    } else {
        let mut ip = [0u8; 40];
        ip[0] = 0x60;
        ip[5] = 20;
        ip[6] = IPPROTO_TCP;
        ip[7] = 64;
        ip[8..24].copy_from_slice(&dst);
        ip[24..40].copy_from_slice(&src);
        pkt.store(opaque(l3), ip)
    };
    ip_ok && pkt.store(opaque(l4), tcp)
}

/// The port unreachable for the datagram: the packet grows at the head by the new IP and
/// ICMP headers, so its own IP header and first 8 bytes are where the quote goes, and is
/// trimmed after them.
#[inline(always)]
fn unreachable(ctx: &XdpContext, p: &Parsed, v4: bool) -> bool {
    let pkt = xdp_packet(ctx);
    let (l3, l4) = (p.l3_off as usize, p.l4_off as usize);
    let ip_len = if v4 { 20 } else { 40 };
    // No VLAN tags (the new Ethernet header is written plain), no IP options or extension
    // headers (the quote is the IP header and 8 bytes).
    if l3 != ETH_LEN || l4 != ETH_LEN + ip_len {
        return false;
    }
    // verifier: one load and its check at a time (see `rst`).
    let Some(macs) = pkt.load_now::<[u8; 12]>(0) else {
        return false;
    };
    let Some(uh) = pkt.load_now::<[u8; 8]>(opaque(l4)) else {
        return false;
    };
    if v4 {
        let Some(ih) = pkt.load_now::<[u8; 20]>(opaque(l3)) else {
            return false;
        };
        if ih[0] != 0x45 {
            return false;
        }
        // New IPv4 header (20) and ICMP header (8) before the old IP header.
        // SAFETY: the context is this program's; a negative delta grows the packet's head.
        if unsafe { bpf_xdp_adjust_head(ctx.as_ptr().cast(), -28) } != 0 {
            return false;
        }
        if !trim(ctx, xdp_packet(ctx).len, ETH_LEN + 20 + 8 + 20 + 8) {
            return false;
        }
        let pkt = xdp_packet(ctx);
        let mut ip = [
            0x45, 0, 0, 56, 0, 0, 0x40, 0, 64, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        ];
        ip[12..16].copy_from_slice(&ih[16..20]);
        ip[16..20].copy_from_slice(&ih[12..16]);
        let c = finish(sum_bytes(&ip));
        ip[10..12].copy_from_slice(&c.to_be_bytes());
        let mut icmp = [3u8, 3, 0, 0, 0, 0, 0, 0];
        let c = finish(sum_bytes(&icmp) + sum_bytes(&ih) + sum_bytes(&uh));
        icmp[2..4].copy_from_slice(&c.to_be_bytes());
        store_swapped(&pkt, macs)
            && pkt.store(12, [0x08u8, 0x00])
            && pkt.store(opaque(ETH_LEN), ip)
            && pkt.store(opaque(34), icmp)
    } else {
        let Some(ih) = pkt.load_now::<[u8; 40]>(opaque(l3)) else {
            return false;
        };
        // New IPv6 header (40) and ICMPv6 header (8) before the old IP header.
        // SAFETY: as above.
        if unsafe { bpf_xdp_adjust_head(ctx.as_ptr().cast(), -48) } != 0 {
            return false;
        }
        if !trim(ctx, xdp_packet(ctx).len, ETH_LEN + 40 + 8 + 40 + 8) {
            return false;
        }
        let pkt = xdp_packet(ctx);
        let mut ip = [0u8; 40];
        ip[0] = 0x60;
        ip[5] = 56;
        ip[6] = 58;
        ip[7] = 64;
        ip[8..24].copy_from_slice(&ih[24..40]);
        ip[24..40].copy_from_slice(&ih[8..24]);
        let mut icmp = [1u8, 4, 0, 0, 0, 0, 0, 0];
        // Pseudo-header: addresses, length (56), next header (58).
        let pseudo = sum_bytes(&ip[8..40]) + 56 + 58;
        let c = finish(pseudo + sum_bytes(&icmp) + sum_bytes(&ih) + sum_bytes(&uh));
        icmp[2..4].copy_from_slice(&c.to_be_bytes());
        store_swapped(&pkt, macs)
            && pkt.store(12, [0x86u8, 0xdd])
            && pkt.store(opaque(ETH_LEN), ip)
            && pkt.store(opaque(54), icmp)
    }
}
