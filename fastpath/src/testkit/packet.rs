//! A small hand-written builder for test frames: Ethernet, VLAN tags, IPv4/IPv6 (with options
//! and extension headers), TCP/UDP/ICMP/ICMPv6, payload, padding and truncation.
//!
//! Contract: by default every length and checksum is *correct* (IPv4 header checksum, TCP/UDP/
//! ICMPv6 over the pseudo-header, ICMP over its message), so fixtures can compare rewritten
//! frames byte for byte; every field a malformed-packet case needs can be overridden, and
//! overrides are applied verbatim (an overridden length is not "fixed" afterwards).
//!
//! ```
//! use fastpath::testkit::packet::{Pkt, tcp_flags};
//! let frame = Pkt::eth()
//!     .vlan(0x8100, 100)
//!     .ipv4([10, 0, 0, 1], [10, 0, 0, 2])
//!     .tcp(40000, 80, tcp_flags::SYN)
//!     .payload(b"hello")
//!     .build();
//! assert_eq!(frame.len(), 14 + 4 + 20 + 20 + 5);
//! ```
//!
//! Modifiers (`ihl`, `tcp_data_offset`, ...) act on the layer of their kind that was added
//! last and panic with a message naming the missing layer when there is none: a test-only
//! builder should fail loudly on misuse rather than build something else.

/// Ethertypes used by the fixtures.
pub mod ethertype {
    pub const IPV4: u16 = 0x0800;
    pub const ARP: u16 = 0x0806;
    pub const VLAN_8021Q: u16 = 0x8100;
    pub const VLAN_8021AD: u16 = 0x88a8;
    /// Pre-standard QinQ outer tag.
    pub const VLAN_QINQ_9100: u16 = 0x9100;
    pub const IPV6: u16 = 0x86dd;
    pub const LLDP: u16 = 0x88cc;
    /// IEEE 802 "local experimental ethertype 1": what a frame without an L3 layer carries
    /// unless `Pkt::ethertype` says otherwise.
    pub const LOCAL_EXPERIMENTAL: u16 = 0x88b5;
}

/// IP protocol / IPv6 next-header numbers used by the fixtures.
pub mod proto {
    pub const HOPOPTS: u8 = 0;
    pub const ICMP: u8 = 1;
    pub const TCP: u8 = 6;
    pub const UDP: u8 = 17;
    pub const ROUTING: u8 = 43;
    pub const FRAGMENT: u8 = 44;
    pub const GRE: u8 = 47;
    pub const ESP: u8 = 50;
    pub const ICMPV6: u8 = 58;
    pub const NO_NEXT: u8 = 59;
    pub const DSTOPTS: u8 = 60;
    /// RFC 3692 experimental: what an IPv4 header without an L4 layer carries unless
    /// `Pkt::ip_proto` says otherwise.
    pub const EXPERIMENTAL: u8 = 253;
}

/// TCP flag bits (the 13th byte of the header).
pub mod tcp_flags {
    pub const FIN: u8 = 0x01;
    pub const SYN: u8 = 0x02;
    pub const RST: u8 = 0x04;
    pub const PSH: u8 = 0x08;
    pub const ACK: u8 = 0x10;
    pub const URG: u8 = 0x20;
}

/// ICMP / ICMPv6 message types used by the fixtures.
pub mod icmp_type {
    pub const ECHO_REPLY: u8 = 0;
    pub const ECHO_REQUEST: u8 = 8;
    pub const V6_ECHO_REQUEST: u8 = 128;
    pub const V6_ECHO_REPLY: u8 = 129;
    pub const V6_ROUTER_SOLICIT: u8 = 133;
    pub const V6_ROUTER_ADVERT: u8 = 134;
    pub const V6_NEIGHBOUR_SOLICIT: u8 = 135;
    pub const V6_NEIGHBOUR_ADVERT: u8 = 136;
    pub const V6_REDIRECT: u8 = 137;
}

/// Default destination MAC (locally administered).
pub const DEFAULT_DST_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];
/// Default source MAC (locally administered).
pub const DEFAULT_SRC_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
/// Minimum Ethernet frame length without FCS: what `Pkt::pad_min` pads to.
pub const ETH_MIN_FRAME: usize = 60;

/// RFC 1071 Internet checksum and the TCP/UDP/ICMPv6 pseudo-headers.
pub mod checksum {
    /// Adds `data` as big-endian 16-bit words to `sum` (an odd trailing byte is padded with
    /// zero). Not folded, not complemented: chain calls, then [`finish`].
    pub fn add(mut sum: u64, data: &[u8]) -> u64 {
        let (words, rest) = data.as_chunks::<2>();
        for w in words {
            sum += u64::from(u16::from_be_bytes(*w));
        }
        if let [last] = rest {
            sum += u64::from(*last) << 8;
        }
        sum
    }

