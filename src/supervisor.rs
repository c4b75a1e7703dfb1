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
use modelforge_proto::ids::HistoryKind;
use modelforge_proto::ids::NodeId;
use modelforge_proto::ids::NodeStatus;

/// Telemetry samples kept per node, at most.
pub const TELEMETRY_RING: usize = 32;
/// Bytes of telemetry samples kept over all nodes by default (`--telemetry-budget-mib`).
pub const DEFAULT_TELEMETRY_BUDGET: usize = 128 << 20;
/// What one sample costs besides its text: the ring slot and the allocation's header.
const SAMPLE_OVERHEAD: usize = 40;
/// How long a read of a shard may take.
const CALL_TIMEOUT_MS: u64 = 2000;

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
    /// Compact JSON text, not a parsed value: a fraction of the memory per sample.
    pub telemetry: VecDeque<(i64, Box<str>)>,
    pub last_refusal: Option<Refusal>,
    /// Refusals not yet written to the node's history: (status, count).
    pub unflushed_refusals: Vec<(u16, u32)>,
    /// The last hardware report (inventory or telemetry naming accelerators) received.
    pub last_report_ms: Option<i64>,
    /// The status last written to history.
    pub recorded_status: Option<NodeStatus>,
}

pub enum ShardMsg {
    Heartbeat {
        node_id: NodeId,
        at_ms: i64,
        telemetry: Box<str>,
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
    rebuilt_at_ms: i64,
    telemetry_budget: usize,
}

pub struct ShardState {
    index: usize,
    shards: usize,
    app: Arc<Replicated>,
    nodes: HashMap<NodeId, NodeLive>,
    rebuilt_at_ms: i64,
    /// This shard's share of the telemetry budget, and what its rings hold now.
    telemetry_budget: usize,
    telemetry_bytes: usize,
}

fn sample_cost(t: &str) -> usize {
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
    /// Seed from the replicated state: the shard's nodes, last seen per `last_used_at`.
    fn seed(&mut self) {
        self.nodes.clear();
        self.telemetry_bytes = 0;
        let s = self.app.read();
        for node in s.nodes.values() {
            if shard_of(&node.node_id, self.shards) != self.index
                || node.decommissioned_at_ms.is_some()
            {
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
            self.nodes.insert(
                node.node_id.clone(),
                NodeLive {
                    last_heartbeat_ms: seen,
                    recorded_status: last_status,
                    ..Default::default()
                },
            );
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

    pub fn heartbeat(&self, node_id: &NodeId, at_ms: i64, telemetry: Box<str>, report: bool) {
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
        if let Some(s) = self.shard(node_id) {
            let _ = s.cast(ShardMsg::Report {
                node_id: node_id.clone(),
                at_ms,
            });
        }
    }

    pub fn refused(&self, node_id: &NodeId, refusal: Refusal) {
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
                format!("{{\"i\":{i}}}").into(),
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
        sup.heartbeat(victim, 7000, "{}".into(), true);
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
            sup.heartbeat(n0, i, format!("{{\"i\":{i}}}").into(), false);
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
                    sup.heartbeat(&NodeId::from(format!("n{n}")), i, sample(i).into(), false);
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
}
