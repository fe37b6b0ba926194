//! The failover testbed: two fastpath nodes (A active, B standby) between a client and three
//! backends, keepalived moving the VIP between them, and the keepalived configuration both
//! the tests and `config/keepalived/` use.
//!
//! ```text
//!                     front switch (bridge)                 back switch (bridge)
//!   client --------------+------------------+         +-------+-------------+------ backend0..2
//!   10.200.100.10        |                  |         |       |               10.200.110.11..13
//!                  front0 .1          front0 .2    back0 .1  back0 .2        default via .254
//!                     [ lba ]==sync0==[ lbb ]-----------+       |
//!                        |  10.200.120.1/.2   |                  |
//!                        +-------------------------------------- +
//!   VIP 10.200.100.100 (front) and gateway 10.200.110.254 (back): on the VRRP master only
//! ```
//!
//! Contract: everything is built from [`Topology`], so it is removed on drop like any other
//! namespace test (processes stopped, namespaces deleted). keepalived runs per node in the
//! foreground with its pid files and transition log in a private temp dir; [`HaTopology::crash`]
//! kills it hard and cuts the node's links, as a dead machine would.
//!
//! Also here: the sync pair on the load-balancer topology ([`SyncPair`]: node A is the LB
//! topology's `fp`, node B a `peer` namespace joined to it by a sync link, no VRRP) that the
//! replication test and the HA benchmarks share, the `[ha]` tables of a node ([`ha_toml`]),
//! waiting for `ha status --check`, and the load-balanced entries of two tables compared
//! entry for entry ([`lb_entries`], [`compare_lb_entries`]). Certificates are made by the
//! callers (rcgen is a dev-dependency); these take their paths.

use std::{
    collections::BTreeSet,
    fs,
    net::{Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    thread,
    time::{Duration, Instant},
};

use fastpath_common::{
    ct::{CT_F_LB, CT_F_LB_ALIAS},
    map_names,
};

use super::netns::{
    Daemon, DaemonConfig, LbTopology, Netns, NetnsError, Spawned, TempDir, Topology, VethEnd,
};
use crate::datapath::{CtTable, DatapathError};

/// One of the two load-balancer nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Node {
    /// The node that starts as master (higher priority).
    A,
    /// The standby.
    B,
}

impl Node {
    pub const BOTH: [Node; 2] = [Node::A, Node::B];

    /// Its namespace role (`lba`, `lbb`).
    pub fn role(self) -> &'static str {
        match self {
            Node::A => "lba",
            Node::B => "lbb",
        }
    }

    pub fn other(self) -> Node {
        match self {
            Node::A => Node::B,
            Node::B => Node::A,
        }
    }

    fn index(self) -> usize {
        match self {
            Node::A => 0,
            Node::B => 1,
        }
    }

    /// Its last address byte on every shared network (`.1`, `.2`).
    fn host(self) -> u8 {
        self.index() as u8 + 1
    }

    /// The name in its sync certificate and in its peer's `server_name`.
    pub fn server_name(self) -> &'static str {
        match self {
            Node::A => "fastpath-a",
            Node::B => "fastpath-b",
        }
    }

    /// Its `[ha] node_id`.
    pub fn node_id(self) -> u32 {
        self.index() as u32 + 1
    }

    /// Its keepalived priority: A above B, so A wins the first election.
    pub fn priority(self) -> u8 {
        match self {
            Node::A => 150,
            Node::B => 100,
        }
    }
}

/// How the nodes' services translate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LbMode {
    /// Destination only: backends route their replies through the floating gateway.
    Nat,
    /// Source too, to the floating gateway address ([`HaTopology::BACK_GATEWAY`]).
    FullNat,
}

/// What [`ha_topology`] built, with its address plan.
pub struct HaTopology {
    /// Dropped (killed) before the namespaces go.
    keepalived: [Option<Keepalived>; 2],
    /// Crashed nodes: left out of [`HaTopology::holders`].
    crashed: [bool; 2],
    backends: usize,
    pub topo: Topology,
}

