//! The scheduler's API and the capability smoke's admin side.
//!
//! Life of an allocation: admin token -> leadership by lease -> the leader's measured view
//! (supervisor shards: a node's accelerators count only if a report arrived since this member
//! last rebuilt its view) -> candidates: enabled, online, not decommissioned, not waiting for a smoke
//! (when `--require-smoke`, the default), GPUs in the inventory with enough memory, not
//! allocated, not busy outside the scheduler -> best fit (the node with the fewest free GPUs
//! that still fits, so large requests keep finding whole nodes) -> propose `Allocate`, which
//! re-checks in apply and refuses `no_capacity` if a racing placement took a GPU first. The
//! leader chooses and proposes one placement at a time (`Ctx::placement`), so racing requests
//! see each other's choices; the re-check in apply is what keeps a GPU single-use across a
//! leader change.

use std::collections::BTreeMap;
use std::collections::BTreeSet;

use super::extract::Path;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::response::Response;
use modelforge_proto::now_ms;
use modelforge_proto::rfc3339_ms;

use super::Shared;
use super::extract::AdminNode;
use super::extract::ClientAddr;
use super::extract::JsonBody;
use super::extract::Need;
use super::extract::authorize;
use super::extract::parse_id;
use super::extract::request_id;
use crate::error::ApiError;
use crate::state::Command;
use crate::state::Outcome;
use crate::state::State as Replicated;
use modelforge_proto::api;
use modelforge_proto::api::ErrorCode;
use modelforge_proto::ids::AllocationId;
use modelforge_proto::ids::NodeId;
use modelforge_proto::ids::SmokeId;
use modelforge_proto::labels;

/// Whether this member has a hardware report of `node_id` since it last rebuilt its view.
fn verified(live: Option<&crate::supervisor::NodeLive>, rebuilt_at: i64) -> bool {
    live.and_then(|l| l.last_report_ms)
        .is_some_and(|r| r >= rebuilt_at)
}

/// Whether the node heartbeats now (not stale): work is never placed on a silent node.
fn online(ctx: &Shared, live: Option<&crate::supervisor::NodeLive>, now: i64) -> bool {
    live.and_then(|l| l.last_heartbeat_ms)
        .is_some_and(|h| now - h < ctx.cfg.thresholds.stale_after_ms)
}

/// GPUs of a node free for placement, with at least `min_mib` of memory (unknown memory
/// counts as not enough when a minimum is asked).
fn free_gpus(
    s: &Replicated,
    node_id: &NodeId,
    min_mib: Option<u64>,
    constraints: &BTreeMap<String, String>,
) -> Vec<String> {
    let Some(node) = s.nodes.get(node_id) else {
        return vec![];
    };
    // A GPU uuid names one physical device: taken on any node is taken (two node records
    // of one machine, after its identity file was lost, report the same GPUs).
    let taken = s.sched.allocated_anywhere();
    let busy = s.sched.external_busy.get(node_id);
    node.inventory
        .accelerators
        .iter()
        .filter(|a| min_mib.is_none_or(|m| a.memory_total_mib.is_some_and(|have| have >= m)))
        .filter(|a| !taken.contains(a.uuid.as_str()))
        .filter(|a| !busy.is_some_and(|b| b.contains(&a.uuid)))
        .filter(|a| s.health.placeable(node_id, &a.uuid))
        .filter(|a| labels::meets(constraints, a, &node.inventory.accelerators))
        .map(|a| a.uuid.clone())
        .collect()
}

