//! GPU health events over real processes (issue 18, first part): an Xid or an ECC count
//! injected by rewriting the agent's `file:` fixture reaches the control plane with the next
//! heartbeat, counted per GPU and `(kind, code)`, with the time first and last seen, and is
//! shown in the node's telemetry; the doctor reads it (a failed GPU on a heartbeating node, then
//! silence since an Xid 79). (Health in node views, cordons and placement are not there yet:
//! see ARCHITECTURE.md, "GPU health".)

mod common;

use common::*;
use modelforge_proto::api;
use modelforge_proto::gpu_health::EventKind;
use modelforge_proto::gpu_health::GpuEvent;
use modelforge_proto::gpu_health::Health;
use modelforge_proto::ids::AllocationState;
use modelforge_proto::ids::HistoryKind;
use serde_json::Value;
use serde_json::json;

/// The events the control plane holds for GPU `uuid` of node `nid` (from its telemetry).
async fn events_of(urls: &[String], nid: &str, uuid: &str) -> Option<Vec<GpuEvent>> {
    let d = node_view(urls, nid).await?;
    let t = telemetry(&d)?;
    let gpu = t
        .accelerators
        .into_iter()
        .find(|a| a.uuid.as_deref() == Some(uuid))?;
    Some(gpu.events)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_injected_xid_and_ecc_count_reach_the_nodes_telemetry_counted() {
    // Offline 10 s after the last heartbeat, so the silent case comes quickly.
    let mut c = Cluster::start_with(1, &["--stale-after", "3s", "--offline-after", "10s"]).await;
    let urls = c.urls();
    let fixture = c.root().join("gpus.json");
    let write = |health: [Value; 2]| {
        let gpu = |u: &str, i: u32, h: &Value| {
            let mut g = json!({"uuid": u, "name": "NVIDIA H200", "memory_total_mib": 143771,
                "pci_bus_id": format!("00000000:{:02X}:00.0", 0x18 + i)});
            for (k, v) in h.as_object().unwrap() {
                g[k] = v.clone();
            }
            g
        };
        let doc = json!({"accelerators": [gpu("GPU-aaaa", 0, &health[0]), gpu("GPU-bbbb", 1, &health[1])]});
        std::fs::write(&fixture, doc.to_string()).unwrap();
    };
    write([json!({}), json!({})]);
    let t = c.new_token(600).await;
    let mut a = Agent::new(c.root(), "g", c.urls()).gpus(&format!("file:{}", fixture.display()));
    a.start(Some(&t));
    let (nid, _) = a.wait_enrolled(None).await;

    // An Xid 79 on the first GPU: the next heartbeat carries it, the other GPU has none.
    write([json!({"xid": [79]}), json!({})]);
    let first = wait_until("the xid in the node's telemetry", WAIT, || {
        let (urls, nid) = (urls.clone(), nid.clone());
        async move {
            events_of(&urls, &nid, "GPU-aaaa")
                .await
                .filter(|e| !e.is_empty())
        }
    })
    .await;
    assert_eq!(first.len(), 1, "{first:?}");
    assert_eq!(
        (first[0].kind, first[0].code, first[0].count),
        (EventKind::Xid, Some(79), 1)
    );
    assert_eq!(
        modelforge_proto::gpu_health::worst(&first),
        (Health::Failed, Some("xid 79".into()))
    );
    assert_eq!(events_of(&urls, &nid, "GPU-bbbb").await, Some(vec![]));
    // The doctor: the node heartbeats, a GPU failed.
    let url = c.url(1);
    let (code, v) = admin_json(&url, &["doctor", &nid]).await;
    assert_eq!(
        (code, v["verdict"].as_str()),
        (15, Some("gpu_failed")),
        "{v}"
    );
    assert!(v["case"].as_str().unwrap().contains("xid 79"), "{v}");

    // More of it, and a double-bit ECC count on the other GPU: counts grow, first seen stays.
    write([json!({"xid": [79, 79]}), json!({"ecc_dbe": 3})]);
    let (a_events, b_events) = wait_until("the new counts", WAIT, || {
        let (urls, nid) = (urls.clone(), nid.clone());
        async move {
            let a = events_of(&urls, &nid, "GPU-aaaa").await?;
            let b = events_of(&urls, &nid, "GPU-bbbb").await?;
            (a.first().is_some_and(|e| e.count == 2) && !b.is_empty()).then_some((a, b))
        }
    })
    .await;
    assert_eq!(a_events[0].first_at, first[0].first_at, "first seen stays");
    assert!(a_events[0].last_at >= first[0].last_at);
    assert_eq!(
        (b_events[0].kind, b_events[0].count),
        (EventKind::EccDbe, 3)
    );

    // The agent goes silent (as a machine whose GPU fell off the bus does): once the node is
    // not online, the doctor names the Xid 79 rather than a plain silence.
    a.stop();
    let v = wait_until("the silent node's verdict", WAIT, || {
        let url = url.clone();
        let nid = nid.clone();
        async move {
            let (code, v) = admin_json(&url, &["doctor", &nid]).await;
            (code != 15).then_some(v)
        }
    })
    .await;
    assert_eq!(v["verdict"], "gpu_fell_off_bus", "{v}");
    assert_eq!(v["exit_code"], 16, "{v}");
    assert!(v["case"].as_str().unwrap().contains("GPU-aaaa"), "{v}");
}

/// The node's accelerator `uuid` as the node view shows it.
fn gpu<'a>(d: &'a api::NodeDetail, uuid: &str) -> &'a api::AcceleratorView {
    d.summary
        .accelerators
        .iter()
        .find(|a| a.accelerator.uuid == uuid)
        .unwrap_or_else(|| panic!("{uuid} not in the view"))
}

