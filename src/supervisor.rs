//! The supervision tree that holds the live (non-replicated) state of every node on the member
//! that processes heartbeats: last heartbeat, a bounded telemetry ring, the last refused agent
//! request, the last fresh hardware report, and the last status recorded in history.
//!
//! Shape: one `NodeSupervisor` actor with `shards` child actors; a node belongs to shard
//! `fnv(node_id) % shards`. Sharding, not one actor per node: ractor actors cost several KiB
//! each, and a shard owning many nodes keeps 100,000 nodes far under the memory target while
//! still isolating failures (a crashed shard takes only its own nodes' live state down, and
//! only until it is rebuilt).
//!
//! Supervision: ractor's default stops a supervisor when any child exits; ours overrides
//! `handle_supervisor_evt` to respawn the failed shard and rebuild it from the replicated state
//! (which nodes exist, when each was last seen per `last_used_at`); the next report from each
//! node refills the rest. A rebuild (start, leader change, shard restart) resets the
//! "accelerators verified" mark of its nodes: only a report received since counts.
//!
//! Mailboxes are unbounded tokio channels: the heartbeat path only `cast`s, reads use
//! `call_t!` with a timeout, and every per-node structure is bounded.

use std::collections::HashMap;
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::RwLock;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;

use ractor::Actor;
use ractor::ActorProcessingErr;
use ractor::ActorRef;
use ractor::RpcReplyPort;
use ractor::SupervisionEvent;

use crate::app::Replicated;
use crate::state::State;
use modelforge_proto::api::ErrorCode;
use modelforge_proto::ids::HistoryKind;
use modelforge_proto::ids::NodeId;
use modelforge_proto::ids::NodeStatus;
use modelforge_proto::wire::Telemetry;

/// Telemetry samples kept per node, at most.
pub const TELEMETRY_RING: usize = 32;
/// Bytes of telemetry samples kept over all nodes by default (`--telemetry-budget-mib`).
pub const DEFAULT_TELEMETRY_BUDGET: usize = 128 << 20;
/// What one sample costs besides its bytes: the ring slot and the allocation's header.
const SAMPLE_OVERHEAD: usize = 40;
/// How long a read of a shard may take.
const CALL_TIMEOUT_MS: u64 = 2000;
/// A node's latest telemetry sample is shared with the other members at most this often.
pub const OBSERVED_TELEMETRY_EVERY_MS: i64 = 30_000;
/// The largest telemetry sample a member takes from a share (an agent's body is smaller).
const SHARED_SAMPLE_MAX: usize = 1 << 20;

/// A telemetry sample as the supervisor keeps it: the parsed heartbeat body in the project's
/// binary codec ([`encode_sample`]), decoded only where it is read ([`decode_sample`]).
pub type Sample = Box<[u8]>;

/// A heartbeat's parsed telemetry as a [`Sample`]: no field names and no number formatting
/// (re-serialising it as JSON was 7.7% of the leader's CPU under heartbeat load).
pub fn encode_sample(t: &Telemetry) -> Sample {
    modelforge_raft::codec::encode(t)
        .unwrap_or_default()
        .into_boxed_slice()
}

/// A [`Sample`] read back; `None` when it does not decode (a damaged or foreign share).
pub fn decode_sample(s: &[u8]) -> Option<Telemetry> {
    modelforge_raft::codec::decode(s).ok()
}

/// A refused agent request, as the node's view shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub status: u16,
    pub code: &'static str,
    pub at_ms: i64,
    /// Whether the presented credential was proven to be this node's (its secret matched).
    /// Anyone can cause a refusal that is not: it never counts as the node's own trouble.
    pub credential_of_this_node: bool,
}

#[derive(Clone, Debug, Default)]
pub struct NodeLive {
    pub last_heartbeat_ms: Option<i64>,
    /// Encoded, not a parsed value: a fraction of the memory per sample.
    pub telemetry: VecDeque<(i64, Sample)>,
    pub last_refusal: Option<Refusal>,
    /// Refusals not yet written to the node's history: (status, count).
    pub unflushed_refusals: Vec<(u16, u32)>,
    /// The last hardware report (inventory or telemetry naming accelerators) received.
    pub last_report_ms: Option<i64>,
    /// The status last written to history.
    pub recorded_status: Option<NodeStatus>,
    /// Whether `last_refusal` was handed to the other members already.
    pub refusal_shared: bool,
    /// The time of the last telemetry sample handed to the other members.
    pub telemetry_shared_at_ms: Option<i64>,
}

/// What the leader's live view of one node shares with the other members: its last refusal
/// and its latest telemetry sample, kept by every member in memory only ([`Observed`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ObservedNode {
    pub last_refusal: Option<Refusal>,
    pub telemetry: Option<(i64, Sample)>,
}

/// One node's share as it travels between members (a peer body): the refusal's code by its
/// wire name, decoded back only into a code this build knows.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct SharedNode {
    pub node_id: NodeId,
    /// (status, code, at, credential_of_this_node)
    pub refusal: Option<(u16, String, i64, bool)>,
    pub telemetry: Option<(i64, Vec<u8>)>,
}

impl SharedNode {
    pub fn from_observed(node_id: NodeId, o: &ObservedNode) -> Self {
        Self {
            node_id,
            refusal: o.last_refusal.map(|r| {
                (
                    r.status,
                    r.code.to_string(),
                    r.at_ms,
                    r.credential_of_this_node,
                )
            }),
            telemetry: o.telemetry.as_ref().map(|(at, t)| (*at, t.to_vec())),
        }
    }

