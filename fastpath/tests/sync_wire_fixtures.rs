//! HA sync's wire form of conntrack entries, checked on entries the real datapath made
//! (BPF_PROG_TEST_RUN through the XDP entry point): load-balanced connections in NAT and
//! full-NAT mode (each a connection entry and its alias) and a plain tracked flow go to the
//! wire, through protobuf bytes, and back; every field a peer needs comes back identical
//! (timestamps and counters are the receiver's own), and on a peer whose service ids and
//! backend indexes differ the entries get the peer's numbers. Malformed records are refused.
//! Needs root; without it the test fails (never skips).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test code: a panic, with its message, is how a test fails"
)]

use fastpath::{
    sync::{LbIndex, WireError, from_wire, pb, to_wire},
    testkit::{
        fixture::{Case, Fixture, Seed},
        packet::{Pkt, tcp_flags},
        require_root,
    },
};
use fastpath_common::{
    ct::{CT_F_LB, CT_F_LB_ALIAS, CtEntry, IFACE_F_CT_XDP},
    lb::{Backend, Service, SvcKey},
};
use prost::Message as _;

const VIP_NAT: [u8; 4] = [10, 254, 0, 100];
const VIP_FULL: [u8; 4] = [10, 254, 0, 101];
const CLIENT: [u8; 4] = [10, 253, 0, 1];
const BACKENDS: [[u8; 4]; 2] = [[10, 252, 0, 1], [10, 252, 0, 2]];

fn services() -> String {
    let mut s = String::new();
    for (vip, extra) in [
        (VIP_NAT, ""),
        (
            VIP_FULL,
            "mode = \"full_nat\"\nsnat_address = \"10.251.0.1\"\n",
        ),
    ] {
        s += &format!(
            "[[service]]\nvip = \"{}\"\nport = 80\n{extra}",
            std::net::Ipv4Addr::from(vip)
        );
        for b in BACKENDS {
            s += &format!(
                "[[service.backend]]\naddress = \"{}\"\nport = 8080\n",
                std::net::Ipv4Addr::from(b)
            );
        }
    }
    s
}

fn case(seed: &Seed, input: Vec<u8>) -> Case {
    Case::xdp_to_kernel("sync wire", seed, input)
}

/// What a peer must reproduce: everything but the clock and the counters.
fn essence(e: &CtEntry) -> CtEntry {
    CtEntry {
        created_ns: 0,
        last_seen_ns: 0,
        packets: [0; 2],
        bytes: [0; 2],
        ..*e
    }
}

