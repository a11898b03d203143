//! The PROXY protocol header, versions 1 and 2, read off the start of a
//! connection: exactly the header's bytes are consumed, never more (what
//! follows, TLS or HTTP, is left as it came), whatever the header says;
//! and the client it names is the one the bytes spell.
#![no_main]

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use fencegate::proxy_protocol::read_header;
use libfuzzer_sys::fuzz_target;

/// Where the header at the start of `data` ends, by the specification:
/// version 2, its 16 fixed bytes and the length they give; version 1, its
/// CRLF within 107 bytes.
fn header_len(data: &[u8]) -> Option<usize> {
    const V2: &[u8] = b"\r\n\r\n\0\r\nQUIT\n";
    if data.starts_with(V2) {
        let len = u16::from_be_bytes([*data.get(14)?, *data.get(15)?]);
        return Some(16 + usize::from(len));
    }
    if data.starts_with(b"PROXY ") {
        let end = data.windows(2).position(|w| w == b"\r\n")? + 2;
        return (end <= 107).then_some(end);
    }
    None
}

fuzz_target!(|data: &[u8]| {
    let rt = fencegate_fuzz::runtime();
    let mut rest = data;
    let read = rt.block_on(read_header(&mut rest, Duration::from_secs(5)));
    let consumed = data.len() - rest.len();
    match read {
        Ok(client) => {
            let len = header_len(data).expect("a header was read where none is");
            assert_eq!(
                consumed, len,
                "read {consumed} bytes of a {len}-byte header"
            );
            // A version 1 TCP line names the client its text spells.
            if let Some(line) = std::str::from_utf8(&data[..len]).ok() {
                let words: Vec<&str> = line.trim_end().split(' ').collect();
                if let ["PROXY", "TCP4" | "TCP6", src, _, port, _] = words[..] {
                    // Read by the standard library (an address it cannot
                    // read is left to the header's own parser); an IPv4
                    // address mapped into IPv6 is the IPv4 client.
                    if let (Ok(ip), Ok(port)) = (src.parse::<IpAddr>(), port.parse::<u16>()) {
                        let ip = match ip {
                            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
                            v4 => v4,
                        };
                        assert_eq!(client, Some(SocketAddr::new(ip, port)), "{line:?}");
                    }
                }
            }
        }
        Err(_) => {
            // A refused header closes the connection, so what it read past
            // is lost to no one; still, never more than a version 2 header
            // says, or the longest version 1 line.
            let v2 = data.starts_with(b"\r\n\r\n\0\r\nQUIT\n");
            let bound = if v2 {
                header_len(data).unwrap_or(16)
            } else {
                107
            };
            assert!(
                consumed <= bound,
                "consumed {consumed} of a refused header (bound {bound})"
            );
        }
    }
});
