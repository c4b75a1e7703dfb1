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

async fn members_of(url: &str) -> Option<Vec<api::ClusterMember>> {
    devkit::cluster_view(&http(), url, ADMIN, Duration::from_secs(5))
        .await
        .map(|v| v.members)
}

/// A client loop running until [`Load::finish`]: each round is one call of `round`, true when it
/// got the answer a good request must get.
struct Load {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicUsize>,
    bad: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Load {
    fn spawn<F, Fut>(mut round: F) -> Self
    where
        F: FnMut() -> Fut + Send + 'static,
        Fut: std::future::Future<Output = bool> + Send,
    {
        let stop = Arc::new(AtomicBool::new(false));
        let (ok, bad) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (s, o, b) = (stop.clone(), ok.clone(), bad.clone());
        let task = tokio::spawn(async move {
            while !s.load(Ordering::SeqCst) {
                let counter = if round().await { &o } else { &b };
                counter.fetch_add(1, Ordering::SeqCst);
            }
        });
        Load {
            stop,
            ok,
            bad,
            task,
        }
    }

    /// Stop it; every round must have succeeded, and at least one ran.
    async fn finish(self, what: &str) {
        self.stop.store(true, Ordering::SeqCst);
        self.task.await.unwrap();
        assert_eq!(
            self.bad.load(Ordering::SeqCst),
            0,
            "{what}: a good request failed"
        );
        assert!(
            self.ok.load(Ordering::SeqCst) > 0,
            "{what}: the load never ran"
        );
    }
}

/// Steady load on `url`: an enrolment token created (a replicated write) and the cluster view
/// read, back to back; both must succeed at once.
fn steady_load(url: String) -> Load {
    Load::spawn(move || {
        let url = url.clone();
        async move {
            let (s, v) = call(
                "POST",
                &format!("{url}/api/v1/admin/node-enrollments"),
                Some(ADMIN),
                Some(json!({"note": "steady"})),
            )
            .await;
            let (r, _) = call("GET", &format!("{url}/api/v1/cluster"), Some(ADMIN), None).await;
            if s != 201 || r != 200 {
                eprintln!("refused under membership change: {s} {v} / {r}");
            }
            s == 201 && r == 200
        }
    })
}

/// Whether `send(url)` answers `want` from some member of `urls`, trying them in turn for up
/// to `within` (as agents and the admin CLI do).
async fn any_member<F, Fut>(urls: &[String], within: Duration, want: u16, send: F) -> bool
where
    F: Fn(String) -> Fut,
    Fut: std::future::Future<Output = u16>,
{
    let deadline = tokio::time::Instant::now() + within;
    while tokio::time::Instant::now() < deadline {
        for url in urls {
            if send(url.clone()).await == want {
                return true;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// One heartbeat of `node_id` sent to `url`: (status, body).
async fn heartbeat(url: &str, node_id: &str, credential: &str) -> (u16, serde_json::Value) {
    call(
        "POST",
        &format!("{url}/api/v1/agent/nodes/{node_id}/heartbeat"),
        Some(credential),
        Some(json!({})),
    )
    .await
}

/// [`heartbeat`] with owned arguments, for a closure's future.
async fn heartbeat_owned(
    url: String,
    node_id: String,
    credential: String,
) -> (u16, serde_json::Value) {
    heartbeat(&url, &node_id, &credential).await
}

/// Heartbeats of one node, agent-like: each beat goes to the members in turn until one
/// answers 200 within 5 s.
fn heartbeat_loop(urls: Vec<String>, node_id: String, credential: String) -> Load {
    Load::spawn(move || {
        let (urls, node_id, credential) = (urls.clone(), node_id.clone(), credential.clone());
        async move {
            let ok = any_member(&urls, Duration::from_secs(5), 200, |url| {
                let (node_id, credential) = (node_id.clone(), credential.clone());
                async move { heartbeat(&url, &node_id, &credential).await.0 }
            })
            .await;
            tokio::time::sleep(Duration::from_millis(50)).await;
            ok
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grow_from_one_to_three_and_back_under_load() {
    let mut c = Cluster::start(1).await;
    let leader = c.url(1);
    // Four clients, each a write and a read back to back, for the whole test.
    let loads: Vec<Load> = (0..4).map(|_| steady_load(leader.clone())).collect();

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
    // Another id at a member's address (the API fuzz found it "caught up" at once and voted
    // twice): 409, and the configuration is unchanged.
    let (s, v) = call(
        "POST",
        &format!("{leader}/api/v1/admin/cluster/members"),
        Some(ADMIN),
        Some(json!({"id": 99, "url": format!("{}/", j3.url)})),
    )
    .await;
    assert_eq!(refused(s, &v), (409, "member_exists"), "{v}");
    assert!(
        !members_of(&leader)
            .await
            .unwrap()
            .iter()
            .any(|m| m.id == 99)
    );
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

    for load in loads {
        load.finish("writes and reads on the leader").await;
    }
    drop((j2.proc, j3.proc));
}

/// A member whose disk died (data dir wiped for good) is replaced online: a new member under a
/// fresh id is added and the dead one removed, while the node keeps getting 200. Then the
/// leader is asked to remove itself: it hands leadership over first, and the retry removes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_member_is_replaced_and_a_leader_removes_itself_while_heartbeats_get_200() {
    let mut c = Cluster::start(3).await;
    let (mut agent, node_id, credential) = c.enrol_one("gpu-a").await;
    let leader = c.wait_leader().await;
    let dead = (1..=3).find(|id| *id != leader).unwrap();
    let stays = (1..=3).find(|id| *id != leader && *id != dead).unwrap();
    let beats = heartbeat_loop(
        vec![c.url(stays), c.url(leader)],
        node_id.clone(),
        credential.clone(),
    );

    // The follower's disk dies: the process is gone and so is its data, for good.
    c.kill9(dead);
    std::fs::remove_dir_all(c.data_dir(dead)).unwrap();
    // Within a few seconds the cluster doctor sees it: no margin left, the member unreachable.
    let v = wait_until("the doctor sees the dead member", WAIT, || {
        let url = c.url(leader);
        async move {
            let (code, v) = admin_json(&url, &["doctor", "--cluster"]).await;
            (code == 21).then_some(v)
        }
    })
    .await;
    assert_eq!(v["verdict"], "quorum_at_risk", "{v}");
    assert!(
        v["unreachable"].as_array().unwrap().contains(&json!(dead)),
        "{v}"
    );

    // A new machine joins under a fresh id, is added, and the dead member is removed.
    let started = std::time::Instant::now();
    let j4 = start_joiner(c.root(), 4, &c.url(leader));
    let (code, v) = admin_json(&c.url(stays), &["members", "add", "4", &j4.url]).await;
    assert_eq!(code, 0, "{v}");
    let added = started.elapsed();
    let (code, v) = admin_json(&c.url(stays), &["members", "remove", &dead.to_string()]).await;
    assert_eq!(code, 0, "{v}");
    // The figures for the operator's runbook (printed; not a target of this test).
    println!(
        "member replacement: new member started and added as a voter in {} ms, dead member removed {} ms after the start",
        added.as_millis(),
        started.elapsed().as_millis()
    );
    let ids: Vec<u64> = v["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_u64().unwrap())
        .collect();
    let mut want = vec![leader, stays, 4];
    want.sort();
    assert_eq!(ids, want, "{v}");
    wait_until("the cluster is healthy again", WAIT, || {
        let url = c.url(leader);
        async move {
            let (code, _) = admin_json(&url, &["doctor", "--cluster"]).await;
            (code == 0).then_some(())
        }
    })
    .await;
    // The new member holds the node and serves it.
    let (s, v) = call(
        "GET",
        &format!("{}/api/v1/admin/hardware/nodes/{node_id}", j4.url),
        Some(ADMIN),
        None,
    )
    .await;
    assert_eq!(s, 200, "{v}");

    // The leader asked to remove itself hands leadership over (503, retry) and the retry,
    // relayed to the new leader, removes it.
    let (s, v) = call(
        "DELETE",
        &format!("{}/api/v1/admin/cluster/members/{leader}", c.url(leader)),
        Some(ADMIN),
        None,
    )
    .await;
    assert_eq!(refused(s, &v), (503, "not_leader"), "{v}");
    let v = wait_until("the old leader is removed", WAIT, || {
        let url = c.url(stays);
        async move {
            let (s, v) = call(
                "DELETE",
                &format!("{url}/api/v1/admin/cluster/members/{leader}"),
                Some(ADMIN),
                None,
            )
            .await;
            (s == 200).then_some(v)
        }
    })
    .await;
    let view: api::MembersView = typed("members", &v);
    assert!(view.members.iter().all(|m| m.id != leader), "{v}");
    assert_eq!(view.members.len(), 2, "{v}");

    beats.finish("heartbeats").await;
    agent.stop();
    drop(j4.proc);
}

/// A removed member's answers to agents send them elsewhere (503), never a 401, which an agent
/// takes for a dead credential and re-enrols over. Chaos seed 1592590340 found agents of a
/// member being replaced answered 401 `peer_unauthenticated`: the member did not hold its
/// removal yet, relayed their heartbeats, and the leader refused the *member*. That window is
/// too short to hit here at will (a member paused through its removal stands for election once
/// it wakes and answers `no_leader`); the relay's answer to a leader refusing its member is
/// pinned by `forward::tests::the_leader_refusing_this_member_is_not_a_member_never_the_clients_401`,
/// and this test holds the whole path over real processes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_member_that_did_not_hear_of_it_sends_agents_elsewhere() {
    let mut c = Cluster::start(3).await;
    let (mut agent, node_id, credential) = c.enrol_one("gpu-a").await;
    agent.stop();
    let leader = c.wait_leader().await;
    let removed = (1..=3).find(|id| *id != leader).unwrap();
    let beat = |url: String| heartbeat_owned(url, node_id.clone(), credential.clone());
    // The follower relays heartbeats while it is a member.
    let (s, v) = beat(c.url(removed)).await;
    assert_eq!(s, 200, "{v}");

    let (s, v) = call(
        "DELETE",
        &format!("{}/api/v1/admin/cluster/members/{removed}", c.url(leader)),
        Some(ADMIN),
        None,
    )
    .await;
    assert_eq!(s, 200, "{v}");

    // Straight after (whether or not it applied its removal) and for a while after (it stands
    // for election once the leader is silent): every heartbeat it answers is a 503 that sends
    // the agent to another member, the first one saying why.
    let mut first = None;
    let until = tokio::time::Instant::now() + Duration::from_secs(3);
    while tokio::time::Instant::now() < until {
        let (s, v) = beat(c.url(removed)).await;
        assert_eq!(s, 503, "a removed member answered a heartbeat {s}: {v}");
        first.get_or_insert(v);
    }
    let first = first.unwrap();
    assert_eq!(first["error"]["code"], "not_a_member", "{first}");
    // The node's credential is intact: the other members take its heartbeats.
    let (s, v) = beat(c.url(leader)).await;
    assert_eq!(s, 200, "{v}");
}

/// 3 -> 5 members with the leader killed (-9) in the middle of adding the fourth: the add is
/// retried against the new leader and finishes, the old leader comes back as a follower, and
/// every heartbeat still gets 200 (agent-like: any member, within 5 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_to_five_members_with_a_leader_kill_in_the_middle() {
    let mut c = Cluster::start(3).await;
    let (mut agent, node_id, credential) = c.enrol_one("gpu-b").await;
    let beats = heartbeat_loop(c.urls(), node_id, credential);
    let leader = c.wait_leader().await;
    let j4 = start_joiner(c.root(), 4, &c.url(leader));
    let j5 = start_joiner(c.root(), 5, &c.url(leader));

    // The add of 4 starts on the leader, which is killed once 4 is in the configuration.
    let add = {
        let url = c.url(leader);
        let body = json!({"id": 4, "url": j4.url});
        tokio::spawn(async move {
            call(
                "POST",
                &format!("{url}/api/v1/admin/cluster/members"),
                Some(ADMIN),
                Some(body),
            )
            .await
        })
    };
    wait_until("member 4 is in the configuration", WAIT, || {
        let url = c.url(leader);
        async move {
            let m = members_of(&url).await?;
            m.iter().any(|m| m.id == 4).then_some(())
        }
    })
    .await;
    c.kill9(leader);
    let _ = add.await.unwrap();
    // The retry, through any member, lands on the new leader and finishes; then 5 is added.
    let all = c
        .urls()
        .into_iter()
        .filter(|u| *u != c.url(leader))
        .collect::<Vec<_>>()
        .join(",");
    // The add may have finished before the kill (or its answer been lost to it): then the
    // retry is told the member exists (409, the contract's answer), which is the same outcome.
    let (code, v) = admin_json(&all, &["members", "add", "4", &j4.url]).await;
    let landed = code == 0
        || v["stderr"]
            .as_str()
            .is_some_and(|e| e.contains("member_exists"));
    assert!(landed, "retrying the add of 4: {code} {v}");
    // The old leader returns on its data dir and follows.
    c.start_member(leader);
    let (code, v) = admin_json(&all, &["members", "add", "5", &j5.url]).await;
    assert_eq!(code, 0, "adding 5: {v}");
    let view = wait_until("five reachable voters", WAIT, || {
        let all = all.clone();
        async move {
            let (code, v) = admin_json(&all, &["doctor", "--cluster"]).await;
            (code == 0 && v["voters"] == 5 && v["reachable_voters"] == 5).then_some(v)
        }
    })
    .await;
    assert_eq!(view["margin"], 2, "{view}");
    // Every member reports the same configuration.
    for url in c.urls().iter().chain([&j4.url, &j5.url]) {
        let m = wait_until("a member sees the five voters", WAIT, || {
            let url = url.clone();
            async move {
                let m = members_of(&url).await?;
                (m.iter().filter(|m| m.voter).count() == 5).then_some(m)
            }
        })
        .await;
        assert_eq!(m.iter().map(|m| m.id).collect::<Vec<_>>(), [1, 2, 3, 4, 5]);
    }

    beats.finish("heartbeats").await;
    agent.stop();
    drop((j4.proc, j5.proc));
}

/// A rolling restart of every member, one at a time and the leader last (SIGTERM: a leader
/// that is stopped hands leadership over first), under heartbeats and writes: every heartbeat
/// and every write still succeeds, retried by the client across members as agents and the CLI
/// do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_refuses_no_good_request() {
    let mut c = Cluster::start(3).await;
    let (mut agent, node_id, credential) = c.enrol_one("gpu-c").await;
    let beats = heartbeat_loop(c.urls(), node_id, credential);
    // Writes, each retried across members for up to 10 s under one Idempotency-Key (as
    // `modelforge admin` does).
    let urls = c.urls();
    let writes = Load::spawn(move || {
        let urls = urls.clone();
        async move {
            let key = modelforge_proto::new_uuid();
            any_member(&urls, Duration::from_secs(10), 201, |url| {
                let key = key.clone();
                async move {
                    raw(
                        "POST",
                        &format!("{url}/api/v1/admin/node-enrollments"),
                        &[
                            ("authorization", &format!("Bearer {ADMIN}")),
                            ("content-type", "application/json"),
                            ("idempotency-key", &key),
                        ],
                        b"{}".to_vec(),
                    )
                    .await
                    .0
                }
            })
            .await
        }
    });
    let leader = c.wait_leader().await;
    let order: Vec<u64> = (1..=3).filter(|id| *id != leader).chain([leader]).collect();
    for id in order {
        assert!(c.signal(id, libc::SIGTERM), "member {id} was not running");
        c.wait_exit(id).await;
        if id == leader {
            assert!(
                c.log(id).contains("handed leadership over"),
                "the leader stopped without handing leadership over"
            );
        }
        c.start_member(id);
        c.wait_ready().await;
        wait_until("the restarted member caught up", WAIT, || {
            let c = &c;
            async move {
                let me = c.cluster_view(id).await?;
                let l = me.leader_id?;
                let lv = c.cluster_view(l).await?;
                (me.applied_index >= lv.commit_index).then_some(())
            }
        })
        .await;
    }
    beats.finish("heartbeats").await;
    writes.finish("writes").await;
    agent.stop();
}
