//! The admin API: enrolment tokens, nodes, credentials, audit. Every handler first checks the
//! admin token, then linearises (reads) or proposes (writes) on the leader.

use super::extract::Path;
use axum::extract::Query;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::response::Response;
use modelforge_proto::now_ms;
use modelforge_proto::rfc3339_ms;
use modelforge_proto::secret::Secret;
use modelforge_proto::secret::SecretKind;
use serde::Deserialize;
use serde_json::Value;

use super::Shared;
use super::extract::AdminNode;
use super::extract::ClientAddr;
use super::extract::JsonBody;
use super::extract::Need;
use super::extract::authorize;
use super::extract::parse_id;
use super::extract::request_id;
use super::watch;
use crate::error::ApiError;
use crate::liveness::node_status;
use crate::state::Command;
use crate::state::Node;
use crate::state::Outcome;
use crate::state::State as Replicated;
use crate::supervisor::NodeLive;
use modelforge_proto::api;
use modelforge_proto::api::ErrorCode;
use modelforge_proto::gpu_health::Health;
use modelforge_proto::ids::CredentialId;
use modelforge_proto::ids::NodeId;
use modelforge_proto::ids::NodeStatus;
use modelforge_proto::ids::PreviewId;
use modelforge_proto::ids::TokenId;
use modelforge_proto::ids::TokenState;

const MAX_NOTE_LEN: usize = 1024;

/// `POST /api/v1/admin/node-enrollments`: the token is shown once; only its hash is kept.
#[utoipa::path(
    post,
    path = "/api/v1/admin/node-enrollments",
    tag = "enrolments",
    summary = "Create an enrolment token (shown once)",
    params(("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 200, description = "Makes a retry return the first answer instead of acting twice (1 to 200 characters)")),
    request_body = Option<modelforge_proto::api::CreateEnrollment>,
    responses((status = 201, description = "The token, shown this once", body = modelforge_proto::api::TokenIssued), super::openapi::WriteRefusals),
    security(("admin_token" = []))
)]
pub async fn create_enrollment(
    State(ctx): State<Shared>,
    client: ClientAddr,
    headers: HeaderMap,
    JsonBody(req): JsonBody<api::CreateEnrollment>,
) -> Result<Response, ApiError> {
    let op = authorize(&ctx, &headers, client, Need::Write).await?;
    let ttl = req.ttl_seconds.unwrap_or(ctx.cfg.default_token_ttl_s);
    if ttl == 0 || ttl > ctx.cfg.max_token_ttl_s {
        return Err(ApiError::new(
            ErrorCode::InvalidTtl,
            format!(
                "ttl_seconds must be between 1 and {}",
                ctx.cfg.max_token_ttl_s
            ),
        ));
    }
    if req
        .note
        .as_ref()
        .is_some_and(|n| n.len() > MAX_NOTE_LEN || n.chars().any(|c| c.is_control()))
    {
        return Err(ApiError::new(
            ErrorCode::InvalidNote,
            "note must be at most 1024 bytes of printable text",
        ));
    }
    let rid = request_id(&headers, "admin enrollment.create", &(ttl, &req.note))?;
    let token = Secret::generate(SecretKind::EnrollmentToken);
    let hash = ctx.hasher.hash(token.expose().to_string()).await?;
    let cmd = Command::CreateToken {
        token_id: TokenId::from(token.id()),
        hash,
        ttl_ms: (ttl as i64) * 1000,
        note: req.note,
    };
    match ctx.propose(&op.name, rid, cmd).await? {
        Outcome::TokenCreated {
            token_id,
            expires_at_ms,
            ..
        } if token_id == token.id() => {
            tracing::info!(enrollment_id = %token_id, "enrolment token created");
            let body = api::TokenIssued {
                enrollment_id: token_id,
                token: token.expose().to_string(),
                expires_at: rfc3339_ms(expires_at_ms),
                ca_cert_hash: ctx.ca.as_ref().map(|(_, hash)| hash.clone()),
            };
            Ok((StatusCode::CREATED, axum::Json(body)).into_response())
        }
        // A retry with the same Idempotency-Key: the token was created by the first attempt and
        // its plaintext was shown only then.
        Outcome::TokenCreated {
            token_id,
            expires_at_ms,
            ..
        } => Err(ApiError::new(
            ErrorCode::AlreadyCreated,
            format!(
                "this Idempotency-Key already created enrolment {token_id} (expires {}); its token is shown only once",
                rfc3339_ms(expires_at_ms)
            ),
        )),
        other => Err(ApiError::internal(format!("unexpected answer: {other:?}"))),
    }
}

