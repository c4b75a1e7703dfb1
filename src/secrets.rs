//! Argon2id hashing and verification of tokens and credentials, off the async executor, on a
//! bounded pool.
//!
//! Parameters: every stored secret is a 256-bit random string, so no cost setting changes how
//! hard it is to brute-force; the hash exists so that a stolen database or snapshot yields
//! nothing usable. The default is OWASP's argon2id setting (m=19 MiB, t=2, p=1) because it is
//! the one operators expect to see; it is configurable and travels inside each PHC string, so
//! changing it needs no migration.
//!
//! Load: at most `workers` hashes run at once (one per core) and at most `max_waiting`
//! ([`MAX_WAITING`] on a member) wait; past that a request is answered 429 with `Retry-After`
//! instead of queueing without bound.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering;

use argon2::Argon2;
use argon2::PasswordHasher;
use argon2::PasswordVerifier;
use subtle::ConstantTimeEq;

use crate::error::ApiError;

#[derive(Clone, Debug)]
pub struct HashParams {
    pub m_kib: u32,
    pub t: u32,
    pub p: u32,
}

impl Default for HashParams {
    fn default() -> Self {
        Self {
            m_kib: argon2::Params::DEFAULT_M_COST,
            t: argon2::Params::DEFAULT_T_COST,
            p: argon2::Params::DEFAULT_P_COST,
        }
    }
}

/// The argon2id parameters a member uses or believes: memory in KiB, iterations and lanes.
/// A stored hash carries its own parameters, and verifying it costs what they say; one with
/// parameters outside these ranges (an edited backup, a forged entry) is never computed, so no
/// hash can make a check allocate gigabytes or run for minutes.
pub const M_KIB_RANGE: std::ops::RangeInclusive<u32> = 8..=262_144;
pub const T_RANGE: std::ops::RangeInclusive<u32> = 1..=16;
pub const P_RANGE: std::ops::RangeInclusive<u32> = 1..=16;

impl HashParams {
    /// Refuse parameters outside the allowed ranges.
    pub fn check(&self) -> Result<(), String> {
        let (m, t, p) = (self.m_kib, self.t, self.p);
        if !M_KIB_RANGE.contains(&m) || !T_RANGE.contains(&t) || !P_RANGE.contains(&p) {
            return Err(format!(
                "argon2id parameters m={m} KiB, t={t}, p={p} are outside the allowed ranges (m {}..={} KiB, t {}..={}, p {}..={})",
                M_KIB_RANGE.start(),
                M_KIB_RANGE.end(),
                T_RANGE.start(),
                T_RANGE.end(),
                P_RANGE.start(),
                P_RANGE.end()
            ));
        }
        Ok(())
    }
}

/// Check a stored PHC string: argon2id, version 0x13, parameters in range. Never echoes the
/// string (it holds a hash).
pub fn check_phc(phc: &str) -> Result<(), String> {
    let hash = argon2::password_hash::phc::PasswordHash::new(phc)
        .map_err(|e| format!("not a PHC string: {e}"))?;
    if hash.algorithm.as_str() != "argon2id" {
        return Err(format!("algorithm {} is not argon2id", hash.algorithm));
    }
    if hash.version != Some(0x13) {
        return Err("not argon2 version 0x13".to_string());
    }
    let params = argon2::Params::try_from(&hash).map_err(|e| format!("parameters: {e}"))?;
    HashParams {
        m_kib: params.m_cost(),
        t: params.t_cost(),
        p: params.p_cost(),
    }
    .check()
}

/// How many secret checks may wait for an argon2 worker on a member before the next is refused.
pub const MAX_WAITING: usize = 4096;

/// The bounded argon2 pool. Clones share it.
#[derive(Clone)]
pub struct Hasher {
    params: argon2::Params,
    permits: Arc<tokio::sync::Semaphore>,
    /// What checks of presented credentials and operator tokens may hold of the workers: all
    /// but one when there are two or more, so that an enrolment (token verify, credential
    /// hash) always finds a worker within one hash's time, however many such checks queue.
    check_permits: Arc<tokio::sync::Semaphore>,
    waiting: Arc<AtomicUsize>,
    max_waiting: usize,
    workers: usize,
    verifies: Arc<std::sync::atomic::AtomicU64>,
}