impl HaTopology {
    pub const CLIENT: &'static str = "client";
    pub const FRONT_SWITCH: &'static str = "swfront";
    pub const BACK_SWITCH: &'static str = "swback";
    /// The client's and every backend's interface.
    pub const HOST_IF: &'static str = "eth0";
    /// An LB node's interface on the front network (VRRP runs here).
    pub const FRONT_IF: &'static str = "front0";
    /// An LB node's interface on the back network.
    pub const BACK_IF: &'static str = "back0";
    /// An LB node's end of the sync link (not attached to fastpath: the sync stream is the
    /// daemon's own TCP traffic).
    pub const SYNC_IF: &'static str = "sync0";
    /// The bridge in each switch namespace.
    const BRIDGE: &'static str = "br0";
    /// The service address clients connect to: on the VRRP master's front interface.
    pub const VIP: Ipv4Addr = Ipv4Addr::new(10, 200, 100, 100);
    /// The backends' default gateway, on the VRRP master's back interface; also the full-NAT
    /// source address, so the backends' replies follow the master either way.
    pub const BACK_GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 200, 110, 254);
    pub const CLIENT_ADDR: Ipv4Addr = Ipv4Addr::new(10, 200, 100, 10);
    /// The sync listener's port on the sync link.
    pub const SYNC_PORT: u16 = 7946;
    /// The VRRP router id of the pair.
    pub const VRID: u8 = 51;

    pub fn backend_role(i: usize) -> String {
        format!("backend{i}")
    }

    pub fn backend_addr(i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, 200, 110, 11 + i as u8)
    }

    pub fn front_addr(node: Node) -> Ipv4Addr {
        Ipv4Addr::new(10, 200, 100, node.host())
    }

    pub fn back_addr(node: Node) -> Ipv4Addr {
        Ipv4Addr::new(10, 200, 110, node.host())
    }

    pub fn sync_addr(node: Node) -> Ipv4Addr {
        Ipv4Addr::new(10, 200, 120, node.host())
    }

    pub fn sync_listen(node: Node) -> SocketAddr {
        SocketAddr::from((Self::sync_addr(node), Self::SYNC_PORT))
    }

    pub fn client(&self) -> &Netns {
        self.topo.ns(Self::CLIENT)
    }

    pub fn node(&self, node: Node) -> &Netns {
        self.topo.ns(node.role())
    }

    pub fn backend(&self, i: usize) -> &Netns {
        self.topo.ns(&Self::backend_role(i))
    }

    pub fn backends(&self) -> usize {
        self.backends
    }

    /// The namespaces whose TCP stacks end the test's connections: the client and every
    /// backend (for [`super::traffic::tcp_resets`]).
    pub fn endpoints(&self) -> Vec<&Netns> {
        std::iter::once(self.client())
            .chain((0..self.backends).map(|i| self.backend(i)))
            .collect()
    }

    /// A daemon config for either node: every hook on its front and back interfaces, and two
    /// services on the VIP with every backend — `http_port` (nginx) and `echo_port` (the
    /// connection pool) — in `mode`. Full-NAT takes its source ports from `snat_ports`
    /// (`"FIRST-LAST"`). `scheduler`: the services' `scheduler` key, if not the default.
    pub fn lb_config(
        &self,
        pin_dir: &Path,
        mode: LbMode,
        ports: &[u16],
        snat_ports: &str,
        scheduler: Option<&str>,
    ) -> DaemonConfig {
        let mut s = String::new();
        for port in ports {
            s += &format!(
                "[[service]]\nvip = \"{}\"\nport = {port}\nprotocol = \"tcp\"\n",
                Self::VIP
            );
            if let Some(sched) = scheduler {
                s += &format!("scheduler = \"{sched}\"\n");
            }
            if mode == LbMode::FullNat {
                s += &format!(
                    "mode = \"full_nat\"\nsnat_address = \"{}\"\nsnat_ports = \"{snat_ports}\"\n",
                    Self::BACK_GATEWAY
                );
            }
            for i in 0..self.backends {
                s += &format!(
                    "[[service.backend]]\naddress = \"{}\"\nport = {port}\n",
                    Self::backend_addr(i)
                );
            }
        }
        DaemonConfig::new(pin_dir)
            .interface(Self::FRONT_IF)
            .interface(Self::BACK_IF)
            .services(&s)
    }

    /// The `[ha]` tables for `node`: it listens on its sync address, its peer is the other
    /// node's sync address, named by the other node's [`Node::server_name`].
    pub fn ha_toml(node: Node, cert: &Path, key: &Path, ca: &Path) -> String {
        ha_toml(
            node,
            Self::sync_listen(node),
            Self::sync_listen(node.other()),
            &NodeTls {
                cert: cert.to_owned(),
                key: key.to_owned(),
                ca: ca.to_owned(),
            },
        )
    }

    /// Checksum offloads off on the client's and every backend's interface (they send full
    /// checksums and verify what they receive, as traffic from a wire does; see
    /// [`super::netns::LbTopology::checksum_offloads_off`]).
    pub fn checksum_offloads_off(&self) -> Result<(), NetnsError> {
        for ns in self.endpoints() {
            ns.run(&["ethtool", "-K", Self::HOST_IF, "tx", "off", "rx", "off"])?;
        }
        Ok(())
    }

    /// Starts keepalived on `node` (see [`KeepalivedConfig::for_node`]); `track` is the
    /// readiness command of its weighted script (`fastpath --socket S ha status --check`),
    /// `forwarding` the command of its FAULT script (`fastpath datapath --check`), each or
    /// none. Waits until it runs its VRRP child.
    pub fn start_keepalived(
        &mut self,
        node: Node,
        track: Option<String>,
        forwarding: Option<String>,
    ) {
        assert!(
            self.keepalived[node.index()].is_none(),
            "keepalived already runs on {node:?}"
        );
        let config = KeepalivedConfig {
            forwarding,
            ..KeepalivedConfig::for_node(node, track)
        };
        let k = Keepalived::start(self.node(node), config)
            .unwrap_or_else(|e| panic!("starting keepalived on {node:?}: {e}"));
        self.keepalived[node.index()] = Some(k);
    }

    pub fn keepalived(&self, node: Node) -> Option<&Keepalived> {
        self.keepalived[node.index()].as_ref()
    }

    /// The live nodes holding the VIP on their front interface (`ip -o addr`). Two means
    /// both think they are master.
    pub fn holders(&self) -> Vec<Node> {
        let vip = format!(" {}/", Self::VIP);
        Node::BOTH
            .into_iter()
            .filter(|n| !self.crashed[n.index()])
            .filter(|&n| {
                self.node(n)
                    .ip(&["-o", "-4", "addr", "show", "dev", Self::FRONT_IF])
                    .is_ok_and(|out| out.contains(&vip))
            })
            .collect()
    }

    /// The one live node holding the VIP, if exactly one does.
    pub fn master(&self) -> Option<Node> {
        match self.holders()[..] {
            [n] => Some(n),
            _ => None,
        }
    }

    /// Waits until `node`, and only it, holds the VIP; panics after `timeout` with both
    /// nodes' keepalived transitions. Returns how long it waited.
    pub fn wait_master(&self, node: Node, timeout: Duration) -> Duration {
        let start = Instant::now();
        loop {
            if self.master() == Some(node) {
                return start.elapsed();
            }
            if start.elapsed() >= timeout {
                panic!(
                    "{node:?} is not the only VIP holder after {timeout:?} (holders: {:?}); \
                     keepalived transitions:\n{}",
                    self.holders(),
                    self.transitions()
                );
            }
            thread::sleep(Duration::from_millis(5));
        }
    }

    /// Both nodes' keepalived transition logs and output, for messages.
    pub fn transitions(&self) -> String {
        Node::BOTH
            .into_iter()
            .map(|n| match self.keepalived(n) {
                Some(k) => format!(
                    "--- {n:?} transitions ---\n{}--- {n:?} keepalived output ---\n{}",
                    k.transitions(),
                    k.output()
                ),
                None => format!("--- {n:?}: no keepalived ---\n"),
            })
            .collect()
    }

    /// A hard crash of `node`'s VRRP side and network: keepalived's VRRP child SIGKILLed,
    /// then its parent (which would otherwise restart the child), then the node's front, back
    /// and sync links set down — a SIGKILLed keepalived leaves the VIP configured, and a
    /// dead machine answers nothing. (Kill the node's daemon first, with
    /// [`super::netns::Daemon::kill9`].) Returns the moment the links went down.
    pub fn crash(&mut self, node: Node) -> Instant {
        if let Some(k) = self.keepalived[node.index()].as_mut() {
            k.kill_hard(self.topo.ns(node.role()));
        }
        let ns = self.node(node);
        for dev in [Self::FRONT_IF, Self::BACK_IF, Self::SYNC_IF] {
            ns.ip(&["link", "set", dev, "down"])
                .unwrap_or_else(|e| panic!("setting {dev} of {node:?} down: {e}"));
        }
        self.crashed[node.index()] = true;
        Instant::now()
    }

    /// Cuts the sync link (both ends down) without touching anything else.
    pub fn cut_sync(&self) {
        for n in Node::BOTH {
            self.node(n)
                .ip(&["link", "set", Self::SYNC_IF, "down"])
                .unwrap_or_else(|e| panic!("setting {n:?}'s sync link down: {e}"));
        }
    }

    /// Brings the sync link back up.
    pub fn heal_sync(&self) {
        for n in Node::BOTH {
            self.node(n)
                .link_up(Self::SYNC_IF)
                .unwrap_or_else(|e| panic!("setting {n:?}'s sync link up: {e}"));
        }
    }
}

