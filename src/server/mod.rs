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
mod extract;
mod forward;
mod scheduler;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::extract::Path;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::response::Response;
use axum::routing::get;
use axum::routing::post;
use modelforge_proto::now_ms;
use modelforge_raft::Consensus;
use modelforge_raft::PeerNetwork;
use modelforge_raft::RaftTuning;
use modelforge_raft::WriteError;
use modelforge_raft::codec;
use modelforge_raft::network::PEER_HEADER;
use serde_json::json;

use crate::app::Replicated;
use crate::error::ApiError;
use crate::liveness::Liveness;
use crate::liveness::StatusThresholds;
use crate::secrets;
use crate::secrets::HashParams;
use crate::secrets::Hasher;
use crate::state::Command;
use crate::state::Envelope;
use crate::state::Outcome;
use modelforge_proto::api::ErrorCode;

/// Everything `serve` needs, validated once by the CLI.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    pub node_id: u64,
    pub listen: SocketAddr,
    pub advertise: String,
    pub data_dir: PathBuf,
    /// The full initial membership, this member included: id -> URL.
    pub peers: BTreeMap<u64, String>,
    /// `--peer-route`: how this member reaches a peer when not by its advertised URL.
    pub peer_routes: BTreeMap<u64, String>,
    pub admin_token: String,
    pub cluster_secret: String,
    pub hash_params: HashParams,
    pub hash_workers: usize,
    pub credential_pool: usize,
    /// Offer a recovered node (re-enrolled, or restored) to the scheduler only after a
    /// passing capability smoke.
    pub require_smoke: bool,
    pub tuning: RaftTuning,
    pub thresholds: StatusThresholds,
    pub max_body_bytes: usize,
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
}

/// Shared by every handler of one member.
pub struct Ctx {
    pub cfg: ServeConfig,
    pub consensus: Consensus<Replicated>,
    pub app: Arc<Replicated>,
    pub hasher: Hasher,
    pub mint: crate::secrets::CredentialMint,
    pub live: Liveness,
    pub http: reqwest::Client,
    pub peer_token: String,
    /// "" for a cluster formed from scratch; `restored-...` for one formed from a backup.
    pub cluster_id: String,
    /// Placements are chosen and proposed one at a time, so that racing requests see each
    /// other's GPUs taken instead of all choosing the same free one.
    pub placement: tokio::sync::Mutex<()>,
    /// Verified-cache entries not yet shared with the other members.
    pub to_share: std::sync::Mutex<Vec<(String, [u8; 32])>>,
    pub checks: SecretChecks,
}

/// Counters of the credential check, shown in `GET /api/v1/cluster`.
#[derive(Default)]
pub struct SecretChecks {
    pub cache_hits: std::sync::atomic::AtomicU64,
    pub shared_in: std::sync::atomic::AtomicU64,
}

pub type Shared = Arc<Ctx>;

/// How long a write may take before its outcome is reported unknown.
const WRITE_DEADLINE: Duration = Duration::from_secs(10);
/// Writes smaller than this many credential uses are batched per coalesced write.
const TOUCH_BATCH: usize = 2000;
/// A use is written when it is this much newer than the replicated `last_used_at`.
const TOUCH_MIN_ADVANCE_MS: i64 = 30_000;

