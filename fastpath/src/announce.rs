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
//! configured prefixes while the node is ready. A stop withdraws everything before the
//! datapath is detached or left.
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

/// `rtm_protocol` of our routes (`/etc/iproute2/rt_protos` has no owner for it): what tells
/// them from the routes others put in the table.
pub const RTPROT_FASTPATH: u8 = 249;
/// How often the announced set is recomputed (health changes, peers syncing).
const PASS: Duration = Duration::from_millis(100);

/// `linux/rtnetlink.h`: `RTN_BLACKHOLE`, and the attributes we write and read.
const RTN_BLACKHOLE: u8 = 6;
const RTA_DST: u16 = 1;
const RTA_TABLE: u16 = 15;

/// Why the node announces nothing, or that it is ready.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Readiness {
    /// Health checks have not probed every backend `fall` times yet.
    Settling,
    /// Peers whose state is not here yet.
    Syncing,
    Ready,
    /// Stopping: everything withdrawn.
    Stopped,
}

impl Readiness {
    pub fn as_str(&self) -> &'static str {
        match self {
            Readiness::Settling => "settling health",
            Readiness::Syncing => "syncing with peers",
            Readiness::Ready => "ready",
            Readiness::Stopped => "stopped",
        }
    }
}

/// What the announcer last did, for status and metrics.
#[derive(Clone, Debug)]
pub struct Status {
    pub readiness: Readiness,
    /// The prefixes in the table now.
    pub announced: Vec<IpNet>,
}

/// The announced set and its readiness, published for the API and metrics.
pub type StatusRx = watch::Receiver<Status>;

/// Keeps `cfg.table` to what this node should announce until `stop`, then withdraws it all.
pub async fn run(
    cfg: AnnounceSection,
    shared: Arc<Shared>,
    status: watch::Sender<Status>,
    mut stop: watch::Receiver<bool>,
) {
    let table = *cfg.table.get_ref();
    let started = Instant::now();
    let mut announced: BTreeSet<IpNet> = match ours(table) {
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
    let mut said = None;
    let mut tick = tokio::time::interval(PASS);
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            _ = tick.tick() => {}
        }
        let warmed = said == Some(Readiness::Ready);
        let (readiness, want) = wanted(&cfg, &shared, started, warmed).await;
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
        });
    }
    reconcile(table, &mut announced, &BTreeSet::new());
    status.send_replace(Status {
        readiness: Readiness::Stopped,
        announced: announced.iter().copied().collect(),
    });
    info!(table, "Withdrew every announcement");
}

/// The readiness and the prefixes to announce now. The start's gates (health settled, peers'
/// state here) are passed once: a node that was ready stays so when a peer leaves (the peer's
/// connections are here already, and withdrawing would move every flow of the set at once).
async fn wanted(
    cfg: &AnnounceSection,
    shared: &Shared,
    started: Instant,
    warmed: bool,
) -> (Readiness, BTreeSet<IpNet>) {
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
    let mut want: BTreeSet<IpNet> = cfg.prefixes.iter().map(|p| *p.get_ref()).collect();
    // Port forwards are this node's own addresses, not the cluster's VIPs.
    for s in config.services.iter().filter(|s| !s.port_forward) {
        // One lookup per backend (`backend_health` would scan every service for each).
        let (id, checked) = (s.id(), s.health_check.is_some());
        let up = s.backends.iter().any(|b| {
            let addr = std::net::SocketAddr::new(*b.address.get_ref(), *b.port.get_ref());
            *b.weight.get_ref() > 0 && !(checked && rules.backend_down(id, addr))
        });
        if up {
            want.insert(IpNet::from(*s.vip.get_ref()));
        }
    }
    (Readiness::Ready, want)
}

/// Adds what `want` has and `announced` lacks, removes the rest; `announced` follows what
/// went through (a failure is retried at the next pass).
fn reconcile(table: u32, announced: &mut BTreeSet<IpNet>, want: &BTreeSet<IpNet>) {
    for net in want.difference(&announced.clone()) {
        match route(libc::RTM_NEWROUTE, table, net) {
            Ok(()) => {
                info!(table, prefix = %net, "Announcing");
                announced.insert(*net);
            }
            Err(e) => {
                warn!(table, prefix = %net, error = %e, "Adding the announcement route failed")
            }
        }
    }
    for net in announced.clone().difference(want) {
        match route(libc::RTM_DELROUTE, table, net) {
            Ok(()) => {
                info!(table, prefix = %net, "Withdrawing");
                announced.remove(net);
            }
            Err(e) if matches!(e.raw_os_error(), Some(libc::ESRCH | libc::ENOENT)) => {
                announced.remove(net);
            }
            Err(e) => {
                warn!(table, prefix = %net, error = %e, "Removing the announcement route failed")
            }
        }
    }
}

/// `struct rtmsg` of our route to `net` in `table`, and its attributes.
fn route_message(table: u32, net: &IpNet) -> Vec<u8> {
    let (family, addr): (u8, Vec<u8>) = match net.addr() {
        IpAddr::V4(a) => (libc::AF_INET as u8, a.octets().to_vec()),
        IpAddr::V6(a) => (libc::AF_INET6 as u8, a.octets().to_vec()),
    };
    // family, dst_len, src_len, tos, table (the attribute says it whole), protocol, scope
    // (universe), type; then flags (u32).
    let mut m = vec![
        family,
        net.prefix_len(),
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

/// Adds (replacing) or deletes our route to `net` in `table`.
fn route(kind: u16, table: u32, net: &IpNet) -> io::Result<()> {
    let flags = if kind == libc::RTM_NEWROUTE {
        (libc::NLM_F_CREATE | libc::NLM_F_REPLACE) as u16
    } else {
        0
    };
    netwatch::request(kind, flags, &route_message(table, net))
}

/// Our routes in `table` now (a dump of every table's routes, kept when of our protocol).
fn ours(table: u32) -> io::Result<BTreeSet<IpNet>> {
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

/// The prefix of an RTM_NEWROUTE payload when it is our route in `table`.
fn parse_ours(table: u32, payload: &[u8]) -> Option<IpNet> {
    let (family, len, protocol) = (*payload.first()?, *payload.get(1)?, *payload.get(5)?);
    if protocol != RTPROT_FASTPATH {
        return None;
    }
    let mut in_table = u32::from(*payload.get(4)?) == table;
    let mut dst = None;
    for (kind, value) in netwatch::attributes(payload.get(12..)?) {
        match kind & netwatch::NLA_TYPE_MASK {
            RTA_TABLE => in_table = value.try_into().ok().map(u32::from_ne_bytes) == Some(table),
            RTA_DST => dst = Some(value),
            _ => {}
        }
    }
    let addr = match (i32::from(family), dst?) {
        (libc::AF_INET, d) => IpAddr::from(<[u8; 4]>::try_from(d).ok()?),
        (libc::AF_INET6, d) => IpAddr::from(<[u8; 16]>::try_from(d).ok()?),
        _ => return None,
    };
    in_table.then(|| IpNet::new(addr, len).ok()).flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_route_message_reads_back_as_ours_in_its_table_only() {
        for net in ["192.0.2.100/32", "2001:db8::/64", "198.51.100.0/28"] {
            let net: IpNet = net.parse().unwrap();
            let m = route_message(100, &net);
            assert_eq!(m.len() % 4, 0);
            assert_eq!(parse_ours(100, &m), Some(net));
            assert_eq!(parse_ours(101, &m), None, "another table");
            let mut other = m.clone();
            other[5] = 186;
            assert_eq!(parse_ours(100, &other), None, "another protocol");
        }
    }
}
