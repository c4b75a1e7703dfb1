//! Decommission: a preview computes and records what retiring a node would change, bound to
//! the state by a fingerprint; an execute applies it only while nothing it showed has changed.
//!
//! [`State::decommission_node`] is the one place that retires a node: executing a preview and
//! re-applying a journal's `NodeDecommissioned` fact after a restore both call it, so a restore
//! ends in the same node, credentials, allocations and smoke state as the execute did.

use modelforge_proto::api::ErrorCode as RefusalCode;
use modelforge_proto::ids::AllocationId;
use modelforge_proto::ids::CredentialId;
use modelforge_proto::ids::HistoryKind;
use modelforge_proto::ids::NodeId;
use modelforge_proto::ids::PreviewId;
use modelforge_proto::ids::TokenId;
use serde::Deserialize;
use serde::Serialize;
use sha2::Digest;
use std::sync::Arc;

use super::ApplyResult;
use super::Outcome;
use super::PREVIEW_TTL_MS;
use super::PREVIEWS_MAX;
use super::Refusal;
use super::State;
use super::model::push_history;
use crate::journal::Fact;

/// Everything decommissioning a node would change, as a preview shows it. Computed only by
/// [`State::decommission_effects`]; two computations are equal exactly when nothing the
/// preview showed has changed.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct DecommissionEffects {
    pub node_id: NodeId,
    pub hostname: String,
    /// The identity key that can never enrol again.
    pub identity_public_key: String,
    /// Active credentials to revoke.
    pub credentials_to_revoke: Vec<CredentialId>,
    /// Other enabled nodes claiming the same hostname: the conflict this resolves.
    pub hostname_conflicts_resolved: Vec<NodeId>,
    /// Enrolment tokens whose claim names this node and is not spent yet. Shown, spent by
    /// execute, but not bound by the fingerprint: a claim only ever goes from unspent to
    /// spent by the node's own first heartbeat (a new claim comes with a new credential,
    /// which the fingerprint does bind), and execute spends whatever remains.
    pub claims_to_spend: Vec<TokenId>,
    /// The scheduler's allocations placed on the node, released by execute.
    pub allocations_to_release: Vec<AllocationId>,
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

/// `[a, b]`: a list as a preview's change message shows it.
fn list<T: std::fmt::Display>(v: &[T]) -> String {
    let items: Vec<String> = v.iter().map(T::to_string).collect();
    format!("[{}]", items.join(", "))
}

/// A recorded decommission preview.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct DecommissionPreview {
    pub preview_id: PreviewId,
    pub node_id: NodeId,
    pub created_at_ms: i64,
    pub expires_at_ms: i64,
    pub effects: DecommissionEffects,
    pub fingerprint: String,
    /// Set when executed: a preview applies at most once.
    pub used_at_ms: Option<i64>,
}

