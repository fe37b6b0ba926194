//! Whether the kernel's FIB answers a forwarded packet by its arriving interface and
//! destination alone: then new load-balanced connections to one backend share the route the
//! first of them was told (`GEN_F_FIB_PER_DST`, the datapath's `route::shared`) instead of
//! each asking the FIB. It does unless a policy rule selects by source, ports, protocol, TOS
//! or anything this code does not know, or a route is multipath (the kernel hashes each
//! flow's addresses, or ports, onto one of its paths).
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

/// The id of the nexthop object of an RTM_NEWNEXTHOP payload (`struct nhmsg`, 8 bytes, then
/// attributes) when it is a group of more than one member.
fn multipath_group(nh: &[u8]) -> Option<u32> {
    let (mut id, mut members) = (None, 0);
    for (kind, value) in attributes(nh.get(8..)?) {
        match kind & NLA_TYPE_MASK {
            NHA_ID => id = Some(u32::from_ne_bytes(value.get(..4)?.try_into().ok()?)),
            NHA_GROUP => members = value.len() / NEXTHOP_GRP_LEN,
            _ => {}
        }
    }
    id.filter(|_| members > 1)
}

/// Whether the route of an RTM_NEWROUTE or RTM_DELROUTE payload (`struct rtmsg`, 12 bytes,
/// then attributes) has more than one path: a multipath attribute with more than one
/// `struct rtnexthop`, or a nexthop object among `groups`.
fn route_multipath(route: &[u8], groups: &HashSet<u32>) -> bool {
    let Some(attrs) = route.get(12..) else {
        return false;
    };
    attributes(attrs).any(|(kind, value)| match kind & NLA_TYPE_MASK {
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

/// Whether every policy rule of every family selects by destination at most.
fn rules_by_destination() -> io::Result<bool> {
    let mut all = true;
    dump(libc::RTM_GETRULE, &[0; 12], |kind, rule| {
        all &= kind != libc::RTM_NEWRULE || rule_by_destination(rule);
    })?;
    Ok(all)
}

/// The nexthop objects that are groups of more than one member.
fn multipath_groups() -> io::Result<HashSet<u32>> {
    let mut groups = HashSet::new();
    dump(RTM_GETNEXTHOP, &[0; 8], |kind, nh| {
        if kind == RTM_NEWNEXTHOP {
            groups.extend(multipath_group(nh));
        }
    })?;
    Ok(groups)
}

/// Whether some route of any table and family is multipath.
fn any_multipath(groups: &HashSet<u32>) -> io::Result<bool> {
    let mut any = false;
    dump(libc::RTM_GETROUTE, &[0; 12], |kind, route| {
        any |= kind == libc::RTM_NEWROUTE && route_multipath(route, groups);
    })?;
    Ok(any)
}

/// What decides whether the FIB answers by destination alone, as last seen.
#[derive(Debug)]
pub struct FibShape {
    rules_ok: bool,
    groups: HashSet<u32>,
    multipath: bool,
    /// What the last changes need dumped again.
    rules_changed: bool,
    groups_changed: bool,
    routes_changed: bool,
    last_route_dump: Instant,
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
            multipath: true,
            rules_changed: true,
            groups_changed: true,
            routes_changed: true,
            last_route_dump: Instant::now(),
        }
    }

    /// Whether the FIB answers a forwarded packet by its arriving interface and destination
    /// alone, as far as known.
    pub fn per_destination(&self) -> bool {
        self.rules_ok && !self.multipath
    }

    /// Why new connections ask the FIB each, when they do (for the log).
    pub fn why_not(&self) -> Option<&'static str> {
        if !self.rules_ok {
            Some(
                "a policy rule selects by more than destination and arriving interface (or the rules could not be read)",
            )
        } else if self.multipath {
            Some("a route is multipath or its check is pending (or the routes could not be read)")
        } else {
            None
        }
    }

    /// Reads one change the kernel announced (message type, payload).
    pub fn observe(&mut self, kind: u16, payload: &[u8]) {
        match kind {
            libc::RTM_NEWRULE | libc::RTM_DELRULE => self.rules_changed = true,
            RTM_NEWNEXTHOP | RTM_DELNEXTHOP => {
                // A route of a group that gained a member is multipath before the dump says.
                self.groups_changed = true;
                self.multipath = true;
            }
            libc::RTM_NEWROUTE if route_multipath(payload, &self.groups) => self.multipath = true,
            libc::RTM_DELROUTE if self.multipath && route_multipath(payload, &self.groups) => {
                self.routes_changed = true;
            }
            _ => {}
        }
    }

    /// Changes were lost (the socket's buffer overran): everything is dumped again.
    pub fn lost(&mut self) {
        (self.rules_changed, self.groups_changed, self.routes_changed) = (true, true, true);
        self.multipath = true;
    }

    /// When the routes are due to be dumped again, if they are.
    pub fn due(&self) -> Option<Instant> {
        (self.routes_changed || self.groups_changed).then_some(self.last_route_dump + ROUTE_RECHECK)
    }

    /// Dumps what changed (the routes only if `at` is `None` or at least [`ROUTE_RECHECK`]
    /// after their last dump); returns [`per_destination`](Self::per_destination).
    pub fn settle(&mut self, at: Option<Instant>) -> bool {
        if std::mem::take(&mut self.rules_changed) {
            self.rules_ok = rules_by_destination().unwrap_or_else(|e| {
                warn!(error = %e, "Listing policy rules (netlink) failed; new connections ask the FIB each");
                false
            });
        }
        let due = at.is_none_or(|at| at >= self.last_route_dump + ROUTE_RECHECK);
        if due && (self.routes_changed || self.groups_changed) {
            let dumped = multipath_groups().and_then(|g| Ok((any_multipath(&g)?, g)));
            self.last_route_dump = at.unwrap_or_else(Instant::now);
            (self.routes_changed, self.groups_changed) = (false, false);
            match dumped {
                Ok((multipath, groups)) => (self.multipath, self.groups) = (multipath, groups),
                Err(e) => {
                    warn!(error = %e, "Listing routes (netlink) failed; new connections ask the FIB each");
                    self.multipath = true;
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
    fn a_route_with_two_paths_or_a_group_of_two_is_multipath() {
        let none = HashSet::new();
        let gw = attr(5, &[10, 0, 0, 1]);
        assert!(!route_multipath(&route(&[gw]), &none));
        let two = [rtnexthop(2), rtnexthop(3)].concat();
        assert!(route_multipath(&route(&[attr(RTA_MULTIPATH, &two)]), &none));
        // One path in a multipath attribute is one path.
        assert!(!route_multipath(
            &route(&[attr(RTA_MULTIPATH, &rtnexthop(2))]),
            &none
        ));
        let nh = attr(RTA_NH_ID, &7u32.to_ne_bytes());
        assert!(!route_multipath(&route(std::slice::from_ref(&nh)), &none));
        assert!(route_multipath(&route(&[nh]), &HashSet::from([7])));
        // A truncated message is none.
        assert!(!route_multipath(&[2, 24], &none));
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

    #[test]
    fn a_multipath_route_added_says_no_at_once_and_one_removed_waits_for_the_dump() {
        let mut s = FibShape {
            rules_ok: true,
            groups: HashSet::new(),
            multipath: false,
            rules_changed: false,
            groups_changed: false,
            routes_changed: false,
            last_route_dump: Instant::now(),
        };
        let mp = route(&[attr(RTA_MULTIPATH, &[rtnexthop(2), rtnexthop(3)].concat())]);
        s.observe(libc::RTM_NEWROUTE, &route(&[]));
        assert!(s.per_destination() && s.due().is_none());
        s.observe(libc::RTM_NEWROUTE, &mp);
        assert!(!s.per_destination() && s.due().is_none());
        s.observe(libc::RTM_DELROUTE, &mp);
        assert!(!s.per_destination());
        assert_eq!(s.due(), Some(s.last_route_dump + ROUTE_RECHECK));
        s.lost();
        assert!(s.rules_changed && s.groups_changed && !s.per_destination());
    }
}
