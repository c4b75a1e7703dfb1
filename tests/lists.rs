//! Lists that scale and can be watched, over real processes: pages (`limit`, `after`, `next`)
//! of enrolments, nodes, credentials and audit that cover each list exactly once, and blocking
//! queries (`index`, `wait`, `X-Modelforge-Index`) that wake on a change, time out with the same
//! answer, pass through a follower's relay, and drive `modelforge admin nodes show --watch`
//! until it prints the node offline after its agent stopped.

mod common;

use std::time::Duration;
use std::time::Instant;

use common::*;
use modelforge_proto::api;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio::io::AsyncBufReadExt;

/// An admin GET: status, body and `X-Modelforge-Index`.
async fn get(url: &str) -> (u16, Value, Option<u64>) {
    let r = http()
        .get(url)
        .bearer_auth(ADMIN)
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    let status = r.status().as_u16();
    let index = r
        .headers()
        .get("x-modelforge-index")
        .and_then(|v| v.to_str().ok())
        .map(|v| v.parse().expect("the index is an integer"));
    (status, r.json().await.unwrap_or(Value::Null), index)
}

/// Every page of `path` at `limit` items a page: the items of `field`, and the pages read.
async fn all_pages<T: DeserializeOwned>(
    base: &str,
    path: &str,
    field: &str,
    limit: usize,
) -> (Vec<T>, usize) {
    let sep = if path.contains('?') { '&' } else { '?' };
    let (mut items, mut pages, mut after) = (vec![], 0, None::<String>);
    loop {
        let mut url = format!("{base}{path}{sep}limit={limit}");
        if let Some(a) = &after {
            url.push_str(&format!("&after={a}"));
        }
        let (s, v, _) = get(&url).await;
        assert_eq!(s, 200, "{url}: {v}");
        let page = v[field].as_array().expect("the list's field").clone();
        assert!(page.len() <= limit, "{url}: {} items", page.len());
        pages += 1;
        items.extend(
            page.into_iter()
                .map(|i| serde_json::from_value(i).expect("an item of the list")),
        );
        match &v["next"] {
            Value::Null => {
                assert!(v.get("next").is_some(), "`next` is always there: {v}");
                return (items, pages);
            }
            Value::String(n) => after = Some(n.clone()),
            other => panic!("next is a string or null, not {other}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_cover_every_list_exactly_once_in_order() {
    let mut c = Cluster::start(1).await;
    let url = c.url(1);
    // 105 tokens: more than a default page.
    for _ in 0..103 {
        c.new_token(600).await;
    }
    // A node with two credentials (lost credential, re-enrolled), and a second node.
    let t1 = c.new_token(600).await;
    let mut a = Agent::new(c.root(), "a", c.urls());
    a.start(Some(&t1));
    let (nid, _) = a.wait_enrolled(None).await;
    a.stop();
    std::fs::remove_file(a.state_dir.join("credential")).unwrap();
    let t2 = c.new_token(600).await;
    a.start(Some(&t2));
    a.wait_enrolled(None).await;
    let (_b, other, _) = c.enrol_one("b").await;

    // Enrolments: the default page is 100, and pages of 7 cover all 106 once, in id order.
    let (s, first, _) = get(&format!("{url}/api/v1/admin/node-enrollments")).await;
    assert_eq!(s, 200);
    assert_eq!(first["enrollments"].as_array().unwrap().len(), 100);
    assert!(first["next"].is_string(), "more follow: {}", first["next"]);
    let (tokens, pages): (Vec<api::Enrollment>, _) =
        all_pages(&url, "/api/v1/admin/node-enrollments", "enrollments", 7).await;
    assert_eq!(tokens.len(), 106);
    assert_eq!(pages, 106usize.div_ceil(7));
    let ids: Vec<String> = tokens.iter().map(|t| t.enrollment_id.to_string()).collect();
    let mut sorted = ids.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(ids, sorted, "in id order, each once");

    // Nodes, with and without a filter.
    let (nodes, pages): (Vec<api::NodeSummary>, _) =
        all_pages(&url, "/api/v1/admin/hardware/nodes", "nodes", 1).await;
    let mut ids: Vec<String> = nodes.iter().map(|n| n.node_id.to_string()).collect();
    assert_eq!(pages, 2);
    ids.sort();
    let mut want = vec![nid.clone(), other.clone()];
    want.sort();
    assert_eq!(ids, want);
    let (filtered, _): (Vec<api::NodeSummary>, _) = all_pages(
        &url,
        &format!("/api/v1/admin/hardware/nodes?hostname={}", a.hostname),
        "nodes",
        1,
    )
    .await;
    let filtered: Vec<String> = filtered.iter().map(|n| n.node_id.to_string()).collect();
    assert_eq!(filtered, vec![nid.clone()]);

    // Credentials: oldest first, a page each; the counts are the node's, not the page's.
    let path = format!("/api/v1/admin/hardware/nodes/{nid}/credentials");
    let (s, page, _) = get(&format!("{url}{path}?limit=1")).await;
    assert_eq!(s, 200);
    assert_eq!(
        (page["active"].as_u64(), page["revoked"].as_u64()),
        (Some(1), Some(1))
    );
    let (creds, pages): (Vec<api::CredentialView>, _) =
        all_pages(&url, &path, "credentials", 1).await;
    assert_eq!(pages, 2);
    assert!(
        creds[0].revoked_at.is_some(),
        "the lost one first: {creds:?}"
    );
    assert!(creds[1].revoked_at.is_none());

    // Audit: pages of 9 are the whole trail, seq 1, 2, 3, ... with no gap or repeat.
    let (events, _): (Vec<api::AuditEventView>, _) =
        all_pages(&url, "/api/v1/admin/audit", "events", 9).await;
    let seqs: Vec<u64> = events.iter().map(|e| e.record.seq).collect();
    assert!(seqs.len() > 106, "{} events", seqs.len());
    assert_eq!(seqs, (1..=seqs.len() as u64).collect::<Vec<_>>());
    let (s, v, _) = get(&format!("{url}/api/v1/admin/audit")).await;
    assert_eq!(s, 200);
    assert_eq!(v["events"].as_array().unwrap().len(), 100, "default page");
    // The CLI follows `next`: it lists every event.
    let (code, v) = admin_json(&url, &["audit", "list"]).await;
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["events"].as_array().unwrap().len(), seqs.len());
    assert_eq!(v["next"], Value::Null);
    let (code, v) = admin_json(&url, &["enrollments", "list"]).await;
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["enrollments"].as_array().unwrap().len(), 106);

    // Bad paging is 400 invalid_query, on every list.
    for q in [
        "limit=0",
        "limit=1001",
        "limit=x",
        "after=%20bad%20",
        "nope=1",
    ] {
        for list in [
            "/api/v1/admin/node-enrollments".to_string(),
            "/api/v1/admin/hardware/nodes".to_string(),
            path.clone(),
            "/api/v1/admin/audit".to_string(),
        ] {
            let (s, v, _) = get(&format!("{url}{list}?{q}")).await;
            assert_eq!(refused(s, &v), (400, "invalid_query"), "{list}?{q}: {v}");
        }
    }
    for q in ["index=x", "index=1&wait=forever", "index=1&wait=6m"] {
        let (s, v, _) = get(&format!("{url}/api/v1/admin/hardware/nodes?{q}")).await;
        assert_eq!(refused(s, &v), (400, "invalid_query"), "{q}: {v}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocking_query_wakes_on_a_change_and_the_cli_watch_sees_a_node_go_offline() {
    let mut c = Cluster::start_with(3, &["--stale-after", "2s", "--offline-after", "4s"]).await;
    let leader = c.wait_leader().await;
    let follower = (1..=3).find(|i| *i != leader).unwrap();
    let (f, l) = (c.url(follower), c.url(leader));
    let nodes = format!("{f}/api/v1/admin/hardware/nodes");

    // Through a follower's relay: the leader's index comes back.
    let (s, _, index) = get(&nodes).await;
    assert_eq!(s, 200);
    let index = index.expect("X-Modelforge-Index on the node list, relayed");
    assert!(index >= 1);

    // A wait that times out answers 200 with the same body (unless something changed).
    let t0 = Instant::now();
    let (s, v, after) = get(&format!("{nodes}?index={index}&wait=700ms")).await;
    assert_eq!(s, 200, "{v}");
    let after = after.unwrap();
    assert!(
        after > index || t0.elapsed() >= Duration::from_millis(650),
        "answered after {:?} with the same index {after}",
        t0.elapsed()
    );

    // A change wakes a long wait at once: the waiter returns with a larger index.
    let now = get(&nodes).await.2.unwrap();
    let waiter = tokio::spawn({
        let url = format!("{nodes}?index={now}&wait=2m");
        async move {
            let t0 = Instant::now();
            let r = get(&url).await;
            (r, t0.elapsed())
        }
    });
    c.new_token(600).await;
    let ((s, v, woke), took) = waiter.await.unwrap();
    assert_eq!(s, 200, "{v}");
    assert!(woke.unwrap() > now);
    assert!(took < Duration::from_secs(60), "woke after {took:?}");

    // The watch: the CLI prints the node each time it changes, until it shows it offline.
    let (mut a, nid, _) = c.enrol_one("w").await;
    let mut cli = tokio::process::Command::new(server_bin())
        .args([
            "admin", "--output", "json", "nodes", "show", &nid, "--watch",
        ])
        .env("MODELFORGE_URL", c.urls().join(","))
        .env("MODELFORGE_CACERT", &harness_ca().cert)
        .env("MODELFORGE_ADMIN_TOKEN", ADMIN)
        .env("MODELFORGE_LOG", "warn")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("run the watch");
    let mut lines = tokio::io::BufReader::new(cli.stdout.take().unwrap()).lines();
    let mut next_status = async || {
        let line = tokio::time::timeout(WAIT, lines.next_line())
            .await
            .expect("the watch printed within 30 s")
            .unwrap()
            .expect("the watch is still running");
        let d: api::NodeDetail = serde_json::from_str(&line).expect("one JSON document a line");
        d.summary.status.to_string()
    };
    // Printed at once, then again when its first heartbeat makes it online.
    let mut seen = vec![next_status().await];
    let deadline = Instant::now() + WAIT;
    while seen.last().unwrap() != "online" {
        assert!(Instant::now() < deadline, "never online: {seen:?}");
        seen.push(next_status().await);
    }
    a.stop();
    while seen.last().unwrap() != "offline" {
        assert!(Instant::now() < deadline, "never offline: {seen:?}");
        seen.push(next_status().await);
    }
    // A node's view answers its index too, on the leader and relayed.
    for base in [&l, &f] {
        let (s, _, i) = get(&format!("{base}/api/v1/admin/hardware/nodes/{nid}")).await;
        assert_eq!(s, 200);
        assert!(i.is_some());
    }
}
