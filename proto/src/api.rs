//! The vocabulary of the HTTP API shared by the control plane and its clients: every error code
//! it can answer, with its HTTP status and default message, in one table.
//!
//! Adding a refusal is one edit of the [`codes!`] table below: the enum, its wire string, its
//! status and its message are all generated from that one row, and every `match` on
//! [`ErrorCode`] is exhaustive. A code that is not in the table cannot be answered (there is
//! no "other" variant).
//!
//! The replicated state stores a refusal's code (as its wire string), never an HTTP status: the
//! status is a property of the code, decided here.

use serde::Deserialize;
use serde::Deserializer;

pub use crate::ids::AllocationId;
pub use crate::ids::AllocationState;
pub use crate::ids::CredentialId;
pub use crate::ids::HistoryKind;
pub use crate::ids::NodeId;
pub use crate::ids::NodeStatus;
pub use crate::ids::PreviewId;
pub use crate::ids::SmokeId;
pub use crate::ids::SmokeState;
pub use crate::ids::TokenId;
pub use crate::ids::TokenState;
use serde::Serialize;
use serde::Serializer;

macro_rules! codes {
    ($($(#[$doc:meta])* $variant:ident = ($wire:literal, $status:literal, $message:literal),)*) => {
        /// Every error code of the API. See the module docs.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum ErrorCode {
            $($(#[$doc])* $variant,)*
        }

        impl ErrorCode {
            /// Every code, in table order.
            pub const ALL: &'static [ErrorCode] = &[$(ErrorCode::$variant,)*];

            /// The code as the JSON error body carries it.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $(ErrorCode::$variant => $wire,)*
                }
            }

            /// The HTTP status a client is answered with.
            pub const fn status(self) -> u16 {
                match self {
                    $(ErrorCode::$variant => $status,)*
                }
            }

            /// The message used when a refusal has nothing more specific to say.
            pub const fn message(self) -> &'static str {
                match self {
                    $(ErrorCode::$variant => $message,)*
                }
            }
        }
    };
}

