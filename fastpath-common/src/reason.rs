//! Stable reason codes: why the datapath gave a packet the verdict it did.
//!
//! Every packet is counted exactly once, under (hook, verdict, reason). Codes are an ABI: they
//! index pinned per-CPU arrays (`FP_STATS` for codes below 64, `FP_STATS_EXT` above, see
//! `stats::stats_map`), so a code is never renumbered or reused; new ones are appended below
//! `COUNT`.

/// Never counted; index 0 is reserved so an uninitialised code shows up as a bug.
pub const NONE: u32 = 0;

// --- Well-formed packets that no stage handles (go to the kernel, the slow path). ---
/// IPv4/TCP that no pipeline stage claimed.
pub const NO_STAGE_IPV4_TCP: u32 = 1;
/// IPv4/UDP that no pipeline stage claimed.
pub const NO_STAGE_IPV4_UDP: u32 = 2;
/// IPv4/ICMP that no pipeline stage claimed.
pub const NO_STAGE_IPV4_ICMP: u32 = 3;
/// IPv4 with another L4 protocol (GRE, ESP, SCTP, ...).
pub const NO_STAGE_IPV4_OTHER: u32 = 4;
/// IPv6/TCP that no pipeline stage claimed.
pub const NO_STAGE_IPV6_TCP: u32 = 5;
/// IPv6/UDP that no pipeline stage claimed.
pub const NO_STAGE_IPV6_UDP: u32 = 6;
/// IPv6/ICMPv6 (other than neighbour discovery) that no pipeline stage claimed.
pub const NO_STAGE_IPV6_ICMP: u32 = 7;
/// IPv6 with another L4 protocol, or an extension header the parser does not walk (AH, ESP).
pub const NO_STAGE_IPV6_OTHER: u32 = 8;

// --- Always the kernel's business. ---
/// ARP: the kernel resolves neighbours.
pub const ARP: u32 = 9;
/// ICMPv6 neighbour discovery (RS, RA, NS, NA, redirect).
pub const IPV6_ND: u32 = 10;
/// Any other ethertype (LLDP, MPLS, PPPoE, ...).
pub const NON_IP: u32 = 11;
/// An IPv4 fragment: reassembly is the kernel's job.
pub const IPV4_FRAGMENT: u32 = 12;
/// An IPv6 packet with a fragment header.
pub const IPV6_FRAGMENT: u32 = 13;
/// More than two VLAN tags.
pub const VLAN_TOO_DEEP: u32 = 14;
/// More IPv6 extension headers than the parser walks (bounded for the verifier).
pub const IPV6_EXT_CHAIN_TOO_LONG: u32 = 15;

// --- Malformed packets: to the kernel by default, dropped when `drop_malformed` is set. ---
/// Frame shorter than an Ethernet header.
pub const TRUNC_ETH: u32 = 16;
/// Frame ends inside a VLAN tag.
pub const TRUNC_VLAN: u32 = 17;
/// Frame ends inside the IPv4 header (including its options).
pub const TRUNC_IPV4: u32 = 18;
/// Frame ends inside the fixed IPv6 header.
pub const TRUNC_IPV6: u32 = 19;
/// Frame or payload ends inside an IPv6 extension header.
pub const TRUNC_IPV6_EXT: u32 = 20;
/// Frame or IP payload ends inside the TCP/UDP/ICMP header.
pub const TRUNC_L4: u32 = 21;
/// IPv4 IHL below 5 (a header shorter than 20 bytes).
pub const BAD_IPV4_IHL: u32 = 22;
/// IPv4 total length shorter than its header (0 only on packets up to 64 KiB), or longer than
/// the frame.
pub const BAD_IPV4_TOTAL_LEN: u32 = 23;
/// The IP version nibble disagrees with the ethertype.
pub const BAD_IP_VERSION: u32 = 24;
/// IPv6 payload length longer than the frame, or zero on a packet up to 64 KiB.
pub const BAD_IPV6_PAYLOAD_LEN: u32 = 25;
/// TCP data offset below 5, or a TCP header longer than the IP payload.
pub const BAD_TCP_DATA_OFFSET: u32 = 26;

/// A TC packet whose headers lie beyond the skb's linear area even after pulling
/// `PULL_LEN` bytes: well-formed as far as we know, so the kernel gets it.
pub const HEADERS_NOT_LINEAR: u32 = 27;

/// Well-formed headers that start beyond the parser's window (`MAX_HDR_OFF`, 1 KiB into the
/// frame, e.g. a huge hop-by-hop header): the kernel handles them.
pub const HEADERS_TOO_DEEP: u32 = 28;

/// An IP length field of 0 on a packet over 64 KiB: a BIG TCP / GSO super-packet or an IPv6
/// jumbogram. Well-formed; the kernel handles it.
pub const GSO_JUMBO: u32 = 29;

