//! The checks a worker planned lately, reused when a request gives
//! planning exactly the same inputs as the one a check was planned for.
//!
//! Planning a request (matching the rules, reading the client id,
//! building the subjects) is the costliest step of a request decided from
//! a lease: measured in Envoy, planning costs about 0.9 µs on a fast
//! machine, as much as the two RateLimit header hostcalls together, and a
//! check planned once also keeps what hits derive from it (its lease's
//! place, its `RateLimit-Policy` value). Real traffic interleaves many
//! clients, so the memo keeps a plan for each of [`SLOTS`] places, not
//! only the last: of the bench's Zipf mix of 1,000 clients, the last plan
//! alone served about 3% of requests, the memo serves 75%.
//!
//! Reuse is exact, not a guess from a key: [`decision::plan`] is a pure
//! function of the configuration (fixed for a worker), the method, the
//! path and what it reads from the request. While planning, a [`Recorder`]
//! notes every header it reads, with all of that header's values, in
//! order. A later request reuses the check only if its method and path are
//! the same and every one of those headers has the same values in it, so
//! planning it would read the same inputs and make the same check. A plan
//! that read anything else (the source address, a property such as a JWT
//! claim) is not kept: those are not in the header map to compare.
//!
//! Where a request looks is only a locator ([`locate`]: a hash of its
//! method, its path and its client-id headers' values); two requests that
//! land on one place simply take turns in it, each planning anew. A
//! request crafted to land on another client's place finds that client's
//! inputs there, which its own do not match.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use crate::check::Check;
use crate::config::Config;
use crate::decision::{self, Plan};
use crate::host::RequestView;

/// How many plans a worker keeps. Replayed through the memo, the bench's
/// Zipf mix of 1,000 clients finds its check kept for 62% of requests
/// with 256 places, 75% with 512 and 85% with 1,024; a check of one limit
/// and its inputs take a few hundred bytes, so 512 places hold about
/// 200 KiB of a worker's memory, and never much more than 1 MiB (see
/// [`MAX_KEPT_INPUTS`]).
pub(crate) const SLOTS: usize = 512;

/// The most a kept plan's inputs may take: a request's path and headers
/// can each be tens of kilobytes (Envoy's header limit), and the memo's
/// memory must stay bounded by its places, whatever clients send. A plan
/// read from more is planned anew each time.
pub(crate) const MAX_KEPT_INPUTS: usize = 2048;

/// A worker's memo of recent plans: a direct-mapped table of checks, each
/// with the inputs it was planned from.
#[derive(Default)]
pub(crate) struct PlanMemo {
    /// `SLOTS` places, made on the first plan kept.
    slots: Vec<Option<Entry>>,
    /// A buffer the next plan's inputs are noted in (the one its place
    /// held before, so that buffers keep their capacity).
    spare: Inputs,
    /// Plans served from the memo (tests).
    #[cfg(test)]
    reused: usize,
}

/// A kept plan.
struct Entry {
    /// What planning read (see [`Inputs`]).
    inputs: Inputs,
    /// The check planned from them; shared with the requests it serves.
    check: Rc<Check>,
}

/// What one plan read, encoded in one buffer: the method, the path, then
/// for each header read (in order) its name and all of its values, each
/// length-prefixed.
#[derive(Default, PartialEq, Eq)]
struct Inputs(Vec<u8>);

impl Inputs {
    fn start(&mut self, method: &str, path: &str) {
        self.0.clear();
        self.push(method.as_bytes());
        self.push(path.as_bytes());
    }

    fn push(&mut self, bytes: &[u8]) {
        self.0
            .extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        self.0.extend_from_slice(bytes);
    }

    fn push_read(&mut self, name: &str, values: &[Vec<u8>]) {
        self.push(name.as_bytes());
        self.0
            .extend_from_slice(&(values.len() as u32).to_le_bytes());
        for value in values {
            self.push(value);
        }
    }

    /// Whether planning `request` would read these inputs.
    fn match_request(&self, request: &impl RequestView, method: &str, path: &str) -> bool {
        let mut reader = Reader(&self.0);
        if reader.field() != Some(method.as_bytes()) || reader.field() != Some(path.as_bytes()) {
            return false;
        }
        while !reader.0.is_empty() {
            let (Some(name), Some(count)) = (reader.field(), reader.word()) else {
                return false;
            };
            let Ok(name) = std::str::from_utf8(name) else {
                return false;
            };
            let mut values = (0..count).map(|_| reader.field());
            if !request.has_values_in(name, &mut values) {
                return false;
            }
        }
        true
    }
}

