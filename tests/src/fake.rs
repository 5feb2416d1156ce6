//! A misbehaving stand-in for meshlimitd, to prove the filter treats every
//! kind of bad answer as a service error and never as a client error.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
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
        let listener =
            TcpListener::bind(addr).unwrap_or_else(|e| panic!("cannot bind {addr}: {e}"));
        listener
            .set_nonblocking(true)
            .unwrap_or_else(|e| panic!("cannot configure {addr}: {e}"));
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        std::thread::spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((stream, _)) => {
                        let (b, f) = (behavior.clone(), Arc::clone(&flag));
                        std::thread::spawn(move || serve(stream, &b, &f));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
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

/// Reads one request (headers and a content-length body); returns its path.
fn read_request(stream: &mut TcpStream) -> Option<String> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = stream.read(&mut chunk).ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            while buf.len() < end + 4 + len {
                let n = stream.read(&mut chunk).ok()?;
                if n == 0 {
                    return None;
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            buf.drain(..end + 4 + len);
            return head.split_whitespace().nth(1).map(str::to_string);
        }
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
        let Some(path) = read_request(&mut stream) else {
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
