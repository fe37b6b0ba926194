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
        IFACE_F_CT_TC_INGRESS, IFACE_F_CT_XDP, IFACE_F_FIREWALL, IFACE_F_LOOPBACK, TcpStep,
        ct_event, ct_key, ct_stat, tcp_class, tcp_classify, tcp_state, tcp_step,
    },
    reason,
};

use super::{
    fixture::{CtEntryExpect, CtExpect, CtSequence, CtStep, Seed},
    packet::{self, Ipv6Ext, Pkt, icmp_type, proto, tcp_flags},
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
const REPLIED_EV: u8 = ct_event::REPLIED;
const EST_EV: u8 = ct_event::ESTABLISHED;
const CLOSED_EV: u8 = ct_event::CLOSED;

use ct_stat::{
    ALIAS_CLASH, ASSURED, CLOSED, EARLY_DROP, FW_DROPPED, HITS, IGNORED, INSERT_FAILED,
    INVALID_NEW, INVALID_STATE, KILLED, LOOKUPS, NEW, RELATED, RELATED_MISS, REOPENED,
    SNAT_EXHAUSTED, SNAT_RETRIES,
};
/// Counter sets a step moves, each by one.
const CREATED: &[u32] = &[LOOKUPS, NEW];
const HIT: &[u32] = &[LOOKUPS, HITS];
const HIT_ASSURED: &[u32] = &[LOOKUPS, HITS, ASSURED];
const HIT_CLOSED: &[u32] = &[LOOKUPS, HITS, CLOSED];
const HIT_IGNORED: &[u32] = &[LOOKUPS, HITS, IGNORED];
const HIT_INVALID: &[u32] = &[LOOKUPS, HITS, INVALID_STATE];
const HIT_REOPENED: &[u32] = &[LOOKUPS, HITS, REOPENED];
const HIT_KILLED: &[u32] = &[LOOKUPS, HITS, KILLED];
const REFUSED: &[u32] = &[LOOKUPS, INVALID_NEW];
const CREATED_EARLY_DROP: &[u32] = &[LOOKUPS, NEW, EARLY_DROP];
const TABLE_FULL: &[u32] = &[LOOKUPS, INSERT_FAILED];

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

    /// An ICMP (v4) or ICMPv6 error quoting this flow's packet sent in direction `about` (its
    /// IP header and first 8 bytes of L4 header, as RFC 792 requires at least), sent back to
    /// that packet's sender.
    fn icmp_error(&self, about: Dir, icmp_type: u8, code: u8) -> Vec<u8> {
        let quoted = match self.proto {
            proto::TCP => self.tcp(about, SYN, &[]),
            proto::UDP => self.udp(about, b"query"),
            _ => self.echo(about, 1),
        };
        let ip_hdr = if self.family == 4 { 20 } else { 40 };
        let quote = &quoted[14..14 + ip_hdr + 8];
        let back = if about == O { R } else { O };
        let p = self.ip(back);
        let p = if self.family == 4 {
            p.icmp(icmp_type, code, [0; 4])
        } else {
            p.icmpv6(icmp_type, code, [0; 4])
        };
        p.payload(quote).build()
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
    /// Time to pass before the next packet (see [`Seq::wait`]).
    pending_age_ns: u64,
    /// Synthetic assured entries in the table before the first step.
    prefill_assured: u32,
    /// The seed later steps run with, when it changed mid-sequence (see [`Seq::reseed`]).
    step_seed: Option<Seed>,
    /// For load-balanced steps: the backend (address, port) the current flow's connection
    /// goes to (the flow's server is the VIP).
    backend: Option<([u8; 16], u16)>,
    /// For full-NAT steps: the source (address, port) the current flow's connection was
    /// given.
    snat: Option<([u8; 16], u16)>,
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
            pending_age_ns: 0,
            prefill_assured: 0,
            step_seed: None,
            backend: None,
            snat: None,
        }
    }

    /// A sequence on XDP (tracking on) with these services.
    fn lb(name: &'static str, flow: Flow, services: &str) -> Self {
        Seq::new(
            name,
            Seed::iface(TEST_RUN_IFINDEX, IFACE_F_CT_XDP).with_services(services),
            Hook::Xdp,
            flow,
        )
    }

    /// Later steps run with `services` instead (a service changed mid-sequence).
    fn reseed(mut self, services: &str) -> Self {
        self.step_seed = Some(self.seed.clone().with_services(services));
        self
    }

    /// Later load-balanced steps: the current flow's connection is on this backend.
    fn via(mut self, backend: [u8; 16], port: u16) -> Self {
        self.backend = Some((backend, port));
        self
    }

    /// Later load-balanced steps are full-NAT: the connection's source is translated to
    /// this address and port.
    fn snat(mut self, addr: [u8; 16], port: u16) -> Self {
        self.snat = Some((addr, port));
        self
    }

    /// A packet of a load-balanced connection: from the client (`O`, to the VIP, translated
    /// to the backend) or from the backend (`R`, translated back to come from the VIP). The
    /// translated frame must be byte-exact what the packet builder makes with full checksums.
    #[expect(
        clippy::too_many_arguments,
        reason = "one table row, read left to right"
    )]
    fn lb_packet(
        mut self,
        dir: Dir,
        what: String,
        input_output: (Vec<u8>, Vec<u8>),
        state: Option<u8>,
        ct_flags: u8,
        stats: &[u32],
        events: &[(u8, u8)],
    ) -> Self {
        let alias = self.backend_flow().key();
        let expect = self.entry(state, ct_flags);
        let (input, output) = input_output;
        self = self.push(what, input, expect, stats, events);
        let step = self.last_step("lb_packet");
        step.expect_output = Some(output);
        step.expect_reason = Some(if dir == O {
            reason::LB_TO_BACKEND
        } else {
            reason::LB_FROM_BACKEND
        });
        step.also_changes.push(alias);
        self
    }

    /// The flow as the backend sees it: the same client (full-NAT: the translated source),
    /// the backend as the server.
    fn backend_flow(&self) -> Flow {
        let (backend, bport) = self.backend.expect("lb steps need via(backend, port)");
        let (client, cport) = self.snat.unwrap_or((self.flow.client, self.flow.cport));
        Flow {
            server: backend,
            sport: bport,
            client,
            cport,
            ..self.flow
        }
    }

    /// A TCP packet of a load-balanced connection (see [`Seq::lb_packet`]).
    fn lb_tcp(
        mut self,
        dir: Dir,
        flags: u8,
        state: u8,
        ct_flags: u8,
        stats: &[u32],
        events: &[(u8, u8)],
    ) -> Self {
        self.check_model(dir, flags, Some(state));
        let at_backend = self.backend_flow();
        let io = if dir == O {
            (self.flow.tcp(O, flags, &[]), at_backend.tcp(O, flags, &[]))
        } else {
            (at_backend.tcp(R, flags, &[]), self.flow.tcp(R, flags, &[]))
        };
        let what = format!("lb {} {}", dir.name(), flags_name(flags));
        self.lb_packet(dir, what, io, Some(state), ct_flags, stats, events)
    }

    /// A whole load-balanced TCP connection, new to TIME_WAIT: the handshake, then the
    /// client's FIN, the backend's FIN and the client's last ACK.
    fn lb_tcp_open_and_close(self) -> Self {
        self.lb_tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
            .lb_tcp(R, SYNACK, SR, SEEN, HIT, &[(REPLIED_EV, SR)])
            .lb_tcp(O, ACK, ES, SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, ES)])
            .lb_tcp(O, FIN, FW, SEEN_ASSURED, HIT, &[])
            .lb_tcp(R, FIN, LA, SEEN_ASSURED, HIT, &[])
            .lb_tcp(O, ACK, TW, SEEN_ASSURED, HIT_CLOSED, &[(CLOSED_EV, TW)])
    }

    /// A load-balanced SYN that takes the place of an ended connection on its tuple (its
    /// entry or alias gives way): a new connection, counted reopened.
    fn lb_syn_reopening(self) -> Self {
        self.lb_tcp(
            O,
            SYN,
            SS,
            NOFLAGS,
            &[LOOKUPS, NEW, REOPENED],
            &[(NEW_EV, SS)],
        )
    }

    /// A UDP datagram of a load-balanced connection (see [`Seq::lb_packet`]).
    fn lb_udp(
        self,
        dir: Dir,
        payload: &[u8],
        ct_flags: u8,
        stats: &[u32],
        ev: &[(u8, u8)],
    ) -> Self {
        let at_backend = self.backend_flow();
        let io = if dir == O {
            (self.flow.udp(O, payload), at_backend.udp(O, payload))
        } else {
            (at_backend.udp(R, payload), self.flow.udp(R, payload))
        };
        let what = format!("lb {} UDP +{}B", dir.name(), payload.len());
        self.lb_packet(dir, what, io, None, ct_flags, stats, ev)
    }

    /// A sequence on XDP with the stateful firewall on for the test-run interface.
    fn firewall(name: &'static str, flow: Flow) -> Self {
        Seq::new(
            name,
            Seed::iface(TEST_RUN_IFINDEX, IFACE_F_CT_XDP | IFACE_F_FIREWALL),
            Hook::Xdp,
            flow,
        )
    }

    /// `secs` pass before the next packet: its connection's entry is aged by that much.
    fn wait(mut self, secs: u64) -> Self {
        self.pending_age_ns += secs * 1_000_000_000;
        self
    }

    /// The last step leaves the connection without an entry (killed).
    fn gone(mut self) -> Self {
        let key = self.flow.key();
        self.last_step("gone").expect = CtExpect::Absent(key);
        self
    }

    /// The last step, to state more about it; `what` names the caller for the panic (a bug in
    /// the table).
    fn last_step(&mut self, what: &str) -> &mut CtStep {
        let name = self.name;
        self.steps
            .last_mut()
            .unwrap_or_else(|| panic!("{name}: {what}() needs a step"))
    }

    /// The last step may also create or remove the entry under `key`.
    fn also(mut self, key: CtKey) -> Self {
        self.last_step("also").also_changes.push(key);
        self
    }

    /// The last step goes to the kernel counted under `code`.
    fn kernel_reason(mut self, code: u32) -> Self {
        self.last_step("kernel_reason").expect_reason = Some(code);
        self
    }

    /// The last step is dropped with `code` (not by the firewall: no fw_dropped count).
    fn drop_reason(mut self, code: u32) -> Self {
        self.last_step("drop_reason").expect_drop = Some(code);
        self
    }

    /// The last step is dropped by the stateful firewall with `code` (and counts it).
    fn dropped(mut self, code: u32) -> Self {
        let s = self.last_step("dropped");
        s.expect_drop = Some(code);
        s.expect_stats.push((FW_DROPPED, 1));
        self
    }

    /// The last step also removes `victim` to make room (early drop), with its event.
    fn early_drops(mut self, victim: CtKey) -> Self {
        self.last_step("early_drops")
            .expect_other_events
            .push((ct_event::EARLY_DROP, victim));
        self
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
            age_before_ns: std::mem::take(&mut self.pending_age_ns),
            expect_drop: None,
            expect_other_events: Vec::new(),
            seed: self.step_seed.clone(),
            expect_output: None,
            expect_reason: None,
            also_changes: Vec::new(),
            expect_forward: false,
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

    /// A TCP packet with no connection that the stateful firewall drops: it is not a SYN.
    /// (Without the firewall a bare ACK would be picked up mid-stream; here nothing starts.)
    fn tcp_fw_refused(self, dir: Dir, flags: u8) -> Self {
        let what = format!("{} {} without a connection", dir.name(), flags_name(flags));
        let input = self.flow.tcp(dir, flags, &[]);
        let expect = CtExpect::Absent(self.flow.key());
        self.push(what, input, expect, REFUSED, &[])
            .dropped(reason::FW_NO_CONNECTION)
    }

    /// A RST before any reply: Linux deletes the connection at once ("if only reply is a
    /// RST..."); so do we, with a KILLED event.
    fn tcp_killed(mut self, dir: Dir, flags: u8) -> Self {
        self.check_model(dir, flags, Some(CL));
        self.model.remove(&self.flow.key());
        let what = format!("{} {} before any reply", dir.name(), flags_name(flags));
        let input = self.flow.tcp(dir, flags, &[]);
        let expect = CtExpect::Absent(self.flow.key());
        self.push(what, input, expect, HIT_KILLED, &[(ct_event::KILLED, CL)])
    }

    /// An ICMP error about a packet of the current flow sent in direction `about`, sent back
    /// to its sender (by the peer, or a router on the way: the outer source does not matter).
    /// It changes no entry; `stats` says whether it was related.
    fn icmp_error(self, about: Dir, icmp_type: u8, code: u8, stats: &[u32]) -> Self {
        let what = format!(
            "icmp error type {icmp_type} code {code} quoting a {} packet",
            about.name()
        );
        let input = self.flow.icmp_error(about, icmp_type, code);
        self.push(what, input, CtExpect::Untouched, stats, &[])
    }

    /// An ICMP error the backend side sends about the connection's packet to the backend
    /// (`icmp_type`/`code`): it must reach the client translated — about the client's own
    /// packet to the VIP, from the VIP (byte-exact, full checksums), counted `lb_icmp_error`.
    fn lb_icmp_error(self, icmp_type: u8, code: u8) -> Self {
        let what = format!("lb icmp error type {icmp_type} code {code} from the backend side");
        let input = self.backend_flow().icmp_error(O, icmp_type, code);
        let output = self.flow.icmp_error(O, icmp_type, code);
        let mut s = self.push(what, input, CtExpect::Untouched, &[RELATED], &[]);
        let step = s.last_step("lb_icmp_error");
        step.expect_output = Some(output);
        step.expect_reason = Some(reason::LB_ICMP_ERROR);
        s
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

    /// A frame that changes no entry but moves `stats` (an ICMP error, related or not).
    fn untouched(self, what: &str, input: Vec<u8>, stats: &[u32]) -> Self {
        self.push(what.to_owned(), input, CtExpect::Untouched, stats, &[])
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
        self.last_step("table_len").expect_table_len = Some(n);
        self
    }

    /// The last step runs as a packet forwarded from interface `ifindex` (TC context).
    fn forwarded_from(mut self, ifindex: u32) -> Self {
        let s = self.last_step("forwarded_from");
        s.skb_ingress_ifindex = Some(ifindex);
        s.what += &format!(" (forwarded from ifindex {ifindex})");
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
            .tcp(R, SYNACK, SR, SEEN, HIT, &[(REPLIED_EV, SR)])
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

    /// The table starts with `n` synthetic assured connections (see `Fixture::ct_fill`).
    fn prefilled(mut self, n: u32) -> Self {
        self.prefill_assured = n;
        self
    }

    /// This XDP sequence at TC ingress instead (`fastpath_tc_lb` for an interface that
    /// tracks there): the same packets, translations, entries, counters and events. Its
    /// interfaces track at TC ingress where they tracked at XDP.
    fn at_tc_ingress(mut self) -> Self {
        let to_tc = |seed: &mut Seed| {
            for (_, cfg) in &mut seed.ifaces {
                if cfg.flags & IFACE_F_CT_XDP != 0 {
                    cfg.flags = cfg.flags & !IFACE_F_CT_XDP | IFACE_F_CT_TC_INGRESS;
                }
            }
        };
        to_tc(&mut self.seed);
        if let Some(seed) = &mut self.step_seed {
            to_tc(seed);
        }
        for step in &mut self.steps {
            assert_eq!(step.hook, Hook::Xdp, "{}: {}", self.name, step.what);
            step.hook = Hook::TcIngress;
            if let Some(seed) = &mut step.seed {
                to_tc(seed);
            }
        }
        // Leaked: sequence names are `&'static str`, and the table is built once per run.
        self.name = format!("{}_at_tc_ingress", self.name).leak();
        self
    }

    fn build(self) -> CtSequence {
        CtSequence {
            name: self.name.to_owned(),
            seed: self.seed,
            prefill_assured: self.prefill_assured,
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
            .tcp(R, SYN, S2, SEEN, HIT, &[(REPLIED_EV, S2)])
            .tcp(O, SYNACK, SR, SEEN, HIT, &[])
            // The other side's SYN/ACK in SYN_RECV: Linux ignores it (sIG).
            .tcp(R, SYNACK, SR, SEEN, HIT_IGNORED, &[])
            .tcp(O, ACK, ES, SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, ES)])
            .tcp(R, ACK, ES, SEEN_ASSURED, HIT, &[])
            .table_len(1),
        Seq::xdp("tcp_simultaneous_open_synack_from_reply", tcp4())
            .tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
            .tcp(R, SYN, S2, SEEN, HIT, &[(REPLIED_EV, S2)])
            .tcp(O, SYN, S2, SEEN, HIT, &[])
            .tcp(R, ACK, S2, SEEN, HIT_IGNORED, &[])
            .tcp(R, SYNACK, SR, SEEN, HIT, &[])
            .tcp(O, ACK, ES, SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, ES)]),
        Seq::xdp("tcp_syn_retransmitted", tcp4())
            .tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
            .tcp(O, SYN, SS, NOFLAGS, HIT, &[])
            .counts([2, 0], [2 * tcp_len(&tcp4(), 0), 0])
            .tcp(R, SYNACK, SR, SEEN, HIT, &[(REPLIED_EV, SR)])
            .tcp(O, ACK, ES, SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, ES)])
            .table_len(1),
        Seq::xdp("tcp_synack_and_syn_retransmitted_in_syn_recv", tcp4())
            .tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
            .tcp(R, SYNACK, SR, SEEN, HIT, &[(REPLIED_EV, SR)])
            .tcp(R, SYNACK, SR, SEEN, HIT_IGNORED, &[])
            .tcp(O, SYN, SR, SEEN, HIT_IGNORED, &[])
            .tcp(O, ACK, ES, SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, ES)]),
        Seq::xdp("tcp_syn_and_synack_in_established", tcp4())
            .handshake()
            .tcp(O, SYN, ES, SEEN_ASSURED, HIT_IGNORED, &[])
            .tcp(R, SYNACK, ES, SEEN_ASSURED, HIT_IGNORED, &[])
            .tcp(R, SYN, ES, SEEN_ASSURED, HIT_INVALID, &[]),
        // A RST before any reply removes the connection at once (Linux); a later ACK is then
        // picked up as a new one.
        Seq::xdp("tcp_rst_from_originator_in_syn_sent", tcp4())
            .tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
            .tcp_killed(O, RST)
            .table_len(0)
            .tcp(O, ACK, ES, NOFLAGS, CREATED, &[(NEW_EV, ES)]),
        Seq::xdp("tcp_rst_from_responder_refuses_syn", tcp4())
            .tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
            .tcp(O, SYN, SS, NOFLAGS, HIT, &[])
            .tcp_killed(R, RSTACK)
            .table_len(0),
        Seq::xdp("tcp_rst_in_syn_recv", tcp4())
            .tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
            .tcp(R, SYNACK, SR, SEEN, HIT, &[(REPLIED_EV, SR)])
            .tcp(O, RST, CL, SEEN, HIT_CLOSED, &[(CLOSED_EV, CL)]),
        Seq::xdp("tcp_rst_in_syn_sent2", tcp4())
            .tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
            .tcp(R, SYN, S2, SEEN, HIT, &[(REPLIED_EV, S2)])
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
            .tcp(R, SYNACK, SR, SEEN, HIT, &[(REPLIED_EV, SR)]),
        // A reply the state machine ignores (an ACK answering the SYN: Linux's sIG) is still
        // accepted, so the reply is seen — with its event, as Linux sends IPCT_REPLY for any
        // accepted reply — though not accounted; the handshake goes on.
        Seq::xdp("tcp_ignored_first_reply_is_seen_with_its_event", tcp4())
            .tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
            .tcp(R, ACK, SS, SEEN, HIT_IGNORED, &[(REPLIED_EV, SS)])
            .counts([1, 0], [tcp_len(&tcp4(), 0), 0])
            .tcp(R, SYNACK, SR, SEEN, HIT, &[])
            .tcp(O, ACK, ES, SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, ES)]),
        Seq::xdp(
            "tcp_fin_and_synack_from_originator_in_syn_sent_are_invalid",
            tcp4(),
        )
        .tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
        .tcp(O, FIN, SS, NOFLAGS, HIT_INVALID, &[])
        .tcp(O, SYNACK, SS, NOFLAGS, HIT_INVALID, &[]),
        // Invalid flag combinations (Linux's tcp_valid_flags) never reach the state machine:
        // the kernel's, the entry and the counters untouched (see the hostile sequences).
        Seq::xdp("tcp_flagless_packets_in_established_are_invalid", tcp4())
            .handshake()
            .hostile(
                "orig no flags".into(),
                tcp4().tcp(O, 0, &[]),
                reason::TCP_INVALID_FLAGS,
                false,
            )
            .hostile(
                "reply PSH alone".into(),
                tcp4().tcp(R, tcp_flags::PSH, &[]),
                reason::TCP_INVALID_FLAGS,
                false,
            ),
        Seq::xdp("tcp_synack_without_connection", tcp4()).tcp_refused(O, SYNACK),
        Seq::xdp("tcp_fin_without_connection", tcp4())
            .tcp_refused(O, FIN)
            .hostile(
                "orig FIN alone without a connection".into(),
                tcp4().tcp(O, tcp_flags::FIN, &[]),
                reason::TCP_INVALID_FLAGS,
                false,
            ),
        Seq::xdp("tcp_rst_and_flagless_without_connection", tcp4())
            .tcp_refused(O, RST)
            .hostile(
                "orig no flags without a connection".into(),
                tcp4().tcp(O, 0, &[]),
                reason::TCP_INVALID_FLAGS,
                false,
            )
            .table_len(0),
        // Picked up mid-stream (Linux's nf_conntrack_tcp_loose): ESTABLISHED at once, but
        // assured only by a packet after the reply was seen — as in Linux.
        Seq::xdp("tcp_loose_pickup_of_bare_ack", tcp4())
            .tcp(O, ACK, ES, NOFLAGS, CREATED, &[(NEW_EV, ES)])
            .tcp(R, ACK, ES, SEEN, HIT, &[(REPLIED_EV, ES)])
            .counts([1, 1], [tcp_len(&tcp4(), 0), tcp_len(&tcp4(), 0)])
            .tcp(O, ACK, ES, SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, ES)]),
        Seq::xdp("tcp_loose_pickup_is_not_assured_without_reply", tcp4())
            .tcp_segment(O, DATA, b"abc", ES, NOFLAGS, CREATED, &[(NEW_EV, ES)])
            .tcp_data(O, b"def", ES, NOFLAGS, HIT)
            .tcp(O, ACK, ES, NOFLAGS, HIT, &[]),
        Seq::xdp("tcp_syn_reopens_time_wait", tcp4())
            .active_close()
            .tcp(O, SYN, SS, NOFLAGS, HIT_REOPENED, &[(NEW_EV, SS)])
            .counts([1, 0], [tcp_len(&tcp4(), 0), 0])
            .table_len(1)
            .tcp(R, SYNACK, SR, SEEN, HIT, &[(REPLIED_EV, SR)])
            .tcp(O, ACK, ES, SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, ES)]),
        // The responder's SYN re-opens TIME_WAIT (Linux: reply SYN in TIME_WAIT → SYN_SENT);
        // the new connection's originator is the old responder.
        Seq::xdp("tcp_syn_from_responder_reopens_time_wait", tcp4())
            .active_close()
            .tcp(R, SYN, SS, NOFLAGS, HIT_REOPENED, &[(NEW_EV, SS)])
            .counts([1, 0], [tcp_len(&tcp4(), 0), 0])
            .tcp(O, SYNACK, SR, SEEN, HIT, &[(REPLIED_EV, SR)])
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
            .tcp(R, SYNACK, SR, SEEN, HIT, &[(REPLIED_EV, SR)])
            .table_len(1)
            .tcp(O, ACK, ES, SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, ES)])
            .table_len(1)
            .tcp_data(R, &[7; 100], ES, SEEN_ASSURED, HIT)
            .counts([2, 2], [syn + ack, syn + tcp_len(&hi_client, 100)])
            .table_len(1),
        Seq::xdp("tcp_per_direction_counters", tcp4())
            .tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
            .counts([1, 0], [54, 0])
            .tcp(R, SYNACK, SR, SEEN, HIT, &[(REPLIED_EV, SR)])
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

