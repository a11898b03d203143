//! The Redis engine's unit tests: reading INFO and Sentinel's answers.

use super::conn::*;
use super::sentinel::*;

#[test]
fn replication_reads_the_role_and_the_replicas_online() {
    let info = "# Replication\r\nrole:master\r\nconnected_slaves:2\r\n\
                slave0:ip=127.0.0.1,port=1,state=online,offset=5,lag=0\r\n\
                slave1:ip=127.0.0.1,port=2,state=wait_bgsave,offset=0,lag=0\r\n\
                master_failover_state:no-failover\r\n";
    assert_eq!(replication(info), ("master".to_string(), 1));
    assert_eq!(
        replication("role:slave\r\nmaster_link_status:up\r\n"),
        ("slave".to_string(), 0)
    );
    assert_eq!(replication("").0, "server of unknown role");
}

#[test]
fn sentinel_counts_the_replicas_it_sees_up() {
    let entry = |flags: &str| {
        vec![
            "name".to_string(),
            "127.0.0.1:1".into(),
            "flags".into(),
            flags.into(),
        ]
    };
    let replicas = vec![
        entry("slave"),
        entry("s_down,slave"),
        entry("slave,disconnected"),
        entry("o_down,slave"),
        entry("slave,promoted"),
    ];
    assert_eq!(sentinel_up(&replicas), 2);
    // A demoted primary not yet reconfigured reports itself a primary.
    let reported = |role: &str| {
        let mut e = entry("slave");
        e.extend(["role-reported".to_string(), role.to_string()]);
        e
    };
    assert_eq!(sentinel_up(&[reported("master"), reported("slave")]), 1);
    assert_eq!(sentinel_up(&[]), 0);
    assert_eq!(sentinel_up(&[vec!["flags".into()]]), 0);
}

