//! The kernel's FIB, asked by the stages that need a route (`bpf_fib_lookup`): the L3 stage
//! for every uncached flow, gateway SNAT and direct server return for a new connection. The
//! question and the answer live in this CPU's `FP_FIB`.

use aya_ebpf::{bindings::bpf_fib_lookup as FibLookup, helpers::bpf_fib_lookup};

use crate::{
    ctx::FibParams,
    maps::{FP_FIB, FP_NAT, FP_VXLAN_GEN},
    packet::Packet,
    parse::{FAMILY_IPV4, Parsed},
};

/// AF_INET / AF_INET6.
const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
/// Route lookup only: no neighbour needed (the kernel forwards the packet and resolves it).
pub const BPF_FIB_LOOKUP_SKIP_NEIGH: u32 = 1 << 2;

/// The kernel's route for the packet that arrived on `ifindex` — to its own destination, or
/// (`to_planned`) to the address of this CPU's NAT plan (`FP_NAT`) — as `bpf_fib_lookup`
/// fills it in (`ifindex` out, and the MAC addresses unless `flags` skip the neighbour).
/// `tot_len`, the IP packet's length, is checked against the route's MTU unless it is 0.
/// `Err`: the helper's `BPF_FIB_LKUP_RET_*` code (no route, no neighbour, ...), or -1.
#[inline(always)]
pub fn lookup(
    pkt: &Packet,
    p: &Parsed,
    ifindex: u32,
    to_planned: bool,
    flags: u32,
    tot_len: u16,
) -> Result<&'static FibParams, i64> {
    let f = question(pkt, p, ifindex, to_planned).ok_or(-1i64)?;
    f.tot_len = tot_len;
    answer(pkt, f, flags)?;
    Ok(f)
}

/// The question `bpf_fib_lookup` is asked for the packet that arrived on `ifindex` (see
/// [`lookup`]), in this CPU's `FP_FIB`, with no length. `None`: the addresses are not
/// readable.
#[inline(always)]
pub fn question(
    pkt: &Packet,
    p: &Parsed,
    ifindex: u32,
    to_planned: bool,
) -> Option<&'static mut FibParams> {
    let f = FP_FIB.get_ptr_mut(0)?;
    // SAFETY: this CPU's slot of a per-CPU array, used by this program run only.
    let f = unsafe { &mut *f };
    let l3 = p.l3_off as usize;
    f.l4_protocol = p.l4_proto;
    f.sport = p.src_port.to_be();
    f.dport = p.dst_port.to_be();
    f.tot_len = 0;
    f.ifindex = ifindex;
    f.flowinfo = 0;
    // perf: word stores (an array assignment compiles to a memset call).
    // SAFETY: both words lie in this CPU's slot.
    unsafe {
        core::ptr::write_volatile(&raw mut f.tail[0], 0);
        core::ptr::write_volatile(&raw mut f.tail[1], 0);
    }
    if p.family == FAMILY_IPV4 {
        let a = pkt.load::<[u8; 8]>(l3 + 12)?;
        f.family = AF_INET;
        f.src = [u64::from(u32::from_ne_bytes([a[0], a[1], a[2], a[3]])), 0];
        f.dst = [u64::from(u32::from_ne_bytes([a[4], a[5], a[6], a[7]])), 0];
    } else {
        let a = pkt.load::<[u64; 4]>(l3 + 8)?;
        f.family = AF_INET6;
        f.src = [a[0], a[1]];
        f.dst = [a[2], a[3]];
    }
    if to_planned {
        let plan = FP_NAT.get_ptr(0)?;
        let words = plan.cast::<u64>();
        // SAFETY: `dst_addr` is the first 16 bytes of this CPU's 8-aligned plan (IPv4 in
        // the first 4, the rest zero, as the lookup's IPv4 field wants).
        f.dst = unsafe {
            [
                core::ptr::read_volatile(words),
                core::ptr::read_volatile(words.add(1)),
            ]
        };
    }
    Some(f)
}

/// Asks `bpf_fib_lookup` the question in `f` (this CPU's `FP_FIB`, from [`question`]);
/// `f` holds the answer then. `Err`: the helper's `BPF_FIB_LKUP_RET_*` code.
#[inline(always)]
pub fn answer(pkt: &Packet, f: &mut FibParams, flags: u32) -> Result<(), i64> {
    // SAFETY: the helper reads and writes the 64-byte parameter block (map memory) and reads
    // the context the packet came with.
    let rc = unsafe {
        bpf_fib_lookup(
            pkt.ctx,
            (f as *mut FibParams).cast::<FibLookup>(),
            core::mem::size_of::<FibParams>() as i32,
            flags,
        )
    };
    if rc == 0 { Ok(()) } else { Err(rc) }
}

/// The current generation of learned headers and cached routes.
#[inline(always)]
pub fn generation() -> u64 {
    FP_VXLAN_GEN.get(0).copied().unwrap_or(0)
}
