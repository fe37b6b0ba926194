//! Connection tracking ABI and logic shared by the datapath and the daemon: the normalized
//! key, the entry layout, and the TCP state machine as a pure function (so the very code the
//! datapath runs is unit-tested on the host).
//!
//! The TCP state machine is modelled on Linux `nf_conntrack_proto_tcp.c` (`tcp_conntracks`):
//! the same states, the same packet classes, the same transition table, including
//! simultaneous open (SYN_SENT2), retransmitted SYNs and RST handling. Sequence-window
//! tracking (`tcp_in_window`) is not modelled.

/// Direction of a packet relative to the connection's originator.
pub const DIR_ORIGINAL: usize = 0;
pub const DIR_REPLY: usize = 1;

/// TCP conntrack states (values are an ABI: stored in pinned entries and events).
pub mod tcp_state {
    pub const NONE: u8 = 0;
    pub const SYN_SENT: u8 = 1;
    pub const SYN_RECV: u8 = 2;
    pub const ESTABLISHED: u8 = 3;
    pub const FIN_WAIT: u8 = 4;
    pub const CLOSE_WAIT: u8 = 5;
    pub const LAST_ACK: u8 = 6;
    pub const TIME_WAIT: u8 = 7;
    pub const CLOSE: u8 = 8;
    /// Simultaneous open: a SYN seen in both directions.
    pub const SYN_SENT2: u8 = 9;
    pub const COUNT: u8 = 10;

    /// Names as `conntrack -L` prints them.
    pub const NAMES: [&str; COUNT as usize] = [
        "NONE",
        "SYN_SENT",
        "SYN_RECV",
        "ESTABLISHED",
        "FIN_WAIT",
        "CLOSE_WAIT",
        "LAST_ACK",
        "TIME_WAIT",
        "CLOSE",
        "SYN_SENT2",
    ];
}

/// TCP packet classes, as in `get_conntrack_index`.
pub mod tcp_class {
    pub const SYN: usize = 0;
    pub const SYNACK: usize = 1;
    pub const FIN: usize = 2;
    pub const ACK: usize = 3;
    pub const RST: usize = 4;
    pub const NONE: usize = 5;
}

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

/// The class of a TCP packet from its flags: RST wins, then SYN (with or without ACK), FIN,
/// ACK; anything else (no flags, only PSH/URG) is `NONE`.
#[inline(always)]
pub const fn tcp_classify(flags: u8) -> usize {
    if flags & TCP_RST != 0 {
        tcp_class::RST
    } else if flags & TCP_SYN != 0 {
        if flags & TCP_ACK != 0 {
            tcp_class::SYNACK
        } else {
            tcp_class::SYN
        }
    } else if flags & TCP_FIN != 0 {
        tcp_class::FIN
    } else if flags & TCP_ACK != 0 {
        tcp_class::ACK
    } else {
        tcp_class::NONE
    }
}

/// TCP flags Linux's conntrack ignores when it judges a combination: ECE, CWR, PSH.
const TCP_FLAGS_IGNORED: u8 = 0x40 | 0x80 | 0x08;
/// The combinations of FIN, SYN, RST, ACK and URG (0x01, 0x02, 0x04, 0x10, 0x20) that Linux's
/// `tcp_valid_flags` accepts, one bit per value: SYN, SYN|URG, SYN|ACK, RST, RST|ACK, FIN|ACK,
/// FIN|ACK|URG, ACK, ACK|URG.
const TCP_VALID_FLAGS: u64 = (1 << 0x02)
    | (1 << 0x22)
    | (1 << 0x12)
    | (1 << 0x04)
    | (1 << 0x14)
    | (1 << 0x11)
    | (1 << 0x31)
    | (1 << 0x10)
    | (1 << 0x30);

/// Whether a TCP segment's flags byte is a combination Linux's conntrack accepts (`tcp_error`:
/// SYN+FIN, SYN+RST, FIN without ACK, no flags, all flags, ... are INVALID there). A mask
/// test, no table: the flags left after masking are below 64.
#[inline(always)]
pub const fn tcp_flags_valid(flags: u8) -> bool {
    (TCP_VALID_FLAGS >> (flags & !TCP_FLAGS_IGNORED)) & 1 != 0
}

/// Whether `src` cannot be the source of a connection arriving from a network: loopback
/// (127/8, ::1), unspecified (0/8, ::), the limited broadcast, multicast (224/4, ff00::/8), or
/// `dst` itself (a LAND frame). Linux's input route drops such packets as martians
/// (`ip_route_input_slow`, `fib_validate_source`; `ip6_rcv_core`). Packets to a broadcast or
/// multicast destination are not judged: Linux takes some from the unspecified source (a DHCP
/// discover is 0.0.0.0 → 255.255.255.255, IGMP and MLD reports), and no service has such an
/// address. Addresses as in a [`CtKey`] (IPv4 in the first 4 bytes, the rest zero).
#[inline(always)]
pub fn martian_source(family: u8, src: &[u8; 16], dst: &[u8; 16]) -> bool {
    // perf/verifier: whole-address integers (two 64-bit words each), no byte loops or memcmp.
    let (s, d) = (u128::from_be_bytes(*src), u128::from_be_bytes(*dst));
    if family == 4 {
        let (a, b) = ((s >> 96) as u32, (d >> 96) as u32);
        if b == u32::MAX || b >> 28 == 0xe {
            return false;
        }
        let first = a >> 24;
        a == b || first == 127 || first == 0 || a >> 28 == 0xe || a == u32::MAX
    } else {
        if d >> 120 == 0xff {
            return false;
        }
        // Multicast, `::` or `::1`, or the destination.
        s == d || s >> 120 == 0xff || s <= 1
    }
}

/// What a TCP packet does to its connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcpStep {
    /// Move to this state (possibly the same one).
    To(u8),
    /// Accepted without changing state (a retransmission, a late SYN/ACK): Linux's sIG.
    Ignore,
    /// Does not fit the state: Linux's sIV. Counted; the stateful firewall drops it.
    Invalid,
}

// Table cells: a state, or IG / IV.
const IG: u8 = 0xfe;
const IV: u8 = 0xff;
use tcp_state::{
    CLOSE as CL, CLOSE_WAIT as CW, ESTABLISHED as ES, FIN_WAIT as FW, LAST_ACK as LA,
    SYN_RECV as SR, SYN_SENT as SS, SYN_SENT2 as S2, TIME_WAIT as TW,
};