/// Reads an [`Inputs`] buffer front to back.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn word(&mut self) -> Option<u32> {
        let (word, rest) = self.0.split_first_chunk::<4>()?;
        self.0 = rest;
        Some(u32::from_le_bytes(*word))
    }

    fn field(&mut self) -> Option<&'a [u8]> {
        let len = self.word()? as usize;
        let field = self.0.get(..len)?;
        self.0 = self.0.get(len..)?;
        Some(field)
    }
}

/// Where a request's plan is kept: FNV-1a over its method, its path (a
/// client id in the query is in it) and every value of the client-id
/// headers, each ended by a 0xff byte, mixed and reduced to a place. Only
/// a locator: reuse is decided by the inputs, so values that hash alike
/// (a 0xff inside one included) share a place, never a plan.
fn locate(config: &Config, request: &impl RequestView, method: &str, path: &str) -> usize {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut feed = |bytes: &[u8]| {
        for &b in bytes.iter().chain(&[0xff]) {
            hash = (hash ^ u64::from(b)).wrapping_mul(PRIME);
        }
    };
    feed(method.as_bytes());
    feed(path.as_bytes());
    for name in &config.client_id.headers {
        request.each_value(name, &mut feed);
    }
    // FNV leaves the last bytes in few bits (client ids often differ in
    // their last): a finalizer (splitmix64's) spreads them over all.
    hash = (hash ^ (hash >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    hash = (hash ^ (hash >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (hash ^ (hash >> 31)) as usize % SLOTS
}

impl PlanMemo {
    /// The plan for this request: a kept check when the request gives
    /// planning the same inputs, else a new plan.
    pub(crate) fn plan(
        &mut self,
        config: &Config,
        request: &impl RequestView,
        method: &str,
        path: &str,
    ) -> Plan {
        let place = locate(config, request, method, path);
        if let Some(Some(entry)) = self.slots.get(place) {
            if entry.inputs.match_request(request, method, path) {
                #[cfg(test)]
                {
                    self.reused += 1;
                }
                return Plan::Check(Rc::clone(&entry.check));
            }
        }
        self.plan_afresh(config, request, method, path, place)
    }

    /// Plans the request, and keeps its check at `place` (in place of the
    /// one there) unless planning read more than headers. Out of line: a
    /// busy client's requests reuse the check, and their code stays short.
    #[inline(never)]
    fn plan_afresh(
        &mut self,
        config: &Config,
        request: &impl RequestView,
        method: &str,
        path: &str,
        place: usize,
    ) -> Plan {
        let mut inputs = std::mem::take(&mut self.spare);
        inputs.start(method, path);
        let recorder = Recorder {
            inner: request,
            inputs: RefCell::new(inputs),
            opaque: Cell::new(false),
        };
        let plan = decision::plan(config, &recorder, method, path);
        let opaque = recorder.opaque.get();
        let inputs = recorder.inputs.into_inner();
        let kept = match &plan {
            Plan::Check(check) if !opaque && inputs.0.len() <= MAX_KEPT_INPUTS => check,
            _ => {
                // Not kept; nor is a buffer grown past the bound.
                if inputs.0.capacity() <= MAX_KEPT_INPUTS {
                    self.spare = inputs;
                }
                return plan;
            }
        };
        if self.slots.is_empty() {
            self.slots.resize_with(SLOTS, || None);
        }
        let entry = Entry {
            inputs,
            check: Rc::clone(kept),
        };
        match self.slots.get_mut(place) {
            Some(slot) => {
                if let Some(old) = slot.replace(entry) {
                    self.spare = old.inputs;
                }
            }
            None => self.spare = entry.inputs,
        }
        plan
    }
}

/// A view of the request that notes what planning reads.
struct Recorder<'r, R> {
    inner: &'r R,
    inputs: RefCell<Inputs>,
    /// Planning read something that is not a header.
    opaque: Cell<bool>,
}

impl<R: RequestView> RequestView for Recorder<'_, R> {
    fn header_values(&self, name: &str) -> Vec<Vec<u8>> {
        let values = self.inner.header_values(name);
        self.inputs.borrow_mut().push_read(name, &values);
        values
    }

    fn source_address(&self) -> Option<String> {
        self.opaque.set(true);
        self.inner.source_address()
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        self.opaque.set(true);
        self.inner.property(path)
    }

    // `header` is the trait's own, over `header_values`: recorded too.
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::fake::{FakeHost, FakeRequest};
    use crate::host::Request;
    use proptest::prelude::*;

    /// Rules that read several headers: the client id, a header condition,
    /// a limit counted by a header, and the path.
    fn config() -> Config {
        crate::config::parse(
            br#"{"client_id": {"headers": ["x-api-key", "x-user"]},
                 "rules": [
                   {"name": "api", "match": {"path_prefix": "/api/"},
                    "limits": [{"name": "m", "requests": 20, "window": "60s"}]},
                   {"name": "plan", "match": {"headers": [{"name": "x-plan", "exact": "gold"}]},
                    "limits": [{"name": "g", "requests": 5, "window": "1s", "by": ["header:x-tenant"]}]}
                 ]}"#,
        )
        .unwrap()
    }

    fn request(host: &FakeHost, headers: &[(&str, &str)]) {
        let mut req = FakeRequest::default();
        for (name, value) in headers {
            req = req.with_header(name, value.as_bytes());
        }
        *host.request.borrow_mut() = req;
    }

    fn planned(memo: &mut PlanMemo, cfg: &Config, host: &FakeHost) -> (Plan, Plan) {
        let request = Request::read(host);
        let (method, path) = (request.text(":method"), request.text(":path"));
        let fresh = decision::plan(cfg, &request, &method, &path);
        (memo.plan(cfg, &request, &method, &path), fresh)
    }

    /// Any header planning reads, changed, repeated or dropped, makes the
    /// memo plan again: a request never gets another client's check.
    #[test]
    fn a_request_reuses_the_check_only_when_planning_would_read_the_same() {
        let cfg = config();
        let host = FakeHost::default();
        let mut memo = PlanMemo::default();
        let base = [
            (":method", "GET"),
            (":path", "/api/items"),
            ("x-api-key", "alice"),
            ("x-plan", "gold"),
            ("x-tenant", "t1"),
        ];
        request(&host, &base);
        let (first, fresh) = planned(&mut memo, &cfg, &host);
        assert_eq!(first, fresh);
        assert_eq!(memo.reused, 0);
        let (again, fresh) = planned(&mut memo, &cfg, &host);
        assert_eq!(again, fresh);
        assert_eq!(memo.reused, 1, "a check planned from headers is kept");
        let variants: &[&[(&str, &str)]] = &[
            &[("x-api-key", "mallory")],
            &[("x-api-key", "alice"), ("x-api-key", "mallory")],
            &[("x-tenant", "t2")],
            &[("x-plan", "silver")],
            &[(":path", "/api/other")],
            &[(":method", "POST")],
            &[("x-user", "bob")],
        ];
        for change in variants {
            let mut headers: Vec<(&str, &str)> = base
                .iter()
                .filter(|(n, _)| change.iter().all(|(c, _)| c != n))
                .copied()
                .collect();
            headers.extend_from_slice(change);
            request(&host, &headers);
            let reused = memo.reused;
            let (memoised, fresh) = planned(&mut memo, &cfg, &host);
            assert_eq!(memoised, fresh, "{change:?}");
            // `x-user` is not read (the client id is the first of its
            // headers present), but it is in the locator: planned anew.
            assert_eq!(memo.reused, reused, "{change:?} planned anew");
            request(&host, &base);
            let (memoised, fresh) = planned(&mut memo, &cfg, &host);
            assert_eq!(memoised, fresh, "back to the base after {change:?}");
        }
        // A header planning never reads does not matter.
        let reused = memo.reused;
        let mut headers = base.to_vec();
        headers.push(("x-request-id", "7"));
        request(&host, &headers);
        let (memoised, fresh) = planned(&mut memo, &cfg, &host);
        assert_eq!(memoised, fresh);
        assert_eq!(memo.reused, reused + 1);
    }

    /// Clients taking turns each reuse their own check, but for those
    /// whose requests land on a place another one's also do (they plan
    /// anew, in turn).
    #[test]
    fn clients_taking_turns_each_reuse_their_own_plan() {
        let cfg = config();
        let host = FakeHost::default();
        let mut memo = PlanMemo::default();
        let clients: Vec<String> = (0..100).map(|i| format!("client-{i}")).collect();
        let mut places = std::collections::HashMap::new();
        for client in &clients {
            request(&host, &[(":path", "/api/items"), ("x-api-key", client)]);
            let request = Request::read(&host);
            let place = locate(&cfg, &request, "", "/api/items");
            *places.entry(place).or_insert(0) += 1;
        }
        let alone = places.values().filter(|&&n| n == 1).count();
        assert!(
            alone > 60,
            "the locator spreads clients: {alone} of 100 alone"
        );
        for _ in 0..3 {
            for client in &clients {
                request(&host, &[(":path", "/api/items"), ("x-api-key", client)]);
                let (memoised, fresh) = planned(&mut memo, &cfg, &host);
                assert_eq!(memoised, fresh, "{client}");
            }
        }
        assert_eq!(memo.reused, 2 * alone);
    }

    /// A plan that read the source address (no `x-api-key`: the client
    /// is its address) is not kept: it is not in the header map to compare.
    #[test]
    fn a_plan_that_read_more_than_headers_is_not_kept() {
        let cfg = crate::config::parse(
            br#"{"client_id": {"headers": ["x-api-key"]},
                 "rules": [{"name": "api", "match": {},
                            "limits": [{"name": "m", "requests": 20, "window": "60s"}]}]}"#,
        )
        .unwrap();
        let host = FakeHost::default();
        *host.request.borrow_mut() = FakeRequest::default()
            .with_header(":path", b"/")
            .from_source("10.0.0.1:5000");
        let mut memo = PlanMemo::default();
        let (memoised, fresh) = planned(&mut memo, &cfg, &host);
        assert!(matches!(memoised, Plan::Check(_)), "{memoised:?}");
        assert_eq!(memoised, fresh);
        let (memoised, fresh) = planned(&mut memo, &cfg, &host);
        assert_eq!(memoised, fresh);
        assert!(memo.slots.iter().all(Option::is_none));
        assert_eq!(memo.reused, 0);
    }

    /// A plan read from inputs past [`MAX_KEPT_INPUTS`] (a long id, a
    /// long path) is not kept: the memo's memory is bounded by its places
    /// whatever clients send.
    #[test]
    fn a_plan_from_oversized_inputs_is_not_kept() {
        let cfg = config();
        let host = FakeHost::default();
        let mut memo = PlanMemo::default();
        let long_id = "k".repeat(MAX_KEPT_INPUTS);
        let long_path = format!("/api/{}", "p".repeat(MAX_KEPT_INPUTS));
        for (path, id) in [
            ("/api/items", long_id.as_str()),
            (long_path.as_str(), "alice"),
        ] {
            for _ in 0..2 {
                request(&host, &[(":path", path), ("x-api-key", id)]);
                let (memoised, fresh) = planned(&mut memo, &cfg, &host);
                assert!(matches!(memoised, Plan::Check(_)), "{memoised:?}");
                assert_eq!(memoised, fresh);
            }
        }
        assert_eq!(memo.reused, 0);
        assert!(memo.slots.iter().all(Option::is_none));
        assert!(memo.spare.0.capacity() <= MAX_KEPT_INPUTS);
        // Within the bound, kept as any other.
        request(&host, &[(":path", "/api/items"), ("x-api-key", "alice")]);
        for _ in 0..2 {
            let (memoised, fresh) = planned(&mut memo, &cfg, &host);
            assert_eq!(memoised, fresh);
        }
        assert_eq!(memo.reused, 1);
    }

    proptest! {
        /// Whatever the sequence of requests, the memo's plan is the plan.
        #[test]
        fn the_memo_always_plans_what_planning_would(
            requests in prop::collection::vec(
                prop::collection::vec((0usize..6, 0usize..3), 0..7), 1..12)
        ) {
            let names = [":path", ":method", "x-api-key", "x-plan", "x-tenant", "x-user"];
            let values = [["/api/a", "/api/b", "/x"], ["GET", "POST", "GET"],
                          ["alice", "bob", ""], ["gold", "silver", "gold"],
                          ["t1", "t2", "t1"], ["u1", "u2", "u1"]];
            let cfg = config();
            let host = FakeHost::default();
            let mut memo = PlanMemo::default();
            for headers in requests {
                let pairs: Vec<(&str, &str)> = headers
                    .iter()
                    .map(|&(n, v)| (names[n], values[n][v]))
                    .collect();
                request(&host, &pairs);
                let (memoised, fresh) = planned(&mut memo, &cfg, &host);
                prop_assert_eq!(memoised, fresh);
            }
        }
    }
}
