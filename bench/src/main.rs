//! `modelforge-bench`: the hot paths of a real 3-member ModelForge cluster on loopback, each
//! next to a reference measured in the same run (a bare axum endpoint, a 3-member etcd 3.4,
//! the argon2 bound), so that this machine's noise cancels out of the ratios.
//!
//! `cargo run --release -p modelforge-bench` runs the full profile (about 8 minutes on 2
//! cores); `--profile smoke` runs every scenario small (CI checks that it works, not how fast).
//! It builds the server binary it needs, prints a table and writes the figures as JSON
//! (`--out`, default `target/bench.json`).
//!
//! Members serve TLS (certificates from one harness CA, which the load client trusts), and so
//! does the bare-axum reference; it is also measured over plain HTTP, and twin clusters, one
//! started with `--insecure-http`, give what TLS costs heartbeats and writes in the same run.
//!
//! Two clusters: A runs at the default argon2 parameters (enrolment burst, heartbeat
//! throughput, replicated writes); B is the agent population (10,000 and 100,000 nodes,
//! open-loop heartbeats, failover, memory), enrolled with cheap argon2 parameters because a
//! population of 100,000 would otherwise take an hour of hashing here. Cheap parameters would
//! hide an argon2 storm after failover, so that scenario reports how many argon2 verifies the
//! surviving members ran, and what they would have cost at the default parameters.

mod cluster;
mod load;
mod report;
mod scenario;

use std::path::PathBuf;
use std::time::Duration;

use serde_json::json;

use report::Report;
use report::machine;
use scenario::Bench;
pub struct Profile {
    pub name: &'static str,
    /// Each closed-loop scenario runs this long.
    pub dur: Duration,
    pub hb_loops: usize,
    pub burst: usize,
    pub population: [usize; 2],
    /// Offered heartbeat rates of the open-loop steps (agents at 1/s each).
    pub open_rates: &'static [usize],
    pub open_secs: u64,
    /// Agents (one connection each) of the flood at twice the measured capacity.
    pub flood_agents: usize,
    pub flood_secs: u64,
    pub failover_agents: usize,
    pub failover_interval: Duration,
    pub write_clients: [usize; 3],
}

const FULL: Profile = Profile {
    name: "full",
    dur: Duration::from_secs(5),
    hb_loops: 64,
    burst: 1000,
    population: [10_000, 100_000],
    open_rates: &[2_000, 5_000, 10_000],
    open_secs: 8,
    flood_agents: 2_000,
    flood_secs: 8,
    failover_agents: 10_000,
    failover_interval: Duration::from_secs(5),
    write_clients: [1, 16, 128],
};

const SMOKE: Profile = Profile {
    name: "smoke",
    dur: Duration::from_millis(800),
    hb_loops: 16,
    burst: 30,
    population: [200, 400],
    open_rates: &[100, 200],
    open_secs: 2,
    flood_agents: 200,
    flood_secs: 2,
    failover_agents: 200,
    failover_interval: Duration::from_secs(1),
    write_clients: [1, 16, 128],
};

struct Args {
    profile: &'static Profile,
    out: PathBuf,
    server: Option<PathBuf>,
    etcd: bool,
    /// Run just this scenario (`flood`), for iterating on it.
    only: Option<String>,
}

fn parse_args() -> Args {
    let mut args = Args {
        profile: &FULL,
        out: PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/bench.json"),
        server: None,
        etcd: true,
        only: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--profile" => {
                args.profile = match it.next().as_deref() {
                    Some("full") => &FULL,
                    Some("smoke") => &SMOKE,
                    other => usage(&format!("unknown profile {other:?} (full or smoke)")),
                }
            }
            "--out" => {
                args.out = it
                    .next()
                    .unwrap_or_else(|| usage("--out needs a path"))
                    .into()
            }
            "--server" => {
                args.server = Some(
                    it.next()
                        .unwrap_or_else(|| usage("--server needs a path"))
                        .into(),
                )
            }
            "--no-etcd" => args.etcd = false,
            "--only" => match it.next().as_deref() {
                Some(s @ ("flood" | "heartbeats" | "writes" | "population" | "surge")) => {
                    args.only = Some(s.into())
                }
                other => usage(&format!(
                    "--only takes a scenario group (flood, heartbeats, writes, population, surge), not {other:?}"
                )),
            },
            "-h" | "--help" => {
                println!(
                    "modelforge-bench [--profile full|smoke] [--out FILE] [--server PATH] [--no-etcd] [--only flood|heartbeats|writes|population|surge]"
                );
                std::process::exit(0);
            }
            other => usage(&format!("unknown argument {other}")),
        }
    }
    args
}

