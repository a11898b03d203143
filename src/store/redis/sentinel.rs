//! Finding the primary through Sentinel: every Sentinel asked at once, the
//! primary the one most of them name.
//!
//! redis-rs's Sentinel client asks the Sentinels one after the other, in
//! the order given, and takes the first answer. Under a partition that is
//! the wrong rule twice over: a first-listed Sentinel that cannot be
//! reached holds every connect for its timeout (writes were refused for
//! about 15 s while the others had long promoted a replica), and a Sentinel
//! cut off together with the old primary still names it. Here the
//! Sentinels are asked concurrently, each within the store timeout; an
//! address named by a majority of all the Sentinels configured wins as soon
//! as it is; otherwise, once every Sentinel answered or gave up, the
//! address most of those that answered name (the first listed on a tie).
//! Whatever is chosen must still say it is the primary (`INFO
//! replication`, `conn.rs`), and every change waits for its replicas.
//!
//! After connecting, the Sentinels are asked again ([`Sentinels::confirm`]):
//! a node named a moment before a failover (one the Sentinels are
//! replacing, or already replaced) is refused, because what it takes is
//! discarded when it is turned into a replica.

use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{
    AsyncConnectionConfig, Client, ConnectionAddr, FromRedisValue, IntoConnectionInfo,
    RedisConnectionInfo,
};
use tokio::task::JoinSet;

use crate::store::api::StoreError;

/// The Sentinels of a `redis+sentinel://` store and how to reach the data
/// nodes they name.
pub(super) struct Sentinels {
    /// One client per Sentinel, in the order given.
    sentinels: Vec<Client>,
    master: String,
    /// The data nodes' database, user and password.
    node: RedisConnectionInfo,
}

impl Sentinels {
    /// The Sentinels of `s`: the data nodes' user and password, and the
    /// Sentinels' own if they ask for the same (`sentinel_auth=same`).
    pub(super) fn new(
        s: &crate::config::Sentinel,
        password: Option<&crate::config::Secret>,
    ) -> Result<Self, String> {
        let password = password.or(s.password.as_ref());
        let mut node = RedisConnectionInfo::default().set_db(s.db);
        let mut own = RedisConnectionInfo::default();
        if let Some(u) = &s.user {
            node = node.set_username(u);
            if s.sentinel_auth {
                own = own.set_username(u);
            }
        }
        if let Some(pw) = password {
            node = node.set_password(pw.expose());
            if s.sentinel_auth {
                own = own.set_password(pw.expose());
            }
        }
        let sentinels = s
            .addrs
            .iter()
            .map(|(host, port)| {
                let info = ConnectionAddr::Tcp(host.clone(), *port)
                    .into_connection_info()
                    .map_err(|e| e.to_string())?
                    .set_redis_settings(own.clone());
                Client::open(info).map_err(|e| e.to_string())
            })
            .collect::<Result<Vec<_>, String>>()?;
        if sentinels.is_empty() {
            return Err("no Sentinel address".into());
        }
        Ok(Self {
            sentinels,
            master: s.master.clone(),
            node,
        })
    }

