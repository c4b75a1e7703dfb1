//! Forwarding: a member that is not the leader relays `/api/v1` requests to the leader.
//!
//! The caller's own `Authorization` travels unchanged; the leader authenticates it as usual.
//! A hop counter (trusted only with the peer header) stops loops while leadership moves. A
//! forwarded write whose connection broke after it was sent is answered `outcome_unknown`
//! (retry with the same Idempotency-Key); one that never reached the leader is `no_leader`.

use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::extract::State;
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::IntoResponse;
use axum::response::Response;
use modelforge_raft::network::PEER_HEADER;

use super::Shared;
use crate::error::ApiError;
use crate::secrets;

const HOPS_HEADER: &str = "x-modelforge-hops";
const MAX_HOPS: u32 = 2;
/// How long a member waits for an election to finish before answering 503.
const LEADER_WAIT: Duration = Duration::from_secs(3);
const FORWARD_TIMEOUT: Duration = Duration::from_secs(15);
const FORWARDED_HEADERS: [&str; 5] = [
    "authorization",
    "content-type",
    "idempotency-key",
    "x-request-id",
    "accept",
];

pub async fn leader_gate(State(ctx): State<Shared>, req: Request, next: Next) -> Response {
    if ctx.consensus.is_leader() {
        return next.run(req).await;
    }
    let trusted = req
        .headers()
        .get(PEER_HEADER)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| secrets::same_secret(v, &ctx.peer_token));
    let hops: u32 = if trusted {
        req.headers()
            .get(HOPS_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    } else {
        0
    };
    if hops >= MAX_HOPS {
        return ApiError::unavailable("no_leader", "leadership is moving; retry shortly")
            .into_response();
    }
    let leader = if ctx
        .consensus
        .leader()
        .is_some_and(|(id, _)| id != ctx.cfg.node_id)
    {
        ctx.consensus.leader()
    } else {
        let me = ctx.cfg.node_id;
        ctx.consensus
            .wait_for(LEADER_WAIT, |s| {
                s.leader_id.is_some() && (s.leader_id != Some(me) || s.state == "Leader")
            })
            .await;
        ctx.consensus.leader()
    };
    let Some((leader_id, url)) = leader else {
        return ApiError::unavailable("no_leader", "the cluster has no leader now; retry shortly")
            .into_response();
    };
    if leader_id == ctx.cfg.node_id {
        return next.run(req).await;
    }
    let url = ctx.peer_url(leader_id, &url);
    match relay(&ctx, req, leader_id, &url, hops + 1).await {
        Ok(resp) => resp,
        Err(e) => e.into_response(),
    }
}

/// Whether resending the request after a cut connection cannot apply it twice: reads,
/// heartbeats and inventory reports (idempotent), and writes carrying an Idempotency-Key
/// (deduplicated by the state machine). Enrolment is not: a retry mints a new credential, so
/// the agent decides (its retry of the same claim lands on the same node id).
fn safe_to_resend(
    method: &axum::http::Method,
    path: &str,
    headers: &axum::http::HeaderMap,
) -> bool {
    method == axum::http::Method::GET
        || method == axum::http::Method::PUT
        || (method == axum::http::Method::POST && path.ends_with("/heartbeat"))
        || headers.contains_key("idempotency-key")
}

async fn relay(
    ctx: &Shared,
    req: Request,
    leader_id: u64,
    leader_url: &str,
    hops: u32,
) -> Result<Response, ApiError> {
    let (parts, body) = req.into_parts();
    let bytes = axum::body::to_bytes(body, ctx.cfg.max_body_bytes)
        .await
        .map_err(|_| ApiError::too_large())?;
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/")
        .to_string();
    let method = reqwest::Method::from_bytes(parts.method.as_str().as_bytes())
        .map_err(|_| ApiError::bad_request("bad_method", "unsupported method"))?;
    let resendable = safe_to_resend(&parts.method, parts.uri.path(), &parts.headers);
    let deadline = tokio::time::Instant::now() + LEADER_WAIT;
    let (mut target_id, mut target_url) = (leader_id, leader_url.to_string());
    // Whether any attempt may have reached a leader: then a write's outcome is unknown, even if
    // a later attempt could not connect at all.
    let mut maybe_sent = false;
    let unknown_or = |maybe_sent: bool, certain: ApiError| {
        if maybe_sent && method != reqwest::Method::GET {
            ApiError::outcome_unknown(
                "the leader did not answer; the request may or may not have applied (retry with the same Idempotency-Key)",
            )
        } else {
            certain
        }
    };
    loop {
        let mut out = ctx
            .http
            .request(
                method.clone(),
                format!("{}{path}", target_url.trim_end_matches('/')),
            )
            .timeout(FORWARD_TIMEOUT)
            .body(bytes.clone());
        for name in FORWARDED_HEADERS {
            if let Some(v) = parts.headers.get(name) {
                out = out.header(name, v.as_bytes());
            }
        }
        out = out
            .header(PEER_HEADER, &ctx.peer_token)
            .header(HOPS_HEADER, hops.to_string());
        let err = match out.send().await {
            Ok(resp) => return relay_answer(resp).await,
            Err(e) => e,
        };
        maybe_sent |= !err.is_connect();
        // The request certainly did not arrive (connect failed), or may be resent safely:
        // wait for leadership to move (or the leader to come back) and try again.
        if (err.is_connect() || resendable) && tokio::time::Instant::now() < deadline {
            let me = ctx.cfg.node_id;
            ctx.consensus
                .wait_for(Duration::from_millis(200), |s| {
                    s.leader_id.is_some_and(|l| l != target_id) || s.state == "Leader"
                })
                .await;
            if ctx.consensus.is_leader() && me != target_id {
                return Err(unknown_or(
                    maybe_sent,
                    ApiError::unavailable(
                        "leader_changed",
                        "this member became the leader meanwhile; retry",
                    ),
                ));
            }
            if let Some((id, url)) = ctx.consensus.leader().filter(|(id, _)| *id != me) {
                (target_id, target_url) = (id, ctx.peer_url(id, &url));
            }
            continue;
        }
        return Err(unknown_or(
            maybe_sent,
            ApiError::unavailable(
                "no_leader",
                "the leader could not be reached; retry shortly",
            ),
        ));
    }
}

async fn relay_answer(resp: reqwest::Response) -> Result<Response, ApiError> {
    let status = axum::http::StatusCode::from_u16(resp.status().as_u16())
        .unwrap_or(axum::http::StatusCode::BAD_GATEWAY);
    let ctype = resp.headers().get("content-type").cloned();
    let body = resp
        .bytes()
        .await
        .map_err(|_| ApiError::outcome_unknown("the leader's answer was cut off"))?;
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    if let Some(ct) = ctype.and_then(|v| HeaderValue::from_bytes(v.as_bytes()).ok()) {
        response.headers_mut().insert("content-type", ct);
    }
    Ok(response)
}
