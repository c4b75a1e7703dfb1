//! Enrolment and credentials: tokens are created, cancelled and claimed; a claim mints one
//! node identity and issues its credential; credentials are used, superseded and revoked.
//!
//! Invariants (checked by `State::check`): one token mints at most one identity; one identity
//! maps to exactly one node; a node has at most one active credential, and only an enabled node
//! has one; a revoked credential is never un-revoked.

use std::collections::VecDeque;
use std::sync::Arc;

use modelforge_proto::api::ErrorCode as RefusalCode;

use super::ApplyResult;
use super::Claim;
use super::Command;
use super::Credential;
use super::Node;
use super::Outcome;
use super::Refusal;
use super::State;
use super::Token;
use super::model::inventory_digest;
use super::model::push_history;
use super::model::set_inventory;
use crate::journal::Fact;
use modelforge_proto::ids::CredentialId;
use modelforge_proto::ids::HistoryKind;
use modelforge_proto::ids::NodeId;
use modelforge_proto::ids::TokenId;
use modelforge_proto::wire::Inventory;

impl State {
    /// Whether `token_id` can be claimed by `public_key` at `now`: the token exists, is not
    /// cancelled or expired, and is unclaimed or claimed by this identity with a credential
    /// nobody used or revoked yet (a retry). The enrolment handler asks it before the argon2
    /// check, and apply asks it again.
    pub fn check_claim(
        &self,
        token_id: &TokenId,
        public_key: &str,
        proof_signed_at_ms: i64,
        now: i64,
    ) -> Result<&Token, Refusal> {
        let Some(token) = self.tokens.get(token_id) else {
            return Err(Refusal::new(RefusalCode::InvalidToken));
        };
        if token.cancelled_at_ms.is_some() {
            return Err(Refusal::new(RefusalCode::TokenCancelled));
        }
        if now > token.expires_at_ms {
            return Err(Refusal::new(RefusalCode::TokenExpired));
        }
        if let Some(claim) = &token.claim {
            let delivered = self
                .credentials
                .get(&claim.credential_id)
                .is_some_and(|c| c.last_used_at_ms.is_some() || c.revoked_at_ms.is_some());
            if claim.public_key != public_key || claim.spent || delivered {
                return Err(Refusal::new(RefusalCode::TokenAlreadyClaimed));
            }
            if proof_signed_at_ms <= claim.proof_signed_at_ms {
                return Err(Refusal::with(
                    RefusalCode::TokenAlreadyClaimed,
                    "a retry of a claim must carry an identity proof signed later than the last one accepted (a replayed request is refused)",
                ));
            }
        }
        Ok(token)
    }

    /// Whether `token_id` can be cancelled: it exists and nobody claimed it.
    pub fn check_cancel(&self, token_id: &TokenId) -> Result<&Token, Refusal> {
        let Some(token) = self.tokens.get(token_id) else {
            return Err(Refusal::new(RefusalCode::EnrollmentNotFound));
        };
        if token.claim.is_some() {
            return Err(Refusal::new(RefusalCode::EnrollmentClaimed));
        }
        Ok(token)
    }

    pub(super) fn create_token(
        &mut self,
        now: i64,
        token_id: &TokenId,
        hash: &str,
        ttl_ms: i64,
        note: &Option<String>,
    ) -> ApplyResult {
        if self.tokens.contains_key(token_id) {
            return Err(Refusal::new(RefusalCode::TokenExists));
        }
        let expires_at_ms = now.saturating_add(ttl_ms);
        self.tokens.insert(
            token_id.clone(),
            Arc::new(Token {
                token_id: token_id.clone(),
                hash: hash.to_string(),
                created_at_ms: now,
                expires_at_ms,
                note: note.clone(),
                cancelled_at_ms: None,
                claim: None,
            }),
        );
        Ok(Outcome::TokenCreated {
            token_id: token_id.clone(),
            created_at_ms: now,
            expires_at_ms,
        })
    }

    pub(super) fn cancel_token(
        &mut self,
        facts: &mut Vec<Fact>,
        now: i64,
        token_id: &TokenId,
    ) -> ApplyResult {
        self.check_cancel(token_id)?;
        let t = self
            .tokens
            .get_mut(token_id)
            .map(Arc::make_mut)
            .expect("checked above");
        if t.cancelled_at_ms.is_none() {
            t.cancelled_at_ms = Some(now);
            facts.push(Fact::TokenCancelled {
                token_id: token_id.clone(),
                at_ms: now,
            });
        }
        Ok(Outcome::TokenCancelled {
            token_id: token_id.clone(),
        })
    }

