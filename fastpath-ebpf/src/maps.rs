//! Every map of the datapath, in one place. Pinned by name under `<pin_dir>/maps/` by the
//! daemon, so a daemon restart or crash keeps both the counters and the attached programs.

use crate::{
    ctx::{
        BACKEND_HOP_SLOTS, BackendHop, Express, FibParams, FlowNote, Miss, NatPlan, RouteHop,
        RouteKey, RouteLearning,
    },
    parse::Parsed,
};
use aya_ebpf::{
    macros::map,
    maps::{Array, DevMapHash, HashMap, LruHashMap, PerCpuArray, ProgramArray, Queue, RingBuf},
};
use fastpath_common::{
    Counter, DatapathConfig,
    ct::{
        CT_EVENTS_BYTES, CtEntry, CtHop, CtKey, FLOW_SLOTS, FlowSlot, IFACE_SLOTS, IfaceConfig,
        ct_stat,
    },
    lb::{
        AFFINITY_ENTRIES, Affinity, AffinityKey, Backend, BackendCounters, BackendLoad, LB_SLOTS,
        MAX_BACKENDS, MAX_SERVICES, MAX_SNAT_RULES, Service, SnatRule, SvcCounters, SvcKey,
    },
    route::{ROUTE_CACHE_ENTRIES, route_stat},
    stats::STATS_ENTRIES,
    vxlan::{VXLAN_NETS, VXLAN_PEERS, VxlanKey, VxlanNet, VxlanPeer, vxlan_stat},
};

/// Packet/byte counters, one slot per (hook, verdict, reason) for reason codes below 64: see
/// `stats_index`. Written by every entry point exactly once per packet; read by the daemon
/// and CLI. Per-CPU so the hot path never contends; 3 hooks × 3 verdicts × 64 reason slots
/// (4 × 4 × 64 with the reserved ones: its pinned size, never changed).
#[map(name = "FP_STATS")]
pub static FP_STATS: PerCpuArray<Counter> = PerCpuArray::pinned(STATS_ENTRIES, 0);

/// The same for reason codes 64 to 127 (`stats_map` 1), laid out as `FP_STATS`: a second map
/// rather than a larger first one, which a datapath upgraded over its pinned maps could not
/// reuse.
#[map(name = "FP_STATS_EXT")]
pub static FP_STATS_EXT: PerCpuArray<Counter> = PerCpuArray::pinned(STATS_ENTRIES, 0);

/// Runtime knobs (`DatapathConfig` at index 0), written by the daemon from its config file.
/// Read only on rare paths (malformed packets), never on the per-packet fast path.
#[map(name = "FP_CONFIG")]
pub static FP_CONFIG: Array<DatapathConfig> = Array::pinned(1, 0);

/// This CPU's clock reading (`clock::now`): the jiffies it was read at, and the coarse
/// clock's time then. Not pinned: a load starts it empty.
#[map(name = "FP_CLOCK")]
pub static FP_CLOCK: PerCpuArray<[u64; 2]> = PerCpuArray::with_max_entries(1, 0);

/// Time of the last rare-event log record on each CPU (ns, monotonic): see `ratelimit`.
/// Not pinned: losing it on restart only allows one early record.
#[map(name = "FP_LOG_RATELIMIT")]
pub static FP_LOG_RATELIMIT: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// The conntrack table: one entry per connection under its direction-independent key.
/// Written by the conntrack stage; read, expired and flushed by the daemon. A plain hash (no
/// LRU): an LRU evicts whatever it likes when full — established connections included — and
/// counts nothing. Here a full table makes room only by dropping the oldest *unassured* entry
/// (early drop, through `FP_CT_NEW`, counted, with an event); when every entry is assured the
/// new connection is refused and counted as `insert_failed`. 1 Mi entries by default; the
/// daemon sizes it at load. Preallocated: an insert takes an element from a per-CPU free
/// list, where a hash that allocates on insert (BPF_F_NO_PREALLOC) refills its cache from the
/// slab now and then and makes a few inserts in a hundred tens of µs slow (docs/conntrack.md
/// has the numbers). A daemon expiry pass over 1M entries takes ~0.5 s, so the daemon spaces
/// passes to stay under 10% of a CPU. A pin of another kind or size is migrated at start
/// (`datapath::migrate`).
#[map(name = "FP_CT")]
pub static FP_CT: HashMap<CtKey, CtEntry> = HashMap::pinned(1 << 20, 0);