    /// Back into a node's share; parts that no member could have recorded (a status other
    /// than 401/403, a code this build does not know, an oversized sample) are dropped.
    pub fn into_observed(self) -> (NodeId, ObservedNode) {
        let last_refusal = self.refusal.and_then(|(status, code, at_ms, own)| {
            let code = ErrorCode::parse(&code)?.as_str();
            matches!(status, 401 | 403).then_some(Refusal {
                status,
                code,
                at_ms,
                credential_of_this_node: own,
            })
        });
        let telemetry = self
            .telemetry
            .filter(|(_, t)| t.len() <= SHARED_SAMPLE_MAX)
            .map(|(at, t)| (at, t.into_boxed_slice()));
        (
            self.node_id,
            ObservedNode {
                last_refusal,
                telemetry,
            },
        )
    }
}

/// Every member's copy of what the leader shared of its live view (see ARCHITECTURE.md, "Node
/// supervision"): memory only, one entry a node that exists and is not decommissioned here,
/// telemetry within a byte budget. A member that becomes leader seeds its shards from it.
pub struct Observed {
    inner: std::sync::Mutex<ObservedInner>,
    /// Bytes of telemetry samples held at most (`--telemetry-budget-mib`).
    budget: usize,
    /// Entries taken from the leader's shares.
    pub learned: AtomicU64,
}

#[derive(Default)]
struct ObservedInner {
    nodes: HashMap<NodeId, ObservedNode>,
    telemetry_bytes: usize,
    pruned_at_ms: i64,
}

/// What [`Observed`] holds, for `GET /api/v1/cluster`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ObservedCounts {
    pub nodes: usize,
    pub refusals: usize,
    pub telemetry_samples: usize,
}

impl Observed {
    /// An empty store holding at most `budget` bytes of telemetry samples.
    pub fn new(budget: usize) -> Self {
        Self {
            inner: Default::default(),
            budget,
            learned: AtomicU64::new(0),
        }
    }

    /// Take `batch` into the store: newer refusals and samples replace older ones; nodes
    /// missing or decommissioned in `state` are skipped (and pruned, at most once a minute);
    /// over the budget, a node without a sample here gets none.
    pub fn merge(&self, state: &State, batch: Vec<(NodeId, ObservedNode)>, now_ms: i64) -> usize {
        let budget = self.budget;
        let live = |id: &NodeId| {
            state
                .nodes
                .get(id)
                .is_some_and(|n| n.decommissioned_at_ms.is_none())
        };
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let inner = &mut *g;
        if now_ms - inner.pruned_at_ms >= 60_000 {
            inner.pruned_at_ms = now_ms;
            let mut freed = 0;
            inner.nodes.retain(|id, o| {
                let keep = live(id);
                if !keep {
                    freed += o.telemetry.as_ref().map_or(0, |(_, t)| sample_cost(t));
                }
                keep
            });
            inner.telemetry_bytes = inner.telemetry_bytes.saturating_sub(freed);
        }
        let mut taken = 0;
        for (id, o) in batch {
            if !live(&id) {
                continue;
            }
            let over = inner.telemetry_bytes;
            let e = inner.nodes.entry(id).or_default();
            if let Some(r) = o.last_refusal
                && e.last_refusal.is_none_or(|old| old.at_ms <= r.at_ms)
            {
                e.last_refusal = Some(r);
            }
            if let Some((at, t)) = o.telemetry {
                let old = e.telemetry.as_ref().map(|(at, t)| (*at, sample_cost(t)));
                match old {
                    Some((old_at, old_cost)) if old_at < at => {
                        inner.telemetry_bytes = over - old_cost + sample_cost(&t);
                        e.telemetry = Some((at, t));
                    }
                    None if over + sample_cost(&t) <= budget => {
                        inner.telemetry_bytes = over + sample_cost(&t);
                        e.telemetry = Some((at, t));
                    }
                    _ => {}
                }
            }
            taken += 1;
        }
        taken
    }

    #[cfg(test)]
    fn get(&self, node_id: &NodeId) -> Option<ObservedNode> {
        let g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.nodes.get(node_id).cloned()
    }

    pub fn counts(&self) -> ObservedCounts {
        let g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        ObservedCounts {
            nodes: g.nodes.len(),
            refusals: g
                .nodes
                .values()
                .filter(|o| o.last_refusal.is_some())
                .count(),
            telemetry_samples: g.nodes.values().filter(|o| o.telemetry.is_some()).count(),
        }
    }
}

pub enum ShardMsg {
    Heartbeat {
        node_id: NodeId,
        at_ms: i64,
        telemetry: Sample,
        report: bool,
    },
    Report {
        node_id: NodeId,
        at_ms: i64,
    },
    Refused {
        node_id: NodeId,
        refusal: Refusal,
    },
    /// One node's live state, and when the shard was last rebuilt.
    Get(NodeId, RpcReplyPort<(NodeLive, i64)>),
    /// Every node's live state (without telemetry rings).
    All(RpcReplyPort<(Vec<(NodeId, NodeLive)>, i64)>),
    /// The named nodes of this shard (without telemetry rings): a page of a list.
    Many(Vec<NodeId>, RpcReplyPort<(Vec<(NodeId, NodeLive)>, i64)>),
    /// What changed since the last share, to hand to the other members (the time is now).
    TakeShare(i64, RpcReplyPort<Vec<(NodeId, ObservedNode)>>),
    /// Record the given statuses as written and take the unflushed refusals.
    Flush(
        Vec<(NodeId, NodeStatus)>,
        RpcReplyPort<Vec<(NodeId, u16, u32)>>,
    ),
    /// Forget everything and start again from the replicated state (leader change).
    Rebuild {
        at_ms: i64,
    },
    /// Fail on purpose (tests of the supervision).
    Crash,
}

