//! Conntrack stage: finds or creates the connection of each TCP, UDP and ICMP-echo packet
//! (IPv4 and IPv6) on the hook that tracks for its interface, steps the TCP state machine
//! (`fastpath_common::ct::tcp_step`, the Linux table), matches ICMP errors to the connection of
//! their inner header, counts, and emits events. With the interface's stateful firewall on, it
//! also says which packets to drop.
//!
//! A packet without a connection that may start one, where the load-balancing stages run, is
//! reported as a miss: the pipeline asks the LB stage (and gateway SNAT) for a service and a
//! backend, then has this stage create the connection — plain ([`create_plain`]) or with its
//! NAT binding in two entries ([`create_lb`], see `fastpath_common::lb::CtNat`). The stage
//! then says how to translate each of the connection's packets.
//!
//! Contract: never changes the packet itself (the pipeline rewrites what it is told to); runs
//! at most once per packet per interface (the daemon picks the hook). Assured entries are never
//! removed here; when the table is full the oldest unassured entry makes room (early drop).

use aya_ebpf::{
    bindings::{BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP},
    helpers::bpf_ktime_get_ns,
};
use fastpath_common::{
    Hook, Verdict,
    ct::{
        CT_EVENTS_WAKE_BYTES, CT_EVENTS_WAKE_END, CT_F_ASSURED, CT_F_DSR, CT_F_FULL_NAT, CT_F_LB,
        CT_F_LB_ALIAS, CT_F_ORIG_IS_LO, CT_F_SEEN_REPLY, CT_F_SNAT, CT_INSTALL_MAX,
        CT_RECORD_CREATE, CT_RECORD_REMOVE, CtEntry, CtEvent, CtKey, CtRecord, DIR_ORIGINAL,
        DIR_REPLY, IFACE_F_CT_TC_EGRESS, IFACE_F_CT_TC_INGRESS, IFACE_F_CT_XDP, IFACE_F_FIREWALL,
        IFACE_F_LOOPBACK, TcpStep, UDP_STREAM_AFTER_NS, ct_event, ct_stat, last_seen_moves,
        martian_source, tcp_class, tcp_classify, tcp_flags_valid, tcp_state, tcp_step,
    },
    lb::{
        Backend, CtNat, SNAT_TRIES, SVC_F_DSR, SVC_F_FULL_NAT, SVC_F_GATEWAY, Service, flow_hash,
        lb_peer_key_into, nat_alias_backend_is_lo,
    },
    reason,
};

use crate::{
    clock,
    ctx::{HopRef, Miss, NAT_DSR, NAT_DST, NAT_ICMP_ERROR, NAT_ICMP_KEEP_SOURCE, NAT_SRC, copy16},
    flowcache,
    maps::{
        FP_CT, FP_CT_ENTRY, FP_CT_EVENTS, FP_CT_KEY, FP_CT_KEY2, FP_CT_KEY3, FP_CT_NEW,
        FP_CT_STATS, FP_IFACE, FP_MISS, FP_NAT, FP_SVC_KEY,
    },
    packet::Packet,
    parse::{
        FAMILY_IPV4, FAMILY_IPV6, IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_TCP, IPPROTO_UDP, Parsed,
    },
    settings, stats,
};

/// BPF_NOEXIST: create only.
pub(crate) const BPF_NOEXIST: u64 = 1;
/// BPF_EXIST: update an existing element only (on a queue push: when full, overwrite the
/// oldest element).
const BPF_EXIST: u64 = 2;
/// A map insert's error for a key that exists.
const EEXIST: i32 = 17;
/// Candidate keys an early drop examines before giving up (keys of entries that were assured
/// or removed since are discarded on the way; bounded for the verifier).
const EARLY_DROP_TRIES: usize = 8;
/// The ICMP header before an error's inner packet.
const ICMP_HDR_LEN: usize = 8;

/// What the pipeline does with a tracked packet.
pub enum Action {
    /// Nothing beyond tracking: the later stages (routing) or the kernel take the packet.
    Pass,
    /// Drop it, counted under this reason (stateful firewall; a service without backends
    /// that drops; a load-balanced connection the full table cannot take).
    Drop(u32),
    /// Hand it to the kernel untranslated, counted under this reason.
    Kernel(u32),
    /// Rewrite the packet as this CPU's `FP_NAT` plan says, then hand it on, counted under
    /// `reason`.
    Nat(u32),
    /// No connection, and the packet may start one where the LB stages run: the pipeline
    /// looks for its service, then calls [`create_lb`] or [`create_plain`] with [`missed`].
    Miss,
}

/// Plans the rewrite of the packet's destination to `dst` and, if `ends & NAT_SRC`, its
/// source to `src` (if `ends & NAT_DST`, likewise), and says to do it under `reason`.
#[inline(always)]
fn nat(dst: Endpoint, src: Endpoint, ends: u8, reason: u32) -> Action {
    let Some(plan) = FP_NAT.get_ptr_mut(0) else {
        return Action::Drop(reason::LB_REWRITE_FAILED);
    };
    // SAFETY: this CPU's slot of a per-CPU array, used by this program run only.
    let plan = unsafe { &mut *plan };
    copy16(&mut plan.dst_addr, dst.0);
    copy16(&mut plan.src_addr, src.0);
    plan.dst_port = dst.1;
    plan.src_port = src.1;
    plan.ends = ends;
    Action::Nat(reason)
}

/// An address (IPv4 in the first 4 bytes; 8-aligned map memory) and port to translate to.
type Endpoint<'a> = (&'a [u8; 16], u16);

