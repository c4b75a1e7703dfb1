//! The middle of the test pyramid: a member served in this process (`server::serve_on` on a
//! loopback listener, no child process), its handlers' refusal paths over real HTTP, and its
//! shutdown, which must be observable: `serve_on` returns once every background loop ended,
//! and the data dir opens again in the same process (the Raft store released).
//!
//! The member serves TLS with the CA it generates into `<data-dir>/tls/ca.pem` on its first
//! start; the test's client trusts that CA and nothing else.

use std::time::Duration;

use modelforge::server::ServeConfig;
use modelforge::server::Shutdown;
use modelforge::server::Stopped;
use modelforge::server::serve_on;
use modelforge_proto::api::Enrollments;
use modelforge_proto::api::ErrorCode;
use modelforge_proto::api::StateDigest;
use modelforge_proto::api::TokenIssued;
use modelforge_proto::wire::ErrorBody;
use serde::de::DeserializeOwned;
use serde_json::Value;
use serde_json::json;

const ADMIN: &str = "router-test-admin-token-0123456789";

struct Member {
    /// The member's base URL and a client trusting its CA.
    api: Api,
    stop: Shutdown,
    task: tokio::task::JoinHandle<anyhow::Result<Stopped>>,
}

/// Where a member answers, and a client that verifies it.
#[derive(Clone)]
struct Api {
    url: String,
    http: reqwest::Client,
}

/// A client trusting only the CA in `ca_pem`.
fn client(ca_pem: &str) -> reqwest::Client {
    modelforge_client::tls::install_provider();
    let tls = modelforge_client::tls::client_config(ca_pem, None).unwrap();
    reqwest::Client::builder()
        .no_proxy()
        .tls_backend_preconfigured(tls)
        .build()
        .unwrap()
}