/// `limit` and `after` of a list without filters.
#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct PageQuery {
    #[param(value_type = Option<u32>, minimum = 1, maximum = 1000)]
    /// How many at most (default 100).
    #[serde(default)]
    limit: Option<String>,
    /// The `next` of the previous page.
    #[serde(default)]
    after: Option<String>,
}

/// The query of a list, or 400 `invalid_query` naming what it takes.
fn query<T>(
    q: Result<Query<T>, axum::extract::rejection::QueryRejection>,
    known: &str,
) -> Result<T, ApiError> {
    q.map(|Query(q)| q)
        .map_err(|_| ApiError::new(ErrorCode::InvalidQuery, format!("this list takes {known}")))
}

/// `GET /api/v1/admin/node-enrollments?limit=&after=`: never the token or its hash.
#[utoipa::path(
    get,
    path = "/api/v1/admin/node-enrollments",
    tag = "enrolments",
    summary = "List enrolment tokens (never a token or its hash)",
    params(PageQuery),
    responses((status = 200, description = "A page of tokens", body = modelforge_proto::api::Enrollments), super::openapi::Refusals),
    security(("admin_token" = []))
)]
pub async fn list_enrollments(
    State(ctx): State<Shared>,
    client: ClientAddr,
    headers: HeaderMap,
    q: Result<Query<PageQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    authorize(&ctx, &headers, client, Need::Read).await?;
    let q = query(q, "limit=1..1000 and after=<next>")?;
    let limit = watch::limit(q.limit.as_deref())?;
    let after: Option<TokenId> = watch::id_cursor(q.after.as_deref())?;
    ctx.linearize().await?;
    let now = now_ms();
    let s = ctx.app.read();
    let (enrollments, next) = watch::page(
        s.tokens
            .range::<_, str>(watch::past(after.as_ref().map(|a| a.as_str())))
            .map(|(_, t)| api::Enrollment {
                enrollment_id: t.token_id.clone(),
                created_at: rfc3339_ms(t.created_at_ms),
                expires_at: rfc3339_ms(t.expires_at_ms),
                state: t.state_at(now),
                claimed_node_id: t.claim.as_ref().map(|c| c.node_id.clone()),
                claimed_at: t.claim.as_ref().map(|c| rfc3339_ms(c.claimed_at_ms)),
                cancelled_at: t.cancelled_at_ms.map(rfc3339_ms),
                note: t.note.clone(),
            }),
        limit,
        |e| e.enrollment_id.to_string(),
    );
    Ok(axum::Json(api::Enrollments { enrollments, next }).into_response())
}

/// `DELETE /api/v1/admin/node-enrollments/{enrollment_id}`: cancel an unclaimed token.
#[utoipa::path(
    delete,
    path = "/api/v1/admin/node-enrollments/{enrollment_id}",
    tag = "enrolments",
    summary = "Cancel an unclaimed enrolment token",
    params(("enrollment_id" = modelforge_proto::api::TokenId, Path, description = "The token's id"), ("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 200, description = "Makes a retry return the first answer instead of acting twice (1 to 200 characters)")),
    request_body = Option<modelforge_proto::api::ReasonRequest>,
    responses((status = 200, description = "The token, cancelled", body = modelforge_proto::api::EnrollmentCancelled), super::openapi::WriteRefusals),
    security(("admin_token" = []))
)]
pub async fn cancel_enrollment(
    State(ctx): State<Shared>,
    client: ClientAddr,
    headers: HeaderMap,
    Path(id): Path<String>,
    JsonBody(body): JsonBody<api::ReasonRequest>,
) -> Result<Response, ApiError> {
    let op = authorize(&ctx, &headers, client, Need::Write).await?;
    let id: TokenId = parse_id("enrollment_id", &id)?;
    let reason = optional_reason(body.reason)?;
    let rid = request_id(&headers, &format!("admin enrollment.cancel {id}"), &reason)?;
    // Refuse what cannot succeed without a replicated write (a bad request changes nothing);
    // apply decides again, for the races.
    ctx.linearize().await?;
    ctx.app.read().check_cancel(&id)?;
    match ctx
        .propose(
            &op.name,
            rid,
            Command::CancelToken {
                token_id: id,
                reason,
            },
        )
        .await?
    {
        Outcome::TokenCancelled { token_id } => Ok(axum::Json(api::EnrollmentCancelled {
            enrollment_id: token_id,
            state: TokenState::Cancelled,
        })
        .into_response()),
        other => Err(ApiError::internal(format!("unexpected answer: {other:?}"))),
    }
}

