//! Deterministic simulation of a cluster in one process (ARCHITECTURE.md, "Deterministic
//! simulation"): openraft with the production configuration choices, the application's own
//! state machine, and a simulated peer network with seeded faults, all on one current-thread
//! runtime with paused (virtual) time. The same seed gives the same run, event for event: the
//! run's trace hash proves it.
//!
//! What is simulated here, not the production code: the log store (an in-memory "durable
//! store" that outlives a member's crash; the production store is redb with a writer thread,
//! which cannot run deterministically) and the transport (the production one is HTTPS).
//! openraft, its configuration and the [`Application`] are the real ones.

use std::collections::BTreeMap;
use std::collections::BTreeSet;
use std::fmt::Debug;
use std::io;
use std::ops::RangeBounds;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use futures_util::Stream;
use futures_util::TryStreamExt;
use openraft::BasicNode;
use openraft::EntryPayload;
use openraft::LogState;
use openraft::OptionalSend;
use openraft::RaftLogReader;
use openraft::RaftSnapshotBuilder;
use openraft::ServerState;
use openraft::alias::EntryOf;
use openraft::alias::LogIdOf;
use openraft::alias::SnapshotMetaOf;
use openraft::alias::SnapshotOf;
use openraft::alias::StoredMembershipOf;
use openraft::alias::VoteOf;
use openraft::async_runtime::WatchReceiver;
use openraft::entry::RaftEntry;
use openraft::errors::ClientWriteError;
use openraft::errors::NetworkError;
use openraft::errors::RPCError;
use openraft::errors::RaftError;
use openraft::errors::ReplicationClosed;
use openraft::errors::StreamingError;
use openraft::errors::Unreachable;
use openraft::network::RPCOption;
use openraft::network::RaftNetworkFactory;
use openraft::network::v2::RaftNetworkV2;
use openraft::raft::AppendEntriesRequest;
use openraft::raft::AppendEntriesResponse;
use openraft::raft::SnapshotResponse;
use openraft::raft::VoteRequest;
use openraft::raft::VoteResponse;
use openraft::storage::EntryResponder;
use openraft::storage::IOFlushed;
use openraft::storage::RaftLogStorage;
use openraft::storage::RaftStateMachine;
use openraft_rt::AsyncRuntime;
use openraft_rt::deterministic_rng::DeterministicRng;
use openraft_rt_tokio::TokioRuntime;
use sha2::Digest;

use crate::AppRequest;
use crate::AppResponse;
use crate::Application;

/// The runtime: tokio, with every random choice openraft makes drawn from the run's seed.
pub type SimRuntime = DeterministicRng<TokioRuntime>;

openraft::declare_raft_types!(
    /// ModelForge's type configuration under the simulator (only the runtime differs).
    pub SimConfig:
        D = AppRequest,
        R = AppResponse,
        NodeId = u64,
        Node = BasicNode,
        AsyncRuntime = SimRuntime,
);

type C = SimConfig;
/// What a state machine has applied: the last log id and the membership.
type AppliedState = (Option<LogIdOf<C>>, StoredMembershipOf<C>);
/// A member's view in `settle`: (id, leader, applied index, last log index).
type View = (u64, Option<u64>, Option<u64>, Option<u64>);
/// A snapshot's bytes, in memory.
type SnapData = std::io::Cursor<Vec<u8>>;
type SimRaft<A> = openraft::Raft<C, SimSm<A>>;

/// A small, fast, seedable generator (SplitMix64): the schedule's only source of chance.
#[derive(Clone, Debug)]
pub struct SimRng(u64);

impl SimRng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// True with probability `per_mille / 1000`.
    pub fn chance(&mut self, per_mille: u64) -> bool {
        self.below(1000) < per_mille
    }
}

/// The seeded fault model of the network.
#[derive(Clone, Debug)]
pub struct Faults {
    /// Chance (per mille) that a request is lost before it is delivered.
    pub loss_per_mille: u64,
    /// Chance (per mille) that an answer is lost after the request was served.
    pub reply_loss_per_mille: u64,
    /// Each message is delayed by up to this (virtual) time.
    pub max_delay_ms: u64,
}