    /// Folds the carries of a running sum into 16 bits (not complemented).
    pub fn fold(mut sum: u64) -> u16 {
        while sum >> 16 != 0 {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        sum as u16
    }

    /// The checksum field value for a running sum: the one's complement of the folded sum.
    pub fn finish(sum: u64) -> u16 {
        !fold(sum)
    }

    /// Internet checksum of `data` (the value to store in a zeroed checksum field). Over data
    /// that already contains a correct checksum it yields 0.
    pub fn internet(data: &[u8]) -> u16 {
        finish(add(0, data))
    }

    /// Running sum of the IPv4 pseudo-header (src, dst, zero, protocol, L4 length).
    pub fn pseudo_v4(src: [u8; 4], dst: [u8; 4], protocol: u8, l4_len: u16) -> u64 {
        let mut sum = add(0, &src);
        sum = add(sum, &dst);
        sum += u64::from(protocol);
        sum + u64::from(l4_len)
    }

    /// Running sum of the IPv6 pseudo-header (src, dst, 32-bit L4 length, next header).
    pub fn pseudo_v6(src: [u8; 16], dst: [u8; 16], next_header: u8, l4_len: u32) -> u64 {
        let mut sum = add(0, &src);
        sum = add(sum, &dst);
        sum = add(sum, &l4_len.to_be_bytes());
        sum + u64::from(next_header)
    }

    /// TCP/UDP checksum over the IPv4 pseudo-header and `segment` (whose checksum field must be
    /// zero). UDP callers map a result of 0 to 0xffff (RFC 768).
    pub fn l4_v4(src: [u8; 4], dst: [u8; 4], protocol: u8, segment: &[u8]) -> u16 {
        finish(add(
            pseudo_v4(src, dst, protocol, segment.len() as u16),
            segment,
        ))
    }

    /// TCP/UDP/ICMPv6 checksum over the IPv6 pseudo-header and `segment` (checksum field zero).
    pub fn l4_v6(src: [u8; 16], dst: [u8; 16], next_header: u8, segment: &[u8]) -> u16 {
        finish(add(
            pseudo_v6(src, dst, next_header, segment.len() as u32),
            segment,
        ))
    }
}

/// An IPv4 header. `None` fields are computed at build time.
#[derive(Clone, Debug)]
pub struct Ipv4 {
    pub src: [u8; 4],
    pub dst: [u8; 4],
    /// Version nibble; 4 unless a case wants a mismatch.
    pub version: u8,
    /// IHL in 32-bit words; `None` = 5 + options.
    pub ihl: Option<u8>,
    pub tos: u8,
    /// `None` = header + options + L4 (before any `truncate`).
    pub total_len: Option<u16>,
    pub id: u16,
    /// Flags (3 bits: reserved, DF, MF) and fragment offset (13 bits, 8-byte units), as on the
    /// wire.
    pub flags_frag: u16,
    pub ttl: u8,
    /// `None` = the L4 layer's protocol, or [`proto::EXPERIMENTAL`] without one.
    pub protocol: Option<u8>,
    /// `None` = the correct header checksum.
    pub checksum: Option<u16>,
    /// Raw option bytes, zero-padded (EOL) to a multiple of 4.
    pub options: Vec<u8>,
}

impl Ipv4 {
    pub fn new(src: [u8; 4], dst: [u8; 4]) -> Self {
        Ipv4 {
            src,
            dst,
            version: 4,
            ihl: None,
            tos: 0,
            total_len: None,
            id: 0x1234,
            flags_frag: 0,
            ttl: 64,
            protocol: None,
            checksum: None,
            options: Vec::new(),
        }
    }
}

/// One IPv6 extension header. The next-header byte is always filled in by the builder.
#[derive(Clone, Debug)]
pub enum Ipv6Ext {
    /// Hop-by-hop options, `8 * (len_units + 1)` bytes, filled with a PadN option.
    HopByHop { len_units: u8 },
    /// Routing header (RFC 8200 layout) carrying `addresses` and `segments_left`.
    Routing {
        routing_type: u8,
        segments_left: u8,
        addresses: Vec<[u8; 16]>,
    },
    /// Destination options, `8 * (len_units + 1)` bytes, filled with a PadN option.
    DestOpts { len_units: u8 },
    /// Fragment header: offset in 8-byte units, more-fragments flag, identification.
    Fragment { offset: u16, more: bool, id: u32 },
    /// Any header `kind` (its protocol number) with `body` verbatim after the next-header byte:
    /// for a header-extension-length byte that lies.
    Raw { kind: u8, body: Vec<u8> },
}

impl Ipv6Ext {
    /// The smallest hop-by-hop header (8 bytes).
    pub fn hop_by_hop() -> Self {
        Ipv6Ext::HopByHop { len_units: 0 }
    }

    /// The smallest destination-options header (8 bytes).
    pub fn dest_opts() -> Self {
        Ipv6Ext::DestOpts { len_units: 0 }
    }

    /// A type-4 (segment routing) header with one address and nothing left to visit, so the
    /// IPv6 destination stays the final destination for the pseudo-header.
    pub fn routing(address: [u8; 16]) -> Self {
        Ipv6Ext::Routing {
            routing_type: 4,
            segments_left: 0,
            addresses: vec![address],
        }
    }

    /// A fragment header.
    pub fn fragment(offset: u16, more: bool, id: u32) -> Self {
        Ipv6Ext::Fragment { offset, more, id }
    }

    /// Protocol number of this header (what the previous header's next-header byte says).
    pub fn kind(&self) -> u8 {
        match self {
            Ipv6Ext::HopByHop { .. } => proto::HOPOPTS,
            Ipv6Ext::Routing { .. } => proto::ROUTING,
            Ipv6Ext::DestOpts { .. } => proto::DSTOPTS,
            Ipv6Ext::Fragment { .. } => proto::FRAGMENT,
            Ipv6Ext::Raw { kind, .. } => *kind,
        }
    }

