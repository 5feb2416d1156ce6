//! Who is this request from? The subject every limit is counted against.
//!
//! Subjects carry their source as a prefix (`hdr:<header>:`,
//! `qry:<parameter>:`, `ip:`, `anon`) so that an API key that happens to
//! look like an IP address, or the same value sent in two different headers,
//! can never share a counter with something else. The value itself is
//! untrusted: passed on verbatim (or hex-encoded when it is not UTF-8) while
//! the subject stays within [`MAX_PLAIN_SUBJECT`] bytes, else replaced by
//! its SHA-256 under a prefix of its own, so an id of any length or bytes is
//! just an id and what leaves the filter stays small; `meshlimitd` makes
//! it safe for keys.

use crate::config::{ClientIdConfig, WhenMissing};
use crate::host::{HeaderValue, RequestView};

/// The outcome of identifying a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    Subject(String),
    /// No configured header and `when_missing: reject`.
    Reject,
}

/// Subject shared by every anonymous request.
pub const ANONYMOUS: &str = "anon";

/// Longest subject passed on as it is; a longer one is a digest.
pub const MAX_PLAIN_SUBJECT: usize = 256;

/// Identifies the request; `path` is its `:path` (for query parameters).
pub fn identify(cfg: &ClientIdConfig, req: &impl RequestView, path: &str) -> Identity {
    for name in &cfg.headers {
        // Sent twice, an id is ambiguous and counts as missing: counting
        // the first while the upstream authenticates another would let
        // `x-api-key: victim` + `x-api-key: mine` spend the victim's quota.
        if let HeaderValue::Once(value) = req.header(name) {
            if !value.is_empty() {
                return Identity::Subject(subject("hdr", name, &value));
            }
        }
    }
    for name in &cfg.query_params {
        if let Some(value) = query_param(path, name) {
            return Identity::Subject(subject("qry", name, &value));
        }
    }
    match cfg.when_missing {
        WhenMissing::Reject => Identity::Reject,
        WhenMissing::Anonymous => Identity::Subject(ANONYMOUS.to_string()),
        WhenMissing::ClientAddress => Identity::Subject(match client_address(cfg, req) {
            Some(addr) => address_subject(&addr, cfg.ipv6_prefix),
            // No address at all (a host that hides it): one shared bucket is
            // the only bounded answer.
            None => ANONYMOUS.to_string(),
        }),
    }
}

/// `ip:<address>`: IPv4 (IPv4-mapped IPv6 too) per address, IPv6 per
/// network of `ipv6_prefix` bits (`ip:2001:db8:1:2::/64`), since one IPv6
/// client holds a whole /64 or more. Text that is no address is kept as it
/// is (a digest when long).
fn address_subject(addr: &str, ipv6_prefix: u8) -> String {
    use std::net::IpAddr;
    match addr.parse::<IpAddr>() {
        Ok(IpAddr::V4(v4)) => format!("ip:{v4}"),
        Ok(IpAddr::V6(v6)) => match v6.to_ipv4_mapped() {
            Some(v4) => format!("ip:{v4}"),
            None if ipv6_prefix >= 128 => format!("ip:{v6}"),
            None => {
                let bits = u128::from(v6);
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(ipv6_prefix))
                    .unwrap_or(0);
                let network = std::net::Ipv6Addr::from(bits & mask);
                format!("ip:{network}/{ipv6_prefix}")
            }
        },
        Err(_) if addr.len() <= MAX_ADDRESS_TEXT => format!("ip:{addr}"),
        Err(_) => format!("ip#:{}", hex(&sha256(addr.as_bytes()))),
    }
}

/// Longest address text kept as it is (an IPv6 address with a zone fits).
const MAX_ADDRESS_TEXT: usize = 64;

/// `<source>:<name>:<value>`, or `<source>x:<name>:<hex>` for a value that
/// is not UTF-8, or, when that would be longer than [`MAX_PLAIN_SUBJECT`],
/// `<source>#:<name>:<SHA-256 of the value, hex>`. The three prefixes never
/// meet (names hold no ':'), so two distinct values never share a subject.
fn subject(source: &str, name: &str, value: &[u8]) -> String {
    tagged(source, Some(name), value)
}

