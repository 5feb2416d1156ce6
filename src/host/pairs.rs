//! The proxy-wasm encoding of a header map ("pairs"), decoded without
//! trusting it: the SDK's own decoder indexes and unwraps, and a malformed
//! or truncated map would trap the VM.
//!
//! Layout: a little-endian u32 count `n`; then `n` pairs of u32 sizes
//! (name, value); then each name and each value in order, each followed by
//! a NUL byte.

/// The decoded pairs, or `None` when the bytes do not hold a whole map.
pub fn decode(bytes: &[u8]) -> Option<Vec<(String, Vec<u8>)>> {
    if bytes.is_empty() {
        return Some(Vec::new());
    }
    let word = |at: usize| -> Option<usize> {
        let b = bytes.get(at..at.checked_add(4)?)?;
        Some(u32::from_le_bytes(<[u8; 4]>::try_from(b).ok()?) as usize)
    };
    let n = word(0)?;
    // Each pair takes at least 8 bytes of sizes and 2 NULs.
    if n > bytes.len() / 10 {
        return None;
    }
    let mut data = 4 + n * 8;
    let mut pairs = Vec::with_capacity(n);
    for i in 0..n {
        let name_len = word(4 + i * 8)?;
        let value_len = word(8 + i * 8)?;
        let (name, after) = field(bytes, data, name_len)?;
        let (value, after) = field(bytes, after, value_len)?;
        data = after;
        pairs.push((String::from_utf8_lossy(name).into_owned(), value.to_vec()));
    }
    Some(pairs)
}

/// `len` bytes at `at` and their NUL terminator; the bytes and where the
/// next field starts.
fn field(bytes: &[u8], at: usize, len: usize) -> Option<(&[u8], usize)> {
    let end = at.checked_add(len)?;
    (bytes.get(end) == Some(&0)).then_some(())?;
    Some((bytes.get(at..end)?, end + 1))
}

/// The encoding [`decode`] reads (for tests and the fake host).
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
        let decoded = decode(&encode(pairs)).unwrap();
        assert_eq!(decoded.len(), 4);
        assert_eq!(decoded[2], ("x-api-key".to_string(), vec![0xff, 0, 0xfe]));
        assert_eq!(decode(&[]), Some(Vec::new()));
    }

    #[test]
    fn truncated_or_lying_maps_are_refused() {
        let good = encode(&[("a", b"b")]);
        for cut in 1..good.len() {
            assert_eq!(decode(&good[..cut]), None, "cut at {cut}");
        }
        let mut huge = good.clone();
        huge[0..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode(&huge), None);
        let mut long = good;
        long[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode(&long), None);
    }

    proptest! {
        #[test]
        fn any_bytes_decode_or_are_refused_never_a_panic(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode(&bytes);
        }
    }
}
