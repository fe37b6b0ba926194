//! HA replication, the protocol's pure core: how a node numbers the
//! changes it sends, what a peer's cumulative acknowledgement releases, when a peer that fell
//! behind gets a resend from the bounded queue and when it needs a resync instead, how a
//! receiver tells the next change from a duplicate, a gap or a restarted sender, and which of
//! two versions of one connection wins. No I/O and no clock: the sync service (`crate::ha`) drives
//! it, and every rule here is unit-tested.
//!
//! Numbering: a node's changes carry (epoch, seq). The epoch is chosen at the daemon's start
//! and never repeats (the start time in ns); seq starts at 1 in each epoch and grows by one
//! per change. A receiver applies a sender's changes in seq order only, so an older version of
//! a connection never overwrites a newer one from the same sender; across a sender's restart
//! (a new epoch) the snapshot it streams first replaces what the receiver had from it.

use std::collections::{HashMap, VecDeque};

use fastpath_common::{
    ct::{
        CT_F_ASSURED, CT_F_DSR, CT_F_FULL_NAT, CT_F_LB, CT_F_LB_ALIAS, CT_F_ORIG_IS_LO,
        CT_F_SEEN_REPLY, CT_F_SNAT, CtEntry, CtKey,
    },
    lb::{Backend, CtNat, GATEWAY_ID, Service, SvcKey},
};

/// The wire format between peers (`fastpath/proto/fastpath/sync/v1/sync.proto`).
#[allow(clippy::all, clippy::pedantic, missing_docs, rustdoc::all)]
pub mod pb {
    tonic::include_proto!("fastpath.sync.v1");
}

/// Where a change comes from and its place in that sender's stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Stamp {
    pub epoch: u64,
    pub seq: u64,
}

/// The sending side for one peer: changes not yet acknowledged, in order, at most `capacity`.
#[derive(Debug)]
pub struct Outbox<T> {
    epoch: u64,
    /// The seq the next change gets.
    next_seq: u64,
    /// Everything up to and including this was acknowledged.
    acked: u64,
    /// Unacknowledged changes, oldest first, consecutive seqs.
    queue: VecDeque<(u64, T)>,
    capacity: usize,
    /// Changes dropped unacknowledged because the queue was full: a peer that still needs one
    /// of them must resync.
    pub overflowed: u64,
}

/// What a peer that asks for everything after `seq` gets.
#[derive(Debug, PartialEq, Eq)]
pub enum Resend<'a, T> {
    /// These changes, in order.
    Changes(Vec<(u64, &'a T)>),
    /// Some of what it needs is gone from the queue: it needs a snapshot.
    Resync,
}

/// A refused acknowledgement (counted by the caller as a rejected message, never applied).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum AckError {
    #[error("acknowledges seq {got} of epoch {epoch}, but only {sent} were sent")]
    Ahead { epoch: u64, got: u64, sent: u64 },
    #[error("acknowledges epoch {got}, this node is at epoch {epoch}")]
    WrongEpoch { epoch: u64, got: u64 },
}

impl<T> Outbox<T> {
    pub fn new(epoch: u64, capacity: usize) -> Outbox<T> {
        Outbox {
            epoch,
            next_seq: 1,
            acked: 0,
            queue: VecDeque::new(),
            capacity: capacity.max(1),
            overflowed: 0,
        }
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Queues a change; returns its stamp. A full queue drops its oldest change (the datapath
    /// never waits on a peer); a peer that needs it then gets a resync.
    pub fn push(&mut self, change: T) -> Stamp {
        let seq = self.next_seq;
        self.next_seq += 1;
        if self.queue.len() == self.capacity {
            self.queue.pop_front();
            self.overflowed += 1;
        }
        self.queue.push_back((seq, change));
        Stamp {
            epoch: self.epoch,
            seq,
        }
    }

    /// The last seq handed out (0: none yet).
    pub fn last_seq(&self) -> u64 {
        self.next_seq - 1
    }

    /// Changes sent but not acknowledged (the sequence lag).
    pub fn unacked(&self) -> u64 {
        self.last_seq() - self.acked
    }

    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// The oldest change not acknowledged yet (the time lag is its age).
    pub fn oldest(&self) -> Option<&T> {
        self.queue.front().map(|(_, c)| c)
    }

    /// The queued change `seq`, if it is still queued.
    pub fn get(&self, seq: u64) -> Option<&T> {
        let first = self.queue.front()?.0;
        self.queue
            .get(usize::try_from(seq.checked_sub(first)?).ok()?)
            .map(|(_, c)| c)
    }

    /// A cumulative acknowledgement: every change up to `seq` arrived. Returns how many queued
    /// changes it released. Stale acks (at or below an earlier one) release nothing.
    pub fn ack(&mut self, epoch: u64, seq: u64) -> Result<usize, AckError> {
        if epoch != self.epoch {
            return Err(AckError::WrongEpoch {
                epoch: self.epoch,
                got: epoch,
            });
        }
        if seq > self.last_seq() {
            return Err(AckError::Ahead {
                epoch,
                got: seq,
                sent: self.last_seq(),
            });
        }
        if seq <= self.acked {
            return Ok(0);
        }
        self.acked = seq;
        let before = self.queue.len();
        while self.queue.front().is_some_and(|(s, _)| *s <= seq) {
            self.queue.pop_front();
        }
        Ok(before - self.queue.len())
    }

    /// Whether the queue still holds everything after `seq`.
    pub fn can_resend_after(&self, seq: u64) -> bool {
        let first_needed = seq + 1;
        first_needed > self.last_seq()
            || self
                .queue
                .front()
                .is_some_and(|(oldest, _)| *oldest <= first_needed)
    }

    /// What a peer that has everything up to `seq` (of this epoch) needs next.
    pub fn resend_after(&self, seq: u64) -> Resend<'_, T> {
        if !self.can_resend_after(seq) {
            return Resend::Resync;
        }
        Resend::Changes(
            self.queue
                .iter()
                .filter(|(s, _)| *s > seq)
                .map(|(s, c)| (*s, c))
                .collect(),
        )
    }
}

/// What a receiver does with a change stamped `stamp`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The next one in order: apply it.
    Apply,
    /// Already applied (a resend overlapping what arrived): acknowledge, do not apply again.
    Duplicate,
    /// Changes are missing before it: ask for everything after `have`.
    Gap { have: u64 },
    /// From an epoch older than the sender's current one: refuse.
    Stale,
    /// The sender restarted (a newer epoch): what it had sent before is void; ask for a
    /// snapshot.
    NewEpoch,
}

/// The receiving side for one sender.
#[derive(Debug, Default)]
pub struct Inbox {
    /// The sender's epoch and the last seq applied from it.
    at: Option<Stamp>,
}

impl Inbox {
    /// Where this receiver is: the stamp to acknowledge.
    pub fn position(&self) -> Option<Stamp> {
        self.at
    }

    /// Starts (again) from a snapshot taken at `watermark`: the tail follows from
    /// `watermark.seq + 1`.
    pub fn start_at(&mut self, watermark: Stamp) {
        self.at = Some(watermark);
    }