#[test]
fn datapath_entries_round_trip_through_the_wire_and_map_to_the_peers_numbers() {
    require_root("sync_wire_fixtures");
    let mut fx = Fixture::new().unwrap_or_else(|e| panic!("loading the datapath fixture: {e}"));
    let seed = Seed::iface(1, IFACE_F_CT_XDP).with_services(&services());
    // Three connections: one per service (first packet: SYN to the VIP), and a plain flow.
    for (vip, sport) in [
        (VIP_NAT, 40000),
        (VIP_FULL, 40001),
        ([10, 250, 0, 9], 40002),
    ] {
        let pkt = Pkt::eth()
            .ipv4(CLIENT, vip)
            .tcp(sport, 80, tcp_flags::SYN)
            .build();
        fx.run(&case(&seed, pkt))
            .unwrap_or_else(|e| panic!("SYN to {vip:?}: {e}"));
    }
    // The plain flow's answer: its entry sees a reply and moves on (SEEN_REPLY, SYN_RECV).
    let synack = Pkt::eth()
        .ipv4([10, 250, 0, 9], CLIENT)
        .tcp(80, 40002, tcp_flags::SYN | tcp_flags::ACK)
        .build();
    fx.run(&case(&seed, synack))
        .unwrap_or_else(|e| panic!("SYN-ACK: {e}"));
    let entries = fx.ct_entries().expect("reading FP_CT");
    assert!(
        entries
            .values()
            .any(|e| e.flags & fastpath_common::ct::CT_F_SEEN_REPLY != 0 && e.state != 0),
        "the plain flow saw its reply: {entries:#?}"
    );
    let lb = |bit| entries.values().filter(|e| e.flags & bit != 0).count();
    assert_eq!(
        (entries.len(), lb(CT_F_LB), lb(CT_F_LB_ALIAS)),
        (5, 2, 2),
        "two load-balanced connections (entry + alias each) and a plain one: {entries:#?}"
    );
    let index = fx.lb_index().expect("reading the LB maps");
    let now = fastpath::conntrack::monotonic_ns();

    for (key, entry) in &entries {
        let wire = to_wire(key, entry, now, &index).expect("a known service and backend");
        // Through protobuf bytes, as a peer receives it.
        let bytes = wire.encode_to_vec();
        let got = pb::Connection::decode(bytes.as_slice()).expect("decoding");
        let (k2, e2) = from_wire(&got, now, &index).expect("accepted");
        assert_eq!(&k2, key, "key");
        assert_eq!(essence(&e2), essence(entry), "entry of {key:?}");
        assert!(
            e2.last_seen_ns <= now && now - e2.last_seen_ns < 60_000_000_000,
            "last seen on the receiver's clock"
        );
    }

    // A peer that numbers services and backends differently: same identities, other numbers.
    let peer_services: Vec<(SvcKey, Service)> = [VIP_NAT, VIP_FULL]
        .iter()
        .enumerate()
        .map(|(i, vip)| {
            let mut k = SvcKey {
                port: 80,
                proto: 6,
                family: 4,
                ..SvcKey::default()
            };
            k.vip[..4].copy_from_slice(vip);
            let s = Service {
                id: 70 + i as u32,
                backends_off: 500 + 10 * i as u32,
                backends_len: 2,
                ..Service::default()
            };
            (k, s)
        })
        .collect();
    let peer = LbIndex::new(&peer_services, |idx| {
        let mut b = Backend {
            port: 8080,
            family: 4,
            ..Backend::default()
        };
        b.addr[..4].copy_from_slice(&BACKENDS[(idx % 10) as usize % 2]);
        Some(b)
    });
    for (key, entry) in entries.iter().filter(|(_, e)| e.flags & CT_F_LB != 0) {
        let (_, e2) = from_wire(&to_wire(key, entry, now, &index).unwrap(), now, &peer)
            .expect("the peer knows the service");
        assert!(
            (70..72).contains(&e2.nat.service),
            "the peer's service id, got {}",
            e2.nat.service
        );
        assert!(
            (500..512).contains(&e2.nat.backend),
            "the peer's backend index, got {}",
            e2.nat.backend
        );
        assert_eq!(
            (e2.nat.addr, e2.nat.port),
            (entry.nat.addr, entry.nat.port),
            "the binding itself is the same"
        );
    }

    // Refused: what a peer without the service gets, and malformed records.
    let (key, entry) = entries
        .iter()
        .find(|(_, e)| e.flags & CT_F_LB != 0)
        .expect("an LB entry");
    let good = to_wire(key, entry, now, &index).unwrap();
    assert!(matches!(
        from_wire(&good, now, &LbIndex::default()),
        Err(WireError::UnknownService(_))
    ));
    let mut bad = good.clone();
    bad.family = 5;
    assert_eq!(from_wire(&bad, now, &index), Err(WireError::Family(5)));
    let mut bad = good.clone();
    bad.lo.as_mut().unwrap().address.push(0);
    assert!(matches!(
        from_wire(&bad, now, &index),
        Err(WireError::Address { what: "lo", .. })
    ));
    let mut bad = good.clone();
    bad.hi.as_mut().unwrap().port = 70_000;
    assert!(matches!(
        from_wire(&bad, now, &index),
        Err(WireError::Port { what: "hi", .. })
    ));
    let mut bad = good.clone();
    bad.tcp_state = 99;
    assert_eq!(from_wire(&bad, now, &index), Err(WireError::State(99)));
    let mut bad = good;
    bad.lb_alias = true;
    assert_eq!(from_wire(&bad, now, &index), Err(WireError::Flags));
}

