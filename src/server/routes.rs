//! The route table of a member, and the endpoints every member answers itself (health,
//! readiness, its view of the cluster).

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::IntoResponse;
use axum::response::Response;
use modelforge_proto::api;
use modelforge_proto::api::ErrorCode;

use super::peer::*;
use super::*;
use crate::error::ApiError;
use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::get;
use axum::routing::post;

/// The agent's routes but enrolment (which has its own bounds: the argon2 queue and the
/// failed-check budgets): admitted by `edge::admit_agent` on the member that processes them.
fn agent_routes(ctx: Shared) -> Router<Shared> {
    Router::new()
        .route(
            "/api/v1/agent/nodes/{node_id}/heartbeat",
            post(agent::heartbeat),
        )
        .route(
            "/api/v1/agent/nodes/{node_id}/inventory",
            axum::routing::put(agent::inventory),
        )
        .route(
            "/api/v1/agent/nodes/{node_id}/smoke/{smoke_id}",
            post(agent::smoke_report),
        )
        .route_layer(axum::middleware::from_fn_with_state(
            ctx,
            super::edge::admit_agent,
        ))
}

/// The whole route table of a member.
pub fn router(ctx: Shared) -> Router {
    let leader_routes = Router::new()
        .route("/api/v1/agent/enroll", post(agent::enroll))
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
        .route(
            "/api/v1/admin/tokens",
            post(operators::create).get(operators::list),
        )
        .route(
            "/api/v1/admin/tokens/{name}",
            axum::routing::delete(operators::delete),
        )
        .route("/api/v1/admin/cluster/members", post(super::members::add))
        .route(
            "/api/v1/admin/cluster/members/{id}",
            axum::routing::delete(super::members::remove),
        )
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
        .merge(agent_routes(ctx.clone()))
        .layer(axum::middleware::from_fn_with_state(
            ctx.clone(),
            forward::leader_gate,
        ))
        .layer(DefaultBodyLimit::max(ctx.cfg.max_body_bytes))
        .layer(axum::middleware::from_fn_with_state(
            ctx.clone(),
            super::extract::refuse_oversized,
        ))
        .layer(axum::middleware::from_fn_with_state(
            ctx.clone(),
            super::members::membership_gate,
        ));
    let peer_routes = Router::new()
        .route(SNAPSHOT, post(peer_snapshot))
        .route(&format!("{RAFT}{{kind}}"), post(peer_rpc))
        .route(PROPOSE, post(peer_propose))
        .route(STATUS, get(peer_status))
        .route(READ_INDEX, get(peer_read_index))
        .route(VERIFIED, post(peer_verified))
        .route(OBSERVED, post(peer_observed))
        .route(AUDIT_ARCHIVE, post(super::peer::peer_audit_archive))
        // Checked before the handler runs, so a refused caller's body is never read.
        .route_layer(axum::middleware::from_fn_with_state(
            ctx.clone(),
            peer_guard,
        ))
        // Bodies are capped where they are read (`peer::authenticate`, `peer_snapshot`).
        .layer(DefaultBodyLimit::disable());
    Router::new()
        .route("/healthz", get(healthz))
        .route("/livez", get(super::observe::livez))
        .route("/readyz", get(super::observe::readyz))
        .route("/metrics", get(super::observe::metrics))
        .route("/ui", get(super::ui::to_index))
        .route("/ui/", get(super::ui::index))
        .route("/ui/app.js", get(super::ui::script))
        .route("/ui/app.css", get(super::ui::style))
        .route("/api/v1/cluster", get(cluster))
        .route("/api/v1/cluster/state-digest", get(admin::state_digest))
        .route("/api/v1/cluster/ca", get(cluster_ca))
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
        .layer(axum::middleware::from_fn_with_state(
            ctx.clone(),
            super::edge::request_deadline,
        ))
        // Outermost: every answer carries the request id and is counted.
        .layer(axum::middleware::from_fn_with_state(
            ctx.clone(),
            super::observe::observe,
        ))
        .with_state(ctx)
}

pub(super) async fn healthz() -> Response {
    axum::Json(api::Health {
        status: "ok".into(),
    })
    .into_response()
}

/// `GET /api/v1/cluster/ca` (no auth): the cluster CA certificate as PEM text, for agents that
/// pin it by hash and clients that trust it. 404 on a member serving plain HTTP.
pub(super) async fn cluster_ca(State(ctx): State<Shared>) -> Result<Response, ApiError> {
    match &ctx.ca {
        Some((pem, _)) => Ok((
            [(axum::http::header::CONTENT_TYPE, "application/x-pem-file")],
            pem.clone(),
        )
            .into_response()),
        None => Err(ApiError::new(
            ErrorCode::NotFound,
            "this member serves plain HTTP (--insecure-http): it has no CA",
        )),
    }
}

pub(super) async fn cluster(
    State(ctx): State<Shared>,
    client: extract::ClientAddr,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    extract::authorize(&ctx, &headers, client, extract::Need::Read).await?;
    let s = ctx.consensus.status();
    let members = super::members::view(&s);
    let relaxed = std::sync::atomic::Ordering::Relaxed;
    let (minted_ahead, minted_inline) = ctx.mint.counts();
    Ok(axum::Json(api::ClusterView {
        id: s.id,
        leader_id: s.leader_id,
        leader_url: s.leader_url,
        term: s.term,
        state: s.state,
        commit_index: s.commit_index,
        applied_index: s.applied_index,
        last_log_index: s.last_log_index,
        snapshot_index: s.snapshot_index,
        members,
        cluster_id: ctx.cluster_id.clone(),
        secret_checks: api::SecretChecksView {
            argon2_verifies: ctx.hasher.verify_count(),
            cache_hits: ctx.checks.cache_hits.load(relaxed),
            cache_entries: ctx.app.verified_entries(),
            entries_learned_from_leader: ctx.checks.shared_in.load(relaxed),
            refused_by_digest: ctx.checks.refused_by_digest.load(relaxed),
            refused_by_budget: ctx.checks.refused_by_budget.load(relaxed),
        },
        credential_pool: api::CredentialPoolView {
            ready: ctx.mint.ready(),
            minted_ahead,
            minted_inline,
        },
        admission: api::AdmissionView {
            limit: ctx.cfg.max_agent_requests,
            in_flight: ctx
                .cfg
                .max_agent_requests
                .saturating_sub(ctx.agent_slots.available_permits()),
            shed: ctx.checks.shed.load(relaxed),
            retry_after_s: ctx.shed_backoff.current(),
            queue_delay_ms: ctx.queue_delay.current_ms(),
            shed_queue_delay_ms: ctx.cfg.shed_queue_delay.as_secs_f64() * 1000.0,
        },
        disk: ctx.disk.view(),
        audit_archive: {
            let (base, live) = {
                let s = ctx.app.read();
                (s.audit_base.clone(), s.audit.len() as u64)
            };
            let tip = ctx.app.archive().map(|a| a.tip()).unwrap_or_default();
            api::AuditArchiveView {
                archived: base.count,
                on_disk: tip.count,
                complete: tip == base,
                live,
            }
        },
        observed: {
            let c = ctx.live.sup.observed.counts();
            api::ObservedView {
                nodes: c.nodes,
                refusals: c.refusals,
                telemetry_samples: c.telemetry_samples,
                learned_from_leader: ctx.live.sup.observed.learned.load(relaxed),
            }
        },
    })
    .into_response())
}
