//! One module a scenario, run in this order by `main`: the references, cluster A (enrolment,
//! heartbeats, writes), the cost of TLS (twin clusters over TLS and plain HTTP), then cluster B
//! (the population, open-loop heartbeats, failover, memory). Each takes the run's [`Bench`] and what an earlier scenario built.

use std::path::PathBuf;

use crate::Profile;
use crate::report::Report;

pub mod enrolment;
pub mod failover;
pub mod flood;
pub mod heartbeats;
pub mod memory;
pub mod open_loop;
pub mod population;
pub mod reference;
pub mod tls_cost;
pub mod writes;

/// What every scenario shares: the profile, one HTTP client, the scratch dir, the server
/// binary and the report.
pub struct Bench {
    pub p: &'static Profile,
    pub http: reqwest::Client,
    pub dir: PathBuf,
    pub bin: PathBuf,
    pub r: Report,
}

/// Serve flags of the clusters that enrol many agents: cheap argon2 (the default parameters
/// would take an hour of hashing for 100,000 nodes) and no credential pool (its background
/// hashing would land on one side of a comparison).
pub fn cheap_hashing_flags() -> Vec<String> {
    [
        "--argon2-m-kib",
        "1024",
        "--argon2-t",
        "1",
        "--credential-pool",
        "0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}
