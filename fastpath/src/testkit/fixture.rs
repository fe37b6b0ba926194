//! Table-driven datapath fixtures: each [`Case`] runs through the real entry point of one hook
//! with BPF_PROG_TEST_RUN, and its verdict, output bytes and counter deltas are compared with
//! what the case states. The same tables drive the benchmarks ([`Fixture::run_repeat`]).
//! Conntrack fixtures are [`CtSequence`]s: packets run in order against one table, each step
//! checked for its connection's entry, the conntrack counters and the events it emits.
//!
//! Contract: a [`Fixture`] loads its own copy of the datapath object with its own, empty maps
//! (pinned in a private directory that is removed on drop), so fixtures never see each other's
//! or a running daemon's state. Needs root (CAP_BPF + CAP_NET_ADMIN, and CAP_SYS_ADMIN to mount
//! a bpffs when `/sys/fs/bpf` is not one).

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    path::{Path, PathBuf},
    time::Duration,
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, DevMapHash, HashMap as BpfHashMap, MapData, MapError, PerCpuArray, RingBuf},
    programs::{
        NetworkInterface, ProgramError, SchedClassifier, TestRun, TestRunOptions, TestRunResult,
        Xdp,
        xdp::{XdpLinkId, XdpMode},
    },
};
use fastpath_common::{
    Counter, DatapathConfig, Hook, Verdict,
    ct::{
        CT_F_ASSURED, CT_F_ORIG_IS_LO, CT_F_SEEN_REPLY, CtEntry, CtEvent, CtKey, DIR_ORIGINAL,
        DIR_REPLY, IfaceConfig, ct_event, ct_stat, tcp_state,
    },
    map_names, program_names,
    route::route_stat,
    stats::CONFIG_F_DROP_MALFORMED,
    vxlan::VxlanNet,
};

use crate::datapath::Tails;
use crate::{
    stats::{StatsError, StatsSnapshot},
    sys::ScratchPinDir,
};

/// Raw XDP return codes (`enum xdp_action`).
pub const XDP_ABORTED: u32 = 0;
pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;
pub const XDP_TX: u32 = 3;
pub const XDP_REDIRECT: u32 = 4;
/// Raw TC return codes (`TC_ACT_*`).
pub const TC_ACT_OK: u32 = 0;
/// TC_ACT_UNSPEC (-1) as the u32 BPF_PROG_TEST_RUN reports: in TCX this is TCX_NEXT, "let the
/// next program and then the stack decide" — what the datapath returns for the kernel verdict.
pub const TC_ACT_UNSPEC: u32 = u32::MAX;
pub const TC_ACT_SHOT: u32 = 2;
pub const TC_ACT_REDIRECT: u32 = 7;

/// The kernel refuses BPF_PROG_TEST_RUN input shorter than an Ethernet header.
pub const MIN_INPUT_LEN: usize = 14;
/// Room beyond the input in the output buffer, so a program that grows the packet (encap) is
/// not cut short: the kernel fails the run with ENOSPC when `data_out` is too small.
const OUTPUT_SLACK: usize = 512;

/// What the entry point of `hook` returns for `verdict` today (no stage forwards yet, so a
/// forward verdict would be handed to the kernel).
pub const fn raw_verdict(hook: Hook, verdict: Verdict) -> u32 {
    match (hook, verdict) {
        (Hook::Xdp, Verdict::Drop) => XDP_DROP,
        (Hook::Xdp, Verdict::Kernel) => XDP_PASS,
        // Forwards are redirects (routed, direct server return).
        (Hook::Xdp, Verdict::Forward) => XDP_REDIRECT,
        (Hook::TcIngress | Hook::TcEgress, Verdict::Drop) => TC_ACT_SHOT,
        (Hook::TcIngress | Hook::TcEgress, Verdict::Kernel) => TC_ACT_UNSPEC,
        (Hook::TcIngress | Hook::TcEgress, Verdict::Forward) => TC_ACT_REDIRECT,
    }
}

/// The map state a case runs against. Applied before every run, and every field is written
/// in full, so a case never inherits the previous case's state. Later stages add their maps
/// here (routes, conntrack entries, ...), each with a default of "empty".
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Seed {
    /// Written to `FP_CONFIG[0]`.
    pub config: DatapathConfig,
    /// Written to `FP_IFACE` (ifindex → settings); every interface not listed is removed, so
    /// the default (none) means no hook tracks connections on any interface.
    pub ifaces: Vec<(u32, IfaceConfig)>,
    /// `[[service]]` tables (TOML, as in the daemon's config), applied with the daemon's own
    /// code (`datapath::apply_services`); empty: no service.
    pub services: String,
    /// Written to `FP_VXLAN_NET` (VNI → network); every other VNI is removed.
    pub vxlan_nets: Vec<(u32, VxlanNet)>,
    /// Written to `FP_VXLAN_GEN[0]` when set (`None` leaves the generation as it is). The
    /// learned headers (`FP_VXLAN_PEER`) are not part of a seed: a run of the TC egress
    /// program learns them for the runs after it.
    pub vxlan_generation: Option<u64>,
    /// Written to `FP_TX_PORTS` (each ifindex → its device, as the daemon writes its
    /// configured interfaces); every other entry is removed. Empty (the default): XDP
    /// redirects by ifindex. The interfaces must exist in the namespace the fixture runs in.
    pub tx_ports: Vec<u32>,
}

impl Seed {
    /// The default configuration with these `CONFIG_F_*` flags.
    pub fn flags(flags: u32) -> Self {
        Seed {
            config: DatapathConfig {
                flags,
                ..DatapathConfig::default()
            },
            ..Seed::default()
        }
    }

    /// `drop_malformed` on.
    pub fn drop_malformed() -> Self {
        Seed::flags(CONFIG_F_DROP_MALFORMED)
    }

    /// The default configuration, with interface `ifindex` set to `IFACE_F_*` `flags` (and no
    /// other interface configured).
    pub fn iface(ifindex: u32, flags: u32) -> Self {
        Seed::default().with_iface(ifindex, flags)
    }

    /// This seed with these `[[service]]` tables.
    pub fn with_services(mut self, toml: &str) -> Self {
        self.services = toml.to_owned();
        self
    }

    /// This seed with interface `ifindex` (also) set to `IFACE_F_*` `flags`.
    pub fn with_iface(self, ifindex: u32, flags: u32) -> Self {
        self.with_iface_config(
            ifindex,
            IfaceConfig {
                flags,
                ..IfaceConfig::default()
            },
        )
    }

    /// This seed with `ifindexes` in the XDP redirect device map (and no other interface).
    pub fn with_tx_ports(mut self, ifindexes: &[u32]) -> Self {
        self.tx_ports = ifindexes.to_vec();
        self
    }

    /// This seed with interface `ifindex`'s settings (also) set to `cfg`.
    pub fn with_iface_config(mut self, ifindex: u32, cfg: IfaceConfig) -> Self {
        assert!(
            ifindex < FIXTURE_IFINDEXES,
            "fixture ifindexes stay below {FIXTURE_IFINDEXES}"
        );
        self.ifaces.retain(|(i, _)| *i != ifindex);
        self.ifaces.push((ifindex, cfg));
        self
    }

    fn apply(
        &self,
        ebpf: &mut Ebpf,
        lb_writer: &mut Option<crate::datapath::LbWriter>,
    ) -> Result<(), FixtureError> {
        let map = ebpf
            .map_mut(map_names::CONFIG)
            .ok_or(FixtureError::MissingMap {
                name: map_names::CONFIG,
            })?;
        let mut config: Array<_, DatapathConfig> =
            Array::try_from(map).map_err(|source| FixtureError::Map {
                name: map_names::CONFIG,
                source,
            })?;
        config
            .set(0, &self.config, 0)
            .map_err(|source| FixtureError::Map {
                name: map_names::CONFIG,
                source,
            })?;

        let name = map_names::IFACE;
        let map_err = map_error(name);
        let map = ebpf
            .map_mut(name)
            .ok_or(FixtureError::MissingMap { name })?;
        let mut ifaces: Array<_, IfaceConfig> = Array::try_from(map).map_err(map_err)?;
        // Fixtures use ifindexes below FIXTURE_IFINDEXES (the test runs' loopback is 1): every
        // one of them not listed is reset, so a seed is exact.
        for ifindex in 0..FIXTURE_IFINDEXES {
            let cfg = self
                .ifaces
                .iter()
                .find(|(i, _)| *i == ifindex)
                .map(|(_, c)| *c)
                .unwrap_or_default();
            ifaces.set(ifindex, &cfg, 0).map_err(map_err)?;
        }
        {
            let name = map_names::VXLAN_NET;
            let map_err = map_error(name);
            let map = ebpf
                .map_mut(name)
                .ok_or(FixtureError::MissingMap { name })?;
            let mut nets: aya::maps::HashMap<_, u32, VxlanNet> =
                aya::maps::HashMap::try_from(map).map_err(map_err)?;
            let old: Vec<u32> = nets.keys().filter_map(Result::ok).collect();
            for vni in old {
                nets.remove(&vni).map_err(map_err)?;
            }
            for (vni, net) in &self.vxlan_nets {
                nets.insert(vni, net, 0).map_err(map_err)?;
            }
        }
        {
            // Cached routes are not part of a seed: each seed starts with none.
            let name = map_names::ROUTE_CACHE;
            let map_err = map_error(name);
            let map = ebpf
                .map_mut(name)
                .ok_or(FixtureError::MissingMap { name })?;
            let mut cache: aya::maps::HashMap<_, [u64; 6], [u64; 5]> =
                aya::maps::HashMap::try_from(map).map_err(map_err)?;
            let old: Vec<[u64; 6]> = cache.keys().filter_map(Result::ok).collect();
            for key in old {
                cache.remove(&key).map_err(map_err)?;
            }
        }
        {
            let name = map_names::TX_PORTS;
            let map_err = map_error(name);
            let map = ebpf
                .map_mut(name)
                .ok_or(FixtureError::MissingMap { name })?;
            let mut ports: DevMapHash<_> = DevMapHash::try_from(map).map_err(map_err)?;
            let stale: Vec<u32> = ports
                .keys()
                .filter_map(Result::ok)
                .filter(|k| !self.tx_ports.contains(k))
                .collect();
            for ifindex in stale {
                ports.remove(ifindex).map_err(map_err)?;
            }
            for &ifindex in &self.tx_ports {
                ports
                    .insert(ifindex, ifindex, None, 0)
                    .map_err(|source| FixtureError::TxPort { ifindex, source })?;
            }
        }
        if let Some(g) = self.vxlan_generation {
            let name = map_names::VXLAN_GEN;
            let map_err = map_error(name);
            let map = ebpf
                .map_mut(name)
                .ok_or(FixtureError::MissingMap { name })?;
            let mut generation: Array<_, u64> = Array::try_from(map).map_err(map_err)?;
            generation.set(0, &g, 0).map_err(map_err)?;
        }
        let text = format!("[[interface]]\nname = \"lo\"\n{}", self.services);
        let config = crate::config::Config::parse_with(
            std::path::Path::new("fixture seed"),
            &text,
            crate::config::InterfaceCheck::Skip,
        )
        .map_err(|e| FixtureError::Seed {
            message: e.to_string(),
        })?;
        crate::datapath::apply_services(ebpf, lb_writer, &config.services, None).map_err(|e| {
            FixtureError::Seed {
                message: e.to_string(),
            }
        })?;
        Ok(())
    }
}

