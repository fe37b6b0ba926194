//! The `fastpath.v1.Fastpath` service and its listeners: a Unix socket (mode 0600) always,
//! TCP with TLS and client certificates when configured.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    pin::Pin,
    sync::Arc,
    time::{Duration, Instant},
};

use tokio_stream::{Stream, StreamExt as _, wrappers::ReceiverStream};
use tonic::{Request, Response, Status};
use tracing::{info, warn};

use super::{API_VERSION, MAX_MESSAGE_BYTES, convert, pb, read};
use crate::{
    config::{Config, InterfaceCheck, ServiceConfig, ServiceId},
    ct_events::{self, EventHub},
    ct_gc::GcStats,
    metrics::ApiLatency,
    rules::{ChangeSummary, RejectKind, Rejected, Rules},
};

/// The name of a gRPC status code, as logs and metrics show it.
pub(crate) fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code as C;
    match code {
        C::Ok => "OK",
        C::InvalidArgument => "INVALID_ARGUMENT",
        C::NotFound => "NOT_FOUND",
        C::AlreadyExists => "ALREADY_EXISTS",
        C::FailedPrecondition => "FAILED_PRECONDITION",
        C::Internal => "INTERNAL",
        C::ResourceExhausted => "RESOURCE_EXHAUSTED",
        C::Unavailable => "UNAVAILABLE",
        _ => "OTHER",
    }
}

/// What the API serves from, shared with the daemon's loop and the metrics endpoint.
pub struct Shared {
    /// The desired state and the datapath; `None` once the daemon is stopping.
    pub rules: tokio::sync::Mutex<Option<Rules>>,
    pub pin_dir: PathBuf,
    pub hub: EventHub,
    pub gc: Arc<GcStats>,
    pub started: Instant,
    pub listeners: Vec<String>,
    pub latency: ApiLatency,
    /// HA replication, when `[ha]` is configured.
    pub ha: Option<Arc<crate::ha::Ha>>,
    /// What the node announces, and its drain, when `[announce]` is configured.
    pub announce: Option<crate::announce::Handle>,
}

impl Shared {
    /// The rules, locked (mutations are serialized here); UNAVAILABLE once the daemon stops.
    pub async fn rules(&self) -> Result<tokio::sync::MappedMutexGuard<'_, Rules>, Status> {
        tokio::sync::MutexGuard::try_map(self.rules.lock().await, Option::as_mut).map_err(|_| {
            Status::unavailable("the daemon is stopping; retry when it has started again")
        })
    }
}

#[derive(Clone)]
pub struct Api(pub Arc<Shared>);

type Streamed<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

fn datapath_status(e: crate::datapath::DatapathError) -> Status {
    Status::unavailable(format!(
        "reading the datapath: {e}; is the daemon's datapath still attached? (`fastpath detach` removes a broken one, then restart the daemon)"
    ))
}

/// Runs blocking map reads off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, crate::datapath::DatapathError> + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(format!("map read task failed: {e}")))?
        .map_err(datapath_status)
}

fn change_response(s: ChangeSummary) -> pb::ChangeResponse {
    pb::ChangeResponse {
        generation: s.generation,
        created: s.created,
        updated: s.updated,
        deleted: s.deleted,
        unchanged: s.unchanged,
        took_us: s.took_us,
        dry_run: s.dry_run,
    }
}

fn find_service(
    services: &mut [ServiceConfig],
    id: ServiceId,
) -> Result<&mut ServiceConfig, Rejected> {
    services.iter_mut().find(|s| s.id() == id).ok_or_else(|| {
        Rejected::new(
            RejectKind::NotFound,
            format!("no service {id}; `fastpath service list` shows the services"),
        )
    })
}

impl Api {
    async fn observed<T>(
        &self,
        method: &'static str,
        f: impl Future<Output = Result<T, Status>>,
    ) -> Result<T, Status> {
        let started = Instant::now();
        let r = f.await;
        let code = r.as_ref().map_or_else(|s| s.code(), |_| tonic::Code::Ok);
        self.0.latency.record(method, started.elapsed(), code);
        if let Err(s) = &r
            && s.code() != tonic::Code::NotFound
        {
            info!(method, code = code_name(s.code()), message = %s.message(), "API request refused");
        }
        r
    }

