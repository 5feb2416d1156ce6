//! Durations as operators write them: `"250ms"`, `"60s"`, `"5m"`, `"1h"`, `"1d"`.
//!
//! A bare number is refused on purpose: `"60"` could mean seconds or
//! milliseconds, and a silent factor of 1000 in a rate limit is exactly the
//! kind of mistake config validation is for.

use std::fmt;

/// Why a duration string was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DurationError(String);

impl fmt::Display for DurationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Parses a duration into milliseconds. Zero is allowed here; callers that
/// need a positive duration say so in their own error.
pub fn parse_millis(text: &str) -> Result<u64, DurationError> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| DurationError(format!("\"{text}\" has no unit (use ms, s, m, h or d)")))?;
    let (digits, unit) = text.split_at(split);
    if digits.is_empty() {
        return Err(DurationError(format!(
            "\"{text}\" must start with a whole number, e.g. \"60s\""
        )));
    }
    let value: u64 = digits
        .parse()
        .map_err(|_| DurationError(format!("\"{text}\" is too large")))?;
    let factor: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => {
            return Err(DurationError(format!(
                "\"{text}\" has unknown unit \"{unit}\" (use ms, s, m, h or d)"
            )))
        }
    };
    value
        .checked_mul(factor)
        .ok_or_else(|| DurationError(format!("\"{text}\" is too large")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_unit() {
        assert_eq!(parse_millis("250ms"), Ok(250));
        assert_eq!(parse_millis("60s"), Ok(60_000));
        assert_eq!(parse_millis("5m"), Ok(300_000));
        assert_eq!(parse_millis("1h"), Ok(3_600_000));
        assert_eq!(parse_millis("2d"), Ok(172_800_000));
        assert_eq!(parse_millis(" 0s "), Ok(0));
    }

    #[test]
    fn refuses_ambiguous_or_broken_input() {
        for bad in [
            "60",
            "",
            "s",
            "-5s",
            "1.5s",
            "10 s",
            "10sec",
            "1h30m",
            "99999999999999999999s",
        ] {
            assert!(parse_millis(bad).is_err(), "{bad} should be refused");
        }
        assert!(parse_millis("60")
            .unwrap_err()
            .to_string()
            .contains("no unit"));
    }

    #[test]
    fn overflow_is_an_error_not_a_wrap() {
        assert!(parse_millis("18446744073709551615d").is_err());
    }
}

#[cfg(test)]
mod proptests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn any_text_is_parsed_or_refused_never_a_panic(text in "\\PC{0,40}") {
            let _ = parse_millis(&text);
        }

        #[test]
        fn number_and_unit_round_trip(n in 0u64..1_000_000, unit in prop::sample::select(vec![("ms", 1u64), ("s", 1_000), ("m", 60_000), ("h", 3_600_000), ("d", 86_400_000)])) {
            prop_assert_eq!(parse_millis(&format!("{n}{}", unit.0)), Ok(n * unit.1));
        }
    }
}