/// `POST /api/v1/allocations`.
#[utoipa::path(
    post,
    path = "/api/v1/allocations",
    tag = "scheduler",
    summary = "Place an allocation on verified accelerators",
    params(("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 200, description = "Makes a retry return the first answer instead of acting twice (1 to 200 characters)")),
    request_body = modelforge_proto::api::AllocationRequest,
    responses((status = 201, description = "The placement", body = modelforge_proto::api::AllocationPlaced), super::openapi::WriteRefusals),
    security(("admin_token" = []))
)]
pub async fn allocate(
    State(ctx): State<Shared>,
    client: ClientAddr,
    headers: HeaderMap,
    JsonBody(req): JsonBody<api::AllocationRequest>,
) -> Result<Response, ApiError> {
    let op = authorize(&ctx, &headers, client, Need::Write).await?;
    if req.accelerators == 0 || req.accelerators > 256 {
        return Err(ApiError::new(
            ErrorCode::InvalidAllocation,
            "accelerators must be between 1 and 256",
        ));
    }
    if req.owner.is_empty() || req.owner.len() > 256 {
        return Err(ApiError::new(
            ErrorCode::InvalidAllocation,
            "owner must be 1 to 256 characters",
        ));
    }
    if req.constraints.len() > 16
        || req
            .constraints
            .iter()
            .any(|(k, v)| !labels::KNOWN.contains(&k.as_str()) || v.is_empty() || v.len() > 256)
    {
        return Err(ApiError::new(
            ErrorCode::InvalidAllocation,
            format!(
                "constraints name GPU Feature Discovery labels ({}) with a value each",
                labels::KNOWN.join(", ")
            ),
        ));
    }
    let rid = request_id(
        &headers,
        "admin allocation.create",
        &(
            req.accelerators,
            req.min_memory_mib,
            &req.owner,
            (!req.constraints.is_empty()).then_some(&req.constraints),
        ),
    )?;
    let key = headers.contains_key("idempotency-key").then(|| rid.clone());
    let _placing = ctx.placement.lock().await;
    ctx.linearize().await?;
    if let Some(k) = &key {
        let s = ctx.app.read();
        if let Some(a) = s
            .sched
            .by_key
            .get(k)
            .and_then(|id| s.sched.allocations.get(id))
        {
            return Ok(created(&a.allocation_id, &a.node_id, &a.accelerator_uuids));
        }
        // Refused here too, so that the answer does not depend on the capacity left; apply
        // decides it again.
        if crate::state::idempotency_key_reused(&s.sched.by_key, k)
            || crate::state::idempotency_key_reused(&s.dedup, k)
        {
            return Err(crate::state::key_reused().into());
        }
    }
    let live = ctx.live.sup.all().await;
    let rebuilt_at = ctx.live.sup.rebuilt_at();
    let now = now_ms();
    let choice = {
        let s = ctx.app.read();
        let mut best: Option<(usize, NodeId, Vec<String>)> = None;
        for (id, node) in &s.nodes {
            let l = live.get(id).map(|(l, _)| l);
            if !node.enabled
                || node.decommissioned_at_ms.is_some()
                || (ctx.cfg.require_smoke && s.sched.smoke_required.contains(id))
                || s.health.cordons.contains_key(id)
                || !verified(l, rebuilt_at)
                || !online(&ctx, l, now)
            {
                continue;
            }
            let free = free_gpus(&s, id, req.min_memory_mib, &req.constraints);
            if free.len() >= req.accelerators as usize
                && best.as_ref().is_none_or(|(n, _, _)| free.len() < *n)
            {
                best = Some((free.len(), id.clone(), free));
            }
        }
        best
    };
    let Some((_, node_id, free)) = choice else {
        return Err(ApiError::new(
            ErrorCode::NoCapacity,
            "no enabled node has that many verified free accelerators (only healthy, uncordoned \
             GPUs measured since this member's view was rebuilt, on uncordoned nodes past their \
             smoke, are placed on)",
        ));
    };
    let cmd = Command::Allocate {
        allocation_id: AllocationId::random(),
        node_id,
        accelerator_uuids: free.into_iter().take(req.accelerators as usize).collect(),
        owner: req.owner,
        idempotency_key: key,
    };
    match ctx.propose(&op.name, rid, cmd).await? {
        Outcome::Allocated {
            allocation_id,
            node_id,
            accelerator_uuids,
        } => Ok(created(&allocation_id, &node_id, &accelerator_uuids)),
        other => Err(ApiError::internal(format!(
            "unexpected answer to an allocation: {other:?}"
        ))),
    }
}

fn created(allocation_id: &AllocationId, node_id: &NodeId, uuids: &[String]) -> Response {
    (
        StatusCode::CREATED,
        axum::Json(api::AllocationPlaced {
            allocation_id: allocation_id.clone(),
            node_id: node_id.clone(),
            accelerator_uuids: uuids.to_vec(),
        }),
    )
        .into_response()
}

/// `DELETE /api/v1/allocations/{allocation_id}`.
#[utoipa::path(
    delete,
    path = "/api/v1/allocations/{allocation_id}",
    operation_id = "release_allocation",
    tag = "scheduler",
    summary = "Release an allocation",
    params(("allocation_id" = modelforge_proto::api::AllocationId, Path, description = "The allocation's id"), ("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 200, description = "Makes a retry return the first answer instead of acting twice (1 to 200 characters)")),
    responses((status = 200, description = "Released", body = modelforge_proto::api::AllocationReleased), super::openapi::WriteRefusals),
    security(("admin_token" = []))
)]
pub async fn release(
    State(ctx): State<Shared>,
    Path(allocation_id): Path<String>,
    client: ClientAddr,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let op = authorize(&ctx, &headers, client, Need::Write).await?;
    let allocation_id: AllocationId = parse_id("allocation_id", &allocation_id)?;
    let rid = request_id(
        &headers,
        &format!("admin allocation.release {allocation_id}"),
        &(),
    )?;
    ctx.propose(
        &op.name,
        rid,
        Command::Release {
            allocation_id: allocation_id.clone(),
        },
    )
    .await?;
    Ok(axum::Json(api::AllocationReleased {
        released: allocation_id,
    })
    .into_response())
}

