//! Attacks on the edges over real processes, each performed: argon2 turned against the
//! member by a flood of wrong secrets naming a real credential.

mod common;

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::time::Duration;
use std::time::Instant;

use common::*;
use modelforge_proto::api::ClusterView;
use serde_json::json;

/// `credential` with its secret replaced by random hex (a well-formed credential naming the
/// same id: the checksum is right, the secret wrong).
fn wrong_secret(credential: &str) -> String {
    let id = credential.split('_').nth(1).unwrap();
    let secret = modelforge_proto::hex(&modelforge_proto::random_bytes::<32>());
    let body = format!("mfnc_{id}_{secret}");
    format!("{body}_{:08x}", crc32fast::hash(body.as_bytes()))
}

/// A client whose connections leave from `local` (another address on the loopback network:
/// the attacker's).
fn client_from(local: [u8; 4]) -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .local_address(std::net::IpAddr::from(local))
        .timeout(Duration::from_secs(15))
        .tls_backend_preconfigured(
            modelforge_client::tls::client_config(&harness_ca().pem, None).unwrap(),
        )
        .build()
        .unwrap()
}

async fn view(c: &Cluster) -> ClusterView {
    c.cluster_view(1).await.expect("the member answers")
}

/// A single member with one enrolled node whose credential is not in the verified cache (the
/// member restarted, the agent stopped): every check of that id needs argon2 until one
/// passes, which is when a flood would cost the most. The cluster, node id and credential.
async fn cold_victim() -> (Cluster, String, String) {
    let mut c = Cluster::start(1).await;
    let (mut agent, node_id, credential) = c.enrol_one("victim").await;
    agent.stop();
    c.kill9(1);
    c.start_member(1);
    c.wait_ready().await;
    (c, node_id, credential)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_wrong_secrets_costs_at_most_the_budget_and_starves_nobody() {
    let (mut c, node_id, credential) = cold_victim().await;
    let before = view(&c).await.secret_checks;

    // Good heartbeats with the victim's own credential, from its own address, all along.
    let url = c.url(1);
    let hb = format!("{url}/api/v1/agent/nodes/{node_id}/heartbeat");
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let good = {
        let (hb, credential, done) = (hb.clone(), credential.clone(), done.clone());
        tokio::spawn(async move {
            let http = http();
            let mut answers = vec![];
            while answers.is_empty() || !done.load(Ordering::Relaxed) {
                let r = http
                    .post(&hb)
                    .bearer_auth(&credential)
                    .json(&serde_json::json!({}))
                    .send()
                    .await
                    .unwrap();
                answers.push(r.status().as_u16());
            }
            answers
        })
    };
    let token = c.new_token(600).await;

    // 2,000 wrong secrets naming the real credential id, from 64 concurrent clients at the
    // attacker's address.
    let sent = Arc::new(AtomicU64::new(0));
    let mut flood = tokio::task::JoinSet::new();
    for _ in 0..64 {
        let (hb, credential, sent) = (hb.clone(), credential.clone(), sent.clone());
        flood.spawn(async move {
            let http = client_from([127, 0, 0, 2]);
            let mut answers = vec![];
            while sent.fetch_add(1, Ordering::Relaxed) < 2000 {
                let r = http
                    .post(&hb)
                    .bearer_auth(wrong_secret(&credential))
                    .json(&serde_json::json!({}))
                    .send()
                    .await
                    .unwrap();
                let retry_after = r.headers().get("retry-after").is_some();
                let status = r.status().as_u16();
                let body: serde_json::Value = r.json().await.unwrap_or_default();
                answers.push((status, retry_after, body));
            }
            answers
        });
    }

    // Meanwhile a new agent enrols.
    let mut newcomer = Agent::new(c.root(), "newcomer", c.urls());
    let t = Instant::now();
    newcomer.start(Some(&token));
    newcomer.wait_enrolled(None).await;
    let enrol_took = t.elapsed();
    let mut answers = vec![];
    while let Some(r) = flood.join_next().await {
        answers.extend(r.unwrap());
    }
    done.store(true, Ordering::Relaxed);
    let good_answers = good.await.unwrap();
    let after = view(&c).await.secret_checks;

    assert!(
        enrol_took < Duration::from_secs(2),
        "the enrolment took {enrol_took:?} under the flood"
    );
    assert!(!good_answers.is_empty());
    assert!(
        good_answers.iter().all(|s| *s == 200),
        "good heartbeats answered {good_answers:?}"
    );
    // Every flood request was refused: 401 while the budget lasted, then 429 with
    // Retry-After, never a 5xx.
    assert_eq!(answers.len(), 2000);
    for (status, retry_after, body) in &answers {
        let code = body["error"]["code"].as_str().unwrap_or("");
        match status {
            401 => assert_eq!(code, "invalid_credential"),
            429 => {
                assert_eq!(code, "too_many_failed_checks");
                assert!(retry_after, "a 429 without Retry-After");
            }
            other => panic!("the flood got {other}: {body}"),
        }
    }
    // The argon2 work the flood caused: the per-credential budget (5) at most. The other
    // verifies: the victim's first good heartbeat, the newcomer's token and its first
    // heartbeat.
    let verifies = after.argon2_verifies - before.argon2_verifies;
    assert!(verifies <= 5 + 3, "{verifies} argon2 verifies");
    // Each refusal was the budget's (429) or needed no argon2 at all (the digest differs from
    // the one the victim's good heartbeat put in the cache).
    let budget = answers.iter().filter(|a| a.0 == 429).count() as u64;
    assert_eq!(after.refused_by_budget - before.refused_by_budget, budget);
    assert!(
        (after.refused_by_budget - before.refused_by_budget)
            + (after.refused_by_digest - before.refused_by_digest)
            >= 2000 - 5,
        "{before:?} -> {after:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_checks_beyond_the_budget_get_429_and_never_the_right_secret() {
    let (c, node_id, credential) = cold_victim().await;
    let hb = format!("{}/api/v1/agent/nodes/{node_id}/heartbeat", c.url(1));
    let attacker = client_from([127, 0, 0, 2]);
    let send = |client: &reqwest::Client, secret: String| {
        let r = client
            .post(&hb)
            .bearer_auth(secret)
            .json(&serde_json::json!({}))
            .send();
        async move {
            let r = r.await.unwrap();
            let retry_after: Option<u64> = r
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok()?.parse().ok());
            let status = r.status().as_u16();
            let body: serde_json::Value = r.json().await.unwrap_or_default();
            (
                status,
                body["error"]["code"].as_str().unwrap_or("").to_string(),
                retry_after,
            )
        }
    };
    let before = view(&c).await.secret_checks;
    // Five wrong secrets for the id from one address are verified (and fail); the sixth is
    // refused without argon2, asked to wait about a minute.
    for _ in 0..5 {
        let (s, code, _) = send(&attacker, wrong_secret(&credential)).await;
        assert_eq!((s, code.as_str()), (401, "invalid_credential"));
    }
    let (s, code, retry_after) = send(&attacker, wrong_secret(&credential)).await;
    assert_eq!((s, code.as_str()), (429, "too_many_failed_checks"));
    let retry_after = retry_after.expect("Retry-After");
    assert!((30..=60).contains(&retry_after), "{retry_after}");
    let mid = view(&c).await.secret_checks;
    assert_eq!(mid.argon2_verifies - before.argon2_verifies, 5);
    assert_eq!(mid.refused_by_budget - before.refused_by_budget, 1);
    // The right secret from the victim's own address: 200 (one verify); and from the
    // attacker's spent address too, now that it is in the cache.
    let (s, _, _) = send(&http(), credential.clone()).await;
    assert_eq!(s, 200);
    let (s, _, _) = send(&attacker, credential.clone()).await;
    assert_eq!(s, 200);
    assert_eq!(
        view(&c).await.secret_checks.argon2_verifies - before.argon2_verifies,
        6
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_secret_for_a_verified_credential_id_is_refused_without_argon2() {
    let mut c = Cluster::start(1).await;
    let (_agent, node_id, credential) = c.enrol_one("a").await;
    // The agent's heartbeats have put its credential in the verified cache.
    let hb = format!("{}/api/v1/agent/nodes/{node_id}/heartbeat", c.url(1));
    let (s, _) = call("POST", &hb, Some(&credential), Some(serde_json::json!({}))).await;
    assert_eq!(s, 200);
    let before = view(&c).await.secret_checks;
    for _ in 0..50 {
        let (s, v) = call(
            "POST",
            &hb,
            Some(&wrong_secret(&credential)),
            Some(serde_json::json!({})),
        )
        .await;
        assert_eq!(refused(s, &v), (401, "invalid_credential"), "{v}");
    }
    let after = view(&c).await.secret_checks;
    assert_eq!(after.argon2_verifies, before.argon2_verifies, "argon2 ran");
    assert_eq!(after.refused_by_digest - before.refused_by_digest, 50);
}

/// Audit events of `action` caused by node `node_id`'s agent.
async fn node_events(c: &mut Cluster, node_id: &str, action: &str) -> usize {
    let actor = format!("agent:{node_id}");
    c.audit_events()
        .await
        .iter()
        .filter(|e| e.record.actor == actor && e.record.action == action)
        .count()
}

/// One node cannot grow the replicated state: smoke reports naming unknown, another node's or
/// finished smokes are answered without a write (before, each was a refused command in the
/// log and a row in the audit trail), and the writes a node may cause are rate-limited
/// (429 `too_many_writes` with `Retry-After`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_node_cannot_grow_the_replicated_state() {
    let mut c = Cluster::start(1).await;
    let (mut agent, node_id, credential) = c.enrol_one("grower").await;
    let (mut other, other_id, _) = c.enrol_one("bystander").await;
    // A smoke that finished: the agent ran it.
    let started = c.start_smoke(&node_id).await;
    let finished = started.smoke_id.to_string();
    let base = c.url(1);
    let smoke_view = format!("{base}/api/v1/admin/hardware/nodes/{node_id}/smoke/{finished}");
    let passed = wait_until("the smoke to finish", WAIT, || async {
        let (s, v) = call("GET", &smoke_view, Some(ADMIN), None).await;
        assert_eq!(s, 200, "{v}");
        (v["state"] != "pending").then(|| v["state"] == "passed")
    })
    .await;
    // A smoke of another node, still pending (its agent is stopped first).
    other.stop();
    let pending = c.start_smoke(&other_id).await;
    agent.stop();

    let report = json!({"checks": [{"name": "gpu", "ok": true, "detail": ""}]});
    let send = |method: reqwest::Method, path: String, body: serde_json::Value| {
        let url = format!("{base}{path}");
        let credential = credential.clone();
        async move {
            let r = http()
                .request(method, url)
                .bearer_auth(credential)
                .json(&body)
                .send()
                .await
                .unwrap();
            let retry_after = r.headers().get("retry-after").is_some();
            let s = r.status().as_u16();
            let v: serde_json::Value = r.json().await.unwrap_or_default();
            (s, v, retry_after)
        }
    };
    let smoke_path = |smoke: &str| format!("/api/v1/agent/nodes/{node_id}/smoke/{smoke}");
    let before = node_events(&mut c, &node_id, "smoke.result").await;
    for i in 0..30 {
        let unknown = format!("no-such-smoke-{i}");
        let (s, v, _) = send(reqwest::Method::POST, smoke_path(&unknown), report.clone()).await;
        assert_eq!(refused(s, &v), (404, "smoke_not_found"), "{v}");
        let (s, v, _) = send(
            reqwest::Method::POST,
            smoke_path(pending.smoke_id.as_ref()),
            report.clone(),
        )
        .await;
        assert_eq!(refused(s, &v), (403, "wrong_node"), "{v}");
        let (s, v, _) = send(reqwest::Method::POST, smoke_path(&finished), report.clone()).await;
        assert_eq!(s, 200, "{v}");
        assert_eq!(
            v["passed"], passed,
            "a finished smoke answers its verdict: {v}"
        );
    }
    assert_eq!(
        node_events(&mut c, &node_id, "smoke.result").await,
        before,
        "a report that changes nothing was written"
    );

    // Inventory that changes on every report: at most the burst is written, then 429.
    let before = node_events(&mut c, &node_id, "node.inventory").await;
    let mut statuses = vec![];
    for i in 0..40 {
        let inv =
            json!({"accelerators": [], "storage_roots": [], "driver_version": format!("v{i}")});
        let (s, v, retry_after) = send(
            reqwest::Method::PUT,
            format!("/api/v1/agent/nodes/{node_id}/inventory"),
            inv,
        )
        .await;
        if s == 429 {
            assert_eq!(v["error"]["code"], "too_many_writes", "{v}");
            assert!(retry_after, "429 without Retry-After");
        } else {
            assert_eq!(s, 200, "{v}");
        }
        statuses.push(s);
    }
    let written = node_events(&mut c, &node_id, "node.inventory").await - before;
    assert!(written <= 20, "{written} inventory writes: {statuses:?}");
    assert_eq!(statuses.last(), Some(&429), "{statuses:?}");
    // The other node's writes are its own budget: its agent, restarted, still reports.
    other.start(None);
    c.admin_as::<serde_json::Value>(
        "GET",
        &format!("/api/v1/admin/hardware/nodes/{other_id}"),
        None,
        200,
    )
    .await;
}

/// Admission control: above `--max-agent-requests` requests in progress, agent requests are
/// shed at once with 503 `over_capacity` and `Retry-After` (never queued without bound), every
/// request admitted is answered 200, and the member keeps serving.
///
/// A heartbeat's handler no longer waits on anything once its credential is verified (the
/// lease is read from Raft's metrics), so only the member's runtime workers (two on these
/// machines) hold slots at once: a limit of 1 is what 64 concurrent heartbeats exceed. The
/// queue-delay shedding is off, so only the limit can shed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_requests_beyond_capacity_are_shed_with_retry_after() {
    let mut c = Cluster::start_with(
        1,
        &["--max-agent-requests", "1", "--shed-queue-delay", "0s"],
    )
    .await;
    let (mut agent, node_id, credential) = c.enrol_one("busy").await;
    agent.stop();
    let url = format!("{}/api/v1/agent/nodes/{node_id}/heartbeat", c.url(1));
    let shed_seen = wait_until("a heartbeat to be shed", WAIT, || async {
        let burst: Vec<_> = (0..64)
            .map(|_| {
                let (url, credential) = (url.clone(), credential.clone());
                tokio::spawn(async move {
                    let r = http()
                        .post(url)
                        .bearer_auth(credential)
                        .json(&json!({}))
                        .send()
                        .await
                        .unwrap();
                    let retry_after = r.headers().get("retry-after").cloned();
                    let s = r.status().as_u16();
                    let v: serde_json::Value = r.json().await.unwrap_or_default();
                    (s, v, retry_after)
                })
            })
            .collect();
        let mut shed = 0;
        for b in burst {
            let (s, v, retry_after) = b.await.unwrap();
            match s {
                200 => {}
                503 => {
                    assert_eq!(v["error"]["code"], "over_capacity", "{v}");
                    assert_eq!(retry_after.unwrap(), "1");
                    shed += 1;
                }
                _ => panic!("{s} {v}"),
            }
        }
        (shed > 0).then_some(shed)
    })
    .await;
    let v = view(&c).await;
    assert!(v.admission.shed >= shed_seen as u64, "{:?}", v.admission);
    assert_eq!(v.admission.limit, 1);
    // Nothing is left in progress, and the member serves the next heartbeat.
    assert_eq!(c.heartbeat_all(&node_id, &credential).await, vec![200]);
    assert_eq!(view(&c).await.admission.in_flight, 0);
}
