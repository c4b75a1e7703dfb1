use super::*;
use crate::journal::Fact;
use modelforge_proto::gpu_health::Health;
use modelforge_proto::ids::AllocationState;
use modelforge_proto::ids::CredentialId;
use modelforge_proto::ids::HistoryKind;
use modelforge_proto::ids::NodeId;
use modelforge_proto::ids::TokenId;
use modelforge_proto::wire::Inventory;
use std::sync::Arc;

fn env(id: &str, now: i64, command: Command) -> Envelope {
    Envelope {
        request_id: id.to_string(),
        now_ms: now,
        actor: "test".into(),
        command,
    }
}

fn create(s: &mut State, token: &str, now: i64) {
    let r = s
        .apply(
            1,
            &env(
                &format!("create-{token}"),
                now,
                Command::CreateToken {
                    token_id: token.into(),
                    hash: "h".into(),
                    ttl_ms: 60_000,
                    note: None,
                },
            ),
        )
        .result;
    assert!(r.is_ok(), "{r:?}");
}

fn enroll(
    s: &mut State,
    req: &str,
    now: i64,
    token: &str,
    key: &str,
    node: &str,
    cred: &str,
) -> ApplyResult {
    s.apply(
        2,
        &env(
            req,
            now,
            Command::Enroll {
                token_id: token.into(),
                public_key: key.into(),
                hostname: "gpu-1".into(),
                inventory: Inventory::default(),
                new_node_id: node.into(),
                credential_id: cred.into(),
                credential_hash: "ch".into(),
                proof_signed_at_ms: now,
            },
        ),
    )
    .result
}

fn touch(s: &mut State, cred: &str, now: i64) {
    s.apply(
        3,
        &env(
            &format!("touch-{cred}-{now}"),
            now,
            Command::TouchCredentials {
                uses: vec![(cred.into(), now)],
            },
        ),
    )
    .result
    .unwrap();
}

#[test]
fn one_token_mints_one_identity() {
    let mut s = State::default();
    create(&mut s, "t1", 1000);
    let a = enroll(&mut s, "r1", 1001, "t1", "keyA", "nA", "cA").unwrap();
    assert_eq!(
        a,
        Outcome::Enrolled {
            node_id: "nA".into(),
            credential_id: "cA".into(),
            reenrolled: false
        }
    );
    let b = enroll(&mut s, "r2", 1002, "t1", "keyB", "nB", "cB").unwrap_err();
    assert_eq!(b.status(), 401);
    assert_eq!(s.nodes.len(), 1);
    assert_eq!(s.identities.len(), 1);
}

#[test]
fn claim_retry_by_same_identity_returns_same_node_until_used() {
    let mut s = State::default();
    create(&mut s, "t1", 1000);
    enroll(&mut s, "r1", 1001, "t1", "keyA", "nA", "c1").unwrap();
    // The leader died before replying: the agent retries with the same identity.
    let r = enroll(&mut s, "r2", 1002, "t1", "keyA", "nX", "c2").unwrap();
    assert_eq!(
        r,
        Outcome::Enrolled {
            node_id: "nA".into(),
            credential_id: "c2".into(),
            reenrolled: true
        }
    );
    assert!(
        s.credentials["c1"].revoked_at_ms.is_some(),
        "the undelivered credential is revoked"
    );
    assert_eq!(s.active_credentials(&"nA".into()).len(), 1);
    // A captured retry replayed byte for byte (the same proof, signed at 1002), or one signed
    // earlier, claims nothing: no credential is minted and c2 stays the node's.
    for signed_at in [1002, 1001] {
        let replay = Command::Enroll {
            token_id: "t1".into(),
            public_key: "keyA".into(),
            hostname: "gpu-1".into(),
            inventory: Inventory::default(),
            new_node_id: "nX".into(),
            credential_id: "c-replay".into(),
            credential_hash: "ch".into(),
            proof_signed_at_ms: signed_at,
        };
        let e = s
            .apply(3, &env("r-replay", 1002, replay))
            .result
            .unwrap_err();
        assert_eq!(e.code, "token_already_claimed");
    }
    assert!(!s.credentials.contains_key("c-replay"));
    assert!(s.credentials["c2"].revoked_at_ms.is_none());
    // Once the credential was used, the token is spent for everyone.
    touch(&mut s, "c2", 1003);
    assert_eq!(
        enroll(&mut s, "r3", 1004, "t1", "keyA", "nA", "c3")
            .unwrap_err()
            .code,
        "token_already_claimed"
    );
}

#[test]
fn revocation_spends_the_claim_and_is_never_undone() {
    let mut s = State::default();
    create(&mut s, "t1", 1000);
    enroll(&mut s, "r1", 1001, "t1", "keyA", "nA", "c1").unwrap();
    let r = s
        .apply(
            4,
            &env(
                "rv",
                1002,
                Command::RevokeCredentials {
                    node_id: "nA".into(),
                    reason: "stolen".into(),
                },
            ),
        )
        .result
        .unwrap();
    assert_eq!(
        r,
        Outcome::Revoked {
            credential_ids: vec!["c1".into()]
        }
    );
    let e = enroll(&mut s, "r2", 1003, "t1", "keyA", "nA", "c2").unwrap_err();
    assert_eq!(
        (e.status(), e.code.as_str()),
        (401, "token_already_claimed"),
        "replaying the old token cannot undo a revocation: {e:?}"
    );
    // A second revoke is safe and reports nothing more.
    let r = s
        .apply(
            5,
            &env(
                "rv2",
                1004,
                Command::RevokeCredentials {
                    node_id: "nA".into(),
                    reason: "again".into(),
                },
            ),
        )
        .result
        .unwrap();
    assert_eq!(
        r,
        Outcome::Revoked {
            credential_ids: vec![]
        }
    );
    // Re-enrolment with a new token: same node, new credential, the old one stays revoked.
    create(&mut s, "t2", 1005);
    let r = enroll(&mut s, "r3", 1006, "t2", "keyA", "nZ", "c3").unwrap();
    assert_eq!(
        r,
        Outcome::Enrolled {
            node_id: "nA".into(),
            credential_id: "c3".into(),
            reenrolled: true
        }
    );
    assert!(s.credentials["c1"].revoked_at_ms.is_some());
    assert_eq!(
        s.credentials["c1"].revoked_reason.as_deref(),
        Some("stolen")
    );
}

#[test]
fn reenrolment_revokes_older_credentials_in_the_same_step() {
    let mut s = State::default();
    create(&mut s, "t1", 1000);
    enroll(&mut s, "r1", 1001, "t1", "keyA", "nA", "c1").unwrap();
    touch(&mut s, "c1", 1002);
    create(&mut s, "t2", 1003);
    enroll(&mut s, "r2", 1004, "t2", "keyA", "nB", "c2").unwrap();
    assert_eq!(
        s.active_credentials(&"nA".into())
            .iter()
            .map(|c| c.credential_id.as_str())
            .collect::<Vec<_>>(),
        vec!["c2"]
    );
    assert_eq!(s.nodes["nA"].credential_ids, vec!["c1", "c2"]);
    assert!(!s.nodes.contains_key("nB"));
}

#[test]
fn expiry_uses_the_leader_stamped_time() {
    let mut s = State::default();
    create(&mut s, "t1", 1000); // expires at 61_000
    let r = enroll(&mut s, "r1", 61_001, "t1", "keyA", "nA", "c1").unwrap_err();
    assert_eq!(r.code, "token_expired");
    // A stale stamp cannot move the clock back.
    let r = enroll(&mut s, "r2", 5_000, "t1", "keyA", "nA", "c1").unwrap_err();
    assert_eq!(r.code, "token_expired");
}

#[test]
fn cancelled_tokens_are_refused_and_claimed_ones_cannot_be_cancelled() {
    let mut s = State::default();
    create(&mut s, "t1", 1000);
    s.apply(
        2,
        &env(
            "c",
            1001,
            Command::CancelToken {
                token_id: "t1".into(),
                reason: None,
            },
        ),
    )
    .result
    .unwrap();
    assert_eq!(
        enroll(&mut s, "r1", 1002, "t1", "k", "n", "c")
            .unwrap_err()
            .code,
        "token_cancelled"
    );
    create(&mut s, "t2", 1003);
    enroll(&mut s, "r2", 1004, "t2", "k", "n", "c").unwrap();
    assert_eq!(
        s.apply(
            3,
            &env(
                "c2",
                1005,
                Command::CancelToken {
                    token_id: "t2".into(),
                    reason: None,
                }
            )
        )
        .result
        .unwrap_err()
        .status(),
        409
    );
}

