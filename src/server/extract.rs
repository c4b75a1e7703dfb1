//! Request parsing at the edge: JSON bodies with the contract's errors, bearer secrets, ids.

use axum::extract::FromRequest;
use axum::extract::Request;
use axum::http::HeaderMap;
use axum::http::StatusCode;
use serde::de::DeserializeOwned;

use super::Ctx;
use crate::error::ApiError;
use crate::secrets;
use modelforge_proto::api::ErrorCode;
use modelforge_proto::ids::Id;
use modelforge_proto::ids::NodeId;

/// The header in which a member relaying a request names the client it came from.
pub const CLIENT_HEADER: &str = "x-modelforge-client";

/// The address a request came from: the connection's, or, on a connection that presented a
/// member's certificate (a relay), the client the relaying member names. Without TLS a relay
/// cannot be told from a client, so relayed requests count against the relaying member's
/// address (see ARCHITECTURE "Budgets of failed secret checks").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientAddr(pub std::net::IpAddr);

impl ClientAddr {
    pub fn of(extensions: &axum::http::Extensions, headers: &HeaderMap) -> Self {
        let conn = extensions.get::<axum::extract::ConnectInfo<crate::tls::ConnPeer>>();
        let remote = conn
            .map(|c| c.0.remote.ip())
            .unwrap_or(std::net::IpAddr::from([0, 0, 0, 0]));
        let named = conn
            .filter(|c| c.0.member.is_some())
            .and_then(|_| headers.get(CLIENT_HEADER))
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        ClientAddr(named.unwrap_or(remote))
    }
}

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for ClientAddr {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _state: &S,
    ) -> Result<Self, Self::Rejection> {
        Ok(Self::of(&parts.extensions, &parts.headers))
    }
}

/// A JSON body. An empty body reads as `{}`. Errors never echo the input (it may hold a
/// secret): a data error names the position, a missing field names the field.
pub struct JsonBody<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let bytes = axum::body::Bytes::from_request(req, state)
            .await
            .map_err(|e| {
                if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                    ApiError::too_large()
                } else {
                    ApiError::new(
                        ErrorCode::UnreadableBody,
                        "the request body could not be read",
                    )
                }
            })?;
        let bytes: &[u8] = if bytes.iter().all(|b| b.is_ascii_whitespace()) {
            b"{}"
        } else {
            &bytes
        };
        serde_json::from_slice(bytes).map(JsonBody).map_err(|e| {
            let msg = e.to_string();
            let what = match e.classify() {
                serde_json::error::Category::Syntax
                | serde_json::error::Category::Eof
                | serde_json::error::Category::Io => {
                    "the request body is not valid JSON".to_string()
                }
                serde_json::error::Category::Data if msg.starts_with("missing field") => {
                    format!(
                        "the request body {}",
                        msg.split(" at line").next().unwrap_or("is missing a field")
                    )
                }
                serde_json::error::Category::Data => {
                    "a field of the request body has the wrong type or value".to_string()
                }
            };
            let code = if matches!(e.classify(), serde_json::error::Category::Data) {
                ErrorCode::InvalidBody
            } else {
                ErrorCode::InvalidJson
            };
            ApiError::new(
                code,
                format!("{what} (line {}, column {})", e.line(), e.column()),
            )
        })
    }
}

/// The bearer secret of the request, or a 401 that says what is wrong (never echoing it).
pub fn bearer(headers: &HeaderMap) -> Result<&str, ApiError> {
    let Some(v) = headers.get("authorization") else {
        return Err(ApiError::new(
            ErrorCode::Unauthenticated,
            "this endpoint needs Authorization: Bearer <secret>",
        ));
    };
    let v = v.to_str().map_err(|_| {
        ApiError::new(
            ErrorCode::Unauthenticated,
            "the Authorization header is not text",
        )
    })?;
    let (scheme, rest) = v.split_once(' ').unwrap_or((v, ""));
    if !scheme.eq_ignore_ascii_case("bearer") {
        return Err(ApiError::new(
            ErrorCode::Unauthenticated,
            "the Authorization scheme must be Bearer",
        ));
    }
    let secret = rest.trim();
    if secret.is_empty() {
        return Err(ApiError::new(
            ErrorCode::Unauthenticated,
            "the bearer secret is empty",
        ));
    }
    Ok(secret)
}

