//! A request's trace context, carried onto the check call made for it, so
//! that meshlimitd's span for the decision is a child of the request's
//! span (see `meshlimit_protocol::trace`).
//!
//! The filter makes no span of its own (a wasm filter has no tracer):
//! what it forwards is the context the request arrived with, W3C
//! `traceparent` (and its `tracestate`) or B3, in whichever form came.
//! Only values that parse are forwarded: these are client headers, copied
//! onto a call to meshlimitd, and nothing but a well-formed context may
//! ride along.

use meshlimit_protocol::trace::TraceParent;

use crate::host::HeaderMap;

/// Longest `tracestate` forwarded (W3C allows 32 members of at most 256
/// characters, and lets a proxy drop what it cannot carry).
const MAX_TRACESTATE: usize = 512;

/// The trace headers of one request that parse, to forward as they came,
/// and the context they name, for the check itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    headers: Vec<(&'static str, String)>,
    parent: TraceParent,
}

/// The B3 headers, multi-header form, forwarded together or not at all.
const B3_MULTI: [&str; 5] = [
    "x-b3-traceid",
    "x-b3-spanid",
    "x-b3-parentspanid",
    "x-b3-sampled",
    "x-b3-flags",
];

impl TraceContext {
    /// The context in a request's headers, if any parses. W3C wins when
    /// both came (it is what the check carries); both are forwarded.
    pub fn read(headers: &HeaderMap) -> Option<TraceContext> {
        let mut found = Found::default();
        // One walk; a name is compared only when its length and first byte
        // could make it a trace header (most requests carry none).
        for (name, value) in headers.iter() {
            let slot = match (name.len(), name.first()) {
                (11, Some(b't')) if name == b"traceparent" => &mut found.traceparent,
                (10, Some(b't')) if name == b"tracestate" => &mut found.tracestate,
                (2, Some(b'b')) if name == b"b3" => &mut found.b3,
                (10..=17, Some(b'x')) if name.starts_with(b"x-b3-") => {
                    match B3_MULTI.iter().position(|n| n.as_bytes() == name) {
                        Some(i) => match found.b3_multi.get_mut(i) {
                            Some(slot) => slot,
                            None => continue,
                        },
                        None => continue,
                    }
                }
                _ => continue,
            };
            // A repeated trace header is ambiguous: ignore the header.
            *slot = match slot {
                Seen::No => {
                    std::str::from_utf8(value).map_or(Seen::Bad, |v| Seen::Once(v.to_owned()))
                }
                _ => Seen::Bad,
            };
        }
        found.into_context()
    }

    /// The headers to put on the call, as they came.
    pub fn headers(&self) -> impl Iterator<Item = (&str, &str)> + '_ {
        self.headers.iter().map(|(n, v)| (*n, v.as_str()))
    }

    /// The context as a `traceparent` value, for the check on the wire.
    pub fn traceparent(&self) -> String {
        self.parent.to_header()
    }
}

#[derive(Default)]
enum Seen {
    #[default]
    No,
    Once(String),
    /// Repeated, or not text.
    Bad,
}

impl Seen {
    fn value(&self) -> Option<&str> {
        match self {
            Seen::Once(v) => Some(v),
            _ => None,
        }
    }
}

#[derive(Default)]
struct Found {
    traceparent: Seen,
    tracestate: Seen,
    b3: Seen,
    b3_multi: [Seen; 5],
}

impl Found {
    fn into_context(self) -> Option<TraceContext> {
        let mut headers = Vec::new();
        let w3c = self.traceparent.value().and_then(TraceParent::parse);
        if let (Some(_), Seen::Once(value)) = (w3c, &self.traceparent) {
            headers.push(("traceparent", value.clone()));
            if let Seen::Once(state) = &self.tracestate {
                if state.len() <= MAX_TRACESTATE && state.bytes().all(|b| (0x20..0x7f).contains(&b))
                {
                    headers.push(("tracestate", state.clone()));
                }
            }
        }
        let single = self.b3.value().and_then(TraceParent::from_b3);
        if let (Some(_), Seen::Once(value)) = (single, &self.b3) {
            headers.push(("b3", value.clone()));
        }
        let multi = self.b3_multi();
        if multi.is_some() {
            for (name, seen) in B3_MULTI.iter().zip(&self.b3_multi) {
                if let Seen::Once(value) = seen {
                    headers.push((name, value.clone()));
                }
            }
        }
        let parent = w3c.or(single).or(multi)?;
        Some(TraceContext { headers, parent })
    }

