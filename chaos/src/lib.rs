//! The ModelForge chaos suite: a cluster of real `modelforge serve` processes, production-like
//! traffic, faults (kill -9 of the leader at random instants, follower kills, restarts,
//! SIGSTOP/SIGCONT of the leader, a partition that cuts the leader off from the majority, a
//! heal), a recorded history, and a checker run after the final heal.
//!
//! A run is driven by a seed (the fault schedule and the traffic choices); timing on a real
//! machine is not reproducible, so a replay re-runs the same schedule, not the same history.

pub mod answer;
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

use modelforge_proto::api;
use serde::Serialize;

use crate::checker::FinalCredential;
use crate::checker::FinalState;
use crate::checker::FinalToken;
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
    /// When set, faults and traffic go on after `duration` while the run has not exercised
    /// these floors yet, for at most `duration` more: on a loaded machine a fixed time does
    /// fewer operations, and a run that exercised too little proves nothing.
    pub floors: Option<Exercised>,
    pub agents: usize,
    pub heartbeaters: usize,
    /// Pause between faults (a fault's own duration comes on top).
    pub fault_every: Duration,
    /// The nemesis also replaces members (removed, then a fresh member with a new id joins).
    pub membership: bool,
    pub server_bin: PathBuf,
    pub work_dir: PathBuf,
}

impl RunConfig {
    pub fn replay_command(&self) -> String {
        format!(
            "cargo run --release -p modelforge-chaos -- --seed {} --members {} --duration-s {} --agents {} --fault-every-ms {}{}",
            self.seed,
            self.members,
            self.duration.as_secs(),
            self.agents,
            self.fault_every.as_millis(),
            if self.membership { " --membership" } else { "" }
        )
    }
}

#[derive(Debug, Serialize)]
pub struct RunReport {
    pub seed: u64,
    pub members: usize,
    pub operations: usize,
    pub exercised: Exercised,
    pub faults: Vec<FaultRecord>,
    pub resolution: Resolution,
    pub violations: Vec<Violation>,
    pub replay: String,
}

/// How often the run produced each event the checker's rules depend on: a rule that was never
/// exercised proved nothing, so a profile sets a floor for each (`Exercised::shortfalls`).
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Exercised {
    pub enrolments_acknowledged: usize,
    pub enrolment_retries: usize,
    pub enrolments_unknown: usize,
    pub heartbeats: usize,
    /// Revocations acknowledged with at least one credential revoked.
    pub revocations_acknowledged: usize,
    /// Heartbeats sent with a credential after its revocation was acknowledged.
    pub heartbeats_after_revocation: usize,
    pub leader_kills: usize,
    pub leader_kills_mid_enrolment: usize,
    pub partitions: usize,
    pub pauses: usize,
    /// Members replaced (removed, and a fresh member added in their place).
    pub membership_changes: usize,
}

impl Exercised {
    pub fn count(ops: &[history::Op], faults: &[FaultRecord]) -> Self {
        use history::Kind;
        use history::Outcome;
        let mut e = Exercised::default();
        // credential -> when its revocation was first acknowledged
        let mut revoked_at: std::collections::BTreeMap<&str, u64> = Default::default();
        for op in ops {
            match (&op.kind, &op.outcome) {
                (Kind::Enroll { attempt, .. }, o) => {
                    e.enrolment_retries += usize::from(*attempt > 0);
                    match o {
                        Outcome::Ok { .. } => e.enrolments_acknowledged += 1,
                        Outcome::Unknown { .. } => e.enrolments_unknown += 1,
                        Outcome::Failed { .. } => {}
                    }
                }
                (Kind::Revoke { .. }, Outcome::Ok { revoked, .. }) if !revoked.is_empty() => {
                    e.revocations_acknowledged += 1;
                    for c in revoked {
                        let at = revoked_at.entry(c).or_insert(op.complete_ms);
                        *at = (*at).min(op.complete_ms);
                    }
                }
                _ => {}
            }
        }
        for op in ops {
            if let Kind::Heartbeat { credential_id, .. } = &op.kind {
                e.heartbeats += 1;
                e.heartbeats_after_revocation += usize::from(
                    revoked_at
                        .get(credential_id.as_str())
                        .is_some_and(|at| op.invoke_ms > *at),
                );
            }
        }
        let installed = |kind: &'static str| {
            faults
                .iter()
                .filter(move |f| f.kind == kind && f.status == "installed")
        };
        e.leader_kills = installed("kill-leader").count();
        e.leader_kills_mid_enrolment = installed("kill-leader")
            .filter(|f| f.enrolments_in_flight > 0)
            .count();
        e.partitions = installed("partition-leader").count();
        e.pauses = installed("pause-leader").count();
        e.membership_changes = installed("replace-member").count();
        e
    }

    /// Every count below its floor in `min`, named: empty when the run exercised enough.
    pub fn shortfalls(&self, min: &Exercised) -> Vec<String> {
        let pairs = [
            (
                "enrolments acknowledged",
                self.enrolments_acknowledged,
                min.enrolments_acknowledged,
            ),
            (
                "enrolment retries",
                self.enrolment_retries,
                min.enrolment_retries,
            ),
            (
                "enrolments with an unknown outcome",
                self.enrolments_unknown,
                min.enrolments_unknown,
            ),
            ("heartbeats", self.heartbeats, min.heartbeats),
            (
                "revocations acknowledged",
                self.revocations_acknowledged,
                min.revocations_acknowledged,
            ),
            (
                "heartbeats after an acknowledged revocation",
                self.heartbeats_after_revocation,
                min.heartbeats_after_revocation,
            ),
            ("leader kills", self.leader_kills, min.leader_kills),
            (
                "leader kills mid-enrolment",
                self.leader_kills_mid_enrolment,
                min.leader_kills_mid_enrolment,
            ),
            ("partitions", self.partitions, min.partitions),
            ("pauses", self.pauses, min.pauses),
            (
                "membership changes",
                self.membership_changes,
                min.membership_changes,
            ),
        ];
        pairs
            .into_iter()
            .filter(|(_, got, floor)| got < floor)
            .map(|(what, got, floor)| format!("{what}: {got}, needs {floor}"))
            .collect()
    }
}

