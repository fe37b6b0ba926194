//! Builds the eBPF object (fastpath-ebpf) with the pinned nightly and bpf-linker; the daemon
//! embeds it. `cargo xtask` installs both before any build.
use anyhow::{Context as _, anyhow};
use aya_build::{Package, Toolchain};

/// The eBPF toolchain, one source shared with xtask.
const EBPF_TOOLCHAIN: &str = include_str!("../ebpf-toolchain.txt").trim_ascii();

fn main() -> anyhow::Result<()> {
    // The management API: protos compiled in-process (protox), no protoc needed.
    println!("cargo::rerun-if-changed=proto");
    let fds = protox::compile(
        ["fastpath/v1/fastpath.proto", "fastpath/sync/v1/sync.proto"],
        ["proto"],
    )
    .map_err(|e| anyhow!("compiling the protos under fastpath/proto: {e}"))?;
    tonic_prost_build::configure()
        .compile_fds(fds)
        .context("generating the gRPC code for fastpath.v1 and fastpath.sync.v1")?;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .ok_or_else(|| anyhow!("fastpath crate has no parent directory"))?
        .join("fastpath-ebpf");
    let root = root.to_str().context("non-UTF-8 path to fastpath-ebpf")?;
    println!("cargo::rerun-if-changed=../fastpath-common/src");
    // bpf-linker lives in the project's .tools/bin (installed by `cargo xtask bootstrap`): put
    // it on PATH so plain `cargo +1.99.1 build` and IDEs find it too.
    let workspace = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .ok_or_else(|| anyhow!("fastpath crate has no parent directory"))?;
    let mut paths = vec![workspace.join(".tools/bin")];
    paths.extend(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    ));
    let path = std::env::join_paths(paths).context("joining PATH")?;
    // SAFETY: build scripts are single-threaded; nothing reads the environment concurrently.
    unsafe { std::env::set_var("PATH", path) };
    let out_dir = std::path::PathBuf::from(
        std::env::var_os("OUT_DIR").context("cargo sets OUT_DIR for build scripts")?,
    );
    let build = |features: &[&str]| {
        aya_build::build_ebpf(
            [Package { name: "fastpath-ebpf", root_dir: root, no_default_features: false, features }],
            Toolchain::Custom(EBPF_TOOLCHAIN),
        )
        .context("building the eBPF datapath failed; run `cargo xtask bootstrap` to install the pinned nightly and bpf-linker")
    };
    // With `testkit` (tests, the demo, the bench) a second object carries the benchmark's
    // programs and maps as well: built first and renamed, since aya-build writes every build
    // of the crate to OUT_DIR/fastpath. The daemon's object, built last, never carries them.
    println!("cargo::rerun-if-env-changed=CARGO_FEATURE_TESTKIT");
    if std::env::var_os("CARGO_FEATURE_TESTKIT").is_some() {
        build(&["bench"])?;
        let (from, to) = (out_dir.join("fastpath"), out_dir.join("fastpath-bench"));
        std::fs::rename(&from, &to)
            .with_context(|| format!("renaming {} to {}", from.display(), to.display()))?;
    }
    build(&[])
}
