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

/// Reason codes per stats map. `FP_STATS` counts codes `0..64` and `FP_STATS_EXT` codes
/// `64..128`, each laid out alike: `FP_STATS` keeps exactly the size and slots it had when it
/// was the only map, so a datapath upgraded over its pinned maps keeps its counters (the kernel
/// cannot grow a pinned map, and aya refuses one of another size).
pub const REASONS_PER_MAP: u32 = 64;
/// Stats maps: `FP_STATS` (0) and `FP_STATS_EXT` (1).
pub const STATS_MAPS: u32 = reason::SLOTS / REASONS_PER_MAP;
const _: () = assert!(STATS_MAPS * REASONS_PER_MAP == reason::SLOTS);

/// Entries in each stats map: one slot per (hook, verdict, reason), with reserved room so that
/// a new hook, verdict or reason never changes a pinned map's size or moves a slot.
pub const STATS_ENTRIES: u32 = Hook::SLOTS * Verdict::SLOTS * REASONS_PER_MAP;

/// Which stats map counts `reason` (see [`REASONS_PER_MAP`]); a code out of range is counted
/// under `reason::NONE`, in map 0.
#[inline(always)]
pub const fn stats_map(reason: u32) -> u32 {
    if reason < reason::SLOTS {
        reason / REASONS_PER_MAP
    } else {
        0
    }
}

/// Index of (hook, verdict, reason) in its stats map ([`stats_map`]). One lookup per packet.
/// A reason code out of range is counted under `reason::NONE`, never merged into another code.
#[inline(always)]
pub const fn stats_index(hook: Hook, verdict: Verdict, reason: u32) -> u32 {
    let reason = if reason < reason::SLOTS {
        reason % REASONS_PER_MAP
    } else {
        reason::NONE
    };
    ((hook as u32) * Verdict::SLOTS + (verdict as u32)) * REASONS_PER_MAP + reason
}

/// Inverse of [`stats_map`] and [`stats_index`]: (hook, verdict, reason) of an index in stats
/// map `map`, if in range.
pub const fn stats_slot(map: u32, index: u32) -> Option<(Hook, Verdict, u32)> {
    if map >= STATS_MAPS || index >= STATS_ENTRIES {
        return None;
    }
    let reason = map * REASONS_PER_MAP + index % REASONS_PER_MAP;
    let hv = index / REASONS_PER_MAP;
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
                    let (m, i) = (stats_map(r), stats_index(hook, verdict, r));
                    assert!(
                        m < STATS_MAPS && i < STATS_ENTRIES,
                        "reason {r}: expected a slot in range, got map {m} index {i}"
                    );
                    assert_eq!(stats_slot(m, i), Some((hook, verdict, r)));
                }
            }
        }
        assert_eq!(stats_slot(0, STATS_ENTRIES), None);
        assert_eq!(stats_slot(STATS_MAPS, 0), None);
        // Out-of-range codes land in the NONE slot, not in another code's.
        let beyond = reason::SLOTS + 1;
        assert_eq!(
            (
                stats_map(beyond),
                stats_index(Hook::Xdp, Verdict::Kernel, beyond)
            ),
            (0, stats_index(Hook::Xdp, Verdict::Kernel, reason::NONE))
        );
    }

    /// FP_STATS is pinned: the codes below 64 keep the size and slots of the layout from
    /// before the second map (one map of 64 reasons per (hook, verdict)).
    #[test]
    fn first_map_keeps_the_one_map_layout() {
        assert_eq!(STATS_ENTRIES, 1024, "FP_STATS must keep its pinned size");
        for hook in Hook::ALL {
            for verdict in Verdict::ALL {
                for r in 0..REASONS_PER_MAP {
                    let old = ((hook as u32) * 4 + verdict as u32) * 64 + r;
                    assert_eq!(
                        (stats_map(r), stats_index(hook, verdict, r)),
                        (0, old),
                        "reason {r} on {}/{} moved",
                        hook.name(),
                        verdict.name()
                    );
                }
            }
        }
    }
}
