//! The types the stages share through per-CPU maps, and that the maps are made of: a
//! translation plan, the FIB question and answer, the route cache's entries. Only types and
//! plain helpers on them: this module imports no stage and no map, so every stage and
//! `maps` can depend on it without a cycle.

use fastpath_common::ct::CtHop;

/// What to rewrite: the destination (`ends & NAT_DST`) and/or the source (`ends &
/// NAT_SRC`) to these addresses (IPv4: the first 4 bytes) and ports.
///
/// verifier: a plan in per-CPU map memory rather than references in the `Action`. Every
/// translating path then reaches the rewrite in the same shape (no pointers into different
/// maps, which the verifier never treats as equivalent), so its states are pruned there
/// instead of multiplied by the rewrite's branches; and no "this pointer or none", which
/// LLVM turns into a mask on a pointer, which is refused.
#[repr(C, align(8))]
pub struct NatPlan {
    pub dst_addr: [u8; 16],
    pub src_addr: [u8; 16],
    pub dst_port: u16,
    pub src_port: u16,
    pub ends: u8,
    pub _pad: [u8; 3],
    /// `NAT_DSR`: the interface the packet leaves through (set by `dsr::forward`).
    pub out_ifindex: u32,
    /// The reason of a forward verdict handed to the tail program that tags the frame
    /// (`fastpath_xdp_vlan_forward`).
    pub fwd_reason: u32,
}

/// `NatPlan::ends`: rewrite the destination.
pub const NAT_DST: u8 = 1;
/// `NatPlan::ends`: rewrite the source.
pub const NAT_SRC: u8 = 2;
/// `NatPlan::ends`: direct server return — no rewrite; send the packet to the MAC address of
/// `dst_addr` (the backend).
pub const NAT_DSR: u8 = 4;
/// `NatPlan::ends`: an ICMP error about a packet a backend was sent (done by the tail program
/// `fastpath_xdp_icmp_error`). The quoted packet's destination becomes `src_addr:src_port`
/// (the VIP) and, with `NAT_DST`, its source `dst_addr:dst_port` (full-NAT: the client); the
/// error then comes from the VIP (unless `NAT_ICMP_KEEP_SOURCE`) and, with `NAT_DST`, goes
/// to the client.
pub const NAT_ICMP_ERROR: u8 = 8;
pub const NAT_ICMP_KEEP_SOURCE: u8 = 16;

/// What the conntrack stage found of a packet that may start a connection it did not find
/// (`conntrack::Action::Miss`), for the connection's creation after the LB stage.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Miss {
    /// The coarse clock's time of the lookup.
    pub now: u64,
    /// The packet's source is on the key's `lo` side.
    pub src_is_lo: bool,
    /// The interface's stateful firewall judges the packet.
    pub firewall: bool,
}

/// Where the L3 stage finds, and keeps, the next hop of the packet's connection direction
/// (`in_entry`): the entry's (`CtEntry::hops`), set by conntrack on a hit or, for a new
/// load-balanced connection, in the entry it built and inserts after the L3 stage
/// (`conntrack::commit`); else this CPU's scratch hop, never read. verifier: never null, so
/// no "a pointer or none". `backend`: for a new load-balanced connection's first packet, the
/// backend (its index) the packet is translated to, whose route new connections share where
/// the FIB answers by destination alone (see `route::shared`); else [`NO_BACKEND`].
pub struct HopRef {
    pub hop: *mut CtHop,
    pub in_entry: bool,
    pub backend: u32,
}

/// No backend: `HopRef::backend` of a packet that shares no backend's route, and
/// `LeastScan::best` before one is chosen (a backend index never reaches it).
pub const NO_BACKEND: u32 = u32::MAX;

/// The route a backend's new connections share on this CPU (`FP_BACKEND_HOP`, a
/// direct-mapped cache: slot `index % BACKEND_HOP_SLOTS`), for the destination address and
/// family it holds — an index reused for another address, or two sharing a slot, miss.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BackendHop {
    addr: [u64; 2],
    family: u8,
    pub hop: CtHop,
}

impl BackendHop {
    /// Whether this is the route of address `addr` (as [`words`]) of `family`.
    #[inline(always)]
    pub fn is_of(&self, addr: [u64; 2], family: u8) -> bool {
        self.addr == addr && self.family == family
    }

    /// Keeps `hop` as the route of address `addr` (as [`words`]) of `family`.
    #[inline(always)]
    pub fn keep(&mut self, addr: [u64; 2], family: u8, hop: &CtHop) {
        self.addr = addr;
        self.family = family;
        self.hop = *hop;
    }
}

/// 16 address bytes of 8-aligned map memory as two words (as they lie in memory).
#[inline(always)]
pub fn words(addr: &[u8; 16]) -> [u64; 2] {
    let w = (addr as *const [u8; 16]).cast::<u64>();
    // SAFETY: 16 bytes of 8-aligned map memory.
    unsafe {
        [
            core::ptr::read_volatile(w),
            core::ptr::read_volatile(w.add(1)),
        ]
    }
}

