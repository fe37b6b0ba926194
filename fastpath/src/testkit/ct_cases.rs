//! The conntrack fixture table: packet sequences through the real entry points, each step
//! checked for its connection's entry, the `ct_stat` counters and the events it emits.
//!
//! Contract: expected TCP states are Linux's (`tcp_conntracks` in `nf_conntrack_proto_tcp.c`),
//! written out by hand and cross-checked, while the table is built, against the transcription
//! in [`fastpath_common::ct::tcp_step`] (a typo in a sequence panics with the step). Every
//! packet arrives on ifindex 1: BPF_PROG_TEST_RUN without a context runs XDP and TC programs on
//! the loopback device of the caller's network namespace, which is always ifindex 1.

use std::collections::BTreeMap;

use fastpath_common::{
    Hook,
    ct::{
        CT_F_ASSURED, CT_F_SEEN_REPLY, CtKey, DIR_ORIGINAL, DIR_REPLY, IFACE_F_CT_TC_EGRESS,
        IFACE_F_CT_TC_INGRESS, IFACE_F_CT_XDP, TcpStep, ct_event, ct_key, ct_stat, tcp_class,
        tcp_classify, tcp_state, tcp_step,
    },
};

use super::{
    fixture::{CtEntryExpect, CtExpect, CtSequence, CtStep, Seed},
    packet::{Ipv6Ext, Pkt, icmp_type, proto, tcp_flags},
};

/// The ifindex BPF_PROG_TEST_RUN reports for every test packet (XDP `ingress_ifindex`, TC
/// `skb->ifindex`): the loopback device, ifindex 1 in every network namespace.
pub const TEST_RUN_IFINDEX: u32 = 1;

const SYN: u8 = tcp_flags::SYN;
const SYNACK: u8 = tcp_flags::SYN | tcp_flags::ACK;
const ACK: u8 = tcp_flags::ACK;
const FIN: u8 = tcp_flags::FIN | tcp_flags::ACK;
const RST: u8 = tcp_flags::RST;
const RSTACK: u8 = tcp_flags::RST | tcp_flags::ACK;
const DATA: u8 = tcp_flags::PSH | tcp_flags::ACK;

use tcp_state::{
    CLOSE as CL, CLOSE_WAIT as CW, ESTABLISHED as ES, FIN_WAIT as FW, LAST_ACK as LA,
    SYN_RECV as SR, SYN_SENT as SS, SYN_SENT2 as S2, TIME_WAIT as TW,
};

/// Entry flags a step states (see [`CtEntryExpect::flags`]).
const NOFLAGS: u8 = 0;
const SEEN: u8 = CT_F_SEEN_REPLY;
const SEEN_ASSURED: u8 = CT_F_SEEN_REPLY | CT_F_ASSURED;

const NEW_EV: u8 = ct_event::NEW;
const EST_EV: u8 = ct_event::ESTABLISHED;
const CLOSED_EV: u8 = ct_event::CLOSED;

use ct_stat::{ASSURED, CLOSED, HITS, IGNORED, INVALID_NEW, INVALID_STATE, LOOKUPS, NEW, REOPENED};
/// Counter sets a step moves, each by one.
const CREATED: &[u32] = &[LOOKUPS, NEW];
const HIT: &[u32] = &[LOOKUPS, HITS];
const HIT_ASSURED: &[u32] = &[LOOKUPS, HITS, ASSURED];
const HIT_CLOSED: &[u32] = &[LOOKUPS, HITS, CLOSED];
const HIT_IGNORED: &[u32] = &[LOOKUPS, HITS, IGNORED];
const HIT_INVALID: &[u32] = &[LOOKUPS, HITS, INVALID_STATE];
const HIT_REOPENED: &[u32] = &[LOOKUPS, HITS, REOPENED];
const REFUSED: &[u32] = &[LOOKUPS, INVALID_NEW];
const LOOSE_PICKUP: &[u32] = &[LOOKUPS, NEW, ASSURED];

const A4: [u8; 4] = [10, 0, 0, 1];
const B4: [u8; 4] = [10, 0, 0, 2];
/// Higher than [`B4`]: a client on the key's `hi` side.
const C4: [u8; 4] = [10, 0, 0, 9];
const A6: [u8; 16] = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
const B6: [u8; 16] = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2];

/// Packet direction relative to the sequence's client (who sends the first packet).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dir {
    /// Client to server.
    O,
    /// Server to client.
    R,
}
use Dir::{O, R};

impl Dir {
    fn name(self) -> &'static str {
        match self {
            O => "orig",
            R => "reply",
        }
    }
}

/// A client/server pair: the connection a sequence's packets belong to.
#[derive(Clone, Copy, Debug)]
struct Flow {
    /// 4 or 6.
    family: u8,
    proto: u8,
    /// IPv4 in the first 4 bytes.
    client: [u8; 16],
    server: [u8; 16],
    /// Ports (TCP/UDP); for ICMP echo both hold the identifier.
    cport: u16,
    sport: u16,
}

fn v4(a: [u8; 4]) -> [u8; 16] {
    let mut out = [0; 16];
    out[..4].copy_from_slice(&a);
    out
}

impl Flow {
    fn v4(proto: u8, client: [u8; 4], cport: u16, server: [u8; 4], sport: u16) -> Self {
        Flow {
            family: 4,
            proto,
            client: v4(client),
            server: v4(server),
            cport,
            sport,
        }
    }

    fn v6(proto: u8, client: [u8; 16], cport: u16, server: [u8; 16], sport: u16) -> Self {
        Flow {
            family: 6,
            proto,
            client,
            server,
            cport,
            sport,
        }
    }

    fn icmp4(client: [u8; 4], server: [u8; 4], id: u16) -> Self {
        Flow::v4(proto::ICMP, client, id, server, id)
    }