    /// One mutation of the services, under the rules lock (serialized with every other).
    async fn change(
        &self,
        expected_generation: u64,
        dry_run: bool,
        edit: impl FnOnce(&mut Vec<ServiceConfig>) -> Result<(), Rejected> + Send,
    ) -> Result<Response<pb::ChangeResponse>, Status> {
        let mut rules = self.0.rules().await?;
        let summary = tokio::task::block_in_place(|| {
            rules.change_services(expected_generation, dry_run, "<api>", edit)
        })?;
        Ok(Response::new(change_response(summary)))
    }

    /// One change of a service's backends: `each` applied to every backend of the request.
    async fn backends_change(
        &self,
        req: pb::BackendsRequest,
        each: impl Fn(
            &mut ServiceConfig,
            crate::config::BackendConfig,
            ServiceId,
        ) -> Result<(), Rejected>
        + Send,
    ) -> Result<Response<pb::ChangeResponse>, Status> {
        let (id, backends) = backends_of(&req)?;
        self.change(req.expected_generation, req.dry_run, move |services| {
            let svc = find_service(services, id)?;
            for b in backends {
                each(svc, b, id)?;
            }
            Ok(())
        })
        .await
    }

    /// Services merged from the desired state and what the datapath counted.
    async fn service_statuses(&self) -> Result<(Vec<pb::ServiceStatus>, u64), Status> {
        let pin = self.0.pin_dir.clone();
        let rows = blocking(move || crate::datapath::pinned_services(&pin)).await?;
        let rules = self.0.rules().await?;
        let mut out = Vec::new();
        let mut seen = Vec::new();
        for svc in &rules.config().services {
            let id = svc.id();
            seen.push(id);
            let row = rows
                .iter()
                .find(|r| r.vip == id.vip && r.port == id.port && r.protocol == id.protocol.name());
            out.push(convert::service_status(Some(svc), row, |b| {
                rules.backend_health(id, b)
            }));
        }
        // In the datapath but not desired (left by a failed change): shown, not hidden.
        for r in &rows {
            if !seen
                .iter()
                .any(|id| r.vip == id.vip && r.port == id.port && r.protocol == id.protocol.name())
            {
                out.push(convert::service_status(None, Some(r), |_| "unknown"));
            }
        }
        Ok((out, rules.generation()))
    }
}

#[tonic::async_trait]
impl pb::fastpath_server::Fastpath for Api {
    async fn get_info(&self, _: Request<pb::GetInfoRequest>) -> Result<Response<pb::Info>, Status> {
        self.observed("GetInfo", async {
            let rules = self.0.rules().await?;
            let c = rules.config();
            Ok(Response::new(pb::Info {
                version: env!("CARGO_PKG_VERSION").into(),
                api_version: API_VERSION.into(),
                pid: std::process::id(),
                uptime_s: self.0.started.elapsed().as_secs(),
                pin_dir: self.0.pin_dir.display().to_string(),
                config_path: rules.config_path().display().to_string(),
                generation: rules.generation(),
                services: c.services.len() as u32,
                interfaces: c.interfaces.len() as u32,
                conntrack_capacity: *c.conntrack.capacity.get_ref(),
                listeners: self.0.listeners.clone(),
                tc_attach: rules.datapath().tc_path().name().into(),
                kernel_release: crate::datapath::kernel::release(),
                kernel_features: rules
                    .datapath()
                    .kernel()
                    .list()
                    .into_iter()
                    .map(|f| pb::KernelFeature {
                        name: f.name.into(),
                        since: f.since.into(),
                        present: f.present,
                        without: f.without.into(),
                    })
                    .collect(),
            }))
        })
        .await
    }

    async fn get_ha_status(
        &self,
        _: Request<pb::GetHaStatusRequest>,
    ) -> Result<Response<pb::HaStatus>, Status> {
        self.observed("GetHaStatus", async {
            Ok(Response::new(
                self.0
                    .ha
                    .as_ref()
                    .map_or_else(pb::HaStatus::default, |ha| ha.status()),
            ))
        })
        .await
    }

    async fn get_announce_status(
        &self,
        _: Request<pb::GetAnnounceStatusRequest>,
    ) -> Result<Response<pb::AnnounceStatus>, Status> {
        self.observed("GetAnnounceStatus", async {
            Ok(Response::new(
                self.0
                    .announce
                    .as_ref()
                    .map_or_else(pb::AnnounceStatus::default, |a| {
                        convert::announce_status(a.table, &a.status.borrow())
                    }),
            ))
        })
        .await
    }

