//! Requests ↔ the daemon's own types. Everything a client sends passes through here first:
//! each field is checked and an error names it (`services[0].backends[1].port`) and says what
//! to give instead. Nothing here touches state; whole-state checks follow in `rules`.

use std::net::{IpAddr, SocketAddr};

use toml::Spanned;

use super::pb;
use crate::{
    config::{
        self, BackendConfig, ForwardMode, HealthCheck, HealthKind, NoBackend, PortRange, Protocol,
        Scheduler, ServiceConfig, ServiceId,
    },
    conntrack::{CtRow, Tuple},
    datapath::{BackendRow, ServiceRow},
    rules::{RejectKind, Rejected},
    stats::StatsRow,
};

fn invalid(field: &str, message: impl std::fmt::Display) -> Rejected {
    Rejected::new(RejectKind::Invalid, format!("{field}: {message}"))
}

fn spanned<T>(v: T) -> Spanned<T> {
    Spanned::new(0..0, v)
}

pub fn ip(field: &str, s: &str) -> Result<IpAddr, Rejected> {
    s.trim().parse().map_err(|_| {
        invalid(
            field,
            format!("{s:?} is not an IP address; give one like 10.0.0.1 or fd00::1"),
        )
    })
}

pub fn port(field: &str, p: u32) -> Result<u16, Rejected> {
    match u16::try_from(p) {
        Ok(p) if p > 0 => Ok(p),
        _ => Err(invalid(field, format!("port {p}; give 1..=65535"))),
    }
}

pub fn protocol(field: &str, p: i32) -> Result<Protocol, Rejected> {
    match pb::Protocol::try_from(p) {
        Ok(pb::Protocol::Unspecified | pb::Protocol::Tcp) => Ok(Protocol::Tcp),
        Ok(pb::Protocol::Udp) => Ok(Protocol::Udp),
        Err(_) => Err(invalid(
            field,
            format!("protocol {p}; give TCP (1) or UDP (2)"),
        )),
    }
}

fn protocol_pb(p: Protocol) -> pb::Protocol {
    match p {
        Protocol::Tcp => pb::Protocol::Tcp,
        Protocol::Udp => pb::Protocol::Udp,
    }
}

pub fn service_id(field: &str, key: Option<&pb::ServiceKey>) -> Result<ServiceId, Rejected> {
    let key = key.ok_or_else(|| invalid(field, "missing; give vip, port and protocol"))?;
    Ok(ServiceId {
        vip: ip(&format!("{field}.vip"), &key.vip)?,
        port: port(&format!("{field}.port"), key.port)?,
        protocol: protocol(&format!("{field}.protocol"), key.protocol)?,
    })
}

pub fn service_key(id: ServiceId) -> pb::ServiceKey {
    pb::ServiceKey {
        vip: id.vip.to_string(),
        port: u32::from(id.port),
        protocol: protocol_pb(id.protocol) as i32,
    }
}

pub fn backend(field: &str, b: &pb::BackendSpec) -> Result<BackendConfig, Rejected> {
    let weight = b.weight.unwrap_or(1);
    if weight > 65_535 {
        return Err(invalid(
            &format!("{field}.weight"),
            format!("{weight}; give 0 (drained) ..= 65535"),
        ));
    }
    Ok(BackendConfig {
        address: spanned(ip(&format!("{field}.address"), &b.address)?),
        port: spanned(port(&format!("{field}.port"), b.port)?),
        weight: spanned(weight),
    })
}

fn backend_pb(b: &BackendConfig) -> pb::BackendSpec {
    pb::BackendSpec {
        address: b.address.get_ref().to_string(),
        port: u32::from(*b.port.get_ref()),
        weight: Some(*b.weight.get_ref()),
    }
}

