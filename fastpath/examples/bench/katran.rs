//! Katran, Facebook's XDP load balancer, timed beside fastpath's LB rows (`--katran-object
//! PATH`): its object is built from Katran's public source outside this repository (see
//! docs/BENCHMARKS.md, "Katran"); this module only loads it, configures the LB bench's service
//! in its maps and times it with BPF_PROG_TEST_RUN in the same rounds as fastpath.
//!
//! The service: VIP 10.254.0.100:80/TCP over the bench's 16 backends as Katran reals 1..=16,
//! Katran's Maglev ring (`RING_SIZE` slots) filled round-robin, the default gateway's MAC in
//! `ctl_array`. Its per-CPU LRU map-in-map stays empty, so every packet uses the fallback LRU
//! (`fallback_cache`), sized at load to hold the pre-filled flows.

use std::{
    fs,
    path::Path,
    sync::{Mutex, PoisonError},
};

use anyhow::{Context as _, Result, bail};
use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap as BpfHashMap, MapData, PerCpuArray},
    programs::{TestRun as _, TestRunOptions, Xdp},
};
use fastpath::testkit::fixture::Fixture;
use fastpath_common::Hook;

use super::{CtRow, ct_row};

/// The Katran source the guide in docs/BENCHMARKS.md builds (balancer.bpf.c and the map and
/// constant headers of this commit of facebookincubator/katran).
pub(crate) const KATRAN_SOURCE: &str =
    "facebookincubator/katran 0659be9a6a94f5423af46dad6ff6044356ce74d4";

/// Katran's consistent-hashing ring size per VIP (`RING_SIZE` in balancer_consts.h).
const RING_SIZE: u32 = 65_537;
/// `MAX_VIPS` in balancer_consts.h: the global counters of `stats` start at this index.
const MAX_VIPS: u32 = 512;
/// `LRU_CNTRS` in balancer_consts.h: v1 counts VIP packets, v2 LRU misses.
const LRU_CNTRS: u32 = 0;
/// XDP_TX: Katran sends the encapsulated packet back out of the interface.
const XDP_TX: u32 = 3;
/// IPPROTO_IPIP, the outer header's protocol of Katran's IPv4-in-IPv4 encapsulation.
const IPPROTO_IPIP: u8 = 4;
const IPPROTO_TCP: u8 = 6;
/// The MAC Katran writes as the outer frame's destination (`ctl_array[0]`).
const GATEWAY_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0xfe];
/// Flows the LRU holds besides the pre-filled ones: the new-connection SYNs of one row and
/// headroom for the LRU's per-CPU free lists, so no pre-filled flow is evicted.
const LRU_HEADROOM: u32 = 16_384;
/// Bytes the output buffer holds beyond the input: the 20-byte outer IPv4 header and more.
const OUTPUT_SLACK: usize = 64;

/// `struct vip_definition`: the VIP (IPv4 in the first 4 bytes of a 16-byte union), its port
/// and protocol. Addresses and the port are in network byte order; 20 bytes with padding.
fn vip_definition(vip: [u8; 4], port: u16, proto: u8) -> [u8; 20] {
    let mut v = [0u8; 20];
    v[..4].copy_from_slice(&vip);
    v[16..18].copy_from_slice(&port.to_be_bytes());
    v[18] = proto;
    v
}

/// `struct vip_meta`: flags and the VIP's number (its ring is `vip_num * RING_SIZE ..`).
fn vip_meta(flags: u32, vip_num: u32) -> [u8; 8] {
    let mut v = [0u8; 8];
    v[..4].copy_from_slice(&flags.to_ne_bytes());
    v[4..].copy_from_slice(&vip_num.to_ne_bytes());
    v
}

/// `struct real_definition` of an IPv4 real (flags 0: not IPv6): 20 bytes with padding.
fn real_definition(addr: [u8; 4]) -> [u8; 20] {
    let mut v = [0u8; 20];
    v[..4].copy_from_slice(&addr);
    v
}

