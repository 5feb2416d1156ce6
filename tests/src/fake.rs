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

fn serve(mut stream: TcpStream, behavior: &Behavior, stop: &AtomicBool) {
    let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
    while !stop.load(Ordering::Relaxed) {
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
            Behavior::Huge(n) => respond(
                &mut stream,
                200,
                &format!("{{\"results\":[\"{}\"]}}", "x".repeat(*n)),
            ),
            Behavior::SlowBody(delay) => {
                let body = r#"{"results":[{"allowed":true,"limits":[{"allowed":true,"limit":20,"remaining":19,"reset_after_ms":1,"retry_after_ms":0}]}]}"#;
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
