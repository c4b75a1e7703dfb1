//! `GET /api/v1/admin/backup`: a consistent backup taken online from any member.
//!
//! The member confirms with the leader that it has applied everything committed when the
//! request arrived (read index: works on followers, so a backup need not load the leader),
//! encodes its state at that index off the async executor, audits the backup through
//! consensus, and streams the file with its length (the CLI shows progress from it).

use axum::extract::State;
use axum::http::HeaderMap;
use axum::http::HeaderValue;
use axum::http::header;
use axum::response::IntoResponse;
use axum::response::Response;

use super::Shared;
use super::extract::ClientAddr;
use super::extract::Need;
use super::extract::authorize;
use crate::error::ApiError;
use crate::state::Command;

#[utoipa::path(
    get,
    path = "/api/v1/admin/backup",
    tag = "cluster",
    summary = "A consistent, checksummed backup of the replicated state",
    responses((status = 200, description = "The backup file", content_type = "application/octet-stream", body = Vec<u8>), super::openapi::Refusals),
    security(("admin_token" = []))
)]
pub async fn backup(
    State(ctx): State<Shared>,
    client: ClientAddr,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let op = authorize(&ctx, &headers, client, Need::Manage).await?;
    ctx.read_anywhere().await?;
    let c = ctx.clone();
    let (bytes, index, digest) = tokio::task::spawn_blocking(move || {
        let s = c.app.read();
        let bytes = crate::backup::encode(
            &s,
            &c.cluster_id,
            c.cfg.node_id,
            modelforge_proto::now_ms(),
            secrecy::ExposeSecret::expose_secret(&c.cfg.cluster_secret),
        );
        let digest = s.digest();
        (bytes, s.last_applied_index, digest)
    })
    .await
    .map_err(|_| ApiError::internal("encoding the backup failed"))?;
    let cmd = Command::RecordBackup {
        member: ctx.cfg.node_id,
        applied_index: index,
        state_digest: digest,
    };
    ctx.propose(&op.name, modelforge_proto::new_uuid(), cmd)
        .await?;
    tracing::info!(applied_index = index, bytes = bytes.len(), "backup taken");
    let mut resp = bytes.into_response();
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(
        "x-modelforge-backup-index",
        HeaderValue::from_str(&index.to_string()).expect("digits"),
    );
    Ok(resp)
}
