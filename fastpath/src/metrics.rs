//! Prometheus metrics at `/metrics`: HTTP/1.1 (hyper), the text exposition format 0.0.4
//! (`prometheus-client`).
//!
//! A scrape reads everything first into a [`Snapshot`]: datapath counters from the pinned maps,
//! conntrack occupancy from the last expiry pass (exact, every entry read), services and
//! backends with their health from the desired state, HA replication. The snapshot is then
//! encoded as constant metrics by a [`Collector`]: the values live in the kernel's maps and the
//! daemon's state, so nothing is copied into registered metrics. The API's request latencies
//! and status codes are the one set of live metrics ([`ApiLatency`]), recorded on every call.
//!
//! Family names, types and labels are a public interface (dashboards and alerts use them):
//! every name below is the exposed one, `_total` included.

use std::{convert::Infallible, fmt, sync::Arc, sync::atomic::Ordering, time::Duration};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{
    Method, Request, Response, StatusCode,
    body::Incoming,
    header::{ALLOW, CONTENT_TYPE, HeaderValue},
};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::{
    collector::Collector,
    encoding::{
        DescriptorEncoder, EncodeGaugeValue, EncodeLabelSet, EncodeMetric, prometheus_text,
    },
    metrics::{
        MetricType, TypedMetric,
        counter::{ConstCounter, Counter},
        family::Family,
        gauge::ConstGauge,
        histogram::Histogram,
    },
    registry::Registry,
};
use tracing::{debug, warn};

use crate::{
    api::{pb, server::Shared},
    datapath::ServiceRow,
    rules::BackendHealth,
};

/// What can go wrong answering a scrape.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error(
        "encoding the metrics failed; this is a bug in fastpath: please report it with the daemon's log"
    )]
    Encode(#[from] fmt::Error),
}

/// Upper bounds (seconds) of the API latency histogram's buckets (`+Inf` is implicit).
pub const LATENCY_BUCKETS_S: [f64; 12] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 2.5,
];

/// How long a client may take to send its request head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(5);

/// `{method}`: the API method's name, from a fixed set (low cardinality).
type MethodLabels = [(&'static str, &'static str); 1];
/// `{method, code}`: the method and its gRPC status code's name.
type MethodCodeLabels = [(&'static str, &'static str); 2];

/// Latencies and status codes of the management API's requests, by method.
///
/// Clones share the same metrics.
#[derive(Clone, Debug)]
pub struct ApiLatency {
    durations: Family<MethodLabels, Histogram, fn() -> Histogram>,
    requests: Family<MethodCodeLabels, Counter>,
}

fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS_S)
}

impl Default for ApiLatency {
    fn default() -> Self {
        ApiLatency {
            durations: Family::new_with_constructor(latency_histogram as fn() -> Histogram),
            requests: Family::default(),
        }
    }
}

impl ApiLatency {
    /// Counts one request of `method` that took `took` and ended with `code`.
    pub fn record(&self, method: &'static str, took: Duration, code: tonic::Code) {
        self.durations
            .get_or_create(&[("method", method)])
            .observe(took.as_secs_f64());
        self.requests
            .get_or_create(&[
                ("method", method),
                ("code", crate::api::server::code_name(code)),
            ])
            .inc();
    }
}

/// Everything one scrape shows, read before encoding.
#[derive(Debug)]
pub struct Snapshot {
    /// The datapath's counters; `None` when the pinned maps could not be read
    /// (`fastpath_up` 0).
    pub datapath: Option<pb::Stats>,
    /// The daemon's state; `None` while it stops (the rules are gone): the exposition ends
    /// after the datapath's families then.
    pub daemon: Option<DaemonState>,
}

/// The daemon's side of a [`Snapshot`].
#[derive(Debug)]
pub struct DaemonState {
    /// Conntrack entries at the last expiry pass.
    pub conntrack_entries: u64,
    pub conntrack_capacity: u32,
    pub conntrack_expired: u64,
    /// Duration of the last expiry pass, in microseconds.
    pub gc_pass_us: u64,
    /// Conntrack events drained from the ring, malformed, and lost by slow subscribers.
    pub events_drained: u64,
    pub events_malformed: u64,
    pub events_lagged: u64,
    pub desired_generation: u64,
    /// Services (and port forwards) in the desired state.
    pub services: usize,
    /// The pinned services with their backends and counters.
    pub service_rows: Vec<ServiceRow>,
    /// Health of the probed backends.
    pub health: Vec<BackendHealth>,
    pub api: ApiLatency,
    /// HA replication, when configured.
    pub ha: Option<pb::HaStatus>,
    /// Announcements, when configured: readiness, drain, and the routes in the table.
    pub announce: Option<crate::announce::Status>,
}

