//! `cargo xtask vm <6.1|6.12|5.15|5.10> [options] [--] <command> [args...]`: runs a host command
//! as root inside a distribution's own kernel under qemu, so the eBPF programs can be loaded and
//! tested on the kernels users have, whatever kernel this machine runs.
//!
//! How it works, and why this way:
//!
//! - The kernel is Debian's generic `-amd64` flavour (the `-cloud` one has no 9p): 6.1 is
//!   bookworm's, 6.12 bookworm-backports'; not in the matrix, 5.10 is bullseye's and 5.15
//!   Ubuntu 22.04's `-generic` (its image and `linux-modules` packages, the archive's keyring
//!   package pinned by hash). Its packages are fetched with a private apt
//!   configuration under `.tools/kernels/apt/` (its own sources list, index and cache), so the
//!   host's apt sources and state are never changed; it is extracted under
//!   `.tools/kernels/<series>/root/` and `depmod` is run there. A stamp written last makes the
//!   next run use the tree without touching the network.
//! - The guest's root file system is the host's `/`, shared read-only over virtio-9p: the guest
//!   runs the host's own binaries (the test binaries, `ip`, `tc`, `bpftool`) at the same paths,
//!   so the command and its working directory need no copying. A small busybox initramfs (cached
//!   beside the kernel) loads the 9p/virtio/overlay modules, mounts that share under an overlay
//!   whose upper layer is guest memory, and `switch_root`s into it. The host's files are never
//!   written; the guest's writes (anywhere but the run share) vanish at power-off. The overlay
//!   is what lets the guest create `/lib/modules/<release>` on a host that has no /lib/modules.
//! - Kernel-specific mounts on top: proc, sysfs, devtmpfs, tmpfs on `/tmp` and `/run` (the
//!   top directories under the host's /tmp of the current directory and the kernel's, if they
//!   are there, bound back), bpffs,
//!   and `/lib/modules/<release>` bound from the extracted package, so `modprobe` and the
//!   kernel's own module autoloading find the guest kernel's modules.
//! - A second, writable 9p share (a per-run directory) carries the scripts in and the command's
//!   exit code out.
//! - Serial ports: ttyS0 is the kernel console (to `console.log` in the run directory, printed
//!   only when the guest fails), ttyS1 and ttyS2 carry the command's stdout and stderr through
//!   FIFOs to this process's stdout and stderr, so kernel messages never mix with the output.
//! - Emulation (`-accel tcg`): this machine's /dev/kvm cannot boot stock kernels. It is slow
//!   (tens of times slower than native): use it for correctness, never for timings.

use std::{
    collections::BTreeSet,
    env,
    fs::{self, File, OpenOptions},
    io::{self, Read as _, Write as _},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::{output, run, tools_dir};

/// Debian packages the VM needs on the host: the emulator, the initramfs's shell and tools,
/// `cpio` to pack it, `kmod` (`depmod`, `modprobe --show-depends`), `xz` and `zstd` for the
/// compressed modules and kernel images.
const VM_PACKAGES: &[&str] = &[
    "qemu-system-x86",
    "busybox-static",
    "cpio",
    "kmod",
    "xz-utils",
    "zstd",
];

/// Modules loaded in the guest before the command runs: what the datapath tests use (veth pairs,
/// the clsact qdisc, TC programs). The kernel autoloads others through `modprobe` as needed.
const GUEST_MODULES: &[&str] = &["veth", "sch_ingress", "cls_bpf"];

/// Modules the initramfs loads to reach the root share and lay the writable overlay on it;
/// their dependencies come from
/// `modprobe --show-depends` (builtins, such as 6.12's virtio_pci, are skipped).
const BOOT_MODULES: &[&str] = &["virtio_pci", "9pnet_virtio", "9p", "overlay"];

const DEFAULT_TIMEOUT_SECS: u64 = 600;
const DEFAULT_MEM_MB: u32 = 1024;
const DEFAULT_CPUS: u32 = 2;

const USAGE: &str = "\
cargo xtask vm <6.1|6.12|5.15|5.10> [--timeout SECS] [--mem MB] [--cpus N] [--] <command> [args...]

Boots Debian's 6.1 (bookworm), 6.12 (bookworm-backports) or 5.10 (bullseye) kernel, or
Ubuntu 22.04's 5.15 (jammy-updates), under qemu emulation with
the host's / as its root (read-only to the host: the guest's writes stay in guest memory) and
runs <command> as root in the current directory. The command's stdout and stderr are the
guest's; its exit code is xtask's. /tmp and /run are empty tmpfs in the guest, except that
a current directory (or this tree's .tools) under /tmp brings its top directory there (e.g.
/tmp/clone.X); /run is refused. Defaults: --timeout 600, --mem 1024, --cpus 2.";

/// The kernel series this subcommand knows: which package of its archive's kernel
/// metapackage's dependencies belongs to it.
struct Series {
    name: &'static str,
    archive: &'static Archive,
    /// The metapackage that depends on the current versioned image package.
    meta: &'static str,
    /// Prefix and suffix of the versioned image package, e.g. `linux-image-6.1.0-57-amd64`.
    package_prefix: &'static str,
    flavour: &'static str,
    /// Packages of the same version that hold the image's modules, as the prefix replacing
    /// `linux-image-` (Ubuntu ships them apart; Debian's image package has them).
    module_packages: &'static [&'static str],
    /// The suites whose metapackage depends on it (`<archive path> <suite>`).
    suites: &'static [&'static str],
}

/// A package archive and the keyring its `InRelease` files are checked against.
struct Archive {
    mirror: &'static str,
    keyring: Keyring,
}

