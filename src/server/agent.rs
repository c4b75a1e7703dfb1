//! The agent API: enrolment, heartbeats, inventory.
//!
//! Life of a heartbeat (on the leader): parse the credential's format (garbage is refused
//! before any lookup) -> confirm leadership by lease (a cut-off old leader answers 503, never
//! 200) -> find the one credential row by its public id -> refuse if revoked -> check the
//! secret: the verified cache (SHA-256 of the secret that last passed argon2) or, on a miss,
//! one argon2 verify on the bounded pool -> 403 if the credential is another node's -> record
//! liveness and telemetry in memory -> the first use of a credential is written through Raft
//! before the 200 (it spends the token's claim); later uses are written coalesced.

use super::extract::Path;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::response::Response;
use modelforge_proto::identity;
use modelforge_proto::now_ms;
use modelforge_proto::rfc3339_ms;
use modelforge_proto::secret::Secret;
use modelforge_proto::secret::SecretKind;
use modelforge_proto::wire::EnrollRequest;
use modelforge_proto::wire::EnrollResponse;
use modelforge_proto::wire::HeartbeatResponse;
use modelforge_proto::wire::Inventory;
use modelforge_proto::wire::Job;
use modelforge_proto::wire::SmokeReport;
use modelforge_proto::wire::Telemetry;

use super::Shared;
use super::budget;
use super::extract::ClientAddr;
use super::extract::JsonBody;
use super::extract::bearer;
use super::extract::parse_id;
use crate::app::Cached;
use crate::error::ApiError;
use crate::state::Command;
use crate::state::Outcome;
use crate::state::inventory_digest;
use modelforge_proto::api;
use modelforge_proto::api::ErrorCode;
use modelforge_proto::ids::CredentialId;
use modelforge_proto::ids::NodeId;
use modelforge_proto::ids::SmokeId;
use modelforge_proto::ids::TokenId;

const MAX_ACCELERATORS: usize = 256;
const MAX_STORAGE_ROOTS: usize = 64;
const MAX_FIELD_LEN: usize = 512;

fn check_inventory(inv: &Inventory) -> Result<(), ApiError> {
    let bad = |m: &str| Err(ApiError::new(ErrorCode::InvalidInventory, m.to_string()));
    if inv.accelerators.len() > MAX_ACCELERATORS {
        return bad("too many accelerators");
    }
    if inv.storage_roots.len() > MAX_STORAGE_ROOTS {
        return bad("too many storage roots");
    }
    let long = |s: Option<&str>| s.is_some_and(|s| s.len() > MAX_FIELD_LEN);
    for a in &inv.accelerators {
        if a.uuid.is_empty()
            || a.uuid.len() > MAX_FIELD_LEN
            || a.name.len() > MAX_FIELD_LEN
            || long(a.pci_bus_id.as_deref())
            || long(a.mig_mode.as_deref())
            || long(a.compute_capability.as_deref())
        {
            return bad("an accelerator needs a uuid, and its fields must be under 512 bytes");
        }
    }
    for r in &inv.storage_roots {
        if r.path.is_empty() || r.path.len() > MAX_FIELD_LEN {
            return bad("a storage root needs a path under 512 bytes");
        }
    }
    if long(inv.driver_version.as_deref())
        || long(inv.cuda_version.as_deref())
        || long(inv.nvml.as_deref())
    {
        return bad("inventory fields must be under 512 bytes");
    }
    // Control characters (terminal escapes, newlines) would reach operators' terminals and
    // logs through the CLI and the audit trail: refused, never stored.
    let strings = inv
        .accelerators
        .iter()
        .flat_map(|a| {
            [
                Some(a.uuid.as_str()),
                Some(&*a.name),
                a.pci_bus_id.as_deref(),
                a.mig_mode.as_deref(),
                a.compute_capability.as_deref(),
            ]
        })
        .chain(inv.storage_roots.iter().map(|r| Some(r.path.as_str())))
        .chain([
            inv.driver_version.as_deref(),
            inv.cuda_version.as_deref(),
            inv.nvml.as_deref(),
        ])
        .flatten();
    for s in strings {
        if s.chars().any(char::is_control) {
            return bad("inventory strings must not contain control characters");
        }
    }
    Ok(())
}

