//! Production-like traffic: agents enrolling with their own identities (retrying the same
//! claim after an unknown outcome), an admin creating and cancelling tokens and revoking
//! credentials, and steady heartbeats to every member. Every request is recorded.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering;
use std::time::Duration;

use modelforge_proto::api;
use modelforge_proto::identity::IdentityKey;
use modelforge_proto::wire;
use serde_json::Value;
use serde_json::json;

use crate::Rng;
use crate::answer::refusal_code;
use crate::answer::typed_if_any;
use crate::cluster::ADMIN;
use crate::history::History;
use crate::history::Kind;
use crate::history::Outcome;

const TIMEOUT: Duration = Duration::from_secs(3);

pub struct Enrolled {
    pub node_id: String,
    pub credential_id: String,
    pub credential: String,
}

pub struct Shared {
    pub urls: Vec<String>,
    pub http: reqwest::Client,
    pub history: History,
    pub stop: AtomicBool,
    pub tokens: Mutex<Vec<(String, String)>>,
    pub enrolled: Mutex<Vec<Enrolled>>,
    /// Enrolment requests currently waiting for an answer (kills are timed against it).
    pub enrolls_in_flight: AtomicUsize,
}

/// Send one request; map the answer to an outcome. 503 `no_leader`/`not_leader` and connection
/// refusals before sending are certain failures; timeouts, cut connections and
/// `outcome_unknown` are unknown.
async fn send(
    sh: &Shared,
    method: reqwest::Method,
    url: String,
    bearer: &str,
    body: Option<Value>,
) -> (Outcome, Value) {
    let mut r = sh
        .http
        .request(method.clone(), &url)
        .bearer_auth(bearer)
        .timeout(TIMEOUT);
    if bearer == ADMIN {
        // A well-behaved admin client: every write carries an Idempotency-Key.
        r = r.header("idempotency-key", modelforge_proto::new_uuid());
    }
    if let Some(b) = body {
        r = r.json(&b);
    }
    match r.send().await {
        Err(e) if e.is_connect() => (
            Outcome::Failed {
                status: 0,
                code: "connect".into(),
            },
            Value::Null,
        ),
        Err(e) => (
            Outcome::Unknown {
                why: if e.is_timeout() {
                    "timeout".into()
                } else {
                    "connection lost".into()
                },
            },
            Value::Null,
        ),
        Ok(resp) => {
            let status = resp.status().as_u16();
            let v: Value = resp.json().await.unwrap_or(Value::Null);
            if (200..300).contains(&status) {
                return (Outcome::ok(), v);
            }
            let code = refusal_code(&v);
            // `already_created`: a relay resent the creation after a cut connection and the
            // first one applied; the token is shown only once, so the answer cannot carry it.
            // Applied, then, but without its id: recorded as unknown and resolved by its note.
            if status == 503 && code == "outcome_unknown"
                || status >= 500 && code.is_empty()
                || status == 409 && code == "already_created"
            {
                return (
                    Outcome::Unknown {
                        why: format!("{status} {code}"),
                    },
                    v,
                );
            }
            (Outcome::Failed { status, code }, v)
        }
    }
}

