//! NAT rewriting: the destination and/or the source address and port of a parsed IPv4/IPv6
//! TCP/UDP packet, with the IPv4 header checksum and the L4 checksum (its pseudo-header and
//! the ports) updated incrementally (`fastpath_common::csum`, RFC 1624). XDP only (direct
//! packet writes).
//!
//! Contract: either every field and checksum is rewritten, or nothing is (all reads and
//! bounds checks happen before the first write) and the caller gets `false`. A UDP/IPv4
//! datagram without a checksum (0) keeps none.
//!
//! verifier: both ends are rewritten by one function with one load of each field; two
//! rewrites in a row let LLVM share a bounds check between them, which the verifier refuses.

use aya_ebpf::helpers::bpf_l4_csum_replace;
use fastpath_common::csum;

use crate::{
    ctx::{NAT_DSR, NAT_DST, NAT_ICMP_ERROR, NAT_ICMP_KEEP_SOURCE, NAT_SRC, NatPlan, words},
    maps::FP_NAT,
    packet::{Packet, be16, opaque},
    parse::{FAMILY_IPV4, IPPROTO_TCP, IPPROTO_UDP, Parsed},
};

/// `bpf_l4_csum_replace` flags (uapi `BPF_F_*`): the change is in the pseudo-header; a UDP
/// checksum of 0 stays 0 and a computed 0 becomes 0xffff; an IPv6 packet's.
const BPF_F_PSEUDO_HDR: u64 = 1 << 4;
const BPF_F_MARK_MANGLED_0: u64 = 1 << 5;
const BPF_F_IPV6: u64 = 1 << 7;

/// Whether this CPU's `FP_NAT` plan is an ICMP error's translation (see `icmp_error`).
#[inline(always)]
pub fn icmp_error_planned() -> bool {
    FP_NAT
        .get(0)
        .is_some_and(|plan| plan.ends & NAT_ICMP_ERROR != 0)
}

/// Whether this CPU's `FP_NAT` plan is direct server return (no rewrite; see `dsr`).
#[inline(always)]
pub fn dsr_planned() -> bool {
    FP_NAT.get(0).is_some_and(|plan| plan.ends & NAT_DSR != 0)
}

