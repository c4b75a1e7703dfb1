//! The scheduler and the capability smoke over real processes: placement only on measured
//! GPUs, never twice on one, idempotent retries, smoke gating of a recovered node, and the
//! reconciliation of a restored backup against freshly measured (fixture) NVML state.

mod common;

use std::path::Path;

use common::*;
use modelforge_proto::api;
use serde_json::Value;
use serde_json::json;

async fn allocate(c: &mut Cluster, n: u32, key: Option<&str>) -> (u16, Value) {
    let leader = c.wait_leader().await;
    let url = format!("{}/api/v1/allocations", c.url(leader));
    let mut req = http()
        .post(url)
        .bearer_auth(ADMIN)
        .json(&json!({"accelerators": n, "owner": "tests"}));
    if let Some(k) = key {
        req = req.header("Idempotency-Key", k);
    }
    let r = req.send().await.unwrap();
    let s = r.status().as_u16();
    (s, r.json().await.unwrap_or(Value::Null))
}

/// The node as the scheduler sees it (`None`: the scheduler does not list it).
async fn scheduler_node(c: &mut Cluster, node_id: &str) -> Option<api::SchedulerNode> {
    let view: api::SchedulerView = c
        .admin_as("GET", "/api/v1/admin/scheduler", None, 200)
        .await;
    view.nodes
        .into_iter()
        .find(|n| n.node_id.as_str() == node_id)
}