    pub(super) fn revoke_node(
        &mut self,
        facts: &mut Vec<Fact>,
        now: i64,
        node_id: &NodeId,
        reason: &str,
    ) -> ApplyResult {
        if !self.nodes.contains_key(node_id) {
            return Err(Refusal::new(RefusalCode::NodeNotFound));
        }
        let active = self.active_credential_ids(node_id);
        for c in &active {
            self.revoke(facts, now, c, reason, true);
        }
        Ok(Outcome::Revoked {
            credential_ids: active,
        })
    }

    /// Coalesced `last_used_at` updates; a credential's first use spends its claim.
    pub(super) fn touch(
        &mut self,
        facts: &mut Vec<Fact>,
        now: i64,
        uses: &[(CredentialId, i64)],
    ) -> ApplyResult {
        let mut count = 0;
        for (id, at) in uses {
            let Some(c) = self.credentials.get_mut(id).map(Arc::make_mut) else {
                continue;
            };
            let at = (*at).min(now);
            let first = c.last_used_at_ms.is_none();
            c.last_used_at_ms = Some(c.last_used_at_ms.map_or(at, |old| old.max(at)));
            count += 1;
            if first {
                let token_id = c.token_id.clone();
                self.spend_claim(facts, now, token_id.as_ref(), id);
            }
        }
        Ok(Outcome::Touched { count })
    }