fn health_check(field: &str, h: &pb::HealthCheckSpec) -> Result<HealthCheck, Rejected> {
    let kind = match h.kind.as_str() {
        "tcp" => HealthKind::Tcp,
        "http" => HealthKind::Http,
        k => {
            return Err(invalid(
                &format!("{field}.kind"),
                format!("{k:?}; give \"tcp\" or \"http\""),
            ));
        }
    };
    let or = |v: u64, d: Spanned<u64>| if v == 0 { d } else { spanned(v) };
    let or32 = |v: u32, d: Spanned<u32>| if v == 0 { d } else { spanned(v) };
    let probe_port = if h.port == 0 {
        None
    } else {
        Some(port(&format!("{field}.port"), h.port)?)
    };
    let expect_status = if h.expect_status == 0 {
        config::default_status()
    } else {
        u16::try_from(h.expect_status)
            .ok()
            .filter(|s| (100..=599).contains(s))
            .ok_or_else(|| {
                invalid(
                    &format!("{field}.expect_status"),
                    format!("{}; give an HTTP status, 100..=599", h.expect_status),
                )
            })?
    };
    Ok(HealthCheck {
        kind: spanned(kind),
        interval_ms: or(h.interval_ms, config::default_interval_ms()),
        timeout_ms: or(h.timeout_ms, config::default_timeout_ms()),
        rise: or32(h.rise, config::default_rise()),
        fall: or32(h.fall, config::default_fall()),
        port: probe_port,
        path: if h.path.is_empty() {
            config::default_path()
        } else {
            h.path.clone()
        },
        expect_status,
    })
}

fn health_check_pb(h: &HealthCheck) -> pb::HealthCheckSpec {
    pb::HealthCheckSpec {
        kind: match h.kind.get_ref() {
            HealthKind::Tcp => "tcp",
            HealthKind::Http => "http",
        }
        .into(),
        interval_ms: *h.interval_ms.get_ref(),
        timeout_ms: *h.timeout_ms.get_ref(),
        rise: *h.rise.get_ref(),
        fall: *h.fall.get_ref(),
        port: h.port.map_or(0, u32::from),
        path: h.path.clone(),
        expect_status: u32::from(h.expect_status),
    }
}

/// A service as a client describes it, checked field by field.
pub fn service(field: &str, s: &pb::ServiceSpec) -> Result<ServiceConfig, Rejected> {
    let id = service_id(&format!("{field}.key"), s.key.as_ref())?;
    let scheduler = match pb::Scheduler::try_from(s.scheduler) {
        Ok(pb::Scheduler::Unspecified | pb::Scheduler::Maglev) => Scheduler::Maglev,
        Ok(pb::Scheduler::Wrr) => Scheduler::Wrr,
        Ok(pb::Scheduler::LeastConnections) => Scheduler::LeastConnections,
        Err(_) => {
            return Err(invalid(
                &format!("{field}.scheduler"),
                format!("{}; give MAGLEV, WRR or LEAST_CONNECTIONS", s.scheduler),
            ));
        }
    };
    let no_backend = match pb::NoBackend::try_from(s.no_backend) {
        Ok(pb::NoBackend::Unspecified | pb::NoBackend::Kernel) => NoBackend::Kernel,
        Ok(pb::NoBackend::Drop) => NoBackend::Drop,
        Ok(pb::NoBackend::Reject) => NoBackend::Reject,
        Err(_) => {
            return Err(invalid(
                &format!("{field}.no_backend"),
                format!("{}; give KERNEL, DROP or REJECT", s.no_backend),
            ));
        }
    };
    let mode = match pb::ForwardMode::try_from(s.mode) {
        Ok(pb::ForwardMode::Unspecified | pb::ForwardMode::Nat) => ForwardMode::Nat,
        Ok(pb::ForwardMode::FullNat) => ForwardMode::FullNat,
        Ok(pb::ForwardMode::Dsr) => ForwardMode::Dsr,
        Err(_) => {
            return Err(invalid(
                &format!("{field}.mode"),
                format!("{}; give NAT, FULL_NAT or DSR", s.mode),
            ));
        }
    };
    let snat_address = if s.snat_address.is_empty() {
        None
    } else {
        Some(spanned(ip(
            &format!("{field}.snat_address"),
            &s.snat_address,
        )?))
    };
    let snat_ports = if s.snat_ports.is_empty() {
        None
    } else {
        Some(spanned(
            PortRange::try_from(s.snat_ports.clone())
                .map_err(|e| invalid(&format!("{field}.snat_ports"), e))?,
        ))
    };
    if s.backends.len() > config::MAX_BACKENDS_PER_SERVICE {
        return Err(invalid(
            &format!("{field}.backends"),
            format!(
                "{} backends; a service takes at most {}",
                s.backends.len(),
                config::MAX_BACKENDS_PER_SERVICE
            ),
        ));
    }
    let backends = s
        .backends
        .iter()
        .enumerate()
        .map(|(i, b)| backend(&format!("{field}.backends[{i}]"), b))
        .collect::<Result<Vec<_>, _>>()?;
    let health_check = s
        .health_check
        .as_ref()
        .map(|h| health_check(&format!("{field}.health_check"), h))
        .transpose()?;
    Ok(ServiceConfig {
        vip: spanned(id.vip),
        port: spanned(id.port),
        protocol: id.protocol,
        scheduler,
        maglev_table_size: (s.maglev_table_size != 0).then(|| spanned(s.maglev_table_size)),
        no_backend,
        affinity_timeout_s: s.affinity_timeout_s,
        mode,
        snat_address,
        snat_ports,
        backends,
        health_check,
        port_forward: false,
    })
}

