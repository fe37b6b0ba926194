//! What the kernel's verifier made of each datapath program: instructions it processed
//! (`verified_insns`, against its limit of 1,000,000) and the size of the program it accepted,
//! for this tree's object or the objects named, side by side. Root (loads programs).
//!
//! `cargo run --release -p fastpath --example verifier [-- OBJECT...]`: this tree's daemon
//! object (`fastpath::EBPF_OBJECT`), then each object named (e.g. an earlier build from
//! `target/bench-old/`), or this tree's benchmark build when none is.

use std::collections::BTreeMap;

use anyhow::{Context as _, Result};

/// Per program: instructions processed by the verifier and translated size, or why it was
/// refused.
type Counts = BTreeMap<String, Result<(u32, u32), String>>;

fn main() -> Result<()> {
    let paths: Vec<String> = std::env::args().skip(1).collect();
    let mut objects: Vec<(String, Vec<u8>)> =
        vec![("this tree".into(), fastpath::EBPF_OBJECT.to_vec())];
    if paths.is_empty() {
        objects.push((
            "this tree (bench)".into(),
            fastpath::EBPF_BENCH_OBJECT.to_vec(),
        ));
    }
    for p in paths {
        let bytes = std::fs::read(&p).with_context(|| format!("reading the object {p}"))?;
        objects.push((p, bytes));
    }
    let counts: Vec<Counts> = objects
        .iter()
        .map(|(name, bytes)| counts(bytes).with_context(|| format!("loading {name}")))
        .collect::<Result<_>>()?;
    let mut programs: Vec<&String> = counts.iter().flat_map(|c| c.keys()).collect();
    programs.sort();
    programs.dedup();
    print!("| program |");
    for (name, _) in &objects {
        print!(" {name}: verified insns | {name}: insns |");
    }
    println!();
    println!("|---|{}", "---:|---:|".repeat(objects.len()));
    for prog in programs {
        print!("| {prog} |");
        for c in &counts {
            match c.get(prog) {
                Some(Ok((verified, size))) => print!(" {verified} | {size} |"),
                Some(Err(why)) => print!(" refused: {why} | |"),
                None => print!(" – | – |"),
            }
        }
        println!();
    }
    Ok(())
}

/// Loads every XDP and TC program of `object` (as `fastpath kernel` does) and reads back what
/// the verifier counted; a refusal as its log's last line.
fn counts(object: &[u8]) -> Result<Counts> {
    let report = fastpath::datapath::kernel::check(object, false)?;
    Ok(report
        .programs
        .into_iter()
        .map(|p| {
            let counted = match p.refused {
                Some(why) => Err(why.lines().last().unwrap_or("").chars().take(120).collect()),
                None => Ok((p.verified_insns.unwrap_or(0), p.xlated_insns.unwrap_or(0))),
            };
            (p.name, counted)
        })
        .collect())
}