/// UDP and ICMP echo: a first packet creates, the rest are hits. As in Linux, a UDP flow is
/// assured only when it has seen a reply and is still active more than 2 s after it began;
/// ICMP echo never is.
fn udp_icmp_sequences() -> Vec<Seq> {
    let udp_len = |f: &Flow, n: usize| f.udp(O, &vec![0; n]).len() as u64;
    let lo = Flow::v4(proto::UDP, [127, 0, 0, 1], 5000, [127, 0, 0, 1], 53);
    vec![
        Seq::xdp("udp_first_packet_reply_and_hits", udp4())
            .udp(O, b"query", NOFLAGS, CREATED, &[(NEW_EV, 0)])
            .udp(O, b"query2", NOFLAGS, HIT, &[])
            .udp(R, b"answer", SEEN, HIT, &[(REPLIED_EV, 0)])
            .udp(R, b"answer2", SEEN, HIT, &[])
            .udp(O, b"q", SEEN, HIT, &[])
            .counts(
                [3, 2],
                [
                    udp_len(&udp4(), 5) + udp_len(&udp4(), 6) + udp_len(&udp4(), 1),
                    udp_len(&udp4(), 6) + udp_len(&udp4(), 7),
                ],
            )
            .table_len(1),
        Seq::xdp("udp_replied_and_active_after_2s_is_assured", udp4())
            .udp(O, b"query", NOFLAGS, CREATED, &[(NEW_EV, 0)])
            .udp(R, b"answer", SEEN, HIT, &[(REPLIED_EV, 0)])
            .wait(1)
            .udp(O, b"within 2 s", SEEN, HIT, &[])
            .wait(2)
            .udp(O, b"after 2 s", SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, 0)])
            .udp(R, b"more", SEEN_ASSURED, HIT, &[]),
        Seq::xdp("udp_first_reply_after_2s_is_not_yet_assured", udp4())
            .udp(O, b"query", NOFLAGS, CREATED, &[(NEW_EV, 0)])
            .wait(3)
            .udp(R, b"late answer", SEEN, HIT, &[(REPLIED_EV, 0)])
            .udp(O, b"next", SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, 0)]),
        Seq::xdp("udp_unreplied_is_never_assured", udp4())
            .udp(O, b"query", NOFLAGS, CREATED, &[(NEW_EV, 0)])
            .wait(5)
            .udp(O, b"again", NOFLAGS, HIT, &[]),
        Seq::xdp("udp_ipv6_assured_after_2s", udp6())
            .udp(O, b"query", NOFLAGS, CREATED, &[(NEW_EV, 0)])
            .udp(R, b"answer", SEEN, HIT, &[(REPLIED_EV, 0)])
            .udp(O, b"again", SEEN, HIT, &[])
            .counts([2, 1], [2 * udp_len(&udp6(), 5), udp_len(&udp6(), 6)])
            .wait(3)
            .udp(R, b"later", SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, 0)])
            .table_len(1),
        // Same address on both sides (loopback traffic): the ports order the key. On a
        // loopback device, where such traffic runs (elsewhere its source is martian).
        Seq::new(
            "udp_same_address_both_sides",
            Seed::iface(TEST_RUN_IFINDEX, IFACE_F_CT_XDP | IFACE_F_LOOPBACK),
            Hook::Xdp,
            lo,
        )
        .udp(O, b"query", NOFLAGS, CREATED, &[(NEW_EV, 0)])
        .udp(R, b"answer", SEEN, HIT, &[(REPLIED_EV, 0)])
        .counts([1, 1], [udp_len(&lo, 5), udp_len(&lo, 6)])
        .table_len(1),
        Seq::xdp("icmp_echo_request_and_reply", Flow::icmp4(A4, B4, 0x4242))
            .echo(O, 1, NOFLAGS, CREATED, &[(NEW_EV, 0)])
            .echo(R, 1, SEEN, HIT, &[(REPLIED_EV, 0)])
            .echo(O, 2, SEEN, HIT, &[])
            .echo(R, 2, SEEN, HIT, &[])
            .counts([2, 2], [2 * 46, 2 * 46])
            .wait(3)
            .echo(O, 3, SEEN, HIT, &[])
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
        .echo(R, 1, SEEN, HIT, &[(REPLIED_EV, 0)])
        .flow(Flow::icmp4(A4, B4, 3))
        .echo_refused(1)
        .table_len(2),
        Seq::xdp("icmpv6_echo_request_and_reply", Flow::icmp6(A6, B6, 0x77))
            .echo(O, 1, NOFLAGS, CREATED, &[(NEW_EV, 0)])
            .echo(R, 1, SEEN, HIT, &[(REPLIED_EV, 0)])
            .echo(O, 2, SEEN, HIT, &[])
            .counts([2, 1], [2 * 66, 66])
            .table_len(1),
        Seq::xdp("icmpv6_echo_reply_without_request", Flow::icmp6(A6, B6, 9))
            .echo_refused(1)
            .table_len(0),
    ]
}

