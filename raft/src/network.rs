//! Peer RPCs (append, vote, pre-vote, full snapshot) over HTTP.
//!
//! Bodies are codec-encoded. Every request carries the signed peer header (`peer_auth`); the receiving
//! member's HTTP layer checks it before calling [`serve`]. A connection failure is reported to
//! openraft as `Unreachable` (it backs off); anything else as a network error.

use std::future::Future;
use std::io::Cursor;
use std::time::Duration;

use openraft::BasicNode;
use openraft::OptionalSend;
use openraft::RaftNetworkFactory;
use openraft::RaftNetworkV2;
use openraft::Snapshot;
use openraft::alias::SnapshotMetaOf;
use openraft::alias::SnapshotOf;
use openraft::alias::VoteOf;
use openraft::errors::NetworkError;
use openraft::errors::RPCError;
use openraft::errors::ReplicationClosed;
use openraft::errors::StreamingError;
use openraft::errors::Unreachable;
use openraft::network::RPCOption;
use openraft::raft::AppendEntriesRequest;
use openraft::raft::AppendEntriesResponse;
use openraft::raft::SnapshotResponse;
use openraft::raft::VoteRequest;
use openraft::raft::VoteResponse;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::Application;
use crate::Raft;
use crate::TypeConfig;
use crate::codec;
use crate::peer_auth::PeerSigner;

type C = TypeConfig;

/// The header that carries the peer credential on every member-to-member call.
pub const PEER_HEADER: &str = "x-modelforge-peer";
/// Path prefix of the peer RPC endpoints.
pub const RPC_PREFIX: &str = "/internal/v1/raft/";

/// Creates peer clients; all share one HTTP connection pool.
#[derive(Clone)]
pub struct PeerNetwork {
    http: reqwest::Client,
    signer: PeerSigner,
    /// Per-member overrides of the URL this member uses to reach a peer (a route through a
    /// NAT, a proxy, or the chaos suite's fault-injecting proxies); others use the advertised URL.
    routes: std::sync::Arc<std::collections::BTreeMap<u64, String>>,
}

impl PeerNetwork {
    /// `signer` signs [`PEER_HEADER`] on every call (see [`crate::peer_auth`]); `http` is the
    /// member's peer client (its TLS settings: the cluster CA and the member's certificate).
    pub fn new(
        signer: PeerSigner,
        routes: std::collections::BTreeMap<u64, String>,
        http: reqwest::Client,
    ) -> Self {
        Self {
            http,
            signer,
            routes: std::sync::Arc::new(routes),
        }
    }
}

impl RaftNetworkFactory<C> for PeerNetwork {
    type Network = PeerClient;

    async fn new_client(&mut self, target: u64, node: &BasicNode) -> PeerClient {
        let url = self.routes.get(&target).unwrap_or(&node.addr);
        PeerClient {
            target,
            base: url.trim_end_matches('/').to_string(),
            net: self.clone(),
        }
    }
}

pub struct PeerClient {
    target: u64,
    base: String,
    net: PeerNetwork,
}

/// The least time an append RPC is given (see `append_entries`).
const APPEND_TIMEOUT_FLOOR: Duration = Duration::from_secs(1);

impl PeerClient {
    async fn call<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        kind: &str,
        req: &Req,
        timeout: Duration,
    ) -> Result<Resp, RPCError<C>> {
        let body = codec::encode(req).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        let path = format!("{RPC_PREFIX}{kind}");
        let url = format!("{}{path}", self.base);
        let resp = self
            .net
            .http
            .post(&url)
            .header(PEER_HEADER, self.net.signer.sign("POST", &path, &body, 0))
            .header("content-type", "application/octet-stream")
            .timeout(timeout)
            .body(body)
            .send()
            .await
            .map_err(|e| {
                if e.is_connect() {
                    RPCError::Unreachable(Unreachable::new(&e))
                } else {
                    RPCError::Network(NetworkError::new(&e))
                }
            })?;
        let status = resp.status();
        let bytes = resp
            .bytes()
            .await
            .map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        if !status.is_success() {
            let text = String::from_utf8_lossy(&bytes);
            let msg = format!(
                "peer {} answered {status} to {kind}: {}",
                self.target,
                text.chars().take(200).collect::<String>()
            );
            return Err(RPCError::Network(NetworkError::from_string(msg)));
        }
        codec::decode(&bytes).map_err(|e| RPCError::Network(NetworkError::new(&e)))
    }
}

