//! Named regression scenarios for the classic failures of this field, over real processes with
//! real cuts of the peer links. (The leader dying after committing a claim but before replying
//! is `a_claim_retried_after_an_unknown_outcome_lands_on_the_same_node` in `tests/faults.rs`.)

use std::time::Duration;

use modelforge_chaos::answer::refusal_code;
use modelforge_chaos::answer::typed;
use modelforge_chaos::cluster::ADMIN;
use modelforge_chaos::cluster::ChaosCluster;
use modelforge_proto::api;
use modelforge_proto::identity::IdentityKey;
use modelforge_proto::wire;
use serde_json::Value;
use serde_json::json;

async fn req(
    c: &ChaosCluster,
    method: reqwest::Method,
    url: String,
    bearer: &str,
    body: Value,
) -> (u16, Value) {
    let r = c
        .http
        .request(method, url)
        .bearer_auth(bearer)
        .header("idempotency-key", modelforge_proto::new_uuid())
        .timeout(Duration::from_secs(10))
        .json(&body)
        .send()
        .await;
    match r {
        Ok(r) => {
            let s = r.status().as_u16();
            (s, r.json().await.unwrap_or(Value::Null))
        }
        Err(_) => (0, Value::Null),
    }
}

/// Retry `f` until it returns Some, for at most 30 s.
macro_rules! eventually {
    ($what:expr, $body:expr) => {{
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(v) = $body {
                break v;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for: {}",
                $what
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }};
}

async fn token(c: &ChaosCluster, member: usize, ttl: u64) -> (String, String) {
    eventually!("a token", {
        let (s, v) = req(
            c,
            reqwest::Method::POST,
            format!("{}/api/v1/admin/node-enrollments", c.url(member)),
            ADMIN,
            json!({"ttl_seconds": ttl}),
        )
        .await;
        (s == 201).then(|| {
            let t: api::TokenIssued = typed("a new token", &v);
            (t.token, t.expires_at)
        })
    })
}

async fn enroll(c: &ChaosCluster, member: usize, tok: &str, key: &IdentityKey) -> (u16, Value) {
    let body = json!({"token": tok, "hostname": "regress", "identity": key.prove(&tok[5..37], "regress", modelforge_proto::now_ms(), None),
        "inventory": {"accelerators": [], "storage_roots": []}});
    req(
        c,
        reqwest::Method::POST,
        format!("{}/api/v1/agent/enroll", c.url(member)),
        "-",
        body,
    )
    .await
}

async fn heartbeat(c: &ChaosCluster, member: usize, nid: &str, cred: &str) -> u16 {
    heartbeat_answer(c, member, nid, cred).await.0
}

/// A heartbeat's status and error code (`""` when the body has none; status 0: no answer).
async fn heartbeat_answer(c: &ChaosCluster, member: usize, nid: &str, cred: &str) -> (u16, String) {
    let (s, v) = req(
        c,
        reqwest::Method::POST,
        format!("{}/api/v1/agent/nodes/{nid}/heartbeat", c.url(member)),
        cred,
        json!({}),
    )
    .await;
    (s, refusal_code(&v))
}

async fn cluster(n: usize) -> (ChaosCluster, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("mf-regress-{}", modelforge_proto::new_uuid()));
    std::fs::create_dir_all(&dir).unwrap();
    let c = ChaosCluster::start(&modelforge_chaos::server_bin_for_tests(), &dir, n, &[])
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    (c, dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_leader_refuses_a_credential_revoked_through_the_majority() {
    let (mut c, dir) = cluster(3).await;
    let leader = c.wait_leader(Duration::from_secs(30)).await.unwrap();
    let (tok, _) = token(&c, leader, 600).await;
    let (s, v) = enroll(&c, leader, &tok, &IdentityKey::generate()).await;
    assert_eq!(s, 201, "{v}");
    let enrolled: wire::EnrollResponse = typed("an enrolment", &v);
    let (nid, cred) = (enrolled.node_id.to_string(), enrolled.credential);
    assert_eq!(heartbeat(&c, leader, &nid, &cred).await, 200);

    c.isolate(leader);
    let other = (0..3).find(|i| *i != leader).unwrap();
    // The admin revokes through the majority side.
    let (s, v) = eventually!("the revoke through the majority", {
        let r = req(
            &c,
            reqwest::Method::DELETE,
            format!(
                "{}/api/v1/admin/hardware/nodes/{nid}/credential",
                c.url(other)
            ),
            ADMIN,
            json!({}),
        )
        .await;
        (r.0 == 200).then_some(r)
    });
    assert_eq!(s, 200);
    assert_eq!(typed::<api::Revoked>("a revoke", &v).revoked.len(), 1);
    // The old leader, still cut off, must never say 200 again for that credential. It cannot
    // say 401 either: the revocation never reached it, so it does not know (the contract's 401
    // is "the credential is revoked", an answer from a current state). Its lease ran out before
    // the majority could elect the leader that revoked, so it refuses to serve from a possibly
    // stale state: exactly 503 `not_leader` (the contract's "no leader / not ready"), at once,
    // never a timeout (an agent moves on to another member on a 503).
    for _ in 0..20 {
        let (s, code) = heartbeat_answer(&c, leader, &nid, &cred).await;
        assert_eq!(
            (s, code.as_str()),
            (503, "not_leader"),
            "the cut-off old leader must refuse to serve the revoked credential from its stale state"
        );
    }
    for m in 0..3 {
        if m != leader {
            let (s, code) = heartbeat_answer(&c, m, &nid, &cred).await;
            assert_eq!((s, code.as_str()), (401, "credential_revoked"));
        }
    }
    c.heal();
    eventually!("the old leader answers 401 after the heal", {
        let (s, code) = heartbeat_answer(&c, leader, &nid, &cred).await;
        assert_ne!(
            s, 200,
            "the old leader accepted a revoked credential after the heal"
        );
        (s == 401).then(|| assert_eq!(code, "credential_revoked"))
    });
    drop(c);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_member_with_an_old_log_rejoins_and_converges() {
    let (mut c, dir) = cluster(3).await;
    let leader = c.wait_leader(Duration::from_secs(30)).await.unwrap();
    let follower = (0..3).find(|i| *i != leader).unwrap();
    c.kill9(follower);
    for _ in 0..10 {
        token(&c, leader, 600).await;
    }
    c.start_member(follower).unwrap();
    let digest = eventually!("all three members converge", {
        let mut d = vec![];
        for i in 0..3 {
            d.push(c.digest(i).await);
        }
        (d.iter().all(|x| x.is_some()) && d.windows(2).all(|w| w[0] == w[1])).then(|| d[0].clone())
    });
    assert!(digest.is_some());
    drop(c);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_that_expired_while_the_cluster_was_down_stays_unusable() {
    let (mut c, dir) = cluster(3).await;
    let leader = c.wait_leader(Duration::from_secs(30)).await.unwrap();
    let (tok, expires_at) = token(&c, leader, 2).await;
    for i in 0..3 {
        c.kill9(i);
    }
    // Wait (on the clock, not a fixed sleep) until the token's expiry has passed.
    eventually!("the token's expiry to pass", {
        let now = modelforge_proto::rfc3339_ms(modelforge_proto::now_ms());
        (now > expires_at).then_some(())
    });
    for i in 0..3 {
        c.start_member(i).unwrap();
    }
    let l = c.wait_leader(Duration::from_secs(30)).await.unwrap();
    let (s, v) = eventually!("an answer to the enrolment", {
        let r = enroll(&c, l, &tok, &IdentityKey::generate()).await;
        (r.0 != 0 && r.0 != 503).then_some(r)
    });
    assert_eq!(s, 401, "{v}");
    assert_eq!(refusal_code(&v), "token_expired", "{v}");
    drop(c);
    let _ = std::fs::remove_dir_all(dir);
}
