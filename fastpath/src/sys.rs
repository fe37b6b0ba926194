//! Every raw system call of the daemon: the bpf(2) commands aya does not offer (batched map
//! reads and writes, BPF_OBJ_GET of a link pin, BPF_OBJ_PIN of a program, a link's info,
//! the TCX probe), the interface lookups
//! (if_nametoindex, the SIOCGIF* ioctls, getifaddrs), statfs/mount of the bpffs, flock of the
//! pin directory, and the shared mappings of the LB arrays. Each is a small safe wrapper; no
//! other module holds an `unsafe` system call.

use std::{
    collections::BTreeSet,
    ffi::{CStr, CString},
    io,
    net::IpAddr,
    os::{
        fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    },
    path::{Path, PathBuf},
    sync::atomic::{AtomicU32, Ordering},
    time::{SystemTime, UNIX_EPOCH},
};

/// bpffs superblock magic (statfs f_type).
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
const BPF_LINK_CREATE: libc::c_long = 28;
/// `enum bpf_prog_type`'s BPF_PROG_TYPE_SCHED_CLS (TC programs).
pub const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
/// `enum bpf_prog_type`'s BPF_PROG_TYPE_XDP.
pub const BPF_PROG_TYPE_XDP: u32 = 6;
/// `enum bpf_func_id`'s BPF_FUNC_loop (Linux 5.17).
pub const BPF_FUNC_LOOP: u32 = 181;
/// `enum bpf_attach_type`'s BPF_TCX_INGRESS (Linux 6.6).
const BPF_TCX_INGRESS: u64 = 46;

/// Entries fetched per BPF_MAP_LOOKUP_BATCH call.
pub const WALK_BATCH: usize = 4096;

/// `bpf(cmd, attr, size_of(attr))`: the syscall's return value, or the error it set.
fn bpf<A>(cmd: libc::c_long, attr: &mut A) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a live, exclusively borrowed buffer of exactly the size passed; each
    // caller lays out the command's union member in it, and every pointer it holds refers to
    // memory that outlives this call (the caller's slices and buffers).
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, std::ptr::from_mut(attr), size_of::<A>()) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// A failed batched update: how many elements the kernel wrote before it stopped.
#[derive(Debug)]
pub struct BatchError {
    pub written: usize,
    pub source: io::Error,
}

/// Writes `keys[i] → values[i]` into the map `fd` with BPF_MAP_UPDATE_BATCH: thousands of
/// elements per syscall instead of one each. `K`/`V` must be the map's key and value types
/// (plain `repr(C)` data of the map's key and value sizes).
pub fn map_update_batch<K: Copy, V: Copy>(
    fd: BorrowedFd<'_>,
    keys: &[K],
    values: &[V],
) -> Result<(), BatchError> {
    let total = keys.len().min(values.len());
    let mut done = 0usize;
    while done < total {
        let chunk = (total - done).min(1 << 16);
        // union bpf_attr, batch: in_batch, out_batch, keys, values, count|map_fd, elem_flags,
        // flags. The kernel reads at most `count` keys and values, which the slices hold.
        let mut attr = [0u64; 7];
        attr[2] = keys[done..].as_ptr() as u64;
        attr[3] = values[done..].as_ptr() as u64;
        attr[4] = (chunk as u64) | ((fd.as_raw_fd() as u32 as u64) << 32);
        let rc = bpf(BPF_MAP_UPDATE_BATCH, &mut attr);
        let written = (attr[4] & 0xffff_ffff) as usize;
        if let Err(source) = rc {
            return Err(BatchError {
                written: done + written,
                source,
            });
        }
        done += chunk;
    }
    Ok(())
}

