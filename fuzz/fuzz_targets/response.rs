//! Upstream answers: the lane's reading (status line, headers, framing,
//! chunked bodies) against hyper's client (differential). An answer the
//! lane reads whole is one hyper reads the same way: the lane is never
//! laxer than hyper's path. And a chunked body decodes the same however
//! its bytes are split between reads.
#![no_main]

use fencegate::h1::reference::{client_reads, decode_all, lane_reads};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&step, bytes)) = data.split_first() else {
        return;
    };
    let step = usize::from(step).max(1);
    // The decoder alone, on the bytes as a chunked body: split reads
    // change nothing.
    // (Which error is named may depend on where a limit is crossed; that
    // it is refused may not.)
    let whole = decode_all(bytes, bytes.len().max(1)).ok();
    assert_eq!(
        whole,
        decode_all(bytes, step).ok(),
        "reads of {step} bytes decode otherwise"
    );
    if let Some((status, mut headers, body)) = lane_reads(bytes) {
        let rt = fencegate_fuzz::runtime();
        let (h_status, mut h_headers, h_body) = client_reads(rt, bytes).unwrap_or_else(|| {
            panic!(
                "hyper refused what the lane read: {:?}",
                String::from_utf8_lossy(bytes)
            )
        });
        assert_eq!(status, h_status);
        // hyper keeps every Content-Length line it merged; the lane one.
        headers.remove(http::header::CONTENT_LENGTH);
        h_headers.remove(http::header::CONTENT_LENGTH);
        assert_eq!(headers, h_headers);
        assert_eq!(body, h_body);
    }
});
