//! The checker: after the final heal, the history and the cluster's final state must satisfy
//! the rules below. Each violation names its rule and the operations involved.
//!
//! Every rule is decided from evidence, never from a likelihood. The workload makes each write
//! leave a mark of its own in the replicated state (a token carries the note of the request
//! that created it, a credential the reason of the request that revoked it and the token it
//! was issued on), so an unknown outcome is resolved by the exact effect of that request:
//! - an enrolment attempt (token T, identity K) applied iff the final state holds a credential
//!   issued on T to the node of K that no acknowledged attempt explains (each applied attempt
//!   issues exactly one credential, and credentials are never deleted);
//! - a token creation applied iff a token carries its note;
//! - a revocation applied iff a credential carries its reason (one that found nothing to
//!   revoke changed nothing, so it excuses nothing);
//! - a cancellation applied iff its token is cancelled (only one request ever cancels a token).

use std::collections::BTreeMap;
use std::collections::BTreeSet;

use serde::Deserialize;
use serde::Serialize;

use crate::history::Kind;
use crate::history::Op;
use crate::history::Outcome;

pub const ONE_TOKEN: &str = "one token mints at most one node identity";
pub const ONE_NODE: &str = "every agent identity maps to exactly one node";
pub const NOT_LOST: &str = "no acknowledged write is lost";
pub const NOT_UNMADE: &str = "no write appears that nobody made";
pub const WORKS: &str = "a credential works unless revoked or superseded";
pub const STAYS_REVOKED: &str = "no credential is accepted after its revocation was acknowledged";
pub const CONVERGE: &str = "all members converge to identical state";
pub const CONFIGURATION: &str = "all members report the same configuration";

/// A credential as the final state holds it.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct FinalCredential {
    pub node_id: String,
    pub revoked: bool,
    pub revoked_reason: Option<String>,
    /// The enrolment token it was issued on.
    pub token_id: Option<String>,
}

/// An enrolment token as the final state holds it.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct FinalToken {
    /// pending | claimed | expired | cancelled
    pub state: String,
    pub claimed_node_id: Option<String>,
    pub note: Option<String>,
}

/// What the cluster holds after the final heal, read back through the admin API.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct FinalState {
    /// node id -> identity public key
    pub nodes: BTreeMap<String, String>,
    /// node id -> its credential ids, oldest first
    pub node_credentials: BTreeMap<String, Vec<String>>,
    pub credentials: BTreeMap<String, FinalCredential>,
    pub tokens: BTreeMap<String, FinalToken>,
    /// member -> (digest, applied index); None when the member did not answer
    pub digests: Vec<Option<(String, u64)>>,
    /// member -> the configuration it reports: (id, voter) of every member, sorted; None
    /// when it did not answer
    #[serde(default)]
    pub configurations: Vec<Option<Vec<(u64, bool)>>>,
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
}

/// The history indexed by what the rules look up.
struct Ix<'a> {
    ops: &'a [Op],
    fin: &'a FinalState,
    /// credential id -> the acknowledged enrolment that issued it
    acked_cred: BTreeMap<&'a str, &'a Op>,
    /// (token, identity) -> enrolment attempts whose outcome is unknown
    unknown_claims: BTreeMap<(&'a str, &'a str), Vec<&'a Op>>,
    /// (token, identity) -> every enrolment attempt, whatever its outcome
    claims: BTreeMap<(&'a str, &'a str), Vec<&'a Op>>,
    /// revocation reason -> the request that gave it
    revokes: BTreeMap<&'a str, &'a Op>,
}

impl<'a> Ix<'a> {
    fn new(ops: &'a [Op], fin: &'a FinalState) -> Self {
        let mut ix = Ix {
            ops,
            fin,
            acked_cred: BTreeMap::new(),
            unknown_claims: BTreeMap::new(),
            claims: BTreeMap::new(),
            revokes: BTreeMap::new(),
        };
        for op in ops {
            match (&op.kind, &op.outcome) {
                (
                    Kind::Enroll {
                        token_id, identity, ..
                    },
                    o,
                ) => {
                    let key = (token_id.as_str(), identity.as_str());
                    ix.claims.entry(key).or_default().push(op);
                    match o {
                        Outcome::Ok {
                            credential_id: Some(c),
                            ..
                        } => {
                            ix.acked_cred.insert(c, op);
                        }
                        Outcome::Unknown { .. } => {
                            ix.unknown_claims.entry(key).or_default().push(op)
                        }
                        _ => {}
                    }
                }
                (Kind::Revoke { reason, .. }, _) => {
                    ix.revokes.insert(reason, op);
                }
                _ => {}
            }
        }
        ix
    }

