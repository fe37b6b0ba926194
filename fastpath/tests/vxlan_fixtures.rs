//! VXLAN in the fast path against the kernel's own vxlan devices: the test builds the
//! overlay topology of `testkit::vxlan_cases`, captures what the kernel puts on the links,
//! checks that against the frames kept in `tests/fixtures/vxlan/` (`FP_UPDATE_FIXTURES=1`
//! writes them anew), and replays the kept frames through the real entry points with
//! BPF_PROG_TEST_RUN in the node's namespace (its FIB and neighbours): decapsulation must
//! give the kernel's routed frame byte for byte; encapsulation, after the TC egress program
//! learned the headers from the kernel's frame, must give the kernel's frame but for the
//! per-packet fields (outer IPv4 identification and checksum, UDP source port). Misses,
//! invalidation by generation, TCP FIN/RST and frames the fast path must leave alone go to the
//! kernel unchanged, each with its reason. A second test replays the same frames at TC
//! ingress, where the fast path works with XDP off; a third does both over an IPv6 underlay
//! (`tests/fixtures/vxlan6/`: its outer frames vary per packet in the UDP source port only;
//! at TC its IPv4-in-IPv6 decapsulation is the kernel's). Invalidation and TCP FIN/RST, which
//! do not depend on the underlay's IP version, are checked over IPv4 only.
//! Needs root; without it the test fails (never skips).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test code: a panic, with its message, is how a test fails"
)]

use fastpath::testkit::{
    fixture::{Case, CounterDelta, Fixture, Seed, raw_verdict},
    require_root,
    vxlan_cases::{Captures, N0_MAC, Overlay, REMOTE, Underlay, node_seed, outer_masked, to_hex},
};
use fastpath_common::{Hook, Verdict, reason};

fn ifindex(name: &str) -> u32 {
    fastpath::config::ifindex(name).unwrap_or_else(|| panic!("no interface {name}"))
}

