//! Conntrack expiry in the daemon: every `gc_interval_ms`, walk the table in batches, delete
//! the connections idle past their state's timeout, publish an EXPIRED event for each, and
//! record the exact occupancy.
//!
//! Why a plain hash with expiry here rather than an LRU map: an LRU evicts whatever it likes
//! when full — established connections included — and says nothing; a hash refuses the new
//! connection instead (counted as `insert_failed`) and the daemon removes only what has timed
//! out, with an event for each. Cost per pass is measured by `cargo xtask bench`.

use std::{
    hash::BuildHasher as _,
    sync::atomic::{AtomicU64, Ordering},
    time::Instant,
};

use fastpath_common::{
    ct::{
        CT_F_LB, CT_F_LB_ALIAS, CT_F_SNAT, CtEntry, CtEvent, CtKey, LAST_SEEN_SLACK_NS, ct_event,
        tcp_state, timeout_of, timeout_slot, with_alias,
    },
    lb::lb_peer_key,
};

use crate::{ct_events::EventHub, datapath::CtOps};

/// After a pass, the daemon waits at least this many times the pass's duration (and at least
/// `gc_interval_ms`) before the next: expiry is bounded to 1/(1+9) = 10% of one CPU.
pub const REST_FACTOR: u32 = 9;

/// What the expiry has seen, for metrics and the CLI.
#[derive(Debug, Default)]
pub struct GcStats {
    /// Entries in the table at the last pass (exact: every entry was read).
    pub occupancy: AtomicU64,
    pub expired_total: AtomicU64,
    pub passes: AtomicU64,
    /// Duration of the last pass, in microseconds.
    pub last_pass_us: AtomicU64,
}

/// Whether `e` has been idle longer than its timeout at `now_ns` (the datapath's clock). The
/// table's stamp may trail the last packet by `LAST_SEEN_SLACK_NS` (the datapath's steps and
/// its flow cache's lease): an entry whose stamp is that much older is not expired early.
pub fn expired(t: &Timeouts, key: &CtKey, e: &CtEntry, now_ns: u64) -> bool {
    let idle = now_ns.saturating_sub(e.last_seen_ns);
    idle > u64::from(timeout_of(t, key, e)) * 1_000_000_000 + LAST_SEEN_SLACK_NS
}

/// Timeouts in seconds, in the `DatapathConfig::ct_timeouts_s` layout.
pub type Timeouts = [u32; timeout_slot::COUNT];