/// The XDP flow cache (see `FlowSlot`, `flowcache.rs`): a direct-mapped copy of the entries
/// of steady connections, probed before `FP_CT` (an array lookup the verifier inlines, no call
/// and return). Per CPU, so no two writers share a slot (the daemon only reads it). Pinned:
/// the copies' counts carry over a restart.
#[map(name = "FP_FLOW")]
pub static FP_FLOW: PerCpuArray<FlowSlot> = PerCpuArray::pinned(FLOW_SLOTS, 0);

/// The tag of each slot of this CPU's `FP_FLOW` (`ct::flow_tag` of its key; 0: empty), in one
/// 32 KiB value: a probe for a connection the cache does not hold (every new flow's) reads
/// this, which stays in the CPU's cache, not the 208-byte slot in a 1.7 MB array.
#[map(name = "FP_FLOW_TAG")]
pub static FP_FLOW_TAG: PerCpuArray<[u32; FLOW_SLOTS as usize]> = PerCpuArray::pinned(1, 0);

/// The flow cache's epoch per slot, shared by every CPU: bumped (atomically, by the
/// datapath and by the daemon through its memory mapping) whenever an entry whose key maps
/// to the slot is removed, replaced or leaves its steady state, so no CPU's copy outlives
/// the entry as it was.
#[map(name = "FP_FLOW_EPOCH")]
pub static FP_FLOW_EPOCH: Array<u64> = Array::pinned(FLOW_SLOTS, BPF_F_MMAPABLE);

/// What the pipeline did to a packet each slot of this CPU's `FP_FLOW` served, per direction
/// (`ctx::Express`, see `express.rs`), for the connection's next packets. Not pinned: a recipe holds only for
/// the copy it was learned from, and a restart learns it again from one packet.
#[map(name = "FP_EXPRESS")]
pub static FP_EXPRESS: PerCpuArray<[Express; 2]> = PerCpuArray::with_max_entries(FLOW_SLOTS, 0);

/// This CPU's `ctx::FlowNote`: which slot served the packet in process.
#[map(name = "FP_FLOW_NOTE")]
pub static FP_FLOW_NOTE: PerCpuArray<FlowNote> = PerCpuArray::with_max_entries(1, 0);

/// Per-CPU LRU lists for an LRU hash.
const BPF_F_NO_COMMON_LRU: u32 = 2;

/// Keys of connections in the order they were created: the early-drop candidates, oldest
/// first. When the table is full the conntrack stage pops keys until it finds one whose entry
/// is still unassured and deletes that entry (keys of entries since assured or gone are simply
/// discarded). As large as the table; a push onto a full queue overwrites the oldest key.
#[map(name = "FP_CT_NEW")]
pub static FP_CT_NEW: Queue<CtKey> = Queue::pinned(1 << 20, 0);

/// Per-CPU conntrack counters (`ct_stat::*`).
#[map(name = "FP_CT_STATS")]
pub static FP_CT_STATS: PerCpuArray<u64> = PerCpuArray::pinned(ct_stat::SLOTS, 0);

/// Conntrack events (`CtEvent`) for the daemon: NEW, ESTABLISHED, CLOSED… `CT_EVENTS_BYTES`
/// of slack; when full, events are counted as lost, never waited for.
#[map(name = "FP_CT_EVENTS")]
pub static FP_CT_EVENTS: RingBuf = RingBuf::pinned(CT_EVENTS_BYTES, 0);

