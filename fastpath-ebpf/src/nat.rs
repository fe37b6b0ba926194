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

use fastpath_common::csum;

use crate::{
    conntrack::{NAT_DSR, NAT_DST, NAT_SRC},
    maps::FP_NAT,
    packet::{Packet, be16},
    parse::{FAMILY_IPV4, IPPROTO_TCP, IPPROTO_UDP, Parsed},
};

/// Which end of the packet an address belongs to.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum End {
    Src,
    Dst,
}

/// Whether this CPU's `FP_NAT` plan is direct server return (no rewrite; see `dsr`).
#[inline(always)]
pub fn dsr_planned() -> bool {
    FP_NAT.get(0).is_some_and(|plan| plan.ends & NAT_DSR != 0)
}

/// Rewrites the packet as this CPU's `FP_NAT` plan says (see `conntrack::NatPlan`).
#[inline(always)]
pub fn rewrite(pkt: &Packet, p: &Parsed) -> bool {
    let Some(plan) = FP_NAT.get_ptr(0) else {
        return false;
    };
    // SAFETY: this CPU's slot of a per-CPU array, written by this program run.
    let plan = unsafe { &*plan };
    let (do_src, do_dst) = (plan.ends & NAT_SRC != 0, plan.ends & NAT_DST != 0);
    let (src_addr, dst_addr) = (addr_bytes(&plan.src_addr), addr_bytes(&plan.dst_addr));
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
    let mut l4c = old_l4;
    let mut new_ports = ports;
    if do_src {
        let port = plan.src_port;
        l4c = csum::replace2(l4c, be16([ports[0], ports[1]]), port);
        let b = port.to_be_bytes();
        new_ports[0] = b[0];
        new_ports[1] = b[1];
    }
    if do_dst {
        let port = plan.dst_port;
        l4c = csum::replace2(l4c, be16([ports[2], ports[3]]), port);
        let b = port.to_be_bytes();
        new_ports[2] = b[0];
        new_ports[3] = b[1];
    }
    let udp = p.l4_proto == IPPROTO_UDP;
    if p.family == FAMILY_IPV4 {
        let (Some(addrs), Some(old_ip)) =
            (pkt.load::<[u8; 8]>(l3 + 12), pkt.load::<[u8; 2]>(l3 + 10))
        else {
            return false;
        };
        let mut ip = be16(old_ip);
        let mut new_addrs = addrs;
        if do_src {
            let a = src_addr;
            let (old, new) = (
                [addrs[0], addrs[1], addrs[2], addrs[3]],
                [a[0], a[1], a[2], a[3]],
            );
            ip = csum::replace4(ip, old, new);
            l4c = csum::replace4(l4c, old, new);
            new_addrs[..4].copy_from_slice(&new);
        }
        if do_dst {
            let a = dst_addr;
            let (old, new) = (
                [addrs[4], addrs[5], addrs[6], addrs[7]],
                [a[0], a[1], a[2], a[3]],
            );
            ip = csum::replace4(ip, old, new);
            l4c = csum::replace4(l4c, old, new);
            new_addrs[4..].copy_from_slice(&new);
        }
        if udp {
            l4c = csum::udp_fixup(old_l4, l4c);
        }
        pkt.store(l3 + 12, new_addrs)
            && pkt.store(l3 + 10, ip.to_be_bytes())
            && pkt.store(l4, new_ports)
            && pkt.store(csum_off, l4c.to_be_bytes())
    } else {
        // verifier: one load and one store of both addresses (one bounds check each); two
        // stores let LLVM drop the second check as implied, which the verifier cannot follow.
        let Some(old) = pkt.load::<[u64; 4]>(l3 + 8) else {
            return false;
        };
        // SAFETY: [u64; 4] and [[u8; 16]; 2] are the same 32 bytes; any bits are valid.
        let [old_src, old_dst] = unsafe { core::mem::transmute::<[u64; 4], [[u8; 16]; 2]>(old) };
        let mut new = [old_src, old_dst];
        if do_src {
            l4c = csum::replace16(l4c, &old_src, &src_addr);
            new[0] = src_addr;
        }
        if do_dst {
            l4c = csum::replace16(l4c, &old_dst, &dst_addr);
            new[1] = dst_addr;
        }
        if udp {
            l4c = csum::udp_fixup(old_l4, l4c);
        }
        // SAFETY: as above.
        let new = unsafe { core::mem::transmute::<[[u8; 16]; 2], [u64; 4]>(new) };
        pkt.store_words(l3 + 8, new)
            && pkt.store(l4, new_ports)
            && pkt.store(csum_off, l4c.to_be_bytes())
    }
}

/// A copy of 16 address bytes of 8-aligned map memory, as two word loads. perf: a
/// `[u8; 16]` copy compiles to a memcpy call.
#[inline(always)]
fn addr_bytes(addr: &[u8; 16]) -> [u8; 16] {
    let words = (addr as *const [u8; 16]).cast::<u64>();
    // SAFETY: `addr` is 16 bytes of 8-aligned map memory (a CtNat, Backend or Service
    // address).
    let w = unsafe {
        [
            core::ptr::read_volatile(words),
            core::ptr::read_volatile(words.add(1)),
        ]
    };
    // SAFETY: two u64 are 16 bytes; any bytes are a valid [u8; 16].
    unsafe { core::mem::transmute::<[u64; 2], [u8; 16]>(w) }
}