codes! {
    // Enrolment tokens.
    TokenExists = ("token_exists", 409, "an enrolment token with this id exists"),
    EnrollmentNotFound = ("enrollment_not_found", 404, "no enrolment token with this id"),
    EnrollmentClaimed = ("enrollment_claimed", 409, "the token was already claimed; revoke the node's credential instead"),
    InvalidToken = ("invalid_token", 401, "the enrolment token is unknown, expired, cancelled or already claimed"),
    TokenCancelled = ("token_cancelled", 401, "the enrolment token was cancelled"),
    TokenExpired = ("token_expired", 401, "the enrolment token has expired"),
    TokenAlreadyClaimed = ("token_already_claimed", 401, "the enrolment token was already claimed"),
    AlreadyCreated = ("already_created", 409, "a token was already created for this request; its plaintext was shown once and cannot be shown again"),
    // Enrolment and nodes.
    CredentialExists = ("credential_exists", 409, "credential id collision; retry"),
    IdentityDecommissioned = ("identity_decommissioned", 403, "this identity belongs to a decommissioned node and can never enrol again"),
    NodeIdExists = ("node_id_exists", 409, "node id collision; retry"),
    NodeNotFound = ("node_not_found", 404, "no node with this id"),
    /// A command on a decommissioned node.
    NodeDecommissioned = ("node_decommissioned", 409, "the node is decommissioned"),
    /// A credential refused because its node was decommissioned: the same wire code as
    /// [`ErrorCode::NodeDecommissioned`], answered 401 (a client reading it back gets that one).
    CredentialOfDecommissionedNode = ("node_decommissioned", 401, "the credential was revoked because its node was decommissioned; this identity can never enrol again"),
    InvalidIdentityProof = ("invalid_identity_proof", 401, "the identity proof does not verify"),
    // Agent credentials.
    Unauthenticated = ("unauthenticated", 401, "a credential is required"),
    InvalidCredential = ("invalid_credential", 401, "the credential is not valid"),
    CredentialRevoked = ("credential_revoked", 401, "the credential was revoked"),
    CredentialForOtherNode = ("credential_for_other_node", 403, "this credential belongs to another node"),
    // Scheduling and smokes.
    NoCapacity = ("no_capacity", 409, "nothing fits"),
    InvalidAllocation = ("invalid_allocation", 400, "no accelerator named"),
    AllocationNotFound = ("allocation_not_found", 404, "no allocation with this id"),
    SmokeExists = ("smoke_exists", 409, "a smoke with this id exists"),
    SmokeNotFound = ("smoke_not_found", 404, "no such smoke"),
    WrongNode = ("wrong_node", 403, "this smoke is for another node"),
    InvalidSmokeReport = ("invalid_smoke_report", 400, "the smoke report is not valid"),
    // Decommission.
    PreviewExists = ("preview_exists", 409, "preview id collision; retry"),
    PreviewNotFound = ("preview_not_found", 404, "no decommission preview with this id (previews expire after 15 minutes); preview again"),
    PreviewForOtherNode = ("preview_for_other_node", 409, "the preview is for another node"),
    PreviewUsed = ("preview_used", 409, "this preview was already executed"),
    PreviewExpired = ("preview_expired", 409, "the preview expired (15 minutes); preview again"),
    PreviewStale = ("preview_stale", 409, "the state changed since the preview; preview again"),
    // Request shape.
    IdempotencyKeyReused = ("idempotency_key_reused", 422, "this Idempotency-Key was already used for a different request to the same operation and target; use a new key"),
    InvalidIdempotencyKey = ("invalid_idempotency_key", 400, "the Idempotency-Key is not valid"),
    BadCommand = ("bad_command", 400, "the command does not decode"),
    BadMethod = ("bad_method", 400, "bad method"),
    InvalidJson = ("invalid_json", 400, "the request body is not valid JSON"),
    InvalidBody = ("invalid_body", 400, "a field of the request body has the wrong type or value"),
    UnreadableBody = ("unreadable_body", 400, "the request body could not be read"),
    BodyTooLarge = ("body_too_large", 413, "the request body is larger than this endpoint accepts"),
    InvalidId = ("invalid_id", 400, "the id is not valid"),
    InvalidHostname = ("invalid_hostname", 400, "the hostname is not valid"),
    InvalidInventory = ("invalid_inventory", 400, "the inventory is not valid"),
    InvalidNote = ("invalid_note", 400, "the note is not valid"),
    InvalidReason = ("invalid_reason", 400, "the reason is not valid"),
    InvalidTtl = ("invalid_ttl", 400, "the ttl is not valid"),
    InvalidSince = ("invalid_since", 400, "the since parameter is not valid"),
    InvalidQuery = ("invalid_query", 400, "the query is not valid"),
    NotFound = ("not_found", 404, "no such resource"),
    MethodNotAllowed = ("method_not_allowed", 405, "this method is not allowed here"),
    // Cluster.
    NoLeader = ("no_leader", 503, "the cluster has no leader; retry"),
    NotLeader = ("not_leader", 503, "this member is not the leader; retry"),
    LeaderChanged = ("leader_changed", 503, "the leader changed; retry"),
    NotCaughtUp = ("not_caught_up", 503, "this member has not caught up with the leader; retry"),
    RaftUnavailable = ("raft_unavailable", 503, "consensus is unavailable; retry"),
    OutcomeUnknown = ("outcome_unknown", 503, "the write may or may not have committed; retry with the same idempotency key"),
    PeerUnauthenticated = ("peer_unauthenticated", 401, "the peer is not authenticated"),
    BadPeerBody = ("bad_peer_body", 400, "the peer request does not decode"),
    Overloaded = ("overloaded", 429, "too many requests are waiting for a secret check; retry shortly"),
    TooManyFailedChecks = ("too_many_failed_checks", 429, "too many failed secret checks from this address; retry after the time given"),
    OverCapacity = ("over_capacity", 503, "this member is above capacity; retry after the time given"),
    TooManyWrites = ("too_many_writes", 429, "this node caused too many replicated writes; retry after the time given"),
    RequestTimeout = ("request_timeout", 503, "the request was not answered in time; retry"),
    DiskFull = ("disk_full", 503, "this member's disk is under its free-space reserve; writes are refused until space returns"),
    // Operators (named admin tokens).
    Forbidden = ("forbidden", 403, "this token's role does not allow this action"),
    InvalidOperatorName = ("invalid_operator_name", 400, "a token name is 1 to 64 letters, digits, '-' or '_', and not 'root' or 'system'"),
    OperatorExists = ("operator_exists", 409, "a token with this name exists"),
    OperatorNotFound = ("operator_not_found", 404, "no token with this name"),
    RootTokenFixed = ("root_token_fixed", 409, "the root token is configuration: rotate it by changing MODELFORGE_ADMIN_TOKEN or --admin-token-file on every member"),
    TooManyOperators = ("too_many_operators", 409, "the cluster holds the most named tokens it keeps (1,000); delete one first"),
    // Cluster membership.
    MemberExists = ("member_exists", 409, "this id is already a member"),
    MemberIdRetired = ("member_id_retired", 409, "this member id was removed from the cluster and can never be added again; give the new member a fresh id"),
    MemberNotFound = ("member_not_found", 404, "no member with this id"),
    LastVoter = ("last_voter", 409, "this is the cluster's last voter; add another member first"),
    CatchUpTimeout = ("catch_up_timeout", 503, "the new member did not catch up in time; it stays a learner (retry to promote it)"),
    NotAMember = ("not_a_member", 503, "this member is not part of the cluster's configuration"),
    MembershipChangeRefused = ("membership_change_refused", 409, "the membership change was refused (another one may be in progress); retry"),
    Internal = ("internal", 500, "internal error"),
}