/// Builds the failover testbed (see the module docs) with `backends` backends (at most 200).
/// The LB nodes keep the kernel's default sysctls (the daemon sets what it needs). The
/// switches are plain bridges (no STP, so ports forward at once).
pub fn ha_topology(backends: usize) -> Result<HaTopology, NetnsError> {
    assert!(backends <= 200, "ha_topology supports up to 200 backends");
    let mut topo = Topology::new();
    for role in [
        HaTopology::CLIENT,
        HaTopology::FRONT_SWITCH,
        HaTopology::BACK_SWITCH,
    ] {
        topo.add_ns(role)?;
    }
    for n in Node::BOTH {
        topo.add_ns(n.role())?;
    }
    for i in 0..backends {
        topo.add_ns(&HaTopology::backend_role(i))?;
    }
    for sw in [HaTopology::FRONT_SWITCH, HaTopology::BACK_SWITCH] {
        let ns = topo.ns(sw);
        ns.ip(&["link", "add", HaTopology::BRIDGE, "type", "bridge"])?;
        ns.link_up(HaTopology::BRIDGE)?;
    }
    // One port of `switch` per (role, its interface, its address, the port's name).
    let mut plug = |switch: &str, role: &str, ifname: &str, cidr: String, port: &str| {
        topo.veth(
            VethEnd::new(role, ifname).addr(&cidr),
            VethEnd::new(switch, port),
        )?;
        topo.ns(switch)
            .ip(&["link", "set", port, "master", HaTopology::BRIDGE])
            .map(drop)
    };
    plug(
        HaTopology::FRONT_SWITCH,
        HaTopology::CLIENT,
        HaTopology::HOST_IF,
        format!("{}/24", HaTopology::CLIENT_ADDR),
        "client",
    )?;
    for n in Node::BOTH {
        plug(
            HaTopology::FRONT_SWITCH,
            n.role(),
            HaTopology::FRONT_IF,
            format!("{}/24", HaTopology::front_addr(n)),
            n.role(),
        )?;
        plug(
            HaTopology::BACK_SWITCH,
            n.role(),
            HaTopology::BACK_IF,
            format!("{}/24", HaTopology::back_addr(n)),
            n.role(),
        )?;
    }
    for i in 0..backends {
        plug(
            HaTopology::BACK_SWITCH,
            &HaTopology::backend_role(i),
            HaTopology::HOST_IF,
            format!("{}/24", HaTopology::backend_addr(i)),
            &format!("be{i}"),
        )?;
    }
    topo.veth(
        VethEnd::new(Node::A.role(), HaTopology::SYNC_IF)
            .addr(&format!("{}/24", HaTopology::sync_addr(Node::A))),
        VethEnd::new(Node::B.role(), HaTopology::SYNC_IF)
            .addr(&format!("{}/24", HaTopology::sync_addr(Node::B))),
    )?;
    // No sysctl is set by hand: forwarding and accept_local are the daemon's to set (as on an
    // operator's node), and nothing on the nodes binds the VIP.
    for i in 0..backends {
        topo.ns(&HaTopology::backend_role(i))
            .add_route("default", &HaTopology::BACK_GATEWAY.to_string())?;
    }
    Ok(HaTopology {
        keepalived: [None, None],
        crashed: [false, false],
        backends,
        topo,
    })
}

