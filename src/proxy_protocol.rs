//! The PROXY protocol (HAProxy's, versions 1 and 2) in front of a
//! connection, and the ranges of addresses trusted to speak for clients.
//!
//! A load balancer that passes TCP through (AWS NLB, HAProxy in `mode tcp`,
//! a Kubernetes cloud balancer) hides the client: the socket's peer is the
//! balancer. With `proxy_protocol` on a listener, each connection starts
//! with a header naming the client, which fencegate reads before TLS and
//! HTTP. Only peers in `trusted_proxies` may send one: anyone else could
//! name any address. Parsing is the `ppp` crate's.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use ipnet::IpNet;
use ppp::{v1, v2, HeaderResult, PartialResult};
use tokio::io::{AsyncRead, AsyncReadExt};

/// Longest version 1 header (the specification's 107 bytes).
const V1_MAX: usize = 107;
/// The version 2 signature, and the fixed part of its header.
const V2_SIGNATURE: &[u8; 12] = b"\r\n\r\n\0\r\nQUIT\n";
const V2_FIXED: usize = 16;

/// Addresses allowed to speak for clients: a PROXY header, or the
/// `X-Forwarded-For`/`Forwarded` items they add.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrustedProxies(Vec<IpNet>);

impl TrustedProxies {
    /// From CIDR ranges or single addresses (`10.0.0.0/8`, `192.0.2.7`,
    /// `2001:db8::/32`); the first that does not parse is the error.
    pub fn parse<S: AsRef<str>>(items: &[S]) -> Result<Self, String> {
        items
            .iter()
            .map(|item| {
                let item = item.as_ref().trim();
                item.parse::<IpNet>()
                    .or_else(|_| item.parse::<IpAddr>().map(IpNet::from))
                    .map_err(|_| format!("{item:?} is not an address or a CIDR range"))
            })
            .collect::<Result<_, _>>()
            .map(Self)
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = canonical(ip);
        self.0.iter().any(|net| net.contains(&ip))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The ranges as written back to a config file.
    pub fn to_strings(&self) -> Vec<String> {
        self.0.iter().map(ToString::to_string).collect()
    }

    /// The client a chain of `X-Forwarded-For` items names, read from the
    /// right: the first address not in these ranges (proxies append, so
    /// only what trusted hops added can be believed). `None` if every item
    /// is trusted or one does not parse before an untrusted one is found.
    pub fn client_in_chain<'a>(
        &self,
        items: impl DoubleEndedIterator<Item = &'a str>,
    ) -> Option<IpAddr> {
        for item in items.rev() {
            let ip = canonical(parse_item(item)?);
            if !self.contains(ip) {
                return Some(ip);
            }
        }
        None
    }
}

/// An `X-Forwarded-For` item: an address, maybe with a port or brackets.
fn parse_item(item: &str) -> Option<IpAddr> {
    let item = item.trim();
    item.parse::<IpAddr>()
        .ok()
        .or_else(|| item.parse::<SocketAddr>().ok().map(|s| s.ip()))
        .or_else(|| item.strip_prefix('[')?.strip_suffix(']')?.parse().ok())
}

/// An IPv4 client on a dual-stack socket shows as `::ffff:a.b.c.d`.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// Why a connection's PROXY header was refused.
#[derive(Debug, thiserror::Error)]
pub enum HeaderError {
    #[error("no PROXY protocol header within {0:?}")]
    Timeout(Duration),
    #[error("the connection ended before its PROXY protocol header did")]
    Closed,
    #[error("not a PROXY protocol header: {0}")]
    Invalid(String),
}

/// Reads a PROXY header (version 1 or 2) off the start of `stream`,
/// taking exactly its bytes, so that what follows (TLS, HTTP) is left as
/// it came. Returns the client it names: `None` for a health check of the
/// balancer's own (version 2 `LOCAL`, version 1 `UNKNOWN`) or a non-IP
/// source, which keep the socket's peer.
pub async fn read_header<S: AsyncRead + Unpin>(
    stream: &mut S,
    within: Duration,
) -> Result<Option<SocketAddr>, HeaderError> {
    match tokio::time::timeout(within, read_header_bytes(stream)).await {
        Ok(r) => r,
        Err(_) => Err(HeaderError::Timeout(within)),
    }
}

async fn read_header_bytes<S: AsyncRead + Unpin>(
    stream: &mut S,
) -> Result<Option<SocketAddr>, HeaderError> {
    let closed = |_| HeaderError::Closed;
    // The shortest header of either version ("PROXY UNKNOWN\r\n") is 15
    // bytes: reading that much never takes a byte of what follows.
    let mut buf = vec![0u8; 15];
    stream.read_exact(&mut buf).await.map_err(closed)?;
    if buf.starts_with(V2_SIGNATURE) {
        buf.resize(V2_FIXED, 0);
        stream.read_exact(&mut buf[15..]).await.map_err(closed)?;
        let len = usize::from(u16::from_be_bytes([buf[14], buf[15]]));
        buf.resize(V2_FIXED + len, 0);
        stream
            .read_exact(&mut buf[V2_FIXED..])
            .await
            .map_err(closed)?;
    } else if buf.starts_with(b"PROXY ") {
        // Version 1 ends at CRLF, at most 107 bytes in: one byte at a time,
        // so that nothing after it is read.
        while !buf.ends_with(b"\r\n") {
            if buf.len() >= V1_MAX {
                return Err(HeaderError::Invalid(
                    "a version 1 line longer than 107 bytes".into(),
                ));
            }
            buf.push(stream.read_u8().await.map_err(closed)?);
        }
    } else {
        return Err(HeaderError::Invalid(format!(
            "it starts with {:?}",
            String::from_utf8_lossy(&buf)
        )));
    }
    client_of(&buf)
}

