//! Whether the kernel's FIB answers a forwarded packet by its arriving interface and
//! destination alone: then new load-balanced connections to one backend share the route the
//! first of them was told (`GEN_F_FIB_PER_DST`, the datapath's `route::shared`) instead of
//! each asking the FIB. It does unless a policy rule selects by source, ports, protocol, TOS
//! or anything this code does not know, or a route is multipath (the kernel hashes each
//! flow's addresses, or ports, onto one of its paths) or from a source prefix (IPv6).
//!
//! `netwatch` keeps the answer: [`FibShape::now`] dumps rules, nexthop groups and routes at
//! the start; then each change is read as it arrives ([`FibShape::observe`]). Rules and nexthop
//! groups are few and dumped again when they change. A multipath route added makes the answer
//! "no" at once; one removed (or a nexthop group changed) needs the routes dumped again, at
//! most every [`ROUTE_RECHECK`] — a table may hold a million routes — and the answer stays
//! "no" until then. Every error makes it "no": each new connection asks the FIB, as without
//! sharing.

use std::{
    collections::HashSet,
    io,
    time::{Duration, Instant},
};

use tracing::warn;

use crate::netwatch::{NLA_TYPE_MASK, attributes, dump};

/// The least time between two dumps of the routes.
pub const ROUTE_RECHECK: Duration = Duration::from_secs(5);

/// `linux/rtnetlink.h` message types of nexthop objects (not in `libc`).
pub const RTM_NEWNEXTHOP: u16 = 104;
pub const RTM_DELNEXTHOP: u16 = 105;
const RTM_GETNEXTHOP: u16 = 106;
/// Route attributes: the paths of a multipath route, a nexthop object's id.
const RTA_MULTIPATH: u16 = 9;
const RTA_NH_ID: u16 = 30;
/// Nexthop object attributes: its id, its members when it is a group.
const NHA_ID: u16 = 1;
const NHA_GROUP: u16 = 2;
/// `struct nexthop_grp`: one member of a group.
const NEXTHOP_GRP_LEN: usize = 8;

/// `linux/fib_rules.h` attributes that select by what a route-cache hit already matches —
/// the destination (`FRA_DST`), the arriving interface (`FRA_IIFNAME`, `FRA_L3MDEV`) — or
/// by what is the same for every forwarded packet the datapath asks about (mark, uid, tunnel
/// id: `bpf_fib_lookup` passes none), or that are no selector: goto, priority, realms,
/// suppress_*, table, output interface, padding, protocol. Any other attribute (source,
/// ports, IP protocol, DSCP, flow label, one this code does not know) may split one
/// destination's flows.
const RULE_ATTRS_BY_DESTINATION: [u16; 16] =
    [1, 3, 4, 6, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21];

/// Whether the rule of an RTM_NEWRULE payload (`struct fib_rule_hdr`: family, dst_len,
/// src_len, tos, table, two reserved bytes, action, flags; then attributes) selects packets
/// by their destination and arriving interface at most.
fn rule_by_destination(rule: &[u8]) -> bool {
    let (Some(&src_len), Some(&tos), Some(attrs)) = (rule.get(2), rule.get(3), rule.get(12..))
    else {
        return false;
    };
    src_len == 0
        && tos == 0
        && attributes(attrs)
            .all(|(kind, _)| RULE_ATTRS_BY_DESTINATION.contains(&(kind & NLA_TYPE_MASK)))
}

/// The id of the nexthop object of an RTM_NEWNEXTHOP or RTM_DELNEXTHOP payload (`struct
/// nhmsg`, 8 bytes, then attributes) and its members if it is a group (0 if not).
fn nexthop(nh: &[u8]) -> Option<(u32, usize)> {
    let (mut id, mut members) = (None, 0);
    for (kind, value) in attributes(nh.get(8..)?) {
        match kind & NLA_TYPE_MASK {
            NHA_ID => id = Some(u32::from_ne_bytes(value.get(..4)?.try_into().ok()?)),
            NHA_GROUP => members = value.len() / NEXTHOP_GRP_LEN,
            _ => {}
        }
    }
    Some((id?, members))
}

/// The id of a nexthop object that is a group of more than one member.
fn multipath_group(nh: &[u8]) -> Option<u32> {
    nexthop(nh).and_then(|(id, members)| (members > 1).then_some(id))
}