impl ErrorCode {
    /// The code for a wire string (the first row of the table that has it).
    pub fn parse(wire: &str) -> Option<ErrorCode> {
        Self::ALL.iter().copied().find(|c| c.as_str() == wire)
    }
}

impl PartialEq<&str> for ErrorCode {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The schema of a code: one of the table's wire strings.
impl utoipa::PartialSchema for ErrorCode {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        crate::ids::names_schema(ErrorCode::ALL.iter().map(|c| c.as_str()))
    }
}

impl utoipa::ToSchema for ErrorCode {}

impl Serialize for ErrorCode {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for ErrorCode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        ErrorCode::parse(&s)
            .ok_or_else(|| serde::de::Error::custom(format!("unknown error code {s:?}")))
    }
}

/// One member of the membership, as `GET /api/v1/cluster` shows it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct ClusterMember {
    pub id: u64,
    pub url: String,
    pub voter: bool,
    /// `voter` or `learner`.
    #[serde(default)]
    pub role: String,
    /// The last log index the leader knows the member holds (null unless this member leads).
    #[serde(default)]
    pub matched_index: Option<u64>,
    /// Whether the member acknowledged the leader within the last 3 s (null unless this member
    /// leads).
    #[serde(default)]
    pub reachable: Option<bool>,
}

/// `POST /api/v1/admin/cluster/members`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AddMember {
    #[schema(minimum = 1)]
    pub id: u64,
    pub url: String,
    /// Promote to voter once caught up (default); false keeps it a learner.
    #[serde(default)]
    pub voter: Option<bool>,
}

/// The members after a change (`POST`/`DELETE /api/v1/admin/cluster/members`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct MembersView {
    pub members: Vec<ClusterMember>,
}

/// Counters of the credential check in `GET /api/v1/cluster`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct SecretChecksView {
    pub argon2_verifies: u64,
    pub cache_hits: u64,
    pub cache_entries: usize,
    pub entries_learned_from_leader: u64,
    /// Secrets refused without argon2: their digest differs from the one verified for their id.
    #[serde(default)]
    pub refused_by_digest: u64,
    /// Checks refused 429 because their client's budget of failed checks was spent.
    #[serde(default)]
    pub refused_by_budget: u64,
}

