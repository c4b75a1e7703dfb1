//! The peer endpoints (`/internal/v1/...`), authenticated by the cluster's peer credential,
//! and the paths their clients (this crate's write path, bootstrap and cache sharing) use.

use std::time::Duration;

use axum::extract::Path;
use axum::extract::State;
use axum::response::IntoResponse;
use axum::response::Response;
use modelforge_proto::api;
use modelforge_proto::api::ErrorCode;
use modelforge_proto::now_ms;
use modelforge_raft::WriteError;
use modelforge_raft::codec;
use modelforge_raft::network::PEER_HEADER;
use modelforge_raft::peer_auth::Signed;

use super::*;
use crate::error::ApiError;
use crate::state::Envelope;

/// Raft RPCs: `{RAFT}{kind}` (the raft crate's client side uses the same prefix).
pub const RAFT: &str = modelforge_raft::network::RPC_PREFIX;
/// A follower's write handed to the leader: an encoded envelope.
pub const PROPOSE: &str = "/internal/v1/propose";
/// Whether a member belongs to a cluster yet (bootstrap asks before forming one).
pub const STATUS: &str = "/internal/v1/status";
/// The leader's read index, for a follower's linearizable read.
pub const READ_INDEX: &str = "/internal/v1/read-index";
/// Verified-credential cache entries shared by the leader.
pub const VERIFIED: &str = "/internal/v1/verified";
/// The leader's live view shared: each node's last refusal and latest telemetry sample.
pub const OBSERVED: &str = "/internal/v1/observed";
/// The most encoded bytes of node shares sent in one peer body.
const OBSERVED_CHUNK: usize = 8 << 20;

/// Archived audit events after a seq, for a member whose archive has a hole.
pub const AUDIT_ARCHIVE: &str = "/internal/v1/audit-archive";
/// The most bytes of archived events in one answer.
const ARCHIVE_PAGE: usize = 4 << 20;

/// A snapshot from the leader, streamed to disk (`peer_snapshot`), never buffered here.
pub const SNAPSHOT: &str = "/internal/v1/raft/snapshot";
/// The most any other peer body may hold (a Raft append or vote, a proposal, a batch of
/// verified-cache entries); read whole, after authentication.
const PEER_BODY_MAX: usize = 64 << 20;

/// The gate of every peer endpoint. Before the body is read: with TLS on, the connection's
/// client certificate (verified against the cluster CA) must name a member of the current
/// configuration (or of the initial `--peer` list, for bootstrap); then the signed peer header
/// must verify (MAC, window, signer = certificate, nonce unseen). Then the body is read under
/// the route's cap and must be the one the header signed. The verified [`Signed`] travels to the
/// handler as a request extension.
pub(super) async fn peer_guard(
    State(ctx): State<Shared>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    match authenticate(&ctx, req).await {
        Ok(req) => next.run(req).await,
        Err(e) => e.into_response(),
    }
}

async fn authenticate(
    ctx: &Ctx,
    req: axum::extract::Request,
) -> Result<axum::extract::Request, ApiError> {
    let signed = verify_peer(ctx, &req)?;
    if req.uri().path().starts_with(RAFT) {
        for_this_member(ctx, req.uri())?;
    }
    let (mut parts, body) = req.into_parts();
    if parts.uri.path() == SNAPSHOT {
        // Streamed by its handler, which checks the digest once the body is on disk.
        parts.extensions.insert(signed);
        return Ok(axum::extract::Request::from_parts(parts, body));
    }
    let bytes = axum::body::to_bytes(body, PEER_BODY_MAX)
        .await
        .map_err(|_| ApiError::too_large())?;
    super::peer_auth::require_body(&signed, &bytes)?;
    parts.extensions.insert(signed);
    Ok(axum::extract::Request::from_parts(
        parts,
        axum::body::Body::from(bytes),
    ))
}

/// A Raft RPC names this member as its target (`?to=<id>`, signed with the path): a process
/// reached under two member ids (one address added twice) answers for neither but its own, so
/// it can never vote twice. One without a target is refused too: members of other releases do
/// not mix (the record format changes with a release: a cluster is upgraded as a whole).
fn for_this_member(ctx: &Ctx, uri: &axum::http::Uri) -> Result<(), ApiError> {
    let key = modelforge_raft::network::TO_QUERY;
    let to = uri
        .query()
        .unwrap_or("")
        .split('&')
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='));
    let me = ctx.cfg.node_id;
    match to.map(str::parse::<u64>) {
        Some(Ok(id)) if id == me => Ok(()),
        Some(Ok(id)) => {
            tracing::warn!(
                to = id,
                "refused a Raft RPC for member {id}: this is member {me} (is one address in the configuration under two ids?)"
            );
            Err(ApiError::new(
                ErrorCode::PeerUnauthenticated,
                format!("this Raft RPC is for member {id}; this is member {me}"),
            ))
        }
        _ => Err(ApiError::new(
            ErrorCode::PeerUnauthenticated,
            format!("a Raft RPC names its target member (?{key}=<id>)"),
        )),
    }
}

