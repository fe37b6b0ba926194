//! Link options for the datapath object (bpf-linker).
fn main() {
    // Expand memset/memcpy inline instead of emitting them as BPF functions: a BPF-to-BPF
    // call costs tens of ns where `ret` is mitigated (AMD SRSO "Safe RET"), so an out-of-line
    // memset on every packet tripled the parse cost.
    println!("cargo::rustc-link-arg=--disable-memory-builtins");
    // Header fields are read with single (unaligned) loads instead of byte by byte: packet
    // access may be unaligned on x86-64 and arm64, the architectures this project targets
    // (the verifier allows it where the CPU has efficient unaligned access). Halves the parse
    // cost. Stack slots must still be aligned: keep aya-log messages free of arguments.
    println!("cargo::rustc-link-arg=--cpu-features=+allows-misaligned-mem-access");
}
