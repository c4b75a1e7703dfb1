//! Node supervision over real processes: status from heartbeats (online, stale, offline),
//! failover without flapping, hardware changes in history, refused requests shown on the node.

mod common;

use common::*;
use serde_json::Value;
use serde_json::json;

const FAST: &[&str] = &[
    "--stale-after",
    "1500ms",
    "--offline-after",
    "3s",
    "--events-interval",
    "200ms",
];

async fn status(c: &Cluster, nid: &str) -> Option<Value> {
    for u in c.urls() {
        let (s, v) = call(
            "GET",
            &format!("{u}/api/v1/admin/hardware/nodes/{nid}"),
            Some(ADMIN),
            None,
        )
        .await;
        if s == 200 {
            return Some(v);
        }
    }
    None
}

async fn wait_status(c: &Cluster, nid: &str, want: &str) -> Value {
    wait_until(&format!("node {nid} to be {want}"), WAIT, || async {
        status(c, nid).await.filter(|v| v["status"] == want)
    })
    .await
}

fn history_kinds(v: &Value, kind: &str) -> Vec<(String, u64)> {
    v["history"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == kind)
        .map(|e| {
            (
                e["detail"].as_str().unwrap_or("").to_string(),
                e["count"].as_u64().unwrap_or(0),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_agent_goes_stale_then_offline_and_back_online() {
    let mut c = Cluster::start_with(3, FAST).await;
    let t = c.new_token(600).await;
    let mut a = Agent::new(c.root(), "a", c.urls());
    a.start(Some(&t));
    let (nid, _) = a.wait_enrolled(None).await;
    // Online comes with the first heartbeat's recorded use, which is written before its
    // telemetry reaches the supervisor: wait for both.
    let v = wait_until("node online with its first telemetry", WAIT, || async {
        status(&c, &nid)
            .await
            .filter(|v| v["status"] == "online" && !v["telemetry"].is_null())
    })
    .await;
    assert_eq!(v["accelerators_verified"], true, "{v}");
    assert_eq!(v["telemetry"]["accelerators"].as_array().unwrap().len(), 2);
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
    let (s, ring) = c
        .admin(
            "GET",
            &format!("/api/v1/admin/hardware/nodes/{nid}/telemetry"),
            None,
        )
        .await;
    assert_eq!(s, 200);
    assert!(!ring["samples"].as_array().unwrap().is_empty(), "{ring}");
    assert_eq!(v["node_id"], nid.as_str());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leader_while_20_agents_heartbeat_leaves_every_node_online() {
    let mut c = Cluster::start_with(
        3,
        &[
            "--stale-after",
            "2s",
            "--offline-after",
            "4s",
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
    let all_online = |v: &Value| {
        v["nodes"]
            .as_array()
            .is_some_and(|n| n.len() == 20 && n.iter().all(|x| x["status"] == "online"))
    };
    wait_until("all 20 nodes online", WAIT, || async {
        let (_, v) = call(
            "GET",
            &format!("{}/api/v1/admin/hardware/nodes", c.url(1)),
            Some(ADMIN),
            None,
        )
        .await;
        all_online(&v).then_some(())
    })
    .await;
    let leader = c.wait_leader().await;
    c.kill9(leader);
    let new_leader = c.wait_leader().await;
    // Watch every node for a while after the failover: none leaves `online`.
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
            for n in v["nodes"].as_array().unwrap() {
                assert_eq!(
                    n["status"], "online",
                    "a node flapped after the leader moved: {n}"
                );
            }
            verified_again = v["nodes"]
                .as_array()
                .unwrap()
                .iter()
                .all(|n| n["accelerators_verified"] == true);
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(answers > 10);
    assert!(
        verified_again,
        "fresh reports re-verify every node's accelerators after the rebuild"
    );
    for nid in &ids {
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
    assert_eq!(v["accelerators"].as_array().unwrap().len(), 2);
    assert_eq!(v["driver_version"], "550.54.15");
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
    assert_eq!(v["accelerators"].as_array().unwrap().len(), 1);
    assert_eq!(
        v["telemetry"]["accelerators"][0]["utilization_pct"], 12.5,
        "fixture telemetry values are reported"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_agent_that_keeps_heartbeating_shows_its_401s_without_a_write_each() {
    let mut c = Cluster::start_with(3, FAST).await;
    let t = c.new_token(600).await;
    let mut a = Agent::new(c.root(), "r", c.urls());
    a.start(Some(&t));
    let (nid, cred) = a.wait_enrolled(None).await;
    a.stop();
    let (s, _) = c
        .admin(
            "DELETE",
            &format!("/api/v1/admin/hardware/nodes/{nid}/credential"),
            None,
        )
        .await;
    assert_eq!(s, 200);
    let leader = c.wait_leader().await;
    let before = c.digest(leader).await.unwrap().1;
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
    assert_eq!(v["last_refusal"]["status"], 401);
    let after = c.digest(leader).await.unwrap().1;
    assert!(
        after - before < 20,
        "75 refused requests caused {} log entries",
        after - before
    );
}
