//! Load balancer map ABI: services (VIP, port, protocol) → a selection table of backend
//! indexes, swapped atomically by the daemon; backends in one array; the NAT binding each
//! load-balanced connection keeps in its conntrack entry.
//!
//! How an update is atomic: the daemon writes a service's new selection table into a free
//! region of `FP_LB_SLOTS` and the backends it names into free `FP_BACKENDS` slots first, then
//! switches the service with one write of its `Service` value (a hash map update replaces the
//! value in one step); the old region is reused only after a grace period. A packet therefore
//! sees either the old service or the new one, never a half-written one.

/// `FP_SVC` key: what a client connects to. 8-aligned for word stores.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(C, align(8))]
pub struct SvcKey {
    /// VIP as on the wire; IPv4 in the first 4 bytes, the rest zero.
    pub vip: [u8; 16],
    /// Port, host byte order.
    pub port: u16,
    /// 6 (TCP) or 17 (UDP).
    pub proto: u8,
    /// 4 or 6.
    pub family: u8,
    pub _pad: [u8; 4],
}
const _: () = assert!(core::mem::size_of::<SvcKey>() == 24);

/// `FP_SVC` value: one service as the datapath sees it. 8-aligned (word copies of
/// `snat_addr`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C, align(8))]
pub struct Service {
    /// Index for per-service counters (`FP_SVC_STATS`), stable for the service's life.
    pub id: u32,
    /// `SVC_F_*`.
    pub flags: u32,
    /// The selection table: `slots_len` backend indexes at `FP_LB_SLOTS[slots_off..]`. A flow
    /// takes slot `hash(5-tuple) % slots_len` (Maglev: the Maglev table; round-robin: the
    /// weighted sequence). 0 slots: no backend is available.
    pub slots_off: u32,
    pub slots_len: u32,
    /// Bumped by every update of this service (visible in events and stats).
    pub generation: u32,
    /// The service's backends: `backends_len` entries at `FP_BACKENDS[backends_off..]` (the
    /// selection table holds indexes into that range).
    pub backends_off: u32,
    pub backends_len: u32,
    /// Hash of the service's definition (backends, weights, table size, flags) when it was
    /// applied: an update skips services whose definition did not change.
    pub fingerprint: u32,
    /// Source-IP affinity: a client's new connections go to the backend its last one got, for
    /// this many seconds after that one (0: off).
    pub affinity_s: u32,
    /// Full-NAT (`SVC_F_FULL_NAT`): the source ports new connections may get, inclusive.
    pub snat_port_lo: u16,
    pub snat_port_hi: u16,
    /// Full-NAT: the source address the backends see (as on the wire; IPv4 in the first 4
    /// bytes). Zero otherwise.
    pub snat_addr: [u8; 16],
}
const _: () = assert!(core::mem::size_of::<Service>() == 56);

/// Selection by Maglev consistent hashing of the flow's 5-tuple.
pub const SVC_F_MAGLEV: u32 = 1 << 0;
/// Selection by weighted round robin: the table is the weighted sequence, walked by a per-CPU
/// counter per service.
pub const SVC_F_WRR: u32 = 1 << 1;
/// Selection by (weighted) least connections: among the service's enabled backends, the one
/// with the fewest active connections per unit of weight (ties: the first).
pub const SVC_F_LEASTCONN: u32 = 1 << 2;
/// Backends a least-connections service may have (the datapath looks at each of them).
pub const LEASTCONN_MAX_BACKENDS: u32 = 64;

/// Connection counts per backend (`FP_BACKEND_LOAD`), added to atomically by the datapath:
/// connections given the backend, and those closed (TIME_WAIT/CLOSE, killed, dropped early).
/// Connections that expire without closing are counted by the daemon in `FP_BACKEND_GONE`;
/// active = opened − closed − gone.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct BackendLoad {
    pub opened: u64,
    pub closed: u64,
}

