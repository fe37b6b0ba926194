//! HA replication in the daemon: this node's conntrack changes streamed to every
//! peer, and every peer's stream installed into this node's datapath, over the `Sync` gRPC
//! service with mutual TLS. The protocol's rules (numbering, acknowledgements, resend or
//! resync, snapshots) are `crate::sync`'s; this module is its I/O.
//!
//! Sending: the conntrack events of this node's datapath (ring buffer → hub) say which
//! connection changed; its entry is read from the table and queued for each peer (a
//! load-balanced connection's alias is not sent: a peer builds it from the entry,
//! `lb::lb_alias`). The datapath never waits: the queues are bounded, and a
//! peer that falls behind them, a lost event (ring or hub overflow) or a new stream gets a
//! snapshot of the table with a watermark, then the tail.
//!
//! Replication runs on its own runtime thread at nice [`NICE`], below packet processing and
//! the management API: on a node with no CPU to spare its queues grow rather than the
//! datapath's latency.
//!
//! Receiving: a peer's entries are installed marked with its node id (`CtEntry::origin`).
//! This node's own traffic owns a connection: an entry it made, or one its packets have
//! touched since it was installed (non-zero counters), is never overwritten or removed by a
//! peer — so after a failover the node that carries a connection is its only writer, and a
//! returning node's stale view cannot undo it.