    /// Classifies a change; on `Apply` the position moves to it.
    pub fn accept(&mut self, stamp: Stamp) -> Verdict {
        let Some(at) = self.at else {
            return Verdict::NewEpoch;
        };
        if stamp.epoch < at.epoch {
            return Verdict::Stale;
        }
        if stamp.epoch > at.epoch {
            return Verdict::NewEpoch;
        }
        if stamp.seq <= at.seq {
            return Verdict::Duplicate;
        }
        if stamp.seq > at.seq + 1 {
            return Verdict::Gap { have: at.seq };
        }
        self.at = Some(stamp);
        Verdict::Apply
    }
}

/// Per-connection versions on a receiver: a change is applied only if it is newer than what
/// was applied for that connection (from a snapshot or an earlier change) — resends and a
/// snapshot overlapping the tail are idempotent.
#[derive(Debug)]
pub struct Versions<K> {
    seen: foldhash::HashMap<K, Stamp>,
}

impl<K> Default for Versions<K> {
    fn default() -> Self {
        Versions {
            seen: foldhash::HashMap::default(),
        }
    }
}

impl<K: std::hash::Hash + Eq> Versions<K> {
    /// Whether a change of `key` stamped `stamp` should be applied; records it if so.
    pub fn newer(&mut self, key: K, stamp: Stamp) -> bool {
        match self.seen.get(&key) {
            Some(old) if *old >= stamp => false,
            _ => {
                self.seen.insert(key, stamp);
                true
            }
        }
    }

    /// Forgets a deleted connection once its deletion is applied.
    pub fn forget(&mut self, key: &K) {
        self.seen.remove(key);
    }

    pub fn len(&self) -> usize {
        self.seen.len()
    }

    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}

/// What a receiver does to its own table for one sender's stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action<K, V> {
    Install(K, V),
    Remove(K),
}

/// A received change: an upsert of a connection's entry, or its removal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op<K, V> {
    Upsert(K, V),
    Delete(K),
    /// A change that could not be read (malformed, an unknown service): it takes its place
    /// in the stream, so the stream goes on, but nothing is applied and it is counted.
    Refused,
}

/// The receiving side of one sender's stream, snapshots included: it turns what arrives into
/// table actions and the acknowledgement to send. A snapshot (after a first contact, a resync
/// or the sender's restart) installs every entry it carries and, when done, removes the
/// entries from this sender that it did not carry — a sender's restart or a long cut leaves
/// nothing stale behind. The tail then continues after the snapshot's watermark; its changes
/// are whole entries, so applying one the snapshot already reflected changes nothing.
#[derive(Debug)]
pub struct Receiver<K> {
    inbox: Inbox,
    /// Every key installed from this sender, with the stamp it came with.
    versions: Versions<K>,
    /// During a snapshot: its epoch and the keys it carried so far.
    snapshot: Option<(u64, std::collections::HashSet<K>)>,
    /// Changes refused (out of order while no snapshot is running, a stale epoch).
    pub rejected: u64,
}

impl<K> Default for Receiver<K> {
    fn default() -> Self {
        Receiver {
            inbox: Inbox::default(),
            versions: Versions::default(),
            snapshot: None,
            rejected: 0,
        }
    }
}

/// What the receiver asks the sender for after a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ask {
    /// Acknowledge up to this stamp.
    Ack(Stamp),
    /// Resend everything after this stamp's seq.
    Resend(Stamp),
    /// Send a snapshot.
    Snapshot,
}

impl<K: std::hash::Hash + Eq + Clone> Receiver<K> {
    /// One entry of a snapshot from `epoch`.
    pub fn snapshot_entry<V>(&mut self, epoch: u64, key: K, value: V) -> Vec<Action<K, V>> {
        let fresh = !matches!(&self.snapshot, Some((e, _)) if *e == epoch);
        if fresh {
            self.snapshot = Some((epoch, std::collections::HashSet::new()));
        }
        if let Some((_, carried)) = &mut self.snapshot {
            carried.insert(key.clone());
        }
        self.versions
            .seen
            .insert(key.clone(), Stamp { epoch, seq: 0 });
        vec![Action::Install(key, value)]
    }

    /// The end of a snapshot from `epoch` taken at `watermark`: entries from this sender it
    /// did not carry go; the tail continues after `watermark`.
    pub fn snapshot_done<V>(&mut self, epoch: u64, watermark: u64) -> (Vec<Action<K, V>>, Ask) {
        let carried = match self.snapshot.take() {
            Some((e, carried)) if e == epoch => carried,
            _ => std::collections::HashSet::new(),
        };
        let stale: Vec<K> = self
            .versions
            .seen
            .keys()
            .filter(|k| !carried.contains(*k))
            .cloned()
            .collect();
        for k in &stale {
            self.versions.forget(k);
        }
        for k in &carried {
            self.versions.seen.insert(
                k.clone(),
                Stamp {
                    epoch,
                    seq: watermark,
                },
            );
        }
        let at = Stamp {
            epoch,
            seq: watermark,
        };
        self.inbox.start_at(at);
        (
            stale.into_iter().map(Action::Remove).collect(),
            Ask::Ack(at),
        )
    }

    /// One change of the tail.
    pub fn change<V>(&mut self, stamp: Stamp, op: Op<K, V>) -> (Vec<Action<K, V>>, Ask) {
        match self.inbox.accept(stamp) {
            Verdict::Apply => {
                let action = match op {
                    Op::Upsert(k, v) => {
                        self.versions.seen.insert(k.clone(), stamp);
                        Some(Action::Install(k, v))
                    }
                    Op::Delete(k) => {
                        self.versions.forget(&k);
                        Some(Action::Remove(k))
                    }
                    Op::Refused => {
                        self.rejected += 1;
                        None
                    }
                };
                (action.into_iter().collect(), Ask::Ack(stamp))
            }
            Verdict::Duplicate => (Vec::new(), self.ask()),
            Verdict::Gap { have } => (
                Vec::new(),
                Ask::Resend(Stamp {
                    epoch: stamp.epoch,
                    seq: have,
                }),
            ),
            Verdict::Stale => {
                self.rejected += 1;
                (Vec::new(), self.ask())
            }
            Verdict::NewEpoch => (Vec::new(), Ask::Snapshot),
        }
    }

    /// Where this receiver is, for the periodic acknowledgement an idle stream sends.
    pub fn ask(&self) -> Ask {
        self.inbox.position().map_or(Ask::Snapshot, Ask::Ack)
    }

    /// A key this sender's entries held before this process started (found in the table):
    /// the sender's next snapshot removes it unless it carries it.
    pub fn adopt(&mut self, key: K) {
        self.versions.seen.insert(key, Stamp { epoch: 0, seq: 0 });
    }

    /// The last change applied from this sender (after a snapshot: its watermark).
    pub fn position(&self) -> Option<Stamp> {
        self.inbox.position()
    }

    /// Whether a snapshot of the current epoch completed (the tail follows it).
    pub fn synced(&self) -> bool {
        self.inbox.position().is_some() && self.snapshot.is_none()
    }