/// ICMP and ICMPv6 errors (destination unreachable, fragmentation needed / packet too big,
/// time exceeded, parameter problem) belong to the connection of the packet they quote:
/// RELATED, leaving it as it is. An error for no connection is counted as a miss.
fn related_sequences() -> Vec<Seq> {
    const PORT_UNREACHABLE: (u8, u8) = (3, 3);
    const FRAG_NEEDED: (u8, u8) = (3, 4);
    const TIME_EXCEEDED: (u8, u8) = (11, 0);
    const PARAMETER_PROBLEM: (u8, u8) = (12, 0);
    const V6_UNREACHABLE: (u8, u8) = (1, 4);
    const V6_TOO_BIG: (u8, u8) = (2, 0);
    const V6_TIME_EXCEEDED: (u8, u8) = (3, 0);
    const V6_PARAMETER_PROBLEM: (u8, u8) = (4, 0);
    let rel = |seq: Seq, about: Dir, (t, c): (u8, u8)| seq.icmp_error(about, t, c, &[RELATED]);
    let miss =
        |seq: Seq, about: Dir, (t, c): (u8, u8)| seq.icmp_error(about, t, c, &[RELATED_MISS]);
    vec![
        rel(
            Seq::xdp("icmp_port_unreachable_is_related_to_udp", udp4()).udp(
                O,
                b"query",
                NOFLAGS,
                CREATED,
                &[(NEW_EV, 0)],
            ),
            O,
            PORT_UNREACHABLE,
        )
        .udp(O, b"again", NOFLAGS, HIT, &[])
        .counts([2, 0], [udp_len4(5) + udp_len4(5), 0])
        .table_len(1),
        rel(
            rel(
                Seq::xdp(
                    "icmp_frag_needed_and_time_exceeded_are_related_to_tcp",
                    tcp4(),
                )
                .handshake(),
                O,
                FRAG_NEEDED,
            ),
            R,
            TIME_EXCEEDED,
        )
        .tcp(O, FIN, FW, SEEN_ASSURED, HIT, &[]),
        rel(
            Seq::xdp("icmp_parameter_problem_is_related_to_tcp_syn", tcp4()).tcp(
                O,
                SYN,
                SS,
                NOFLAGS,
                CREATED,
                &[(NEW_EV, SS)],
            ),
            O,
            PARAMETER_PROBLEM,
        ),
        rel(
            Seq::xdp(
                "icmp_time_exceeded_is_related_to_echo",
                Flow::icmp4(A4, B4, 0x99),
            )
            .echo(O, 1, NOFLAGS, CREATED, &[(NEW_EV, 0)]),
            O,
            TIME_EXCEEDED,
        ),
        rel(
            rel(
                Seq::xdp("icmpv6_too_big_and_unreachable_are_related_to_tcp", tcp6()).handshake(),
                R,
                V6_TOO_BIG,
            ),
            O,
            V6_UNREACHABLE,
        ),
        rel(
            rel(
                Seq::xdp("icmpv6_errors_are_related_to_udp", udp6()).udp(
                    O,
                    b"query",
                    NOFLAGS,
                    CREATED,
                    &[(NEW_EV, 0)],
                ),
                O,
                V6_TIME_EXCEEDED,
            ),
            O,
            V6_PARAMETER_PROBLEM,
        ),
        rel(
            Seq::xdp(
                "icmpv6_time_exceeded_is_related_to_echo",
                Flow::icmp6(A6, B6, 3),
            )
            .echo(O, 1, NOFLAGS, CREATED, &[(NEW_EV, 0)]),
            O,
            V6_TIME_EXCEEDED,
        ),
        miss(
            miss(
                miss(
                    Seq::xdp("icmp_errors_without_connection_are_misses", udp4()),
                    O,
                    PORT_UNREACHABLE,
                )
                .flow(udp6()),
                O,
                V6_TOO_BIG,
            )
            .flow(tcp4()),
            R,
            TIME_EXCEEDED,
        )
        .table_len(0),
        // The quoted packet of another connection (other ports) does not match this one.
        miss(
            Seq::xdp("icmp_error_for_another_port_is_a_miss", udp4())
                .udp(O, b"query", NOFLAGS, CREATED, &[(NEW_EV, 0)])
                .flow(Flow::v4(proto::UDP, A4, 5354, B4, 53)),
            O,
            PORT_UNREACHABLE,
        ),
    ]
}

/// Frame length of a UDP datagram of [`udp4`] with `n` payload bytes.
fn udp_len4(n: usize) -> u64 {
    udp4().udp(O, &vec![0; n]).len() as u64
}