    async fn drain(
        &self,
        req: Request<pb::DrainRequest>,
    ) -> Result<Response<pb::AnnounceStatus>, Status> {
        self.observed("Drain", async {
            let a = self.0.announce.as_ref().ok_or_else(|| {
                Status::failed_precondition(
                    "this node announces nothing (its config has no [announce] section), so there is nothing to withdraw: move its addresses with the failover manager instead, or configure [announce]",
                )
            })?;
            let request = convert::drain_request(req.get_ref())?;
            info!(?request, "Drain asked");
            a.drain.send_replace(request);
            // The announcer takes it at its next pass (100 ms): answer with what it did.
            let draining = request.is_some();
            let mut status = a.status.clone();
            let took = tokio::time::timeout(
                Duration::from_secs(2),
                status.wait_for(|s| {
                    use crate::announce::Readiness as R;
                    matches!(s.readiness, R::Draining | R::Drained | R::Stopped) == draining
                }),
            )
            .await;
            if !matches!(took, Ok(Ok(_))) {
                return Err(Status::unavailable(
                    "the announcer did not take the request within 2 s (is the daemon stopping?); `fastpath cluster status` shows where it is",
                ));
            }
            Ok(Response::new(convert::announce_status(
                a.table,
                &a.status.borrow(),
            )))
        })
        .await
    }

    async fn list_services(
        &self,
        _: Request<pb::ListServicesRequest>,
    ) -> Result<Response<pb::ListServicesResponse>, Status> {
        self.observed("ListServices", async {
            let (services, generation) = self.service_statuses().await?;
            Ok(Response::new(pb::ListServicesResponse {
                services,
                generation,
            }))
        })
        .await
    }

    async fn get_service(
        &self,
        req: Request<pb::ServiceKey>,
    ) -> Result<Response<pb::ServiceStatus>, Status> {
        self.observed("GetService", async {
            let id = convert::service_id("key", Some(req.get_ref()))?;
            let (services, _) = self.service_statuses().await?;
            let key = convert::service_key(id);
            services
                .into_iter()
                .find(|s| s.spec.as_ref().and_then(|s| s.key.as_ref()) == Some(&key))
                .map(Response::new)
                .ok_or_else(|| {
                    Status::not_found(format!(
                        "no service {id}; `fastpath service list` shows the services"
                    ))
                })
        })
        .await
    }

    async fn create_services(
        &self,
        req: Request<pb::ServicesRequest>,
    ) -> Result<Response<pb::ChangeResponse>, Status> {
        self.observed("CreateServices", async {
            let req = req.into_inner();
            let new = specs(&req.services)?;
            self.change(req.expected_generation, req.dry_run, move |services| {
                for s in new {
                    if services.iter().any(|o| o.id() == s.id()) {
                        return Err(Rejected::new(
                            RejectKind::AlreadyExists,
                            format!(
                                "service {} already exists; change its backends with `fastpath backend add|del|drain`, the whole service with UpdateServices or `fastpath apply`, or delete it first",
                                s.id()
                            ),
                        ));
                    }
                    services.push(s);
                }
                Ok(())
            })
            .await
        })
        .await
    }

    async fn update_services(
        &self,
        req: Request<pb::ServicesRequest>,
    ) -> Result<Response<pb::ChangeResponse>, Status> {
        self.observed("UpdateServices", async {
            let req = req.into_inner();
            let new = specs(&req.services)?;
            self.change(req.expected_generation, req.dry_run, move |services| {
                for s in new {
                    let slot = find_service(services, s.id())?;
                    *slot = s;
                }
                Ok(())
            })
            .await
        })
        .await
    }

    async fn delete_services(
        &self,
        req: Request<pb::DeleteServicesRequest>,
    ) -> Result<Response<pb::ChangeResponse>, Status> {
        self.observed("DeleteServices", async {
            let req = req.into_inner();
            let ids = req
                .keys
                .iter()
                .enumerate()
                .map(|(i, k)| convert::service_id(&format!("keys[{i}]"), Some(k)))
                .collect::<Result<Vec<_>, _>>()?;
            self.change(req.expected_generation, req.dry_run, move |services| {
                for id in ids {
                    find_service(services, id)?;
                    services.retain(|s| s.id() != id);
                }
                Ok(())
            })
            .await
        })
        .await
    }

    async fn add_backends(
        &self,
        req: Request<pb::BackendsRequest>,
    ) -> Result<Response<pb::ChangeResponse>, Status> {
        self.observed(
            "AddBackends",
            self.backends_change(req.into_inner(), |svc, b, id| {
                if let Some(o) = svc.backends.iter().find(|o| same_backend(o, &b)) {
                    return Err(Rejected::new(
                        RejectKind::AlreadyExists,
                        format!(
                            "{} is already a backend of {id} (weight {}); remove it first to add it again",
                            SocketAddr::new(*o.address.get_ref(), *o.port.get_ref()),
                            o.weight.get_ref()
                        ),
                    ));
                }
                svc.backends.push(b);
                Ok(())
            }),
        )
        .await
    }

