//! Operability at the edge: request ids, metrics, liveness and readiness. See ARCHITECTURE
//! "Operability: metrics, request ids, health".

use std::sync::Arc;
use std::time::Instant;

use axum::extract::MatchedPath;
use axum::extract::Request;
use axum::extract::State;
use axum::http::HeaderValue;
use axum::http::StatusCode;
use axum::http::header::HeaderName;
use axum::middleware::Next;
use axum::response::IntoResponse;
use axum::response::Response;
use modelforge_proto::api;
use modelforge_proto::api::NodeStatus;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::histogram::exponential_buckets;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;
use prometheus_client::registry::Unit;
use tracing::Instrument;

use super::Shared;
use crate::error::ApiError;

/// The request id header: taken from the caller, made when absent, echoed on every answer.
pub static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
/// The longest request id taken from a caller; a longer one is replaced.
const MAX_REQUEST_ID: usize = 128;
/// Every metric's prefix.
const PREFIX: &str = "modelforge";
/// The route label of a request that matched no route (a scanner cannot grow the label set).
const UNMATCHED: &str = "unmatched";
const HEARTBEAT_ROUTE: &str = "/api/v1/agent/nodes/{node_id}/heartbeat";
const ENROL_ROUTE: &str = "/api/v1/agent/enroll";
const REVOKE_ROUTE: &str = "/api/v1/admin/hardware/nodes/{node_id}/credential";

tokio::task_local! {
    /// The id of the request this task serves.
    static REQUEST_ID: Arc<str>;
}

/// Run `fut` as serving the request `id` (a heartbeat relayed in a batch keeps the id the
/// agent's request got on the member that received it).
pub async fn with_request_id<F: std::future::Future>(id: Option<String>, fut: F) -> F::Output {
    match id {
        Some(id) => REQUEST_ID.scope(Arc::from(id.as_str()), fut).await,
        None => fut.await,
    }
}

/// The id of the request the calling task serves, if it serves one.
pub fn current_request_id() -> Option<String> {
    REQUEST_ID.try_with(|id| id.to_string()).ok()
}

fn acceptable_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= MAX_REQUEST_ID && id.bytes().all(|b| b.is_ascii_graphic())
}

