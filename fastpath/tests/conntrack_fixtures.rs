//! Runs the conntrack sequences through the real entry points with BPF_PROG_TEST_RUN and
//! reports every failing sequence at once. Needs root; without it the test fails (never skips).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test code: a panic, with its message, is how a test fails"
)]

use fastpath::{
    conntrack::monotonic_ns,
    ct_events::EventHub,
    ct_gc::{self, GcStats},
    datapath::CtTable,
    testkit::{
        ct_cases::{PRESSURE_CAPACITY, ct_sequences, hostile_sequences, pressure_sequences},
        fixture::{Case, CtSequence, Fixture, Seed},
        packet::Pkt,
        require_root,
    },
};
use fastpath_common::{
    ct::{
        CT_F_ASSURED, CT_F_LB, CT_F_LB_ALIAS, CT_F_SEEN_REPLY, CtEntry, DEFAULT_TIMEOUTS_S,
        IFACE_F_CT_XDP, tcp_state,
    },
    lb::lb_peer_key,
    map_names,
};

#[test]
fn conntrack_sequences_through_bpf_prog_test_run() {
    require_root("conntrack_fixtures");
    let sequences = ct_sequences();
    assert!(
        sequences.len() >= 30,
        "the conntrack table shrank to {} sequences; expected at least 30",
        sequences.len()
    );
    let fixture = Fixture::new().unwrap_or_else(|e| panic!("loading the datapath fixture: {e}"));
    run_all(fixture, &sequences);
}

/// Hostile frames: invalid TCP flag combinations against established
/// NAT / full-NAT / plain connections and new tuples, and martian-source SYNs to a VIP, at
/// XDP and at the TC ingress load-balancing tail. Each step checks the verdict, the frame
/// (untranslated), the whole table (unchanged), the `ct_stat` counters (unchanged) and the
/// reason counted; valid packets of the same flows around them are the positive control.
#[test]
fn hostile_frames_through_bpf_prog_test_run() {
    require_root("conntrack_fixtures");
    let sequences = hostile_sequences();
    assert!(
        sequences.len() >= 20,
        "the hostile-frame table shrank to {} sequences; expected at least 20",
        sequences.len()
    );
    let fixture = Fixture::new().unwrap_or_else(|e| panic!("loading the datapath fixture: {e}"));
    run_all(fixture, &sequences);
}

/// Table pressure on a small table: early drop of the oldest unassured entry, assured entries
/// kept, refusal when only assured ones are left.
#[test]
fn conntrack_pressure_through_bpf_prog_test_run() {
    require_root("conntrack_fixtures");
    let sequences = pressure_sequences();
    let fixture = Fixture::with_ct_capacity(PRESSURE_CAPACITY)
        .unwrap_or_else(|e| panic!("loading the datapath fixture: {e}"));
    run_all(fixture, &sequences);
}

/// Runs every sequence and reports every failing one at once.
fn run_all(mut fixture: Fixture, sequences: &[CtSequence]) {
    let steps: usize = sequences.iter().map(|s| s.steps.len()).sum();
    let mut failures = Vec::new();
    for seq in sequences {
        if let Err(failure) = fixture.run_ct_sequence(seq) {
            failures.push(failure.to_string());
        }
    }
    if !failures.is_empty() {
        panic!(
            "{} of {} conntrack sequences failed:\n\n{}",
            failures.len(),
            sequences.len(),
            failures.join("\n")
        );
    }
    eprintln!(
        "{} conntrack sequences ({steps} steps) passed",
        sequences.len()
    );
}

