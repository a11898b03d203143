//! The lane's request-head reading against hyper's server (differential):
//! whatever the lane takes, hyper reads the same method, target, headers
//! and body; the guard that reads the heads going to hyper
//! (`check_request_head`) frames them as hyper does; and a head either
//! refuses gets 400 and is forwarded nowhere (a refused head never comes
//! out as one the lane serves).
#![no_main]

use fencegate::h1::reference::server_reads;
use fencegate::h1::{check_request_head, parse_request, BodyFraming, HeadCheck, Parsed};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let rt = fencegate_fuzz::runtime();
    let lane = parse_request(data);
    let check = check_request_head(data);
    if let Parsed::Head(h) = &lane {
        // The lane's head is one the guard reads the same way.
        match check {
            HeadCheck::Head {
                len,
                body: BodyFraming::Length(n),
            } => assert_eq!((len, n), (h.len, h.body), "the guard framed it otherwise"),
            other => panic!("the lane took a head the guard reads as {other:?}"),
        }
        let Some(whole) = usize::try_from(h.body)
            .ok()
            .and_then(|b| b.checked_add(h.len))
        else {
            return;
        };
        if data.len() < whole {
            // The lane waits for the rest of the body, as hyper would.
            return;
        }
        let (parts, body) = server_reads(rt, data).unwrap_or_else(|| {
            panic!(
                "hyper refused what the lane took: {:?}",
                String::from_utf8_lossy(data)
            )
        });
        assert_eq!(h.parts.method, parts.method);
        assert_eq!(h.parts.uri, parts.uri);
        assert_eq!(h.parts.headers, parts.headers);
        assert_eq!(&body[..], &data[h.len..whole]);
        return;
    }
    // A head the lane leaves to hyper: where the guard says a length
    // frames it, hyper reads that length.
    if let HeadCheck::Head {
        len,
        body: BodyFraming::Length(n),
    } = check
    {
        let Some(whole) = usize::try_from(n).ok().and_then(|b| b.checked_add(len)) else {
            return;
        };
        if data.len() < whole {
            return;
        }
        if let Some((_, body)) = server_reads(rt, data) {
            assert_eq!(
                &body[..],
                &data[len..whole],
                "hyper framed the body otherwise than the guard: {:?}",
                String::from_utf8_lossy(data)
            );
        }
    }
});
