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
    /// OpenAI's usage event (no choices, a `usage`) is read, not passed:
    /// the filter asked for it, the client did not, and a client that did
    /// not ask may expect every chunk to have a choice.
    hide_usage_event: bool,
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
            hide_usage_event: false,
        }
    }

    /// Hides OpenAI's usage event when `hide` (see `hide_usage_event`).
    pub fn hiding_usage_event(mut self, hide: bool) -> Self {
        self.hide_usage_event = hide;
        self
    }

    /// Whether an event is OpenAI's usage event, to be hidden.
    fn hidden(&self, value: Option<&Value>) -> bool {
        self.hide_usage_event
            && value.is_some_and(|v| {
                v.get("usage").is_some_and(Value::is_object)
                    && v.get("choices")
                        .and_then(Value::as_array)
                        .is_some_and(Vec::is_empty)
            })
    }

    /// Adds `chunk` and passes every whole event that fits in `room` more
    /// deltas (`None`: no bound).
    pub fn push(&mut self, chunk: &[u8], room: Option<u64>) -> Passed {
        self.pending.extend_from_slice(chunk);
        let mut passed = Passed::default();
        let mut room = room;
        let mut start = 0;
        // Hidden events' places in what is passed (usually none).
        let mut hidden = Vec::new();
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
            if self.hidden(value.as_ref()) {
                hidden.push(start..start + end);
            }
            start += end;
        }
        if !passed.blocked && start == 0 && self.pending.len() > self.max_pending {
            // No event boundary in sight: not an event stream we can count.
            start = self.pending.len();
        }
        passed.bytes = self.pending.drain(..start).collect();
        for range in hidden.into_iter().rev() {
            if range.end <= passed.bytes.len() {
                passed.bytes.drain(range);
            }
        }
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
        if self.hidden(value.as_ref()) {
            self.pending.clear();
        }
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

    #[test]
    fn a_usage_event_the_client_did_not_ask_for_is_read_and_not_passed() {
        let usage = "data: {\"choices\":[],\"usage\":{\"total_tokens\":42}}\n\n";
        let stream = format!("{}{usage}data: [DONE]\n\n", delta("a"));
        for hide in [true, false] {
            let mut g = gate().hiding_usage_event(hide);
            // In one chunk, and with the usage event as the stream's end.
            let passed = g.push(stream.as_bytes(), None);
            assert_eq!(g.usage, Some(42));
            let text = String::from_utf8(passed.bytes).unwrap();
            assert_eq!(text.contains("usage"), !hide, "{text}");
            assert!(text.ends_with("data: [DONE]\n\n"));
            let mut g = gate().hiding_usage_event(hide);
            let first = g.push(delta("a").as_bytes(), None);
            // The last event without its blank line, as a stream may end.
            g.push(usage.trim_end().as_bytes(), None);
            let last = g.finish(None);
            assert_eq!(g.usage, Some(42));
            assert!(!first.bytes.is_empty());
            assert_eq!(last.bytes.is_empty(), hide);
        }
    }

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