impl Default for Faults {
    fn default() -> Self {
        Self {
            loss_per_mille: 30,
            reply_loss_per_mille: 30,
            max_delay_ms: 20,
        }
    }
}

/// What a member keeps across a crash: its log, vote, committed index and last snapshot.
#[derive(Default)]
struct Durable {
    vote: Option<VoteOf<C>>,
    committed: Option<LogIdOf<C>>,
    purged: Option<LogIdOf<C>>,
    entries: BTreeMap<u64, EntryOf<C>>,
    snapshot: Option<(SnapshotMetaOf<C>, Vec<u8>)>,
}

/// The in-memory durable store of one member: every write is durable when it returns (like the
/// production store's fsync before a callback).
#[derive(Clone, Default)]
pub struct SimStore(Arc<Mutex<Durable>>);

impl SimStore {
    fn lock(&self) -> std::sync::MutexGuard<'_, Durable> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl RaftLogReader<C> for SimStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<EntryOf<C>>, io::Error> {
        Ok(self
            .lock()
            .entries
            .range(range)
            .map(|(_, e)| e.clone())
            .collect())
    }

    async fn read_vote(&mut self) -> Result<Option<VoteOf<C>>, io::Error> {
        Ok(self.lock().vote)
    }
}

impl RaftLogStorage<C> for SimStore {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<C>, io::Error> {
        let d = self.lock();
        let last = d
            .entries
            .values()
            .next_back()
            .map(|e| e.log_id())
            .or(d.purged);
        Ok(LogState {
            last_purged_log_id: d.purged,
            last_log_id: last,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &VoteOf<C>) -> Result<(), io::Error> {
        self.lock().vote = Some(*vote);
        Ok(())
    }

    async fn save_committed(&mut self, committed: Option<LogIdOf<C>>) -> Result<(), io::Error> {
        self.lock().committed = committed;
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogIdOf<C>>, io::Error> {
        Ok(self.lock().committed)
    }

    async fn append<I>(&mut self, entries: I, callback: IOFlushed<C>) -> Result<(), io::Error>
    where
        I: IntoIterator<Item = EntryOf<C>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        {
            let mut d = self.lock();
            for e in entries {
                d.entries.insert(e.log_id().index(), e);
            }
        }
        callback.io_completed(Ok(()));
        Ok(())
    }

    async fn truncate_after(&mut self, last_log_id: Option<LogIdOf<C>>) -> Result<(), io::Error> {
        let from = last_log_id.map(|l| l.index() + 1).unwrap_or(0);
        let _ = self.lock().entries.split_off(&from);
        Ok(())
    }

    async fn purge(&mut self, log_id: LogIdOf<C>) -> Result<(), io::Error> {
        let mut d = self.lock();
        let keep = d.entries.split_off(&(log_id.index() + 1));
        d.entries = keep;
        d.purged = Some(log_id);
        Ok(())
    }
}

/// What was applied where: the hash of the command applied at each index, shared by every
/// member and every incarnation (two different commands at one index is a violation).
#[derive(Default)]
struct Applied {
    by_index: BTreeMap<u64, [u8; 32]>,
    conflicts: Vec<String>,
}

/// The state machine adapter of one member incarnation: the application in memory, its last
/// snapshot in the member's durable store.
pub struct SimSm<A> {
    id: u64,
    app: Arc<A>,
    store: SimStore,
    applied: Arc<Mutex<AppliedState>>,
    world: Arc<Mutex<Applied>>,
}

impl<A> Clone for SimSm<A> {
    fn clone(&self) -> Self {
        Self {
            id: self.id,
            app: self.app.clone(),
            store: self.store.clone(),
            applied: self.applied.clone(),
            world: self.world.clone(),
        }
    }
}

impl<A: Application> SimSm<A> {
    fn applied(&self) -> std::sync::MutexGuard<'_, AppliedState> {
        self.applied.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn entry_hash(entry: &EntryOf<C>) -> [u8; 32] {
    let mut h = sha2::Sha256::new();
    h.update(entry.log_id.index().to_le_bytes());
    match &entry.payload {
        EntryPayload::Blank => h.update(b"blank"),
        EntryPayload::Normal(r) => {
            h.update(b"normal");
            h.update(&r.0);
        }
        EntryPayload::Membership(m) => h.update(format!("membership {m:?}").as_bytes()),
    }
    h.finalize().into()
}

impl<A: Application> RaftSnapshotBuilder<C> for SimSm<A> {
    type SnapshotData = SnapData;