/// The stateful firewall (per interface, off by default): what cannot start a connection,
/// does not fit its state, or is an error for no connection is dropped with its reason.
fn firewall_sequences() -> Vec<Seq> {
    vec![
        Seq::firewall("firewall_passes_a_whole_tcp_connection", tcp4())
            .active_close()
            .table_len(1),
        Seq::firewall(
            "firewall_drops_mid_stream_packets_without_connection",
            tcp4(),
        )
        .tcp_fw_refused(O, ACK)
        .tcp_fw_refused(O, DATA)
        .tcp_fw_refused(R, SYNACK)
        .tcp_fw_refused(O, FIN)
        .tcp_fw_refused(O, RST)
        .table_len(0)
        .tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)]),
        Seq::firewall("firewall_drops_tcp_invalid_for_its_state", tcp4())
            .tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
            .tcp(O, ACK, SS, NOFLAGS, HIT_INVALID, &[])
            .dropped(reason::FW_INVALID_STATE)
            .tcp(R, SYNACK, SR, SEEN, HIT, &[(REPLIED_EV, SR)])
            .tcp(O, ACK, ES, SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, ES)])
            // An invalid flag combination: dropped before the state machine sees it.
            .hostile(
                "orig no flags".into(),
                tcp4().tcp(O, 0, &[]),
                reason::TCP_INVALID_FLAGS,
                true,
            )
            // Retransmissions are accepted (ignored by the state machine), not dropped.
            .tcp(O, SYN, ES, SEEN_ASSURED, HIT_IGNORED, &[]),
        Seq::firewall(
            "firewall_passes_udp_and_echo_and_drops_unsolicited_replies",
            udp4(),
        )
        .udp(O, b"query", NOFLAGS, CREATED, &[(NEW_EV, 0)])
        .udp(R, b"answer", SEEN, HIT, &[(REPLIED_EV, 0)])
        .flow(Flow::icmp4(A4, B4, 11))
        .echo(O, 1, NOFLAGS, CREATED, &[(NEW_EV, 0)])
        .echo(R, 1, SEEN, HIT, &[(REPLIED_EV, 0)])
        .flow(Flow::icmp6(A6, B6, 12))
        .echo_refused(1)
        .dropped(reason::FW_NO_CONNECTION)
        .table_len(2),
        Seq::firewall(
            "firewall_passes_related_errors_and_drops_unrelated_ones",
            udp4(),
        )
        .udp(O, b"query", NOFLAGS, CREATED, &[(NEW_EV, 0)])
        .icmp_error(O, 3, 3, &[RELATED])
        .flow(Flow::v4(proto::UDP, A4, 7777, B4, 53))
        .icmp_error(O, 3, 3, &[RELATED_MISS])
        .dropped(reason::FW_ICMP_ERROR_NO_CONNECTION)
        .flow(tcp6())
        .icmp_error(O, 2, 0, &[RELATED_MISS])
        .dropped(reason::FW_ICMP_ERROR_NO_CONNECTION),
        // The firewall is on the ingress side only: what this node sends is not filtered.
        Seq::new(
            "firewall_does_not_filter_local_egress",
            Seed::iface(
                TEST_RUN_IFINDEX,
                IFACE_F_CT_TC_EGRESS | IFACE_F_CT_TC_INGRESS | IFACE_F_FIREWALL,
            ),
            Hook::TcEgress,
            tcp4(),
        )
        .tcp(O, ACK, ES, NOFLAGS, CREATED, &[(NEW_EV, ES)])
        .on(Hook::TcIngress)
        .tcp(R, ACK, ES, SEEN, HIT, &[(REPLIED_EV, ES)]),
    ]
}

/// A full table: the oldest unassured connection makes room (early drop, with an event);
/// assured ones never do — with only those left, the new connection is refused. Run on a
/// fixture whose table holds [`PRESSURE_CAPACITY`] entries.
pub fn pressure_sequences() -> Vec<CtSequence> {
    let udp = |port: u16| Flow::v4(proto::UDP, A4, port, B4, 53);
    let assured = PRESSURE_CAPACITY - 4;
    let mut seq = Seq::xdp("early_drop_takes_the_oldest_unassured_entry", udp(1001))
        .prefilled(assured)
        .udp(O, b"1", NOFLAGS, CREATED, &[(NEW_EV, 0)]);
    for port in 1002..=1004 {
        seq = seq
            .flow(udp(port))
            .udp(O, b"n", NOFLAGS, CREATED, &[(NEW_EV, 0)]);
    }
    let seq = seq
        .table_len(PRESSURE_CAPACITY as usize)
        // Full: the oldest unassured (port 1001) goes.
        .flow(udp(1005))
        .udp(O, b"5", NOFLAGS, CREATED_EARLY_DROP, &[(NEW_EV, 0)])
        .early_drops(udp(1001).key())
        .table_len(PRESSURE_CAPACITY as usize)
        // A TCP connection starts under pressure (1002 goes) and becomes assured.
        .flow(tcp4())
        .tcp(O, SYN, SS, NOFLAGS, CREATED_EARLY_DROP, &[(NEW_EV, SS)])
        .early_drops(udp(1002).key())
        .tcp(R, SYNACK, SR, SEEN, HIT, &[(REPLIED_EV, SR)])
        .tcp(O, ACK, ES, SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, ES)])
        .flow(udp(1006))
        .udp(O, b"6", NOFLAGS, CREATED_EARLY_DROP, &[(NEW_EV, 0)])
        .early_drops(udp(1003).key())
        .flow(udp(1007))
        .udp(O, b"7", NOFLAGS, CREATED_EARLY_DROP, &[(NEW_EV, 0)])
        .early_drops(udp(1004).key())
        .flow(udp(1008))
        .udp(O, b"8", NOFLAGS, CREATED_EARLY_DROP, &[(NEW_EV, 0)])
        .early_drops(udp(1005).key())
        // Next in line is the TCP connection, assured since: skipped, 1006 goes instead.
        .flow(udp(1009))
        .udp(O, b"9", NOFLAGS, CREATED_EARLY_DROP, &[(NEW_EV, 0)])
        .early_drops(udp(1006).key())
        .table_len(PRESSURE_CAPACITY as usize)
        .flow(tcp4())
        .tcp_data(O, b"still here", ES, SEEN_ASSURED, HIT);
    let full = |name| {
        Seq::xdp(name, udp(2001))
            .prefilled(PRESSURE_CAPACITY)
            .untouched(
                "new udp flow, table full of assured",
                udp(2001).udp(O, b"x"),
                TABLE_FULL,
            )
            .table_len(PRESSURE_CAPACITY as usize)
    };
    vec![
        seq,
        full("a_table_full_of_assured_refuses_new_connections")
            .flow(tcp4())
            .untouched(
                "tcp SYN, table full of assured",
                tcp4().tcp(O, SYN, &[]),
                TABLE_FULL,
            ),
        Seq::firewall("firewall_drops_what_a_full_table_cannot_take", tcp4())
            .prefilled(PRESSURE_CAPACITY)
            .untouched("tcp SYN, table full", tcp4().tcp(O, SYN, &[]), TABLE_FULL)
            .dropped(reason::FW_TABLE_FULL),
    ]
    .into_iter()
    .map(Seq::build)
    .collect()
}

/// Table size the pressure sequences run with.
pub const PRESSURE_CAPACITY: u32 = 64;

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
        // Errors quoting something that is not a tracked packet (here: protocol 69, next
        // header 96) change nothing and count as misses; ND is not tracked at all.
        Seq::xdp("icmp_errors_quoting_untracked_packets_and_nd", udp4())
            .untouched(
                "icmp port unreachable quoting protocol 69",
                v4().icmp(3, 3, [0; 4]).payload(&[0x45; 28]).build(),
                &[RELATED_MISS],
            )
            .untouched(
                "icmp time exceeded quoting protocol 69",
                v4().icmp(11, 0, [0; 4]).payload(&[0x45; 28]).build(),
                &[RELATED_MISS],
            )
            .untouched(
                "icmpv6 packet too big quoting next header 96",
                v6().icmpv6(2, 0, [0, 0, 5, 0xdc])
                    .payload(&[0x60; 48])
                    .build(),
                &[RELATED_MISS],
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
        .udp(R, b"a", SEEN, HIT, &[(REPLIED_EV, 0)])
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
        .tcp(R, SYNACK, SR, SEEN, HIT, &[(REPLIED_EV, SR)])
        .on(Hook::TcEgress)
        .tcp(O, ACK, ES, SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, ES)])
        .counts([2, 1], [108, 54])
        .table_len(1),
    ]
}

const VIP4: [u8; 4] = [10, 0, 0, 100];
const BE4: [[u8; 4]; 4] = [[10, 0, 1, 1], [10, 0, 1, 2], [10, 0, 1, 3], [10, 0, 1, 4]];
const VIP6: [u8; 16] = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0];
const BE6: [u8; 16] = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x10, 1];

/// `[[service]]` TOML: `vip:port` over `protocol` to `backends` (address, port), weight 1.
fn service_toml(
    vip: &str,
    port: u16,
    protocol: &str,
    backends: &[(String, u16)],
    extra: &str,
) -> String {
    let mut s = format!(
        "[[service]]\nvip = \"{vip}\"\nport = {port}\nprotocol = \"{protocol}\"\n{extra}\n"
    );
    for (a, p) in backends {
        s += &format!("[[service.backend]]\naddress = \"{a}\"\nport = {p}\n");
    }
    s
}

fn ip4(a: [u8; 4]) -> String {
    std::net::Ipv4Addr::from(a).to_string()
}

fn ip6(a: [u8; 16]) -> String {
    std::net::Ipv6Addr::from(a).to_string()
}

