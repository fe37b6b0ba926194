//! Presenting the conntrack table: rows in the original/reply form `conntrack -L` prints,
//! remaining timeouts from the per-state defaults, and the counters.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use fastpath_common::ct::{
    CT_F_ASSURED, CT_F_DSR, CT_F_FULL_NAT, CT_F_LB, CT_F_ORIG_IS_LO, CT_F_SEEN_REPLY, CtEntry,
    CtKey, DIR_ORIGINAL, DIR_REPLY, ct_stat, tcp_state, timeout_of,
};
use serde::Serialize;

use crate::ct_gc::Timeouts;

/// One side of a connection as seen by its sender.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Tuple {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub sport: u16,
    pub dport: u16,
    pub packets: u64,
    pub bytes: u64,
}

/// A tracked connection, ready to print.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct CtRow {
    pub proto: String,
    pub proto_num: u8,
    /// Seconds until expiry at the default timeouts.
    pub timeout_s: u64,
    /// TCP state name; empty for other protocols.
    pub state: String,
    pub original: Tuple,
    pub reply: Tuple,
    pub assured: bool,
    pub seen_reply: bool,
}

fn addr(family: u8, a: &[u8; 16]) -> IpAddr {
    if family == 4 {
        IpAddr::V4(Ipv4Addr::new(a[0], a[1], a[2], a[3]))
    } else {
        IpAddr::V6(Ipv6Addr::from(*a))
    }
}

/// A row for `key`/`entry`, with `now_ns` on the datapath's clock (CLOCK_MONOTONIC) and the
/// datapath's configured `timeouts`.
pub fn row(key: &CtKey, e: &CtEntry, now_ns: u64, timeouts: &Timeouts) -> CtRow {
    let lo = (addr(key.family, &key.addr_lo), key.port_lo);
    let hi = (addr(key.family, &key.addr_hi), key.port_hi);
    let (orig, resp) = if e.flags & CT_F_ORIG_IS_LO != 0 {
        (lo, hi)
    } else {
        (hi, lo)
    };
    let idle_s = now_ns.saturating_sub(e.last_seen_ns) / 1_000_000_000;
    // A DSR connection's replies come from the VIP itself, untranslated.
    let lb = e.flags & CT_F_LB != 0 && e.flags & CT_F_DSR == 0;
    let full_nat = lb && e.flags & CT_F_FULL_NAT != 0;
    let proto = match key.proto {
        6 => "tcp",
        17 => "udp",
        1 => "icmp",
        58 => "icmpv6",
        _ => "unknown",
    };
    CtRow {
        proto: proto.into(),
        proto_num: key.proto,
        timeout_s: u64::from(timeout_of(timeouts, key, e)).saturating_sub(idle_s),
        state: if key.proto == 6 {
            tcp_state::NAMES
                .get(e.state as usize)
                .copied()
                .unwrap_or("UNKNOWN")
                .into()
        } else {
            String::new()
        },
        original: Tuple {
            src: orig.0,
            dst: resp.0,
            sport: orig.1,
            dport: resp.1,
            packets: e.packets[DIR_ORIGINAL],
            bytes: e.bytes[DIR_ORIGINAL],
        },
        // As Linux shows a DNAT'ed connection: the reply comes from the backend; and a
        // full-NAT one: to the source address and port it was given.
        reply: Tuple {
            src: if lb {
                addr(key.family, &e.nat.addr)
            } else {
                resp.0
            },
            dst: if full_nat {
                addr(key.family, &e.nat.addr2)
            } else {
                orig.0
            },
            sport: if lb { e.nat.port } else { resp.1 },
            dport: if full_nat { e.nat.port2 } else { orig.1 },
            packets: e.packets[DIR_REPLY],
            bytes: e.bytes[DIR_REPLY],
        },
        assured: e.flags & CT_F_ASSURED != 0,
        seen_reply: e.flags & CT_F_SEEN_REPLY != 0,
    }
}

/// The `conntrack -L` line of a row.
pub fn render(r: &CtRow) -> String {
    let tuple = |t: &Tuple| {
        if r.proto.starts_with("icmp") {
            format!(
                "src={} dst={} id={} packets={} bytes={}",
                t.src, t.dst, t.sport, t.packets, t.bytes
            )
        } else {
            format!(
                "src={} dst={} sport={} dport={} packets={} bytes={}",
                t.src, t.dst, t.sport, t.dport, t.packets, t.bytes
            )
        }
    };
    let mut line = format!("{:<8} {} {} ", r.proto, r.proto_num, r.timeout_s);
    if !r.state.is_empty() {
        line.push_str(&r.state);
        line.push(' ');
    }
    line.push_str(&tuple(&r.original));
    if !r.seen_reply {
        line.push_str(" [UNREPLIED]");
    }
    line.push(' ');
    line.push_str(&tuple(&r.reply));
    if r.assured {
        line.push_str(" [ASSURED]");
    }
    line
}

/// Current CLOCK_MONOTONIC in ns: the clock of the datapath's event timestamps
/// (bpf_ktime_get_ns); entries' `created_ns` and `last_seen_ns` come from its coarse form
/// (bpf_ktime_get_coarse_ns, the last tick's time), which trails it by at most one tick.
pub fn monotonic_ns() -> u64 {
    // SAFETY: an all-zero timespec is valid; clock_gettime writes into it.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: valid clock id and pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64
}