    async fn build_snapshot(&mut self) -> Result<SnapshotOf<C, SnapData>, io::Error> {
        let (meta, encode) = {
            let a = self.applied();
            let meta = SnapshotMetaOf::<C> {
                last_log_id: a.0,
                last_membership: a.1.clone(),
            };
            (meta, self.app.snapshot())
        };
        let data = encode();
        self.store.lock().snapshot = Some((meta.clone(), data.clone()));
        Ok(SnapshotOf::<C, SnapData> {
            meta,
            snapshot: std::io::Cursor::new(data),
        })
    }
}

impl<A: Application> RaftStateMachine<C> for SimSm<A> {
    type SnapshotData = SnapData;
    type SnapshotBuilder = Self;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogIdOf<C>>, StoredMembershipOf<C>), io::Error> {
        let a = self.applied();
        Ok((a.0, a.1.clone()))
    }

    async fn apply<Strm>(&mut self, mut entries: Strm) -> Result<(), io::Error>
    where
        Strm: Stream<Item = Result<EntryResponder<C>, io::Error>> + Unpin + OptionalSend,
    {
        while let Some((entry, responder)) = entries.try_next().await? {
            let index = entry.log_id.index();
            let hash = entry_hash(&entry);
            {
                let mut w = self.world.lock().unwrap_or_else(|p| p.into_inner());
                let first = *w.by_index.entry(index).or_insert(hash);
                if first != hash {
                    w.conflicts.push(format!(
                        "member {} applied another command at index {index}",
                        self.id
                    ));
                }
            }
            let response = match &entry.payload {
                EntryPayload::Blank => AppResponse::default(),
                EntryPayload::Normal(req) => AppResponse(self.app.apply(index, &req.0)),
                EntryPayload::Membership(m) => {
                    self.applied().1 = StoredMembershipOf::<C>::new(Some(entry.log_id), m.clone());
                    AppResponse::default()
                }
            };
            self.applied().0 = Some(entry.log_id);
            if let Some(responder) = responder {
                responder.send(response);
            }
        }
        Ok(())
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMetaOf<C>,
        snapshot: SnapData,
    ) -> Result<(), io::Error> {
        let data = snapshot.into_inner();
        self.app.restore(&data)?;
        {
            let mut a = self.applied();
            a.0 = meta.last_log_id;
            a.1 = meta.last_membership.clone();
        }
        self.store.lock().snapshot = Some((meta.clone(), data));
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<SnapshotOf<C, SnapData>>, io::Error> {
        Ok(self
            .store
            .lock()
            .snapshot
            .clone()
            .map(|(meta, data)| SnapshotOf::<C, SnapData> {
                meta,
                snapshot: std::io::Cursor::new(data),
            }))
    }
}

/// One member: its durable store, and its running incarnation (None while crashed).
struct Member<A: Application> {
    store: SimStore,
    raft: Option<SimRaft<A>>,
    app: Option<Arc<A>>,
    /// Bumped at every crash: messages of an older incarnation are never delivered.
    incarnation: u64,
}

struct World<A: Application> {
    members: BTreeMap<u64, Member<A>>,
    /// Cut links, both directions listed.
    cut: BTreeSet<(u64, u64)>,
    rng: SimRng,
    faults: Faults,
    trace: sha2::Sha256,
    events: u64,
    log: Vec<String>,
    /// term -> the leaders seen in it.
    leaders: BTreeMap<u64, BTreeSet<u64>>,
}

/// A simulated cluster (see the module's documentation).
pub struct Sim<A: Application> {
    world: Arc<Mutex<World<A>>>,
    applied: Arc<Mutex<Applied>>,
    config: Arc<openraft::Config>,
    make_app: Box<dyn Fn() -> Arc<A>>,
    start: tokio::time::Instant,
}

/// Why a client write got no answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SimWriteError {
    /// Certainly not applied (refused before it was proposed).
    NotApplied(String),
    /// May or may not have been applied.
    Unknown(String),
}

struct SimNet<A: Application> {
    world: Arc<Mutex<World<A>>>,
    from: u64,
    incarnation: u64,
    start: tokio::time::Instant,
}

struct SimClient<A: Application> {
    world: Arc<Mutex<World<A>>>,
    from: u64,
    incarnation: u64,
    to: u64,
    start: tokio::time::Instant,
}

impl<A: Application> RaftNetworkFactory<C> for SimNet<A> {
    type Network = SimClient<A>;

