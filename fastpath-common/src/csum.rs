//! Internet checksum arithmetic (RFC 1071) and incremental updates (RFC 1624, eqn. 3:
//! `HC' = ~(~HC + ~m + m')`), for NAT rewriting addresses and ports in the datapath without
//! re-reading the payload. Pure functions on values: no packet access, no loops over data
//! (the `*8` variants walk 4 words, unrolled), so they cost a few instructions and no calls.
//!
//! Checksums are handled as the 16-bit value read from the packet in network byte order
//! (`u16::from_be_bytes`); words of addresses and ports likewise.

/// Ones'-complement sum folded to 16 bits.
#[inline(always)]
pub const fn fold(mut sum: u64) -> u16 {
    sum = (sum & 0xffff_ffff) + (sum >> 32);
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    sum as u16
}

/// Ones'-complement sum of big-endian 16-bit words of `bytes` (odd length: zero padded).
pub fn sum_bytes(bytes: &[u8]) -> u64 {
    let (words, rest) = bytes.as_chunks::<2>();
    let mut sum: u64 = words
        .iter()
        .map(|w| u64::from(u16::from_be_bytes(*w)))
        .sum();
    if let [last] = rest {
        sum += u64::from(*last) << 8;
    }
    sum
}

/// The checksum field value for data whose words sum (with the field zero) to `sum`.
#[inline(always)]
pub const fn finish(sum: u64) -> u16 {
    !fold(sum)
}

/// Checksum after the covered data changed by `delta` (the sum of the changes' `~m + m'`
/// terms: [`delta2`], [`delta4`], [`delta8`], added together).
#[inline(always)]
pub const fn apply(check: u16, delta: u64) -> u16 {
    // ~HC + Σ(~m + m')
    !fold((!check) as u64 + delta)
}

/// `~m + m'` of one 16-bit word changed from `old` to `new`.
#[inline(always)]
pub const fn delta2(old: u16, new: u16) -> u64 {
    (!old) as u64 + new as u64
}

/// `~m + m'` of a 32-bit field (two words, e.g. an IPv4 address) changed.
#[inline(always)]
pub const fn delta4(old: [u8; 4], new: [u8; 4]) -> u64 {
    delta2(
        u16::from_be_bytes([old[0], old[1]]),
        u16::from_be_bytes([new[0], new[1]]),
    ) + delta2(
        u16::from_be_bytes([old[2], old[3]]),
        u16::from_be_bytes([new[2], new[3]]),
    )
}

/// `~m + m'` of 8 bytes changed: `old` and `new` are those bytes as they lie in memory, read
/// as a native-endian u64 (see [`replace8`]).
#[inline(always)]
pub fn delta8(old: u64, new: u64) -> u64 {
    let (o, n) = (old.to_ne_bytes(), new.to_ne_bytes());
    let mut sum = 0;
    let mut i = 0;
    while i < 8 {
        sum += delta2(
            u16::from_be_bytes([o[i], o[i + 1]]),
            u16::from_be_bytes([n[i], n[i + 1]]),
        );
        i += 2;
    }
    sum
}

/// Checksum after one 16-bit word of the covered data changed from `old` to `new`.
#[inline(always)]
pub const fn replace2(check: u16, old: u16, new: u16) -> u16 {
    apply(check, delta2(old, new))
}

/// Checksum after a 32-bit field (two words, e.g. an IPv4 address) changed.
#[inline(always)]
pub const fn replace4(check: u16, old: [u8; 4], new: [u8; 4]) -> u16 {
    apply(check, delta4(old, new))
}

/// Checksum after 8 bytes of the covered data changed: `old` and `new` are those bytes as they
/// lie in memory, read as a native-endian u64 (two of them make an IPv6 address without a
/// 16-byte array, which the datapath's stack cannot spare).
#[inline(always)]
pub fn replace8(check: u16, old: u64, new: u64) -> u16 {
    apply(check, delta8(old, new))
}