    fn icmp6(client: [u8; 16], server: [u8; 16], id: u16) -> Self {
        Flow::v6(proto::ICMPV6, client, id, server, id)
    }

    /// The direction-independent key, as the datapath must compute it.
    fn key(&self) -> CtKey {
        ct_key(
            self.family,
            self.proto,
            &self.client,
            self.cport,
            &self.server,
            self.sport,
        )
        .0
    }

    /// Ethernet + IP header from the sender of `dir`.
    fn ip(&self, dir: Dir) -> Pkt {
        let (src, dst) = match dir {
            O => (self.client, self.server),
            R => (self.server, self.client),
        };
        if self.family == 4 {
            let a = |x: [u8; 16]| [x[0], x[1], x[2], x[3]];
            Pkt::eth().ipv4(a(src), a(dst))
        } else {
            Pkt::eth().ipv6(src, dst)
        }
    }

    fn ports(&self, dir: Dir) -> (u16, u16) {
        match dir {
            O => (self.cport, self.sport),
            R => (self.sport, self.cport),
        }
    }

    fn tcp(&self, dir: Dir, flags: u8, payload: &[u8]) -> Vec<u8> {
        let (s, d) = self.ports(dir);
        self.ip(dir).tcp(s, d, flags).payload(payload).build()
    }

    fn udp(&self, dir: Dir, payload: &[u8]) -> Vec<u8> {
        let (s, d) = self.ports(dir);
        self.ip(dir).udp(s, d).payload(payload).build()
    }

    /// An echo request from the client (`O`) or an echo reply from the server (`R`).
    fn echo(&self, dir: Dir, seq: u16) -> Vec<u8> {
        let [a, b] = self.cport.to_be_bytes();
        let [c, d] = seq.to_be_bytes();
        let rest = [a, b, c, d];
        let p = self.ip(dir);
        let p = match (self.family, dir) {
            (4, O) => p.icmp(icmp_type::ECHO_REQUEST, 0, rest),
            (4, R) => p.icmp(icmp_type::ECHO_REPLY, 0, rest),
            (_, O) => p.icmpv6(icmp_type::V6_ECHO_REQUEST, 0, rest),
            (_, R) => p.icmpv6(icmp_type::V6_ECHO_REPLY, 0, rest),
        };
        p.payload(b"ping").build()
    }
}

fn tcp4() -> Flow {
    Flow::v4(proto::TCP, A4, 40000, B4, 80)
}

fn tcp6() -> Flow {
    Flow::v6(proto::TCP, A6, 40000, B6, 443)
}

fn udp4() -> Flow {
    Flow::v4(proto::UDP, A4, 5353, B4, 53)
}

fn udp6() -> Flow {
    Flow::v6(proto::UDP, A6, 5353, B6, 53)
}

/// `SYN|ACK` style name of TCP flags.
fn flags_name(flags: u8) -> String {
    let names: Vec<&str> = [
        (tcp_flags::SYN, "SYN"),
        (tcp_flags::FIN, "FIN"),
        (tcp_flags::RST, "RST"),
        (tcp_flags::PSH, "PSH"),
        (tcp_flags::ACK, "ACK"),
        (tcp_flags::URG, "URG"),
    ]
    .into_iter()
    .filter(|(bit, _)| flags & bit != 0)
    .map(|(_, n)| n)
    .collect();
    if names.is_empty() {
        "no flags".to_owned()
    } else {
        names.join("|")
    }
}

/// Linux's view of one TCP connection while a sequence is written: its state and whether the
/// client is the originator.
#[derive(Clone, Copy, Debug)]
struct TcpModel {
    state: u8,
    client_is_orig: bool,
}

/// Builds one [`CtSequence`] packet by packet on a current flow and hook.
struct Seq {
    name: &'static str,
    seed: Seed,
    hook: Hook,
    flow: Flow,
    steps: Vec<CtStep>,
    /// Per TCP connection: what `tcp_step` says, to check every stated state against.
    model: BTreeMap<CtKey, TcpModel>,
}

impl Seq {
    /// A sequence on XDP, with XDP tracking on the test-run interface.
    fn xdp(name: &'static str, flow: Flow) -> Self {
        Seq::new(
            name,
            Seed::iface(TEST_RUN_IFINDEX, IFACE_F_CT_XDP),
            Hook::Xdp,
            flow,
        )
    }

    fn new(name: &'static str, seed: Seed, hook: Hook, flow: Flow) -> Self {
        Seq {
            name,
            seed,
            hook,
            flow,
            steps: Vec::new(),
            model: BTreeMap::new(),
        }
    }

    /// Later packets go through `hook`.
    fn on(mut self, hook: Hook) -> Self {
        self.hook = hook;
        self
    }

    /// Later packets belong to `flow`.
    fn flow(mut self, flow: Flow) -> Self {
        self.flow = flow;
        self
    }

    fn push(
        mut self,
        what: String,
        input: Vec<u8>,
        expect: CtExpect,
        stats: &[u32],
        events: &[(u8, u8)],
    ) -> Self {
        self.steps.push(CtStep {
            what,
            hook: self.hook,
            input,
            expect,
            expect_stats: stats.iter().map(|&code| (code, 1)).collect(),
            expect_events: events.to_vec(),
            expect_table_len: None,
            skb_ingress_ifindex: None,
        });
        self
    }

    fn entry(&self, tcp_state: Option<u8>, flags: u8) -> CtExpect {
        CtExpect::Entry(
            self.flow.key(),
            CtEntryExpect {
                tcp_state,
                flags,
                ..CtEntryExpect::default()
            },
        )
    }

    /// A TCP packet without payload; the connection ends in `state` with `flags`.
    fn tcp(
        self,
        dir: Dir,
        flags: u8,
        state: u8,
        ct_flags: u8,
        stats: &[u32],
        events: &[(u8, u8)],
    ) -> Self {
        self.tcp_segment(dir, flags, &[], state, ct_flags, stats, events)
    }