    /// A client for the primary most Sentinels name (see the module's
    /// rule), each Sentinel asked within `within`, and its address.
    pub(super) async fn primary(
        &self,
        within: Duration,
    ) -> Result<(Client, (String, u16)), StoreError> {
        let cmd = {
            let mut c = redis::cmd("SENTINEL");
            c.arg("GET-MASTER-ADDR-BY-NAME").arg(&self.master);
            c
        };
        let all: Vec<usize> = (0..self.sentinels.len()).collect();
        let mut asked = self.ask::<Option<(String, u16)>>(&cmd, &all, within);
        let majority = self.sentinels.len() / 2 + 1;
        // Per address, the Sentinels that named it, in the order they
        // answered.
        let mut named: Vec<((String, u16), Vec<usize>)> = Vec::new();
        let mut errors = Vec::new();
        while let Some(joined) = asked.join_next().await {
            let Ok((i, answer)) = joined else { continue };
            match answer {
                Ok(Some(addr)) => {
                    match named.iter_mut().find(|(a, _)| *a == addr) {
                        Some((_, by)) => by.push(i),
                        None => named.push((addr, vec![i])),
                    }
                    if named.iter().any(|(_, by)| by.len() >= majority) {
                        break;
                    }
                }
                Ok(None) => errors.push(format!(
                    "sentinel {i}: does not know master {:?}",
                    self.master
                )),
                Err(e) => errors.push(format!("sentinel {i}: {e}")),
            }
        }
        asked.abort_all();
        // The most named; on a tie, the one named by the first listed.
        let first = |by: &[usize]| by.iter().min().copied().unwrap_or(usize::MAX);
        let chosen = named
            .into_iter()
            .max_by(|(_, a), (_, b)| a.len().cmp(&b.len()).then(first(b).cmp(&first(a))));
        let Some(((host, port), _)) = chosen else {
            return Err(StoreError::Unavailable(format!(
                "redis sentinel: no Sentinel named the primary: {}",
                errors.join("; ")
            )));
        };
        let info = ConnectionAddr::Tcp(host.clone(), port)
            .into_connection_info()
            .map_err(|e| StoreError::Unavailable(format!("redis sentinel: {e}")))?
            .set_redis_settings(self.node.clone());
        let client = Client::open(info)
            .map_err(|e| StoreError::Unavailable(format!("redis sentinel: {e}")))?;
        Ok((client, (host, port)))
    }

    /// Whether the primary at `addr`, just connected to, may be used, and
    /// how many of its replicas the Sentinels see up: every Sentinel asked
    /// at once (`SENTINEL MASTER` and `SENTINEL REPLICAS`), until `by`,
    /// and their answers judged by [`judge`]. Once a majority has
    /// answered, the others get [`GRACE`] more: one Sentinel that cannot
    /// be reached (a host powered off, packets dropped) costs each connect
    /// that much, not the store timeout.
    pub(super) async fn confirm(
        &self,
        addr: &(String, u16),
        by: std::time::Instant,
    ) -> Result<u32, StoreError> {
        let mut pipe = redis::pipe();
        pipe.cmd("SENTINEL").arg("MASTER").arg(&self.master);
        pipe.cmd("SENTINEL").arg("REPLICAS").arg(&self.master);
        let all: Vec<usize> = (0..self.sentinels.len()).collect();
        let within = by.saturating_duration_since(std::time::Instant::now());
        let mut asked = self.ask::<(Vec<String>, Vec<Vec<String>>)>(&pipe, &all, within);
        let majority = self.sentinels.len() / 2 + 1;
        let mut cutoff = tokio::time::Instant::from_std(by);
        let (mut views, mut errors) = (Vec::new(), Vec::new());
        loop {
            match tokio::time::timeout_at(cutoff, asked.join_next()).await {
                Ok(Some(Ok((i, Ok((master, replicas)))))) => {
                    views.push(View::read(i, &master, replicas))
                }
                Ok(Some(Ok((i, Err(e))))) => errors.push(format!("sentinel {i}: {e}")),
                Ok(Some(Err(_))) => {}
                Ok(None) | Err(_) => break,
            }
            if views.len() >= majority {
                cutoff = cutoff.min(tokio::time::Instant::now() + GRACE);
            }
        }
        asked.abort_all();
        judge(addr, &views, self.sentinels.len()).map_err(|why| {
            let errors = match errors.is_empty() {
                true => String::new(),
                false => format!(" ({})", errors.join("; ")),
            };
            StoreError::Unavailable(format!(
                "redis sentinel: not using {}:{}: {why}{errors}",
                addr.0, addr.1
            ))
        })
    }

