//! Prometheus metrics: the text exposition format (0.0.4) over plain HTTP at `/metrics`.
//!
//! Everything is read when scraped: datapath counters from the pinned maps, conntrack
//! occupancy from the last expiry pass (exact, every entry read), services and backends with
//! their health from the desired state, and the API's own request latencies.

use std::{fmt::Write as _, sync::Arc, sync::atomic::Ordering};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tracing::{debug, warn};

use crate::api::server::{LATENCY_BUCKETS_S, Shared};

/// Escapes a label value (backslash, quote, newline).
fn esc(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// One metric family being written: HELP and TYPE once, then samples.
struct Out(String);

impl Out {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.0, "# HELP {name} {help}");
        let _ = writeln!(self.0, "# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: impl std::fmt::Display) {
        self.0.push_str(name);
        if !labels.is_empty() {
            self.0.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.0.push(',');
                }
                let _ = write!(self.0, "{k}=\"{}\"", esc(v));
            }
            self.0.push('}');
        }
        let _ = writeln!(self.0, " {value}");
    }
}

/// The whole exposition.
pub async fn render(shared: &Arc<Shared>) -> String {
    let mut o = Out(String::new());
    let pin = shared.pin_dir.clone();
    let read = tokio::task::spawn_blocking(move || crate::api::read::stats(&pin, true)).await;
    o.family(
        "fastpath_build_info",
        "gauge",
        "Version of the running daemon.",
    );
    o.sample(
        "fastpath_build_info",
        &[
            ("version", env!("CARGO_PKG_VERSION")),
            ("api", crate::api::API_VERSION),
        ],
        1,
    );
    o.family(
        "fastpath_up",
        "gauge",
        "1 when the datapath's maps could be read.",
    );
    let stats = match read {
        Ok(Ok(s)) => {
            o.sample("fastpath_up", &[], 1);
            Some(s)
        }
        Ok(Err(e)) => {
            warn!(error = %e, "metrics: reading the datapath failed");
            o.sample("fastpath_up", &[], 0);
            None
        }
        Err(e) => {
            warn!(error = %e, "metrics: read task failed");
            o.sample("fastpath_up", &[], 0);
            None
        }
    };
    if let Some(s) = &stats {
        o.family(
            "fastpath_packets_total",
            "counter",
            "Packets by hook, verdict and reason code.",
        );
        for r in &s.reasons {
            o.sample(
                "fastpath_packets_total",
                &[
                    ("hook", &r.hook),
                    ("verdict", &r.verdict),
                    ("reason", &r.reason),
                ],
                r.packets,
            );
        }
        o.family(
            "fastpath_bytes_total",
            "counter",
            "Bytes (frame lengths) by hook, verdict and reason code.",
        );
        for r in &s.reasons {
            o.sample(
                "fastpath_bytes_total",
                &[
                    ("hook", &r.hook),
                    ("verdict", &r.verdict),
                    ("reason", &r.reason),
                ],
                r.bytes,
            );
        }
        o.family(
            "fastpath_conntrack_operations_total",
            "counter",
            "Conntrack counters (lookups, hits, new, insert_failed, early drops, ...).",
        );
        for c in &s.conntrack {
            o.sample(
                "fastpath_conntrack_operations_total",
                &[("counter", &c.name)],
                c.value,
            );
        }
        o.family(
            "fastpath_vxlan_learning_total",
            "counter",
            "VXLAN flow cache: headers learned from the kernel's vxlan devices, packets whose headers the cache cannot use, arriving GRO aggregates left to the kernel at TC.",
        );
        for c in &s.vxlan {
            o.sample(
                "fastpath_vxlan_learning_total",
                &[("counter", &c.name)],
                c.value,
            );
        }
        o.family(
            "fastpath_vxlan_generation",
            "gauge",
            "Current generation of learned VXLAN headers and cached routes (each route, neighbour, link or configuration change starts one).",
        );
        o.sample("fastpath_vxlan_generation", &[], s.vxlan_generation);
        o.family(
            "fastpath_route_cache_total",
            "counter",
            "Route cache: routed packets that took their flow's cached FIB answer (hit), asked the FIB (miss), found an answer of an older generation or past its second (stale).",
        );
        for c in &s.route_cache {
            o.sample(
                "fastpath_route_cache_total",
                &[("counter", &c.name)],
                c.value,
            );
        }
    }
    let Ok(rules) = shared.rules().await else {
        return o.0;
    };
    let (capacity, generation, health, services) = (
        *rules.config().conntrack.capacity.get_ref(),
        rules.generation(),
        rules.health(),
        rules
            .config()
            .services
            .iter()
            .map(|s| s.id())
            .collect::<Vec<_>>(),
    );
    drop(rules);
    let occupancy = shared.gc.occupancy.load(Ordering::Relaxed);
    o.family(
        "fastpath_conntrack_entries",
        "gauge",
        "Tracked connections at the last expiry pass (every entry counted).",
    );
    o.sample("fastpath_conntrack_entries", &[], occupancy);
    o.family(
        "fastpath_conntrack_capacity",
        "gauge",
        "Size of the conntrack table.",
    );
    o.sample("fastpath_conntrack_capacity", &[], capacity);
    o.family(
        "fastpath_conntrack_pressure_ratio",
        "gauge",
        "Entries over capacity: new connections fail (insert_failed) near 1.",
    );
    o.sample(
        "fastpath_conntrack_pressure_ratio",
        &[],
        occupancy as f64 / f64::from(capacity.max(1)),
    );
    o.family(
        "fastpath_conntrack_expired_total",
        "counter",
        "Connections removed by the expiry for being idle past their timeout.",
    );
    o.sample(
        "fastpath_conntrack_expired_total",
        &[],
        shared.gc.expired_total.load(Ordering::Relaxed),
    );
    o.family(
        "fastpath_conntrack_gc_pass_seconds",
        "gauge",
        "Duration of the last expiry pass.",
    );
    o.sample(
        "fastpath_conntrack_gc_pass_seconds",
        &[],
        shared.gc.last_pass_us.load(Ordering::Relaxed) as f64 / 1e6,
    );
    o.family(
        "fastpath_conntrack_events_total",
        "counter",
        "Conntrack events read from the datapath's ring, and lost by slow subscribers.",
    );
    let ev = &shared.hub.stats;
    for (what, v) in [
        ("drained", ev.drained.load(Ordering::Relaxed)),
        ("malformed", ev.malformed.load(Ordering::Relaxed)),
        ("lagged", ev.lagged.load(Ordering::Relaxed)),
    ] {
        o.sample("fastpath_conntrack_events_total", &[("outcome", what)], v);
    }
    o.family(
        "fastpath_desired_generation",
        "gauge",
        "Generation of the desired state (each accepted change adds one).",
    );
    o.sample("fastpath_desired_generation", &[], generation);
    o.family(
        "fastpath_services",
        "gauge",
        "Services (and port forwards) in the desired state.",
    );
    o.sample("fastpath_services", &[], services.len());

    let pin = shared.pin_dir.clone();
    let rows = tokio::task::spawn_blocking(move || crate::datapath::pinned_services(&pin))
        .await
        .ok()
        .and_then(Result::ok)
        .unwrap_or_default();
    let svc_name = |r: &crate::datapath::ServiceRow| {
        format!(
            "{}/{}",
            std::net::SocketAddr::new(r.vip, r.port),
            r.protocol
        )
    };
    for (name, help, get) in [
        (
            "fastpath_service_packets_total",
            "Packets of a service's connections, both directions.",
            (|r: &crate::datapath::ServiceRow| r.packets)
                as fn(&crate::datapath::ServiceRow) -> u64,
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
    ] {
        o.family(name, "counter", help);
        for r in &rows {
            o.sample(name, &[("service", &svc_name(r))], get(r));
        }
    }
    type B = crate::datapath::BackendRow;
    for (name, kind, help, get) in [
        (
            "fastpath_backend_packets_total",
            "counter",
            "Packets of a backend's connections, both directions.",
            (|b: &B| b.packets as f64) as fn(&B) -> f64,
        ),
        (
            "fastpath_backend_bytes_total",
            "counter",
            "Bytes of a backend's connections, both directions.",
            |b| b.bytes as f64,
        ),
        (
            "fastpath_backend_connections_total",
            "counter",
            "Connections given this backend.",
            |b| b.connections as f64,
        ),
        (
            "fastpath_backend_active_connections",
            "gauge",
            "Connections of this backend tracked now and not closed.",
            |b| b.active as f64,
        ),
        (
            "fastpath_backend_share_ratio",
            "gauge",
            "Share of new connections the selection table gives this backend.",
            |b| b.share_pct / 100.0,
        ),
    ] {
        o.family(name, kind, help);
        for r in &rows {
            let svc = svc_name(r);
            for b in &r.backends {
                let backend = std::net::SocketAddr::new(b.address, b.port).to_string();
                o.sample(name, &[("service", &svc), ("backend", &backend)], get(b));
            }
        }
    }
    o.family(
        "fastpath_backend_up",
        "gauge",
        "Health of probed backends: 1 up, 0 down.",
    );
    for h in &health {
        o.sample(
            "fastpath_backend_up",
            &[
                ("service", &h.service.to_string()),
                ("backend", &h.backend.to_string()),
            ],
            u8::from(h.up),
        );
    }

    o.family(
        "fastpath_api_request_duration_seconds",
        "histogram",
        "Latency of management API requests, by method.",
    );
    let latency = shared.latency.snapshot();
    for (method, m) in &latency {
        for (i, le) in LATENCY_BUCKETS_S.iter().enumerate() {
            o.sample(
                "fastpath_api_request_duration_seconds_bucket",
                &[("method", method), ("le", &le.to_string())],
                m.buckets[i],
            );
        }
        o.sample(
            "fastpath_api_request_duration_seconds_bucket",
            &[("method", method), ("le", "+Inf")],
            m.count,
        );
        o.sample(
            "fastpath_api_request_duration_seconds_sum",
            &[("method", method)],
            m.sum_s,
        );
        o.sample(
            "fastpath_api_request_duration_seconds_count",
            &[("method", method)],
            m.count,
        );
    }
    o.family(
        "fastpath_api_requests_total",
        "counter",
        "Management API requests by method and status code.",
    );
    for (method, m) in &latency {
        let mut codes: Vec<_> = m.codes.iter().collect();
        codes.sort();
        for (code, n) in codes {
            o.sample(
                "fastpath_api_requests_total",
                &[("method", method), ("code", code)],
                n,
            );
        }
    }
    if let Some(ha) = &shared.ha {
        ha_metrics(&mut o, &ha.status());
    }
    o.0
}

/// HA replication: readiness, and per peer the stream out (queue, lag, resends, resyncs,
/// refusals) and the stream in (synced, installed, refused).
fn ha_metrics(o: &mut Out, s: &crate::api::pb::HaStatus) {
    o.family(
        "fastpath_ha_in_sync",
        "gauge",
        "1 when this node holds every peer's state (a failover manager may promote it).",
    );
    o.sample("fastpath_ha_in_sync", &[], u8::from(s.in_sync));
    o.family(
        "fastpath_ha_events_lost_total",
        "counter",
        "Conntrack events replication missed (ring or hub overflow); each makes the peers resync.",
    );
    o.sample("fastpath_ha_events_lost_total", &[], s.events_lost);
    o.family(
        "fastpath_ha_rejected_messages_total",
        "counter",
        "Peer messages refused whole (no or a wrong node id); their stream was closed.",
    );
    o.sample(
        "fastpath_ha_rejected_messages_total",
        &[],
        s.rejected_messages,
    );
    type Get = fn(&crate::api::pb::HaPeerOut) -> f64;
    let outs: [(&str, &str, &str, Get); 10] = [
        (
            "fastpath_ha_peer_connected",
            "gauge",
            "1 while this node's stream to the peer is up.",
            |p| f64::from(u8::from(p.connected)),
        ),
        (
            "fastpath_ha_send_queue",
            "gauge",
            "Changes queued for the peer and not acknowledged.",
            |p| p.queued as f64,
        ),
        (
            "fastpath_ha_send_lag_changes",
            "gauge",
            "Changes made here that the peer has not acknowledged (sequence lag).",
            |p| p.last_seq.saturating_sub(p.acked_seq) as f64,
        ),
        (
            "fastpath_ha_send_lag_seconds",
            "gauge",
            "Age of the oldest change the peer has not acknowledged (time lag).",
            |p| p.lag_ms as f64 / 1000.0,
        ),
        (
            "fastpath_ha_replication_lag_p99_seconds",
            "gauge",
            "99th percentile of change-to-acknowledgement time over the latest acknowledgements.",
            |p| p.lag_p99_us as f64 / 1e6,
        ),
        (
            "fastpath_ha_sent_changes_total",
            "counter",
            "Changes sent to the peer (resends included, snapshots not).",
            |p| p.sent_changes as f64,
        ),
        (
            "fastpath_ha_resyncs_total",
            "counter",
            "Snapshots sent to the peer (connects, resync requests, lost events, an overflowed queue).",
            |p| p.snapshots as f64,
        ),
        (
            "fastpath_ha_resends_total",
            "counter",
            "Resends of part of the queue after the peer saw a gap.",
            |p| p.resends as f64,
        ),
        (
            "fastpath_ha_rejected_total",
            "counter",
            "Acknowledgements from the peer this node refused (out of range, another epoch).",
            |p| p.rejected as f64,
        ),
        (
            "fastpath_ha_peer_rejected_total",
            "counter",
            "Changes the peer refused (malformed, unknown service or backend), never applied.",
            |p| p.peer_rejected as f64,
        ),
    ];
    for (name, kind, help, get) in outs {
        o.family(name, kind, help);
        for p in &s.peers_out {
            o.sample(name, &[("peer", &p.address)], get(p));
        }
    }
    type GetIn = fn(&crate::api::pb::HaPeerIn) -> f64;
    let ins: [(&str, &str, &str, GetIn); 5] = [
        (
            "fastpath_ha_node_synced",
            "gauge",
            "1 when this node received the node's snapshot and applied its stream since.",
            |p| f64::from(u8::from(p.synced)),
        ),
        (
            "fastpath_ha_node_connected",
            "gauge",
            "1 while the node's stream to this node is up.",
            |p| f64::from(u8::from(p.connected)),
        ),
        (
            "fastpath_ha_node_installed_entries",
            "gauge",
            "Conntrack entries from the node in this node's table.",
            |p| p.installed as f64,
        ),
        (
            "fastpath_ha_node_received_changes_total",
            "counter",
            "Changes received from the node (snapshot entries included).",
            |p| p.received_changes as f64,
        ),
        (
            "fastpath_ha_node_refused_total",
            "counter",
            "Changes from the node refused (malformed, out of range, stale), never applied.",
            |p| p.rejected as f64,
        ),
    ];
    for (name, kind, help, get) in ins {
        o.family(name, kind, help);
        for p in &s.peers_in {
            o.sample(name, &[("node", &p.node_id.to_string())], get(p));
        }
    }
}

/// Serves `GET /metrics` on `listener` until `shutdown` turns true.
pub async fn serve(
    listener: tokio::net::TcpListener,
    shared: Arc<Shared>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        let (mut sock, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => { warn!(error = %e, "metrics: accept failed"); continue; }
            },
            _ = shutdown.wait_for(|s| *s) => return,
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            let mut buf = Vec::with_capacity(1024);
            let mut chunk = [0u8; 1024];
            // Read the request head (bounded: 8 KiB, 5 s).
            let head = tokio::time::timeout(std::time::Duration::from_secs(5), async {
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < 8192 {
                    match sock.read(&mut chunk).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
            })
            .await;
            if head.is_err() {
                return;
            }
            let line = String::from_utf8_lossy(&buf);
            let mut parts = line.split_whitespace();
            let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
            let path = path.split('?').next().unwrap_or("");
            let (status, ctype, body) = match (method, path) {
                ("GET", "/metrics") => (
                    "200 OK",
                    "text/plain; version=0.0.4; charset=utf-8",
                    render(&shared).await,
                ),
                ("GET", _) => (
                    "404 Not Found",
                    "text/plain",
                    "fastpath serves /metrics only\n".to_string(),
                ),
                _ => (
                    "405 Method Not Allowed",
                    "text/plain",
                    "GET /metrics\n".to_string(),
                ),
            };
            debug!(%peer, path, status, "metrics request");
            let head = format!(
                "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = sock.write_all(head.as_bytes()).await;
            let _ = sock.write_all(body.as_bytes()).await;
            let _ = sock.shutdown().await;
        });
    }
}
