//! The only module that loads, attaches and pins the datapath.
//!
//! Layout under the pin directory (on a bpffs):
//!   maps/FP_STATS, maps/FP_CONFIG   — reused on restart, so counters and state survive;
//!   links/<iface>@<hook>             — bpf_links; while pinned, the program stays attached
//!                                      with or without a daemon (restart, crash, upgrade).
//! On restart a pinned link is kept and its program swapped atomically (bpf_link_update):
//! traffic never sees a moment without a program.

use std::{
    collections::BTreeSet,
    ffi::CString,
    fs, io,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, MapData, PerCpuArray},
    programs::{
        LinkOrder, ProgramError, SchedClassifier, TcAttach, TcAttachType, Xdp,
        XdpMode as AyaXdpMode,
        links::{FdLink, LinkError, PinnedLink},
        tc::{SchedClassifierLink, SchedClassifierLinkId},
        xdp::{XdpLink, XdpLinkId},
    },
};
use fastpath_common::{Counter, DatapathConfig, map_names, program_names};
use tracing::{info, warn};

use crate::{
    config::{InterfaceConfig, XdpMode},
    stats::{StatsError, StatsSnapshot},
};

/// bpffs superblock magic (statfs f_type).
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

#[derive(Debug, thiserror::Error)]
pub enum DatapathError {
    #[error(
        "{path} is not on a bpffs; mount one with `mount -t bpf bpf {mount_hint}` or set datapath.pin_dir to a directory on a bpffs"
    )]
    NotBpffs { path: PathBuf, mount_hint: String },
    #[error(
        "mounting bpffs on /sys/fs/bpf failed: {source}; mount it yourself with `mount -t bpf bpf /sys/fs/bpf`"
    )]
    Mount {
        #[source]
        source: io::Error,
    },
    #[error("creating pin directory {path}: {source}")]
    PinDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "loading the eBPF object: {source}; run as root (CAP_BPF, CAP_NET_ADMIN, CAP_PERFMON). If pinned maps under {pin_dir} come from an incompatible version, remove them with `fastpath detach --pin-dir {pin_dir}`"
    )]
    Load {
        pin_dir: String,
        #[source]
        source: Box<aya::EbpfError>,
    },
    #[error(
        "program {name} missing from the eBPF object (build mismatch; rebuild with `cargo xtask build`)"
    )]
    MissingProgram { name: &'static str },
    #[error(
        "map {name} missing from the eBPF object (build mismatch; rebuild with `cargo xtask build`)"
    )]
    MissingMap { name: &'static str },
    #[error("{what}: {source}")]
    Program {
        what: String,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("{what}: {source}")]
    Map {
        what: String,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("{what}: {source}")]
    Link {
        what: String,
        #[source]
        source: aya::programs::links::LinkError,
    },
    #[error("pinning {path}: {source}")]
    Pin {
        path: PathBuf,
        #[source]
        source: aya::pin::PinError,
    },
    #[error("removing pin {path}: {source}")]
    Unpin {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Stats(#[from] StatsError),
}

/// A program hook on an interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HookKind {
    Xdp,
    TcIngress,
    TcEgress,
}

impl HookKind {
    fn suffix(self) -> &'static str {
        match self {
            HookKind::Xdp => "xdp",
            HookKind::TcIngress => "tc_ingress",
            HookKind::TcEgress => "tc_egress",
        }
    }
}

/// One attachment the daemon holds.
#[derive(Debug)]
pub struct Attachment {
    pub iface: String,
    pub hook: HookKind,
    /// Human-readable mode (`native`, `generic`, `tcx`).
    pub mode: &'static str,
    /// Whether an already pinned link was reused (program swapped in place).
    pub reused: bool,
    /// Where the link is pinned.
    pub pin: PathBuf,
    _link: FdLink,
}

/// The loaded datapath: programs, pinned maps and the links this daemon holds.
pub struct Datapath {
    ebpf: Ebpf,
    pin_dir: PathBuf,
    /// Whether the maps already existed under the pin directory before this load.
    pub maps_reused: bool,
    pub attachments: Vec<Attachment>,
}

