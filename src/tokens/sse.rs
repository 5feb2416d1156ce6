//! A server-sent-events stream (OpenAI's chat completions with
//! `"stream": true`), passed on event by event within a budget.
//!
//! Each `data:` event is JSON; each content delta counts as one token (a
//! documented estimate: a delta is usually one token, sometimes a few): an
//! OpenAI choice whose `delta` carries content, reasoning or tool-call
//! arguments, an Anthropic `content_block_delta`, a Gemini candidate's
//! text. The usage the events report ([`crate::tokens::usage`]: the last
//! value of each of its paths) gives the exact count. Only whole events
//! are passed on, so the stream can be ended cleanly between two of them.

use serde_json::Value;

use super::usage::{StreamUsage, UsageExpr};

/// The event that ends a stream cut at its budget, in the shape of an
/// OpenAI chunk, and the terminator OpenAI clients wait for.
pub const CUT_EVENTS: &[u8] = b"data: {\"id\":\"meshlimit-budget\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"rate_limited\"}]}\n\ndata: [DONE]\n\n";

/// What [`SseGate::push`] lets through.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Passed {
    /// The bytes to forward now (whole events).
    pub bytes: Vec<u8>,
    /// An event was held back: passing it would exceed the room given.
    pub blocked: bool,
}

/// A stream's events, counted as they pass.
#[derive(Debug)]
pub struct SseGate {
    /// Bytes not passed yet: an incomplete event, or events held back.
    pending: Vec<u8>,
    usage_expr: Option<UsageExpr>,
    /// The usage's terms as the events reported them so far.
    reported: StreamUsage,
    /// Above this many pending bytes without a whole event, the stream is
    /// not one we can read: its bytes pass uncounted.
    max_pending: usize,
    /// Content deltas passed.
    pub deltas: u64,
    /// The usage the last event carrying it reported.
    pub usage: Option<u64>,
}

impl SseGate {
    pub fn new(usage_expr: Option<UsageExpr>, max_pending: usize) -> Self {
        SseGate {
            pending: Vec::new(),
            usage_expr,
            reported: StreamUsage::default(),
            max_pending,
            deltas: 0,
            usage: None,
        }
    }

    /// Adds `chunk` and passes every whole event that fits in `room` more
    /// deltas (`None`: no bound).
    pub fn push(&mut self, chunk: &[u8], room: Option<u64>) -> Passed {
        self.pending.extend_from_slice(chunk);
        let mut passed = Passed::default();
        let mut room = room;
        let mut start = 0;
        while let Some(end) = event_end(self.pending.get(start..).unwrap_or_default()) {
            let event = self.pending.get(start..start + end).unwrap_or_default();
            let (deltas, value) = read_event(event);
            if let Some(r) = room {
                if deltas > r {
                    passed.blocked = true;
                    break;
                }
                room = Some(r - deltas);
            }
            self.deltas += deltas;
            self.note_usage(value.as_ref());
            start += end;
        }
        if !passed.blocked && start == 0 && self.pending.len() > self.max_pending {
            // No event boundary in sight: not an event stream we can count.
            start = self.pending.len();
        }
        passed.bytes = self.pending.drain(..start).collect();
        passed
    }

    /// The stream ended: what is left passes as it is (an incomplete last
    /// event is counted if it reads as one), unless it does not fit `room`.
    pub fn finish(&mut self, room: Option<u64>) -> Passed {
        let mut passed = self.push(&[], room);
        if passed.blocked || self.pending.is_empty() {
            return passed;
        }
        let (deltas, value) = read_event(&self.pending);
        if room.is_some_and(|r| deltas > r) {
            passed.blocked = true;
            return passed;
        }
        self.deltas += deltas;
        self.note_usage(value.as_ref());
        passed.bytes.append(&mut self.pending);
        passed
    }

    /// Drops what is pending (the stream was cut).
    pub fn discard(&mut self) {
        self.pending.clear();
    }

    /// Notes what an event says of the usage.
    fn note_usage(&mut self, event: Option<&Value>) {
        if let (Some(expr), Some(event)) = (&self.usage_expr, event) {
            self.reported.see(expr, event);
            if let Some(total) = self.reported.total(expr) {
                self.usage = Some(total);
            }
        }
    }
}

