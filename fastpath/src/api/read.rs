//! Reading the datapath's pinned maps into API messages: what the server answers, and what the
//! CLI shows with `--pin-dir` when no daemon runs (after `kill -9`), from the same code.

use std::path::Path;

use fastpath_common::{
    ct::{CT_F_LB, CT_F_LB_ALIAS, CtEntry, CtKey, with_alias},
    lb::lb_peer_key,
};

use super::{convert, pb};
use crate::{
    conntrack,
    datapath::{self, DatapathError},
};

/// Every tracked connection, a load-balanced one once (its alias entry is shown through it,
/// with what the alias counted: `ct::with_alias`), sorted by protocol, source and source
/// port.
pub fn connections(pin_dir: &Path) -> Result<Vec<pb::Connection>, DatapathError> {
    let cfg = datapath::pinned_config(pin_dir)?;
    let entries = datapath::pinned_ct_entries(pin_dir)?;
    let now = conntrack::monotonic_ns();
    // Each connection's alias, by the connection's key.
    let aliases: std::collections::HashMap<CtKey, CtEntry> = entries
        .iter()
        .filter(|(_, e)| e.flags & CT_F_LB_ALIAS != 0)
        .filter_map(|(k, e)| lb_peer_key(k, e).map(|conn| (conn, *e)))
        .collect();
    let mut rows: Vec<conntrack::CtRow> = entries
        .iter()
        .filter(|(_, e)| e.flags & CT_F_LB_ALIAS == 0)
        .map(|(k, e)| {
            let e = match aliases.get(k) {
                Some(alias) => with_alias(e, alias),
                None => *e,
            };
            conntrack::row(k, &e, now, &cfg.ct_timeouts_s)
        })
        .collect();
    rows.sort_by(|a, b| {
        (&a.proto, &a.original.src, a.original.sport).cmp(&(
            &b.proto,
            &b.original.src,
            b.original.sport,
        ))
    });
    Ok(rows.iter().map(convert::connection).collect())
}

/// The connection `key` names from either direction; asked by a load-balanced connection's
/// backend-side tuple, the connection it belongs to.
pub fn connection(pin_dir: &Path, key: &CtKey) -> Result<Option<pb::Connection>, DatapathError> {
    let cfg = datapath::pinned_config(pin_dir)?;
    let found = datapath::pinned_ct_get(pin_dir, key)?;
    let found =
        match found.and_then(|e| lb_peer_key(key, &e).filter(|_| e.flags & CT_F_LB_ALIAS != 0)) {
            Some(peer) => datapath::pinned_ct_get(pin_dir, &peer)?.map(|e| (peer, e)),
            None => found.map(|e| (*key, e)),
        };
    // A load-balanced connection with what its alias counted.
    let found = match found {
        Some((k, e)) if e.flags & CT_F_LB != 0 => {
            let alias = match lb_peer_key(&k, &e) {
                Some(a) => datapath::pinned_ct_get(pin_dir, &a)?,
                None => None,
            };
            Some((k, alias.map_or(e, |a| with_alias(&e, &a))))
        }
        other => other,
    };
    Ok(found.map(|(k, e)| {
        convert::connection(&conntrack::row(
            &k,
            &e,
            conntrack::monotonic_ns(),
            &cfg.ct_timeouts_s,
        ))
    }))
}

/// The datapath's counters; the conntrack occupancy (a walk of the whole table) unless
/// `skip_entries`.
pub fn stats(pin_dir: &Path, skip_entries: bool) -> Result<pb::Stats, DatapathError> {
    let reasons = datapath::pinned_stats(pin_dir)?
        .rows()
        .iter()
        .map(convert::reason_counter)
        .collect();
    let (entries, capacity) = if skip_entries {
        (0, 0)
    } else {
        datapath::pinned_ct_occupancy(pin_dir)?
    };
    let sums = datapath::pinned_ct_stats(pin_dir)?;
    let (vxlan, vxlan_generation) = datapath::pinned_vxlan_stats(pin_dir)?;
    let route_cache = datapath::pinned_route_stats(pin_dir)?;
    let route_shared = datapath::pinned_route_shared(pin_dir)?;
    let named = |names: &[&str], sums: Vec<u64>| {
        names
            .iter()
            .zip(sums)
            .map(|(name, value)| pb::NamedCounter {
                name: (*name).into(),
                value,
            })
            .collect()
    };
    Ok(pb::Stats {
        reasons,
        conntrack_entries: entries,
        conntrack_capacity: capacity,
        conntrack: named(&fastpath_common::ct::ct_stat::NAMES, sums),
        services: Vec::new(),
        timestamp_ns: conntrack::monotonic_ns(),
        vxlan: named(&fastpath_common::vxlan::vxlan_stat::NAMES, vxlan),
        vxlan_generation,
        route_cache: named(&fastpath_common::route::route_stat::NAMES, route_cache),
        route_shared,
    })
}

/// The services the datapath has, with their counters (no configuration: see the server for
/// services merged with the desired state).
pub fn services(pin_dir: &Path) -> Result<Vec<pb::ServiceStatus>, DatapathError> {
    Ok(datapath::pinned_services(pin_dir)?
        .iter()
        .map(|r| convert::service_status(None, Some(r), |_| "unknown"))
        .collect())
}
