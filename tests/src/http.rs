//! A minimal HTTP/1.1 client over a raw socket. Raw on purpose: the tests
//! send header bytes that HTTP libraries refuse to produce (control bytes,
//! obs-text, 16 KiB values), and must see exactly what Envoy answers.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Response {
    /// First value of a header (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Sends one request on a fresh connection (`Connection: close`).
pub fn request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &[u8])],
    body: &[u8],
) -> std::io::Result<Response> {
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    stream.set_write_timeout(Some(Duration::from_secs(10)))?;
    let mut req = Vec::with_capacity(256 + body.len());
    req.extend_from_slice(
        format!("{method} {path} HTTP/1.1\r\nhost: meshlimit.test\r\n").as_bytes(),
    );
    for (k, v) in headers {
        req.extend_from_slice(k.as_bytes());
        req.extend_from_slice(b": ");
        req.extend_from_slice(v);
        req.extend_from_slice(b"\r\n");
    }
    req.extend_from_slice(
        format!(
            "content-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        )
        .as_bytes(),
    );
    req.extend_from_slice(body);
    stream.write_all(&req)?;
    parse(&read_response(&mut stream)?)
}

/// One response's bytes: up to the end of its body when its headers say
/// where that is (a content-length, or a chunked body's last chunk), else
/// to the end of the connection. Not waiting for the close: after a local
/// reply Envoy keeps the connection for its `delayed_close_timeout` (1 s)
/// unless the client closes first, as real clients do once they have the
/// body, and a test reading to the end waited that second for every such
/// response.
fn read_response(stream: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut raw = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    loop {
        if let Some(end) = response_end(&raw) {
            raw.truncate(end);
            return Ok(raw);
        }
        let n = read_some(stream, &mut buf)?;
        if n == 0 {
            return Ok(raw);
        }
        raw.extend_from_slice(&buf[..n]);
    }
}

/// One read, retried when interrupted: a read with a timeout fails with
/// EINTR after the process was stopped and continued, even with no signal
/// handler (signal(7)); seen once in a full run as "Interrupted system
/// call", failing a test that had done nothing wrong.
fn read_some(stream: &mut TcpStream, buf: &mut [u8]) -> std::io::Result<usize> {
    loop {
        match stream.read(buf) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            other => return other,
        }
    }
}

/// Where a chunked body that starts at `at` ends: after its last chunk
/// and the trailers' blank line, once `raw` holds them.
fn chunked_end(raw: &[u8], mut at: usize) -> Option<usize> {
    loop {
        let rest = raw.get(at..)?;
        let eol = rest.windows(2).position(|w| w == b"\r\n")?;
        let line = String::from_utf8_lossy(&rest[..eol]);
        let size = usize::from_str_radix(line.split(';').next()?.trim(), 16).ok()?;
        at += eol + 2;
        if size == 0 {
            // Trailers, if any, end with a blank line.
            let rest = raw.get(at..)?;
            if rest.starts_with(b"\r\n") {
                return Some(at + 2);
            }
            return rest
                .windows(4)
                .position(|w| w == b"\r\n\r\n")
                .map(|p| at + p + 4);
        }
        at += size + 2;
        if raw.len() < at {
            return None;
        }
    }
}

/// Where the response in `raw` ends, once `raw` holds all of it and its
/// headers say where that is.
fn response_end(raw: &[u8]) -> Option<usize> {
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let body_start = split + 4;
    let head = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
    let header = |name: &str| {
        head.split("\r\n")
            .skip(1)
            .filter_map(|l| l.split_once(':'))
            .find(|(k, _)| k.trim() == name)
            .map(|(_, v)| v.trim().to_string())
    };
    if header("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
        return chunked_end(raw, body_start);
    }
    let length: usize = header("content-length")?.parse().ok()?;
    (raw.len() >= body_start + length).then_some(body_start + length)
}

pub fn get(addr: &str, path: &str, headers: &[(&str, &[u8])]) -> std::io::Result<Response> {
    request(addr, "GET", path, headers, b"")
}

fn bad(what: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string())
}

