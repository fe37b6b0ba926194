//! Gateway SNAT (masquerade): a new connection forwarded out of an interface with a SNAT rule
//! gets its source translated to the rule's address and an allocated port. It is handled as
//! a full-NAT connection whose backend is its own destination: the LB stage's connection and
//! alias entries, port allocation and rewrites serve it unchanged (see `conntrack::lb_create`).
//!
//! Where it leaves is asked of the kernel's FIB (`bpf_fib_lookup`, without neighbour
//! resolution) on the connection's first packet only, and only when some rule exists.

use aya_ebpf::{bindings::bpf_fib_lookup as FibLookup, helpers::bpf_fib_lookup};
use fastpath_common::{
    ct::IFACE_F_SNAT,
    lb::{Backend, GATEWAY_ID, SVC_F_FULL_NAT, SVC_F_GATEWAY, Service},
    stats::CONFIG_F_SNAT,
};

use crate::{
    maps::{FP_CONFIG, FP_FIB, FP_IFACE, FP_NAT, FP_NEW_SVC, FP_SNAT, FP_SNAT_DST, FP_SVC_KEY},
    packet::Packet,
    parse::{FAMILY_IPV4, Parsed},
    route::RouteKey,
};

/// `bpf_fib_lookup`'s parameters with plain fields (the kernel's layout, 64 bytes).
#[repr(C, align(8))]
pub struct FibParams {
    family: u8,
    l4_protocol: u8,
    sport: u16,
    dport: u16,
    tot_len: u16,
    pub ifindex: u32,
    flowinfo: u32,
    src: [u64; 2],
    dst: [u64; 2],
    tail: [u64; 2],
}
const _: () = assert!(core::mem::size_of::<FibParams>() == 64);

/// AF_INET / AF_INET6.
const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
/// Route lookup only: no neighbour needed (the kernel forwards the packet and resolves it).
const BPF_FIB_LOOKUP_SKIP_NEIGH: u32 = 1 << 2;

/// The gateway "service" for a new connection that arrived on `ifindex`, if the route of its
/// destination leaves through an interface with a SNAT rule for its family. Built in per-CPU
/// scratch. `FP_SVC_KEY` must hold the packet's destination (`lb::service` left it there).
#[inline(always)]
pub fn snat_service(pkt: &Packet, p: &Parsed, ifindex: u32) -> Option<&'static Service> {
    let cfg = FP_CONFIG.get(0)?;
    if cfg.flags & CONFIG_F_SNAT == 0 {
        return None;
    }
    let out = fib_lookup(pkt, p, ifindex, false, BPF_FIB_LOOKUP_SKIP_NEIGH, 0)
        .ok()?
        .ifindex;
    let iface = FP_IFACE.get(out)?;
    if iface.flags & IFACE_F_SNAT == 0 {
        return None;
    }
    let rule = FP_SNAT.get(iface.snat)?;
    let v4 = p.family == FAMILY_IPV4;
    if rule.families & if v4 { 1 } else { 2 } == 0 {
        return None;
    }
    let svc = FP_NEW_SVC.get_ptr_mut(0)?;
    // SAFETY: this CPU's slot of a per-CPU array, used by this program run only.
    let svc = unsafe { &mut *svc };
    svc.id = GATEWAY_ID;
    svc.flags = SVC_F_FULL_NAT | SVC_F_GATEWAY;
    svc.slots_len = 1;
    svc.affinity_s = 0;
    svc.snat_port_lo = rule.port_lo;
    svc.snat_port_hi = rule.port_hi;
    crate::conntrack::copy16(
        &mut svc.snat_addr,
        if v4 { &rule.addr4 } else { &rule.addr6 },
    );
    Some(svc)
}

/// The "backend" of a gateway connection: its own destination (from `FP_SVC_KEY`).
#[inline(always)]
pub fn destination() -> Option<(u32, &'static Backend)> {
    let key = FP_SVC_KEY.get_ptr(0)?;
    let b = FP_SNAT_DST.get_ptr_mut(0)?;
    // SAFETY: this CPU's slots of per-CPU arrays, used by this program run only.
    let (key, b) = unsafe { (&*key, &mut *b) };
    crate::conntrack::copy16(&mut b.addr, &key.vip);
    b.port = key.port;
    b.family = key.family;
    Some((GATEWAY_ID, b))
}

