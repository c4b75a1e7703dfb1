//! Retention: what the replicated state forgets, and when (ARCHITECTURE.md, "Bounded state").
//!
//! Once an hour of leader time (the first apply whose stamped clock enters a new hour, the
//! same entry on every replica, so pruning is as deterministic as the rest of apply), apply
//! drops what has been finished for longer than [`RETENTION_MS`]:
//! - credentials revoked that long ago (from the table and their node's list);
//! - enrolment tokens no longer pending (claimed, cancelled or expired) that long ago and that
//!   no remaining credential was issued on (a claimed token stays while its credential does);
//! - capability smokes finished that long ago;
//! - the history of a node decommissioned that long ago, but for its last
//!   [`DECOMMISSIONED_HISTORY`] events (the node itself stays, a tombstone that keeps its id
//!   and identity from ever being used again).
//!
//! - audit events older than that: they move to each member's archive file (the state keeps
//!   the chain's base, so the whole trail is still proven; see `audit.rs`).
//!
//! Nothing pruned can be used again: an unknown token or credential is refused exactly like a
//! spent or revoked one (401), so forgetting never lets anything back in.

use super::AuditEvent;
use super::CredentialId;
use super::NodeId;
use super::State;
use super::TokenId;
use super::sched::SmokeState;
use std::sync::Arc;

/// How long a finished token, revoked credential or finished smoke is kept.
pub const RETENTION_MS: i64 = 30 * 24 * 3600 * 1000;
/// Events kept in the history of a node decommissioned longer than [`RETENTION_MS`] ago.
pub const DECOMMISSIONED_HISTORY: usize = 8;
/// The most audit events one prune moves to the archive: a burst (100,000 enrolments in an
/// hour) leaves over the following hours instead of stalling apply for their whole move and
/// write (measured: 200,000 events, about 0.6 s).
pub const AUDIT_ARCHIVED_PER_PRUNE: usize = 10_000;
/// How often (in leader time) apply prunes.
pub const PRUNE_EVERY_MS: i64 = 3600 * 1000;

/// The environment variable that shortens [`RETENTION_MS`] for tests over real processes (a
/// month of retention seen in seconds). Never for production: every member of a cluster must
/// have the same value or their states diverge (which their state digests would show).
pub const TEST_RETENTION_ENV: &str = "MODELFORGE_TEST_RETENTION_MS";

/// The retention window and the pruning period this process applies: the constants, unless
/// [`TEST_RETENTION_ENV`] is set (then a quarter of it, at least 100 ms, between prunes). Read
/// once, so constant for the life of the process (apply stays a function of its input).
pub fn windows() -> (i64, i64) {
    static WINDOWS: std::sync::OnceLock<(i64, i64)> = std::sync::OnceLock::new();
    *WINDOWS.get_or_init(|| {
        match std::env::var(TEST_RETENTION_ENV)
            .ok()
            .and_then(|v| v.parse::<i64>().ok())
            .filter(|v| *v > 0)
        {
            Some(r) => (r, (r / 4).max(100)),
            None => (RETENTION_MS, PRUNE_EVERY_MS),
        }
    })
}

impl State {
    /// Prune if the clock, moving from `before` to the current clock, entered a new period;
    /// the audit events moved out of the state.
    pub(super) fn prune_on_the_hour(&mut self, before: i64) -> Vec<AuditEvent> {
        let every = windows().1;
        if before.div_euclid(every) != self.clock_ms.div_euclid(every) {
            return self.prune_finished(self.clock_ms);
        }
        Vec::new()
    }

    /// Drop what finished before `now - RETENTION_MS` (see the module's documentation); the
    /// audit events older than that leave the state for the archive and are returned.
    pub fn prune_finished(&mut self, now: i64) -> Vec<AuditEvent> {
        let cutoff = now - windows().0;
        let revoked: Vec<(CredentialId, NodeId)> = self
            .credentials
            .values()
            .filter(|c| c.revoked_at_ms.is_some_and(|at| at < cutoff))
            .map(|c| (c.credential_id.clone(), c.node_id.clone()))
            .collect();
        for (id, node) in revoked {
            self.credentials.remove(&id);
            if let Some(n) = self.nodes.get_mut(&node).map(Arc::make_mut) {
                n.credential_ids.retain(|c| *c != id);
            }
        }
        // A claimed token stays while a credential issued on it does: those are all on the
        // claim's node (a short list), so no pass over every credential is needed.
        let still_issued = |t: &super::Token| {
            t.claim.as_ref().is_some_and(|c| {
                // The claim's latest credential, most often still there: one lookup.
                self.credentials.contains_key(&c.credential_id)
                    || self.nodes.get(&c.node_id).is_some_and(|n| {
                        n.credential_ids.iter().any(|id| {
                            self.credentials
                                .get(id)
                                .is_some_and(|cr| cr.token_id.as_ref() == Some(&t.token_id))
                        })
                    })
            })
        };
        let ended: Vec<TokenId> = self
            .tokens
            .values()
            .filter(|t| {
                let ended_at = match (&t.claim, t.cancelled_at_ms) {
                    (Some(c), _) => Some(c.claimed_at_ms),
                    (None, Some(at)) => Some(at),
                    (None, None) => (now > t.expires_at_ms).then_some(t.expires_at_ms),
                };
                ended_at.is_some_and(|at| at < cutoff)
            })
            .filter(|t| !still_issued(t))
            .map(|t| t.token_id.clone())
            .collect();
        for id in ended {
            self.tokens.remove(&id);
        }
        let finished: Vec<_> = self
            .sched
            .smokes
            .values()
            .filter(|s| s.state != SmokeState::Pending)
            .filter(|s| s.finished_at_ms.is_some_and(|at| at < cutoff))
            .map(|s| s.smoke_id.clone())
            .collect();
        for id in finished {
            self.sched.smokes.remove(&id);
        }
        let retired: Vec<NodeId> = self
            .nodes
            .values()
            .filter(|n| n.decommissioned_at_ms.is_some_and(|at| at < cutoff))
            .filter(|n| n.history.len() > DECOMMISSIONED_HISTORY)
            .map(|n| n.node_id.clone())
            .collect();
        for id in retired {
            if let Some(n) = self.nodes.get_mut(&id).map(Arc::make_mut) {
                let drop = n.history.len() - DECOMMISSIONED_HISTORY;
                n.history.drain(..drop);
            }
        }
        self.archive_audit_before(cutoff, AUDIT_ARCHIVED_PER_PRUNE)
    }
}
