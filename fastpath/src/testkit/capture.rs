//! Raw frames on the wire of a namespace: an AF_PACKET socket bound to one interface, to
//! send a frame exactly as built and to capture what the kernel puts on a link (the VXLAN
//! fixtures keep the kernel's own packets this way).

use std::{
    io,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    time::{Duration, Instant},
};

/// `sll_pkttype` of a frame this host sent (the others arrived).
const PACKET_OUTGOING: u8 = 4;
const ETH_P_ALL: u16 = 0x0003;

/// An AF_PACKET socket bound to one interface of the namespace it was opened in.
pub struct PacketSocket {
    fd: OwnedFd,
    ifindex: u32,
}

/// Which frames [`PacketSocket::capture`] keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    Arriving,
    Leaving,
}

impl PacketSocket {
    /// Opens a socket on `dev` in this thread's namespace (see `Netns::in_netns` for another).
    /// Frames are queued from now on.
    pub fn open(dev: &str) -> io::Result<PacketSocket> {
        let ifindex = crate::sys::ifindex(dev)
            .ok_or_else(|| io::Error::other(format!("no interface {dev:?} here")))?;
        // SAFETY: a plain socket(2) call; the fd is owned right below.
        let fd = unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                i32::from(ETH_P_ALL.to_be()),
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a new descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: sockaddr_ll is plain old data; all zeroes is valid.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = ETH_P_ALL.to_be();
        sll.sll_ifindex = ifindex as i32;
        // SAFETY: `sll` is a valid sockaddr_ll of the size given.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&raw const sll).cast::<libc::sockaddr>(),
                size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(PacketSocket { fd, ifindex })
    }

    /// Sends `frame` (from the destination MAC on) out of the interface as it is.
    pub fn send(&self, frame: &[u8]) -> io::Result<()> {
        // SAFETY: sockaddr_ll is plain old data; all zeroes is valid.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_ifindex = self.ifindex as i32;
        sll.sll_halen = 6;
        sll.sll_addr[..6].copy_from_slice(&frame[..6]);
        // SAFETY: the buffer and the address are valid for the lengths given.
        let n = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                frame.as_ptr().cast(),
                frame.len(),
                0,
                (&raw const sll).cast::<libc::sockaddr>(),
                size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// The first frame in `direction` that `want` accepts, waiting at most `timeout`.
    pub fn capture(
        &self,
        direction: Direction,
        timeout: Duration,
        want: impl Fn(&[u8]) -> bool,
    ) -> Option<Vec<u8>> {
        let end = Instant::now() + timeout;
        let mut buf = vec![0u8; 65536];
        while Instant::now() < end {
            let mut pfd = libc::pollfd {
                fd: self.fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let left = end.saturating_duration_since(Instant::now()).as_millis() as i32;
            // SAFETY: one valid pollfd.
            if unsafe { libc::poll(&raw mut pfd, 1, left.max(1)) } <= 0 {
                continue;
            }
            // SAFETY: sockaddr_ll is plain old data; all zeroes is valid.
            let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
            let mut len = size_of::<libc::sockaddr_ll>() as u32;
            // SAFETY: the buffer and the address are valid for the lengths given.
            let n = unsafe {
                libc::recvfrom(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                    (&raw mut sll).cast::<libc::sockaddr>(),
                    &raw mut len,
                )
            };
            if n <= 0 {
                continue;
            }
            let leaving = sll.sll_pkttype == PACKET_OUTGOING;
            let frame = &buf[..n as usize];
            if leaving == (direction == Direction::Leaving) && want(frame) {
                return Some(frame.to_vec());
            }
        }
        None
    }
}