/// Run one member until `shutdown` resolves.
pub async fn serve(
    cfg: ServeConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(&cfg.data_dir)?;
    // A restored member starts from the backup's state (see backup.rs); others from empty.
    let (base, cluster_id) = crate::backup::load_base(&cfg.data_dir)?;
    if !cluster_id.is_empty() {
        tracing::info!(cluster = %cluster_id, nodes = base.nodes.len(), "member of a restored cluster");
    }
    let app = Arc::new(Replicated::with_base(base));
    app.attach_journal(crate::journal::Journal::open(&cfg.data_dir, &cluster_id)?);
    let peer_token = secrets::peer_token(&cfg.cluster_secret, &cluster_id);
    let consensus = Consensus::start(
        cfg.node_id,
        &cfg.data_dir.join("raft"),
        app.clone(),
        PeerNetwork::new(peer_token.clone(), cfg.peer_routes.clone()),
        &cfg.tuning,
    )
    .await
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let listener = tokio::net::TcpListener::bind(cfg.listen).await?;
    let hasher = Hasher::new(&cfg.hash_params, cfg.hash_workers, secrets::MAX_WAITING)?;
    tracing::info!(
        node_id = cfg.node_id,
        listen = %cfg.listen,
        advertise = %cfg.advertise,
        argon2_hash_ms = hasher.time_one_hash().as_secs_f64() * 1000.0,
        "member started"
    );
    let http = reqwest::Client::builder()
        .no_proxy()
        .connect_timeout(Duration::from_millis(500))
        .tcp_nodelay(true)
        .build()?;
    let mint = crate::secrets::CredentialMint::new(cfg.credential_pool);
    let sup = crate::supervisor::Supervision::start_with(
        app.clone(),
        cfg.node_shards,
        cfg.telemetry_budget_bytes,
        now_ms(),
    )
    .await?;
    let ctx = Arc::new(Ctx {
        cfg,
        consensus: consensus.clone(),
        app,
        mint,
        hasher,
        live: Liveness::new(sup),
        http,
        peer_token,
        cluster_id,
        placement: Default::default(),
        to_share: Default::default(),
        checks: Default::default(),
    });
    tokio::spawn(bootstrap(ctx.clone()));
    tokio::spawn(watch_leadership(ctx.clone()));
    tokio::spawn(write_coalesced_uses(ctx.clone()));
    tokio::spawn(record_node_events(ctx.clone()));
    tokio::spawn(share_verified(ctx.clone()));
    for _ in 0..ctx.hasher.workers() {
        tokio::spawn(mint_ahead(ctx.clone()));
    }
    tokio::spawn(return_freed_memory());
    axum::serve(listener, router(ctx.clone()).into_make_service())
        .with_graceful_shutdown(shutdown)
        .await?;
    tracing::info!("stopping");
    consensus.shutdown().await;
    Ok(())
}

/// The whole route table of a member.
pub fn router(ctx: Shared) -> Router {
    let leader_routes = Router::new()
        .route("/api/v1/agent/enroll", post(agent::enroll))
        .route(
            "/api/v1/agent/nodes/{node_id}/heartbeat",
            post(agent::heartbeat),
        )
        .route(
            "/api/v1/agent/nodes/{node_id}/inventory",
            axum::routing::put(agent::inventory),
        )
        .route(
            "/api/v1/admin/node-enrollments",
            post(admin::create_enrollment).get(admin::list_enrollments),
        )
        .route(
            "/api/v1/admin/node-enrollments/{enrollment_id}",
            axum::routing::delete(admin::cancel_enrollment),
        )
        .route("/api/v1/admin/hardware/nodes", get(admin::list_nodes))
        .route(
            "/api/v1/admin/hardware/nodes/{node_id}",
            get(admin::show_node),
        )
        .route(
            "/api/v1/admin/hardware/nodes/{node_id}/credentials",
            get(admin::list_credentials),
        )
        .route(
            "/api/v1/admin/hardware/nodes/{node_id}/telemetry",
            get(admin::telemetry),
        )
        .route(
            "/api/v1/admin/hardware/nodes/{node_id}/credential",
            axum::routing::delete(admin::revoke_credential),
        )
        .route(
            "/api/v1/admin/hardware/nodes/{node_id}/decommission/preview",
            post(admin::decommission_preview),
        )
        .route(
            "/api/v1/admin/hardware/nodes/{node_id}/decommission/execute",
            post(admin::decommission_execute),
        )
        .route("/api/v1/admin/audit", get(admin::audit))
        .route("/api/v1/allocations", post(scheduler::allocate))
        .route(
            "/api/v1/allocations/{allocation_id}",
            axum::routing::delete(scheduler::release),
        )
        .route("/api/v1/admin/scheduler", get(scheduler::view))
        .route(
            "/api/v1/admin/hardware/nodes/{node_id}/smoke",
            post(scheduler::start_smoke),
        )
        .route(
            "/api/v1/admin/hardware/nodes/{node_id}/smoke/{smoke_id}",
            get(scheduler::show_smoke),
        )
        .route(
            "/api/v1/agent/nodes/{node_id}/smoke/{smoke_id}",
            post(agent::smoke_report),
        )
        .layer(axum::middleware::from_fn_with_state(
            ctx.clone(),
            forward::leader_gate,
        ))
        .layer(DefaultBodyLimit::max(ctx.cfg.max_body_bytes));
    let peer_routes = Router::new()
        .route("/internal/v1/raft/{kind}", post(peer_rpc))
        .route("/internal/v1/propose", post(peer_propose))
        .route("/internal/v1/status", get(peer_status))
        .route("/internal/v1/read-index", get(peer_read_index))
        .route("/internal/v1/verified", post(peer_verified))
        .layer(DefaultBodyLimit::max(1 << 30));
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/api/v1/cluster", get(cluster))
        .route("/api/v1/cluster/state-digest", get(admin::state_digest))
        .route("/api/v1/admin/backup", get(backup::backup))
        .merge(leader_routes)
        .merge(peer_routes)
        .fallback(|| async { ApiError::new(ErrorCode::NotFound, "no such endpoint") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                ErrorCode::MethodNotAllowed,
                "this endpoint does not take that method",
            )
        })
        .with_state(ctx)
}

