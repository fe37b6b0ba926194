//! Parse stage: Ethernet, up to two VLAN tags, IPv4 (IHL, options, fragments), IPv6 (bounded
//! walk over hop-by-hop, routing, destination-options and fragment headers), TCP, UDP, ICMP,
//! ICMPv6.
//!
//! Contract: on `Ok` every offset in [`Parsed`] points at a header that is fully inside the
//! frame and consistent with the IP length fields; on `Err` the code says why the packet is not
//! for the fast path (see `fastpath_common::reason`). Nothing here writes to the packet.

use fastpath_common::reason;

use crate::packet::{MAX_HDR_OFF, Packet, be16};

pub const ETH_HLEN: usize = 14;
pub const ETH_P_IPV4: u16 = 0x0800;
pub const ETH_P_IPV6: u16 = 0x86dd;
pub const ETH_P_ARP: u16 = 0x0806;
pub const ETH_P_8021Q: u16 = 0x8100;
pub const ETH_P_8021AD: u16 = 0x88a8;
/// Pre-standard QinQ outer tag, still seen on switches.
pub const ETH_P_QINQ_9100: u16 = 0x9100;

pub const IPPROTO_HOPOPTS: u8 = 0;
pub const IPPROTO_ICMP: u8 = 1;
pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;
pub const IPPROTO_ROUTING: u8 = 43;
pub const IPPROTO_FRAGMENT: u8 = 44;
pub const IPPROTO_ICMPV6: u8 = 58;
pub const IPPROTO_DSTOPTS: u8 = 60;

/// Frames longer than this cannot carry a 16-bit IP length: a zero length then means BIG TCP
/// or a jumbogram, not a malformed header.
const JUMBO_LEN: usize = 65_535 + ETH_HLEN + 8;

/// IPv6 extension headers walked before giving up (each costs a bounded loop iteration).
pub const MAX_IPV6_EXT: usize = 6;
/// VLAN tags honoured (802.1Q, 802.1ad/QinQ).
pub const MAX_VLAN: usize = 2;

pub const FAMILY_IPV4: u8 = 4;
pub const FAMILY_IPV6: u8 = 6;

/// What the parser learned. Offsets are from the start of the frame.
#[derive(Clone, Copy)]
pub struct Parsed {
    pub vlan_count: u8,
    /// `FAMILY_IPV4` or `FAMILY_IPV6`.
    pub family: u8,
    /// Final next-header / protocol after extension headers.
    pub l4_proto: u8,
    /// Non-zero when the packet is (part of) a fragment; L4 fields are then not parsed.
    pub fragment: u8,
    /// Offsets are u32: at TC a GSO packet's IP length is up to 64 KiB, plus L2 headers.
    pub l3_off: u32,
    pub l4_off: u32,
    /// End of the IP packet per its length field (the frame may carry padding beyond it).
    pub l3_end: u32,
    /// TCP flags byte (FIN 0x01, SYN 0x02, RST 0x04, PSH 0x08, ACK 0x10, ...).
    pub tcp_flags: u8,
    pub icmp_type: u8,
    pub icmp_code: u8,
    pub _pad: u8,
    /// Source/destination ports (TCP/UDP) or ICMP echo identifier in `src_port`, host order.
    pub src_port: u16,
    pub dst_port: u16,
    /// VLAN TCIs, outermost first, host order.
    pub vlan_tci: [u16; MAX_VLAN],
    /// Pads the struct to whole u64 words for [`Parsed::reset`].
    pub _pad2: u32,
    // Addresses are not copied here: a stage that needs them reads them from the packet at
    // `l3_off`, so packets that no stage looks at do not pay for the copy.
}
const _: () = assert!(core::mem::size_of::<Parsed>() % 8 == 0);
const _: () = assert!(core::mem::align_of::<Parsed>() <= 8);

impl Parsed {
    /// Whether this is a TCP segment (not a fragment: those carry no parsed flags) whose flag
    /// combination Linux's conntrack calls invalid (`ct::tcp_flags_valid`).
    #[inline(always)]
    pub fn tcp_flags_invalid(&self) -> bool {
        self.l4_proto == IPPROTO_TCP
            && self.fragment == 0
            && !fastpath_common::ct::tcp_flags_valid(self.tcp_flags)
    }

    /// Zeroes every field in place with word stores. verifier/perf: a struct assignment
    /// becomes an out-of-line BPF `memset` call, and a BPF-to-BPF call is costly where `ret`
    /// is mitigated (AMD SRSO "Safe RET": tens of ns per packet).
    #[inline(always)]
    pub fn reset(&mut self) {
        let words = (self as *mut Parsed).cast::<u64>();
        let mut i = 0;
        while i < core::mem::size_of::<Parsed>() / 8 {
            // SAFETY: `i` stays within the struct, which is a whole number of u64 words and
            // at least u64-aligned where it lives (a per-CPU map value, 8-aligned); every bit
            // pattern of zeroes is a valid Parsed.
            unsafe { core::ptr::write_volatile(words.add(i), 0) };
            i += 1;
        }
    }
}

