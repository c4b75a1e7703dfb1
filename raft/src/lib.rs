//! Consensus for the ModelForge control plane.
//!
//! Architecture invariant: this is the only crate that names openraft types. The control plane
//! above it sees opaque, already-encoded commands ([`Application::apply`] takes bytes and returns
//! bytes), a [`Consensus`] handle with `write`/`lease_read`/`status`, and plain structs.
//!
//! - [`log_store`]: the durable Raft log and vote in redb, group-committed by one writer thread.
//! - [`state_machine`]: adapts an [`Application`] to openraft, with snapshots on disk.
//! - [`network`]: peer RPCs over HTTP, authenticated with the cluster secret.
//! - [`sim`]: the deterministic simulation of a cluster (openraft, the application, a seeded
//!   network) in one process.
//! - [`codec`]: the one place that knows the byte layout of records and RPC bodies.
//! - [`lease`]: the leader's lease checked from openraft's metrics, without its core.

pub mod codec;
pub mod lease;
pub mod log_store;
pub mod metrics;
pub mod network;
pub mod peer_auth;
pub mod sim;
pub mod state_machine;

use std::collections::BTreeMap;
use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use openraft::BasicNode;
use openraft::ReadPolicy;
use openraft::ServerState;
use openraft::async_runtime::WatchReceiver;
use openraft::errors::ClientWriteError;
use openraft::errors::RaftError;
use serde::Deserialize;
use serde::Serialize;

pub use crate::log_store::LogStore;
pub use crate::network::PeerNetwork;
pub use crate::state_machine::StateMachine;

/// An application command, already encoded by the application's own codec use.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AppRequest(pub Vec<u8>);

impl std::fmt::Display for AppRequest {
    /// Only the size: a command's content is the application's business (and never logged).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AppRequest({} bytes)", self.0.len())
    }
}

/// What applying an [`AppRequest`] returned, encoded by the application.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct AppResponse(pub Vec<u8>);

openraft::declare_raft_types!(
    /// The openraft type configuration of ModelForge.
    pub TypeConfig:
        D = AppRequest,
        R = AppResponse,
        NodeId = u64,
        Node = BasicNode,
);

pub type Raft<A> = openraft::Raft<TypeConfig, StateMachine<A>>;
pub use crate::state_machine::SnapshotData;

/// Encodes a captured state (see [`Application::snapshot`]).
pub type SnapshotEncoder = Box<dyn FnOnce() -> Vec<u8> + Send + 'static>;

/// The replicated application: a deterministic function of (state, command).
///
/// Architecture invariant: `apply` does no I/O and reads no clock; everything it decides on is
/// in the command (including the leader-stamped time).
pub trait Application: Send + Sync + 'static {
    /// Apply one committed command and return the encoded response.
    fn apply(&self, log_index: u64, command: &[u8]) -> Vec<u8>;
    /// Capture the whole state for a snapshot and return its encoder. The capture is made
    /// while apply waits, so it must be quick (a clone of a persistent state, not an encode);
    /// the encoder then runs on a blocking thread while apply goes on. The encoder runs before
    /// that snapshot is written (and so before any log entry it covers can be purged): an
    /// application makes the files it keeps beside the state durable there.
    fn snapshot(&self) -> SnapshotEncoder;
    /// Replace the whole state with a snapshot's.
    fn restore(&self, data: &[u8]) -> std::io::Result<()>;
}

/// Timing and retention knobs for one member.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RaftTuning {
    pub heartbeat_interval_ms: u64,
    pub election_timeout_min_ms: u64,
    pub election_timeout_max_ms: u64,
    pub snapshot_every_logs: u64,
    pub logs_kept_after_snapshot: u64,
}

impl Default for RaftTuning {
    fn default() -> Self {
        Self {
            heartbeat_interval_ms: 50,
            election_timeout_min_ms: 200,
            election_timeout_max_ms: 300,
            snapshot_every_logs: 5000,
            logs_kept_after_snapshot: 5000,
        }
    }
}