/// The certificate and header checks of a peer request (its body not read yet).
pub(super) fn verify_peer(ctx: &Ctx, req: &axum::extract::Request) -> Result<Signed, ApiError> {
    let conn = req
        .extensions()
        .get::<axum::extract::ConnectInfo<crate::tls::ConnPeer>>()
        .map(|c| c.0.clone());
    let member = member_connection(ctx, conn.as_ref())?;
    ctx.peer_auth.verify(req, member, now_ms() as u64)
}

/// The member id of the connection's certificate, which must name a member (None without TLS).
fn member_connection(
    ctx: &Ctx,
    conn: Option<&crate::tls::ConnPeer>,
) -> Result<Option<u64>, ApiError> {
    if ctx.ca.is_none() {
        // --insecure-http: the cluster secret alone.
        return Ok(None);
    }
    let Some(id) = conn.and_then(|c| c.member) else {
        return Err(ApiError::new(
            ErrorCode::PeerUnauthenticated,
            "peer endpoints need a member's client certificate from the cluster CA",
        ));
    };
    if ctx.app.read().retired_members.contains(&id) {
        return Err(ApiError::new(
            ErrorCode::PeerUnauthenticated,
            format!("member {id} was removed from the cluster"),
        ));
    }
    let status = ctx.consensus.status();
    // A `--join` member not added yet knows no configuration: the cluster CA's certificate
    // and the cluster secret's MAC are what admit its future leader. Neither does a member
    // still catching up know members added after the entries it holds: a joiner replaying an
    // old configuration must accept a leader that was itself added later (the chaos suite's
    // membership nemesis caught a joiner refusing such a leader for good). So a member that
    // does not lead admits any certified member that was never removed; the leader admits
    // only members of its configuration.
    // (A joiner not added yet leads nothing, so it is covered too.)
    let not_leading = status.leader_id != Some(ctx.cfg.node_id);
    let member =
        not_leading || ctx.cfg.peers.contains_key(&id) || status.members.iter().any(|m| m.id == id);
    if !member {
        return Err(ApiError::new(
            ErrorCode::PeerUnauthenticated,
            format!("member {id} is not in the cluster's configuration"),
        ));
    }
    Ok(Some(id))
}

pub(super) async fn peer_rpc(
    State(ctx): State<Shared>,
    Path(kind): Path<String>,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    match ctx.consensus.handle_peer_rpc(&kind, &body).await {
        Ok(bytes) => Ok(([("content-type", "application/octet-stream")], bytes).into_response()),
        Err(e) => Err(rpc_error(e)),
    }
}

fn rpc_error(e: modelforge_raft::network::PeerRpcError) -> ApiError {
    use modelforge_raft::network::PeerRpcError as E;
    match e {
        E::Unknown(_) => ApiError::new(ErrorCode::NotFound, "no such peer rpc"),
        E::BadBody(e) => ApiError::new(ErrorCode::BadPeerBody, e.to_string()),
        E::Snapshot(m) => ApiError::new(ErrorCode::BadPeerBody, m),
        E::TooLarge => ApiError::too_large(),
        e => ApiError::new(ErrorCode::RaftUnavailable, e.to_string()),
    }
}

/// A snapshot from the leader: streamed into a file in the member's dir as it arrives (at
/// most 1 GiB; memory: a chunk and a write buffer), its digest compared with the signed
/// header, then installed from disk. A body that is not the signed one is removed unread.
pub(super) async fn peer_snapshot(
    State(ctx): State<Shared>,
    axum::Extension(signed): axum::Extension<Signed>,
    body: axum::body::Body,
) -> Result<Response, ApiError> {
    let received = ctx
        .consensus
        .receive_snapshot(body.into_data_stream())
        .await
        .map_err(rpc_error)?;
    super::peer_auth::require_digest(&signed, &received.body_sha256())?;
    tracing::info!(
        bytes = received.bytes(),
        "received a snapshot from the leader"
    );
    let bytes = ctx
        .consensus
        .install_snapshot(received)
        .await
        .map_err(rpc_error)?;
    Ok(([("content-type", "application/octet-stream")], bytes).into_response())
}

pub(super) async fn peer_status(State(ctx): State<Shared>) -> Result<Response, ApiError> {
    let initialized = ctx.consensus.is_initialized().await;
    Ok(axum::Json(api::PeerStatus {
        initialized,
        id: ctx.cfg.node_id,
    })
    .into_response())
}