impl Hasher {
    pub fn new(params: &HashParams, workers: usize, max_waiting: usize) -> anyhow::Result<Self> {
        params.check().map_err(anyhow::Error::msg)?;
        let params = argon2::Params::new(params.m_kib, params.t, params.p, None)
            .map_err(|e| anyhow::anyhow!("argon2 parameters: {e}"))?;
        Ok(Self {
            params,
            permits: Arc::new(tokio::sync::Semaphore::new(workers.max(1))),
            check_permits: Arc::new(tokio::sync::Semaphore::new(workers.max(2) - 1)),
            waiting: Arc::new(AtomicUsize::new(0)),
            max_waiting,
            workers: workers.max(1),
            verifies: Arc::new(std::sync::atomic::AtomicU64::new(0)),
        })
    }

    fn argon(&self) -> Argon2<'static> {
        Argon2::new(
            argon2::Algorithm::Argon2id,
            argon2::Version::V0x13,
            self.params.clone(),
        )
    }

    async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(Argon2<'static>) -> T + Send + 'static,
    ) -> Result<T, ApiError> {
        self.run_marking(f, None, false).await
    }

    async fn run_marking<T: Send + 'static>(
        &self,
        f: impl FnOnce(Argon2<'static>) -> T + Send + 'static,
        started: Option<&AtomicBool>,
        is_check: bool,
    ) -> Result<T, ApiError> {
        if self.waiting.fetch_add(1, Ordering::SeqCst) >= self.max_waiting {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(ApiError::overloaded());
        }
        // Counted out however the wait ends: a request whose client went away is dropped
        // while it waits, and must not keep its place in the queue.
        let waiting = Waiting(&self.waiting);
        let check_permit = if is_check {
            let p = self.check_permits.clone().acquire_owned().await;
            Some(p.map_err(|_| ApiError::internal("secret pool closed"))?)
        } else {
            None
        };
        let permit = self.permits.clone().acquire_owned().await;
        drop(waiting);
        let permit = permit.map_err(|_| ApiError::internal("secret pool closed"))?;
        // Only verifies pass `started`: counted once a worker runs them (not when refused).
        if let Some(s) = started {
            s.store(true, Ordering::SeqCst);
            self.verifies.fetch_add(1, Ordering::Relaxed);
        }
        let argon = self.argon();
        let out = tokio::task::spawn_blocking(move || {
            let out = f(argon);
            drop(permit);
            drop(check_permit);
            out
        })
        .await
        .map_err(|_| ApiError::internal("secret check failed"))?;
        Ok(out)
    }

    /// Hash `secret` into a PHC string (with its own random salt and the parameters).
    #[tracing::instrument(name = "argon2_hash", skip_all)]
    pub async fn hash(&self, secret: String) -> Result<String, ApiError> {
        self.run(move |a| a.hash_password(secret.as_bytes()).map(|h| h.to_string()))
            .await?
            .map_err(|e| ApiError::internal(format!("argon2 hash failed: {e}")))
    }

    /// Whether `secret` matches the stored PHC string. A malformed PHC string never matches.
    pub async fn verify(&self, phc: String, secret: String) -> Result<bool, ApiError> {
        self.verify_marking(phc, secret, &AtomicBool::new(false))
            .await
    }

    /// [`Self::verify`], setting `started` once a worker has begun the computation (what a
    /// failed-check budget charges; see `server::budget`).
    pub async fn verify_marking(
        &self,
        phc: String,
        secret: String,
        started: &AtomicBool,
    ) -> Result<bool, ApiError> {
        self.verify_kind(phc, secret, started, false).await
    }

    /// [`Self::verify_marking`] for a presented credential or operator token: such checks
    /// share all workers but one (see `check_permits`), keeping one for enrolments.
    pub async fn verify_check_marking(
        &self,
        phc: String,
        secret: String,
        started: &AtomicBool,
    ) -> Result<bool, ApiError> {
        self.verify_kind(phc, secret, started, true).await
    }

    #[tracing::instrument(name = "argon2_verify", skip_all, fields(check = is_check))]
    async fn verify_kind(
        &self,
        phc: String,
        secret: String,
        started: &AtomicBool,
        is_check: bool,
    ) -> Result<bool, ApiError> {
        // A stored hash whose parameters are out of range is refused before any work.
        if let Err(why) = check_phc(&phc) {
            tracing::warn!(%why, "a stored hash was refused without computing it");
            return Ok(false);
        }
        self.run_marking(
            move |a| a.verify_password(secret.as_bytes(), phc.as_str()).is_ok(),
            Some(started),
            is_check,
        )
        .await
    }

    /// Whether a worker is free and nothing waits for one: spare capacity for work done ahead.
    fn idle(&self) -> bool {
        self.waiting.load(Ordering::SeqCst) == 0 && self.permits.available_permits() > 0
    }

    /// How many hashes may run at once.
    pub fn workers(&self) -> usize {
        self.workers
    }

    /// How many argon2 verifies this member has run.
    /// Jobs waiting for an argon2 worker now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn verify_count(&self) -> u64 {
        self.verifies.load(Ordering::Relaxed)
    }

    /// Time one hash at the configured parameters (for benchmarks and the startup log).
    pub fn time_one_hash(&self) -> std::time::Duration {
        let t = std::time::Instant::now();
        let _ = self.argon().hash_password(b"mfnc_benchmark");
        t.elapsed()
    }
}

