//! Online membership changes: `POST /api/v1/admin/cluster/members` (learner, catch up, then
//! voter), `DELETE /api/v1/admin/cluster/members/{id}`, and each member's role and progress in
//! `GET /api/v1/cluster`. See ARCHITECTURE "Membership changes".

use std::time::Duration;

use super::extract::Path;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::IntoResponse;
use axum::response::Response;
use modelforge_proto::api;
use modelforge_proto::api::ErrorCode;
use modelforge_raft::ClusterStatus;
use modelforge_raft::MembershipError;

use super::Shared;
use super::extract::ClientAddr;
use super::extract::JsonBody;
use super::extract::Need;
use super::extract::authorize;
use crate::error::ApiError;
use crate::state::Command;

/// How long a new member may take to catch up (a snapshot install included) before the add
/// answers 503 `catch_up_timeout`, inside the request deadline.
const CATCH_UP: Duration = Duration::from_secs(40);
/// A member that acknowledged the leader within this is reachable.
const REACHABLE_MS: u64 = 3_000;

/// The members as `status` sees them, in the API's shape.
pub fn view(status: &ClusterStatus) -> Vec<api::ClusterMember> {
    status
        .members
        .iter()
        .map(|m| api::ClusterMember {
            id: m.id,
            url: m.url.clone(),
            voter: m.voter,
            role: if m.voter { "voter" } else { "learner" }.into(),
            matched_index: m.matched_index,
            reachable: status
                .leader_id
                .filter(|l| *l == status.id)
                .map(|_| m.last_ack_ms.is_some_and(|ms| ms <= REACHABLE_MS)),
        })
        .collect()
}

fn members_answer(ctx: &Shared) -> Response {
    axum::Json(api::MembersView {
        members: view(&ctx.consensus.status()),
    })
    .into_response()
}

fn membership_error(e: MembershipError) -> ApiError {
    match e {
        MembershipError::NotLeader { .. } => ApiError::of(ErrorCode::NotLeader),
        MembershipError::CatchUpTimeout(_) => ApiError::of(ErrorCode::CatchUpTimeout),
        MembershipError::Refused(m) => ApiError::new(ErrorCode::MembershipChangeRefused, m),
        MembershipError::Fatal(m) => ApiError::new(ErrorCode::RaftUnavailable, m),
    }
}

/// A member URL: `https://host:port` (`http://` only when the cluster speaks plain HTTP), no
/// path, no control characters, at most 512 bytes.
fn check_url(ctx: &Shared, url: &str) -> Result<String, ApiError> {
    let scheme_ok = url.starts_with("https://") || (ctx.ca.is_none() && url.starts_with("http://"));
    let rest = url.split_once("://").map(|(_, r)| r).unwrap_or("");
    let rest = rest.trim_end_matches('/');
    if !scheme_ok
        || url.len() > 512
        || rest.is_empty()
        || rest.contains('/')
        || url.chars().any(|c| c.is_control() || c.is_whitespace())
    {
        return Err(ApiError::new(
            ErrorCode::InvalidBody,
            if ctx.ca.is_some() {
                "url must be the member's https://host:port"
            } else {
                "url must be the member's http://host:port"
            },
        ));
    }
    Ok(url.trim_end_matches('/').to_string())
}

/// `POST /api/v1/admin/cluster/members {"id", "url", "voter"?}`: add `id` as a learner, wait
/// until it has caught up, then (unless `voter` is false) promote it to voter. Safe to retry:
/// a learner that timed out is promoted by the retry.
#[utoipa::path(
    post,
    path = "/api/v1/admin/cluster/members",
    operation_id = "add_member",
    tag = "cluster",
    summary = "Add a member (learner, then voter once caught up)",
    request_body = modelforge_proto::api::AddMember,
    responses((status = 200, description = "The members after the change", body = modelforge_proto::api::MembersView), super::openapi::WriteRefusals),
    security(("admin_token" = []))
)]
pub async fn add(
    State(ctx): State<Shared>,
    client: ClientAddr,
    headers: HeaderMap,
    JsonBody(req): JsonBody<api::AddMember>,
) -> Result<Response, ApiError> {
    let op = authorize(&ctx, &headers, client, Need::Manage).await?;
    if req.id == 0 {
        return Err(ApiError::new(
            ErrorCode::InvalidBody,
            "id must be at least 1",
        ));
    }
    let url = check_url(&ctx, &req.url)?;
    let voter = req.voter.unwrap_or(true);
    ctx.linearize().await?;
    if ctx.app.read().retired_members.contains(&req.id) {
        return Err(ApiError::of(ErrorCode::MemberIdRetired));
    }
    let status = ctx.consensus.status();
    if let Some(m) = status.members.iter().find(|m| m.id == req.id) {
        // Only a learner being promoted (a retry after a catch-up timeout) goes on.
        if m.voter || !voter || m.url != url {
            return Err(ApiError::of(ErrorCode::MemberExists));
        }
    }
    // One process, one vote: a second id at a live member's address would be that member
    // answering (and voting) twice (found by the API fuzz: an add that "caught up" at once).
    // A member that no longer answers may be replaced at its own address (add, then remove
    // the lost id); Raft RPCs name their target, so the new process never answers for it.
    if let Some(m) = status.members.iter().find(|m| {
        m.id != req.id
            && same_address(&m.url, &url)
            && m.last_ack_ms.is_some_and(|ms| ms <= REACHABLE_MS)
    }) {
        return Err(ApiError::new(
            ErrorCode::MemberExists,
            format!("member {} already serves at {url}", m.id),
        ));
    }
    // Audited first, with its actor: apply refuses a retired id on every member alike.
    ctx.propose(
        &op.name,
        modelforge_proto::new_uuid(),
        Command::AddMember {
            id: req.id,
            url: url.clone(),
            voter,
        },
    )
    .await?;
    tracing::info!(member = req.id, %url, voter, actor = %op.name, "adding a member");
    ctx.consensus
        .add_learner(req.id, &url, CATCH_UP)
        .await
        .map_err(membership_error)?;
    if voter {
        ctx.consensus
            .promote(req.id)
            .await
            .map_err(membership_error)?;
    }
    tracing::info!(member = req.id, voter, "member added");
    // As at removal: the answer waits for the published status to show the change.
    let id = req.id;
    ctx.consensus
        .wait_for(Duration::from_secs(2), |s| {
            s.members.iter().any(|m| m.id == id && m.voter == voter)
        })
        .await;
    Ok(members_answer(&ctx))
}