use std::{
    collections::{HashMap, VecDeque},
    net::SocketAddr,
    path::PathBuf,
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use fastpath_common::{
    ct::{CT_F_LB_ALIAS, CT_RECORD_REMOVE, CtEntry, CtEvent, CtKey, CtRecord, ct_event, ct_stat},
    lb::{lb_alias, lb_peer_key},
    map_names,
};
use rustls_pki_types::ServerName;
use tokio::sync::{Notify, broadcast, mpsc, watch};
use tokio_stream::{Stream, StreamExt as _};
use tonic::{
    Request, Response, Status, Streaming,
    transport::{Certificate, CertificateDer, ClientTlsConfig, Identity, ServerTlsConfig},
};
use tracing::{Instrument as _, info, info_span, warn};

use crate::{
    api::pb as api,
    config::HaSection,
    conntrack,
    datapath::{self, CtTable, DatapathError},
    sync::{
        self, Action, Ask, Batch, LbIndex, Op, Receiver, Reply, Sender, Stamp, WireBatch, WireOp,
        pb,
    },
};

/// Changes per message.
const BATCH: usize = 1024;
/// Acknowledgements whose lag the percentiles cover.
const LAG_SAMPLES: usize = 4096;
/// How often lost ring events are looked for.
const LOSS_POLL: Duration = Duration::from_millis(200);
/// A peer's largest message (a batch of 1024 IPv4 NAT changes is about 90 KiB).
const MAX_MESSAGE_BYTES: usize = 16 << 20;

/// A change queued for the peers, with the datapath time of the event that made it.
#[derive(Clone, Debug)]
struct Pending {
    at_ns: u64,
    op: WireOp,
}

/// This node's stream to one peer.
struct PeerOut {
    address: SocketAddr,
    /// Its `node_id`, and the name its certificate is valid for: its streams into this node
    /// must carry both (see [`Ha::admit`]).
    node_id: u32,
    name: String,
    tls: ClientTlsConfig,
    sender: Mutex<Sender<Pending>>,
    wake: Notify,
    /// Set when events were lost: the next turn of the stream sends a snapshot.
    resync: AtomicBool,
    connected: AtomicBool,
    sent_changes: AtomicU64,
    snapshot_entries: AtomicU64,
    peer_rejected: AtomicU64,
    connects: AtomicU64,
    /// Replication lag of the latest acknowledgements, µs.
    lags: Mutex<VecDeque<u64>>,
    last_error: Mutex<String>,
}

/// One peer's stream to this node (kept across its reconnections).
struct PeerIn {
    rx: Receiver<CtKey>,
    epoch: u64,
    streams: u32,
    received: u64,
    snapshots: u64,
    kept_local: u64,
    /// Entries refused on receipt (malformed, unknown service or backend).
    refused: u64,
    last_message: Option<Instant>,
}

impl PeerIn {
    fn new() -> PeerIn {
        PeerIn {
            rx: Receiver::default(),
            epoch: 0,
            streams: 0,
            received: 0,
            snapshots: 0,
            kept_local: 0,
            refused: 0,
            last_message: None,
        }
    }
}

/// The daemon's replication: shared by the sync service, the peer streams, the event feeder
/// and the API.
pub struct Ha {
    node_id: u32,
    epoch: u64,
    pin_dir: PathBuf,
    peers: Vec<Arc<PeerOut>>,
    inbound: Mutex<HashMap<u32, PeerIn>>,
    table: Mutex<CtTable>,
    lb: watch::Receiver<Arc<LbIndex>>,
    events_lost: AtomicU64,
    /// Messages refused whole (no node id, this node's own id, a node id changing mid-stream).
    rejected_messages: AtomicU64,
}

#[derive(Debug, thiserror::Error)]
pub enum HaError {
    #[error("reading the HA TLS material: {0}")]
    Tls(String),
    #[error(transparent)]
    Datapath(#[from] DatapathError),
    #[error("reading the conntrack table: {0}")]
    Walk(#[source] std::io::Error),
    #[error("starting the HA replication thread: {0}")]
    Runtime(#[source] std::io::Error),
}

/// The nice value of the replication thread(s): below everything at the default 0 (packet
/// processing happens in softirq context and always comes first).
pub const NICE: i32 = 10;

fn lower_priority() {
    // SAFETY: setpriority has no memory preconditions; `who` 0 is the calling thread (Linux
    // keeps a nice value per thread).
    if unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, NICE) } != 0 {
        warn!(
            error = %std::io::Error::last_os_error(),
            "Could not lower the HA replication thread's priority; it runs at the default"
        );
    }
}

/// Replication running on its own runtime (see [`Ha::start`]).
pub struct Running {
    rt: tokio::runtime::Runtime,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Running {
    /// Waits for the tasks to end after `stop` turned true (a stream in the middle of a
    /// snapshot to an unresponsive peer does not hold the stop: it is aborted after twice the
    /// API's grace), then ends the runtime.
    pub async fn stopped(self) {
        for t in self.tasks {
            let abort = t.abort_handle();
            if tokio::time::timeout(2 * crate::api::server::SHUTDOWN_GRACE, t)
                .await
                .is_err()
            {
                abort.abort();
            }
        }
        self.rt.shutdown_background();
    }
}

fn read_pem(p: &std::path::Path) -> Result<Vec<u8>, HaError> {
    std::fs::read(p).map_err(|e| HaError::Tls(format!("{}: {e}", p.display())))
}

/// The sync listener's TLS: this node's certificate, and peers' certificates required.
pub fn server_tls(cfg: &HaSection) -> Result<ServerTlsConfig, HaError> {
    Ok(ServerTlsConfig::new()
        .identity(Identity::from_pem(
            read_pem(cfg.tls_cert.get_ref())?,
            read_pem(cfg.tls_key.get_ref())?,
        ))
        .client_ca_root(Certificate::from_pem(read_pem(cfg.tls_ca.get_ref())?)))
}

/// Whether this node's traffic owns the entry: it made it, or its packets touched it since
/// it was installed. An alias is owned as its connection's entry is.
fn owned_here(table: &CtTable, key: &CtKey, e: &CtEntry) -> bool {
    let own = |e: &CtEntry| e.origin == 0 || e.packets[0] != 0 || e.packets[1] != 0;
    if e.flags & CT_F_LB_ALIAS != 0
        && let Some(main) = lb_peer_key(key, e).and_then(|k| table.get(&k))
    {
        return own(&main);
    }
    own(e)
}

impl Ha {
    /// Replication for `cfg`; entries already in the table from a peer (this process
    /// restarted) are adopted, so that peer's next snapshot removes what it no longer has.
    /// `installer`: the datapath's conntrack installer program (see
    /// [`CtTable::with_installer`]); without it, replicated entries are written one by one.
    pub fn new(
        cfg: &HaSection,
        pin_dir: PathBuf,
        lb: watch::Receiver<Arc<LbIndex>>,
        installer: Option<datapath::CtInstaller>,
    ) -> Result<Arc<Ha>, HaError> {
        let mut table = CtTable::open_pin(&pin_dir.join("maps").join(map_names::CT))?;
        if let Some(installer) = installer {
            table = table.with_installer(installer);
        }
        let mut inbound: HashMap<u32, PeerIn> = HashMap::new();
        let mut adopted = 0usize;
        table
            .walk(|keys, entries| {
                for (k, e) in keys.iter().zip(entries) {
                    // An alias goes with its connection's entry (removing one removes both).
                    if e.origin != 0 && e.flags & CT_F_LB_ALIAS == 0 {
                        inbound
                            .entry(e.origin)
                            .or_insert_with(PeerIn::new)
                            .rx
                            .adopt(*k);
                        adopted += 1;
                    }
                }
            })
            .map_err(HaError::Walk)?;
        if adopted > 0 {
            info!(
                entries = adopted,
                "Adopted connections replicated from peers before this start"
            );
        }
        let epoch = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64);
        let identity = Identity::from_pem(
            read_pem(cfg.tls_cert.get_ref())?,
            read_pem(cfg.tls_key.get_ref())?,
        );
        let ca = Certificate::from_pem(read_pem(cfg.tls_ca.get_ref())?);
        let peers = cfg
            .peers
            .iter()
            .map(|p| {
                let address = *p.address.get_ref();
                let name = p
                    .server_name
                    .as_ref()
                    .map_or_else(|| address.ip().to_string(), |n| n.get_ref().clone());
                Arc::new(PeerOut {
                    address,
                    node_id: *p.node_id.get_ref(),
                    tls: ClientTlsConfig::new()
                        .ca_certificate(ca.clone())
                        .identity(identity.clone())
                        .domain_name(name.clone()),
                    name,
                    sender: Mutex::new(Sender::new(epoch, *cfg.queue.get_ref() as usize)),
                    wake: Notify::new(),
                    resync: AtomicBool::new(false),
                    connected: AtomicBool::new(false),
                    sent_changes: AtomicU64::new(0),
                    snapshot_entries: AtomicU64::new(0),
                    peer_rejected: AtomicU64::new(0),
                    connects: AtomicU64::new(0),
                    lags: Mutex::new(VecDeque::new()),
                    last_error: Mutex::new(String::new()),
                })
            })
            .collect();
        Ok(Arc::new(Ha {
            node_id: *cfg.node_id.get_ref(),
            epoch,
            pin_dir,
            peers,
            inbound: Mutex::new(inbound),
            table: Mutex::new(table),
            lb,
            events_lost: AtomicU64::new(0),
            rejected_messages: AtomicU64::new(0),
        }))
    }

    /// Starts replication on its own runtime thread at a lower CPU priority ([`NICE`]): the
    /// event feeder, one stream per peer and the sync service on `listener`, until `stop`
    /// turns true. Replication then never takes a CPU from packet processing, the
    /// management API or anything else on the node; on a node with no CPU to spare its
    /// queues grow instead, and a peer that falls behind them is resynced.
    pub fn start(
        self: &Arc<Ha>,
        events: broadcast::Receiver<CtEvent>,
        listener: std::net::TcpListener,
        tls: ServerTlsConfig,
        stop: watch::Receiver<bool>,
    ) -> Result<Running, HaError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("fastpath-ha")
            .on_thread_start(lower_priority)
            .enable_all()
            .build()
            .map_err(HaError::Runtime)?;
        let mut tasks = vec![
            rt.spawn(feed(self.clone(), events, stop.clone()).instrument(info_span!("ha_feed"))),
        ];
        for p in &self.peers {
            tasks.push(rt.spawn(peer_stream(self.clone(), p.clone(), stop.clone())));
        }
        let ha = self.clone();
        tasks.push(rt.spawn(async move {
            match tokio::net::TcpListener::from_std(listener) {
                Ok(l) => serve(ha, l, tls, stop).await,
                Err(e) => {
                    warn!(error = %e, "HA sync listener unusable; peers cannot reach this node")
                }
            }
        }));
        Ok(Running { rt, tasks })
    }

    pub fn service(self: &Arc<Ha>) -> pb::sync_server::SyncServer<SyncService> {
        pb::sync_server::SyncServer::new(SyncService(self.clone()))
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES)
    }

    /// Queues the changes `events` describe for every peer. Several events of one
    /// connection in the batch (a short connection's NEW, REPLIED, ESTABLISHED, CLOSED) make
    /// one change: the connection as its last event describes it (state, flags and NAT
    /// binding after that packet: no table read), or its removal if that came last. Every
    /// event but a removal comes from a packet this node's datapath handled, so the entry is
    /// this node's own (`owned_here`).
    fn on_events(&self, events: &[CtEvent]) {
        let ix = self.lb.borrow().clone();
        let now = conntrack::monotonic_ns();
        // Per connection: the first event's time (the lag counts from it) and the last event.
        let mut order: Vec<CtKey> = Vec::with_capacity(events.len());
        let mut last: foldhash::HashMap<CtKey, (u64, &CtEvent)> =
            foldhash::HashMap::with_capacity_and_hasher(events.len(), Default::default());
        for ev in events {
            if !matches!(
                ev.kind,
                ct_event::NEW
                    | ct_event::REPLIED
                    | ct_event::ESTABLISHED
                    | ct_event::CLOSED
                    | ct_event::EXPIRED
                    | ct_event::EARLY_DROP
                    | ct_event::KILLED
            ) || ev.flags & CT_F_LB_ALIAS != 0
            {
                continue;
            }
            last.entry(ev.key)
                .and_modify(|(_, l)| *l = ev)
                .or_insert_with(|| {
                    order.push(ev.key);
                    (ev.ts_ns, ev)
                });
        }
        let mut out = Vec::with_capacity(order.len());
        for key in &order {
            let Some(&(at_ns, ev)) = last.get(key) else {
                continue;
            };
            let removed = matches!(
                ev.kind,
                ct_event::EXPIRED | ct_event::EARLY_DROP | ct_event::KILLED
            );
            // A removal names the connection only.
            let entry = if removed {
                CtEntry::default()
            } else {
                CtEntry {
                    last_seen_ns: ev.ts_ns,
                    state: ev.state,
                    flags: ev.flags,
                    nat: ev.nat,
                    ..CtEntry::default()
                }
            };
            if let Some(op) =
                WireOp::connection(removed, key, &entry, if removed { 0 } else { now }, &ix)
            {
                out.push(Pending { at_ns, op });
            }
        }
        if out.is_empty() {
            return;
        }
        let mut out = Some(out);
        for (i, p) in self.peers.iter().enumerate() {
            // The last peer takes the changes; the others get copies.
            let changes = if i + 1 == self.peers.len() {
                out.take().unwrap_or_default()
            } else {
                out.clone().unwrap_or_default()
            };
            if let Ok(mut s) = p.sender.lock() {
                for c in changes {
                    s.push(c);
                }
            }
            p.wake.notify_one();
        }
    }

    /// Events were lost before replication saw them: every peer resyncs.
    fn lost(&self, n: u64, where_: &str) {
        self.events_lost.fetch_add(n, Ordering::Relaxed);
        warn!(
            lost = n,
            at = where_,
            "Conntrack events were lost before replication saw them; every peer resyncs with a snapshot"
        );
        self.resync_all();
    }

    /// Every peer gets a snapshot next (the table changed in a way no event describes, e.g.
    /// a flush): what they hold from this node becomes what the table holds.
    pub fn resync_all(&self) {
        for p in &self.peers {
            p.resync.store(true, Ordering::Relaxed);
            p.wake.notify_one();
        }
    }

    /// Whether a stream whose first message says it is from node `id`, over a connection
    /// whose client presented `cert`, may be applied: `id` must be a configured peer's and
    /// `cert` valid for that peer's name (the check its server certificate passes when this
    /// node connects to it). The CA alone would let any node it signed send connections as
    /// any other, overwriting theirs.
    fn admit(&self, id: u32, cert: Option<&CertificateDer<'_>>) -> Result<(), String> {
        let Some(peer) = self.peers.iter().find(|p| p.node_id == id) else {
            return Err(format!(
                "node id {id} is no configured peer's: add it to a [[ha.peers]] entry's node_id if that node belongs to this cluster"
            ));
        };
        let name = ServerName::try_from(peer.name.as_str())
            .map_err(|e| format!("node {id}'s name {:?}: {e}", peer.name))?;
        let cert = cert.ok_or_else(|| format!("node {id}'s stream came with no certificate"))?;
        webpki::EndEntityCert::try_from(cert)
            .and_then(|c| c.verify_is_valid_for_subject_name(&name))
            .map_err(|e| {
                format!(
                    "the certificate of the stream that says it is node {id} is not valid for {:?}, the name of node {id}'s [[ha.peers]] entry ({e:?}): a node may send only its own connections",
                    peer.name
                )
            })
    }

    /// Applies one message of `node`'s stream from a client that presented `cert`; returns
    /// the acknowledgement to send, if any (none while a snapshot streams: its end is
    /// acknowledged).
    fn receive(
        &self,
        node: &mut Option<u32>,
        cert: Option<&CertificateDer<'_>>,
        b: pb::Batch,
    ) -> Result<Option<pb::Ack>, String> {
        let id = match u32::try_from(b.node_id) {
            Ok(id) if id != 0 && id != self.node_id => id,
            _ => {
                self.rejected_messages.fetch_add(1, Ordering::Relaxed);
                return Err(format!(
                    "node id {} is not a peer's (0, out of range or this node's own)",
                    b.node_id
                ));
            }
        };
        if node.is_some_and(|n| n != id) {
            self.rejected_messages.fetch_add(1, Ordering::Relaxed);
            return Err(format!("node id changed mid-stream to {id}"));
        }
        let first = node.is_none();
        if first && let Err(e) = self.admit(id, cert) {
            self.rejected_messages.fetch_add(1, Ordering::Relaxed);
            return Err(e);
        }
        *node = Some(id);
        let now = conntrack::monotonic_ns();
        let ix = self.lb.borrow().clone();
        let mut inbound = self.inbound.lock().map_err(|_| "poisoned")?;
        let peer = inbound.entry(id).or_insert_with(PeerIn::new);
        // Counted under the same lock as the batch is applied: `in_sync` never sees the new
        // stream with the previous epoch's completed snapshot.
        if first {
            peer.streams += 1;
        }
        let mut table = self.table.lock().map_err(|_| "poisoned")?;
        peer.last_message = Some(Instant::now());
        peer.epoch = peer.epoch.max(b.epoch);
        let mut ask = None;
        // The message's actions, carried out together: new connections are then created in
        // batches (see `apply`).
        let mut acts = Vec::with_capacity(b.changes.len());
        if b.snapshot {
            for ch in b.changes {
                peer.received += 1;
                match ch.op.map(|op| read_op(op, now, &ix)) {
                    Some(Op::Upsert(k, e)) => acts.push(peer.rx.snapshot_entry(b.epoch, k, e)),
                    _ => peer.refused += 1,
                }
            }
            if b.snapshot_done {
                let (done, a) = peer.rx.snapshot_done(b.epoch, b.watermark);
                acts.extend(done);
                peer.snapshots += 1;
                ask = Some(a);
                info!(
                    node = id,
                    epoch = b.epoch,
                    "A peer's snapshot arrived: its state is here"
                );
            }
        } else {
            for ch in b.changes {
                peer.received += 1;
                let stamp = Stamp {
                    epoch: b.epoch,
                    seq: ch.seq,
                };
                let op = ch.op.map_or(Op::Refused, |op| read_op(op, now, &ix));
                if matches!(op, Op::Refused) {
                    peer.refused += 1;
                }
                let (these, a) = peer.rx.change(stamp, op);
                acts.extend(these);
                ask = Some(a);
                if !matches!(a, Ask::Ack(_)) {
                    break;
                }
            }
        }
        apply(&mut table, peer, id, acts);
        let rejected = peer.rx.rejected + peer.refused;
        Ok(ask.map(|a| {
            let (at, resend, resync) = match a {
                Ask::Ack(at) => (at, false, false),
                Ask::Resend(at) => (at, true, false),
                Ask::Snapshot => (
                    Stamp {
                        epoch: b.epoch,
                        seq: 0,
                    },
                    false,
                    true,
                ),
            };
            pb::Ack {
                node_id: u64::from(self.node_id),
                epoch: at.epoch,
                seq: at.seq,
                resend,
                resync,
                rejected,
            }
        }))
    }

    fn stream_ended(&self, node: Option<u32>) {
        if let (Some(id), Ok(mut inbound)) = (node, self.inbound.lock())
            && let Some(p) = inbound.get_mut(&id)
        {
            p.streams = p.streams.saturating_sub(1);
        }
    }

    /// Whether this node holds every configured peer's state: as many peers stream to it now,
    /// having completed a snapshot of their current epoch (and applied their stream since), as
    /// are configured. A peer whose stream is down is not in sync: its changes since then are
    /// unknown here, and when it restarts, its connections opened meanwhile arrive only with
    /// its next snapshot.
    pub fn in_sync(&self) -> bool {
        let synced = self
            .inbound
            .lock()
            .map(|m| {
                m.values()
                    .filter(|p| p.streams > 0 && p.rx.synced())
                    .count()
            })
            .unwrap_or(0);
        synced >= self.peers.len()
    }

    /// Whether every peer streaming to this node now has its state here (the peers that do
    /// not stream are left out: see [`Ha::in_sync`] for all of them).
    pub fn streaming_in_sync(&self) -> bool {
        self.inbound
            .lock()
            .map(|m| m.values().filter(|p| p.streams > 0).all(|p| p.rx.synced()))
            .unwrap_or(false)
    }

    pub fn status(&self) -> api::HaStatus {
        let now = conntrack::monotonic_ns();
        let peers_out = self
            .peers
            .iter()
            .map(|p| {
                let (queued, last_seq, acked_seq, lag_ms, snapshots, resends, rejected) =
                    match p.sender.lock() {
                        Ok(s) => {
                            let o = s.outbox();
                            (
                                o.queued() as u64,
                                o.last_seq(),
                                o.last_seq() - o.unacked(),
                                o.oldest()
                                    .map_or(0, |c| now.saturating_sub(c.at_ns) / 1_000_000),
                                s.snapshots,
                                s.resends,
                                s.rejected,
                            )
                        }
                        Err(_) => Default::default(),
                    };
                let (p50, p99) = p.lags.lock().map_or((0, 0), |l| percentiles(&l));
                api::HaPeerOut {
                    address: p.address.to_string(),
                    connected: p.connected.load(Ordering::Relaxed),
                    queued,
                    last_seq,
                    acked_seq,
                    lag_ms,
                    lag_p50_us: p50,
                    lag_p99_us: p99,
                    sent_changes: p.sent_changes.load(Ordering::Relaxed),
                    snapshots,
                    snapshot_entries: p.snapshot_entries.load(Ordering::Relaxed),
                    resends,
                    rejected,
                    peer_rejected: p.peer_rejected.load(Ordering::Relaxed),
                    connects: p.connects.load(Ordering::Relaxed),
                    last_error: p.last_error.lock().map(|e| e.clone()).unwrap_or_default(),
                }
            })
            .collect();
        let mut peers_in: Vec<api::HaPeerIn> = self
            .inbound
            .lock()
            .map(|m| {
                m.iter()
                    .map(|(id, p)| api::HaPeerIn {
                        node_id: *id,
                        connected: p.streams > 0,
                        epoch: p.epoch,
                        applied_seq: p.rx.position().map_or(0, |s| s.seq),
                        synced: p.rx.synced(),
                        installed: p.rx.installed() as u64,
                        received_changes: p.received,
                        snapshots: p.snapshots,
                        rejected: p.rx.rejected + p.refused,
                        kept_local: p.kept_local,
                        last_message_ms_ago: p
                            .last_message
                            .map_or(0, |t| t.elapsed().as_millis() as u64),
                    })
                    .collect()
            })
            .unwrap_or_default();
        peers_in.sort_by_key(|p| p.node_id);
        api::HaStatus {
            enabled: true,
            node_id: self.node_id,
            epoch: self.epoch,
            in_sync: self.in_sync(),
            peers_out,
            peers_in,
            events_lost: self.events_lost.load(Ordering::Relaxed),
            rejected_messages: self.rejected_messages.load(Ordering::Relaxed),
        }
    }
}

