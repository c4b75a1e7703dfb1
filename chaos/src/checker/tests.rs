//! Planted violations: one clean history with every kind of event the workload produces
//! (retries, re-enrolments, unknown outcomes applied and not), then one test per hole, each
//! changing one fact and asserting the rule that must catch it.

use super::*;

/// A history under construction: each operation takes 5 ms and starts 10 ms after the last.
#[derive(Default)]
struct H {
    ops: Vec<Op>,
    t: u64,
}

fn ok() -> Outcome {
    Outcome::ok()
}

fn unknown() -> Outcome {
    Outcome::Unknown {
        why: "timeout".into(),
    }
}

fn failed(status: u16, code: &str) -> Outcome {
    Outcome::Failed {
        status,
        code: code.into(),
    }
}

impl H {
    fn push(&mut self, kind: Kind, outcome: Outcome) -> u64 {
        let id = self.ops.len() as u64;
        self.t += 10;
        self.ops.push(Op {
            id,
            client: "t".into(),
            invoke_ms: self.t,
            complete_ms: self.t + 5,
            kind,
            outcome,
        });
        id
    }
    fn create(&mut self, note: &str, token: Option<&str>) -> u64 {
        let outcome = match token {
            Some(t) => Outcome::Ok {
                token_id: Some(t.into()),
                node_id: None,
                credential_id: None,
                revoked: vec![],
            },
            None => unknown(),
        };
        self.push(Kind::CreateToken { note: note.into() }, outcome)
    }
    fn enroll(&mut self, token: &str, key: &str, outcome: Outcome) -> u64 {
        let kind = Kind::Enroll {
            token_id: token.into(),
            identity: key.into(),
            attempt: 0,
        };
        self.push(kind, outcome)
    }
    fn revoke(&mut self, node: &str, reason: &str, revoked: Option<&[&str]>) -> u64 {
        let outcome = match revoked {
            Some(r) => Outcome::Ok {
                token_id: None,
                node_id: None,
                credential_id: None,
                revoked: r.iter().map(|x| x.to_string()).collect(),
            },
            None => unknown(),
        };
        let kind = Kind::Revoke {
            node_id: node.into(),
            reason: reason.into(),
        };
        self.push(kind, outcome)
    }
    fn cancel(&mut self, token: &str, outcome: Outcome) -> u64 {
        self.push(
            Kind::CancelToken {
                token_id: token.into(),
            },
            outcome,
        )
    }
    fn hb(&mut self, node: &str, cred: &str, outcome: Outcome) -> u64 {
        let kind = Kind::Heartbeat {
            node_id: node.into(),
            credential_id: cred.into(),
            member: 0,
        };
        self.push(kind, outcome)
    }
}

fn enrolled(node: &str, cred: &str) -> Outcome {
    Outcome::Ok {
        token_id: None,
        node_id: Some(node.into()),
        credential_id: Some(cred.into()),
        revoked: vec![],
    }
}

fn cred(node: &str, token: &str, revoked_reason: Option<&str>) -> FinalCredential {
    FinalCredential {
        node_id: node.into(),
        revoked: revoked_reason.is_some(),
        revoked_reason: revoked_reason.map(String::from),
        token_id: Some(token.into()),
    }
}

fn token(state: &str, claimed: Option<&str>, note: &str) -> FinalToken {
    FinalToken {
        state: state.into(),
        claimed_node_id: claimed.map(String::from),
        note: Some(note.into()),
    }
}

const RETRY: &str = "superseded by a retry of the same claim";