    async fn new_client(&mut self, target: u64, _node: &BasicNode) -> SimClient<A> {
        SimClient {
            world: self.world.clone(),
            from: self.from,
            incarnation: self.incarnation,
            to: target,
            start: self.start,
        }
    }
}

fn note<A: Application>(w: &mut World<A>, start: tokio::time::Instant, what: &str) {
    let at = start.elapsed().as_millis() as u64;
    w.trace.update(at.to_le_bytes());
    w.trace.update(what.as_bytes());
    w.events += 1;
    w.log.push(format!("{at} {what}"));
}

impl<A: Application> SimClient<A> {
    /// The link from this member's incarnation to the target, if it is up: the target's Raft.
    fn link(&self) -> Option<SimRaft<A>> {
        let w = self.world.lock().unwrap_or_else(|p| p.into_inner());
        let from = w.members.get(&self.from)?;
        if from.incarnation != self.incarnation || from.raft.is_none() {
            return None;
        }
        if w.cut.contains(&(self.from, self.to)) {
            return None;
        }
        w.members.get(&self.to)?.raft.clone()
    }

    /// Carry one RPC through the fault model: maybe lost, delayed, served, its answer lost.
    async fn carry<T, F, Fut>(&self, kind: &str, serve: F) -> Result<T, String>
    where
        F: FnOnce(SimRaft<A>) -> Fut,
        Fut: std::future::Future<Output = Result<T, String>>,
    {
        let (lost, delay, reply_lost) = {
            let mut w = self.world.lock().unwrap_or_else(|p| p.into_inner());
            let f = w.faults.clone();
            let lost = w.rng.chance(f.loss_per_mille);
            let delay = w.rng.below(f.max_delay_ms + 1);
            let reply_lost = w.rng.chance(f.reply_loss_per_mille);
            let what = format!(
                "{kind} {}->{} lost={lost} delay={delay} reply_lost={reply_lost}",
                self.from, self.to
            );
            note(&mut w, self.start, &what);
            (lost, delay, reply_lost)
        };
        tokio::time::sleep(Duration::from_millis(delay)).await;
        if lost {
            return Err("lost".into());
        }
        let raft = self.link().ok_or_else(|| "unreachable".to_string())?;
        let answer = serve(raft).await?;
        // The answer travels back over the same link (it may have been cut meanwhile).
        tokio::time::sleep(Duration::from_millis(delay / 2)).await;
        if reply_lost || self.link().is_none() {
            return Err("answer lost".into());
        }
        Ok(answer)
    }
}

fn unreachable(e: String) -> RPCError<C> {
    RPCError::Unreachable(Unreachable::from_string(e))
}

impl<A: Application> RaftNetworkV2<C> for SimClient<A> {
    type SnapshotData = SnapData;

    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<C>,
        _option: RPCOption,
    ) -> Result<AppendEntriesResponse<C>, RPCError<C>> {
        self.carry("append", |raft| async move {
            raft.append_entries(rpc).await.map_err(|e| e.to_string())
        })
        .await
        .map_err(unreachable)
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<C>,
        _option: RPCOption,
    ) -> Result<VoteResponse<C>, RPCError<C>> {
        self.carry("vote", |raft| async move {
            raft.vote(rpc).await.map_err(|e| e.to_string())
        })
        .await
        .map_err(unreachable)
    }

