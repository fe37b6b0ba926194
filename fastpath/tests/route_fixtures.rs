//! The L3 stage and the 802.1Q ports through the real XDP and TC entry points with
//! BPF_PROG_TEST_RUN: the datapath asks the kernel's FIB for routes and next hops, so each
//! test runs in a network namespace of its own prepared by `ROUTE_NETNS_SETUP`, the frames
//! arriving on its `r0`. Needs root; without it the tests fail (never skip).

use fastpath::testkit::{
    enter_fresh_netns,
    fixture::Case,
    fixture::Fixture,
    require_root,
    route_cases::{ROUTE_NETNS_SETUP, RouteIfaces, route_cases},
    vlan_cases::vlan_cases,
};

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