/// The client a complete header names.
pub fn client_of(header: &[u8]) -> Result<Option<SocketAddr>, HeaderError> {
    client_named(header).map(|c| c.map(|a| SocketAddr::new(canonical(a.ip()), a.port())))
}

fn client_named(header: &[u8]) -> Result<Option<SocketAddr>, HeaderError> {
    let parsed = HeaderResult::parse(header);
    if parsed.is_incomplete() {
        return Err(HeaderError::Invalid("incomplete".into()));
    }
    match parsed {
        HeaderResult::V1(Ok(h)) => Ok(match h.addresses {
            v1::Addresses::Tcp4(a) => Some(SocketAddr::new(a.source_address.into(), a.source_port)),
            v1::Addresses::Tcp6(a) => Some(SocketAddr::new(a.source_address.into(), a.source_port)),
            v1::Addresses::Unknown => None,
        }),
        HeaderResult::V2(Ok(h)) => Ok(match (h.command, h.addresses) {
            (v2::Command::Local, _) => None,
            (_, v2::Addresses::IPv4(a)) => {
                Some(SocketAddr::new(a.source_address.into(), a.source_port))
            }
            (_, v2::Addresses::IPv6(a)) => {
                Some(SocketAddr::new(a.source_address.into(), a.source_port))
            }
            _ => None,
        }),
        HeaderResult::V1(Err(e)) => Err(HeaderError::Invalid(e.to_string())),
        HeaderResult::V2(Err(e)) => Err(HeaderError::Invalid(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trusted_ranges_parse_and_match() {
        let t = TrustedProxies::parse(&["10.0.0.0/8", "192.0.2.7", "2001:db8::/32"]).unwrap();
        assert!(t.contains("10.1.2.3".parse().unwrap()));
        assert!(t.contains("::ffff:10.1.2.3".parse().unwrap()), "v4-mapped");
        assert!(t.contains("192.0.2.7".parse().unwrap()));
        assert!(!t.contains("192.0.2.8".parse().unwrap()));
        assert!(t.contains("2001:db8::1".parse().unwrap()));
        assert!(!t.contains("11.0.0.1".parse().unwrap()));
        assert_eq!(
            t.to_strings(),
            ["10.0.0.0/8", "192.0.2.7/32", "2001:db8::/32"]
        );
        for bad in ["10.0.0.0/33", "nope", "", "10.0.0"] {
            assert!(TrustedProxies::parse(&[bad]).is_err(), "{bad:?}");
        }
        assert!(TrustedProxies::default().is_empty());
    }

    #[test]
    fn the_client_is_the_first_untrusted_address_from_the_right() {
        let t = TrustedProxies::parse(&["10.0.0.0/8"]).unwrap();
        let chain = |s: &'static str| t.client_in_chain(s.split(','));
        assert_eq!(
            chain("203.0.113.9, 10.0.0.2"),
            Some("203.0.113.9".parse().unwrap())
        );
        // What the client itself wrote on the left is not believed.
        assert_eq!(
            chain("1.1.1.1, 203.0.113.9, 10.0.0.2"),
            Some("203.0.113.9".parse().unwrap())
        );
        assert_eq!(chain("10.0.0.1, 10.0.0.2"), None);
        assert_eq!(
            chain("[2001:db8::5], 10.0.0.2"),
            Some("2001:db8::5".parse().unwrap())
        );
        assert_eq!(
            chain("198.51.100.1:4711"),
            Some("198.51.100.1".parse().unwrap())
        );
        assert_eq!(chain("garbage, 10.0.0.2"), None);
        assert_eq!(
            chain("::ffff:198.51.100.1"),
            Some("198.51.100.1".parse().unwrap())
        );
    }

    #[test]
    fn headers_of_both_versions_name_the_client() {
        let v1 = b"PROXY TCP4 203.0.113.9 10.0.0.1 51000 8080\r\n";
        assert_eq!(
            client_of(v1).unwrap(),
            Some("203.0.113.9:51000".parse().unwrap())
        );
        let v1_6 = b"PROXY TCP6 2001:db8::5 2001:db8::1 51000 8080\r\n";
        assert_eq!(
            client_of(v1_6).unwrap(),
            Some("[2001:db8::5]:51000".parse().unwrap())
        );
        assert_eq!(client_of(b"PROXY UNKNOWN\r\n").unwrap(), None);
        // A v4 client of a dual-stack balancer, as the IPv4 address.
        let mapped = b"PROXY TCP6 ::ffff:203.0.113.9 2001:db8::1 51000 8080\r\n";
        assert_eq!(
            client_of(mapped).unwrap(),
            Some("203.0.113.9:51000".parse().unwrap())
        );
        let v2 = v2::Builder::with_addresses(
            v2::Version::Two | v2::Command::Proxy,
            v2::Protocol::Stream,
            (
                "203.0.113.9:51000".parse::<SocketAddr>().unwrap(),
                "10.0.0.1:8080".parse::<SocketAddr>().unwrap(),
            ),
        )
        .build()
        .unwrap();
        assert_eq!(
            client_of(&v2).unwrap(),
            Some("203.0.113.9:51000".parse().unwrap())
        );
        let local = v2::Builder::with_addresses(
            v2::Version::Two | v2::Command::Local,
            v2::Protocol::Unspecified,
            v2::Addresses::Unspecified,
        )
        .build()
        .unwrap();
        assert_eq!(client_of(&local).unwrap(), None);
        assert!(client_of(b"PROXY TCP4 nope 10.0.0.1 1 2\r\n").is_err());
    }
}
