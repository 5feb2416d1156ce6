//! Redis key layout.
//!
//! ```text
//! <prefix>{<tag>}:<rule>/<limit>:<algorithm>:<window_ms or calendar>
//! ml:{e:hdr:x-api-key:alice}:api/per-minute:fw:60000
//! ml:{h:3f1c…(64 hex)}:api/per-minute:fw:60000
//! ml:{e:hdr:x-api-key:alice}:api/monthly:fw:month+120
//! ml:{e:hdr:x-api-key:alice}:api/per-minute:ovr      (a live override)
//! ml:{e:hdr:x-api-key:alice}:epoch                   (its counters' epoch)
//! ml:{e:hdr:x-api-key:alice}:grant:00000000000004d2   (a lease grant's record)
//! ml:{e:hdr:x-api-key:alice}:settled:00000000000004d2 (a settlement applied)
//! ```
//!
//! The subject is client input, so it never reaches a key as is. The tag is
//! either `e:` + the subject percent-encoded (short, plain ids stay readable
//! for operators) or `h:` + the SHA-256 of the subject (long or exotic ids).
//! Percent-encoding escapes `{`, `}`, `%`, control bytes and everything
//! outside a small safe set, so no client can end the hash tag early and
//! choose a Redis Cluster slot; the two prefixes cannot produce the same
//! tag; and no id makes a key longer than about 100 bytes plus the names.
//! All keys of one subject share its tag, hence one slot, hence one script.

use meshlimit_protocol::Limit;
use sha2::{Digest, Sha256};

/// Longest escaped subject kept readable; longer ones are hashed.
const MAX_ESCAPED_LEN: usize = 64;

/// The hash tag content for a subject (without the braces).
pub fn subject_tag(subject: &str) -> String {
    let mut escaped = String::with_capacity(subject.len().min(MAX_ESCAPED_LEN) + 2);
    escaped.push_str("e:");
    for b in subject.bytes() {
        if escaped.len() > MAX_ESCAPED_LEN {
            return hashed(subject);
        }
        if b.is_ascii_alphanumeric() || b"-_.:@/".contains(&b) {
            escaped.push(char::from(b));
        } else {
            escaped.push_str(&format!("%{b:02X}"));
        }
    }
    if escaped.len() > MAX_ESCAPED_LEN {
        return hashed(subject);
    }
    escaped
}

fn hashed(subject: &str) -> String {
    format!("h:{}", hex::encode(Sha256::digest(subject.as_bytes())))
}