enum Keyring {
    /// A keyring every Debian system has.
    Host(&'static str),
    /// The archive's own keyring package (`pool` path in the archive, its SHA-256 pinned
    /// here, the keyring file inside): no Debian package carries Ubuntu's archive key, so
    /// the package is fetched once and trusted only if its hash is the one this file names.
    Pinned {
        pool_path: &'static str,
        sha256: &'static str,
        file: &'static str,
    },
}

const DEBIAN: Archive = Archive {
    mirror: "http://deb.debian.org",
    keyring: Keyring::Host("/usr/share/keyrings/debian-archive-keyring.gpg"),
};

const UBUNTU: Archive = Archive {
    mirror: "http://archive.ubuntu.com",
    keyring: Keyring::Pinned {
        pool_path: "ubuntu/pool/main/u/ubuntu-keyring/ubuntu-keyring_2021.03.26_all.deb",
        sha256: "0d0e7ed6b112f5d03eabf3c7eb01ebdacf9c57714b279e90495cfc58c8c4520f",
        file: "usr/share/keyrings/ubuntu-archive-keyring.gpg",
    },
};

const SERIES: &[Series] = &[
    Series {
        name: "6.1",
        archive: &DEBIAN,
        meta: "linux-image-amd64",
        package_prefix: "linux-image-6.1.0-",
        flavour: "-amd64",
        module_packages: &[],
        suites: &["debian bookworm", "debian-security bookworm-security"],
    },
    Series {
        name: "6.12",
        archive: &DEBIAN,
        meta: "linux-image-amd64",
        package_prefix: "linux-image-6.12.",
        flavour: "-amd64",
        module_packages: &[],
        suites: &["debian bookworm-backports"],
    },
    // Not in the test command's matrix (see README "Kernels"): for trying.
    Series {
        name: "5.15",
        archive: &UBUNTU,
        meta: "linux-image-generic",
        package_prefix: "linux-image-5.15.0-",
        flavour: "-generic",
        module_packages: &["linux-modules-"],
        suites: &["ubuntu jammy-updates", "ubuntu jammy-security"],
    },
    Series {
        name: "5.10",
        archive: &DEBIAN,
        meta: "linux-image-amd64",
        package_prefix: "linux-image-5.10.0-",
        flavour: "-amd64",
        module_packages: &[],
        suites: &["debian bullseye", "debian-security bullseye-security"],
    },
];

struct Options {
    series: &'static Series,
    timeout: Duration,
    mem_mb: u32,
    cpus: u32,
    command: Vec<String>,
}

/// Entry point. Returns on success; exits the process with the guest command's code when it
/// failed (the code is the result, so it is passed through rather than turned into an error).
pub fn main(args: &[String]) -> Result<()> {
    let opts = match parse_args(args)? {
        Some(o) => o,
        None => {
            println!("{USAGE}");
            return Ok(());
        }
    };
    let cwd = env::current_dir().context("reading the current directory")?;
    let code = run_options(&opts, &cwd)?;
    if code != 0 {
        eprintln!("xtask: vm: the command exited with {code}");
        // Whatever the threads copied is written; exit with the command's code.
        let _ = io::stdout().flush();
        std::process::exit(code);
    }
    Ok(())
}

/// Runs `command` as root in kernel `series` (`"6.1"`, `"6.12"`) with `mem_mb` of memory and
/// the default CPUs, from directory `cwd`; returns its exit code (the test command's kernel
/// matrix).
pub fn run_in(
    series: &str,
    timeout: Duration,
    mem_mb: u32,
    cwd: &Path,
    command: &[String],
) -> Result<i32> {
    let series = SERIES
        .iter()
        .find(|s| s.name == series)
        .with_context(|| format!("unknown kernel series {series:?}"))?;
    run_options(
        &Options {
            series,
            timeout,
            mem_mb,
            cpus: DEFAULT_CPUS,
            command: command.to_vec(),
        },
        cwd,
    )
}

fn run_options(opts: &Options, cwd: &Path) -> Result<i32> {
    // The guest mounts fresh tmpfs/proc/sys/dev there: the host's contents are hidden. (A
    // tree under /tmp is bound back in by command.sh.)
    for hidden in ["/run", "/proc", "/sys", "/dev"] {
        if cwd.starts_with(hidden) {
            bail!(
                "the current directory {} is under {hidden}, which the guest mounts afresh: run from elsewhere",
                cwd.display()
            );
        }
    }
    crate::debian_packages(VM_PACKAGES)?;
    let t = Instant::now();
    let kernel = ensure_kernel(opts.series)?;
    let initramfs = ensure_initramfs(&kernel)?;
    let image = boot_image(&kernel);
    eprintln!(
        "xtask: vm: Linux {} ready in {:.1} s",
        kernel.release,
        t.elapsed().as_secs_f64()
    );
    boot(&kernel, &image, &initramfs, opts, cwd)
}

/// `None` for `--help`.
fn parse_args(args: &[String]) -> Result<Option<Options>> {
    let mut it = args.iter();
    let Some(series) = it.next() else {
        bail!("missing the kernel series\n\n{USAGE}");
    };
    if matches!(series.as_str(), "-h" | "--help" | "help") {
        return Ok(None);
    }
    let series = SERIES
        .iter()
        .find(|s| s.name == series)
        .with_context(|| format!("unknown kernel series {series:?}\n\n{USAGE}"))?;
    let mut opts = Options {
        series,
        timeout: Duration::from_secs(DEFAULT_TIMEOUT_SECS),
        mem_mb: DEFAULT_MEM_MB,
        cpus: DEFAULT_CPUS,
        command: Vec::new(),
    };
    while let Some(arg) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .with_context(|| format!("{name} needs a value\n\n{USAGE}"))
        };
        match arg.as_str() {
            "--timeout" => {
                let v = value("--timeout")?;
                opts.timeout = Duration::from_secs(
                    v.parse()
                        .with_context(|| format!("--timeout {v:?}: not a number of seconds"))?,
                );
            }
            "--mem" => {
                let v = value("--mem")?;
                opts.mem_mb = v
                    .parse()
                    .with_context(|| format!("--mem {v:?}: not a number of MB"))?;
            }
            "--cpus" => {
                let v = value("--cpus")?;
                opts.cpus = v
                    .parse()
                    .with_context(|| format!("--cpus {v:?}: not a number"))?;
            }
            "--" => {
                opts.command.extend(it.by_ref().cloned());
            }
            _ => {
                // The first word that is not an option starts the command.
                opts.command.push(arg.clone());
                opts.command.extend(it.by_ref().cloned());
            }
        }
    }
    if opts.command.is_empty() {
        bail!("missing the command to run in the guest\n\n{USAGE}");
    }
    Ok(Some(opts))
}