    /// Apply an enrolment (`command` is a [`Command::Enroll`]; anything else is refused).
    pub(super) fn enroll(
        &mut self,
        facts: &mut Vec<Fact>,
        now: i64,
        command: &Command,
    ) -> ApplyResult {
        let Command::Enroll {
            token_id,
            public_key,
            hostname,
            inventory,
            new_node_id,
            credential_id,
            credential_hash,
            proof_signed_at_ms,
        } = command
        else {
            return Err(Refusal::new(RefusalCode::BadCommand));
        };
        let (public_key, hostname) = (public_key.as_str(), hostname.as_str());
        let retry = self
            .check_claim(token_id, public_key, *proof_signed_at_ms, now)?
            .claim
            .is_some();
        if self.credentials.contains_key(credential_id) {
            return Err(Refusal::new(RefusalCode::CredentialExists));
        }
        let existing = self.identities.get(public_key).cloned();
        if let Some(nid) = &existing
            && self
                .nodes
                .get(nid)
                .is_some_and(|n| n.decommissioned_at_ms.is_some())
        {
            return Err(Refusal::new(RefusalCode::IdentityDecommissioned));
        }
        let token = &self.tokens[token_id];
        let claimed_credential = token.claim.as_ref().map(|c| c.credential_id.clone());
        let (node_id, reenrolled) = match existing {
            Some(nid) => (nid, true),
            None => {
                if self.nodes.contains_key(new_node_id) {
                    return Err(Refusal::new(RefusalCode::NodeIdExists));
                }
                self.identities
                    .insert(public_key.to_string(), new_node_id.clone());
                self.nodes.insert(
                    new_node_id.clone(),
                    Arc::new(Node {
                        node_id: new_node_id.clone(),
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
                    }),
                );
                self.index_hostname(hostname, new_node_id);
                let others: Vec<NodeId> = self
                    .enabled_claimants(hostname)
                    .into_iter()
                    .filter(|n| n != new_node_id)
                    .collect();
                for other in &others {
                    if let Some(o) = self.nodes.get_mut(other).map(Arc::make_mut) {
                        push_history(
                            o,
                            now,
                            HistoryKind::HostnameConflict,
                            new_node_id.to_string(),
                        );
                    }
                }
                if let Some(n) = self.nodes.get_mut(new_node_id).map(Arc::make_mut) {
                    for other in others {
                        push_history(n, now, HistoryKind::HostnameConflict, other.into_string());
                    }
                }
                (new_node_id.clone(), false)
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
            self.revoke(facts, now, c, reason, !undelivered_retry);
        }
        self.credentials.insert(
            credential_id.clone(),
            Arc::new(Credential {
                credential_id: credential_id.clone(),
                node_id: node_id.clone(),
                hash: credential_hash.to_string(),
                created_at_ms: now,
                last_used_at_ms: None,
                revoked_at_ms: None,
                revoked_reason: None,
                token_id: Some(token_id.clone()),
            }),
        );
        let token = self
            .tokens
            .get_mut(token_id)
            .map(Arc::make_mut)
            .expect("token looked up above");
        match &mut token.claim {
            Some(claim) => {
                claim.credential_id = credential_id.clone();
                claim.proof_signed_at_ms = *proof_signed_at_ms;
            }
            None => {
                token.claim = Some(Claim {
                    node_id: node_id.clone(),
                    public_key: public_key.to_string(),
                    credential_id: credential_id.clone(),
                    claimed_at_ms: now,
                    spent: false,
                    proof_signed_at_ms: *proof_signed_at_ms,
                });
                facts.push(Fact::TokenClaimed {
                    token_id: token_id.clone(),
                    node_id: node_id.clone(),
                    public_key: public_key.to_string(),
                    at_ms: now,
                });
            }
        }
        let node = self
            .nodes
            .get_mut(&node_id)
            .map(Arc::make_mut)
            .expect("node exists or was created above");
        node.credential_ids.push(credential_id.clone());
        node.enrolled_at_ms = now;
        if node.hostname != hostname {
            let old = std::mem::replace(&mut node.hostname, hostname.to_string());
            let enabled = node.enabled;
            push_history(
                node,
                now,
                HistoryKind::HostnameChanged,
                format!("{old} -> {hostname}"),
            );
            if enabled {
                self.unindex_hostname(&old, &node_id);
                self.index_hostname(hostname, &node_id);
            }
        }
        let node = self
            .nodes
            .get_mut(&node_id)
            .map(Arc::make_mut)
            .expect("node looked up above");
        let kind = if retry {
            HistoryKind::EnrolmentRetried
        } else if reenrolled {
            HistoryKind::ReEnrolled
        } else {
            HistoryKind::Enrolled
        };
        push_history(node, now, kind, format!("token {token_id}"));
        push_history(
            node,
            now,
            HistoryKind::CredentialIssued,
            credential_id.to_string(),
        );
        set_inventory(node, now, inventory);
        if reenrolled && !retry {
            // Recovered by the runbook: offered to the scheduler only after a passing smoke.
            self.sched.smoke_required.insert(node_id.clone());
        }
        Ok(Outcome::Enrolled {
            node_id,
            credential_id: credential_id.clone(),
            reenrolled: reenrolled || retry,
        })
    }

    /// Revoke one credential (idempotent). With `spend`, the claim it came from is spent too.
    pub(super) fn revoke(
        &mut self,
        facts: &mut Vec<Fact>,
        now: i64,
        credential_id: &CredentialId,
        reason: &str,
        spend: bool,
    ) {
        let Some(c) = self.credentials.get_mut(credential_id).map(Arc::make_mut) else {
            return;
        };
        if c.revoked_at_ms.is_some() {
            return;
        }
        c.revoked_at_ms = Some(now);
        c.revoked_reason = Some(reason.to_string());
        let (node_id, token_id) = (c.node_id.clone(), c.token_id.clone());
        facts.push(Fact::CredentialRevoked {
            credential_id: credential_id.clone(),
            node_id: node_id.clone(),
            at_ms: now,
            reason: reason.to_string(),
        });
        if spend {
            self.spend_claim(facts, now, token_id.as_ref(), credential_id);
        }
        if let Some(node) = self.nodes.get_mut(&node_id).map(Arc::make_mut) {
            push_history(
                node,
                now,
                HistoryKind::CredentialRevoked,
                format!("{credential_id}: {reason}"),
            );
        }
    }

    pub(super) fn spend_claim(
        &mut self,
        facts: &mut Vec<Fact>,
        now: i64,
        token_id: Option<&TokenId>,
        credential_id: &CredentialId,
    ) {
        let Some(token_id) = token_id else {
            return;
        };
        if let Some(claim) = self
            .tokens
            .get_mut(token_id)
            .map(Arc::make_mut)
            .and_then(|t| t.claim.as_mut())
            && claim.credential_id == *credential_id
            && !claim.spent
        {
            claim.spent = true;
            facts.push(Fact::TokenSpent {
                token_id: token_id.clone(),
                at_ms: now,
            });
        }
    }

    /// Active (unrevoked) credentials of a node.
    pub fn active_credentials(&self, node_id: &NodeId) -> Vec<&Credential> {
        self.nodes
            .get(node_id)
            .map(|n| {
                n.credential_ids
                    .iter()
                    .filter_map(|c| self.credentials.get(c).map(|c| &**c))
                    .filter(|c| c.revoked_at_ms.is_none())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Ids of a node's active credentials, owned (for revoking them).
    pub(super) fn active_credential_ids(&self, node_id: &NodeId) -> Vec<CredentialId> {
        self.active_credentials(node_id)
            .iter()
            .map(|c| c.credential_id.clone())
            .collect()
    }
}
