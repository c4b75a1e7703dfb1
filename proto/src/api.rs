//! The vocabulary of the HTTP API shared by the control plane and its clients: every error code
//! it can answer, with its HTTP status and default message, in one table.
//!
//! Adding a refusal is one edit of the [`codes!`] table below: the enum, its wire string, its
//! status and its message are all generated from that one row, and every `match` on
//! [`ErrorCode`] is exhaustive. A code that is not in the table cannot be answered (there is
//! no "other" variant).
//!
//! The replicated state stores a refusal's code (as its wire string), never an HTTP status: the
//! status is a property of the code, decided here.

use serde::Deserialize;
use serde::Deserializer;
use serde::Serialize;
use serde::Serializer;

macro_rules! codes {
    ($($(#[$doc:meta])* $variant:ident = ($wire:literal, $status:literal, $message:literal),)*) => {
        /// Every error code of the API. See the module docs.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum ErrorCode {
            $($(#[$doc])* $variant,)*
        }

        impl ErrorCode {
            /// Every code, in table order.
            pub const ALL: &'static [ErrorCode] = &[$(ErrorCode::$variant,)*];

            /// The code as the JSON error body carries it.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $(ErrorCode::$variant => $wire,)*
                }
            }

            /// The HTTP status a client is answered with.
            pub const fn status(self) -> u16 {
                match self {
                    $(ErrorCode::$variant => $status,)*
                }
            }

            /// The message used when a refusal has nothing more specific to say.
            pub const fn message(self) -> &'static str {
                match self {
                    $(ErrorCode::$variant => $message,)*
                }
            }
        }
    };
}

codes! {
    // Enrolment tokens.
    TokenExists = ("token_exists", 409, "an enrolment token with this id exists"),
    EnrollmentNotFound = ("enrollment_not_found", 404, "no enrolment token with this id"),
    EnrollmentClaimed = ("enrollment_claimed", 409, "the token was already claimed; revoke the node's credential instead"),
    InvalidToken = ("invalid_token", 401, "the enrolment token is unknown, expired, cancelled or already claimed"),
    TokenCancelled = ("token_cancelled", 401, "the enrolment token was cancelled"),
    TokenExpired = ("token_expired", 401, "the enrolment token has expired"),
    TokenAlreadyClaimed = ("token_already_claimed", 401, "the enrolment token was already claimed"),
    AlreadyCreated = ("already_created", 409, "a token was already created for this request; its plaintext was shown once and cannot be shown again"),
    // Enrolment and nodes.
    CredentialExists = ("credential_exists", 409, "credential id collision; retry"),
    IdentityDecommissioned = ("identity_decommissioned", 403, "this identity belongs to a decommissioned node and can never enrol again"),
    NodeIdExists = ("node_id_exists", 409, "node id collision; retry"),
    NodeNotFound = ("node_not_found", 404, "no node with this id"),
    /// A command on a decommissioned node.
    NodeDecommissioned = ("node_decommissioned", 409, "the node is decommissioned"),
    /// A credential refused because its node was decommissioned: the same wire code as
    /// [`ErrorCode::NodeDecommissioned`], answered 401 (a client reading it back gets that one).
    CredentialOfDecommissionedNode = ("node_decommissioned", 401, "the credential was revoked because its node was decommissioned; this identity can never enrol again"),
    InvalidIdentityProof = ("invalid_identity_proof", 401, "the identity proof does not verify"),
    // Agent credentials.
    Unauthenticated = ("unauthenticated", 401, "a credential is required"),
    InvalidCredential = ("invalid_credential", 401, "the credential is not valid"),
    CredentialRevoked = ("credential_revoked", 401, "the credential was revoked"),
    CredentialForOtherNode = ("credential_for_other_node", 403, "this credential belongs to another node"),
    // Scheduling and smokes.
    NoCapacity = ("no_capacity", 409, "nothing fits"),
    InvalidAllocation = ("invalid_allocation", 400, "no accelerator named"),
    AllocationNotFound = ("allocation_not_found", 404, "no allocation with this id"),
    SmokeExists = ("smoke_exists", 409, "a smoke with this id exists"),
    SmokeNotFound = ("smoke_not_found", 404, "no such smoke"),
    WrongNode = ("wrong_node", 403, "this smoke is for another node"),
    InvalidSmokeReport = ("invalid_smoke_report", 400, "the smoke report is not valid"),
    // Decommission.
    PreviewExists = ("preview_exists", 409, "preview id collision; retry"),
    PreviewNotFound = ("preview_not_found", 404, "no decommission preview with this id (previews expire after 15 minutes); preview again"),
    PreviewForOtherNode = ("preview_for_other_node", 409, "the preview is for another node"),
    PreviewUsed = ("preview_used", 409, "this preview was already executed"),
    PreviewExpired = ("preview_expired", 409, "the preview expired (15 minutes); preview again"),
    PreviewStale = ("preview_stale", 409, "the state changed since the preview; preview again"),
    // Request shape.
    IdempotencyKeyReused = ("idempotency_key_reused", 422, "this Idempotency-Key was already used for a different request to the same operation and target; use a new key"),
    InvalidIdempotencyKey = ("invalid_idempotency_key", 400, "the Idempotency-Key is not valid"),
    BadCommand = ("bad_command", 400, "the command does not decode"),
    BadMethod = ("bad_method", 400, "bad method"),
    InvalidJson = ("invalid_json", 400, "the request body is not valid JSON"),
    InvalidBody = ("invalid_body", 400, "a field of the request body has the wrong type or value"),
    UnreadableBody = ("unreadable_body", 400, "the request body could not be read"),
    BodyTooLarge = ("body_too_large", 413, "the request body is larger than this endpoint accepts"),
    InvalidId = ("invalid_id", 400, "the id is not valid"),
    InvalidHostname = ("invalid_hostname", 400, "the hostname is not valid"),
    InvalidInventory = ("invalid_inventory", 400, "the inventory is not valid"),
    InvalidNote = ("invalid_note", 400, "the note is not valid"),
    InvalidReason = ("invalid_reason", 400, "the reason is not valid"),
    InvalidTtl = ("invalid_ttl", 400, "the ttl is not valid"),
    InvalidSince = ("invalid_since", 400, "the since parameter is not valid"),
    InvalidQuery = ("invalid_query", 400, "the query is not valid"),
    NotFound = ("not_found", 404, "no such resource"),
    MethodNotAllowed = ("method_not_allowed", 405, "this method is not allowed here"),
    // Cluster.
    NoLeader = ("no_leader", 503, "the cluster has no leader; retry"),
    NotLeader = ("not_leader", 503, "this member is not the leader; retry"),
    LeaderChanged = ("leader_changed", 503, "the leader changed; retry"),
    NotCaughtUp = ("not_caught_up", 503, "this member has not caught up with the leader; retry"),
    RaftUnavailable = ("raft_unavailable", 503, "consensus is unavailable; retry"),
    OutcomeUnknown = ("outcome_unknown", 503, "the write may or may not have committed; retry with the same idempotency key"),
    PeerUnauthenticated = ("peer_unauthenticated", 401, "the peer is not authenticated"),
    BadPeerBody = ("bad_peer_body", 400, "the peer request does not decode"),
    Overloaded = ("overloaded", 429, "too many requests are waiting for a secret check; retry shortly"),
    Internal = ("internal", 500, "internal error"),
}