/// An optional `reason`: at most [`MAX_NOTE_LEN`] bytes of printable text, blank as none.
pub fn optional_reason(reason: Option<String>) -> Result<Option<String>, ApiError> {
    let reason = reason
        .map(|r| r.trim().to_string())
        .filter(|r| !r.is_empty());
    if let Some(r) = &reason
        && (r.len() > MAX_NOTE_LEN || r.chars().any(|c| c.is_control()))
    {
        return Err(ApiError::new(
            ErrorCode::InvalidReason,
            "reason must be at most 1024 bytes of printable text",
        ));
    }
    Ok(reason)
}

/// The last time a node was seen: a heartbeat here, or a replicated credential use.
fn last_seen(s: &Replicated, node: &Node, live: &NodeLive) -> Option<i64> {
    let used = node
        .credential_ids
        .iter()
        .filter_map(|c| s.credentials.get(c))
        .filter_map(|c| c.last_used_at_ms)
        .max();
    live.last_heartbeat_ms.max(used)
}

/// A node's status at `now` as this member judges it.
pub fn status_of(
    ctx: &Shared,
    s: &Replicated,
    node: &Node,
    live: &NodeLive,
    now: i64,
) -> NodeStatus {
    node_status(
        node.decommissioned_at_ms.is_some(),
        last_seen(s, node, live),
        ctx.live.leader_since(),
        now,
        ctx.cfg.thresholds,
    )
}

pub(super) fn node_summary(
    ctx: &Shared,
    s: &Replicated,
    node: &Node,
    live: &NodeLive,
    rebuilt_at: i64,
    now: i64,
) -> api::NodeSummary {
    let seen = last_seen(s, node, live);
    let conflicts: Vec<NodeId> = match s.enabled_by_hostname.get(&node.hostname) {
        Some(ids) if node.enabled => ids
            .iter()
            .filter(|o| **o != node.node_id)
            .cloned()
            .collect(),
        _ => vec![],
    };
    // Accelerators count as verified only after a fresh hardware report since this member
    // last rebuilt its view (start, leader change, shard restart).
    let verified_at = live.last_report_ms.filter(|r| *r >= rebuilt_at);
    let cordon = s.health.cordons.get(&node.node_id);
    api::NodeSummary {
        node_id: node.node_id.clone(),
        hostname: node.hostname.clone(),
        identity_public_key: node.public_key.clone(),
        enabled: node.enabled,
        status: status_of(ctx, s, node, live, now),
        last_heartbeat_at: seen.map(rfc3339_ms),
        accelerators: node
            .inventory
            .accelerators
            .iter()
            .map(|a| {
                let rec = s.health.gpu(&node.node_id, &a.uuid);
                api::AcceleratorView {
                    accelerator: a.clone(),
                    health: rec.map_or(Health::Healthy, |r| r.health),
                    cordoned: rec.is_some_and(|r| r.cordoned),
                    health_cause: rec.filter(|r| !r.cause.is_empty()).map(|r| r.cause.clone()),
                    events: vec![],
                }
            })
            .collect(),
        health: s.health.worst(
            &node.node_id,
            node.inventory.accelerators.iter().map(|a| a.uuid.as_str()),
        ),
        cordoned: cordon.is_some(),
        cordon_reason: cordon.map(|c| c.reason.clone()),
        labels: modelforge_proto::labels::node_labels(&node.inventory.accelerators),
        accelerators_verified: verified_at.is_some(),
        accelerators_verified_at: verified_at.map(rfc3339_ms),
        view_rebuilt_at: rfc3339_ms(rebuilt_at),
        storage_roots: node.inventory.storage_roots.clone(),
        driver_version: node.inventory.driver_version.as_deref().map(str::to_string),
        cuda_version: node.inventory.cuda_version.as_deref().map(str::to_string),
        nvml: node.inventory.nvml.as_deref().map(str::to_string),
        created_at: rfc3339_ms(node.created_at_ms),
        enrolled_at: rfc3339_ms(node.enrolled_at_ms),
        decommissioned_at: node.decommissioned_at_ms.map(rfc3339_ms),
        active_credentials: s.active_credentials(&node.node_id).len(),
        hostname_conflicts: conflicts,
    }
}

/// `GET /api/v1/admin/hardware/nodes`.
#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct NodeQuery {
    /// Only nodes that claim this hostname ("which enabled nodes claim hostname H").
    #[serde(default)]
    hostname: Option<String>,
    /// Only nodes that are (or are not) enabled.
    #[serde(default)]
    enabled: Option<bool>,
    #[param(value_type = Option<u32>, minimum = 1, maximum = 1000)]
    /// How many at most (default 100).
    #[serde(default)]
    limit: Option<String>,
    /// The `next` of the previous page.
    #[serde(default)]
    after: Option<String>,
    #[param(value_type = Option<u64>, minimum = 0, maximum = 9223372036854775807_i64)]
    /// Wait until the view's index (`X-Modelforge-Index`) is past this one.
    #[serde(default)]
    index: Option<String>,
    /// How long to wait for a change past `index` (`500ms`, `10s`, `1m`; at most 5 minutes; default 30 s).
    #[serde(default)]
    wait: Option<String>,
}

