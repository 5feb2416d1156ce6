//! Who may call: the proxies' shared token for checks (the HTTP API and
//! the gRPC rate limit service alike), and the admin token for the admin
//! API. One check, in constant time, whatever the front: a front only
//! says which caller it serves and hands over what was presented.

use super::AppState;

/// Which secret a call must carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Caller {
    /// A proxy asking for decisions (`--auth-token-file`; open without it).
    Proxy,
    /// An operator changing overrides (`--admin-token-file`; the API is
    /// off without it).
    Admin,
}

/// Why a call is refused before anything is read of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Denied {
    /// The admin API is off: there is nothing to authorize against.
    AdminOff,
    /// The `authorization` presented is missing or wrong.
    Unauthorized(Caller),
}

impl std::fmt::Display for Denied {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Denied::AdminOff => "the admin API is off (start meshlimitd with --admin-token-file)",
            Denied::Unauthorized(Caller::Proxy) => {
                "missing or wrong authorization: calls must carry the shared token"
            }
            Denied::Unauthorized(Caller::Admin) => {
                "missing or wrong authorization: admin calls must carry the admin token"
            }
        })
    }
}

impl std::error::Error for Denied {}

impl AppState {
    /// Whether `presented` (the `authorization` header or gRPC metadata,
    /// `None` when absent) lets `caller` in. A refusal is counted.
    pub fn authorize(&self, caller: Caller, presented: Option<&[u8]>) -> Result<(), Denied> {
        let expected = match caller {
            Caller::Proxy => match &self.authorization {
                Some(expected) => expected,
                None => return Ok(()),
            },
            Caller::Admin => match &self.admin_authorization {
                Some(expected) => expected,
                None => return Err(Denied::AdminOff),
            },
        };
        if same_secret(presented.unwrap_or_default(), expected) {
            return Ok(());
        }
        self.metrics.unauthorized();
        Err(Denied::Unauthorized(caller))
    }
}

/// The shared secret from the file's bytes: one line of 16 to 256 visible
/// ASCII characters (surrounding white space ignored).
pub fn auth_token(bytes: &[u8]) -> Result<String, String> {
    let text = std::str::from_utf8(bytes).map_err(|_| "the token is not text".to_string())?;
    let token = text.trim();
    if !(16..=256).contains(&token.len()) || !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("the token must be 16 to 256 visible ASCII characters".into());
    }
    Ok(token.to_string())
}

/// Whether `presented` equals `expected`, in time that does not depend on
/// where they differ.
fn same_secret(presented: &[u8], expected: &[u8]) -> bool {
    presented.len() == expected.len()
        && presented
            .iter()
            .zip(expected)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_compare_whole() {
        assert!(same_secret(b"Bearer abc", b"Bearer abc"));
        assert!(!same_secret(b"Bearer abd", b"Bearer abc"));
        assert!(!same_secret(b"Bearer ab", b"Bearer abc"));
        assert!(!same_secret(b"", b"Bearer abc"));
    }

    #[test]
    fn tokens_are_one_line_of_visible_ascii() {
        assert_eq!(
            auth_token(b"  0123456789abcdef\n").as_deref(),
            Ok("0123456789abcdef")
        );
        assert!(auth_token(b"short").is_err());
        assert!(auth_token(b"0123456789 abcdef").is_err());
    }
}
