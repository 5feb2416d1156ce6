//! The configuration directory, watched: its files are read again when
//! any of them changes (a write, a new or removed file, or the directory
//! swapped through a symlink), checked by polling once a second, which
//! needs no platform watcher and sees symlink swaps as plainly as edits.
//! A configuration with a bad file is refused with a log line naming the
//! file and the field; the last good one stays in use.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use sha2::{Digest, Sha256};
use tracing::{error, info};

use super::config::{ConfigError, Domains};

/// The configuration in use, shared by every request.
#[derive(Clone, Default)]
pub struct Current(Arc<RwLock<Arc<Domains>>>);

impl Current {
    pub fn get(&self) -> Arc<Domains> {
        match self.0.read() {
            Ok(d) => Arc::clone(&d),
            Err(poisoned) => Arc::clone(&poisoned.into_inner()),
        }
    }

    fn set(&self, domains: Domains) {
        match self.0.write() {
            Ok(mut d) => *d = Arc::new(domains),
            Err(poisoned) => *poisoned.into_inner() = Arc::new(domains),
        }
    }
}

/// What the directory holds now: its YAML files' names and contents, read
/// through symlinks.
fn fingerprint(dir: &Path) -> Vec<u8> {
    let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|entries| entries.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    names.sort();
    let mut hash = Sha256::new();
    for name in names {
        hash.update(name.to_string_lossy().as_bytes());
        hash.update(std::fs::read(&name).unwrap_or_default());
        hash.update([0]);
    }
    hash.finalize().to_vec()
}

/// A configuration loaded, and what its directory held when it was read.
pub struct Loaded {
    pub current: Current,
    seen: Vec<u8>,
}

/// Loads `dir` once: the first configuration must be good, or meshlimitd
/// refuses to start (an operator sees the mistake at once).
pub fn load(dir: &Path) -> Result<Loaded, ConfigError> {
    // Taken before the files are read: a change made meanwhile is seen by
    // the first poll (at worst read twice), never missed.
    let seen = fingerprint(dir);
    let domains = Domains::load_dir(dir)?;
    info!(
        "rate limit service configuration: {} domain(s) from {}",
        domains.domain_count(),
        dir.display()
    );
    let current = Current::default();
    current.set(domains);
    Ok(Loaded { current, seen })
}

/// Watches `dir` every `every`, reloading the configuration when the
/// directory holds something else than what was last read; each reload is
/// counted in `metrics` (`meshlimitd_rls_config_loads_total{result}`).
pub async fn watch(
    dir: PathBuf,
    loaded: Loaded,
    every: Duration,
    metrics: crate::metrics::Metrics,
) {
    let Loaded { current, mut seen } = loaded;
    loop {
        tokio::time::sleep(every).await;
        let now = fingerprint(&dir);
        if now == seen {
            continue;
        }
        seen = now;
        match Domains::load_dir(&dir) {
            Ok(domains) => {
                info!(
                    "rate limit service configuration reloaded: {} domain(s)",
                    domains.domain_count()
                );
                current.set(domains);
                metrics.rls_config_load(true);
            }
            Err(e) => {
                metrics.rls_config_load(false);
                error!("rate limit service configuration refused, keeping the last good one: {e}")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rls::config::RateLimit;

    fn write(dir: &Path, requests: u64) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(
            dir.join("edge.yaml"),
            format!("domain: edge\ndescriptors:\n  - key: user\n    rate_limit: {{ unit: minute, requests_per_unit: {requests} }}\n"),
        )
        .unwrap();
    }

    fn requests(current: &Current) -> u64 {
        match &current
            .get()
            .lookup("edge", &[("user", "a")])
            .unwrap()
            .limit
            .limit
        {
            RateLimit::Limited(l) => l.requests,
            _ => 0,
        }
    }

    /// A Kubernetes ConfigMap mount swaps a symlink to a new directory: the
    /// watcher reads the files anew; a broken swap keeps the last good one.
    #[tokio::test]
    async fn a_symlink_swap_is_a_reload_and_a_bad_one_is_refused() {
        let root = std::env::temp_dir().join(format!("rls-reload-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let (a, b, bad) = (root.join("a"), root.join("b"), root.join("bad"));
        write(&a, 5);
        write(&b, 7);
        std::fs::create_dir_all(&bad).unwrap();
        std::fs::write(
            bad.join("edge.yaml"),
            "domain: edge\ndescriptors: [{ key: user, rate_limt: {} }]\n",
        )
        .unwrap();
        let link = root.join("current");
        std::os::unix::fs::symlink(&a, &link).unwrap();
        let loaded = load(&link).unwrap();
        let current = loaded.current.clone();
        assert_eq!(requests(&current), 5);
        let metrics = crate::metrics::Metrics::new();
        let watcher = tokio::spawn(watch(
            link.clone(),
            loaded,
            Duration::from_millis(20),
            metrics.clone(),
        ));
        let swap = |to: &Path| {
            let tmp = root.join("next");
            let _ = std::fs::remove_file(&tmp);
            std::os::unix::fs::symlink(to, &tmp).unwrap();
            std::fs::rename(&tmp, &link).unwrap();
        };
        swap(&b);
        let mut seen = 0;
        for _ in 0..100 {
            seen = requests(&current);
            if seen == 7 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(seen, 7, "the swapped directory is in use");
        swap(&bad);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(requests(&current), 7, "the last good configuration stays");
        let counted = metrics.render();
        assert!(
            counted.contains(r#"meshlimitd_rls_config_loads_total{result="success"} 1"#),
            "{counted}"
        );
        assert!(
            counted.contains(r#"meshlimitd_rls_config_loads_total{result="error"} 1"#),
            "{counted}"
        );
        watcher.abort();
        let _ = std::fs::remove_dir_all(&root);
    }
}