/// A received change as a table operation; anything malformed is `Refused`.
fn read_op(op: pb::change::Op, now: u64, ix: &LbIndex) -> Op<CtKey, CtEntry> {
    match op {
        pb::change::Op::Upsert(c) => match sync::from_wire(&c, now, ix) {
            Ok((k, e)) => Op::Upsert(k, e),
            Err(_) => Op::Refused,
        },
        pb::change::Op::Delete(c) => match sync::from_wire(&c, now, ix) {
            Ok((k, _)) => Op::Delete(k),
            Err(_) => Op::Refused,
        },
    }
}

/// Carries out a peer's actions on this node's table, in order, this node's own connections
/// kept: written in batches (`CtTable::write_run`: each installed connection's entry and,
/// after it, its alias; each removal); where a write is not the simple case (a key taken, an
/// entry this node touched, no installer program), that connection goes the careful way
/// ([`install`], [`install_alias`], [`remove`]) and the batch resumes after it.
fn apply(table: &mut CtTable, peer: &mut PeerIn, origin: u32, acts: Vec<Action<CtKey, CtEntry>>) {
    // Records, and for each, the action it comes from and whether it is an alias.
    let mut records = Vec::with_capacity(2 * acts.len());
    let mut of = Vec::with_capacity(2 * acts.len());
    for (i, act) in acts.iter().enumerate() {
        match act {
            Action::Install(k, e) => {
                let e = CtEntry { origin, ..*e };
                records.push(CtRecord {
                    key: *k,
                    entry: e,
                    ..CtRecord::default()
                });
                of.push((i, false));
                if let Some((ak, alias)) = lb_alias(k, &e) {
                    records.push(CtRecord {
                        key: ak,
                        entry: alias,
                        ..CtRecord::default()
                    });
                    of.push((i, true));
                }
            }
            Action::Remove(k) => {
                records.push(CtRecord {
                    key: *k,
                    entry: CtEntry {
                        origin,
                        ..CtEntry::default()
                    },
                    op: CT_RECORD_REMOVE,
                    _pad: 0,
                });
                of.push((i, false));
            }
        }
    }
    let mut at = 0;
    while at < records.len() {
        at += table.write_run(&records[at..]);
        let Some(&(i, is_alias)) = of.get(at) else {
            break;
        };
        if is_alias {
            if let Err(err) = install_alias(table, &records[at].key, &records[at].entry) {
                peer.refused += 1;
                warn!(error = %err, "Could not install a replicated connection's alias");
            }
            at += 1;
            continue;
        }
        match acts[i] {
            Action::Install(k, e) => install(table, peer, origin, k, CtEntry { origin, ..e }),
            Action::Remove(k) => remove(table, peer, origin, &k),
        }
        // The careful way took care of the alias too.
        at += 1;
        if of.get(at).is_some_and(|&(j, a)| j == i && a) {
            at += 1;
        }
    }
}