/// `TCP_TRANSITIONS[dir][class][state]`, transcribed from Linux's `tcp_conntracks`.
/// Columns: NONE, SYN_SENT, SYN_RECV, ESTABLISHED, FIN_WAIT, CLOSE_WAIT, LAST_ACK, TIME_WAIT,
/// CLOSE, SYN_SENT2.
const TCP_TRANSITIONS: [[[u8; tcp_state::COUNT as usize]; 6]; 2] = [
    // ORIGINAL
    [
        /* syn    */ [SS, SS, IG, IG, IG, IG, IG, SS, SS, S2],
        /* synack */ [IV, IV, SR, IV, IV, IV, IV, IV, IV, SR],
        /* fin    */ [IV, IV, FW, FW, LA, LA, LA, TW, CL, IV],
        /* ack    */ [ES, IV, ES, ES, CW, CW, TW, TW, CL, IV],
        /* rst    */ [IV, CL, CL, CL, CL, CL, CL, CL, CL, CL],
        /* none   */ [IV, IV, IV, IV, IV, IV, IV, IV, IV, IV],
    ],
    // REPLY
    [
        /* syn    */ [IV, S2, IV, IV, IV, IV, IV, SS, IV, S2],
        /* synack */ [IV, SR, IG, IG, IG, IG, IG, IG, IG, SR],
        /* fin    */ [IV, IV, FW, FW, LA, LA, LA, TW, CL, IV],
        /* ack    */ [IV, IG, SR, ES, CW, CW, TW, TW, CL, IG],
        /* rst    */ [IV, CL, CL, CL, CL, CL, CL, CL, CL, CL],
        /* none   */ [IV, IV, IV, IV, IV, IV, IV, IV, IV, IV],
    ],
];

/// The TCP state machine: what a packet of `flags` in direction `dir` does to a connection
/// in `state`. `state` NONE means "no entry yet" (only a SYN — or, like Linux's loose
/// pickup, an ACK in the original direction — starts one).
#[inline(always)]
pub fn tcp_step(state: u8, dir: usize, flags: u8) -> TcpStep {
    let class = tcp_classify(flags);
    let row = match TCP_TRANSITIONS.get(dir & 1).and_then(|d| d.get(class)) {
        Some(r) => r,
        None => return TcpStep::Invalid,
    };
    match row.get(state as usize) {
        Some(&IG) => TcpStep::Ignore,
        Some(&IV) | None => TcpStep::Invalid,
        Some(&s) => TcpStep::To(s),
    }
}

/// Default timeouts in seconds, per TCP state (index = state), as Linux's
/// `nf_conntrack_tcp_timeout_*` defaults.
pub const TCP_TIMEOUTS_S: [u32; tcp_state::COUNT as usize] = [
    0,       // NONE
    120,     // SYN_SENT
    60,      // SYN_RECV
    432_000, // ESTABLISHED (5 days)
    120,     // FIN_WAIT
    60,      // CLOSE_WAIT
    30,      // LAST_ACK
    120,     // TIME_WAIT
    10,      // CLOSE
    120,     // SYN_SENT2
];
/// Slots of `DatapathConfig::ct_timeouts_s`: TCP states by their value (1..=9, slot 0
/// unused), then UDP unreplied, UDP assured, ICMP, and the cap for a TCP connection picked up
/// mid-stream that has not seen a reply yet (Linux's `nf_conntrack_tcp_timeout_unacknowledged`).
pub mod timeout_slot {
    pub const UDP: usize = 10;
    pub const UDP_STREAM: usize = 11;
    pub const ICMP: usize = 12;
    pub const TCP_UNACKNOWLEDGED: usize = 13;
    pub const COUNT: usize = 14;
}

/// The Linux defaults in `DatapathConfig::ct_timeouts_s` layout.
pub const DEFAULT_TIMEOUTS_S: [u32; timeout_slot::COUNT] = [
    0,
    TCP_TIMEOUTS_S[1],
    TCP_TIMEOUTS_S[2],
    TCP_TIMEOUTS_S[3],
    TCP_TIMEOUTS_S[4],
    TCP_TIMEOUTS_S[5],
    TCP_TIMEOUTS_S[6],
    TCP_TIMEOUTS_S[7],
    TCP_TIMEOUTS_S[8],
    TCP_TIMEOUTS_S[9],
    UDP_UNREPLIED_TIMEOUT_S,
    UDP_ASSURED_TIMEOUT_S,
    ICMP_TIMEOUT_S,
    TCP_UNACKNOWLEDGED_TIMEOUT_S,
];

/// Idle timeout of an entry, from a `ct_timeouts_s` table. As in Linux, an ESTABLISHED
/// connection that has never seen a reply (picked up mid-stream) gets at most the
/// unacknowledged timeout, not five days.
pub fn timeout_of(timeouts: &[u32; timeout_slot::COUNT], key: &CtKey, e: &CtEntry) -> u32 {
    let slot = match key.proto {
        6 if e.state >= 1 && (e.state as usize) < timeout_slot::UDP => e.state as usize,
        6 => tcp_state::CLOSE as usize,
        17 if e.flags & CT_F_ASSURED != 0 => timeout_slot::UDP_STREAM,
        17 => timeout_slot::UDP,
        _ => timeout_slot::ICMP,
    };
    let t = timeouts[slot];
    if key.proto == 6 && e.state == tcp_state::ESTABLISHED && e.flags & CT_F_SEEN_REPLY == 0 {
        t.min(timeouts[timeout_slot::TCP_UNACKNOWLEDGED])
    } else {
        t
    }
}

/// UDP before a reply is seen (`nf_conntrack_udp_timeout`).
pub const UDP_UNREPLIED_TIMEOUT_S: u32 = 30;
/// UDP once replied / assured (`nf_conntrack_udp_timeout_stream`).
pub const UDP_ASSURED_TIMEOUT_S: u32 = 120;
/// ICMP echo (`nf_conntrack_icmp_timeout`).
pub const ICMP_TIMEOUT_S: u32 = 30;
/// Cap for TCP picked up mid-stream before any reply (`nf_conntrack_tcp_timeout_unacknowledged`).
pub const TCP_UNACKNOWLEDGED_TIMEOUT_S: u32 = 300;
/// A replied UDP flow becomes assured (a "stream", with the longer timeout) on a packet more
/// than this long after its first one, as in Linux since 5.16.
pub const UDP_STREAM_AFTER_NS: u64 = 2_000_000_000;

/// The datapath moves an entry's `last_seen_ns` only once the clock is this far past it
/// (2^28 ns, 268 ms), as Cilium refreshes its entries' lifetime: most packets of a busy
/// connection leave the stamp as it is. Expiry allows for it (an entry is idle at most this
/// much longer than its stamp says), so no connection expires early.
pub const LAST_SEEN_STEP_NS: u64 = 1 << 28;

/// Slots per CPU of the flow cache (`FP_FLOW`, a power of two): each holds one connection's
/// entry for at most a lease of [`LAST_SEEN_STEP_NS`].
pub const FLOW_SLOTS: u32 = 1 << 13;

/// One slot of the XDP flow cache (`FP_FLOW`, per CPU): a copy of the entry of `key`, which
/// serves that connection's steady packets (an ACK of an established TCP connection, a
/// datagram of an assured UDP one) on this CPU without a hash lookup while
/// - `epoch` equals `FP_FLOW_EPOCH[flow_slot(key)]`, which every removal or replacement of an
///   entry and every move of a connection out of its steady state bumps (datapath and daemon
///   alike), and
/// - the lease, [`LAST_SEEN_STEP_NS`] from `filled_ns`, has not ended.
///
/// The key and the lease come first: a probe that is not this slot's connection reads only
/// the slot's tag (`FP_FLOW_TAG`), one that is reads the first cache line or two.
///
/// The copy's counters are the packets it served (zero at fill); they are added to the
/// table's entry when the slot is next filled or taken (`created_ns` tells the connection
/// from a later one on the same tuple), and readers of the table add them meanwhile
/// ([`FlowSlot::deltas_for`]).
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct FlowSlot {
    pub key: CtKey,
    /// The coarse clock's time the lease began (0: empty).
    pub filled_ns: u64,
    pub epoch: u64,
    pub entry: CtEntry,
}
const _: () = assert!(core::mem::size_of::<FlowSlot>() == 208);