/// The leader's read index for a follower: confirmed with a quorum, then the index the
/// follower must have applied before its local read is linearizable.
pub(super) async fn peer_read_index(State(ctx): State<Shared>) -> Result<Response, ApiError> {
    ctx.consensus
        .read_index()
        .await
        .map_err(|e| ApiError::new(ErrorCode::NotLeader, e.to_string()))?;
    let applied = ctx.consensus.status().applied_index;
    Ok(axum::Json(api::ReadIndex { index: applied }).into_response())
}

/// A member whose write found another leader hands the encoded envelope over here.
pub(super) async fn peer_propose(
    State(ctx): State<Shared>,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let mut env: Envelope =
        codec::decode(&body).map_err(|e| ApiError::new(ErrorCode::BadPeerBody, e.to_string()))?;
    if ctx.disk.low() {
        // A definite answer, not a failed relay: nothing was proposed, and the member that
        // relayed it answers its client 503 `disk_full` instead of retrying to its deadline.
        let e = ctx.disk.refusal();
        let refused: crate::state::ApplyResult =
            Err(crate::state::Refusal::with(e.code, e.message));
        let answer = codec::encode(&refused).map_err(|e| ApiError::internal(e.to_string()))?;
        return Ok(([("content-type", "application/octet-stream")], answer).into_response());
    }
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
pub(super) async fn peer_verified(
    State(ctx): State<Shared>,
    axum::Extension(signed): axum::Extension<Signed>,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    // Only the leader verifies credentials with argon2, so only it has entries to share.
    from_leader(&ctx, &signed, "verified credentials")?;
    let entries: Vec<(String, [u8; 32])> =
        codec::decode(&body).map_err(|e| ApiError::new(ErrorCode::BadPeerBody, e.to_string()))?;
    let n = ctx.app.learn_verified(entries);
    ctx.checks
        .shared_in
        .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
    Ok(axum::Json(api::Learned { learned: n }).into_response())
}

/// What only the leader shares (it alone verifies secrets and processes heartbeats): from
/// a follower or a removed member it is refused, and nothing is learned.
fn from_leader(ctx: &Shared, signed: &Signed, what: &str) -> Result<(), ApiError> {
    if ctx.consensus.leader().map(|(id, _)| id) == Some(signed.from) {
        return Ok(());
    }
    Err(ApiError::new(
        ErrorCode::PeerUnauthenticated,
        format!(
            "member {} is not the leader; only the leader shares {what}",
            signed.from
        ),
    ))
}

/// The leader's live view of some nodes (last refusal, latest sample), kept in memory so that
/// this member's view does not start empty if it becomes leader.
pub(super) async fn peer_observed(
    State(ctx): State<Shared>,
    axum::Extension(signed): axum::Extension<Signed>,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    from_leader(&ctx, &signed, "its view of the nodes")?;
    let shared: Vec<crate::supervisor::SharedNode> =
        codec::decode(&body).map_err(|e| ApiError::new(ErrorCode::BadPeerBody, e.to_string()))?;
    let batch = shared.into_iter().map(|n| n.into_observed()).collect();
    let sup = &ctx.live.sup;
    let n = sup.observed.merge(&ctx.app.read(), batch, now_ms());
    if n > 0 {
        ctx.app.view.mark();
    }
    sup.observed
        .learned
        .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
    Ok(axum::Json(api::Learned { learned: n }).into_response())
}

/// Every second, the leader hands what changed in its view of the nodes (refusals, a sample
/// per node at most every 30 s) to every other member, best effort, in bodies of at most
/// `OBSERVED_CHUNK` bytes. It keeps no copy of its own: its shards hold the same, and should it
/// lose leadership it learns the new leader's view like any follower (a new leader shares its
/// refusals again when it rebuilds).
pub(super) async fn share_observed(ctx: Shared) {
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        if !ctx.consensus.is_leader() {
            continue;
        }
        let sup = &ctx.live.sup;
        let batch = sup.take_share(now_ms()).await;
        if batch.is_empty() {
            continue;
        }
        let mut bodies = vec![];
        let mut chunk = vec![];
        let mut bytes = 0;
        for (id, o) in &batch {
            let n = crate::supervisor::SharedNode::from_observed(id.clone(), o);
            bytes += 64 + n.telemetry.as_ref().map_or(0, |(_, t)| t.len());
            chunk.push(n);
            if bytes >= OBSERVED_CHUNK {
                bodies.extend(codec::encode(&std::mem::take(&mut chunk)).ok());
                bytes = 0;
            }
        }
        if !chunk.is_empty() {
            bodies.extend(codec::encode(&chunk).ok());
        }
        post_to_others(&ctx, OBSERVED, &bodies, Duration::from_secs(5)).await;
    }
}

