//! Plans the per-interface maps from the configured interfaces: which hook tracks each
//! interface's connections, its route/VLAN/SNAT/VXLAN flags and MAC, the gateway SNAT rules
//! and the VXLAN networks — everything [`Datapath::write_interfaces`] then writes as given.
//!
//! Contract: planning is pure over a [`Host`] (interface lookups and sysctl reads), so it is
//! unit-tested with a fake host; nothing here writes to the kernel.
//!
//! [`Datapath::write_interfaces`]: crate::datapath::Datapath::write_interfaces

use std::{collections::BTreeMap, io, net::IpAddr};

use fastpath_common::{
    ct::{
        IFACE_F_CT_TC_EGRESS, IFACE_F_CT_TC_INGRESS, IFACE_F_CT_XDP, IFACE_F_FIREWALL,
        IFACE_F_LOOPBACK, IFACE_F_ROUTE, IFACE_F_ROUTE_TC, IFACE_F_SNAT, IFACE_F_VLAN_TC,
        IFACE_F_VLAN_XDP, IFACE_F_VXLAN, IFACE_F_VXLAN_UNDERLAY, IFACE_SLOTS, IfaceConfig,
    },
    lb::{MAX_SNAT_RULES, SnatRule},
    vxlan::VxlanNet,
};
use tracing::{info, warn};

use crate::{
    config::{InterfaceConfig, PortRange, VxlanPort, XdpMode},
    datapath::InterfacePlan,
};

/// Why the interfaces cannot be planned (the message says what to do).
#[derive(Debug, thiserror::Error)]
pub enum IfacePlanError {
    #[error(
        "reading the MAC address of interface {name:?}: {source}; route = true needs an Ethernet interface"
    )]
    Mac {
        name: String,
        #[source]
        source: io::Error,
    },
    #[error("reading the addresses of {name}: {source}")]
    Addresses {
        name: String,
        #[source]
        source: io::Error,
    },
    #[error(
        "interface {name} has snat = true but no global address to masquerade as; add one (ip addr add) or give snat_addresses"
    )]
    NoSnatAddress { name: String },
    #[error("{count} interfaces with snat = true; the datapath takes at most {MAX_SNAT_RULES}")]
    TooManySnatRules { count: usize },
    #[error("the VXLAN underlay {name:?} does not exist")]
    NoUnderlay { name: String },
}

/// What planning asks of the host, all in the daemon's network namespace.
pub trait Host {
    /// The ifindex of interface `name`, if it exists.
    fn ifindex(&self, name: &str) -> Option<u32>;
    /// Whether `name` is a loopback device.
    fn is_loopback(&self, name: &str) -> bool;
    /// The MAC address of `name`.
    fn mac(&self, name: &str) -> io::Result<[u8; 6]>;
    /// The addresses of `name`, as `ip addr` lists them.
    fn addresses(&self, name: &str) -> io::Result<Vec<IpAddr>>;
    /// The contents of the sysctl file at `path` (under /proc/sys), if readable.
    fn sysctl(&self, path: &str) -> Option<String>;
}

/// The host this process runs on.
pub struct SysHost;

impl Host for SysHost {
    fn ifindex(&self, name: &str) -> Option<u32> {
        crate::sys::ifindex(name)
    }

    fn is_loopback(&self, name: &str) -> bool {
        crate::sys::is_loopback(name)
    }

    fn mac(&self, name: &str) -> io::Result<[u8; 6]> {
        crate::sys::interface_mac(name)
    }

    fn addresses(&self, name: &str) -> io::Result<Vec<IpAddr>> {
        crate::sys::interface_addresses(name)
    }

    fn sysctl(&self, path: &str) -> Option<String> {
        std::fs::read_to_string(path).ok()
    }
}

