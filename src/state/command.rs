//! Commands, the envelope every command travels in, and what applying one answers.

use modelforge_proto::api::ErrorCode as RefusalCode;
use modelforge_proto::api::Role;
use modelforge_proto::ids::AllocationId;
use modelforge_proto::ids::CredentialId;
use modelforge_proto::ids::HistoryKind;
use modelforge_proto::ids::NodeId;
use modelforge_proto::ids::PreviewId;
use modelforge_proto::ids::SmokeId;
use modelforge_proto::ids::TokenId;
use modelforge_proto::wire::Inventory;
use serde::Deserialize;
use serde::Serialize;

use super::decommission::DecommissionEffects;
use super::decommission::DecommissionPreview;
use super::sched;
use crate::journal::Fact;

/// A command with the metadata every command carries.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Envelope {
    /// Unique per logical request; a retry reuses it and gets the first answer.
    pub request_id: String,
    /// Leader-stamped wall time, milliseconds since the Unix epoch.
    pub now_ms: i64,
    /// Who asked: `admin`, `agent:<node or key>`, `system`.
    pub actor: String,
    pub command: Command,
}

/// Everything that changes replicated state.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Command {
    CreateToken {
        token_id: TokenId,
        hash: String,
        ttl_ms: i64,
        note: Option<String>,
    },
    CancelToken {
        token_id: TokenId,
        reason: Option<String>,
    },
    Enroll {
        token_id: TokenId,
        public_key: String,
        hostname: String,
        inventory: Inventory,
        /// Used only if the identity is new: the leader picks it, so apply stays deterministic.
        new_node_id: NodeId,
        credential_id: CredentialId,
        credential_hash: String,
        /// `identity.signed_at_ms` of the request: a retry of a claim must be signed later.
        proof_signed_at_ms: i64,
    },
    RevokeCredentials {
        node_id: NodeId,
        reason: String,
    },
    /// Coalesced `last_used_at` updates: (credential id, used at).
    TouchCredentials {
        uses: Vec<(CredentialId, i64)>,
    },
    UpdateInventory {
        node_id: NodeId,
        inventory: Inventory,
    },
    /// Coalesced node events from the heartbeat-processing member: (node, kind, detail, count).
    RecordEvents {
        events: Vec<(NodeId, HistoryKind, String, u32)>,
    },
    /// An admin took a backup (audit only): which member, at which index, its digest.
    RecordBackup {
        member: u64,
        applied_index: u64,
        state_digest: String,
    },
    /// Place an allocation on GPUs the leader chose from what it measured.
    Allocate {
        allocation_id: AllocationId,
        node_id: NodeId,
        accelerator_uuids: Vec<String>,
        owner: String,
        idempotency_key: Option<String>,
    },
    Release {
        allocation_id: AllocationId,
    },
    /// A node's fresh report: GPUs present, and those running something.
    Reconcile {
        node_id: NodeId,
        present: Vec<String>,
        busy: Vec<String>,
    },
    StartSmoke {
        smoke_id: SmokeId,
        node_id: NodeId,
    },
    SmokeResult {
        smoke_id: SmokeId,
        node_id: NodeId,
        checks: Vec<sched::SmokeCheck>,
    },
    /// Compute and record what decommissioning `node_id` would do, bound to the state now.
    PreviewDecommission {
        /// Chosen by the leader, so apply stays deterministic.
        preview_id: PreviewId,
        node_id: NodeId,
    },
    /// Apply a recorded preview, only if its effects are unchanged.
    ExecuteDecommission {
        preview_id: PreviewId,
        node_id: NodeId,
        reason: String,
    },
    /// A GPU's health changed in its node's reports (proposed only on a transition).
    GpuHealth {
        node_id: NodeId,
        uuid: String,
        /// The record the transition was judged from (apply drops it if that has changed).
        from: modelforge_proto::gpu_health::Health,
        cleared_at_ms: Option<i64>,
        health: modelforge_proto::gpu_health::Health,
        cause: String,
    },
    /// An operator cordons the node; `drain` also releases its allocations (marked `drained`).
    Cordon {
        node_id: NodeId,
        reason: String,
        drain: bool,
    },
    Uncordon {
        node_id: NodeId,
        reason: String,
    },
    /// An operator lifts a GPU's health cordon.
    UncordonGpu {
        node_id: NodeId,
        uuid: String,
        reason: String,
    },
    /// A named operator's token: the argon2id hash of its secret, never the secret.
    CreateOperator {
        name: String,
        role: Role,
        token_id: String,
        hash: String,
        reason: Option<String>,
    },
    DeleteOperator {
        name: String,
        reason: Option<String>,
    },
    /// A Raft member id removed from the cluster: never accepted again (proposed before the
    /// membership change that removes it).
    RetireMember {
        id: u64,
    },
    /// A member being added (the audit row of the change; refused for a retired id).
    AddMember {
        id: u64,
        url: String,
        voter: bool,
    },
}

