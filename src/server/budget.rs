//! Budgets of failed secret checks: how many argon2 verifications a client address may make
//! fail, in all and per credential or token it names. See ARCHITECTURE "Budgets of failed
//! secret checks".

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Instant;

/// What a failed check is charged to.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Key {
    /// Every failed check from one client address.
    Client(IpAddr),
    /// Failed checks of one credential id from one client address.
    Credential(String, IpAddr),
    /// Failed checks of one enrolment token id from one client address.
    Token(String, IpAddr),
    /// Replicated writes caused by one node (inventory changes, smoke reports, reconciles):
    /// not a failed-check budget but a plain rate limit, taken with [`Budgets::take`].
    NodeWrites(String),
}

/// A token bucket's shape: `burst` failures at once, then one every `1 / per_s` seconds.
#[derive(Clone, Copy, Debug)]
pub struct Rule {
    pub burst: f64,
    pub per_s: f64,
}

/// A client address may fail 30 checks at once, then one every 2 s.
pub const CLIENT: Rule = Rule {
    burst: 30.0,
    per_s: 0.5,
};
/// One credential id (or token id) from one address: 5 failures, then one a minute.
pub const PER_SECRET: Rule = Rule {
    burst: 5.0,
    per_s: 1.0 / 60.0,
};
/// One node may cause 20 replicated writes at once, then one every 3 s: far above what an
/// agent does (a write per inventory change, per smoke, per reconcile), far below what would
/// let one compromised node grow the log and the audit trail without bound.
pub const NODE_WRITES: Rule = Rule {
    burst: 20.0,
    per_s: 1.0 / 3.0,
};
/// Buckets kept at most: beyond it full buckets are forgotten (a full bucket is the same as
/// none), and if that is not enough new keys are refused (memory stays bounded whatever
/// addresses and ids a flood names).
const MAX_BUCKETS: usize = 200_000;

impl Key {
    /// Whether a check takes its unit before it runs (see [`Reservation`]).
    fn reserved_up_front(&self) -> bool {
        !matches!(self, Key::Client(_))
    }

    fn rule(&self) -> Rule {
        match self {
            Key::Client(_) => CLIENT,
            Key::Credential(..) | Key::Token(..) => PER_SECRET,
            Key::NodeWrites(_) => NODE_WRITES,
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn refilled(mut self, rule: Rule, now: Instant) -> Self {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + dt * rule.per_s).min(rule.burst);
        self.at = now;
        self
    }
}

#[derive(Default)]
pub struct Budgets {
    buckets: Mutex<HashMap<Key, Bucket>>,
}

/// One check's claim on its budgets. Per-secret buckets are reserved up front (their checks
/// run one at a time per id, so the reservation is exact); the client address's bucket is only
/// looked at up front and charged when the check fails, so that many right secrets checked at
/// once from one address (a rack behind one NAT powering on) never spend it. Dropped without
/// [`Reservation::passed`], the check counts as failed if its argon2 verification started
/// ([`Reservation::started`]; a client that hangs up mid-verify is charged too, so a flood
/// cannot dodge the budget by disconnecting), and as nothing if it never started (the pool
/// was full, or the client went away while queued).
pub struct Reservation<'a> {
    budgets: &'a Budgets,
    keys: Vec<Key>,
    passed: bool,
    /// Set by the argon2 pool when the verification starts.
    pub started: std::sync::atomic::AtomicBool,
}

impl Reservation<'_> {
    /// The check passed: nothing is charged.
    pub fn passed(mut self) {
        self.passed = true;
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        let now = Instant::now();
        let mut b = self.budgets.lock();
        for k in &self.keys {
            let rule = k.rule();
            let failed = !self.passed && self.started.load(std::sync::atomic::Ordering::SeqCst);
            let change = match (k.reserved_up_front(), failed) {
                (true, false) => 1.0,
                (false, true) => -1.0,
                _ => continue,
            };
            let bucket = b.entry(k.clone()).or_insert(Bucket {
                tokens: rule.burst,
                at: now,
            });
            *bucket = bucket.refilled(rule, now);
            bucket.tokens = (bucket.tokens + change).min(rule.burst);
        }
    }
}

impl Budgets {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Bucket>> {
        self.buckets.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Claim one check from every key's budget before an argon2 verification (see
    /// [`Reservation`]); `Err(seconds)` until the first spent one has a check again.
    pub fn reserve(&self, keys: Vec<Key>) -> Result<Reservation<'_>, u64> {
        let now = Instant::now();
        let mut b = self.lock();
        if b.len() >= MAX_BUCKETS {
            b.retain(|k, bucket| bucket.refilled(k.rule(), now).tokens < k.rule().burst);
        }
        let mut wait_s: f64 = 0.0;
        for k in &keys {
            let rule = k.rule();
            let tokens = match b.get(k) {
                Some(bucket) => bucket.refilled(rule, now).tokens,
                None if b.len() >= MAX_BUCKETS => 0.0,
                None => rule.burst,
            };
            if tokens < 1.0 {
                wait_s = wait_s.max((1.0 - tokens) / rule.per_s);
            }
        }
        if wait_s > 0.0 {
            return Err(wait_s.ceil().max(1.0) as u64);
        }
        for k in keys.iter().filter(|k| k.reserved_up_front()) {
            let rule = k.rule();
            let bucket = b.entry(k.clone()).or_insert(Bucket {
                tokens: rule.burst,
                at: now,
            });
            *bucket = bucket.refilled(rule, now);
            bucket.tokens -= 1.0;
        }
        Ok(Reservation {
            budgets: self,
            keys,
            passed: false,
            started: Default::default(),
        })
    }
}