/// Serve a single member on `dir`, once it is ready (over TLS, verified against its CA).
async fn member(dir: &std::path::Path) -> Member {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let cfg = ServeConfig::for_test(dir, addr, ADMIN).unwrap();
    let stop = Shutdown::new();
    let task = tokio::spawn(serve_on(listener, cfg, stop.clone()));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let ca = dir.join("tls").join("ca.pem");
    let mut api: Option<Api> = None;
    loop {
        // The CA is written (atomically) when the member starts, or kept from a start before.
        if api.is_none()
            && let Ok(pem) = std::fs::read_to_string(&ca)
        {
            api = Some(Api {
                url: format!("https://{addr}"),
                http: client(&pem),
            });
        }
        if let Some(a) = &api
            && call(a, "GET", "/readyz", None, None).await.0 == 200
        {
            break;
        }
        if task.is_finished() {
            panic!("the member stopped while starting: {:?}", task.await);
        }
        assert!(tokio::time::Instant::now() < deadline, "not ready in 30 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Member {
        api: api.unwrap(),
        stop,
        task,
    }
}

/// (status, JSON body) of one request; `bearer` None sends no Authorization. Status 0: no
/// answer (nothing listening, or a connection that did not verify).
async fn call(
    api: &Api,
    method: &str,
    path: &str,
    bearer: Option<&str>,
    body: Option<&str>,
) -> (u16, Value) {
    let (base, http) = (&api.url, &api.http);
    let mut r = http.request(
        reqwest::Method::from_bytes(method.as_bytes()).unwrap(),
        format!("{base}{path}"),
    );
    if let Some(b) = bearer {
        r = r.bearer_auth(b);
    }
    if let Some(b) = body {
        r = r
            .header("content-type", "application/json")
            .body(b.to_string());
    }
    match r.send().await {
        Ok(resp) => (
            resp.status().as_u16(),
            resp.json().await.unwrap_or(Value::Null),
        ),
        Err(_) => (0, Value::Null),
    }
}

/// An answer read as its endpoint's type; one that does not decode panics with the body.
fn typed<T: DeserializeOwned>(what: &str, v: &Value) -> T {
    serde_json::from_value(v.clone()).unwrap_or_else(|e| {
        panic!(
            "{what}: the answer is not a {} ({e}): {v}",
            std::any::type_name::<T>()
        )
    })
}

/// The request is refused with `code`, its status from the one table, and the contract's body.
async fn refused(
    m: &Member,
    method: &str,
    path: &str,
    bearer: Option<&str>,
    body: Option<&str>,
    code: ErrorCode,
) {
    let (s, v) = call(&m.api, method, path, bearer, body).await;
    let e: ErrorBody = typed(&format!("{method} {path} answered {s}"), &v);
    assert_eq!(
        (s, e.error.code.as_str()),
        (code.status(), code.as_str()),
        "{method} {path}: {v}"
    );
    assert!(!e.error.message.is_empty(), "{v}");
}

/// The member's state digest.
async fn digest(api: &Api) -> String {
    let (_, v) = call(
        api,
        "GET",
        "/api/v1/cluster/state-digest",
        Some(ADMIN),
        None,
    )
    .await;
    typed::<StateDigest>("the state digest", &v).digest
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handlers_refuse_bad_requests_with_the_tables_codes_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let m = member(dir.path()).await;
    let before = digest(&m.api).await;
    assert!(!before.is_empty());

    use ErrorCode as E;
    let tokens = "/api/v1/admin/node-enrollments";
    let huge = format!(r#"{{"note": "{}"}}"#, "x".repeat(300 * 1024));
    let nodes = "/api/v1/admin/hardware/nodes";
    let execute = format!("{nodes}/no-such-node/decommission/execute");
    let enroll = json!({"token": "mfet_garbage", "hostname": "h", "inventory": {"accelerators": [], "storage_roots": []},
        "identity": {"public_key": "00", "signed_at_ms": 0, "signature": "00"}})
    .to_string();
    let heartbeat = "/api/v1/agent/nodes/no-such-node/heartbeat";
    // (method, path, bearer, body, the code it is refused with)
    type Case<'a> = (&'a str, String, Option<&'a str>, Option<&'a str>, ErrorCode);
    let cases: Vec<Case> = vec![
        ("GET", tokens.to_string(), None, None, E::Unauthenticated),
        (
            "GET",
            tokens.to_string(),
            Some("not-the-admin-token"),
            None,
            E::Unauthenticated,
        ),
        (
            "GET",
            "/api/v1/nothing-here".to_string(),
            Some(ADMIN),
            None,
            E::NotFound,
        ),
        (
            "PATCH",
            tokens.to_string(),
            Some(ADMIN),
            None,
            E::MethodNotAllowed,
        ),
        (
            "POST",
            tokens.to_string(),
            Some(ADMIN),
            Some("{not json"),
            E::InvalidJson,
        ),
        (
            "POST",
            tokens.to_string(),
            Some(ADMIN),
            Some(r#"{"ttl_seconds": "soon"}"#),
            E::InvalidBody,
        ),
        (
            "POST",
            tokens.to_string(),
            Some(ADMIN),
            Some(r#"{"ttl_seconds": 0}"#),
            E::InvalidTtl,
        ),
        (
            "POST",
            tokens.to_string(),
            Some(ADMIN),
            Some(huge.as_str()),
            E::BodyTooLarge,
        ),
        (
            "DELETE",
            format!("{tokens}/no-such-token"),
            Some(ADMIN),
            None,
            E::EnrollmentNotFound,
        ),
        (
            "DELETE",
            format!("{tokens}/bad.id"),
            Some(ADMIN),
            None,
            E::InvalidId,
        ),
        (
            "GET",
            format!("{nodes}/no-such-node"),
            Some(ADMIN),
            None,
            E::NodeNotFound,
        ),
        (
            "GET",
            format!("{nodes}/no-such-node/credentials"),
            Some(ADMIN),
            None,
            E::NodeNotFound,
        ),
        (
            "DELETE",
            format!("{nodes}/no-such-node/credential"),
            Some(ADMIN),
            Some(r#"{"reason": "x"}"#),
            E::NodeNotFound,
        ),
        (
            "POST",
            execute.clone(),
            Some(ADMIN),
            Some(r#"{"preview_id": "p1", "reason": "x"}"#),
            E::NodeNotFound,
        ),
        (
            "POST",
            "/api/v1/allocations".to_string(),
            Some(ADMIN),
            Some(r#"{"owner": "o", "accelerators": 1}"#),
            E::NoCapacity,
        ),
        (
            "POST",
            "/api/v1/agent/enroll".to_string(),
            None,
            Some(enroll.as_str()),
            E::InvalidToken,
        ),
        (
            "POST",
            heartbeat.to_string(),
            None,
            Some("{}"),
            E::Unauthenticated,
        ),
        (
            "POST",
            heartbeat.to_string(),
            Some("mfnc_garbage"),
            Some("{}"),
            E::InvalidCredential,
        ),
    ];
    for (method, path, bearer, body, code) in &cases {
        refused(&m, method, path, *bearer, *body, *code).await;
    }

    // None of it changed the replicated state.
    let after = digest(&m.api).await;
    assert_eq!(after, before, "a refused request changed the state");
    m.stop.trigger();
    m.task.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_stops_every_background_loop_and_the_data_dir_opens_again() {
    let dir = tempfile::tempdir().unwrap();
    let m = member(dir.path()).await;
    let (s, v) = call(
        &m.api,
        "POST",
        "/api/v1/admin/node-enrollments",
        Some(ADMIN),
        Some(r#"{"note": "kept"}"#),
    )
    .await;
    assert_eq!(s, 201, "{v}");
    let id = typed::<TokenIssued>("a new enrolment token", &v)
        .enrollment_id
        .to_string();

    let api = m.api.clone();
    m.stop.trigger();
    let stopped = tokio::time::timeout(Duration::from_secs(20), m.task)
        .await
        .expect("serve_on returned within 20 s of the switch")
        .unwrap()
        .unwrap();
    // bootstrap, leadership watch, coalesced uses, node events, cache sharing, sharing of the
    // node view, the disk watch, two minting workers, certificate reload, the heartbeat relay:
    // all of them ended.
    assert_eq!(
        stopped,
        Stopped {
            background_tasks: 15
        }
    );
    assert_eq!(
        call(&api, "GET", "/healthz", None, None).await.0,
        0,
        "still listening"
    );

    // The same data dir serves again in this process: the Raft store was released, and the
    // token written before the shutdown is there.
    let again = member(dir.path()).await;
    let (s, v) = call(
        &again.api,
        "GET",
        "/api/v1/admin/node-enrollments",
        Some(ADMIN),
        None,
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let listed = typed::<Enrollments>("enrollments", &v).enrollments;
    assert!(listed.iter().any(|e| e.enrollment_id.as_str() == id), "{v}");
    again.stop.trigger();
    again.task.await.unwrap().unwrap();
}