/// The free space of this member's data dir, in `GET /api/v1/cluster`: under the reserve the
/// alarm is raised and writes are refused (503 `disk_full`) until space returns.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct DiskView {
    pub free_bytes: u64,
    /// `--disk-reserve-mib` in bytes.
    pub reserve_bytes: u64,
    pub alarm: bool,
    pub alarm_since: Option<String>,
}

/// Admission control of agent requests on this member, in `GET /api/v1/cluster`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct AdmissionView {
    /// Agent requests processed at once at most (`--max-agent-requests`).
    pub limit: usize,
    pub in_flight: usize,
    /// Agent requests answered 503 `over_capacity` since start.
    pub shed: u64,
    /// The `Retry-After` (seconds) a request shed now is answered with: 1, doubled each
    /// second in which requests were shed, halved each second in which none were.
    #[serde(default)]
    pub retry_after_s: u64,
    /// How long requests that are ready wait for this member's CPU now (milliseconds).
    #[serde(default)]
    pub queue_delay_ms: f64,
    /// Agent requests are shed while `queue_delay_ms` is above this (`--shed-queue-delay`;
    /// zero: never).
    #[serde(default)]
    pub shed_queue_delay_ms: f64,
}

/// The leader's pool of credentials minted ahead, in `GET /api/v1/cluster`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct CredentialPoolView {
    pub ready: usize,
    pub minted_ahead: u64,
    pub minted_inline: u64,
}

/// `GET /api/v1/cluster`: the cluster as the answering member sees it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct ClusterView {
    pub id: u64,
    pub leader_id: Option<u64>,
    pub leader_url: Option<String>,
    pub term: u64,
    /// openraft's server state: `Leader`, `Follower`, `Candidate`, `Learner`, `Shutdown`.
    pub state: String,
    pub commit_index: u64,
    pub applied_index: u64,
    pub last_log_index: u64,
    pub snapshot_index: Option<u64>,
    pub members: Vec<ClusterMember>,
    /// "" for a cluster formed from scratch; `restored-...` for one formed from a backup.
    pub cluster_id: String,
    pub secret_checks: SecretChecksView,
    pub credential_pool: CredentialPoolView,
    #[serde(default)]
    pub admission: AdmissionView,
    #[serde(default)]
    pub observed: ObservedView,
    #[serde(default)]
    pub disk: DiskView,
    #[serde(default)]
    pub audit_archive: AuditArchiveView,
}

/// This member's audit archive against the replicated state's base: `complete` once its file
/// holds every event the state moved out (a member that installed a snapshot fills the hole
/// from the others).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct AuditArchiveView {
    /// Events the replicated state has moved to the archive.
    pub archived: u64,
    /// Events this member's archive file holds (a contiguous chain from seq 1).
    pub on_disk: u64,
    pub complete: bool,
    /// Events still in the replicated state.
    pub live: u64,
}

/// What this member holds of the leader's live view of the nodes (memory only): it seeds the
/// member's view if it becomes leader, so refusals and telemetry survive a failover.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct ObservedView {
    pub nodes: usize,
    pub refusals: usize,
    pub telemetry_samples: usize,
    pub learned_from_leader: u64,
}

/// `GET /api/v1/cluster/state-digest`: a digest of the member's applied state.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct StateDigest {
    pub digest: String,
    pub applied_index: u64,
}

// ---- Health and the peer endpoints.

/// `GET /healthz`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct Health {
    pub status: String,
}

/// `GET /readyz` (200 when ready, 503 otherwise).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct Readiness {
    pub ready: bool,
    pub leader_id: Option<u64>,
    pub commit_index: u64,
    pub applied_index: u64,
    /// Each check (`leader`, `caught_up`, `disk`, `serving`); ready when every one is ok.
    #[serde(default)]
    pub checks: Vec<ReadinessCheck>,
}

/// One check of `GET /readyz`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct ReadinessCheck {
    pub name: String,
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// `GET /internal/v1/status`: whether the member belongs to a cluster yet.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct PeerStatus {
    pub initialized: bool,
    pub id: u64,
}