fn usage(msg: &str) -> ! {
    eprintln!("modelforge-bench: {msg}");
    std::process::exit(2)
}

/// The `modelforge` binary: `--server`, else the one beside this executable, (re)built first
/// when this runs under `cargo run` so that the figures are of the current source.
fn server_bin(args: &Args) -> PathBuf {
    if let Some(p) = &args.server {
        return p.clone();
    }
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().expect("exe dir").to_path_buf();
    if let Ok(cargo) = std::env::var("CARGO") {
        let mut c = std::process::Command::new(cargo);
        c.args(["build", "-p", "modelforge", "--bin", "modelforge"]);
        if dir.ends_with("release") {
            c.arg("--release");
        }
        let ok = c.status().is_ok_and(|s| s.success());
        assert!(ok, "building the modelforge server failed");
    }
    let bin = dir.join("modelforge");
    assert!(
        bin.exists(),
        "{} not found: build it (cargo build --release) or pass --server",
        bin.display()
    );
    bin
}

#[tokio::main]
async fn main() {
    let args = parse_args();
    let p = args.profile;
    let dir = tempfile::tempdir().expect("temp dir");
    // `MF_BENCH_KEEP=1` keeps the members' data dirs and logs after the run (the path is
    // printed), to read what the members logged (elections, sheds) during a scenario.
    let (dir_path, dir) = if std::env::var_os("MF_BENCH_KEEP").is_some() {
        let kept = dir.keep();
        println!("members' data dirs and logs are kept in {}", kept.display());
        (kept, None)
    } else {
        (dir.path().to_path_buf(), Some(dir))
    };
    let bin = server_bin(&args);
    // Members speak TLS with the harness CA; the load client trusts it.
    modelforge_devkit::ca(&bin);
    let mut b = Bench {
        p,
        http: load::client(),
        dir: dir_path,
        bin,
        r: Report::default(),
    };
    b.r.put("profile", json!(p.name));
    b.r.put("machine", machine());
    println!("modelforge-bench, profile {} on {}", p.name, machine());
    // `--only` runs one group of scenarios (with what it needs), for iterating on it.
    let only = args.only.as_deref();
    let runs = |group: &str| only.is_none_or(|o| o == group);
    let mut one = scenario::reference::argon2_bound();
    if runs("heartbeats") || runs("writes") {
        let bare = scenario::reference::bare_axum(&mut b).await;
        let a = scenario::enrolment::run(&mut b, &mut one).await;
        if runs("heartbeats") {
            scenario::heartbeats::run(&mut b, &a, &bare).await;
        }
        if runs("writes") {
            scenario::writes::run(&mut b, &a, args.etcd).await;
        }
        drop(a);
    }
    if only.is_none() {
        scenario::tls_cost::run(&mut b).await;
    }
    // `surge` is the population group without its growth to 100,000 nodes: the open loop and
    // the failover, for comparing builds in a few minutes a run.
    if runs("population") || only == Some("surge") {
        let mut pop = scenario::population::enrol(&mut b).await;
        scenario::open_loop::run(&mut b, &pop).await;
        let killed = scenario::failover::run(&mut b, &mut pop, one).await;
        if runs("population") {
            scenario::memory::run(&mut b, &mut pop, killed).await;
        }
        drop(pop);
    }
    if runs("flood") {
        scenario::flood::run(&mut b).await;
    }
    b.r.finish(&args.out);
    drop(dir);
}
