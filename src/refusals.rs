//! The last refusals, kept in memory for the operator (issue 46): a
//! bounded ring the request path writes one entry into per refusal it
//! answers, and the admin API reads (`GET /v1/refusals`, the admin page).
//!
//! Only refused writes are kept; an admitted request writes nothing here
//! (its record keeps its target and user agent for the log line and for
//! this, a reference count each). The ring is a mutex around a `VecDeque`, held for one push or one
//! copy of the entries asked for; refusals are the rare path, and a burst
//! of them (a stale writer retrying) contends on it no more than on the
//! log line each also writes.

use std::net::IpAddr;
use std::sync::Mutex;

use serde::Serialize;

use crate::ring::{Numbered, SeqRing};

/// One refusal, as the operator sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Refusal {
    /// Increases by one per refusal of this process: what a reader passes
    /// as `since` to get only newer ones.
    pub seq: u64,
    /// When it was refused: milliseconds since the Unix epoch.
    pub at_ms: u64,
    pub status: u16,
    /// Why, in words (the problem's detail).
    pub reason: String,
    /// The fencing decision of a write (`stale`, `missing_token`...), if it
    /// was a write.
    pub decision: Option<&'static str>,
    pub method: String,
    /// The request target, at most [`TARGET_BYTES`] bytes of it.
    pub target: String,
    pub route: Option<String>,
    pub key: Option<String>,
    /// The token the request carried, and the key's highest when it was
    /// refused as stale; strings in JSON (past 2^53 a JSON number loses
    /// precision in most readers).
    #[serde(serialize_with = "crate::token::serialize_maybe_as_text")]
    pub token: Option<u64>,
    #[serde(serialize_with = "crate::token::serialize_maybe_as_text")]
    pub highest: Option<u64>,
    /// The client: the socket's peer, or the one a PROXY header or a
    /// trusted proxy names.
    pub client: IpAddr,
    pub user_agent: Option<String>,
    pub request_id: String,
    /// The W3C trace the client's `traceparent` names.
    pub trace_id: Option<String>,
}

/// The longest request target kept (and logged): longer ones are cut, and
/// end in `...`.
pub const TARGET_BYTES: usize = 512;

/// `text` cut to at most `max` bytes on a character boundary, `...` added
/// when it was cut.
pub fn bounded(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max.saturating_sub(3);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &text[..end])
}

/// Query parameters whose values are credentials (S3 presigned URLs,
/// bearer tokens in a URL): never logged or kept.
const SECRET_PARAMS: &[&str] = &[
    "x-amz-signature",
    "x-amz-credential",
    "x-amz-security-token",
    "signature",
    "awsaccesskeyid",
    "access_token",
    "token",
    "sig",
    "x-goog-signature",
];

/// The request target as it is logged and kept: credentials in the query
/// (presigned URLs) replaced by `REDACTED`, and at most [`TARGET_BYTES`].
pub fn loggable_target(uri: &http::Uri) -> String {
    let path = uri.path();
    let Some(query) = uri.query() else {
        return bounded(path, TARGET_BYTES);
    };
    let mut out = String::with_capacity(path.len() + query.len() + 1);
    out.push_str(path);
    out.push('?');
    for (i, pair) in query.split('&').enumerate() {
        if i > 0 {
            out.push('&');
        }
        match pair.split_once('=') {
            Some((name, _)) if SECRET_PARAMS.iter().any(|s| name.eq_ignore_ascii_case(s)) => {
                out.push_str(name);
                out.push_str("=REDACTED");
            }
            _ => out.push_str(pair),
        }
    }
    bounded(&out, TARGET_BYTES)
}

/// Which refusals a reader wants.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Only those after this sequence number.
    pub since: u64,
    /// Only those whose key contains this text.
    pub key: Option<String>,
    /// Only those of this client.
    pub client: Option<IpAddr>,
    /// At most this many, the newest.
    pub limit: usize,
}

/// The ring of the last refusals.
#[derive(Debug)]
pub struct Refusals {
    kept: usize,
    state: Mutex<SeqRing<Refusal>>,
}

impl Numbered for Refusal {
    fn seq(&self) -> u64 {
        self.seq
    }
    fn set_seq(&mut self, seq: u64) {
        self.seq = seq;
    }
}

impl Refusals {
    /// A ring of the last `kept` refusals (0: none kept).
    pub fn new(kept: usize) -> Self {
        let ring = SeqRing::new(kept);
        Self {
            kept: ring.kept(),
            state: Mutex::new(ring),
        }
    }

    /// How many it keeps.
    pub fn kept(&self) -> usize {
        self.kept
    }

    /// The sequence number of the newest refusal so far (0: none yet).
    pub fn newest(&self) -> u64 {
        self.state.lock().expect("refusal ring lock").newest()
    }

    /// Adds `r`, numbered next (its `seq` is set here), dropping the
    /// oldest when full.
    pub fn push(&self, r: Refusal) {
        if self.kept == 0 {
            return;
        }
        self.state.lock().expect("refusal ring lock").push(r);
    }

