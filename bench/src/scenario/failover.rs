//! Failover on cluster B: agents heartbeat at their interval, the leader is killed with -9, and
//! the time to the next acknowledged write and to every agent answered 200 again is measured.

use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;

use serde_json::json;

use super::Bench;
use super::population::Population;
use crate::cluster::ADMIN;
use crate::cluster::Cluster;
use crate::load;
use crate::report::ms;

/// Returns the index of the member it killed (restarted by the memory scenario).
pub async fn run(bench: &mut Bench, pop: &mut Population, one: f64) -> usize {
    let (p, http) = (bench.p, bench.http.clone());
    let r = &mut bench.r;
    let (urls, agents, canary) = (&pop.urls, &pop.agents, &pop.canary);
    let b = &mut pop.cluster;
    // Failover: agents heartbeat at their interval; kill -9 the leader; time to the next
    // acknowledged write, and to every agent having had a 200 again.
    let fo: Arc<Vec<load::SimAgent>> =
        Arc::new(agents.iter().take(p.failover_agents).cloned().collect());
    let n_fo = fo.len();
    let iv = p.failover_interval;
    let verifies_before = argon2_verifies(b, &http).await;
    let start = Instant::now();
    let deadline = start + iv * 6;
    let (h, us) = (http.clone(), urls.clone());
    let run = tokio::spawn(async move { load::run_agents(&h, &us, fo, iv, deadline, 4096).await });
    tokio::time::sleep(iv * 2).await; // steady state before the fault
    let old = b.wait_leader(Duration::from_secs(10)).await;
    load::take_refusals();
    load::count_refusals(true);
    let killed_at = Instant::now();
    b.kill(old);
    let survivors: Vec<String> = (0..3).filter(|i| *i != old).map(|i| b.url(i)).collect();
    // When a survivor first says it leads (ms after the kill, its id and term), polled every
    // 20 ms while the write below is tried: the election's share of the write's time.
    let leader_seen = {
        let (h, us) = (http.clone(), survivors.clone());
        tokio::spawn(async move {
            loop {
                for u in &us {
                    let view =
                        modelforge_devkit::cluster_view(&h, u, ADMIN, Duration::from_secs(1));
                    if let Some(v) = view.await
                        && v.state == "Leader"
                    {
                        return Some((ms(killed_at.elapsed()), v.id, v.term));
                    }
                }
                if killed_at.elapsed() > Duration::from_secs(30) {
                    return None;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let mut k = 0;
    // Each write attempt: (ms after the kill it was sent, answered, survivor, what it got).
    let mut write_attempts: Vec<(f64, f64, usize, String)> = vec![];
    let write_ms = loop {
        let u = &survivors[k % survivors.len()];
        k += 1;
        let sent = ms(killed_at.elapsed());
        let got = http
            .delete(format!(
                "{u}/api/v1/admin/hardware/nodes/{}/credential",
                canary.node_id
            ))
            .bearer_auth(ADMIN)
            .timeout(Duration::from_secs(2))
            .send()
            .await;
        let (ok, what) = match got {
            Ok(r) if r.status() == 200 => (true, "200".to_string()),
            Ok(r) => {
                let status = r.status().as_u16();
                let body: serde_json::Value = r.json().await.unwrap_or_default();
                let code = body["error"]["code"].as_str().unwrap_or("no error body");
                (false, format!("{status} {code}"))
            }
            Err(e) if e.is_timeout() => (false, "timed out".into()),
            Err(_) => (false, "no answer".into()),
        };
        write_attempts.push((
            sent,
            ms(killed_at.elapsed()),
            (k - 1) % survivors.len(),
            what,
        ));
        if ok {
            break ms(killed_at.elapsed());
        }
        assert!(
            killed_at.elapsed() < Duration::from_secs(30),
            "no write acknowledged within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let leader_seen = leader_seen.await.ok().flatten();
    let traces = run.await.expect("agents");
    // Every attempt's refusal from the kill on (an agent's pass tries each member once).
    load::count_refusals(false);
    let attempts_refused = load::take_refusals();
    let verifies_after = argon2_verifies(b, &http).await;
    let mut back = vec![];
    // Per agent, from its first heartbeat due after the kill to its first 200: an agent whose
    // next heartbeat was due just before the next interval cannot be back sooner than that,
    // so "back within one interval" is judged from when each agent next tried.
    let mut outage = vec![];
    let mut never = 0;
    let mut refused_after = 0;
    // What the heartbeats after the kill that did not get 200 got instead, and the slowest
    // agent's heartbeats from the kill on (ms after the kill: scheduled, answered, status).
    let mut refusals = std::collections::BTreeMap::<String, usize>::new();
    let mut slowest: (Duration, Vec<(f64, f64, Option<u16>)>) = (Duration::ZERO, vec![]);
    for trace in &traces {
        // A heartbeat in flight at the kill counts: it is the one that may have been lost.
        let after: Vec<_> = trace.iter().filter(|(_, d, _)| *d >= killed_at).collect();
        for (_, _, st) in after.iter().filter(|(_, _, st)| *st != Some(200)) {
            refused_after += 1;
            *refusals
                .entry(st.map_or("no answer".into(), |s| s.to_string()))
                .or_default() += 1;
        }
        match after.iter().find(|(_, _, st)| *st == Some(200)) {
            Some((_, done, _)) => {
                back.push(*done - killed_at);
                let first_due = after
                    .first()
                    .map_or(killed_at, |(s, _, _)| *s.max(&killed_at));
                outage.push(*done - first_due);
                if *done - first_due > slowest.0 {
                    let at = |t: &Instant| {
                        t.checked_duration_since(killed_at)
                            .map_or_else(|| -ms(killed_at - *t), ms)
                    };
                    slowest = (
                        *done - first_due,
                        after.iter().map(|(s, d, st)| (at(s), at(d), *st)).collect(),
                    );
                }
            }
            None => never += 1,
        }
    }
    back.sort();
    outage.sort();
    let all_back = back.last().copied().unwrap_or_default();
    let worst_outage = outage.last().copied().unwrap_or_default();
    let new_verifies = verifies_after.saturating_sub(verifies_before);
    r.row(
        "Failover: kill -9 leader -> next acknowledged write",
        format!("{write_ms:.0} ms"),
        "-".into(),
        "< 1 s",
        Some(write_ms < 1000.0),
    );
    r.row(
        &format!("Failover: every one of {n_fo} agents (interval {iv:?}) gets 200 again"),
        format!(
            "longest from an agent's next heartbeat to its 200: {:.0} ms; last agent back {:.0} ms after the kill ({never} never did; {refused_after} heartbeats unanswered or refused)",
            ms(worst_outage),
            ms(all_back)
        ),
        format!(
            "{new_verifies} argon2 verifies on the survivors (~{:.0} ms of one core at the default parameters)",
            new_verifies as f64 * one * 1000.0
        ),
        "< 1 heartbeat interval",
        Some(never == 0 && worst_outage < iv),
    );
    r.put(
        "failover",
        json!({"write_ms": write_ms, "agents": n_fo, "interval_ms": ms(iv), "all_back_ms": ms(all_back), "worst_outage_ms": ms(worst_outage),
               "p50_back_ms": ms(back.get(back.len() / 2).copied().unwrap_or_default()),
               "never_back": never, "unanswered_or_refused": refused_after,
               "refused_by_status": refusals, "attempts_refused": attempts_refused, "slowest_agent_after_kill": slowest.1,
               "argon2_verifies_on_survivors": new_verifies, "write_attempts": write_attempts, "leader_seen": leader_seen}),
    );
    old
}

/// Sum of argon2 verifies the running members have done.
async fn argon2_verifies(c: &Cluster, http: &reqwest::Client) -> u64 {
    let mut n = 0;
    for i in 0..3 {
        if c.pid(i).is_some()
            && let Some(v) = c.cluster_view(http, i).await
        {
            n += v.secret_checks.argon2_verifies;
        }
    }
    n
}
