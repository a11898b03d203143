//! One canonical parse of the request target.
//!
//! The same parse yields the resource key that is fenced *and* the target that
//! is sent upstream, so a request cannot be fenced as one resource and applied
//! as another. In the default (canonical) mode anything a backend might read
//! two ways is refused; in literal mode (for S3-like backends where `//` and
//! `%2F` are legal object names) the target is forwarded byte for byte and the
//! key is the fully percent-decoded path, the identity S3 gives an object,
//! with the names some S3 servers read as one merged (`+` and space, runs of
//! `/`, a trailing `/`): two objects sharing a fence is safe, one object
//! under two fences is not.

use std::fmt;

/// Why a request target was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("the request target must be a path starting with '/'")]
    NotAPath,
    #[error("dot segments ('.', '..', '..;') are not allowed in the path")]
    DotSegment,
    #[error("empty path segments ('//') are not allowed")]
    EmptySegment,
    #[error("encoded '/' or '\\' (or a double-encoded escape) is not allowed in the path")]
    EncodedSeparator,
    #[error("a backslash is not allowed in the path")]
    Backslash,
    #[error("NUL and other control characters are not allowed in the path")]
    ControlCharacter,
    #[error("invalid percent-encoding in the path")]
    InvalidPercentEncoding,
    #[error("non-ASCII bytes must be percent-encoded")]
    NonAscii,
    #[error("path parameters (';') are not allowed in canonical mode")]
    PathParameter,
    #[error("a fragment is not allowed in the request target")]
    Fragment,
    #[error("the percent-decoded path is not valid UTF-8")]
    NotUtf8,
    #[error("the absolute-form request target names another host than the Host header")]
    ForeignHost,
    #[error("bad authority: {0}")]
    BadAuthority(String),
    #[error("the path does not match the route's key template {0}")]
    TemplateMismatch(String),
    #[error("the key header {0} is missing, empty or repeated")]
    KeyHeader(String),
}

/// A request path after the canonical parse.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CanonicalPath {
    /// Segments in canonical spelling: unreserved escapes decoded, the other
    /// escapes kept with upper-case hex digits. In literal mode, the fully
    /// decoded non-empty segments of the raw path (one may hold a decoded
    /// `/`, which key templates refuse).
    pub segments: Vec<String>,
    /// The path as a key: canonical segments joined, without a trailing slash
    /// (over-merging `/a/` with `/a` is safe; splitting them would not be).
    pub key_path: String,
    /// The path (and query) to send upstream.
    pub upstream_target: String,
}

/// How a route turns a path into the key text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyTemplate {
    /// The whole path is one resource.
    Path,
    /// A pattern such as `/{bucket}` or `/{tenant}/users/{id}`: each part is a
    /// placeholder or a literal segment; the key is the matched prefix.
    Pattern(Vec<PatternPart>),
    /// The (trimmed) value of a request header.
    Header(http::HeaderName),
}

/// One segment of a [`KeyTemplate::Pattern`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PatternPart {
    Any(String),
    Literal(String),
}