#[test]
fn a_retried_request_id_applies_once() {
    let mut s = State::default();
    create(&mut s, "t1", 1000);
    let first = enroll(&mut s, "same", 1001, "t1", "keyA", "nA", "c1");
    let again = enroll(&mut s, "same", 1002, "t1", "keyA", "nA", "c2");
    assert_eq!(first, again);
    assert_eq!(s.credentials.len(), 1);
}

#[test]
fn audit_chain_detects_tampering() {
    let mut s = State::default();
    create(&mut s, "t1", 1000);
    enroll(&mut s, "r1", 1001, "t1", "keyA", "nA", "c1").unwrap();
    enroll(&mut s, "r2", 1002, "t1", "keyB", "nB", "c2").unwrap_err();
    assert_eq!(s.audit.len(), 3);
    assert_eq!(s.audit[2].result, "token_already_claimed");
    assert_eq!(
        verify_audit_chain(&crate::state::AuditBase::default(), &s.audit),
        Ok(())
    );
    let mut edited = s.audit.clone();
    edited[1].actor = "someone-else".into();
    assert_eq!(
        verify_audit_chain(&crate::state::AuditBase::default(), &edited),
        Err(2)
    );
    let mut dropped = s.audit.clone();
    dropped.remove(1);
    // The event after the dropped one is the first out of sequence.
    assert_eq!(
        verify_audit_chain(&crate::state::AuditBase::default(), &dropped),
        Err(3)
    );
}

#[test]
fn history_is_bounded_and_coalesced() {
    let mut s = State::default();
    create(&mut s, "t1", 1000);
    enroll(&mut s, "r1", 1001, "t1", "keyA", "nA", "c1").unwrap();
    let node = s.nodes.get_mut("nA").map(Arc::make_mut).unwrap();
    for i in 0..1000 {
        push_history(node, 2000 + i, HistoryKind::RequestRefused, "401".into());
    }
    assert_eq!(node.history.back().unwrap().count, 1000);
    for i in 0..1000 {
        push_history(node, 5000 + i, HistoryKind::Status, i.to_string());
    }
    assert_eq!(node.history.len(), HISTORY_PER_NODE);
}

#[test]
fn accelerators_appearing_and_disappearing_are_recorded() {
    use modelforge_proto::wire::Accelerator;
    let gpu = |u: &str| Accelerator {
        uuid: u.into(),
        name: "H200".into(),
        memory_total_mib: Some(1),
        pci_bus_id: None,
        index: None,
        mig_mode: None,
        power_limit_w: None,
        compute_capability: None,
    };
    let mut s = State::default();
    create(&mut s, "t1", 1000);
    enroll(&mut s, "r1", 1001, "t1", "keyA", "nA", "c1").unwrap();
    let inv = |g: Vec<Accelerator>| Inventory {
        accelerators: g,
        ..Default::default()
    };
    let up = |s: &mut State, id: &str, i: Inventory| {
        s.apply(
            9,
            &env(
                id,
                1002,
                Command::UpdateInventory {
                    node_id: "nA".into(),
                    inventory: i,
                },
            ),
        )
        .result
        .unwrap()
    };
    assert_eq!(
        up(&mut s, "i1", inv(vec![gpu("G1"), gpu("G2")])),
        Outcome::InventoryUpdated { changed: true }
    );
    assert_eq!(
        up(&mut s, "i2", inv(vec![gpu("G1"), gpu("G2")])),
        Outcome::InventoryUpdated { changed: false }
    );
    up(&mut s, "i3", inv(vec![gpu("G1")]));
    let h = &s.nodes["nA"].history;
    assert!(
        h.iter()
            .any(|e| e.kind == "accelerator_disappeared" && e.detail == "G2")
    );
}

#[test]
fn snapshot_round_trip_preserves_digest() {
    let mut s = State::default();
    create(&mut s, "t1", 1000);
    enroll(&mut s, "r1", 1001, "t1", "keyA", "nA", "c1").unwrap();
    let bytes = modelforge_raft::codec::encode(&s).unwrap();
    let back: State = modelforge_raft::codec::decode(&bytes).unwrap();
    assert_eq!(back, s);
    assert_eq!(back.digest(), s.digest());
}

/// The compact in-memory forms (values behind `Arc`, hostname claimants as a sorted `Vec`,
/// interned inventory strings) encode byte for byte as the std types they replaced, so older
/// snapshots and backups decode the same (ARCHITECTURE.md, "Bounded state").
#[test]
fn the_compact_forms_encode_as_the_types_they_replaced() {
    use modelforge_raft::codec::decode;
    use modelforge_raft::codec::encode;
    use std::collections::BTreeMap;
    let mut s = two_nodes_one_hostname();
    let mut inv = inventory_with(&["G1", "G2"]);
    for (i, a) in inv.accelerators.iter_mut().enumerate() {
        a.mig_mode = Some("disabled".into());
        a.compute_capability = Some("9.0".into());
        a.pci_bus_id = Some(format!("00000000:1{i}:00.0"));
    }
    inv.driver_version = Some("550.54.15".into());
    inv.nvml = Some("ok".into());
    Arc::make_mut(s.nodes.get_mut("nA").unwrap()).inventory = inv.clone();
    assert_eq!(s.enabled_by_hostname["gpu-1"].iter().count(), 2);

    let std_nodes: BTreeMap<NodeId, Node> = s
        .nodes
        .iter()
        .map(|(k, v)| (k.clone(), (**v).clone()))
        .collect();
    assert_eq!(encode(&s.nodes).unwrap(), encode(&std_nodes).unwrap());
    let std_index: BTreeMap<String, BTreeSet<NodeId>> = s
        .enabled_by_hostname
        .iter()
        .map(|(h, ids)| (h.clone(), ids.iter().cloned().collect()))
        .collect();
    let old_index = encode(&std_index).unwrap();
    assert_eq!(encode(&s.enabled_by_hostname).unwrap(), old_index);
    let back: OrdMap<String, Claimants> = decode(&old_index).unwrap();
    assert_eq!(back, s.enabled_by_hostname);

    // The inventory as it was declared before its strings were shared.
    #[derive(serde::Serialize)]
    struct OldAccelerator {
        uuid: String,
        name: String,
        memory_total_mib: Option<u64>,
        pci_bus_id: Option<String>,
        index: Option<u32>,
        mig_mode: Option<String>,
        power_limit_w: Option<u64>,
        compute_capability: Option<String>,
    }
    #[derive(serde::Serialize)]
    struct OldInventory {
        accelerators: Vec<OldAccelerator>,
        storage_roots: Vec<modelforge_proto::wire::StorageRoot>,
        driver_version: Option<String>,
        cuda_version: Option<String>,
        nvml: Option<String>,
    }
    let text = |s: &Option<modelforge_proto::intern::Shared>| s.as_deref().map(str::to_string);
    let old = OldInventory {
        accelerators: inv
            .accelerators
            .iter()
            .map(|a| OldAccelerator {
                uuid: a.uuid.clone(),
                name: a.name.to_string(),
                memory_total_mib: a.memory_total_mib,
                pci_bus_id: a.pci_bus_id.clone(),
                index: a.index,
                mig_mode: text(&a.mig_mode),
                power_limit_w: a.power_limit_w,
                compute_capability: text(&a.compute_capability),
            })
            .collect(),
        storage_roots: inv.storage_roots.clone(),
        driver_version: text(&inv.driver_version),
        cuda_version: text(&inv.cuda_version),
        nvml: text(&inv.nvml),
    };
    let old_bytes = encode(&old).unwrap();
    assert_eq!(encode(&inv).unwrap(), old_bytes);
    let back: Inventory = decode(&old_bytes).unwrap();
    assert_eq!(back, inv);
    // Decoded twice, the fleet-wide strings are one allocation.
    let again: Inventory = decode(&old_bytes).unwrap();
    assert!(modelforge_proto::intern::Shared::same_allocation(
        &back.accelerators[0].name,
        &again.accelerators[1].name
    ));

    // The audit trail as the API's records (string hashes, owned strings), its base with a
    // string head, and the request table keyed by `String`: what they replaced.
    let _ = s.apply(
        9,
        &env(
            "r-cancel",
            1010,
            Command::CancelToken {
                token_id: "t9".into(),
                reason: Some("why".into()),
            },
        ),
    );
    assert!(s.audit.iter().any(|e| e.reason.is_some()));
    let records: Vec<modelforge_proto::api::AuditRecord> =
        s.audit.iter().map(|e| e.record()).collect();
    let old_audit = encode(&records).unwrap();
    assert_eq!(encode(&s.audit).unwrap(), old_audit);
    let back: imbl::Vector<AuditEvent> = decode(&old_audit).unwrap();
    assert_eq!(back, s.audit);
    assert_eq!(
        serde_json::to_value(&s.audit[0]).unwrap(),
        serde_json::to_value(&records[0]).unwrap()
    );
    #[derive(serde::Serialize)]
    struct OldBase {
        count: u64,
        head: String,
    }
    let last = s.audit.last().unwrap().hash;
    let base = crate::state::AuditBase {
        count: 7,
        head: last,
    };
    let old_base = OldBase {
        count: 7,
        head: last.to_string(),
    };
    assert_eq!(encode(&base).unwrap(), encode(&old_base).unwrap());
    let std_dedup: BTreeMap<String, (i64, ApplyResult)> = s
        .dedup
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    assert_eq!(encode(&s.dedup).unwrap(), encode(&std_dedup).unwrap());
    let std_order: Vec<(i64, String)> = s
        .dedup_order
        .iter()
        .map(|(at, id)| (*at, id.to_string()))
        .collect();
    assert_eq!(encode(&s.dedup_order).unwrap(), encode(&std_order).unwrap());
}

