//! Test hosts in network namespaces, for network faults (issue 43).
//!
//! A [`Net`] is a switch: a namespace of its own holding a bridge, and each
//! [`Host`] a namespace with one veth link to it and an address in a /24 of
//! 198.18.0.0/15 (the range set aside for testing network equipment), one
//! /24 per net. The test process itself is on the switch too
//! ([`Net::local`], the `.254` of the net, on a link whose other end is in
//! the switch), so every fixture that speaks HTTP from the test (clients,
//! the history checker, curl) reaches the hosts as it reaches loopback. No
//! host has a route out and the switch forwards nothing else: nothing a
//! test sends leaves the machine.
//!
//! Faults are made where a network makes them, in the switch: an
//! nftables `bridge` filter drops a link's frames (one direction or both).
//! The hosts' own stacks see nothing but silence, as across a real
//! partition: a sender's bytes wait in its kernel and are retransmitted
//! when the link heals.
//!
//! Processes run on a host with `ip netns exec` ([`Host::command`]); a
//! socket of the test's own (a client, a recording backend) is made inside
//! a host's namespace by [`Host::enter`] and used from anywhere.
//!
//! Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN), iproute2 and nftables;
//! without them the test fails saying what is missing.

use std::net::Ipv4Addr;
use std::os::fd::AsFd;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// A switch and the hosts on it; every namespace is removed on drop.
pub struct Net {
    /// Unique per net: names are `<tag>s` for the switch, `<tag>h<n>` for
    /// hosts (interface names have at most 15 bytes).
    tag: String,
    /// The net's /24 is 198.18.<subnet>.0 (198.19 past 255).
    subnet: u16,
    hosts: u8,
}

/// One host: its namespace and its address on the switch.
#[derive(Clone)]
pub struct Host {
    pub ns: String,
    pub addr: Ipv4Addr,
}

fn run(what: &str, cmd: &mut Command) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run {cmd:?} ({e}); install iproute2 and nftables (Debian: apt-get install iproute2 nftables)"));
    assert!(
        out.status.success(),
        "{what}: {cmd:?} failed ({}): {}; network namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN)",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

fn ip(args: &[&str]) {
    run("ip", Command::new("ip").args(args));
}

impl Net {
    pub fn new() -> Net {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let tag = format!("fg{}n{n}", std::process::id() % 100_000);
        // Nets of one test binary never share a /24 (the test's own
        // namespace has a link on each); nor, unless 512 nets apart, do
        // those of binaries run one after another.
        let subnet = ((std::process::id() % 512 + n * 37) % 512) as u16;
        let net = Net {
            tag,
            subnet,
            hosts: 0,
        };
        let sw = net.switch();
        ip(&["netns", "add", &sw]);
        ip(&["-n", &sw, "link", "add", "br0", "type", "bridge"]);
        ip(&["-n", &sw, "link", "set", "br0", "up"]);
        // The test's own link: its far end in the switch, so that the
        // switch's removal takes it away.
        let (near, far) = (format!("{}r", net.tag), format!("{}rs", net.tag));
        ip(&["link", "add", &near, "type", "veth", "peer", "name", &far]);
        ip(&["link", "set", &far, "netns", &sw]);
        ip(&["-n", &sw, "link", "set", &far, "master", "br0"]);
        ip(&["-n", &sw, "link", "set", &far, "up"]);
        ip(&[
            "addr",
            "add",
            &format!("{}/24", net.addr(254)),
            "dev",
            &near,
        ]);
        ip(&["link", "set", &near, "up"]);
        // The filter every fault is a rule of.
        net.nft(&["add", "table", "bridge", "faults"]);
        net.nft(&[
            "add",
            "chain",
            "bridge",
            "faults",
            "links",
            "{ type filter hook forward priority 0; }",
        ]);
        net
    }

    fn switch(&self) -> String {
        format!("{}s", self.tag)
    }

    fn addr(&self, last: u8) -> Ipv4Addr {
        let [hi, lo] = (0x12_00u16 + self.subnet).to_be_bytes();
        Ipv4Addr::new(198, hi, lo, last)
    }

    /// The test process on the switch: its address, and its namespace for
    /// cuts (it cannot run commands as a host).
    pub fn local(&self) -> Host {
        Host {
            ns: String::new(),
            addr: self.addr(254),
        }
    }

    fn nft(&self, args: &[&str]) {
        run(
            "nft",
            Command::new("ip")
                .args(["netns", "exec", &self.switch(), "nft"])
                .args(args),
        );
    }

    /// A new host on the switch.
    pub fn host(&mut self) -> Host {
        self.hosts += 1;
        let n = self.hosts;
        assert!(n < 250, "at most 249 hosts on a test network");
        let ns = format!("{}h{n}", self.tag);
        let (inside, outside) = (format!("{}h{n}i", self.tag), format!("{}h{n}o", self.tag));
        ip(&["netns", "add", &ns]);
        ip(&[
            "link", "add", &inside, "type", "veth", "peer", "name", &outside,
        ]);
        ip(&["link", "set", &inside, "netns", &ns]);
        ip(&["link", "set", &outside, "netns", &self.switch()]);
        ip(&[
            "-n",
            &self.switch(),
            "link",
            "set",
            &outside,
            "master",
            "br0",
        ]);
        ip(&["-n", &self.switch(), "link", "set", &outside, "up"]);
        let addr = self.addr(n + 1);
        ip(&[
            "-n",
            &ns,
            "addr",
            "add",
            &format!("{addr}/24"),
            "dev",
            &inside,
        ]);
        ip(&["-n", &ns, "link", "set", &inside, "up"]);
        ip(&["-n", &ns, "link", "set", "lo", "up"]);
        Host { ns, addr }
    }

    /// Drops every frame from `from` to `to` (one direction).
    pub fn cut_one_way(&self, from: &Host, to: &Host) {
        let (f, t) = (from.addr.to_string(), to.addr.to_string());
        self.nft(&[
            "add", "rule", "bridge", "faults", "links", "ip", "saddr", &f, "ip", "daddr", &t,
            "drop",
        ]);
    }

    /// A partition between `a` and `b`: nothing passes either way.
    pub fn cut(&self, a: &Host, b: &Host) {
        self.cut_one_way(a, b);
        self.cut_one_way(b, a);
    }

    /// Every cut healed.
    pub fn heal(&self) {
        self.nft(&["flush", "chain", "bridge", "faults", "links"]);
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // A namespace's links go with it.
        for n in 1..=self.hosts {
            let _ = Command::new("ip")
                .args(["netns", "del", &format!("{}h{n}", self.tag)])
                .status();
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &self.switch()])
            .status();
    }
}

