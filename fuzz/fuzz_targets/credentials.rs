//! `X-Fence-Token` and bearer credentials. A token is read exactly when its
//! trimmed value is the canonical decimal spelling of a `u64` (checked
//! against the standard library's reading); a request's token only from
//! exactly one header; a bearer credential only from exactly one
//! `Authorization` header of scheme Bearer; secrets compare equal only
//! when equal; a lease token file's lines are read one bearer each.
#![no_main]

use arbitrary::Arbitrary;
use fencegate::bearer::{bearer_credential, parse_bearers, same_secret};
use fencegate::token::{parse_token, token_from_headers, TokenError, FENCE_TOKEN};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
struct Input<'a> {
    token: &'a [u8],
    /// Further `X-Fence-Token` values on the same request.
    more_tokens: Vec<&'a [u8]>,
    authorization: Vec<&'a [u8]>,
    secrets: (&'a str, &'a str),
    token_file: &'a str,
}

/// The token the value spells, read another way: optional SP/HTAB around
/// it, then digits that `u64` parses and prints back the same (no sign, no
/// leading zero).
fn reference(raw: &[u8]) -> Option<u64> {
    let t = raw;
    let start = t.iter().position(|b| *b != b' ' && *b != b'\t')?;
    let end = t.iter().rposition(|b| *b != b' ' && *b != b'\t')? + 1;
    let s = std::str::from_utf8(&t[start..end]).ok()?;
    let n: u64 = s.parse().ok()?;
    (n.to_string() == s).then_some(n)
}

fuzz_target!(|input: Input<'_>| {
    let parsed = parse_token(input.token);
    assert_eq!(
        parsed.clone().ok(),
        reference(input.token),
        "{:?}",
        input.token
    );

    let mut headers = http::HeaderMap::new();
    let mut values = Vec::new();
    for v in std::iter::once(input.token).chain(input.more_tokens.iter().copied()) {
        if let Ok(v) = http::HeaderValue::from_bytes(v) {
            headers.append(FENCE_TOKEN.clone(), v);
            values.push(v_bytes(&headers, values.len()));
        }
    }
    match token_from_headers(&headers) {
        Ok(n) => {
            assert_eq!(
                values.len(),
                1,
                "a token read from {} headers",
                values.len()
            );
            assert_eq!(Some(n), reference(&values[0]));
        }
        Err(TokenError::Missing) => assert!(values.is_empty()),
        Err(_) => assert!(values.len() > 1 || reference(&values[0]).is_none()),
    }

    let mut req = http::Request::new(());
    let mut count = 0;
    for v in &input.authorization {
        if let Ok(v) = http::HeaderValue::from_bytes(v) {
            req.headers_mut().append(http::header::AUTHORIZATION, v);
            count += 1;
        }
    }
    if let Some(t) = bearer_credential(&req) {
        assert_eq!(count, 1, "a credential from {count} Authorization headers");
        let value = req.headers()[http::header::AUTHORIZATION].to_str().unwrap();
        let v = value.trim();
        assert!(
            v.len() > 7 && v[..7].eq_ignore_ascii_case("bearer "),
            "{value:?}"
        );
        assert!(
            !t.is_empty() && t == t.trim() && v.ends_with(t),
            "{value:?} gave {t:?}"
        );
    }

    let (a, b) = input.secrets;
    assert_eq!(same_secret(a, b), a == b);

    if let Ok(bearers) = parse_bearers(input.token_file) {
        let lines = input
            .token_file
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .count();
        assert_eq!(bearers.len(), lines);
    }
});

/// The bytes of the `i`th `X-Fence-Token` value in `headers`.
fn v_bytes(headers: &http::HeaderMap, i: usize) -> Vec<u8> {
    headers
        .get_all(&FENCE_TOKEN)
        .iter()
        .nth(i)
        .expect("appended")
        .as_bytes()
        .to_vec()
}