pub fn service_pb(s: &ServiceConfig) -> pb::ServiceSpec {
    pb::ServiceSpec {
        key: Some(service_key(s.id())),
        scheduler: match s.scheduler {
            Scheduler::Maglev => pb::Scheduler::Maglev,
            Scheduler::Wrr => pb::Scheduler::Wrr,
            Scheduler::LeastConnections => pb::Scheduler::LeastConnections,
        } as i32,
        maglev_table_size: s.maglev_table_size.as_ref().map_or(0, |m| *m.get_ref()),
        no_backend: match s.no_backend {
            NoBackend::Kernel => pb::NoBackend::Kernel,
            NoBackend::Drop => pb::NoBackend::Drop,
            NoBackend::Reject => pb::NoBackend::Reject,
        } as i32,
        affinity_timeout_s: s.affinity_timeout_s,
        mode: match s.mode {
            ForwardMode::Nat => pb::ForwardMode::Nat,
            ForwardMode::FullNat => pb::ForwardMode::FullNat,
            ForwardMode::Dsr => pb::ForwardMode::Dsr,
        } as i32,
        snat_address: s
            .snat_address
            .as_ref()
            .map_or_else(String::new, |a| a.get_ref().to_string()),
        snat_ports: s
            .snat_ports
            .as_ref()
            .map_or_else(String::new, |r| r.get_ref().to_string()),
        backends: s.backends.iter().map(backend_pb).collect(),
        health_check: s.health_check.as_ref().map(health_check_pb),
    }
}

/// A port forward as a one-backend NAT service.
pub fn port_forward(field: &str, f: &pb::PortForwardSpec) -> Result<ServiceConfig, Rejected> {
    let address = ip(&format!("{field}.address"), &f.address)?;
    let p = port(&format!("{field}.port"), f.port)?;
    let to = ip(&format!("{field}.to"), &f.to)?;
    let to_port = if f.to_port == 0 {
        p
    } else {
        port(&format!("{field}.to_port"), f.to_port)?
    };
    Ok(config::PortForward {
        address: spanned(address),
        port: spanned(p),
        protocol: protocol(&format!("{field}.protocol"), f.protocol)?,
        to: spanned(to),
        to_port: Some(spanned(to_port)),
    }
    .to_service())
}

