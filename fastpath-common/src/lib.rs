//! The map ABI shared by the datapath (`fastpath-ebpf`) and the daemon (`fastpath`).
//!
//! Everything here is `#[repr(C)]` with fixed-width fields and explicit padding, and is
//! append-only: pinned maps survive a daemon upgrade, so a field or code never moves.
#![no_std]

pub mod csum;
pub mod ct;
pub mod lb;
pub mod reason;
pub mod route;
pub mod stats;
pub mod vxlan;

pub use stats::{Counter, DatapathConfig, Hook, Verdict};

/// Copies `N` words with word loads and stores. perf: on the BPF target a plain copy of 16
/// bytes or more compiles to a call of an out-of-line byte loop (`memmove`); volatile
/// accesses keep LLVM from turning these back into one.
#[inline(always)]
pub fn copy_words<const N: usize>(dst: &mut [u64; N], src: &[u64; N]) {
    let (d, s) = (dst.as_mut_ptr(), src.as_ptr());
    let mut i = 0;
    while i < N {
        // SAFETY: i < N: within both arrays.
        unsafe { core::ptr::write_volatile(d.add(i), core::ptr::read_volatile(s.add(i))) };
        i += 1;
    }
}

/// Copies 16 address bytes as two words, as [`copy_words`] does (written out: built on it, the
/// TC load-balancing program's stack overflows). Both must be 8-aligned: key fields,
/// `CtNat`/`Backend` addresses, all at multiples of 8 in 8-aligned structs.
#[inline(always)]
pub fn copy16(dst: &mut [u8; 16], src: &[u8; 16]) {
    let d = (dst as *mut [u8; 16]).cast::<u64>();
    let s = (src as *const [u8; 16]).cast::<u64>();
    // SAFETY: both are 16 bytes and 8-aligned (see above); any bytes are valid.
    unsafe {
        core::ptr::write_volatile(d, core::ptr::read_volatile(s));
        core::ptr::write_volatile(d.add(1), core::ptr::read_volatile(s.add(1)));
    }
}

