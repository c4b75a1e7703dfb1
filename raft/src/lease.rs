//! The leader's lease, checked locally from openraft's metrics (ARCHITECTURE.md, "Lease reads on
//! the leader"): a read that this says yes to needs no round trip through Raft's core.
//!
//! Invariant: [`lease_holds`] says yes only when openraft's own `LeaseRead` would have; every
//! doubt (a stale acknowledgement, a blank entry not yet applied, a transfer) is a no, and the
//! caller then asks openraft, which decides as it always did.

use std::sync::atomic::AtomicU32;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// What the local check reads, from one borrow of openraft's metrics and the transfer mark.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseView {
    /// The metrics say this member leads (`state == Leader` and `current_leader == self`).
    pub leads: bool,
    /// The current term.
    pub term: u64,
    /// A leadership transfer was started in this term, or is being started now.
    pub transferring: bool,
    /// This member is the only voter of the (non-joint) membership: its own quorum.
    pub sole_voter: bool,
    /// How long ago the last heartbeat a quorum acknowledged was *sent*.
    pub quorum_acked_ago: Option<Duration>,
    /// The term of the last applied entry (`None` before anything is applied).
    pub applied_term: Option<u64>,
}

/// The share of the lease kept back for clock-rate drift between members.
const DRIFT_MARGIN_DIVISOR: u32 = 10;

/// Whether a local read on this member is linearizable now, without asking Raft's core.
pub fn lease_holds(v: &LeaseView, lease: Duration) -> bool {
    if !v.leads || v.transferring {
        return false;
    }
    // The leader's blank entry of this term is applied: whatever a previous leader
    // acknowledged is in the state (and this leader answers a write only once it is applied).
    if v.applied_term != Some(v.term) {
        return false;
    }
    if v.sole_voter {
        return true;
    }
    let usable = lease.saturating_sub(lease / DRIFT_MARGIN_DIVISOR);
    v.quorum_acked_ago.is_some_and(|ago| ago < usable)
}

/// Which term this member started a leadership transfer in (the target's votes bypass the
/// followers' leases, so the old leader's lease proves nothing from then on).
#[derive(Debug)]
pub struct TransferMark {
    /// Transfers being started right now (the term they apply to is not known yet).
    starting: AtomicU32,
    /// The latest term a transfer was started in; `u64::MAX` for none.
    term: AtomicU64,
}

impl Default for TransferMark {
    fn default() -> Self {
        Self {
            starting: AtomicU32::new(0),
            term: AtomicU64::new(u64::MAX),
        }
    }
}

impl TransferMark {
    /// Called before asking openraft to transfer: blocks local lease reads until [`Self::end`].
    pub fn begin(&self) {
        self.starting.fetch_add(1, Ordering::SeqCst);
    }

    /// Called once openraft has the request: `term` is the term read after it returned, at
    /// least the term the transfer applies to (an older term than recorded is blocked too:
    /// it can never be led again, so over-recording costs nothing).
    pub fn end(&self, term: u64) {
        // Keep the later of the two terms (`u64::MAX`, none, is replaced).
        let _ = self
            .term
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |cur| {
                Some(if cur == u64::MAX { term } else { cur.max(term) })
            });
        self.starting.fetch_sub(1, Ordering::SeqCst);
    }

    /// Whether a transfer is being started, or was started in `term` or later.
    pub fn blocks(&self, term: u64) -> bool {
        if self.starting.load(Ordering::SeqCst) > 0 {
            return true;
        }
        let recorded = self.term.load(Ordering::SeqCst);
        recorded != u64::MAX && term <= recorded
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_millis(300);

    fn holding() -> LeaseView {
        LeaseView {
            leads: true,
            term: 7,
            transferring: false,
            sole_voter: false,
            quorum_acked_ago: Some(Duration::from_millis(40)),
            applied_term: Some(7),
        }
    }

    #[test]
    fn a_leader_acknowledged_within_the_lease_with_its_blank_entry_applied_holds_it() {
        assert!(lease_holds(&holding(), LEASE));
    }

    #[test]
    fn each_missing_condition_refuses() {
        let cases: [(&str, LeaseView); 7] = [
            (
                "not the leader",
                LeaseView {
                    leads: false,
                    ..holding()
                },
            ),
            (
                "a transfer started",
                LeaseView {
                    transferring: true,
                    ..holding()
                },
            ),
            (
                "blank entry not applied",
                LeaseView {
                    applied_term: Some(6),
                    ..holding()
                },
            ),
            (
                "nothing applied",
                LeaseView {
                    applied_term: None,
                    ..holding()
                },
            ),
            (
                "never acknowledged",
                LeaseView {
                    quorum_acked_ago: None,
                    ..holding()
                },
            ),
            (
                "acknowledged a lease ago",
                LeaseView {
                    quorum_acked_ago: Some(LEASE),
                    ..holding()
                },
            ),
            (
                "acknowledged inside the drift margin",
                LeaseView {
                    quorum_acked_ago: Some(Duration::from_millis(271)),
                    ..holding()
                },
            ),
        ];
        for (what, v) in cases {
            assert!(!lease_holds(&v, LEASE), "{what}: {v:?}");
        }
        let edge = LeaseView {
            quorum_acked_ago: Some(Duration::from_millis(269)),
            ..holding()
        };
        assert!(lease_holds(&edge, LEASE), "just inside the margin");
    }

    #[test]
    fn a_sole_voter_needs_no_acknowledgement_but_still_its_blank_entry_and_no_transfer() {
        let alone = LeaseView {
            sole_voter: true,
            quorum_acked_ago: None,
            ..holding()
        };
        assert!(lease_holds(&alone, LEASE));
        assert!(!lease_holds(
            &LeaseView {
                applied_term: Some(6),
                ..alone
            },
            LEASE
        ));
        assert!(!lease_holds(
            &LeaseView {
                transferring: true,
                ..alone
            },
            LEASE
        ));
        assert!(!lease_holds(
            &LeaseView {
                leads: false,
                ..alone
            },
            LEASE
        ));
    }

    #[test]
    fn a_transfer_blocks_while_it_starts_and_for_the_rest_of_its_term() {
        let mark = TransferMark::default();
        assert!(!mark.blocks(3));
        mark.begin();
        assert!(mark.blocks(3), "while starting, whatever the term");
        mark.end(3);
        assert!(mark.blocks(3));
        assert!(
            mark.blocks(2),
            "an older term is never led again: blocking it is free"
        );
        assert!(
            !mark.blocks(4),
            "a later term's leadership is a new election"
        );
        mark.begin();
        mark.end(2);
        assert!(mark.blocks(3), "an older term never replaces a newer one");
    }
}
