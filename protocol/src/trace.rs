//! Trace context: which request a check belongs to, so that meshlimitd's
//! span for it hangs under that request's span.
//!
//! Two formats arrive at a proxy: W3C Trace Context (`traceparent`, what
//! OpenTelemetry and Envoy's OpenTelemetry tracer send) and Zipkin's B3
//! (`b3`, or `x-b3-traceid` and friends, what Istio's sidecars send by
//! default). The filter forwards whichever came on its check calls, as
//! headers, and also puts each check's context in the check itself (a
//! batch carries checks of many requests, a call only one set of headers)
//! in one form, the `traceparent` value, which [`TraceParent`] parses and
//! writes. B3's 64-bit trace ids become 128-bit ones left-padded with
//! zeros, as OpenTelemetry's B3 propagator does.
//!
//! All of it is client input: parsing is strict (lower-case hex of the
//! exact lengths, ids not all zero), and anything else is no context at
//! all, never an error: a bad `traceparent` must not cost a request its
//! decision.

/// A span context: the trace, the span that is the parent, and whether
/// the trace is sampled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    /// W3C trace flags (bit 0: sampled).
    pub flags: u8,
}

/// Longest `traceparent` accepted: version 00 is exactly 55 characters;
/// later versions may append fields, which are ignored (W3C, "versioning").
const MAX_TRACEPARENT: usize = 512;

impl TraceParent {
    /// Whether the caller sampled the trace.
    pub fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }

    /// Parses a W3C `traceparent` (`00-<trace id>-<span id>-<flags>`).
    pub fn parse(value: &str) -> Option<TraceParent> {
        if value.len() > MAX_TRACEPARENT {
            return None;
        }
        let mut parts = value.split('-');
        let version = hex_array::<1>(parts.next()?)?;
        // Version ff is invalid; 00 has exactly four fields.
        let [v] = version;
        if v == 0xff {
            return None;
        }
        let trace_id = non_zero(hex_array::<16>(parts.next()?)?)?;
        let span_id = non_zero(hex_array::<8>(parts.next()?)?)?;
        let [flags] = hex_array::<1>(parts.next()?)?;
        if v == 0 && parts.next().is_some() {
            return None;
        }
        Some(TraceParent {
            trace_id,
            span_id,
            flags,
        })
    }

    /// Parses B3's single header (`<trace id>-<span id>[-<sampling>[-<parent>]]`).
    /// A value that only samples (`0`, `1`, `d`) carries no context.
    pub fn from_b3(value: &str) -> Option<TraceParent> {
        let mut parts = value.split('-');
        let (trace_id, span_id) = (parts.next()?, parts.next()?);
        let sampled = parts.next();
        let parent = parts.next();
        if parts.next().is_some() || parent.is_some_and(|p| hex_array::<8>(p).is_none()) {
            return None;
        }
        TraceParent::from_b3_parts(trace_id, span_id, sampled)
    }

    /// From B3's multiple headers: `x-b3-traceid`, `x-b3-spanid` and
    /// `x-b3-sampled` (or `x-b3-flags: 1`, debug, which implies sampled).
    pub fn from_b3_parts(
        trace_id: &str,
        span_id: &str,
        sampled: Option<&str>,
    ) -> Option<TraceParent> {
        let trace_id = non_zero(b3_trace_id(trace_id)?)?;
        let span_id = non_zero(hex_array::<8>(span_id)?)?;
        let flags = match sampled {
            None | Some("0") => 0,
            Some("1" | "d" | "true") => 1,
            Some(_) => return None,
        };
        Some(TraceParent {
            trace_id,
            span_id,
            flags,
        })
    }

    /// The context as a version 00 `traceparent` value.
    pub fn to_header(&self) -> String {
        let mut out = String::with_capacity(55);
        out.push_str("00-");
        push_hex(&mut out, &self.trace_id);
        out.push('-');
        push_hex(&mut out, &self.span_id);
        out.push('-');
        push_hex(&mut out, &[self.flags]);
        out
    }
}

/// A B3 trace id: 32 hex digits, or 16 (64 bits, left-padded with zeros).
fn b3_trace_id(text: &str) -> Option<[u8; 16]> {
    if text.len() == 16 {
        let low = hex_array::<8>(text)?;
        let mut id = [0u8; 16];
        for (to, from) in id.iter_mut().skip(8).zip(low) {
            *to = from;
        }
        return Some(id);
    }
    hex_array::<16>(text)
}

fn non_zero<const N: usize>(id: [u8; N]) -> Option<[u8; N]> {
    id.iter().any(|b| *b != 0).then_some(id)
}

/// Exactly `2 * N` lower-case hex digits, as bytes.
fn hex_array<const N: usize>(text: &str) -> Option<[u8; N]> {
    if text.len() != 2 * N {
        return None;
    }
    let mut out = [0u8; N];
    let digits = text.as_bytes().chunks_exact(2);
    for (byte, pair) in out.iter_mut().zip(digits) {
        let (hi, lo) = match pair {
            [hi, lo] => (hex_digit(*hi)?, hex_digit(*lo)?),
            _ => return None,
        };
        *byte = hi << 4 | lo;
    }
    Some(out)
}

fn hex_digit(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    }
}

fn push_hex(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for b in bytes {
        for nibble in [b >> 4, b & 0xf] {
            if let Some(d) = DIGITS.get(usize::from(nibble)) {
                out.push(char::from(*d));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W3C: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_traceparent_round_trips() {
        let t = TraceParent::parse(W3C).unwrap();
        assert!(t.sampled());
        assert_eq!(t.to_header(), W3C);
        let unsampled = TraceParent::parse(&W3C.replace("-01", "-00")).unwrap();
        assert!(!unsampled.sampled());
    }

    #[test]
    fn a_malformed_traceparent_is_no_context() {
        for bad in [
            "",
            "00",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0\u{e9}",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad}");
        }
        // A later version may append fields.
        let later = format!("{}-what-comes", W3C.replacen("00", "01", 1));
        assert!(TraceParent::parse(&later).is_some());
        assert_eq!(TraceParent::parse(&"0".repeat(600)), None);
    }

    #[test]
    fn b3_becomes_a_traceparent() {
        let single = TraceParent::from_b3(
            "80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-1-05e3ac9a4f6e3b90",
        )
        .unwrap();
        assert_eq!(
            single.to_header(),
            "00-80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-01"
        );
        let short =
            TraceParent::from_b3_parts("a3ce929d0e0e4736", "00f067aa0ba902b7", Some("0")).unwrap();
        assert_eq!(
            short.to_header(),
            "00-0000000000000000a3ce929d0e0e4736-00f067aa0ba902b7-00"
        );
        let debug = TraceParent::from_b3("a3ce929d0e0e4736-00f067aa0ba902b7-d").unwrap();
        assert!(debug.sampled());
        for bad in [
            "1",
            "0",
            "d",
            "a3ce929d0e0e4736-00f067aa0ba902b7-x",
            "a3ce929d0e0e4736-00f067aa0ba902b7-1-zz",
            "xyz-00f067aa0ba902b7",
        ] {
            assert_eq!(TraceParent::from_b3(bad), None, "{bad}");
        }
    }
}