impl Command {
    pub fn action(&self) -> &'static str {
        match self {
            Command::CreateToken { .. } => "enrollment.create",
            Command::CancelToken { .. } => "enrollment.cancel",
            Command::Enroll { .. } => "node.enroll",
            Command::RevokeCredentials { .. } => "credential.revoke",
            Command::TouchCredentials { .. } => "credential.touch",
            Command::UpdateInventory { .. } => "node.inventory",
            Command::RecordEvents { .. } => "node.events",
            Command::RecordBackup { .. } => "cluster.backup",
            Command::Allocate { .. } => "allocation.create",
            Command::Release { .. } => "allocation.release",
            Command::Reconcile { .. } => "scheduler.reconcile",
            Command::StartSmoke { .. } => "smoke.start",
            Command::SmokeResult { .. } => "smoke.result",
            Command::PreviewDecommission { .. } => "node.decommission.preview",
            Command::ExecuteDecommission { .. } => "node.decommission.execute",
            Command::CreateOperator { .. } => "operator.create",
            Command::DeleteOperator { .. } => "operator.delete",
            Command::RetireMember { .. } => "cluster.member.remove",
            Command::AddMember { .. } => "cluster.member.add",
            Command::GpuHealth { .. } => "node.gpu_health",
            Command::Cordon { drain: false, .. } => "node.cordon",
            Command::Cordon { drain: true, .. } => "node.drain",
            Command::Uncordon { .. } => "node.uncordon",
            Command::UncordonGpu { .. } => "node.accelerator.uncordon",
        }
    }

    /// The reason an audit row of this command carries.
    pub fn reason(&self) -> Option<&str> {
        match self {
            Command::RevokeCredentials { reason, .. }
            | Command::ExecuteDecommission { reason, .. }
            | Command::Cordon { reason, .. }
            | Command::Uncordon { reason, .. }
            | Command::UncordonGpu { reason, .. } => Some(reason),
            Command::CancelToken { reason, .. }
            | Command::CreateOperator { reason, .. }
            | Command::DeleteOperator { reason, .. } => reason.as_deref(),
            _ => None,
        }
    }

    /// Admin and enrolment actions go into the audit trail; bookkeeping does not.
    pub fn audited(&self) -> bool {
        !matches!(
            self,
            Command::TouchCredentials { .. }
                | Command::UpdateInventory { .. }
                | Command::RecordEvents { .. }
                | Command::Reconcile { .. }
                | Command::GpuHealth { .. }
        )
    }

    /// What an audit row of this command names, given its answer.
    pub fn audit_target(&self, result: &ApplyResult) -> String {
        match (self, result) {
            (_, Ok(Outcome::Enrolled { node_id, .. })) => node_id.to_string(),
            (Command::CreateToken { token_id, .. } | Command::CancelToken { token_id, .. }, _) => {
                token_id.to_string()
            }
            (Command::CreateOperator { name, role, .. }, _) => {
                format!("operator:{name} role:{}", role.as_str())
            }
            (Command::DeleteOperator { name, .. }, _) => format!("operator:{name}"),
            (Command::RetireMember { id }, _) => format!("member:{id}"),
            (Command::AddMember { id, url, voter }, _) => {
                format!("member:{id} url:{url} voter:{voter}")
            }
            (Command::Enroll { token_id, .. }, Err(_)) => format!("enrollment:{token_id}"),
            (Command::Allocate { node_id, .. }, _) => node_id.to_string(),
            (Command::Release { allocation_id }, _) => allocation_id.to_string(),
            (Command::StartSmoke { node_id, .. }, _)
            | (Command::SmokeResult { node_id, .. }, _) => node_id.to_string(),
            (
                Command::RecordBackup {
                    member,
                    applied_index,
                    state_digest,
                },
                _,
            ) => format!(
                "member {member} index {applied_index} digest {}",
                &state_digest[..16.min(state_digest.len())]
            ),
            (
                Command::RevokeCredentials { node_id, .. }
                | Command::Cordon { node_id, .. }
                | Command::Uncordon { node_id, .. }
                | Command::PreviewDecommission { node_id, .. }
                | Command::ExecuteDecommission { node_id, .. },
                _,
            ) => node_id.to_string(),
            (Command::UncordonGpu { node_id, uuid, .. }, _) => format!("{node_id} {uuid}"),
            _ => String::new(),
        }
    }
}

