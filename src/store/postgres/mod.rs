//! The PostgreSQL store: fences and leases in tables, each operation one
//! call of a PL/pgSQL function (one round trip, one transaction).
//!
//! Tokens are `numeric(20,0)` with a check constraint on the u64 range
//! (`bigint` is signed and would lose the upper half); they cross the wire as
//! text. The schema is created or migrated at connect, under an advisory
//! lock so that replicas starting together do not race. Lease expiry uses
//! the server's clock (`clock_timestamp()`). A raise is durable when its
//! transaction commits with `synchronous_commit` on (the default; fencegate
//! warns at connect when it is off).
//!
//! Files: `conn.rs` (connections and calls), `backend.rs` (the admission's
//! operations), `schema.rs` (the schema and its functions), `tls.rs` (TLS
//! for tokio-postgres over rustls).

mod backend;
mod conn;
mod schema;
mod tls;

pub use conn::{Connect, PostgresBackend};