/// [`ha_topology`] for tests: panics saying why it could not be built.
pub fn test_ha_topology(backends: usize) -> HaTopology {
    ha_topology(backends).unwrap_or_else(|e| panic!("building the HA topology: {e}"))
}

/// The notify hook in `config/keepalived/`, run by the tests' keepalived as by a deployment's.
pub fn notify_script() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/keepalived/fastpath-notify.sh");
    fs::canonicalize(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// A keepalived `track_script`: its command and what it does to the priority.
#[derive(Clone, Debug)]
pub struct TrackScript {
    pub command: String,
    /// Added to the priority while the command fails (negative: a node not in sync drops
    /// below its peer).
    pub weight: i32,
}

/// The weight of the readiness track script: A (150) not in sync drops to 90, below an
/// in-sync B (100), and B not in sync drops to 40, below A either way.
pub const TRACK_WEIGHT: i32 = -60;

/// One node's keepalived configuration: a single VRRP instance owning the VIP (front) and
/// the backends' gateway (back), VRRP v3 with 0.1 s adverts, `nopreempt`. The files in
/// `config/keepalived/` are [`KeepalivedConfig::example`] rendered (a unit test keeps them
/// equal).
#[derive(Clone, Debug)]
pub struct KeepalivedConfig {
    pub router_id: String,
    pub priority: u8,
    pub virtual_router_id: u8,
    /// Adverts go out here, and the VIP lives here.
    pub front_if: String,
    pub vip: String,
    pub back_if: String,
    pub back_gateway: String,
    /// `advert_int`, seconds (fractions need VRRP v3).
    pub advert_int: &'static str,
    pub track: Option<TrackScript>,
    /// The FAULT script's command: fails while this node's datapath cannot forward.
    pub forwarding: Option<String>,
    /// The notify command (keepalived appends: type, instance, state, priority).
    pub notify: Option<String>,
}

impl KeepalivedConfig {
    /// The testbed's config for `node`; `track`: the readiness command, if any.
    pub fn for_node(node: Node, track: Option<String>) -> KeepalivedConfig {
        KeepalivedConfig {
            router_id: node.server_name().into(),
            priority: node.priority(),
            virtual_router_id: HaTopology::VRID,
            front_if: HaTopology::FRONT_IF.into(),
            vip: format!("{}/24", HaTopology::VIP),
            back_if: HaTopology::BACK_IF.into(),
            back_gateway: format!("{}/24", HaTopology::BACK_GATEWAY),
            advert_int: "0.1",
            track: track.map(|command| TrackScript {
                command,
                weight: TRACK_WEIGHT,
            }),
            forwarding: None,
            notify: None,
        }
    }

    /// The shipped example for `node` (`config/keepalived/keepalived-{a,b}.conf`):
    /// documentation addresses, eth0 in front, eth1 behind, fastpath installed as the unit
    /// file installs it, both scripts finding the daemon and its pins through its config.
    pub fn example(node: Node) -> KeepalivedConfig {
        KeepalivedConfig {
            forwarding: Some(
                "/usr/local/bin/fastpath --config /etc/fastpath/fastpath.toml datapath --check"
                    .into(),
            ),
            front_if: "eth0".into(),
            vip: "192.0.2.100/24".into(),
            back_if: "eth1".into(),
            back_gateway: "198.51.100.254/24".into(),
            notify: Some(
                "/etc/keepalived/fastpath-notify.sh /var/log/fastpath-vrrp.log".into(),
            ),
            ..KeepalivedConfig::for_node(
                node,
                Some(
                    "/usr/local/bin/fastpath --config /etc/fastpath/fastpath.toml ha status --check"
                        .into(),
                ),
            )
        }
    }

    pub fn render(&self) -> String {
        let mut s = format!(
            "# fastpath HA pair: node {router_id}. See README.md beside this file: install,\n\
             # and which failure leads where.\n\
             global_defs {{\n\
             \x20   router_id {router_id}\n\
             \x20   vrrp_version 3\n\
             \x20   # The new master announces the VIP and the gateway at once, and again 1 s later\n\
             \x20   # for neighbours that missed the first burst.\n\
             \x20   vrrp_garp_master_delay 1\n\
             \x20   vrrp_garp_master_repeat 3\n\
             \x20   script_user root\n\
             \x20   enable_script_security\n\
             }}\n",
            router_id = self.router_id
        );
        if let Some(command) = &self.forwarding {
            s += &format!(
                "\n\
                 # Forwarding: exit 0 while this node's datapath can forward (links pinned,\n\
                 # attached to interfaces that are up; it reads the pins, so a daemon that is\n\
                 # down or restarting does not count: the datapath forwards without it).\n\
                 # No weight: failing is a FAULT — the master gives the VIP up at once and the\n\
                 # standby takes over, nopreempt or not.\n\
                 vrrp_script fastpath_forwarding {{\n\
                 \x20   script \"{command}\"\n\
                 \x20   interval 1\n\
                 \x20   timeout 2\n\
                 \x20   rise 2\n\
                 \x20   fall 1\n\
                 }}\n"
            );
        }
        if let Some(t) = &self.track {
            s += &format!(
                "\n\
                 # Readiness: exit 0 while this node holds its peer's connections (in sync).\n\
                 # A weight, not a fault: a standby out of sync must not take the VIP from a\n\
                 # healthy master (it drops below it), but must still take over when the\n\
                 # master is dead (no adverts: it becomes master whatever its priority). A\n\
                 # master whose daemon died fails it too (150 - 60 = 90) but keeps the VIP:\n\
                 # its datapath still forwards, and the standby has nopreempt.\n\
                 vrrp_script fastpath_in_sync {{\n\
                 \x20   script \"{}\"\n\
                 \x20   interval 1\n\
                 \x20   timeout 2\n\
                 \x20   rise 1\n\
                 \x20   fall 2\n\
                 \x20   weight {}\n\
                 }}\n",
                t.command, t.weight
            );
        }
        s += &format!(
            "\n\
             vrrp_instance fastpath {{\n\
             \x20   # Both nodes start as BACKUP with nopreempt: the higher priority wins the\n\
             \x20   # first election, and a node that comes back never takes the VIP back (it\n\
             \x20   # has no connections yet).\n\
             \x20   state BACKUP\n\
             \x20   nopreempt\n\
             \x20   interface {front_if}\n\
             \x20   virtual_router_id {vrid}\n\
             \x20   priority {priority}\n\
             \x20   # VRRP v3 takes fractions: a dead master is noticed after 3 adverts plus skew\n\
             \x20   # (about 0.35 s here).\n\
             \x20   advert_int {advert}\n\
             \x20   virtual_ipaddress {{\n\
             \x20       # The service address clients connect to.\n\
             \x20       {vip} dev {front_if}\n\
             \x20       # The backends' default gateway and the full-NAT source address: replies\n\
             \x20       # follow the master.\n\
             \x20       {gw} dev {back_if}\n\
             \x20   }}\n",
            front_if = self.front_if,
            vrid = self.virtual_router_id,
            priority = self.priority,
            advert = self.advert_int,
            vip = self.vip,
            gw = self.back_gateway,
            back_if = self.back_if,
        );
        s += &format!(
            "    # The back interface down: the backends are out of reach, FAULT (the front\n\
             \x20   # one, `interface`, is tracked anyway).\n\
             \x20   track_interface {{\n\
             \x20       {}\n\
             \x20   }}\n",
            self.back_if
        );
        let scripts: Vec<&str> = [
            self.forwarding.as_ref().map(|_| "fastpath_forwarding"),
            self.track.as_ref().map(|_| "fastpath_in_sync"),
        ]
        .into_iter()
        .flatten()
        .collect();
        if !scripts.is_empty() {
            s += "    track_script {\n";
            for name in scripts {
                s += &format!("        {name}\n");
            }
            s += "    }\n";
        }
        if let Some(n) = &self.notify {
            s += &format!("    notify \"{n}\"\n");
        }
        s += "}\n";
        s
    }
}

/// keepalived (VRRP only) in the foreground in one namespace: config, pid files and the
/// notify hook's transition log in a private temp dir. Killed (SIGKILL) on drop.
pub struct Keepalived {
    process: Spawned,
    dir: TempDir,
    vrrp_pid_file: PathBuf,
}

impl Keepalived {
    /// Writes `config` (its notify set to [`notify_script`] logging into the temp dir) and
    /// starts `keepalived -f CONF -p PID -r VRRP_PID --vrrp -n -l -D -G` in `ns`; waits until
    /// the VRRP child has written its pid.
    pub fn start(ns: &Netns, mut config: KeepalivedConfig) -> Result<Keepalived, NetnsError> {
        let dir = TempDir::new("keepalived")?;
        config.notify = Some(format!(
            "{} {}",
            notify_script().display(),
            dir.join("transitions.log").display()
        ));
        let conf = dir.join("keepalived.conf");
        fs::write(&conf, config.render()).map_err(|source| NetnsError::Io {
            what: format!("writing {}", conf.display()),
            source,
        })?;
        let (pid, vrrp_pid) = (dir.join("keepalived.pid"), dir.join("vrrp.pid"));
        let path = |p: &Path| p.display().to_string();
        let mut process = ns.spawn(&[
            "keepalived",
            "-f",
            &path(&conf),
            "-p",
            &path(&pid),
            "-r",
            &path(&vrrp_pid),
            "--vrrp",
            "-n",
            "-l",
            "-D",
            "-G",
        ])?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while read_pid(&vrrp_pid).is_none() {
            if !process.is_running() || Instant::now() >= deadline {
                return Err(NetnsError::Io {
                    what: format!(
                        "keepalived in {} (running: {}) wrote no VRRP pid; its output:\n{}",
                        ns.name(),
                        process.is_running(),
                        process.log()
                    ),
                    source: std::io::Error::other("no VRRP child"),
                });
            }
            thread::sleep(Duration::from_millis(20));
        }
        Ok(Keepalived {
            process,
            dir,
            vrrp_pid_file: vrrp_pid,
        })
    }

    /// The notify hook's log: one line per transition (`<time> INSTANCE fastpath MASTER 150`).
    pub fn transitions(&self) -> String {
        fs::read_to_string(self.dir.join("transitions.log")).unwrap_or_default()
    }

    /// keepalived's own output (-l: to the console).
    pub fn output(&self) -> String {
        self.process.log()
    }

    /// SIGKILL the VRRP child, then the parent, then any keepalived process the parent
    /// forked in between (looked up among `ns`'s processes only).
    fn kill_hard(&mut self, ns: &Netns) {
        if let Some(child) = read_pid(&self.vrrp_pid_file) {
            // SAFETY: kill with a pid keepalived wrote; a stale one just fails.
            unsafe { libc::kill(child, libc::SIGKILL) };
        }
        self.process.kill();
        for pid in ns.pids() {
            let comm = fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            if comm.trim() == "keepalived" {
                // SAFETY: a pid of this test's namespace, just read; a stale one just fails.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }
}

fn read_pid(path: &Path) -> Option<i32> {
    fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// A node's sync certificate, key and the CA it trusts for its peers, as PEM files.
#[derive(Clone, Debug)]
pub struct NodeTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

/// The `[ha]` tables of `node`: its [`Node::node_id`], listening on `listen`, with one peer
/// at `peer` whose certificate names the other node's [`Node::server_name`].
pub fn ha_toml(node: Node, listen: SocketAddr, peer: SocketAddr, tls: &NodeTls) -> String {
    format!(
        "[ha]\nnode_id = {}\nlisten = \"{listen}\"\ntls_cert = {:?}\ntls_key = {:?}\ntls_ca = {:?}\n\
         [[ha.peers]]\naddress = \"{peer}\"\nnode_id = {}\nserver_name = \"{}\"\n",
        node.node_id(),
        tls.cert.display().to_string(),
        tls.key.display().to_string(),
        tls.ca.display().to_string(),
        node.other().node_id(),
        node.other().server_name()
    )
}

/// A sync pair on the load-balancer topology ([`super::netns::lb_topology`]), without VRRP:
/// node A is `fp` (it balances the client's connections), node B is the [`SyncPair::PEER`]
/// namespace, joined to fp by its own veth ([`SyncPair::SYNC_IF`], 10.201.0.1 on fp, .2 on
/// the peer), so B only receives A's stream. The sync link is not one of
/// [`LbTopology::fp_interfaces`]: fastpath does not hook it, on either end.
pub struct SyncPair;

impl SyncPair {
    /// Node B's namespace role.
    pub const PEER: &'static str = "peer";
    /// Both ends of the sync link.
    pub const SYNC_IF: &'static str = "sync0";
    /// The ends of a spare link inside B's namespace, where B's daemon attaches (a daemon
    /// needs an interface). Not the sync link: between two machines, A's stream leaves with
    /// segmentation offload and B's packet processing runs on B's CPU. On veth, a native XDP
    /// program on one end turns segmentation offload off on the other, so B's program on the
    /// sync link would make A segment its stream in software and run B's receive path (its
    /// XDP program included) for every segment in A's sending context.
    pub const HOLD_IF: [&'static str; 2] = ["hold0", "hold1"];
    pub const SYNC_PORT: u16 = 7946;

    pub fn sync_addr(node: Node) -> Ipv4Addr {
        Ipv4Addr::new(10, 201, 0, node.host())
    }

    pub fn sync_listen(node: Node) -> SocketAddr {
        SocketAddr::from((Self::sync_addr(node), Self::SYNC_PORT))
    }

    /// Adds node B's namespace and the sync link to `lb`.
    pub fn add_to(lb: &mut LbTopology) -> Result<(), NetnsError> {
        lb.topo.add_ns(Self::PEER)?;
        lb.topo.veth(
            VethEnd::new(LbTopology::FP, Self::SYNC_IF)
                .addr(&format!("{}/24", Self::sync_addr(Node::A))),
            VethEnd::new(Self::PEER, Self::SYNC_IF)
                .addr(&format!("{}/24", Self::sync_addr(Node::B))),
        )?;
        lb.topo.veth(
            VethEnd::new(Self::PEER, Self::HOLD_IF[0]),
            VethEnd::new(Self::PEER, Self::HOLD_IF[1]),
        )
    }

    /// The namespace node `node` runs in.
    pub fn ns(lb: &LbTopology, node: Node) -> &Netns {
        match node {
            Node::A => lb.fp(),
            Node::B => lb.topo.ns(Self::PEER),
        }
    }

    /// `node`'s `[ha]` tables on the sync link; its certificate must name its
    /// [`Node::server_name`].
    pub fn ha_toml(node: Node, tls: &NodeTls) -> String {
        ha_toml(
            node,
            Self::sync_listen(node),
            Self::sync_listen(node.other()),
            tls,
        )
    }

    /// Node B's daemon config without services or `[ha]`: attached to its spare link
    /// ([`Self::HOLD_IF`]; it balances nothing, it holds A's connections).
    pub fn peer_config(pin_dir: &Path) -> DaemonConfig {
        DaemonConfig::new(pin_dir).interface(Self::HOLD_IF[0])
    }
}

/// hping3 in `client`: `count` SYNs to `vip`:`port` from random source addresses, `gap_us`
/// microseconds apart (1: as fast as hping3 sends with a count), quiet. Through a load
/// balancer each is a new connection: an entry and its alias.
pub fn syn_burst(
    client: &Netns,
    vip: Ipv4Addr,
    port: u16,
    count: u32,
    gap_us: u32,
) -> Result<Spawned, NetnsError> {
    client.spawn(&[
        "hping3",
        "-q",
        "-S",
        "-p",
        &port.to_string(),
        "--rand-source",
        "-c",
        &count.to_string(),
        "-i",
        &format!("u{gap_us}"),
        &vip.to_string(),
    ])
}

/// Why a pair did not get where a test or benchmark waited for it to be.
#[derive(Debug, thiserror::Error)]
pub enum PairError {
    #[error("{what}: not in sync after {timeout:?}: {reason}\nha status:\n{status}\nlog:\n{log}")]
    NotInSync {
        what: String,
        timeout: Duration,
        reason: String,
        status: String,
        log: String,
    },
    #[error("`fastpath ha status -o json` failed or printed no JSON: {detail}")]
    Status { detail: String },
    #[error("reading the conntrack table under {}: {source}", pin_dir.display())]
    Table {
        pin_dir: PathBuf,
        #[source]
        source: Box<DatapathError>,
    },
    #[error("walking the conntrack table under {}: {source}", pin_dir.display())]
    Walk {
        pin_dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// `detail`: both nodes' `ha status` and logs.
    #[error(
        "{what}: after {timeout:?} B does not hold A's load-balanced entries: {diff}\n{detail}"
    )]
    TablesDiffer {
        what: String,
        timeout: Duration,
        diff: Box<LbTableDiff>,
        detail: String,
    },
}

/// `node`'s `ha status -o json`.
pub fn ha_status(node: &Daemon) -> Result<serde_json::Value, PairError> {
    let out = node.cli(&["ha", "status", "-o", "json"]);
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(PairError::Status {
            detail: format!("{}: {}", out.status, String::from_utf8_lossy(&out.stderr)),
        });
    }
    serde_json::from_str(&text).map_err(|e| PairError::Status {
        detail: format!("{e}: {text}"),
    })
}

/// Waits until `node`'s `ha status --check` passes (it holds every peer's snapshot);
/// returns how long that took.
pub fn wait_in_sync(node: &Daemon, what: &str, timeout: Duration) -> Result<Duration, PairError> {
    let start = Instant::now();
    loop {
        let out = node.cli(&["ha", "status", "--check"]);
        if out.status.success() {
            return Ok(start.elapsed());
        }
        if start.elapsed() >= timeout {
            return Err(PairError::NotInSync {
                what: what.into(),
                timeout,
                reason: String::from_utf8_lossy(&out.stderr).trim().into(),
                status: String::from_utf8_lossy(&node.cli(&["ha", "status"]).stdout).into(),
                log: node.log(),
            });
        }
        thread::sleep(Duration::from_millis(100));
    }
}

/// The load-balanced entries (connections and their aliases) of one table with one origin,
/// as comparable text: key, TCP state, flags and NAT binding — what a takeover needs.
#[derive(Clone, Debug, Default)]
pub struct LbEntries {
    pub entries: BTreeSet<String>,
    /// Of them, the connections' own entries (`CT_F_LB`; the rest are their aliases).
    pub connections: usize,
}

/// The load-balanced entries of the table pinned under `pin_dir` whose origin is `origin`
/// (0: the node's own; a peer's node id: replicated from it).
pub fn lb_entries(pin_dir: &Path, origin: u32) -> Result<LbEntries, PairError> {
    let table = CtTable::open_pin(&pin_dir.join("maps").join(map_names::CT)).map_err(|source| {
        PairError::Table {
            pin_dir: pin_dir.to_owned(),
            source: Box::new(source),
        }
    })?;
    let mut out = LbEntries::default();
    table
        .walk(|keys, entries| {
            for (k, e) in keys.iter().zip(entries) {
                if e.origin == origin && e.flags & (CT_F_LB | CT_F_LB_ALIAS) != 0 {
                    out.connections += usize::from(e.flags & CT_F_LB != 0);
                    out.entries.insert(format!(
                        "{k:?} state={} flags={:#x} nat={:?}",
                        e.state, e.flags, e.nat
                    ));
                }
            }
        })
        .map_err(|source| PairError::Walk {
            pin_dir: pin_dir.to_owned(),
            source,
        })?;
    Ok(out)
}

/// Node A's own load-balanced entries against those node B holds as A's.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LbTableDiff {
    /// A's entries (connections and aliases), and of them the connections.
    pub a_entries: usize,
    pub a_connections: usize,
    /// B's entries marked as A's, and of them the connections.
    pub b_entries: usize,
    pub b_connections: usize,
    /// A's entries B lacks or holds differently, and B's that A does not have.
    pub missing_on_b: usize,
    pub extra_on_b: usize,
    /// Up to three of each, for messages.
    pub missing_examples: Vec<String>,
    pub extra_examples: Vec<String>,
}

impl LbTableDiff {
    /// B holds exactly A's entries.
    pub fn agree(&self) -> bool {
        self.missing_on_b == 0 && self.extra_on_b == 0
    }
}

impl std::fmt::Display for LbTableDiff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "A {} entries ({} connections), B {} ({} connections); {} missing on B (e.g. {:?}), {} extra on B (e.g. {:?})",
            self.a_entries,
            self.a_connections,
            self.b_entries,
            self.b_connections,
            self.missing_on_b,
            self.missing_examples,
            self.extra_on_b,
            self.extra_examples
        )
    }
}