/// Claim the failed-check budgets of `keys` before an argon2 verification: 429
/// `too_many_failed_checks` with `Retry-After` when one is spent (see `budget`).
pub(super) fn reserve_check(
    ctx: &super::Ctx,
    keys: Vec<budget::Key>,
) -> Result<budget::Reservation<'_>, ApiError> {
    ctx.budgets.reserve(keys).map_err(|wait_s| {
        ctx.checks
            .refused_by_budget
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        ApiError::budget_spent(wait_s)
    })
}

/// `POST /api/v1/agent/enroll`.
///
/// Life of an enrolment: validate the body (hostname, inventory, token format) -> verify the
/// identity proof (Ed25519 over token id, hostname, key, time) -> confirm leadership -> find
/// the token row by its public id and refuse early if it cannot succeed -> argon2-verify the
/// token -> mint a credential and argon2-hash it -> propose `Enroll`, which decides
/// atomically in apply (claim, node id, revocation of older credentials, audit) -> 201.
#[utoipa::path(
    post,
    path = "/api/v1/agent/enroll",
    tag = "agent",
    summary = "Enrol with a one-time token",
    request_body = modelforge_proto::wire::EnrollRequest,
    responses((status = 201, description = "The node id and its credential", body = modelforge_proto::wire::EnrollResponse), super::openapi::WriteRefusals)
)]
pub async fn enroll(
    State(ctx): State<Shared>,
    client: ClientAddr,
    JsonBody(req): JsonBody<EnrollRequest>,
) -> Result<Response, ApiError> {
    if !modelforge_proto::valid_hostname(&req.hostname) {
        return Err(ApiError::new(
            ErrorCode::InvalidHostname,
            "hostname must be 1 to 253 letters, digits, '-', '_' or '.'",
        ));
    }
    check_inventory(&req.inventory)?;
    let token = Secret::parse(SecretKind::EnrollmentToken, &req.token).map_err(|e| {
        ApiError::new(
            ErrorCode::InvalidToken,
            format!("the enrolment token is malformed: {e}"),
        )
    })?;
    identity::verify(&req.identity, token.id(), &req.hostname, now_ms())
        .map_err(|e| ApiError::new(ErrorCode::InvalidIdentityProof, e.to_string()))?;
    ctx.linearize().await?;
    // The same check apply makes, asked before the argon2 verify (apply decides again).
    let hash = {
        let s = ctx.app.read();
        match s.check_claim(
            &TokenId::from(token.id()),
            &req.identity.public_key,
            req.identity.signed_at_ms,
            now_ms(),
        ) {
            Ok(t) => t.hash.clone(),
            Err(refusal) => {
                let e = ApiError::from(refusal);
                tracing::info!(
                    enrollment_id = token.id(),
                    code = e.code.as_str(),
                    "enrolment refused"
                );
                return Err(e);
            }
        }
    };
    let keys = vec![
        budget::Key::Client(client.0),
        budget::Key::Token(token.id().to_string(), client.0),
    ];
    let reservation = reserve_check(&ctx, keys)?;
    if !ctx
        .hasher
        .verify_marking(hash, token.expose().to_string(), &reservation.started)
        .await?
    {
        // Dropping the reservation of a verify that ran charges one failed check.
        tracing::info!(
            enrollment_id = token.id(),
            "enrolment refused: token secret does not match"
        );
        return Err(ApiError::new(
            ErrorCode::InvalidToken,
            "the enrolment token is not valid",
        ));
    }
    reservation.passed();
    let (credential, credential_hash) = ctx.mint.mint(&ctx.hasher).await?;
    let cmd = Command::Enroll {
        token_id: TokenId::from(token.id()),
        public_key: req.identity.public_key.clone(),
        hostname: req.hostname.clone(),
        inventory: req.inventory.clone(),
        new_node_id: NodeId::random(),
        credential_id: CredentialId::from(credential.id()),
        credential_hash,
        proof_signed_at_ms: req.identity.signed_at_ms,
    };
    let actor = format!(
        "agent:{}",
        &req.identity.public_key[..16.min(req.identity.public_key.len())]
    );
    match ctx
        .propose(&actor, modelforge_proto::new_uuid(), cmd)
        .await?
    {
        Outcome::Enrolled {
            node_id,
            credential_id,
            reenrolled,
        } => {
            tracing::info!(
                node_id = %node_id,
                credential_id = %credential_id,
                reenrolled,
                enrollment_id = token.id(),
                "node enrolled"
            );
            let body = EnrollResponse {
                node_id,
                credential: credential.expose().to_string(),
                credential_id,
                reenrolled,
            };
            Ok((StatusCode::CREATED, axum::Json(body)).into_response())
        }
        other => Err(ApiError::internal(format!(
            "unexpected answer to an enrolment: {other:?}"
        ))),
    }
}