    fn write(&self, next: u8, out: &mut Vec<u8>) {
        out.push(next);
        match self {
            Ipv6Ext::HopByHop { len_units } | Ipv6Ext::DestOpts { len_units } => {
                let total = 8 * (usize::from(*len_units) + 1);
                out.push(*len_units);
                // PadN (type 1) covering the remaining `total - 2` bytes.
                out.push(1);
                out.push((total - 4) as u8);
                out.extend(std::iter::repeat_n(0, total - 4));
            }
            Ipv6Ext::Routing {
                routing_type,
                segments_left,
                addresses,
            } => {
                out.push((2 * addresses.len()) as u8);
                out.push(*routing_type);
                out.push(*segments_left);
                out.extend_from_slice(&[0; 4]);
                for a in addresses {
                    out.extend_from_slice(a);
                }
            }
            Ipv6Ext::Fragment { offset, more, id } => {
                out.push(0);
                let off_flags = (offset << 3) | u16::from(*more);
                out.extend_from_slice(&off_flags.to_be_bytes());
                out.extend_from_slice(&id.to_be_bytes());
            }
            Ipv6Ext::Raw { body, .. } => out.extend_from_slice(body),
        }
    }
}

/// An IPv6 header and its extension-header chain. `None` fields are computed at build time.
#[derive(Clone, Debug)]
pub struct Ipv6 {
    pub src: [u8; 16],
    pub dst: [u8; 16],
    /// Version nibble; 6 unless a case wants a mismatch.
    pub version: u8,
    pub traffic_class: u8,
    /// 20 bits.
    pub flow_label: u32,
    /// `None` = extension headers + L4 (before any `truncate`).
    pub payload_len: Option<u16>,
    /// Next header after the last extension header: `None` = the L4 layer's protocol, or
    /// [`proto::NO_NEXT`] without one.
    pub next_header: Option<u8>,
    pub hop_limit: u8,
    /// Extension headers in wire order.
    pub ext: Vec<Ipv6Ext>,
}

impl Ipv6 {
    pub fn new(src: [u8; 16], dst: [u8; 16]) -> Self {
        Ipv6 {
            src,
            dst,
            version: 6,
            traffic_class: 0,
            flow_label: 0,
            payload_len: None,
            next_header: None,
            hop_limit: 64,
            ext: Vec::new(),
        }
    }
}

/// A TCP header. `None` fields are computed at build time.
#[derive(Clone, Debug)]
pub struct Tcp {
    pub sport: u16,
    pub dport: u16,
    pub seq: u32,
    pub ack: u32,
    /// Data offset in 32-bit words; `None` = 5 + options.
    pub data_offset: Option<u8>,
    pub flags: u8,
    pub window: u16,
    pub urgent: u16,
    /// Raw option bytes, zero-padded (EOL) to a multiple of 4.
    pub options: Vec<u8>,
}

/// A UDP header. `None` length = header + payload.
#[derive(Clone, Debug)]
pub struct Udp {
    pub sport: u16,
    pub dport: u16,
    pub len: Option<u16>,
}

/// An ICMP or ICMPv6 header: type, code and the 4 type-specific bytes (echo id + sequence).
#[derive(Clone, Debug)]
pub struct Icmp {
    pub icmp_type: u8,
    pub code: u8,
    pub rest: [u8; 4],
}

#[derive(Clone, Debug)]
enum L3 {
    V4(Ipv4),
    V6(Ipv6),
}

#[derive(Clone, Debug)]
enum L4 {
    Tcp(Tcp),
    Udp(Udp),
    Icmp(Icmp),
    Icmpv6(Icmp),
}

impl L4 {
    fn protocol(&self) -> u8 {
        match self {
            L4::Tcp(_) => proto::TCP,
            L4::Udp(_) => proto::UDP,
            L4::Icmp(_) => proto::ICMP,
            L4::Icmpv6(_) => proto::ICMPV6,
        }
    }

