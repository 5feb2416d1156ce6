//! Any text as a rate limit service configuration file (what an operator
//! puts in `--rls-config-dir`, read at start and at every reload),
//! then any descriptor looked up in it (what an Envoy sends in
//! `ShouldRateLimit`): refused with the file and field named, or loaded;
//! never a panic, and a loaded limit's window is one meshlimitd can count.
#![no_main]

use std::collections::BTreeMap;

use meshlimitd::rls::config::{Domains, RateLimit, MAX_WINDOW_MS};

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    // The file, then after a NUL the descriptor: `key=value` entries, one
    // a line.
    let (file, descriptor) = match data.iter().position(|&b| b == 0) {
        Some(at) => (&data[..at], &data[at + 1..]),
        None => (data, &[][..]),
    };
    let Ok(text) = std::str::from_utf8(file) else {
        return;
    };
    let files = BTreeMap::from([("fuzz.yaml".to_string(), text.to_string())]);
    let domains = match Domains::from_files(&files) {
        Ok(domains) => domains,
        Err(e) => {
            assert_eq!(e.file, "fuzz.yaml", "a refusal names its file");
            return;
        }
    };
    let descriptor = String::from_utf8_lossy(descriptor);
    let entries: Vec<(&str, &str)> = descriptor
        .lines()
        .map(|line| line.split_once('=').unwrap_or((line, "")))
        .collect();
    for domain in ["", "fuzz", "d", "edge"] {
        if let Some(matched) = domains.lookup(domain, &entries) {
            if let RateLimit::Limited(limited) = &matched.limit.limit {
                assert!(limited.requests > 0);
                let window = limited.window_ms();
                assert!(window > 0 && window <= MAX_WINDOW_MS);
            }
        }
    }
});