/// `GET /api/v1/admin/hardware/nodes?hostname=&enabled=&limit=&after=&index=&wait=`.
#[utoipa::path(
    get,
    path = "/api/v1/admin/hardware/nodes",
    tag = "nodes",
    summary = "List nodes (a blocking query with `index` and `wait`)",
    params(NodeQuery),
    responses((status = 200, description = "A page of nodes", body = modelforge_proto::api::Nodes, headers(("X-Modelforge-Index" = u64, description = "The view's index: pass it back as `index` to wait for a change"))), super::openapi::Refusals),
    security(("admin_token" = []))
)]
pub async fn list_nodes(
    State(ctx): State<Shared>,
    client: ClientAddr,
    headers: HeaderMap,
    q: Result<Query<NodeQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    authorize(&ctx, &headers, client, Need::Read).await?;
    let q = query(
        q,
        "hostname=<name>, enabled=true|false, limit=1..1000, after=<next>, index=<n>, wait=<duration>",
    )?;
    let limit = watch::limit(q.limit.as_deref())?;
    let after: Option<NodeId> = watch::id_cursor(q.after.as_deref())?;
    let blocking = watch::blocking(q.index.as_deref(), q.wait.as_deref())?;
    let index = watch::block(&ctx, blocking).await;
    ctx.linearize().await?;
    let now = now_ms();
    let (ids, next) = {
        let s = ctx.app.read();
        watch::page(
            s.nodes
                .range::<_, str>(watch::past(after.as_ref().map(|a| a.as_str())))
                .map(|(_, n)| n)
                .filter(|n| q.hostname.as_ref().is_none_or(|h| &n.hostname == h))
                .filter(|n| q.enabled.is_none_or(|e| n.enabled == e))
                .map(|n| n.node_id.clone()),
            limit,
            |id| id.to_string(),
        )
    };
    // The live state of this page's nodes only (one call per shard).
    let live = ctx.live.sup.many(&ids).await;
    let fallback = (NodeLive::default(), ctx.live.sup.rebuilt_at());
    let s = ctx.app.read();
    let nodes = ids
        .iter()
        .filter_map(|id| s.nodes.get(id))
        .map(|n| {
            let (l, at) = live.get(&n.node_id).unwrap_or(&fallback);
            node_summary(&ctx, &s, n, l, *at, now)
        })
        .collect();
    let resp = axum::Json(api::Nodes { nodes, next }).into_response();
    Ok(watch::indexed(resp, index))
}

/// `GET /api/v1/admin/hardware/nodes/{node_id}?index=&wait=`.
#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct WatchQuery {
    #[param(value_type = Option<u64>, minimum = 0, maximum = 9223372036854775807_i64)]
    /// Wait until the view's index (`X-Modelforge-Index`) is past this one.
    #[serde(default)]
    index: Option<String>,
    /// How long to wait for a change past `index` (`500ms`, `10s`, `1m`; at most 5 minutes; default 30 s).
    #[serde(default)]
    wait: Option<String>,
}

