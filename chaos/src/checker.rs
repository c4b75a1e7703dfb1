//! The checker: after the final heal, the history and the cluster's final state must satisfy
//! the invariants below. Each violation names the operations involved.

use std::collections::BTreeMap;
use std::collections::BTreeSet;

use serde::Serialize;

use crate::history::Kind;
use crate::history::Op;
use crate::history::Outcome;

/// What the cluster holds after the final heal, read back through the admin API.
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
pub struct FinalState {
    /// node id -> identity public key
    pub nodes: BTreeMap<String, String>,
    /// credential id -> (node id, revoked)
    pub credentials: BTreeMap<String, (String, bool)>,
    /// enrolment id -> (state, claimed node id)
    pub tokens: BTreeMap<String, (String, Option<String>)>,
    /// member -> (digest, applied index)
    pub digests: Vec<Option<(String, u64)>>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Violation {
    pub rule: &'static str,
    pub detail: String,
    pub ops: Vec<u64>,
}

/// How the unknown outcomes were resolved by reading back the final state.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Resolution {
    pub unknown: usize,
    pub resolved_committed: usize,
    pub resolved_not_committed: usize,
    pub unresolvable: usize,
}

pub fn check(ops: &[Op], fin: &FinalState) -> (Vec<Violation>, Resolution) {
    let mut v = vec![];
    let mut res = Resolution::default();

    // Acknowledged enrolments, per token and per identity.
    let mut by_token: BTreeMap<&str, BTreeSet<(&str, &str)>> = BTreeMap::new();
    let mut by_identity: BTreeMap<&str, BTreeMap<&str, Vec<u64>>> = BTreeMap::new();
    // credential -> (node, time its issuing enrolment was acknowledged, op id)
    let mut issued: BTreeMap<&str, (&str, u64, u64)> = BTreeMap::new();
    for op in ops {
        if let (
            Kind::Enroll {
                token_id, identity, ..
            },
            Outcome::Ok {
                node_id: Some(n),
                credential_id: Some(c),
                ..
            },
        ) = (&op.kind, &op.outcome)
        {
            by_token.entry(token_id).or_default().insert((n, identity));
            by_identity
                .entry(identity)
                .or_default()
                .entry(n)
                .or_default()
                .push(op.id);
            issued.insert(c, (n, op.complete_ms, op.id));
        }
    }
    for (token, minted) in &by_token {
        let nodes: BTreeSet<&str> = minted.iter().map(|(n, _)| *n).collect();
        let idents: BTreeSet<&str> = minted.iter().map(|(_, i)| *i).collect();
        if nodes.len() > 1 || idents.len() > 1 {
            let ids = ops
                .iter()
                .filter(|o| {
                    matches!(&o.kind, Kind::Enroll { token_id, .. } if token_id == token)
                        && matches!(o.outcome, Outcome::Ok { .. })
                })
                .map(|o| o.id)
                .collect();
            v.push(Violation {
                rule: "one token mints at most one node identity",
                detail: format!(
                    "token {token} minted {nodes:?} for {} identities",
                    idents.len()
                ),
                ops: ids,
            });
        }
    }
    for (ident, nodes) in &by_identity {
        if nodes.len() > 1 {
            v.push(Violation {
                rule: "every agent identity maps to exactly one node",
                detail: format!(
                    "identity {}… acknowledged on nodes {:?}",
                    &ident[..ident.len().min(12)],
                    nodes.keys().collect::<Vec<_>>()
                ),
                ops: nodes.values().flatten().copied().collect(),
            });
        }
    }
    let mut final_ident: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (n, k) in &fin.nodes {
        final_ident.entry(k).or_default().push(n);
    }
    for (k, ns) in &final_ident {
        if ns.len() > 1 {
            v.push(Violation {
                rule: "every agent identity maps to exactly one node",
                detail: format!(
                    "identity {}… owns nodes {ns:?} in the final state",
                    &k[..k.len().min(12)]
                ),
                ops: vec![],
            });
        }
    }

    // When each credential was certainly dead: an acknowledged revoke naming it, or an
    // acknowledged enrolment of the same node issuing a newer one.
    let mut dead_since: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    let note_dead = |c: &str, at: u64, op: u64, d: &mut BTreeMap<String, (u64, u64)>| {
        let e = d.entry(c.to_string()).or_insert((at, op));
        if at < e.0 {
            *e = (at, op);
        }
    };
    let mut dead: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for op in ops {
        if let (Kind::Revoke { .. }, Outcome::Ok { revoked, .. }) = (&op.kind, &op.outcome) {
            for c in revoked {
                note_dead(c, op.complete_ms, op.id, &mut dead);
            }
        }
        if let Outcome::Ok {
            node_id: Some(n),
            credential_id: Some(newc),
            ..
        } = &op.outcome
            && matches!(op.kind, Kind::Enroll { .. })
        {
            for (c, (cn, at, _)) in &issued {
                if cn == n && c != newc && *at < op.complete_ms {
                    note_dead(c, op.complete_ms, op.id, &mut dead);
                }
            }
        }
    }
    for (c, x) in &dead {
        dead_since.insert(c.as_str(), *x);
    }
    for op in ops {
        if let (
            Kind::Heartbeat {
                credential_id,
                member,
                ..
            },
            Outcome::Ok { .. },
        ) = (&op.kind, &op.outcome)
            && let Some((at, by)) = dead_since.get(credential_id.as_str())
            && op.invoke_ms > *at
        {
            v.push(Violation {
                rule: "no credential is accepted after its revocation was acknowledged",
                detail: format!("credential {credential_id} got 200 from member {} at {} ms, dead since {at} ms", member + 1, op.invoke_ms),
                ops: vec![*by, op.id],
            });
        }
    }

    // No acknowledged write lost; unknown outcomes resolved by reading back.
    for op in ops {
        match (&op.kind, &op.outcome) {
            (
                Kind::CreateToken,
                Outcome::Ok {
                    token_id: Some(t), ..
                },
            ) if !fin.tokens.contains_key(t) => v.push(Violation {
                rule: "no acknowledged write is lost",
                detail: format!("token {t} was acknowledged but is gone"),
                ops: vec![op.id],
            }),
            (Kind::CancelToken { token_id }, Outcome::Ok { .. })
                if fin
                    .tokens
                    .get(token_id)
                    .is_none_or(|(s, _)| s != "cancelled") =>
            {
                v.push(Violation {
                    rule: "no acknowledged write is lost",
                    detail: format!(
                        "token {token_id} was cancelled but is {:?}",
                        fin.tokens.get(token_id)
                    ),
                    ops: vec![op.id],
                })
            }
            (Kind::Revoke { .. }, Outcome::Ok { revoked, .. }) => {
                for c in revoked {
                    if fin.credentials.get(c).is_none_or(|(_, r)| !r) {
                        v.push(Violation {
                            rule: "no acknowledged write is lost",
                            detail: format!("credential {c} was revoked but is active"),
                            ops: vec![op.id],
                        });
                    }
                }
            }
            (
                Kind::Enroll { .. },
                Outcome::Ok {
                    node_id: Some(n),
                    credential_id: Some(c),
                    ..
                },
            ) => {
                if !fin.nodes.contains_key(n) {
                    v.push(Violation {
                        rule: "every acknowledged enrolment's node exists",
                        detail: format!("node {n} is gone"),
                        ops: vec![op.id],
                    });
                }
                match fin.credentials.get(c) {
                    None => v.push(Violation {
                        rule: "no acknowledged write is lost",
                        detail: format!("credential {c} of node {n} is gone"),
                        ops: vec![op.id],
                    }),
                    Some((cn, revoked)) => {
                        if cn != n {
                            v.push(Violation {
                                rule: "no acknowledged write is lost",
                                detail: format!("credential {c} belongs to {cn}, not {n}"),
                                ops: vec![op.id],
                            });
                        }
                        if *revoked
                            && !dead_since.contains_key(c.as_str())
                            && !has_later_claim_or_revoke(ops, op, n)
                        {
                            v.push(Violation {
                                rule: "an acknowledged enrolment's credential works unless revoked or superseded",
                                detail: format!("credential {c} of node {n} is revoked, yet nothing acknowledged or attempted revoked it"),
                                ops: vec![op.id],
                            });
                        }
                    }
                }
            }
            (Kind::Enroll { identity, .. }, Outcome::Unknown { .. }) => {
                res.unknown += 1;
                if fin.nodes.values().any(|k| k == identity) {
                    res.resolved_committed += 1;
                } else {
                    res.resolved_not_committed += 1;
                }
            }
            (Kind::CancelToken { token_id }, Outcome::Unknown { .. }) => {
                res.unknown += 1;
                match fin.tokens.get(token_id) {
                    Some((s, _)) if s == "cancelled" => res.resolved_committed += 1,
                    Some(_) => res.resolved_not_committed += 1,
                    None => res.unresolvable += 1,
                }
            }
            (Kind::CreateToken | Kind::Revoke { .. }, Outcome::Unknown { .. }) => {
                // Resolved in aggregate below (the id of an unacknowledged token is unknown to
                // the client; an unknown revoke is read back through the credentials).
                res.unknown += 1;
                res.unresolvable += 1;
            }
            _ => {}
        }
    }
    // Tokens in the final state that no acknowledged CreateToken produced must be accounted for
    // by unknown ones.
    let acked: BTreeSet<&str> = ops
        .iter()
        .filter_map(|o| match (&o.kind, &o.outcome) {
            (
                Kind::CreateToken,
                Outcome::Ok {
                    token_id: Some(t), ..
                },
            ) => Some(t.as_str()),
            _ => None,
        })
        .collect();
    let unknown_creates = ops
        .iter()
        .filter(|o| {
            matches!(o.kind, Kind::CreateToken) && matches!(o.outcome, Outcome::Unknown { .. })
        })
        .count();
    let extra = fin
        .tokens
        .keys()
        .filter(|t| !acked.contains(t.as_str()))
        .count();
    if extra > unknown_creates {
        v.push(Violation { rule: "no write appears that nobody made", detail: format!("{extra} tokens exist that no acknowledged or unknown create explains ({unknown_creates} unknown)"), ops: vec![] });
    }

    // Convergence.
    let live: Vec<&(String, u64)> = fin.digests.iter().flatten().collect();
    if live.len() != fin.digests.len() {
        v.push(Violation {
            rule: "all members converge to identical state",
            detail: "a member did not report its digest".into(),
            ops: vec![],
        });
    } else if live.windows(2).any(|w| w[0] != w[1]) {
        v.push(Violation {
            rule: "all members converge to identical state",
            detail: format!("digests differ: {live:?}"),
            ops: vec![],
        });
    }
    (v, res)
}

