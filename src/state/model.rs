//! The model: tokens and their claims, nodes and their bounded history, credentials.

use std::collections::VecDeque;

use modelforge_proto::ids::CredentialId;
use modelforge_proto::ids::HistoryKind;
use modelforge_proto::ids::NodeId;
use modelforge_proto::ids::TokenId;
pub use modelforge_proto::ids::TokenState;
use modelforge_proto::wire::Inventory;
use serde::Deserialize;
use serde::Serialize;
use sha2::Digest;

use super::HISTORY_PER_NODE;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Claim {
    pub node_id: NodeId,
    pub public_key: String,
    /// The latest credential issued by this claim.
    pub credential_id: CredentialId,
    pub claimed_at_ms: i64,
    /// Set once a credential from this claim was used or revoked: no retry after that.
    pub spent: bool,
    /// The signing time of the identity proof of the last accepted request of this claim: a
    /// retry must be signed strictly later, so a captured request replayed byte for byte (same
    /// proof) never claims again.
    pub proof_signed_at_ms: i64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Token {
    pub token_id: TokenId,
    pub hash: String,
    pub created_at_ms: i64,
    pub expires_at_ms: i64,
    pub note: Option<String>,
    pub cancelled_at_ms: Option<i64>,
    pub claim: Option<Claim>,
}

impl Token {
    /// The token's state at `now_ms`.
    pub fn state_at(&self, now_ms: i64) -> TokenState {
        if self.claim.is_some() {
            TokenState::Claimed
        } else if self.cancelled_at_ms.is_some() {
            TokenState::Cancelled
        } else if now_ms > self.expires_at_ms {
            TokenState::Expired
        } else {
            TokenState::Pending
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct HistoryEvent {
    pub at_ms: i64,
    pub kind: HistoryKind,
    pub detail: String,
    /// How many identical events were folded into this one.
    pub count: u32,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Node {
    pub node_id: NodeId,
    pub hostname: String,
    pub public_key: String,
    pub enabled: bool,
    pub decommissioned_at_ms: Option<i64>,
    pub created_at_ms: i64,
    pub enrolled_at_ms: i64,
    pub inventory: Inventory,
    pub inventory_digest: String,
    /// Every credential ever issued to this node, oldest first.
    pub credential_ids: Vec<CredentialId>,
    pub history: VecDeque<HistoryEvent>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Credential {
    pub credential_id: CredentialId,
    pub node_id: NodeId,
    pub hash: String,
    pub created_at_ms: i64,
    pub last_used_at_ms: Option<i64>,
    pub revoked_at_ms: Option<i64>,
    pub revoked_reason: Option<String>,
    pub token_id: Option<TokenId>,
}

/// SHA-256 hex of an inventory's canonical JSON.
pub fn inventory_digest(inv: &Inventory) -> String {
    let json = serde_json::to_vec(inv).unwrap_or_default();
    modelforge_proto::hex(&sha2::Sha256::digest(&json))
}

/// Replace a node's inventory; record appeared/disappeared accelerators. Returns whether it changed.
pub(super) fn set_inventory(node: &mut Node, now: i64, inventory: &Inventory) -> bool {
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
        push_history(node, now, HistoryKind::AcceleratorAppeared, u);
    }
    for u in gone {
        push_history(node, now, HistoryKind::AcceleratorDisappeared, u);
    }
    true
}

/// Append to a node's bounded history, folding a repeat of the latest event into it.
pub fn push_history(node: &mut Node, now: i64, kind: HistoryKind, detail: String) {
    push_history_n(node, now, kind, detail, 1)
}

/// [`push_history`] for `n` identical events at once.
pub fn push_history_n(node: &mut Node, now: i64, kind: HistoryKind, detail: String, n: u32) {
    if let Some(last) = node.history.back_mut()
        && last.kind == kind
        && last.detail == detail
    {
        last.count = last.count.saturating_add(n);
        last.at_ms = now;
        return;
    }
    // Grown by a quarter, not doubled: a node's history is mostly a few events, and 100,000
    // half-empty buffers are memory for nothing (ARCHITECTURE.md, "Bounded state").
    if node.history.len() == node.history.capacity() {
        let more = (node.history.len() / 4).max(4);
        node.history.reserve_exact(
            more.min((HISTORY_PER_NODE + 1).saturating_sub(node.history.len()))
                .max(1),
        );
    }
    node.history.push_back(HistoryEvent {
        at_ms: now,
        kind,
        detail,
        count: n,
    });
    while node.history.len() > HISTORY_PER_NODE {
        node.history.pop_front();
    }
}
