//! The write path: replicating a command (retried across leader changes with the same request
//! id), relaying it to the leader, and linearizing reads.

use std::time::Duration;

use modelforge_proto::api;
use modelforge_proto::api::ErrorCode;
use modelforge_proto::ids::NodeId;
use modelforge_proto::now_ms;
use modelforge_raft::WriteError;
use modelforge_raft::codec;
use modelforge_raft::network::PEER_HEADER;

use super::peer::*;
use super::*;
use crate::app::Replicated;
use crate::error::ApiError;
use crate::state::Command;
use crate::state::Envelope;
use crate::state::Outcome;

impl Ctx {
    /// Queue a freshly verified credential digest for sharing with the other members.
    pub fn note_verified(&self, credential_id: &str, digest: [u8; 32]) {
        let mut q = self.to_share.lock().unwrap_or_else(|p| p.into_inner());
        if q.len() < 100_000 {
            q.push((credential_id.to_string(), digest));
        }
    }

    /// Replicate `command` and return its answer. Retries the same envelope (same request id,
    /// so it applies at most once) across leader changes until [`WRITE_DEADLINE`].
    #[tracing::instrument(name = "propose", skip_all, fields(actor = %actor, write = %request_id))]
    pub async fn propose(
        &self,
        actor: &str,
        request_id: String,
        command: Command,
    ) -> Result<Outcome, ApiError> {
        super::edge::leave_admission();
        if self.disk.low() {
            return Err(self.disk.refusal());
        }
        let env = Envelope {
            request_id,
            now_ms: now_ms(),
            actor: actor.to_string(),
            command,
        };
        let bytes = codec::encode(&env).map_err(|e| ApiError::internal(e.to_string()))?;
        let deadline = tokio::time::Instant::now() + WRITE_DEADLINE;
        let mut last_unknown = String::from("no answer before the deadline");
        loop {
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Err(ApiError::outcome_unknown(format!(
                    "the write may or may not have applied ({last_unknown}); retry with the same Idempotency-Key"
                )));
            }
            let attempt =
                tokio::time::timeout(deadline - now, self.consensus.write(bytes.clone())).await;
            let answer = match attempt {
                Err(_) => continue,
                Ok(Ok(answer)) => answer,
                Ok(Err(WriteError::NotLeader {
                    leader: Some((id, url)),
                })) if id != self.cfg.node_id => {
                    match self.propose_via(&self.peer_url(id, &url), &bytes).await {
                        Ok(answer) => answer,
                        Err(e) => {
                            last_unknown = e;
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            continue;
                        }
                    }
                }
                Ok(Err(WriteError::NotLeader { .. })) => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
                Ok(Err(WriteError::OutcomeUnknown(m))) => {
                    last_unknown = m;
                    continue;
                }
                Ok(Err(WriteError::Fatal(m))) => {
                    return Err(ApiError::new(ErrorCode::RaftUnavailable, m));
                }
            };
            return Replicated::decode_result(&answer).map_err(ApiError::from);
        }
    }

    /// Replicate a command an agent's request caused (a fresh request id: agents' requests are
    /// not retried by id).
    pub async fn propose_for_agent(
        &self,
        node_id: &NodeId,
        command: Command,
    ) -> Result<Outcome, ApiError> {
        self.take_node_write(node_id)?;
        self.propose(
            &format!("agent:{node_id}"),
            modelforge_proto::new_uuid(),
            command,
        )
        .await
    }

    /// Take one of `node_id`'s replicated writes (`budget::NODE_WRITES`), or 429
    /// `too_many_writes` with `Retry-After`.
    pub fn take_node_write(&self, node_id: &NodeId) -> Result<(), ApiError> {
        self.budgets
            .take(super::budget::Key::NodeWrites(node_id.to_string()))
            .map_err(ApiError::writes_spent)
    }

    async fn propose_via(&self, leader_url: &str, envelope: &[u8]) -> Result<Vec<u8>, String> {
        let resp = self
            .http
            .post(format!("{}{PROPOSE}", leader_url.trim_end_matches('/')))
            .header(PEER_HEADER, self.signer.sign("POST", PROPOSE, envelope, 0))
            .timeout(WRITE_DEADLINE)
            .body(envelope.to_vec())
            .send()
            .await
            .map_err(|e| format!("forwarding the write to the leader failed: {e}"))?;
        let status = resp.status();
        let body = resp.bytes().await.map_err(|e| e.to_string())?;
        if !status.is_success() {
            return Err(format!("leader answered {status}"));
        }
        Ok(body.to_vec())
    }

    /// The URL this member uses to reach member `id` (a `--peer-route` override, else `advertised`).
    pub fn peer_url(&self, id: u64, advertised: &str) -> String {
        self.cfg
            .peer_routes
            .get(&id)
            .cloned()
            .unwrap_or_else(|| advertised.to_string())
    }

    /// Confirm leadership by lease before a read of the local state.
    /// Make a local read linearizable on any member: on the leader a read index with a quorum;
    /// on a follower the leader's read index, then wait until this member has applied it.
    pub async fn read_anywhere(&self) -> Result<(), ApiError> {
        if self.consensus.is_leader() {
            return self.consensus.read_index().await.map_err(|e| {
                ApiError::new(ErrorCode::NotLeader, format!("read index failed: {e}"))
            });
        }
        let Some((id, url)) = self.consensus.leader() else {
            return Err(ApiError::new(ErrorCode::NoLeader, "no leader is known"));
        };
        let url = self.peer_url(id, &url);
        let answer: api::ReadIndex = self
            .http
            .get(format!("{}{READ_INDEX}", url.trim_end_matches('/')))
            .header(PEER_HEADER, self.signer.sign("GET", READ_INDEX, b"", 0))
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .map_err(|e| {
                ApiError::new(
                    ErrorCode::NoLeader,
                    format!("leader unreachable: {}", e.without_url()),
                )
            })?
            .json()
            .await
            .map_err(|_| {
                ApiError::new(
                    ErrorCode::NoLeader,
                    "the leader did not answer the read index (or refused it)",
                )
            })?;
        let index = answer.index;
        if self
            .consensus
            .wait_for(Duration::from_secs(10), |s| s.applied_index >= index)
            .await
        {
            Ok(())
        } else {
            Err(ApiError::new(
                ErrorCode::NotCaughtUp,
                "this member has not caught up with the leader",
            ))
        }
    }

    pub async fn linearize(&self) -> Result<(), ApiError> {
        self.consensus.lease_read().await.map_err(|e| {
            ApiError::new(
                ErrorCode::NotLeader,
                format!("this member cannot serve a consistent read now: {e}"),
            )
        })?;
        // A new term's view is rebuilt before anything is judged from it.
        self.live.on_leader(self.consensus.current_term(), now_ms());
        Ok(())
    }
}