/// [`subject`]'s scheme for any attribute, with or without a name:
/// `host:<value>`, `hostx:<hex>`, `host#:<SHA-256>` (see
/// [`crate::subject`]).
pub(crate) fn tagged(source: &str, name: Option<&str>, value: &[u8]) -> String {
    let text = std::str::from_utf8(value).ok();
    let encoded_len = text.map_or(value.len() * 2 + 1, str::len);
    // Built by hand, not with `format!`: this runs for every request, and
    // the formatting machinery was a tenth of planning one.
    let label_len = source.len() + 1 + name.map_or(0, |n| n.len() + 1);
    let label = |marker: &str, rest: usize| {
        let mut out = String::with_capacity(label_len + marker.len() + rest);
        out.push_str(source);
        out.push_str(marker);
        out.push(':');
        if let Some(name) = name {
            out.push_str(name);
            out.push(':');
        }
        out
    };
    if label_len + encoded_len > MAX_PLAIN_SUBJECT {
        return label("#", 64) + &hex(&sha256(value));
    }
    match text {
        Some(text) => label("", text.len()) + text,
        // Distinct prefix keeps the mapping one-to-one: a UTF-8 value can
        // never render as the hex of another value.
        None => label("x", value.len() * 2) + &hex(value),
    }
}

/// The value inside a client-id subject as the client sent it
/// (`partner-a` of `hdr:x-api-key:partner-a`, `10.0.0.1` of
/// `ip:10.0.0.1`); the subject itself for digests and `anon`.
pub(crate) fn bare_value(subject: &str) -> &str {
    if let Some(rest) = subject
        .strip_prefix("hdr:")
        .or_else(|| subject.strip_prefix("qry:"))
    {
        return rest.split_once(':').map_or(subject, |(_, v)| v);
    }
    subject.strip_prefix("ip:").unwrap_or(subject)
}

pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    hex(&sha256(bytes))
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    Sha256::digest(bytes).into()
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(out, "{b:02x}");
    }
    out
}

/// The decoded value of query parameter `name`, when it appears exactly
/// once with a non-empty value. Names and values are percent-decoded (and
/// `+` read as a space, as forms send it), so `key=abc` and `key=%61bc`
/// are one client, as they are to the upstream that reads the key. A
/// parameter given twice is treated as missing: counting the first while
/// the upstream authenticates the last would let `key=victim&key=mine`
/// spend the victim's quota.
pub(crate) fn query_param(path: &str, name: &str) -> Option<Vec<u8>> {
    let query = path.split('#').next()?.split_once('?')?.1;
    let mut found = None;
    for pair in query.split('&') {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        if percent_decode(key) != name.as_bytes() {
            continue;
        }
        if found.is_some() {
            return None;
        }
        found = Some(percent_decode(value));
    }
    found.filter(|v| !v.is_empty())
}

/// `%XX` escapes and `+`; a malformed escape stays as it is.
fn percent_decode(text: &str) -> Vec<u8> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        let escaped = crate::percent::escaped_byte(bytes, i);
        match escaped {
            Some(decoded) => {
                out.push(decoded);
                i += 3;
            }
            None => {
                out.push(if b == b'+' { b' ' } else { b });
                i += 1;
            }
        }
    }
    out
}

