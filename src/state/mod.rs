//! The replicated state of the control plane and the one function that changes it.
//!
//! Architecture invariant: [`State::apply`] is a pure function of (state, envelope). It reads no
//! clock (the leader stamps `now_ms` into every envelope, and the state's clock only moves
//! forward), does no I/O, and never panics on any input: an impossible command is refused
//! with the same answer on every member. It returns the answer and the monotone facts it
//! decided ([`Applied`]); the state keeps no output buffer.
//!
//! The invariants are written once, in [`State::check`] (`check.rs`), which runs after every
//! apply in debug builds and in the property test (`proptest.rs`):
//! - one enrolment token mints at most one node identity; a retry of the claim by the same
//!   identity gets the same node id, until a credential from that claim was used or revoked;
//! - one identity (public key) maps to exactly one node;
//! - a node has at most one active credential, and only an enabled node has one; issuing one
//!   revokes the others in the same step; a revoked credential is never un-revoked;
//! - the plaintext of a token or credential never reaches this module: only argon2id hashes.
//!
//! Where each concern lives:
//! - `command.rs`: commands, envelope, outcomes, refusals;
//! - `model.rs`: tokens, nodes and their history, credentials;
//! - `enrol.rs`: tokens, claims, credentials and their revocation;
//! - `decommission.rs`: previews, execute, and the one `decommission_node`;
//! - `audit.rs`: the hash-chained audit trail;
//! - `dedup.rs`: the request-id table;
//! - `hostnames.rs`: the enabled-hostname index;
//! - `reapply.rs`: restore's re-application of journal facts;
//! - `operators.rs`: named admin tokens (argon2id hashes only);
//! - `sched.rs`: allocations and smokes;
//! - `check.rs`: the invariants.

use std::collections::BTreeMap;
use std::collections::BTreeSet;
use std::sync::Arc;

use imbl::OrdMap;
use imbl::Vector;

use serde::Deserialize;
use serde::Serialize;
use sha2::Digest;

mod audit;
mod check;
mod command;
mod decommission;
mod dedup;
mod enrol;
pub mod health;
pub mod hostnames;
mod model;
pub mod operators;
pub mod persist;
mod reapply;
mod retention;
pub mod sched;

pub use audit::AuditBase;
pub use audit::AuditEvent;
pub use audit::ChainHash;
pub use audit::GENESIS;
pub use audit::audit_hash;
pub use audit::verify_audit_chain;
pub use command::Applied;
pub use command::ApplyResult;
pub use command::Command;
pub use command::Envelope;
pub use command::Outcome;
pub use command::Refusal;
pub use decommission::DecommissionEffects;
pub use decommission::DecommissionPreview;
pub use dedup::idempotency_key_reused;
pub use dedup::key_reused;
pub use hostnames::Claimants;
pub use model::Claim;
pub use model::Credential;
pub use model::HistoryEvent;
pub use model::Node;
pub use model::Token;
pub use model::TokenState;
pub use model::inventory_digest;
pub use model::push_history;
pub use model::push_history_n;
pub use modelforge_proto::api::ErrorCode as RefusalCode;
pub use modelforge_proto::ids::CredentialId;
pub use modelforge_proto::ids::HistoryKind;
pub use modelforge_proto::ids::NodeId;
pub use modelforge_proto::ids::PreviewId;
pub use modelforge_proto::ids::RequestId;
pub use modelforge_proto::ids::TokenId;
pub use retention::RETENTION_MS;
pub use retention::TEST_RETENTION_ENV;
pub use retention::windows as retention_windows;

/// How many history events a node keeps (oldest dropped first).
pub const HISTORY_PER_NODE: usize = 256;
/// How long a request id's answer is kept for deduplicating retries (leader time).
pub const DEDUP_TTL_MS: i64 = 24 * 3600 * 1000;
/// The most remembered request ids (after each apply; the oldest is dropped first).
pub const DEDUP_MAX: usize = 200_000;
/// How long a decommission preview can be executed (leader time).
pub const PREVIEW_TTL_MS: i64 = 15 * 60 * 1000;
/// The most decommission previews kept (oldest dropped first).
pub const PREVIEWS_MAX: usize = 1000;

