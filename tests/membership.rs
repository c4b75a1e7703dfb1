//! Online membership changes over real processes: a cluster grows from 1 to 3 members started
//! with `--join`, shrinks back to 1, all under steady writes and reads with no refused good
//! request; a removed id is never accepted again, and the last voter cannot be removed.

mod common;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use modelforge_proto::api;
use serde_json::json;

/// A member started with `--join <join>` on an empty data dir under `root`.
struct Joiner {
    url: String,
    proc: devkit::Proc,
}

fn start_joiner(root: &std::path::Path, id: u64, join: &str) -> Joiner {
    let port = free_port();
    let data_dir = root.join(format!("joiner{id}"));
    let extra = vec!["--join".to_string(), join.to_string()];
    let args = devkit::MemberSpec {
        id,
        port,
        data_dir: &data_dir,
        peers: &[],
        routes: &[],
        extra: &extra,
    }
    .args();
    let log = root.join(format!("joiner{id}.log"));
    Joiner {
        url: devkit::url(port),
        proc: spawn(&server_bin(), &args, &log, &MEMBER_ENV),
    }
}

/// Run `modelforge admin <args> --output json` against `url`: (exit code, JSON out).
async fn admin_json(url: &str, args: &[&str]) -> (i32, serde_json::Value) {
    let out = tokio::process::Command::new(server_bin())
        .arg("admin")
        .args(args)
        .args(["--output", "json"])
        .env("MODELFORGE_URL", url)
        .env("MODELFORGE_CACERT", &harness_ca().cert)
        .env("MODELFORGE_ADMIN_TOKEN", ADMIN)
        .env("MODELFORGE_LOG", "warn")
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .expect("run modelforge admin");
    let text = String::from_utf8_lossy(&out.stdout);
    let v = serde_json::from_str(&text).unwrap_or_else(
        |_| json!({"stdout": text, "stderr": String::from_utf8_lossy(&out.stderr)}),
    );
    (out.status.code().unwrap_or(-1), v)
}

async fn members_of(url: &str) -> Option<Vec<api::ClusterMember>> {
    devkit::cluster_view(&http(), url, ADMIN, Duration::from_secs(5))
        .await
        .map(|v| v.members)
}