    /// A PSH|ACK data segment in an existing connection (no event).
    fn tcp_data(self, dir: Dir, payload: &[u8], state: u8, ct_flags: u8, stats: &[u32]) -> Self {
        self.tcp_segment(dir, DATA, payload, state, ct_flags, stats, &[])
    }

    #[expect(
        clippy::too_many_arguments,
        reason = "one table row, read left to right"
    )]
    fn tcp_segment(
        mut self,
        dir: Dir,
        flags: u8,
        payload: &[u8],
        state: u8,
        ct_flags: u8,
        stats: &[u32],
        events: &[(u8, u8)],
    ) -> Self {
        self.check_model(dir, flags, Some(state));
        let what = format!("{} {}", dir.name(), flags_name(flags))
            + &if payload.is_empty() {
                String::new()
            } else {
                format!(" +{}B", payload.len())
            };
        let input = self.flow.tcp(dir, flags, payload);
        let expect = self.entry(Some(state), ct_flags);
        self.push(what, input, expect, stats, events)
    }

    /// A TCP packet with no connection that cannot start one.
    fn tcp_refused(mut self, dir: Dir, flags: u8) -> Self {
        self.check_model(dir, flags, None);
        let what = format!("{} {} without a connection", dir.name(), flags_name(flags));
        let input = self.flow.tcp(dir, flags, &[]);
        let expect = CtExpect::Absent(self.flow.key());
        self.push(what, input, expect, REFUSED, &[])
    }

    /// A TCP packet the current hook must not track.
    fn tcp_untracked(self, dir: Dir, flags: u8) -> Self {
        let what = format!("{} {} (not tracked here)", dir.name(), flags_name(flags));
        let input = self.flow.tcp(dir, flags, &[]);
        self.push(what, input, CtExpect::Untouched, &[], &[])
    }

    fn udp(self, dir: Dir, payload: &[u8], ct_flags: u8, stats: &[u32], ev: &[(u8, u8)]) -> Self {
        let what = format!("{} UDP +{}B", dir.name(), payload.len());
        let input = self.flow.udp(dir, payload);
        let expect = self.entry(None, ct_flags);
        self.push(what, input, expect, stats, ev)
    }

    fn echo(self, dir: Dir, seq: u16, ct_flags: u8, stats: &[u32], ev: &[(u8, u8)]) -> Self {
        let what = format!(
            "echo {} id {} seq {seq}",
            if dir == O { "request" } else { "reply" },
            self.flow.cport
        );
        let input = self.flow.echo(dir, seq);
        let expect = self.entry(None, ct_flags);
        self.push(what, input, expect, stats, ev)
    }

    /// An echo reply with no request before it.
    fn echo_refused(self, seq: u16) -> Self {
        let what = format!(
            "echo reply id {} seq {seq} without a request",
            self.flow.cport
        );
        let input = self.flow.echo(R, seq);
        let expect = CtExpect::Absent(self.flow.key());
        self.push(what, input, expect, REFUSED, &[])
    }

    /// Any frame conntrack must leave alone (no counter moves, no event).
    fn untracked(self, what: &str, input: Vec<u8>) -> Self {
        self.push(what.to_owned(), input, CtExpect::Untouched, &[], &[])
    }

    /// The last step also states the entry's per-direction packets and bytes.
    fn counts(mut self, packets: [u64; 2], bytes: [u64; 2]) -> Self {
        match self.steps.last_mut().map(|s| &mut s.expect) {
            Some(CtExpect::Entry(_, want)) => {
                want.packets = Some(packets);
                want.bytes = Some(bytes);
            }
            _ => panic!("{}: counts() needs a step that expects an entry", self.name),
        }
        self
    }

    /// The last step also states how many entries the table holds.
    fn table_len(mut self, n: usize) -> Self {
        match self.steps.last_mut() {
            Some(s) => s.expect_table_len = Some(n),
            None => panic!("{}: table_len() needs a step", self.name),
        }
        self
    }

    /// The last step runs as a packet forwarded from interface `ifindex` (TC context).
    fn forwarded_from(mut self, ifindex: u32) -> Self {
        match self.steps.last_mut() {
            Some(s) => {
                s.skb_ingress_ifindex = Some(ifindex);
                s.what += &format!(" (forwarded from ifindex {ifindex})");
            }
            None => panic!("{}: forwarded_from() needs a step", self.name),
        }
        self
    }

    /// Checks a stated TCP outcome (`None` = no entry) against `tcp_step` and moves the
    /// model on: a sequence can only state what Linux's table says.
    fn check_model(&mut self, dir: Dir, flags: u8, want: Option<u8>) {
        let key = self.flow.key();
        let sender_is_client = dir == O;
        let (got, next) = match self.model.get(&key).copied() {
            None => match tcp_step(tcp_state::NONE, DIR_ORIGINAL, flags) {
                TcpStep::To(s) => (
                    Some(s),
                    Some(TcpModel {
                        state: s,
                        client_is_orig: sender_is_client,
                    }),
                ),
                _ => (None, None),
            },
            Some(m) => {
                let d = if sender_is_client == m.client_is_orig {
                    DIR_ORIGINAL
                } else {
                    DIR_REPLY
                };
                let mut next = m;
                if let TcpStep::To(s) = tcp_step(m.state, d, flags) {
                    // Linux deletes a closed connection that a SYN re-opens and starts a new
                    // one, its sender the originator.
                    let reopen = s == SS
                        && (m.state == TW || m.state == CL)
                        && tcp_classify(flags) == tcp_class::SYN;
                    if reopen {
                        next.client_is_orig = sender_is_client;
                    }
                    next.state = s;
                }
                (Some(next.state), Some(next))
            }
        };
        let name = |s: Option<u8>| {
            s.map_or("no entry", |s| {
                tcp_state::NAMES.get(usize::from(s)).copied().unwrap_or("?")
            })
        };
        assert_eq!(
            got,
            want,
            "ct sequence `{}` step {}: {} {} — the sequence states {}, Linux's table \
             (tcp_step) says {}",
            self.name,
            self.steps.len(),
            dir.name(),
            flags_name(flags),
            name(want),
            name(got)
        );
        match next {
            Some(m) => self.model.insert(key, m),
            None => self.model.remove(&key),
        };
    }

    /// The three-way handshake on the current flow, from nothing to ESTABLISHED.
    fn handshake(self) -> Self {
        self.tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
            .tcp(R, SYNACK, SR, SEEN, HIT, &[])
            .tcp(O, ACK, ES, SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, ES)])
    }

    /// Handshake, then the client closes first, down to TIME_WAIT.
    fn active_close(self) -> Self {
        self.handshake()
            .tcp(O, FIN, FW, SEEN_ASSURED, HIT, &[])
            .tcp(R, ACK, CW, SEEN_ASSURED, HIT, &[])
            .tcp(R, FIN, LA, SEEN_ASSURED, HIT, &[])
            .tcp(O, ACK, TW, SEEN_ASSURED, HIT_CLOSED, &[(CLOSED_EV, TW)])
    }

    fn build(self) -> CtSequence {
        CtSequence {
            name: self.name.to_owned(),
            seed: self.seed,
            steps: self.steps,
        }
    }
}

