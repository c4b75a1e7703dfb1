//! The leader's lease decided from openraft's metrics (`Consensus::local_lease`,
//! ARCHITECTURE.md "Lease reads on the leader"), in process over real HTTPS (`common::Cluster`,
//! production timing: lease 300 ms).
//!
//! The local check must never say yes where openraft's own lease read would not: not once a
//! leadership transfer has started (the target's votes bypass the followers' leases), and never
//! past the lease after the leader is cut off from both followers (they elect another leader,
//! which commits writes the old one cannot see).

mod common;

use std::time::Duration;
use std::time::Instant;

use common::Cluster;
use common::wait_until;
use modelforge_raft::RaftTuning;

/// A leader with a lease it proves locally (its blank entry applied, a fresh acknowledgement).
async fn settled_leader(cluster: &Cluster) -> (u64, modelforge_raft::Consensus<common::Journal>) {
    let (id, leader, _) = cluster.write_via_leader("settle".into()).await;
    wait_until(
        "the leader to prove its lease from its metrics",
        Duration::from_secs(10),
        || async { leader.local_lease().then_some(()) },
    )
    .await;
    (id, leader)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_steady_leader_reads_locally_and_followers_never_do() {
    // A long lease (1.5 s), so that a loaded machine's stalls cannot end it in this second.
    let cluster = Cluster::start(
        3,
        RaftTuning {
            election_timeout_min_ms: 1000,
            election_timeout_max_ms: 1500,
            ..RaftTuning::default()
        },
    )
    .await;
    let (id, leader) = settled_leader(&cluster).await;
    // Over a second of steady leadership (heartbeats every 50 ms) the lease keeps holding, and
    // lease_read answers from it.
    let until = Instant::now() + Duration::from_secs(1);
    let mut checks = 0;
    while Instant::now() < until {
        assert!(leader.is_leader(), "leadership moved in a quiet cluster");
        assert!(leader.local_lease(), "a steady leader lost its local lease");
        leader.lease_read().await.unwrap();
        for (other, m) in &cluster.members {
            if *other != id {
                assert!(!m.get().await.unwrap().local_lease(), "follower {other}");
            }
        }
        checks += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(checks > 10, "{checks}");
    cluster.shutdown().await;
}

/// Also the transfer itself (`transfer-leader`, the peer RPC openraft's default network left
/// unanswered): with a 1.5 s lease, no follower may vote for anyone within 1.5 s of the
/// leader's last heartbeat, so a target that leads sooner was elected by the transfer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_local_lease_once_a_transfer_starts() {
    let tuning = RaftTuning {
        election_timeout_min_ms: 1000,
        election_timeout_max_ms: 1500,
        ..RaftTuning::default()
    };
    let lease = Duration::from_millis(tuning.election_timeout_max_ms);
    let cluster = Cluster::start(3, tuning).await;
    let (id, leader) = settled_leader(&cluster).await;
    let term = leader.current_term();
    let to = cluster.members.keys().copied().find(|m| *m != id).unwrap();
    // openraft ignores a transfer to a member whose log is behind: wait until it has all.
    let last = leader.status().last_log_index;
    let target = cluster.members[&to].get().await.unwrap();
    assert!(
        target
            .wait_for(Duration::from_secs(10), |s| s.last_log_index >= last)
            .await,
        "the target never caught up"
    );
    let asked = Instant::now();
    leader.transfer_leadership(to).await.unwrap();
    // At once: the target has not even been asked to campaign yet, and the metrics still show
    // this member leading with a fresh acknowledgement.
    assert!(
        !leader.local_lease(),
        "the old leader proved a lease after starting a transfer (term {term})"
    );
    // The transfer completes; the old leader never claims a lease in that term again.
    let new_leader = target;
    wait_until(
        "the transfer's target to lead",
        Duration::from_secs(20),
        || async { (new_leader.is_leader() && new_leader.current_term() > term).then_some(()) },
    )
    .await;
    assert!(
        asked.elapsed() < lease,
        "the target led {:?} after the transfer: elected by a timer, not by the transfer",
        asked.elapsed()
    );
    assert!(!leader.local_lease());
    assert!(
        leader.lease_read().await.is_err(),
        "the old leader still reads"
    );
    // The new leader proves its own lease once its blank entry is applied.
    wait_until(
        "the new leader's local lease",
        Duration::from_secs(10),
        || async { new_leader.local_lease().then_some(()) },
    )
    .await;
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_cut_off_from_both_followers_stops_reading_within_its_lease() {
    let tuning = RaftTuning::default();
    let lease = Duration::from_millis(tuning.election_timeout_max_ms);
    let cluster = Cluster::start(3, tuning).await;
    let (id, leader) = settled_leader(&cluster).await;
    let term = leader.current_term();
    cluster.set_cut(id, true);
    // Nothing sent after this instant can be acknowledged, so no lease may hold past
    // cut + lease (the followers' leases, from their last answer, end no sooner).
    let cut = Instant::now();
    loop {
        // The time first: a stall between the two cannot pair a yes with a later time.
        let elapsed = cut.elapsed();
        let holds = leader.local_lease();
        if !holds {
            break;
        }
        assert!(
            elapsed < lease,
            "the cut-off leader still proved its lease {elapsed:?} after the cut (lease {lease:?})"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // Whatever happens next (the others elect a leader among themselves), the old one never
    // proves a lease again while cut off.
    // (Retried: under load the two may hold more than one election.)
    wait_until(
        "the two followers to elect a leader and commit a write",
        Duration::from_secs(20),
        || async {
            for (other, m) in &cluster.members {
                let c = m.get().await?;
                if *other != id && c.is_leader() && c.current_term() > term {
                    return c.write(b"after the cut".to_vec()).await.ok();
                }
            }
            None
        },
    )
    .await;
    assert!(
        !leader.local_lease(),
        "the old leader claims a lease beside a new one"
    );
    assert!(leader.lease_read().await.is_err());
    cluster.shutdown().await;
}
