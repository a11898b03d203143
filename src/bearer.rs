//! Bearer tokens: the lease token file's lines (a token and the key
//! prefixes it may lease), the one rule that reads a request's
//! `Authorization: Bearer` credential, and the comparison of secrets. Plain
//! values and parsers: the config reads the file, the admin and lease
//! listeners check requests against it.

/// One line of the lease token file: a bearer token and the key prefixes
/// it may lease (none: every key).
#[derive(Clone, PartialEq, Eq)]
pub struct Bearer {
    pub(crate) token: String,
    pub(crate) prefixes: Vec<String>,
}

impl std::fmt::Debug for Bearer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bearer")
            .field("token", &"****")
            .field("prefixes", &self.prefixes)
            .finish()
    }
}

impl Bearer {
    /// Whether this token may lease `key`.
    pub fn covers(&self, key: &str) -> bool {
        self.prefixes.is_empty() || self.prefixes.iter().any(|p| key.starts_with(p.as_str()))
    }
}

/// Parses the lease token file: one `TOKEN [PREFIX ...]` per line; blank
/// lines and `#` comments are skipped. Tokens are at least 16 characters.
pub fn parse_bearers(text: &str) -> Result<Vec<Bearer>, String> {
    let mut out: Vec<Bearer> = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut words = line.split_whitespace();
        let token = words.next().unwrap_or_default().to_string();
        if token.len() < 16 {
            return Err(format!(
                "line {}: the token must be at least 16 characters",
                n + 1
            ));
        }
        if out.iter().any(|b| b.token == token) {
            return Err(format!("line {}: the token is listed twice", n + 1));
        }
        out.push(Bearer {
            token,
            prefixes: words.map(str::to_string).collect(),
        });
    }
    if out.is_empty() {
        return Err("holds no token (a line is `TOKEN [KEY-PREFIX ...]`)".into());
    }
    Ok(out)
}

/// Compares a presented secret with the expected one in time that does not
/// depend on where they differ, nor on their lengths (a bearer token must
/// not leak by timing, its length included): the SHA-256 digests of both,
/// of fixed size, are compared in full.
pub fn same_secret(got: &str, expected: &str) -> bool {
    let digest = |s: &str| ring::digest::digest(&ring::digest::SHA256, s.as_bytes());
    let (a, b) = (digest(got), digest(expected));
    a.as_ref()
        .iter()
        .zip(b.as_ref())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y))
        == 0
}

/// The bearer credential of a request, by one rule for the admin and the
/// lease listeners: exactly one `Authorization` header, its scheme
/// `Bearer` in any case (RFC 9110), the token around it trimmed. Two
/// headers are refused: which one counts would be ambiguous.
pub fn bearer_credential<B>(req: &http::Request<B>) -> Option<&str> {
    let mut values = req.headers().get_all(http::header::AUTHORIZATION).iter();
    let value = values.next()?.to_str().ok()?;
    if values.next().is_some() {
        return None;
    }
    let (scheme, token) = value.trim().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_lines_and_scopes() {
        let b = parse_bearers("# ops\n\nabcdefghijklmnop\nqrstuvwxyz012345 jobs: s3:reports/\n")
            .unwrap();
        assert_eq!(b.len(), 2);
        assert!(b[0].covers("anything"));
        assert!(b[1].covers("jobs:x") && b[1].covers("s3:reports/a"));
        assert!(!b[1].covers("s3:other"));
        assert!(parse_bearers("short").unwrap_err().contains("16"));
        assert!(parse_bearers("\n# none\n").is_err());
        assert!(parse_bearers("abcdefghijklmnop\nabcdefghijklmnop x")
            .unwrap_err()
            .contains("twice"));
        assert!(!format!("{:?}", b[0]).contains("abcdefghijklmnop"));
    }

    #[test]
    fn secrets_compare_whole_and_of_any_length() {
        assert!(same_secret("abcdefghijklmnop", "abcdefghijklmnop"));
        assert!(!same_secret("abcdefghijklmnoq", "abcdefghijklmnop"));
        assert!(!same_secret("abcdefghijklmno", "abcdefghijklmnop"));
        assert!(!same_secret("abcdefghijklmnopq", "abcdefghijklmnop"));
        assert!(!same_secret("", "abcdefghijklmnop"));
    }

    #[test]
    fn one_bearer_rule_for_every_listener() {
        let with = |values: &[&str]| {
            let mut b = http::Request::builder();
            for v in values {
                b = b.header(http::header::AUTHORIZATION, *v);
            }
            b.body(()).unwrap()
        };
        for ok in ["Bearer tok", "bearer tok", "BEARER  tok ", " Bearer tok"] {
            assert_eq!(bearer_credential(&with(&[ok])), Some("tok"), "{ok:?}");
        }
        for bad in ["Basic tok", "Bearer", "Bearer ", "Bearertok", "tok"] {
            assert_eq!(bearer_credential(&with(&[bad])), None, "{bad:?}");
        }
        assert_eq!(bearer_credential(&with(&[])), None);
        assert_eq!(
            bearer_credential(&with(&["Bearer a", "Bearer a"])),
            None,
            "two credentials"
        );
    }
}