    /// Header followed by `payload`, checksum field zero; returns the checksum field offset.
    fn write(&self, payload: &[u8], out: &mut Vec<u8>) -> usize {
        match self {
            L4::Tcp(t) => {
                let mut options = t.options.clone();
                options.resize(options.len().div_ceil(4) * 4, 0);
                let doff = t.data_offset.unwrap_or((5 + options.len() / 4) as u8);
                out.extend_from_slice(&t.sport.to_be_bytes());
                out.extend_from_slice(&t.dport.to_be_bytes());
                out.extend_from_slice(&t.seq.to_be_bytes());
                out.extend_from_slice(&t.ack.to_be_bytes());
                out.push(doff << 4);
                out.push(t.flags);
                out.extend_from_slice(&t.window.to_be_bytes());
                out.extend_from_slice(&[0, 0]);
                out.extend_from_slice(&t.urgent.to_be_bytes());
                out.extend_from_slice(&options);
                out.extend_from_slice(payload);
                16
            }
            L4::Udp(u) => {
                let len = u.len.unwrap_or((8 + payload.len()) as u16);
                out.extend_from_slice(&u.sport.to_be_bytes());
                out.extend_from_slice(&u.dport.to_be_bytes());
                out.extend_from_slice(&len.to_be_bytes());
                out.extend_from_slice(&[0, 0]);
                out.extend_from_slice(payload);
                6
            }
            L4::Icmp(i) | L4::Icmpv6(i) => {
                out.push(i.icmp_type);
                out.push(i.code);
                out.extend_from_slice(&[0, 0]);
                out.extend_from_slice(&i.rest);
                out.extend_from_slice(payload);
                2
            }
        }
    }
}

/// A frame under construction. Start with [`Pkt::eth`], end with [`Pkt::build`].
#[derive(Clone, Debug)]
pub struct Pkt {
    dst_mac: [u8; 6],
    src_mac: [u8; 6],
    /// (TPID, TCI), outermost first.
    vlans: Vec<(u16, u16)>,
    ethertype: Option<u16>,
    l3: Option<L3>,
    l4: Option<L4>,
    l4_checksum: Option<u16>,
    payload: Vec<u8>,
    l4_cut: Option<usize>,
    pad_to: Option<usize>,
    truncate: Option<usize>,
}

impl Pkt {
    /// An Ethernet frame from [`DEFAULT_SRC_MAC`] to [`DEFAULT_DST_MAC`], nothing inside yet.
    pub fn eth() -> Self {
        Pkt {
            dst_mac: DEFAULT_DST_MAC,
            src_mac: DEFAULT_SRC_MAC,
            vlans: Vec::new(),
            ethertype: None,
            l3: None,
            l4: None,
            l4_checksum: None,
            payload: Vec::new(),
            l4_cut: None,
            pad_to: None,
            truncate: None,
        }
    }

    /// Sets the destination and source MAC addresses.
    pub fn macs(mut self, dst: [u8; 6], src: [u8; 6]) -> Self {
        self.dst_mac = dst;
        self.src_mac = src;
        self
    }

    /// Overrides the ethertype after the VLAN tags (default: from the L3 layer, or
    /// [`ethertype::LOCAL_EXPERIMENTAL`] without one).
    pub fn ethertype(mut self, ethertype: u16) -> Self {
        self.ethertype = Some(ethertype);
        self
    }

    /// Appends a VLAN tag (inside the ones added before): `tpid` 0x8100 / 0x88a8 / 0x9100.
    pub fn vlan(mut self, tpid: u16, tci: u16) -> Self {
        self.vlans.push((tpid, tci));
        self
    }

    /// An IPv4 header with default fields (see [`Ipv4::new`]).
    pub fn ipv4(self, src: [u8; 4], dst: [u8; 4]) -> Self {
        self.ipv4_with(Ipv4::new(src, dst))
    }

    /// An explicit IPv4 header.
    pub fn ipv4_with(mut self, h: Ipv4) -> Self {
        self.l3 = Some(L3::V4(h));
        self
    }

    /// An IPv6 header with default fields (see [`Ipv6::new`]).
    pub fn ipv6(self, src: [u8; 16], dst: [u8; 16]) -> Self {
        self.ipv6_with(Ipv6::new(src, dst))
    }

    /// An explicit IPv6 header.
    pub fn ipv6_with(mut self, h: Ipv6) -> Self {
        self.l3 = Some(L3::V6(h));
        self
    }

    fn v4_mut(&mut self, what: &str) -> &mut Ipv4 {
        match &mut self.l3 {
            Some(L3::V4(h)) => h,
            _ => panic!("Pkt::{what} needs an IPv4 layer; call .ipv4() first"),
        }
    }

    fn v6_mut(&mut self, what: &str) -> &mut Ipv6 {
        match &mut self.l3 {
            Some(L3::V6(h)) => h,
            _ => panic!("Pkt::{what} needs an IPv6 layer; call .ipv6() first"),
        }
    }

    /// IPv4 options (zero-padded to a multiple of 4; IHL follows unless overridden).
    pub fn ipv4_options(mut self, options: &[u8]) -> Self {
        self.v4_mut("ipv4_options").options = options.to_vec();
        self
    }

    /// Overrides the IPv4 IHL (32-bit words); the header bytes written do not change.
    pub fn ihl(mut self, ihl: u8) -> Self {
        self.v4_mut("ihl").ihl = Some(ihl);
        self
    }

    /// Overrides the IPv4 total length.
    pub fn ip_total_len(mut self, len: u16) -> Self {
        self.v4_mut("ip_total_len").total_len = Some(len);
        self
    }

    /// Sets the IPv4 flags + fragment offset word as on the wire (`0x4000` = DF).
    pub fn ipv4_flags_frag(mut self, flags_frag: u16) -> Self {
        self.v4_mut("ipv4_flags_frag").flags_frag = flags_frag;
        self
    }

    /// Makes the IPv4 packet a fragment: `offset` in 8-byte units, MF flag.
    pub fn ipv4_fragment(self, offset: u16, more: bool) -> Self {
        self.ipv4_flags_frag((u16::from(more) << 13) | (offset & 0x1fff))
    }

    /// Overrides the IPv4 header checksum (default: correct).
    pub fn ipv4_checksum(mut self, checksum: u16) -> Self {
        self.v4_mut("ipv4_checksum").checksum = Some(checksum);
        self
    }

    /// Sets the IPv4 identification field.
    pub fn ip_id(mut self, id: u16) -> Self {
        self.v4_mut("ip_id").id = id;
        self
    }

