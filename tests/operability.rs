//! Operability over real processes: `GET /metrics` (every family declared before its first
//! observation, counts that follow what happened, `promtool check metrics` where installed),
//! request ids (echoed, in error bodies, in JSON log lines, kept through a follower's relay),
//! `/livez` and `/readyz?verbose`, and a SIGTERM that fails readiness before the member stops.

mod common;

use std::collections::BTreeMap;
use std::collections::BTreeSet;

use common::*;
use serde_json::Value;
use serde_json::json;

/// A scrape of `url`'s `/metrics` (no credentials): its content type and text.
async fn scrape(url: &str) -> (String, String) {
    let r = http()
        .get(format!("{url}/metrics"))
        .send()
        .await
        .expect("/metrics answers");
    assert_eq!(r.status(), 200);
    let ct = r
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    (ct, r.text().await.unwrap())
}

/// The families a scrape declares (`# TYPE name kind`), and its samples (`name{labels}` ->
/// value). Panics when a sample comes before its family's `# TYPE` line.
fn parse(text: &str) -> (BTreeMap<String, String>, BTreeMap<String, f64>) {
    let (mut types, mut samples) = (BTreeMap::new(), BTreeMap::new());
    for line in text.lines().filter(|l| !l.is_empty()) {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("# TYPE name kind");
            types.insert(name.to_string(), kind.to_string());
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').expect("a sample: series value");
        let name = series.split('{').next().unwrap();
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| {
                name.strip_suffix(s)
                    .filter(|f| types.get(*f).is_some_and(|k| k == "histogram"))
            })
            .unwrap_or(name);
        assert!(
            types.contains_key(family),
            "sample {series} before its family's # TYPE line"
        );
        samples.insert(series.to_string(), value.parse().expect("a number"));
    }
    (types, samples)
}

/// The contract's families, and the kind each must have.
const CONTRACT: &[(&str, &str)] = &[
    ("modelforge_server_has_leader", "gauge"),
    ("modelforge_server_leader_changes_seen_total", "counter"),
    ("modelforge_raft_term", "gauge"),
    ("modelforge_raft_commit_index", "gauge"),
    ("modelforge_raft_applied_index", "gauge"),
    ("modelforge_proposals_committed_total", "counter"),
    ("modelforge_proposals_failed_total", "counter"),
    ("modelforge_disk_fsync_duration_seconds", "histogram"),
    ("modelforge_http_requests_total", "counter"),
    ("modelforge_http_request_duration_seconds", "histogram"),
    ("modelforge_heartbeats_total", "counter"),
    ("modelforge_argon2_verifies_total", "counter"),
    ("modelforge_argon2_queue_depth", "gauge"),
    ("modelforge_nodes", "gauge"),
    ("modelforge_build_info", "gauge"),
];