    async fn remove_backends(
        &self,
        req: Request<pb::BackendsRequest>,
    ) -> Result<Response<pb::ChangeResponse>, Status> {
        self.observed(
            "RemoveBackends",
            self.backends_change(req.into_inner(), |svc, b, id| {
                let i = backend_index(svc, &b, id)?;
                svc.backends.remove(i);
                Ok(())
            }),
        )
        .await
    }

    async fn drain_backends(
        &self,
        req: Request<pb::BackendsRequest>,
    ) -> Result<Response<pb::ChangeResponse>, Status> {
        self.observed(
            "DrainBackends",
            self.backends_change(req.into_inner(), |svc, b, id| {
                let i = backend_index(svc, &b, id)?;
                svc.backends[i].weight = toml::Spanned::new(0..0, 0);
                Ok(())
            }),
        )
        .await
    }

    async fn list_nat_rules(
        &self,
        _: Request<pb::ListNatRulesRequest>,
    ) -> Result<Response<pb::NatRules>, Status> {
        self.observed("ListNatRules", async {
            let rules = self.0.rules().await?;
            let c = rules.config();
            Ok(Response::new(pb::NatRules {
                port_forwards: c
                    .services
                    .iter()
                    .filter(|s| s.port_forward)
                    .map(convert::port_forward_pb)
                    .collect(),
                snat: c
                    .interfaces
                    .iter()
                    .filter(|i| i.snat)
                    .map(|i| pb::SnatRule {
                        interface: i.name.get_ref().clone(),
                        addresses: i
                            .snat_addresses
                            .as_ref()
                            .map(|a| a.get_ref().iter().map(ToString::to_string).collect())
                            .unwrap_or_default(),
                        ports: i.snat_ports.as_ref().map_or_else(
                            || crate::config::PortRange::DEFAULT_SNAT.to_string(),
                            |r| r.get_ref().to_string(),
                        ),
                    })
                    .collect(),
            }))
        })
        .await
    }

    async fn create_port_forwards(
        &self,
        req: Request<pb::PortForwardsRequest>,
    ) -> Result<Response<pb::ChangeResponse>, Status> {
        self.observed("CreatePortForwards", async {
            let req = req.into_inner();
            let new = req
                .port_forwards
                .iter()
                .enumerate()
                .map(|(i, f)| convert::port_forward(&format!("port_forwards[{i}]"), f))
                .collect::<Result<Vec<_>, _>>()?;
            self.change(req.expected_generation, req.dry_run, move |services| {
                for s in new {
                    if services.iter().any(|o| o.id() == s.id()) {
                        return Err(Rejected::new(
                            RejectKind::AlreadyExists,
                            format!("{} is already a service or port forward; keep one", s.id()),
                        ));
                    }
                    services.push(s);
                }
                Ok(())
            })
            .await
        })
        .await
    }

    async fn delete_port_forwards(
        &self,
        req: Request<pb::PortForwardsRequest>,
    ) -> Result<Response<pb::ChangeResponse>, Status> {
        self.observed("DeletePortForwards", async {
            let req = req.into_inner();
            let ids = req
                .port_forwards
                .iter()
                .enumerate()
                .map(|(i, f)| {
                    let field = format!("port_forwards[{i}]");
                    Ok(ServiceId {
                        vip: convert::ip(&format!("{field}.address"), &f.address)?,
                        port: convert::port(&format!("{field}.port"), f.port)?,
                        protocol: convert::protocol(&format!("{field}.protocol"), f.protocol)?,
                    })
                })
                .collect::<Result<Vec<_>, Rejected>>()?;
            self.change(req.expected_generation, req.dry_run, move |services| {
                for id in ids {
                    if !services.iter().any(|s| s.id() == id && s.port_forward) {
                        return Err(Rejected::new(
                            RejectKind::NotFound,
                            format!("no port forward {id}; `fastpath nat list` shows them"),
                        ));
                    }
                    services.retain(|s| s.id() != id);
                }
                Ok(())
            })
            .await
        })
        .await
    }

