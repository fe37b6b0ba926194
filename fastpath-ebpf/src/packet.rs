//! Checked access to packet bytes, the same for XDP and TC.
//!
//! All header reads go through [`Packet::load`]: it bounds the offset (so the verifier can
//! track it) and checks the read against `data_end` before touching memory.

use aya_ebpf::{
    EbpfContext as _,
    programs::{TcContext, XdpContext},
};
use core::mem::size_of;

/// Largest header offset the parser ever reads at. Bounds variable offsets for the verifier.
pub const MAX_HDR_OFF: usize = 1024;
/// The smallest all-ones mask that keeps every offset up to [`MAX_HDR_OFF`].
const HDR_OFF_MASK: usize = 2 * MAX_HDR_OFF - 1;

/// `off` (at most [`MAX_HDR_OFF`]) masked in the register the packet address is computed
/// from, where LLVM cannot see it and drop it as redundant.
///
/// verifier: a comparison bounds only the register it is made on (and, before Linux 6.8, not
/// a stack slot the value was spilled to without an ID), so LLVM's reload of the offset after
/// `off > MAX_HDR_OFF` came back unbounded on 6.1, and a packet pointer with an unbounded
/// variable part gets no range from the `data_end` check. A masked value carries its bound
/// through every copy, spill and fill. One ALU instruction.
#[inline(always)]
fn bounded(off: usize) -> usize {
    // perf: a constant offset is bounded already, and stays an immediate of the access.
    if core::intrinsics::is_val_statically_known(off) {
        return off;
    }
    let mut off = off;
    // SAFETY: one AND of a register with a constant; no memory, no control flow.
    unsafe {
        core::arch::asm!(
            "{0} &= {mask}",
            inout(reg) off,
            mask = const HDR_OFF_MASK,
            options(pure, nomem, nostack),
        );
    }
    off
}

/// `x & mask`, masked where LLVM cannot see it: for an index whose bound the verifier must
/// see in the register it is used from (see [`bounded`]). One ALU instruction and the mask's
/// load.
#[inline(always)]
pub fn masked(x: usize, mask: usize) -> usize {
    let mut x = x;
    // SAFETY: one AND of two registers; no memory, no control flow.
    unsafe {
        core::arch::asm!("{0} &= {1}", inout(reg) x, in(reg) mask, options(pure, nomem, nostack))
    };
    x
}

/// `x`, through a volatile stack slot: LLVM no longer knows how it relates to the values it
/// came from, so it keeps the bounds checks made on it (verifier). Not an empty `asm!`: that
/// leaves BTF line info without an instruction, which the kernel refuses.
#[inline(always)]
pub fn opaque(x: usize) -> usize {
    let slot = x;
    // SAFETY: a read of a local.
    unsafe { core::ptr::read_volatile(&slot) }
}

/// The bytes of one packet as the hook presents them.
pub struct Packet {
    /// First byte of the frame (Ethernet header).
    pub data: usize,
    /// One past the last directly readable byte (the skb's linear area in TC).
    pub data_end: usize,
    /// Full frame length (`skb->len` in TC; `data_end - data` in XDP).
    pub len: usize,
    /// The program's context (for helpers that take it, e.g. `bpf_fib_lookup`).
    pub ctx: *mut core::ffi::c_void,
}

impl Packet {
    /// The same skb's bounds read again (TC only): after a helper that may move packet data
    /// (the verifier then forgets every packet pointer it knew).
    #[inline(always)]
    pub fn reread_skb(&self) -> Packet {
        let skb = self.ctx as *const aya_ebpf::bindings::__sk_buff;
        // SAFETY: at TC, `ctx` is the kernel's __sk_buff for the duration of the program.
        let (data, data_end) = unsafe { ((*skb).data, (*skb).data_end) };
        Packet {
            data: data as usize,
            data_end: data_end as usize,
            len: self.len,
            ctx: self.ctx,
        }
    }

    /// A copy of the `T` at `off`, or `None` if it is not inside the readable bytes.
    /// `T` must be a plain byte array type (alignment 1).
    #[inline(always)]
    pub fn load<T: Copy>(&self, off: usize) -> Option<T> {
        // verifier: an explicit upper bound keeps the offset's range finite.
        if off > MAX_HDR_OFF {
            return None;
        }
        let at = self.data + bounded(off);
        if at + size_of::<T>() > self.data_end {
            return None;
        }
        // SAFETY: the read lies within [data, data_end), checked just above; T is a byte
        // array, so any alignment is fine.
        Some(unsafe { core::ptr::read_unaligned(at as *const T) })
    }

