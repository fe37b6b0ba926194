//! Table-driven datapath fixtures: each [`Case`] runs through the real entry point of one hook
//! with BPF_PROG_TEST_RUN, and its verdict, output bytes and counter deltas are compared with
//! what the case states. The same tables drive the benchmarks ([`Fixture::run_repeat`]).
//!
//! Contract: a [`Fixture`] loads its own copy of the datapath object with its own, empty maps
//! (pinned in a private directory that is removed on drop), so fixtures never see each other's
//! or a running daemon's state. Needs root (CAP_BPF + CAP_NET_ADMIN, and CAP_SYS_ADMIN to mount
//! a bpffs when `/sys/fs/bpf` is not one).

use std::{
    ffi::CString,
    fmt::Write as _,
    os::unix::ffi::OsStrExt as _,
    path::{Path, PathBuf},
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, PerCpuArray},
    programs::{ProgramError, SchedClassifier, TestRun, TestRunOptions, TestRunResult, Xdp},
};
use fastpath_common::{
    Counter, DatapathConfig, Hook, Verdict, map_names, program_names,
    stats::CONFIG_F_DROP_MALFORMED,
};

use crate::{
    datapath::{is_bpffs, mount_bpffs},
    stats::{StatsError, StatsSnapshot},
};

/// Raw XDP return codes (`enum xdp_action`).
pub const XDP_ABORTED: u32 = 0;
pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;
pub const XDP_TX: u32 = 3;
pub const XDP_REDIRECT: u32 = 4;
/// Raw TC return codes (`TC_ACT_*`).
pub const TC_ACT_OK: u32 = 0;
/// TC_ACT_UNSPEC (-1) as the u32 BPF_PROG_TEST_RUN reports: in TCX this is TCX_NEXT, "let the
/// next program and then the stack decide" — what the datapath returns for the kernel verdict.
pub const TC_ACT_UNSPEC: u32 = u32::MAX;
pub const TC_ACT_SHOT: u32 = 2;
pub const TC_ACT_REDIRECT: u32 = 7;

/// The kernel refuses BPF_PROG_TEST_RUN input shorter than an Ethernet header.
pub const MIN_INPUT_LEN: usize = 14;
/// Room beyond the input in the output buffer, so a program that grows the packet (encap) is
/// not cut short: the kernel fails the run with ENOSPC when `data_out` is too small.
const OUTPUT_SLACK: usize = 512;

/// What the entry point of `hook` returns for `verdict` today (no stage forwards yet, so a
/// forward verdict would be handed to the kernel).
pub const fn raw_verdict(hook: Hook, verdict: Verdict) -> u32 {
    match (hook, verdict) {
        (Hook::Xdp, Verdict::Drop) => XDP_DROP,
        (Hook::Xdp, Verdict::Kernel | Verdict::Forward) => XDP_PASS,
        (Hook::TcIngress | Hook::TcEgress, Verdict::Drop) => TC_ACT_SHOT,
        (Hook::TcIngress | Hook::TcEgress, Verdict::Kernel) => TC_ACT_UNSPEC,
        (Hook::TcIngress | Hook::TcEgress, Verdict::Forward) => TC_ACT_OK,
    }
}

/// The map state a case runs against. Applied before every run, and every field is written
/// in full, so a case never inherits the previous case's state. Later stages add their maps
/// here (routes, conntrack entries, ...), each with a default of "empty".
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Seed {
    /// Written to `FP_CONFIG[0]`.
    pub config: DatapathConfig,
}

impl Seed {
    /// The default configuration with these `CONFIG_F_*` flags.
    pub fn flags(flags: u32) -> Self {
        Seed {
            config: DatapathConfig {
                flags,
                ..DatapathConfig::default()
            },
        }
    }

    /// `drop_malformed` on.
    pub fn drop_malformed() -> Self {
        Seed::flags(CONFIG_F_DROP_MALFORMED)
    }

    fn apply(&self, ebpf: &mut Ebpf) -> Result<(), FixtureError> {
        let map = ebpf
            .map_mut(map_names::CONFIG)
            .ok_or(FixtureError::MissingMap {
                name: map_names::CONFIG,
            })?;
        let mut config: Array<_, DatapathConfig> =
            Array::try_from(map).map_err(|source| FixtureError::Map {
                name: map_names::CONFIG,
                source,
            })?;
        config
            .set(0, &self.config, 0)
            .map_err(|source| FixtureError::Map {
                name: map_names::CONFIG,
                source,
            })
    }
}