    async fn list_interfaces(
        &self,
        _: Request<pb::ListInterfacesRequest>,
    ) -> Result<Response<pb::ListInterfacesResponse>, Status> {
        self.observed("ListInterfaces", async {
            let rules = self.0.rules().await?;
            let attachments = &rules.datapath().attachments;
            let interfaces = rules
                .config()
                .interfaces
                .iter()
                .map(|i| {
                    let name = i.name.get_ref();
                    pb::InterfaceStatus {
                        name: name.clone(),
                        ifindex: crate::sys::ifindex(name).unwrap_or(0),
                        xdp: format!("{:?}", i.xdp).to_lowercase(),
                        tc_ingress: i.tc_ingress,
                        tc_egress: i.tc_egress,
                        conntrack: i.conntrack,
                        stateful_firewall: i.stateful_firewall,
                        snat: i.snat,
                        route: i.route,
                        vlan: i.vlan.as_ref().map_or(0, |v| u32::from(*v.get_ref())),
                        hooks: attachments
                            .iter()
                            .filter(|a| &a.iface == name)
                            .map(|a| format!("{}({})", a.hook.name(), a.mode))
                            .collect(),
                    }
                })
                .collect();
            Ok(Response::new(pb::ListInterfacesResponse { interfaces }))
        })
        .await
    }

    async fn list_connections(
        &self,
        req: Request<pb::ListConnectionsRequest>,
    ) -> Result<Response<pb::ListConnectionsResponse>, Status> {
        self.observed("ListConnections", async {
            let pin = self.0.pin_dir.clone();
            let mut all = blocking(move || read::connections(&pin)).await?;
            let total = all.len() as u64;
            let limit = req.get_ref().limit as usize;
            if limit > 0 {
                all.truncate(limit);
            }
            Ok(Response::new(pb::ListConnectionsResponse {
                connections: all,
                total,
            }))
        })
        .await
    }

    async fn get_connection(
        &self,
        req: Request<pb::ConnectionQuery>,
    ) -> Result<Response<pb::Connection>, Status> {
        self.observed("GetConnection", async {
            let q = req.into_inner();
            let key = query_key(&q)?;
            let pin = self.0.pin_dir.clone();
            blocking(move || read::connection(&pin, &key))
                .await?
                .map(Response::new)
                .ok_or_else(|| {
                    Status::not_found(format!(
                        "{} {} -> {} is not tracked (either direction); `fastpath ct list` shows what is",
                        q.protocol, q.src, q.dst
                    ))
                })
        })
        .await
    }

    async fn flush_connections(
        &self,
        _: Request<pb::FlushConnectionsRequest>,
    ) -> Result<Response<pb::FlushConnectionsResponse>, Status> {
        self.observed("FlushConnections", async {
            let pin = self.0.pin_dir.clone();
            let n = blocking(move || crate::datapath::flush_pinned_ct(&pin)).await?;
            info!(deleted = n, "Conntrack table flushed through the API");
            // No event describes a flush: the peers resync to the (now empty) table.
            if let Some(ha) = &self.0.ha {
                ha.resync_all();
            }
            Ok(Response::new(pb::FlushConnectionsResponse {
                deleted: n as u64,
            }))
        })
        .await
    }

    type WatchConnectionsStream = Streamed<pb::ConnectionEvent>;

    async fn watch_connections(
        &self,
        _: Request<pb::WatchConnectionsRequest>,
    ) -> Result<Response<Self::WatchConnectionsStream>, Status> {
        self.observed("WatchConnections", async {
            let rx = self.0.hub.subscribe();
            let stats = self.0.hub.stats.clone();
            let stream =
                tokio_stream::wrappers::BroadcastStream::new(rx).filter_map(move |ev| match ev {
                    Ok(ev) => {
                        let row = ct_events::event_row(&ev);
                        Some(Ok(pb::ConnectionEvent {
                            kind: ct_events::kind_name(&ev).into(),
                            timestamp_ns: ev.ts_ns,
                            line: ct_events::render(&ev),
                            protocol: row.proto.clone(),
                            src: row.original.src.to_string(),
                            dst: row.original.dst.to_string(),
                            sport: u32::from(row.original.sport),
                            dport: u32::from(row.original.dport),
                            state: row.state,
                        }))
                    }
                    Err(tokio_stream::wrappers::errors::BroadcastStreamRecvError::Lagged(n)) => {
                        stats
                            .lagged
                            .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
                        None
                    }
                });
            Ok(Response::new(
                Box::pin(stream) as Self::WatchConnectionsStream
            ))
        })
        .await
    }