/// Every entry of the hash map `fd` (keys `K`, values `V`: the map's types), read with
/// BPF_MAP_LOOKUP_BATCH ([`WALK_BATCH`] entries per syscall), handed to `visit` chunk by chunk.
pub fn map_walk_batches<K: Copy + Default, V: Copy + Default>(
    fd: BorrowedFd<'_>,
    mut visit: impl FnMut(&[K], &[V]),
) -> io::Result<()> {
    let mut keys = vec![K::default(); WALK_BATCH];
    let mut values = vec![V::default(); WALK_BATCH];
    // Opaque resume tokens (a bucket index for hash maps).
    let mut in_batch = [0u64; 8];
    let mut out_batch = [0u64; 8];
    let mut first = true;
    loop {
        // union bpf_attr, batch: in_batch, out_batch, keys, values, count|map_fd, elem_flags,
        // flags. The kernel writes at most `count` keys and values into the buffers, which
        // hold WALK_BATCH of each, and a resume token into `out_batch`.
        let mut attr = [0u64; 7];
        attr[0] = if first {
            0
        } else {
            in_batch.as_mut_ptr() as u64
        };
        attr[1] = out_batch.as_mut_ptr() as u64;
        attr[2] = keys.as_mut_ptr() as u64;
        attr[3] = values.as_mut_ptr() as u64;
        attr[4] = (WALK_BATCH as u64) | ((fd.as_raw_fd() as u32 as u64) << 32);
        let rc = bpf(BPF_MAP_LOOKUP_BATCH, &mut attr);
        let count = ((attr[4] & 0xffff_ffff) as usize).min(WALK_BATCH);
        match rc {
            Ok(_) => {}
            // End of the table: the last chunk (possibly empty) is in the buffers.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                visit(&keys[..count], &values[..count]);
                return Ok(());
            }
            Err(e) => return Err(e),
        }
        visit(&keys[..count], &values[..count]);
        in_batch = out_batch;
        first = false;
    }
}

