//! Route, neighbour (and VXLAN FDB) and link changes end the generation of learned VXLAN
//! headers: the outer headers the datapath learned from the kernel's vxlan devices depend on
//! the FDB, the underlay's route and its neighbour, so after any such change each overlay
//! next hop's next packet takes the kernel's path once and teaches them again. No flush: the
//! datapath compares generations per packet.
//!
//! The daemon listens on a netlink route socket (the multicast groups of links, neighbours
//! and IPv4/IPv6 routes), drains what arrived, and bumps `FP_VXLAN_GEN` once per burst, at
//! most every `COALESCE`.

use std::{
    io,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use tokio::{io::unix::AsyncFd, sync::watch};
use tracing::warn;

use crate::datapath::{self, DatapathError};

/// The least time between two generations (a burst of changes makes one).
const COALESCE: Duration = Duration::from_millis(100);

/// Netlink message types that change what learned headers depend on.
const RELEVANT: [u16; 6] = [
    libc::RTM_NEWLINK,
    libc::RTM_DELLINK,
    libc::RTM_NEWROUTE,
    libc::RTM_DELROUTE,
    libc::RTM_NEWNEIGH,
    libc::RTM_DELNEIGH,
];

/// A netlink route socket subscribed to link, neighbour and route changes, non-blocking.
pub fn subscribe() -> io::Result<OwnedFd> {
    // SAFETY: a plain socket(2) call; the fd is owned right below.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            libc::NETLINK_ROUTE,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sockaddr_nl is plain old data; all zeroes is valid.
    let mut sa: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    sa.nl_family = libc::AF_NETLINK as u16;
    sa.nl_groups = (libc::RTMGRP_LINK
        | libc::RTMGRP_NEIGH
        | libc::RTMGRP_IPV4_ROUTE
        | libc::RTMGRP_IPV6_ROUTE) as u32;
    // SAFETY: `sa` is a valid sockaddr_nl of the size given.
    let rc = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&raw const sa).cast::<libc::sockaddr>(),
            size_of::<libc::sockaddr_nl>() as u32,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// Reads everything queued on `fd`; returns how many relevant messages there were. A lost
/// burst (the socket's buffer overran) counts as one: something changed.
pub fn drain(fd: &OwnedFd) -> io::Result<usize> {
    let mut buf = vec![0u8; 64 * 1024];
    let mut relevant = 0;
    loop {
        // SAFETY: the buffer is valid for its length.
        let n = unsafe {
            libc::recv(
                fd.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EAGAIN) => return Ok(relevant),
                Some(libc::ENOBUFS) => relevant += 1,
                Some(libc::EINTR) => {}
                _ => return Err(e),
            }
            continue;
        }
        relevant += count_relevant(&buf[..n as usize]);
    }
}

/// Relevant messages in one datagram (a sequence of netlink messages).
fn count_relevant(mut data: &[u8]) -> usize {
    let mut n = 0;
    while data.len() >= 16 {
        let len = u32::from_ne_bytes([data[0], data[1], data[2], data[3]]) as usize;
        let kind = u16::from_ne_bytes([data[4], data[5]]);
        if len < 16 || len > data.len() {
            break;
        }
        n += usize::from(RELEVANT.contains(&kind));
        // Messages are 4-byte aligned.
        let next = (len + 3) & !3;
        data = data.get(next..).unwrap_or(&[]);
    }
    n
}

/// Bumps `generation` after every burst of changes until `stop`; `generations` counts the
/// bumps.
pub async fn watch(
    mut generation: datapath::VxlanGeneration,
    generations: Arc<AtomicU64>,
    mut stop: watch::Receiver<bool>,
) -> Result<(), DatapathError> {
    let fd = subscribe().map_err(|e| {
        DatapathError::Config(format!(
            "subscribing to route, neighbour and link changes (netlink): {e}"
        ))
    })?;
    // SAFETY: the AsyncFd owns the socket and keeps it open while registered.
    let fd = unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }
        .map_err(|e| DatapathError::Config(format!("registering the netlink socket: {e}")))?;
    loop {
        tokio::select! {
            ready = fd.readable() => {
                let Ok(mut guard) = ready else { continue };
                let relevant = match drain(guard.get_inner()) {
                    Ok(n) => n,
                    Err(e) => {
                        warn!(error = %e, "Reading route and neighbour changes failed; learned VXLAN headers are invalidated");
                        1
                    }
                };
                guard.clear_ready();
                if relevant > 0 {
                    if let Err(e) = generation.bump() {
                        warn!(error = %e, "Could not start a new generation of learned VXLAN headers");
                    }
                    generations.fetch_add(1, Ordering::Relaxed);
                    // A burst makes one generation: what arrives meanwhile waits.
                    tokio::time::sleep(COALESCE).await;
                }
            }
            _ = stop.changed() => return Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(kind: u16, len: usize) -> Vec<u8> {
        let mut m = vec![0u8; len];
        m[..4].copy_from_slice(&(len as u32).to_ne_bytes());
        m[4..6].copy_from_slice(&kind.to_ne_bytes());
        m
    }

    #[test]
    fn only_link_route_and_neighbour_messages_count() {
        let mut d = msg(libc::RTM_NEWROUTE, 26);
        d.extend([0; 2]); // alignment padding to 28
        d.extend(msg(libc::RTM_NEWADDR, 24));
        d.extend(msg(libc::RTM_DELNEIGH, 20));
        assert_eq!(count_relevant(&d), 2);
        // A length that runs past the datagram ends the walk.
        let mut bad = msg(libc::RTM_NEWLINK, 16);
        bad[0] = 200;
        assert_eq!(count_relevant(&bad), 0);
    }
}