    async fn get_stats(
        &self,
        req: Request<pb::GetStatsRequest>,
    ) -> Result<Response<pb::Stats>, Status> {
        self.observed("GetStats", async {
            let skip = req.get_ref().skip_conntrack_entries;
            let pin = self.0.pin_dir.clone();
            let mut stats = blocking(move || read::stats(&pin, skip)).await?;
            stats.services = self.service_statuses().await?.0;
            Ok(Response::new(stats))
        })
        .await
    }

    type WatchStatsStream = Streamed<pb::Stats>;

    async fn watch_stats(
        &self,
        req: Request<pb::WatchStatsRequest>,
    ) -> Result<Response<Self::WatchStatsStream>, Status> {
        self.observed("WatchStats", async {
            let r = req.into_inner();
            let interval = Duration::from_millis(match r.interval_ms {
                0 => 1000,
                ms => u64::from(ms.max(100)),
            });
            let (tx, rx) = tokio::sync::mpsc::channel(2);
            let api = self.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(interval);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tick.tick().await;
                    let pin = api.0.pin_dir.clone();
                    let skip = r.skip_conntrack_entries;
                    let mut s = blocking(move || read::stats(&pin, skip)).await;
                    if let Ok(stats) = &mut s {
                        match api.service_statuses().await {
                            Ok((services, _)) => stats.services = services,
                            Err(e) => {
                                let _ = tx.send(Err(e)).await;
                                return;
                            }
                        }
                    }
                    if tx.send(s).await.is_err() {
                        return;
                    }
                }
            });
            Ok(Response::new(
                Box::pin(ReceiverStream::new(rx)) as Self::WatchStatsStream
            ))
        })
        .await
    }

    async fn get_health(
        &self,
        _: Request<pb::GetHealthRequest>,
    ) -> Result<Response<pb::HealthStatus>, Status> {
        self.observed("GetHealth", async {
            let rules = self.0.rules().await?;
            Ok(Response::new(pb::HealthStatus {
                backends: rules.health().iter().map(backend_health).collect(),
            }))
        })
        .await
    }

    type WatchHealthStream = Streamed<pb::HealthEvent>;

    async fn watch_health(
        &self,
        _: Request<pb::WatchHealthRequest>,
    ) -> Result<Response<Self::WatchHealthStream>, Status> {
        self.observed("WatchHealth", async {
            let rx = self.0.rules().await?.subscribe_health();
            let stream =
                tokio_stream::wrappers::BroadcastStream::new(rx).filter_map(|ev| match ev {
                    Ok(h) => Some(Ok(pb::HealthEvent {
                        backend: Some(backend_health(&h)),
                        timestamp_ns: crate::conntrack::monotonic_ns(),
                    })),
                    Err(_) => None,
                });
            Ok(Response::new(Box::pin(stream) as Self::WatchHealthStream))
        })
        .await
    }

    async fn apply(
        &self,
        req: Request<pb::ApplyRequest>,
    ) -> Result<Response<pb::ApplyResponse>, Status> {
        self.observed("Apply", async {
            let req = req.into_inner();
            let source = if req.source_name.is_empty() {
                "<apply>".to_string()
            } else {
                req.source_name.clone()
            };
            let new = Config::parse_with(
                Path::new(&source),
                &req.config_toml,
                InterfaceCheck::MustExist,
            )
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
            let mut rules = self.0.rules().await?;
            let summary = tokio::task::block_in_place(|| {
                rules.apply_config(new, req.expected_generation, req.dry_run, false)
            })?;
            let notes = summary.notes.clone();
            Ok(Response::new(pb::ApplyResponse {
                change: Some(change_response(summary)),
                notes,
            }))
        })
        .await
    }
}

fn specs(specs: &[pb::ServiceSpec]) -> Result<Vec<ServiceConfig>, Rejected> {
    if specs.is_empty() {
        return Err(Rejected::new(
            RejectKind::Invalid,
            "services: empty; give at least one service",
        ));
    }
    specs
        .iter()
        .enumerate()
        .map(|(i, s)| convert::service(&format!("services[{i}]"), s))
        .collect()
}

fn backends_of(
    req: &pb::BackendsRequest,
) -> Result<(ServiceId, Vec<crate::config::BackendConfig>), Rejected> {
    let id = convert::service_id("service", req.service.as_ref())?;
    if req.backends.is_empty() {
        return Err(Rejected::new(
            RejectKind::Invalid,
            "backends: empty; give at least one backend",
        ));
    }
    let list = req
        .backends
        .iter()
        .enumerate()
        .map(|(i, b)| convert::backend(&format!("backends[{i}]"), b))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((id, list))
}

