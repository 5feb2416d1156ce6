//! Requests decided without a call: a lease hit (stage 2 of `decide`) or
//! `scope: local` rules alone (stage 1). Such a request is never queued,
//! called for, resumed by the root or priced in tokens, so the worker's
//! tables of streams hold nothing of it; its RateLimit headers are made
//! when its response comes, from the check it shares with the plan memo,
//! into a scratch string that keeps its capacity: a busy client's
//! requests allocate nothing for them.

use std::cell::RefCell;
use std::rc::Rc;

use super::clock::HitClock;
use super::{Step, Stream, Worker};
use crate::check::Check;
use crate::host::Host;

/// What a hit needs across requests: the clock it may reuse, and where
/// header values are written.
#[derive(Default)]
pub(super) struct Hits {
    /// The last clock read, which a hit may reuse (see `clock`).
    pub(super) clock: HitClock,
    scratch: RefCell<String>,
}

/// Which of the check's limits decided the hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Scope {
    /// Its global limits, from a lease: every one reports the lease's
    /// units.
    Global,
    /// Its `scope: local` rules (it has no global ones).
    Local,
}

/// What a hit reports in its RateLimit headers, until its response comes.
pub(crate) struct HitHeaders {
    pub(super) check: Rc<Check>,
    pub(super) scope: Scope,
    /// The most constraining limit, an index into the scope's limits.
    pub(super) top: usize,
    pub(super) remaining: u64,
    pub(super) reset_after_ms: u64,
}

impl Worker {
    /// Admits `stream` as a hit; its headers come with its response.
    pub(super) fn admit_hit(&self, stream: &mut Stream, headers: HitHeaders) -> Step {
        stream.hit = true;
        if !super::profile::SKIP_HEADERS {
            stream.hit_headers = Some(headers);
        }
        Step::Continue
    }

    /// Adds a hit's RateLimit headers to its response.
    pub(super) fn add_hit_headers(&self, host: &impl Host, hit: &HitHeaders) {
        let limits = match hit.scope {
            Scope::Global => &hit.check.global,
            Scope::Local => &hit.check.local,
        };
        let mut scratch = self.hits.scratch.borrow_mut();
        crate::headers::add_admitted(
            self.config.response.headers,
            limits,
            (hit.top, hit.remaining, hit.reset_after_ms),
            &hit.check.hit_policy.0,
            &mut scratch,
            |name, value| add(host, name, value),
        );
    }
}

/// Adds a hit's header (in `make bench-headers`' builds, otherwise; see
/// `profile`).
fn add(host: &impl Host, name: &str, value: &str) {
    if super::profile::HEADERS_CROSS_ONLY {
        let _ = host.now_ms();
    } else if super::profile::HEADERS_TINY {
        let tiny = if name == "ratelimit" { "b" } else { "a" };
        host.add_response_header(tiny, "1");
    } else {
        host.add_response_header(name, value);
    }
}
