//! TC programs attached through netlink, for kernels without TCX links (before Linux 6.6): a
//! clsact qdisc and one cls_bpf filter (direct action) per hook, at a fixed priority and
//! handle of fastpath's own, so that the daemon finds its filters again after a restart and
//! never touches another program's filters on the same qdisc.
//!
//! A netlink filter is no file descriptor: it stays in the kernel until deleted, with or
//! without a daemon (as a pinned link does). What stands for it under the pin directory is a
//! marker, `tc/<iface>@<hook>`: the program the filter runs, pinned. It says that the filter
//! exists (a restart replaces its program instead of creating it anew), and `fastpath
//! detach` and a clean stop find through it which filters to delete. Invariant: the marker
//! pins the program the filter runs (re-pinned on every replacement), so it keeps no older
//! program, and with it older maps, alive.

use std::{io, path::Path};

use aya::programs::{
    ProgramError, SchedClassifier, TcAttach, TcAttachType, TcError,
    links::Link as _,
    tc::{NlOptions, SchedClassifierLink, TcHandle, qdisc_add_clsact},
};

use super::{DatapathError, HookKind};

/// The priority of fastpath's filters (lower runs first). One no other tool is likely to
/// use: a filter of another kind at the same priority would make the kernel refuse ours.
pub const PRIORITY: u16 = 0xfa;
/// The handle of fastpath's filter at [`PRIORITY`].
pub const HANDLE: TcHandle = TcHandle::new(0, 0xfa57);

fn attach_type(hook: HookKind) -> TcAttachType {
    match hook {
        HookKind::TcEgress => TcAttachType::Egress,
        _ => TcAttachType::Ingress,
    }
}

fn errno(e: &ProgramError) -> Option<i32> {
    match e {
        ProgramError::TcError(TcError::NetlinkError(n)) | ProgramError::NetlinkError(n) => {
            n.raw_os_error()
        }
        ProgramError::SyscallError(aya::sys::SyscallError { io_error, .. }) => {
            io_error.raw_os_error()
        }
        _ => None,
    }
}

/// Our filter at `hook` of interface `ifindex`, as aya names an existing filter.
fn ours(ifindex: u32, hook: HookKind) -> io::Result<SchedClassifierLink> {
    SchedClassifierLink::attached(ifindex, attach_type(hook).into(), PRIORITY, HANDLE, None)
}

/// Attaches `prog` as our filter at `hook` of `iface` (adding the clsact qdisc if the
/// interface has none). A filter of ours already there (its marker lost) gets the program
/// instead.
pub fn attach(
    prog: &mut SchedClassifier,
    iface: &str,
    ifindex: u32,
    hook: HookKind,
) -> Result<(), DatapathError> {
    let what = |verb: &str| {
        format!(
            "{verb} {iface}'s netlink TC filter ({} priority {PRIORITY}, handle 0:{:x})",
            hook.name(),
            u32::from(HANDLE)
        )
    };
    if let Err(e) = qdisc_add_clsact(ifindex) {
        // EEXIST: the interface has its clsact qdisc already (ours from before, or another
        // tool's, which our filter joins).
        let exists =
            matches!(&e, TcError::NetlinkError(n) if n.raw_os_error() == Some(libc::EEXIST));
        if !exists {
            return Err(DatapathError::Program {
                what: format!("adding a clsact qdisc to {iface}"),
                source: ProgramError::TcError(e),
            });
        }
    }
    let attached = prog.attach(
        ifindex,
        TcAttach::Netlink {
            parent: attach_type(hook).into(),
            options: NlOptions {
                priority: PRIORITY,
                handle: HANDLE,
                classid: None,
            },
        },
    );
    let id = match attached {
        Ok(id) => id,
        Err(e) if errno(&e) == Some(libc::EEXIST) => return replace(prog, iface, ifindex, hook),
        Err(source) => {
            return Err(DatapathError::Program {
                what: what("creating"),
                source,
            });
        }
    };
    keep(prog, id, &what("keeping"))
}

/// Replaces the program of our filter at `hook` of `ifindex` atomically (cls_bpf swaps the
/// program of an existing filter in place: no packet sees a gap). `Err` with ENOENT or
/// ENODEV inside: the filter or the interface is gone.
pub fn replace(
    prog: &mut SchedClassifier,
    iface: &str,
    ifindex: u32,
    hook: HookKind,
) -> Result<(), DatapathError> {
    let what = format!(
        "replacing the program of {iface}'s netlink TC filter ({})",
        hook.name()
    );
    let link = ours(ifindex, hook).map_err(|source| DatapathError::Io {
        what: what.clone(),
        source,
    })?;
    let id = prog
        .attach_to_link(link)
        .map_err(|source| DatapathError::Program {
            what: what.clone(),
            source,
        })?;
    keep(prog, id, &what)
}

/// Takes the filter out of aya's hands without deleting it: aya deletes the filters of a
/// program's links when they, or the program, are dropped; ours outlive the daemon.
fn keep(
    prog: &mut SchedClassifier,
    id: aya::programs::tc::SchedClassifierLinkId,
    what: &str,
) -> Result<(), DatapathError> {
    let link = prog
        .take_link(id)
        .map_err(|source| DatapathError::Program {
            what: what.to_owned(),
            source,
        })?;
    // A netlink link is the filter's numbers only (no fd, no memory of its own to free).
    std::mem::forget(link);
    Ok(())
}

/// Deletes our filter at `hook` of interface `iface` (by name, as the marker names it). A
/// filter or interface already gone is not an error: what is wanted is that none is left.
pub fn delete(iface: &str, hook: HookKind) -> Result<(), DatapathError> {
    let Some(ifindex) = crate::sys::ifindex(iface) else {
        return Ok(());
    };
    let link = ours(ifindex, hook).map_err(|source| DatapathError::Io {
        what: format!("naming {iface}'s netlink TC filter"),
        source,
    })?;
    match link.detach() {
        Ok(()) => Ok(()),
        Err(e) if matches!(errno(&e), Some(libc::ENOENT | libc::ENODEV | libc::EINVAL)) => Ok(()),
        Err(source) => Err(DatapathError::Program {
            what: format!(
                "deleting {iface}'s netlink TC filter ({} priority {PRIORITY})",
                hook.name()
            ),
            source,
        }),
    }
}

/// Whether `e` (from [`replace`]) says the filter or its interface is gone.
pub fn is_gone(e: &DatapathError) -> bool {
    matches!(e, DatapathError::Program { source, .. }
        if matches!(errno(source), Some(libc::ENOENT | libc::ENODEV)))
}

/// Pins `prog` at `marker` (replacing an older marker).
pub fn pin_marker(prog: &SchedClassifier, marker: &Path) -> Result<(), DatapathError> {
    super::remove_pin(marker)?;
    let fd = prog.fd().map_err(|source| DatapathError::Program {
        what: "reading the TC program's fd".into(),
        source,
    })?;
    crate::sys::obj_pin(std::os::fd::AsFd::as_fd(fd), marker).map_err(|source| DatapathError::Pin {
        path: marker.to_owned(),
        source: aya::pin::PinError::SyscallError(aya::sys::SyscallError {
            call: "BPF_OBJ_PIN",
            io_error: source,
        }),
    })
}
