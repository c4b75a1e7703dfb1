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
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

/// The agent's routes but enrolment (which has its own bounds: the argon2 queue and the
/// failed-check budgets): admitted by `edge::admit_agent` on the member that processes them.
fn agent_routes(ctx: Shared) -> OpenApiRouter<Shared> {
    OpenApiRouter::new()
        .routes(routes!(agent::heartbeat))
        .routes(routes!(agent::inventory))
        .routes(routes!(agent::smoke_report))
        .route_layer(axum::middleware::from_fn_with_state(
            ctx,
            super::edge::admit_agent,
        ))
}

/// The whole route table of a member. Every `/api/v1` route registers with its handler's
/// `#[utoipa::path]`, so the served OpenAPI document covers each one (`openapi.rs`).
pub fn router(ctx: Shared) -> Router {
    let leader_routes = OpenApiRouter::new()
        .routes(routes!(agent::enroll))
        .routes(routes!(admin::create_enrollment, admin::list_enrollments))
        .routes(routes!(admin::cancel_enrollment))
        .routes(routes!(admin::list_nodes))
        .routes(routes!(admin::show_node))
        .routes(routes!(admin::list_credentials))
        .routes(routes!(admin::telemetry))
        .routes(routes!(admin::revoke_credential))
        .routes(routes!(admin::decommission_preview))
        .routes(routes!(admin::decommission_execute))
        .routes(routes!(admin::audit))
        .routes(routes!(super::cordon::cordon))
        .routes(routes!(super::cordon::drain))
        .routes(routes!(super::cordon::uncordon))
        .routes(routes!(super::cordon::uncordon_accelerator))
        .routes(routes!(operators::create, operators::list))
        .routes(routes!(operators::delete))
        .routes(routes!(super::members::add))
        .routes(routes!(super::members::remove))
        .routes(routes!(scheduler::allocate))
        .routes(routes!(scheduler::release))
        .routes(routes!(scheduler::view))
        .routes(routes!(scheduler::start_smoke))
        .routes(routes!(scheduler::show_smoke))
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
    let (api_routes, api) = OpenApiRouter::with_openapi(super::openapi::ApiDoc::openapi())
        .routes(routes!(cluster))
        .routes(routes!(admin::state_digest))
        .routes(routes!(cluster_ca))
        .routes(routes!(backup::backup))
        .routes(routes!(super::openapi::document))
        .merge(leader_routes)
        .split_for_parts();
    super::openapi::publish(&api);
    let peer_routes = Router::new()
        .route(SNAPSHOT, post(peer_snapshot))
        .route(&format!("{RAFT}{{kind}}"), post(peer_rpc))
        .route(PROPOSE, post(peer_propose))
        .route(STATUS, get(peer_status))
        .route(READ_INDEX, get(peer_read_index))
        .route(VERIFIED, post(peer_verified))
        .route(OBSERVED, post(peer_observed))
        .route(
            super::relay_batch::HEARTBEATS,
            post(super::relay_batch::peer_heartbeats),
        )
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
        .merge(api_routes)
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
#[utoipa::path(
    get,
    path = "/api/v1/cluster/ca",
    tag = "cluster",
    summary = "The cluster CA certificate (PEM)",
    responses((status = 200, description = "The CA certificate", content_type = "application/x-pem-file", body = String), super::openapi::Refusals)
)]
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

#[utoipa::path(
    get,
    path = "/api/v1/cluster",
    tag = "cluster",
    summary = "The cluster as this member sees it",
    responses((status = 200, description = "The cluster", body = modelforge_proto::api::ClusterView), super::openapi::Refusals),
    security(("admin_token" = []))
)]
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