/// The IPv4 header checksum of the header at `at` (its checksum field included: a valid
/// header sums to zero).
fn ipv4_sum(f: &[u8], at: usize) -> u16 {
    let mut sum: u32 = f[at..at + 20]
        .chunks(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// `f` with the IPv4 header at `at` given a fresh checksum.
fn fix_ipv4_check(mut f: Vec<u8>, at: usize) -> Vec<u8> {
    f[at + 10] = 0;
    f[at + 11] = 0;
    let c = ipv4_sum(&f, at);
    f[at + 10..at + 12].copy_from_slice(&c.to_be_bytes());
    f
}

/// A case whose frame the kernel gets unchanged, with `why`.
fn to_kernel(name: &str, hook: Hook, seed: &Seed, input: Vec<u8>, on: u32, why: u32) -> Case {
    let bytes = input.len() as u64;
    Case {
        name: name.into(),
        hook,
        seed: seed.clone(),
        expect_verdict: raw_verdict(hook, Verdict::Kernel),
        expect_output: None,
        expect_counters: vec![CounterDelta::new(hook, Verdict::Kernel, why, 1, bytes)],
        input,
        arrives_on: Some(on),
    }
}

#[test]
fn vxlan_encap_and_decap_match_the_kernels_own_packets() {
    require_root("vxlan_fixtures");
    let (overlay, kept) = captures(Underlay::V4);
    let n0 = ifindex("n0");
    let seed = node_seed(Hook::Xdp, &overlay);
    let mut fx = Fixture::new().unwrap_or_else(|e| panic!("loading the datapath fixture: {e}"));
    let (learn, encap) = encap_and_decap(&mut fx, &seed, &kept, Hook::Xdp);
    let check = |fx: &mut Fixture, c: &Case| {
        if let Err(f) = fx.evaluate(c) {
            panic!("{f}");
        }
    };

    // A new generation (a configuration, route or neighbour change): stale until the
    // kernel's path teaches the headers again.
    let mut next = seed.clone();
    next.vxlan_generation = Some(1);
    // Stale under `seed`'s generation, then taught again by the kernel's frame.
    let stale_then_relearned = |fx: &mut Fixture, name: &str, seed: &Seed| {
        check(
            fx,
            &to_kernel(
                name,
                Hook::Xdp,
                seed,
                kept.encap_in.clone(),
                n0,
                reason::VXLAN_STALE,
            ),
        );
        check(
            fx,
            &Case {
                seed: seed.clone(),
                ..learn.clone()
            },
        );
        let out = fx
            .run(&Case {
                seed: seed.clone(),
                ..encap.clone()
            })
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            out.verdict,
            raw_verdict(Hook::Xdp, Verdict::Forward),
            "{name}: relearned"
        );
    };
    stale_then_relearned(&mut fx, "encap_stale", &next);
    // A neighbour change on the underlay ends the generation too (the daemon's watcher of
    // route, neighbour and link changes).
    let rt = tokio::runtime::Runtime::new().expect("a runtime");
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let bumps = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let gen_pin = fx.pin_dir().join(fastpath_common::map_names::VXLAN_GEN);
    let open = || fastpath::datapath::VxlanGeneration::open_pin(&gen_pin).expect("FP_VXLAN_GEN");
    let peers = fastpath::datapath::PeerLinks::open_pin(
        &fx.pin_dir().join(fastpath_common::map_names::PEER),
    )
    .expect("FP_PEER");
    let watcher = {
        let (bumps, watched) = (bumps.clone(), open());
        rt.spawn(async move { fastpath::netwatch::watch(watched, peers, bumps, stop_rx).await })
    };
    let generation = open();
    let before = generation.current();
    // Let the watcher subscribe before the change.
    std::thread::sleep(std::time::Duration::from_millis(200));
    fastpath::testkit::run_commands(&[&[
        "ip",
        "neigh",
        "replace",
        "192.168.50.2",
        "lladdr",
        "02:00:00:00:0c:09",
        "dev",
        "und0",
        "nud",
        "permanent",
    ]]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
    while generation.current() == before && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(
        generation.current() > before,
        "the neighbour change started a generation"
    );
    let mut watched = next.clone();
    watched.vxlan_generation = None;
    stale_then_relearned(&mut fx, "encap_stale_after_neighbour_change", &watched);
    let _ = stop_tx.send(true);
    rt.block_on(watcher)
        .expect("the watcher task")
        .expect("the watcher");
    assert!(bumps.load(std::sync::atomic::Ordering::Relaxed) >= 1);
    // TCP FIN and RST take the kernel's path.
    let fin = fastpath::testkit::packet::Pkt::eth()
        .macs(N0_MAC, fastpath::testkit::vxlan_cases::P0_MAC)
        .ipv4(fastpath::testkit::vxlan_cases::POD, REMOTE)
        .tcp(7, 40000, 0x11)
        .build();
    check(
        &mut fx,
        &to_kernel(
            "encap_fin",
            Hook::Xdp,
            &next,
            fin,
            n0,
            reason::VXLAN_TCP_CLOSE,
        ),
    );
    eprintln!(
        "VXLAN fixtures: decapsulation byte-exact, encapsulation byte-exact but for the outer identification, checksum and source port ({} and {} bytes)",
        kept.decap_out.len(),
        kept.encap_out.len()
    );
}

/// The overlay (the thread is then in its node namespace) and the kept frames, checked
/// against a fresh capture of the kernel's (see the module's documentation).
fn captures(underlay: Underlay) -> (Overlay, Captures) {
    let overlay = Overlay::build(underlay);
    let fresh = overlay.capture();
    if std::env::var("FP_UPDATE_FIXTURES").is_ok_and(|v| v == "1") {
        fresh.save(underlay).expect("writing the fixture files");
    }
    let kept = Captures::load(underlay).unwrap_or_else(|e| {
        panic!("reading the fixture files ({e}); FP_UPDATE_FIXTURES=1 writes them from a capture")
    });
    // The kernel still makes the frames kept (but for its per-packet fields).
    assert_eq!(
        fresh.decap_out,
        kept.decap_out,
        "decap_out:\n{}",
        to_hex(&fresh.decap_out)
    );
    assert_eq!(
        fresh.encap_in,
        kept.encap_in,
        "encap_in:\n{}",
        to_hex(&fresh.encap_in)
    );
    assert_eq!(
        outer_masked(&fresh.decap_in),
        outer_masked(&kept.decap_in),
        "decap_in:\n{}",
        to_hex(&fresh.decap_in)
    );
    assert_eq!(
        outer_masked(&fresh.encap_out),
        outer_masked(&kept.encap_out),
        "encap_out:\n{}",
        to_hex(&fresh.encap_out)
    );
    (overlay, kept)
}

/// At `hook`, on a fixture with nothing learned: decapsulation gives the kernel's routed
/// frame byte for byte; what it leaves to the kernel comes out as it went in; encapsulation
/// misses until the kernel's frame leaving the underlay teaches the headers, and then gives
/// the kernel's frame but for the outer source port and, over IPv4, identification and
/// checksum (the identification going on from the kernel's). Returns the learning case and
/// the encapsulation case.
fn encap_and_decap(fx: &mut Fixture, seed: &Seed, kept: &Captures, hook: Hook) -> (Case, Case) {
    let und0 = ifindex("und0");
    let outer = underlay_of(kept);
    let (underlay, outer_udp) = outer;
    let o = underlay.outer();
    let check = |fx: &mut Fixture, c: &Case| checked(fx, c, hook);
    // Frames decapsulation leaves to the kernel come out as they went in: another VNI, an
    // inner TTL that expires (the kernel sends the ICMP error).
    let mut other_vni = kept.decap_in.clone();
    // The VNI's last byte (the VXLAN header follows the outer UDP one).
    other_vni[o.udp + 8 + 6] ^= 1;
    check(
        fx,
        &to_kernel("decap_other_vni", hook, seed, other_vni, und0, outer_udp),
    );
    // At TC, the fast path decapsulates only an inner packet of the outer one's IP version
    // (the skb's protocol stays); this inner IPv4 over an IPv6 underlay is the kernel's.
    if hook != Hook::Xdp && underlay == Underlay::V6 {
        check(
            fx,
            &to_kernel(
                "decap_other_ip_version",
                hook,
                seed,
                kept.decap_in.clone(),
                und0,
                reason::VXLAN_MISS,
            ),
        );
        return encap(fx, seed, kept, hook, outer);
    }
    let decap_bytes = kept.decap_in.len() as u64;
    check(
        fx,
        &Case {
            name: "decap".into(),
            hook,
            seed: seed.clone(),
            expect_verdict: raw_verdict(hook, Verdict::Forward),
            expect_output: Some(kept.decap_out.clone()),
            expect_counters: vec![CounterDelta::new(
                hook,
                Verdict::Forward,
                reason::VXLAN_DECAP,
                1,
                decap_bytes,
            )],
            input: kept.decap_in.clone(),
            arrives_on: Some(und0),
        },
    );
    let mut ttl1 = kept.decap_in.clone();
    ttl1[o.inner + 14 + 8] = 1;
    let ttl1 = fix_ipv4_check(ttl1, o.inner + 14);
    check(
        fx,
        &to_kernel(
            "decap_inner_ttl_1",
            hook,
            seed,
            ttl1,
            und0,
            reason::ROUTE_TTL_EXPIRED,
        ),
    );
    encap(fx, seed, kept, hook, outer)
}

/// The kept frames' underlay, and the reason the kernel's path counts an outer datagram of
/// it under.
fn underlay_of(kept: &Captures) -> (Underlay, u32) {
    match Underlay::of(&kept.decap_in) {
        Some(Underlay::V4) => (Underlay::V4, reason::NO_STAGE_IPV4_UDP),
        Some(Underlay::V6) => (Underlay::V6, reason::NO_STAGE_IPV6_UDP),
        None => panic!("the kept frames are not Ethernet/IP"),
    }
}

/// Evaluates `c`; panics with what differs.
fn checked(fx: &mut Fixture, c: &Case, hook: Hook) {
    if let Err(f) = fx.evaluate(c) {
        panic!("{hook:?}: {f}");
    }
}

/// Encapsulation at `hook`: see [`encap_and_decap`].
/// `outer`: the frames' underlay and reason, from [`underlay_of`].
fn encap(
    fx: &mut Fixture,
    seed: &Seed,
    kept: &Captures,
    hook: Hook,
    outer: (Underlay, u32),
) -> (Case, Case) {
    let (n0, und0) = (ifindex("n0"), ifindex("und0"));
    let (underlay, outer_udp) = outer;
    let o = underlay.outer();
    let check = |fx: &mut Fixture, c: &Case| checked(fx, c, hook);
    // Encapsulation: a miss before anything is learned.
    check(
        fx,
        &to_kernel(
            "encap_miss",
            hook,
            seed,
            kept.encap_in.clone(),
            n0,
            reason::VXLAN_MISS,
        ),
    );
    // The kernel's frame leaving the underlay teaches the headers (the frame goes on).
    let learn = to_kernel(
        "learn",
        Hook::TcEgress,
        seed,
        kept.encap_out.clone(),
        und0,
        outer_udp,
    );
    check(fx, &learn);
    let encap = Case {
        name: "encap".into(),
        hook,
        seed: seed.clone(),
        expect_verdict: raw_verdict(hook, Verdict::Forward),
        expect_output: None,
        expect_counters: Vec::new(),
        input: kept.encap_in.clone(),
        arrives_on: Some(n0),
    };
    let out = fx.run(&encap).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        out.verdict,
        raw_verdict(hook, Verdict::Forward),
        "{hook:?}: encap verdict"
    );
    assert_eq!(
        outer_masked(&out.output),
        outer_masked(&kept.encap_out),
        "{hook:?}: encapsulated frame (masked) differs from the kernel's:\nours:\n{}\nkernel's:\n{}",
        to_hex(&out.output),
        to_hex(&kept.encap_out)
    );
    let id = |f: &[u8]| u16::from_be_bytes([f[18], f[19]]);
    if underlay == Underlay::V4 {
        assert_eq!(
            ipv4_sum(&out.output, 14),
            0,
            "{hook:?}: outer IPv4 checksum"
        );
        assert_eq!(
            id(&out.output),
            id(&kept.encap_out).wrapping_add(1),
            "{hook:?}: the identification goes on from the kernel's"
        );
    }
    let sport_of = |f: &[u8]| [f[o.udp], f[o.udp + 1]];
    let sport = u16::from_be_bytes(sport_of(&out.output));
    assert!((32768..60999).contains(&sport), "source port {sport}");
    assert_eq!(
        out.counters
            .get(hook, Verdict::Forward, reason::VXLAN_ENCAP)
            .packets,
        1,
        "{hook:?}: counted as an encapsulation: {:?}",
        out.counters
    );
    // The same flow keeps its source port.
    let again = fx.run(&encap).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(sport_of(&again.output), sport_of(&out.output));
    // The kernel's next frame teaches nothing new in this generation: over IPv4 the
    // identification goes on from the fast path's; over IPv6 the frame stays the same.
    check(fx, &learn);
    let third = fx.run(&encap).unwrap_or_else(|e| panic!("{e}"));
    match underlay {
        Underlay::V4 => assert_eq!(
            id(&third.output),
            id(&kept.encap_out).wrapping_add(3),
            "{hook:?}: relearned within a generation"
        ),
        // Nothing varies per packet in one flow's IPv6 outer headers.
        Underlay::V6 => assert_eq!(
            third.output, again.output,
            "{hook:?}: relearned within a generation"
        ),
    }
    (learn, encap)
}

/// The same at TC ingress (XDP off): the pod link routes and encapsulates there, the
/// underlay decapsulates there.
#[test]
fn vxlan_at_tc_ingress_matches_the_kernels_own_packets() {
    require_root("vxlan_fixtures");
    let (overlay, kept) = captures(Underlay::V4);
    let mut fx = Fixture::new().unwrap_or_else(|e| panic!("loading the datapath fixture: {e}"));
    encap_and_decap(
        &mut fx,
        &node_seed(Hook::TcIngress, &overlay),
        &kept,
        Hook::TcIngress,
    );
}

/// Over an IPv6 underlay, at XDP and at TC ingress: the kernel's vxlan device's frames
/// (zero UDP checksums, as the fast path sends) against the fast path's.
#[test]
fn vxlan_over_an_ipv6_underlay_matches_the_kernels_own_packets() {
    require_root("vxlan_fixtures");
    let (overlay, kept) = captures(Underlay::V6);
    for hook in [Hook::Xdp, Hook::TcIngress] {
        let mut fx = Fixture::new().unwrap_or_else(|e| panic!("loading the datapath fixture: {e}"));
        encap_and_decap(&mut fx, &node_seed(hook, &overlay), &kept, hook);
    }
    eprintln!(
        "VXLAN fixtures over IPv6: decapsulation byte-exact at XDP (at TC the kernel's), encapsulation byte-exact but for the outer source port at both ({} and {} bytes)",
        kept.decap_out.len(),
        kept.encap_out.len()
    );
}
