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

use std::{
    fs,
    net::{Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    thread,
    time::{Duration, Instant},
};

use super::netns::{DaemonConfig, Netns, NetnsError, Spawned, TempDir, Topology, VethEnd};

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
        format!(
            "[ha]\nnode_id = {}\nlisten = \"{}\"\ntls_cert = {:?}\ntls_key = {:?}\ntls_ca = {:?}\n\
             [[ha.peers]]\naddress = \"{}\"\nserver_name = \"{}\"\n",
            node.node_id(),
            Self::sync_listen(node),
            cert.display().to_string(),
            key.display().to_string(),
            ca.display().to_string(),
            Self::sync_listen(node.other()),
            node.other().server_name()
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
    /// readiness command of its `track_script` (`fastpath --socket S ha status --check`), or
    /// none. Waits until it runs its VRRP child.
    pub fn start_keepalived(&mut self, node: Node, track: Option<String>) {
        assert!(
            self.keepalived[node.index()].is_none(),
            "keepalived already runs on {node:?}"
        );
        let config = KeepalivedConfig::for_node(node, track);
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
/// Each LB node forwards (`ip_forward`), may bind the VIP it does not hold yet
/// (`ip_nonlocal_bind`) and accepts packets from its own addresses (`accept_local`: the
/// full-NAT source is the node's gateway address); the switches are plain bridges (no STP,
/// so ports forward at once).
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
    for n in Node::BOTH {
        let ns = topo.ns(n.role());
        ns.sysctl("net.ipv4.ip_forward", "1")?;
        ns.sysctl("net.ipv4.ip_nonlocal_bind", "1")?;
        for dev in ["all", "default", HaTopology::FRONT_IF, HaTopology::BACK_IF] {
            ns.sysctl(&format!("net.ipv4.conf.{dev}.accept_local"), "1")?;
        }
    }
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
            notify: None,
        }
    }

    /// The shipped example for `node` (`config/keepalived/keepalived-{a,b}.conf`):
    /// documentation addresses, eth0 in front, eth1 behind, fastpath installed as the unit
    /// file installs it.
    pub fn example(node: Node) -> KeepalivedConfig {
        KeepalivedConfig {
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
                    "/usr/local/bin/fastpath --socket /run/fastpath/fastpath.sock ha status --check"
                        .into(),
                ),
            )
        }
    }

    pub fn render(&self) -> String {
        let mut s = format!(
            "# fastpath HA pair: node {router_id}. Rendered by\n\
             # fastpath::testkit::ha::KeepalivedConfig (the failover tests run the same text);\n\
             # see README.md beside this file.\n\
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
        if let Some(t) = &self.track {
            s += &format!(
                "\n\
                 # Readiness: exit 0 while this node holds its peer's connections (in sync).\n\
                 # A weight, not a fault: a standby out of sync must not take the VIP from a\n\
                 # healthy master (it drops below it), but must still take over when the\n\
                 # master is dead (no adverts: it becomes master whatever its priority).\n\
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
        if self.track.is_some() {
            s += "    track_script {\n        fastpath_in_sync\n    }\n";
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