/// Per-interface settings indexed by ifindex (`IfaceConfig`), written by the daemon: which
/// hook tracks connections. An array, not a hash: its lookup is inlined by the verifier,
/// while a hash lookup is a kernel call on every packet. 65536 ifindexes × 16 B = 1 MiB.
#[map(name = "FP_IFACE")]
pub static FP_IFACE: Array<IfaceConfig> = Array::pinned(IFACE_SLOTS, 0);

/// The routing interfaces, by ifindex, for XDP's redirects: a device map holds the device
/// itself, where a redirect by ifindex looks it up for every packet. The daemon keeps it
/// equal to the interfaces with `route = true`; a redirect to another goes by ifindex.
#[map(name = "FP_TX_PORTS")]
pub static FP_TX_PORTS: DevMapHash = DevMapHash::pinned(TX_PORTS, 0);
/// `FP_TX_PORTS`' capacity (`fastpath_common::ct::TX_PORTS`).
const TX_PORTS: u32 = fastpath_common::ct::TX_PORTS;

/// This CPU's packet context: what the parser learned about the packet being processed,
/// read by the later stages. One entry per CPU; overwritten by every packet.
#[map(name = "FP_PKT_CTX")]
pub static FP_PKT_CTX: PerCpuArray<Parsed> = PerCpuArray::with_max_entries(1, 0);

/// This CPU's conntrack key under construction: built in place from the packet (no stack
/// copies of 16-byte addresses) and used for the lookup and insert.
#[map(name = "FP_CT_KEY")]
pub static FP_CT_KEY: PerCpuArray<CtKey> = PerCpuArray::with_max_entries(1, 0);

/// Next sequence number of `bench_ct_events` (index 0): the benchmark's synthetic producer,
/// never run on live traffic. Shared by all CPUs, not per-CPU, so the sequence stays one
/// sequence when the benchmark's single producer thread moves between CPUs. Not pinned: each
/// load starts at 0.
#[cfg(feature = "bench")]
#[map(name = "FP_BENCH_SEQ")]
pub static FP_BENCH_SEQ: Array<u64> = Array::with_max_entries(1, 0);

/// Next frame number of `bench_xdp_flows` (index 0): shared by all CPUs, so that one
/// generator thread's frames stay distinct flows when it moves between CPUs; one thread per
/// loaded object (the increment is not atomic). Not pinned: each load starts at 0.
#[cfg(feature = "bench")]
#[map(name = "FP_BENCH_FLOWS")]
pub static FP_BENCH_FLOWS: Array<u64> = Array::with_max_entries(1, 0);

/// The generators' frame, its first `BENCH_FRAME_WORDS` words: written over every frame
/// `bench_xdp_tx` and `bench_xdp_flows` send, since a frame comes back to the generator with the
/// headers the path rewrote (live frames are recycled, not reset). Not pinned.
#[cfg(feature = "bench")]
#[map(name = "FP_BENCH_FRAME")]
pub static FP_BENCH_FRAME: Array<[u64; fastpath_common::bench::BENCH_FRAME_WORDS]> =
    Array::with_max_entries(1, 0);

/// The conntrack key `bench_ct_lookup` looks up, written by the benchmark. Not pinned.
#[cfg(feature = "bench")]
#[map(name = "FP_BENCH_CT_KEY")]
pub static FP_BENCH_CT_KEY: Array<CtKey> = Array::with_max_entries(1, 0);

/// The open-addressed table `bench_table_slots` works on (see
/// `fastpath_common::bench::CtSlot`): its buckets' heads and its slots, sized by the benchmark
/// (a power of two buckets, `BUCKET_SLOTS` slots each) and filled through their memory
/// mappings. Not pinned.
#[cfg(feature = "bench")]
#[map(name = "FP_BENCH_HEADS")]
pub static FP_BENCH_HEADS: Array<fastpath_common::bench::CtBucket> =
    Array::with_max_entries(1, BPF_F_MMAPABLE);
