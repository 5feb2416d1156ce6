//! In-memory doubles of the host traits, for unit tests: a request, shared
//! data, and [`FakeHost`], which runs the whole flow and records what it
//! did (calls sent, streams resumed or answered, stats, headers). Compiled
//! only under `#[cfg(test)]`.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;

use super::*;

#[derive(Default, Clone)]
pub struct FakeRequest {
    pub headers: Vec<(String, Vec<u8>)>,
    pub source: Option<String>,
    pub properties: Vec<(Vec<String>, Vec<u8>)>,
}

impl FakeRequest {
    pub fn with_property(mut self, path: &[&str], value: &[u8]) -> Self {
        let path = path.iter().map(|p| p.to_string()).collect();
        self.properties.push((path, value.to_vec()));
        self
    }
    pub fn with_header(mut self, name: &str, value: &[u8]) -> Self {
        self.headers.push((name.to_string(), value.to_vec()));
        self
    }
    pub fn from_source(mut self, addr: &str) -> Self {
        self.source = Some(addr.to_string());
        self
    }
}

impl RequestView for FakeRequest {
    fn header_values(&self, name: &str) -> Vec<Vec<u8>> {
        values_of(&self.headers, name)
    }
    fn source_address(&self) -> Option<String> {
        self.source.clone()
    }
    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        self.properties
            .iter()
            .find(|(p, _)| p.iter().map(String::as_str).eq(path.iter().copied()))
            .map(|(_, v)| v.clone())
            .filter(|v| !v.is_empty())
    }
}

/// Shared data with CAS tokens, plus a switch to inject CAS conflicts.
#[derive(Default)]
pub struct FakeStore {
    pub data: RefCell<HashMap<String, (Vec<u8>, u32)>>,
    pub conflicts_left: RefCell<u32>,
    pub broken: Cell<bool>,
}

impl SharedStore for FakeStore {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError> {
        if self.broken.get() {
            return Err(StoreError::Failed);
        }
        Ok(match self.data.borrow().get(key) {
            Some((v, cas)) => (Some(v.clone()), Some(*cas)),
            None => (None, None),
        })
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        if self.broken.get() {
            return Err(StoreError::Failed);
        }
        let mut left = self.conflicts_left.borrow_mut();
        if *left > 0 {
            *left -= 1;
            return Err(StoreError::CasMismatch);
        }
        let current = self.data.borrow().get(key).map(|(_, c)| *c);
        // Envoy's rule: a token must match an existing entry's. `None` is
        // the token no entry holds (the key was read missing: see
        // `WasmHost`'s `set`).
        match (cas, current) {
            (Some(c), Some(cur)) if c != cur => Err(StoreError::CasMismatch),
            (None, Some(_)) => Err(StoreError::CasMismatch),
            _ => {
                self.write(key, value, current);
                Ok(())
            }
        }
    }

    fn overwrite(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        if self.broken.get() {
            return Err(StoreError::Failed);
        }
        let current = self.data.borrow().get(key).map(|(_, c)| *c);
        self.write(key, value, current);
        Ok(())
    }
}

impl FakeStore {
    fn write(&self, key: &str, value: &[u8], current: Option<u32>) {
        let next = current.unwrap_or(0) + 1;
        self.data
            .borrow_mut()
            .insert(key.to_string(), (value.to_vec(), next));
    }
}

/// A call the flow sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SentCall {
    pub token: u32,
    /// The effective context it was sent from: the context Envoy makes
    /// own the call (the root's calls are never cancelled with a stream).
    pub from: u32,
    /// The context whose callback was running when it was sent: the SDK
    /// registers the call under it and hands the answer to that context
    /// alone, whatever `set_effective_context` said; once that context
    /// has ended, the answer is dropped (see [`FakeHost::answer_goes_to`]).
    pub answer_to: u32,
    pub cluster: String,
    pub path: String,
    pub body: Vec<u8>,
    pub timeout_ms: u64,
    /// When it was sent (the host's clock): Envoy gives up on it at
    /// `sent_ms + timeout_ms`, and no answer comes after that.
    pub sent_ms: u64,
    pub authorization: Option<String>,
    /// The trace headers it carried.
    pub trace_headers: Vec<(String, String)>,
}