/// `DELETE /api/v1/admin/cluster/members/{id}`: retire the id (never accepted again), then
/// remove the member, dead or alive. The leader asked to remove itself hands leadership to
/// the most caught-up voter first and answers 503 `not_leader`: the retry lands on the new
/// leader, which removes it.
#[utoipa::path(
    delete,
    path = "/api/v1/admin/cluster/members/{id}",
    operation_id = "remove_member",
    tag = "cluster",
    summary = "Remove a member (its id is retired)",
    params(("id" = u64, Path, description = "The member's id")),
    responses((status = 200, description = "The members after the change", body = modelforge_proto::api::MembersView), super::openapi::WriteRefusals),
    security(("admin_token" = []))
)]
pub async fn remove(
    State(ctx): State<Shared>,
    client: ClientAddr,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let op = authorize(&ctx, &headers, client, Need::Manage).await?;
    let id: u64 = id
        .parse()
        .map_err(|_| ApiError::new(ErrorCode::InvalidId, "a member id is a number"))?;
    ctx.linearize().await?;
    let status = ctx.consensus.status();
    let Some(member) = status.members.iter().find(|m| m.id == id) else {
        if ctx.app.read().retired_members.contains(&id) {
            // Removed already (a retry): the answer is the same.
            return Ok(members_answer(&ctx));
        }
        return Err(ApiError::of(ErrorCode::MemberNotFound));
    };
    let voters = status.members.iter().filter(|m| m.voter).count();
    if member.voter && voters <= 1 {
        return Err(ApiError::of(ErrorCode::LastVoter));
    }
    if id == ctx.cfg.node_id {
        let to = status
            .members
            .iter()
            .filter(|m| m.voter && m.id != id)
            .max_by_key(|m| m.matched_index.unwrap_or(0))
            .map(|m| m.id)
            .ok_or_else(|| ApiError::of(ErrorCode::LastVoter))?;
        ctx.consensus
            .transfer_leadership(to)
            .await
            .map_err(membership_error)?;
        ctx.consensus
            .wait_for(Duration::from_secs(5), |s| {
                s.leader_id.is_some_and(|l| l != id)
            })
            .await;
        tracing::info!(to, "handed leadership over before removing this member");
        return Err(ApiError::new(
            ErrorCode::NotLeader,
            format!("leadership handed to member {to}; retry the removal there"),
        ));
    }
    ctx.propose(
        &op.name,
        modelforge_proto::new_uuid(),
        Command::RetireMember { id },
    )
    .await?;
    // A reachable member is given a moment to hold its retirement before it is cut off, so
    // that it learns it was removed (the change's own entries then tell it the commit).
    let retired_at = ctx.consensus.status().last_log_index;
    if member.last_ack_ms.is_some_and(|ms| ms <= REACHABLE_MS) {
        ctx.consensus
            .wait_for(Duration::from_secs(3), |s| {
                s.members
                    .iter()
                    .any(|m| m.id == id && m.matched_index.is_some_and(|i| i >= retired_at))
            })
            .await;
    }
    ctx.consensus
        .remove_member(id)
        .await
        .map_err(membership_error)?;
    tracing::info!(member = id, actor = %op.name, "member removed");
    // The status is openraft's metrics, published a moment after the change commits: the
    // answer waits for it, so it never lists the member just removed (seen in CI).
    ctx.consensus
        .wait_for(Duration::from_secs(2), |s| {
            s.members.iter().all(|m| m.id != id)
        })
        .await;
    Ok(members_answer(&ctx))
}

/// Whether two member urls name the same listener (scheme, host and port; case and a trailing
/// slash aside).
fn same_address(a: &str, b: &str) -> bool {
    let norm = |u: &str| u.trim_end_matches('/').to_ascii_lowercase();
    norm(a) == norm(b)
}

/// Client requests on a member that is not (or no longer) in the cluster's configuration:
/// a `--join` member not added yet, or a removed one. 503 `not_a_member`, saying which.
pub async fn membership_gate(
    State(ctx): State<Shared>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let me = ctx.cfg.node_id;
    if ctx.app.read().retired_members.contains(&me) {
        return ApiError::new(
            ErrorCode::NotAMember,
            format!("member {me} was removed from the cluster; it serves no requests (wipe its data dir to reuse the machine under a new id)"),
        )
        .into_response();
    }
    if !ctx.cfg.join.is_empty() && !ctx.consensus.status().members.iter().any(|m| m.id == me) {
        return ApiError::new(
            ErrorCode::NotAMember,
            format!("member {me} is waiting to be added: run `modelforge admin members add {me} {}` against the cluster", ctx.cfg.advertise),
        )
        .into_response();
    }
    next.run(req).await
}
