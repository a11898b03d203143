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
    /// rule), each Sentinel asked within `within`, and which Sentinels
    /// named it (their places in the list).
    pub(super) async fn primary(
        &self,
        within: Duration,
    ) -> Result<(Client, Vec<usize>), StoreError> {
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
        let Some(((host, port), by)) = chosen else {
            return Err(StoreError::Unavailable(format!(
                "redis sentinel: no Sentinel named the primary: {}",
                errors.join("; ")
            )));
        };
        let info = ConnectionAddr::Tcp(host, port)
            .into_connection_info()
            .map_err(|e| StoreError::Unavailable(format!("redis sentinel: {e}")))?
            .set_redis_settings(self.node.clone());
        let client = Client::open(info)
            .map_err(|e| StoreError::Unavailable(format!("redis sentinel: {e}")))?;
        Ok((client, by))
    }

    /// The answers to `SENTINEL REPLICAS` of the Sentinels in `of` (places
    /// in the list), asked at once, each within `within` (those that did
    /// not answer are left out).
    pub(super) async fn replicas(&self, of: &[usize], within: Duration) -> Vec<Vec<Vec<String>>> {
        let cmd = {
            let mut c = redis::cmd("SENTINEL");
            c.arg("REPLICAS").arg(&self.master);
            c
        };
        let mut asked = self.ask::<Vec<Vec<String>>>(&cmd, of, within);
        let mut answers = Vec::new();
        while let Some(joined) = asked.join_next().await {
            if let Ok((_, Ok(replicas))) = joined {
                answers.push(replicas);
            }
        }
        answers
    }

    /// `cmd` sent at once to the Sentinels in `of` (places in the list);
    /// each task yields the Sentinel's place and its answer.
    fn ask<T: FromRedisValue + Send + 'static>(
        &self,
        cmd: &redis::Cmd,
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
                    cmd.query_async::<T>(&mut c).await
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

/// A connection to a Sentinel, its connect and answers bounded.
async fn open(client: &Client, within: Duration) -> redis::RedisResult<MultiplexedConnection> {
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(within))
        .set_response_timeout(Some(within));
    client
        .get_multiplexed_async_connection_with_config(&config)
        .await
}