/// The whole replicated state.
/// The whole replicated state. Its large collections are persistent (`imbl`): a clone costs a
/// few reference counts, so a snapshot encodes a captured version while apply goes on.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct State {
    /// The latest leader-stamped time applied; never goes back.
    pub clock_ms: i64,
    pub last_applied_index: u64,
    #[serde(deserialize_with = "persist::map")]
    pub tokens: OrdMap<TokenId, Arc<Token>>,
    #[serde(deserialize_with = "persist::map")]
    pub nodes: OrdMap<NodeId, Arc<Node>>,
    /// Identity public key -> node id.
    #[serde(deserialize_with = "persist::map")]
    pub identities: OrdMap<String, NodeId>,
    #[serde(deserialize_with = "persist::map")]
    pub credentials: OrdMap<CredentialId, Arc<Credential>>,
    /// The live audit trail: the events after `audit_base` (older ones are in each member's
    /// archive file, see ARCHITECTURE.md "The archive").
    #[serde(deserialize_with = "persist::vector")]
    pub audit: Vector<AuditEvent>,
    /// How many events were archived, and the hash of the last: the chain's proof of them.
    pub audit_base: AuditBase,
    /// request id -> (applied at, answer). The id shares its text with its place in the
    /// order and with the audit event of the request, as every id does.
    #[serde(deserialize_with = "persist::map")]
    pub dedup: OrdMap<RequestId, (i64, ApplyResult)>,
    #[serde(deserialize_with = "persist::vector")]
    pub dedup_order: Vector<(i64, RequestId)>,
    /// Allocations, smokes, and what the scheduler must re-measure.
    pub sched: sched::Scheduling,
    /// Decommission previews by id (pruned by expiry in apply).
    pub previews: BTreeMap<PreviewId, DecommissionPreview>,
    /// Hostname -> the enabled nodes claiming it: "which enabled nodes claim H" without a scan
    /// of every node (an enrolment asks it, and so does every node view). Maintained wherever
    /// a node is created, renamed or disabled (`index_hostname`, `unindex_hostname`).
    #[serde(deserialize_with = "persist::map")]
    pub enabled_by_hostname: OrdMap<String, Claimants>,
    /// Named operators' tokens by name (`root` is configuration, not here).
    pub operators: BTreeMap<String, operators::OperatorToken>,
    /// Raft member ids removed from the cluster: never added again, refused as peers.
    pub retired_members: BTreeSet<u64>,
    /// GPU health and cordons.
    pub health: health::Fleet,
}

impl State {
    /// Apply one committed envelope at `log_index`. Deterministic; never panics (in debug
    /// builds it asserts [`State::check_after_apply`] afterwards).
    pub fn apply(&mut self, log_index: u64, env: &Envelope) -> Applied {
        let before = self.clock_ms;
        self.clock_ms = self.clock_ms.max(env.now_ms);
        self.last_applied_index = log_index;
        let now = self.clock_ms;
        self.prune_dedup(now);
        let archived = self.prune_on_the_hour(before);
        if let Some((_, answer)) = self.dedup.get(env.request_id.as_str()) {
            return Applied {
                result: answer.clone(),
                facts: Vec::new(),
                archived,
            };
        }
        let mut facts = Vec::new();
        let reused = idempotency_key_reused(&self.dedup, &env.request_id);
        // One allocation for the id, shared by the audit event and the request table.
        let request_id = RequestId::from(env.request_id.as_str());
        let result = if reused {
            Err(key_reused())
        } else {
            self.execute(&mut facts, now, env)
        };
        if env.command.audited() {
            let outcome = match &result {
                Ok(_) => "ok",
                Err(r) => r.code.as_str(),
            };
            self.audit(
                now,
                log_index,
                &env.actor,
                env.command.action(),
                &env.command.audit_target(&result),
                outcome,
                request_id.clone(),
                env.command.reason(),
            );
        }
        // A reused key's refusal is not stored: the key keeps answering its first request.
        if !reused {
            self.remember(now, request_id, &result);
        }
        #[cfg(debug_assertions)]
        if let Err(broken) = self.check_after_apply() {
            panic!("invariant broken after applying index {log_index}: {broken}");
        }
        Applied {
            result,
            facts,
            archived,
        }
    }