pub fn require_admin(ctx: &Ctx, headers: &HeaderMap) -> Result<(), ApiError> {
    let given = bearer(headers)?;
    if !secrets::same_secret(given, &ctx.cfg.admin_token) {
        return Err(ApiError::new(
            ErrorCode::Unauthenticated,
            "the admin token is not valid",
        ));
    }
    Ok(())
}

/// An id from a path or a body, typed. Ids are opaque but tame (`modelforge_proto::ids::is_tame`:
/// 1..=64 of `[A-Za-z0-9_-]`), so no id can carry a path.
pub fn parse_id<T: Id>(what: &'static str, id: &str) -> Result<T, ApiError> {
    T::parse(id).ok_or_else(|| {
        ApiError::new(
            ErrorCode::InvalidId,
            format!("{what} must be 1 to 64 letters, digits, '-' or '_'"),
        )
    })
}

/// The request id of a write: derived from `Idempotency-Key` when given (so a retry of the
/// same logical request applies once), else fresh. `scope` names the actor, the operation and
/// its target (`admin credential.revoke <node>`), so a key reused for another operation or
/// another object is another request, never the first one's stored answer. The id is
/// `idem-<key part>.<request part>`, the request part a digest of the parsed body: apply
/// refuses a key reused with another body (`State::idempotency_key_reused`).
pub fn request_id(
    headers: &HeaderMap,
    scope: &str,
    request: &impl serde::Serialize,
) -> Result<String, ApiError> {
    use sha2::Digest;
    match headers.get("idempotency-key") {
        None => Ok(modelforge_proto::new_uuid()),
        Some(v) => {
            let key = v.to_str().map_err(|_| {
                ApiError::new(
                    ErrorCode::InvalidIdempotencyKey,
                    "Idempotency-Key must be text",
                )
            })?;
            if key.is_empty() || key.len() > 200 {
                return Err(ApiError::new(
                    ErrorCode::InvalidIdempotencyKey,
                    "Idempotency-Key must be 1 to 200 characters",
                ));
            }
            let key_part = sha2::Sha256::digest(format!("{scope}\n{key}").as_bytes());
            let body = serde_json::to_vec(request).unwrap_or_default();
            let request_part = sha2::Sha256::digest(&body);
            Ok(format!(
                "idem-{}.{}",
                modelforge_proto::hex(&key_part[..16]),
                modelforge_proto::hex(&request_part[..8])
            ))
        }
    }
}

/// "An admin asks about an existing node": the admin token, a well-formed `{node_id}` from the
/// path, a linearized read, and the node exists (nodes are never deleted, so it still does
/// when the handler reads it). Its id.
pub struct AdminNode(pub NodeId);

impl axum::extract::FromRequestParts<super::Shared> for AdminNode {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        ctx: &super::Shared,
    ) -> Result<Self, ApiError> {
        require_admin(ctx, &parts.headers)?;
        let axum::extract::Path(params) = axum::extract::Path::<
            std::collections::HashMap<String, String>,
        >::from_request_parts(parts, ctx)
        .await
        .map_err(|_| ApiError::new(ErrorCode::InvalidId, "the path does not name a node"))?;
        let node_id: NodeId = parse_id("node_id", params.get("node_id").map_or("", |s| s))?;
        ctx.linearize().await?;
        if !ctx.app.read().nodes.contains_key(&node_id) {
            return Err(ApiError::of(ErrorCode::NodeNotFound));
        }
        Ok(AdminNode(node_id))
    }
}

/// The most of an oversized body read (and dropped) before it is refused.
const DRAIN_CAP: u64 = 16 << 20;

/// A request that declares a body over the API's limit is answered 413 `body_too_large`, after
/// its body is read and dropped (up to [`DRAIN_CAP`]). Closing a connection with unread data
/// makes the kernel reset it, and the client, still sending, then loses the answer: over TLS it
/// saw no answer at all. Outermost layer of the API routes, so nothing else reads the body.
pub async fn refuse_oversized(
    axum::extract::State(ctx): axum::extract::State<super::Shared>,
    req: Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let declared = req
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    match declared {
        Some(n) if n > ctx.cfg.max_body_bytes as u64 => {
            if n <= DRAIN_CAP {
                let _ = axum::body::to_bytes(req.into_body(), DRAIN_CAP as usize).await;
            }
            ApiError::too_large().into_response()
        }
        _ => next.run(req).await,
    }
}