/// Tracks `p` if `hook` tracks for interface `ifindex` (reading the clock into `now`,
/// `clock::now`, for the later stages); on a
/// hit, points `hop` at the next hop its entry keeps for the packet's direction. At egress only packets this node sent
/// (`local`) are tracked: forwarded ones were tracked where they came in. Says what to do with
/// the packet: drop it when the interface's stateful firewall refuses it (never at egress),
/// translate it when it belongs to a load-balanced connection (where `lb`: the program runs
/// the load-balancing stages — XDP, and TC ingress's tail program `fastpath_tc_lb`).
#[expect(
    clippy::too_many_arguments,
    reason = "the packet and where it was seen, passed down once"
)]
#[inline(always)]
pub fn track(
    hook: Hook,
    lb: bool,
    ifindex: u32,
    local: bool,
    pkt: &Packet,
    p: &Parsed,
    len: usize,
    now: &mut u64,
    hop: &mut HopRef,
) -> Action {
    if p.fragment != 0 || (hook == Hook::TcEgress && !local) {
        return Action::Pass;
    }
    let flags = iface_flags(ifindex);
    let bit = match hook {
        Hook::Xdp => IFACE_F_CT_XDP,
        Hook::TcIngress => IFACE_F_CT_TC_INGRESS,
        Hook::TcEgress => IFACE_F_CT_TC_EGRESS,
    };
    if flags & bit == 0 {
        return Action::Pass;
    }
    let firewall = hook != Hook::TcEgress && flags & IFACE_F_FIREWALL != 0;
    let kind = classify(p);
    if kind == Kind::Untracked {
        return Action::Pass;
    }
    let Some(key) = FP_CT_KEY.get_ptr_mut(0) else {
        return Action::Pass;
    };
    // SAFETY: this CPU's slot of a per-CPU array, used by this program run only.
    let key = unsafe { &mut *key };
    if kind == Kind::IcmpError {
        return related(pkt, p, key, firewall, lb);
    }
    // ICMP echo: both sides of the key carry the identifier (parsed into `src_port`).
    let is_tcp_udp = p.l4_proto == IPPROTO_TCP || p.l4_proto == IPPROTO_UDP;
    let dst_port = if is_tcp_udp { p.dst_port } else { p.src_port };
    let l3_off = p.l3_off as usize;
    if !load_key(pkt, p.family, l3_off, p.l4_proto, p.src_port, dst_port, key) {
        return Action::Pass;
    }
    let src_is_lo = key.normalize();
    let key: &CtKey = key;
    // Only a steady packet may be served from a copy: the others (a SYN, FIN or RST, ICMP)
    // go to the table without the probe.
    let mut hit = if hook == Hook::Xdp && steady(p) {
        *now = clock::now();
        flowcache::lookup(key, src_is_lo, *now)
    } else {
        FP_CT.get_ptr_mut(key)
    };
    // Hostile frames touch no entry and no conntrack counter: counted under their reason
    // only. A byte test on every TCP packet; the martian test only where an entry would be
    // created (arriving packets; a loopback device carries the node's own traffic).
    if p.l4_proto == IPPROTO_TCP && !tcp_flags_valid(p.tcp_flags) {
        return invalid_flags(hit, firewall);
    }
    if hit.is_none()
        && hook != Hook::TcEgress
        && flags & IFACE_F_LOOPBACK == 0
        && martian(key, src_is_lo)
    {
        // Dropped rather than handed on: Linux drops martian sources too, and a LAND frame
        // to a VIP that is no local address would be routed on by the kernel.
        return Action::Drop(reason::MARTIAN_SOURCE);
    }
    count(ct_stat::LOOKUPS);
    if *now == 0 {
        *now = clock::now();
    }
    let now = *now;
    let lb_here = lb && is_tcp_udp;
    if lb_here
        && let Some(e) = hit
        // SAFETY: as below.
        && lb_reopens(unsafe { &*e }, src_is_lo, p)
    {
        // A new connection on the tuple of a closed load-balanced one: it is balanced
        // again (the service may have changed), so the old entry and its alias go first.
        // SAFETY: as below.
        forget_lb(pkt, p, key, unsafe { &*e });
        count(ct_stat::HITS);
        count(ct_stat::REOPENED);
        hit = None;
    }
    if lb_here
        && let Some(e) = hit
        // SAFETY: as below.
        && towards_backend(unsafe { &*e }, key, src_is_lo)
    {
        // Not the backend's reply: the client's own connection to the backend on the tuple
        // its balanced connection uses after translation (the same client port to the VIP
        // and to the backend). A SYN takes the tuple once the balanced connection has ended,
        // as the backend's stack lets it; otherwise the packet goes to the kernel as it is,
        // untracked — translated, it would reach the backend from the VIP.
        count(ct_stat::HITS);
        if !(p.l4_proto == IPPROTO_TCP
            && tcp_classify(p.tcp_flags) == tcp_class::SYN
            && replace_ended(key))
        {
            count(ct_stat::ALIAS_CLASH);
            if firewall {
                count(ct_stat::FW_DROPPED);
                return Action::Drop(reason::FW_INVALID_STATE);
            }
            return Action::Pass;
        }
        hit = None;
    }
    let refused = match hit {
        Some(e) => {
            count(ct_stat::HITS);
            // SAFETY: a value pointer of a hash map stays valid for this program run (deleted
            // entries are freed after an RCU grace period); writes race only with the same
            // connection's packets on other CPUs (counters may lose an increment, as with
            // Linux's per-conntrack counters without acct locking).
            let e: &'static mut CtEntry = unsafe { &mut *e };
            if e.flags & CT_F_LB_ALIAS != 0 {
                if !lb_here {
                    return Action::Pass;
                }
                // The backend's packets leave as the alias's reply direction says.
                hop.hop = &raw mut e.hops[DIR_REPLY];
                hop.in_entry = true;
                return lb_reply(pkt, p, key, e, firewall, len, now);
            }
            let was = e.state;
            let refused = update(key, e, src_is_lo, p, len, now);
            hop.hop = &raw mut e.hops[e.dir(src_is_lo) & 1];
            hop.in_entry = true;
            if lb_here
                && e.flags & CT_F_LB != 0
                && was == tcp_state::ESTABLISHED
                && e.state != tcp_state::ESTABLISHED
            {
                // The connection starts to close (or re-opens): the backend's packets step it
                // again (see `lb_reply`).
                unsteady(pkt, p, e);
            }
            if lb_here && e.flags & CT_F_LB != 0 && e.dir(src_is_lo) == DIR_ORIGINAL {
                if let Some(code) = refused
                    && firewall
                {
                    count(ct_stat::FW_DROPPED);
                    return Action::Drop(code);
                }
                stats::service(e.nat.service, e.nat.backend, len, false);
                let e: &'static CtEntry = e;
                let dsr = e.flags & CT_F_DSR != 0;
                return nat(
                    (&e.nat.addr, e.nat.port),
                    (&e.nat.addr2, e.nat.port2),
                    if dsr {
                        NAT_DSR
                    } else {
                        NAT_DST | full_nat(e.flags, NAT_SRC)
                    },
                    if dsr {
                        reason::LB_DSR
                    } else {
                        reason::LB_TO_BACKEND
                    },
                );
            }
            refused
        }
        None => {
            if lb_here && kind == Kind::Starts {
                let Some(m) = FP_MISS.get_ptr_mut(0) else {
                    return Action::Pass;
                };
                // SAFETY: this CPU's slot of a per-CPU array, used by this program run and the
                // tail program it calls only.
                unsafe {
                    *m = Miss {
                        src_is_lo,
                        firewall,
                        now,
                    };
                }
                return Action::Miss;
            }
            create(key, src_is_lo, kind == Kind::Starts, firewall, p, len, now)
        }
    };
    judged(refused, firewall)
}

/// What a packet the stateful firewall may refuse (`refused`: its reason) turns into.
#[inline(always)]
fn judged(refused: Option<u32>, firewall: bool) -> Action {
    match refused {
        Some(code) if firewall => {
            count(ct_stat::FW_DROPPED);
            Action::Drop(code)
        }
        _ => Action::Pass,
    }
}

/// What `track` found of the packet it reported as [`Action::Miss`] (this CPU's `FP_MISS`).
#[inline(always)]
pub fn missed() -> Option<&'static Miss> {
    FP_MISS.get(0)
}

/// The key of the connection a [`Action::Miss`] was reported for (this CPU's `FP_CT_KEY`,
/// normalized).
#[inline(always)]
pub fn missed_key() -> Option<&'static CtKey> {
    // SAFETY: this CPU's slot of a per-CPU array, used by this program run only.
    FP_CT_KEY.get_ptr(0).map(|k| unsafe { &*k })
}

/// A missed packet with no service: a plain connection, as `track` creates one.
#[inline(always)]
pub fn create_plain(m: &Miss, p: &Parsed, len: usize) -> Action {
    let Some(key) = missed_key() else {
        return Action::Pass;
    };
    judged(
        create(key, m.src_is_lo, true, m.firewall, p, len, m.now),
        m.firewall,
    )
}

/// The state a missed packet to a service starts its connection in, if it may start one.
/// Without the firewall a mid-stream packet is picked up, as conntrack does: the same backend
/// comes out of the same table (Maglev), as on a peer after failover.
#[inline(always)]
pub fn lb_start(m: &Miss, p: &Parsed) -> Option<u8> {
    start_state(p, true, m.firewall)
}

/// What happens to a missed packet to a service that may not start a connection
/// ([`lb_start`] said `None`).
#[inline(always)]
pub fn lb_refused(m: &Miss) -> Action {
    if m.firewall {
        count(ct_stat::FW_DROPPED);
        return Action::Drop(reason::FW_NO_CONNECTION);
    }
    Action::Pass
}

/// A TCP segment with a flag combination Linux's conntrack calls invalid
/// (`ct::tcp_flags_valid`), on the tuple of entry `hit` if any: never translated, tracked or
/// stepped. Dropped where its tuple is a load-balanced connection's (either entry: NAT,
/// full-NAT, gateway SNAT, DSR): the kernel, given it untranslated, would answer it with a
/// RST from this node (killing the client's or the backend's connection) or forward it
/// untranslated. Elsewhere as a malformed packet: the kernel's unless `drop_malformed`, or
/// the interface's stateful firewall, says drop.
#[inline(always)]
fn invalid_flags(hit: Option<*mut CtEntry>, firewall: bool) -> Action {
    let entry_flags = match hit {
        // SAFETY: a valid map value pointer for this run; only its flags are read.
        Some(e) => unsafe { (*e).flags },
        None => 0,
    };
    if entry_flags & (CT_F_LB | CT_F_LB_ALIAS) != 0 || firewall || settings::drop_malformed() {
        Action::Drop(reason::TCP_INVALID_FLAGS)
    } else {
        Action::Kernel(reason::TCP_INVALID_FLAGS)
    }
}

