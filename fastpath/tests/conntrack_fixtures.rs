//! Runs the conntrack sequences through the real entry points with BPF_PROG_TEST_RUN and
//! reports every failing sequence at once. Needs root; without it the test fails (never skips).

use fastpath::testkit::{
    ct_cases::{PRESSURE_CAPACITY, ct_sequences, pressure_sequences},
    fixture::{CtSequence, Fixture},
    require_root,
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
