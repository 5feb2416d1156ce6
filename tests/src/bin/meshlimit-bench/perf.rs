//! `make bench-perf`: where each Envoy's CPU goes, from perf's call
//! chains.

use std::process::Command;

use meshlimit_testbed::tools;

use crate::machine::stat;
use crate::rows::Target;

/// Samples a second `make bench-perf` takes of each Envoy: what one
/// sample is worth in scripts/perf_split.py follows from it.
pub(crate) const PERF_HZ: u32 = 499;

/// `perf record -g` on every Envoy of a `make bench-ab` run, and the
/// requests each served meanwhile; [`PerfRecording::finish`] splits their
/// time with scripts/perf_split.py: inside the VM (the filter's wasm and
/// its hostcalls) and outside it, and the call paths that differ from the
/// first row's (the do-nothing filter).
pub(crate) struct PerfRecording {
    pub(crate) dir: std::path::PathBuf,
    pub(crate) recorders: Vec<std::process::Child>,
    pub(crate) requests_before: Vec<u64>,
}

impl PerfRecording {
    pub(crate) fn start(dir: &std::path::Path, targets: &[Target]) -> PerfRecording {
        let _ = std::fs::create_dir_all(dir);
        let recorders = targets
            .iter()
            .enumerate()
            .map(|(i, t)| {
                Command::new("perf")
                    .args(["record", "-q", "-g", "-e", "cpu-clock", "-p"])
                    .arg(t.pid.to_string())
                    .arg("-F")
                    .arg(PERF_HZ.to_string())
                    .arg("-o")
                    .arg(dir.join(format!("row{i}.data")))
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .spawn()
                    .unwrap_or_else(|e| {
                        panic!("cannot run perf: {e} (make bench-perf installs it)")
                    })
            })
            .collect();
        let requests_before = targets
            .iter()
            .map(|t| stat(&t.admin, "http.ingress.downstream_rq_total"))
            .collect();
        PerfRecording {
            dir: dir.to_path_buf(),
            recorders,
            requests_before,
        }
    }

    pub(crate) fn finish(self, targets: &[Target]) {
        let requests: Vec<u64> = targets
            .iter()
            .zip(&self.requests_before)
            .map(|(t, before)| {
                stat(&t.admin, "http.ingress.downstream_rq_total").saturating_sub(*before)
            })
            .collect();
        for mut recorder in self.recorders {
            // perf writes its file out on SIGINT.
            let _ = Command::new("kill")
                .args(["-INT", &recorder.id().to_string()])
                .status();
            let _ = recorder.wait();
        }
        let mut args = Vec::new();
        for (i, (t, n)) in targets.iter().zip(&requests).enumerate() {
            let stacks = self.dir.join(format!("row{i}.stacks"));
            let written = std::fs::File::create(&stacks).ok().and_then(|out| {
                Command::new("perf")
                    .args(["script", "-F", "ip,dso", "-i"])
                    .arg(self.dir.join(format!("row{i}.data")))
                    .stdout(out)
                    .stderr(std::process::Stdio::null())
                    .status()
                    .ok()
            });
            if written.is_some_and(|s| s.success()) {
                args.push(format!("{}={}:{n}", t.name, stacks.display()));
            }
        }
        // Every Envoy runs the same binary.
        let envoy = targets
            .first()
            .and_then(|t| std::fs::read_link(format!("/proc/{}/exe", t.pid)).ok())
            .unwrap_or_else(tools::envoy);
        let split = Command::new("python3")
            .arg(tools::root().join("scripts/perf_split.py"))
            .arg(envoy)
            .arg(PERF_HZ.to_string())
            .args(&args)
            .status();
        assert!(
            split.is_ok_and(|s| s.success()),
            "scripts/perf_split.py failed on {}",
            self.dir.display()
        );
    }
}