pub struct Shard;

pub struct ShardArgs {
    index: usize,
    shards: usize,
    app: Arc<Replicated>,
    observed: Arc<Observed>,
    rebuilt_at_ms: i64,
    telemetry_budget: usize,
}

pub struct ShardState {
    index: usize,
    shards: usize,
    app: Arc<Replicated>,
    observed: Arc<Observed>,
    nodes: HashMap<NodeId, NodeLive>,
    rebuilt_at_ms: i64,
    /// This shard's share of the telemetry budget, and what its rings hold now.
    telemetry_budget: usize,
    telemetry_bytes: usize,
}

fn sample_cost(t: &[u8]) -> usize {
    t.len() + SAMPLE_OVERHEAD
}

pub fn shard_of(node_id: &NodeId, shards: usize) -> usize {
    let h = node_id
        .as_str()
        .bytes()
        .fold(0xcbf29ce484222325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x100000001b3)
        });
    (h % shards.max(1) as u64) as usize
}

impl ShardState {
    /// Seed from the replicated state (the shard's nodes, last seen per `last_used_at`), then
    /// from what the leader shared ([`Observed`]): the last refusal and the latest sample.
    fn seed(&mut self) {
        self.nodes.clear();
        self.telemetry_bytes = 0;
        // Lock order: the state, then the store (as `Observed::merge`'s callers).
        let s = self.app.read();
        let observed = self
            .observed
            .inner
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        // Every shard walks every node: the shard is decided from the map's key, so the other
        // shards' nodes (behind their `Arc`) are never read.
        for (id, node) in s.nodes.iter() {
            if shard_of(id, self.shards) != self.index || node.decommissioned_at_ms.is_some() {
                continue;
            }
            let seen = node
                .credential_ids
                .iter()
                .filter_map(|c| s.credentials.get(c))
                .filter_map(|c| c.last_used_at_ms)
                .max();
            let last_status = node
                .history
                .iter()
                .rev()
                .find(|e| e.kind == HistoryKind::Status)
                .map(|e| NodeStatus::parse(&e.detail).unwrap_or(NodeStatus::NeverSeen));
            let mut live = NodeLive {
                last_heartbeat_ms: seen,
                recorded_status: last_status,
                ..Default::default()
            };
            if let Some(o) = observed.nodes.get(&node.node_id) {
                // Other members may have missed the refusal: it is shared again. A sample
                // arrives only with an accepted heartbeat, so it dates one; it is never a
                // fresh hardware report.
                live.last_refusal = o.last_refusal;
                if let Some((at, t)) = &o.telemetry {
                    live.last_heartbeat_ms = live.last_heartbeat_ms.max(Some(*at));
                    live.telemetry_shared_at_ms = Some(*at);
                    self.telemetry_bytes += sample_cost(t);
                    live.telemetry.push_back((*at, t.clone()));
                }
            }
            self.nodes.insert(node.node_id.clone(), live);
        }
    }

    fn entry(&mut self, node_id: &NodeId) -> Option<&mut NodeLive> {
        // Bounded: only nodes that exist in the replicated state get an entry.
        if !self.nodes.contains_key(node_id) {
            if !self.app.read().nodes.contains_key(node_id) {
                return None;
            }
            self.nodes.insert(node_id.clone(), NodeLive::default());
        }
        self.nodes.get_mut(node_id)
    }
}

