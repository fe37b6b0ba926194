//! Direct server return at L2: a load-balanced packet keeps its addresses and ports and is
//! sent to its backend's MAC address, out of the interface the kernel's route to the backend
//! names (`bpf_fib_lookup`, which also gives the MAC addresses; an unresolved neighbour is
//! refused rather than guessed). The backend holds the VIP itself and replies to the client
//! directly, so nothing needs translating back.

use crate::{gateway, maps::FP_NAT, packet::Packet, parse::Parsed};

/// Rewrites the packet's MAC addresses for the backend in this CPU's NAT plan and records
/// the interface to redirect it to (`NatPlan::out_ifindex`). False (nothing written): no
/// route or no resolved neighbour.
#[inline(always)]
pub fn forward(pkt: &Packet, p: &Parsed, ifindex: u32) -> bool {
    let Some(route) = gateway::fib_lookup(pkt, p, ifindex, true, 0) else {
        return false;
    };
    let Some(plan) = FP_NAT.get_ptr_mut(0) else {
        return false;
    };
    if !pkt.store(0, route.macs()) {
        return false;
    }
    // SAFETY: this CPU's slot of a per-CPU array, used by this program run only.
    unsafe { (*plan).out_ifindex = route.ifindex };
    true
}

/// The interface `forward` chose for this packet.
#[inline(always)]
pub fn out_ifindex() -> u32 {
    match FP_NAT.get(0) {
        Some(plan) => plan.out_ifindex,
        None => 0,
    }
}
