//! The CI profile of the chaos suite: about two minutes of traffic with 20 or more leader
//! kills, pauses and partitions, checked afterwards. A violation fails the test with the seed
//! and a replay command; harness trouble fails it as harness trouble, never as a pass.

use std::time::Duration;

use modelforge_chaos::RunConfig;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_profile_finds_no_violation() {
    let seed = std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| modelforge_proto::now_ms() as u64);
    let secs = std::env::var("CHAOS_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100);
    let work = std::env::temp_dir().join(format!("mf-chaos-ci-{seed}"));
    let cfg = RunConfig {
        seed,
        members: 3,
        duration: Duration::from_secs(secs),
        agents: 6,
        heartbeaters: 4,
        fault_every: Duration::from_millis(600),
        server_bin: modelforge_chaos::server_bin_for_tests(),
        work_dir: work.clone(),
    };
    eprintln!(
        "chaos short profile: seed {seed}; replay: {}",
        cfg.replay_command()
    );
    let report = match modelforge_chaos::run(&cfg).await {
        Ok(r) => r,
        Err(e) => panic!(
            "{e}: not a verdict on the system; logs in {}",
            work.display()
        ),
    };
    eprintln!(
        "operations {}, enrolments {} (retries {}), heartbeats {}, leader kills {} ({} mid-enrolment), pauses {}, partitions {}, unknown {:?}",
        report.operations,
        report.enrolments_acknowledged,
        report.enrolment_retries,
        report.heartbeats,
        report.leader_kills,
        report.leader_kills_mid_enrolment,
        report.pauses,
        report.partitions,
        report.resolution
    );
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
    assert!(
        report.leader_kills >= 20,
        "the profile must land 20 or more leader kills, got {}",
        report.leader_kills
    );
    // A traffic floor, generous for a slow machine: the point is many enrolments with kills
    // landing among them, not a throughput figure.
    let attempts = report.enrolments_acknowledged + report.enrolment_retries;
    assert!(
        attempts >= 200 && report.enrolments_acknowledged >= 80,
        "too little enrolment traffic: {} acknowledged, {attempts} requests",
        report.enrolments_acknowledged
    );
    let _ = std::fs::remove_dir_all(&work);
}
