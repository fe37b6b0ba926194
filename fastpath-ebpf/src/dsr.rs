//! Direct server return at L2: a load-balanced packet keeps its addresses and ports and is
//! sent to its backend's MAC address, out of the interface the kernel's route to the backend
//! names (`bpf_fib_lookup`, which also gives the MAC addresses; an unresolved neighbour is
//! refused rather than guessed). The backend holds the VIP itself and replies to the client
//! directly, so nothing needs translating back. The answer is kept in the connection's entry
//! (`CtEntry::hops`) for its next packets, under the route cache's rules.

use crate::{
    clock,
    ctx::HopRef,
    fib,
    packet::Packet,
    parse::Parsed,
    route::{self, Kept},
};

/// Rewrites the packet's MAC addresses for the backend in this CPU's NAT plan and records
/// the interface to redirect it to (`route::redirect_to`): from the connection's kept hop
/// (`hop`) when it holds at `now` (`clock::now`; 0: not read yet), else from the FIB, then
/// kept. False (nothing written): no route or no resolved neighbour.
#[inline(always)]
pub fn forward(pkt: &Packet, p: &Parsed, ifindex: u32, now: u64, hop: &HopRef) -> bool {
    let now = if now == 0 { clock::now() } else { now };
    // SAFETY: a live conntrack entry's hop (valid for this program run) or this CPU's
    // scratch one (see `route::forward`).
    let known = unsafe { &mut *hop.hop };
    let generation = fib::generation();
    // No length: the frame keeps its size.
    if route::holds_or_shared(hop, known, ifindex, now, generation, 0, p.family) {
        if !route::store_macs(pkt, known.macs) {
            return false;
        }
        route::redirect_to(u32::from(known.out_ifindex));
        return true;
    }
    let Ok(answer) = fib::lookup(pkt, p, ifindex, true, 0, 0) else {
        return false;
    };
    let (out, macs) = (answer.ifindex, answer.macs());
    if !route::store_macs(pkt, macs) {
        return false;
    }
    if hop.in_entry {
        // No length was asked (the frame keeps its size): fits 0, so the L3 stage never
        // takes this answer for a routed packet.
        route::keep(
            hop,
            known,
            Kept {
                ifindex,
                out,
                fits: 0,
                macs,
                now,
                generation,
                family: p.family,
            },
        );
    }
    route::redirect_to(out);
    true
}