/// Steady load on `url` until `stop`: an enrolment token created (a replicated write) and the
/// cluster view read, back to back; counts what was not answered 2xx.
fn steady_load(
    url: String,
    stop: Arc<AtomicBool>,
) -> (
    Arc<AtomicUsize>,
    Arc<AtomicUsize>,
    tokio::task::JoinHandle<()>,
) {
    let (ok, bad) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (o, b) = (ok.clone(), bad.clone());
    let task = tokio::spawn(async move {
        while !stop.load(Ordering::SeqCst) {
            let (s, v) = call(
                "POST",
                &format!("{url}/api/v1/admin/node-enrollments"),
                Some(ADMIN),
                Some(json!({"note": "steady"})),
            )
            .await;
            let (r, _) = call("GET", &format!("{url}/api/v1/cluster"), Some(ADMIN), None).await;
            if s == 201 && r == 200 {
                o.fetch_add(1, Ordering::SeqCst);
            } else {
                eprintln!("refused under membership change: {s} {v} / {r}");
                b.fetch_add(1, Ordering::SeqCst);
            }
        }
    });
    (ok, bad, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grow_from_one_to_three_and_back_under_load() {
    let mut c = Cluster::start(1).await;
    let leader = c.url(1);
    let stop = Arc::new(AtomicBool::new(false));
    // Four clients, each a write and a read back to back, for the whole test.
    let loads: Vec<_> = (0..4)
        .map(|_| steady_load(leader.clone(), stop.clone()))
        .collect();

    // Two members wait to be added; until then they refuse client requests and say why.
    let j2 = start_joiner(c.root(), 2, &leader);
    let j3 = start_joiner(c.root(), 3, &leader);
    let (s, v) = wait_until("the joiner answers", WAIT, || {
        let url = j2.url.clone();
        async move {
            let (s, v) = call(
                "GET",
                &format!("{url}/api/v1/admin/node-enrollments"),
                Some(ADMIN),
                None,
            )
            .await;
            (s != 0).then_some((s, v))
        }
    })
    .await;
    assert_eq!(refused(s, &v), (503, "not_a_member"), "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("members add 2"),
        "{v}"
    );

    // A single voter has no margin: the cluster doctor says so (exit 21).
    let (code, v) = admin_json(&leader, &["doctor", "--cluster"]).await;
    assert_eq!(
        (code, v["verdict"].as_str()),
        (21, Some("quorum_at_risk")),
        "{v}"
    );
    // Grow: 1 -> 2 -> 3, each a learner first, then a voter once caught up (2 through the
    // API, 3 through the CLI).
    for j in [(2u64, &j2)] {
        let (s, v) = call(
            "POST",
            &format!("{leader}/api/v1/admin/cluster/members"),
            Some(ADMIN),
            Some(json!({"id": j.0, "url": j.1.url})),
        )
        .await;
        assert_eq!(s, 200, "adding member {}: {v}", j.0);
        let view: api::MembersView = typed("members", &v);
        let m = view.members.iter().find(|m| m.id == j.0).unwrap();
        assert_eq!(m.role, "voter", "{v}");
    }
    let (code, v) = admin_json(&leader, &["members", "add", "3", &j3.url]).await;
    assert_eq!(code, 0, "{v}");
    assert!(
        v["members"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["id"] == 3 && m["role"] == "voter"),
        "{v}"
    );
    // Adding a member twice: 409.
    let (s, v) = call(
        "POST",
        &format!("{leader}/api/v1/admin/cluster/members"),
        Some(ADMIN),
        Some(json!({"id": 3, "url": j3.url})),
    )
    .await;
    assert_eq!(refused(s, &v), (409, "member_exists"), "{v}");
    // The leader reports every member's role, progress and reachability; the new members
    // hold the state and serve it.
    let view = wait_until("three reachable voters", WAIT, || {
        let leader = leader.clone();
        async move {
            let m = members_of(&leader).await?;
            (m.len() == 3
                && m.iter().all(|m| {
                    m.role == "voter" && m.reachable == Some(true) && m.matched_index.is_some()
                }))
            .then_some(m)
        }
    })
    .await;
    assert_eq!(view.iter().map(|m| m.id).collect::<Vec<_>>(), [1, 2, 3]);
    // Asked through a follower, the doctor reads the leader's figures: healthy, one voter may
    // fail (exit 0).
    let (code, v) = admin_json(&j3.url, &["doctor", "--cluster"]).await;
    assert_eq!(
        (code, v["verdict"].as_str(), v["margin"].as_i64()),
        (0, Some("healthy"), Some(1)),
        "{v}"
    );
    for url in [&j2.url, &j3.url] {
        let (s, v) = call(
            "GET",
            &format!("{url}/api/v1/admin/node-enrollments"),
            Some(ADMIN),
            None,
        )
        .await;
        assert_eq!(s, 200, "a new member serves: {v}");
    }

    // Shrink: remove 2, then 3; the last voter stays.
    for id in [2u64, 3] {
        let (s, v) = call(
            "DELETE",
            &format!("{leader}/api/v1/admin/cluster/members/{id}"),
            Some(ADMIN),
            None,
        )
        .await;
        assert_eq!(s, 200, "removing member {id}: {v}");
        let view: api::MembersView = typed("members", &v);
        assert!(view.members.iter().all(|m| m.id != id), "{v}");
    }
    let (s, v) = call(
        "DELETE",
        &format!("{leader}/api/v1/admin/cluster/members/1"),
        Some(ADMIN),
        None,
    )
    .await;
    assert_eq!(refused(s, &v), (409, "last_voter"), "{v}");
    // A removed id is never accepted again, even for a fresh machine.
    let (s, v) = call(
        "POST",
        &format!("{leader}/api/v1/admin/cluster/members"),
        Some(ADMIN),
        Some(json!({"id": 2, "url": j2.url})),
    )
    .await;
    assert_eq!(refused(s, &v), (409, "member_id_retired"), "{v}");
    // A removed member that learned of its removal refuses client requests and says why.
    let (s, v) = call(
        "GET",
        &format!("{}/api/v1/admin/node-enrollments", j2.url),
        Some(ADMIN),
        None,
    )
    .await;
    assert_eq!(refused(s, &v), (503, "not_a_member"), "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("removed"),
        "{v}"
    );

    // Every change is in the audit trail with its actor.
    let audit = c.audit_events().await;
    for action in ["cluster.member.add", "cluster.member.remove"] {
        assert!(
            audit.iter().any(|e| e.record.action == action
                && e.record.actor == "root"
                && e.record.result == "ok"),
            "no {action} in the audit trail"
        );
    }

    stop.store(true, Ordering::SeqCst);
    for (ok, bad, task) in loads {
        task.await.unwrap();
        assert_eq!(bad.load(Ordering::SeqCst), 0, "good requests were refused");
        assert!(ok.load(Ordering::SeqCst) > 0, "the load ran");
    }
    drop((j2.proc, j3.proc));
}
