//! `make bench-timers`: the in-VM timers of a timed build.

use meshlimit_testbed::http;

use crate::rows::Target;

/// The in-VM timers of a `make bench-timers` build (src/wasm/timers.rs),
/// if `t` runs one: each callback's and costly hostcall's time, per call
/// and per request (requests counted by the streams created, the warm-up
/// included).
pub(crate) fn print_timers(t: &Target) {
    let stats = http::envoy_stats(&t.admin, r"^wasmcustom\.meshlimit\.profile\.");
    let value = |name: &str| {
        stats
            .iter()
            .find(|(n, _)| n.strip_prefix("wasmcustom.meshlimit.profile.") == Some(name))
            .map_or(0, |(_, v)| *v)
    };
    let requests = value("stream_created.calls");
    if requests == 0 {
        return;
    }
    println!(
        "\n{}: in-VM timers over {requests} requests (a callback's time includes its hostcalls')\n\n| site | calls per request | µs per call | µs per request |\n|---|---|---|---|",
        t.name
    );
    for (name, _) in stats.iter().filter(|(n, _)| n.ends_with(".calls")) {
        let Some(site) = name
            .strip_prefix("wasmcustom.meshlimit.profile.")
            .and_then(|n| n.strip_suffix(".calls"))
        else {
            continue;
        };
        let (calls, us) = (
            value(&format!("{site}.calls")),
            value(&format!("{site}.us")),
        );
        println!(
            "| {site} | {:.3} | {:.2} | {:.2} |",
            calls as f64 / requests as f64,
            us as f64 / calls.max(1) as f64,
            us as f64 / requests as f64
        );
    }
}