impl Datapath {
    /// Loads `object`, creating or reusing the maps pinned under `pin_dir/maps`.
    pub fn open(pin_dir: &Path, object: &[u8]) -> Result<Datapath, DatapathError> {
        ensure_bpffs(pin_dir)?;
        let maps_dir = pin_dir.join("maps");
        for dir in [maps_dir.clone(), pin_dir.join("links")] {
            fs::create_dir_all(&dir)
                .map_err(|source| DatapathError::PinDir { path: dir, source })?;
        }
        let maps_reused = maps_dir.join(map_names::STATS).exists();
        let mut ebpf = EbpfLoader::new()
            .default_map_pin_directory(&maps_dir)
            .load(object)
            .map_err(|source| DatapathError::Load {
                pin_dir: pin_dir.display().to_string(),
                source: Box::new(source),
            })?;
        for name in [program_names::TC_INGRESS, program_names::TC_EGRESS] {
            let prog: &mut SchedClassifier = program(&mut ebpf, name)?;
            prog.load().map_err(|source| DatapathError::Program {
                what: format!("loading {name}"),
                source,
            })?;
        }
        let xdp: &mut Xdp = program(&mut ebpf, program_names::XDP)?;
        xdp.load().map_err(|source| DatapathError::Program {
            what: format!("loading {}", program_names::XDP),
            source,
        })?;
        Ok(Datapath {
            ebpf,
            pin_dir: pin_dir.to_owned(),
            maps_reused,
            attachments: Vec::new(),
        })
    }