/// A chain hash reads only as 64 lowercase hex digits: another spelling of the same bytes
/// would encode differently after a round trip, and anything else is not a hash.
#[test]
fn chain_hashes_decode_only_from_their_own_spelling() {
    use crate::state::ChainHash;
    let h = ChainHash([0xab; 32]);
    let text = serde_json::to_string(&h).unwrap();
    assert_eq!(text, format!("\"{}\"", "ab".repeat(32)));
    assert_eq!(serde_json::from_str::<ChainHash>(&text).unwrap(), h);
    for bad in [
        "AB".repeat(32),
        "ab".repeat(31),
        "ab".repeat(33),
        "zz".repeat(32),
    ] {
        let json = format!("\"{bad}\"");
        assert!(serde_json::from_str::<ChainHash>(&json).is_err(), "{bad}");
        let bytes = modelforge_raft::codec::encode(&bad).unwrap();
        assert!(
            modelforge_raft::codec::decode::<ChainHash>(&bytes).is_err(),
            "{bad}"
        );
    }
    assert_eq!(
        ChainHash::GENESIS.to_string(),
        crate::state::GENESIS,
        "the default head is the genesis hash"
    );
}

/// An id is one allocation wherever the state names it, after apply and after a snapshot's
/// decode (`decode_sharing`); a plain decode gives each occurrence its own.
#[test]
fn a_nodes_id_is_one_allocation_wherever_the_state_names_it() {
    let s = two_nodes_one_hostname();
    let shared = |s: &State| {
        let (key, node) = s.nodes.get_key_value("nA").expect("nA");
        let cred = &s.credentials["cA"];
        let indexed = s.identities.get("keyA").expect("identity");
        NodeId::same_allocation(key, &node.node_id)
            && NodeId::same_allocation(key, &cred.node_id)
            && NodeId::same_allocation(key, indexed)
            && CredentialId::same_allocation(&node.credential_ids[0], &cred.credential_id)
    };
    assert!(shared(&s));
    let bytes = modelforge_raft::codec::encode(&s).unwrap();
    let plain: State = modelforge_raft::codec::decode(&bytes).unwrap();
    assert!(!shared(&plain));
    let back: State = modelforge_proto::ids::decode_sharing(|| {
        modelforge_raft::codec::decode::<State>(&bytes).unwrap()
    });
    assert!(shared(&back));
    assert_eq!(back, s);
    // The pool is gone with the call: ids decoded afterwards are fresh.
    let one: NodeId = serde_json::from_str("\"nA\"").unwrap();
    let two: NodeId = serde_json::from_str("\"nA\"").unwrap();
    assert!(!NodeId::same_allocation(&one, &two));
}

/// Apply keeps one copy of a request id for the request table's map, its order and the audit
/// event; a state decoded from a snapshot as a member decodes it (`decode_sharing`) too.
#[test]
fn a_request_id_is_one_allocation_after_apply_and_after_a_decode() {
    let s = two_nodes_one_hostname();
    let shared = |s: &State| {
        let (key, _) = s.dedup.get_key_value("r2").expect("r2 remembered");
        let in_order = s.dedup_order.iter().find(|(_, id)| id == "r2").unwrap();
        let in_audit = s.audit.iter().find(|e| e.request_id == "r2").unwrap();
        RequestId::same_allocation(key, &in_order.1)
            && RequestId::same_allocation(key, &in_audit.request_id)
    };
    assert!(shared(&s));
    let bytes = modelforge_raft::codec::encode(&s).unwrap();
    let plain: State = modelforge_raft::codec::decode(&bytes).unwrap();
    assert!(
        !shared(&plain),
        "a decode gives each occurrence its own copy"
    );
    let back: State = modelforge_proto::ids::decode_sharing(|| {
        modelforge_raft::codec::decode::<State>(&bytes).unwrap()
    });
    assert!(shared(&back));
    assert_eq!(back, s);
}

/// Claimants decoded from damaged input (out of order, repeated) come out sorted and unique:
/// the lookups and the hostname invariant rely on the order.
#[test]
fn hostname_claimants_decode_sorted_and_unique() {
    let bytes = modelforge_raft::codec::encode(&vec!["nB", "nA", "nB"]).unwrap();
    let c: Claimants = modelforge_raft::codec::decode(&bytes).unwrap();
    assert_eq!(
        c.iter().map(|n| n.as_str()).collect::<Vec<_>>(),
        ["nA", "nB"]
    );
}

fn preview(s: &mut State, req: &str, now: i64, id: &str, node: &str) -> ApplyResult {
    s.apply(
        4,
        &env(
            req,
            now,
            Command::PreviewDecommission {
                preview_id: id.into(),
                node_id: node.into(),
            },
        ),
    )
    .result
}

fn execute(s: &mut State, req: &str, now: i64, id: &str, node: &str) -> ApplyResult {
    execute_applied(s, req, now, id, node).result
}

/// An execute that must succeed; the journal facts it decided.
fn execute_facts(s: &mut State, req: &str, now: i64, id: &str, node: &str) -> Vec<Fact> {
    let applied = execute_applied(s, req, now, id, node);
    assert!(applied.result.is_ok(), "{:?}", applied.result);
    applied.facts
}

fn execute_applied(s: &mut State, req: &str, now: i64, id: &str, node: &str) -> Applied {
    s.apply(
        5,
        &env(
            req,
            now,
            Command::ExecuteDecommission {
                preview_id: id.into(),
                node_id: node.into(),
                reason: "hardware retired".into(),
            },
        ),
    )
}

/// Two nodes claiming hostname gpu-1 (the identity-lost case): nA old, nB new.
fn two_nodes_one_hostname() -> State {
    let mut s = State::default();
    create(&mut s, "t1", 1000);
    create(&mut s, "t2", 1000);
    enroll(&mut s, "r1", 1001, "t1", "keyA", "nA", "cA").unwrap();
    touch(&mut s, "cA", 1002);
    enroll(&mut s, "r2", 1003, "t2", "keyB", "nB", "cB").unwrap();
    s
}

