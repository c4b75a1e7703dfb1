//! Named operators: `POST/GET /api/v1/admin/tokens`, `DELETE /api/v1/admin/tokens/{name}`.
//! Only the SHA-256 of a token's secret is replicated; the plaintext is answered once. See
//! ARCHITECTURE "Operators and roles".

use super::extract::Path;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::response::Response;
use modelforge_proto::api;
use modelforge_proto::api::ErrorCode;
use modelforge_proto::api::Role;
use modelforge_proto::rfc3339_ms;
use modelforge_proto::secret::Secret;
use modelforge_proto::secret::SecretKind;

use super::Shared;
use super::admin::optional_reason;
use super::extract::ClientAddr;
use super::extract::JsonBody;
use super::extract::Need;
use super::extract::authorize;
use super::extract::request_id;
use crate::error::ApiError;
use crate::state::Command;
use crate::state::Outcome;
use crate::state::operators::OPERATORS_MAX;
use crate::state::operators::valid_name;

fn check_name(name: &str) -> Result<(), ApiError> {
    if name == "root" {
        return Err(ApiError::of(ErrorCode::RootTokenFixed));
    }
    if !valid_name(name) {
        return Err(ApiError::of(ErrorCode::InvalidOperatorName));
    }
    Ok(())
}

/// `POST /api/v1/admin/tokens {"name", "role", "reason"?}` 201 `{"name", "role", "token",
/// "created_at"}`: the token is shown here once.
#[utoipa::path(
    post,
    path = "/api/v1/admin/tokens",
    operation_id = "create_token",
    tag = "operators",
    summary = "Create a named admin token (shown once)",
    request_body = modelforge_proto::api::CreateOperatorToken,
    responses((status = 201, description = "The token, shown this once", body = modelforge_proto::api::OperatorTokenCreated), super::openapi::WriteRefusals),
    security(("admin_token" = []))
)]
pub async fn create(
    State(ctx): State<Shared>,
    client: ClientAddr,
    headers: HeaderMap,
    JsonBody(req): JsonBody<api::CreateOperatorToken>,
) -> Result<Response, ApiError> {
    let op = authorize(&ctx, &headers, client, Need::Manage).await?;
    if req.name == "root" || !valid_name(&req.name) {
        return Err(ApiError::of(ErrorCode::InvalidOperatorName));
    }
    let reason = optional_reason(req.reason)?;
    // Refused before proposing (a bad request changes nothing); apply decides again.
    ctx.linearize().await?;
    {
        let s = ctx.app.read();
        if s.operators.contains_key(&req.name) {
            return Err(ApiError::of(ErrorCode::OperatorExists));
        }
        if s.operators.len() >= OPERATORS_MAX {
            return Err(ApiError::of(ErrorCode::TooManyOperators));
        }
    }
    let token = Secret::generate(SecretKind::OperatorToken);
    let hash = ctx.hasher.hash(token.expose().to_string()).await?;
    let cmd = Command::CreateOperator {
        name: req.name.clone(),
        role: req.role,
        token_id: token.id().to_string(),
        hash,
        reason,
    };
    // No Idempotency-Key: a retry could not show the token again. A write whose outcome is
    // unknown is retried by the operator; a 409 then says the first one landed (delete it).
    match ctx
        .propose(&op.name, modelforge_proto::new_uuid(), cmd)
        .await?
    {
        Outcome::OperatorCreated {
            name,
            created_at_ms,
        } => {
            tracing::info!(operator = %name, role = req.role.as_str(), by = %op.name, "operator token created");
            Ok((
                StatusCode::CREATED,
                axum::Json(api::OperatorTokenCreated {
                    name,
                    role: req.role,
                    token: token.expose().to_string(),
                    created_at: rfc3339_ms(created_at_ms),
                }),
            )
                .into_response())
        }
        other => Err(ApiError::internal(format!("unexpected answer: {other:?}"))),
    }
}

/// `GET /api/v1/admin/tokens`: names, roles, creators; never a secret or its hash.
#[utoipa::path(
    get,
    path = "/api/v1/admin/tokens",
    operation_id = "list_tokens",
    tag = "operators",
    summary = "List the named admin tokens (never a secret)",
    responses((status = 200, description = "The tokens", body = modelforge_proto::api::OperatorList), super::openapi::Refusals),
    security(("admin_token" = []))
)]
pub async fn list(
    State(ctx): State<Shared>,
    client: ClientAddr,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    authorize(&ctx, &headers, client, Need::Manage).await?;
    ctx.linearize().await?;
    let s = ctx.app.read();
    let mut tokens = vec![api::OperatorView {
        name: "root".to_string(),
        role: Role::Admin,
        created_at: None,
        created_by: None,
        builtin: true,
    }];
    tokens.extend(s.operators.values().map(|o| api::OperatorView {
        name: o.name.clone(),
        role: o.role,
        created_at: Some(rfc3339_ms(o.created_at_ms)),
        created_by: Some(o.created_by.clone()),
        builtin: false,
    }));
    Ok(axum::Json(api::OperatorList { tokens }).into_response())
}

/// `DELETE /api/v1/admin/tokens/{name}` `{"reason"?}`: when it returns, no member accepts the
/// token (every member looks a named token up only after a linearized read).
#[utoipa::path(
    delete,
    path = "/api/v1/admin/tokens/{name}",
    operation_id = "delete_token",
    tag = "operators",
    summary = "Delete a named admin token",
    params(("name" = String, Path, description = "The token's name"), ("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 200, description = "Makes a retry return the first answer instead of acting twice (1 to 200 characters)")),
    request_body = Option<modelforge_proto::api::ReasonRequest>,
    responses((status = 200, description = "Deleted: no member accepts it any more", body = modelforge_proto::api::OperatorDeleted), super::openapi::WriteRefusals),
    security(("admin_token" = []))
)]
pub async fn delete(
    State(ctx): State<Shared>,
    client: ClientAddr,
    headers: HeaderMap,
    Path(name): Path<String>,
    JsonBody(body): JsonBody<api::ReasonRequest>,
) -> Result<Response, ApiError> {
    let op = authorize(&ctx, &headers, client, Need::Manage).await?;
    check_name(&name)?;
    let reason = optional_reason(body.reason)?;
    let rid = request_id(&headers, &format!("admin operator.delete {name}"), &reason)?;
    ctx.linearize().await?;
    if !ctx.app.read().operators.contains_key(&name) {
        return Err(ApiError::of(ErrorCode::OperatorNotFound));
    }
    match ctx
        .propose(
            &op.name,
            rid,
            Command::DeleteOperator {
                name: name.clone(),
                reason,
            },
        )
        .await?
    {
        Outcome::OperatorDeleted { name } => {
            tracing::info!(operator = %name, by = %op.name, "operator token deleted");
            Ok(axum::Json(api::OperatorDeleted {
                name,
                deleted: true,
            })
            .into_response())
        }
        other => Err(ApiError::internal(format!("unexpected answer: {other:?}"))),
    }
}
