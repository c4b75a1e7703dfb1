//! The operator's workflow over real processes: decommission (preview, stale preview, execute,
//! retry), a decommissioned identity trying to enrol, hostname conflicts, the `modelforge
//! admin` CLI (exit codes, failover, JSON), audit verification of live and tampered exports,
//! and the doctor's verdict for each runbook case.

mod common;

use common::*;
use modelforge_proto::api;
use serde_json::Value;
use serde_json::json;

/// The agent command `enrollments create` prints, run as printed (paths moved into the test's
/// scratch dir), enrols a node: the token reaches the agent through a 0600 file, never argv.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_printed_agent_command_enrols_with_the_token_in_a_file() {
    let c = Cluster::start(1).await;
    let urls = c.urls().join(",");
    let (code, out, err) = admin_cli(&urls, &["enrollments", "create", "--note", "printed"]).await;
    assert_eq!(code, 0, "{err}");
    let token = out
        .lines()
        .find_map(|l| l.strip_prefix("token (shown once): "))
        .expect("the token line")
        .to_string();
    let script: Vec<&str> = out
        .lines()
        .skip_while(|l| !l.starts_with("on the node, run:"))
        .skip(1)
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    assert_eq!(script.len(), 2, "{out}");
    let agent_line = script[1];
    assert!(agent_line.starts_with("modelforge-agent "), "{out}");
    assert!(!agent_line.contains(&token), "the token is in argv: {out}");
    assert!(agent_line.contains("--ca-cert-hash sha256:"), "{out}");
    let dir = c.root().join("printed");
    std::fs::create_dir_all(&dir).unwrap();
    let local = |l: &str| l.replace("/var/lib/", &format!("{}/", dir.display()));
    let sh = format!(
        "{}\nexec {} {} --gpu-source simulated:1 --hostname printed --heartbeat-interval 300ms",
        local(script[0]),
        agent_bin().display(),
        local(agent_line.strip_prefix("modelforge-agent ").unwrap())
    );
    let log = std::fs::File::create(dir.join("agent.log")).unwrap();
    let mut child = KillOnDrop(
        std::process::Command::new("sh")
            .args(["-c", &sh])
            .env("MODELFORGE_LOG", "info")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap(),
    );
    let token_file = dir.join("modelforge-agent.token");
    wait_until("the printed agent to enrol", WAIT, || async {
        std::fs::metadata(dir.join("modelforge-agent").join("credential"))
            .is_ok_and(|m| m.len() > 0)
            .then_some(())
    })
    .await;
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&token_file).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    let args = std::fs::read_to_string(format!("/proc/{}/cmdline", child.0.id())).unwrap();
    assert!(!args.contains(&token), "the token is in the agent's argv");
    child.0.kill().ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decommission_with_a_stale_preview_then_execute_and_the_identity_never_enrols_again() {
    let mut c = Cluster::start(3).await;
    let t1 = c.new_token(600).await;
    let mut a = Agent::new(c.root(), "a", c.urls());
    a.start(Some(&t1));
    let (old_id, _) = a.wait_enrolled(None).await;

    // The preview computes every effect and changes nothing.
    let path = format!("/api/v1/admin/hardware/nodes/{old_id}/decommission");
    let p1: api::DecommissionPreviewView = c
        .admin_as("POST", &format!("{path}/preview"), None, 200)
        .await;
    assert_eq!(p1.effects.credentials_to_revoke.len(), 1, "{p1:?}");
    assert!(p1.effects.hostname_conflicts_resolved.is_empty(), "{p1:?}");
    assert!(c.node(&old_id).await.summary.enabled);

    // The identity file is lost: the same hardware enrols as a new node under its hostname.
    let t2 = c.new_token(600).await;
    let mut b = Agent::new(c.root(), "b", c.urls());
    b.hostname = a.hostname.clone();
    b.start(Some(&t2));
    let (new_id, _) = b.wait_enrolled(None).await;
    assert_ne!(new_id, old_id);
    assert_eq!(
        texts(&c.node(&old_id).await.summary.hostname_conflicts),
        vec![new_id.clone()]
    );
    assert_eq!(
        texts(&c.node(&new_id).await.summary.hostname_conflicts),
        vec![old_id.clone()]
    );

    // The first preview is stale now: 409 with what changed, and nothing changed.
    let body = json!({"preview_id": p1.preview_id, "reason": "identity lost"});
    let (s, v) = c
        .admin("POST", &format!("{path}/execute"), Some(body))
        .await;
    assert_eq!(refused(s, &v), (409, "preview_stale"), "{v}");
    let msg = error_body(s, &v).error.message;
    assert!(
        msg.contains("hostname_conflicts_resolved") && msg.contains(&new_id),
        "{msg}"
    );
    assert!(c.node(&old_id).await.summary.enabled);
    assert_eq!(c.credentials(&old_id).await.active, 1);

    // A fresh preview, executed, with an Idempotency-Key: one replicated step.
    let p2: api::DecommissionPreviewView = c
        .admin_as("POST", &format!("{path}/preview"), None, 200)
        .await;
    assert_eq!(
        texts(&p2.effects.hostname_conflicts_resolved),
        vec![new_id.clone()]
    );
    let url = format!("{}{path}/execute", c.url(2));
    let headers = [
        ("authorization", format!("Bearer {ADMIN}")),
        ("idempotency-key", "decommission-once".to_string()),
        ("content-type", "application/json".to_string()),
    ];
    let hdrs: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let body = json!({"preview_id": p2.preview_id, "reason": "identity lost"}).to_string();
    let (s, first) = raw("POST", &url, &hdrs, body.clone().into_bytes()).await;
    assert_eq!(s, 200, "{first}");
    let done: api::Decommissioned = typed("decommission execute", &first);
    assert_eq!(done.status, "decommissioned");
    // The same request retried (on another member): the same answer, applied once.
    let url3 = format!("{}{path}/execute", c.url(3));
    let (s, again) = raw("POST", &url3, &hdrs, body.into_bytes()).await;
    assert_eq!((s, &again), (200, &first));
    // A new request: a clear 409.
    let body = json!({"preview_id": p2.preview_id, "reason": "again"});
    let (s, v) = c
        .admin("POST", &format!("{path}/execute"), Some(body))
        .await;
    assert_eq!(refused(s, &v), (409, "node_decommissioned"));
    let (s, v) = c.admin("POST", &format!("{path}/preview"), None).await;
    assert_eq!(refused(s, &v), (409, "node_decommissioned"));

    // Never deleted: the node stays, decommissioned, with its history; credentials revoked;
    // the conflict is cleared on both nodes and in the list.
    let node = c.node(&old_id).await;
    assert_eq!(node.summary.status, "decommissioned", "{node:?}");
    assert!(!node.summary.enabled, "{node:?}");
    assert!(node.history.iter().any(|e| e.kind == "decommissioned"));
    assert!(node.summary.hostname_conflicts.is_empty());
    assert!(c.node(&new_id).await.summary.hostname_conflicts.is_empty());
    let creds = c.credentials(&old_id).await;
    assert_eq!((creds.active, creds.revoked), (0, 1));
    let listed = c
        .nodes(&format!("?hostname={}&enabled=true", b.hostname))
        .await;
    let ids: Vec<&str> = listed.iter().map(|n| n.node_id.as_str()).collect();
    assert_eq!(ids, vec![new_id.as_str()]);

    // The old agent is told why and exits non-zero with one line.
    let (code, line) = a.wait_exit().await;
    assert_eq!(code, 1, "{line}");
    assert!(line.contains("decommissioned"), "{line}");
    // Restarted with a fresh token, it is told again (its credential names the decommission).
    let t3 = c.new_token(600).await;
    a.start(Some(&t3));
    let (code, line) = a.wait_exit().await;
    assert_eq!(code, 1, "{line}");
    assert!(line.contains("401 node_decommissioned"), "{line}");
    // Its identity can never enrol again: without the credential it tries, and is refused.
    std::fs::remove_file(a.state_dir.join("credential")).unwrap();
    a.start(Some(&t3));
    let (code, line) = a.wait_exit().await;
    assert_eq!(code, 1, "{line}");
    assert!(line.contains("403 identity_decommissioned"), "{line}");
    assert_eq!(c.nodes("").await.len(), 2);

    // Both steps are audited, the stale attempt included, and the chain verifies.
    let page = c.audit(&format!("?node_id={old_id}")).await;
    let seen: Vec<(String, String)> = page
        .events
        .iter()
        .filter(|e| e.record.action.starts_with("node.decommission"))
        .map(|e| (e.record.action.to_string(), e.record.result.to_string()))
        .collect();
    let want: Vec<(String, String)> = [
        ("node.decommission.preview", "ok"),
        ("node.decommission.execute", "preview_stale"),
        ("node.decommission.preview", "ok"),
        ("node.decommission.execute", "ok"),
        ("node.decommission.execute", "node_decommissioned"),
        ("node.decommission.preview", "node_decommissioned"),
    ]
    .iter()
    .map(|(a, r)| (a.to_string(), r.to_string()))
    .collect();
    assert_eq!(seen, want);
    assert!(page.chain_verified);
    c.wait_converged().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decommission_bad_input_gets_clear_errors_and_changes_nothing() {
    // No timed write may land between the digests however slowly this runs (the periodic
    // events write, status transitions and coalesced uses are put off), and the agent stops
    // once its own first use is replicated.
    let mut c = Cluster::start_with(1, NO_TIMED_WRITES).await;
    let (mut a, nid, _) = c.enrol_one("a").await;
    c.wait_first_use(&nid).await;
    a.stop();
    let digest = c.wait_converged().await;
    let base = format!("/api/v1/admin/hardware/nodes/{nid}/decommission");
    for (path, body, status, code) in [
        (
            format!("{base}/execute"),
            json!({"preview_id": "nope", "reason": "x"}),
            404,
            "preview_not_found",
        ),
        (
            format!("{base}/execute"),
            json!({"preview_id": "p"}),
            400,
            "invalid_body",
        ),
        (
            format!("{base}/execute"),
            json!({"preview_id": "p", "reason": ""}),
            400,
            "invalid_reason",
        ),
        (
            format!("{base}/execute"),
            json!({"preview_id": "../x", "reason": "r"}),
            400,
            "invalid_id",
        ),
        (
            format!("{base}/preview"),
            json!({"surprise": 1}),
            400,
            "invalid_body",
        ),
        (
            "/api/v1/admin/hardware/nodes/nobody/decommission/preview".to_string(),
            json!({}),
            404,
            "node_not_found",
        ),
    ] {
        let (s, v) = c.admin("POST", &path, Some(body)).await;
        assert_eq!(refused(s, &v), (status, code), "{path}: {v}");
        assert!(is_error_shape(&v));
    }
    let (s, _) = call("POST", &format!("{}{base}/preview", c.url(1)), None, None).await;
    assert_eq!(s, 401);
    // Let the agent's own writes (first use) settle, then compare: nothing above wrote.
    assert_eq!(c.wait_converged().await, digest);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_cli_covers_the_runbook_with_trustworthy_exit_codes_and_failover() {
    let c = Cluster::start(3).await;
    let dead = devkit::url(free_port());
    // Failover: a dead member first, then the real ones.
    let urls = format!("{dead},{}", c.urls().join(","));
    let (code, token, err) =
        admin_cli(&urls, &["enrollments", "create", "--note", "cli", "-q"]).await;
    assert_eq!(code, 0, "{err}");
    let token = token.trim().to_string();
    assert!(token.starts_with("mfet_"));
    let (code, v) = admin_json(&urls, &["enrollments", "list"]).await;
    assert_eq!(code, 0);
    let list: api::Enrollments = typed("enrollments list", &v);
    assert_eq!(list.enrollments[0].state, "pending", "{v}");
    assert!(!v.to_string().contains(&token));
    let mut a = Agent::new(c.root(), "a", c.urls());
    a.start(Some(&token));
    let (nid, _) = a.wait_enrolled(None).await;

    let (code, out, _) = admin_cli(&urls, &["nodes", "list"]).await;
    assert_eq!(code, 0);
    assert!(out.starts_with("NODE") && out.contains(&nid), "{out}");
    let (code, out, _) = admin_cli(
        &urls,
        &[
            "nodes",
            "list",
            "--hostname",
            "host-a",
            "--enabled",
            "true",
            "-q",
        ],
    )
    .await;
    assert_eq!((code, out.trim()), (0, nid.as_str()));
    let (code, v) = admin_json(&urls, &["nodes", "show", &nid]).await;
    assert_eq!(code, 0, "{v}");
    let shown: api::NodeDetail = typed("nodes show", &v);
    assert_eq!(shown.summary.node_id.as_str(), nid);
    let (code, v) = admin_json(&urls, &["nodes", "credentials", &nid]).await;
    assert_eq!(code, 0, "{v}");
    assert_eq!(typed::<api::Credentials>("nodes credentials", &v).active, 1);
    let (code, v) = admin_json(&urls, &["cluster"]).await;
    assert_eq!(code, 0);
    assert_eq!(typed::<api::ClusterView>("cluster", &v).members.len(), 3);

    // Refused by the server: exit 1, one line on stderr with the server's code.
    let (code, out, err) = admin_cli(&urls, &["nodes", "show", "no-such-node"]).await;
    assert_eq!(code, 1);
    assert!(out.is_empty());
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("node_not_found"), "{err}");
    // Usage: exit 2, before any request.
    let (code, _, err) = admin_cli(&urls, &["nodes", "show", "../etc"]).await;
    assert_eq!(code, 2, "{err}");
    let (code, _, _) = admin_cli(&urls, &["nodes", "frobnicate"]).await;
    assert_eq!(code, 2);
    // Nothing reachable: exit 3.
    let (code, _, err) = admin_cli(&dead, &["nodes", "list", "--timeout", "1s"]).await;
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("no member answered"), "{err}");
    // A wrong admin token is refused (exit 1 with unauthenticated).
    let out = tokio::process::Command::new(server_bin())
        .args(["admin", "nodes", "list", "--server", &c.url(1)])
        .env("MODELFORGE_CACERT", &harness_ca().cert)
        .env("MODELFORGE_ADMIN_TOKEN", "wrong-token-wrong-token")
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unauthenticated"));

    // Cancel a token; revoke a credential.
    let (_, t2, _) = admin_cli(&urls, &["enrollments", "create", "-q"]).await;
    let (_, v) = admin_json(&urls, &["enrollments", "list"]).await;
    let eid = typed::<api::Enrollments>("enrollments list", &v)
        .enrollments
        .iter()
        .find(|r| r.state == "pending")
        .unwrap()
        .enrollment_id
        .to_string();
    assert!(t2.contains(&eid));
    let (code, _, err) = admin_cli(
        &urls,
        &["enrollments", "cancel", &eid, "--reason", "not needed"],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    let (code, out, _) = admin_cli(
        &urls,
        &[
            "nodes",
            "revoke-credential",
            &nid,
            "--reason",
            "believed stolen",
            "-q",
        ],
    )
    .await;
    assert_eq!(code, 0);
    assert_eq!(out.lines().count(), 1, "one credential revoked: {out}");

    // Decommission: execute without --yes and without a terminal is a usage error.
    let (code, pid, _) = admin_cli(&urls, &["decommission", "preview", &nid, "-q"]).await;
    assert_eq!(code, 0);
    let pid = pid.trim().to_string();
    let execute = [
        "decommission",
        "execute",
        &nid,
        "--preview-id",
        &pid,
        "--reason",
        "retired",
        "--yes",
    ];
    let without_yes = &execute[..execute.len() - 1];
    let (code, _, err) = admin_cli(&urls, without_yes).await;
    assert_eq!(code, 2, "{err}");
    let (code, v) = admin_json(&urls, &execute).await;
    assert_eq!(code, 0, "{v}");
    let done: api::Decommissioned = typed("decommission execute", &v);
    assert_eq!(done.status, "decommissioned", "{v}");
    // Retried by a script (same preview, so the same key): the first answer.
    let (code, again) = admin_json(&urls, &execute).await;
    assert_eq!((code, &again), (0, &v));

    // Audit: list by node, export, verify live and from the file.
    let (code, v) = admin_json(&urls, &["audit", "list", "--node-id", &nid]).await;
    assert_eq!(code, 0);
    let page: api::AuditPage = typed("audit list --node-id", &v);
    // Filtered by time: an offset time is passed intact; nothing happened in the future.
    let (code, all) = admin_json(
        &urls,
        &["audit", "list", "--since", "2000-01-01T01:00:00+01:00"],
    )
    .await;
    assert_eq!(code, 0, "{all}");
    let all: api::AuditPage = typed("audit list --since 2000", &all);
    assert!(all.events.len() > page.events.len());
    let (code, none) =
        admin_json(&urls, &["audit", "list", "--since", "2999-01-01T00:00:00Z"]).await;
    assert_eq!(code, 0, "{none}");
    let none: api::AuditPage = typed("audit list --since 2999", &none);
    assert_eq!(none.events.len(), 0);
    let (code, _, _) = admin_cli(&urls, &["audit", "list", "--since", "yesterday"]).await;
    assert_eq!(code, 2);
    assert!(page.events.iter().all(|e| e.record.target == nid));
    let (code, out, _) = admin_cli(&urls, &["audit", "verify"]).await;
    assert_eq!(code, 0, "{out}");
    let (code, head, _) = admin_cli(&urls, &["audit", "verify", "-q"]).await;
    assert_eq!(code, 0);
    let head = head.trim().to_string();
    let export = c.root().join("audit.json");
    let (code, _, err) = admin_cli(
        &urls,
        &["audit", "export", "--out", export.to_str().unwrap()],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = admin_cli(
        &dead,
        &[
            "audit",
            "verify",
            "--file",
            export.to_str().unwrap(),
            "--expect-head",
            &head,
        ],
    )
    .await;
    assert_eq!(code, 0, "a file verifies offline: {err}");
    let text = std::fs::read_to_string(&export).unwrap();
    assert!(!text.contains(&token), "no token in the audit export");

    // Tampering with the export is detected: an edited event, a dropped event, a cut tail. The
    // export is a file handed to the verifier: it is edited as raw JSON, by key, on purpose.
    let doc: Value = serde_json::from_str(&text).unwrap();
    let write = |name: &str, d: &Value| {
        let p = c.root().join(name);
        std::fs::write(&p, d.to_string()).unwrap();
        p.display().to_string()
    };
    let mut edited = doc.clone();
    edited["events"][1]["result"] = json!("ok-but-edited");
    let mut dropped = doc.clone();
    dropped["events"].as_array_mut().unwrap().remove(2);
    let mut cut = doc.clone();
    cut["events"].as_array_mut().unwrap().pop();
    for (name, d, flags, want) in [
        ("edited.json", &edited, vec![], "edited"),
        ("dropped.json", &dropped, vec![], "dropped"),
        (
            "cut.json",
            &cut,
            vec!["--expect-head", head.as_str()],
            "cut from the end",
        ),
    ] {
        let p = write(name, d);
        let mut args = vec!["audit", "verify", "--file", p.as_str()];
        args.extend(flags);
        let (code, _, err) = admin_cli(&dead, &args).await;
        assert_eq!(code, 5, "{name}: {err}");
        assert!(err.contains(want), "{name}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_doctor_names_each_runbook_case() {
    // Agents heartbeat every 300 ms: 3 s leaves a loaded machine ten beats before "silent".
    let mut c = Cluster::start_with(3, &["--stale-after", "3s", "--offline-after", "6s"]).await;
    let urls = c.urls().join(",");
    let ta = c.new_token(600).await;
    let tb = c.new_token(600).await;
    let mut a = Agent::new(c.root(), "a", c.urls());
    let mut b = Agent::new(c.root(), "b", c.urls());
    a.start(Some(&ta));
    b.start(Some(&tb));
    let (aid, acred) = a.wait_enrolled(None).await;
    let (bid, bcred) = b.wait_enrolled(None).await;

    // The doctor's `--output json` report is the CLI's own document (built in
    // src/admin_cli/doctor.rs), not an API answer, and proto has no type for it: read by key.
    // Healthy: exit 0 (waiting for the first heartbeats to be seen).
    let (code, v) = admin_json(&urls, &["doctor", &aid, "--wait", "20s"]).await;
    assert_eq!((code, v["verdict"].as_str()), (0, Some("healthy")), "{v}");
    assert_eq!(v["checks"]["credentials_active"], 1);
    assert_eq!(v["checks"]["accelerators"], 2);

    // A stranger cannot make a healthy node look revoked: requests naming a's real credential
    // id with a wrong secret, or no credential at all, are refused and shown, and the doctor
    // still says healthy (its verdict on revocation rests on the replicated credentials).
    let url = format!("{}/api/v1/agent/nodes/{aid}/heartbeat", c.url(1));
    let forged = {
        let body = format!("{}_{}", &acred[..37], "0".repeat(64));
        format!("{body}_{:08x}", crc32fast::hash(body.as_bytes()))
    };
    assert_eq!(
        call("POST", &url, Some(&forged), Some(json!({}))).await.0,
        401
    );
    assert_eq!(call("POST", &url, None, Some(json!({}))).await.0, 401);
    let (code, v) = admin_json(&urls, &["doctor", &aid]).await;
    assert_eq!((code, v["verdict"].as_str()), (0, Some("healthy")), "{v}");
    let refusal = &v["checks"]["last_refusal"];
    assert_eq!(refusal["status"], 401, "{v}");
    assert_eq!(refusal["credential_of_this_node"], false, "{v}");

    // Credential for another node (403): a's agent stops; b's credential is sent for a, and
    // once a is no longer online the doctor names the case.
    a.stop();
    assert_eq!(
        call("POST", &url, Some(&bcred), Some(json!({}))).await.0,
        403
    );
    let v = wait_until("the doctor to name another node's credential", WAIT, || {
        let urls = urls.clone();
        let aid = aid.clone();
        async move {
            let (code, v) = admin_json(&urls, &["doctor", &aid]).await;
            (code == 11).then_some(v)
        }
    })
    .await;
    assert_eq!(v["verdict"], "credential_for_other_node");
    assert_eq!(v["checks"]["last_refusal"]["status"], 403);
    assert_eq!(
        v["checks"]["last_refusal"]["code"],
        "credential_for_other_node"
    );

    // Agent silent: a restarts and heartbeats (healthy again), then stops and goes quiet.
    a.start(None);
    let (code, _) = admin_json(&urls, &["doctor", &aid, "--wait", "20s"]).await;
    assert_eq!(code, 0);
    a.stop();
    let v = wait_until("the doctor to call a silent agent", WAIT, || {
        let urls = urls.clone();
        let aid = aid.clone();
        async move {
            let (code, v) = admin_json(&urls, &["doctor", &aid]).await;
            (code == 12).then_some(v)
        }
    })
    .await;
    assert_eq!(v["verdict"], "agent_silent");
    assert!(v["commands"].to_string().contains("modelforge-agent"));

    // Credential revoked (401): b's credential is revoked while its agent runs.
    let (code, _, _) = admin_cli(
        &urls,
        &["nodes", "revoke-credential", &bid, "--reason", "test"],
    )
    .await;
    assert_eq!(code, 0);
    let (code, line) = b.wait_exit().await;
    assert_eq!(code, 1, "{line}");
    assert!(
        line.contains("credential refused (401 credential_revoked)"),
        "{line}"
    );
    let (code, out, _) = admin_cli(&urls, &["doctor", &bid]).await;
    assert_eq!(code, 10, "{out}");
    assert!(out.contains("verdict: credential_revoked"), "{out}");
    assert!(out.contains("requests answered:    401"), "{out}");
    assert!(
        out.contains(&format!("modelforge admin doctor {bid} --wait 60s")),
        "commands carry the real node id: {out}"
    );
}

/// `cmd` run by a shell on a pseudo-terminal (`script`) with `answer` typed into it: its exit
/// status and what the terminal showed.
async fn on_terminal(cmd: &str, answer: &str) -> (i32, String) {
    let mut child = tokio::process::Command::new("/usr/bin/script")
        .args(["-qec", cmd, "/dev/null"])
        .env("MODELFORGE_ADMIN_TOKEN", ADMIN)
        .env("MODELFORGE_CACERT", &harness_ca().cert)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use tokio::io::AsyncWriteExt;
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(answer.as_bytes()).await.unwrap();
    drop(stdin);
    let out = child.wait_with_output().await.unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decommission_execute_asks_on_a_terminal() {
    // A missing prerequisite fails the test (CI installs it), never skips it silently.
    assert!(
        std::path::Path::new("/usr/bin/script").exists(),
        "this test needs `script` for a pseudo-terminal: apt-get install bsdutils"
    );
    let mut c = Cluster::start(1).await;
    let (_a, nid, _) = c.enrol_one("a").await;
    let url = c.url(1);
    let (_, pid, _) = admin_cli(&url, &["decommission", "preview", &nid, "-q"]).await;
    let pid = pid.trim().to_string();
    let cmd = format!(
        "{} admin decommission execute {nid} --preview-id {pid} --reason retired --server {url}",
        server_bin().display()
    );
    let on_terminal = |answer: &'static str| on_terminal(&cmd, answer);
    let (code, out) = on_terminal("no\n").await;
    assert_eq!(code, 4, "{out}");
    assert!(out.contains("Type 'yes'"), "{out}");
    assert!(
        c.node(&nid).await.summary.enabled,
        "declined: nothing changed"
    );
    let (code, out) = on_terminal("yes\n").await;
    assert_eq!(code, 0, "{out}");
    assert_eq!(c.node(&nid).await.summary.status, "decommissioned");
}

/// Issue 16 item 4 over real processes: with retention shortened to 2 s, audit events leave
/// the replicated state for every member's archive file; a member that loses its archive and
/// restarts from a snapshot (its state's base ahead of its empty file) refills it from the
/// others, checked against the replicated head, to the same bytes; and the trail served and
/// verified by the CLI is still whole from seq 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_audit_events_move_to_every_members_archive_and_a_lost_archive_is_refilled() {
    let mut c = Cluster::unstarted(3, &["--snapshot-every", "20"]);
    c.env
        .push((modelforge::state::TEST_RETENTION_ENV.into(), "2000".into()));
    c.start_all().await;
    let leader = c.wait_leader().await;
    let follower = (1..=3).find(|i| *i != leader).unwrap();
    // Audited writes until events were archived and the follower took a snapshot after that.
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut archived_at = None;
    let archived = loop {
        assert!(tokio::time::Instant::now() < deadline, "nothing archived");
        c.new_token(60).await;
        let v = c.cluster_view(follower).await.unwrap();
        let a = &v.audit_archive;
        assert!(
            a.complete,
            "a member that applied every entry holds its archive: {a:?}"
        );
        if a.archived >= 10 && archived_at.is_none() {
            archived_at = Some(v.applied_index);
        }
        if archived_at.is_some_and(|at| v.snapshot_index.unwrap_or(0) > at) {
            break a.archived;
        }
    };
    // Every member archived the same events: identical files as far as the shortest goes.
    let dirs: Vec<_> = (1..=3).map(|id| c.data_dir(id)).collect();
    let lines = |id: u64| {
        let path = dirs[id as usize - 1].join(modelforge::archive::FILE);
        let text = std::fs::read_to_string(path).unwrap();
        text.lines().map(str::to_string).collect::<Vec<_>>()
    };
    let leaders = lines(leader);
    assert!(leaders.len() as u64 >= archived);
    assert_eq!(lines(follower)[..], leaders[..lines(follower).len()]);

    // The follower's archive is lost; it restarts from its snapshot, which is past the prune.
    c.kill9(follower);
    std::fs::remove_file(dirs[follower as usize - 1].join(modelforge::archive::FILE)).unwrap();
    c.start_member(follower);
    let refilled = wait_until("the follower refills its archive", WAIT, || {
        let view = c.cluster_view(follower);
        async move {
            let a = view.await?.audit_archive;
            (a.complete && a.on_disk >= archived).then_some(a.on_disk)
        }
    })
    .await;
    assert!(
        c.log(follower).contains("audit archive: hole filled"),
        "the archive was not refilled from another member"
    );
    let leaders = lines(leader);
    assert_eq!(lines(follower)[..], leaders[..refilled as usize]);

    // The trail served is whole from seq 1, and verifies here. Every page counts: how many
    // events the loop above wrote depends on when the follower snapshotted, and past 100 the
    // first page (the default limit) is not the whole trail.
    let page = c.audit("").await;
    assert!(page.chain_verified);
    assert_eq!(page.events[0].record.seq, 1);
    let total = c.audit_events().await.len() as u64;
    let v = c.cluster_view(leader).await.unwrap().audit_archive;
    assert!(
        v.archived >= archived && total >= v.archived + v.live,
        "{v:?}"
    );
    let (code, out) = admin_json(&c.urls().join(","), &["audit", "verify"]).await;
    assert_eq!(code, 0, "{out}");
    assert_eq!(out["verified"], true, "{out}");
    assert!(out["events"].as_u64().unwrap() >= total, "{out}");
}

/// Issue 17 item 9: the CLI's outputs and its confirmation. `-o table` shows ages, `-o wide`
/// adds columns (GPU models, full times), `-o yaml` is the answer as YAML; `--since` takes a
/// duration back from now; no progress bar reaches a stderr that is not a terminal; revoking
/// asks on a terminal (declined: nothing revoked) and not in a script.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_prints_table_wide_and_yaml_and_asks_before_revoking() {
    assert!(
        std::path::Path::new("/usr/bin/script").exists(),
        "this test needs `script` for a pseudo-terminal: apt-get install bsdutils"
    );
    let mut c = Cluster::start(1).await;
    let (_a, nid, _) = c.enrol_one("cli-host").await;
    let url = c.url(1);
    // The agent's first heartbeat lands right after enrolment.
    let urls = c.urls();
    wait_until("a heartbeat", WAIT, || {
        let (urls, nid) = (urls.clone(), nid.clone());
        async move {
            node_view(&urls, &nid)
                .await?
                .summary
                .last_heartbeat_at
                .map(|_| ())
        }
    })
    .await;

    let (code, table, err) = admin_cli(&url, &["nodes", "list"]).await;
    assert_eq!(code, 0, "{err}");
    let header = table.lines().next().unwrap();
    assert!(
        header.starts_with("NODE  ") && !header.contains("GPU MODELS"),
        "{table}"
    );
    assert!(table.contains(" ago"), "an age, not a time: {table}");
    let (code, wide, err) = admin_cli(&url, &["nodes", "list", "-o", "wide"]).await;
    assert_eq!(code, 0, "{err}");
    let header = wide.lines().next().unwrap();
    assert!(
        header.contains("GPU MODELS") && header.contains("ENROLLED"),
        "{wide}"
    );
    assert!(
        wide.contains("(simulated)") && wide.contains(&nid),
        "{wide}"
    );
    assert!(!wide.contains(" ago"), "full times: {wide}");
    let (code, yaml, err) = admin_cli(&url, &["nodes", "list", "-o", "yaml"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(yaml.contains(&format!("node_id: {nid}")), "{yaml}");
    assert!(yaml.contains("hostname: host-cli-host"), "{yaml}");
    assert!(
        serde_json::from_str::<Value>(&yaml).is_err(),
        "YAML, not JSON: {yaml}"
    );

    // `--since 1h`: the node's enrolment, minutes old, is in it; `--since` in the future: none.
    let (code, v) = admin_json(&url, &["audit", "list", "--since", "1h"]).await;
    assert_eq!(code, 0, "{v}");
    assert!(!v["events"].as_array().unwrap().is_empty(), "{v}");
    let (code, _, err) = admin_cli(&url, &["audit", "list", "--since", "soon"]).await;
    assert_eq!(code, 2, "{err}");

    // No progress bar on a stderr that is not a terminal.
    let file = c.root().join("cli.backup");
    let (code, _, err) = admin_cli(&url, &["backup", "--out", file.to_str().unwrap()]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        !err.contains('\r') && !err.contains("downloading"),
        "{err:?}"
    );

    // Revoke on a terminal: asked; "no" changes nothing (exit 4).
    let cmd = format!(
        "{} admin nodes revoke-credential {nid} --reason 'lost laptop' --server {url}",
        server_bin().display()
    );
    let (code, text) = on_terminal(&cmd, "no\n").await;
    assert_eq!(code, 4, "{text}");
    assert!(
        text.contains("Revoke every active credential") && text.contains("lost laptop"),
        "{text}"
    );
    assert_eq!(
        c.node(&nid).await.summary.active_credentials,
        1,
        "declined: nothing revoked"
    );
    // In a script (stdin not a terminal) it goes on.
    let (code, out, err) = admin_cli(
        &url,
        &[
            "nodes",
            "revoke-credential",
            &nid,
            "--reason",
            "lost laptop",
            "-q",
        ],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.lines().count(), 1, "{out}");
    assert_eq!(c.node(&nid).await.summary.active_credentials, 0);
}