#[test]
fn decommission_preview_then_execute_revokes_disables_and_never_deletes() {
    let mut s = two_nodes_one_hostname();
    assert!(
        s.nodes["nA"]
            .history
            .iter()
            .any(|e| e.kind == "hostname_conflict" && e.detail == "nB")
    );
    let Ok(Outcome::DecommissionPreviewed { preview: p }) =
        preview(&mut s, "p1", 2000, "pv1", "nA")
    else {
        panic!("preview refused");
    };
    assert_eq!(p.effects.credentials_to_revoke, vec!["cA".to_string()]);
    assert_eq!(
        p.effects.hostname_conflicts_resolved,
        vec!["nB".to_string()]
    );
    assert_eq!(p.effects.identity_public_key, "keyA");
    assert_eq!(p.expires_at_ms, 2000 + PREVIEW_TTL_MS);
    // A preview changes nothing but the preview table and the audit trail.
    assert!(s.nodes["nA"].enabled);
    assert!(s.credentials["cA"].revoked_at_ms.is_none());
    let r = execute(&mut s, "x1", 2100, "pv1", "nA").unwrap();
    assert!(matches!(r, Outcome::Decommissioned { ref node_id, .. } if node_id == "nA"));
    let node = &s.nodes["nA"];
    assert!(!node.enabled);
    assert_eq!(node.decommissioned_at_ms, Some(2100));
    assert!(
        node.history
            .iter()
            .any(|e| e.kind == "decommissioned" && e.detail == "hardware retired")
    );
    assert!(s.credentials["cA"].revoked_at_ms.is_some());
    assert_eq!(s.identities.get("keyA"), Some(&NodeId::from("nA")));
    assert_eq!(s.nodes.len(), 2, "never deleted");
    assert_eq!(s.enabled_claimants("gpu-1"), vec!["nB".to_string()]);
    assert!(
        s.nodes["nB"]
            .history
            .iter()
            .any(|e| e.kind == "hostname_conflict_resolved")
    );
    // Both steps are audited, with the node as target.
    let tail: Vec<(&str, &str, &str)> = s
        .audit
        .iter()
        .rev()
        .take(2)
        .map(|e| (e.action.as_str(), &*e.target, e.result.as_str()))
        .collect();
    assert_eq!(
        tail,
        vec![
            ("node.decommission.execute", "nA", "ok"),
            ("node.decommission.preview", "nA", "ok")
        ]
    );
    assert_eq!(
        verify_audit_chain(&crate::state::AuditBase::default(), &s.audit),
        Ok(())
    );
    // The identity can never enrol again.
    create(&mut s, "t3", 3000);
    let e = enroll(&mut s, "r3", 3001, "t3", "keyA", "nZ", "cZ").unwrap_err();
    assert_eq!(
        (e.status(), e.code.as_str()),
        (403, "identity_decommissioned")
    );
    // A decommissioned node cannot be previewed or executed again.
    let e = preview(&mut s, "p2", 3002, "pv2", "nA").unwrap_err();
    assert_eq!((e.status(), e.code.as_str()), (409, "node_decommissioned"));
    let e = execute(&mut s, "x2", 3003, "pv1", "nA").unwrap_err();
    assert_eq!((e.status(), e.code.as_str()), (409, "node_decommissioned"));
}

#[test]
fn a_stale_preview_is_refused_with_what_changed_and_changes_nothing() {
    let mut s = two_nodes_one_hostname();
    preview(&mut s, "p1", 2000, "pv1", "nA").unwrap();
    // The node re-enrols with a fresh token: a new credential the preview did not show.
    create(&mut s, "t3", 2001);
    enroll(&mut s, "r3", 2002, "t3", "keyA", "unused", "cA2").unwrap();
    let before = s.clone();
    let e = execute(&mut s, "x1", 2100, "pv1", "nA").unwrap_err();
    assert_eq!((e.status(), e.code.as_str()), (409, "preview_stale"));
    assert!(
        e.message
            .contains("credentials_to_revoke: was [cA], now [cA2]"),
        "{}",
        e.message
    );
    assert!(s.nodes["nA"].enabled);
    assert!(s.credentials["cA2"].revoked_at_ms.is_none());
    assert_eq!(s.nodes, before.nodes);
    assert_eq!(s.credentials, before.credentials);
    assert_eq!(s.audit.last().unwrap().result, "preview_stale");
    // A fresh preview binds to the new state and executes.
    preview(&mut s, "p2", 2200, "pv2", "nA").unwrap();
    execute(&mut s, "x2", 2300, "pv2", "nA").unwrap();
    assert!(s.credentials["cA2"].revoked_at_ms.is_some());
}

#[test]
fn a_new_node_claiming_the_hostname_makes_the_preview_stale() {
    let mut s = State::default();
    create(&mut s, "t1", 1000);
    enroll(&mut s, "r1", 1001, "t1", "keyA", "nA", "cA").unwrap();
    preview(&mut s, "p1", 1100, "pv1", "nA").unwrap();
    create(&mut s, "t2", 1200);
    enroll(&mut s, "r2", 1201, "t2", "keyB", "nB", "cB").unwrap();
    let e = execute(&mut s, "x1", 1300, "pv1", "nA").unwrap_err();
    assert_stale(&e, "hostname_conflicts_resolved: was [], now [nB]");
}

/// A stale-preview refusal that names `change`.
fn assert_stale(e: &Refusal, change: &str) {
    assert_eq!(e.code, "preview_stale");
    assert!(e.message.contains(change), "{}", e.message);
}

#[test]
fn decommission_execute_retried_by_request_id_returns_the_first_answer() {
    let mut s = two_nodes_one_hostname();
    preview(&mut s, "p1", 2000, "pv1", "nA").unwrap();
    let first = execute(&mut s, "idem-x", 2100, "pv1", "nA");
    let audit_len = s.audit.len();
    let again = execute(&mut s, "idem-x", 2200, "pv1", "nA");
    assert!(first.is_ok());
    assert_eq!(first, again, "same request id, same answer");
    assert_eq!(s.audit.len(), audit_len, "applied once");
    assert_eq!(s.nodes["nA"].decommissioned_at_ms, Some(2100));
}

#[test]
fn previews_expire_by_envelope_time_and_are_bound_to_their_node() {
    let mut s = two_nodes_one_hostname();
    preview(&mut s, "p1", 2000, "pv1", "nA").unwrap();
    let e = execute(&mut s, "x0", 2001, "pv1", "nB").unwrap_err();
    assert_eq!(
        (e.status(), e.code.as_str()),
        (409, "preview_for_other_node")
    );
    let e = execute(&mut s, "x1", 2000 + PREVIEW_TTL_MS + 1, "pv1", "nA").unwrap_err();
    assert_eq!((e.status(), e.code.as_str()), (409, "preview_expired"));
    // The next preview prunes the expired one.
    preview(&mut s, "p2", 2000 + PREVIEW_TTL_MS + 2, "pv2", "nA").unwrap();
    assert!(!s.previews.contains_key("pv1"));
    let e = execute(&mut s, "x2", 2000 + PREVIEW_TTL_MS + 3, "pv1", "nA").unwrap_err();
    assert_eq!((e.status(), e.code.as_str()), (404, "preview_not_found"));
    let e = preview(&mut s, "p3", 2000 + PREVIEW_TTL_MS + 4, "pv3", "nobody").unwrap_err();
    assert_eq!(e.code, "node_not_found");
    assert!(s.nodes["nA"].enabled);
}

#[test]
fn the_first_heartbeat_spending_the_claim_does_not_make_a_preview_stale() {
    let mut s = State::default();
    create(&mut s, "t1", 1000);
    enroll(&mut s, "r1", 1001, "t1", "keyA", "nA", "cA").unwrap();
    let Ok(Outcome::DecommissionPreviewed { preview: p }) =
        preview(&mut s, "p1", 1100, "pv1", "nA")
    else {
        panic!("preview refused");
    };
    assert_eq!(p.effects.claims_to_spend, vec!["t1".to_string()]);
    touch(&mut s, "cA", 1200);
    execute(&mut s, "x1", 1300, "pv1", "nA").unwrap();
    assert!(s.tokens["t1"].claim.as_ref().unwrap().spent);
}

pub(super) fn inventory_with(uuids: &[&str]) -> Inventory {
    Inventory {
        accelerators: uuids
            .iter()
            .map(|u| modelforge_proto::wire::Accelerator {
                uuid: u.to_string(),
                name: "gpu".into(),
                memory_total_mib: Some(80_000),
                pci_bus_id: None,
                index: None,
                mig_mode: None,
                power_limit_w: None,
                compute_capability: None,
            })
            .collect(),
        ..Default::default()
    }
}

