//! Test support shared by the integration tests, the demo and the benchmarks: a packet
//! builder, BPF_PROG_TEST_RUN fixtures through the real entry points, and network-namespace
//! topologies with guaranteed cleanup.

pub mod cases;
pub mod ct_cases;
pub mod fixture;
pub mod netns;
pub mod packet;
