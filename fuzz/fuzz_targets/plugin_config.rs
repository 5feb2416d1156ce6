//! Any bytes as the plugin configuration: parsed or refused, never a panic.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(config) = meshlimit::config::parse(data) {
        // A config the filter accepts must be internally consistent.
        assert!(!config.rules.is_empty());
        for rule in &config.rules {
            assert!(!rule.limits.is_empty());
            for limit in &rule.limits {
                assert!(limit.requests > 0 && limit.window_ms > 0);
                assert!(!limit.qualified_name.contains(['{', '}']));
            }
        }
    }
});