fn allocate(s: &mut State, id: &str, node: &str, uuids: &[&str], key: Option<&str>) -> ApplyResult {
    s.apply(
        9,
        &env(
            &format!("alloc-{id}"),
            2_000,
            Command::Allocate {
                allocation_id: id.into(),
                node_id: node.into(),
                accelerator_uuids: uuids.iter().map(|u| u.to_string()).collect(),
                owner: "o".into(),
                idempotency_key: key.map(str::to_string),
            },
        ),
    )
    .result
}

#[test]
fn a_gpu_is_never_allocated_twice_and_an_idempotency_key_returns_the_first_answer() {
    let mut s = State::default();
    create(&mut s, "t1", 1_000);
    enroll(&mut s, "e1", 1_000, "t1", "k1", "n1", "c1").unwrap();
    s.nodes.get_mut("n1").map(Arc::make_mut).unwrap().inventory = inventory_with(&["G1", "G2"]);
    let first = allocate(&mut s, "a1", "n1", &["G1"], Some("key")).unwrap();
    // A placement racing for G1 is refused; the same key returns the first allocation.
    let r = allocate(&mut s, "a2", "n1", &["G1"], None).unwrap_err();
    assert_eq!(r.code, "no_capacity");
    assert_eq!(
        allocate(&mut s, "a3", "n1", &["G2"], Some("key")).unwrap(),
        first
    );
    assert_eq!(s.sched.allocations.len(), 1);
    // A GPU outside the inventory, or named twice, is refused.
    for (id, uuids) in [("a4", &["G9"][..]), ("a5", &["G2", "G2"][..])] {
        let e = allocate(&mut s, id, "n1", uuids, None).unwrap_err();
        assert_eq!(
            (e.status(), e.code.as_str()),
            (409, "no_capacity"),
            "{uuids:?}: {e:?}"
        );
    }
    assert!(!s.sched.allocations.contains_key("a4") && !s.sched.allocations.contains_key("a5"));
    assert!(allocate(&mut s, "a6", "n1", &["G2"], None).is_ok());
}

#[test]
fn reconcile_confirms_busy_releases_vanished_and_idle_and_marks_unscheduled_use() {
    let mut s = State::default();
    create(&mut s, "t1", 1_000);
    enroll(&mut s, "e1", 1_000, "t1", "k1", "n1", "c1").unwrap();
    s.nodes.get_mut("n1").map(Arc::make_mut).unwrap().inventory =
        inventory_with(&["G1", "G2", "G3", "G4"]);
    for (id, g) in [("a1", "G1"), ("a2", "G2"), ("a3", "G3")] {
        allocate(&mut s, id, "n1", &[g], None).unwrap();
    }
    s.sched
        .distrust_after_restore([NodeId::from("n1")].into_iter());
    let present = ["G1", "G3", "G4"].iter().map(|x| x.to_string()).collect();
    let busy = ["G1", "G4"].iter().map(|x| x.to_string()).collect();
    let r = s
        .apply(
            10,
            &env(
                "rec",
                3_000,
                Command::Reconcile {
                    node_id: "n1".into(),
                    present,
                    busy,
                },
            ),
        )
        .result;
    assert_eq!(
        r.unwrap(),
        Outcome::Reconciled {
            confirmed: vec!["a1".into()],
            released: vec!["a2".into(), "a3".into()],
        }
    );
    assert!(s.sched.allocations["a1"].confirmed);
    assert_eq!(
        s.sched.external_busy["n1"].iter().collect::<Vec<_>>(),
        vec!["G4"]
    );
    assert!(s.sched.smoke_required.contains("n1"));
}

#[test]
fn decommission_releases_the_nodes_allocations_journals_it_and_nothing_is_placed_there_again() {
    let mut s = State::default();
    create(&mut s, "t1", 1_000);
    enroll(&mut s, "e1", 1_000, "t1", "k1", "n1", "c1").unwrap();
    s.nodes.get_mut("n1").map(Arc::make_mut).unwrap().inventory = inventory_with(&["G1", "G2"]);
    allocate(&mut s, "a1", "n1", &["G1"], None).unwrap();
    let Outcome::DecommissionPreviewed { preview: p } =
        preview(&mut s, "p0", 2_000, "pv0", "n1").unwrap()
    else {
        panic!("not a preview")
    };
    assert_eq!(p.effects.allocations_to_release, vec!["a1".to_string()]);
    // Work placed on the node after the preview makes it stale: the operator never saw it.
    allocate(&mut s, "a0", "n1", &["G2"], None).unwrap();
    let e = execute(&mut s, "x0", 2_001, "pv0", "n1").unwrap_err();
    assert_stale(&e, "allocations_to_release: was [a1], now [a0, a1]");
    assert_eq!(
        s.sched.allocations.len(),
        2,
        "a stale execute released something"
    );
    assert_eq!(
        s.release(2_002, &"a0".into(), "test"),
        Ok(Outcome::Released {
            allocation_id: "a0".into()
        })
    );
    // Releasing it again is refused, and says why.
    let e = s.release(2_002, &"a0".into(), "test").unwrap_err();
    assert_eq!(
        (e.status(), e.code.as_str()),
        (404, "allocation_not_found"),
        "{e:?}"
    );
    preview(&mut s, "p1", 3_000, "pv1", "n1").unwrap();
    let facts = execute_facts(&mut s, "x1", 3_001, "pv1", "n1");
    assert!(s.sched.allocations.is_empty());
    assert!(
        facts
            .iter()
            .any(|f| matches!(f, Fact::NodeDecommissioned { node_id, .. } if node_id == "n1"))
    );
    let e = allocate(&mut s, "a2", "n1", &["G2"], None).unwrap_err();
    assert_eq!(e.code, "no_capacity");
    // A restore that re-applies the fact to an older state decommissions the node there too.
    let mut older = State::default();
    create(&mut older, "t1", 1_000);
    enroll(&mut older, "e1", 1_000, "t1", "k1", "n1", "c1").unwrap();
    for f in &facts {
        older.reapply(f);
    }
    assert!(older.nodes["n1"].decommissioned_at_ms.is_some());
    assert!(older.active_credentials(&"n1".into()).is_empty());
    assert!(
        older.reapply(&facts[facts.len() - 1]).is_none(),
        "re-applying twice changed something"
    );
}

#[test]
fn an_idempotency_key_reused_with_another_body_is_refused_and_keeps_its_first_answer() {
    let mut s = State::default();
    create(&mut s, "t1", 1_000);
    let cancel = |id: &str| {
        env(
            id,
            2_000,
            Command::CancelToken {
                token_id: "t1".into(),
                reason: None,
            },
        )
    };
    let first = s.apply(5, &cancel("idem-k1.b1")).result;
    assert!(first.is_ok(), "{first:?}");
    // Same key part, other request part: refused, audited, and not stored.
    let e = s.apply(6, &cancel("idem-k1.b2")).result.unwrap_err();
    assert_eq!(
        (e.status(), e.code.as_str()),
        (422, "idempotency_key_reused")
    );
    assert_eq!(s.audit.last().unwrap().result, "idempotency_key_reused");
    assert!(!s.dedup.contains_key("idem-k1.b2"));
    assert_eq!(s.apply(7, &cancel("idem-k1.b1")).result, first);
    // Ids without a key part (no Idempotency-Key) never collide this way.
    assert!(!idempotency_key_reused(&s.dedup, "idem-k1"));
    assert!(!idempotency_key_reused(&s.dedup, "a-fresh-uuid"));
    assert!(idempotency_key_reused(&s.dedup, "idem-k1.zz"));
    assert!(!idempotency_key_reused(&s.dedup, "idem-k10.b1"));

    // An allocation's key is kept as long as the allocation, beyond the request-id table.
    create(&mut s, "t2", 1_000);
    enroll(&mut s, "e1", 1_000, "t2", "k1", "n1", "c1").unwrap();
    s.nodes.get_mut("n1").map(Arc::make_mut).unwrap().inventory = inventory_with(&["G1", "G2"]);
    allocate(&mut s, "a1", "n1", &["G1"], Some("idem-k2.x1")).unwrap();
    s.dedup.clear();
    s.dedup_order.clear();
    let e = allocate(&mut s, "a2", "n1", &["G2"], Some("idem-k2.x2")).unwrap_err();
    assert_eq!(e.code, "idempotency_key_reused");
    assert_eq!(s.sched.allocations.len(), 1);
}

