//! The only module that loads, attaches and pins the datapath.
//!
//! Layout under the pin directory (on a bpffs):
//! - `maps/FP_STATS`, `maps/FP_CONFIG`, …: reused on restart, so counters and state survive;
//! - `links/<iface>@<hook>`: bpf_links; while pinned, the program stays attached with or
//!   without a daemon (restart, crash, upgrade);
//! - `tc/<iface>@<hook>`: on kernels without TCX links, the marker of a netlink TC filter
//!   (see the `tc_netlink` module), which stays attached like a pinned link;
//! - `tails/<prog id>/FP_TAILS`, …: the program arrays one load's main programs tail-call
//!   (named by that load's XDP program id).
//!
//! On restart a pinned link is kept and its program swapped atomically (bpf_link_update; a
//! netlink filter's program is replaced in place): traffic never sees a moment without a
//! program.
//!
//! Invariant: everything an attached program needs is held by a pin, not by this process. A
//! program holds its maps, but the kernel empties a program array once no process or pin
//! holds it (`map_release_uref`): an unpinned tail array would lose its programs the moment
//! the daemon exits, and with them every path that tail-calls (at TC ingress, all load
//! balancing). Each load pins its own arrays, so the programs still attached from an earlier
//! load keep theirs until the links are swapped; then the older arrays are unpinned.

use std::time::Duration;
use std::{
    collections::BTreeSet,
    ffi::CString,
    fs::{self, File},
    io,
    os::fd::{AsFd as _, BorrowedFd},
    path::{Path, PathBuf},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, DevMapHash, HashMap, MapData, PerCpuArray, RingBuf},
    programs::{
        LinkOrder, ProgramError, SchedClassifier, TcAttach, TcAttachType, Xdp,
        XdpMode as AyaXdpMode,
        links::{FdLink, LinkError, PinnedLink},
        tc::{SchedClassifierLink, SchedClassifierLinkId},
        xdp::{XdpLink, XdpLinkId},
    },
};
use fastpath_common::{
    Counter, DatapathConfig,
    ct::{IFACE_SLOTS, IfaceConfig, ct_stat},
    lb::{Backend, Service, SnatRule, SvcKey},
    map_names, program_names,
    route::route_stat,
    vxlan::{VxlanNet, vxlan_stat},
};
use tracing::{info, warn};

mod ct;
#[cfg(test)]
pub mod fake;
pub mod kernel;
mod migrate;
mod ops;
mod tc_netlink;

pub use ct::{
    CtInstaller, CtTable, FlowCache, ct_installer, flush_pinned_ct, pinned_ct_entries,
    pinned_ct_get, pinned_ct_occupancy,
};
pub use kernel::KernelFeatures;
pub use ops::{CtOps, DatapathOps, InterfacePlan, ServiceMaps};

use crate::{
    config::{InterfaceConfig, TcAttachMode, XdpMode},
    ct_events::RecordSource,
    stats::{StatsError, StatsSnapshot},
    sys::{self, is_bpffs, mount_bpffs},
};

#[derive(Debug, thiserror::Error)]
pub enum DatapathError {
    #[error(
        "datapath.tc_attach = \"tcx\": this kernel has no TCX links (Linux 6.6 added them); set tc_attach = \"auto\" or \"netlink\" to attach TC programs through a clsact qdisc and cls_bpf filters"
    )]
    NoTcx,
    #[error(
        "service {service}: scheduler = \"least_connections\" needs the bpf_loop helper, which this kernel lacks (Linux 5.17 added it); use scheduler = \"maglev\" or \"wrr\" on this kernel"
    )]
    NoBpfLoop { service: String },
    #[error("interface {name} does not exist (`ip link` lists the interfaces)")]
    NoInterface { name: String },
    #[error(
        "{path} is not on a bpffs; mount one with `mount -t bpf bpf {mount_hint}` or set datapath.pin_dir to a directory on a bpffs"
    )]
    NotBpffs { path: PathBuf, mount_hint: String },
    #[error(
        "mounting bpffs on /sys/fs/bpf failed: {source}; mount it yourself with `mount -t bpf bpf /sys/fs/bpf`"
    )]
    Mount {
        #[source]
        source: io::Error,
    },
    #[error("creating pin directory {path}: {source}")]
    PinDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "loading the eBPF object: {source}; run as root (CAP_BPF, CAP_NET_ADMIN, CAP_PERFMON). If pinned maps under {pin_dir} come from an incompatible version, remove them with `fastpath detach --pin-dir {pin_dir}`"
    )]
    Load {
        pin_dir: String,
        #[source]
        source: Box<aya::EbpfError>,
    },
    #[error(
        "program {name} missing from the eBPF object (build mismatch; rebuild with `cargo xtask build`)"
    )]
    MissingProgram { name: &'static str },
    #[error(
        "map {name} missing from the eBPF object (build mismatch; rebuild with `cargo xtask build`)"
    )]
    MissingMap { name: &'static str },
    #[error(
        "another fastpath daemon (or `fastpath detach`) is using {pin_dir}; stop it first, or give this daemon another datapath.pin_dir"
    )]
    Locked { pin_dir: PathBuf },
    #[error("interface name {name:?} contains a NUL byte")]
    BadInterfaceName { name: String },
    /// A setting that cannot be applied as configured (the message says what to do).
    #[error("{0}")]
    Config(String),
    #[error("{what}: {source}")]
    Program {
        what: String,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("{what}: {source}")]
    Map {
        what: String,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("{what}: {source}")]
    Link {
        what: String,
        #[source]
        source: aya::programs::links::LinkError,
    },
    #[error("{sysctl} must be 1: {why}")]
    Sysctl { sysctl: String, why: String },
    #[error("pinning {path}: {source}")]
    Pin {
        path: PathBuf,
        #[source]
        source: aya::pin::PinError,
    },
    #[error("planning the services: {0}")]
    Plan(crate::lb::PlanError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("removing pin {path}: {source}")]
    Unpin {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Stats(#[from] StatsError),
}

/// A program hook on an interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HookKind {
    Xdp,
    TcIngress,
    TcEgress,
}

impl HookKind {
    pub fn name(self) -> &'static str {
        match self {
            HookKind::Xdp => "xdp",
            HookKind::TcIngress => "tc_ingress",
            HookKind::TcEgress => "tc_egress",
        }
    }
}

/// How TC programs attach on this kernel (chosen by [`TcPath::choose`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcPath {
    /// bpf_links at the TCX hooks (Linux 6.6).
    Tcx,
    /// A clsact qdisc and a cls_bpf filter per hook (the `tc_netlink` module).
    Netlink,
}

impl TcPath {
    /// Decides how TC programs attach, before anything is loaded: `auto` takes TCX links
    /// where the kernel has them and netlink where it has none; `tcx` on such a kernel is an error
    /// that names the feature. Logs and returns the choice.
    pub fn choose(mode: TcAttachMode, kernel: KernelFeatures) -> Result<TcPath, DatapathError> {
        let path = match mode {
            TcAttachMode::Netlink => TcPath::Netlink,
            TcAttachMode::Tcx if kernel.tcx_links => TcPath::Tcx,
            TcAttachMode::Tcx => return Err(DatapathError::NoTcx),
            TcAttachMode::Auto if kernel.tcx_links => TcPath::Tcx,
            TcAttachMode::Auto => {
                info!(
                    "This kernel has no TCX links (Linux 6.6 added them): TC programs attach through netlink (a clsact qdisc and a cls_bpf filter per hook)"
                );
                TcPath::Netlink
            }
        };
        info!(tc_attach = path.name(), "TC attach path chosen");
        Ok(path)
    }

    pub fn name(self) -> &'static str {
        match self {
            TcPath::Tcx => "tcx",
            TcPath::Netlink => "netlink",
        }
    }
}

/// One attachment the daemon holds.
#[derive(Debug)]
pub struct Attachment {
    pub iface: String,
    pub hook: HookKind,
    /// Human-readable mode (`native`, `generic`, `tcx`, `netlink`).
    pub mode: &'static str,
    /// Whether an already pinned link was reused (program swapped in place).
    pub reused: bool,
    /// Where the link (or a netlink filter's marker) is pinned.
    pub pin: PathBuf,
    /// The link; none for a netlink filter, which is no fd.
    link: Option<FdLink>,
}

impl Attachment {
    fn is_filter(&self) -> bool {
        self.link.is_none()
    }
}

/// The loaded datapath: programs, pinned maps and the links this daemon holds.
pub struct Datapath {
    ebpf: Ebpf,
    pin_dir: PathBuf,
    /// Whether the maps already existed under the pin directory before this load.
    pub maps_reused: bool,
    pub attachments: Vec<Attachment>,
    /// The LB arrays, mapped on first use (see [`LbMaps`]).
    lb_maps: Option<LbMaps>,
    /// The interface plan written last (what a failed [`Datapath::reattach`] restores).
    interfaces: InterfacePlan,
    /// Where this load's tail-call arrays are pinned (`tails/<prog id>`).
    tails_dir: PathBuf,
    /// Pinned maps of another kind or size, being migrated: finished once the new programs
    /// are attached ([`Datapath::finish_migration`]); dropped unfinished, undone.
    migration: Option<migrate::Migration>,
    /// How TC hooks attach.
    tc_path: TcPath,
    /// What the kernel offers, as probed at start.
    kernel: KernelFeatures,
}

impl Datapath {
    /// Loads `object`, creating or reusing the maps pinned under `pin_dir/maps`; TC programs
    /// will attach through `tc_path` ([`TcPath::choose`]); `kernel` sets the object's globals.
    /// Call with the [`lock_pin_dir`] lock held. A failed first load removes the maps it
    /// pinned.
    pub fn open(
        pin_dir: &Path,
        object: &[u8],
        ct_capacity: u32,
        kernel: KernelFeatures,
        tc_path: TcPath,
    ) -> Result<Datapath, DatapathError> {
        let maps_dir = pin_dir.join("maps");
        for dir in [
            maps_dir.clone(),
            pin_dir.join("links"),
            pin_dir.join(TC_DIR),
        ] {
            fs::create_dir_all(&dir)
                .map_err(|source| DatapathError::PinDir { path: dir, source })?;
        }
        let maps_reused = maps_dir.join(map_names::STATS).exists();
        // Before the load, which pins new maps where this moves old ones aside; a failed
        // load drops it, which moves them back.
        let migration = if maps_reused {
            Some(migrate::Migration::prepare(
                pin_dir,
                &maps_dir,
                object,
                ct_capacity,
            )?)
        } else {
            None
        };
        let loaded = Datapath::load(
            pin_dir,
            &maps_dir,
            object,
            maps_reused,
            ct_capacity,
            kernel,
            tc_path,
        );
        if loaded.is_err() && !maps_reused {
            let _ = remove_pins(pin_dir);
        }
        let mut dp = loaded?;
        if let Some(mut m) = migration.filter(|m| !m.is_empty()) {
            m.copy_before_attach(&mut dp.ebpf)?;
            dp.migration = Some(m);
        }
        Ok(dp)
    }

    /// After a start's [`Datapath::attach_all`] failed: unless a link already runs one of
    /// this load's programs, unpins its tail arrays, which would otherwise keep its programs
    /// and their new maps (a migrated conntrack table among them) alive until the next start.
    pub fn discard_failed_load(&mut self) {
        if self.attachments.iter().any(|a| a.reused) {
            return;
        }
        if let Err(e) = remove_pin_tree(&self.tails_dir) {
            warn!(error = %e, dir = %self.tails_dir.display(), "Could not unpin the failed load's tail arrays");
        }
    }