/// The backend (address, port) the daemon's own table gives `flow`'s connection for the
/// service in `services`: what the datapath must pick too.
fn predicted_backend(services: &str, flow: &Flow) -> ([u8; 16], u16) {
    let text = format!("[[interface]]\nname = \"lo\"\n{services}");
    let config = crate::config::Config::parse_with(
        std::path::Path::new("lb sequence"),
        &text,
        crate::config::InterfaceCheck::Skip,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let b = crate::lb::predict(&config.services, 0, &flow.key())
        .unwrap_or_else(|e| panic!("{e}"))
        .expect("the service has backends");
    (b.addr, b.port)
}

/// The first source port a full-NAT allocation tries for `flow` in `first..=last`.
fn snat_first_port(flow: &Flow, first: u16, last: u16) -> u16 {
    let n = u32::from(last - first) + 1;
    first + (fastpath_common::lb::flow_hash(&flow.key()) % n) as u16
}

/// Full-NAT: the source is translated too (to the service's `snat_address` and a port the
/// datapath allocates by inserting the alias, snat ↔ backend), so the backend replies to this
/// node; replies are translated back to VIP → client. A taken port moves the allocation to
/// the next candidate; with every candidate taken the connection is refused and counted.
fn full_nat_sequences() -> Vec<Seq> {
    const SNAT4: [u8; 4] = [10, 0, 2, 1];
    const SNAT6: [u8; 16] = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x20, 1];
    let full = |snat: &str, ports: &str| {
        format!("mode = \"full_nat\"\nsnat_address = \"{snat}\"\nsnat_ports = \"{ports}\"")
    };
    let tcp4_svc = service_toml(
        &ip4(VIP4),
        80,
        "tcp",
        &[(ip4(BE4[0]), 8080)],
        &full(&ip4(SNAT4), "20000-29999"),
    );
    let tcp_vip = Flow::v4(proto::TCP, A4, 40000, VIP4, 80);
    let sp = snat_first_port(&tcp_vip, 20000, 29999);
    let udp6_svc = service_toml(
        &ip6(VIP6),
        53,
        "udp",
        &[(ip6(BE6), 5353)],
        &full(&ip6(SNAT6), "1024-32767"),
    );
    let udp6_vip = Flow::v6(proto::UDP, A6, 33000, VIP6, 53);
    let sp6 = snat_first_port(&udp6_vip, 1024, 32767);
    let tcp6_svc = service_toml(
        &ip6(VIP6),
        443,
        "tcp",
        &[(ip6(BE6), 8443)],
        &full(&ip6(SNAT6), "1024-32767"),
    );
    let tcp6_vip = Flow::v6(proto::TCP, A6, 40001, VIP6, 443);
    let sp6t = snat_first_port(&tcp6_vip, 1024, 32767);
    // Two ports only: a second connection whose first candidate is taken gets the other;
    // a third finds both taken.
    let two = service_toml(
        &ip4(VIP4),
        80,
        "tcp",
        &[(ip4(BE4[0]), 8080)],
        &full(&ip4(SNAT4), "20000-20001"),
    );
    let port_flow = |port: u16| Flow::v4(proto::TCP, A4, port, VIP4, 80);
    let a = port_flow(45000);
    let a_port = snat_first_port(&a, 20000, 20001);
    let other = if a_port == 20000 { 20001 } else { 20000 };
    let b = (45001..46000)
        .map(port_flow)
        .find(|f| snat_first_port(f, 20000, 20001) == a_port)
        .expect("a flow with the same first candidate");
    let c = (b.cport + 1..47000)
        .map(port_flow)
        .next()
        .expect("a third flow");
    let mut retried_once = CREATED.to_vec();
    retried_once.push(SNAT_RETRIES);
    let mut exhausted = vec![LOOKUPS, SNAT_EXHAUSTED];
    exhausted.extend(std::iter::repeat_n(
        SNAT_RETRIES,
        fastpath_common::lb::SNAT_TRIES as usize,
    ));
    let icmp_errors = Seq::lb(
        "lb_full_nat_icmp_errors_reach_the_client",
        tcp_vip,
        &tcp4_svc,
    )
    .via(v4(BE4[0]), 8080)
    .snat(v4(SNAT4), sp)
    .lb_tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
    .lb_icmp_error(3, 4)
    .lb_icmp_error(11, 0);
    let icmp6_errors = Seq::lb(
        "lb_full_nat_icmpv6_packet_too_big_reaches_the_client",
        udp6_vip,
        &udp6_svc,
    )
    .via(BE6, 5353)
    .snat(SNAT6, sp6)
    .lb_udp(O, b"query", NOFLAGS, CREATED, &[(NEW_EV, 0)])
    .lb_icmp_error(2, 0)
    .lb_icmp_error(1, 4);
    vec![
        icmp_errors,
        icmp6_errors,
        Seq::lb("lb_full_nat_tcp_v4_whole_connection", tcp_vip, &tcp4_svc)
            .via(v4(BE4[0]), 8080)
            .snat(v4(SNAT4), sp)
            .lb_tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
            .table_len(2)
            .lb_tcp(R, SYNACK, SR, SEEN, HIT, &[(REPLIED_EV, SR)])
            .lb_tcp(O, ACK, ES, SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, ES)])
            .lb_tcp(O, DATA, ES, SEEN_ASSURED, HIT, &[])
            .lb_tcp(R, DATA, ES, SEEN_ASSURED, HIT, &[])
            .lb_tcp(O, FIN, FW, SEEN_ASSURED, HIT, &[])
            .lb_tcp(R, FIN, LA, SEEN_ASSURED, HIT, &[])
            .lb_tcp(O, ACK, TW, SEEN_ASSURED, HIT_CLOSED, &[(CLOSED_EV, TW)])
            .counts([5, 3], [5 * 54, 3 * 54])
            .table_len(2),
        Seq::lb("lb_full_nat_tcp_v6_handshake", tcp6_vip, &tcp6_svc)
            .via(BE6, 8443)
            .snat(SNAT6, sp6t)
            .lb_tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
            .lb_tcp(R, SYNACK, SR, SEEN, HIT, &[(REPLIED_EV, SR)])
            .lb_tcp(O, ACK, ES, SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, ES)]),
        Seq::lb("lb_full_nat_udp_v6_query_and_answer", udp6_vip, &udp6_svc)
            .via(BE6, 5353)
            .snat(SNAT6, sp6)
            .lb_udp(O, b"query", NOFLAGS, CREATED, &[(NEW_EV, 0)])
            .lb_udp(R, b"answer", SEEN, HIT, &[(REPLIED_EV, 0)])
            .lb_udp(O, b"again", SEEN, HIT, &[])
            .table_len(2),
        Seq::lb(
            "lb_full_nat_taken_port_moves_to_the_next_candidate",
            a,
            &two,
        )
        .via(v4(BE4[0]), 8080)
        .snat(v4(SNAT4), a_port)
        .lb_tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
        .flow(b)
        .snat(v4(SNAT4), other)
        .lb_tcp(O, SYN, SS, NOFLAGS, &retried_once, &[(NEW_EV, SS)])
        .table_len(4)
        .flow(c)
        .untouched(
            "SYN with every source port taken",
            c.tcp(O, SYN, &[]),
            &exhausted,
        )
        .drop_reason(reason::SNAT_EXHAUSTED)
        .table_len(4),
    ]
}

