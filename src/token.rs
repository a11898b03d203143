//! The `X-Fence-Token` grammar.
//!
//! A token is an unsigned decimal integer in the full `u64` range. The grammar
//! is deliberately strict: anything a lenient parser might read two ways (a
//! sign, leading zeros, `1,2`, hex, full-width digits) is refused, because a
//! proxy that reads a token differently from the client that sent it is a
//! proxy that can be talked into admitting a stale write.

use http::header::{HeaderMap, HeaderName};

/// The request header that carries the fencing token.
pub static FENCE_TOKEN: HeaderName = HeaderName::from_static("x-fence-token");
/// The response header that carries the key's highest token on a 409.
pub static FENCE_TOKEN_HIGHEST: HeaderName = HeaderName::from_static("x-fence-token-highest");

/// Why a token could not be read from a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// No `X-Fence-Token` header at all.
    #[error("the write carries no X-Fence-Token header")]
    Missing,
    /// The header is present more than once (or as a comma list).
    #[error("X-Fence-Token must be sent exactly once")]
    Repeated,
    /// The value does not follow the grammar.
    #[error("X-Fence-Token is not an unsigned decimal integer in 0..=18446744073709551615: {0}")]
    Malformed(&'static str),
}

/// Parses one token value: optional surrounding whitespace (SP / HTAB, as
/// HTTP's OWS allows), then `0` or a non-zero ASCII digit followed by ASCII
/// digits, fitting in a `u64`.
pub fn parse_token(raw: &[u8]) -> Result<u64, TokenError> {
    let trimmed = trim_ows(raw);
    if trimmed.is_empty() {
        return Err(TokenError::Malformed("empty value"));
    }
    if trimmed.contains(&b',') {
        return Err(TokenError::Repeated);
    }
    if !trimmed.iter().all(u8::is_ascii_digit) {
        return Err(TokenError::Malformed(
            "only the ASCII digits 0-9 are allowed",
        ));
    }
    if trimmed.len() > 1 && trimmed[0] == b'0' {
        return Err(TokenError::Malformed("leading zeros are not allowed"));
    }
    let mut value: u64 = 0;
    for &digit in trimmed {
        value = value
            .checked_mul(10)
            .and_then(|v| v.checked_add(u64::from(digit - b'0')))
            .ok_or(TokenError::Malformed("larger than 18446744073709551615"))?;
    }
    Ok(value)
}

/// Reads the token of a request: exactly one `X-Fence-Token` header whose
/// value parses with [`parse_token`].
pub fn token_from_headers(headers: &HeaderMap) -> Result<u64, TokenError> {
    let mut values = headers.get_all(&FENCE_TOKEN).iter();
    let first = values.next().ok_or(TokenError::Missing)?;
    if values.next().is_some() {
        return Err(TokenError::Repeated);
    }
    parse_token(first.as_bytes())
}

fn trim_ows(raw: &[u8]) -> &[u8] {
    let is_ows = |b: &u8| *b == b' ' || *b == b'\t';
    let start = raw.iter().position(|b| !is_ows(b)).unwrap_or(raw.len());
    let end = raw
        .iter()
        .rposition(|b| !is_ows(b))
        .map_or(start, |i| i + 1);
    &raw[start..end]
}

/// A token in a JSON answer, as a decimal string: JSON readers (the admin
/// page's JavaScript among them) lose precision on integers past 2^53, so
/// every token the admin API gives out is text. For `serialize_with`.
pub fn serialize_as_text<S: serde::Serializer>(token: &u64, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(token)
}

/// [`serialize_as_text`] for a token that may be absent (`null`).
pub fn serialize_maybe_as_text<S: serde::Serializer>(
    token: &Option<u64>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match token {
        Some(t) => s.collect_str(t),
        None => s.serialize_none(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn accepts_the_full_range() {
        assert_eq!(parse_token(b"0"), Ok(0));
        assert_eq!(parse_token(b"1"), Ok(1));
        assert_eq!(parse_token(b" \t42\t "), Ok(42));
        assert_eq!(parse_token(b"18446744073709551615"), Ok(u64::MAX));
    }

    #[test]
    fn refuses_everything_else() {
        for bad in [
            &b""[..],
            b"   ",
            b"-1",
            b"+1",
            b"01",
            b"00",
            b"1 2",
            b"0x10",
            b"1e3",
            b"1.0",
            b"18446744073709551616",
            b"99999999999999999999999",
            "\u{FF11}".as_bytes(), // full-width 1
            "\u{0661}".as_bytes(), // Arabic-Indic 1
            b"1\r\n",
            b"\x001",
        ] {
            assert!(
                matches!(parse_token(bad), Err(TokenError::Malformed(_))),
                "{:?} should be malformed",
                String::from_utf8_lossy(bad)
            );
        }
        assert_eq!(parse_token(b"1,2"), Err(TokenError::Repeated));
        assert_eq!(parse_token(b"1, 2"), Err(TokenError::Repeated));
    }

    #[test]
    fn header_map_rules() {
        let mut h = HeaderMap::new();
        assert_eq!(token_from_headers(&h), Err(TokenError::Missing));
        h.append(&FENCE_TOKEN, "7".parse().unwrap());
        assert_eq!(token_from_headers(&h), Ok(7));
        h.append(&FENCE_TOKEN, "7".parse().unwrap());
        assert_eq!(token_from_headers(&h), Err(TokenError::Repeated));
    }

    proptest! {
        #[test]
        fn round_trips_every_u64(n in any::<u64>(), pre in "[ \t]{0,3}", post in "[ \t]{0,3}") {
            let text = format!("{pre}{n}{post}");
            prop_assert_eq!(parse_token(text.as_bytes()), Ok(n));
        }

        #[test]
        fn accepts_exactly_the_canonical_decimal_form(raw in proptest::collection::vec(any::<u8>(), 0..24)) {
            // Oracle: the value is accepted iff, after trimming OWS, it is the
            // canonical decimal rendering of some u64.
            let trimmed = trim_ows(&raw);
            let expected = std::str::from_utf8(trimmed)
                .ok()
                .and_then(|s| s.parse::<u64>().ok().filter(|n| n.to_string() == s));
            prop_assert_eq!(parse_token(&raw).ok(), expected);
        }

        #[test]
        fn leading_zero_or_sign_is_refused(n in any::<u64>(), prefix in prop_oneof![Just("0"), Just("+"), Just("-")]) {
            let text = format!("{prefix}{n}");
            prop_assert!(parse_token(text.as_bytes()).is_err());
        }
    }
}