/// Plans the per-interface maps for `ifaces`: which hook tracks connections arriving on each
/// interface — XDP when attached (earliest), else TC ingress — plus TC egress, where the
/// datapath tracks only what this node itself sends, so every packet is tracked once; the
/// gateway SNAT rules of interfaces with `snat = true`, numbered in order; and the VXLAN
/// networks. Interfaces gone since validation, or whose ifindex is beyond the table, get no
/// entry (the latter with a warning).
pub fn plan_interfaces(
    ifaces: &[InterfaceConfig],
    host: &(impl Host + ?Sized),
) -> Result<InterfacePlan, IfacePlanError> {
    let mut plan = InterfacePlan::default();
    let mut ports = Vec::new();
    for iface in ifaces {
        let name = iface.name.get_ref();
        let Some(ifindex) = host.ifindex(name) else {
            continue; // validated at load; gone since: nothing to configure
        };
        if ifindex >= IFACE_SLOTS {
            warn!(iface = %name, ifindex, "Interface index beyond the datapath's per-interface table; its connections are not tracked");
            continue;
        }
        let xdp = iface.xdp != XdpMode::Off;
        let mut cfg = IfaceConfig::default();
        if host.is_loopback(name) {
            cfg.flags |= IFACE_F_LOOPBACK;
        }
        if iface.conntrack {
            if xdp {
                cfg.flags |= IFACE_F_CT_XDP;
            } else if iface.tc_ingress {
                cfg.flags |= IFACE_F_CT_TC_INGRESS;
            }
            if iface.tc_egress {
                cfg.flags |= IFACE_F_CT_TC_EGRESS;
            }
            if iface.stateful_firewall {
                cfg.flags |= IFACE_F_FIREWALL;
            }
        }
        if iface.route {
            cfg.flags |= if xdp { IFACE_F_ROUTE } else { IFACE_F_ROUTE_TC };
            cfg.mac = mac(host, name)?;
            for (family, sysctl) in [
                ("IPv4", format!("/proc/sys/net/ipv4/conf/{name}/forwarding")),
                ("IPv6", format!("/proc/sys/net/ipv6/conf/{name}/forwarding")),
            ] {
                if host.sysctl(&sysctl).is_some_and(|v| v.trim() == "0") {
                    warn!(iface = %name, "route = true but {family} forwarding is off here ({sysctl} = 0): the kernel's FIB answers no forwarding lookups, so these packets go to the kernel (reason route_forwarding_off)");
                }
            }
        }
        if let Some(vid) = &iface.vlan {
            cfg.flags |= if xdp {
                IFACE_F_VLAN_XDP
            } else {
                IFACE_F_VLAN_TC
            };
            cfg.vlan = vid.get_ref().to_be_bytes();
        }
        if iface.snat {
            let rule = snat_rule(iface, host)?;
            cfg.flags |= IFACE_F_SNAT;
            cfg.snat = plan.snat.len() as u32;
            plan.snat.push(rule);
        }
        if let Some(vx) = &iface.vxlan {
            // Decapsulated packets are routed as if they arrived on the device.
            cfg.flags |= IFACE_F_VXLAN | IFACE_F_ROUTE | IFACE_F_ROUTE_TC;
            cfg.mac = mac(host, name)?;
            ports.push((ifindex, vx));
        }
        plan.ifaces.insert(ifindex, cfg);
    }
    plan.vxlan = vxlan_nets(&ports, host)?;
    for net in plan.vxlan.values() {
        if let Some(u) = plan.ifaces.get_mut(&net.underlay) {
            u.flags |= IFACE_F_VXLAN_UNDERLAY;
        }
    }
    if plan.snat.len() > MAX_SNAT_RULES as usize {
        return Err(IfacePlanError::TooManySnatRules {
            count: plan.snat.len(),
        });
    }
    Ok(plan)
}

fn mac(host: &(impl Host + ?Sized), name: &str) -> Result<[u8; 6], IfacePlanError> {
    host.mac(name).map_err(|source| IfacePlanError::Mac {
        name: name.to_owned(),
        source,
    })
}