/// A call's response as the host holds it: `:status` and body.
#[derive(Debug, Clone, Default)]
pub struct CallResponse {
    pub status: Option<Vec<u8>>,
    pub body: Option<Vec<u8>>,
}

/// What the flow did to one stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Acted {
    Resumed(u32),
    /// A paused response went on.
    ResumedResponse(u32),
    Replied(u32, DenyResponse),
}

/// The host, in memory. The current request is `request`; the response of
/// the call being answered is `response`; `context` is the effective
/// context and `callback` the context whose callback runs (set both with
/// [`FakeHost::enter`]). Every trait method is one hostcall, recorded by
/// name in `hostcalls`.
///
/// Calls are routed as proxy-wasm's Rust SDK (0.2.5) routes them: its
/// dispatcher files each call under the context whose callback made it
/// (`register_callout` with its `active_id`) and gives the answer to that
/// context only (`on_http_call_response`), dropping it when that context
/// was deleted. `set_effective_context` changes which context Envoy makes
/// own the call, not where the SDK sends the answer.
pub struct FakeHost {
    pub request: RefCell<FakeRequest>,
    pub store: FakeStore,
    pub now: Cell<u64>,
    /// The effective context (what `set_effective_context` last made
    /// current, or the context whose callback began).
    pub context: Cell<u32>,
    /// The context whose callback is running: the SDK's `active_id`.
    pub callback: Cell<u32>,
    /// Streams that have ended: acting for them fails, as in Envoy.
    pub gone: RefCell<Vec<u32>>,
    pub sent: RefCell<Vec<SentCall>>,
    /// When set, dispatching fails (no such cluster, no healthy host).
    pub dispatch_fails: Cell<bool>,
    /// When set, the wake-up queue cannot be registered or written.
    pub queue_fails: Cell<bool>,
    /// When set, the host refuses to define stats.
    pub metrics_refused: Cell<bool>,
    /// When set, local replies cannot be sent.
    pub reply_fails: Cell<bool>,
    /// Local replies sent as gRPC.
    pub grpc_replies: Cell<u32>,
    pub wakes: Cell<u32>,
    /// The tick period the flow asked for.
    pub tick_ms: Cell<Option<u32>>,
    /// The root whose `on_done` said it had work left: Envoy waits for its
    /// `proxy_done` (and refuses one from any other context, or a second).
    pub awaiting_done: Cell<Option<u32>>,
    /// Roots that called `proxy_done` when Envoy was waiting for them.
    pub done: RefCell<Vec<u32>>,
    /// The response of the call being answered.
    pub response: RefCell<CallResponse>,
    pub acted: RefCell<Vec<Acted>>,
    pub response_headers: RefCell<Vec<(u32, String, String)>>,
    /// The upstream's response headers, as the current stream sees them.
    pub upstream_headers: RefCell<Vec<(String, Vec<u8>)>>,
    /// The request body Envoy holds for the current stream.
    pub request_body: RefCell<Vec<u8>>,
    /// The response body Envoy holds for the current stream (the chunk,
    /// or what is buffered).
    pub response_body: RefCell<Vec<u8>>,
    /// Stats by name and kind, as Envoy's stats scope holds them: every
    /// worker's VM that defines one gets an id of its own for the same
    /// stat (`metric_ids`: id to stat).
    metrics: RefCell<Vec<(String, MetricKind, u64)>>,
    metric_ids: RefCell<Vec<usize>>,
    next_token: Cell<u32>,
    /// Seeds handed out (see `random_seed`).
    seeds: Cell<u64>,
    /// Every hostcall made, by name, in order.
    pub hostcalls: RefCell<Vec<&'static str>>,
}