/// One request waiting for an argon2 worker; leaves the count when dropped.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Node credentials minted ahead of demand: (credential, its argon2 hash) pairs made one at a
/// time while the argon2 pool has nothing else to do.
///
/// Why: an enrolment costs an argon2 verify of the token plus an argon2 hash of the new
/// credential. With a warm pool a burst of enrolments (a rack powering on) pays only the
/// verify, so it runs at close to the argon2 bound instead of half of it. The plaintext of a
/// pooled credential lives only in this member's memory until it is handed to exactly one
/// enrolment (taken out under the lock, never cloned) and is lost with the process, which
/// costs nothing: an unissued credential was never stored anywhere. The pool fills only on
/// the leader (where enrolments are decided) and only while a worker is free and nothing
/// waits, so it delays an enrolment by at most the one hash in progress.
///
/// A free argon2 worker is not a free CPU: heartbeats need no argon2 and would share the cores
/// with a refill running flat out (the benchmark measured heartbeats at half their rate while
/// the leader re-minted its pool after a burst). While agents were served in the last
/// [`FOREGROUND_WINDOW_MS`], the refill keeps to [`BUSY_DUTY`] of one core: after each
/// hash it rests three times as long. With nothing to serve it runs at full speed.
pub struct CredentialMint {
    ready: std::sync::Mutex<Vec<(modelforge_proto::secret::Secret, String)>>,
    target: usize,
    minted_ahead: std::sync::atomic::AtomicU64,
    minted_inline: std::sync::atomic::AtomicU64,
    /// When a request was last served (ms since the epoch).
    last_foreground_ms: std::sync::atomic::AtomicI64,
}

/// How recent a served request must be for the refill to yield.
pub const FOREGROUND_WINDOW_MS: i64 = 500;
/// The share of one core the refill may take while requests are being served.
pub const BUSY_DUTY: f64 = 0.25;

impl CredentialMint {
    pub fn new(target: usize) -> Self {
        Self {
            ready: Default::default(),
            target,
            minted_ahead: Default::default(),
            minted_inline: Default::default(),
            last_foreground_ms: Default::default(),
        }
    }

    /// A request is being served: the refill yields for a while.
    pub fn note_foreground(&self, now_ms: i64) {
        self.last_foreground_ms.store(now_ms, Ordering::Relaxed);
    }