/// The SNAT rule of an interface with `snat = true`: its configured addresses, or its own
/// first global IPv4 and IPv6 addresses (masquerade).
fn snat_rule(
    iface: &InterfaceConfig,
    host: &(impl Host + ?Sized),
) -> Result<SnatRule, IfacePlanError> {
    let name = iface.name.get_ref();
    let addrs = match &iface.snat_addresses {
        Some(a) => a.get_ref().clone(),
        None => {
            let own = host
                .addresses(name)
                .map_err(|source| IfacePlanError::Addresses {
                    name: name.clone(),
                    source,
                })?;
            let list = crate::config::masquerade_addresses(&own);
            if list.is_empty() {
                return Err(IfacePlanError::NoSnatAddress { name: name.clone() });
            }
            list
        }
    };
    let ports = iface
        .snat_ports
        .as_ref()
        .map_or(PortRange::DEFAULT_SNAT, |r| *r.get_ref());
    let mut rule = SnatRule {
        port_lo: ports.first,
        port_hi: ports.last,
        ..SnatRule::default()
    };
    for a in addrs {
        let (bytes, family) = crate::lb::addr16(a);
        if family == 4 {
            rule.addr4 = bytes;
            rule.families |= 1;
        } else {
            rule.addr6 = bytes;
            rule.families |= 2;
        }
    }
    let v4 = IpAddr::from([rule.addr4[0], rule.addr4[1], rule.addr4[2], rule.addr4[3]]);
    let v6 = IpAddr::from(rule.addr6);
    info!(iface = %name, %v4, %v6, families = rule.families, ports = %ports, "Gateway SNAT on");
    Ok(rule)
}

/// The VXLAN networks of the devices `ports` (by ifindex), by VNI.
fn vxlan_nets(
    ports: &[(u32, &VxlanPort)],
    host: &(impl Host + ?Sized),
) -> Result<BTreeMap<u32, VxlanNet>, IfacePlanError> {
    // The kernel's default outer source ports: the namespace's local port range (a device
    // created with `srcport` uses its own).
    let (port_min, port_max) = host
        .sysctl("/proc/sys/net/ipv4/ip_local_port_range")
        .and_then(|t| {
            let mut it = t.split_whitespace().map(|p| p.parse::<u16>().ok());
            Some((it.next()??, it.next()??))
        })
        .unwrap_or((32768, 60999));
    let mut out = BTreeMap::new();
    for &(ifindex, vx) in ports {
        let under = vx.underlay.get_ref();
        let underlay = host
            .ifindex(under)
            .ok_or_else(|| IfacePlanError::NoUnderlay {
                name: under.clone(),
            })?;
        let (family, local) = match vx.local.get_ref() {
            IpAddr::V4(a) => {
                let mut l = [0; 16];
                l[..4].copy_from_slice(&a.octets());
                (4, l)
            }
            IpAddr::V6(a) => (6, a.octets()),
        };
        out.insert(
            *vx.vni.get_ref(),
            VxlanNet {
                ifindex,
                underlay,
                port: vx.port,
                port_min,
                port_max,
                family,
                _pad: 0,
                local,
            },
        );
    }
    Ok(out)
}

/// A host in memory for tests: interfaces by name, sysctl files by path.
#[cfg(test)]
#[derive(Default)]
pub struct FakeHost {
    pub interfaces: BTreeMap<String, FakeInterface>,
    pub sysctls: BTreeMap<String, String>,
}

/// One interface of a [`FakeHost`].
#[cfg(test)]
#[derive(Clone, Debug, Default)]
pub struct FakeInterface {
    pub ifindex: u32,
    pub loopback: bool,
    /// `None`: reading it fails (not an Ethernet device).
    pub mac: Option<[u8; 6]>,
    pub addresses: Vec<IpAddr>,
}

#[cfg(test)]
impl FakeHost {
    /// A host with these interfaces, each with a MAC derived from its ifindex.
    pub fn with(interfaces: &[(&str, u32)]) -> FakeHost {
        FakeHost {
            interfaces: interfaces
                .iter()
                .map(|&(name, ifindex)| {
                    let i = ifindex.to_be_bytes();
                    let iface = FakeInterface {
                        ifindex,
                        mac: Some([2, 0, i[0], i[1], i[2], i[3]]),
                        ..FakeInterface::default()
                    };
                    (name.to_owned(), iface)
                })
                .collect(),
            sysctls: BTreeMap::new(),
        }
    }

    pub fn iface(&mut self, name: &str) -> &mut FakeInterface {
        self.interfaces
            .get_mut(name)
            .unwrap_or_else(|| panic!("the fake host has no interface {name}"))
    }
}

#[cfg(test)]
impl Host for FakeHost {
    fn ifindex(&self, name: &str) -> Option<u32> {
        self.interfaces.get(name).map(|i| i.ifindex)
    }

    fn is_loopback(&self, name: &str) -> bool {
        self.interfaces.get(name).is_some_and(|i| i.loopback)
    }