/// A new fd of the object pinned at `pin` (BPF_OBJ_GET): while open, it keeps the object
/// alive even once unpinned.
pub fn obj_get(pin: &Path) -> io::Result<OwnedFd> {
    let path = CString::new(pin.as_os_str().as_bytes())?;
    // union bpf_attr for BPF_OBJ_GET: pathname (u64), bpf_fd, file_flags, path_fd. The
    // kernel reads the NUL-terminated path, which `path` holds past the call.
    let mut attr = [0u64; 4];
    attr[0] = path.as_ptr() as u64;
    let fd = bpf(BPF_OBJ_GET, &mut attr)?;
    let fd = i32::try_from(fd).map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
    // SAFETY: BPF_OBJ_GET returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Pins the object `fd` at `pin` (BPF_OBJ_PIN).
pub fn obj_pin(fd: BorrowedFd<'_>, pin: &Path) -> io::Result<()> {
    let path = CString::new(pin.as_os_str().as_bytes())?;
    // union bpf_attr for BPF_OBJ_PIN: pathname (u64), bpf_fd, file_flags, path_fd.
    let mut attr = [0u64; 3];
    attr[0] = path.as_ptr() as u64;
    attr[1] = fd.as_raw_fd() as u32 as u64;
    bpf(BPF_OBJ_PIN, &mut attr)?;
    Ok(())
}

/// Loads `r0 = 0; exit` as a program of `prog_type`: something to probe the kernel with.
pub fn load_return_zero(prog_type: u32) -> io::Result<OwnedFd> {
    // BPF_MOV64_IMM(BPF_REG_0, 0) and BPF_EXIT_INSN(), as the kernel lays out `struct bpf_insn`.
    prog_load(prog_type, &[0xb7, 0x95], None)
}

/// BPF_PROG_LOAD of `insns` (each a `struct bpf_insn` as a little-endian word) as a GPL
/// program of `prog_type`, with the verifier's log (level 1) into `log` if given.
fn prog_load(prog_type: u32, insns: &[u64], log: Option<&mut [u8]>) -> io::Result<OwnedFd> {
    let license = c"GPL";
    // union bpf_attr for BPF_PROG_LOAD: prog_type, insn_cnt, insns, license, log_level,
    // log_size, log_buf.
    let mut attr = [0u64; 16];
    attr[0] = u64::from(prog_type) | (insns.len() as u64) << 32;
    attr[1] = insns.as_ptr() as u64;
    attr[2] = license.as_ptr() as u64;
    if let Some(log) = log {
        attr[3] = 1 | (log.len() as u64) << 32;
        attr[4] = log.as_mut_ptr() as u64;
    }
    let fd = bpf(BPF_PROG_LOAD, &mut attr)?;
    let fd = i32::try_from(fd).map_err(|_| io::Error::other("BPF_PROG_LOAD: fd out of range"))?;
    // SAFETY: BPF_PROG_LOAD returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Whether programs of `prog_type` may call helper `func_id`, probed as libbpf and bpftool
/// do: a program that calls it with no argument set. A kernel that knows the helper refuses
/// the arguments (or takes the program); one that does not says "invalid func" or "unknown
/// func" in the verifier's log.
pub fn helper_supported(prog_type: u32, func_id: u32) -> io::Result<bool> {
    // BPF_EMIT_CALL(func_id) and BPF_EXIT_INSN().
    let insns = [0x85 | u64::from(func_id) << 32, 0x95];
    let mut log = vec![0u8; 4096];
    match prog_load(prog_type, &insns, Some(&mut log)) {
        Ok(_) => Ok(true),
        Err(e) => {
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            let text = String::from_utf8_lossy(&log[..end]);
            if text.is_empty() {
                // No verdict of the verifier's (no privileges, say): no answer either way.
                return Err(e);
            }
            Ok(!(text.contains("invalid func ") || text.contains("unknown func ")))
        }
    }
}

/// Whether the kernel has TCX links (Linux 6.6), probed with a two-instruction SCHED_CLS
/// program of our own: BPF_LINK_CREATE at TCX ingress of interface 0, which attaches nothing.
/// A kernel with TCX looks the interface up and answers ENODEV; one without knows no such
/// attach type and answers EINVAL.
pub fn tcx_supported() -> io::Result<bool> {
    let prog = load_return_zero(BPF_PROG_TYPE_SCHED_CLS)?;
    // union bpf_attr for BPF_LINK_CREATE: prog_fd, target_ifindex (0), attach_type, flags,
    // then the per-type union (zero: no relative program, no expected revision).
    let mut attr = [0u64; 8];
    attr[0] = prog.as_raw_fd() as u32 as u64;
    attr[1] = BPF_TCX_INGRESS;
    match bpf(BPF_LINK_CREATE, &mut attr) {
        Ok(fd) => {
            // Cannot happen (there is no interface 0); close what the kernel made all the same.
            if let Ok(fd) = i32::try_from(fd) {
                // SAFETY: BPF_LINK_CREATE returned a new fd that nothing else owns.
                drop(unsafe { OwnedFd::from_raw_fd(fd) });
            }
            Ok(true)
        }
        Err(e) if e.raw_os_error() == Some(libc::ENODEV) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
        Err(e) => Err(e),
    }
}

/// What `bpf_link_info` says of a link (aya exposes neither field).
pub struct LinkInfo {
    pub link_type: u32,
    /// The program the link runs.
    pub prog_id: u32,
    /// Interface an XDP/TCX link is attached to; 0 once that interface is gone.
    pub ifindex: u32,
}

/// BPF_OBJ_GET_INFO_BY_FD of the link `fd`.
pub fn link_info(fd: BorrowedFd<'_>) -> io::Result<LinkInfo> {
    // struct bpf_link_info: type, id, prog_id, pad, then the per-type union; for XDP and TCX
    // links its first field is the ifindex (offset 16). The kernel writes at most `info_len`
    // bytes into `info`.
    let mut info = [0u64; 32];
    let mut attr = [0u64; 2];
    attr[0] = (fd.as_raw_fd() as u32 as u64) | ((size_of_val(&info) as u64) << 32);
    attr[1] = info.as_mut_ptr() as u64;
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    Ok(LinkInfo {
        link_type: info[0] as u32,
        prog_id: info[1] as u32,
        ifindex: info[2] as u32,
    })
}

/// Takes an exclusive, non-blocking flock on `fd`: false if another holder has it.
pub fn flock_exclusive(fd: BorrowedFd<'_>) -> bool {
    // SAFETY: flock on a valid open fd; no memory is passed.
    unsafe { libc::flock(fd.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}

/// Whether `path` is on a bpffs (statfs f_type).
pub fn is_bpffs(path: &Path) -> bool {
    let Ok(c) = CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: an all-zero statfs is a valid value of this plain C struct.
    let mut buf: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: statfs writes into `buf`, which is large enough; `c` is NUL-terminated.
    let rc = unsafe { libc::statfs(c.as_ptr(), &mut buf) };
    rc == 0 && buf.f_type as i64 == BPF_FS_MAGIC
}

/// Mounts a new bpffs instance on `path`.
pub fn mount_bpffs(path: &Path) -> io::Result<()> {
    let target = CString::new(path.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let fstype = c"bpf";
    // SAFETY: every pointer is a NUL-terminated string that outlives the call; no data.
    let rc = unsafe {
        libc::mount(
            fstype.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A directory on a bpffs that only its owner uses (the fixtures, `fastpath kernel`): a
/// fresh subdirectory of `/sys/fs/bpf` when that is a bpffs, else a private bpffs instance
/// mounted on a fresh temporary directory (so the host's `/sys/fs/bpf` is never mounted
/// over). The name is unique per process, directory and time, and the directory is created
/// with `create_dir` (not `_all`), so stale pins of a crashed run can never be picked up.
/// Removed, with its pins, when dropped.
pub struct ScratchPinDir {
    path: PathBuf,
    /// We mounted a bpffs on `path` and must unmount it.
    mounted: bool,
}

impl ScratchPinDir {
    /// A new directory named after `purpose`; the error names the directory it could not make.
    pub fn create(purpose: &str) -> Result<Self, (PathBuf, io::Error)> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let unique = format!(
            "fastpath-{purpose}-{}-{}-{nanos}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let sys = Path::new("/sys/fs/bpf");
        if is_bpffs(sys) {
            let path = sys.join(unique);
            return match std::fs::create_dir(&path) {
                Ok(()) => Ok(ScratchPinDir {
                    path,
                    mounted: false,
                }),
                Err(e) => Err((path, e)),
            };
        }
        let path = std::env::temp_dir().join(unique);
        if let Err(e) = std::fs::create_dir(&path) {
            return Err((path, e));
        }
        // Owned before mounting, so a failed mount still removes the directory.
        let mut dir = ScratchPinDir {
            path,
            mounted: false,
        };
        if let Err(e) = mount_bpffs(&dir.path) {
            return Err((dir.path.clone(), e));
        }
        dir.mounted = true;
        Ok(dir)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ScratchPinDir {
    fn drop(&mut self) {
        if self.mounted {
            // Unmounting a private bpffs instance drops every pin in it at once.
            if let Err(e) = umount(&self.path) {
                eprintln!("unmounting bpffs at {}: {e}", self.path.display());
                return;
            }
        } else if let Ok(entries) = std::fs::read_dir(&self.path) {
            for entry in entries.flatten() {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        if let Err(e) = std::fs::remove_dir(&self.path) {
            eprintln!("removing pin directory {}: {e}", self.path.display());
        }
    }
}

fn umount(path: &Path) -> io::Result<()> {
    let target = CString::new(path.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    // SAFETY: `target` is a NUL-terminated path that outlives the call.
    let rc = unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Every address of every interface in this network namespace, with the interface's name,
/// as `ip addr` lists them (getifaddrs).
pub fn addresses() -> io::Result<Vec<(String, IpAddr)>> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list freed below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, alive until freeifaddrs;
        // its name is NUL-terminated and a sockaddr's family tells which struct it is.
        unsafe {
            let (addr, name) = ((*cur).ifa_addr, (*cur).ifa_name);
            if !addr.is_null() && !name.is_null() {
                let ip: Option<IpAddr> = match i32::from((*addr).sa_family) {
                    libc::AF_INET => {
                        let a = &*(addr as *const libc::sockaddr_in);
                        Some(std::net::Ipv4Addr::from(a.sin_addr.s_addr.to_ne_bytes()).into())
                    }
                    libc::AF_INET6 => {
                        let a = &*(addr as *const libc::sockaddr_in6);
                        Some(std::net::Ipv6Addr::from(a.sin6_addr.s6_addr).into())
                    }
                    _ => None,
                };
                if let Some(ip) = ip {
                    out.push((CStr::from_ptr(name).to_string_lossy().into_owned(), ip));
                }
            }
            cur = (*cur).ifa_next;
        }
    }
    // SAFETY: the list getifaddrs allocated, freed once.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

/// The addresses of this network namespace's interfaces (none when they cannot be read).
pub fn local_addresses() -> BTreeSet<IpAddr> {
    addresses()
        .map(|all| all.into_iter().map(|(_, ip)| ip).collect())
        .unwrap_or_default()
}

/// The addresses of interface `name` in this network namespace, in `ip addr`'s order.
pub fn interface_addresses(name: &str) -> io::Result<Vec<IpAddr>> {
    Ok(addresses()?
        .into_iter()
        .filter(|(n, _)| n == name)
        .map(|(_, ip)| ip)
        .collect())
}

/// The index of interface `name` in this network namespace, if it exists.
pub fn ifindex(name: &str) -> Option<u32> {
    let c = CString::new(name).ok()?;
    // SAFETY: `c` is a valid NUL-terminated string that outlives the call.
    let idx = unsafe { libc::if_nametoindex(c.as_ptr()) };
    (idx != 0).then_some(idx)
}

/// The name of interface `ifindex` in this network namespace, if it exists.
pub fn interface_name(ifindex: u32) -> Option<String> {
    let mut name = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: if_indextoname writes at most IF_NAMESIZE bytes, NUL-terminated, into `name`.
    if unsafe { libc::if_indextoname(ifindex, name.as_mut_ptr()) }.is_null() {
        return None;
    }
    // SAFETY: NUL-terminated by if_indextoname, within `name`.
    let cname = unsafe { CStr::from_ptr(name.as_ptr()) };
    Some(cname.to_string_lossy().into_owned())
}

/// A datagram socket for the interface ioctls.
fn ioctl_socket() -> io::Result<OwnedFd> {
    // SAFETY: a plain socket(2) call; the fd is owned right below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// An `ifreq` naming `name` (shorter than IFNAMSIZ, checked).
fn ifreq(name: &str) -> io::Result<libc::ifreq> {
    if name.len() >= libc::IFNAMSIZ || name.bytes().any(|b| b == 0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "interface name too long or containing NUL",
        ));
    }
    // SAFETY: ifreq is plain old data; all zeroes is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    Ok(req)
}

/// Whether interface `name` is up with carrier (IFF_UP and IFF_RUNNING; SIOCGIFFLAGS).
pub fn interface_up(name: &str) -> bool {
    let (Ok(sock), Ok(mut req)) = (ioctl_socket(), ifreq(name)) else {
        return false;
    };
    // SAFETY: SIOCGIFFLAGS reads ifr_name and writes ifr_flags of `req`, which it owns.
    let rc = unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) };
    if rc != 0 {
        return false;
    }
    // SAFETY: ifr_flags is the union member SIOCGIFFLAGS wrote.
    let flags = i32::from(unsafe { req.ifr_ifru.ifru_flags });
    flags & libc::IFF_UP != 0 && flags & libc::IFF_RUNNING != 0
}

/// The hardware address of interface `name` (SIOCGIFHWADDR): an error unless it is an
/// Ethernet interface.
pub fn interface_mac(name: &str) -> io::Result<[u8; 6]> {
    let hw = hwaddr(name)?;
    if hw.sa_family != libc::ARPHRD_ETHER {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!("link type {} is not Ethernet", hw.sa_family),
        ));
    }
    Ok(std::array::from_fn(|i| hw.sa_data[i] as u8))
}

/// The ARPHRD link type of interface `name` (`libc::ARPHRD_ETHER`, `libc::ARPHRD_LOOPBACK`,
/// ...), read with SIOCGIFHWADDR: it answers for this process's network namespace after
/// setns, unlike /sys/class/net, which shows the mounting namespace's.
pub fn link_type(name: &str) -> io::Result<u16> {
    Ok(hwaddr(name)?.sa_family)
}

/// Whether interface `name` is a loopback device.
pub fn is_loopback(name: &str) -> bool {
    link_type(name).is_ok_and(|t| t == libc::ARPHRD_LOOPBACK)
}

/// SIOCGIFHWADDR of interface `name`: its link type and hardware address.
fn hwaddr(name: &str) -> io::Result<libc::sockaddr> {
    let sock = ioctl_socket()?;
    let mut req = ifreq(name)?;
    // SAFETY: SIOCGIFHWADDR reads the NUL-terminated name and writes the address into `req`.
    let rc = unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFHWADDR, &mut req) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: after a successful SIOCGIFHWADDR the union holds `ifru_hwaddr`.
    Ok(unsafe { req.ifr_ifru.ifru_hwaddr })
}

/// A BPF array created with BPF_F_MMAPABLE, mapped into this process: element `i` of `T`
/// at byte `i × size_of::<T>()` (`T` plain data, a multiple of 8 bytes; or u32 for an array
/// of `[u32; 2]` pairs, whose halves are consecutive u32s).
pub(crate) struct SharedArray<T> {
    ptr: *mut T,
    /// Elements of `T` in the mapping.
    len: usize,
    bytes: usize,
}

// SAFETY: the mapping is plain shared memory owned by this value; moving the owner to
// another thread is fine (it is written from one thread at a time, through `&mut`).
unsafe impl<T: Send> Send for SharedArray<T> {}

impl<T: Copy> SharedArray<T> {
    /// Maps `bytes` of the array map `fd`.
    pub fn map(fd: BorrowedFd<'_>, bytes: usize) -> io::Result<SharedArray<T>> {
        // SAFETY: a fresh shared mapping of the map's memory; the kernel checks the size and
        // that the map is mmapable.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(SharedArray {
            ptr: ptr.cast(),
            len: bytes / size_of::<T>(),
            bytes,
        })
    }

    /// Elements in the mapping.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The mapping's elements, to read and write in place.
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: `len` elements of `T` lie in the mapping, which lives as long as `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Copies `values` to elements `off..off + values.len()`; false (nothing written) if
    /// that range is not inside the mapping.
    pub fn write(&mut self, off: usize, values: &[T]) -> bool {
        if off
            .checked_add(values.len())
            .is_none_or(|end| end > self.len)
        {
            return false;
        }
        // SAFETY: the range was checked against the mapping; `T` is plain data; the datapath
        // reads these elements only after the service that names them is switched.
        unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), self.ptr.add(off), values.len()) };
        true
    }
}

impl SharedArray<u64> {
    /// Adds one to element `i` atomically (the datapath bumps the same words); false if `i`
    /// is outside the mapping.
    pub fn bump(&self, i: usize) -> bool {
        if i >= self.len {
            return false;
        }
        // SAFETY: `i` is inside the mapping, which is u64-aligned shared memory that outlives
        // this call; every writer (here and in BPF) updates it atomically.
        let word = unsafe { std::sync::atomic::AtomicU64::from_ptr(self.ptr.add(i)) };
        word.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        true
    }
}

impl<T> Drop for SharedArray<T> {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `map` mapped.
        unsafe { libc::munmap(self.ptr.cast(), self.bytes) };
    }
}

/// The bytes of conntrack records, as the installer program reads them.
pub fn ct_records_bytes(records: &[fastpath_common::ct::CtRecord]) -> &[u8] {
    // SAFETY: CtRecord is repr(C) plain data without padding (its size is asserted in
    // fastpath-common); the slice is borrowed for the returned lifetime.
    unsafe { std::slice::from_raw_parts(records.as_ptr().cast::<u8>(), size_of_val(records)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ifreq_refuses_names_the_kernel_would_cut() {
        assert!(ifreq("eth0").is_ok());
        assert!(
            ifreq("0123456789abcdef").is_err(),
            "16 bytes: no room for NUL"
        );
        assert!(ifreq("a\0b").is_err());
    }

    #[test]
    fn loopback_is_an_ethernet_framed_device_with_its_addresses() {
        assert_eq!(link_type("lo").ok(), Some(libc::ARPHRD_LOOPBACK));
        assert!(is_loopback("lo"));
        assert!(link_type("nosuch0").is_err());
        assert!(ifindex("lo").is_some());
        assert_eq!(ifindex("nosuch0"), None);
        let lo = interface_addresses("lo").expect("getifaddrs");
        assert!(
            lo.contains(&IpAddr::from([127, 0, 0, 1])),
            "expected 127.0.0.1 on lo, got {lo:?}"
        );
        assert!(local_addresses().is_superset(&lo.into_iter().collect()));
    }
}
