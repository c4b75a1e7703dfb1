//! Open-loop heartbeats on cluster B: each agent at 1/s through the member it talks to, in
//! steps of offered load, latency measured from the scheduled send (no coordinated omission).

use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;

use serde_json::json;

use super::Bench;
use super::population::Population;
use crate::cluster::ADMIN;
use crate::load;
use crate::load::Stats;

pub async fn run(bench: &mut Bench, pop: &Population) {
    let (p, http) = (bench.p, bench.http.clone());
    let r = &mut bench.r;
    let (b, urls, agents) = (&pop.cluster, &pop.urls, &pop.agents);
    // Open-loop heartbeats: each agent at a 1 s interval through the member it talks to, in
    // steps of offered load (a step past capacity shows how it degrades, not just where).
    let mut steps = vec![];
    for &rate in p.open_rates {
        let open: Arc<Vec<load::SimAgent>> = Arc::new(agents.iter().take(rate).cloned().collect());
        let offered = open.len() as f64;
        let start = Instant::now();
        let traces = load::run_agents(
            &http,
            urls,
            open,
            Duration::from_secs(1),
            start + Duration::from_secs(p.open_secs),
            1024,
        )
        .await;
        let secs = start.elapsed().as_secs_f64();
        let (mut lat, mut failed, mut shed) = (vec![], 0, 0);
        for (sched, done, status) in traces.iter().flatten() {
            match status {
                Some(200) => lat.push(*done - *sched),
                // Shed by admission control (503 over_capacity, Retry-After): answered at
                // once, by design; counted apart from failures.
                Some(503) => shed += 1,
                _ => failed += 1,
            }
        }
        let s = Stats::new(lat, failed, secs);
        r.row(
            &format!("Heartbeats open-loop, {rate} agents at 1/s each"),
            format!(
                "{:.0}/s admitted, p50 {:.2} ms p99 {:.2} ms ({shed} shed with 503, {} other not 200)",
                s.rate(),
                s.pct(0.5),
                s.pct(0.99),
                s.failed
            ),
            "latency of the admitted (200) from the scheduled send (no coordinated omission)".into(),
            if rate >= 10_000 {
                "p99 < 10 ms at 10,000/s"
            } else {
                "-"
            },
            (rate >= 10_000).then(|| s.pct(0.99) < 10.0 && s.rate() >= 0.95 * offered),
        );
        steps.push(json!({"offered_per_s": offered, "shed": shed, "stats": s.json()}));
    }
    r.put("heartbeats_open_loop", json!(steps));

    // Let the previous step's overload drain first (requests the clients gave up on are still
    // being answered): wait until the leader answers a read within 50 ms, for up to 60 s.
    let settle = Instant::now();
    let probe = agents.last().map(|a| a.node_id.clone()).unwrap_or_default();
    while settle.elapsed() < Duration::from_secs(60) {
        let l = b.wait_leader(Duration::from_secs(30)).await;
        let t = Instant::now();
        let ok = http
            .get(format!("{}/api/v1/admin/hardware/nodes/{probe}", b.url(l)))
            .bearer_auth(ADMIN)
            .send()
            .await
            .is_ok_and(|r| r.status() == 200);
        if ok && t.elapsed() < Duration::from_millis(50) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!(
        "settled after the open-loop steps in {:.1} s",
        settle.elapsed().as_secs_f64()
    );
}
