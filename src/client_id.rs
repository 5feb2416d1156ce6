//! Who is this request from? The subject every limit is counted against.
//!
//! Subjects carry their source as a prefix (`hdr:<header>:`, `ip:`, `anon`)
//! so that an API key that happens to look like an IP address, or the same
//! value sent in two different headers, can never share a counter with
//! something else. The value itself is untrusted and passed on verbatim (or
//! hex-encoded when it is not UTF-8); `meshlimitd` makes it safe for keys.

use crate::config::{ClientIdConfig, WhenMissing};
use crate::host::RequestView;

/// The outcome of identifying a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    Subject(String),
    /// No configured header and `when_missing: reject`.
    Reject,
}

/// Subject shared by every anonymous request.
pub const ANONYMOUS: &str = "anon";

pub fn identify(cfg: &ClientIdConfig, req: &impl RequestView) -> Identity {
    for name in &cfg.headers {
        if let Some(value) = req.header(name) {
            if !value.is_empty() {
                return Identity::Subject(header_subject(name, &value));
            }
        }
    }
    match cfg.when_missing {
        WhenMissing::Reject => Identity::Reject,
        WhenMissing::Anonymous => Identity::Subject(ANONYMOUS.to_string()),
        WhenMissing::ClientAddress => Identity::Subject(match client_address(cfg, req) {
            Some(addr) => format!("ip:{addr}"),
            // No address at all (a host that hides it): one shared bucket is
            // the only bounded answer.
            None => ANONYMOUS.to_string(),
        }),
    }
}

fn header_subject(name: &str, value: &[u8]) -> String {
    match std::str::from_utf8(value) {
        Ok(text) => format!("hdr:{name}:{text}"),
        // Distinct prefix keeps the mapping one-to-one: a UTF-8 value can
        // never render as the hex of another value.
        Err(_) => {
            let mut out = String::with_capacity(name.len() + 6 + value.len() * 2);
            out.push_str("hdrx:");
            out.push_str(name);
            out.push(':');
            for b in value {
                out.push_str(&format!("{b:02x}"));
            }
            out
        }
    }
}

/// The client address: with `trusted_hops = 0`, the peer address; otherwise
/// the right-most `x-forwarded-for` entry not added by one of our trusted
/// proxies. Entries further left are client-controlled and never used.
fn client_address(cfg: &ClientIdConfig, req: &impl RequestView) -> Option<String> {
    if cfg.trusted_hops > 0 {
        if let Some(xff) = req.header("x-forwarded-for") {
            let text = String::from_utf8_lossy(&xff);
            let hops: Vec<&str> = text.split(',').map(str::trim).collect();
            let n = cfg.trusted_hops as usize;
            if hops.len() >= n {
                if let Some(hop) = hops.get(hops.len() - n) {
                    if !hop.is_empty() {
                        return Some((*hop).to_string());
                    }
                }
            }
        }
    }
    req.source_address().map(|a| strip_port(&a).to_string())
}