/// A Sentinel's view: the master at `port` with `flags` (and a
/// `failover-state` when given), configuration `epoch`, and one replica
/// (at port 7, flagged `promoted` while a failover is on) that is up and
/// reports `replica_role`.
fn view(sentinel: usize, port: u16, flags: &str, epoch: u64, replica_role: &str) -> View {
    let (flags, state) = match flags.split_once(' ') {
        Some((f, state)) => (f, Some(state)),
        None => (flags, None),
    };
    let mut master: Vec<String> = [
        "name",
        "fg",
        "ip",
        "127.0.0.1",
        "port",
        &port.to_string(),
        "flags",
        flags,
        "config-epoch",
        &epoch.to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if let Some(state) = state {
        master.extend(["failover-state".to_string(), state.to_string()]);
    }
    let replica_flags = if state.is_some() {
        "slave,promoted"
    } else {
        "slave"
    };
    let replica = [
        "ip",
        "127.0.0.1",
        "port",
        "7",
        "flags",
        replica_flags,
        "role-reported",
        replica_role,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    View::read(sentinel, &master, vec![replica])
}

#[test]
fn a_primary_is_used_when_a_majority_of_sentinels_name_it_and_none_replaces_it() {
    let addr = ("127.0.0.1".to_string(), 1);
    let views = [
        view(0, 1, "master", 3, "slave"),
        view(1, 1, "master", 3, "slave"),
    ];
    assert_eq!(judge(&addr, &views, 3), Ok(1));
    // A demoted old primary listed as the replica, not yet reconfigured:
    // not waited for.
    let views = [
        view(0, 1, "master", 3, "master"),
        view(1, 1, "master", 3, "master"),
    ];
    assert_eq!(judge(&addr, &views, 3), Ok(0));
    // A Sentinel cut off with an old primary names it with an older epoch:
    // the newer configuration is the one used.
    let views = [
        view(0, 1, "master", 3, "slave"),
        view(1, 1, "master", 3, "slave"),
        view(2, 2, "master", 2, "slave"),
    ];
    assert_eq!(judge(&addr, &views, 3), Ok(1));
    // A failover attempt still waiting for its election replaces nothing.
    let views = [
        view(
            0,
            1,
            "master,o_down,failover_in_progress wait_start",
            3,
            "slave",
        ),
        view(1, 1, "master", 3, "slave"),
    ];
    assert_eq!(judge(&addr, &views, 3), Ok(1));
    // After the promotion, the leader's entry keeps the old address until
    // the failover ends, but names the promoted node: it may be used.
    let promoted = ("127.0.0.1".to_string(), 7);
    let views = [
        view(
            0,
            1,
            "master,failover_in_progress reconf_slaves",
            4,
            "master",
        ),
        view(1, 7, "master", 4, "master"),
    ];
    assert_eq!(judge(&promoted, &views, 3), Ok(0));
}

#[test]
fn a_primary_being_replaced_or_named_by_a_minority_is_refused() {
    let addr = ("127.0.0.1".to_string(), 1);
    // Before the switch: the leader replaces the master, the others still
    // name it, and the promoted node reports itself a primary.
    let views = [
        view(0, 1, "master", 2, "master"),
        view(
            1,
            1,
            "master,failover_in_progress wait_promotion",
            3,
            "master",
        ),
    ];
    let why = judge(&addr, &views, 3).unwrap_err();
    assert!(
        why.contains("Sentinel 1 is failing it over (wait_promotion)"),
        "{why}"
    );
    // The leader has promoted the replica and reconfigures the others.
    let views = [
        view(0, 1, "master", 2, "master"),
        view(
            1,
            1,
            "master,failover_in_progress reconf_slaves",
            3,
            "master",
        ),
    ];
    assert!(judge(&addr, &views, 3)
        .unwrap_err()
        .contains("failing it over"));
    // After the leader's switch, before the others heard of it.
    let views = [
        view(0, 1, "master", 2, "master"),
        view(2, 7, "master", 3, "master"),
    ];
    let why = judge(&addr, &views, 3).unwrap_err();
    assert!(why.contains("Sentinel 2 names 127.0.0.1:7"), "{why}");
    assert!(why.contains("epoch 3 > 2"), "{why}");
    // Cut off with one Sentinel of three: it cannot know.
    let views = [view(0, 1, "master", 3, "slave")];
    let why = judge(&addr, &views, 3).unwrap_err();
    assert!(why.contains("only 1 of 3 Sentinels answered"), "{why}");
    // Two answered, one of them still naming an older primary.
    let views = [
        view(0, 1, "master", 3, "slave"),
        view(1, 9, "master", 3, "slave"),
    ];
    let why = judge(&addr, &views, 3).unwrap_err();
    assert!(
        why.contains("1 of 3 Sentinels name it, not a majority"),
        "{why}"
    );
    // Every Sentinel moved on.
    let views = [
        view(0, 7, "master", 3, "master"),
        view(1, 7, "master", 3, "master"),
    ];
    assert!(judge(&addr, &views, 3)
        .unwrap_err()
        .contains("no Sentinel names it"));
}

/// A `redis-server` on a free loopback port, killed when dropped.
struct Server {
    child: std::process::Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Server {
    fn start(replica_of: Option<u16>) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = tempfile::tempdir().unwrap();
        let mut cmd = std::process::Command::new("redis-server");
        cmd.args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
        ])
        .arg("--dir")
        .arg(dir.path())
        .stdout(std::process::Stdio::null());
        if let Some(p) = replica_of {
            cmd.args(["--replicaof", "127.0.0.1", &p.to_string()]);
        }
        let child = cmd
            .spawn()
            .expect("redis-server not found: install the Debian package redis-server");
        let s = Self {
            child,
            port,
            _dir: dir,
        };
        s.wait_for(|c| redis::cmd("PING").query::<String>(c).is_ok());
        s
    }

    fn client(&self) -> redis::Connection {
        redis::Client::open(format!("redis://127.0.0.1:{}", self.port))
            .unwrap()
            .get_connection()
            .unwrap()
    }

    /// Polls `ok` on a fresh connection every 20 ms, for up to 10 s.
    fn wait_for(&self, mut ok: impl FnMut(&mut redis::Connection) -> bool) {
        for _ in 0..500 {
            let c = redis::Client::open(format!("redis://127.0.0.1:{}", self.port))
                .unwrap()
                .get_connection();
            if let Ok(mut c) = c {
                if ok(&mut c) {
                    return;
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        panic!("redis on {} never got there", self.port);
    }

    fn online_replicas(&self) -> u32 {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query(&mut self.client())
            .unwrap();
        replication(&info).1
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The replicas a call waits for belong to the connection it goes on: a
/// runtime that reconnects to a primary with no replica online (0) does not
/// stop the wait of calls on another runtime's older connection, which
/// was made while a replica was online (1).
#[tokio::test]
async fn the_replica_count_is_kept_per_connection() {
    let primary = Server::start(None);
    let replica = Server::start(Some(primary.port));
    primary.wait_for(|_| primary.online_replicas() == 1);
    let backend = RedisBackend::new(
        &format!("redis://127.0.0.1:{}", primary.port),
        Options {
            sentinel: None,
            password: None,
            pem: None,
            // WAIT gets half: room for a replica on a busy machine.
            timeout: std::time::Duration::from_secs(2),
            replicas_to_wait: None,
        },
    )
    .unwrap();
    let set = || {
        let mut c = redis::cmd("SET");
        c.arg("fencegate:test").arg(1);
        c
    };
    {
        let _w = crate::slot::become_worker(0);
        let _: () = backend.waited(set()).await.expect("waited for the replica");
    }
    // The replica stops, and the primary drops it.
    signal(replica.child.id(), "STOP");
    let _: u32 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("replica")
        .query(&mut primary.client())
        .unwrap();
    primary.wait_for(|_| primary.online_replicas() == 0);
    {
        // Another runtime connects now: none online, nothing to wait for.
        let _w = crate::slot::become_worker(1);
        let _: () = backend.waited(set()).await.expect("no replica to wait for");
    }
    {
        // The first runtime's connection still waits for its replica.
        let _w = crate::slot::become_worker(0);
        let e = backend.waited::<()>(set()).await.unwrap_err();
        assert!(e.to_string().contains("0 of 1 replicas"), "{e}");
    }
    signal(replica.child.id(), "CONT");
}

fn signal(pid: u32, name: &str) {
    let ok = std::process::Command::new("kill")
        .args([&format!("-{name}"), &pid.to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -{name} {pid}");
}