/// Whether the packet of `key` (its source on the `lo` side if `src_is_lo`) has a martian
/// source (`ct::martian_source`).
#[inline(always)]
fn martian(key: &CtKey, src_is_lo: bool) -> bool {
    if src_is_lo {
        martian_source(key.family, &key.addr_lo, &key.addr_hi)
    } else {
        martian_source(key.family, &key.addr_hi, &key.addr_lo)
    }
}

/// Whether `p` (a SYN in the original direction) re-opens the closed load-balanced
/// connection `e`.
#[inline(always)]
fn lb_reopens(e: &CtEntry, src_is_lo: bool, p: &Parsed) -> bool {
    // Linux's table: a SYN from the originator in TIME_WAIT or CLOSE goes to SYN_SENT. Spelled
    // out rather than through `tcp_step`: the verifier loses the bound on the state read here.
    e.flags & CT_F_LB != 0
        && p.l4_proto == IPPROTO_TCP
        && (e.state == tcp_state::TIME_WAIT || e.state == tcp_state::CLOSE)
        && e.dir(src_is_lo) == DIR_ORIGINAL
        && tcp_classify(p.tcp_flags) == tcp_class::SYN
}

/// Whether `e` is the alias of a NAT-mode connection and the packet (its source on the key's
/// `lo` side if `src_is_lo`) was not sent by the backend: the alias key is client ↔ backend,
/// and only the backend's side sends replies. (A full-NAT alias's other side is this node's
/// own source address, which no arriving packet carries.)
#[inline(always)]
fn towards_backend(e: &CtEntry, key: &CtKey, src_is_lo: bool) -> bool {
    e.flags & (CT_F_LB_ALIAS | CT_F_FULL_NAT) == CT_F_LB_ALIAS
        && src_is_lo != nat_alias_backend_is_lo(key, e)
}

/// Removes a load-balanced connection's entry and its alias.
#[inline(always)]
fn forget_lb(pkt: &Packet, p: &Parsed, key: &CtKey, e: &CtEntry) {
    if let Some(alias) = alias_key(pkt, p, e) {
        remove(alias);
    }
    remove(key);
}

/// The alias key of load-balanced connection `e`, from a packet of its original direction
/// (NAT: client ↔ backend, the client being this packet's source; full-NAT: the allocated
/// source ↔ backend), in this CPU's `FP_CT_KEY2`. `None` for direct server return (no
/// alias).
#[inline(always)]
fn alias_key(pkt: &Packet, p: &Parsed, e: &CtEntry) -> Option<&'static CtKey> {
    if e.flags & CT_F_DSR != 0 {
        return None;
    }
    let alias = FP_CT_KEY2.get_ptr_mut(0)?;
    // SAFETY: this CPU's slot of a per-CPU array, used by this program run only.
    let alias = unsafe { &mut *alias };
    let (sport, loaded) = if e.flags & CT_F_FULL_NAT != 0 {
        (e.nat.port2, true)
    } else {
        (p.src_port, false)
    };
    if !load_key(
        pkt,
        p.family,
        p.l3_off as usize,
        p.l4_proto,
        sport,
        e.nat.port,
        alias,
    ) {
        return None;
    }
    if loaded {
        copy16(&mut alias.addr_lo, &e.nat.addr2);
    }
    copy16(&mut alias.addr_hi, &e.nat.addr);
    alias.normalize();
    Some(alias)
}

/// `CT_F_SNAT` for a gateway connection's entries.
#[inline(always)]
fn gateway_flag(svc: &Service) -> u8 {
    if svc.flags & SVC_F_GATEWAY != 0 {
        CT_F_SNAT
    } else {
        0
    }
}

/// `end` if `flags` (an entry's) say full-NAT, else nothing.
#[inline(always)]
fn full_nat(flags: u8, end: u8) -> u8 {
    if flags & CT_F_FULL_NAT != 0 { end } else { 0 }
}

/// A new connection (missed as `m`, starting in `state`) to service `svc`, given backend
/// `backend` (index `idx`) by the LB stage: creates the alias under client ↔ backend (how
/// the backend's replies find it) and builds the connection's entry (client ↔ VIP, holding
/// the state and the binding), and says to translate the packet to the backend. The entry
/// is inserted by [`commit`] once the later stages have routed the packet into it: `hop`
/// points at its next hop for the packet's direction. perf: one lookup less than reading
/// the inserted entry back to keep the route in it.
#[expect(
    clippy::too_many_arguments,
    reason = "the stages' results, passed down once"
)]
#[inline(always)]
pub fn create_lb(
    m: &Miss,
    state: u8,
    svc: &'static Service,
    idx: u32,
    backend: &Backend,
    pkt: &Packet,
    p: &Parsed,
    len: usize,
    hop: &mut HopRef,
) -> (Action, Option<Unsaved>) {
    let (src_is_lo, now) = (m.src_is_lo, m.now);
    let (Some(key), Some(alias), Some(svc_key)) = (
        missed_key(),
        FP_CT_KEY2.get_ptr_mut(0),
        FP_SVC_KEY.get_ptr(0),
    ) else {
        return (Action::Pass, None);
    };
    // SAFETY: this CPU's slots of per-CPU arrays, used by this program run only.
    let (alias, svc_key) = unsafe { (&mut *alias, &*svc_key) };
    let full = svc.flags & SVC_F_FULL_NAT != 0;
    let dsr = svc.flags & SVC_F_DSR != 0;
    // The alias: the client (this packet's source) or, full-NAT, the service's source
    // address (its port is allocated below) ↔ the backend.
    if !load_key(
        pkt,
        p.family,
        p.l3_off as usize,
        p.l4_proto,
        p.src_port,
        backend.port,
        alias,
    ) {
        return (Action::Pass, None);
    }
    if full {
        copy16(&mut alias.addr_lo, &svc.snat_addr);
    }
    copy16(&mut alias.addr_hi, &backend.addr);
    let snat_is_lo = alias.normalize();
    // verifier: both entries are built in per-CPU scratch, not on the 512-byte stack.
    let (Some(entry), Some(back)) = (scratch_entry(0), scratch_entry(1)) else {
        return (Action::Pass, None);
    };
    back.created_ns = now;
    back.last_seen_ns = now;
    back.flags = CT_F_LB_ALIAS | gateway_flag(svc);
    back.nat.port = svc_key.port;
    back.nat.backend = idx;
    back.nat.service = svc.id;
    copy16(&mut back.nat.addr, &svc_key.vip);
    if full {
        // Where the backend's replies go: the client.
        back.flags |= CT_F_FULL_NAT;
        if src_is_lo {
            copy16(&mut back.nat.addr2, &key.addr_lo);
            back.nat.port2 = key.port_lo;
        } else {
            copy16(&mut back.nat.addr2, &key.addr_hi);
            back.nat.port2 = key.port_hi;
        }
    } else {
        // The backend's side of the alias key, so the daemon can tell which side is the
        // client.
        copy16(&mut back.nat.addr2, &backend.addr);
        back.nat.port2 = backend.port;
    }
    let back: &CtEntry = back;
    // The alias first: for full-NAT its insertion is the port allocation. Direct server
    // return has none (the backend's replies need no translation).
    let sport = if dsr {
        0
    } else if full {
        match alloc_port(alias, snat_is_lo, svc, key, back) {
            Ok(port) => port,
            Err(code) => return (Action::Drop(code), None),
        }
    } else {
        if !insert(alias, back) && !(replace_ended(alias) && insert(alias, back)) {
            // Without the alias the replies could not be translated: no connection at all.
            count(ct_stat::INSERT_FAILED);
            return (Action::Drop(reason::LB_TABLE_FULL), None);
        }
        0
    };
    entry.created_ns = now;
    entry.last_seen_ns = now;
    entry.state = state;
    entry.flags = CT_F_LB | gateway_flag(svc) | if src_is_lo { CT_F_ORIG_IS_LO } else { 0 };
    entry.nat.port = backend.port;
    entry.nat.backend = idx;
    entry.nat.service = svc.id;
    copy16(&mut entry.nat.addr, &backend.addr);
    if dsr {
        entry.flags |= CT_F_DSR;
    }
    if full {
        entry.flags |= CT_F_FULL_NAT;
        copy16(&mut entry.nat.addr2, &svc.snat_addr);
        entry.nat.port2 = sport;
    }
    entry.packets[DIR_ORIGINAL] = 1;
    entry.bytes[DIR_ORIGINAL] = len as u64;
    // The first route goes into the entry before it is inserted.
    hop.hop = &raw mut entry.hops[DIR_ORIGINAL];
    hop.in_entry = true;
    // Translated to the backend, the packet is routed by the backend's address (a gateway
    // connection's by its own destination, which no other connection shares).
    if svc.flags & SVC_F_GATEWAY == 0 {
        hop.backend = idx;
    }
    (
        nat(
            (&backend.addr, backend.port),
            (&svc.snat_addr, sport),
            if dsr {
                NAT_DSR
            } else {
                NAT_DST | if full { NAT_SRC } else { 0 }
            },
            if dsr {
                reason::LB_DSR
            } else {
                reason::LB_TO_BACKEND
            },
        ),
        Some(Unsaved(())),
    )
}