/// Installs one replicated connection (`e.origin` set) and its alias, one write at a time.
fn install(table: &mut CtTable, peer: &mut PeerIn, origin: u32, k: CtKey, e: CtEntry) {
    // Mostly the connection is new here: one write that fails if the key is taken. If it
    // is, this node's own entry is kept and a replicated one is brought up to date.
    // The alias the entry had, when it was replicated from the same peer: its alias was
    // installed with it, and stays right if it would be the same.
    let mut had_alias = None;
    let installed = match table.insert_new(&k, &e) {
        Ok(true) => Ok(()),
        Ok(false) => match table.get(&k) {
            Some(local) if owned_here(table, &k, &local) => {
                peer.kept_local += 1;
                return;
            }
            local => {
                had_alias = local
                    .filter(|l| l.origin == origin)
                    .map(|l| lb_alias(&k, &l));
                table.insert(&k, &e)
            }
        },
        Err(err) => Err(err),
    };
    if let Err(err) = installed {
        peer.refused += 1;
        warn!(error = %err, "Could not install a replicated connection");
        return;
    }
    let alias = lb_alias(&k, &e);
    if had_alias == Some(alias) {
        // A tuple reused with the same binding (a client reopening its port within
        // TIME_WAIT): a write and a read fewer.
        return;
    }
    if let Some((ak, alias)) = alias
        && let Err(err) = install_alias(table, &ak, &alias)
    {
        peer.refused += 1;
        warn!(error = %err, "Could not install a replicated connection's alias");
    }
}

