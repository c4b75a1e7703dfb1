//! GPU health events over real processes (issue 18, first part): an Xid or an ECC count
//! injected by rewriting the agent's `file:` fixture reaches the control plane with the next
//! heartbeat, counted per GPU and `(kind, code)`, with the time first and last seen, and is
//! shown in the node's telemetry; the doctor reads it (a failed GPU on a heartbeating node, then
//! silence since an Xid 79). (Health in node views, cordons and placement are not there yet:
//! see ARCHITECTURE.md, "GPU health".)

mod common;

use common::*;
use modelforge_proto::gpu_health::EventKind;
use modelforge_proto::gpu_health::GpuEvent;
use modelforge_proto::gpu_health::Health;
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
