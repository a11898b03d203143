//! The durable highest-token table behind the fence.
//!
//! [`FenceStore`] is the seam between admission (`fence`) and the engines. The
//! embedded engine ([`embedded::EmbeddedStore`], redb with group commit) is the
//! default; shared engines (Redis, PostgreSQL, etcd) implement the same trait so
//! several replicas can enforce one fence.

mod api;
pub mod batch;
pub mod embedded;
pub mod etcd;
pub mod instrumented;
pub mod postgres;
pub mod redis;
pub mod shared;

use std::sync::Arc;

use crate::config::{SharedEngine, SharedStoreConfig};
pub use api::{
    Advance, Claim, CrashedKey, FenceStore, LastWait, LeaseOutcome, Lock, Replicas, Shard,
    StartState, StoreError, WriteLease, KEY_MAPPING_MIXED,
};

/// Why a shared store could not be set up from its config.
#[derive(Debug, Clone, thiserror::Error)]
#[error("invalid `store`: {0}")]
pub struct ConnectError(pub String);

/// Builds the shared store a config names. Connects lazily: a store that is
/// down at start makes writes fail closed until it answers. `batch_sizes`
/// observes the size of each batch sent ([`batch`]), by operation.
pub fn connect_shared(
    c: &SharedStoreConfig,
    batch_sizes: Option<&prometheus::HistogramVec>,
) -> Result<Arc<dyn FenceStore>, ConnectError> {
    let bad = ConnectError;
    let state = || c.state_file.clone().map(shared::StateFile::new);
    let opened = |e: StoreError| ConnectError(e.to_string());
    // The TLS settings as an engine takes them, if TLS is on.
    fn with_tls<T>(
        c: &SharedStoreConfig,
        read: fn(&crate::tls::StoreTls) -> Result<T, crate::tls::TlsError>,
    ) -> Result<Option<T>, ConnectError> {
        c.tls
            .as_ref()
            .map(read)
            .transpose()
            .map_err(|e| ConnectError(e.to_string()))
    }
    // PostgreSQL's and etcd's: a rustls config.
    let client_config = || with_tls(c, crate::tls::store_client_config);
    // Redis's (lone or cluster): the CA and client certificate as PEM.
    let redis_pem = || with_tls(c, crate::tls::store_pem);
    Ok(match &c.engine {
        SharedEngine::Redis { sentinel } => {
            let pem = redis_pem()?;
            Arc::new(
                shared::SharedStore::new(
                    redis::RedisBackend::new(
                        &c.url,
                        redis::Options {
                            sentinel: sentinel.as_ref(),
                            password: c.password.as_ref(),
                            pem,
                            timeout: c.timeout,
                            replicas_to_wait: c.replicas_to_wait,
                        },
                    )
                    .map_err(bad)?,
                    c.accept_reset,
                    batch_sizes,
                    state(),
                )
                .map_err(opened)?,
            )
        }
        SharedEngine::RedisCluster(cluster) => {
            let pem = redis_pem()?;
            let shared = redis::cluster::Cluster::new(redis::cluster::ClusterOptions {
                cluster,
                password: c.password.as_ref(),
                pem,
                timeout: c.timeout,
                replicas_to_wait: c.replicas_to_wait,
            })
            .map_err(bad)?;
            let groups = (0..redis::cluster::GROUPS)
                .map(|g| {
                    let state = c
                        .state_file
                        .as_ref()
                        .map(|p| shared::StateFile::new(group_state_file(p, g)));
                    let store = shared::SharedStore::new(
                        redis::cluster::ClusterGroup::new(shared.clone(), g),
                        c.accept_reset,
                        batch_sizes,
                        state,
                    )?
                    .with_known_capacity(1_000_000 / redis::cluster::GROUPS);
                    Ok((redis::cluster::group_tag(g), store))
                })
                .collect::<Result<Vec<_>, StoreError>>()
                .map_err(opened)?;
            Arc::new(shared::Grouped::new(groups, redis::cluster::group_of))
        }
        SharedEngine::Postgres { conn, prefer } => {
            let config = client_config()?;
            Arc::new(
                shared::SharedStore::new(
                    postgres::PostgresBackend::new(
                        conn,
                        postgres::Connect {
                            password: c.password.clone(),
                            tls: config,
                            prefer: *prefer,
                        },
                        c.timeout,
                        8,
                    )
                    .map_err(bad)?,
                    c.accept_reset,
                    batch_sizes,
                    state(),
                )
                .map_err(opened)?,
            )
        }
        SharedEngine::Etcd { endpoints, user } => {
            let config = client_config()?;
            let password = c
                .password
                .clone()
                .or_else(|| crate::config::url_password(&c.url));
            let auth = user.clone().map(|u| {
                (
                    u,
                    password.unwrap_or_else(|| crate::config::Secret::new("")),
                )
            });
            Arc::new(
                shared::SharedStore::new(
                    etcd::EtcdBackend::new(endpoints.clone(), config, auth, c.timeout),
                    c.accept_reset,
                    batch_sizes,
                    state(),
                )
                .map_err(opened)?,
            )
        }
    })
}

/// A cluster group's own state file: the configured path with the group's
/// number after it (`fencegate.state.17`).
fn group_state_file(p: &std::path::Path, g: usize) -> std::path::PathBuf {
    let mut name = p.as_os_str().to_owned();
    name.push(format!(".{g}"));
    name.into()
}