/// UDP over IPv4 may carry no checksum (0): a rewrite keeps it that way. A computed 0 is sent
/// as 0xffff (RFC 768), since 0 means "none".
#[inline(always)]
pub const fn udp_fixup(old_check: u16, new_check: u16) -> u16 {
    if old_check == 0 {
        0
    } else if new_check == 0 {
        0xffff
    } else {
        new_check
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::vec::Vec;

    use super::*;

    /// A tiny deterministic generator (xorshift) for varied inputs without a dependency.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn bytes<const N: usize>(&mut self) -> [u8; N] {
            core::array::from_fn(|_| self.next() as u8)
        }
    }

    fn full(data: &[u8]) -> u16 {
        finish(sum_bytes(data))
    }

    #[test]
    fn a_known_ipv4_header() {
        // Example header from RFC 1071 discussions: checksum 0xb861.
        let mut h = [
            0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0x00, 0x00, 0xc0, 0xa8,
            0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7,
        ];
        assert_eq!(full(&h), 0xb861);
        h[10..12].copy_from_slice(&0xb861u16.to_be_bytes());
        assert_eq!(
            fold(sum_bytes(&h)),
            0xffff,
            "a correct header sums to all ones"
        );
    }

    #[test]
    fn incremental_updates_equal_full_recomputation() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for round in 0..20_000 {
            // 40 bytes of data: a 16-byte address at 8, a 4-byte one at 24, a port at 30.
            let mut data: Vec<u8> = (0..40).map(|_| rng.next() as u8).collect();
            let check = full(&data);
            let (a16, a4, p): ([u8; 16], [u8; 4], [u8; 2]) =
                (rng.bytes(), rng.bytes(), rng.bytes());
            let old16: [u8; 16] = data[8..24].try_into().unwrap();
            let old4: [u8; 4] = data[24..28].try_into().unwrap();
            let oldp = u16::from_be_bytes([data[30], data[31]]);
            let word = |b: &[u8; 16], i: usize| {
                u64::from_ne_bytes(b[i * 8..i * 8 + 8].try_into().unwrap())
            };
            // The 16-byte address as two words, as the datapath changes IPv6 addresses.
            let mut c = replace8(
                replace8(check, word(&old16, 0), word(&a16, 0)),
                word(&old16, 1),
                word(&a16, 1),
            );
            c = replace4(c, old4, a4);
            c = replace2(c, oldp, u16::from_be_bytes(p));
            data[8..24].copy_from_slice(&a16);
            data[24..28].copy_from_slice(&a4);
            data[30..32].copy_from_slice(&p);
            let want = full(&data);
            // 0x0000 and 0xffff are the same value in ones' complement; a sum that checks out
            // is what matters, and RFC 1624's form never yields -0 from a valid header.
            assert!(
                c == want || (c ^ want) == 0xffff && (c == 0 || want == 0),
                "round {round}: incremental {c:#06x}, full {want:#06x}"
            );
            let delta = delta8(word(&old16, 0), word(&a16, 0))
                + delta8(word(&old16, 1), word(&a16, 1))
                + delta4(old4, a4)
                + delta2(oldp, u16::from_be_bytes(p));
            assert_eq!(
                apply(check, delta),
                c,
                "round {round}: one summed delta = the replaces"
            );
            let mut with = data.clone();
            with.extend_from_slice(&c.to_be_bytes());
            assert_eq!(fold(sum_bytes(&with)), 0xffff, "round {round}");
        }
    }

    #[test]
    fn udp_zero_checksum_stays_zero_and_computed_zero_is_sent_as_ffff() {
        assert_eq!(udp_fixup(0, 0x1234), 0);
        assert_eq!(udp_fixup(0x4321, 0), 0xffff);
        assert_eq!(udp_fixup(0x4321, 0x1234), 0x1234);
    }
}
