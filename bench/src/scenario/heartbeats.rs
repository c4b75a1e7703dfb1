//! Closed-loop heartbeats on cluster A, all to the leader and spread over the members, against
//! the bare-axum reference over TLS (the members serve TLS).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::Mutex;

use super::Bench;
use super::enrolment::ClusterA;
use crate::load;
use crate::load::Stats;
use crate::load::drive;

/// `bare_s`: the bare-axum reference over TLS.
pub async fn run(b: &mut Bench, a: &ClusterA, bare_s: &Stats) {
    let (p, http) = (b.p, b.http.clone());
    // Steady state: the leader refills its credential pool after the burst (argon2 at a
    // quarter of a core while agents are served), which is not what a heartbeat costs.
    super::enrolment::wait_pool(&a.cluster, &http, p.burst).await;
    let r = &mut b.r;
    let (agents_a, urls, leader_url) = (&a.agents, &a.urls, &a.leader_url);
    for (name, key, spread) in [
        (
            "Heartbeats, all to the leader",
            "heartbeats_all_to_the_leader",
            false,
        ),
        (
            "Heartbeats, spread over 3 members",
            "heartbeats_spread_over_3_members",
            true,
        ),
    ] {
        let (h, ag, us, lu) = (
            http.clone(),
            agents_a.clone(),
            urls.clone(),
            leader_url.clone(),
        );
        let pids: Vec<u32> = (0..3).filter_map(|i| a.cluster.pid(i)).collect();
        let perf = super::perf_record(key, &pids, p.dur);
        // Answers other than 200, by status (None: no answer): at saturation the members'
        // queue-delay shedding answers some with 503, which the rate does not count.
        let refused = Arc::new(Mutex::new(BTreeMap::<String, u64>::new()));
        let tally = refused.clone();
        let s = drive(p.hb_loops, p.dur, move |_, n| {
            let (h, ag, tally) = (h.clone(), ag.clone(), tally.clone());
            let u = if spread {
                us[n % 3].clone()
            } else {
                lu.clone()
            };
            async move {
                let status = load::heartbeat(&h, &u, &ag[n % ag.len()]).await;
                if status != Some(200) {
                    let key = status.map_or("none".to_string(), |c| c.to_string());
                    *tally.lock().unwrap().entry(key).or_default() += 1;
                }
                status == Some(200)
            }
        })
        .await;
        let refused = std::mem::take(&mut *refused.lock().unwrap());
        println!("  {name}: answers other than 200: {refused:?}");
        if let Some(mut perf) = perf {
            let _ = perf.wait();
        }
        r.row(
            name,
            format!(
                "{:.0}/s p50 {:.2} ms p99 {:.2} ms",
                s.rate(),
                s.pct(0.5),
                s.pct(0.99)
            ),
            format!(
                "bare axum over TLS {:.0}/s ({:.2})",
                bare_s.rate(),
                s.rate() / bare_s.rate()
            ),
            if spread {
                ">= 0.5 of bare axum"
            } else {
                ">= 0.7 of bare axum"
            },
            Some(s.rate() / bare_s.rate() >= if spread { 0.5 } else { 0.7 }),
        );
        let mut json = s.json();
        json["not_200"] = serde_json::json!(refused);
        r.put(key, json);
    }
}