/// Frame length of a TCP segment of `flow` with `payload` bytes.
fn tcp_len(flow: &Flow, payload: usize) -> u64 {
    flow.tcp(O, DATA, &vec![0; payload]).len() as u64
}

/// The TCP state machine over the Linux table: every transition of the happy path, both close
/// orders, simultaneous open and close, retransmissions, RSTs, invalid packets, re-opening.
fn tcp_sequences() -> Vec<Seq> {
    vec![
        Seq::xdp("tcp_handshake_data_active_close", tcp4())
            .handshake()
            .tcp_data(O, b"GET / HTTP/1.1\r\n\r\n", ES, SEEN_ASSURED, HIT)
            .tcp_data(R, b"HTTP/1.1 200 OK\r\n\r\n", ES, SEEN_ASSURED, HIT)
            .tcp(O, FIN, FW, SEEN_ASSURED, HIT, &[])
            .tcp(R, ACK, CW, SEEN_ASSURED, HIT, &[])
            .tcp(R, FIN, LA, SEEN_ASSURED, HIT, &[])
            .tcp(O, ACK, TW, SEEN_ASSURED, HIT_CLOSED, &[(CLOSED_EV, TW)])
            .table_len(1),
        Seq::xdp("tcp_handshake_passive_close", tcp4())
            .handshake()
            .tcp(R, FIN, FW, SEEN_ASSURED, HIT, &[])
            .tcp(O, ACK, CW, SEEN_ASSURED, HIT, &[])
            .tcp(O, FIN, LA, SEEN_ASSURED, HIT, &[])
            .tcp(R, ACK, TW, SEEN_ASSURED, HIT_CLOSED, &[(CLOSED_EV, TW)]),
        Seq::xdp("tcp_simultaneous_close", tcp4())
            .handshake()
            .tcp(O, FIN, FW, SEEN_ASSURED, HIT, &[])
            .tcp(R, FIN, LA, SEEN_ASSURED, HIT, &[])
            .tcp(O, ACK, TW, SEEN_ASSURED, HIT_CLOSED, &[(CLOSED_EV, TW)])
            // The last ACK: already closed, no second CLOSED.
            .tcp(R, ACK, TW, SEEN_ASSURED, HIT, &[]),
        Seq::xdp("tcp_fin_retransmitted_in_last_ack", tcp4())
            .handshake()
            .tcp(O, FIN, FW, SEEN_ASSURED, HIT, &[])
            .tcp(R, ACK, CW, SEEN_ASSURED, HIT, &[])
            .tcp(R, FIN, LA, SEEN_ASSURED, HIT, &[])
            .tcp(R, FIN, LA, SEEN_ASSURED, HIT, &[])
            .tcp(O, ACK, TW, SEEN_ASSURED, HIT_CLOSED, &[(CLOSED_EV, TW)]),
        Seq::xdp("tcp_late_packets_in_time_wait", tcp4())
            .active_close()
            .tcp(O, ACK, TW, SEEN_ASSURED, HIT, &[])
            .tcp(R, FIN, TW, SEEN_ASSURED, HIT, &[]),
        Seq::xdp("tcp_simultaneous_open", tcp4())
            .tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
            .tcp(R, SYN, S2, SEEN, HIT, &[])
            .tcp(O, SYNACK, SR, SEEN, HIT, &[])
            // The other side's SYN/ACK in SYN_RECV: Linux ignores it (sIG).
            .tcp(R, SYNACK, SR, SEEN, HIT_IGNORED, &[])
            .tcp(O, ACK, ES, SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, ES)])
            .tcp(R, ACK, ES, SEEN_ASSURED, HIT, &[])
            .table_len(1),
        Seq::xdp("tcp_simultaneous_open_synack_from_reply", tcp4())
            .tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
            .tcp(R, SYN, S2, SEEN, HIT, &[])
            .tcp(O, SYN, S2, SEEN, HIT, &[])
            .tcp(R, ACK, S2, SEEN, HIT_IGNORED, &[])
            .tcp(R, SYNACK, SR, SEEN, HIT, &[])
            .tcp(O, ACK, ES, SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, ES)]),
        Seq::xdp("tcp_syn_retransmitted", tcp4())
            .tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
            .tcp(O, SYN, SS, NOFLAGS, HIT, &[])
            .counts([2, 0], [2 * tcp_len(&tcp4(), 0), 0])
            .tcp(R, SYNACK, SR, SEEN, HIT, &[])
            .tcp(O, ACK, ES, SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, ES)])
            .table_len(1),
        Seq::xdp("tcp_synack_and_syn_retransmitted_in_syn_recv", tcp4())
            .tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
            .tcp(R, SYNACK, SR, SEEN, HIT, &[])
            .tcp(R, SYNACK, SR, SEEN, HIT_IGNORED, &[])
            .tcp(O, SYN, SR, SEEN, HIT_IGNORED, &[])
            .tcp(O, ACK, ES, SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, ES)]),
        Seq::xdp("tcp_syn_and_synack_in_established", tcp4())
            .handshake()
            .tcp(O, SYN, ES, SEEN_ASSURED, HIT_IGNORED, &[])
            .tcp(R, SYNACK, ES, SEEN_ASSURED, HIT_IGNORED, &[])
            .tcp(R, SYN, ES, SEEN_ASSURED, HIT_INVALID, &[]),
        Seq::xdp("tcp_rst_from_originator_in_syn_sent", tcp4())
            .tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
            .tcp(O, RST, CL, NOFLAGS, HIT_CLOSED, &[(CLOSED_EV, CL)])
            .tcp(O, ACK, CL, NOFLAGS, HIT, &[]),
        Seq::xdp("tcp_rst_from_responder_refuses_syn", tcp4())
            .tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
            .tcp(R, RSTACK, CL, SEEN, HIT_CLOSED, &[(CLOSED_EV, CL)]),
        Seq::xdp("tcp_rst_in_syn_recv", tcp4())
            .tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
            .tcp(R, SYNACK, SR, SEEN, HIT, &[])
            .tcp(O, RST, CL, SEEN, HIT_CLOSED, &[(CLOSED_EV, CL)]),
        Seq::xdp("tcp_rst_in_syn_sent2", tcp4())
            .tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
            .tcp(R, SYN, S2, SEEN, HIT, &[])
            .tcp(R, RST, CL, SEEN, HIT_CLOSED, &[(CLOSED_EV, CL)]),
        Seq::xdp("tcp_rst_from_responder_in_established", tcp4())
            .handshake()
            .tcp(R, RST, CL, SEEN_ASSURED, HIT_CLOSED, &[(CLOSED_EV, CL)]),
        Seq::xdp("tcp_rst_from_originator_in_established", tcp4())
            .handshake()
            .tcp_data(O, b"abc", ES, SEEN_ASSURED, HIT)
            .tcp(O, RSTACK, CL, SEEN_ASSURED, HIT_CLOSED, &[(CLOSED_EV, CL)]),
        Seq::xdp("tcp_rst_in_fin_wait", tcp4())
            .handshake()
            .tcp(O, FIN, FW, SEEN_ASSURED, HIT, &[])
            .tcp(R, RST, CL, SEEN_ASSURED, HIT_CLOSED, &[(CLOSED_EV, CL)]),
        Seq::xdp("tcp_rst_in_time_wait_is_no_second_close", tcp4())
            .active_close()
            .tcp(R, RST, CL, SEEN_ASSURED, HIT, &[]),
        Seq::xdp("tcp_ack_in_syn_sent_is_invalid", tcp4())
            .tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
            .tcp(O, ACK, SS, NOFLAGS, HIT_INVALID, &[])
            .tcp(R, SYNACK, SR, SEEN, HIT, &[]),
        Seq::xdp(
            "tcp_fin_and_synack_from_originator_in_syn_sent_are_invalid",
            tcp4(),
        )
        .tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
        .tcp(O, FIN, SS, NOFLAGS, HIT_INVALID, &[])
        .tcp(O, SYNACK, SS, NOFLAGS, HIT_INVALID, &[]),
        Seq::xdp("tcp_flagless_packets_in_established_are_invalid", tcp4())
            .handshake()
            .tcp(O, 0, ES, SEEN_ASSURED, HIT_INVALID, &[])
            .tcp(R, tcp_flags::PSH, ES, SEEN_ASSURED, HIT_INVALID, &[]),
        Seq::xdp("tcp_synack_without_connection", tcp4()).tcp_refused(O, SYNACK),
        Seq::xdp("tcp_fin_without_connection", tcp4())
            .tcp_refused(O, FIN)
            .tcp_refused(O, tcp_flags::FIN),
        Seq::xdp("tcp_rst_and_flagless_without_connection", tcp4())
            .tcp_refused(O, RST)
            .tcp_refused(O, 0)
            .table_len(0),
        Seq::xdp("tcp_loose_pickup_of_bare_ack", tcp4())
            .tcp(
                O,
                ACK,
                ES,
                CT_F_ASSURED,
                LOOSE_PICKUP,
                &[(NEW_EV, ES), (EST_EV, ES)],
            )
            .tcp(R, ACK, ES, SEEN_ASSURED, HIT, &[])
            .counts([1, 1], [tcp_len(&tcp4(), 0), tcp_len(&tcp4(), 0)]),
        Seq::xdp("tcp_syn_reopens_time_wait", tcp4())
            .active_close()
            .tcp(O, SYN, SS, NOFLAGS, HIT_REOPENED, &[(NEW_EV, SS)])
            .counts([1, 0], [tcp_len(&tcp4(), 0), 0])
            .table_len(1)
            .tcp(R, SYNACK, SR, SEEN, HIT, &[])
            .tcp(O, ACK, ES, SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, ES)]),
        // The responder's SYN re-opens TIME_WAIT (Linux: reply SYN in TIME_WAIT → SYN_SENT);
        // the new connection's originator is the old responder.
        Seq::xdp("tcp_syn_from_responder_reopens_time_wait", tcp4())
            .active_close()
            .tcp(R, SYN, SS, NOFLAGS, HIT_REOPENED, &[(NEW_EV, SS)])
            .counts([1, 0], [tcp_len(&tcp4(), 0), 0])
            .tcp(O, SYNACK, SR, SEEN, HIT, &[])
            .tcp(R, ACK, ES, SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, ES)])
            .counts([2, 1], [2 * tcp_len(&tcp4(), 0), tcp_len(&tcp4(), 0)]),
        Seq::xdp("tcp_syn_reopens_close_after_rst", tcp4())
            .handshake()
            .tcp(R, RST, CL, SEEN_ASSURED, HIT_CLOSED, &[(CLOSED_EV, CL)])
            .tcp(O, SYN, SS, NOFLAGS, HIT_REOPENED, &[(NEW_EV, SS)])
            .counts([1, 0], [tcp_len(&tcp4(), 0), 0]),
        Seq::xdp("tcp_syn_from_responder_in_close_is_invalid", tcp4())
            .handshake()
            .tcp(O, RST, CL, SEEN_ASSURED, HIT_CLOSED, &[(CLOSED_EV, CL)])
            .tcp(R, SYN, CL, SEEN_ASSURED, HIT_INVALID, &[]),
        Seq::xdp("tcp_invalid_packets_are_not_accounted", tcp4())
            .tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
            .tcp(R, FIN, SS, NOFLAGS, HIT_INVALID, &[])
            .counts([1, 0], [tcp_len(&tcp4(), 0), 0]),
        Seq::xdp("tcp_ipv6_handshake_and_close", tcp6())
            .handshake()
            .tcp_data(O, b"hello", ES, SEEN_ASSURED, HIT)
            .tcp(R, FIN, FW, SEEN_ASSURED, HIT, &[])
            .tcp(O, FIN, LA, SEEN_ASSURED, HIT, &[])
            .tcp(R, ACK, TW, SEEN_ASSURED, HIT_CLOSED, &[(CLOSED_EV, TW)])
            .counts(
                [4, 3],
                [
                    3 * tcp_len(&tcp6(), 0) + tcp_len(&tcp6(), 5),
                    3 * tcp_len(&tcp6(), 0),
                ],
            )
            .table_len(1),
    ]
}