/// An event's content deltas, and its JSON.
fn read_event(event: &[u8]) -> (u64, Option<Value>) {
    let mut data = Vec::new();
    for line in event.split(|b| *b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some(rest) = line.strip_prefix(b"data:") {
            if !data.is_empty() {
                data.push(b'\n');
            }
            data.extend_from_slice(rest.strip_prefix(b" ").unwrap_or(rest));
        }
    }
    let Ok(value) = serde_json::from_slice::<Value>(&data) else {
        return (0, None);
    };
    (deltas(&value), Some(value))
}

/// Content deltas in an event, in each provider's shape.
fn deltas(value: &Value) -> u64 {
    let text = |v: Option<&Value>| v.and_then(Value::as_str).is_some_and(|s| !s.is_empty());
    // OpenAI: each choice with content, reasoning, or tool-call arguments.
    let openai = value
        .get("choices")
        .and_then(Value::as_array)
        .map_or(0, |choices| {
            choices
                .iter()
                .filter(|c| {
                    let delta = c.get("delta");
                    let d = |k: &str| delta.and_then(|d| d.get(k));
                    text(d("content"))
                        || text(d("reasoning_content"))
                        || d("tool_calls").is_some_and(|t| !t.is_null())
                })
                .count() as u64
        });
    // Anthropic: a content block's delta (text, thinking, tool input).
    let anthropic =
        u64::from(value.get("type").and_then(Value::as_str) == Some("content_block_delta"));
    // Gemini: each candidate whose parts carry text.
    let gemini = value
        .get("candidates")
        .and_then(Value::as_array)
        .map_or(0, |candidates| {
            candidates
                .iter()
                .filter(|c| {
                    c.get("content")
                        .and_then(|c| c.get("parts"))
                        .and_then(Value::as_array)
                        .is_some_and(|parts| parts.iter().any(|p| text(p.get("text"))))
                })
                .count() as u64
        });
    openai + anthropic + gemini
}

/// The length of the first whole event in `bytes`, its blank line
/// included.
fn event_end(bytes: &[u8]) -> Option<usize> {
    let mut i = 0;
    while i < bytes.len() {
        if bytes.get(i) == Some(&b'\n') {
            match bytes.get(i + 1) {
                Some(b'\n') => return Some(i + 2),
                Some(b'\r') if bytes.get(i + 2) == Some(&b'\n') => return Some(i + 3),
                _ => {}
            }
        }
        i += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::usage::UsageExpr;

    fn delta(text: &str) -> String {
        format!("data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{text}\"}}}}]}}\n\n")
    }

    const USAGE: &str =
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"total_tokens\":9}}\n\n";

    fn gate() -> SseGate {
        SseGate::new(Some(UsageExpr::single("usage.total_tokens")), 1 << 16)
    }

    #[test]
    fn deltas_and_usage_are_counted_event_by_event_across_chunks() {
        let mut g = gate();
        let stream = format!("{}{}{USAGE}data: [DONE]\n\n", delta("a"), delta("b"));
        let bytes = stream.as_bytes();
        let mut out = Vec::new();
        for chunk in bytes.chunks(7) {
            out.extend(g.push(chunk, None).bytes);
        }
        out.extend(g.finish(None).bytes);
        assert_eq!(out, bytes);
        assert_eq!((g.deltas, g.usage), (2, Some(9)));
    }

    #[test]
    fn events_that_do_not_fit_are_held_back_whole() {
        let mut g = gate();
        let stream = format!("{}{}{}", delta("a"), delta("b"), delta("c"));
        let passed = g.push(stream.as_bytes(), Some(2));
        assert!(passed.blocked);
        assert_eq!(
            passed.bytes,
            format!("{}{}", delta("a"), delta("b")).as_bytes()
        );
        // More room (a top-up): the held event passes with the next chunk.
        let next = g.push(delta("d").as_bytes(), Some(5));
        assert!(!next.blocked);
        assert_eq!(
            next.bytes,
            format!("{}{}", delta("c"), delta("d")).as_bytes()
        );
        assert_eq!(g.deltas, 4);
    }

    #[test]
    fn empty_deltas_crlf_and_garbage_count_nothing() {
        let mut g = gate();
        let s = "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\r\n\r\n: comment\n\ndata: not json\n\n";
        let passed = g.push(s.as_bytes(), Some(0));
        assert_eq!(passed.bytes, s.as_bytes());
        assert_eq!(g.deltas, 0);
    }

    #[test]
    fn a_stream_without_event_boundaries_passes_uncounted() {
        let mut g = SseGate::new(None, 16);
        let passed = g.push(&[b'x'; 40], Some(0));
        assert_eq!(passed.bytes.len(), 40);
    }
}