/// Names of the pinned maps, as declared in the eBPF object and pinned under `<pin_dir>/maps/`.
pub mod map_names {
    /// Per-CPU packet/byte counters indexed by [`crate::stats::stats_index`]: reason codes
    /// below 64.
    pub const STATS: &str = "FP_STATS";
    /// The same for reason codes 64 to 127 (see [`crate::stats::stats_map`]).
    pub const STATS_EXT: &str = "FP_STATS_EXT";
    /// One [`crate::DatapathConfig`] at index 0.
    pub const CONFIG: &str = "FP_CONFIG";
    /// Conntrack table: [`crate::ct::CtKey`] → [`crate::ct::CtEntry`].
    pub const CT: &str = "FP_CT";
    /// Queue of [`crate::ct::CtKey`] in creation order: the early-drop candidates.
    pub const CT_NEW: &str = "FP_CT_NEW";
    /// The XDP flow cache (`ct::FlowSlot`), per CPU.
    pub const FLOW: &str = "FP_FLOW";
    /// The tags of the flow cache's slots, per CPU.
    pub const FLOW_TAG: &str = "FP_FLOW_TAG";
    /// The flow cache's epoch per slot: bumped to invalidate every CPU's copy in that slot.
    pub const FLOW_EPOCH: &str = "FP_FLOW_EPOCH";
    /// Per-CPU conntrack counters indexed by [`crate::ct::ct_stat`].
    pub const CT_STATS: &str = "FP_CT_STATS";
    /// Ring buffer of [`crate::ct::CtEvent`].
    pub const CT_EVENTS: &str = "FP_CT_EVENTS";
    /// ifindex → [`crate::ct::IfaceConfig`].
    pub const IFACE: &str = "FP_IFACE";
    /// The routing interfaces XDP redirects to (a device map: `FP_TX_PORTS`).
    pub const TX_PORTS: &str = "FP_TX_PORTS";
    /// [`crate::lb::SvcKey`] → [`crate::lb::Service`].
    pub const SVC: &str = "FP_SVC";
    /// Backend index → [`crate::lb::Backend`].
    pub const BACKENDS: &str = "FP_BACKENDS";
    /// Selection tables: backend indexes.
    pub const LB_SLOTS: &str = "FP_LB_SLOTS";
    /// Per-CPU [`crate::lb::SvcCounters`] by service id.
    pub const SVC_STATS: &str = "FP_SVC_STATS";
    /// Per-CPU [`crate::lb::BackendCounters`] by backend index.
    pub const BACKEND_STATS: &str = "FP_BACKEND_STATS";
    /// Per backend, load-balanced connections that expired without closing (daemon-written).
    pub const BACKEND_GONE: &str = "FP_BACKEND_GONE";
    /// Per backend, [`crate::lb::BackendLoad`]: connections given and closed.
    pub const BACKEND_LOAD: &str = "FP_BACKEND_LOAD";
    /// Gateway SNAT rules ([`crate::lb::SnatRule`]) by `IfaceConfig::snat`.
    pub const SNAT: &str = "FP_SNAT";
    /// VNI → [`crate::vxlan::VxlanNet`]: the VXLAN networks of `[[vxlan]]`.
    pub const VXLAN_NET: &str = "FP_VXLAN_NET";
    /// [`crate::vxlan::VxlanKey`] → [`crate::vxlan::VxlanPeer`]: learned outer headers.
    pub const VXLAN_PEER: &str = "FP_VXLAN_PEER";
    /// The current generation of learned VXLAN headers and cached routes (one u64); bumping
    /// it invalidates them all.
    pub const VXLAN_GEN: &str = "FP_VXLAN_GEN";
    /// Per-CPU learning counters indexed by [`crate::vxlan::vxlan_stat`].
    pub const VXLAN_STATS: &str = "FP_VXLAN_STATS";
    /// The route cache: the FIB's answer per flow (not pinned; 48-byte key, 40-byte value).
    pub const ROUTE_CACHE: &str = "FP_ROUTE_CACHE";
    /// Per-CPU route cache counters indexed by [`crate::route::route_stat`].
    pub const ROUTE_STATS: &str = "FP_ROUTE_STATS";
    /// ifindex → 1 when the interface is a veth (or netkit) whose peer is in another network
    /// namespace, else 0 (daemon-written from netlink, whatever the config).
    pub const PEER: &str = "FP_PEER";
    /// XDP tail programs (`program_names::XDP_TAILS`), filled by the loader.
    pub const TAILS: &str = "FP_TAILS";
    /// TC tail programs (`program_names::TC_TAILS`), filled by the loader.
    pub const TC_TAILS: &str = "FP_TC_TAILS";
    /// The routing benchmark generator's frame headers (`bench::BENCH_FRAME_WORDS` words).
    pub const BENCH_FRAME: &str = "FP_BENCH_FRAME";
    /// The key `bench_ct_lookup` looks up.
    pub const BENCH_CT_KEY: &str = "FP_BENCH_CT_KEY";
    /// The open-addressed table `bench_table_slots` works on: its buckets' heads
    /// (`bench::CtBucket`) and its slots (`bench::CtSlot`).
    pub const BENCH_HEADS: &str = "FP_BENCH_HEADS";
    pub const BENCH_SLOTS: &str = "FP_BENCH_SLOTS";
    /// The LRU hash `bench_table_lru` works on, of the conntrack table's key and entry.
    pub const BENCH_LRU: &str = "FP_BENCH_LRU";
}

/// Names of the object's read-only globals, which the loader sets before the load
/// (`EbpfLoader::override_global`) from what it probed of the kernel. The verifier reads
/// them as constants, so code behind a global that is 0 is dead to it: never checked, and
/// free to call a helper this kernel lacks (from Linux 5.13: older kernels refuse a
/// callback's address even in dead code).
pub mod global_names {
    /// 1 if the kernel has the `bpf_loop` helper (Linux 5.17), which the least-connections
    /// scan calls; 0 turns the scan off (the daemon refuses least-connections services).
    /// A `u8`; the object's own value is 1.
    pub const HAVE_BPF_LOOP: &str = "FP_HAVE_BPF_LOOP";
}