    /// The context of B3's multiple headers, when they make one: a trace
    /// and span id, and any of the others well formed.
    fn b3_multi(&self) -> Option<TraceParent> {
        let [trace_id, span_id, parent, sampled, flags] = &self.b3_multi;
        let debug = match flags {
            Seen::No => false,
            Seen::Once(f) if f == "1" => true,
            _ => return None,
        };
        let parent_ok = match parent {
            Seen::No => true,
            Seen::Once(p) => TraceParent::from_b3_parts("0000000000000001", p, None).is_some(),
            Seen::Bad => false,
        };
        if !parent_ok || matches!(sampled, Seen::Bad) {
            return None;
        }
        let sampled = if debug { Some("1") } else { sampled.value() };
        TraceParent::from_b3_parts(trace_id.value()?, span_id.value()?, sampled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W3C: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn read(pairs: &[(&str, &str)]) -> Option<TraceContext> {
        let pairs: Vec<(&str, &[u8])> = pairs.iter().map(|(n, v)| (*n, v.as_bytes())).collect();
        TraceContext::read(&HeaderMap::from_pairs(&pairs))
    }

    #[test]
    fn a_request_without_trace_headers_has_no_context() {
        assert_eq!(
            read(&[(":path", "/"), ("x-api-key", "k"), ("b", "x")]),
            None
        );
    }

    #[test]
    fn w3c_is_forwarded_as_it_came() {
        let t = read(&[("traceparent", W3C), ("tracestate", "vendor=x"), ("x", "y")]).unwrap();
        assert_eq!(
            t.headers().collect::<Vec<_>>(),
            [("traceparent", W3C), ("tracestate", "vendor=x")]
        );
        assert_eq!(t.traceparent(), W3C);
    }

    #[test]
    fn b3_is_forwarded_as_it_came_and_carried_as_w3c() {
        let t = read(&[
            ("x-b3-traceid", "a3ce929d0e0e4736"),
            ("x-b3-spanid", "00f067aa0ba902b7"),
            ("x-b3-parentspanid", "0020000000000001"),
            ("x-b3-sampled", "1"),
        ])
        .unwrap();
        assert_eq!(t.headers().count(), 4);
        assert_eq!(
            t.traceparent(),
            "00-0000000000000000a3ce929d0e0e4736-00f067aa0ba902b7-01"
        );
        let single = read(&[("b3", "a3ce929d0e0e4736-00f067aa0ba902b7-0")]).unwrap();
        assert_eq!(
            single.headers().collect::<Vec<_>>(),
            [("b3", "a3ce929d0e0e4736-00f067aa0ba902b7-0")]
        );
        assert!(single.traceparent().ends_with("-00"));
    }

    #[test]
    fn malformed_or_repeated_trace_headers_are_not_forwarded() {
        assert_eq!(read(&[("traceparent", "00-zz-00f067aa0ba902b7-01")]), None);
        assert_eq!(read(&[("traceparent", W3C), ("traceparent", W3C)]), None);
        assert_eq!(read(&[("x-b3-traceid", "a3ce929d0e0e4736")]), None);
        assert_eq!(
            read(&[
                ("x-b3-traceid", "a3ce929d0e0e4736"),
                ("x-b3-spanid", "00f067aa0ba902b7"),
                ("x-b3-sampled", "yes\r\nx-evil: 1"),
            ]),
            None
        );
        // A bad tracestate does not cost the context.
        let long = "a=".to_string() + &"b".repeat(600);
        let t = read(&[("traceparent", W3C), ("tracestate", &long)]).unwrap();
        assert_eq!(t.headers().count(), 1);
        // A bad B3 beside a good W3C: W3C alone goes.
        let t = read(&[("traceparent", W3C), ("b3", "nonsense")]).unwrap();
        assert_eq!(t.headers().collect::<Vec<_>>(), [("traceparent", W3C)]);
    }
}
