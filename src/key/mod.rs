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
    #[error("a space, '<', '>', '`' or '#' must be percent-encoded in the path")]
    Unescaped,
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
            // Such headers are dropped before a request is read
            // (`proxy::handle::drop_underscored`): the key could never be
            // found.
            if name.contains('_') {
                return Err(format!(
                    "`{name}`: header names with `_` are dropped from requests; use `-`"
                ));
            }
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
            b if decodes_in_path(b) => out.push(b as char),
            // The bytes whose escape is kept (`%20`): taken raw, they
            // would key the resource apart from its escaped spelling.
            // HTTP's parsers refuse them raw in a target; this keeps the
            // key's rule whole whoever calls it (found by fuzzing,
            // `fuzz/fuzz_targets/key.rs`).
            _ => return Err(KeyError::Unescaped),
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
mod tests;