/// Authenticate an agent request for `node_id`; on refusal the node shows it in `last_refusal`.
async fn authenticate(
    ctx: &Shared,
    node_id: &str,
    headers: &HeaderMap,
    client: ClientAddr,
) -> Result<(NodeId, CredentialId), ApiError> {
    let node_id: NodeId = parse_id("node_id", node_id)?;
    // Credentials minted ahead yield the CPU while agents are being served.
    ctx.mint.note_foreground(now_ms());
    let result = authenticate_inner(ctx, &node_id, headers, client).await;
    if let Err(e) = &result
        && matches!(e.status, StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN)
    {
        // The shard keeps it only for nodes that exist; never a replicated write per refusal.
        let refusal = crate::supervisor::Refusal {
            status: e.status.as_u16(),
            code: e.code.as_str(),
            at_ms: now_ms(),
            credential_of_this_node: proven_of(ctx, &node_id, headers),
        };
        ctx.live.sup.refused(&node_id, refusal);
        tracing::debug!(node_id = %node_id, code = e.code.as_str(), "agent request refused");
    }
    result.map(|credential_id| (node_id, credential_id))
}

/// Whether the credential in `headers` is `node_id`'s and its secret is the one that last
/// passed argon2 (a refused credential is revoked, so this asks the cache, never argon2).
fn proven_of(ctx: &Shared, node_id: &NodeId, headers: &HeaderMap) -> bool {
    let Some(secret) = bearer(headers)
        .ok()
        .and_then(|p| Secret::parse(SecretKind::NodeCredential, p).ok())
    else {
        return false;
    };
    let ours = ctx
        .app
        .read()
        .credentials
        .get(secret.id())
        .is_some_and(|c| c.node_id == *node_id);
    ours && ctx.app.cached(secret.id(), &secret.fast_digest()) == Cached::Match
}

async fn authenticate_inner(
    ctx: &Shared,
    node_id: &NodeId,
    headers: &HeaderMap,
    client: ClientAddr,
) -> Result<CredentialId, ApiError> {
    let presented = bearer(headers)?;
    let secret = Secret::parse(SecretKind::NodeCredential, presented).map_err(|e| {
        ApiError::new(
            ErrorCode::InvalidCredential,
            format!("the credential is malformed: {e}"),
        )
    })?;
    ctx.linearize().await?;
    let revoked_or_missing = |ctx: &Shared| {
        let s = ctx.app.read();
        match s.credentials.get(secret.id()) {
            None => Err(ApiError::new(
                ErrorCode::InvalidCredential,
                "the credential matches no stored credential",
            )),
            Some(c)
                if c.revoked_at_ms.is_some()
                    && s.nodes
                        .get(&c.node_id)
                        .is_some_and(|n| n.decommissioned_at_ms.is_some()) =>
            {
                Err(ApiError::new(
                    ErrorCode::CredentialOfDecommissionedNode,
                    "the credential was revoked because its node was decommissioned; this identity can never enrol again",
                ))
            }
            Some(c) if c.revoked_at_ms.is_some() => Err(ApiError::new(
                ErrorCode::CredentialRevoked,
                "the credential was revoked",
            )),
            Some(c) => Ok((c.hash.clone(), c.node_id.clone())),
        }
    };
    let (hash, owner) = revoked_or_missing(ctx)?;
    let key = budget::Key::Credential(secret.id().to_string(), client.0);
    // Re-checked after a (slow) argon2 verify: a revocation may have applied meanwhile.
    let still_valid = || revoked_or_missing(ctx).map(|_| ());
    match check_secret(ctx, &secret, hash, key, client, still_valid).await? {
        Checked::Cached => {}
        Checked::Verified(digest) => ctx.note_verified(secret.id(), digest),
        Checked::Wrong => {
            return Err(ApiError::new(
                ErrorCode::InvalidCredential,
                "the credential matches no stored credential",
            ));
        }
    }
    if owner != *node_id {
        return Err(ApiError::new(
            ErrorCode::CredentialForOtherNode,
            "the credential is valid but belongs to another node",
        ));
    }
    Ok(CredentialId::from(secret.id()))
}

