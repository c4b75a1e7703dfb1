//! The peer header: a MAC that binds one member-to-member request to its method, path, body,
//! sender, time and a fresh nonce, so that a captured request cannot be replayed or altered.
//!
//! `x-modelforge-peer: v2.<from>.<unix ms>.<nonce hex>.<body sha256 hex>.<mac hex>`, the MAC an
//! HMAC-SHA256 keyed by the peer key over every other field plus the method, the path and query,
//! and the relay hop count. This module signs and checks the MAC; the receiver adds the clock
//! window, the seen-nonce cache and the body digest (see the server's `peer_auth`).

use hmac::KeyInit;
use hmac::Mac;
use modelforge_proto::hex;
use modelforge_proto::unhex;
use sha2::Digest;
use subtle::ConstantTimeEq;

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

const VERSION: &str = "v2";

/// Signs this member's outgoing peer requests.
#[derive(Clone)]
pub struct PeerSigner {
    key: std::sync::Arc<[u8]>,
    from: u64,
}

/// What a verified header says (the MAC matched; time, nonce and body are the caller's to check).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Signed {
    pub from: u64,
    pub at_ms: u64,
    pub nonce: [u8; 16],
    pub body_sha256: [u8; 32],
}

/// Why a header was refused (no secret material in any of them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BadHeader {
    #[error("the peer header is missing")]
    Missing,
    #[error("the peer header is malformed")]
    Malformed,
    #[error("the peer header's MAC does not match")]
    BadMac,
}

impl PeerSigner {
    /// `key`: the peer key derived from the cluster secret; `from`: this member's id.
    pub fn new(key: &[u8], from: u64) -> Self {
        Self {
            key: key.into(),
            from,
        }
    }

    /// The header value for one request (a new nonce and timestamp on every call, so a retried
    /// request is signed anew).
    pub fn sign(&self, method: &str, path_and_query: &str, body: &[u8], hops: u32) -> String {
        self.sign_digest(
            method,
            path_and_query,
            sha2::Sha256::digest(body).into(),
            hops,
        )
    }

    /// [`Self::sign`] for a body known by its SHA-256 (a body streamed from a file).
    pub fn sign_digest(
        &self,
        method: &str,
        path_and_query: &str,
        body_sha256: [u8; 32],
        hops: u32,
    ) -> String {
        let nonce: [u8; 16] = modelforge_proto::random_bytes();
        let at_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        self.header(
            method,
            path_and_query,
            hops,
            Signed {
                from: self.from,
                at_ms,
                nonce,
                body_sha256,
            },
        )
    }

    /// [`Self::sign`] with a given time and nonce (tests forge old and repeated headers).
    pub fn sign_at(
        &self,
        method: &str,
        path_and_query: &str,
        body: &[u8],
        hops: u32,
        at_ms: u64,
        nonce: [u8; 16],
    ) -> String {
        let signed = Signed {
            from: self.from,
            at_ms,
            nonce,
            body_sha256: sha2::Sha256::digest(body).into(),
        };
        self.header(method, path_and_query, hops, signed)
    }

    fn header(&self, method: &str, path_and_query: &str, hops: u32, signed: Signed) -> String {
        let mac = mac(&self.key, method, path_and_query, hops, &signed);
        format!(
            "{VERSION}.{}.{}.{}.{}.{}",
            signed.from,
            signed.at_ms,
            hex(&signed.nonce),
            hex(&signed.body_sha256),
            hex(&mac)
        )
    }
}

