//! Node supervision over real processes: status from heartbeats (online, stale, offline),
//! failover without flapping, hardware changes in history, refused requests shown on the node.

mod common;

use common::*;
use modelforge_proto::api;
use serde_json::json;

/// Thresholds with margins a loaded 2-core machine cannot eat: agents heartbeat every 300 ms,
/// ten times within `--stale-after`, and a node stays `stale` for 7 s, long enough for every
/// poll and every events write (each 200 ms) to see it on the way to `offline`.
const FAST: &[&str] = &[
    "--stale-after",
    "3s",
    "--offline-after",
    "10s",
    "--events-interval",
    "200ms",
];

/// The failover test's `--stale-after`: agents must reach the new leader within it, and the
/// test must be over before the agents it stopped at the failover go stale.
const FAILOVER_STALE_AFTER_S: u64 = 12;

async fn status(c: &Cluster, nid: &str) -> Option<api::NodeDetail> {
    node_view(&c.urls(), nid).await
}

async fn wait_status(c: &Cluster, nid: &str, want: &str) -> api::NodeDetail {
    wait_until(&format!("node {nid} to be {want}"), WAIT, || async {
        status(c, nid).await.filter(|v| v.summary.status == want)
    })
    .await
}

fn history_kinds(v: &api::NodeDetail, kind: &str) -> Vec<(String, u64)> {
    v.history
        .iter()
        .filter(|e| e.kind == kind)
        .map(|e| (e.detail.to_string(), u64::from(e.count)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_agent_goes_stale_then_offline_and_back_online() {
    let mut c = Cluster::start_with(3, FAST).await;
    let (mut a, nid, _) = c.enrol_one("a").await;
    // Online comes with the first heartbeat's recorded use, which is written before its
    // telemetry reaches the supervisor: wait for both.
    let v = wait_until("node online with its first telemetry", WAIT, || async {
        status(&c, &nid)
            .await
            .filter(|v| v.summary.status == "online" && !v.telemetry.is_null())
    })
    .await;
    assert!(v.summary.accelerators_verified, "{v:?}");
    assert_eq!(
        telemetry(&v)
            .expect("the node's first telemetry")
            .accelerators
            .len(),
        2
    );
    a.stop();
    wait_status(&c, &nid, "stale").await;
    wait_status(&c, &nid, "offline").await;
    wait_until("offline recorded in history", WAIT, || async {
        let v = status(&c, &nid).await?;
        history_kinds(&v, "status")
            .last()
            .is_some_and(|(d, _)| d == "offline")
            .then_some(())
    })
    .await;
    a.start(None);
    wait_status(&c, &nid, "online").await;
    let v = wait_until("the transitions in history", WAIT, || async {
        let v = status(&c, &nid).await?;
        let seq: Vec<String> = history_kinds(&v, "status")
            .into_iter()
            .map(|(d, _)| d)
            .collect();
        (seq.ends_with(&[
            "online".to_string(),
            "stale".into(),
            "offline".into(),
            "online".into(),
        ]))
        .then_some(v)
    })
    .await;
    // The telemetry ring holds recent samples.
    let ring: api::TelemetrySamples = c
        .admin_as(
            "GET",
            &format!("/api/v1/admin/hardware/nodes/{nid}/telemetry"),
            None,
            200,
        )
        .await;
    assert!(!ring.samples.is_empty(), "{ring:?}");
    assert_eq!(v.summary.node_id.as_str(), nid);
}

/// A failover alone never marks a node down: 15 agents heartbeat through it, 5 stop just
/// before it, and the new leader shows all 20 online (liveness.rs, the grace window).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leader_leaves_every_node_online_heartbeating_or_just_stopped() {
    let stale_after = format!("{FAILOVER_STALE_AFTER_S}s");
    let offline_after = format!("{}s", 2 * FAILOVER_STALE_AFTER_S);
    let mut c = Cluster::start_with(
        3,
        &[
            "--stale-after",
            &stale_after,
            "--offline-after",
            &offline_after,
            "--events-interval",
            "200ms",
        ],
    )
    .await;
    let mut agents = vec![];
    let mut ids = vec![];
    for i in 0..20 {
        let t = c.new_token(600).await;
        let mut a = Agent::new(c.root(), &format!("n{i}"), c.urls()).gpus("simulated:1");
        a.start(Some(&t));
        agents.push(a);
    }
    for a in &agents {
        ids.push(a.wait_enrolled(None).await.0);
    }
    let all_online =
        |v: &api::Nodes| v.nodes.len() == 20 && v.nodes.iter().all(|x| x.status == "online");
    wait_until("all 20 nodes online", WAIT, || async {
        let (s, v) = call(
            "GET",
            &format!("{}/api/v1/admin/hardware/nodes", c.url(1)),
            Some(ADMIN),
            None,
        )
        .await;
        (s == 200 && all_online(&typed("nodes", &v))).then_some(())
    })
    .await;
    // The new leader rebuilds its view from the replicated state, where a node's last use is
    // written at its first heartbeat and then at most every 30 s. Let every replicated use age
    // past `--stale-after`, and stop five agents just before the failover: then only the grace
    // window of the leadership change (silence counts from the change) keeps those five online
    // on the new leader, and the watch below fails if it is missing. Heartbeating agents
    // reach the new leader too soon after the change to show that.
    let mut last_use = std::time::SystemTime::UNIX_EPOCH;
    for nid in &ids {
        for cred in c.credentials(nid).await.credentials {
            if let Some(at) = cred.last_used_at {
                last_use = last_use.max(humantime::parse_rfc3339(&at).unwrap());
            }
        }
    }
    let aged = last_use + std::time::Duration::from_secs(FAILOVER_STALE_AFTER_S + 1);
    wait_until(
        "every replicated use older than --stale-after",
        WAIT,
        || async { (std::time::SystemTime::now() > aged).then_some(()) },
    )
    .await;
    for a in &mut agents[15..] {
        a.stop();
    }
    let leader = c.wait_leader().await;
    c.kill9(leader);
    let new_leader = c.wait_leader().await;
    // Watch every node for a while after the failover: none leaves `online` (the stopped ones
    // would only go stale 12 s after the change).
    let until = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
    let mut answers = 0;
    let mut verified_again = false;
    while tokio::time::Instant::now() < until {
        let (s, v) = call(
            "GET",
            &format!("{}/api/v1/admin/hardware/nodes", c.url(new_leader)),
            Some(ADMIN),
            None,
        )
        .await;
        if s == 200 {
            answers += 1;
            let listed: api::Nodes = typed("nodes", &v);
            for n in &listed.nodes {
                assert_eq!(
                    n.status, "online",
                    "a node flapped after the leader moved: {n:?}"
                );
            }
            verified_again = listed
                .nodes
                .iter()
                .filter(|n| ids[..15].iter().any(|i| n.node_id.as_str() == i))
                .all(|n| n.accelerators_verified);
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(answers > 10);
    assert!(
        verified_again,
        "fresh reports re-verify every node's accelerators after the rebuild"
    );
    for nid in &ids[..15] {
        let v = c.node(nid).await;
        let statuses: Vec<String> = history_kinds(&v, "status")
            .into_iter()
            .map(|(d, _)| d)
            .collect();
        assert!(
            !statuses.iter().any(|s| s != "online"),
            "node {nid} history shows a flap: {statuses:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_removed_from_the_fixture_shows_in_the_nodes_history() {
    let mut c = Cluster::start_with(1, FAST).await;
    let fixture = c.root().join("gpus.json");
    let gpu = |u: &str, i: u32| json!({"uuid": u, "name": "NVIDIA H200", "memory_total_mib": 143771, "pci_bus_id": format!("00000000:{:02X}:00.0", 0x18 + i), "utilization_pct": 12.5});
    std::fs::write(&fixture, json!({"accelerators": [gpu("GPU-aaaa", 0), gpu("GPU-bbbb", 1)], "driver_version": "550.54.15", "cuda_version": "12.4"}).to_string()).unwrap();
    let t = c.new_token(600).await;
    let mut a = Agent::new(c.root(), "f", c.urls()).gpus(&format!("file:{}", fixture.display()));
    a.start(Some(&t));
    let (nid, _) = a.wait_enrolled(None).await;
    let v = c.node(&nid).await;
    assert_eq!(v.summary.accelerators.len(), 2);
    assert_eq!(v.summary.driver_version.as_deref(), Some("550.54.15"));
    std::fs::write(&fixture, json!({"accelerators": [gpu("GPU-aaaa", 0)], "driver_version": "550.54.15", "cuda_version": "12.4"}).to_string()).unwrap();
    let v = wait_until("the removed GPU in history", WAIT, || {
        let c = &c;
        let nid = nid.clone();
        async move {
            let v = status(c, &nid).await?;
            history_kinds(&v, "accelerator_disappeared")
                .iter()
                .any(|(d, _)| d == "GPU-bbbb")
                .then_some(v)
        }
    })
    .await;
    assert_eq!(v.summary.accelerators.len(), 1);
    assert_eq!(
        telemetry(&v).expect("the node's telemetry").accelerators[0].utilization_pct,
        Some(12.5),
        "fixture telemetry values are reported"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_agent_that_keeps_heartbeating_shows_its_401s_without_a_write_each() {
    // Refusals are written once per events interval: 1 s here, so that however slowly the 75
    // requests go, the writes stay far fewer than the requests.
    let mut c = Cluster::start_with(
        3,
        &[
            "--stale-after",
            "3s",
            "--offline-after",
            "10s",
            "--events-interval",
            "1s",
        ],
    )
    .await;
    let (mut a, nid, cred) = c.enrol_one("r").await;
    a.stop();
    c.revoke(&nid).await;
    let leader = c.wait_leader().await;
    let before = c.digest(leader).await.unwrap().1;
    let started = std::time::Instant::now();
    for _ in 0..25 {
        assert_eq!(c.heartbeat_all(&nid, &cred).await, vec![401, 401, 401]);
    }
    let v = wait_until("75 refusals in the node's history", WAIT, || {
        let c = &c;
        let nid = nid.clone();
        async move {
            let v = status(c, &nid).await?;
            let total: u64 = history_kinds(&v, "request_refused")
                .iter()
                .filter(|(d, _)| d == "401")
                .map(|(_, n)| n)
                .sum();
            (total >= 75).then_some(v)
        }
    })
    .await;
    assert_eq!(v.last_refusal.map(|r| r.status), Some(401));
    let after = c.digest(leader).await.unwrap().1;
    // At most one events write a second (plus one at each end), and the node's own status
    // transitions (stale, offline) since its agent stopped.
    let bound = started.elapsed().as_secs() + 2 + 2;
    assert!(
        after - before <= bound && after - before < 75,
        "75 refused requests caused {} log entries (at most {bound} expected)",
        after - before
    );
}

/// README, "Flags worth knowing": `--telemetry-budget-mib` is honoured. With a budget of 0 each
/// node keeps exactly its latest sample (the default keeps up to 32): never more, and never
/// an older one instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_telemetry_budget_of_zero_keeps_only_each_nodes_latest_sample() {
    let mut c = Cluster::start_with(1, &["--telemetry-budget-mib", "0"]).await;
    let (_a, nid, _) = c.enrol_one("t").await;
    let url = format!("{}/api/v1/admin/hardware/nodes/{nid}/telemetry", c.url(1));
    // Watch five heartbeats' samples arrive, one replacing the other.
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut latest: Vec<String> = vec![];
    while latest.len() < 5 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "only {} samples seen within {WAIT:?}",
            latest.len()
        );
        let (s, v) = call("GET", &url, Some(ADMIN), None).await;
        assert_eq!(s, 200, "{v}");
        let samples = typed::<api::TelemetrySamples>("telemetry samples", &v).samples;
        match (samples.as_slice(), latest.last()) {
            ([], None) => {}
            ([one], _) => {
                let at = one.at.clone();
                if let Some(prev) = latest.last() {
                    assert!(*prev <= at, "an older sample replaced a newer one: {v}");
                }
                if latest.last() != Some(&at) {
                    latest.push(at);
                }
            }
            _ => panic!(
                "{} samples held, expected the latest alone: {v}",
                samples.len()
            ),
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}