/// `struct flow_key` of an IPv4 TCP flow as Katran's parser fills it: source and destination
/// in the first 4 bytes of 16-byte unions, the ports as on the wire, the protocol; 40 bytes.
pub(crate) fn flow_key(src: [u8; 4], dst: [u8; 4], sport: u16, dport: u16) -> [u8; 40] {
    let mut k = [0u8; 40];
    k[..4].copy_from_slice(&src);
    k[16..20].copy_from_slice(&dst);
    k[32..34].copy_from_slice(&sport.to_be_bytes());
    k[34..36].copy_from_slice(&dport.to_be_bytes());
    k[36] = IPPROTO_TCP;
    k
}

/// `struct real_pos_lru`: the real's index (and an access time Katran only reads for UDP).
fn real_pos_lru(pos: u32) -> [u8; 16] {
    let mut v = [0u8; 16];
    v[..4].copy_from_slice(&pos.to_ne_bytes());
    v
}

/// A ring of `size` slots over reals `1..=reals`, each real in `size / reals` or one more
/// slots (Katran's real ids start at 1: 0 is "no real").
fn ring(reals: u32, size: u32) -> Vec<u32> {
    (0..size).map(|slot| 1 + slot % reals.max(1)).collect()
}

/// The `i`-th pre-filled flow: a client of 10.252.0.0/16 on a port of 1024..=65535, to the
/// VIP. Distinct for `i` below 2^16 × 64512, and never the bench's own client (10.253.0.1).
fn filler_flow(i: u32, vip: [u8; 4], vport: u16) -> [u8; 40] {
    let host = i / 64_512;
    let port = 1024 + (i % 64_512) as u16;
    let [_, _, a, b] = host.to_be_bytes();
    flow_key([10, 252, a, b], vip, port, vport)
}

/// The outer IPv4 header of Katran's output: (protocol, destination), if the frame has one.
fn outer_ipv4(frame: &[u8]) -> Option<(u8, [u8; 4])> {
    let ip = frame.get(14..34)?;
    if frame.get(12..14)? != [0x08, 0x00] || ip[0] >> 4 != 4 {
        return None;
    }
    Some((ip[9], ip[16..20].try_into().ok()?))
}

/// The Katran object named by `--katran-object`, and the rows timed through it.
pub(crate) struct KatranObject {
    name: String,
    bytes: Vec<u8>,
    rows: Mutex<Vec<CtRow>>,
}

impl KatranObject {
    pub(crate) fn read(path: &Path) -> Result<Self> {
        let bytes = fs::read(path).with_context(|| {
            format!(
                "reading the Katran object {}; docs/BENCHMARKS.md (\"Katran\") says how to build it",
                path.display()
            )
        })?;
        Ok(Self {
            name: path.display().to_string(),
            bytes,
            rows: Mutex::new(Vec::new()),
        })
    }

    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Loads the object with a fallback LRU that holds as many flows as fastpath's conntrack
    /// table (`DEFAULT_CT_CAPACITY`, plus headroom) and at least `flows` pre-filled ones, and
    /// configures the bench's service. perf: the same capacity, because a table's memory, not
    /// its fill, sets how often a new flow's bucket misses the caches and the TLB (a 17k-flow
    /// LRU beside a 1 Mi-entry table made the "1000 entries" rows compare 2 MB with 268 MB).
    fn load(&self, flows: u32, vip: [u8; 4], reals: &[[u8; 4]]) -> Result<Katran> {
        let ebpf = EbpfLoader::new()
            .map_max_entries("fallback_cache", lru_capacity(flows))
            // One VIP (number 0): Katran reads only the first RING_SIZE slots of `ch_rings`,
            // sized MAX_VIPS * RING_SIZE (134 MB) by default.
            .map_max_entries("ch_rings", RING_SIZE)
            // Server ids are for QUIC and TCP server-id routing, neither used here.
            .map_max_entries("server_id_map", 1)
            .load(&self.bytes)
            .with_context(|| {
                format!(
                    "loading the Katran object {} with aya (it needs the maps vip_map, reals, ch_rings, ctl_array, fallback_cache and stats: build balancer.bpf.c as docs/BENCHMARKS.md, \"Katran\", says)",
                    self.name
                )
            })?;
        let mut k = Katran { ebpf };
        {
            let prog: &mut Xdp = k
                .ebpf
                .program_mut("balancer_ingress")
                .context("the Katran object has no program balancer_ingress")?
                .try_into()?;
            prog.load()
                .context("the verifier rejected Katran's balancer_ingress")?;
        }
        k.configure(vip, reals)?;
        Ok(k)
    }

