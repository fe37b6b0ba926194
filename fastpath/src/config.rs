//! The daemon's TOML configuration: parsing, defaults and validation.
//!
//! Contract: [`Config::load`] either returns a configuration that the datapath can apply as a
//! whole, or an error naming the file, line, key and what to do. It never touches the kernel
//! beyond read-only lookups (interface names).

use std::{
    fmt,
    ops::Range,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};
use toml::Spanned;

/// Backends one service may have.
pub const MAX_BACKENDS_PER_SERVICE: usize = 4096;

/// Default bpffs directory for pinned maps and links.
pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/fastpath";

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub datapath: DatapathSection,
    #[serde(default)]
    pub conntrack: ConntrackSection,
    /// Interfaces the datapath attaches to (`[[interface]]` tables).
    #[serde(default, rename = "interface")]
    pub interfaces: Vec<InterfaceConfig>,
    /// Load-balanced services (`[[service]]` tables), followed, once loaded, by one
    /// single-backend service per port forward.
    #[serde(default, rename = "service")]
    pub services: Vec<ServiceConfig>,
    /// Static DNAT port forwards (`[[port_forward]]` tables).
    #[serde(default, rename = "port_forward")]
    pub port_forwards: Vec<PortForward>,
    /// The management API and metrics listeners (`[api]`).
    #[serde(default)]
    pub api: ApiSection,
    /// Conntrack replication between HA peers (`[ha]`); off when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ha: Option<HaSection>,
    /// Route announcements through a routing daemon (`[announce]`); off when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub announce: Option<AnnounceSection>,
}

/// `[announce]`: the prefixes this node asks a routing daemon (BIRD, FRR) to announce while it
/// is ready to carry them, published as routes in a kernel table the daemon learns from.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AnnounceSection {
    /// The kernel routing table the routes go in (1 ..= 4294967295, not 253, 254 or 255:
    /// default, main and local). No policy rule should point at it: its routes are
    /// blackholes, there only to be learned.
    pub table: Spanned<u32>,
    /// Prefixes announced beside the services' VIPs while the node is ready (this node's
    /// full-NAT source prefix, for one), whatever the backends' health.
    #[serde(default)]
    pub prefixes: Vec<Spanned<ipnet::IpNet>>,
    /// Other nodes' prefixes this node announces at a lower preference while it is ready
    /// (their full-NAT source prefixes: when one of them dies, the routers send its
    /// connections' replies here, and this node translates them from the replicated state).
    /// Their routes have metric [`crate::announce::BACKUP_METRIC`], which the routing daemon
    /// turns into a lower preference (e.g. a prepended AS path).
    #[serde(default)]
    pub backup_prefixes: Vec<Spanned<ipnet::IpNet>>,
    /// With `[ha]`: seconds to wait for peers that do not connect before announcing without
    /// their state (peers that do connect are always waited for). Default 30.
    #[serde(default = "default_sync_timeout_s")]
    pub sync_timeout_s: Spanned<u64>,
}

fn default_sync_timeout_s() -> Spanned<u64> {
    Spanned::new(0..0, 30)
}

/// `[ha]`: this node's identity, its sync listener, its peers and the mutual-TLS material.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct HaSection {
    /// This node's id, unique among the peers (1 ..= 4294967295). Entries replicated from
    /// a node are marked with its id.
    pub node_id: Spanned<u32>,
    /// Where peers connect to stream their changes to this node (`"ADDR:PORT"`).
    pub listen: Spanned<std::net::SocketAddr>,
    /// PEM certificate chain this node presents, as server and as client.
    pub tls_cert: Spanned<PathBuf>,
    /// PEM private key of `tls_cert`.
    pub tls_key: Spanned<PathBuf>,
    /// PEM CA certificates: a peer must present a certificate they signed, both ways.
    pub tls_ca: Spanned<PathBuf>,
    /// Changes kept per peer until it acknowledges them; a peer further behind resyncs
    /// with a snapshot. Default 1048576.
    #[serde(default = "default_ha_queue")]
    pub queue: Spanned<u32>,
    /// The peers this node replicates its connections to (`[[ha.peers]]`).
    #[serde(default)]
    pub peers: Vec<HaPeer>,
}

/// `[[ha.peers]]`: one peer's sync listener.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct HaPeer {
    pub address: Spanned<std::net::SocketAddr>,
    /// The peer's own `ha.node_id`. Its streams into this node must carry this id and come
    /// with its certificate (valid for `server_name`): a peer cannot send connections as
    /// another node.
    pub node_id: Spanned<u32>,
    /// The name its certificate carries; default: the address's IP (an IP SAN).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server_name: Option<Spanned<String>>,
}

fn default_ha_queue() -> Spanned<u32> {
    Spanned::new(0..0, 1 << 20)
}

/// A static DNAT port forward: connections to `address:port` go to `to:to_port`, the client's
/// address kept (a NAT-mode service with one backend, without health checks).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PortForward {
    /// The address clients connect to (typically one of this node's outside addresses).
    pub address: Spanned<std::net::IpAddr>,
    pub port: Spanned<u16>,
    /// `tcp` or `udp`. Default tcp.
    #[serde(default)]
    pub protocol: Protocol,
    /// Where the connections go.
    pub to: Spanned<std::net::IpAddr>,
    /// Default: `port`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub to_port: Option<Spanned<u16>>,
}

impl PortForward {
    /// The forward as what the datapath runs it as: a NAT service with one backend.
    pub fn to_service(&self) -> ServiceConfig {
        ServiceConfig {
            vip: self.address.clone(),
            port: self.port.clone(),
            protocol: self.protocol,
            scheduler: Scheduler::default(),
            maglev_table_size: None,
            no_backend: NoBackend::Kernel,
            affinity_timeout_s: 0,
            mode: ForwardMode::Nat,
            snat_address: None,
            snat_ports: None,
            backends: vec![BackendConfig {
                address: self.to.clone(),
                port: self.to_port.clone().unwrap_or_else(|| self.port.clone()),
                weight: default_weight(),
            }],
            health_check: None,
            port_forward: true,
        }
    }
}

/// One load-balanced service: clients connect to `vip:port`; each new connection gets a
/// backend and keeps it.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ServiceConfig {
    /// IPv4 or IPv6 address clients connect to.
    pub vip: Spanned<std::net::IpAddr>,
    pub port: Spanned<u16>,
    /// `tcp` or `udp`. Default tcp.
    #[serde(default)]
    pub protocol: Protocol,
    /// How a backend is chosen. Default maglev.
    #[serde(default)]
    pub scheduler: Scheduler,
    /// Maglev table size (a prime up to 131071); default: the smallest of 251, 509, 1021,
    /// ... with at least 100 slots per backend.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub maglev_table_size: Option<Spanned<u32>>,
    /// With no backend available: `kernel` (hand the packet on untranslated), `drop`, or
    /// `reject` (a TCP RST / an ICMP port unreachable back to the client).
    #[serde(default)]
    pub no_backend: NoBackend,
    /// Source-IP affinity: a client's new connections go to the backend of its last one if
    /// that was less than this many seconds ago (and the backend still takes connections).
    /// 0: off.
    #[serde(default)]
    pub affinity_timeout_s: u32,
    /// How packets reach the backends: `nat` (the destination is translated, the client's
    /// address kept: backends must route their replies through this node) or `full_nat`
    /// (the source is translated too, to `snat_address`: backends reply to this node
    /// whatever their routing, and see the load balancer's address, not the client's).
    #[serde(default)]
    pub mode: ForwardMode,
    /// Full-NAT: the source address backends see. The backends must route it to this node;
    /// it need not be assigned to an interface (if it is, the daemon sets `accept_local` on
    /// the attached interfaces, or the kernel would drop the translated packets as martians).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snat_address: Option<Spanned<std::net::IpAddr>>,
    /// Full-NAT: the source ports connections get, `"FIRST-LAST"`. Default `"1024-32767"`,
    /// clear of Linux's ephemeral ports (`net.ipv4.ip_local_port_range`, 32768-60999), so
    /// the node's own connections from the same address never collide. A port is shared by
    /// connections to different backends.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snat_ports: Option<Spanned<PortRange>>,
    #[serde(default, rename = "backend")]
    pub backends: Vec<BackendConfig>,
    /// Probing of the backends (`[service.health_check]`); none: every backend is up.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub health_check: Option<HealthCheck>,
    /// Made from a `[[port_forward]]` table (written back as one).
    #[serde(skip)]
    pub port_forward: bool,
}

/// What identifies a service: clients' destination address, port and protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceId {
    pub vip: std::net::IpAddr,
    pub port: u16,
    pub protocol: Protocol,
}

impl fmt::Display for ServiceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}",
            std::net::SocketAddr::new(self.vip, self.port),
            self.protocol.name()
        )
    }
}

impl ServiceConfig {
    pub fn id(&self) -> ServiceId {
        ServiceId {
            vip: *self.vip.get_ref(),
            port: *self.port.get_ref(),
            protocol: self.protocol,
        }
    }
}

/// How the daemon probes a service's backends. A backend goes down after `fall` failed
/// probes in a row (no new connections; existing ones keep it) and up again after `rise`
/// good ones.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct HealthCheck {
    /// `tcp` (a connect) or `http` (GET `path`, expecting `expect_status`).
    pub kind: Spanned<HealthKind>,
    #[serde(default = "default_interval_ms")]
    pub interval_ms: Spanned<u64>,
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: Spanned<u64>,
    #[serde(default = "default_rise")]
    pub rise: Spanned<u32>,
    #[serde(default = "default_fall")]
    pub fall: Spanned<u32>,
    /// Probe this port instead of the backend's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    #[serde(default = "default_path")]
    pub path: String,
    #[serde(default = "default_status")]
    pub expect_status: u16,
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum HealthKind {
    Tcp,
    Http,
}