    /// Takes the aya-log ring so its records can be forwarded to tracing.
    pub fn take_logger(
        &mut self,
    ) -> Result<aya_log::EbpfLogger<&'static dyn log::Log>, aya_log::Error> {
        aya_log::EbpfLogger::init(&mut self.ebpf)
    }

    /// Writes the runtime knobs (index 0 of FP_CONFIG).
    pub fn set_config(&mut self, config: DatapathConfig) -> Result<(), DatapathError> {
        let map = self
            .ebpf
            .map_mut(map_names::CONFIG)
            .ok_or(DatapathError::MissingMap {
                name: map_names::CONFIG,
            })?;
        let mut array: Array<&mut MapData, DatapathConfig> =
            Array::try_from(map).map_err(|source| DatapathError::Map {
                what: "opening FP_CONFIG".into(),
                source,
            })?;
        array
            .set(0, &config, 0)
            .map_err(|source| DatapathError::Map {
                what: "writing FP_CONFIG".into(),
                source,
            })
    }

    /// Attaches every hook `iface` asks for.
    pub fn attach_interface(&mut self, iface: &InterfaceConfig) -> Result<(), DatapathError> {
        let name = iface.name.get_ref();
        if iface.xdp != XdpMode::Off {
            self.attach_xdp(name, iface.xdp)?;
        }
        if iface.tc_ingress {
            self.attach_tc(name, HookKind::TcIngress)?;
        }
        if iface.tc_egress {
            self.attach_tc(name, HookKind::TcEgress)?;
        }
        Ok(())
    }

    /// `links/<iface>@<hook>`. bpffs refuses names containing '.', which interface names may
    /// have (`eth0.100`), so '%' and '.' are percent-encoded.
    fn link_pin(&self, iface: &str, hook: HookKind) -> PathBuf {
        let iface = iface.replace('%', "%25").replace('.', "%2e");
        self.pin_dir
            .join("links")
            .join(format!("{iface}@{}", hook.suffix()))
    }

    fn attach_xdp(&mut self, iface: &str, mode: XdpMode) -> Result<(), DatapathError> {
        let pin = self.link_pin(iface, HookKind::Xdp);
        let prog: &mut Xdp = program(&mut self.ebpf, program_names::XDP)?;
        if let Some(fd) = reuse_pinned(prog, &pin)? {
            self.record(iface, HookKind::Xdp, "pinned", true, pin, fd);
            return Ok(());
        }
        let c_iface = iface_cstr(iface)?;
        let (id, mode_name) = match mode {
            XdpMode::Native => (
                attach_xdp_mode(prog, &c_iface, iface, AyaXdpMode::Driver)?,
                "native",
            ),
            XdpMode::Generic => (
                attach_xdp_mode(prog, &c_iface, iface, AyaXdpMode::Skb)?,
                "generic",
            ),
            XdpMode::Auto | XdpMode::Off => {
                match attach_xdp_mode(prog, &c_iface, iface, AyaXdpMode::Driver) {
                    Ok(id) => (id, "native"),
                    Err(e) => {
                        warn!(iface, error = %e, "Native XDP unavailable; falling back to generic (skb) mode");
                        (
                            attach_xdp_mode(prog, &c_iface, iface, AyaXdpMode::Skb)?,
                            "generic",
                        )
                    }
                }
            }
        };
        let fd = pin_link(prog.take_fd_link(id)?, &pin)?;
        self.record(iface, HookKind::Xdp, mode_name, false, pin, fd);
        Ok(())
    }

    fn attach_tc(&mut self, iface: &str, hook: HookKind) -> Result<(), DatapathError> {
        let (name, attach_type) = match hook {
            HookKind::TcEgress => (program_names::TC_EGRESS, TcAttachType::Egress),
            _ => (program_names::TC_INGRESS, TcAttachType::Ingress),
        };
        let pin = self.link_pin(iface, hook);
        let prog: &mut SchedClassifier = program(&mut self.ebpf, name)?;
        if let Some(fd) = reuse_pinned(prog, &pin)? {
            self.record(iface, hook, "pinned", true, pin, fd);
            return Ok(());
        }
        let c_iface = iface_cstr(iface)?;
        let id = prog
            .attach(
                c_iface.as_c_str(),
                TcAttach::Tcx {
                    attach_type,
                    order: LinkOrder::default(),
                },
            )
            .map_err(|source| DatapathError::Program {
                what: format!("attaching {name} to {iface} (TCX {})", hook.suffix()),
                source,
            })?;
        let fd = pin_link(prog.take_fd_link(id)?, &pin)?;
        self.record(iface, hook, "tcx", false, pin, fd);
        Ok(())
    }

    /// Logs and keeps one attachment.
    fn record(
        &mut self,
        iface: &str,
        hook: HookKind,
        mode: &'static str,
        reused: bool,
        pin: PathBuf,
        link: FdLink,
    ) {
        let pin_s = pin.display();
        match (reused, hook) {
            (true, HookKind::Xdp) => {
                info!(iface, pin = %pin_s, "Reused pinned XDP link; program replaced in place")
            }
            (true, _) => {
                info!(iface, hook = hook.suffix(), pin = %pin_s, "Reused pinned TCX link; program replaced in place")
            }
            (false, HookKind::Xdp) => info!(iface, mode, pin = %pin_s, "Attached XDP program"),
            (false, _) => {
                info!(iface, hook = hook.suffix(), mode, pin = %pin_s, "Attached TC program")
            }
        }
        self.attachments.push(Attachment {
            iface: iface.into(),
            hook,
            mode,
            reused,
            pin,
            _link: link,
        });
    }

    /// Detaches pinned links that the current configuration no longer names (left by an
    /// earlier run with another config). Returns their pin paths.
    pub fn remove_stale_links(&mut self) -> Result<Vec<PathBuf>, DatapathError> {
        let wanted: BTreeSet<&Path> = self.attachments.iter().map(|a| a.pin.as_path()).collect();
        let mut removed = Vec::new();
        let dir = self.pin_dir.join("links");
        let entries = fs::read_dir(&dir).map_err(|source| DatapathError::PinDir {
            path: dir.clone(),
            source,
        })?;
        for entry in entries.flatten() {
            let path = entry.path();
            if !wanted.contains(path.as_path()) {
                remove_pin(&path)?;
                removed.push(path);
            }
        }
        Ok(removed)
    }

    /// Sums the per-CPU counters.
    pub fn stats(&self) -> Result<StatsSnapshot, DatapathError> {
        let map = self
            .ebpf
            .map(map_names::STATS)
            .ok_or(DatapathError::MissingMap {
                name: map_names::STATS,
            })?;
        let array: PerCpuArray<&MapData, Counter> =
            PerCpuArray::try_from(map).map_err(|source| DatapathError::Map {
                what: "opening FP_STATS".into(),
                source,
            })?;
        Ok(StatsSnapshot::read(&array)?)
    }

    /// Detaches everything and removes every pin: the datapath is gone.
    pub fn detach_all(self) -> Result<(), DatapathError> {
        let pin_dir = self.pin_dir.clone();
        for a in &self.attachments {
            remove_pin(&a.pin)?;
        }
        drop(self); // closes the link fds: with their pins gone, the programs detach
        remove_pins(&pin_dir)
    }

    /// Leaves programs attached and pins in place (the datapath runs without a daemon).
    pub fn leave_attached(self) {
        drop(self);
    }
}