    /// How long to rest after a refill hash that took `took`, at `now_ms`.
    pub fn rest_after(&self, took: std::time::Duration, now_ms: i64) -> std::time::Duration {
        let busy = now_ms - self.last_foreground_ms.load(Ordering::Relaxed) < FOREGROUND_WINDOW_MS;
        if busy {
            took.mul_f64((1.0 - BUSY_DUTY) / BUSY_DUTY)
        } else {
            std::time::Duration::ZERO
        }
    }

    /// A fresh credential and its hash: from the pool when it has one, else hashed now.
    pub async fn mint(
        &self,
        hasher: &Hasher,
    ) -> Result<(modelforge_proto::secret::Secret, String), ApiError> {
        use modelforge_proto::secret::Secret;
        use modelforge_proto::secret::SecretKind;
        if let Some(pair) = self.ready.lock().expect("mint lock").pop() {
            return Ok(pair);
        }
        self.minted_inline.fetch_add(1, Ordering::Relaxed);
        let credential = Secret::generate(SecretKind::NodeCredential);
        let hash = hasher.hash(credential.expose().to_string()).await?;
        Ok((credential, hash))
    }

    /// How many are ready now.
    pub fn ready(&self) -> usize {
        self.ready.lock().expect("mint lock").len()
    }

    /// (minted ahead, minted inline) since start.
    pub fn counts(&self) -> (u64, u64) {
        (
            self.minted_ahead.load(Ordering::Relaxed),
            self.minted_inline.load(Ordering::Relaxed),
        )
    }

    /// Mint one ahead if the pool is short and the hasher idle; how long that hash took
    /// (None when it minted nothing).
    pub async fn refill_one(&self, hasher: &Hasher) -> Option<std::time::Duration> {
        use modelforge_proto::secret::Secret;
        use modelforge_proto::secret::SecretKind;
        if self.ready() >= self.target || !hasher.idle() {
            return None;
        }
        let t = std::time::Instant::now();
        let credential = Secret::generate(SecretKind::NodeCredential);
        let Ok(hash) = hasher.hash(credential.expose().to_string()).await else {
            return None;
        };
        self.minted_ahead.fetch_add(1, Ordering::Relaxed);
        self.ready
            .lock()
            .expect("mint lock")
            .push((credential, hash));
        Some(t.elapsed())
    }
}

/// Compare a presented bearer secret with the expected one in constant time (over digests,
/// so the length does not leak either).
pub fn same_secret(presented: &str, expected: &str) -> bool {
    use sha2::Digest;
    let a = sha2::Sha256::digest(presented.as_bytes());
    let b = sha2::Sha256::digest(expected.as_bytes());
    a.ct_eq(&b).into()
}