/// The flow-cache hash of `key`, the same in the datapath and the daemon: a multiplicative
/// hash of its five words (cheaper in BPF than the table's jhash; a collision only costs the
/// table lookup). Its high half picks the slot ([`flow_slot`]), its low half is the slot's tag
/// ([`flow_tag`]).
#[inline(always)]
pub fn flow_hash(key: &CtKey) -> u64 {
    flow_hash_words(key.words())
}

/// [`flow_hash`] of a key given as its five words ([`CtKey::words`]).
#[inline(always)]
pub fn flow_hash_words([a, b, c, d, e]: [u64; 5]) -> u64 {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut h = a.wrapping_mul(K);
    h = (h ^ (h >> 32) ^ b).wrapping_mul(K);
    h = (h ^ (h >> 32) ^ c).wrapping_mul(K);
    h = (h ^ (h >> 32) ^ d).wrapping_mul(K);
    (h ^ (h >> 32) ^ e).wrapping_mul(K)
}

/// The flow-cache slot of `key` (see [`flow_hash`]).
#[inline(always)]
pub fn flow_slot(key: &CtKey) -> u32 {
    slot_of(flow_hash(key))
}

/// The slot of hash `h`.
#[inline(always)]
pub const fn slot_of(h: u64) -> u32 {
    ((h >> 32) as u32) & (FLOW_SLOTS - 1)
}

/// The tag of hash `h` in its slot's entry of `FP_FLOW_TAG` (never 0, which marks an empty
/// slot).
#[inline(always)]
pub const fn flow_tag(h: u64) -> u32 {
    h as u32 | 1
}

impl FlowSlot {
    /// What this slot (one CPU's) has counted for the connection `e` of `key` that the
    /// table does not have yet: packets and bytes per direction, and its last-seen stamp.
    /// Whatever its epoch: a copy made stale by a change of its connection still holds that
    /// connection's packets until they are folded in.
    pub fn deltas_for(&self, key: &CtKey, e: &CtEntry) -> Option<([u64; 2], [u64; 2], u64)> {
        (self.filled_ns != 0 && self.key == *key && self.entry.created_ns == e.created_ns)
            .then_some((
                self.entry.packets,
                self.entry.bytes,
                self.entry.last_seen_ns,
            ))
    }
}

/// How much older than a connection's last packet its entry's `last_seen_ns` in the table may
/// be: one step of the stamp, plus one lease of the flow cache (`FlowSlot`), whose packets
/// reach the table's stamp when the lease ends. Expiry waits this much past the timeout.
pub const LAST_SEEN_SLACK_NS: u64 = 2 * LAST_SEEN_STEP_NS;

/// Whether a packet at `now` moves a `last_seen_ns` stamp (see [`LAST_SEEN_STEP_NS`]); a
/// stamp ahead of `now` (an entry installed from a peer's precise clock) stays.
#[inline(always)]
pub const fn last_seen_moves(last_seen_ns: u64, now: u64) -> bool {
    now.saturating_sub(last_seen_ns) >= LAST_SEEN_STEP_NS
}

/// A connection key that is the same for both directions: the (address, port) pairs are
/// ordered, lower first. Addresses as on the wire; IPv4 uses the first 4 bytes. For ICMP echo
/// both ports hold the echo identifier. 8-aligned so the datapath can fill it with word
/// stores.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(C, align(8))]
pub struct CtKey {
    pub addr_lo: [u8; 16],
    pub addr_hi: [u8; 16],
    /// Ports in host byte order.
    pub port_lo: u16,
    pub port_hi: u16,
    /// IP protocol (6, 17, 1, 58).
    pub proto: u8,
    /// 4 or 6.
    pub family: u8,
    pub _pad: [u8; 2],
}
const _: () = assert!(core::mem::size_of::<CtKey>() == 40);
const _: () = assert!(core::mem::align_of::<CtKey>() == 8);
const _: () = assert!(core::mem::offset_of!(CtKey, port_lo) == 32);

/// `CtKey` for a packet from (src, sport) to (dst, dport), and whether the packet's source is
/// the key's `lo` side.
#[inline(always)]
pub fn ct_key(
    family: u8,
    proto: u8,
    src: &[u8; 16],
    sport: u16,
    dst: &[u8; 16],
    dport: u16,
) -> (CtKey, bool) {
    let mut key = CtKey {
        addr_lo: *src,
        addr_hi: *dst,
        port_lo: sport,
        port_hi: dport,
        proto,
        family,
        _pad: [0; 2],
    };
    let src_is_lo = key.normalize();
    (key, src_is_lo)
}

impl CtKey {
    /// Orders a key filled as (source in `lo`, destination in `hi`) so that the lower
    /// (address, port) comes first; returns whether the source stayed `lo`. Works in place
    /// (the datapath builds keys in map memory: no stack copies).
    #[inline(always)]
    pub fn normalize(&mut self) -> bool {
        let src_is_lo = match self.cmp_addrs() {
            core::cmp::Ordering::Less => true,
            core::cmp::Ordering::Greater => false,
            core::cmp::Ordering::Equal => self.port_lo <= self.port_hi,
        };
        if !src_is_lo {
            core::mem::swap(&mut self.addr_lo, &mut self.addr_hi);
            core::mem::swap(&mut self.port_lo, &mut self.port_hi);
        }
        src_is_lo
    }

    /// The key as five native-endian words (it is 8-aligned and has no implicit padding).
    #[inline(always)]
    pub fn words(&self) -> [u64; 5] {
        let w = (self as *const CtKey).cast::<u64>();
        // SAFETY: CtKey is 40 bytes, 8-aligned, every byte a declared field (asserted below
        // its definition).
        unsafe {
            [
                w.read(),
                w.add(1).read(),
                w.add(2).read(),
                w.add(3).read(),
                w.add(4).read(),
            ]
        }
    }

    /// `addr_lo` against `addr_hi` in byte order. perf: as two big-endian words each (a
    /// byte loop walked the twelve equal bytes of every pair of IPv4-mapped addresses).
    #[inline(always)]
    fn cmp_addrs(&self) -> core::cmp::Ordering {
        let w = (self as *const CtKey).cast::<u64>();
        // SAFETY: CtKey is 8-aligned (asserted below its definition) and starts with the two
        // 16-byte addresses: words 0-1 are `addr_lo`, 2-3 `addr_hi`.
        let [a0, a1, b0, b1] =
            unsafe { [w.read(), w.add(1).read(), w.add(2).read(), w.add(3).read()] };
        (u64::from_be(a0), u64::from_be(a1)).cmp(&(u64::from_be(b0), u64::from_be(b1)))
    }
}