    /// Keys installed from this sender.
    pub fn installed(&self) -> usize {
        self.versions.len()
    }
}

/// The sending side of one peer's stream: the outbox and how far the stream has gone. The
/// caller sends `next_batch` while there is any, answers each `Ask` with `on_ask`, and when
/// that says `Snapshot`, streams its whole table and then the watermark it was given.
#[derive(Debug)]
pub struct Sender<T> {
    outbox: Outbox<T>,
    /// Changes up to here were sent on the current stream.
    cursor: u64,
    /// Resyncs sent (the peer was too far behind, new, or restarted).
    pub snapshots: u64,
    /// Resends of part of the queue.
    pub resends: u64,
    /// Asks refused (an ack ahead of what was sent, another epoch).
    pub rejected: u64,
}

/// What the sender sends next.
#[derive(Debug, PartialEq, Eq)]
pub enum Batch<'a, T> {
    Changes(Vec<(Stamp, &'a T)>),
    /// Stream the whole table as a snapshot, then `snapshot_done` with this watermark.
    Snapshot {
        epoch: u64,
        watermark: u64,
    },
}

/// What the sender must do after an ask.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reply {
    /// Carry on with `next_batch`.
    Continue,
    /// Stream the whole table as a snapshot, then `snapshot_done` with this watermark.
    Snapshot { epoch: u64, watermark: u64 },
}

impl<T> Sender<T> {
    pub fn new(epoch: u64, capacity: usize) -> Sender<T> {
        Sender {
            outbox: Outbox::new(epoch, capacity),
            cursor: 0,
            snapshots: 0,
            resends: 0,
            rejected: 0,
        }
    }

    /// A change of this node's table, to be replicated.
    pub fn push(&mut self, change: T) -> Stamp {
        self.outbox.push(change)
    }

    pub fn outbox(&self) -> &Outbox<T> {
        &self.outbox
    }

    /// Up to `max` changes not sent yet on this stream, in order — or, when the queue dropped
    /// some of them before they were sent (changes came faster than the stream took them), a
    /// snapshot to send instead.
    pub fn next_batch(&mut self, max: usize) -> Batch<'_, T> {
        let epoch = self.outbox.epoch();
        if !self.outbox.can_resend_after(self.cursor) {
            let (epoch, watermark) = self.start_snapshot();
            return Batch::Snapshot { epoch, watermark };
        }
        let Resend::Changes(list) = self.outbox.resend_after(self.cursor) else {
            return Batch::Changes(Vec::new());
        };
        let batch: Vec<(Stamp, &T)> = list
            .into_iter()
            .take(max)
            .map(|(seq, c)| (Stamp { epoch, seq }, c))
            .collect();
        if let Some((last, _)) = batch.last() {
            self.cursor = last.seq;
        }
        Batch::Changes(batch)
    }

    /// A stream to the peer (re)starts: it begins with a snapshot.
    pub fn connected(&mut self) -> Reply {
        self.snapshot()
    }

    fn snapshot(&mut self) -> Reply {
        let (epoch, watermark) = self.start_snapshot();
        Reply::Snapshot { epoch, watermark }
    }

    /// A snapshot starts: everything up to the watermark is in the table the caller streams
    /// next. Returns (epoch, watermark).
    fn start_snapshot(&mut self) -> (u64, u64) {
        self.snapshots += 1;
        self.cursor = self.outbox.last_seq();
        (self.outbox.epoch(), self.cursor)
    }

    /// The periodic acknowledgement of an idle stream: what it confirms is released, and if
    /// the peer is behind what was sent (the last changes were lost), they go again.
    pub fn on_idle_ack(&mut self, at: Stamp) -> Reply {
        let reply = self.on_ask(Ask::Ack(at));
        if at.epoch == self.outbox.epoch() && at.seq < self.cursor {
            return self.on_ask(Ask::Resend(at));
        }
        reply
    }

    /// What the peer asked for.
    pub fn on_ask(&mut self, ask: Ask) -> Reply {
        match ask {
            Ask::Ack(at) => {
                if self.outbox.ack(at.epoch, at.seq).is_err() {
                    self.rejected += 1;
                }
                Reply::Continue
            }
            Ask::Resend(at) => {
                if at.epoch != self.outbox.epoch() || at.seq > self.outbox.last_seq() {
                    self.rejected += 1;
                    return Reply::Continue;
                }
                match self.outbox.resend_after(at.seq) {
                    Resend::Changes(_) => {
                        self.resends += 1;
                        self.cursor = at.seq;
                        Reply::Continue
                    }
                    Resend::Resync => self.snapshot(),
                }
            }
            Ask::Snapshot => self.snapshot(),
        }
    }
}

/// The load balancer's numbering on one node: service ids and backend indexes are node-local,
/// so the wire names services by (VIP, port, protocol) and backends by (address, port), and
/// each side maps them with its own index.
#[derive(Debug, Default)]
pub struct LbIndex {
    by_id: HashMap<u32, SvcKey>,
    by_key: HashMap<SvcKey, u32>,
    /// (service id, backend index) → the backend's (address, port), and back.
    backend_at: HashMap<(u32, u32), ([u8; 16], u16)>,
    backend_idx: HashMap<(u32, [u8; 16], u16), u32>,
}

impl LbIndex {
    /// From the services (`FP_SVC`) and the backend array (`FP_BACKENDS`) of a datapath.
    pub fn new(services: &[(SvcKey, Service)], backend: impl Fn(u32) -> Option<Backend>) -> Self {
        let mut ix = LbIndex::default();
        for (k, s) in services {
            ix.by_id.insert(s.id, *k);
            ix.by_key.insert(*k, s.id);
            for i in s.backends_off..s.backends_off.saturating_add(s.backends_len) {
                if let Some(b) = backend(i) {
                    ix.backend_at.insert((s.id, i), (b.addr, b.port));
                    ix.backend_idx.insert((s.id, b.addr, b.port), i);
                }
            }
        }
        ix
    }

    /// This node's id of a service.
    pub fn service_id(&self, key: &SvcKey) -> Option<u32> {
        self.by_key.get(key).copied()
    }
}

