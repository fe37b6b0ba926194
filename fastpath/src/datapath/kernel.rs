//! What this kernel offers the datapath (`fastpath kernel`): the features probed at start,
//! and every program of the object loaded — verified, not attached — with the verifier's
//! instruction count or its refusal.

use aya::{EbpfLoader, programs::Program};
use fastpath_common::{global_names, map_names};
use serde::Serialize;

use super::DatapathError;
use crate::{
    config::{Scheduler, ServiceConfig},
    sys,
};

/// Lines of a refusal's verifier log kept: the last ones say what it refused and where.
const LOG_TAIL_LINES: usize = 24;
/// Conntrack table size for the check: verification does not depend on it, memory does.
const CHECK_CT_CAPACITY: u32 = 1024;

/// What the kernel offers the datapath that not every supported kernel has, probed once at
/// start ([`KernelFeatures::probe`]); the loader, the checks of services and `fastpath
/// kernel`/`fastpath info` all take it from there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelFeatures {
    /// TCX links (Linux 6.6); without them TC programs attach through netlink.
    pub tcx_links: bool,
    /// The `bpf_loop` helper (Linux 5.17); without it there is no least-connections scheduler.
    pub bpf_loop: bool,
}

impl Default for KernelFeatures {
    fn default() -> KernelFeatures {
        KernelFeatures::ALL
    }
}

/// `1` and `0` as the object's `u8` globals, borrowed for as long as a loader may need.
const GLOBAL_ON: u8 = 1;
const GLOBAL_OFF: u8 = 0;

impl KernelFeatures {
    /// Everything: what tests of the daemon's logic run with.
    pub const ALL: KernelFeatures = KernelFeatures {
        tcx_links: true,
        bpf_loop: true,
    };

    /// Probes this kernel, each feature with a small program of our own (see
    /// [`sys::tcx_supported`], [`sys::helper_supported`]).
    pub fn probe() -> Result<KernelFeatures, DatapathError> {
        let probe_error = |what: &str| {
            let what = what.to_owned();
            move |source| DatapathError::Io {
                what: format!("probing the kernel for {what}"),
                source,
            }
        };
        Ok(KernelFeatures {
            tcx_links: sys::tcx_supported().map_err(probe_error("TCX links (BPF_LINK_CREATE)"))?,
            bpf_loop: sys::helper_supported(sys::BPF_PROG_TYPE_XDP, sys::BPF_FUNC_LOOP)
                .map_err(probe_error("the bpf_loop helper (BPF_PROG_LOAD)"))?,
        })
    }

    /// Each feature with the release that added it and what the datapath does without it.
    pub fn list(&self) -> Vec<Feature> {
        vec![
            Feature {
                name: "TCX links",
                since: "6.6",
                present: self.tcx_links,
                without: "TC programs attach through netlink (clsact qdisc, cls_bpf filters)",
            },
            Feature {
                name: "bpf_loop",
                since: "5.17",
                present: self.bpf_loop,
                without: "no least_connections scheduler: services asking for it are refused",
            },
        ]
    }

    /// Sets the object's globals ([`global_names`]) for this kernel before `loader` loads it:
    /// code for a feature the kernel lacks becomes dead to the verifier.
    pub fn configure(&self, loader: &mut EbpfLoader<'_>) {
        let flag = |on: bool| if on { &GLOBAL_ON } else { &GLOBAL_OFF };
        // Not required to exist: the benchmark and `examples/verifier.rs` load other
        // revisions' objects, and one older than the global takes no override (it calls
        // bpf_loop unconditionally, so it loads only where the kernel has it).
        loader.override_global(global_names::HAVE_BPF_LOOP, flag(self.bpf_loop), false);
    }

    /// Refuses `services` if one needs what this kernel lacks, naming the service and the
    /// feature.
    pub fn check_services(&self, services: &[ServiceConfig]) -> Result<(), DatapathError> {
        if !self.bpf_loop
            && let Some(svc) = services
                .iter()
                .find(|s| s.scheduler == Scheduler::LeastConnections)
        {
            return Err(DatapathError::NoBpfLoop {
                service: svc.id().to_string(),
            });
        }
        Ok(())
    }
}

/// A kernel feature the datapath uses that not every supported kernel has.
#[derive(Serialize)]
pub struct Feature {
    pub name: &'static str,
    /// The Linux release that added it.
    pub since: &'static str,
    pub present: bool,
    /// What the datapath does without it.
    pub without: &'static str,
}

/// One program of the datapath object, as this kernel's verifier saw it.
#[derive(Serialize)]
pub struct ProgramCheck {
    pub name: String,
    /// `xdp` or `tc`.
    pub hook: &'static str,
    /// Instructions the verifier processed (`bpf_prog_info.verified_insns`) when it accepted.
    pub verified_insns: Option<u32>,
    /// The accepted program's size after the kernel's rewrites, in instructions.
    pub xlated_insns: Option<u32>,
    /// Why it was refused: the error and the end of the verifier's log.
    pub refused: Option<String>,
}