/// Interface indexes a fixture seed may name (and resets when it does not).
pub const FIXTURE_IFINDEXES: u32 = 16;

/// One expected counter change: `packets` and `bytes` added to (hook, verdict, reason).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CounterDelta {
    pub hook: Hook,
    pub verdict: Verdict,
    /// A `fastpath_common::reason` code.
    pub reason: u32,
    pub packets: u64,
    pub bytes: u64,
}

impl CounterDelta {
    pub const fn new(hook: Hook, verdict: Verdict, reason: u32, packets: u64, bytes: u64) -> Self {
        CounterDelta {
            hook,
            verdict,
            reason,
            packets,
            bytes,
        }
    }
}

/// One row of a fixture table.
#[derive(Clone, Debug)]
pub struct Case {
    /// Unique, says what the case is about (`xdp_qinq_ipv6_udp`).
    pub name: String,
    /// Which entry point runs the input.
    pub hook: Hook,
    pub seed: Seed,
    /// The frame, from the destination MAC on (at least [`MIN_INPUT_LEN`] bytes).
    pub input: Vec<u8>,
    /// The interface the frame arrives on (XDP: `ingress_ifindex`; TC: `ifindex` and
    /// `ingress_ifindex`), which must exist in the test's network namespace; `None`: the
    /// kernel's default (loopback).
    pub arrives_on: Option<u32>,
    /// The program's raw return value (`XDP_PASS`, `TC_ACT_SHOT`, ...).
    pub expect_verdict: u32,
    /// The frame after the program; `None` = the input, unchanged.
    pub expect_output: Option<Vec<u8>>,
    /// Every counter that must change, and by how much; any other change is a failure.
    pub expect_counters: Vec<CounterDelta>,
}

impl Case {
    /// An XDP run of `input` that hands the packet to the kernel (`XDP_PASS`), with no
    /// expectation on the output or the counters: a step that sets up state (a connection in
    /// the table) or is measured, not checked.
    pub fn xdp_to_kernel(name: impl Into<String>, seed: &Seed, input: Vec<u8>) -> Case {
        Case {
            name: name.into(),
            hook: Hook::Xdp,
            seed: seed.clone(),
            input,
            arrives_on: None,
            expect_verdict: raw_verdict(Hook::Xdp, Verdict::Kernel),
            expect_output: None,
            expect_counters: vec![],
        }
    }
}

/// What one run produced.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// The program's raw return value.
    pub verdict: u32,
    /// The frame after the program.
    pub output: Vec<u8>,
    /// Counter changes caused by the run.
    pub counters: StatsSnapshot,
    /// The kernel's measurement of the run.
    pub duration: Duration,
}

/// Result of [`Fixture::run_repeat`].
#[derive(Clone, Copy, Debug)]
pub struct RepeatRun {
    /// The raw return value of the last run.
    pub verdict: u32,
    /// Mean time of one run, as measured by the kernel (it divides by `repeat` itself).
    pub per_run: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum FixtureError {
    #[error("applying the seed's services: {message}")]
    Seed { message: String },
    #[error(
        "creating the private bpffs pin directory {path}: {source}; fixtures need root \
         (run the tests with sudo or as root)"
    )]
    PinDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("loading the datapath object: {source}; fixtures need root (CAP_BPF, CAP_NET_ADMIN)")]
    Load {
        #[source]
        source: aya::EbpfError,
    },
    #[error("the datapath object has no program `{name}`; was fastpath-ebpf rebuilt?")]
    MissingProgram { name: &'static str },
    /// With the system error under it (e.g. a test-run context this kernel refuses: Linux 5.15
    /// takes no `__sk_buff.ingress_ifindex` there, EINVAL).
    #[error(
        "program `{name}`: {source}{}",
        std::error::Error::source(source).map(|e| format!(": {e}")).unwrap_or_default()
    )]
    Program {
        name: &'static str,
        #[source]
        source: ProgramError,
    },
    #[error("the datapath object has no map `{name}`; was fastpath-ebpf rebuilt?")]
    MissingMap { name: &'static str },
    #[error("probing the kernel: {source}")]
    Probe {
        #[source]
        source: crate::datapath::DatapathError,
    },
    #[error("installing the XDP tail programs: {source}")]
    Tails {
        #[source]
        source: crate::datapath::DatapathError,
    },
    #[error("map `{name}`: {source}")]
    Map {
        name: &'static str,
        #[source]
        source: aya::maps::MapError,
    },
    #[error(
        "putting interface {ifindex} in FP_TX_PORTS: {source}; a seed's TX ports must be \
         interfaces of the namespace the fixture runs in (`ip link`)"
    )]
    TxPort {
        ifindex: u32,
        #[source]
        source: aya::maps::xdp::XdpMapError,
    },
    #[error("reading counters: {source}")]
    Stats {
        #[source]
        source: StatsError,
    },
    #[error("input is {len} bytes; BPF_PROG_TEST_RUN needs at least {MIN_INPUT_LEN}")]
    InputTooShort { len: usize },
    #[error(
        "a conntrack event record is {len} bytes, a CtEvent {}; was fastpath-ebpf rebuilt?",
        size_of::<CtEvent>()
    )]
    BadEvent { len: usize },
    #[error("the open-addressed table of the table-kind rows: {message}")]
    Slots { message: String },
}

/// Why a case did not pass: it could not run, or it ran and something differed.
#[derive(Debug, thiserror::Error)]
pub enum CaseFailure {
    #[error("case `{case}` could not run: {source}")]
    Run {
        case: String,
        // Boxed: aya's errors are large and failures are rare.
        #[source]
        source: Box<FixtureError>,
    },
    #[error("case `{case}` ({hook}):\n{details}")]
    Mismatch {
        case: String,
        hook: &'static str,
        details: String,
    },
}

/// The datapath object loaded once, with private maps, ready to run cases on any hook.
pub struct Fixture {
    /// The LB arrays mapped into this process (before `ebpf`: unmapped first).
    lb_writer: Option<crate::datapath::LbWriter>,
    // Declared before `pins` so the program and map fds are closed before the pins go.
    ebpf: Ebpf,
    /// The object's flow cache (`None` for an object built before it), told of the entries
    /// this fixture writes and read for what its copies counted.
    flow: Option<crate::datapath::FlowCache>,
    pins: ScratchPinDir,
}

impl Fixture {
    /// Loads [`crate::EBPF_BENCH_OBJECT`] (the datapath plus the benchmark's programs) with
    /// fresh maps and loads (verifies) every program: the three entry points and the benchmark
    /// programs.
    pub fn new() -> Result<Self, FixtureError> {
        Fixture::with_ct_capacity(crate::config::DEFAULT_CT_CAPACITY)
    }

    /// As [`Fixture::new`], with a conntrack table of `capacity` entries.
    pub fn with_ct_capacity(capacity: u32) -> Result<Self, FixtureError> {
        Fixture::load(crate::EBPF_BENCH_OBJECT, capacity, None, Tails::All)
    }

    /// As [`Fixture::with_ct_capacity`], from another build of the datapath with the
    /// benchmark's programs (fastpath-ebpf's `bench` feature), e.g. an earlier revision's, to
    /// time both objects in one run. Its maps must have this tree's layouts: the fixture seeds
    /// them with this tree's types.
    /// Tail programs it lacks (it may predate one) are left out.
    pub fn with_object(object: &[u8], capacity: u32) -> Result<Self, FixtureError> {
        Fixture::load(object, capacity, None, Tails::Present)
    }

    /// As [`Fixture::with_ct_capacity`], with the table-kind programs loaded, and beside the
    /// conntrack hash an open-addressed table of `buckets` (a power of two above one) and an
    /// LRU hash of `capacity` entries, for the benchmark's comparison of the three
    /// ([`Fixture::run_table`]).
    pub fn with_table_kinds(capacity: u32, buckets: u32) -> Result<Self, FixtureError> {
        if !buckets.is_power_of_two() || buckets < 2 {
            return Err(FixtureError::Slots {
                message: format!("{buckets} buckets: a power of two above one is needed"),
            });
        }
        let mut fx = Fixture::load(
            crate::EBPF_BENCH_OBJECT,
            capacity,
            Some(buckets),
            Tails::All,
        )?;
        for name in [
            program_names::BENCH_TABLE_HASH,
            program_names::BENCH_TABLE_SLOTS,
            program_names::BENCH_TABLE_LRU,
        ] {
            let xdp: &mut Xdp = program_mut(&mut fx.ebpf, name)?;
            xdp.load()
                .map_err(|source| FixtureError::Program { name, source })?;
        }
        Ok(fx)
    }

    /// `kinds`: the open-addressed table's buckets, for the table-kind rows, which also size
    /// the LRU hash like the conntrack table (elsewhere both are left at one entry).
    fn load(
        object: &[u8],
        capacity: u32,
        kinds: Option<u32>,
        tails: Tails,
    ) -> Result<Self, FixtureError> {
        let (buckets, lru) = kinds.map_or((1, 1), |b| (b, capacity));
        let pins = ScratchPinDir::create("fixture")
            .map_err(|(path, source)| FixtureError::PinDir { path, source })?;
        let mut loader = EbpfLoader::new();
        crate::datapath::KernelFeatures::probe()
            .map_err(|source| FixtureError::Probe { source })?
            .configure(&mut loader);
        let mut ebpf = loader
            .default_map_pin_directory(pins.path())
            .map_max_entries(map_names::CT, capacity)
            .map_max_entries(map_names::CT_NEW, capacity)
            .map_max_entries(map_names::BENCH_HEADS, buckets)
            .map_max_entries(
                map_names::BENCH_SLOTS,
                buckets * fastpath_common::bench::BUCKET_SLOTS as u32,
            )
            .map_max_entries(map_names::BENCH_LRU, lru)
            .load(object)
            .map_err(|source| FixtureError::Load { source })?;
        for name in [
            program_names::XDP,
            program_names::BENCH_FLOOR_XDP,
            program_names::BENCH_CT_EVENTS,
            program_names::BENCH_XDP_TX,
            program_names::BENCH_CT_LOOKUP,
            program_names::CT_INSTALL,
        ] {
            let xdp: &mut Xdp = program_mut(&mut ebpf, name)?;
            xdp.load()
                .map_err(|source| FixtureError::Program { name, source })?;
        }
        for name in [
            program_names::TC_INGRESS,
            program_names::TC_EGRESS,
            program_names::BENCH_FLOOR_TC,
        ] {
            let tc: &mut SchedClassifier = program_mut(&mut ebpf, name)?;
            tc.load()
                .map_err(|source| FixtureError::Program { name, source })?;
        }
        crate::datapath::install_tails(&mut ebpf, tails)
            .map_err(|source| FixtureError::Tails { source })?;
        let flow = crate::datapath::FlowCache::open(pins.path());
        Ok(Fixture {
            lb_writer: None,
            ebpf,
            flow,
            pins,
        })
    }

    /// Applies services with the daemon's own code (`datapath::apply_services`).
    pub fn apply_services(
        &mut self,
        services: &[crate::config::ServiceConfig],
    ) -> Result<crate::datapath::ServicesApplied, crate::datapath::DatapathError> {
        crate::datapath::apply_services(&mut self.ebpf, &mut self.lb_writer, services, None)
    }