/// A load-balanced connection's entry that [`create_lb`] built and the later stages routed
/// the packet into: [`commit`] inserts it.
#[must_use]
pub struct Unsaved(());

/// Inserts the entry of a new load-balanced connection ([`Unsaved`], this CPU's scratch
/// entry under the missed key) and counts it, as the packet's `verdict` stands; if the table
/// cannot take it, the connection is not made (its alias goes too) and the packet is
/// dropped.
#[inline(always)]
pub fn commit(_: Unsaved, verdict: (Verdict, u32)) -> (Verdict, u32) {
    let (Some(key), Some(entry), Some(alias)) =
        (missed_key(), FP_CT_ENTRY.get(0), FP_CT_KEY2.get(0))
    else {
        return verdict;
    };
    if !insert(key, entry) {
        if entry.flags & CT_F_DSR == 0 {
            remove(alias);
        }
        count(ct_stat::INSERT_FAILED);
        return (Verdict::Drop, reason::LB_TABLE_FULL);
    }
    let _ = FP_CT_NEW.push(key, BPF_EXIST);
    count(ct_stat::NEW);
    emit(key, ct_event::NEW, entry, event_ns());
    let len = entry.bytes[DIR_ORIGINAL] as usize;
    stats::service(entry.nat.service, entry.nat.backend, len, true);
    stats::backend_opened(entry.nat.backend);
    verdict
}

/// Full-NAT source port allocation: inserts the alias (`alias`, the service's source address
/// on its `lo` side if `snat_is_lo`) with candidate ports from the service's range until one
/// is free — a taken tuple means the port is in use towards that backend, so ports are
/// shared between backends as in Linux's NAT. Candidates start at the connection's hash and
/// stride through the range (`SNAT_TRIES` of them). `Err`: the reason to drop with.
#[inline(always)]
fn alloc_port(
    alias: &mut CtKey,
    snat_is_lo: bool,
    svc: &Service,
    key: &CtKey,
    back: &CtEntry,
) -> Result<u16, u32> {
    let lo = u32::from(svc.snat_port_lo);
    if svc.snat_port_hi < svc.snat_port_lo {
        count(ct_stat::SNAT_EXHAUSTED);
        return Err(reason::SNAT_EXHAUSTED);
    }
    let n = u32::from(svc.snat_port_hi) - lo + 1;
    let start = flow_hash(key);
    let mut port = 0u16;
    let mut full = false;
    let mut i = 0;
    // verifier: a constant bound.
    while i < SNAT_TRIES {
        // A stride coprime with most range sizes scatters the candidates.
        port = (lo + start.wrapping_add(i.wrapping_mul(40_503)) % n) as u16;
        if snat_is_lo {
            alias.port_lo = port;
        } else {
            alias.port_hi = port;
        }
        match FP_CT.insert(&*alias, back, BPF_NOEXIST) {
            Ok(()) => return Ok(port),
            Err(e) if e == -EEXIST => count(ct_stat::SNAT_RETRIES),
            Err(_) => {
                full = true;
                break;
            }
        }
        i += 1;
    }
    if full {
        // The table is full, not the port range: make room once for this port.
        if early_drop() && FP_CT.insert(&*alias, back, BPF_NOEXIST).is_ok() {
            return Ok(port);
        }
        count(ct_stat::INSERT_FAILED);
        return Err(reason::LB_TABLE_FULL);
    }
    count(ct_stat::SNAT_EXHAUSTED);
    Err(reason::SNAT_EXHAUSTED)
}

/// The alias key of a new load-balanced connection is taken: if by a TCP connection that has
/// ended (TIME_WAIT/CLOSE — e.g. the client's earlier direct connection to the backend from the
/// same port, which Linux may hand out again for another destination), or by the alias of an
/// earlier load-balanced connection that has ended or is gone (the client's earlier connection
/// to another VIP of the same backend from the same port), it gives way, as the backend's own
/// stack lets a new SYN reuse a TIME_WAIT tuple. True if it was removed.
#[inline(always)]
fn replace_ended(alias: &CtKey) -> bool {
    let Some(e) = FP_CT.get_ptr(alias) else {
        return false;
    };
    if alias.proto != IPPROTO_TCP {
        return false;
    }
    // SAFETY: a valid map value pointer for this run.
    let e = unsafe { &*e };
    let ended = |state: u8| state == tcp_state::TIME_WAIT || state == tcp_state::CLOSE;
    let gives_way = if e.flags & CT_F_LB_ALIAS == 0 {
        ended(e.state)
    } else {
        // An alias keeps no state: its connection's entry says whether it has ended.
        let Some(conn) = FP_CT_KEY3.get_ptr_mut(0) else {
            return false;
        };
        // SAFETY: this CPU's scratch key, used by this program run only.
        let conn = unsafe { &mut *conn };
        lb_peer_key_into(alias, e, conn)
            && match FP_CT.get_ptr(conn) {
                None => true,
                // SAFETY: as above.
                Some(c) => ended(unsafe { (*c).state }),
            }
    };
    if gives_way && remove(alias) {
        count(ct_stat::REOPENED);
        return true;
    }
    false
}

/// Per-CPU scratch entry `i` (0 or 1), zeroed with word stores (a struct assignment would be
/// a memset call, and a `CtEntry` on the stack is 104 of its 512 bytes).
#[inline(always)]
fn scratch_entry(i: u32) -> Option<&'static mut CtEntry> {
    let e = FP_CT_ENTRY.get_ptr_mut(i)?;
    let words = e.cast::<u64>();
    let mut w = 0;
    while w < core::mem::size_of::<CtEntry>() / 8 {
        // SAFETY: within this CPU's slot of a per-CPU array (a whole number of 8-aligned
        // words); all-zero is a valid CtEntry.
        unsafe { core::ptr::write_volatile(words.add(w), 0) };
        w += 1;
    }
    // SAFETY: this CPU's slot, used by this program run only.
    Some(unsafe { &mut *e })
}

/// Carries out the [`CtRecord`]s that make up `pkt` (the daemon's batch, see
/// `fastpath_ct_install`) in order, and stops at the first one that is not the simple case:
/// the caller does that one itself (the daemon's `ha::install` / `ha::remove`, which this
/// mirrors). Returns how many were done. Simple cases: a creation whose key is free or holds
/// the same peer's untouched entry of the same kind (no early drop: the daemon's writes never
/// push out the datapath's connections), and a removal of a
/// connection that is gone, or that `entry.origin` replicated and this node's traffic has
/// not touched (then its alias goes too, if it is the same peer's and untouched).
#[inline(always)]
pub fn install(pkt: &Packet) -> u32 {
    let mut n = 0;
    while n < CT_INSTALL_MAX {
        let at = pkt.data + n * core::mem::size_of::<CtRecord>();
        if at + core::mem::size_of::<CtRecord>() > pkt.data_end {
            break;
        }
        // SAFETY: the record lies within [data, data_end), checked just above; the input
        // starts 8-byte aligned (XDP headroom) and records are a multiple of 8 bytes long.
        let rec = unsafe { &*(at as *const CtRecord) };
        let done = match rec.op {
            CT_RECORD_CREATE => create_or_refresh(&rec.key, &rec.entry),
            CT_RECORD_REMOVE => remove_replicated(&rec.key, rec.entry.origin),
            _ => false,
        };
        if !done {
            break;
        }
        n += 1;
    }
    n as u32
}

