//! The route cache: per flow, the kernel FIB's answer for it (egress interface, next hop's
//! and egress MAC addresses, how long a packet fits), so that a flow's later packets skip
//! `bpf_fib_lookup`. Keyed by everything the lookup is asked with (the arriving interface,
//! family, protocol, ports and both addresses), a hit is the answer the FIB would give for
//! the same question — policy rules and multipath routes included — as long as nothing
//! changed: an entry carries the generation of `FP_VXLAN_GEN` (the daemon bumps it on any
//! route, neighbour, link or configuration change) and expires [`ROUTE_CACHE_TTL_NS`] after
//! it was learned (bounding staleness while no daemon watches, and for what netlink does
//! not announce, such as a forwarding sysctl).

/// In `FP_VXLAN_GEN` (the route generation), set by the daemon while the kernel's FIB
/// answers a forwarded packet by its arriving interface and destination alone: no policy rule
/// selects by source, ports, protocol or TOS, and no route is multipath. Then new
/// load-balanced connections to one backend share the route the first was told, and the flag
/// changes only with a new generation (one write), so no shared route outlives it.
pub const GEN_F_FIB_PER_DST: u64 = 1 << 63;

/// Entries of `FP_ROUTE_CACHE` (LRU: the least recently used flow goes first).
pub const ROUTE_CACHE_ENTRIES: u32 = 65_536;
/// How long a learned answer is used at most (coarse monotonic clock).
pub const ROUTE_CACHE_TTL_NS: u64 = 1_000_000_000;

/// Indexes of the per-CPU route cache counters (`FP_ROUTE_STATS`).
pub mod route_stat {
    /// Routed with the cached answer (no FIB lookup).
    pub const HIT: u32 = 0;
    /// Asked the FIB: no entry for the flow, or the packet is longer than the entry knows
    /// to fit.
    pub const MISS: u32 = 1;
    /// Asked the FIB: the entry was from an earlier generation or had expired.
    pub const STALE: u32 = 2;
    /// One past the highest counter in use.
    pub const COUNT: u32 = 3;
    pub const SLOTS: u32 = 4;
    const _: () = assert!(COUNT <= SLOTS);
    /// Stable snake_case names, indexed by counter, for the CLI and metrics labels.
    pub const NAMES: [&str; COUNT as usize] = ["hit", "miss", "stale"];
}