    /// The load balancer's numbering (services, backends) as the maps hold it now.
    pub fn lb_index(&mut self) -> Result<crate::sync::LbIndex, crate::datapath::DatapathError> {
        crate::datapath::lb_index(&mut self.ebpf)
    }

    /// Applies `services[i]` for the listed `i` only, as the daemon does on a health change.
    pub fn update_services(
        &mut self,
        services: &[crate::config::ServiceConfig],
        changed: &[usize],
    ) -> Result<crate::datapath::ServicesApplied, crate::datapath::DatapathError> {
        crate::datapath::apply_services(
            &mut self.ebpf,
            &mut self.lb_writer,
            services,
            Some(changed),
        )
    }

    /// The route cache counters, summed over CPUs, indexed by `route_stat::*`.
    pub fn route_stats(&self) -> Result<Vec<u64>, FixtureError> {
        let name = map_names::ROUTE_STATS;
        let map = self
            .ebpf
            .map(name)
            .ok_or(FixtureError::MissingMap { name })?;
        let per_cpu: PerCpuArray<_, u64> = PerCpuArray::try_from(map).map_err(map_error(name))?;
        (0..route_stat::COUNT)
            .map(|slot| {
                let values = per_cpu.get(&slot, 0).map_err(map_error(name))?;
                Ok(values.iter().sum())
            })
            .collect()
    }

    /// Service `index`'s counters (`FP_SVC_STATS`), summed over CPUs.
    pub fn service_counters(
        &self,
        index: u32,
    ) -> Result<fastpath_common::lb::SvcCounters, FixtureError> {
        let name = map_names::SVC_STATS;
        let map = self
            .ebpf
            .map(name)
            .ok_or(FixtureError::MissingMap { name })?;
        let per_cpu: PerCpuArray<_, fastpath_common::lb::SvcCounters> =
            PerCpuArray::try_from(map).map_err(map_error(name))?;
        let values = per_cpu.get(&index, 0).map_err(map_error(name))?;
        Ok(values.iter().fold(Default::default(), |mut a, c| {
            a.packets += c.packets;
            a.bytes += c.bytes;
            a.connections += c.connections;
            a.no_backend += c.no_backend;
            a
        }))
    }

    /// Starts a new generation of learned VXLAN headers and cached routes, as the daemon
    /// does on a route, neighbour, link or configuration change.
    pub fn bump_generation(&mut self) -> Result<(), crate::datapath::DatapathError> {
        crate::datapath::bump_vxlan_generation(&mut self.ebpf)
    }

    /// Starts a new generation saying whether the FIB answers by destination alone, as the
    /// daemon does from `netwatch::fib_per_destination` (see `GEN_F_FIB_PER_DST`).
    pub fn set_fib_per_destination(
        &mut self,
        per_dst: bool,
    ) -> Result<(), crate::datapath::DatapathError> {
        crate::datapath::VxlanGeneration::open_pin(&self.pin_dir().join(map_names::VXLAN_GEN))?
            .bump(per_dst)
            .map(drop)
    }

    /// Where this fixture's maps are pinned (removed on drop).
    pub fn pin_dir(&self) -> &Path {
        self.pins.path()
    }

    /// This fixture's `FP_CT` as the daemon writes it: with the installer program.
    pub fn ct_writer(&self) -> Result<crate::datapath::CtTable, crate::datapath::DatapathError> {
        let table = crate::datapath::CtTable::open_pin(&self.pin_dir().join(map_names::CT))?;
        Ok(table.with_installer(crate::datapath::ct_installer(&self.ebpf)?))
    }

    /// Seeds the maps, runs the case's input once through its hook, and reports what happened.
    pub fn run(&mut self, case: &Case) -> Result<Outcome, FixtureError> {
        check_input(case)?;
        case.seed.apply(&mut self.ebpf, &mut self.lb_writer)?;
        self.rerun(case)
    }

    /// [`Fixture::run`] without applying the case's seed first: the maps stay as the previous
    /// runs left them (conntrack entries, learned VXLAN headers, cached routes).
    pub fn rerun(&mut self, case: &Case) -> Result<Outcome, FixtureError> {
        check_input(case)?;
        let before = self.stats()?;
        let mut out = vec![0u8; case.input.len() + OUTPUT_SLACK];
        let res = self.test_run(case, &mut out, 1)?;
        let after = self.stats()?;
        out.truncate(res.data_size_out as usize);
        Ok(Outcome {
            verdict: res.return_value,
            output: out,
            counters: after.delta(&before),
            duration: res.duration,
        })
    }

    /// Seeds the maps and runs the case's input `repeat` times in the kernel: for benchmarks.
    /// Counters grow by `repeat` packets; nothing is compared.
    pub fn run_repeat(&mut self, case: &Case, repeat: u32) -> Result<RepeatRun, FixtureError> {
        check_input(case)?;
        case.seed.apply(&mut self.ebpf, &mut self.lb_writer)?;
        self.rerun_repeat(case, repeat)
    }

    /// [`Fixture::run_repeat`] without applying the case's seed first: the maps stay as the
    /// previous runs left them. For benchmarks that seeded once (with a run of a case with the
    /// same seed) and time single runs: re-applying a large seed (a thousand backends)
    /// between them would measure a datapath whose caches the seeding just evicted.
    pub fn rerun_repeat(&mut self, case: &Case, repeat: u32) -> Result<RepeatRun, FixtureError> {
        check_input(case)?;
        let mut out = vec![0u8; case.input.len() + OUTPUT_SLACK];
        let res = self.test_run(case, &mut out, repeat.max(1))?;
        Ok(RepeatRun {
            verdict: res.return_value,
            per_run: res.duration,
        })
    }

    /// Runs `input` `repeat` times through the empty program of `hook`'s kind: the benchmark
    /// floor (program dispatch and BPF_PROG_TEST_RUN overhead, no datapath work).
    pub fn run_floor_repeat(
        &mut self,
        hook: Hook,
        input: &[u8],
        repeat: u32,
    ) -> Result<RepeatRun, FixtureError> {
        let name = match hook {
            Hook::Xdp => program_names::BENCH_FLOOR_XDP,
            Hook::TcIngress | Hook::TcEgress => program_names::BENCH_FLOOR_TC,
        };
        let mut out = vec![0u8; input.len() + OUTPUT_SLACK];
        let res = self.test_run_program(name, hook, input, &mut out, repeat.max(1), None)?;
        Ok(RepeatRun {
            verdict: res.return_value,
            per_run: res.duration,
        })
    }

    /// Looks `key` up in the conntrack table `repeat` times through `bench_ct_lookup` (the
    /// lookup alone, no packet parsed): the verdict is XDP_PASS when the key is there.
    pub fn run_ct_lookup_repeat(
        &mut self,
        key: &CtKey,
        input: &[u8],
        repeat: u32,
    ) -> Result<RepeatRun, FixtureError> {
        let name = map_names::BENCH_CT_KEY;
        let map = self
            .ebpf
            .map_mut(name)
            .ok_or(FixtureError::MissingMap { name })?;
        let mut keys: Array<_, CtKey> = Array::try_from(map).map_err(map_error(name))?;
        keys.set(0, key, 0).map_err(map_error(name))?;
        let mut out = vec![0u8; input.len() + OUTPUT_SLACK];
        let res = self.test_run_program(
            program_names::BENCH_CT_LOOKUP,
            Hook::Xdp,
            input,
            &mut out,
            repeat.max(1),
            None,
        )?;
        Ok(RepeatRun {
            verdict: res.return_value,
            per_run: res.duration,
        })
    }

    /// One run of `run` through the table-kind program `name`
    /// (`program_names::BENCH_TABLE_*`; [`Fixture::with_table_kinds`]),
    /// `repeat` times.
    pub fn run_table(
        &self,
        name: &'static str,
        run: &fastpath_common::bench::TableRun,
        repeat: u32,
    ) -> Result<RepeatRun, FixtureError> {
        let input = run.as_bytes();
        let mut out = vec![0u8; input.len() + OUTPUT_SLACK];
        let res = self.test_run_program(name, Hook::Xdp, input, &mut out, repeat.max(1), None)?;
        Ok(RepeatRun {
            verdict: res.return_value,
            per_run: res.duration,
        })
    }

    /// The open-addressed table's bucket mask (its buckets − 1).
    pub fn buckets_mask(&self) -> Result<u32, FixtureError> {
        Ok(self
            .mapped::<fastpath_common::bench::CtBucket>(map_names::BENCH_HEADS)?
            .1
            - 1)
    }

    /// Empties the open-addressed table, then puts `keys` in it, each with `entry`, where the
    /// datapath's insert would (the first free slot of the bucket with more room). Errors if
    /// both of a key's buckets are full.
    pub fn slots_fill(&mut self, keys: &[CtKey], entry: &CtEntry) -> Result<(), FixtureError> {
        use fastpath_common::bench::{
            BUCKET_SLOTS, CtBucket, CtSlot, SLOT_FREE, SLOT_LIVE, slot_buckets,
        };
        let (mut heads, buckets) = self.mapped::<CtBucket>(map_names::BENCH_HEADS)?;
        let (mut slots, n) = self.mapped::<CtSlot>(map_names::BENCH_SLOTS)?;
        let heads = &mut heads.as_mut_slice()[..buckets as usize];
        let slots = &mut slots.as_mut_slice()[..n as usize];
        heads.fill([SLOT_FREE; BUCKET_SLOTS]);
        for key in keys {
            let (first, second, tag) = slot_buckets(key, buckets - 1);
            let room = |b: u32| {
                heads[b as usize]
                    .iter()
                    .filter(|&&h| h == SLOT_FREE)
                    .count()
            };
            let b = if room(second) > room(first) {
                second
            } else {
                first
            };
            let i = heads[b as usize]
                .iter()
                .position(|&h| h == SLOT_FREE)
                .ok_or_else(|| FixtureError::Slots {
                    message: format!("buckets {first} and {second} are full"),
                })?;
            heads[b as usize][i] = SLOT_LIVE | tag;
            slots[b as usize * BUCKET_SLOTS + i] = CtSlot {
                key: *key,
                entry: *entry,
            };
        }
        Ok(())
    }

    /// Empties the LRU hash of the table-kind rows, then puts `keys` in it, each with `entry`.
    pub fn lru_fill(&mut self, keys: &[CtKey], entry: &CtEntry) -> Result<(), FixtureError> {
        let name = map_names::BENCH_LRU;
        let map = self
            .ebpf
            .map_mut(name)
            .ok_or(FixtureError::MissingMap { name })?;
        let mut lru: aya::maps::HashMap<_, CtKey, CtEntry> =
            aya::maps::HashMap::try_from(map).map_err(map_error(name))?;
        // Keys first: deleting while walking would restart the kernel's iteration.
        let old: Vec<CtKey> = lru
            .keys()
            .collect::<Result<_, _>>()
            .map_err(map_error(name))?;
        for key in &old {
            lru.remove(key).map_err(map_error(name))?;
        }
        for key in keys {
            lru.insert(key, entry, 0).map_err(map_error(name))?;
        }
        Ok(())
    }