#[test]
fn the_hostname_index_follows_enrolment_renames_decommission_and_reapplied_facts() {
    let mut s = two_nodes_one_hostname();
    s.check().unwrap();
    assert_eq!(s.enabled_claimants("gpu-1"), vec!["nA", "nB"]);
    // nA re-enrols under another hostname (same identity, new token): the index moves it.
    create(&mut s, "t3", 1100);
    s.apply(
        7,
        &env(
            "r3",
            1101,
            Command::Enroll {
                token_id: "t3".into(),
                public_key: "keyA".into(),
                hostname: "gpu-2".into(),
                inventory: Inventory::default(),
                new_node_id: "unused".into(),
                credential_id: "cA2".into(),
                credential_hash: "ch".into(),
                proof_signed_at_ms: 1101,
            },
        ),
    )
    .result
    .unwrap();
    assert_eq!(s.nodes["nA"].hostname, "gpu-2");
    s.check().unwrap();
    assert_eq!(s.enabled_claimants("gpu-1"), vec!["nB"]);
    assert_eq!(s.enabled_claimants("gpu-2"), vec!["nA"]);
    // Decommissioned: out of the index, and no empty entry is left behind.
    let older = s.clone();
    preview(&mut s, "p1", 2000, "pv1", "nB").unwrap();
    let facts = execute_facts(&mut s, "x1", 2001, "pv1", "nB");
    s.check().unwrap();
    assert!(!s.enabled_by_hostname.contains_key("gpu-1"));
    // The same fact re-applied from the journal to an older state does the same.
    let mut restored = older;
    for f in facts {
        restored.reapply(&f);
    }
    assert!(restored.nodes["nB"].decommissioned_at_ms.is_some());
    restored.check().unwrap();
}

/// ARCHITECTURE.md, "Known gaps": the request-id table is capped at `DEDUP_MAX` entries (and
/// 24 h); at the cap the oldest id goes first, and the table and its order stay in step.
#[test]
fn the_request_id_table_is_capped_dropping_its_oldest_ids_in_step_with_its_order() {
    fn in_step(s: &State) -> bool {
        s.dedup.len() == s.dedup_order.len()
            && s.dedup_order
                .iter()
                .all(|(at, id)| s.dedup.get(id).is_some_and(|(a, _)| a == at))
    }
    let touch = |id: &str, now: i64| env(id, now, Command::TouchCredentials { uses: vec![] });
    let create = env(
        "r-create",
        1_000,
        Command::CreateToken {
            token_id: "t1".into(),
            hash: "h".into(),
            ttl_ms: 3_600_000,
            note: None,
        },
    );
    let mut s = State::default();
    let first = s.apply(1, &create).result;
    assert!(first.is_ok(), "{first:?}");
    for i in 1..DEDUP_MAX {
        s.apply(1 + i as u64, &touch(&format!("r{i}"), 1_000))
            .result
            .unwrap();
    }
    assert_eq!(s.dedup.len(), DEDUP_MAX);
    assert!(in_step(&s));
    // Full: a retry is still answered from the table, and adds nothing.
    assert_eq!(s.apply(300_000, &create).result, first);
    assert_eq!(s.dedup.len(), DEDUP_MAX);

    // Each new id evicts exactly the oldest.
    s.apply(300_001, &touch("new-1", 2_000)).result.unwrap();
    assert_eq!(s.dedup.len(), DEDUP_MAX, "the cap was exceeded");
    assert!(!s.dedup.contains_key("r-create"), "the oldest id was kept");
    assert!(s.dedup.contains_key("r1") && s.dedup.contains_key("new-1"));
    s.apply(300_002, &touch("new-2", 2_000)).result.unwrap();
    assert_eq!(s.dedup.len(), DEDUP_MAX);
    assert!(!s.dedup.contains_key("r1"));
    assert_eq!(s.dedup_order.front().map(|(_, id)| id.as_str()), Some("r2"));
    assert_eq!(
        s.dedup_order.back().map(|(_, id)| id.as_str()),
        Some("new-2")
    );
    assert!(in_step(&s));
    // An evicted id is executed again, not answered from the table: the token exists now.
    let again = s.apply(300_003, &create).result.unwrap_err();
    assert_eq!(again.code, "token_exists");
    assert_eq!(s.dedup.len(), DEDUP_MAX);
    assert!(in_step(&s));

    // 24 h of leader time later every old id has gone, in step.
    s.apply(300_004, &touch("late", 2_000 + DEDUP_TTL_MS + 1))
        .result
        .unwrap();
    assert_eq!(
        s.dedup.keys().map(RequestId::as_str).collect::<Vec<_>>(),
        vec!["late"]
    );
    assert!(in_step(&s));
}

/// Decommission is written once: a restore that re-applies a journal's decommission (alone, or
/// with the revocations the execute journaled beside it) ends with the same node, credentials,
/// claims, allocations and smoke state as executing it. Before `decommission_node`, the
/// re-application left the node's allocations placed and its smoke requirement set.
#[test]
fn a_decommission_reapplied_from_the_journal_ends_where_executing_it_did() {
    let mut s = State::default();
    create(&mut s, "t1", 1_000);
    enroll(&mut s, "e1", 1_000, "t1", "k1", "n1", "c1").unwrap();
    touch(&mut s, "c1", 1_001);
    // Re-enrolled on a second token (claim not spent yet), so it waits for a smoke.
    create(&mut s, "t2", 1_002);
    enroll(&mut s, "e2", 1_003, "t2", "k1", "n1", "c2").unwrap();
    assert!(s.sched.smoke_required.contains("n1"));
    s.nodes.get_mut("n1").map(Arc::make_mut).unwrap().inventory = inventory_with(&["G1", "G2"]);
    allocate(&mut s, "a1", "n1", &["G1"], Some("idem-k.1")).unwrap();
    let backup = s.clone();

    preview(&mut s, "p1", 2_000, "pv1", "n1").unwrap();
    let facts = execute_facts(&mut s, "x1", 2_001, "pv1", "n1");
    let decommission: Vec<Fact> = facts
        .iter()
        .filter(|f| matches!(f, Fact::NodeDecommissioned { .. }))
        .cloned()
        .collect();
    assert_eq!(decommission.len(), 1);

    for journal in [facts, decommission] {
        let mut restored = backup.clone();
        for f in &journal {
            restored.reapply(f);
        }
        restored.check().unwrap();
        let (was, is) = (&s.nodes["n1"], &restored.nodes["n1"]);
        assert_eq!(
            (was.enabled, was.decommissioned_at_ms),
            (is.enabled, is.decommissioned_at_ms)
        );
        let revoked = |st: &State| -> Vec<(CredentialId, Option<i64>)> {
            st.credentials
                .values()
                .map(|c| (c.credential_id.clone(), c.revoked_at_ms))
                .collect()
        };
        assert_eq!(revoked(&restored), revoked(&s));
        let spent = |st: &State| -> Vec<(TokenId, bool)> {
            st.tokens
                .values()
                .map(|t| {
                    (
                        t.token_id.clone(),
                        t.claim.as_ref().is_some_and(|c| c.spent),
                    )
                })
                .collect()
        };
        assert_eq!(spent(&restored), spent(&s));
        assert!(restored.sched.allocations.is_empty());
        assert_eq!(restored.sched, s.sched.clone());
        assert_eq!(restored.enabled_by_hostname, s.enabled_by_hostname);
        assert!(!restored.sched.smoke_required.contains("n1"));
    }
}