    /// Ends a migration [`Datapath::open`] began: call once the new programs run on every
    /// link and stale links are gone (no old program writes the old maps). Does nothing
    /// without one.
    pub fn finish_migration(&mut self) -> Result<(), DatapathError> {
        match self.migration.take() {
            Some(m) => m.finish(&mut self.ebpf),
            None => Ok(()),
        }
    }

    fn load(
        pin_dir: &Path,
        maps_dir: &Path,
        object: &[u8],
        maps_reused: bool,
        ct_capacity: u32,
        kernel: KernelFeatures,
        tc_path: TcPath,
    ) -> Result<Datapath, DatapathError> {
        let mut loader = EbpfLoader::new();
        kernel.configure(&mut loader);
        let mut ebpf = loader
            .default_map_pin_directory(maps_dir)
            .map_max_entries(map_names::CT, ct_capacity)
            .map_max_entries(map_names::CT_NEW, ct_capacity)
            .load(object)
            .map_err(|source| DatapathError::Load {
                pin_dir: pin_dir.display().to_string(),
                source: Box::new(source),
            })?;
        for name in [program_names::TC_INGRESS, program_names::TC_EGRESS] {
            let prog: &mut SchedClassifier = program(&mut ebpf, name)?;
            prog.load().map_err(|source| DatapathError::Program {
                what: format!("loading {name}"),
                source,
            })?;
        }
        for name in [program_names::XDP, program_names::CT_INSTALL] {
            let xdp: &mut Xdp = program(&mut ebpf, name)?;
            xdp.load().map_err(|source| DatapathError::Program {
                what: format!("loading {name}"),
                source,
            })?;
        }
        // Before anything is attached: the main program tail-calls these.
        install_tails(&mut ebpf, Tails::All)?;
        let tails_dir = pin_tails(&ebpf, pin_dir)?;
        Ok(Datapath {
            ebpf,
            pin_dir: pin_dir.to_owned(),
            maps_reused,
            attachments: Vec::new(),
            lb_maps: None,
            interfaces: InterfacePlan::default(),
            tails_dir,
            migration: None,
            tc_path,
            kernel,
        })
    }

    /// How TC programs attach (see [`TcPath::choose`]).
    pub fn tc_path(&self) -> TcPath {
        self.tc_path
    }

    /// What the kernel offers, as probed at start.
    pub fn kernel(&self) -> KernelFeatures {
        self.kernel
    }

    /// Takes the conntrack table for the daemon's expiry.
    /// The service and backend numbering the datapath uses now.
    pub fn lb_index(&mut self) -> Result<crate::sync::LbIndex, DatapathError> {
        lb_index(&mut self.ebpf)
    }

    pub fn take_ct_table(&mut self) -> Result<CtTable, DatapathError> {
        let map = self
            .ebpf
            .take_map(map_names::CT)
            .ok_or(DatapathError::MissingMap {
                name: map_names::CT,
            })?;
        let table = HashMap::try_from(map).map_err(|source| DatapathError::Map {
            what: "opening FP_CT".into(),
            source,
        })?;
        // Opened again from its pin, not taken: service updates zero it for fresh backends.
        let gone = MapData::from_pin(self.pin_dir.join("maps").join(map_names::BACKEND_GONE))
            .ok()
            .and_then(|d| Array::try_from(aya::maps::Map::Array(d)).ok());
        let flow = ct::FlowCache::open(&self.pin_dir.join("maps"));
        Ok(CtTable::from_maps(table, gone).with_flow_cache(flow))
    }

    /// The conntrack installer program (see [`CtTable::with_installer`]).
    pub fn ct_installer(&self) -> Result<CtInstaller, DatapathError> {
        ct_installer(&self.ebpf)
    }

    /// Takes the conntrack event ring so the daemon can drain it.
    pub fn take_ct_events(&mut self) -> Result<CtEventRing, DatapathError> {
        let map = self
            .ebpf
            .take_map(map_names::CT_EVENTS)
            .ok_or(DatapathError::MissingMap {
                name: map_names::CT_EVENTS,
            })?;
        RingBuf::try_from(map).map_err(|source| DatapathError::Map {
            what: "opening FP_CT_EVENTS".into(),
            source,
        })
    }