#[cfg(feature = "bench")]
#[map(name = "FP_BENCH_SLOTS")]
pub static FP_BENCH_SLOTS: Array<fastpath_common::bench::CtSlot> =
    Array::with_max_entries(1, BPF_F_MMAPABLE);

/// The LRU hash `bench_table_lru` works on: the kind Katran keeps its flows in, sized by the
/// benchmark like the conntrack table and filled with the same keys. Not pinned.
#[cfg(feature = "bench")]
#[map(name = "FP_BENCH_LRU")]
pub static FP_BENCH_LRU: LruHashMap<CtKey, CtEntry> = LruHashMap::with_max_entries(1, 0);

/// Services: (VIP, port, protocol) → `Service`, written by the daemon (one value write
/// switches a service to its new selection table).
#[map(name = "FP_SVC")]
pub static FP_SVC: HashMap<SvcKey, Service> = HashMap::pinned(MAX_SERVICES, 0);

/// Backends by index, written by the daemon before any selection table names them.
/// Memory-mapped by the daemon (BPF_F_MMAPABLE): it writes new ranges directly, no syscalls.
#[map(name = "FP_BACKENDS")]
pub static FP_BACKENDS: Array<Backend> = Array::pinned(MAX_BACKENDS, BPF_F_MMAPABLE);

/// Selection tables of all services: backend indexes, one region per service version, two
/// per element (array elements are 8-byte aligned, so a u32 array would waste half its
/// memory and not be one flat u32 array when memory-mapped). Memory-mapped by the daemon.
#[map(name = "FP_LB_SLOTS")]
pub static FP_LB_SLOTS: Array<[u32; 2]> = Array::pinned(LB_SLOTS / 2, BPF_F_MMAPABLE);

/// Map flag: the array can be mmap()ed by userspace.
const BPF_F_MMAPABLE: u32 = 1 << 10;

/// Per-service round-robin positions (weighted round robin), per CPU: each CPU walks the
/// service's sequence on its own, so no two CPUs contend for one counter.
#[map(name = "FP_SVC_RR")]
pub static FP_SVC_RR: PerCpuArray<u32> = PerCpuArray::with_max_entries(MAX_SERVICES, 0);

/// Per-service and per-backend counters, per CPU.
#[map(name = "FP_SVC_STATS")]
pub static FP_SVC_STATS: PerCpuArray<SvcCounters> = PerCpuArray::pinned(MAX_SERVICES, 0);
#[map(name = "FP_BACKEND_STATS")]
pub static FP_BACKEND_STATS: PerCpuArray<BackendCounters> = PerCpuArray::pinned(MAX_BACKENDS, 0);

/// This CPU's service key under construction (see `FP_CT_KEY`).
#[map(name = "FP_SVC_KEY")]
pub static FP_SVC_KEY: PerCpuArray<SvcKey> = PerCpuArray::with_max_entries(1, 0);

/// This CPU's second conntrack key: the alias (client ↔ backend) of a new load-balanced
/// connection, built while the first still holds the connection's own key.
#[map(name = "FP_CT_KEY2")]
pub static FP_CT_KEY2: PerCpuArray<CtKey> = PerCpuArray::with_max_entries(1, 0);

/// This CPU's third conntrack key: the connection an alias that is in the way belongs to
/// (`conntrack::replace_ended`), while the first two hold the new connection's keys.
#[map(name = "FP_CT_KEY3")]
pub static FP_CT_KEY3: PerCpuArray<CtKey> = PerCpuArray::with_max_entries(1, 0);

/// Source-IP affinity: a client of a service → the backend its last new connection got and
/// when. An LRU (the least recently seen clients go when full): losing one only means its next
/// connection is balanced afresh.
#[map(name = "FP_AFFINITY")]
pub static FP_AFFINITY: LruHashMap<AffinityKey, Affinity> = LruHashMap::pinned(AFFINITY_ENTRIES, 0);