pub(crate) fn default_interval_ms() -> Spanned<u64> {
    Spanned::new(0..0, 1000)
}
pub(crate) fn default_timeout_ms() -> Spanned<u64> {
    Spanned::new(0..0, 500)
}
pub(crate) fn default_rise() -> Spanned<u32> {
    Spanned::new(0..0, 2)
}
pub(crate) fn default_fall() -> Spanned<u32> {
    Spanned::new(0..0, 3)
}
pub(crate) fn default_path() -> String {
    "/".into()
}
pub(crate) fn default_status() -> u16 {
    200
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BackendConfig {
    pub address: Spanned<std::net::IpAddr>,
    pub port: Spanned<u16>,
    /// Relative share of new connections, 0 (drain: no new connections) ..= 65535. Default 1.
    #[serde(default = "default_weight")]
    pub weight: Spanned<u32>,
}

pub(crate) fn default_weight() -> Spanned<u32> {
    Spanned::new(0..0, 1)
}

#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
#[derive(Hash, PartialOrd, Ord)]
pub enum Protocol {
    #[default]
    Tcp,
    Udp,
}

impl Protocol {
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
        }
    }

    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => 6,
            Protocol::Udp => 17,
        }
    }
}

#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Scheduler {
    /// Maglev consistent hashing of the connection's addresses and ports.
    #[default]
    Maglev,
    /// Weighted round robin: new connections take the backends in turn, each as often as its
    /// weight says (smoothly interleaved).
    Wrr,
    /// Weighted least connections: the enabled backend with the fewest active connections per
    /// unit of weight (at most 64 backends).
    #[serde(rename = "least_connections")]
    LeastConnections,
}

/// How a service's packets reach its backends.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ForwardMode {
    /// Destination NAT: the backend sees the client's address.
    #[default]
    Nat,
    /// Destination and source NAT: the backend sees `snat_address`.
    FullNat,
    /// Direct server return at L2: only the MAC addresses change; the backend holds the VIP
    /// and replies to the client directly.
    Dsr,
}

/// An inclusive range of ports, written `"FIRST-LAST"` (or one port).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub struct PortRange {
    pub first: u16,
    pub last: u16,
}

impl PortRange {
    /// The full-NAT default (see `ServiceConfig::snat_ports`).
    pub const DEFAULT_SNAT: PortRange = PortRange {
        first: 1024,
        last: 32767,
    };
}

impl TryFrom<String> for PortRange {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        let bad = || {
            format!("{s:?} is not a port range; write it as \"FIRST-LAST\", e.g. \"1024-32767\"")
        };
        let (a, b) = s.split_once('-').unwrap_or((&s, &s));
        let first: u16 = a.trim().parse().map_err(|_| bad())?;
        let last: u16 = b.trim().parse().map_err(|_| bad())?;
        if first == 0 || first > last {
            return Err(format!(
                "{s:?}: give FIRST-LAST with 1 <= FIRST <= LAST <= 65535"
            ));
        }
        Ok(PortRange { first, last })
    }
}

impl Serialize for PortRange {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.first, self.last)
    }
}

#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum NoBackend {
    #[default]
    Kernel,
    Drop,
    /// Answer: a TCP RST, or an ICMP/ICMPv6 port unreachable for UDP.
    Reject,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DatapathSection {
    /// Where maps (`maps/`) and links (`links/`) are pinned. Default `/sys/fs/bpf/fastpath`.
    /// Must be on a bpffs; `/sys/fs/bpf` is mounted if it is not yet.
    #[serde(default = "default_pin_dir")]
    pub pin_dir: Spanned<PathBuf>,
    /// Drop malformed packets (counted with their reason) instead of handing them to the
    /// kernel. Default false: the kernel sees them and keeps its own counters.
    #[serde(default)]
    pub drop_malformed: bool,
    /// Detach programs and remove pins on a clean stop (SIGINT/SIGTERM). Default true; false
    /// leaves the datapath running without a daemon (as after a crash).
    #[serde(default = "default_true")]
    pub detach_on_exit: bool,
    /// How TC programs attach: `auto` (default), `tcx` or `netlink`.
    #[serde(default)]
    pub tc_attach: TcAttachMode,
}

impl Default for DatapathSection {
    fn default() -> Self {
        DatapathSection {
            pin_dir: default_pin_dir(),
            drop_malformed: false,
            detach_on_exit: true,
            tc_attach: TcAttachMode::Auto,
        }
    }
}

/// How TC programs attach to their interfaces.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum TcAttachMode {
    /// TCX links where the kernel has them (Linux 6.6), probed at start; else netlink.
    #[default]
    Auto,
    /// TCX links only: the start fails on a kernel without them.
    Tcx,
    /// A clsact qdisc and a cls_bpf filter (direct action), as `tc filter add ... bpf da`
    /// makes: every kernel, beside other tools' filters on the same qdisc.
    Netlink,
}

fn default_pin_dir() -> Spanned<PathBuf> {
    Spanned::new(0..0, PathBuf::from(DEFAULT_PIN_DIR))
}

fn default_true() -> bool {
    true
}

/// XDP attachment mode.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum XdpMode {
    /// Native (driver) mode, falling back to generic (skb) mode with a warning. Default.
    #[default]
    Auto,
    /// Native only: fail if the driver has no XDP support.
    Native,
    /// Generic (skb) mode only.
    Generic,
    /// No XDP program on this interface.
    Off,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct InterfaceConfig {
    /// Interface name in the daemon's network namespace.
    pub name: Spanned<String>,
    /// XDP mode. Default `auto`.
    #[serde(default)]
    pub xdp: XdpMode,
    /// Attach the TC program at TCX ingress. Default false.
    #[serde(default)]
    pub tc_ingress: bool,
    /// Attach the TC program at TCX egress. Default false.
    #[serde(default)]
    pub tc_egress: bool,
    /// Track connections arriving on this interface (at XDP if attached, else at TC
    /// ingress). Default true.
    #[serde(default = "default_true")]
    pub conntrack: bool,
    /// Drop, at the tracking ingress hook, what belongs to no connection and cannot start one,
    /// TCP invalid for its state, unrelated ICMP errors, and new connections a full table
    /// cannot take. Default false.
    #[serde(default)]
    pub stateful_firewall: bool,
    /// Gateway SNAT (masquerade): connections forwarded out of this interface get their
    /// source translated to `snat_addresses` (default: the interface's own first global IPv4
    /// and IPv6 addresses, read at start) and a port of `snat_ports`. Default false.
    #[serde(default)]
    pub snat: bool,
    /// The source addresses for `snat`, at most one per family.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snat_addresses: Option<Spanned<Vec<std::net::IpAddr>>>,
    /// The source ports for `snat`, `"FIRST-LAST"`. Default `"1024-32767"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snat_ports: Option<Spanned<PortRange>>,
    /// Route in the fast path: IPv4/IPv6 packets sent to this interface's MAC address whose
    /// route (the kernel's FIB, neighbour resolved) leaves through another interface with
    /// `route = true` are forwarded at the arriving hook (XDP if attached, else TC ingress),
    /// TTL decremented. Everything else goes to the kernel. Forwarded packets skip
    /// netfilter's FORWARD hook. Default false.
    #[serde(default)]
    pub route: bool,
    /// An 802.1Q port of this VLAN id (1-4094), without a VLAN device: frames arriving
    /// tagged with it are untagged at the ingress hook (XDP if attached, else TC ingress)
    /// before anything else sees them, whatever their priority bits; anything else arriving
    /// (untagged, another VLAN, an 802.1ad outer tag) is dropped (reason vlan_not_member).
    /// Frames leaving get the tag, priority 0: at TC egress (so it needs tc_egress = true), or
    /// before the fast path redirects them out of the port. Default none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vlan: Option<Spanned<u16>>,
    /// This interface is a kernel vxlan device (no TC egress), and the fast
    /// path accelerates its overlay: packets routed to it (from interfaces with
    /// `route = true`) are encapsulated at XDP with the outer headers learned from the
    /// device's own packets and sent out of the underlay directly; the network's packets
    /// arriving on the underlay are decapsulated at XDP and their inner packet routed. With
    /// `xdp = "generic"` (conntrack on), the kernel decapsulates the network's packets and
    /// the device's XDP hook tracks, load-balances and routes the inner packets.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vxlan: Option<VxlanPort>,
}

/// `vxlan = { ... }` of an `[[interface]]`: the device's network, as it was created
/// (`ip link add NAME type vxlan id VNI local LOCAL dstport PORT dev UNDERLAY`).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct VxlanPort {
    /// The VXLAN network identifier, 1-16777215.
    pub vni: Spanned<u32>,
    /// This VTEP's address on the underlay (IPv4 or IPv6): the outer source of what the
    /// device sends, the outer destination of what it receives.
    pub local: Spanned<std::net::IpAddr>,
    /// The UDP destination port. Default 4789.
    #[serde(default = "default_vxlan_port")]
    pub port: u16,
    /// The `[[interface]]` the device's packets leave and arrive on: it needs XDP (where
    /// arriving packets are decapsulated) and `tc_egress = true` (where the device's packets
    /// teach the fast path their outer headers).
    pub underlay: Spanned<String>,
}

fn default_vxlan_port() -> u16 {
    4789
}

/// The management API's listeners and where its changes persist (`[api]`).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ApiSection {
    /// The gRPC API's Unix socket (mode 0600, root only). Default
    /// `/run/fastpath/NAME.sock`, NAME the last component of `datapath.pin_dir`
    /// (`/run/fastpath/fastpath.sock` by default).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub socket: Option<Spanned<PathBuf>>,
    /// Where changes made through the API are kept across restarts. Default
    /// `/var/lib/fastpath/NAME.state.toml`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state_file: Option<Spanned<PathBuf>>,
    /// Also serve the API on this TCP address (`"ADDR:PORT"`), with TLS and client
    /// certificates (`tls_cert`, `tls_key`, `tls_client_ca`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<Spanned<std::net::SocketAddr>>,
    /// PEM server certificate chain for `listen`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_cert: Option<Spanned<PathBuf>>,
    /// PEM private key of `tls_cert`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_key: Option<Spanned<PathBuf>>,
    /// PEM CA certificates; a client must present a certificate they signed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_client_ca: Option<Spanned<PathBuf>>,
    /// Serve `listen` as plain TCP without authentication: anyone who reaches the port
    /// controls the datapath. Default false (refused).
    #[serde(default)]
    pub allow_insecure_tcp: bool,
    /// Serve Prometheus metrics over HTTP at `http://ADDR:PORT/metrics`. Default: off.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_listen: Option<Spanned<std::net::SocketAddr>>,
}

/// Default directory of the API sockets.
pub const DEFAULT_SOCKET_DIR: &str = "/run/fastpath";
/// Default directory of the API state files.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/fastpath";

/// The default API socket of the datapath pinned at `pin_dir`.
pub fn default_socket(pin_dir: &Path) -> PathBuf {
    Path::new(DEFAULT_SOCKET_DIR).join(format!("{}.sock", instance_name(pin_dir)))
}