/// Archived audit events after the seq the body names (a little-endian u64), as JSON lines:
/// any member that holds them answers; the asker trusts them only once they recompute to the
/// replicated head (`archive::Archive::fill`).
pub(super) async fn peer_audit_archive(
    State(ctx): State<Shared>,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let after = <[u8; 8]>::try_from(&body[..])
        .map(u64::from_le_bytes)
        .map_err(|_| ApiError::new(ErrorCode::BadPeerBody, "the body must be a seq (8 bytes)"))?;
    let Some(archive) = ctx.app.archive().cloned() else {
        return Ok(Vec::<u8>::new().into_response());
    };
    let lines = tokio::task::spawn_blocking(move || archive.lines_after(after, ARCHIVE_PAGE))
        .await
        .map_err(|_| ApiError::internal("the archive read stopped"))?
        .map_err(|e| ApiError::internal(format!("the archive is not readable: {e}")))?;
    Ok(lines.into_response())
}

/// Every 5 s: if the replicated state has archived events this member's archive does not hold
/// (it installed a snapshot, or was restored), fetch them from the other members in turn.
pub(super) async fn fill_audit_archive(ctx: Shared) {
    loop {
        tokio::time::sleep(Duration::from_secs(5)).await;
        let Some(archive) = ctx.app.archive().cloned() else {
            return;
        };
        let base = ctx.app.read().audit_base.clone();
        if archive.tip().count >= base.count {
            continue;
        }
        for m in ctx.consensus.status().members {
            if m.id == ctx.cfg.node_id {
                continue;
            }
            let url = format!(
                "{}{AUDIT_ARCHIVE}",
                ctx.peer_url(m.id, &m.url).trim_end_matches('/')
            );
            let fetch = |after: u64| {
                let body = after.to_le_bytes().to_vec();
                let req = ctx
                    .http
                    .post(&url)
                    .header(
                        PEER_HEADER,
                        ctx.signer.sign("POST", AUDIT_ARCHIVE, &body, 0),
                    )
                    .timeout(Duration::from_secs(30))
                    .body(body);
                async move {
                    let resp = req.send().await.map_err(|e| e.without_url().to_string())?;
                    if !resp.status().is_success() {
                        return Err(format!("answered {}", resp.status()));
                    }
                    let bytes = resp.bytes().await.map_err(|e| e.to_string())?;
                    if bytes.len() > 2 * ARCHIVE_PAGE {
                        return Err("answered more than a page".into());
                    }
                    Ok(bytes.to_vec())
                }
            };
            match archive.fill(&base, fetch).await {
                Ok(n) => {
                    tracing::info!(
                        from = m.id,
                        events = n,
                        upto = base.count,
                        "audit archive: hole filled"
                    );
                    break;
                }
                Err(e) => {
                    tracing::warn!(from = m.id, error = %e, "audit archive: a member could not fill the hole")
                }
            }
        }
    }
}

/// POST `bodies` in order to every other member at `path`, best effort: a member that fails
/// one is skipped for the rest of this round.
async fn post_to_others(ctx: &Shared, path: &str, bodies: &[Vec<u8>], timeout: Duration) {
    for m in ctx.consensus.status().members {
        if m.id == ctx.cfg.node_id {
            continue;
        }
        let url = format!("{}{path}", ctx.peer_url(m.id, &m.url).trim_end_matches('/'));
        for body in bodies {
            let req = ctx
                .http
                .post(&url)
                .header(PEER_HEADER, ctx.signer.sign("POST", path, body, 0))
                .timeout(timeout)
                .body(body.clone());
            if let Err(e) = req.send().await {
                tracing::debug!(peer = m.id, path, error = %e.without_url(), "sharing with a member failed");
                break;
            }
        }
    }
}

/// Share newly verified cache entries with the other members, best effort, batched.
///
/// What travels is (credential id, SHA-256 of the credential), between authenticated members,
/// into memory only: never the plaintext, never the Raft log or a snapshot. SHA-256 of a
/// 256-bit random secret cannot be inverted any more than its argon2 hash can; the cache never
/// decides alone (revocation and ownership are read from the state), and every member's apply
/// clears a revoked credential's entry.
pub(super) async fn share_verified(ctx: Shared) {
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let batch = std::mem::take(&mut *ctx.to_share.lock().unwrap_or_else(|p| p.into_inner()));
        if batch.is_empty() || !ctx.consensus.is_leader() {
            continue;
        }
        let Ok(body) = codec::encode(&batch) else {
            continue;
        };
        post_to_others(&ctx, VERIFIED, &[body], Duration::from_secs(2)).await;
    }
}
