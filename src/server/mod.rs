//! The HTTP face of one member: the contract's API, the peer endpoints, forwarding to the
//! leader, and the background loops (bootstrap, leadership watch, coalesced writes).
//!
//! Request routing: every `/api/v1/...` request except `/api/v1/cluster` is served by the
//! leader. A member that is not the leader forwards the request as it came (method, path,
//! body, the caller's own authorization) to the leader and relays the answer, so clients never
//! need to know who leads. On the leader, reads are linearised by leader lease and writes go
//! through [`Ctx::propose`].

mod admin;
mod agent;
mod backup;
pub mod budget;
mod cordon;
pub mod edge;
mod extract;
mod forward;
mod members;
pub mod observe;
mod openapi;
mod operators;
mod peer;
pub mod peer_auth;
mod relay_batch;
mod routes;
mod scheduler;
mod strict;
mod tasks;
mod ui;
pub mod watch;
mod write;

use peer::share_observed;
use peer::share_verified;
pub use routes::router;
use tasks::*;

use secrecy::ExposeSecret;
use secrecy::SecretString;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use modelforge_proto::now_ms;
use modelforge_raft::Consensus;
use modelforge_raft::PeerNetwork;
use modelforge_raft::RaftTuning;

use crate::app::Replicated;
use crate::liveness::Liveness;
use crate::liveness::StatusThresholds;
use crate::secrets;
use crate::secrets::HashParams;
use crate::secrets::Hasher;

/// Everything `serve` needs, validated once by the CLI.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    pub node_id: u64,
    pub listen: SocketAddr,
    pub advertise: String,
    /// Where the member's certificate comes from; `Insecure` serves plain HTTP.
    pub tls: crate::tls::TlsSource,
    pub data_dir: PathBuf,
    /// The full initial membership, this member included: id -> URL.
    pub peers: BTreeMap<u64, String>,
    /// `--peer-route`: how this member reaches a peer when not by its advertised URL.
    pub peer_routes: BTreeMap<u64, String>,
    /// `--join`: members of the cluster this member waits to be added to (empty: it forms
    /// or belongs to one by its `--peer` list).
    pub join: Vec<String>,
    /// The bootstrap admin token (the operator `root`). Held as a secret: redacted from
    /// `Debug`, zeroed when dropped.
    pub admin_token: SecretString,
    /// The key of peer MACs and backup MACs.
    pub cluster_secret: SecretString,
    pub hash_params: HashParams,
    pub hash_workers: usize,
    pub credential_pool: usize,
    /// Offer a recovered node (re-enrolled, or restored) to the scheduler only after a
    /// passing capability smoke.
    pub require_smoke: bool,
    pub tuning: RaftTuning,
    pub thresholds: StatusThresholds,
    pub max_body_bytes: usize,
    /// Agent requests processed at once (see `edge::admit_agent`).
    pub max_agent_requests: usize,
    /// Agent requests are shed while ready requests wait longer than this (zero: never).
    pub shed_queue_delay: Duration,
    /// How long readiness fails before the member stops accepting, at shutdown.
    pub shutdown_delay: Duration,
    /// Whether `/metrics` needs an admin token.
    pub metrics_auth: bool,
    /// Connection slots of the listener (see `edge`).
    pub max_connections: usize,
    pub header_read_timeout: Duration,
    /// A request not answered by then gets 503 (see `edge::request_deadline`).
    pub request_timeout: Duration,
    pub default_token_ttl_s: u64,
    pub max_token_ttl_s: u64,
    /// How often coalesced `last_used_at` updates are written.
    pub touch_interval: Duration,
    /// Shards of the node supervision tree.
    pub node_shards: usize,
    /// Bytes of recent telemetry samples kept over all nodes.
    pub telemetry_budget_bytes: usize,
    /// How often status transitions and refused requests are written to node histories.
    pub events_interval: Duration,
    /// Free bytes kept on the data dir's filesystem (see `disk`).
    pub disk_reserve_bytes: u64,
}

