//! The L3 stage and the 802.1Q ports through the real XDP and TC entry points with
//! BPF_PROG_TEST_RUN: the datapath asks the kernel's FIB for routes and next hops, so each
//! test runs in a network namespace of its own prepared by `ROUTE_NETNS_SETUP`, the frames
//! arriving on its `r0`. Needs root; without it the tests fail (never skip).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test code: a panic, with its message, is how a test fails"
)]

use fastpath::testkit::{
    enter_fresh_netns,
    fixture::{Case, Fixture, mismatches},
    require_root,
    route_cases::{ROUTE_NETNS_SETUP, RouteIfaces, route_cases},
    vlan_cases::vlan_cases,
};
use fastpath_common::route::{ROUTE_CACHE_TTL_NS, route_stat};

/// The index of `name` in this thread's network namespace (sysfs shows the mounter's).
fn ifindex(name: &str) -> u32 {
    fastpath::config::ifindex(name).unwrap_or_else(|| panic!("no interface {name}"))
}

/// Runs `cases(interfaces)` in a fresh namespace prepared by `ROUTE_NETNS_SETUP`.
fn run_in_route_netns(what: &str, cases: fn(RouteIfaces) -> Vec<Case>) {
    require_root("route_fixtures");
    enter_fresh_netns(ROUTE_NETNS_SETUP);
    let ifx = RouteIfaces {
        r0: ifindex("r0"),
        r1: ifindex("r1"),
        r2: ifindex("r2"),
    };
    let cases = cases(ifx);
    let mut fixture =
        Fixture::new().unwrap_or_else(|e| panic!("loading the datapath fixture: {e}"));
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|c| fixture.evaluate(c).err().map(|f| f.to_string()))
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} {what} cases failed:\n\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    eprintln!("{} {what} cases passed", cases.len());
}

#[test]
fn routing_cases_through_bpf_prog_test_run() {
    run_in_route_netns("routing", route_cases);
}

#[test]
fn vlan_cases_through_bpf_prog_test_run() {
    run_in_route_netns("VLAN", vlan_cases);
}

/// Runs `case` without its seed (the maps as the runs before left them) and checks it; the
/// route cache counters' change (`route_stat::*`: hit, miss, stale) is returned.
fn rerun_checked(fixture: &mut Fixture, case: &Case) -> Vec<u64> {
    let before = fixture.route_stats().expect("route cache counters");
    let outcome = fixture
        .rerun(case)
        .unwrap_or_else(|e| panic!("{}: {e}", case.name));
    let details = mismatches(case, &outcome);
    assert!(details.is_empty(), "{}:\n{details}", case.name);
    let after = fixture.route_stats().expect("route cache counters");
    after.iter().zip(&before).map(|(a, b)| a - b).collect()
}

/// Runs a command of the test's namespace, which must succeed.
fn sh(args: &[&str]) {
    let status = std::process::Command::new(args[0])
        .args(&args[1..])
        .status()
        .unwrap_or_else(|e| panic!("{args:?}: {e}"));
    assert!(status.success(), "{args:?}: {status}");
}

/// The route cache: a flow's first packet asks the FIB and the next ones take its answer
/// from the cache (the same frame out); a packet longer than the cache knows to fit asks
/// the FIB again (one over the MTU still goes to the kernel); after a route change, a new
/// generation (the daemon's netwatch starts one on every route, neighbour or link change)
/// sends the flow's next packet by the new route, and without one the cached answer ends
/// after its second.
#[test]
fn route_cache_hits_until_a_new_generation_or_a_second() {
    require_root("route_fixtures");
    enter_fresh_netns(ROUTE_NETNS_SETUP);
    let ifx = RouteIfaces {
        r0: ifindex("r0"),
        r1: ifindex("r1"),
        r2: ifindex("r2"),
    };
    let cases = route_cases(ifx);
    let case = |name: &str| {
        cases
            .iter()
            .find(|c| c.name.ends_with(name))
            .cloned()
            .unwrap_or_else(|| panic!("no routing case {name}"))
    };
    let mut fixture =
        Fixture::new().unwrap_or_else(|e| panic!("loading the datapath fixture: {e}"));
    let [hit, miss, stale] = [route_stat::HIT, route_stat::MISS, route_stat::STALE];
    let only = |slot: u32, n: u64| {
        let mut v = vec![0u64; route_stat::COUNT as usize];
        v[slot as usize] = n;
        v
    };

    // A packet of the MTU's length: the FIB's answer, then the cache's, twice.
    let at_mtu = case("route_v4_at_the_mtu");
    fixture.check(&at_mtu);
    assert_eq!(rerun_checked(&mut fixture, &at_mtu), only(hit, 1));
    assert_eq!(rerun_checked(&mut fixture, &at_mtu), only(hit, 1));
    // The same flow one byte over the MTU: not known to fit, the FIB refuses it.
    let over = case("over_the_mtu_v4");
    assert_eq!(rerun_checked(&mut fixture, &over), only(miss, 1));
    assert_eq!(rerun_checked(&mut fixture, &at_mtu), only(hit, 1));

    // A flow via a gateway; the route then moves to another next hop on the same link.
    let via = case("route_v4_via_a_gateway");
    fixture.check(&via);
    assert_eq!(rerun_checked(&mut fixture, &via), only(hit, 1));
    sh(&[
        "ip",
        "neigh",
        "add",
        "10.2.0.5",
        "lladdr",
        "02:00:00:00:02:05",
        "dev",
        "r1",
        "nud",
        "permanent",
    ]);
    sh(&["ip", "route", "replace", "10.9.0.0/24", "via", "10.2.0.5"]);
    let mut moved = via.clone();
    let out = moved.expect_output.as_mut().expect("a routed case's frame");
    out[..6].copy_from_slice(&[0x02, 0, 0, 0, 2, 5]);
    // Within the generation and the second, the cached answer still holds.
    assert_eq!(rerun_checked(&mut fixture, &via), only(hit, 1));
    fixture.bump_generation().expect("a new generation");
    assert_eq!(rerun_checked(&mut fixture, &moved), only(stale, 1));
    assert_eq!(rerun_checked(&mut fixture, &moved), only(hit, 1));

    // Back to the first next hop, with no new generation: the answer ends after its second.
    sh(&["ip", "route", "replace", "10.9.0.0/24", "via", "10.2.0.1"]);
    assert_eq!(rerun_checked(&mut fixture, &moved), only(hit, 1));
    std::thread::sleep(std::time::Duration::from_nanos(
        ROUTE_CACHE_TTL_NS + 100_000_000,
    ));
    assert_eq!(rerun_checked(&mut fixture, &via), only(stale, 1));
    assert_eq!(rerun_checked(&mut fixture, &via), only(hit, 1));

    // IPv6 alike, and at TC.
    for name in ["route_v6_via_a_gateway", "route_v4_at_tc", "route_v6_at_tc"] {
        let c = case(name);
        fixture.check(&c);
        assert_eq!(rerun_checked(&mut fixture, &c), only(hit, 1), "{name}");
    }
}