/// Names of the programs in the eBPF object.
pub mod program_names {
    pub const XDP: &str = "fastpath_xdp";
    pub const TC_INGRESS: &str = "fastpath_tc_ingress";
    pub const TC_EGRESS: &str = "fastpath_tc_egress";
    /// Empty programs measured as the benchmark floor; never attached.
    pub const BENCH_FLOOR_XDP: &str = "bench_floor_xdp";
    pub const BENCH_FLOOR_TC: &str = "bench_floor_tc";
    /// Synthetic conntrack event producer for the ring-drain benchmark; never attached.
    pub const BENCH_CT_EVENTS: &str = "bench_ct_events";
    /// XDP_TX for every frame: the routing benchmark's in-kernel traffic generator
    /// (BPF_PROG_TEST_RUN in live-frames mode); never attached.
    pub const BENCH_XDP_TX: &str = "bench_xdp_tx";
    /// As `bench_xdp_tx`, each frame a new TCP flow (`bench::flow_stamp`): the replication
    /// benchmark's generator of new connections; never attached.
    pub const BENCH_XDP_FLOWS: &str = "bench_xdp_flows";
    /// Drops IPv4 datagrams to `bench::SINK_UDP_PORT` and passes everything else: attached
    /// by the load-balancer benchmark to the backends' links as a traffic sink, as a
    /// generator's receiving port (the veth counts the drops).
    pub const BENCH_XDP_SINK: &str = "bench_xdp_sink";
    /// One lookup in the conntrack table (of `FP_BENCH_CT_KEY`) and nothing else: the
    /// benchmark's measure of the hash lookup inside the CT-hit path; never attached.
    pub const BENCH_CT_LOOKUP: &str = "bench_ct_lookup";
    /// A new connection's or an established packet's table work (`bench::TableRun`) on the
    /// conntrack hash `FP_CT`, on an open-addressed array (`FP_BENCH_SLOTS`) and on an LRU
    /// hash (`FP_BENCH_LRU`): the benchmark's comparison of table kinds; never attached.
    pub const BENCH_TABLE_HASH: &str = "bench_table_hash";
    pub const BENCH_TABLE_SLOTS: &str = "bench_table_slots";
    pub const BENCH_TABLE_LRU: &str = "bench_table_lru";
    /// Creates and removes conntrack entries for the daemon, a batch of
    /// [`crate::ct::CtRecord`]s per BPF_PROG_TEST_RUN (HA applies a peer's changes with it);
    /// never attached.
    pub const CT_INSTALL: &str = "fastpath_ct_install";
    /// XDP programs the main one tail-calls (`FP_TAILS`), by index: rare paths whose stack
    /// would not fit beside the main program's.
    pub const XDP_TAILS: [&str; 8] = [
        "fastpath_xdp_icmp_error",
        "fastpath_xdp_icmp6_error",
        "fastpath_xdp_reject",
        "fastpath_xdp_reject6",
        "fastpath_xdp_vlan_forward",
        "fastpath_xdp_vxlan_encap",
        "fastpath_xdp_vxlan_decap",
        "fastpath_xdp_new_connection",
    ];
    /// TC programs the TC ingress one tail-calls (`FP_TC_TAILS`), by index.
    pub const TC_TAILS: [&str; 5] = [
        "fastpath_tc_vxlan_encap",
        "fastpath_tc_vxlan_decap",
        "fastpath_tc_lb",
        "fastpath_tc_icmp_error",
        "fastpath_tc_icmp6_error",
    ];
}

