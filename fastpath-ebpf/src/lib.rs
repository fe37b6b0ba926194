//! Library target so the daemon can name this crate as a build dependency (rebuild tracking);
//! the programs themselves are in the `fastpath` binary target (main.rs).
#![no_std]