/// This CPU's affinity key under construction.
#[map(name = "FP_AFF_KEY")]
pub static FP_AFF_KEY: PerCpuArray<AffinityKey> = PerCpuArray::with_max_entries(1, 0);

/// Connections given and closed per backend (`BackendLoad`), atomic adds from the datapath:
/// what least-connections compares.
#[map(name = "FP_BACKEND_LOAD")]
pub static FP_BACKEND_LOAD: Array<BackendLoad> = Array::pinned(MAX_BACKENDS, 0);

/// Per backend, its connections that expired without closing (written by the daemon's expiry
/// only).
#[map(name = "FP_BACKEND_GONE")]
pub static FP_BACKEND_GONE: Array<u64> = Array::pinned(MAX_BACKENDS, 0);

/// This CPU's new conntrack entries under construction (a connection's and its alias), built
/// here rather than on the 512-byte BPF stack.
#[map(name = "FP_CT_ENTRY")]
pub static FP_CT_ENTRY: PerCpuArray<CtEntry> = PerCpuArray::with_max_entries(2, 0);

/// This CPU's packet that may start a connection conntrack did not find (see `ctx::Miss`).
#[map(name = "FP_MISS")]
pub static FP_MISS: PerCpuArray<Miss> = PerCpuArray::with_max_entries(1, 0);

/// This CPU's stand-in for a connection's next hop (`ctx::HopRef`) when the packet found no
/// entry: written, never read.
#[map(name = "FP_HOP")]
pub static FP_HOP: PerCpuArray<CtHop> = PerCpuArray::with_max_entries(1, 0);

/// This CPU's routes of backends, shared by their new connections (see `ctx::BackendHop`,
/// `route::shared`). A cache: not pinned, refilled from the FIB.
#[map(name = "FP_BACKEND_HOP")]
pub static FP_BACKEND_HOP: PerCpuArray<BackendHop> =
    PerCpuArray::with_max_entries(BACKEND_HOP_SLOTS, 0);

/// This CPU's planned rewrite of the packet being processed (see `ctx::NatPlan`).
#[map(name = "FP_NAT")]
pub static FP_NAT: PerCpuArray<NatPlan> = PerCpuArray::with_max_entries(1, 0);

/// Gateway SNAT rules (`SnatRule`), indexed by `IfaceConfig::snat`; written by the daemon.
#[map(name = "FP_SNAT")]
pub static FP_SNAT: Array<SnatRule> = Array::pinned(MAX_SNAT_RULES, 0);

/// This CPU's service of a new connection: a copy of its `FP_SVC` value, or the gateway
/// "service" of a SNAT connection (see `gateway`).
#[map(name = "FP_NEW_SVC")]
pub static FP_NEW_SVC: PerCpuArray<Service> = PerCpuArray::with_max_entries(1, 0);
/// This CPU's "backend" of a new gateway SNAT connection: its destination.
#[map(name = "FP_SNAT_DST")]
pub static FP_SNAT_DST: PerCpuArray<Backend> = PerCpuArray::with_max_entries(1, 0);

/// This CPU's FIB lookup parameters (64 bytes: off the 512-byte stack).
#[map(name = "FP_FIB")]
pub static FP_FIB: PerCpuArray<FibParams> = PerCpuArray::with_max_entries(1, 0);

/// XDP tail programs (`program_names::XDP_TAILS`), filled by the loader before the main
/// program is attached. Not pinned by name: each load brings its own programs, and the
/// daemon pins each load's arrays apart (`tails/<prog id>/`), so they outlive it.
#[map(name = "FP_TAILS")]
pub static FP_TAILS: ProgramArray = ProgramArray::with_max_entries(8, 0);

/// TC ingress tail programs (`program_names::TC_TAILS`), as `FP_TAILS`.
#[map(name = "FP_TC_TAILS")]
pub static FP_TC_TAILS: ProgramArray = ProgramArray::with_max_entries(5, 0);