/// One expected counter change: `packets` and `bytes` added to (hook, verdict, reason).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CounterDelta {
    pub hook: Hook,
    pub verdict: Verdict,
    /// A `fastpath_common::reason` code.
    pub reason: u32,
    pub packets: u64,
    pub bytes: u64,
}

impl CounterDelta {
    pub const fn new(hook: Hook, verdict: Verdict, reason: u32, packets: u64, bytes: u64) -> Self {
        CounterDelta {
            hook,
            verdict,
            reason,
            packets,
            bytes,
        }
    }
}

/// One row of a fixture table.
#[derive(Clone, Debug)]
pub struct Case {
    /// Unique, says what the case is about (`xdp_qinq_ipv6_udp`).
    pub name: String,
    /// Which entry point runs the input.
    pub hook: Hook,
    pub seed: Seed,
    /// The frame, from the destination MAC on (at least [`MIN_INPUT_LEN`] bytes).
    pub input: Vec<u8>,
    /// The program's raw return value (`XDP_PASS`, `TC_ACT_SHOT`, ...).
    pub expect_verdict: u32,
    /// The frame after the program; `None` = the input, unchanged.
    pub expect_output: Option<Vec<u8>>,
    /// Every counter that must change, and by how much; any other change is a failure.
    pub expect_counters: Vec<CounterDelta>,
}

/// What one run produced.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// The program's raw return value.
    pub verdict: u32,
    /// The frame after the program.
    pub output: Vec<u8>,
    /// Counter changes caused by the run.
    pub counters: StatsSnapshot,
    /// The kernel's measurement of the run.
    pub duration: Duration,
}