    async fn pre_vote(
        &mut self,
        rpc: VoteRequest<C>,
        _option: RPCOption,
    ) -> Result<VoteResponse<C>, RPCError<C>> {
        self.carry("pre-vote", |raft| async move {
            raft.pre_vote(rpc).await.map_err(|e| e.to_string())
        })
        .await
        .map_err(unreachable)
    }

    async fn full_snapshot(
        &mut self,
        vote: VoteOf<C>,
        snapshot: SnapshotOf<C, SnapData>,
        _cancel: impl std::future::Future<Output = ReplicationClosed> + OptionalSend + 'static,
        _option: RPCOption,
    ) -> Result<SnapshotResponse<C>, StreamingError<C>> {
        self.carry("snapshot", |raft| async move {
            raft.install_full_snapshot(vote, snapshot)
                .await
                .map_err(|e| e.to_string())
        })
        .await
        .map_err(|e| StreamingError::Network(NetworkError::from_string(e)))
    }
}

impl<A: Application> Sim<A> {
    /// `n` members (ids 1..=n), initialised as one cluster, with the production configuration
    /// choices; `make_app` makes a member's empty application (at start and at each restart).
    pub async fn new(n: u64, seed: u64, faults: Faults, make_app: Box<dyn Fn() -> Arc<A>>) -> Self {
        // The members' default timing (`RaftTuning::default`, what `serve`'s flags default to).
        let timing = crate::RaftTuning::default();
        let config = openraft::Config {
            cluster_name: "modelforge-sim".to_string(),
            heartbeat_interval: timing.heartbeat_interval_ms,
            election_timeout_min: timing.election_timeout_min_ms,
            election_timeout_max: timing.election_timeout_max_ms,
            // Often, so that snapshots are built, purged behind and installed on laggards.
            snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(40),
            max_in_snapshot_log_to_keep: 10,
            install_snapshot_timeout: 2_000,
            enable_leader_restore: Some(false),
            allow_log_reversion: Some(true),
            enable_pre_vote: Some(true),
            ..Default::default()
        };
        let sim = Self {
            world: Arc::new(Mutex::new(World {
                members: BTreeMap::new(),
                cut: BTreeSet::new(),
                rng: SimRng::new(seed),
                faults,
                trace: sha2::Sha256::new(),
                events: 0,
                log: vec![],
                leaders: BTreeMap::new(),
            })),
            applied: Arc::new(Mutex::new(Applied::default())),
            config: Arc::new(config.validate().expect("the simulation's configuration")),
            make_app,
            start: tokio::time::Instant::now(),
        };
        for id in 1..=n {
            sim.world().members.insert(
                id,
                Member {
                    store: SimStore::default(),
                    raft: None,
                    app: None,
                    incarnation: 0,
                },
            );
            sim.boot(id).await;
        }
        let nodes: BTreeMap<u64, BasicNode> = (1..=n)
            .map(|id| (id, BasicNode::new(format!("sim://{id}"))))
            .collect();
        let first = sim.raft(1).expect("member 1 runs");
        first
            .initialize(nodes)
            .await
            .expect("the simulated cluster initialises");
        sim
    }

    fn world(&self) -> std::sync::MutexGuard<'_, World<A>> {
        self.world.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn raft(&self, id: u64) -> Option<SimRaft<A>> {
        self.world().members.get(&id)?.raft.clone()
    }

    /// Start member `id` over its durable store: a fresh application restored from the kept
    /// snapshot; openraft then replays the committed log after it.
    async fn boot(&self, id: u64) {
        let (store, incarnation) = {
            let mut w = self.world();
            let m = w.members.get_mut(&id).expect("a known member");
            m.incarnation += 1;
            (m.store.clone(), m.incarnation)
        };
        let app = (self.make_app)();
        let mut applied = (None, StoredMembershipOf::<C>::default());
        if let Some((meta, data)) = store.lock().snapshot.clone() {
            app.restore(&data).expect("a kept snapshot restores");
            applied = (meta.last_log_id, meta.last_membership.clone());
        }
        let sm = SimSm {
            id,
            app: app.clone(),
            store: store.clone(),
            applied: Arc::new(Mutex::new(applied)),
            world: self.applied.clone(),
        };
        let net = SimNet {
            world: self.world.clone(),
            from: id,
            incarnation,
            start: self.start,
        };
        let raft = openraft::Raft::new(id, self.config.clone(), net, store, sm)
            .await
            .expect("a simulated member starts");
        let mut w = self.world();
        let m = w.members.get_mut(&id).expect("a known member");
        m.raft = Some(raft);
        m.app = Some(app);
        note(&mut w, self.start, &format!("boot {id}"));
    }