// --- Stateful firewall drops (interfaces with `stateful_firewall = true`). ---
/// No connection, and the packet cannot start one (TCP without SYN, an echo reply, ...).
pub const FW_NO_CONNECTION: u32 = 30;
/// A TCP packet that does not fit its connection's state (Linux's conntrack INVALID).
pub const FW_INVALID_STATE: u32 = 31;
/// An ICMP/ICMPv6 error whose inner header belongs to no tracked connection.
pub const FW_ICMP_ERROR_NO_CONNECTION: u32 = 32;
/// A new connection the table cannot take: full of assured connections (none to drop early).
pub const FW_TABLE_FULL: u32 = 33;

// --- Load balancing (XDP). Translated packets are routed by the kernel. ---
/// A client packet of a load-balanced connection, translated to its backend (DNAT).
pub const LB_TO_BACKEND: u32 = 34;
/// A backend's reply, translated back to the service's VIP.
pub const LB_FROM_BACKEND: u32 = 35;
/// A new connection to a service with no backend available (dropped or passed untranslated,
/// as the service says).
pub const LB_NO_BACKEND: u32 = 36;
/// A load-balanced packet whose headers could not be rewritten (not in the writable bytes).
pub const LB_REWRITE_FAILED: u32 = 37;

/// A new load-balanced connection the conntrack table cannot take (full of assured
/// connections): dropped, since its replies could not be translated back.
pub const LB_TABLE_FULL: u32 = 38;
/// A new full-NAT or masqueraded connection for which no source port was free (every
/// candidate's tuple taken): dropped.
pub const SNAT_EXHAUSTED: u32 = 39;
/// A direct-server-return packet sent to its backend's MAC address (forward verdict).
pub const LB_DSR: u32 = 40;
/// A direct-server-return packet whose backend has no route or no resolved neighbour
/// (MAC address) yet, or arriving where forwarding is off: dropped (the client retransmits;
/// the daemon resolves the backends).
pub const LB_DSR_NO_NEIGHBOR: u32 = 41;
/// An ICMP/ICMPv6 error about a packet a backend was sent (port unreachable, fragmentation
/// needed / packet too big, ...), translated for the client: the quoted packet as the client
/// sent it, the error from the VIP.
pub const LB_ICMP_ERROR: u32 = 42;
/// A new connection to a service with no backend available, answered (`no_backend =
/// "reject"`): a TCP RST or an ICMP/ICMPv6 port unreachable, sent back (forward verdict).
pub const LB_REJECTED: u32 = 43;

// --- Routing (interfaces with `route = true`). ---
/// Routed in the fast path: TTL / hop limit decremented, MAC addresses of the next hop and
/// the egress interface, redirected there (forward verdict).
pub const ROUTED: u32 = 44;
/// TTL / hop limit 1 or 0: the kernel sends the ICMP time exceeded.
pub const ROUTE_TTL_EXPIRED: u32 = 45;
/// The next hop's MAC address is not resolved (or is failed): the kernel resolves it.
pub const ROUTE_NO_NEIGHBOR: u32 = 46;
/// The FIB does not forward it — for this node itself, broadcast or multicast, or no route
/// at all: the kernel's (it delivers it, or drops it with its ICMP error).
pub const ROUTE_NOT_FORWARDED: u32 = 47;
/// A blackhole, unreachable or prohibit route: the kernel drops it, with its ICMP error.
pub const ROUTE_UNREACHABLE: u32 = 48;
/// Longer than the route's MTU: the kernel fragments it or sends the ICMP error.
pub const ROUTE_MTU: u32 = 49;
/// IPv4 options or IPv6 extension headers: the kernel processes them.
pub const ROUTE_IP_OPTIONS: u32 = 50;
/// A fragment: the kernel forwards it (or reassembles, if its configuration says so).
pub const ROUTE_FRAGMENT: u32 = 51;
/// The route leaves through an interface without `route = true`: the kernel forwards it.
pub const ROUTE_EGRESS_NOT_ROUTED: u32 = 52;
/// Forwarding is off on the arriving interface (`net.ipv4.ip_forward`,
/// `net.ipv6.conf.*.forwarding`): the kernel's to decide (it delivers or drops).
pub const ROUTE_FORWARDING_OFF: u32 = 53;
/// Not sent to the interface's MAC address (multicast, broadcast, another host's frame seen
/// in promiscuous mode), or VLAN-tagged: the kernel's.
pub const ROUTE_NOT_FOR_US: u32 = 54;
/// Any other FIB answer (an unsupported lightweight tunnel route, ...): the kernel's.
pub const ROUTE_OTHER: u32 = 55;

/// An address the kernel never forwards (loopback, unspecified, a multicast or broadcast
/// source, IPv6 link-local, IPv4-mapped IPv6): the kernel's (it drops it as a martian).
pub const ROUTE_MARTIAN: u32 = 56;

/// A frame arriving on an 802.1Q port (`vlan = N`) without its VLAN's tag: untagged,
/// another VLAN, or an 802.1ad outer tag. Dropped: the port carries that VLAN only.
pub const VLAN_NOT_MEMBER: u32 = 57;
/// A port's VLAN tag could not be removed or added (no room in the frame): dropped.
pub const VLAN_FAILED: u32 = 58;

