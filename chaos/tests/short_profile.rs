//! The CI profiles of the chaos suite: about two minutes of traffic on three members with 20 or
//! more leader kills, pauses and partitions, and a five-member profile whose nemesis also
//! replaces members (removed, then a fresh member with a new id joins in their place), each
//! checked afterwards. A violation fails the test with the seed
//! and a replay command; harness trouble fails it as harness trouble, and so does a run that
//! did not produce enough of every event the checker's rules depend on: a rule never exercised
//! proved nothing.
//!
//! The seed comes from `CHAOS_SEED`, else from a fixed list, one per UTC day (printed, so a CI
//! failure replays with `CHAOS_SEED=<seed>`). Timing on a real machine is not reproducible: a
//! replay re-runs the same fault schedule and traffic choices, not the same interleaving.

use std::time::Duration;

use modelforge_chaos::Exercised;
use modelforge_chaos::RunConfig;

const SEEDS: [u64; 7] = [
    0x5eed_0001,
    0x5eed_0002,
    0x5eed_0003,
    0x5eed_0004,
    0x5eed_0005,
    0x5eed_0006,
    0x5eed_0007,
];

/// The floors a CI run must reach: about a third of what 100 s produced here (seed 0x5eed0001:
/// 266 enrolments, 200 unknown, 9,918 heartbeats, 1,550 after a revocation, 37 revocations,
/// 23 leader kills all mid-enrolment, 9 pauses, 13 partitions), so a loaded machine passes.
fn floors() -> Exercised {
    Exercised {
        enrolments_acknowledged: 80,
        enrolment_retries: 5,
        enrolments_unknown: 10,
        heartbeats: 2_000,
        revocations_acknowledged: 10,
        heartbeats_after_revocation: 100,
        leader_kills: 20,
        leader_kills_mid_enrolment: 10,
        partitions: 2,
        pauses: 2,
        membership_changes: 0,
    }
}

/// The five-member profile's floors, far under what 60 s produced here (seed 0x5eed0001: 214
/// enrolments, 2,757 heartbeats, 34 revocations, 15 leader kills, 6 members replaced; seed
/// 0x5eed0003: 11 replaced), so that a loaded machine passes.
fn membership_floors() -> Exercised {
    Exercised {
        enrolments_acknowledged: 20,
        heartbeats: 500,
        revocations_acknowledged: 3,
        leader_kills: 3,
        membership_changes: 3,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_profile_finds_no_violation() {
    profile("short profile", 3, false, 100, floors()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_members_with_membership_changes_find_no_violation() {
    profile("membership profile", 5, true, 60, membership_floors()).await;
}

/// Run one profile: a violation fails with the seed and a replay command; so does a run that
/// did not exercise its floors (when it ran its full length).
async fn profile(name: &str, members: usize, membership: bool, default_secs: u64, min: Exercised) {
    let day = modelforge_proto::now_ms() as u64 / 86_400_000;
    let seed = match std::env::var("CHAOS_SEED") {
        Ok(s) => s.parse().expect("CHAOS_SEED is a number"),
        Err(_) => SEEDS[(day % SEEDS.len() as u64) as usize],
    };
    let secs = std::env::var("CHAOS_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default_secs);
    let work = std::env::temp_dir().join(format!("mf-chaos-ci-{members}-{seed}"));
    let cfg = RunConfig {
        seed,
        members,
        duration: Duration::from_secs(secs),
        floors: Some(min.clone()),
        agents: 6,
        heartbeaters: 4,
        fault_every: Duration::from_millis(600),
        membership,
        server_bin: modelforge_chaos::server_bin_for_tests(),
        work_dir: work.clone(),
    };
    eprintln!(
        "chaos {name}: seed {seed} (seeds {SEEDS:?}, or CHAOS_SEED); replay: CHAOS_SEED={seed} cargo nextest run -p modelforge-chaos --test short_profile, or {}",
        cfg.replay_command()
    );
    let report = match modelforge_chaos::run(&cfg).await {
        Ok(r) => r,
        Err(e) => panic!(
            "seed {seed}: {e}: not a verdict on the system; logs in {}",
            work.display()
        ),
    };
    eprintln!(
        "operations {}: {}; unknown outcomes {:?}",
        report.operations, report.exercised, report.resolution
    );
    for f in report.faults.iter().filter(|f| f.kind == "replace-member") {
        eprintln!(
            "replace-member slot {:?}: {}",
            f.target.map(|t| t + 1),
            f.status
        );
    }
    for v in &report.violations {
        eprintln!(
            "VIOLATION [{}] {} (operations {:?})",
            v.rule, v.detail, v.ops
        );
    }
    assert!(
        report.violations.is_empty(),
        "seed {seed}: {} violations; replay: {}; history in {}",
        report.violations.len(),
        report.replay,
        work.display()
    );
    if secs >= default_secs {
        let short = report.exercised.shortfalls(&min);
        assert!(
            short.is_empty(),
            "seed {seed}: the run did not exercise what the checker checks (harness trouble, not a verdict): {short:?}; logs in {}",
            work.display()
        );
    }
    modelforge_chaos::remove_work_dir(&work);
}
