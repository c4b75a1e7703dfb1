//! The replicated state of the control plane and the one function that changes it.
//!
//! Architecture invariant: [`State::apply`] is a pure function of (state, envelope). It reads no
//! clock (the leader stamps `now_ms` into every envelope, and the state's clock only moves
//! forward), does no I/O, and never panics on any input: an impossible command is refused
//! with the same answer on every member.
//!
//! Invariants kept here (and checked by the unit tests below):
//! - one enrolment token mints at most one node identity; a retry of the claim by the same
//!   identity gets the same node id, until a credential from that claim was used or revoked;
//! - one identity (public key) maps to exactly one node;
//! - a node has at most one active credential; issuing one revokes the others in the same step;
//! - a revoked credential is never un-revoked;
//! - the plaintext of a token or credential never reaches this module: only argon2id hashes.

use std::collections::BTreeMap;
use std::collections::BTreeSet;
use std::collections::VecDeque;

use modelforge_proto::wire::Inventory;

use crate::journal::Fact;

pub mod sched;
use serde::Deserialize;
use serde::Serialize;
use sha2::Digest;

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
        token_id: String,
        hash: String,
        ttl_ms: i64,
        note: Option<String>,
    },
    CancelToken {
        token_id: String,
    },
    Enroll {
        token_id: String,
        public_key: String,
        hostname: String,
        inventory: Inventory,
        /// Used only if the identity is new: the leader picks it, so apply stays deterministic.
        new_node_id: String,
        credential_id: String,
        credential_hash: String,
    },
    RevokeCredentials {
        node_id: String,
        reason: String,
    },
    /// Coalesced `last_used_at` updates: (credential id, used at).
    TouchCredentials {
        uses: Vec<(String, i64)>,
    },
    UpdateInventory {
        node_id: String,
        inventory: Inventory,
    },
    /// Coalesced node events from the heartbeat-processing member: (node, kind, detail, count).
    RecordEvents {
        events: Vec<(String, String, String, u32)>,
    },
    /// An admin took a backup (audit only): which member, at which index, its digest.
    RecordBackup {
        member: u64,
        applied_index: u64,
        state_digest: String,
    },
    /// Place an allocation on GPUs the leader chose from what it measured.
    Allocate {
        allocation_id: String,
        node_id: String,
        accelerator_uuids: Vec<String>,
        owner: String,
        idempotency_key: Option<String>,
    },
    Release {
        allocation_id: String,
    },
    /// A node's fresh report: GPUs present, and those running something.
    Reconcile {
        node_id: String,
        present: Vec<String>,
        busy: Vec<String>,
    },
    StartSmoke {
        smoke_id: String,
        node_id: String,
    },
    SmokeResult {
        smoke_id: String,
        node_id: String,
        checks: Vec<sched::SmokeCheck>,
    },
    /// Compute and record what decommissioning `node_id` would do, bound to the state now.
    PreviewDecommission {
        /// Chosen by the leader, so apply stays deterministic.
        preview_id: String,
        node_id: String,
    },
    /// Apply a recorded preview, only if its effects are unchanged.
    ExecuteDecommission {
        preview_id: String,
        node_id: String,
        reason: String,
    },
}

impl Command {
    fn action(&self) -> &'static str {
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
        }
    }

    /// Admin and enrolment actions go into the audit trail; bookkeeping does not.
    fn audited(&self) -> bool {
        !matches!(
            self,
            Command::TouchCredentials { .. }
                | Command::UpdateInventory { .. }
                | Command::RecordEvents { .. }
                | Command::Reconcile { .. }
        )
    }
}

/// A successful command's answer.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub enum Outcome {
    TokenCreated {
        token_id: String,
        created_at_ms: i64,
        expires_at_ms: i64,
    },
    TokenCancelled {
        token_id: String,
    },
    Enrolled {
        node_id: String,
        credential_id: String,
        reenrolled: bool,
    },
    Revoked {
        credential_ids: Vec<String>,
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
    BackupRecorded,
    Allocated {
        allocation_id: String,
        node_id: String,
        accelerator_uuids: Vec<String>,
    },
    Released {
        allocation_id: String,
    },
    Reconciled {
        confirmed: Vec<String>,
        released: Vec<String>,
    },
    SmokeStarted {
        smoke_id: String,
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
        node_id: String,
        decommissioned_at_ms: i64,
        effects: Box<DecommissionEffects>,
    },
}

/// A refused command: the same on every member, mapped to HTTP by `error.rs`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Refusal {
    pub status: u16,
    pub code: String,
    pub message: String,
}

impl Refusal {
    pub fn new(status: u16, code: &str, message: impl Into<String>) -> Self {
        Self {
            status,
            code: code.to_string(),
            message: message.into(),
        }
    }
}

