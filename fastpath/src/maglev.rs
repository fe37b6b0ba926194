//! Maglev consistent hashing (Eisenbud et al., NSDI 2016): a per-service lookup table of prime
//! size `M` in which every backend owns about `M × weight / Σweights` slots; a flow picks the
//! slot `hash(5-tuple) mod M`.
//!
//! Contract: the table depends only on the backend *set* (addresses, ports, weights) and `M` —
//! not on the order backends were configured or added — so two nodes with the same backends
//! build identical tables and send a flow to the same backend (what makes failover of not yet
//! replicated flows safe). Removing one backend of `N` moves only the flows that were on it
//! plus a small fraction (measured in the tests), not a reshuffle.

use std::fmt;

/// A backend as the table sees it: its identity bytes (address and port, on the wire) and
/// weight. Weight 0 (draining) owns no slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaglevBackend {
    /// Stable identity: 16 address bytes (IPv4 in the first 4) and the port, big-endian.
    pub id: [u8; 18],
    pub weight: u32,
}

/// Table sizes the daemon picks from when a service does not set one: primes, each about
/// twice the last. The paper's guidance is `M ≥ 100 × N` for ≤ 1% imbalance.
pub const AUTO_SIZES: [u32; 10] = [
    251, 509, 1021, 2039, 4093, 8191, 16381, 32749, 65521, 131_071,
];
/// Largest table a service may ask for (slots are u32 backend indexes: 256 KiB per table).
pub const MAX_SIZE: u32 = 131_071;

#[derive(Debug, PartialEq, Eq)]
pub enum MaglevError {
    NotPrime(u32),
    TooLarge(u32),
    /// More backends with a weight than slots.
    TooManyBackends {
        backends: usize,
        size: u32,
    },
}

impl fmt::Display for MaglevError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MaglevError::NotPrime(m) => write!(
                f,
                "Maglev table size {m} is not prime; use a prime such as {}",
                AUTO_SIZES.iter().find(|&&p| p >= *m).unwrap_or(&MAX_SIZE)
            ),
            MaglevError::TooLarge(m) => {
                write!(f, "Maglev table size {m} is above the maximum {MAX_SIZE}")
            }
            MaglevError::TooManyBackends { backends, size } => write!(
                f,
                "{backends} weighted backends do not fit a Maglev table of {size} slots; use a larger prime size (at least 100 × backends)"
            ),
        }
    }
}

impl std::error::Error for MaglevError {}

pub fn is_prime(n: u32) -> bool {
    if n < 2 {
        return false;
    }
    let n = u64::from(n);
    let mut d = 2u64;
    while d * d <= n {
        if n % d == 0 {
            return false;
        }
        d += 1;
    }
    true
}

/// The table size for `backends` when the service does not set one: the smallest listed prime
/// of at least 100 slots per backend (capped at [`MAX_SIZE`]).
pub fn auto_size(backends: usize) -> u32 {
    let want = (backends as u64).saturating_mul(100);
    AUTO_SIZES
        .iter()
        .copied()
        .find(|&m| u64::from(m) >= want)
        .unwrap_or(MAX_SIZE)
}

/// FNV-1a 64 over `bytes` with a seed folded in first: fixed, portable, and the same on every
/// node and version (never the std hasher, whose keys are random per process).
fn fnv1a(seed: u64, bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    // Final avalanche (splitmix64's), so nearby identities spread over the table.
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// Builds the lookup table: `size` slots, each the index (into `backends`) of its owner.
/// Backends are ordered by identity first, so the result does not depend on input order.
/// Weights are relative: per round, a backend claims as many slots as its weight divided by
/// the largest common divisor of all weights.
pub fn build(backends: &[MaglevBackend], size: u32) -> Result<Vec<u32>, MaglevError> {
    if size > MAX_SIZE {
        return Err(MaglevError::TooLarge(size));
    }
    if !is_prime(size) {
        return Err(MaglevError::NotPrime(size));
    }
    let m = size as usize;
    let mut order: Vec<usize> = (0..backends.len())
        .filter(|&i| backends[i].weight > 0)
        .collect();
    if order.is_empty() {
        return Ok(Vec::new());
    }
    if order.len() > m {
        return Err(MaglevError::TooManyBackends {
            backends: order.len(),
            size,
        });
    }
    order.sort_by(|&a, &b| backends[a].id.cmp(&backends[b].id));
    let g = order.iter().map(|&i| backends[i].weight).fold(0, gcd);
    let turns: Vec<u64> = order
        .iter()
        .map(|&i| u64::from(backends[i].weight / g))
        .collect();
    let perm: Vec<(u64, u64)> = order
        .iter()
        .map(|&i| {
            let id = &backends[i].id;
            let offset = fnv1a(0x6d61_676c_6576_3031, id) % size as u64;
            let skip = fnv1a(0x736b_6970_7631_3031, id) % (size as u64 - 1) + 1;
            (offset, skip)
        })
        .collect();
    // Each backend walks its own permutation of the slots (offset + j × skip mod M, a full
    // cycle since M is prime) and claims the first free one, `turns` times per round. The
    // position advances by adding `skip` (no multiplication or division per step).
    let mut pos: Vec<usize> = perm.iter().map(|&(offset, _)| offset as usize).collect();
    let skips: Vec<usize> = perm.iter().map(|&(_, skip)| skip as usize).collect();
    let advance = |p: usize, skip: usize| {
        let n = p + skip;
        if n >= m { n - m } else { n }
    };
    let mut table = vec![u32::MAX; m];
    let mut filled = 0usize;
    'rounds: loop {
        for k in 0..perm.len() {
            for _ in 0..turns[k] {
                let mut c = pos[k];
                while table[c] != u32::MAX {
                    c = advance(c, skips[k]);
                }
                table[c] = order[k] as u32;
                pos[k] = advance(c, skips[k]);
                filled += 1;
                if filled == m {
                    break 'rounds;
                }
            }
        }
    }
    Ok(table)
}