/// `GET /internal/v1/read-index`: the index a follower must have applied before its read.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct ReadIndex {
    pub index: u64,
}

/// `POST /internal/v1/verified`: how many shared cache entries the member kept.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct Learned {
    pub learned: usize,
}

// ---- Agent answers beyond `wire`.

/// `POST .../smoke/{smoke_id}` (agent report): the verdict.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct SmokeVerdict {
    pub passed: bool,
}

/// `PUT .../inventory`: whether the replicated inventory changed.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct InventoryChanged {
    pub changed: bool,
}

// ---- Admin: enrolment tokens and credentials. Times are RFC 3339 strings.

/// `POST /api/v1/admin/node-enrollments` (201): the token, shown this once. No `Debug`: it
/// holds a secret.
#[derive(Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TokenIssued {
    pub enrollment_id: TokenId,
    pub token: String,
    pub expires_at: String,
    /// `sha256:<hex>` of the cluster CA certificate's DER, which an agent pins with
    /// `--ca-cert-hash` (absent on a member serving plain HTTP).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_cert_hash: Option<String>,
}

/// One enrolment token as listed: never the token or its hash.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct Enrollment {
    pub enrollment_id: TokenId,
    pub created_at: String,
    pub expires_at: String,
    /// `pending`, `claimed`, `expired` or `cancelled`.
    pub state: TokenState,
    pub claimed_node_id: Option<NodeId>,
    pub claimed_at: Option<String>,
    pub cancelled_at: Option<String>,
    pub note: Option<String>,
}

/// `GET /api/v1/admin/node-enrollments`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct Enrollments {
    pub enrollments: Vec<Enrollment>,
    /// The cursor of the next page (`after=`), or null on the last page.
    #[serde(default)]
    pub next: Option<String>,
}

/// `DELETE /api/v1/admin/node-enrollments/{id}`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct EnrollmentCancelled {
    pub enrollment_id: TokenId,
    pub state: TokenState,
}

/// One credential of a node: never its hash.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct CredentialView {
    pub credential_id: CredentialId,
    pub created_at: String,
    pub last_used_at: Option<String>,
    pub revoked_at: Option<String>,
    pub revoked_reason: Option<String>,
    pub enrollment_id: Option<TokenId>,
}

/// `GET /api/v1/admin/hardware/nodes/{id}/credentials`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct Credentials {
    pub node_id: NodeId,
    pub active: usize,
    pub revoked: usize,
    pub credentials: Vec<CredentialView>,
    /// The cursor of the next page (`after=`), or null on the last page.
    #[serde(default)]
    pub next: Option<String>,
}

/// `DELETE /api/v1/admin/hardware/nodes/{id}/credential`: the credentials it revoked.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct Revoked {
    pub node_id: NodeId,
    pub revoked: Vec<CredentialId>,
}

/// One recent telemetry sample of a node.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct TelemetrySample {
    pub at: String,
    pub telemetry: serde_json::Value,
}

/// `GET /api/v1/admin/hardware/nodes/{id}/telemetry`: oldest first.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct TelemetrySamples {
    pub node_id: NodeId,
    pub samples: Vec<TelemetrySample>,
}

/// One audit event: each hashes the one before. The replicated state keeps it in a compact
/// form that encodes exactly as this record (the server's `state::AuditEvent`), so this type's
/// encoding is replicated too (positional codec): no serde attributes.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct AuditRecord {
    pub seq: u64,
    pub at_ms: i64,
    pub actor: String,
    pub action: String,
    pub target: String,
    pub result: String,
    pub request_id: String,
    pub log_index: u64,
    pub prev_hash: String,
    pub hash: String,
    /// Why, for revocations, cancellations, decommissions and token changes. Never skipped
    /// when absent: this record is also stored with a positional codec.
    #[serde(default)]
    pub reason: Option<String>,
}

