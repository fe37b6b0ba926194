//! Route, rule, nexthop, neighbour (and VXLAN FDB) and link changes end the generation of
//! learned VXLAN headers and cached routes: the outer headers the datapath learned from the
//! kernel's vxlan devices depend on the FDB, the underlay's route and its neighbour, so after
//! any such change each overlay next hop's next packet takes the kernel's path once and
//! teaches them again. No flush: the datapath compares generations per packet.
//!
//! The daemon listens on a netlink route socket (the multicast groups of links, neighbours,
//! IPv4/IPv6 routes and rules, and nexthops), drains what arrived, and bumps `FP_VXLAN_GEN`
//! once per burst, at most every `COALESCE`, saying in the same write whether the FIB answers
//! by destination alone ([`FibShape`]).
//!
//! Link changes also refresh `FP_PEER`, the links whose peer is in another namespace (veth
//! and netkit devices: pods' and containers' links), to which TC hands forwarded packets
//! straight into the peer's ingress. A link moved between namespaces is in the next burst.

use std::{
    io,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use tokio::{io::unix::AsyncFd, sync::watch};
use tracing::{info, warn};

use crate::{
    datapath::{self, DatapathError},
    fibshape::{FibShape, RTM_DELNEXTHOP, RTM_NEWNEXTHOP},
};

/// The least time between two generations (a burst of changes makes one).
const COALESCE: Duration = Duration::from_millis(100);

/// Netlink message types that change what learned headers depend on.
const RELEVANT: [u16; 10] = [
    libc::RTM_NEWLINK,
    libc::RTM_DELLINK,
    libc::RTM_NEWROUTE,
    libc::RTM_DELROUTE,
    libc::RTM_NEWNEIGH,
    libc::RTM_DELNEIGH,
    libc::RTM_NEWRULE,
    libc::RTM_DELRULE,
    RTM_NEWNEXTHOP,
    RTM_DELNEXTHOP,
];

/// Multicast groups (`1 << (RTNLGRP_* - 1)`) of IPv6 rules (19) and nexthops (32), which
/// `libc` has no `RTMGRP_*` for.
const GROUP_IPV6_RULE: u32 = 1 << 18;
const GROUP_NEXTHOP: u32 = 1 << 31;

/// A netlink route socket (`flags`: SOCK_NONBLOCK or 0).
fn route_socket(flags: i32) -> io::Result<OwnedFd> {
    // SAFETY: a plain socket(2) call; the fd is owned right below.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC | flags,
            libc::NETLINK_ROUTE,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A netlink route socket subscribed to link, neighbour, route, rule and nexthop changes,
/// non-blocking.
pub fn subscribe() -> io::Result<OwnedFd> {
    let fd = route_socket(libc::SOCK_NONBLOCK)?;
    // SAFETY: sockaddr_nl is plain old data; all zeroes is valid.
    let mut sa: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    sa.nl_family = libc::AF_NETLINK as u16;
    sa.nl_groups = (libc::RTMGRP_LINK
        | libc::RTMGRP_NEIGH
        | libc::RTMGRP_IPV4_ROUTE
        | libc::RTMGRP_IPV6_ROUTE
        | libc::RTMGRP_IPV4_RULE) as u32
        | GROUP_IPV6_RULE
        | GROUP_NEXTHOP;
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

/// What one drain of the subscribed socket saw.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// Link, route and neighbour messages.
    pub relevant: usize,
    /// Link messages among them.
    pub links: usize,
}

/// Reads everything queued on `fd`, each message shown to `shape` too. A lost burst (the
/// socket's buffer overran) counts as a link change: anything may have changed.
pub fn drain(fd: &OwnedFd, shape: &mut FibShape) -> io::Result<Changes> {
    let mut buf = vec![0u8; 64 * 1024];
    let mut seen = Changes::default();
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
                Some(libc::EAGAIN) => return Ok(seen),
                Some(libc::ENOBUFS) => {
                    seen.relevant += 1;
                    seen.links += 1;
                    shape.lost();
                }
                Some(libc::EINTR) => {}
                _ => return Err(e),
            }
            continue;
        }
        for (kind, _, payload) in messages(&buf[..n as usize]) {
            shape.observe(kind, payload);
            seen.relevant += usize::from(RELEVANT.contains(&kind));
            seen.links += usize::from(matches!(kind, libc::RTM_NEWLINK | libc::RTM_DELLINK));
        }
    }
}