#[test]
fn operators_are_named_once_keep_only_a_hash_and_reasons_reach_the_audit_trail() {
    use modelforge_proto::api::Role;
    let mut s = State::default();
    let mk = |name: &str, token_id: &str| Command::CreateOperator {
        name: name.into(),
        role: Role::Viewer,
        token_id: token_id.into(),
        hash: "$argon2id$v=19$m=19456,t=2,p=1$c2FsdA$aGFzaA".into(),
        reason: Some("night shift".into()),
    };
    let at = |s: &mut State, id: &str, i: u64, cmd: Command| {
        s.apply(
            i,
            &Envelope {
                request_id: id.into(),
                now_ms: 1000 + i as i64,
                actor: "root".into(),
                command: cmd,
            },
        )
        .result
    };
    assert!(at(&mut s, "r1", 1, mk("ops", "id1")).is_ok());
    assert_eq!(
        at(&mut s, "r2", 2, mk("ops", "id2")).unwrap_err().code,
        RefusalCode::OperatorExists
    );
    assert_eq!(
        at(&mut s, "r3", 3, mk("other", "id1")).unwrap_err().code,
        RefusalCode::OperatorExists,
        "one token id names one operator"
    );
    for bad in ["root", "system", "a b", ""] {
        assert_eq!(
            at(&mut s, &format!("bad-{bad}"), 4, mk(bad, "id9"))
                .unwrap_err()
                .code,
            RefusalCode::InvalidOperatorName
        );
    }
    let o = s.operator_by_token_id("id1").unwrap();
    assert_eq!((o.name.as_str(), o.created_by.as_str()), ("ops", "root"));
    assert_eq!(
        at(
            &mut s,
            "d0",
            5,
            Command::DeleteOperator {
                name: "root".into(),
                reason: None
            }
        )
        .unwrap_err()
        .code,
        RefusalCode::RootTokenFixed
    );
    at(
        &mut s,
        "d1",
        6,
        Command::DeleteOperator {
            name: "ops".into(),
            reason: Some("left the team".into()),
        },
    )
    .unwrap();
    assert!(s.operator_by_token_id("id1").is_none());
    let last = s.audit.last().unwrap();
    assert_eq!(
        (&*last.actor, last.action.as_str(), last.reason.as_deref()),
        ("root", "operator.delete", Some("left the team"))
    );
    s.check().unwrap();
    // The reason is part of the chain: editing it breaks verification.
    let mut edited = s.audit.clone();
    edited.back_mut().unwrap().reason = Some("routine".into());
    assert!(verify_audit_chain(&crate::state::AuditBase::default(), &edited).is_err());
}

/// Issue 16 (bounded state): once an hour of leader time apply forgets revoked credentials,
/// finished tokens and finished smokes older than the retention window, and the old history
/// of long-decommissioned nodes; nothing forgotten can be used again, and two replicas that
/// apply the same entries forget the same things.
#[test]
fn finished_tokens_revoked_credentials_and_smokes_are_forgotten_after_retention() {
    use super::retention::DECOMMISSIONED_HISTORY;
    use super::retention::PRUNE_EVERY_MS;
    let mut s = State::default();
    create(&mut s, "t1", 1000);
    enroll(&mut s, "r1", 1001, "t1", "keyA", "nA", "c1").unwrap();
    let revoke = Command::RevokeCredentials {
        node_id: "nA".into(),
        reason: "stolen".into(),
    };
    s.apply(3, &env("rv", 1002, revoke)).result.unwrap();
    create(&mut s, "t2", 1003);
    enroll(&mut s, "r2", 1004, "t2", "keyA", "nA", "c2").unwrap();
    create(&mut s, "t3", 1005);
    let cancel = Command::CancelToken {
        token_id: "t3".into(),
        reason: None,
    };
    s.apply(4, &env("cancel", 1006, cancel)).result.unwrap();
    create(&mut s, "t4", 1007);
    let start = Command::StartSmoke {
        smoke_id: "s1".into(),
        node_id: "nA".into(),
    };
    s.apply(5, &env("smoke", 1008, start)).result.unwrap();
    let result = Command::SmokeResult {
        smoke_id: "s1".into(),
        node_id: "nA".into(),
        checks: vec![sched::SmokeCheck {
            name: "matmul".into(),
            ok: true,
            detail: "ok".into(),
        }],
    };
    s.apply(6, &env("result", 1009, result)).result.unwrap();
    let mut replica = s.clone();

    // Within the window nothing is forgotten, though apply pruned on the hour.
    touch(&mut s, "c2", 1000 + RETENTION_MS);
    assert_eq!(s.tokens.len(), 4);
    assert!(s.credentials.contains_key("c1") && s.sched.smokes.contains_key("s1"));
    // An hour later: everything that ended before the cutoff is gone.
    let later = 1010 + RETENTION_MS + PRUNE_EVERY_MS;
    touch(&mut s, "c2", later);
    assert!(!s.credentials.contains_key("c1"), "revoked long ago");
    assert_eq!(s.nodes["nA"].credential_ids, vec!["c2"]);
    assert_eq!(
        s.tokens.keys().map(|t| t.as_str()).collect::<Vec<_>>(),
        vec!["t2"],
        "t1's credential is gone, t3 cancelled and t4 expired long ago; t2 issued c2"
    );
    assert!(s.sched.smokes.is_empty());
    s.check().unwrap();
    // Forgotten is never usable again: an unknown token is refused like a spent one.
    let e = enroll(&mut s, "r3", later + 1, "t1", "keyB", "nB", "c9").unwrap_err();
    assert_eq!(
        (e.status(), e.code.as_str()),
        (401, "invalid_token"),
        "{e:?}"
    );
    assert!(!s.nodes.contains_key("nB"));

    // A replica applying the same entries forgets the same things at the same entry.
    touch(&mut replica, "c2", 1000 + RETENTION_MS);
    touch(&mut replica, "c2", later);
    let _ = enroll(&mut replica, "r3", later + 1, "t1", "keyB", "nB", "c9");
    assert_eq!(replica, s);

    // A node decommissioned long ago keeps its tombstone and only its last events.
    let mut s = two_nodes_one_hostname();
    for i in 0..20 {
        let ev = Command::RecordEvents {
            events: vec![("nA".into(), HistoryKind::Status, format!("s{i}"), 1)],
        };
        s.apply(10 + i, &env(&format!("ev{i}"), 5_000 + i as i64, ev))
            .result
            .unwrap();
    }
    preview(&mut s, "p", 6_000, "pv", "nA").unwrap();
    execute(&mut s, "x", 6_001, "pv", "nA").unwrap();
    assert!(s.nodes["nA"].history.len() > DECOMMISSIONED_HISTORY);
    touch(&mut s, "cB", 7_000 + RETENTION_MS + PRUNE_EVERY_MS);
    let na = &s.nodes["nA"];
    assert_eq!(na.history.len(), DECOMMISSIONED_HISTORY);
    assert!(na.decommissioned_at_ms.is_some() && s.identities.contains_key(&na.public_key));
    s.check().unwrap();
}

/// Issue 16 item 4: audit events older than the retention window leave the state at the
/// hourly prune, returned by that apply for the archive; the state keeps the base (count and
/// head hash), the next event continues the sequence and the chain, and archived ++ live
/// verifies from the genesis hash, on a replica and after a snapshot round trip alike.
#[test]
fn old_audit_events_move_to_the_archive_and_the_chain_still_proves_the_whole_trail() {
    use super::retention::PRUNE_EVERY_MS;
    let mut s = State::default();
    for i in 0..5 {
        create(&mut s, &format!("t{i}"), 1_000 + i);
    }
    let mut replica = s.clone();
    // In a new hour, but within the window of the first five: nothing archived yet.
    let late = 990 + RETENTION_MS;
    create(&mut s, "late", late);
    let head_before = s.audit[4].hash;
    // The first apply of a new hour, past the window of the first five.
    let later = late + PRUNE_EVERY_MS;
    let applied = s.apply(
        9,
        &env(
            "cancel-late",
            later,
            Command::CancelToken {
                token_id: "late".into(),
                reason: Some("done".into()),
            },
        ),
    );
    applied.result.unwrap();
    let archived = applied.archived;
    assert_eq!(
        archived.iter().map(|e| e.seq).collect::<Vec<_>>(),
        vec![1, 2, 3, 4, 5]
    );
    assert_eq!(
        s.audit_base,
        crate::state::AuditBase {
            count: 5,
            head: head_before
        }
    );
    assert_eq!(
        s.audit.iter().map(|e| e.seq).collect::<Vec<_>>(),
        vec![6, 7]
    );
    s.check().unwrap();
    s.check_after_apply().unwrap();
    let whole: Vec<_> = archived.iter().chain(s.audit.iter()).cloned().collect();
    assert_eq!(
        verify_audit_chain(&crate::state::AuditBase::default(), &whole),
        Ok(())
    );
    // The live part alone verifies only from the base, not from the genesis.
    assert!(verify_audit_chain(&crate::state::AuditBase::default(), &s.audit).is_err());
    // A forged base breaks the live chain.
    let mut forged = s.clone();
    forged.audit_base.head = crate::state::ChainHash([0xff; 32]);
    assert!(forged.check().is_err());
    // The same entries archive the same events on a replica.
    create(&mut replica, "late", late);
    let again = replica.apply(
        9,
        &env(
            "cancel-late",
            later,
            Command::CancelToken {
                token_id: "late".into(),
                reason: Some("done".into()),
            },
        ),
    );
    assert_eq!(again.archived, archived);
    assert_eq!(replica, s);
    // The base survives a snapshot.
    let bytes = modelforge_raft::codec::encode(&s).unwrap();
    let back: State = modelforge_raft::codec::decode(&bytes).unwrap();
    assert_eq!(back, s);
    back.check().unwrap();
}