/// Check a header's MAC for this request (before its body is read: the body's digest is taken
/// from the header, and the caller compares it with the body afterwards).
pub fn check(
    key: &[u8],
    header: Option<&str>,
    method: &str,
    path_and_query: &str,
    hops: u32,
) -> Result<Signed, BadHeader> {
    let header = header.filter(|h| !h.is_empty()).ok_or(BadHeader::Missing)?;
    let mut parts = header.split('.');
    let (Some(VERSION), Some(from), Some(at), Some(nonce), Some(digest), Some(given), None) = (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    ) else {
        return Err(BadHeader::Malformed);
    };
    let signed = Signed {
        from: from.parse().map_err(|_| BadHeader::Malformed)?,
        at_ms: at.parse().map_err(|_| BadHeader::Malformed)?,
        nonce: unhex(nonce).ok_or(BadHeader::Malformed)?,
        body_sha256: unhex(digest).ok_or(BadHeader::Malformed)?,
    };
    let given: [u8; 32] = unhex(given).ok_or(BadHeader::Malformed)?;
    let expected = mac(key, method, path_and_query, hops, &signed);
    if bool::from(expected.ct_eq(&given)) {
        Ok(signed)
    } else {
        Err(BadHeader::BadMac)
    }
}

/// Whether `body` is the one the header signed.
pub fn body_matches(signed: &Signed, body: &[u8]) -> bool {
    digest_matches(signed, &sha2::Sha256::digest(body).into())
}

/// Whether a body whose SHA-256 is `digest` (taken as it streamed in) is the one the header
/// signed.
pub fn digest_matches(signed: &Signed, digest: &[u8; 32]) -> bool {
    bool::from(digest.ct_eq(&signed.body_sha256))
}

fn mac(key: &[u8], method: &str, path_and_query: &str, hops: u32, s: &Signed) -> [u8; 32] {
    let mut m = HmacSha256::new_from_slice(key).expect("hmac takes any key length");
    // Length-prefixed fields: no two different requests produce the same MAC input.
    for field in [
        VERSION.as_bytes(),
        method.as_bytes(),
        path_and_query.as_bytes(),
        &s.from.to_be_bytes(),
        &s.at_ms.to_be_bytes(),
        &s.nonce,
        &s.body_sha256,
        &hops.to_be_bytes(),
    ] {
        m.update(&(field.len() as u64).to_be_bytes());
        m.update(field);
    }
    m.finalize().into_bytes().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signed_header_checks_only_for_its_own_request() {
        let s = PeerSigner::new(b"key", 2);
        let h = s.sign("POST", "/internal/v1/raft/append", b"body", 0);
        let ok = check(b"key", Some(&h), "POST", "/internal/v1/raft/append", 0).unwrap();
        assert_eq!(ok.from, 2);
        assert!(body_matches(&ok, b"body"));
        assert!(!body_matches(&ok, b"bodx"));
        for (key, method, path, hops) in [
            (&b"other"[..], "POST", "/internal/v1/raft/append", 0),
            (b"key", "GET", "/internal/v1/raft/append", 0),
            (b"key", "POST", "/internal/v1/raft/vote", 0),
            (b"key", "POST", "/internal/v1/raft/append", 1),
        ] {
            assert_eq!(
                check(key, Some(&h), method, path, hops),
                Err(BadHeader::BadMac)
            );
        }
        // Any field changed breaks the MAC: the sender, the time, the nonce, the digest.
        let fields: Vec<&str> = h.split('.').collect();
        for i in 1..5 {
            let mut f = fields.clone();
            let changed = if i <= 2 {
                "9".to_string()
            } else {
                "0".repeat(f[i].len())
            };
            f[i] = &changed;
            assert_eq!(
                check(
                    b"key",
                    Some(&f.join(".")),
                    "POST",
                    "/internal/v1/raft/append",
                    0
                ),
                Err(BadHeader::BadMac),
                "field {i}"
            );
        }
        for bad in ["", "v1.2.3", "v2.x.1.00.00.00", &format!("{h}.extra")] {
            assert!(check(b"key", Some(bad), "POST", "/internal/v1/raft/append", 0).is_err());
        }
        assert_eq!(check(b"key", None, "POST", "/", 0), Err(BadHeader::Missing));
    }

    #[test]
    fn every_signature_has_a_fresh_nonce() {
        let s = PeerSigner::new(b"key", 1);
        let a = check(b"key", Some(&s.sign("GET", "/x", b"", 0)), "GET", "/x", 0).unwrap();
        let b = check(b"key", Some(&s.sign("GET", "/x", b"", 0)), "GET", "/x", 0).unwrap();
        assert_ne!(a.nonce, b.nonce);
    }
}
