//! What the layers above the datapath need from the kernel, as traits: the desired-state
//! layer ([`crate::rules`]) writes services, settings and interfaces through
//! [`DatapathOps`]; conntrack expiry ([`crate::ct_gc`]) walks and deletes entries through
//! [`CtOps`]. [`Datapath`] and [`CtTable`] are the real ones; `fake` (tests only) keeps the
//! same state in memory, so that logic is unit-tested without root.
//!
//! Contract: an implementation writes what it is given, in the order given; planning (which
//! space a service's tables take, Maglev tables, which neighbours to resolve, each
//! interface's settings) is the caller's.

use std::{collections::BTreeMap, net::IpAddr, path::PathBuf};

use fastpath_common::{
    DatapathConfig,
    ct::{CtEntry, CtKey, IfaceConfig},
    lb::{Service, SnatRule, SvcKey},
    vxlan::VxlanNet,
};

use super::{CtTable, Datapath, DatapathError};
use crate::{config::InterfaceConfig, lb::Plan, sync::LbIndex};

/// What the per-interface maps hold, as planned by [`crate::ifaces::plan_interfaces`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InterfacePlan {
    /// `FP_IFACE` by ifindex (each below `IFACE_SLOTS`); every other slot is cleared. The
    /// same interfaces make up `FP_TX_PORTS`.
    pub ifaces: BTreeMap<u32, IfaceConfig>,
    /// `FP_SNAT` in order: an interface's `IfaceConfig::snat` is its rule's index here.
    pub snat: Vec<SnatRule>,
    /// `FP_VXLAN_NET` by VNI: these and no others.
    pub vxlan: BTreeMap<u32, VxlanNet>,
}

/// The LB maps (`FP_SVC`, `FP_BACKENDS`, `FP_LB_SLOTS`) as a planner sees them.
pub trait ServiceMaps {
    /// What `FP_SVC` holds now.
    fn current_services(&mut self) -> Result<Vec<(SvcKey, Service)>, DatapathError>;

    /// Writes `plan` in its order: backends and tables into free space, then each service
    /// switches with one write of its value, then the removals. On error the maps may hold
    /// part of it (the planner reads them again).
    fn write_services(&mut self, plan: &Plan) -> Result<(), DatapathError>;
}

/// What the desired-state layer writes into a running datapath.
pub trait DatapathOps: ServiceMaps {
    /// What the kernel offers, as probed at start: a change needing what it lacks is refused
    /// before anything is written.
    fn kernel(&self) -> super::KernelFeatures;

    /// The service and backend numbering the datapath uses now.
    fn lb_index(&mut self) -> Result<LbIndex, DatapathError>;

    /// Writes the runtime knobs (`FP_CONFIG[0]`).
    fn set_config(&mut self, config: DatapathConfig) -> Result<(), DatapathError>;

    /// Changes the hooks to what `ifaces` name and writes `plan` (planned for `ifaces`) into
    /// the interface maps, as one change (see [`Datapath::reattach`]): on error the
    /// attachments are as they were and the interface maps hold the plan written before.
    /// Returns the detached pins.
    fn reattach(
        &mut self,
        ifaces: &[InterfaceConfig],
        plan: &InterfacePlan,
    ) -> Result<Vec<PathBuf>, DatapathError>;

    /// Turns on the forwarding sysctls translated traffic needs (see
    /// [`super::prepare_forwarding`]).
    fn prepare_forwarding(
        &mut self,
        ifaces: &[InterfaceConfig],
        ipv6: bool,
    ) -> Result<(), DatapathError>;

    /// Makes the kernel resolve the link-layer addresses of `addrs` (direct server return
    /// sends to the backends' MACs, taken from the neighbour table): one UDP datagram to each
    /// one's discard port. Best effort: nothing to report.
    fn resolve_neighbours(&mut self, addrs: &[IpAddr]);
}

impl ServiceMaps for Datapath {
    fn current_services(&mut self) -> Result<Vec<(SvcKey, Service)>, DatapathError> {
        super::current_services(&mut self.ebpf)
    }

    fn write_services(&mut self, plan: &Plan) -> Result<(), DatapathError> {
        super::EbpfLb {
            ebpf: &mut self.ebpf,
            maps: &mut self.lb_maps,
        }
        .write_services(plan)
    }
}

impl DatapathOps for Datapath {
    fn kernel(&self) -> super::KernelFeatures {
        Datapath::kernel(self)
    }

    fn lb_index(&mut self) -> Result<LbIndex, DatapathError> {
        super::lb_index(&mut self.ebpf)
    }

    fn set_config(&mut self, config: DatapathConfig) -> Result<(), DatapathError> {
        Datapath::set_config(self, config)
    }

    fn reattach(
        &mut self,
        ifaces: &[InterfaceConfig],
        plan: &InterfacePlan,
    ) -> Result<Vec<PathBuf>, DatapathError> {
        Datapath::reattach(self, ifaces, plan)
    }

    fn prepare_forwarding(
        &mut self,
        ifaces: &[InterfaceConfig],
        ipv6: bool,
    ) -> Result<(), DatapathError> {
        super::prepare_forwarding(ifaces, ipv6)
    }

    fn resolve_neighbours(&mut self, addrs: &[IpAddr]) {
        for &addr in addrs {
            let local: std::net::SocketAddr = if addr.is_ipv4() {
                (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
            } else {
                (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
            };
            // Errors are of no interest: the datagram itself is not, only the resolution.
            if let Ok(sock) = std::net::UdpSocket::bind(local) {
                let _ = sock.send_to(b"", (addr, 9));
            }
        }
    }
}

/// What conntrack expiry needs from the conntrack table (`FP_CT`, `FP_BACKEND_GONE`).
pub trait CtOps {
    /// Every entry, handed to `visit` chunk by chunk.
    fn walk(&self, visit: &mut dyn FnMut(&[CtKey], &[CtEntry])) -> std::io::Result<()>;

    /// The entry of `key` now, if any.
    fn get(&self, key: &CtKey) -> Option<CtEntry>;

    /// Deletes the entry of `key`: whether there was one.
    fn remove(&mut self, key: &CtKey) -> bool;

    /// Counts a load-balanced connection of backend `idx` that went without closing.
    fn backend_gone(&mut self, idx: u32);
}

impl CtOps for CtTable {
    fn walk(&self, visit: &mut dyn FnMut(&[CtKey], &[CtEntry])) -> std::io::Result<()> {
        CtTable::walk(self, visit)
    }

    fn get(&self, key: &CtKey) -> Option<CtEntry> {
        CtTable::get(self, key)
    }

    fn remove(&mut self, key: &CtKey) -> bool {
        CtTable::remove(self, key)
    }

    fn backend_gone(&mut self, idx: u32) {
        CtTable::backend_gone(self, idx)
    }
}