/// Removes every link and map pin under `pin_dir` (links first, so programs detach before
/// their maps go), then the directories. Works without a loaded object: `fastpath detach`.
pub fn remove_pins(pin_dir: &Path) -> Result<(), DatapathError> {
    for sub in ["links", "maps"] {
        let dir = pin_dir.join(sub);
        if let Ok(entries) = fs::read_dir(&dir) {
            for entry in entries.flatten() {
                remove_pin(&entry.path())?;
            }
        }
        let _ = fs::remove_dir(&dir);
    }
    let _ = fs::remove_dir(pin_dir);
    Ok(())
}

/// Reads the counters of a pinned datapath without loading anything (`fastpath stats`).
pub fn pinned_stats(pin_dir: &Path) -> Result<StatsSnapshot, DatapathError> {
    let path = pin_dir.join("maps").join(map_names::STATS);
    let data = MapData::from_pin(&path).map_err(|source| DatapathError::Map {
        what: format!(
            "opening {} (is a fastpath datapath running with this pin dir?)",
            path.display()
        ),
        source,
    })?;
    let array: PerCpuArray<MapData, Counter> =
        PerCpuArray::try_from(aya::maps::Map::PerCpuArray(data)).map_err(|source| {
            DatapathError::Map {
                what: "opening FP_STATS".into(),
                source,
            }
        })?;
    Ok(StatsSnapshot::read(&array)?)
}

/// The program kinds attached through bpf_links (XDP, TCX), seen alike for pinning.
trait LinkedProgram {
    type Link: TryFrom<FdLink, Error = LinkError>;
    type LinkId;
    /// Atomically swaps this program into `link` (bpf_link_update).
    fn replace_in(&mut self, link: Self::Link) -> Result<Self::LinkId, ProgramError>;
    /// Takes ownership of an attached link as a plain fd link.
    fn take_fd_link(&mut self, id: Self::LinkId) -> Result<FdLink, DatapathError>;
}

impl LinkedProgram for Xdp {
    type Link = XdpLink;
    type LinkId = XdpLinkId;
    fn replace_in(&mut self, link: XdpLink) -> Result<XdpLinkId, ProgramError> {
        self.attach_to_link(link)
    }
    fn take_fd_link(&mut self, id: XdpLinkId) -> Result<FdLink, DatapathError> {
        let link = self
            .take_link(id)
            .map_err(|source| DatapathError::Program {
                what: "taking the XDP link".into(),
                source,
            })?;
        FdLink::try_from(link).map_err(|source| DatapathError::Link {
            what: "the XDP link is not a bpf_link (kernel too old?)".into(),
            source,
        })
    }
}

impl LinkedProgram for SchedClassifier {
    type Link = SchedClassifierLink;
    type LinkId = SchedClassifierLinkId;
    fn replace_in(
        &mut self,
        link: SchedClassifierLink,
    ) -> Result<SchedClassifierLinkId, ProgramError> {
        self.attach_to_link(link)
    }
    fn take_fd_link(&mut self, id: SchedClassifierLinkId) -> Result<FdLink, DatapathError> {
        let link = self
            .take_link(id)
            .map_err(|source| DatapathError::Program {
                what: "taking the TC link".into(),
                source,
            })?;
        FdLink::try_from(link).map_err(|source| DatapathError::Link {
            what: "the TC link is not a bpf_link (kernel without TCX?)".into(),
            source,
        })
    }
}

/// Swaps `prog` into the link pinned at `pin`, if there is one still attached. A stale pin
/// (its interface gone, or of another kind) is removed so the caller attaches afresh.
fn reuse_pinned<P: LinkedProgram>(
    prog: &mut P,
    pin: &Path,
) -> Result<Option<FdLink>, DatapathError> {
    let Some(old) = open_pinned(pin)? else {
        return Ok(None);
    };
    let replaced = P::Link::try_from(old)
        .map_err(|source| DatapathError::Link {
            what: format!("reading {}", pin.display()),
            source,
        })
        .and_then(|link| {
            prog.replace_in(link)
                .map_err(|source| DatapathError::Program {
                    what: format!("replacing the program of {}", pin.display()),
                    source,
                })
        });
    match replaced {
        Ok(id) => Ok(Some(prog.take_fd_link(id)?)),
        Err(e) => {
            warn!(pin = %pin.display(), error = %e, "Pinned link is stale; attaching afresh");
            remove_pin(pin)?;
            Ok(None)
        }
    }
}