/// One audit event as `GET /api/v1/admin/audit` shows it: the record and its time as text.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct AuditEventView {
    pub at: String,
    #[serde(flatten)]
    pub record: AuditRecord,
}

/// `GET /api/v1/admin/audit`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct AuditPage {
    pub events: Vec<AuditEventView>,
    /// Whether the whole chain (not only this page) verifies.
    pub chain_verified: bool,
    /// The cursor of the next page (`after=`), or null on the last page.
    #[serde(default)]
    pub next: Option<String>,
}

// ---- Scheduling and smokes.

/// `POST /api/v1/allocations` (201).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct AllocationPlaced {
    pub allocation_id: AllocationId,
    pub node_id: NodeId,
    pub accelerator_uuids: Vec<String>,
}

/// `DELETE /api/v1/allocations/{id}`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct AllocationReleased {
    pub released: AllocationId,
}

/// `POST /api/v1/admin/hardware/nodes/{id}/smoke` (202).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct SmokeStarted {
    pub smoke_id: SmokeId,
}

/// One check of a smoke, as the node reported it (replicated: no serde attributes).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct SmokeCheck {
    pub name: String,
    pub ok: bool,
    pub detail: String,
}

/// `GET /api/v1/admin/hardware/nodes/{id}/smoke/{smoke_id}`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct SmokeView {
    pub smoke_id: SmokeId,
    pub node_id: NodeId,
    /// `pending`, `passed` or `failed`.
    pub state: SmokeState,
    pub checks: Vec<SmokeCheck>,
    pub created_at: String,
    pub finished_at: Option<String>,
}

// ---- Nodes, decommission and the scheduler view.

/// A node as `GET /api/v1/admin/hardware/nodes` lists it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct NodeSummary {
    pub node_id: NodeId,
    pub hostname: String,
    pub identity_public_key: String,
    pub enabled: bool,
    /// `online`, `stale`, `offline`, `never_seen` or `decommissioned`.
    pub status: NodeStatus,
    pub last_heartbeat_at: Option<String>,
    pub accelerators: Vec<AcceleratorView>,
    /// The worst health among its GPUs.
    pub health: crate::gpu_health::Health,
    /// Cordoned by an operator (GPU cordons are on each accelerator).
    pub cordoned: bool,
    pub cordon_reason: Option<String>,
    /// Its GPUs' attributes as NVIDIA GPU Feature Discovery names them.
    pub labels: std::collections::BTreeMap<String, String>,
    /// Whether a hardware report since this member rebuilt its view confirmed them.
    pub accelerators_verified: bool,
    pub accelerators_verified_at: Option<String>,
    pub view_rebuilt_at: String,
    pub storage_roots: Vec<crate::wire::StorageRoot>,
    pub driver_version: Option<String>,
    pub cuda_version: Option<String>,
    pub nvml: Option<String>,
    pub created_at: String,
    pub enrolled_at: String,
    pub decommissioned_at: Option<String>,
    pub active_credentials: usize,
    /// Other enabled nodes claiming the same hostname.
    pub hostname_conflicts: Vec<NodeId>,
}

/// An accelerator of a node view: the inventory's, with its health.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct AcceleratorView {
    #[serde(flatten)]
    pub accelerator: crate::wire::Accelerator,
    pub health: crate::gpu_health::Health,
    /// Cordoned for health (a `failed` GPU until an operator uncordons it).
    pub cordoned: bool,
    /// The event behind a health other than `healthy` (`xid 79`).
    #[serde(default)]
    pub health_cause: Option<String>,
    /// The health events of its latest telemetry (node detail; empty in lists).
    #[serde(default)]
    pub events: Vec<crate::gpu_health::GpuEvent>,
}

/// `POST .../nodes/{id}/cordon`, `uncordon`, `drain` and `.../accelerators/{uuid}/uncordon`.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CordonRequest {
    /// Why (kept in the audit trail and the node's history; 1 to 1024 bytes of printable text).
    pub reason: String,
}