pub fn port_forward_pb(s: &ServiceConfig) -> pb::PortForwardSpec {
    let b = s.backends.first();
    pb::PortForwardSpec {
        address: s.vip.get_ref().to_string(),
        port: u32::from(*s.port.get_ref()),
        protocol: protocol_pb(s.protocol) as i32,
        to: b.map_or_else(String::new, |b| b.address.get_ref().to_string()),
        to_port: b.map_or(0, |b| u32::from(*b.port.get_ref())),
    }
}

/// The status of a service: its spec (when configured) and what the datapath counted.
pub fn service_status(
    spec: Option<&ServiceConfig>,
    row: Option<&ServiceRow>,
    health: impl Fn(SocketAddr) -> &'static str,
) -> pb::ServiceStatus {
    let mut out = pb::ServiceStatus {
        spec: spec.map(service_pb),
        port_forward: spec.is_some_and(|s| s.port_forward),
        ..Default::default()
    };
    if let Some(r) = row {
        out.packets = r.packets;
        out.bytes = r.bytes;
        out.connections = r.connections;
        out.no_backend = r.no_backend;
        out.datapath_id = r.id;
        out.datapath_generation = r.generation;
        out.snat = r.snat.clone().unwrap_or_default();
        out.datapath_mode = r.mode.clone();
        if out.spec.is_none() {
            out.spec = Some(pb::ServiceSpec {
                key: Some(pb::ServiceKey {
                    vip: r.vip.to_string(),
                    port: u32::from(r.port),
                    protocol: if r.protocol == "udp" {
                        pb::Protocol::Udp
                    } else {
                        pb::Protocol::Tcp
                    } as i32,
                }),
                ..Default::default()
            });
        }
    }
    let weight = |addr: SocketAddr| {
        spec.and_then(|s| {
            s.backends
                .iter()
                .find(|b| SocketAddr::new(*b.address.get_ref(), *b.port.get_ref()) == addr)
                .map(|b| *b.weight.get_ref())
        })
    };
    // Backends the datapath has, then configured ones it does not have yet.
    let mut seen = Vec::new();
    for b in row.map(|r| r.backends.as_slice()).unwrap_or_default() {
        let addr = SocketAddr::new(b.address, b.port);
        seen.push(addr);
        out.backends.push(pb::BackendStatus {
            address: b.address.to_string(),
            port: u32::from(b.port),
            weight: weight(addr).unwrap_or(0),
            share_pct: b.share_pct,
            packets: b.packets,
            bytes: b.bytes,
            connections: b.connections,
            active: b.active,
            health: health(addr).into(),
        });
    }
    for b in spec.map(|s| s.backends.as_slice()).unwrap_or_default() {
        let addr = SocketAddr::new(*b.address.get_ref(), *b.port.get_ref());
        if !seen.contains(&addr) {
            out.backends.push(pb::BackendStatus {
                address: addr.ip().to_string(),
                port: u32::from(addr.port()),
                weight: *b.weight.get_ref(),
                health: health(addr).into(),
                ..Default::default()
            });
        }
    }
    out
}

/// A status back in the CLI's row form (tables and `-o json`).
pub fn service_row(s: &pb::ServiceStatus) -> ServiceRow {
    let key = s
        .spec
        .as_ref()
        .and_then(|s| s.key.clone())
        .unwrap_or_default();
    ServiceRow {
        vip: key.vip.parse().unwrap_or(IpAddr::from([0, 0, 0, 0])),
        port: u16::try_from(key.port).unwrap_or(0),
        protocol: if key.protocol == pb::Protocol::Udp as i32 {
            "udp"
        } else {
            "tcp"
        }
        .into(),
        id: s.datapath_id,
        generation: s.datapath_generation,
        packets: s.packets,
        bytes: s.bytes,
        connections: s.connections,
        no_backend: s.no_backend,
        mode: s.datapath_mode.clone(),
        snat: (!s.snat.is_empty()).then(|| s.snat.clone()),
        backends: s
            .backends
            .iter()
            .map(|b| BackendRow {
                address: b.address.parse().unwrap_or(IpAddr::from([0, 0, 0, 0])),
                port: u16::try_from(b.port).unwrap_or(0),
                share_pct: b.share_pct,
                packets: b.packets,
                bytes: b.bytes,
                connections: b.connections,
                active: b.active,
            })
            .collect(),
    }
}

