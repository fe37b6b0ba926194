//! fastpath userspace: the daemon and the CLI's library; with the `testkit` feature (tests,
//! the demo and the bench turn it on), their test support too.

pub mod announce;
pub mod api;
pub mod config;
pub mod conntrack;
pub mod ct_events;
pub mod ct_gc;
pub mod daemon;
pub mod datapath;
pub mod fibshape;
pub mod ha;
pub mod health;
pub mod ifaces;
pub mod lb;
pub mod maglev;
pub mod metrics;
pub mod netwatch;
pub mod rules;
pub mod stats;
pub mod sync;
pub mod sys;
/// Test support (packet builder, fixtures, namespace topologies): never in the product
/// binary (`cargo xtask build`).
#[cfg(any(test, feature = "testkit"))]
pub mod testkit;

/// The compiled datapath object, built by build.rs from fastpath-ebpf.
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/fastpath"));
/// The datapath object with the benchmark's programs and maps too (fastpath-ebpf's `bench`
/// feature): what the fixtures and the bench load. Never in the product binary.
#[cfg(any(test, feature = "testkit"))]
pub static EBPF_BENCH_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/fastpath-bench"));
