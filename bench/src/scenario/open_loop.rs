//! Open-loop heartbeats on cluster B: each agent at 1/s through the member it talks to, in
//! steps of offered load, latency measured from the scheduled send (no coordinated omission).

use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;

use serde_json::json;

use super::Bench;
use super::population::Population;
use crate::cluster::ADMIN;
use crate::cluster::cpu_secs;
use crate::cluster::cpu_since;
use crate::load;
use crate::load::Stats;

pub async fn run(bench: &mut Bench, pop: &Population) {
    let (p, http) = (bench.p, bench.http.clone());
    let r = &mut bench.r;
    let (b, urls, agents) = (&pop.cluster, &pop.urls, &pop.agents);
    // Open-loop heartbeats: each agent at a 1 s interval through the member it talks to, in
    // steps of offered load (a step past capacity shows how it degrades, not just where).
    let mut steps = vec![];
    // What the members spend with no agent sending: the floor under every step's CPU figure.
    let member_pids: Vec<u32> = (0..3).filter_map(|i| b.pid(i)).collect();
    let idle_before: Vec<f64> = member_pids.iter().map(|&pid| cpu_secs(pid)).collect();
    let idle_start = Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let idle_secs = idle_start.elapsed().as_secs_f64();
    let idle: Vec<f64> = cpu_since(&member_pids, &idle_before)
        .iter()
        .map(|cpu| cpu / idle_secs)
        .collect();
    println!(
        "  members idle with {} nodes: {} cores",
        agents.len(),
        idle.iter()
            .map(|c| format!("{c:.3}"))
            .collect::<Vec<_>>()
            .join(" / ")
    );
    r.put("members_idle_cores", json!(idle));
    for &rate in p.open_rates {
        let open: Arc<Vec<load::SimAgent>> = Arc::new(agents.iter().take(rate).cloned().collect());
        let offered = open.len() as f64;
        // The members and this load generator (which shares their cores).
        let pids: Vec<u32> = member_pids
            .iter()
            .copied()
            .chain([std::process::id()])
            .collect();
        let perf = super::perf_record(
            &format!("open_loop_{rate}"),
            &pids,
            Duration::from_secs(p.open_secs),
        );
        let cpu_before: Vec<f64> = pids.iter().map(|&pid| cpu_secs(pid)).collect();
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
        // CPU per heartbeat, a figure the machine's noise moves far less than latency: the
        // members' together and this load generator's (the last pid).
        let cpu = cpu_since(&pids, &cpu_before);
        if let Some(mut perf) = perf {
            let _ = perf.wait();
        }
        let (mut lat, mut failed, mut shed) = (vec![], 0, 0);
        // The same answers by the second they were scheduled in: whether a tail is the step's
        // onset (new agents' connections) or spread over it.
        let mut by_second = vec![(vec![], 0usize); p.open_secs as usize + 1];
        for (sched, done, status) in traces.iter().flatten() {
            let second = &mut by_second[(sched.saturating_duration_since(start).as_secs()
                as usize)
                .min(p.open_secs as usize)];
            match status {
                Some(200) => second.0.push(*done - *sched),
                Some(503) => second.1 += 1,
                _ => {}
            }
            match status {
                Some(200) => lat.push(*done - *sched),
                // Shed by admission control (503 over_capacity, Retry-After): answered at
                // once, by design; counted apart from failures.
                Some(503) => shed += 1,
                _ => failed += 1,
            }
        }
        let s = Stats::new(lat, failed, secs);
        let answered = (s.ok + shed + s.failed).max(1) as f64;
        let (generator_cpu, each_member_cpu) = cpu.split_last().unwrap_or((&0.0, &[]));
        let us_each = |cpu: f64| cpu * 1e6 / answered;
        let each_member: Vec<f64> = each_member_cpu.iter().map(|c| us_each(*c)).collect();
        let members_us: f64 = each_member.iter().sum();
        println!(
            "  {rate}/s: CPU per answered heartbeat {:.0} us in the members ({}), {:.0} us in the load generator",
            members_us,
            each_member
                .iter()
                .map(|us| format!("{us:.0}"))
                .collect::<Vec<_>>()
                .join(" / "),
            us_each(*generator_cpu)
        );
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
        let seconds: Vec<_> = by_second
            .into_iter()
            .map(|(lat, shed)| {
                let s = Stats::new(lat, 0, 1.0);
                json!({"admitted": s.ok, "shed": shed, "p99_ms": s.pct(0.99), "max_ms": s.pct(1.0)})
            })
            .collect();
        println!(
            "  {rate}/s by second (admitted, shed, p99 ms): {}",
            seconds
                .iter()
                .map(|v| format!(
                    "{} {} {:.1}",
                    v["admitted"],
                    v["shed"],
                    v["p99_ms"].as_f64().unwrap_or(0.0)
                ))
                .collect::<Vec<_>>()
                .join(" | ")
        );
        steps.push(json!({
            "offered_per_s": offered,
            "shed": shed,
            "stats": s.json(),
            "by_second": seconds,
            "cpu_us_per_answer": {
                "members": members_us,
                "each_member": each_member,
                "load_generator": us_each(*generator_cpu),
            },
        }));
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
