//! The key canonicalizer's unit and property tests.

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
    // Dropped from every request, so never a key's header.
    assert!(KeyTemplate::parse("header:x_resource").is_err());
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
    proptest::collection::vec(proptest::collection::vec(seg_char(), 1..5), 1..4).prop_map(|segs| {
        segs.iter()
            .map(|s| format!("/{}", s.concat()))
            .collect::<String>()
    })
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

/// Found by the key fuzz target (`/%20/` and `/ `: one resource to a
/// decoding backend, two keys): every printable byte, raw or escaped,
/// gives one key, or the raw spelling is refused.
#[test]
fn a_byte_raw_or_escaped_takes_one_key() {
    assert_eq!(key("/ "), Err(KeyError::Unescaped));
    assert_eq!(key("/%20/").as_deref(), Ok("/%20"));
    for b in 0x20u8..0x7F {
        if matches!(b, b'/' | b'%' | b'?' | b'#') {
            continue; // structure: the separator, the escape, the query, the fragment
        }
        let raw = format!("/a{}b", b as char);
        let escaped = format!("/a%{b:02X}b");
        match (key(&raw), key(&escaped)) {
            (Ok(r), Ok(e)) => assert_eq!(r, e, "{raw:?} and {escaped:?}"),
            (Err(_), _) => {}
            (Ok(r), Err(e)) => panic!("{raw:?} keys as {r:?} but {escaped:?} is refused: {e}"),
        }
    }
}
