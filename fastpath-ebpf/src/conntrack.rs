//! Conntrack stage: finds or creates the connection of each TCP, UDP and ICMP-echo packet
//! (IPv4 and IPv6) on the hook that tracks for its interface, steps the TCP state machine
//! (`fastpath_common::ct::tcp_step`, the Linux table), counts, and emits events.
//!
//! Contract: never changes the packet or the verdict (the stateful firewall and NAT build on
//! it later); runs at most once per packet per interface (the daemon picks the hook).

use aya_ebpf::helpers::bpf_ktime_get_ns;
use fastpath_common::{
    Hook,
    ct::{
        CT_F_ASSURED, CT_F_ORIG_IS_LO, CT_F_SEEN_REPLY, CtEntry, CtEvent, CtKey, DIR_ORIGINAL,
        DIR_REPLY, IFACE_F_CT_TC_EGRESS, IFACE_F_CT_TC_INGRESS, IFACE_F_CT_XDP, TcpStep, ct_event,
        ct_stat, tcp_state, tcp_step,
    },
};

use crate::{
    maps::{FP_CT, FP_CT_EVENTS, FP_CT_KEY, FP_CT_STATS, FP_IFACE},
    packet::Packet,
    parse::{FAMILY_IPV4, IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_TCP, IPPROTO_UDP, Parsed},
};

/// BPF_NOEXIST: create only.
const BPF_NOEXIST: u64 = 1;

/// Tracks `p` if `hook` tracks for interface `ifindex`. At egress only packets this node sent
/// (`local`) are tracked: forwarded ones were tracked where they came in.
#[inline(always)]
pub fn track(hook: Hook, ifindex: u32, local: bool, pkt: &Packet, p: &Parsed, len: usize) {
    if p.fragment != 0 || (hook == Hook::TcEgress && !local) || !hook_tracks(hook, ifindex) {
        return;
    }
    let Some((src_port, dst_port, starts)) = ports_and_start(p) else {
        return;
    };
    let Some(key) = FP_CT_KEY.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: this CPU's slot of a per-CPU array, used by this program run only.
    let key = unsafe { &mut *key };
    if !load_addresses(pkt, p, key) {
        return;
    }
    key.port_lo = src_port;
    key.port_hi = dst_port;
    key.proto = p.l4_proto;
    key.family = p.family;
    key._pad = [0; 2];
    let src_is_lo = key.normalize();
    count(ct_stat::LOOKUPS);
    let key: &CtKey = key;
    // SAFETY: bpf_ktime_get_ns has no preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    match FP_CT.get_ptr_mut(&key) {
        Some(e) => {
            count(ct_stat::HITS);
            // SAFETY: a value pointer of a hash map stays valid for this program run; writes
            // race only with the same connection's packets on other CPUs (counters may lose an
            // increment, as with Linux's per-conntrack counters without acct locking).
            unsafe { update(&key, &mut *e, src_is_lo, p, len, now) };
        }
        None => create(&key, src_is_lo, starts, p, len, now),
    }
}

/// Source into `addr_lo`, destination into `addr_hi`, read from the packet (IPv4: first 4
/// bytes, the rest zero). False if the packet no longer holds them.
#[inline(always)]
fn load_addresses(pkt: &Packet, p: &Parsed, key: &mut CtKey) -> bool {
    let off = p.l3_off as usize;
    if p.family == FAMILY_IPV4 {
        let Some(a) = pkt.load::<[u8; 8]>(off + 12) else {
            return false;
        };
        key.addr_lo = [0; 16];
        key.addr_hi = [0; 16];
        key.addr_lo[..4].copy_from_slice(&a[..4]);
        key.addr_hi[..4].copy_from_slice(&a[4..]);
        true
    } else {
        match (
            pkt.load::<[u8; 16]>(off + 8),
            pkt.load::<[u8; 16]>(off + 24),
        ) {
            (Some(s), Some(d)) => {
                key.addr_lo = s;
                key.addr_hi = d;
                true
            }
            _ => false,
        }
    }
}

/// Whether this hook is the one tracking for the interface.
#[inline(always)]
fn hook_tracks(hook: Hook, ifindex: u32) -> bool {
    let Some(cfg) = FP_IFACE.get_ptr(ifindex) else {
        return false;
    };
    // SAFETY: a valid map value pointer for this run.
    let flags = unsafe { (*cfg).flags };
    let bit = match hook {
        Hook::Xdp => IFACE_F_CT_XDP,
        Hook::TcIngress => IFACE_F_CT_TC_INGRESS,
        Hook::TcEgress => IFACE_F_CT_TC_EGRESS,
    };
    flags & bit != 0
}

/// Key ports for the packet and whether a packet like it may start a connection; `None` for
/// protocols (and ICMP types) that are not tracked.
#[inline(always)]
fn ports_and_start(p: &Parsed) -> Option<(u16, u16, bool)> {
    match p.l4_proto {
        IPPROTO_TCP | IPPROTO_UDP => Some((p.src_port, p.dst_port, true)),
        IPPROTO_ICMP if p.family == FAMILY_IPV4 => echo(p, 8, 0),
        IPPROTO_ICMPV6 if p.family != FAMILY_IPV4 => echo(p, 128, 129),
        _ => None,
    }
}

