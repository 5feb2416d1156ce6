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

/// One admin credential: its id (what the log names) and the
/// `authorization` value it is presented as.
#[derive(Clone)]
pub struct AdminToken {
    pub id: String,
    authorization: Vec<u8>,
}

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the secret.
        write!(f, "AdminToken({})", self.id)
    }
}

impl AppState {
    /// Whether `presented` (the `authorization` header or gRPC metadata,
    /// `None` when absent) lets `caller` in. A refusal is counted.
    pub fn authorize(&self, caller: Caller, presented: Option<&[u8]>) -> Result<(), Denied> {
        match caller {
            Caller::Admin => self.authorize_admin(presented).map(drop),
            Caller::Proxy => {
                let Some(expected) = &self.authorization else {
                    return Ok(());
                };
                if same_secret(presented.unwrap_or_default(), expected) {
                    return Ok(());
                }
                self.metrics.unauthorized();
                Err(Denied::Unauthorized(caller))
            }
        }
    }

    /// The id of the admin credential `presented` is, or why it is none.
    /// Every credential is compared, whichever matches: the time taken
    /// tells nothing of which one, or how much of it, was right.
    pub fn authorize_admin(&self, presented: Option<&[u8]>) -> Result<&str, Denied> {
        let Some(tokens) = &self.admin_tokens else {
            return Err(Denied::AdminOff);
        };
        let presented = presented.unwrap_or_default();
        let mut found = None;
        for token in tokens.iter() {
            if same_secret(presented, &token.authorization) && found.is_none() {
                found = Some(token.id.as_str());
            }
        }
        found.ok_or_else(|| {
            self.metrics.unauthorized();
            Denied::Unauthorized(Caller::Admin)
        })
    }
}

/// The admin credentials in `--admin-token-file`: one secret (its id is
/// `admin`), or one credential a line, `<id> <secret>`, so that the log
/// names who made each change (blank lines and `#` comments skipped).
/// Ids are 1 to 64 letters, digits, `-`, `_` or `.`, each once; secrets
/// as [`auth_token`] requires, each once.
pub fn admin_tokens(bytes: &[u8]) -> Result<Vec<AdminToken>, String> {
    let text = std::str::from_utf8(bytes).map_err(|_| "the file is not text".to_string())?;
    let lines: Vec<(usize, &str)> = text
        .lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l.trim()))
        .filter(|(_, l)| !l.is_empty() && !l.starts_with('#'))
        .collect();
    let mut tokens: Vec<AdminToken> = Vec::new();
    for (n, line) in &lines {
        let (id, secret) = match line.split_once(char::is_whitespace) {
            Some((id, secret)) => (id, secret.trim()),
            None if lines.len() == 1 => ("admin", *line),
            None => return Err(format!("line {n}: `<id> <secret>` (one credential a line)")),
        };
        let valid_id = (1..=64).contains(&id.len())
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
        if !valid_id {
            return Err(format!(
                "line {n}: the id must be 1 to 64 letters, digits, '-', '_' or '.'"
            ));
        }
        let secret = auth_token(secret.as_bytes()).map_err(|e| format!("line {n}: {e}"))?;
        let authorization = format!("Bearer {secret}").into_bytes();
        if tokens.iter().any(|t| t.id == id) {
            return Err(format!("line {n}: id {id} is given twice"));
        }
        if tokens.iter().any(|t| t.authorization == authorization) {
            return Err(format!("line {n}: this secret is given twice"));
        }
        tokens.push(AdminToken {
            id: id.to_string(),
            authorization,
        });
    }
    if tokens.is_empty() {
        return Err("no credential in the file".into());
    }
    Ok(tokens)
}

impl AdminToken {
    /// Whether this credential's secret is `secret`.
    pub fn has_secret(&self, secret: &str) -> bool {
        same_secret(format!("Bearer {secret}").as_bytes(), &self.authorization)
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
pub(super) fn same_secret(presented: &[u8], expected: &[u8]) -> bool {
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
    fn admin_credentials_have_ids() {
        let one = admin_tokens(b"0123456789abcdef\n").unwrap();
        assert_eq!(one[0].id, "admin");
        let many =
            admin_tokens(b"# on call\nalice 0123456789abcdef\n\nbob   fedcba9876543210\n").unwrap();
        assert_eq!(
            many.iter().map(|t| t.id.as_str()).collect::<Vec<_>>(),
            ["alice", "bob"]
        );
        assert!(many[1].has_secret("fedcba9876543210"));
        for bad in [
            &b"alice 0123456789abcdef\nbob\n"[..],
            b"al ice 0123456789abcdef",
            b"alice 0123456789abcdef\nalice fedcba9876543210",
            b"alice 0123456789abcdef\nbob 0123456789abcdef",
            b"alice short",
            b"a/b 0123456789abcdef",
            b"# nothing\n",
        ] {
            assert!(
                admin_tokens(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
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
