//! Announcements (`[announce]`): while this node is ready to carry them, its services' VIPs
//! (and the configured prefixes) are routes in a kernel table of their own, which a routing
//! daemon on the node learns and announces to the routers over BGP (BIRD: a `kernel` protocol
//! on that table with `learn`; FRR: `ip import-table`). Going through the kernel keeps us
//! out of the routing daemon's configuration and protocol: any daemon that learns kernel
//! routes works, and the routes show with `ip route show table N`.
//!
//! Ready means: the datapath attached and the services applied (the task starts after both),
//! the health checks settled (every backend probed `fall` times, so a dead one is down by
//! then), and with `[ha]` every peer's state held: each configured peer streamed its snapshot
//! here, or, after `sync_timeout_s`, each peer that does stream has (a dead peer's state
//! cannot be had). These gates are the start's warm-up: once ready, a node stays ready when a
//! peer leaves. A VIP is announced while one of its services has a backend up; the
//! configured prefixes while the node is ready, and other nodes' prefixes
//! (`backup_prefixes`) as backups: routes of metric [`BACKUP_METRIC`], which the routing
//! daemon announces at a lower preference. A drain (asked through the API) withdraws
//! everything, then watches the load-balanced packets that still arrive until none has for
//! a quiet time, or a deadline passes. A stop withdraws everything before the datapath is
//! detached or left.
//!
//! The routes are blackholes of protocol [`RTPROT_FASTPATH`]: routes of other protocols in
//! the table are never touched, and ours left by a daemon that was killed are taken back (or
//! kept) by the next start's first pass.

use std::{
    collections::BTreeSet,
    io,
    net::IpAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use ipnet::IpNet;
use tokio::sync::watch;
use tracing::{info, warn};

use crate::{api::server::Shared, config::AnnounceSection, netwatch};
use fastpath_common::reason;

/// `rtm_protocol` of our routes (`/etc/iproute2/rt_protos` has no owner for it): what tells
/// them from the routes others put in the table.
pub const RTPROT_FASTPATH: u8 = 249;
/// How often the announced set is recomputed (health changes, peers syncing, a drain).
const PASS: Duration = Duration::from_millis(100);
/// The metric (`RTA_PRIORITY`) of the routes of `backup_prefixes`; this node's own have 0.
/// The routing daemon matches it to announce them at a lower preference (BIRD:
/// `krt_metric`; FRR: `match metric`).
pub const BACKUP_METRIC: u32 = 1000;
/// The datapath's reasons that count a load-balanced packet: what a drain watches.
const BALANCED: [u32; 4] = [
    reason::LB_TO_BACKEND,
    reason::LB_FROM_BACKEND,
    reason::LB_DSR,
    reason::LB_ICMP_ERROR,
];

/// `linux/rtnetlink.h`: `RTN_BLACKHOLE`, and the attributes we write and read.
const RTN_BLACKHOLE: u8 = 6;
const RTA_DST: u16 = 1;
const RTA_PRIORITY: u16 = 6;
const RTA_TABLE: u16 = 15;

/// Why the node announces nothing, or that it is ready.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Readiness {
    /// Health checks have not probed every backend `fall` times yet.
    Settling,
    /// Peers whose state is not here yet.
    Syncing,
    Ready,
    /// The datapath cannot forward (a link detached, an interface down or gone): everything
    /// withdrawn until it can again.
    DatapathDown,
    /// Drained through the API: everything withdrawn, flows that still arrive served.
    Draining,
    /// The drain ended: no load-balanced packet for its quiet time, or its deadline passed.
    Drained,
    /// Stopping: everything withdrawn.
    Stopped,
}

impl Readiness {
    pub fn as_str(&self) -> &'static str {
        match self {
            Readiness::Settling => "settling health",
            Readiness::Syncing => "syncing with peers",
            Readiness::Ready => "ready",
            Readiness::DatapathDown => "datapath down",
            Readiness::Draining => "draining",
            Readiness::Drained => "drained",
            Readiness::Stopped => "stopped",
        }
    }
}

/// One of our routes: a prefix, this node's own or (`backup`) another's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Route {
    pub net: IpNet,
    pub backup: bool,
}

impl Route {
    fn metric(&self) -> u32 {
        if self.backup { BACKUP_METRIC } else { 0 }
    }
}

/// A drain asked through the API.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DrainRequest {
    /// The drain ends once no load-balanced packet has arrived for this long...
    pub quiet: Duration,
    /// ...or at the latest this long after it started.
    pub deadline: Duration,
}

/// Why a drain ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DrainEnd {
    Quiet,
    Deadline,
}