/// A creation in the simple case (see [`install`]): the key is free, or holds the same
/// peer's entry of the same kind (connection or alias) that this node's traffic has not
/// touched, which is brought up to date (a later state of the connection). A call of its own,
/// as [`remove_replicated`].
#[inline(never)]
fn create_or_refresh(key: &CtKey, entry: &CtEntry) -> bool {
    if FP_CT.insert(key, entry, BPF_NOEXIST).is_ok() {
        return true;
    }
    let Some(e) = FP_CT.get_ptr(key) else {
        return false;
    };
    // SAFETY: a live entry of the table, read before it is replaced.
    let e = unsafe { &*e };
    if !untouched(e, entry.origin) || (e.flags ^ entry.flags) & CT_F_LB_ALIAS != 0 {
        return false;
    }
    let replaced = FP_CT.insert(key, entry, BPF_EXIST).is_ok();
    if replaced {
        flowcache::changed(key);
    }
    replaced
}

/// Whether a peer's entry is untouched by this node: replicated, and no packet since.
#[inline(always)]
fn untouched(e: &CtEntry, origin: u32) -> bool {
    e.origin == origin && e.origin != 0 && e.packets[0] == 0 && e.packets[1] == 0
}

/// A removal of `origin`'s connection `key` in the simple case (see [`install`]). A call of
/// its own: inlined, the unrolled loop's copies of the alias key overflow the stack.
#[inline(never)]
fn remove_replicated(key: &CtKey, origin: u32) -> bool {
    let Some(e) = FP_CT.get_ptr(key) else {
        return true;
    };
    // SAFETY: a live entry of the table; read before it is removed.
    let e = unsafe { &*e };
    if e.flags & CT_F_LB_ALIAS != 0 || !untouched(e, origin) {
        return false;
    }
    let mut ak = CtKey::default();
    let alias = lb_peer_key_into(key, e, &mut ak);
    if !remove(key) {
        return false;
    }
    if alias && let Some(a) = FP_CT.get_ptr(&ak) {
        // SAFETY: as above. The alias's connection entry (`key`) is gone, so the alias is
        // this node's only if its own packet counts say so.
        let a = unsafe { &*a };
        if untouched(a, origin) {
            remove(&ak);
        }
    }
    true
}

/// Removes the entry of `key`, then says so to the flow cache; true if it was there.
#[inline(always)]
fn remove(key: &CtKey) -> bool {
    let removed = FP_CT.remove(key).is_ok();
    if removed {
        flowcache::changed(key);
    }
    removed
}

/// Inserts a new entry, making room by early drop when the table is full.
#[inline(always)]
fn insert(key: &CtKey, entry: &CtEntry) -> bool {
    FP_CT.insert(key, entry, BPF_NOEXIST).is_ok()
        || (early_drop() && FP_CT.insert(key, entry, BPF_NOEXIST).is_ok())
}

/// A backend's reply, found through the alias (`akey`): steps the connection's own entry (client ↔
/// VIP) as a reply and says to translate the source back to the VIP. If the entry is gone
/// (flushed, dropped early) the translation still happens: the alias alone knows the VIP.
#[inline(always)]
fn lb_reply(
    pkt: &Packet,
    p: &Parsed,
    akey: &CtKey,
    alias: &'static mut CtEntry,
    firewall: bool,
    len: usize,
    now: u64,
) -> Action {
    let vip = &alias.nat.addr;
    let vport = alias.nat.port;
    let full = alias.flags & CT_F_FULL_NAT != 0;
    let action = nat(
        (&alias.nat.addr2, alias.nat.port2),
        (vip, vport),
        NAT_SRC | full_nat(alias.flags, NAT_DST),
        reason::LB_FROM_BACKEND,
    );
    if alias.flags & CT_F_ASSURED != 0 && steady(p) {
        // perf: one lookup. A plain segment of an established connection (or any datagram
        // of an assured UDP one) changes nothing in the connection's state: it is counted
        // in the alias (the daemon adds the alias's counts and last-seen time to its
        // connection's), not looked up again under the connection's key.
        alias.packets[DIR_REPLY] += 1;
        alias.bytes[DIR_REPLY] += len as u64;
        if last_seen_moves(alias.last_seen_ns, now) {
            alias.last_seen_ns = now;
        }
        stats::service(alias.nat.service, alias.nat.backend, len, false);
        return action;
    }
    let Some(k) = FP_CT_KEY2.get_ptr_mut(0) else {
        return action;
    };
    // SAFETY: this CPU's slot of a per-CPU array, used by this program run only.
    let k = unsafe { &mut *k };
    // The connection's key: the client (NAT: this packet's destination; full-NAT: the one
    // the alias names) ↔ the VIP.
    let cport = if full { alias.nat.port2 } else { p.dst_port };
    if !load_key(
        pkt,
        p.family,
        p.l3_off as usize,
        p.l4_proto,
        vport,
        cport,
        k,
    ) {
        return action;
    }
    copy16(&mut k.addr_lo, vip);
    if full {
        copy16(&mut k.addr_hi, &alias.nat.addr2);
    }
    let src_is_lo = k.normalize();
    let k: &CtKey = k;
    if let Some(e) = FP_CT.get_ptr_mut(k) {
        // SAFETY: as in `track`.
        let e = unsafe { &mut *e };
        let refused = update(k, e, src_is_lo, p, len, now);
        // The alias says whether the backend's next plain packets may skip this lookup.
        let steady_now = e.flags & CT_F_ASSURED != 0
            && (k.proto != IPPROTO_TCP || e.state == tcp_state::ESTABLISHED);
        if steady_now {
            set_flag(alias, CT_F_ASSURED);
        } else if alias.flags & CT_F_ASSURED != 0 {
            clear_flag(alias, CT_F_ASSURED);
            flowcache::changed(akey);
        }
        if let Some(code) = refused
            && firewall
        {
            count(ct_stat::FW_DROPPED);
            return Action::Drop(code);
        }
    }
    stats::service(alias.nat.service, alias.nat.backend, len, false);
    action
}

/// Whether packet `p` of an established TCP connection changes nothing in its state (an ACK
/// without SYN, FIN or RST); any UDP datagram.
#[inline(always)]
fn steady(p: &Parsed) -> bool {
    use fastpath_common::ct::{TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN};
    p.l4_proto == IPPROTO_UDP
        || (p.l4_proto == IPPROTO_TCP
            && p.tcp_flags & (TCP_SYN | TCP_FIN | TCP_RST | TCP_ACK) == TCP_ACK)
}

/// Load-balanced connection `e` left ESTABLISHED on a packet of its original direction: its
/// alias stops taking the backend's packets on one lookup (`CT_F_ASSURED` on the alias, see
/// `lb_reply`), so they step the connection again.
#[inline(always)]
fn unsteady(pkt: &Packet, p: &Parsed, e: &CtEntry) {
    if let Some(alias) = alias_key(pkt, p, e)
        && let Some(a) = FP_CT.get_ptr_mut(alias)
    {
        // SAFETY: a live entry of the table for this run.
        clear_flag(unsafe { &mut *a }, CT_F_ASSURED);
        flowcache::changed(alias);
    }
}

#[inline(always)]
fn iface_flags(ifindex: u32) -> u32 {
    match FP_IFACE.get_ptr(ifindex) {
        // SAFETY: a valid map value pointer for this run.
        Some(cfg) => unsafe { (*cfg).flags },
        None => 0,
    }
}

/// What conntrack does with a parsed packet.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Not a tracked protocol or ICMP type.
    Untracked,
    /// TCP and UDP (TCP's table decides whether it may start a connection), ICMP echo request.
    Starts,
    /// ICMP echo reply: joins a connection, never starts one.
    Echo,
    /// ICMP/ICMPv6 error: related to the connection of its inner header.
    IcmpError,
}