impl Default for FakeHost {
    fn default() -> Self {
        FakeHost {
            request: RefCell::default(),
            store: FakeStore::default(),
            now: Cell::new(1_000_000),
            context: Cell::new(0),
            callback: Cell::new(0),
            gone: RefCell::default(),
            sent: RefCell::default(),
            dispatch_fails: Cell::new(false),
            queue_fails: Cell::new(false),
            metrics_refused: Cell::new(false),
            reply_fails: Cell::new(false),
            grpc_replies: Cell::new(0),
            wakes: Cell::new(0),
            tick_ms: Cell::new(None),
            awaiting_done: Cell::new(None),
            done: RefCell::default(),
            response: RefCell::default(),
            acted: RefCell::default(),
            response_headers: RefCell::default(),
            upstream_headers: RefCell::default(),
            request_body: RefCell::default(),
            response_body: RefCell::default(),
            metrics: RefCell::default(),
            metric_ids: RefCell::default(),
            next_token: Cell::new(1),
            seeds: Cell::new(0),
            hostcalls: RefCell::default(),
        }
    }
}

impl FakeHost {
    /// A callback of context `context_id` begins: the SDK makes it the
    /// active context, and Envoy the effective one.
    pub fn enter(&self, context_id: u32) {
        self.callback.set(context_id);
        self.context.set(context_id);
    }

    /// Context `context_id` is deleted (a stream that ended): acting for
    /// it fails, and the answers of calls filed under it are dropped.
    pub fn end(&self, context_id: u32) {
        self.gone.borrow_mut().push(context_id);
    }

    /// The context the SDK hands call `token`'s answer to, or `None` when
    /// it drops it (that context was deleted). Panics on a token never
    /// dispatched, as the SDK does (`expect("invalid token_id")`).
    pub fn answer_goes_to(&self, token: u32) -> Option<u32> {
        let to = self
            .sent
            .borrow()
            .iter()
            .find(|c| c.token == token)
            .map(|c| c.answer_to)
            .unwrap_or_else(|| panic!("call {token} was never dispatched"));
        (!self.gone.borrow().contains(&to)).then_some(to)
    }

    fn hostcall(&self, name: &'static str) {
        self.hostcalls.borrow_mut().push(name);
    }

    /// The hostcalls made since the last call of this method.
    pub fn take_hostcalls(&self) -> Vec<&'static str> {
        std::mem::take(&mut *self.hostcalls.borrow_mut())
    }

    /// Whether a stat of that name was defined.
    pub fn has_stat(&self, name: &str) -> bool {
        self.metrics.borrow().iter().any(|(n, _, _)| n == name)
    }

    /// A stat's value by name (0 when never touched or not defined).
    pub fn stat(&self, name: &str) -> u64 {
        self.metrics
            .borrow()
            .iter()
            .find(|(n, _, _)| n == name)
            .map_or(0, |(_, _, v)| *v)
    }

    /// Sets the response the next answered call carries.
    pub fn respond(&self, status: Option<u32>, body: &str) {
        *self.response.borrow_mut() = CallResponse {
            status: status.map(|s| s.to_string().into_bytes()),
            body: Some(body.as_bytes().to_vec()),
        };
    }

    /// The stat behind metric id `id`.
    fn metric_of(&self, id: u32) -> Option<usize> {
        self.metric_ids.borrow().get(id as usize).copied()
    }

    /// What the flow did to streams, taken (so each test step sees its own).
    pub fn take_acted(&self) -> Vec<Acted> {
        std::mem::take(&mut *self.acted.borrow_mut())
    }
}

impl SharedStore for FakeHost {
    fn get(&self, key: &str) -> Result<(Option<Vec<u8>>, Option<u32>), StoreError> {
        self.hostcall("get_shared_data");
        self.store.get(key)
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        self.hostcall("set_shared_data");
        self.store.set(key, value, cas)
    }
    fn overwrite(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.hostcall("set_shared_data");
        self.store.overwrite(key, value)
    }
}