/// The netlink messages of one datagram: (type, flags, payload after the 16-byte header).
/// The walk ends at a length that runs past the datagram.
pub(crate) fn messages(mut data: &[u8]) -> impl Iterator<Item = (u16, u16, &[u8])> {
    std::iter::from_fn(move || {
        let len = u32::from_ne_bytes(data.get(..4)?.try_into().ok()?) as usize;
        let kind = u16::from_ne_bytes(data.get(4..6)?.try_into().ok()?);
        let flags = u16::from_ne_bytes(data.get(6..8)?.try_into().ok()?);
        let payload = data.get(16..len)?;
        // Messages are 4-byte aligned.
        data = data.get((len + 3) & !3..).unwrap_or(&[]);
        Some((kind, flags, payload))
    })
}

/// Routing attributes (`struct rtattr`) in `data`: (type, payload).
pub(crate) fn attributes(data: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    let mut data = data;
    std::iter::from_fn(move || {
        let len = usize::from(u16::from_ne_bytes(data.get(..2)?.try_into().ok()?));
        let kind = u16::from_ne_bytes(data.get(2..4)?.try_into().ok()?);
        let payload = data.get(4..len)?;
        data = data.get((len + 3) & !3..).unwrap_or(&[]);
        Some((kind, payload))
    })
}

/// `linux/if_link.h`: a link's kind-specific information (nested), its kind, and the
/// namespace id its peer (or lower device) lives in when that is not the link's own.
const IFLA_LINKINFO: u16 = 18;
const IFLA_INFO_KIND: u16 = 1;
const IFLA_LINK_NETNSID: u16 = 37;
/// The attribute type without its nested flag (`NLA_F_NESTED`).
pub(crate) const NLA_TYPE_MASK: u16 = 0x3fff;
/// Kinds of link whose peer `bpf_redirect_peer` reaches.
const PEER_KINDS: [&[u8]; 2] = [b"veth\0", b"netkit\0"];

/// The ifindex of the link an RTM_NEWLINK payload (`struct ifinfomsg` and its attributes)
/// describes, when it is a veth or netkit device whose peer lives in another namespace.
fn foreign_peer(link: &[u8]) -> Option<u32> {
    let index = i32::from_ne_bytes(link.get(4..8)?.try_into().ok()?);
    let (mut kind_ok, mut elsewhere) = (false, false);
    for (kind, value) in attributes(link.get(16..)?) {
        match kind & NLA_TYPE_MASK {
            IFLA_LINK_NETNSID => elsewhere = true,
            IFLA_LINKINFO => {
                kind_ok = attributes(value)
                    .any(|(k, v)| k & NLA_TYPE_MASK == IFLA_INFO_KIND && PEER_KINDS.contains(&v));
            }
            _ => {}
        }
    }
    (kind_ok && elsewhere).then_some(u32::try_from(index).ok()?)
}

/// The links of this namespace that are veth or netkit devices whose peer lives in another
/// namespace (a netlink dump of every link).
pub fn foreign_peer_links() -> io::Result<Vec<u32>> {
    let mut links = Vec::new();
    // struct ifinfomsg, all zero: every family, every link. A dump a change interrupted
    // still lists every link that stayed; the change is in the next burst.
    dump(libc::RTM_GETLINK, &[0; 16], |kind, payload| {
        if kind == libc::RTM_NEWLINK {
            links.extend(foreign_peer(payload));
        }
    })?;
    Ok(links)
}

/// Asks the kernel for a dump of `request` (`RTM_GET*`, with `header`: the family's request
/// struct) and hands each message (type, payload) to `each`, until the dump is done. `Ok(false)`:
/// a change interrupted it (`NLM_F_DUMP_INTR`), so it may have missed an object that did not
/// change.
pub(crate) fn dump(request: u16, header: &[u8], each: impl FnMut(u16, &[u8])) -> io::Result<bool> {
    exchange(request, libc::NLM_F_DUMP as u16, header, each)
}

/// Sends one request (`kind` with `flags`, then `body`: the family's struct and its
/// attributes) and waits for the kernel's acknowledgement: `Ok` on it, its error otherwise.
pub(crate) fn request(kind: u16, flags: u16, body: &[u8]) -> io::Result<()> {
    exchange(kind, flags | libc::NLM_F_ACK as u16, body, |_, _| {}).map(drop)
}

