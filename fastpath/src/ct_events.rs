//! Conntrack events: drained from the datapath's ring buffer into a bounded broadcast that the
//! event log (and later the API watch and HA sync) subscribe to.
//!
//! Contract: the drain never waits on a subscriber. A subscriber that falls behind loses the
//! oldest events and the loss is counted (`lagged`); the ring itself is never left full by a
//! slow reader.

use std::{
    io::Write as _,
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use fastpath_common::ct::{CtEntry, CtEvent, DEFAULT_TIMEOUTS_S, ct_event};
use tokio::sync::broadcast;
use tracing::warn;

use crate::conntrack;

/// How often the daemon drains the event ring. The datapath writes events without waking it
/// (see `fastpath_common::ct::CT_EVENTS_WAKE_BYTES`), so this bounds how late a subscriber
/// sees an event, and each drain takes that period's events in one go.
pub const DRAIN_EVERY: std::time::Duration = std::time::Duration::from_millis(10);
/// The period with HA replication, whose lag to the peers it bounds: a change reaches them
/// within a few ms (`cargo xtask bench -- ha-mesh`). Only a replicating daemon pays its
/// thousand wakeups a second.
pub const DRAIN_EVERY_HA: std::time::Duration = std::time::Duration::from_millis(1);

/// Events buffered per subscriber before it starts losing the oldest.
pub const BROADCAST_CAPACITY: usize = 65_536;

/// Counters of the event path, shared with whoever reports them.
#[derive(Debug, Default)]
pub struct EventStats {
    /// Events read from the ring.
    pub drained: AtomicU64,
    /// Ring records of the wrong size (a datapath/daemon version mismatch), skipped.
    pub malformed: AtomicU64,
    /// Events a subscriber missed because it fell behind.
    pub lagged: AtomicU64,
}

/// The sending side: the drain publishes, subscribers call [`EventHub::subscribe`].
#[derive(Clone)]
pub struct EventHub {
    tx: broadcast::Sender<CtEvent>,
    pub stats: Arc<EventStats>,
}

impl Default for EventHub {
    fn default() -> Self {
        EventHub::new()
    }
}

impl EventHub {
    pub fn new() -> EventHub {
        let (tx, _) = broadcast::channel(BROADCAST_CAPACITY);
        EventHub {
            tx,
            stats: Arc::default(),
        }
    }

    pub fn subscribe(&self) -> broadcast::Receiver<CtEvent> {
        self.tx.subscribe()
    }

    /// Publishes an event produced in userspace (expiry); never blocks.
    pub fn publish(&self, ev: CtEvent) {
        let _ = self.tx.send(ev);
    }

    /// Publishes one ring record; never blocks.
    pub fn publish_record(&self, record: &[u8]) {
        match decode(record) {
            Some(ev) => {
                self.stats.drained.fetch_add(1, Ordering::Relaxed);
                // No subscriber is not an error: the event is simply not wanted now.
                let _ = self.tx.send(ev);
            }
            None => {
                self.stats.malformed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// Where raw event records come from: the datapath's ring buffer (`datapath` implements this
/// for aya's `RingBuf`), or a queue in tests.
pub trait RecordSource {
    /// Passes the oldest record to `f`, then consumes it; false when there is none.
    fn pop_with(&mut self, f: impl FnOnce(&[u8])) -> bool;
}

/// Publishes every record `ring` holds now, oldest first; returns how many it took (malformed
/// ones included). Never blocks: [`drain_next`] says when.
pub fn drain(ring: &mut impl RecordSource, hub: &EventHub) -> usize {
    let mut n = 0;
    while ring.pop_with(|record| hub.publish_record(record)) {
        n += 1;
    }
    n
}

/// The timer of [`drain_next`]: every `period` ([`DRAIN_EVERY`] or [`DRAIN_EVERY_HA`]), a
/// late tick not made up for.
pub fn drain_timer(period: std::time::Duration) -> tokio::time::Interval {
    let mut t = tokio::time::interval(period);
    t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    t
}

/// Waits until the ring is to be drained — the datapath woke its reader (the ring is filling
/// up) or `timer` ([`drain_timer`]) ticked — and drains it into `hub`; returns how many
/// records it took. Cancel-safe: a `select!` branch of the daemon's main loop.
pub async fn drain_next<R: RecordSource + std::os::fd::AsRawFd>(
    ring: &mut tokio::io::unix::AsyncFd<R>,
    timer: &mut tokio::time::Interval,
    hub: &EventHub,
) -> std::io::Result<usize> {
    tokio::select! {
        ready = ring.readable_mut() => {
            let mut guard = ready?;
            let n = drain(guard.get_inner_mut(), hub);
            guard.clear_ready();
            Ok(n)
        }
        _ = timer.tick() => Ok(drain(ring.get_mut(), hub)),
    }
}

/// A `CtEvent` from a ring record, if it has exactly the right size.
pub fn decode(record: &[u8]) -> Option<CtEvent> {
    if record.len() != size_of::<CtEvent>() {
        return None;
    }
    // SAFETY: the length matches and CtEvent is a plain #[repr(C)] struct of integers, valid
    // for any bit pattern; read_unaligned copes with the record's alignment.
    Some(unsafe { std::ptr::read_unaligned(record.as_ptr().cast::<CtEvent>()) })
}

/// The `conntrack -E` name of an event's kind: NEW, UPDATE or DESTROY.
pub fn kind_name(ev: &CtEvent) -> &'static str {
    match ev.kind {
        ct_event::NEW => "NEW",
        ct_event::ESTABLISHED => "UPDATE",
        ct_event::CLOSED | ct_event::REPLIED => "UPDATE",
        ct_event::EXPIRED | ct_event::EARLY_DROP | ct_event::KILLED => "DESTROY",
        _ => "UNKNOWN",
    }
}

/// The connection an event is about, as a table row (no counters).
pub fn event_row(ev: &CtEvent) -> conntrack::CtRow {
    let entry = CtEntry {
        state: ev.state,
        flags: ev.flags,
        ..CtEntry::default()
    };
    conntrack::row(&ev.key, &entry, 0, &DEFAULT_TIMEOUTS_S)
}

/// `conntrack -E -o timestamp`-style line: `[ts] [NEW] tcp 6 SYN_SENT src=.. dst=.. ...`.
pub fn render(ev: &CtEvent) -> String {
    let kind = kind_name(ev);
    let row = event_row(ev);
    let t = &row.original;
    let ports = if row.proto.starts_with("icmp") {
        format!("id={}", t.sport)
    } else {
        format!("sport={} dport={}", t.sport, t.dport)
    };
    let mut line = format!(
        "[{}.{:06}] [{kind}] {} {} ",
        ev.ts_ns / 1_000_000_000,
        (ev.ts_ns % 1_000_000_000) / 1000,
        row.proto,
        row.proto_num
    );
    if !row.state.is_empty() {
        line.push_str(&row.state);
        line.push(' ');
    }
    line.push_str(&format!("src={} dst={} {ports}", t.src, t.dst));
    if row.assured {
        line.push_str(" [ASSURED]");
    }
    line
}

/// Appends every event of `rx` to `path`, one line each, until `stop` turns true (then what
/// is queued is written too: the daemon publishes its last events before it signals the
/// stop) or the hub is dropped. Lag is counted in `stats`.
pub async fn log_to_file(
    mut rx: broadcast::Receiver<CtEvent>,
    stats: Arc<EventStats>,
    path: PathBuf,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let file = match std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
    {
        Ok(f) => f,
        Err(e) => {
            warn!(path = %path.display(), error = %e, "Cannot open the conntrack event log; events will not be logged");
            return;
        }
    };
    let mut out = std::io::BufWriter::new(file);
    let mut write = |ev: &CtEvent, rx: &broadcast::Receiver<CtEvent>| {
        let _ = writeln!(out, "{}", render(ev));
        // Flush when nothing else is queued: batches under load, prompt when idle.
        if rx.is_empty() {
            let _ = out.flush();
        }
    };
    loop {
        let received = tokio::select! {
            r = rx.recv() => r,
            _ = stop.wait_for(|s| *s) => break,
        };
        match received {
            Ok(ev) => write(&ev, &rx),
            Err(broadcast::error::RecvError::Lagged(n)) => {
                stats.lagged.fetch_add(n, Ordering::Relaxed);
            }
            Err(broadcast::error::RecvError::Closed) => break,
        }
    }
    loop {
        match rx.try_recv() {
            Ok(ev) => write(&ev, &rx),
            Err(broadcast::error::TryRecvError::Lagged(n)) => {
                stats.lagged.fetch_add(n, Ordering::Relaxed);
            }
            Err(_) => break,
        }
    }
    drop(write);
    let _ = out.flush();
}

#[cfg(test)]
mod tests {
    use fastpath_common::ct::{CT_F_ASSURED, CT_F_ORIG_IS_LO, CT_F_SEEN_REPLY, ct_key, tcp_state};

    use super::*;

    fn event(kind: u8, state: u8, flags: u8) -> CtEvent {
        let c = [10, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        let s = [10, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        let (key, client_is_lo) = ct_key(4, 6, &c, 40000, &s, 80);
        let orig = if client_is_lo { CT_F_ORIG_IS_LO } else { 0 };
        CtEvent {
            ts_ns: 12_000_345_678,
            key,
            kind,
            state,
            flags: flags | orig,
            _pad: [0; 5],
            nat: Default::default(),
        }
    }

    fn bytes(ev: &CtEvent) -> Vec<u8> {
        // SAFETY: viewing a plain #[repr(C)] struct as bytes.
        unsafe {
            std::slice::from_raw_parts((ev as *const CtEvent).cast::<u8>(), size_of::<CtEvent>())
        }
        .to_vec()
    }

    #[test]
    fn records_round_trip_and_bad_sizes_are_counted() {
        let hub = EventHub::new();
        let mut rx = hub.subscribe();
        let ev = event(ct_event::NEW, tcp_state::SYN_SENT, 0);
        hub.publish_record(&bytes(&ev));
        hub.publish_record(&[0u8; 7]);
        assert_eq!(rx.try_recv().expect("one event"), ev);
        assert!(
            rx.try_recv().is_err(),
            "the short record must not be published"
        );
        assert_eq!(hub.stats.drained.load(Ordering::Relaxed), 1);
        assert_eq!(hub.stats.malformed.load(Ordering::Relaxed), 1);
    }

    /// A ring stand-in: records in arrival order.
    impl RecordSource for std::collections::VecDeque<Vec<u8>> {
        fn pop_with(&mut self, f: impl FnOnce(&[u8])) -> bool {
            match self.pop_front() {
                Some(record) => {
                    f(&record);
                    true
                }
                None => false,
            }
        }
    }

    #[test]
    fn drain_publishes_every_record_in_order_and_empties_the_ring() {
        let hub = EventHub::new();
        let mut rx = hub.subscribe();
        let evs = [
            event(ct_event::NEW, tcp_state::SYN_SENT, 0),
            event(ct_event::ESTABLISHED, tcp_state::ESTABLISHED, CT_F_ASSURED),
            event(ct_event::CLOSED, tcp_state::TIME_WAIT, CT_F_ASSURED),
        ];
        let mut ring: std::collections::VecDeque<Vec<u8>> = evs.iter().map(bytes).collect();
        ring.insert(1, vec![0u8; 3]);
        assert_eq!(
            drain(&mut ring, &hub),
            4,
            "every record is taken, malformed too"
        );
        assert!(ring.is_empty());
        for ev in &evs {
            assert_eq!(rx.try_recv().expect("each event, in ring order"), *ev);
        }
        assert!(rx.try_recv().is_err(), "nothing beyond the ring's events");
        assert_eq!(hub.stats.drained.load(Ordering::Relaxed), 3);
        assert_eq!(hub.stats.malformed.load(Ordering::Relaxed), 1);
        assert_eq!(drain(&mut ring, &hub), 0, "an empty ring drains nothing");
    }

    #[test]
    fn a_slow_subscriber_never_blocks_the_drain() {
        let hub = EventHub::new();
        let mut rx = hub.subscribe();
        let ev = bytes(&event(ct_event::NEW, tcp_state::SYN_SENT, 0));
        for _ in 0..BROADCAST_CAPACITY + 10 {
            hub.publish_record(&ev); // returns at once even though nobody reads
        }
        assert!(matches!(
            rx.try_recv(),
            Err(broadcast::error::TryRecvError::Lagged(10))
        ));
    }

    #[test]
    fn lines_read_like_conntrack_e() {
        let line = render(&event(
            ct_event::ESTABLISHED,
            tcp_state::ESTABLISHED,
            CT_F_ASSURED,
        ));
        assert_eq!(
            line,
            "[12.000345] [UPDATE] tcp 6 ESTABLISHED src=10.0.0.2 dst=10.0.0.1 sport=40000 dport=80 [ASSURED]"
        );
        // The first reply: an UPDATE, as Linux prints its IPCT_REPLY event.
        let line = render(&event(
            ct_event::REPLIED,
            tcp_state::SYN_RECV,
            CT_F_SEEN_REPLY,
        ));
        assert_eq!(
            line,
            "[12.000345] [UPDATE] tcp 6 SYN_RECV src=10.0.0.2 dst=10.0.0.1 sport=40000 dport=80"
        );
    }
}