// ---------------------------------------------------------------------------------------------
// the kernel

/// An extracted kernel package.
struct Kernel {
    /// `.tools/kernels/<series>/`
    dir: PathBuf,
    /// `uname -r` of the guest, e.g. `6.1.0-57-amd64`.
    release: String,
}

impl Kernel {
    fn root(&self) -> PathBuf {
        self.dir.join("root")
    }

    fn vmlinuz(&self) -> PathBuf {
        self.root()
            .join("boot")
            .join(format!("vmlinuz-{}", self.release))
    }

    fn modules(&self) -> PathBuf {
        self.root().join("lib/modules").join(&self.release)
    }
}

/// The series' kernel, downloaded and extracted once. The stamp `kernel.stamp` (the package
/// name, then the release) is written after extraction and `depmod` succeeded: with it and the
/// image in place nothing is fetched, so later runs work offline and keep the same kernel until
/// `.tools/kernels/<series>/` is removed.
fn ensure_kernel(series: &Series) -> Result<Kernel> {
    let dir = tools_dir().join("kernels").join(series.name);
    let stamp = dir.join("kernel.stamp");
    if let Ok(text) = fs::read_to_string(&stamp)
        && let Some(release) = text.lines().nth(1)
    {
        let kernel = Kernel {
            dir: dir.clone(),
            release: release.to_owned(),
        };
        if kernel.vmlinuz().is_file() && kernel.modules().is_dir() {
            return Ok(kernel);
        }
    }
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let apt = Apt::new(series)?;
    let package = apt.resolve(series)?;
    let image_version = package
        .strip_prefix("linux-image-")
        .with_context(|| format!("{package}: not a linux-image- package"))?;
    let packages: Vec<String> = std::iter::once(package.clone())
        .chain(
            series
                .module_packages
                .iter()
                .map(|prefix| format!("{prefix}{image_version}")),
        )
        .collect();
    let root = dir.join("root");
    if root.exists() {
        fs::remove_dir_all(&root).with_context(|| format!("removing {}", root.display()))?;
    }
    for name in &packages {
        let deb = match find_deb(&dir, name)? {
            Some(deb) => deb,
            None => {
                eprintln!("xtask: vm: downloading {name}");
                run(apt
                    .command("apt-get")
                    .arg("download")
                    .arg(name)
                    .current_dir(&dir))?;
                find_deb(&dir, name)?.with_context(|| {
                    format!("apt-get download left no {name}_*.deb in {}", dir.display())
                })?
            }
        };
        eprintln!("xtask: vm: extracting {}", deb.display());
        run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&root))?;
    }
    // The package's one modules directory names the release (`uname -r`).
    let modules = root.join("lib/modules");
    let releases: Vec<String> = fs::read_dir(&modules)
        .with_context(|| format!("reading {}", modules.display()))?
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    let [release] = releases.as_slice() else {
        bail!(
            "expected one kernel release in {}, found {releases:?}",
            modules.display()
        );
    };
    // Debian ships no modules.dep: postinst makes it. Both modprobes (the host's, resolving the
    // initramfs's modules, and the guest's) need it.
    run(Command::new("depmod").arg("-b").arg(&root).arg(release))?;
    fs::write(&stamp, format!("{package}\n{release}\n"))
        .with_context(|| format!("writing {}", stamp.display()))?;
    let kernel = Kernel {
        dir,
        release: release.clone(),
    };
    if !kernel.vmlinuz().is_file() {
        bail!("{package} has no {}", kernel.vmlinuz().display());
    }
    Ok(kernel)
}

/// `<dir>/<package>_*.deb`, if downloaded.
fn find_deb(dir: &Path, package: &str) -> Result<Option<PathBuf>> {
    let prefix = format!("{package}_");
    Ok(fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".deb"))
        }))
}

/// apt with its own sources, index and cache under `.tools/kernels/apt/`: the host's apt
/// configuration is read (proxies, keyrings) but its sources and state are neither used nor
/// changed, whatever Debian release the host runs.
struct Apt {
    options: Vec<String>,
}