#[inline(always)]
fn classify(p: &Parsed) -> Kind {
    let v4 = p.family == FAMILY_IPV4;
    match p.l4_proto {
        IPPROTO_TCP | IPPROTO_UDP => Kind::Starts,
        IPPROTO_ICMP if v4 => match p.icmp_type {
            8 => Kind::Starts,
            0 => Kind::Echo,
            // Destination unreachable, source quench, redirect, time exceeded, parameter
            // problem: the types Linux relates to a connection.
            3 | 4 | 5 | 11 | 12 => Kind::IcmpError,
            _ => Kind::Untracked,
        },
        IPPROTO_ICMPV6 if !v4 => match p.icmp_type {
            128 => Kind::Starts,
            129 => Kind::Echo,
            // Destination unreachable, packet too big, time exceeded, parameter problem.
            1..=4 => Kind::IcmpError,
            _ => Kind::Untracked,
        },
        _ => Kind::Untracked,
    }
}

/// Fills `key` (not yet normalized) from the packet's addresses at `l3_off` and the given
/// ports: source into `lo`, destination into `hi` (IPv4: first 4 bytes, the rest zero). False
/// if the packet does not hold the addresses.
#[inline(always)]
fn load_key(
    pkt: &Packet,
    family: u8,
    l3_off: usize,
    proto: u8,
    src_port: u16,
    dst_port: u16,
    key: &mut CtKey,
) -> bool {
    if family == FAMILY_IPV4 {
        let Some(a) = pkt.load::<[u8; 8]>(l3_off + 12) else {
            return false;
        };
        store_v4(&mut key.addr_lo, [a[0], a[1], a[2], a[3]]);
        store_v4(&mut key.addr_hi, [a[4], a[5], a[6], a[7]]);
    } else {
        match (
            pkt.load::<[u8; 16]>(l3_off + 8),
            pkt.load::<[u8; 16]>(l3_off + 24),
        ) {
            (Some(s), Some(d)) => {
                key.addr_lo = s;
                key.addr_hi = d;
            }
            _ => return false,
        }
    }
    key.port_lo = src_port;
    key.port_hi = dst_port;
    key.proto = proto;
    key.family = family;
    key._pad = [0; 2];
    true
}

/// An IPv4 address into a 16-byte key field, the rest zero, as two word stores.
/// verifier/perf: `= [0; 16]` compiles to an out-of-line BPF `memset` call, and a BPF-to-BPF
/// call costs tens of ns where `ret` is mitigated (AMD SRSO "Safe RET").
#[inline(always)]
fn store_v4(dst: &mut [u8; 16], a: [u8; 4]) {
    let words = (dst as *mut [u8; 16]).cast::<u64>();
    // SAFETY: `dst` is 16 bytes and 8-aligned (CtKey is `align(8)` and both address fields
    // sit at offsets 0 and 16); any bytes are a valid [u8; 16].
    unsafe {
        core::ptr::write_volatile(
            words,
            u64::from_ne_bytes([a[0], a[1], a[2], a[3], 0, 0, 0, 0]),
        );
        core::ptr::write_volatile(words.add(1), 0);
    }
}

/// An ICMP error: looks up the connection of the packet it quotes (the inner IP header and
/// the first 8 bytes of its L4 header: ports, or the echo identifier). A match is RELATED and
/// leaves the connection as it is, as in Linux.
#[inline(always)]
fn related(pkt: &Packet, p: &Parsed, key: &mut CtKey, firewall: bool, lb: bool) -> Action {
    let found = if inner_key(pkt, p, key) {
        key.normalize();
        let key: &CtKey = key;
        FP_CT.get_ptr(key)
    } else {
        None
    };
    let Some(e) = found else {
        count(ct_stat::RELATED_MISS);
        if firewall {
            count(ct_stat::FW_DROPPED);
            return Action::Drop(reason::FW_ICMP_ERROR_NO_CONNECTION);
        }
        return Action::Pass;
    };
    count(ct_stat::RELATED);
    // SAFETY: a hash map value pointer stays valid for this program run.
    let e: &'static CtEntry = unsafe { &*e };
    let inner_tcp_udp = key.proto == IPPROTO_TCP || key.proto == IPPROTO_UDP;
    if lb && inner_tcp_udp && e.flags & CT_F_LB_ALIAS != 0 {
        // About a packet a backend was sent (the quote matches the backend-side alias): the
        // client must see it about its own packet to the VIP, from the VIP; with full-NAT
        // also its own address and port, and addressed to it.
        let mut ends = NAT_ICMP_ERROR | NAT_SRC;
        if e.flags & CT_F_FULL_NAT != 0 {
            ends |= NAT_DST;
        }
        if e.flags & CT_F_SNAT != 0 {
            // Gateway SNAT: the error still comes from whoever sent it.
            ends |= NAT_ICMP_KEEP_SOURCE;
        }
        return nat(
            (&e.nat.addr2, e.nat.port2),
            (&e.nat.addr, e.nat.port),
            ends,
            reason::LB_ICMP_ERROR,
        );
    }
    Action::Pass
}

/// Fills `key` from an ICMP error's inner packet; false if it is not a tracked packet of the
/// error's own family, or is cut short before its ports.
#[inline(always)]
fn inner_key(pkt: &Packet, p: &Parsed, key: &mut CtKey) -> bool {
    let inner = p.l4_off as usize + ICMP_HDR_LEN;
    let end = p.l3_end as usize;
    let (proto, l4) = if p.family == FAMILY_IPV4 {
        let Some(h) = pkt.load::<[u8; 20]>(inner) else {
            return false;
        };
        let ihl = (h[0] & 0x0f) as usize;
        // A quoted fragment other than the first carries no ports.
        if h[0] >> 4 != 4 || ihl < 5 || u16::from_be_bytes([h[6], h[7]]) & 0x1fff != 0 {
            return false;
        }
        (h[9], inner + ihl * 4)
    } else {
        let Some(h) = pkt.load::<[u8; 8]>(inner) else {
            return false;
        };
        if h[0] >> 4 != 6 {
            return false;
        }
        // Extension headers in the quoted packet are not walked: such errors stay unmatched.
        (h[6], inner + 40)
    };
    if l4 + 8 > end {
        return false;
    }
    let Some(l4h) = pkt.load::<[u8; 8]>(l4) else {
        return false;
    };
    let (sport, dport) = match proto {
        IPPROTO_TCP | IPPROTO_UDP => (
            u16::from_be_bytes([l4h[0], l4h[1]]),
            u16::from_be_bytes([l4h[2], l4h[3]]),
        ),
        // Only a quoted echo request names an echo connection (by its identifier).
        IPPROTO_ICMP if p.family == FAMILY_IPV4 && l4h[0] == 8 => {
            let id = u16::from_be_bytes([l4h[4], l4h[5]]);
            (id, id)
        }
        IPPROTO_ICMPV6 if p.family == FAMILY_IPV6 && l4h[0] == 128 => {
            let id = u16::from_be_bytes([l4h[4], l4h[5]]);
            (id, id)
        }
        _ => return false,
    };
    load_key(pkt, p.family, inner, proto, sport, dport, key)
}

/// The state a new connection starts in, if packet `p` may start one (counted as
/// `invalid_new` if not): a TCP packet that Linux's table takes from NONE — with the firewall
/// on, only a SYN, no mid-stream pickup — or another protocol's packet that `starts` one.
#[inline(always)]
fn start_state(p: &Parsed, starts: bool, firewall: bool) -> Option<u8> {
    let state = if p.l4_proto == IPPROTO_TCP {
        match tcp_step(tcp_state::NONE, DIR_ORIGINAL, p.tcp_flags) {
            TcpStep::To(s) if s == tcp_state::SYN_SENT || !firewall => Some(s),
            _ => None,
        }
    } else if starts {
        Some(0)
    } else {
        None
    };
    if state.is_none() {
        count(ct_stat::INVALID_NEW);
    }
    state
}

/// A packet with no connection: creates one if it may start one. Returns the firewall reason
/// when it is refused.
#[inline(always)]
fn create(
    key: &CtKey,
    src_is_lo: bool,
    starts: bool,
    firewall: bool,
    p: &Parsed,
    len: usize,
    now: u64,
) -> Option<u32> {
    let Some(state) = start_state(p, starts, firewall) else {
        return Some(reason::FW_NO_CONNECTION);
    };
    let entry = scratch_entry(0)?;
    entry.created_ns = now;
    entry.last_seen_ns = now;
    entry.state = state;
    entry.flags = if src_is_lo { CT_F_ORIG_IS_LO } else { 0 };
    entry.packets[DIR_ORIGINAL] = 1;
    entry.bytes[DIR_ORIGINAL] = len as u64;
    let entry: &CtEntry = entry;
    if !insert(key, entry) {
        count(ct_stat::INSERT_FAILED);
        return Some(reason::FW_TABLE_FULL);
    }
    // The key joins the early-drop candidates; a full queue forgets its oldest key, whose
    // entry is then simply never dropped early (it still expires).
    let _ = FP_CT_NEW.push(key, BPF_EXIST);
    count(ct_stat::NEW);
    emit(key, ct_event::NEW, entry, event_ns());
    None
}