fn parse(raw: &[u8]) -> std::io::Result<Response> {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| bad("no end of headers"))?;
    let head = String::from_utf8_lossy(&raw[..split]);
    let mut lines = head.split("\r\n");
    let status_line = lines.next().ok_or_else(|| bad("empty response"))?;
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("bad status line"))?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"));
    if chunked {
        body = dechunk(&body);
    }
    Ok(Response {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = data.windows(2).position(|w| w == b"\r\n") {
        let size =
            usize::from_str_radix(String::from_utf8_lossy(&data[..eol]).trim(), 16).unwrap_or(0);
        if size == 0 || data.len() < eol + 2 + size {
            break;
        }
        out.extend_from_slice(&data[eol + 2..eol + 2 + size]);
        data = &data[(eol + 4 + size).min(data.len())..];
    }
    out
}

/// One of Envoy's stats by its full name (`cluster.meshlimit.upstream_rq_total`),
/// 0 when Envoy has none.
pub fn envoy_stat(admin: &str, name: &str) -> u64 {
    envoy_stats(admin, &format!("^{}$", name.replace('.', "\\.")))
        .first()
        .map_or(0, |(_, v)| *v)
}

/// `name: value` lines of an Envoy admin `/stats` page, as numbers.
pub fn envoy_stats(admin: &str, filter: &str) -> Vec<(String, u64)> {
    let path = format!("/stats?filter={filter}");
    match get(admin, &path, &[]) {
        Ok(r) => r
            .body
            .lines()
            .filter_map(|l| l.split_once(": "))
            .filter_map(|(k, v)| Some((k.to_string(), v.trim().parse().ok()?)))
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// A keep-alive HTTP/1.1 connection, for load: responses are read by
/// their content-length (every response in these tests carries one).
pub struct Conn {
    addr: String,
    stream: Option<std::io::BufReader<TcpStream>>,
    connects: u32,
}

impl Conn {
    pub fn new(addr: &str) -> Conn {
        Conn {
            addr: addr.to_string(),
            stream: None,
            connects: 0,
        }
    }

    /// How many TCP connections it has made: more than one means a
    /// request went on a new connection (perhaps to another Envoy worker).
    pub fn connects(&self) -> u32 {
        self.connects
    }

    /// One GET; reconnects once if the kept connection was closed.
    pub fn get(&mut self, path: &str, headers: &[(&str, &[u8])]) -> std::io::Result<Response> {
        match self.try_get(path, headers) {
            Ok(r) => Ok(r),
            Err(_) => {
                self.stream = None;
                self.try_get(path, headers)
            }
        }
    }

    fn try_get(&mut self, path: &str, headers: &[(&str, &[u8])]) -> std::io::Result<Response> {
        use std::io::BufRead;
        if self.stream.is_none() {
            let s = TcpStream::connect(&self.addr)?;
            self.connects += 1;
            s.set_read_timeout(Some(Duration::from_secs(10)))?;
            s.set_nodelay(true)?;
            self.stream = Some(std::io::BufReader::new(s));
        }
        let reader = self.stream.as_mut().ok_or_else(|| bad("no connection"))?;
        let mut req = format!("GET {path} HTTP/1.1\r\nhost: meshlimit.test\r\n").into_bytes();
        for (k, v) in headers {
            req.extend_from_slice(k.as_bytes());
            req.extend_from_slice(b": ");
            req.extend_from_slice(v);
            req.extend_from_slice(b"\r\n");
        }
        req.extend_from_slice(b"\r\n");
        reader.get_mut().write_all(&req)?;
        let mut status_line = String::new();
        if reader.read_line(&mut status_line)? == 0 {
            return Err(bad("connection closed"));
        }
        let status = status_line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| bad("bad status line"))?;
        let mut headers = Vec::new();
        loop {
            let mut line = String::new();
            reader.read_line(&mut line)?;
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            if let Some((k, v)) = line.split_once(':') {
                headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
            }
        }
        let len: usize = headers
            .iter()
            .find(|(k, _)| k == "content-length")
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or(0);
        let mut body = vec![0u8; len];
        reader.read_exact(&mut body)?;
        if headers
            .iter()
            .any(|(k, v)| k == "connection" && v == "close")
        {
            self.stream = None;
        }
        Ok(Response {
            status,
            headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        })
    }
}

/// A request a stand-in server (the fake meshlimitd, the fake model) read.
#[derive(Debug, Clone)]
pub struct ServerRequest {
    pub path: String,
    /// Lower-case names, trimmed values.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl ServerRequest {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Reads one request (headers and a content-length body) from a client
/// connection; `None` when it closes or times out first.
pub fn read_request(stream: &mut TcpStream) -> Option<ServerRequest> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        let n = read_some(stream, &mut chunk).ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
            continue;
        };
        let head = String::from_utf8_lossy(&buf[..end]).into_owned();
        let mut lines = head.split("\r\n");
        let path = lines.next()?.split_whitespace().nth(1)?.to_string();
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        let chunked = headers
            .iter()
            .any(|(k, v)| k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"));
        if chunked {
            // A body Envoy frames itself (no content-length: a filter may
            // have changed its length), read to its last chunk.
            while !buf[end + 4..].windows(5).any(|w| w == b"0\r\n\r\n") {
                let n = read_some(stream, &mut chunk).ok()?;
                if n == 0 {
                    return None;
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            let body = dechunk(&buf[end + 4..]);
            return Some(ServerRequest {
                path,
                headers,
                body,
            });
        }
        let len: usize = headers
            .iter()
            .find(|(k, _)| k == "content-length")
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or(0);
        while buf.len() < end + 4 + len {
            let n = read_some(stream, &mut chunk).ok()?;
            if n == 0 {
                return None;
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        let body = buf[end + 4..end + 4 + len].to_vec();
        return Some(ServerRequest {
            path,
            headers,
            body,
        });
    }
}

/// Accepts connections on `addr` in a thread of its own until `stop` is
/// set, handing each to `handle` in a thread of its own (the stand-in
/// servers: the fake meshlimitd, the fake model). Panics when `addr`
/// cannot be bound: a test cannot run without it.
pub fn accept_in_background(
    addr: &str,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    handle: impl Fn(TcpStream) + Send + Sync + Clone + 'static,
) {
    use std::sync::atomic::Ordering;
    let listener =
        std::net::TcpListener::bind(addr).unwrap_or_else(|e| panic!("cannot bind {addr}: {e}"));
    listener
        .set_nonblocking(true)
        .unwrap_or_else(|e| panic!("cannot configure {addr}: {e}"));
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            match listener.accept() {
                Ok((stream, _)) => {
                    let handle = handle.clone();
                    std::thread::spawn(move || handle(stream));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(2)),
            }
        }
    });
}