async fn healthz() -> Response {
    axum::Json(json!({"status": "ok"})).into_response()
}

async fn readyz(State(ctx): State<Shared>) -> Response {
    let s = ctx.consensus.status();
    let ready = s.leader_id.is_some() && s.applied_index >= s.commit_index;
    let body = json!({"ready": ready, "leader_id": s.leader_id, "commit_index": s.commit_index, "applied_index": s.applied_index});
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, axum::Json(body)).into_response()
}

async fn cluster(State(ctx): State<Shared>, headers: HeaderMap) -> Result<Response, ApiError> {
    extract::require_admin(&ctx, &headers)?;
    let s = ctx.consensus.status();
    Ok(axum::Json(json!({
        "id": s.id,
        "leader_id": s.leader_id,
        "leader_url": s.leader_url,
        "term": s.term,
        "state": s.state,
        "commit_index": s.commit_index,
        "applied_index": s.applied_index,
        "last_log_index": s.last_log_index,
        "snapshot_index": s.snapshot_index,
        "members": s.members,
        "cluster_id": ctx.cluster_id,
        "secret_checks": {
            "argon2_verifies": ctx.hasher.verify_count(),
            "cache_hits": ctx.checks.cache_hits.load(std::sync::atomic::Ordering::Relaxed),
            "cache_entries": ctx.app.verified_entries(),
            "entries_learned_from_leader": ctx.checks.shared_in.load(std::sync::atomic::Ordering::Relaxed),
        },
        "credential_pool": {
            "ready": ctx.mint.ready(),
            "minted_ahead": ctx.mint.counts().0,
            "minted_inline": ctx.mint.counts().1,
        },
    }))
    .into_response())
}