/// Load balancing (NAT mode, XDP): the first packet of a connection to a service picks a
/// backend and is translated to it; the backend's replies are translated back to the VIP;
/// the connection's state lives in one entry (client ↔ VIP) with an alias (client ↔ backend).
/// Every translated frame is compared byte for byte with one the packet builder makes with
/// fully recomputed checksums.
fn lb_sequences() -> Vec<Seq> {
    let one4 = service_toml(&ip4(VIP4), 80, "tcp", &[(ip4(BE4[0]), 8080)], "");
    let tcp_vip = Flow::v4(proto::TCP, A4, 40000, VIP4, 80);
    let be0 = v4(BE4[0]);
    // The client's flow straight to backend 0 from tcp_vip's port: its alias tuple.
    let direct_be0 = Flow {
        server: be0,
        sport: 8080,
        ..tcp_vip
    };
    let udp6_svc = service_toml(&ip6(VIP6), 53, "udp", &[(ip6(BE6), 5353)], "");
    let udp6_vip = Flow::v6(proto::UDP, A6, 33000, VIP6, 53);
    let udp4_svc = service_toml(&ip4(VIP4), 53, "udp", &[(ip4(BE4[1]), 53)], "");
    let udp4_vip = Flow::v4(proto::UDP, A4, 33001, VIP4, 53);
    let tcp6_svc = service_toml(&ip6(VIP6), 443, "tcp", &[(ip6(BE6), 8443)], "");
    let tcp6_vip = Flow::v6(proto::TCP, A6, 40001, VIP6, 443);
    let four = service_toml(
        &ip4(VIP4),
        80,
        "tcp",
        &BE4.iter().map(|b| (ip4(*b), 8080)).collect::<Vec<_>>(),
        "",
    );
    let empty_kernel = service_toml(&ip4(VIP4), 80, "tcp", &[], "");
    let empty_drop = service_toml(&ip4(VIP4), 80, "tcp", &[], "no_backend = \"drop\"");
    let moved = service_toml(&ip4(VIP4), 80, "tcp", &[(ip4(BE4[1]), 8080)], "");
    let udp_zero = |dir: Dir, f: &Flow, payload: &[u8]| -> Vec<u8> {
        let (sp, dp) = f.ports(dir);
        f.ip(dir)
            .udp(sp, dp)
            .l4_checksum(0)
            .payload(payload)
            .build()
    };
    let mut predicted = Seq::lb(
        "lb_maglev_picks_the_backend_the_daemon_predicts",
        tcp_vip,
        &four,
    );
    for port in 41000..41012u16 {
        let flow = Flow::v4(proto::TCP, A4, port, VIP4, 80);
        let (b, p) = predicted_backend(&four, &flow);
        predicted =
            predicted
                .flow(flow)
                .via(b, p)
                .lb_tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)]);
    }
    let three = |extra: &str, weights: [u32; 3]| {
        let mut t = format!(
            "[[service]]\nvip = \"{}\"\nport = 80\nprotocol = \"tcp\"\n{extra}\n",
            ip4(VIP4)
        );
        for (b, w) in BE4.iter().take(3).zip(weights) {
            t += &format!(
                "[[service.backend]]\naddress = \"{}\"\nport = 8080\nweight = {w}\n",
                ip4(*b)
            );
        }
        t
    };
    let port_flow = |port: u16| Flow::v4(proto::TCP, A4, port, VIP4, 80);
    let mut wrr = Seq::lb(
        "lb_weighted_round_robin_follows_the_smooth_sequence",
        port_flow(42000),
        &three("scheduler = \"wrr\"", [1, 1, 2]),
    );
    for (n, b) in [2usize, 0, 1, 2].into_iter().enumerate() {
        wrr = wrr
            .flow(port_flow(42000 + n as u16))
            .via(v4(BE4[b]), 8080)
            .lb_tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)]);
    }
    let lc_svc = three("scheduler = \"least_connections\"", [1, 1, 1]);
    let mut lc = Seq::lb(
        "lb_least_connections_fills_the_emptiest_backend",
        port_flow(43000),
        &lc_svc,
    );
    for (n, b) in [0usize, 1, 2, 0].into_iter().enumerate() {
        lc = lc
            .flow(port_flow(43000 + n as u16))
            .via(v4(BE4[b]), 8080)
            .lb_tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)]);
    }
    // Backend 1's connection is refused (RST before any reply): its place is free again.
    let lc = lc
        .flow(port_flow(43001))
        .via(v4(BE4[1]), 8080)
        .lb_packet(
            R,
            "lb reply RST|ACK before any reply".into(),
            (
                Flow {
                    server: v4(BE4[1]),
                    sport: 8080,
                    ..port_flow(43001)
                }
                .tcp(R, RSTACK, &[]),
                port_flow(43001).tcp(R, RSTACK, &[]),
            ),
            None,
            NOFLAGS,
            HIT_KILLED,
            &[(ct_event::KILLED, CL)],
        )
        .gone()
        .flow(port_flow(43009))
        .via(v4(BE4[1]), 8080)
        .lb_tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)]);
    let aff_svc = three("affinity_timeout_s = 60", [1, 1, 1]);
    let first = predicted_backend(&aff_svc, &port_flow(44000));
    // A second port that Maglev alone sends to another backend.
    let other = (44001..45000u16)
        .find(|&p| predicted_backend(&aff_svc, &port_flow(p)) != first)
        .expect("a port Maglev sends elsewhere");
    let affinity = Seq::lb(
        "lb_source_ip_affinity_keeps_the_client_on_its_backend",
        port_flow(44000),
        &aff_svc,
    )
    .via(first.0, first.1)
    .lb_tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
    .flow(port_flow(other))
    .via(first.0, first.1)
    .lb_tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)]);
    let zero_in = udp_zero(O, &udp4_vip, b"q");
    let zero_out = udp_zero(
        O,
        &Flow {
            server: v4(BE4[1]),
            ..udp4_vip
        },
        b"q",
    );
    let zero_reply_in = udp_zero(
        R,
        &Flow {
            server: v4(BE4[1]),
            ..udp4_vip
        },
        b"a",
    );
    let zero_reply_out = udp_zero(R, &udp4_vip, b"a");
    // Two VIPs of one backend: a client's port, free again once its connection through the
    // first ended, opens a connection through the second (the same alias key).
    let vip4b = [10, 0, 0, 101];
    let two_vips = one4.clone() + &service_toml(&ip4(vip4b), 80, "tcp", &[(ip4(BE4[0]), 8080)], "");
    let port_reused = Seq::lb(
        "lb_an_ended_connections_alias_gives_way_to_another_vips",
        tcp_vip,
        &two_vips,
    )
    .via(be0, 8080)
    .lb_tcp_open_and_close()
    .table_len(2)
    .flow(Flow::v4(proto::TCP, A4, 40000, vip4b, 80))
    .via(be0, 8080)
    .lb_syn_reopening()
    .table_len(3);
    vec![
        port_reused,
        // ICMP errors from the backend side about the client's packets (fragmentation needed,
        // port unreachable; packet too big): the client sees them about its own packets to
        // the VIP, from the VIP, every checksum as a full recomputation gives it.
        Seq::lb("lb_icmp_frag_needed_reaches_the_client", tcp_vip, &one4)
            .via(be0, 8080)
            .lb_tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
            .lb_icmp_error(3, 4)
            .table_len(2),
        Seq::lb(
            "lb_icmp_port_unreachable_reaches_the_client",
            udp4_vip,
            &udp4_svc,
        )
        .via(v4(BE4[1]), 53)
        .lb_udp(O, b"query", NOFLAGS, CREATED, &[(NEW_EV, 0)])
        .lb_icmp_error(3, 3),
        Seq::lb(
            "lb_icmpv6_packet_too_big_reaches_the_client",
            tcp6_vip,
            &tcp6_svc,
        )
        .via(BE6, 8443)
        .lb_tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
        .lb_icmp_error(2, 0),
        Seq::lb(
            "lb_icmpv6_unreachable_about_udp_reaches_the_client",
            udp6_vip,
            &udp6_svc,
        )
        .via(BE6, 5353)
        .lb_udp(O, b"query", NOFLAGS, CREATED, &[(NEW_EV, 0)])
        .lb_icmp_error(1, 4),
        Seq::lb(
            "lb_tcp_v4_whole_connection_through_the_backend",
            tcp_vip,
            &one4,
        )
        .via(be0, 8080)
        .lb_tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
        .table_len(2)
        .lb_tcp(R, SYNACK, SR, SEEN, HIT, &[(REPLIED_EV, SR)])
        .lb_tcp(O, ACK, ES, SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, ES)])
        // The backend's first ACK of the established connection steps it (and marks its
        // alias); its next is found on the alias alone and counted there (one lookup), so
        // the connection's entry counts 4 of the backend's 5 packets.
        .lb_tcp(R, ACK, ES, SEEN_ASSURED, HIT, &[])
        .lb_tcp(R, ACK, ES, SEEN_ASSURED, HIT, &[])
        // The client's FIN takes that back: the backend's ACK steps the connection again
        // (FIN_WAIT → CLOSE_WAIT, which a one-lookup ACK would have skipped).
        .lb_tcp(O, FIN, FW, SEEN_ASSURED, HIT, &[])
        .lb_tcp(R, ACK, CW, SEEN_ASSURED, HIT, &[])
        .lb_tcp(R, FIN, LA, SEEN_ASSURED, HIT, &[])
        .lb_tcp(O, ACK, TW, SEEN_ASSURED, HIT_CLOSED, &[(CLOSED_EV, TW)])
        .counts([4, 4], [4 * 54, 4 * 54])
        .table_len(2),
        Seq::lb("lb_tcp_v6_handshake", tcp6_vip, &tcp6_svc)
            .via(BE6, 8443)
            .lb_tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
            .lb_tcp(R, SYNACK, SR, SEEN, HIT, &[(REPLIED_EV, SR)])
            .lb_tcp(O, ACK, ES, SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, ES)]),
        Seq::lb("lb_udp_v6_query_and_answer", udp6_vip, &udp6_svc)
            .via(BE6, 5353)
            .lb_udp(O, b"query", NOFLAGS, CREATED, &[(NEW_EV, 0)])
            .lb_udp(R, b"answer", SEEN, HIT, &[(REPLIED_EV, 0)])
            .lb_udp(O, b"again", SEEN, HIT, &[])
            .table_len(2),
        // UDP over IPv4 may carry no checksum: a translated datagram keeps none.
        Seq::lb("lb_udp_v4_zero_checksum_stays_zero", udp4_vip, &udp4_svc)
            .via(v4(BE4[1]), 53)
            .lb_packet(
                O,
                "lb orig UDP without checksum".into(),
                (zero_in, zero_out),
                None,
                NOFLAGS,
                CREATED,
                &[(NEW_EV, 0)],
            )
            .lb_packet(
                R,
                "lb reply UDP without checksum".into(),
                (zero_reply_in, zero_reply_out),
                None,
                SEEN,
                HIT,
                &[(REPLIED_EV, 0)],
            ),
        predicted.table_len(24),
        // An established connection stays on its backend when the service changes; a new one
        // goes where the service now says.
        Seq::lb(
            "lb_backend_removed_mid_connection_keeps_the_connection",
            tcp_vip,
            &one4,
        )
        .via(be0, 8080)
        .lb_tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
        .lb_tcp(R, SYNACK, SR, SEEN, HIT, &[(REPLIED_EV, SR)])
        .lb_tcp(O, ACK, ES, SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, ES)])
        .reseed(&moved)
        .lb_tcp(O, DATA, ES, SEEN_ASSURED, HIT, &[])
        .lb_tcp(R, DATA, ES, SEEN_ASSURED, HIT, &[])
        .flow(Flow::v4(proto::TCP, A4, 40009, VIP4, 80))
        .via(v4(BE4[1]), 8080)
        .lb_tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
        .table_len(4),
        // The client talked to the backend directly from the same port before (TIME_WAIT):
        // that ended connection gives way to the new connection's alias.
        Seq::lb(
            "lb_alias_replaces_an_ended_direct_connection",
            Flow::v4(proto::TCP, A4, 40000, BE4[0], 8080),
            &one4,
        )
        .active_close()
        .flow(tcp_vip)
        .via(be0, 8080)
        .lb_syn_reopening()
        .table_len(2)
        .lb_tcp(R, SYNACK, SR, SEEN, HIT, &[(REPLIED_EV, SR)]),
        // The other way round: the client's connection through the VIP ended, and it dials
        // the backend directly from the same port: the alias gives way to a plain connection,
        // whose packets pass untranslated.
        Seq::lb(
            "lb_ended_connections_alias_gives_way_to_a_direct_connection",
            tcp_vip,
            &one4,
        )
        .via(be0, 8080)
        .lb_tcp_open_and_close()
        .flow(direct_be0)
        .tcp(
            O,
            SYN,
            SS,
            NOFLAGS,
            &[LOOKUPS, HITS, REOPENED, NEW],
            &[(NEW_EV, SS)],
        )
        .table_len(2)
        .tcp(R, SYNACK, SR, SEEN, HIT, &[(REPLIED_EV, SR)]),
        // While the balanced connection lives, a packet from the client to the backend on its
        // alias tuple is not the backend's reply: it goes to the kernel as it is (translated
        // it would reach the backend from the VIP), untracked, and the connection carries on.
        Seq::lb(
            "lb_direct_segment_on_a_live_connections_alias_is_not_translated",
            tcp_vip,
            &one4,
        )
        .via(be0, 8080)
        .lb_tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
        .lb_tcp(R, SYNACK, SR, SEEN, HIT, &[(REPLIED_EV, SR)])
        .untouched(
            "SYN from the client to the backend on the alias tuple",
            direct_be0.tcp(O, SYN, &[]),
            &[LOOKUPS, HITS, ALIAS_CLASH],
        )
        .table_len(2)
        .lb_tcp(O, ACK, ES, SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, ES)]),
        Seq::lb(
            "lb_direct_datagram_on_a_live_flows_alias_is_not_translated",
            udp4_vip,
            &udp4_svc,
        )
        .via(v4(BE4[1]), 53)
        .lb_udp(O, b"query", NOFLAGS, CREATED, &[(NEW_EV, 0)])
        .untouched(
            "datagram from the client to the backend on the alias tuple",
            Flow {
                server: v4(BE4[1]),
                sport: 53,
                ..udp4_vip
            }
            .udp(O, b"direct"),
            &[LOOKUPS, HITS, ALIAS_CLASH],
        )
        .table_len(2)
        .lb_udp(R, b"answer", SEEN, HIT, &[(REPLIED_EV, 0)]),
        Seq::lb(
            "lb_direct_segment_on_a_live_v6_connections_alias_is_not_translated",
            tcp6_vip,
            &tcp6_svc,
        )
        .via(BE6, 8443)
        .lb_tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
        .untouched(
            "IPv6 SYN from the client to the backend on the alias tuple",
            Flow {
                server: BE6,
                sport: 8443,
                ..tcp6_vip
            }
            .tcp(O, SYN, &[]),
            &[LOOKUPS, HITS, ALIAS_CLASH],
        )
        .table_len(2)
        .lb_tcp(R, SYNACK, SR, SEEN, HIT, &[(REPLIED_EV, SR)]),
        // Where the stateful firewall is on, such a packet is dropped as invalid.
        Seq::new(
            "lb_firewall_drops_a_direct_segment_on_a_live_connections_alias",
            Seed::iface(TEST_RUN_IFINDEX, IFACE_F_CT_XDP | IFACE_F_FIREWALL).with_services(&one4),
            Hook::Xdp,
            tcp_vip,
        )
        .via(be0, 8080)
        .lb_tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
        .untouched(
            "SYN from the client to the backend on the alias tuple",
            direct_be0.tcp(O, SYN, &[]),
            &[LOOKUPS, HITS, ALIAS_CLASH],
        )
        .dropped(reason::FW_INVALID_STATE)
        .table_len(2)
        .lb_tcp(R, SYNACK, SR, SEEN, HIT, &[(REPLIED_EV, SR)]),
        // A SYN on the tuple of a closed connection is a new connection: balanced again by
        // the service as it is now, its old entry and alias replaced.
        Seq::lb(
            "lb_syn_on_a_closed_connection_is_balanced_again",
            tcp_vip,
            &one4,
        )
        .via(be0, 8080)
        .lb_tcp_open_and_close()
        .reseed(&moved)
        .via(v4(BE4[1]), 8080)
        .lb_tcp(
            O,
            SYN,
            SS,
            NOFLAGS,
            &[LOOKUPS, HITS, REOPENED, NEW],
            &[(NEW_EV, SS)],
        )
        .also(direct_be0.key())
        .table_len(2),
        // Weighted round robin 1:1:2: the smooth sequence 2, 0, 1, 2 (the run stays on one
        // CPU, whose position for the new service starts at 0).
        wrr,
        // Least connections: open connections fill the emptiest backend; a closed one frees
        // its place.
        lc,
        // Source-IP affinity: a second connection of the client goes where its first went,
        // although Maglev alone would send it elsewhere.
        affinity,
        Seq::lb(
            "lb_service_without_backends_hands_to_the_kernel",
            tcp_vip,
            &empty_kernel,
        )
        .untouched(
            "SYN to a service with no backend",
            tcp_vip.tcp(O, SYN, &[]),
            &[LOOKUPS],
        )
        .kernel_reason(reason::LB_NO_BACKEND)
        .table_len(0),
        Seq::lb(
            "lb_service_without_backends_drops_when_told",
            tcp_vip,
            &empty_drop,
        )
        .untouched(
            "SYN to a service with no backend",
            tcp_vip.tcp(O, SYN, &[]),
            &[LOOKUPS],
        )
        .drop_reason(reason::LB_NO_BACKEND)
        .table_len(0),
    ]
}

