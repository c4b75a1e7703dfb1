//! Heartbeats sent to followers travel to the leader in batches (`src/server/relay_batch.rs`),
//! over real processes: each heartbeat of a batch gets its own answer (200, 401, 403, 400),
//! with the request id its member gave it; a revocation the leader acknowledged is never
//! contradicted by a follower; and the leader saw batches, not relayed heartbeats.

mod common;

use common::*;
use serde_json::Value;
use serde_json::json;

/// One heartbeat to `url` for `node`: (status, body, the X-Request-Id header).
async fn beat(url: &str, node: &str, cred: &str, body: Vec<u8>) -> (u16, Value, String) {
    let resp = http()
        .post(format!("{url}/api/v1/agent/nodes/{node}/heartbeat"))
        .bearer_auth(cred)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .expect("the follower answers");
    let status = resp.status().as_u16();
    let id = resp
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    (status, resp.json().await.unwrap_or(Value::Null), id)
}

/// How many requests `url`'s metrics counted for `route`.
async fn counted(url: &str, route: &str) -> u64 {
    let text = http()
        .get(format!("{url}/metrics"))
        .send()
        .await
        .expect("/metrics answers")
        .text()
        .await
        .unwrap_or_default();
    text.lines()
        .filter(|l| {
            l.starts_with("modelforge_http_requests_total{")
                && l.contains(&format!("route=\"{route}\""))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_to_followers_are_decided_one_by_one_in_batches() {
    let mut c = Cluster::start(3).await;
    let (_agents, nodes) = c.enrol_agents("r", 3).await;
    let leader = c.wait_leader().await;
    let followers: Vec<u64> = c.ids.iter().copied().filter(|i| *i != leader).collect();
    let f = c.url(followers[0]);
    let good = serde_json::to_vec(&json!({"accelerators": []})).unwrap();
    // Many at once, so that the follower holds several while a batch is in flight: valid
    // heartbeats of two nodes, a credential used on another node's path, a body that is not
    // JSON, and a credential that matches nothing.
    let (n0, c0) = nodes[0].clone();
    let (n1, c1) = nodes[1].clone();
    let (n2, _) = nodes[2].clone();
    let wrong = {
        // The right id with a wrong secret is refused by argon2 or the cache; a garbled one
        // before any lookup. Either way 401, never 200.
        let mut s = c0.clone();
        s.pop();
        s.push(if c0.ends_with('A') { 'B' } else { 'A' });
        s
    };
    let mut calls = vec![];
    for k in 0..80 {
        let f = f.clone();
        let (node, cred, body, want): (String, String, Vec<u8>, u16) = match k % 5 {
            0 => (n0.clone(), c0.clone(), good.clone(), 200),
            1 => (n1.clone(), c1.clone(), good.clone(), 200),
            2 => (n2.clone(), c1.clone(), good.clone(), 403),
            3 => (n0.clone(), c0.clone(), b"{not json".to_vec(), 400),
            _ => (n1.clone(), wrong.clone(), good.clone(), 401),
        };
        calls.push(tokio::spawn(async move {
            (beat(&f, &node, &cred, body).await, want, k)
        }));
    }
    for call in calls {
        let ((status, body, id), want, k) = call.await.unwrap();
        assert_eq!(status, want, "heartbeat {k}: {body}");
        if status == 200 {
            assert_eq!(body["status"], "ok", "{body}");
        } else {
            assert!(is_error_shape(&body), "heartbeat {k}: {body}");
            // The error carries the id the follower gave the request, not the batch's.
            assert_eq!(
                body["error"]["request_id"],
                id.as_str(),
                "heartbeat {k}: {body}"
            );
        }
    }
    let code_of = |v: &Value| v["error"]["code"].as_str().unwrap_or_default().to_string();
    let (_, body, _) = beat(&f, &n2, &c1, good.clone()).await;
    assert_eq!(code_of(&body), "credential_for_other_node");
    let (_, body, _) = beat(&f, &n0, &c0, b"{not json".to_vec()).await;
    assert_eq!(code_of(&body), "invalid_json");

    // The leader decided them from batches: it counted the batch route, and no heartbeat
    // relayed one by one.
    let leader_url = c.url(leader);
    assert!(
        counted(&leader_url, "/internal/v1/heartbeats").await > 0,
        "the leader received batches"
    );
    let follower_beats = counted(&f, "/api/v1/agent/nodes/{node_id}/heartbeat").await;
    assert!(
        follower_beats >= 82,
        "the follower counted its heartbeats ({follower_beats})"
    );

    // A revocation acknowledged by the leader is never contradicted by any member, at once.
    c.revoke(&n0).await;
    for id in c.ids.clone() {
        let (status, body, _) = beat(&c.url(id), &n0, &c0, good.clone()).await;
        assert_eq!(status, 401, "member {id} after the revocation: {body}");
        assert_eq!(code_of(&body), "credential_revoked");
    }
    // The other node still heartbeats through both followers.
    for id in followers {
        let (status, body, _) = beat(&c.url(id), &n1, &c1, good.clone()).await;
        assert_eq!(status, 200, "member {id}: {body}");
    }
}

/// A batch refused whole (its leader died: the follower cannot reach it) still answers each
/// heartbeat under the request id its member gave it, so that an operator finds each one in
/// the logs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_refused_whole_answers_each_heartbeat_under_its_own_request_id() {
    let mut c = Cluster::start(3).await;
    let (mut agents, nodes) = c.enrol_agents("w", 2).await;
    for a in &mut agents {
        a.stop();
    }
    let leader = c.wait_leader().await;
    let follower = c.ids.iter().copied().find(|i| *i != leader).unwrap();
    let f = c.url(follower);
    let good = serde_json::to_vec(&json!({"accelerators": []})).unwrap();
    let (n0, c0) = nodes[0].clone();
    let (s, body, _) = beat(&f, &n0, &c0, good.clone()).await;
    assert_eq!(s, 200, "{body}");
    // No quorum is left, and the follower still takes the dead leader for its leader.
    for id in c.ids.clone() {
        if id != follower {
            c.kill9(id);
        }
    }
    let mut calls = vec![];
    for (k, (node, cred)) in nodes.iter().cycle().take(12).enumerate() {
        let (f, node, cred, body) = (f.clone(), node.clone(), cred.clone(), good.clone());
        calls.push(tokio::spawn(async move {
            (beat(&f, &node, &cred, body).await, k)
        }));
    }
    let mut ids = std::collections::HashSet::new();
    for call in calls {
        let ((status, body, id), k) = call.await.unwrap();
        assert_eq!(status, 503, "heartbeat {k}: {body}");
        assert!(is_error_shape(&body), "heartbeat {k}: {body}");
        assert!(!id.is_empty(), "heartbeat {k} has no request id");
        assert_eq!(
            body["error"]["request_id"],
            id.as_str(),
            "heartbeat {k}: {body}"
        );
        ids.insert(id);
    }
    assert_eq!(ids.len(), 12, "request ids are per request");
}