/// `GET /api/v1/admin/scheduler`: every enabled node as the scheduler sees it.
#[utoipa::path(
    get,
    path = "/api/v1/admin/scheduler",
    operation_id = "scheduler_view",
    tag = "scheduler",
    summary = "Every enabled node as the scheduler sees it",
    responses((status = 200, description = "The scheduler's view", body = modelforge_proto::api::SchedulerView), super::openapi::Refusals),
    security(("admin_token" = []))
)]
pub async fn view(
    State(ctx): State<Shared>,
    client: ClientAddr,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&ctx, &headers, client, Need::Read).await?;
    ctx.linearize().await?;
    let live = ctx.live.sup.all().await;
    let rebuilt_at = ctx.live.sup.rebuilt_at();
    let now = now_ms();
    let s = ctx.app.read();
    let mut nodes = vec![];
    for (id, node) in &s.nodes {
        if node.decommissioned_at_ms.is_some() {
            continue;
        }
        let allocations = s
            .sched
            .allocations
            .values()
            .filter(|a| a.node_id == id)
            .map(|a| api::AllocationView {
                allocation_id: a.allocation_id.clone(),
                owner: a.owner.clone(),
                accelerator_uuids: a.accelerator_uuids.clone(),
                state: a.state(),
                created_at: rfc3339_ms(a.created_at_ms),
            })
            .collect();
        let l = live.get(id).map(|(l, _)| l);
        let verified = verified(l, rebuilt_at);
        let online = online(&ctx, l, now);
        let smoke_required = s.sched.smoke_required.contains(id);
        let offered = node.enabled
            && verified
            && online
            && !(ctx.cfg.require_smoke && smoke_required)
            && !s.health.cordons.contains_key(id);
        let free: Vec<String> = if offered {
            free_gpus(&s, id, None, &BTreeMap::new())
        } else {
            vec![]
        };
        let busy: Vec<String> = s
            .sched
            .external_busy
            .get(id)
            .map(|b| b.iter().cloned().collect())
            .unwrap_or_default();
        nodes.push(api::SchedulerNode {
            node_id: id.clone(),
            hostname: node.hostname.clone(),
            enabled: node.enabled,
            verified,
            online,
            smoke_required,
            offered,
            accelerators: node.inventory.accelerators.len(),
            free_accelerators: free.len(),
            free_accelerator_uuids: free,
            busy_outside_scheduler: busy,
            allocations,
        });
    }
    Ok(axum::Json(api::SchedulerView {
        view_rebuilt_at: rfc3339_ms(rebuilt_at),
        require_smoke: ctx.cfg.require_smoke,
        nodes,
    })
    .into_response())
}

/// `POST /api/v1/admin/hardware/nodes/{node_id}/smoke` -> 202 `{smoke_id}`.
#[utoipa::path(
    post,
    path = "/api/v1/admin/hardware/nodes/{node_id}/smoke",
    tag = "scheduler",
    summary = "Start a capability smoke on the node",
    params(("node_id" = modelforge_proto::api::NodeId, Path, description = "The node's id"), ("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 200, description = "Makes a retry return the first answer instead of acting twice (1 to 200 characters)")),
    responses((status = 202, description = "Started; the agent runs it with its next heartbeat", body = modelforge_proto::api::SmokeStarted), super::openapi::WriteRefusals),
    security(("admin_token" = []))
)]
pub async fn start_smoke(
    State(ctx): State<Shared>,
    AdminNode(node_id, op): AdminNode,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let rid = request_id(&headers, &format!("admin smoke.start {node_id}"), &())?;
    // Derived from the request id, so a retry names the same smoke.
    let smoke_id = SmokeId::from(format!(
        "smk-{}",
        &rid.replace('-', "")[..20.min(rid.len())]
    ));
    let cmd = Command::StartSmoke { smoke_id, node_id };
    match ctx.propose(&op.name, rid, cmd).await? {
        Outcome::SmokeStarted { smoke_id } => Ok((
            StatusCode::ACCEPTED,
            axum::Json(api::SmokeStarted { smoke_id }),
        )
            .into_response()),
        other => Err(ApiError::internal(format!(
            "unexpected answer to a smoke: {other:?}"
        ))),
    }
}