/// Rewrites the packet as this CPU's `FP_NAT` plan says (see `ctx::NatPlan`). At XDP
/// (`!tc`) the L4 checksum is written as computed; at TC it is updated by the kernel
/// (`bpf_l4_csum_replace`), which knows what this program cannot see: a partial checksum
/// (`CHECKSUM_PARTIAL`, as a local sender or a veth with transmit offloads passes it) holds
/// the pseudo-header's sum only, so the addresses change it and the ports do not; a complete
/// one (`CHECKSUM_COMPLETE`, from a NIC) needs the skb's sum of the data kept in step.
#[inline(always)]
pub fn rewrite(pkt: &Packet, p: &Parsed, tc: bool) -> bool {
    let Some(plan) = FP_NAT.get_ptr(0) else {
        return false;
    };
    // SAFETY: this CPU's slot of a per-CPU array, written by this program run.
    let plan = unsafe { &*plan };
    let (do_src, do_dst) = (plan.ends & NAT_SRC != 0, plan.ends & NAT_DST != 0);
    let l3 = p.l3_off as usize;
    let l4 = p.l4_off as usize;
    let csum_off = match p.l4_proto {
        IPPROTO_TCP => l4 + 16,
        IPPROTO_UDP => l4 + 6,
        _ => return false,
    };
    let (Some(ports), Some(old_l4)) = (pkt.load::<[u8; 4]>(l4), pkt.load::<[u8; 2]>(csum_off))
    else {
        return false;
    };
    let old_l4 = be16(old_l4);
    // The L4 checksum's changes: the ports', and the addresses' (its pseudo-header).
    let mut port_delta = 0;
    let mut addr_delta = 0;
    let mut new_ports = ports;
    if do_src {
        let port = plan.src_port;
        port_delta += csum::delta2(be16([ports[0], ports[1]]), port);
        let b = port.to_be_bytes();
        new_ports[0] = b[0];
        new_ports[1] = b[1];
    }
    if do_dst {
        let port = plan.dst_port;
        port_delta += csum::delta2(be16([ports[2], ports[3]]), port);
        let b = port.to_be_bytes();
        new_ports[2] = b[0];
        new_ports[3] = b[1];
    }
    let udp = p.l4_proto == IPPROTO_UDP;
    let v4 = p.family == FAMILY_IPV4;
    let written = if v4 {
        // Both addresses as one word, changed in place (as IPv6's below): no byte arrays on
        // a stack this program has no room on.
        let (Some(at), Some(old_ip)) = (pkt.words_at::<1>(l3 + 12), pkt.load::<[u8; 2]>(l3 + 10))
        else {
            return false;
        };
        // SAFETY: a word within the packet, checked by `words_at`; unaligned access is allowed
        // (see build.rs).
        let old = unsafe { core::ptr::read_unaligned(at) };
        // The word as it lies in memory: the source address is its low half (little-endian
        // BPF), the destination its high half; an address's first word holds an IPv4 one in
        // its low half.
        let mut new = old;
        if do_src {
            new = new & !0xffff_ffff | words(&plan.src_addr)[0] & 0xffff_ffff;
        }
        if do_dst {
            new = new & 0xffff_ffff | words(&plan.dst_addr)[0] << 32;
        }
        addr_delta = csum::delta8(old, new);
        // SAFETY: as the read above.
        unsafe { core::ptr::write_unaligned(at, new) };
        pkt.store(
            l3 + 10,
            csum::replace8(be16(old_ip), old, new).to_be_bytes(),
        ) && pkt.store(l4, new_ports)
    } else {
        // One bounds check for both addresses, then word by word in place: no copies on a
        // stack this program has no room on.
        let Some(at) = pkt.words_at::<4>(l3 + 8) else {
            return false;
        };
        // The change of word `i` of the addresses to `new`, made; its checksum delta.
        let swap = |i: usize, new: u64| {
            // SAFETY: `i` < 4: within the words `words_at` checked; unaligned access is
            // allowed (see build.rs).
            unsafe {
                let old = core::ptr::read_unaligned(at.add(i));
                core::ptr::write_unaligned(at.add(i), new);
                csum::delta8(old, new)
            }
        };
        if do_src {
            let a = words(&plan.src_addr);
            addr_delta += swap(0, a[0]) + swap(1, a[1]);
        }
        if do_dst {
            let a = words(&plan.dst_addr);
            addr_delta += swap(2, a[0]) + swap(3, a[1]);
        }
        pkt.store(l4, new_ports)
    };
    if !written {
        return false;
    }
    if tc {
        return l4_checksum_tc(pkt, csum_off, udp, v4, addr_delta, port_delta);
    }
    let mut l4c = csum::apply(old_l4, addr_delta + port_delta);
    if udp {
        l4c = csum::udp_fixup(old_l4, l4c);
    }
    pkt.store(csum_off, l4c.to_be_bytes())
}

/// Has the kernel update the L4 checksum at `csum_off` of a TC packet for changes of its
/// pseudo-header (`addr_delta`) and of the covered data (`port_delta`), as `csum::apply`
/// takes them. UDP without a checksum keeps none; a computed 0 is sent as 0xffff.
#[inline(always)]
fn l4_checksum_tc(
    pkt: &Packet,
    csum_off: usize,
    udp: bool,
    v4: bool,
    addr_delta: u64,
    port_delta: u64,
) -> bool {
    let zero = if udp { BPF_F_MARK_MANGLED_0 } else { 0 };
    // An IPv6 address is not under a header checksum: in a complete checksum its change
    // cancels the L4 checksum's (BPF_F_IPV6 keeps the skb's sum as it is).
    let family = if v4 { 0 } else { BPF_F_IPV6 };
    // The kernel adds `to` to the checksum as a 32-bit ones'-complement sum in the packet's
    // byte order (size 0: `to` is such a difference, `from` must be 0).
    let as_diff = |delta: u64| u64::from(csum::fold(delta).to_be());
    // SAFETY: the context is this TC program's skb; the helper checks the offset against it.
    // It may move packet data: nothing reads the packet through `pkt` after these calls.
    unsafe {
        bpf_l4_csum_replace(
            pkt.ctx.cast(),
            csum_off as u32,
            0,
            as_diff(addr_delta),
            BPF_F_PSEUDO_HDR | zero | family,
        ) == 0
            && bpf_l4_csum_replace(
                pkt.ctx.cast(),
                csum_off as u32,
                0,
                as_diff(port_delta),
                zero,
            ) == 0
    }
}