impl Apt {
    /// Writes the sources list (`series`'s suites) and refreshes the private index.
    fn new(series: &Series) -> Result<Apt> {
        let dir = tools_dir().join("kernels/apt");
        for sub in ["lists/partial", "cache/archives/partial"] {
            let d = dir.join(sub);
            fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
        }
        let keyring = keyring(series.archive, &dir)?;
        let sources = dir.join("sources.list");
        let list: String = series
            .suites
            .iter()
            .map(|suite| {
                format!(
                    "deb [signed-by={}] {}/{suite} main\n",
                    keyring.display(),
                    series.archive.mirror
                )
            })
            .collect();
        fs::write(&sources, list).with_context(|| format!("writing {}", sources.display()))?;
        let path = |p: PathBuf| p.to_string_lossy().into_owned();
        let options = vec![
            format!("Dir::Etc::sourcelist={}", path(sources)),
            // No sources.list.d: only ours.
            "Dir::Etc::sourceparts=-".to_owned(),
            format!("Dir::State::Lists={}", path(dir.join("lists"))),
            format!("Dir::Cache={}", path(dir.join("cache"))),
            // Nothing is installed through this configuration: no dpkg status is read.
            "Dir::State::status=/dev/null".to_owned(),
            // The download lands in .tools, which apt's `_apt` user may not be able to write.
            "APT::Sandbox::User=root".to_owned(),
        ];
        let apt = Apt { options };
        eprintln!("xtask: vm: refreshing the kernel package index (.tools/kernels/apt)");
        run(apt.command("apt-get").args(["update", "-qq"]))?;
        Ok(apt)
    }

    fn command(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        for o in &self.options {
            c.arg("-o").arg(o);
        }
        c
    }

    /// The newest versioned image package of `series`: the metapackage (`series.meta`) of
    /// each of the series' suites depends on its suite's current one.
    fn resolve(&self, series: &Series) -> Result<String> {
        let show = output(self.command("apt-cache").args(["show", series.meta]))?;
        let mut best: Option<(String, String)> = None;
        for stanza in show.split("\n\n") {
            let field = |name: &str| {
                stanza
                    .lines()
                    .find_map(|l| l.strip_prefix(name))
                    .map(|v| v.trim().to_owned())
            };
            let (Some(version), Some(depends)) = (field("Version:"), field("Depends:")) else {
                continue;
            };
            let Some(package) = depends
                .split([',', ' '])
                .find(|d| d.starts_with(series.package_prefix) && d.ends_with(series.flavour))
            else {
                continue;
            };
            let newer = match &best {
                None => true,
                Some((v, _)) => Command::new("dpkg")
                    .args(["--compare-versions", &version, "gt", v])
                    .status()
                    .context("running dpkg --compare-versions")?
                    .success(),
            };
            if newer {
                best = Some((version, package.to_owned()));
            }
        }
        best.map(|(_, p)| p).with_context(|| {
            format!(
                "no {} in {:?} depends on a {}*{} package",
                series.meta, series.suites, series.package_prefix, series.flavour
            )
        })
    }
}

/// The keyring file apt checks `archive`'s index with; a pinned keyring package is fetched
/// into `dir` once and refused unless its SHA-256 is the pinned one.
fn keyring(archive: &Archive, dir: &Path) -> Result<PathBuf> {
    let (pool_path, sha256, file) = match &archive.keyring {
        Keyring::Host(path) => return Ok(PathBuf::from(path)),
        Keyring::Pinned {
            pool_path,
            sha256,
            file,
        } => (pool_path, sha256, file),
    };
    let name = Path::new(pool_path)
        .file_name()
        .context("a pinned keyring's pool path names no file")?;
    let extracted = dir.join("keyrings").join(name);
    let path = extracted.join(file);
    if path.is_file() {
        return Ok(path);
    }
    let deb = dir.join(name);
    let url = format!("{}/{pool_path}", archive.mirror);
    eprintln!("xtask: vm: downloading {url}");
    run(Command::new("curl")
        .args(["-fsSL", "--retry", "3", "-o"])
        .arg(&deb)
        .arg(&url))?;
    let sum = output(Command::new("sha256sum").arg(&deb))?;
    if sum.split_whitespace().next() != Some(sha256) {
        let _ = fs::remove_file(&deb);
        bail!("{url}: SHA-256 {sum:?} is not the pinned {sha256}: not trusted, removed");
    }
    fs::create_dir_all(&extracted).with_context(|| format!("creating {}", extracted.display()))?;
    run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&extracted))?;
    if !path.is_file() {
        bail!("{url} has no {file}");
    }
    Ok(path)
}

/// What qemu boots: the uncompressed ELF kernel inside the bzImage, extracted once to
/// `<kernel dir>/vmlinux-<release>`. qemu starts an ELF kernel with a PVH note (Debian's have
/// one: CONFIG_PVH) directly, which skips the kernel decompressing itself under emulation
/// (about 3 s of each boot here). Any failure falls back to the bzImage, which always works.
fn boot_image(kernel: &Kernel) -> PathBuf {
    let vmlinux = kernel.dir.join(format!("vmlinux-{}", kernel.release));
    if vmlinux.is_file() {
        return vmlinux;
    }
    match extract_vmlinux(&kernel.vmlinuz(), &vmlinux) {
        Ok(()) => vmlinux,
        Err(e) => {
            eprintln!("xtask: vm: booting the bzImage (slower): extracting its ELF kernel: {e:#}");
            kernel.vmlinuz()
        }
    }
}