    /// `cmd` sent at once to the Sentinels in `of` (places in the list);
    /// each task yields the Sentinel's place and its answer.
    fn ask<T: FromRedisValue + Send + 'static>(
        &self,
        cmd: &(impl Query + Clone + Send + Sync + 'static),
        of: &[usize],
        within: Duration,
    ) -> JoinSet<(usize, redis::RedisResult<T>)> {
        let mut set = JoinSet::new();
        for &i in of {
            let Some(client) = self.sentinels.get(i) else {
                continue;
            };
            let (client, cmd) = (client.clone(), cmd.clone());
            set.spawn(async move {
                let ask = async {
                    let mut c = open(&client, within).await?;
                    cmd.send::<T>(&mut c).await
                };
                let answer = match tokio::time::timeout(within, ask).await {
                    Ok(answer) => answer,
                    Err(_) => Err(redis::RedisError::from((
                        redis::ErrorKind::Io,
                        "no answer within the store timeout",
                    ))),
                };
                (i, answer)
            });
        }
        set
    }
}

/// A command or a pipeline of them, sent to a Sentinel.
trait Query {
    fn send<T: FromRedisValue>(
        &self,
        c: &mut MultiplexedConnection,
    ) -> impl std::future::Future<Output = redis::RedisResult<T>> + Send;
}

impl Query for redis::Cmd {
    fn send<T: FromRedisValue>(
        &self,
        c: &mut MultiplexedConnection,
    ) -> impl std::future::Future<Output = redis::RedisResult<T>> + Send {
        self.query_async(c)
    }
}

impl Query for redis::Pipeline {
    fn send<T: FromRedisValue>(
        &self,
        c: &mut MultiplexedConnection,
    ) -> impl std::future::Future<Output = redis::RedisResult<T>> + Send {
        self.query_async(c)
    }
}

/// How long [`Sentinels::confirm`] waits for the Sentinels that have not
/// answered once a majority has.
pub(super) const GRACE: Duration = Duration::from_millis(250);

/// What one Sentinel says of the master: where it is, its flags
/// (`failover_in_progress` while the Sentinel replaces it, with
/// `failover-state`), the configuration's epoch (raised by every failover
/// that promoted a replica) and its replicas (`SENTINEL REPLICAS`'
/// entries).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct View {
    /// The Sentinel's place in the list.
    pub sentinel: usize,
    pub addr: (String, u16),
    pub flags: String,
    pub failover_state: Option<String>,
    pub epoch: u64,
    pub replicas: Vec<Vec<String>>,
}

impl View {
    /// From `SENTINEL MASTER`'s flat field/value list.
    pub(super) fn read(sentinel: usize, master: &[String], replicas: Vec<Vec<String>>) -> Self {
        let get = |name: &str| field(master, name).unwrap_or_default();
        Self {
            sentinel,
            addr: (get("ip"), get("port").parse().unwrap_or(0)),
            flags: get("flags"),
            failover_state: field(master, "failover-state"),
            epoch: get("config-epoch").parse().unwrap_or(0),
            replicas,
        }
    }

    fn failing_over(&self) -> bool {
        self.flags.split(',').any(|f| f == "failover_in_progress")
    }

    /// The failover has promoted a replica: the Sentinel's master entry
    /// keeps the old address until the failover ends, but the promoted
    /// replica is the primary it names (`GET-MASTER-ADDR-BY-NAME`).
    fn promoted(&self) -> Option<(String, u16)> {
        if !self.failing_over()
            || !matches!(
                self.failover_state.as_deref(),
                Some("reconf_slaves" | "update_config")
            )
        {
            return None;
        }
        self.replicas
            .iter()
            .find(|r| field(r, "flags").is_some_and(|f| f.split(',').any(|f| f == "promoted")))
            .map(|r| {
                (
                    field(r, "ip").unwrap_or_default(),
                    field(r, "port").and_then(|p| p.parse().ok()).unwrap_or(0),
                )
            })
    }

    /// The primary this Sentinel names now.
    fn current(&self) -> (String, u16) {
        self.promoted().unwrap_or_else(|| self.addr.clone())
    }