/// Every event the workload produces, and a final state that explains it exactly.
fn clean() -> (H, FinalState) {
    let mut h = H::default();
    h.create("n1", Some("t1"));
    h.create("n2", Some("t2"));
    h.create("n3", None); // unknown, applied: t3 carries its note
    h.create("n4", None); // unknown, not applied
    h.enroll("t1", "k1", enrolled("N1", "C1"));
    h.hb("N1", "C1", ok());
    h.enroll("t2", "k2", unknown()); // applied: C2a
    h.enroll("t2", "k2", enrolled("N2", "C2b")); // the retry of the same claim
    h.revoke("N1", "r1", Some(&["C1"]));
    h.hb("N1", "C1", failed(401, "credential_revoked"));
    h.create("n5", Some("t5"));
    h.enroll("t5", "k1", enrolled("N1", "C1b")); // the same identity re-enrols
    h.hb("N1", "C1b", ok());
    h.revoke("N2", "r2", None); // unknown, applied: C2b carries r2
    h.hb("N2", "C2b", failed(401, "credential_revoked"));
    h.create("n6", Some("t6"));
    h.cancel("t6", ok());
    h.create("n7", Some("t7"));
    h.cancel("t7", unknown()); // applied
    h.enroll("t1", "k3", failed(401, "token_already_claimed"));
    h.hb("N1", "C1b", failed(503, "no_leader"));

    let mut f = FinalState::default();
    f.nodes.insert("N1".into(), "k1".into());
    f.nodes.insert("N2".into(), "k2".into());
    f.node_credentials
        .insert("N1".into(), vec!["C1".into(), "C1b".into()]);
    f.node_credentials
        .insert("N2".into(), vec!["C2a".into(), "C2b".into()]);
    f.credentials
        .insert("C1".into(), cred("N1", "t1", Some("r1")));
    f.credentials.insert("C1b".into(), cred("N1", "t5", None));
    f.credentials
        .insert("C2a".into(), cred("N2", "t2", Some(RETRY)));
    f.credentials
        .insert("C2b".into(), cred("N2", "t2", Some("r2")));
    f.tokens
        .insert("t1".into(), token("claimed", Some("N1"), "n1"));
    f.tokens
        .insert("t2".into(), token("claimed", Some("N2"), "n2"));
    f.tokens.insert("t3".into(), token("pending", None, "n3"));
    f.tokens
        .insert("t5".into(), token("claimed", Some("N1"), "n5"));
    f.tokens.insert("t6".into(), token("cancelled", None, "n6"));
    f.tokens.insert("t7".into(), token("cancelled", None, "n7"));
    f.digests = vec![Some(("d".into(), 40)); 3];
    f.configurations = vec![Some(vec![(1, true), (5, true), (6, true)]); 3];
    (h, f)
}

fn rules(v: &[Violation]) -> BTreeSet<&'static str> {
    v.iter().map(|x| x.rule).collect()
}

/// The planted fact is caught by `rule`, and by nothing else.
#[track_caller]
fn caught_by(h: &H, f: &FinalState, rule: &str) -> Vec<Violation> {
    let (v, _) = check(&h.ops, f);
    assert_eq!(rules(&v), BTreeSet::from([rule]), "{v:#?}");
    v
}

#[test]
fn the_clean_history_passes_and_each_unknown_is_resolved_by_its_own_effect() {
    let (h, f) = clean();
    let (v, res) = check(&h.ops, &f);
    assert!(v.is_empty(), "{v:#?}");
    // create n3 (applied), create n4 (not), the enrolment attempt (applied), the revoke
    // (applied), the cancel (applied).
    assert_eq!(res.unknown, 5, "{res:?}");
    assert_eq!(res.resolved_committed, 4, "{res:?}");
    assert_eq!(res.resolved_not_committed, 1, "{res:?}");
}

#[test]
fn an_unknown_enrolment_is_not_resolved_by_an_older_enrolment_of_the_same_identity() {
    let (mut h, mut f) = clean();
    h.create("n8", Some("t8"));
    h.enroll("t8", "k1", unknown());
    f.tokens.insert("t8".into(), token("pending", None, "n8"));
    let (v, res) = check(&h.ops, &f);
    assert!(v.is_empty(), "{v:#?}");
    // k1 owns N1 from an older enrolment; the attempt on t8 left nothing, so it did not apply.
    assert_eq!(
        (res.resolved_committed, res.resolved_not_committed),
        (4, 2),
        "{res:?}"
    );
}