/// Whether a revoke of node `n`, or a later enrolment onto `n`, was at least attempted after `op`.
fn has_later_claim_or_revoke(ops: &[Op], op: &Op, n: &str) -> bool {
    ops.iter().any(|o| {
        o.invoke_ms + 1 >= op.invoke_ms
            && o.id != op.id
            && match (&o.kind, &o.outcome) {
                (Kind::Revoke { node_id }, _) => node_id == n,
                (
                    Kind::Enroll { .. },
                    Outcome::Ok {
                        node_id: Some(x), ..
                    },
                ) => x == n,
                (Kind::Enroll { identity, .. }, _) => {
                    matches!(&op.kind, Kind::Enroll { identity: i, .. } if i == identity)
                }
                _ => false,
            }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(id: u64, t0: u64, t1: u64, kind: Kind, outcome: Outcome) -> Op {
        Op {
            id,
            client: "t".into(),
            invoke_ms: t0,
            complete_ms: t1,
            kind,
            outcome,
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

    fn created() -> Op {
        op(
            99,
            0,
            1,
            Kind::CreateToken,
            Outcome::Ok {
                token_id: Some("t1".into()),
                node_id: None,
                credential_id: None,
                revoked: vec![],
            },
        )
    }

    fn base_state() -> FinalState {
        let mut f = FinalState::default();
        f.nodes.insert("n1".into(), "k1".into());
        f.credentials.insert("c1".into(), ("n1".into(), true));
        f.tokens
            .insert("t1".into(), ("claimed".into(), Some("n1".into())));
        f.digests = vec![Some(("d".into(), 9)), Some(("d".into(), 9))];
        f
    }

    #[test]
    fn a_clean_history_passes() {
        let ops = vec![
            created(),
            op(
                0,
                0,
                10,
                Kind::Enroll {
                    token_id: "t1".into(),
                    identity: "k1".into(),
                    attempt: 0,
                },
                enrolled("n1", "c1"),
            ),
            op(
                1,
                11,
                12,
                Kind::Heartbeat {
                    node_id: "n1".into(),
                    credential_id: "c1".into(),
                    member: 0,
                },
                Outcome::ok(),
            ),
            op(
                2,
                20,
                30,
                Kind::Revoke {
                    node_id: "n1".into(),
                },
                Outcome::Ok {
                    token_id: None,
                    node_id: None,
                    credential_id: None,
                    revoked: vec!["c1".into()],
                },
            ),
            op(
                3,
                31,
                32,
                Kind::Heartbeat {
                    node_id: "n1".into(),
                    credential_id: "c1".into(),
                    member: 1,
                },
                Outcome::Failed {
                    status: 401,
                    code: "credential_revoked".into(),
                },
            ),
        ];
        let (v, _) = check(&ops, &base_state());
        assert!(v.is_empty(), "{v:?}");
    }

    #[test]
    fn catches_a_revoked_credential_accepted() {
        let ops = vec![
            created(),
            op(
                0,
                0,
                10,
                Kind::Enroll {
                    token_id: "t1".into(),
                    identity: "k1".into(),
                    attempt: 0,
                },
                enrolled("n1", "c1"),
            ),
            op(
                1,
                20,
                30,
                Kind::Revoke {
                    node_id: "n1".into(),
                },
                Outcome::Ok {
                    token_id: None,
                    node_id: None,
                    credential_id: None,
                    revoked: vec!["c1".into()],
                },
            ),
            // A cut-off old leader said 200 after the revocation was acknowledged.
            op(
                2,
                31,
                32,
                Kind::Heartbeat {
                    node_id: "n1".into(),
                    credential_id: "c1".into(),
                    member: 2,
                },
                Outcome::ok(),
            ),
        ];
        let (v, _) = check(&ops, &base_state());
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!(
            v[0].rule,
            "no credential is accepted after its revocation was acknowledged"
        );
        assert_eq!(v[0].ops, vec![1, 2]);
    }

    #[test]
    fn catches_a_token_that_minted_two_nodes() {
        let mut f = base_state();
        f.nodes.insert("n2".into(), "k2".into());
        f.credentials.insert("c2".into(), ("n2".into(), false));
        let ops = vec![
            op(
                0,
                0,
                10,
                Kind::Enroll {
                    token_id: "t1".into(),
                    identity: "k1".into(),
                    attempt: 0,
                },
                enrolled("n1", "c1"),
            ),
            op(
                1,
                0,
                11,
                Kind::Enroll {
                    token_id: "t1".into(),
                    identity: "k2".into(),
                    attempt: 0,
                },
                enrolled("n2", "c2"),
            ),
        ];
        let (v, _) = check(&ops, &f);
        assert!(
            v.iter()
                .any(|x| x.rule == "one token mints at most one node identity"
                    && x.ops == vec![0, 1]),
            "{v:?}"
        );
    }

    #[test]
    fn catches_lost_writes_and_divergence() {
        let mut f = base_state();
        f.digests = vec![Some(("a".into(), 9)), Some(("b".into(), 9))];
        let ops = vec![op(
            0,
            0,
            10,
            Kind::CreateToken,
            Outcome::Ok {
                token_id: Some("t9".into()),
                node_id: None,
                credential_id: None,
                revoked: vec![],
            },
        )];
        let (v, _) = check(&ops, &f);
        assert!(
            v.iter().any(|x| x.rule == "no acknowledged write is lost"),
            "{v:?}"
        );
        assert!(
            v.iter()
                .any(|x| x.rule == "all members converge to identical state"),
            "{v:?}"
        );
    }
}
