//! A fake LLM upstream for token-budget tests and the demo, speaking the
//! shapes of OpenAI's chat completions (the default), Anthropic's messages
//! and Gemini's `generateContent` (`x-llm-shape`).
//!
//! A request is answered with a JSON body, or with `"stream": true` in the
//! request an event stream: one delta event per token; OpenAI's ends with a
//! usage event and `[DONE]`, as OpenAI's own does, only when the request
//! asked (`"stream_options": {"include_usage": true}`), Anthropic's reports the
//! input tokens in `message_start` and the output tokens in
//! `message_delta`, Gemini's carries the usage so far in every chunk.
//! Each request says how it should behave through headers, so one
//! upstream serves every case of a test:
//!
//! | header | meaning | default |
//! |---|---|---|
//! | `x-llm-tokens` | completion tokens (deltas of a stream) | 10 |
//! | `x-llm-prompt` | prompt tokens (counted in `total_tokens`) | 0 |
//! | `x-llm-usage` | `body` (JSON `usage` / last event), `header` (`x-usage-tokens`), `none` | `body` |
//! | `x-llm-status` | answer this status with an error body | 200 |
//! | `x-llm-delay-ms` | wait before the answer, and between events | 0 |
//! | `x-llm-shape` | `openai`, `anthropic` or `gemini` | `openai` |
//! | `x-llm-framing` | a stream's: `chunked`, or `length` (all of it at once, with a `content-length`) | `chunked` |
//!
//! It counts the completion tokens it actually wrote to the socket, so a
//! test can compare what the budget settled with what was delivered.

use std::io::Write;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::http::{read_request, ServerRequest as Request};

pub struct FakeLlm {
    stop: Arc<AtomicBool>,
    /// Completion tokens written to clients (Envoy) so far.
    pub written: Arc<AtomicU64>,
    /// Connections Envoy opened to the model, and requests it began (a
    /// first byte seen, whether or not the request was then finished):
    /// what a limiter that protects the model must keep at 0 for a client
    /// it refuses.
    pub connections: Arc<AtomicU64>,
    pub requests_begun: Arc<AtomicU64>,
}

impl FakeLlm {
    pub fn start(addr: &str) -> FakeLlm {
        let stop = Arc::new(AtomicBool::new(false));
        let written = Arc::new(AtomicU64::new(0));
        let connections = Arc::new(AtomicU64::new(0));
        let requests_begun = Arc::new(AtomicU64::new(0));
        let counts = (
            Arc::clone(&written),
            Arc::clone(&connections),
            Arc::clone(&requests_begun),
        );
        crate::http::accept_in_background(addr, Arc::clone(&stop), move |stream| {
            counts.1.fetch_add(1, Ordering::Relaxed);
            serve(stream, &counts.0, &counts.2)
        });
        FakeLlm {
            stop,
            written,
            connections,
            requests_begun,
        }
    }
}

impl Drop for FakeLlm {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// A behaviour header's number, or `default`.
fn number(req: &Request, name: &str, default: u64) -> u64 {
    req.header(name)
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Answers requests on one connection: kept alive after JSON answers (the
/// bench's load reuses Envoy's upstream connections), closed after a stream.
fn serve(mut stream: TcpStream, written: &AtomicU64, begun: &AtomicU64) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    // Each answer and each event is one write: no small segment waits on
    // a delayed ACK.
    let _ = stream.set_nodelay(true);
    loop {
        // A request has begun once its first byte is in.
        let mut first = [0u8; 1];
        if !matches!(stream.peek(&mut first), Ok(n) if n > 0) {
            return;
        }
        begun.fetch_add(1, Ordering::Relaxed);
        let Some(req) = read_request(&mut stream) else {
            return;
        };
        if !answer(&mut stream, &req, written) {
            return;
        }
    }
}

/// A provider's response shapes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Shape {
    OpenAi,
    Anthropic,
    Gemini,
}

impl Shape {
    fn of(req: &Request) -> Shape {
        match req.header("x-llm-shape") {
            Some("anthropic") => Shape::Anthropic,
            Some("gemini") => Shape::Gemini,
            _ => Shape::OpenAi,
        }
    }