fn require_peer(ctx: &Ctx, headers: &HeaderMap) -> Result<(), ApiError> {
    let given = headers
        .get(PEER_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if given.is_empty() || !secrets::same_secret(given, &ctx.peer_token) {
        return Err(ApiError::new(
            ErrorCode::PeerUnauthenticated,
            "peer endpoints need the cluster secret",
        ));
    }
    Ok(())
}

async fn peer_rpc(
    State(ctx): State<Shared>,
    Path(kind): Path<String>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    require_peer(&ctx, &headers)?;
    match ctx.consensus.handle_peer_rpc(&kind, &body).await {
        Ok(bytes) => Ok(([("content-type", "application/octet-stream")], bytes).into_response()),
        Err(modelforge_raft::network::PeerRpcError::Unknown(_)) => {
            Err(ApiError::new(ErrorCode::NotFound, "no such peer rpc"))
        }
        Err(modelforge_raft::network::PeerRpcError::BadBody(e)) => {
            Err(ApiError::new(ErrorCode::BadPeerBody, e.to_string()))
        }
        Err(e) => Err(ApiError::new(ErrorCode::RaftUnavailable, e.to_string())),
    }
}

async fn peer_status(State(ctx): State<Shared>, headers: HeaderMap) -> Result<Response, ApiError> {
    require_peer(&ctx, &headers)?;
    let initialized = ctx.consensus.is_initialized().await;
    Ok(axum::Json(json!({"initialized": initialized, "id": ctx.cfg.node_id})).into_response())
}

/// The leader's read index for a follower: confirmed with a quorum, then the index the
/// follower must have applied before its local read is linearizable.
async fn peer_read_index(
    State(ctx): State<Shared>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    require_peer(&ctx, &headers)?;
    ctx.consensus
        .read_index()
        .await
        .map_err(|e| ApiError::new(ErrorCode::NotLeader, e.to_string()))?;
    let applied = ctx.consensus.status().applied_index;
    Ok(axum::Json(json!({"index": applied})).into_response())
}

/// A member whose write found another leader hands the encoded envelope over here.
async fn peer_propose(
    State(ctx): State<Shared>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    require_peer(&ctx, &headers)?;
    let mut env: Envelope =
        codec::decode(&body).map_err(|e| ApiError::new(ErrorCode::BadPeerBody, e.to_string()))?;
    // Re-stamped by the member that will propose it: expiry is decided by leader time.
    env.now_ms = env.now_ms.max(now_ms());
    let bytes = codec::encode(&env).map_err(|e| ApiError::internal(e.to_string()))?;
    match ctx.consensus.write(bytes).await {
        Ok(answer) => Ok(([("content-type", "application/octet-stream")], answer).into_response()),
        Err(WriteError::NotLeader { .. }) => Err(ApiError::new(
            ErrorCode::NotLeader,
            "this member is not the leader",
        )),
        Err(WriteError::OutcomeUnknown(m)) => Err(ApiError::outcome_unknown(m)),
        Err(WriteError::Fatal(m)) => Err(ApiError::new(ErrorCode::RaftUnavailable, m)),
    }
}

/// Entries of the leader's verified cache, learned by a follower so that it does not need 10,000
/// argon2 verifies when it becomes leader after a failover.
async fn peer_verified(
    State(ctx): State<Shared>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    require_peer(&ctx, &headers)?;
    let entries: Vec<(String, [u8; 32])> =
        codec::decode(&body).map_err(|e| ApiError::new(ErrorCode::BadPeerBody, e.to_string()))?;
    let n = ctx.app.learn_verified(entries);
    ctx.checks
        .shared_in
        .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
    Ok(axum::Json(json!({"learned": n})).into_response())
}

/// Share newly verified cache entries with the other members, best effort, batched.
///
/// What travels is (credential id, SHA-256 of the credential), between authenticated members,
/// into memory only: never the plaintext, never the Raft log or a snapshot. SHA-256 of a
/// 256-bit random secret cannot be inverted any more than its argon2 hash can; the cache never
/// decides alone (revocation and ownership are read from the state), and every member's apply
/// clears a revoked credential's entry.
async fn share_verified(ctx: Shared) {
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let batch = std::mem::take(&mut *ctx.to_share.lock().unwrap_or_else(|p| p.into_inner()));
        if batch.is_empty() || !ctx.consensus.is_leader() {
            continue;
        }
        let Ok(body) = codec::encode(&batch) else {
            continue;
        };
        for m in ctx.consensus.status().members {
            if m.id == ctx.cfg.node_id {
                continue;
            }
            let url = format!(
                "{}/internal/v1/verified",
                ctx.peer_url(m.id, &m.url).trim_end_matches('/')
            );
            let req = ctx
                .http
                .post(url)
                .header(PEER_HEADER, &ctx.peer_token)
                .timeout(Duration::from_secs(2))
                .body(body.clone());
            if let Err(e) = req.send().await {
                tracing::debug!(peer = m.id, error = %e.without_url(), "sharing verified credentials failed");
            }
        }
    }
}

