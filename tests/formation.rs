//! Start-up over real processes: a member that lost its Raft store refuses to start, and a
//! member whose data dir was wiped rejoins its cluster instead of founding another.

mod common;

use common::*;

/// Member `id`'s own view: (state, term, member ids), if it answers.
async fn own_view(c: &Cluster, id: u64) -> Option<(String, u64, Vec<u64>)> {
    let v = c.cluster_view(id).await?;
    let members = v.members.iter().map(|m| m.id).collect();
    Some((v.state, v.term, members))
}

/// ARCHITECTURE.md, "Durability": a database that opens without its vote while the marker
/// beside it says it held one refuses to start (deleted, or replaced by an empty store).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_whose_raft_store_is_lost_but_whose_marker_remains_refuses_to_start() {
    let mut c = Cluster::start(1).await;
    c.new_token(600).await;
    c.kill9(1);
    let raft = c.data_dir(1).join("raft");
    let store = raft.join("raft-log.redb");
    assert!(
        raft.join("raft-log.has-state").exists(),
        "the first vote leaves the marker"
    );
    std::fs::remove_file(&store).unwrap();

    for attempt in ["the store deleted", "the store replaced by an empty one"] {
        let logged_before = c.log(1).len();
        c.start_member(1);
        let code = c.wait_exit(1).await;
        let log = c.log(1)[logged_before..].to_string();
        assert_eq!(code, 1, "{attempt}: exit code {code}; log: {log}");
        assert!(
            log.contains("opened without the vote it is known to have held")
                && log.contains("refusing to start")
                && log.contains(&store.display().to_string()),
            "{attempt}: no clear reason in the log: {log}"
        );
        assert!(
            !log.contains("member started"),
            "{attempt}: it served before refusing: {log}"
        );
    }
}

/// ARCHITECTURE.md, "Cluster formation": a member whose data was wiped waits to be replicated
/// to instead of founding a second cluster, whether its peers are up when it comes back or
/// not (then it campaigns for the old membership, which it cannot win alone, until they are).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wiped_member_rejoins_its_cluster_and_never_founds_another() {
    let mut c = Cluster::start(3).await;
    for _ in 0..3 {
        c.new_token(600).await;
    }
    let before = c.wait_converged().await;
    let leader = c.wait_leader().await;
    let wiped = c.ids.iter().copied().find(|i| *i != leader).unwrap();

    // Its peers are up: it asks them, finds a cluster and is replicated to.
    c.kill9(wiped);
    std::fs::remove_dir_all(c.data_dir(wiped)).unwrap();
    let logged_before = c.log(wiped).len();
    c.start_member(wiped);
    let this = &c;
    wait_until(
        "the wiped member holds the cluster's state",
        WAIT,
        || async {
            let view = own_view(this, wiped).await;
            // No membership until it is replicated to; never another one.
            if let Some((state, _, members)) = &view {
                assert!(
                    members.is_empty() || members == &[1, 2, 3],
                    "another membership: {view:?}"
                );
                assert_ne!(state, "Leader", "it led before catching up: {view:?}");
            }
            (this.digest(wiped).await?.0 == before).then_some(())
        },
    )
    .await;
    let log = c.log(wiped)[logged_before..].to_string();
    assert!(
        log.contains("a peer already belongs to a cluster: waiting to be replicated to"),
        "{log}"
    );
    assert!(!log.contains("cluster initialised"), "{log}");
    // Every member, the leader included, still applies what is written.
    c.new_token(600).await;
    let before = c.wait_converged().await;

    // Its peers are down: it can only initialise the same three-member membership, and
    // campaigns for it without winning (it asks for pre-votes nobody answers, so it raises no
    // term); when they return it follows them and their state.
    for id in c.ids.clone() {
        c.kill9(id);
    }
    std::fs::remove_dir_all(c.data_dir(wiped)).unwrap();
    let logged_before = c.log(wiped).len();
    c.start_member(wiped);
    let this = &c;
    wait_until(
        "the lone wiped member to campaign and lose",
        WAIT,
        || async {
            let view = own_view(this, wiped).await?;
            // Empty until it has asked its peers (1 s each) and initialised; never another.
            assert!(
                view.2.is_empty() || view.2 == [1, 2, 3],
                "another membership: {view:?}"
            );
            assert_ne!(view.0, "Leader", "it led a cluster alone: {view:?}");
            let campaigned = this.log(wiped)[logged_before..].contains("requesting pre-vote");
            (view.2 == [1, 2, 3] && campaigned).then_some(())
        },
    )
    .await;
    let lone = c.log(wiped)[logged_before..].to_string();
    assert!(!lone.contains("became leader"), "{lone}");
    for id in c.ids.clone() {
        if id != wiped {
            c.start_member(id);
        }
    }
    c.wait_ready().await;
    assert_eq!(
        c.wait_converged().await,
        before,
        "the members' state is not the cluster's"
    );
}