#[test]
fn a_lost_answer_that_minted_a_second_node_on_a_claimed_token_is_caught() {
    let (mut h, mut f) = clean();
    // Another identity's attempt on the already claimed t5 timed out, yet it minted N4.
    h.enroll("t5", "k4", unknown());
    f.nodes.insert("N4".into(), "k4".into());
    f.node_credentials.insert("N4".into(), vec!["C4".into()]);
    f.credentials.insert("C4".into(), cred("N4", "t5", None));
    let v = caught_by(&h, &f, ONE_TOKEN);
    assert!(v[0].detail.contains("t5"), "{v:#?}");
}

#[test]
fn two_acknowledged_nodes_on_one_token_are_caught() {
    let (mut h, f) = clean();
    h.enroll("t1", "k9", enrolled("N9", "C9"));
    let (v, _) = check(&h.ops, &f);
    assert!(rules(&v).contains(ONE_TOKEN), "{v:#?}");
}

#[test]
fn an_identity_on_two_nodes_in_the_final_state_is_caught() {
    let (mut h, mut f) = clean();
    h.create("n8", Some("t8"));
    h.enroll("t8", "k1", unknown());
    f.nodes.insert("N8".into(), "k1".into());
    f.node_credentials.insert("N8".into(), vec!["C8".into()]);
    f.credentials.insert("C8".into(), cred("N8", "t8", None));
    f.tokens
        .insert("t8".into(), token("claimed", Some("N8"), "n8"));
    caught_by(&h, &f, ONE_NODE);
}

#[test]
fn an_identity_acknowledged_on_two_nodes_is_caught() {
    let (mut h, mut f) = clean();
    h.create("n8", Some("t8"));
    h.enroll("t8", "k2", enrolled("N8", "C8"));
    f.nodes.insert("N8".into(), "k2b".into());
    f.node_credentials.insert("N8".into(), vec!["C8".into()]);
    f.credentials.insert("C8".into(), cred("N8", "t8", None));
    f.tokens
        .insert("t8".into(), token("claimed", Some("N8"), "n8"));
    let (v, _) = check(&h.ops, &f);
    assert!(
        v.iter()
            .any(|x| x.rule == ONE_NODE && x.detail.contains("acknowledged")),
        "{v:#?}"
    );
}

#[test]
fn an_acknowledged_node_lost_is_caught() {
    let (h, mut f) = clean();
    f.nodes.remove("N2");
    let (v, _) = check(&h.ops, &f);
    assert!(
        v.iter()
            .any(|x| x.rule == NOT_LOST && x.detail.contains("node N2 is gone")),
        "{v:#?}"
    );
}

#[test]
fn an_acknowledged_credential_lost_is_caught() {
    let (h, mut f) = clean();
    f.credentials.remove("C1b");
    f.node_credentials.insert("N1".into(), vec!["C1".into()]);
    let v = caught_by(&h, &f, NOT_LOST);
    assert!(v[0].detail.contains("C1b"), "{v:#?}");
}

#[test]
fn a_revocation_reverted_is_caught() {
    let (h, mut f) = clean();
    f.credentials.insert("C1".into(), cred("N1", "t1", None));
    let (v, _) = check(&h.ops, &f);
    assert!(
        v.iter()
            .any(|x| x.rule == NOT_LOST && x.detail.contains("C1 was revoked but is active")),
        "{v:#?}"
    );
}

#[test]
fn a_cancellation_reverted_is_caught() {
    let (h, mut f) = clean();
    f.tokens.insert("t6".into(), token("pending", None, "n6"));
    caught_by(&h, &f, NOT_LOST);
}