/// Slots of `FP_BACKEND_HOP` per CPU (a power of two).
pub const BACKEND_HOP_SLOTS: u32 = 4096;

/// Which end of the packet an address belongs to.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum End {
    Src,
    Dst,
}

/// `bpf_fib_lookup`'s parameters with plain fields (the kernel's layout, 64 bytes).
#[repr(C, align(8))]
pub struct FibParams {
    pub(crate) family: u8,
    pub(crate) l4_protocol: u8,
    pub(crate) sport: u16,
    pub(crate) dport: u16,
    pub(crate) tot_len: u16,
    pub ifindex: u32,
    pub(crate) flowinfo: u32,
    pub(crate) src: [u64; 2],
    pub(crate) dst: [u64; 2],
    pub(crate) tail: [u64; 2],
}
const _: () = assert!(core::mem::size_of::<FibParams>() == 64);

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
    /// `fib::lookup`).
    #[inline(always)]
    pub fn set_len(&mut self, tot_len: u16) {
        self.tot_len = tot_len;
    }

    /// Writes an answer as the lookup leaves it (the egress interface and the last 16 bytes:
    /// VLAN fields, MAC addresses): a route cache hit stands in for the lookup for the code
    /// that reads the answer from here.
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

/// What a route cache entry holds: the FIB's answer for a flow, and for how long it holds.
#[repr(C)]
pub struct RouteHop {
    /// The `FP_VXLAN_GEN` generation it was learned in.
    pub(crate) generation: u64,
    /// Coarse-clock time it is used until.
    pub(crate) expires_ns: u64,
    /// The egress interface.
    pub(crate) out: u32,
    /// The longest IP packet known to fit the route (its MTU, or the longest packet the FIB
    /// passed): a longer one asks the FIB, which checks the MTU.
    pub(crate) fits: u16,
    pub(crate) _pad: u16,
    /// The answer's last 16 bytes: the next hop's MAC address and the egress interface's.
    pub(crate) tail: [u64; 2],
}

/// The route cache key: the first 48 bytes of the FIB question (`FibParams::key`).
pub type RouteKey = [u64; 6];

/// A flow being learned: the FIB question's key and the answer to cache.
#[repr(C)]
pub struct RouteLearning {
    pub(crate) key: RouteKey,
    pub(crate) hop: RouteHop,
}

pub use fastpath_common::{copy_words, copy16};

/// What the XDP pipeline did to a steady packet that a flow-cache slot's copy served
/// (`FP_EXPRESS`, one per slot, direction and CPU; see `express.rs`): enough to do it again to the
/// connection's next packets of that direction without the pipeline. Learned from the packet
/// as it left, so it holds whatever the stages decided (translation or none, routed or direct
/// server return) without knowing why.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Express {
    /// The slot's `filled_ns` when learned: the recipe holds only for that copy (0: none).
    pub filled_ns: u64,
    /// The next hop the packet left by (the copy's, for `dir`), checked as the L3 stage
    /// checks it.
    pub hop: CtHop,
    /// The addresses as they left: IPv4 source and destination in word 0; IPv6 source in
    /// words 0-1, destination in 2-3 (as they lie in the packet).
    pub addrs: [u64; 4],
    /// The ports as they left (as they lie in the packet).
    pub ports: [u8; 4],
    /// The reason the packet was counted under (forward verdict).
    pub reason: u32,
    /// The service and backend counted (`lb`).
    pub service: u32,
    pub backend: u32,
    /// The checksums' changes (`csum::apply`'s delta, folded; 0: unchanged): IPv4 header, L4.
    pub l3_delta: u16,
    pub l4_delta: u16,
    /// Routed by the L3 stage (TTL decremented, `route_stat::HIT` counted); else direct
    /// server return (MAC addresses only).
    pub routed: u8,
    /// Counted for its service and backend.
    pub lb: u8,
    // The family and protocol are the slot's key's, which the probe matched.
    pub _pad: [u8; 6],
}

/// This CPU's note that the flow-cache slot `slot - 1` served the packet being processed
/// (0: none), for the pipeline to learn its [`Express`] recipe once the packet is forwarded:
/// set by `flowcache::lookup`, taken by `express::noted` in the same program run.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct FlowNote {
    pub slot: u32,
    /// The copy's direction the packet counts in.
    pub dir: u32,
    /// The packet's checksums before the stages rewrote it: IPv4 header (0 for IPv6), L4.
    pub l3_check: u16,
    pub l4_check: u16,
    /// Probes in a row the express path has not served (see `express::serve`), wrapping.
    pub misses: u32,
}
const _: () = assert!(core::mem::size_of::<Express>() == 96);

/// The state of `lb::least_connections`' scan, which each step reads and updates. 16 bytes:
/// it lives on the stack of programs whose frame must stay within 480 bytes (see there).
#[repr(C)]
pub struct LeastScan {
    /// The backend the next step looks at, also its lookups' key.
    pub next: u32,
    /// The best backend so far, or [`NO_BACKEND`].
    pub best: u32,
    /// The best backend's active connections (below 2^48) and weight (below 2^16), as
    /// `active << 16 | weight`.
    pub best_load: u64,
}
