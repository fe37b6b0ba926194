//! The daemon's runtime knobs (`FP_CONFIG[0]`) as the stages read them. A leaf under `maps`:
//! any stage may ask, without importing the pipeline that calls it.

use fastpath_common::{
    DatapathConfig,
    stats::{CONFIG_F_DROP_MALFORMED, CONFIG_F_VXLAN},
};

use crate::maps::FP_CONFIG;

/// `datapath.drop_malformed`: malformed (and hostile) packets are dropped rather than handed
/// to the kernel. Read only on those packets' paths, never per ordinary packet.
#[inline(always)]
pub fn drop_malformed() -> bool {
    match FP_CONFIG.get(0) {
        Some(DatapathConfig { flags, .. }) => flags & CONFIG_F_DROP_MALFORMED != 0,
        None => false,
    }
}

/// Whether some interface is a VXLAN device (`CONFIG_F_VXLAN`).
#[inline(always)]
pub fn vxlan_configured() -> bool {
    FP_CONFIG
        .get(0)
        .is_some_and(|c| c.flags & CONFIG_F_VXLAN != 0)
}