    /// [`Packet::load`], read where it stands: volatile, so LLVM cannot sink the read below
    /// later code, away from its bounds check (the verifier then sees a packet pointer that
    /// was never checked). For functions with many loads whose values are used late.
    #[inline(always)]
    pub fn load_now<T: Copy>(&self, off: usize) -> Option<T> {
        if off > MAX_HDR_OFF {
            return None;
        }
        let at = self.data + bounded(off);
        if at + size_of::<T>() > self.data_end {
            return None;
        }
        // SAFETY: as in `load`; a volatile read of the same bytes.
        Some(unsafe { core::ptr::read_volatile(at as *const T) })
    }

    /// Writes `v` at `off`; false (nothing written) if it is not inside the writable bytes.
    /// In TC, the verifier's prologue unclones a cloned skb for programs that write, and the
    /// writable bytes are the linear area. `T` is a byte array.
    #[inline(always)]
    pub fn store<T: Copy>(&self, off: usize, v: T) -> bool {
        if off > MAX_HDR_OFF {
            return false;
        }
        let at = self.data + bounded(off);
        if at + size_of::<T>() > self.data_end {
            return false;
        }
        // SAFETY: the write lies within [data, data_end), checked just above; T is a byte
        // array, so any alignment is fine; XDP packet memory is writable.
        unsafe { core::ptr::write_unaligned(at as *mut T, v) };
        true
    }

    /// Writes `N` words (as they lie in memory) at `off`, with one bounds check; false
    /// (nothing written) if they are not inside the writable bytes. perf: a byte-array store
    /// of 16 or more bytes compiles to an out-of-line memmove call.
    #[inline(always)]
    pub fn store_words<const N: usize>(&self, off: usize, w: [u64; N]) -> bool {
        let Some(p) = self.words_at::<N>(off) else {
            return false;
        };
        let mut i = 0;
        while i < N {
            // SAFETY: every 8-byte write lies within [data, data_end), checked just above;
            // the target allows unaligned stores (see build.rs); XDP packet memory is
            // writable.
            unsafe { core::ptr::write_unaligned(p.add(i), w[i]) };
            i += 1;
        }
        true
    }

    /// The address of `N` words at `off`, checked to lie inside the writable bytes, for
    /// reading and rewriting them one at a time without copies (see `store`).
    #[inline(always)]
    pub fn words_at<const N: usize>(&self, off: usize) -> Option<*mut u64> {
        if off > MAX_HDR_OFF {
            return None;
        }
        let at = self.data + bounded(off);
        if at + 8 * N > self.data_end {
            return None;
        }
        Some(at as *mut u64)
    }

    /// Whether `need` bytes at `off` are inside the frame at all (possibly beyond the linear
    /// area): tells truncation (malformed) apart from a non-linear skb (kernel).
    #[inline(always)]
    pub fn within_frame(&self, off: usize, need: usize) -> bool {
        off + need <= self.len
    }
}

#[inline(always)]
pub fn be16(b: [u8; 2]) -> u16 {
    u16::from_be_bytes(b)
}

/// The packet an XDP program sees.
#[inline(always)]
pub fn xdp_packet(ctx: &XdpContext) -> Packet {
    // verifier: `len` is read from the context a second time, volatile, so LLVM cannot derive
    // one bounds check from another through it (it otherwise drops checks the verifier needs).
    // SAFETY: `ctx.ctx` points at the kernel's xdp_md for the duration of the program.
    let end = unsafe { core::ptr::read_volatile(&(*ctx.ctx).data_end) } as usize;
    Packet {
        data: ctx.data(),
        data_end: ctx.data_end(),
        len: end.saturating_sub(ctx.data()),
        ctx: ctx.as_ptr(),
    }
}

/// The packet bounds of an skb; re-read after anything that can move packet data.
#[inline(always)]
pub fn tc_packet(ctx: &TcContext) -> Packet {
    Packet {
        data: ctx.data(),
        data_end: ctx.data_end(),
        len: ctx.len() as usize,
        ctx: ctx.as_ptr(),
    }
}
