//! The request table: every answered request id keeps its first answer for a day (bounded), so
//! a retry of a write that committed gets that answer instead of applying twice.
//!
//! Invariant (checked by `State::check`): `dedup` and `dedup_order` hold the same ids, and the
//! order is by apply time.

use std::borrow::Borrow;

use modelforge_proto::api::ErrorCode as RefusalCode;

use super::ApplyResult;
use super::DEDUP_MAX;
use super::DEDUP_TTL_MS;
use super::Refusal;
use super::RequestId;
use super::State;

impl State {
    /// Forget answers older than [`DEDUP_TTL_MS`], and the oldest beyond [`DEDUP_MAX`].
    pub(super) fn prune_dedup(&mut self, now: i64) {
        while let Some((at, id)) = self.dedup_order.front() {
            if now - *at > DEDUP_TTL_MS || self.dedup_order.len() > DEDUP_MAX {
                self.dedup.remove(id);
                self.dedup_order.pop_front();
            } else {
                break;
            }
        }
    }

    /// Keep `result` as the answer to `request_id` (at the cap, it takes the oldest's place).
    pub(super) fn remember(&mut self, now: i64, request_id: RequestId, result: &ApplyResult) {
        if request_id.as_str().is_empty() {
            return;
        }
        self.dedup.insert(request_id.clone(), (now, result.clone()));
        self.dedup_order.push_back((now, request_id));
        self.prune_dedup(now);
    }
}

/// Whether `request_id` (`idem-<key part>.<request part>`, see `server::extract::request_id`)
/// shares its key part with another request id in `table`: the same Idempotency-Key used for
/// the same operation and target with a different body.
pub fn idempotency_key_reused<K, V>(table: &imbl::OrdMap<K, V>, request_id: &str) -> bool
where
    K: Ord + Clone + Borrow<str>,
    V: Clone,
{
    let Some(dot) = request_id.find('.') else {
        return false;
    };
    if !request_id.starts_with("idem-") {
        return false;
    }
    let prefix = &request_id[..=dot];
    table
        .range::<_, str>((
            std::ops::Bound::Included(prefix),
            std::ops::Bound::Unbounded,
        ))
        .map(|(k, _)| k.borrow())
        .take_while(|k| k.starts_with(prefix))
        .any(|k| k != request_id)
}

/// The refusal of an Idempotency-Key reused with another request body.
pub fn key_reused() -> Refusal {
    Refusal::new(RefusalCode::IdempotencyKeyReused)
}