    /// A whole JSON answer; `usage`: with its usage.
    fn json(self, prompt: u64, tokens: u64, usage: bool) -> String {
        let content = vec!["tok"; tokens as usize].join(" ");
        let total = prompt + tokens;
        match (self, usage) {
            (Shape::OpenAi, _) => {
                let usage = if usage {
                    format!(
                        r#","usage":{{"prompt_tokens":{prompt},"completion_tokens":{tokens},"total_tokens":{total}}}"#
                    )
                } else {
                    String::new()
                };
                format!(
                    r#"{{"id":"chatcmpl-fake","object":"chat.completion","choices":[{{"index":0,"message":{{"role":"assistant","content":"{content}"}},"finish_reason":"stop"}}]{usage}}}"#
                )
            }
            (Shape::Anthropic, usage) => {
                let usage = if usage {
                    format!(r#","usage":{{"input_tokens":{prompt},"output_tokens":{tokens}}}"#)
                } else {
                    String::new()
                };
                format!(
                    r#"{{"id":"msg_fake","type":"message","role":"assistant","content":[{{"type":"text","text":"{content}"}}],"stop_reason":"end_turn"{usage}}}"#
                )
            }
            (Shape::Gemini, usage) => {
                let usage = if usage {
                    format!(
                        r#","usageMetadata":{{"promptTokenCount":{prompt},"candidatesTokenCount":{tokens},"totalTokenCount":{total}}}"#
                    )
                } else {
                    String::new()
                };
                format!(
                    r#"{{"candidates":[{{"content":{{"parts":[{{"text":"{content}"}}],"role":"model"}},"finishReason":"STOP"}}]{usage}}}"#
                )
            }
        }
    }

    /// Events before the first delta.
    fn start(self, prompt: u64, usage: bool) -> Vec<String> {
        match self {
            Shape::Anthropic => {
                let usage = if usage {
                    format!(r#","usage":{{"input_tokens":{prompt},"output_tokens":1}}"#)
                } else {
                    String::new()
                };
                vec![format!("event: message_start\ndata: {{\"type\":\"message_start\",\"message\":{{\"id\":\"msg_fake\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[]{usage}}}}}\n\n")]
            }
            _ => Vec::new(),
        }
    }

    /// The event of token `i` (of a prompt of `prompt`).
    fn delta(self, i: u64, prompt: u64, usage: bool) -> String {
        match self {
            Shape::OpenAi => format!("data: {{\"id\":\"chatcmpl-fake\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"t{i} \"}},\"finish_reason\":null}}]}}\n\n"),
            Shape::Anthropic => format!("event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\"index\":0,\"delta\":{{\"type\":\"text_delta\",\"text\":\"t{i} \"}}}}\n\n"),
            Shape::Gemini => {
                let usage = if usage {
                    format!(r#","usageMetadata":{{"promptTokenCount":{prompt},"candidatesTokenCount":{},"totalTokenCount":{}}}"#, i + 1, prompt + i + 1)
                } else {
                    String::new()
                };
                format!("data: {{\"candidates\":[{{\"content\":{{\"parts\":[{{\"text\":\"t{i} \"}}],\"role\":\"model\"}}}}]{usage}}}\n\n")
            }
        }
    }

    /// Events after the last delta.
    fn end(self, prompt: u64, tokens: u64, usage: bool) -> Vec<String> {
        let total = prompt + tokens;
        match self {
            Shape::OpenAi => {
                let mut events = vec!["data: {\"id\":\"chatcmpl-fake\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n".to_string()];
                if usage {
                    events.push(format!("data: {{\"id\":\"chatcmpl-fake\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{{\"prompt_tokens\":{prompt},\"completion_tokens\":{tokens},\"total_tokens\":{total}}}}}\n\n"));
                }
                events.push("data: [DONE]\n\n".to_string());
                events
            }
            Shape::Anthropic => {
                let usage = if usage {
                    format!(r#","usage":{{"output_tokens":{tokens}}}"#)
                } else {
                    String::new()
                };
                vec![
                    format!("event: message_delta\ndata: {{\"type\":\"message_delta\",\"delta\":{{\"stop_reason\":\"end_turn\"}}{usage}}}\n\n"),
                    "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n".to_string(),
                ]
            }
            Shape::Gemini => Vec::new(),
        }
    }
}

/// Answers one request; false when the connection is done.
fn answer(stream: &mut TcpStream, req: &Request, written: &AtomicU64) -> bool {
    let tokens = number(req, "x-llm-tokens", 10);
    let prompt = number(req, "x-llm-prompt", 0);
    let status = number(req, "x-llm-status", 200);
    let delay = Duration::from_millis(number(req, "x-llm-delay-ms", 0));
    let usage = req.header("x-llm-usage").unwrap_or("body").to_string();
    let shape = Shape::of(req);
    let body = serde_json::from_slice::<serde_json::Value>(&req.body).ok();
    let streamed = body
        .as_ref()
        .and_then(|v| v.get("stream")?.as_bool())
        .unwrap_or(false);
    // OpenAI reports a stream's usage only to a request that asks for it.
    let asked_usage = body
        .as_ref()
        .and_then(|v| v.pointer("/stream_options/include_usage")?.as_bool())
        .unwrap_or(false);
    std::thread::sleep(delay);
    let total = prompt + tokens;
    if status != 200 {
        let body = r#"{"error":{"message":"the fake model failed","type":"server_error"}}"#;
        let answer = format!(
            "HTTP/1.1 {status} Error\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        return stream.write_all(answer.as_bytes()).is_ok();
    }
    let usage_header = if usage == "header" {
        format!("x-usage-tokens: {total}\r\n")
    } else {
        String::new()
    };
    let in_body = usage == "body";
    if !streamed {
        let body = shape.json(prompt, tokens, in_body);
        let answer = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n{usage_header}content-length: {}\r\n\r\n{body}",
            body.len()
        );
        let sent = stream.write_all(answer.as_bytes());
        if sent.is_ok() {
            written.fetch_add(tokens, Ordering::Relaxed);
        }
        return sent.is_ok();
    }
    if req.header("x-llm-framing") == Some("length") {
        // The whole stream at once, framed by its length (as an upstream
        // that buffers does): a client reads it by its content-length.
        let in_end = in_body && (shape != Shape::OpenAi || asked_usage);
        let events: Vec<String> = shape
            .start(prompt, in_body)
            .into_iter()
            .chain((0..tokens).map(|i| shape.delta(i, prompt, in_body)))
            .chain(shape.end(prompt, tokens, in_end))
            .collect();
        let body = events.concat();
        let answer = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n{usage_header}content-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        if stream.write_all(answer.as_bytes()).is_ok() {
            written.fetch_add(tokens, Ordering::Relaxed);
        }
        return false;
    }
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n{usage_header}transfer-encoding: chunked\r\nconnection: close\r\n\r\n"
    );
    if stream.write_all(head.as_bytes()).is_err() {
        return false;
    }
    let chunk = |stream: &mut TcpStream, data: &str| -> bool {
        stream
            .write_all(format!("{:x}\r\n{data}\r\n", data.len()).as_bytes())
            .and_then(|_| stream.flush())
            .is_ok()
    };
    for event in shape.start(prompt, in_body) {
        if !chunk(stream, &event) {
            return false;
        }
    }
    for i in 0..tokens {
        if !chunk(stream, &shape.delta(i, prompt, in_body)) {
            return false;
        }
        written.fetch_add(1, Ordering::Relaxed);
        if !delay.is_zero() {
            std::thread::sleep(delay);
        }
    }
    let in_end = in_body && (shape != Shape::OpenAi || asked_usage);
    for event in shape.end(prompt, tokens, in_end) {
        if !chunk(stream, &event) {
            return false;
        }
    }
    let _ = stream.write_all(b"0\r\n\r\n");
    // A stream's connection closes with it (its head said so).
    false
}

/// A chat completion request to `addr` from API key `client`, asking for
/// `max_tokens` (and an event stream with `stream`); `llm` are the fake
/// model's behaviour headers (`x-llm-tokens`, ...).
pub fn chat(
    addr: &str,
    client: &str,
    max_tokens: u64,
    stream: bool,
    llm: &[(&str, &str)],
) -> std::io::Result<crate::http::Response> {
    chat_with_prompt(addr, client, max_tokens, stream, "hi", llm)
}

/// As [`chat`], with `prompt` as the user's message.
pub fn chat_with_prompt(
    addr: &str,
    client: &str,
    max_tokens: u64,
    stream: bool,
    prompt: &str,
    llm: &[(&str, &str)],
) -> std::io::Result<crate::http::Response> {
    let body = serde_json::json!({"model": "fake", "max_tokens": max_tokens, "stream": stream,
                                  "messages": [{"role": "user", "content": prompt}]})
    .to_string();
    let mut headers: Vec<(&str, &[u8])> = vec![
        ("x-api-key", client.as_bytes()),
        ("content-type", b"application/json"),
    ];
    headers.extend(llm.iter().map(|(k, v)| (*k, v.as_bytes())));
    crate::http::request(
        addr,
        "POST",
        "/v1/chat/completions",
        &headers,
        body.as_bytes(),
    )
}

/// The data lines of an event stream's (de-chunked) body.
pub fn events(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}