    /// The memory-mapped array `name` of `T`s, mapped into this process, and its length.
    fn mapped<T: Copy>(
        &self,
        name: &'static str,
    ) -> Result<(crate::sys::SharedArray<T>, u32), FixtureError> {
        use std::os::fd::AsFd as _;
        let Some(aya::maps::Map::Array(data)) = self.ebpf.map(name) else {
            return Err(FixtureError::MissingMap { name });
        };
        let info = data.info().map_err(map_error(name))?;
        let bytes = info.max_entries() as usize * size_of::<T>();
        let mapped = crate::sys::SharedArray::map(data.fd().as_fd(), bytes.next_multiple_of(4096))
            .map_err(|e| FixtureError::Slots {
                message: format!("mapping {name}: {e}"),
            })?;
        Ok((mapped, info.max_entries()))
    }

    /// Runs the synthetic conntrack event producer (`bench_ct_events`) `runs` times: each run
    /// emits [`fastpath_common::bench::CT_EVENTS_PER_RUN`] numbered events into `FP_CT_EVENTS`.
    /// For the ring-drain benchmark; `&self`, so it can run while another thread drains. For
    /// throughput call it with `runs` = 1: with more, the kernel swaps the XDP dispatcher in
    /// and out around its loop, an RCU grace period per call.
    pub fn run_ct_event_producer(&self, runs: u32) -> Result<RepeatRun, FixtureError> {
        let input = [0u8; MIN_INPUT_LEN];
        let mut out = vec![0u8; MIN_INPUT_LEN + OUTPUT_SLACK];
        let res = self.test_run_program(
            program_names::BENCH_CT_EVENTS,
            Hook::Xdp,
            &input,
            &mut out,
            runs.max(1),
            None,
        )?;
        Ok(RepeatRun {
            verdict: res.return_value,
            per_run: res.duration,
        })
    }

    /// Transmits `frame` `packets` times out of interface `ifindex` (of this thread's network
    /// namespace; it must take XDP frames, e.g. a veth whose peer runs NAPI), from the kernel:
    /// BPF_PROG_TEST_RUN of `bench_xdp_tx` in live-frames mode, `batch` frames per batch.
    /// Returns the time the kernel took. `frame` must be at least 56 bytes long: its start is
    /// restored in every frame sent (see `bench_xdp_tx`).
    pub fn transmit_live(
        &mut self,
        ifindex: u32,
        frame: &[u8],
        packets: u32,
        batch: u32,
    ) -> Result<Duration, FixtureError> {
        set_generator_frame(&mut self.ebpf, frame)?;
        live_frames(
            &self.ebpf,
            program_names::BENCH_XDP_TX,
            ifindex,
            frame,
            packets,
            batch,
        )
    }

    /// Runs the case and compares everything it states; `Err` says what differed.
    pub fn evaluate(&mut self, case: &Case) -> Result<(), CaseFailure> {
        let outcome = self.run(case).map_err(|source| CaseFailure::Run {
            case: case.name.clone(),
            source: Box::new(source),
        })?;
        let details = mismatches(case, &outcome);
        if details.is_empty() {
            Ok(())
        } else {
            Err(CaseFailure::Mismatch {
                case: case.name.clone(),
                hook: case.hook.name(),
                details,
            })
        }
    }

    /// Runs the case and panics with expected vs got (and a hexdump diff) on any mismatch.
    pub fn check(&mut self, case: &Case) {
        if let Err(failure) = self.evaluate(case) {
            panic!("{failure}");
        }
    }

    /// The stats map summed over CPUs.
    pub fn stats(&self) -> Result<StatsSnapshot, FixtureError> {
        let map = self
            .ebpf
            .map(map_names::STATS)
            .ok_or(FixtureError::MissingMap {
                name: map_names::STATS,
            })?;
        let stats: PerCpuArray<_, Counter> =
            PerCpuArray::try_from(map).map_err(|source| FixtureError::Map {
                name: map_names::STATS,
                source,
            })?;
        let map = self
            .ebpf
            .map(map_names::STATS_EXT)
            .ok_or(FixtureError::MissingMap {
                name: map_names::STATS_EXT,
            })?;
        let ext: PerCpuArray<_, Counter> =
            PerCpuArray::try_from(map).map_err(|source| FixtureError::Map {
                name: map_names::STATS_EXT,
                source,
            })?;
        StatsSnapshot::read(&stats, Some(&ext)).map_err(|source| FixtureError::Stats { source })
    }

    /// Runs the case's input through its hook's entry point `repeat` times, arriving where
    /// the case says.
    fn test_run(
        &self,
        case: &Case,
        out: &mut [u8],
        repeat: u32,
    ) -> Result<TestRunResult, FixtureError> {
        let ctx = case
            .arrives_on
            .map(|i| arrival_ctx(case.hook, i, case.input.len()));
        self.test_run_program(
            program_name(case.hook),
            case.hook,
            &case.input,
            out,
            repeat,
            ctx.as_deref(),
        )
    }

    /// Runs program `name`, of `hook`'s kind, on `input`, with the context `ctx` (`None`: the
    /// kernel's default context).
    fn test_run_program(
        &self,
        name: &'static str,
        hook: Hook,
        input: &[u8],
        out: &mut [u8],
        repeat: u32,
        ctx: Option<&[u8]>,
    ) -> Result<TestRunResult, FixtureError> {
        test_run(&self.ebpf, name, hook, input, out, repeat, ctx)
    }
}

/// Runs program `name` of `ebpf`, of `hook`'s kind, on `input`, with the context `ctx`
/// (`None`: the kernel's default context).
fn test_run(
    ebpf: &Ebpf,
    name: &'static str,
    hook: Hook,
    input: &[u8],
    out: &mut [u8],
    repeat: u32,
    ctx: Option<&[u8]>,
) -> Result<TestRunResult, FixtureError> {
    let opts = TestRunOptions {
        data_in: Some(input),
        data_out: Some(out),
        ctx_in: ctx,
        repeat,
        ..Default::default()
    };
    test_run_with(ebpf, name, hook, opts)
}

/// BPF_PROG_TEST_RUN of program `name` of `ebpf`, of `hook`'s kind, with `opts`.
fn test_run_with(
    ebpf: &Ebpf,
    name: &'static str,
    hook: Hook,
    opts: TestRunOptions<'_>,
) -> Result<TestRunResult, FixtureError> {
    let prog = ebpf
        .program(name)
        .ok_or(FixtureError::MissingProgram { name })?;
    let result = match hook {
        Hook::Xdp => {
            let xdp: &Xdp = prog
                .try_into()
                .map_err(|source| FixtureError::Program { name, source })?;
            xdp.test_run(opts)
        }
        Hook::TcIngress | Hook::TcEgress => {
            let tc: &SchedClassifier = prog
                .try_into()
                .map_err(|source| FixtureError::Program { name, source })?;
            tc.test_run(opts)
        }
    };
    result.map_err(|source| FixtureError::Program { name, source })
}

/// Writes the generators' template (`FP_BENCH_FRAME`): the first words of `frame`.
fn set_generator_frame(ebpf: &mut Ebpf, frame: &[u8]) -> Result<(), FixtureError> {
    const WORDS: usize = fastpath_common::bench::BENCH_FRAME_WORDS;
    if frame.len() < 8 * WORDS {
        return Err(FixtureError::InputTooShort { len: frame.len() });
    }
    let head: [u64; WORDS] = std::array::from_fn(|i| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&frame[8 * i..8 * i + 8]);
        u64::from_ne_bytes(w)
    });
    let name = map_names::BENCH_FRAME;
    let map_err = map_error(name);
    let map = ebpf
        .map_mut(name)
        .ok_or(FixtureError::MissingMap { name })?;
    let mut template: Array<_, [u64; WORDS]> = Array::try_from(map).map_err(map_err)?;
    template.set(0, &head, 0).map_err(map_err)
}

/// BPF_PROG_TEST_RUN of generator `name` in live-frames mode (see `Fixture::transmit_live`);
/// the time the kernel took.
fn live_frames(
    ebpf: &Ebpf,
    name: &'static str,
    ifindex: u32,
    frame: &[u8],
    packets: u32,
    batch: u32,
) -> Result<Duration, FixtureError> {
    let mut ctx = vec![0u8; XDP_MD_LEN];
    ctx[4..8].copy_from_slice(&(frame.len() as u32).to_ne_bytes());
    ctx[12..16].copy_from_slice(&ifindex.to_ne_bytes());
    let opts = TestRunOptions {
        data_in: Some(frame),
        ctx_in: Some(&ctx),
        repeat: packets,
        attrs: aya::programs::TestRunAttrs::new().xdp_live_frames(batch),
        ..Default::default()
    };
    let started = std::time::Instant::now();
    test_run_with(ebpf, name, Hook::Xdp, opts)?;
    Ok(started.elapsed())
}

fn program_name(hook: Hook) -> &'static str {
    match hook {
        Hook::Xdp => program_names::XDP,
        Hook::TcIngress => program_names::TC_INGRESS,
        Hook::TcEgress => program_names::TC_EGRESS,
    }
}

fn program_mut<'a, T>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut T, FixtureError>
where
    &'a mut T: TryFrom<&'a mut aya::programs::Program, Error = ProgramError>,
{
    let prog = ebpf
        .program_mut(name)
        .ok_or(FixtureError::MissingProgram { name })?;
    prog.try_into()
        .map_err(|source| FixtureError::Program { name, source })
}

fn check_input(case: &Case) -> Result<(), FixtureError> {
    if case.input.len() < MIN_INPUT_LEN {
        return Err(FixtureError::InputTooShort {
            len: case.input.len(),
        });
    }
    Ok(())
}

/// Every difference between what `case` states and what `got` shows, one paragraph each;
/// empty when the case passed.
pub fn mismatches(case: &Case, got: &Outcome) -> String {
    let mut out = String::new();
    if got.verdict != case.expect_verdict {
        let _ = writeln!(
            out,
            "  verdict: expected {} got {}",
            verdict_name(case.hook, case.expect_verdict),
            verdict_name(case.hook, got.verdict)
        );
    }
    let want_output = case.expect_output.as_ref().unwrap_or(&case.input);
    if &got.output != want_output {
        let _ = writeln!(
            out,
            "  output: expected {} bytes got {} bytes ('!' marks differing lines)\n{}",
            want_output.len(),
            got.output.len(),
            hexdump_diff(want_output, &got.output)
        );
    }
    let want_counters = expected_snapshot(&case.expect_counters);
    if got.counters != want_counters {
        let _ = writeln!(
            out,
            "  counters: expected\n{}  got\n{}",
            indent(&counter_lines(&want_counters)),
            indent(&counter_lines(&got.counters))
        );
    }
    out
}

fn expected_snapshot(deltas: &[CounterDelta]) -> StatsSnapshot {
    let mut snap = StatsSnapshot::default();
    for d in deltas {
        let c = snap
            .slots
            .entry((d.hook as u32, d.verdict as u32, d.reason))
            .or_default();
        c.packets += d.packets;
        c.bytes += d.bytes;
    }
    snap.slots.retain(|_, c| c.packets != 0 || c.bytes != 0);
    snap
}

fn counter_lines(snap: &StatsSnapshot) -> String {
    if snap.slots.is_empty() {
        return "(no counter changed)\n".to_owned();
    }
    let mut out = String::new();
    for r in snap.rows() {
        let _ = writeln!(
            out,
            "{}/{}/{}: {} packets, {} bytes",
            r.hook, r.verdict, r.reason, r.packets, r.bytes
        );
    }
    out
}