/// Removes a connection replicated from `origin` and its alias, unless this node owns it.
fn remove(table: &mut CtTable, peer: &mut PeerIn, origin: u32, k: &CtKey) {
    let Some(local) = table.get(k) else {
        return;
    };
    if local.origin != origin || owned_here(table, k, &local) {
        peer.kept_local += u64::from(local.origin == origin);
        return;
    }
    let other = lb_peer_key(k, &local);
    table.remove(k);
    if let Some(ok) = other
        && let Some(oe) = table.get(&ok)
        && oe.origin == origin
        && !owned_here(table, &ok, &oe)
    {
        table.remove(&ok);
    }
}

/// Installs the alias a replicated connection's entry implies. Usually it is new; if the key
/// is taken, an alias of the same origin is brought up to date and anything else (this node's
/// own entry on that tuple) is kept.
fn install_alias(table: &mut CtTable, key: &CtKey, alias: &CtEntry) -> Result<(), DatapathError> {
    if table.insert_new(key, alias)? {
        return Ok(());
    }
    match table.get(key) {
        Some(local)
            if local.flags & CT_F_LB_ALIAS != 0
                && local.origin == alias.origin
                && local.nat != alias.nat =>
        {
            table.insert(key, alias)
        }
        _ => Ok(()),
    }
}

fn percentiles(samples: &VecDeque<u64>) -> (u64, u64) {
    if samples.is_empty() {
        return (0, 0);
    }
    let mut v: Vec<u64> = samples.iter().copied().collect();
    v.sort_unstable();
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99))
}

/// The datapath's count of events its ring could not take.
fn ring_lost(pin_dir: &std::path::Path) -> u64 {
    datapath::pinned_ct_stats(pin_dir)
        .ok()
        .and_then(|s| s.get(ct_stat::EVENTS_LOST as usize).copied())
        .unwrap_or(0)
}

/// Conntrack events → changes for the peers; lost events → resyncs.
async fn feed(
    ha: Arc<Ha>,
    mut events: broadcast::Receiver<CtEvent>,
    mut stop: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(LOSS_POLL);
    let mut lost_seen = ring_lost(&ha.pin_dir);
    let mut batch = Vec::with_capacity(BATCH);
    loop {
        tokio::select! {
            ev = events.recv() => {
                match ev {
                    Ok(ev) => batch.push(ev),
                    Err(broadcast::error::RecvError::Lagged(n)) => ha.lost(n, "the event hub"),
                    Err(broadcast::error::RecvError::Closed) => return,
                }
                // Everything the drain published with it: one drain period's events, so a
                // connection's handshake within a period (NEW, REPLIED, ESTABLISHED on a LAN)
                // mostly makes one change. Waiting for more would cost each change that wait
                // (1-2 ms with tokio's timer, more on a busy CPU at this thread's priority).
                while batch.len() < BATCH {
                    match events.try_recv() {
                        Ok(ev) => batch.push(ev),
                        Err(broadcast::error::TryRecvError::Lagged(n)) => ha.lost(n, "the event hub"),
                        Err(_) => break,
                    }
                }
                // Encoded on the replication thread itself: it has nothing else to do
                // meanwhile, and handing the work to another thread costs two context
                // switches per batch.
                if !batch.is_empty() {
                    ha.on_events(&batch);
                    batch.clear();
                }
            }
            _ = tick.tick() => {
                let lost = ring_lost(&ha.pin_dir);
                if lost > lost_seen {
                    ha.lost(lost - lost_seen, "the datapath's event ring");
                }
                lost_seen = lost;
            }
            _ = stop.changed() => return,
        }
    }
}