/// Longest weighted round-robin sequence (weights are scaled down to fit).
pub const WRR_MAX_SLOTS: u32 = 65_536;
/// With no backend available: drop the packet (counted) instead of handing it to the kernel.
pub const SVC_F_NO_BACKEND_DROP: u32 = 1 << 8;
/// With no backend available: answer the client — a TCP RST, or an ICMP/ICMPv6 port
/// unreachable for UDP — sent back out of the interface it came in on (XDP_TX).
pub const SVC_F_NO_BACKEND_REJECT: u32 = 1 << 12;
/// Full-NAT: besides the destination (→ backend), the source is translated to `snat_addr`
/// and a port from `snat_port_lo..=snat_port_hi`, so replies come back to this node whatever
/// the backends' routing. The port is allocated by inserting the connection's alias
/// (snat ↔ backend) into the conntrack table: a taken tuple is a collision, and the next
/// candidate port is tried (`SNAT_TRIES`).
pub const SVC_F_FULL_NAT: u32 = 1 << 9;
/// Ports a full-NAT or masquerade allocation tries before giving up (`snat_exhausted`).
pub const SNAT_TRIES: u32 = 16;
/// A gateway-SNAT connection, balanced by no service: the datapath builds such a `Service`
/// for itself (id `GATEWAY_ID`, full-NAT to the out interface's rule) with the packet's own
/// destination as the backend (index `GATEWAY_ID`).
pub const SVC_F_GATEWAY: u32 = 1 << 10;
/// Direct server return at L2: new connections' packets keep their addresses and ports and
/// go to the backend's MAC address (the backend holds the VIP itself and replies to the
/// client directly). Backends listen on the service port.
pub const SVC_F_DSR: u32 = 1 << 11;
/// Service id and backend index of gateway-SNAT connections (no counters).
pub const GATEWAY_ID: u32 = u32::MAX;

/// `FP_SNAT` value: a gateway SNAT rule (masquerade), indexed by `IfaceConfig::snat`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C, align(8))]
pub struct SnatRule {
    /// The IPv4 source (first 4 bytes) for IPv4 connections; valid if `families & 1`.
    pub addr4: [u8; 16],
    /// The IPv6 source for IPv6 connections; valid if `families & 2`.
    pub addr6: [u8; 16],
    pub port_lo: u16,
    pub port_hi: u16,
    /// Bit 0: IPv4 is translated; bit 1: IPv6.
    pub families: u8,
    pub _pad: [u8; 3],
}
const _: () = assert!(core::mem::size_of::<SnatRule>() == 40);
/// Gateway SNAT rules (`FP_SNAT` entries).
pub const MAX_SNAT_RULES: u32 = 64;

/// `FP_BACKENDS` value, indexed by backend index.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C, align(8))]
pub struct Backend {
    /// Address as on the wire; IPv4 in the first 4 bytes.
    pub addr: [u8; 16],
    /// Port, host byte order.
    pub port: u16,
    /// 4 or 6: the service's family (no 4↔6 translation).
    pub family: u8,
    /// `BACKEND_F_*`.
    pub flags: u8,
    /// The configured weight (least-connections weighs the load by it).
    pub weight: u16,
    pub _pad: [u8; 2],
}

/// The backend takes new connections (weight > 0 and not down): what source-IP affinity
/// checks before sending a client back to it.
pub const BACKEND_F_ENABLED: u8 = 1 << 0;

/// `FP_AFFINITY` key: a client of a service.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C, align(8))]
pub struct AffinityKey {
    pub client: [u8; 16],
    pub service: u32,
    pub family: u8,
    pub _pad: [u8; 3],
}
const _: () = assert!(core::mem::size_of::<AffinityKey>() == 24);
const _: () = assert!(core::mem::offset_of!(AffinityKey, family) == 20);

/// `FP_AFFINITY` value: the backend the client's last new connection got, and when.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct Affinity {
    pub backend: u32,
    pub _pad: u32,
    pub last_ns: u64,
}
const _: () = assert!(core::mem::size_of::<Backend>() == 24);