#[derive(Serialize)]
pub struct KernelReport {
    /// `uname -r`.
    pub release: String,
    pub features: Vec<Feature>,
    pub programs: Vec<ProgramCheck>,
}

impl KernelReport {
    pub fn all_loaded(&self) -> bool {
        self.programs.iter().all(|p| p.refused.is_none())
    }
}

/// Probes the features and loads every program of `object` with its maps in a scratch pin
/// directory (removed on return). Errors only where the check itself cannot run (no bpffs,
/// no privileges, an object this build cannot parse); a refused program is a result.
/// `full_log`: keep a refusal's whole verifier log, not only its end.
pub fn check(object: &[u8], full_log: bool) -> Result<KernelReport, DatapathError> {
    let kernel = KernelFeatures::probe()?;
    let pins = sys::ScratchPinDir::create("kernel-check")
        .map_err(|(path, source)| DatapathError::PinDir { path, source })?;
    let mut loader = EbpfLoader::new();
    kernel.configure(&mut loader);
    let mut ebpf = loader
        .default_map_pin_directory(pins.path())
        .map_max_entries(map_names::CT, CHECK_CT_CAPACITY)
        .map_max_entries(map_names::CT_NEW, CHECK_CT_CAPACITY)
        .load(object)
        .map_err(|source| DatapathError::Load {
            pin_dir: pins.path().display().to_string(),
            source: Box::new(source),
        })?;
    let mut programs: Vec<ProgramCheck> = ebpf
        .programs_mut()
        .map(|(name, program)| {
            let (hook, loaded) = match program {
                Program::Xdp(p) => ("xdp", p.load().and_then(|()| p.info())),
                Program::SchedClassifier(p) => ("tc", p.load().and_then(|()| p.info())),
                _ => ("other", Err(aya::programs::ProgramError::NotLoaded)),
            };
            let mut check = ProgramCheck {
                name: name.to_owned(),
                hook,
                verified_insns: None,
                xlated_insns: None,
                refused: None,
            };
            match loaded {
                Ok(info) => {
                    check.verified_insns = info.verified_instruction_count();
                    check.xlated_insns = info.size_translated().map(|bytes| bytes / 8);
                }
                Err(e) => check.refused = Some(refusal(&e, full_log)),
            }
            check
        })
        .collect();
    programs.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(KernelReport {
        release: release(),
        features: kernel.list(),
        programs,
    })
}

/// The error, and for a verifier refusal the last lines of its log.
fn refusal(e: &aya::programs::ProgramError, full_log: bool) -> String {
    match e {
        aya::programs::ProgramError::LoadError {
            io_error,
            verifier_log,
        } => {
            let log = verifier_log.to_string();
            let lines: Vec<&str> = log.lines().collect();
            let keep = if full_log {
                lines.len()
            } else {
                LOG_TAIL_LINES
            };
            let tail = lines[lines.len().saturating_sub(keep)..].join("\n");
            format!("BPF_PROG_LOAD: {io_error}; the verifier's log ends:\n{tail}")
        }
        other => other.to_string(),
    }
}

pub fn release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map_or_else(|_| "unknown".into(), |s| s.trim().to_owned())
}

/// The probes on this kernel: root only (see `ha::kernel_tests`).
#[cfg(test)]
mod kernel_tests {
    use super::*;
    use crate::testkit::{kernel_at_least, require_root};

    /// Each probe agrees with the release that added its feature; a helper id no kernel has
    /// is reported missing, not an error.
    #[test]
    fn probes_agree_with_the_kernel_release() {
        require_root("probing the kernel (BPF_PROG_LOAD)");
        let k = KernelFeatures::probe().unwrap_or_else(|e| panic!("probing: {e}"));
        assert_eq!(
            k.tcx_links,
            kernel_at_least(6, 6),
            "TCX links on Linux {}",
            release()
        );
        assert_eq!(
            k.bpf_loop,
            kernel_at_least(5, 17),
            "bpf_loop on Linux {}",
            release()
        );
        let unknown = sys::helper_supported(sys::BPF_PROG_TYPE_XDP, 100_000)
            .unwrap_or_else(|e| panic!("probing helper 100000: {e}"));
        assert!(!unknown, "helper 100000 reported present");
        let ktime = sys::helper_supported(sys::BPF_PROG_TYPE_XDP, 5)
            .unwrap_or_else(|e| panic!("probing bpf_ktime_get_ns: {e}"));
        assert!(
            ktime,
            "bpf_ktime_get_ns (helper 5, Linux 4.1) reported missing"
        );
    }
}