/// Why a received connection is refused (counted, never applied).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("family {0}: 4 or 6")]
    Family(u32),
    #[error("protocol {0}: 6, 17, 1 or 58")]
    Protocol(u32),
    #[error("{what}: {len}-byte address for family {family}")]
    Address {
        what: &'static str,
        len: usize,
        family: u8,
    },
    #[error("{what}: port {port} out of range")]
    Port { what: &'static str, port: u32 },
    #[error("TCP state {0} out of range")]
    State(u32),
    #[error("{0} missing")]
    Missing(&'static str),
    #[error("service {0} is not configured on this node")]
    UnknownService(String),
    #[error("backend {backend} is not a backend of service {service} on this node")]
    UnknownBackend { service: String, backend: String },
    #[error("both lb and lb_alias set")]
    Flags,
}

fn parse_endpoint(
    e: Option<&pb::Endpoint>,
    family: u8,
    what: &'static str,
) -> Result<([u8; 16], u16), WireError> {
    let e = e.ok_or(WireError::Missing(what))?;
    let want = if family == 4 { 4 } else { 16 };
    if e.address.len() != want {
        return Err(WireError::Address {
            what,
            len: e.address.len(),
            family,
        });
    }
    let mut addr = [0u8; 16];
    addr[..want].copy_from_slice(&e.address);
    let port = u16::try_from(e.port).map_err(|_| WireError::Port { what, port: e.port })?;
    Ok((addr, port))
}

fn service_text(k: &SvcKey) -> String {
    let len = if k.family == 4 { 4 } else { 16 };
    let mut a = [0u8; 16];
    a[..len].copy_from_slice(&k.vip[..len]);
    let ip: std::net::IpAddr = if k.family == 4 {
        std::net::Ipv4Addr::new(a[0], a[1], a[2], a[3]).into()
    } else {
        std::net::Ipv6Addr::from(a).into()
    };
    format!("{}/{}", std::net::SocketAddr::new(ip, k.port), k.proto)
}

/// A conntrack entry for the wire; `None` for a load-balanced one whose service or backend
/// this node's index does not know (a service being removed: not worth replicating). The
/// message form of what [`WireOp::connection`] writes (for tests and tools; replication sends
/// the bytes).
pub fn to_wire(key: &CtKey, e: &CtEntry, now_ns: u64, ix: &LbIndex) -> Option<pb::Connection> {
    let change: pb::Change =
        prost::Message::decode(WireOp::connection(false, key, e, now_ns, ix)?.0).ok()?;
    match change.op? {
        pb::change::Op::Upsert(c) => Some(c),
        pb::change::Op::Delete(_) => None,
    }
}

/// A received connection as this node's entry (its service and backend numbers, its clock:
/// last seen `idle_ms` before `now_ns`; counters start at zero). Everything is checked; a
/// malformed or unknown one is refused.
pub fn from_wire(
    c: &pb::Connection,
    now_ns: u64,
    ix: &LbIndex,
) -> Result<(CtKey, CtEntry), WireError> {
    let family = match c.family {
        4 => 4u8,
        6 => 6u8,
        other => return Err(WireError::Family(other)),
    };
    let proto = match c.protocol {
        6 | 17 | 1 | 58 => c.protocol as u8,
        other => return Err(WireError::Protocol(other)),
    };
    if c.tcp_state >= u32::from(fastpath_common::ct::tcp_state::COUNT) {
        return Err(WireError::State(c.tcp_state));
    }
    if c.lb && c.lb_alias {
        return Err(WireError::Flags);
    }
    let (addr_lo, port_lo) = parse_endpoint(c.lo.as_ref(), family, "lo")?;
    let (addr_hi, port_hi) = parse_endpoint(c.hi.as_ref(), family, "hi")?;
    let key = CtKey {
        addr_lo,
        addr_hi,
        port_lo,
        port_hi,
        proto,
        family,
        _pad: [0; 2],
    };
    let mut flags = 0u8;
    for (on, bit) in [
        (c.original_is_lo, CT_F_ORIG_IS_LO),
        (c.seen_reply, CT_F_SEEN_REPLY),
        (c.assured, CT_F_ASSURED),
        (c.lb, CT_F_LB),
        (c.lb_alias, CT_F_LB_ALIAS),
        (c.full_nat, CT_F_FULL_NAT),
        (c.snat, CT_F_SNAT),
        (c.dsr, CT_F_DSR),
    ] {
        if on {
            flags |= bit;
        }
    }
    let mut nat = CtNat::default();
    if c.lb || c.lb_alias {
        (nat.addr, nat.port) = parse_endpoint(c.nat.as_ref(), family, "nat")?;
        (nat.addr2, nat.port2) = parse_endpoint(c.nat2.as_ref(), family, "nat2")?;
        if c.gateway {
            (nat.service, nat.backend) = (GATEWAY_ID, GATEWAY_ID);
        } else {
            let s = c.service.as_ref().ok_or(WireError::Missing("service"))?;
            let vip = parse_endpoint(
                Some(&pb::Endpoint {
                    address: s.vip.clone(),
                    port: s.port,
                }),
                family,
                "service",
            )?;
            let svc = SvcKey {
                vip: vip.0,
                port: vip.1,
                proto: u8::try_from(s.protocol).map_err(|_| WireError::Protocol(s.protocol))?,
                family,
                _pad: [0; 4],
            };
            let id = *ix
                .by_key
                .get(&svc)
                .ok_or_else(|| WireError::UnknownService(service_text(&svc)))?;
            let (baddr, bport) = parse_endpoint(c.backend.as_ref(), family, "backend")?;
            let idx = *ix.backend_idx.get(&(id, baddr, bport)).ok_or_else(|| {
                WireError::UnknownBackend {
                    service: service_text(&svc),
                    backend: format!("{:?}:{bport}", &baddr[..if family == 4 { 4 } else { 16 }]),
                }
            })?;
            (nat.service, nat.backend) = (id, idx);
        }
    }
    let last_seen = now_ns.saturating_sub(c.idle_ms.saturating_mul(1_000_000));
    Ok((
        key,
        CtEntry {
            created_ns: last_seen,
            last_seen_ns: last_seen,
            state: c.tcp_state as u8,
            flags,
            nat,
            ..CtEntry::default()
        },
    ))
}

/// A change's operation (`Change.op`: upsert or delete, and the connection), encoded once,
/// when the change is made. A queued change is kept this way: its encoded size (about 80
/// bytes for an IPv4 NAT connection) rather than a message's several heap blocks, and every
/// message carrying it — to each peer, and again on a resend — copies bytes instead of
/// encoding anew.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WireOp(bytes::Bytes);

/// Bytes before a connection's fields in [`WireOp::connection`]'s buffer: room for the
/// change's field key and the connection's length (a connection is under 16 KiB: a 2-byte
/// varint at most).
const OP_PREFIX: usize = 3;

impl WireOp {
    /// The upsert of connection `key` as its entry `e` has it (or, with `delete`, its
    /// removal), written straight from the entry: the bytes prost writes for
    /// `Change { seq: 0, op: Upsert(c) }` (or `Delete(c)`), `c` being the `pb::Connection`
    /// with the fields below, without building one (one allocation, not one per address).
    /// `None` as [`to_wire`].
    pub fn connection(
        delete: bool,
        key: &CtKey,
        e: &CtEntry,
        now_ns: u64,
        ix: &LbIndex,
    ) -> Option<WireOp> {
        use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint};
        let f = |bit: u8| e.flags & bit != 0;
        let lb = f(CT_F_LB) || f(CT_F_LB_ALIAS);
        let gateway = lb && e.nat.service == GATEWAY_ID;
        let (service, backend) = if lb && !gateway {
            let k = ix.by_id.get(&e.nat.service)?;
            let b = ix.backend_at.get(&(e.nat.service, e.nat.backend))?;
            (Some(k), Some(b))
        } else {
            (None, None)
        };
        let alen = if key.family == 4 { 4 } else { 16 };
        // proto3 as prost writes it: fields in number order, scalars only when not zero
        // or false, present messages always.
        fn varint(w: &mut Vec<u8>, tag: u32, v: u64) {
            if v != 0 {
                encode_key(tag, WireType::Varint, w);
                encode_varint(v, w);
            }
        }
        fn varint_len(v: u64) -> usize {
            if v == 0 { 0 } else { 1 + encoded_len_varint(v) }
        }
        // Only ever given an address (4 or 16 bytes): never the empty default prost omits.
        fn bytes(w: &mut Vec<u8>, tag: u32, b: &[u8]) {
            encode_key(tag, WireType::LengthDelimited, w);
            encode_varint(b.len() as u64, w);
            w.extend_from_slice(b);
        }
        fn bytes_len(b: &[u8]) -> usize {
            1 + encoded_len_varint(b.len() as u64) + b.len()
        }
        // Endpoint { address = 1; port = 2 }, ServiceRef { vip = 1; port = 2; protocol = 3 }.
        let message = |w: &mut Vec<u8>, tag: u32, addr: &[u8], port: u16, proto: Option<u8>| {
            let port = u64::from(port);
            let proto = proto.map_or(0, u64::from);
            let len = bytes_len(addr) + varint_len(port) + varint_len(proto);
            encode_key(tag, WireType::LengthDelimited, w);
            encode_varint(len as u64, w);
            bytes(w, 1, addr);
            varint(w, 2, port);
            varint(w, 3, proto);
        };
        // At most: 36 bytes of scalars, 5 endpoints of 9 + alen, a service of 11 + alen.
        let mut w = Vec::with_capacity(OP_PREFIX + 92 + 6 * alen);
        w.resize(OP_PREFIX, 0);
        varint(&mut w, 1, u64::from(key.family));
        varint(&mut w, 2, u64::from(key.proto));
        message(&mut w, 3, &key.addr_lo[..alen], key.port_lo, None);
        message(&mut w, 4, &key.addr_hi[..alen], key.port_hi, None);
        varint(&mut w, 5, u64::from(f(CT_F_ORIG_IS_LO)));
        varint(&mut w, 6, u64::from(e.state));
        for (tag, bit) in [
            (7, CT_F_SEEN_REPLY),
            (8, CT_F_ASSURED),
            (9, CT_F_LB),
            (10, CT_F_LB_ALIAS),
            (11, CT_F_FULL_NAT),
            (12, CT_F_SNAT),
            (13, CT_F_DSR),
        ] {
            varint(&mut w, tag, u64::from(f(bit)));
        }
        varint(
            &mut w,
            14,
            now_ns.saturating_sub(e.last_seen_ns) / 1_000_000,
        );
        if lb {
            message(&mut w, 15, &e.nat.addr[..alen], e.nat.port, None);
            message(&mut w, 16, &e.nat.addr2[..alen], e.nat.port2, None);
        }
        if let Some(k) = service {
            let vlen = if k.family == 4 { 4 } else { 16 };
            message(&mut w, 17, &k.vip[..vlen], k.port, Some(k.proto));
        }
        if let Some((addr, port)) = backend {
            message(&mut w, 18, &addr[..alen], *port, None);
        }
        varint(&mut w, 19, u64::from(gateway));
        // The change's field key and the connection's length, just before the fields.
        let len = (w.len() - OP_PREFIX) as u64;
        let start = OP_PREFIX.checked_sub(1 + encoded_len_varint(len))?;
        let mut head = &mut w[start..OP_PREFIX];
        encode_key(
            if delete { 3 } else { 2 },
            WireType::LengthDelimited,
            &mut head,
        );
        encode_varint(len, &mut head);
        // Shrinking gives the queue back the unused capacity (in place: no copy) and lets the
        // buffer become `Bytes` without a second allocation; `advance`, unlike `slice`, keeps
        // it that way.
        w.shrink_to_fit();
        let mut b = bytes::Bytes::from(w);
        bytes::Buf::advance(&mut b, start);
        Some(WireOp(b))
    }

    pub fn new(op: pb::change::Op) -> WireOp {
        // A `Change` whose seq is 0 encodes its `op` alone (proto3 omits default values).
        WireOp(
            prost::Message::encode_to_vec(&pb::Change {
                seq: 0,
                op: Some(op),
            })
            .into(),
        )
    }
}