/// Why a write did not return a result.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// Certainly not applied by this member: ask the leader.
    #[error("this member is not the leader")]
    NotLeader { leader: Option<(u64, String)> },
    /// May or may not have committed: the caller retries the same (deduplicated) command.
    #[error("outcome unknown: {0}")]
    OutcomeUnknown(String),
    #[error("consensus failed: {0}")]
    Fatal(String),
}

/// Why a linearizable read could not be served here.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("this member is not the leader")]
    NotLeader { leader: Option<(u64, String)> },
    #[error("leadership could not be confirmed: {0}")]
    Unavailable(String),
}

/// One member as this member sees the membership.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct MemberView {
    pub id: u64,
    pub url: String,
    pub voter: bool,
    /// The last log index the leader knows the member holds (on the leader only).
    pub matched_index: Option<u64>,
    /// Milliseconds since the member last acknowledged the leader (on the leader only; None
    /// on the leader for a member never heard from).
    pub last_ack_ms: Option<u64>,
}

/// Why a membership change did not happen.
#[derive(Debug, thiserror::Error)]
pub enum MembershipError {
    #[error("this member is not the leader")]
    NotLeader { leader: Option<(u64, String)> },
    #[error("member {0} did not catch up in time; it stays a learner (retry to promote it)")]
    CatchUpTimeout(u64),
    #[error("the change was refused: {0}")]
    Refused(String),
    #[error("consensus failed: {0}")]
    Fatal(String),
}

fn membership_error(e: RaftError<TypeConfig, ClientWriteError<TypeConfig>>) -> MembershipError {
    match e {
        RaftError::APIError(ClientWriteError::ForwardToLeader(f)) => MembershipError::NotLeader {
            leader: f.leader_id.zip(f.leader_node.map(|n| n.addr)),
        },
        RaftError::APIError(e) => MembershipError::Refused(e.to_string()),
        RaftError::Fatal(e) => MembershipError::Fatal(e.to_string()),
    }
}

/// A plain summary of openraft's metrics for the API and the tests.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ClusterStatus {
    pub id: u64,
    pub leader_id: Option<u64>,
    pub leader_url: Option<String>,
    pub term: u64,
    pub state: String,
    pub commit_index: u64,
    pub applied_index: u64,
    pub last_log_index: u64,
    pub snapshot_index: Option<u64>,
    pub members: Vec<MemberView>,
}

/// Ends a [`lease::TransferMark`] when dropped: with the core's term when it was read, else
/// the metrics' term.
struct TransferEnding<'a, A: Application> {
    consensus: &'a Consensus<A>,
    term: Option<u64>,
}

impl<A: Application> Drop for TransferEnding<'_, A> {
    fn drop(&mut self) {
        let term = self.term.unwrap_or_else(|| self.consensus.current_term());
        self.consensus.transfer.end(term);
    }
}

/// The handle the control plane holds: a running Raft member.
pub struct Consensus<A: Application> {
    raft: Raft<A>,
    id: u64,
    /// The member's Raft dir (snapshots from the leader are received into it).
    dir: std::path::PathBuf,
    /// Closed on shutdown, so that the data dir can be opened again in the same process.
    log: LogStore,
    pacing: Arc<state_machine::SnapshotPacing>,
    /// The term this member started a leadership transfer in (no local lease reads then).
    transfer: Arc<lease::TransferMark>,
}

impl<A: Application> Clone for Consensus<A> {
    fn clone(&self) -> Self {
        Self {
            raft: self.raft.clone(),
            id: self.id,
            dir: self.dir.clone(),
            log: self.log.clone(),
            pacing: self.pacing.clone(),
            transfer: self.transfer.clone(),
        }
    }
}

