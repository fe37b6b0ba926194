//! Link options for the datapath object (bpf-linker).
fn main() {
    // Keep the conntrack stage a global BPF function: the verifier checks it once, on its own.
    println!("cargo::rustc-link-arg=--export=fp_ct_track");
}