fn indent(text: &str) -> String {
    text.lines().map(|l| format!("    {l}\n")).collect()
}

/// `XDP_PASS (2)` style name of a raw return value.
pub fn verdict_name(hook: Hook, raw: u32) -> String {
    let name = match (hook, raw) {
        (Hook::Xdp, XDP_ABORTED) => "XDP_ABORTED",
        (Hook::Xdp, XDP_DROP) => "XDP_DROP",
        (Hook::Xdp, XDP_PASS) => "XDP_PASS",
        (Hook::Xdp, XDP_TX) => "XDP_TX",
        (Hook::Xdp, XDP_REDIRECT) => "XDP_REDIRECT",
        (_, TC_ACT_OK) => "TC_ACT_OK",
        (_, TC_ACT_UNSPEC) => "TC_ACT_UNSPEC",
        (_, TC_ACT_SHOT) => "TC_ACT_SHOT",
        (_, TC_ACT_REDIRECT) => "TC_ACT_REDIRECT",
        _ => "unknown",
    };
    format!("{name} ({raw})")
}

/// Side-by-side hexdump of two byte strings, 16 bytes a line; lines that differ start with
/// `!`, and bytes missing on one side show as `--`.
pub fn hexdump_diff(expected: &[u8], got: &[u8]) -> String {
    let mut out = String::new();
    let lines = expected.len().max(got.len()).div_ceil(16);
    let _ = writeln!(out, "         {:<48}  got", "expected");
    for line in 0..lines {
        // The last line stops at the longer input; the shorter one shows `--` for its gap.
        let range = line * 16..((line + 1) * 16).min(expected.len().max(got.len()));
        let e = hex_line(expected, range.clone());
        let g = hex_line(got, range.clone());
        let mark = if e == g { ' ' } else { '!' };
        let _ = writeln!(out, "{mark} {:04x}:  {e:<48}  {g}", range.start);
    }
    out
}

fn hex_line(bytes: &[u8], range: std::ops::Range<usize>) -> String {
    range
        .map(|i| {
            bytes
                .get(i)
                .map_or_else(|| "--".to_owned(), |b| format!("{b:02x}"))
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn map_error(name: &'static str) -> impl Fn(MapError) -> FixtureError + Copy {
    move |source| FixtureError::Map { name, source }
}

/// `FP_CT_STATS` summed over CPUs, indexed by `ct_stat::*` (every slot, named or not).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CtStats(pub [u64; ct_stat::SLOTS as usize]);

impl CtStats {
    /// Every slot that moved since `before`, as (code, delta), in code order.
    pub fn delta(&self, before: &CtStats) -> Vec<(u32, u64)> {
        self.0
            .iter()
            .zip(before.0.iter())
            .enumerate()
            .filter(|(_, (now, was))| now != was)
            .map(|(code, (now, was))| (code as u32, now.wrapping_sub(*was)))
            .collect()
    }
}

/// Conntrack state: the table, its counters and its event ring.
impl Fixture {
    /// Every entry of `FP_CT`, in key order, with what the flow cache's copies counted (as
    /// the daemon shows them).
    pub fn ct_entries(&self) -> Result<BTreeMap<CtKey, CtEntry>, FixtureError> {
        let entries = self
            .ct_table()?
            .entries()
            .map_err(map_error(map_names::CT))?;
        let Some(flow) = &self.flow else {
            return Ok(entries);
        };
        let mut list: Vec<(CtKey, CtEntry)> = entries.into_iter().collect();
        flow.add_counts(&mut list);
        Ok(list.into_iter().collect())
    }

    /// The entry of one connection, if there is one, with what the flow cache's copies
    /// counted.
    pub fn ct_entry(&self, key: &CtKey) -> Result<Option<CtEntry>, FixtureError> {
        let name = map_names::CT;
        match self.ct_table()?.get(key) {
            Ok(entry) => {
                let mut one = [(*key, entry)];
                if let Some(flow) = &self.flow {
                    flow.add_counts(&mut one);
                }
                Ok(Some(one[0].1))
            }
            Err(MapError::KeyNotFound) => Ok(None),
            Err(source) => Err(FixtureError::Map { name, source }),
        }
    }

    /// `FP_CT`, read-only.
    fn ct_table(&self) -> Result<CtView<&MapData>, FixtureError> {
        let name = map_names::CT;
        let map = || self.ebpf.map(name).ok_or(FixtureError::MissingMap { name });
        let view = match CtLayout::of(map()?)? {
            CtLayout::Now => BpfHashMap::try_from(map()?).map(CtView::Now),
            CtLayout::BeforeHops => BpfHashMap::try_from(map()?).map(CtView::BeforeHops),
            CtLayout::WideHops => BpfHashMap::try_from(map()?).map(CtView::WideHops),
        };
        view.map_err(map_error(name))
    }

    /// `FP_CT`, writable.
    fn ct_table_mut(&mut self) -> Result<CtView<&mut MapData>, FixtureError> {
        let name = map_names::CT;
        let layout = CtLayout::of(
            self.ebpf
                .map(name)
                .ok_or(FixtureError::MissingMap { name })?,
        )?;
        let map = self
            .ebpf
            .map_mut(name)
            .ok_or(FixtureError::MissingMap { name })?;
        match layout {
            CtLayout::Now => BpfHashMap::try_from(map).map(CtView::Now),
            CtLayout::BeforeHops => BpfHashMap::try_from(map).map(CtView::BeforeHops),
            CtLayout::WideHops => BpfHashMap::try_from(map).map(CtView::WideHops),
        }
        .map_err(map_error(name))
    }

    /// Writes one entry into `FP_CT` (what a peer's replication installs).
    pub fn ct_insert(&mut self, key: &CtKey, entry: &CtEntry) -> Result<(), FixtureError> {
        let name = map_names::CT;
        self.ct_table_mut()?
            .insert(key, entry)
            .map_err(map_error(name))?;
        if let Some(flow) = &self.flow {
            flow.changed(key);
        }
        Ok(())
    }

    /// Deletes every entry of `FP_CT`; returns how many there were.
    pub fn ct_clear(&mut self) -> Result<usize, FixtureError> {
        let name = map_names::CT;
        let mut table = self.ct_table_mut()?;
        // Keys first: deleting while walking would restart the kernel's iteration.
        let keys = table.keys().map_err(map_error(name))?;
        for key in &keys {
            table.remove(key).map_err(map_error(name))?;
        }
        if let Some(flow) = &self.flow {
            for key in &keys {
                flow.changed(key);
            }
        }
        // So do the backends' connection counts (least-connections) and the early-drop
        // candidates: the next sequence starts from nothing.
        // (Fixture services use few backends: the indexes stay far below 16384.)
        crate::datapath::reset_backend_loads(&mut self.ebpf, 1 << 14).map_err(|e| {
            FixtureError::Seed {
                message: e.to_string(),
            }
        })?;
        let name = map_names::CT_NEW;
        let map = self
            .ebpf
            .map_mut(name)
            .ok_or(FixtureError::MissingMap { name })?;
        let mut queue: aya::maps::Queue<_, CtKey> =
            aya::maps::Queue::try_from(map).map_err(map_error(name))?;
        while queue.pop(0).is_ok() {}
        Ok(keys.len())
    }

    /// Inserts `n` synthetic established TCP connections (10.128.0.0/9 ↔ 10.0.0.0/9 keys that
    /// no fixture packet uses), last seen `now_ns`: table pressure for benchmarks.
    pub fn ct_fill(&mut self, n: u32, now_ns: u64) -> Result<(), FixtureError> {
        self.ct_fill_shaped(n, now_ns, false)
    }

    /// `n` entries as the load balancer makes them: `n / 2` assured NAT connections to a
    /// backend, each with its alias (`lb_alias`).
    pub fn ct_fill_lb(&mut self, n: u32, now_ns: u64) -> Result<(), FixtureError> {
        self.ct_fill_shaped(n / 2, now_ns, true)
    }

    fn ct_fill_shaped(&mut self, n: u32, now_ns: u64, lb: bool) -> Result<(), FixtureError> {
        use fastpath_common::ct::{CT_F_ASSURED, CT_F_LB, CT_F_ORIG_IS_LO, tcp_state};
        let name = map_names::CT;
        let mut table = self.ct_table_mut()?;
        for i in 0..n {
            let b = i.to_be_bytes();
            let mut lo = [0u8; 16];
            let mut hi = [0u8; 16];
            lo[..4].copy_from_slice(&[10, b[1] & 0x7f, b[2], b[3]]);
            hi[..4].copy_from_slice(&[10, 0x80 | b[1], b[2], b[3]]);
            let key = CtKey {
                addr_lo: lo,
                addr_hi: hi,
                port_lo: 40000,
                port_hi: 80,
                proto: 6,
                family: 4,
                _pad: [0; 2],
            };
            let mut entry = CtEntry {
                created_ns: now_ns,
                last_seen_ns: now_ns,
                state: tcp_state::ESTABLISHED,
                flags: CT_F_ASSURED | CT_F_ORIG_IS_LO,
                ..CtEntry::default()
            };
            if lb {
                entry.flags |= CT_F_LB;
                entry.nat.addr[..4].copy_from_slice(&[172, 16, b[3] & 0x7, 1]);
                entry.nat.port = 8080;
                if let Some((ak, alias)) = fastpath_common::lb::lb_alias(&key, &entry) {
                    table.insert(&ak, &alias).map_err(map_error(name))?;
                }
            }
            table.insert(&key, &entry).map_err(map_error(name))?;
        }
        Ok(())
    }

    /// Moves a connection's creation and last-seen times `ns` back, as if that time passed.
    pub fn ct_age(&mut self, key: &CtKey, ns: u64) -> Result<(), FixtureError> {
        let name = map_names::CT;
        let mut table = self.ct_table_mut()?;
        let mut e = match table.get(key) {
            Ok(e) => e,
            Err(MapError::KeyNotFound) => return Ok(()),
            Err(source) => return Err(FixtureError::Map { name, source }),
        };
        e.created_ns = e.created_ns.saturating_sub(ns);
        e.last_seen_ns = e.last_seen_ns.saturating_sub(ns);
        table.insert(key, &e).map_err(map_error(name))
    }

    /// `FP_CT_STATS` summed over CPUs.
    pub fn ct_stats(&self) -> Result<CtStats, FixtureError> {
        let name = map_names::CT_STATS;
        let map = self
            .ebpf
            .map(name)
            .ok_or(FixtureError::MissingMap { name })?;
        let per_cpu: PerCpuArray<_, u64> = PerCpuArray::try_from(map).map_err(map_error(name))?;
        let mut sums = [0u64; ct_stat::SLOTS as usize];
        for (code, sum) in (0u32..).zip(sums.iter_mut()) {
            let values = per_cpu.get(&code, 0).map_err(map_error(name))?;
            *sum = values.iter().sum();
        }
        Ok(CtStats(sums))
    }

    /// Takes every record out of the `FP_CT_EVENTS` ring, oldest first. The ring keeps its
    /// consumer position in the kernel, so each call sees only what the last one left.
    pub fn ct_drain_events(&self) -> Result<Vec<CtEvent>, FixtureError> {
        let name = map_names::CT_EVENTS;
        let map = self
            .ebpf
            .map(name)
            .ok_or(FixtureError::MissingMap { name })?;
        let mut ring = RingBuf::try_from(map).map_err(map_error(name))?;
        let mut events = Vec::new();
        while let Some(record) = ring.next() {
            if record.len() != size_of::<CtEvent>() {
                return Err(FixtureError::BadEvent { len: record.len() });
            }
            // SAFETY: the record holds exactly one CtEvent (length checked above), a Pod type;
            // read_unaligned assumes nothing about the record's alignment.
            events.push(unsafe { std::ptr::read_unaligned(record.as_ptr().cast::<CtEvent>()) });
        }
        Ok(events)
    }

    /// Runs a conntrack sequence from an empty table and an empty event ring, step by step,
    /// and stops at the first step that does not do what it states.
    pub fn run_ct_sequence(&mut self, seq: &CtSequence) -> Result<(), CtFailure> {
        let run_error = |step: usize, what: &str, source| CtFailure::Run {
            sequence: seq.name.clone(),
            step,
            what: what.to_owned(),
            source: Box::new(source),
        };
        // Per-CPU state (round-robin positions) must not change CPUs between steps: the whole
        // sequence runs on the CPU it starts on (BPF_PROG_TEST_RUN runs on the calling CPU).
        pin_to_current_cpu();
        self.ct_clear()
            .map_err(|e| run_error(0, "clearing FP_CT", e))?;
        self.ct_drain_events()
            .map_err(|e| run_error(0, "draining FP_CT_EVENTS", e))?;
        if seq.prefill_assured > 0 {
            self.ct_fill(seq.prefill_assured, 0)
                .map_err(|e| run_error(0, "pre-filling FP_CT", e))?;
        }
        for (i, step) in seq.steps.iter().enumerate() {
            let details = self
                .ct_step(&seq.seed, step)
                .map_err(|e| run_error(i, &step.what, e))?;
            if details.is_empty() {
                continue;
            }
            return Err(CtFailure::Mismatch {
                sequence: seq.name.clone(),
                step: i,
                hook: step.hook.name(),
                what: step.what.clone(),
                details,
            });
        }
        Ok(())
    }

    /// Runs one step; returns its mismatches (empty when it did what it states).
    fn ct_step(&mut self, seed: &Seed, step: &CtStep) -> Result<String, FixtureError> {
        if step.input.len() < MIN_INPUT_LEN {
            return Err(FixtureError::InputTooShort {
                len: step.input.len(),
            });
        }
        if step.hook == Hook::Xdp && step.skb_ingress_ifindex.is_some() {
            return Ok(
                "  step: skb_ingress_ifindex is a TC context field; XDP has none\n".to_owned(),
            );
        }
        step.seed
            .as_ref()
            .unwrap_or(seed)
            .apply(&mut self.ebpf, &mut self.lb_writer)?;
        if step.age_before_ns > 0
            && let Some(key) = step.expect.key()
        {
            self.ct_age(&key, step.age_before_ns)?;
        }
        let table_before = self.ct_entries()?;
        let stats_before = self.ct_stats()?;
        let reasons_before = self.stats()?;
        let ctx = step.skb_ingress_ifindex.map(skb_ctx_forwarded_from);
        let mut out = vec![0u8; step.input.len() + OUTPUT_SLACK];
        let res = self.test_run_program(
            program_name(step.hook),
            step.hook,
            &step.input,
            &mut out,
            1,
            ctx.as_ref().map(|c| c.as_slice()),
        )?;
        out.truncate(res.data_size_out as usize);
        let got = CtObserved {
            verdict: res.return_value,
            output: out,
            table_before,
            table_after: self.ct_entries()?,
            stats: self.ct_stats()?.delta(&stats_before),
            reasons: self.stats()?.delta(&reasons_before),
            events: self.ct_drain_events()?,
        };
        Ok(ct_mismatches(step, &got))
    }
}

/// Keeps the calling thread on the CPU it runs on now: BPF_PROG_TEST_RUN runs on the calling
/// CPU, so a test of per-CPU state (round-robin positions, a backend's shared route) runs
/// every packet on one.
pub fn pin_to_current_cpu() {
    // SAFETY: sched_getcpu has no preconditions; the cpu_set_t is zeroed, then one bit set,
    // and passed with its size for the calling thread (pid 0).
    unsafe {
        let cpu = libc::sched_getcpu();
        if cpu < 0 {
            return;
        }
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu as usize, &mut set);
        libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set);
    }
}

/// Offsets in `struct __sk_buff` (uapi, stable).
const SKB_INGRESS_IFINDEX_OFF: usize = 36;
/// Up to the end of `ifindex`: what BPF_PROG_TEST_RUN accepts with every other field zero.
const SKB_CTX_LEN: usize = 44;

/// Offset of `ifindex` in `struct __sk_buff`.
const SKB_IFINDEX_OFF: usize = 40;
/// `struct xdp_md`: data, data_end, data_meta, ingress_ifindex, rx_queue_index,
/// egress_ifindex (u32 each).
const XDP_MD_LEN: usize = 24;

/// A test-run context for a frame of `len` bytes arriving on interface `ifindex` at `hook`.
fn arrival_ctx(hook: Hook, ifindex: u32, len: usize) -> Vec<u8> {
    let i = ifindex.to_ne_bytes();
    match hook {
        Hook::Xdp => {
            let mut ctx = vec![0u8; XDP_MD_LEN];
            // data_end must be the frame's length; data and data_meta 0.
            ctx[4..8].copy_from_slice(&(len as u32).to_ne_bytes());
            ctx[12..16].copy_from_slice(&i);
            ctx
        }
        Hook::TcIngress | Hook::TcEgress => {
            let mut ctx = skb_ctx_forwarded_from(ifindex).to_vec();
            ctx[SKB_IFINDEX_OFF..SKB_IFINDEX_OFF + 4].copy_from_slice(&i);
            ctx
        }
    }
}

/// A TC test-run context for a packet that arrived on `ingress_ifindex` (its
/// `skb->skb_iif`): forwarded rather than sent by this node. `ifindex` stays 0, so the packet
/// is still seen on loopback.
fn skb_ctx_forwarded_from(ingress_ifindex: u32) -> [u8; SKB_CTX_LEN] {
    let mut ctx = [0u8; SKB_CTX_LEN];
    ctx[SKB_INGRESS_IFINDEX_OFF..SKB_INGRESS_IFINDEX_OFF + 4]
        .copy_from_slice(&ingress_ifindex.to_ne_bytes());
    ctx
}

/// What a step leaves behind for its packet's connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CtExpect {
    /// The packet is not tracked (a fragment, an untracked protocol or ICMP type, a hook that
    /// does not track for the interface): the table does not change at all.
    Untouched,
    /// The packet's connection has no entry after the step (a packet that cannot start one);
    /// no other entry changes.
    Absent(CtKey),
    /// The packet's connection has an entry like this after the step; no other entry changes.
    Entry(CtKey, CtEntryExpect),
}