    /// Takes the aya-log ring so its records can be forwarded to tracing.
    pub fn take_logger(
        &mut self,
    ) -> Result<aya_log::EbpfLogger<&'static dyn log::Log>, aya_log::Error> {
        aya_log::EbpfLogger::init(&mut self.ebpf)
    }

    /// Writes `plan` (see [`crate::ifaces::plan_interfaces`]) as given: the SNAT rules
    /// (FP_SNAT) first, since an interface names its rule only once the rule is in place; then
    /// every FP_IFACE slot (the planned ones set, whatever an earlier plan left cleared); then
    /// the XDP redirect ports and the VXLAN networks, with a new generation of learned
    /// headers. Remembered as what a failed [`Datapath::reattach`] restores.
    pub fn write_interfaces(&mut self, plan: &InterfacePlan) -> Result<(), DatapathError> {
        self.write_interface_maps(plan)?;
        self.interfaces = plan.clone();
        Ok(())
    }

    fn write_interface_maps(&mut self, plan: &InterfacePlan) -> Result<(), DatapathError> {
        {
            let map = self
                .ebpf
                .map_mut(map_names::SNAT)
                .ok_or(DatapathError::MissingMap {
                    name: map_names::SNAT,
                })?;
            let mut snat: Array<&mut MapData, SnatRule> =
                Array::try_from(map).map_err(|source| DatapathError::Map {
                    what: "opening FP_SNAT".into(),
                    source,
                })?;
            for (i, rule) in plan.snat.iter().enumerate() {
                snat.set(i as u32, rule, 0)
                    .map_err(|source| DatapathError::Map {
                        what: format!("writing FP_SNAT[{i}]"),
                        source,
                    })?;
            }
        }
        let map = self
            .ebpf
            .map_mut(map_names::IFACE)
            .ok_or(DatapathError::MissingMap {
                name: map_names::IFACE,
            })?;
        let mut table: Array<&mut MapData, IfaceConfig> =
            Array::try_from(map).map_err(|source| DatapathError::Map {
                what: "opening FP_IFACE".into(),
                source,
            })?;
        // Every slot: set the configured ones, clear whatever an earlier config left.
        for ifindex in 0..IFACE_SLOTS {
            let cfg = plan.ifaces.get(&ifindex).copied().unwrap_or_default();
            let current = table.get(&ifindex, 0).unwrap_or_default();
            if current != cfg {
                table
                    .set(ifindex, &cfg, 0)
                    .map_err(|source| DatapathError::Map {
                        what: format!("writing FP_IFACE[{ifindex}]"),
                        source,
                    })?;
            }
        }
        self.set_tx_ports(plan.ifaces.keys().copied())?;
        self.set_vxlan_nets(&plan.vxlan)
    }

    /// Makes the XDP redirect device map (`FP_TX_PORTS`) hold these interfaces and no others.
    /// One that does not fit is still reached: XDP redirects to it by ifindex.
    fn set_tx_ports(&mut self, ifindexes: impl Iterator<Item = u32>) -> Result<(), DatapathError> {
        let name = map_names::TX_PORTS;
        let map = self
            .ebpf
            .map_mut(name)
            .ok_or(DatapathError::MissingMap { name })?;
        let mut ports: DevMapHash<&mut MapData> =
            DevMapHash::try_from(map).map_err(|source| DatapathError::Map {
                what: "opening FP_TX_PORTS".into(),
                source,
            })?;
        let wanted: std::collections::BTreeSet<u32> = ifindexes.collect();
        for &ifindex in &wanted {
            if let Err(e) = ports.insert(ifindex, ifindex, None, 0) {
                warn!(ifindex, error = %e, "Interface not in the XDP redirect device map; XDP redirects to it by ifindex");
            }
        }
        let stale: Vec<u32> = ports
            .keys()
            .filter_map(Result::ok)
            .filter(|k| !wanted.contains(k))
            .collect();
        for ifindex in stale {
            ports.remove(ifindex).map_err(|source| DatapathError::Map {
                what: format!("removing FP_TX_PORTS[{ifindex}]"),
                source,
            })?;
        }
        Ok(())
    }

    /// Writes the VXLAN networks (`FP_VXLAN_NET`: these, and no others) and starts a new
    /// generation of learned headers: whatever was learned before this configuration is a
    /// miss until the kernel's path teaches it again.
    fn set_vxlan_nets(
        &mut self,
        nets: &std::collections::BTreeMap<u32, VxlanNet>,
    ) -> Result<(), DatapathError> {
        let map = |what: String| move |source| DatapathError::Map { what, source };
        {
            let m = self
                .ebpf
                .map_mut(map_names::VXLAN_NET)
                .ok_or(DatapathError::MissingMap {
                    name: map_names::VXLAN_NET,
                })?;
            let mut table: HashMap<&mut MapData, u32, VxlanNet> =
                HashMap::try_from(m).map_err(map("opening FP_VXLAN_NET".into()))?;
            let old: Vec<u32> = table.keys().filter_map(Result::ok).collect();
            for (vni, net) in nets {
                table
                    .insert(vni, net, 0)
                    .map_err(map(format!("writing FP_VXLAN_NET[{vni}]")))?;
            }
            for vni in old.iter().filter(|v| !nets.contains_key(v)) {
                table
                    .remove(vni)
                    .map_err(map(format!("removing FP_VXLAN_NET[{vni}]")))?;
            }
        }
        bump_vxlan_generation(&mut self.ebpf)
    }

    /// Writes the runtime knobs (index 0 of FP_CONFIG).
    pub fn set_config(&mut self, config: DatapathConfig) -> Result<(), DatapathError> {
        let map = self
            .ebpf
            .map_mut(map_names::CONFIG)
            .ok_or(DatapathError::MissingMap {
                name: map_names::CONFIG,
            })?;
        let mut array: Array<&mut MapData, DatapathConfig> =
            Array::try_from(map).map_err(|source| DatapathError::Map {
                what: "opening FP_CONFIG".into(),
                source,
            })?;
        array
            .set(0, &config, 0)
            .map_err(|source| DatapathError::Map {
                what: "writing FP_CONFIG".into(),
                source,
            })
    }

    /// Attaches every hook the interfaces ask for, as one change. Hooks without a pinned link
    /// are attached first; only when all of them succeeded are the new programs swapped into
    /// the links an earlier run pinned. On failure, what this call attached is detached again
    /// and pinned links keep their old programs: the running datapath is left as it was.
    pub fn attach_all(&mut self, ifaces: &[InterfaceConfig]) -> Result<(), DatapathError> {
        let mut pending = Vec::new();
        let result = self
            .attach_fresh_or_defer(ifaces, &mut pending)
            .and_then(|()| self.swap_pinned(pending));
        if result.is_err() {
            self.detach_fresh();
        }
        // A link swapped (even by a swap that failed later) runs a new program: the new maps
        // are live from here on.
        if let Some(m) = self.migration.as_mut()
            && (result.is_ok() || self.attachments.iter().any(|a| a.reused))
        {
            m.set_live();
        }
        result
    }

    /// Changes the hooks of a running datapath to what `ifaces` name, as one change: new
    /// hooks are attached, kept ones stay (the same program swapped into their links), the
    /// interface maps get `plan` (planned for `ifaces`), and hooks no longer named are
    /// detached. On failure the attachments are as they were and the interface maps hold the
    /// plan written before. Returns the detached pins.
    pub fn reattach(
        &mut self,
        ifaces: &[InterfaceConfig],
        plan: &InterfacePlan,
    ) -> Result<Vec<PathBuf>, DatapathError> {
        let before = std::mem::take(&mut self.attachments);
        if let Err(e) = self.attach_all(ifaces) {
            // attach_all removed what it attached afresh; `before` still holds every old link.
            self.attachments = before;
            return Err(e);
        }
        if let Err(e) = self.write_interface_maps(plan) {
            self.detach_fresh();
            self.attachments = before;
            let old = self.interfaces.clone();
            if let Err(undo) = self.write_interface_maps(&old) {
                warn!(error = %undo, "Could not restore the interface table");
            }
            return Err(e);
        }
        // The old handles of links kept are duplicates now; those of links no longer named
        // go with their pins below.
        drop(before);
        self.interfaces = plan.clone();
        self.remove_stale_links()
    }

    fn attach_fresh_or_defer(
        &mut self,
        ifaces: &[InterfaceConfig],
        pending: &mut Vec<PendingSwap>,
    ) -> Result<(), DatapathError> {
        for iface in ifaces {
            let name = iface.name.get_ref();
            let hooks = [
                (HookKind::Xdp, iface.xdp != XdpMode::Off),
                (HookKind::TcIngress, iface.tc_ingress),
                (HookKind::TcEgress, iface.tc_egress),
            ];
            for (hook, wanted) in hooks {
                if !wanted {
                    continue;
                }
                if hook != HookKind::Xdp && self.tc_path == TcPath::Netlink {
                    let marker = self.marker_pin(name, hook);
                    if marker.exists() {
                        pending.push(PendingSwap {
                            iface: name.clone(),
                            hook,
                            xdp: iface.xdp,
                            pin: marker,
                            link: None,
                        });
                    } else {
                        self.attach_fresh(name, hook, iface.xdp, marker)?;
                    }
                    continue;
                }
                let pin = self.link_pin(name, hook);
                if let Some(why) = stale_pin(&pin, hook) {
                    // Found now, before any swap, so a failure later never leaves a mix.
                    warn!(pin = %pin.display(), why, "Pinned link is stale; attaching afresh");
                    remove_pin(&pin)?;
                }
                match open_pinned(&pin)? {
                    Some(link) => pending.push(PendingSwap {
                        iface: name.clone(),
                        hook,
                        xdp: iface.xdp,
                        pin,
                        link: Some(link),
                    }),
                    None => self.attach_fresh(name, hook, iface.xdp, pin)?,
                }
            }
        }
        Ok(())
    }

    /// Swaps the new programs into pinned links (bpf_link_update: no packet sees a gap).
    fn swap_pinned(&mut self, pending: Vec<PendingSwap>) -> Result<(), DatapathError> {
        for p in pending {
            let Some(link) = p.link else {
                self.swap_filter(p)?;
                continue;
            };
            let swapped = match p.hook {
                HookKind::Xdp => {
                    let prog: &mut Xdp = program(&mut self.ebpf, program_names::XDP)?;
                    swap_into(prog, link, &p.pin)
                }
                HookKind::TcIngress | HookKind::TcEgress => {
                    let prog: &mut SchedClassifier =
                        program(&mut self.ebpf, tc_program_name(p.hook))?;
                    swap_into(prog, link, &p.pin)
                }
            };
            match swapped {
                Ok(link) => self.record(&p.iface, p.hook, "pinned", true, p.pin, Some(link)),
                Err(SwapError::Stale(e)) => {
                    warn!(pin = %p.pin.display(), error = %e, "Pinned link is stale (interface gone or recreated); attaching afresh");
                    remove_pin(&p.pin)?;
                    self.attach_fresh(&p.iface, p.hook, p.xdp, p.pin)?;
                }
                Err(SwapError::Failed(e)) => return Err(e),
            }
        }
        Ok(())
    }

    /// Replaces the program of a netlink filter of ours that an earlier run left (its marker
    /// found); a filter or interface gone since is attached afresh.
    fn swap_filter(&mut self, p: PendingSwap) -> Result<(), DatapathError> {
        let prog: &mut SchedClassifier = program(&mut self.ebpf, tc_program_name(p.hook))?;
        let replaced = match sys::ifindex(&p.iface) {
            Some(ifindex) => tc_netlink::replace(prog, &p.iface, ifindex, p.hook),
            None => Err(DatapathError::NoInterface {
                name: p.iface.clone(),
            }),
        };
        match replaced {
            Ok(()) => {
                tc_netlink::pin_marker(prog, &p.pin)?;
                self.record(&p.iface, p.hook, "netlink", true, p.pin, None);
                Ok(())
            }
            Err(e) if tc_netlink::is_gone(&e) || matches!(e, DatapathError::NoInterface { .. }) => {
                warn!(marker = %p.pin.display(), error = %e, "Netlink TC filter is gone (interface recreated, or deleted by hand); attaching afresh");
                remove_pin(&p.pin)?;
                self.attach_fresh(&p.iface, p.hook, p.xdp, p.pin)
            }
            Err(e) => Err(e),
        }
    }

    /// Detaches and unpins what this run attached afresh; reused links stay.
    fn detach_fresh(&mut self) {
        for a in self.attachments.iter().filter(|a| !a.reused) {
            if a.is_filter()
                && let Err(e) = tc_netlink::delete(&a.iface, a.hook)
            {
                warn!(iface = a.iface, error = %e, "Could not delete a netlink TC filter attached by the failed change");
            }
            let _ = remove_pin(&a.pin);
        }
        self.attachments.retain(|a| a.reused);
    }

    fn attach_fresh(
        &mut self,
        iface: &str,
        hook: HookKind,
        xdp: XdpMode,
        pin: PathBuf,
    ) -> Result<(), DatapathError> {
        let c_iface = CString::new(iface).map_err(|_| DatapathError::BadInterfaceName {
            name: iface.to_owned(),
        })?;
        let (link, mode) = match hook {
            HookKind::Xdp => {
                let prog: &mut Xdp = program(&mut self.ebpf, program_names::XDP)?;
                let (id, mode) = attach_xdp(prog, &c_iface, iface, xdp)?;
                (prog.take_fd_link(id)?, mode)
            }
            HookKind::TcIngress | HookKind::TcEgress if self.tc_path == TcPath::Netlink => {
                let ifindex = sys::ifindex(iface).ok_or_else(|| DatapathError::NoInterface {
                    name: iface.to_owned(),
                })?;
                let prog: &mut SchedClassifier = program(&mut self.ebpf, tc_program_name(hook))?;
                tc_netlink::attach(prog, iface, ifindex, hook)?;
                if let Err(e) = tc_netlink::pin_marker(prog, &pin) {
                    let _ = tc_netlink::delete(iface, hook);
                    return Err(e);
                }
                self.record(iface, hook, "netlink", false, pin, None);
                return Ok(());
            }
            HookKind::TcIngress | HookKind::TcEgress => {
                let name = tc_program_name(hook);
                let attach_type = match hook {
                    HookKind::TcEgress => TcAttachType::Egress,
                    _ => TcAttachType::Ingress,
                };
                let prog: &mut SchedClassifier = program(&mut self.ebpf, name)?;
                let id = prog
                    .attach(
                        c_iface.as_c_str(),
                        TcAttach::Tcx {
                            attach_type,
                            order: LinkOrder::default(),
                        },
                    )
                    .map_err(|source| DatapathError::Program {
                        what: format!("attaching {name} to {iface} (TCX {})", hook.name()),
                        source,
                    })?;
                (prog.take_fd_link(id)?, "tcx")
            }
        };
        let link = pin_link(link, &pin)?;
        self.record(iface, hook, mode, false, pin, Some(link));
        Ok(())
    }

    /// `links/<iface>@<hook>` (see [`pin_name`]).
    fn link_pin(&self, iface: &str, hook: HookKind) -> PathBuf {
        self.pin_dir.join("links").join(pin_name(iface, hook))
    }

    /// `tc/<iface>@<hook>`: the marker of a netlink filter.
    fn marker_pin(&self, iface: &str, hook: HookKind) -> PathBuf {
        self.pin_dir.join(TC_DIR).join(pin_name(iface, hook))
    }

    /// Logs and keeps one attachment.
    fn record(
        &mut self,
        iface: &str,
        hook: HookKind,
        mode: &'static str,
        reused: bool,
        pin: PathBuf,
        link: Option<FdLink>,
    ) {
        let pin_s = pin.display();
        match (reused, hook) {
            (true, HookKind::Xdp) => {
                info!(iface, pin = %pin_s, "Reused pinned XDP link; program replaced in place")
            }
            (true, _) if link.is_none() => {
                info!(iface, hook = hook.name(), marker = %pin_s, "Reused the netlink TC filter; program replaced in place")
            }
            (true, _) => {
                info!(iface, hook = hook.name(), pin = %pin_s, "Reused pinned TCX link; program replaced in place")
            }
            (false, HookKind::Xdp) => info!(iface, mode, pin = %pin_s, "Attached XDP program"),
            (false, _) => {
                info!(iface, hook = hook.name(), mode, pin = %pin_s, "Attached TC program")
            }
        }
        self.attachments.push(Attachment {
            iface: iface.into(),
            hook,
            mode,
            reused,
            pin,
            link,
        });
    }

    /// Detaches pinned links that the current configuration no longer names (left by an
    /// earlier run with another config), then unpins the tail arrays of earlier loads: every
    /// link runs this load's programs now. Returns the detached links' pin paths.
    pub fn remove_stale_links(&mut self) -> Result<Vec<PathBuf>, DatapathError> {
        let wanted: BTreeSet<&Path> = self.attachments.iter().map(|a| a.pin.as_path()).collect();
        let mut removed = Vec::new();
        let dir = self.pin_dir.join("links");
        let entries = fs::read_dir(&dir).map_err(|source| DatapathError::PinDir {
            path: dir.clone(),
            source,
        })?;
        for entry in entries.flatten() {
            let path = entry.path();
            if !wanted.contains(path.as_path()) {
                remove_pin(&path)?;
                removed.push(path);
            }
        }
        for marker in markers(&self.pin_dir) {
            if !wanted.contains(marker.as_path()) {
                remove_filter(&marker)?;
                removed.push(marker);
            }
        }
        for old in subdirs(&self.pin_dir.join(TAILS_DIR)) {
            if old != self.tails_dir {
                remove_pin_tree(&old)?;
            }
        }
        Ok(removed)
    }

    /// Sums the per-CPU counters.
    pub fn stats(&self) -> Result<StatsSnapshot, DatapathError> {
        let open = |name: &'static str| {
            let map = self
                .ebpf
                .map(name)
                .ok_or(DatapathError::MissingMap { name })?;
            PerCpuArray::<&MapData, Counter>::try_from(map).map_err(|source| DatapathError::Map {
                what: format!("opening {name}"),
                source,
            })
        };
        let (array, ext) = (open(map_names::STATS)?, open(map_names::STATS_EXT)?);
        Ok(StatsSnapshot::read(&array, Some(&ext))?)
    }

    /// Detaches everything and removes every pin: the datapath is gone. With `handover`, the
    /// VIPs move first (see [`remove_pins_after_handover`]): the links are unpinned, then
    /// held while a VIP is still an address of this node, at most that long.
    pub fn detach_all(self, handover: Option<Duration>) -> Result<(), DatapathError> {
        let pin_dir = self.pin_dir.clone();
        // Netlink filters forward on through the handover; `remove_pins` deletes them last.
        for a in self.attachments.iter().filter(|a| !a.is_filter()) {
            remove_pin(&a.pin)?;
        }
        if let Some(timeout) = handover {
            wait_for_handover(&pinned_vips(&pin_dir).unwrap_or_default(), timeout);
        }
        drop(self); // closes the link fds: with their pins gone, the programs detach
        remove_pins(&pin_dir)
    }

    /// Leaves programs attached and pins in place (the datapath runs without a daemon).
    pub fn leave_attached(self) {
        drop(self);
    }
}

