//! Holding a request's headers until it is decided, for a reservation read
//! from its body (token budgets), so that a denied request never reaches
//! the upstream: not its headers, not a connection.
//!
//! A paused header callback is turned into "stop all iteration" by Envoy,
//! which then delivers no body callbacks, unless the Wasm `PluginConfig`
//! sets `allow_on_headers_stop_iteration` (Envoy 1.35 and later; Istio's
//! `WasmPlugin` cannot set it). The filter cannot read that setting, so the
//! plugin configuration says it (`allow_on_headers_stop_iteration: true`)
//! and the hold checks it: until a held stream's first body callback
//! proves Envoy honours it, a stream held for [`PROOF_WITHIN_MS`] with no
//! body callback makes the worker stop holding (its headers go on, as
//! without the setting) and say so in the log, rather than leave requests
//! hanging.

use std::cell::{Cell, RefCell};

use log::warn;

use crate::context_map::ContextMap;

/// How long a held stream may wait for its first body callback before the
/// worker concludes that Envoy does not honour the setting.
pub(super) const PROOF_WITHIN_MS: u64 = 1_000;

pub(super) struct HeaderHold {
    /// Holding is configured, and not found unhonoured.
    on: Cell<bool>,
    /// A held stream got a body callback: Envoy honours the setting.
    proven: Cell<bool>,
    /// Streams holding their headers (until proven), since when.
    held: RefCell<ContextMap<u64>>,
}

impl HeaderHold {
    pub(super) fn new(configured: bool) -> HeaderHold {
        HeaderHold {
            on: Cell::new(configured),
            proven: Cell::new(false),
            held: RefCell::default(),
        }
    }

    /// Whether stream `id`, whose reservation is in its body, holds its
    /// headers (else they go on and only the body waits).
    pub(super) fn hold(&self, id: u32, now: u64) -> bool {
        if !self.on.get() {
            return false;
        }
        if !self.proven.get() {
            self.held.borrow_mut().insert(id, now);
        }
        true
    }

    /// A body callback of stream `id`.
    pub(super) fn body_came(&self, id: u32) {
        if self.on.get() && !self.proven.get() && self.held.borrow_mut().remove(&id).is_some() {
            self.proven.set(true);
            self.held.borrow_mut().clear();
        }
    }

    /// Stream `id` ended.
    pub(super) fn forget(&self, id: u32) {
        if !self.proven.get() {
            self.held.borrow_mut().remove(&id);
        }
    }

    /// Whether the root's tick should look at held streams.
    pub(super) fn unproven(&self) -> bool {
        self.on.get() && !self.proven.get()
    }

    /// The streams to let go on the root's tick: every held one, once one
    /// waited [`PROOF_WITHIN_MS`] for a body callback that never came
    /// (holding then stops for this worker).
    pub(super) fn overdue(&self, now: u64) -> Vec<u32> {
        if !self.unproven() {
            return Vec::new();
        }
        let mut held = self.held.borrow_mut();
        let late = held
            .values()
            .any(|&since| now.saturating_sub(since) >= PROOF_WITHIN_MS);
        if !late {
            return Vec::new();
        }
        self.on.set(false);
        warn!(
            "allow_on_headers_stop_iteration is set, but a request held at its headers got no body for {PROOF_WITHIN_MS}ms: Envoy's Wasm PluginConfig must set allow_on_headers_stop_iteration: true as well (Envoy 1.35 or later); headers go on from now, as without it"
        );
        held.drain().map(|(id, _)| id).collect()
    }
}