/// Whether the route of an RTM_NEWROUTE or RTM_DELROUTE payload (`struct rtmsg`: family,
/// dst_len, src_len, ...; 12 bytes, then attributes) may send two flows to one destination
/// different ways: an IPv6 route from a source prefix (`src_len`), a multipath attribute with
/// more than one `struct rtnexthop`, or a nexthop object among `groups`. Only IPv4 and IPv6
/// routes count (multicast routing has families of its own).
fn route_splits(route: &[u8], groups: &HashSet<u32>) -> bool {
    let (Some(&family), Some(&src_len), Some(attrs)) =
        (route.first(), route.get(2), route.get(12..))
    else {
        return false;
    };
    if i32::from(family) != libc::AF_INET && i32::from(family) != libc::AF_INET6 {
        return false;
    }
    src_len != 0
        || attributes(attrs).any(|(kind, value)| match kind & NLA_TYPE_MASK {
            RTA_MULTIPATH => paths(value) > 1,
            RTA_NH_ID => value
                .get(..4)
                .and_then(|b| b.try_into().ok())
                .is_some_and(|b| groups.contains(&u32::from_ne_bytes(b))),
            _ => false,
        })
}

/// The `struct rtnexthop`s (length, flags, hops, ifindex, then their own attributes) of a
/// multipath attribute.
fn paths(mut value: &[u8]) -> usize {
    let mut n = 0;
    while let Some(len) = value
        .get(..2)
        .map(|b| usize::from(u16::from_ne_bytes([b[0], b[1]])))
    {
        if len < 8 || len > value.len() {
            break;
        }
        n += 1;
        value = value.get((len + 3) & !3..).unwrap_or(&[]);
    }
    n
}

/// A dump a change interrupted: it may have missed an object that did not change.
fn interrupted(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::Interrupted,
        format!("a change interrupted the {what} dump"),
    )
}

/// Whether every policy rule of every family selects by destination at most.
fn rules_by_destination() -> io::Result<bool> {
    let mut all = true;
    let whole = dump(libc::RTM_GETRULE, &[0; 12], |kind, rule| {
        all &= kind != libc::RTM_NEWRULE || rule_by_destination(rule);
    })?;
    if whole {
        Ok(all)
    } else {
        Err(interrupted("rule"))
    }
}

/// The nexthop objects that are groups of more than one member (none where the kernel has no
/// nexthop objects).
fn multipath_groups() -> io::Result<HashSet<u32>> {
    let mut groups = HashSet::new();
    let whole = match dump(RTM_GETNEXTHOP, &[0; 8], |kind, nh| {
        if kind == RTM_NEWNEXTHOP {
            groups.extend(multipath_group(nh));
        }
    }) {
        Err(e) if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP | libc::EINVAL)) => true,
        other => other?,
    };
    if whole {
        Ok(groups)
    } else {
        Err(interrupted("nexthop"))
    }
}

/// Whether some route of any table may send two flows to one destination different ways
/// (see [`route_splits`]).
fn any_splits(groups: &HashSet<u32>) -> io::Result<bool> {
    let mut any = false;
    let whole = dump(libc::RTM_GETROUTE, &[0; 12], |kind, route| {
        any |= kind == libc::RTM_NEWROUTE && route_splits(route, groups);
    })?;
    if whole {
        Ok(any)
    } else {
        Err(interrupted("route"))
    }
}

/// What decides whether the FIB answers by destination alone, as last seen.
#[derive(Debug)]
pub struct FibShape {
    rules_ok: bool,
    groups: HashSet<u32>,
    /// Some route may send two flows to one destination different ways ([`route_splits`]).
    splits: bool,
    /// What the last changes (or a failed dump) need dumped again.
    rules_changed: bool,
    routes_changed: bool,
    last_dump: Instant,
}

impl FibShape {
    /// The shape of this namespace's FIB now (three dumps).
    pub fn now() -> FibShape {
        let mut s = FibShape::unknown();
        s.settle(None);
        s
    }

    /// A shape not known yet: not per destination, everything to be dumped.
    pub fn unknown() -> FibShape {
        FibShape {
            rules_ok: false,
            groups: HashSet::new(),
            splits: true,
            rules_changed: true,
            routes_changed: true,
            last_dump: Instant::now(),
        }
    }

    /// Whether the FIB answers a forwarded packet by its arriving interface and destination
    /// alone, as far as known.
    pub fn per_destination(&self) -> bool {
        self.rules_ok && !self.splits
    }