/// Failover at the map level: node A's connections, replicated through the wire into node B
/// (another datapath whose services were applied in another order, so other ids and backend
/// indexes), are forwarded by B exactly as A forwards them — the client's next packet goes to
/// the same backend (NAT) or from the same source port (full-NAT), the backend's reply comes
/// back from the VIP — without B ever having seen their SYN.
#[test]
fn a_peer_forwards_replicated_connections_as_the_origin_did() {
    require_root("sync_wire_fixtures");
    let mut a = Fixture::new().unwrap_or_else(|e| panic!("loading datapath A: {e}"));
    let mut b = Fixture::new().unwrap_or_else(|e| panic!("loading datapath B: {e}"));
    let seed_a = Seed::iface(1, IFACE_F_CT_XDP).with_services(&services());
    // B: the same services, the other way round.
    let reversed: String = {
        let s = services();
        let parts: Vec<&str> = s.split("[[service]]").filter(|p| !p.is_empty()).collect();
        parts
            .iter()
            .rev()
            .map(|p| format!("[[service]]{p}"))
            .collect()
    };
    let seed_b = Seed::iface(1, IFACE_F_CT_XDP).with_services(&reversed);
    // B's maps hold its services before anything is replicated (a standby is configured).
    let probe = Pkt::eth()
        .ipv4(CLIENT, [10, 250, 0, 77])
        .tcp(1, 80, tcp_flags::SYN)
        .build();
    b.run(&case(&seed_b, probe)).expect("seeding B");
    b.ct_clear().expect("clearing B");

    const IP4_SRC: usize = 14 + 12;
    const IP4_DST: usize = 14 + 16;
    const SPORT: usize = 14 + 20;
    const DPORT: usize = 14 + 22;
    let field = |frame: &[u8], at: usize, len: usize| frame[at..at + len].to_vec();
    for (vip, sport) in [(VIP_NAT, 41000u16), (VIP_FULL, 41001)] {
        let syn = Pkt::eth()
            .ipv4(CLIENT, vip)
            .tcp(sport, 80, tcp_flags::SYN)
            .build();
        let out = a.run(&case(&seed_a, syn)).expect("SYN through A");
        let (backend, src, src_port) = (
            field(&out.output, IP4_DST, 4),
            field(&out.output, IP4_SRC, 4),
            field(&out.output, SPORT, 2),
        );
        assert!(
            BACKENDS.iter().any(|b| b[..] == backend[..]),
            "A sent the SYN to a backend: {backend:?}"
        );

        // Replicate A's whole table to B, through protobuf bytes.
        let index_a = a.lb_index().expect("A's LB index");
        let index_b = b.lb_index().expect("B's LB index");
        let mut svc = SvcKey {
            port: 80,
            proto: 6,
            family: 4,
            ..SvcKey::default()
        };
        svc.vip[..4].copy_from_slice(&vip);
        assert_ne!(
            index_a.service_id(&svc),
            index_b.service_id(&svc),
            "the two nodes number the service differently"
        );
        let now = fastpath::conntrack::monotonic_ns();
        for (key, entry) in a.ct_entries().expect("A's table") {
            let bytes = to_wire(&key, &entry, now, &index_a)
                .expect("known to A")
                .encode_to_vec();
            let wire = pb::Connection::decode(bytes.as_slice()).expect("decoding");
            let (k, e) = from_wire(&wire, now, &index_b).expect("B knows the service");
            b.ct_insert(&k, &e).expect("installing on B");
        }

        // The backend answers through B (A is gone): translated back from the VIP.
        let backend4: [u8; 4] = backend.clone().try_into().unwrap();
        let (to, to_port) = if src[..] == CLIENT[..] {
            (CLIENT, sport)
        } else {
            // Full-NAT: the backend answers the source A gave the connection.
            (
                <[u8; 4]>::try_from(src.clone()).unwrap(),
                u16::from_be_bytes([src_port[0], src_port[1]]),
            )
        };
        let synack = Pkt::eth()
            .ipv4(backend4, to)
            .tcp(8080, to_port, tcp_flags::SYN | tcp_flags::ACK)
            .build();
        let back = b.run(&case(&seed_b, synack)).expect("SYN-ACK through B");
        assert_eq!(
            (
                field(&back.output, IP4_SRC, 4),
                field(&back.output, SPORT, 2),
                field(&back.output, IP4_DST, 4),
                field(&back.output, DPORT, 2)
            ),
            (
                vip.to_vec(),
                80u16.to_be_bytes().to_vec(),
                CLIENT.to_vec(),
                sport.to_be_bytes().to_vec()
            ),
            "B translates the backend's answer back to the VIP, to the client"
        );
        // The client's ACK through B: to the same backend, from the same source as via A.
        let ack = Pkt::eth()
            .ipv4(CLIENT, vip)
            .tcp(sport, 80, tcp_flags::ACK)
            .build();
        let fwd = b.run(&case(&seed_b, ack)).expect("ACK through B");
        assert_eq!(
            (
                field(&fwd.output, IP4_DST, 4),
                field(&fwd.output, IP4_SRC, 4),
                field(&fwd.output, SPORT, 2)
            ),
            (backend.clone(), src.clone(), src_port.clone()),
            "B sends the client's packet where A sent it, from the source A gave it"
        );
    }
}