/// Sends `kind` with `flags | NLM_F_REQUEST` and `body` on a socket of its own, then hands
/// each message of the answer (type, payload) to `each` until the kernel says done or
/// acknowledges; `Ok(false)` when a dump was interrupted (`NLM_F_DUMP_INTR`).
fn exchange(
    kind: u16,
    flags: u16,
    body: &[u8],
    mut each: impl FnMut(u16, &[u8]),
) -> io::Result<bool> {
    let fd = route_socket(0)?;
    // struct nlmsghdr (length, type, flags, sequence, port id), then the body.
    let len = 16 + body.len();
    let mut req = vec![0u8; len];
    req[..4].copy_from_slice(&(len as u32).to_ne_bytes());
    req[4..6].copy_from_slice(&kind.to_ne_bytes());
    req[6..8].copy_from_slice(&(flags | libc::NLM_F_REQUEST as u16).to_ne_bytes());
    req[8..12].copy_from_slice(&1u32.to_ne_bytes());
    req[16..].copy_from_slice(body);
    // SAFETY: the buffer is valid for its length; the kernel is the default destination.
    if unsafe { libc::send(fd.as_raw_fd(), req.as_ptr().cast(), req.len(), 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut buf = vec![0u8; 64 * 1024];
    let mut whole = true;
    loop {
        // SAFETY: the buffer is valid for its length.
        let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "netlink closed the socket before answering",
            ));
        }
        for (kind, flags, payload) in messages(&buf[..n as usize]) {
            whole &= i32::from(flags) & libc::NLM_F_DUMP_INTR == 0;
            match i32::from(kind) {
                libc::NLMSG_DONE => return Ok(whole),
                // An acknowledgement (code 0) or an error (minus an errno).
                libc::NLMSG_ERROR => {
                    let code = payload
                        .get(..4)
                        .map_or(0, |b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
                    return match code {
                        0 => Ok(whole),
                        c => Err(io::Error::from_raw_os_error(-c)),
                    };
                }
                _ => each(kind, payload),
            }
        }
    }
}

/// Bumps `generation` after every burst of changes until `stop`; `generations` counts the
/// bumps. Keeps `peers` (`FP_PEER`) to the links whose peer is in another namespace: at the
/// start and after every burst with a link change.
pub async fn watch(
    generation: datapath::VxlanGeneration,
    mut peers: datapath::PeerLinks,
    generations: Arc<AtomicU64>,
    mut stop: watch::Receiver<bool>,
) -> Result<(), DatapathError> {
    let mut generation = Generations {
        generation,
        count: generations,
        said: None,
    };
    // Nobody follows the FIB's shape until the dumps below say it: new connections ask the
    // FIB meanwhile (and for good if the watcher cannot start or stops).
    generation.bump(None);
    let fd = subscribe().map_err(|e| {
        DatapathError::Config(format!(
            "subscribing to route, neighbour and link changes (netlink): {e}"
        ))
    })?;
    // SAFETY: the AsyncFd owns the socket and keeps it open while registered.
    let fd = unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }
        .map_err(|e| DatapathError::Config(format!("registering the netlink socket: {e}")))?;
    // Subscribed first: a link, rule or route that changes during the dumps is in the next
    // burst.
    refresh_peers(&mut peers);
    let mut shape = settled(None, None).await;
    generation.bump(Some(&shape));
    loop {
        let due = shape.due();
        tokio::select! {
            ready = fd.readable() => {
                let Ok(mut guard) = ready else { continue };
                let seen = match drain(guard.get_inner(), &mut shape) {
                    Ok(seen) => seen,
                    Err(e) => {
                        warn!(error = %e, "Reading route, neighbour and link changes failed; learned VXLAN headers are invalidated");
                        shape.lost();
                        Changes { relevant: 1, links: 1 }
                    }
                };
                guard.clear_ready();
                if seen.links > 0 {
                    refresh_peers(&mut peers);
                }
                if seen.relevant > 0 {
                    shape = settled(Some(shape), Some(Instant::now())).await;
                    generation.bump(Some(&shape));
                    // A burst makes one generation: what arrives meanwhile waits.
                    tokio::time::sleep(COALESCE).await;
                }
            }
            () = tokio::time::sleep_until(due.unwrap_or_else(Instant::now).into()), if due.is_some() => {
                let before = shape.per_destination();
                shape = settled(Some(shape), Some(Instant::now())).await;
                if shape.per_destination() != before {
                    generation.bump(Some(&shape));
                }
            }
            _ = stop.changed() => {
                generation.bump(None);
                return Ok(());
            }
        }
    }
}

/// The route generation as the watcher keeps it (`count`: bumps made), saying whether the FIB
/// answers by destination alone; `said`: what the log last said of that.
struct Generations {
    generation: datapath::VxlanGeneration,
    count: Arc<AtomicU64>,
    said: Option<bool>,
}

impl Generations {
    /// Starts a new generation saying what `shape` says, or "no" where nobody knows (`None`);
    /// logs a known answer when it changes.
    fn bump(&mut self, shape: Option<&FibShape>) {
        let per_dst = shape.is_some_and(FibShape::per_destination);
        if let Some(shape) = shape
            && self.said != Some(per_dst)
        {
            match shape.why_not() {
                None => info!(
                    "The FIB answers by destination alone: new connections share their backend's route"
                ),
                Some(why) => info!(why, "New connections ask the FIB each"),
            }
            self.said = Some(per_dst);
        }
        if let Err(e) = self.generation.bump(per_dst) {
            warn!(error = %e, "Could not start a new generation of learned VXLAN headers and cached routes");
        }
        self.count.fetch_add(1, Ordering::Relaxed);
    }
}

