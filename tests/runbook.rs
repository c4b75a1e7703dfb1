//! The runbook's flows over real processes: a 3-member cluster on loopback and real agents.

mod common;

use common::*;
use modelforge_proto::api;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fresh_enrolment_then_heartbeats_on_every_member() {
    let mut c = Cluster::start(3).await;
    let token = c.new_token(600).await;
    let mut a = Agent::new(c.root(), "a", c.urls());
    a.start(Some(&token));
    let (nid, cred) = a.wait_enrolled(None).await;
    assert!(cred.starts_with("mfnc_"));
    assert_eq!(c.heartbeat_all(&nid, &cred).await, vec![200, 200, 200]);
    let node = c.node(&nid).await;
    assert_eq!(node.summary.hostname, "host-a");
    assert_eq!(node.summary.accelerators.len(), 2);
    assert!(node.summary.enabled);
    wait_until("the node shows online", WAIT, || {
        let mut c2 = c.urls();
        let u = c2.remove(0);
        let nid = nid.clone();
        async move {
            let (s, v) = call(
                "GET",
                &format!("{u}/api/v1/admin/hardware/nodes/{nid}"),
                Some(ADMIN),
                None,
            )
            .await;
            if s != 200 {
                return None;
            }
            let node: api::NodeDetail = typed("a node", &v);
            (node.summary.status == "online"
                && telemetry(&node).is_some_and(|t| t.accelerators.len() == 2))
            .then_some(())
        }
    })
    .await;
    // The credential file is private.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(a.state_dir.join("credential"))
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600);
    // The token shows as claimed by this node, and the audit trail has the enrolment.
    let (s, v) = c.admin("GET", "/api/v1/admin/node-enrollments", None).await;
    assert_eq!(s, 200, "{v}");
    let list: api::Enrollments = typed("enrollments", &v);
    let row = &list.enrollments[0];
    assert_eq!(row.state, "claimed");
    assert_eq!(
        row.claimed_node_id.as_ref().map(ToString::to_string),
        Some(nid.clone())
    );
    assert!(!v.to_string().contains(&token));
    let page = c.audit(&format!("?node_id={nid}")).await;
    assert!(
        page.events
            .iter()
            .any(|e| e.record.action == "node.enroll" && e.record.result == "ok")
    );
    assert!(page.chain_verified);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credential_lost_reenrols_onto_the_same_node() {
    let mut c = Cluster::start(3).await;
    let t1 = c.new_token(600).await;
    let mut a = Agent::new(c.root(), "a", c.urls());
    a.start(Some(&t1));
    let (nid, old) = a.wait_enrolled(None).await;
    assert_eq!(c.heartbeat_all(&nid, &old).await, vec![200, 200, 200]);
    let history_before = c.node(&nid).await.history.len();
    a.stop();
    std::fs::remove_file(a.state_dir.join("credential")).unwrap();
    let t2 = c.new_token(600).await;
    a.start(Some(&t2));
    let (nid2, new) = a.wait_enrolled(None).await;
    assert_eq!(nid2, nid, "same node id from the persisted identity");
    assert_ne!(new, old);
    let creds = c.credentials(&nid).await;
    assert_eq!((creds.active, creds.revoked), (1, 1), "{creds:?}");
    assert_eq!(c.heartbeat_all(&nid, &old).await, vec![401, 401, 401]);
    assert_eq!(c.heartbeat_all(&nid, &new).await, vec![200, 200, 200]);
    let node = c.node(&nid).await;
    assert_eq!(node.summary.accelerators.len(), 2, "accelerators intact");
    assert!(
        node.history.len() > history_before,
        "history kept and extended"
    );
    assert_eq!(c.nodes("").await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credential_stolen_revoke_then_reenrol_and_the_copy_stays_refused() {
    let mut c = Cluster::start(3).await;
    let t1 = c.new_token(600).await;
    let mut a = Agent::new(c.root(), "a", c.urls());
    a.start(Some(&t1));
    let (nid, stolen) = a.wait_enrolled(None).await;
    assert_eq!(c.heartbeat_all(&nid, &stolen).await, vec![200, 200, 200]);
    assert_eq!(c.revoke(&nid).await.revoked.len(), 1);
    // Revocation is linearizable: right after the 200, every member refuses.
    assert_eq!(c.heartbeat_all(&nid, &stolen).await, vec![401, 401, 401]);
    // A retry of the revoke is safe.
    assert_eq!(c.revoke(&nid).await.revoked.len(), 0);
    // The running agent's token is spent, so it stops with a one-line reason.
    let (code, line) = a.wait_exit().await;
    assert_eq!(code, 1, "{line}");
    assert!(
        line.contains("credential refused (401 credential_revoked)"),
        "{line}"
    );
    // Replaying the first token cannot undo the revocation.
    a.start(Some(&t1));
    let (code, line) = a.wait_exit().await;
    assert_eq!(code, 1, "{line}");
    assert!(line.contains("enrolment refused (401"), "{line}");
    let t2 = c.new_token(600).await;
    a.start(Some(&t2));
    let (nid2, fresh) = a.wait_enrolled(None).await;
    assert_eq!(nid2, nid);
    assert_eq!(c.heartbeat_all(&nid, &fresh).await, vec![200, 200, 200]);
    assert_eq!(
        c.heartbeat_all(&nid, &stolen).await,
        vec![401, 401, 401],
        "the stolen copy stays refused"
    );
    let node = c.node(&nid).await;
    assert_eq!(node.last_refusal.map(|r| r.status), Some(401));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_nodes_credential_gets_403_and_shows_on_the_node() {
    let mut c = Cluster::start(3).await;
    let (ta, tb) = (c.new_token(600).await, c.new_token(600).await);
    let mut a = Agent::new(c.root(), "a", c.urls());
    let mut b = Agent::new(c.root(), "b", c.urls());
    a.start(Some(&ta));
    b.start(Some(&tb));
    let (na, ca) = a.wait_enrolled(None).await;
    let (nb, _) = b.wait_enrolled(None).await;
    assert_ne!(na, nb);
    assert_eq!(c.heartbeat_all(&nb, &ca).await, vec![403, 403, 403]);
    let node_b = c.node(&nb).await;
    assert_eq!(
        node_b.last_refusal.as_ref().map(|r| r.status),
        Some(403),
        "{node_b:?}"
    );
    // An unknown node id with a valid credential: 403, not 404 (no existence leak).
    let url = format!(
        "{}/api/v1/agent/nodes/00000000-0000-4000-8000-000000000000/heartbeat",
        c.url(1)
    );
    assert_eq!(call("POST", &url, Some(&ca), Some(json!({}))).await.0, 403);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identity_lost_enrols_a_new_node_and_the_hostname_conflict_shows() {
    let mut c = Cluster::start(3).await;
    let t1 = c.new_token(600).await;
    let mut a = Agent::new(c.root(), "a", c.urls());
    a.start(Some(&t1));
    let (old_id, _) = a.wait_enrolled(None).await;
    a.stop();
    a.wipe();
    let t2 = c.new_token(600).await;
    a.start(Some(&t2));
    let (new_id, _) = a.wait_enrolled(None).await;
    assert_ne!(
        new_id, old_id,
        "a wiped identity cannot be told apart from new hardware"
    );
    let node = c.node(&new_id).await;
    assert_eq!(
        texts(&node.summary.hostname_conflicts),
        vec![old_id.clone()]
    );
    let node = c.node(&old_id).await;
    assert_eq!(
        texts(&node.summary.hostname_conflicts),
        vec![new_id.clone()]
    );
    // "Which enabled nodes claim hostname H": both, until the old one is decommissioned.
    let listed = c.nodes("?hostname=host-a&enabled=true").await;
    let mut ids: Vec<&str> = listed.iter().map(|n| n.node_id.as_str()).collect();
    ids.sort();
    let mut want = vec![old_id.as_str(), new_id.as_str()];
    want.sort();
    assert_eq!(ids, want);
    assert_eq!(c.nodes("?hostname=nobody").await.len(), 0);
    let (s, v) = c
        .admin("GET", "/api/v1/admin/hardware/nodes?colour=red", None)
        .await;
    assert_eq!(s, 400, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_identities_racing_on_one_token_mint_exactly_one_node() {
    let mut c = Cluster::start(3).await;
    let token = c.new_token(600).await;
    let mut agents: Vec<Agent> = (0..4)
        .map(|i| Agent::new(c.root(), &format!("r{i}"), c.urls()))
        .collect();
    for a in agents.iter_mut() {
        a.start(Some(&token));
    }
    let mut exits = vec![];
    let mut winners = vec![];
    for a in agents.iter_mut() {
        let done = wait_until("each racer enrols or exits", WAIT, || {
            let enrolled = a.node_id().is_some() && a.credential().is_some();
            let running = a.running();
            async move { (enrolled || !running).then_some(enrolled) }
        })
        .await;
        if done {
            winners.push(a.node_id().unwrap());
        } else {
            exits.push(a.wait_exit().await);
        }
    }
    assert_eq!(
        winners.len(),
        1,
        "exactly one identity won: {winners:?}, exits {exits:?}"
    );
    for (code, line) in &exits {
        assert_eq!(*code, 1, "{line}");
        assert!(
            line.contains("enrolment refused (401 token_already_claimed)"),
            "{line}"
        );
    }
    assert_eq!(c.nodes("").await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_and_cancelled_tokens_are_refused() {
    let mut c = Cluster::start(3).await;
    let issued: api::TokenIssued = c
        .admin_as(
            "POST",
            "/api/v1/admin/node-enrollments",
            Some(json!({"ttl_seconds": 1})),
            201,
        )
        .await;
    let short = issued.token;
    let eid = issued.enrollment_id.to_string();
    wait_until("the token to show expired", WAIT, || {
        let u = c.url(1);
        let eid = eid.clone();
        async move {
            let (s, v) = call(
                "GET",
                &format!("{u}/api/v1/admin/node-enrollments"),
                Some(ADMIN),
                None,
            )
            .await;
            if s != 200 {
                return None;
            }
            typed::<api::Enrollments>("enrollments", &v)
                .enrollments
                .iter()
                .any(|r| r.enrollment_id.as_str() == eid && r.state == "expired")
                .then_some(())
        }
    })
    .await;
    let mut a = Agent::new(c.root(), "a", c.urls());
    a.start(Some(&short));
    let (code, line) = a.wait_exit().await;
    assert_eq!(code, 1, "{line}");
    assert!(
        line.contains("401") && line.contains("token_expired"),
        "{line}"
    );

    let issued: api::TokenIssued = c
        .admin_as(
            "POST",
            "/api/v1/admin/node-enrollments",
            Some(json!({"ttl_seconds": 600})),
            201,
        )
        .await;
    let cancelled = issued.token;
    let eid = issued.enrollment_id;
    c.admin_as::<api::EnrollmentCancelled>(
        "DELETE",
        &format!("/api/v1/admin/node-enrollments/{eid}"),
        None,
        200,
    )
    .await;
    a.start(Some(&cancelled));
    let (code, line) = a.wait_exit().await;
    assert_eq!(code, 1, "{line}");
    assert!(
        line.contains("401") && line.contains("token_cancelled"),
        "{line}"
    );
    assert_eq!(c.nodes("").await.len(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_without_token_exits_with_a_reason() {
    let c = Cluster::start(1).await;
    let mut a = Agent::new(c.root(), "a", c.urls());
    a.start(None);
    let (code, line) = a.wait_exit().await;
    assert_eq!(code, 1, "{line}");
    assert!(line.contains("no enrolment token"), "{line}");
    // A bogus token is refused with a one-line reason.
    a.start(Some("mfet_not-a-token"));
    let (code, line) = a.wait_exit().await;
    assert_eq!(code, 1, "{line}");
    assert!(
        line.contains("enrolment refused (401 invalid_token)"),
        "{line}"
    );
}