/// Decompresses the payload of the bzImage `from` into `to`. The x86 boot protocol's setup
/// header locates it exactly: `setup_sects` (0x1f1; 0 means 4) sectors of real-mode setup plus
/// the boot sector precede the protected-mode code, in which the payload sits at
/// `payload_offset` (0x248) for `payload_length` (0x24c) bytes, the last 4 of which are the
/// decompressed size (the kernel's build appends it), not compressed data: the decompressors
/// would reject them. The first bytes say how it is compressed (Debian: xz for 6.1, zstd for
/// 6.12).
fn extract_vmlinux(from: &Path, to: &Path) -> Result<()> {
    let image = fs::read(from).with_context(|| format!("reading {}", from.display()))?;
    let u32_at = |at: usize| -> Result<usize> {
        let bytes = image
            .get(at..at + 4)
            .with_context(|| format!("{} is too short for a bzImage", from.display()))?;
        let mut word = [0u8; 4];
        word.copy_from_slice(bytes);
        Ok(u32::from_le_bytes(word) as usize)
    };
    if image.get(0x202..0x206) != Some(b"HdrS".as_slice()) {
        bail!("{} has no x86 boot protocol header", from.display());
    }
    let setup_sects = match image.get(0x1f1).copied() {
        Some(0) => 4,
        Some(n) => usize::from(n),
        None => bail!("{} is too short for a bzImage", from.display()),
    };
    let start = (setup_sects + 1) * 512 + u32_at(0x248)?;
    let length = u32_at(0x24c)?
        .checked_sub(4)
        .context("an empty kernel payload")?;
    let payload = image
        .get(start..start + length)
        .context("the payload lies outside the bzImage")?;
    let tool: &[&str] = if payload.starts_with(&[0xfd, b'7', b'z', b'X', b'Z', 0]) {
        &["xz", "-dc"]
    } else if payload.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        &["zstd", "-dcq"]
    } else if payload.starts_with(&[0x1f, 0x8b]) {
        &["gzip", "-dc"]
    } else {
        bail!("unknown compression of the kernel payload");
    };
    let mut tmp = to.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let out = File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let mut child = Command::new(tool[0])
        .args(&tool[1..])
        .stdin(Stdio::piped())
        .stdout(out)
        .spawn()
        .with_context(|| format!("starting {}", tool[0]))?;
    // Written from a thread: the decompressor's output goes to the file meanwhile, so neither
    // side waits on a full pipe.
    let input = payload.to_vec();
    let mut stdin = child.stdin.take().context("the decompressor's stdin")?;
    let writer = thread::spawn(move || stdin.write_all(&input));
    let status = child.wait().context("waiting for the decompressor")?;
    let written = writer
        .join()
        .map_err(|_| anyhow::anyhow!("the writer thread panicked"))?;
    written.context("feeding the decompressor")?;
    if !status.success() {
        bail!("{} failed with {status}", tool.join(" "));
    }
    let mut magic = [0u8; 4];
    File::open(&tmp)
        .and_then(|mut f| f.read_exact(&mut magic))
        .with_context(|| format!("reading {}", tmp.display()))?;
    if magic != *b"\x7fELF" {
        bail!("the decompressed kernel is not an ELF file");
    }
    fs::rename(&tmp, to).with_context(|| format!("renaming {}", tmp.display()))
}

// ---------------------------------------------------------------------------------------------
// the initramfs

