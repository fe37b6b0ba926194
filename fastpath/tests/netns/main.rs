//! End-to-end tests: the real `fastpath` binary and real clients and servers (curl, nginx,
//! socat, iperf3, HAProxy, keepalived, the kernel's conntrack tool) in network namespaces made
//! per test. One binary, one module per feature; run with `--test-threads=1`, since tests share
//! kernel state (bpffs, interface names). Root only: without it every test fails, none skips.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test code: a panic, with its message, is how a test fails"
)]

use std::path::Path;

mod announce;
mod api_bad_input;
mod api_cli;
mod api_reload;
mod api_tls;
mod cluster;
mod conntrack;
mod dsr;
mod gateway;
mod grpc_tools;
mod ha_bad_peer;
mod ha_failover;
mod ha_sync;
mod lb;
mod metrics_http;
mod route;
mod smoke;
mod traffic;
mod vlan;
mod vxlan;

/// The `fastpath` binary under test (built by cargo for this test target).
fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_fastpath"))
}