impl std::fmt::Display for Exercised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "enrolments {} (retries {}, unknown {}), heartbeats {} ({} after a revocation), revocations {}, leader kills {} ({} mid-enrolment), pauses {}, partitions {}, members replaced {}",
            self.enrolments_acknowledged,
            self.enrolment_retries,
            self.enrolments_unknown,
            self.heartbeats,
            self.heartbeats_after_revocation,
            self.revocations_acknowledged,
            self.leader_kills,
            self.leader_kills_mid_enrolment,
            self.pauses,
            self.partitions,
            self.membership_changes
        )
    }
}

/// The file that marks a work dir as made by this harness: only such a dir is ever removed.
const WORK_DIR_MARK: &str = ".modelforge-chaos-work-dir";

/// Make `dir` an empty work dir. An existing dir is emptied only if this harness made it (a
/// replay must not inherit an earlier run's state, and `--work-dir` must never wipe a dir that
/// holds anything else).
pub fn prepare_work_dir(dir: &std::path::Path) -> Result<(), HarnessError> {
    let fail = |e: std::io::Error| HarnessError(format!("work dir {}: {e}", dir.display()));
    if dir.exists() {
        let mine = dir.join(WORK_DIR_MARK).exists();
        let empty = std::fs::read_dir(dir).map_err(fail)?.next().is_none();
        if !mine && !empty {
            return Err(HarnessError(format!(
                "work dir {} exists and was not made by modelforge-chaos; refusing to empty it",
                dir.display()
            )));
        }
        if mine {
            std::fs::remove_dir_all(dir).map_err(fail)?;
        }
    }
    std::fs::create_dir_all(dir).map_err(fail)?;
    std::fs::write(dir.join(WORK_DIR_MARK), b"").map_err(fail)
}