impl Ctx {
    /// Queue a freshly verified credential digest for sharing with the other members.
    pub fn note_verified(&self, credential_id: &str, digest: [u8; 32]) {
        let mut q = self.to_share.lock().unwrap_or_else(|p| p.into_inner());
        if q.len() < 100_000 {
            q.push((credential_id.to_string(), digest));
        }
    }

    /// Replicate `command` and return its answer. Retries the same envelope (same request id,
    /// so it applies at most once) across leader changes until [`WRITE_DEADLINE`].
    pub async fn propose(
        &self,
        actor: &str,
        request_id: String,
        command: Command,
    ) -> Result<Outcome, ApiError> {
        let env = Envelope {
            request_id,
            now_ms: now_ms(),
            actor: actor.to_string(),
            command,
        };
        let bytes = codec::encode(&env).map_err(|e| ApiError::internal(e.to_string()))?;
        let deadline = tokio::time::Instant::now() + WRITE_DEADLINE;
        let mut last_unknown = String::from("no answer before the deadline");
        loop {
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Err(ApiError::outcome_unknown(format!(
                    "the write may or may not have applied ({last_unknown}); retry with the same Idempotency-Key"
                )));
            }
            let attempt =
                tokio::time::timeout(deadline - now, self.consensus.write(bytes.clone())).await;
            let answer = match attempt {
                Err(_) => continue,
                Ok(Ok(answer)) => answer,
                Ok(Err(WriteError::NotLeader {
                    leader: Some((id, url)),
                })) if id != self.cfg.node_id => {
                    match self.propose_via(&self.peer_url(id, &url), &bytes).await {
                        Ok(answer) => answer,
                        Err(e) => {
                            last_unknown = e;
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            continue;
                        }
                    }
                }
                Ok(Err(WriteError::NotLeader { .. })) => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
                Ok(Err(WriteError::OutcomeUnknown(m))) => {
                    last_unknown = m;
                    continue;
                }
                Ok(Err(WriteError::Fatal(m))) => {
                    return Err(ApiError::new(ErrorCode::RaftUnavailable, m));
                }
            };
            return Replicated::decode_result(&answer).map_err(ApiError::from);
        }
    }

    async fn propose_via(&self, leader_url: &str, envelope: &[u8]) -> Result<Vec<u8>, String> {
        let resp = self
            .http
            .post(format!(
                "{}/internal/v1/propose",
                leader_url.trim_end_matches('/')
            ))
            .header(PEER_HEADER, &self.peer_token)
            .timeout(WRITE_DEADLINE)
            .body(envelope.to_vec())
            .send()
            .await
            .map_err(|e| format!("forwarding the write to the leader failed: {e}"))?;
        let status = resp.status();
        let body = resp.bytes().await.map_err(|e| e.to_string())?;
        if !status.is_success() {
            return Err(format!("leader answered {status}"));
        }
        Ok(body.to_vec())
    }

    /// The URL this member uses to reach member `id` (a `--peer-route` override, else `advertised`).
    pub fn peer_url(&self, id: u64, advertised: &str) -> String {
        self.cfg
            .peer_routes
            .get(&id)
            .cloned()
            .unwrap_or_else(|| advertised.to_string())
    }

    /// Confirm leadership by lease before a read of the local state.
    /// Make a local read linearizable on any member: on the leader a read index with a quorum;
    /// on a follower the leader's read index, then wait until this member has applied it.
    pub async fn read_anywhere(&self) -> Result<(), ApiError> {
        if self.consensus.is_leader() {
            return self.consensus.read_index().await.map_err(|e| {
                ApiError::new(ErrorCode::NotLeader, format!("read index failed: {e}"))
            });
        }
        let Some((id, url)) = self.consensus.leader() else {
            return Err(ApiError::new(ErrorCode::NoLeader, "no leader is known"));
        };
        let url = self.peer_url(id, &url);
        let v: serde_json::Value = self
            .http
            .get(format!(
                "{}/internal/v1/read-index",
                url.trim_end_matches('/')
            ))
            .header(PEER_HEADER, &self.peer_token)
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .map_err(|e| {
                ApiError::new(
                    ErrorCode::NoLeader,
                    format!("leader unreachable: {}", e.without_url()),
                )
            })?
            .json()
            .await
            .map_err(|_| {
                ApiError::new(
                    ErrorCode::NoLeader,
                    "the leader did not answer the read index",
                )
            })?;
        let index = v["index"].as_u64().ok_or_else(|| {
            ApiError::new(ErrorCode::NoLeader, "the leader refused the read index")
        })?;
        if self
            .consensus
            .wait_for(Duration::from_secs(10), |s| s.applied_index >= index)
            .await
        {
            Ok(())
        } else {
            Err(ApiError::new(
                ErrorCode::NotCaughtUp,
                "this member has not caught up with the leader",
            ))
        }
    }

    pub async fn linearize(&self) -> Result<(), ApiError> {
        self.consensus.lease_read().await.map_err(|e| {
            ApiError::new(
                ErrorCode::NotLeader,
                format!("this member cannot serve a consistent read now: {e}"),
            )
        })?;
        // A new term's view is rebuilt before anything is judged from it.
        self.live.on_leader(self.consensus.current_term(), now_ms());
        Ok(())
    }
}