impl Actor for Shard {
    type Msg = ShardMsg;
    type State = ShardState;
    type Arguments = ShardArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<ShardMsg>,
        a: ShardArgs,
    ) -> Result<ShardState, ActorProcessingErr> {
        let mut st = ShardState {
            index: a.index,
            shards: a.shards,
            app: a.app,
            observed: a.observed,
            nodes: HashMap::new(),
            rebuilt_at_ms: a.rebuilt_at_ms,
            telemetry_budget: a.telemetry_budget,
            telemetry_bytes: 0,
        };
        st.seed();
        Ok(st)
    }

    async fn handle(
        &self,
        _myself: ActorRef<ShardMsg>,
        msg: ShardMsg,
        st: &mut ShardState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            ShardMsg::Heartbeat {
                node_id,
                at_ms,
                telemetry,
                report,
            } => {
                // Over the shard's budget, the node that reports drops its own oldest
                // samples (never its latest): rings shrink evenly as nodes are added.
                let budget = st.telemetry_budget;
                let mut bytes = st.telemetry_bytes;
                if let Some(n) = st.entry(&node_id) {
                    n.last_heartbeat_ms = Some(at_ms);
                    bytes += sample_cost(&telemetry);
                    n.telemetry.push_back((at_ms, telemetry));
                    while n.telemetry.len() > TELEMETRY_RING
                        || (bytes > budget && n.telemetry.len() > 1)
                    {
                        if let Some((_, old)) = n.telemetry.pop_front() {
                            bytes = bytes.saturating_sub(sample_cost(&old));
                        }
                    }
                    if report {
                        n.last_report_ms = Some(at_ms);
                    }
                }
                st.telemetry_bytes = bytes;
            }
            ShardMsg::Report { node_id, at_ms } => {
                if let Some(n) = st.entry(&node_id) {
                    n.last_report_ms = Some(at_ms);
                }
            }
            ShardMsg::Refused { node_id, refusal } => {
                if let Some(n) = st.entry(&node_id) {
                    let status = refusal.status;
                    n.last_refusal = Some(refusal);
                    n.refusal_shared = false;
                    match n.unflushed_refusals.iter_mut().find(|(s, _)| *s == status) {
                        Some((_, c)) => *c = c.saturating_add(1),
                        None => n.unflushed_refusals.push((status, 1)),
                    }
                }
            }
            ShardMsg::Get(node_id, reply) => {
                let _ = reply.send((
                    st.nodes.get(&node_id).cloned().unwrap_or_default(),
                    st.rebuilt_at_ms,
                ));
            }
            ShardMsg::All(reply) => {
                let all = st
                    .nodes
                    .iter()
                    .map(|(k, v)| {
                        (
                            k.clone(),
                            NodeLive {
                                telemetry: VecDeque::new(),
                                ..v.clone()
                            },
                        )
                    })
                    .collect();
                let _ = reply.send((all, st.rebuilt_at_ms));
            }
            ShardMsg::Many(ids, reply) => {
                let some = ids
                    .into_iter()
                    .filter_map(|id| {
                        let v = st.nodes.get(&id)?;
                        let live = NodeLive {
                            telemetry: VecDeque::new(),
                            ..v.clone()
                        };
                        Some((id, live))
                    })
                    .collect();
                let _ = reply.send((some, st.rebuilt_at_ms));
            }
            ShardMsg::TakeShare(now_ms, reply) => {
                let mut out = vec![];
                for (id, n) in st.nodes.iter_mut() {
                    let last_refusal = if n.refusal_shared {
                        None
                    } else {
                        n.refusal_shared = true;
                        n.last_refusal
                    };
                    let telemetry = match n.telemetry.back() {
                        Some((at, t))
                            if n.telemetry_shared_at_ms.is_none_or(|shared| {
                                *at > shared && now_ms - shared >= OBSERVED_TELEMETRY_EVERY_MS
                            }) =>
                        {
                            n.telemetry_shared_at_ms = Some(*at);
                            Some((*at, t.clone()))
                        }
                        _ => None,
                    };
                    if last_refusal.is_some() || telemetry.is_some() {
                        out.push((
                            id.clone(),
                            ObservedNode {
                                last_refusal,
                                telemetry,
                            },
                        ));
                    }
                }
                let _ = reply.send(out);
            }
            ShardMsg::Flush(statuses, reply) => {
                for (id, s) in statuses {
                    if let Some(n) = st.nodes.get_mut(&id) {
                        n.recorded_status = Some(s);
                    }
                }
                let mut out = vec![];
                for (id, n) in st.nodes.iter_mut() {
                    for (status, count) in n.unflushed_refusals.drain(..) {
                        out.push((id.clone(), status, count));
                    }
                }
                let _ = reply.send(out);
            }
            ShardMsg::Rebuild { at_ms } => {
                st.rebuilt_at_ms = at_ms;
                st.seed();
            }
            ShardMsg::Crash => return Err(From::from("shard asked to crash")),
        }
        Ok(())
    }
}

/// The root: spawns the shards and respawns any that fails.
pub struct NodeSupervisor;

pub struct SupervisorState {
    handle: Supervision,
}

impl Actor for NodeSupervisor {
    type Msg = ();
    type State = SupervisorState;
    type Arguments = Supervision;

    async fn pre_start(
        &self,
        myself: ActorRef<()>,
        handle: Supervision,
    ) -> Result<SupervisorState, ActorProcessingErr> {
        for i in 0..handle.shards {
            let (r, _) =
                Actor::spawn_linked(None, Shard, handle.args(i), myself.get_cell()).await?;
            handle.refs.write().unwrap_or_else(|p| p.into_inner())[i] = Some(r);
        }
        Ok(SupervisorState { handle })
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<()>,
        evt: SupervisionEvent,
        st: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        let (cell, why) = match evt {
            SupervisionEvent::ActorFailed(cell, e) => (cell, e.to_string()),
            SupervisionEvent::ActorTerminated(cell, _, reason) => {
                (cell, reason.unwrap_or_else(|| "stopped".into()))
            }
            _ => return Ok(()),
        };
        let index = {
            let refs = st.handle.refs.read().unwrap_or_else(|p| p.into_inner());
            refs.iter()
                .position(|r| r.as_ref().is_some_and(|r| r.get_id() == cell.get_id()))
        };
        let Some(i) = index else { return Ok(()) };
        tracing::warn!(shard = i, reason = %why, "node shard failed: restarting it from the replicated state");
        st.handle.restarts.fetch_add(1, Ordering::SeqCst);
        let (r, _) = Actor::spawn_linked(None, Shard, st.handle.args(i), myself.get_cell()).await?;
        st.handle.refs.write().unwrap_or_else(|p| p.into_inner())[i] = Some(r);
        Ok(())
    }
}

/// The handle the HTTP layer holds: routes messages to shards.
#[derive(Clone)]
pub struct Supervision {
    shards: usize,
    telemetry_budget: usize,
    app: Arc<Replicated>,
    /// What the leader shared of its live view; shards seed from it when rebuilt.
    pub observed: Arc<Observed>,
    refs: Arc<RwLock<Vec<Option<ActorRef<ShardMsg>>>>>,
    rebuilt_at_ms: Arc<AtomicU64>,
    pub restarts: Arc<AtomicU64>,
    /// The root supervisor, to stop the whole tree with its member.
    root: Arc<std::sync::Mutex<Option<ractor::ActorCell>>>,
}

