//! The receiving side of the peer header (see `modelforge_raft::peer_auth` for its format):
//! the MAC, the clock window, the sender bound to the connection's certificate, and the
//! seen-nonce cache that refuses a replay. See ARCHITECTURE "Transport security".

use std::collections::HashMap;
use std::sync::Mutex;

use axum::extract::Request;
use modelforge_proto::api::ErrorCode;
use modelforge_raft::network::PEER_HEADER;
use modelforge_raft::peer_auth;
use modelforge_raft::peer_auth::Signed;

use crate::error::ApiError;

/// A peer request is refused when its timestamp is further than this from this member's clock.
pub const WINDOW_MS: u64 = 30_000;
/// Nonces remembered at most; beyond it peer calls are refused until old ones expire (memory
/// stays bounded even if a member's key were used to flood this one).
const MAX_SEEN: usize = 1_000_000;
/// The relay hop counter, covered by the MAC.
pub const HOPS_HEADER: &str = "x-modelforge-hops";

pub struct Verifier {
    key: Vec<u8>,
    /// Nonce -> the time (unix ms) after which its request falls outside the window anyway.
    seen: Mutex<Seen>,
}

#[derive(Default)]
struct Seen {
    until: HashMap<[u8; 16], u64>,
    /// Size after the last prune: the next prune runs when the map has doubled.
    pruned_at: usize,
}

impl Verifier {
    pub fn new(key: &[u8]) -> Self {
        Self {
            key: key.to_vec(),
            seen: Mutex::new(Seen::default()),
        }
    }

    /// Check the peer header of `req` (its body is not read here: the caller compares the body
    /// with [`Signed::body_sha256`] once it has read it, see [`require_body`]). `member` is the
    /// member id of the connection's client certificate (None without TLS): the header must
    /// have been signed by that member.
    pub fn verify(
        &self,
        req: &Request,
        member: Option<u64>,
        now_ms: u64,
    ) -> Result<Signed, ApiError> {
        let refuse = |why: &str| ApiError::new(ErrorCode::PeerUnauthenticated, why.to_string());
        let header = req.headers().get(PEER_HEADER).and_then(|v| v.to_str().ok());
        let hops = hops_of(req);
        let path = req
            .uri()
            .path_and_query()
            .map(|p| p.as_str())
            .unwrap_or("/");
        let signed = peer_auth::check(&self.key, header, req.method().as_str(), path, hops)
            .map_err(|e| refuse(&format!("{e} (peer endpoints need the cluster secret)")))?;
        if signed.at_ms.abs_diff(now_ms) > WINDOW_MS {
            return Err(refuse(
                "the peer request's timestamp is outside the window (a replay, or clocks apart by more than 30 s)",
            ));
        }
        if let Some(m) = member
            && m != signed.from
        {
            return Err(refuse(
                "the peer header was signed for another member than the certificate names",
            ));
        }
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if seen.until.len() >= seen.pruned_at.max(1024) * 2 {
            seen.until.retain(|_, until| *until >= now_ms);
            seen.pruned_at = seen.until.len();
        }
        if seen.until.len() >= MAX_SEEN {
            return Err(refuse("too many recent peer requests; retry shortly"));
        }
        if seen
            .until
            .insert(signed.nonce, signed.at_ms + WINDOW_MS)
            .is_some()
        {
            return Err(refuse("the peer request was seen before (a replay)"));
        }
        Ok(signed)
    }
}

/// The relay hop count a request claims (0 when absent).
pub fn hops_of(req: &Request) -> u32 {
    req.headers()
        .get(HOPS_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Refuse a body that is not the one the header signed.
pub fn require_body(signed: &Signed, body: &[u8]) -> Result<(), ApiError> {
    if peer_auth::body_matches(signed, body) {
        Ok(())
    } else {
        Err(body_not_signed())
    }
}

/// Refuse a streamed body whose SHA-256 is not the one the header signed.
pub fn require_digest(signed: &Signed, digest: &[u8; 32]) -> Result<(), ApiError> {
    if peer_auth::digest_matches(signed, digest) {
        Ok(())
    } else {
        Err(body_not_signed())
    }
}

fn body_not_signed() -> ApiError {
    ApiError::new(
        ErrorCode::PeerUnauthenticated,
        "the peer request's body is not the one its header signed",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use modelforge_raft::peer_auth::PeerSigner;

    fn req(header: &str) -> Request {
        axum::http::Request::builder()
            .method("POST")
            .uri("/internal/v1/propose")
            .header(PEER_HEADER, header)
            .body(axum::body::Body::empty())
            .unwrap()
    }

    #[test]
    fn a_header_is_accepted_once_within_the_window_and_from_its_own_member() {
        let v = Verifier::new(b"k");
        let s = PeerSigner::new(b"k", 3);
        let now = modelforge_proto::now_ms() as u64;
        let h = s.sign_at("POST", "/internal/v1/propose", b"", 0, now, [7; 16]);
        assert_eq!(v.verify(&req(&h), Some(3), now).unwrap().from, 3);
        // The same request again: a replay.
        assert!(v.verify(&req(&h), Some(3), now).is_err());
        // Fresh nonces, but old, future, signed as another member, or with another key.
        let old = s.sign_at(
            "POST",
            "/internal/v1/propose",
            b"",
            0,
            now - 31_000,
            [8; 16],
        );
        let ahead = s.sign_at(
            "POST",
            "/internal/v1/propose",
            b"",
            0,
            now + 31_000,
            [9; 16],
        );
        let other = PeerSigner::new(b"k", 2).sign("POST", "/internal/v1/propose", b"", 0);
        let foreign = PeerSigner::new(b"x", 3).sign("POST", "/internal/v1/propose", b"", 0);
        for h in [old, ahead, other, foreign] {
            assert!(v.verify(&req(&h), Some(3), now).is_err(), "{h}");
        }
        // Without TLS (no certificate member) the signed sender stands.
        let plain = PeerSigner::new(b"k", 2).sign("POST", "/internal/v1/propose", b"", 0);
        assert_eq!(v.verify(&req(&plain), None, now).unwrap().from, 2);
    }

    #[test]
    fn the_seen_nonces_are_pruned_once_out_of_the_window() {
        let v = Verifier::new(b"k");
        let s = PeerSigner::new(b"k", 1);
        let start = modelforge_proto::now_ms() as u64;
        for i in 0..5000u32 {
            let mut nonce = [0; 16];
            nonce[..4].copy_from_slice(&i.to_be_bytes());
            let at = start + u64::from(i) * 10;
            let h = s.sign_at("POST", "/internal/v1/propose", b"", 0, at, nonce);
            v.verify(&req(&h), None, at).unwrap();
        }
        // 50 s of requests at 100/s: only about the last window's worth (plus one prune's slack)
        // is remembered.
        let kept = v.seen.lock().unwrap().until.len();
        assert!(kept < 4200, "{kept} nonces kept");
    }
}
