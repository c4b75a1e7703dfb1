//! Argon2id hashing and verification of tokens and credentials, off the async executor, on a
//! bounded pool.
//!
//! Parameters: every stored secret is a 256-bit random string, so no cost setting changes how
//! hard it is to brute-force; the hash exists so that a stolen database or snapshot yields
//! nothing usable. The default is OWASP's argon2id setting (m=19 MiB, t=2, p=1) because it is
//! the one operators expect to see; it is configurable and travels inside each PHC string, so
//! changing it needs no migration.
//!
//! Load: at most `workers` hashes run at once (one per core) and at most `max_waiting` wait;
//! past that a request is answered 429 instead of queueing without bound.

use std::sync::Arc;
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

/// The bounded argon2 pool. Clones share it.
#[derive(Clone)]
pub struct Hasher {
    params: argon2::Params,
    permits: Arc<tokio::sync::Semaphore>,
    waiting: Arc<AtomicUsize>,
    max_waiting: usize,
    verifies: Arc<std::sync::atomic::AtomicU64>,
}

impl Hasher {
    pub fn new(params: &HashParams, workers: usize, max_waiting: usize) -> anyhow::Result<Self> {
        let params = argon2::Params::new(params.m_kib, params.t, params.p, None)
            .map_err(|e| anyhow::anyhow!("argon2 parameters: {e}"))?;
        Ok(Self {
            params,
            permits: Arc::new(tokio::sync::Semaphore::new(workers.max(1))),
            waiting: Arc::new(AtomicUsize::new(0)),
            max_waiting,
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
        if self.waiting.fetch_add(1, Ordering::SeqCst) >= self.max_waiting {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(ApiError::overloaded());
        }
        let permit = self.permits.clone().acquire_owned().await;
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        let permit = permit.map_err(|_| ApiError::internal("secret pool closed"))?;
        let argon = self.argon();
        let out = tokio::task::spawn_blocking(move || {
            let out = f(argon);
            drop(permit);
            out
        })
        .await
        .map_err(|_| ApiError::internal("secret check failed"))?;
        Ok(out)
    }

    /// Hash `secret` into a PHC string (with its own random salt and the parameters).
    pub async fn hash(&self, secret: String) -> Result<String, ApiError> {
        self.run(move |a| a.hash_password(secret.as_bytes()).map(|h| h.to_string()))
            .await?
            .map_err(|e| ApiError::internal(format!("argon2 hash failed: {e}")))
    }

    /// Whether `secret` matches the stored PHC string. A malformed PHC string never matches.
    pub async fn verify(&self, phc: String, secret: String) -> Result<bool, ApiError> {
        self.verifies.fetch_add(1, Ordering::Relaxed);
        self.run(move |a| a.verify_password(secret.as_bytes(), phc.as_str()).is_ok())
            .await
    }

    /// How many argon2 verifies this member has run.
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

/// Compare a presented bearer secret with the expected one in constant time (over digests,
/// so the length does not leak either).
pub fn same_secret(presented: &str, expected: &str) -> bool {
    use sha2::Digest;
    let a = sha2::Sha256::digest(presented.as_bytes());
    let b = sha2::Sha256::digest(expected.as_bytes());
    a.ct_eq(&b).into()
}

/// The value of the peer header, derived from the cluster secret so that the secret itself
/// (which may be the admin token) never travels between members.
pub fn peer_token(cluster_secret: &str) -> String {
    use hmac::KeyInit;
    use hmac::Mac;
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(cluster_secret.as_bytes())
        .expect("hmac takes any key length");
    mac.update(b"modelforge-peer-v1");
    modelforge_proto::hex(&mac.finalize().into_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn hash_then_verify() {
        let h = Hasher::new(
            &HashParams {
                m_kib: 1024,
                t: 1,
                p: 1,
            },
            2,
            8,
        )
        .unwrap();
        let phc = h.hash("mfnc_secret".into()).await.unwrap();
        assert!(phc.starts_with("$argon2id$"));
        assert!(!phc.contains("mfnc_secret"));
        assert!(h.verify(phc.clone(), "mfnc_secret".into()).await.unwrap());
        assert!(!h.verify(phc, "mfnc_other".into()).await.unwrap());
        assert!(!h.verify("not a phc".into(), "x".into()).await.unwrap());
    }

    #[test]
    fn secrets_compare() {
        assert!(same_secret("abc", "abc"));
        assert!(!same_secret("abc", "abd"));
        assert_ne!(peer_token("a"), peer_token("b"));
        assert_eq!(peer_token("a").len(), 64);
    }
}