/// Why a header could not be read at `off`: truncated frame (malformed), beyond the parser's
/// window, or, in TC, bytes that exist but are outside the linear area (the kernel can still
/// handle the last two).
#[inline(always)]
fn missing(pkt: &Packet, off: usize, need: usize, trunc_reason: u32) -> u32 {
    if !pkt.within_frame(off, need) {
        trunc_reason
    } else if off > MAX_HDR_OFF {
        reason::HEADERS_TOO_DEEP
    } else {
        reason::HEADERS_NOT_LINEAR
    }
}

#[inline(always)]
fn is_vlan_tpid(ethertype: u16) -> bool {
    ethertype == ETH_P_8021Q || ethertype == ETH_P_8021AD || ethertype == ETH_P_QINQ_9100
}

/// Parses the headers of `pkt` into `p` (fully overwritten). `Err(code)` carries a `reason`
/// code; `p` is then partly filled and must not be used.
#[inline(always)]
pub fn parse(pkt: &Packet, p: &mut Parsed) -> Result<(), u32> {
    p.reset();

    let eth: [u8; ETH_HLEN] = match pkt.load(0) {
        Some(h) => h,
        None => return Err(missing(pkt, 0, ETH_HLEN, reason::TRUNC_ETH)),
    };
    let mut ethertype = be16([eth[12], eth[13]]);
    let mut off = ETH_HLEN;

    // verifier: two explicit iterations instead of a loop; deeper stacks go to the kernel.
    if is_vlan_tpid(ethertype) {
        let tag: [u8; 4] = pkt
            .load(off)
            .ok_or_else(|| missing(pkt, off, 4, reason::TRUNC_VLAN))?;
        p.vlan_tci[0] = be16([tag[0], tag[1]]);
        ethertype = be16([tag[2], tag[3]]);
        p.vlan_count = 1;
        off += 4;
        if is_vlan_tpid(ethertype) {
            let tag: [u8; 4] = pkt
                .load(off)
                .ok_or_else(|| missing(pkt, off, 4, reason::TRUNC_VLAN))?;
            p.vlan_tci[1] = be16([tag[0], tag[1]]);
            ethertype = be16([tag[2], tag[3]]);
            p.vlan_count = 2;
            off += 4;
            if is_vlan_tpid(ethertype) {
                return Err(reason::VLAN_TOO_DEEP);
            }
        }
    }

    p.l3_off = off as u32;
    match ethertype {
        ETH_P_IPV4 => parse_ipv4(pkt, off, p)?,
        ETH_P_IPV6 => parse_ipv6(pkt, off, p)?,
        ETH_P_ARP => return Err(reason::ARP),
        _ => return Err(reason::NON_IP),
    }
    if p.fragment != 0 {
        return Ok(());
    }
    parse_l4(pkt, p)
}

#[inline(always)]
fn parse_ipv4(pkt: &Packet, off: usize, p: &mut Parsed) -> Result<(), u32> {
    let h: [u8; 20] = pkt
        .load(off)
        .ok_or_else(|| missing(pkt, off, 20, reason::TRUNC_IPV4))?;
    if h[0] >> 4 != 4 {
        return Err(reason::BAD_IP_VERSION);
    }
    let ihl = (h[0] & 0x0f) as usize;
    if ihl < 5 {
        return Err(reason::BAD_IPV4_IHL);
    }
    let hdr_len = ihl * 4;
    if hdr_len > 20 {
        // Options present: the whole header must be in the frame.
        if !pkt.within_frame(off, hdr_len) {
            return Err(reason::TRUNC_IPV4);
        }
    }
    let total_len = be16([h[2], h[3]]) as usize;
    if total_len == 0 && pkt.len > JUMBO_LEN {
        // BIG TCP: the kernel's GSO super-packets over 64 KiB carry a zero length.
        return Err(reason::GSO_JUMBO);
    }
    if total_len < hdr_len || !pkt.within_frame(off, total_len) {
        return Err(reason::BAD_IPV4_TOTAL_LEN);
    }
    let frag = be16([h[6], h[7]]);
    // MF set or a non-zero fragment offset: reassembly belongs to the kernel.
    if frag & 0x3fff != 0 {
        p.fragment = 1;
    }
    p.family = FAMILY_IPV4;
    p.l4_proto = h[9];
    p.l4_off = (off + hdr_len) as u32;
    p.l3_end = (off + total_len) as u32;
    Ok(())
}