/// Translates an ICMP/ICMPv6 error about a packet a backend was sent, as this CPU's `FP_NAT`
/// plan says (see `NAT_ICMP_ERROR`): the quoted packet's destination becomes the VIP and, with
/// `NAT_DST`, its source the client; the error's own source becomes the VIP (unless
/// `NAT_ICMP_KEEP_SOURCE`) and, with `NAT_DST`, its destination the client. Every checksum
/// follows incrementally: the quoted IPv4 header's, the quoted TCP/UDP checksum when it is
/// in the quote (UDP without one keeps none), the ICMP checksum over all of it (ICMPv6: with
/// its pseudo-header) and the outer IPv4 header's. Quoted TCP/UDP only (the conntrack stage
/// checked the quote reaches the ports). All reads before the first write.
///
/// `v4` says which of the two tail programs runs this (each has its own stack: both
/// variants in one do not fit 512 bytes); a packet of the other family is refused.
#[inline(always)]
pub fn icmp_error(pkt: &Packet, p: &Parsed, v4: bool) -> bool {
    if (p.family == FAMILY_IPV4) != v4 {
        return false;
    }
    let Some(plan) = FP_NAT.get(0) else {
        return false;
    };
    let to_client = plan.ends & NAT_DST != 0;
    let from_vip = plan.ends & NAT_ICMP_KEEP_SOURCE == 0;
    let end = p.l3_end as usize;
    // verifier: each region's offset is read afresh (volatile), so LLVM cannot derive one
    // region's bounds check from another's and drop it; within a region, one load and one
    // store share one checked pointer.
    let off = |f: &u32| {
        // SAFETY: a read of this CPU's packet context.
        unsafe { core::ptr::read_volatile(f) as usize }
    };
    let icmp = off(&p.l4_off);
    let Some(ih) = pkt.load_now::<[u8; 4]>(icmp) else {
        return false;
    };
    let inner = off(&p.l4_off) + 8;
    let mut ic = be16([ih[2], ih[3]]);
    if v4 {
        let Some(q) = pkt.load_now::<[u8; 20]>(inner) else {
            return false;
        };
        let i4 = off(&p.l4_off) + 8 + ((q[0] & 0x0f) as usize) * 4;
        let udp = q[9] == IPPROTO_UDP;
        let Some(l4) = pkt.load_now::<[u8; 8]>(i4) else {
            return false;
        };
        let o3 = off(&p.l3_off);
        let Some(o) = pkt.load_now::<[u8; 12]>(o3 + 8) else {
            return false;
        };
        let (tcp_c_off, tcp_c) = quoted_tcp_checksum(pkt, i4, udp, end);
        let v = [
            plan.src_addr[0],
            plan.src_addr[1],
            plan.src_addr[2],
            plan.src_addr[3],
        ];
        let c = [
            plan.dst_addr[0],
            plan.dst_addr[1],
            plan.dst_addr[2],
            plan.dst_addr[3],
        ];
        let old_isrc = [q[12], q[13], q[14], q[15]];
        let old_idst = [q[16], q[17], q[18], q[19]];
        let new_isrc = if to_client { c } else { old_isrc };
        let [sp0, dp0, sp1, dp1] = quoted_ports(&l4, plan, to_client);
        // The quoted L4 checksum: UDP's in the first 8 bytes (0: none), TCP's at 16 if quoted.
        // verifier: a flag beside a plain value, not an Option (see the IPv6 branch; as an
        // Option here, Linux 5.15 refused the read of its undefined payload, 6.1 took it).
        let udp_c = be16([l4[6], l4[7]]);
        let (has_l4c, old_l4c) = match tcp_c {
            _ if udp => (udp_c != 0, udp_c),
            Some(c) => (true, c),
            None => (false, 0),
        };
        let mut new_l4c = csum::replace4(csum::replace4(old_l4c, old_idst, v), old_isrc, new_isrc);
        new_l4c = csum::replace2(csum::replace2(new_l4c, sp0, sp1), dp0, dp1);
        if udp {
            new_l4c = csum::udp_fixup(old_l4c, new_l4c);
        }
        let old_ic3 = be16([q[10], q[11]]);
        let new_ic3 = csum::replace4(csum::replace4(old_ic3, old_idst, v), old_isrc, new_isrc);
        ic = csum::replace4(csum::replace4(ic, old_idst, v), old_isrc, new_isrc);
        ic = csum::replace2(ic, old_ic3, new_ic3);
        ic = csum::replace2(csum::replace2(ic, sp0, sp1), dp0, dp1);
        if has_l4c {
            ic = csum::replace2(ic, old_l4c, new_l4c);
        }
        let old_osrc = [o[4], o[5], o[6], o[7]];
        let old_odst = [o[8], o[9], o[10], o[11]];
        let new_osrc = if from_vip { v } else { old_osrc };
        let new_odst = if to_client { c } else { old_odst };
        let oc = csum::replace4(
            csum::replace4(be16([o[2], o[3]]), old_osrc, new_osrc),
            old_odst,
            new_odst,
        );
        // Outer: checksum and addresses (bytes 10..20 of the header).
        let mut out = [0u8; 10];
        out[..2].copy_from_slice(&oc.to_be_bytes());
        out[2..6].copy_from_slice(&new_osrc);
        out[6..].copy_from_slice(&new_odst);
        // Quoted header: checksum and addresses.
        let mut qh = [0u8; 10];
        qh[..2].copy_from_slice(&new_ic3.to_be_bytes());
        qh[2..6].copy_from_slice(&new_isrc);
        qh[6..].copy_from_slice(&v);
        // Quoted L4: ports, and UDP's checksum.
        let ql4 = quoted_l4(l4, sp1, dp1, udp && has_l4c, new_l4c);
        pkt.store(opaque(o3 + 10), out)
            && pkt.store(opaque(inner + 10), qh)
            && pkt.store(opaque(i4), ql4)
            && (udp || !has_l4c || pkt.store(opaque(tcp_c_off), new_l4c.to_be_bytes()))
            && pkt.store(opaque(icmp + 2), ic.to_be_bytes())
    } else {
        // verifier/stack: addresses as pairs of words, never 16-byte arrays (see
        // `csum::replace8`).
        let Some(q) = pkt.load_now::<[u64; 4]>(inner + 8) else {
            return false;
        };
        // verifier: 8 bytes, not the 1 needed (LLVM turns a 1-byte check into `p >= end`,
        // from which the verifier learns no readable length).
        let Some(h) = pkt.load_now::<[u8; 8]>(off(&p.l4_off) + 8) else {
            return false;
        };
        let udp = h[6] == IPPROTO_UDP;
        let i4 = off(&p.l4_off) + 8 + 40;
        let Some(l4) = pkt.load_now::<[u8; 8]>(i4) else {
            return false;
        };
        let o3 = off(&p.l3_off);
        let Some(o) = pkt.load_now::<[u64; 4]>(o3 + 8) else {
            return false;
        };
        let (tcp_c_off, tcp_c) = quoted_tcp_checksum(pkt, i4, udp, end);
        let (v, c) = (words(&plan.src_addr), words(&plan.dst_addr));
        let isrc = if to_client { c } else { [q[0], q[1]] };
        let osrc = if from_vip { v } else { [o[0], o[1]] };
        let odst = if to_client { c } else { [o[2], o[3]] };
        let new_outer = [osrc[0], osrc[1], odst[0], odst[1]];
        let new_inner = [isrc[0], isrc[1], v[0], v[1]];
        let [sp0, dp0, sp1, dp1] = quoted_ports(&l4, plan, to_client);
        let udp_c = be16([l4[6], l4[7]]);
        // UDP over IPv6 always has a checksum. verifier: a flag beside a plain value, not an
        // Option: LLVM stored the None case's undefined payload, which the verifier refuses
        // to read.
        let (has_l4c, old_l4c) = match tcp_c {
            _ if udp => (true, udp_c),
            Some(c) => (true, c),
            None => (false, 0),
        };
        let mut new_l4c = old_l4c;
        // verifier: unrolled by hand. As a loop, LLVM laid one out whose back-edge is a
        // fall-through, which Linux 6.1 refuses ("back-edge from insn").
        (ic, new_l4c) = address_word(ic, new_l4c, [o[0], new_outer[0]], [q[0], new_inner[0]]);
        (ic, new_l4c) = address_word(ic, new_l4c, [o[1], new_outer[1]], [q[1], new_inner[1]]);
        (ic, new_l4c) = address_word(ic, new_l4c, [o[2], new_outer[2]], [q[2], new_inner[2]]);
        (ic, new_l4c) = address_word(ic, new_l4c, [o[3], new_outer[3]], [q[3], new_inner[3]]);
        new_l4c = csum::replace2(csum::replace2(new_l4c, sp0, sp1), dp0, dp1);
        ic = csum::replace2(csum::replace2(ic, sp0, sp1), dp0, dp1);
        if has_l4c {
            ic = csum::replace2(ic, old_l4c, new_l4c);
        }
        let ql4 = quoted_l4(l4, sp1, dp1, udp, new_l4c);
        pkt.store_words(opaque(o3 + 8), new_outer)
            && pkt.store_words(opaque(inner + 8), new_inner)
            && pkt.store(opaque(i4), ql4)
            && (udp || !has_l4c || pkt.store(opaque(tcp_c_off), new_l4c.to_be_bytes()))
            && pkt.store(opaque(icmp + 2), ic.to_be_bytes())
    }
}

