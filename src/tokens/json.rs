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

/// What a streamed OpenAI chat completion request must say for the model
/// to report the stream's usage (in a last event, before `[DONE]`).
const ASK_USAGE: &[u8] = br#""stream_options":{"include_usage":true},"#;

/// The body of a streamed request (`"stream": true`) made to ask for its
/// usage, when it does not already; `None` when it needs no change (not
/// streamed, already asking, not a JSON object) or cannot take one
/// (`stream_options` that is not an object: the model refuses it as it is).
/// Without `stream_options` the field is put in front, the client's bytes
/// kept as they are; with it, the body is written anew.
pub fn asking_stream_usage(body: &[u8]) -> Option<Vec<u8>> {
    let mut value: Value = serde_json::from_slice(body).ok()?;
    let object = value.as_object_mut()?;
    if object.get("stream").and_then(Value::as_bool) != Some(true) {
        return None;
    }
    match object.get_mut("stream_options") {
        None => {
            // A JSON object: its first byte that is not white space is `{`.
            let open = body.iter().position(|b| *b == b'{')?;
            let (head, rest) = body.split_at(open.checked_add(1)?);
            let mut asked = Vec::with_capacity(body.len() + ASK_USAGE.len());
            asked.extend_from_slice(head);
            asked.extend_from_slice(ASK_USAGE);
            asked.extend_from_slice(rest);
            Some(asked)
        }
        Some(Value::Object(options)) => {
            if options.get("include_usage").and_then(Value::as_bool) == Some(true) {
                return None;
            }
            options.insert("include_usage".into(), Value::Bool(true));
            serde_json::to_vec(&value).ok()
        }
        Some(_) => None,
    }
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
    fn a_stream_is_made_to_ask_for_its_usage_and_nothing_else_changes() {
        let asked = |body: &[u8]| {
            asking_stream_usage(body).map(|b| serde_json::from_slice::<Value>(&b).unwrap())
        };
        // Put in front, the client's bytes kept.
        let body = br#" {"model":"m","stream":true,"messages":[{"role":"user","content":"{hi}"}]}"#;
        let out = asking_stream_usage(body).unwrap();
        assert_eq!(
            out,
            br#" {"stream_options":{"include_usage":true},"model":"m","stream":true,"messages":[{"role":"user","content":"{hi}"}]}"#.to_vec()
        );
        // Options of its own are kept, the usage asked beside them.
        let v =
            asked(br#"{"stream":true,"stream_options":{"include_usage":false,"x":1}}"#).unwrap();
        assert_eq!(
            v["stream_options"],
            serde_json::json!({"include_usage": true, "x": 1})
        );
        // Nothing to do, or nothing that can be done.
        for body in [
            &br#"{"stream":true,"stream_options":{"include_usage":true}}"#[..],
            br#"{"stream":false}"#,
            br#"{"model":"m"}"#,
            br#"{"stream":"true"}"#,
            br#"{"stream":true,"stream_options":"yes"}"#,
            br#"[{"stream":true}]"#,
            b"not json",
            b"",
        ] {
            assert_eq!(asking_stream_usage(body), None, "{body:?}");
        }
    }

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