pub type ApplyResult = Result<Outcome, Refusal>;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Claim {
    pub node_id: String,
    pub public_key: String,
    /// The latest credential issued by this claim.
    pub credential_id: String,
    pub claimed_at_ms: i64,
    /// Set once a credential from this claim was used or revoked: no retry after that.
    pub spent: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Token {
    pub token_id: String,
    pub hash: String,
    pub created_at_ms: i64,
    pub expires_at_ms: i64,
    pub note: Option<String>,
    pub cancelled_at_ms: Option<i64>,
    pub claim: Option<Claim>,
}

impl Token {
    /// `pending`, `claimed`, `expired` or `cancelled` at `now_ms`.
    pub fn state_at(&self, now_ms: i64) -> &'static str {
        if self.claim.is_some() {
            "claimed"
        } else if self.cancelled_at_ms.is_some() {
            "cancelled"
        } else if now_ms > self.expires_at_ms {
            "expired"
        } else {
            "pending"
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct HistoryEvent {
    pub at_ms: i64,
    pub kind: String,
    pub detail: String,
    /// How many identical events were folded into this one.
    pub count: u32,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Node {
    pub node_id: String,
    pub hostname: String,
    pub public_key: String,
    pub enabled: bool,
    pub decommissioned_at_ms: Option<i64>,
    pub created_at_ms: i64,
    pub enrolled_at_ms: i64,
    pub inventory: Inventory,
    pub inventory_digest: String,
    /// Every credential ever issued to this node, oldest first.
    pub credential_ids: Vec<String>,
    pub history: VecDeque<HistoryEvent>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Credential {
    pub credential_id: String,
    pub node_id: String,
    pub hash: String,
    pub created_at_ms: i64,
    pub last_used_at_ms: Option<i64>,
    pub revoked_at_ms: Option<i64>,
    pub revoked_reason: Option<String>,
    pub token_id: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct AuditEvent {
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
}

/// Everything decommissioning a node would change, as a preview shows it. Computed only by
/// [`State::decommission_effects`]; two computations are equal exactly when nothing the
/// preview showed has changed.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct DecommissionEffects {
    pub node_id: String,
    pub hostname: String,
    /// The identity key that can never enrol again.
    pub identity_public_key: String,
    /// Active credentials to revoke.
    pub credentials_to_revoke: Vec<String>,
    /// Other enabled nodes claiming the same hostname: the conflict this resolves.
    pub hostname_conflicts_resolved: Vec<String>,
    /// Enrolment tokens whose claim names this node and is not spent yet. Shown, spent by
    /// execute, but not bound by the fingerprint: a claim only ever goes from unspent to
    /// spent by the node's own first heartbeat (a new claim comes with a new credential,
    /// which the fingerprint does bind), and execute spends whatever remains.
    pub claims_to_spend: Vec<String>,
    /// The scheduler's allocations placed on the node, released by execute.
    pub allocations_to_release: Vec<String>,
    /// Accelerator uuids that leave service with the node.
    pub accelerators: Vec<String>,
}

impl DecommissionEffects {
    /// SHA-256 of the canonical JSON (without `claims_to_spend`): what an execute must still
    /// match.
    pub fn fingerprint(&self) -> String {
        let bound = DecommissionEffects {
            claims_to_spend: Vec::new(),
            ..self.clone()
        };
        let json = serde_json::to_vec(&bound).unwrap_or_default();
        modelforge_proto::hex(&sha2::Sha256::digest(&json))
    }

    /// Each effect that differs from `now`, as "field: was X, now Y".
    pub fn changes(&self, now: &DecommissionEffects) -> Vec<String> {
        let mut out = vec![];
        let mut cmp = |name: &str, was: String, is: String| {
            if was != is {
                out.push(format!("{name}: was {was}, now {is}"));
            }
        };
        cmp("hostname", self.hostname.clone(), now.hostname.clone());
        cmp(
            "identity_public_key",
            self.identity_public_key.clone(),
            now.identity_public_key.clone(),
        );
        let list = |v: &[String]| format!("[{}]", v.join(", "));
        cmp(
            "credentials_to_revoke",
            list(&self.credentials_to_revoke),
            list(&now.credentials_to_revoke),
        );
        cmp(
            "hostname_conflicts_resolved",
            list(&self.hostname_conflicts_resolved),
            list(&now.hostname_conflicts_resolved),
        );
        cmp(
            "allocations_to_release",
            list(&self.allocations_to_release),
            list(&now.allocations_to_release),
        );
        cmp(
            "accelerators",
            list(&self.accelerators),
            list(&now.accelerators),
        );
        out
    }
}

/// A recorded decommission preview.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct DecommissionPreview {
    pub preview_id: String,
    pub node_id: String,
    pub created_at_ms: i64,
    pub expires_at_ms: i64,
    pub effects: DecommissionEffects,
    pub fingerprint: String,
    /// Set when executed: a preview applies at most once.
    pub used_at_ms: Option<i64>,
}

/// The whole replicated state.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct State {
    /// The latest leader-stamped time applied; never goes back.
    pub clock_ms: i64,
    pub last_applied_index: u64,
    pub tokens: BTreeMap<String, Token>,
    pub nodes: BTreeMap<String, Node>,
    /// Identity public key -> node id.
    pub identities: BTreeMap<String, String>,
    pub credentials: BTreeMap<String, Credential>,
    pub audit: Vec<AuditEvent>,
    /// request id -> (applied at, answer).
    pub dedup: BTreeMap<String, (i64, ApplyResult)>,
    pub dedup_order: VecDeque<(i64, String)>,
    /// Allocations, smokes, and what the scheduler must re-measure.
    pub sched: sched::Scheduling,
    /// Monotone facts decided by the latest applies, for the revocation journal (drained by
    /// the apply path; not replicated state).
    #[serde(skip)]
    pub journal: crate::journal::Pending,
    /// Decommission previews by id (pruned by expiry in apply).
    pub previews: BTreeMap<String, DecommissionPreview>,
    /// Hostname -> the enabled nodes claiming it: "which enabled nodes claim H" without a scan
    /// of every node (an enrolment asks it, and so does every node view). Maintained wherever
    /// a node is created, renamed or disabled (`index_hostname`, `unindex_hostname`).
    pub enabled_by_hostname: BTreeMap<String, BTreeSet<String>>,
}

/// SHA-256 hex of an inventory's canonical JSON.
pub fn inventory_digest(inv: &Inventory) -> String {
    let json = serde_json::to_vec(inv).unwrap_or_default();
    modelforge_proto::hex(&sha2::Sha256::digest(&json))
}

/// Whether `request_id` (`idem-<key part>.<request part>`, see `server::extract::request_id`)
/// shares its key part with another request id in `table`: the same Idempotency-Key used for
/// the same operation and target with a different body.
pub fn idempotency_key_reused<V>(table: &BTreeMap<String, V>, request_id: &str) -> bool {
    let Some(dot) = request_id.find('.') else {
        return false;
    };
    if !request_id.starts_with("idem-") {
        return false;
    }
    let prefix = &request_id[..=dot];
    table
        .range::<str, _>((
            std::ops::Bound::Included(prefix),
            std::ops::Bound::Unbounded,
        ))
        .take_while(|(k, _)| k.starts_with(prefix))
        .any(|(k, _)| k != request_id)
}

/// The refusal of an Idempotency-Key reused with another request body.
pub fn key_reused() -> Refusal {
    Refusal::new(
        422,
        "idempotency_key_reused",
        "this Idempotency-Key was already used for a different request to the same operation \
         and target; use a new key",
    )
}

impl State {
    /// Apply one committed envelope at `log_index`. Deterministic; never panics.
    pub fn apply(&mut self, log_index: u64, env: &Envelope) -> ApplyResult {
        self.clock_ms = self.clock_ms.max(env.now_ms);
        self.last_applied_index = log_index;
        let now = self.clock_ms;
        self.prune_dedup(now);
        if let Some((_, answer)) = self.dedup.get(&env.request_id) {
            return answer.clone();
        }
        let reused = idempotency_key_reused(&self.dedup, &env.request_id);
        let result = if reused {
            Err(key_reused())
        } else {
            self.execute(now, env)
        };
        if env.command.audited() {
            let target = match (&env.command, &result) {
                (_, Ok(Outcome::Enrolled { node_id, .. })) => node_id.clone(),
                (Command::CreateToken { token_id, .. } | Command::CancelToken { token_id }, _) => {
                    token_id.clone()
                }
                (Command::Enroll { token_id, .. }, Err(_)) => format!("enrollment:{token_id}"),
                (Command::Allocate { node_id, .. }, _) => node_id.clone(),
                (Command::Release { allocation_id }, _) => allocation_id.clone(),
                (Command::StartSmoke { node_id, .. }, _)
                | (Command::SmokeResult { node_id, .. }, _) => node_id.clone(),
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
                    | Command::PreviewDecommission { node_id, .. }
                    | Command::ExecuteDecommission { node_id, .. },
                    _,
                ) => node_id.clone(),
                _ => String::new(),
            };
            let outcome = match &result {
                Ok(_) => "ok".to_string(),
                Err(r) => r.code.clone(),
            };
            self.audit(
                now,
                log_index,
                &env.actor,
                env.command.action(),
                &target,
                &outcome,
                &env.request_id,
            );
        }
        // A reused key's refusal is not stored: the key keeps answering its first request.
        if !env.request_id.is_empty() && !reused {
            self.dedup
                .insert(env.request_id.clone(), (now, result.clone()));
            self.dedup_order.push_back((now, env.request_id.clone()));
            // At the cap, the new id takes the oldest one's place.
            self.prune_dedup(now);
        }
        result
    }

    fn prune_dedup(&mut self, now: i64) {
        while let Some((at, id)) = self.dedup_order.front() {
            if now - *at > DEDUP_TTL_MS || self.dedup_order.len() > DEDUP_MAX {
                self.dedup.remove(id);
                self.dedup_order.pop_front();
            } else {
                break;
            }
        }
    }

    #[allow(clippy::too_many_arguments)] // one audit row has this many columns
    fn audit(
        &mut self,
        now: i64,
        log_index: u64,
        actor: &str,
        action: &str,
        target: &str,
        result: &str,
        request_id: &str,
    ) {
        let seq = self.audit.len() as u64 + 1;
        let prev_hash = self
            .audit
            .last()
            .map(|e| e.hash.clone())
            .unwrap_or_else(|| "0".repeat(64));
        let mut ev = AuditEvent {
            seq,
            at_ms: now,
            actor: actor.to_string(),
            action: action.to_string(),
            target: target.to_string(),
            result: result.to_string(),
            request_id: request_id.to_string(),
            log_index,
            prev_hash,
            hash: String::new(),
        };
        ev.hash = audit_hash(&ev);
        self.audit.push(ev);
    }

    fn execute(&mut self, now: i64, env: &Envelope) -> ApplyResult {
        match &env.command {
            Command::CreateToken {
                token_id,
                hash,
                ttl_ms,
                note,
            } => {
                if self.tokens.contains_key(token_id) {
                    return Err(Refusal::new(
                        409,
                        "token_exists",
                        "an enrolment token with this id exists",
                    ));
                }
                let expires_at_ms = now.saturating_add(*ttl_ms);
                self.tokens.insert(
                    token_id.clone(),
                    Token {
                        token_id: token_id.clone(),
                        hash: hash.clone(),
                        created_at_ms: now,
                        expires_at_ms,
                        note: note.clone(),
                        cancelled_at_ms: None,
                        claim: None,
                    },
                );
                Ok(Outcome::TokenCreated {
                    token_id: token_id.clone(),
                    created_at_ms: now,
                    expires_at_ms,
                })
            }
            Command::CancelToken { token_id } => {
                let Some(t) = self.tokens.get_mut(token_id) else {
                    return Err(Refusal::new(
                        404,
                        "enrollment_not_found",
                        "no enrolment token with this id",
                    ));
                };
                if t.claim.is_some() {
                    return Err(Refusal::new(
                        409,
                        "enrollment_claimed",
                        "the token was already claimed; revoke the node's credential instead",
                    ));
                }
                if t.cancelled_at_ms.is_none() {
                    t.cancelled_at_ms = Some(now);
                    self.journal.0.push(Fact::TokenCancelled {
                        token_id: token_id.clone(),
                        at_ms: now,
                    });
                }
                Ok(Outcome::TokenCancelled {
                    token_id: token_id.clone(),
                })
            }
            Command::Enroll {
                token_id,
                public_key,
                hostname,
                inventory,
                new_node_id,
                credential_id,
                credential_hash,
            } => self.enroll(
                now,
                token_id,
                public_key,
                hostname,
                inventory,
                new_node_id,
                credential_id,
                credential_hash,
            ),
            Command::RevokeCredentials { node_id, reason } => {
                if !self.nodes.contains_key(node_id) {
                    return Err(Refusal::new(404, "node_not_found", "no node with this id"));
                }
                let active = self.active_credential_ids(node_id);
                for c in &active {
                    self.revoke(now, c, reason, true);
                }
                Ok(Outcome::Revoked {
                    credential_ids: active,
                })
            }
            Command::TouchCredentials { uses } => {
                let mut count = 0;
                for (id, at) in uses {
                    let Some(c) = self.credentials.get_mut(id) else {
                        continue;
                    };
                    let at = (*at).min(now);
                    let first = c.last_used_at_ms.is_none();
                    c.last_used_at_ms = Some(c.last_used_at_ms.map_or(at, |old| old.max(at)));
                    count += 1;
                    if first {
                        let token_id = c.token_id.clone();
                        self.spend_claim(now, token_id.as_deref(), id);
                    }
                }
                Ok(Outcome::Touched { count })
            }
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
                    if let Some(node) = self.nodes.get_mut(node_id) {
                        push_history_n(node, now, kind, detail.clone(), (*n).max(1));
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
            } => self.execute_decommission(now, preview_id, node_id, reason),
            Command::UpdateInventory { node_id, inventory } => {
                let Some(node) = self.nodes.get_mut(node_id) else {
                    return Err(Refusal::new(404, "node_not_found", "no node with this id"));
                };
                if node.decommissioned_at_ms.is_some() {
                    return Err(Refusal::new(
                        409,
                        "node_decommissioned",
                        "the node is decommissioned",
                    ));
                }
                Ok(Outcome::InventoryUpdated {
                    changed: set_inventory(node, now, inventory),
                })
            }
        }
    }

    #[allow(clippy::too_many_arguments)] // the fields of one enrolment command
    fn enroll(
        &mut self,
        now: i64,
        token_id: &str,
        public_key: &str,
        hostname: &str,
        inventory: &Inventory,
        new_node_id: &str,
        credential_id: &str,
        credential_hash: &str,
    ) -> ApplyResult {
        let invalid = || {
            Refusal::new(
                401,
                "invalid_token",
                "the enrolment token is unknown, expired, cancelled or already claimed",
            )
        };
        let Some(token) = self.tokens.get(token_id) else {
            return Err(invalid());
        };
        if token.cancelled_at_ms.is_some() {
            return Err(Refusal::new(
                401,
                "token_cancelled",
                "the enrolment token was cancelled",
            ));
        }
        if now > token.expires_at_ms {
            return Err(Refusal::new(
                401,
                "token_expired",
                "the enrolment token has expired",
            ));
        }
        if self.credentials.contains_key(credential_id) {
            return Err(Refusal::new(
                409,
                "credential_exists",
                "credential id collision; retry",
            ));
        }
        let existing = self.identities.get(public_key).cloned();
        if let Some(nid) = &existing
            && self
                .nodes
                .get(nid)
                .is_some_and(|n| n.decommissioned_at_ms.is_some())
        {
            return Err(Refusal::new(
                403,
                "identity_decommissioned",
                "this identity belongs to a decommissioned node and can never enrol again",
            ));
        }
        let retry = match &token.claim {
            None => false,
            Some(claim) => {
                let delivered = self
                    .credentials
                    .get(&claim.credential_id)
                    .is_some_and(|c| c.last_used_at_ms.is_some() || c.revoked_at_ms.is_some());
                if claim.public_key != public_key || claim.spent || delivered {
                    return Err(Refusal::new(
                        401,
                        "token_already_claimed",
                        "the enrolment token was already claimed",
                    ));
                }
                true
            }
        };
        let claimed_credential = token.claim.as_ref().map(|c| c.credential_id.clone());
        let (node_id, reenrolled) = match existing {
            Some(nid) => (nid, true),
            None => {
                if self.nodes.contains_key(new_node_id) {
                    return Err(Refusal::new(
                        409,
                        "node_id_exists",
                        "node id collision; retry",
                    ));
                }
                self.identities
                    .insert(public_key.to_string(), new_node_id.to_string());
                self.nodes.insert(
                    new_node_id.to_string(),
                    Node {
                        node_id: new_node_id.to_string(),
                        hostname: hostname.to_string(),
                        public_key: public_key.to_string(),
                        enabled: true,
                        decommissioned_at_ms: None,
                        created_at_ms: now,
                        enrolled_at_ms: now,
                        inventory: Inventory::default(),
                        inventory_digest: inventory_digest(&Inventory::default()),
                        credential_ids: Vec::new(),
                        history: VecDeque::new(),
                    },
                );
                self.index_hostname(hostname, new_node_id);
                let others: Vec<String> = self
                    .enabled_claimants(hostname)
                    .into_iter()
                    .filter(|n| n != new_node_id)
                    .collect();
                for other in &others {
                    if let Some(o) = self.nodes.get_mut(other) {
                        push_history(o, now, "hostname_conflict", new_node_id.to_string());
                    }
                }
                if let Some(n) = self.nodes.get_mut(new_node_id) {
                    for other in others {
                        push_history(n, now, "hostname_conflict", other);
                    }
                }
                (new_node_id.to_string(), false)
            }
        };
        // Every older credential of the node is revoked in this same step. A claim retry
        // revokes only the undelivered credential and leaves the token claimable by the same
        // identity; any other supersession spends the token the old credential came from.
        let old = self.active_credential_ids(&node_id);
        for c in &old {
            let undelivered_retry = retry && claimed_credential.as_ref() == Some(c);
            let reason = if undelivered_retry {
                "superseded by a retry of the same claim"
            } else {
                "superseded by re-enrolment"
            };
            self.revoke(now, c, reason, !undelivered_retry);
        }
        self.credentials.insert(
            credential_id.to_string(),
            Credential {
                credential_id: credential_id.to_string(),
                node_id: node_id.clone(),
                hash: credential_hash.to_string(),
                created_at_ms: now,
                last_used_at_ms: None,
                revoked_at_ms: None,
                revoked_reason: None,
                token_id: Some(token_id.to_string()),
            },
        );
        let token = self
            .tokens
            .get_mut(token_id)
            .expect("token looked up above");
        match &mut token.claim {
            Some(claim) => claim.credential_id = credential_id.to_string(),
            None => {
                token.claim = Some(Claim {
                    node_id: node_id.clone(),
                    public_key: public_key.to_string(),
                    credential_id: credential_id.to_string(),
                    claimed_at_ms: now,
                    spent: false,
                });
                self.journal.0.push(Fact::TokenClaimed {
                    token_id: token_id.to_string(),
                    node_id: node_id.clone(),
                    public_key: public_key.to_string(),
                    at_ms: now,
                });
            }
        }
        let node = self
            .nodes
            .get_mut(&node_id)
            .expect("node exists or was created above");
        node.credential_ids.push(credential_id.to_string());
        node.enrolled_at_ms = now;
        if node.hostname != hostname {
            let old = std::mem::replace(&mut node.hostname, hostname.to_string());
            let enabled = node.enabled;
            push_history(
                node,
                now,
                "hostname_changed",
                format!("{old} -> {hostname}"),
            );
            if enabled {
                self.unindex_hostname(&old, &node_id);
                self.index_hostname(hostname, &node_id);
            }
        }
        let node = self.nodes.get_mut(&node_id).expect("node looked up above");
        let kind = if retry {
            "enrolment_retried"
        } else if reenrolled {
            "re-enrolled"
        } else {
            "enrolled"
        };
        push_history(node, now, kind, format!("token {token_id}"));
        push_history(node, now, "credential_issued", credential_id.to_string());
        set_inventory(node, now, inventory);
        if reenrolled && !retry {
            // Recovered by the runbook: offered to the scheduler only after a passing smoke.
            self.sched.smoke_required.insert(node_id.clone());
        }
        Ok(Outcome::Enrolled {
            node_id,
            credential_id: credential_id.to_string(),
            reenrolled: reenrolled || retry,
        })
    }

    /// Revoke one credential (idempotent). With `spend`, the claim it came from is spent too.
    fn revoke(&mut self, now: i64, credential_id: &str, reason: &str, spend: bool) {
        let Some(c) = self.credentials.get_mut(credential_id) else {
            return;
        };
        if c.revoked_at_ms.is_some() {
            return;
        }
        c.revoked_at_ms = Some(now);
        c.revoked_reason = Some(reason.to_string());
        let (node_id, token_id) = (c.node_id.clone(), c.token_id.clone());
        self.journal.0.push(Fact::CredentialRevoked {
            credential_id: credential_id.to_string(),
            node_id: node_id.clone(),
            at_ms: now,
            reason: reason.to_string(),
        });
        if spend {
            self.spend_claim(now, token_id.as_deref(), credential_id);
        }
        if let Some(node) = self.nodes.get_mut(&node_id) {
            push_history(
                node,
                now,
                "credential_revoked",
                format!("{credential_id}: {reason}"),
            );
        }
    }

    fn spend_claim(&mut self, now: i64, token_id: Option<&str>, credential_id: &str) {
        if let Some(claim) = token_id
            .and_then(|t| self.tokens.get_mut(t))
            .and_then(|t| t.claim.as_mut())
            && claim.credential_id == credential_id
            && !claim.spent
        {
            claim.spent = true;
            self.journal.0.push(Fact::TokenSpent {
                token_id: token_id.unwrap_or_default().to_string(),
                at_ms: now,
            });
        }
    }

    /// Active (unrevoked) credentials of a node.
    pub fn active_credentials(&self, node_id: &str) -> Vec<&Credential> {
        self.nodes
            .get(node_id)
            .map(|n| {
                n.credential_ids
                    .iter()
                    .filter_map(|c| self.credentials.get(c))
                    .filter(|c| c.revoked_at_ms.is_none())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Enabled nodes claiming `hostname`, in id order.
    pub fn enabled_claimants(&self, hostname: &str) -> Vec<String> {
        self.enabled_by_hostname
            .get(hostname)
            .map(|ids| ids.iter().cloned().collect())
            .unwrap_or_default()
    }

    fn index_hostname(&mut self, hostname: &str, node_id: &str) {
        self.enabled_by_hostname
            .entry(hostname.to_string())
            .or_default()
            .insert(node_id.to_string());
    }

    fn unindex_hostname(&mut self, hostname: &str, node_id: &str) {
        if let Some(ids) = self.enabled_by_hostname.get_mut(hostname) {
            ids.remove(node_id);
            if ids.is_empty() {
                self.enabled_by_hostname.remove(hostname);
            }
        }
    }

    /// Whether the hostname index matches the nodes.
    #[cfg(test)]
    pub fn hostname_index_matches_nodes(&self) -> bool {
        let mut expected: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for n in self.nodes.values().filter(|n| n.enabled) {
            expected
                .entry(n.hostname.clone())
                .or_default()
                .insert(n.node_id.clone());
        }
        expected == self.enabled_by_hostname
    }

    /// What decommissioning `node_id` would change now; `None` for an unknown node.
    pub fn decommission_effects(&self, node_id: &str) -> Option<DecommissionEffects> {
        let node = self.nodes.get(node_id)?;
        Some(DecommissionEffects {
            node_id: node_id.to_string(),
            hostname: node.hostname.clone(),
            identity_public_key: node.public_key.clone(),
            credentials_to_revoke: self.active_credential_ids(node_id),
            hostname_conflicts_resolved: self
                .enabled_claimants(&node.hostname)
                .into_iter()
                .filter(|n| n != node_id)
                .collect(),
            claims_to_spend: self
                .tokens
                .values()
                .filter(|t| {
                    t.claim
                        .as_ref()
                        .is_some_and(|c| c.node_id == node_id && !c.spent)
                })
                .map(|t| t.token_id.clone())
                .collect(),
            allocations_to_release: self
                .sched
                .allocations
                .values()
                .filter(|a| a.node_id == node_id)
                .map(|a| a.allocation_id.clone())
                .collect(),
            accelerators: node
                .inventory
                .accelerators
                .iter()
                .map(|a| a.uuid.clone())
                .collect(),
        })
    }

    /// Drop expired previews, then the oldest beyond [`PREVIEWS_MAX`]. Deterministic.
    fn prune_previews(&mut self, now: i64) {
        self.previews.retain(|_, p| p.expires_at_ms >= now);
        while self.previews.len() > PREVIEWS_MAX {
            let oldest = self
                .previews
                .values()
                .min_by(|a, b| {
                    (a.created_at_ms, &a.preview_id).cmp(&(b.created_at_ms, &b.preview_id))
                })
                .map(|p| p.preview_id.clone());
            match oldest {
                Some(id) => self.previews.remove(&id),
                None => break,
            };
        }
    }

    fn preview_decommission(&mut self, now: i64, preview_id: &str, node_id: &str) -> ApplyResult {
        self.prune_previews(now);
        let Some(node) = self.nodes.get(node_id) else {
            return Err(Refusal::new(404, "node_not_found", "no node with this id"));
        };
        if node.decommissioned_at_ms.is_some() {
            return Err(Refusal::new(
                409,
                "node_decommissioned",
                "the node is already decommissioned",
            ));
        }
        if self.previews.contains_key(preview_id) {
            return Err(Refusal::new(
                409,
                "preview_exists",
                "preview id collision; retry",
            ));
        }
        let effects = self
            .decommission_effects(node_id)
            .expect("node looked up above");
        let preview = DecommissionPreview {
            preview_id: preview_id.to_string(),
            node_id: node_id.to_string(),
            created_at_ms: now,
            expires_at_ms: now.saturating_add(PREVIEW_TTL_MS),
            fingerprint: effects.fingerprint(),
            effects,
            used_at_ms: None,
        };
        self.previews
            .insert(preview_id.to_string(), preview.clone());
        self.prune_previews(now);
        Ok(Outcome::DecommissionPreviewed {
            preview: Box::new(preview),
        })
    }

    fn execute_decommission(
        &mut self,
        now: i64,
        preview_id: &str,
        node_id: &str,
        reason: &str,
    ) -> ApplyResult {
        let Some(node) = self.nodes.get(node_id) else {
            return Err(Refusal::new(404, "node_not_found", "no node with this id"));
        };
        if node.decommissioned_at_ms.is_some() {
            return Err(Refusal::new(
                409,
                "node_decommissioned",
                "the node is already decommissioned",
            ));
        }
        let Some(preview) = self.previews.get(preview_id) else {
            return Err(Refusal::new(
                404,
                "preview_not_found",
                "no decommission preview with this id (previews expire after 15 minutes); preview again",
            ));
        };
        if preview.node_id != node_id {
            return Err(Refusal::new(
                409,
                "preview_for_other_node",
                format!("preview {preview_id} is for node {}", preview.node_id),
            ));
        }
        if preview.used_at_ms.is_some() {
            return Err(Refusal::new(
                409,
                "preview_used",
                "this preview was already executed",
            ));
        }
        if now > preview.expires_at_ms {
            return Err(Refusal::new(
                409,
                "preview_expired",
                "the preview expired (15 minutes); preview again",
            ));
        }
        let effects = self
            .decommission_effects(node_id)
            .expect("node looked up above");
        if effects.fingerprint() != preview.fingerprint {
            let changes = preview.effects.changes(&effects);
            return Err(Refusal::new(
                409,
                "preview_stale",
                format!(
                    "the state changed since the preview; preview again. Changed: {}",
                    changes.join("; ")
                ),
            ));
        }
        let why = format!("decommissioned: {reason}");
        for c in &effects.credentials_to_revoke {
            self.revoke(now, c, &why, true);
        }
        for t in &effects.claims_to_spend {
            if let Some(claim) = self.tokens.get_mut(t).and_then(|t| t.claim.as_mut()) {
                claim.spent = true;
            }
        }
        for other in &effects.hostname_conflicts_resolved {
            if let Some(o) = self.nodes.get_mut(other) {
                push_history(o, now, "hostname_conflict_resolved", node_id.to_string());
            }
        }
        let node = self.nodes.get_mut(node_id).expect("node looked up above");
        node.enabled = false;
        node.decommissioned_at_ms = Some(now);
        push_history(node, now, "decommissioned", reason.to_string());
        let public_key = node.public_key.clone();
        let hostname = node.hostname.clone();
        self.unindex_hostname(&hostname, node_id);
        self.journal.0.push(Fact::NodeDecommissioned {
            node_id: node_id.to_string(),
            public_key,
            at_ms: now,
        });
        // Nothing stays placed on hardware leaving service (the fingerprint matched, so these
        // are all the node's allocations).
        for id in &effects.allocations_to_release {
            let _ = self.release(now, id, "node decommissioned");
        }
        self.sched.smoke_required.remove(node_id);
        if let Some(p) = self.previews.get_mut(preview_id) {
            p.used_at_ms = Some(now);
        }
        Ok(Outcome::Decommissioned {
            node_id: node_id.to_string(),
            decommissioned_at_ms: now,
            effects: Box::new(effects),
        })
    }

    /// Ids of a node's active credentials, owned (for revoking them).
    fn active_credential_ids(&self, node_id: &str) -> Vec<String> {
        self.active_credentials(node_id)
            .iter()
            .map(|c| c.credential_id.clone())
            .collect()
    }

    /// Re-apply one journal fact to a restored state (see `journal.rs`): idempotent, and
    /// never un-does anything. Returns what it changed, or None when the state already held
    /// the fact or does not know its object (decided after the backup: nothing to re-apply).
    pub fn reapply(&mut self, fact: &Fact) -> Option<String> {
        const WHY: &str = "re-applied from the revocation journal after a restore";
        match fact {
            Fact::CredentialRevoked {
                credential_id,
                at_ms,
                reason,
                ..
            } => {
                let active = self
                    .credentials
                    .get(credential_id)
                    .is_some_and(|c| c.revoked_at_ms.is_none());
                if !active {
                    return None;
                }
                self.revoke(*at_ms, credential_id, &format!("{reason} ({WHY})"), true);
                Some(format!("credential {credential_id} revoked"))
            }
            Fact::TokenClaimed {
                token_id,
                node_id,
                public_key,
                at_ms,
            } => {
                let t = self.tokens.get_mut(token_id)?;
                if t.claim.as_ref().is_some_and(|c| c.spent) {
                    return None;
                }
                // The claim's credential is not in the backup: the token refuses everyone.
                let claim = t.claim.get_or_insert_with(|| Claim {
                    node_id: node_id.clone(),
                    public_key: public_key.clone(),
                    credential_id: String::new(),
                    claimed_at_ms: *at_ms,
                    spent: true,
                });
                claim.spent = true;
                Some(format!(
                    "token {token_id} spent (claimed by node {node_id})"
                ))
            }
            Fact::TokenSpent { token_id, at_ms } => {
                let t = self.tokens.get_mut(token_id)?;
                match &mut t.claim {
                    Some(c) if c.spent => None,
                    Some(c) => {
                        c.spent = true;
                        Some(format!("token {token_id} spent"))
                    }
                    None => {
                        // Claimed and spent after the backup, with no claim line: cancel it.
                        t.cancelled_at_ms.get_or_insert(*at_ms);
                        Some(format!(
                            "token {token_id} cancelled (spent after the backup)"
                        ))
                    }
                }
            }
            Fact::TokenCancelled { token_id, at_ms } => {
                let t = self.tokens.get_mut(token_id)?;
                if t.cancelled_at_ms.is_some() || t.claim.is_some() {
                    return None;
                }
                t.cancelled_at_ms = Some(*at_ms);
                Some(format!("token {token_id} cancelled"))
            }
            Fact::NodeDecommissioned { node_id, at_ms, .. } => {
                let node = self.nodes.get_mut(node_id)?;
                if node.decommissioned_at_ms.is_some() {
                    return None;
                }
                node.decommissioned_at_ms = Some(*at_ms);
                node.enabled = false;
                push_history(node, *at_ms, "decommissioned", WHY.to_string());
                let hostname = node.hostname.clone();
                self.unindex_hostname(&hostname, node_id);
                for c in self.active_credential_ids(node_id) {
                    self.revoke(*at_ms, &c, "node decommissioned", true);
                }
                Some(format!("node {node_id} decommissioned"))
            }
        }
    }

    /// A digest of the whole state, to compare members.
    pub fn digest(&self) -> String {
        let bytes = modelforge_raft::codec::encode(self).unwrap_or_default();
        modelforge_proto::hex(&sha2::Sha256::digest(&bytes))
    }
}

/// Replace a node's inventory; record appeared/disappeared accelerators. Returns whether it changed.
fn set_inventory(node: &mut Node, now: i64, inventory: &Inventory) -> bool {
    let digest = inventory_digest(inventory);
    if digest == node.inventory_digest {
        return false;
    }
    let old: Vec<&str> = node
        .inventory
        .accelerators
        .iter()
        .map(|a| a.uuid.as_str())
        .collect();
    let new: Vec<&str> = inventory
        .accelerators
        .iter()
        .map(|a| a.uuid.as_str())
        .collect();
    let appeared: Vec<String> = new
        .iter()
        .filter(|u| !old.contains(u))
        .map(|u| u.to_string())
        .collect();
    let gone: Vec<String> = old
        .iter()
        .filter(|u| !new.contains(u))
        .map(|u| u.to_string())
        .collect();
    node.inventory = inventory.clone();
    node.inventory_digest = digest;
    for u in appeared {
        push_history(node, now, "accelerator_appeared", u);
    }
    for u in gone {
        push_history(node, now, "accelerator_disappeared", u);
    }
    true
}

/// Append to a node's bounded history, folding a repeat of the latest event into it.
pub fn push_history(node: &mut Node, now: i64, kind: &str, detail: String) {
    push_history_n(node, now, kind, detail, 1)
}

/// [`push_history`] for `n` identical events at once.
pub fn push_history_n(node: &mut Node, now: i64, kind: &str, detail: String, n: u32) {
    if let Some(last) = node.history.back_mut()
        && last.kind == kind
        && last.detail == detail
    {
        last.count = last.count.saturating_add(n);
        last.at_ms = now;
        return;
    }
    node.history.push_back(HistoryEvent {
        at_ms: now,
        kind: kind.to_string(),
        detail,
        count: n,
    });
    while node.history.len() > HISTORY_PER_NODE {
        node.history.pop_front();
    }
}

/// The chained hash of an audit event: SHA-256 over the previous hash and every field.
pub fn audit_hash(ev: &AuditEvent) -> String {
    let mut h = sha2::Sha256::new();
    for part in [
        ev.prev_hash.as_str(),
        &ev.seq.to_string(),
        &ev.at_ms.to_string(),
        &ev.actor,
        &ev.action,
        &ev.target,
        &ev.result,
        &ev.request_id,
        &ev.log_index.to_string(),
    ] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    modelforge_proto::hex(&h.finalize())
}

/// Check the audit chain; returns the first broken sequence number.
pub fn verify_audit_chain(events: &[AuditEvent]) -> Result<(), u64> {
    let mut prev = "0".repeat(64);
    for (i, ev) in events.iter().enumerate() {
        if ev.seq != i as u64 + 1 || ev.prev_hash != prev || audit_hash(ev) != ev.hash {
            return Err(ev.seq);
        }
        prev = ev.hash.clone();
    }
    Ok(())
}

#[cfg(test)]
mod tests;
