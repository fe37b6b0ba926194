//! fastpath datapath entry points: thin wrappers that build a [`Packet`], run the shared
//! pipeline, count the outcome once, and translate the verdict for their hook.
#![no_std]
#![no_main]

mod maps;
mod packet;
mod parse;
mod pipeline;
mod stats;

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT, xdp_action},
    macros::{classifier, xdp},
    programs::{TcContext, XdpContext},
};
use fastpath_common::{Hook, Verdict};

use crate::packet::Packet;

/// Bytes made linear in TC before parsing: every header the parser reads fits in it for
/// ordinary packets (Ethernet + 2 VLAN + IPv6 + a few extension headers + TCP).
const PULL_LEN: u32 = 256;

#[xdp]
pub fn fastpath_xdp(ctx: XdpContext) -> u32 {
    // verifier: `len` is read from the context a second time, volatile, so LLVM cannot derive
    // one bounds check from another through it (it otherwise drops checks the verifier needs).
    // SAFETY: `ctx.ctx` points at the kernel's xdp_md for the duration of the program.
    let end = unsafe { core::ptr::read_volatile(&(*ctx.ctx).data_end) } as usize;
    let len = end.saturating_sub(ctx.data());
    let pkt = Packet {
        data: ctx.data(),
        data_end: ctx.data_end(),
        len,
    };
    let (verdict, reason) = pipeline::run(&pkt);
    stats::count(Hook::Xdp, verdict, reason, len);
    match verdict {
        Verdict::Drop => xdp_action::XDP_DROP,
        // No stage forwards yet; a forward verdict without a rewrite would be a bug, so it
        // goes to the kernel like everything unhandled.
        Verdict::Kernel | Verdict::Forward => xdp_action::XDP_PASS,
    }
}

#[classifier]
pub fn fastpath_tc_ingress(ctx: TcContext) -> i32 {
    tc(ctx, Hook::TcIngress)
}

#[classifier]
pub fn fastpath_tc_egress(ctx: TcContext) -> i32 {
    tc(ctx, Hook::TcEgress)
}

#[inline(always)]
fn tc(ctx: TcContext, hook: Hook) -> i32 {
    let len = ctx.len();
    let want = if len < PULL_LEN { len } else { PULL_LEN };
    if ((ctx.data_end() - ctx.data()) as u32) < want {
        // On failure (skb allocation) the parser reports headers_not_linear and the kernel
        // gets the packet; that is rare enough to log rather than count.
        if let Err(err) = ctx.pull_data(want) {
            aya_log_ebpf::warn!(&ctx, "bpf_skb_pull_data({}) failed: {}", want, err);
        }
    }
    let pkt = Packet {
        data: ctx.data(),
        data_end: ctx.data_end(),
        len: len as usize,
    };
    let (verdict, reason) = pipeline::run(&pkt);
    stats::count(hook, verdict, reason, len as usize);
    match verdict {
        Verdict::Drop => TC_ACT_SHOT,
        Verdict::Kernel | Verdict::Forward => TC_ACT_OK,
    }
}

/// Empty XDP program: the floor `cargo xtask bench` measures in the same run. Never attached.
#[xdp]
pub fn bench_floor_xdp(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_PASS
}

/// Empty TC program: the floor for the TC entry points. Never attached.
#[classifier]
pub fn bench_floor_tc(_ctx: TcContext) -> i32 {
    TC_ACT_OK
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // verifier: unreachable in a verified program; the loop satisfies the `!` type.
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
