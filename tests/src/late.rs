//! A TCP proxy between the replicas and meshlimitd that can hold
//! meshlimitd's answers back: meshlimitd decides in time and sends its
//! answer, which reaches Envoy after the filter's call timed out. What
//! the filter then decides without meshlimitd was charged in Redis all the
//! same; this is how a test loses an answer after it left meshlimitd.
//!
//! Requests go on at once. Each chunk of an answer is passed on `delay`
//! (0: none) after it arrived, as on a slow link: in order, and not
//! delayed again for the chunks before it. Envoy resets a call it timed
//! out: over HTTP/2 (the meshlimit cluster's protocol) its stream, and its
//! answer, held back on the connection the next calls share, still arrives
//! ahead of theirs; over HTTP/1.1 the connection, and the answer with it.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub struct LateProxy {
    stop: Arc<AtomicBool>,
    delay_ms: Arc<AtomicU64>,
}

impl LateProxy {
    /// Listens on `addr`, forwarding to `target`.
    pub fn start(addr: &str, target: &str) -> LateProxy {
        let stop = Arc::new(AtomicBool::new(false));
        let delay_ms = Arc::new(AtomicU64::new(0));
        let (target, delay) = (target.to_string(), Arc::clone(&delay_ms));
        crate::http::accept_in_background(addr, Arc::clone(&stop), move |client| {
            forward(client, &target, &delay)
        });
        LateProxy { stop, delay_ms }
    }

    /// Holds every answer chunk back this long from now on (0: none).
    pub fn delay(&self, delay: Duration) {
        self.delay_ms
            .store(delay.as_millis() as u64, Ordering::Relaxed);
    }
}

impl Drop for LateProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Pumps `client`'s bytes to `target` at once, and the answers back after
/// the delay current when each arrives.
fn forward(client: TcpStream, target: &str, delay_ms: &Arc<AtomicU64>) {
    let Ok(server) = TcpStream::connect(target) else {
        let _ = client.shutdown(Shutdown::Both);
        return;
    };
    let (Ok(mut client_in), Ok(mut server_out)) = (client.try_clone(), server.try_clone()) else {
        return;
    };
    let requests = std::thread::spawn(move || {
        let _ = std::io::copy(&mut client_in, &mut server_out);
        let _ = server_out.shutdown(Shutdown::Write);
    });
    // Each chunk is read as it comes and stamped with when it is due; the
    // writer passes them on in order at that time.
    let (due, chunks) = std::sync::mpsc::channel::<(Instant, Vec<u8>)>();
    let mut server_in = server;
    let delays = Arc::clone(delay_ms);
    let answers = std::thread::spawn(move || {
        let mut buf = [0u8; 16 * 1024];
        loop {
            let n = match server_in.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let delay = Duration::from_millis(delays.load(Ordering::Relaxed));
            if due
                .send((Instant::now() + delay, buf[..n].to_vec()))
                .is_err()
            {
                break;
            }
        }
    });
    let mut client_out = client;
    for (at, chunk) in chunks {
        std::thread::sleep(at.saturating_duration_since(Instant::now()));
        if client_out.write_all(&chunk).is_err() {
            break;
        }
    }
    let _ = client_out.shutdown(Shutdown::Both);
    let _ = requests.join();
    let _ = answers.join();
}