/// The value of the peer header, derived from the cluster secret so that the secret itself
/// (which may be the admin token) never travels between members, and from the cluster id, so
/// that members of another cluster with the same secret (the old members of a restored
/// cluster) are refused by every peer endpoint.
pub fn peer_token(cluster_secret: &str, cluster_id: &str) -> String {
    use hmac::KeyInit;
    use hmac::Mac;
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(cluster_secret.as_bytes())
        .expect("hmac takes any key length");
    mac.update(b"modelforge-peer-v1");
    if !cluster_id.is_empty() {
        mac.update(b"/cluster/");
        mac.update(cluster_id.as_bytes());
    }
    modelforge_proto::hex(&mac.finalize().into_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pool of 2 workers with cheap but real argon2 parameters.
    fn small() -> Hasher {
        Hasher::new(
            &HashParams {
                m_kib: 1024,
                t: 1,
                p: 1,
            },
            2,
            8,
        )
        .unwrap()
    }

    #[tokio::test]
    async fn hash_then_verify() {
        let h = small();
        let phc = h.hash("mfnc_secret".into()).await.unwrap();
        assert!(phc.starts_with("$argon2id$"));
        assert!(!phc.contains("mfnc_secret"));
        assert!(h.verify(phc.clone(), "mfnc_secret".into()).await.unwrap());
        assert!(!h.verify(phc, "mfnc_other".into()).await.unwrap());
        assert!(!h.verify("not a phc".into(), "x".into()).await.unwrap());
    }

    /// However many credential checks queue, an enrolment's hash finds a worker within about
    /// one hash's time: checks hold all workers but one.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn credential_checks_leave_one_worker_for_enrolments() {
        let h = Hasher::new(
            &HashParams {
                m_kib: 8192,
                t: 2,
                p: 1,
            },
            2,
            64,
        )
        .unwrap();
        let phc = h.hash("mfnc_secret".into()).await.unwrap();
        let checks: Vec<_> = (0..8)
            .map(|_| {
                let (h, phc) = (h.clone(), phc.clone());
                tokio::spawn(async move {
                    h.verify_check_marking(phc, "mfnc_wrong".into(), &AtomicBool::new(false))
                        .await
                })
            })
            .collect();
        // Every check is running or queued before the enrolment asks.
        while h.verify_count() + (h.waiting.load(Ordering::SeqCst) as u64) < 8 {
            tokio::task::yield_now().await;
        }
        h.hash("mfet_token".into()).await.unwrap();
        let started = h.verify_count();
        assert!(
            started <= 4,
            "{started} of 8 queued checks ran before the enrolment's hash"
        );
        for c in checks {
            assert!(!c.await.unwrap().unwrap());
        }
    }

    /// A stored hash asking for 4 GiB, a million passes or another algorithm is refused
    /// without computing it, and so are such parameters at start.
    #[tokio::test]
    async fn a_hash_with_parameters_out_of_range_is_refused_without_computing_it() {
        let h = small();
        let phc = h.hash("mfnc_secret".into()).await.unwrap();
        assert_eq!(check_phc(&phc), Ok(()));
        let params = phc.split('$').nth(3).unwrap().to_string();
        let before = h.verify_count();
        for forged in [
            phc.replace(&params, "m=4194304,t=2,p=1"),
            phc.replace(&params, "m=64,t=1000000,p=1"),
            phc.replace(&params, "m=64,t=1,p=64"),
            phc.replace("$argon2id$", "$argon2i$"),
            phc.replace("$v=19$", "$v=16$"),
        ] {
            assert!(check_phc(&forged).is_err(), "{forged}");
            assert!(!h.verify(forged, "mfnc_secret".into()).await.unwrap());
        }
        assert_eq!(
            h.verify_count(),
            before,
            "an out-of-range hash was computed"
        );
        let huge = HashParams {
            m_kib: 4 << 20,
            t: 1,
            p: 1,
        };
        assert!(Hasher::new(&huge, 1, 1).is_err());
    }

    #[tokio::test]
    async fn minted_ahead_credentials_verify_and_are_handed_out_once() {
        let h = small();
        let mint = CredentialMint::new(3);
        while mint.refill_one(&h).await.is_some() {}
        assert_eq!(mint.ready(), 3);
        let mut ids = std::collections::HashSet::new();
        for _ in 0..5 {
            let (c, phc) = mint.mint(&h).await.unwrap();
            assert!(h.verify(phc, c.expose().to_string()).await.unwrap());
            assert!(
                ids.insert(c.id().to_string()),
                "a credential was handed out twice"
            );
        }
        assert_eq!(mint.counts(), (3, 2));
    }

    #[test]
    fn secrets_compare() {
        assert!(same_secret("abc", "abc"));
        assert!(!same_secret("abc", "abd"));
        assert_ne!(peer_token("a", ""), peer_token("b", ""));
        assert_ne!(peer_token("a", ""), peer_token("a", "restored-1"));
        assert_eq!(peer_token("a", "").len(), 64);
    }
}

#[cfg(test)]
mod mint_tests {
    use super::*;