    fn key_of(&self, node: &str) -> Option<&'a str> {
        self.fin.nodes.get(node).map(String::as_str)
    }

    /// The requests that may have issued credential `c`: the acknowledged enrolment that
    /// returned it, else the unknown attempts on its token by its node's identity.
    fn creators(&self, c: &str) -> Vec<&'a Op> {
        if let Some(op) = self.acked_cred.get(c) {
            return vec![*op];
        }
        let Some(cred) = self.fin.credentials.get(c) else {
            return vec![];
        };
        match (cred.token_id.as_deref(), self.key_of(&cred.node_id)) {
            (Some(t), Some(k)) => self
                .unknown_claims
                .get(&(t, k))
                .cloned()
                .unwrap_or_default(),
            _ => vec![],
        }
    }

    /// The requests that may have revoked credential `c` (revoked in the final state), or why
    /// none can have.
    fn revokers(&self, c: &str) -> Result<Vec<&'a Op>, String> {
        let cred = &self.fin.credentials[c];
        let reason = cred.revoked_reason.as_deref().unwrap_or("");
        if let Some(op) = self.revokes.get(reason) {
            return match &op.kind {
                Kind::Revoke { node_id, .. } if *node_id == cred.node_id => Ok(vec![*op]),
                _ => Err(format!(
                    "revoked by request {} which named another node",
                    op.id
                )),
            };
        }
        if !reason.starts_with("superseded") {
            return Err(format!(
                "revoked with reason {reason:?}, which no request gave"
            ));
        }
        // Superseded: by the first credential issued to the node after it (an enrolment
        // revokes every older credential still active).
        let own = self
            .fin
            .node_credentials
            .get(&cred.node_id)
            .map(Vec::as_slice)
            .unwrap_or_default();
        let next = own.iter().position(|x| x == c).and_then(|i| own.get(i + 1));
        match next {
            None => Err("superseded, yet no newer credential was issued to its node".into()),
            Some(n) => match self.creators(n) {
                ops if ops.is_empty() => Err(format!(
                    "superseded by credential {n}, which no request issued"
                )),
                ops => Ok(ops),
            },
        }
    }
}

pub fn check(ops: &[Op], fin: &FinalState) -> (Vec<Violation>, Resolution) {
    let ix = Ix::new(ops, fin);
    let mut v = vec![];
    let mut res = Resolution::default();
    one_token_one_identity(&ix, &mut v);
    one_identity_one_node(&ix, &mut v);
    acknowledged_writes_kept(&ix, &mut v);
    nothing_unmade(&ix, &mut v, &mut res);
    credentials_work_unless_revoked(&ix, &mut v);
    revoked_credentials_stay_refused(&ix, &mut v);
    converged(fin, &mut v);
    configuration_converged(fin, &mut v);
    (v, res)
}

fn violation(v: &mut Vec<Violation>, rule: &'static str, detail: String, ops: Vec<u64>) {
    v.push(Violation { rule, detail, ops });
}

fn short(key: &str) -> &str {
    &key[..key.len().min(12)]
}

fn acked_enrolments(ops: &[Op]) -> impl Iterator<Item = (&Op, &str, &str, &str, &str)> {
    ops.iter().filter_map(|op| match (&op.kind, &op.outcome) {
        (
            Kind::Enroll {
                token_id, identity, ..
            },
            Outcome::Ok {
                node_id: Some(n),
                credential_id: Some(c),
                ..
            },
        ) => Some((
            op,
            token_id.as_str(),
            identity.as_str(),
            n.as_str(),
            c.as_str(),
        )),
        _ => None,
    })
}