/// How a presented secret compared with the stored hash of its id.
pub(super) enum Checked {
    /// It is the secret that last passed argon2 for this id (the verified cache).
    Cached,
    /// argon2 verified it just now; its digest is in the cache.
    Verified([u8; 32]),
    /// It is not the id's secret.
    Wrong,
}

/// Check a presented secret (a node credential or an operator token) against `hash`, the
/// stored argon2id hash of its id. One id has one secret: the verified cache answers a known
/// digest, and refuses another without argon2. Otherwise, one check of the id at a time (a
/// second waits, then finds the first's result in the cache), charged to the failed-check
/// budgets of the client address and of `key` (429 beyond them), holding no admission slot
/// while it waits; after a verify that passed, `still_valid` re-reads the row (a revocation or
/// deletion may have applied meanwhile) before the digest is cached.
pub(super) async fn check_secret(
    ctx: &super::Ctx,
    secret: &Secret,
    hash: String,
    key: budget::Key,
    client: ClientAddr,
    still_valid: impl Fn() -> Result<(), ApiError>,
) -> Result<Checked, ApiError> {
    let relaxed = std::sync::atomic::Ordering::Relaxed;
    let digest = secret.fast_digest();
    let mut cached = ctx.app.cached(secret.id(), &digest);
    let _one_at_a_time = if cached == Cached::Unknown {
        super::edge::leave_admission();
        let guard = ctx.id_locks.lock(secret.id()).await;
        cached = ctx.app.cached(secret.id(), &digest);
        Some(guard)
    } else {
        None
    };
    match cached {
        Cached::Match => {
            ctx.checks.cache_hits.fetch_add(1, relaxed);
            Ok(Checked::Cached)
        }
        Cached::Mismatch => {
            ctx.checks.refused_by_digest.fetch_add(1, relaxed);
            Ok(Checked::Wrong)
        }
        Cached::Unknown => {
            let reservation = reserve_check(ctx, vec![budget::Key::Client(client.0), key])?;
            if !ctx
                .hasher
                .verify_check_marking(hash, secret.expose().to_string(), &reservation.started)
                .await?
            {
                // Dropping the reservation of a verify that ran charges one failed check.
                return Ok(Checked::Wrong);
            }
            reservation.passed();
            still_valid()?;
            ctx.app.remember_verified(secret.id(), digest);
            Ok(Checked::Verified(digest))
        }
    }
}

/// Note a use of `credential_id`: the first is replicated before answering, later ones coalesced.
async fn record_use(ctx: &Shared, credential_id: &CredentialId) -> Result<(), ApiError> {
    let now = now_ms();
    let first = ctx
        .app
        .read()
        .credentials
        .get(credential_id)
        .is_some_and(|c| c.last_used_at_ms.is_none());
    if first {
        let cmd = Command::TouchCredentials {
            uses: vec![(credential_id.clone(), now)],
        };
        ctx.propose("system", format!("first-use-{credential_id}"), cmd)
            .await?;
    } else {
        ctx.live.note_use(credential_id, now);
    }
    Ok(())
}

/// `POST /api/v1/agent/nodes/{node_id}/heartbeat`.
#[utoipa::path(
    post,
    path = "/api/v1/agent/nodes/{node_id}/heartbeat",
    tag = "agent",
    summary = "Heartbeat with telemetry (`{}` is valid)",
    params(("node_id" = modelforge_proto::api::NodeId, Path, description = "The node's id")),
    request_body = Option<modelforge_proto::wire::Telemetry>,
    responses((status = 200, description = "Acknowledged, with any jobs", body = modelforge_proto::wire::HeartbeatResponse), super::openapi::Refusals),
    security(("agent_credential" = []))
)]
pub async fn heartbeat(
    State(ctx): State<Shared>,
    Path(node_id): Path<String>,
    headers: HeaderMap,
    client: ClientAddr,
    JsonBody(telemetry): JsonBody<Telemetry>,
) -> Result<Response, ApiError> {
    heartbeat_core(&ctx, &node_id, &headers, client, telemetry).await
}

