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

/// Loads `dir` once: the first configuration must be good, or meshlimitd
/// refuses to start (an operator sees the mistake at once).
pub fn load(dir: &Path) -> Result<Current, ConfigError> {
    let domains = Domains::load_dir(dir)?;
    info!(
        "rate limit service configuration: {} domain(s) from {}",
        domains.domain_count(),
        dir.display()
    );
    let current = Current::default();
    current.set(domains);
    Ok(current)
}

/// Watches `dir` every `every`, reloading `current` when it changed.
pub async fn watch(dir: PathBuf, current: Current, every: Duration) {
    let mut seen = fingerprint(&dir);
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
            }
            Err(e) => {
                error!("rate limit service configuration refused, keeping the last good one: {e}")
            }
        }
    }
}
