//! Builds the eBPF object (fastpath-ebpf) with the pinned nightly and bpf-linker; the daemon
//! embeds it. `cargo xtask` installs both before any build.
use anyhow::{Context as _, anyhow};
use aya_build::{Package, Toolchain};

/// Must match `EBPF_TOOLCHAIN` in xtask.
const EBPF_TOOLCHAIN: &str = "nightly-2026-10-30";

fn main() -> anyhow::Result<()> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .ok_or_else(|| anyhow!("fastpath crate has no parent directory"))?
        .join("fastpath-ebpf");
    let root = root.to_str().context("non-UTF-8 path to fastpath-ebpf")?;
    println!("cargo::rerun-if-changed=../fastpath-common/src");
    aya_build::build_ebpf(
        [Package { name: "fastpath-ebpf", root_dir: root, no_default_features: false, features: &[] }],
        Toolchain::Custom(EBPF_TOOLCHAIN),
    )
    .context("building the eBPF datapath failed; run `cargo xtask bootstrap` to install the pinned nightly and bpf-linker")
}