    /// The run's seeded generator, for the schedule.
    pub fn draw(&self, n: u64) -> u64 {
        self.world().rng.below(n)
    }

    /// Member ids, and which of them run.
    pub fn members(&self) -> Vec<(u64, bool)> {
        self.world()
            .members
            .iter()
            .map(|(id, m)| (*id, m.raft.is_some()))
            .collect()
    }

    /// The running application of member `id`.
    pub fn app(&self, id: u64) -> Option<Arc<A>> {
        self.world().members.get(&id)?.app.clone()
    }

    /// Crash member `id`: nothing more reaches it or leaves it; its durable store stays.
    pub async fn crash(&self, id: u64) {
        let raft = {
            let mut w = self.world();
            note(&mut w, self.start, &format!("crash {id}"));
            let m = w.members.get_mut(&id).expect("a known member");
            m.incarnation += 1;
            m.app = None;
            m.raft.take()
        };
        if let Some(raft) = raft {
            let _ = raft.shutdown().await;
        }
    }

    /// Restart a crashed member over its durable store.
    pub async fn restart(&self, id: u64) {
        if self.raft(id).is_none() {
            self.boot(id).await;
        }
    }

    /// Cut (or mend) the links between `a` and `b`, both ways.
    pub fn cut(&self, a: u64, b: u64, cut: bool) {
        let mut w = self.world();
        note(&mut w, self.start, &format!("cut {a} {b} {cut}"));
        if cut {
            w.cut.insert((a, b));
            w.cut.insert((b, a));
        } else {
            w.cut.remove(&(a, b));
            w.cut.remove(&(b, a));
        }
    }

    /// Mend every link.
    pub fn heal(&self) {
        let mut w = self.world();
        note(&mut w, self.start, "heal");
        w.cut.clear();
    }

    /// Record a client-side event in the trace (its answer, say).
    pub fn record(&self, what: &str) {
        let mut w = self.world();
        note(&mut w, self.start, what);
    }

    /// Look at every running member's view of leadership: more than one leader in a term is a
    /// violation (returned).
    pub fn observe(&self) -> Vec<String> {
        let mut w = self.world();
        let seen: Vec<(u64, u64)> = w
            .members
            .iter()
            .filter_map(|(id, m)| {
                let raft = m.raft.as_ref()?;
                let metrics = raft.metrics();
                let m = metrics.borrow_watched();
                (m.state == ServerState::Leader).then_some((m.current_term, *id))
            })
            .collect();
        let mut bad = vec![];
        for (term, id) in seen {
            let leaders = w.leaders.entry(term).or_default();
            leaders.insert(id);
            if leaders.len() > 1 {
                bad.push(format!("two leaders in term {term}: {leaders:?}"));
            }
        }
        bad
    }

    /// The running member that says it leads, and its term.
    pub fn leader_and_term(&self) -> Option<(u64, u64)> {
        let w = self.world();
        w.members.iter().find_map(|(id, m)| {
            let metrics = m.raft.as_ref()?.metrics();
            let m = metrics.borrow_watched();
            (m.state == ServerState::Leader).then_some((*id, m.current_term))
        })
    }

    /// The member each running member believes leads (the first running one that knows).
    pub fn believed_leader(&self) -> Option<u64> {
        let w = self.world();
        w.members.values().find_map(|m| {
            let raft = m.raft.as_ref()?;
            raft.metrics().borrow_watched().current_leader
        })
    }

