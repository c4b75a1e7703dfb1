//! Cordon, uncordon and drain of a node, and a GPU's uncordon (ARCHITECTURE.md "GPU health").
//! Each is an audited command with its reason; each answers the node as the list shows it.

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::IntoResponse;
use axum::response::Response;
use modelforge_proto::now_ms;

use super::Shared;
use super::extract::AdminNode;
use super::extract::JsonBody;
use super::extract::Path;
use super::extract::request_id;
use crate::error::ApiError;
use crate::state::Command;
use modelforge_proto::api;
use modelforge_proto::api::ErrorCode;
use modelforge_proto::gpu_health;
use modelforge_proto::gpu_health::GpuEvent;
use modelforge_proto::gpu_health::Health;
use modelforge_proto::ids::NodeId;
use modelforge_proto::wire::Telemetry;

/// The required reason: the shared rule for reasons (printable, at most 1024 bytes), not blank.
fn reason(body: &api::CordonRequest) -> Result<String, ApiError> {
    super::admin::optional_reason(Some(body.reason.clone()))?
        .ok_or_else(|| ApiError::new(ErrorCode::InvalidReason, "a reason is required"))
}

/// Propose `cmd` for the operator, then answer the node's view.
async fn act(
    ctx: &Shared,
    op: &str,
    node_id: &NodeId,
    headers: &HeaderMap,
    cmd: Command,
) -> Result<Response, ApiError> {
    let rid = request_id(
        headers,
        &format!("admin {} {node_id}", cmd.action()),
        &format!("{cmd:?}"),
    )?;
    ctx.propose(op, rid, cmd).await?;
    let (live, rebuilt_at) = ctx.live.sup.get(node_id).await;
    let s = ctx.app.read();
    let node = s
        .nodes
        .get(node_id)
        .ok_or_else(|| ApiError::of(ErrorCode::NodeNotFound))?;
    let view = super::admin::node_summary(ctx, &s, node, &live, rebuilt_at, now_ms());
    Ok(axum::Json(view).into_response())
}

/// `POST /api/v1/admin/hardware/nodes/{node_id}/cordon`.
#[utoipa::path(
    post,
    path = "/api/v1/admin/hardware/nodes/{node_id}/cordon",
    tag = "nodes",
    summary = "Cordon the node: no new placement on it",
    params(("node_id" = modelforge_proto::api::NodeId, Path, description = "The node's id")),
    request_body = modelforge_proto::api::CordonRequest,
    responses((status = 200, description = "The node", body = modelforge_proto::api::NodeSummary), super::openapi::WriteRefusals),
    security(("admin_token" = []))
)]
pub async fn cordon(
    State(ctx): State<Shared>,
    AdminNode(node_id, op): AdminNode,
    headers: HeaderMap,
    JsonBody(body): JsonBody<api::CordonRequest>,
) -> Result<Response, ApiError> {
    let reason = reason(&body)?;
    let cmd = Command::Cordon {
        node_id: node_id.clone(),
        reason,
        drain: false,
    };
    act(&ctx, &op.name, &node_id, &headers, cmd).await
}

/// `POST /api/v1/admin/hardware/nodes/{node_id}/drain`.
#[utoipa::path(
    post,
    path = "/api/v1/admin/hardware/nodes/{node_id}/drain",
    tag = "nodes",
    summary = "Drain the node: cordon it and release its allocations (each marked `drained`)",
    params(("node_id" = modelforge_proto::api::NodeId, Path, description = "The node's id")),
    request_body = modelforge_proto::api::CordonRequest,
    responses((status = 200, description = "The node", body = modelforge_proto::api::NodeSummary), super::openapi::WriteRefusals),
    security(("admin_token" = []))
)]
pub async fn drain(
    State(ctx): State<Shared>,
    AdminNode(node_id, op): AdminNode,
    headers: HeaderMap,
    JsonBody(body): JsonBody<api::CordonRequest>,
) -> Result<Response, ApiError> {
    let reason = reason(&body)?;
    let cmd = Command::Cordon {
        node_id: node_id.clone(),
        reason,
        drain: true,
    };
    act(&ctx, &op.name, &node_id, &headers, cmd).await
}

/// `POST /api/v1/admin/hardware/nodes/{node_id}/uncordon`.
#[utoipa::path(
    post,
    path = "/api/v1/admin/hardware/nodes/{node_id}/uncordon",
    tag = "nodes",
    summary = "Lift the operator's cordon of the node (GPU cordons stay)",
    params(("node_id" = modelforge_proto::api::NodeId, Path, description = "The node's id")),
    request_body = modelforge_proto::api::CordonRequest,
    responses((status = 200, description = "The node", body = modelforge_proto::api::NodeSummary), super::openapi::WriteRefusals),
    security(("admin_token" = []))
)]
pub async fn uncordon(
    State(ctx): State<Shared>,
    AdminNode(node_id, op): AdminNode,
    headers: HeaderMap,
    JsonBody(body): JsonBody<api::CordonRequest>,
) -> Result<Response, ApiError> {
    let reason = reason(&body)?;
    let cmd = Command::Uncordon {
        node_id: node_id.clone(),
        reason,
    };
    act(&ctx, &op.name, &node_id, &headers, cmd).await
}