impl KeyTemplate {
    /// Parses the config spelling: `path`, `header:NAME`, or a `/`-pattern.
    pub fn parse(text: &str) -> Result<Self, String> {
        if text == "path" {
            return Ok(Self::Path);
        }
        if let Some(name) = text.strip_prefix("header:") {
            return http::HeaderName::from_bytes(name.trim().as_bytes())
                .map(Self::Header)
                .map_err(|_| format!("`{name}` is not a valid header name"));
        }
        let Some(rest) = text.strip_prefix('/') else {
            return Err("expected `path`, `header:NAME` or a pattern like `/{bucket}`".into());
        };
        let mut parts = Vec::new();
        for seg in rest.split('/') {
            if seg.is_empty() {
                return Err("a pattern may not have empty segments".into());
            }
            if let Some(name) = seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
                if name.is_empty() || name.contains(['{', '}']) {
                    return Err(format!("bad placeholder `{seg}`"));
                }
                parts.push(PatternPart::Any(name.to_string()));
            } else if seg.contains(['{', '}']) {
                return Err(format!("bad placeholder `{seg}`"));
            } else {
                parts.push(PatternPart::Literal(seg.to_string()));
            }
        }
        Ok(Self::Pattern(parts))
    }

    /// Derives the key text of a request.
    pub fn key_text(
        &self,
        path: &CanonicalPath,
        headers: &http::HeaderMap,
    ) -> Result<String, KeyError> {
        match self {
            Self::Path => Ok(path.key_path.clone()),
            Self::Pattern(parts) => {
                if path.segments.len() < parts.len() {
                    return Err(KeyError::TemplateMismatch(self.to_string()));
                }
                let mut key = String::new();
                for (part, seg) in parts.iter().zip(&path.segments) {
                    // In literal mode a segment is decoded after the split;
                    // one that decodes to a '/' would be split differently
                    // by a backend that decodes first.
                    if seg.is_empty() || seg.contains(['/', '\\']) {
                        return Err(KeyError::TemplateMismatch(self.to_string()));
                    }
                    if let PatternPart::Literal(lit) = part {
                        if lit != seg {
                            return Err(KeyError::TemplateMismatch(self.to_string()));
                        }
                    }
                    key.push('/');
                    key.push_str(seg);
                }
                Ok(key)
            }
            Self::Header(name) => {
                let mut values = headers.get_all(name).iter();
                let value = values
                    .next()
                    .and_then(|v| v.to_str().ok())
                    .map(str::trim)
                    .filter(|v| !v.is_empty() && !v.contains(','))
                    .ok_or_else(|| KeyError::KeyHeader(name.to_string()))?;
                if values.next().is_some() {
                    return Err(KeyError::KeyHeader(name.to_string()));
                }
                // A backend that reads the value as a quoted-string (RFC
                // 9110) sees `"acct1"` as `acct1`: one resource, one key.
                // Escapes inside quotes could be read two ways: refused.
                match value.strip_prefix('"').and_then(|v| v.strip_suffix('"')) {
                    Some(inner) if inner.is_empty() || inner.contains(['"', '\\']) => {
                        Err(KeyError::KeyHeader(name.to_string()))
                    }
                    Some(inner) => Ok(inner.to_string()),
                    None => Ok(value.to_string()),
                }
            }
        }
    }
}

impl fmt::Display for KeyTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Path => f.write_str("path"),
            Self::Header(h) => write!(f, "header:{h}"),
            Self::Pattern(parts) => {
                for p in parts {
                    match p {
                        PatternPart::Any(n) => write!(f, "/{{{n}}}")?,
                        PatternPart::Literal(l) => write!(f, "/{l}")?,
                    }
                }
                Ok(())
            }
        }
    }
}

fn hex_val(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// Whether an escaped byte is written as the plain character in the
/// canonical spelling: every byte the HTTP parser also accepts unescaped in a
/// path, except the ones that change the path's structure (`/`, `\\`, `%`,
/// `;`). So each decoded byte sequence has exactly one canonical spelling, and
/// two requests share a key exactly when a decoding backend would see the same
/// path.
fn decodes_in_path(b: u8) -> bool {
    b.is_ascii_alphanumeric()
        || matches!(
            b,
            b'-' | b'.'
                | b'_'
                | b'~'
                | b'!'
                | b'$'
                | b'&'
                | b'\''
                | b'('
                | b')'
                | b'*'
                | b'+'
                | b','
                | b'='
                | b':'
                | b'@'
                | b'['
                | b']'
                | b'^'
                | b'|'
                | b'"'
                | b'{'
                | b'}'
        )
}

/// Splits `path?query`. The HTTP parser has already removed any fragment; a
/// `#` that survives (it cannot in HTTP/1) is refused.
fn split_target(target: &str) -> Result<(&str, Option<&str>), KeyError> {
    if target.contains('#') {
        return Err(KeyError::Fragment);
    }
    Ok(match target.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (target, None),
    })
}

/// The default parse: refuses anything ambiguous, decodes escapes of
/// unreserved characters, upper-cases the hex of the others.
pub fn canonicalize(target: &str) -> Result<CanonicalPath, KeyError> {
    let (path, query) = split_target(target)?;
    if !path.starts_with('/') {
        return Err(KeyError::NotAPath);
    }
    if !path.is_ascii() {
        return Err(KeyError::NonAscii);
    }
    let body = &path[1..];
    let trailing_slash = body.ends_with('/');
    let body = if trailing_slash {
        &body[..body.len() - 1]
    } else {
        body
    };
    // Every segment is non-empty (`canonical_segment` refuses an empty
    // one: "//", "/a//b" and "/a//" are refused); "/" has none.
    let mut segments = Vec::new();
    if !body.is_empty() || trailing_slash {
        for raw in body.split('/') {
            segments.push(canonical_segment(raw)?);
        }
    }
    let key_path = format!("/{}", segments.join("/"));
    let mut upstream_target = key_path.clone();
    if trailing_slash {
        upstream_target.push('/');
    }
    if let Some(q) = query {
        upstream_target.push('?');
        upstream_target.push_str(q);
    }
    Ok(CanonicalPath {
        segments,
        key_path,
        upstream_target,
    })
}

