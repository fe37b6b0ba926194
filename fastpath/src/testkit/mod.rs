//! Test support shared by the integration tests, the demo and the benchmarks: a packet
//! builder, BPF_PROG_TEST_RUN fixtures through the real entry points, and network-namespace
//! topologies with guaranteed cleanup.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test support: a panic, with its message, is how a test fails"
)]

pub mod bgp;
pub mod capture;
pub mod cases;
pub mod cluster;
pub mod ct_cases;
pub mod fixture;
pub mod ha;
pub mod netns;
pub mod packet;
pub mod pki;
pub mod route_cases;
pub mod traffic;
pub mod vlan_cases;
pub mod vxlan_cases;

/// Whether the running kernel is Linux `major.minor` or later, from its release: the tests'
/// own witness of a feature, apart from the daemon's probe. Right for the kernels the tests
/// boot (mainline releases and Debian's and Ubuntu's); a kernel with the feature backported
/// (RHEL 9's 5.14 has `bpf_loop`) would need a witness of its own.
pub fn kernel_at_least(major: u32, minor: u32) -> bool {
    let release = crate::datapath::kernel::release();
    let mut numbers = release
        .split(|c: char| !c.is_ascii_digit())
        .map(|n| n.parse::<u32>().unwrap_or(0));
    (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0)) >= (major, minor)
}

/// The check every root-only test (and the demo) starts with. It panics, never skips: a test
/// that did not run must not pass. Under CI=true the message says the CI job must run as root;
/// otherwise it says how to run `what` as root.
pub fn require_root(what: &str) {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    if euid == 0 {
        return;
    }
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!(
            "{what} needs root (euid is {euid}) and CI=true: it loads eBPF programs, creates \
             network namespaces and pins under /sys/fs/bpf; run the CI job as root, it cannot be \
             skipped"
        );
    }
    panic!(
        "{what} needs root (euid is {euid}): it loads eBPF programs and creates network \
         namespaces; run it as root (e.g. `sudo env PATH=\"$PATH\" cargo xtask test`)"
    );
}

/// Moves this thread (and the commands it starts from now on) to a fresh network namespace
/// and runs `setup` there (`ip ...`, `sysctl ...`), for fixtures whose datapath asks the
/// kernel's FIB: their test runs see this namespace's routes and neighbours. Panics on any
/// failure. Needs root.
pub fn enter_fresh_netns(setup: &[&[&str]]) {
    // SAFETY: unshare has no memory-safety preconditions.
    let rc = unsafe { libc::unshare(libc::CLONE_NEWNET) };
    assert_eq!(
        rc,
        0,
        "unshare(CLONE_NEWNET): {}",
        std::io::Error::last_os_error()
    );
    run_commands(setup);
}

/// Points the neighbour entry of `addr` (IPv4 or IPv6) on `dev` at MAC 02:00:00:00:01:`last`
/// (permanent): a next hop that moved, with no route change. Returns that MAC.
pub fn move_neighbour(addr: &str, dev: &str, last: u8) -> [u8; 6] {
    let mac = format!("02:00:00:00:01:{last:02x}");
    run_commands(&[&[
        "ip",
        "neigh",
        "replace",
        addr,
        "lladdr",
        &mac,
        "dev",
        dev,
        "nud",
        "permanent",
    ]]);
    [0x02, 0, 0, 0, 1, last]
}

/// Runs each command (in this thread's namespace); panics on any failure.
pub fn run_commands(cmds: &[&[&str]]) {
    for cmd in cmds {
        let out = std::process::Command::new(cmd[0])
            .args(&cmd[1..])
            .output()
            .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
        assert!(
            out.status.success(),
            "{cmd:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
