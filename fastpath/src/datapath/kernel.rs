//! What this kernel offers the datapath (`fastpath kernel`): the features probed at start,
//! and every program of the object loaded — verified, not attached — with the verifier's
//! instruction count or its refusal.

use aya::{EbpfLoader, programs::Program};
use fastpath_common::map_names;
use serde::Serialize;

use super::DatapathError;
use crate::sys;

/// Lines of a refusal's verifier log kept: the last ones say what it refused and where.
const LOG_TAIL_LINES: usize = 24;
/// Conntrack table size for the check: verification does not depend on it, memory does.
const CHECK_CT_CAPACITY: u32 = 1024;

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
    let features = vec![Feature {
        name: "TCX links",
        since: "6.6",
        present: super::tcx_links()?,
        without: "TC programs attach through netlink (clsact qdisc, cls_bpf filters)",
    }];
    let pins = sys::ScratchPinDir::create("kernel-check")
        .map_err(|(path, source)| DatapathError::PinDir { path, source })?;
    let mut ebpf = EbpfLoader::new()
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
        features,
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

fn release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map_or_else(|_| "unknown".into(), |s| s.trim().to_owned())
}