/// From the acknowledged answers and from the final state's claims: a token issued credentials
/// to one node of one identity at most, and that node is the token's claimant.
fn one_token_one_identity(ix: &Ix, v: &mut Vec<Violation>) {
    /// The nodes, identities and operations acknowledged on one token.
    type Minted<'a> = (BTreeSet<&'a str>, BTreeSet<&'a str>, Vec<u64>);
    let mut by_token: BTreeMap<&str, Minted> = BTreeMap::new();
    for (op, t, k, n, _) in acked_enrolments(ix.ops) {
        let e = by_token.entry(t).or_default();
        e.0.insert(n);
        e.1.insert(k);
        e.2.push(op.id);
    }
    for (t, (nodes, idents, ids)) in by_token {
        if nodes.len() > 1 || idents.len() > 1 {
            violation(
                v,
                ONE_TOKEN,
                format!(
                    "token {t} was acknowledged for nodes {nodes:?} of {} identities",
                    idents.len()
                ),
                ids,
            );
        }
    }
    let mut issued_on: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for c in ix.fin.credentials.values() {
        if let Some(t) = &c.token_id {
            issued_on.entry(t).or_default().insert(&c.node_id);
        }
    }
    for (t, nodes) in &issued_on {
        let claimant = ix
            .fin
            .tokens
            .get(*t)
            .and_then(|x| x.claimed_node_id.as_deref());
        if nodes.len() > 1 || claimant.is_some_and(|n| !nodes.contains(n)) {
            let ids = ix
                .ops
                .iter()
                .filter(|o| matches!(&o.kind, Kind::Enroll { token_id, .. } if token_id == t))
                .map(|o| o.id)
                .collect();
            violation(
                v,
                ONE_TOKEN,
                format!(
                    "token {t} issued credentials to nodes {nodes:?} in the final state (claimed by {claimant:?})"
                ),
                ids,
            );
        }
    }
}

fn one_identity_one_node(ix: &Ix, v: &mut Vec<Violation>) {
    let mut by_identity: BTreeMap<&str, BTreeMap<&str, Vec<u64>>> = BTreeMap::new();
    for (op, _, k, n, _) in acked_enrolments(ix.ops) {
        by_identity
            .entry(k)
            .or_default()
            .entry(n)
            .or_default()
            .push(op.id);
    }
    for (k, nodes) in &by_identity {
        if nodes.len() > 1 {
            violation(
                v,
                ONE_NODE,
                format!(
                    "identity {}… acknowledged on nodes {:?}",
                    short(k),
                    nodes.keys().collect::<Vec<_>>()
                ),
                nodes.values().flatten().copied().collect(),
            );
        }
    }
    let mut owners: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (n, k) in &ix.fin.nodes {
        owners.entry(k).or_default().push(n);
    }
    for (k, ns) in owners {
        if ns.len() > 1 {
            violation(
                v,
                ONE_NODE,
                format!(
                    "identity {}… owns nodes {ns:?} in the final state",
                    short(k)
                ),
                vec![],
            );
        }
    }
}