fn program<'a, T>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut T, DatapathError>
where
    &'a mut T: TryFrom<&'a mut aya::programs::Program, Error = aya::programs::ProgramError>,
{
    let p = ebpf
        .program_mut(name)
        .ok_or(DatapathError::MissingProgram { name })?;
    p.try_into().map_err(|source| DatapathError::Program {
        what: format!("program {name} has the wrong type"),
        source,
    })
}

fn attach_xdp_mode(
    prog: &mut Xdp,
    c_iface: &CString,
    iface: &str,
    mode: AyaXdpMode,
) -> Result<XdpLinkId, DatapathError> {
    let hint = match mode {
        AyaXdpMode::Driver => {
            " (native mode needs driver support; xdp = \"auto\" falls back to generic, xdp = \"generic\" forces it)"
        }
        _ => "",
    };
    prog.attach(c_iface.as_c_str(), mode)
        .map_err(|source| DatapathError::Program {
            what: format!("attaching XDP ({mode:?}) to {iface}{hint}"),
            source,
        })
}

fn iface_cstr(iface: &str) -> Result<CString, DatapathError> {
    CString::new(iface).map_err(|_| DatapathError::PinDir {
        path: PathBuf::from(iface),
        source: io::Error::new(io::ErrorKind::InvalidInput, "interface name contains NUL"),
    })
}

/// The link pinned at `pin`, if any.
fn open_pinned(pin: &Path) -> Result<Option<FdLink>, DatapathError> {
    if !pin.exists() {
        return Ok(None);
    }
    match PinnedLink::from_pin(pin) {
        Ok(p) => Ok(Some(FdLink::from(p))),
        Err(e) => {
            warn!(pin = %pin.display(), error = %e, "Unreadable link pin; removing it");
            remove_pin(pin)?;
            Ok(None)
        }
    }
}

fn pin_link(fd: FdLink, pin: &Path) -> Result<FdLink, DatapathError> {
    let pinned = fd.pin(pin).map_err(|source| DatapathError::Pin {
        path: pin.to_owned(),
        source,
    })?;
    Ok(FdLink::from(pinned))
}

fn remove_pin(path: &Path) -> Result<(), DatapathError> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(DatapathError::Unpin {
            path: path.to_owned(),
            source,
        }),
    }
}

/// Makes sure `pin_dir` is on a bpffs, mounting `/sys/fs/bpf` if that is where it lives and
/// nothing is mounted there yet.
fn ensure_bpffs(pin_dir: &Path) -> Result<(), DatapathError> {
    let mut probe = pin_dir.to_path_buf();
    while !probe.exists() {
        if !probe.pop() {
            break;
        }
    }
    if fs_type(&probe) == Some(BPF_FS_MAGIC) {
        return Ok(());
    }
    let sys_bpf = Path::new("/sys/fs/bpf");
    if pin_dir.starts_with(sys_bpf) && fs_type(sys_bpf) != Some(BPF_FS_MAGIC) {
        let src = CString::new("bpf").unwrap_or_default();
        let target = CString::new("/sys/fs/bpf").unwrap_or_default();
        // SAFETY: all pointers are valid NUL-terminated strings for the duration of the call.
        let rc = unsafe {
            libc::mount(
                src.as_ptr(),
                target.as_ptr(),
                src.as_ptr(),
                0,
                std::ptr::null(),
            )
        };
        if rc != 0 {
            return Err(DatapathError::Mount {
                source: io::Error::last_os_error(),
            });
        }
        info!("Mounted bpffs on /sys/fs/bpf");
        return Ok(());
    }
    Err(DatapathError::NotBpffs {
        path: pin_dir.to_owned(),
        mount_hint: probe.display().to_string(),
    })
}

fn fs_type(path: &Path) -> Option<i64> {
    use std::os::unix::ffi::OsStrExt as _;
    let c = CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: statfs writes into `buf`, which is large enough; `c` is NUL-terminated.
    let mut buf: libc::statfs = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::statfs(c.as_ptr(), &mut buf) };
    (rc == 0).then_some(buf.f_type as i64)
}