/// Entry flags.
pub const CT_F_ORIG_IS_LO: u8 = 1 << 0;
/// A packet was seen in the reply direction.
pub const CT_F_SEEN_REPLY: u8 = 1 << 1;
/// Assured (Linux's IPS_ASSURED): TCP established after a reply, UDP replied and still active
/// after 2 s; never ICMP. When the table is full, unassured entries are dropped to make room
/// (early drop), assured ones never are. On an alias (`CT_F_LB_ALIAS`): its connection is
/// assured and (TCP) established, so the backend's plain packets change nothing in it and are
/// counted in the alias alone, on one lookup (see [`with_alias`]).
pub const CT_F_ASSURED: u8 = 1 << 2;
/// A load-balanced connection's entry (client ↔ VIP): client packets are translated to the
/// backend in `nat`.
pub const CT_F_LB: u8 = 1 << 3;
/// The alias entry of a load-balanced connection (client ↔ backend): the backend's replies are
/// translated back to the VIP in `nat`; the state lives in the `CT_F_LB` entry.
pub const CT_F_LB_ALIAS: u8 = 1 << 4;
/// On both entries of a full-NAT connection (see `lb::CtNat`): the source is translated too.
pub const CT_F_FULL_NAT: u8 = 1 << 5;
/// On both entries of a gateway-SNAT connection (with `CT_F_LB`/`CT_F_LB_ALIAS` and
/// `CT_F_FULL_NAT`): the "backend" is the destination itself, only the source changes; no
/// service or backend counters.
pub const CT_F_SNAT: u8 = 1 << 6;
/// A direct-server-return connection's entry (with `CT_F_LB`): client packets are sent to the
/// backend unchanged but for the MAC addresses; no alias (replies need no translation).
pub const CT_F_DSR: u8 = 1 << 7;

/// A tracked connection. Append-only layout; `nat` holds the NAT binding and
/// chosen backend that later stages share through the entry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct CtEntry {
    /// bpf_ktime_get_ns() at creation and at the last packet.
    pub created_ns: u64,
    pub last_seen_ns: u64,
    /// Packets and bytes per direction, indexed by `DIR_*`.
    pub packets: [u64; 2],
    pub bytes: [u64; 2],
    /// `tcp_state::*` for TCP; 0 otherwise.
    pub state: u8,
    /// `CT_F_*`.
    pub flags: u8,
    /// Padding as naturally aligned words: the datapath builds entries on the BPF stack, where
    /// the verifier refuses a store that is not aligned to its size.
    pub _pad: u16,
    /// 0 when this node's datapath made the entry; otherwise the HA node id of the peer it
    /// was replicated from (the datapath never writes it: an installed entry keeps it).
    pub origin: u32,
    /// The NAT binding of a load-balanced connection (`CT_F_LB`, `CT_F_LB_ALIAS`); zero
    /// otherwise.
    pub nat: crate::lb::CtNat,
    /// Where the fast path routes the packets that find this entry, per direction (`DIR_*`;
    /// an alias's packets, the backend's, use `DIR_REPLY`): learned by the datapath on the
    /// direction's first routed packet after the connection's first, so an established
    /// packet is one lookup, a rewrite and a redirect. Local to the node that learned it:
    /// zero in entries the daemon writes (HA, restores).
    pub hops: [CtHop; 2],
}
// With the kernel's 48-byte hash element header, the 40-byte key and the allocator's 8-byte
// free-list link, an entry of up to 160 bytes takes a 256-byte allocation, a longer one a
// 512-byte one (measured as slab growth per entry of a no-prealloc hash: 256 B for 104-,
// 152- and 160-byte values, 512 B for 161-, 168- and 184-byte ones).
const _: () = assert!(core::mem::size_of::<CtEntry>() == 152);

/// The FIB's answer for one direction of a connection (`CtEntry::hops`), used while `until`
/// has not passed, the route generation (`FP_VXLAN_GEN`) is the one it was learned in, the
/// packet arrives on `in_ifindex`, and its IP length is at most `fits`: the route cache's
/// rules (`route::ROUTE_CACHE_TTL_NS`). Narrow fields keep the entry in the 256-byte
/// allocation: an interface the fast path routes from or to has an ifindex below
/// [`IFACE_SLOTS`] (2^16; an egress beyond it is not kept), and the generation's low 16 bits
/// tell generations apart within the hop's lifetime (`ttl`, a second: the daemon would have
/// to change routes 65,536 times in it to alias one).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct CtHop {
    /// The coarse clock's time it holds until, in units of 2^[`HOP_CLOCK_SHIFT`] ns (about a
    /// millisecond), wrapping; compared by [`hop_holds_at`].
    pub until: u32,
    /// The route generation's low 16 bits.
    pub generation: u16,
    /// The interface the direction's packets arrive on (0: nothing learned; no interface has
    /// ifindex 0).
    pub in_ifindex: u16,
    /// The egress interface.
    pub out_ifindex: u16,
    /// The longest IP packet known to fit the route.
    pub fits: u16,
    /// The next hop's MAC address, then the egress interface's: an Ethernet header's first
    /// 12 bytes.
    pub macs: [u8; 12],
}
const _: () = assert!(core::mem::size_of::<CtHop>() == 24);
const _: () = assert!(IFACE_SLOTS - 1 == u16::MAX as u32);

/// [`CtHop::until`]'s unit: 2^20 ns (1.05 ms).
pub const HOP_CLOCK_SHIFT: u32 = 20;

/// The clock `now_ns` (ns) in [`CtHop::until`]'s unit, wrapping.
#[inline(always)]
pub const fn hop_clock(now_ns: u64) -> u32 {
    (now_ns >> HOP_CLOCK_SHIFT) as u32
}

/// Whether a hop kept until `until` (for at most `ttl` units after it was learned) still
/// holds at `now` (both [`hop_clock`] values). Wrapping: the clock wraps every 2^52 ns (52
/// days); a hop is never kept longer than `ttl`, so one that is still valid is at most `ttl`
/// ahead of `now`, and one that ran out is taken for valid again only if it sat unrefreshed
/// for a whole multiple of 52 days to within `ttl`, longer than any conntrack timeout keeps
/// an idle entry.
#[inline(always)]
pub const fn hop_holds_at(until: u32, now: u32, ttl: u32) -> bool {
    let ahead = until.wrapping_sub(now);
    ahead != 0 && ahead <= ttl
}

const _: () = assert!(core::mem::offset_of!(CtEntry, state) == 48);

impl CtEntry {
    /// Direction of a packet whose source is (or is not) the key's `lo` side.
    #[inline(always)]
    pub const fn dir(&self, src_is_lo: bool) -> usize {
        let orig_is_lo = self.flags & CT_F_ORIG_IS_LO != 0;
        if src_is_lo == orig_is_lo {
            DIR_ORIGINAL
        } else {
            DIR_REPLY
        }
    }
}

/// A load-balanced connection's entry `conn` with what its alias `alias` counted: the
/// backend's packets the datapath counted in the alias alone (see `CT_F_ASSURED`), added to
/// the reply direction, and the later of the two last-seen times — the connection as the
/// daemon shows and expires it.
pub fn with_alias(conn: &CtEntry, alias: &CtEntry) -> CtEntry {
    let mut e = *conn;
    e.packets[DIR_REPLY] = e.packets[DIR_REPLY].wrapping_add(alias.packets[DIR_REPLY]);
    e.bytes[DIR_REPLY] = e.bytes[DIR_REPLY].wrapping_add(alias.bytes[DIR_REPLY]);
    if alias.last_seen_ns > e.last_seen_ns {
        e.last_seen_ns = alias.last_seen_ns;
    }
    e
}