/// An exclusive lock on a pin directory (flock on the directory itself, so every spelling of
/// the path is the same lock), held by a daemon for its life and by `fastpath detach`; the
/// kernel releases it when the process dies. Creates the directory (on a bpffs) if needed.
pub struct PinDirLock {
    _dir: File,
}

pub fn lock_pin_dir(pin_dir: &Path) -> Result<PinDirLock, DatapathError> {
    ensure_bpffs(pin_dir)?;
    fs::create_dir_all(pin_dir).map_err(|source| DatapathError::PinDir {
        path: pin_dir.to_owned(),
        source,
    })?;
    let dir = File::open(pin_dir).map_err(|source| DatapathError::PinDir {
        path: pin_dir.to_owned(),
        source,
    })?;
    if !sys::flock_exclusive(dir.as_fd()) {
        return Err(DatapathError::Locked {
            pin_dir: pin_dir.to_owned(),
        });
    }
    Ok(PinDirLock { _dir: dir })
}

/// The pin directory's subdirectory of tail-call arrays, one directory per load.
const TAILS_DIR: &str = "tails";
/// The pin directory's subdirectory of netlink filters' markers ([`tc_netlink`]).
const TC_DIR: &str = "tc";

/// `<iface>@<hook>`, the name of a hook's pin. bpffs refuses names containing '.', which
/// interface names may have (`eth0.100`), so '%' and '.' are percent-encoded.
fn pin_name(iface: &str, hook: HookKind) -> String {
    let iface = iface.replace('%', "%25").replace('.', "%2e");
    format!("{iface}@{}", hook.name())
}

/// The interface and hook a [`pin_name`] names.
fn parse_pin_name(name: &str) -> Option<(String, HookKind)> {
    let (iface, hook) = name.rsplit_once('@')?;
    let hook = [HookKind::Xdp, HookKind::TcIngress, HookKind::TcEgress]
        .into_iter()
        .find(|h| h.name() == hook)?;
    Some((iface.replace("%2e", ".").replace("%25", "%"), hook))
}

/// The netlink filters' markers pinned under `pin_dir`.
fn markers(pin_dir: &Path) -> Vec<PathBuf> {
    fs::read_dir(pin_dir.join(TC_DIR))
        .map(|entries| entries.flatten().map(|e| e.path()).collect())
        .unwrap_or_default()
}

/// Deletes the netlink filter `marker` stands for, then the marker.
fn remove_filter(marker: &Path) -> Result<(), DatapathError> {
    let name = marker
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    match parse_pin_name(&name) {
        Some((iface, hook)) if hook != HookKind::Xdp => tc_netlink::delete(&iface, hook)?,
        _ => warn!(marker = %marker.display(), "Not a netlink filter's marker; removing it"),
    }
    remove_pin(marker)
}

/// Whether `pin_dir` holds nothing but what a fastpath daemon pins (`maps/`, `links/`,
/// `tails/`), so `fastpath detach` never removes anybody else's pins.
pub fn looks_like_pin_dir(pin_dir: &Path) -> bool {
    let Ok(entries) = fs::read_dir(pin_dir) else {
        return false;
    };
    let names: Vec<String> = entries
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    !names.is_empty()
        && names.iter().all(|n| {
            n == "maps"
                || n == "links"
                || n == TC_DIR
                || n == TAILS_DIR
                || n == migrate::MIGRATING_DIR
        })
}

/// Removes every link, tail array and map pin under `pin_dir` (links first, so programs
/// detach before their maps go), then the directories. Works without a loaded object:
/// `fastpath detach`.
pub fn remove_pins(pin_dir: &Path) -> Result<(), DatapathError> {
    for marker in markers(pin_dir) {
        remove_filter(&marker)?;
    }
    let _ = fs::remove_dir(pin_dir.join(TC_DIR));
    remove_pin_tree(&pin_dir.join("links"))?;
    for tails in subdirs(&pin_dir.join(TAILS_DIR)) {
        remove_pin_tree(&tails)?;
    }
    let _ = fs::remove_dir(pin_dir.join(TAILS_DIR));
    remove_pin_tree(&pin_dir.join(migrate::MIGRATING_DIR))?;
    remove_pin_tree(&pin_dir.join("maps"))?;
    let _ = fs::remove_dir(pin_dir);
    Ok(())
}

/// [`remove_pins`], handing the VIPs over first: while one of the pinned services' VIPs is an
/// address of this node (a VRRP master's), the links are unpinned but held open, so the
/// datapath goes on forwarding while `fastpath datapath --check` (keepalived's FAULT script)
/// fails and the standby takes the VIPs — up to `timeout`. Then the links go with the rest.
pub fn remove_pins_after_handover(pin_dir: &Path, timeout: Duration) -> Result<(), DatapathError> {
    let vips = pinned_vips(pin_dir).unwrap_or_default();
    if local_vips(&vips).is_empty() {
        return remove_pins(pin_dir);
    }
    let links: Vec<(PathBuf, std::os::fd::OwnedFd)> = fs::read_dir(pin_dir.join("links"))
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| sys::obj_get(&e.path()).ok().map(|fd| (e.path(), fd)))
                .collect()
        })
        .unwrap_or_default();
    for (pin, _) in &links {
        remove_pin(pin)?;
    }
    wait_for_handover(&vips, timeout);
    drop(links);
    remove_pins(pin_dir)
}

/// How long a node goes on forwarding once its VIPs have left it (see [`wait_for_handover`]).
const HANDOVER_GRACE: Duration = Duration::from_secs(1);

/// Waits until none of `vips` is an address of this node, at most `timeout`, then
/// [`HANDOVER_GRACE`]; logs how it went.
fn wait_for_handover(vips: &[std::net::IpAddr], timeout: Duration) {
    let started = std::time::Instant::now();
    let mut local = local_vips(vips);
    if local.is_empty() {
        return;
    }
    info!(vips = ?local, timeout_s = timeout.as_secs_f64(), "Links unpinned; forwarding until the VIPs move to the standby");
    while !local.is_empty() && started.elapsed() < timeout {
        std::thread::sleep(Duration::from_millis(20));
        local = local_vips(vips);
    }
    if local.is_empty() {
        // Packets already on their way here, and neighbours that have not yet taken the new
        // master's gratuitous ARP, still arrive for a moment: they are translated as before
        // instead of meeting a kernel that no longer knows their connections.
        std::thread::sleep(HANDOVER_GRACE);
        info!(
            took_ms = started.elapsed().as_millis() as u64,
            "The VIPs left this node; detaching"
        );
    } else {
        warn!(vips = ?local, "The VIPs are still on this node; detaching anyway (is keepalived running `fastpath datapath --check`?)");
    }
}

/// The VIPs of the services pinned under `pin_dir`.
pub fn pinned_vips(pin_dir: &Path) -> Result<Vec<std::net::IpAddr>, DatapathError> {
    let svc_map = pinned_map(pin_dir, map_names::SVC)?;
    let mut vips = BTreeSet::new();
    sys::map_walk_batches(svc_map.fd().as_fd(), |k: &[SvcKey], _: &[Service]| {
        vips.extend(k.iter().map(|k| ip_of(k.family, &k.vip)));
    })
    .map_err(|source| DatapathError::Io {
        what: "reading FP_SVC".into(),
        source,
    })?;
    Ok(vips.into_iter().collect())
}

/// Those of `vips` that are addresses of an interface of this network namespace.
fn local_vips(vips: &[std::net::IpAddr]) -> Vec<std::net::IpAddr> {
    let local = sys::local_addresses();
    vips.iter().copied().filter(|v| local.contains(v)).collect()
}

/// One pinned link of a datapath as the kernel has it now (`fastpath datapath`).
#[derive(Debug, serde::Serialize)]
pub struct LinkState {
    /// The pin's name: `<iface>@<hook>`.
    pub pin: String,
    /// The interface it is attached to (by its index now), if it still exists.
    pub iface: Option<String>,
    pub ifindex: u32,
    /// The interface is up and has carrier.
    pub up: bool,
    /// Why the link cannot forward, if it cannot.
    pub problem: Option<String>,
}

impl LinkState {
    /// A hook pinned as `pin` on interface `ifindex` (`shown` names the interface where it is
    /// not in this network namespace), with why it cannot forward, if it cannot.
    fn on(pin: String, ifindex: u32, shown: &str) -> LinkState {
        let (iface, up) = interface_up(ifindex);
        let problem = match (&iface, up) {
            (None, _) => Some(format!(
                "interface {shown} is not in this network namespace (use --netns)"
            )),
            (Some(name), false) => Some(format!("interface {name} is down or has no carrier")),
            (Some(_), true) => None,
        };
        LinkState {
            pin,
            iface,
            ifindex,
            up,
            problem,
        }
    }
}

/// Why the datapath pinned under `pin_dir` (its `links` and `tails`, as
/// [`pinned_datapath`] read them) cannot forward; empty when it can.
pub fn forwarding_problems(pin_dir: &Path, links: &[LinkState], tails: usize) -> Vec<String> {
    let mut problems: Vec<String> = links
        .iter()
        .filter_map(|l| l.problem.as_ref().map(|p| format!("{}: {p}", l.pin)))
        .collect();
    if links.is_empty() {
        problems.push(format!(
            "no links are pinned under {} (detached, or never attached; start the daemon)",
            pin_dir.display()
        ));
    }
    if tails == 0 {
        problems.push(format!(
            "no tail-call arrays are pinned under {}/tails (a datapath from an older fastpath: restart the daemon)",
            pin_dir.display()
        ));
    }
    problems
}

/// The datapath pinned under `pin_dir` as the kernel runs it: its links, and the number of
/// loads whose tail-call arrays are pinned. Reads pins only (no daemon needed).
pub fn pinned_datapath(pin_dir: &Path) -> (Vec<LinkState>, usize) {
    let mut links = Vec::new();
    if let Ok(entries) = fs::read_dir(pin_dir.join("links")) {
        for e in entries.flatten() {
            let pin = e.file_name().to_string_lossy().into_owned();
            let state = match pinned_link_info(&e.path()) {
                Err(err) => LinkState {
                    pin,
                    iface: None,
                    ifindex: 0,
                    up: false,
                    problem: Some(format!("the pinned link cannot be read: {err}")),
                },
                Ok(info) if info.ifindex == 0 => LinkState {
                    pin,
                    iface: None,
                    ifindex: 0,
                    up: false,
                    problem: Some("its interface is gone".into()),
                },
                Ok(info) => LinkState::on(pin, info.ifindex, &info.ifindex.to_string()),
            };
            links.push(state);
        }
    }
    // Netlink filters, by their markers (the filter itself is looked up by the interface's
    // name: a filter is no object with an id to ask the kernel about).
    for marker in markers(pin_dir) {
        let pin = marker
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let Some((name, _)) = parse_pin_name(&pin) else {
            continue;
        };
        let ifindex = sys::ifindex(&name).unwrap_or(0);
        links.push(LinkState::on(format!("{TC_DIR}/{pin}"), ifindex, &name));
    }
    links.sort_by(|a, b| a.pin.cmp(&b.pin));
    let tails = subdirs(&pin_dir.join(TAILS_DIR))
        .iter()
        .filter(|d| {
            [map_names::TAILS, map_names::TC_TAILS]
                .iter()
                .all(|m| d.join(m).exists())
        })
        .count();
    (links, tails)
}