/// `FP_TAILS` indexes of the XDP tail programs that translate ICMP (IPv4) and ICMPv6 errors
/// of load-balanced connections.
pub const TAIL_ICMP_ERROR: u32 = 0;
pub const TAIL_ICMP6_ERROR: u32 = 1;
/// `FP_TAILS` indexes of the XDP tail programs that answer a new connection to a service
/// without backends (`no_backend = "reject"`), IPv4 and IPv6.
pub const TAIL_REJECT: u32 = 2;
pub const TAIL_REJECT6: u32 = 3;
/// `FP_TAILS` index of the XDP tail program that tags a frame forwarded out of an 802.1Q
/// port and redirects it.
pub const TAIL_VLAN_FORWARD: u32 = 4;
/// `FP_TAILS` index of the XDP tail program that puts learned VXLAN headers on a frame the
/// L3 stage routed to a vxlan device and redirects it to the underlay.
pub const TAIL_VXLAN_ENCAP: u32 = 5;
/// `FP_TAILS` index of the XDP tail program for UDP arriving on a VXLAN underlay: a
/// configured network's packets are decapsulated and their inner packet routed.
pub const TAIL_VXLAN_DECAP: u32 = 6;
/// `FP_TAILS` index of the XDP tail program for a packet that may start a connection
/// conntrack did not find: the load-balancing stages (service, backend, the connection's
/// entries), then the rest of the pipeline. A program of its own: verified apart from the
/// main program, whose established path it leaves within the verifier's limits.
pub const TAIL_NEW_CONNECTION: u32 = 7;
/// `FP_TC_TAILS` indexes of the TC ingress tail programs: VXLAN encapsulation of a packet
/// the L3 stage routed to a vxlan device, and decapsulation of UDP arriving on an underlay
/// (as `TAIL_VXLAN_ENCAP` and `TAIL_VXLAN_DECAP` at XDP).
pub const TC_TAIL_VXLAN_ENCAP: u32 = 0;
pub const TC_TAIL_VXLAN_DECAP: u32 = 1;
/// `FP_TC_TAILS` index of the TC ingress pipeline with the load-balancing stages, for the
/// packets of an interface that tracks connections at TC ingress (their stack does not fit
/// beside the TC ingress program's own).
pub const TC_TAIL_LB: u32 = 2;
/// `FP_TC_TAILS` indexes of the TC tail programs that translate ICMP (IPv4) and ICMPv6 errors
/// of load-balanced connections (as `TAIL_ICMP_ERROR` and `TAIL_ICMP6_ERROR` at XDP).
pub const TC_TAIL_ICMP_ERROR: u32 = 3;
pub const TC_TAIL_ICMP6_ERROR: u32 = 4;

/// What the benchmark programs do, shared by the programs and the benchmark that drives them.
pub mod bench {
    /// Conntrack events one run of `bench_ct_events` emits. Each is a NEW event for a UDP key
    /// whose ports hold a sequence number (`port_lo` the low 16 bits, `port_hi` the next 16)
    /// and whose `ts_ns` is the full sequence number: consecutive over every run of one loaded
    /// object, so a consumer sees any loss or reordering.
    pub const CT_EVENTS_PER_RUN: u32 = 32;
    /// Words of the generators' frame that `bench_xdp_tx` and `bench_xdp_flows` restore in
    /// every frame they send (56 bytes: Ethernet, IPv4 and TCP headers up to the TCP
    /// checksum, or a UDP header and some payload).
    pub const BENCH_FRAME_WORDS: usize = 7;
    /// Offsets in `bench_xdp_flows`'s frame (Ethernet, IPv4 without options, TCP) of the
    /// fields it stamps: the IPv4 checksum, the low 16 bits of the source address, the TCP
    /// source port, the TCP checksum. Each is 2 bytes inside one frame word.
    pub const FLOW_IP_CSUM: usize = 24;
    pub const FLOW_SRC_LOW: usize = 28;
    pub const FLOW_SPORT: usize = 34;
    pub const FLOW_TCP_CSUM: usize = 50;

    /// The low 16 bits of the IPv4 source address and the TCP source port that
    /// `bench_xdp_flows` stamps into frame number `n` (counted over every frame one loaded
    /// object sends): 2^31 distinct flows, source ports 32768..=65535.
    pub const fn flow_stamp(n: u64) -> (u16, u16) {
        ((n >> 15) as u16, 0x8000 | (n & 0x7fff) as u16)
    }
    /// The UDP port whose IPv4 datagrams `bench_xdp_sink` drops (the discard port, which the
    /// load-balancer benchmarks send to).
    pub const SINK_UDP_PORT: u16 = 9;

    use crate::ct::{CtEntry, CtKey};

    /// The input frame of the `bench_table_*` programs: a key, what to do with
    /// it, and the open-addressed table's bucket mask (its buckets are a power of two).
    #[derive(Clone, Copy, Debug, Default)]
    #[repr(C, align(8))]
    pub struct TableRun {
        pub key: CtKey,
        /// [`TABLE_NEW`], [`TABLE_NEW_ONE`] or [`TABLE_HIT`].
        pub op: u32,
        pub mask: u32,
        /// Up to the 64 bytes BPF_PROG_TEST_RUN's XDP input wants at least (an Ethernet
        /// header's worth is the minimum; 64 keeps the floor's frame the same size).
        pub _pad: [u64; 2],
    }
    const _: () = assert!(core::mem::size_of::<TableRun>() == 64);