fn endpoint(t: &Tuple) -> pb::Endpoint {
    pb::Endpoint {
        src: t.src.to_string(),
        dst: t.dst.to_string(),
        sport: u32::from(t.sport),
        dport: u32::from(t.dport),
        packets: t.packets,
        bytes: t.bytes,
    }
}

fn tuple(e: Option<&pb::Endpoint>) -> Tuple {
    let e = e.cloned().unwrap_or_default();
    let any = IpAddr::from([0, 0, 0, 0]);
    Tuple {
        src: e.src.parse().unwrap_or(any),
        dst: e.dst.parse().unwrap_or(any),
        sport: u16::try_from(e.sport).unwrap_or(0),
        dport: u16::try_from(e.dport).unwrap_or(0),
        packets: e.packets,
        bytes: e.bytes,
    }
}

pub fn connection(r: &CtRow) -> pb::Connection {
    pb::Connection {
        protocol: r.proto.clone(),
        protocol_number: u32::from(r.proto_num),
        timeout_s: r.timeout_s,
        state: r.state.clone(),
        original: Some(endpoint(&r.original)),
        reply: Some(endpoint(&r.reply)),
        assured: r.assured,
        seen_reply: r.seen_reply,
    }
}

pub fn ct_row(c: &pb::Connection) -> CtRow {
    CtRow {
        proto: c.protocol.clone(),
        proto_num: u8::try_from(c.protocol_number).unwrap_or(0),
        timeout_s: c.timeout_s,
        state: c.state.clone(),
        original: tuple(c.original.as_ref()),
        reply: tuple(c.reply.as_ref()),
        assured: c.assured,
        seen_reply: c.seen_reply,
    }
}

pub fn reason_counter(r: &StatsRow) -> pb::ReasonCounter {
    pb::ReasonCounter {
        hook: r.hook.clone(),
        verdict: r.verdict.clone(),
        reason: r.reason.clone(),
        packets: r.packets,
        bytes: r.bytes,
    }
}

pub fn stats_row(r: &pb::ReasonCounter) -> StatsRow {
    StatsRow {
        hook: r.hook.clone(),
        verdict: r.verdict.clone(),
        reason: r.reason.clone(),
        packets: r.packets,
        bytes: r.bytes,
    }
}

/// Default quiet time and deadline of a drain (`DrainRequest` fields left 0).
pub const DRAIN_QUIET_MS: u64 = 5_000;
pub const DRAIN_DEADLINE_MS: u64 = 300_000;