/// Result of [`Fixture::run_repeat`].
#[derive(Clone, Copy, Debug)]
pub struct RepeatRun {
    /// The raw return value of the last run.
    pub verdict: u32,
    /// Mean time of one run, as measured by the kernel (it divides by `repeat` itself).
    pub per_run: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum FixtureError {
    #[error(
        "creating the private bpffs pin directory {path}: {source}; fixtures need root \
         (run the tests with sudo or as root)"
    )]
    PinDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("loading the datapath object: {source}; fixtures need root (CAP_BPF, CAP_NET_ADMIN)")]
    Load {
        #[source]
        source: aya::EbpfError,
    },
    #[error("the datapath object has no program `{name}`; was fastpath-ebpf rebuilt?")]
    MissingProgram { name: &'static str },
    #[error("program `{name}`: {source}")]
    Program {
        name: &'static str,
        #[source]
        source: ProgramError,
    },
    #[error("the datapath object has no map `{name}`; was fastpath-ebpf rebuilt?")]
    MissingMap { name: &'static str },
    #[error("map `{name}`: {source}")]
    Map {
        name: &'static str,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("reading counters: {source}")]
    Stats {
        #[source]
        source: StatsError,
    },
    #[error("input is {len} bytes; BPF_PROG_TEST_RUN needs at least {MIN_INPUT_LEN}")]
    InputTooShort { len: usize },
}

/// Why a case did not pass: it could not run, or it ran and something differed.
#[derive(Debug, thiserror::Error)]
pub enum CaseFailure {
    #[error("case `{case}` could not run: {source}")]
    Run {
        case: String,
        // Boxed: aya's errors are large and failures are rare.
        #[source]
        source: Box<FixtureError>,
    },
    #[error("case `{case}` ({hook}):\n{details}")]
    Mismatch {
        case: String,
        hook: &'static str,
        details: String,
    },
}

/// The datapath object loaded once, with private maps, ready to run cases on any hook.
pub struct Fixture {
    // Declared before `pins` so the program and map fds are closed before the pins go.
    ebpf: Ebpf,
    pins: PinDir,
}

impl Fixture {
    /// Loads [`crate::EBPF_OBJECT`] with fresh maps and loads (verifies) all three programs.
    pub fn new() -> Result<Self, FixtureError> {
        let pins = PinDir::create()?;
        let mut ebpf = EbpfLoader::new()
            .default_map_pin_directory(&pins.path)
            .load(crate::EBPF_OBJECT)
            .map_err(|source| FixtureError::Load { source })?;
        for name in [program_names::XDP, program_names::BENCH_FLOOR_XDP] {
            let xdp: &mut Xdp = program_mut(&mut ebpf, name)?;
            xdp.load()
                .map_err(|source| FixtureError::Program { name, source })?;
        }
        for name in [
            program_names::TC_INGRESS,
            program_names::TC_EGRESS,
            program_names::BENCH_FLOOR_TC,
        ] {
            let tc: &mut SchedClassifier = program_mut(&mut ebpf, name)?;
            tc.load()
                .map_err(|source| FixtureError::Program { name, source })?;
        }
        Ok(Fixture { ebpf, pins })
    }

    /// Where this fixture's maps are pinned (removed on drop).
    pub fn pin_dir(&self) -> &Path {
        &self.pins.path
    }

    /// Seeds the maps, runs the case's input once through its hook, and reports what happened.
    pub fn run(&mut self, case: &Case) -> Result<Outcome, FixtureError> {
        check_input(case)?;
        case.seed.apply(&mut self.ebpf)?;
        let before = self.stats()?;
        let mut out = vec![0u8; case.input.len() + OUTPUT_SLACK];
        let res = self.test_run(case.hook, &case.input, &mut out, 1)?;
        let after = self.stats()?;
        out.truncate(res.data_size_out as usize);
        Ok(Outcome {
            verdict: res.return_value,
            output: out,
            counters: after.delta(&before),
            duration: res.duration,
        })
    }

    /// Seeds the maps and runs the case's input `repeat` times in the kernel: for benchmarks.
    /// Counters grow by `repeat` packets; nothing is compared.
    pub fn run_repeat(&mut self, case: &Case, repeat: u32) -> Result<RepeatRun, FixtureError> {
        check_input(case)?;
        case.seed.apply(&mut self.ebpf)?;
        let mut out = vec![0u8; case.input.len() + OUTPUT_SLACK];
        let res = self.test_run(case.hook, &case.input, &mut out, repeat.max(1))?;
        Ok(RepeatRun {
            verdict: res.return_value,
            per_run: res.duration,
        })
    }

    /// Runs `input` `repeat` times through the empty program of `hook`'s kind: the benchmark
    /// floor (program dispatch and BPF_PROG_TEST_RUN overhead, no datapath work).
    pub fn run_floor_repeat(
        &mut self,
        hook: Hook,
        input: &[u8],
        repeat: u32,
    ) -> Result<RepeatRun, FixtureError> {
        let name = match hook {
            Hook::Xdp => program_names::BENCH_FLOOR_XDP,
            Hook::TcIngress | Hook::TcEgress => program_names::BENCH_FLOOR_TC,
        };
        let mut out = vec![0u8; input.len() + OUTPUT_SLACK];
        let res = self.test_run_program(name, hook, input, &mut out, repeat.max(1))?;
        Ok(RepeatRun {
            verdict: res.return_value,
            per_run: res.duration,
        })
    }

    /// Runs the case and compares everything it states; `Err` says what differed.
    pub fn evaluate(&mut self, case: &Case) -> Result<(), CaseFailure> {
        let outcome = self.run(case).map_err(|source| CaseFailure::Run {
            case: case.name.clone(),
            source: Box::new(source),
        })?;
        let details = mismatches(case, &outcome);
        if details.is_empty() {
            Ok(())
        } else {
            Err(CaseFailure::Mismatch {
                case: case.name.clone(),
                hook: case.hook.name(),
                details,
            })
        }
    }

    /// Runs the case and panics with expected vs got (and a hexdump diff) on any mismatch.
    pub fn check(&mut self, case: &Case) {
        if let Err(failure) = self.evaluate(case) {
            panic!("{failure}");
        }
    }

    /// The stats map summed over CPUs.
    pub fn stats(&self) -> Result<StatsSnapshot, FixtureError> {
        let map = self
            .ebpf
            .map(map_names::STATS)
            .ok_or(FixtureError::MissingMap {
                name: map_names::STATS,
            })?;
        let stats: PerCpuArray<_, Counter> =
            PerCpuArray::try_from(map).map_err(|source| FixtureError::Map {
                name: map_names::STATS,
                source,
            })?;
        StatsSnapshot::read(&stats).map_err(|source| FixtureError::Stats { source })
    }

    fn test_run(
        &self,
        hook: Hook,
        input: &[u8],
        out: &mut [u8],
        repeat: u32,
    ) -> Result<TestRunResult, FixtureError> {
        self.test_run_program(program_name(hook), hook, input, out, repeat)
    }

    /// Runs program `name`, of `hook`'s kind, on `input`.
    fn test_run_program(
        &self,
        name: &'static str,
        hook: Hook,
        input: &[u8],
        out: &mut [u8],
        repeat: u32,
    ) -> Result<TestRunResult, FixtureError> {
        let opts = TestRunOptions {
            data_in: Some(input),
            data_out: Some(out),
            repeat,
            ..Default::default()
        };
        let prog = self
            .ebpf
            .program(name)
            .ok_or(FixtureError::MissingProgram { name })?;
        let result = match hook {
            Hook::Xdp => {
                let xdp: &Xdp = prog
                    .try_into()
                    .map_err(|source| FixtureError::Program { name, source })?;
                xdp.test_run(opts)
            }
            Hook::TcIngress | Hook::TcEgress => {
                let tc: &SchedClassifier = prog
                    .try_into()
                    .map_err(|source| FixtureError::Program { name, source })?;
                tc.test_run(opts)
            }
        };
        result.map_err(|source| FixtureError::Program { name, source })
    }
}

fn program_name(hook: Hook) -> &'static str {
    match hook {
        Hook::Xdp => program_names::XDP,
        Hook::TcIngress => program_names::TC_INGRESS,
        Hook::TcEgress => program_names::TC_EGRESS,
    }
}

fn program_mut<'a, T>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut T, FixtureError>
where
    &'a mut T: TryFrom<&'a mut aya::programs::Program, Error = ProgramError>,
{
    let prog = ebpf
        .program_mut(name)
        .ok_or(FixtureError::MissingProgram { name })?;
    prog.try_into()
        .map_err(|source| FixtureError::Program { name, source })
}

fn check_input(case: &Case) -> Result<(), FixtureError> {
    if case.input.len() < MIN_INPUT_LEN {
        return Err(FixtureError::InputTooShort {
            len: case.input.len(),
        });
    }
    Ok(())
}

/// Every difference between what `case` states and what `got` shows, one paragraph each;
/// empty when the case passed.
pub fn mismatches(case: &Case, got: &Outcome) -> String {
    let mut out = String::new();
    if got.verdict != case.expect_verdict {
        let _ = writeln!(
            out,
            "  verdict: expected {} got {}",
            verdict_name(case.hook, case.expect_verdict),
            verdict_name(case.hook, got.verdict)
        );
    }
    let want_output = case.expect_output.as_ref().unwrap_or(&case.input);
    if &got.output != want_output {
        let _ = writeln!(
            out,
            "  output: expected {} bytes got {} bytes ('!' marks differing lines)\n{}",
            want_output.len(),
            got.output.len(),
            hexdump_diff(want_output, &got.output)
        );
    }
    let want_counters = expected_snapshot(&case.expect_counters);
    if got.counters != want_counters {
        let _ = writeln!(
            out,
            "  counters: expected\n{}  got\n{}",
            indent(&counter_lines(&want_counters)),
            indent(&counter_lines(&got.counters))
        );
    }
    out
}

fn expected_snapshot(deltas: &[CounterDelta]) -> StatsSnapshot {
    let mut snap = StatsSnapshot::default();
    for d in deltas {
        let c = snap
            .slots
            .entry((d.hook as u32, d.verdict as u32, d.reason))
            .or_default();
        c.packets += d.packets;
        c.bytes += d.bytes;
    }
    snap.slots.retain(|_, c| c.packets != 0 || c.bytes != 0);
    snap
}

fn counter_lines(snap: &StatsSnapshot) -> String {
    if snap.slots.is_empty() {
        return "(no counter changed)\n".to_owned();
    }
    let mut out = String::new();
    for r in snap.rows() {
        let _ = writeln!(
            out,
            "{}/{}/{}: {} packets, {} bytes",
            r.hook, r.verdict, r.reason, r.packets, r.bytes
        );
    }
    out
}

fn indent(text: &str) -> String {
    text.lines().map(|l| format!("    {l}\n")).collect()
}

/// `XDP_PASS (2)` style name of a raw return value.
pub fn verdict_name(hook: Hook, raw: u32) -> String {
    let name = match (hook, raw) {
        (Hook::Xdp, XDP_ABORTED) => "XDP_ABORTED",
        (Hook::Xdp, XDP_DROP) => "XDP_DROP",
        (Hook::Xdp, XDP_PASS) => "XDP_PASS",
        (Hook::Xdp, XDP_TX) => "XDP_TX",
        (Hook::Xdp, XDP_REDIRECT) => "XDP_REDIRECT",
        (_, TC_ACT_OK) => "TC_ACT_OK",
        (_, TC_ACT_UNSPEC) => "TC_ACT_UNSPEC",
        (_, TC_ACT_SHOT) => "TC_ACT_SHOT",
        (_, TC_ACT_REDIRECT) => "TC_ACT_REDIRECT",
        _ => "unknown",
    };
    format!("{name} ({raw})")
}

/// Side-by-side hexdump of two byte strings, 16 bytes a line; lines that differ start with
/// `!`, and bytes missing on one side show as `--`.
pub fn hexdump_diff(expected: &[u8], got: &[u8]) -> String {
    let mut out = String::new();
    let lines = expected.len().max(got.len()).div_ceil(16);
    let _ = writeln!(out, "         {:<48}  got", "expected");
    for line in 0..lines {
        // The last line stops at the longer input; the shorter one shows `--` for its gap.
        let range = line * 16..((line + 1) * 16).min(expected.len().max(got.len()));
        let e = hex_line(expected, range.clone());
        let g = hex_line(got, range.clone());
        let mark = if e == g { ' ' } else { '!' };
        let _ = writeln!(out, "{mark} {:04x}:  {e:<48}  {g}", range.start);
    }
    out
}

fn hex_line(bytes: &[u8], range: std::ops::Range<usize>) -> String {
    range
        .map(|i| {
            bytes
                .get(i)
                .map_or_else(|| "--".to_owned(), |b| format!("{b:02x}"))
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// A directory on a bpffs that only this fixture uses: a fresh subdirectory of `/sys/fs/bpf`
/// when that is a bpffs, else a private bpffs instance mounted on a fresh temporary directory
/// (so the host's `/sys/fs/bpf` is never mounted over by a test). The name is unique per
/// process, fixture and time, and the directory is created with `create_dir` (not `_all`), so
/// stale pins of a crashed run can never be picked up.
struct PinDir {
    path: PathBuf,
    /// We mounted a bpffs on `path` and must unmount it.
    mounted: bool,
}

impl PinDir {
    fn create() -> Result<Self, FixtureError> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let unique = format!(
            "fastpath-fixture-{}-{}-{nanos}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let sys = Path::new("/sys/fs/bpf");
        if is_bpffs(sys) {
            let path = sys.join(unique);
            std::fs::create_dir(&path).map_err(|source| FixtureError::PinDir {
                path: path.clone(),
                source,
            })?;
            return Ok(PinDir {
                path,
                mounted: false,
            });
        }
        let path = std::env::temp_dir().join(unique);
        std::fs::create_dir(&path).map_err(|source| FixtureError::PinDir {
            path: path.clone(),
            source,
        })?;
        // Owned before mounting, so a failed mount still removes the directory.
        let mut dir = PinDir {
            path,
            mounted: false,
        };
        mount_bpffs(&dir.path).map_err(|source| FixtureError::PinDir {
            path: dir.path.clone(),
            source,
        })?;
        dir.mounted = true;
        Ok(dir)
    }
}

impl Drop for PinDir {
    fn drop(&mut self) {
        if self.mounted {
            // Unmounting a private bpffs instance drops every pin in it at once.
            if let Err(e) = umount(&self.path) {
                eprintln!("fixture: unmounting bpffs at {}: {e}", self.path.display());
                return;
            }
        } else if let Ok(entries) = std::fs::read_dir(&self.path) {
            for entry in entries.flatten() {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        if let Err(e) = std::fs::remove_dir(&self.path) {
            eprintln!(
                "fixture: removing pin directory {}: {e}",
                self.path.display()
            );
        }
    }
}

fn c_path(path: &Path) -> std::io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))
}

fn umount(path: &Path) -> std::io::Result<()> {
    let target = c_path(path)?;
    // SAFETY: `target` is a NUL-terminated path that outlives the call.
    let rc = unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hexdump_marks_only_differing_lines() {
        let a: Vec<u8> = (0..20).collect();
        let mut b = a.clone();
        b[17] = 0xff;
        b.pop();
        let d = hexdump_diff(&a, &b);
        let lines: Vec<&str> = d.lines().collect();
        assert_eq!(lines.len(), 3, "{d}");
        assert!(lines[1].starts_with("  0000:"), "{d}");
        assert!(lines[2].starts_with("! 0010:"), "{d}");
        assert!(lines[2].contains("10 ff 12 --"), "{d}");
    }

    #[test]
    fn raw_verdicts_per_hook() {
        assert_eq!(raw_verdict(Hook::Xdp, Verdict::Kernel), XDP_PASS);
        assert_eq!(raw_verdict(Hook::Xdp, Verdict::Drop), XDP_DROP);
        assert_eq!(raw_verdict(Hook::TcIngress, Verdict::Kernel), TC_ACT_UNSPEC);
        assert_eq!(raw_verdict(Hook::TcEgress, Verdict::Drop), TC_ACT_SHOT);
    }
}