/// A heartbeat, sent to this member directly or relayed in a batch (`relay_batch`).
pub(super) async fn heartbeat_core(
    ctx: &Shared,
    node_id: &str,
    headers: &HeaderMap,
    client: ClientAddr,
    telemetry: Telemetry,
) -> Result<Response, ApiError> {
    let (node_id, credential_id) = authenticate(ctx, node_id, headers, client).await?;
    record_use(ctx, &credential_id).await?;
    let now = now_ms();
    // A heartbeat that names accelerators is a fresh hardware report.
    let report = telemetry.accelerators.iter().any(|a| a.uuid.is_some());
    ctx.live.sup.heartbeat(
        &node_id,
        now,
        crate::supervisor::encode_sample(&telemetry),
        report,
    );
    if report {
        super::scheduler::reconcile_after_report(ctx, &node_id, &telemetry);
        super::cordon::health_after_report(ctx, &node_id, &telemetry);
    }
    let jobs = {
        let s = ctx.app.read();
        s.sched
            .pending_smoke(&node_id)
            .map(|smoke| {
                let expected_uuids = s
                    .nodes
                    .get(&node_id)
                    .map(|n| {
                        n.inventory
                            .accelerators
                            .iter()
                            .map(|a| a.uuid.clone())
                            .collect()
                    })
                    .unwrap_or_default();
                vec![Job::Smoke {
                    smoke_id: smoke.smoke_id.clone(),
                    expected_uuids,
                }]
            })
            .unwrap_or_default()
    };
    let body = HeartbeatResponse {
        status: "ok".into(),
        node_id,
        server_time: rfc3339_ms(now),
        jobs,
    };
    Ok(axum::Json(body).into_response())
}

/// `POST /api/v1/agent/nodes/{node_id}/smoke/{smoke_id}`: the agent's smoke report.
#[utoipa::path(
    post,
    path = "/api/v1/agent/nodes/{node_id}/smoke/{smoke_id}",
    tag = "agent",
    summary = "Report a capability smoke",
    params(("node_id" = modelforge_proto::api::NodeId, Path, description = "The node's id"), ("smoke_id" = modelforge_proto::api::SmokeId, Path, description = "The smoke's id")),
    request_body = modelforge_proto::wire::SmokeReport,
    responses((status = 200, description = "The verdict", body = modelforge_proto::api::SmokeVerdict), super::openapi::WriteRefusals),
    security(("agent_credential" = []))
)]
pub async fn smoke_report(
    State(ctx): State<Shared>,
    Path((node_id, smoke_id)): Path<(String, String)>,
    headers: HeaderMap,
    client: ClientAddr,
    JsonBody(report): JsonBody<SmokeReport>,
) -> Result<Response, ApiError> {
    let (node_id, credential_id) = authenticate(&ctx, &node_id, &headers, client).await?;
    let smoke_id: SmokeId = parse_id("smoke_id", &smoke_id)?;
    if report.checks.is_empty() || report.checks.len() > 1024 {
        return Err(ApiError::new(
            ErrorCode::InvalidSmokeReport,
            "a smoke report has 1 to 1024 checks",
        ));
    }
    if report
        .checks
        .iter()
        .any(|c| c.name.is_empty() || c.name.len() > MAX_FIELD_LEN || c.detail.len() > 4096)
    {
        return Err(ApiError::new(
            ErrorCode::InvalidSmokeReport,
            "a check needs a name under 512 bytes and a detail under 4096",
        ));
    }
    // Decided before proposing (authenticate linearized the read), so that a node naming
    // unknown, other nodes' or finished smokes writes nothing: a finished smoke answers its
    // verdict again, as apply would.
    {
        let s = ctx.app.read();
        match s.sched.smokes.get(&smoke_id) {
            None => return Err(ApiError::of(ErrorCode::SmokeNotFound)),
            Some(smoke) if smoke.node_id != node_id => {
                return Err(ApiError::of(ErrorCode::WrongNode));
            }
            Some(smoke) if smoke.state != api::SmokeState::Pending => {
                let passed = smoke.state == api::SmokeState::Passed;
                return Ok(axum::Json(api::SmokeVerdict { passed }).into_response());
            }
            Some(_) => {}
        }
    }
    record_use(&ctx, &credential_id).await?;
    let cmd = Command::SmokeResult {
        smoke_id,
        node_id: node_id.clone(),
        checks: report
            .checks
            .into_iter()
            .map(|c| crate::state::sched::SmokeCheck {
                name: c.name,
                ok: c.ok,
                detail: c.detail,
            })
            .collect(),
    };
    match ctx.propose_for_agent(&node_id, cmd).await? {
        Outcome::SmokeFinished { passed } => {
            Ok(axum::Json(api::SmokeVerdict { passed }).into_response())
        }
        other => Err(ApiError::internal(format!(
            "unexpected answer to a smoke report: {other:?}"
        ))),
    }
}