impl Supervision {
    /// Start the tree with `shards` shards over `app` and the default telemetry budget.
    pub async fn start(app: Arc<Replicated>, shards: usize, now_ms: i64) -> anyhow::Result<Self> {
        Self::start_with(app, shards, DEFAULT_TELEMETRY_BUDGET, now_ms).await
    }

    /// Start the tree; the shards share `telemetry_budget` bytes of telemetry samples.
    pub async fn start_with(
        app: Arc<Replicated>,
        shards: usize,
        telemetry_budget: usize,
        now_ms: i64,
    ) -> anyhow::Result<Self> {
        let h = Supervision {
            shards: shards.max(1),
            telemetry_budget,
            app,
            observed: Arc::new(Observed::new(telemetry_budget)),
            refs: Arc::new(RwLock::new(vec![None; shards.max(1)])),
            rebuilt_at_ms: Arc::new(AtomicU64::new(now_ms as u64)),
            restarts: Arc::new(AtomicU64::new(0)),
            root: Default::default(),
        };
        let (root, _) = Actor::spawn(None, NodeSupervisor, h.clone())
            .await
            .map_err(|e| anyhow::anyhow!("start the node supervisor: {e}"))?;
        *h.root.lock().unwrap_or_else(|p| p.into_inner()) = Some(root.get_cell());
        Ok(h)
    }

    /// Stop the tree (its member is shutting down); the shards stop with their supervisor.
    pub fn stop(&self) {
        if let Some(root) = self.root.lock().unwrap_or_else(|p| p.into_inner()).take() {
            root.stop(Some("member shutting down".into()));
        }
    }

    fn args(&self, index: usize) -> ShardArgs {
        ShardArgs {
            index,
            shards: self.shards,
            app: self.app.clone(),
            observed: self.observed.clone(),
            rebuilt_at_ms: self.rebuilt_at_ms.load(Ordering::SeqCst) as i64,
            telemetry_budget: self.telemetry_budget / self.shards,
        }
    }

    fn shard(&self, node_id: &NodeId) -> Option<ActorRef<ShardMsg>> {
        self.refs.read().unwrap_or_else(|p| p.into_inner())[shard_of(node_id, self.shards)].clone()
    }

    fn all_refs(&self) -> Vec<ActorRef<ShardMsg>> {
        self.refs
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .flatten()
            .cloned()
            .collect()
    }

    pub fn heartbeat(&self, node_id: &NodeId, at_ms: i64, telemetry: Sample, report: bool) {
        self.app.view.mark();
        if let Some(s) = self.shard(node_id) {
            let _ = s.cast(ShardMsg::Heartbeat {
                node_id: node_id.clone(),
                at_ms,
                telemetry,
                report,
            });
        }
    }

    pub fn report(&self, node_id: &NodeId, at_ms: i64) {
        self.app.view.mark();
        if let Some(s) = self.shard(node_id) {
            let _ = s.cast(ShardMsg::Report {
                node_id: node_id.clone(),
                at_ms,
            });
        }
    }

    pub fn refused(&self, node_id: &NodeId, refusal: Refusal) {
        self.app.view.mark();
        if let Some(s) = self.shard(node_id) {
            let _ = s.cast(ShardMsg::Refused {
                node_id: node_id.clone(),
                refusal,
            });
        }
    }

    /// One node's live state and when its shard was last rebuilt.
    pub async fn get(&self, node_id: &NodeId) -> (NodeLive, i64) {
        let Some(s) = self.shard(node_id) else {
            return (NodeLive::default(), self.rebuilt_at());
        };
        let id = node_id.clone();
        ractor::call_t!(s, ShardMsg::Get, CALL_TIMEOUT_MS, id)
            .unwrap_or_else(|_| (NodeLive::default(), self.rebuilt_at()))
    }

    /// Every node's live state (without telemetry rings), with its shard's rebuild time.
    pub async fn all(&self) -> HashMap<NodeId, (NodeLive, i64)> {
        let mut out = HashMap::new();
        for s in self.all_refs() {
            if let Ok((nodes, at)) = ractor::call_t!(s, ShardMsg::All, CALL_TIMEOUT_MS) {
                out.extend(nodes.into_iter().map(|(k, v)| (k, (v, at))));
            }
        }
        out
    }

    /// The live state (without telemetry rings) of the nodes named, with their shard's
    /// rebuild time: one call per shard, however many nodes.
    pub async fn many(&self, ids: &[NodeId]) -> HashMap<NodeId, (NodeLive, i64)> {
        let mut by_shard: Vec<Vec<NodeId>> = vec![vec![]; self.shards];
        for id in ids {
            by_shard[shard_of(id, self.shards)].push(id.clone());
        }
        let refs = self.refs.read().unwrap_or_else(|p| p.into_inner()).clone();
        let mut out = HashMap::new();
        for (want, s) in by_shard.into_iter().zip(refs) {
            let Some(s) = s.filter(|_| !want.is_empty()) else {
                continue;
            };
            if let Ok((nodes, at)) = ractor::call_t!(s, ShardMsg::Many, CALL_TIMEOUT_MS, want) {
                out.extend(nodes.into_iter().map(|(k, v)| (k, (v, at))));
            }
        }
        out
    }

    /// What changed in every shard since the last share (see [`ShardMsg::TakeShare`]).
    pub async fn take_share(&self, now_ms: i64) -> Vec<(NodeId, ObservedNode)> {
        let mut out = vec![];
        for s in self.all_refs() {
            if let Ok(v) = ractor::call_t!(s, ShardMsg::TakeShare, CALL_TIMEOUT_MS, now_ms) {
                out.extend(v);
            }
        }
        out
    }