    fn mac(&self, name: &str) -> io::Result<[u8; 6]> {
        self.interfaces
            .get(name)
            .and_then(|i| i.mac)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))
    }

    fn addresses(&self, name: &str) -> io::Result<Vec<IpAddr>> {
        self.interfaces
            .get(name)
            .map(|i| i.addresses.clone())
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ENODEV))
    }

    fn sysctl(&self, path: &str) -> Option<String> {
        self.sysctls.get(path).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One `[[interface]]` table, deserialized as is (no validation: the planner must not
    /// rely on it for what it decides).
    fn iface(text: &str) -> InterfaceConfig {
        toml::from_str(text).unwrap_or_else(|e| panic!("test interface {text:?}: {e}"))
    }

    fn plan(ifaces: &[InterfaceConfig], host: &FakeHost) -> InterfacePlan {
        plan_interfaces(ifaces, host).unwrap_or_else(|e| panic!("expected a plan, got: {e}"))
    }

    /// The flags planned for the one interface `text`, on a host where it is ifindex 3.
    fn flags(text: &str) -> u32 {
        let host = FakeHost::with(&[("eth0", 3)]);
        let p = plan(&[iface(text)], &host);
        match p.ifaces.get(&3) {
            Some(cfg) => cfg.flags,
            None => panic!("expected an entry for ifindex 3 from {text:?}, got {p:?}"),
        }
    }

    #[test]
    fn connections_are_tracked_at_xdp_when_attached_else_at_tc_ingress() {
        assert_eq!(flags("name = \"eth0\""), IFACE_F_CT_XDP);
        assert_eq!(
            flags("name = \"eth0\"\nxdp = \"off\"\ntc_ingress = true"),
            IFACE_F_CT_TC_INGRESS
        );
        // Both hooks attached: XDP alone tracks, so a packet is tracked once.
        assert_eq!(flags("name = \"eth0\"\ntc_ingress = true"), IFACE_F_CT_XDP);
        assert_eq!(flags("name = \"eth0\"\nxdp = \"off\""), 0);
    }

    #[test]
    fn tc_egress_tracks_what_this_node_sends() {
        assert_eq!(
            flags("name = \"eth0\"\ntc_egress = true"),
            IFACE_F_CT_XDP | IFACE_F_CT_TC_EGRESS
        );
        assert_eq!(
            flags("name = \"eth0\"\nxdp = \"off\"\ntc_egress = true"),
            IFACE_F_CT_TC_EGRESS
        );
    }

    #[test]
    fn without_conntrack_nothing_is_tracked_or_firewalled() {
        assert_eq!(
            flags("name = \"eth0\"\nstateful_firewall = true"),
            IFACE_F_CT_XDP | IFACE_F_FIREWALL
        );
        assert_eq!(
            flags(
                "name = \"eth0\"\nconntrack = false\nstateful_firewall = true\ntc_ingress = true\ntc_egress = true"
            ),
            0
        );
    }

    #[test]
    fn route_flag_follows_the_hook_and_takes_the_mac() {
        let mut host = FakeHost::with(&[("eth0", 3)]);
        host.iface("eth0").mac = Some([2, 1, 2, 3, 4, 5]);
        let p = plan(&[iface("name = \"eth0\"\nroute = true")], &host);
        assert_eq!(
            p.ifaces.get(&3).map(|c| (c.flags, c.mac)),
            Some((IFACE_F_CT_XDP | IFACE_F_ROUTE, [2, 1, 2, 3, 4, 5]))
        );
        assert_eq!(
            flags("name = \"eth0\"\nxdp = \"off\"\ntc_ingress = true\nroute = true"),
            IFACE_F_CT_TC_INGRESS | IFACE_F_ROUTE_TC
        );
    }

    #[test]
    fn route_on_a_device_without_a_mac_is_refused() {
        let mut host = FakeHost::with(&[("tun0", 3)]);
        host.iface("tun0").mac = None;
        match plan_interfaces(&[iface("name = \"tun0\"\nroute = true")], &host) {
            Err(e @ IfacePlanError::Mac { .. }) => assert_eq!(
                e.to_string(),
                "reading the MAC address of interface \"tun0\": Invalid argument (os error 22); route = true needs an Ethernet interface"
            ),
            other => panic!("expected a MAC error, got {other:?}"),
        }
    }

    #[test]
    fn vlan_flag_follows_the_hook_and_the_id_is_big_endian() {
        let host = FakeHost::with(&[("eth0", 3)]);
        let p = plan(&[iface("name = \"eth0\"\nvlan = 100")], &host);
        assert_eq!(
            p.ifaces.get(&3).map(|c| (c.flags, c.vlan)),
            Some((IFACE_F_CT_XDP | IFACE_F_VLAN_XDP, [0, 100]))
        );
        assert_eq!(
            flags("name = \"eth0\"\nxdp = \"off\"\ntc_ingress = true\nvlan = 300"),
            IFACE_F_CT_TC_INGRESS | IFACE_F_VLAN_TC
        );
    }

    #[test]
    fn loopback_devices_are_marked() {
        let mut host = FakeHost::with(&[("lo", 1), ("eth0", 3)]);
        host.iface("lo").loopback = true;
        let p = plan(&[iface("name = \"lo\""), iface("name = \"eth0\"")], &host);
        let flags: Vec<(u32, u32)> = p.ifaces.iter().map(|(i, c)| (*i, c.flags)).collect();
        assert_eq!(
            flags,
            vec![(1, IFACE_F_CT_XDP | IFACE_F_LOOPBACK), (3, IFACE_F_CT_XDP)]
        );
    }

    #[test]
    fn snat_rules_are_numbered_in_order_of_the_interfaces() {
        let mut host = FakeHost::with(&[("eth0", 3), ("eth1", 4), ("eth2", 5)]);
        host.iface("eth2").addresses = vec![
            "127.0.0.1".parse().unwrap_or_else(|e| panic!("{e}")),
            "169.254.1.1".parse().unwrap_or_else(|e| panic!("{e}")),
            "fe80::1".parse().unwrap_or_else(|e| panic!("{e}")),
            "192.0.2.7".parse().unwrap_or_else(|e| panic!("{e}")),
            "2001:db8::7".parse().unwrap_or_else(|e| panic!("{e}")),
        ];
        let p = plan(
            &[
                iface("name = \"eth0\"\nsnat = true\nsnat_addresses = [\"198.51.100.1\"]"),
                iface("name = \"eth1\""),
                iface("name = \"eth2\"\nsnat = true\nsnat_ports = \"2000-3000\""),
            ],
            &host,
        );
        let snat: Vec<(u32, u32, u32)> = p
            .ifaces
            .iter()
            .map(|(i, c)| (*i, c.flags & IFACE_F_SNAT, c.snat))
            .collect();
        assert_eq!(
            snat,
            vec![(3, IFACE_F_SNAT, 0), (4, 0, 0), (5, IFACE_F_SNAT, 1)]
        );
        let rule = |addr4: [u8; 4], addr6: Option<[u8; 16]>, lo: u16, hi: u16| {
            let mut r = SnatRule {
                port_lo: lo,
                port_hi: hi,
                families: 1,
                ..SnatRule::default()
            };
            r.addr4[..4].copy_from_slice(&addr4);
            if let Some(a) = addr6 {
                r.addr6 = a;
                r.families |= 2;
            }
            r
        };
        let v6: std::net::Ipv6Addr = "2001:db8::7".parse().unwrap_or_else(|e| panic!("{e}"));
        let default = PortRange::DEFAULT_SNAT;
        assert_eq!(
            p.snat,
            vec![
                rule([198, 51, 100, 1], None, default.first, default.last),
                rule([192, 0, 2, 7], Some(v6.octets()), 2000, 3000),
            ],
            "rule 0 from snat_addresses, rule 1 the interface's first global addresses"
        );
    }

    #[test]
    fn snat_without_a_global_address_is_refused() {
        let mut host = FakeHost::with(&[("eth0", 3)]);
        host.iface("eth0").addresses = vec!["fe80::1".parse().unwrap_or_else(|e| panic!("{e}"))];
        match plan_interfaces(&[iface("name = \"eth0\"\nsnat = true")], &host) {
            Err(IfacePlanError::NoSnatAddress { name }) => assert_eq!(name, "eth0"),
            other => panic!("expected NoSnatAddress, got {other:?}"),
        }
    }

    #[test]
    fn more_snat_rules_than_the_datapath_takes_are_refused() {
        let n = MAX_SNAT_RULES as usize;
        let names: Vec<String> = (0..=n).map(|i| format!("eth{i}")).collect();
        let table: Vec<(&str, u32)> = names
            .iter()
            .zip(10..)
            .map(|(n, i)| (n.as_str(), i))
            .collect();
        let host = FakeHost::with(&table);
        let config = |names: &[String]| -> Vec<InterfaceConfig> {
            names
                .iter()
                .map(|n| {
                    iface(&format!(
                        "name = \"{n}\"\nsnat = true\nsnat_addresses = [\"192.0.2.1\"]"
                    ))
                })
                .collect()
        };
        let at_limit = plan(&config(&names[..n]), &host);
        assert_eq!(at_limit.snat.len(), n, "{n} rules fit");
        match plan_interfaces(&config(&names), &host) {
            Err(e @ IfacePlanError::TooManySnatRules { .. }) => assert_eq!(
                e.to_string(),
                format!(
                    "{} interfaces with snat = true; the datapath takes at most {MAX_SNAT_RULES}",
                    n + 1
                )
            ),
            other => panic!(
                "expected TooManySnatRules for {} rules, got {other:?}",
                n + 1
            ),
        }
    }

    #[test]
    fn vxlan_devices_route_and_mark_their_underlay() {
        let mut host = FakeHost::with(&[("eth0", 3), ("vx0", 7)]);
        host.sysctls.insert(
            "/proc/sys/net/ipv4/ip_local_port_range".into(),
            "40000\t50000\n".into(),
        );
        let p = plan(
            &[
                iface("name = \"eth0\"\ntc_egress = true"),
                iface(
                    "name = \"vx0\"\nxdp = \"off\"\nconntrack = false\nvxlan = { vni = 42, local = \"192.0.2.1\", underlay = \"eth0\" }",
                ),
            ],
            &host,
        );
        let flags: Vec<(u32, u32)> = p.ifaces.iter().map(|(i, c)| (*i, c.flags)).collect();
        assert_eq!(
            flags,
            vec![
                (
                    3,
                    IFACE_F_CT_XDP | IFACE_F_CT_TC_EGRESS | IFACE_F_VXLAN_UNDERLAY
                ),
                (7, IFACE_F_VXLAN | IFACE_F_ROUTE | IFACE_F_ROUTE_TC),
            ]
        );
        let mut local = [0; 16];
        local[..4].copy_from_slice(&[192, 0, 2, 1]);
        let want = VxlanNet {
            ifindex: 7,
            underlay: 3,
            port: 4789,
            port_min: 40000,
            port_max: 50000,
            family: 4,
            _pad: 0,
            local,
        };
        assert_eq!(p.vxlan, BTreeMap::from([(42, want)]));
    }

    #[test]
    fn vxlan_over_a_missing_underlay_is_refused() {
        let host = FakeHost::with(&[("vx0", 7)]);
        let vx = iface(
            "name = \"vx0\"\nvxlan = { vni = 42, local = \"192.0.2.1\", underlay = \"eth0\" }",
        );
        match plan_interfaces(&[vx], &host) {
            Err(IfacePlanError::NoUnderlay { name }) => assert_eq!(name, "eth0"),
            other => panic!("expected NoUnderlay, got {other:?}"),
        }
    }

    #[test]
    fn interfaces_gone_or_beyond_the_table_get_no_entry() {
        let host = FakeHost::with(&[
            ("eth0", 3),
            ("big0", IFACE_SLOTS),
            ("edge0", IFACE_SLOTS - 1),
        ]);
        let p = plan(
            &[
                iface("name = \"gone0\"\nsnat = true"),
                iface("name = \"big0\"\nsnat = true\nsnat_addresses = [\"192.0.2.1\"]"),
                iface("name = \"edge0\""),
                iface("name = \"eth0\""),
            ],
            &host,
        );
        let planned: Vec<u32> = p.ifaces.keys().copied().collect();
        assert_eq!(planned, vec![3, IFACE_SLOTS - 1]);
        assert!(
            p.snat.is_empty(),
            "skipped interfaces plan no SNAT rule: {:?}",
            p.snat
        );
    }
}