#[tokio::test]
async fn metrics_declare_every_family_first_and_count_heartbeats_enrolments_and_nodes() {
    let mut c = Cluster::start(1).await;
    let url = c.url(1);
    let (ct, text) = scrape(&url).await;
    assert!(ct.starts_with("text/plain; version=0.0.4"), "{ct}");
    let (types, samples) = parse(&text);
    for (family, kind) in CONTRACT {
        assert_eq!(
            types.get(*family).map(String::as_str),
            Some(*kind),
            "{family} in:\n{text}"
        );
    }
    // Declared before the first heartbeat, the usual answers at zero.
    assert_eq!(
        samples["modelforge_heartbeats_total{code=\"200\"}"], 0.0,
        "{text}"
    );
    assert_eq!(samples["modelforge_server_has_leader"], 1.0);
    assert!(samples["modelforge_raft_term"] >= 1.0);
    assert!(samples["modelforge_raft_applied_index"] >= 1.0);
    assert!(samples["modelforge_disk_fsync_duration_seconds_count"] >= 1.0);
    assert_eq!(samples["modelforge_nodes{status=\"online\"}"], 0.0);
    assert!(
        samples
            .keys()
            .any(|s| s.starts_with("modelforge_build_info{version=\"")),
        "{text}"
    );

    // An agent enrols and heartbeats; then its credential is revoked and its heartbeats are
    // refused: each shows under its route and code.
    let (_agent, node_id, cred) = c.enrol_one("metrics-node").await;
    let counts = wait_until("the heartbeat and the node are counted", WAIT, || {
        let url = url.clone();
        async move {
            let (_, text) = scrape(&url).await;
            let (_, s) = parse(&text);
            let ok = s
                .get("modelforge_heartbeats_total{code=\"200\"}")
                .is_some_and(|n| *n >= 1.0)
                && s.get("modelforge_nodes{status=\"online\"}") == Some(&1.0);
            ok.then_some(s)
        }
    })
    .await;
    assert_eq!(counts["modelforge_enrollments_total{code=\"201\"}"], 1.0);
    assert!(counts["modelforge_argon2_verifies_total"] >= 1.0);
    assert!(counts["modelforge_proposals_committed_total"] >= 2.0);
    assert!(
        counts.keys().any(|s| s.starts_with(
            "modelforge_http_requests_total{route=\"/api/v1/agent/nodes/{node_id}/heartbeat\",code=\"200\"}"
        )),
        "{counts:?}"
    );
    c.revoke(&node_id).await;
    let (s, _) = call(
        "POST",
        &format!("{url}/api/v1/agent/nodes/{node_id}/heartbeat"),
        Some(&cred),
        Some(json!({})),
    )
    .await;
    assert_eq!(s, 401);
    let (_, text) = scrape(&url).await;
    let (_, s) = parse(&text);
    assert!(s["modelforge_revocations_total"] >= 1.0, "{text}");
    assert!(
        s["modelforge_heartbeats_total{code=\"401\"}"] >= 1.0,
        "{text}"
    );
    // A scanner's paths share one label value: the label set cannot grow with them.
    for p in ["/wp-admin", "/.env", "/a/b/c"] {
        let (s, _) = call("GET", &format!("{url}{p}"), None, None).await;
        assert_eq!(s, 404);
    }
    let (_, text) = scrape(&url).await;
    assert!(!text.contains("wp-admin"), "{text}");
    assert!(
        text.contains("modelforge_http_requests_total{route=\"unmatched\",code=\"404\"} 3"),
        "{text}"
    );

    // The shipped alerts and dashboard name only what a member exports.
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    for file in [
        "deploy/prometheus/alerts.yml",
        "deploy/grafana/modelforge-dashboard.json",
    ] {
        let text = std::fs::read_to_string(root.join(file)).unwrap();
        let mut named = 0;
        for (at, _) in text.match_indices("modelforge_") {
            let name: String = text[at..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            let family = name.strip_suffix("_bucket").unwrap_or(&name);
            assert!(
                types.contains_key(family),
                "{file} names {name}, which no member exports"
            );
            named += 1;
        }
        assert!(named >= 6, "{file} names {named} metrics");
    }

    // Prometheus's own linter, where it is installed (CI installs it).
    if let Ok(mut lint) = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
    {
        use std::io::Write;
        lint.stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
        let out = lint.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "promtool check metrics: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    } else {
        eprintln!("promtool not installed: the exposition was not linted");
    }
}

/// Send a request with `id` as its `X-Request-Id` (none: without one): status, the id
/// answered, and the JSON body.
async fn with_id(
    method: &str,
    url: &str,
    id: Option<&str>,
    token: Option<&str>,
    body: Option<Value>,
) -> (u16, String, Value) {
    let mut r = http().request(method.parse().unwrap(), url);
    if let Some(id) = id {
        r = r.header("x-request-id", id);
    }
    if let Some(t) = token {
        r = r.bearer_auth(t);
    }
    if let Some(b) = body {
        r = r.json(&b);
    }
    let resp = r.send().await.expect("an answer");
    let echoed = resp
        .headers()
        .get("x-request-id")
        .expect("every answer carries X-Request-Id")
        .to_str()
        .unwrap()
        .to_string();
    (
        resp.status().as_u16(),
        echoed,
        resp.json().await.unwrap_or(Value::Null),
    )
}

#[tokio::test]
async fn request_ids_are_echoed_in_errors_and_json_logs_and_kept_through_a_relay() {
    let mut c = Cluster::start_with(3, &["--log-format", "json"]).await;
    let leader = c.wait_leader().await;
    let follower = (1..=3).find(|i| *i != leader).unwrap();
    let (f, l) = (c.url(follower), c.url(leader));

    // Taken from the caller, on a success and on an error (header and body alike).
    let (s, echoed, _) = with_id("GET", &format!("{l}/readyz"), Some("probe-1"), None, None).await;
    assert_eq!((s, echoed.as_str()), (200, "probe-1"));
    let (s, echoed, v) = with_id(
        "GET",
        &format!("{l}/api/v1/admin/hardware/nodes"),
        Some("no-token-2"),
        None,
        None,
    )
    .await;
    assert_eq!((s, echoed.as_str()), (401, "no-token-2"));
    assert_eq!(v["error"]["request_id"], "no-token-2", "{v}");
    // Made when absent, or when what was sent is not a printable id.
    let (_, made, v) = with_id("GET", &format!("{l}/nope"), None, None, None).await;
    assert!(
        made.len() == 32 && made.bytes().all(|b| b.is_ascii_hexdigit()),
        "{made}"
    );
    assert_eq!(v["error"]["request_id"], made.as_str());
    let long = "x".repeat(200);
    let (_, replaced, _) = with_id("GET", &format!("{l}/livez"), Some(&long), None, None).await;
    assert_eq!(replaced.len(), 32, "{replaced}");

    // A write sent to a follower is relayed: the leader answers under the caller's id and
    // logs its work with it.
    let (s, echoed, v) = with_id(
        "POST",
        &format!("{f}/api/v1/admin/node-enrollments"),
        Some("relayed-3"),
        Some(ADMIN),
        Some(json!({"ttl_seconds": 600})),
    )
    .await;
    assert_eq!((s, echoed.as_str()), (201, "relayed-3"), "{v}");
    let logged = wait_until("the leader logs the relayed request's id", WAIT, || {
        let log = c.log(leader);
        async move {
            log.lines()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .find(|l| l["fields"]["message"] == "enrolment token created")
        }
    })
    .await;
    assert_eq!(logged["span"]["id"], "relayed-3", "{logged}");
    assert_eq!(logged["spans"][0]["name"], "request", "{logged}");
    // Every line a member logs is one JSON object.
    for id in 1..=3 {
        for line in c.log(id).lines().filter(|l| !l.trim().is_empty()) {
            assert!(
                serde_json::from_str::<Value>(line).is_ok(),
                "member {id} logged a line that is not JSON: {line}"
            );
        }
    }
}

/// `/readyz?verbose` of `url`: status and body.
async fn readiness(url: &str) -> (u16, Value) {
    call("GET", &format!("{url}/readyz?verbose"), None, None).await
}

fn checks(v: &Value) -> BTreeMap<String, bool> {
    v["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .map(|c| (c["name"].as_str().unwrap().to_string(), c["ok"] == true))
        .collect()
}

#[tokio::test]
async fn at_sigterm_readiness_fails_first_while_the_member_still_serves_then_it_exits() {
    let mut c = Cluster::start_with(1, &["--shutdown-delay", "3s"]).await;
    let url = c.url(1);
    let (s, v) = readiness(&url).await;
    assert_eq!(s, 200, "{v}");
    let names: BTreeSet<String> = checks(&v).into_keys().collect();
    for name in ["leader", "caught_up", "disk", "serving"] {
        assert!(names.contains(name), "{v}");
    }
    assert!(checks(&v).values().all(|ok| *ok), "{v}");
    assert_eq!(
        call("GET", &format!("{url}/livez"), None, None).await.0,
        200
    );

    assert!(c.signal(1, libc::SIGTERM));
    let (s, v) = wait_until("readiness fails", WAIT, || {
        let url = url.clone();
        async move {
            let (s, v) = readiness(&url).await;
            (s == 503).then_some((s, v))
        }
    })
    .await;
    assert_eq!(s, 503);
    assert!(!checks(&v)["serving"], "{v}");
    assert_eq!(v["ready"], false);
    // Still serving while it drains: liveness and reads answer.
    assert_eq!(
        call("GET", &format!("{url}/livez"), None, None).await.0,
        200
    );
    let (s, _) = call(
        "GET",
        &format!("{url}/api/v1/admin/node-enrollments"),
        Some(ADMIN),
        None,
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(c.wait_exit(1).await, 0);
}

#[tokio::test]
async fn under_systemd_the_member_says_ready_once_ready_and_stopping_at_sigterm() {
    let mut c = Cluster::unstarted(1, &[]);
    // systemd's notification socket, played by the test.
    let socket = c.root().join("notify.sock");
    let notify = tokio::net::UnixDatagram::bind(&socket).unwrap();
    c.env.push((
        "NOTIFY_SOCKET".to_string(),
        socket.to_string_lossy().into_owned(),
    ));
    c.start_all().await;
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(WAIT, notify.recv(&mut buf))
        .await
        .expect("READY=1 within the wait")
        .unwrap();
    assert_eq!(std::str::from_utf8(&buf[..n]).unwrap().trim(), "READY=1");
    // Sent once the member was ready: readiness holds now.
    assert_eq!(readiness(&c.url(1)).await.0, 200);
    assert!(c.signal(1, libc::SIGTERM));
    let n = tokio::time::timeout(WAIT, notify.recv(&mut buf))
        .await
        .expect("STOPPING=1 at SIGTERM")
        .unwrap();
    assert_eq!(std::str::from_utf8(&buf[..n]).unwrap().trim(), "STOPPING=1");
    assert_eq!(c.wait_exit(1).await, 0);
}

#[tokio::test]
async fn with_metrics_auth_a_scrape_needs_an_admin_token() {
    let mut c = Cluster::start_with(1, &["--metrics-auth"]).await;
    c.wait_ready().await;
    let url = format!("{}/metrics", c.url(1));
    let r = http().get(&url).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let r = http()
        .get(&url)
        .bearer_auth("wrong-token-0123456789abcdef")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = http().get(&url).bearer_auth(ADMIN).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.text().await.unwrap().contains("modelforge_build_info"));
}
