//! Configuration: the raw TOML/flag shape and the validated [`Config`].
//!
//! [`RawConfig`] is what a file (or the quick-start flags) says, with every
//! field optional and unknown fields refused. [`Config`] is built from it
//! with `TryFrom`, which checks each value and names the field on failure; a
//! `Config` that exists is one the server can run with.
//!
//! Files: `raw.rs` (the file shape), `validated.rs` (the `Config` and its
//! checks), `route.rs` (routes), `store/` (the store URL and its
//! settings), `parse.rs` (durations, addresses), `secret.rs` (passwords
//! that never print), `error.rs`.

mod error;
mod parse;
mod raw;
mod route;
mod secret;
mod store;
#[cfg(test)]
mod tests;
mod validated;

pub use error::ConfigError;
pub use parse::{parse_duration, MAX_DURATION};
pub use raw::{RawConfig, RawLimits, RawRoute, RawTls};
pub use route::{
    bodiless, parse_upstream, ErrorFormat, Route, TokenMode, Upstream, WriteMethods, BODY_OPT_IN,
};
pub use secret::Secret;
pub use store::{
    redact_url, store, url_password, RedisCluster, Sentinel, SharedEngine, SharedStoreConfig,
    StoreConfig,
};
pub use validated::{Config, LeaseConfig, Limits, MAX_WORKERS};
