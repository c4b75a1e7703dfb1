//! What the scale examples share: a node enrolled as the cluster benchmark enrols one.

use modelforge::state::Command;
use modelforge_proto::wire::Inventory;

/// An argon2id hash of the length the members store.
const HASH: &str =
    "$argon2id$v=19$m=19456,t=2,p=1$c2FsdHNhbHRzYWx0$aGFzaGhhc2hoYXNoaGFzaGhhc2hoYXNoaGFzaGhhc2g";

/// Node `i`'s token and its enrolment (8-GPU inventory `inv`, a hostname of its own).
pub fn enrolment(i: usize, inv: &Inventory) -> [Command; 2] {
    [
        Command::CreateToken {
            token_id: format!("{i:032x}").into(),
            hash: HASH.into(),
            ttl_ms: 3_600_000,
            note: None,
        },
        Command::Enroll {
            token_id: format!("{i:032x}").into(),
            public_key: format!("{i:064x}"),
            hostname: format!("gpu-{i}"),
            inventory: inv.clone(),
            new_node_id: format!("{i:08x}-0000-4000-8000-000000000000").into(),
            credential_id: format!("{:032x}", i + (1 << 40)).into(),
            credential_hash: HASH.into(),
            proof_signed_at_ms: 1,
        },
    ]
}