    /// The refusals `f` asks for, oldest first, and the sequence number of
    /// the newest refusal so far (0: none yet), for the next `since`.
    pub fn read(&self, f: &Filter) -> (Vec<Refusal>, u64) {
        let ring = self.state.lock().expect("refusal ring lock");
        let newest = ring.newest();
        let mut out: Vec<Refusal> = ring
            .iter()
            .rev()
            .take_while(|r| r.seq > f.since)
            .filter(|r| {
                f.key
                    .as_deref()
                    .is_none_or(|k| r.key.as_deref().is_some_and(|rk| rk.contains(k)))
            })
            .filter(|r| f.client.is_none_or(|c| r.client == c))
            .take(f.limit)
            .cloned()
            .collect();
        out.reverse();
        (out, newest)
    }
}

/// The trace id of a W3C `traceparent` value (`00-<32 hex>-<16 hex>-<2
/// hex>`), if it is one: a version other than `ff`, ids not all zeros.
pub fn trace_id(traceparent: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(traceparent).ok()?.trim();
    let mut parts = text.split('-');
    let (version, trace, parent, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    // Version 00 has exactly four fields; a later version may add more.
    if !hex(version, 2) || version == "ff" || (version == "00" && parts.next().is_some()) {
        return None;
    }
    if !hex(trace, 32) || !hex(parent, 16) || !hex(flags, 2) {
        return None;
    }
    if trace.bytes().all(|b| b == b'0') || parent.bytes().all(|b| b == b'0') {
        return None;
    }
    Some(trace.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(key: &str, client: &str) -> Refusal {
        Refusal {
            seq: 0,
            at_ms: 1,
            status: 409,
            reason: "stale".into(),
            decision: Some("stale"),
            method: "PUT".into(),
            target: "/k".into(),
            route: Some("default".into()),
            key: Some(key.into()),
            token: Some(1),
            highest: Some(2),
            client: client.parse().unwrap(),
            user_agent: None,
            request_id: "r".into(),
            trace_id: None,
        }
    }

    #[test]
    fn the_ring_keeps_the_last_and_numbers_them() {
        let ring = Refusals::new(3);
        for i in 0..5 {
            ring.push(refusal(&format!("default:/k{i}"), "192.0.2.1"));
        }
        let all = Filter {
            limit: 100,
            ..Filter::default()
        };
        let (got, newest) = ring.read(&all);
        assert_eq!(newest, 5);
        assert_eq!(got.iter().map(|r| r.seq).collect::<Vec<_>>(), [3, 4, 5]);
        let (got, _) = ring.read(&Filter {
            since: 4,
            ..all.clone()
        });
        assert_eq!(got.iter().map(|r| r.seq).collect::<Vec<_>>(), [5]);
        let (got, _) = ring.read(&Filter {
            limit: 2,
            ..all.clone()
        });
        assert_eq!(got.iter().map(|r| r.seq).collect::<Vec<_>>(), [4, 5]);
    }

    #[test]
    fn the_ring_filters_by_key_and_client() {
        let ring = Refusals::new(10);
        ring.push(refusal("default:/a", "192.0.2.1"));
        ring.push(refusal("default:/b", "192.0.2.2"));
        ring.push(refusal("default:/ab", "192.0.2.2"));
        let f = Filter {
            limit: 10,
            key: Some("/a".into()),
            ..Filter::default()
        };
        assert_eq!(
            ring.read(&f).0.iter().map(|r| r.seq).collect::<Vec<_>>(),
            [1, 3]
        );
        let f = Filter {
            limit: 10,
            client: Some("192.0.2.2".parse().unwrap()),
            ..Filter::default()
        };
        assert_eq!(
            ring.read(&f).0.iter().map(|r| r.seq).collect::<Vec<_>>(),
            [2, 3]
        );
    }

    #[test]
    fn a_ring_of_none_keeps_none() {
        let ring = Refusals::new(0);
        ring.push(refusal("k", "192.0.2.1"));
        let (got, newest) = ring.read(&Filter {
            limit: 10,
            ..Filter::default()
        });
        assert!(got.is_empty());
        assert_eq!(newest, 0);
    }

    #[test]
    fn targets_are_cut_on_a_character_boundary() {
        assert_eq!(bounded("/abc", 10), "/abc");
        assert_eq!(bounded("/abcdefghij", 8), "/abcd...");
        assert_eq!(bounded("/ééééé", 8), "/éé...");
    }

    #[test]
    fn credentials_in_a_target_are_never_kept() {
        let uri: http::Uri =
            "/b/k?X-Amz-Credential=AKIA%2F1&x-amz-signature=abc&partNumber=2&token=t"
                .parse()
                .unwrap();
        assert_eq!(
            loggable_target(&uri),
            "/b/k?X-Amz-Credential=REDACTED&x-amz-signature=REDACTED&partNumber=2&token=REDACTED"
        );
        assert_eq!(loggable_target(&"/a?b".parse().unwrap()), "/a?b");
        assert_eq!(loggable_target(&"/a".parse().unwrap()), "/a");
    }

    #[test]
    fn traceparent_gives_its_trace_id() {
        let t = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(
            trace_id(t.as_bytes()).as_deref(),
            Some("4bf92f3577b34da6a3ce929d0e0e4736")
        );
        for bad in [
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "",
        ] {
            assert_eq!(trace_id(bad.as_bytes()), None, "{bad}");
        }
        let later = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-more";
        assert!(trace_id(later.as_bytes()).is_some());
    }
}