/// `GET /api/v1/admin/hardware/nodes/{node_id}/smoke/{smoke_id}`.
#[utoipa::path(
    get,
    path = "/api/v1/admin/hardware/nodes/{node_id}/smoke/{smoke_id}",
    tag = "scheduler",
    summary = "Show a capability smoke",
    params(("node_id" = modelforge_proto::api::NodeId, Path, description = "The node's id"), ("smoke_id" = modelforge_proto::api::SmokeId, Path, description = "The smoke's id")),
    responses((status = 200, description = "The smoke", body = modelforge_proto::api::SmokeView), super::openapi::Refusals),
    security(("admin_token" = []))
)]
pub async fn show_smoke(
    State(ctx): State<Shared>,
    AdminNode(node_id, _): AdminNode,
    Path((_, smoke_id)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let smoke_id: SmokeId = parse_id("smoke_id", &smoke_id)?;
    let s = ctx.app.read();
    let Some(smoke) = s
        .sched
        .smokes
        .get(&smoke_id)
        .filter(|x| x.node_id == node_id)
    else {
        return Err(ApiError::new(
            ErrorCode::SmokeNotFound,
            "no such smoke for this node",
        ));
    };
    Ok(axum::Json(api::SmokeView {
        smoke_id: smoke.smoke_id.clone(),
        node_id: smoke.node_id.clone(),
        state: smoke.state,
        checks: smoke.checks.clone(),
        created_at: rfc3339_ms(smoke.created_at_ms),
        finished_at: smoke.finished_at_ms.map(rfc3339_ms),
    })
    .into_response())
}

/// A node's reconcile in flight; the mark goes when it is dropped.
struct InFlight {
    ctx: Shared,
    node_id: NodeId,
}

impl InFlight {
    fn claim(ctx: &Shared, node_id: &NodeId) -> Option<Self> {
        let mut set = ctx.reconciling.lock().unwrap_or_else(|p| p.into_inner());
        set.insert(node_id.clone()).then(|| InFlight {
            ctx: ctx.clone(),
            node_id: node_id.clone(),
        })
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.ctx
            .reconciling
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.node_id);
    }
}

/// After a fresh report of `node_id` (telemetry naming accelerators): reconcile what the
/// replicated state believes with what was measured, when they differ. Off the heartbeat's
/// path (spawned); at most one write per report, none when nothing is to be changed.
pub fn reconcile_after_report(
    ctx: &Shared,
    node_id: &NodeId,
    telemetry: &modelforge_proto::wire::Telemetry,
) {
    let uuids = |busy_only: bool| {
        telemetry
            .accelerators
            .iter()
            .filter(move |a| !busy_only || !a.processes.is_empty())
            .filter_map(|a| a.uuid.as_deref())
    };
    // Every heartbeat of a node with GPUs asks this; the answer is almost always no, so it
    // is found without copying the report's uuids.
    let needed = {
        let s = ctx.app.read();
        let unconfirmed = s
            .sched
            .allocations
            .values()
            .any(|a| a.node_id == node_id && !a.confirmed);
        unconfirmed || {
            let outside = s.sched.busy_outside(node_id, uuids(true));
            s.sched.busy_outside_changed(node_id, &outside)
        }
    };
    if !needed {
        return;
    }
    let present: BTreeSet<String> = uuids(false).map(str::to_string).collect();
    let busy: BTreeSet<String> = uuids(true).map(str::to_string).collect();
    // One reconcile in flight per node, within the node's write rate: a node that reports
    // faster than its reconciles commit cannot pile up tasks or writes (a later report
    // reconciles again).
    let Some(in_flight) = InFlight::claim(ctx, node_id) else {
        return;
    };
    if ctx.take_node_write(node_id).is_err() {
        return;
    }
    let (ctx, node_id) = (ctx.clone(), node_id.clone());
    tokio::spawn(async move {
        let _in_flight = in_flight;
        let cmd = Command::Reconcile {
            node_id: node_id.clone(),
            present: present.into_iter().collect(),
            busy: busy.into_iter().collect(),
        };
        let at = now_ms();
        if let Err(e) = ctx
            .propose("system", format!("reconcile-{node_id}-{at}"), cmd)
            .await
        {
            tracing::warn!(
                node_id = %node_id,
                code = e.code.as_str(),
                "scheduler reconcile not written"
            );
        }
    });
}
