//! The proxy-wasm encoding of a header map ("pairs"), decoded without
//! trusting it: the SDK's own decoder indexes and unwraps, and a malformed
//! or truncated map would trap the VM.
//!
//! Layout: a little-endian u32 count `n`; then `n` pairs of u32 sizes
//! (name, value); then each name and each value in order, each followed by
//! a NUL byte.

/// A header map as the host sent it, kept whole and checked once: its
/// headers are then found by walking the sizes at the front of the bytes.
/// Reading a request's headers is one allocation, the host's buffer: no
/// copy per header (measured in Envoy, decoding into owned pairs cost about
/// as much as the hostcall that fetched them), and no index (a request has
/// a few headers, and the walk is a few additions each).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeaderMap {
    /// Checked by [`HeaderMap::parse`]: a whole map (empty when there are
    /// no headers).
    bytes: Vec<u8>,
}

/// The little-endian u32 at `at` in `bytes`.
fn word(bytes: &[u8], at: usize) -> Option<usize> {
    let b = bytes.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes(<[u8; 4]>::try_from(b).ok()?) as usize)
}

impl HeaderMap {
    /// The map in `bytes`, or `None` when they do not hold a whole map.
    pub fn parse(bytes: Vec<u8>) -> Option<HeaderMap> {
        if bytes.is_empty() {
            return Some(HeaderMap::default());
        }
        let n = word(&bytes, 0)?;
        // Each pair takes at least 8 bytes of sizes and 2 NULs.
        if n > bytes.len() / 10 {
            return None;
        }
        let map = HeaderMap { bytes };
        // Every field checked here, so that a walk never stops early.
        (map.iter().count() == n).then_some(map)
    }

    /// Every header, in order: name and value, walked from the sizes; stops
    /// at the first field that is not where its size says (never, once
    /// parsed).
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> + '_ {
        let bytes = self.bytes.as_slice();
        let n = word(bytes, 0).unwrap_or(0);
        let mut data = 4usize.saturating_add(n.saturating_mul(8));
        (0..n).map_while(move |i| {
            let name_len = word(bytes, 4 + i * 8)?;
            let value_len = word(bytes, 8 + i * 8)?;
            let name_end = field(bytes, data, name_len)?;
            let value_end = field(bytes, name_end + 1, value_len)?;
            let pair = (
                bytes.get(data..name_end)?,
                bytes.get(name_end + 1..value_end)?,
            );
            data = value_end + 1;
            Some(pair)
        })
    }

    /// The map holding `pairs` (tests and the fake host).
    pub fn from_pairs(pairs: &[(&str, &[u8])]) -> HeaderMap {
        HeaderMap::parse(encode(pairs)).unwrap_or_default()
    }

    /// Every value of header `name`, in order.
    pub fn values<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.iter()
            .filter(move |(n, _)| *n == name.as_bytes())
            .map(|(_, v)| v)
    }

    /// The first value of header `name`.
    pub fn first(&self, name: &str) -> Option<&[u8]> {
        self.iter()
            .find(|(n, _)| *n == name.as_bytes())
            .map(|(_, v)| v)
    }

    pub fn len(&self) -> usize {
        word(&self.bytes, 0).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Checks that `len` bytes at `at` are followed by their NUL terminator;
/// where the field ends (the NUL's index).
fn field(bytes: &[u8], at: usize, len: usize) -> Option<usize> {
    let end = at.checked_add(len)?;
    (bytes.get(end) == Some(&0)).then_some(end)
}

/// The encoding [`HeaderMap::parse`] reads (for tests and the fake host).
pub fn encode(pairs: &[(&str, &[u8])]) -> Vec<u8> {
    let mut out = (pairs.len() as u32).to_le_bytes().to_vec();
    for (name, value) in pairs {
        out.extend_from_slice(&(name.len() as u32).to_le_bytes());
        out.extend_from_slice(&(value.len() as u32).to_le_bytes());
    }
    for (name, value) in pairs {
        out.extend_from_slice(name.as_bytes());
        out.push(0);
        out.extend_from_slice(value);
        out.push(0);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn pairs_round_trip_including_repeats_and_binary_values() {
        let pairs: &[(&str, &[u8])] = &[
            (":path", b"/api/x"),
            ("x-api-key", b"victim"),
            ("x-api-key", &[0xff, 0, 0xfe]),
            ("empty", b""),
        ];
        let map = HeaderMap::parse(encode(pairs)).unwrap();
        assert_eq!(map.len(), 4);
        assert_eq!(
            map.iter().nth(2),
            Some((&b"x-api-key"[..], &[0xff, 0, 0xfe][..]))
        );
        let keys: Vec<&[u8]> = map.values("x-api-key").collect();
        assert_eq!(keys, [&b"victim"[..], &[0xff, 0, 0xfe][..]]);
        assert_eq!(map.first("empty"), Some(&b""[..]));
        assert_eq!(map.first("absent"), None);
        assert!(HeaderMap::parse(Vec::new()).unwrap().is_empty());
    }

    #[test]
    fn truncated_or_lying_maps_are_refused() {
        let good = encode(&[("a", b"b")]);
        for cut in 1..good.len() {
            assert_eq!(HeaderMap::parse(good[..cut].to_vec()), None, "cut at {cut}");
        }
        let mut huge = good.clone();
        huge[0..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(HeaderMap::parse(huge), None);
        let mut long = good;
        long[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(HeaderMap::parse(long), None);
    }

    proptest! {
        #[test]
        fn any_bytes_decode_or_are_refused_never_a_panic(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
            if let Some(map) = HeaderMap::parse(bytes) {
                for (name, value) in map.iter() {
                    let _ = (name.len(), value.len());
                }
            }
        }
    }
}