fn canonical_segment(raw: &str) -> Result<String, KeyError> {
    if raw.is_empty() {
        return Err(KeyError::EmptySegment);
    }
    let bytes = raw.as_bytes();
    let mut out = String::with_capacity(raw.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        match b {
            b'%' => {
                let (hi, lo) = match (bytes.get(i + 1), bytes.get(i + 2)) {
                    (Some(&h), Some(&l)) => (h, l),
                    _ => return Err(KeyError::InvalidPercentEncoding),
                };
                let value = match (hex_val(hi), hex_val(lo)) {
                    (Some(h), Some(l)) => h * 16 + l,
                    _ => return Err(KeyError::InvalidPercentEncoding),
                };
                match value {
                    b'/' | b'\\' => return Err(KeyError::EncodedSeparator),
                    0x00..=0x1F | 0x7F => return Err(KeyError::ControlCharacter),
                    // `%25` followed by two hex digits (raw or decoded)
                    // would be another escape to a backend that decodes
                    // twice: the check on the output below refuses it.
                    b'%' => {
                        out.push_str("%25");
                    }
                    v if decodes_in_path(v) => out.push(v as char),
                    v => {
                        out.push('%');
                        out.push(char::from(b"0123456789ABCDEF"[usize::from(v >> 4)]));
                        out.push(char::from(b"0123456789ABCDEF"[usize::from(v & 15)]));
                    }
                }
                i += 3;
                continue;
            }
            b'\\' => return Err(KeyError::Backslash),
            b';' => {
                let before = &out;
                if before == "." || before == ".." {
                    return Err(KeyError::DotSegment);
                }
                return Err(KeyError::PathParameter);
            }
            0x00..=0x1F | 0x7F => return Err(KeyError::ControlCharacter),
            _ => out.push(b as char),
        }
        i += 1;
    }
    if out == "." || out == ".." {
        return Err(KeyError::DotSegment);
    }
    // Escapes that decode to bytes no UTF-8 decoder accepts (`%C0%AE` is
    // an overlong '.', which a lax decoder reads as one): refused, so the
    // backend cannot read another name than the key's.
    if raw.contains('%') && std::str::from_utf8(&percent_decode(raw)?).is_err() {
        return Err(KeyError::NotUtf8);
    }
    // Checked on the output too: `%25%32%46` becomes `%252F`, which a
    // backend that decodes twice reads as `/`.
    let ob = out.as_bytes();
    if ob
        .windows(5)
        .any(|w| w[..3] == *b"%25" && hex_val(w[3]).is_some() && hex_val(w[4]).is_some())
    {
        return Err(KeyError::EncodedSeparator);
    }
    Ok(out)
}

/// The literal parse: the target is kept byte for byte; the key is the fully
/// percent-decoded path (what S3 calls the object's name) with `\` read as
/// `/`, runs of `/` merged and no trailing `/`. Some S3 servers (SeaweedFS)
/// read `a//b`, `a\b` and `a/b/` as `a/b`, others (AWS) as names of their
/// own: merging them into one key is safe (at worst two objects share a
/// fence), splitting them would not be. Dot segments (`.`, `..`, raw or encoded) are refused, as in
/// the canonical parse: a backend that resolves them would write where no
/// route or key of the raw path points.
pub fn literal(target: &str) -> Result<CanonicalPath, KeyError> {
    let (path, _query) = split_target(target)?;
    if !path.starts_with('/') {
        return Err(KeyError::NotAPath);
    }
    // Some S3 implementations read a raw `+` in the path as a space, others
    // as a plus: `a+b`, `a%2Bb`, `a b` and `a%20b` may all name one
    // object. Merging them into one key is safe; splitting them would not be.
    let decode = |s: &str| -> Result<String, KeyError> {
        let out = percent_decode(s)?;
        if out.contains(&0) {
            return Err(KeyError::ControlCharacter);
        }
        String::from_utf8(out)
            .map(|s| s.replace('+', " "))
            .map_err(|_| KeyError::NotUtf8)
    };
    let decoded = decode(path)?;
    // Checked on the decoded name, whose `/` include the encoded ones; a
    // `\` is a `/` too (SeaweedFS reads `a\b` as `a/b`).
    let mut key_path = String::with_capacity(decoded.len());
    for seg in decoded.split(['/', '\\']).filter(|s| !s.is_empty()) {
        if seg == "." || seg == ".." {
            return Err(KeyError::DotSegment);
        }
        key_path.push('/');
        key_path.push_str(seg);
    }
    if key_path.is_empty() {
        key_path.push('/');
    }
    let segments = path[1..]
        .split(['/', '\\'])
        .filter(|s| !s.is_empty())
        .map(decode)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(CanonicalPath {
        segments,
        key_path,
        upstream_target: target.to_string(),
    })
}