/// Greatest common divisor (0 with 0 gives 0).
pub(crate) fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 { a } else { gcd(b, a % b) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backend(i: u32, weight: u32) -> MaglevBackend {
        let mut id = [0u8; 18];
        id[..4].copy_from_slice(&[10, 1, (i >> 8) as u8, i as u8]);
        id[16..].copy_from_slice(&8080u16.to_be_bytes());
        MaglevBackend { id, weight }
    }

    fn shares(table: &[u32], n: usize) -> Vec<usize> {
        let mut c = vec![0; n];
        for &b in table {
            c[b as usize] += 1;
        }
        c
    }

    #[test]
    fn every_slot_is_owned_and_shares_are_even() {
        let bs: Vec<_> = (0..100).map(|i| backend(i, 1)).collect();
        let t = build(&bs, 65521).unwrap();
        assert_eq!(t.len(), 65521);
        let s = shares(&t, bs.len());
        let (min, max) = (*s.iter().min().unwrap(), *s.iter().max().unwrap());
        // M = 655 × N: the paper's bound gives about 1% spread; allow 2%.
        let mean = 65521.0 / 100.0;
        assert!(
            (max as f64) < mean * 1.02 && (min as f64) > mean * 0.98,
            "min {min} max {max} mean {mean}"
        );
    }

    #[test]
    fn weights_set_the_shares() {
        let bs = vec![backend(1, 1), backend(2, 2), backend(3, 5)];
        let t = build(&bs, 4093).unwrap();
        let s = shares(&t, 3);
        for (i, w) in [1.0, 2.0, 5.0].iter().enumerate() {
            let want = 4093.0 * w / 8.0;
            let got = s[i] as f64;
            assert!(
                (got - want).abs() / want < 0.01,
                "backend {i}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn drained_backends_own_nothing() {
        let bs = vec![backend(1, 1), backend(2, 0), backend(3, 1)];
        let t = build(&bs, 251).unwrap();
        assert_eq!(shares(&t, 3)[1], 0);
        assert!(build(&[backend(1, 0)], 251).unwrap().is_empty());
    }

    #[test]
    fn the_table_does_not_depend_on_input_order() {
        let bs: Vec<_> = (0..37).map(|i| backend(i * 7, 1 + i % 3)).collect();
        let mut rev = bs.clone();
        rev.reverse();
        let a = build(&bs, 8191).unwrap();
        let b = build(&rev, 8191).unwrap();
        // Same owner per slot, by identity (indexes differ with the order).
        let owner = |bs: &[MaglevBackend], t: &[u32]| -> Vec<[u8; 18]> {
            t.iter().map(|&i| bs[i as usize].id).collect()
        };
        assert_eq!(owner(&bs, &a), owner(&rev, &b));
    }

    #[test]
    fn removing_a_backend_moves_little_else() {
        let n = 50;
        let bs: Vec<_> = (0..n).map(|i| backend(i, 1)).collect();
        let before = build(&bs, 65521).unwrap();
        let mut fewer = bs.clone();
        let gone = fewer.remove(17);
        let after = build(&fewer, 65521).unwrap();
        let owner_before: Vec<[u8; 18]> = before.iter().map(|&i| bs[i as usize].id).collect();
        let owner_after: Vec<[u8; 18]> = after.iter().map(|&i| fewer[i as usize].id).collect();
        let moved_others = owner_before
            .iter()
            .zip(&owner_after)
            .filter(|(b, a)| **b != gone.id && b != a)
            .count();
        // Slots of the other backends that changed owner: a few percent at most (the paper
        // reports about 1-2% here), against ~98% for modulo hashing.
        let frac = moved_others as f64 / 65521.0;
        assert!(
            frac < 0.03,
            "{:.2}% of the others' slots moved",
            frac * 100.0
        );
    }

    #[test]
    fn sizes_are_checked() {
        assert_eq!(
            build(&[backend(1, 1)], 1000),
            Err(MaglevError::NotPrime(1000))
        );
        assert_eq!(
            build(&[backend(1, 1)], 131_101),
            Err(MaglevError::TooLarge(131_101))
        );
        let many: Vec<_> = (0..300).map(|i| backend(i, 1)).collect();
        assert!(matches!(
            build(&many, 251),
            Err(MaglevError::TooManyBackends { .. })
        ));
        assert_eq!(auto_size(1), 251);
        assert_eq!(auto_size(10), 1021);
        assert_eq!(auto_size(1024), 131_071);
        assert!(AUTO_SIZES.iter().all(|&p| is_prime(p)));
    }
}