/// This node's stream to `peer`, reconnected with a backoff until `stop`.
async fn peer_stream(ha: Arc<Ha>, peer: Arc<PeerOut>, mut stop: watch::Receiver<bool>) {
    let mut backoff = Duration::from_millis(100);
    for attempt in 1u64.. {
        let result = run_stream(&ha, &peer, &mut stop)
            .instrument(info_span!("ha_stream_out", peer = %peer.address, attempt))
            .await;
        peer.connected.store(false, Ordering::Relaxed);
        match result {
            Ok(()) => return,
            Err((e, was_connected)) => {
                let changed = peer.last_error.lock().map(|mut last| {
                    let changed = *last != e;
                    *last = e.clone();
                    changed
                });
                if changed.unwrap_or(true) || was_connected {
                    warn!(peer = %peer.address, error = %e, "HA stream to the peer is down; reconnecting");
                }
                if was_connected {
                    backoff = Duration::from_millis(100);
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = stop.changed() => return,
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

type StreamError = (String, bool);

/// One stream: a snapshot, then the tail as it comes, answering acknowledgements. Ok when
/// stopped; otherwise the error and whether the stream had been established.
async fn run_stream(
    ha: &Arc<Ha>,
    peer: &Arc<PeerOut>,
    stop: &mut watch::Receiver<bool>,
) -> Result<(), StreamError> {
    let fail = |what: &str, e: &dyn std::error::Error, up: bool| {
        (
            format!("{what}: {}", crate::api::client::source_text(e)),
            up,
        )
    };
    let endpoint = tonic::transport::Endpoint::from_shared(format!("https://{}", peer.address))
        .map_err(|e| fail("address", &e, false))?
        .tls_config(peer.tls.clone())
        .map_err(|e| fail("TLS settings", &e, false))?
        .connect_timeout(Duration::from_secs(2))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_millis(500))
        .keep_alive_timeout(Duration::from_secs(2))
        .keep_alive_while_idle(true);
    let channel = endpoint
        .connect()
        .await
        .map_err(|e| fail("connecting", &e, false))?;
    let (tx, rx) = mpsc::channel::<WireBatch>(4);
    let mut acks = open_replicate(channel, rx)
        .await
        .map_err(|e| fail("opening the stream", &e, false))?;
    peer.connected.store(true, Ordering::Relaxed);
    peer.connects.fetch_add(1, Ordering::Relaxed);
    if let Ok(mut last) = peer.last_error.lock() {
        last.clear();
    }
    info!(peer = %peer.address, "HA stream to the peer is up; sending a snapshot");
    let lost = |e: &dyn std::error::Error| fail("the stream broke", e, true);
    let closed = || ("the peer closed the stream".to_string(), true);
    let first = peer.sender.lock().ok().map(|mut s| s.connected());
    if let Some(Reply::Snapshot { epoch, watermark }) = first {
        send_snapshot(ha, peer, &tx, epoch, watermark)
            .await
            .map_err(|_| closed())?;
    }
    loop {
        // Everything pending goes out first (a snapshot when one is due).
        loop {
            let snapshot = if peer.resync.swap(false, Ordering::Relaxed) {
                peer.sender.lock().ok().map(|mut s| s.on_ask(Ask::Snapshot))
            } else {
                None
            };
            if let Some(Reply::Snapshot { epoch, watermark }) = snapshot {
                send_snapshot(ha, peer, &tx, epoch, watermark)
                    .await
                    .map_err(|_| closed())?;
                continue;
            }
            let next = match peer.sender.lock() {
                Ok(mut s) => match s.next_batch(BATCH) {
                    Batch::Changes(list) if list.is_empty() => None,
                    Batch::Changes(list) => Some(Ok(WireBatch {
                        head: pb::Batch {
                            node_id: u64::from(ha.node_id),
                            epoch: ha.epoch,
                            ..Default::default()
                        },
                        changes: list
                            .into_iter()
                            .map(|(st, c)| (st.seq, c.op.clone()))
                            .collect(),
                    })),
                    Batch::Snapshot { epoch, watermark } => Some(Err((epoch, watermark))),
                },
                Err(_) => None,
            };
            match next {
                None => break,
                Some(Ok(b)) => {
                    let n = b.changes.len() as u64;
                    tx.send(b).await.map_err(|_| closed())?;
                    peer.sent_changes.fetch_add(n, Ordering::Relaxed);
                }
                Some(Err((epoch, watermark))) => {
                    send_snapshot(ha, peer, &tx, epoch, watermark)
                        .await
                        .map_err(|_| closed())?;
                }
            }
        }
        tokio::select! {
            _ = peer.wake.notified() => {}
            ack = acks.message() => {
                let ack = ack.map_err(|e| lost(&e))?.ok_or_else(closed)?;
                if let Some(Reply::Snapshot { epoch, watermark }) = on_ack(ha, peer, &ack) {
                    send_snapshot(ha, peer, &tx, epoch, watermark).await.map_err(|_| closed())?;
                }
            }
            _ = stop.changed() => return Ok(()),
        }
    }
}

/// Opens `Sync/Replicate` on `channel`, sending `batches`: what the generated client does,
/// with `WireBatch` (already encoded changes) in place of `pb::Batch`.
async fn open_replicate(
    channel: tonic::transport::Channel,
    batches: mpsc::Receiver<WireBatch>,
) -> Result<Streaming<pb::Ack>, Status> {
    let mut grpc = tonic::client::Grpc::new(channel)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(format!("the channel is not ready: {e}")))?;
    let mut request = Request::new(tokio_stream::wrappers::ReceiverStream::new(batches));
    request
        .extensions_mut()
        .insert(tonic::GrpcMethod::new("fastpath.sync.v1.Sync", "Replicate"));
    let path =
        tonic::codegen::http::uri::PathAndQuery::from_static("/fastpath.sync.v1.Sync/Replicate");
    let codec = tonic_prost::ProstCodec::<WireBatch, pb::Ack>::default();
    Ok(grpc.streaming(request, path, codec).await?.into_inner())
}

/// A peer's acknowledgement: releases what it confirms, records the lag, and says whether a
/// snapshot is due.
fn on_ack(ha: &Ha, peer: &PeerOut, ack: &pb::Ack) -> Option<Reply> {
    peer.peer_rejected.store(ack.rejected, Ordering::Relaxed);
    let at = Stamp {
        epoch: ack.epoch,
        seq: ack.seq,
    };
    let ask = if ack.resync {
        Ask::Snapshot
    } else if ack.resend {
        Ask::Resend(at)
    } else {
        Ask::Ack(at)
    };
    let mut s = peer.sender.lock().ok()?;
    if !ack.resync
        && !ack.resend
        && ack.epoch == ha.epoch
        && let Some(c) = s.outbox().get(ack.seq)
    {
        let lag = conntrack::monotonic_ns().saturating_sub(c.at_ns) / 1000;
        if let Ok(mut lags) = peer.lags.lock() {
            if lags.len() == LAG_SAMPLES {
                lags.pop_front();
            }
            lags.push_back(lag);
        }
    }
    match s.on_ask(ask) {
        Reply::Continue => None,
        r @ Reply::Snapshot { .. } => Some(r),
    }
}

/// Streams this node's own connections as a snapshot, then its end with `watermark`.
async fn send_snapshot(
    ha: &Arc<Ha>,
    peer: &Arc<PeerOut>,
    tx: &mpsc::Sender<WireBatch>,
    epoch: u64,
    watermark: u64,
) -> Result<(), ()> {
    let (node_id, pin_dir, ix) = (
        u64::from(ha.node_id),
        ha.pin_dir.clone(),
        ha.lb.borrow().clone(),
    );
    let tx2 = tx.clone();
    let peer2 = peer.clone();
    let sent = tokio::task::spawn_blocking(move || {
        let table = CtTable::open_pin(&pin_dir.join("maps").join(map_names::CT)).map_err(|_| ())?;
        let now = conntrack::monotonic_ns();
        let mut changes = Vec::with_capacity(BATCH);
        let mut ok = true;
        let mut flush = |changes: &mut Vec<(u64, WireOp)>| {
            if changes.is_empty() || !ok {
                return;
            }
            let n = changes.len() as u64;
            let b = WireBatch {
                head: pb::Batch {
                    node_id,
                    epoch,
                    snapshot: true,
                    ..Default::default()
                },
                changes: std::mem::take(changes),
            };
            ok = tx2.blocking_send(b).is_ok();
            peer2.snapshot_entries.fetch_add(n, Ordering::Relaxed);
        };
        let walked = table.walk(|keys, entries| {
            for (k, e) in keys.iter().zip(entries) {
                // Aliases are not sent: the peer builds each from its connection's entry.
                if e.flags & CT_F_LB_ALIAS != 0 || !owned_here(&table, k, e) {
                    continue;
                }
                if let Some(op) = WireOp::connection(false, k, e, now, &ix) {
                    changes.push((0, op));
                }
                if changes.len() >= BATCH {
                    flush(&mut changes);
                }
            }
        });
        flush(&mut changes);
        if walked.is_err() || !ok {
            return Err(());
        }
        Ok(())
    })
    .await;
    if !matches!(sent, Ok(Ok(()))) {
        return Err(());
    }
    tx.send(WireBatch {
        head: pb::Batch {
            node_id,
            epoch,
            snapshot: true,
            snapshot_done: true,
            watermark,
            ..Default::default()
        },
        changes: Vec::new(),
    })
    .await
    .map_err(|_| ())
}

/// The `Sync` gRPC service: peers' streams into this node.
#[derive(Clone)]
pub struct SyncService(Arc<Ha>);

type AckStream = Pin<Box<dyn Stream<Item = Result<pb::Ack, Status>> + Send>>;

#[tonic::async_trait]
impl pb::sync_server::Sync for SyncService {
    type ReplicateStream = AckStream;

    async fn replicate(
        &self,
        request: Request<Streaming<pb::Batch>>,
    ) -> Result<Response<AckStream>, Status> {
        let remote = request.remote_addr();
        // The client's own certificate (its chain's first), which `Ha::admit` checks.
        let cert = request.peer_certs().and_then(|c| c.first().cloned());
        let mut batches = request.into_inner();
        // Acknowledgements are cumulative: only the latest matters, so a slow sender never
        // makes this side wait.
        let (tx, rx) = watch::channel(None::<pb::Ack>);
        let ha = self.0.clone();
        let span = info_span!("ha_stream_in", remote = ?remote);
        tokio::spawn(async move {
            let mut node = None;
            loop {
                match batches.message().await {
                    // Inline on the replication thread, as the feeder's reads.
                    Ok(Some(b)) => match ha.receive(&mut node, cert.as_ref(), b) {
                        Ok(Some(ack)) => {
                            tx.send_replace(Some(ack));
                        }
                        Ok(None) => {}
                        Err(e) => {
                            warn!(peer = ?remote, error = %e, "Refused a peer's HA message; closing its stream");
                            break;
                        }
                    },
                    Ok(None) => break,
                    Err(e) => {
                        info!(peer = ?remote, error = %e, "A peer's HA stream ended");
                        break;
                    }
                }
            }
            ha.stream_ended(node);
        }.instrument(span));
        let acks = tokio_stream::wrappers::WatchStream::new(rx).filter_map(|a| a.map(Ok));
        Ok(Response::new(Box::pin(acks)))
    }
}

/// Serves the sync service on `listener` with mutual TLS until `stop`.
async fn serve(
    ha: Arc<Ha>,
    listener: tokio::net::TcpListener,
    tls: ServerTlsConfig,
    mut stop: watch::Receiver<bool>,
) {
    let server = match tonic::transport::Server::builder()
        .tls_config(tls)
        .map(|b| b.http2_keepalive_interval(Some(Duration::from_millis(500))))
    {
        Ok(b) => b
            .http2_keepalive_timeout(Some(Duration::from_secs(2)))
            .add_service(ha.service()),
        Err(e) => {
            warn!(error = %e, "HA sync listener: TLS settings refused; peers cannot reach this node");
            return;
        }
    };
    // Acknowledgements are small writes: with Nagle's algorithm one waits for the TCP ACK of
    // the one before, which the sender delays (tonic's own `tcp_nodelay` covers only the
    // listeners it binds itself).
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener).map(|s| {
        let s = s?;
        s.set_nodelay(true)?;
        Ok::<_, std::io::Error>(s)
    });
    let mut stopping = stop.clone();
    let task = tokio::spawn(server.serve_with_incoming_shutdown(incoming, async move {
        let _ = stopping.wait_for(|s| *s).await;
    }));
    let _ = stop.wait_for(|s| *s).await;
    // A graceful shutdown waits for every stream to end, and a peer's stream into this node
    // never does: the peers get the API's grace, then their connections are closed (they
    // reconnect to this node's next start, which they get a snapshot from).
    let abort = task.abort_handle();
    match tokio::time::timeout(crate::api::server::SHUTDOWN_GRACE, task).await {
        Ok(Ok(Err(e))) => warn!(error = %e, "HA sync listener failed"),
        Ok(_) => {}
        Err(_) => abort.abort(),
    }
}

/// Through the real datapath (BPF_PROG_TEST_RUN): root only. `cargo xtask test` runs every
/// unit test as root, then again as an unprivileged user skipping the `kernel_tests` modules.
#[cfg(test)]
mod kernel_tests {
    use fastpath_common::ct::{CT_F_LB, IFACE_F_CT_XDP, tcp_state};

    use super::*;
    use crate::testkit::{
        fixture::{Case, Fixture, Seed},
        packet::{Pkt, tcp_flags},
        require_root,
    };

    /// A fixture, and the load-balanced connection a SYN to a two-backend service made in
    /// it (the table then emptied).
    fn lb_connection() -> (Fixture, CtKey, CtEntry) {
        require_root("ha apply");
        let mut fx = Fixture::new().unwrap_or_else(|e| panic!("loading the datapath: {e}"));
        let seed = Seed::iface(1, IFACE_F_CT_XDP).with_services(
            "[[service]]\nvip = \"10.9.0.100\"\nport = 80\nprotocol = \"tcp\"\n\
             [[service.backend]]\naddress = \"10.9.1.1\"\nport = 80\n\
             [[service.backend]]\naddress = \"10.9.1.2\"\nport = 80\n",
        );
        let syn = Case::xdp_to_kernel(
            "syn",
            &seed,
            Pkt::eth()
                .ipv4([10, 9, 2, 1], [10, 9, 0, 100])
                .tcp(1000, 80, tcp_flags::SYN)
                .build(),
        );
        fx.run(&syn).unwrap_or_else(|e| panic!("{e}"));
        let (k, made) = fx
            .ct_entries()
            .unwrap_or_else(|e| panic!("{e}"))
            .into_iter()
            .find(|(_, e)| e.flags & CT_F_LB != 0)
            .expect("the SYN made a load-balanced connection");
        fx.ct_clear().unwrap_or_else(|e| panic!("{e}"));
        (fx, k, made)
    }

    /// A peer's connection installed again (a reused tuple): with the same binding the entry
    /// is brought up to date and its alias kept; with another backend the new alias is made.
    #[test]
    fn a_reinstalled_connection_keeps_or_remakes_its_alias() {
        let (fx, k, made) = lb_connection();
        let mut table = fx.ct_writer().expect("FP_CT and its installer");
        let mut peer = PeerIn::new();
        let replicated = |e: &CtEntry| CtEntry {
            packets: [0; 2],
            bytes: [0; 2],
            origin: 7,
            ..*e
        };
        let alias_of = |e: &CtEntry| lb_alias(&k, &replicated(e)).expect("an LB alias");

        apply(
            &mut table,
            &mut peer,
            7,
            vec![Action::Install(k, replicated(&made))],
        );
        let (ak, alias) = alias_of(&made);
        assert_eq!(table.get(&ak), Some(alias), "the alias is made");

        let closed = CtEntry {
            state: tcp_state::TIME_WAIT,
            ..made
        };
        apply(
            &mut table,
            &mut peer,
            7,
            vec![Action::Install(k, replicated(&closed))],
        );
        assert_eq!(
            table.get(&k),
            Some(replicated(&closed)),
            "brought up to date"
        );
        assert_eq!(
            table.get(&ak),
            Some(alias),
            "the same binding keeps its alias"
        );

        let mut moved = made;
        moved.nat.addr[3] = if made.nat.addr[3] == 1 { 2 } else { 1 };
        let (mk, malias) = alias_of(&moved);
        assert_ne!(mk, ak, "another backend, another alias");
        apply(
            &mut table,
            &mut peer,
            7,
            vec![Action::Install(k, replicated(&moved))],
        );
        assert_eq!(table.get(&k), Some(replicated(&moved)));
        assert_eq!(
            table.get(&mk),
            Some(malias),
            "another backend gets its alias"
        );
        assert_eq!((peer.refused, peer.kept_local), (0, 0));
    }

    /// A message's installs are written in batches by the installer program; every
    /// exception (a key this node owns, an alias key taken, the same connection twice, a
    /// removal between installs) leaves the table exactly as one write at a time does.
    #[test]
    fn batched_writes_match_one_by_one() {
        let (mut fx, k0, made) = lb_connection();
        // The same connection from client port `port`.
        let conn = |port: u16| {
            let mut k = k0;
            if made.flags & fastpath_common::ct::CT_F_ORIG_IS_LO != 0 {
                k.port_lo = port;
            } else {
                k.port_hi = port;
            }
            let e = CtEntry {
                packets: [0; 2],
                bytes: [0; 2],
                origin: 7,
                ..made
            };
            (k, e)
        };
        // 40 connections: 80 records, more than three runs of the installer.
        let mut acts: Vec<Action<CtKey, CtEntry>> = (2000..2040)
            .map(|p| {
                let (k, e) = conn(p);
                Action::Install(k, e)
            })
            .collect();
        let (k5, e5) = conn(2005);
        acts.insert(
            30,
            Action::Install(
                k5,
                CtEntry {
                    state: tcp_state::TIME_WAIT,
                    ..e5
                },
            ),
        );
        acts.insert(20, Action::Remove(conn(2010).0));
        // Removals in a row: connections with their aliases (2001-2004), one whose alias key
        // is this node's (2030), this node's own connection (2020), one never installed
        // (2099), one this node's traffic touched since (2041, seeded), and one named by its
        // alias's key (2006's).
        let (k6, e6) = conn(2006);
        let (ak6, _) = lb_alias(&k6, &e6).expect("an LB alias");
        for p in [2001, 2002, 2030, 2003, 2020, 2099, 2041, 2004] {
            acts.push(Action::Remove(conn(p).0));
        }
        acts.push(Action::Remove(ak6));
        let (k41, e41) = conn(2041);
        let touched41 = CtEntry {
            packets: [1, 0],
            ..e41
        };
        // This node's own: the connection from port 2020, and a connection on the key the
        // alias of port 2030's would take.
        let (k20, e20) = conn(2020);
        let own20 = CtEntry {
            origin: 0,
            packets: [3, 2],
            ..e20
        };
        let (k30, e30) = conn(2030);
        let (ak30, _) = lb_alias(&k30, &e30).expect("an LB alias");
        let own_ak30 = CtEntry {
            origin: 0,
            flags: 0,
            packets: [1, 1],
            ..CtEntry::default()
        };
        let mut outcome = |batched: bool| {
            fx.ct_clear().unwrap_or_else(|e| panic!("{e}"));
            let mut table = if batched {
                fx.ct_writer().expect("FP_CT and its installer")
            } else {
                CtTable::open_pin(&fx.pin_dir().join(map_names::CT)).expect("FP_CT pinned")
            };
            table.insert(&k20, &own20).expect("seeding");
            table.insert(&ak30, &own_ak30).expect("seeding");
            table.insert(&k41, &touched41).expect("seeding");
            let mut peer = PeerIn::new();
            apply(&mut table, &mut peer, 7, acts.clone());
            if batched {
                // 91 records, at most 23 a run, and runs end early at the exceptions.
                assert!(
                    table.installer_runs() >= 4,
                    "{} runs",
                    table.installer_runs()
                );
            }
            (
                fx.ct_entries().unwrap_or_else(|e| panic!("{e}")),
                peer.kept_local,
                peer.refused,
            )
        };
        let (batched, kept, refused) = outcome(true);
        let one_by_one = outcome(false);
        assert_eq!(batched.get(&k20), Some(&own20), "this node's entry is kept");
        assert_eq!(
            batched.get(&ak30),
            Some(&own_ak30),
            "this node's entry is kept"
        );
        assert_eq!(
            batched.get(&k41),
            Some(&touched41),
            "an entry this node's traffic touched is kept"
        );
        let removed = [2001, 2002, 2003, 2004, 2006, 2010, 2030];
        for p in removed {
            assert_eq!(batched.get(&conn(p).0), None, "port {p}'s removed");
        }
        assert_eq!(
            batched.get(&k5).map(|e| e.state),
            Some(tcp_state::TIME_WAIT),
            "the later change wins"
        );
        for p in (2000..2040).filter(|p| !removed.contains(p) && *p != 2020) {
            let (k, e) = conn(p);
            assert!(batched.contains_key(&k), "connection from port {p}");
            let (ak, _) = lb_alias(&k, &e).expect("an LB alias");
            assert!(batched.contains_key(&ak), "alias of port {p}");
        }
        // 32 connections with aliases (the removed ones' aliases went with them, but port
        // 2030's alias key was this node's) and 3 seeded entries.
        assert_eq!(batched.len(), 32 * 2 + 3);
        assert_eq!((kept, refused), (2, 0));
        assert_eq!((batched, kept, refused), one_by_one);
    }
}