/// Reads what a scrape shows: the pinned maps off the async threads, then the daemon's state.
pub async fn snapshot(shared: &Arc<Shared>) -> Snapshot {
    let pin = shared.pin_dir.clone();
    let datapath =
        match tokio::task::spawn_blocking(move || crate::api::read::stats(&pin, true)).await {
            Ok(Ok(s)) => Some(s),
            Ok(Err(e)) => {
                warn!(error = %e, "Reading the datapath's counters for /metrics failed");
                None
            }
            Err(e) => {
                warn!(error = %e, "The task reading the datapath's counters for /metrics failed");
                None
            }
        };
    let Ok(rules) = shared.rules().await else {
        return Snapshot {
            datapath,
            daemon: None,
        };
    };
    let (conntrack_capacity, desired_generation, health, services) = (
        *rules.config().conntrack.capacity.get_ref(),
        rules.generation(),
        rules.health(),
        rules.config().services.len(),
    );
    drop(rules);
    let pin = shared.pin_dir.clone();
    let service_rows = tokio::task::spawn_blocking(move || crate::datapath::pinned_services(&pin))
        .await
        .ok()
        .and_then(Result::ok)
        .unwrap_or_default();
    let ev = &shared.hub.stats;
    Snapshot {
        datapath,
        daemon: Some(DaemonState {
            conntrack_entries: shared.gc.occupancy.load(Ordering::Relaxed),
            conntrack_capacity,
            conntrack_expired: shared.gc.expired_total.load(Ordering::Relaxed),
            gc_pass_us: shared.gc.last_pass_us.load(Ordering::Relaxed),
            events_drained: ev.drained.load(Ordering::Relaxed),
            events_malformed: ev.malformed.load(Ordering::Relaxed),
            events_lagged: ev.lagged.load(Ordering::Relaxed),
            desired_generation,
            services,
            service_rows,
            health,
            api: shared.latency.clone(),
            ha: shared.ha.as_ref().map(|ha| ha.status()),
            announce: shared.announce.as_ref().map(|a| a.status.borrow().clone()),
        }),
    }
}

/// The exposition of `snapshot` in the Prometheus text format 0.0.4.
pub fn render(snapshot: Snapshot) -> Result<String, MetricsError> {
    // A registry per scrape: the snapshot is read asynchronously (the rules lock, blocking
    // map walks), which a long-lived registry's synchronous collectors cannot do.
    let mut registry = Registry::default();
    registry.register_collector(Box::new(snapshot));
    let mut out = String::new();
    prometheus_text::encode(&mut out, &registry)?;
    Ok(out)
}

/// No labels.
const NONE: [(&str, &str); 0] = [];

/// Writes metric families to a [`DescriptorEncoder`].
struct Families<'a>(DescriptorEncoder<'a>);

impl Families<'_> {
    /// One family: HELP and TYPE (even with no samples), then a sample per label set.
    fn family<L: EncodeLabelSet, M: EncodeMetric + TypedMetric>(
        &mut self,
        name: &str,
        help: &str,
        samples: impl IntoIterator<Item = (L, M)>,
    ) -> fmt::Result {
        let mut family = self
            .0
            .encode_descriptor(base_name(name, M::TYPE), help, None, M::TYPE)?;
        for (labels, metric) in samples {
            metric.encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }

    fn counter(&mut self, name: &str, help: &str, value: u64) -> fmt::Result {
        self.family(name, help, [(NONE, ConstCounter::new(value))])
    }

    fn gauge(&mut self, name: &str, help: &str, value: impl EncodeGaugeValue) -> fmt::Result {
        self.family(name, help, [(NONE, ConstGauge::new(value))])
    }

    /// A family of live metrics (a `prometheus-client` metric or family).
    fn live(&mut self, name: &str, help: &str, metric: &impl EncodeMetric) -> fmt::Result {
        let kind = metric.metric_type();
        metric.encode(
            self.0
                .encode_descriptor(base_name(name, kind), help, None, kind)?,
        )
    }
}

/// The name to give the encoder for the exposed `name`: it appends `_total` to counters.
fn base_name(name: &str, kind: MetricType) -> &str {
    match kind {
        MetricType::Counter => name.strip_suffix("_total").unwrap_or(name),
        _ => name,
    }
}

/// One family of a table of families over the same rows: name, help, and a row's value.
type Column<T, V> = (&'static str, &'static str, fn(&T) -> V);

fn service_name(r: &ServiceRow) -> String {
    format!(
        "{}/{}",
        std::net::SocketAddr::new(r.vip, r.port),
        r.protocol
    )
}

impl Collector for Snapshot {
    fn encode(&self, encoder: DescriptorEncoder) -> fmt::Result {
        let mut f = Families(encoder);
        f.family(
            "fastpath_build_info",
            "Version of the running daemon.",
            [(
                [
                    ("version", env!("CARGO_PKG_VERSION")),
                    ("api", crate::api::API_VERSION),
                ],
                ConstGauge::new(1u64),
            )],
        )?;
        f.gauge(
            "fastpath_up",
            "1 when the datapath's maps could be read.",
            u64::from(self.datapath.is_some()),
        )?;
        if let Some(s) = &self.datapath {
            datapath_families(&mut f, s)?;
        }
        if let Some(d) = &self.daemon {
            daemon_families(&mut f, d)?;
        }
        Ok(())
    }
}