/// `GET /api/v1/admin/hardware/nodes`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct Nodes {
    pub nodes: Vec<NodeSummary>,
    /// The cursor of the next page (`after=`), or null on the last page.
    #[serde(default)]
    pub next: Option<String>,
}

/// One event of a node's bounded history.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct HistoryEntry {
    pub at: String,
    pub kind: HistoryKind,
    pub detail: String,
    /// How many identical events were folded into this one.
    pub count: u32,
}

/// The last agent request refused for a node (status and when).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct LastRefusal {
    pub status: u16,
    pub at: String,
    /// The error code the agent was answered.
    pub code: String,
    /// Whether the presented credential was proven to be this node's. A refusal that is not
    /// (a stranger's request, a wrong secret, another node's credential) is no evidence about
    /// this node's own credential.
    pub credential_of_this_node: bool,
}

/// `GET /api/v1/admin/hardware/nodes/{id}`: the summary, history, latest telemetry and the
/// last refused agent request.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct NodeDetail {
    #[serde(flatten)]
    pub summary: NodeSummary,
    pub history: Vec<HistoryEntry>,
    pub telemetry: serde_json::Value,
    pub telemetry_at: Option<String>,
    pub last_refusal: Option<LastRefusal>,
}

/// What a decommission would change, as a preview shows it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct DecommissionEffectsView {
    pub node_id: NodeId,
    pub hostname: String,
    pub disable_node: bool,
    /// The identity key that can never enrol again.
    pub ban_identity: String,
    pub credentials_to_revoke: Vec<CredentialId>,
    pub hostname_conflicts_resolved: Vec<NodeId>,
    pub claims_to_spend: Vec<TokenId>,
    pub allocations_to_release: Vec<AllocationId>,
    pub accelerators_leaving_service: Vec<String>,
}

/// `POST .../decommission/preview`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct DecommissionPreviewView {
    pub preview_id: PreviewId,
    pub node_id: NodeId,
    pub effects: DecommissionEffectsView,
    pub fingerprint: String,
    pub created_at: String,
    pub expires_at: String,
}

/// `POST .../decommission/execute`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct Decommissioned {
    pub node_id: NodeId,
    pub status: NodeStatus,
    pub enabled: bool,
    pub decommissioned_at: String,
    pub preview_id: PreviewId,
    pub revoked: Vec<CredentialId>,
    pub hostname_conflicts_resolved: Vec<NodeId>,
    pub claims_spent: Vec<TokenId>,
    pub allocations_released: Vec<AllocationId>,
}

/// An allocation in the scheduler view.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct AllocationView {
    pub allocation_id: AllocationId,
    pub owner: String,
    pub accelerator_uuids: Vec<String>,
    /// `confirmed`, or `unconfirmed` after a restore until the node's report confirms it.
    pub state: AllocationState,
    pub created_at: String,
}

/// A node as the scheduler sees it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct SchedulerNode {
    pub node_id: NodeId,
    pub hostname: String,
    pub enabled: bool,
    pub verified: bool,
    pub online: bool,
    pub smoke_required: bool,
    pub offered: bool,
    pub accelerators: usize,
    pub free_accelerators: usize,
    pub free_accelerator_uuids: Vec<String>,
    pub busy_outside_scheduler: Vec<String>,
    pub allocations: Vec<AllocationView>,
}

/// `GET /api/v1/admin/scheduler`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct SchedulerView {
    pub view_rebuilt_at: String,
    pub require_smoke: bool,
    pub nodes: Vec<SchedulerNode>,
}

// ---- Admin request bodies (the server refuses unknown fields: `invalid_body`).

/// `POST /api/v1/admin/node-enrollments`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateEnrollment {
    /// At most `--max-token-ttl` (default 30 days); default `--default-token-ttl`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1)]
    pub ttl_seconds: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(max_length = 1024)]
    pub note: Option<String>,
}

/// `DELETE /api/v1/admin/hardware/nodes/{id}/credential`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RevokeRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(max_length = 1024)]
    pub reason: Option<String>,
}