/// Conntrack counters (index of the per-CPU `FP_CT_STATS` array). Codes are an ABI.
pub mod ct_stat {
    /// Packets looked up (tracked protocols on a tracking hook).
    pub const LOOKUPS: u32 = 0;
    /// Packets that found their connection.
    pub const HITS: u32 = 1;
    /// Connections created.
    pub const NEW: u32 = 2;
    /// Creations refused by the table (full, or a concurrent insert): the packet is untracked.
    pub const INSERT_FAILED: u32 = 3;
    /// Packets with no connection that cannot start one (TCP without SYN, echo reply, ...).
    pub const INVALID_NEW: u32 = 4;
    /// TCP packets that do not fit the connection's state (Linux's sIV).
    pub const INVALID_STATE: u32 = 5;
    /// TCP packets accepted without a state change (Linux's sIG: retransmissions).
    pub const IGNORED: u32 = 6;
    /// Connections that became assured (TCP established, UDP/ICMP replied).
    pub const ASSURED: u32 = 7;
    /// TCP connections that reached TIME_WAIT or CLOSE.
    pub const CLOSED: u32 = 8;
    /// A SYN re-opened a connection in TIME_WAIT/CLOSE (entry reset).
    pub const REOPENED: u32 = 9;
    /// Events dropped because the ring buffer was full.
    pub const EVENTS_LOST: u32 = 10;
    /// ICMP/ICMPv6 errors whose inner header belongs to a tracked connection (Linux's
    /// RELATED); they do not change or refresh it.
    pub const RELATED: u32 = 11;
    /// ICMP/ICMPv6 errors for no tracked connection (or with an unreadable inner header).
    pub const RELATED_MISS: u32 = 12;
    /// Unassured entries removed to make room for a new connection when the table was full.
    pub const EARLY_DROP: u32 = 13;
    /// Entries removed by a RST before any reply was seen (Linux deletes these at once).
    pub const KILLED: u32 = 14;
    /// Packets the stateful firewall dropped (also counted under their reason in FP_STATS).
    pub const FW_DROPPED: u32 = 15;
    /// Source ports a full-NAT allocation found taken (each moved it to the next candidate).
    pub const SNAT_RETRIES: u32 = 16;
    /// New full-NAT connections refused because every candidate port was taken (the packet
    /// is dropped with reason `snat_exhausted`): widen the port range or add an address.
    pub const SNAT_EXHAUSTED: u32 = 17;
    /// Packets towards a backend on the tuple of a live NAT-mode connection's alias — the
    /// client reaching the backend directly from the port its connection to the VIP uses:
    /// passed to the kernel untranslated and untracked (dropped by the stateful firewall).
    pub const ALIAS_CLASH: u32 = 18;
    /// Packets served from the XDP flow cache's copy of their connection (`FlowSlot`): no
    /// table lookup. Also counted under `LOOKUPS` and `HITS`.
    pub const FLOW_HITS: u32 = 19;
    /// Of `FLOW_HITS`, packets the express path served (`express.rs`: rewritten as the
    /// pipeline did the connection's last served packet, without the pipeline's stages).
    pub const EXPRESS_HITS: u32 = 20;
    pub const COUNT: u32 = 21;
    /// Slots in the map (room to append codes without resizing the pinned map).
    pub const SLOTS: u32 = 32;

    pub const NAMES: [&str; COUNT as usize] = [
        "lookups",
        "hits",
        "new",
        "insert_failed",
        "invalid_new",
        "invalid_state",
        "ignored",
        "assured",
        "closed",
        "reopened",
        "events_lost",
        "related",
        "related_miss",
        "early_drop",
        "killed",
        "fw_dropped",
        "snat_retries",
        "snat_exhausted",
        "alias_clash",
        "flow_hits",
        "express_hits",
    ];

    /// What each counter of [`NAMES`] counts, for `fastpath ct stats --help`.
    pub const HELP: [&str; COUNT as usize] = [
        "packets looked up (tracked protocols on a tracking hook)",
        "packets that found their connection",
        "connections created",
        "creations refused by the full table (or a concurrent insert): the packet went untracked",
        "packets with no connection that cannot start one (TCP without SYN, echo reply)",
        "TCP packets that do not fit their connection's state (Linux's sIV)",
        "TCP packets accepted without a state change (retransmissions; Linux's sIG)",
        "connections that became assured (TCP established, UDP/ICMP answered)",
        "TCP connections that reached TIME_WAIT or CLOSE",
        "SYNs that took the tuple of an ended connection (its entry or alias gave way)",
        "events lost because the event ring was full (the daemon or its HA peers missed them)",
        "ICMP errors about a tracked connection (Linux's RELATED)",
        "ICMP errors about no tracked connection",
        "unassured connections removed to make room in a full table",
        "connections removed by a RST before any reply",
        "packets the stateful firewall dropped (each also under its reason in `fastpath stats`)",
        "full-NAT/SNAT source ports found taken (the allocation moved to the next candidate)",
        "full-NAT/SNAT connections refused: all 16 candidate ports taken (widen the range)",
        "packets from a NAT connection's client to its backend on the connection's own tuple, \
         not translated (the client dialled the backend directly from its VIP connection's port)",
        "packets of steady connections served from the XDP flow cache without a table lookup \
         (also counted in hits)",
        "of flow_hits, packets the express path rewrote as the pipeline did their connection's \
         last one, without running the pipeline's stages",
    ];
}

/// Event kinds in the conntrack event stream.
pub mod ct_event {
    pub const NEW: u8 = 1;
    pub const ESTABLISHED: u8 = 2;
    pub const CLOSED: u8 = 3;
    /// Produced by the daemon's expiry, not the datapath.
    pub const EXPIRED: u8 = 4;
    /// The datapath removed this unassured entry to make room (table full).
    pub const EARLY_DROP: u8 = 5;
    /// The datapath removed this entry: a RST before any reply (as Linux does).
    pub const KILLED: u8 = 6;
    /// The first reply was seen: `CT_F_SEEN_REPLY` was set (TCP: usually the SYN-ACK, now
    /// SYN_RECV; a simultaneous open's SYN, SYN_SENT2; the answer to a connection picked up
    /// mid-stream, ESTABLISHED; or a reply the state machine ignores, state unchanged) —
    /// Linux's IPCT_REPLY UPDATE. HA replication needs it, as the entry changed.
    pub const REPLIED: u8 = 7;
}