/// ifindex → 1 when the interface is a veth or netkit device whose peer lives in another
/// network namespace (daemon-written from netlink): a packet forwarded there at TC ingress
/// can go straight to the peer's ingress (`route::tc_redirect`). A separate array rather than
/// an `IfaceConfig` flag: the daemon's link watcher owns it, and it never races a config
/// change writing `FP_IFACE`.
#[map(name = "FP_PEER")]
pub static FP_PEER: Array<u32> = Array::pinned(IFACE_SLOTS, 0);
/// VNI → the VXLAN network's settings (daemon-written).
#[map(name = "FP_VXLAN_NET")]
pub static FP_VXLAN_NET: HashMap<u32, VxlanNet> = HashMap::pinned(VXLAN_NETS, 0);
/// Outer headers learned from the kernel's vxlan devices, per (device, inner next-hop MAC).
#[map(name = "FP_VXLAN_PEER")]
pub static FP_VXLAN_PEER: LruHashMap<VxlanKey, VxlanPeer> = LruHashMap::pinned(VXLAN_PEERS, 0);
/// The generation learned headers and cached routes must have to be used (daemon-bumped).
#[map(name = "FP_VXLAN_GEN")]
pub static FP_VXLAN_GEN: Array<u64> = Array::pinned(1, 0);
#[map(name = "FP_VXLAN_STATS")]
pub static FP_VXLAN_STATS: PerCpuArray<u64> = PerCpuArray::pinned(vxlan_stat::SLOTS, 0);
/// Scratch: the cache key being looked up or learned (kept off the stack).
#[map(name = "FP_VXLAN_KEY")]
pub static FP_VXLAN_KEY: PerCpuArray<VxlanKey> = PerCpuArray::with_max_entries(1, 0);
/// Scratch: an entry being learned (kept off the stack).
#[map(name = "FP_VXLAN_LEARN")]
pub static FP_VXLAN_LEARN: PerCpuArray<VxlanPeer> = PerCpuArray::with_max_entries(1, 0);

/// The route cache (`fastpath_common::route`): the FIB's answer per flow. Not pinned: a
/// load starts it empty. Per-CPU LRU lists (BPF_F_NO_COMMON_LRU): a CPU learning a flow
/// takes no lock another CPU holds.
#[map(name = "FP_ROUTE_CACHE")]
pub static FP_ROUTE_CACHE: LruHashMap<RouteKey, RouteHop> =
    LruHashMap::with_max_entries(ROUTE_CACHE_ENTRIES, BPF_F_NO_COMMON_LRU);
/// Route cache hits, misses and stale entries per CPU (`route_stat`).
#[map(name = "FP_ROUTE_STATS")]
pub static FP_ROUTE_STATS: PerCpuArray<u64> = PerCpuArray::pinned(route_stat::SLOTS, 0);
/// Scratch: a route cache entry being learned, with its key (kept off the stack).
#[map(name = "FP_ROUTE_LEARN")]
pub static FP_ROUTE_LEARN: PerCpuArray<RouteLearning> = PerCpuArray::with_max_entries(1, 0);

/// The value of the array `map` at `*key`, a key in memory the caller keeps: in a `bpf_loop`
/// step, its context, so the step's frame needs no stack of its own (aya's `get` copies the
/// index to the caller's stack, and a step's frame counts toward the program's 512 bytes).
#[inline(always)]
pub fn array_at<T>(map: &'static Array<T>, key: &u32) -> Option<&'static T> {
    // SAFETY: aya's `Array` is `repr(transparent)` over the map definition, so its address
    // is the map's (what the loader relocates); the helper returns a pointer to a value of
    // the array, valid for this program run, or null.
    unsafe {
        let v = aya_ebpf::helpers::bpf_map_lookup_elem(
            (map as *const Array<T>).cast_mut().cast(),
            (key as *const u32).cast(),
        );
        v.cast::<T>().as_ref()
    }
}