/// Wait until `pred` holds for the node's view; the view.
async fn wait_view(
    urls: &[String],
    nid: &str,
    what: &str,
    pred: impl Fn(&api::NodeDetail) -> bool,
) -> api::NodeDetail {
    let pred = &pred;
    wait_until(what, WAIT, || async move {
        node_view(urls, nid).await.filter(|d| pred(d))
    })
    .await
}

fn gpu_history(d: &api::NodeDetail) -> Vec<String> {
    d.history
        .iter()
        .filter(|e| e.kind == HistoryKind::GpuHealth)
        .map(|e| e.detail.clone())
        .collect()
}

async fn allocate(c: &mut Cluster, n: u32) -> (u16, Value) {
    c.admin(
        "POST",
        "/api/v1/allocations",
        Some(json!({"accelerators": n, "owner": "gpu-health-test"})),
    )
    .await
}

async fn scheduler_node(c: &mut Cluster, nid: &str) -> api::SchedulerNode {
    let view: api::SchedulerView = c
        .admin_as("GET", "/api/v1/admin/scheduler", None, 200)
        .await;
    view.nodes
        .into_iter()
        .find(|n| n.node_id.as_str() == nid)
        .expect("the node in the scheduler's view")
}

/// Each severity class injected through the fixture: an application fault is recorded and
/// changes nothing; a degrading Xid makes the GPU `degraded` (no placement, no cordon); a
/// failing one makes it `failed`, cordons it, marks the allocation on it and moves the doctor;
/// one history entry per transition. Then an operator's cordon, drain and uncordons, audited
/// with their reasons, and what each does to placement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_severity_class_moves_health_history_cordons_placement_and_the_doctor() {
    let mut c = Cluster::start(1).await;
    let urls = c.urls();
    let fixture = c.root().join("gpus.json");
    let write = |extra: [Value; 3]| {
        let gpus: Vec<Value> = extra
            .iter()
            .enumerate()
            .map(|(i, h)| {
                let mut g = json!({"uuid": format!("GPU-{}", i + 1), "name": "NVIDIA H200",
                    "memory_total_mib": 143771, "index": i, "compute_capability": "9.0",
                    "pci_bus_id": format!("00000000:{:02X}:00.0", 0x18 + i)});
                for (k, v) in h.as_object().unwrap() {
                    g[k] = v.clone();
                }
                g
            })
            .collect();
        std::fs::write(&fixture, json!({ "accelerators": gpus }).to_string()).unwrap();
    };
    write([json!({}), json!({}), json!({})]);
    let t = c.new_token(600).await;
    let mut a = Agent::new(c.root(), "h", c.urls()).gpus(&format!("file:{}", fixture.display()));
    a.start(Some(&t));
    let (nid, _) = a.wait_enrolled(None).await;
    let d = wait_view(&urls, &nid, "verified GPUs", |d| {
        d.summary.accelerators_verified
    })
    .await;
    assert_eq!(d.summary.health, Health::Healthy);
    assert!(!d.summary.cordoned && d.summary.cordon_reason.is_none());
    let (s, placed) = allocate(&mut c, 1).await;
    assert_eq!(s, 201, "{placed}");
    assert_eq!(placed["accelerator_uuids"], json!(["GPU-1"]));

    // Application fault (Xid 13): recorded with the next heartbeat, health unchanged.
    write([json!({}), json!({"xid": [13]}), json!({})]);
    let d = wait_view(&urls, &nid, "xid 13 in the node's events", |d| {
        !gpu(d, "GPU-2").events.is_empty()
    })
    .await;
    assert_eq!(gpu(&d, "GPU-2").health, Health::Healthy);
    assert!(gpu_history(&d).is_empty(), "{:?}", gpu_history(&d));

    // Degrading (Xid 94): degraded, not cordoned, not placed on; the node's worst.
    write([json!({}), json!({"xid": [13, 94]}), json!({})]);
    let d = wait_view(&urls, &nid, "GPU-2 degraded", |d| {
        gpu(d, "GPU-2").health == Health::Degraded
    })
    .await;
    assert!(!gpu(&d, "GPU-2").cordoned);
    assert_eq!(gpu(&d, "GPU-2").health_cause.as_deref(), Some("xid 94"));
    assert_eq!(d.summary.health, Health::Degraded);
    let free = scheduler_node(&mut c, &nid).await.free_accelerator_uuids;
    assert_eq!(free, vec!["GPU-3".to_string()]);

    // Failing (Xid 79) on the allocated GPU: failed, cordoned, its allocation marked.
    write([json!({"xid": [79]}), json!({"xid": [13, 94]}), json!({})]);
    let d = wait_view(&urls, &nid, "GPU-1 failed", |d| {
        gpu(d, "GPU-1").health == Health::Failed
    })
    .await;
    assert!(gpu(&d, "GPU-1").cordoned);
    assert_eq!(d.summary.health, Health::Failed);
    assert!(!d.summary.cordoned, "a GPU cordon is not the node's");
    let sched = scheduler_node(&mut c, &nid).await;
    assert_eq!(sched.allocations.len(), 1);
    assert_eq!(sched.allocations[0].state, AllocationState::GpuFailed);
    let (code, v) = admin_json(&c.url(1), &["doctor", &nid]).await;
    assert_eq!(
        (code, v["verdict"].as_str()),
        (15, Some("gpu_failed")),
        "{v}"
    );

    // Only the healthy GPU-3 is placeable: one fits, two do not. Constraints on the GPU
    // Feature Discovery labels the node shows: a wrong product fits nothing, an unknown label
    // is refused, the right product and family place.
    let labels = &d.summary.labels;
    assert_eq!(
        labels["nvidia.com/gpu.product"], "NVIDIA-H200",
        "{labels:?}"
    );
    assert_eq!(labels["nvidia.com/gpu.count"], "3", "{labels:?}");
    assert_eq!(labels["nvidia.com/gpu.family"], "hopper", "{labels:?}");
    assert_eq!(labels["nvidia.com/mig.strategy"], "none", "{labels:?}");
    let (s, v) = allocate(&mut c, 2).await;
    assert_eq!(refused(s, &v), (409, "no_capacity"), "{v}");
    let constrained = |c: Value| json!({"accelerators": 1, "owner": "t", "constraints": c});
    for (want, refusal) in [
        (
            json!({"nvidia.com/gpu.product": "NVIDIA-A100"}),
            (409, "no_capacity"),
        ),
        (
            json!({"nvidia.com/gpu.colour": "green"}),
            (400, "invalid_allocation"),
        ),
    ] {
        let (s, v) = c
            .admin("POST", "/api/v1/allocations", Some(constrained(want)))
            .await;
        assert_eq!(refused(s, &v), refusal, "{v}");
    }
    let want = json!({"nvidia.com/gpu.product": "NVIDIA-H200", "nvidia.com/gpu.family": "hopper"});
    let (s, v) = c
        .admin("POST", "/api/v1/allocations", Some(constrained(want)))
        .await;
    assert_eq!(
        (s, &v["accelerator_uuids"]),
        (201, &json!(["GPU-3"])),
        "{v}"
    );

    // Each transition is one history entry, however many heartbeats repeated it.
    let seen_at = d.telemetry_at.clone();
    let d = wait_view(&urls, &nid, "more heartbeats", |d| {
        d.telemetry_at != seen_at
    })
    .await;
    let h = gpu_history(&d);
    assert_eq!(
        h.iter()
            .filter(|e| e.starts_with("GPU-1 failed: xid 79"))
            .count(),
        1,
        "{h:?}"
    );
    assert_eq!(
        h.iter()
            .filter(|e| e.starts_with("GPU-2 degraded: xid 94"))
            .count(),
        1,
        "{h:?}"
    );
    assert!(
        d.history
            .iter()
            .any(|e| e.kind == HistoryKind::AllocationMarked
                && e.detail.contains("gpu_failed (GPU GPU-1: xid 79)")),
        "{h:?}"
    );

    // Bad input changes nothing.
    let node = format!("/api/v1/admin/hardware/nodes/{nid}");
    let (s, v) = c
        .admin(
            "POST",
            &format!("{node}/cordon"),
            Some(json!({"reason": ""})),
        )
        .await;
    assert_eq!(refused(s, &v), (400, "invalid_reason"), "{v}");
    let (s, v) = c
        .admin("POST", &format!("{node}/cordon"), Some(json!({})))
        .await;
    assert_eq!(refused(s, &v), (400, "invalid_body"), "{v}");
    let (s, v) = c
        .admin(
            "POST",
            "/api/v1/admin/hardware/nodes/n-404/cordon",
            Some(json!({"reason": "x"})),
        )
        .await;
    assert_eq!(s, 404, "{v}");
    let (s, v) = c
        .admin(
            "POST",
            &format!("{node}/accelerators/GPU-9/uncordon"),
            Some(json!({"reason": "x"})),
        )
        .await;
    assert_eq!(refused(s, &v), (404, "not_found"), "{v}");
    assert!(!node_view(&urls, &nid).await.unwrap().summary.cordoned);

    // An operator's cordon: nothing placed on the node (GPU-2 recovers meanwhile: the fixture
    // drops its degrading Xid only by an agent restart, so it stays degraded; release GPU-3).
    let (s, v) = c
        .admin(
            "POST",
            &format!("{node}/cordon"),
            Some(json!({"reason": "rack maintenance"})),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        (v["cordoned"].as_bool(), v["cordon_reason"].as_str()),
        (Some(true), Some("rack maintenance"))
    );
    let second = scheduler_node(&mut c, &nid).await.allocations;
    let on_three = second
        .iter()
        .find(|a| a.accelerator_uuids == ["GPU-3"])
        .expect("the allocation on GPU-3");
    let (s, _) = c
        .admin(
            "DELETE",
            &format!("/api/v1/allocations/{}", on_three.allocation_id),
            None,
        )
        .await;
    assert_eq!(s, 200);
    assert!(!scheduler_node(&mut c, &nid).await.offered);
    let (s, v) = allocate(&mut c, 1).await;
    assert_eq!(refused(s, &v), (409, "no_capacity"), "{v}");

    // Drain: every allocation of the node marked drained, its GPUs released.
    let (s, v) = c
        .admin(
            "POST",
            &format!("{node}/drain"),
            Some(json!({"reason": "replace GPU-1"})),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    let sched = scheduler_node(&mut c, &nid).await;
    assert_eq!(sched.allocations.len(), 1, "{:?}", sched.allocations);
    assert!(
        sched
            .allocations
            .iter()
            .all(|a| a.state == AllocationState::Drained),
        "{:?}",
        sched.allocations
    );

    // Node uncordon leaves the GPU cordon alone; GPU-3 is placeable again.
    let (s, v) = c
        .admin(
            "POST",
            &format!("{node}/uncordon"),
            Some(json!({"reason": "rack done"})),
        )
        .await;
    assert_eq!((s, v["cordoned"].as_bool()), (200, Some(false)), "{v}");
    assert!(v["accelerators"][0]["cordoned"].as_bool().unwrap(), "{v}");
    let (s, v) = allocate(&mut c, 1).await;
    assert_eq!(
        (s, &v["accelerator_uuids"]),
        (201, &json!(["GPU-3"])),
        "{v}"
    );

    // The GPU's uncordon (after a reset): healthy, and the Xid 79 it already reported is not
    // judged again; a new one is.
    let (s, v) = c
        .admin(
            "POST",
            &format!("{node}/accelerators/GPU-1/uncordon"),
            Some(json!({"reason": "GPU reset, field diag passed"})),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        (
            v["accelerators"][0]["health"].as_str(),
            v["accelerators"][0]["cordoned"].as_bool()
        ),
        (Some("healthy"), Some(false)),
        "{v}"
    );
    let before = node_view(&urls, &nid).await.unwrap().telemetry_at;
    let d = wait_view(&urls, &nid, "a heartbeat after the uncordon", |d| {
        d.telemetry_at != before
    })
    .await;
    let d = wait_view(&urls, &nid, "yet another heartbeat", |x| {
        x.telemetry_at != d.telemetry_at
    })
    .await;
    assert_eq!(
        gpu(&d, "GPU-1").health,
        Health::Healthy,
        "{:?}",
        gpu_history(&d)
    );
    write([
        json!({"xid": [79, 79]}),
        json!({"xid": [13, 94]}),
        json!({}),
    ]);
    wait_view(&urls, &nid, "GPU-1 failed again", |d| {
        gpu(d, "GPU-1").health == Health::Failed
    })
    .await;

    // Every operator action is audited with its actor and reason.
    let (s, v) = c.admin("GET", "/api/v1/admin/audit?limit=1000", None).await;
    assert_eq!(s, 200);
    for (action, reason) in [
        ("node.cordon", "rack maintenance"),
        ("node.drain", "replace GPU-1"),
        ("node.uncordon", "rack done"),
        ("node.accelerator.uncordon", "GPU reset, field diag passed"),
    ] {
        let row = v["events"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["action"] == action && e["result"] == "ok")
            .unwrap_or_else(|| panic!("no {action} in the audit trail: {v}"));
        assert_eq!(
            (row["actor"].as_str(), row["reason"].as_str()),
            (Some("root"), Some(reason)),
            "{row}"
        );
    }
    a.stop();
}