/// The conntrack event ring's size (`FP_CT_EVENTS`): 8 MiB = 74,898 events of 104 B (112 with
/// the ring's record header).
pub const CT_EVENTS_BYTES: u32 = 1 << 23;
/// Unread bytes in the event ring from which the datapath wakes the daemon, up to
/// [`CT_EVENTS_WAKE_END`]. Outside that window events are written without a wakeup
/// (`BPF_RB_NO_WAKEUP`) and the daemon drains the ring on its own timer: the kernel's default
/// wakes a reader that has caught up on every event, an inter-processor interrupt each time —
/// at 50,000 events/s, 5-10% of a CPU in the packet path's own context. 1 MiB is 9,362
/// events: a burst wakes the daemon long before the ring (8 MiB) fills. Each event written
/// inside the window wakes it (the kernel coalesces wakeups still pending), so however many
/// CPUs write at once, some land in it; above it, the daemon is awake and draining already.
pub const CT_EVENTS_WAKE_BYTES: u64 = 1 << 20;
/// The end of the wakeup window that starts at [`CT_EVENTS_WAKE_BYTES`]: 1.25 MiB.
pub const CT_EVENTS_WAKE_END: u64 = CT_EVENTS_WAKE_BYTES + (1 << 18);
/// One conntrack event (ring buffer record). Append-only.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct CtEvent {
    pub ts_ns: u64,
    pub key: CtKey,
    /// `ct_event::*`.
    pub kind: u8,
    /// TCP state after the packet (0 for other protocols).
    pub state: u8,
    /// `CT_F_*` after the packet.
    pub flags: u8,
    pub _pad: [u8; 5],
    /// The connection's NAT binding (`CtEntry::nat`; zero when it has none): with it an event
    /// says all HA replication sends, with no table read.
    pub nat: crate::lb::CtNat,
}
const _: () = assert!(core::mem::size_of::<CtEvent>() == 104);
const _: () = assert!(
    core::mem::offset_of!(CtEvent, key) == 8
        && core::mem::offset_of!(CtEvent, kind) == 48
        && core::mem::offset_of!(CtEvent, nat) == 56
);

/// Per-interface datapath settings (`FP_IFACE`, keyed by ifindex), written by the daemon.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct IfaceConfig {
    /// `IFACE_F_*`.
    pub flags: u32,
    /// With `IFACE_F_SNAT`: the index of the interface's rule in `FP_SNAT`.
    pub snat: u32,
    /// The interface's MAC address: with `IFACE_F_ROUTE`, only frames sent to it are routed.
    pub mac: [u8; 6],
    /// With `IFACE_F_VLAN_XDP` or `IFACE_F_VLAN_TC`: the port's 802.1Q VLAN id, big-endian as
    /// in a tag.
    pub vlan: [u8; 2],
}
const _: () = assert!(core::mem::size_of::<IfaceConfig>() == 16);

/// Entries of the per-interface array (`FP_IFACE`): interfaces with a larger ifindex are not
/// tracked (the daemon says so).
pub const IFACE_SLOTS: u32 = 1 << 16;
/// Routing interfaces the XDP redirect device map (`FP_TX_PORTS`) holds; XDP redirects to
/// others by ifindex.
pub const TX_PORTS: u32 = 4096;

/// Track connections at this interface's XDP hook.
pub const IFACE_F_CT_XDP: u32 = 1 << 0;
/// Track connections at this interface's TC ingress hook (when it has no XDP program).
pub const IFACE_F_CT_TC_INGRESS: u32 = 1 << 1;
/// Track locally sent connections at this interface's TC egress hook.
pub const IFACE_F_CT_TC_EGRESS: u32 = 1 << 2;
/// Stateful firewall on this interface's tracking ingress hook: packets that belong to no
/// connection and cannot start one, that are invalid for their connection's state, ICMP
/// errors for no connection, and new connections the full table cannot take are dropped,
/// each with its reason.
pub const IFACE_F_FIREWALL: u32 = 1 << 3;
/// Gateway SNAT: new connections forwarded out of this interface get their source
/// translated by the rule `IfaceConfig::snat` (decided at XDP where they come in, from a FIB
/// lookup of their destination).
pub const IFACE_F_SNAT: u32 = 1 << 4;
/// Route in the fast path at this interface's XDP hook: IPv4/IPv6 packets sent to its MAC
/// address (`IfaceConfig::mac`) and routed out of another routing interface (either flag)
/// are forwarded there, TTL decremented and MAC addresses rewritten from the kernel's FIB
/// and neighbour table (see the datapath's `route` stage).
pub const IFACE_F_ROUTE: u32 = 1 << 5;
/// The same at TC ingress, for an interface without XDP (one hook routes, as one tracks).
pub const IFACE_F_ROUTE_TC: u32 = 1 << 6;
/// An 802.1Q port of VLAN `IfaceConfig::vlan` (the kernel here has no VLAN devices): frames
/// arriving tagged with it are untagged at XDP, before anything else sees them, and anything
/// else arriving is dropped; frames leaving get the tag (at TC egress, or before the fast
/// path redirects them there).
pub const IFACE_F_VLAN_XDP: u32 = 1 << 7;
/// The same, untagging at TC ingress, for an interface without XDP.
pub const IFACE_F_VLAN_TC: u32 = 1 << 8;
/// A kernel vxlan device of a configured network (`[[vxlan]]`, no program attached to it):
/// packets the L3 stage routes to it are encapsulated at XDP with the learned headers (see
/// `crate::vxlan`); with `IFACE_F_ROUTE` and `IfaceConfig::mac`, decapsulated packets are
/// routed as if they arrived on it.
pub const IFACE_F_VXLAN: u32 = 1 << 9;
/// A VXLAN underlay: UDP arriving at XDP goes to the decapsulation tail program, packets
/// leaving (TC egress) teach the cache.
pub const IFACE_F_VXLAN_UNDERLAY: u32 = 1 << 10;
/// A loopback device: the node's own traffic arrives here with loopback sources or with its
/// source equal to its destination (a local client of a local address), so sources are not
/// judged martian (see `martian_source`).
pub const IFACE_F_LOOPBACK: u32 = 1 << 11;

/// One write of the installer program (`program_names::CT_INSTALL`), which reads a batch of
/// them back to back: create the entry `key` → `entry` ([`CT_RECORD_CREATE`]), or remove the
/// connection `key` replicated from `entry.origin` and its alias ([`CT_RECORD_REMOVE`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct CtRecord {
    pub key: CtKey,
    pub entry: CtEntry,
    /// `CT_RECORD_CREATE` or `CT_RECORD_REMOVE`.
    pub op: u32,
    pub _pad: u32,
}
const _: () = assert!(core::mem::size_of::<CtRecord>() == 200);

/// [`CtRecord::op`]: create the entry if its key is free.
pub const CT_RECORD_CREATE: u32 = 0;
/// [`CtRecord::op`]: remove a peer's connection (only `entry.origin` is read).
pub const CT_RECORD_REMOVE: u32 = 1;

/// Records one run of the installer takes at most: BPF_PROG_TEST_RUN gives an XDP program
/// at most a page less its headroom and `skb_shared_info` (3520 bytes with 4 KiB pages).
pub const CT_INSTALL_MAX: usize = 16;
const _: () = assert!(CT_INSTALL_MAX * core::mem::size_of::<CtRecord>() <= 3520);

#[cfg(feature = "user")]
mod pod {
    // SAFETY: #[repr(C)], fixed-width fields, explicit padding (sizes asserted above).
    unsafe impl aya::Pod for super::CtKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::CtEntry {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::FlowSlot {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::CtEvent {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::IfaceConfig {}
}

#[cfg(test)]
mod tests {
    use super::{tcp_state::*, *};

    const SYN: u8 = TCP_SYN;
    const SYNACK: u8 = TCP_SYN | TCP_ACK;
    const ACK: u8 = TCP_ACK;
    const FIN: u8 = TCP_FIN | TCP_ACK;
    const RST: u8 = TCP_RST;
    const O: usize = DIR_ORIGINAL;
    const R: usize = DIR_REPLY;