/// Key normalization and per-direction accounting.
fn direction_sequences() -> Vec<Seq> {
    // The client's address is above the server's: the originator is the key's `hi` side.
    let hi_client = Flow::v4(proto::TCP, C4, 40001, B4, 443);
    let (syn, ack) = (tcp_len(&hi_client, 0), tcp_len(&hi_client, 0));
    vec![
        Seq::xdp("tcp_both_directions_one_entry", hi_client)
            .tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
            .table_len(1)
            .tcp(R, SYNACK, SR, SEEN, HIT, &[])
            .table_len(1)
            .tcp(O, ACK, ES, SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, ES)])
            .table_len(1)
            .tcp_data(R, &[7; 100], ES, SEEN_ASSURED, HIT)
            .counts([2, 2], [syn + ack, syn + tcp_len(&hi_client, 100)])
            .table_len(1),
        Seq::xdp("tcp_per_direction_counters", tcp4())
            .tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
            .counts([1, 0], [54, 0])
            .tcp(R, SYNACK, SR, SEEN, HIT, &[])
            .counts([1, 1], [54, 54])
            .tcp(O, ACK, ES, SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, ES)])
            .counts([2, 1], [108, 54])
            .tcp_data(O, &[1; 10], ES, SEEN_ASSURED, HIT)
            .counts([3, 1], [172, 54])
            .tcp_data(R, &[2; 1000], ES, SEEN_ASSURED, HIT)
            .counts([3, 2], [172, 1108])
            .tcp_data(R, &[3; 1], ES, SEEN_ASSURED, HIT)
            .counts([3, 3], [172, 1163]),
        Seq::xdp("two_connections_two_entries", tcp4())
            .handshake()
            .flow(Flow::v4(proto::TCP, A4, 40002, B4, 80))
            .tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
            .table_len(2)
            .flow(tcp4())
            .tcp(O, FIN, FW, SEEN_ASSURED, HIT, &[])
            .table_len(2),
    ]
}

