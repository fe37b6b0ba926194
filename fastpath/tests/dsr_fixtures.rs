//! Direct server return through the real XDP entry point with BPF_PROG_TEST_RUN. The
//! datapath asks the kernel's FIB for the backend's route and MAC address, so the test runs in
//! a network namespace of its own with the routes and neighbours the sequences expect
//! (`DSR_NETNS_SETUP`). Needs root; without it the test fails (never skips).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test code: a panic, with its message, is how a test fails"
)]

use fastpath::testkit::{
    ct_cases::{DSR_NETNS_SETUP, dsr_sequences},
    enter_fresh_netns,
    fixture::Fixture,
    require_root,
};

#[test]
fn dsr_sequences_through_bpf_prog_test_run() {
    require_root("dsr_fixtures");
    enter_fresh_netns(DSR_NETNS_SETUP);
    let sequences = dsr_sequences();
    let mut fixture =
        Fixture::new().unwrap_or_else(|e| panic!("loading the datapath fixture: {e}"));
    let mut failures = Vec::new();
    for seq in &sequences {
        if let Err(f) = fixture.run_ct_sequence(seq) {
            failures.push(f.to_string());
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} DSR sequences failed:\n\n{}",
        failures.len(),
        sequences.len(),
        failures.join("\n")
    );
    let steps: usize = sequences.iter().map(|s| s.steps.len()).sum();
    eprintln!("{} DSR sequences ({steps} steps) passed", sequences.len());
}