/// The ICMPv6 and quoted L4 checksums after one address word changes: `outer` (old, new) of
/// the outer header, which the ICMPv6 checksum's pseudo-header covers, and `quoted` of the
/// quoted header, which both cover.
#[inline(always)]
fn address_word(ic: u16, l4c: u16, outer: [u64; 2], quoted: [u64; 2]) -> (u16, u16) {
    let ic = csum::replace8(ic, outer[0], outer[1]);
    (
        csum::replace8(ic, quoted[0], quoted[1]),
        csum::replace8(l4c, quoted[0], quoted[1]),
    )
}

/// The quoted TCP/UDP header's ports before and after the translation: source, destination,
/// new source (the client's, with `to_client`), new destination (the VIP's port).
#[inline(always)]
fn quoted_ports(l4: &[u8; 8], plan: &NatPlan, to_client: bool) -> [u16; 4] {
    let (sp0, dp0) = (be16([l4[0], l4[1]]), be16([l4[2], l4[3]]));
    let sp1 = if to_client { plan.dst_port } else { sp0 };
    [sp0, dp0, sp1, plan.src_port]
}

/// The quoted TCP/UDP header's first 8 bytes after the translation: the new ports and, with
/// `set_udp_checksum`, UDP's new checksum `udp_checksum`.
#[inline(always)]
fn quoted_l4(
    l4: [u8; 8],
    sp1: u16,
    dp1: u16,
    set_udp_checksum: bool,
    udp_checksum: u16,
) -> [u8; 8] {
    let mut q = l4;
    q[..2].copy_from_slice(&sp1.to_be_bytes());
    q[2..4].copy_from_slice(&dp1.to_be_bytes());
    if set_udp_checksum {
        q[6..].copy_from_slice(&udp_checksum.to_be_bytes());
    }
    q
}

/// Where a quoted TCP header's checksum lies (`i4 + 16`) and its value, if the quote (ending at
/// `end`) includes it; nothing for UDP.
#[inline(always)]
fn quoted_tcp_checksum(pkt: &Packet, i4: usize, udp: bool, end: usize) -> (usize, Option<u16>) {
    let off = opaque(i4 + 16);
    if udp {
        return (off, None);
    }
    let c = pkt
        .load_now::<[u8; 2]>(off)
        .filter(|_| off + 2 <= end)
        .map(be16);
    (off, c)
}
