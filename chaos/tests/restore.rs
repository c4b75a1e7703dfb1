//! Chaos scenario: a control-plane restore in the middle of enrolment traffic.
//!
//! Agents enrol, spend their tokens with a first heartbeat and have some credentials revoked,
//! continuously; a backup is taken online mid-traffic; more traffic; then every member is
//! killed with -9 while requests are in flight, and a new cluster is restored on the same
//! addresses from the backup and the old members' revocation journals while the traffic goes
//! on. Checked against everything the old cluster acknowledged:
//! - no acknowledged revocation comes back (401 on every member);
//! - no token whose claim was acknowledged mints a second identity (401 for a new identity);
//! - credentials acknowledged before the backup and never touched by a revocation still work;
//! - the restored members converge to one state.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering;
use std::time::Duration;
use std::time::Instant;

use modelforge_chaos::answer::typed;
use modelforge_chaos::cluster::ADMIN;
use modelforge_chaos::cluster::CLUSTER_SECRET;
use modelforge_chaos::cluster::ChaosCluster;
use modelforge_proto::api;
use modelforge_proto::identity::IdentityKey;
use modelforge_proto::wire;
use serde_json::Value;
use serde_json::json;

#[derive(Default)]
struct History {
    /// (token, node id, credential, acknowledged at)
    enrolled: Vec<(String, String, String, Instant)>,
    /// credentials whose revocation was sent (acknowledged or not)
    revoke_sent: Vec<String>,
    /// credentials whose revocation was acknowledged
    revoked: Vec<String>,
}

async fn call(
    http: &reqwest::Client,
    method: reqwest::Method,
    url: String,
    bearer: &str,
    body: Value,
) -> (u16, Value) {
    match http
        .request(method, url)
        .bearer_auth(bearer)
        .timeout(Duration::from_secs(5))
        .json(&body)
        .send()
        .await
    {
        Ok(r) => {
            let s = r.status().as_u16();
            (s, r.json().await.unwrap_or(Value::Null))
        }
        Err(_) => (0, Value::Null),
    }
}

fn enrol_body(tok: &str, host: &str, key: &IdentityKey) -> Value {
    json!({"token": tok, "hostname": host,
        "identity": key.prove(&tok[5..37], host, modelforge_proto::now_ms(), None),
        "inventory": {"accelerators": [], "storage_roots": []}})
}

