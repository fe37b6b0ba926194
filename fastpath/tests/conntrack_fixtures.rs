//! Runs the conntrack sequences through the real entry points with BPF_PROG_TEST_RUN and
//! reports every failing sequence at once. Needs root; without it the test fails (never skips).

use fastpath::testkit::{ct_cases::ct_sequences, fixture::Fixture, require_root};

#[test]
fn conntrack_sequences_through_bpf_prog_test_run() {
    require_root("conntrack_fixtures");
    let sequences = ct_sequences();
    assert!(
        sequences.len() >= 30,
        "the conntrack table shrank to {} sequences; expected at least 30",
        sequences.len()
    );
    let steps: usize = sequences.iter().map(|s| s.steps.len()).sum();

    let mut fixture =
        Fixture::new().unwrap_or_else(|e| panic!("loading the datapath fixture: {e}"));
    let mut failures = Vec::new();
    for seq in &sequences {
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