impl<A: Application> Consensus<A> {
    /// Open the member's store under `dir` and start its Raft task.
    pub async fn start(
        id: u64,
        dir: &Path,
        app: Arc<A>,
        network: PeerNetwork,
        tuning: &RaftTuning,
    ) -> anyhow_like::Result<Self> {
        let config = openraft::Config {
            cluster_name: "modelforge".to_string(),
            heartbeat_interval: tuning.heartbeat_interval_ms,
            election_timeout_min: tuning.election_timeout_min_ms,
            election_timeout_max: tuning.election_timeout_max_ms,
            // Snapshots are asked for by `pace_snapshots`, never by a fixed policy.
            snapshot_policy: openraft::SnapshotPolicy::Never,
            max_in_snapshot_log_to_keep: tuning.logs_kept_after_snapshot,
            install_snapshot_timeout: 10_000,
            // A restarted leader must win a new election instead of resuming its old term: the
            // log store lets replication read entries before they are flushed locally, so a
            // leader killed with -9 can come back with a shorter log than the quorum committed.
            // Resuming the same term would then reuse (term, index) pairs for other entries and
            // split the members' states (the chaos suite caught exactly this). An election in a
            // new term is safe: voters refuse a candidate whose log lacks committed entries.
            enable_leader_restore: Some(false),
            // A member whose data dir was wiped (replaced, as the refusal in `log_store` advises)
            // comes back with an empty log, and the leader must replicate to it from the start.
            // Without this openraft's leader panics on the reverted follower in debug builds and
            // never catches it up in release builds (tests/formation.rs caught the panic).
            allow_log_reversion: Some(true),
            // Pre-vote: a follower asks whether it would be elected before it raises its term,
            // so a follower that alone cannot hear the leader (or whose timer fired late) is
            // refused by the others and cannot unseat the leader with a raised term when the
            // link mends. This is what makes the short default timeout safe; it does not make a
            // failover faster (the timer runs after the lease either way; ARCHITECTURE.md,
            // "Elections: leader lease and pre-vote").
            enable_pre_vote: Some(true),
            ..Default::default()
        };
        let config = Arc::new(
            config
                .validate()
                .map_err(|e| anyhow_like::Error(e.to_string()))?,
        );
        std::fs::create_dir_all(dir)
            .map_err(|e| anyhow_like::Error(format!("create {}: {e}", dir.display())))?;
        let log = LogStore::open(&dir.join("raft-log.redb"))
            .map_err(|e| anyhow_like::Error(e.to_string()))?;
        let sm = StateMachine::open(dir, app).map_err(|e| anyhow_like::Error(e.to_string()))?;
        let pacing = sm.pacing();
        let raft = openraft::Raft::new(id, config, network, log.clone(), sm)
            .await
            .map_err(|e| anyhow_like::Error(e.to_string()))?;
        pace_snapshots(
            raft.clone(),
            pacing.clone(),
            tuning.snapshot_every_logs.max(1),
        );
        Ok(Self {
            raft,
            id,
            dir: dir.to_path_buf(),
            log,
            pacing,
            transfer: Arc::default(),
        })
    }