/// The Redis Cluster slot of every key with hash tag `tag` (CRC16/XMODEM
/// of the tag, modulo 16384, as Redis computes it).
pub fn tag_slot(tag: &str) -> u16 {
    let mut crc: u16 = 0;
    for &b in tag.as_bytes() {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
}

/// The key of a lease grant's record (see `LeaseAsk::id`), for the
/// subject of tag `tag`: `ml:{e:alice}:grant:00000000000004d2`.
pub fn grant_key(prefix: &str, tag: &str, id: u64) -> String {
    format!("{prefix}{{{tag}}}:grant:{id:016x}")
}

/// The key that marks a settlement with id `id` applied, for the subject
/// of tag `tag`: `ml:{e:alice}:settled:00000000000004d2`.
pub fn settled_key(prefix: &str, tag: &str, id: u64) -> String {
    format!("{prefix}{{{tag}}}:settled:{id:016x}")
}

/// The key of the epoch of the subject of tag `tag`'s counters (see
/// `decide.lua`, `touch_epoch`): `ml:{e:alice}:epoch`.
pub fn epoch_key(prefix: &str, tag: &str) -> String {
    format!("{prefix}{{{tag}}}:epoch")
}

/// The key of one limit's counter for the subject of tag `tag`.
pub fn limit_key(prefix: &str, tag: &str, limit: &Limit) -> String {
    match &limit.calendar {
        Some(calendar) => format!(
            "{prefix}{{{tag}}}:{}:{}:{}",
            limit.name,
            limit.algorithm.short_name(),
            calendar.key_suffix()
        ),
        None => format!(
            "{prefix}{{{tag}}}:{}:{}:{}",
            limit.name,
            limit.algorithm.short_name(),
            limit.window_ms
        ),
    }
}

/// The key of a live override of limit `name` (`rule/limit`) for the
/// subject of tag `tag`: beside the subject's counters, in their slot, so
/// the script that decides reads it in the same run.
pub fn override_key(prefix: &str, tag: &str, name: &str) -> String {
    format!("{prefix}{{{tag}}}:{name}:ovr")
}

#[cfg(test)]
mod tests {
    #[test]
    fn slots_are_redis_own() {
        // Redis' cluster spec: CRC16("123456789") = 0x31C3; and
        // CLUSTER KEYSLOT of two known keys.
        assert_eq!(tag_slot("123456789"), 0x31C3);
        assert_eq!(tag_slot("foo"), 12182);
        assert_eq!(tag_slot("user1000"), 3443);
    }

    use super::*;
    use meshlimit_protocol::Algorithm;

    fn limit() -> Limit {
        Limit {
            name: "api/per-minute".into(),
            requests: 20,
            window_ms: 60_000,
            algorithm: Algorithm::FixedWindow,
            cost: 1,
            burst: None,
            shadow: false,
            subject: None,
            calendar: None,
        }
    }

    /// Redis Cluster's rule: the tag is between the first `{` and the next `}`.
    fn cluster_tag(key: &str) -> &str {
        if let Some(open) = key.find('{') {
            if let Some(len) = key[open + 1..].find('}') {
                if len > 0 {
                    return &key[open + 1..open + 1 + len];
                }
            }
        }
        key
    }

    #[test]
    fn plain_ids_stay_readable() {
        assert_eq!(subject_tag("hdr:x-api-key:alice"), "e:hdr:x-api-key:alice");
        assert_eq!(
            limit_key("ml:", &subject_tag("ip:10.0.0.1"), &limit()),
            "ml:{e:ip:10.0.0.1}:api/per-minute:fw:60000"
        );
    }

    #[test]
    fn braces_cannot_choose_the_slot() {
        for id in ["a", "{a}", "x{a}y", "}{", "{", "}", "a}b{c"] {
            let key = limit_key("ml:", &subject_tag(id), &limit());
            assert_eq!(cluster_tag(&key), subject_tag(id), "{id}");
            assert!(!subject_tag(id).contains(['{', '}']), "{id}");
        }
    }

    #[test]
    fn different_ids_never_share_a_tag() {
        let ids = [
            "a", "{a}", "x{a}y", "}{", "a%7B", "%7Ba%7D", "A", "a\u{1}", "a\t", "a\n", "",
        ];
        let tags: std::collections::HashSet<_> = ids.iter().map(|i| subject_tag(i)).collect();
        assert_eq!(tags.len(), ids.len());
    }

    #[test]
    fn long_ids_are_hashed_to_a_bounded_tag() {
        let big = "z".repeat(16 * 1024);
        let tag = subject_tag(&big);
        assert!(tag.starts_with("h:"));
        assert_eq!(tag.len(), 2 + 64);
        assert_ne!(subject_tag(&"z".repeat(16 * 1024 + 1)), tag);
        // Exactly at the boundary both sides stay distinct.
        let edge = "q".repeat(MAX_ESCAPED_LEN - 2);
        assert!(subject_tag(&edge).starts_with("e:"));
        assert!(subject_tag(&format!("{edge}q")).starts_with("h:"));
    }

    #[test]
    fn control_bytes_are_escaped() {
        assert_eq!(subject_tag("a\u{0}b\u{7f}"), "e:a%00b%7F");
    }
}

#[cfg(test)]
mod proptests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn tags_never_contain_braces_and_stay_small(subject in "\\PC{0,300}") {
            let tag = subject_tag(&subject);
            prop_assert!(!tag.contains(['{', '}']), "braces in {}", tag);
            prop_assert!(tag.len() <= 66);
            prop_assert!(tag.bytes().all(|b| b.is_ascii_graphic()));
        }

        #[test]
        fn different_subjects_get_different_tags(a in "\\PC{0,80}", b in "\\PC{0,80}") {
            prop_assume!(a != b);
            prop_assert_ne!(subject_tag(&a), subject_tag(&b));
        }

        #[test]
        fn near_identical_subjects_stay_apart(base in "[a-z{}%]{0,70}", suffix in "[{}%a]") {
            let longer = format!("{base}{suffix}");
            prop_assert_ne!(subject_tag(&base), subject_tag(&longer));
        }
    }
}