impl CtExpect {
    /// The connection the step is about, if the packet is tracked.
    pub fn key(&self) -> Option<CtKey> {
        match self {
            CtExpect::Untouched => None,
            CtExpect::Absent(key) | CtExpect::Entry(key, _) => Some(*key),
        }
    }
}

/// The parts of a [`CtEntry`] a step states.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtEntryExpect {
    /// `tcp_state::*` for TCP; `None` for UDP and ICMP, whose entries keep state 0.
    pub tcp_state: Option<u8>,
    /// The `CT_F_SEEN_REPLY | CT_F_ASSURED` bits, exactly (the direction bit shows in
    /// `packets`: the originator's packets count under `DIR_ORIGINAL`).
    pub flags: u8,
    /// Packets per direction (`DIR_*`), when stated.
    pub packets: Option<[u64; 2]>,
    /// Bytes (frame lengths) per direction, when stated.
    pub bytes: Option<[u64; 2]>,
}

/// The flag bits a [`CtEntryExpect`] states.
pub const CT_CHECKED_FLAGS: u8 = CT_F_SEEN_REPLY | CT_F_ASSURED;

/// One packet of a [`CtSequence`] and what it must do.
#[derive(Clone, Debug)]
pub struct CtStep {
    /// What the packet is, for failure messages (`reply SYN|ACK`).
    pub what: String,
    pub hook: Hook,
    /// The frame, from the destination MAC on.
    pub input: Vec<u8>,
    pub expect: CtExpect,
    /// Exact `ct_stat` changes as (code, delta); every slot not listed must not move.
    pub expect_stats: Vec<(u32, u64)>,
    /// The events this packet emits, in order, as (`ct_event::*`, state in the event). Each
    /// must also carry the packet's connection key.
    pub expect_events: Vec<(u8, u8)>,
    /// Entries in `FP_CT` after the step, when stated.
    pub expect_table_len: Option<usize>,
    /// TC only: run with a context saying the packet arrived on this interface (forwarded);
    /// `None` runs without one, which the datapath sees as sent by this node.
    pub skb_ingress_ifindex: Option<u32>,
    /// Before the packet, the connection's entry (if any) is made this much older: its
    /// creation and last-seen times move back, as if that time had passed.
    pub age_before_ns: u64,
    /// `Some(reason)`: the stateful firewall drops the packet with this reason code (counted
    /// once under (hook, drop, reason)); `None`: the kernel gets it, as conntrack alone never
    /// decides.
    pub expect_drop: Option<u32>,
    /// Events this packet emits about other connections (an early drop's victim), as
    /// (`ct_event::*`, key), in order, after the packet's own.
    pub expect_other_events: Vec<(u8, CtKey)>,
    /// The seed for this step, instead of the sequence's (a service changed mid-connection).
    pub seed: Option<Seed>,
    /// The frame the program must leave (a translated packet), instead of the input.
    pub expect_output: Option<Vec<u8>>,
    /// The reason the packet is counted under, with the kernel verdict (e.g. `lb_to_backend`),
    /// when the step states one.
    pub expect_reason: Option<u32>,
    /// Other entries this step may create or remove (a load-balanced connection's alias).
    pub also_changes: Vec<CtKey>,
    /// The fast path forwards the packet itself (XDP: a redirect), counted under
    /// `expect_reason` with the forward verdict.
    pub expect_forward: bool,
}

/// A conntrack fixture: packets run in order against one table (entries persist across
/// steps), each checked for its entry, counters and events. The verdict must stay the
/// kernel's and the frame unchanged, since conntrack never decides or rewrites.
#[derive(Clone, Debug)]
pub struct CtSequence {
    /// Unique, says what the sequence is about (`tcp_handshake_active_close`).
    pub name: String,
    /// Applied before every step (it includes which hooks track on which interface).
    pub seed: Seed,
    /// Synthetic assured connections put in the table before the first step (`ct_fill`).
    pub prefill_assured: u32,
    pub steps: Vec<CtStep>,
}

/// Why a sequence did not pass.
#[derive(Debug, thiserror::Error)]
pub enum CtFailure {
    #[error("sequence `{sequence}` step {step} ({what}) could not run: {source}")]
    Run {
        sequence: String,
        step: usize,
        what: String,
        #[source]
        source: Box<FixtureError>,
    },
    #[error("sequence `{sequence}`, step {step} ({hook}, {what}):\n{details}")]
    Mismatch {
        sequence: String,
        step: usize,
        hook: &'static str,
        what: String,
        details: String,
    },
}

