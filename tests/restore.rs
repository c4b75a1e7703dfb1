//! Backup and restore over real processes: a backup taken online from a follower, the whole
//! cluster lost (kill -9), a new cluster restored from the backup and the old members'
//! revocation journals on the same addresses, agents heartbeating throughout.

mod common;

use std::path::Path;
use std::path::PathBuf;

use common::*;
use modelforge_proto::api;

/// `modelforge restore ...` with the cluster's secret: (exit code, stdout + stderr).
fn restore(from: &Path, data_dir: &Path, journals: &[PathBuf]) -> (i32, String) {
    restore_with(CLUSTER_SECRET, from, data_dir, journals)
}

fn restore_with(secret: &str, from: &Path, data_dir: &Path, journals: &[PathBuf]) -> (i32, String) {
    let mut c = std::process::Command::new(server_bin());
    c.env("MODELFORGE_CLUSTER_SECRET", secret)
        .args(["restore", "--from"])
        .arg(from)
        .arg("--data-dir")
        .arg(data_dir);
    for j in journals {
        c.arg("--journal").arg(j);
    }
    let out = c.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

async fn take_backup(url: &str) -> Vec<u8> {
    let r = http()
        .get(format!("{url}/api/v1/admin/backup"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers().contains_key("x-modelforge-backup-index"));
    r.bytes().await.unwrap().to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_keeps_live_agents_and_every_revocation_made_after_the_backup() {
    let mut c = Cluster::start(3).await;
    // A keeps heartbeating through everything; B is revoked after the backup; the token for C
    // exists at backup time but is claimed after it.
    let t_a = c.new_token(600).await;
    let t_b = c.new_token(600).await;
    let t_c = c.new_token(600).await;
    let mut a = Agent::new(c.root(), "a", c.urls());
    a.start(Some(&t_a));
    let (a_id, a_cred) = a.wait_enrolled(None).await;
    let mut b = Agent::new(c.root(), "b", c.urls());
    b.start(Some(&t_b));
    let (b_id, b_cred) = b.wait_enrolled(None).await;
    b.stop();
    assert_eq!(c.heartbeat_all(&b_id, &b_cred).await, vec![200, 200, 200]);

    // The backup, online, from a follower.
    let leader = c.wait_leader().await;
    let follower = c.ids.iter().copied().find(|i| *i != leader).unwrap();
    let backup = take_backup(&c.url(follower)).await;
    assert_eq!(&backup[..8], b"MFBACKUP");
    for secret in [&t_a, &t_b, &t_c, &a_cred, &b_cred] {
        assert!(
            !backup.windows(secret.len()).any(|w| w == secret.as_bytes()),
            "a plaintext secret is in the backup"
        );
    }
    let file = c.root().join("cluster.mfbackup");
    std::fs::write(&file, &backup).unwrap();
    let audit = c.audit_events().await;
    assert!(
        audit.iter().any(|e| e.record.action == "cluster.backup"),
        "the backup is audited: {audit:?}"
    );

    // After the backup: B's credential revoked, C enrolled with a token that was pending.
    c.revoke(&b_id).await;
    let mut agent_c = Agent::new(c.root(), "c", c.urls());
    agent_c.start(Some(&t_c));
    let (c_id, c_cred) = agent_c.wait_enrolled(None).await;
    agent_c.stop();
    // Its first use spends the token.
    assert_eq!(c.heartbeat_all(&c_id, &c_cred).await[0], 200);

    // The whole cluster is lost; the journals beside the state survive.
    for id in c.ids.clone() {
        c.kill9(id);
    }
    let mut journals = vec![];
    for id in c.ids.clone() {
        let old = c.root().join(format!("old-m{id}"));
        std::fs::rename(c.data_dir(id), &old).unwrap();
        journals.push(old);
    }

    // What a member wrote is its user's alone.
    for old in &journals {
        assert_private(old);
    }
    // Another cluster's secret (or a forger's) does not restore the backup.
    let (code, out) = restore_with(
        "another-cluster-secret-0123456789",
        &file,
        &c.root().join("wrong-secret"),
        &[],
    );
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("backup MAC does not verify"), "{out}");
    assert!(!c.root().join("wrong-secret").join("restore").exists());

    // Without a journal, restore says loudly what it cannot re-apply.
    let (code, out) = restore(&file, &c.root().join("no-journal"), &[]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("NO REVOCATION JOURNAL"), "{out}");

    // Restore every member from the backup and every journal, on the same addresses.
    for id in c.ids.clone() {
        let (code, out) = restore(&file, &c.data_dir(id), &journals);
        assert_eq!(code, 0, "{out}");
        assert!(
            out.contains(&format!("credential {}", b_cred_id(&b_cred))),
            "{out}"
        );
        assert!(!out.contains("NO REVOCATION JOURNAL"), "{out}");
    }
    for id in c.ids.clone() {
        assert_private(&c.data_dir(id));
    }
    // A restored dir cannot be restored over.
    let (code, out) = restore(&file, &c.data_dir(1), &journals);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("already holds a member's state: restore into a fresh data dir"),
        "{out}"
    );
    for id in c.ids.clone() {
        c.start_member(id);
    }
    c.wait_ready().await;

    // A reconnects by itself: the agent process never stopped.
    assert!(a.running(), "agent A gave up during the restore");
    wait_until("agent A heartbeats the restored cluster", WAIT, || {
        let (urls, a_id) = (c.urls(), a_id.clone());
        async move {
            let (s, v) = call(
                "GET",
                &format!("{}/api/v1/admin/hardware/nodes/{a_id}", urls[0]),
                Some(ADMIN),
                None,
            )
            .await;
            (s == 200 && typed::<api::NodeDetail>("a node", &v).summary.status == "online")
                .then_some(())
        }
    })
    .await;
    assert_eq!(c.heartbeat_all(&a_id, &a_cred).await, vec![200, 200, 200]);
    // B's revocation came back from the journal; C's credential never existed here.
    assert_eq!(c.heartbeat_all(&b_id, &b_cred).await, vec![401, 401, 401]);
    assert_eq!(c.heartbeat_all(&c_id, &c_cred).await, vec![401, 401, 401]);
    let creds = c.credentials(&b_id).await;
    assert_eq!(creds.active, 0, "{creds:?}");
    // C's token was spent after the backup: nobody can claim it again.
    let mut thief = Agent::new(c.root(), "thief", c.urls());
    thief.start(Some(&t_c));
    let (code, line) = thief.wait_exit().await;
    assert_eq!(code, 1, "{line}");
    assert!(
        line.contains("enrolment refused (401 token_already_claimed)"),
        "{line}"
    );
    // Agent C recovers by the runbook: a new token.
    let t_c2 = c.new_token(600).await;
    agent_c.start(Some(&t_c2));
    let (_, c_cred2) = agent_c.wait_enrolled(Some(&c_cred)).await;
    assert_ne!(c_cred2, c_cred);
    c.wait_converged().await;

    // The restored cluster has its own id; the old cluster's peer credential is refused.
    let view = c.cluster_view(1).await.unwrap();
    let cluster_id = view.cluster_id.clone();
    assert!(cluster_id.starts_with("restored-"), "{view:?}");
    let old_peer = peer_header("", 1, "GET", "/internal/v1/status", b"");
    let new_peer = peer_header(&cluster_id, 1, "GET", "/internal/v1/status", b"");
    let status = |token: String| {
        let url = format!("{}/internal/v1/status", c.url(1));
        async move {
            member_client(Some(1))
                .get(url)
                .header("x-modelforge-peer", token)
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    assert_eq!(status(old_peer).await, 401);
    assert_eq!(status(new_peer).await, 200);

    // An old member started again on its old data dir cannot disturb the restored cluster.
    let term = view.term;
    let old_port = free_port();
    let mut args = vec![
        "serve".to_string(),
        "--node-id".into(),
        "2".into(),
        "--listen".into(),
        format!("127.0.0.1:{old_port}"),
        "--data-dir".into(),
        journals[1].display().to_string(),
        "--tls-ca".into(),
        harness_ca().cert.display().to_string(),
        "--tls-ca-key".into(),
        harness_ca().key.display().to_string(),
    ];
    for id in c.ids.clone() {
        args.push("--peer".into());
        args.push(format!("{id}={}", c.url(id)));
    }
    let mut old = KillOnDrop(
        std::process::Command::new(server_bin())
            .args(&args)
            .envs(MEMBER_ENV)
            .stderr(std::fs::File::create(c.root().join("old-m2.log")).unwrap())
            .spawn()
            .unwrap(),
    );
    // Wait until the old member has campaigned: asked the restored members for pre-votes
    // (refused: its peer credentials are the old cluster's).
    let old_log = c.root().join("old-m2.log");
    wait_until("the old member campaigns", WAIT, || async {
        let log = std::fs::read_to_string(&old_log).unwrap_or_default();
        log.contains("requesting pre-vote").then_some(())
    })
    .await;
    // (The agents keep the state moving, so compare terms, not digests.)
    let view = c.cluster_view(1).await.unwrap();
    assert_eq!(view.term, term, "the old member forced an election");
    let _ = old.0.kill();
    let _ = old.0.wait();
    assert_eq!(c.heartbeat_all(&a_id, &a_cred).await, vec![200, 200, 200]);
    c.wait_converged().await;
}

/// A child process killed when the test ends, also when it panics.
/// The public id inside a credential (`mfnc_<id>_<secret>_<crc>`).
fn b_cred_id(cred: &str) -> String {
    cred[5..37].to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_backup_is_refused_and_a_backup_needs_the_admin_token() {
    let c = Cluster::start(1).await;
    let r = http()
        .get(format!("{}/api/v1/admin/backup", c.url(1)))
        .bearer_auth("wrong-token-0123456789abcdef0123")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let mut backup = take_backup(&c.url(1)).await;
    let mid = backup.len() / 2;
    backup[mid] ^= 1;
    let file = c.root().join("bad.mfbackup");
    std::fs::write(&file, &backup).unwrap();
    let (code, out) = restore(&file, &c.root().join("r"), &[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("backup checksum mismatch: the file is truncated or corrupted"),
        "{out}"
    );
    assert!(!c.root().join("r").join("cluster.id").exists());
}

/// Every file under `dir` with its content, to show that a refused restore touched nothing.
fn files(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = vec![];
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(files(&p));
        } else {
            out.push((p.clone(), std::fs::read(&p).unwrap()));
        }
    }
    out.sort();
    out
}

/// ARCHITECTURE.md, "Backup, restore and the revocation journal": restore refuses a data dir
/// that holds a member's Raft state, or a base state from an earlier restore, with exit 1 and a
/// reason, and changes nothing in it (the member starts on it as before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_refuses_a_data_dir_that_already_holds_raft_state() {
    let mut c = Cluster::start(1).await;
    c.new_token(600).await;
    let file = c.root().join("good.mfbackup");
    std::fs::write(&file, take_backup(&c.url(1)).await).unwrap();
    let digest = c.wait_converged().await;
    c.kill9(1);

    let member = c.data_dir(1);
    assert!(member.join("raft").is_dir());
    let held = files(&member);
    let (code, out) = restore(&file, &member, &[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("already holds a member's state: restore into a fresh data dir")
            && out.contains(&member.display().to_string()),
        "{out}"
    );
    assert_eq!(
        files(&member),
        held,
        "a refused restore changed the data dir"
    );

    // A dir restored once holds a base state: restoring into it again is refused the same way.
    let fresh = c.root().join("restored");
    let (code, out) = restore(&file, &fresh, &[]);
    assert_eq!(code, 0, "{out}");
    let restored = files(&fresh);
    let (code, out) = restore(&file, &fresh, &[]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("already holds a member's state"), "{out}");
    assert_eq!(
        files(&fresh),
        restored,
        "a refused restore changed the data dir"
    );

    // The member whose dir was refused starts on it with its state intact.
    c.start_member(1);
    c.wait_ready().await;
    assert_eq!(c.wait_converged().await, digest);
}