/// Form the cluster on first start: unless a peer already belongs to one, initialise with the
/// full `--peer` list (identical on every member, which openraft allows on several members).
async fn bootstrap(ctx: Shared) {
    if ctx.consensus.is_initialized().await {
        return;
    }
    for (id, url) in &ctx.cfg.peers {
        if *id == ctx.cfg.node_id {
            continue;
        }
        let url = ctx.peer_url(*id, url);
        let resp = ctx
            .http
            .get(format!("{}/internal/v1/status", url.trim_end_matches('/')))
            .header(PEER_HEADER, &ctx.peer_token)
            .timeout(Duration::from_secs(1))
            .send()
            .await;
        if let Ok(resp) = resp
            && let Ok(v) = resp.json::<serde_json::Value>().await
            && v.get("initialized").and_then(|b| b.as_bool()) == Some(true)
        {
            tracing::info!(
                peer = id,
                "a peer already belongs to a cluster: waiting to be replicated to"
            );
            return;
        }
    }
    match ctx.consensus.initialize(&ctx.cfg.peers).await {
        Ok(()) => {
            tracing::info!(members = ?ctx.cfg.peers.keys().collect::<Vec<_>>(), "cluster initialised")
        }
        Err(e) => tracing::warn!(error = %e, "cluster initialisation failed"),
    }
}