    #[test]
    fn the_refill_rests_three_times_its_work_only_while_requests_are_served() {
        let m = CredentialMint::new(4);
        let took = std::time::Duration::from_millis(40);
        assert_eq!(
            m.rest_after(took, 10_000),
            std::time::Duration::ZERO,
            "idle"
        );
        m.note_foreground(10_000);
        assert_eq!(
            m.rest_after(took, 10_100),
            took * 3,
            "requests served just now"
        );
        assert_eq!(
            m.rest_after(took, 10_000 + FOREGROUND_WINDOW_MS),
            std::time::Duration::ZERO,
            "idle again after the window"
        );
    }
}

#[cfg(test)]
mod queue_tests {
    use super::*;
    use axum::response::IntoResponse;

    fn cheap(workers: usize, max_waiting: usize) -> Hasher {
        let params = HashParams {
            m_kib: 64,
            t: 1,
            p: 1,
        };
        Hasher::new(&params, workers, max_waiting).unwrap()
    }

    async fn until_waiting(h: &Hasher, n: usize) {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        while h.waiting.load(Ordering::SeqCst) != n {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{} waiting, expected {n}",
                h.waiting.load(Ordering::SeqCst)
            );
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }

    /// `n` checks of "mfnc_x" against `phc`, spawned, once all of them wait in the queue.
    async fn checks_waiting(
        h: &Hasher,
        phc: &str,
        n: usize,
    ) -> Vec<tokio::task::JoinHandle<Result<bool, crate::error::ApiError>>> {
        let checks = (0..n)
            .map(|_| {
                let (h, phc) = (h.clone(), phc.to_string());
                tokio::spawn(async move { h.verify(phc, "mfnc_x".into()).await })
            })
            .collect();
        until_waiting(h, n).await;
        checks
    }

    /// ARCHITECTURE.md, "Secrets": argon2 runs at most one per worker at once with at most
    /// `max_waiting` waiting; past that the request gets 429 with `Retry-After` and the
    /// contract's JSON error, and the queue takes requests again once it drains.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_argon2_queue_answers_429_with_retry_after_and_the_error_body() {
        let h = cheap(2, 3);
        let phc = h.hash("mfnc_x".into()).await.unwrap();
        // Every worker busy, then three checks waiting: the queue is full.
        let busy = h.permits.clone().acquire_many_owned(2).await.unwrap();
        let waiting = checks_waiting(&h, &phc, 3).await;

        let refused = h.verify(phc.clone(), "mfnc_x".into()).await.unwrap_err();
        assert_eq!(
            h.waiting.load(Ordering::SeqCst),
            3,
            "the refusal took a place"
        );
        let response = refused.into_response();
        assert_eq!(response.status(), 429);
        assert_eq!(
            response.headers().get("retry-after").map(|v| v.as_bytes()),
            Some(crate::error::RETRY_AFTER_S.to_string().as_bytes()),
            "429 without Retry-After"
        );
        let body = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["code"], "overloaded", "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
        );

        // The workers free up: every waiting check runs, and new ones are taken again.
        drop(busy);
        for w in waiting {
            assert!(w.await.unwrap().unwrap());
        }
        assert_eq!(h.waiting.load(Ordering::SeqCst), 0);
        assert!(h.verify(phc, "mfnc_x".into()).await.unwrap());
    }

    /// A check dropped while it waits (its client went away) gives its place back: otherwise
    /// abandoned requests fill the queue and every later check gets 429 for ever.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_check_abandoned_while_waiting_leaves_the_queue() {
        let h = cheap(1, 2);
        let phc = h.hash("mfnc_x".into()).await.unwrap();
        let busy = h.permits.clone().acquire_many_owned(1).await.unwrap();
        let abandoned = checks_waiting(&h, &phc, 2).await;
        for a in &abandoned {
            a.abort();
        }
        for a in abandoned {
            assert!(a.await.unwrap_err().is_cancelled());
        }
        until_waiting(&h, 0).await;
        drop(busy);
        assert!(h.verify(phc, "mfnc_x".into()).await.unwrap());
    }
}