/// Encapsulated with the VXLAN headers learned for the next hop and sent out of the
/// underlay (a cache hit; the verdict is forward).
pub const VXLAN_ENCAP: u32 = 59;
/// A configured VXLAN network's packet to this VTEP, decapsulated and its inner packet routed
/// (the verdict is forward).
pub const VXLAN_DECAP: u32 = 60;
/// Routed to a vxlan device whose headers for that next hop are not learned yet (a cache
/// miss), or arriving VXLAN that is not a configured network's to this VTEP (or whose inner
/// packet does not parse, or whose vxlan device tracks connections: the kernel decapsulates
/// it and the device's own XDP hook takes the inner packet): the kernel's.
pub const VXLAN_MISS: u32 = 61;
/// Routed to a vxlan device whose headers for that next hop were learned before the last
/// change they depend on (an invalidation): the kernel's, which teaches them again.
pub const VXLAN_STALE: u32 = 62;
/// A TCP FIN or RST to or from a VXLAN network: the kernel's, so that its connection
/// tracking sees the connection end.
pub const VXLAN_TCP_CLOSE: u32 = 63;

// --- Hostile frames (codes from 64 on are counted in `FP_STATS_EXT`). ---
/// A TCP segment whose flags Linux's conntrack calls invalid (`tcp_error`'s
/// `tcp_valid_flags`: SYN with FIN or RST, FIN without ACK, no flags, ...; see
/// `ct::tcp_flags_valid`): never translated, tracked or forwarded by the fast path. Dropped
/// when its tuple is a load-balanced, full-NAT, masqueraded or DSR connection's (the kernel,
/// given it untranslated, would answer with a RST that kills the connection, or forward it
/// untranslated), on an interface with the stateful firewall, or with `drop_malformed`;
/// otherwise the kernel's.
pub const TCP_INVALID_FLAGS: u32 = 64;
/// A packet that would start a connection from a martian source — loopback (127/8, ::1),
/// unspecified (0/8, ::), limited broadcast, multicast, or the destination's own address
/// (a LAND frame) — arriving on an interface that is not a loopback device: dropped with no
/// conntrack entry, NAT binding or conntrack counter (Linux never confirms such
/// connections: its input route refuses martian sources).
pub const MARTIAN_SOURCE: u32 = 65;

/// One past the highest code in use. Append new codes above this line and bump it.
pub const COUNT: u32 = 66;
/// Codes the stats maps have room for (64 per map: see `stats::REASONS_PER_MAP`); codes
/// must stay below this.
pub const SLOTS: u32 = 128;

const _: () = assert!(COUNT <= SLOTS);

/// Stable snake_case names, indexed by code, for the CLI, logs and metrics labels.
pub const NAMES: [&str; COUNT as usize] = [
    "none",
    "no_stage_ipv4_tcp",
    "no_stage_ipv4_udp",
    "no_stage_ipv4_icmp",
    "no_stage_ipv4_other",
    "no_stage_ipv6_tcp",
    "no_stage_ipv6_udp",
    "no_stage_ipv6_icmp",
    "no_stage_ipv6_other",
    "arp",
    "ipv6_nd",
    "non_ip",
    "ipv4_fragment",
    "ipv6_fragment",
    "vlan_too_deep",
    "ipv6_ext_chain_too_long",
    "trunc_eth",
    "trunc_vlan",
    "trunc_ipv4",
    "trunc_ipv6",
    "trunc_ipv6_ext",
    "trunc_l4",
    "bad_ipv4_ihl",
    "bad_ipv4_total_len",
    "bad_ip_version",
    "bad_ipv6_payload_len",
    "bad_tcp_data_offset",
    "headers_not_linear",
    "headers_too_deep",
    "gso_jumbo",
    "fw_no_connection",
    "fw_invalid_state",
    "fw_icmp_error_no_connection",
    "fw_table_full",
    "lb_to_backend",
    "lb_from_backend",
    "lb_no_backend",
    "lb_rewrite_failed",
    "lb_table_full",
    "snat_exhausted",
    "lb_dsr",
    "lb_dsr_no_neighbor",
    "lb_icmp_error",
    "lb_rejected",
    "routed",
    "route_ttl_expired",
    "route_no_neighbor",
    "route_not_forwarded",
    "route_unreachable",
    "route_mtu",
    "route_ip_options",
    "route_fragment",
    "route_egress_not_routed",
    "route_forwarding_off",
    "route_not_for_us",
    "route_other",
    "route_martian",
    "vlan_not_member",
    "vlan_failed",
    "vxlan_encap",
    "vxlan_decap",
    "vxlan_miss",
    "vxlan_stale",
    "vxlan_tcp_close",
    "tcp_invalid_flags",
    "martian_source",
];

/// Name of a code, or `"unknown"` for a code this build does not know (a newer datapath).
pub fn name(code: u32) -> &'static str {
    match NAMES.get(code as usize) {
        Some(n) => n,
        None => "unknown",
    }
}

/// Whether a code means the packet was malformed (subject to `drop_malformed`).
pub const fn is_malformed(code: u32) -> bool {
    code >= TRUNC_ETH && code <= BAD_TCP_DATA_OFFSET
}