/// Track when this member became leader (the grace window of node status starts there).
async fn watch_leadership(ctx: Shared) {
    loop {
        if ctx.consensus.is_leader() {
            let term = ctx.consensus.current_term();
            if ctx.live.on_leader(term, now_ms()) {
                tracing::info!(
                    term,
                    "became leader: node view rebuilt, grace window started"
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Hand memory freed by transient work back to the OS. Building or installing a snapshot
/// encodes the whole state (hundreds of MiB at 100,000 nodes) and glibc keeps the freed pages
/// in its arenas, so without this a member's RSS stays at its snapshot peak (measured by
/// `modelforge-bench`: 1.3 GiB instead of the ~0.9 GiB the state needs at 100,000 nodes).
async fn return_freed_memory() {
    loop {
        tokio::time::sleep(Duration::from_secs(10)).await;
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        let _ = tokio::task::spawn_blocking(|| {
            // SAFETY: malloc_trim only releases free memory at the top of glibc's heaps and
            // in free chunks; it takes the allocator's own locks and is safe to call anytime.
            unsafe { libc::malloc_trim(0) }
        })
        .await;
    }
}

/// Fill the leader's pool of credentials minted ahead (see [`crate::secrets::CredentialMint`]).
async fn mint_ahead(ctx: Shared) {
    loop {
        let minted = if ctx.consensus.is_leader() {
            ctx.mint.refill_one(&ctx.hasher).await
        } else {
            None
        };
        match minted {
            Some(took) => {
                let rest = ctx.mint.rest_after(took, now_ms());
                if !rest.is_zero() {
                    tokio::time::sleep(rest).await;
                }
            }
            None => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

/// Write `last_used_at` updates coalesced: at most one write per interval, only for
/// credentials whose replicated value is older than [`TOUCH_MIN_ADVANCE_MS`].
async fn write_coalesced_uses(ctx: Shared) {
    loop {
        tokio::time::sleep(ctx.cfg.touch_interval).await;
        let uses = ctx.live.take_uses();
        if uses.is_empty() || !ctx.consensus.is_leader() {
            continue;
        }
        let due: Vec<(String, i64)> = {
            let s = ctx.app.read();
            uses.into_iter()
                .filter(|(id, at)| {
                    s.credentials.get(id).is_some_and(|c| {
                        c.revoked_at_ms.is_none()
                            && c.last_used_at_ms
                                .is_none_or(|old| at - old >= TOUCH_MIN_ADVANCE_MS)
                    })
                })
                .collect()
        };
        for chunk in due.chunks(TOUCH_BATCH) {
            let cmd = Command::TouchCredentials {
                uses: chunk.to_vec(),
            };
            if let Err(e) = ctx
                .propose("system", modelforge_proto::new_uuid(), cmd)
                .await
            {
                tracing::warn!(
                    code = e.code.as_str(),
                    "coalesced last_used_at write failed"
                );
            }
        }
    }
}

/// Write node events that only the heartbeat-processing member sees, coalesced: status
/// transitions and refused agent requests go into the nodes' histories in at most one write
/// per interval, however many requests were refused (anyone can send those).
async fn record_node_events(ctx: Shared) {
    loop {
        tokio::time::sleep(ctx.cfg.events_interval).await;
        if !ctx.consensus.is_leader() {
            continue;
        }
        let now = now_ms();
        let live = ctx.live.sup.all().await;
        let mut transitions = vec![];
        {
            let s = ctx.app.read();
            for node in s.nodes.values() {
                let Some((l, _)) = live.get(&node.node_id) else {
                    continue;
                };
                let status = admin::status_of(&ctx, &s, node, l, now);
                if status != "never_seen" && l.recorded_status != Some(status) {
                    transitions.push((node.node_id.clone(), status));
                }
            }
        }
        let refusals = ctx.live.sup.flush(transitions.clone()).await;
        let mut events: Vec<(String, String, String, u32)> = transitions
            .into_iter()
            .map(|(n, s)| (n, "status".to_string(), s.to_string(), 1))
            .collect();
        events.extend(refusals.into_iter().map(|(n, status, count)| {
            (n, "request_refused".to_string(), status.to_string(), count)
        }));
        if events.is_empty() {
            continue;
        }
        if let Err(e) = ctx
            .propose(
                "system",
                modelforge_proto::new_uuid(),
                Command::RecordEvents { events },
            )
            .await
        {
            tracing::warn!(code = e.code.as_str(), "writing node events failed");
        }
    }
}