    /// Walks `steps` from NONE, checking the state after each.
    fn walk(steps: &[(usize, u8, TcpStep)]) {
        let mut state = NONE;
        for (i, &(dir, flags, want)) in steps.iter().enumerate() {
            let got = tcp_step(state, dir, flags);
            assert_eq!(
                got,
                want,
                "step {i}: {} {flags:#04x} in {}: expected {want:?}, got {got:?}",
                if dir == O { "orig" } else { "reply" },
                NAMES[state as usize]
            );
            if let TcpStep::To(s) = got {
                state = s;
            }
        }
    }

    #[test]
    fn keys_order_their_ends_by_address_bytes_then_port() {
        // Addresses whose first differing byte is `i` and which differ the other way at a
        // later byte `j` (within a word and across the two), both orders; equal addresses.
        let check = |a: [u8; 16], b: [u8; 16]| {
            for (pa, pb) in [(1u16, 2u16), (2, 1)] {
                let mut key = CtKey {
                    addr_lo: a,
                    addr_hi: b,
                    port_lo: pa,
                    port_hi: pb,
                    ..CtKey::default()
                };
                let want = (a, pa) <= (b, pb);
                let got = key.normalize();
                assert_eq!(
                    got, want,
                    "{a:?}:{pa} vs {b:?}:{pb}: expected source-is-lo {want}, got {got}"
                );
                let lo = if want { (a, pa) } else { (b, pb) };
                assert_eq!((key.addr_lo, key.port_lo), lo, "lower end first");
            }
        };
        for i in 0..16 {
            for j in i + 1..=16 {
                let (mut a, mut b) = ([0x80u8; 16], [0x80u8; 16]);
                a[i] = 0x7f;
                b[i] = 0x81;
                if j < 16 {
                    a[j] = 0xff;
                    b[j] = 0x00;
                }
                check(a, b);
                check(b, a);
            }
        }
        check([9; 16], [9; 16]);
    }

    #[test]
    fn a_kept_hop_holds_for_its_ttl_across_the_clocks_wrap() {
        let ttl = hop_clock(1_000_000_000);
        assert_eq!(ttl, 953, "1 s in 2^20 ns units");
        for learned in [0u32, 12_345, u32::MAX - 10, u32::MAX] {
            let until = learned.wrapping_add(ttl);
            for (age, holds) in [
                (0, true),
                (ttl - 1, true),
                (ttl, false),
                (ttl + 1, false),
                (1 << 31, false),
            ] {
                let now = learned.wrapping_add(age);
                assert_eq!(
                    hop_holds_at(until, now, ttl),
                    holds,
                    "learned at {learned}, {age} units later: expected holds = {holds}"
                );
            }
        }
        // Nothing learned (until 0) at clock 0 does not hold.
        assert!(!hop_holds_at(0, 0, ttl), "an empty hop at clock 0");
    }

    #[test]
    fn three_way_handshake_and_active_close() {
        walk(&[
            (O, SYN, TcpStep::To(SYN_SENT)),
            (R, SYNACK, TcpStep::To(SYN_RECV)),
            (O, ACK, TcpStep::To(ESTABLISHED)),
            (O, ACK | 0x08, TcpStep::To(ESTABLISHED)), // data (PSH|ACK)
            (R, ACK, TcpStep::To(ESTABLISHED)),
            (O, FIN, TcpStep::To(FIN_WAIT)),
            (R, ACK, TcpStep::To(CLOSE_WAIT)),
            (R, FIN, TcpStep::To(LAST_ACK)),
            (O, ACK, TcpStep::To(TIME_WAIT)),
        ]);
    }

    #[test]
    fn passive_close_from_the_responder() {
        walk(&[
            (O, SYN, TcpStep::To(SYN_SENT)),
            (R, SYNACK, TcpStep::To(SYN_RECV)),
            (O, ACK, TcpStep::To(ESTABLISHED)),
            (R, FIN, TcpStep::To(FIN_WAIT)),
            (O, ACK, TcpStep::To(CLOSE_WAIT)),
            (O, FIN, TcpStep::To(LAST_ACK)),
            (R, ACK, TcpStep::To(TIME_WAIT)),
        ]);
    }

    #[test]
    fn simultaneous_close_reaches_time_wait() {
        walk(&[
            (O, SYN, TcpStep::To(SYN_SENT)),
            (R, SYNACK, TcpStep::To(SYN_RECV)),
            (O, ACK, TcpStep::To(ESTABLISHED)),
            (O, FIN, TcpStep::To(FIN_WAIT)),
            (R, FIN, TcpStep::To(LAST_ACK)),
            (O, ACK, TcpStep::To(TIME_WAIT)),
            (R, ACK, TcpStep::To(TIME_WAIT)),
        ]);
    }

    #[test]
    fn simultaneous_open_goes_through_syn_sent2() {
        walk(&[
            (O, SYN, TcpStep::To(SYN_SENT)),
            (R, SYN, TcpStep::To(SYN_SENT2)),
            (O, SYNACK, TcpStep::To(SYN_RECV)),
            (R, ACK, TcpStep::To(SYN_RECV)),
        ]);
        assert_eq!(tcp_step(SYN_SENT2, R, SYNACK), TcpStep::To(SYN_RECV));
        assert_eq!(tcp_step(SYN_SENT2, O, SYN), TcpStep::To(SYN_SENT2));
        assert_eq!(tcp_step(SYN_SENT2, R, ACK), TcpStep::Ignore);
        // A late retransmitted SYN/ACK of a simultaneous open, from the originator.
        assert_eq!(tcp_step(SYN_RECV, O, SYNACK), TcpStep::To(SYN_RECV));
    }

    #[test]
    fn retransmitted_syn_and_synack() {
        assert_eq!(tcp_step(SYN_SENT, O, SYN), TcpStep::To(SYN_SENT));
        assert_eq!(tcp_step(SYN_RECV, R, SYNACK), TcpStep::Ignore);
        assert_eq!(tcp_step(SYN_RECV, O, SYN), TcpStep::Ignore);
        assert_eq!(tcp_step(ESTABLISHED, R, SYNACK), TcpStep::Ignore);
        assert_eq!(tcp_step(ESTABLISHED, O, SYN), TcpStep::Ignore);
    }

    #[test]
    fn rst_closes_from_any_state_in_either_direction() {
        for s in [
            SYN_SENT,
            SYN_RECV,
            ESTABLISHED,
            FIN_WAIT,
            CLOSE_WAIT,
            LAST_ACK,
            TIME_WAIT,
            CLOSE,
            SYN_SENT2,
        ] {
            assert_eq!(
                tcp_step(s, O, RST),
                TcpStep::To(CLOSE),
                "orig RST in {}",
                NAMES[s as usize]
            );
            assert_eq!(
                tcp_step(s, R, RST | TCP_ACK),
                TcpStep::To(CLOSE),
                "reply RST in {}",
                NAMES[s as usize]
            );
        }
        assert_eq!(tcp_step(NONE, O, RST), TcpStep::Invalid);
    }

