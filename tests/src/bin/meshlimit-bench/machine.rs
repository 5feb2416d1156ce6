//! The machine: cores, pinning processes to them, their CPU time, and an
//! Envoy's stats.

use std::process::Command;

use meshlimit_testbed::Topology;

use crate::load::{Sample, SECONDS};
use crate::rows::{run, Target};

/// The machine's cores, read once, first thing: the bench later pins its
/// own process (it runs the token row's fake model), and
/// `available_parallelism` follows the process's CPU affinity.
pub(crate) fn cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The CPU for the Envoy under test, and the CPUs for everything else (its
/// upstream, meshlimitd, Redis, the load generator); None on one core.
pub(crate) fn cpu_sets() -> Option<(String, String)> {
    let n = cores();
    let others = if n == 2 {
        "1".to_string()
    } else {
        format!("1-{}", n - 1)
    };
    (n >= 2).then_some(("0".to_string(), others))
}

/// Sets the CPUs every thread of `pid` may run on.
pub(crate) fn pin(pid: Option<u32>, cpus: &str) {
    let Some(pid) = pid else { return };
    let ok = Command::new("taskset")
        .args(["-a", "-p", "-c", cpus, &pid.to_string()])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(ok, "taskset could not pin process {pid} to CPUs {cpus}");
}

pub(crate) use meshlimit_testbed::http::envoy_stat as stat;

pub(crate) use meshlimit_testbed::procs::cpu_ticks;

/// CPU time of the whole machine so far (all cores, excluding idle), ticks.
pub(crate) fn busy_ticks() -> u64 {
    std::fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|s| {
            let cpu: Vec<u64> = s
                .lines()
                .next()?
                .split_whitespace()
                .skip(1)
                .filter_map(|v| v.parse().ok())
                .collect();
            Some(
                cpu.iter().sum::<u64>()
                    - cpu.get(3).copied().unwrap_or(0)
                    - cpu.get(4).copied().unwrap_or(0),
            )
        })
        .unwrap_or(0)
}

/// Where the CPU went during one saturation run: per process, in
/// milliseconds of CPU per 1000 requests.
pub(crate) struct CpuShare {
    pub(crate) name: &'static str,
    pub(crate) per_1000: Vec<(&'static str, f64)>,
}

/// Pins the Envoys under test (`targets`) to wait off the test core and
/// the rest of `topologies` (upstreams, meshlimitd, Redis) and the load
/// generator to the other cores (see [`pin_for_runs`]), then warms every
/// row up at a fixed rate.
pub(crate) fn pin_and_warm<'t>(
    what: &str,
    targets: &[Target],
    topologies: impl Iterator<Item = &'t Topology>,
    key: &str,
) {
    let support = topologies.flat_map(|t| [t.upstream_pid(), t.meshlimitd_pid(), t.redis_pid()]);
    if !pin_for_runs(targets.iter().map(|t| t.pid), support) {
        panic!("{what} pins Envoy to a core of its own: it needs two cores");
    }
    for t in targets {
        let _ = run(t, key, Some(2_000));
    }
}

/// While runs are pinned: the core the Envoy under test runs on, alone,
/// and the cores every other process waits on meanwhile (the other Envoys
/// under test, the upstreams, meshlimitd, Redis, the load generator). An
/// idle Envoy still wakes (its timers, health checks, the filter's tick:
/// about 0.2% of a core each), and a run beside thirty of them was a run
/// beside their wake-ups: in `make bench-ab` with ten more copies of one
/// build, the copies read 0.75 to 0.92 of the do-nothing filter (median
/// 0.87) waiting on the test core, and 0.80 to 0.95 (median 0.91) waiting
/// on the other.
static PINNING: std::sync::Mutex<Option<(String, String)>> = std::sync::Mutex::new(None);

fn pinning() -> Option<(String, String)> {
    PINNING.lock().map(|c| c.clone()).unwrap_or(None)
}

/// Pins the Envoys under test (`envoys`) and everything else (`support`)
/// to wait off the test core, where [`on_the_test_core`] moves each for
/// its run. False (nothing pinned) on one core.
pub(crate) fn pin_for_runs(
    envoys: impl IntoIterator<Item = u32>,
    support: impl IntoIterator<Item = Option<u32>>,
) -> bool {
    let Some((test, waiting)) = cpu_sets() else {
        return false;
    };
    for pid in envoys {
        pin(Some(pid), &waiting);
    }
    for pid in support {
        pin(pid, &waiting);
    }
    if let Ok(mut p) = PINNING.lock() {
        *p = Some((test, waiting));
    }
    true
}

/// Ends the pinning: every process may run on every core.
pub(crate) fn unpin_all(pids: impl IntoIterator<Item = Option<u32>>) {
    let all = format!("0-{}", cores() - 1);
    for pid in pids {
        pin(pid, &all);
    }
    if let Ok(mut p) = PINNING.lock() {
        *p = None;
    }
}

/// The cores the load generator runs on while runs are pinned (None:
/// unpinned).
pub(crate) fn loadgen_cores() -> Option<String> {
    pinning().map(|(_, waiting)| waiting)
}

/// Runs `f` (a run against the Envoy `pid`) with that Envoy moved to the
/// test core for it, and back to wait with the others after; unpinned,
/// just runs `f`.
pub(crate) fn on_the_test_core<T>(pid: u32, f: impl FnOnce() -> T) -> T {
    let Some((test, waiting)) = pinning() else {
        return f();
    };
    pin(Some(pid), &test);
    let out = f();
    pin(Some(pid), &waiting);
    out
}

/// A saturation run of `t`, with the Envoy CPU it spent per request
/// (since `before`, its CPU ticks when the run started; USER_HZ is 100 on
/// Linux: a tick is 10 ms).
pub(crate) fn with_cpu(t: &Target, mut s: Sample, before: u64) -> Sample {
    s.envoy_cpu_us =
        (cpu_ticks(Some(t.pid)) - before) as f64 * 10_000.0 / (s.rps * SECONDS as f64).max(1.0);
    s
}

/// Whether the environment variable `name` is set to something (an empty
/// value, as `make` passes an unset one, is off).
pub(crate) fn flag(name: &str) -> bool {
    std::env::var_os(name).is_some_and(|v| !v.is_empty())
}
