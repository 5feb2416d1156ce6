//! Builders the unit tests share: one way to make a limit, a limit applied
//! to a request, and a limit's status in an answer. Compiled only under
//! `#[cfg(test)]`.

use std::rc::Rc;

use meshlimit_protocol::{Algorithm, LimitStatus};

use crate::check::Applied;
use crate::config::LimitConfig;

/// A fixed-window limit named `rule/name`.
pub(crate) fn limit(qualified_name: &str, requests: u64, window_ms: u64) -> LimitConfig {
    let name = qualified_name
        .rsplit('/')
        .next()
        .unwrap_or(qualified_name)
        .to_string();
    LimitConfig {
        name,
        qualified_name: qualified_name.to_string(),
        requests,
        window_ms,
        algorithm: Algorithm::FixedWindow,
        burst: None,
        by: vec![crate::config::Attribute::Client],
        missing: crate::config::MissingAttribute::Skip,
        overrides: Vec::new(),
        calendar: None,
        share_ppm: 1_000_000,
        stats: crate::config::StatSlot::default(),
    }
}

/// `limit` applied to a request of cost 1, enforced.
pub(crate) fn applied(limit: &LimitConfig) -> Applied {
    Applied {
        limit: Rc::new(limit.clone()),
        cost: 1,
        shadow: false,
        subject: "s".into(),
        tokens: false,
    }
}

/// A limit's status in an answer.
pub(crate) fn status(
    allowed: bool,
    limit: u64,
    remaining: u64,
    reset_after_ms: u64,
    retry_after_ms: u64,
) -> LimitStatus {
    LimitStatus {
        allowed,
        limit,
        remaining,
        reset_after_ms,
        retry_after_ms,
        shadow: false,
        reason: None,
    }
}