/// Direct server return, against a FIB prepared by [`DSR_NETNS_SETUP`] (the test runs it in a
/// network namespace of its own): the packets of a connection to a DSR service leave by
/// redirect, unchanged but for the MAC addresses (the backend's, then the egress
/// interface's); replies pass untouched; no alias entry. A backend without a resolved
/// neighbour is refused (dropped, counted), its connection's entry kept for the
/// retransmission. Each at XDP and at TC ingress.
pub fn dsr_sequences() -> Vec<CtSequence> {
    dsr_seqs()
        .into_iter()
        .chain(dsr_seqs().into_iter().map(Seq::at_tc_ingress))
        .map(Seq::build)
        .collect()
}

/// A step of a DSR sequence: direction, TCP flags, the state and entry flags after it, the
/// conntrack counters and the events it makes.
type DsrStep = (Dir, u8, u8, u8, &'static [u32], &'static [(u8, u8)]);

/// The DSR sequences (XDP), for [`dsr_sequences`].
fn dsr_seqs() -> Vec<Seq> {
    let svc = |backend: String, vip: &str| {
        format!(
            "[[service]]\nvip = \"{vip}\"\nport = 80\nmode = \"dsr\"\n[[service.backend]]\naddress = \"{backend}\"\nport = 80\n"
        )
    };
    let with_macs = |frame: Vec<u8>, dst: [u8; 6]| {
        let mut out = frame;
        out[..6].copy_from_slice(&dst);
        out[6..12].copy_from_slice(&DSR_EGRESS_MAC);
        out
    };
    let v4 = Flow::v4(proto::TCP, A4, 40000, VIP4, 80);
    let v6 = Flow::v6(proto::TCP, A6, 40001, VIP6, 80);
    let mut seqs = Vec::new();
    // Replies through this node (the backend's route to the client passes here), as Linux's
    // table steps them ...
    let replied: &[DsrStep] = &[
        (O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)]),
        (R, SYNACK, SR, SEEN, HIT, &[(REPLIED_EV, SR)]),
        (O, ACK, ES, SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, ES)]),
        (O, DATA, ES, SEEN_ASSURED, HIT, &[]),
    ];
    // ... and the client's packets alone (the backend answers it directly): its first plain
    // ACK after the SYN establishes and assures the connection (`conntrack::step`, as IPVS's
    // DR mode), where Linux's table calls it invalid.
    let alone: &[DsrStep] = &[
        (O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)]),
        (O, ACK, ES, CT_F_ASSURED, HIT_ASSURED, &[(EST_EV, ES)]),
        (O, DATA, ES, CT_F_ASSURED, HIT, &[]),
    ];
    // (`linux`: the steps Linux's table takes, checked against the model of it.)
    for (name, flow, svcs, mac, (steps, linux)) in [
        (
            "dsr_tcp_v4_packets_go_to_the_backend_mac",
            v4,
            svc(ip4(BE4[0]), &ip4(VIP4)),
            DSR_BACKEND_MAC,
            (replied, true),
        ),
        (
            "dsr_tcp_v6_packets_go_to_the_backend_mac",
            v6,
            svc(ip6(BE6), &ip6(VIP6)),
            DSR_BACKEND6_MAC,
            (replied, true),
        ),
        (
            "dsr_tcp_v4_client_packets_alone_establish_the_connection",
            v4,
            svc(ip4(BE4[0]), &ip4(VIP4)),
            DSR_BACKEND_MAC,
            (alone, false),
        ),
        (
            "dsr_tcp_v6_client_packets_alone_establish_the_connection",
            v6,
            svc(ip6(BE6), &ip6(VIP6)),
            DSR_BACKEND6_MAC,
            (alone, false),
        ),
    ] {
        let mut s = Seq::lb(name, flow, &svcs);
        for &(dir, flags, state, ct_flags, stats, events) in steps {
            if linux {
                s.check_model(dir, flags, Some(state));
            }
            let input = flow.tcp(dir, flags, &[]);
            let expect = s.entry(Some(state), ct_flags);
            s = s.push(
                format!("dsr {} {}", dir.name(), flags_name(flags)),
                input.clone(),
                expect,
                stats,
                events,
            );
            if dir == O {
                let step = s.last_step("dsr_sequences");
                step.expect_output = Some(with_macs(input, mac));
                step.expect_forward = true;
                step.expect_reason = Some(reason::LB_DSR);
            }
        }
        // Hostile frames on the established DSR connection: never sent to the backend.
        for (flags, fname) in INVALID_FLAGS {
            s = s.hostile(
                format!("dsr orig {fname}"),
                flow.tcp(O, flags, &[]),
                reason::TCP_INVALID_FLAGS,
                true,
            );
        }
        seqs.push(s.table_len(1));
    }
    let unresolved = Seq::lb(
        "dsr_backend_without_neighbour_is_refused",
        v4,
        &svc(ip4(BE4[1]), &ip4(VIP4)),
    )
    .tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
    .drop_reason(reason::LB_DSR_NO_NEIGHBOR)
    .table_len(1);
    seqs.push(unresolved);
    seqs
}

/// The egress interface of the DSR sequences' routes and its MAC address.
pub const DSR_EGRESS_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0xfe];
/// The MAC addresses of the DSR sequences' resolved backends (`BE4[0]`, `BE6`).
pub const DSR_BACKEND_MAC: [u8; 6] = [0x02, 0, 0, 0, 1, 1];
pub const DSR_BACKEND6_MAC: [u8; 6] = [0x02, 0, 0, 0, 1, 6];
/// Commands (`ip ...`) that give a fresh network namespace the routes and neighbours the DSR
/// sequences expect: an interface `d0` (a veth, its peer up) on the backends' networks, `BE4[0]` and `BE6`
/// resolved, `BE4[1]` routed but not resolved.
pub const DSR_NETNS_SETUP: &[&[&str]] = &[
    &["ip", "link", "set", "lo", "up"],
    // The FIB answers forwarding lookups only where forwarding is on.
    &["sysctl", "-qw", "net.ipv4.ip_forward=1"],
    &["sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"],
    &[
        "ip",
        "link",
        "add",
        "d0",
        "address",
        "02:00:00:00:00:fe",
        "type",
        "veth",
        "peer",
        "name",
        "d1",
    ],
    &["ip", "link", "set", "d1", "up"],
    &["ip", "link", "set", "d0", "up"],
    &["ip", "addr", "add", "10.0.1.254/24", "dev", "d0"],
    &[
        "ip",
        "-6",
        "addr",
        "add",
        "fd00::fe/64",
        "dev",
        "d0",
        "nodad",
    ],
    &[
        "ip",
        "neigh",
        "add",
        "10.0.1.1",
        "lladdr",
        "02:00:00:00:01:01",
        "dev",
        "d0",
        "nud",
        "permanent",
    ],
    &[
        "ip",
        "-6",
        "neigh",
        "add",
        "fd00::1001",
        "lladdr",
        "02:00:00:00:01:06",
        "dev",
        "d0",
        "nud",
        "permanent",
    ],
];

/// `no_backend = "reject"`: the first packet of a connection to a service without backends is
/// answered in place and sent back out of the interface it came in on (a redirect): a TCP RST
/// (`<SEQ=0><ACK=SEG.SEQ+SEG.LEN><RST,ACK>` for a SYN) or an ICMP / ICMPv6 port unreachable
/// quoting the datagram's IP header and first 8 bytes, byte-exact with full checksums; no
/// entry is created.
fn reject_sequences() -> Vec<Seq> {
    let svcs = |vip: String| {
        format!(
            "[[service]]\nvip = \"{vip}\"\nport = 80\nno_backend = \"reject\"\n\
             [[service]]\nvip = \"{vip}\"\nport = 53\nprotocol = \"udp\"\nno_backend = \"reject\"\n"
        )
    };
    let back = |f: &Flow| {
        f.ip(R)
            .macs(packet::DEFAULT_SRC_MAC, packet::DEFAULT_DST_MAC)
    };
    let mut seqs = Vec::new();
    for (v4, tcp, udp, services) in [
        (
            true,
            Flow::v4(proto::TCP, A4, 40000, VIP4, 80),
            Flow::v4(proto::UDP, A4, 33000, VIP4, 53),
            svcs(ip4(VIP4)),
        ),
        (
            false,
            Flow::v6(proto::TCP, A6, 40000, VIP6, 80),
            Flow::v6(proto::UDP, A6, 33000, VIP6, 53),
            svcs(ip6(VIP6)),
        ),
    ] {
        // The answers' IPv4 headers: id 0, don't fragment.
        let ip4 = |p: Pkt| {
            if v4 {
                p.ip_id(0).ipv4_flags_frag(0x4000)
            } else {
                p
            }
        };
        // The builder's SYN carries seq 1: the RST acknowledges 2.
        let rst = ip4(back(&tcp))
            .tcp(80, 40000, tcp_flags::RST | tcp_flags::ACK)
            .tcp_seq_ack(0, 2)
            .tcp_window(0)
            .build();
        let datagram = udp.udp(O, b"query");
        let quote_len = if v4 { 20 + 8 } else { 40 + 8 };
        let quote = &datagram[14..14 + quote_len];
        let unreachable = if v4 {
            ip4(back(&udp)).icmp(3, 3, [0; 4])
        } else {
            back(&udp).icmpv6(1, 4, [0; 4])
        }
        .payload(quote)
        .build();
        let mut s = Seq::lb(
            if v4 {
                "lb_reject_answers_tcp_and_udp_v4"
            } else {
                "lb_reject_answers_tcp_and_udp_v6"
            },
            tcp,
            &services,
        );
        for (what, input, output) in [
            (
                "SYN to a service without backends",
                tcp.tcp(O, SYN, &[]),
                rst,
            ),
            (
                "UDP to a service without backends",
                datagram.clone(),
                unreachable,
            ),
        ] {
            s = s.untouched(what, input, &[LOOKUPS]);
            let step = s.last_step("reject_sequences");
            step.expect_output = Some(output);
            step.expect_forward = true;
            step.expect_reason = Some(reason::LB_REJECTED);
        }
        seqs.push(s.table_len(0));
    }
    seqs
}

/// Every conntrack sequence; the load-balancing ones also at TC ingress.
/// TCP flag combinations Linux's conntrack calls invalid (`tcp_valid_flags`), each with its
/// name: the fast path must never translate, track or forward them.
const INVALID_FLAGS: [(u8, &str); 7] = [
    (tcp_flags::SYN | tcp_flags::FIN, "SYN|FIN"),
    (0, "no flags"),
    (0xff, "every flag"),
    (tcp_flags::FIN, "FIN alone"),
    (tcp_flags::SYN | tcp_flags::RST, "SYN|RST"),
    (tcp_flags::FIN | tcp_flags::RST, "FIN|RST"),
    (
        tcp_flags::FIN | tcp_flags::PSH | tcp_flags::URG,
        "FIN|PSH|URG (xmas)",
    ),
];

impl Seq {
    /// A hostile frame: changes no entry (the whole table stays byte for byte as it was, its
    /// connection's entry included), moves no `ct_stat` counter, leaves the frame untranslated,
    /// and is counted once under `code` — dropped if `drop`, else the kernel's.
    fn hostile(self, what: String, input: Vec<u8>, code: u32, drop: bool) -> Self {
        let mut s = self.push(what, input, CtExpect::Untouched, &[], &[]);
        let step = s.last_step("hostile");
        if drop {
            step.expect_drop = Some(code);
        } else {
            step.expect_reason = Some(code);
        }
        s
    }