    /// Sets the IPv4 TTL or IPv6 hop limit.
    pub fn ttl(mut self, ttl: u8) -> Self {
        match &mut self.l3 {
            Some(L3::V4(h)) => h.ttl = ttl,
            Some(L3::V6(h)) => h.hop_limit = ttl,
            None => panic!("Pkt::ttl needs an IP layer; call .ipv4() or .ipv6() first"),
        }
        self
    }

    /// Overrides the IP version nibble (of either family).
    pub fn ip_version(mut self, version: u8) -> Self {
        match &mut self.l3 {
            Some(L3::V4(h)) => h.version = version,
            Some(L3::V6(h)) => h.version = version,
            None => panic!("Pkt::ip_version needs an IP layer; call .ipv4() or .ipv6() first"),
        }
        self
    }

    /// Overrides the IPv4 protocol, or the IPv6 next header after the extension headers.
    pub fn ip_proto(mut self, protocol: u8) -> Self {
        match &mut self.l3 {
            Some(L3::V4(h)) => h.protocol = Some(protocol),
            Some(L3::V6(h)) => h.next_header = Some(protocol),
            None => panic!("Pkt::ip_proto needs an IP layer; call .ipv4() or .ipv6() first"),
        }
        self
    }

    /// Appends an IPv6 extension header to the chain.
    pub fn ipv6_ext(mut self, ext: Ipv6Ext) -> Self {
        self.v6_mut("ipv6_ext").ext.push(ext);
        self
    }

    /// Overrides the IPv6 payload length.
    pub fn ipv6_payload_len(mut self, len: u16) -> Self {
        self.v6_mut("ipv6_payload_len").payload_len = Some(len);
        self
    }

    /// A TCP header (seq 1, ack 0, window 65535).
    pub fn tcp(mut self, sport: u16, dport: u16, flags: u8) -> Self {
        self.l4 = Some(L4::Tcp(Tcp {
            sport,
            dport,
            seq: 1,
            ack: 0,
            data_offset: None,
            flags,
            window: 0xffff,
            urgent: 0,
            options: Vec::new(),
        }));
        self
    }

    fn tcp_mut(&mut self, what: &str) -> &mut Tcp {
        match &mut self.l4 {
            Some(L4::Tcp(t)) => t,
            _ => panic!("Pkt::{what} needs a TCP layer; call .tcp() first"),
        }
    }

    /// TCP options (zero-padded to a multiple of 4; data offset follows unless overridden).
    pub fn tcp_options(mut self, options: &[u8]) -> Self {
        self.tcp_mut("tcp_options").options = options.to_vec();
        self
    }

    /// Overrides the TCP data offset (32-bit words); the header bytes written do not change.
    pub fn tcp_data_offset(mut self, words: u8) -> Self {
        self.tcp_mut("tcp_data_offset").data_offset = Some(words);
        self
    }

    /// Sets the TCP window.
    pub fn tcp_window(mut self, window: u16) -> Self {
        self.tcp_mut("tcp_window").window = window;
        self
    }

    /// Sets the TCP sequence and acknowledgement numbers.
    pub fn tcp_seq_ack(mut self, seq: u32, ack: u32) -> Self {
        let t = self.tcp_mut("tcp_seq_ack");
        t.seq = seq;
        t.ack = ack;
        self
    }

    /// A UDP header.
    pub fn udp(mut self, sport: u16, dport: u16) -> Self {
        self.l4 = Some(L4::Udp(Udp {
            sport,
            dport,
            len: None,
        }));
        self
    }

    /// Overrides the UDP length field.
    pub fn udp_len(mut self, len: u16) -> Self {
        match &mut self.l4 {
            Some(L4::Udp(u)) => u.len = Some(len),
            _ => panic!("Pkt::udp_len needs a UDP layer; call .udp() first"),
        }
        self
    }

    /// An ICMP echo request.
    pub fn icmp_echo(self, id: u16, seq: u16) -> Self {
        self.icmp(icmp_type::ECHO_REQUEST, 0, echo_rest(id, seq))
    }

    /// Any ICMP message: type, code and the 4 type-specific bytes.
    pub fn icmp(mut self, icmp_type: u8, code: u8, rest: [u8; 4]) -> Self {
        self.l4 = Some(L4::Icmp(Icmp {
            icmp_type,
            code,
            rest,
        }));
        self
    }

    /// An ICMPv6 echo request (type 128).
    pub fn icmpv6_echo(self, id: u16, seq: u16) -> Self {
        self.icmpv6(icmp_type::V6_ECHO_REQUEST, 0, echo_rest(id, seq))
    }

    /// A neighbour solicitation (type 135) for `target`.
    pub fn icmpv6_neighbour_solicit(self, target: [u8; 16]) -> Self {
        self.icmpv6(icmp_type::V6_NEIGHBOUR_SOLICIT, 0, [0; 4])
            .payload(&target)
    }

    /// Any ICMPv6 message: type, code and the 4 type-specific bytes.
    pub fn icmpv6(mut self, icmp_type: u8, code: u8, rest: [u8; 4]) -> Self {
        self.l4 = Some(L4::Icmpv6(Icmp {
            icmp_type,
            code,
            rest,
        }));
        self
    }

    /// Overrides the L4 checksum (default: correct).
    pub fn l4_checksum(mut self, checksum: u16) -> Self {
        self.l4_checksum = Some(checksum);
        self
    }

