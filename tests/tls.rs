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
    (
        spawn(
            &server_bin(),
            &args,
            &log,
            &[("MODELFORGE_ADMIN_TOKEN", ADMIN)],
        ),
        port,
    )
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
    // The right pin enrols, and the agent keeps the CA it verified for later runs.
    let mut a = Agent::new(c.root(), "right", c.urls()).trust(&["--ca-cert-hash", &pin]);
    a.start(Some(&issued.token));
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_endpoints_take_only_a_current_members_certificate_and_the_cluster_secret() {
    let c = Cluster::start(1).await;
    // The single member's cluster secret is its admin token (no MODELFORGE_CLUSTER_SECRET).
    let secret = modelforge::secrets::peer_token(ADMIN, "");
    let url = format!("{}/internal/v1/status", c.url(1));
    let status = |client: reqwest::Client, header: Option<String>| {
        let url = url.clone();
        async move {
            let mut r = client.get(&url);
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
    };
    // The right secret over a connection with no client certificate: 401.
    let (s, v) = status(member_client(None), Some(secret.clone())).await;
    assert_eq!(refused(s, &v), (401, "peer_unauthenticated"), "{v}");
    // A certificate from the cluster CA naming a member not in the configuration: 401.
    let (s, v) = status(member_client(Some(99)), Some(secret.clone())).await;
    assert_eq!(refused(s, &v), (401, "peer_unauthenticated"), "{v}");
    // A member's certificate without the secret, or with an admin token or a credential: 401.
    let (s, v) = status(member_client(Some(1)), None).await;
    assert_eq!(refused(s, &v), (401, "peer_unauthenticated"), "{v}");
    let (s, v) = status(member_client(Some(1)), Some(ADMIN.into())).await;
    assert_eq!(refused(s, &v), (401, "peer_unauthenticated"), "{v}");
    // A member's certificate and the secret: answered.
    let (s, v) = status(member_client(Some(1)), Some(secret.clone())).await;
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
    let (s, _) = status(client, Some(secret)).await;
    assert_eq!(
        s, 0,
        "a foreign client certificate is refused at the handshake"
    );
}
