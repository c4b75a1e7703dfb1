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

/// `perf record` of the members for `dur`, when `MF_BENCH_PERF` names a folder: the profile of
/// one scenario's members (call graphs from DWARF), written as `<folder>/<name>.data`. Start it
/// just before the load; the recording stops by itself. Needs `perf` and the right to trace
/// the members (root, or `kernel.perf_event_paranoid` <= 1).
pub fn perf_record(
    name: &str,
    pids: &[u32],
    dur: std::time::Duration,
) -> Option<std::process::Child> {
    let dir = std::env::var_os("MF_BENCH_PERF")?;
    std::fs::create_dir_all(&dir).ok()?;
    let pids: Vec<String> = pids.iter().map(u32::to_string).collect();
    let out = std::path::Path::new(&dir).join(format!("{name}.data"));
    let child = std::process::Command::new("perf")
        .args([
            "record",
            "-q",
            "-F",
            "400",
            "--call-graph",
            "dwarf,16384",
            "-p",
        ])
        .arg(pids.join(","))
        .arg("-o")
        .arg(&out)
        .args(["--", "sleep"])
        .arg(format!("{:.1}", dur.as_secs_f64()))
        .stdout(std::process::Stdio::null())
        .spawn();
    match child {
        Ok(c) => {
            println!("perf: recording {name} into {}", out.display());
            Some(c)
        }
        Err(e) => {
            println!("perf: cannot record {name}: {e}");
            None
        }
    }
}