/// `GET /api/v1/admin/hardware/nodes/{node_id}`: the summary plus history, telemetry and the
/// last refused agent request.
#[utoipa::path(
    get,
    path = "/api/v1/admin/hardware/nodes/{node_id}",
    tag = "nodes",
    summary = "Show a node: summary, history, latest telemetry, last refusal",
    params(("node_id" = modelforge_proto::api::NodeId, Path, description = "The node's id"), WatchQuery),
    responses((status = 200, description = "The node", body = modelforge_proto::api::NodeDetail, headers(("X-Modelforge-Index" = u64, description = "The view's index: pass it back as `index` to wait for a change"))), super::openapi::Refusals),
    security(("admin_token" = []))
)]
pub async fn show_node(
    State(ctx): State<Shared>,
    AdminNode(node_id, _): AdminNode,
    q: Result<Query<WatchQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let q = query(q, "index=<n> and wait=<duration>")?;
    let blocking = watch::blocking(q.index.as_deref(), q.wait.as_deref())?;
    let index = watch::block(&ctx, blocking).await;
    if blocking.is_some() {
        // Still the leader after the wait (a relayed watcher must not read a deposed one).
        ctx.linearize().await?;
    }
    let now = now_ms();
    let (live, rebuilt_at) = ctx.live.sup.get(&node_id).await;
    let s = ctx.app.read();
    let node = s
        .nodes
        .get(&node_id)
        .ok_or_else(|| ApiError::new(ErrorCode::NodeNotFound, "no node with this id"))?;
    let mut summary = node_summary(&ctx, &s, node, &live, rebuilt_at, now);
    let latest = live.telemetry.back();
    let telemetry = latest.and_then(|(_, t)| crate::supervisor::decode_sample(t));
    for a in &mut summary.accelerators {
        a.events = telemetry
            .iter()
            .flat_map(|t| &t.accelerators)
            .find(|t| t.uuid.as_deref() == Some(a.accelerator.uuid.as_str()))
            .map(|t| t.events.clone())
            .unwrap_or_default();
    }
    let history = node
        .history
        .iter()
        .map(|e| api::HistoryEntry {
            at: rfc3339_ms(e.at_ms),
            kind: e.kind,
            detail: e.detail.clone(),
            count: e.count,
        })
        .collect();
    let resp = axum::Json(api::NodeDetail {
        summary,
        history,
        telemetry: telemetry
            .as_ref()
            .and_then(|t| serde_json::to_value(t).ok())
            .unwrap_or(Value::Null),
        telemetry_at: latest.map(|(at, _)| rfc3339_ms(*at)),
        last_refusal: live.last_refusal.map(|r| api::LastRefusal {
            status: r.status,
            at: rfc3339_ms(r.at_ms),
            code: r.code.to_string(),
            credential_of_this_node: r.credential_of_this_node,
        }),
    })
    .into_response();
    Ok(watch::indexed(resp, index))
}

/// `GET /api/v1/admin/hardware/nodes/{node_id}/telemetry`: the recent ring, oldest first.
#[utoipa::path(
    get,
    path = "/api/v1/admin/hardware/nodes/{node_id}/telemetry",
    operation_id = "node_telemetry",
    tag = "nodes",
    summary = "A node's recent telemetry, oldest first",
    params(("node_id" = modelforge_proto::api::NodeId, Path, description = "The node's id")),
    responses((status = 200, description = "The samples", body = modelforge_proto::api::TelemetrySamples), super::openapi::Refusals),
    security(("admin_token" = []))
)]
pub async fn telemetry(
    State(ctx): State<Shared>,
    AdminNode(node_id, _): AdminNode,
) -> Result<Response, ApiError> {
    let (live, _) = ctx.live.sup.get(&node_id).await;
    let samples = live
        .telemetry
        .iter()
        .map(|(at, t)| api::TelemetrySample {
            at: rfc3339_ms(*at),
            telemetry: crate::supervisor::decode_sample(t)
                .and_then(|t| serde_json::to_value(t).ok())
                .unwrap_or(Value::Null),
        })
        .collect();
    Ok(axum::Json(api::TelemetrySamples { node_id, samples }).into_response())
}

/// `GET /api/v1/admin/hardware/nodes/{node_id}/credentials?limit=&after=`: no hashes, ever.
/// Oldest first; the counts are of all the node's credentials, not the page's. A cursor is
/// `<created_at_ms>.<credential_id>`, so a page after a pruned credential still starts right.
#[utoipa::path(
    get,
    path = "/api/v1/admin/hardware/nodes/{node_id}/credentials",
    tag = "nodes",
    summary = "List a node's credentials (never a hash)",
    params(("node_id" = modelforge_proto::api::NodeId, Path, description = "The node's id"), PageQuery),
    responses((status = 200, description = "A page of credentials, oldest first", body = modelforge_proto::api::Credentials), super::openapi::Refusals),
    security(("admin_token" = []))
)]
pub async fn list_credentials(
    State(ctx): State<Shared>,
    AdminNode(node_id, _): AdminNode,
    q: Result<Query<PageQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let q = query(q, "limit=1..1000 and after=<next>")?;
    let limit = watch::limit(q.limit.as_deref())?;
    let after: Option<(i64, CredentialId)> = match q.after.as_deref() {
        None => None,
        Some(a) => Some(
            a.split_once('.')
                .and_then(|(ms, id)| Some((ms.parse().ok()?, CredentialId::parse(id)?)))
                .ok_or_else(watch::bad_cursor)?,
        ),
    };
    let s = ctx.app.read();
    let node = s
        .nodes
        .get(&node_id)
        .ok_or_else(|| ApiError::new(ErrorCode::NodeNotFound, "no node with this id"))?;
    let mut all: Vec<_> = node
        .credential_ids
        .iter()
        .filter_map(|c| s.credentials.get(c))
        .collect();
    all.sort_by(|a, b| {
        (a.created_at_ms, &a.credential_id).cmp(&(b.created_at_ms, &b.credential_id))
    });
    let active = all.iter().filter(|c| c.revoked_at_ms.is_none()).count();
    let revoked = all.len() - active;
    let (page, next) = watch::page(
        all.into_iter().filter(|c| {
            after
                .as_ref()
                .is_none_or(|(ms, id)| (c.created_at_ms, &c.credential_id) > (*ms, id))
        }),
        limit,
        |c| format!("{}.{}", c.created_at_ms, c.credential_id),
    );
    let credentials = page
        .into_iter()
        .map(|c| api::CredentialView {
            credential_id: c.credential_id.clone(),
            created_at: rfc3339_ms(c.created_at_ms),
            last_used_at: c.last_used_at_ms.map(rfc3339_ms),
            revoked_at: c.revoked_at_ms.map(rfc3339_ms),
            revoked_reason: c.revoked_reason.clone(),
            enrollment_id: c.token_id.clone(),
        })
        .collect();
    Ok(axum::Json(api::Credentials {
        node_id,
        active,
        revoked,
        credentials,
        next,
    })
    .into_response())
}