fn by_reason(r: &pb::ReasonCounter) -> [(&'static str, &str); 3] {
    [
        ("hook", r.hook.as_str()),
        ("verdict", r.verdict.as_str()),
        ("reason", r.reason.as_str()),
    ]
}

fn named(
    c: &[pb::NamedCounter],
) -> impl Iterator<Item = ([(&'static str, &str); 1], ConstCounter)> {
    c.iter()
        .map(|c| ([("counter", c.name.as_str())], ConstCounter::new(c.value)))
}

/// Each backend of `r` with its `{service, backend}` labels.
fn backends(
    r: &ServiceRow,
) -> impl Iterator<Item = ([(&'static str, String); 2], &crate::datapath::BackendRow)> {
    let service = service_name(r);
    r.backends.iter().map(move |b| {
        let backend = std::net::SocketAddr::new(b.address, b.port).to_string();
        ([("service", service.clone()), ("backend", backend)], b)
    })
}

fn datapath_families(f: &mut Families<'_>, s: &pb::Stats) -> fmt::Result {
    f.family(
        "fastpath_packets_total",
        "Packets by hook, verdict and reason code.",
        s.reasons
            .iter()
            .map(|r| (by_reason(r), ConstCounter::new(r.packets))),
    )?;
    f.family(
        "fastpath_bytes_total",
        "Bytes (frame lengths) by hook, verdict and reason code.",
        s.reasons
            .iter()
            .map(|r| (by_reason(r), ConstCounter::new(r.bytes))),
    )?;
    f.family(
        "fastpath_conntrack_operations_total",
        "Conntrack counters (lookups, hits, new, insert_failed, early drops, ...).",
        named(&s.conntrack),
    )?;
    f.family(
        "fastpath_vxlan_learning_total",
        "VXLAN flow cache: headers learned from the kernel's vxlan devices, packets whose headers the cache cannot use, arriving GRO aggregates left to the kernel at TC.",
        named(&s.vxlan),
    )?;
    f.gauge(
        "fastpath_vxlan_generation",
        "Current generation of learned VXLAN headers and cached routes (each route, neighbour, link or configuration change starts one).",
        s.vxlan_generation,
    )?;
    f.family(
        "fastpath_route_cache_total",
        "Route cache: routed packets that took their flow's cached FIB answer (hit), asked the FIB (miss), found an answer of an older generation or past its second (stale).",
        named(&s.route_cache),
    )?;
    f.gauge(
        "fastpath_route_shared",
        "1 while new load-balanced connections share their backend's route (the FIB answers by destination alone: no policy rule by source, ports, protocol or TOS, no multipath route); 0 while each asks the FIB.",
        u64::from(s.route_shared),
    )
}

fn daemon_families(f: &mut Families<'_>, d: &DaemonState) -> fmt::Result {
    f.gauge(
        "fastpath_conntrack_entries",
        "Tracked connections at the last expiry pass (every entry counted).",
        d.conntrack_entries,
    )?;
    f.gauge(
        "fastpath_conntrack_capacity",
        "Size of the conntrack table.",
        d.conntrack_capacity,
    )?;
    f.gauge(
        "fastpath_conntrack_pressure_ratio",
        "Entries over capacity: new connections fail (insert_failed) near 1.",
        d.conntrack_entries as f64 / f64::from(d.conntrack_capacity.max(1)),
    )?;
    f.counter(
        "fastpath_conntrack_expired_total",
        "Connections removed by the expiry for being idle past their timeout.",
        d.conntrack_expired,
    )?;
    f.gauge(
        "fastpath_conntrack_gc_pass_seconds",
        "Duration of the last expiry pass.",
        d.gc_pass_us as f64 / 1e6,
    )?;
    f.family(
        "fastpath_conntrack_events_total",
        "Conntrack events read from the datapath's ring, and lost by slow subscribers.",
        [
            ("drained", d.events_drained),
            ("malformed", d.events_malformed),
            ("lagged", d.events_lagged),
        ]
        .map(|(outcome, v)| ([("outcome", outcome)], ConstCounter::new(v))),
    )?;
    f.gauge(
        "fastpath_desired_generation",
        "Generation of the desired state (each accepted change adds one).",
        d.desired_generation,
    )?;
    f.gauge(
        "fastpath_services",
        "Services (and port forwards) in the desired state.",
        d.services,
    )?;

    let services: [Column<ServiceRow, u64>; 4] = [
        (
            "fastpath_service_packets_total",
            "Packets of a service's connections, both directions.",
            |r| r.packets,
        ),
        (
            "fastpath_service_bytes_total",
            "Bytes of a service's connections, both directions.",
            |r| r.bytes,
        ),
        (
            "fastpath_service_connections_total",
            "New connections given a backend.",
            |r| r.connections,
        ),
        (
            "fastpath_service_no_backend_total",
            "New connections that found no backend.",
            |r| r.no_backend,
        ),
    ];
    for (name, help, get) in services {
        f.family(
            name,
            help,
            d.service_rows
                .iter()
                .map(|r| ([("service", service_name(r))], ConstCounter::new(get(r)))),
        )?;
    }
    type B = crate::datapath::BackendRow;
    let backend_counters: [Column<B, u64>; 3] = [
        (
            "fastpath_backend_packets_total",
            "Packets of a backend's connections, both directions.",
            |b| b.packets,
        ),
        (
            "fastpath_backend_bytes_total",
            "Bytes of a backend's connections, both directions.",
            |b| b.bytes,
        ),
        (
            "fastpath_backend_connections_total",
            "Connections given this backend.",
            |b| b.connections,
        ),
    ];
    for (name, help, get) in backend_counters {
        f.family(
            name,
            help,
            d.service_rows
                .iter()
                .flat_map(backends)
                .map(|(labels, b)| (labels, ConstCounter::new(get(b)))),
        )?;
    }
    let backend_gauges: [Column<B, f64>; 2] = [
        (
            "fastpath_backend_active_connections",
            "Connections of this backend tracked now and not closed.",
            |b| b.active as f64,
        ),
        (
            "fastpath_backend_share_ratio",
            "Share of new connections the selection table gives this backend.",
            |b| b.share_pct / 100.0,
        ),
    ];
    for (name, help, get) in backend_gauges {
        f.family(
            name,
            help,
            d.service_rows
                .iter()
                .flat_map(backends)
                .map(|(labels, b)| (labels, ConstGauge::new(get(b)))),
        )?;
    }
    f.family(
        "fastpath_backend_up",
        "Health of probed backends: 1 up, 0 down.",
        d.health.iter().map(|h| {
            (
                [
                    ("service", h.service.to_string()),
                    ("backend", h.backend.to_string()),
                ],
                ConstGauge::new(u64::from(h.up)),
            )
        }),
    )?;
    f.live(
        "fastpath_api_request_duration_seconds",
        "Latency of management API requests, by method.",
        &d.api.durations,
    )?;
    f.live(
        "fastpath_api_requests_total",
        "Management API requests by method and status code.",
        &d.api.requests,
    )?;
    if let Some(ha) = &d.ha {
        ha_families(f, ha)?;
    }
    if let Some(a) = &d.announce {
        use crate::announce::Readiness;
        f.gauge(
            "fastpath_announce_ready",
            "1 while the node is ready to carry its VIPs (health settled, peers' state held).",
            u64::from(a.readiness == Readiness::Ready),
        )?;
        f.gauge(
            "fastpath_announce_draining",
            "1 while the node is drained (`fastpath drain`): everything withdrawn.",
            u64::from(matches!(
                a.readiness,
                Readiness::Draining | Readiness::Drained
            )),
        )?;
        f.family(
            "fastpath_announced",
            "1 per route in the announcement table (what the routing daemon announces): this node's own (preference primary) or another node's prefix (backup).",
            a.announced.iter().map(|r| {
                (
                    [
                        ("prefix", r.net.to_string()),
                        (
                            "preference",
                            if r.backup { "backup" } else { "primary" }.to_string(),
                        ),
                    ],
                    ConstGauge::new(1u64),
                )
            }),
        )?;
    }
    Ok(())
}

/// HA replication: readiness, and per peer the stream out (queue, lag, resends, resyncs,
/// refusals) and the stream in (synced, installed, refused).
fn ha_families(f: &mut Families<'_>, s: &pb::HaStatus) -> fmt::Result {
    f.gauge(
        "fastpath_ha_in_sync",
        "1 when this node holds every peer's state (a failover manager may promote it).",
        u64::from(s.in_sync),
    )?;
    f.counter(
        "fastpath_ha_events_lost_total",
        "Conntrack events replication missed (ring or hub overflow); each makes the peers resync.",
        s.events_lost,
    )?;
    f.counter(
        "fastpath_ha_rejected_messages_total",
        "Peer messages refused whole (no or a wrong node id); their stream was closed.",
        s.rejected_messages,
    )?;
    let peer = |p: &pb::HaPeerOut| [("peer", p.address.clone())];
    let out_gauges: [Column<pb::HaPeerOut, f64>; 5] = [
        (
            "fastpath_ha_peer_connected",
            "1 while this node's stream to the peer is up.",
            |p| f64::from(u8::from(p.connected)),
        ),
        (
            "fastpath_ha_send_queue",
            "Changes queued for the peer and not acknowledged.",
            |p| p.queued as f64,
        ),
        (
            "fastpath_ha_send_lag_changes",
            "Changes made here that the peer has not acknowledged (sequence lag).",
            |p| p.last_seq.saturating_sub(p.acked_seq) as f64,
        ),
        (
            "fastpath_ha_send_lag_seconds",
            "Age of the oldest change the peer has not acknowledged (time lag).",
            |p| p.lag_ms as f64 / 1000.0,
        ),
        (
            "fastpath_ha_replication_lag_p99_seconds",
            "99th percentile of change-to-acknowledgement time over the latest acknowledgements.",
            |p| p.lag_p99_us as f64 / 1e6,
        ),
    ];
    for (name, help, get) in out_gauges {
        f.family(
            name,
            help,
            s.peers_out
                .iter()
                .map(|p| (peer(p), ConstGauge::new(get(p)))),
        )?;
    }
    let out_counters: [Column<pb::HaPeerOut, u64>; 5] = [
        (
            "fastpath_ha_sent_changes_total",
            "Changes sent to the peer (resends included, snapshots not).",
            |p| p.sent_changes,
        ),
        (
            "fastpath_ha_resyncs_total",
            "Snapshots sent to the peer (connects, resync requests, lost events, an overflowed queue).",
            |p| p.snapshots,
        ),
        (
            "fastpath_ha_resends_total",
            "Resends of part of the queue after the peer saw a gap.",
            |p| p.resends,
        ),
        (
            "fastpath_ha_rejected_total",
            "Acknowledgements from the peer this node refused (out of range, another epoch).",
            |p| p.rejected,
        ),
        (
            "fastpath_ha_peer_rejected_total",
            "Changes the peer refused (malformed, unknown service or backend), never applied.",
            |p| p.peer_rejected,
        ),
    ];
    for (name, help, get) in out_counters {
        f.family(
            name,
            help,
            s.peers_out
                .iter()
                .map(|p| (peer(p), ConstCounter::new(get(p)))),
        )?;
    }
    let node = |p: &pb::HaPeerIn| [("node", p.node_id.to_string())];
    let in_gauges: [Column<pb::HaPeerIn, u64>; 3] = [
        (
            "fastpath_ha_node_synced",
            "1 when this node received the node's snapshot and applied its stream since.",
            |p| u64::from(p.synced),
        ),
        (
            "fastpath_ha_node_connected",
            "1 while the node's stream to this node is up.",
            |p| u64::from(p.connected),
        ),
        (
            "fastpath_ha_node_installed_entries",
            "Conntrack entries from the node in this node's table.",
            |p| p.installed,
        ),
    ];
    for (name, help, get) in in_gauges {
        f.family(
            name,
            help,
            s.peers_in
                .iter()
                .map(|p| (node(p), ConstGauge::new(get(p)))),
        )?;
    }
    let in_counters: [Column<pb::HaPeerIn, u64>; 2] = [
        (
            "fastpath_ha_node_received_changes_total",
            "Changes received from the node (snapshot entries included).",
            |p| p.received_changes,
        ),
        (
            "fastpath_ha_node_refused_total",
            "Changes from the node refused (malformed, out of range, stale), never applied.",
            |p| p.rejected,
        ),
    ];
    for (name, help, get) in in_counters {
        f.family(
            name,
            help,
            s.peers_in
                .iter()
                .map(|p| (node(p), ConstCounter::new(get(p)))),
        )?;
    }
    Ok(())
}

/// Serves `GET /metrics` on `listener` until `shutdown` turns true; open connections finish
/// their request in flight and close then.
pub async fn serve(
    listener: tokio::net::TcpListener,
    shared: Arc<Shared>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(HEAD_TIMEOUT);
    loop {
        let (sock, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => { warn!(error = %e, "Accepting a metrics connection failed"); continue; }
            },
            _ = shutdown.wait_for(|s| *s) => return,
        };
        let shared = shared.clone();
        let service = hyper::service::service_fn(move |req| respond(shared.clone(), req));
        let conn = http.serve_connection(TokioIo::new(sock), service);
        let mut stop = shutdown.clone();
        tokio::spawn(async move {
            let mut conn = std::pin::pin!(conn);
            // The watch's guard is not `Send`: drop it inside this future.
            let stopped = async move {
                let _ = stop.wait_for(|s| *s).await;
            };
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        debug!(%peer, error = %e, "Metrics connection ended with an error");
                    }
                }
                () = stopped => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
        });
    }
}

/// The answer to one request: the exposition at `GET /metrics`, 404 or 405 otherwise.
async fn respond(
    shared: Arc<Shared>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let path = req.uri().path();
    let (status, content_type, body) = match (req.method(), path) {
        (&Method::GET, "/metrics") => match render(snapshot(&shared).await) {
            Ok(body) => (StatusCode::OK, prometheus_text::CONTENT_TYPE, body),
            Err(e) => {
                warn!(error = %e, "Answering a scrape failed");
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "text/plain",
                    format!("{e}\n"),
                )
            }
        },
        (&Method::GET, _) => (
            StatusCode::NOT_FOUND,
            "text/plain",
            "fastpath serves /metrics only\n".to_string(),
        ),
        _ => (
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "GET /metrics\n".to_string(),
        ),
    };
    debug!(path, status = status.as_u16(), "Metrics request");
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    if status == StatusCode::METHOD_NOT_ALLOWED {
        resp.headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET"));
    }
    Ok(resp)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(pairs: &[(&str, u64)]) -> Vec<pb::NamedCounter> {
        pairs
            .iter()
            .map(|(name, value)| pb::NamedCounter {
                name: (*name).into(),
                value: *value,
            })
            .collect()
    }

    /// A snapshot with one of everything: two reason rows (one label value needing every
    /// escape), a service with a backend, a probed backend, two API methods, an HA peer each way.
    fn known_snapshot() -> Snapshot {
        let api = ApiLatency::default();
        // 250 µs is a bucket bound exactly: it counts in that bucket (upper bounds inclusive).
        for _ in 0..2 {
            api.record("ListServices", Duration::from_micros(250), tonic::Code::Ok);
        }
        api.record("GetService", Duration::from_secs(3), tonic::Code::NotFound);
        let localhost = std::net::IpAddr::from([127, 0, 0, 1]);
        Snapshot {
            datapath: Some(pb::Stats {
                reasons: vec![
                    pb::ReasonCounter {
                        hook: "xdp".into(),
                        verdict: "tx".into(),
                        reason: "lb".into(),
                        packets: 10,
                        bytes: 1500,
                    },
                    pb::ReasonCounter {
                        hook: "tc_ingress".into(),
                        verdict: "drop".into(),
                        reason: "a \"quoted\" back\\slash\nnewline".into(),
                        packets: 2,
                        bytes: 120,
                    },
                ],
                conntrack: named(&[("lookups", 12), ("hits", 9)]),
                vxlan: named(&[("learned", 4)]),
                vxlan_generation: 7,
                route_cache: named(&[("hit", 5)]),
                route_shared: true,
                ..Default::default()
            }),
            daemon: Some(DaemonState {
                conntrack_entries: 250,
                conntrack_capacity: 1000,
                conntrack_expired: 33,
                gc_pass_us: 1500,
                events_drained: 40,
                events_malformed: 1,
                events_lagged: 2,
                desired_generation: 6,
                services: 1,
                service_rows: vec![ServiceRow {
                    vip: std::net::IpAddr::from([10, 0, 0, 1]),
                    port: 80,
                    protocol: "tcp".into(),
                    id: 1,
                    generation: 1,
                    packets: 100,
                    bytes: 9000,
                    connections: 8,
                    no_backend: 1,
                    mode: "nat".into(),
                    snat: None,
                    backends: vec![crate::datapath::BackendRow {
                        address: std::net::IpAddr::from([10, 0, 1, 2]),
                        port: 8080,
                        share_pct: 50.0,
                        packets: 60,
                        bytes: 5000,
                        connections: 5,
                        active: 3,
                    }],
                }],
                health: vec![BackendHealth {
                    service: crate::config::ServiceId {
                        vip: std::net::IpAddr::from([10, 0, 0, 1]),
                        port: 80,
                        protocol: crate::config::Protocol::Tcp,
                    },
                    backend: std::net::SocketAddr::new(localhost, 8080),
                    up: false,
                    detail: "refused".into(),
                }],
                api,
                ha: Some(pb::HaStatus {
                    enabled: true,
                    in_sync: true,
                    events_lost: 3,
                    rejected_messages: 4,
                    peers_out: vec![pb::HaPeerOut {
                        address: "10.9.0.2:7946".into(),
                        connected: true,
                        queued: 5,
                        last_seq: 20,
                        acked_seq: 15,
                        lag_ms: 250,
                        lag_p99_us: 1500,
                        sent_changes: 21,
                        snapshots: 2,
                        resends: 1,
                        rejected: 6,
                        peer_rejected: 7,
                        ..Default::default()
                    }],
                    peers_in: vec![pb::HaPeerIn {
                        node_id: 2,
                        connected: true,
                        synced: true,
                        installed: 11,
                        received_changes: 30,
                        rejected: 8,
                        ..Default::default()
                    }],
                    ..Default::default()
                }),
                announce: Some(crate::announce::Status {
                    readiness: crate::announce::Readiness::Ready,
                    announced: vec![crate::announce::Route {
                        net: "192.0.2.100/32".parse().expect("prefix"),
                        backup: false,
                    }],
                    drain: None,
                }),
            }),
        }
    }

    /// Every family, in order, with its type: the names dashboards and alerts use.
    const FAMILIES: &[(&str, &str)] = &[
        ("fastpath_build_info", "gauge"),
        ("fastpath_up", "gauge"),
        ("fastpath_packets_total", "counter"),
        ("fastpath_bytes_total", "counter"),
        ("fastpath_conntrack_operations_total", "counter"),
        ("fastpath_vxlan_learning_total", "counter"),
        ("fastpath_vxlan_generation", "gauge"),
        ("fastpath_route_cache_total", "counter"),
        ("fastpath_route_shared", "gauge"),
        ("fastpath_conntrack_entries", "gauge"),
        ("fastpath_conntrack_capacity", "gauge"),
        ("fastpath_conntrack_pressure_ratio", "gauge"),
        ("fastpath_conntrack_expired_total", "counter"),
        ("fastpath_conntrack_gc_pass_seconds", "gauge"),
        ("fastpath_conntrack_events_total", "counter"),
        ("fastpath_desired_generation", "gauge"),
        ("fastpath_services", "gauge"),
        ("fastpath_service_packets_total", "counter"),
        ("fastpath_service_bytes_total", "counter"),
        ("fastpath_service_connections_total", "counter"),
        ("fastpath_service_no_backend_total", "counter"),
        ("fastpath_backend_packets_total", "counter"),
        ("fastpath_backend_bytes_total", "counter"),
        ("fastpath_backend_connections_total", "counter"),
        ("fastpath_backend_active_connections", "gauge"),
        ("fastpath_backend_share_ratio", "gauge"),
        ("fastpath_backend_up", "gauge"),
        ("fastpath_api_request_duration_seconds", "histogram"),
        ("fastpath_api_requests_total", "counter"),
        ("fastpath_ha_in_sync", "gauge"),
        ("fastpath_ha_events_lost_total", "counter"),
        ("fastpath_ha_rejected_messages_total", "counter"),
        ("fastpath_ha_peer_connected", "gauge"),
        ("fastpath_ha_send_queue", "gauge"),
        ("fastpath_ha_send_lag_changes", "gauge"),
        ("fastpath_ha_send_lag_seconds", "gauge"),
        ("fastpath_ha_replication_lag_p99_seconds", "gauge"),
        ("fastpath_ha_sent_changes_total", "counter"),
        ("fastpath_ha_resyncs_total", "counter"),
        ("fastpath_ha_resends_total", "counter"),
        ("fastpath_ha_rejected_total", "counter"),
        ("fastpath_ha_peer_rejected_total", "counter"),
        ("fastpath_ha_node_synced", "gauge"),
        ("fastpath_ha_node_connected", "gauge"),
        ("fastpath_ha_node_installed_entries", "gauge"),
        ("fastpath_ha_node_received_changes_total", "counter"),
        ("fastpath_ha_node_refused_total", "counter"),
        ("fastpath_announce_ready", "gauge"),
        ("fastpath_announce_draining", "gauge"),
        ("fastpath_announced", "gauge"),
    ];

    /// Every sample of [`known_snapshot`], as the text format writes it.
    const SAMPLES: &str = r#"
fastpath_build_info{version="VERSION",api="fastpath.v1"} 1
fastpath_up 1
fastpath_packets_total{hook="xdp",verdict="tx",reason="lb"} 10
fastpath_packets_total{hook="tc_ingress",verdict="drop",reason="a \"quoted\" back\\slash\nnewline"} 2
fastpath_bytes_total{hook="xdp",verdict="tx",reason="lb"} 1500
fastpath_bytes_total{hook="tc_ingress",verdict="drop",reason="a \"quoted\" back\\slash\nnewline"} 120
fastpath_conntrack_operations_total{counter="lookups"} 12
fastpath_conntrack_operations_total{counter="hits"} 9
fastpath_vxlan_learning_total{counter="learned"} 4
fastpath_vxlan_generation 7
fastpath_route_cache_total{counter="hit"} 5
fastpath_route_shared 1
fastpath_conntrack_entries 250
fastpath_conntrack_capacity 1000
fastpath_conntrack_pressure_ratio 0.25
fastpath_conntrack_expired_total 33
fastpath_conntrack_gc_pass_seconds 0.0015
fastpath_conntrack_events_total{outcome="drained"} 40
fastpath_conntrack_events_total{outcome="malformed"} 1
fastpath_conntrack_events_total{outcome="lagged"} 2
fastpath_desired_generation 6
fastpath_services 1
fastpath_service_packets_total{service="10.0.0.1:80/tcp"} 100
fastpath_service_bytes_total{service="10.0.0.1:80/tcp"} 9000
fastpath_service_connections_total{service="10.0.0.1:80/tcp"} 8
fastpath_service_no_backend_total{service="10.0.0.1:80/tcp"} 1
fastpath_backend_packets_total{service="10.0.0.1:80/tcp",backend="10.0.1.2:8080"} 60
fastpath_backend_bytes_total{service="10.0.0.1:80/tcp",backend="10.0.1.2:8080"} 5000
fastpath_backend_connections_total{service="10.0.0.1:80/tcp",backend="10.0.1.2:8080"} 5
fastpath_backend_active_connections{service="10.0.0.1:80/tcp",backend="10.0.1.2:8080"} 3.0
fastpath_backend_share_ratio{service="10.0.0.1:80/tcp",backend="10.0.1.2:8080"} 0.5
fastpath_backend_up{service="10.0.0.1:80/tcp",backend="127.0.0.1:8080"} 0
fastpath_api_request_duration_seconds_bucket{method="ListServices",le="0.0001"} 0
fastpath_api_request_duration_seconds_bucket{method="ListServices",le="0.00025"} 2
fastpath_api_request_duration_seconds_bucket{method="ListServices",le="0.0005"} 2
fastpath_api_request_duration_seconds_bucket{method="ListServices",le="0.001"} 2
fastpath_api_request_duration_seconds_bucket{method="ListServices",le="0.0025"} 2
fastpath_api_request_duration_seconds_bucket{method="ListServices",le="0.005"} 2
fastpath_api_request_duration_seconds_bucket{method="ListServices",le="0.01"} 2
fastpath_api_request_duration_seconds_bucket{method="ListServices",le="0.025"} 2
fastpath_api_request_duration_seconds_bucket{method="ListServices",le="0.05"} 2
fastpath_api_request_duration_seconds_bucket{method="ListServices",le="0.1"} 2
fastpath_api_request_duration_seconds_bucket{method="ListServices",le="0.5"} 2
fastpath_api_request_duration_seconds_bucket{method="ListServices",le="2.5"} 2
fastpath_api_request_duration_seconds_bucket{method="ListServices",le="+Inf"} 2
fastpath_api_request_duration_seconds_sum{method="ListServices"} 0.0005
fastpath_api_request_duration_seconds_count{method="ListServices"} 2
fastpath_api_request_duration_seconds_bucket{method="GetService",le="0.0001"} 0
fastpath_api_request_duration_seconds_bucket{method="GetService",le="0.00025"} 0
fastpath_api_request_duration_seconds_bucket{method="GetService",le="0.0005"} 0
fastpath_api_request_duration_seconds_bucket{method="GetService",le="0.001"} 0
fastpath_api_request_duration_seconds_bucket{method="GetService",le="0.0025"} 0
fastpath_api_request_duration_seconds_bucket{method="GetService",le="0.005"} 0
fastpath_api_request_duration_seconds_bucket{method="GetService",le="0.01"} 0
fastpath_api_request_duration_seconds_bucket{method="GetService",le="0.025"} 0
fastpath_api_request_duration_seconds_bucket{method="GetService",le="0.05"} 0
fastpath_api_request_duration_seconds_bucket{method="GetService",le="0.1"} 0
fastpath_api_request_duration_seconds_bucket{method="GetService",le="0.5"} 0
fastpath_api_request_duration_seconds_bucket{method="GetService",le="2.5"} 0
fastpath_api_request_duration_seconds_bucket{method="GetService",le="+Inf"} 1
fastpath_api_request_duration_seconds_sum{method="GetService"} 3.0
fastpath_api_request_duration_seconds_count{method="GetService"} 1
fastpath_api_requests_total{method="ListServices",code="OK"} 2
fastpath_api_requests_total{method="GetService",code="NOT_FOUND"} 1
fastpath_ha_in_sync 1
fastpath_ha_events_lost_total 3
fastpath_ha_rejected_messages_total 4
fastpath_ha_peer_connected{peer="10.9.0.2:7946"} 1.0
fastpath_ha_send_queue{peer="10.9.0.2:7946"} 5.0
fastpath_ha_send_lag_changes{peer="10.9.0.2:7946"} 5.0
fastpath_ha_send_lag_seconds{peer="10.9.0.2:7946"} 0.25
fastpath_ha_replication_lag_p99_seconds{peer="10.9.0.2:7946"} 0.0015
fastpath_ha_sent_changes_total{peer="10.9.0.2:7946"} 21
fastpath_ha_resyncs_total{peer="10.9.0.2:7946"} 2
fastpath_ha_resends_total{peer="10.9.0.2:7946"} 1
fastpath_ha_rejected_total{peer="10.9.0.2:7946"} 6
fastpath_ha_peer_rejected_total{peer="10.9.0.2:7946"} 7
fastpath_ha_node_synced{node="2"} 1
fastpath_ha_node_connected{node="2"} 1
fastpath_ha_node_installed_entries{node="2"} 11
fastpath_ha_node_received_changes_total{node="2"} 30
fastpath_ha_node_refused_total{node="2"} 8
fastpath_announce_ready 1
fastpath_announce_draining 0
fastpath_announced{prefix="192.0.2.100/32",preference="primary"} 1
"#;

    fn sorted_lines(text: &str) -> Vec<String> {
        let mut v: Vec<String> = text
            .lines()
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(str::to_owned)
            .collect();
        v.sort();
        v
    }

    #[test]
    fn known_snapshot_renders_every_family_and_sample_exactly() {
        let text = render(known_snapshot()).unwrap_or_else(|e| panic!("render: {e}"));
        // HELP then TYPE for each family, in this order, with nothing else between samples.
        let types: Vec<(String, String)> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split_once(' '))
            .map(|(n, t)| (n.to_owned(), t.to_owned()))
            .collect();
        let want: Vec<(String, String)> = FAMILIES
            .iter()
            .map(|(n, t)| ((*n).to_owned(), (*t).to_owned()))
            .collect();
        assert_eq!(types, want, "families and types; exposition:\n{text}");
        let helps: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# HELP "))
            .filter_map(|l| l.split_once(' ').map(|(n, _)| n))
            .collect();
        let names: Vec<&str> = FAMILIES.iter().map(|(n, _)| *n).collect();
        assert_eq!(helps, names, "a HELP line per family; exposition:\n{text}");
        let expected = SAMPLES.replace("VERSION", env!("CARGO_PKG_VERSION"));
        assert_eq!(
            sorted_lines(&text),
            sorted_lines(&expected),
            "samples; exposition:\n{text}"
        );
        // Each family's samples follow its own HELP/TYPE lines.
        let mut family = "";
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                family = rest.split(' ').next().unwrap_or("");
            } else if !line.starts_with('#') {
                assert!(
                    line.starts_with(family),
                    "sample {line:?} outside its family (last TYPE {family})"
                );
            }
        }
    }

    #[test]
    fn a_text_format_parser_reads_the_histogram_and_counters_back() {
        let text = render(known_snapshot()).unwrap_or_else(|e| panic!("render: {e}"));
        let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned())))
            .unwrap_or_else(|e| panic!("parsing: {e}\n{text}"));
        let histogram = scrape
            .samples
            .iter()
            .find(|s| {
                s.metric == "fastpath_api_request_duration_seconds"
                    && s.labels.get("method") == Some("ListServices")
            })
            .unwrap_or_else(|| panic!("no ListServices histogram in\n{text}"));
        let prometheus_parse::Value::Histogram(buckets) = &histogram.value else {
            panic!("expected a histogram, got {:?}", histogram.value);
        };
        let got: Vec<(f64, f64)> = buckets.iter().map(|b| (b.less_than, b.count)).collect();
        let want: Vec<(f64, f64)> = LATENCY_BUCKETS_S
            .iter()
            .map(|le| (*le, if *le < 0.00025 { 0.0 } else { 2.0 }))
            .chain([(f64::INFINITY, 2.0)])
            .collect();
        assert_eq!(got, want, "ListServices buckets");
        let counter = |name: &str, label: (&str, &str)| {
            scrape
                .samples
                .iter()
                .find(|s| s.metric == name && s.labels.get(label.0) == Some(label.1))
                .map(|s| s.value.clone())
        };
        assert_eq!(
            counter("fastpath_api_requests_total", ("code", "NOT_FOUND")),
            Some(prometheus_parse::Value::Counter(1.0))
        );
        assert_eq!(
            counter("fastpath_packets_total", ("reason", "lb")),
            Some(prometheus_parse::Value::Counter(10.0))
        );
        assert_eq!(
            counter("fastpath_backend_share_ratio", ("backend", "10.0.1.2:8080")),
            Some(prometheus_parse::Value::Gauge(0.5))
        );
    }

    #[test]
    fn unreadable_maps_and_a_stopping_daemon_leave_build_info_and_up_0() {
        let mut s = known_snapshot();
        s.datapath = None;
        s.daemon = None;
        let text = render(s).unwrap_or_else(|e| panic!("render: {e}"));
        let samples = sorted_lines(&text);
        let want = sorted_lines(&format!(
            "fastpath_build_info{{version=\"{}\",api=\"fastpath.v1\"}} 1\nfastpath_up 0\n",
            env!("CARGO_PKG_VERSION")
        ));
        assert_eq!(samples, want, "exposition:\n{text}");
    }

    #[test]
    fn families_without_samples_keep_their_help_and_type() {
        let mut s = known_snapshot();
        if let Some(d) = &mut s.daemon {
            d.api = ApiLatency::default();
            d.health.clear();
        }
        let text = render(s).unwrap_or_else(|e| panic!("render: {e}"));
        for family in [
            "fastpath_api_request_duration_seconds",
            "fastpath_api_requests_total",
            "fastpath_backend_up",
        ] {
            assert!(
                text.contains(&format!("# TYPE {family} ")),
                "expected a TYPE line for {family} in\n{text}"
            );
            assert!(
                !text.lines().any(|l| l.starts_with(family)),
                "expected no {family} samples in\n{text}"
            );
        }
    }
}
