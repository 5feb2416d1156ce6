//! A misbehaving stand-in for meshlimitd, to prove the filter treats every
//! kind of bad answer as a service error and never as a client error.

use std::io::Write;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Clone)]
pub enum Behavior {
    /// Accepts, reads, never answers.
    Hang,
    /// Answers this status and body to checks; health checks get 200.
    Answer(u16, String),
    /// 200 with a body of this many bytes of JSON-ish garbage.
    Huge(usize),
    /// 200 headers at once, then the body after this delay.
    SlowBody(Duration),
    /// Health checks fail (503) and checks hang: "no healthy endpoint".
    Unhealthy,
}

pub struct FakeService {
    stop: Arc<AtomicBool>,
    addr: String,
}

impl FakeService {
    pub fn start(addr: &str, behavior: Behavior) -> FakeService {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        crate::http::accept_in_background(addr, Arc::clone(&stop), move |stream| {
            serve(stream, &behavior, &flag)
        });
        FakeService {
            stop,
            addr: addr.to_string(),
        }
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }
}

impl Drop for FakeService {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn respond(stream: &mut TcpStream, status: u16, body: &str) -> bool {
    let head = format!(
        "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).is_ok() && stream.write_all(body.as_bytes()).is_ok()
}

/// What [`Behavior::SlowBody`] answers, once its delay is over: one
/// check allowed.
const SLOW_ANSWER: &str = r#"{"results":[{"allowed":true,"limits":[{"allowed":true,"limit":20,"remaining":19,"reset_after_ms":1,"retry_after_ms":0}]}]}"#;

/// What [`Behavior::Huge`] answers: JSON whose one result is a string of
/// `n` bytes (no check result the filter can use).
fn huge_answer(n: usize) -> String {
    format!("{{\"results\":[\"{}\"]}}", "x".repeat(n))
}

/// The first bytes of an HTTP/2 connection with prior knowledge (h2c), as
/// Envoy opens its meshlimit cluster's: no HTTP/1.1 method starts so.
const HTTP2_PREFACE: &[u8] = b"PRI * HTTP/2.0";

/// Serves a connection in the protocol it opens with: Envoy's calls come
/// over HTTP/2, as its meshlimit cluster speaks (envoy/replica.yaml), and
/// its health checks over HTTP/1.1.
fn serve(stream: TcpStream, behavior: &Behavior, stop: &AtomicBool) {
    let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
    let mut first = [0u8; HTTP2_PREFACE.len()];
    let opened = loop {
        match stream.peek(&mut first) {
            Ok(n) if n < first.len() && n > 0 && HTTP2_PREFACE.starts_with(&first[..n]) => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Ok(n) => break first.get(..n).unwrap_or_default(),
            Err(_) if !stop.load(Ordering::Relaxed) => {}
            Err(_) => return,
        }
    };
    if opened == HTTP2_PREFACE {
        serve_http2(stream, behavior, stop);
    } else {
        serve_http1(stream, behavior, stop);
    }
}

fn serve_http1(mut stream: TcpStream, behavior: &Behavior, stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        // Closed by Envoy: done (a read at its end returns at once, and
        // would spin here until the test stops).
        if matches!(stream.peek(&mut [0u8; 1]), Ok(0)) {
            return;
        }
        let Some(path) = crate::http::read_request(&mut stream).map(|r| r.path) else {
            // Timeouts just mean an idle keep-alive connection.
            if stop.load(Ordering::Relaxed) {
                return;
            }
            continue;
        };
        let healthz = path == "/healthz";
        let ok = match behavior {
            Behavior::Unhealthy if healthz => respond(&mut stream, 503, "{}"),
            _ if healthz => respond(&mut stream, 200, "ok"),
            Behavior::Hang | Behavior::Unhealthy => {
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(20));
                }
                false
            }
            Behavior::Answer(status, body) => respond(&mut stream, *status, body),
            Behavior::Huge(n) => respond(&mut stream, 200, &huge_answer(*n)),
            Behavior::SlowBody(delay) => {
                let body = SLOW_ANSWER;
                let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", body.len());
                let sent = stream.write_all(head.as_bytes()).is_ok();
                std::thread::sleep(*delay);
                sent && stream.write_all(body.as_bytes()).is_ok()
            }
        };
        if !ok {
            return;
        }
    }
}

/// The same behaviours over HTTP/2: each call a stream of its own, so a
/// hanging one holds only its stream.
fn serve_http2(stream: TcpStream, behavior: &Behavior, stop: &AtomicBool) {
    let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    else {
        return;
    };
    runtime.block_on(async {
        let Ok(tcp) = stream
            .set_nonblocking(true)
            .and_then(|()| tokio::net::TcpStream::from_std(stream))
        else {
            return;
        };
        let Ok(mut connection) = h2::server::handshake(tcp).await else {
            return;
        };
        while !stop.load(Ordering::Relaxed) {
            let accepted = tokio::time::timeout(Duration::from_millis(200), connection.accept());
            match accepted.await {
                Ok(Some(Ok((request, respond)))) => {
                    let behavior = behavior.clone();
                    tokio::spawn(answer_http2(request, respond, behavior));
                }
                Ok(_) => return,
                Err(_) => {} // idle
            }
        }
    });
}

/// Reads a call's body whole, as meshlimitd does, then answers as
/// `behavior` says (a hanging call never is, until its stream is reset).
async fn answer_http2(
    request: http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<bytes::Bytes>,
    behavior: Behavior,
) {
    let healthz = request.uri().path() == "/healthz";
    let mut body = request.into_body();
    while let Some(Ok(chunk)) = body.data().await {
        let _ = body.flow_control().release_capacity(chunk.len());
    }
    let (status, answer, delay) = match behavior {
        Behavior::Unhealthy if healthz => (503, "{}".to_string(), None),
        _ if healthz => (200, "ok".to_string(), None),
        Behavior::Hang | Behavior::Unhealthy => {
            // Until Envoy gives up on the call and resets its stream.
            let _ = std::future::poll_fn(|cx| respond.poll_reset(cx)).await;
            return;
        }
        Behavior::Answer(status, body) => (status, body, None),
        Behavior::Huge(n) => (200, huge_answer(n), None),
        Behavior::SlowBody(delay) => (200, SLOW_ANSWER.to_string(), Some(delay)),
    };
    let Ok(head) = http::Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(())
    else {
        return;
    };
    let Ok(mut send) = respond.send_response(head, answer.is_empty()) else {
        return;
    };
    if let Some(delay) = delay {
        tokio::time::sleep(delay).await;
    }
    if !answer.is_empty() {
        // Queued whole; the connection sends it as Envoy's window allows.
        let _ = send.send_data(bytes::Bytes::from(answer), true);
    }
}
