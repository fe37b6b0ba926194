//! Gateway SNAT (masquerade): a new connection forwarded out of an interface with a SNAT rule
//! gets its source translated to the rule's address and an allocated port. It is handled as
//! a full-NAT connection whose backend is its own destination: the LB stage's connection and
//! alias entries, port allocation and rewrites serve it unchanged (see `conntrack::lb_create`).
//!
//! Where it leaves is asked of the kernel's FIB (`bpf_fib_lookup`, without neighbour
//! resolution) on the connection's first packet only, and only when some rule exists.

use fastpath_common::{
    ct::IFACE_F_SNAT,
    lb::{Backend, GATEWAY_ID, SVC_F_FULL_NAT, SVC_F_GATEWAY, Service},
    stats::CONFIG_F_SNAT,
};

use crate::{
    ctx::copy16,
    fib::{self, BPF_FIB_LOOKUP_SKIP_NEIGH},
    maps::{FP_CONFIG, FP_IFACE, FP_NEW_SVC, FP_SNAT, FP_SNAT_DST, FP_SVC_KEY},
    packet::Packet,
    parse::{FAMILY_IPV4, Parsed},
};

/// The gateway "service" for a new connection that arrived on `ifindex`, if the route of its
/// destination leaves through an interface with a SNAT rule for its family. Built in per-CPU
/// scratch. `FP_SVC_KEY` must hold the packet's destination (`lb::service` left it there).
#[inline(always)]
pub fn snat_service(pkt: &Packet, p: &Parsed, ifindex: u32) -> Option<&'static Service> {
    let cfg = FP_CONFIG.get(0)?;
    if cfg.flags & CONFIG_F_SNAT == 0 {
        return None;
    }
    let out = fib::lookup(pkt, p, ifindex, false, BPF_FIB_LOOKUP_SKIP_NEIGH, 0)
        .ok()?
        .ifindex;
    let iface = FP_IFACE.get(out)?;
    if iface.flags & IFACE_F_SNAT == 0 {
        return None;
    }
    let rule = FP_SNAT.get(iface.snat)?;
    let v4 = p.family == FAMILY_IPV4;
    if rule.families & if v4 { 1 } else { 2 } == 0 {
        return None;
    }
    let svc = FP_NEW_SVC.get_ptr_mut(0)?;
    // SAFETY: this CPU's slot of a per-CPU array, used by this program run only.
    let svc = unsafe { &mut *svc };
    svc.id = GATEWAY_ID;
    svc.flags = SVC_F_FULL_NAT | SVC_F_GATEWAY;
    svc.slots_len = 1;
    svc.affinity_s = 0;
    svc.snat_port_lo = rule.port_lo;
    svc.snat_port_hi = rule.port_hi;
    copy16(
        &mut svc.snat_addr,
        if v4 { &rule.addr4 } else { &rule.addr6 },
    );
    Some(svc)
}

/// The "backend" of a gateway connection: its own destination (from `FP_SVC_KEY`).
#[inline(always)]
pub fn destination() -> Option<(u32, &'static Backend)> {
    let key = FP_SVC_KEY.get_ptr(0)?;
    let b = FP_SNAT_DST.get_ptr_mut(0)?;
    // SAFETY: this CPU's slots of per-CPU arrays, used by this program run only.
    let (key, b) = unsafe { (&*key, &mut *b) };
    copy16(&mut b.addr, &key.vip);
    b.port = key.port;
    b.family = key.family;
    Some((GATEWAY_ID, b))
}
