//! Bad input over real HTTP: each gets the contract's JSON error with the right status,
//! changes no replicated state, and every member keeps serving.

mod common;

use common::*;
use serde_json::json;

/// (method, path, headers, body, expected status, what it tries)
type Case = (
    &'static str,
    String,
    Vec<(&'static str, String)>,
    Vec<u8>,
    u16,
    &'static str,
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_clear_errors_and_change_nothing() {
    let mut c = Cluster::start_with(3, NO_TIMED_WRITES).await;
    let token = c.new_token(600).await;
    let mut a = Agent::new(c.root(), "a", c.urls());
    a.start(Some(&token));
    let (nid, cred) = a.wait_enrolled(None).await;
    // The agent's first heartbeat writes the credential's first use: wait for it, so that no
    // request of the agent's is still writing when the digest is taken.
    c.wait_first_use(&nid).await;
    a.stop();
    assert_eq!(c.heartbeat_all(&nid, &cred).await, vec![200, 200, 200]);
    c.wait_converged().await;
    let before = c.digest(1).await.unwrap();

    let leader = c.wait_leader().await;
    let follower = c.ids.iter().copied().find(|i| *i != leader).unwrap();
    let admin_h = format!("Bearer {ADMIN}");
    let cred_h = format!("Bearer {cred}");
    let huge = vec![b' '; 2 * 1024 * 1024];
    let mut huge_json = b"{\"note\":\"".to_vec();
    huge_json.extend(std::iter::repeat_n(b'x', 400 * 1024));
    huge_json.extend(b"\"}");
    let enroll_path = "/api/v1/agent/enroll";
    let hb = format!("/api/v1/agent/nodes/{nid}/heartbeat");
    let cases: Vec<Case> = vec![
        ("POST", "/api/v1/admin/node-enrollments".into(), vec![("authorization", admin_h.clone())], b"{nope".to_vec(), 400, "malformed JSON"),
        ("POST", "/api/v1/admin/node-enrollments".into(), vec![("authorization", admin_h.clone())], br#"{"ttl_seconds":"soon"}"#.to_vec(), 400, "wrongly typed ttl"),
        ("POST", "/api/v1/admin/node-enrollments".into(), vec![("authorization", admin_h.clone())], br#"{"ttl_seconds":-5}"#.to_vec(), 400, "negative ttl"),
        ("POST", "/api/v1/admin/node-enrollments".into(), vec![("authorization", admin_h.clone())], br#"{"ttl_seconds":0}"#.to_vec(), 400, "zero ttl"),
        ("POST", "/api/v1/admin/node-enrollments".into(), vec![("authorization", admin_h.clone())], br#"{"ttl_seconds":99999999999}"#.to_vec(), 400, "absurd ttl"),
        ("POST", "/api/v1/admin/node-enrollments".into(), vec![("authorization", admin_h.clone())], br#"[1,2,3]"#.to_vec(), 400, "array body"),
        ("POST", "/api/v1/admin/node-enrollments".into(), vec![("authorization", admin_h.clone())], huge_json.clone(), 413, "oversized body"),
        ("POST", "/api/v1/admin/node-enrollments".into(), vec![], b"{}".to_vec(), 401, "no auth"),
        ("POST", "/api/v1/admin/node-enrollments".into(), vec![("authorization", "Bearer wrong".into())], b"{}".to_vec(), 401, "wrong admin token"),
        ("POST", "/api/v1/admin/node-enrollments".into(), vec![("authorization", format!("Basic {ADMIN}"))], b"{}".to_vec(), 401, "wrong scheme"),
        ("POST", "/api/v1/admin/node-enrollments".into(), vec![("authorization", cred_h.clone())], b"{}".to_vec(), 401, "agent credential on an admin endpoint"),
        ("GET", "/api/v1/cluster".into(), vec![("authorization", cred_h.clone())], vec![], 401, "agent credential on cluster"),
        ("POST", enroll_path.into(), vec![], b"{}".to_vec(), 400, "enrol: missing fields"),
        ("POST", enroll_path.into(), vec![], huge.clone(), 413, "enrol: 2 MiB body"),
        ("POST", enroll_path.into(), vec![], serde_json::to_vec(&json!({"token": token, "hostname": "../../etc", "identity": {"public_key": "00", "signature": "00", "signed_at_ms": 0}, "inventory": {"accelerators": [], "storage_roots": []}})).unwrap(), 400, "enrol: absurd hostname"),
        ("POST", enroll_path.into(), vec![], serde_json::to_vec(&json!({"token": token, "hostname": "x".repeat(300), "identity": {"public_key": "00", "signature": "00", "signed_at_ms": 0}, "inventory": {"accelerators": [], "storage_roots": []}})).unwrap(), 400, "enrol: 300-byte hostname"),
        ("POST", enroll_path.into(), vec![], serde_json::to_vec(&json!({"token": token, "hostname": "ok", "identity": {"public_key": "00", "signature": "00", "signed_at_ms": 0}, "inventory": {"accelerators": []}})).unwrap(), 400, "enrol: inventory without storage_roots"),
        ("POST", enroll_path.into(), vec![], serde_json::to_vec(&json!({"token": "mfnc_wrongprefix", "hostname": "ok", "identity": {"public_key": "00", "signature": "00", "signed_at_ms": 0}, "inventory": {"accelerators": [], "storage_roots": []}})).unwrap(), 401, "enrol: token of the wrong prefix"),
        ("POST", enroll_path.into(), vec![], serde_json::to_vec(&json!({"token": token, "hostname": "ok", "identity": {"public_key": "00", "signature": "00", "signed_at_ms": 0}, "inventory": {"accelerators": [], "storage_roots": []}})).unwrap(), 401, "enrol: forged identity proof"),
        ("POST", hb.clone(), vec![], b"{}".to_vec(), 401, "heartbeat without credential"),
        ("POST", hb.clone(), vec![("authorization", "Bearer mfet_abc".into())], b"{}".to_vec(), 401, "heartbeat with a credential of the wrong prefix"),
        ("POST", hb.clone(), vec![("authorization", format!("Bearer {}", &cred[..cred.len() - 1]))], b"{}".to_vec(), 401, "heartbeat with a credential of the wrong length"),
        ("POST", hb.clone(), vec![("authorization", format!("Bearer {}{}", &cred[..cred.len() - 1], if cred.ends_with('0') { '1' } else { '0' }))], b"{}".to_vec(), 401, "heartbeat with a bad checksum"),
        ("POST", hb.clone(), vec![("authorization", cred_h.clone())], br#"{"accelerators": "lots"}"#.to_vec(), 400, "heartbeat with wrongly typed telemetry"),
        ("POST", hb.clone(), vec![("authorization", cred_h.clone())], huge.clone(), 413, "heartbeat with a 2 MiB body"),
        ("POST", enroll_path.into(), vec![], serde_json::to_vec(&json!({"token": token, "hostname": "ok\n", "identity": {"public_key": "00", "signature": "00", "signed_at_ms": 0}, "inventory": {"accelerators": [], "storage_roots": []}})).unwrap(), 400, "enrol: hostname with a newline"),
        ("POST", enroll_path.into(), vec![], serde_json::to_vec(&json!({"token": token, "hostname": "ok", "identity": {"public_key": "00", "signature": "00", "signed_at_ms": 0}, "inventory": {"accelerators": [{"uuid": "GPU-1", "name": "A100\u{1b}[2J\u{1b}[31m"}], "storage_roots": []}})).unwrap(), 400, "enrol: terminal escapes in an accelerator name"),
        ("PUT", format!("/api/v1/agent/nodes/{nid}/inventory"), vec![("authorization", cred_h.clone())], serde_json::to_vec(&json!({"accelerators": [{"uuid": "GPU-1\r\nforged log line", "name": "A100"}], "storage_roots": []})).unwrap(), 400, "inventory with a CRLF in a uuid"),
        ("POST", "/api/v1/agent/nodes/..%2F..%2Fetc/heartbeat".into(), vec![("authorization", cred_h.clone())], b"{}".to_vec(), 400, "node id with path characters"),
        ("GET", "/api/v1/admin/hardware/nodes/a%20b".into(), vec![("authorization", admin_h.clone())], vec![], 400, "node id with a space"),
        ("GET", "/api/v1/admin/hardware/nodes/00000000-0000-4000-8000-000000000000".into(), vec![("authorization", admin_h.clone())], vec![], 404, "unknown node"),
        ("DELETE", "/api/v1/admin/hardware/nodes/nope/credential".into(), vec![("authorization", admin_h.clone())], vec![], 404, "revoke an unknown node"),
        ("DELETE", "/api/v1/admin/node-enrollments/unknown".into(), vec![("authorization", admin_h.clone())], vec![], 404, "cancel an unknown token"),
        ("GET", "/api/v1/nothing-here".into(), vec![], vec![], 404, "unknown path"),
        ("PATCH", "/api/v1/admin/node-enrollments".into(), vec![("authorization", admin_h.clone())], vec![], 405, "wrong method"),
        ("POST", "/internal/v1/raft/append".into(), vec![("authorization", admin_h.clone())], vec![1, 2, 3], 401, "admin token on a raft rpc"),
        ("POST", "/internal/v1/raft/vote".into(), vec![("authorization", cred_h.clone())], vec![1, 2, 3], 401, "agent credential on a raft rpc"),
        ("POST", "/internal/v1/propose".into(), vec![("x-modelforge-peer", "guess".into())], vec![1, 2, 3], 401, "wrong peer secret"),
    ];
    for (method, path, headers, body, want, what) in &cases {
        for member in [leader, follower] {
            let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
            let (s, v) = raw(
                method,
                &format!("{}{path}", c.url(member)),
                &h,
                body.clone(),
            )
            .await;
            assert_eq!(s, *want, "{what} on member {member}: got {s} {v}");
            if *want != 405 || !v.is_null() {
                assert!(is_error_shape(&v), "{what}: not the error shape: {v}");
            }
            assert!(
                !v.to_string().contains(&token[38..]) && !v.to_string().contains(&cred[38..]),
                "{what}: an error echoed a secret"
            );
        }
    }
    // Every member still serves, and the replicated state did not move.
    for id in c.ids.clone() {
        assert_eq!(
            call("GET", &format!("{}/healthz", c.url(id)), None, None)
                .await
                .0,
            200
        );
    }
    let after = c.wait_converged().await;
    assert_eq!(after, before.0, "bad input changed replicated state");
    // The refusals that named the node are still shown on it (from memory, not the log).
    assert_eq!(c.node(&nid).await.last_refusal.map(|r| r.status), Some(401));
    assert_eq!(c.heartbeat_all(&nid, &cred).await, vec![200, 200, 200]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_reaches_a_log_a_snapshot_or_the_raft_log() {
    let mut c = Cluster::start_with(3, &["--snapshot-every", "5"]).await;
    let mut secrets = vec![];
    let mut agents = vec![];
    for i in 0..3 {
        let t = c.new_token(600).await;
        let mut a = Agent::new(c.root(), &format!("s{i}"), c.urls());
        a.start(Some(&t));
        let (_, cred) = a.wait_enrolled(None).await;
        secrets.push(t);
        secrets.push(cred);
        agents.push(a);
    }
    for _ in 0..10 {
        secrets.push(c.new_token(600).await);
    }
    // Named operators' tokens too (their secret part sits at the same offsets).
    for (i, role) in ["viewer", "operator", "admin"].iter().enumerate() {
        let (s, v) = call(
            "POST",
            &format!("{}/api/v1/admin/tokens", c.url(1)),
            Some(ADMIN),
            Some(json!({"name": format!("op{i}"), "role": role})),
        )
        .await;
        assert_eq!(s, 201, "{v}");
        secrets.push(v["token"].as_str().unwrap().to_string());
    }
    c.wait_converged().await;
    // Every member has written a snapshot to scan (snapshots are paced: wait for them).
    let ids = c.ids.clone();
    let this = &c;
    wait_until("every member has a snapshot", WAIT, || {
        let ids = ids.clone();
        async move {
            for id in ids {
                this.cluster_view(id).await?.snapshot_index?;
            }
            Some(())
        }
    })
    .await;
    for a in agents.iter_mut() {
        a.stop();
    }
    let mut bytes = Vec::new();
    for id in c.ids.clone() {
        bytes.extend(std::fs::read(c.root().join(format!("m{id}.log"))).unwrap());
        for e in walk(&c.data_dir(id)) {
            bytes.extend(std::fs::read(e).unwrap());
        }
    }
    assert!(bytes.len() > 10_000);
    let hay = String::from_utf8_lossy(&bytes);
    for s in &secrets {
        // The public id may appear; the secret part never.
        assert!(
            !hay.contains(&s[38..102]),
            "a secret reached a member's files or logs"
        );
    }
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = vec![];
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(walk(&p));
            } else {
                out.push(p);
            }
        }
    }
    out
}