/// The NAT binding of a load-balanced connection, kept in its conntrack entries (the room
/// `CtEntry` reserved for it). The connection has two entries: the original one under the
/// client ↔ VIP key (`CT_F_LB`), whose binding says where client packets go (`addr:port` =
/// the backend), and an alias under the key of the backend's side (`CT_F_LB_ALIAS`), whose
/// binding says what the backend's replies must look like (`addr:port` = the VIP) and leads
/// back to the original entry, which holds the connection's state.
///
/// NAT mode: the alias key is client ↔ backend, and the alias's `addr2:port2` is the backend.
/// Full-NAT (`CT_F_FULL_NAT` on both): the entry's `addr2:port2` is the source address and
/// port the connection was given; the alias key is that ↔ backend, and the alias's
/// `addr2:port2` is the client (where replies go).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct CtNat {
    pub addr: [u8; 16],
    /// See above: the backend (NAT alias), the allocated source (full-NAT entry), the client
    /// (full-NAT alias); zero on a NAT entry.
    pub addr2: [u8; 16],
    pub port: u16,
    pub port2: u16,
    /// Backend index (`FP_BACKENDS`) and service id the connection was given.
    pub backend: u32,
    pub service: u32,
    pub _pad: u32,
}
const _: () = assert!(core::mem::size_of::<CtNat>() == 48);

/// Per-service counters (`FP_SVC_STATS`, per-CPU, indexed by service id).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct SvcCounters {
    pub packets: u64,
    pub bytes: u64,
    /// Connections given a backend.
    pub connections: u64,
    /// New connections that found no backend.
    pub no_backend: u64,
}

/// Per-backend counters (`FP_BACKEND_STATS`, per-CPU, indexed by backend index).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct BackendCounters {
    pub packets: u64,
    pub bytes: u64,
    /// Connections given this backend.
    pub connections: u64,
    pub _reserved: u64,
}

/// Capacities (entries) of the LB maps.
/// Services: 2^18, so 131072 fit with updates written beside them (the benchmark sweeps up to
/// 100k).
pub const MAX_SERVICES: u32 = 1 << 18;
pub const MAX_BACKENDS: u32 = 1 << 18;
/// Clients remembered for source-IP affinity (an LRU: the least recently seen go first).
pub const AFFINITY_ENTRIES: u32 = 1 << 18;
/// Selection slots for all services together (8 Mi u32, 32 MiB): e.g. 10k services of 251
/// slots with room to double-buffer, or 30 services of 131071.
pub const LB_SLOTS: u32 = 1 << 23;

