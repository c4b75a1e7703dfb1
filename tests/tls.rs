//! Transport security over real processes: the default member makes its CA and serves only
//! HTTPS, `--insecure-http` serves plain HTTP and says so, agents pin the cluster CA before
//! sending a token, and a member of a cluster without a shared CA refuses to start.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use common::*;
use modelforge_proto::api;
use serde_json::json;

/// A client trusting only `ca_pem`.
fn trusting(ca_pem: &str) -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(10))
        .tls_backend_preconfigured(modelforge_client::tls::client_config(ca_pem, None).unwrap())
        .build()
        .unwrap()
}

/// `serve` on a free port in `dir` with `flags`: the process and its port.
fn serve(root: &std::path::Path, name: &str, flags: &[&str]) -> (devkit::Proc, u16) {
    let port = free_port();
    let mut args = vec![
        "serve".to_string(),
        "--listen".into(),
        format!("127.0.0.1:{port}"),
        "--data-dir".into(),
        root.join(name).display().to_string(),
    ];
    args.extend(flags.iter().map(|f| f.to_string()));
    let log = root.join(format!("{name}.log"));
    (spawn(&server_bin(), &args, &log, &MEMBER_ENV), port)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_with_no_tls_flags_makes_its_ca_and_serves_only_https() {
    let scratch = Scratch::new();
    let (_m, port) = serve(scratch.path(), "m", &[]);
    let tls = scratch.path().join("m/tls");
    let ca_pem = wait_until("the member writes its CA", WAIT, || async {
        std::fs::read_to_string(tls.join("ca.pem")).ok()
    })
    .await;
    let http = trusting(&ca_pem);
    let url = format!("https://127.0.0.1:{port}");
    wait_until("the member serves HTTPS", WAIT, || async {
        let r = http.get(format!("{url}/readyz")).send().await.ok()?;
        r.status().is_success().then_some(())
    })
    .await;
    for key in ["ca.key", "member.key"] {
        let mode = std::fs::metadata(tls.join(key))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{key}");
    }
    // The CA is served as PEM, and the token answer pins exactly it.
    let served = http
        .get(format!("{url}/api/v1/cluster/ca"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(served, ca_pem);
    let issued: api::TokenIssued = http
        .post(format!("{url}/api/v1/admin/node-enrollments"))
        .bearer_auth(ADMIN)
        .json(&json!({}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let pin = issued.ca_cert_hash.expect("the answer pins the CA");
    assert_eq!(pin, modelforge_client::tls::pem_cert_hash(&ca_pem).unwrap());
    assert_eq!(pin.len(), "sha256:".len() + 64);
    // Plain HTTP gets no answer, and neither does a client trusting another CA.
    modelforge_client::tls::install_provider();
    let plain = reqwest::Client::builder().no_proxy().build().unwrap();
    let r = plain
        .get(format!("http://127.0.0.1:{port}/healthz"))
        .send()
        .await;
    assert!(r.is_err() || !r.unwrap().status().is_success());
    let other = trusting(&harness_ca().pem);
    assert!(other.get(format!("{url}/healthz")).send().await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn insecure_http_serves_plain_http_and_warns() {
    let scratch = Scratch::new();
    let (_m, port) = serve(scratch.path(), "m", &["--insecure-http"]);
    let url = format!("http://127.0.0.1:{port}");
    wait_until("the member serves plain HTTP", WAIT, || async {
        let (s, _) = call("GET", &format!("{url}/readyz"), None, None).await;
        (s == 200).then_some(())
    })
    .await;
    let (s, v) = call("GET", &format!("{url}/api/v1/cluster/ca"), None, None).await;
    assert_eq!(refused(s, &v), (404, "not_found"));
    let log = std::fs::read_to_string(scratch.path().join("m.log")).unwrap();
    assert!(log.contains("--insecure-http: serving plain HTTP"), "{log}");
    assert!(!scratch.path().join("m/tls").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_pins_the_ca_by_hash_and_sends_no_token_to_another_cluster() {
    let mut c = Cluster::start(1).await;
    let issued: api::TokenIssued = c
        .admin_as(
            "POST",
            "/api/v1/admin/node-enrollments",
            Some(json!({})),
            201,
        )
        .await;
    let pin = issued.ca_cert_hash.clone().expect("a pin");
    let wrong = format!("sha256:{}", "0".repeat(64));
    let mut a = Agent::new(c.root(), "wrong", c.urls()).trust(&["--ca-cert-hash", &wrong]);
    a.start(Some(&issued.token));
    let (code, line) = a.wait_exit().await;
    assert_ne!(code, 0);
    assert!(line.contains("the token was not sent"), "{line}");
    assert!(!a.state_dir.join("credential").exists());
    // Nothing reached the cluster: the token is still pending and no enrolment was audited.
    let list: api::Enrollments = c.read_as("/api/v1/admin/node-enrollments").await;
    let t = list
        .enrollments
        .iter()
        .find(|e| e.enrollment_id == issued.enrollment_id)
        .unwrap();
    assert_eq!(t.state, "pending");
    assert!(
        !c.audit_events()
            .await
            .iter()
            .any(|e| e.record.action == "node.enroll")
    );
    // The right pin enrols, and the agent keeps the CA it verified for later runs (this one
    // takes its token in argv, the other way the contract allows).
    let mut a = Agent::new(c.root(), "right", c.urls()).trust(&[
        "--ca-cert-hash",
        &pin,
        "--enrollment-token",
        &issued.token,
    ]);
    a.start(None);
    a.wait_enrolled(None).await;
    let kept = std::fs::read_to_string(a.state_dir.join("ca.pem")).unwrap();
    assert_eq!(kept, harness_ca().pem);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_refuses_a_member_whose_certificate_is_from_another_ca() {
    let mut c = Cluster::start(1).await;
    let other = c.root().join("other-ca");
    let out = std::process::Command::new(server_bin())
        .args(["cluster", "init-ca", "--out"])
        .arg(&other)
        .output()
        .unwrap();
    assert!(out.status.success());
    let token = c.new_token(600).await;
    let ca_file = other.join("ca.pem").display().to_string();
    let mut a = Agent::new(c.root(), "a", c.urls()).trust(&[
        "--ca-file",
        &ca_file,
        "--enroll-timeout",
        "2s",
    ]);
    a.start(Some(&token));
    let (code, line) = a.wait_exit().await;
    assert_ne!(code, 0, "{line}");
    assert!(!a.state_dir.join("credential").exists());
    let list: api::Enrollments = c.read_as("/api/v1/admin/node-enrollments").await;
    assert!(list.enrollments.iter().all(|e| e.state == "pending"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_of_a_cluster_without_a_shared_ca_refuses_to_start() {
    let scratch = Scratch::new();
    let (mut m, _) = serve(
        scratch.path(),
        "m",
        &[
            "--node-id",
            "1",
            "--peer",
            "1=https://127.0.0.1:1",
            "--peer",
            "2=https://127.0.0.1:2",
        ],
    );
    let code = wait_exit_of(&mut m, "the member to refuse").await;
    assert_ne!(code, 0);
    let log = std::fs::read_to_string(scratch.path().join("m.log")).unwrap();
    assert!(log.contains("modelforge cluster init-ca"), "{log}");
}

/// A cluster of more than one member refuses to start without a cluster secret of its own
/// (one equal to the admin token would let every operator speak as a member), and a secret
/// from the environment must be as long as one from a file.
#[test]
fn members_refuse_to_start_without_a_cluster_secret_of_their_own() {
    let scratch = Scratch::new();
    let two = [
        "--insecure-http",
        "--node-id",
        "1",
        "--peer",
        "1=http://127.0.0.1:1",
        "--peer",
        "2=http://127.0.0.1:2",
    ];
    let start = |name: &str, flags: &[&str], env: &[(&str, &str)]| {
        let out = std::process::Command::new(server_bin())
            .arg("serve")
            .arg("--data-dir")
            .arg(scratch.path().join(name))
            .args(["--listen", "127.0.0.1:0"])
            .args(flags)
            .env_remove("MODELFORGE_ADMIN_TOKEN")
            .env_remove("MODELFORGE_CLUSTER_SECRET")
            .envs(env.iter().copied())
            .output()
            .unwrap();
        assert!(!out.status.success(), "{name} started");
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let err = start("none", &two, &[("MODELFORGE_ADMIN_TOKEN", ADMIN)]);
    assert!(err.contains("MODELFORGE_CLUSTER_SECRET"), "{err}");
    let err = start(
        "same",
        &two,
        &[
            ("MODELFORGE_ADMIN_TOKEN", ADMIN),
            ("MODELFORGE_CLUSTER_SECRET", ADMIN),
        ],
    );
    assert!(err.contains("must differ from the admin token"), "{err}");
    let err = start(
        "short",
        &["--insecure-http"],
        &[
            ("MODELFORGE_ADMIN_TOKEN", ADMIN),
            ("MODELFORGE_CLUSTER_SECRET", "short"),
        ],
    );
    assert!(err.contains("at least 16 characters"), "{err}");
    let err = start(
        "short-admin",
        &["--insecure-http"],
        &[("MODELFORGE_ADMIN_TOKEN", "short")],
    );
    assert!(err.contains("at least 16 characters"), "{err}");
    assert!(!err.contains("short\n"), "the secret is echoed: {err}");
}

/// (status, JSON body or Null; status 0: no answer) of one peer call through `client`.
async fn peer_call(
    client: &reqwest::Client,
    method: &str,
    url: &str,
    header: Option<String>,
    body: Vec<u8>,
) -> (u16, serde_json::Value) {
    let mut r = client
        .request(reqwest::Method::from_bytes(method.as_bytes()).unwrap(), url)
        .body(body);
    if let Some(h) = header {
        r = r.header("x-modelforge-peer", h);
    }
    match r.send().await {
        Ok(resp) => {
            let s = resp.status().as_u16();
            let v = resp.json().await.unwrap_or(serde_json::Value::Null);
            (s, v)
        }
        Err(_) => (0, serde_json::Value::Null),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_endpoints_take_only_a_current_members_certificate_and_the_cluster_secret() {
    let mut c = Cluster::start(1).await;
    const STATUS: &str = "/internal/v1/status";
    let url = format!("{}{STATUS}", c.url(1));
    let signed = || Some(peer_header("", 1, "GET", STATUS, b""));
    let status = |client: reqwest::Client, header: Option<String>| {
        let url = url.clone();
        async move { peer_call(&client, "GET", &url, header, vec![]).await }
    };
    // A correctly signed header over a connection with no client certificate: 401.
    let (s, v) = status(member_client(None), signed()).await;
    assert_eq!(refused(s, &v), (401, "peer_unauthenticated"), "{v}");
    // A certificate from the cluster CA naming a member not in the configuration: 401.
    let h = Some(peer_header("", 99, "GET", STATUS, b""));
    let (s, v) = status(member_client(Some(99)), h).await;
    assert_eq!(refused(s, &v), (401, "peer_unauthenticated"), "{v}");
    // A member's certificate with no header, or with an admin token, an agent's credential,
    // or the old fixed header (the bare derived secret) in it: 401.
    let (_agent, _, credential) = c.enrol_one("a").await;
    let fixed = modelforge::secrets::peer_token(CLUSTER_SECRET, "");
    // A header signed with a key derived from the admin token: an operator is not a member.
    let by_operator = modelforge_raft::peer_auth::PeerSigner::new(
        modelforge::secrets::peer_token(ADMIN, "").as_bytes(),
        1,
    )
    .sign("GET", STATUS, b"", 0);
    for header in [
        None,
        Some(ADMIN.to_string()),
        Some(credential),
        Some(fixed),
        Some(by_operator),
    ] {
        let (s, v) = status(member_client(Some(1)), header.clone()).await;
        assert_eq!(
            refused(s, &v),
            (401, "peer_unauthenticated"),
            "{header:?}: {v}"
        );
    }
    // Signed as another member than the certificate names: 401.
    let h = Some(peer_header("", 2, "GET", STATUS, b""));
    let (s, v) = status(member_client(Some(1)), h).await;
    assert_eq!(refused(s, &v), (401, "peer_unauthenticated"), "{v}");
    // A member's certificate and its signed header: answered.
    let (s, v) = status(member_client(Some(1)), signed()).await;
    assert_eq!(s, 200, "{v}");
    // A certificate from another CA does not even finish the handshake.
    let other = c.root().join("other-ca");
    assert!(
        std::process::Command::new(server_bin())
            .args(["cluster", "init-ca", "--out"])
            .arg(&other)
            .status()
            .unwrap()
            .success()
    );
    let pem = std::fs::read_to_string(other.join("ca.pem")).unwrap();
    let key = std::fs::read_to_string(other.join("ca.key")).unwrap();
    let (cert, key) = modelforge::tls::issue_member(&pem, &key, 1, &["127.0.0.1".into()]).unwrap();
    let foreign = modelforge::tls::load(&pem, &cert, &key).unwrap().identity();
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(10))
        .tls_backend_preconfigured(
            modelforge_client::tls::client_config(&harness_ca().pem, Some(foreign)).unwrap(),
        )
        .build()
        .unwrap();
    let (s, _) = status(client, signed()).await;
    assert_eq!(
        s, 0,
        "a foreign client certificate is refused at the handshake"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_captured_peer_request_replayed_or_altered_is_refused() {
    let c = Cluster::start(1).await;
    let me = member_client(Some(1));
    // A proposal exactly as member 1 would hand it over (a codec-encoded envelope); the
    // bytes do not decode as one, so even the original changes nothing: what matters is that
    // it passes the gate once (400 bad_peer_body, from the handler) and never again.
    const PROPOSE: &str = "/internal/v1/propose";
    let url = format!("{}{PROPOSE}", c.url(1));
    let body = b"captured proposal bytes".to_vec();
    let captured = peer_header("", 1, "POST", PROPOSE, &body);
    let (s, v) = peer_call(&me, "POST", &url, Some(captured.clone()), body.clone()).await;
    assert_eq!(refused(s, &v), (400, "bad_peer_body"), "the original: {v}");
    // Replayed at once, and later, on a new connection: 401 both times.
    for _ in 0..2 {
        let (s, v) = peer_call(&me, "POST", &url, Some(captured.clone()), body.clone()).await;
        assert_eq!(
            refused(s, &v),
            (401, "peer_unauthenticated"),
            "a replay: {v}"
        );
    }
    let (s, v) = peer_call(
        &member_client(Some(1)),
        "POST",
        &url,
        Some(captured),
        body.clone(),
    )
    .await;
    assert_eq!(refused(s, &v), (401, "peer_unauthenticated"), "{v}");
    // A fresh header with another body than the one it signed: 401.
    let header = peer_header("", 1, "POST", PROPOSE, &body);
    let (s, v) = peer_call(&me, "POST", &url, Some(header), b"other bytes".to_vec()).await;
    assert_eq!(refused(s, &v), (401, "peer_unauthenticated"), "{v}");
    // Signed for another path (a header lifted onto the Raft vote endpoint): 401.
    let header = peer_header("", 1, "POST", PROPOSE, &body);
    let vote = format!("{}/internal/v1/raft/vote", c.url(1));
    let (s, v) = peer_call(&me, "POST", &vote, Some(header), body.clone()).await;
    assert_eq!(refused(s, &v), (401, "peer_unauthenticated"), "{v}");
    // A well-signed Raft RPC meant for another member id (one address configured under two
    // ids): refused before its body is read, so this process never votes as member 7.
    let for_other = "/internal/v1/raft/vote?to=7";
    let header = peer_header("", 1, "POST", for_other, &body);
    let url_other = format!("{}{for_other}", c.url(1));
    let (s, v) = peer_call(&me, "POST", &url_other, Some(header), body.clone()).await;
    assert_eq!(refused(s, &v), (401, "peer_unauthenticated"), "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("member 7"),
        "{v}"
    );
    // A target that is not an id, or none: refused.
    let garbled = "/internal/v1/raft/vote?to=x";
    let header = peer_header("", 1, "POST", garbled, &body);
    let url_garbled = format!("{}{garbled}", c.url(1));
    let (s, v) = peer_call(&me, "POST", &url_garbled, Some(header), body.clone()).await;
    assert_eq!(refused(s, &v), (401, "peer_unauthenticated"), "{v}");
    let header = peer_header("", 1, "POST", "/internal/v1/raft/vote", &body);
    let (s, v) = peer_call(&me, "POST", &vote, Some(header), body.clone()).await;
    assert_eq!(refused(s, &v), (401, "peer_unauthenticated"), "{v}");
    // Signed 60 s ago with a nonce never seen (a request held back and sent later): 401.
    let key = modelforge::secrets::peer_token(CLUSTER_SECRET, "");
    let old = modelforge_raft::peer_auth::PeerSigner::new(key.as_bytes(), 1).sign_at(
        "POST",
        PROPOSE,
        &body,
        0,
        modelforge_proto::now_ms() as u64 - 60_000,
        [42; 16],
    );
    let (s, v) = peer_call(&me, "POST", &url, Some(old), body).await;
    assert_eq!(refused(s, &v), (401, "peer_unauthenticated"), "{v}");
}

/// Files named `snapshot.incoming.*` anywhere under `dir`: snapshots being received.
fn incoming_snapshots(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = vec![];
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                todo.push(p);
            } else if e
                .file_name()
                .to_string_lossy()
                .starts_with("snapshot.incoming.")
            {
                out.push(p);
            }
        }
    }
    out
}

/// A snapshot streams to disk on the member receiving it; its digest is checked against the
/// signed header once it is there. A body other than the one signed (a member's header on a
/// stranger's bytes) is refused with 401, a signed body that is no snapshot with 400, and
/// neither leaves a file behind or changes the member.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_snapshot_other_than_the_signed_one_is_refused_and_removed() {
    // No credential pool: its background argon2 hashing (64 MiB each) would swamp the RSS
    // figure below.
    let c = Cluster::start_with(1, &["--credential-pool", "0"]).await;
    let me = member_client(Some(1));
    const SNAPSHOT: &str = "/internal/v1/raft/snapshot?to=1";
    let url = format!("{}{SNAPSHOT}", c.url(1));
    let before = c.cluster_view(1).await.unwrap();
    // 8 MiB, more than any single read: it is streamed, not taken in one piece.
    let signed_body = vec![7u8; 8 << 20];
    let mut other = signed_body.clone();
    other[5 << 20] ^= 1;
    let header = peer_header("", 1, "POST", SNAPSHOT, &signed_body);
    let (s, v) = peer_call(&me, "POST", &url, Some(header), other).await;
    assert_eq!(refused(s, &v), (401, "peer_unauthenticated"), "{v}");
    // Signed, but not a snapshot: the vote's length at its head is absurd.
    let header = peer_header("", 1, "POST", SNAPSHOT, &signed_body);
    let (s, v) = peer_call(&me, "POST", &url, Some(header), signed_body.clone()).await;
    assert_eq!(refused(s, &v), (400, "bad_peer_body"), "{v}");
    // Signed, a well-formed head, then bytes that fail the snapshot's checksum.
    let mut forged = modelforge_raft::network::snapshot_head(1, 1);
    forged.extend_from_slice(&[0u8; 4096]);
    let header = peer_header("", 1, "POST", SNAPSHOT, &forged);
    let (s, v) = peer_call(&me, "POST", &url, Some(header), forged).await;
    assert_eq!(refused(s, &v), (400, "bad_peer_body"), "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("checksum"),
        "{v}"
    );
    // 128 MiB behind a well-formed head: received to disk and checked there, in bounded
    // memory. The member's peak RSS grows by far less than the body (buffered, it would grow by
    // all of it).
    let peak = || {
        let status =
            std::fs::read_to_string(format!("/proc/{}/status", c.pid(1).unwrap())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap()
            * 1024
    };
    let before_peak = peak();
    let mut big = modelforge_raft::network::snapshot_head(1, 1);
    big.resize(big.len() + (128 << 20), 0);
    let header = peer_header("", 1, "POST", SNAPSHOT, &big);
    let (s, v) = peer_call(&me, "POST", &url, Some(header), big).await;
    assert_eq!(refused(s, &v), (400, "bad_peer_body"), "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("checksum"),
        "{v}"
    );
    let grew = peak().saturating_sub(before_peak);
    assert!(
        grew < 32 << 20,
        "receiving 128 MiB raised the peak RSS by {} MiB",
        grew >> 20
    );
    // Nothing left behind, nothing changed.
    assert_eq!(
        incoming_snapshots(&c.data_dir(1)),
        Vec::<std::path::PathBuf>::new()
    );
    let after = c.cluster_view(1).await.unwrap();
    assert_eq!(after.snapshot_index, before.snapshot_index);
    assert!(after.applied_index >= before.applied_index);
    let (s, _) = call("GET", &format!("{}/healthz", c.url(1)), None, None).await;
    assert_eq!(s, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_cannot_plant_a_verified_credential_cache_entry() {
    let mut c = Cluster::start(3).await;
    let leader = c.wait_leader().await;
    let followers: Vec<u64> = c.ids.iter().copied().filter(|i| *i != leader).collect();
    let (target, planter) = (followers[0], followers[1]);
    // The entry a follower would plant: a real credential id with the digest of a secret of
    // its choosing, so that it could heartbeat with no argon2 once the target leads.
    let (_agent, _, credential) = c.enrol_one("a").await;
    let cred_id = credential.split('_').nth(1).unwrap().to_string();
    let forged: Vec<(String, [u8; 32])> = vec![(cred_id, [7u8; 32])];
    let body = modelforge_raft::codec::encode(&forged).unwrap();
    const VERIFIED: &str = "/internal/v1/verified";
    // The agent's first heartbeat is verified by the leader and shared: wait for that one, so
    // that nothing else moves the count below.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while learned(&c, target).await < 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the leader never shared"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let before = learned(&c, target).await;
    for (from, to) in [(planter, target), (planter, leader), (target, leader)] {
        let url = format!("{}{VERIFIED}", c.url(to));
        let header = peer_header("", from, "POST", VERIFIED, &body);
        let (s, v) = peer_call(
            &member_client(Some(from)),
            "POST",
            &url,
            Some(header),
            body.clone(),
        )
        .await;
        assert_eq!(
            refused(s, &v),
            (401, "peer_unauthenticated"),
            "member {from} planting into {to}: {v}"
        );
    }
    assert_eq!(
        learned(&c, target).await,
        before,
        "a follower's entry was learned"
    );
    // The same call signed by the leader over its certificate is taken (the gate can pass).
    let url = format!("{}{VERIFIED}", c.url(target));
    let header = peer_header("", leader, "POST", VERIFIED, &body);
    let (s, v) = peer_call(
        &member_client(Some(leader)),
        "POST",
        &url,
        Some(header),
        body,
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(learned(&c, target).await, before + 1);
}

/// The DER of the certificate `url`'s server presents on a new connection.
async fn served_cert(url: &str) -> Vec<u8> {
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(10))
        .tls_info(true)
        .tls_backend_preconfigured(
            modelforge_client::tls::client_config(&harness_ca().pem, None).unwrap(),
        )
        .build()
        .unwrap();
    let resp = client.get(format!("{url}/healthz")).send().await.unwrap();
    resp.extensions()
        .get::<reqwest::tls::TlsInfo>()
        .and_then(|i| i.peer_certificate())
        .expect("a TLS connection")
        .to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_members_certificate_rotates_under_heartbeat_load_without_a_failed_request() {
    let mut c = Cluster::start(1).await;
    let (_agent, node_id, credential) = c.enrol_one("a").await;
    let url = c.url(1);
    // Heartbeats from 8 loops until told to stop, every third on a new connection (a new
    // handshake), the others on a kept one; every answer that is not 200 is kept.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut loops = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let (stop, url, node_id, credential) = (
            stop.clone(),
            url.clone(),
            node_id.clone(),
            credential.clone(),
        );
        loops.spawn(async move {
            let (mut sent, mut failed) = (0u64, vec![]);
            let mut kept = http();
            let hb = format!("{url}/api/v1/agent/nodes/{node_id}/heartbeat");
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if sent % 3 == 0 {
                    kept = http();
                }
                let r = kept
                    .post(&hb)
                    .bearer_auth(&credential)
                    .json(&json!({}))
                    .send()
                    .await;
                match r {
                    Ok(r) if r.status() == 200 => {}
                    Ok(r) => failed.push(format!("{}", r.status())),
                    Err(e) => failed.push(format!("{e:?}")),
                }
                sent += 1;
            }
            (sent, failed)
        });
    }
    let first = served_cert(&url).await;

    // 1. SIGHUP: the member issues itself a new certificate from the CA and serves it.
    assert!(c.signal(1, libc::SIGHUP));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while served_cert(&url).await == first {
        assert!(
            tokio::time::Instant::now() < deadline,
            "SIGHUP did not rotate the certificate"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(c.log(1).contains("TLS certificate reloaded"));
    let second = served_cert(&url).await;
    assert!(c.alive(1), "SIGHUP stopped the member");

    // 2. A changed file: an operator (or a renewal job) replaces member.pem and member.key.
    let key = std::fs::read_to_string(&harness_ca().key).unwrap();
    let (cert, cert_key) =
        modelforge::tls::issue_member(&harness_ca().pem, &key, 1, &["127.0.0.1".into()]).unwrap();
    let dir = c.data_dir(1).join("tls");
    for (name, text) in [("member.key", &cert_key), ("member.pem", &cert)] {
        let tmp = dir.join(format!("{name}.new"));
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, dir.join(name)).unwrap();
    }
    let third = modelforge::tls::load(&harness_ca().pem, &cert, &cert_key)
        .unwrap()
        .chain[0]
        .to_vec();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while served_cert(&url).await != third {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the changed files were not served"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_ne!(second, third);

    // 3. A broken pair (a key that is not the certificate's) is refused; the last good one
    // keeps serving.
    let other =
        modelforge::tls::issue_member(&harness_ca().pem, &key, 1, &["127.0.0.1".into()]).unwrap();
    std::fs::write(dir.join("member.key"), &other.1).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !c.log(1).contains("TLS certificate reload failed") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the broken pair was not noticed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(served_cert(&url).await, third);

    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (mut sent, mut failed) = (0, vec![]);
    while let Some(r) = loops.join_next().await {
        let (s, f) = r.unwrap();
        sent += s;
        failed.extend(f);
    }
    assert!(sent > 100, "only {sent} heartbeats sent");
    assert!(
        failed.is_empty(),
        "{} of {sent} heartbeats failed: {:?}",
        failed.len(),
        &failed[..failed.len().min(5)]
    );
}

/// The cache entries member `id` has learned from a leader.
async fn learned(c: &Cluster, id: u64) -> u64 {
    c.cluster_view(id)
        .await
        .unwrap()
        .secret_checks
        .entries_learned_from_leader
}
