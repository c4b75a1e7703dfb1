//! Replicated writes that hash no secret (revocations and inventory changes alternate) on
//! cluster A, against a 3-member etcd 3.4 at the same client counts when one is installed.

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

use super::Bench;
use super::enrolment::ClusterA;
use crate::cluster::ADMIN;
use crate::cluster::Etcd;
use crate::cluster::cpu_secs;
use crate::cluster::cpu_since;
use crate::load::SimAgent;
use crate::load::Stats;
use crate::load::drive;

/// `clients` closed loops of replicated writes that hash no secret, through the leader at
/// `leader_url` for `dur`: revocations of the first half of `agents`' credentials, and cordons
/// and uncordons of the second half's nodes, alternating (admin writes, each audited). Agent
/// inventory reports are not used: a node may cause only so many replicated writes a minute
/// (429 `too_many_writes`), and agent requests are shed under load, so most would be refused.
pub async fn measure(
    http: &reqwest::Client,
    agents: &Arc<Vec<SimAgent>>,
    leader_url: &str,
    clients: usize,
    dur: Duration,
) -> Stats {
    let half = agents.len() / 2;
    let (h, ag, lu) = (http.clone(), agents.clone(), leader_url.to_string());
    drive(clients, dur, move |_, n| {
        let (h, ag, lu) = (h.clone(), ag.clone(), lu.clone());
        async move {
            let req = if n % 2 == 0 {
                let a = &ag[(n / 2) % half];
                h.delete(format!(
                    "{lu}/api/v1/admin/hardware/nodes/{}/credential",
                    a.node_id
                ))
            } else {
                let k = n / 2;
                let a = &ag[half + k % (ag.len() - half)];
                let op = if (k / (ag.len() - half)).is_multiple_of(2) {
                    "cordon"
                } else {
                    "uncordon"
                };
                h.post(format!(
                    "{lu}/api/v1/admin/hardware/nodes/{}/{op}",
                    a.node_id
                ))
                .json(&json!({"reason": "benchmark"}))
            };
            req.bearer_auth(ADMIN)
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
        }
    })
    .await
}