/// `POST /api/v1/admin/hardware/nodes/{node_id}/accelerators/{uuid}/uncordon`.
#[utoipa::path(
    post,
    path = "/api/v1/admin/hardware/nodes/{node_id}/accelerators/{uuid}/uncordon",
    operation_id = "uncordon_accelerator",
    tag = "nodes",
    summary = "Lift a GPU's health cordon (after a reset): healthy until new events say otherwise",
    params(("node_id" = modelforge_proto::api::NodeId, Path, description = "The node's id"), ("uuid" = String, Path, description = "The GPU's uuid")),
    request_body = modelforge_proto::api::CordonRequest,
    responses((status = 200, description = "The node", body = modelforge_proto::api::NodeSummary), super::openapi::WriteRefusals),
    security(("admin_token" = []))
)]
pub async fn uncordon_accelerator(
    State(ctx): State<Shared>,
    AdminNode(node_id, op): AdminNode,
    Path((_, uuid)): Path<(String, String)>,
    headers: HeaderMap,
    JsonBody(body): JsonBody<api::CordonRequest>,
) -> Result<Response, ApiError> {
    let reason = reason(&body)?;
    let known = ctx
        .app
        .read()
        .nodes
        .get(&node_id)
        .is_some_and(|n| n.inventory.accelerators.iter().any(|a| a.uuid == uuid));
    if !known {
        return Err(ApiError::new(
            ErrorCode::NotFound,
            "the node has no accelerator with that uuid",
        ));
    }
    let cmd = Command::UncordonGpu {
        node_id: node_id.clone(),
        uuid,
        reason,
    };
    act(&ctx, &op.name, &node_id, &headers, cmd).await
}

/// A degraded event that has not grown for this long no longer counts (throttling passes).
const DEGRADED_FOR_MS: i64 = 60 * 60 * 1000;

/// Whether `e` is judged now: it grew after the GPU was last cleared by an operator, and a
/// degrading one grew within the last hour (a failing one counts until it is cleared).
fn judged(e: &GpuEvent, cleared_at: Option<i64>, now: i64) -> bool {
    let last = humantime::parse_rfc3339_weak(&e.last_at)
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(now, |d| d.as_millis() as i64);
    if cleared_at.is_some_and(|c| last <= c) {
        return false;
    }
    gpu_health::severity(e.kind, e.code, e.count) != Health::Degraded
        || now - last < DEGRADED_FOR_MS
}

/// A transition a report shows: the GPU, the record it was judged from, the new health and
/// its cause.
pub struct Transition {
    uuid: String,
    from: Health,
    cleared_at_ms: Option<i64>,
    health: Health,
    cause: String,
}

/// The health transitions a report shows against the replicated state.
pub fn transitions(
    s: &crate::state::State,
    node_id: &NodeId,
    telemetry: &Telemetry,
    now: i64,
) -> Vec<Transition> {
    if s.nodes
        .get(node_id)
        .is_some_and(|n| n.decommissioned_at_ms.is_some())
    {
        return vec![];
    }
    let Some(node) = s.nodes.get(node_id) else {
        return vec![];
    };
    telemetry
        .accelerators
        .iter()
        .filter_map(|a| {
            let uuid = a.uuid.as_ref()?;
            let rec = s.health.gpu(node_id, uuid);
            // The usual report: no events on a GPU with no health record, healthy as before.
            // (Every heartbeat of a node with GPUs comes here.)
            if a.events.is_empty() && rec.is_none() {
                return None;
            }
            if !node.inventory.accelerators.iter().any(|i| &i.uuid == uuid) {
                return None;
            }
            let cleared = rec.and_then(|r| r.cleared_at_ms);
            let events: Vec<GpuEvent> = a
                .events
                .iter()
                .filter(|e| judged(e, cleared, now))
                .cloned()
                .collect();
            let (health, cause) = gpu_health::worst(&events);
            let sticky = rec.is_some_and(|r| r.cordoned && r.health == Health::Failed);
            let current = rec.map_or(Health::Healthy, |r| r.health);
            (health != current && !sticky).then(|| Transition {
                uuid: uuid.clone(),
                from: current,
                cleared_at_ms: cleared,
                health,
                cause: cause.unwrap_or_default(),
            })
        })
        .collect()
}

/// After a report naming GPUs: propose each health transition it shows (off the heartbeat's
/// path, within the node's write budget). Nothing is written while health is unchanged; a
/// transition proposed twice (two reports racing) is recorded once by apply.
pub fn health_after_report(ctx: &Shared, node_id: &NodeId, telemetry: &Telemetry) {
    let now = now_ms();
    let changes = transitions(&ctx.app.read(), node_id, telemetry, now);
    if changes.is_empty() || ctx.take_node_write(node_id).is_err() {
        return;
    }
    let (ctx, node_id) = (ctx.clone(), node_id.clone());
    tokio::spawn(async move {
        for t in changes {
            let Transition {
                uuid,
                from,
                cleared_at_ms,
                health,
                cause,
            } = t;
            let rid = format!("gpu-health-{node_id}-{uuid}-{health:?}-{now}");
            let cmd = Command::GpuHealth {
                node_id: node_id.clone(),
                uuid: uuid.clone(),
                from,
                cleared_at_ms,
                health,
                cause: cause.clone(),
            };
            match ctx.propose("system", rid, cmd).await {
                Ok(_) => {
                    tracing::info!(node_id = %node_id, uuid, ?health, cause, "GPU health changed")
                }
                Err(e) => {
                    tracing::warn!(node_id = %node_id, uuid, code = e.code.as_str(), "GPU health not written")
                }
            }
        }
    });
}