/// A burst of old audit events leaves the state a bounded number per prune (so one prune never
/// stalls apply for a whole burst); the base advances each time and the chain stays whole.
#[test]
fn audit_events_leave_at_most_a_bounded_number_per_prune() {
    let mut s = State::default();
    for i in 0..5 {
        create(&mut s, &format!("t{i}"), 1_000 + i);
    }
    let mut archived = vec![];
    for expected in [2, 2, 1, 0] {
        let moved = s.archive_audit_before(10_000, 2);
        assert_eq!(moved.len(), expected);
        archived.extend(moved);
        s.check().unwrap();
    }
    assert_eq!(s.audit_base.count, 5);
    assert!(s.audit.is_empty());
    assert_eq!(
        verify_audit_chain(&crate::state::AuditBase::default(), &archived),
        Ok(())
    );
    create(&mut s, "t9", 2_000);
    assert_eq!(s.audit[0].seq, 6);
    s.check().unwrap();
}

fn health(s: &mut State, req: &str, uuid: &str, h: Health, cause: &str) -> ApplyResult {
    let from = s.health.health(&"n1".into(), uuid);
    let cleared_at_ms = s.health.cleared_at(&"n1".into(), uuid);
    s.apply(
        10,
        &env(
            req,
            3_000,
            Command::GpuHealth {
                node_id: "n1".into(),
                uuid: uuid.into(),
                from,
                cleared_at_ms,
                health: h,
                cause: cause.into(),
            },
        ),
    )
    .result
}

#[test]
fn a_failed_gpu_is_cordoned_sticky_and_marks_its_allocation_until_an_operator_clears_it() {
    let mut s = State::default();
    create(&mut s, "t1", 1_000);
    enroll(&mut s, "e1", 1_000, "t1", "k1", "n1", "c1").unwrap();
    s.nodes.get_mut("n1").map(Arc::make_mut).unwrap().inventory = inventory_with(&["G1", "G2"]);
    allocate(&mut s, "a1", "n1", &["G1"], None).unwrap();
    let gpu_history = |s: &State| {
        s.nodes["n1"]
            .history
            .iter()
            .filter(|e| e.kind == HistoryKind::GpuHealth)
            .count()
    };
    // Degraded, then failed: one history entry each; the same health again changes nothing.
    health(&mut s, "h1", "G1", Health::Degraded, "xid 94").unwrap();
    assert!(!s.health.placeable(&"n1".into(), "G1"));
    health(&mut s, "h2", "G1", Health::Failed, "xid 79").unwrap();
    assert_eq!(
        health(&mut s, "h3", "G1", Health::Failed, "xid 79").unwrap(),
        Outcome::GpuHealthRecorded { changed: false }
    );
    let rec = s.health.gpu(&"n1".into(), "G1").unwrap().clone();
    assert!(rec.cordoned && rec.health == Health::Failed && rec.cause == "xid 79");
    assert_eq!(
        s.sched.allocations["a1"].state(),
        AllocationState::GpuFailed
    );
    // One gpu_health entry per transition; the allocation's mark is an entry of its own.
    assert_eq!(gpu_history(&s), 2);
    assert!(
        s.nodes["n1"]
            .history
            .iter()
            .any(|e| e.kind == HistoryKind::AllocationMarked)
    );
    // A transition judged from a record that has changed since is stale: dropped.
    let stale = Command::GpuHealth {
        node_id: "n1".into(),
        uuid: "G1".into(),
        from: Health::Healthy,
        cleared_at_ms: None,
        health: Health::Degraded,
        cause: "xid 94".into(),
    };
    let r = s.apply(10, &env("stale", 3_000, stale)).result.unwrap();
    assert_eq!(r, Outcome::GpuHealthRecorded { changed: false });
    assert_eq!(s.health.health(&"n1".into(), "G1"), Health::Failed);
    // Sticky: a healthy report does not lift it; nothing is placed on it.
    health(&mut s, "h4", "G1", Health::Healthy, "").unwrap();
    assert_eq!(s.health.health(&"n1".into(), "G1"), Health::Failed);
    s.apply(
        11,
        &env(
            "rel",
            3_000,
            Command::Release {
                allocation_id: "a1".into(),
            },
        ),
    )
    .result
    .unwrap();
    assert_eq!(
        allocate(&mut s, "a2", "n1", &["G1"], None)
            .unwrap_err()
            .code,
        "no_capacity"
    );
    // A GPU not in the inventory is refused and changes nothing.
    assert!(health(&mut s, "h5", "G9", Health::Failed, "xid 79").is_err());
    assert!(s.health.gpu(&"n1".into(), "G9").is_none());
    // The operator's uncordon clears it, and records when.
    let un = Command::UncordonGpu {
        node_id: "n1".into(),
        uuid: "G1".into(),
        reason: "reset".into(),
    };
    s.apply(12, &env("un", 4_000, un)).result.unwrap();
    assert!(s.health.placeable(&"n1".into(), "G1"));
    assert_eq!(s.health.cleared_at(&"n1".into(), "G1"), Some(4_000));
    assert_eq!(gpu_history(&s), 3, "the clearing is a health change too");
    assert!(allocate(&mut s, "a3", "n1", &["G1"], None).is_ok());
}

#[test]
fn a_cordoned_node_takes_no_placement_and_a_drain_releases_its_allocations_marked() {
    let mut s = State::default();
    create(&mut s, "t1", 1_000);
    enroll(&mut s, "e1", 1_000, "t1", "k1", "n1", "c1").unwrap();
    s.nodes.get_mut("n1").map(Arc::make_mut).unwrap().inventory = inventory_with(&["G1", "G2"]);
    allocate(&mut s, "a1", "n1", &["G1"], None).unwrap();
    let cordon = |drain| Command::Cordon {
        node_id: "n1".into(),
        reason: "maintenance".into(),
        drain,
    };
    s.apply(11, &env("c", 3_000, cordon(false))).result.unwrap();
    assert_eq!(
        allocate(&mut s, "a2", "n1", &["G2"], None)
            .unwrap_err()
            .code,
        "no_capacity"
    );
    let drained = s.apply(12, &env("d", 3_000, cordon(true))).result.unwrap();
    assert_eq!(
        drained,
        Outcome::Cordoned {
            drained: vec!["a1".into()]
        }
    );
    assert_eq!(s.sched.allocations["a1"].state(), AllocationState::Drained);
    assert!(
        s.sched.allocated_anywhere().is_empty(),
        "a drained allocation holds nothing"
    );
    let un = Command::Uncordon {
        node_id: "n1".into(),
        reason: "done".into(),
    };
    s.apply(13, &env("u", 3_000, un)).result.unwrap();
    assert!(allocate(&mut s, "a3", "n1", &["G1"], None).is_ok());
    // Audited with the reason.
    let actions: Vec<_> = s
        .audit
        .iter()
        .map(|e| {
            (
                e.action.to_string(),
                e.reason.as_deref().map(str::to_string),
            )
        })
        .collect();
    assert!(
        actions.contains(&("node.drain".into(), Some("maintenance".into()))),
        "{actions:?}"
    );
    assert!(
        actions.contains(&("node.uncordon".into(), Some("done".into()))),
        "{actions:?}"
    );
}