/// The kernel's route for the packet that arrived on `ifindex` — to its own destination, or
/// (`to_planned`) to the address of this CPU's NAT plan (`FP_NAT`) — as `bpf_fib_lookup`
/// fills it in (`ifindex` out, and the MAC addresses unless `flags` skip the neighbour).
/// `tot_len`, the IP packet's length, is checked against the route's MTU unless it is 0.
/// `Err`: the helper's `BPF_FIB_LKUP_RET_*` code (no route, no neighbour, ...), or -1.
#[inline(always)]
pub fn fib_lookup(
    pkt: &Packet,
    p: &Parsed,
    ifindex: u32,
    to_planned: bool,
    flags: u32,
    tot_len: u16,
) -> Result<&'static FibParams, i64> {
    let f = fib_question(pkt, p, ifindex, to_planned).ok_or(-1i64)?;
    f.tot_len = tot_len;
    fib_answer(pkt, f, flags)?;
    Ok(f)
}

/// The question `bpf_fib_lookup` is asked for the packet that arrived on `ifindex` (see
/// [`fib_lookup`]), in this CPU's `FP_FIB`, with no length. `None`: the addresses are not
/// readable.
#[inline(always)]
pub fn fib_question(
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

/// Asks `bpf_fib_lookup` the question in `f` (this CPU's `FP_FIB`, from [`fib_question`]);
/// `f` holds the answer then. `Err`: the helper's `BPF_FIB_LKUP_RET_*` code.
#[inline(always)]
pub fn fib_answer(pkt: &Packet, f: &mut FibParams, flags: u32) -> Result<(), i64> {
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

impl FibParams {
    /// The question's first 48 bytes (family, protocol, ports, length, arriving interface,
    /// flow label, addresses): the route cache's key, while they hold the question (the
    /// answer overwrites the interface, the length, the flow label and, for a route via a
    /// gateway, the destination).
    #[inline(always)]
    pub fn key(&self) -> &RouteKey {
        // SAFETY: the struct starts with 48 bytes of plain integers, 8-aligned as the key.
        unsafe { &*(self as *const FibParams).cast::<RouteKey>() }
    }

    /// Sets the length the lookup checks against the route's MTU (0: none; see
    /// [`fib_lookup`]).
    #[inline(always)]
    pub fn set_len(&mut self, tot_len: u16) {
        self.tot_len = tot_len;
    }

    /// The answer's egress interface and its last 16 bytes (VLAN fields, MAC addresses).
    #[inline(always)]
    pub fn answer(&self) -> (u32, [u64; 2]) {
        (self.ifindex, self.tail)
    }

    /// Writes an answer as [`FibParams::answer`] gave it: a route cache hit stands in for the
    /// lookup for the code that reads the answer from here.
    #[inline(always)]
    pub fn set_answer(&mut self, out: u32, tail: [u64; 2]) {
        self.ifindex = out;
        self.tail = tail;
    }

    /// After a successful TC lookup asked with no length: the egress route's MTU (the
    /// kernel's `mtu_result`, which shares the length's field).
    #[inline(always)]
    pub fn mtu(&self) -> u16 {
        self.tot_len
    }

    /// After a successful lookup without `BPF_FIB_LOOKUP_SKIP_NEIGH`: the next hop's MAC
    /// address, then the egress interface's, as an Ethernet header starts.
    #[inline(always)]
    pub fn macs(&self) -> [u8; 12] {
        // SAFETY: two u64 are 16 bytes; any bits are valid.
        let t = unsafe { core::mem::transmute::<[u64; 2], [u8; 16]>(self.tail) };
        // The kernel's layout from byte 48: VLAN protocol and TCI (4), smac (6), dmac (6).
        [
            t[10], t[11], t[12], t[13], t[14], t[15], t[4], t[5], t[6], t[7], t[8], t[9],
        ]
    }
}