/// `DELETE /api/v1/admin/hardware/nodes/{node_id}/credential`: when this returns 200, no member
/// accepts the revoked credentials (heartbeats are served only by a leader holding its lease,
/// after applying everything committed).
#[utoipa::path(
    delete,
    path = "/api/v1/admin/hardware/nodes/{node_id}/credential",
    tag = "nodes",
    summary = "Revoke the node's active credentials",
    params(("node_id" = modelforge_proto::api::NodeId, Path, description = "The node's id"), ("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 200, description = "Makes a retry return the first answer instead of acting twice (1 to 200 characters)")),
    request_body = Option<modelforge_proto::api::RevokeRequest>,
    responses((status = 200, description = "The credentials revoked (empty when none was active)", body = modelforge_proto::api::Revoked), super::openapi::WriteRefusals),
    security(("admin_token" = []))
)]
pub async fn revoke_credential(
    State(ctx): State<Shared>,
    AdminNode(node_id, op): AdminNode,
    headers: HeaderMap,
    JsonBody(body): JsonBody<api::RevokeRequest>,
) -> Result<Response, ApiError> {
    let reason = body
        .reason
        .unwrap_or_else(|| "revoked by admin".to_string());
    if reason.len() > MAX_NOTE_LEN || reason.chars().any(|c| c.is_control()) {
        return Err(ApiError::new(
            ErrorCode::InvalidReason,
            "reason must be at most 1024 bytes of printable text",
        ));
    }
    let rid = request_id(
        &headers,
        &format!("admin credential.revoke {node_id}"),
        &reason,
    )?;
    match ctx
        .propose(
            &op.name,
            rid,
            Command::RevokeCredentials {
                node_id: node_id.clone(),
                reason,
            },
        )
        .await?
    {
        Outcome::Revoked { credential_ids } => {
            tracing::info!(node_id = %node_id, revoked = ?credential_ids, "credentials revoked");
            Ok(axum::Json(api::Revoked {
                node_id,
                revoked: credential_ids,
            })
            .into_response())
        }
        other => Err(ApiError::internal(format!("unexpected answer: {other:?}"))),
    }
}

fn preview_json(p: &crate::state::DecommissionPreview) -> api::DecommissionPreviewView {
    api::DecommissionPreviewView {
        preview_id: p.preview_id.clone(),
        node_id: p.node_id.clone(),
        effects: api::DecommissionEffectsView {
            node_id: p.effects.node_id.clone(),
            hostname: p.effects.hostname.clone(),
            disable_node: true,
            ban_identity: p.effects.identity_public_key.clone(),
            credentials_to_revoke: p.effects.credentials_to_revoke.clone(),
            hostname_conflicts_resolved: p.effects.hostname_conflicts_resolved.clone(),
            claims_to_spend: p.effects.claims_to_spend.clone(),
            allocations_to_release: p.effects.allocations_to_release.clone(),
            accelerators_leaving_service: p.effects.accelerators.clone(),
        },
        fingerprint: p.fingerprint.clone(),
        created_at: rfc3339_ms(p.created_at_ms),
        expires_at: rfc3339_ms(p.expires_at_ms),
    }
}

