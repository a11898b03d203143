//! The write-ahead log's records on arbitrary and torn files. Replay reads
//! a generation's records up to the first that does not check out, so:
//! - on any bytes, every record it yields is there, byte for byte (encoded
//!   again, it is the bytes it was read from): never a token that was not
//!   written;
//! - on a log torn by a crash (the new generation's appends cut at any
//!   byte, the rest of the preallocated file still holding an older
//!   generation's records, or zeros), it yields a prefix of what was
//!   appended, and every record whose bytes all reached the file: never a
//!   value lower than a durable one.
#![no_main]

use arbitrary::Arbitrary;
use fencegate::store::embedded::{wal_decode, wal_encode, WalRecord};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
enum Rec {
    Raise { key: String, token: u64 },
    Mark { seq: u64, key: String, token: u64 },
    Watermark(u64),
    Generation,
}

impl Rec {
    fn record(&self) -> WalRecord {
        match self {
            Rec::Raise { key, token } => WalRecord::Raise {
                key: key.clone(),
                token: *token,
            },
            Rec::Mark { seq, key, token } => WalRecord::Mark {
                seq: *seq,
                key: key.clone(),
                token: *token,
            },
            Rec::Watermark(w) => WalRecord::Watermark(*w),
            Rec::Generation => WalRecord::Generation,
        }
    }
}

#[derive(Debug, Arbitrary)]
enum Input {
    /// Any bytes, read as generation `generation`.
    Raw { generation: u64, bytes: Vec<u8> },
    /// Generation `generation` appended over an older one's records in the
    /// same file, the appends cut at byte `tear`.
    Torn {
        generation: u64,
        older: Vec<Rec>,
        appended: Vec<Rec>,
        tear: u16,
        zeros_after_older: bool,
    },
}

/// Each decoded record, encoded again, is the bytes at its place.
fn all_there(bytes: &[u8], generation: u64, decoded: &[WalRecord]) {
    let mut again = Vec::new();
    for r in decoded {
        wal_encode(&mut again, generation, r);
    }
    assert!(
        bytes.starts_with(&again),
        "a record was read that the bytes do not hold"
    );
}

fuzz_target!(|input: Input| match input {
    Input::Raw { generation, bytes } => {
        let decoded = wal_decode(&bytes, generation);
        all_there(&bytes, generation, &decoded);
    }
    Input::Torn {
        generation,
        older,
        appended,
        tear,
        zeros_after_older,
    } => {
        let generation = generation.max(2);
        let mut old = Vec::new();
        for r in &older {
            wal_encode(&mut old, generation - 2, &r.record());
        }
        if zeros_after_older {
            old.resize(old.len() + 64, 0);
        }
        let mut new = Vec::new();
        let mut ends = Vec::new();
        for r in &appended {
            wal_encode(&mut new, generation, &r.record());
            ends.push(new.len());
        }
        let tear = usize::from(tear).min(new.len());
        let mut file = new[..tear].to_vec();
        if old.len() > tear {
            file.extend_from_slice(&old[tear..]);
        }
        let decoded = wal_decode(&file, generation);
        all_there(&file, generation, &decoded);
        let written: Vec<WalRecord> = appended.iter().map(Rec::record).collect();
        assert!(
            written.starts_with(&decoded),
            "replay read records that were not appended"
        );
        let durable = ends.iter().filter(|e| **e <= tear).count();
        assert!(
            decoded.len() >= durable,
            "replay lost {} of {durable} records whose bytes reached the file",
            durable - decoded.len()
        );
    }
});