/// Every acknowledged write is in the final state, exactly as it was acknowledged.
fn acknowledged_writes_kept(ix: &Ix, v: &mut Vec<Violation>) {
    let fin = ix.fin;
    for op in ix.ops {
        let mut lost = |detail: String| violation(v, NOT_LOST, detail, vec![op.id]);
        match (&op.kind, &op.outcome) {
            (
                Kind::CreateToken { note },
                Outcome::Ok {
                    token_id: Some(t), ..
                },
            ) => match fin.tokens.get(t) {
                None => lost(format!("token {t} was acknowledged but is gone")),
                Some(x) if x.note.as_deref() != Some(note) => lost(format!(
                    "token {t} was created with note {note:?} but holds {:?}",
                    x.note
                )),
                Some(_) => {}
            },
            (Kind::CancelToken { token_id }, Outcome::Ok { .. }) => {
                let state = fin.tokens.get(token_id).map(|x| x.state.as_str());
                if state != Some("cancelled") {
                    lost(format!("token {token_id} was cancelled but is {state:?}"));
                }
            }
            (Kind::Revoke { reason, .. }, Outcome::Ok { revoked, .. }) => {
                for c in revoked {
                    match fin.credentials.get(c) {
                        Some(x) if x.revoked && x.revoked_reason.as_deref() == Some(reason) => {}
                        Some(x) if x.revoked => lost(format!(
                            "credential {c} was revoked by this request, yet holds the reason {:?}",
                            x.revoked_reason
                        )),
                        Some(_) => lost(format!("credential {c} was revoked but is active")),
                        None => lost(format!("credential {c} was revoked but is gone")),
                    }
                }
            }
            (
                Kind::Enroll {
                    token_id, identity, ..
                },
                Outcome::Ok {
                    node_id: Some(n),
                    credential_id: Some(c),
                    ..
                },
            ) => {
                match fin.nodes.get(n) {
                    None => lost(format!("node {n} is gone")),
                    Some(k) if k != identity => lost(format!(
                        "node {n} was enrolled by identity {}… but holds {}…",
                        short(identity),
                        short(k)
                    )),
                    Some(_) => {}
                }
                match fin.credentials.get(c) {
                    None => lost(format!("credential {c} of node {n} is gone")),
                    Some(x) if x.node_id != *n => {
                        lost(format!("credential {c} belongs to {}, not {n}", x.node_id))
                    }
                    Some(x) if x.token_id.as_deref() != Some(token_id) => lost(format!(
                        "credential {c} was issued on token {token_id} but records {:?}",
                        x.token_id
                    )),
                    Some(_) => {}
                }
                let claim = fin.tokens.get(token_id);
                if claim.and_then(|x| x.claimed_node_id.as_deref()) != Some(n.as_str()) {
                    lost(format!(
                        "token {token_id} was claimed by node {n} but is {:?}",
                        claim.map(|x| (&x.state, &x.claimed_node_id))
                    ));
                }
            }
            _ => {}
        }
    }
}

/// Every node, credential, token, cancellation and claim in the final state was made by a
/// request of the history: acknowledged, or unknown and resolved as applied by its exact effect.
fn nothing_unmade(ix: &Ix, v: &mut Vec<Violation>, res: &mut Resolution) {
    let fin = ix.fin;
    let mut unmade = |detail: String, ops: Vec<u64>| violation(v, NOT_UNMADE, detail, ops);

    for (n, k) in &fin.nodes {
        let made = ix.ops.iter().any(|op| match (&op.kind, &op.outcome) {
            (Kind::Enroll { identity, .. }, Outcome::Ok { node_id, .. }) => {
                identity == k && node_id.as_deref() == Some(n)
            }
            (Kind::Enroll { identity, .. }, Outcome::Unknown { .. }) => identity == k,
            _ => false,
        });
        if !made {
            unmade(
                format!(
                    "node {n} of identity {}… was made by no enrolment",
                    short(k)
                ),
                vec![],
            );
        }
    }

    // Credentials, grouped by the claim (token, identity) that issued them.
    let mut extra: BTreeMap<(&str, &str), Vec<&str>> = BTreeMap::new();
    for (c, cred) in &fin.credentials {
        if ix.acked_cred.contains_key(c.as_str()) {
            continue;
        }
        match (cred.token_id.as_deref(), ix.key_of(&cred.node_id)) {
            (Some(t), Some(k)) => extra.entry((t, k)).or_default().push(c),
            _ => unmade(
                format!(
                    "credential {c} of node {} names no token or no known node",
                    cred.node_id
                ),
                vec![],
            ),
        }
    }
    for (key, unknown) in &ix.unknown_claims {
        res.unknown += unknown.len();
        let applied = extra.get(key).map_or(0, Vec::len).min(unknown.len());
        res.resolved_committed += applied;
        res.resolved_not_committed += unknown.len() - applied;
    }
    for ((t, k), creds) in &extra {
        let unknown = ix.unknown_claims.get(&(*t, *k)).map_or(0, Vec::len);
        if creds.len() > unknown {
            unmade(
                format!(
                    "{} credentials {creds:?} were issued on token {t} to identity {}…, but only {unknown} attempts of that claim have an unknown outcome",
                    creds.len(),
                    short(k)
                ),
                ix.claims
                    .get(&(*t, *k))
                    .into_iter()
                    .flatten()
                    .map(|o| o.id)
                    .collect(),
            );
        }
    }

    // Tokens: each carries the note of the request that created it.
    let mut notes: BTreeMap<&str, &Op> = BTreeMap::new();
    for op in ix.ops {
        if let Kind::CreateToken { note } = &op.kind {
            notes.insert(note, op);
        }
    }
    for op in ix.ops {
        if let (Kind::CreateToken { note }, Outcome::Unknown { .. }) = (&op.kind, &op.outcome) {
            res.unknown += 1;
            if fin.tokens.values().any(|x| x.note.as_deref() == Some(note)) {
                res.resolved_committed += 1;
            } else {
                res.resolved_not_committed += 1;
            }
        }
    }
    for (t, tok) in &fin.tokens {
        let creator = tok.note.as_deref().and_then(|n| notes.get(n));
        let made = creator.is_some_and(|op| match &op.outcome {
            Outcome::Ok { token_id, .. } => token_id.as_deref() == Some(t),
            Outcome::Unknown { .. } => true,
            Outcome::Failed { .. } => false,
        });
        if !made {
            unmade(
                format!("token {t} (note {:?}) was made by no request", tok.note),
                creator.map(|o| vec![o.id]).unwrap_or_default(),
            );
        }
        if tok.state == "cancelled"
            && !ix.ops.iter().any(|op| {
                matches!(&op.kind, Kind::CancelToken { token_id } if token_id == t)
                    && !matches!(op.outcome, Outcome::Failed { .. })
            })
        {
            unmade(
                format!("token {t} is cancelled, yet no request cancelled it"),
                vec![],
            );
        }
        if let Some(n) = &tok.claimed_node_id {
            let claimed = ix
                .key_of(n)
                .is_some_and(|k| ix.claims.contains_key(&(t.as_str(), k)));
            if !claimed {
                unmade(
                    format!(
                        "token {t} is claimed by node {n}, yet that node's identity never used it"
                    ),
                    vec![],
                );
            }
        }
    }
    for op in ix.ops {
        if let (Kind::CancelToken { token_id }, Outcome::Unknown { .. }) = (&op.kind, &op.outcome) {
            res.unknown += 1;
            if fin
                .tokens
                .get(token_id)
                .is_some_and(|x| x.state == "cancelled")
            {
                res.resolved_committed += 1;
            } else {
                res.resolved_not_committed += 1;
            }
        }
        if let (Kind::Revoke { reason, .. }, Outcome::Unknown { .. }) = (&op.kind, &op.outcome) {
            res.unknown += 1;
            if fin
                .credentials
                .values()
                .any(|x| x.revoked_reason.as_deref() == Some(reason))
            {
                res.resolved_committed += 1;
            } else {
                res.resolved_not_committed += 1;
            }
        }
    }
}