fn same_backend(a: &crate::config::BackendConfig, b: &crate::config::BackendConfig) -> bool {
    a.address == b.address && a.port == b.port
}

fn backend_index(
    svc: &ServiceConfig,
    b: &crate::config::BackendConfig,
    id: ServiceId,
) -> Result<usize, Rejected> {
    svc.backends
        .iter()
        .position(|o| same_backend(o, b))
        .ok_or_else(|| {
            Rejected::new(
                RejectKind::NotFound,
                format!(
                    "{} is not a backend of {id}; `fastpath service show` lists them",
                    SocketAddr::new(*b.address.get_ref(), *b.port.get_ref())
                ),
            )
        })
}

fn backend_health(h: &crate::rules::BackendHealth) -> pb::BackendHealth {
    pb::BackendHealth {
        service: Some(convert::service_key(h.service)),
        address: h.backend.ip().to_string(),
        port: u32::from(h.backend.port()),
        up: h.up,
        detail: h.detail.clone(),
    }
}

fn query_key(q: &pb::ConnectionQuery) -> Result<fastpath_common::ct::CtKey, Rejected> {
    let opt = |v: u32, field: &str| -> Result<Option<u16>, Rejected> {
        if v == 0 {
            Ok(None)
        } else {
            u16::try_from(v).map(Some).map_err(|_| {
                Rejected::new(RejectKind::Invalid, format!("{field}: {v}; give 1..=65535"))
            })
        }
    };
    crate::conntrack::lookup_key(
        &q.protocol,
        convert::ip("src", &q.src)?,
        convert::ip("dst", &q.dst)?,
        opt(q.sport, "sport")?,
        opt(q.dport, "dport")?,
        opt(q.id, "id")?,
    )
    .map_err(|m| Rejected::new(RejectKind::Invalid, m))
}

/// Binds the Unix socket at `path`: a stale socket of a dead daemon is replaced, a live one
/// refused. The socket is made mode 0600 (root only) before it accepts.
pub fn bind_unix(path: &Path) -> std::io::Result<tokio::net::UnixListener> {
    use std::os::unix::fs::PermissionsExt as _;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                format!(
                    "{} is served by another running daemon; stop it, or give this one its own [api] socket",
                    path.display()
                ),
            ));
        }
        std::fs::remove_file(path)?;
    }
    // Created with no permissions for anyone but the owner from the start.
    // SAFETY: umask only changes this process's file creation mask; restored right after.
    let old = unsafe { libc::umask(0o177) };
    let listener = tokio::net::UnixListener::bind(path);
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    let listener = listener?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// The TLS settings of the TCP listener, read from the files the config names.
pub fn server_tls(config: &Config) -> Result<Option<tonic::transport::ServerTlsConfig>, String> {
    let api = &config.api;
    let (Some(cert), Some(key), Some(ca)) = (&api.tls_cert, &api.tls_key, &api.tls_client_ca)
    else {
        return Ok(None);
    };
    let read = |p: &PathBuf| std::fs::read(p).map_err(|e| format!("reading {}: {e}", p.display()));
    let identity =
        tonic::transport::Identity::from_pem(read(cert.get_ref())?, read(key.get_ref())?);
    let ca = tonic::transport::Certificate::from_pem(read(ca.get_ref())?);
    Ok(Some(
        tonic::transport::ServerTlsConfig::new()
            .identity(identity)
            .client_ca_root(ca),
    ))
}