/// A drain request: `None` cancels. Each time in range (quiet 100 ms ..= 1 h, deadline
/// 1 s ..= 24 h, quiet no longer than the deadline).
pub fn drain_request(
    r: &pb::DrainRequest,
) -> Result<Option<crate::announce::DrainRequest>, Rejected> {
    if r.cancel {
        if r.quiet_ms != 0 || r.deadline_ms != 0 {
            return Err(invalid(
                "cancel",
                "a cancel takes no quiet_ms or deadline_ms; send one or the other",
            ));
        }
        return Ok(None);
    }
    let or = |v: u64, d: u64| if v == 0 { d } else { v };
    let (quiet, deadline) = (
        or(r.quiet_ms, DRAIN_QUIET_MS),
        or(r.deadline_ms, DRAIN_DEADLINE_MS),
    );
    if !(100..=3_600_000).contains(&quiet) {
        return Err(invalid(
            "quiet_ms",
            format!("{quiet} is out of range: use 100 ..= 3600000 (1 h), or 0 for 5000"),
        ));
    }
    if !(1_000..=86_400_000).contains(&deadline) {
        return Err(invalid(
            "deadline_ms",
            format!("{deadline} is out of range: use 1000 ..= 86400000 (24 h), or 0 for 300000"),
        ));
    }
    if quiet > deadline {
        return Err(invalid(
            "quiet_ms",
            format!(
                "{quiet} is longer than deadline_ms {deadline}: the deadline would always end the drain"
            ),
        ));
    }
    Ok(Some(crate::announce::DrainRequest {
        quiet: std::time::Duration::from_millis(quiet),
        deadline: std::time::Duration::from_millis(deadline),
    }))
}