/// `Batch.changes` and `Change.seq`, the field numbers `WireBatch` writes itself.
const BATCH_CHANGES: u32 = 3;
const CHANGE_SEQ: u32 = 1;

/// A `pb::Batch` as a node sends it: `head` holds every field but the changes, which are
/// already encoded. The bytes on the wire are exactly a `pb::Batch`'s, so a peer of any
/// version decodes it as one. Send-only: decoding into it skips every field.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WireBatch {
    pub head: pb::Batch,
    /// Each change's seq (0 in a snapshot) and operation.
    pub changes: Vec<(u64, WireOp)>,
}

impl WireBatch {
    /// One change's encoded length, without its field key and length prefix.
    fn change_len(seq: u64, op: &WireOp) -> usize {
        let seq_len = if seq == 0 {
            0
        } else {
            prost::encoding::uint64::encoded_len(CHANGE_SEQ, &seq)
        };
        seq_len + op.0.len()
    }
}

impl prost::Message for WireBatch {
    fn encode_raw(&self, buf: &mut impl bytes::BufMut) {
        use prost::encoding::{WireType, encode_key, encode_varint, uint64};
        self.head.encode_raw(buf);
        for (seq, op) in &self.changes {
            encode_key(BATCH_CHANGES, WireType::LengthDelimited, buf);
            encode_varint(Self::change_len(*seq, op) as u64, buf);
            if *seq != 0 {
                uint64::encode(CHANGE_SEQ, seq, buf);
            }
            buf.put_slice(&op.0);
        }
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: prost::encoding::WireType,
        buf: &mut impl bytes::Buf,
        ctx: prost::encoding::DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        prost::encoding::skip_field(wire_type, tag, buf, ctx)
    }

    fn encoded_len(&self) -> usize {
        use prost::encoding::{encoded_len_varint, key_len};
        let changes: usize = self
            .changes
            .iter()
            .map(|(seq, op)| {
                let len = Self::change_len(*seq, op);
                key_len(BATCH_CHANGES) + encoded_len_varint(len as u64) + len
            })
            .sum();
        self.head.encoded_len() + changes
    }

