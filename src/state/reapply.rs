//! Restore's re-application of journal facts (see `journal.rs`): what was decided after a
//! backup was taken, applied again to the restored state. Each fact is idempotent and never
//! un-does anything; a decommission goes through [`State::decommission_node`], the same code
//! an execute runs.

use super::Claim;
use super::State;
use crate::journal::Fact;
use modelforge_proto::ids::CredentialId;
use std::sync::Arc;

impl State {
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
                self.revoke(
                    &mut Vec::new(),
                    *at_ms,
                    credential_id,
                    &format!("{reason} ({WHY})"),
                    true,
                );
                Some(format!("credential {credential_id} revoked"))
            }
            Fact::TokenClaimed {
                token_id,
                node_id,
                public_key,
                at_ms,
            } => {
                let t = self.tokens.get_mut(token_id).map(Arc::make_mut)?;
                if t.claim.as_ref().is_some_and(|c| c.spent) {
                    return None;
                }
                // The claim's credential is not in the backup: the token refuses everyone.
                let claim = t.claim.get_or_insert_with(|| Claim {
                    node_id: node_id.clone(),
                    public_key: public_key.clone(),
                    credential_id: CredentialId::default(),
                    claimed_at_ms: *at_ms,
                    spent: true,
                    proof_signed_at_ms: i64::MAX,
                });
                claim.spent = true;
                Some(format!(
                    "token {token_id} spent (claimed by node {node_id})"
                ))
            }
            Fact::TokenSpent { token_id, at_ms } => {
                let t = self.tokens.get_mut(token_id).map(Arc::make_mut)?;
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
                let t = self.tokens.get_mut(token_id).map(Arc::make_mut)?;
                if t.cancelled_at_ms.is_some() || t.claim.is_some() {
                    return None;
                }
                t.cancelled_at_ms = Some(*at_ms);
                Some(format!("token {token_id} cancelled"))
            }
            Fact::NodeDecommissioned {
                node_id,
                at_ms,
                reason,
                ..
            } => {
                let reason = if reason.is_empty() {
                    WHY.to_string()
                } else {
                    format!("{reason} ({WHY})")
                };
                self.decommission_node(&mut Vec::new(), *at_ms, node_id, &reason)?;
                Some(format!("node {node_id} decommissioned"))
            }
        }
    }
}