/// What one step did: the program's result and what changed in the conntrack maps.
struct CtObserved {
    verdict: u32,
    output: Vec<u8>,
    table_before: BTreeMap<CtKey, CtEntry>,
    table_after: BTreeMap<CtKey, CtEntry>,
    stats: Vec<(u32, u64)>,
    /// FP_STATS moved by the packet.
    reasons: crate::stats::StatsSnapshot,
    events: Vec<CtEvent>,
}

/// Every difference between what `step` states and what happened, one paragraph each.
fn ct_mismatches(step: &CtStep, got: &CtObserved) -> String {
    let mut out = String::new();
    let verdict = if step.expect_drop.is_some() {
        Verdict::Drop
    } else if step.expect_forward {
        Verdict::Forward
    } else {
        Verdict::Kernel
    };
    let want_verdict = raw_verdict(step.hook, verdict);
    if got.verdict != want_verdict {
        let _ = writeln!(
            out,
            "  verdict: expected {} got {}",
            verdict_name(step.hook, want_verdict),
            verdict_name(step.hook, got.verdict)
        );
    }
    if let Some(code) = step.expect_drop {
        let n = got.reasons.get(step.hook, Verdict::Drop, code).packets;
        let all = got.reasons.packets_on_hook(step.hook);
        if n != 1 || all != 1 {
            let _ = writeln!(
                out,
                "  stats: expected the packet counted once as drop/{}, got {n} there ({all} on the hook)",
                fastpath_common::reason::name(code)
            );
        }
    }
    let want_output = step.expect_output.as_ref().unwrap_or(&step.input);
    if got.output != *want_output {
        let _ = writeln!(
            out,
            "  output: expected {}, got ('!' marks differing lines)\n{}",
            if step.expect_output.is_some() {
                "the translated frame (checksums as a full recomputation gives them)"
            } else {
                "the input unchanged"
            },
            hexdump_diff(want_output, &got.output)
        );
    }
    if let Some(code) = step.expect_reason {
        let n = got.reasons.get(step.hook, verdict, code).packets;
        if n != 1 {
            let _ = writeln!(
                out,
                "  stats: expected the packet counted once as {}/{}, got {n}",
                verdict.name(),
                fastpath_common::reason::name(code)
            );
        }
    }

    let key = step.expect.key();
    let victims: Vec<CtKey> = step
        .expect_other_events
        .iter()
        .filter(|(kind, _)| *kind == ct_event::EARLY_DROP)
        .map(|(_, k)| *k)
        .collect();
    for v in &victims {
        if got.table_after.contains_key(v) {
            let _ = writeln!(
                out,
                "  table: {} should have been dropped early, but is still there",
                key_name(v)
            );
        }
    }
    let others: Vec<String> = got
        .table_before
        .keys()
        .chain(got.table_after.keys())
        .filter(|k| Some(**k) != key && !victims.contains(k) && !step.also_changes.contains(k))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .filter(|k| got.table_before.get(k) != got.table_after.get(k))
        .map(|k| {
            format!(
                "    {}: {} -> {}\n",
                key_name(k),
                entry_name(got.table_before.get(k)),
                entry_name(got.table_after.get(k))
            )
        })
        .collect();
    if !others.is_empty() {
        let mine = key.map_or_else(|| "none: untracked".to_owned(), |k| key_name(&k));
        let _ = writeln!(
            out,
            "  table: entries other than the packet's connection ({mine}) changed:\n{}",
            others.concat().trim_end()
        );
    }
    match &step.expect {
        CtExpect::Untouched => {}
        CtExpect::Absent(k) => {
            if let Some(e) = got.table_after.get(k) {
                let _ = writeln!(
                    out,
                    "  entry {}: expected none, got {}",
                    key_name(k),
                    entry_name(Some(e))
                );
            }
        }
        CtExpect::Entry(k, want) => match got.table_after.get(k) {
            None => {
                let _ = writeln!(
                    out,
                    "  entry {}: expected {}, got none",
                    key_name(k),
                    want_name(want)
                );
            }
            Some(e) => {
                if !entry_matches(want, e) {
                    let _ = writeln!(
                        out,
                        "  entry {}:\n    expected {}\n    got      {}",
                        key_name(k),
                        want_name(want),
                        entry_name(Some(e))
                    );
                }
            }
        },
    }
    if let Some(n) = step.expect_table_len
        && got.table_after.len() != n
    {
        let keys: Vec<String> = got.table_after.keys().map(key_name).collect();
        let _ = writeln!(
            out,
            "  table: expected {n} entries, got {}: {}",
            got.table_after.len(),
            keys.join(", ")
        );
    }

    let mut want_stats: BTreeMap<u32, u64> = BTreeMap::new();
    for &(code, delta) in &step.expect_stats {
        *want_stats.entry(code).or_default() += delta;
    }
    want_stats.retain(|_, d| *d != 0);
    let want_stats: Vec<(u32, u64)> = want_stats.into_iter().collect();
    if got.stats != want_stats {
        let _ = writeln!(
            out,
            "  ct_stats: expected {} got {}",
            stats_name(&want_stats),
            stats_name(&got.stats)
        );
    }

    let got_events: Vec<(u8, u8)> = got
        .events
        .iter()
        .filter(|e| Some(e.key) == key)
        .map(|e| (e.kind, e.state))
        .collect();
    if got_events != step.expect_events {
        let _ = writeln!(
            out,
            "  events: expected {} got {}",
            events_name(&step.expect_events),
            events_name(&got_events)
        );
    }
    let got_other: Vec<(u8, CtKey)> = got
        .events
        .iter()
        .filter(|e| Some(e.key) != key)
        .map(|e| (e.kind, e.key))
        .collect();
    if got_other != step.expect_other_events {
        let name = |v: &[(u8, CtKey)]| {
            if v.is_empty() {
                return "(none)".to_owned();
            }
            v.iter()
                .map(|(kind, k)| format!("{} of {}", events_name(&[(*kind, 0)]), key_name(k)))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let _ = writeln!(
            out,
            "  events about other connections: expected {} got {}",
            name(&step.expect_other_events),
            name(&got_other)
        );
    }
    out
}

fn entry_matches(want: &CtEntryExpect, got: &CtEntry) -> bool {
    got.state == want.tcp_state.unwrap_or(tcp_state::NONE)
        && got.flags & CT_CHECKED_FLAGS == want.flags
        && want.packets.is_none_or(|p| p == got.packets)
        && want.bytes.is_none_or(|b| b == got.bytes)
}

/// `tcp 10.0.0.1:40000 <-> 10.0.0.2:80`.
pub fn key_name(k: &CtKey) -> String {
    let addr = |a: &[u8; 16]| match k.family {
        4 => std::net::Ipv4Addr::new(a[0], a[1], a[2], a[3]).to_string(),
        _ => format!("[{}]", std::net::Ipv6Addr::from(*a)),
    };
    let proto = match k.proto {
        6 => "tcp".to_owned(),
        17 => "udp".to_owned(),
        1 => "icmp".to_owned(),
        58 => "icmpv6".to_owned(),
        p => format!("proto{p}"),
    };
    format!(
        "{proto} {}:{} <-> {}:{}",
        addr(&k.addr_lo),
        k.port_lo,
        addr(&k.addr_hi),
        k.port_hi
    )
}

fn state_name(state: u8) -> String {
    tcp_state::NAMES
        .get(usize::from(state))
        .map_or_else(|| format!("state{state}"), |n| (*n).to_owned())
}

fn flags_name(flags: u8) -> String {
    let names: Vec<&str> = [
        (CT_F_ORIG_IS_LO, "ORIG_IS_LO"),
        (CT_F_SEEN_REPLY, "SEEN_REPLY"),
        (CT_F_ASSURED, "ASSURED"),
    ]
    .into_iter()
    .filter(|(bit, _)| flags & bit != 0)
    .map(|(_, name)| name)
    .collect();
    if names.is_empty() {
        "-".to_owned()
    } else {
        names.join("|")
    }
}

fn entry_name(e: Option<&CtEntry>) -> String {
    let Some(e) = e else {
        return "none".to_owned();
    };
    format!(
        "state {} flags {} packets orig {} reply {} bytes orig {} reply {}",
        state_name(e.state),
        flags_name(e.flags),
        e.packets[DIR_ORIGINAL],
        e.packets[DIR_REPLY],
        e.bytes[DIR_ORIGINAL],
        e.bytes[DIR_REPLY]
    )
}

fn want_name(w: &CtEntryExpect) -> String {
    let mut s = format!(
        "state {} flags {} (of SEEN_REPLY|ASSURED)",
        state_name(w.tcp_state.unwrap_or(tcp_state::NONE)),
        flags_name(w.flags)
    );
    if let Some(p) = w.packets {
        let _ = write!(
            s,
            " packets orig {} reply {}",
            p[DIR_ORIGINAL], p[DIR_REPLY]
        );
    }
    if let Some(b) = w.bytes {
        let _ = write!(s, " bytes orig {} reply {}", b[DIR_ORIGINAL], b[DIR_REPLY]);
    }
    s
}

fn stats_name(stats: &[(u32, u64)]) -> String {
    if stats.is_empty() {
        return "(no counter moved)".to_owned();
    }
    stats
        .iter()
        .map(|&(code, delta)| {
            let name = ct_stat::NAMES
                .get(code as usize)
                .map_or_else(|| format!("slot{code}"), |n| (*n).to_owned());
            format!("{name}+{delta}")
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn events_name(events: &[(u8, u8)]) -> String {
    if events.is_empty() {
        return "(none)".to_owned();
    }
    events
        .iter()
        .map(|&(kind, state)| {
            let kind = match kind {
                ct_event::NEW => "NEW".to_owned(),
                ct_event::REPLIED => "REPLIED".to_owned(),
                ct_event::ESTABLISHED => "ESTABLISHED".to_owned(),
                ct_event::CLOSED => "CLOSED".to_owned(),
                ct_event::EXPIRED => "EXPIRED".to_owned(),
                ct_event::EARLY_DROP => "EARLY_DROP".to_owned(),
                ct_event::KILLED => "KILLED".to_owned(),
                k => format!("kind{k}"),
            };
            // Only TCP events carry a state.
            if state == tcp_state::NONE {
                kind
            } else {
                format!("{kind}({})", state_name(state))
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// One benchmark program loaded on its own: the object's maps in a pin directory of their
/// own, no other program verified. Detached from where it was attached when dropped.
struct Solo {
    ebpf: Ebpf,
    name: &'static str,
    _pins: ScratchPinDir,
}

impl Solo {
    fn load(name: &'static str) -> Result<Self, FixtureError> {
        let pins = ScratchPinDir::create("fixture")
            .map_err(|(path, source)| FixtureError::PinDir { path, source })?;
        let mut ebpf = EbpfLoader::new()
            .default_map_pin_directory(pins.path())
            .load(crate::EBPF_BENCH_OBJECT)
            .map_err(|source| FixtureError::Load { source })?;
        let xdp: &mut Xdp = program_mut(&mut ebpf, name)?;
        xdp.load()
            .map_err(|source| FixtureError::Program { name, source })?;
        Ok(Solo {
            ebpf,
            name,
            _pins: pins,
        })
    }

    /// Attaches the program in native mode to interface `ifindex` of this thread's network
    /// namespace.
    fn attach(&mut self, ifindex: u32) -> Result<XdpLinkId, FixtureError> {
        let name = self.name;
        let xdp: &mut Xdp = program_mut(&mut self.ebpf, name)?;
        xdp.attach(NetworkInterface::Index(ifindex), XdpMode::Driver)
            .map_err(|source| FixtureError::Program { name, source })
    }

    fn detach(&mut self, link: XdpLinkId) -> Result<(), FixtureError> {
        let name = self.name;
        let xdp: &mut Xdp = program_mut(&mut self.ebpf, name)?;
        xdp.detach(link)
            .map_err(|source| FixtureError::Program { name, source })
    }
}

/// `bench_xdp_sink` loaded on its own, for the load-balancer benchmark's backends: it drops
/// the benchmark's datagrams on the links it is attached to. Detached by
/// [`XdpSink::detach`] or when dropped.
pub struct XdpSink(Solo);

impl XdpSink {
    pub fn load() -> Result<Self, FixtureError> {
        Ok(XdpSink(Solo::load(program_names::BENCH_XDP_SINK)?))
    }

    /// Attaches the sink in native mode to interface `ifindex` of this thread's network
    /// namespace (a veth: it then counts what it drops as `xdp_drops`).
    pub fn attach(&mut self, ifindex: u32) -> Result<XdpLinkId, FixtureError> {
        self.0.attach(ifindex)
    }

    /// Detaches what [`XdpSink::attach`] attached.
    pub fn detach(&mut self, link: XdpLinkId) -> Result<(), FixtureError> {
        self.0.detach(link)
    }
}

/// `bench_xdp_flows` loaded on its own: the replication benchmark's generator of new
/// connections, each frame a new TCP flow (`fastpath_common::bench::flow_stamp`, counted
/// over every frame this generator makes). One thread at a time.
pub struct FlowGenerator(Solo);

impl FlowGenerator {
    pub fn load() -> Result<Self, FixtureError> {
        Ok(FlowGenerator(Solo::load(program_names::BENCH_XDP_FLOWS)?))
    }

    /// Attaches the generator in native mode to interface `ifindex` of this thread's network
    /// namespace, a spare veth that carries nothing: a test run of more than one frame puts
    /// its program into the kernel's XDP dispatcher and takes it out again (an RCU grace
    /// period each, ~25 ms per call here), unless the program is attached somewhere.
    pub fn hold_in_dispatcher(&mut self, ifindex: u32) -> Result<XdpLinkId, FixtureError> {
        self.0.attach(ifindex)
    }

    /// Sends `packets` new flows made from `frame` (an IPv4 TCP SYN, no IP options, at least
    /// 56 bytes) out of interface `ifindex` of this thread's namespace, as
    /// [`Fixture::transmit_live`] does; the time the kernel took.
    pub fn transmit(
        &mut self,
        ifindex: u32,
        frame: &[u8],
        packets: u32,
        batch: u32,
    ) -> Result<Duration, FixtureError> {
        set_generator_frame(&mut self.0.ebpf, frame)?;
        live_frames(
            &self.0.ebpf,
            program_names::BENCH_XDP_FLOWS,
            ifindex,
            frame,
            packets,
            batch,
        )
    }

    /// The next `count` frames the generator would send for `frame`, made one at a time
    /// without sending them: what it puts on the wire, for its test.
    pub fn frames(&mut self, frame: &[u8], count: usize) -> Result<Vec<Vec<u8>>, FixtureError> {
        set_generator_frame(&mut self.0.ebpf, frame)?;
        (0..count)
            .map(|_| {
                let mut out = vec![0u8; frame.len() + OUTPUT_SLACK];
                let res = test_run(
                    &self.0.ebpf,
                    program_names::BENCH_XDP_FLOWS,
                    Hook::Xdp,
                    frame,
                    &mut out,
                    1,
                    None,
                )?;
                out.truncate(res.data_size_out as usize);
                Ok(out)
            })
            .collect()
    }
}

/// The first bytes of a conntrack entry, the same in every layout the benchmark may time
/// beside this tree's (an earlier build's table): the fields before `CtEntry::hops`. The hops
/// are the node's own routing state; an entry moved between layouts has none learned (zero).
const CT_ENTRY_SHARED: usize = 104;
/// Entry sizes of earlier builds: before entries kept their next hops, and with 32-byte hops.
const CT_ENTRY_BEFORE_HOPS: usize = CT_ENTRY_SHARED;
const CT_ENTRY_WIDE_HOPS: usize = 168;

/// Which entry layout the loaded object's `FP_CT` has (by its value size).
enum CtLayout {
    Now,
    BeforeHops,
    WideHops,
}

impl CtLayout {
    fn of(map: &aya::maps::Map) -> Result<CtLayout, FixtureError> {
        let name = map_names::CT;
        let data = match map {
            aya::maps::Map::HashMap(data) => data,
            _ => return Err(map_error(name)(MapError::InvalidMapType { map_type: 0 })),
        };
        let size = data.info().map_err(map_error(name))?.value_size() as usize;
        match size {
            s if s == size_of::<CtEntry>() => Ok(CtLayout::Now),
            CT_ENTRY_BEFORE_HOPS => Ok(CtLayout::BeforeHops),
            CT_ENTRY_WIDE_HOPS => Ok(CtLayout::WideHops),
            size => Err(map_error(name)(MapError::InvalidValueSize {
                size,
                expected: size_of::<CtEntry>(),
            })),
        }
    }
}

/// `FP_CT` with the entry layout of the object loaded.
enum CtView<M> {
    Now(BpfHashMap<M, CtKey, CtEntry>),
    BeforeHops(BpfHashMap<M, CtKey, [u8; CT_ENTRY_BEFORE_HOPS]>),
    WideHops(BpfHashMap<M, CtKey, [u8; CT_ENTRY_WIDE_HOPS]>),
}

/// This tree's entry in an earlier layout of `N` bytes: the shared fields, no hops.
fn entry_as<const N: usize>(e: &CtEntry) -> [u8; N] {
    let mut out = [0; N];
    // SAFETY: CtEntry is plain old data (#[repr(C)], integers) longer than the shared part.
    let bytes = unsafe {
        std::slice::from_raw_parts((e as *const CtEntry).cast::<u8>(), size_of::<CtEntry>())
    };
    out[..CT_ENTRY_SHARED].copy_from_slice(&bytes[..CT_ENTRY_SHARED]);
    out
}

/// An earlier layout's entry as this tree's: the shared fields, no hops.
fn entry_from<const N: usize>(v: &[u8; N]) -> CtEntry {
    let mut e = CtEntry::default();
    // SAFETY: as in `entry_as`; any bytes are a valid CtEntry.
    let bytes = unsafe {
        std::slice::from_raw_parts_mut((&mut e as *mut CtEntry).cast::<u8>(), size_of::<CtEntry>())
    };
    bytes[..CT_ENTRY_SHARED].copy_from_slice(&v[..CT_ENTRY_SHARED]);
    e
}

impl<M: std::borrow::Borrow<MapData>> CtView<M> {
    fn entries(&self) -> Result<BTreeMap<CtKey, CtEntry>, MapError> {
        match self {
            CtView::Now(t) => t.iter().collect(),
            CtView::BeforeHops(t) => t
                .iter()
                .map(|r| r.map(|(k, v)| (k, entry_from(&v))))
                .collect(),
            CtView::WideHops(t) => t
                .iter()
                .map(|r| r.map(|(k, v)| (k, entry_from(&v))))
                .collect(),
        }
    }

    fn get(&self, key: &CtKey) -> Result<CtEntry, MapError> {
        match self {
            CtView::Now(t) => t.get(key, 0),
            CtView::BeforeHops(t) => t.get(key, 0).map(|v| entry_from(&v)),
            CtView::WideHops(t) => t.get(key, 0).map(|v| entry_from(&v)),
        }
    }

    fn keys(&self) -> Result<Vec<CtKey>, MapError> {
        match self {
            CtView::Now(t) => t.keys().collect(),
            CtView::BeforeHops(t) => t.keys().collect(),
            CtView::WideHops(t) => t.keys().collect(),
        }
    }
}

impl<M: std::borrow::BorrowMut<MapData>> CtView<M> {
    fn insert(&mut self, key: &CtKey, entry: &CtEntry) -> Result<(), MapError> {
        match self {
            CtView::Now(t) => t.insert(key, entry, 0),
            CtView::BeforeHops(t) => t.insert(key, &entry_as(entry), 0),
            CtView::WideHops(t) => t.insert(key, &entry_as(entry), 0),
        }
    }

    fn remove(&mut self, key: &CtKey) -> Result<(), MapError> {
        match self {
            CtView::Now(t) => t.remove(key),
            CtView::BeforeHops(t) => t.remove(key),
            CtView::WideHops(t) => t.remove(key),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hexdump_marks_only_differing_lines() {
        let a: Vec<u8> = (0..20).collect();
        let mut b = a.clone();
        b[17] = 0xff;
        b.pop();
        let d = hexdump_diff(&a, &b);
        let lines: Vec<&str> = d.lines().collect();
        assert_eq!(lines.len(), 3, "{d}");
        assert!(lines[1].starts_with("  0000:"), "{d}");
        assert!(lines[2].starts_with("! 0010:"), "{d}");
        assert!(lines[2].contains("10 ff 12 --"), "{d}");
    }

    #[test]
    fn raw_verdicts_per_hook() {
        assert_eq!(raw_verdict(Hook::Xdp, Verdict::Kernel), XDP_PASS);
        assert_eq!(raw_verdict(Hook::Xdp, Verdict::Drop), XDP_DROP);
        assert_eq!(raw_verdict(Hook::TcIngress, Verdict::Kernel), TC_ACT_UNSPEC);
        assert_eq!(raw_verdict(Hook::TcEgress, Verdict::Drop), TC_ACT_SHOT);
        assert_eq!(raw_verdict(Hook::Xdp, Verdict::Forward), XDP_REDIRECT);
        assert_eq!(
            raw_verdict(Hook::TcIngress, Verdict::Forward),
            TC_ACT_REDIRECT
        );
    }

    #[test]
    fn an_entry_keeps_its_fields_through_the_earlier_layouts() {
        let mut e = CtEntry {
            created_ns: 7,
            last_seen_ns: 9,
            state: 3,
            flags: 0x41,
            origin: 2,
            ..CtEntry::default()
        };
        e.nat.port = 8080;
        e.hops[1].out_ifindex = 5;
        let want = CtEntry {
            hops: Default::default(),
            ..e
        };
        let before_hops = entry_from(&entry_as::<CT_ENTRY_BEFORE_HOPS>(&e));
        let wide_hops = entry_from(&entry_as::<CT_ENTRY_WIDE_HOPS>(&e));
        for (layout, back) in [("before hops", before_hops), ("wide hops", wide_hops)] {
            assert_eq!(
                back, want,
                "{layout}: every field but the hops survives; the hops come back zero"
            );
        }
        assert_eq!(
            entry_as::<CT_ENTRY_WIDE_HOPS>(&e)[CT_ENTRY_SHARED..],
            [0; CT_ENTRY_WIDE_HOPS - CT_ENTRY_SHARED],
            "an earlier layout's hops are written as nothing learned"
        );
    }
}
