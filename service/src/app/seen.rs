//! The limits meshlimitd has decided, by name, as their checks last
//! described them: what `GET /v1/usage/{rule}/{limit}` reads a subject's
//! counter with (a counter's key is made of its limit's name, algorithm
//! and window; its remaining of its quota), so an operator names a limit
//! and a subject, nothing more.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use meshlimit_protocol::Limit;

/// Names kept at most (as many as the per-limit metrics label).
pub const MAX_SEEN: usize = 1000;

#[derive(Clone, Default, Debug)]
pub struct LimitsSeen(Arc<RwLock<HashMap<String, Limit>>>);

impl LimitsSeen {
    /// Notes `limits`' definitions: a read lock when nothing changed (the
    /// usual case), a write only for a new name or a changed definition.
    pub fn note<'a>(&self, limits: impl Iterator<Item = &'a Limit>) {
        for limit in limits {
            let same = self.0.read().is_ok_and(|seen| {
                seen.get(&limit.name)
                    .is_some_and(|s| same_counter(s, limit))
            });
            if same {
                continue;
            }
            if let Ok(mut seen) = self.0.write() {
                if seen.len() < MAX_SEEN || seen.contains_key(&limit.name) {
                    let mut kept = limit.clone();
                    kept.cost = 0;
                    kept.shadow = false;
                    kept.subject = None;
                    seen.insert(limit.name.clone(), kept);
                }
            }
        }
    }

    /// The last definition of limit `name` (`rule/limit`), at cost 0.
    pub fn get(&self, name: &str) -> Option<Limit> {
        self.0.read().ok()?.get(name).cloned()
    }
}

/// Whether two definitions read the same counter the same way.
fn same_counter(a: &Limit, b: &Limit) -> bool {
    (a.requests, a.window_ms, a.algorithm, a.burst, a.calendar)
        == (b.requests, b.window_ms, b.algorithm, b.burst, b.calendar)
}