/// Makes room in a full table: removes the oldest entry that is still unassured. False if
/// none was found within `EARLY_DROP_TRIES` candidates.
#[inline(always)]
fn early_drop() -> bool {
    for _ in 0..EARLY_DROP_TRIES {
        let Ok(Some(victim)) = FP_CT_NEW.pop() else {
            return false;
        };
        let Some(e) = FP_CT.get_ptr(&victim) else {
            continue;
        };
        // SAFETY: a valid map value pointer for this run.
        let e = unsafe { *e };
        if e.flags & CT_F_ASSURED != 0 {
            continue;
        }
        if remove(&victim) {
            let ended = e.state == tcp_state::TIME_WAIT || e.state == tcp_state::CLOSE;
            if e.flags & CT_F_LB != 0 && !ended {
                stats::backend_closed(e.nat.backend);
            }
            count(ct_stat::EARLY_DROP);
            emit(&victim, ct_event::EARLY_DROP, &e, event_ns());
            return true;
        }
    }
    false
}

/// Steps an existing connection; returns the firewall reason for a packet that does not fit
/// its state. As in Linux, a packet the state machine rejects (invalid) or ignores (a
/// retransmission) is not accounted: it neither refreshes the entry nor counts.
#[inline(always)]
fn update(
    key: &CtKey,
    e: &mut CtEntry,
    src_is_lo: bool,
    p: &Parsed,
    len: usize,
    now: u64,
) -> Option<u32> {
    let mut dir = e.dir(src_is_lo);
    let mut seen_reply = e.flags & CT_F_SEEN_REPLY != 0;
    if p.l4_proto == IPPROTO_TCP {
        let closed = |x: u8| x == tcp_state::TIME_WAIT || x == tcp_state::CLOSE;
        // The two ends' packets of one connection (say, both FINs) may be handled on two CPUs
        // at once: the state moves by compare-and-swap, so neither move is lost (a plain
        // read-modify-write left connections stuck in CLOSE_WAIT). A CPU whose swap failed
        // steps once more from what the other left; its events and counters follow only its
        // own successful swap.
        let claim = match claim_tcp_step(e, dir, p.tcp_flags) {
            Some(c) => c,
            None => claim_tcp_step(e, dir, p.tcp_flags).unwrap_or(Claim {
                to: STEP_IGNORE,
                was: e.state,
                seen_reply,
            }),
        };
        seen_reply = claim.seen_reply;
        match claim.step() {
            TcpStep::To(tcp_state::SYN_SENT) if closed(claim.was) => {
                // A new connection on the same tuple: start over, its SYN sender as originator.
                // A load-balanced connection keeps its backend (and its alias).
                // perf: field by field, the binding left in place (a struct write zeroes the
                // entry with an out-of-line byte loop, `memset`). The kept hops are dropped:
                // ifindex 0 matches no interface (see `route::holds`).
                e.created_ns = now;
                // SAFETY: fields of the live entry; volatile, so LLVM does not merge the
                // zeroing into a `memset` call.
                unsafe {
                    for w in [
                        &raw mut e.last_seen_ns,
                        &raw mut e.packets[0],
                        &raw mut e.packets[1],
                        &raw mut e.bytes[0],
                        &raw mut e.bytes[1],
                    ] {
                        core::ptr::write_volatile(w, 0);
                    }
                }
                e.flags = (e.flags & CT_F_LB) | if src_is_lo { CT_F_ORIG_IS_LO } else { 0 };
                e._pad = 0;
                e.origin = 0;
                e.hops[0].in_ifindex = 0;
                e.hops[1].in_ifindex = 0;
                e.state = tcp_state::SYN_SENT;
                dir = DIR_ORIGINAL;
                count(ct_stat::REOPENED);
                emit(key, ct_event::NEW, e, event_ns());
                let _ = FP_CT_NEW.push(key, BPF_EXIST);
            }
            TcpStep::To(s) => {
                let was = claim.was;
                if was == tcp_state::ESTABLISHED && s != was {
                    // This CPU moved it (a move is swapped in): no copy may serve it now.
                    flowcache::changed(key);
                }
                if !seen_reply && p.tcp_flags & fastpath_common::ct::TCP_RST != 0 {
                    // Linux: "if only reply is a RST, we can consider ourselves not to have an
                    // established connection" — the entry goes at once.
                    count(ct_stat::KILLED);
                    emit(key, ct_event::KILLED, e, event_ns());
                    if e.flags & CT_F_LB != 0 && !closed(was) {
                        stats::backend_closed(e.nat.backend);
                    }
                    remove(key);
                    return None;
                }
                // Assured, as in Linux: a valid ACK in ESTABLISHED after SYN_RECV, or an
                // answer to a connection picked up mid-stream — only once a reply was seen.
                // perf: a plain read first, the atomic only while not assured (an atomic or
                // per established packet cost a locked compare-and-swap loop).
                // Direct server return without replies: assured when established (`step`).
                let dsr_alone =
                    !seen_reply && e.flags & CT_F_DSR != 0 && was == tcp_state::SYN_SENT;
                if (seen_reply || dsr_alone)
                    && s == tcp_state::ESTABLISHED
                    && (was == tcp_state::SYN_RECV || was == tcp_state::ESTABLISHED || dsr_alone)
                    && e.flags & CT_F_ASSURED == 0
                    && set_flag(e, CT_F_ASSURED)
                {
                    count(ct_stat::ASSURED);
                    emit(key, ct_event::ESTABLISHED, e, event_ns());
                }
                if closed(s) && !closed(was) {
                    count(ct_stat::CLOSED);
                    emit(key, ct_event::CLOSED, e, event_ns());
                    if e.flags & CT_F_LB != 0 {
                        stats::backend_closed(e.nat.backend);
                    }
                }
            }
            TcpStep::Ignore => {
                // Accepted, so a reply still counts as seen, with its event (as in Linux:
                // IPCT_REPLY follows any accepted reply), but not accounted.
                count(ct_stat::IGNORED);
                mark_replied(key, e, dir);
                return None;
            }
            TcpStep::Invalid => {
                count(ct_stat::INVALID_STATE);
                return Some(reason::FW_INVALID_STATE);
            }
        }
    } else if p.l4_proto == IPPROTO_UDP
        // saturating: an entry the daemon installed (from an HA peer) carries the precise
        // clock, which runs up to a tick ahead of the coarse one.
        && seen_reply
        && e.flags & CT_F_ASSURED == 0
        && now.saturating_sub(e.created_ns) > UDP_STREAM_AFTER_NS
        && set_flag(e, CT_F_ASSURED)
    {
        // UDP, as in Linux: replied and still active 2 s after it began is a stream. ICMP
        // echo is never assured.
        count(ct_stat::ASSURED);
        emit(key, ct_event::ESTABLISHED, e, event_ns());
    }
    mark_replied(key, e, dir);
    let d = dir & 1;
    e.packets[d] += 1;
    e.bytes[d] += len as u64;
    if last_seen_moves(e.last_seen_ns, now) {
        e.last_seen_ns = now;
    }
    None
}

/// A reply-direction packet the connection accepted: the first one sets `CT_F_SEEN_REPLY`,
/// with a REPLIED event (Linux's IPCT_REPLY) from the CPU whose atomic set it, so every
/// transition has exactly one event.
#[inline(always)]
fn mark_replied(key: &CtKey, e: &mut CtEntry, dir: usize) {
    // perf: an atomic or only the first time (a plain read first).
    if dir == DIR_REPLY && e.flags & CT_F_SEEN_REPLY == 0 && set_flag(e, CT_F_SEEN_REPLY) {
        emit(key, ct_event::REPLIED, e, event_ns());
    }
}