/// The default API state file of the datapath pinned at `pin_dir`.
pub fn default_state_file(pin_dir: &Path) -> PathBuf {
    Path::new(DEFAULT_STATE_DIR).join(format!("{}.state.toml", instance_name(pin_dir)))
}

fn instance_name(pin_dir: &Path) -> String {
    pin_dir
        .file_name()
        .map_or_else(|| "fastpath".into(), |n| n.to_string_lossy().into_owned())
}

/// Default conntrack table size: 1 Mi connections, like a mid-size Linux box's
/// nf_conntrack_max.
pub const DEFAULT_CT_CAPACITY: u32 = 1 << 20;

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ConntrackSection {
    /// Maximum tracked connections. Default 1048576. The table is preallocated at start (256
    /// bytes per entry); a restart with another value migrates the pinned table.
    #[serde(default = "default_ct_capacity")]
    pub capacity: Spanned<u32>,
    /// How often the daemon expires idle connections, in milliseconds. Default 1000: an idle
    /// connection goes at most this long after its timeout.
    #[serde(default = "default_gc_interval_ms")]
    pub gc_interval_ms: Spanned<u64>,
    /// Idle timeouts per state, in seconds; defaults as Linux's nf_conntrack.
    #[serde(default)]
    pub timeouts: CtTimeouts,
}

impl Default for ConntrackSection {
    fn default() -> Self {
        ConntrackSection {
            capacity: default_ct_capacity(),
            gc_interval_ms: default_gc_interval_ms(),
            timeouts: CtTimeouts::default(),
        }
    }
}

fn default_gc_interval_ms() -> Spanned<u64> {
    Spanned::new(0..0, 1000)
}

/// Idle timeouts in seconds (`[conntrack.timeouts]`), named like Linux's
/// `nf_conntrack_*_timeout*` sysctls; every default is Linux's.
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct CtTimeouts {
    pub tcp_syn_sent: u32,
    pub tcp_syn_recv: u32,
    pub tcp_established: u32,
    pub tcp_fin_wait: u32,
    pub tcp_close_wait: u32,
    pub tcp_last_ack: u32,
    pub tcp_time_wait: u32,
    pub tcp_close: u32,
    /// UDP before a reply is seen.
    pub udp: u32,
    /// UDP once replied (assured).
    pub udp_stream: u32,
    /// ICMP and ICMPv6 echo.
    pub icmp: u32,
    /// Cap for an ESTABLISHED TCP connection picked up mid-stream that has not seen a reply.
    pub tcp_unacknowledged: u32,
}

impl Default for CtTimeouts {
    fn default() -> Self {
        use fastpath_common::ct::{DEFAULT_TIMEOUTS_S as D, tcp_state as s, timeout_slot};
        CtTimeouts {
            tcp_syn_sent: D[s::SYN_SENT as usize],
            tcp_syn_recv: D[s::SYN_RECV as usize],
            tcp_established: D[s::ESTABLISHED as usize],
            tcp_fin_wait: D[s::FIN_WAIT as usize],
            tcp_close_wait: D[s::CLOSE_WAIT as usize],
            tcp_last_ack: D[s::LAST_ACK as usize],
            tcp_time_wait: D[s::TIME_WAIT as usize],
            tcp_close: D[s::CLOSE as usize],
            udp: D[timeout_slot::UDP],
            udp_stream: D[timeout_slot::UDP_STREAM],
            icmp: D[timeout_slot::ICMP],
            tcp_unacknowledged: D[timeout_slot::TCP_UNACKNOWLEDGED],
        }
    }
}

impl CtTimeouts {
    /// The `DatapathConfig::ct_timeouts_s` layout (SYN_SENT2 shares SYN_SENT's timeout).
    pub fn to_slots(&self) -> [u32; fastpath_common::ct::timeout_slot::COUNT] {
        [
            0,
            self.tcp_syn_sent,
            self.tcp_syn_recv,
            self.tcp_established,
            self.tcp_fin_wait,
            self.tcp_close_wait,
            self.tcp_last_ack,
            self.tcp_time_wait,
            self.tcp_close,
            self.tcp_syn_sent,
            self.udp,
            self.udp_stream,
            self.icmp,
            self.tcp_unacknowledged,
        ]
    }
}

fn default_ct_capacity() -> Spanned<u32> {
    Spanned::new(0..0, DEFAULT_CT_CAPACITY)
}

/// Whether validation requires the named interfaces to exist in this network namespace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InterfaceCheck {
    MustExist,
    Skip,
}

/// A configuration problem, located in the file.
#[derive(Debug, thiserror::Error)]
pub struct ConfigError {
    pub path: PathBuf,
    /// 1-based line, when known.
    pub line: Option<usize>,
    /// Dotted key, when known (e.g. `interface[1].name`).
    pub key: Option<String>,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.path.display())?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
        }
        if let Some(key) = &self.key {
            write!(f, ": key `{key}`")?;
        }
        write!(f, ": {}", self.message)
    }
}

impl Config {
    /// Whether the datapath translates packets that the kernel then forwards — any service,
    /// port forward or gateway SNAT — and if so, whether IPv6 ones too (see
    /// `datapath::prepare_forwarding`).
    pub fn translates(&self) -> Option<bool> {
        let snat = self.interfaces.iter().filter(|i| i.snat);
        if self.services.is_empty() && snat.clone().next().is_none() {
            return None;
        }
        let v6_service = self.services.iter().any(|s| s.vip.get_ref().is_ipv6());
        let v6_snat = snat.clone().any(|i| match &i.snat_addresses {
            Some(a) => a.get_ref().iter().any(|a| a.is_ipv6()),
            None => default_snat_addresses(i.name.get_ref())
                .is_ok_and(|a| a.iter().any(|a| a.is_ipv6())),
        });
        Some(v6_service || v6_snat)
    }

    /// The API's Unix socket.
    pub fn api_socket(&self) -> PathBuf {
        self.api.socket.as_ref().map_or_else(
            || default_socket(self.datapath.pin_dir.get_ref()),
            |s| s.get_ref().clone(),
        )
    }

    /// Where API changes persist.
    pub fn state_file(&self) -> PathBuf {
        self.api.state_file.as_ref().map_or_else(
            || default_state_file(self.datapath.pin_dir.get_ref()),
            |s| s.get_ref().clone(),
        )
    }

    /// A fingerprint of the whole config (FNV-1a of its TOML form): tells whether a config
    /// file changed since API changes were made on top of it.
    pub fn fingerprint(&self) -> u64 {
        let text = self.to_toml().unwrap_or_default();
        text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
    }

    /// This config as TOML, port forwards written back as `[[port_forward]]` tables: what
    /// [`Config::parse`] reads back into an equal config.
    pub fn to_toml(&self) -> Result<String, toml::ser::Error> {
        let mut c = self.clone();
        let only = ServicesOnly::of(&self.services);
        c.services = only.service;
        c.port_forwards = only.port_forward;
        toml::to_string(&c)
    }

