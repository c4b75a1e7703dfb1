//! The agent's identity: an Ed25519 key pair made on the node. The public key is the identity
//! the control plane binds a node id to; the secret key never leaves the node. At enrolment the
//! agent signs a message that binds the token id, the hostname, the key and the time, so a
//! proof cannot be moved to another token or replayed long after.

use ed25519_dalek::Signer;
use serde::Deserialize;
use serde::Serialize;

/// How far the signing time of a proof may be from the server's clock.
pub const PROOF_MAX_SKEW_MS: i64 = 10 * 60 * 1000;

/// Proof of possession sent in the enrolment request's `identity` object.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
pub struct IdentityProof {
    /// Ed25519 public key, hex.
    pub public_key: String,
    /// Signature over [`proof_message`], hex.
    pub signature: String,
    /// When the agent signed, milliseconds since the Unix epoch.
    pub signed_at_ms: i64,
    /// The node id the agent believes it has (informational: the key decides).
    #[serde(default)]
    pub node_id: Option<String>,
}

/// The exact bytes an agent signs at enrolment.
pub fn proof_message(
    token_id: &str,
    hostname: &str,
    public_key: &str,
    signed_at_ms: i64,
) -> Vec<u8> {
    format!("modelforge-enroll-v1\n{token_id}\n{hostname}\n{public_key}\n{signed_at_ms}")
        .into_bytes()
}

/// An identity key pair, held by the agent.
pub struct IdentityKey(ed25519_dalek::SigningKey);

impl IdentityKey {
    pub fn generate() -> Self {
        Self(ed25519_dalek::SigningKey::from_bytes(
            &crate::random_bytes::<32>(),
        ))
    }

    pub fn from_secret_hex(s: &str) -> Option<Self> {
        crate::unhex::<32>(s).map(|b| Self(ed25519_dalek::SigningKey::from_bytes(&b)))
    }

    pub fn secret_hex(&self) -> String {
        crate::hex(&self.0.to_bytes())
    }

    pub fn public_hex(&self) -> String {
        crate::hex(self.0.verifying_key().as_bytes())
    }

    /// Sign an enrolment proof for `token_id` and `hostname` at `now_ms`.
    pub fn prove(
        &self,
        token_id: &str,
        hostname: &str,
        now_ms: i64,
        node_id: Option<String>,
    ) -> IdentityProof {
        let public_key = self.public_hex();
        let sig = self
            .0
            .sign(&proof_message(token_id, hostname, &public_key, now_ms));
        IdentityProof {
            public_key,
            signature: crate::hex(&sig.to_bytes()),
            signed_at_ms: now_ms,
            node_id,
        }
    }
}

/// Why a proof was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProofError {
    BadKey,
    BadSignature,
    Stale,
}

impl std::fmt::Display for ProofError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ProofError::BadKey => "identity.public_key is not an Ed25519 public key in hex",
            ProofError::BadSignature => {
                "identity.signature does not verify for this token, hostname and key"
            }
            ProofError::Stale => "identity.signed_at_ms is too far from the server's clock",
        })
    }
}

/// Check `proof` for `token_id` and `hostname` against the server clock `now_ms`.
pub fn verify(
    proof: &IdentityProof,
    token_id: &str,
    hostname: &str,
    now_ms: i64,
) -> Result<(), ProofError> {
    let key_bytes = crate::unhex::<32>(&proof.public_key).ok_or(ProofError::BadKey)?;
    let key =
        ed25519_dalek::VerifyingKey::from_bytes(&key_bytes).map_err(|_| ProofError::BadKey)?;
    let sig_bytes = crate::unhex::<64>(&proof.signature).ok_or(ProofError::BadSignature)?;
    let sig = ed25519_dalek::Signature::from_bytes(&sig_bytes);
    if (now_ms - proof.signed_at_ms).abs() > PROOF_MAX_SKEW_MS {
        return Err(ProofError::Stale);
    }
    let msg = proof_message(token_id, hostname, &proof.public_key, proof.signed_at_ms);
    // Strict: no malleable signature (non-canonical S) and no small-order key or R passes.
    key.verify_strict(&msg, &sig)
        .map_err(|_| ProofError::BadSignature)?;
    if key.is_weak() {
        return Err(ProofError::BadKey);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_bind_token_hostname_and_time() {
        let k = IdentityKey::generate();
        let p = k.prove("tok1", "gpu-1", 1_000_000, None);
        assert_eq!(verify(&p, "tok1", "gpu-1", 1_000_000), Ok(()));
        assert_eq!(
            verify(&p, "tok2", "gpu-1", 1_000_000),
            Err(ProofError::BadSignature)
        );
        assert_eq!(
            verify(&p, "tok1", "gpu-2", 1_000_000),
            Err(ProofError::BadSignature)
        );
        assert_eq!(
            verify(&p, "tok1", "gpu-1", 1_000_000 + PROOF_MAX_SKEW_MS + 1),
            Err(ProofError::Stale)
        );
        let k2 = IdentityKey::from_secret_hex(&k.secret_hex()).unwrap();
        assert_eq!(k2.public_hex(), k.public_hex());
        let mut bad = p.clone();
        bad.public_key = "zz".into();
        assert_eq!(
            verify(&bad, "tok1", "gpu-1", 1_000_000),
            Err(ProofError::BadKey)
        );
    }
}