    /// Record `statuses` as written and take every shard's unflushed refusals.
    pub async fn flush(&self, statuses: Vec<(NodeId, NodeStatus)>) -> Vec<(NodeId, u16, u32)> {
        let mut by_shard: Vec<Vec<(NodeId, NodeStatus)>> = vec![vec![]; self.shards];
        for (id, s) in statuses {
            by_shard[shard_of(&id, self.shards)].push((id, s));
        }
        let mut out = vec![];
        for (i, s) in self.all_refs().into_iter().enumerate() {
            let st = std::mem::take(&mut by_shard[i.min(self.shards - 1)]);
            if let Ok(v) = ractor::call_t!(s, ShardMsg::Flush, CALL_TIMEOUT_MS, st) {
                out.extend(v);
            }
        }
        out
    }

    /// Forget live state and start again from the replicated state (this member became leader).
    pub fn rebuild(&self, at_ms: i64) {
        self.app.view.mark();
        self.rebuilt_at_ms.store(at_ms as u64, Ordering::SeqCst);
        for s in self.all_refs() {
            let _ = s.cast(ShardMsg::Rebuild { at_ms });
        }
    }

    pub fn rebuilt_at(&self) -> i64 {
        self.rebuilt_at_ms.load(Ordering::SeqCst) as i64
    }