impl RaftNetworkV2<C> for PeerClient {
    type SnapshotData = Cursor<Vec<u8>>;

    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<C>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<C>, RPCError<C>> {
        // openraft's budget for an append is the heartbeat interval (50 ms, so 37 ms soft):
        // a follower that takes longer (an fsync and 300 entries on a loaded machine) had its
        // answer thrown away and the batch sent again, a retry storm that stalled commits
        // under an enrolment wave. The sequential stream waits for the answer instead.
        self.call("append", &rpc, option.soft_ttl().max(APPEND_TIMEOUT_FLOOR))
            .await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<C>,
        option: RPCOption,
    ) -> Result<VoteResponse<C>, RPCError<C>> {
        self.call("vote", &rpc, option.soft_ttl()).await
    }

    async fn pre_vote(
        &mut self,
        rpc: VoteRequest<C>,
        option: RPCOption,
    ) -> Result<VoteResponse<C>, RPCError<C>> {
        self.call("pre-vote", &rpc, option.soft_ttl()).await
    }

    async fn full_snapshot(
        &mut self,
        vote: VoteOf<C>,
        snapshot: SnapshotOf<C, Self::SnapshotData>,
        cancel: impl Future<Output = ReplicationClosed> + OptionalSend + 'static,
        option: RPCOption,
    ) -> Result<SnapshotResponse<C>, StreamingError<C>> {
        let req = (vote, snapshot.meta, snapshot.snapshot.into_inner());
        let timeout = option.hard_ttl().max(Duration::from_secs(10));
        tokio::select! {
            closed = cancel => Err(StreamingError::Closed(closed)),
            res = self.call("snapshot", &req, timeout) => Ok(res?),
        }
    }
}

/// Why a peer RPC could not be served.
#[derive(Debug, thiserror::Error)]
pub enum PeerRpcError {
    #[error("unknown peer rpc {0:?}")]
    Unknown(String),
    #[error("peer rpc body does not decode: {0}")]
    BadBody(codec::CodecError),
    #[error("raft refused the rpc: {0}")]
    Raft(String),
}

fn decode_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, PeerRpcError> {
    codec::decode(body).map_err(PeerRpcError::BadBody)
}

fn encode_reply<T: Serialize>(v: &T) -> Result<Vec<u8>, PeerRpcError> {
    codec::encode(v).map_err(|e| PeerRpcError::Raft(e.to_string()))
}

/// A peer RPC, decoded (bounded: see `codec`) and not yet served.
pub enum PeerRpc {
    Append(AppendEntriesRequest<C>),
    Vote(VoteRequest<C>),
    PreVote(VoteRequest<C>),
    Snapshot(VoteOf<C>, SnapshotMetaOf<C>, Vec<u8>),
}

/// Decode the body of a peer RPC of kind `kind`. Any bytes: an error, never a panic.
pub fn decode_rpc(kind: &str, body: &[u8]) -> Result<PeerRpc, PeerRpcError> {
    Ok(match kind {
        "append" => PeerRpc::Append(decode_body(body)?),
        "vote" => PeerRpc::Vote(decode_body(body)?),
        "pre-vote" => PeerRpc::PreVote(decode_body(body)?),
        "snapshot" => {
            let (vote, meta, data) = decode_body(body)?;
            PeerRpc::Snapshot(vote, meta, data)
        }
        other => return Err(PeerRpcError::Unknown(other.to_string())),
    })
}

/// The kinds of peer RPC [`decode_rpc`] knows.
pub const RPC_KINDS: [&str; 4] = ["append", "vote", "pre-vote", "snapshot"];

/// Serve one peer RPC of kind `kind` against the local Raft member.
pub async fn serve<A: Application>(
    raft: &Raft<A>,
    kind: &str,
    body: &[u8],
) -> Result<Vec<u8>, PeerRpcError> {
    let raft_err = |e: &dyn std::fmt::Display| PeerRpcError::Raft(e.to_string());
    match decode_rpc(kind, body)? {
        PeerRpc::Append(req) => {
            encode_reply(&raft.append_entries(req).await.map_err(|e| raft_err(&e))?)
        }
        PeerRpc::Vote(req) => encode_reply(&raft.vote(req).await.map_err(|e| raft_err(&e))?),
        PeerRpc::PreVote(req) => encode_reply(&raft.pre_vote(req).await.map_err(|e| raft_err(&e))?),
        PeerRpc::Snapshot(vote, meta, data) => {
            let snapshot = Snapshot {
                meta,
                snapshot: Cursor::new(data),
            };
            encode_reply(
                &raft
                    .install_full_snapshot(vote, snapshot)
                    .await
                    .map_err(|e| raft_err(&e))?,
            )
        }
    }
}