    /// Appends payload bytes: after the L4 header, else after the L3 header, else after the
    /// Ethernet header.
    pub fn payload(mut self, bytes: &[u8]) -> Self {
        self.payload.extend_from_slice(bytes);
        self
    }

    /// An ARP request (Ethernet/IPv4) as the frame's payload, ethertype 0x0806.
    pub fn arp_request(self, sender_ip: [u8; 4], target_ip: [u8; 4]) -> Self {
        let sender_mac = self.src_mac;
        let mut body = vec![0, 1, 0x08, 0x00, 6, 4, 0, 1];
        body.extend_from_slice(&sender_mac);
        body.extend_from_slice(&sender_ip);
        body.extend_from_slice(&[0; 6]);
        body.extend_from_slice(&target_ip);
        self.ethertype(ethertype::ARP).payload(&body)
    }

    /// Keeps only the first `n` bytes of the L4 segment (header + payload) *before* the IP
    /// lengths are computed: an IP packet that is consistent but ends inside its L4 header.
    /// The L4 checksum is the one of the full segment.
    pub fn cut_l4(mut self, n: usize) -> Self {
        self.l4_cut = Some(n);
        self
    }

    /// Pads the frame with zeros to at least `len` bytes after everything else (IP lengths do
    /// not cover the padding).
    pub fn pad_to(mut self, len: usize) -> Self {
        self.pad_to = Some(len);
        self
    }

    /// Pads to the 60-byte Ethernet minimum.
    pub fn pad_min(self) -> Self {
        self.pad_to(ETH_MIN_FRAME)
    }

    /// Cuts the finished frame to `len` bytes, after every length and checksum was computed.
    pub fn truncate(mut self, len: usize) -> Self {
        self.truncate = Some(len);
        self
    }

    /// The frame's bytes.
    pub fn build(&self) -> Vec<u8> {
        let l3_payload = self.l3_payload();
        let mut frame = Vec::with_capacity(64 + l3_payload.len());
        frame.extend_from_slice(&self.dst_mac);
        frame.extend_from_slice(&self.src_mac);
        for (tpid, tci) in &self.vlans {
            frame.extend_from_slice(&tpid.to_be_bytes());
            frame.extend_from_slice(&tci.to_be_bytes());
        }
        let ethertype = self.ethertype.unwrap_or(match &self.l3 {
            Some(L3::V4(_)) => ethertype::IPV4,
            Some(L3::V6(_)) => ethertype::IPV6,
            None => ethertype::LOCAL_EXPERIMENTAL,
        });
        frame.extend_from_slice(&ethertype.to_be_bytes());
        match &self.l3 {
            Some(L3::V4(h)) => write_ipv4(h, self.l4_protocol(), &l3_payload, &mut frame),
            Some(L3::V6(h)) => write_ipv6(h, self.l4_protocol(), &l3_payload, &mut frame),
            None => frame.extend_from_slice(&l3_payload),
        }
        if let Some(min) = self.pad_to
            && frame.len() < min
        {
            frame.resize(min, 0);
        }
        if let Some(len) = self.truncate {
            frame.truncate(len);
        }
        frame
    }

    fn l4_protocol(&self) -> Option<u8> {
        self.l4.as_ref().map(L4::protocol)
    }