/// One agent's life: enrol (retrying the same claim across members and the restore), spend
/// the token with a heartbeat, and every third agent has its credential revoked.
async fn agent(
    http: reqwest::Client,
    urls: Vec<String>,
    i: usize,
    tok: String,
    history: Arc<Mutex<History>>,
    stop: Arc<AtomicBool>,
) {
    let key = IdentityKey::generate();
    let host = format!("chaos-{i}");
    let mut k = i;
    let (nid, cred) = loop {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let u = &urls[k % urls.len()];
        k += 1;
        let (s, v) = call(
            &http,
            reqwest::Method::POST,
            format!("{u}/api/v1/agent/enroll"),
            "-",
            enrol_body(&tok, &host, &key),
        )
        .await;
        match s {
            201 => {
                let enrolled: wire::EnrollResponse = typed("an enrolment", &v);
                let nid = enrolled.node_id.to_string();
                let cred = enrolled.credential;
                history.lock().unwrap().enrolled.push((
                    tok.clone(),
                    nid.clone(),
                    cred.clone(),
                    Instant::now(),
                ));
                break (nid, cred);
            }
            // Refused for good (e.g. the claim was spent by a journal fact after the restore).
            401 | 403 | 400 => return,
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    for _ in 0..40 {
        let u = &urls[k % urls.len()];
        k += 1;
        let (s, _) = call(
            &http,
            reqwest::Method::POST,
            format!("{u}/api/v1/agent/nodes/{nid}/heartbeat"),
            &cred,
            json!({}),
        )
        .await;
        if s == 200 || s == 401 || stop.load(Ordering::Relaxed) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if i.is_multiple_of(3) {
        history.lock().unwrap().revoke_sent.push(cred.clone());
        for _ in 0..40 {
            let u = &urls[k % urls.len()];
            k += 1;
            let (s, _) = call(
                &http,
                reqwest::Method::DELETE,
                format!("{u}/api/v1/admin/hardware/nodes/{nid}/credential"),
                ADMIN,
                json!({}),
            )
            .await;
            if s == 200 {
                history.lock().unwrap().revoked.push(cred.clone());
                break;
            }
            if stop.load(Ordering::Relaxed) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

async fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_mid_enrolment_brings_back_no_revoked_credential_and_no_spent_token() {
    let root =
        std::env::temp_dir().join(format!("mf-chaos-restore-{}", modelforge_proto::new_uuid()));
    std::fs::create_dir_all(&root).unwrap();
    let bin = modelforge_chaos::server_bin_for_tests();
    let mut c = ChaosCluster::start(&bin, &root, 3, &[])
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let http = c.http.clone();
    let urls = c.urls();

    // Tokens for the whole run, made up front (a token creation is not what is under test).
    let mut tokens = vec![];
    let deadline = Instant::now() + Duration::from_secs(60);
    while tokens.len() < 90 {
        assert!(Instant::now() < deadline, "could not create the tokens");
        let (s, v) = call(
            &http,
            reqwest::Method::POST,
            format!("{}/api/v1/admin/node-enrollments", urls[tokens.len() % 3]),
            ADMIN,
            json!({"ttl_seconds": 3600}),
        )
        .await;
        if s == 201 {
            tokens.push(typed::<api::TokenIssued>("a new token", &v).token);
        } else {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    // Traffic: agents start a few at a time, for the whole run.
    let history = Arc::new(Mutex::new(History::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let (h, u, hist, st) = (http.clone(), urls.clone(), history.clone(), stop.clone());
    let traffic = tokio::spawn(async move {
        let mut running = vec![];
        for (i, tok) in tokens.into_iter().enumerate() {
            if st.load(Ordering::Relaxed) {
                break;
            }
            running.push(tokio::spawn(agent(
                h.clone(),
                u.clone(),
                i,
                tok,
                hist.clone(),
                st.clone(),
            )));
            if i % 6 == 5 {
                tokio::time::sleep(Duration::from_millis(150)).await;
            }
        }
        for r in running {
            let _ = r.await;
        }
    });

    // A backup online, mid-traffic.
    wait_for("20 enrolments", || {
        history.lock().unwrap().enrolled.len() >= 20
    })
    .await;
    let backup_started = Instant::now();
    let backup = loop {
        assert!(
            backup_started.elapsed() < Duration::from_secs(60),
            "no backup within 60 s"
        );
        let r = http
            .get(format!("{}/api/v1/admin/backup", urls[1]))
            .bearer_auth(ADMIN)
            .timeout(Duration::from_secs(20))
            .send()
            .await;
        if let Ok(r) = r
            && r.status() == 200
        {
            break r.bytes().await.unwrap().to_vec();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let file = root.join("mid.mfbackup");
    std::fs::write(&file, &backup).unwrap();

    // More traffic, then the whole cluster dies with requests in flight.
    let at_backup = history.lock().unwrap().enrolled.len();
    wait_for("more enrolments after the backup", || {
        history.lock().unwrap().enrolled.len() >= at_backup + 15
    })
    .await;
    c.stop_all();
    let mut journals = vec![];
    for i in 1..=3 {
        let old = root.join(format!("old-m{i}"));
        std::fs::rename(root.join(format!("m{i}")), &old).unwrap();
        journals.push(old);
    }
    for i in 1..=3 {
        let mut cmd = std::process::Command::new(&bin);
        cmd.env("MODELFORGE_CLUSTER_SECRET", CLUSTER_SECRET)
            .args(["restore", "--from"])
            .arg(&file)
            .arg("--data-dir")
            .arg(root.join(format!("m{i}")));
        for j in &journals {
            cmd.arg("--journal").arg(j);
        }
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    for i in 0..3 {
        c.start_member(i).unwrap();
    }
    c.wait_leader(Duration::from_secs(60))
        .await
        .expect("the restored cluster elects a leader");

    // The traffic goes on against the restored cluster until every agent is done.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !traffic.is_finished() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.store(true, Ordering::Relaxed);
    traffic.await.unwrap();

    let h = std::mem::take(&mut *history.lock().unwrap());
    let heartbeat = |url: String, nid: String, cred: String| {
        let http = http.clone();
        async move {
            call(
                &http,
                reqwest::Method::POST,
                format!("{url}/api/v1/agent/nodes/{nid}/heartbeat"),
                &cred,
                json!({}),
            )
            .await
            .0
        }
    };
    let mut checked = (0, 0, 0);
    for (tok, nid, cred, at) in &h.enrolled {
        // No acknowledged revocation comes back, on any member.
        if h.revoked.contains(cred) {
            for u in &urls {
                let s = heartbeat(u.clone(), nid.clone(), cred.clone()).await;
                assert_eq!(
                    s, 401,
                    "a credential revoked before the restore got {s} from {u}"
                );
            }
            checked.0 += 1;
        } else if *at < backup_started && !h.revoke_sent.contains(cred) {
            // In the backup and never revoked: still works.
            let s = heartbeat(urls[0].clone(), nid.clone(), cred.clone()).await;
            assert_eq!(s, 200, "a credential from the backup was refused");
            checked.1 += 1;
        }
        // One token, one identity: a new identity cannot claim an acknowledged token.
        let key = IdentityKey::generate();
        let (s, v) = call(
            &http,
            reqwest::Method::POST,
            format!("{}/api/v1/agent/enroll", urls[2]),
            "-",
            enrol_body(tok, "thief", &key),
        )
        .await;
        assert_eq!(
            s, 401,
            "a claimed token minted a second identity after the restore: {v}"
        );
        checked.2 += 1;
    }
    assert!(
        checked.0 > 0 && checked.1 > 0,
        "the run checked too little: {checked:?}"
    );
    eprintln!(
        "restore mid-enrolment: {} enrolments acknowledged ({} before the backup), {} revocations \
         acknowledged; checked {} revoked, {} kept, {} tokens",
        h.enrolled.len(),
        h.enrolled.iter().filter(|e| e.3 < backup_started).count(),
        h.revoked.len(),
        checked.0,
        checked.1,
        checked.2
    );

    // The restored members converge.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut d = vec![];
        for i in 0..3 {
            d.push(c.digest(i).await);
        }
        if d.iter().all(|x| x.is_some() && *x == d[0]) {
            break;
        }
        assert!(Instant::now() < deadline, "restored members diverge: {d:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(c);
    let _ = std::fs::remove_dir_all(&root);
}
