//! The bodies of the fuzz targets (`fuzz/fuzz_targets/*.rs` call them under libFuzzer on
//! nightly; `tests/fuzz_corpus.rs` replays the kept corpus and mutations of it on stable, in
//! every test run). Each takes any bytes and must return without panicking, aborting or
//! allocating without bound; what it may find wrong is a refusal (an `Err`), never a crash.
//!
//! Every input an outsider or a damaged disk can hand a member has a target: the secret
//! parsers, every JSON body, identity proofs, the peer header, peer RPC bodies, log entries
//! (decoded and applied), snapshots and backups.

use modelforge_proto::api;
use modelforge_proto::identity;
use modelforge_proto::secret::Secret;
use modelforge_proto::secret::SecretKind;
use modelforge_proto::wire;
use modelforge_raft::codec;

use crate::state::Envelope;
use crate::state::State;

/// The names of the targets, as `fuzz/fuzz_targets/<name>.rs` and `fuzz/corpus/<name>/`.
pub const TARGETS: [&str; 8] = [
    "secret",
    "json_body",
    "identity_proof",
    "peer_header",
    "peer_rpc",
    "log_entry",
    "snapshot",
    "backup",
];

/// Run the target named `name` on `data` (see [`TARGETS`]).
pub fn run(name: &str, data: &[u8]) {
    match name {
        "secret" => secret(data),
        "json_body" => json_body(data),
        "identity_proof" => identity_proof(data),
        "peer_header" => peer_header(data),
        "peer_rpc" => peer_rpc(data),
        "log_entry" => log_entry(data),
        "snapshot" => snapshot(data),
        "backup" => backup(data),
        other => panic!("no fuzz target {other:?}"),
    }
}

/// The secret parsers, and the comparison, on any text.
pub fn secret(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    for kind in [
        SecretKind::EnrollmentToken,
        SecretKind::NodeCredential,
        SecretKind::OperatorToken,
    ] {
        if let Ok(s) = Secret::parse(kind, text) {
            // A parsed secret round-trips and its parts are where the format says.
            assert_eq!(s.expose(), text);
            assert_eq!(s.id().len(), 32);
            let _ = s.fast_digest();
        }
    }
    let _ = crate::secrets::same_secret(text, "mfet_reference");
}

/// Parse `data` as `T` and, when it parses, encode it again.
fn json_as<T: serde::de::DeserializeOwned + serde::Serialize>(data: &[u8]) {
    if let Ok(v) = serde_json::from_slice::<T>(data) {
        let again = serde_json::to_vec(&v).expect("a parsed body encodes");
        serde_json::from_slice::<T>(&again).expect("an encoded body parses");
    }
}

/// Every JSON body a member accepts.
pub fn json_body(data: &[u8]) {
    json_as::<wire::EnrollRequest>(data);
    json_as::<wire::Telemetry>(data);
    json_as::<wire::Inventory>(data);
    json_as::<wire::SmokeReport>(data);
    json_as::<api::AllocationRequest>(data);
    json_as::<api::CreateEnrollment>(data);
    json_as::<api::CreateOperatorToken>(data);
    json_as::<api::EmptyRequest>(data);
    json_as::<api::ExecuteDecommission>(data);
    json_as::<api::ReasonRequest>(data);
    json_as::<api::RevokeRequest>(data);
    if let Ok(inv) = serde_json::from_slice::<wire::Inventory>(data) {
        let _ = crate::state::inventory_digest(&inv);
    }
}

/// An identity proof, verified against the time it claims.
pub fn identity_proof(data: &[u8]) {
    if let Ok(p) = serde_json::from_slice::<identity::IdentityProof>(data) {
        let _ = identity::verify(
            &p,
            "0123456789abcdef0123456789abcdef",
            "gpu-1",
            p.signed_at_ms,
        );
    }
}

/// The peer header's parser and MAC check.
pub fn peer_header(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let key = crate::secrets::peer_token("fuzz-cluster-secret-0123456789", "");
    for (method, path) in [
        ("POST", "/internal/v1/propose"),
        ("GET", "/internal/v1/status"),
    ] {
        let _ = modelforge_raft::peer_auth::check(key.as_bytes(), Some(text), method, path, 0);
    }
}

/// Peer RPC bodies of every kind, and the two bodies members send each other besides.
pub fn peer_rpc(data: &[u8]) {
    for kind in modelforge_raft::network::RPC_KINDS {
        let _ = modelforge_raft::network::decode_rpc(kind, data);
    }
    let _ = codec::decode::<Envelope>(data);
    let _ = codec::decode::<Vec<(String, [u8; 32])>>(data);
}

/// A log entry's command, decoded and applied: apply never panics, and whatever it decides
/// leaves the state's invariants whole.
pub fn log_entry(data: &[u8]) {
    let Ok(env) = codec::decode::<Envelope>(data) else {
        return;
    };
    let mut state = State::default();
    let _ = state.apply(1, &env);
    let _ = state.apply(2, &env);
    if let Err(e) = state.check() {
        panic!("apply broke an invariant: {e}");
    }
}

/// A snapshot (the encoded state), decoded and checked as a member installing it does; a state
/// that passes can be read and applied to without breaking an invariant.
pub fn snapshot(data: &[u8]) {
    let Ok(mut state) = codec::decode::<State>(data) else {
        return;
    };
    if state.check().is_err() {
        return;
    }
    let _ = state.digest();
    let _ = codec::encode(&state);
    let env = Envelope {
        request_id: "fuzz".into(),
        now_ms: state.clock_ms.saturating_add(1),
        actor: "fuzz".into(),
        command: crate::state::Command::TouchCredentials { uses: vec![] },
    };
    let next = state.last_applied_index.saturating_add(1);
    let _ = state.apply(next, &env);
}

/// A backup file: its framing without the secret, and the whole check with one.
pub fn backup(data: &[u8]) {
    let _ = crate::backup::inspect(data);
    let _ = crate::backup::decode(data, "fuzz-cluster-secret-0123456789");
}
