//! Link options for the datapath object (bpf-linker).
fn main() {
    // Expand memset/memcpy inline instead of emitting them as BPF functions: a BPF-to-BPF
    // call costs tens of ns where `ret` is mitigated (AMD SRSO "Safe RET"), so an out-of-line
    // memset on every packet tripled the parse cost.
    println!("cargo::rustc-link-arg=--disable-memory-builtins");
}
