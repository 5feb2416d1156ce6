//! Builds of the filter that skip one step of the asynchronous path, made
//! by `make bench-profile` only (cargo features `profile-skip-*`; never in
//! a release build): the difference in Envoy's CPU per request between
//! the shipped build and each of these is what that step costs.
//!
//! - `SKIP_HEADERS`: no RateLimit headers are made or added.
//! - `SKIP_PAUSE`: a request whose check is queued goes on at once; the
//!   check is still queued, the root still woken, the batch still sent
//!   and its answer read, but nothing is resumed.
//! - `SKIP_CALL`: a request that would call is admitted at once, as if
//!   meshlimitd had answered (no queue, wake-up, dispatch, answer).
//! - `SKIP_PLAN`: a request goes on once its headers are read.
//! - `SKIP_READ`: a request goes on before its headers are read (what
//!   reading them costs, against the do-nothing filter's one header).
//! - `SKIP_DECIDE`: a request goes on once its check is planned (its
//!   headers read, its rules matched, its subject made): what the filter
//!   costs before it decides anything.
//!
//! And, for a lease hit's two RateLimit headers (`make bench-headers`),
//! builds that make the headers' values but add them otherwise:
//!
//! - `HEADERS_CROSS_ONLY`: in place of each header, one crossing into
//!   Envoy that adds nothing (a clock read): what the crossings and the
//!   values cost, without Envoy's work for a header.
//! - `HEADERS_TINY`: each header added with a one-byte name and value:
//!   Envoy's work for a header, apart from its bytes.

pub(crate) const SKIP_HEADERS: bool = cfg!(feature = "profile-skip-headers");
pub(crate) const SKIP_PAUSE: bool = cfg!(feature = "profile-skip-pause");
pub(crate) const SKIP_CALL: bool = cfg!(feature = "profile-skip-call");
pub(crate) const SKIP_DECIDE: bool = cfg!(feature = "profile-skip-decide");
pub(crate) const SKIP_READ: bool = cfg!(feature = "profile-skip-read");
pub(crate) const SKIP_PLAN: bool = cfg!(feature = "profile-skip-plan");
pub(crate) const HEADERS_CROSS_ONLY: bool = cfg!(feature = "profile-headers-cross-only");
pub(crate) const HEADERS_TINY: bool = cfg!(feature = "profile-headers-tiny");
