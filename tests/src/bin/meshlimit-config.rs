//! `meshlimit-config FILE...`: checks plugin configurations (JSON) with the
//! filter's own parser, before Envoy or Istio ever loads them. Prints one
//! line per file; exits 1 if any is refused.
//!
//!   cargo run -q -p meshlimit-testbed --bin meshlimit-config -- config.json

// Test code: a failed expectation is a panic, by design.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

fn main() {
    let files: Vec<String> = std::env::args().skip(1).collect();
    if files.is_empty() {
        eprintln!("usage: meshlimit-config FILE.json...");
        std::process::exit(2);
    }
    let mut failed = false;
    for file in &files {
        match std::fs::read(file) {
            Err(e) => {
                println!("{file}: cannot read: {e}");
                failed = true;
            }
            Ok(bytes) => match meshlimit::config::parse(&bytes) {
                Ok(c) => println!(
                    "{file}: ok ({} rule(s), service cluster \"{}\")",
                    c.rules.len(),
                    c.service.cluster
                ),
                Err(e) => {
                    println!("{file}: {e}");
                    failed = true;
                }
            },
        }
    }
    if failed {
        std::process::exit(1);
    }
}
