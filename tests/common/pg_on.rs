//! PostgreSQL with a synchronous standby, each on a test host of its own
//! (tests/partition.rs's split brain): the primary waits for the standby
//! at every commit (`synchronous_standby_names`), and nothing promotes the
//! standby by itself; the test does, as an operator or Patroni would.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::netns::Host;
use super::servers::{initdb, postgres_bin};

/// The standby's name on the primary.
const STANDBY: &str = "fgstandby";

pub struct PgStandbyOn {
    /// Both hosts, the writable one chosen (`target_session_attrs`).
    pub url: String,
    pub primary: Host,
    pub standby: Host,
    children: std::sync::Mutex<Vec<Child>>,
    standby_data: PathBuf,
    _dir: tempfile::TempDir,
}

impl PgStandbyOn {
    pub fn start(primary: &Host, standby: &Host) -> PgStandbyOn {
        let dir = super::cluster::scratch_dir();
        let data = initdb(dir.path());
        let hba = data.join("pg_hba.conf");
        let mut rules = std::fs::read_to_string(&hba).unwrap();
        rules.push_str("host all all 198.18.0.0/15 trust\n");
        rules.push_str("host replication all 198.18.0.0/15 trust\n");
        std::fs::write(&hba, rules).unwrap();
        let mut children = vec![postgres_on(
            primary,
            &data,
            &[&format!("synchronous_standby_names={STANDBY}")],
        )];
        wait_until("the primary to answer", &data.join("server.log"), || {
            psql(primary, "SELECT 1").is_some()
        });
        // The standby's copy, taken from its own host.
        let standby_data = dir.path().join("standby");
        let out = as_postgres_on(standby, "pg_basebackup")
            .arg("-D")
            .arg(&standby_data)
            .args(["-R", "-X", "stream", "-c", "fast", "-d"])
            .arg(format!(
                "host={} port=5432 user=postgres application_name={STANDBY}",
                primary.addr
            ))
            .output()
            .expect("run pg_basebackup");
        assert!(
            out.status.success(),
            "pg_basebackup: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        children.push(postgres_on(standby, &standby_data, &[]));
        wait_until(
            "the standby to be synchronous",
            &standby_data.join("server.log"),
            || {
                psql(
                primary,
                &format!("SELECT sync_state FROM pg_stat_replication WHERE application_name = '{STANDBY}'"),
            )
            .as_deref()
                == Some("sync")
            },
        );
        let url = format!(
            "postgres://postgres@{}:5432,{}:5432/postgres?target_session_attrs=read-write",
            primary.addr, standby.addr
        );
        super::servers::init_store(&url);
        PgStandbyOn {
            url,
            primary: primary.clone(),
            standby: standby.clone(),
            children: std::sync::Mutex::new(children),
            standby_data,
            _dir: dir,
        }
    }

    /// `pg_ctl promote` of the standby; waits until it takes writes.
    pub fn promote(&self) {
        let out = as_postgres_on(&self.standby, "pg_ctl")
            .arg("-D")
            .arg(&self.standby_data)
            .args(["-w", "promote"])
            .output()
            .expect("run pg_ctl promote");
        assert!(
            out.status.success(),
            "pg_ctl promote: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        wait_until(
            "the standby to leave recovery",
            &self.standby_data.join("server.log"),
            || psql(&self.standby, "SELECT pg_is_in_recovery()").as_deref() == Some("f"),
        );
    }

    /// The old primary stopped for good (kill -9), as an operator fences
    /// it off once its standby was promoted.
    pub fn stop_primary(&self) {
        let mut children = self.children.lock().unwrap();
        let _ = children[0].kill();
        let _ = children[0].wait();
    }
}

impl Drop for PgStandbyOn {
    fn drop(&mut self) {
        for c in self.children.get_mut().unwrap() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `program` (a PostgreSQL binary) as the `postgres` user, on `host`.
/// `setpriv` execs it (`runuser` would fork, and killing the child the
/// test holds would leave the server running).
fn as_postgres_on(host: &Host, program: &str) -> Command {
    let mut c = host.command("setpriv");
    c.args(["--reuid=postgres", "--regid=postgres", "--init-groups"])
        .arg(postgres_bin(program));
    c
}

/// The server on `host`'s address, with no Unix socket (both listen on
/// 5432, and a socket's lock file in a data directory would be copied
/// into the standby's by the base backup).
fn postgres_on(host: &Host, data: &Path, settings: &[&str]) -> Child {
    let mut c = as_postgres_on(host, "postgres");
    c.arg("-D")
        .arg(data)
        .args(["-p", "5432", "-c"])
        .arg(format!("listen_addresses={}", host.addr))
        .args(["-k", ""]);
    for s in settings {
        c.args(["-c", s]);
    }
    let log = std::fs::File::create(data.join("server.log")).unwrap();
    c.stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start postgres")
}

/// One value from `sql` on the server of `host`, from that host.
fn psql(host: &Host, sql: &str) -> Option<String> {
    let out = as_postgres_on(host, "psql")
        .args(["-XAtq", "-h", &host.addr.to_string(), "-p", "5432"])
        .args(["-U", "postgres", "-d", "postgres", "-c", sql])
        .env("PGCONNECT_TIMEOUT", "2")
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Waits (30 s at most) for `f`; on a timeout, fails with the server log
/// at `log`.
fn wait_until(what: &str, log: &Path, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !f() {
        if Instant::now() > deadline {
            let log = std::fs::read_to_string(log).unwrap_or_default();
            panic!("timed out waiting for {what}; the server's log:\n{log}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