/// Shared by every handler of one member.
pub struct Ctx {
    pub cfg: ServeConfig,
    pub consensus: Consensus<Replicated>,
    pub app: Arc<Replicated>,
    pub hasher: Hasher,
    pub mint: crate::secrets::CredentialMint,
    pub live: Liveness,
    /// The client for peer calls: mutual TLS with the member's certificate when TLS is on.
    pub http: reqwest::Client,
    /// The cluster CA as PEM, and `sha256:<hex>` of its DER (None with --insecure-http).
    pub ca: Option<(String, String)>,
    /// Signs this member's peer calls (the unreplayable peer header).
    pub signer: modelforge_raft::peer_auth::PeerSigner,
    /// Checks the peer header of calls to this member.
    pub peer_auth: peer_auth::Verifier,
    /// "" for a cluster formed from scratch; `restored-...` for one formed from a backup.
    pub cluster_id: String,
    /// Placements are chosen and proposed one at a time, so that racing requests see each
    /// other's GPUs taken instead of all choosing the same free one.
    pub placement: tokio::sync::Mutex<()>,
    /// Verified-cache entries not yet shared with the other members.
    pub to_share: std::sync::Mutex<Vec<(String, [u8; 32])>>,
    pub checks: SecretChecks,
    /// Budgets of failed secret checks per client address (see `budget`).
    pub budgets: budget::Budgets,
    /// Slots of agent requests being processed (`edge::admit_agent`).
    pub agent_slots: Arc<tokio::sync::Semaphore>,
    /// The `Retry-After` of a shed agent request, growing while shedding goes on.
    pub shed_backoff: edge::ShedBackoff,
    /// How long ready requests wait for the runtime (agent requests are shed beyond a target).
    pub queue_delay: Arc<edge::QueueDelay>,
    /// What this member counts for `GET /metrics`.
    pub metrics: observe::Metrics,
    /// The member's stop switch (readiness fails once it is draining).
    pub stopping: Shutdown,
    /// Nodes with a scheduler reconcile in flight (at most one each).
    pub reconciling: std::sync::Mutex<std::collections::HashSet<modelforge_proto::ids::NodeId>>,
    /// One argon2 check at a time per credential id (see `budget::IdLocks`).
    pub id_locks: budget::IdLocks,
    /// The data dir's free space; writes are refused under the reserve.
    pub disk: crate::disk::DiskWatch,
    /// Agents' heartbeats waiting to be relayed to the leader in a batch.
    pub heartbeats: relay_batch::HeartbeatRelay,
}

/// Counters of the secret checks (node credentials and operator tokens), shown in
/// `GET /api/v1/cluster`.
#[derive(Default)]
pub struct SecretChecks {
    pub cache_hits: std::sync::atomic::AtomicU64,
    pub shared_in: std::sync::atomic::AtomicU64,
    pub refused_by_digest: std::sync::atomic::AtomicU64,
    pub refused_by_budget: std::sync::atomic::AtomicU64,
    /// Agent requests shed by admission control (`edge::admit_agent`).
    pub shed: std::sync::atomic::AtomicU64,
}

pub type Shared = Arc<Ctx>;

/// How long a write may take before its outcome is reported unknown.
const WRITE_DEADLINE: Duration = Duration::from_secs(10);
/// Writes smaller than this many credential uses are batched per coalesced write.
const TOUCH_BATCH: usize = 2000;
/// A use is written when it is this much newer than the replicated `last_used_at`.
const TOUCH_MIN_ADVANCE_MS: i64 = 30_000;

/// One switch that stops a member: the HTTP server and every background loop watch it.
/// Draining comes first: readiness fails while the member still serves (see `serve`).
#[derive(Clone, Default)]
pub struct Shutdown(
    Arc<tokio::sync::watch::Sender<bool>>,
    Arc<std::sync::atomic::AtomicBool>,
);

impl Shutdown {
    pub fn new() -> Self {
        Self::default()
    }