    /// The `[api]` checks: plain TCP only when explicitly allowed, TLS material complete and
    /// readable, the socket an absolute path.
    fn validate_ha(
        &self,
        err: &dyn Fn(Range<usize>, String, String) -> ConfigError,
        files_here: bool,
    ) -> Result<(), ConfigError> {
        let Some(ha) = &self.ha else {
            return Ok(());
        };
        if *ha.node_id.get_ref() == 0 {
            return Err(err(
                ha.node_id.span(),
                "ha.node_id".into(),
                "0 is not a node id: give each node of the pair its own id, 1 ..= 4294967295"
                    .into(),
            ));
        }
        let queue = &ha.queue;
        if !(1024..=1 << 24).contains(queue.get_ref()) {
            return Err(err(
                queue.span(),
                "ha.queue".into(),
                format!(
                    "{} is out of range: use 1024 ..= 16777216 changes",
                    queue.get_ref()
                ),
            ));
        }
        if ha.peers.is_empty() {
            return Err(err(
                ha.listen.span(),
                "ha.peers".into(),
                "no peers: add a [[ha.peers]] table with the address of each other node's ha.listen, or remove [ha]".into(),
            ));
        }
        let mut seen = std::collections::HashSet::new();
        let mut ids = std::collections::HashSet::new();
        for (i, p) in ha.peers.iter().enumerate() {
            let id = *p.node_id.get_ref();
            let problem = if id == 0 {
                Some("0 is not a node id: give the peer's own ha.node_id, 1 ..= 4294967295")
            } else if id == *ha.node_id.get_ref() {
                Some("this is this node's own ha.node_id: give the peer's, which must differ")
            } else if !ids.insert(id) {
                Some("two peers have this id: give each the node_id in its own [ha]")
            } else {
                None
            };
            if let Some(problem) = problem {
                return Err(err(
                    p.node_id.span(),
                    format!("ha.peers[{i}].node_id"),
                    format!("{id}: {problem}"),
                ));
            }
            let a = *p.address.get_ref();
            if a == *ha.listen.get_ref() {
                return Err(err(
                    p.address.span(),
                    format!("ha.peers[{i}].address"),
                    format!("{a} is this node's own ha.listen: list the other nodes only"),
                ));
            }
            if !seen.insert(a) {
                return Err(err(
                    p.address.span(),
                    format!("ha.peers[{i}].address"),
                    format!("{a} is listed twice"),
                ));
            }
            if let Some(n) = &p.server_name
                && n.get_ref().is_empty()
            {
                return Err(err(
                    n.span(),
                    format!("ha.peers[{i}].server_name"),
                    "empty: give the name in the peer's certificate, or remove the key to use its IP address".into(),
                ));
            }
        }
        for (k, p) in [
            ("tls_cert", &ha.tls_cert),
            ("tls_key", &ha.tls_key),
            ("tls_ca", &ha.tls_ca),
        ] {
            if files_here && let Err(e) = std::fs::metadata(p.get_ref()) {
                return Err(err(
                    p.span(),
                    format!("ha.{k}"),
                    format!(
                        "cannot read {}: {e}; peers authenticate each other with mutual TLS, so every node needs a certificate, its key and the CA",
                        p.get_ref().display()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The `[announce]` checks: a table of its own, host-free prefixes listed once.
    fn validate_announce(
        &self,
        err: &dyn Fn(Range<usize>, String, String) -> ConfigError,
    ) -> Result<(), ConfigError> {
        let Some(a) = &self.announce else {
            return Ok(());
        };
        let table = *a.table.get_ref();
        if matches!(table, 0 | 253..=255) {
            return Err(err(
                a.table.span(),
                "announce.table".into(),
                format!(
                    "{table} is not a table of its own (0 unspecified, 253 default, 254 main, 255 local): pick an unused one such as 100, and have the routing daemon learn from it"
                ),
            ));
        }
        let mut seen = std::collections::HashSet::new();
        for (key, list) in [
            ("prefixes", &a.prefixes),
            ("backup_prefixes", &a.backup_prefixes),
        ] {
            for (i, p) in list.iter().enumerate() {
                let net = *p.get_ref();
                if net != net.trunc() {
                    return Err(err(
                        p.span(),
                        format!("announce.{key}[{i}]"),
                        format!("{net} has host bits set: write {}", net.trunc()),
                    ));
                }
                if !seen.insert(net) {
                    return Err(err(
                        p.span(),
                        format!("announce.{key}[{i}]"),
                        format!(
                            "{net} is listed twice (in prefixes or backup_prefixes): a prefix is this node's own or another's, once"
                        ),
                    ));
                }
            }
        }
        let t = &a.sync_timeout_s;
        if !(1..=3600).contains(t.get_ref()) {
            return Err(err(
                t.span(),
                "announce.sync_timeout_s".into(),
                format!("{} is out of range: use 1 ..= 3600 s", t.get_ref()),
            ));
        }
        Ok(())
    }

    fn validate_api(
        &self,
        err: &dyn Fn(Range<usize>, String, String) -> ConfigError,
        files_here: bool,
    ) -> Result<(), ConfigError> {
        let api = &self.api;
        if let Some(s) = &api.socket
            && !s.get_ref().is_absolute()
        {
            return Err(err(
                s.span(),
                "api.socket".into(),
                format!("{:?} is not an absolute path", s.get_ref()),
            ));
        }
        let tls = [
            ("tls_cert", &api.tls_cert),
            ("tls_key", &api.tls_key),
            ("tls_client_ca", &api.tls_client_ca),
        ];
        let given = tls.iter().filter(|(_, v)| v.is_some()).count();
        match &api.listen {
            None => {
                if let Some((k, Some(v))) = tls.iter().find(|(_, v)| v.is_some()) {
                    return Err(err(
                        v.span(),
                        format!("api.{k}"),
                        "TLS material without api.listen: set listen = \"ADDR:PORT\" or remove it"
                            .into(),
                    ));
                }
            }
            Some(listen) => {
                if given == 0 && !api.allow_insecure_tcp {
                    return Err(err(
                        listen.span(),
                        "api.listen".into(),
                        "plain TCP without authentication is refused: anyone who reaches the port would control the datapath; give tls_cert, tls_key and tls_client_ca (client certificates are required), or set allow_insecure_tcp = true on a trusted network".into(),
                    ));
                }
                if given != 0 && given != tls.len() {
                    let (k, _) = tls
                        .iter()
                        .find(|(_, v)| v.is_none())
                        .copied()
                        .unwrap_or(tls[0]);
                    return Err(err(
                        listen.span(),
                        format!("api.{k}"),
                        format!(
                            "api.{k} is missing: TLS needs tls_cert, tls_key and tls_client_ca together"
                        ),
                    ));
                }
                for (k, v) in tls {
                    if let Some(p) = v
                        && files_here
                        && let Err(e) = std::fs::metadata(p.get_ref())
                    {
                        return Err(err(
                            p.span(),
                            format!("api.{k}"),
                            format!("cannot read {}: {e}", p.get_ref().display()),
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// Reads, parses and validates `path`.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        Config::load_with(path, InterfaceCheck::MustExist)
    }

    /// As [`Config::load`], optionally without requiring the interfaces to exist here.
    pub fn load_with(path: &Path, interfaces: InterfaceCheck) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            path: path.to_owned(),
            line: None,
            key: None,
            message: format!("cannot read the config file: {e}; check the path given to --config"),
        })?;
        Config::parse_with(path, &text, interfaces)
    }

    /// Parses and validates `text` (read from `path`, used in messages).
    pub fn parse(path: &Path, text: &str) -> Result<Config, ConfigError> {
        Config::parse_with(path, text, InterfaceCheck::MustExist)
    }

    /// As [`Config::parse`], optionally without checking that interfaces exist here (for
    /// files meant for another machine, such as the examples in `config/`).
    pub fn parse_with(
        path: &Path,
        text: &str,
        interfaces: InterfaceCheck,
    ) -> Result<Config, ConfigError> {
        let config: Config = toml::from_str(text).map_err(|e| {
            let line = e.span().map(|s| line_of(text, s.start));
            ConfigError {
                path: path.to_owned(),
                line,
                key: e.span().and_then(|s| key_at(text, s.start)),
                message: format!(
                    "{}; see config/README.md for every key",
                    e.message().trim_end()
                ),
            }
        })?;
        let mut config = config;
        config.add_port_forwards(path, text)?;
        config.validate(path, text, interfaces)?;
        Ok(config)
    }

    /// Checks the port forwards and appends each to `services` as a NAT service with one
    /// backend (the service checks then apply to them too).
    fn add_port_forwards(&mut self, path: &Path, text: &str) -> Result<(), ConfigError> {
        let err = |span: Range<usize>, key: String, message: String| ConfigError {
            path: path.to_owned(),
            line: (span.end > 0).then(|| line_of(text, span.start)),
            key: Some(key),
            message,
        };
        for (i, f) in self.port_forwards.iter().enumerate() {
            let key = |k: &str| format!("port_forward[{i}].{k}");
            let (addr, to) = (*f.address.get_ref(), *f.to.get_ref());
            if addr.is_ipv4() != to.is_ipv4() {
                return Err(err(
                    f.to.span(),
                    key("to"),
                    format!("{to} is not of {addr}'s family; no IPv4↔IPv6 translation"),
                ));
            }
            let to_port = f.to_port.as_ref().unwrap_or(&f.port);
            for (k, p) in [("port", &f.port), ("to_port", to_port)] {
                if *p.get_ref() == 0 {
                    return Err(err(p.span(), key(k), "port 0; give 1..=65535".into()));
                }
            }
            let same = |vip: &std::net::IpAddr, port: u16, proto: Protocol| {
                *vip == addr && port == *f.port.get_ref() && proto == f.protocol
            };
            if self
                .services
                .iter()
                .any(|s| same(s.vip.get_ref(), *s.port.get_ref(), s.protocol))
                || self.port_forwards[..i]
                    .iter()
                    .any(|o| same(o.address.get_ref(), *o.port.get_ref(), o.protocol))
            {
                return Err(err(
                    f.address.span(),
                    key("address"),
                    format!(
                        "{addr} port {} {} is already a service or port forward; keep one",
                        f.port.get_ref(),
                        f.protocol.name()
                    ),
                ));
            }
        }
        let forwards: Vec<ServiceConfig> = self
            .port_forwards
            .iter()
            .map(PortForward::to_service)
            .collect();
        self.services.extend(forwards);
        // From here on the services are the one list of what is forwarded.
        self.port_forwards.clear();
        Ok(())
    }

    /// Checks a whole config (as parsed from `text`, read from `path`): every value, and that
    /// the services fit the datapath. Used again on every change made through the API.
    /// `interface[i]`'s `vxlan`: a valid VNI no other device has, an underlay that is an
    /// `[[interface]]` with XDP and TC egress, and no program on the device itself.
    fn validate_vxlan(
        &self,
        err: &impl Fn(Range<usize>, String, String) -> ConfigError,
        i: usize,
        iface: &InterfaceConfig,
        vx: &VxlanPort,
    ) -> Result<(), ConfigError> {
        let name = iface.name.get_ref();
        let vni = *vx.vni.get_ref();
        if !(1..=0xff_ffff).contains(&vni) {
            return Err(err(
                vx.vni.span(),
                format!("interface[{i}].vxlan.vni"),
                format!(
                    "VNI {vni} is out of range; use 1-16777215, the id the device {name:?} was created with"
                ),
            ));
        }
        if let Some(j) = self.interfaces[..i]
            .iter()
            .position(|o| o.vxlan.as_ref().is_some_and(|o| *o.vni.get_ref() == vni))
        {
            return Err(err(
                vx.vni.span(),
                format!("interface[{i}].vxlan.vni"),
                format!(
                    "VNI {vni} is also interface[{j}]'s ({:?}); each VXLAN network has one device",
                    self.interfaces[j].name.get_ref()
                ),
            ));
        }
        let device_err = |why: String| err(iface.name.span(), format!("interface[{i}].vxlan"), why);
        if iface.tc_ingress || iface.tc_egress {
            return Err(device_err(format!(
                "interface {name:?} is a vxlan device: no TC program runs on it (the underlay decapsulates and learns, the routing interfaces encapsulate); set tc_ingress = false and tc_egress = false"
            )));
        }
        match iface.xdp {
            XdpMode::Off => {}
            XdpMode::Generic if iface.conntrack && !iface.route && !iface.snat => {}
            XdpMode::Generic => {
                return Err(device_err(format!(
                    "interface {name:?} is a vxlan device with xdp = \"generic\": its XDP hook tracks, load-balances and routes what the kernel decapsulated, so it needs conntrack on, and takes no route = true (it routes already) and no snat = true (translate where the traffic leaves); set conntrack = true and remove route and snat"
                )));
            }
            XdpMode::Auto | XdpMode::Native => {
                return Err(device_err(format!(
                    "interface {name:?} is a vxlan device, which has no native XDP: set xdp = \"off\" (the fast path decapsulates on the underlay), or xdp = \"generic\" to load-balance and NAT on the device what the kernel decapsulated (the underlay then leaves this network's packets to the kernel)"
                )));
            }
        }
        let under = vx.underlay.get_ref();
        match self.interfaces.iter().find(|o| o.name.get_ref() == under) {
            Some(u)
                if (u.xdp != XdpMode::Off || u.tc_ingress) && u.tc_egress && u.vxlan.is_none() =>
            {
                Ok(())
            }
            Some(_) => Err(err(
                vx.underlay.span(),
                format!("interface[{i}].vxlan.underlay"),
                format!(
                    "the underlay {under:?} needs XDP or, with xdp = \"off\", tc_ingress = true (arriving VXLAN is decapsulated there), and tc_egress = true (the device's packets teach the fast path their headers there); set them in its [[interface]]"
                ),
            )),
            None => Err(err(
                vx.underlay.span(),
                format!("interface[{i}].vxlan.underlay"),
                format!(
                    "the underlay {under:?} is not an [[interface]]; add one for it with XDP (or tc_ingress = true) and tc_egress = true"
                ),
            )),
        }
    }

    pub fn validate(
        &self,
        path: &Path,
        text: &str,
        interfaces: InterfaceCheck,
    ) -> Result<(), ConfigError> {
        let err = |span: Range<usize>, key: String, message: String| ConfigError {
            path: path.to_owned(),
            line: (span.end > 0).then(|| line_of(text, span.start)),
            key: Some(key),
            message,
        };
        let pin_dir = &self.datapath.pin_dir;
        if !pin_dir.get_ref().is_absolute() {
            return Err(err(
                pin_dir.span(),
                "datapath.pin_dir".into(),
                format!(
                    "{:?} is not an absolute path; use a directory on a bpffs such as {DEFAULT_PIN_DIR}",
                    pin_dir.get_ref()
                ),
            ));
        }
        self.validate_api(&err, interfaces == InterfaceCheck::MustExist)?;
        self.validate_ha(&err, interfaces == InterfaceCheck::MustExist)?;
        self.validate_announce(&err)?;
        let capacity = &self.conntrack.capacity;
        if !(1024..=1 << 26).contains(capacity.get_ref()) {
            return Err(err(
                capacity.span(),
                "conntrack.capacity".into(),
                format!(
                    "{} is out of range: use 1024 ..= 67108864 entries",
                    capacity.get_ref()
                ),
            ));
        }
        let gc = &self.conntrack.gc_interval_ms;
        if !(10..=60_000).contains(gc.get_ref()) {
            return Err(err(
                gc.span(),
                "conntrack.gc_interval_ms".into(),
                format!("{} is out of range: use 10 ..= 60000 ms", gc.get_ref()),
            ));
        }
        if self.interfaces.is_empty() {
            return Err(ConfigError {
                path: path.to_owned(),
                line: None,
                key: Some("interface".into()),
                message: "no [[interface]] table: name at least one interface to attach to".into(),
            });
        }
        for (i, iface) in self.interfaces.iter().enumerate() {
            let name = iface.name.get_ref();
            let key = format!("interface[{i}].name");
            if let Some(j) = self.interfaces[..i]
                .iter()
                .position(|o| o.name.get_ref() == name)
            {
                return Err(err(
                    iface.name.span(),
                    key,
                    format!(
                        "interface {name:?} is listed twice (also interface[{j}]); merge the two tables"
                    ),
                ));
            }
            if interfaces == InterfaceCheck::MustExist && crate::sys::ifindex(name).is_none() {
                return Err(err(
                    iface.name.span(),
                    key,
                    format!(
                        "interface {name:?} not found in this network namespace; list interfaces with `ip link`"
                    ),
                ));
            }
            if interfaces == InterfaceCheck::MustExist
                && let Ok(kind) = crate::sys::link_type(name)
                // The datapath parses Ethernet frames; loopback uses Ethernet framing.
                && kind != libc::ARPHRD_ETHER
                && kind != libc::ARPHRD_LOOPBACK
            {
                return Err(err(
                    iface.name.span(),
                    key,
                    format!(
                        "interface {name:?} is not an Ethernet device (link type {kind}); the datapath parses Ethernet frames, so attach it to the Ethernet device underneath"
                    ),
                ));
            }
            if iface.stateful_firewall
                && (!iface.conntrack || (iface.xdp == XdpMode::Off && !iface.tc_ingress))
            {
                return Err(err(
                    iface.name.span(),
                    format!("interface[{i}].stateful_firewall"),
                    format!(
                        "interface {name:?} has stateful_firewall = true but does not track arriving connections; it needs conntrack = true and an ingress hook (xdp, or tc_ingress = true)"
                    ),
                ));
            }
            if let Some(vx) = &iface.vxlan {
                self.validate_vxlan(&err, i, iface, vx)?;
            }
            if iface.route && iface.xdp == XdpMode::Off && !iface.tc_ingress {
                return Err(err(
                    iface.name.span(),
                    format!("interface[{i}].route"),
                    format!(
                        "interface {name:?} has route = true but no ingress hook; set xdp = \"auto\" (or tc_ingress = true)"
                    ),
                ));
            }
            if let Some(vlan) = &iface.vlan {
                let key = format!("interface[{i}].vlan");
                let vid = *vlan.get_ref();
                if !(1..=4094).contains(&vid) {
                    return Err(err(
                        vlan.span(),
                        key,
                        format!(
                            "VLAN id {vid} is out of range; use 1-4094 (0 means untagged and 4095 is reserved), or remove vlan for an untagged port"
                        ),
                    ));
                }
                if (iface.xdp == XdpMode::Off && !iface.tc_ingress) || !iface.tc_egress {
                    return Err(err(
                        vlan.span(),
                        key,
                        format!(
                            "interface {name:?} has vlan = {vid} but the tag is taken off at the ingress hook and put on at TC egress; set tc_egress = true and keep an ingress hook (xdp, or tc_ingress = true)"
                        ),
                    ));
                }
            }
            if !iface.snat {
                for (k, span) in [
                    (
                        "snat_addresses",
                        iface.snat_addresses.as_ref().map(|a| a.span()),
                    ),
                    ("snat_ports", iface.snat_ports.as_ref().map(|r| r.span())),
                ] {
                    if let Some(span) = span {
                        return Err(err(
                            span,
                            format!("interface[{i}].{k}"),
                            format!("{k} applies only with snat = true; set it or remove {k}"),
                        ));
                    }
                }
            } else if iface.xdp == XdpMode::Off {
                return Err(err(
                    iface.name.span(),
                    format!("interface[{i}].snat"),
                    format!(
                        "interface {name:?} has snat = true but no XDP: the replies to translated connections come back here and are translated at XDP; set xdp = \"auto\""
                    ),
                ));
            }
            if let Some(addrs) = &iface.snat_addresses {
                let list = addrs.get_ref();
                let v4 = list.iter().filter(|a| a.is_ipv4()).count();
                let bad = list.iter().find(|a| a.is_unspecified() || a.is_multicast());
                if let Some(a) = bad {
                    return Err(err(
                        addrs.span(),
                        format!("interface[{i}].snat_addresses"),
                        format!("{a} cannot be a source address; give unicast addresses"),
                    ));
                }
                if list.is_empty() || v4 > 1 || list.len() - v4 > 1 {
                    return Err(err(
                        addrs.span(),
                        format!("interface[{i}].snat_addresses"),
                        "give one or two addresses: at most one IPv4 and one IPv6".into(),
                    ));
                }
            }
            if iface.xdp == XdpMode::Off
                && !iface.tc_ingress
                && !iface.tc_egress
                && iface.vxlan.is_none()
            {
                return Err(err(
                    iface.name.span(),
                    format!("interface[{i}]"),
                    format!(
                        "interface {name:?} has xdp = \"off\" and no TC hook: nothing to attach; enable a hook or remove the table"
                    ),
                ));
            }
        }
        // Each service's first index by (VIP, port, protocol): the duplicate check in one
        // pass (100k services compared pairwise took 19 s).
        let mut first = std::collections::HashMap::with_capacity(self.services.len());
        for (i, svc) in self.services.iter().enumerate() {
            let vip = *svc.vip.get_ref();
            let key = |k: &str| format!("service[{i}].{k}");
            if vip.is_unspecified() || vip.is_multicast() {
                return Err(err(
                    svc.vip.span(),
                    key("vip"),
                    format!(
                        "{vip} cannot be a service address; give the unicast address clients connect to"
                    ),
                ));
            }
            if *svc.port.get_ref() == 0 {
                return Err(err(
                    svc.port.span(),
                    key("port"),
                    "port 0 is not a service port; give 1..=65535".into(),
                ));
            }
            let j = *first
                .entry((vip, *svc.port.get_ref(), svc.protocol))
                .or_insert(i);
            if j != i {
                return Err(err(
                    svc.vip.span(),
                    key("vip"),
                    format!(
                        "service {vip} port {} {} is defined twice (also service[{j}]); merge the two",
                        svc.port.get_ref(),
                        svc.protocol.name()
                    ),
                ));
            }
            if let Some(size) = &svc.maglev_table_size {
                let m = *size.get_ref();
                if m > crate::maglev::MAX_SIZE || !crate::maglev::is_prime(m) {
                    return Err(err(
                        size.span(),
                        key("maglev_table_size"),
                        format!(
                            "{m} is not a prime up to {}; use one of {:?}",
                            crate::maglev::MAX_SIZE,
                            crate::maglev::AUTO_SIZES
                        ),
                    ));
                }
                let weighted = svc
                    .backends
                    .iter()
                    .filter(|b| *b.weight.get_ref() > 0)
                    .count();
                if weighted as u64 > u64::from(m) {
                    return Err(err(
                        size.span(),
                        key("maglev_table_size"),
                        format!(
                            "{m} slots cannot hold {weighted} backends; use a prime of at least 100 × backends"
                        ),
                    ));
                }
            }
            if let Some(h) = &svc.health_check {
                let (iv, to) = (*h.interval_ms.get_ref(), *h.timeout_ms.get_ref());
                if !(10..=3_600_000).contains(&iv) {
                    return Err(err(
                        h.interval_ms.span(),
                        key("health_check.interval_ms"),
                        format!("{iv} ms; give 10 ..= 3600000"),
                    ));
                }
                if to == 0 || to > iv {
                    return Err(err(
                        h.timeout_ms.span(),
                        key("health_check.timeout_ms"),
                        format!("{to} ms; give 1 ..= interval_ms ({iv})"),
                    ));
                }
                for (name, v) in [("rise", &h.rise), ("fall", &h.fall)] {
                    if !(1..=100).contains(v.get_ref()) {
                        return Err(err(
                            v.span(),
                            key(&format!("health_check.{name}")),
                            format!("{}; give 1 ..= 100", v.get_ref()),
                        ));
                    }
                }
                if !h.path.starts_with('/') || h.path.contains(char::is_whitespace) {
                    return Err(err(
                        h.kind.span(),
                        key("health_check.path"),
                        format!(
                            "{:?} is not an HTTP path; give one like \"/healthz\"",
                            h.path
                        ),
                    ));
                }
            }
            match (svc.mode, &svc.snat_address) {
                (ForwardMode::FullNat, None) => {
                    return Err(err(
                        svc.vip.span(),
                        key("snat_address"),
                        "mode = \"full_nat\" needs snat_address: the source address the backends see (routed to this node)".into(),
                    ));
                }
                (ForwardMode::FullNat, Some(a)) => {
                    let snat = *a.get_ref();
                    if snat.is_ipv4() != vip.is_ipv4()
                        || snat.is_unspecified()
                        || snat.is_multicast()
                    {
                        return Err(err(
                            a.span(),
                            key("snat_address"),
                            format!(
                                "{snat} cannot be the source for VIP {vip}; give a unicast address of the VIP's family"
                            ),
                        ));
                    }
                    if let Some(b) = svc.backends.iter().find(|b| *b.address.get_ref() == snat) {
                        return Err(err(
                            b.address.span(),
                            key("snat_address"),
                            format!(
                                "{snat} is also a backend's address; the source address must be this node's, not a backend's"
                            ),
                        ));
                    }
                }
                (ForwardMode::Nat | ForwardMode::Dsr, _) => {
                    if let Some(a) = &svc.snat_address {
                        return Err(err(
                            a.span(),
                            key("snat_address"),
                            "snat_address applies only with mode = \"full_nat\"; set the mode or remove it".into(),
                        ));
                    }
                    if let Some(r) = &svc.snat_ports {
                        return Err(err(
                            r.span(),
                            key("snat_ports"),
                            "snat_ports applies only with mode = \"full_nat\"; set the mode or remove it".into(),
                        ));
                    }
                }
            }
            if svc.mode == ForwardMode::Dsr
                && let Some(b) = svc
                    .backends
                    .iter()
                    .find(|b| b.port.get_ref() != svc.port.get_ref())
            {
                return Err(err(
                    b.port.span(),
                    key("backend"),
                    format!(
                        "mode = \"dsr\" sends packets to the backend unchanged, so backends listen on the service port {}; this one has port {}",
                        svc.port.get_ref(),
                        b.port.get_ref()
                    ),
                ));
            }
            if svc.scheduler == Scheduler::LeastConnections
                && svc.backends.len() > fastpath_common::lb::LEASTCONN_MAX_BACKENDS as usize
            {
                return Err(err(
                    svc.vip.span(),
                    key("scheduler"),
                    format!(
                        "least_connections looks at every backend of a new connection's service, so it takes at most {}; this service has {} — use maglev or wrr",
                        fastpath_common::lb::LEASTCONN_MAX_BACKENDS,
                        svc.backends.len()
                    ),
                ));
            }
            if svc.backends.len() > MAX_BACKENDS_PER_SERVICE {
                return Err(err(
                    svc.vip.span(),
                    key("backend"),
                    format!(
                        "{} backends; a service takes at most {MAX_BACKENDS_PER_SERVICE}",
                        svc.backends.len()
                    ),
                ));
            }
            for (b_i, b) in svc.backends.iter().enumerate() {
                let bkey = |k: &str| format!("service[{i}].backend[{b_i}].{k}");
                let addr = *b.address.get_ref();
                if addr.is_ipv4() != vip.is_ipv4() {
                    return Err(err(
                        b.address.span(),
                        bkey("address"),
                        format!(
                            "backend {addr} is not of the VIP's family ({vip}); the load balancer does not translate between IPv4 and IPv6"
                        ),
                    ));
                }
                if addr.is_unspecified() || addr.is_multicast() {
                    return Err(err(
                        b.address.span(),
                        bkey("address"),
                        format!("{addr} cannot be a backend address"),
                    ));
                }
                if *b.port.get_ref() == 0 {
                    return Err(err(
                        b.port.span(),
                        bkey("port"),
                        "port 0: give the backend's port, 1..=65535".into(),
                    ));
                }
                if *b.weight.get_ref() > 65_535 {
                    return Err(err(
                        b.weight.span(),
                        bkey("weight"),
                        format!("weight {} is above 65535", b.weight.get_ref()),
                    ));
                }
                if let Some(o) = svc.backends[..b_i].iter().position(|o| {
                    o.address.get_ref() == b.address.get_ref()
                        && o.port.get_ref() == b.port.get_ref()
                }) {
                    return Err(err(
                        b.address.span(),
                        bkey("address"),
                        format!(
                            "backend {addr} port {} is listed twice (also backend[{o}]); list it once and set its weight",
                            b.port.get_ref()
                        ),
                    ));
                }
            }
        }
        // New tables are written beside the live ones before the switch: the whole set must
        // fit in half of each map.
        let slots: u64 = self
            .services
            .iter()
            .map(|s| {
                let weighted = s
                    .backends
                    .iter()
                    .filter(|b| *b.weight.get_ref() > 0)
                    .count();
                if weighted == 0 {
                    return 0;
                }
                // The selection table `lb` writes for the service's scheduler.
                match s.scheduler {
                    Scheduler::Maglev => u64::from(
                        s.maglev_table_size
                            .as_ref()
                            .map_or_else(|| crate::maglev::auto_size(weighted), |m| *m.get_ref()),
                    ),
                    Scheduler::Wrr => {
                        let weights: Vec<u32> =
                            s.backends.iter().map(|b| *b.weight.get_ref()).collect();
                        crate::lb::wrr_sequence(&weights).len() as u64
                    }
                    Scheduler::LeastConnections => 1,
                }
            })
            .sum();
        let backends: u64 = self.services.iter().map(|s| s.backends.len() as u64).sum();
        for (what, used, cap) in [
            ("Maglev table slots", slots, fastpath_common::lb::LB_SLOTS),
            ("backends", backends, fastpath_common::lb::MAX_BACKENDS),
        ] {
            if used > u64::from(cap / 2) {
                return Err(ConfigError {
                    path: path.to_owned(),
                    line: None,
                    key: Some("service".into()),
                    message: format!(
                        "the services need {used} {what}; at most {} fit (half the datapath's {cap}: updates are written beside the live ones); use smaller maglev_table_size or fewer backends",
                        cap / 2
                    ),
                });
            }
        }
        if self.services.len() > fastpath_common::lb::MAX_SERVICES as usize / 2 {
            return Err(ConfigError {
                path: path.to_owned(),
                line: None,
                key: Some("service".into()),
                message: format!(
                    "{} services; at most {} fit (the datapath double-buffers them)",
                    self.services.len(),
                    fastpath_common::lb::MAX_SERVICES / 2
                ),
            });
        }
        Ok(())
    }
}

/// The services of a config in file form: services, then port forwards.
#[derive(Serialize)]
struct ServicesOnly {
    service: Vec<ServiceConfig>,
    port_forward: Vec<PortForward>,
}

impl ServicesOnly {
    fn of(services: &[ServiceConfig]) -> ServicesOnly {
        let (forwards, service): (Vec<_>, Vec<_>) =
            services.iter().cloned().partition(|s| s.port_forward);
        ServicesOnly {
            service,
            port_forward: forwards
                .into_iter()
                .filter_map(|s| {
                    let b = s.backends.into_iter().next()?;
                    Some(PortForward {
                        address: s.vip,
                        to_port: (b.port != s.port).then_some(b.port),
                        port: s.port,
                        protocol: s.protocol,
                        to: b.address,
                    })
                })
                .collect(),
        }
    }
}

/// What `snat = true` without `snat_addresses` masquerades as on interface `name`: see
/// [`masquerade_addresses`].
pub fn default_snat_addresses(name: &str) -> std::io::Result<Vec<std::net::IpAddr>> {
    Ok(masquerade_addresses(&crate::sys::interface_addresses(
        name,
    )?))
}

/// Of an interface's addresses `own`, the first global IPv4 and the first global IPv6 one
/// (loopback and link-local ones are not global), in that order; empty when it has neither.
pub fn masquerade_addresses(own: &[std::net::IpAddr]) -> Vec<std::net::IpAddr> {
    let global = |a: &&std::net::IpAddr| match a {
        std::net::IpAddr::V4(v4) => !v4.is_loopback() && !v4.is_link_local(),
        std::net::IpAddr::V6(v6) => !v6.is_loopback() && !v6.is_unicast_link_local(),
    };
    let v4 = own.iter().filter(global).find(|a| a.is_ipv4()).copied();
    let v6 = own.iter().filter(global).find(|a| a.is_ipv6()).copied();
    v4.into_iter().chain(v6).collect()
}

/// The dotted key whose line holds byte offset `at` (`datapath.pin_dir`, `interface[1].xdp`),
/// read from the text, for parse errors that carry only a position.
fn key_at(text: &str, at: usize) -> Option<String> {
    let at = at.min(text.len());
    let line_start = text[..at].rfind('\n').map_or(0, |i| i + 1);
    let line = text[line_start..].lines().next()?;
    let key = line.split('=').next()?.trim();
    if !line.contains('=')
        || key.is_empty()
        || key.starts_with('[')
        || key.chars().any(char::is_control)
    {
        return None;
    }
    // The table the line belongs to: the last header above it. Arrays of tables are counted
    // per element of their parent (`service[2].backend[0]`, as the checks name them).
    let mut table: Option<String> = None;
    let mut counts: Vec<(String, usize)> = Vec::new();
    for l in text[..line_start].lines() {
        let l = l.trim();
        if let Some(name) = l.strip_prefix("[[").and_then(|r| r.strip_suffix("]]")) {
            let name = name.trim().to_string();
            // A new element: the arrays nested in the previous one start again.
            let nested = format!("{name}.");
            counts.retain(|(t, _)| !t.starts_with(&nested));
            match counts.iter_mut().find(|(t, _)| *t == name) {
                Some((_, n)) => *n += 1,
                None => counts.push((name.clone(), 0)),
            }
            table = Some(indexed(&name, &counts));
        } else if let Some(name) = l.strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
            table = Some(indexed(name.trim(), &counts));
        }
    }
    Some(match table {
        Some(t) => format!("{t}.{key}"),
        None => key.to_string(),
    })
}

/// `service.backend` as `service[2].backend[0]`: each prefix that is an array of tables
/// with its current index.
fn indexed(name: &str, counts: &[(String, usize)]) -> String {
    let mut prefix = String::new();
    let mut out = String::new();
    for (i, part) in name.split('.').enumerate() {
        if i > 0 {
            prefix.push('.');
            out.push('.');
        }
        prefix.push_str(part);
        out.push_str(part);
        if let Some((_, n)) = counts.iter().find(|(t, _)| *t == prefix) {
            out.push_str(&format!("[{n}]"));
        }
    }
    out
}

/// 1-based line number of byte offset `at` in `text`.
fn line_of(text: &str, at: usize) -> usize {
    text.as_bytes()[..at.min(text.len())]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fmt::Write as _;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::parse(Path::new("test.toml"), text)
    }

    /// Every example under config/, embedded so the test reads no file at run time (it also
    /// runs as an unprivileged user, who may not be able to read the checkout).
    const EXAMPLE_CONFIGS: [(&str, &str); 4] = [
        (
            "appliance.toml",
            include_str!("../../config/appliance.toml"),
        ),
        ("bgp-node.toml", include_str!("../../config/bgp-node.toml")),
        ("gateway.toml", include_str!("../../config/gateway.toml")),
        (
            "ha-node-a.toml",
            include_str!("../../config/ha-node-a.toml"),
        ),
    ];

    #[test]
    fn example_configs_are_valid() {
        let listed: Vec<&str> = EXAMPLE_CONFIGS.iter().map(|(name, _)| *name).collect();
        assert_eq!(
            listed.join(","),
            env!("FASTPATH_EXAMPLE_CONFIGS"),
            "EXAMPLE_CONFIGS must list every config/*.toml (in order)"
        );
        for (name, text) in EXAMPLE_CONFIGS {
            let path = Path::new("config").join(name);
            if let Err(e) = Config::parse_with(&path, text, InterfaceCheck::Skip) {
                panic!("example {} is invalid: {e}", path.display());
            }
        }
    }

    #[test]
    fn bad_services_name_the_key_and_line() {
        let base = "[[interface]]\nname = \"lo\"\n";
        let svc = |body: &str| format!("{base}[[service]]\nvip = \"10.0.0.1\"\nport = 80\n{body}");
        let cases: [(String, &str, usize, &str); 13] = [
            (
                format!("{base}[[service]]\nvip = \"10.0.0.x\"\nport = 80\n"),
                "vip",
                4,
                "invalid",
            ),
            (
                svc("[[service.backend]]\naddress = \"fd00::1\"\nport = 80\n"),
                "service[0].backend[0].address",
                7,
                "family",
            ),
            (
                svc("maglev_table_size = 1000\n"),
                "service[0].maglev_table_size",
                6,
                "prime",
            ),
            (
                svc(
                    "[[service.backend]]\naddress = \"10.0.1.1\"\nport = 80\n[[service.backend]]\naddress = \"10.0.1.1\"\nport = 80\n",
                ),
                "service[0].backend[1].address",
                10,
                "twice",
            ),
            (
                format!("{}[[service]]\nvip = \"10.0.0.1\"\nport = 80\n", svc("")),
                "service[1].vip",
                7,
                "defined twice",
            ),
            (
                svc(
                    "[service.health_check]\nkind = \"http\"\ninterval_ms = 100\ntimeout_ms = 200\n",
                ),
                "service[0].health_check.timeout_ms",
                9,
                "interval_ms",
            ),
            (
                svc("[service.health_check]\nkind = \"icmp\"\n"),
                "kind",
                7,
                "unknown variant",
            ),
            (
                svc("mode = \"full_nat\"\n"),
                "service[0].snat_address",
                4,
                "needs snat_address",
            ),
            (
                svc("snat_address = \"10.0.2.1\"\n"),
                "service[0].snat_address",
                6,
                "only with mode",
            ),
            (
                svc("mode = \"full_nat\"\nsnat_address = \"fd00::1\"\n"),
                "service[0].snat_address",
                7,
                "family",
            ),
            (
                svc(
                    "mode = \"full_nat\"\nsnat_address = \"10.0.2.1\"\nsnat_ports = \"30000-20000\"\n",
                ),
                "snat_ports",
                8,
                "FIRST <= LAST",
            ),
            (
                "[[interface]]\nname = \"lo\"\nsnat_ports = \"2000-3000\"\n".to_string(),
                "interface[0].snat_ports",
                3,
                "only with snat = true",
            ),
            (
                format!(
                    "{base}[[port_forward]]\naddress = \"10.0.0.1\"\nport = 80\nto = \"fd00::1\"\n"
                ),
                "port_forward[0].to",
                6,
                "family",
            ),
        ];
        for (text, key, line, says) in cases {
            let e = parse(&text).expect_err(&text);
            assert!(
                e.key.as_deref().is_some_and(|k| k.ends_with(key))
                    && e.line == Some(line)
                    && e.to_string().contains(says),
                "for\n{text}\nexpected key {key} line {line} saying {says:?}; got {e}"
            );
        }
    }

    #[test]
    fn parse_errors_index_nested_tables_per_parent() {
        let text = "[[interface]]\nname = \"lo\"\n\
            [[service]]\nvip = \"10.0.0.1\"\nport = 80\n[[service.backend]]\naddress = \"10.1.0.1\"\nport = 80\n\
            [[service]]\nvip = \"10.0.0.2\"\nport = 80\n[[service.backend]]\naddress = \"10.1.0.1\"\nport = 70000\n";
        let e = parse(text).expect_err("port 70000");
        assert_eq!(e.key.as_deref(), Some("service[1].backend[0].port"), "{e}");
        assert_eq!(e.line, Some(14), "{e}");
        let text = "[[interface]]\nname = \"lo\"\n\
            [[service]]\nvip = \"10.0.0.1\"\nport = 80\n[service.health_check]\nkind = 5\n";
        let e = parse(text).expect_err("kind = 5");
        assert_eq!(
            e.key.as_deref(),
            Some("service[0].health_check.kind"),
            "{e}"
        );
    }

    #[test]
    fn minimal_config_uses_defaults() {
        let c = parse("[[interface]]\nname = \"lo\"\n").expect("valid");
        assert_eq!(c.datapath.pin_dir.get_ref(), Path::new(DEFAULT_PIN_DIR));
        assert!(c.datapath.detach_on_exit);
        assert!(!c.datapath.drop_malformed);
        assert_eq!(c.interfaces[0].xdp, XdpMode::Auto);
        assert!(!c.interfaces[0].tc_ingress);
        assert!(c.interfaces[0].conntrack);
        assert_eq!(*c.conntrack.capacity.get_ref(), DEFAULT_CT_CAPACITY);
    }

    #[test]
    fn ha_section_is_checked_key_by_key() {
        // A readable stand-in for the PEM files (only readability is checked here), made in
        // the temp dir: the unprivileged pass may not be able to read the checkout.
        let pem = std::env::temp_dir().join(format!("fastpath-ha-test-{}.pem", std::process::id()));
        std::fs::write(&pem, "not checked here\n").expect("writing to the temp dir");
        let file = pem.display().to_string();
        let ha = |body: &str, peers: &str| {
            format!(
                "[[interface]]\nname = \"lo\"\n[ha]\n{body}listen = \"10.0.0.1:7946\"\ntls_cert = \"{file}\"\ntls_key = \"{file}\"\ntls_ca = \"{file}\"\n{peers}"
            )
        };
        let peer = "[[ha.peers]]\naddress = \"10.0.0.2:7946\"\nnode_id = 2\n";
        let c = parse(&ha("node_id = 1\n", peer)).expect("valid");
        let h = c.ha.expect("[ha]");
        assert_eq!((*h.node_id.get_ref(), *h.queue.get_ref()), (1, 1 << 20));
        for (body, peers, key, says) in [
            ("node_id = 0\n", peer, "ha.node_id", "its own id"),
            (
                "node_id = 1\nqueue = 10\n",
                peer,
                "ha.queue",
                "out of range",
            ),
            ("node_id = 1\n", "", "ha.peers", "[[ha.peers]]"),
            (
                "node_id = 1\n",
                "[[ha.peers]]\naddress = \"10.0.0.1:7946\"\nnode_id = 2\n",
                "ha.peers[0].address",
                "own ha.listen",
            ),
            (
                "node_id = 1\n",
                "[[ha.peers]]\naddress = \"10.0.0.2:7946\"\nnode_id = 2\n[[ha.peers]]\naddress = \"10.0.0.2:7946\"\nnode_id = 3\n",
                "ha.peers[1].address",
                "twice",
            ),
            (
                "node_id = 1\n",
                "[[ha.peers]]\naddress = \"10.0.0.2:7946\"\nnode_id = 1\n",
                "ha.peers[0].node_id",
                "own ha.node_id",
            ),
            (
                "node_id = 1\n",
                "[[ha.peers]]\naddress = \"10.0.0.2:7946\"\nnode_id = 2\n[[ha.peers]]\naddress = \"10.0.0.3:7946\"\nnode_id = 2\n",
                "ha.peers[1].node_id",
                "two peers",
            ),
            (
                "node_id = 1\n",
                "[[ha.peers]]\naddress = \"10.0.0.2:7946\"\nnode_id = 0\n",
                "ha.peers[0].node_id",
                "not a node id",
            ),
        ] {
            let e = parse(&ha(body, peers)).expect_err(key);
            assert_eq!(e.key.as_deref(), Some(key), "{e}");
            assert!(e.to_string().contains(says), "{e}");
        }
        let e = parse(&ha("node_id = 1\n", peer).replacen(&file, "/nonexistent/node.pem", 1))
            .expect_err("missing certificate");
        let _ = std::fs::remove_file(&pem);
        assert_eq!(e.key.as_deref(), Some("ha.tls_cert"), "{e}");
        assert!(e.to_string().contains("mutual TLS"), "{e}");
    }

    #[test]
    fn announce_section_is_checked_key_by_key() {
        let announce = |body: &str| format!("[[interface]]\nname = \"lo\"\n[announce]\n{body}");
        let c = parse(&announce(
            "table = 100\nprefixes = [\"198.51.100.0/28\", \"2001:db8::/64\"]\n",
        ))
        .expect("valid");
        let a = c.announce.expect("[announce]");
        assert_eq!((*a.table.get_ref(), *a.sync_timeout_s.get_ref()), (100, 30));
        assert_eq!(a.prefixes.len(), 2);
        for (body, key, says) in [
            ("table = 254\n", "announce.table", "main"),
            ("table = 0\n", "announce.table", "unspecified"),
            (
                "table = 100\nprefixes = [\"198.51.100.1/28\"]\n",
                "announce.prefixes[0]",
                "write 198.51.100.0/28",
            ),
            (
                "table = 100\nprefixes = [\"10.0.0.0/8\", \"10.0.0.0/8\"]\n",
                "announce.prefixes[1]",
                "twice",
            ),
            (
                "table = 100\nprefixes = [\"10.1.0.0/24\"]\nbackup_prefixes = [\"10.2.0.0/24\", \"10.1.0.0/24\"]\n",
                "announce.backup_prefixes[1]",
                "twice",
            ),
            (
                "table = 100\nbackup_prefixes = [\"10.2.0.1/24\"]\n",
                "announce.backup_prefixes[0]",
                "write 10.2.0.0/24",
            ),
            (
                "table = 100\nsync_timeout_s = 0\n",
                "announce.sync_timeout_s",
                "out of range",
            ),
        ] {
            let e = parse(&announce(body)).expect_err(key);
            assert_eq!(e.key.as_deref(), Some(key), "{e}");
            assert!(e.to_string().contains(says), "{e}");
        }
        let e = parse(&announce("table = 100\nprefixes = [\"10.0.0.300/8\"]\n"))
            .expect_err("not a prefix");
        assert!(e.to_string().contains("prefixes"), "{e}");
    }

    #[test]
    fn selection_slots_are_counted_per_scheduler() {
        // 20000 one-backend services: as Maglev tables (251 slots each) they need 5 Mi slots,
        // more than fit; weighted round robin takes one slot each.
        let services = |scheduler: &str| {
            let mut s = String::from("[[interface]]\nname = \"lo\"\n");
            for i in 0..20_000u32 {
                let _ = write!(
                    s,
                    "[[service]]\nvip = \"10.64.{}.{}\"\nport = 80\nscheduler = \"{scheduler}\"\n[[service.backend]]\naddress = \"10.1.0.1\"\nport = 80\n",
                    i / 256,
                    i % 256
                );
            }
            s
        };
        let e = parse(&services("maglev")).expect_err("5 Mi Maglev slots do not fit");
        assert!(e.to_string().contains("Maglev table slots"), "{e}");
        let c = parse(&services("wrr")).expect("20000 one-slot services fit");
        assert_eq!(c.services.len(), 20_000);
    }

    #[test]
    fn conntrack_capacity_is_bounded() {
        let e = parse("[conntrack]\ncapacity = 10\n[[interface]]\nname = \"lo\"\n")
            .expect_err("tiny table");
        assert_eq!(e.line, Some(2), "{e}");
        assert_eq!(e.key.as_deref(), Some("conntrack.capacity"), "{e}");
    }

    #[test]
    fn unknown_key_names_key_and_line() {
        let e = parse(
            "[datapath]\ndrop_malformed = true\n\n[[interface]]\nname = \"lo\"\nxdpp = \"auto\"\n",
        )
        .expect_err("typo must fail");
        assert_eq!(e.line, Some(6), "{e}");
        assert!(e.to_string().contains("xdpp"), "{e}");
    }

    #[test]
    fn missing_interface_names_key_and_line() {
        let e = parse("[[interface]]\nname = \"lo\"\n[[interface]]\nname = \"nosuch0\"\n")
            .expect_err("missing interface must fail");
        assert_eq!(e.line, Some(4), "{e}");
        assert_eq!(e.key.as_deref(), Some("interface[1].name"));
        assert!(e.to_string().contains("ip link"), "{e}");
    }

    #[test]
    fn tc_attach_takes_auto_tcx_or_netlink() {
        let c = parse("[[interface]]\nname = \"lo\"\n").expect("valid");
        assert_eq!(c.datapath.tc_attach, TcAttachMode::Auto);
        for (text, want) in [
            ("auto", TcAttachMode::Auto),
            ("tcx", TcAttachMode::Tcx),
            ("netlink", TcAttachMode::Netlink),
        ] {
            let c = parse(&format!(
                "[datapath]\ntc_attach = \"{text}\"\n[[interface]]\nname = \"lo\"\n"
            ))
            .expect("valid");
            assert_eq!(c.datapath.tc_attach, want);
        }
        let e = parse("[datapath]\ntc_attach = \"legacy\"\n[[interface]]\nname = \"lo\"\n")
            .expect_err("unknown mode");
        assert_eq!(e.key.as_deref(), Some("datapath.tc_attach"), "{e}");
        assert!(e.to_string().contains("netlink"), "{e}");
    }

    #[test]
    fn type_errors_name_the_key_and_line() {
        let e = parse("[datapath]\ndrop_malformed = \"yes\"\n[[interface]]\nname = \"lo\"\n")
            .expect_err("string for a bool");
        assert_eq!(e.line, Some(2), "{e}");
        assert_eq!(e.key.as_deref(), Some("datapath.drop_malformed"), "{e}");
        let e = parse("[[interface]]\nname = \"lo\"\n[[interface]]\nname = \"lo2\"\nxdp = 1\n")
            .expect_err("integer for a mode");
        assert_eq!(e.line, Some(5), "{e}");
        assert_eq!(e.key.as_deref(), Some("interface[1].xdp"), "{e}");
    }

    #[test]
    fn bad_values_are_rejected() {
        let e = parse("[[interface]]\nname = \"lo\"\nxdp = \"turbo\"\n").expect_err("bad mode");
        assert_eq!(e.line, Some(3), "{e}");
        let e = parse("[datapath]\npin_dir = \"relative\"\n[[interface]]\nname = \"lo\"\n")
            .expect_err("relative pin dir");
        assert_eq!(e.line, Some(2), "{e}");
        let e =
            parse("[[interface]]\nname = \"lo\"\n[[interface]]\nname = \"lo\"\n").expect_err("dup");
        assert!(e.to_string().contains("twice"), "{e}");
        let e =
            parse("[[interface]]\nname = \"lo\"\nxdp = \"off\"\n").expect_err("nothing to attach");
        assert!(e.to_string().contains("nothing to attach"), "{e}");
        let e = parse("").expect_err("no interfaces");
        assert!(e.to_string().contains("[[interface]]"), "{e}");
        let e =
            parse("[[interface]]\nname = \"lo\"\nxdp = \"off\"\ntc_egress = true\nroute = true\n")
                .expect_err("routing without an ingress hook");
        assert!(e.to_string().contains("no ingress hook"), "{e}");
        let ok =
            parse("[[interface]]\nname = \"lo\"\nxdp = \"off\"\ntc_ingress = true\nroute = true\n")
                .expect("routing at TC ingress");
        assert!(ok.interfaces[0].route);
    }

    #[test]
    fn a_vxlan_device_needs_a_valid_vni_an_underlay_with_both_hooks_and_at_most_generic_xdp() {
        let cfg = |under: &str, dev: &str| {
            Config::parse_with(
                Path::new("test.toml"),
                &format!(
                    "[[interface]]\nname = \"lo\"\n{under}\n[[interface]]\nname = \"vx\"\n{dev}\n"
                ),
                InterfaceCheck::Skip,
            )
        };
        let dev = |vni: u32| {
            format!(
                "xdp = \"off\"\nvxlan = {{ vni = {vni}, local = \"192.0.2.1\", underlay = \"lo\" }}"
            )
        };
        for vni in [0, 1 << 24] {
            let e = cfg("tc_egress = true", &dev(vni)).expect_err("out of range");
            assert!(e.to_string().contains("use 1-16777215"), "{vni}: {e}");
        }
        let e = cfg("", &dev(42)).expect_err("no TC egress on the underlay");
        assert!(e.to_string().contains("tc_egress = true"), "{e}");
        let e = cfg("xdp = \"off\"\ntc_egress = true", &dev(42)).expect_err("no XDP or TC");
        assert!(e.to_string().contains("needs XDP or"), "{e}");
        cfg(
            "xdp = \"off\"\ntc_ingress = true\ntc_egress = true",
            &dev(42),
        )
        .expect("an underlay decapsulating at TC ingress");
        let under = "tc_egress = true";
        let vx = "vxlan = { vni = 42, local = \"192.0.2.1\", underlay = \"lo\" }";
        for (dev_hooks, says) in [
            ("", "has no native XDP"),
            ("xdp = \"native\"", "has no native XDP"),
            (
                "xdp = \"off\"\ntc_egress = true",
                "no TC program runs on it",
            ),
            (
                "xdp = \"off\"\ntc_ingress = true",
                "no TC program runs on it",
            ),
            ("xdp = \"generic\"\nconntrack = false", "needs conntrack on"),
            ("xdp = \"generic\"\nroute = true", "takes no route = true"),
        ] {
            let e = cfg(under, &format!("{dev_hooks}\n{vx}")).expect_err(dev_hooks);
            assert!(e.to_string().contains(says), "{dev_hooks}: {e}");
        }
        let ok = cfg(under, &format!("xdp = \"generic\"\n{vx}"))
            .expect("connection tracking at the device's XDP");
        assert!(ok.interfaces[1].xdp == XdpMode::Generic && ok.interfaces[1].conntrack);
        let e = cfg(
            "tc_egress = true",
            "xdp = \"off\"\nvxlan = { vni = 42, local = \"192.0.2.1\", underlay = \"eth9\" }",
        )
        .expect_err("no such underlay");
        assert!(e.to_string().contains("is not an [[interface]]"), "{e}");
        let ok = cfg("tc_egress = true", &dev(42)).expect("a VXLAN device");
        let vx = ok.interfaces[1].vxlan.as_ref().expect("vxlan");
        assert_eq!((*vx.vni.get_ref(), vx.port), (42, 4789));
    }

    #[test]
    fn a_vlan_port_needs_a_valid_id_and_both_hooks() {
        let port = |keys: &str| parse(&format!("[[interface]]\nname = \"lo\"\n{keys}\n"));
        for vid in [0, 4095, 5000] {
            let e = port(&format!("tc_egress = true\nvlan = {vid}")).expect_err("out of range");
            assert!(e.to_string().contains("use 1-4094"), "{vid}: {e}");
        }
        let e = port("vlan = 100").expect_err("no TC egress");
        assert!(e.to_string().contains("set tc_egress = true"), "{e}");
        let e = port("xdp = \"off\"\ntc_egress = true\nvlan = 100").expect_err("no ingress");
        assert!(e.to_string().contains("keep an ingress hook"), "{e}");
        let ok = port("xdp = \"off\"\ntc_ingress = true\ntc_egress = true\nvlan = 4094")
            .expect("a VLAN port at TC");
        assert_eq!(
            ok.interfaces[0].vlan.as_ref().map(|v| *v.get_ref()),
            Some(4094)
        );
    }
}