/// UDP and ICMP echo: a first packet creates, a reply assures, the rest are hits.
fn udp_icmp_sequences() -> Vec<Seq> {
    let udp_len = |f: &Flow, n: usize| f.udp(O, &vec![0; n]).len() as u64;
    let lo = Flow::v4(proto::UDP, [127, 0, 0, 1], 5000, [127, 0, 0, 1], 53);
    vec![
        Seq::xdp("udp_first_packet_reply_and_hits", udp4())
            .udp(O, b"query", NOFLAGS, CREATED, &[(NEW_EV, 0)])
            .udp(O, b"query2", NOFLAGS, HIT, &[])
            .udp(R, b"answer", SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, 0)])
            .udp(R, b"answer2", SEEN_ASSURED, HIT, &[])
            .udp(O, b"q", SEEN_ASSURED, HIT, &[])
            .counts(
                [3, 2],
                [
                    udp_len(&udp4(), 5) + udp_len(&udp4(), 6) + udp_len(&udp4(), 1),
                    udp_len(&udp4(), 6) + udp_len(&udp4(), 7),
                ],
            )
            .table_len(1),
        Seq::xdp("udp_ipv6_first_packet_and_reply", udp6())
            .udp(O, b"query", NOFLAGS, CREATED, &[(NEW_EV, 0)])
            .udp(R, b"answer", SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, 0)])
            .udp(O, b"again", SEEN_ASSURED, HIT, &[])
            .counts([2, 1], [2 * udp_len(&udp6(), 5), udp_len(&udp6(), 6)])
            .table_len(1),
        // Same address on both sides (loopback traffic): the ports order the key.
        Seq::xdp("udp_same_address_both_sides", lo)
            .udp(O, b"query", NOFLAGS, CREATED, &[(NEW_EV, 0)])
            .udp(R, b"answer", SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, 0)])
            .counts([1, 1], [udp_len(&lo, 5), udp_len(&lo, 6)])
            .table_len(1),
        Seq::xdp("icmp_echo_request_and_reply", Flow::icmp4(A4, B4, 0x4242))
            .echo(O, 1, NOFLAGS, CREATED, &[(NEW_EV, 0)])
            .echo(R, 1, SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, 0)])
            .echo(O, 2, SEEN_ASSURED, HIT, &[])
            .echo(R, 2, SEEN_ASSURED, HIT, &[])
            .counts([2, 2], [2 * 46, 2 * 46])
            .table_len(1),
        Seq::xdp("icmp_echo_reply_without_request", Flow::icmp4(A4, B4, 7))
            .echo_refused(1)
            .table_len(0),
        Seq::xdp(
            "icmp_echo_identifiers_key_connections",
            Flow::icmp4(A4, B4, 1),
        )
        .echo(O, 1, NOFLAGS, CREATED, &[(NEW_EV, 0)])
        .flow(Flow::icmp4(A4, B4, 2))
        .echo(O, 1, NOFLAGS, CREATED, &[(NEW_EV, 0)])
        .table_len(2)
        .flow(Flow::icmp4(A4, B4, 1))
        .echo(R, 1, SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, 0)])
        .flow(Flow::icmp4(A4, B4, 3))
        .echo_refused(1)
        .table_len(2),
        Seq::xdp("icmpv6_echo_request_and_reply", Flow::icmp6(A6, B6, 0x77))
            .echo(O, 1, NOFLAGS, CREATED, &[(NEW_EV, 0)])
            .echo(R, 1, SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, 0)])
            .echo(O, 2, SEEN_ASSURED, HIT, &[])
            .counts([2, 1], [2 * 66, 66])
            .table_len(1),
        Seq::xdp("icmpv6_echo_reply_without_request", Flow::icmp6(A6, B6, 9))
            .echo_refused(1)
            .table_len(0),
    ]
}