/// The form routes are matched on: the path fully percent-decoded, as a
/// decoding backend reads it (a byte that is not UTF-8 becomes U+FFFD;
/// route prefixes are plain ASCII, so that cannot change a match), with
/// `\` read as `/` and runs of `/` merged, as a backend that does both reads
/// it. Every spelling of a resource, in either mode, has this one form, so
/// it meets one route, and that route's parse then gives the key.
pub fn route_form(target: &str) -> Result<std::borrow::Cow<'_, str>, KeyError> {
    let (path, _query) = split_target(target)?;
    if !path.starts_with('/') {
        return Err(KeyError::NotAPath);
    }
    if !path.contains(['%', '\\']) && !path.contains("//") {
        // Nothing to decode or merge: the common case costs no allocation.
        return Ok(std::borrow::Cow::Borrowed(path));
    }
    // Merged in place on the decoded bytes (`/` and `\` are ASCII, never
    // part of a longer UTF-8 sequence): one allocation for a valid name.
    let mut form = percent_decode(path)?;
    let mut len = 0;
    for i in 0..form.len() {
        let b = if form[i] == b'\\' { b'/' } else { form[i] };
        if !(b == b'/' && len > 0 && form[len - 1] == b'/') {
            form[len] = b;
            len += 1;
        }
    }
    form.truncate(len);
    Ok(std::borrow::Cow::Owned(
        String::from_utf8(form)
            .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned()),
    ))
}

/// A route form as a backend that drops path parameters (`;...` in each
/// segment: Tomcat, Jetty, Spring) and merges runs of `/` reads it; `None`
/// when it has none.
pub fn without_params(form: &str) -> Option<String> {
    if !form.contains(';') {
        return None;
    }
    // A segment that was only parameters leaves an empty one, merged like
    // any run of `/` (`/a/;x/b` reads as `/a/b`).
    let mut bare = String::with_capacity(form.len());
    for seg in form.split('/') {
        let seg = seg.split(';').next().unwrap_or("");
        if !seg.is_empty() {
            bare.push('/');
            bare.push_str(seg);
        }
    }
    if bare.is_empty() {
        bare.push('/');
    }
    Some(bare)
}

/// Decodes every `%XX` escape; a `%` not followed by two hex digits is an
/// error.
pub fn percent_decode(s: &str) -> Result<Vec<u8>, KeyError> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let h = bytes.get(i + 1).copied().and_then(hex_val);
            let l = bytes.get(i + 2).copied().and_then(hex_val);
            match (h, l) {
                (Some(h), Some(l)) => out.push(h * 16 + l),
                _ => return Err(KeyError::InvalidPercentEncoding),
            }
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    Ok(out)
}

/// The host an authority names, in the one spelling routes are matched on:
/// lower case, without port, brackets or a trailing dot. The same parse
/// serves `Host`, an absolute-form target and HTTP/2's `:authority`. User
/// info (`user@host`) is refused: hosts read it two ways.
pub fn authority_host(text: &str) -> Result<(String, Option<u16>), KeyError> {
    if text.contains('@') {
        return Err(KeyError::BadAuthority("user info is not allowed".into()));
    }
    let authority: http::uri::Authority = text
        .parse()
        .map_err(|_| KeyError::BadAuthority(format!("`{text}` is not a host[:port]")))?;
    let host = authority.host();
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
        .trim_end_matches('.')
        .to_ascii_lowercase();
    if host.is_empty() {
        return Err(KeyError::BadAuthority(format!("`{text}` names no host")));
    }
    Ok((host, authority.port_u16()))
}