/// The name of interface `ifindex` in this network namespace, and whether it is up with
/// carrier (IFF_UP and IFF_RUNNING).
fn interface_up(ifindex: u32) -> (Option<String>, bool) {
    match sys::interface_name(ifindex) {
        Some(name) => {
            let up = sys::interface_up(&name);
            (Some(name), up)
        }
        None => (None, false),
    }
}

/// Removes the pins in `dir`, then `dir` (gone already: nothing to do).
fn remove_pin_tree(dir: &Path) -> Result<(), DatapathError> {
    if let Ok(entries) = fs::read_dir(dir) {
        for entry in entries.flatten() {
            remove_pin(&entry.path())?;
        }
    }
    let _ = fs::remove_dir(dir);
    Ok(())
}

/// The directories in `dir` (none if it does not exist).
fn subdirs(dir: &Path) -> Vec<PathBuf> {
    fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default()
}

/// The conntrack event ring (`FP_CT_EVENTS`), opened for draining.
pub type CtEventRing = RingBuf<MapData>;

/// The conntrack event ring drains through [`crate::ct_events::drain`].
impl<T> RecordSource for RingBuf<T> {
    fn pop_with(&mut self, f: impl FnOnce(&[u8])) -> bool {
        match self.next() {
            Some(record) => {
                f(&record);
                // Dropping the item hands its space back to the kernel.
                true
            }
            None => false,
        }
    }
}

/// The conntrack event ring pinned at `map_path`, opened for draining, and its size in bytes
/// (for tools and benchmarks; the daemon takes its own with [`Datapath::take_ct_events`]).
/// Only one reader may drain a ring at a time.
pub fn open_ct_events_pin(map_path: &Path) -> Result<(CtEventRing, u32), DatapathError> {
    let data = MapData::from_pin(map_path).map_err(|source| DatapathError::Map {
        what: format!("opening {}", map_path.display()),
        source,
    })?;
    let bytes = data
        .info()
        .map_err(|source| DatapathError::Map {
            what: format!("reading the size of {}", map_path.display()),
            source,
        })?
        .max_entries();
    let ring =
        RingBuf::try_from(aya::maps::Map::RingBuf(data)).map_err(|source| DatapathError::Map {
            what: "opening FP_CT_EVENTS".into(),
            source,
        })?;
    Ok((ring, bytes))
}

/// Plans and applies `services` to a loaded datapath with its own planner (tools, tests
/// and benchmarks; the daemon plans in [`crate::rules`]): see [`crate::lb::ServicePlanner`].
/// A packet sees a service either as it was or as it is now, never half written.
pub fn apply_services(
    ebpf: &mut Ebpf,
    writer: &mut Option<LbWriter>,
    services: &[crate::config::ServiceConfig],
    only: Option<&[usize]>,
) -> Result<ServicesApplied, DatapathError> {
    let w = writer.get_or_insert_with(LbWriter::default);
    let mut maps = EbpfLb {
        ebpf,
        maps: &mut w.maps,
    };
    w.planner.apply(&mut maps, services, only)
}

/// A loaded object's LB maps as a [`ServiceMaps`].
struct EbpfLb<'a> {
    ebpf: &'a mut Ebpf,
    maps: &'a mut Option<LbMaps>,
}

impl ServiceMaps for EbpfLb<'_> {
    fn current_services(&mut self) -> Result<Vec<(SvcKey, Service)>, DatapathError> {
        current_services(self.ebpf)
    }

    fn write_services(&mut self, plan: &crate::lb::Plan) -> Result<(), DatapathError> {
        if self.maps.is_none() {
            *self.maps = Some(LbMaps {
                backends: Mapped::array(self.ebpf, map_names::BACKENDS)?,
                slots: Mapped::array(self.ebpf, map_names::LB_SLOTS)?,
            });
        }
        let Some(maps) = self.maps.as_mut() else {
            return Err(DatapathError::MissingMap {
                name: map_names::LB_SLOTS,
            });
        };
        write_plan(self.ebpf, maps, plan)
    }
}

/// Writes a plan: backends and tables into free space, then the service switches, then the
/// removals.
fn write_plan(
    ebpf: &mut Ebpf,
    w: &mut LbMaps,
    plan: &crate::lb::Plan,
) -> Result<(), DatapathError> {
    // Fresh backend indexes start with no connections counted (least-connections).
    for &(off, len) in &plan.fresh_backends {
        zero_backend_loads(ebpf, off..off + len)?;
    }
    // Tables and backends go straight into the memory-mapped arrays (no syscall per
    // element); the service switch below is a syscall, which orders these writes before it.
    for (off, list) in &plan.backends {
        w.backends.write(*off, list)?;
    }
    for (off, table) in &plan.slots {
        w.slots.write(*off, table)?;
    }
    let (keys, values): (Vec<SvcKey>, Vec<Service>) = plan.services.iter().copied().unzip();
    update_batch(map_fd(ebpf, map_names::SVC)?, &keys, &values, "FP_SVC")?;
    let mut table: HashMap<&mut MapData, SvcKey, Service> =
        HashMap::try_from(map_data(ebpf, map_names::SVC)?).map_err(|source| {
            DatapathError::Map {
                what: "opening FP_SVC".into(),
                source,
            }
        })?;
    for k in &plan.remove {
        table.remove(k).map_err(|source| DatapathError::Map {
            what: "removing a service from FP_SVC".into(),
            source,
        })?;
    }
    Ok(())
}

/// The LB arrays mapped into this process, kept for the datapath's life: mapping a whole
/// array costs milliseconds (every page is mapped up front), writing into it microseconds.
struct LbMaps {
    backends: Mapped<Backend>,
    slots: Mapped<u32>,
}

/// What [`apply_services`] keeps between calls: the mapped arrays and the planner.
#[derive(Default)]
pub struct LbWriter {
    maps: Option<LbMaps>,
    planner: crate::lb::ServicePlanner,
}

/// A BPF array created with BPF_F_MMAPABLE, mapped into this process (see
/// [`sys::SharedArray`]).
struct Mapped<T>(sys::SharedArray<T>);

impl<T: Copy> Mapped<T> {
    fn array(ebpf: &mut Ebpf, name: &'static str) -> Result<Mapped<T>, DatapathError> {
        let data = match map_data(ebpf, name)? {
            aya::maps::Map::Array(d) => d,
            _ => return Err(DatapathError::MissingMap { name }),
        };
        let info = data.info().map_err(|source| DatapathError::Map {
            what: format!("reading {name}'s info"),
            source,
        })?;
        let bytes = info.max_entries() as usize * (info.value_size() as usize).next_multiple_of(8);
        sys::SharedArray::map(data.fd().as_fd(), bytes)
            .map(Mapped)
            .map_err(|source| DatapathError::Io {
                what: format!(
                    "mapping {name} into memory (a datapath pinned by an older fastpath? `fastpath detach`, then start again)"
                ),
                source,
            })
    }

    /// Copies `values` to elements `off..off + values.len()`.
    fn write(&mut self, off: u32, values: &[T]) -> Result<(), DatapathError> {
        if self.0.write(off as usize, values) {
            return Ok(());
        }
        Err(DatapathError::Io {
            what: format!(
                "writing {} elements at {off} of a {}-element array",
                values.len(),
                self.0.len()
            ),
            source: io::Error::from(io::ErrorKind::InvalidInput),
        })
    }
}

/// Zeroes the connection counts (`FP_BACKEND_LOAD`, `FP_BACKEND_GONE`) of backend indexes
/// below `upto`: after the conntrack table was emptied, no connection is left to count.
pub fn reset_backend_loads(ebpf: &mut Ebpf, upto: u32) -> Result<(), DatapathError> {
    zero_backend_loads(ebpf, 0..upto.min(fastpath_common::lb::MAX_BACKENDS))
}

/// Zeroes the connection counts of the backend indexes in `range`.
fn zero_backend_loads(ebpf: &mut Ebpf, range: std::ops::Range<u32>) -> Result<(), DatapathError> {
    let keys: Vec<u32> = range.collect();
    let loads = vec![fastpath_common::lb::BackendLoad::default(); keys.len()];
    update_batch(
        map_fd(ebpf, map_names::BACKEND_LOAD)?,
        &keys,
        &loads,
        "FP_BACKEND_LOAD",
    )?;
    update_batch(
        map_fd(ebpf, map_names::BACKEND_GONE)?,
        &keys,
        &vec![0u64; keys.len()],
        "FP_BACKEND_GONE",
    )
}

/// The load balancer's numbering of a loaded datapath (services and backends), for HA sync.
pub fn lb_index(ebpf: &mut Ebpf) -> Result<crate::sync::LbIndex, DatapathError> {
    let services = current_services(ebpf)?;
    let backends: Array<&mut MapData, Backend> =
        Array::try_from(map_data(ebpf, map_names::BACKENDS)?).map_err(|source| {
            DatapathError::Map {
                what: "opening FP_BACKENDS".into(),
                source,
            }
        })?;
    Ok(crate::sync::LbIndex::new(&services, |i| {
        backends.get(&i, 0).ok()
    }))
}

/// What `FP_SVC` holds now (read in batches).
pub fn current_services(ebpf: &mut Ebpf) -> Result<Vec<(SvcKey, Service)>, DatapathError> {
    let mut out = Vec::new();
    sys::map_walk_batches(
        map_fd(ebpf, map_names::SVC)?,
        |k: &[SvcKey], v: &[Service]| {
            out.extend(k.iter().copied().zip(v.iter().copied()));
        },
    )
    .map_err(|source| DatapathError::Io {
        what: "reading FP_SVC".into(),
        source,
    })?;
    Ok(out)
}

fn map_data<'a>(
    ebpf: &'a mut Ebpf,
    name: &'static str,
) -> Result<&'a mut aya::maps::Map, DatapathError> {
    ebpf.map_mut(name).ok_or(DatapathError::MissingMap { name })
}

/// The fd of a loaded map, for batched syscalls aya does not offer.
fn map_fd<'a>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<BorrowedFd<'a>, DatapathError> {
    use aya::maps::Map;
    let data = match map_data(ebpf, name)? {
        Map::Array(d) | Map::HashMap(d) | Map::PerCpuArray(d) => d,
        _ => return Err(DatapathError::MissingMap { name }),
    };
    Ok(data.fd().as_fd())
}

/// What one application of services wrote.
#[derive(Debug)]
pub struct ServicesApplied {
    /// Services written (new or changed).
    pub services: usize,
    /// Services already as desired: not written.
    pub unchanged: usize,
    pub removed: usize,
    pub backends: usize,
    pub slots: usize,
    pub took: std::time::Duration,
}

/// Writes `keys[i] → values[i]` into the map `fd` with one batched update per 64k elements
/// (see [`sys::map_update_batch`]).
fn update_batch<K: Copy, V: Copy>(
    fd: BorrowedFd<'_>,
    keys: &[K],
    values: &[V],
    what: &str,
) -> Result<(), DatapathError> {
    sys::map_update_batch(fd, keys, values).map_err(|e| DatapathError::Io {
        what: format!("writing {what} ({} of {} written)", e.written, keys.len()),
        source: e.source,
    })
}