/// Serves the API on `unix` (and on `tcp`, with `tls` unless insecure TCP is allowed) until
/// `shutdown` fires. Both listeners also serve server reflection (`grpc.reflection.v1` and
/// `v1alpha`, describing `fastpath.v1`) and `grpc.health.v1.Health`: SERVING for "" and
/// `fastpath.v1.Fastpath` from the start, NOT_SERVING once `shutdown` fires, before the
/// listeners stop, so a client watching the health sees the daemon go.
pub async fn serve(
    api: Api,
    unix: tokio::net::UnixListener,
    tcp: Option<(
        tokio::net::TcpListener,
        Option<tonic::transport::ServerTlsConfig>,
    )>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_serving::<pb::fastpath_server::FastpathServer<Api>>()
        .await;
    let reflection = match reflection_services() {
        Ok(r) => Some(r),
        Err(e) => {
            // Not expected (the descriptor set is built with the binary); the API itself works.
            warn!(error = %e, "Server reflection is not served: the embedded descriptor set does not load");
            None
        }
    };
    let router = |builder: tonic::transport::Server, listener: &'static str| {
        let (v1, v1alpha) = reflection.clone().unzip();
        // One span per request: what a log line of its handling belongs to.
        builder
            .trace_fn(
                move |req| tracing::info_span!("api_request", listener, method = %req.uri().path()),
            )
            .add_service(
                pb::fastpath_server::FastpathServer::new(api.clone())
                    .max_decoding_message_size(MAX_MESSAGE_BYTES)
                    .max_encoding_message_size(MAX_MESSAGE_BYTES),
            )
            .add_service(health_service.clone())
            .add_optional_service(v1)
            .add_optional_service(v1alpha)
    };
    // The listeners stop after the health service has said NOT_SERVING.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut stop_unix = stop_rx.clone();
    // Unix socket clients' `:authority` is normalized (see `authority`); TCP's is not.
    let unix_incoming = tokio_stream::wrappers::UnixListenerStream::new(unix)
        .map(|conn| conn.map(super::authority::AuthorityFix::new));
    let unix_task = tokio::spawn(
        router(tonic::transport::Server::builder(), "unix").serve_with_incoming_shutdown(
            unix_incoming,
            async move {
                let _ = stop_unix.wait_for(|s| *s).await;
            },
        ),
    );
    let tcp_task = tcp.and_then(|(listener, tls)| {
        let mut builder = tonic::transport::Server::builder();
        if let Some(tls) = tls {
            match builder.tls_config(tls) {
                Ok(b) => builder = b,
                Err(e) => {
                    // Never fall back to plain TCP.
                    warn!(error = %e, "TLS setup of the API's TCP listener failed; it is not served");
                    return None;
                }
            }
        }
        let mut stop = stop_rx.clone();
        Some(tokio::spawn(router(builder, "tcp").serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            async move {
                let _ = stop.wait_for(|s| *s).await;
            },
        )))
    });
    let _ = shutdown.wait_for(|s| *s).await;
    health
        .set_service_status("", tonic_health::ServingStatus::NotServing)
        .await;
    health
        .set_not_serving::<pb::fastpath_server::FastpathServer<Api>>()
        .await;
    let _ = stop_tx.send(true);
    // Graceful shutdown waits for every connection to close; a client that keeps one open (a
    // `ct watch`, an idle channel) must not hold the daemon's stop: it gets SHUTDOWN_GRACE.
    for (what, task) in
        std::iter::once(("unix socket", unix_task)).chain(tcp_task.map(|t| ("TCP", t)))
    {
        let abort = task.abort_handle();
        match tokio::time::timeout(SHUTDOWN_GRACE, task).await {
            Ok(Ok(Err(e))) => warn!(error = %e, what, "API server failed"),
            Ok(_) => {}
            Err(_) => {
                info!(
                    what,
                    "API clients still connected at shutdown; closing their connections"
                );
                abort.abort();
            }
        }
    }
}

/// The reflection services, v1 and v1alpha (which clients such as Python's grpcio-reflection
/// and older grpcurl ask only), describing `fastpath.v1`, `grpc.health.v1` and themselves.
fn reflection_services() -> Result<
    (
        tonic_reflection::server::v1::ServerReflectionServer<
            impl tonic_reflection::server::v1::ServerReflection,
        >,
        tonic_reflection::server::v1alpha::ServerReflectionServer<
            impl tonic_reflection::server::v1alpha::ServerReflection,
        >,
    ),
    tonic_reflection::server::Error,
> {
    let builder = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    Ok((builder().build_v1()?, builder().build_v1alpha()?))
}

/// How long a stopping daemon waits for API clients to finish their requests.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(1);

#[cfg(test)]
mod tests {
    use super::*;

    /// The descriptor set build.rs embeds loads: reflection is served, and it knows the API.
    #[test]
    fn reflection_loads_the_embedded_descriptor_sets() {
        if let Err(e) = reflection_services() {
            panic!(
                "expected the reflection services to build from the embedded descriptor sets, got: {e}"
            );
        }
        use prost::Message as _;
        let set = prost_types::FileDescriptorSet::decode(pb::FILE_DESCRIPTOR_SET)
            .unwrap_or_else(|e| panic!("the embedded descriptor set does not decode: {e}"));
        let services: Vec<String> = set
            .file
            .iter()
            .flat_map(|f| {
                f.service
                    .iter()
                    .map(|s| format!("{}.{}", f.package(), s.name()))
            })
            .collect();
        assert_eq!(
            services,
            ["fastpath.v1.Fastpath"],
            "services in the reflected set"
        );
    }
}
