//! The ModelForge chaos suite: a cluster of real `modelforge serve` processes, production-like
//! traffic, faults (kill -9 of the leader at random instants, follower kills, restarts,
//! SIGSTOP/SIGCONT of the leader, a partition that cuts the leader off from the majority, a
//! heal), a recorded history, and a checker run after the final heal.
//!
//! A run is driven by a seed (the fault schedule and the traffic choices); timing on a real
//! machine is not reproducible, so a replay re-runs the same schedule, not the same history.

pub mod checker;
pub mod cluster;
pub mod history;
pub mod nemesis;
pub mod proxy;
pub mod workload;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde::Serialize;

use crate::checker::FinalState;
use crate::checker::Resolution;
use crate::checker::Violation;
use crate::cluster::ChaosCluster;
use crate::cluster::HarnessError;
use crate::nemesis::FaultRecord;

/// The `modelforge` binary of the build a test binary belongs to (`target/<profile>/deps/<test>`
/// -> `target/<profile>/modelforge`), built first if this test run has not built it.
pub fn server_bin_for_tests() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let profile_dir = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target/<profile>/deps/<test>");
    let bin = profile_dir.join("modelforge");
    if !bin.exists() {
        let mut c =
            std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
        c.args(["build", "-p", "modelforge", "--bin", "modelforge"]);
        if profile_dir.ends_with("release") {
            c.arg("--release");
        }
        assert!(
            c.status().is_ok_and(|s| s.success()),
            "building modelforge failed"
        );
    }
    bin
}

/// splitmix64: a tiny seeded generator, so the schedule depends on the seed alone.
#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
    pub fn fork(&mut self) -> Self {
        Self(self.next_u64())
    }
}

#[derive(Clone, Debug)]
pub struct RunConfig {
    pub seed: u64,
    pub members: usize,
    pub duration: Duration,
    pub agents: usize,
    pub heartbeaters: usize,
    /// Pause between faults (a fault's own duration comes on top).
    pub fault_every: Duration,
    pub server_bin: PathBuf,
    pub work_dir: PathBuf,
}

impl RunConfig {
    pub fn replay_command(&self) -> String {
        format!(
            "cargo run --release -p modelforge-chaos -- --seed {} --members {} --duration-s {} --agents {} --fault-every-ms {}",
            self.seed,
            self.members,
            self.duration.as_secs(),
            self.agents,
            self.fault_every.as_millis()
        )
    }
}

#[derive(Debug, Serialize)]
pub struct RunReport {
    pub seed: u64,
    pub members: usize,
    pub operations: usize,
    pub enrolments_acknowledged: usize,
    pub enrolment_retries: usize,
    pub heartbeats: usize,
    pub faults: Vec<FaultRecord>,
    pub leader_kills: usize,
    pub leader_kills_mid_enrolment: usize,
    pub partitions: usize,
    pub pauses: usize,
    pub resolution: Resolution,
    pub violations: Vec<Violation>,
    pub replay: String,
}

