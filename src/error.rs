//! One error type for the HTTP edge, and the one table from error to status and JSON body.

use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::response::Response;
use modelforge_proto::wire::ErrorBody;
use modelforge_proto::wire::ErrorDetail;

use crate::state::Refusal;
use modelforge_proto::api::ErrorCode;

/// An error answered to a client as `{"error": {"code", "message"}}`. Its status is its
/// code's (`modelforge_proto::api`, the one table of codes).
///
/// Architecture invariant: a message never contains a secret; messages are written here, in
/// the code table or in `state/`, never copied from client input.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: ErrorCode,
    pub message: String,
    /// `Retry-After` in seconds (a 429 without one gets [`RETRY_AFTER_S`]).
    pub retry_after_s: Option<u64>,
}

impl ApiError {
    /// An error with a message more specific than its code's.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::from_u16(code.status())
                .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            code,
            message: message.into(),
            retry_after_s: None,
        }
    }
    /// 429: this client's budget of failed secret checks is spent for `retry_after_s`.
    pub fn budget_spent(retry_after_s: u64) -> Self {
        Self {
            retry_after_s: Some(retry_after_s),
            ..Self::of(ErrorCode::TooManyFailedChecks)
        }
    }
    /// Shed by admission control.
    pub fn over_capacity(retry_after_s: u64) -> Self {
        Self {
            retry_after_s: Some(retry_after_s),
            ..Self::of(ErrorCode::OverCapacity)
        }
    }
    /// A node's replicated-write rate is spent.
    pub fn writes_spent(retry_after_s: u64) -> Self {
        Self {
            retry_after_s: Some(retry_after_s),
            ..Self::of(ErrorCode::TooManyWrites)
        }
    }
    /// An error with its code's own message.
    pub fn of(code: ErrorCode) -> Self {
        Self::new(code, code.message())
    }
    pub fn too_large() -> Self {
        Self::of(ErrorCode::BodyTooLarge)
    }
    pub fn overloaded() -> Self {
        Self::of(ErrorCode::Overloaded)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Internal, message)
    }
    /// A write that may or may not have committed: retry with the same idempotency key.
    pub fn outcome_unknown(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::OutcomeUnknown, message)
    }
}

impl From<Refusal> for ApiError {
    fn from(r: Refusal) -> Self {
        Self::new(r.code, r.message)
    }
}

/// How long a client answered 429 is asked to wait (`Retry-After`, in seconds): one argon2
/// worker clears dozens of checks a second, so the queue has moved on by then.
pub const RETRY_AFTER_S: u32 = 1;

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code.as_str().to_string(),
                message: self.message,
                request_id: crate::server::observe::current_request_id(),
            },
        };
        let mut response = (self.status, axum::Json(body)).into_response();
        // The contract: an overloaded member answers 429 with `Retry-After`, never a queue
        // without bound.
        let retry_after = match self.retry_after_s {
            Some(s) => Some(s),
            None if self.status == StatusCode::TOO_MANY_REQUESTS => Some(RETRY_AFTER_S.into()),
            None => None,
        };
        if let Some(s) = retry_after {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(s),
            );
        }
        response
    }
}