    /// Every invalid flag combination from both ends of the current flow's connection: from
    /// the client (to the VIP) and, load-balanced, from the backend (to the client, or to the
    /// full-NAT source), as they arrive. `drop`: dropped, else the kernel's.
    fn invalid_flags_both_ways(mut self, drop: bool) -> Self {
        for (flags, name) in INVALID_FLAGS {
            let from_client = self.flow.tcp(O, flags, &[]);
            let from_server = match self.backend {
                Some(_) => self.backend_flow().tcp(R, flags, &[]),
                None => self.flow.tcp(R, flags, &[]),
            };
            self = self
                .hostile(
                    format!("orig {name}"),
                    from_client,
                    reason::TCP_INVALID_FLAGS,
                    drop,
                )
                .hostile(
                    format!("reply {name}"),
                    from_server,
                    reason::TCP_INVALID_FLAGS,
                    drop,
                );
        }
        self
    }
}

/// Hostile frames, through the real entry points (XDP, and the TC ingress
/// load-balancing tail for each): TCP segments with flag combinations Linux's conntrack calls
/// invalid, against established NAT and full-NAT connections (dropped: the kernel would RST
/// the live connection), a plain tracked connection and a new tuple (the kernel's; dropped
/// with `drop_malformed` or the stateful firewall); and SYNs from martian sources to a VIP
/// (dropped, no entry, no NAT binding, no `ct_stat` counter). Each sequence carries its
/// positive control: valid packets of the same flow before and after are translated and
/// tracked as ever.
pub fn hostile_sequences() -> Vec<CtSequence> {
    let xdp = hostile_seqs();
    let tc: Vec<Seq> = hostile_seqs().into_iter().map(Seq::at_tc_ingress).collect();
    xdp.into_iter().chain(tc).map(Seq::build).collect()
}

fn hostile_seqs() -> Vec<Seq> {
    const SNAT4: [u8; 4] = [10, 0, 2, 1];
    let nat4 = service_toml(&ip4(VIP4), 80, "tcp", &[(ip4(BE4[0]), 8080)], "");
    let nat6 = service_toml(&ip6(VIP6), 443, "tcp", &[(ip6(BE6), 8443)], "");
    let full4 = service_toml(
        &ip4(VIP4),
        80,
        "tcp",
        &[(ip4(BE4[0]), 8080)],
        &format!(
            "mode = \"full_nat\"\nsnat_address = \"{}\"\nsnat_ports = \"20000-29999\"",
            ip4(SNAT4)
        ),
    );
    let tcp_vip = Flow::v4(proto::TCP, A4, 40000, VIP4, 80);
    let tcp6_vip = Flow::v6(proto::TCP, A6, 40001, VIP6, 443);
    let sp = snat_first_port(&tcp_vip, 20000, 29999);
    // A new client port to the VIP: no entry, and none made.
    let fresh = Flow::v4(proto::TCP, A4, 40100, VIP4, 80);
    let established = |s: Seq| {
        s.lb_tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
            .lb_tcp(R, SYNACK, SR, SEEN, HIT, &[(REPLIED_EV, SR)])
            .lb_tcp(O, ACK, ES, SEEN_ASSURED, HIT_ASSURED, &[(EST_EV, ES)])
    };
    let still_translated = |s: Seq| {
        s.lb_tcp(O, DATA, ES, SEEN_ASSURED, HIT, &[])
            .lb_tcp(R, DATA, ES, SEEN_ASSURED, HIT, &[])
            .counts([3, 2], [3 * 54, 2 * 54])
            .table_len(2)
    };
    let mut seqs = vec![
        still_translated(
            established(
                Seq::lb("hostile_invalid_tcp_flags_lb_nat_v4", tcp_vip, &nat4)
                    .via(v4(BE4[0]), 8080),
            )
            .invalid_flags_both_ways(true),
        ),
        established(Seq::lb("hostile_invalid_tcp_flags_lb_nat_v6", tcp6_vip, &nat6).via(BE6, 8443))
            .invalid_flags_both_ways(true)
            .lb_tcp(O, DATA, ES, SEEN_ASSURED, HIT, &[])
            .table_len(2),
        still_translated(
            established(
                Seq::lb("hostile_invalid_tcp_flags_lb_full_nat_v4", tcp_vip, &full4)
                    .via(v4(BE4[0]), 8080)
                    .snat(v4(SNAT4), sp),
            )
            .invalid_flags_both_ways(true),
        ),
    ];
    // A new tuple to the VIP: no connection to protect, so the kernel's (as a malformed
    // packet); dropped with drop_malformed. No entry either way; a valid SYN then opens one.
    let mut new_tuple = Seq::lb("hostile_invalid_tcp_flags_new_tuple_to_vip", fresh, &nat4);
    let mut dropping = Seed::iface(TEST_RUN_IFINDEX, IFACE_F_CT_XDP).with_services(&nat4);
    dropping.config.flags |= fastpath_common::stats::CONFIG_F_DROP_MALFORMED;
    let mut new_tuple_dropped = Seq::new(
        "hostile_invalid_tcp_flags_new_tuple_drop_malformed",
        dropping,
        Hook::Xdp,
        fresh,
    );
    for (flags, name) in INVALID_FLAGS {
        new_tuple = new_tuple.hostile(
            format!("orig {name} on a new tuple"),
            fresh.tcp(O, flags, &[]),
            reason::TCP_INVALID_FLAGS,
            false,
        );
        new_tuple_dropped = new_tuple_dropped.hostile(
            format!("orig {name} on a new tuple"),
            fresh.tcp(O, flags, &[]),
            reason::TCP_INVALID_FLAGS,
            true,
        );
    }
    for s in [new_tuple, new_tuple_dropped] {
        seqs.push(
            s.table_len(0)
                .via(v4(BE4[0]), 8080)
                .lb_tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
                .table_len(2),
        );
    }
    // A plain tracked connection (no service): the kernel's, its entry untouched; the
    // stateful firewall drops them.
    seqs.push(
        Seq::xdp("hostile_invalid_tcp_flags_tracked_connection", tcp4())
            .handshake()
            .invalid_flags_both_ways(false)
            .tcp_data(O, b"after", ES, SEEN_ASSURED, HIT)
            .table_len(1),
    );
    seqs.push(
        Seq::firewall("hostile_invalid_tcp_flags_firewall", tcp4())
            .handshake()
            .invalid_flags_both_ways(true)
            .tcp_data(O, b"after", ES, SEEN_ASSURED, HIT)
            .table_len(1),
    );
    seqs.extend(martian_seqs(&nat4, &nat6));
    seqs
}

/// SYNs from martian sources to a VIP: dropped, no entry, no NAT binding, no `ct_stat`
/// counter; a valid client's SYN after them still opens its balanced connection. On a
/// loopback device (the node's own traffic) such sources are not martian.
fn martian_seqs(nat4: &str, nat6: &str) -> Vec<Seq> {
    let mut lo6 = [0u8; 16];
    lo6[15] = 1;
    let mut mc6 = [0u8; 16];
    mc6[0] = 0xff;
    mc6[1] = 0x02;
    mc6[15] = 1;
    let v4_sources: [([u8; 4], &str); 6] = [
        ([127, 0, 0, 1], "loopback 127.0.0.1"),
        ([127, 1, 2, 3], "loopback 127.1.2.3"),
        ([255, 255, 255, 255], "limited broadcast"),
        ([0, 0, 0, 0], "0.0.0.0"),
        ([224, 0, 0, 1], "multicast 224.0.0.1"),
        (VIP4, "the VIP itself (LAND)"),
    ];
    let v6_sources: [([u8; 16], &str); 4] = [
        (lo6, "::1"),
        ([0; 16], "::"),
        (mc6, "multicast ff02::1"),
        (VIP6, "the VIP itself (LAND)"),
    ];
    let mut seq4 = Seq::lb(
        "hostile_martian_source_syn_v4",
        Flow::v4(proto::TCP, A4, 40000, VIP4, 80),
        nat4,
    );
    for (src, name) in v4_sources {
        let f = Flow::v4(proto::TCP, src, 40000, VIP4, 80);
        seq4 = seq4.hostile(
            format!("SYN from {name}"),
            f.tcp(O, SYN, &[]),
            reason::MARTIAN_SOURCE,
            true,
        );
        let f = Flow::v4(proto::UDP, src, 40000, VIP4, 80);
        seq4 = seq4.hostile(
            format!("UDP from {name}"),
            f.udp(O, b"x"),
            reason::MARTIAN_SOURCE,
            true,
        );
    }
    let seq4 = seq4
        .table_len(0)
        .via(v4(BE4[0]), 8080)
        .lb_tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
        .table_len(2);
    let mut seq6 = Seq::lb(
        "hostile_martian_source_syn_v6",
        Flow::v6(proto::TCP, A6, 40001, VIP6, 443),
        nat6,
    );
    for (src, name) in v6_sources {
        let f = Flow::v6(proto::TCP, src, 40001, VIP6, 443);
        seq6 = seq6.hostile(
            format!("SYN from {name}"),
            f.tcp(O, SYN, &[]),
            reason::MARTIAN_SOURCE,
            true,
        );
    }
    let seq6 = seq6
        .table_len(0)
        .via(BE6, 8443)
        .lb_tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
        .table_len(2);
    // The node's own traffic on a loopback device: a local client of a VIP on this node
    // has the VIP as its source too.
    let on_lo = Seq::new(
        "hostile_martian_source_not_judged_on_loopback",
        Seed::iface(TEST_RUN_IFINDEX, IFACE_F_CT_XDP | IFACE_F_LOOPBACK).with_services(nat4),
        Hook::Xdp,
        Flow::v4(proto::TCP, [127, 0, 0, 1], 40000, VIP4, 80),
    )
    .via(v4(BE4[0]), 8080)
    .lb_tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
    .flow(Flow::v4(proto::TCP, VIP4, 40001, VIP4, 80))
    .lb_tcp(O, SYN, SS, NOFLAGS, CREATED, &[(NEW_EV, SS)])
    .table_len(4);
    vec![seq4, seq6, on_lo]
}

pub fn ct_sequences() -> Vec<CtSequence> {
    let lb_tc: Vec<Seq> = lb_sequences()
        .into_iter()
        .chain(full_nat_sequences())
        .map(Seq::at_tc_ingress)
        .collect();
    [
        tcp_sequences(),
        direction_sequences(),
        udp_icmp_sequences(),
        related_sequences(),
        firewall_sequences(),
        lb_sequences(),
        full_nat_sequences(),
        reject_sequences(),
        untracked_sequences(),
        hook_sequences(),
        lb_tc,
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
        let mut seqs = ct_sequences();
        seqs.extend(hostile_sequences());
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
    fn every_firewall_reason_is_covered() {
        let dropped: BTreeSet<u32> = ct_sequences()
            .iter()
            .chain(pressure_sequences().iter())
            .flat_map(|s| s.steps.iter().filter_map(|st| st.expect_drop))
            .collect();
        for code in reason::FW_NO_CONNECTION..=reason::FW_TABLE_FULL {
            assert!(
                dropped.contains(&code),
                "no sequence drops with {}",
                reason::name(code)
            );
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