/// A drain in progress or ended.
#[derive(Clone, Debug)]
pub struct DrainStatus {
    pub request: DrainRequest,
    pub started: Instant,
    /// When the last load-balanced packet was counted (`started` before any).
    pub last_packet: Instant,
    /// Load-balanced packets counted since the drain started.
    pub packets: u64,
    /// The datapath's count at the last pass (`None` before the first).
    counted: Option<u64>,
    pub ended: Option<DrainEnd>,
}

/// What the announcer last did, for status and metrics.
#[derive(Clone, Debug)]
pub struct Status {
    pub readiness: Readiness,
    /// The routes in the table now.
    pub announced: Vec<Route>,
    pub drain: Option<DrainStatus>,
}

impl Status {
    pub fn starting() -> Status {
        Status {
            readiness: Readiness::Settling,
            announced: vec![],
            drain: None,
        }
    }
}

/// The announcer's side the API and metrics hold: its status, and where a drain is asked
/// (`Some`) or cancelled (`None`).
pub struct Handle {
    pub table: u32,
    pub status: watch::Receiver<Status>,
    pub drain: watch::Sender<Option<DrainRequest>>,
}

/// The channels of an announcer: its handle, and the ends [`run`] takes.
pub fn channels(
    table: u32,
) -> (
    Handle,
    watch::Sender<Status>,
    watch::Receiver<Option<DrainRequest>>,
) {
    let (status_tx, status) = watch::channel(Status::starting());
    let (drain, drain_rx) = watch::channel(None);
    (
        Handle {
            table,
            status,
            drain,
        },
        status_tx,
        drain_rx,
    )
}

/// Keeps `cfg.table` to what this node should announce until `stop`, then withdraws it all.
pub async fn run(
    cfg: AnnounceSection,
    shared: Arc<Shared>,
    status: watch::Sender<Status>,
    drain_rx: watch::Receiver<Option<DrainRequest>>,
    mut stop: watch::Receiver<bool>,
) {
    let table = *cfg.table.get_ref();
    let started = Instant::now();
    let mut announced: BTreeSet<Route> = match ours(table) {
        Ok(set) => set,
        Err(e) => {
            warn!(table, error = %e, "Listing this node's announcement routes failed; announcing nothing");
            return;
        }
    };
    if !announced.is_empty() {
        info!(
            table,
            routes = announced.len(),
            "Found announcement routes of an earlier run"
        );
    }
    // Routes an earlier run left (its daemon was killed while the datapath went on forwarding)
    // stay through the warm-up: withdrawing them would move every flow of the node away and
    // back. A node whose kernel lost them (a reboot) announces nothing until ready.
    let earlier = announced.clone();
    let mut said = None;
    let mut warmed = false;
    let mut drain: Option<DrainStatus> = None;
    let mut tick = tokio::time::interval(PASS);
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            _ = tick.tick() => {}
        }
        let asked = *drain_rx.borrow();
        let (readiness, want) = match asked {
            Some(request) => {
                let d = drain.get_or_insert_with(|| {
                    info!(table, quiet = ?request.quiet, deadline = ?request.deadline, "Draining");
                    DrainStatus {
                        request,
                        started: Instant::now(),
                        last_packet: Instant::now(),
                        packets: 0,
                        counted: None,
                        ended: None,
                    }
                });
                // Asked again: the new times apply to the drain under way.
                d.request = request;
                (drained(&shared, d).await, BTreeSet::new())
            }
            None => {
                if drain.take().is_some() {
                    info!(table, "Drain cancelled");
                }
                let (readiness, want) = wanted(&cfg, &shared, started, warmed).await;
                warmed |= readiness == Readiness::Ready;
                let keep = !warmed && readiness != Readiness::DatapathDown;
                (readiness, if keep { earlier.clone() } else { want })
            }
        };
        if said.as_ref() != Some(&readiness) {
            info!(
                table,
                readiness = readiness.as_str(),
                "Announcement readiness"
            );
            said = Some(readiness.clone());
        }
        reconcile(table, &mut announced, &want);
        status.send_replace(Status {
            readiness,
            announced: announced.iter().copied().collect(),
            drain: drain.clone(),
        });
    }
    reconcile(table, &mut announced, &BTreeSet::new());
    status.send_replace(Status {
        readiness: Readiness::Stopped,
        announced: announced.iter().copied().collect(),
        drain,
    });
    info!(table, "Withdrew every announcement");
}