async fn wait_offered(c: &mut Cluster, node_id: &str, offered: bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let n = scheduler_node(c, node_id).await;
        if n.as_ref().is_some_and(|n| n.offered == offered) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "offered never became {offered}: {n:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// Start a smoke for `node_id` and wait for its verdict.
async fn smoke(c: &mut Cluster, node_id: &str) -> api::SmokeView {
    let started = c.start_smoke(node_id).await;
    let id = started.smoke_id.to_string();
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let v: api::SmokeView = c
            .admin_as(
                "GET",
                &format!("/api/v1/admin/hardware/nodes/{node_id}/smoke/{id}"),
                None,
                200,
            )
            .await;
        if v.state != "pending" {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the smoke never finished: {v:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placement_is_on_measured_gpus_once_each_and_a_recovered_node_waits_for_its_smoke() {
    let mut c = Cluster::start(3).await;
    let token = c.new_token(600).await;
    let mut a = Agent::new(c.root(), "a", c.urls()).gpus("simulated:4");
    a.start(Some(&token));
    let (nid, cred) = a.wait_enrolled(None).await;
    wait_offered(&mut c, &nid, true).await;

    // Eight racing requests for one GPU each on a 4-GPU node: exactly four succeed, no GPU twice.
    let mut tasks = vec![];
    for i in 0..8 {
        let url = format!("{}/api/v1/allocations", c.url(c.ids[i % 3]));
        tasks.push(tokio::spawn(async move {
            let r = http()
                .post(url)
                .bearer_auth(ADMIN)
                .json(&json!({"accelerators": 1, "owner": format!("job-{i}")}))
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }));
    }
    let mut uuids = vec![];
    let mut ids = vec![];
    for t in tasks {
        let (s, v) = t.await.unwrap();
        match s {
            201 => {
                let placed: api::AllocationPlaced = typed("an allocation", &v);
                uuids.extend(placed.accelerator_uuids);
                ids.push(placed.allocation_id.to_string());
            }
            409 => assert_eq!(refused(s, &v), (409, "no_capacity"), "{v}"),
            other => panic!("unexpected {other}: {v}"),
        }
    }
    assert_eq!(uuids.len(), 4, "{uuids:?}");
    let distinct: std::collections::BTreeSet<String> = uuids.iter().cloned().collect();
    assert_eq!(distinct.len(), 4, "a GPU was placed twice: {uuids:?}");
    let n = scheduler_node(&mut c, &nid)
        .await
        .expect("the scheduler lists the node");
    assert_eq!(n.free_accelerators, 0, "{n:?}");
    assert_eq!(n.allocations.len(), 4);

    // Release two; an Idempotency-Key retry returns the first answer, not a second allocation.
    for id in &ids[..2] {
        c.admin_as::<api::AllocationReleased>(
            "DELETE",
            &format!("/api/v1/allocations/{id}"),
            None,
            200,
        )
        .await;
    }
    let (s, first) = allocate(&mut c, 1, Some("key-1")).await;
    assert_eq!(s, 201, "{first}");
    let (s, again) = allocate(&mut c, 1, Some("key-1")).await;
    assert_eq!(s, 201, "{again}");
    assert_eq!(
        typed::<api::AllocationPlaced>("an allocation", &first).allocation_id,
        typed::<api::AllocationPlaced>("its retry", &again).allocation_id
    );
    // The same key with another request is refused, never answered with the first allocation.
    let (s, v) = allocate(&mut c, 2, Some("key-1")).await;
    assert_eq!(refused(s, &v), (422, "idempotency_key_reused"), "{v}");
    assert_eq!(
        scheduler_node(&mut c, &nid)
            .await
            .map(|n| n.free_accelerators),
        Some(1)
    );
    let (s, v) = allocate(&mut c, 2, None).await;
    assert_eq!(refused(s, &v), (409, "no_capacity"));

    // The credential is lost: the agent re-enrols (same node id) and must pass a smoke first.
    a.stop();
    std::fs::remove_file(a.state_dir.join("credential")).unwrap();
    let token2 = c.new_token(600).await;
    a.start(Some(&token2));
    let (nid2, _) = a.wait_enrolled(Some(&cred)).await;
    assert_eq!(nid2, nid);
    wait_offered(&mut c, &nid, false).await;
    assert!(
        scheduler_node(&mut c, &nid)
            .await
            .is_some_and(|n| n.smoke_required)
    );
    let (s, _) = allocate(&mut c, 1, None).await;
    assert_eq!(s, 409, "a node waiting for its smoke was offered");
    let v = smoke(&mut c, &nid).await;
    assert_eq!(v.state, "passed", "{v:?}");
    let names: Vec<&str> = v.checks.iter().map(|c| c.name.as_str()).collect();
    assert!(
        names.contains(&"nvml") && names.contains(&"accelerator_count"),
        "{names:?}"
    );
    assert_eq!(names.iter().filter(|n| n.starts_with("gpu:")).count(), 4);
    assert!(names.iter().any(|n| n.starts_with("storage:")));
    wait_offered(&mut c, &nid, true).await;
    let (s, v) = allocate(&mut c, 1, None).await;
    assert_eq!(s, 201, "{v}");
    let last: api::AllocationPlaced = typed("an allocation", &v);
    let node = c.node(&nid).await;
    for kind in [
        "smoke_requested",
        "smoke_passed",
        "allocation_created",
        "allocation_released",
    ] {
        assert!(
            has_event(&node, kind, ""),
            "{kind} missing from {:?}",
            node.history
        );
    }

    // Decommission: the preview lists the work placed on the node, binds it (releasing one
    // allocation makes the preview stale), and execute releases the rest; nothing is placed on
    // the node again.
    let decommission =
        |path: &str| format!("/api/v1/admin/hardware/nodes/{nid}/decommission/{path}");
    let p: api::DecommissionPreviewView = c
        .admin_as("POST", &decommission("preview"), None, 200)
        .await;
    let placed = texts(&p.effects.allocations_to_release);
    assert_eq!(placed.len(), 4, "{p:?}");
    assert!(placed.contains(&last.allocation_id.to_string()), "{p:?}");
    c.admin_as::<api::AllocationReleased>(
        "DELETE",
        &format!("/api/v1/allocations/{}", last.allocation_id),
        None,
        200,
    )
    .await;
    let body = json!({"preview_id": p.preview_id, "reason": "tests"});
    let (s, e) = c.admin("POST", &decommission("execute"), Some(body)).await;
    assert_eq!(refused(s, &e), (409, "preview_stale"), "{e}");
    assert!(
        error_body(s, &e)
            .error
            .message
            .contains("allocations_to_release"),
        "{e}"
    );
    let p: api::DecommissionPreviewView = c
        .admin_as("POST", &decommission("preview"), None, 200)
        .await;
    assert_eq!(p.effects.allocations_to_release.len(), 3, "{p:?}");
    let body = json!({"preview_id": p.preview_id, "reason": "tests"});
    let d: api::Decommissioned = c
        .admin_as("POST", &decommission("execute"), Some(body), 200)
        .await;
    assert_eq!(
        texts(&d.allocations_released),
        texts(&p.effects.allocations_to_release),
        "{d:?}"
    );
    let n = scheduler_node(&mut c, &nid).await;
    assert!(n.as_ref().is_none_or(|n| !n.offered), "{n:?}");
    assert!(n.as_ref().is_none_or(|n| n.allocations.is_empty()), "{n:?}");
    assert_eq!(allocate(&mut c, 1, None).await.0, 409);
    let node = c.node(&nid).await;
    assert!(has_event(&node, "decommissioned", ""), "{:?}", node.history);
}

fn fixture(path: &Path, gpus: &[(&str, bool)]) {
    let accelerators: Vec<Value> = gpus
        .iter()
        .map(|(uuid, busy)| {
            let mut g =
                json!({"uuid": uuid, "name": "NVIDIA H100 80GB HBM3", "memory_total_mib": 81559});
            if *busy {
                g["processes"] = json!([{"pid": 4242, "used_memory_mib": 60000.0}]);
            }
            g
        })
        .collect();
    let body = json!({"accelerators": accelerators, "storage_roots": [], "nvml": "ok"});
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, body.to_string()).unwrap();
    std::fs::rename(tmp, path).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_restore_allocations_wait_for_fresh_nvml_and_are_reconciled_with_it() {
    let mut c = Cluster::start(1).await;
    let fx = c.root().join("gpus.json");
    fixture(
        &fx,
        &[
            ("GPU-1", false),
            ("GPU-2", false),
            ("GPU-3", false),
            ("GPU-4", false),
        ],
    );
    let token = c.new_token(600).await;
    let mut a = Agent::new(c.root(), "a", c.urls()).gpus(&format!("file:{}", fx.display()));
    a.start(Some(&token));
    let (nid, _) = a.wait_enrolled(None).await;
    wait_offered(&mut c, &nid, true).await;
    let mut placed = vec![];
    for _ in 0..3 {
        let (s, v) = allocate(&mut c, 1, None).await;
        assert_eq!(s, 201, "{v}");
        let a: api::AllocationPlaced = typed("an allocation", &v);
        placed.push((a.allocation_id.to_string(), a.accelerator_uuids[0].clone()));
    }
    let on = |gpu: &str| placed.iter().find(|(_, g)| g == gpu).unwrap().0.clone();
    let (on1, on2, on3) = (on("GPU-1"), on("GPU-2"), on("GPU-3"));

    // Backup, then the control plane is lost and restored while the agent is down; meanwhile
    // the hardware moved on: GPU-2 is gone, GPU-3 is idle, GPU-4 runs something unscheduled.
    let r = http()
        .get(format!("{}/api/v1/admin/backup", c.url(1)))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let file = c.root().join("b.mfbackup");
    std::fs::write(&file, r.bytes().await.unwrap()).unwrap();
    a.stop();
    c.kill9(1);
    std::fs::rename(c.data_dir(1), c.root().join("old-m1")).unwrap();
    let out = std::process::Command::new(server_bin())
        .env("MODELFORGE_CLUSTER_SECRET", CLUSTER_SECRET)
        .args(["restore", "--from"])
        .arg(&file)
        .arg("--data-dir")
        .arg(c.data_dir(1))
        .arg("--journal")
        .arg(c.root().join("old-m1"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    fixture(&fx, &[("GPU-1", true), ("GPU-3", false), ("GPU-4", true)]);
    c.start_member(1);
    c.wait_ready().await;

    // Nothing restored is trusted yet.
    let n = scheduler_node(&mut c, &nid)
        .await
        .expect("the scheduler lists the node");
    assert!(!n.verified, "{n:?}");
    assert!(!n.offered, "{n:?}");
    assert!(
        n.allocations.iter().all(|a| a.state == "unconfirmed"),
        "{n:?}"
    );
    assert_eq!(allocate(&mut c, 1, None).await.0, 409);

    // The agent comes back: its first report reconciles the restored allocations.
    a.start(None);
    let deadline = tokio::time::Instant::now() + WAIT;
    let n = loop {
        let n = scheduler_node(&mut c, &nid)
            .await
            .expect("the scheduler lists the node");
        if n.verified
            && n.allocations.iter().all(|a| a.state == "confirmed")
            && n.busy_outside_scheduler == ["GPU-4"]
        {
            break n;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never reconciled: {n:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    let ids: Vec<&str> = n
        .allocations
        .iter()
        .map(|a| a.allocation_id.as_str())
        .collect();
    assert_eq!(
        ids,
        vec![on1.as_str()],
        "only the allocation measured busy stays"
    );
    let node = c.node(&nid).await;
    assert!(
        has_event(
            &node,
            "allocation_released",
            &format!("{on2}: GPU GPU-2 vanished")
        ),
        "{:?}",
        node.history
    );
    assert!(
        has_event(
            &node,
            "allocation_released",
            &format!("{on3}: the node no longer runs it")
        ),
        "{:?}",
        node.history
    );
    assert!(
        has_event(&node, "accelerators_busy_outside_scheduler", ""),
        "{:?}",
        node.history
    );

    // Seen for the first time since the restore: offered only after a passing smoke, and then
    // never on GPU-1 (allocated) or GPU-4 (busy outside the scheduler).
    assert!(!n.offered);
    let v = smoke(&mut c, &nid).await;
    assert_eq!(v.state, "passed", "{v:?}");
    wait_offered(&mut c, &nid, true).await;
    let (s, v) = allocate(&mut c, 1, None).await;
    assert_eq!(s, 201, "{v}");
    let a: api::AllocationPlaced = typed("an allocation", &v);
    assert_eq!(a.accelerator_uuids, ["GPU-3"]);
    assert_eq!(allocate(&mut c, 1, None).await.0, 409);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotency_key_reused_for_another_target_is_another_request() {
    let mut c = Cluster::start(1).await;
    let mut creds = vec![];
    for name in ["k1", "k2"] {
        let token = c.new_token(600).await;
        let mut a = Agent::new(c.root(), name, c.urls());
        a.start(Some(&token));
        creds.push(a.wait_enrolled(None).await);
        a.stop();
    }
    let revoke = |node: String| {
        let url = format!("{}/api/v1/admin/hardware/nodes/{node}/credential", c.url(1));
        async move {
            let r = http()
                .delete(url)
                .bearer_auth(ADMIN)
                .header("Idempotency-Key", "same-key")
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    let (s1, v1) = revoke(creds[0].0.clone()).await;
    let (s2, v2) = revoke(creds[1].0.clone()).await;
    assert_eq!((s1, s2), (200, 200), "{v1} {v2}");
    let (r1, r2): (api::Revoked, api::Revoked) = (typed("revoke", &v1), typed("revoke", &v2));
    assert_ne!(
        r1.revoked, r2.revoked,
        "the second node got the first one's answer"
    );
    assert_eq!(c.heartbeat_all(&creds[1].0, &creds[1].1).await, vec![401]);
    // The same key, operation and target with another body: refused, and audited.
    let r = http()
        .delete(format!(
            "{}/api/v1/admin/hardware/nodes/{}/credential",
            c.url(1),
            creds[0].0
        ))
        .bearer_auth(ADMIN)
        .header("Idempotency-Key", "same-key")
        .json(&json!({"reason": "another reason"}))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let v: Value = r.json().await.unwrap();
    assert_eq!(refused(status, &v), (422, "idempotency_key_reused"), "{v}");
    let audit = c.audit_events().await;
    assert!(
        audit
            .iter()
            .any(|e| e.record.result == "idempotency_key_reused"),
        "{audit:?}"
    );
    // The same key on the allocation endpoint is yet another request (no 500, no stored answer):
    // an allocation, or the refusal that nothing fits.
    let (s, v) = allocate(&mut c, 1, Some("same-key")).await;
    match s {
        201 => {
            typed::<api::AllocationPlaced>("an allocation", &v);
        }
        409 => assert_eq!(refused(s, &v), (409, "no_capacity"), "{v}"),
        _ => panic!("{s} {v}"),
    }
}