#[test]
fn a_credential_owned_by_the_wrong_node_is_caught() {
    let (h, mut f) = clean();
    f.credentials.insert("C1b".into(), cred("N2", "t5", None));
    f.node_credentials.insert("N1".into(), vec!["C1".into()]);
    f.node_credentials
        .insert("N2".into(), vec!["C2a".into(), "C2b".into(), "C1b".into()]);
    let (v, _) = check(&h.ops, &f);
    assert!(
        v.iter()
            .any(|x| x.rule == NOT_LOST && x.detail.contains("C1b belongs to N2")),
        "{v:#?}"
    );
}

#[test]
fn an_acknowledged_claim_lost_is_caught() {
    let (h, mut f) = clean();
    f.tokens.insert("t1".into(), token("pending", None, "n1"));
    caught_by(&h, &f, NOT_LOST);
}

#[test]
fn a_member_that_did_not_report_its_digest_is_caught() {
    let (h, mut f) = clean();
    f.digests[1] = None;
    let v = caught_by(&h, &f, CONVERGE);
    assert!(v[0].detail.contains("[2]"), "{v:#?}");
}

#[test]
fn members_with_different_digests_are_caught() {
    let (h, mut f) = clean();
    f.digests[2] = Some(("e".into(), 40));
    caught_by(&h, &f, CONVERGE);
}

#[test]
fn members_that_report_different_configurations_are_caught() {
    let (h, mut f) = clean();
    // Member 2 never learned that member 6 was promoted.
    f.configurations[1] = Some(vec![(1, true), (5, true), (6, false)]);
    caught_by(&h, &f, CONFIGURATION);
    let (h, mut f) = clean();
    f.configurations[2] = None;
    let v = caught_by(&h, &f, CONFIGURATION);
    assert!(v[0].detail.contains("[3]"), "{v:#?}");
}

#[test]
fn a_401_for_a_credential_nobody_revoked_is_caught() {
    let (mut h, f) = clean();
    h.hb("N1", "C1b", failed(401, "unknown_credential"));
    caught_by(&h, &f, WORKS);
}

#[test]
fn a_401_before_the_revoking_request_was_made_is_caught() {
    let (h, f) = clean();
    let mut ops = h.ops.clone();
    // C2b is refused before the (unknown, applied) revoke r2 was even sent.
    let revoke = ops
        .iter()
        .position(|o| matches!(&o.kind, Kind::Revoke { reason, .. } if reason == "r2"))
        .unwrap();
    let mut early = ops[revoke].clone();
    early.kind = Kind::Heartbeat {
        node_id: "N2".into(),
        credential_id: "C2b".into(),
        member: 0,
    };
    early.outcome = failed(401, "credential_revoked");
    early.invoke_ms -= 9;
    early.complete_ms -= 9;
    early.id = ops.len() as u64;
    ops.push(early);
    let (v, _) = check(&ops, &f);
    assert_eq!(rules(&v), BTreeSet::from([WORKS]), "{v:#?}");
    assert!(v[0].detail.contains("before the request"), "{v:#?}");
}

#[test]
fn a_credential_revoked_by_no_request_is_caught() {
    let (h, mut f) = clean();
    f.credentials
        .insert("C1b".into(), cred("N1", "t5", Some("revoked by admin")));
    caught_by(&h, &f, WORKS);
}

#[test]
fn a_supersession_without_a_newer_credential_is_caught() {
    let (h, mut f) = clean();
    f.credentials.insert(
        "C1b".into(),
        cred("N1", "t5", Some("superseded by re-enrolment")),
    );
    caught_by(&h, &f, WORKS);
}

#[test]
fn a_node_refusing_its_own_credential_with_403_is_caught() {
    let (mut h, f) = clean();
    h.hb("N1", "C1b", failed(403, "credential_of_another_node"));
    caught_by(&h, &f, WORKS);
}

#[test]
fn a_revoked_credential_accepted_after_the_acknowledgement_is_caught() {
    let (mut h, f) = clean();
    // A cut-off old leader said 200 after the revocation was acknowledged.
    let hb = h.hb("N1", "C1", ok());
    let v = caught_by(&h, &f, STAYS_REVOKED);
    assert_eq!(v[0].ops, vec![8, hb], "{v:#?}");
}