    impl TableRun {
        /// The frame a table-kind program reads.
        pub fn as_bytes(&self) -> &[u8] {
            // SAFETY: TableRun is repr(C) plain data without padding (its size is asserted
            // above); the slice borrows `self`.
            unsafe {
                core::slice::from_raw_parts(
                    (self as *const TableRun).cast::<u8>(),
                    core::mem::size_of::<TableRun>(),
                )
            }
        }
    }

    /// A new load-balanced connection's table work: the key is looked up and not found, then
    /// it and its alias ([`table_alias`]) are inserted (`BPF_NOEXIST` semantics). XDP_PASS
    /// when all three went so, XDP_DROP otherwise.
    pub const TABLE_NEW: u32 = 0;
    /// An established packet's: the key is looked up, found, and a packet counted in its
    /// entry. XDP_PASS when found, XDP_DROP otherwise.
    pub const TABLE_HIT: u32 = 1;
    /// A new connection of one entry (a DSR connection's, Katran's): the key is looked up and
    /// not found, then inserted. XDP_PASS when both went so, XDP_DROP otherwise.
    pub const TABLE_NEW_ONE: u32 = 2;

    /// The alias a [`TABLE_NEW`] run inserts beside `key`: the same tuple as another
    /// protocol, so it never meets the table's other keys.
    #[inline(always)]
    pub fn table_alias(key: &CtKey) -> CtKey {
        CtKey {
            proto: key.proto ^ 0x80,
            ..*key
        }
    }

    /// The open-addressed conntrack table the benchmark times beside the kernel's hash: a
    /// key may sit in either of two buckets of [`BUCKET_SLOTS`] slots ([`slot_buckets`]),
    /// and goes into the one with more room (two choices keep buckets from overflowing well
    /// past half full; the first free slot of the first bucket alone overflows a few buckets
    /// in a thousand there). A bucket's heads (`FP_BENCH_HEADS`, one cache line) hold each slot's
    /// state (`SLOT_*`, low half) and the key's tag (the high half of its hash), so a lookup
    /// reads two lines of heads and only the slot whose head matches; an insert claims a slot
    /// by compare-and-swap on its head (BPF's compare-and-swap is 64-bit on every CPU
    /// version), no lock. The slot (`FP_BENCH_SLOTS`, bucket × `BUCKET_SLOTS` + i) holds the
    /// key and the entry.
    #[derive(Clone, Copy, Debug, Default)]
    #[repr(C, align(8))]
    pub struct CtSlot {
        pub key: CtKey,
        pub entry: CtEntry,
    }
    const _: () = assert!(core::mem::size_of::<CtSlot>() == 192);

    /// Slots per bucket: a bucket's heads fill one 64-byte cache line.
    pub const BUCKET_SLOTS: usize = 8;

    /// One bucket's heads (see [`CtSlot`]).
    pub type CtBucket = [u64; BUCKET_SLOTS];

    /// Empty (never used, or its key was removed: a lookup reads the whole bucket anyway). The
    /// whole head is zero.
    pub const SLOT_FREE: u64 = 0;
    /// Being written by the CPU that claimed it: skipped by lookups, not taken by inserts.
    pub const SLOT_CLAIMED: u64 = 1;
    /// Holds a key and its entry.
    pub const SLOT_LIVE: u64 = 2;

    /// The two buckets `key` may sit in, in a table of `mask + 1` buckets (a power of two
    /// above one), and its tag in place (the high half of a head). The second bucket is the
    /// first's XOR a function of the tag, so either tells the other.
    #[inline(always)]
    pub fn slot_buckets(key: &CtKey, mask: u32) -> (u32, u32, u64) {
        let h = crate::ct::flow_hash(key);
        let first = h as u32 & mask;
        let step = ((h >> 32) as u32).wrapping_mul(0x5bd1_e995) | 1;
        (first, (first ^ step) & mask, h & !0xffff_ffff)
    }
}