/// `POST /api/v1/admin/hardware/nodes/{node_id}/decommission/preview`: a replicated, audited
/// write that records every effect and binds them to the state it saw (see ARCHITECTURE.md,
/// "Decommission: preview, then execute").
#[utoipa::path(
    post,
    path = "/api/v1/admin/hardware/nodes/{node_id}/decommission/preview",
    tag = "nodes",
    summary = "Preview what decommissioning the node would change",
    params(("node_id" = modelforge_proto::api::NodeId, Path, description = "The node's id"), ("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 200, description = "Makes a retry return the first answer instead of acting twice (1 to 200 characters)")),
    request_body = Option<modelforge_proto::api::EmptyRequest>,
    responses((status = 200, description = "The preview (valid 15 minutes)", body = modelforge_proto::api::DecommissionPreviewView), super::openapi::WriteRefusals),
    security(("admin_token" = []))
)]
pub async fn decommission_preview(
    State(ctx): State<Shared>,
    AdminNode(node_id, op): AdminNode,
    headers: HeaderMap,
    JsonBody(_): JsonBody<api::EmptyRequest>,
) -> Result<Response, ApiError> {
    let rid = request_id(
        &headers,
        &format!("admin decommission.preview {node_id}"),
        &(),
    )?;
    let cmd = Command::PreviewDecommission {
        preview_id: PreviewId::random(),
        node_id: node_id.clone(),
    };
    match ctx.propose(&op.name, rid, cmd).await? {
        Outcome::DecommissionPreviewed { preview } => {
            tracing::info!(
                node_id = %node_id,
                preview_id = %preview.preview_id,
                "decommission previewed"
            );
            Ok(axum::Json(preview_json(&preview)).into_response())
        }
        other => Err(ApiError::internal(format!("unexpected answer: {other:?}"))),
    }
}