/// `name value` lines: the table's occupancy, then the counters in code order.
pub fn render_stats(entries: u64, capacity: u32, sums: &[u64]) -> String {
    [("entries", entries), ("capacity", u64::from(capacity))]
        .into_iter()
        .chain(ct_stat::NAMES.iter().copied().zip(sums.iter().copied()))
        .map(|(n, v)| format!("{n:<14} {v}\n"))
        .collect()
}

/// The table key of the connection a `ct get` names, from either direction's tuple. ICMP
/// with IPv6 addresses is ICMPv6.
pub fn lookup_key(
    proto: &str,
    src: IpAddr,
    dst: IpAddr,
    sport: Option<u16>,
    dport: Option<u16>,
    id: Option<u16>,
) -> Result<CtKey, String> {
    let (family, s, d) = match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let mut a = [0u8; 16];
            let mut b = [0u8; 16];
            a[..4].copy_from_slice(&s.octets());
            b[..4].copy_from_slice(&d.octets());
            (4u8, a, b)
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => (6u8, s.octets(), d.octets()),
        _ => {
            return Err(format!(
                "--src {src} and --dst {dst} are of different address families; give two IPv4 or two IPv6 addresses"
            ));
        }
    };
    let (num, sp, dp) = match proto {
        "tcp" | "udp" => {
            let (Some(sp), Some(dp)) = (sport, dport) else {
                return Err(format!("-p {proto} needs --sport and --dport"));
            };
            (if proto == "tcp" { 6 } else { 17 }, sp, dp)
        }
        "icmp" | "icmpv6" => {
            let Some(id) = id else {
                return Err(format!("-p {proto} needs --id (the echo identifier)"));
            };
            if proto == "icmpv6" && family == 4 {
                return Err("-p icmpv6 needs IPv6 addresses".into());
            }
            (if family == 4 { 1 } else { 58 }, id, id)
        }
        other => {
            return Err(format!(
                "unknown protocol {other:?}; use tcp, udp, icmp or icmpv6"
            ));
        }
    };
    Ok(fastpath_common::ct::ct_key(family, num, &s, sp, &d, dp).0)
}

#[cfg(test)]
mod tests {
    use fastpath_common::ct::{DEFAULT_TIMEOUTS_S, ct_key, tcp_state::ESTABLISHED};

    use super::*;

    #[test]
    fn lookup_keys_are_the_same_from_both_directions() {
        let a: IpAddr = "10.0.0.2".parse().unwrap();
        let b: IpAddr = "10.0.0.1".parse().unwrap();
        let fwd = lookup_key("tcp", a, b, Some(40000), Some(80), None);
        let back = lookup_key("tcp", b, a, Some(80), Some(40000), None);
        assert_eq!(fwd, back);
        let k = fwd.unwrap();
        assert_eq!((k.proto, k.family, k.port_lo, k.port_hi), (6, 4, 80, 40000));
        let v6: IpAddr = "fd00::1".parse().unwrap();
        let e = lookup_key("icmp", v6, "fd00::2".parse().unwrap(), None, None, Some(7)).unwrap();
        assert_eq!((e.proto, e.port_lo, e.port_hi), (58, 7, 7));
        assert!(
            lookup_key("udp", a, v6, Some(1), Some(2), None)
                .unwrap_err()
                .contains("families")
        );
        assert!(
            lookup_key("udp", a, b, None, Some(2), None)
                .unwrap_err()
                .contains("--sport")
        );
    }

    #[test]
    fn rows_read_like_conntrack_l() {
        let c = [10, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        let s = [10, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        // The client (10.0.0.2) opened the connection; its address sorts high.
        let (key, client_is_lo) = ct_key(4, 6, &c, 40000, &s, 80);
        assert!(!client_is_lo);
        let e = CtEntry {
            last_seen_ns: 5_000_000_000,
            packets: [3, 2],
            bytes: [180, 120],
            state: ESTABLISHED,
            flags: CT_F_ASSURED | CT_F_SEEN_REPLY,
            ..CtEntry::default()
        };
        let r = row(&key, &e, 6_000_000_000, &DEFAULT_TIMEOUTS_S);
        assert_eq!(
            render(&r),
            "tcp      6 431999 ESTABLISHED src=10.0.0.2 dst=10.0.0.1 sport=40000 dport=80 packets=3 bytes=180 src=10.0.0.1 dst=10.0.0.2 sport=80 dport=40000 packets=2 bytes=120 [ASSURED]"
        );
    }

    #[test]
    fn unreplied_udp_times_out_sooner() {
        let a = [10, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        let b = [10, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        let (key, _) = ct_key(4, 17, &a, 5000, &b, 53);
        let e = CtEntry {
            flags: CT_F_ORIG_IS_LO,
            ..CtEntry::default()
        };
        assert_eq!(timeout_of(&DEFAULT_TIMEOUTS_S, &key, &e), 30);
        assert!(render(&row(&key, &e, 0, &DEFAULT_TIMEOUTS_S)).contains("[UNREPLIED]"));
    }
}