#[inline(always)]
fn parse_ipv6(pkt: &Packet, off: usize, p: &mut Parsed) -> Result<(), u32> {
    let h: [u8; 40] = pkt
        .load(off)
        .ok_or_else(|| missing(pkt, off, 40, reason::TRUNC_IPV6))?;
    if h[0] >> 4 != 6 {
        return Err(reason::BAD_IP_VERSION);
    }
    let payload_len = be16([h[4], h[5]]) as usize;
    if payload_len == 0 && (pkt.len > JUMBO_LEN || h[6] == IPPROTO_HOPOPTS) {
        // BIG TCP super-packet, or a jumbogram (its length is in a hop-by-hop option).
        return Err(reason::GSO_JUMBO);
    }
    if payload_len == 0 || !pkt.within_frame(off + 40, payload_len) {
        return Err(reason::BAD_IPV6_PAYLOAD_LEN);
    }
    let l3_end = off + 40 + payload_len;
    p.family = FAMILY_IPV6;
    p.l3_end = l3_end as u32;

    let mut next = h[6];
    let mut cur = off + 40;
    // verifier: bounded walk; each header advances `cur` by at most 2 KiB.
    for _ in 0..MAX_IPV6_EXT {
        match next {
            IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS => {
                // No separate `cur + 8 > l3_end` check: the length check below implies it
                // (every such header is at least 8 bytes), and the load is bounds-checked.
                let e: [u8; 2] = pkt
                    .load(cur)
                    .ok_or_else(|| missing(pkt, cur, 8, reason::TRUNC_IPV6_EXT))?;
                let len = (e[1] as usize + 1) * 8;
                if cur + len > l3_end {
                    return Err(reason::TRUNC_IPV6_EXT);
                }
                next = e[0];
                cur += len;
            }
            IPPROTO_FRAGMENT => {
                if cur + 8 > l3_end {
                    return Err(reason::TRUNC_IPV6_EXT);
                }
                let e: [u8; 8] = pkt
                    .load(cur)
                    .ok_or_else(|| missing(pkt, cur, 8, reason::TRUNC_IPV6_EXT))?;
                p.fragment = 1;
                p.l4_proto = e[0];
                p.l4_off = (cur + 8) as u32;
                return Ok(());
            }
            _ => {
                p.l4_proto = next;
                p.l4_off = cur as u32;
                return Ok(());
            }
        }
    }
    match next {
        IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS | IPPROTO_FRAGMENT => {
            Err(reason::IPV6_EXT_CHAIN_TOO_LONG)
        }
        _ => {
            p.l4_proto = next;
            p.l4_off = cur as u32;
            Ok(())
        }
    }
}

/// ICMP in IPv4, ICMPv6 in IPv6; the other pairing is just another protocol number.
#[inline(always)]
fn is_icmp_of_family(p: &Parsed) -> bool {
    (p.family == FAMILY_IPV4 && p.l4_proto == IPPROTO_ICMP)
        || (p.family == FAMILY_IPV6 && p.l4_proto == IPPROTO_ICMPV6)
}

/// Echo request/reply of either family (ICMP 8/0, ICMPv6 128/129).
#[inline(always)]
fn is_echo(p: &Parsed) -> bool {
    if p.family == FAMILY_IPV4 {
        p.icmp_type == 8 || p.icmp_type == 0
    } else {
        p.icmp_type == 128 || p.icmp_type == 129
    }
}

#[inline(always)]
fn parse_l4(pkt: &Packet, p: &mut Parsed) -> Result<(), u32> {
    let off = p.l4_off as usize;
    let room = (p.l3_end as usize).saturating_sub(off);
    match p.l4_proto {
        IPPROTO_TCP => {
            if room < 20 {
                return Err(reason::TRUNC_L4);
            }
            let t: [u8; 20] = pkt
                .load(off)
                .ok_or_else(|| missing(pkt, off, 20, reason::TRUNC_L4))?;
            let doff = (t[12] >> 4) as usize * 4;
            if doff < 20 || doff > room {
                return Err(reason::BAD_TCP_DATA_OFFSET);
            }
            p.src_port = be16([t[0], t[1]]);
            p.dst_port = be16([t[2], t[3]]);
            p.tcp_flags = t[13];
        }
        IPPROTO_UDP => {
            if room < 8 {
                return Err(reason::TRUNC_L4);
            }
            let u: [u8; 8] = pkt
                .load(off)
                .ok_or_else(|| missing(pkt, off, 8, reason::TRUNC_L4))?;
            p.src_port = be16([u[0], u[1]]);
            p.dst_port = be16([u[2], u[3]]);
        }
        IPPROTO_ICMP | IPPROTO_ICMPV6 if is_icmp_of_family(p) => {
            if room < 8 {
                return Err(reason::TRUNC_L4);
            }
            let i: [u8; 8] = pkt
                .load(off)
                .ok_or_else(|| missing(pkt, off, 8, reason::TRUNC_L4))?;
            p.icmp_type = i[0];
            p.icmp_code = i[1];
            if is_echo(p) {
                // Echo identifier: what conntrack keys ICMP echo flows by.
                p.src_port = be16([i[4], i[5]]);
            }
        }
        _ => {}
    }
    Ok(())
}
