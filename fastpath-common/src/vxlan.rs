//! The VXLAN overlay's maps: the networks the fast path decapsulates and encapsulates for, and
//! the cache of outer headers it learns from the kernel's vxlan devices.
//!
//! The first packets towards an overlay destination take the kernel's path (routing, the
//! vxlan device's FDB, the underlay's route and neighbour): the datapath watches them leave
//! the underlay interface (TC egress) and keeps their outer headers per (vxlan device, inner
//! destination MAC). Later packets routed to that device are encapsulated with those headers
//! at XDP and redirected to the underlay directly. Arriving VXLAN packets of a configured
//! network are decapsulated at the underlay's XDP hook and their inner packet routed from the
//! vxlan device in the fast path (the kernel's FIB and neighbour table, as `route = true`).
//! An entry holds the generation it was learned in (`FP_VXLAN_GEN`): the daemon bumps the
//! generation on any change the headers depend on, and an entry of an older one is a miss
//! until the kernel's path teaches it again (no flush, no stale minutes).

/// A VXLAN network (`FP_VXLAN_NET`, by VNI): its kernel device and its VTEP settings.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct VxlanNet {
    /// The kernel's vxlan device carrying this VNI.
    pub ifindex: u32,
    /// The underlay interface its packets leave and arrive on.
    pub underlay: u32,
    /// UDP destination port, host order.
    pub port: u16,
    /// Outer UDP source ports (host order, `port_min..port_max`), as the kernel's vxlan
    /// device picks them: from the inner flow's hash.
    pub port_min: u16,
    pub port_max: u16,
    /// 4 or 6: the underlay's address family.
    pub family: u8,
    pub _pad: u8,
    /// This VTEP's address (IPv4 in the first 4 bytes).
    pub local: [u8; 16],
}
const _: () = assert!(core::mem::size_of::<VxlanNet>() == 32);

impl VxlanNet {
    /// `local` as two words (as it lies in memory), for comparing with an IPv6 address read
    /// as words.
    #[inline(always)]
    pub fn local_words(&self) -> [u64; 2] {
        // SAFETY: 16 bytes are two u64; any bits are valid.
        unsafe { core::mem::transmute::<[u8; 16], [u64; 2]>(self.local) }
    }
}

/// Key of the learned headers (`FP_VXLAN_PEER`): the vxlan device and the inner destination
/// MAC address (the next hop on the overlay, as the kernel's neighbour table names it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[repr(C)]
pub struct VxlanKey {
    pub ifindex: u32,
    pub mac: [u8; 6],
    pub _pad: [u8; 2],
}
const _: () = assert!(core::mem::size_of::<VxlanKey>() == 12);

/// Longest outer header: Ethernet (14) + IPv6 (40) + UDP (8) + VXLAN (8).
pub const VXLAN_HDR_MAX: usize = 70;
/// Outer header over an IPv4 underlay: Ethernet + IPv4 without options + UDP + VXLAN.
pub const VXLAN_HDR_V4: u32 = 50;
/// Outer header over an IPv6 underlay: Ethernet + IPv6 + UDP + VXLAN.
pub const VXLAN_HDR_V6: u32 = 70;

/// Learned outer headers (`FP_VXLAN_PEER`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct VxlanPeer {
    /// The `FP_VXLAN_GEN` generation it was learned in.
    pub generation: u64,
    /// Where encapsulated packets leave.
    pub underlay: u32,
    /// `VXLAN_HDR_V4` or `VXLAN_HDR_V6`.
    pub hdr_len: u32,
    /// The next IPv4 identification the fast path gives (per destination, as the kernel's
    /// counters are).
    pub ip_id: u32,
    /// The network's outer UDP source ports (`VxlanNet::port_min`, `port_max`).
    pub port_min: u16,
    pub port_max: u16,
    /// The outer headers as the kernel wrote them; the fast path sets the lengths, the IPv4
    /// identification and checksum, and the UDP source port per packet.
    pub hdr: [u64; 9],
}
const _: () = assert!(core::mem::size_of::<VxlanPeer>() == 96);
const _: () = assert!(VXLAN_HDR_MAX <= 9 * 8);

impl VxlanPeer {
    /// The outer headers' bytes.
    pub fn hdr_bytes(&self) -> [u8; 72] {
        // SAFETY: nine u64 are 72 bytes; any bits are valid.
        unsafe { core::mem::transmute::<[u64; 9], [u8; 72]>(self.hdr) }
    }
}

/// Entries of `FP_VXLAN_PEER` (LRU: the least recently used destination goes first).
pub const VXLAN_PEERS: u32 = 16_384;
/// Entries of `FP_VXLAN_NET`.
pub const VXLAN_NETS: u32 = 256;

/// Indexes of the per-CPU VXLAN counters (`FP_VXLAN_STATS`). Hits, misses and
/// invalidations are reason codes (`vxlan_encap` / `vxlan_decap`, `vxlan_miss`,
/// `vxlan_stale`); these count the learning.
pub mod vxlan_stat {
    /// Outer headers learned from a packet of the kernel's vxlan device, for a next hop not
    /// known in the current generation.
    pub const LEARNED: u32 = 0;
    /// Packets of a configured network the cache cannot use: a UDP checksum (the fast path
    /// sends none), IPv4 options, fragments.
    pub const UNUSABLE: u32 = 1;
    /// Packets of a configured network that arrived at TC as a GRO aggregate (many segments
    /// in one): left to the kernel's vxlan device, as eBPF on this kernel cannot clear the
    /// aggregate's tunnel offload state (`BPF_F_ADJ_ROOM_DECAP_L4_UDP` came after 6.18).
    pub const GRO_TO_KERNEL: u32 = 2;
    /// One past the highest counter in use.
    pub const COUNT: u32 = 3;
    pub const SLOTS: u32 = 4;
    const _: () = assert!(COUNT <= SLOTS);
    /// Stable snake_case names, indexed by counter, for the CLI and metrics labels.
    pub const NAMES: [&str; COUNT as usize] = ["learned", "unusable", "gro_to_kernel"];
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: #[repr(C)], fixed-width fields, explicit padding (sizes asserted above).
    unsafe impl aya::Pod for super::VxlanNet {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::VxlanKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::VxlanPeer {}
}
