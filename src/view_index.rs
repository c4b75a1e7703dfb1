//! The member-local index of `X-Modelforge-Index` (ARCHITECTURE.md, "Lists and watches"):
//! `(applied log index << 24) + local changes`, published lazily so that a fleet's heartbeats
//! wake a watcher a few times a second, not once per heartbeat.

use std::sync::Mutex;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::watch;

/// Bits of the index below the applied log index: live changes between two applies.
const LOCAL_BITS: u32 = 24;
const LOCAL_MAX: u64 = (1 << LOCAL_BITS) - 1;

pub struct ViewIndex {
    /// The newest applied log index reported (by apply and restore).
    applied: AtomicU64,
    /// A change not yet published.
    dirty: AtomicBool,
    /// (applied part, local part) of the published value.
    parts: Mutex<(u64, u64)>,
    published: watch::Sender<u64>,
}

impl Default for ViewIndex {
    fn default() -> Self {
        Self {
            applied: AtomicU64::new(0),
            dirty: AtomicBool::new(false),
            parts: Mutex::new((0, 1)),
            published: watch::Sender::new(1),
        }
    }
}

impl ViewIndex {
    /// A live change of what node views show (heartbeat, refusal, report, rebuild).
    pub fn mark(&self) {
        self.dirty.store(true, Ordering::Release);
    }

    /// The state was applied up to `log_index` (apply, snapshot install).
    pub fn applied(&self, log_index: u64) {
        self.applied.fetch_max(log_index, Ordering::AcqRel);
        self.dirty.store(true, Ordering::Release);
    }

    /// Publish what changed since the last call and answer the current index: a reader takes
    /// it before computing its answer, so the answer is at least as new as the index.
    pub fn current(&self) -> u64 {
        if self.dirty.swap(false, Ordering::AcqRel) {
            let applied = self.applied.load(Ordering::Acquire);
            let mut parts = self.parts.lock().unwrap_or_else(|p| p.into_inner());
            if applied > parts.0 {
                *parts = (applied, 1);
            } else {
                // Saturates: the index stalls until the next apply (2^24 live changes).
                parts.1 = (parts.1 + 1).min(LOCAL_MAX);
            }
            let value = (parts.0 << LOCAL_BITS) | parts.1;
            self.published.send_if_modified(|v| {
                let grew = value > *v;
                if grew {
                    *v = value;
                }
                grew
            });
        }
        *self.published.borrow()
    }

    /// Wait until the index exceeds `index` or `wait` passes; the index then.
    pub async fn wait_past(&self, index: u64, wait: Duration) -> u64 {
        let mut rx = self.published.subscribe();
        if self.current() <= index {
            let _ = tokio::time::timeout(wait, rx.wait_for(|v| *v > index)).await;
        }
        self.current()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_index_grows_with_applies_and_marked_changes_and_only_when_looked_at() {
        let v = ViewIndex::default();
        assert_eq!(v.current(), 1);
        v.mark();
        v.mark();
        assert_eq!(v.current(), 2, "two marks before a look are one change");
        assert_eq!(v.current(), 2, "nothing new: the same index");
        v.applied(7);
        let after_apply = v.current();
        assert_eq!(after_apply, (7 << LOCAL_BITS) | 1);
        v.mark();
        assert_eq!(v.current(), after_apply + 1);
        // An index served by a member that applied less is smaller, whatever its local part.
        let behind = ViewIndex::default();
        behind.applied(6);
        for _ in 0..1000 {
            behind.mark();
            behind.current();
        }
        assert!(behind.current() < after_apply);
    }

    #[test]
    fn the_local_part_saturates_instead_of_spilling_into_the_applied_part() {
        let v = ViewIndex::default();
        v.applied(3);
        v.current();
        v.parts.lock().unwrap().1 = LOCAL_MAX - 1;
        v.mark();
        let top = v.current();
        v.mark();
        assert_eq!(v.current(), top, "saturated");
        v.applied(4);
        assert!(v.current() > top);
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_wakes_when_a_change_is_published_or_its_wait_ends() {
        let v = std::sync::Arc::new(ViewIndex::default());
        let n = v.current();
        let t0 = tokio::time::Instant::now();
        assert_eq!(v.wait_past(n, Duration::from_secs(5)).await, n);
        assert_eq!(
            t0.elapsed(),
            Duration::from_secs(5),
            "timed out with the same index"
        );
        let waiter = tokio::spawn({
            let v = v.clone();
            async move { v.wait_past(n, Duration::from_secs(60)).await }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        v.mark();
        // A mark alone wakes nobody until someone publishes it (the ticker, a reader).
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!waiter.is_finished());
        v.current();
        assert_eq!(waiter.await.unwrap(), n + 1);
    }
}