    fn push(&self, row: CtRow) {
        self.rows
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(row);
    }

    pub(crate) fn take_rows(&self) -> Vec<CtRow> {
        std::mem::take(&mut *self.rows.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// A loaded, configured Katran.
pub(crate) struct Katran {
    ebpf: Ebpf,
}

impl Katran {
    fn map(&mut self, name: &'static str) -> Result<&mut aya::maps::Map> {
        self.ebpf
            .map_mut(name)
            .with_context(|| format!("the Katran object has no map {name}"))
    }

    /// The bench's service: VIP:80/TCP (number 0, no flags), reals 1..=n, the ring, the MAC.
    fn configure(&mut self, vip: [u8; 4], reals: &[[u8; 4]]) -> Result<()> {
        let mut vips: BpfHashMap<&mut MapData, [u8; 20], [u8; 8]> =
            BpfHashMap::try_from(self.map("vip_map")?)?;
        vips.insert(&vip_definition(vip, 80, IPPROTO_TCP), &vip_meta(0, 0), 0)?;
        let mut real_map: Array<&mut MapData, [u8; 20]> = Array::try_from(self.map("reals")?)?;
        for (i, addr) in reals.iter().enumerate() {
            real_map.set(i as u32 + 1, &real_definition(*addr), 0)?;
        }
        let mut rings: Array<&mut MapData, u32> = Array::try_from(self.map("ch_rings")?)?;
        for (slot, real) in ring(reals.len() as u32, RING_SIZE).into_iter().enumerate() {
            rings.set(slot as u32, &real, 0)?;
        }
        let mut ctl: Array<&mut MapData, [u8; 8]> = Array::try_from(self.map("ctl_array")?)?;
        let mut mac = [0u8; 8];
        mac[..6].copy_from_slice(&GATEWAY_MAC);
        ctl.set(0, &mac, 0)?;
        Ok(())
    }

    /// Pre-fills `flows` flows to the VIP in the fallback LRU, spread over the reals, then
    /// `established` (a flow the bench's packets belong to) on real `pos`.
    fn fill_lru(
        &mut self,
        flows: u32,
        vip: [u8; 4],
        reals: u32,
        established: [u8; 40],
        pos: u32,
    ) -> Result<()> {
        let mut lru: BpfHashMap<&mut MapData, [u8; 40], [u8; 16]> =
            BpfHashMap::try_from(self.map("fallback_cache")?)?;
        for i in 0..flows.saturating_sub(1) {
            lru.insert(&filler_flow(i, vip, 80), &real_pos_lru(1 + i % reals), 0)?;
        }
        lru.insert(&established, &real_pos_lru(pos), 0)?;
        Ok(())
    }

    /// LRU misses Katran counted so far (`stats[MAX_VIPS + LRU_CNTRS].v2`, all CPUs).
    fn lru_misses(&mut self) -> Result<u64> {
        let stats: PerCpuArray<&mut MapData, [u64; 2]> = PerCpuArray::try_from(self.map("stats")?)?;
        Ok(stats
            .get(&(MAX_VIPS + LRU_CNTRS), 0)?
            .iter()
            .map(|v| v[1])
            .sum())
    }

    /// One run of `frame` (repeat = 1): verdict, kernel-reported ns, output frame.
    fn run(&self, frame: &[u8]) -> Result<(u32, f64, Vec<u8>)> {
        let prog: &Xdp = self
            .ebpf
            .program("balancer_ingress")
            .context("the Katran object has no program balancer_ingress")?
            .try_into()?;
        let mut out = vec![0u8; frame.len() + OUTPUT_SLACK];
        let res = prog.test_run(TestRunOptions {
            data_in: Some(frame),
            data_out: Some(&mut out),
            repeat: 1,
            ..Default::default()
        })?;
        out.truncate(res.data_size_out as usize);
        Ok((res.return_value, res.duration.as_nanos() as f64, out))
    }

    /// Runs `frame` once and checks Katran really balanced it: XDP_TX, an IPIP header towards
    /// one of `reals` around the unchanged packet, and an LRU hit (`lru_hit`) or miss.
    fn check(&mut self, what: &str, frame: &[u8], reals: &[[u8; 4]], lru_hit: bool) -> Result<()> {
        let misses = self.lru_misses()?;
        let (verdict, _, out) = self.run(frame)?;
        let missed = self.lru_misses()? - misses;
        let outer = outer_ipv4(&out);
        let inner_unchanged = out
            .get(34..)
            .zip(frame.get(14..))
            .is_some_and(|(a, b)| a == b);
        match outer {
            Some((IPPROTO_IPIP, real))
                if verdict == XDP_TX
                    && reals.contains(&real)
                    && inner_unchanged
                    && (missed == 0) == lru_hit =>
            {
                Ok(())
            }
            _ => bail!(
                "Katran {what}: expected XDP_TX ({XDP_TX}) with an IPIP header to one of the reals around the input and an LRU {}, got verdict {verdict}, outer header {outer:?}, {missed} LRU misses; output {out:02x?}",
                if lru_hit { "hit" } else { "miss" }
            ),
        }
    }
}

/// The Katran rows: one per timed path.
#[derive(Clone, Copy)]
pub(crate) enum Row {
    /// The established connection's client → VIP packet: an LRU hit.
    Hit,
    /// A SYN from a new source port per run: an LRU miss, ring pick and LRU insert.
    NewConnection,
}

/// Katran with the LB benchmark's service and a number of flows in its LRU, whose rows go to
/// its [`KatranObject`].
pub(crate) struct KatranLb<'o> {
    object: &'o KatranObject,
    katran: Katran,
    reals: Vec<[u8; 4]>,
    flows: u32,
}

impl<'o> KatranLb<'o> {
    /// Loads `object` for `vip` over `reals` and pre-fills `flows` flows in its LRU, the last
    /// `established` (on real 1), the connection the benchmark's hit packets belong to.
    pub(crate) fn new(
        object: &'o KatranObject,
        flows: u32,
        vip: [u8; 4],
        reals: Vec<[u8; 4]>,
        established: [u8; 40],
    ) -> Result<Self> {
        let mut katran = object.load(flows, vip, &reals)?;
        katran.fill_lru(flows, vip, reals.len() as u32, established, 1)?;
        Ok(Self {
            object,
            katran,
            reals,
            flows,
        })
    }

    pub(crate) fn katran(&self) -> &Katran {
        &self.katran
    }

    /// Checks `frame` once for `row`: an LRU hit for [`Row::Hit`], a miss otherwise.
    pub(crate) fn check(&mut self, row: Row, frame: &[u8]) -> Result<()> {
        let (what, hit) = match row {
            Row::Hit => ("hit", true),
            Row::NewConnection => ("new connection", false),
        };
        self.katran.check(what, frame, &self.reals, hit)
    }

    /// Adds `row`'s timed samples (`runs` single runs and their floors) to the object's rows.
    pub(crate) fn push_row(&self, row: Row, runs: usize, ns: &[f64], floor: &[f64]) {
        let what = format!(
            "{} reals, Maglev ring {RING_SIZE} slots, {} flows in its LRU of {}",
            self.reals.len(),
            self.flows,
            lru_capacity(self.flows)
        );
        let path = match row {
            Row::Hit => format!("Katran hit: client → VIP, IPIP to the real ({what}, repeat = 1)"),
            Row::NewConnection => format!(
                "Katran new connection: SYN → VIP, ring pick + LRU insert + IPIP ({what}, {runs} connections, repeat = 1)"
            ),
        };
        self.object.push(CtRow {
            backends: Some(self.reals.len()),
            ..ct_row(path, self.flows, ns, floor)
        });
    }
}

/// Katran's fallback LRU for `flows` pre-filled flows: fastpath's table's capacity or more.
fn lru_capacity(flows: u32) -> u32 {
    flows.max(fastpath::config::DEFAULT_CT_CAPACITY) + LRU_HEADROOM
}

/// Katran as one more participant of `time_interleaved`'s rotation: run `run` times
/// `frames(run)` through Katran right after the floor program on the same frame.
pub(crate) struct Beside<'k, 'f> {
    pub(crate) katran: &'k Katran,
    pub(crate) frames: &'f dyn Fn(usize) -> &'f [u8],
}

impl Beside<'_, '_> {
    /// (Katran ns, floor ns) of run `run`; the floor is the first object's empty XDP program.
    pub(crate) fn time(&self, floor: &mut Fixture, run: usize) -> Result<(f64, f64)> {
        let frame = (self.frames)(run);
        let floor_ns = floor
            .run_floor_repeat(Hook::Xdp, frame, 1)?
            .per_run
            .as_nanos() as f64;
        let (verdict, ns, _) = self.katran.run(frame)?;
        if verdict != XDP_TX {
            bail!("Katran: verdict {verdict} during the benchmark, expected XDP_TX ({XDP_TX})");
        }
        Ok((ns, floor_ns))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vip_definition_matches_katrans_layout() {
        let v = vip_definition([10, 254, 0, 100], 80, IPPROTO_TCP);
        let mut want = [0u8; 20];
        want[..4].copy_from_slice(&[10, 254, 0, 100]);
        want[16..18].copy_from_slice(&[0, 80]);
        want[18] = 6;
        assert_eq!(
            v, want,
            "expected vip, port (big endian), proto at 0, 16, 18"
        );
    }

    #[test]
    fn flow_key_puts_ports_as_on_the_wire() {
        let k = flow_key([10, 253, 0, 1], [10, 254, 0, 100], 40000, 80);
        assert_eq!(&k[..4], &[10, 253, 0, 1], "src");
        assert_eq!(&k[4..16], &[0u8; 12], "rest of the src union");
        assert_eq!(&k[16..20], &[10, 254, 0, 100], "dst");
        assert_eq!(
            &k[32..36],
            &[0x9c, 0x40, 0, 80],
            "sport then dport, big endian"
        );
        assert_eq!(k[36], 6, "proto");
        assert_eq!(&k[37..], &[0u8; 3], "padding");
    }

    #[test]
    fn meta_real_and_lru_values() {
        assert_eq!(
            vip_meta(0, 3),
            [0, 0, 0, 0, 3, 0, 0, 0],
            "flags then vip_num"
        );
        let r = real_definition([10, 254, 1, 7]);
        assert_eq!((&r[..4], &r[4..]), (&[10, 254, 1, 7][..], &[0u8; 16][..]));
        assert_eq!(real_pos_lru(9)[..4], 9u32.to_ne_bytes(), "pos first");
        assert_eq!(real_pos_lru(9)[4..], [0u8; 12], "no atime");
    }

    #[test]
    fn ring_is_fair_and_never_uses_real_0() {
        let r = ring(16, RING_SIZE);
        assert_eq!(r.len(), RING_SIZE as usize);
        let mut per_real = [0u32; 17];
        for real in &r {
            per_real[*real as usize] += 1;
        }
        assert_eq!(per_real[0], 0, "real 0 means no real in Katran");
        let (lo, hi) = (per_real[1..].iter().min(), per_real[1..].iter().max());
        assert_eq!(
            (lo, hi),
            (Some(&4096), Some(&4097)),
            "expected 65537 slots over 16 reals to give each 4096 or 4097"
        );
    }

    #[test]
    fn filler_flows_are_distinct_and_not_the_client() {
        let vip = [10, 254, 0, 100];
        let n = 200_000;
        let flows: std::collections::HashSet<[u8; 40]> =
            (0..n).map(|i| filler_flow(i, vip, 80)).collect();
        assert_eq!(flows.len(), n as usize, "expected {n} distinct flows");
        assert!(
            !flows.contains(&flow_key([10, 253, 0, 1], vip, 40000, 80)),
            "the bench's own flow must not be a filler"
        );
    }

    #[test]
    fn outer_ipv4_reads_protocol_and_destination() {
        let mut f = vec![0u8; 54];
        f[12..14].copy_from_slice(&[0x08, 0x00]);
        f[14] = 0x45;
        f[14 + 9] = IPPROTO_IPIP;
        f[30..34].copy_from_slice(&[10, 254, 1, 3]);
        assert_eq!(outer_ipv4(&f), Some((IPPROTO_IPIP, [10, 254, 1, 3])));
        f[12] = 0x86;
        assert_eq!(outer_ipv4(&f), None, "not IPv4");
        assert_eq!(outer_ipv4(&f[..20]), None, "too short");
    }
}
