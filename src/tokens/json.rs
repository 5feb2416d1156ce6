//! A whole number at a dotted path (`usage.total_tokens`) of a JSON body.

use serde_json::Value;

/// The non-negative integer at `path` in `value`, if there is one.
pub fn number_at(value: &Value, path: &[String]) -> Option<u64> {
    path.iter()
        .try_fold(value, |v, key| v.get(key.as_str()))
        .and_then(Value::as_u64)
}

/// The number at `path` in a JSON `body`; `None` when the body is not
/// JSON or has no whole number there.
pub fn body_number(body: &[u8], path: &[String]) -> Option<u64> {
    let value: Value = serde_json::from_slice(body).ok()?;
    number_at(&value, path)
}

/// A dotted path as the configuration splits it.
#[cfg(test)]
pub fn path(dotted: &str) -> Vec<String> {
    dotted.split('.').map(str::to_string).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_found_at_their_path_and_nothing_else_is_a_number() {
        let p = path("usage.total_tokens");
        assert_eq!(
            body_number(br#"{"usage":{"total_tokens":42}}"#, &p),
            Some(42)
        );
        for body in [
            &br#"{"usage":{"total_tokens":-1}}"#[..],
            br#"{"usage":{"total_tokens":"42"}}"#,
            br#"{"usage":{"total_tokens":4.5}}"#,
            br#"{"usage":{}}"#,
            br#"{"usage":7}"#,
            b"not json",
            b"",
        ] {
            assert_eq!(body_number(body, &p), None, "{body:?}");
        }
    }
}