    /// Propose `command` at member `at`, waiting at most `within` (virtual time).
    pub async fn write(
        &self,
        at: u64,
        command: Vec<u8>,
        within: Duration,
    ) -> Result<Vec<u8>, SimWriteError> {
        let Some(raft) = self.raft(at) else {
            return Err(SimWriteError::NotApplied(format!("member {at} is down")));
        };
        match tokio::time::timeout(within, raft.client_write(AppRequest(command))).await {
            Err(_) => Err(SimWriteError::Unknown("no answer in time".into())),
            Ok(Ok(resp)) => Ok(resp.data.0),
            Ok(Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f)))) => Err(
                SimWriteError::NotApplied(format!("not the leader (leader {:?})", f.leader_id)),
            ),
            Ok(Err(e)) => Err(SimWriteError::Unknown(e.to_string())),
        }
    }

    /// Heal, restart every member, and wait until all of them have applied the same last log
    /// index, which is at least the leader's commit at the time (at most `within`).
    pub async fn settle(&self, within: Duration) -> Result<u64, String> {
        self.heal();
        let ids: Vec<u64> = self.members().into_iter().map(|(id, _)| id).collect();
        for id in &ids {
            self.restart(*id).await;
        }
        // A no-op round of writes is the application's business; here only wait.
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let views: Vec<View> = ids
                .iter()
                .filter_map(|id| {
                    let raft = self.raft(*id)?;
                    let metrics = raft.metrics();
                    let m = metrics.borrow_watched();
                    Some((
                        *id,
                        m.current_leader,
                        m.last_applied.map(|l| l.index()),
                        m.last_log_index,
                    ))
                })
                .collect();
            let applied: BTreeSet<Option<u64>> = views.iter().map(|v| v.2).collect();
            let logs: BTreeSet<Option<u64>> = views.iter().map(|v| v.3).collect();
            let leaders: BTreeSet<Option<u64>> = views.iter().map(|v| v.1).collect();
            if views.len() == ids.len()
                && applied.len() == 1
                && logs.len() == 1
                && leaders.len() == 1
                && !leaders.contains(&None)
                && applied == logs
            {
                return Ok(applied.into_iter().next().flatten().unwrap_or(0));
            }
            if tokio::time::Instant::now() > deadline {
                return Err(format!(
                    "members did not converge: (id, leader, applied, last log) {views:?}"
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Violations found by the state machine adapters: two commands applied at one index.
    pub fn conflicts(&self) -> Vec<String> {
        self.applied
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .conflicts
            .clone()
    }

    /// The trace so far: (events, SHA-256 of every event with its virtual time).
    pub fn trace(&self) -> (u64, String) {
        let w = self.world();
        let h = w.trace.clone().finalize();
        (
            w.events,
            h.iter().map(|b| format!("{b:02x}")).collect::<String>(),
        )
    }

    /// Every event of the trace, in words.
    pub fn events(&self) -> Vec<String> {
        self.world().log.clone()
    }

    /// Virtual time since the start.
    pub fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }

    /// Stop every member.
    pub async fn shutdown(&self) {
        let ids: Vec<u64> = self.members().into_iter().map(|(id, _)| id).collect();
        for id in ids {
            self.crash(id).await;
        }
    }
}

/// Run `f` on a fresh current-thread runtime with paused time, with openraft's randomness
/// drawn from `seed`: the one way to run a simulation.
pub fn run<F, Fut, T>(seed: u64, f: F) -> T
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = T>,
{
    let mut builder = tokio::runtime::Builder::new_current_thread();
    builder.enable_time().start_paused(true);
    // tokio's own random choices (a watch channel's waiter shards) from the seed too.
    #[cfg(tokio_unstable)]
    builder.rng_seed(tokio::runtime::RngSeed::from_bytes(&seed.to_le_bytes()));
    let rt = builder.build().expect("a current-thread runtime");
    rt.block_on(SimRuntime::scope(seed, f()))
}

/// Whether runs replay exactly: tokio's randomness can be seeded only in a build with
/// `--cfg tokio_unstable` (`.cargo/config.toml` sets it).
pub fn replays_exactly() -> bool {
    cfg!(tokio_unstable)
}

/// Spawn a task of the simulation (it inherits the seeded randomness).
pub fn spawn<F>(f: F) -> tokio::task::JoinHandle<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    <SimRuntime as AsyncRuntime>::spawn(f)
}
