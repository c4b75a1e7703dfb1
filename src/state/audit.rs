//! The audit trail: one row per admin and enrolment action, each row hashing the one before.

use std::fmt;

use modelforge_proto::api::AuditRecord;
use modelforge_proto::intern::Shared;
use serde::Deserialize;
use serde::Deserializer;
use serde::Serialize;
use serde::Serializer;
use sha2::Digest;

use super::RequestId;
use super::State;

/// An audit row as the replicated state and the archive hold it: the API's [`AuditRecord`],
/// field for field, in a compact form that encodes exactly as the record does (JSON and the
/// positional codec; ARCHITECTURE.md, "Bounded state"): the two hashes as 32 bytes instead of
/// 64-character strings, the action and result (a few dozen values fleet-wide) interned, the
/// request id shared with the request table. Replicated (positional codec): no serde
/// attributes but the record's own.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct AuditEvent {
    pub seq: u64,
    pub at_ms: i64,
    pub actor: Box<str>,
    pub action: Shared,
    pub target: Box<str>,
    pub result: Shared,
    pub request_id: RequestId,
    pub log_index: u64,
    pub prev_hash: ChainHash,
    pub hash: ChainHash,
    /// Why, for revocations, cancellations, decommissions and token changes.
    #[serde(default)]
    pub reason: Option<Box<str>>,
}

impl AuditEvent {
    /// The hash this event's fields and `prev_hash` chain to (what `hash` must be).
    pub fn chain_hash(&self) -> ChainHash {
        ChainHash(chain_digest(&Fields {
            prev_hash: &self.prev_hash.to_string(),
            seq: self.seq,
            at_ms: self.at_ms,
            actor: &self.actor,
            action: &self.action,
            target: &self.target,
            result: &self.result,
            request_id: self.request_id.as_str(),
            log_index: self.log_index,
            reason: self.reason.as_deref(),
        }))
    }

    /// The API's record of this event.
    pub fn record(&self) -> AuditRecord {
        AuditRecord {
            seq: self.seq,
            at_ms: self.at_ms,
            actor: self.actor.to_string(),
            action: self.action.to_string(),
            target: self.target.to_string(),
            result: self.result.to_string(),
            request_id: self.request_id.to_string(),
            log_index: self.log_index,
            prev_hash: self.prev_hash.to_string(),
            hash: self.hash.to_string(),
            reason: self.reason.as_deref().map(str::to_string),
        }
    }
}

/// A SHA-256 of the audit chain: 32 bytes in memory, 64 lowercase hex digits in every
/// encoding (so it reads and writes exactly as the `String` it replaced; anything else, such
/// as upper case, is refused at decode, which keeps a decode-encode round trip byte-exact).
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct ChainHash(pub [u8; 32]);

impl ChainHash {
    /// The `prev_hash` of the first event of every trail (64 zeros).
    pub const GENESIS: Self = Self([0; 32]);

    /// Parse 64 lowercase hex digits.
    pub fn from_hex(s: &str) -> Option<Self> {
        modelforge_proto::unhex::<32>(s).map(Self)
    }
}

impl fmt::Display for ChainHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&modelforge_proto::hex(&self.0))
    }
}

impl fmt::Debug for ChainHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl Serialize for ChainHash {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for ChainHash {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = std::borrow::Cow::<'de, str>::deserialize(d)?;
        Self::from_hex(&s)
            .ok_or_else(|| serde::de::Error::custom("a chain hash is 64 lowercase hex digits"))
    }
}

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
        request_id: RequestId,
        reason: Option<&str>,
    ) {
        let seq = self.audit_base.count + self.audit.len() as u64 + 1;
        let prev_hash = self.audit.last().map_or(self.audit_base.head, |e| e.hash);
        let mut ev = AuditEvent {
            seq,
            at_ms: now,
            actor: actor.into(),
            action: Shared::intern(action),
            target: target.into(),
            result: Shared::intern(result),
            request_id,
            log_index,
            prev_hash,
            hash: ChainHash::GENESIS,
            reason: reason.map(Into::into),
        };
        ev.hash = ev.chain_hash();
        self.audit.push_back(ev);
    }
}

/// The fields an audit hash covers, borrowed from either form of an event.
struct Fields<'a> {
    prev_hash: &'a str,
    seq: u64,
    at_ms: i64,
    actor: &'a str,
    action: &'a str,
    target: &'a str,
    result: &'a str,
    request_id: &'a str,
    log_index: u64,
    reason: Option<&'a str>,
}

/// SHA-256 over the previous hash (as its hex text) and every field, each length-prefixed.
fn chain_digest(f: &Fields<'_>) -> [u8; 32] {
    let mut h = sha2::Sha256::new();
    for part in [
        f.prev_hash,
        &f.seq.to_string(),
        &f.at_ms.to_string(),
        f.actor,
        f.action,
        f.target,
        f.result,
        f.request_id,
        &f.log_index.to_string(),
    ] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    // Hashed only when present, so chains written before reasons were recorded still verify.
    if let Some(reason) = f.reason {
        h.update(b"reason");
        h.update((reason.len() as u64).to_le_bytes());
        h.update(reason.as_bytes());
    }
    h.finalize().into()
}

/// The chained hash of an audit record as a client receives it (hex): what its `hash` must be.
pub fn audit_hash(ev: &AuditRecord) -> String {
    modelforge_proto::hex(&chain_digest(&Fields {
        prev_hash: &ev.prev_hash,
        seq: ev.seq,
        at_ms: ev.at_ms,
        actor: &ev.actor,
        action: &ev.action,
        target: &ev.target,
        result: &ev.result,
        request_id: &ev.request_id,
        log_index: ev.log_index,
        reason: ev.reason.as_deref(),
    }))
}

/// Where the live audit trail starts: how many events were moved to the archive and the hash
/// of the last of them (the chain's head as far as the archive goes; see ARCHITECTURE.md,
/// "The archive"). Replicated (positional codec).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct AuditBase {
    pub count: u64,
    pub head: ChainHash,
}

/// The `prev_hash` of the first event of every trail, as a client sees it.
pub const GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// Check an audit chain that continues from `base`; returns the first broken sequence number.
pub fn verify_audit_chain<'a>(
    base: &AuditBase,
    events: impl IntoIterator<Item = &'a AuditEvent>,
) -> Result<(), u64> {
    let mut prev = base.head;
    for (i, ev) in events.into_iter().enumerate() {
        if ev.seq != base.count + i as u64 + 1 || ev.prev_hash != prev || ev.chain_hash() != ev.hash
        {
            return Err(ev.seq);
        }
        prev = ev.hash;
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
                head: last.hash,
            };
        }
        moved.into_iter().collect()
    }
}