impl Host for FakeHost {
    fn request_headers(&self) -> HeaderMap {
        self.hostcall("get_header_map_pairs");
        let request = self.request.borrow();
        let pairs: Vec<(&str, &[u8])> = request
            .headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_slice()))
            .collect();
        HeaderMap::from_pairs(&pairs)
    }

    fn source_address(&self) -> Option<String> {
        self.hostcall("get_property");
        self.request.borrow().source_address()
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        self.hostcall("get_property");
        self.request.borrow().property(path)
    }

    fn now_ms(&self) -> u64 {
        self.hostcall("get_current_time");
        self.now.get()
    }

    fn random_seed(&self) -> (u64, u64) {
        // Fresh on every call, as WASI's random_get makes it (each worker
        // seeds its ids from it), but the same sequence in every test run.
        let n = self.seeds.get().wrapping_add(1);
        self.seeds.set(n);
        (splitmix64(2 * n), splitmix64(2 * n + 1))
    }

    fn define_metric(&self, kind: MetricKind, name: &str) -> Option<u32> {
        self.hostcall("define_metric");
        if self.metrics_refused.get() {
            return None;
        }
        let mut metrics = self.metrics.borrow_mut();
        let stat = match metrics.iter().position(|(n, k, _)| n == name && *k == kind) {
            Some(stat) => stat,
            None => {
                metrics.push((name.to_string(), kind, 0));
                metrics.len() - 1
            }
        };
        let mut ids = self.metric_ids.borrow_mut();
        ids.push(stat);
        u32::try_from(ids.len() - 1).ok()
    }

    fn increment_metric(&self, id: u32, delta: u64) {
        self.hostcall("increment_metric");
        let stat = self.metric_of(id).unwrap_or(usize::MAX);
        if let Some(m) = self.metrics.borrow_mut().get_mut(stat) {
            assert_eq!(m.1, MetricKind::Counter, "{} is not a counter", m.0);
            m.2 += delta;
        }
    }

    fn record_metric(&self, id: u32, value: u64) {
        self.hostcall("record_metric");
        let stat = self.metric_of(id).unwrap_or(usize::MAX);
        if let Some(m) = self.metrics.borrow_mut().get_mut(stat) {
            assert_eq!(m.1, MetricKind::Gauge, "{} is not a gauge", m.0);
            m.2 = value;
        }
    }

    fn set_tick_period(&self, ms: u32) -> bool {
        self.hostcall("set_tick_period");
        self.tick_ms.set(Some(ms));
        true
    }

    fn done(&self) -> bool {
        self.hostcall("done");
        if self.awaiting_done.get() != Some(self.context.get()) {
            return false;
        }
        self.awaiting_done.set(None);
        self.done.borrow_mut().push(self.context.get());
        true
    }

    fn register_queue(&self, _name: &str) -> Option<u32> {
        self.hostcall("register_shared_queue");
        (!self.queue_fails.get()).then_some(7)
    }

    fn enqueue(&self, _queue: u32) -> bool {
        self.hostcall("enqueue_shared_queue");
        if self.queue_fails.get() {
            return false;
        }
        self.wakes.set(self.wakes.get() + 1);
        true
    }

    fn dispatch(&self, call: &Call<'_>) -> Result<u32, String> {
        self.hostcall("dispatch_http_call");
        if self.dispatch_fails.get() {
            return Err("BadArgument".into());
        }
        let token = self.next_token.get();
        self.next_token.set(token + 1);
        self.sent.borrow_mut().push(SentCall {
            token,
            from: self.context.get(),
            answer_to: self.callback.get(),
            cluster: call.cluster.to_string(),
            path: call.path.to_string(),
            body: call.body.to_vec(),
            timeout_ms: call.timeout_ms,
            sent_ms: self.now.get(),
            authorization: call.authorization.map(String::from),
            trace_headers: call
                .trace
                .iter()
                .flat_map(|t| t.headers())
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
        });
        Ok(token)
    }

    fn call_response_header(&self, name: &str) -> Option<Vec<u8>> {
        self.hostcall("get_call_response_header");
        assert_eq!(name, ":status");
        self.response.borrow().status.clone()
    }

    fn call_response_body(&self, max: usize) -> Option<Vec<u8>> {
        self.hostcall("get_call_response_body");
        let body = self.response.borrow().body.clone()?;
        Some(body.into_iter().take(max).collect())
    }

    fn set_effective_context(&self, context_id: u32) -> bool {
        self.hostcall("set_effective_context");
        if self.gone.borrow().contains(&context_id) {
            return false;
        }
        self.context.set(context_id);
        true
    }

    fn resume_request(&self) -> bool {
        self.hostcall("resume_http_request");
        self.acted
            .borrow_mut()
            .push(Acted::Resumed(self.context.get()));
        true
    }

    fn send_reply(&self, reply: &DenyResponse) -> bool {
        self.hostcall("send_http_response");
        if self.reply_fails.get() {
            return false;
        }
        self.acted
            .borrow_mut()
            .push(Acted::Replied(self.context.get(), reply.clone()));
        true
    }

    fn send_grpc_reply(&self, reply: &DenyResponse) -> bool {
        self.hostcall("send_grpc_response");
        self.grpc_replies.set(self.grpc_replies.get() + 1);
        self.send_reply(reply)
    }

    fn add_response_header(&self, name: &str, value: &str) {
        self.hostcall("add_header");
        self.response_headers.borrow_mut().push((
            self.context.get(),
            name.to_string(),
            value.to_string(),
        ));
    }

    fn response_header(&self, name: &str) -> Option<Vec<u8>> {
        self.hostcall("get_header_map_value");
        values_of(&self.upstream_headers.borrow(), name).pop()
    }

    fn request_body(&self, size: usize) -> Option<Vec<u8>> {
        self.hostcall("get_buffer_bytes");
        Some(
            self.request_body
                .borrow()
                .iter()
                .take(size)
                .copied()
                .collect(),
        )
    }

    fn response_body(&self, size: usize) -> Option<Vec<u8>> {
        self.hostcall("get_buffer_bytes");
        Some(
            self.response_body
                .borrow()
                .iter()
                .take(size)
                .copied()
                .collect(),
        )
    }

    fn remove_request_header(&self, name: &str) -> bool {
        self.hostcall("remove_header_map_value");
        self.request
            .borrow_mut()
            .headers
            .retain(|(k, _)| !k.eq_ignore_ascii_case(name));
        true
    }

    fn remove_response_header(&self, name: &str) -> bool {
        self.hostcall("remove_header_map_value");
        self.upstream_headers
            .borrow_mut()
            .retain(|(k, _)| !k.eq_ignore_ascii_case(name));
        true
    }

    fn replace_request_body(&self, size: usize, bytes: &[u8]) -> bool {
        self.hostcall("set_buffer_bytes");
        let mut body = self.request_body.borrow_mut();
        let size = size.min(body.len());
        body.splice(..size, bytes.iter().copied());
        true
    }

    fn replace_response_body(&self, size: usize, bytes: &[u8]) -> bool {
        self.hostcall("set_buffer_bytes");
        let mut body = self.response_body.borrow_mut();
        let size = size.min(body.len());
        body.splice(..size, bytes.iter().copied());
        true
    }

    fn append_response_body(&self, bytes: &[u8]) -> bool {
        self.hostcall("set_buffer_bytes");
        self.response_body.borrow_mut().extend_from_slice(bytes);
        true
    }

    fn resume_response(&self) -> bool {
        self.hostcall("resume_http_response");
        self.acted
            .borrow_mut()
            .push(Acted::ResumedResponse(self.context.get()));
        true
    }
}

/// SplitMix64's output function: distinct, well-spread values from a
/// counter.
fn splitmix64(n: u64) -> u64 {
    let mut z = n.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