/// The map pinned at `map_path`.
pub(super) fn map_at(map_path: &Path) -> Result<MapData, DatapathError> {
    MapData::from_pin(map_path).map_err(|source| DatapathError::Map {
        what: format!("opening {}", map_path.display()),
        source,
    })
}

/// Opens a pinned map of a running datapath by name.
pub(super) fn pinned_map(pin_dir: &Path, name: &str) -> Result<MapData, DatapathError> {
    let path = pin_dir.join("maps").join(name);
    MapData::from_pin(&path).map_err(|source| DatapathError::Map {
        what: format!(
            "opening {} (is a fastpath datapath running with this pin dir?)",
            path.display()
        ),
        source,
    })
}

/// The runtime knobs of a pinned datapath (`FP_CONFIG[0]`).
pub fn pinned_config(pin_dir: &Path) -> Result<DatapathConfig, DatapathError> {
    let data = pinned_map(pin_dir, map_names::CONFIG)?;
    let array: Array<MapData, DatapathConfig> = Array::try_from(aya::maps::Map::Array(data))
        .map_err(|source| DatapathError::Map {
            what: "opening FP_CONFIG".into(),
            source,
        })?;
    array.get(&0, 0).map_err(|source| DatapathError::Map {
        what: "reading FP_CONFIG".into(),
        source,
    })
}

/// One load-balanced service of a pinned datapath, with its counters (`fastpath service list`).
#[derive(Debug, serde::Serialize)]
pub struct ServiceRow {
    pub vip: std::net::IpAddr,
    pub port: u16,
    pub protocol: String,
    pub id: u32,
    pub generation: u32,
    pub packets: u64,
    pub bytes: u64,
    pub connections: u64,
    pub no_backend: u64,
    /// `nat`, `full_nat` or `dsr`.
    pub mode: String,
    /// Full-NAT: the source address and port range, `10.0.2.1 1024-32767`.
    pub snat: Option<String>,
    pub backends: Vec<BackendRow>,
}

#[derive(Debug, serde::Serialize)]
pub struct BackendRow {
    pub address: std::net::IpAddr,
    pub port: u16,
    /// Share of the selection table (new connections), in percent: 0 when drained or down.
    pub share_pct: f64,
    pub packets: u64,
    pub bytes: u64,
    /// Connections given this backend.
    pub connections: u64,
    /// Of those, tracked now and not closed (TIME_WAIT/CLOSE excluded).
    pub active: u64,
}

/// Starts a new generation of learned VXLAN headers and cached routes (`FP_VXLAN_GEN`):
/// every entry learned before is a miss until the kernel's path (or the FIB) teaches it
/// again.
pub fn bump_vxlan_generation(ebpf: &mut Ebpf) -> Result<(), DatapathError> {
    let map = ebpf
        .map_mut(map_names::VXLAN_GEN)
        .ok_or(DatapathError::MissingMap {
            name: map_names::VXLAN_GEN,
        })?;
    let mut array = Array::try_from(map).map_err(|source| DatapathError::Map {
        what: "opening FP_VXLAN_GEN".into(),
        source,
    })?;
    next_generation(&mut array, None).map(drop)
}

/// Serializes this process's read-modify-writes of `FP_VXLAN_GEN`: a configuration change and
/// the route watcher both bump it, and the flag one writes must not be lost to the other's
/// write of what it read before.
static GENERATION_WRITES: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Bumps the generation in `array` (`FP_VXLAN_GEN`) and, if `per_dst` says, sets or clears
/// its `GEN_F_FIB_PER_DST` in the same write (else it is kept); returns the new one.
fn next_generation<T: std::borrow::BorrowMut<MapData>>(
    array: &mut Array<T, u64>,
    per_dst: Option<bool>,
) -> Result<u64, DatapathError> {
    use fastpath_common::route::GEN_F_FIB_PER_DST;
    let _serial = GENERATION_WRITES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let current = array.get(&0, 0).unwrap_or(0);
    let flag = match per_dst {
        Some(true) => GEN_F_FIB_PER_DST,
        Some(false) => 0,
        None => current & GEN_F_FIB_PER_DST,
    };
    let next = ((current & !GEN_F_FIB_PER_DST).wrapping_add(1) & !GEN_F_FIB_PER_DST) | flag;
    array
        .set(0, &next, 0)
        .map_err(|source| DatapathError::Map {
            what: "writing FP_VXLAN_GEN".into(),
            source,
        })?;
    Ok(next)
}

/// The generation of learned VXLAN headers of a running datapath (pinned `FP_VXLAN_GEN`).
pub struct VxlanGeneration(Array<MapData, u64>);

impl VxlanGeneration {
    /// The map pinned at `map_path` (`<pin_dir>/maps/FP_VXLAN_GEN` for the daemon's).
    pub fn open_pin(map_path: &Path) -> Result<VxlanGeneration, DatapathError> {
        let data = map_at(map_path)?;
        Array::try_from(aya::maps::Map::Array(data))
            .map(VxlanGeneration)
            .map_err(|source| DatapathError::Map {
                what: "opening FP_VXLAN_GEN".into(),
                source,
            })
    }

    /// The generation's number (without its `GEN_F_FIB_PER_DST`).
    pub fn current(&self) -> u64 {
        self.word() & !fastpath_common::route::GEN_F_FIB_PER_DST
    }

    /// Whether the generation says the FIB answers by destination alone.
    pub fn per_destination(&self) -> bool {
        self.word() & fastpath_common::route::GEN_F_FIB_PER_DST != 0
    }

    fn word(&self) -> u64 {
        self.0.get(&0, 0).unwrap_or(0)
    }

    /// Starts a new generation, saying whether the FIB answers by destination alone
    /// (`GEN_F_FIB_PER_DST`, see `netwatch::fib_per_destination`); returns it.
    pub fn bump(&mut self, per_dst: bool) -> Result<u64, DatapathError> {
        next_generation(&mut self.0, Some(per_dst))
    }
}

/// The pinned `FP_PEER` of a running datapath: the links whose peer is in another
/// namespace (see `netwatch`), written by the link watcher alone.
pub struct PeerLinks {
    map: Array<MapData, u32>,
    /// The ifindexes set to 1; `None` until the first `set`, which clears every other slot
    /// (a map pinned by an earlier daemon may hold links gone since).
    set: Option<std::collections::BTreeSet<u32>>,
}

impl PeerLinks {
    /// The map pinned at `map_path` (`<pin_dir>/maps/FP_PEER` for the daemon's).
    pub fn open_pin(map_path: &Path) -> Result<PeerLinks, DatapathError> {
        let data = map_at(map_path)?;
        let map =
            Array::try_from(aya::maps::Map::Array(data)).map_err(|source| DatapathError::Map {
                what: "opening FP_PEER".into(),
                source,
            })?;
        Ok(PeerLinks { map, set: None })
    }

    /// Makes `links` (ifindexes) the map's only entries of 1; ifindexes beyond its slots are
    /// left out (a plain redirect serves them).
    pub fn set(&mut self, links: &[u32]) -> Result<(), DatapathError> {
        let wanted: std::collections::BTreeSet<u32> =
            links.iter().copied().filter(|&i| i < IFACE_SLOTS).collect();
        let stale: Vec<u32> = match &self.set {
            Some(set) => set.difference(&wanted).copied().collect(),
            None => (0..IFACE_SLOTS)
                .filter(|i| !wanted.contains(i) && self.map.get(i, 0).unwrap_or(0) != 0)
                .collect(),
        };
        let write = |map: &mut Array<MapData, u32>, i: u32, v: u32| {
            map.set(i, &v, 0).map_err(|source| DatapathError::Map {
                what: format!("writing FP_PEER[{i}]"),
                source,
            })
        };
        let before = self.set.take();
        // Cleared first: a link that stopped qualifying must never get a peer redirect.
        for &i in &stale {
            write(&mut self.map, i, 0)?;
        }
        for &i in &wanted {
            if before.as_ref().is_none_or(|s| !s.contains(&i)) {
                write(&mut self.map, i, 1)?;
            }
        }
        // Only now: after a failed write, the next call scans every slot again.
        self.set = Some(wanted);
        Ok(())
    }
}

/// What the kernel needs to forward the packets the datapath translates and hands to it
/// (services, port forwards, gateway SNAT: the stages rewrite, the kernel routes), set on
/// every attached interface, each change logged:
/// - `net.ipv4.conf.<iface>.forwarding = 1`: the kernel routes only what arrives on an
///   interface with forwarding on (per interface, so other interfaces keep host behaviour);
/// - `net.ipv4.conf.<iface>.accept_local = 1`: a translated reply leaves with the VIP or an
///   SNAT address as its source, which on a node holding that address (a VRRP master) the
///   kernel otherwise drops as a martian;
/// - IPv6 (when `ipv6`): `net.ipv6.conf.<iface>.force_forwarding = 1` (Linux ≥ 6.17), unless
///   `net.ipv6.conf.all.forwarding` is on already. Older kernels forward IPv6 only with the
///   global switch, which also changes how every interface treats router advertisements:
///   that one is the operator's to set, and its absence is an error naming it.
///
/// A strict `rp_filter` would still drop such packets: warned about. Errors name the sysctl
/// that could not be set; the caller refuses to go on.
pub fn prepare_forwarding(ifaces: &[InterfaceConfig], ipv6: bool) -> Result<(), DatapathError> {
    let v6_global = Path::new("/proc/sys/net/ipv6/conf/all/forwarding");
    let v6_on = !ipv6 || fs::read_to_string(v6_global).is_ok_and(|v| v.trim() != "0");
    for iface in ifaces {
        let name = iface.name.get_ref();
        let v4 = Path::new("/proc/sys/net/ipv4/conf").join(name);
        ensure_sysctl(
            &v4.join("forwarding"),
            "the kernel forwards what the datapath translated",
        )?;
        ensure_sysctl(
            &v4.join("accept_local"),
            "translated replies come from this node's addresses",
        )?;
        if !v6_on {
            let force = Path::new("/proc/sys/net/ipv6/conf")
                .join(name)
                .join("force_forwarding");
            if !force.exists() {
                return Err(DatapathError::Sysctl {
                    sysctl: "net.ipv6.conf.all.forwarding".into(),
                    why: "IPv6 services and NAT need IPv6 forwarding, which this kernel (before 6.17) turns on only for all interfaces at once: set it yourself (`sysctl -w net.ipv6.conf.all.forwarding=1`; with it, interfaces that take router advertisements need accept_ra = 2)".into(),
                });
            }
            ensure_sysctl(
                &force,
                "the kernel forwards the IPv6 the datapath translated",
            )?;
            // force_forwarding is the kernel's forwarding decision only: bpf_fib_lookup still
            // answers "forwarding disabled" for IPv6 arriving on an interface whose own
            // forwarding flag is off, and gateway SNAT asks it where a connection leaves.
            ensure_sysctl(
                &Path::new("/proc/sys/net/ipv6/conf")
                    .join(name)
                    .join("forwarding"),
                "the datapath's route lookups (bpf_fib_lookup) answer IPv6 arriving here",
            )?;
        }
        if fs::read_to_string(v4.join("rp_filter")).is_ok_and(|v| v.trim() == "1") {
            warn!(iface = %name, "rp_filter is strict (1) here; set it to 2 (loose) or 0, or translated traffic arriving here may be dropped");
        }
    }
    Ok(())
}

