//! Counter and config layouts, and the stats map indexing scheme.

use crate::reason;

/// Which entry point saw the packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Hook {
    Xdp = 0,
    TcIngress = 1,
    TcEgress = 2,
}

impl Hook {
    pub const COUNT: u32 = 3;
    /// Slots reserved for hooks in the stats map (room for one more without a layout change).
    pub const SLOTS: u32 = 4;
    pub const ALL: [Hook; 3] = [Hook::Xdp, Hook::TcIngress, Hook::TcEgress];

    pub const fn name(self) -> &'static str {
        match self {
            Hook::Xdp => "xdp",
            Hook::TcIngress => "tc_ingress",
            Hook::TcEgress => "tc_egress",
        }
    }
}

/// What the datapath did with the packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Verdict {
    /// Handed to the Linux stack (XDP_PASS / TC_ACT_OK): the slow path.
    Kernel = 0,
    /// Dropped (XDP_DROP / TC_ACT_SHOT).
    Drop = 1,
    /// Forwarded by the fast path (TX / redirect with rewritten headers).
    Forward = 2,
}

impl Verdict {
    pub const COUNT: u32 = 3;
    /// Slots reserved for verdicts in the stats map (room for one more without a layout change).
    pub const SLOTS: u32 = 4;
    pub const ALL: [Verdict; 3] = [Verdict::Kernel, Verdict::Drop, Verdict::Forward];

    pub const fn name(self) -> &'static str {
        match self {
            Verdict::Kernel => "kernel",
            Verdict::Drop => "drop",
            Verdict::Forward => "forward",
        }
    }
}

/// Entries in the stats map: one slot per (hook, verdict, reason), with reserved room so that
/// a new hook, verdict or reason never changes the pinned map's size or moves a slot.
pub const STATS_ENTRIES: u32 = Hook::SLOTS * Verdict::SLOTS * reason::SLOTS;

/// Index of (hook, verdict, reason) in the stats map. One lookup per packet. A reason code
/// out of range is counted under `reason::NONE`, never merged into another code.
#[inline(always)]
pub const fn stats_index(hook: Hook, verdict: Verdict, reason: u32) -> u32 {
    let reason = if reason < reason::SLOTS {
        reason
    } else {
        reason::NONE
    };
    ((hook as u32) * Verdict::SLOTS + (verdict as u32)) * reason::SLOTS + reason
}

/// Inverse of [`stats_index`]: (hook, verdict, reason) of an index, if in range.
pub const fn stats_slot(index: u32) -> Option<(Hook, Verdict, u32)> {
    if index >= STATS_ENTRIES {
        return None;
    }
    let reason = index % reason::SLOTS;
    let hv = index / reason::SLOTS;
    let (h, v) = (hv / Verdict::SLOTS, hv % Verdict::SLOTS);
    if h >= Hook::COUNT || v >= Verdict::COUNT {
        return None; // reserved slot
    }
    Some((Hook::ALL[h as usize], Verdict::ALL[v as usize], reason))
}

/// A packet and byte counter. Per-CPU in the map; userspace sums the CPUs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct Counter {
    pub packets: u64,
    pub bytes: u64,
}
const _: () = assert!(core::mem::size_of::<Counter>() == 16);
const _: () = assert!(core::mem::offset_of!(Counter, packets) == 0);
const _: () = assert!(core::mem::offset_of!(Counter, bytes) == 8);

/// Runtime knobs read by the datapath (index 0 of the config array). Append-only.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct DatapathConfig {
    /// Bit set of `CONFIG_F_*`.
    pub flags: u32,
    /// Conntrack idle timeouts in seconds, indexed by `ct::timeout_slot`; written by the
    /// daemon from its config so that every reader (CLI, expiry) uses the same values.
    pub ct_timeouts_s: [u32; crate::ct::timeout_slot::COUNT],
    /// Reserved for later knobs; zero.
    pub _reserved: [u32; 15 - crate::ct::timeout_slot::COUNT],
}
const _: () = assert!(core::mem::size_of::<DatapathConfig>() == 64);
const _: () = assert!(core::mem::offset_of!(DatapathConfig, flags) == 0);

/// Drop malformed packets (with their reason) instead of handing them to the kernel.
pub const CONFIG_F_DROP_MALFORMED: u32 = 1 << 0;
/// Some interface has a gateway SNAT rule: new forwarded connections look up their route
/// (no rule: no lookup).
pub const CONFIG_F_SNAT: u32 = 1 << 1;
/// Some interface is a VXLAN device (`IFACE_F_VXLAN`): UDP that no stage took is looked at
/// for decapsulation (none: no look).
pub const CONFIG_F_VXLAN: u32 = 1 << 2;

#[cfg(feature = "user")]
mod pod {
    // SAFETY: both are #[repr(C)] of fixed-width integers with no padding (sizes asserted above).
    unsafe impl aya::Pod for super::Counter {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::DatapathConfig {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_round_trips() {
        for hook in Hook::ALL {
            for verdict in Verdict::ALL {
                for r in 0..reason::COUNT {
                    let i = stats_index(hook, verdict, r);
                    assert!(i < STATS_ENTRIES);
                    assert_eq!(stats_slot(i), Some((hook, verdict, r)));
                }
            }
        }
        assert_eq!(stats_slot(STATS_ENTRIES), None);
        // Out-of-range codes land in the NONE slot, not in another code's.
        assert_eq!(
            stats_index(Hook::Xdp, Verdict::Kernel, reason::SLOTS + 1),
            stats_index(Hook::Xdp, Verdict::Kernel, reason::NONE)
        );
    }
}