/// `10.0.0.1:5555` -> `10.0.0.1`, `[::1]:80` -> `::1`.
fn strip_port(addr: &str) -> &str {
    if let Some(rest) = addr.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match addr.rsplit_once(':') {
        // A bare IPv6 address has several colons and no port.
        Some((host, _)) if !host.contains(':') => host,
        _ => addr,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::fake::FakeRequest;

    fn cfg(headers: &[&str], when_missing: WhenMissing, trusted_hops: u32) -> ClientIdConfig {
        ClientIdConfig {
            headers: headers.iter().map(|h| h.to_string()).collect(),
            when_missing,
            trusted_hops,
            reject_status: 401,
        }
    }

    fn subject(s: &str) -> Identity {
        Identity::Subject(s.to_string())
    }

    #[test]
    fn first_present_header_wins() {
        let c = cfg(&["x-api-key", "x-client-id"], WhenMissing::Reject, 0);
        let both = FakeRequest::default()
            .with_header("x-client-id", b"legacy")
            .with_header("x-api-key", b"k1");
        assert_eq!(identify(&c, &both), subject("hdr:x-api-key:k1"));
        let second = FakeRequest::default().with_header("x-client-id", b"legacy");
        assert_eq!(identify(&c, &second), subject("hdr:x-client-id:legacy"));
    }

    #[test]
    fn empty_header_counts_as_missing() {
        let c = cfg(&["x-api-key"], WhenMissing::Anonymous, 0);
        let req = FakeRequest::default().with_header("x-api-key", b"");
        assert_eq!(identify(&c, &req), subject("anon"));
    }

    #[test]
    fn when_missing_modes() {
        let req = FakeRequest::default().from_source("10.1.2.3:4567");
        assert_eq!(
            identify(&cfg(&["x"], WhenMissing::Reject, 0), &req),
            Identity::Reject
        );
        assert_eq!(
            identify(&cfg(&["x"], WhenMissing::Anonymous, 0), &req),
            subject("anon")
        );
        assert_eq!(
            identify(&cfg(&["x"], WhenMissing::ClientAddress, 0), &req),
            subject("ip:10.1.2.3")
        );
        let nothing = FakeRequest::default();
        assert_eq!(
            identify(&cfg(&[], WhenMissing::ClientAddress, 0), &nothing),
            subject("anon")
        );
    }

    #[test]
    fn forwarded_for_takes_rightmost_untrusted_hop() {
        let req = FakeRequest::default()
            .from_source("127.0.0.9:1000")
            .with_header("x-forwarded-for", b"6.6.6.6, 1.1.1.1, 2.2.2.2");
        let id = |hops| identify(&cfg(&[], WhenMissing::ClientAddress, hops), &req);
        assert_eq!(id(0), subject("ip:127.0.0.9"));
        assert_eq!(id(1), subject("ip:2.2.2.2"));
        assert_eq!(id(2), subject("ip:1.1.1.1"));
        assert_eq!(id(3), subject("ip:6.6.6.6"));
        // Fewer hops than trusted proxies: the header was not built by our
        // proxies, so it is ignored.
        assert_eq!(id(4), subject("ip:127.0.0.9"));
    }

    #[test]
    fn ports_are_stripped_from_addresses() {
        assert_eq!(strip_port("10.0.0.1:80"), "10.0.0.1");
        assert_eq!(strip_port("[::1]:80"), "::1");
        assert_eq!(strip_port("::1"), "::1");
        assert_eq!(strip_port("10.0.0.1"), "10.0.0.1");
    }

    #[test]
    fn hostile_values_stay_distinct() {
        let c = cfg(&["x-api-key"], WhenMissing::Reject, 0);
        let id = |v: &[u8]| identify(&c, &FakeRequest::default().with_header("x-api-key", v));
        assert_eq!(id(b"{a}"), subject("hdr:x-api-key:{a}"));
        assert_ne!(id(b"a"), id(b"{a}"));
        // Not UTF-8: hex under its own prefix, never equal to a UTF-8 value.
        assert_eq!(id(&[0xff, 0x01]), subject("hdrx:x-api-key:ff01"));
        assert_ne!(id(&[0xff, 0x01]), id(b"ff01"));
        let big = vec![b'z'; 16 * 1024];
        match id(&big) {
            Identity::Subject(s) => assert_eq!(s.len(), 16 * 1024 + "hdr:x-api-key:".len()),
            Identity::Reject => panic!("a long id is still an id"),
        }
    }

    #[test]
    fn same_value_in_different_headers_is_a_different_subject() {
        let c = cfg(&["x-api-key", "x-client-id"], WhenMissing::Reject, 0);
        let a = identify(&c, &FakeRequest::default().with_header("x-api-key", b"v"));
        let b = identify(&c, &FakeRequest::default().with_header("x-client-id", b"v"));
        assert_ne!(a, b);
    }
}