    fn clear(&mut self) {
        self.head.clear();
        self.changes.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(a: [u8; 4]) -> [u8; 16] {
        let mut x = [0u8; 16];
        x[..4].copy_from_slice(&a);
        x
    }

    /// Service 7 (10.200.0.100:80/TCP, or [2001:db8::64]:80/TCP with `v6`) with backend 3
    /// (10.1.0.2:80 or [2001:db8:1::2]:80).
    fn index(v6: bool) -> LbIndex {
        let (vip, backend) = if v6 {
            let a = |last: u8, net: u8| {
                let mut x = [0u8; 16];
                x[..4].copy_from_slice(&[0x20, 0x01, 0x0d, 0xb8]);
                x[5] = net;
                x[15] = last;
                x
            };
            (a(100, 0), a(2, 1))
        } else {
            (v4([10, 200, 0, 100]), v4([10, 1, 0, 2]))
        };
        let family = if v6 { 6 } else { 4 };
        let key = SvcKey {
            vip,
            port: 80,
            proto: 6,
            family,
            ..SvcKey::default()
        };
        let svc = Service {
            id: 7,
            backends_off: 3,
            backends_len: 1,
            ..Service::default()
        };
        LbIndex::new(&[(key, svc)], |i| {
            (i == 3).then_some(Backend {
                addr: backend,
                port: 80,
                family,
                ..Backend::default()
            })
        })
    }

    #[test]
    fn a_connection_is_written_field_by_field_in_under_96_bytes_for_ipv4_nat() {
        // A load-balanced IPv4 TCP connection in NAT mode, client port past 16383 (a 3-byte
        // varint): every endpoint, the service and the backend.
        let key = CtKey {
            addr_lo: v4([10, 0, 0, 2]),
            addr_hi: v4([10, 200, 0, 100]),
            port_lo: 51234,
            port_hi: 80,
            proto: 6,
            family: 4,
            ..CtKey::default()
        };
        let entry = CtEntry {
            last_seen_ns: 1_000_000_000,
            state: 4,
            flags: CT_F_ORIG_IS_LO | CT_F_SEEN_REPLY | CT_F_ASSURED | CT_F_LB,
            nat: CtNat {
                addr: v4([10, 1, 0, 2]),
                port: 80,
                backend: 3,
                service: 7,
                ..CtNat::default()
            },
            ..CtEntry::default()
        };
        let now = 1_000_000_000 + 999_400_000;
        let op = WireOp::connection(false, &key, &entry, now, &index(false)).expect("known");
        assert!(op.0.len() < 96, "{} bytes", op.0.len());
        let ep = |a: [u8; 4], port: u16| pb::Endpoint {
            address: a.to_vec(),
            port: u32::from(port),
        };
        let want = pb::Connection {
            family: 4,
            protocol: 6,
            lo: Some(ep([10, 0, 0, 2], 51234)),
            hi: Some(ep([10, 200, 0, 100], 80)),
            original_is_lo: true,
            tcp_state: 4,
            seen_reply: true,
            assured: true,
            lb: true,
            idle_ms: 999,
            nat: Some(ep([10, 1, 0, 2], 80)),
            nat2: Some(ep([0, 0, 0, 0], 0)),
            service: Some(pb::ServiceRef {
                vip: vec![10, 200, 0, 100],
                port: 80,
                protocol: 6,
            }),
            backend: Some(ep([10, 1, 0, 2], 80)),
            ..Default::default()
        };
        let got: pb::Change = prost::Message::decode(op.0.clone()).expect("a Change");
        assert_eq!(got.op, Some(pb::change::Op::Upsert(want)));
        // A removal is the same connection under the other field.
        let del = WireOp::connection(true, &key, &entry, now, &index(false)).expect("known");
        assert_eq!(del.0[0], (3 << 3) | 2);
        assert_eq!(del.0[1..], op.0[1..]);
    }

    #[test]
    fn a_written_connection_is_the_bytes_prost_writes_for_it() {
        // Decoded and encoded again by prost, every connection comes back byte for byte: the
        // fields are in order and defaults are left out, as prost (and every proto3 encoder
        // that peers may run) writes them. Over families, modes, flags, states and ports,
        // zero ones included.
        let mut checked = 0;
        for v6 in [false, true] {
            let ix = index(v6);
            let family = if v6 { 6 } else { 4 };
            let addr = |last: u8| {
                let mut a = if v6 { [0x20; 16] } else { v4([10, 0, 0, 0]) };
                a[if v6 { 15 } else { 3 }] = last;
                a
            };
            for flags in [
                0,
                CT_F_ORIG_IS_LO,
                CT_F_SEEN_REPLY | CT_F_ASSURED,
                CT_F_LB | CT_F_ORIG_IS_LO,
                CT_F_LB_ALIAS | CT_F_SEEN_REPLY,
                CT_F_LB | CT_F_FULL_NAT | CT_F_ASSURED,
                CT_F_LB | CT_F_DSR,
                CT_F_LB | CT_F_SNAT,
            ] {
                for (service, ports, state, idle_ns) in [
                    (7, (0, 0), 0, 0),
                    (7, (80, 65535), 4, 5_000_000),
                    (GATEWAY_ID, (1, 127), 9, u64::from(u32::MAX) * 1_000_000),
                ] {
                    let key = CtKey {
                        addr_lo: addr(2),
                        addr_hi: addr(100),
                        port_lo: ports.0,
                        port_hi: ports.1,
                        proto: if v6 { 58 } else { 17 },
                        family,
                        ..CtKey::default()
                    };
                    let entry = CtEntry {
                        last_seen_ns: 7,
                        state,
                        flags,
                        nat: CtNat {
                            addr: addr(9),
                            addr2: addr(10),
                            port: ports.1,
                            port2: ports.0,
                            backend: 3,
                            service,
                            ..CtNat::default()
                        },
                        ..CtEntry::default()
                    };
                    for delete in [false, true] {
                        let op = WireOp::connection(delete, &key, &entry, 7 + idle_ns, &ix)
                            .expect("known service and backend");
                        let change: pb::Change =
                            prost::Message::decode(op.0.clone()).expect("a Change");
                        assert_eq!(
                            prost::Message::encode_to_vec(&change),
                            op.0.to_vec(),
                            "{key:?} {entry:?}"
                        );
                        checked += 1;
                    }
                }
            }
        }
        assert_eq!(checked, 2 * 8 * 3 * 2);
        // A service this node does not know: not written.
        let entry = CtEntry {
            flags: CT_F_LB,
            nat: CtNat {
                service: 8,
                ..CtNat::default()
            },
            ..CtEntry::default()
        };
        let key = CtKey {
            family: 4,
            proto: 6,
            ..CtKey::default()
        };
        assert_eq!(
            WireOp::connection(false, &key, &entry, 0, &index(false)),
            None
        );
    }

    #[test]
    fn wire_batch_is_a_batch() {
        use prost::Message as _;
        let conn = |port: u32| pb::Connection {
            family: 4,
            protocol: 6,
            lo: Some(pb::Endpoint {
                address: vec![10, 0, 0, 1],
                port,
            }),
            hi: Some(pb::Endpoint {
                address: vec![10, 200, 0, 100],
                port: 80,
            }),
            tcp_state: 3,
            lb: true,
            idle_ms: 1234,
            ..Default::default()
        };
        let ops = [
            pb::change::Op::Upsert(conn(40000)),
            pb::change::Op::Delete(conn(40001)),
            pb::change::Op::Upsert(conn(40002)),
        ];
        let head = pb::Batch {
            node_id: 2,
            epoch: 1_700_000_000_000_000_000,
            snapshot: true,
            watermark: 77,
            ..Default::default()
        };
        // Sequence numbers as the tail has them (from 1, past one byte of varint) and as a
        // snapshot has them (0, not written).
        for seqs in [[1u64, 300, 1 << 40], [0, 0, 0]] {
            let wire = WireBatch {
                head: head.clone(),
                changes: seqs
                    .iter()
                    .zip(&ops)
                    .map(|(s, op)| (*s, WireOp::new(op.clone())))
                    .collect(),
            };
            let bytes = wire.encode_to_vec();
            assert_eq!(bytes.len(), wire.encoded_len());
            let expected = pb::Batch {
                changes: seqs
                    .iter()
                    .zip(&ops)
                    .map(|(s, op)| pb::Change {
                        seq: *s,
                        op: Some(op.clone()),
                    })
                    .collect(),
                ..head.clone()
            };
            assert_eq!(pb::Batch::decode(bytes.as_slice()), Ok(expected.clone()));
            assert_eq!(
                bytes.len(),
                expected.encoded_len(),
                "no byte more than prost's"
            );
        }
        let empty = WireBatch {
            head: head.clone(),
            changes: Vec::new(),
        };
        assert_eq!(empty.encode_to_vec(), head.encode_to_vec());
    }

    #[test]
    fn acks_are_cumulative_and_release_in_order() {
        let mut out = Outbox::new(7, 100);
        for i in 0..10 {
            assert_eq!(out.push(i).seq, i + 1);
        }
        assert_eq!(out.unacked(), 10);
        assert_eq!(out.ack(7, 4), Ok(4));
        assert_eq!(out.ack(7, 3), Ok(0), "a stale ack releases nothing");
        assert_eq!(out.unacked(), 6);
        assert_eq!(
            out.ack(7, 11),
            Err(AckError::Ahead {
                epoch: 7,
                got: 11,
                sent: 10
            })
        );
        assert_eq!(
            out.ack(6, 5),
            Err(AckError::WrongEpoch { epoch: 7, got: 6 })
        );
        assert_eq!(out.unacked(), 6, "refused acks change nothing");
        assert_eq!(out.ack(7, 10), Ok(6));
        assert_eq!(out.queued(), 0);
    }

    #[test]
    fn a_peer_behind_gets_the_missing_changes_or_a_resync_past_the_queue() {
        let mut out = Outbox::new(1, 4);
        for i in 1..=6u64 {
            out.push(i * 10);
        }
        // The queue keeps seqs 3..=6; 1 and 2 were dropped unacknowledged.
        assert_eq!(out.overflowed, 2);
        assert_eq!(
            out.resend_after(2),
            Resend::Changes(vec![(3, &30), (4, &40), (5, &50), (6, &60)])
        );
        assert_eq!(
            out.resend_after(4),
            Resend::Changes(vec![(5, &50), (6, &60)])
        );
        assert_eq!(out.resend_after(6), Resend::Changes(vec![]));
        assert_eq!(out.resend_after(1), Resend::Resync, "seq 2 is gone");
        assert_eq!(out.resend_after(0), Resend::Resync);
    }

    #[test]
    fn a_receiver_applies_in_order_and_names_gaps_duplicates_and_restarts() {
        let mut inbox = Inbox::default();
        let s = |epoch, seq| Stamp { epoch, seq };
        assert_eq!(
            inbox.accept(s(5, 1)),
            Verdict::NewEpoch,
            "a first contact starts with a snapshot"
        );
        inbox.start_at(s(5, 100));
        assert_eq!(inbox.accept(s(5, 101)), Verdict::Apply);
        assert_eq!(inbox.accept(s(5, 101)), Verdict::Duplicate);
        assert_eq!(inbox.accept(s(5, 50)), Verdict::Duplicate);
        assert_eq!(inbox.accept(s(5, 104)), Verdict::Gap { have: 101 });
        assert_eq!(inbox.position(), Some(s(5, 101)), "a gap does not move");
        assert_eq!(inbox.accept(s(5, 102)), Verdict::Apply);
        assert_eq!(inbox.accept(s(4, 103)), Verdict::Stale);
        assert_eq!(inbox.accept(s(6, 1)), Verdict::NewEpoch);
        assert_eq!(inbox.position(), Some(s(5, 102)));
    }

    #[test]
    fn an_older_version_never_overwrites_a_newer_one() {
        let mut v = Versions::default();
        let s = |epoch, seq| Stamp { epoch, seq };
        assert!(v.newer("conn-a", s(1, 10)));
        assert!(!v.newer("conn-a", s(1, 10)), "the same change twice");
        assert!(!v.newer("conn-a", s(1, 9)), "an older change");
        assert!(v.newer("conn-a", s(1, 11)));
        assert!(v.newer("conn-a", s(2, 1)), "a newer epoch wins");
        assert!(!v.newer("conn-a", s(1, 500)), "an older epoch loses");
        v.forget(&"conn-a");
        assert!(v.is_empty());
    }

    /// A sender's restart: its new snapshot replaces what the receiver had from it (entries
    /// it no longer has go), then its tail applies in order; duplicates and gaps are named.
    #[test]
    fn a_snapshot_replaces_the_senders_old_state_and_the_tail_follows() {
        let mut rx: Receiver<&str> = Receiver::default();
        let s = |epoch, seq| Stamp { epoch, seq };
        // First contact: a change before any snapshot asks for one.
        assert_eq!(
            rx.change(s(1, 5), Op::Upsert("a", 1)),
            (vec![], Ask::Snapshot)
        );
        assert_eq!(rx.snapshot_entry(1, "a", 1), vec![Action::Install("a", 1)]);
        assert_eq!(rx.snapshot_entry(1, "b", 2), vec![Action::Install("b", 2)]);
        let (removed, ask) = rx.snapshot_done::<i32>(1, 10);
        assert_eq!((removed, ask), (vec![], Ask::Ack(s(1, 10))));
        assert_eq!(
            rx.change(s(1, 11), Op::Upsert("c", 3)),
            (vec![Action::Install("c", 3)], Ask::Ack(s(1, 11)))
        );
        assert_eq!(
            rx.change(s(1, 11), Op::Upsert("c", 3)),
            (vec![], Ask::Ack(s(1, 11))),
            "a duplicate is acknowledged, not applied"
        );
        assert_eq!(
            rx.change(s(1, 13), Op::<&str, i32>::Delete("a")),
            (vec![], Ask::Resend(s(1, 11))),
            "a gap asks for what is missing"
        );
        assert_eq!(
            rx.change(s(1, 12), Op::<&str, i32>::Delete("b")),
            (vec![Action::Remove("b")], Ask::Ack(s(1, 12)))
        );
        assert_eq!(rx.installed(), 2);
        // The sender restarts (epoch 2): its snapshot carries "a" and "d"; "c" is gone.
        assert_eq!(
            rx.change(s(2, 1), Op::Upsert("x", 9)),
            (vec![], Ask::Snapshot)
        );
        rx.snapshot_entry(2, "a", 10);
        rx.snapshot_entry(2, "d", 4);
        let (removed, ask) = rx.snapshot_done::<i32>(2, 7);
        assert_eq!(removed, vec![Action::Remove("c")]);
        assert_eq!(ask, Ask::Ack(s(2, 7)));
        assert_eq!(
            rx.change(s(1, 14), Op::Upsert("z", 0)),
            (vec![], Ask::Ack(s(2, 7))),
            "the old epoch is refused"
        );
        assert_eq!(rx.rejected, 1);
        assert_eq!(
            rx.change(s(2, 8), Op::Upsert("d", 5)),
            (vec![Action::Install("d", 5)], Ask::Ack(s(2, 8)))
        );
        assert_eq!(rx.installed(), 2);
    }

    /// Sender and receiver over a link that loses messages both ways, with a receiver
    /// restart and a queue overflow on the way: once the link is quiet, the receiver's table
    /// equals the sender's, entry for entry — nothing lost, nothing left over.
    #[test]
    fn tables_agree_after_losses_a_restart_and_an_overflow() {
        use std::collections::BTreeMap;
        let mut tx: Sender<Op<u32, u64>> = Sender::new(9, 64);
        let mut table: BTreeMap<u32, u64> = BTreeMap::new();
        let mut rx: Receiver<u32> = Receiver::default();
        let mut replica: BTreeMap<u32, u64> = BTreeMap::new();
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut rand = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let apply = |replica: &mut BTreeMap<u32, u64>, actions: Vec<Action<u32, u64>>| {
            for a in actions {
                match a {
                    Action::Install(k, v) => {
                        replica.insert(k, v);
                    }
                    Action::Remove(k) => {
                        replica.remove(&k);
                    }
                }
            }
        };
        // One exchange: the sender's reply to an ask, a snapshot if needed, then a batch.
        let exchange = |tx: &mut Sender<Op<u32, u64>>,
                        rx: &mut Receiver<u32>,
                        table: &BTreeMap<u32, u64>,
                        replica: &mut BTreeMap<u32, u64>,
                        reply: Reply,
                        lossy: bool,
                        rand: &mut dyn FnMut() -> u64| {
            let mut reply = reply;
            for _ in 0..8 {
                if let Reply::Snapshot { epoch, watermark } = reply {
                    for (k, v) in table {
                        let a = rx.snapshot_entry(epoch, *k, *v);
                        apply(replica, a);
                    }
                    let (a, _) = rx.snapshot_done::<u64>(epoch, watermark);
                    apply(replica, a);
                }
                let batch: Vec<(Stamp, Op<u32, u64>)> = match tx.next_batch(16) {
                    Batch::Changes(list) => list.into_iter().map(|(s, c)| (s, c.clone())).collect(),
                    Batch::Snapshot { epoch, watermark } => {
                        reply = Reply::Snapshot { epoch, watermark };
                        continue;
                    }
                };
                let mut last_ask = None;
                for (stamp, op) in batch {
                    if lossy && rand().is_multiple_of(5) {
                        continue;
                    }
                    let (a, ask) = rx.change(stamp, op);
                    apply(replica, a);
                    last_ask = Some(ask);
                }
                match last_ask {
                    Some(ask) if !(lossy && rand().is_multiple_of(4)) => reply = tx.on_ask(ask),
                    _ => {
                        // Nothing (or the ask) got through: the receiver's position is
                        // asked for again, as a stream's periodic ack does.
                        reply = match rx.ask() {
                            Ask::Ack(at) => tx.on_idle_ack(at),
                            other => tx.on_ask(other),
                        };
                    }
                }
            }
        };
        let reply = tx.connected();
        exchange(
            &mut tx,
            &mut rx,
            &table,
            &mut replica,
            reply,
            false,
            &mut rand,
        );
        for round in 0..300u32 {
            // The table changes.
            for _ in 0..(rand() % 6) {
                let k = (rand() % 40) as u32;
                if rand().is_multiple_of(3) {
                    table.remove(&k);
                    tx.push(Op::Delete(k));
                } else {
                    let v = rand();
                    table.insert(k, v);
                    tx.push(Op::Upsert(k, v));
                }
            }
            if round == 150 {
                // The receiver restarts: empty table, no position.
                rx = Receiver::default();
                replica.clear();
                let reply = tx.connected();
                exchange(
                    &mut tx,
                    &mut rx,
                    &table,
                    &mut replica,
                    reply,
                    true,
                    &mut rand,
                );
            }
            if round == 200 {
                // A burst larger than the queue while the peer is away.
                for i in 0..200u64 {
                    let k = (i % 40) as u32;
                    table.insert(k, i);
                    tx.push(Op::Upsert(k, i));
                }
            }
            exchange(
                &mut tx,
                &mut rx,
                &table,
                &mut replica,
                Reply::Continue,
                true,
                &mut rand,
            );
        }
        // Quiet link: the stream settles.
        for _ in 0..4 {
            exchange(
                &mut tx,
                &mut rx,
                &table,
                &mut replica,
                Reply::Continue,
                false,
                &mut rand,
            );
        }
        eprintln!(
            "rx at {:?}, tx last {} cursor {} acked-unacked {} queued {} snapshots {} resends {} rejected {}",
            rx.ask(),
            tx.outbox().last_seq(),
            tx.cursor,
            tx.outbox().unacked(),
            tx.outbox().queued(),
            tx.snapshots,
            tx.resends,
            tx.rejected
        );
        assert_eq!(replica, table, "the replica equals the table");
        assert!(tx.outbox().overflowed > 0, "the overflow happened");
        assert!(
            tx.snapshots >= 2 && tx.resends > 0,
            "snapshots {}, resends {}",
            tx.snapshots,
            tx.resends
        );
    }

    /// A lossy link, simulated: every change is eventually applied exactly once, in order,
    /// by resending after gaps, whatever is lost.
    #[test]
    fn resends_heal_any_loss_pattern_exactly_once() {
        let mut out = Outbox::new(3, 1000);
        let mut inbox = Inbox::default();
        inbox.start_at(Stamp { epoch: 3, seq: 0 });
        let mut applied = Vec::new();
        let mut lost = 0;
        for i in 0..500u64 {
            let stamp = out.push(i);
            // Lose about one in seven on the first try.
            if (i * 2_654_435_761) % 7 == 0 {
                lost += 1;
                continue;
            }
            match inbox.accept(stamp) {
                Verdict::Apply => applied.push(i),
                Verdict::Gap { have } => {
                    let Resend::Changes(missing) = out.resend_after(have) else {
                        panic!("the queue holds everything");
                    };
                    for (seq, c) in missing {
                        if inbox.accept(Stamp { epoch: 3, seq }) == Verdict::Apply {
                            applied.push(*c);
                        }
                    }
                }
                other => panic!("unexpected {other:?}"),
            }
            if let Some(at) = inbox.position() {
                out.ack(at.epoch, at.seq).expect("a valid ack");
            }
        }
        // The tail: the last losses are found by the next ack exchange.
        if let Some(at) = inbox.position()
            && let Resend::Changes(missing) = out.resend_after(at.seq)
        {
            for (seq, c) in missing {
                if inbox.accept(Stamp { epoch: 3, seq }) == Verdict::Apply {
                    applied.push(*c);
                }
            }
        }
        assert!(lost > 50, "the test loses something: {lost}");
        assert_eq!(applied, (0..500).collect::<Vec<_>>());
    }
}