/// Compares A's own load-balanced entries (under `a_pins`) with the entries B (under
/// `b_pins`) holds as A's (origin `a_id`), entry for entry.
pub fn compare_lb_entries(
    a_pins: &Path,
    b_pins: &Path,
    a_id: u32,
) -> Result<LbTableDiff, PairError> {
    let (a, b) = (lb_entries(a_pins, 0)?, lb_entries(b_pins, a_id)?);
    let missing = || a.entries.difference(&b.entries);
    let extra = || b.entries.difference(&a.entries);
    Ok(LbTableDiff {
        a_entries: a.entries.len(),
        a_connections: a.connections,
        b_entries: b.entries.len(),
        b_connections: b.connections,
        missing_on_b: missing().count(),
        extra_on_b: extra().count(),
        missing_examples: missing().take(3).cloned().collect(),
        extra_examples: extra().take(3).cloned().collect(),
    })
}

/// Waits until B holds exactly A's load-balanced entries (A's node id: [`Node::A`]'s, as
/// [`SyncPair::ha_toml`] configures it); returns the agreeing comparison.
pub fn wait_tables_agree(
    a: &Daemon,
    b: &Daemon,
    what: &str,
    timeout: Duration,
) -> Result<LbTableDiff, PairError> {
    let start = Instant::now();
    loop {
        let diff = compare_lb_entries(a.pin_dir(), b.pin_dir(), Node::A.node_id())?;
        if diff.agree() {
            return Ok(diff);
        }
        if start.elapsed() >= timeout {
            let status =
                |d: &Daemon| String::from_utf8_lossy(&d.cli(&["ha", "status"]).stdout).into_owned();
            return Err(PairError::TablesDiffer {
                what: what.into(),
                timeout,
                diff: Box::new(diff),
                detail: format!(
                    "A: {}\nB: {}\nA's log:\n{}\nB's log:\n{}",
                    status(a),
                    status(b),
                    a.log(),
                    b.log()
                ),
            });
        }
        thread::sleep(Duration::from_millis(300));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_keepalived_examples_are_the_rendered_ones() {
        for (node, shipped) in [
            (
                Node::A,
                include_str!("../../../config/keepalived/keepalived-a.conf"),
            ),
            (
                Node::B,
                include_str!("../../../config/keepalived/keepalived-b.conf"),
            ),
        ] {
            let rendered = KeepalivedConfig::example(node).render();
            let file = format!(
                "{}/../config/keepalived/keepalived-{}.conf",
                env!("CARGO_MANIFEST_DIR"),
                node.server_name().trim_start_matches("fastpath-")
            );
            if std::env::var_os("FASTPATH_BLESS").is_some() {
                fs::write(&file, &rendered).unwrap_or_else(|e| panic!("writing {file}: {e}"));
                continue;
            }
            assert!(
                rendered == shipped,
                "{file} differs from what the tests run (FASTPATH_BLESS=1 rewrites it); it \
                 should be:\n{rendered}"
            );
        }
    }

    #[test]
    fn an_unsynced_node_drops_below_its_synced_peer() {
        let (a, b) = (Node::A.priority() as i32, Node::B.priority() as i32);
        assert!(a > b, "A wins the first election");
        assert!(a + TRACK_WEIGHT < b, "A out of sync is below B in sync");
        assert!(b + TRACK_WEIGHT > 0, "a priority stays valid");
    }
}