/// A credential is refused only once a request revoked or superseded it: every revoked
/// credential has such a request (acknowledged, or unknown and resolved as applied), and every
/// 401 seen during the run came after that request was made. A node's own credential never gets
/// 403.
fn credentials_work_unless_revoked(ix: &Ix, v: &mut Vec<Violation>) {
    let mut cause: BTreeMap<&str, Vec<&Op>> = BTreeMap::new();
    for (c, cred) in &ix.fin.credentials {
        if !cred.revoked {
            continue;
        }
        match ix.revokers(c) {
            Ok(ops) => {
                cause.insert(c, ops);
            }
            Err(why) => violation(
                v,
                WORKS,
                format!("credential {c} of node {}: {why}", cred.node_id),
                ix.acked_cred
                    .get(c.as_str())
                    .map(|o| vec![o.id])
                    .unwrap_or_default(),
            ),
        }
    }
    for op in ix.ops {
        let (
            Kind::Heartbeat {
                credential_id: c,
                member,
                ..
            },
            Outcome::Failed { status, code },
        ) = (&op.kind, &op.outcome)
        else {
            continue;
        };
        let refused = format!(
            "credential {c} got {status} {code} from member {} at {} ms",
            member + 1,
            op.complete_ms
        );
        match (*status, ix.fin.credentials.get(c.as_str())) {
            (403, _) => violation(
                v,
                WORKS,
                format!("{refused}: its own node's credential"),
                vec![op.id],
            ),
            (401, None) => violation(v, WORKS, format!("{refused}, and it is gone"), vec![op.id]),
            (401, Some(x)) if !x.revoked => violation(
                v,
                WORKS,
                format!("{refused}, yet nobody revoked or superseded it"),
                vec![op.id],
            ),
            (401, Some(_)) => {
                if let Some(ops) = cause.get(c.as_str()) {
                    let first = ops.iter().map(|o| o.invoke_ms).min().unwrap_or(u64::MAX);
                    if first > op.complete_ms {
                        let mut ids: Vec<u64> = ops.iter().map(|o| o.id).collect();
                        ids.push(op.id);
                        violation(
                            v,
                            WORKS,
                            format!(
                                "{refused}, before the request that revoked it was made (at {first} ms)"
                            ),
                            ids,
                        );
                    }
                }
            }
            _ => {}
        }
    }
}