/// Least connections counts a connection until it ends: UDP flows (which never close) stop
/// counting when the daemon's expiry removes them, so the next flow goes to the backend they
/// left.
#[test]
fn least_connections_forgets_expired_connections() {
    require_root("conntrack_fixtures");
    let mut fx = Fixture::new().unwrap_or_else(|e| panic!("loading the datapath fixture: {e}"));
    let seed = Seed::iface(1, IFACE_F_CT_XDP).with_services(
        "[[service]]\nvip = \"10.9.0.100\"\nport = 53\nprotocol = \"udp\"\nscheduler = \"least_connections\"\n\
         [[service.backend]]\naddress = \"10.9.1.1\"\nport = 53\n\
         [[service.backend]]\naddress = \"10.9.1.2\"\nport = 53\n",
    );
    // Which backend a new flow from client port `port` gets (the translated destination).
    let flow = |fx: &mut Fixture, port: u16| -> u8 {
        let case = Case::xdp_to_kernel(
            "lc",
            &seed,
            Pkt::eth()
                .ipv4([10, 9, 2, 1], [10, 9, 0, 100])
                .udp(port, 53)
                .payload(b"q")
                .build(),
        );
        let out = fx.run(&case).unwrap_or_else(|e| panic!("{e}"));
        // Ethernet 14 + IPv4 destination at 16: the last byte names the backend.
        out.output[14 + 19]
    };
    let first: Vec<u8> = (1000..1003).map(|p| flow(&mut fx, p)).collect();
    assert_eq!(first, vec![1, 2, 1], "least connections, ties to the first");
    // Without expiry, backend 1 has 2 flows and backend 2 one: the next goes to 2.
    // After the flows expire (aged past the UDP timeout), both are empty: the next goes to 1.
    for key in fx.ct_entries().unwrap_or_else(|e| panic!("{e}")).keys() {
        fx.ct_age(key, 60_000_000_000)
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let mut table = CtTable::open_pin(&fx.pin_dir().join(map_names::CT)).expect("FP_CT pinned");
    ct_gc::pass(
        &mut table,
        &DEFAULT_TIMEOUTS_S,
        &EventHub::new(),
        &GcStats::default(),
        monotonic_ns(),
    );
    assert!(
        fx.ct_entries().unwrap_or_else(|e| panic!("{e}")).is_empty(),
        "all expired"
    );
    assert_eq!(flow(&mut fx, 1003), 1, "expired flows no longer count");
}

/// The expiry pass removes an alias whose connection is gone (here deleted behind its back, as
/// a flush or a kill would) and keeps every alias whose connection is there.
#[test]
fn expiry_removes_orphaned_aliases_and_keeps_the_others() {
    require_root("conntrack_fixtures");
    let mut fx = Fixture::new().unwrap_or_else(|e| panic!("loading the datapath fixture: {e}"));
    let seed = Seed::iface(1, IFACE_F_CT_XDP).with_services(
        "[[service]]\nvip = \"10.9.0.100\"\nport = 80\nprotocol = \"tcp\"\n\
         [[service.backend]]\naddress = \"10.9.1.1\"\nport = 80\n\
         [[service.backend]]\naddress = \"10.9.1.2\"\nport = 80\n",
    );
    for port in 1000..1004 {
        let case = Case::xdp_to_kernel(
            "syn",
            &seed,
            Pkt::eth()
                .ipv4([10, 9, 2, 1], [10, 9, 0, 100])
                .tcp(port, 80, fastpath::testkit::packet::tcp_flags::SYN)
                .build(),
        );
        fx.run(&case).unwrap_or_else(|e| panic!("{e}"));
    }
    let before = fx.ct_entries().unwrap_or_else(|e| panic!("{e}"));
    let conns: Vec<_> = before
        .iter()
        .filter(|(_, e)| e.flags & CT_F_LB != 0)
        .map(|(k, e)| {
            (
                *k,
                lb_peer_key(k, e).expect("an LB connection has an alias"),
            )
        })
        .collect();
    assert_eq!(conns.len(), 4, "four load-balanced connections: {before:?}");
    assert_eq!(before.len(), 8, "each with its alias: {before:?}");
    let (gone, gone_alias) = conns[1];
    let mut table = CtTable::open_pin(&fx.pin_dir().join(map_names::CT)).expect("FP_CT pinned");
    assert!(table.remove(&gone), "the connection's entry was there");
    let stats = GcStats::default();
    ct_gc::pass(
        &mut table,
        &DEFAULT_TIMEOUTS_S,
        &EventHub::new(),
        &stats,
        monotonic_ns(),
    );
    let after = fx.ct_entries().unwrap_or_else(|e| panic!("{e}"));
    assert!(
        !after.contains_key(&gone_alias),
        "the orphaned alias is removed"
    );
    for (conn, alias) in conns.iter().filter(|(c, _)| *c != gone) {
        assert!(after.contains_key(conn), "a live connection is kept");
        let a = after.get(alias).expect("a live connection's alias is kept");
        assert_ne!(a.flags & CT_F_LB_ALIAS, 0);
    }
    assert_eq!(after.len(), 6);
    assert_eq!(
        stats.occupancy.load(std::sync::atomic::Ordering::Relaxed),
        6,
        "occupancy counts what is left"
    );
}

/// A connection that expires takes its alias with it only while the tuple is still its alias:
/// once it ended, the client may have dialled the backend directly from the same port, and the
/// alias gave way to that connection's own entry — which the expiry keeps.
#[test]
fn expiry_keeps_a_connection_that_took_an_expired_connections_alias_tuple() {
    require_root("conntrack_fixtures");
    let mut fx = Fixture::new().unwrap_or_else(|e| panic!("loading the datapath fixture: {e}"));
    let seed = Seed::iface(1, IFACE_F_CT_XDP).with_services(
        "[[service]]\nvip = \"10.9.0.100\"\nport = 80\nprotocol = \"tcp\"\n\
         [[service.backend]]\naddress = \"10.9.1.1\"\nport = 80\n",
    );
    let syn = Case::xdp_to_kernel(
        "syn",
        &seed,
        Pkt::eth()
            .ipv4([10, 9, 2, 1], [10, 9, 0, 100])
            .tcp(1000, 80, fastpath::testkit::packet::tcp_flags::SYN)
            .build(),
    );
    fx.run(&syn).unwrap_or_else(|e| panic!("{e}"));
    let before = fx.ct_entries().unwrap_or_else(|e| panic!("{e}"));
    let (conn, entry) = before
        .iter()
        .find(|(_, e)| e.flags & CT_F_LB != 0)
        .map(|(k, e)| (*k, *e))
        .expect("the load-balanced connection");
    let alias = lb_peer_key(&conn, &entry).expect("its alias");
    let mut table = CtTable::open_pin(&fx.pin_dir().join(map_names::CT)).expect("FP_CT pinned");
    // Its alias tuple now holds a direct connection's entry; the expiry runs 200 s later,
    // when the balanced connection (SYN_SENT: 120 s) is idle past its timeout and the direct
    // one (established) is not.
    let now = monotonic_ns();
    assert!(table.remove(&alias), "the alias was there");
    let direct = CtEntry {
        created_ns: now,
        last_seen_ns: now,
        state: tcp_state::ESTABLISHED,
        flags: CT_F_SEEN_REPLY | CT_F_ASSURED,
        ..CtEntry::default()
    };
    table
        .insert(&alias, &direct)
        .expect("the direct connection");
    ct_gc::pass(
        &mut table,
        &DEFAULT_TIMEOUTS_S,
        &EventHub::new(),
        &GcStats::default(),
        now + 200_000_000_000,
    );
    let after = fx.ct_entries().unwrap_or_else(|e| panic!("{e}"));
    assert!(!after.contains_key(&conn), "the idle connection expired");
    let kept = after
        .get(&alias)
        .expect("the direct connection on the alias tuple is kept");
    assert_eq!(
        (kept.flags, kept.state),
        (direct.flags, direct.state),
        "and untouched"
    );
}