/// Sets the boolean sysctl at `path` (under /proc/sys) to 1 unless it is already.
fn ensure_sysctl(path: &Path, why: &str) -> Result<(), DatapathError> {
    let sysctl = path
        .strip_prefix("/proc/sys")
        .unwrap_or(path)
        .display()
        .to_string()
        .replace('/', ".");
    if fs::read_to_string(path).is_ok_and(|v| v.trim() == "1") {
        return Ok(());
    }
    fs::write(path, "1").map_err(|e| DatapathError::Sysctl {
        sysctl: sysctl.clone(),
        why: format!(
            "{why}, but it could not be set ({e}): set it yourself (`sysctl -w {sysctl}=1`)"
        ),
    })?;
    info!(sysctl = %sysctl, why, "Set a sysctl to 1");
    Ok(())
}

fn ip_of(family: u8, a: &[u8; 16]) -> std::net::IpAddr {
    if family == 4 {
        std::net::IpAddr::from([a[0], a[1], a[2], a[3]])
    } else {
        std::net::IpAddr::from(*a)
    }
}

/// Services, backends and their counters in a pinned datapath; active connections come from
/// one batched walk of the conntrack table.
pub fn pinned_services(pin_dir: &Path) -> Result<Vec<ServiceRow>, DatapathError> {
    use fastpath_common::{
        ct::{CT_F_LB, tcp_state},
        lb::{BackendCounters, SvcCounters},
    };
    let svc_map = pinned_map(pin_dir, map_names::SVC)?;
    let mut services: Vec<(SvcKey, Service)> = Vec::new();
    sys::map_walk_batches(svc_map.fd().as_fd(), |k: &[SvcKey], v: &[Service]| {
        services.extend(k.iter().copied().zip(v.iter().copied()));
    })
    .map_err(|source| DatapathError::Io {
        what: "reading FP_SVC".into(),
        source,
    })?;
    services.sort_by_key(|(k, _)| (k.family, k.vip, k.port, k.proto));
    let map_err = |what: &str| {
        let what = what.to_owned();
        move |source| DatapathError::Map {
            what: what.clone(),
            source,
        }
    };
    let svc_stats: PerCpuArray<MapData, SvcCounters> = PerCpuArray::try_from(
        aya::maps::Map::PerCpuArray(pinned_map(pin_dir, map_names::SVC_STATS)?),
    )
    .map_err(map_err("opening FP_SVC_STATS"))?;
    let be_stats: PerCpuArray<MapData, BackendCounters> = PerCpuArray::try_from(
        aya::maps::Map::PerCpuArray(pinned_map(pin_dir, map_names::BACKEND_STATS)?),
    )
    .map_err(map_err("opening FP_BACKEND_STATS"))?;
    let backends: Array<MapData, Backend> = Array::try_from(aya::maps::Map::Array(pinned_map(
        pin_dir,
        map_names::BACKENDS,
    )?))
    .map_err(map_err("opening FP_BACKENDS"))?;
    let slots: Array<MapData, [u32; 2]> = Array::try_from(aya::maps::Map::Array(pinned_map(
        pin_dir,
        map_names::LB_SLOTS,
    )?))
    .map_err(map_err("opening FP_LB_SLOTS"))?;
    let mut active: std::collections::HashMap<u32, u64> = std::collections::HashMap::new();
    ct::pinned_ct_table(pin_dir)?
        .walk(|_, entries| {
            for e in entries {
                let closed = e.state == tcp_state::TIME_WAIT || e.state == tcp_state::CLOSE;
                if e.flags & CT_F_LB != 0 && !closed {
                    *active.entry(e.nat.backend).or_default() += 1;
                }
            }
        })
        .map_err(|source| DatapathError::Io {
            what: "walking FP_CT".into(),
            source,
        })?;
    let mut rows = Vec::new();
    for (key, svc) in services {
        let sum = svc_stats
            .get(&svc.id, 0)
            .map_err(map_err("reading FP_SVC_STATS"))?
            .iter()
            .fold(SvcCounters::default(), |mut a, c| {
                a.packets += c.packets;
                a.bytes += c.bytes;
                a.connections += c.connections;
                a.no_backend += c.no_backend;
                a
            });
        let mut share: std::collections::HashMap<u32, u64> = std::collections::HashMap::new();
        for i in svc.slots_off..svc.slots_off + svc.slots_len {
            let pair = slots
                .get(&(i / 2), 0)
                .map_err(map_err("reading FP_LB_SLOTS"))?;
            *share.entry(pair[(i % 2) as usize]).or_default() += 1;
        }
        let mut brows = Vec::new();
        for idx in svc.backends_off..svc.backends_off + svc.backends_len {
            let b = backends
                .get(&idx, 0)
                .map_err(map_err("reading FP_BACKENDS"))?;
            let c = be_stats
                .get(&idx, 0)
                .map_err(map_err("reading FP_BACKEND_STATS"))?
                .iter()
                .fold(BackendCounters::default(), |mut a, c| {
                    a.packets += c.packets;
                    a.bytes += c.bytes;
                    a.connections += c.connections;
                    a
                });
            brows.push(BackendRow {
                address: ip_of(b.family, &b.addr),
                port: b.port,
                share_pct: if svc.slots_len == 0 {
                    0.0
                } else {
                    100.0 * share.get(&idx).copied().unwrap_or(0) as f64 / f64::from(svc.slots_len)
                },
                packets: c.packets,
                bytes: c.bytes,
                connections: c.connections,
                active: active.get(&idx).copied().unwrap_or(0),
            });
        }
        rows.push(ServiceRow {
            vip: ip_of(key.family, &key.vip),
            port: key.port,
            protocol: if key.proto == 17 { "udp" } else { "tcp" }.into(),
            id: svc.id,
            generation: svc.generation,
            packets: sum.packets,
            bytes: sum.bytes,
            connections: sum.connections,
            no_backend: sum.no_backend,
            mode: if svc.flags & fastpath_common::lb::SVC_F_FULL_NAT != 0 {
                "full_nat"
            } else if svc.flags & fastpath_common::lb::SVC_F_DSR != 0 {
                "dsr"
            } else {
                "nat"
            }
            .into(),
            snat: (svc.flags & fastpath_common::lb::SVC_F_FULL_NAT != 0).then(|| {
                format!(
                    "{} {}-{}",
                    ip_of(key.family, &svc.snat_addr),
                    svc.snat_port_lo,
                    svc.snat_port_hi
                )
            }),
            backends: brows,
        });
    }
    Ok(rows)
}

/// Conntrack counters of a pinned datapath, summed over CPUs, indexed by `ct_stat::*`.
pub fn pinned_ct_stats(pin_dir: &Path) -> Result<Vec<u64>, DatapathError> {
    pinned_counters(pin_dir, map_names::CT_STATS, ct_stat::COUNT)
}

/// VXLAN learning counters of a pinned datapath, summed over CPUs, indexed by
/// `vxlan_stat::*`, and the current generation of learned headers. Zeros from a datapath
/// pinned before VXLAN existed (no such maps).
pub fn pinned_vxlan_stats(pin_dir: &Path) -> Result<(Vec<u64>, u64), DatapathError> {
    let maps = pin_dir.join("maps");
    if !maps.join(map_names::VXLAN_STATS).exists() {
        return Ok((vec![0; vxlan_stat::COUNT as usize], 0));
    }
    let sums = pinned_counters(pin_dir, map_names::VXLAN_STATS, vxlan_stat::COUNT)?;
    let generation = VxlanGeneration::open_pin(&maps.join(map_names::VXLAN_GEN))?.current();
    Ok((sums, generation))
}

/// Whether a pinned datapath's new load-balanced connections share their backend's route (the
/// daemon's `GEN_F_FIB_PER_DST`); false for a datapath without the map.
pub fn pinned_route_shared(pin_dir: &Path) -> Result<bool, DatapathError> {
    let path = pin_dir.join("maps").join(map_names::VXLAN_GEN);
    if !path.exists() {
        return Ok(false);
    }
    Ok(VxlanGeneration::open_pin(&path)?.per_destination())
}

/// Route cache counters of a pinned datapath, summed over CPUs, indexed by `route_stat::*`.
/// Zeros from a datapath pinned before the cache existed (no such map).
pub fn pinned_route_stats(pin_dir: &Path) -> Result<Vec<u64>, DatapathError> {
    if !pin_dir.join("maps").join(map_names::ROUTE_STATS).exists() {
        return Ok(vec![0; route_stat::COUNT as usize]);
    }
    pinned_counters(pin_dir, map_names::ROUTE_STATS, route_stat::COUNT)
}

/// The first `count` slots of a pinned per-CPU array of counters, each summed over CPUs.
fn pinned_counters(pin_dir: &Path, map: &str, count: u32) -> Result<Vec<u64>, DatapathError> {
    let data = pinned_map(pin_dir, map)?;
    let array: PerCpuArray<MapData, u64> = PerCpuArray::try_from(aya::maps::Map::PerCpuArray(data))
        .map_err(|source| DatapathError::Map {
            what: format!("opening {map}"),
            source,
        })?;
    let mut sums = Vec::with_capacity(count as usize);
    for code in 0..count {
        let per_cpu = array.get(&code, 0).map_err(|source| DatapathError::Map {
            what: format!("reading {map}[{code}]"),
            source,
        })?;
        sums.push(per_cpu.iter().sum());
    }
    Ok(sums)
}

/// Reads the counters of a pinned datapath without loading anything (`fastpath stats`).
pub fn pinned_stats(pin_dir: &Path) -> Result<StatsSnapshot, DatapathError> {
    let path = pin_dir.join("maps").join(map_names::STATS);
    let data = MapData::from_pin(&path).map_err(|source| DatapathError::Map {
        what: format!(
            "opening {} (is a fastpath datapath running with this pin dir?)",
            path.display()
        ),
        source,
    })?;
    let array: PerCpuArray<MapData, Counter> =
        PerCpuArray::try_from(aya::maps::Map::PerCpuArray(data)).map_err(|source| {
            DatapathError::Map {
                what: "opening FP_STATS".into(),
                source,
            }
        })?;
    // Missing where a datapath from before reason code 64 runs: it counts none of those.
    let ext_path = pin_dir.join("maps").join(map_names::STATS_EXT);
    let ext = match MapData::from_pin(&ext_path) {
        Ok(data) => Some(
            PerCpuArray::<MapData, Counter>::try_from(aya::maps::Map::PerCpuArray(data)).map_err(
                |source| DatapathError::Map {
                    what: "opening FP_STATS_EXT".into(),
                    source,
                },
            )?,
        ),
        Err(_) if !ext_path.exists() => None,
        Err(source) => {
            return Err(DatapathError::Map {
                what: format!("opening {}", ext_path.display()),
                source,
            });
        }
    };
    Ok(StatsSnapshot::read(&array, ext.as_ref())?)
}

/// The program kinds attached through bpf_links (XDP, TCX), seen alike for pinning.
trait LinkedProgram {
    type Link: TryFrom<FdLink, Error = LinkError>;
    type LinkId;
    /// Atomically swaps this program into `link` (bpf_link_update).
    fn replace_in(&mut self, link: Self::Link) -> Result<Self::LinkId, ProgramError>;
    /// Takes ownership of an attached link as a plain fd link.
    fn take_fd_link(&mut self, id: Self::LinkId) -> Result<FdLink, DatapathError>;
}

