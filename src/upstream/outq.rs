//! What this host's kernel still holds for the backend on one upstream
//! connection: bytes written and not yet acknowledged (unsent ones among
//! them, and a FIN), as `/proc/self/net/tcp` shows them.
//!
//! Read only to let go of a connection that carried an early-answered
//! write (`kill.rs`): the socket is reset on close (`dial.rs`), which
//! discards what the kernel holds, so it is closed only once nothing is
//! left or once the write's deadline says to discard the rest. The file
//! lists every socket of the network namespace, so it is read rarely, with
//! a growing pause (`kill.rs`), off the worker threads and once for all
//! who ask at the same moment, never on the request path.
//! `SIOCOUTQ` or `TCP_INFO` would answer for one socket, but only through
//! `unsafe` system calls, which this crate forbids.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

/// The kernel's `local_address` / `rem_address` form: each 32-bit word of
/// the address as the host reads it from memory, in hex, then the port.
fn proc_form(addr: SocketAddr) -> String {
    let words: Vec<[u8; 4]> = match addr {
        SocketAddr::V4(a) => vec![a.ip().octets()],
        SocketAddr::V6(a) => a
            .ip()
            .octets()
            .chunks_exact(4)
            .map(|c| [c[0], c[1], c[2], c[3]])
            .collect(),
    };
    let mut out = String::with_capacity(37);
    for w in words {
        out.push_str(&format!("{:08X}", u32::from_ne_bytes(w)));
    }
    out.push_str(&format!(":{:04X}", addr.port()));
    out
}

/// The connection's `tx_queue` in `table` (the text of `/proc/net/tcp` or
/// `tcp6`), or `None` if it is not listed (closed, or never there).
fn tx_queue_in(table: &str, local: SocketAddr, peer: SocketAddr) -> Option<u64> {
    let (local, peer) = (proc_form(local), proc_form(peer));
    table.lines().skip(1).find_map(|line| {
        let mut fields = line.split_whitespace().skip(1);
        let (l, r) = (fields.next()?, fields.next()?);
        if l != local || r != peer {
            return None;
        }
        // `st`, then `tx_queue:rx_queue`.
        let queues = fields.nth(1)?;
        let tx = queues.split(':').next()?;
        u64::from_str_radix(tx, 16).ok()
    })
}

/// Bytes the kernel holds for `peer` on the connection from `local`
/// (unsent, or sent and not acknowledged), or `None` if the connection is
/// not in the kernel's table.
///
/// The table is read off the worker's thread, and once for every
/// connection that asks within the same moment: through a partition many
/// connections may settle at once, and the file lists every socket.
pub(super) async fn unacknowledged(local: SocketAddr, peer: SocketAddr) -> io::Result<Option<u64>> {
    let file = match local {
        SocketAddr::V4(_) => 0,
        SocketAddr::V6(_) => 1,
    };
    let table = fresh_table(file).await?;
    Ok(tx_queue_in(&table, local, peer))
}

/// A reading of a table, and when it began.
type Reading = Option<(Instant, Arc<str>)>;

/// The last reading of each table (IPv4, IPv6).
static TABLES: [tokio::sync::Mutex<Reading>; 2] = [
    tokio::sync::Mutex::const_new(None),
    tokio::sync::Mutex::const_new(None),
];

/// A reading of table `file` begun after this call was: one begun while
/// the caller waited for the lock answers it too.
async fn fresh_table(file: usize) -> io::Result<Arc<str>> {
    let asked = Instant::now();
    let mut last = TABLES[file].lock().await;
    if let Some((at, table)) = &*last {
        if *at >= asked {
            return Ok(table.clone());
        }
    }
    let path = ["/proc/self/net/tcp", "/proc/self/net/tcp6"][file];
    let began = Instant::now();
    let table: Arc<str> = tokio::task::spawn_blocking(move || std::fs::read_to_string(path))
        .await
        .map_err(io::Error::other)??
        .into();
    *last = Some((began, table.clone()));
    Ok(table)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::io::AsyncWriteExt;

    #[test]
    fn a_line_is_read_by_both_addresses() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   \
            0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0 100 0 0 10 0\n   \
            1: 0100007F:D431 0100007F:1F90 01 0000A2C4:00000000 01:00000014 00000000     0        0 2 1 0 20 4 30 10 -1\n";
        let (local, peer) = (
            "127.0.0.1:54321".parse().unwrap(),
            "127.0.0.1:8080".parse().unwrap(),
        );
        assert_eq!(tx_queue_in(table, local, peer), Some(0xA2C4));
        // The other direction, or another port, is another connection.
        assert_eq!(tx_queue_in(table, peer, local), None);
        assert_eq!(
            tx_queue_in(table, local, "127.0.0.1:8081".parse().unwrap()),
            None
        );
        // IPv6: each 32-bit word as the host reads it (on x86, ::1's last
        // word 00000001 is printed 01000000).
        let v6: SocketAddr = "[::1]:443".parse().unwrap();
        let last = u32::from_ne_bytes([0, 0, 0, 1]);
        assert_eq!(
            proc_form(v6),
            format!("000000000000000000000000{last:08X}:01BB")
        );
    }

    /// The real kernel: an idle connection holds nothing; one whose peer
    /// reads nothing holds what its receive window could not take.
    #[tokio::test]
    async fn the_kernel_shows_what_the_peer_has_not_acknowledged() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut ours = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (_theirs, _) = listener.accept().await.unwrap();
        let (local, peer) = (ours.local_addr().unwrap(), ours.peer_addr().unwrap());
        assert_eq!(unacknowledged(local, peer).await.unwrap(), Some(0));
        // Written until the socket takes no more: the peer's window and
        // buffers are full, and the rest waits in ours.
        let chunk = vec![0u8; 1 << 20];
        while tokio::time::timeout(Duration::from_millis(200), ours.write_all(&chunk))
            .await
            .is_ok()
        {}
        let held = unacknowledged(local, peer).await.unwrap().unwrap();
        assert!(held > 0, "nothing held for a peer that reads nothing");
        assert_eq!(
            unacknowledged(local, "127.0.0.1:1".parse().unwrap())
                .await
                .unwrap(),
            None
        );
    }
}