    /// The node this Sentinel is replacing, if it is: from the choice of
    /// a replica on (an attempt still waiting for its election,
    /// `wait_start`, replaces nothing yet).
    fn replacing(&self) -> Option<&(String, u16)> {
        (self.failing_over() && self.failover_state.as_deref() != Some("wait_start"))
            .then_some(&self.addr)
    }
}

/// Field `name` of a flat field/value list (Sentinel's answers).
fn field(entry: &[String], name: &str) -> Option<String> {
    entry
        .chunks(2)
        .find(|kv| kv.len() == 2 && kv[0] == name)
        .map(|kv| kv[1].clone())
}

/// Whether the primary at `addr` may be used, given what the Sentinels
/// that answered say (`configured`: how many there are), and if so how
/// many of its replicas they see up (the most any Sentinel naming it
/// reports: more replicas to wait for only makes a write wait longer,
/// fewer could let one be acknowledged that a failover loses).
///
/// Refused:
/// - unless a majority of the Sentinels answered and name it: a minority
///   (this replica cut off with the old primary and one Sentinel) cannot
///   know that the others have promoted a replica, and what the old
///   primary takes then is discarded when it is turned into one;
/// - while a Sentinel is replacing it (a failover past its election,
///   before the switch): a restarted old primary takes connections as a
///   primary, lists the promoted node as its replica, and that node
///   reports itself a primary, so nothing would be waited for;
/// - when a Sentinel names another node with a newer configuration (the
///   failover is done and this is the old primary, not yet told).
pub(super) fn judge(
    addr: &(String, u16),
    views: &[View],
    configured: usize,
) -> Result<u32, String> {
    let majority = configured / 2 + 1;
    if views.len() < majority {
        return Err(format!(
            "only {} of {configured} Sentinels answered after the connect",
            views.len()
        ));
    }
    if let Some(v) = views.iter().find(|v| v.replacing() == Some(addr)) {
        return Err(format!(
            "Sentinel {} is failing it over ({})",
            v.sentinel,
            v.failover_state.as_deref().unwrap_or("state unknown")
        ));
    }
    let naming: Vec<&View> = views.iter().filter(|v| v.current() == *addr).collect();
    let Some(ours) = naming.iter().map(|v| v.epoch).max() else {
        return Err("no Sentinel names it any more".into());
    };
    if let Some(v) = views
        .iter()
        .find(|v| v.current() != *addr && v.epoch > ours)
    {
        let (host, port) = v.current();
        return Err(format!(
            "Sentinel {} names {host}:{port}, of a newer configuration (epoch {} > {ours})",
            v.sentinel, v.epoch
        ));
    }
    if naming.len() < majority {
        return Err(format!(
            "{} of {configured} Sentinels name it, not a majority",
            naming.len()
        ));
    }
    Ok(naming
        .iter()
        .map(|v| sentinel_up(&v.replicas))
        .max()
        .unwrap_or(0))
}

/// How many of `SENTINEL REPLICAS`'s entries are up: flags without
/// `s_down`, `o_down` or `disconnected`, and not still reporting itself a
/// primary (`role-reported`). The last is a demoted old primary back after
/// a partition: Sentinel lists it as a replica of the promoted one at once,
/// but it replicates nothing until Sentinel has reconfigured it (10 s
/// here), and waiting for it refused every write meanwhile. (The opposite
/// case, a promoted node listed as the replica of the old primary it
/// replaces, is refused by [`judge`] before this count matters.)
pub(super) fn sentinel_up(replicas: &[Vec<String>]) -> u32 {
    replicas
        .iter()
        .filter(|r| {
            field(r, "flags").is_some_and(|flags| {
                !flags
                    .split(',')
                    .any(|f| matches!(f, "s_down" | "o_down" | "disconnected"))
            }) && field(r, "role-reported").as_deref() != Some("master")
        })
        .count() as u32
}

/// A connection to a Sentinel, its connect and answers bounded.
async fn open(client: &Client, within: Duration) -> redis::RedisResult<MultiplexedConnection> {
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(within))
        .set_response_timeout(Some(within));
    client
        .get_multiplexed_async_connection_with_config(&config)
        .await
}
