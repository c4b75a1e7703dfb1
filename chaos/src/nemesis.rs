//! The faults, one at a time, on a seeded schedule. Each is reported as installed, skipped
//! (with why) or indeterminate.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde::Serialize;

use crate::Rng;
use crate::RunConfig;
use crate::cluster::ChaosCluster;
use crate::cluster::HarnessError;
use crate::workload::Shared;

#[derive(Clone, Debug, Serialize)]
pub struct FaultRecord {
    pub kind: &'static str,
    pub target: Option<usize>,
    pub at_ms: u64,
    pub healed_ms: Option<u64>,
    /// installed | skipped: <why> | indeterminate: <why>
    pub status: String,
    pub enrolments_in_flight: usize,
}

pub async fn run(
    cluster: &mut ChaosCluster,
    sh: &Arc<Shared>,
    cfg: &RunConfig,
    rng: &mut Rng,
) -> Result<Vec<FaultRecord>, HarnessError> {
    let mut out = vec![];
    let start = tokio::time::Instant::now();
    let (end, last) = (start + cfg.duration, start + 2 * cfg.duration);
    // Let some traffic start before the first fault.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let more = |out: &[FaultRecord]| {
        let now = tokio::time::Instant::now();
        now < end
            || (now < last
                && cfg.floors.as_ref().is_some_and(|f| {
                    !crate::Exercised::count(&sh.history.ops(), out)
                        .shortfalls(f)
                        .is_empty()
                }))
    };
    while more(&out) {
        let kind = match rng.below(if cfg.membership { 25 } else { 20 }) {
            0..=10 => "kill-leader",
            11..=12 => "kill-follower",
            13..=15 => "pause-leader",
            16..=19 => "partition-leader",
            _ => "replace-member",
        };
        let hold = Duration::from_millis(300 + rng.below(1200) as u64);
        let at_ms = sh.history.now_ms();
        let leader = cluster.wait_leader(Duration::from_secs(5)).await;
        let mut rec = FaultRecord {
            kind,
            target: leader,
            at_ms,
            healed_ms: None,
            status: String::new(),
            enrolments_in_flight: 0,
        };
        let Some(l) = leader else {
            rec.status = "skipped: no leader to target".into();
            out.push(rec);
            continue;
        };
        match kind {
            "kill-leader" => {
                // Time the kill to land while enrolments are in flight when possible.
                let wait_until = tokio::time::Instant::now() + Duration::from_millis(500);
                while sh.enrolls_in_flight.load(Ordering::SeqCst) == 0
                    && tokio::time::Instant::now() < wait_until
                {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                tokio::time::sleep(Duration::from_millis(rng.below(40) as u64)).await;
                rec.enrolments_in_flight = sh.enrolls_in_flight.load(Ordering::SeqCst);
                rec.status = if cluster.kill9(l) {
                    "installed".into()
                } else {
                    "indeterminate: kill(2) failed".into()
                };
                tokio::time::sleep(hold).await;
                cluster.start_member(l)?;
            }
            "kill-follower" => {
                let f = (0..cluster.n).find(|i| *i != l && cluster.running(*i));
                match f {
                    None => rec.status = "skipped: no running follower".into(),
                    Some(f) => {
                        rec.target = Some(f);
                        rec.status = if cluster.kill9(f) {
                            "installed".into()
                        } else {
                            "indeterminate: kill(2) failed".into()
                        };
                        tokio::time::sleep(hold).await;
                        cluster.start_member(f)?;
                    }
                }
            }
            "replace-member" => {
                // Any member, the leader included (it hands leadership over first).
                let i = rng.below(cluster.n);
                rec.target = Some(i);
                rec.enrolments_in_flight = sh.enrolls_in_flight.load(Ordering::SeqCst);
                rec.status = cluster.replace(i).await?;
            }
            "pause-leader" => {
                rec.status = if cluster.pause(l) {
                    "installed".into()
                } else {
                    "indeterminate: SIGSTOP failed".into()
                };
                tokio::time::sleep(hold + Duration::from_millis(500)).await;
                cluster.resume(l);
            }
            _ => {
                cluster.isolate(l);
                rec.status = "installed".into();
                tokio::time::sleep(hold + Duration::from_millis(1000)).await;
                cluster.heal();
            }
        }
        rec.healed_ms = Some(sh.history.now_ms());
        out.push(rec);
        // Let the cluster settle before the next fault.
        let _ = cluster.wait_leader(Duration::from_secs(10)).await;
        tokio::time::sleep(
            cfg.fault_every / 2
                + Duration::from_millis(rng.below(cfg.fault_every.as_millis() as usize) as u64),
        )
        .await;
    }
    Ok(out)
}