/// A successful command's answer.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub enum Outcome {
    TokenCreated {
        token_id: TokenId,
        created_at_ms: i64,
        expires_at_ms: i64,
    },
    TokenCancelled {
        token_id: TokenId,
    },
    Enrolled {
        node_id: NodeId,
        credential_id: CredentialId,
        reenrolled: bool,
    },
    Revoked {
        credential_ids: Vec<CredentialId>,
    },
    Touched {
        count: usize,
    },
    InventoryUpdated {
        changed: bool,
    },
    EventsRecorded {
        count: usize,
    },
    GpuHealthRecorded {
        changed: bool,
    },
    /// A cordon, uncordon or drain landed; `drained` names the allocations a drain released.
    Cordoned {
        drained: Vec<AllocationId>,
    },
    BackupRecorded,
    Allocated {
        allocation_id: AllocationId,
        node_id: NodeId,
        accelerator_uuids: Vec<String>,
    },
    Released {
        allocation_id: AllocationId,
    },
    Reconciled {
        confirmed: Vec<AllocationId>,
        released: Vec<AllocationId>,
    },
    SmokeStarted {
        smoke_id: SmokeId,
    },
    SmokeFinished {
        passed: bool,
    },
    // The large answers are boxed: every answer is kept in the request-id table (up to
    // `DEDUP_MAX` of them), and an enum is as large as its largest variant.
    DecommissionPreviewed {
        preview: Box<DecommissionPreview>,
    },
    Decommissioned {
        node_id: NodeId,
        decommissioned_at_ms: i64,
        effects: Box<DecommissionEffects>,
    },
    OperatorCreated {
        name: String,
        created_at_ms: i64,
    },
    OperatorDeleted {
        name: String,
    },
    MemberRetired {
        id: u64,
    },
    MemberAdded {
        id: u64,
    },
}

/// A refused command: the same on every member. It carries its code, never an HTTP status:
/// the status is the code's, from the one table in `modelforge_proto::api`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Refusal {
    pub code: RefusalCode,
    pub message: String,
}

impl Refusal {
    /// A refusal with the code's own message.
    pub fn new(code: RefusalCode) -> Self {
        Self {
            code,
            message: code.message().to_string(),
        }
    }

    /// A refusal with a more specific message (never client input: see `error.rs`).
    pub fn with(code: RefusalCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    pub fn status(&self) -> u16 {
        self.code.status()
    }
}

pub type ApplyResult = Result<Outcome, Refusal>;

/// What one apply decided: the answer, the monotone facts for the revocation journal, and the
/// audit events it moved out of the state, for the member's archive (oldest first).
#[derive(Clone, Debug, PartialEq)]
pub struct Applied {
    pub result: ApplyResult,
    pub facts: Vec<Fact>,
    pub archived: Vec<super::AuditEvent>,
}