/// What conntrack must not touch: fragments, untracked protocols, ICMP errors and ND.
fn untracked_sequences() -> Vec<Seq> {
    let v4 = || Pkt::eth().ipv4(A4, B4);
    let v6 = || Pkt::eth().ipv6(A6, B6);
    vec![
        // An entry on the same tuple exists: fragments must still not touch it.
        Seq::xdp("fragments_are_not_tracked", udp4())
            .udp(O, b"query", NOFLAGS, CREATED, &[(NEW_EV, 0)])
            .untracked(
                "ipv4 first fragment (MF) udp",
                v4().ipv4_fragment(0, true)
                    .udp(5353, 53)
                    .payload(&[0xab; 32])
                    .build(),
            )
            .untracked(
                "ipv4 non-first fragment",
                v4().ipv4_fragment(4, false)
                    .ip_proto(proto::UDP)
                    .payload(&[0xab; 16])
                    .build(),
            )
            .untracked(
                "ipv6 first fragment udp",
                v6().ipv6_ext(Ipv6Ext::fragment(0, true, 9))
                    .udp(5353, 53)
                    .payload(&[0xab; 32])
                    .build(),
            )
            .untracked(
                "ipv6 first fragment tcp syn",
                v6().ipv6_ext(Ipv6Ext::fragment(0, true, 10))
                    .tcp(40000, 443, SYN)
                    .build(),
            )
            .table_len(1),
        Seq::xdp("untracked_protocols", udp4())
            .untracked(
                "ipv4 gre",
                v4().ip_proto(proto::GRE).payload(&[0, 0, 0x08, 0]).build(),
            )
            .untracked(
                "ipv4 esp",
                v4().ip_proto(proto::ESP).payload(&[0; 16]).build(),
            )
            .untracked(
                "ipv6 gre",
                v6().ip_proto(proto::GRE)
                    .payload(&[0, 0, 0x86, 0xdd])
                    .build(),
            )
            .untracked("ipv6 no next header", v6().build())
            .table_len(0),
        Seq::xdp("icmp_errors_and_nd_are_not_tracked", udp4())
            .untracked(
                "icmp port unreachable",
                v4().icmp(3, 3, [0; 4]).payload(&[0x45; 28]).build(),
            )
            .untracked(
                "icmp time exceeded",
                v4().icmp(11, 0, [0; 4]).payload(&[0x45; 28]).build(),
            )
            .untracked(
                "icmpv6 packet too big",
                v6().icmpv6(2, 0, [0, 0, 5, 0xdc])
                    .payload(&[0x60; 48])
                    .build(),
            )
            .untracked(
                "icmpv6 neighbour solicitation",
                v6().icmpv6_neighbour_solicit(B6).build(),
            )
            .table_len(0),
    ]
}