impl LinkedProgram for Xdp {
    type Link = XdpLink;
    type LinkId = XdpLinkId;
    fn replace_in(&mut self, link: XdpLink) -> Result<XdpLinkId, ProgramError> {
        self.attach_to_link(link)
    }
    fn take_fd_link(&mut self, id: XdpLinkId) -> Result<FdLink, DatapathError> {
        let link = self
            .take_link(id)
            .map_err(|source| DatapathError::Program {
                what: "taking the XDP link".into(),
                source,
            })?;
        FdLink::try_from(link).map_err(|source| DatapathError::Link {
            what: "the XDP link is not a bpf_link (kernel too old?)".into(),
            source,
        })
    }
}

impl LinkedProgram for SchedClassifier {
    type Link = SchedClassifierLink;
    type LinkId = SchedClassifierLinkId;
    fn replace_in(
        &mut self,
        link: SchedClassifierLink,
    ) -> Result<SchedClassifierLinkId, ProgramError> {
        self.attach_to_link(link)
    }
    fn take_fd_link(&mut self, id: SchedClassifierLinkId) -> Result<FdLink, DatapathError> {
        let link = self
            .take_link(id)
            .map_err(|source| DatapathError::Program {
                what: "taking the TC link".into(),
                source,
            })?;
        FdLink::try_from(link).map_err(|source| DatapathError::Link {
            what: "the TC link is not a bpf_link (kernel without TCX?)".into(),
            source,
        })
    }
}

/// A pinned link found at start, to receive the new program once every fresh attach worked.
struct PendingSwap {
    iface: String,
    hook: HookKind,
    xdp: XdpMode,
    pin: PathBuf,
    /// None: a netlink filter's marker.
    link: Option<FdLink>,
}

enum SwapError {
    /// The link no longer works (its interface is gone) or is of another kind: attach afresh.
    Stale(DatapathError),
    /// The kernel refused the swap for another reason: stop, keep the old program.
    Failed(DatapathError),
}

fn errno(e: &ProgramError) -> Option<i32> {
    match e {
        ProgramError::SyscallError(aya::sys::SyscallError { io_error, .. }) => {
            io_error.raw_os_error()
        }
        _ => None,
    }
}

/// Swaps `prog` into `link` (pinned at `pin`) atomically.
fn swap_into<P: LinkedProgram>(
    prog: &mut P,
    link: FdLink,
    pin: &Path,
) -> Result<FdLink, SwapError> {
    let typed = P::Link::try_from(link).map_err(|source| {
        SwapError::Stale(DatapathError::Link {
            what: format!("{} holds another kind of link", pin.display()),
            source,
        })
    })?;
    let id = prog.replace_in(typed).map_err(|source| {
        let stale = errno(&source) == Some(libc::ENOLINK);
        let e = DatapathError::Program {
            what: format!("replacing the program of {}", pin.display()),
            source,
        };
        if stale {
            SwapError::Stale(e)
        } else {
            SwapError::Failed(e)
        }
    })?;
    prog.take_fd_link(id).map_err(SwapError::Failed)
}

/// Attaches XDP in the configured mode. `auto` falls back to generic only when the driver
/// cannot do native XDP (EOPNOTSUPP/EINVAL); other errors (EBUSY, ...) are reported as such.
fn attach_xdp(
    prog: &mut Xdp,
    c_iface: &CString,
    iface: &str,
    mode: XdpMode,
) -> Result<(XdpLinkId, &'static str), DatapathError> {
    let attach = |prog: &mut Xdp, m: AyaXdpMode| prog.attach(c_iface.as_c_str(), m);
    let err = |m: AyaXdpMode, source: ProgramError| {
        let hint = match m {
            AyaXdpMode::Driver => {
                " (native mode needs driver support; xdp = \"auto\" falls back to generic, xdp = \"generic\" forces it)"
            }
            _ => "",
        };
        DatapathError::Program {
            what: format!("attaching XDP ({m:?}) to {iface}{hint}"),
            source,
        }
    };
    match mode {
        XdpMode::Native => attach(prog, AyaXdpMode::Driver)
            .map(|id| (id, "native"))
            .map_err(|e| err(AyaXdpMode::Driver, e)),
        XdpMode::Generic => attach(prog, AyaXdpMode::Skb)
            .map(|id| (id, "generic"))
            .map_err(|e| err(AyaXdpMode::Skb, e)),
        XdpMode::Auto | XdpMode::Off => match attach(prog, AyaXdpMode::Driver) {
            Ok(id) => Ok((id, "native")),
            Err(e) if matches!(errno(&e), Some(libc::EOPNOTSUPP | libc::EINVAL)) => {
                warn!(iface, error = %e, "Native XDP unavailable; falling back to generic (skb) mode");
                attach(prog, AyaXdpMode::Skb)
                    .map(|id| (id, "generic"))
                    .map_err(|e| err(AyaXdpMode::Skb, e))
            }
            Err(e) => Err(err(AyaXdpMode::Driver, e)),
        },
    }
}

fn tc_program_name(hook: HookKind) -> &'static str {
    match hook {
        HookKind::TcEgress => program_names::TC_EGRESS,
        _ => program_names::TC_INGRESS,
    }
}

/// Which tail programs [`install_tails`] wants.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Tails {
    /// Every one this tree names: a missing one is an error.
    All,
    /// Those the object has.
    Present,
}

/// Loads the tail programs — XDP (`program_names::XDP_TAILS`) and TC ingress
/// (`program_names::TC_TAILS`) — and puts each in its program array (`FP_TAILS`,
/// `FP_TC_TAILS`) at its index, where the main programs find them. `Tails::Present`: only
/// those the object has (an earlier build's, timed beside this tree's by the benchmark).
pub fn install_tails(ebpf: &mut Ebpf, which: Tails) -> Result<(), DatapathError> {
    let arrays: [(&'static str, &[&'static str]); 2] = [
        (map_names::TAILS, &program_names::XDP_TAILS),
        (map_names::TC_TAILS, &program_names::TC_TAILS),
    ];
    for (map, names) in arrays {
        for (index, &name) in names.iter().enumerate() {
            if which == Tails::Present && ebpf.program(name).is_none() {
                continue;
            }
            let loaded = if map == map_names::TAILS {
                program::<Xdp>(ebpf, name)?.load()
            } else {
                program::<SchedClassifier>(ebpf, name)?.load()
            };
            loaded.map_err(|source| DatapathError::Program {
                what: format!("loading {name}"),
                source,
            })?;
            let fd = ebpf
                .program(name)
                .ok_or(DatapathError::MissingProgram { name })?
                .fd()
                .and_then(|fd| fd.try_clone().map_err(ProgramError::from));
            set_tail(ebpf, map, index, name, fd)?;
        }
    }
    Ok(())
}

/// Pins this load's tail-call arrays under `tails/<id of its XDP program>` (see the module's
/// invariant); returns that directory.
fn pin_tails(ebpf: &Ebpf, pin_dir: &Path) -> Result<PathBuf, DatapathError> {
    let id = ebpf
        .program(program_names::XDP)
        .ok_or(DatapathError::MissingProgram {
            name: program_names::XDP,
        })?
        .info()
        .map_err(|source| DatapathError::Program {
            what: format!("reading the id of {}", program_names::XDP),
            source,
        })?
        .id();
    let dir = pin_dir.join(TAILS_DIR).join(id.to_string());
    fs::create_dir_all(&dir).map_err(|source| DatapathError::PinDir {
        path: dir.clone(),
        source,
    })?;
    for name in [map_names::TAILS, map_names::TC_TAILS] {
        let map = ebpf.map(name).ok_or(DatapathError::MissingMap { name })?;
        let path = dir.join(name);
        map.pin(&path)
            .map_err(|source| DatapathError::Pin { path, source })?;
    }
    Ok(dir)
}

/// `map[index] = ` the loaded program `name` (its `fd`).
fn set_tail(
    ebpf: &mut Ebpf,
    map: &'static str,
    index: usize,
    name: &str,
    fd: Result<aya::programs::ProgramFd, ProgramError>,
) -> Result<(), DatapathError> {
    let fd = fd.map_err(|source| DatapathError::Program {
        what: format!("the fd of {name}"),
        source,
    })?;
    let array = ebpf
        .map_mut(map)
        .ok_or(DatapathError::MissingMap { name: map })?;
    let mut tails =
        aya::maps::ProgramArray::try_from(array).map_err(|source| DatapathError::Map {
            what: format!("opening {map}"),
            source,
        })?;
    tails
        .set(index as u32, &fd, 0)
        .map_err(|source| DatapathError::Map {
            what: format!("{map}[{index}] = {name}"),
            source,
        })
}

fn program<'a, T>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut T, DatapathError>
where
    &'a mut T: TryFrom<&'a mut aya::programs::Program, Error = aya::programs::ProgramError>,
{
    let p = ebpf
        .program_mut(name)
        .ok_or(DatapathError::MissingProgram { name })?;
    p.try_into().map_err(|source| DatapathError::Program {
        what: format!("program {name} has the wrong type"),
        source,
    })
}

/// Why the link pinned at `pin` cannot take the new program (its interface is gone, or it is
/// another kind of link), or `None` if it can (or nothing is pinned there).
fn stale_pin(pin: &Path, hook: HookKind) -> Option<&'static str> {
    let info = pinned_link_info(pin).ok()?;
    let want = match hook {
        HookKind::Xdp => BPF_LINK_TYPE_XDP,
        HookKind::TcIngress | HookKind::TcEgress => BPF_LINK_TYPE_TCX,
    };
    if info.link_type != want {
        Some("another kind of link")
    } else if info.ifindex == 0 {
        Some("its interface is gone")
    } else {
        None
    }
}

const BPF_LINK_TYPE_XDP: u32 = 6;
const BPF_LINK_TYPE_TCX: u32 = 11;

/// What the kernel says of the link pinned at `pin`.
fn pinned_link_info(pin: &Path) -> io::Result<sys::LinkInfo> {
    sys::link_info(sys::obj_get(pin)?.as_fd())
}

/// The link pinned at `pin`, if any.
fn open_pinned(pin: &Path) -> Result<Option<FdLink>, DatapathError> {
    if !pin.exists() {
        return Ok(None);
    }
    match PinnedLink::from_pin(pin) {
        Ok(p) => Ok(Some(FdLink::from(p))),
        Err(e) => {
            warn!(pin = %pin.display(), error = %e, "Unreadable link pin; removing it");
            remove_pin(pin)?;
            Ok(None)
        }
    }
}

fn pin_link(fd: FdLink, pin: &Path) -> Result<FdLink, DatapathError> {
    let pinned = fd.pin(pin).map_err(|source| DatapathError::Pin {
        path: pin.to_owned(),
        source,
    })?;
    Ok(FdLink::from(pinned))
}

fn remove_pin(path: &Path) -> Result<(), DatapathError> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(DatapathError::Unpin {
            path: path.to_owned(),
            source,
        }),
    }
}

/// Makes sure `pin_dir` is on a bpffs, mounting `/sys/fs/bpf` if that is where it lives and
/// nothing is mounted there yet.
fn ensure_bpffs(pin_dir: &Path) -> Result<(), DatapathError> {
    let mut probe = pin_dir.to_path_buf();
    while !probe.exists() {
        if !probe.pop() {
            break;
        }
    }
    if is_bpffs(&probe) {
        return Ok(());
    }
    let sys_bpf = Path::new("/sys/fs/bpf");
    if pin_dir.starts_with(sys_bpf) && !is_bpffs(sys_bpf) {
        mount_bpffs(sys_bpf).map_err(|source| DatapathError::Mount { source })?;
        info!("Mounted bpffs on /sys/fs/bpf");
        return Ok(());
    }
    Err(DatapathError::NotBpffs {
        path: pin_dir.to_owned(),
        mount_hint: probe.display().to_string(),
    })
}