/// Remove a work dir made by `prepare_work_dir`, and nothing else.
pub fn remove_work_dir(dir: &std::path::Path) {
    if dir.join(WORK_DIR_MARK).exists() {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// Wait for every workload task. One that panicked stopped producing the events the rules are
/// checked on, so the run is harness trouble, never a pass.
pub async fn join_workload(tasks: Vec<tokio::task::JoinHandle<()>>) -> Result<(), HarnessError> {
    let mut died = vec![];
    for t in tasks {
        if let Err(e) = t.await {
            died.push(e.to_string());
        }
    }
    if died.is_empty() {
        Ok(())
    } else {
        Err(HarnessError(format!(
            "{} workload task(s) died: {}",
            died.len(),
            died.join("; ")
        )))
    }
}

/// Run one chaos profile; `Err` is harness trouble, never a verdict on the system.
pub async fn run(cfg: &RunConfig) -> Result<RunReport, HarnessError> {
    prepare_work_dir(&cfg.work_dir)?;
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
    let joined = join_workload(tasks).await;
    let faults = faults?;
    joined?;

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
    std::fs::write(
        cfg.work_dir.join("final-state.json"),
        serde_json::to_vec(&fin).unwrap_or_default(),
    )
    .ok();
    Ok(RunReport {
        seed: cfg.seed,
        members: cfg.members,
        operations: ops.len(),
        exercised: Exercised::count(&ops, &faults),
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
    // The configuration every member reports, once it agrees (or the deadline passes).
    loop {
        let configs = cluster.configurations().await;
        let same = configs.iter().all(|c| c.is_some()) && configs.windows(2).all(|w| w[0] == w[1]);
        if same || tokio::time::Instant::now() >= deadline {
            fin.configurations = configs;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let nodes: api::Nodes = cluster
        .admin_get_all("/api/v1/admin/hardware/nodes", "nodes", t)
        .await?;
    for n in nodes.nodes {
        let id = n.node_id.to_string();
        fin.nodes
            .insert(id.clone(), n.identity_public_key.to_string());
        let creds: api::Credentials = cluster
            .admin_get_all(
                &format!("/api/v1/admin/hardware/nodes/{id}/credentials"),
                "credentials",
                t,
            )
            .await?;
        // Listed oldest first.
        let mut own = vec![];
        for c in creds.credentials {
            let cid = c.credential_id.to_string();
            own.push(cid.clone());
            fin.credentials.insert(
                cid,
                FinalCredential {
                    node_id: id.clone(),
                    revoked: c.revoked_at.is_some(),
                    revoked_reason: c.revoked_reason,
                    token_id: c.enrollment_id.map(|t| t.to_string()),
                },
            );
        }
        fin.node_credentials.insert(id, own);
    }
    let toks: api::Enrollments = cluster
        .admin_get_all("/api/v1/admin/node-enrollments", "enrollments", t)
        .await?;
    for r in toks.enrollments {
        fin.tokens.insert(
            r.enrollment_id.to_string(),
            FinalToken {
                state: r.state.to_string(),
                claimed_node_id: r.claimed_node_id.map(|n| n.to_string()),
                note: r.note,
            },
        );
    }
    Ok(fin)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_workload_task_that_panics_is_harness_trouble() {
        let ok = tokio::spawn(async {});
        let boom = tokio::spawn(async { panic!("planted") });
        let e = join_workload(vec![ok, boom]).await.unwrap_err();
        assert!(e.0.contains("1 workload task(s) died"), "{e}");
        assert!(join_workload(vec![tokio::spawn(async {})]).await.is_ok());
    }

    #[test]
    fn a_run_short_of_any_event_is_named() {
        let min = Exercised {
            revocations_acknowledged: 3,
            heartbeats_after_revocation: 10,
            pauses: 1,
            ..Default::default()
        };
        let got = Exercised {
            revocations_acknowledged: 3,
            heartbeats_after_revocation: 9,
            ..Default::default()
        };
        assert_eq!(
            got.shortfalls(&min),
            vec![
                "heartbeats after an acknowledged revocation: 9, needs 10".to_string(),
                "pauses: 0, needs 1".to_string()
            ]
        );
        assert!(min.shortfalls(&min).is_empty());
    }

    #[test]
    fn counts_come_from_the_history_and_the_installed_faults() {
        use history::Kind;
        use history::Op;
        use history::Outcome;
        let op = |id, t, kind, outcome| Op {
            id,
            client: "t".into(),
            invoke_ms: t,
            complete_ms: t + 1,
            kind,
            outcome,
        };
        let hb = |id, t| {
            op(
                id,
                t,
                Kind::Heartbeat {
                    node_id: "n".into(),
                    credential_id: "c".into(),
                    member: 0,
                },
                Outcome::ok(),
            )
        };
        let revoke = Outcome::Ok {
            token_id: None,
            node_id: None,
            credential_id: None,
            revoked: vec!["c".into()],
        };
        let ops = vec![
            hb(0, 0),
            op(
                1,
                10,
                Kind::Revoke {
                    node_id: "n".into(),
                    reason: "r".into(),
                },
                revoke,
            ),
            hb(2, 20),
            op(
                3,
                30,
                Kind::Enroll {
                    token_id: "t".into(),
                    identity: "k".into(),
                    attempt: 1,
                },
                Outcome::Unknown { why: "x".into() },
            ),
        ];
        let fault = |kind, status: &str, in_flight| FaultRecord {
            kind,
            target: Some(0),
            at_ms: 0,
            healed_ms: None,
            status: status.into(),
            enrolments_in_flight: in_flight,
        };
        let faults = vec![
            fault("kill-leader", "installed", 2),
            fault("kill-leader", "installed", 0),
            fault("kill-leader", "skipped: no leader to target", 1),
            fault("pause-leader", "installed", 0),
            fault("partition-leader", "indeterminate: x", 0),
        ];
        let e = Exercised::count(&ops, &faults);
        assert_eq!(
            e,
            Exercised {
                enrolments_acknowledged: 0,
                enrolment_retries: 1,
                enrolments_unknown: 1,
                heartbeats: 2,
                revocations_acknowledged: 1,
                heartbeats_after_revocation: 1,
                leader_kills: 2,
                leader_kills_mid_enrolment: 1,
                partitions: 0,
                pauses: 1,
                membership_changes: 0,
            }
        );
    }

    #[test]
    fn a_work_dir_not_made_by_the_harness_is_never_emptied() {
        let root =
            std::env::temp_dir().join(format!("mf-chaos-wd-{}", modelforge_proto::new_uuid()));
        std::fs::create_dir_all(&root).unwrap();
        std::fs::write(root.join("precious"), b"x").unwrap();
        assert!(prepare_work_dir(&root).is_err());
        remove_work_dir(&root);
        assert!(
            root.join("precious").exists(),
            "an unmarked dir was removed"
        );
        std::fs::remove_file(root.join("precious")).unwrap();
        // Empty: taken and marked; then emptied on the next run, and removed at the end.
        prepare_work_dir(&root).unwrap();
        std::fs::write(root.join("history.json"), b"[]").unwrap();
        prepare_work_dir(&root).unwrap();
        assert!(!root.join("history.json").exists());
        remove_work_dir(&root);
        assert!(!root.exists());
    }
}
