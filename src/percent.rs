//! Percent-escapes (`%XX`), one rule for every decoder: exactly two hex
//! digits make an escape (`u8::from_str_radix` alone would read `%+1` as 1),
//! anything else stays as it is.

/// The byte an escape starting at `i` (at its `%`) encodes, if there is
/// one.
pub(crate) fn escaped_byte(bytes: &[u8], i: usize) -> Option<u8> {
    if bytes.get(i) != Some(&b'%') {
        return None;
    }
    let hex = bytes.get(i + 1..i + 3)?;
    if !hex.iter().all(u8::is_ascii_hexdigit) {
        return None;
    }
    u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_two_hex_digits_make_an_escape() {
        assert_eq!(escaped_byte(b"%41", 0), Some(b'A'));
        assert_eq!(escaped_byte(b"x%4a", 1), Some(b'J'));
        for not in [&b"%+1"[..], b"%-1", b"%4", b"%", b"A41", b"%g0"] {
            assert_eq!(escaped_byte(not, 0), None, "{not:?}");
        }
    }
}
