//! Node liveness on the heartbeat-processing member (the leader): the handle to the supervision
//! tree that owns each node's live state (`supervisor.rs`), the leadership grace window, and the
//! queue of `last_used_at` updates that are written to the log coalesced, not per heartbeat.
//!
//! Status rules (thresholds in config): `decommissioned` if so; `never_seen` if no heartbeat
//! was ever accepted (here or, per the replicated `last_used_at`, anywhere); `online` if the
//! last one is younger than `stale_after`, `stale` if younger than `offline_after`, else
//! `offline`. After this member becomes leader, a node last seen before that is given a grace
//! window that starts at the leadership change, so a failover alone never marks nodes down.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::AtomicI64;
use std::sync::atomic::Ordering;

use crate::supervisor::Supervision;
use modelforge_proto::ids::CredentialId;
use modelforge_proto::ids::NodeStatus;

pub struct Liveness {
    /// The supervision tree that owns each node's live state.
    pub sup: Supervision,
    /// credential id -> latest use not yet written to the log.
    pending_uses: Mutex<HashMap<CredentialId, i64>>,
    leader_since_ms: AtomicI64,
    /// The term whose leadership the view was last rebuilt for.
    view_term: std::sync::atomic::AtomicU64,
}

/// The thresholds of node status, in milliseconds.
#[derive(Clone, Copy, Debug)]
pub struct StatusThresholds {
    pub stale_after_ms: i64,
    pub offline_after_ms: i64,
}

impl Liveness {
    pub fn new(sup: Supervision) -> Self {
        Self {
            sup,
            pending_uses: Mutex::new(HashMap::new()),
            leader_since_ms: AtomicI64::new(0),
            view_term: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// This member became leader at `ms`: the grace window starts, and the supervisors are
    /// rebuilt from the replicated state.
    pub fn set_leader_since(&self, ms: i64) {
        self.leader_since_ms.store(ms, Ordering::SeqCst);
        self.sup.rebuild(ms);
    }

    /// This member leads in `term`: start the grace window and rebuild the view once per term.
    /// Called before any leader-side read or heartbeat is served, so nothing is judged from a
    /// view left over from an earlier term.
    pub fn on_leader(&self, term: u64, now_ms: i64) -> bool {
        if self.view_term.swap(term, Ordering::SeqCst) != term {
            self.set_leader_since(now_ms);
            return true;
        }
        false
    }

    pub fn leader_since(&self) -> i64 {
        self.leader_since_ms.load(Ordering::SeqCst)
    }

    /// Note a use of a credential, to be written coalesced.
    pub fn note_use(&self, credential_id: &CredentialId, at_ms: i64) {
        let mut p = self.pending_uses.lock().unwrap_or_else(|p| p.into_inner());
        let e = p.entry(credential_id.clone()).or_insert(at_ms);
        *e = (*e).max(at_ms);
    }

    /// Take the pending uses (the caller writes those that moved enough).
    pub fn take_uses(&self) -> Vec<(CredentialId, i64)> {
        let mut p = self.pending_uses.lock().unwrap_or_else(|p| p.into_inner());
        p.drain().collect()
    }
}

/// The status of one node at `now_ms`.
pub fn node_status(
    decommissioned: bool,
    last_seen_ms: Option<i64>,
    leader_since_ms: i64,
    now_ms: i64,
    t: StatusThresholds,
) -> NodeStatus {
    if decommissioned {
        return NodeStatus::Decommissioned;
    }
    let Some(last) = last_seen_ms else {
        return NodeStatus::NeverSeen;
    };
    // Grace after a leadership change: silence is counted from the change at the latest.
    let silent_since = if leader_since_ms > last {
        leader_since_ms
    } else {
        last
    };
    let age = now_ms - silent_since;
    if age <= t.stale_after_ms {
        NodeStatus::Online
    } else if age <= t.offline_after_ms {
        NodeStatus::Stale
    } else {
        NodeStatus::Offline
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: StatusThresholds = StatusThresholds {
        stale_after_ms: 30_000,
        offline_after_ms: 90_000,
    };

    #[test]
    fn statuses() {
        assert_eq!(node_status(true, Some(0), 0, 0, T), "decommissioned");
        assert_eq!(node_status(false, None, 0, 100, T), "never_seen");
        assert_eq!(node_status(false, Some(100_000), 0, 120_000, T), "online");
        assert_eq!(node_status(false, Some(100_000), 0, 150_000, T), "stale");
        assert_eq!(node_status(false, Some(100_000), 0, 200_000, T), "offline");
    }

    #[test]
    fn a_leader_change_opens_a_grace_window() {
        // Last seen long ago by the old leader; this member leads since 190_000.
        assert_eq!(
            node_status(false, Some(100_000), 190_000, 200_000, T),
            "online"
        );
        assert_eq!(
            node_status(false, Some(100_000), 190_000, 250_000, T),
            "stale"
        );
    }
}
