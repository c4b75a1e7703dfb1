//! One error type for the HTTP edge, and the one table from error to status and JSON body.

use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::response::Response;
use modelforge_proto::wire::ErrorBody;
use modelforge_proto::wire::ErrorDetail;

use crate::state::Refusal;

/// An error answered to a client as `{"error": {"code", "message"}}`.
///
/// Architecture invariant: a message never contains a secret; messages are written here or
/// in `state.rs`, never copied from client input.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
    }
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }
    pub fn unauthorized(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, code, message)
    }
    pub fn forbidden(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, code, message)
    }
    pub fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, code, message)
    }
    pub fn unavailable(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, code, message)
    }
    pub fn too_large() -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            "the request body is larger than this endpoint accepts",
        )
    }
    pub fn overloaded() -> Self {
        Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            "overloaded",
            "too many requests are waiting for a secret check; retry shortly",
        )
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
    }
    /// A write that may or may not have committed: retry with the same idempotency key.
    pub fn outcome_unknown(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "outcome_unknown", message)
    }
}

impl From<Refusal> for ApiError {
    fn from(r: Refusal) -> Self {
        let status = StatusCode::from_u16(r.status).unwrap_or(StatusCode::CONFLICT);
        // Codes from the state machine are a closed set; keep them as static strings.
        let code: &'static str = match r.code.as_str() {
            "token_exists" => "token_exists",
            "enrollment_not_found" => "enrollment_not_found",
            "enrollment_claimed" => "enrollment_claimed",
            "invalid_token" => "invalid_token",
            "token_cancelled" => "token_cancelled",
            "token_expired" => "token_expired",
            "token_already_claimed" => "token_already_claimed",
            "credential_exists" => "credential_exists",
            "identity_decommissioned" => "identity_decommissioned",
            "node_id_exists" => "node_id_exists",
            "node_not_found" => "node_not_found",
            "node_decommissioned" => "node_decommissioned",
            "bad_command" => "bad_command",
            "no_capacity" => "no_capacity",
            "invalid_allocation" => "invalid_allocation",
            "allocation_not_found" => "allocation_not_found",
            "smoke_exists" => "smoke_exists",
            "smoke_not_found" => "smoke_not_found",
            "wrong_node" => "wrong_node",
            "preview_exists" => "preview_exists",
            "preview_not_found" => "preview_not_found",
            "preview_for_other_node" => "preview_for_other_node",
            "preview_used" => "preview_used",
            "preview_expired" => "preview_expired",
            "preview_stale" => "preview_stale",
            "idempotency_key_reused" => "idempotency_key_reused",
            _ => "refused",
        };
        Self {
            status,
            code,
            message: r.message,
        }
    }
}

/// How long a client answered 429 is asked to wait (`Retry-After`, in seconds): one argon2
/// worker clears dozens of checks a second, so the queue has moved on by then.
pub const RETRY_AFTER_S: u32 = 1;

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code.to_string(),
                message: self.message,
            },
        };
        let mut response = (self.status, axum::Json(body)).into_response();
        // The contract: an overloaded member answers 429 with `Retry-After`, never a queue
        // without bound.
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(RETRY_AFTER_S),
            );
        }
        response
    }
}