    /// What follows the IP header (for IPv6 the extension headers are not included): the L4
    /// segment with its checksum, or the raw payload.
    fn l3_payload(&self) -> Vec<u8> {
        let Some(l4) = &self.l4 else {
            return self.payload.clone();
        };
        let mut seg = Vec::with_capacity(60 + self.payload.len());
        let csum_at = l4.write(&self.payload, &mut seg);
        let csum = match self.l4_checksum {
            Some(c) => c,
            None => match (l4, &self.l3) {
                (L4::Icmp(_), _) => checksum::internet(&seg),
                (_, Some(L3::V4(h))) => {
                    udp_zero(l4, checksum::l4_v4(h.src, h.dst, l4.protocol(), &seg))
                }
                (_, Some(L3::V6(h))) => {
                    udp_zero(l4, checksum::l4_v6(h.src, h.dst, l4.protocol(), &seg))
                }
                // No IP layer: there is no pseudo-header to cover; leave the field zero.
                (_, None) => 0,
            },
        };
        seg[csum_at..csum_at + 2].copy_from_slice(&csum.to_be_bytes());
        if let Some(n) = self.l4_cut {
            seg.truncate(n);
        }
        seg
    }
}

/// RFC 768: a computed UDP checksum of zero is sent as all ones (zero means "none").
fn udp_zero(l4: &L4, csum: u16) -> u16 {
    match (l4, csum) {
        (L4::Udp(_), 0) => 0xffff,
        _ => csum,
    }
}

fn echo_rest(id: u16, seq: u16) -> [u8; 4] {
    let [a, b] = id.to_be_bytes();
    let [c, d] = seq.to_be_bytes();
    [a, b, c, d]
}

fn write_ipv4(h: &Ipv4, l4_proto: Option<u8>, payload: &[u8], out: &mut Vec<u8>) {
    let mut options = h.options.clone();
    options.resize(options.len().div_ceil(4) * 4, 0);
    let hdr_len = 20 + options.len();
    let ihl = h.ihl.unwrap_or((hdr_len / 4) as u8);
    let total_len = h.total_len.unwrap_or((hdr_len + payload.len()) as u16);
    let protocol = h.protocol.or(l4_proto).unwrap_or(proto::EXPERIMENTAL);
    let start = out.len();
    out.push((h.version << 4) | (ihl & 0x0f));
    out.push(h.tos);
    out.extend_from_slice(&total_len.to_be_bytes());
    out.extend_from_slice(&h.id.to_be_bytes());
    out.extend_from_slice(&h.flags_frag.to_be_bytes());
    out.push(h.ttl);
    out.push(protocol);
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(&h.src);
    out.extend_from_slice(&h.dst);
    out.extend_from_slice(&options);
    let csum = h
        .checksum
        .unwrap_or_else(|| checksum::internet(&out[start..]));
    out[start + 10..start + 12].copy_from_slice(&csum.to_be_bytes());
    out.extend_from_slice(payload);
}

fn write_ipv6(h: &Ipv6, l4_proto: Option<u8>, payload: &[u8], out: &mut Vec<u8>) {
    let mut ext = Vec::new();
    let last = h.next_header.or(l4_proto).unwrap_or(proto::NO_NEXT);
    for (i, e) in h.ext.iter().enumerate() {
        let next = h.ext.get(i + 1).map_or(last, Ipv6Ext::kind);
        e.write(next, &mut ext);
    }
    let first = h.ext.first().map_or(last, Ipv6Ext::kind);
    let payload_len = h.payload_len.unwrap_or((ext.len() + payload.len()) as u16);
    let vtf = (u32::from(h.version) << 28)
        | (u32::from(h.traffic_class) << 20)
        | (h.flow_label & 0x000f_ffff);
    out.extend_from_slice(&vtf.to_be_bytes());
    out.extend_from_slice(&payload_len.to_be_bytes());
    out.push(first);
    out.push(h.hop_limit);
    out.extend_from_slice(&h.src);
    out.extend_from_slice(&h.dst);
    out.extend_from_slice(&ext);
    out.extend_from_slice(payload);
}

#[cfg(test)]
mod tests {
    use super::*;

    const A4: [u8; 4] = [192, 168, 0, 1];
    const B4: [u8; 4] = [192, 168, 0, 199];
    const A6: [u8; 16] = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
    const B6: [u8; 16] = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2];

    #[test]
    fn rfc1071_example_sum() {
        // RFC 1071 section 3: the words 0001 f203 f4f5 f6f7 sum to 0xddf2.
        let data = [0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7];
        assert_eq!(checksum::fold(checksum::add(0, &data)), 0xddf2);
        assert_eq!(checksum::internet(&data), !0xddf2);
    }

    #[test]
    fn odd_length_pads_with_zero() {
        assert_eq!(
            checksum::fold(checksum::add(0, &[0x12, 0x34, 0x56])),
            0x1234 + 0x5600
        );
    }

    #[test]
    fn known_ipv4_header_checksum() {
        // The classic example header: 192.168.0.1 -> 192.168.0.199, UDP, checksum 0xb861.
        let hdr = [
            0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0x00, 0x00, 0xc0, 0xa8,
            0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7,
        ];
        assert_eq!(checksum::internet(&hdr), 0xb861);

        let frame = Pkt::eth()
            .ipv4_with(Ipv4 {
                id: 0,
                flags_frag: 0x4000,
                total_len: Some(0x73),
                protocol: Some(proto::UDP),
                ..Ipv4::new(A4, B4)
            })
            .build();
        assert_eq!(
            &frame[14..34],
            &[&hdr[..10], &[0xb8, 0x61], &hdr[12..]].concat()[..]
        );
    }

    #[test]
    fn known_udp_checksum() {
        // 10.0.0.1:1000 -> 10.0.0.2:2000 "hi": pseudo 0a00+0001+0a00+0002+0011+000a,
        // header 03e8+07d0+000a, data 6869 -> sum 0x8849, checksum 0x77b6.
        let frame = Pkt::eth()
            .ipv4([10, 0, 0, 1], [10, 0, 0, 2])
            .udp(1000, 2000)
            .payload(b"hi")
            .build();
        assert_eq!(&frame[34 + 6..34 + 8], &[0x77, 0xb6]);
    }

    /// Sums the pseudo-header and segment of a built frame: 0 when the stored checksum is right.
    fn verify_v4(frame: &[u8], l3: usize, proto: u8) -> u16 {
        let ihl = usize::from(frame[l3] & 0x0f) * 4;
        let total = usize::from(u16::from_be_bytes([frame[l3 + 2], frame[l3 + 3]]));
        let seg = &frame[l3 + ihl..l3 + total];
        let src = frame[l3 + 12..l3 + 16].try_into().unwrap();
        let dst = frame[l3 + 16..l3 + 20].try_into().unwrap();
        checksum::finish(checksum::add(
            checksum::pseudo_v4(src, dst, proto, seg.len() as u16),
            seg,
        ))
    }

    #[test]
    fn ipv4_header_checksum_verifies_with_options() {
        let frame = Pkt::eth()
            .ipv4(A4, B4)
            .ipv4_options(&[0x94, 0x04, 0, 0, 1])
            .tcp(1, 2, 0)
            .build();
        assert_eq!(frame[14], 0x47, "IHL follows the padded options");
        assert_eq!(checksum::internet(&frame[14..14 + 28]), 0);
        assert_eq!(verify_v4(&frame, 14, proto::TCP), 0);
    }