impl ErrorCode {
    /// The code for a wire string (the first row of the table that has it).
    pub fn parse(wire: &str) -> Option<ErrorCode> {
        Self::ALL.iter().copied().find(|c| c.as_str() == wire)
    }
}

impl PartialEq<&str> for ErrorCode {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for ErrorCode {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for ErrorCode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        ErrorCode::parse(&s)
            .ok_or_else(|| serde::de::Error::custom(format!("unknown error code {s:?}")))
    }
}

/// One member of the membership, as `GET /api/v1/cluster` shows it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ClusterMember {
    pub id: u64,
    pub url: String,
    pub voter: bool,
}

/// Counters of the credential check in `GET /api/v1/cluster`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct SecretChecksView {
    pub argon2_verifies: u64,
    pub cache_hits: u64,
    pub cache_entries: usize,
    pub entries_learned_from_leader: u64,
}

/// The leader's pool of credentials minted ahead, in `GET /api/v1/cluster`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct CredentialPoolView {
    pub ready: usize,
    pub minted_ahead: u64,
    pub minted_inline: u64,
}

/// `GET /api/v1/cluster`: the cluster as the answering member sees it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ClusterView {
    pub id: u64,
    pub leader_id: Option<u64>,
    pub leader_url: Option<String>,
    pub term: u64,
    /// openraft's server state: `Leader`, `Follower`, `Candidate`, `Learner`, `Shutdown`.
    pub state: String,
    pub commit_index: u64,
    pub applied_index: u64,
    pub last_log_index: u64,
    pub snapshot_index: Option<u64>,
    pub members: Vec<ClusterMember>,
    /// "" for a cluster formed from scratch; `restored-...` for one formed from a backup.
    pub cluster_id: String,
    pub secret_checks: SecretChecksView,
    pub credential_pool: CredentialPoolView,
}

/// `GET /api/v1/cluster/state-digest`: a digest of the member's applied state.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct StateDigest {
    pub digest: String,
    pub applied_index: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_is_snake_case_with_an_error_status_and_round_trips() {
        for &c in ErrorCode::ALL {
            let s = c.as_str();
            assert!(
                !s.is_empty() && s.chars().all(|ch| ch.is_ascii_lowercase() || ch == '_'),
                "{s}"
            );
            assert!((400..600).contains(&c.status()), "{s}");
            assert!(!c.message().is_empty(), "{s}");
            let json = serde_json::to_string(&c).unwrap();
            let back: ErrorCode = serde_json::from_str(&json).unwrap();
            // Only the one shared wire string reads back as its first row.
            assert!(back == c || back.as_str() == c.as_str(), "{s}");
        }
    }

    #[test]
    fn a_wire_string_names_one_code_except_the_documented_pair() {
        let mut seen = std::collections::BTreeMap::new();
        for &c in ErrorCode::ALL {
            if let Some(prev) = seen.insert(c.as_str(), c) {
                assert_eq!(
                    (prev, c),
                    (
                        ErrorCode::NodeDecommissioned,
                        ErrorCode::CredentialOfDecommissionedNode
                    )
                );
            }
        }
    }

    #[test]
    fn an_unknown_code_does_not_deserialize() {
        assert!(serde_json::from_str::<ErrorCode>("\"refused\"").is_err());
    }
}
