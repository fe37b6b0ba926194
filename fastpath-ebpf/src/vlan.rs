//! L2 stage: 802.1Q ports (`vlan = N`, `IFACE_F_VLAN_XDP` / `IFACE_F_VLAN_TC`), which the
//! kernel here cannot make with VLAN devices. A frame arriving tagged with the port's VLAN
//! is untagged at the ingress hook before anything else sees it, whatever its priority bits;
//! anything else arriving (untagged, another VLAN, an 802.1ad outer tag) is dropped, since the
//! port carries that VLAN only. Frames leaving get the tag: the kernel's and those redirected
//! at TC ingress at the port's TC egress, those the XDP program forwards before it redirects
//! them.

use aya_ebpf::{
    EbpfContext as _,
    bindings::__sk_buff,
    helpers::{bpf_skb_vlan_pop, bpf_skb_vlan_push, bpf_xdp_adjust_head},
    programs::{TcContext, XdpContext},
};
use fastpath_common::{
    ct::{IFACE_F_VLAN_TC, IFACE_F_VLAN_XDP},
    reason,
};

use crate::{
    maps::FP_IFACE,
    packet::{Packet, xdp_packet},
};

/// The 802.1Q tag protocol identifier, as it lies in a frame.
const TPID: [u8; 2] = [0x81, 0x00];

/// The VLAN id (big-endian) of `ifindex` when it is a port untagging at the hook of `flag`
/// (`IFACE_F_VLAN_XDP`, `IFACE_F_VLAN_TC`, or both: either).
#[inline(always)]
pub fn port(ifindex: u32, flag: u32) -> Option<[u8; 2]> {
    let iface = FP_IFACE.get(ifindex)?;
    if iface.flags & flag != 0 {
        Some(iface.vlan)
    } else {
        None
    }
}

/// Of either kind: where frames leaving get the tag.
pub const ANY: u32 = IFACE_F_VLAN_XDP | IFACE_F_VLAN_TC;

/// Whether a tag's control information (big-endian) names VLAN `vid`; the priority and
/// drop-eligible bits are not looked at.
#[inline(always)]
fn is_vid(tci: [u8; 2], vid: [u8; 2]) -> bool {
    tci[0] & 0x0f == vid[0] && tci[1] == vid[1]
}

/// XDP: takes the tag of VLAN `vid` out of the frame (the MAC addresses move up 4 bytes);
/// the reason to drop it otherwise. A function of its own: called only on VLAN ports, and its
/// stack is not the main program's.
#[inline(never)]
pub fn pop_xdp(ctx: &XdpContext, vid: [u8; 2]) -> Result<(), u32> {
    let pkt = xdp_packet(ctx);
    let macs: [u8; 12] = pkt.load_now(0).ok_or(reason::VLAN_NOT_MEMBER)?;
    let tag: [u8; 4] = pkt.load_now(12).ok_or(reason::VLAN_NOT_MEMBER)?;
    if [tag[0], tag[1]] != TPID || !is_vid([tag[2], tag[3]], vid) {
        return Err(reason::VLAN_NOT_MEMBER);
    }
    // SAFETY: the context is the program's; the frame is at least 16 bytes long (read above).
    if unsafe { bpf_xdp_adjust_head(ctx.as_ptr() as *mut _, 4) } != 0 {
        return Err(reason::VLAN_FAILED);
    }
    if xdp_packet(ctx).store(0, macs) {
        Ok(())
    } else {
        Err(reason::VLAN_FAILED)
    }
}

/// XDP: puts the tag of VLAN `vid` in front of the frame's EtherType (priority 0); false if
/// the frame has no room for it.
#[inline(never)]
pub fn push_xdp(ctx: &XdpContext, vid: [u8; 2]) -> bool {
    let Some(macs) = xdp_packet(ctx).load_now::<[u8; 12]>(0) else {
        return false;
    };
    // SAFETY: the context is the program's; a negative delta grows the frame into the
    // headroom, and fails if there is not enough.
    if unsafe { bpf_xdp_adjust_head(ctx.as_ptr() as *mut _, -4) } != 0 {
        return false;
    }
    let pkt = xdp_packet(ctx);
    pkt.store(0, macs) && pkt.store(12, [TPID[0], TPID[1], vid[0], vid[1]])
}

/// TC ingress: removes the tag of VLAN `vid` — out of band, where the kernel moved it before
/// TC ingress, or still in the frame (a BPF_PROG_TEST_RUN skb); the reason to drop the frame
/// otherwise.
#[inline(always)]
pub fn pop_tc(ctx: &TcContext, pkt: &Packet, vid: [u8; 2]) -> Result<(), u32> {
    let tagged = match out_of_band(ctx) {
        Some((proto, tci)) => proto == TPID && is_vid(tci, vid),
        None => match pkt.load_now::<[u8; 4]>(12) {
            Some(tag) => [tag[0], tag[1]] == TPID && is_vid([tag[2], tag[3]], vid),
            None => false,
        },
    };
    if !tagged {
        return Err(reason::VLAN_NOT_MEMBER);
    }
    // SAFETY: the context is the program's skb; the helper takes the out-of-band tag off,
    // or the frame's outer one.
    if unsafe { bpf_skb_vlan_pop(ctx.as_ptr() as *mut _) } != 0 {
        return Err(reason::VLAN_FAILED);
    }
    Ok(())
}

/// TC egress: gives the frame the tag of VLAN `vid` (priority 0), out of band as the kernel
/// does (the device or the stack puts it in the frame); false if that failed.
#[inline(always)]
pub fn push_tc(ctx: &TcContext, vid: [u8; 2]) -> bool {
    // SAFETY: the context is the program's skb.
    unsafe {
        bpf_skb_vlan_push(
            ctx.as_ptr() as *mut _,
            u16::from_ne_bytes(TPID),
            u16::from_be_bytes(vid),
        ) == 0
    }
}

/// The skb's out-of-band tag (protocol as in a frame, control information big-endian), if
/// it has one.
#[inline(always)]
pub fn out_of_band(ctx: &TcContext) -> Option<([u8; 2], [u8; 2])> {
    // SAFETY: the context pointer is the kernel's __sk_buff for the duration of the program.
    let (present, proto, tci) = unsafe {
        let skb = ctx.as_ptr() as *const __sk_buff;
        ((*skb).vlan_present, (*skb).vlan_proto, (*skb).vlan_tci)
    };
    if present == 0 {
        return None;
    }
    // `vlan_proto` holds the protocol in network order, `vlan_tci` in host order.
    Some(((proto as u16).to_ne_bytes(), (tci as u16).to_be_bytes()))
}
