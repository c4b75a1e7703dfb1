//! The recorded history: every operation with its invoke and completion time and outcome.

use std::sync::Mutex;
use std::time::Instant;

use serde::Deserialize;
use serde::Serialize;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub enum Kind {
    /// `note` is unique per request: the created token carries it, so an unknown outcome is
    /// resolved by reading the note back.
    CreateToken {
        note: String,
    },
    CancelToken {
        token_id: String,
    },
    /// `attempt` counts retries of the same claim (same identity, same token).
    Enroll {
        token_id: String,
        identity: String,
        attempt: u32,
    },
    /// `reason` is unique per request: every credential it revoked carries it as its
    /// `revoked_reason`, so the exact effect of the request is read back from the final state.
    Revoke {
        node_id: String,
        reason: String,
    },
    Heartbeat {
        node_id: String,
        credential_id: String,
        member: usize,
    },
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub enum Outcome {
    /// Acknowledged. For CreateToken: token_id; Enroll: node_id and credential_id;
    /// Revoke: the revoked ids; Heartbeat: nothing.
    Ok {
        token_id: Option<String>,
        node_id: Option<String>,
        credential_id: Option<String>,
        revoked: Vec<String>,
    },
    /// Certainly not applied (a refusal with a status), or refused (heartbeat 401/403).
    Failed { status: u16, code: String },
    /// Timed out, connection lost, or 503 `outcome_unknown`: may or may not have applied.
    Unknown { why: String },
}

impl Outcome {
    pub fn ok() -> Self {
        Outcome::Ok {
            token_id: None,
            node_id: None,
            credential_id: None,
            revoked: vec![],
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Op {
    pub id: u64,
    pub client: String,
    pub invoke_ms: u64,
    pub complete_ms: u64,
    pub kind: Kind,
    pub outcome: Outcome,
}

pub struct History {
    start: Instant,
    ops: Mutex<Vec<Op>>,
}

impl Default for History {
    fn default() -> Self {
        Self {
            start: Instant::now(),
            ops: Mutex::new(vec![]),
        }
    }
}

impl History {
    pub fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    pub fn record(&self, client: &str, invoke_ms: u64, kind: Kind, outcome: Outcome) {
        let complete_ms = self.now_ms();
        let mut ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        let id = ops.len() as u64;
        ops.push(Op {
            id,
            client: client.to_string(),
            invoke_ms,
            complete_ms,
            kind,
            outcome,
        });
    }

    pub fn ops(&self) -> Vec<Op> {
        self.ops.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}
