//! A bare Pingora proxy with the steady fenced write's check, started the
//! way `scripts/ab.sh` starts fencegate (`--listen`, `--upstream`; the
//! other flags are ignored) and printing the same `listening proxy=`
//! line, so that the same rounds measure both.
//!
//! Per request: the `X-Fence-Token` header parsed as a number and
//! compared with the highest seen (an atomic: the steady token is answered
//! from memory in fencegate too), a 409 below it, else forwarded over a
//! pooled keep-alive connection.

use std::net::TcpListener;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use pingora_core::server::configuration::ServerConf;
use pingora_core::server::Server;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_core::Result;
use pingora_proxy::{ProxyHttp, Session};

struct Bare {
    upstream: String,
    highest: AtomicU64,
}

#[async_trait]
impl ProxyHttp for Bare {
    type CTX = ();
    fn new_ctx(&self) {}

    async fn request_filter(&self, session: &mut Session, _: &mut ()) -> Result<bool> {
        let token = session
            .req_header()
            .headers
            .get("x-fence-token")
            .and_then(|v| std::str::from_utf8(v.as_bytes()).ok())
            .and_then(|s| s.parse::<u64>().ok());
        let status = match token {
            None => 428,
            Some(t) if t < self.highest.fetch_max(t, Ordering::AcqRel) => 409,
            Some(_) => return Ok(false),
        };
        session.respond_error(status).await?;
        Ok(true)
    }

    async fn upstream_peer(&self, _: &mut Session, _: &mut ()) -> Result<Box<HttpPeer>> {
        Ok(Box::new(HttpPeer::new(
            self.upstream.as_str(),
            false,
            String::new(),
        )))
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let upstream = flag("--upstream").expect("--upstream http://HOST:PORT");
    let upstream = upstream.trim_start_matches("http://").to_string();
    // Pingora binds by name: a free port is found first.
    let listen = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let conf = ServerConf {
        threads: 1,
        ..Default::default()
    };
    let mut server = Server::new_with_opt_and_conf(None, conf);
    server.bootstrap();
    let mut proxy = pingora_proxy::http_proxy_service(
        &server.configuration,
        Bare {
            upstream,
            highest: AtomicU64::new(0),
        },
    );
    proxy.add_tcp(&listen.to_string());
    server.add_service(proxy);
    println!("listening proxy={listen} admin=none");
    server.run_forever();
}