    fn execute(
        &mut self,
        facts: &mut Vec<crate::journal::Fact>,
        now: i64,
        env: &Envelope,
    ) -> ApplyResult {
        match &env.command {
            Command::CreateToken {
                token_id,
                hash,
                ttl_ms,
                note,
            } => self.create_token(now, token_id, hash, *ttl_ms, note),
            Command::CancelToken { token_id, .. } => self.cancel_token(facts, now, token_id),
            Command::CreateOperator {
                name,
                role,
                token_id,
                hash,
                ..
            } => self.create_operator(now, &env.actor, name, *role, token_id, hash),
            Command::DeleteOperator { name, .. } => self.delete_operator(name),
            Command::RetireMember { id } => {
                self.retired_members.insert(*id);
                Ok(Outcome::MemberRetired { id: *id })
            }
            Command::AddMember { id, .. } => {
                if self.retired_members.contains(id) {
                    Err(Refusal::new(RefusalCode::MemberIdRetired))
                } else {
                    Ok(Outcome::MemberAdded { id: *id })
                }
            }
            enroll @ Command::Enroll { .. } => self.enroll(facts, now, enroll),
            Command::RevokeCredentials { node_id, reason } => {
                self.revoke_node(facts, now, node_id, reason)
            }
            Command::TouchCredentials { uses } => self.touch(facts, now, uses),
            Command::RecordBackup { .. } => Ok(Outcome::BackupRecorded),
            Command::Allocate {
                allocation_id,
                node_id,
                accelerator_uuids,
                owner,
                idempotency_key,
            } => self.allocate(
                now,
                allocation_id,
                node_id,
                accelerator_uuids,
                owner,
                idempotency_key.as_ref(),
            ),
            Command::Release { allocation_id } => {
                self.release(now, allocation_id, "released by its owner")
            }
            Command::Reconcile {
                node_id,
                present,
                busy,
            } => self.reconcile(
                now,
                node_id,
                &present.iter().cloned().collect(),
                &busy.iter().cloned().collect(),
            ),
            Command::StartSmoke { smoke_id, node_id } => self.start_smoke(now, smoke_id, node_id),
            Command::SmokeResult {
                smoke_id,
                node_id,
                checks,
            } => self.smoke_result(now, smoke_id, node_id, checks),
            Command::RecordEvents { events } => {
                let mut count = 0;
                for (node_id, kind, detail, n) in events {
                    if let Some(node) = self.nodes.get_mut(node_id).map(Arc::make_mut) {
                        push_history_n(node, now, *kind, detail.clone(), (*n).max(1));
                        count += 1;
                    }
                }
                Ok(Outcome::EventsRecorded { count })
            }
            Command::PreviewDecommission {
                preview_id,
                node_id,
            } => self.preview_decommission(now, preview_id, node_id),
            Command::ExecuteDecommission {
                preview_id,
                node_id,
                reason,
            } => self.execute_decommission(facts, now, preview_id, node_id, reason),
            Command::GpuHealth {
                node_id,
                uuid,
                from,
                cleared_at_ms,
                health,
                cause,
            } => self.gpu_health(now, node_id, uuid, *from, *cleared_at_ms, *health, cause),
            Command::Cordon {
                node_id,
                reason,
                drain,
            } => self.cordon(now, &env.actor, node_id, reason, *drain),
            Command::Uncordon { node_id, reason } => {
                self.uncordon(now, &env.actor, node_id, reason)
            }
            Command::UncordonGpu {
                node_id,
                uuid,
                reason,
            } => self.uncordon_gpu(now, &env.actor, node_id, uuid, reason),
            Command::UpdateInventory { node_id, inventory } => {
                let Some(node) = self.nodes.get_mut(node_id).map(Arc::make_mut) else {
                    return Err(Refusal::new(RefusalCode::NodeNotFound));
                };
                if node.decommissioned_at_ms.is_some() {
                    return Err(Refusal::new(RefusalCode::NodeDecommissioned));
                }
                Ok(Outcome::InventoryUpdated {
                    changed: model::set_inventory(node, now, inventory),
                })
            }
        }
    }

    /// A digest of the whole state, to compare members.
    pub fn digest(&self) -> String {
        let bytes = modelforge_raft::codec::encode(self).unwrap_or_default();
        modelforge_proto::hex(&sha2::Sha256::digest(&bytes))
    }
}

#[cfg(test)]
mod proptest;
#[cfg(test)]
mod tests;
