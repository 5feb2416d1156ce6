//! Child processes that are killed (by PID) when their handle drops, with
//! their output in a log file kept for the failure message; and, for the
//! binaries built with `panic = "abort"` (the release profile's, for the
//! filter and meshlimitd), killed by a panic hook when no handle will drop.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Every process spawned and not yet stopped, by PID: what the panic hook
/// of [`stop_all_on_panic`] kills.
static RUNNING: Mutex<Vec<u32>> = Mutex::new(Vec::new());

/// For the testbed's binaries (`make demo`, `make bench`, soak, accuracy):
/// they run in the release profile, which aborts on a panic, so no
/// destructor runs and every process they started (Envoys, meshlimitd,
/// Redis) would outlive them, holding its address and a share of the CPU
/// the next run measures. The hook reports the panic as before, then
/// kills those still running. Not for tests: they unwind, each test's handles stop
/// its own processes, and one test's panic must not stop another's.
pub fn stop_all_on_panic() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        let running = std::mem::take(&mut *RUNNING.lock().unwrap_or_else(PoisonError::into_inner));
        for pid in running {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
    }));
}

pub struct Proc {
    pub name: String,
    child: Option<Child>,
    pub log: PathBuf,
}

/// A process reaped or stopped: its PID may be reused, never killed again.
fn no_longer_running(pid: u32) {
    RUNNING
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .retain(|&p| p != pid);
}

impl Proc {
    pub fn spawn(name: &str, cmd: &mut Command, log_dir: &Path) -> Proc {
        let log = log_dir.join(format!("{name}.log"));
        let out =
            File::create(&log).unwrap_or_else(|e| panic!("cannot create {}: {e}", log.display()));
        let err = out
            .try_clone()
            .unwrap_or_else(|e| panic!("cannot dup log handle: {e}"));
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({cmd:?}): {e}"));
        RUNNING
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(child.id());
        Proc {
            name: name.to_string(),
            child: Some(child),
            log,
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The process's output so far (for failure messages).
    pub fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// True while the process runs.
    pub fn alive(&mut self) -> bool {
        let Some(c) = self.child.as_mut() else {
            return false;
        };
        if matches!(c.try_wait(), Ok(None)) {
            return true;
        }
        no_longer_running(c.id());
        false
    }

    /// Waits for it to exit and returns its status code.
    pub fn wait(&mut self, timeout: Duration) -> Option<i32> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(status)) = c.try_wait() {
                    no_longer_running(c.id());
                    return status.code();
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    /// SIGTERM, then SIGKILL if it lingers.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let pid = child.id().to_string();
            // A process that has already exited (a test stopped it on
            // purpose) leaves nothing to signal: kill's complaint is noise.
            let _ = Command::new("kill")
                .args(["-TERM", &pid])
                .stderr(Stdio::null())
                .status();
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    no_longer_running(child.id());
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
            no_longer_running(child.id());
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop();
    }
}

/// CPU time (user + system) a process used so far, in clock ticks (10 ms
/// each on Linux), 0 if unknown.
pub fn cpu_ticks(pid: Option<u32>) -> u64 {
    pid.and_then(|p| std::fs::read_to_string(format!("/proc/{p}/stat")).ok())
        .and_then(|s| {
            // Fields after the command name (which may contain spaces).
            let rest = s.rsplit_once(')')?.1;
            let f: Vec<&str> = rest.split_whitespace().collect();
            Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
        })
        .unwrap_or(0)
}

/// Resident memory of a process in KiB (VmRSS), 0 if unknown.
pub fn rss_kib(pid: Option<u32>) -> u64 {
    pid.and_then(|p| std::fs::read_to_string(format!("/proc/{p}/status")).ok())
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

/// Polls `holds` every 20 ms until it does or `within` has passed, and
/// says which: for effects that meshlimitd applies after its answer (a
/// give-back is spawned, not awaited), so that a test asserts the end
/// state, with its values, instead of sleeping a guess.
pub fn eventually(within: Duration, mut holds: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if holds() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Polls `ready` until it holds, or panics with the process's output.
pub fn wait_until(proc: &mut Proc, what: &str, timeout: Duration, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    loop {
        if ready() {
            return;
        }
        if !proc.alive() {
            panic!(
                "{} exited before {what}; its output:\n{}",
                proc.name,
                proc.output()
            );
        }
        if Instant::now() > deadline {
            panic!(
                "{} not {what} after {timeout:?}; its output:\n{}",
                proc.name,
                proc.output()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A fresh temporary directory, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "meshlimit-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
        TempDir(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if std::env::var_os("MESHLIMIT_KEEP_LOGS").is_none() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Set in the child run of the test below.
    const CHILD: &str = "MESHLIMIT_PROCS_PANIC_CHILD";

    /// A binary that panics under `panic = "abort"` runs no destructor: the
    /// child run forgets its handle, as an abort would, and panics; the
    /// hook must still stop the process it started.
    #[test]
    fn a_panic_stops_what_was_started_even_with_no_destructor_run() {
        if std::env::var_os(CHILD).is_some() {
            stop_all_on_panic();
            let dir = TempDir::new("procs-panic");
            let sleeper = Proc::spawn("sleeper", Command::new("sleep").arg("60"), dir.path());
            println!("sleeper pid {}", sleeper.pid().unwrap_or(0));
            std::mem::forget(sleeper);
            panic!("on purpose: the child run of this test");
        }
        let exe = std::env::current_exe().unwrap();
        let out = Command::new(exe)
            .args([
                "--exact",
                "procs::tests::a_panic_stops_what_was_started_even_with_no_destructor_run",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(CHILD, "1")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let pid: u32 = stdout
            .lines()
            // libtest prints it after the test's name, on the same line.
            .find_map(|l| l.split("sleeper pid ").nth(1))
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or_else(|| panic!("the child run printed no pid: {stdout}"));
        assert!(!out.status.success(), "the child run panicked on purpose");
        let gone = eventually(Duration::from_secs(5), || {
            // Gone, or a zombie waiting for init to reap it.
            std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| {
                s.rsplit_once(')')
                    .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
            })
        });
        if !gone {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
        assert!(gone, "process {pid} outlived the run that started it");
    }
}