/// A TCP state move this CPU made (see `claim_tcp_step`).
struct Claim {
    /// The new state, or `STEP_IGNORE` / `STEP_INVALID`. verifier: a plain byte, not a
    /// `TcpStep` — an enum's payload is undefined for its other variants, and LLVM copies
    /// such undefined registers, which the verifier refuses to read.
    to: u8,
    /// The state it moved from.
    was: u8,
    /// Whether a reply had been seen then.
    seen_reply: bool,
}

/// `Claim::to` for `TcpStep::Ignore` and `TcpStep::Invalid` (no state is this large).
const STEP_IGNORE: u8 = 0xfe;
const STEP_INVALID: u8 = 0xff;

impl Claim {
    #[inline(always)]
    fn step(&self) -> TcpStep {
        match self.to {
            STEP_IGNORE => TcpStep::Ignore,
            STEP_INVALID => TcpStep::Invalid,
            s => TcpStep::To(s),
        }
    }
}

/// The entry's state, flags and padding: one 8-aligned word (state in its low byte, flags in
/// the next), swapped and or-ed atomically.
#[inline(always)]
fn state_word(e: &mut CtEntry) -> *mut u64 {
    const _: () = assert!(core::mem::offset_of!(CtEntry, state) % 8 == 0);
    const _: () =
        assert!(core::mem::offset_of!(CtEntry, flags) == core::mem::offset_of!(CtEntry, state) + 1);
    (&raw mut e.state).cast::<u64>()
}

/// Steps the TCP state machine from the entry's current state and, for a move, swaps the
/// new state in if nobody changed the word since it was read. `None`: another CPU did (step
/// again). The reopening of a closed connection (SYN in TIME_WAIT/CLOSE) is not swapped: the
/// caller rewrites the entry.
#[inline(always)]
fn claim_tcp_step(e: &mut CtEntry, dir: usize, tcp_flags: u8) -> Option<Claim> {
    let word = state_word(e);
    // SAFETY: an 8-aligned word of a map value (see `state_word`).
    let old = unsafe { core::ptr::read_volatile(word) };
    let (was, flags) = (old as u8, (old >> 8) as u8);
    // verifier: the state indexes the transition table; passed through a volatile stack
    // slot, so the table's bounds check is made on the register the access uses (LLVM would
    // otherwise check a value derived from `old` and index with another).
    let slot = was;
    // SAFETY: a read of a local.
    let indexed = unsafe { core::ptr::read_volatile(&slot) };
    let to = match step(indexed, dir, tcp_flags, flags) {
        TcpStep::To(s) => s,
        TcpStep::Ignore => STEP_IGNORE,
        TcpStep::Invalid => STEP_INVALID,
    };
    let claim = Claim {
        to,
        was,
        seen_reply: flags & CT_F_SEEN_REPLY != 0,
    };
    if to == STEP_IGNORE || to == STEP_INVALID {
        return Some(claim);
    }
    let s = to;
    let reopen =
        s == tcp_state::SYN_SENT && (was == tcp_state::TIME_WAIT || was == tcp_state::CLOSE);
    if reopen || s == was {
        return Some(claim);
    }
    let new = (old & !0xff) | u64::from(s);
    // SAFETY: as above; BPF's compare-and-swap on map memory.
    let (_, swapped) = unsafe {
        core::intrinsics::atomic_cxchg::<
            u64,
            { core::intrinsics::AtomicOrdering::Relaxed },
            { core::intrinsics::AtomicOrdering::Relaxed },
        >(word, old, new)
    };
    swapped.then_some(claim)
}

/// The TCP step of a connection whose entry has `flags`: Linux's table, but for a
/// direct-server-return connection that has seen no reply. Its backend answers the client
/// directly, so this node sees the client's packets only: as IPVS's DR mode does, the client's
/// first plain ACK after its SYN establishes it (the client sends one only once the backend's
/// SYN-ACK reached it). In Linux's table that ACK is invalid in SYN_SENT, and such a
/// connection would stay there, its packets refreshing nothing, until the SYN_SENT timeout
/// removed it under live traffic.
#[inline(always)]
fn step(state: u8, dir: usize, tcp_flags: u8, flags: u8) -> TcpStep {
    if flags & (CT_F_DSR | CT_F_SEEN_REPLY) == CT_F_DSR
        && dir == DIR_ORIGINAL
        && state == tcp_state::SYN_SENT
        && tcp_classify(tcp_flags) == tcp_class::ACK
    {
        return TcpStep::To(tcp_state::ESTABLISHED);
    }
    tcp_step(state, dir, tcp_flags)
}

/// Sets an entry flag atomically (BPF atomic or on the state word); true if this call set it
/// (it was clear), so what follows from it happens once.
#[inline(always)]
fn set_flag(e: &mut CtEntry, flag: u8) -> bool {
    let word = state_word(e);
    // SAFETY: an 8-aligned word of a map value (see `state_word`).
    let old = unsafe {
        core::intrinsics::atomic_or::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(
            word,
            u64::from(flag) << 8,
        )
    };
    (old >> 8) as u8 & flag == 0
}

/// Clears an entry flag atomically (BPF atomic and on the state word).
#[inline(always)]
fn clear_flag(e: &mut CtEntry, flag: u8) {
    let word = state_word(e);
    // SAFETY: an 8-aligned word of a map value (see `state_word`).
    unsafe {
        core::intrinsics::atomic_and::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(
            word,
            !(u64::from(flag) << 8),
        );
    }
}

/// An event's timestamp: the precise monotonic clock (events are rare beside packets, and
/// consecutive events of one connection must be ordered; entries keep the coarse one).
#[inline(always)]
fn event_ns() -> u64 {
    // SAFETY: bpf_ktime_get_ns has no preconditions.
    unsafe { bpf_ktime_get_ns() }
}

/// Writes an event straight into the ring (no stack copy); counts it as lost if full. The
/// daemon is woken only by events written while the unread data is within
/// `CT_EVENTS_WAKE_BYTES..CT_EVENTS_WAKE_END`; otherwise it finds them on its drain timer.
#[inline(always)]
pub(crate) fn emit(key: &CtKey, kind: u8, e: &CtEntry, ts_ns: u64) {
    let unread = FP_CT_EVENTS.query(u64::from(BPF_RB_AVAIL_DATA));
    let wake = if (CT_EVENTS_WAKE_BYTES..CT_EVENTS_WAKE_END).contains(&unread) {
        BPF_RB_FORCE_WAKEUP
    } else {
        BPF_RB_NO_WAKEUP
    };
    let Some(mut slot) = FP_CT_EVENTS.reserve::<CtEvent>(0) else {
        count(ct_stat::EVENTS_LOST);
        return;
    };
    // perf: word stores into the slot. A struct write zeroes the padding with an out-of-line
    // BPF `memset` call (tens of ns where `ret` is mitigated).
    let words = slot.as_mut_ptr().cast::<u64>();
    let key_words = (key as *const CtKey).cast::<u64>();
    let nat_words = (&e.nat as *const CtNat).cast::<u64>();
    // SAFETY: the slot is a reserved, 8-aligned CtEvent (13 words: ts, 5 key words,
    // kind/state/flags and padding, then the 6 words of the NAT binding); CtKey is 5 words and
    // CtNat 6, both 8-aligned. Any bytes are a valid CtEvent.
    unsafe {
        core::ptr::write_volatile(words, ts_ns);
        let mut i = 0;
        while i < 5 {
            core::ptr::write_volatile(words.add(1 + i), core::ptr::read_volatile(key_words.add(i)));
            i += 1;
        }
        core::ptr::write_volatile(
            words.add(6),
            u64::from_ne_bytes([kind, e.state, e.flags, 0, 0, 0, 0, 0]),
        );
        let mut i = 0;
        while i < 6 {
            core::ptr::write_volatile(words.add(7 + i), core::ptr::read_volatile(nat_words.add(i)));
            i += 1;
        }
    }
    slot.submit(u64::from(wake));
}

#[inline(always)]
pub fn count(code: u32) {
    if let Some(c) = FP_CT_STATS.get_ptr_mut(code) {
        // SAFETY: this CPU's slot of a per-CPU array.
        unsafe { *c += 1 };
    }
}