/// A drain's pass: counts the load-balanced packets that arrived since the last one and
/// ends the drain once none has for its quiet time, or at its deadline. Everything is
/// withdrawn meanwhile; the datapath forwards whatever still arrives.
async fn drained(shared: &Shared, d: &mut DrainStatus) -> Readiness {
    if d.ended.is_some() {
        return Readiness::Drained;
    }
    let total: u64 = match shared.rules().await.map(|r| r.datapath().stats()) {
        Ok(Ok(stats)) => BALANCED.iter().map(|&r| stats.packets_for_reason(r)).sum(),
        Ok(Err(e)) => {
            warn!(error = %e, "Reading the datapath's counters for the drain failed");
            return Readiness::Draining;
        }
        Err(_) => return Readiness::Draining,
    };
    let now = Instant::now();
    // The first pass takes the counters as they are; later ones count what arrived since.
    if let Some(arrived) = d
        .counted
        .map(|c| total.saturating_sub(c))
        .filter(|&a| a > 0)
    {
        d.packets += arrived;
        d.last_packet = now;
    }
    d.counted = Some(total);
    let ended = if now.duration_since(d.last_packet) >= d.request.quiet {
        Some(DrainEnd::Quiet)
    } else if now.duration_since(d.started) >= d.request.deadline {
        Some(DrainEnd::Deadline)
    } else {
        None
    };
    d.ended = ended;
    if ended.is_some() {
        Readiness::Drained
    } else {
        Readiness::Draining
    }
}

/// The readiness and the prefixes to announce now. The start's gates (health settled, peers'
/// state here) are passed once: a node that was ready stays so when a peer leaves (the peer's
/// connections are here already, and withdrawing would move every flow of the set at once).
async fn wanted(
    cfg: &AnnounceSection,
    shared: &Shared,
    started: Instant,
    warmed: bool,
) -> (Readiness, BTreeSet<Route>) {
    // A live condition, not a warm-up gate: a node whose datapath cannot forward must not
    // draw flows, whenever it happens.
    let (links, tails) = crate::datapath::pinned_datapath(&shared.pin_dir);
    if !crate::datapath::forwarding_problems(&shared.pin_dir, &links, tails).is_empty() {
        return (Readiness::DatapathDown, BTreeSet::new());
    }
    let Ok(rules) = shared.rules().await else {
        return (Readiness::Stopped, BTreeSet::new());
    };
    let config = rules.config();
    let settle = config
        .services
        .iter()
        .filter_map(|s| s.health_check.as_ref())
        .map(|c| {
            Duration::from_millis(
                c.interval_ms.get_ref() * u64::from(*c.fall.get_ref()) + c.timeout_ms.get_ref(),
            )
        })
        .max()
        .unwrap_or_default();
    if !warmed && started.elapsed() < settle {
        return (Readiness::Settling, BTreeSet::new());
    }
    if let Some(ha) = shared.ha.as_ref().filter(|_| !warmed) {
        let waited = started.elapsed() >= Duration::from_secs(*cfg.sync_timeout_s.get_ref());
        if !ha.in_sync() && !(waited && ha.streaming_in_sync()) {
            return (Readiness::Syncing, BTreeSet::new());
        }
    }
    let route = |backup| {
        move |p: &toml::Spanned<IpNet>| Route {
            net: *p.get_ref(),
            backup,
        }
    };
    let mut want: BTreeSet<Route> = cfg.prefixes.iter().map(route(false)).collect();
    want.extend(cfg.backup_prefixes.iter().map(route(true)));
    // Port forwards are this node's own addresses, not the cluster's VIPs.
    for s in config.services.iter().filter(|s| !s.port_forward) {
        // One lookup per backend (`backend_health` would scan every service for each).
        let (id, checked) = (s.id(), s.health_check.is_some());
        let up = s.backends.iter().any(|b| {
            let addr = std::net::SocketAddr::new(*b.address.get_ref(), *b.port.get_ref());
            *b.weight.get_ref() > 0 && !(checked && rules.backend_down(id, addr))
        });
        if up {
            want.insert(Route {
                net: IpNet::from(*s.vip.get_ref()),
                backup: false,
            });
        }
    }
    (Readiness::Ready, want)
}

/// Adds what `want` has and `announced` lacks, removes the rest; `announced` follows what
/// went through (a failure is retried at the next pass).
fn reconcile(table: u32, announced: &mut BTreeSet<Route>, want: &BTreeSet<Route>) {
    for r in want.difference(&announced.clone()) {
        match route(libc::RTM_NEWROUTE, table, r) {
            Ok(()) => {
                info!(table, prefix = %r.net, backup = r.backup, "Announcing");
                announced.insert(*r);
            }
            Err(e) => {
                warn!(table, prefix = %r.net, error = %e, "Adding the announcement route failed")
            }
        }
    }
    for r in announced.clone().difference(want) {
        match route(libc::RTM_DELROUTE, table, r) {
            Ok(()) => {
                info!(table, prefix = %r.net, backup = r.backup, "Withdrawing");
                announced.remove(r);
            }
            Err(e) if matches!(e.raw_os_error(), Some(libc::ESRCH | libc::ENOENT)) => {
                announced.remove(r);
            }
            Err(e) => {
                warn!(table, prefix = %r.net, error = %e, "Removing the announcement route failed")
            }
        }
    }
}