    #[test]
    fn new_connections_start_only_with_syn_or_loose_ack() {
        assert_eq!(tcp_step(NONE, O, SYN), TcpStep::To(SYN_SENT));
        // Picked up mid-stream, as Linux does with nf_conntrack_tcp_loose=1.
        assert_eq!(tcp_step(NONE, O, ACK), TcpStep::To(ESTABLISHED));
        assert_eq!(tcp_step(NONE, O, SYNACK), TcpStep::Invalid);
        assert_eq!(tcp_step(NONE, O, FIN), TcpStep::Invalid);
        assert_eq!(tcp_step(NONE, O, 0), TcpStep::Invalid);
    }

    #[test]
    fn packets_that_do_not_fit_the_state_are_invalid() {
        assert_eq!(tcp_step(SYN_SENT, O, ACK), TcpStep::Invalid);
        assert_eq!(tcp_step(SYN_SENT, O, FIN), TcpStep::Invalid);
        assert_eq!(tcp_step(SYN_SENT, R, FIN), TcpStep::Invalid);
        assert_eq!(tcp_step(SYN_SENT, O, SYNACK), TcpStep::Invalid);
        assert_eq!(tcp_step(ESTABLISHED, R, SYN), TcpStep::Invalid);
        assert_eq!(tcp_step(ESTABLISHED, O, 0), TcpStep::Invalid);
        assert_eq!(tcp_step(SYN_SENT2, O, FIN), TcpStep::Invalid);
    }

    #[test]
    fn a_new_syn_reopens_time_wait_and_close() {
        assert_eq!(tcp_step(TIME_WAIT, O, SYN), TcpStep::To(SYN_SENT));
        assert_eq!(tcp_step(CLOSE, O, SYN), TcpStep::To(SYN_SENT));
        assert_eq!(tcp_step(TIME_WAIT, R, SYN), TcpStep::To(SYN_SENT));
        assert_eq!(tcp_step(CLOSE, R, SYN), TcpStep::Invalid);
    }

    #[test]
    fn late_packets_after_close() {
        assert_eq!(tcp_step(TIME_WAIT, O, ACK), TcpStep::To(TIME_WAIT));
        assert_eq!(tcp_step(TIME_WAIT, R, FIN), TcpStep::To(TIME_WAIT));
        assert_eq!(tcp_step(CLOSE, O, ACK), TcpStep::To(CLOSE));
        assert_eq!(tcp_step(LAST_ACK, R, FIN), TcpStep::To(LAST_ACK));
    }

    /// `tcp_flags_valid` against Linux's `tcp_valid_flags` table, written out as there, for
    /// every flags byte.
    #[test]
    fn valid_flags_are_linuxs() {
        const URG: u8 = 0x20;
        let linux = [
            TCP_SYN,
            TCP_SYN | URG,
            TCP_SYN | TCP_ACK,
            TCP_RST,
            TCP_RST | TCP_ACK,
            TCP_FIN | TCP_ACK,
            TCP_FIN | TCP_ACK | URG,
            TCP_ACK,
            TCP_ACK | URG,
        ];
        for flags in 0..=u8::MAX {
            let want = linux.contains(&(flags & !(0x40 | 0x80 | 0x08)));
            assert_eq!(
                tcp_flags_valid(flags),
                want,
                "flags {flags:#04x}: expected valid = {want} as in Linux's tcp_valid_flags"
            );
        }
        for invalid in [
            TCP_SYN | TCP_FIN,
            0,
            0xff,
            TCP_FIN,
            TCP_SYN | TCP_RST,
            TCP_FIN | TCP_RST,
        ] {
            assert!(!tcp_flags_valid(invalid), "{invalid:#04x} must be invalid");
        }
    }

    #[test]
    fn martian_sources() {
        let v4 = |a: [u8; 4]| {
            let mut x = [0u8; 16];
            x[..4].copy_from_slice(&a);
            x
        };
        let vip = v4([10, 0, 0, 100]);
        for (src, want) in [
            ([127, 0, 0, 1], true),
            ([127, 9, 9, 9], true),
            ([0, 0, 0, 0], true),
            ([0, 1, 2, 3], true),
            ([255, 255, 255, 255], true),
            ([224, 0, 0, 1], true),
            ([239, 255, 255, 250], true),
            ([10, 0, 0, 100], true), // the destination itself
            ([10, 0, 0, 1], false),
            ([192, 168, 1, 1], false),
            ([240, 0, 0, 1], false), // class E: Linux takes it
            ([255, 255, 255, 254], false),
        ] {
            assert_eq!(
                martian_source(4, &v4(src), &vip),
                want,
                "IPv4 source {src:?} to {vip:?}: expected martian = {want}"
            );
        }
        // Broadcast and multicast destinations are not judged (DHCP discover, IGMP).
        for dst in [[255, 255, 255, 255], [224, 0, 0, 22]] {
            assert!(
                !martian_source(4, &v4([0, 0, 0, 0]), &v4(dst)),
                "0.0.0.0 to {dst:?}: expected not martian (Linux takes it)"
            );
        }
        let vip6 = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0];
        let mut lo6 = [0u8; 16];
        lo6[15] = 1;
        let mut two6 = [0u8; 16];
        two6[15] = 2;
        let mut mc6 = [0u8; 16];
        mc6[0] = 0xff;
        mc6[1] = 0x02;
        let mut client6 = vip6;
        client6[15] = 9;
        for (src, want) in [
            (lo6, true),
            ([0; 16], true),
            (mc6, true),
            (vip6, true),
            (client6, false),
            (two6, false), // ::2 is not loopback
        ] {
            assert_eq!(
                martian_source(6, &src, &vip6),
                want,
                "IPv6 source {src:x?}: expected martian = {want}"
            );
        }
        assert!(
            !martian_source(6, &[0; 16], &mc6),
            ":: to ff02::/16: expected not martian (MLD reports)"
        );
    }

    #[test]
    fn classification_follows_linux_precedence() {
        assert_eq!(tcp_classify(TCP_RST | TCP_SYN), tcp_class::RST);
        assert_eq!(tcp_classify(TCP_SYN | TCP_FIN), tcp_class::SYN);
        assert_eq!(tcp_classify(TCP_FIN), tcp_class::FIN);
        assert_eq!(tcp_classify(0x08), tcp_class::NONE); // PSH only
    }

    #[test]
    fn keys_are_the_same_from_both_directions() {
        let a = [10, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        let b = [10, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        let (k1, lo1) = ct_key(4, 6, &a, 40000, &b, 80);
        let (k2, lo2) = ct_key(4, 6, &b, 80, &a, 40000);
        assert_eq!(k1, k2);
        assert!(lo1 && !lo2);
        // Same address (e.g. loopback): ports decide.
        let (k3, lo3) = ct_key(4, 17, &a, 5000, &a, 53);
        let (k4, lo4) = ct_key(4, 17, &a, 53, &a, 5000);
        assert_eq!(k3, k4);
        assert!(!lo3 && lo4);
    }

    #[test]
    fn direction_follows_the_originator() {
        let e = CtEntry {
            flags: CT_F_ORIG_IS_LO,
            ..Default::default()
        };
        assert_eq!(e.dir(true), DIR_ORIGINAL);
        assert_eq!(e.dir(false), DIR_REPLY);
        let e = CtEntry::default();
        assert_eq!(e.dir(false), DIR_ORIGINAL);
        assert_eq!(e.dir(true), DIR_REPLY);
    }
}