/// Once a revocation (or a superseding enrolment) was acknowledged, no member accepts the
/// credential again.
fn revoked_credentials_stay_refused(ix: &Ix, v: &mut Vec<Violation>) {
    fn note<'a>(dead: &mut BTreeMap<&'a str, (u64, u64)>, c: &'a str, op: &Op) {
        let e = dead.entry(c).or_insert((op.complete_ms, op.id));
        if op.complete_ms < e.0 {
            *e = (op.complete_ms, op.id);
        }
    }
    let mut dead: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    for op in ix.ops {
        if let (Kind::Revoke { .. }, Outcome::Ok { revoked, .. }) = (&op.kind, &op.outcome) {
            for c in revoked {
                note(&mut dead, c, op);
            }
        }
    }
    let acked: Vec<_> = acked_enrolments(ix.ops).collect();
    for (op, _, _, n, newc) in &acked {
        for (older, _, _, on, oldc) in &acked {
            if on == n && oldc != newc && older.complete_ms < op.complete_ms {
                note(&mut dead, oldc, op);
            }
        }
    }
    for c in ix.fin.credentials.keys() {
        if ix.fin.credentials[c].revoked
            && let Ok(ops) = ix.revokers(c)
            && let [op] = ops.as_slice()
            && matches!(op.outcome, Outcome::Ok { .. })
        {
            note(&mut dead, c, op);
        }
    }
    for op in ix.ops {
        if let (
            Kind::Heartbeat {
                credential_id,
                member,
                ..
            },
            Outcome::Ok { .. },
        ) = (&op.kind, &op.outcome)
            && let Some((at, by)) = dead.get(credential_id.as_str())
            && op.invoke_ms > *at
        {
            violation(
                v,
                STAYS_REVOKED,
                format!(
                    "credential {credential_id} got 200 from member {} at {} ms, dead since {at} ms",
                    member + 1,
                    op.invoke_ms
                ),
                vec![*by, op.id],
            );
        }
    }
}

/// Every member reports the same membership after the final heal (a membership change that
/// one member applied and another never learned would split who counts for a quorum).
fn configuration_converged(fin: &FinalState, v: &mut Vec<Violation>) {
    let silent: Vec<usize> = (0..fin.configurations.len())
        .filter(|i| fin.configurations[*i].is_none())
        .map(|i| i + 1)
        .collect();
    let seen: Vec<&Vec<(u64, bool)>> = fin.configurations.iter().flatten().collect();
    if !silent.is_empty() {
        violation(
            v,
            CONFIGURATION,
            format!("members in slots {silent:?} did not report their configuration"),
            vec![],
        );
    } else if seen.windows(2).any(|w| w[0] != w[1]) {
        violation(
            v,
            CONFIGURATION,
            format!("configurations differ: {seen:?}"),
            vec![],
        );
    }
}

fn converged(fin: &FinalState, v: &mut Vec<Violation>) {
    let silent: Vec<usize> = (0..fin.digests.len())
        .filter(|i| fin.digests[*i].is_none())
        .map(|i| i + 1)
        .collect();
    let live: Vec<&(String, u64)> = fin.digests.iter().flatten().collect();
    if fin.digests.is_empty() {
        violation(v, CONVERGE, "no member reported its digest".into(), vec![]);
    } else if !silent.is_empty() {
        violation(
            v,
            CONVERGE,
            format!("members {silent:?} did not report their digest"),
            vec![],
        );
    } else if live.windows(2).any(|w| w[0] != w[1]) {
        violation(v, CONVERGE, format!("digests differ: {live:?}"), vec![]);
    }
}

#[cfg(test)]
mod tests;