    /// Make the shard of `node_id` fail (tests of the supervision).
    pub fn crash_shard_of(&self, node_id: &NodeId) {
        if let Some(s) = self.shard(node_id) {
            let _ = s.cast(ShardMsg::Crash);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::Command;
    use crate::state::Envelope;
    use modelforge_raft::Application;

    /// Any bytes stand for a sample here: the supervisor never looks inside one.
    fn text(s: &str) -> Sample {
        s.as_bytes().into()
    }

    /// A heartbeat body as the bench and a real 8-GPU agent send it, with events.
    fn eight_gpus() -> Telemetry {
        let body = serde_json::json!({"accelerators": (0..8).map(|g| serde_json::json!({
            "uuid": format!("GPU-0000002a-{g:04x}-4a1b-9c2d-{:012x}", 336 + g),
            "utilization_pct": 90.0 + g as f64 * 0.5, "memory_used_mib": 61234.0 + g as f64,
            "temperature_c": 68.0 + g as f64, "power_draw_w": 612.4 + g as f64,
            "ecc_errors_uncorrected": 0,
            "processes": [{"pid": 4000 + g, "used_memory_mib": 61000.0}],
            "events": if g == 3 {
                serde_json::json!([
                    {"kind": "xid", "code": 79, "count": 2, "first_at": "2026-12-07T09:00:00.000Z",
                     "last_at": "2026-12-07T09:00:05.000Z"},
                    {"kind": "from_a_newer_agent", "count": 1, "first_at": "2026-12-07T09:00:00.000Z",
                     "last_at": "2026-12-07T09:00:00.000Z"},
                    {"kind": "xid", "count": "not a number"}
                ])
            } else {
                serde_json::json!([])
            },
        })).collect::<Vec<_>>()});
        serde_json::from_value(body).unwrap()
    }

    /// A sample reads back as exactly the telemetry that was parsed (the events this member
    /// could read included, an unknown kind as `other`), and is about half its JSON's size.
    #[test]
    fn a_sample_reads_back_as_the_parsed_telemetry_in_half_the_bytes_of_its_json() {
        let t = eight_gpus();
        assert_eq!(
            t.accelerators[3].events.len(),
            2,
            "the unreadable event is dropped"
        );
        let sample = encode_sample(&t);
        assert_eq!(decode_sample(&sample), Some(t.clone()));
        let json = serde_json::to_string(&t).unwrap();
        assert!(
            sample.len() * 2 <= json.len() + json.len() / 10,
            "sample {} bytes, JSON {} bytes",
            sample.len(),
            json.len()
        );
        assert_eq!(
            decode_sample(b"{\"accelerators\":[]}"),
            None,
            "JSON is not a sample"
        );
        assert_eq!(
            decode_sample(&sample[..sample.len() / 2]),
            None,
            "a cut sample"
        );
    }

    fn app_with_nodes(n: usize) -> Arc<Replicated> {
        let app = Arc::new(Replicated::default());
        let mut idx = 0;
        let mut apply = |cmd: Command| {
            idx += 1;
            let env = Envelope {
                request_id: format!("r{idx}"),
                now_ms: 1000,
                actor: "t".into(),
                command: cmd,
            };
            app.apply(idx, &modelforge_raft::codec::encode(&env).unwrap());
        };
        for i in 0..n {
            apply(Command::CreateToken {
                token_id: format!("t{i}").into(),
                hash: "h".into(),
                ttl_ms: 60_000,
                note: None,
            });
            apply(Command::Enroll {
                token_id: format!("t{i}").into(),
                public_key: format!("k{i}"),
                hostname: format!("h{i}"),
                inventory: Default::default(),
                new_node_id: format!("n{i}").into(),
                credential_id: format!("c{i}").into(),
                credential_hash: "x".into(),
                proof_signed_at_ms: 1,
            });
        }
        app
    }

    async fn wait(what: &str, mut f: impl AsyncFnMut() -> bool) {
        for _ in 0..200 {
            if f().await {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        panic!("timed out waiting for {what}");
    }

    #[tokio::test]
    async fn a_crashed_shard_is_restarted_and_rebuilt_without_touching_the_others() {
        let app = app_with_nodes(40);
        let sup = Supervision::start(app, 4, 5000).await.unwrap();
        for i in 0..40 {
            sup.heartbeat(
                &NodeId::from(format!("n{i}")),
                6000,
                text(&format!("{{\"i\":{i}}}")),
                true,
            );
        }
        wait("every heartbeat applied", async || {
            sup.all()
                .await
                .values()
                .filter(|(l, _)| l.last_heartbeat_ms == Some(6000))
                .count()
                == 40
        })
        .await;
        let victim = &NodeId::from("n7");
        let other = (0..40)
            .map(|i| NodeId::from(format!("n{i}")))
            .find(|n| shard_of(n, 4) != shard_of(victim, 4))
            .unwrap();
        sup.crash_shard_of(victim);
        wait("the supervisor restarts the shard", async || {
            sup.restarts.load(Ordering::SeqCst) == 1
        })
        .await;
        wait("the restarted shard answers", async || {
            sup.get(victim).await.0.telemetry.is_empty()
        })
        .await;
        // The victim's shard was rebuilt from the replicated state (no heartbeat known there).
        let (v, _) = sup.get(victim).await;
        assert_eq!(v.last_heartbeat_ms, None);
        assert_eq!(
            v.last_report_ms, None,
            "accelerators are unverified until the next report"
        );
        // Another shard kept its live state.
        let (o, _) = sup.get(&other).await;
        assert_eq!(o.last_heartbeat_ms, Some(6000));
        assert_eq!(o.telemetry.len(), 1);
        // The restarted shard serves again.
        sup.heartbeat(victim, 7000, text("{}"), true);
        wait("the victim's next report", async || {
            sup.get(victim).await.0.last_heartbeat_ms == Some(7000)
        })
        .await;
        // All nodes are still tracked.
        assert_eq!(sup.all().await.len(), 40);
    }

    fn refusal(at_ms: i64) -> Refusal {
        Refusal {
            status: 401,
            code: "invalid_credential",
            at_ms,
            credential_of_this_node: false,
        }
    }

    #[tokio::test]
    async fn telemetry_ring_is_bounded_and_refusals_are_coalesced() {
        let app = app_with_nodes(1);
        let sup = Supervision::start(app, 2, 0).await.unwrap();
        let n0 = &NodeId::from("n0");
        for i in 0..100 {
            sup.heartbeat(n0, i, text(&format!("{{\"i\":{i}}}")), false);
            sup.refused(n0, refusal(i));
        }
        sup.refused(&NodeId::from("unknown-node"), refusal(5));
        wait("all messages", async || {
            sup.get(n0).await.0.last_heartbeat_ms == Some(99)
        })
        .await;
        let (l, _) = sup.get(n0).await;
        assert_eq!(l.telemetry.len(), TELEMETRY_RING);
        assert_eq!(l.telemetry.front().unwrap().0, 100 - TELEMETRY_RING as i64);
        assert_eq!(l.last_refusal, Some(refusal(99)));
        let flushed = sup.flush(vec![(n0.clone(), NodeStatus::Online)]).await;
        assert_eq!(flushed, vec![(n0.clone(), 401, 100)]);
        assert!(sup.flush(vec![]).await.is_empty());
        assert_eq!(
            sup.get(n0).await.0.recorded_status,
            Some(NodeStatus::Online)
        );
        assert_eq!(sup.all().await.len(), 1, "unknown node ids get no entry");
    }

    #[tokio::test]
    async fn telemetry_rings_share_a_byte_budget_and_keep_each_nodes_latest_sample() {
        let app = app_with_nodes(20);
        let sample = |i: i64| format!("{{\"pad\":\"{}\",\"i\":{i}}}", "x".repeat(900));
        let per = sample(0).len() + SAMPLE_OVERHEAD;
        // One shard, room for 40 samples: 20 nodes x 10 heartbeats end with about 2 each.
        let budget = 40 * per;
        // `rounds` heartbeats from each of `nodes` nodes, then wait until the shard has them all.
        let beat = async |sup: &Supervision, nodes: usize, rounds: i64| {
            for i in 0..rounds {
                for n in 0..nodes {
                    sup.heartbeat(&NodeId::from(format!("n{n}")), i, text(&sample(i)), false);
                }
            }
            let last = NodeId::from(format!("n{}", nodes - 1));
            wait("all heartbeats", async || {
                sup.get(&last).await.0.last_heartbeat_ms == Some(rounds - 1)
            })
            .await;
        };
        let sup = Supervision::start_with(app, 1, budget, 0).await.unwrap();
        beat(&sup, 20, 10).await;
        let mut held = 0;
        for n in 0..20 {
            let (l, _) = sup.get(&NodeId::from(format!("n{n}"))).await;
            assert!(!l.telemetry.is_empty(), "n{n} lost its latest sample");
            assert_eq!(
                l.telemetry.back().unwrap().0,
                9,
                "n{n}'s latest is not the last one"
            );
            held += l.telemetry.len();
        }
        assert!(
            held * per <= budget,
            "{held} samples exceed the budget of 40"
        );
        assert!(held >= 20, "{held}");
        // A budget smaller than one sample a node still keeps every node's latest.
        let sup = Supervision::start_with(app_with_nodes(3), 1, 1, 0)
            .await
            .unwrap();
        beat(&sup, 3, 5).await;
        for n in 0..3 {
            let (l, _) = sup.get(&NodeId::from(format!("n{n}"))).await;
            assert_eq!(l.telemetry.len(), 1);
            assert_eq!(l.telemetry[0].0, 4);
        }
    }

    /// What the leader shares reaches another member's store through the wire shape, and a
    /// member that becomes leader seeds its view from it: the refusal and the latest sample
    /// survive the failover, the sample dates a heartbeat but is no hardware report.
    #[tokio::test]
    async fn a_new_leader_seeds_its_view_with_what_the_old_one_shared() {
        let leader = Supervision::start(app_with_nodes(3), 2, 0).await.unwrap();
        let n0 = NodeId::from("n0");
        leader.heartbeat(&n0, 5_000, text("{\"gpu\":1}"), true);
        let refusal = Refusal {
            status: 403,
            code: ErrorCode::CredentialForOtherNode.as_str(),
            at_ms: 6_000,
            credential_of_this_node: false,
        };
        leader.refused(&n0, refusal);
        let mut share = vec![];
        wait("the heartbeat and the refusal are shared", async || {
            share.extend(leader.take_share(10_000).await);
            let o = share.iter().find(|(id, _)| *id == n0).map(|(_, o)| o);
            o.is_some_and(|o| o.last_refusal.is_some())
                && share
                    .iter()
                    .any(|(id, o)| *id == n0 && o.telemetry.is_some())
        })
        .await;
        assert!(
            leader.take_share(11_000).await.is_empty(),
            "nothing changed, nothing is shared again"
        );
        leader.heartbeat(&n0, 7_000, text("{\"gpu\":2}"), false);
        leader.refused(&n0, refusal);
        wait("only the new refusal is shared within 30 s", async || {
            let v = leader.take_share(12_000).await;
            v.len() == 1 && v[0].1.telemetry.is_none() && v[0].1.last_refusal.is_some()
        })
        .await;
        let v = leader.take_share(5_000 + OBSERVED_TELEMETRY_EVERY_MS).await;
        assert_eq!(v[0].1.telemetry.as_ref().unwrap().0, 7_000, "{v:?}");

        // Through the wire, into another member's store; an unknown code is dropped.
        let wire: Vec<SharedNode> = share
            .iter()
            .map(|(id, o)| SharedNode::from_observed(id.clone(), o))
            .chain([SharedNode {
                node_id: NodeId::from("n1"),
                refusal: Some((401, "made_up".into(), 1, true)),
                telemetry: None,
            }])
            .collect();
        let bytes = modelforge_raft::codec::encode(&wire).unwrap();
        let back: Vec<SharedNode> = modelforge_raft::codec::decode(&bytes).unwrap();
        let follower_app = app_with_nodes(3);
        let follower = Supervision::start(follower_app.clone(), 2, 0)
            .await
            .unwrap();
        let batch = back.into_iter().map(SharedNode::into_observed).collect();
        follower.observed.merge(&follower_app.read(), batch, 20_000);
        assert_eq!(
            follower.observed.counts(),
            ObservedCounts {
                nodes: 2,
                refusals: 1,
                telemetry_samples: 1
            }
        );
        let (before, _) = follower.get(&n0).await;
        assert_eq!(before.last_refusal, None, "seeded only when rebuilt");
        follower.rebuild(30_000);
        wait("the rebuilt view holds the shared state", async || {
            follower.get(&n0).await.0.last_refusal == Some(refusal)
        })
        .await;
        let (live, _) = follower.get(&n0).await;
        assert_eq!(
            live.telemetry.back().map(|(at, t)| (*at, &**t)),
            Some((5_000, b"{\"gpu\":1}".as_slice()))
        );
        assert_eq!(live.last_heartbeat_ms, Some(5_000));
        assert_eq!(
            live.last_report_ms, None,
            "a shared sample is no hardware report"
        );
        assert!(!live.refusal_shared, "the new leader shares it again");
        assert_eq!(follower.get(&NodeId::from("n1")).await.0.last_refusal, None);
    }

    /// The store keeps the newer of two samples or refusals, keeps nothing for a node that is
    /// not in its state, and holds samples within its budget.
    #[test]
    fn the_observed_store_keeps_the_newest_for_known_nodes_within_its_budget() {
        let app = app_with_nodes(3);
        let budget = sample_cost(b"aaaa") + sample_cost(b"bbbb");
        let store = Observed::new(budget);
        let obs = |at: i64, text: &str| ObservedNode {
            last_refusal: None,
            telemetry: Some((at, text.as_bytes().into())),
        };
        let id = |s: &str| NodeId::from(s);
        let state = app.read();
        let taken = store.merge(
            &state,
            vec![
                (id("n0"), obs(10, "aaaa")),
                (id("nx"), obs(10, "xxxx")),
                (id("n1"), obs(10, "bbbb")),
            ],
            0,
        );
        assert_eq!(taken, 2, "the unknown node is skipped");
        store.merge(&state, vec![(id("n2"), obs(10, "cccc"))], 0);
        assert_eq!(
            store.get(&id("n2")).unwrap().telemetry,
            None,
            "over the budget"
        );
        store.merge(&state, vec![(id("n0"), obs(5, "old!"))], 0);
        assert_eq!(store.get(&id("n0")).unwrap().telemetry.unwrap().0, 10);
        store.merge(&state, vec![(id("n0"), obs(20, "newr"))], 0);
        assert_eq!(
            &*store.get(&id("n0")).unwrap().telemetry.unwrap().1,
            b"newr"
        );
        assert_eq!(store.counts().telemetry_samples, 2);
    }
}