pub async fn admin(sh: Arc<Shared>, mut rng: Rng) {
    let mut n = 0u64;
    while !sh.stop.load(Ordering::Relaxed) {
        n += 1;
        let url = sh.urls[rng.below(sh.urls.len())].clone();
        let t = sh.history.now_ms();
        if n.is_multiple_of(9) {
            // Revoke a random enrolled node's credential.
            let nid = {
                let e = sh.enrolled.lock().unwrap();
                if e.is_empty() {
                    None
                } else {
                    Some(e[rng.below(e.len())].node_id.clone())
                }
            };
            if let Some(nid) = nid {
                // A reason of its own: the credentials it revokes carry it in the final state.
                let reason = format!("chaos revoke {}", modelforge_proto::new_uuid());
                let (mut o, v) = send(
                    &sh,
                    reqwest::Method::DELETE,
                    format!("{url}/api/v1/admin/hardware/nodes/{nid}/credential"),
                    ADMIN,
                    Some(json!({ "reason": reason })),
                )
                .await;
                if let Outcome::Ok { revoked, .. } = &mut o {
                    *revoked = typed_if_any::<api::Revoked>("a revoke", &v)
                        .map(|r| r.revoked.iter().map(ToString::to_string).collect())
                        .unwrap_or_default();
                }
                sh.history.record(
                    "admin",
                    t,
                    Kind::Revoke {
                        node_id: nid,
                        reason,
                    },
                    o,
                );
            }
        } else if n.is_multiple_of(7) {
            let tok = { sh.tokens.lock().unwrap().pop() };
            if let Some((tid, _)) = tok {
                let (o, _) = send(
                    &sh,
                    reqwest::Method::DELETE,
                    format!("{url}/api/v1/admin/node-enrollments/{tid}"),
                    ADMIN,
                    None,
                )
                .await;
                sh.history
                    .record("admin", t, Kind::CancelToken { token_id: tid }, o);
            }
        } else {
            // A note of its own: the token it creates carries it in the final state.
            let note = format!("chaos {}", modelforge_proto::new_uuid());
            let (mut o, v) = send(
                &sh,
                reqwest::Method::POST,
                format!("{url}/api/v1/admin/node-enrollments"),
                ADMIN,
                Some(json!({"ttl_seconds": 3600, "note": note})),
            )
            .await;
            if let Outcome::Ok { token_id, .. } = &mut o
                && let Some(t) = typed_if_any::<api::TokenIssued>("a new token", &v)
            {
                let id = t.enrollment_id.to_string();
                *token_id = Some(id.clone());
                sh.tokens.lock().unwrap().push((id, t.token));
            }
            sh.history.record("admin", t, Kind::CreateToken { note }, o);
        }
        if sh.tokens.lock().unwrap().len() > 20 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

pub async fn agent(sh: Arc<Shared>, name: String, mut rng: Rng) {
    let mut keys: Vec<IdentityKey> = vec![];
    while !sh.stop.load(Ordering::Relaxed) {
        let tok = { sh.tokens.lock().unwrap().pop() };
        let Some((tid, token)) = tok else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        // Mostly new identities; sometimes an existing one re-enrols (credential rotation).
        let key = if !keys.is_empty() && rng.below(5) == 0 {
            keys.swap_remove(rng.below(keys.len()))
        } else {
            IdentityKey::generate()
        };
        let hostname = format!("{name}-{}", &key.public_hex()[..8]);
        for attempt in 0..6u32 {
            if sh.stop.load(Ordering::Relaxed) {
                break;
            }
            let url = sh.urls[rng.below(sh.urls.len())].clone();
            let body = json!({"token": token, "hostname": hostname, "identity": key.prove(&tid, &hostname, modelforge_proto::now_ms(), None),
                "inventory": {"accelerators": [{"uuid": format!("GPU-{}", &key.public_hex()[..12]), "name": "sim"}], "storage_roots": []}});
            let t = sh.history.now_ms();
            sh.enrolls_in_flight.fetch_add(1, Ordering::SeqCst);
            let (mut o, v) = send(
                &sh,
                reqwest::Method::POST,
                format!("{url}/api/v1/agent/enroll"),
                "-",
                Some(body),
            )
            .await;
            sh.enrolls_in_flight.fetch_sub(1, Ordering::SeqCst);
            let mut done = true;
            match &mut o {
                Outcome::Ok {
                    node_id,
                    credential_id,
                    ..
                } => {
                    if let Some(e) = typed_if_any::<wire::EnrollResponse>("an enrolment", &v) {
                        *node_id = Some(e.node_id.to_string());
                        *credential_id = Some(e.credential_id.to_string());
                        sh.enrolled.lock().unwrap().push(Enrolled {
                            node_id: e.node_id.to_string(),
                            credential_id: e.credential_id.to_string(),
                            credential: e.credential,
                        });
                    }
                }
                // Unknown or not answered: retry the same claim with the same identity.
                Outcome::Unknown { .. }
                | Outcome::Failed {
                    status: 0 | 503 | 429,
                    ..
                } => done = false,
                Outcome::Failed { .. } => {}
            }
            sh.history.record(
                &name,
                t,
                Kind::Enroll {
                    token_id: tid.clone(),
                    identity: key.public_hex(),
                    attempt,
                },
                o,
            );
            if done {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100 + rng.below(200) as u64)).await;
        }
        keys.push(key);
    }
}

pub async fn heartbeats(sh: Arc<Shared>, name: String, mut rng: Rng) {
    while !sh.stop.load(Ordering::Relaxed) {
        let pick = {
            let e = sh.enrolled.lock().unwrap();
            if e.is_empty() {
                None
            } else {
                let x = &e[rng.below(e.len())];
                Some((
                    x.node_id.clone(),
                    x.credential_id.clone(),
                    x.credential.clone(),
                ))
            }
        };
        let Some((nid, cid, cred)) = pick else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        let member = rng.below(sh.urls.len());
        let t = sh.history.now_ms();
        let (o, _) = send(
            &sh,
            reqwest::Method::POST,
            format!("{}/api/v1/agent/nodes/{nid}/heartbeat", sh.urls[member]),
            &cred,
            Some(json!({})),
        )
        .await;
        sh.history.record(
            &name,
            t,
            Kind::Heartbeat {
                node_id: nid,
                credential_id: cid,
                member,
            },
            o,
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