impl Host {
    /// A command that runs `program` on this host.
    pub fn command(&self, program: &str) -> Command {
        assert!(!self.ns.is_empty(), "the test's own link runs no commands");
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns, program]);
        c
    }

    /// Runs `f` with this thread in the host's namespace, and back: the
    /// sockets `f` makes belong to the host for their whole life, whichever
    /// thread then uses them. `f` must not block on the async runtime.
    pub fn enter<T>(&self, f: impl FnOnce() -> T) -> T {
        assert!(
            !self.ns.is_empty(),
            "the test's own link is no host to enter"
        );
        use rustix::thread::{move_into_link_name_space, LinkNameSpaceType};
        let home = std::fs::File::open("/proc/thread-self/ns/net").expect("own namespace");
        let there = std::fs::File::open(format!("/run/netns/{}", self.ns))
            .unwrap_or_else(|e| panic!("namespace {}: {e}", self.ns));
        move_into_link_name_space(there.as_fd(), Some(LinkNameSpaceType::Network))
            .unwrap_or_else(|e| panic!("cannot enter namespace {} ({e}): needs root", self.ns));
        let out = f();
        move_into_link_name_space(home.as_fd(), Some(LinkNameSpaceType::Network))
            .expect("back to the test's namespace");
        out
    }

    /// A TCP connection from this host to `to`.
    pub async fn connect(
        &self,
        to: std::net::SocketAddr,
    ) -> std::io::Result<tokio::net::TcpStream> {
        if self.ns.is_empty() {
            return tokio::net::TcpStream::connect(to).await;
        }
        let socket = self.enter(tokio::net::TcpSocket::new_v4)?;
        socket.connect(to).await
    }

    /// What `ss -tn` prints on this host for connections to `peer`.
    pub fn sockets_to(&self, peer: Ipv4Addr) -> String {
        let out = self
            .command("ss")
            .args(["-tnH", "dst", &peer.to_string()])
            .output()
            .expect("ss (iproute2)");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

/// A redis-server on a test host, port 6379, without persistence (the
/// tests here are about the network, not the disk); killed on drop.
pub struct RedisOn {
    pub url: String,
    child: std::process::Child,
}

impl RedisOn {
    pub async fn start(host: &Host) -> RedisOn {
        let server = super::servers::require("redis-server", "redis-server");
        let child = host
            .command(&server)
            .args(["--port", "6379", "--bind", &host.addr.to_string()])
            .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start redis-server");
        let redis = RedisOn {
            url: format!("redis://{}:6379", host.addr),
            child,
        };
        // Ready when it answers a PING from `from`.
        let addr = std::net::SocketAddr::from((host.addr, 6379));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            if let Ok(mut s) = tokio::net::TcpStream::connect(addr).await {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let mut buf = [0u8; 7];
                if s.write_all(b"PING\r\n").await.is_ok()
                    && s.read_exact(&mut buf).await.is_ok()
                    && &buf == b"+PONG\r\n"
                {
                    // As an operator does once for a new store.
                    let out = Command::new(super::bin())
                        .args(["init-store", "--store", &redis.url])
                        .output()
                        .expect("run fencegate init-store");
                    assert!(
                        out.status.success(),
                        "fencegate init-store: {}",
                        String::from_utf8_lossy(&out.stderr)
                    );
                    return redis;
                }
            }
            assert!(
                std::time::Instant::now() < deadline,
                "redis-server on {} did not answer within 20 s",
                host.ns
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }
}

impl Drop for RedisOn {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