/// `struct rtmsg` of our route `r` in `table`, and its attributes.
fn route_message(table: u32, r: &Route) -> Vec<u8> {
    let (family, addr): (u8, Vec<u8>) = match r.net.addr() {
        IpAddr::V4(a) => (libc::AF_INET as u8, a.octets().to_vec()),
        IpAddr::V6(a) => (libc::AF_INET6 as u8, a.octets().to_vec()),
    };
    // family, dst_len, src_len, tos, table (the attribute says it whole), protocol, scope
    // (universe), type; then flags (u32).
    let mut m = vec![
        family,
        r.net.prefix_len(),
        0,
        0,
        0,
        RTPROT_FASTPATH,
        0,
        RTN_BLACKHOLE,
    ];
    m.extend_from_slice(&0u32.to_ne_bytes());
    attribute(&mut m, RTA_TABLE, &table.to_ne_bytes());
    attribute(&mut m, RTA_DST, &addr);
    attribute(&mut m, RTA_PRIORITY, &r.metric().to_ne_bytes());
    m
}

/// Appends a routing attribute (`struct rtattr`, padded to 4 bytes).
fn attribute(m: &mut Vec<u8>, kind: u16, value: &[u8]) {
    let len = 4 + value.len();
    m.extend_from_slice(&(len as u16).to_ne_bytes());
    m.extend_from_slice(&kind.to_ne_bytes());
    m.extend_from_slice(value);
    m.resize(m.len().next_multiple_of(4), 0);
}

/// Adds (replacing) or deletes our route `r` in `table`.
fn route(kind: u16, table: u32, r: &Route) -> io::Result<()> {
    let flags = if kind == libc::RTM_NEWROUTE {
        (libc::NLM_F_CREATE | libc::NLM_F_REPLACE) as u16
    } else {
        0
    };
    netwatch::request(kind, flags, &route_message(table, r))
}

/// Our routes in `table` now (a dump of every table's routes, kept when of our protocol).
fn ours(table: u32) -> io::Result<BTreeSet<Route>> {
    let mut set = BTreeSet::new();
    for family in [libc::AF_INET, libc::AF_INET6] {
        let mut header = [0u8; 12];
        header[0] = family as u8;
        netwatch::dump(libc::RTM_GETROUTE, &header, |kind, payload| {
            if kind == libc::RTM_NEWROUTE
                && let Some(net) = parse_ours(table, payload)
            {
                set.insert(net);
            }
        })?;
    }
    Ok(set)
}

/// The route of an RTM_NEWROUTE payload when it is ours in `table`.
fn parse_ours(table: u32, payload: &[u8]) -> Option<Route> {
    let (family, len, protocol) = (*payload.first()?, *payload.get(1)?, *payload.get(5)?);
    if protocol != RTPROT_FASTPATH {
        return None;
    }
    let mut in_table = u32::from(*payload.get(4)?) == table;
    let (mut dst, mut metric) = (None, 0);
    for (kind, value) in netwatch::attributes(payload.get(12..)?) {
        match kind & netwatch::NLA_TYPE_MASK {
            RTA_TABLE => in_table = value.try_into().ok().map(u32::from_ne_bytes) == Some(table),
            RTA_DST => dst = Some(value),
            RTA_PRIORITY => metric = value.try_into().map_or(0, u32::from_ne_bytes),
            _ => {}
        }
    }
    let addr = match (i32::from(family), dst?) {
        (libc::AF_INET, d) => IpAddr::from(<[u8; 4]>::try_from(d).ok()?),
        (libc::AF_INET6, d) => IpAddr::from(<[u8; 16]>::try_from(d).ok()?),
        _ => return None,
    };
    let net = IpNet::new(addr, len).ok()?;
    in_table.then_some(Route {
        net,
        backup: metric == BACKUP_METRIC,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_route_message_reads_back_as_ours_in_its_table_only() {
        for (net, backup) in [
            ("192.0.2.100/32", false),
            ("2001:db8::/64", false),
            ("198.51.100.0/28", true),
            ("2001:db8:1::/64", true),
        ] {
            let r = Route {
                net: net.parse().unwrap(),
                backup,
            };
            let m = route_message(100, &r);
            assert_eq!(m.len() % 4, 0);
            assert_eq!(parse_ours(100, &m), Some(r));
            assert_eq!(parse_ours(101, &m), None, "another table");
            let mut other = m.clone();
            other[5] = 186;
            assert_eq!(parse_ours(100, &other), None, "another protocol");
        }
    }
}