impl Budgets {
    /// Take one unit of `key`'s bucket now, or `Err(seconds)` until it has one.
    pub fn take(&self, key: Key) -> Result<(), u64> {
        let now = Instant::now();
        let rule = key.rule();
        let mut b = self.lock();
        if b.len() >= MAX_BUCKETS {
            b.retain(|k, bucket| bucket.refilled(k.rule(), now).tokens < k.rule().burst);
        }
        if b.len() >= MAX_BUCKETS && !b.contains_key(&key) {
            return Err(1);
        }
        let bucket = b.entry(key).or_insert(Bucket {
            tokens: rule.burst,
            at: now,
        });
        *bucket = bucket.refilled(rule, now);
        if bucket.tokens < 1.0 {
            return Err(((1.0 - bucket.tokens) / rule.per_s).ceil().max(1.0) as u64);
        }
        bucket.tokens -= 1.0;
        Ok(())
    }
}

/// One check at a time per credential id: a check that needs argon2 holds its id's lock, so
/// that concurrent requests with the same (right) credential wait for the first verify and then
/// find it in the cache, instead of each spending budget and argon2 on it.
#[derive(Default)]
pub struct IdLocks {
    map: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// Held while one id is checked; the id's entry goes when nobody holds or waits for it.
pub struct IdGuard<'a> {
    locks: &'a IdLocks,
    id: String,
    lock: Arc<tokio::sync::Mutex<()>>,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl IdLocks {
    pub async fn lock(&self, id: &str) -> IdGuard<'_> {
        let lock = self
            .map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(id.to_string())
            .or_default()
            .clone();
        let guard = lock.clone().lock_owned().await;
        IdGuard {
            locks: self,
            id: id.to_string(),
            lock,
            guard: Some(guard),
        }
    }

    pub fn len(&self) -> usize {
        self.map.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for IdGuard<'_> {
    fn drop(&mut self) {
        drop(self.guard.take());
        let mut map = self.locks.map.lock().unwrap_or_else(|p| p.into_inner());
        // The map's reference and ours: nobody else holds or waits for this id.
        if Arc::strong_count(&self.lock) == 2 {
            map.remove(&self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    #[test]
    fn failures_are_budgeted_per_secret_and_address_and_passes_cost_nothing() {
        let b = Budgets::default();
        let keys = |addr| vec![Key::Client(addr), Key::Credential("c1".into(), addr)];
        // Passing checks are refunded: any number of them.
        for _ in 0..100 {
            b.reserve(keys(ip(1))).unwrap().passed();
        }
        // Five failures of c1 from one address, then a wait of about a minute.
        for _ in 0..5 {
            failed(b.reserve(keys(ip(1))).unwrap());
        }
        let wait = b.reserve(keys(ip(1))).err().expect("the sixth is refused");
        assert!((50..=60).contains(&wait), "{wait}");
        // Another address is not affected, nor another credential from the first address.
        failed(b.reserve(keys(ip(2))).unwrap());
        failed(
            b.reserve(vec![
                Key::Client(ip(1)),
                Key::Credential("c2".into(), ip(1)),
            ])
            .unwrap(),
        );
        // An address failing across many ids runs out of its own budget.
        let mut refused = 0;
        for i in 0..100 {
            let k = vec![Key::Client(ip(3)), Key::Token(format!("t{i}"), ip(3))];
            match b.reserve(k) {
                Ok(r) => failed(r),
                Err(_) => refused += 1,
            }
        }
        assert_eq!(refused, 100 - CLIENT.burst as usize);
        // Many right secrets in flight at once from one address (distinct ids, as a rack
        // enrolling behind one NAT) are not refused for the address's budget.
        let in_flight: Vec<_> = (0..200)
            .map(|i| {
                b.reserve(vec![Key::Client(ip(4)), Key::Token(format!("t{i}"), ip(4))])
                    .unwrap()
            })
            .collect();
        in_flight.into_iter().for_each(Reservation::passed);
        // Checks that never ran (a full pool, a client gone while queued) cost nothing.
        for _ in 0..50 {
            drop(b.reserve(keys(ip(5))).unwrap());
        }
        failed(b.reserve(keys(ip(5))).unwrap());
    }

    /// A check whose verification ran and failed.
    fn failed(r: Reservation<'_>) {
        r.started.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    #[tokio::test]
    async fn an_ids_lock_serialises_its_checks_and_is_forgotten_when_free() {
        let locks = IdLocks::default();
        let first = locks.lock("c1").await;
        let other = locks.lock("c2").await;
        assert_eq!(locks.len(), 2);
        let waiting = tokio::time::timeout(Duration::from_millis(50), locks.lock("c1")).await;
        assert!(
            waiting.is_err(),
            "a second check of c1 ran alongside the first"
        );
        drop(first);
        drop(locks.lock("c1").await);
        drop(other);
        assert!(locks.is_empty());
    }
}