/// Stage 1, the initramfs's /init (busybox): the modules to reach the root share, the guest's
/// view of the host's `/` (an overlay on the read-only share, with fresh proc, sys, dev, tmp,
/// run), the run share, then
/// `switch_root` into stage 2, which the run share carries. Any failure powers off at once:
/// without an exit code in the run share, xtask reports the failure with the console log.
const INIT: &str = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
fail() { echo "vm init: $*"; poweroff -f; }
mkdir -p /proc /sys /dev /newroot
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in /modules/*.ko; do
    [ -e "$m" ] || continue
    insmod "$m" || fail "insmod $m"
done
# cache=loose: the share is read-only and lives for one run, so caching it whole is safe.
mkdir -p /lower /upper
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144,cache=loose,ro root /lower \
    || fail "mounting the host's / (9p tag root)"
# Writes land in guest memory, never on the host: the host's / stays read-only, yet the
# guest can create what the host's tree lacks (/lib/modules/<release> on a machine without
# a kernel of its own) and programs may write where they expect to.
mount -t tmpfs -o mode=755 tmpfs /upper || fail "tmpfs for the overlay"
mkdir -p /upper/data /upper/work
mount -t overlay -o lowerdir=/lower,upperdir=/upper/data,workdir=/upper/work overlay /newroot \
    || fail "the overlay on the host's /"
mount -t proc proc /newroot/proc || fail "proc"
mount -t sysfs sysfs /newroot/sys || fail "sysfs"
mount -t devtmpfs devtmpfs /newroot/dev || fail "devtmpfs"
# The host's /tmp stays reachable at /run/host-tmp (through the overlay), for a command run
# from a tree under /tmp (see command.sh).
mkdir -p /hosttmp
mount -o bind /newroot/tmp /hosttmp || fail "keeping the host's /tmp"
mount -t tmpfs -o mode=1777 tmpfs /newroot/tmp || fail "tmpfs /tmp"
mount -t tmpfs -o mode=755 tmpfs /newroot/run || fail "tmpfs /run"
mkdir -p /newroot/run/vm /newroot/run/host-tmp
mount -o move /hosttmp /newroot/run/host-tmp || fail "moving the host's /tmp to /run/host-tmp"
# No cache on the writable share: the exit code must reach the host before power-off.
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 out /newroot/run/vm \
    || fail "mounting the run share (9p tag out)"
umount /proc /sys /dev
exec switch_root /newroot /bin/sh /run/vm/stage2.sh
"#;

/// Stage 2, PID 1 on the host's tree: the kernel-specific mounts (bpffs, the guest kernel's
/// modules at /lib/modules), the modules the tests use, then the command with its stdout on
/// ttyS1 and stderr on ttyS2 (raw: no CR added, no echo). The exit code goes to the run share;
/// then power-off (PID 1 must not exit: the kernel would panic).
const STAGE2: &str = r#"# sourced: MODULES_DIR, GUEST_MODULES, HOST_TMP_TOPS
. /run/vm/env.sh
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
# The host's /tmp directories the run needs (a checkout there, its kernels), bound from the
# host's /tmp over the guest's fresh one, first: the modules below may be among them.
for top in $HOST_TMP_TOPS; do
    mkdir -p "/tmp/$top" && mount --bind "/run/host-tmp/$top" "/tmp/$top" \
        || echo "vm: binding the host's /tmp/$top failed" >&2
done
mount -t bpf bpf /sys/fs/bpf
mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null
mount -t cgroup2 cgroup2 /sys/fs/cgroup 2>/dev/null
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
# The guest kernel's modules, where modprobe and the kernel's autoloading look (the
# directory is created in the overlay: the host may have no /lib/modules at all).
mkdir -p "/lib/modules/$(uname -r)"
mount --bind -o ro "$MODULES_DIR" "/lib/modules/$(uname -r)"
for m in $GUEST_MODULES; do
    modprobe "$m" || echo "vm: modprobe $m failed" >&2
done
ip link set lo up 2>/dev/null
hostname vm 2>/dev/null
exec 3>/dev/ttyS1 4>/dev/ttyS2
stty -F /dev/ttyS1 raw -echo
stty -F /dev/ttyS2 raw -echo
/bin/sh /run/vm/command.sh >&3 2>&4 3>&- 4>&- </dev/null
echo $? > /run/vm/exit-code
sync
exec 3>&- 4>&-
/bin/busybox poweroff -f
echo o > /proc/sysrq-trigger
"#;

/// The initramfs `<kernel dir>/initramfs.cpio`: busybox, [`INIT`], and [`BOOT_MODULES`] with
/// their dependencies, decompressed (busybox's insmod reads plain ELF), named `NN-name.ko` so
/// the glob in /init loads them in dependency order. Rebuilt when its stamp (the script and the
/// module list) changes.
fn ensure_initramfs(kernel: &Kernel) -> Result<PathBuf> {
    let cpio = kernel.dir.join("initramfs.cpio");
    let stamp_path = kernel.dir.join("initramfs.stamp");
    let modules = boot_modules(kernel)?;
    let stamp = format!(
        "{INIT}\n{}\n",
        modules
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join("\n")
    );
    if cpio.is_file() && fs::read_to_string(&stamp_path).ok().as_deref() == Some(stamp.as_str()) {
        return Ok(cpio);
    }
    eprintln!("xtask: vm: building {}", cpio.display());
    let staging = kernel.dir.join("initramfs.d");
    if staging.exists() {
        fs::remove_dir_all(&staging).with_context(|| format!("removing {}", staging.display()))?;
    }
    for sub in ["bin", "modules"] {
        fs::create_dir_all(staging.join(sub))
            .with_context(|| format!("creating {}", staging.join(sub).display()))?;
    }
    fs::copy("/bin/busybox", staging.join("bin/busybox"))
        .context("copying /bin/busybox (from busybox-static) into the initramfs")?;
    write_executable(&staging.join("init"), INIT)?;
    for (i, module) in modules.iter().enumerate() {
        let name = module
            .file_name()
            .and_then(|n| n.to_str())
            .with_context(|| format!("a module path without a name: {}", module.display()))?;
        let base = name.split(".ko").next().unwrap_or(name);
        let target = staging.join(format!("modules/{i:02}-{base}.ko"));
        decompress_module(module, &target)?;
    }
    let tmp = kernel.dir.join("initramfs.cpio.tmp");
    // newc: the format the kernel unpacks. Paths relative to the staging root.
    run(Command::new("sh")
        .arg("-c")
        .arg("find . -print | LC_ALL=C sort | cpio -o -H newc --quiet > \"$0\"")
        .arg(&tmp)
        .current_dir(&staging))?;
    fs::rename(&tmp, &cpio).with_context(|| format!("renaming {}", tmp.display()))?;
    fs::write(&stamp_path, stamp).with_context(|| format!("writing {}", stamp_path.display()))?;
    Ok(cpio)
}

/// The module files of [`BOOT_MODULES`] and their dependencies, dependencies first, each once,
/// as the host's `modprobe` resolves them in the extracted tree.
fn boot_modules(kernel: &Kernel) -> Result<Vec<PathBuf>> {
    let mut seen = BTreeSet::new();
    let mut files = Vec::new();
    for module in BOOT_MODULES {
        // One module per call: further words would be taken as its parameters.
        let deps = output(
            Command::new("modprobe")
                .arg("-d")
                .arg(kernel.root())
                .arg("-S")
                .arg(&kernel.release)
                .arg("--show-depends")
                .arg(module),
        )?;
        for line in deps.lines() {
            // `insmod <path> [params]` or `builtin <name>`.
            let mut words = line.split_whitespace();
            if words.next() != Some("insmod") {
                continue;
            }
            let Some(path) = words.next() else { continue };
            if seen.insert(path.to_owned()) {
                files.push(PathBuf::from(path));
            }
        }
    }
    Ok(files)
}

fn decompress_module(from: &Path, to: &Path) -> Result<()> {
    let name = from.to_string_lossy();
    let tool = if name.ends_with(".ko.xz") {
        Some("xz")
    } else if name.ends_with(".ko.zst") {
        Some("zstd")
    } else if name.ends_with(".ko.gz") {
        Some("gzip")
    } else {
        None
    };
    match tool {
        None => {
            fs::copy(from, to).with_context(|| format!("copying {}", from.display()))?;
        }
        Some(tool) => {
            let out = File::create(to).with_context(|| format!("creating {}", to.display()))?;
            let status = Command::new(tool)
                .arg("-dc")
                .arg(from)
                .stdout(out)
                .status()
                .with_context(|| format!("starting {tool} (to decompress {})", from.display()))?;
            if !status.success() {
                bail!("{tool} -dc {} failed with {status}", from.display());
            }
        }
    }
    Ok(())
}

fn write_executable(path: &Path, text: &str) -> Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o755))
        .with_context(|| format!("making {} executable", path.display()))
}

// ---------------------------------------------------------------------------------------------
// the run

/// `'text'` for sh, whatever the text holds.
fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The command's script: its directory, an environment (what a root shell would have, plus
/// the caller's RUST_* and FASTPATH_* settings), then the command itself.
fn command_script(opts: &Options, cwd: &Path) -> Result<String> {
    let cwd = cwd.to_str().context("the current directory is not UTF-8")?;
    // The caller's PATH (cargo's toolchains, .tools/bin), and the sbin directories where ip,
    // tc and modprobe live.
    let mut path = env::var("PATH").unwrap_or_default();
    for dir in [
        "/usr/local/sbin",
        "/usr/local/bin",
        "/usr/sbin",
        "/usr/bin",
        "/sbin",
        "/bin",
    ] {
        if !path.split(':').any(|p| p == dir) {
            if !path.is_empty() {
                path.push(':');
            }
            path.push_str(dir);
        }
    }
    let mut vars = vec![
        ("PATH".to_owned(), path),
        // The host's, through the overlay: writes there are the guest's alone.
        ("HOME".to_owned(), "/root".to_owned()),
        ("USER".to_owned(), "root".to_owned()),
        ("LOGNAME".to_owned(), "root".to_owned()),
        // The output goes through a serial line: no colours.
        ("TERM".to_owned(), "dumb".to_owned()),
        ("LANG".to_owned(), "C.UTF-8".to_owned()),
    ];
    for (k, v) in env::vars() {
        let name_ok = k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if name_ok && (k.starts_with("RUST_") || k.starts_with("FASTPATH_")) {
            vars.push((k, v));
        }
    }
    // PID 1's environment is the kernel's (HOME=/, TERM=linux): replaced by these exports.
    let mut script = format!("cd {} || exit 125\n", sh_quote(cwd));
    for (k, v) in &vars {
        script.push_str(&format!("export {k}={}\n", sh_quote(v)));
    }
    // `exec`'s arguments are plain words: a command containing `=` is still the command.
    script.push_str("exec");
    for a in &opts.command {
        script.push(' ');
        script.push_str(&sh_quote(a));
    }
    script.push('\n');
    Ok(script)
}

/// A per-run directory `.tools/kernels/runs/<pid>`: the guest's writable share (scripts in, exit
/// code out), the console log and the output FIFOs. Directories of runs whose xtask is gone
/// (killed, Ctrl-C) are removed first.
fn run_dir() -> Result<PathBuf> {
    let runs = tools_dir().join("kernels/runs");
    fs::create_dir_all(&runs).with_context(|| format!("creating {}", runs.display()))?;
    for entry in fs::read_dir(&runs).with_context(|| format!("reading {}", runs.display()))? {
        let path = entry?.path();
        let alive = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|pid| Path::new("/proc").join(pid).exists());
        if !alive {
            let _ = fs::remove_dir_all(&path);
        }
    }
    let dir = runs.join(std::process::id().to_string());
    if dir.exists() {
        fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

/// Copies a FIFO to stdout or stderr on a thread. Opening the read end blocks until qemu opens
/// the write end, which qemu does at start-up: started before qemu, so neither waits forever.
fn forward(fifo: PathBuf, to_stderr: bool) -> thread::JoinHandle<io::Result<()>> {
    thread::spawn(move || {
        let mut from = File::open(&fifo)?;
        let mut buf = [0u8; 4096];
        loop {
            let n = from.read(&mut buf)?;
            if n == 0 {
                return Ok(());
            }
            // Flushed per read: the output appears as the guest writes it.
            if to_stderr {
                let mut e = io::stderr().lock();
                e.write_all(&buf[..n])?;
                e.flush()?;
            } else {
                let mut o = io::stdout().lock();
                o.write_all(&buf[..n])?;
                o.flush()?;
            }
        }
    })
}

/// The top directories under /tmp of `paths` (`/tmp/clone.X/tree` → `clone.X`), which the
/// guest binds back from the host over its fresh /tmp.
fn host_tmp_tops(paths: &[&Path]) -> Result<Vec<String>> {
    let mut tops = Vec::new();
    for path in paths {
        if let Some(top) = path
            .strip_prefix("/tmp")
            .ok()
            .and_then(|rest| rest.components().next())
        {
            let top = top
                .as_os_str()
                .to_str()
                .filter(|t| !t.contains(char::is_whitespace))
                .with_context(|| format!("{}: a directory name sh can split on", path.display()))?;
            if !tops.iter().any(|t| t == top) {
                tops.push(top.to_owned());
            }
        }
    }
    Ok(tops)
}

/// Boots the guest, runs the command, returns its exit code.
fn boot(
    kernel: &Kernel,
    image: &Path,
    initramfs: &Path,
    opts: &Options,
    cwd: &Path,
) -> Result<i32> {
    let dir = run_dir()?;
    for p in [&dir, &image.to_path_buf(), &initramfs.to_path_buf()] {
        // qemu splits option values at commas.
        if p.to_string_lossy().contains(',') {
            bail!("qemu cannot take a path with a comma: {}", p.display());
        }
    }
    fs::write(dir.join("stage2.sh"), STAGE2).context("writing stage2.sh")?;
    fs::write(
        dir.join("env.sh"),
        format!(
            "MODULES_DIR={}\nGUEST_MODULES={}\nHOST_TMP_TOPS={}\n",
            sh_quote(&kernel.modules().to_string_lossy()),
            sh_quote(&GUEST_MODULES.join(" ")),
            sh_quote(&host_tmp_tops(&[cwd, &kernel.modules()])?.join(" "))
        ),
    )
    .context("writing env.sh")?;
    fs::write(dir.join("command.sh"), command_script(opts, cwd)?).context("writing command.sh")?;
    let console = dir.join("console.log");
    let fifos = [dir.join("stdout.fifo"), dir.join("stderr.fifo")];
    for f in &fifos {
        run(Command::new("mkfifo").arg(f))?;
    }
    let forwarders = [
        forward(fifos[0].clone(), false),
        forward(fifos[1].clone(), true),
    ];

    let mut qemu = Command::new("setpriv");
    // If xtask dies (Ctrl-C reaches qemu too, but a kill of xtask alone does not), qemu dies.
    qemu.args(["--pdeathsig", "KILL", "--", "qemu-system-x86_64"])
        .args(["-accel", "tcg", "-cpu", "max"])
        .arg("-smp")
        .arg(opts.cpus.to_string())
        .arg("-m")
        .arg(opts.mem_mb.to_string())
        // No default devices, no display, no monitor; a guest panic or reboot ends qemu.
        .args(["-nodefaults", "-no-user-config", "-display", "none", "-no-reboot"])
        .arg("-kernel")
        .arg(image)
        .arg("-initrd")
        .arg(initramfs)
        .arg("-append")
        .arg("console=ttyS0 quiet loglevel=0 panic=-1 rdinit=/init")
        .arg("-chardev")
        .arg(format!("file,id=console,path={}", console.display()))
        .args(["-serial", "chardev:console"])
        .arg("-chardev")
        .arg(format!("file,id=out,path={}", fifos[0].display()))
        .args(["-serial", "chardev:out"])
        .arg("-chardev")
        .arg(format!("file,id=err,path={}", fifos[1].display()))
        .args(["-serial", "chardev:err"])
        .args(["-virtfs", "local,path=/,mount_tag=root,security_model=none,readonly=on,multidevs=remap"])
        .arg("-virtfs")
        .arg(format!(
            "local,path={},mount_tag=out,security_model=none,multidevs=remap",
            dir.display()
        ))
        .stdin(Stdio::null());
    eprintln!(
        "xtask: vm: booting Linux {} (qemu, emulated; timeout {} s): {}",
        kernel.release,
        opts.timeout.as_secs(),
        opts.command.join(" ")
    );
    let started = Instant::now();
    let mut child = qemu
        .spawn()
        .context("starting qemu-system-x86_64 (through setpriv)")?;
    let status = loop {
        if let Some(status) = child.try_wait().context("waiting for qemu")? {
            break Some(status);
        }
        if started.elapsed() > opts.timeout {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        thread::sleep(Duration::from_millis(100));
    };
    // A forwarder still blocked in open (qemu died before opening its FIFO) is released by a
    // writer that closes at once: opening a FIFO read-write never blocks.
    for f in &fifos {
        if let Ok(w) = OpenOptions::new().read(true).write(true).open(f) {
            drop(w);
        }
    }
    for f in forwarders {
        match f.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("xtask: vm: copying the guest's output: {e}"),
            Err(_) => eprintln!("xtask: vm: an output thread panicked"),
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    let code = fs::read_to_string(dir.join("exit-code"))
        .ok()
        .and_then(|s| s.trim().parse::<i32>().ok());
    match (status, code) {
        (None, _) => {
            print_console(&console);
            bail!(
                "timed out after {} s: qemu killed (the console log and run files are in {})",
                opts.timeout.as_secs(),
                dir.display()
            );
        }
        (Some(status), None) => {
            print_console(&console);
            bail!(
                "the guest stopped ({status}) without the command's exit code after {elapsed:.1} s (files in {})",
                dir.display()
            );
        }
        (Some(_), Some(code)) => {
            eprintln!("xtask: vm: guest done in {elapsed:.1} s (boot, command, power-off)");
            let _ = fs::remove_dir_all(&dir);
            Ok(code)
        }
    }
}

/// The last lines of the guest's console, for a guest that failed.
fn print_console(console: &Path) {
    let text = fs::read_to_string(console).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let tail = &lines[lines.len().saturating_sub(40)..];
    eprintln!(
        "xtask: vm: the guest's console ({}), last {} lines:",
        console.display(),
        tail.len()
    );
    for l in tail {
        eprintln!("  {l}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting_survives_quotes() {
        assert_eq!(sh_quote("it's"), r"'it'\''s'");
        assert_eq!(sh_quote(""), "''");
    }

    #[test]
    fn args_split_options_from_the_command() {
        let args: Vec<String> = ["6.12", "--timeout", "5", "--", "sh", "-c", "echo --mem"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let o = parse_args(&args).unwrap().unwrap();
        assert_eq!(o.series.name, "6.12");
        assert_eq!(o.timeout, Duration::from_secs(5));
        assert_eq!(o.command, ["sh", "-c", "echo --mem"]);
        let args: Vec<String> = ["6.1", "uname", "--timeout"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(
            parse_args(&args).unwrap().unwrap().command,
            ["uname", "--timeout"]
        );
    }
}