/// One expiry pass. Candidates come from the batched walk; each is read again just before
/// its delete so a packet that refreshed it in between keeps it alive.
pub fn pass(table: &mut impl CtOps, t: &Timeouts, hub: &EventHub, stats: &GcStats, now_ns: u64) {
    let start = Instant::now();
    let mut occupancy = 0u64;
    let mut candidates: Vec<CtKey> = Vec::new();
    // Aliases as (alias, its connection's key), and a fingerprint of every connection the
    // walk saw (a push each: tables without aliases pay no more): an alias whose connection
    // was walked needs no read of its own.
    let mut aliases: Vec<(CtKey, CtKey)> = Vec::new();
    let seed = foldhash::quality::RandomState::default();
    let mut walked_conns: Vec<u64> =
        Vec::with_capacity(stats.occupancy.load(Ordering::Relaxed) as usize);
    let walked = table.walk(&mut |keys, values| {
        occupancy += keys.len() as u64;
        for (k, e) in keys.iter().zip(values) {
            if e.flags & CT_F_LB_ALIAS != 0 {
                // An alias lives as long as its connection's entry (checked below).
                if let Some(conn) = lb_peer_key(k, e) {
                    aliases.push((*k, conn));
                }
            } else {
                walked_conns.push(seed.hash_one(k));
                if expired(t, k, e, now_ns) {
                    candidates.push(*k);
                }
            }
        }
    });
    if let Err(e) = walked {
        tracing::warn!(error = %e, "Conntrack expiry could not walk the table; retrying next pass");
        return;
    }
    // Entries removed (occupancy) and connections expired (aliases are not connections).
    let mut removed = 0u64;
    let mut expired_conns = 0u64;
    for key in &candidates {
        let Some(entry) = table.get(key) else {
            continue;
        };
        // A load-balanced connection lives while its alias sees the backend's packets (the
        // datapath counts an established connection's there alone: `ct::with_alias`).
        // Its alias, if the entry under that tuple still is: once the connection ended, the
        // tuple may have gone to a connection of its own (a direct one from the client's port,
        // or another VIP's to the same backend), which is not this connection's.
        let alias = lb_peer_key(key, &entry).and_then(|a| {
            table
                .get(&a)
                .filter(|e| lb_peer_key(&a, e).as_ref() == Some(key))
                .map(|e| (a, e))
        });
        let seen = match &alias {
            Some((_, e)) => with_alias(&entry, e),
            None => entry,
        };
        if expired(t, key, &seen, now_ns) && table.remove(key) {
            removed += 1;
            expired_conns += 1;
            let ended = key.proto == 6
                && (entry.state == tcp_state::TIME_WAIT || entry.state == tcp_state::CLOSE);
            if entry.flags & CT_F_LB != 0 && entry.flags & CT_F_SNAT == 0 && !ended {
                // It never closed: least-connections stops counting it now.
                table.backend_gone(entry.nat.backend);
            }
            // Its alias goes with it (read above; another connection's entry under that tuple
            // stays).
            if let Some((a, _)) = &alias
                && table.remove(a)
            {
                removed += 1;
            }
            hub.publish(CtEvent {
                ts_ns: now_ns,
                key: *key,
                kind: ct_event::EXPIRED,
                state: entry.state,
                flags: entry.flags,
                _pad: [0; 5],
                nat: entry.nat,
            });
        }
    }
    // Aliases whose connection is gone (dropped early, killed, flushed; one expired above
    // took its alias with it). A connection the walk saw is there (or went with its alias
    // above): no read. Only an alias whose connection the walk did not see is read again —
    // the connection may have been made after the walk passed its bucket. Fingerprints are
    // seeded afresh each pass, so a collision can keep an orphan for one pass at most.
    if !aliases.is_empty() {
        let mut unseen: foldhash::HashSet<u64> = aliases
            .iter()
            .map(|(_, conn)| seed.hash_one(conn))
            .collect();
        for fp in &walked_conns {
            unseen.remove(fp);
        }
        for (key, conn) in &aliases {
            if unseen.contains(&seed.hash_one(conn))
                && table.get(conn).is_none()
                && table.remove(key)
            {
                removed += 1;
            }
        }
    }
    stats
        .occupancy
        .store(occupancy.saturating_sub(removed), Ordering::Relaxed);
    stats
        .expired_total
        .fetch_add(expired_conns, Ordering::Relaxed);
    stats.passes.fetch_add(1, Ordering::Relaxed);
    stats
        .last_pass_us
        .store(start.elapsed().as_micros() as u64, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use fastpath_common::{
        ct::{
            CT_F_ASSURED, CT_F_ORIG_IS_LO, CT_F_SEEN_REPLY, DEFAULT_TIMEOUTS_S, ct_key, tcp_state,
        },
        lb::lb_alias,
    };

    use super::*;
    use crate::{config::CtTimeouts, datapath::fake::FakeCt};

    #[test]
    fn timeouts_follow_state_and_assurance() {
        let t = DEFAULT_TIMEOUTS_S;
        let (tcp, _) = ct_key(4, 6, &[1; 16], 1, &[2; 16], 2);
        let (udp, _) = ct_key(4, 17, &[1; 16], 1, &[2; 16], 2);
        let with = |state, flags| CtEntry {
            state,
            flags,
            ..CtEntry::default()
        };
        assert_eq!(
            timeout_of(&t, &tcp, &with(tcp_state::ESTABLISHED, CT_F_SEEN_REPLY)),
            432_000
        );
        // Picked up mid-stream, no reply yet: capped as in Linux (unacknowledged, 300 s).
        assert_eq!(timeout_of(&t, &tcp, &with(tcp_state::ESTABLISHED, 0)), 300);
        assert_eq!(timeout_of(&t, &tcp, &with(tcp_state::TIME_WAIT, 0)), 120);
        assert_eq!(timeout_of(&t, &tcp, &with(tcp_state::SYN_SENT2, 0)), 120);
        assert_eq!(timeout_of(&t, &udp, &with(0, 0)), 30);
        assert_eq!(timeout_of(&t, &udp, &with(0, CT_F_ASSURED)), 120);
        assert_eq!(CtTimeouts::default().to_slots(), DEFAULT_TIMEOUTS_S);
    }

    #[test]
    fn expiry_is_strictly_after_the_timeout() {
        let t = CtTimeouts {
            udp: 2,
            ..CtTimeouts::default()
        }
        .to_slots();
        let (udp, _) = ct_key(4, 17, &[1; 16], 1, &[2; 16], 2);
        let e = CtEntry {
            last_seen_ns: 10_000_000_000,
            ..CtEntry::default()
        };
        // The timeout plus the stamp's slack (its last packet may have come that much after
        // the stamp).
        let end = 12_000_000_000 + LAST_SEEN_SLACK_NS;
        assert!(
            !expired(&t, &udp, &e, end),
            "not expired at timeout + slack"
        );
        assert!(expired(&t, &udp, &e, end + 1), "expired just after");
        // A clock before last_seen (entry refreshed after `now` was taken) is not expired.
        assert!(!expired(&t, &udp, &e, 1));
    }

    const SEC: u64 = 1_000_000_000;
    /// The pass's clock: long after every entry below was made.
    const NOW: u64 = 1_000_000 * SEC;

    fn v4(a: [u8; 4]) -> [u8; 16] {
        let mut out = [0; 16];
        out[..4].copy_from_slice(&a);
        out
    }

    /// A plain connection from 10.0.0.1:`sport` to 10.0.0.2:`dport`, last seen `idle_s` ago.
    fn plain(proto: u8, sport: u16, dport: u16, state: u8, idle_s: u64) -> (CtKey, CtEntry) {
        let (key, src_is_lo) = ct_key(
            4,
            proto,
            &v4([10, 0, 0, 1]),
            sport,
            &v4([10, 0, 0, 2]),
            dport,
        );
        let entry = CtEntry {
            last_seen_ns: NOW - idle_s * SEC,
            state,
            flags: CT_F_SEEN_REPLY | if src_is_lo { CT_F_ORIG_IS_LO } else { 0 },
            ..CtEntry::default()
        };
        (key, entry)
    }

    /// A load-balanced TCP connection from 10.0.0.1:`sport` to the VIP 10.9.0.1:80, sent to
    /// backend `backend` (10.1.0.`backend`:8080), last seen `idle_s` ago, and its alias.
    fn balanced(sport: u16, state: u8, backend: u8, idle_s: u64) -> [(CtKey, CtEntry); 2] {
        let (key, src_is_lo) = ct_key(4, 6, &v4([10, 0, 0, 1]), sport, &v4([10, 9, 0, 1]), 80);
        let mut entry = CtEntry {
            last_seen_ns: NOW - idle_s * SEC,
            state,
            flags: CT_F_SEEN_REPLY | CT_F_LB | if src_is_lo { CT_F_ORIG_IS_LO } else { 0 },
            ..CtEntry::default()
        };
        entry.nat.addr = v4([10, 1, 0, backend]);
        entry.nat.port = 8080;
        entry.nat.backend = u32::from(backend);
        entry.nat.service = 7;
        let Some(alias) = lb_alias(&key, &entry) else {
            panic!("expected an alias for {key:?}");
        };
        [(key, entry), alias]
    }

    fn table(entries: impl IntoIterator<Item = (CtKey, CtEntry)>) -> FakeCt {
        FakeCt {
            entries: entries.into_iter().collect(),
            ..FakeCt::default()
        }
    }

    /// One pass at NOW with the default timeouts: the events it published, and its stats.
    fn expire(ct: &mut FakeCt) -> (Vec<CtEvent>, GcStats) {
        let hub = EventHub::new();
        let mut events = hub.subscribe();
        let stats = GcStats::default();
        pass(ct, &DEFAULT_TIMEOUTS_S, &hub, &stats, NOW);
        let mut out = Vec::new();
        while let Ok(ev) = events.try_recv() {
            out.push(ev);
        }
        (out, stats)
    }

    #[test]
    fn plain_connections_go_once_idle_past_their_state_timeout() {
        let udp_old = plain(17, 1000, 53, 0, 31);
        let udp_fresh = plain(17, 1001, 53, 0, 29);
        let tcp_established = plain(6, 1002, 22, tcp_state::ESTABLISHED, 3600);
        let tcp_time_wait = plain(6, 1003, 22, tcp_state::TIME_WAIT, 121);
        let mut ct = table([udp_old, udp_fresh, tcp_established, tcp_time_wait]);
        let (events, stats) = expire(&mut ct);
        let left: Vec<CtKey> = ct.entries.keys().copied().collect();
        let mut want = vec![udp_fresh.0, tcp_established.0];
        want.sort();
        assert_eq!(left, want, "entries left after the pass");
        let mut gone: Vec<CtKey> = events.iter().map(|e| e.key).collect();
        gone.sort();
        let mut want_gone = vec![udp_old.0, tcp_time_wait.0];
        want_gone.sort();
        assert_eq!(gone, want_gone, "EXPIRED events");
        assert!(
            events
                .iter()
                .all(|e| e.kind == ct_event::EXPIRED && e.ts_ns == NOW)
        );
        assert_eq!(stats.expired_total.load(Ordering::Relaxed), 2);
        assert_eq!(stats.occupancy.load(Ordering::Relaxed), 2);
        assert!(ct.gone.is_empty(), "no backend counted: {:?}", ct.gone);
    }

    /// An expired load-balanced connection takes its alias with it; one that never closed is
    /// counted gone for least-connections, one that closed (or was SNAT'd) is not. A live
    /// one keeps its alias however old the alias's own timestamp.
    #[test]
    fn load_balanced_connections_expire_with_their_aliases() {
        let open = balanced(2000, tcp_state::ESTABLISHED, 1, 432_001);
        let closed = balanced(2001, tcp_state::TIME_WAIT, 2, 121);
        let mut snat = balanced(2002, tcp_state::ESTABLISHED, 3, 432_001);
        snat[0].1.flags |= CT_F_SNAT;
        let live = balanced(2003, tcp_state::ESTABLISHED, 4, 10);
        let mut ct = table(open.into_iter().chain(closed).chain(snat).chain(live));
        let (events, stats) = expire(&mut ct);
        let left: Vec<CtKey> = ct.entries.keys().copied().collect();
        let mut want = vec![live[0].0, live[1].0];
        want.sort();
        assert_eq!(
            left, want,
            "entries left: the live connection and its alias"
        );
        assert_eq!(
            ct.gone,
            [(1, 1)].into_iter().collect(),
            "backends counted gone: only the one that never closed"
        );
        assert_eq!(events.len(), 3, "one event per connection, none per alias");
        assert_eq!(stats.expired_total.load(Ordering::Relaxed), 3);
        assert_eq!(stats.occupancy.load(Ordering::Relaxed), 2);
    }

    /// A connection whose client has been quiet past the timeout stays while its alias (the
    /// backend's packets, which the datapath counts there alone once established) is fresh.
    #[test]
    fn a_connection_lives_while_its_alias_sees_the_backends_packets() {
        let mut answered = balanced(2010, tcp_state::ESTABLISHED, 1, 432_001);
        answered[1].1.last_seen_ns = NOW - SEC;
        let silent = balanced(2011, tcp_state::ESTABLISHED, 2, 432_001);
        let mut ct = table(answered.into_iter().chain(silent));
        let (events, _) = expire(&mut ct);
        let left: Vec<CtKey> = ct.entries.keys().copied().collect();
        let mut want = vec![answered[0].0, answered[1].0];
        want.sort();
        assert_eq!(
            left, want,
            "the connection whose alias saw a packet 1 s ago stays, with its alias"
        );
        assert_eq!(
            events.iter().map(|e| e.key).collect::<Vec<_>>(),
            [silent[0].0],
            "only the connection silent both ways expires"
        );
    }

    /// An alias whose connection is gone goes; an expired connection's alias tuple that now
    /// belongs to another connection stays.
    #[test]
    fn orphan_aliases_go_and_reused_tuples_stay() {
        let [_, orphan] = balanced(3000, tcp_state::ESTABLISHED, 1, 10);
        let expired = balanced(3001, tcp_state::ESTABLISHED, 2, 432_001);
        // The alias's tuple (client ↔ backend) now holds a direct connection of its own.
        let reused = (
            expired[1].0,
            CtEntry {
                last_seen_ns: NOW,
                state: tcp_state::ESTABLISHED,
                flags: CT_F_SEEN_REPLY,
                ..CtEntry::default()
            },
        );
        let mut ct = table([orphan, expired[0], reused]);
        let (_, stats) = expire(&mut ct);
        let left: Vec<CtKey> = ct.entries.keys().copied().collect();
        assert_eq!(
            left,
            vec![reused.0],
            "only the reused tuple's connection is left"
        );
        assert_eq!(stats.occupancy.load(Ordering::Relaxed), 1);
    }
}
