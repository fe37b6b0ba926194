//! Builds the eBPF object (fastpath-ebpf) with the pinned nightly and bpf-linker; the daemon
//! embeds it. `cargo xtask` installs both before any build.
use anyhow::{Context as _, anyhow};
use aya_build::{Package, Toolchain};

/// The eBPF toolchain's pin, one source shared with xtask.
const EBPF_TOOLCHAIN_FILE: &str = include_str!("../fastpath-ebpf/rust-toolchain.toml");

/// The `channel = "..."` of a rust-toolchain.toml.
fn channel(toolchain_file: &str) -> Option<&str> {
    toolchain_file
        .lines()
        .filter_map(|l| l.split_once('='))
        .find(|(k, _)| k.trim() == "channel")
        .and_then(|(_, v)| v.trim().strip_prefix('"')?.strip_suffix('"'))
}

fn main() -> anyhow::Result<()> {
    // The management API: protos compiled in-process (protox), no protoc needed.
    println!("cargo::rerun-if-changed=proto");
    let fds = protox::compile(
        ["fastpath/v1/fastpath.proto", "fastpath/sync/v1/sync.proto"],
        ["proto"],
    )
    .map_err(|e| anyhow!("compiling the protos under fastpath/proto: {e}"))?;
    tonic_prost_build::configure()
        // A replicated change's addresses as `Bytes`: decoding slices the received buffer
        // (a reference count) instead of allocating and copying a Vec per address.
        .bytes(".fastpath.sync.v1")
        .compile_fds(fds)
        .context("generating the gRPC code for fastpath.v1 and fastpath.sync.v1")?;
    // What server reflection serves on the API's listeners: fastpath.v1 with its imports
    // (fastpath.sync.v1 is served to HA peers only).
    let reflected = protox::Compiler::new(["proto"])
        .and_then(|mut c| {
            c.include_imports(true)
                .open_files(["fastpath/v1/fastpath.proto"])?;
            Ok(c.encode_file_descriptor_set())
        })
        .map_err(|e| anyhow!("compiling fastpath/v1/fastpath.proto for reflection: {e}"))?;
    let out_dir = std::env::var_os("OUT_DIR").context("cargo sets OUT_DIR for build scripts")?;
    let descriptor = std::path::Path::new(&out_dir).join("fastpath_v1.bin");
    std::fs::write(&descriptor, reflected)
        .with_context(|| format!("writing {}", descriptor.display()))?;
    // The example configs' names, for the unit test that parses each (embedded) example.
    println!("cargo::rerun-if-changed=../config");
    let mut examples: Vec<String> = std::fs::read_dir("../config")
        .context("listing config/")?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".toml"))
        .collect();
    examples.sort();
    println!(
        "cargo::rustc-env=FASTPATH_EXAMPLE_CONFIGS={}",
        examples.join(",")
    );
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .ok_or_else(|| anyhow!("fastpath crate has no parent directory"))?
        .join("fastpath-ebpf");
    let root = root.to_str().context("non-UTF-8 path to fastpath-ebpf")?;
    println!("cargo::rerun-if-changed=../fastpath-common/src");
    // bpf-linker lives in the project's .tools/bin (installed by `cargo xtask bootstrap`): put
    // it on PATH so plain `cargo build` and IDEs find it too.
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
    println!("cargo::rerun-if-changed=../fastpath-ebpf/rust-toolchain.toml");
    let toolchain = channel(EBPF_TOOLCHAIN_FILE)
        .context("fastpath-ebpf/rust-toolchain.toml states no channel = \"...\"")?;
    let out_dir = std::path::PathBuf::from(out_dir);
    let build = |features: &[&str]| {
        aya_build::build_ebpf(
            [Package { name: "fastpath-ebpf", root_dir: root, no_default_features: false, features }],
            Toolchain::Custom(toolchain),
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