/// Run one chaos profile; `Err` is harness trouble, never a verdict on the system.
pub async fn run(cfg: &RunConfig) -> Result<RunReport, HarnessError> {
    // A run starts from empty data dirs (a replay must not inherit an earlier run's state).
    let _ = std::fs::remove_dir_all(&cfg.work_dir);
    std::fs::create_dir_all(&cfg.work_dir).map_err(|e| HarnessError(format!("work dir: {e}")))?;
    let extra = vec!["--touch-interval".to_string(), "1s".to_string()];
    let mut cluster =
        ChaosCluster::start(&cfg.server_bin, &cfg.work_dir, cfg.members, &extra).await?;
    let mut rng = Rng::new(cfg.seed);
    let shared = Arc::new(workload::Shared {
        urls: cluster.urls(),
        http: cluster.http.clone(),
        history: history::History::default(),
        stop: Default::default(),
        tokens: Default::default(),
        enrolled: Default::default(),
        enrolls_in_flight: Default::default(),
    });
    let mut tasks = vec![tokio::spawn(workload::admin(shared.clone(), rng.fork()))];
    for i in 0..cfg.agents {
        tasks.push(tokio::spawn(workload::agent(
            shared.clone(),
            format!("agent{i}"),
            rng.fork(),
        )));
    }
    for i in 0..cfg.heartbeaters {
        tasks.push(tokio::spawn(workload::heartbeats(
            shared.clone(),
            format!("hb{i}"),
            rng.fork(),
        )));
    }
    let faults = nemesis::run(&mut cluster, &shared, cfg, &mut rng).await;
    shared.stop.store(true, Ordering::SeqCst);
    for t in tasks {
        let _ = t.await;
    }
    let faults = faults?;

    // Final heal: every member up, unpaused, connected; then wait for convergence.
    cluster.heal();
    for i in 0..cluster.n {
        if cluster.is_paused(i) {
            cluster.resume(i);
        }
        if !cluster.running(i) {
            cluster.start_member(i)?;
        }
    }
    cluster
        .wait_leader(Duration::from_secs(60))
        .await
        .ok_or_else(|| HarnessError("no leader after the final heal".into()))?;
    let fin = read_final_state(&mut cluster).await?;
    let ops = shared.history.ops();
    let (violations, resolution) = checker::check(&ops, &fin);
    std::fs::write(
        cfg.work_dir.join("history.json"),
        serde_json::to_vec(&ops).unwrap_or_default(),
    )
    .ok();
    let count = |f: &dyn Fn(&FaultRecord) -> bool| faults.iter().filter(|x| f(x)).count();
    std::fs::write(
        cfg.work_dir.join("final-state.json"),
        serde_json::to_vec(&fin).unwrap_or_default(),
    )
    .ok();
    Ok(RunReport {
        seed: cfg.seed,
        members: cfg.members,
        operations: ops.len(),
        enrolments_acknowledged: ops
            .iter()
            .filter(|o| {
                matches!(o.kind, history::Kind::Enroll { .. })
                    && matches!(o.outcome, history::Outcome::Ok { .. })
            })
            .count(),
        enrolment_retries: ops
            .iter()
            .filter(|o| matches!(o.kind, history::Kind::Enroll { attempt, .. } if attempt > 0))
            .count(),
        heartbeats: ops
            .iter()
            .filter(|o| matches!(o.kind, history::Kind::Heartbeat { .. }))
            .count(),
        leader_kills: count(&|f| f.kind == "kill-leader" && f.status == "installed"),
        leader_kills_mid_enrolment: count(&|f| {
            f.kind == "kill-leader" && f.status == "installed" && f.enrolments_in_flight > 0
        }),
        partitions: count(&|f| f.kind == "partition-leader" && f.status == "installed"),
        pauses: count(&|f| f.kind == "pause-leader" && f.status == "installed"),
        faults,
        resolution,
        violations,
        replay: cfg.replay_command(),
    })
}

/// Read back what the cluster holds, once every member has applied the same state.
async fn read_final_state(cluster: &mut ChaosCluster) -> Result<FinalState, HarnessError> {
    let t = Duration::from_secs(60);
    let mut fin = FinalState::default();
    let deadline = tokio::time::Instant::now() + t;
    loop {
        let mut d = vec![];
        for i in 0..cluster.n {
            d.push(cluster.digest(i).await);
        }
        let all = d.iter().all(|x| x.is_some());
        let same = all && d.windows(2).all(|w| w[0] == w[1]);
        if same || tokio::time::Instant::now() >= deadline {
            fin.digests = d;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let nodes = cluster
        .admin_get("/api/v1/admin/hardware/nodes", t)
        .await
        .ok_or_else(|| HarnessError("could not read nodes".into()))?;
    for n in nodes["nodes"].as_array().into_iter().flatten() {
        let id = n["node_id"].as_str().unwrap_or("").to_string();
        fin.nodes.insert(
            id.clone(),
            n["identity_public_key"].as_str().unwrap_or("").to_string(),
        );
        let creds = cluster
            .admin_get(&format!("/api/v1/admin/hardware/nodes/{id}/credentials"), t)
            .await
            .ok_or_else(|| HarnessError("could not read credentials".into()))?;
        for c in creds["credentials"].as_array().into_iter().flatten() {
            fin.credentials.insert(
                c["credential_id"].as_str().unwrap_or("").to_string(),
                (id.clone(), !c["revoked_at"].is_null()),
            );
        }
    }
    let toks = cluster
        .admin_get("/api/v1/admin/node-enrollments", t)
        .await
        .ok_or_else(|| HarnessError("could not read tokens".into()))?;
    for r in toks["enrollments"].as_array().into_iter().flatten() {
        fin.tokens.insert(
            r["enrollment_id"].as_str().unwrap_or("").to_string(),
            (
                r["state"].as_str().unwrap_or("").to_string(),
                r["claimed_node_id"].as_str().map(String::from),
            ),
        );
    }
    Ok(fin)
}