/// A fresh request id: 32 hex digits, this process's random 64-bit prefix then a counter.
/// Unique, not secret (it is echoed and logged), so one draw from the OS per process, not one
/// system call per request.
fn new_request_id() -> String {
    static PREFIX: std::sync::LazyLock<[u8; 8]> =
        std::sync::LazyLock::new(modelforge_proto::random_bytes::<8>);
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&*PREFIX);
    bytes[8..].copy_from_slice(&n.to_be_bytes());
    modelforge_proto::hex(&bytes)
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteCode {
    route: String,
    code: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Route {
    route: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Code {
    code: u16,
}

/// What a member counts as it happens (one registry a member). Scrape-time values (the
/// state, consensus, the argon2 pool) are read when scraped, in [`metrics`].
pub struct Metrics {
    registry: Registry,
    requests: Family<RouteCode, Counter>,
    durations: Family<Route, Histogram>,
    heartbeats: Family<Code, Counter>,
    enrolments: Family<Code, Counter>,
    revocations: Counter,
    pub leader_changes: Counter,
    /// Heartbeats in each batch this member relayed to the leader.
    pub relay_batch_size: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix(PREFIX);
        let requests = Family::<RouteCode, Counter>::default();
        registry.register(
            "http_requests",
            "HTTP requests answered, by route and status code",
            requests.clone(),
        );
        // 0.5 ms .. 8 s.
        let durations = Family::<Route, Histogram>::new_with_constructor(
            (|| Histogram::new(exponential_buckets(0.000_5, 2.0, 15))) as fn() -> Histogram,
        );
        registry.register_with_unit(
            "http_request_duration",
            "Time from a request's routing to its answer, by route",
            Unit::Seconds,
            durations.clone(),
        );
        let heartbeats = Family::<Code, Counter>::default();
        registry.register(
            "heartbeats",
            "Heartbeats answered to agents by this member, by status code",
            heartbeats.clone(),
        );
        let enrolments = Family::<Code, Counter>::default();
        registry.register(
            "enrollments",
            "Enrolments answered to agents by this member, by status code (201: a node enrolled)",
            enrolments.clone(),
        );
        let revocations = Counter::default();
        registry.register(
            "revocations",
            "Credential revocations answered 200 by this member",
            revocations.clone(),
        );
        let leader_changes = Counter::default();
        registry.register(
            "server_leader_changes_seen",
            "Changes of leader this member has seen",
            leader_changes.clone(),
        );
        // 1 .. 512, the largest batch.
        let relay_batch_size = Histogram::new(exponential_buckets(1.0, 2.0, 10));
        registry.register(
            "heartbeat_relay_batch_size",
            "Heartbeats in each batch this member relayed to the leader",
            relay_batch_size.clone(),
        );
        modelforge_raft::metrics::METRICS.register(&mut registry);
        // The encoder leaves out a family with no series: the usual answers start at zero, so
        // each family is there (its # TYPE line first) before its first observation.
        for code in [200, 401, 503] {
            let _ = heartbeats.get_or_create(&Code { code });
        }
        for code in [201, 401] {
            let _ = enrolments.get_or_create(&Code { code });
        }
        let scrape = "/metrics".to_string();
        let _ = requests.get_or_create(&RouteCode {
            route: scrape.clone(),
            code: 200,
        });
        let _ = durations.get_or_create(&Route { route: scrape });
        registry.register(
            "build",
            "The running build",
            Info::new(vec![(
                "version".to_string(),
                env!("CARGO_PKG_VERSION").to_string(),
            )]),
        );
        Self {
            registry,
            requests,
            durations,
            heartbeats,
            enrolments,
            revocations,
            leader_changes,
            relay_batch_size,
        }
    }
}

/// The outermost layer of every route: the request id (taken or made, kept for the
/// request's future, in its span and on its answer) and the request's metrics.
pub async fn observe(State(ctx): State<Shared>, mut req: Request, next: Next) -> Response {
    let id = req
        .headers()
        .get(&X_REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|id| acceptable_id(id))
        .map(str::to_string)
        .unwrap_or_else(new_request_id);
    let value = HeaderValue::from_str(&id).expect("a printable ASCII id");
    // Relays copy the header, so the leader logs the same id.
    req.headers_mut()
        .insert(X_REQUEST_ID.clone(), value.clone());
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or(UNMATCHED, |p| p.as_str())
        .to_string();
    // A relayed request was answered to the agent by the member that relayed it.
    let from_agent = !req
        .headers()
        .contains_key(modelforge_raft::network::PEER_HEADER);
    let span = tracing::info_span!("request", id = %id, method = %req.method(), route = %route);
    let started = Instant::now();
    let mut resp = REQUEST_ID
        .scope(Arc::from(id.as_str()), next.run(req).instrument(span))
        .await;
    resp.headers_mut().insert(X_REQUEST_ID.clone(), value);
    let code = resp.status().as_u16();
    let m = &ctx.metrics;
    m.durations
        .get_or_create(&Route {
            route: route.clone(),
        })
        .observe(started.elapsed().as_secs_f64());
    match route.as_str() {
        HEARTBEAT_ROUTE if from_agent => {
            m.heartbeats.get_or_create(&Code { code }).inc();
        }
        ENROL_ROUTE if from_agent => {
            m.enrolments.get_or_create(&Code { code }).inc();
        }
        REVOKE_ROUTE if code == 200 && from_agent => {
            m.revocations.inc();
        }
        _ => {}
    }
    m.requests.get_or_create(&RouteCode { route, code }).inc();
    resp
}

/// `GET /metrics` (Prometheus text format 0.0.4): what was counted, then what is read now.
pub async fn metrics(
    State(ctx): State<Shared>,
    client: super::extract::ClientAddr,
    headers: axum::http::HeaderMap,
) -> Response {
    if ctx.cfg.metrics_auth
        && let Err(e) =
            super::extract::authorize(&ctx, &headers, client, super::extract::Need::Read).await
    {
        return e.into_response();
    }
    let mut now = Registry::with_prefix(PREFIX);
    let s = ctx.consensus.status();
    let gauge = |v: i64| {
        let g: Gauge = Gauge::default();
        g.set(v);
        g
    };
    now.register(
        "server_has_leader",
        "1 if this member knows a leader",
        gauge(s.leader_id.is_some() as i64),
    );
    now.register(
        "server_is_leader",
        "1 if this member leads",
        gauge((s.leader_id == Some(ctx.cfg.node_id) && s.state == "Leader") as i64),
    );
    now.register("raft_term", "The current Raft term", gauge(s.term as i64));
    now.register(
        "raft_commit_index",
        "The highest log index known committed",
        gauge(s.commit_index as i64),
    );
    now.register(
        "raft_applied_index",
        "The highest log index applied to this member's state",
        gauge(s.applied_index as i64),
    );
    let members = Family::<Vec<(String, String)>, Gauge>::default();
    for role in ["voter", "learner"] {
        let n = s
            .members
            .iter()
            .filter(|m| m.voter == (role == "voter"))
            .count();
        members
            .get_or_create(&vec![("role".to_string(), role.to_string())])
            .set(n as i64);
    }
    now.register("members", "Cluster members by role", members);
    let relaxed = std::sync::atomic::Ordering::Relaxed;
    now.register(
        "argon2_verifies",
        "argon2 verifications run by this member",
        ConstCounter::new(ctx.hasher.verify_count()),
    );
    now.register(
        "argon2_queue_depth",
        "argon2 jobs waiting for a worker",
        gauge(ctx.hasher.waiting() as i64),
    );
    now.register(
        "secret_cache_hits",
        "Secret checks answered by the verified cache (no argon2)",
        ConstCounter::new(ctx.checks.cache_hits.load(relaxed)),
    );
    now.register(
        "agent_requests_shed",
        "Agent requests shed by admission control (503 over_capacity)",
        ConstCounter::new(ctx.checks.shed.load(relaxed)),
    );
    let delay: prometheus_client::metrics::gauge::Gauge<f64, std::sync::atomic::AtomicU64> =
        Default::default();
    delay.set(ctx.queue_delay.current_ms() / 1000.0);
    now.register_with_unit(
        "queue_delay",
        "How long ready requests wait for this member's CPU",
        Unit::Seconds,
        delay,
    );
    let nodes = Family::<Vec<(String, String)>, Gauge>::default();
    for (status, n) in node_counts(&ctx).await {
        nodes
            .get_or_create(&vec![("status".to_string(), status.as_str().to_string())])
            .set(n as i64);
    }
    now.register(
        "nodes",
        "Nodes by status as this member judges them (the leader's is authoritative)",
        nodes,
    );
    let mut text = String::with_capacity(16 * 1024);
    let encoded =
        prometheus_client::encoding::prometheus_text::encode(&mut text, &ctx.metrics.registry)
            .and_then(|()| prometheus_client::encoding::prometheus_text::encode(&mut text, &now));
    match encoded {
        Ok(()) => (
            [(
                axum::http::header::CONTENT_TYPE,
                prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
            )],
            text,
        )
            .into_response(),
        Err(_) => ApiError::internal("metrics could not be encoded").into_response(),
    }
}

/// How many nodes have each status now (every status listed, zeros included).
async fn node_counts(ctx: &Shared) -> Vec<(NodeStatus, usize)> {
    let live = ctx.live.sup.all().await;
    let fallback = crate::supervisor::NodeLive::default();
    let now = modelforge_proto::now_ms();
    let s = ctx.app.read();
    let mut counts: Vec<(NodeStatus, usize)> = NodeStatus::ALL.iter().map(|st| (*st, 0)).collect();
    for n in s.nodes.values() {
        let l = live.get(&n.node_id).map_or(&fallback, |(l, _)| l);
        let status = super::admin::status_of(ctx, &s, n, l, now);
        if let Some(c) = counts.iter_mut().find(|(st, _)| *st == status) {
            c.1 += 1;
        }
    }
    counts
}

/// `GET /livez`: answered by the runtime itself, so a member whose runtime is stuck does not
/// answer.
pub async fn livez() -> Response {
    axum::Json(api::Health {
        status: "ok".into(),
    })
    .into_response()
}

/// `GET /readyz[?verbose]`: each check, and 503 if one fails.
pub async fn readyz(State(ctx): State<Shared>) -> Response {
    let s = ctx.consensus.status();
    let checks = readiness_checks(&ctx, &s);
    let ready = checks.iter().all(|c| c.ok);
    let body = api::Readiness {
        ready,
        leader_id: s.leader_id,
        commit_index: s.commit_index,
        applied_index: s.applied_index,
        checks,
    };
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, axum::Json(body)).into_response()
}