impl State {
    /// What decommissioning `node_id` would change now; `None` for an unknown node.
    pub fn decommission_effects(&self, node_id: &NodeId) -> Option<DecommissionEffects> {
        let node = self.nodes.get(node_id)?;
        Some(DecommissionEffects {
            node_id: node_id.clone(),
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
    pub(super) fn prune_previews(&mut self, now: i64) {
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

    pub(super) fn preview_decommission(
        &mut self,
        now: i64,
        preview_id: &PreviewId,
        node_id: &NodeId,
    ) -> ApplyResult {
        self.prune_previews(now);
        let Some(node) = self.nodes.get(node_id) else {
            return Err(Refusal::new(RefusalCode::NodeNotFound));
        };
        if node.decommissioned_at_ms.is_some() {
            return Err(Refusal::with(
                RefusalCode::NodeDecommissioned,
                "the node is already decommissioned",
            ));
        }
        if self.previews.contains_key(preview_id) {
            return Err(Refusal::new(RefusalCode::PreviewExists));
        }
        let effects = self
            .decommission_effects(node_id)
            .expect("node looked up above");
        let preview = DecommissionPreview {
            preview_id: preview_id.clone(),
            node_id: node_id.clone(),
            created_at_ms: now,
            expires_at_ms: now.saturating_add(PREVIEW_TTL_MS),
            fingerprint: effects.fingerprint(),
            effects,
            used_at_ms: None,
        };
        self.previews.insert(preview_id.clone(), preview.clone());
        self.prune_previews(now);
        Ok(Outcome::DecommissionPreviewed {
            preview: Box::new(preview),
        })
    }

    /// Whether `preview_id` names a recorded preview of `node_id`, an existing node. The
    /// execute handler asks it before proposing (no replicated write for a request that names
    /// the wrong things), and apply asks it again.
    pub fn check_preview_target(
        &self,
        preview_id: &PreviewId,
        node_id: &NodeId,
    ) -> Result<&DecommissionPreview, Refusal> {
        if !self.nodes.contains_key(node_id) {
            return Err(Refusal::new(RefusalCode::NodeNotFound));
        }
        let Some(preview) = self.previews.get(preview_id) else {
            return Err(Refusal::new(RefusalCode::PreviewNotFound));
        };
        if preview.node_id != node_id {
            return Err(Refusal::with(
                RefusalCode::PreviewForOtherNode,
                format!("preview {preview_id} is for node {}", preview.node_id),
            ));
        }
        Ok(preview)
    }

    pub(super) fn execute_decommission(
        &mut self,
        facts: &mut Vec<Fact>,
        now: i64,
        preview_id: &PreviewId,
        node_id: &NodeId,
        reason: &str,
    ) -> ApplyResult {
        let preview = self.check_preview_target(preview_id, node_id)?;
        if self.nodes[node_id].decommissioned_at_ms.is_some() {
            return Err(Refusal::with(
                RefusalCode::NodeDecommissioned,
                "the node is already decommissioned",
            ));
        }
        if preview.used_at_ms.is_some() {
            return Err(Refusal::new(RefusalCode::PreviewUsed));
        }
        if now > preview.expires_at_ms {
            return Err(Refusal::new(RefusalCode::PreviewExpired));
        }
        let effects = self
            .decommission_effects(node_id)
            .expect("node looked up above");
        if effects.fingerprint() != preview.fingerprint {
            let changes = preview.effects.changes(&effects);
            return Err(Refusal::with(
                RefusalCode::PreviewStale,
                format!(
                    "the state changed since the preview; preview again. Changed: {}",
                    changes.join("; ")
                ),
            ));
        }
        self.decommission_node(facts, now, node_id, reason);
        if let Some(p) = self.previews.get_mut(preview_id) {
            p.used_at_ms = Some(now);
        }
        Ok(Outcome::Decommissioned {
            node_id: node_id.clone(),
            decommissioned_at_ms: now,
            effects: Box::new(effects),
        })
    }

    /// Retire `node_id` for good (no-op for an unknown or already retired node): revoke its
    /// credentials, spend its unspent claims, disable it and free its hostname, release its
    /// allocations and forget its smoke requirement. Returns the effects it applied.
    pub(super) fn decommission_node(
        &mut self,
        facts: &mut Vec<Fact>,
        now: i64,
        node_id: &NodeId,
        reason: &str,
    ) -> Option<DecommissionEffects> {
        let effects = self.decommission_effects(node_id)?;
        if self.nodes[node_id].decommissioned_at_ms.is_some() {
            return None;
        }
        let why = format!("decommissioned: {reason}");
        for c in &effects.credentials_to_revoke {
            self.revoke(facts, now, c, &why, true);
        }
        for t in &effects.claims_to_spend {
            if let Some(claim) = self
                .tokens
                .get_mut(t)
                .map(Arc::make_mut)
                .and_then(|t| t.claim.as_mut())
            {
                claim.spent = true;
            }
        }
        for other in &effects.hostname_conflicts_resolved {
            if let Some(o) = self.nodes.get_mut(other).map(Arc::make_mut) {
                push_history(
                    o,
                    now,
                    HistoryKind::HostnameConflictResolved,
                    node_id.to_string(),
                );
            }
        }
        let node = self
            .nodes
            .get_mut(node_id)
            .map(Arc::make_mut)
            .expect("looked up above");
        node.enabled = false;
        node.decommissioned_at_ms = Some(now);
        push_history(node, now, HistoryKind::Decommissioned, reason.to_string());
        let public_key = node.public_key.clone();
        let hostname = node.hostname.clone();
        self.unindex_hostname(&hostname, node_id);
        facts.push(Fact::NodeDecommissioned {
            node_id: node_id.clone(),
            public_key,
            at_ms: now,
            reason: reason.to_string(),
        });
        // Nothing stays placed on hardware leaving service.
        for id in &effects.allocations_to_release {
            let _ = self.release(now, id, "node decommissioned");
        }
        self.sched.smoke_required.remove(node_id);
        self.health.gpus.remove(node_id);
        self.health.cordons.remove(node_id);
        Some(effects)
    }
}