/// Which hook tracks: only the one `FP_IFACE` enables for the packet's interface.
fn hook_sequences() -> Vec<Seq> {
    let iface = Seed::iface;
    let all = IFACE_F_CT_XDP | IFACE_F_CT_TC_INGRESS | IFACE_F_CT_TC_EGRESS;
    vec![
        Seq::new(
            "no_interface_configured_tracks_nothing",
            Seed::default(),
            Hook::Xdp,
            tcp4(),
        )
        .tcp_untracked(O, SYN)
        .on(Hook::TcIngress)
        .tcp_untracked(O, SYN)
        .on(Hook::TcEgress)
        .tcp_untracked(O, SYN),
        Seq::new(
            "interface_without_ct_flags_tracks_nothing",
            iface(TEST_RUN_IFINDEX, 0),
            Hook::Xdp,
            tcp4(),
        )
        .tcp_untracked(O, SYN)
        .on(Hook::TcIngress)
        .tcp_untracked(O, SYN),
        // Every hook enabled on other interfaces: the test-run packets (loopback) stay out.
        Seq::new(
            "other_interfaces_tracking_do_not_apply",
            Seed::iface(2, all)
                .with_iface(3, all)
                .with_iface(4, all)
                .with_iface(0, all),
            Hook::Xdp,
            tcp4(),
        )
        .tcp_untracked(O, SYN)
        .on(Hook::TcIngress)
        .tcp_untracked(O, SYN)
        .on(Hook::TcEgress)
        .tcp_untracked(O, SYN),
        Seq::new(
            "only_the_enabled_hook_tracks",
            iface(TEST_RUN_IFINDEX, IFACE_F_CT_TC_INGRESS),
            Hook::Xdp,
            tcp4(),
        )
        .tcp_untracked(O, SYN)
        .on(Hook::TcEgress)
        .tcp_untracked(O, SYN)
        .on(Hook::TcIngress)
        .tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
        .on(Hook::Xdp)
        .tcp_untracked(R, SYNACK)
        .table_len(1),
        Seq::new(
            "tc_ingress_tracks_a_connection",
            iface(TEST_RUN_IFINDEX, IFACE_F_CT_TC_INGRESS),
            Hook::TcIngress,
            tcp4(),
        )
        .active_close()
        .counts([4, 3], [4 * 54, 3 * 54]),
        Seq::new(
            "tc_egress_tracks_a_connection",
            iface(TEST_RUN_IFINDEX, IFACE_F_CT_TC_EGRESS),
            Hook::TcEgress,
            tcp6(),
        )
        .handshake()
        .tcp(O, RST, CL, SEEN_ASSURED, HIT_CLOSED, &[(CLOSED_EV, CL)]),
        Seq::new(
            "tc_ingress_tracks_udp_and_icmp",
            iface(TEST_RUN_IFINDEX, IFACE_F_CT_TC_INGRESS),
            Hook::TcIngress,
            udp4(),
        )
        .udp(O, b"q", NOFLAGS, CREATED, &[(NEW_EV, 0)])
        .udp(R, b"a", SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, 0)])
        .flow(Flow::icmp6(A6, B6, 5))
        .echo(O, 1, NOFLAGS, CREATED, &[(NEW_EV, 0)])
        .table_len(2),
        // Egress tracks what this node sends; forwarded packets were tracked where they came
        // in (the same packet must not be counted twice).
        Seq::new(
            "tc_egress_tracks_only_local_traffic",
            iface(TEST_RUN_IFINDEX, IFACE_F_CT_TC_EGRESS),
            Hook::TcEgress,
            tcp4(),
        )
        .tcp_untracked(O, SYN)
        .forwarded_from(4)
        .tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
        .tcp_untracked(R, SYNACK)
        .forwarded_from(4)
        .table_len(1),
        // A local client: its packets leave through TC egress, the replies arrive at XDP;
        // both hooks land on one entry.
        Seq::new(
            "egress_and_xdp_share_one_entry",
            iface(TEST_RUN_IFINDEX, IFACE_F_CT_XDP | IFACE_F_CT_TC_EGRESS),
            Hook::TcEgress,
            tcp4(),
        )
        .tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
        .on(Hook::Xdp)
        .tcp(R, SYNACK, SR, SEEN, HIT, &[])
        .on(Hook::TcEgress)
        .tcp(O, ACK, ES, SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, ES)])
        .counts([2, 1], [108, 54])
        .table_len(1),
    ]
}

/// Every conntrack sequence.
pub fn ct_sequences() -> Vec<CtSequence> {
    [
        tcp_sequences(),
        direction_sequences(),
        udp_icmp_sequences(),
        untracked_sequences(),
        hook_sequences(),
    ]
    .into_iter()
    .flatten()
    .map(Seq::build)
    .collect()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;
    use crate::testkit::fixture::MIN_INPUT_LEN;

    #[test]
    fn names_are_unique_and_steps_runnable() {
        let seqs = ct_sequences();
        assert!(seqs.len() >= 30, "only {} sequences", seqs.len());
        let mut names = BTreeSet::new();
        for s in &seqs {
            assert!(names.insert(&s.name), "duplicate sequence name {}", s.name);
            assert!(!s.steps.is_empty(), "{} has no steps", s.name);
            for (i, step) in s.steps.iter().enumerate() {
                assert!(
                    step.input.len() >= MIN_INPUT_LEN,
                    "{} step {i}: {} bytes",
                    s.name,
                    step.input.len()
                );
            }
        }
    }

    #[test]
    fn frame_lengths_used_in_counts() {
        assert_eq!(tcp_len(&tcp4(), 0), 54);
        assert_eq!(tcp_len(&tcp6(), 0), 74);
        assert_eq!(Flow::icmp4(A4, B4, 1).echo(O, 1).len(), 46);
        assert_eq!(Flow::icmp6(A6, B6, 1).echo(R, 1).len(), 66);
    }

    #[test]
    fn echo_keys_use_the_identifier_on_both_sides() {
        let k = Flow::icmp4(A4, B4, 0x4242).key();
        assert_eq!(
            (k.port_lo, k.port_hi, k.proto),
            (0x4242, 0x4242, proto::ICMP)
        );
    }

    #[test]
    #[should_panic(expected = "Linux's table (tcp_step) says SYN_SENT")]
    fn a_sequence_that_contradicts_tcp_step_does_not_build() {
        let _ = Seq::xdp("wrong", tcp4())
            .tcp(O, SYN, SS, NOFLAGS, CREATED, &[])
            .tcp(O, ACK, ES, NOFLAGS, HIT, &[]);
    }
}