    /// Fail readiness from now on; the member serves on until [`Shutdown::trigger`].
    pub fn drain(&self) {
        self.1.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Is the member shutting down (draining or stopped)?
    pub fn draining(&self) -> bool {
        self.1.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Stop the member (idempotent).
    pub fn trigger(&self) {
        self.drain();
        self.0.send_replace(true);
    }

    /// Resolves once [`Shutdown::trigger`] was called.
    pub async fn triggered(&self) {
        let mut rx = self.0.subscribe();
        let _ = rx.wait_for(|stop| *stop).await;
    }
}

/// How a member stopped, for whoever waits on [`serve_on`].
#[derive(Debug, PartialEq)]
pub struct Stopped {
    /// Background loops that were running, every one of which has ended.
    pub background_tasks: usize,
}

/// Run one member on `cfg.listen` until `shutdown` resolves.
pub async fn serve(
    cfg: ServeConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(cfg.listen).await?;
    let stop = Shutdown::new();
    let switch = stop.clone();
    let delay = cfg.shutdown_delay;
    tokio::spawn(async move {
        shutdown.await;
        // Readiness fails first, so that load balancers stop sending before accepting stops.
        switch.drain();
        let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
        tracing::info!(
            delay_ms = delay.as_millis() as u64,
            "shutting down: readiness fails now"
        );
        tokio::time::sleep(delay).await;
        switch.trigger();
    });
    serve_on(listener, cfg, stop).await.map(|_| ())
}

/// Run one member on `listener` until `stop` is triggered; returns once the HTTP server,
/// every background loop, the supervision tree and consensus have stopped.
/// The names a member's certificate covers: the advertised host, the listen address (unless it
/// is a wildcard), `127.0.0.1` and `localhost`.
fn tls_names(cfg: &ServeConfig) -> Vec<String> {
    let mut names = vec![];
    let host = cfg
        .advertise
        .split_once("://")
        .map_or(cfg.advertise.as_str(), |(_, rest)| rest);
    let host = host.split('/').next().unwrap_or(host);
    let host = match host.rsplit_once(':') {
        Some((h, port)) if port.chars().all(|c| c.is_ascii_digit()) => h,
        _ => host,
    };
    names.push(
        host.trim_start_matches('[')
            .trim_end_matches(']')
            .to_string(),
    );
    if !cfg.listen.ip().is_unspecified() {
        names.push(cfg.listen.ip().to_string());
    }
    // Reached on the member's own machine too (health checks, a port forward, the CLI there).
    names.push("127.0.0.1".to_string());
    names.push("localhost".to_string());
    names.retain(|n| !n.is_empty());
    let mut seen = std::collections::BTreeSet::new();
    names.retain(|n| seen.insert(n.clone()));
    names
}

pub async fn serve_on(
    listener: tokio::net::TcpListener,
    cfg: ServeConfig,
    stop: Shutdown,
) -> anyhow::Result<Stopped> {
    std::fs::create_dir_all(&cfg.data_dir)?;
    // A restored member starts from the backup's state (see backup.rs); others from empty.
    let (base, cluster_id) = crate::backup::load_base(&cfg.data_dir)?;
    if !cluster_id.is_empty() {
        tracing::info!(cluster = %cluster_id, nodes = base.nodes.len(), "member of a restored cluster");
    }
    let app = Arc::new(Replicated::with_base(base));
    app.attach_journal(crate::journal::Journal::open(&cfg.data_dir, &cluster_id)?);
    if std::env::var_os(crate::state::TEST_RETENTION_ENV).is_some() {
        tracing::warn!(
            window_ms = crate::state::retention_windows().0,
            "{} is set: retention is shortened for a test; never in production",
            crate::state::TEST_RETENTION_ENV
        );
    }
    app.attach_archive(Arc::new(crate::archive::Archive::open(&cfg.data_dir)?));
    let peer_key = secrets::peer_token(cfg.cluster_secret.expose_secret(), &cluster_id);
    let signer = modelforge_raft::peer_auth::PeerSigner::new(peer_key.as_bytes(), cfg.node_id);
    let tls = crate::tls::prepare(&cfg.tls, &cfg.data_dir, cfg.node_id, &tls_names(&cfg))?;
    if tls.is_none() {
        tracing::warn!(
            "--insecure-http: serving plain HTTP; tokens and credentials cross the network in clear (tests and local experiments only)"
        );
    }
    // One client for every peer call (Raft RPCs, relayed writes, read indexes, the cache
    // share): it trusts only the cluster CA and presents this member's certificate.
    crate::tls::install_provider();
    let mut http = reqwest::Client::builder()
        .no_proxy()
        .connect_timeout(Duration::from_millis(500))
        // Below the peers' header-read timeout, which closes idle connections at 30 s.
        .pool_idle_timeout(Duration::from_secs(20))
        .tcp_nodelay(true);
    // The member's certificate lives in one store, read by every new handshake in both
    // directions, so that a reload (SIGHUP, a changed file) needs no restart.
    let store = tls.as_ref().map(crate::tls::CertStore::new).transpose()?;
    if let Some(store) = &store {
        http = http.tls_backend_preconfigured(crate::tls::member_client_config(store)?);
    }
    let http = http.build()?;
    let consensus = Consensus::start(
        cfg.node_id,
        &cfg.data_dir.join("raft"),
        app.clone(),
        PeerNetwork::new(signer.clone(), cfg.peer_routes.clone(), http.clone()),
        &cfg.tuning,
    )
    .await
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let hasher = Hasher::new(&cfg.hash_params, cfg.hash_workers, secrets::MAX_WAITING)?;
    tracing::info!(
        node_id = cfg.node_id,
        listen = %cfg.listen,
        advertise = %cfg.advertise,
        argon2_hash_ms = hasher.time_one_hash().as_secs_f64() * 1000.0,
        "member started"
    );
    let mint = crate::secrets::CredentialMint::new(cfg.credential_pool);
    let sup = crate::supervisor::Supervision::start_with(
        app.clone(),
        cfg.node_shards,
        cfg.telemetry_budget_bytes,
        now_ms(),
    )
    .await?;
    let max_agent_requests = cfg.max_agent_requests.max(1);
    // A quarter of --stale-after: a shed agent waits at most twice that (with its jitter)
    // plus one interval, so shedding alone never makes a node stale.
    let shed_backoff =
        edge::ShedBackoff::new((cfg.thresholds.stale_after_ms / 4_000).max(1) as u64);
    let queue_delay = Arc::new(edge::QueueDelay::new(cfg.shed_queue_delay));
    let disk = crate::disk::DiskWatch::new(&cfg.data_dir, cfg.disk_reserve_bytes, now_ms());
    let ctx = Arc::new(Ctx {
        cfg,
        consensus: consensus.clone(),
        app,
        mint,
        hasher,
        live: Liveness::new(sup),
        http,
        ca: tls.as_ref().map(|m| (m.ca_pem.clone(), m.ca_cert_hash())),
        signer,
        peer_auth: peer_auth::Verifier::new(peer_key.as_bytes()),
        cluster_id,
        placement: Default::default(),
        to_share: Default::default(),
        checks: Default::default(),
        budgets: Default::default(),
        agent_slots: Arc::new(tokio::sync::Semaphore::new(max_agent_requests)),
        shed_backoff,
        queue_delay,
        metrics: Default::default(),
        stopping: stop.clone(),
        reconciling: Default::default(),
        id_locks: Default::default(),
        disk,
        heartbeats: Default::default(),
    });
    // Every background loop runs until the switch, in one set, so that shutdown is observable:
    // `serve_on` returns only once each of them has ended.
    let mut tasks = tokio::task::JoinSet::new();
    let mut until_stopped =
        |task: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>| {
            let stop = stop.clone();
            tasks.spawn(async move {
                tokio::select! {
                    _ = stop.triggered() => {}
                    _ = task => {}
                }
            });
        };
    until_stopped(Box::pin(bootstrap(ctx.clone())));
    until_stopped(Box::pin(watch_leadership(ctx.clone())));
    until_stopped(Box::pin(write_coalesced_uses(ctx.clone())));
    until_stopped(Box::pin(record_node_events(ctx.clone())));
    until_stopped(Box::pin(share_verified(ctx.clone())));
    until_stopped(Box::pin(share_observed(ctx.clone())));
    until_stopped(Box::pin(peer::fill_audit_archive(ctx.clone())));
    until_stopped(Box::pin(tasks::watch_disk(ctx.clone())));
    for _ in 0..ctx.hasher.workers() {
        until_stopped(Box::pin(mint_ahead(ctx.clone())));
    }
    until_stopped(Box::pin(ctx.queue_delay.clone().probe()));
    until_stopped(Box::pin(observe::notify_ready(ctx.clone())));
    until_stopped(Box::pin(watch::publish_changes(ctx.clone())));
    until_stopped(Box::pin(relay_batch::run(ctx.clone())));
    if let Some(store) = &store {
        let reloader = crate::tls::Reloader::new(
            store.clone(),
            &ctx.cfg.tls,
            &ctx.cfg.data_dir,
            ctx.cfg.node_id,
            &tls_names(&ctx.cfg),
        );
        until_stopped(Box::pin(reloader.run()));
    }
    // A leader that is stopped hands leadership to a caught-up voter while its connections
    // drain, so the others need no election timeout to go on (a rolling restart).
    let hand_over = {
        let (ctx, stop) = (ctx.clone(), stop.clone());
        tokio::spawn(async move {
            stop.triggered().await;
            tasks::hand_over_leadership(&ctx).await;
        })
    };
    let app_router = router(ctx.clone());
    let slots = edge::Slots::new(ctx.cfg.max_connections);
    let header_read_timeout = ctx.cfg.header_read_timeout;
    match &store {
        Some(store) => {
            let config = crate::tls::server_config_for(store)?;
            let listener = crate::tls::TlsListener::with_slots(listener, config, slots);
            edge::serve(listener, app_router, stop.clone(), header_read_timeout).await;
        }
        None => {
            let listener = edge::PlainListener::new(listener, slots);
            edge::serve(listener, app_router, stop.clone(), header_read_timeout).await;
        }
    }
    // However the server ended, everything else stops with it.
    stop.trigger();
    tracing::info!("stopping");
    let _ = hand_over.await;
    let background_tasks = tasks.len();
    while tasks.join_next().await.is_some() {}
    ctx.live.sup.stop();
    consensus.shutdown().await;
    tracing::info!(background_tasks, "stopped");
    Ok(Stopped { background_tasks })
}