pub async fn run(b: &mut Bench, a: &ClusterA, with_etcd: bool) {
    let (p, http, dir) = (b.p, b.http.clone(), b.dir.clone());
    // Steady state, as for heartbeats: with `--only writes` the enrolment burst has just
    // drained the leader's credential pool, and its refill (argon2 at a quarter of a core) was
    // 45% of the members' CPU at 1 client in a profile.
    super::enrolment::wait_pool(&a.cluster, &http, p.burst).await;
    let r = &mut b.r;
    let (agents_a, leader_url) = (&a.agents, &a.leader_url);
    let mut ours = vec![];
    for c in p.write_clients {
        let pids: Vec<u32> = (0..3).filter_map(|i| a.cluster.pid(i)).collect();
        let perf = super::perf_record(&format!("writes_{c}_clients"), &pids, p.dur);
        let urls = a.cluster.urls();
        let before = server_time(&http, leader_url).await;
        let fsyncs_before = counters(&http, &urls, FSYNCS).await;
        let rpcs_before = raft_rpcs(&http, &urls).await;
        let cpu_before: Vec<f64> = pids.iter().map(|&pid| cpu_secs(pid)).collect();
        let s = measure(&http, agents_a, leader_url, c, p.dur).await;
        let cpu = cpu_since(&pids, &cpu_before);
        let after = server_time(&http, leader_url).await;
        let fsyncs_after = counters(&http, &urls, FSYNCS).await;
        let rpcs_after = raft_rpcs(&http, &urls).await;
        if let Some(mut perf) = perf {
            let _ = perf.wait();
        }
        // What the leader itself measured, from routing to answer (the rest of the client's
        // latency is the transport, both ends' queues and the load generator).
        let server_ms = before
            .zip(after)
            .filter(|(b, a)| a.1 > b.1)
            .map(|(b, a)| 1000.0 * (a.0 - b.0) / (a.1 - b.1));
        // Group commits of each member's Raft log per answered write: what a write costs the
        // disks (a lone write costs each member one; fewer is batching).
        let answered = s.lat.len().max(1) as f64;
        let fsyncs_per_write: Vec<Option<f64>> = fsyncs_before
            .iter()
            .zip(&fsyncs_after)
            .map(|(b, a)| b.zip(*a).map(|(b, a)| (a - b) / answered))
            .collect();
        // Raft RPCs each follower served per answered write (openraft's heartbeats, 20 a
        // second, among them): one is a write in an RPC of its own; fewer is batching.
        let leader = urls.iter().position(|u| u == leader_url);
        let per_follower: Vec<f64> = rpcs_before
            .iter()
            .zip(&rpcs_after)
            .enumerate()
            .filter(|(i, _)| Some(*i) != leader)
            .filter_map(|(_, (b, a))| Some((a.as_ref()? - b.as_ref()?) / answered))
            .collect();
        let appends_per_write = (!per_follower.is_empty())
            .then(|| per_follower.iter().sum::<f64>() / per_follower.len() as f64);
        // What a write costs each member's CPU (the steadier figure on a noisy machine).
        let cpu_ms_per_write: Vec<f64> = cpu.iter().map(|s| 1000.0 * s / answered).collect();
        println!(
            "  writes, {c} clients: {:.0}/s p50 {:.2} ms p99 {:.2} ms ({} failed); mean on the leader {}; CPU ms per write by member {}; Raft RPCs per write per follower {}; log fsyncs per write by member {}",
            s.rate(),
            s.pct(0.5),
            s.pct(0.99),
            s.failed,
            server_ms.map_or("unknown".into(), |ms| format!("{ms:.2} ms")),
            cpu_ms_per_write
                .iter()
                .map(|ms| format!("{ms:.2}"))
                .collect::<Vec<_>>()
                .join(" / "),
            appends_per_write.map_or("?".into(), |a| format!("{a:.2}")),
            fsyncs_per_write
                .iter()
                .map(|f| f.map_or("?".into(), |f| format!("{f:.2}")))
                .collect::<Vec<_>>()
                .join(" / ")
        );
        let mut json = s.json();
        json["leader_mean_ms"] = serde_json::json!(server_ms);
        json["log_fsyncs_per_write"] = serde_json::json!(fsyncs_per_write);
        json["raft_rpcs_per_write_per_follower"] = serde_json::json!(appends_per_write);
        json["cpu_ms_per_write"] = serde_json::json!(cpu_ms_per_write);
        r.put(&format!("writes_{c}_clients"), json);
        ours.push(s);
    }
    // The reference speaks TLS as the members do (the bar: TLS on both sides); etcd
    // over plain HTTP is measured too, for the record.
    let ca = modelforge_devkit::ca(&b.bin);
    let theirs = etcd_writes(&http, &dir, Some(ca), p, with_etcd).await;
    let theirs_plain = etcd_writes(&http, &dir, None, p, with_etcd).await;
    for (i, c) in p.write_clients.iter().enumerate() {
        if let Some(e) = &theirs[i] {
            r.put(&format!("etcd_{c}_clients"), e.json());
        }
        if let Some(e) = &theirs_plain[i] {
            r.put(&format!("etcd_plain_{c}_clients"), e.json());
        }
    }
    for (i, c) in p.write_clients.iter().enumerate() {
        let s = &ours[i];
        let (reference, met) = match &theirs[i] {
            Some(e) => (
                format!(
                    "etcd over TLS {:.0}/s p99 {:.2} ms ({:.2}x){}",
                    e.rate(),
                    e.pct(0.99),
                    s.rate() / e.rate().max(1e-9),
                    theirs_plain[i]
                        .as_ref()
                        .map_or(String::new(), |plain| format!(
                            "; plain HTTP {:.0}/s p99 {:.2} ms",
                            plain.rate(),
                            plain.pct(0.99)
                        ))
                ),
                (*c == 128).then(|| s.rate() >= 2.0 * e.rate() && s.pct(0.99) <= e.pct(0.99)),
            ),
            None => (
                if with_etcd {
                    "etcd not installed or not healthy (apt-get install etcd-server)"
                } else {
                    "etcd not run (--no-etcd)"
                }
                .into(),
                None,
            ),
        };
        r.row(
            &format!("Replicated writes, {c} clients"),
            format!(
                "{:.0}/s p50 {:.2} ms p99 {:.2} ms",
                s.rate(),
                s.pct(0.5),
                s.pct(0.99)
            ),
            reference,
            if *c == 128 {
                ">= 2x etcd, p99 <= etcd's"
            } else {
                "-"
            },
            met,
        );
    }
}

