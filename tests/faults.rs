//! Crashes over real processes: `kill -9` of the leader and of a follower during steady
//! heartbeats, restarts that catch up (log replay and snapshot install), a whole-cluster crash,
//! and the claim retry when the outcome of an enrolment was unknown.

mod common;

use common::*;
use modelforge_proto::api;
use modelforge_proto::identity::IdentityKey;
use modelforge_proto::wire::EnrollResponse;
use serde_json::json;
use std::time::Duration;

/// Heartbeat from every agent through whichever member answers; true if all got 200.
async fn all_heartbeat_ok(urls: &[String], nodes: &[(String, String)]) -> bool {
    for (nid, cred) in nodes {
        let mut ok = false;
        for u in urls {
            let (s, _) = call(
                "POST",
                &format!("{u}/api/v1/agent/nodes/{nid}/heartbeat"),
                Some(cred),
                Some(json!({})),
            )
            .await;
            if s == 200 {
                ok = true;
                break;
            }
        }
        if !ok {
            return false;
        }
    }
    true
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_leader_then_follower_during_heartbeats_writes_resume_and_members_catch_up() {
    let mut c =
        Cluster::start_with(3, &["--snapshot-every", "20", "--snapshot-keep-logs", "0"]).await;
    let (_agents, nodes) = c.enrol_agents("a", 3).await;
    let leader = c.wait_leader().await;
    c.kill9(leader);
    let new_leader = c.wait_leader().await;
    assert_ne!(new_leader, leader);
    // Writes resume: a token can be created and an agent can enrol.
    let t = c.new_token(600).await;
    let urls = c.urls();
    wait_until(
        "every agent's heartbeat is accepted after the leader died",
        WAIT,
        || async { all_heartbeat_ok(&urls, &nodes).await.then_some(()) },
    )
    .await;
    // Enough writes that the survivors snapshot past what the dead member has (snapshots are
    // paced, so wait for them rather than assume them).
    let (s, view) = c.admin("GET", "/api/v1/cluster", None).await;
    assert_eq!(s, 200, "{view}");
    let dead_had = typed::<api::ClusterView>("the cluster", &view).applied_index;
    for _ in 0..30 {
        c.new_token(60).await;
    }
    let survivors: Vec<u64> = c.live_ids();
    let this = &c;
    wait_until(
        "the survivors snapshot past what the dead member has",
        WAIT,
        || {
            let survivors = survivors.clone();
            async move {
                for id in survivors {
                    let v = this.cluster_view(id).await?;
                    if v.snapshot_index.is_none_or(|s| s <= dead_had) {
                        return None;
                    }
                }
                Some(())
            }
        },
    )
    .await;
    c.start_member(leader);
    c.wait_ready().await;
    let digest = c.wait_converged().await;
    assert!(!digest.is_empty());
    let log = std::fs::read_to_string(c.root().join(format!("m{leader}.log"))).unwrap();
    assert!(
        log.contains("installed snapshot"),
        "the restarted member caught up by snapshot install"
    );
    // The restarted member caught up (snapshot install or log replay) and serves correctly.
    for (nid, cred) in &nodes {
        let url = format!("{}/api/v1/agent/nodes/{nid}/heartbeat", c.url(leader));
        let (s, _) = call("POST", &url, Some(cred), Some(json!({}))).await;
        assert_eq!(s, 200);
    }
    // Now a follower.
    let leader = c.wait_leader().await;
    let follower = c.ids.iter().copied().find(|i| *i != leader).unwrap();
    c.kill9(follower);
    let mut late = Agent::new(c.root(), "late", c.urls());
    late.start(Some(&t));
    late.wait_enrolled(None).await;
    assert!(all_heartbeat_ok(&c.urls(), &nodes).await);
    c.start_member(follower);
    c.wait_ready().await;
    c.wait_converged().await;
    let nodes = c.nodes("").await;
    assert_eq!(nodes.len(), 4);
    for n in &nodes {
        assert_eq!(
            n.status, "online",
            "no node leaves online because the leader moved: {n:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_cluster_killed_keeps_every_acknowledged_write() {
    let mut c = Cluster::start(3).await;
    let (mut a, nid, cred) = c.enrol_one("a").await;
    a.stop();
    c.revoke(&nid).await;
    let t2 = c.new_token(600).await;
    a.start(Some(&t2));
    let (_, cred2) = a.wait_enrolled(Some(&cred)).await;
    a.stop();
    for id in c.ids.clone() {
        c.kill9(id);
    }
    for id in c.ids.clone() {
        c.start_member(id);
    }
    c.wait_ready().await;
    assert_eq!(
        c.heartbeat_all(&nid, &cred).await,
        vec![401, 401, 401],
        "the revocation survived kill -9"
    );
    assert_eq!(
        c.heartbeat_all(&nid, &cred2).await,
        vec![200, 200, 200],
        "the new credential survived kill -9"
    );
    let creds = c.credentials(&nid).await;
    assert_eq!((creds.active, creds.revoked), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_member_restarted_keeps_its_state() {
    let mut c = Cluster::start(1).await;
    let (mut a, nid, cred) = c.enrol_one("a").await;
    a.stop();
    c.kill9(1);
    c.start_member(1);
    c.wait_ready().await;
    assert_eq!(c.heartbeat_all(&nid, &cred).await, vec![200]);
}

/// An agent whose heartbeat was not delivered (its only member down) sends it again within
/// seconds of the member's return, not at its next interval: with a 10-minute interval, the
/// restarted member (which holds no telemetry until a heartbeat arrives) sees one long before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undelivered_heartbeat_is_sent_again_within_seconds_not_an_interval_later() {
    let mut c = Cluster::start(1).await;
    let t = c.new_token(600).await;
    let mut a = Agent::new(c.root(), "patient", c.urls()).interval("10m");
    a.start(Some(&t));
    let (nid, _) = a.wait_enrolled(None).await;
    a.stop();
    c.kill9(1);
    // Started again while its member is down: the first heartbeat is not delivered.
    a.start(None);
    let log = c.root().join("agent-patient.log");
    wait_until("the agent to miss a heartbeat", WAIT, || async {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        text.contains("heartbeat not delivered").then_some(())
    })
    .await;
    c.start_member(1);
    c.wait_ready().await;
    let back = std::time::Instant::now();
    while c.node(&nid).await.telemetry_at.is_none() {
        assert!(
            back.elapsed() < Duration::from_secs(30),
            "no heartbeat 30 s after the member's return (the interval is 10 minutes)"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A captured enrolment request replayed byte for byte (the same identity proof) claims
/// nothing, though it carries a valid token and a valid signature within the clock window:
/// before this, it was taken for a retry of the claim and answered with a fresh credential,
/// revoking the real agent's. A retry signed later is still a retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_captured_enrolment_replayed_byte_for_byte_claims_nothing() {
    let mut c = Cluster::start(1).await;
    let token = c.new_token(600).await;
    let key = IdentityKey::generate();
    let signed = |at: i64| {
        json!({
            "token": token,
            "hostname": "gpu-replay",
            "identity": key.prove(&token[5..37], "gpu-replay", at, None),
            "inventory": {"accelerators": [], "storage_roots": []},
        })
    };
    let url = format!("{}/api/v1/agent/enroll", c.url(1));
    let captured = signed(modelforge_proto::now_ms());
    let (s, first) = call("POST", &url, None, Some(captured.clone())).await;
    assert_eq!(s, 201, "{first}");
    let first: EnrollResponse = typed("an enrolment", &first);
    let (s, v) = call("POST", &url, None, Some(captured)).await;
    assert_eq!(refused(s, &v), (401, "token_already_claimed"), "{v}");
    // An older proof than the one accepted is refused too.
    let (s, v) = call(
        "POST",
        &url,
        None,
        Some(signed(modelforge_proto::now_ms() - 60_000)),
    )
    .await;
    assert_eq!(refused(s, &v), (401, "token_already_claimed"), "{v}");
    assert_eq!(
        c.heartbeat_all(first.node_id.as_str(), &first.credential)
            .await,
        vec![200],
        "the real agent's credential survives the replay"
    );
    assert_eq!(c.nodes("").await.len(), 1);
}

/// The leader died after committing a claim but before replying: the agent's retry of the same
/// claim (same identity, same token) lands on the same node id; another identity cannot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_retried_after_an_unknown_outcome_lands_on_the_same_node() {
    let mut c = Cluster::start(3).await;
    let token = c.new_token(600).await;
    let token_id = &token[5..37];
    let key = IdentityKey::generate();
    let enroll = |key: &IdentityKey| {
        json!({
            "token": token,
            "hostname": "gpu-retry",
            "identity": key.prove(token_id, "gpu-retry", modelforge_proto::now_ms(), None),
            "inventory": {"accelerators": [], "storage_roots": []},
        })
    };
    let leader = c.wait_leader().await;
    let urls = c.urls();
    let enroll_at = |id: u64| format!("{}/api/v1/agent/enroll", urls[id as usize - 1]);
    let (s, first) = call("POST", &enroll_at(leader), None, Some(enroll(&key))).await;
    assert_eq!(s, 201, "{first}");
    // The reply is "lost"; the leader dies; the agent retries elsewhere.
    c.kill9(leader);
    c.wait_leader().await;
    let other = c.live_ids()[0];
    let body = enroll(&key);
    let (s, second) = wait_until("the retry is answered", WAIT, || {
        let url = format!("{}/api/v1/agent/enroll", c.url(other));
        let body = body.clone();
        async move {
            let r = call("POST", &url, None, Some(body)).await;
            (r.0 != 0 && r.0 != 503).then_some(r)
        }
    })
    .await;
    assert_eq!(s, 201, "{second}");
    let first: EnrollResponse = typed("an enrolment", &first);
    let second: EnrollResponse = typed("its retry", &second);
    assert_eq!(second.node_id, first.node_id);
    assert_ne!(second.credential, first.credential);
    let nid = first.node_id.as_str();
    let first_cred = first.credential.as_str();
    let second_cred = second.credential.as_str();
    assert_eq!(
        c.heartbeat_all(nid, first_cred).await,
        vec![401, 401],
        "the undelivered credential is revoked"
    );
    // Another identity with the same token: refused.
    let thief = IdentityKey::generate();
    let (s, v) = call("POST", &enroll_at(other), None, Some(enroll(&thief))).await;
    assert_eq!(s, 401, "{v}");
    // Once the credential was used, even the same identity cannot claim again.
    assert_eq!(c.heartbeat_all(nid, second_cred).await, vec![200, 200]);
    let (s, v) = call("POST", &enroll_at(other), None, Some(enroll(&key))).await;
    assert_eq!(refused(s, &v), (401, "token_already_claimed"), "{v}");
    assert_eq!(c.nodes("").await.len(), 1);
}

/// How many argon2 verifies member `id` has run.
async fn argon2_verifies(c: &Cluster, id: u64) -> u64 {
    c.cluster_view(id)
        .await
        .unwrap()
        .secret_checks
        .argon2_verifies
}

/// After a failover the new leader already holds the verified-credential cache entries the old
/// leader built, so reconnecting agents cost it no argon2 verify (no storm of 10,000 verifies).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_needs_no_argon2_for_credentials_the_old_leader_verified() {
    let mut c = Cluster::start(3).await;
    let (mut agents, nodes) = c.enrol_agents("w", 4).await;
    let leader = c.wait_leader().await;
    let followers: Vec<u64> = c.ids.iter().copied().filter(|i| *i != leader).collect();
    for f in &followers {
        let c = &c;
        wait_until(
            "the follower learns the leader's verified credentials",
            WAIT,
            || async move {
                let v = c.cluster_view(*f).await?;
                (v.secret_checks.cache_entries >= 4).then_some(())
            },
        )
        .await;
    }
    for a in agents.iter_mut() {
        a.stop();
    }
    c.kill9(leader);
    let new_leader = c.wait_leader().await;
    let before = argon2_verifies(&c, new_leader).await;
    for (nid, cred) in &nodes {
        let url = format!("{}/api/v1/agent/nodes/{nid}/heartbeat", c.url(new_leader));
        assert_eq!(call("POST", &url, Some(cred), Some(json!({}))).await.0, 200);
    }
    let after = argon2_verifies(&c, new_leader).await;
    assert_eq!(
        after, before,
        "the new leader re-ran argon2 for credentials the old leader had verified"
    );
    // A well-formed credential with a known id and another secret: its digest differs from the
    // cached one (one id has one secret), so it is refused 401 invalid_credential without
    // argon2 on every attempt.
    let (nid, cred) = &nodes[1];
    let wrong = with_another_secret(cred);
    let url = format!("{}/api/v1/agent/nodes/{nid}/heartbeat", c.url(new_leader));
    for _ in 1..=2u64 {
        let (s, v) = call("POST", &url, Some(&wrong), Some(json!({}))).await;
        assert_eq!(refused(s, &v), (401, "invalid_credential"), "{v}");
    }
    let view = c.cluster_view(new_leader).await.unwrap();
    assert_eq!(view.secret_checks.argon2_verifies, after);
    assert!(view.secret_checks.refused_by_digest >= 2, "{view:?}");
    // And the right secret is still served from the cache.
    assert_eq!(call("POST", &url, Some(cred), Some(json!({}))).await.0, 200);
    assert_eq!(argon2_verifies(&c, new_leader).await, after);
    // The positive control: the counter does move when argon2 must run (a new agent's token
    // and its first heartbeat), so the equalities above are not a counter that never moves.
    let (_newcomer, nid, cred) = c.enrol_one("newcomer").await;
    let url = format!("{}/api/v1/agent/nodes/{nid}/heartbeat", c.url(new_leader));
    assert_eq!(
        call("POST", &url, Some(&cred), Some(json!({}))).await.0,
        200
    );
    assert!(argon2_verifies(&c, new_leader).await >= after + 2);
    // A revocation still wins over a warm cache on every member.
    let (nid, cred) = &nodes[0];
    c.revoke(nid).await;
    assert_eq!(c.heartbeat_all(nid, cred).await, vec![401, 401]);
}

/// `credential` with the same prefix and id and another secret, with a valid checksum: it
/// passes the format check and finds its row (and the verified cache refuses its digest).
fn with_another_secret(credential: &str) -> String {
    let (body, _crc) = credential.rsplit_once('_').unwrap();
    let (prefix_and_id, secret) = body.rsplit_once('_').unwrap();
    let other: String = secret
        .chars()
        .map(|ch| if ch == '0' { '1' } else { '0' })
        .collect();
    let body = format!("{prefix_and_id}_{other}");
    format!("{body}_{:08x}", crc32fast::hash(body.as_bytes()))
}

/// Issue 16: nothing an operator relies on dies with a leader. The refusal that prompted an
/// investigation (another node's credential sent for node a) and the nodes' telemetry are
/// shared with the followers, so after `kill -9` of the leader the new leader's node view still
/// shows both and the doctor still names the runbook case, instead of "silent".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_and_telemetry_survive_the_leaders_death() {
    let mut c = Cluster::start_with(3, &["--stale-after", "3s", "--offline-after", "6s"]).await;
    let (mut agents, nodes) = c.enrol_agents("o", 2).await;
    let ((aid, _), (_, bcred)) = (&nodes[0], &nodes[1]);
    let urls = c.urls();
    wait_until("node a's telemetry on the leader", WAIT, || async {
        node_view(&urls, aid)
            .await
            .filter(|v| telemetry(v).is_some())
    })
    .await;
    agents[0].stop();
    let leader = c.wait_leader().await;
    let url = format!("{}/api/v1/agent/nodes/{aid}/heartbeat", c.url(leader));
    let (s, v) = call("POST", &url, Some(bcred), Some(json!({}))).await;
    assert_eq!(refused(s, &v), (403, "credential_for_other_node"), "{v}");
    let before = c.node(aid).await;
    let refusal = before
        .last_refusal
        .clone()
        .expect("the leader shows the refusal");
    let followers: Vec<u64> = c.ids.iter().copied().filter(|i| *i != leader).collect();
    for f in &followers {
        let c = &c;
        wait_until(
            "the follower holds the leader's view",
            WAIT,
            || async move {
                let o = c.cluster_view(*f).await?.observed;
                (o.refusals >= 1 && o.telemetry_samples >= 2).then_some(())
            },
        )
        .await;
    }
    // The old leader's latest sample of a, read after the shares above: a's last heartbeat
    // may still have been on its way (relayed, or in its supervisor's mailbox) when `before`
    // was read, and the shares carry it.
    let last = c.node(aid).await;

    c.kill9(leader);
    let new_leader = c.wait_leader().await;
    let after = node_view(&[c.url(new_leader)], aid)
        .await
        .expect("the new leader's view of node a");
    assert_eq!(
        after.last_refusal.as_ref(),
        Some(&refusal),
        "the new leader lost the refusal"
    );
    assert!(
        telemetry(&after).is_some() && after.telemetry_at.is_some(),
        "the new leader shows no telemetry: {after:?}"
    );
    assert!(
        after.telemetry_at <= last.telemetry_at,
        "the new leader shows a sample newer than the old leader's last: {:?} > {:?}",
        after.telemetry_at,
        last.telemetry_at
    );
    assert!(
        !after.summary.accelerators_verified,
        "a shared sample is no fresh hardware report"
    );
    // The doctor, asked of the new leader, names the case once a is no longer online (the
    // grace window of the new term); without the shared refusal it would say "silent".
    let urls = c.url(new_leader);
    let v = wait_until("the doctor names another node's credential", WAIT, || {
        let urls = urls.clone();
        let aid = aid.clone();
        async move {
            let (code, v) = admin_json(&urls, &["doctor", &aid]).await;
            (code != 0).then_some((code, v))
        }
    })
    .await;
    assert_eq!(v.0, 11, "{}", v.1);
    assert_eq!(
        v.1["checks"]["last_refusal"]["code"],
        "credential_for_other_node"
    );
}
