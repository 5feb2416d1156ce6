//! The decision log: why was this request decided so? A sampled line per
//! decision (`decision_log` in the plugin configuration; off by default,
//! turned on or off by a configuration push, no restart), naming where
//! the decision came from and, for each limit, its name, its subject as
//! overrides spell it (`docs/policies.md`), whether it admitted the
//! request and what is left of it.
//!
//! A line looks like:
//!
//! ```text
//! decision denied from call: api/per-minute subject "hdr:x-api-key:k1" denied remaining 0 of 20
//! ```
//!
//! Where a decision comes from:
//! - `lease`: units meshlimitd leased to this Envoy (no call);
//! - `call`: meshlimitd's answer;
//! - `cache`: a deny remembered until its retry time;
//! - `fallback`: decided by `failure_mode` without meshlimitd;
//! - `local`: a `scope: local` rule, in this Envoy's shared data.
//!
//! Subjects are client input: written with Rust's debug quoting, so a
//! newline or a quote in a header cannot forge a line. When off, a
//! decision costs one branch here; when on, a sampled-out one a draw
//! from a xorshift generator, and at most [`MAX_LINES_PER_SECOND`] lines
//! a second per worker are written (the next line says how many were
//! held back).

use std::cell::Cell;
use std::fmt::Write as _;

use log::Level;
use meshlimit_protocol::CheckResult;

use crate::check::Applied;
use crate::config::{Config, DecisionLogConfig, LogLevel};

/// Lines a worker writes at most in a second.
pub(crate) const MAX_LINES_PER_SECOND: u32 = 100;

/// Where a decision came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    Lease,
    Call,
    Cache,
    Fallback,
    Local,
}

impl Source {
    fn as_str(self) -> &'static str {
        match self {
            Source::Lease => "lease",
            Source::Call => "call",
            Source::Cache => "cache",
            Source::Fallback => "fallback",
            Source::Local => "local",
        }
    }
}

/// One limit as the line shows it.
pub(crate) struct LimitLine<'a> {
    pub applied: &'a Applied,
    pub allowed: bool,
    /// `None` where it is not known (a cached deny, `failure_mode` allow
    /// or deny).
    pub remaining: Option<u64>,
}

pub(super) struct DecisionLog {
    config: Option<DecisionLogConfig>,
    /// xorshift64 state (never 0).
    rng: Cell<u64>,
    /// The second of the last line, lines written in it, and lines held
    /// back since the last line.
    second: Cell<u64>,
    written: Cell<u32>,
    held_back: Cell<u64>,
}

impl DecisionLog {
    pub(super) fn new(config: &Config, seed: u64) -> DecisionLog {
        DecisionLog {
            config: config.decision_log,
            rng: Cell::new(seed | 1),
            second: Cell::new(0),
            written: Cell::new(0),
            held_back: Cell::new(0),
        }
    }

    /// Logs the decision of a result on `limits` (in the result's order).
    pub(super) fn result(
        &self,
        now: u64,
        source: Source,
        limits: &[Applied],
        result: &CheckResult,
    ) {
        let denied = !result.allowed || result.limits.iter().any(|l| !l.allowed);
        if !self.sampled(denied) {
            return;
        }
        let lines = limits.iter().enumerate().map(|(i, applied)| {
            let status = result.limits.get(i);
            LimitLine {
                applied,
                allowed: status.is_none_or(|s| s.allowed),
                remaining: status.map(|s| s.remaining),
            }
        });
        self.write(now, source, decision(result.allowed, denied), lines);
    }

    /// Logs a request admitted on `limits` with `remaining` left (a lease
    /// hit, a local draw).
    pub(super) fn admitted(&self, now: u64, source: Source, limits: &[Applied], remaining: u64) {
        if !self.sampled(false) {
            return;
        }
        let lines = limits.iter().map(|applied| LimitLine {
            applied,
            allowed: true,
            remaining: Some(remaining),
        });
        self.write(now, source, "allowed", lines);
    }

    /// Logs a decision no counter made (a cached deny, `failure_mode`
    /// allow or deny): `refused` names the limit that refused, if any.
    pub(super) fn uncounted(
        &self,
        now: u64,
        source: Source,
        limits: &[Applied],
        allowed: bool,
        refused: Option<&Applied>,
    ) {
        if !self.sampled(!allowed) {
            return;
        }
        let lines = limits.iter().map(|applied| LimitLine {
            applied,
            allowed: !refused.is_some_and(|r| std::ptr::eq(r, applied)),
            remaining: None,
        });
        self.write(
            now,
            source,
            if allowed { "allowed" } else { "denied" },
            lines,
        );
    }

    /// Whether a decision (a denial: `denied`) gets a line.
    fn sampled(&self, denied: bool) -> bool {
        let Some(config) = &self.config else {
            return false;
        };
        if config.denied_only && !denied {
            return false;
        }
        if config.sample_ppm >= 1_000_000 {
            return true;
        }
        let mut x = self.rng.get();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng.set(x);
        x % 1_000_000 < u64::from(config.sample_ppm)
    }

    #[cold]
    #[inline(never)]
    fn write<'a>(
        &self,
        now: u64,
        source: Source,
        decision: &str,
        limits: impl Iterator<Item = LimitLine<'a>>,
    ) {
        let second = now / 1000;
        if second != self.second.get() {
            self.second.set(second);
            self.written.set(0);
        }
        if self.written.get() >= MAX_LINES_PER_SECOND {
            self.held_back.set(self.held_back.get() + 1);
            return;
        }
        self.written.set(self.written.get() + 1);
        let mut line = format!("decision {decision} from {}:", source.as_str());
        for (i, l) in limits.enumerate() {
            let limit = &l.applied.limit;
            let _ = write!(
                line,
                "{} {} subject {:?} {}",
                if i == 0 { "" } else { ";" },
                limit.qualified_name,
                l.applied.subject,
                if l.allowed { "allowed" } else { "denied" }
            );
            if let Some(remaining) = l.remaining {
                let _ = write!(line, " remaining {remaining} of {}", limit.requests);
            }
            if l.applied.shadow {
                line.push_str(" (shadow)");
            }
        }
        let held_back = self.held_back.replace(0);
        if held_back > 0 {
            let _ = write!(line, " ({held_back} sampled lines held back)");
        }
        let level = match self.config.map(|c| c.level) {
            Some(LogLevel::Info) => Level::Info,
            _ => Level::Debug,
        };
        log::log!(level, "{line}");
    }
}

/// `allowed`, `denied`, or `shadow_denied` (admitted; a shadow limit
/// would have refused).
fn decision(allowed: bool, refused_somewhere: bool) -> &'static str {
    match (allowed, refused_somewhere) {
        (false, _) => "denied",
        (true, true) => "shadow_denied",
        (true, false) => "allowed",
    }
}
