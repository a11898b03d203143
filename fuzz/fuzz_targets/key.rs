//! The key canonicalizer: canonical(canonical(x)) = canonical(x); two
//! targets a strict (decoding) backend reads as one resource get one key,
//! and two it reads as different resources get two; what is forwarded
//! decodes to the path that was fenced. Literal mode forwards the target
//! byte for byte and keys it by its decoded path.
#![no_main]

use fencegate::key::{canonicalize, literal, percent_decode, route_form};
use libfuzzer_sys::fuzz_target;

/// The path of a target (before `?`), fully decoded, without a trailing
/// slash: what a decoding backend would see (canonical mode merges `/a/`
/// with `/a`).
fn decoded(target: &str) -> Option<Vec<u8>> {
    let path = target.split('?').next().unwrap_or_default();
    let mut d = percent_decode(path).ok()?;
    if d.len() > 1 && d.ends_with(b"/") {
        d.pop();
    }
    Some(d)
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // Two targets, split at the first NUL (a byte no accepted target has).
    let (a, b) = text.split_once('\0').unwrap_or((text, "/"));
    let _ = route_form(a);
    if let Ok(ca) = canonicalize(a) {
        let again = canonicalize(&ca.upstream_target).expect("a canonical target is accepted");
        assert_eq!(again, ca, "canonical twice differs: {a:?}");
        // What goes upstream decodes to the path that was fenced.
        assert_eq!(decoded(&ca.upstream_target), decoded(a), "{a:?}");
        assert_eq!(decoded(&ca.key_path), decoded(a), "{a:?}");
        if let Ok(cb) = canonicalize(b) {
            assert_eq!(
                ca.key_path == cb.key_path,
                decoded(a) == decoded(b),
                "{a:?} and {b:?}"
            );
        }
    }
    if let Ok(la) = literal(a) {
        assert_eq!(
            la.upstream_target, a,
            "literal mode forwards the target as it came"
        );
        if let Ok(lb) = literal(b) {
            // Spellings of one decoded path share a key.
            if decoded(a) == decoded(b) {
                assert_eq!(la.key_path, lb.key_path, "{a:?} and {b:?}");
            }
        }
    }
});