    /// Why new connections ask the FIB each, when they do (for the log).
    pub fn why_not(&self) -> Option<&'static str> {
        if !self.rules_ok {
            Some(
                "a policy rule selects by more than destination and arriving interface, or the rules are not read yet",
            )
        } else if self.splits {
            Some("a route is multipath or from a source prefix, or the routes are not read yet")
        } else {
            None
        }
    }

    /// Reads one change the kernel announced (message type, payload).
    pub fn observe(&mut self, kind: u16, payload: &[u8]) {
        match kind {
            libc::RTM_NEWRULE | libc::RTM_DELRULE => self.rules_changed = true,
            // A group of two or more: routes over it (an id replaced in place keeps its
            // routes) split flows now, until the next dump says which routes use it. A group
            // that shrank or went: its routes may not any more, which the next dump tells.
            // Single nexthops change neither.
            RTM_NEWNEXTHOP => match nexthop(payload) {
                Some((id, members)) if members > 1 => {
                    self.groups.insert(id);
                    (self.splits, self.routes_changed) = (true, true);
                }
                Some((id, _)) if self.groups.remove(&id) => self.routes_changed = true,
                _ => {}
            },
            RTM_DELNEXTHOP => {
                if nexthop(payload).is_some_and(|(id, _)| self.groups.remove(&id)) {
                    self.routes_changed = true;
                }
            }
            libc::RTM_NEWROUTE if route_splits(payload, &self.groups) => self.splits = true,
            libc::RTM_DELROUTE if self.splits && route_splits(payload, &self.groups) => {
                self.routes_changed = true;
            }
            _ => {}
        }
    }

    /// Changes were lost (the socket's buffer overran): everything is dumped again.
    pub fn lost(&mut self) {
        (self.rules_changed, self.routes_changed) = (true, true);
        self.splits = true;
    }

    /// When what changed (or failed to be read) is due to be dumped again, if anything is.
    pub fn due(&self) -> Option<Instant> {
        (self.routes_changed || self.rules_changed).then_some(self.last_dump + ROUTE_RECHECK)
    }

    /// Dumps what changed — the routes and nexthop groups only if `at` is `None` or at least
    /// [`ROUTE_RECHECK`] after the last dump; returns [`per_destination`](Self::per_destination).
    /// What fails to be read counts against sharing and is read again when due.
    pub fn settle(&mut self, at: Option<Instant>) -> bool {
        let now = at.unwrap_or_else(Instant::now);
        if self.rules_changed {
            self.last_dump = now;
            match rules_by_destination() {
                Ok(ok) => (self.rules_ok, self.rules_changed) = (ok, false),
                Err(e) => {
                    warn!(error = %e, "Listing policy rules (netlink) failed; new connections ask the FIB each until they are read");
                    self.rules_ok = false;
                }
            }
        }
        let due = at.is_none_or(|at| at >= self.last_dump + ROUTE_RECHECK);
        if self.routes_changed && due {
            self.last_dump = now;
            match multipath_groups().and_then(|g| Ok((any_splits(&g)?, g))) {
                Ok((splits, groups)) => {
                    (self.splits, self.groups, self.routes_changed) = (splits, groups, false);
                }
                Err(e) => {
                    warn!(error = %e, "Listing routes (netlink) failed; new connections ask the FIB each until they are read");
                    self.splits = true;
                }
            }
        }
        self.per_destination()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attr(kind: u16, value: &[u8]) -> Vec<u8> {
        let mut a = ((4 + value.len()) as u16).to_ne_bytes().to_vec();
        a.extend(kind.to_ne_bytes());
        a.extend(value);
        a.resize((a.len() + 3) & !3, 0);
        a
    }

    fn rule(src_len: u8, tos: u8, attrs: &[Vec<u8>]) -> Vec<u8> {
        let mut r = vec![2, 0, src_len, tos, 254, 0, 0, 1, 0, 0, 0, 0];
        attrs.iter().for_each(|a| r.extend(a));
        r
    }

    #[test]
    fn a_rule_by_destination_interface_mark_or_table_keeps_the_fib_per_destination() {
        let prio = attr(6, &32766u32.to_ne_bytes());
        let table = attr(15, &254u32.to_ne_bytes());
        assert!(rule_by_destination(&rule(
            0,
            0,
            &[prio.clone(), table.clone()]
        )));
        let iif = attr(3, b"eth0\0");
        let dst = attr(1, &[10, 0, 0, 0]);
        let mark = attr(10, &1u32.to_ne_bytes());
        assert!(rule_by_destination(&rule(
            0,
            0,
            &[dst, iif, mark, table.clone()]
        )));
        // By source, TOS, ports, protocol, or an attribute not known here: not.
        assert!(!rule_by_destination(&rule(
            16,
            0,
            &[attr(2, &[10, 1, 0, 0]), table.clone()]
        )));
        assert!(!rule_by_destination(&rule(
            0,
            0x10,
            std::slice::from_ref(&table)
        )));
        assert!(!rule_by_destination(&rule(
            0,
            0,
            &[attr(24, &[0, 80, 0, 80])]
        )));
        assert!(!rule_by_destination(&rule(0, 0, &[attr(22, &[6])])));
        assert!(!rule_by_destination(&rule(0, 0, &[attr(40, &[0; 4])])));
        assert!(!rule_by_destination(&[2, 0, 0]));
    }

    fn rtnexthop(ifindex: i32) -> Vec<u8> {
        let mut n = 8u16.to_ne_bytes().to_vec();
        n.extend([0, 0]);
        n.extend(ifindex.to_ne_bytes());
        n
    }

    fn route(attrs: &[Vec<u8>]) -> Vec<u8> {
        let mut r = vec![2, 24, 0, 0, 254, 3, 0, 1, 0, 0, 0, 0];
        attrs.iter().for_each(|a| r.extend(a));
        r
    }

    #[test]
    fn a_route_with_two_paths_a_group_of_two_or_a_source_prefix_splits_flows() {
        let none = HashSet::new();
        let gw = attr(5, &[10, 0, 0, 1]);
        assert!(!route_splits(&route(&[gw]), &none));
        let two = [rtnexthop(2), rtnexthop(3)].concat();
        assert!(route_splits(&route(&[attr(RTA_MULTIPATH, &two)]), &none));
        // One path in a multipath attribute is one path.
        assert!(!route_splits(
            &route(&[attr(RTA_MULTIPATH, &rtnexthop(2))]),
            &none
        ));
        let nh = attr(RTA_NH_ID, &7u32.to_ne_bytes());
        assert!(!route_splits(&route(std::slice::from_ref(&nh)), &none));
        assert!(route_splits(&route(&[nh]), &HashSet::from([7])));
        // An IPv6 route from a source prefix splits; multicast routing's families do not count.
        let mut from = route(&[]);
        (from[0], from[2]) = (10, 48);
        assert!(route_splits(&from, &none));
        let mut mroute = route(&[attr(RTA_MULTIPATH, &two)]);
        mroute[0] = 128;
        assert!(!route_splits(&mroute, &none));
        // A truncated message is none.
        assert!(!route_splits(&[2, 24], &none));
    }

    #[test]
    fn a_nexthop_group_of_two_members_is_multipath_and_of_one_is_not() {
        let nh = |members: usize| {
            let mut m = vec![0u8; 8];
            m.extend(attr(NHA_ID, &9u32.to_ne_bytes()));
            m.extend(attr(NHA_GROUP, &vec![0; NEXTHOP_GRP_LEN * members]));
            m
        };
        assert_eq!(multipath_group(&nh(2)), Some(9));
        assert_eq!(multipath_group(&nh(1)), None);
        let mut plain = vec![0u8; 8];
        plain.extend(attr(NHA_ID, &9u32.to_ne_bytes()));
        assert_eq!(multipath_group(&plain), None);
    }

    /// A shape read a moment ago: per destination, nothing due.
    fn per_destination_now() -> FibShape {
        FibShape {
            rules_ok: true,
            groups: HashSet::new(),
            splits: false,
            rules_changed: false,
            routes_changed: false,
            last_dump: Instant::now(),
        }
    }

    #[test]
    fn a_multipath_route_added_says_no_at_once_and_one_removed_waits_for_the_dump() {
        let mut s = per_destination_now();
        let mp = route(&[attr(RTA_MULTIPATH, &[rtnexthop(2), rtnexthop(3)].concat())]);
        s.observe(libc::RTM_NEWROUTE, &route(&[]));
        assert!(s.per_destination() && s.due().is_none());
        s.observe(libc::RTM_NEWROUTE, &mp);
        assert!(!s.per_destination() && s.due().is_none());
        s.observe(libc::RTM_DELROUTE, &mp);
        assert!(!s.per_destination());
        assert_eq!(s.due(), Some(s.last_dump + ROUTE_RECHECK));
        s.lost();
        assert!(s.rules_changed && s.routes_changed && !s.per_destination());
    }

    #[test]
    fn a_nexthop_group_of_two_says_no_at_once_and_a_single_nexthop_changes_nothing() {
        let mut s = per_destination_now();
        let nh = |id: u32, members: usize| {
            let mut m = vec![0u8; 8];
            m.extend(attr(NHA_ID, &id.to_ne_bytes()));
            if members > 0 {
                m.extend(attr(NHA_GROUP, &vec![0; NEXTHOP_GRP_LEN * members]));
            }
            m
        };
        s.observe(RTM_NEWNEXTHOP, &nh(1, 0));
        s.observe(RTM_DELNEXTHOP, &nh(1, 0));
        assert!(s.per_destination() && s.due().is_none());
        s.observe(RTM_NEWNEXTHOP, &nh(10, 2));
        assert!(!s.per_destination() && s.groups.contains(&10) && s.due().is_some());
        s.routes_changed = false;
        // The group shrinks to one member: the routes are read again when due.
        s.observe(RTM_NEWNEXTHOP, &nh(10, 1));
        assert!(!s.groups.contains(&10) && s.due().is_some());
    }
}
