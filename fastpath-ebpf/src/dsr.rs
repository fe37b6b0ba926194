//! Direct server return at L2: a load-balanced packet keeps its addresses and ports and is
//! sent to its backend's MAC address, out of the interface the kernel's route to the backend
//! names (`bpf_fib_lookup`, which also gives the MAC addresses; an unresolved neighbour is
//! refused rather than guessed). The backend holds the VIP itself and replies to the client
//! directly, so nothing needs translating back.

use crate::{fib, packet::Packet, parse::Parsed, route};

/// Rewrites the packet's MAC addresses for the backend in this CPU's NAT plan and records
/// the interface to redirect it to (`route::redirect_to`). False (nothing written): no
/// route or no resolved neighbour.
#[inline(always)]
pub fn forward(pkt: &Packet, p: &Parsed, ifindex: u32) -> bool {
    let Ok(route) = fib::lookup(pkt, p, ifindex, true, 0, 0) else {
        return false;
    };
    if !pkt.store(0, route.macs()) {
        return false;
    }
    route::redirect_to(route.ifindex);
    true
}
