//! The binary's own modules (not part of the library): its command line
//! and the subcommands that do not run the proxy. `src/main.rs` runs the
//! proxy itself.

pub(crate) mod commands;
pub(crate) mod opts;