/// ICMP echo: keyed by identifier on both sides; a request may start a connection.
#[inline(always)]
fn echo(p: &Parsed, request: u8, reply: u8) -> Option<(u16, u16, bool)> {
    if p.icmp_type == request {
        Some((p.src_port, p.src_port, true))
    } else if p.icmp_type == reply {
        Some((p.src_port, p.src_port, false))
    } else {
        None
    }
}

#[inline(always)]
fn create(key: &CtKey, src_is_lo: bool, starts: bool, p: &Parsed, len: usize, now: u64) {
    let mut state = 0;
    if p.l4_proto == IPPROTO_TCP {
        match tcp_step(tcp_state::NONE, DIR_ORIGINAL, p.tcp_flags) {
            TcpStep::To(s) => state = s,
            _ => {
                count(ct_stat::INVALID_NEW);
                return;
            }
        }
    } else if !starts {
        count(ct_stat::INVALID_NEW);
        return;
    }
    let mut entry = CtEntry {
        created_ns: now,
        last_seen_ns: now,
        state,
        flags: if src_is_lo { CT_F_ORIG_IS_LO } else { 0 },
        ..CtEntry::default()
    };
    entry.packets[DIR_ORIGINAL] = 1;
    entry.bytes[DIR_ORIGINAL] = len as u64;
    if FP_CT.insert(key, &entry, BPF_NOEXIST).is_err() {
        count(ct_stat::INSERT_FAILED);
        return;
    }
    count(ct_stat::NEW);
    emit(key, ct_event::NEW, &entry, now);
    // A connection picked up mid-stream (loose ACK) is established from the start.
    if state == tcp_state::ESTABLISHED {
        entry.flags |= CT_F_ASSURED;
        if let Some(e) = FP_CT.get_ptr_mut(key) {
            // SAFETY: valid map value pointer for this run.
            unsafe { (*e).flags |= CT_F_ASSURED };
        }
        count(ct_stat::ASSURED);
        emit(key, ct_event::ESTABLISHED, &entry, now);
    }
}

/// Steps an existing connection. As in Linux, a packet the state machine rejects (invalid)
/// or ignores (a retransmission) is not accounted: it neither refreshes the entry nor counts.
#[inline(always)]
fn update(key: &CtKey, e: &mut CtEntry, src_is_lo: bool, p: &Parsed, len: usize, now: u64) {
    let mut dir = e.dir(src_is_lo);
    if p.l4_proto == IPPROTO_TCP {
        let closed = |x: u8| x == tcp_state::TIME_WAIT || x == tcp_state::CLOSE;
        match tcp_step(e.state, dir, p.tcp_flags) {
            TcpStep::To(tcp_state::SYN_SENT) if closed(e.state) => {
                // A new connection on the same tuple: start over, its SYN sender as originator.
                *e = CtEntry {
                    created_ns: now,
                    flags: if src_is_lo { CT_F_ORIG_IS_LO } else { 0 },
                    ..CtEntry::default()
                };
                e.state = tcp_state::SYN_SENT;
                dir = DIR_ORIGINAL;
                count(ct_stat::REOPENED);
                emit(key, ct_event::NEW, e, now);
            }
            TcpStep::To(s) => {
                let was = e.state;
                e.state = s;
                if s == tcp_state::ESTABLISHED && e.flags & CT_F_ASSURED == 0 {
                    e.flags |= CT_F_ASSURED;
                    count(ct_stat::ASSURED);
                    emit(key, ct_event::ESTABLISHED, e, now);
                }
                if closed(s) && !closed(was) {
                    count(ct_stat::CLOSED);
                    emit(key, ct_event::CLOSED, e, now);
                }
            }
            TcpStep::Ignore => {
                // Accepted, so a reply still counts as seen (as in Linux), but not accounted.
                count(ct_stat::IGNORED);
                if dir == DIR_REPLY {
                    e.flags |= CT_F_SEEN_REPLY;
                }
                return;
            }
            TcpStep::Invalid => {
                count(ct_stat::INVALID_STATE);
                return;
            }
        }
    } else if dir == DIR_REPLY && e.flags & CT_F_ASSURED == 0 {
        // UDP and ICMP echo: a reply makes the connection assured.
        e.flags |= CT_F_ASSURED;
        count(ct_stat::ASSURED);
        emit(key, ct_event::ESTABLISHED, e, now);
    }
    if dir == DIR_REPLY {
        e.flags |= CT_F_SEEN_REPLY;
    }
    let d = dir & 1;
    e.packets[d] += 1;
    e.bytes[d] += len as u64;
    e.last_seen_ns = now;
}

/// Writes an event straight into the ring (no stack copy); counts it as lost if full.
#[inline(always)]
fn emit(key: &CtKey, kind: u8, e: &CtEntry, now: u64) {
    let Some(mut slot) = FP_CT_EVENTS.reserve::<CtEvent>(0) else {
        count(ct_stat::EVENTS_LOST);
        return;
    };
    slot.write(CtEvent {
        ts_ns: now,
        key: *key,
        kind,
        state: e.state,
        flags: e.flags,
        _pad: [0; 5],
    });
    slot.submit(0);
}

#[inline(always)]
fn count(code: u32) {
    if let Some(c) = FP_CT_STATS.get_ptr_mut(code) {
        // SAFETY: this CPU's slot of a per-CPU array.
        unsafe { *c += 1 };
    }
}