    /// Hold back (or let go) new snapshot builds: while the disk is under its reserve a
    /// snapshot, as large as the state, could fill it (a build already running finishes).
    pub fn hold_snapshots(&self, held: bool) {
        self.pacing.hold(held);
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    /// Whether this member has ever been part of an initialised cluster.
    pub async fn is_initialized(&self) -> bool {
        self.raft.is_initialized().await.unwrap_or(false)
    }

    /// Form a cluster of exactly `members` (id -> URL). Calling it on several pristine members
    /// with the same list is safe; on an initialised member it does nothing.
    pub async fn initialize(&self, members: &BTreeMap<u64, String>) -> Result<(), String> {
        let nodes: BTreeMap<u64, BasicNode> = members
            .iter()
            .map(|(id, url)| (*id, BasicNode { addr: url.clone() }))
            .collect();
        match self.raft.initialize(nodes).await {
            Ok(()) => Ok(()),
            Err(RaftError::APIError(openraft::errors::InitializeError::NotAllowed(_))) => Ok(()),
            Err(e) => Err(e.to_string()),
        }
    }

    /// Propose `command` and wait until it is applied here, returning the application's answer.
    pub async fn write(&self, command: Vec<u8>) -> Result<Vec<u8>, WriteError> {
        let m = &metrics::METRICS;
        m.proposals_pending.inc();
        let result = self.write_once(command).await;
        m.proposals_pending.dec();
        match &result {
            Ok(_) => m.proposals_committed.inc(),
            Err(_) => m.proposals_failed.inc(),
        };
        result
    }

    async fn write_once(&self, command: Vec<u8>) -> Result<Vec<u8>, WriteError> {
        match self.raft.client_write(AppRequest(command)).await {
            Ok(resp) => Ok(resp.data.0),
            Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f))) => {
                Err(WriteError::NotLeader {
                    leader: f.leader_id.zip(f.leader_node.map(|n| n.addr)),
                })
            }
            Err(RaftError::APIError(ClientWriteError::LogEntryDiscarded(f))) => Err(
                WriteError::OutcomeUnknown(format!("entry discarded on leader change: {f}")),
            ),
            Err(RaftError::APIError(e)) => Err(WriteError::Fatal(e.to_string())),
            Err(RaftError::Fatal(e)) => Err(WriteError::Fatal(e.to_string())),
        }
    }

    /// Confirm by leader lease that this member leads and that every write acknowledged
    /// before the call is applied here: a read of the local state after this is
    /// linearizable. Decided from openraft's metrics when they prove it
    /// ([`Self::local_lease`]), else by Raft's core (which also waits for what was committed).
    pub async fn lease_read(&self) -> Result<(), ReadError> {
        if self.local_lease() {
            metrics::METRICS.lease_reads_local.inc();
            return Ok(());
        }
        metrics::METRICS.lease_reads_core.inc();
        self.linearize(ReadPolicy::LeaseRead).await
    }

    /// Whether openraft's metrics alone prove this member's lease now ([`lease::lease_holds`]).
    pub fn local_lease(&self) -> bool {
        let m = self.raft.metrics();
        let m = m.borrow_watched();
        let membership = m.membership_config.membership();
        let sole_voter = membership.get_joint_config().len() == 1 && {
            let mut voters = membership.voter_ids();
            voters.next() == Some(self.id) && voters.next().is_none()
        };
        let view = lease::LeaseView {
            leads: m.state == ServerState::Leader && m.current_leader == Some(self.id),
            term: m.current_term,
            transferring: self.transfer.blocks(m.current_term),
            sole_voter,
            quorum_acked_ago: m
                .last_quorum_acked
                .as_ref()
                .map(|t| openraft::Instant::elapsed(&t.into_inner())),
            applied_term: m
                .last_applied
                .as_ref()
                .map(|l| l.committed_leader_id().term),
        };
        // openraft's leader lease is the election timeout's upper bound.
        let lease = Duration::from_millis(self.raft.config().election_timeout_max);
        lease::lease_holds(&view, lease)
    }

    /// Like [`Self::lease_read`] but confirmed by a round trip to a quorum.
    pub async fn read_index(&self) -> Result<(), ReadError> {
        self.linearize(ReadPolicy::ReadIndex).await
    }

    async fn linearize(&self, policy: ReadPolicy) -> Result<(), ReadError> {
        match self.raft.ensure_linearizable(policy).await {
            Ok(_) => Ok(()),
            Err(RaftError::APIError(openraft::errors::LinearizableReadError::ForwardToLeader(
                f,
            ))) => Err(ReadError::NotLeader {
                leader: f.leader_id.zip(f.leader_node.map(|n| n.addr)),
            }),
            Err(e) => Err(ReadError::Unavailable(e.to_string())),
        }
    }

    pub fn is_leader(&self) -> bool {
        let m = self.raft.metrics();
        let m = m.borrow_watched();
        m.state == ServerState::Leader && m.current_leader == Some(self.id)
    }

    /// The current term, cheaply (no allocation; for hot paths).
    pub fn current_term(&self) -> u64 {
        self.raft.metrics().borrow_watched().current_term
    }

    /// The leader as this member last heard of it: (id, URL).
    pub fn leader(&self) -> Option<(u64, String)> {
        let m = self.raft.metrics();
        let m = m.borrow_watched();
        let id = m.current_leader?;
        let url = m.membership_config.membership().get_node(&id)?.addr.clone();
        Some((id, url))
    }

    pub fn status(&self) -> ClusterStatus {
        let m = self.raft.metrics();
        let m = m.borrow_watched();
        let membership = m.membership_config.membership();
        let voters: BTreeSet<u64> = membership.voter_ids().collect();
        let members = membership
            .nodes()
            .map(|(id, node)| {
                let me = *id == self.id && m.state == ServerState::Leader;
                let matched_index = if me {
                    m.last_log_index
                } else {
                    m.replication
                        .as_ref()
                        .and_then(|r| r.get(id).cloned().flatten())
                        .map(|l| l.index())
                };
                let last_ack_ms = if me {
                    Some(0)
                } else {
                    m.heartbeat
                        .as_ref()
                        .and_then(|h| h.get(id).cloned().flatten())
                        .map(|t| openraft::Instant::elapsed(&t.into_inner()).as_millis() as u64)
                };
                MemberView {
                    id: *id,
                    url: node.addr.clone(),
                    voter: voters.contains(id),
                    matched_index,
                    last_ack_ms,
                }
            })
            .collect();
        let leader_url = m
            .current_leader
            .and_then(|id| membership.get_node(&id).map(|n| n.addr.clone()));
        ClusterStatus {
            id: self.id,
            leader_id: m.current_leader,
            leader_url,
            term: m.current_term,
            state: format!("{:?}", m.state),
            commit_index: m.local_committed.as_ref().map(|l| l.index()).unwrap_or(0),
            applied_index: m.last_applied.as_ref().map(|l| l.index()).unwrap_or(0),
            last_log_index: m.last_log_index.unwrap_or(0),
            snapshot_index: m.snapshot.as_ref().map(|l| l.index()),
            members,
        }
    }

    /// Wait until `pred` holds for this member's status, or `timeout` passes.
    pub async fn wait_for(&self, timeout: Duration, pred: impl Fn(&ClusterStatus) -> bool) -> bool {
        let mut rx = self.raft.metrics();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if pred(&self.status()) {
                return true;
            }
            if tokio::time::timeout_at(deadline, rx.changed())
                .await
                .is_err()
            {
                return pred(&self.status());
            }
        }
    }

    /// Answer a peer RPC (already authenticated by the caller) whose whole body is at hand.
    pub async fn handle_peer_rpc(
        &self,
        kind: &str,
        body: &[u8],
    ) -> Result<Vec<u8>, network::PeerRpcError> {
        if kind == network::SNAPSHOT_RPC {
            let chunk = bytes::Bytes::copy_from_slice(body);
            let body = futures_util::stream::once(async move { Ok::<_, std::io::Error>(chunk) });
            let received = self.receive_snapshot(Box::pin(body)).await?;
            return self.install_snapshot(received).await;
        }
        network::serve(&self.raft, kind, body).await
    }

    /// Receive a snapshot RPC's body from the leader as it streams in, into a file in the
    /// member's dir (at most [`network::SNAPSHOT_MAX`] bytes); the caller checks its digest
    /// against the signed peer header before [`Consensus::install_snapshot`].
    pub async fn receive_snapshot<S, E>(
        &self,
        body: S,
    ) -> Result<network::ReceivedSnapshot, network::PeerRpcError>
    where
        S: futures_util::Stream<Item = Result<bytes::Bytes, E>> + Unpin,
        E: std::fmt::Display,
    {
        network::receive_snapshot(&self.dir, body, network::SNAPSHOT_MAX).await
    }

    /// Install a received snapshot (checked first, in bounded memory).
    pub async fn install_snapshot(
        &self,
        received: network::ReceivedSnapshot,
    ) -> Result<Vec<u8>, network::PeerRpcError> {
        network::install_received(&self.raft, received).await
    }

    /// Add member `id` at `url` as a learner and wait, up to `within`, until it holds the log
    /// the leader had when it was added (a snapshot install included). Adding a learner that
    /// is already one re-adds it (same node); on a timeout it stays a learner.
    pub async fn add_learner(
        &self,
        id: u64,
        url: &str,
        within: Duration,
    ) -> Result<(), MembershipError> {
        let node = BasicNode {
            addr: url.to_string(),
        };
        self.raft
            .add_learner(id, node, false)
            .await
            .map_err(membership_error)?;
        let target = self.status().last_log_index;
        let caught_up = self
            .wait_for(within, |s| {
                s.members
                    .iter()
                    .any(|m| m.id == id && m.matched_index.is_some_and(|i| i >= target))
            })
            .await;
        if caught_up {
            Ok(())
        } else {
            Err(MembershipError::CatchUpTimeout(id))
        }
    }

    /// Make learner `id` a voter (joint consensus; returns once the change is committed).
    pub async fn promote(&self, id: u64) -> Result<(), MembershipError> {
        self.raft
            .change_membership(
                openraft::ChangeMembers::AddVoterIds(BTreeSet::from([id])),
                false,
            )
            .await
            .map(|_| ())
            .map_err(membership_error)
    }

    /// Remove member `id`, voter or learner, from the configuration (returns once the change is
    /// committed). Removing the leader itself is allowed: it steps down once the change
    /// commits (hand leadership over first with [`Self::transfer_leadership`]).
    pub async fn remove_member(&self, id: u64) -> Result<(), MembershipError> {
        let voter = self.status().members.iter().any(|m| m.id == id && m.voter);
        let change = if voter {
            openraft::ChangeMembers::RemoveVoters(BTreeSet::from([id]))
        } else {
            openraft::ChangeMembers::RemoveNodes(BTreeSet::from([id]))
        };
        self.raft
            .change_membership(change, false)
            .await
            .map(|_| ())
            .map_err(membership_error)
    }

    /// Ask the leader to hand leadership to voter `to`.
    pub async fn transfer_leadership(&self, to: u64) -> Result<(), MembershipError> {
        // No local lease reads from before openraft hears of it to the end of the term: the
        // target's votes bypass the followers' leases (`lease::TransferMark`). The mark ends
        // even if this future is dropped midway (then with the metrics' term).
        self.transfer.begin();
        let mut ending = TransferEnding {
            consensus: self,
            term: None,
        };
        let result = self.raft.trigger().transfer_leader(to).await;
        // Raft's core takes requests in order: its term now is at least the one the transfer
        // applies to (the metrics' term may lag it).
        ending.term = self
            .raft
            .with_raft_state(|st| st.vote_ref().leader_id().term)
            .await
            .ok();
        drop(ending);
        result.map_err(|e| MembershipError::Fatal(e.to_string()))
    }

    /// Ask for a snapshot now (tests and operators).
    pub async fn trigger_snapshot(&self) -> Result<(), String> {
        self.raft
            .trigger()
            .snapshot()
            .await
            .map_err(|e| e.to_string())
    }

    /// Stop the Raft task, then close the log (its database file is released once this
    /// returns).
    pub async fn shutdown(&self) {
        if let Err(e) = self.raft.shutdown().await {
            tracing::warn!(error = %e, "raft shutdown");
        }
        self.log.close().await;
    }
}

/// Ask for a snapshot when at least `every` entries were applied since the last one and the
/// last build took at most a tenth of the time since (ARCHITECTURE.md, "Snapshot pacing").
/// Ends when the Raft task has shut down.
fn pace_snapshots<A: Application>(
    raft: Raft<A>,
    pacing: Arc<state_machine::SnapshotPacing>,
    every: u64,
) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let since = {
                let m = raft.metrics();
                let m = m.borrow_watched();
                if m.state == ServerState::Shutdown {
                    return;
                }
                let applied = m.last_applied.as_ref().map(|l| l.index() + 1).unwrap_or(0);
                let covered = m.snapshot.as_ref().map(|l| l.index() + 1).unwrap_or(0);
                applied.saturating_sub(covered)
            };
            if since < every || !pacing.may_start() {
                continue;
            }
            pacing.requested();
            if raft.trigger().snapshot().await.is_err() {
                return;
            }
        }
    });
}

/// A tiny error type so that this crate needs no `anyhow`.
pub mod anyhow_like {
    #[derive(Debug)]
    pub struct Error(pub String);
    impl std::fmt::Display for Error {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(&self.0)
        }
    }
    impl std::error::Error for Error {}
    pub type Result<T> = std::result::Result<T, Error>;
}
