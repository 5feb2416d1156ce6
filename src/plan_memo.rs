//! The last check a worker planned, reused when the next request gives
//! planning exactly the same inputs.
//!
//! A busy client sends the same request again and again, and planning it
//! (matching the rules, reading the client id, building the subjects) is
//! the costliest step of a request decided from a lease: measured in
//! Envoy, a second plan of the same request costs about 0.9 µs, as much
//! as the two RateLimit header hostcalls together.
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

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use crate::check::Check;
use crate::config::Config;
use crate::decision::{self, Plan};
use crate::host::RequestView;

/// A worker's memo of the last plan (one entry: a busy client's requests
/// follow each other). A check is kept only once two plans in a row read
/// the same inputs, so that a mix of many clients, whose consecutive
/// requests rarely match, pays for noting the inputs (into buffers that
/// keep their capacity) and never for copying checks it will not reuse.
#[derive(Default)]
pub(crate) struct PlanMemo {
    /// The inputs of the last plan (see [`Inputs`]); empty when it read
    /// something that is not a header.
    inputs: Inputs,
    /// The next plan's inputs are noted here, then swapped in.
    spare: Inputs,
    /// The check planned from `inputs`, once planned from them twice;
    /// shared with the requests it serves.
    check: Option<Rc<Check>>,
    /// Plans served from the memo (tests).
    #[cfg(test)]
    reused: usize,
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

impl PlanMemo {
    /// The plan for this request: the memo's check when the request gives
    /// planning the same inputs, else a new plan.
    pub(crate) fn plan(
        &mut self,
        config: &Config,
        request: &impl RequestView,
        method: &str,
        path: &str,
    ) -> Plan {
        if let Some(check) = &self.check {
            if self.inputs.match_request(request, method, path) {
                #[cfg(test)]
                {
                    self.reused += 1;
                }
                return Plan::Check(Rc::clone(check));
            }
        }
        self.plan_afresh(config, request, method, path)
    }

    /// Plans the request, and keeps its check when planning read the same
    /// inputs as the last time. Out of line: a busy client's requests
    /// reuse the check, and their code stays short.
    #[inline(never)]
    fn plan_afresh(
        &mut self,
        config: &Config,
        request: &impl RequestView,
        method: &str,
        path: &str,
    ) -> Plan {
        let mut inputs = std::mem::take(&mut self.spare);
        inputs.start(method, path);
        let recorder = Recorder {
            inner: request,
            inputs: RefCell::new(inputs),
            opaque: Cell::new(false),
        };
        let plan = decision::plan(config, &recorder, method, path);
        let mut inputs = recorder.inputs.into_inner();
        if recorder.opaque.get() {
            inputs.0.clear();
        }
        self.check = match &plan {
            Plan::Check(check) if !inputs.0.is_empty() && inputs == self.inputs => {
                Some(Rc::clone(check))
            }
            _ => None,
        };
        self.spare = std::mem::replace(&mut self.inputs, inputs);
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
        assert!(
            memo.check.is_none(),
            "kept once planned twice from the same inputs"
        );
        let (again, fresh) = planned(&mut memo, &cfg, &host);
        assert_eq!(again, fresh);
        assert!(memo.check.is_some(), "a check planned from headers is kept");
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
            let (memoised, fresh) = planned(&mut memo, &cfg, &host);
            assert_eq!(memoised, fresh, "{change:?}");
            request(&host, &base);
            let (memoised, fresh) = planned(&mut memo, &cfg, &host);
            assert_eq!(memoised, fresh, "back to the base after {change:?}");
        }
        // Every change planned anew, and so did the base after it: two
        // plans in a row from different inputs keep no check. Only
        // `x-user` left the inputs as they were (the client id is the first
        // of its headers that is present, so planning never read it): that
        // plan kept the check, and the base after it reused it. A header
        // planning never reads does not matter either.
        assert_eq!(memo.reused, 1);
        let mut headers = base.to_vec();
        headers.push(("x-request-id", "7"));
        request(&host, &headers);
        let (memoised, fresh) = planned(&mut memo, &cfg, &host);
        assert_eq!(memoised, fresh);
        assert_eq!(memo.reused, 2);
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
        assert!(memo.check.is_none());
        assert_eq!(memo.reused, 0);
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