    #[test]
    fn tcp_udp_checksums_verify_over_v4_pseudo_header() {
        let tcp = Pkt::eth()
            .vlan(0x8100, 7)
            .ipv4(A4, B4)
            .tcp(40000, 443, tcp_flags::SYN)
            .tcp_options(&[2, 4, 5, 0xb4, 1])
            .payload(b"odd")
            .build();
        assert_eq!(verify_v4(&tcp, 18, proto::TCP), 0);
        let udp = Pkt::eth()
            .ipv4(A4, B4)
            .udp(53, 5353)
            .payload(b"query")
            .build();
        assert_eq!(verify_v4(&udp, 14, proto::UDP), 0);
    }

    #[test]
    fn icmp_checksum_covers_message_only() {
        let frame = Pkt::eth()
            .ipv4(A4, B4)
            .icmp_echo(0x1234, 1)
            .payload(b"ping")
            .build();
        assert_eq!(checksum::internet(&frame[34..]), 0);
    }

    #[test]
    fn v6_checksums_verify_over_pseudo_header_after_ext_chain() {
        for pkt in [
            Pkt::eth()
                .ipv6(A6, B6)
                .tcp(1, 2, tcp_flags::ACK)
                .payload(b"x"),
            Pkt::eth()
                .ipv6(A6, B6)
                .ipv6_ext(Ipv6Ext::hop_by_hop())
                .udp(1, 2)
                .payload(b"xyz"),
            Pkt::eth()
                .ipv6(A6, B6)
                .ipv6_ext(Ipv6Ext::dest_opts())
                .icmpv6_echo(9, 9),
            Pkt::eth().ipv6(A6, B6).icmpv6_neighbour_solicit(B6),
        ] {
            let frame = pkt.build();
            let plen = usize::from(u16::from_be_bytes([frame[18], frame[19]]));
            assert_eq!(frame.len(), 54 + plen);
            // Walk the chain the simple way: every ext header here has a length byte.
            let (mut next, mut off) = (frame[20], 54);
            while matches!(next, proto::HOPOPTS | proto::DSTOPTS | proto::ROUTING) {
                next = frame[off];
                off += (usize::from(frame[off + 1]) + 1) * 8;
            }
            let seg = &frame[off..];
            let sum = checksum::add(checksum::pseudo_v6(A6, B6, next, seg.len() as u32), seg);
            assert_eq!(checksum::finish(sum), 0, "{pkt:?}");
        }
    }

    #[test]
    fn ext_chain_links_next_headers() {
        let frame = Pkt::eth()
            .ipv6(A6, B6)
            .ipv6_ext(Ipv6Ext::hop_by_hop())
            .ipv6_ext(Ipv6Ext::routing(B6))
            .ipv6_ext(Ipv6Ext::fragment(0, true, 7))
            .udp(1, 2)
            .build();
        assert_eq!(frame[20], proto::HOPOPTS);
        assert_eq!(frame[54], proto::ROUTING);
        assert_eq!(&frame[62..64], &[proto::FRAGMENT, 2]);
        assert_eq!(frame[62 + 24], proto::UDP);
        assert_eq!(&frame[62 + 24 + 2..62 + 24 + 4], &[0, 1], "offset 0, M set");
        assert_eq!(u16::from_be_bytes([frame[18], frame[19]]), 8 + 24 + 8 + 8);
    }

    #[test]
    fn vlan_tags_sit_between_macs_and_ethertype() {
        let frame = Pkt::eth()
            .vlan(0x88a8, 100)
            .vlan(0x8100, 200)
            .ipv4(A4, B4)
            .build();
        assert_eq!(
            &frame[12..22],
            &[0x88, 0xa8, 0, 100, 0x81, 0x00, 0, 200, 0x08, 0x00]
        );
    }

    #[test]
    fn overrides_are_verbatim() {
        let frame = Pkt::eth()
            .ipv4(A4, B4)
            .ihl(4)
            .ip_total_len(19)
            .udp(1, 2)
            .build();
        assert_eq!(frame[14], 0x44);
        assert_eq!(&frame[16..18], &[0, 19]);
        assert_eq!(
            checksum::internet(&frame[14..34]),
            0,
            "checksum covers the overrides"
        );
        let frame = Pkt::eth()
            .ipv4(A4, B4)
            .tcp(1, 2, 0)
            .tcp_data_offset(4)
            .build();
        assert_eq!(frame[34 + 12], 0x40);
    }

    #[test]
    fn cut_padding_and_truncation() {
        let cut = Pkt::eth().ipv4(A4, B4).tcp(1, 2, 0).cut_l4(10).build();
        assert_eq!(cut.len(), 14 + 20 + 10);
        assert_eq!(&cut[16..18], &[0, 30]);
        let padded = Pkt::eth().ipv4(A4, B4).udp(1, 2).pad_min().build();
        assert_eq!(padded.len(), 60);
        assert_eq!(
            &padded[16..18],
            &[0, 28],
            "padding is outside the IP packet"
        );
        let short = Pkt::eth().ipv4(A4, B4).udp(1, 2).truncate(20).build();
        assert_eq!(short.len(), 20);
    }
}