/// The client address: with `trusted_hops = 0`, the peer address; otherwise
/// the right-most `x-forwarded-for` entry not added by one of our trusted
/// proxies. Entries further left are client-controlled and never used.
fn client_address(cfg: &ClientIdConfig, req: &impl RequestView) -> Option<String> {
    if cfg.trusted_hops > 0 {
        // Several x-forwarded-for headers are one list, in order.
        let xff = req.header_values("x-forwarded-for");
        if !xff.is_empty() {
            let text = xff
                .iter()
                .map(|v| String::from_utf8_lossy(v))
                .collect::<Vec<_>>()
                .join(",");
            let hops: Vec<&str> = text.split(',').map(str::trim).collect();
            let n = cfg.trusted_hops as usize;
            if hops.len() >= n {
                if let Some(hop) = hops.get(hops.len() - n) {
                    if !hop.is_empty() {
                        // Some proxies write `address:port`: one client,
                        // whatever its source port.
                        return Some(strip_port(hop).to_string());
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
            query_params: Vec::new(),
            when_missing,
            trusted_hops,
            reject_status: 401,
            ipv6_prefix: 128,
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
        assert_eq!(identify(&c, &both, "/"), subject("hdr:x-api-key:k1"));
        let second = FakeRequest::default().with_header("x-client-id", b"legacy");
        assert_eq!(
            identify(&c, &second, "/"),
            subject("hdr:x-client-id:legacy")
        );
    }

    #[test]
    fn empty_header_counts_as_missing() {
        let c = cfg(&["x-api-key"], WhenMissing::Anonymous, 0);
        let req = FakeRequest::default().with_header("x-api-key", b"");
        assert_eq!(identify(&c, &req, "/"), subject("anon"));
    }

    #[test]
    fn when_missing_modes() {
        let req = FakeRequest::default().from_source("10.1.2.3:4567");
        assert_eq!(
            identify(&cfg(&["x"], WhenMissing::Reject, 0), &req, "/"),
            Identity::Reject
        );
        assert_eq!(
            identify(&cfg(&["x"], WhenMissing::Anonymous, 0), &req, "/"),
            subject("anon")
        );
        assert_eq!(
            identify(&cfg(&["x"], WhenMissing::ClientAddress, 0), &req, "/"),
            subject("ip:10.1.2.3")
        );
        let nothing = FakeRequest::default();
        assert_eq!(
            identify(&cfg(&[], WhenMissing::ClientAddress, 0), &nothing, "/"),
            subject("anon")
        );
    }

    #[test]
    fn forwarded_for_takes_rightmost_untrusted_hop() {
        let req = FakeRequest::default()
            .from_source("127.0.0.9:1000")
            .with_header("x-forwarded-for", b"6.6.6.6, 1.1.1.1, 2.2.2.2");
        let id = |hops| identify(&cfg(&[], WhenMissing::ClientAddress, hops), &req, "/");
        assert_eq!(id(0), subject("ip:127.0.0.9"));
        assert_eq!(id(1), subject("ip:2.2.2.2"));
        assert_eq!(id(2), subject("ip:1.1.1.1"));
        assert_eq!(id(3), subject("ip:6.6.6.6"));
        // Fewer hops than trusted proxies: the header was not built by our
        // proxies, so it is ignored.
        assert_eq!(id(4), subject("ip:127.0.0.9"));
    }

    #[test]
    fn forwarded_for_entries_lose_their_ports() {
        let req = |xff: &[u8]| {
            FakeRequest::default()
                .from_source("127.0.0.9:1000")
                .with_header("x-forwarded-for", xff)
        };
        let id = |r| identify(&cfg(&[], WhenMissing::ClientAddress, 1), &r, "/");
        // One client, whatever source port its proxy wrote down.
        assert_eq!(id(req(b"1.1.1.1, 2.2.2.2:5555")), subject("ip:2.2.2.2"));
        assert_eq!(id(req(b"[2001:db8::7]:443")), subject("ip:2001:db8::7"));
        assert_eq!(id(req(b"2001:db8::7")), subject("ip:2001:db8::7"));
    }

    /// An IPv6 client holds a /64 (or more): per /128 it could rotate
    /// through 2^64 addresses, a fresh quota each.
    #[test]
    fn ipv6_clients_are_limited_per_prefix() {
        let mut c = cfg(&[], WhenMissing::ClientAddress, 0);
        c.ipv6_prefix = 64;
        let from = |a: &str| identify(&c, &FakeRequest::default().from_source(a), "/");
        assert_eq!(
            from("[2001:db8:1:2:aaaa::1]:80"),
            subject("ip:2001:db8:1:2::/64")
        );
        assert_eq!(
            from("[2001:db8:1:2:bbbb::9]:80"),
            from("[2001:db8:1:2::5]:1")
        );
        assert_ne!(from("[2001:db8:1:3::1]:80"), from("[2001:db8:1:2::1]:80"));
        // IPv4, and IPv4-mapped IPv6, stay per address.
        assert_eq!(from("10.0.0.1:80"), subject("ip:10.0.0.1"));
        assert_eq!(from("[::ffff:10.0.0.1]:80"), subject("ip:10.0.0.1"));
        c.ipv6_prefix = 48;
        let from = |a: &str| identify(&c, &FakeRequest::default().from_source(a), "/");
        assert_eq!(from("[2001:db8:1:2::1]:80"), subject("ip:2001:db8:1::/48"));
        // Not an address (a broken header): used as it is, still bounded.
        c.ipv6_prefix = 64;
        let req = FakeRequest::default()
            .from_source("127.0.0.9:1000")
            .with_header("x-forwarded-for", b"not-an-ip");
        assert_eq!(
            identify(&cfg(&[], WhenMissing::ClientAddress, 1), &req, "/"),
            subject("ip:not-an-ip")
        );
    }

    #[test]
    fn repeated_id_headers_count_as_missing_and_forwarded_for_is_one_list() {
        let c = cfg(&["x-api-key", "x-user"], WhenMissing::Reject, 0);
        let req = FakeRequest::default()
            .with_header("x-api-key", b"victim")
            .with_header("x-api-key", b"mine");
        assert_eq!(identify(&c, &req, "/"), Identity::Reject);
        let req = req.with_header("x-user", b"u1");
        assert_eq!(identify(&c, &req, "/"), subject("hdr:x-user:u1"));
        let req = FakeRequest::default()
            .from_source("127.0.0.9:1000")
            .with_header("x-forwarded-for", b"6.6.6.6, 1.1.1.1")
            .with_header("x-forwarded-for", b"2.2.2.2");
        let id = |hops| identify(&cfg(&[], WhenMissing::ClientAddress, hops), &req, "/");
        assert_eq!(id(1), subject("ip:2.2.2.2"));
        assert_eq!(id(2), subject("ip:1.1.1.1"));
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
        let id = |v: &[u8]| identify(&c, &FakeRequest::default().with_header("x-api-key", v), "/");
        assert_eq!(id(b"{a}"), subject("hdr:x-api-key:{a}"));
        assert_ne!(id(b"a"), id(b"{a}"));
        // Not UTF-8: hex under its own prefix, never equal to a UTF-8 value.
        assert_eq!(id(&[0xff, 0x01]), subject("hdrx:x-api-key:ff01"));
        assert_ne!(id(&[0xff, 0x01]), id(b"ff01"));
        // A long id is still an id, reduced to a digest of fixed length
        // (it used to be passed on whole: 16 KiB then, 66 KB of hex for
        // 33,000 non-UTF-8 bytes, which meshlimitd refused with the batch).
        let big = vec![b'z'; 16 * 1024];
        let Identity::Subject(s) = id(&big) else {
            panic!("a long id is still an id")
        };
        assert_eq!(s.len(), "hdr#:x-api-key:".len() + 64);
        assert!(s.starts_with("hdr#:x-api-key:"));
        let Identity::Subject(hostile) = id(&vec![0xff; 33_000]) else {
            panic!("a long id is still an id")
        };
        assert!(hostile.starts_with("hdr#:x-api-key:") && hostile.len() <= MAX_PLAIN_SUBJECT);
        assert_ne!(id(&big), id(&[b'z'; 16 * 1024 - 1]));
        // Right at the bound, still plain.
        let fits = vec![b'k'; MAX_PLAIN_SUBJECT - "hdr:x-api-key:".len()];
        assert_eq!(
            id(&fits),
            subject(&format!("hdr:x-api-key:{}", "k".repeat(fits.len())))
        );
    }

    #[test]
    fn same_value_in_different_headers_is_a_different_subject() {
        let c = cfg(&["x-api-key", "x-client-id"], WhenMissing::Reject, 0);
        let a = identify(
            &c,
            &FakeRequest::default().with_header("x-api-key", b"v"),
            "/",
        );
        let b = identify(
            &c,
            &FakeRequest::default().with_header("x-client-id", b"v"),
            "/",
        );
        assert_ne!(a, b);
    }

    fn by_param(names: &[&str], when_missing: WhenMissing) -> ClientIdConfig {
        ClientIdConfig {
            query_params: names.iter().map(|n| n.to_string()).collect(),
            ..cfg(&[], when_missing, 0)
        }
    }

    #[test]
    fn query_parameters_identify_after_headers() {
        let c = ClientIdConfig {
            headers: vec!["x-api-key".into()],
            ..by_param(&["api_key", "key"], WhenMissing::Anonymous)
        };
        let plain = FakeRequest::default();
        let id = |req: &FakeRequest, path: &str| identify(&c, req, path);
        assert_eq!(id(&plain, "/v1?key=k1"), subject("qry:key:k1"));
        assert_eq!(
            id(&plain, "/v1?key=k1&api_key=k2"),
            subject("qry:api_key:k2"),
            "parameters are tried in config order"
        );
        assert_eq!(
            id(&plain.clone().with_header("x-api-key", b"h"), "/?key=k1"),
            subject("hdr:x-api-key:h"),
            "headers first"
        );
        assert_eq!(id(&plain, "/v1?other=1"), subject("anon"));
        assert_eq!(id(&plain, "/v1?key="), subject("anon"), "empty is missing");
        assert_eq!(id(&plain, "/v1?key"), subject("anon"));
        assert_eq!(id(&plain, "/v1#?key=k1"), subject("anon"), "fragment");
        assert_eq!(id(&plain, "/v1?a=1&key=k1#x"), subject("qry:key:k1"));
        assert_ne!(
            id(&plain, "/?key=v"),
            identify(&c, &plain.clone().with_header("x-api-key", b"v"), "/"),
            "a header and a parameter never share a counter"
        );
    }

    #[test]
    fn only_two_hex_digits_make_an_escape() {
        // `from_str_radix` reads "+1" as 1: "%+1" is not an escape.
        assert_eq!(percent_decode("%+1"), b"% 1");
        assert_eq!(percent_decode("%-1"), b"%-1");
        assert_eq!(percent_decode("%41%4a%4A"), b"AJJ");
        assert_eq!(percent_decode("%4"), b"%4");
    }

    #[test]
    fn query_parameters_are_decoded_so_one_key_is_one_client() {
        let c = by_param(&["key"], WhenMissing::Reject);
        let id = |path: &str| identify(&c, &FakeRequest::default(), path);
        assert_eq!(id("/?key=abc"), id("/?key=%61bc"));
        assert_eq!(id("/?k%65y=abc"), subject("qry:key:abc"));
        assert_eq!(id("/?key=a+b"), subject("qry:key:a b"));
        assert_eq!(id("/?key=a%2Bb"), subject("qry:key:a+b"));
        assert_eq!(id("/?key=%zz%4"), subject("qry:key:%zz%4"), "malformed");
        assert_eq!(id("/?key=%ff%01"), subject("qryx:key:ff01"));
        assert_eq!(id("/?key=%7Ba%7D"), subject("qry:key:{a}"));
    }

    #[test]
    fn a_repeated_parameter_is_ambiguous_and_counts_as_missing() {
        let c = by_param(&["key"], WhenMissing::Reject);
        let id = |path: &str| identify(&c, &FakeRequest::default(), path);
        assert_eq!(id("/?key=victim&key=mine"), Identity::Reject);
        assert_eq!(id("/?key=a&k%65y=a"), Identity::Reject);
    }
}

#[cfg(test)]
mod proptests {
    use super::*;
    use crate::host::fake::FakeRequest;
    use proptest::prelude::*;

    fn by_key() -> ClientIdConfig {
        ClientIdConfig {
            headers: Vec::new(),
            query_params: vec!["key".into()],
            when_missing: WhenMissing::Reject,
            trusted_hops: 0,
            reject_status: 401,
            ipv6_prefix: 64,
        }
    }

    fn percent_encode(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("%{b:02X}")).collect()
    }

    proptest! {
        #[test]
        fn any_path_is_identified_or_refused_never_a_panic(path in "\\PC{0,80}") {
            let _ = identify(&by_key(), &FakeRequest::default(), &path);
        }

        #[test]
        fn any_value_survives_encoding_as_itself(
            value in prop::collection::vec(any::<u8>(), 1..40),
            before in "[a-z]{0,5}=[a-z0-9]{0,5}",
        ) {
            prop_assume!(!before.starts_with("key="));
            let path = format!("/x?{before}&key={}", percent_encode(&value));
            let expected = subject("qry", "key", &value);
            prop_assert_eq!(
                identify(&by_key(), &FakeRequest::default(), &path),
                Identity::Subject(expected)
            );
        }

        #[test]
        fn distinct_values_are_distinct_clients(
            a in prop::collection::vec(any::<u8>(), 1..20),
            b in prop::collection::vec(any::<u8>(), 1..20),
        ) {
            prop_assume!(a != b);
            let id = |v: &[u8]| identify(
                &by_key(),
                &FakeRequest::default(),
                &format!("/?key={}", percent_encode(v)),
            );
            prop_assert_ne!(id(&a), id(&b));
        }
    }
}
