//! The audit trail: one row per admin and enrolment action, each row hashing the one before.

use serde::Deserialize;
use serde::Serialize;
use sha2::Digest;

use super::State;

/// An audit row (the type is the API's record, shared with clients that verify the chain).
pub use modelforge_proto::api::AuditRecord as AuditEvent;

impl State {
    #[allow(clippy::too_many_arguments)] // one audit row has this many columns
    pub(super) fn audit(
        &mut self,
        now: i64,
        log_index: u64,
        actor: &str,
        action: &str,
        target: &str,
        result: &str,
        request_id: &str,
        reason: Option<&str>,
    ) {
        let seq = self.audit_base.count + self.audit.len() as u64 + 1;
        let prev_hash = self
            .audit
            .last()
            .map_or_else(|| self.audit_base.head.clone(), |e| e.hash.clone());
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
            reason: reason.map(str::to_string),
        };
        ev.hash = audit_hash(&ev);
        self.audit.push_back(ev);
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
    // Hashed only when present, so chains written before reasons were recorded still verify.
    if let Some(reason) = &ev.reason {
        h.update(b"reason");
        h.update((reason.len() as u64).to_le_bytes());
        h.update(reason.as_bytes());
    }
    modelforge_proto::hex(&h.finalize())
}

/// Where the live audit trail starts: how many events were moved to the archive and the hash
/// of the last of them (the chain's head as far as the archive goes; see ARCHITECTURE.md,
/// "The archive"). Replicated (positional codec).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct AuditBase {
    pub count: u64,
    pub head: String,
}

impl Default for AuditBase {
    fn default() -> Self {
        Self {
            count: 0,
            head: GENESIS.to_string(),
        }
    }
}

/// The `prev_hash` of the first event of every trail.
pub const GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// Check an audit chain that continues from `base`; returns the first broken sequence number.
pub fn verify_audit_chain<'a>(
    base: &AuditBase,
    events: impl IntoIterator<Item = &'a AuditEvent>,
) -> Result<(), u64> {
    let mut prev = base.head.clone();
    for (i, ev) in events.into_iter().enumerate() {
        if ev.seq != base.count + i as u64 + 1 || ev.prev_hash != prev || audit_hash(ev) != ev.hash
        {
            return Err(ev.seq);
        }
        prev = ev.hash.clone();
    }
    Ok(())
}

impl State {
    /// Move the events older than `cutoff` (at most `max`) out of the state, advancing the
    /// base; the events moved, oldest first, for the member's archive (apply writes nothing).
    pub(super) fn archive_audit_before(&mut self, cutoff: i64, max: usize) -> Vec<AuditEvent> {
        let n = self
            .audit
            .iter()
            .take(max)
            .take_while(|e| e.at_ms < cutoff)
            .count();
        if n == 0 {
            return Vec::new();
        }
        let rest = self.audit.split_off(n);
        let moved = std::mem::replace(&mut self.audit, rest);
        if let Some(last) = moved.last() {
            self.audit_base = AuditBase {
                count: last.seq,
                head: last.hash.clone(),
            };
        }
        moved.into_iter().collect()
    }
}