/// Tell systemd (`Type=notify`) the member is ready once its readiness checks first pass
/// (a no-op when not started by systemd).
pub async fn notify_ready(ctx: Shared) {
    loop {
        let s = ctx.consensus.status();
        if readiness_checks(&ctx, &s).iter().all(|c| c.ok) {
            if let Err(e) = sd_notify::notify(&[sd_notify::NotifyState::Ready]) {
                tracing::warn!(error = %e, "could not tell systemd the member is ready");
            }
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// What `/readyz` checks: a leader known, caught up, disk above the reserve, not stopping.
fn readiness_checks(ctx: &Shared, s: &modelforge_raft::ClusterStatus) -> Vec<api::ReadinessCheck> {
    let check = |name: &str, ok: bool, detail: String| api::ReadinessCheck {
        name: name.to_string(),
        ok,
        detail: Some(detail),
    };
    let disk = ctx.disk.view();
    vec![
        check(
            "leader",
            s.leader_id.is_some(),
            match s.leader_id {
                Some(id) => format!("member {id} leads in term {}", s.term),
                None => "no leader known".to_string(),
            },
        ),
        check(
            "caught_up",
            s.applied_index >= s.commit_index,
            format!(
                "applied {} of {} committed",
                s.applied_index, s.commit_index
            ),
        ),
        check(
            "disk",
            !disk.alarm,
            format!("{} bytes free", disk.free_bytes),
        ),
        check(
            "serving",
            !ctx.stopping.draining(),
            if ctx.stopping.draining() {
                "shutting down".to_string()
            } else {
                "accepting requests".to_string()
            },
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fresh ids are 32 lowercase hex digits, accepted as ids, and never repeat (this process's
    /// prefix, then a counter).
    #[test]
    fn fresh_request_ids_are_hex_and_unique() {
        let ids: Vec<String> = (0..1000).map(|_| new_request_id()).collect();
        for id in &ids {
            assert_eq!(id.len(), 32);
            assert!(
                id.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
            );
            assert!(acceptable_id(id));
            assert_eq!(id[..16], ids[0][..16], "one prefix per process");
        }
        let distinct: std::collections::HashSet<&String> = ids.iter().collect();
        assert_eq!(distinct.len(), ids.len());
    }
}