/// `shape` with what changed dumped again at `at` (see `FibShape::settle`), or this
/// namespace's shape from scratch: netlink dumps, off the runtime's threads (a table may
/// hold a million routes).
async fn settled(shape: Option<FibShape>, at: Option<Instant>) -> FibShape {
    let dumped = tokio::task::spawn_blocking(move || match shape {
        Some(mut s) => {
            s.settle(at);
            s
        }
        None => FibShape::now(),
    });
    // A dump that panicked leaves the shape unknown: every new connection asks the FIB.
    dumped.await.unwrap_or_else(|_| FibShape::unknown())
}

/// `FP_PEER` from a fresh dump of the links; when the dump fails, empty (a plain redirect
/// suits every link, a peer redirect only these).
fn refresh_peers(peers: &mut datapath::PeerLinks) {
    let links = foreign_peer_links().unwrap_or_else(|e| {
        warn!(error = %e, "Listing links (netlink) failed; packets forwarded at TC go out of their interface, not straight to its peer");
        Vec::new()
    });
    if let Err(e) = peers.set(&links) {
        warn!(error = %e, "Could not write FP_PEER");
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

    fn kinds(data: &[u8]) -> Vec<u16> {
        messages(data).map(|(k, _, _)| k).collect()
    }

    #[test]
    fn messages_walk_aligned_and_stop_at_a_length_past_the_datagram() {
        let mut d = msg(libc::RTM_NEWROUTE, 26);
        d.extend([0; 2]); // alignment padding to 28
        d.extend(msg(libc::RTM_NEWADDR, 24));
        d.extend(msg(libc::RTM_DELNEIGH, 20));
        assert_eq!(
            kinds(&d),
            [libc::RTM_NEWROUTE, libc::RTM_NEWADDR, libc::RTM_DELNEIGH]
        );
        let mut bad = msg(libc::RTM_NEWLINK, 16);
        bad[0] = 200;
        assert!(kinds(&bad).is_empty());
        assert!(kinds(&[1, 2, 3]).is_empty());
    }

    fn attr(kind: u16, value: &[u8]) -> Vec<u8> {
        let mut a = ((4 + value.len()) as u16).to_ne_bytes().to_vec();
        a.extend(kind.to_ne_bytes());
        a.extend(value);
        a.resize((a.len() + 3) & !3, 0);
        a
    }

    /// An RTM_NEWLINK payload: ifinfomsg with `index`, then `attrs`.
    fn link(index: i32, attrs: &[Vec<u8>]) -> Vec<u8> {
        let mut l = vec![0u8; 16];
        l[4..8].copy_from_slice(&index.to_ne_bytes());
        for a in attrs {
            l.extend(a);
        }
        l
    }

    #[test]
    fn a_veth_or_netkit_link_with_its_peer_elsewhere_is_a_foreign_peer() {
        let info = |kind: &[u8]| attr(IFLA_LINKINFO | 0x8000, &attr(IFLA_INFO_KIND, kind));
        let netnsid = attr(IFLA_LINK_NETNSID, &0i32.to_ne_bytes());
        let mtu = attr(4, &1500u32.to_ne_bytes());
        assert_eq!(
            foreign_peer(&link(7, &[mtu.clone(), info(b"veth\0"), netnsid.clone()])),
            Some(7)
        );
        assert_eq!(
            foreign_peer(&link(8, &[netnsid.clone(), info(b"netkit\0")])),
            Some(8)
        );
        // Both peers in this namespace: no netnsid.
        assert_eq!(foreign_peer(&link(9, &[mtu, info(b"veth\0")])), None);
        // A vxlan device on an underlay in another namespace is not a peer.
        assert_eq!(
            foreign_peer(&link(10, &[info(b"vxlan\0"), netnsid.clone()])),
            None
        );
        // A truncated attribute ends the walk: nothing is taken from it.
        let mut cut = link(11, &[netnsid, info(b"veth\0")]);
        cut.truncate(cut.len() - 4);
        assert_eq!(foreign_peer(&cut), None);
        assert_eq!(foreign_peer(&[0; 6]), None);
    }

    /// This namespace's loopback is no veth.
    #[test]
    fn the_dump_of_this_namespace_lists_no_loopback() {
        let links = foreign_peer_links().expect("a netlink link dump");
        assert!(!links.contains(&1), "{links:?}");
    }
}
