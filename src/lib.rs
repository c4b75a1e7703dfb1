//! The ModelForge control plane: a Raft-replicated cluster that enrols GPU compute nodes,
//! authenticates their heartbeats and keeps their credentials, inventory and history.
//!
//! See ARCHITECTURE.md for the map. Entry points: [`server::serve`] (the `serve` command) and
//! [`state::State::apply`] (every replicated change).

pub mod admin_cli;
pub mod app;
pub mod archive;
pub mod backup;
pub mod cli;
pub mod config;
pub mod disk;
pub mod error;
#[doc(hidden)]
pub mod fuzz;
pub mod journal;
pub mod liveness;
pub mod secrets;
pub mod server;
pub mod state;
pub mod supervisor;
pub mod tls;
pub mod view_index;