/// `DELETE /api/v1/admin/node-enrollments/{id}` and `DELETE /api/v1/admin/tokens/{name}`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReasonRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(max_length = 1024)]
    pub reason: Option<String>,
}

/// What an operator's token may do. Each role may do everything the one before it may.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    utoipa::ToSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Every read but the backup.
    Viewer,
    /// Reads and writes: enrolments, revocations, decommissions, allocations, smokes.
    Operator,
    /// Everything: also token management and backups.
    Admin,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Viewer => "viewer",
            Role::Operator => "operator",
            Role::Admin => "admin",
        }
    }
}

/// `POST /api/v1/admin/tokens`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateOperatorToken {
    /// Not `root` or `system`.
    #[schema(pattern = "^[A-Za-z0-9_-]{1,64}$")]
    pub name: String,
    pub role: Role,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(max_length = 1024)]
    pub reason: Option<String>,
}

/// The 201 answer of `POST /api/v1/admin/tokens`: the token's plaintext, shown once.
#[derive(Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct OperatorTokenCreated {
    pub name: String,
    pub role: Role,
    pub token: String,
    pub created_at: String,
}

impl std::fmt::Debug for OperatorTokenCreated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OperatorTokenCreated")
            .field("name", &self.name)
            .field("role", &self.role)
            .field("token", &"<redacted>")
            .finish()
    }
}

/// One operator as `GET /api/v1/admin/tokens` lists it (never a secret or its digest).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct OperatorView {
    pub name: String,
    pub role: Role,
    /// None for `root`, which is configuration.
    pub created_at: Option<String>,
    pub created_by: Option<String>,
    /// True for `root`: it cannot be deleted through the API.
    pub builtin: bool,
}

/// `GET /api/v1/admin/tokens`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct OperatorList {
    pub tokens: Vec<OperatorView>,
}

/// `DELETE /api/v1/admin/tokens/{name}`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct OperatorDeleted {
    pub name: String,
    pub deleted: bool,
}

/// `{}`: the body of `POST .../decommission/preview` (nothing may be asked along).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EmptyRequest {}

/// `POST .../decommission/execute`. The preview id stays text here: the handler parses it
/// (`invalid_id`), so that an untame id is refused with its own code, not `invalid_body`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecuteDecommission {
    pub preview_id: String,
    pub reason: String,
}

/// `POST /api/v1/allocations`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AllocationRequest {
    #[schema(minimum = 1, maximum = 256)]
    pub accelerators: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_memory_mib: Option<u64>,
    pub owner: String,
    /// GPU Feature Discovery labels the placement must match exactly
    /// (`{"nvidia.com/gpu.product": "NVIDIA-H200"}`; see `labels::KNOWN`).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub constraints: std::collections::BTreeMap<String, String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_is_snake_case_with_an_error_status_and_round_trips() {
        for &c in ErrorCode::ALL {
            let s = c.as_str();
            assert!(
                !s.is_empty() && s.chars().all(|ch| ch.is_ascii_lowercase() || ch == '_'),
                "{s}"
            );
            assert!((400..600).contains(&c.status()), "{s}");
            assert!(!c.message().is_empty(), "{s}");
            let json = serde_json::to_string(&c).unwrap();
            let back: ErrorCode = serde_json::from_str(&json).unwrap();
            // Only the one shared wire string reads back as its first row.
            assert!(back == c || back.as_str() == c.as_str(), "{s}");
        }
    }

    #[test]
    fn a_wire_string_names_one_code_except_the_documented_pair() {
        let mut seen = std::collections::BTreeMap::new();
        for &c in ErrorCode::ALL {
            if let Some(prev) = seen.insert(c.as_str(), c) {
                assert_eq!(
                    (prev, c),
                    (
                        ErrorCode::NodeDecommissioned,
                        ErrorCode::CredentialOfDecommissionedNode
                    )
                );
            }
        }
    }

    #[test]
    fn an_unknown_code_does_not_deserialize() {
        assert!(serde_json::from_str::<ErrorCode>("\"refused\"").is_err());
    }
}
