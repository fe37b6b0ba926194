//! NAT rewriting: one address and port of a parsed IPv4/IPv6 TCP/UDP packet, with the IPv4
//! header checksum and the L4 checksum (its pseudo-header and the port) updated
//! incrementally (`fastpath_common::csum`, RFC 1624). XDP only (direct packet writes).
//!
//! Contract: either every field and checksum is rewritten, or nothing is (all reads and
//! bounds checks happen before the first write) and the caller gets `false`. A UDP/IPv4
//! datagram without a checksum (0) keeps none.

use fastpath_common::csum;

use crate::{
    packet::{Packet, be16},
    parse::{FAMILY_IPV4, IPPROTO_TCP, IPPROTO_UDP, Parsed},
};

/// Which end of the packet to rewrite.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// Source address and port (replies translated back to the VIP).
    Src,
    /// Destination address and port (client packets translated to the backend).
    Dst,
}

/// Rewrites `end`'s address to `addr` (IPv4: its first 4 bytes) and its port to `port`.
#[inline(always)]
pub fn rewrite(pkt: &Packet, p: &Parsed, end: End, addr: &[u8; 16], port: u16) -> bool {
    let l3 = p.l3_off as usize;
    let l4 = p.l4_off as usize;
    let csum_off = match p.l4_proto {
        IPPROTO_TCP => l4 + 16,
        IPPROTO_UDP => l4 + 6,
        _ => return false,
    };
    let port_off = if end == End::Dst { l4 + 2 } else { l4 };
    let (Some(old_port), Some(old_l4)) =
        (pkt.load::<[u8; 2]>(port_off), pkt.load::<[u8; 2]>(csum_off))
    else {
        return false;
    };
    let old_l4 = be16(old_l4);
    let udp = p.l4_proto == IPPROTO_UDP;
    if p.family == FAMILY_IPV4 {
        let addr_off = if end == End::Dst { l3 + 16 } else { l3 + 12 };
        let (Some(old_addr), Some(old_ip)) =
            (pkt.load::<[u8; 4]>(addr_off), pkt.load::<[u8; 2]>(l3 + 10))
        else {
            return false;
        };
        let new_addr = [addr[0], addr[1], addr[2], addr[3]];
        let ip = csum::replace4(be16(old_ip), old_addr, new_addr);
        let mut l4c = csum::replace4(old_l4, old_addr, new_addr);
        l4c = csum::replace2(l4c, be16(old_port), port);
        if udp {
            l4c = csum::udp_fixup(old_l4, l4c);
        }
        pkt.store(addr_off, new_addr)
            && pkt.store(l3 + 10, ip.to_be_bytes())
            && pkt.store(port_off, port.to_be_bytes())
            && pkt.store(csum_off, l4c.to_be_bytes())
    } else {
        let addr_off = if end == End::Dst { l3 + 24 } else { l3 + 8 };
        let Some(old_addr) = pkt.load::<[u8; 16]>(addr_off) else {
            return false;
        };
        let mut l4c = csum::replace16(old_l4, &old_addr, addr);
        l4c = csum::replace2(l4c, be16(old_port), port);
        if udp {
            l4c = csum::udp_fixup(old_l4, l4c);
        }
        // perf: two 8-byte stores (a 16-byte array store compiles to a memmove call).
        let words = (addr as *const [u8; 16]).cast::<u64>();
        // SAFETY: `addr` is 16 bytes of 8-aligned map memory (a CtNat or Backend address).
        let (w0, w1) = unsafe {
            (
                core::ptr::read_volatile(words),
                core::ptr::read_volatile(words.add(1)),
            )
        };
        pkt.store16(addr_off, w0, w1)
            && pkt.store(port_off, port.to_be_bytes())
            && pkt.store(csum_off, l4c.to_be_bytes())
    }
}