#[cfg(feature = "user")]
mod pod {
    // SAFETY: #[repr(C)], fixed-width fields, explicit padding (sizes asserted above).
    unsafe impl aya::Pod for super::SvcKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::Service {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::Backend {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::SvcCounters {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::AffinityKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::BackendLoad {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::Affinity {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::BackendCounters {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::SnatRule {}
}

/// The key of the other entry of a load-balanced connection: from the connection's entry
/// (`CT_F_LB`) its alias (client ↔ backend), from an alias (`CT_F_LB_ALIAS`) the connection's
/// entry (client ↔ VIP). `None` for other entries.
pub fn lb_peer_key(key: &crate::ct::CtKey, e: &crate::ct::CtEntry) -> Option<crate::ct::CtKey> {
    let mut other = crate::ct::CtKey::default();
    lb_peer_key_into(key, e, &mut other).then_some(other)
}

/// Of a NAT-mode alias (client ↔ backend), whether the backend is the key's `lo` side: the
/// alias entry holds the backend's address and port (`nat.addr2`, `nat.port2`).
#[inline(always)]
pub fn nat_alias_backend_is_lo(key: &crate::ct::CtKey, e: &crate::ct::CtEntry) -> bool {
    key.addr_lo == e.nat.addr2 && key.port_lo == e.nat.port2
}

/// [`lb_peer_key`] written into `out` (the datapath keeps keys out of its small stack);
/// false, `out` untouched, for other entries.
#[inline(always)]
pub fn lb_peer_key_into(
    key: &crate::ct::CtKey,
    e: &crate::ct::CtEntry,
    out: &mut crate::ct::CtKey,
) -> bool {
    use crate::ct::{CT_F_DSR, CT_F_FULL_NAT, CT_F_LB, CT_F_LB_ALIAS, CT_F_ORIG_IS_LO};
    if e.flags & CT_F_DSR != 0 {
        return false;
    }
    let full = e.flags & CT_F_FULL_NAT != 0;
    // Which of the key's sides stays (the other side comes from the binding), or none when
    // both come from it (full-NAT).
    let keep_lo = if e.flags & CT_F_LB != 0 {
        // Full-NAT: the alias is the allocated source ↔ the backend; NAT: the client (the
        // originator) ↔ the backend.
        (!full).then_some(e.flags & CT_F_ORIG_IS_LO != 0)
    } else if e.flags & CT_F_LB_ALIAS != 0 {
        // Full-NAT: the client ↔ the VIP; NAT: the client is the side that is not the backend.
        (!full).then_some(!nat_alias_backend_is_lo(key, e))
    } else {
        return false;
    };
    match keep_lo {
        Some(true) => {
            crate::copy16(&mut out.addr_lo, &key.addr_lo);
            out.port_lo = key.port_lo;
        }
        Some(false) => {
            crate::copy16(&mut out.addr_lo, &key.addr_hi);
            out.port_lo = key.port_hi;
        }
        None => {
            crate::copy16(&mut out.addr_lo, &e.nat.addr2);
            out.port_lo = e.nat.port2;
        }
    }
    crate::copy16(&mut out.addr_hi, &e.nat.addr);
    out.port_hi = e.nat.port;
    out.family = key.family;
    out.proto = key.proto;
    out._pad = [0; 2];
    out.normalize();
    true
}

/// The alias of a load-balanced connection (`CT_F_LB`, not DSR) as the datapath makes it
/// beside the connection's entry: key and entry, everything in it derived from the
/// connection's (the alias carries no state of its own: the datapath never updates it). HA
/// peers build it from the replicated connection instead of receiving it. `None` for other
/// entries.
pub fn lb_alias(
    key: &crate::ct::CtKey,
    e: &crate::ct::CtEntry,
) -> Option<(crate::ct::CtKey, crate::ct::CtEntry)> {
    use crate::ct::{CT_F_FULL_NAT, CT_F_LB, CT_F_LB_ALIAS, CT_F_ORIG_IS_LO, CT_F_SNAT, CtEntry};
    if e.flags & CT_F_LB == 0 {
        return None;
    }
    let alias_key = lb_peer_key(key, e)?;
    // The connection's key is client ↔ VIP (or, gateway SNAT, client ↔ destination).
    let (client, vip) = if e.flags & CT_F_ORIG_IS_LO != 0 {
        ((&key.addr_lo, key.port_lo), (&key.addr_hi, key.port_hi))
    } else {
        ((&key.addr_hi, key.port_hi), (&key.addr_lo, key.port_lo))
    };
    let full = e.flags & CT_F_FULL_NAT != 0;
    let mut alias = CtEntry {
        created_ns: e.created_ns,
        last_seen_ns: e.created_ns,
        flags: CT_F_LB_ALIAS | (e.flags & (CT_F_SNAT | CT_F_FULL_NAT)),
        origin: e.origin,
        ..CtEntry::default()
    };
    alias.nat.addr = *vip.0;
    alias.nat.port = vip.1;
    alias.nat.service = e.nat.service;
    alias.nat.backend = e.nat.backend;
    // Where the backend's replies go: full-NAT, the client; NAT, the alias's backend side
    // (which tells the client's side apart).
    (alias.nat.addr2, alias.nat.port2) = if full {
        (*client.0, client.1)
    } else {
        (e.nat.addr, e.nat.port)
    };
    Some((alias_key, alias))
}

/// The hash that picks a connection's slot in its service's selection table: the same on
/// every node for the same connection (the key is direction-independent and laid out the
/// same everywhere), so Maglev sends it to the same backend on a peer that takes over, and the
/// daemon can tell which backend a connection gets. murmur3's 32-bit mixing over the key's ten
/// words; no loops over data, no calls (the datapath inlines it).
#[inline(always)]
pub fn flow_hash(key: &crate::ct::CtKey) -> u32 {
    let words = (key as *const crate::ct::CtKey).cast::<u32>();
    let mut h: u32 = 0x6c62_6631;
    let mut i = 0;
    while i < 10 {
        // SAFETY: CtKey is 40 bytes and 8-aligned: ten u32 words. Volatile keeps the datapath's
        // compiler from turning the reads into a memcpy call.
        let mut k = unsafe { core::ptr::read_volatile(words.add(i)) };
        k = k
            .wrapping_mul(0xcc9e_2d51)
            .rotate_left(15)
            .wrapping_mul(0x1b87_3593);
        h = (h ^ k)
            .rotate_left(13)
            .wrapping_mul(5)
            .wrapping_add(0xe654_6b64);
        i += 1;
    }
    h ^= 40;
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^ (h >> 16)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ct::{CT_F_FULL_NAT, CT_F_LB, CT_F_LB_ALIAS, CT_F_ORIG_IS_LO, CtEntry, ct_key};

    fn a4(a: [u8; 4]) -> [u8; 16] {
        let mut out = [0; 16];
        out[..4].copy_from_slice(&a);
        out
    }

    const TCP: u8 = 6;

    /// Both entries of a connection lead to each other, in NAT and in full-NAT mode.
    #[test]
    fn each_entry_of_a_balanced_connection_names_the_other() {
        let (client, vip, backend, snat) = (
            a4([10, 0, 0, 1]),
            a4([10, 0, 0, 100]),
            a4([10, 0, 1, 1]),
            a4([10, 0, 2, 1]),
        );
        let (conn, client_is_lo) = ct_key(4, TCP, &client, 40000, &vip, 80);
        for full in [false, true] {
            let mut e = CtEntry {
                flags: CT_F_LB | if client_is_lo { CT_F_ORIG_IS_LO } else { 0 },
                ..CtEntry::default()
            };
            e.nat.addr = backend;
            e.nat.port = 8080;
            let mut alias = CtEntry {
                flags: CT_F_LB_ALIAS,
                ..CtEntry::default()
            };
            alias.nat.addr = vip;
            alias.nat.port = 80;
            let alias_key = if full {
                e.flags |= CT_F_FULL_NAT;
                e.nat.addr2 = snat;
                e.nat.port2 = 20001;
                alias.flags |= CT_F_FULL_NAT;
                alias.nat.addr2 = client;
                alias.nat.port2 = 40000;
                ct_key(4, TCP, &snat, 20001, &backend, 8080).0
            } else {
                alias.nat.addr2 = backend;
                alias.nat.port2 = 8080;
                ct_key(4, TCP, &client, 40000, &backend, 8080).0
            };
            assert_eq!(lb_peer_key(&conn, &e), Some(alias_key), "full-NAT {full}");
            // The alias built from the connection is the one the datapath makes.
            e.nat.service = 7;
            e.nat.backend = 2;
            e.created_ns = 1000;
            e.last_seen_ns = 5000;
            alias.nat.service = 7;
            alias.nat.backend = 2;
            alias.created_ns = 1000;
            alias.last_seen_ns = 1000;
            assert_eq!(
                lb_alias(&conn, &e),
                Some((alias_key, alias)),
                "full-NAT {full}"
            );
            assert_eq!(
                lb_peer_key(&alias_key, &alias),
                Some(conn),
                "full-NAT {full}"
            );
        }
        assert_eq!(lb_peer_key(&conn, &CtEntry::default()), None);
        assert_eq!(lb_alias(&conn, &CtEntry::default()), None);
    }
}