/// What the announcer reports, as the API shows it.
pub fn announce_status(table: u32, s: &crate::announce::Status) -> pb::AnnounceStatus {
    let ms = |d: std::time::Duration| d.as_millis() as u64;
    pb::AnnounceStatus {
        enabled: true,
        table,
        readiness: s.readiness.as_str().into(),
        routes: s
            .announced
            .iter()
            .map(|r| pb::AnnouncedRoute {
                prefix: r.net.to_string(),
                backup: r.backup,
            })
            .collect(),
        drain: s.drain.as_ref().map(|d| pb::DrainStatus {
            quiet_ms: ms(d.request.quiet),
            deadline_ms: ms(d.request.deadline),
            started_ms_ago: ms(d.started.elapsed()),
            packets: d.packets,
            last_packet_ms_ago: ms(d.last_packet.elapsed()),
            ended: match d.ended {
                None => String::new(),
                Some(crate::announce::DrainEnd::Quiet) => "quiet".into(),
                Some(crate::announce::DrainEnd::Deadline) => "deadline".into(),
            },
        }),
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn a_drain_request_is_checked_field_by_field() {
        let req = |cancel, quiet_ms, deadline_ms| pb::DrainRequest {
            cancel,
            quiet_ms,
            deadline_ms,
        };
        assert_eq!(drain_request(&req(true, 0, 0)).expect("cancel"), None);
        let d = drain_request(&req(false, 0, 0))
            .expect("defaults")
            .expect("a drain");
        assert_eq!(
            (d.quiet.as_millis(), d.deadline.as_millis()),
            (u128::from(DRAIN_QUIET_MS), u128::from(DRAIN_DEADLINE_MS))
        );
        for (r, says) in [
            (req(true, 1000, 0), "cancel: a cancel takes no"),
            (req(false, 50, 0), "quiet_ms: 50 is out of range"),
            (req(false, 0, 500), "deadline_ms: 500 is out of range"),
            (
                req(false, 0, 100_000_000),
                "deadline_ms: 100000000 is out of range",
            ),
            (req(false, 20_000, 10_000), "longer than deadline_ms"),
        ] {
            let e = drain_request(&r).expect_err(says);
            assert!(e.to_string().contains(says), "{e}");
        }
    }

    fn any_backend() -> impl Strategy<Value = pb::BackendSpec> {
        (
            prop_oneof![
                Just("10.1.0.1".to_string()),
                Just("fd00::1".to_string()),
                ".{0,20}"
            ],
            any::<u32>(),
            proptest::option::of(any::<u32>()),
        )
            .prop_map(|(address, port, weight)| pb::BackendSpec {
                address,
                port,
                weight,
            })
    }

    fn any_spec() -> impl Strategy<Value = pb::ServiceSpec> {
        (
            proptest::option::of((
                prop_oneof![
                    Just("10.0.0.1".to_string()),
                    Just("fd00::10".to_string()),
                    Just("0.0.0.0".to_string()),
                    ".{0,40}"
                ],
                prop_oneof![Just(80u32), any::<u32>()],
                -2i32..5,
            )),
            (-1i32..5, any::<u32>(), -1i32..5, any::<u32>(), -1i32..5),
            (
                prop_oneof![Just(String::new()), Just("10.9.0.1".into()), ".{0,20}"],
                prop_oneof![Just(String::new()), Just("1000-2000".into()), ".{0,12}"],
            ),
            proptest::collection::vec(any_backend(), 0..5),
            proptest::option::of((
                prop_oneof![Just("tcp".to_string()), Just("http".into()), ".{0,6}"],
                any::<u64>(),
                any::<u32>(),
                ".{0,10}",
            )),
        )
            .prop_map(
                |(key, (sched, msize, nb, aff, mode), (snat, ports), backends, hc)| {
                    pb::ServiceSpec {
                        key: key.map(|(vip, port, protocol)| pb::ServiceKey {
                            vip,
                            port,
                            protocol,
                        }),
                        scheduler: sched,
                        maglev_table_size: msize % 140_000,
                        no_backend: nb,
                        affinity_timeout_s: aff,
                        mode,
                        snat_address: snat,
                        snat_ports: ports,
                        backends,
                        health_check: hc.map(|(kind, interval_ms, rise, path)| {
                            pb::HealthCheckSpec {
                                kind,
                                interval_ms,
                                rise,
                                path,
                                ..Default::default()
                            }
                        }),
                    }
                },
            )
    }

    fn base() -> config::Config {
        config::Config::parse_with(
            std::path::Path::new("t"),
            "[[interface]]\nname = \"lo\"\n",
            config::InterfaceCheck::Skip,
        )
        .unwrap()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Whatever a client sends: a clear error or a service, never a panic; a service that
        /// passes the whole-state checks converts back to the same request semantics.
        #[test]
        fn any_request_is_rejected_clearly_or_round_trips(spec in any_spec()) {
            match service("services[0]", &spec) {
                Err(e) => {
                    prop_assert_eq!(e.kind, RejectKind::Invalid);
                    prop_assert!(e.message.starts_with("services[0]"), "{}", e.message);
                }
                Ok(svc) => {
                    let back = service("services[0]", &service_pb(&svc)).unwrap();
                    prop_assert_eq!(&back, &svc);
                    if let Err(e) = crate::rules::validate_services(&base(), vec![svc], "<api>") {
                        prop_assert_eq!(e.kind, RejectKind::Invalid);
                        prop_assert!(!e.message.is_empty());
                    }
                }
            }
        }

        /// Raw garbage decoded as a request never panics the conversion either.
        #[test]
        fn garbage_bytes_decode_to_an_error_or_a_checked_request(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            use prost::Message as _;
            if let Ok(req) = pb::ServicesRequest::decode(bytes.as_slice()) {
                for (i, s) in req.services.iter().enumerate() {
                    let _ = service(&format!("services[{i}]"), s);
                }
            }
        }
    }

    #[test]
    fn errors_name_the_field_and_what_to_give() {
        let mut spec = pb::ServiceSpec {
            key: Some(pb::ServiceKey {
                vip: "10.0.0.1".into(),
                port: 80,
                protocol: 1,
            }),
            backends: vec![pb::BackendSpec {
                address: "10.1.0.1".into(),
                port: 70_000,
                weight: None,
            }],
            ..Default::default()
        };
        let e = service("services[3]", &spec).unwrap_err();
        assert_eq!(
            e.message,
            "services[3].backends[0].port: port 70000; give 1..=65535"
        );
        spec.backends[0].port = 80;
        spec.key.as_mut().unwrap().vip = "10.0.0.256".into();
        let e = service("services[3]", &spec).unwrap_err();
        assert_eq!(
            e.message,
            "services[3].key.vip: \"10.0.0.256\" is not an IP address; give one like 10.0.0.1 or fd00::1"
        );
    }
}