#[test]
fn a_superseded_credential_accepted_after_the_new_one_was_acknowledged_is_caught() {
    let (mut h, mut f) = clean();
    // N1 re-enrols again; its previous credential C1b must be dead from then on.
    h.create("n8", Some("t8"));
    h.enroll("t8", "k1", enrolled("N1", "C1c"));
    f.node_credentials
        .insert("N1".into(), vec!["C1".into(), "C1b".into(), "C1c".into()]);
    f.credentials.insert(
        "C1b".into(),
        cred("N1", "t5", Some("superseded by re-enrolment")),
    );
    f.credentials.insert("C1c".into(), cred("N1", "t8", None));
    f.tokens
        .insert("t8".into(), token("claimed", Some("N1"), "n8"));
    assert!(check(&h.ops, &f).0.is_empty());
    h.hb("N1", "C1b", ok());
    caught_by(&h, &f, STAYS_REVOKED);
}

#[test]
fn a_node_nobody_enrolled_is_caught() {
    let (h, mut f) = clean();
    f.nodes.insert("N9".into(), "k9".into());
    f.node_credentials.insert("N9".into(), vec!["C9".into()]);
    f.credentials.insert("C9".into(), cred("N9", "t3", None));
    let (v, _) = check(&h.ops, &f);
    assert!(
        v.iter()
            .any(|x| x.rule == NOT_UNMADE && x.detail.contains("node N9")),
        "{v:#?}"
    );
    assert!(
        v.iter()
            .any(|x| x.rule == NOT_UNMADE && x.detail.contains("C9")),
        "{v:#?}"
    );
}

#[test]
fn a_credential_nobody_issued_is_caught() {
    let (h, mut f) = clean();
    // A second credential on t1 for N1, but t1's only attempt was acknowledged with C1.
    f.node_credentials
        .insert("N1".into(), vec!["C1".into(), "C1x".into(), "C1b".into()]);
    f.credentials.insert(
        "C1x".into(),
        cred("N1", "t1", Some("superseded by re-enrolment")),
    );
    caught_by(&h, &f, NOT_UNMADE);
}

#[test]
fn more_credentials_on_a_claim_than_its_unknown_attempts_is_caught() {
    let (h, mut f) = clean();
    // One unknown attempt of (t2, k2), yet two unacknowledged credentials.
    f.node_credentials
        .insert("N2".into(), vec!["C2a".into(), "C2z".into(), "C2b".into()]);
    f.credentials
        .insert("C2z".into(), cred("N2", "t2", Some(RETRY)));
    caught_by(&h, &f, NOT_UNMADE);
}

#[test]
fn a_token_nobody_created_is_caught() {
    let (h, mut f) = clean();
    f.tokens.insert("t9".into(), token("pending", None, "zzz"));
    caught_by(&h, &f, NOT_UNMADE);
}

#[test]
fn a_token_cancelled_by_nobody_is_caught() {
    let (h, mut f) = clean();
    f.tokens.insert("t3".into(), token("cancelled", None, "n3"));
    caught_by(&h, &f, NOT_UNMADE);
}

#[test]
fn an_unknown_revocation_that_left_no_mark_excuses_nothing() {
    let (mut h, mut f) = clean();
    // The revoke of N2 did not apply: C2b is active, so its 401 is a violation.
    f.credentials.insert("C2b".into(), cred("N2", "t2", None));
    let (v, res) = check(&h.ops, &f);
    assert_eq!(rules(&v), BTreeSet::from([WORKS]), "{v:#?}");
    assert_eq!(res.resolved_not_committed, 2, "{res:?}");
    h.ops.retain(
        |o| !matches!(&o.kind, Kind::Heartbeat { credential_id, .. } if credential_id == "C2b"),
    );
    assert!(check(&h.ops, &f).0.is_empty());
}