/// `PUT /api/v1/agent/nodes/{node_id}/inventory`: replicated only when it changed.
#[utoipa::path(
    put,
    path = "/api/v1/agent/nodes/{node_id}/inventory",
    operation_id = "report_inventory",
    tag = "agent",
    summary = "Report the node's inventory",
    params(("node_id" = modelforge_proto::api::NodeId, Path, description = "The node's id")),
    request_body = modelforge_proto::wire::Inventory,
    responses((status = 200, description = "Whether it changed", body = modelforge_proto::api::InventoryChanged), super::openapi::WriteRefusals),
    security(("agent_credential" = []))
)]
pub async fn inventory(
    State(ctx): State<Shared>,
    Path(node_id): Path<String>,
    headers: HeaderMap,
    client: ClientAddr,
    JsonBody(inv): JsonBody<Inventory>,
) -> Result<Response, ApiError> {
    let (node_id, credential_id) = authenticate(&ctx, &node_id, &headers, client).await?;
    check_inventory(&inv)?;
    record_use(&ctx, &credential_id).await?;
    ctx.live.sup.report(&node_id, now_ms());
    let unchanged = ctx
        .app
        .read()
        .nodes
        .get(&node_id)
        .is_some_and(|n| n.inventory_digest == inventory_digest(&inv));
    if unchanged {
        return Ok(axum::Json(api::InventoryChanged { changed: false }).into_response());
    }
    let cmd = Command::UpdateInventory {
        node_id: node_id.clone(),
        inventory: inv,
    };
    match ctx.propose_for_agent(&node_id, cmd).await? {
        Outcome::InventoryUpdated { changed } => {
            Ok(axum::Json(api::InventoryChanged { changed }).into_response())
        }
        other => Err(ApiError::internal(format!(
            "unexpected answer to an inventory update: {other:?}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::check_inventory;
    use modelforge_proto::wire::Inventory;

    /// An agent's inventory strings reach operators' terminals (CLI, labels, audit): every
    /// one of them, the compute capability included, is refused with a control character or
    /// past 512 bytes.
    #[test]
    fn every_inventory_string_is_checked_for_control_characters_and_length() {
        let good = modelforge_devkit::h200_inventory(2);
        assert!(check_inventory(&good).is_ok());
        type Set = fn(&mut Inventory, &str);
        let setters: [(&str, Set); 9] = [
            ("uuid", |i, v| i.accelerators[1].uuid = v.into()),
            ("name", |i, v| i.accelerators[1].name = v.into()),
            ("pci_bus_id", |i, v| {
                i.accelerators[1].pci_bus_id = Some(v.into())
            }),
            ("mig_mode", |i, v| {
                i.accelerators[1].mig_mode = Some(v.into())
            }),
            ("compute_capability", |i, v| {
                i.accelerators[1].compute_capability = Some(v.into())
            }),
            ("storage path", |i, v| i.storage_roots[0].path = v.into()),
            ("driver_version", |i, v| i.driver_version = Some(v.into())),
            ("cuda_version", |i, v| i.cuda_version = Some(v.into())),
            ("nvml", |i, v| i.nvml = Some(v.into())),
        ];
        for (field, set) in setters {
            for bad in ["9.0\u{1b}[2J".to_string(), "x".repeat(513)] {
                let mut inv = good.clone();
                set(&mut inv, &bad);
                assert!(
                    check_inventory(&inv).is_err(),
                    "{field} = {bad:?} was accepted"
                );
            }
        }
    }
}