/// etcd's put rate at each of the profile's client counts (None throughout when it is not
/// installed or `with_etcd` is off), on a fresh 3-member etcd over TLS with `ca`, else plain.
async fn etcd_writes(
    http: &reqwest::Client,
    dir: &std::path::Path,
    ca: Option<&modelforge_devkit::Ca>,
    p: &crate::Profile,
    with_etcd: bool,
) -> Vec<Option<Stats>> {
    let etcd = if with_etcd {
        Etcd::start(dir, ca).await
    } else {
        None
    };
    let mut out = vec![];
    for c in p.write_clients {
        let Some(e) = &etcd else {
            out.push(None);
            continue;
        };
        let (h, us) = (http.clone(), e.urls.clone());
        let s = drive(c, p.dur, move |l, n| {
            let (h, u) = (h.clone(), us[l % us.len()].clone());
            async move {
                let body =
                    json!({"key": crate::cluster::b64(format!("k{n}").as_bytes()), "value": "dmFsdWU="});
                h.post(format!("{u}/v3/kv/put"))
                    .json(&body)
                    .send()
                    .await
                    .is_ok_and(|r| r.status() == 200)
            }
        })
        .await;
        out.push(Some(s));
    }
    out
}

/// The series of a member's Raft log group commits.
const FSYNCS: &str = "modelforge_disk_fsync_duration_seconds_count";

/// Each member's value of the unlabelled `series` (`None` where its metrics did not answer).
async fn counters(http: &reqwest::Client, urls: &[String], series: &str) -> Vec<Option<f64>> {
    let mut out = vec![];
    for url in urls {
        let count = metrics_text(http, url).await.and_then(|text| {
            text.lines()
                .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        });
        out.push(count);
    }
    out
}

/// The Raft RPCs each member has served (`None` where its metrics did not answer).
async fn raft_rpcs(http: &reqwest::Client, urls: &[String]) -> Vec<Option<f64>> {
    let mut out = vec![];
    for url in urls {
        let served = metrics_text(http, url).await.map(|text| {
            text.lines()
                .filter(|line| {
                    line.starts_with("modelforge_http_requests_total{")
                        && line.contains("route=\"/internal/v1/raft/{kind}\"")
                })
                .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
                .sum()
        });
        out.push(served);
    }
    out
}

async fn metrics_text(http: &reqwest::Client, url: &str) -> Option<String> {
    http.get(format!("{url}/metrics"))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()
}

/// The leader's own time for the writes' routes so far: (seconds, requests), summed from its
/// `modelforge_http_request_duration_seconds` histogram over the cordon, uncordon and
/// credential routes.
async fn server_time(http: &reqwest::Client, leader_url: &str) -> Option<(f64, f64)> {
    let text = metrics_text(http, leader_url).await?;
    let mut sum = (0.0, 0.0);
    for line in text.lines() {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let ours = ["/cordon\"", "/uncordon\"", "/credential\""]
            .iter()
            .any(|r| series.contains(r));
        if !ours {
            continue;
        }
        let v: f64 = value.parse().ok()?;
        if series.starts_with("modelforge_http_request_duration_seconds_sum{") {
            sum.0 += v;
        } else if series.starts_with("modelforge_http_request_duration_seconds_count{") {
            sum.1 += v;
        }
    }
    Some(sum)
}