/// `POST /api/v1/admin/hardware/nodes/{node_id}/decommission/execute` `{preview_id, reason}`:
/// applies the preview's effects in one replicated step if they are unchanged, else 409.
#[utoipa::path(
    post,
    path = "/api/v1/admin/hardware/nodes/{node_id}/decommission/execute",
    tag = "nodes",
    summary = "Decommission the node as previewed",
    params(("node_id" = modelforge_proto::api::NodeId, Path, description = "The node's id"), ("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 200, description = "Makes a retry return the first answer instead of acting twice (1 to 200 characters)")),
    request_body = modelforge_proto::api::ExecuteDecommission,
    responses((status = 200, description = "The node, decommissioned", body = modelforge_proto::api::Decommissioned), super::openapi::WriteRefusals),
    security(("admin_token" = []))
)]
pub async fn decommission_execute(
    State(ctx): State<Shared>,
    AdminNode(node_id, op): AdminNode,
    headers: HeaderMap,
    JsonBody(body): JsonBody<api::ExecuteDecommission>,
) -> Result<Response, ApiError> {
    let preview_id: PreviewId = parse_id("preview_id", &body.preview_id)?;
    let reason = body.reason.trim().to_string();
    if reason.is_empty() || reason.len() > MAX_NOTE_LEN || reason.chars().any(|c| c.is_control()) {
        return Err(ApiError::new(
            ErrorCode::InvalidReason,
            "reason must be 1 to 1024 bytes of printable text",
        ));
    }
    let rid = request_id(
        &headers,
        &format!("admin decommission.execute {node_id}"),
        &(&preview_id, &reason),
    )?;
    // What needs no decision by consensus is refused before proposing (the node exists:
    // `AdminNode`); apply decides the rest (stale, expired, already decommissioned), and
    // audits it.
    {
        let s = ctx.app.read();
        // A retry of an answered execute gets its answer, even once the preview is gone.
        if !s.dedup.contains_key(rid.as_str()) {
            s.check_preview_target(&preview_id, &node_id)?;
        }
    }
    let cmd = Command::ExecuteDecommission {
        preview_id: preview_id.clone(),
        node_id: node_id.clone(),
        reason,
    };
    match ctx.propose(&op.name, rid, cmd).await? {
        Outcome::Decommissioned {
            node_id,
            decommissioned_at_ms,
            effects,
        } => {
            tracing::info!(node_id = %node_id, revoked = ?effects.credentials_to_revoke, "node decommissioned");
            Ok(axum::Json(api::Decommissioned {
                node_id,
                status: NodeStatus::Decommissioned,
                enabled: false,
                decommissioned_at: rfc3339_ms(decommissioned_at_ms),
                preview_id,
                revoked: effects.credentials_to_revoke,
                hostname_conflicts_resolved: effects.hostname_conflicts_resolved,
                claims_spent: effects.claims_to_spend,
                allocations_released: effects.allocations_to_release,
            })
            .into_response())
        }
        other => Err(ApiError::internal(format!("unexpected answer: {other:?}"))),
    }
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct AuditQuery {
    /// Only events about this node.
    #[serde(default)]
    node_id: Option<String>,
    /// Only events at or after this RFC 3339 time.
    #[serde(default)]
    since: Option<String>,
    #[param(value_type = Option<u32>, minimum = 1, maximum = 1000)]
    /// How many at most (default 100).
    #[serde(default)]
    limit: Option<String>,
    /// The `seq` of the last event of the previous page.
    /// The `next` of the previous page.
    #[serde(default)]
    after: Option<String>,
}

/// `GET /api/v1/admin/audit?node_id=&since=&limit=&after=`: the trail from seq 1 (archived
/// events first, then the live ones), a page at a time.
#[utoipa::path(
    get,
    path = "/api/v1/admin/audit",
    operation_id = "audit_trail",
    tag = "cluster",
    summary = "The audit trail, from seq 1",
    params(AuditQuery),
    responses((status = 200, description = "A page of events", body = modelforge_proto::api::AuditPage), super::openapi::Refusals),
    security(("admin_token" = []))
)]
pub async fn audit(
    State(ctx): State<Shared>,
    client: ClientAddr,
    headers: HeaderMap,
    q: Result<Query<AuditQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    authorize(&ctx, &headers, client, Need::Read).await?;
    let q = query(
        q,
        "node_id=<id>, since=<RFC 3339 time>, limit=1..1000 and after=<next>",
    )?;
    let limit = watch::limit(q.limit.as_deref())?;
    let after: u64 = match q.after.as_deref() {
        None => 0,
        Some(a) => a.parse().map_err(|_| watch::bad_cursor())?,
    };
    let since_ms = match &q.since {
        None => None,
        Some(s) => Some(
            humantime::parse_rfc3339_weak(s)
                .map_err(|_| {
                    ApiError::new(ErrorCode::InvalidSince, "since must be an RFC 3339 time")
                })?
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as i64)
                .unwrap_or(0),
        ),
    };
    ctx.linearize().await?;
    let (live, base) = {
        let s = ctx.app.read();
        (s.audit.clone(), s.audit_base.clone())
    };
    let wanted = move |e: &crate::state::AuditEvent| {
        e.seq > after
            && q.node_id.as_deref().is_none_or(|n| *e.target == *n)
            && since_ms.is_none_or(|t| e.at_ms >= t)
    };
    let view = |e: crate::state::AuditEvent| api::AuditEventView {
        at: rfc3339_ms(e.at_ms),
        record: e.record(),
    };
    // The archived events first (read from this member's file), then the live ones: the whole
    // trail from seq 1, so a client verifies it end to end. One more than the page, to know
    // whether another follows. A cursor past the archive skips the file.
    let archive = ctx.app.archive().cloned();
    let read_archive = after < base.count;
    let (mut events, complete) = tokio::task::spawn_blocking({
        let wanted = wanted.clone();
        let base = base.clone();
        move || {
            let mut events = vec![];
            let Some(archive) = archive else {
                return Ok((events, base.count == 0));
            };
            if read_archive {
                archive.each(|e| {
                    if wanted(&e) {
                        events.push(view(e));
                    }
                    events.len() <= limit
                })?;
            }
            Ok::<_, std::io::Error>((events, archive.tip() == base))
        }
    })
    .await
    .map_err(|_| ApiError::internal("the archive read stopped"))?
    .map_err(|e| ApiError::internal(format!("the audit archive is not readable: {e}")))?;
    let room = (limit + 1).saturating_sub(events.len());
    let skip = after.saturating_sub(base.count) as usize;
    events.extend(
        live.iter()
            .skip(skip)
            .filter(|e| wanted(e))
            .take(room)
            .cloned()
            .map(view),
    );
    let (events, next) = watch::page(events.into_iter(), limit, |e| e.record.seq.to_string());
    let chain_verified = complete && crate::state::verify_audit_chain(&base, &live).is_ok();
    Ok(axum::Json(api::AuditPage {
        events,
        chain_verified,
        next,
    })
    .into_response())
}

/// `GET /api/v1/admin/state-digest`: a digest of the applied state, to compare members.
#[utoipa::path(
    get,
    path = "/api/v1/cluster/state-digest",
    tag = "cluster",
    summary = "A digest of this member's applied state",
    responses((status = 200, description = "The digest", body = modelforge_proto::api::StateDigest), super::openapi::Refusals),
    security(("admin_token" = []))
)]
pub async fn state_digest(
    State(ctx): State<Shared>,
    client: ClientAddr,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&ctx, &headers, client, Need::Read).await?;
    let s = ctx.app.read();
    Ok(axum::Json(modelforge_proto::api::StateDigest {
        digest: s.digest(),
        applied_index: s.last_applied_index,
    })
    .into_response())
}