/// Whether `text` (a `Host` value or an authority) spells its host the way
/// routes name hosts: no upper-case letter, no trailing dot. Route matching
/// ignores both, but a backend may not (SeaweedFS reads `bkt.S3.LOCAL` and
/// `bkt.s3.local.` as path-style requests, not as bucket `bkt`), so a
/// request that meets a host route must spell its host plainly.
pub fn host_spelled_plainly(text: &str) -> bool {
    text.parse::<http::uri::Authority>().is_ok_and(|a| {
        let h = a.host();
        !h.ends_with('.') && !h.bytes().any(|b| b.is_ascii_uppercase())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(t: &str) -> Result<String, KeyError> {
        canonicalize(t).map(|c| c.key_path)
    }

    #[test]
    fn unreserved_escapes_are_decoded_in_either_case() {
        assert_eq!(key("/a/%6Fbj"), Ok("/a/obj".into()));
        assert_eq!(key("/a/%6fbj"), Ok("/a/obj".into()));
        assert_eq!(key("/a/obj"), Ok("/a/obj".into()));
        assert_eq!(key("/a/%7e%2D"), Ok("/a/~-".into()));
        // Characters a path may carry plain are decoded; the others stay
        // encoded with upper-case hex.
        assert_eq!(key("/a/b%3ac"), Ok("/a/b:c".into()));
        assert_eq!(key("/a/b%3Fc%20d%3b"), Ok("/a/b%3Fc%20d%3B".into()));
        assert_eq!(key("/a/%c3%a9"), Ok("/a/%C3%A9".into()));
    }

    #[test]
    fn the_upstream_target_is_the_canonical_path_plus_the_query() {
        let c = canonicalize("/a/%6Fbj/?x=%2F&y").unwrap();
        assert_eq!(c.key_path, "/a/obj");
        assert_eq!(c.upstream_target, "/a/obj/?x=%2F&y");
        assert_eq!(canonicalize("/").unwrap().upstream_target, "/");
        assert_eq!(canonicalize("/?q").unwrap().upstream_target, "/?q");
    }

    #[test]
    fn ambiguous_paths_are_refused() {
        use KeyError::*;
        for (t, e) in [
            ("/a/./b", DotSegment),
            ("/a/../b", DotSegment),
            ("/a/..", DotSegment),
            ("/a/%2e%2E/b", DotSegment),
            ("/a/.%2e/b", DotSegment),
            ("/a/..;/b", DotSegment),
            ("/a/b;jsessionid=1", PathParameter),
            ("/a//b", EmptySegment),
            ("//a", EmptySegment),
            ("/a//", EmptySegment),
            ("/a/%2Fb", EncodedSeparator),
            ("/a/%2fb", EncodedSeparator),
            ("/a/%5Cb", EncodedSeparator),
            ("/a/%252Fb", EncodedSeparator),
            ("/a/%255c", EncodedSeparator),
            ("/a/%25%32%46b", EncodedSeparator),
            ("/a/%25%32%65%25%32%65", EncodedSeparator),
            ("/a\\b", Backslash),
            ("/a/%00", ControlCharacter),
            ("/a/%0d%0a", ControlCharacter),
            ("/a/%zz", InvalidPercentEncoding),
            ("/a/%4", InvalidPercentEncoding),
            ("/a/%", InvalidPercentEncoding),
            ("/a/é", NonAscii),
            ("/a#frag", Fragment),
            ("a/b", NotAPath),
            ("*", NotAPath),
        ] {
            assert_eq!(key(t), Err(e), "{t}");
        }
        // A lone %25 (a literal percent sign) is fine.
        assert_eq!(key("/a/100%25"), Ok("/a/100%25".into()));
    }

    #[test]
    fn escapes_that_are_not_utf8_are_refused() {
        for bad in [
            "/s/%C0%AE%C0%AE/x",
            "/s/%C0%AE",
            "/s/%E0%80%AE",
            "/s/%FF",
            "/s/%C3",
            "/s/%ED%A0%80",
            "/s/%80",
        ] {
            assert_eq!(key(bad), Err(KeyError::NotUtf8), "{bad}");
        }
        assert_eq!(key("/s/%C3%A9").unwrap(), "/s/%C3%A9");
        assert_eq!(key("/s/%e2%82%ac").unwrap(), "/s/%E2%82%AC");
    }

    #[test]
    fn trailing_slash_shares_the_key_but_is_forwarded() {
        let c = canonicalize("/dir/").unwrap();
        assert_eq!(c.key_path, "/dir");
        assert_eq!(c.upstream_target, "/dir/");
        let c = canonicalize("/dir").unwrap();
        assert_eq!(c.upstream_target, "/dir", "no slash is added");
        assert_eq!(c.segments, ["dir"]);
        assert_eq!(canonicalize("//"), Err(KeyError::EmptySegment));
        assert!(canonicalize("/").unwrap().segments.is_empty());
    }

    #[test]
    fn raw_control_characters_and_half_escapes_after_a_percent_sign() {
        assert_eq!(key("/a/b\u{1}c"), Err(KeyError::ControlCharacter));
        assert_eq!(key("/a/\u{7f}"), Err(KeyError::ControlCharacter));
        assert_eq!(key("/a/\tb"), Err(KeyError::ControlCharacter));
        // `%25` then one hex digit is no second escape: a literal percent
        // sign followed by text.
        assert_eq!(key("/a/%25Az"), Ok("/a/%25Az".into()));
        assert_eq!(key("/a/%25zA"), Ok("/a/%25zA".into()));
        assert_eq!(key("/a/%25A"), Ok("/a/%25A".into()));
    }

    #[test]
    fn literal_mode_keeps_the_target_and_decodes_the_key() {
        let c = literal("/bucket/a//b%2Fc/d/?partNumber=1").unwrap();
        assert_eq!(c.upstream_target, "/bucket/a//b%2Fc/d/?partNumber=1");
        // One key for every spelling a merging server reads as one name.
        assert_eq!(c.key_path, "/bucket/a/b/c/d");
        assert_eq!(c.segments, ["bucket", "a", "b/c", "d"]);
        for spelling in [
            "//bucket/a/b/c/d",
            "/bucket/a/b/c/d//",
            "/bucket///a%2F%2Fb/c/d",
        ] {
            assert_eq!(
                literal(spelling).unwrap().key_path,
                c.key_path,
                "{spelling}"
            );
        }
        assert_eq!(literal("//bucket/x").unwrap().segments[0], "bucket");
        assert_eq!(literal("/").unwrap().key_path, "/");
        assert_eq!(literal("//").unwrap().key_path, "/");
        for dots in [
            "/b/../x",
            "/b/./x",
            "/b/%2e%2E/x",
            "/b/x/..",
            "/b/a%2F..%2Fx",
            "/..",
        ] {
            assert_eq!(literal(dots), Err(KeyError::DotSegment), "{dots}");
        }
        assert_eq!(literal("/b/..x/.y/...").unwrap().key_path, "/b/..x/.y/...");
        // `\`, raw or encoded, is a `/` to SeaweedFS.
        for spelling in ["/bucket\\a\\b%5Cc/d", "/bucket/a%5C%5Cb/c\\d"] {
            assert_eq!(
                literal(spelling).unwrap().key_path,
                c.key_path,
                "{spelling}"
            );
        }
        assert_eq!(literal("/b\\x").unwrap().segments, ["b", "x"]);
        assert_eq!(literal("/b/..\\x"), Err(KeyError::DotSegment));
        assert_eq!(route_form("/b\\x%5Cy"), Ok("/b/x/y".into()));
        assert_eq!(without_params("/a;x/b;y=1;z/c"), Some("/a/b/c".into()));
        assert_eq!(without_params("/rec/;x/sub/;/x"), Some("/rec/sub/x".into()));
        assert_eq!(without_params("/;x"), Some("/".into()));
        assert_eq!(without_params("/a/b"), None);
        assert_eq!(route_form("//b//x/"), Ok("/b/x/".into()));
        assert_eq!(route_form("/b%2F%2Fx"), Ok("/b/x".into()));
        assert!(matches!(
            route_form("/b/x"),
            Ok(std::borrow::Cow::Borrowed("/b/x"))
        ));
        assert_eq!(literal("/b/%6Fbj").unwrap().key_path, "/b/obj");
        // `+` and space are one name to some S3 implementations.
        for spelling in ["/b/a+b", "/b/a%2Bb", "/b/a%2bb", "/b/a%20b"] {
            assert_eq!(literal(spelling).unwrap().key_path, "/b/a b", "{spelling}");
        }
        assert_eq!(literal("/b/a+b").unwrap().upstream_target, "/b/a+b");
        assert_eq!(literal("/b/%zz"), Err(KeyError::InvalidPercentEncoding));
        assert_eq!(literal("/b/%00"), Err(KeyError::ControlCharacter));
    }

    #[test]
    fn templates() {
        let h = http::HeaderMap::new();
        let c = canonicalize("/t1/orders/42/items").unwrap();
        let t = KeyTemplate::parse("/{tenant}/{resource}/{id}").unwrap();
        assert_eq!(t.key_text(&c, &h), Ok("/t1/orders/42".into()));
        let bucket = KeyTemplate::parse("/{bucket}").unwrap();
        assert_eq!(bucket.key_text(&c, &h), Ok("/t1".into()));
        let lit = KeyTemplate::parse("/{tenant}/orders/{id}").unwrap();
        assert_eq!(lit.key_text(&c, &h), Ok("/t1/orders/42".into()));
        let other = KeyTemplate::parse("/{tenant}/users/{id}").unwrap();
        assert!(other.key_text(&c, &h).is_err());
        let short = canonicalize("/t1").unwrap();
        assert!(t.key_text(&short, &h).is_err());
        // Exactly as many segments as the template has.
        let exact = canonicalize("/t1/orders/42").unwrap();
        assert_eq!(t.key_text(&exact, &h), Ok("/t1/orders/42".into()));
        assert_eq!(bucket.key_text(&short, &h), Ok("/t1".into()));
        let hdr = KeyTemplate::parse("header:x-resource").unwrap();
        assert!(hdr.key_text(&c, &h).is_err());
        let mut h2 = http::HeaderMap::new();
        h2.insert("x-resource", " acct-9 ".parse().unwrap());
        assert_eq!(hdr.key_text(&c, &h2), Ok("acct-9".into()));
        // Quoted or not, one key.
        let mut q = http::HeaderMap::new();
        q.insert("x-resource", "\"acct-9\"".parse().unwrap());
        assert_eq!(hdr.key_text(&c, &q), Ok("acct-9".into()));
        for bad in [
            "",
            "   ",
            "a,b",
            "a, b",
            ",",
            "\"\"",
            "\"a\\\"b\"",
            "\"a\\b\"",
        ] {
            let mut h3 = http::HeaderMap::new();
            h3.insert("x-resource", bad.parse().unwrap());
            assert_eq!(
                hdr.key_text(&c, &h3),
                Err(KeyError::KeyHeader("x-resource".into())),
                "{bad:?}"
            );
        }
        let mut twice = http::HeaderMap::new();
        twice.append("x-resource", "a".parse().unwrap());
        twice.append("x-resource", "b".parse().unwrap());
        assert!(
            hdr.key_text(&c, &twice).is_err(),
            "a repeated key header is refused"
        );
        let split = literal("/bkt%2Fa/obj").unwrap();
        assert!(
            bucket.key_text(&split, &h).is_err(),
            "a segment decoding to '/' is refused"
        );
        assert!(KeyTemplate::parse("bucket").is_err());
        assert!(KeyTemplate::parse("/{}").is_err());
        assert!(KeyTemplate::parse("/a//b").is_err());
        assert_eq!(t.to_string(), "/{tenant}/{resource}/{id}");
    }

    #[test]
    fn plain_host_spellings() {
        for plain in [
            "api.example",
            "api.example:8080",
            "[::1]:80",
            "10.0.0.1",
            "[::1]",
        ] {
            assert!(host_spelled_plainly(plain), "{plain}");
        }
        for other in [
            "Api.example",
            "api.example.",
            "api.example.:80",
            "API.EXAMPLE",
            "[::ABCD]",
            "",
            "a b",
        ] {
            assert!(!host_spelled_plainly(other), "{other}");
        }
    }

    #[test]
    fn one_authority_parse_for_every_source() {
        let h = |t: &str| authority_host(t).map(|(h, _)| h);
        assert_eq!(h("Example.COM."), Ok("example.com".into()));
        assert_eq!(h("example.com:8080"), Ok("example.com".into()));
        assert_eq!(h("[::1]:8080"), Ok("::1".into()));
        assert_eq!(h("[::1]"), Ok("::1".into()));
        assert_eq!(authority_host("[::1]:80"), Ok(("::1".into(), Some(80))));
        assert!(h("user@example.com").is_err());
        assert!(h("u:p@[::1]:80").is_err());
        assert!(h("").is_err());
        assert!(h("a b").is_err());
        assert!(h(":80").is_err());
    }

    #[test]
    fn route_form_is_the_decoded_path() {
        assert_eq!(
            route_form("/bkt/reports%2Fy.csv?x=1"),
            Ok("/bkt/reports/y.csv".into())
        );
        assert_eq!(
            route_form("/bkt/report%73//z"),
            Ok("/bkt/reports/z".into()),
            "runs of `/` merged"
        );
        assert_eq!(route_form("/a/%FF"), Ok("/a/\u{FFFD}".into()));
        assert!(route_form("/a/%zz").is_err());
        assert!(route_form("a").is_err());
    }

    fn seg_char() -> impl Strategy<Value = String> {
        prop_oneof![
            "[a-zA-Z0-9._~-]".prop_map(|s| s),
            // Escapes of a percent sign, to probe double encoding.
            Just("%25".to_string()),
            // Any escape, either hex case.
            (any::<u8>(), any::<bool>()).prop_map(|(b, lower)| if lower {
                format!("%{b:02x}")
            } else {
                format!("%{b:02X}")
            }),
            "[!$&'()*+,=:@]".prop_map(|s| s),
        ]
    }

    fn path() -> impl Strategy<Value = String> {
        proptest::collection::vec(proptest::collection::vec(seg_char(), 1..5), 1..4).prop_map(
            |segs| {
                segs.iter()
                    .map(|s| format!("/{}", s.concat()))
                    .collect::<String>()
            },
        )
    }

    /// What a decoding backend would see: the path fully percent-decoded.
    fn decoded(p: &str) -> Vec<u8> {
        let b = p.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < b.len() {
            if b[i] == b'%' {
                out.push(hex_val(b[i + 1]).unwrap() * 16 + hex_val(b[i + 2]).unwrap());
                i += 3;
            } else {
                out.push(b[i]);
                i += 1;
            }
        }
        out
    }

    proptest! {
        /// Two accepted paths get the same key if and only if a decoding
        /// backend would see the same resource.
        #[test]
        fn same_key_iff_same_resource(a in path(), b in path()) {
            if let (Ok(ka), Ok(kb)) = (key(&a), key(&b)) {
                prop_assert_eq!(ka == kb, decoded(&a) == decoded(&b), "{} vs {}", a, b);
            }
        }

        /// Every spelling of one resource (any byte escaped or not, either
        /// hex case) has one route form, so it meets one route; that
        /// route's parse then gives one key: literal always, canonical
        /// whenever it accepts the spelling at all.
        #[test]
        fn every_spelling_meets_one_route_and_one_key(
            p in path(),
            choices in proptest::collection::vec((any::<bool>(), any::<bool>()), 64),
        ) {
            // Respell: escape plain bytes (never '/': that would be
            // another path) at random, in either hex case.
            let mut other = String::new();
            let mut i = 0;
            for (n, c) in p.chars().enumerate() {
                let (escape, lower) = choices[n % choices.len()];
                if escape && c != '/' && c != '%' && i == 0 {
                    if lower {
                        other.push_str(&format!("%{:02x}", c as u32));
                    } else {
                        other.push_str(&format!("%{:02X}", c as u32));
                    }
                } else {
                    other.push(c);
                }
                // Inside an escape: copy its two hex digits as they are.
                i = match (c, i) {
                    ('%', 0) => 2,
                    (_, 0) => 0,
                    (_, n) => n - 1,
                };
            }
            prop_assert_eq!(route_form(&p), route_form(&other), "{} vs {}", p, other);
            if let (Ok(a), Ok(b)) = (literal(&p), literal(&other)) {
                prop_assert_eq!(a.key_path, b.key_path);
            }
            if let (Ok(a), Ok(b)) = (canonicalize(&p), canonicalize(&other)) {
                prop_assert_eq!(a.key_path, b.key_path);
            }
        }

        /// A server that merges runs of `/` reads every doubling of a
        /// path's slashes (and a trailing one) as the path: route forms and
        /// literal keys read it so too.
        #[test]
        fn doubled_slashes_are_one_name(p in path(), doubles in proptest::collection::vec(proptest::bool::ANY, 8)) {
            let mut other = String::new();
            for (n, c) in p.chars().enumerate() {
                other.push(c);
                if c == '/' && doubles[n % doubles.len()] {
                    other.push('/');
                }
            }
            if doubles[0] {
                other.push('/');
            }
            let form = |t: &str| route_form(t).map(|f| f.trim_end_matches('/').to_string());
            prop_assert_eq!(form(&p), form(&other), "{} vs {}", p, other);
            prop_assert_eq!(literal(&p).map(|c| c.key_path), literal(&other).map(|c| c.key_path));
        }

        /// Canonicalization is idempotent: the forwarded target parses to the
        /// same key and the same target again.
        #[test]
        fn idempotent(p in path(), q in proptest::option::of("[a-z=&%0-9]{0,8}")) {
            let target = match &q { Some(q) => format!("{p}?{q}"), None => p.clone() };
            if let Ok(c) = canonicalize(&target) {
                let again = canonicalize(&c.upstream_target).unwrap();
                prop_assert_eq!(&again, &c);
            }
        }

        /// Whatever bytes come in, the parse never panics, and an accepted
        /// path never contains a dot segment, an empty segment or an encoded
        /// separator in its key.
        #[test]
        fn accepted_keys_are_unambiguous(raw in "/[a-zA-Z0-9%./;\\\\~_-]{0,20}") {
            if let Ok(c) = canonicalize(&raw) {
                for seg in &c.segments {
                    prop_assert!(!seg.is_empty() && seg != "." && seg != "..");
                    let upper = seg.to_ascii_uppercase();
                    prop_assert!(!upper.contains("%2F") && !upper.contains("%5C") && !seg.contains('\\'));
                }
            }
        }
    }
}
