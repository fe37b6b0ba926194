//! Runs the parser fixture table through the real entry points with BPF_PROG_TEST_RUN and
//! reports every failing case at once. Needs root; without it the test fails (never skips).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test code: a panic, with its message, is how a test fails"
)]

use fastpath::testkit::{cases::parser_cases, fixture::Fixture, require_root};

#[test]
fn parser_cases_through_bpf_prog_test_run() {
    require_root("datapath_fixtures");
    let cases = parser_cases();
    assert!(
        cases.len() >= 30,
        "the parser table shrank to {} cases; expected at least 30",
        cases.len()
    );

    let mut fixture =
        Fixture::new().unwrap_or_else(|e| panic!("loading the datapath fixture: {e}"));
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|case| fixture.evaluate(case).err())
        .map(|f| f.to_string())
        .collect();
    if !failures.is_empty() {
        panic!(
            "{} of {} parser cases failed:\n\n{}",
            failures.len(),
            cases.len(),
            failures.join("\n")
        );
    }
    eprintln!("{} parser cases passed", cases.len());
}
