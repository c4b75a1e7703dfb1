//! Peer RPCs (append, vote, pre-vote, full snapshot) over HTTP.
//!
//! Bodies are codec-encoded. Every request carries the signed peer header (`peer_auth`); the receiving
//! member's HTTP layer checks it before calling [`serve`]. A connection failure is reported to
//! openraft as `Unreachable` (it backs off); anything else as a network error.
//!
//! A snapshot streams: its body is `u32 le length ++ codec(vote) ++ the snapshot file`, sent
//! from the file in chunks (the header signs its digest, taken in one pass over the file
//! first) and received into a file in chunks ([`receive_snapshot`]), checked against the
//! header and installed from disk ([`install_received`]). Neither side holds it in memory.

use std::future::Future;
use std::io::Cursor;
use std::path::Path;
use std::path::PathBuf;
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::TryStreamExt;
use openraft::BasicNode;
use openraft::OptionalSend;
use openraft::RaftNetworkFactory;
use openraft::RaftNetworkV2;
use openraft::Snapshot;
use openraft::alias::LogIdOf;
use openraft::alias::SnapshotMetaOf;
use openraft::alias::SnapshotOf;
use openraft::alias::VoteOf;
use openraft::base::BoxFuture;
use openraft::base::BoxStream;
use openraft::entry::RaftEntry;
use openraft::errors::NetworkError;
use openraft::errors::RPCError;
use openraft::errors::ReplicationClosed;
use openraft::errors::StreamingError;
use openraft::errors::Unreachable;
use openraft::network::RPCOption;
use openraft::raft::AppendEntriesRequest;
use openraft::raft::AppendEntriesResponse;
use openraft::raft::SnapshotResponse;
use openraft::raft::StreamAppendResult;
use openraft::raft::TransferLeaderRequest;
use openraft::raft::TransferLeaderResponse;
use openraft::raft::VoteRequest;
use openraft::raft::VoteResponse;
use serde::Serialize;
use serde::de::DeserializeOwned;
use sha2::Digest;
use tokio::io::AsyncReadExt;
use tokio::io::AsyncWriteExt;

use crate::Application;
use crate::Raft;
use crate::SnapshotData;
use crate::TypeConfig;
use crate::codec;
use crate::peer_auth::PeerSigner;

type C = TypeConfig;

/// The header that carries the peer credential on every member-to-member call.
pub const PEER_HEADER: &str = "x-modelforge-peer";
/// Path prefix of the peer RPC endpoints.
pub const RPC_PREFIX: &str = "/internal/v1/raft/";
/// The query key naming the member a Raft RPC is for (`?to=<id>`): signed with the path, and
/// refused by any other member, so one process reached under two member ids never answers
/// (or votes) for the one it is not.
pub const TO_QUERY: &str = "to";
/// The kind of the snapshot RPC, whose body streams (`{RPC_PREFIX}snapshot`).
pub const SNAPSHOT_RPC: &str = "snapshot";
/// The largest snapshot body a member receives.
pub const SNAPSHOT_MAX: u64 = 1 << 30;
/// The largest encoded vote at the head of a snapshot body.
const VOTE_MAX: usize = 4096;
/// Chunks of a snapshot body as it is read from disk.
const CHUNK: usize = 256 << 10;

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
/// How long an append that carries no entry (a commit advance) waits for the next append to
/// carry it instead (see [`PeerClient::stream_append`]).
const COMMIT_LINGER: Duration = Duration::from_millis(5);
/// The most entries one merged append carries (openraft's `max_payload_entries` default).
const MERGE_MAX_ENTRIES: usize = 300;

type AppendReq = AppendEntriesRequest<C>;
/// What `stream_append` returns: the stream of one result per RPC sent.
type AppendResults<'s> =
    BoxFuture<'s, Result<BoxStream<'s, Result<StreamAppendResult<C>, RPCError<C>>>, RPCError<C>>>;

/// The last log id `req` asks the follower to hold: its last entry's, else its `prev_log_id`.
fn last_log_id(req: &AppendReq) -> Option<LogIdOf<C>> {
    req.entries
        .last()
        .map(RaftEntry::log_id)
        .or(req.prev_log_id)
}

/// `next` joined onto `first`, where a follower answers the one request as it would the two in
/// turn: the same vote, `next` starting where `first` ends, at most `max_entries` entries in
/// all. Otherwise `first` is left as it was and `next` comes back.
fn merge_appends(
    first: &mut AppendReq,
    next: AppendReq,
    max_entries: usize,
) -> Result<(), AppendReq> {
    let joins = first.vote == next.vote
        && next.prev_log_id == last_log_id(first)
        && first.entries.len() + next.entries.len() <= max_entries;
    if !joins {
        return Err(next);
    }
    first.entries.extend(next.entries);
    first.leader_commit = first.leader_commit.max(next.leader_commit);
    Ok(())
}

/// Appends to one follower through `net`, one RPC at a time, consecutive requests merged (see
/// ARCHITECTURE, "Appends to a follower"): openraft's own sequential stream sent every commit
/// advance in an RPC of its own. One result answers every request merged into its RPC because
/// openraft (0.10.0-alpha.37, `replication/inflight_append_queue.rs`) drains its in-flight
/// requests by the log id a result matched, not one per result: check that on every upgrade.
fn merged_appends<'s, N, S>(net: &'s mut N, input: S, option: RPCOption) -> AppendResults<'s>
where
    N: RaftNetworkV2<C>,
    S: futures_util::Stream<Item = AppendReq> + OptionalSend + Unpin + 'static,
{
    Box::pin(async move {
        let start = Some((net, input, None::<AppendReq>));
        let results = futures_util::stream::unfold(start, move |state| {
            let option = option.clone();
            async move {
                let (net, mut input, held) = state?;
                let first = match held {
                    Some(req) => req,
                    None => input.next().await?,
                };
                let (req, after) = gather(&mut input, first, COMMIT_LINGER).await;
                let (prev, last) = (req.prev_log_id, last_log_id(&req));
                let resp = match net.append_entries(req, option).await {
                    Ok(resp) => resp,
                    Err(e) => return Some((Err(e), None)),
                };
                // A partial success short of the last entry ends the stream, as in openraft's
                // sequential one; openraft resumes from what was matched.
                let partial =
                    matches!(&resp, AppendEntriesResponse::PartialSuccess(m) if *m != last);
                let result = resp.into_stream_result(prev, last);
                let next = match after {
                    _ if result.is_err() || partial => None,
                    After::Ended => None,
                    After::Nothing => Some((net, input, None)),
                    After::Held(req) => Some((net, input, Some(req))),
                };
                Some((Ok(result), next))
            }
        });
        let results: BoxStream<'s, _> = Box::pin(results);
        Ok(results)
    })
}

/// What [`gather`] found after the request it returns.
#[derive(Debug)]
enum After {
    /// Nothing ready (or the linger passed).
    Nothing,
    /// A request that could not join; it goes next.
    Held(AppendReq),
    /// The input ended.
    Ended,
}

/// `first` joined with every request `input` has ready; a request without entries (a commit
/// advance) waits up to `linger` for one to join it.
async fn gather<S>(input: &mut S, first: AppendReq, linger: Duration) -> (AppendReq, After)
where
    S: futures_util::Stream<Item = AppendReq> + Unpin,
{
    use futures_util::FutureExt;
    // One deadline: commit advances that join one another do not extend the wait.
    let deadline = tokio::time::Instant::now() + linger;
    let mut req = first;
    loop {
        if req.entries.len() >= MERGE_MAX_ENTRIES {
            // Full: reading the next batch now would only hold it.
            return (req, After::Nothing);
        }
        // Polling the stream and dropping the poll keeps its state: openraft's request stream
        // is an `unfold` that holds its pending future.
        let polled = if req.entries.is_empty() {
            tokio::time::timeout_at(deadline, input.next()).await.ok()
        } else {
            input.next().now_or_never()
        };
        match polled {
            None => return (req, After::Nothing),
            Some(None) => return (req, After::Ended),
            Some(Some(next)) => match merge_appends(&mut req, next, MERGE_MAX_ENTRIES) {
                Ok(()) => {
                    crate::metrics::METRICS.appends_merged.inc();
                }
                Err(held) => return (req, After::Held(held)),
            },
        }
    }
}

impl PeerClient {
    async fn call<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        kind: &str,
        req: &Req,
        timeout: Duration,
    ) -> Result<Resp, RPCError<C>> {
        let body = codec::encode(req).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        let path = format!("{RPC_PREFIX}{kind}?{TO_QUERY}={}", self.target);
        let header = self.net.signer.sign("POST", &path, &body, 0);
        self.post(kind, &path, header, reqwest::Body::from(body), timeout)
            .await
    }

    /// POST `body` to `path` under the signed `header`; the decoded answer.
    async fn post<Resp: DeserializeOwned>(
        &self,
        kind: &str,
        path: &str,
        header: String,
        body: reqwest::Body,
        timeout: Duration,
    ) -> Result<Resp, RPCError<C>> {
        let url = format!("{}{path}", self.base);
        let resp = self
            .net
            .http
            .post(&url)
            .header(PEER_HEADER, header)
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

impl PeerClient {
    /// Stream a snapshot file to the peer (see the module's doc).
    async fn send_snapshot(
        &self,
        vote: &VoteOf<C>,
        data: &SnapshotData,
        timeout: Duration,
    ) -> Result<SnapshotResponse<C>, RPCError<C>> {
        let io_err = |e: std::io::Error| RPCError::Network(NetworkError::new(&e));
        let prefix = vote_prefix(vote).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        let file = data.reader().map_err(io_err)?;
        let head = prefix.clone();
        let (digest, file) = tokio::task::spawn_blocking(move || {
            let mut file = file;
            let digest = digest_of(&head, &mut file)?;
            std::io::Seek::seek(&mut file, std::io::SeekFrom::Start(0))?;
            Ok::<_, std::io::Error>((digest, file))
        })
        .await
        .map_err(|e| io_err(std::io::Error::other(e)))?
        .map_err(io_err)?;
        let path = format!("{RPC_PREFIX}{SNAPSHOT_RPC}?{TO_QUERY}={}", self.target);
        let header = self.net.signer.sign_digest("POST", &path, digest, 0);
        self.post(
            SNAPSHOT_RPC,
            &path,
            header,
            file_body(prefix, file),
            timeout,
        )
        .await
    }
}

/// `u32 le length ++ codec(vote)`: the head of a snapshot body.
fn vote_prefix(vote: &VoteOf<C>) -> Result<Vec<u8>, codec::CodecError> {
    let v = codec::encode(vote)?;
    let mut out = (v.len() as u32).to_le_bytes().to_vec();
    out.extend_from_slice(&v);
    Ok(out)
}

/// The head of a snapshot body as leader `node` of `term` sends it (tests forge bodies).
pub fn snapshot_head(term: u64, node: u64) -> Vec<u8> {
    vote_prefix(&VoteOf::<C>::new(term, node)).expect("a vote encodes")
}

/// The vote at the head of a snapshot body, and how many bytes it took; None while `buf` is
/// too short to tell.
fn parse_vote_prefix(buf: &[u8]) -> Result<Option<(VoteOf<C>, usize)>, PeerRpcError> {
    let Some(len) = buf.get(..4) else {
        return Ok(None);
    };
    let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
    if len > VOTE_MAX {
        return Err(PeerRpcError::Snapshot(format!(
            "the snapshot's vote claims {len} bytes"
        )));
    }
    let Some(v) = buf.get(4..4 + len) else {
        return Ok(None);
    };
    Ok(Some((decode_body(v)?, 4 + len)))
}

/// SHA-256 of `head ++ file` (read from its current position), in one pass.
fn digest_of(head: &[u8], file: &mut std::fs::File) -> std::io::Result<[u8; 32]> {
    use std::io::Read;
    let mut h = sha2::Sha256::new();
    h.update(head);
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            return Ok(h.finalize().into());
        }
        h.update(&buf[..n]);
    }
}

/// A request body of `head` then `file` from its current position, in chunks of [`CHUNK`].
fn file_body(head: Vec<u8>, file: std::fs::File) -> reqwest::Body {
    let head = futures_util::stream::once(async move { Ok(bytes::Bytes::from(head)) });
    let rest =
        futures_util::stream::try_unfold(tokio::fs::File::from_std(file), |mut f| async move {
            let mut buf = vec![0u8; CHUNK];
            let n = f.read(&mut buf).await?;
            if n == 0 {
                return Ok::<_, std::io::Error>(None);
            }
            buf.truncate(n);
            Ok(Some((bytes::Bytes::from(buf), f)))
        });
    let frames = head.chain(rest).map_ok(http_body::Frame::data);
    reqwest::Body::wrap(http_body_util::StreamBody::new(frames))
}

impl RaftNetworkV2<C> for PeerClient {
    type SnapshotData = SnapshotData;

    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<C>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<C>, RPCError<C>> {
        // openraft's budget for an append is the heartbeat interval (50 ms, so 37 ms soft):
        // a follower that takes longer (an fsync and 300 entries on a loaded machine) had its
        // answer thrown away and the batch sent again, a retry storm that stalled commits
        // under an enrolment wave. The sequential stream waits for the answer instead.
        crate::metrics::METRICS.appends_sent.inc();
        self.call("append", &rpc, option.soft_ttl().max(APPEND_TIMEOUT_FLOOR))
            .await
    }

    fn stream_append<'s, S>(
        &'s mut self,
        input: S,
        option: RPCOption,
    ) -> BoxFuture<'s, Result<BoxStream<'s, Result<StreamAppendResult<C>, RPCError<C>>>, RPCError<C>>>
    where
        S: futures_util::Stream<Item = AppendReq> + OptionalSend + Unpin + 'static,
    {
        merged_appends(self, input, option)
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

    /// A leader handing over (`Consensus::transfer_leadership`) tells every member, the
    /// target first among them: the target campaigns at once and the others grant it their
    /// vote despite their leases. (openraft's default answers "unreachable", which left the
    /// old leader refusing reads and writes until a follower's timer ran out and any member,
    /// not the target, was elected.)
    async fn transfer_leader(
        &mut self,
        req: TransferLeaderRequest<C>,
        option: RPCOption,
    ) -> Result<TransferLeaderResponse<C>, RPCError<C>> {
        self.call("transfer-leader", &req, option.soft_ttl()).await
    }

    async fn full_snapshot(
        &mut self,
        vote: VoteOf<C>,
        snapshot: SnapshotOf<C, Self::SnapshotData>,
        cancel: impl Future<Output = ReplicationClosed> + OptionalSend + 'static,
        option: RPCOption,
    ) -> Result<SnapshotResponse<C>, StreamingError<C>> {
        let timeout = option.hard_ttl().max(Duration::from_secs(10));
        tokio::select! {
            closed = cancel => Err(StreamingError::Closed(closed)),
            res = self.send_snapshot(&vote, &snapshot.snapshot, timeout) => Ok(res?),
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
    #[error("the snapshot body is over {SNAPSHOT_MAX} bytes")]
    TooLarge,
    #[error("the snapshot does not check: {0}")]
    Snapshot(String),
    #[error("the snapshot could not be received: {0}")]
    Io(String),
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
    TransferLeader(TransferLeaderRequest<C>),
    /// A whole snapshot body: its vote, and its file's meta and length once checked (served
    /// through [`receive_snapshot`], which streams; decoded whole only here, for the fuzzer).
    Snapshot(VoteOf<C>, SnapshotMetaOf<C>, u64),
}

/// Decode the body of a peer RPC of kind `kind`. Any bytes: an error, never a panic.
pub fn decode_rpc(kind: &str, body: &[u8]) -> Result<PeerRpc, PeerRpcError> {
    Ok(match kind {
        "append" => PeerRpc::Append(decode_body(body)?),
        "vote" => PeerRpc::Vote(decode_body(body)?),
        "pre-vote" => PeerRpc::PreVote(decode_body(body)?),
        "transfer-leader" => PeerRpc::TransferLeader(decode_body(body)?),
        SNAPSHOT_RPC => {
            let Some((vote, used)) = parse_vote_prefix(body)? else {
                return Err(PeerRpcError::Snapshot(
                    "the body ends inside its vote".into(),
                ));
            };
            let mut file = Cursor::new(&body[used..]);
            let snapshot_err = |e: std::io::Error| PeerRpcError::Snapshot(e.to_string());
            let (meta, len) =
                crate::state_machine::check_snapshot(&mut file).map_err(snapshot_err)?;
            crate::state_machine::read_snapshot(&mut file, len).map_err(snapshot_err)?;
            PeerRpc::Snapshot(vote, meta, len)
        }
        other => return Err(PeerRpcError::Unknown(other.to_string())),
    })
}

/// The kinds of peer RPC [`decode_rpc`] knows.
pub const RPC_KINDS: [&str; 5] = ["append", "vote", "pre-vote", "transfer-leader", "snapshot"];

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
        PeerRpc::TransferLeader(req) => encode_reply(
            &raft
                .handle_transfer_leader(req)
                .await
                .map_err(|e| raft_err(&e))?,
        ),
        PeerRpc::Snapshot(..) => Err(PeerRpcError::Unknown(
            "snapshot bodies stream: Consensus::receive_snapshot".into(),
        )),
    }
}

/// A snapshot streamed in from the leader: on disk in the member's dir, not installed yet
/// (dropped, its file is removed).
pub struct ReceivedSnapshot {
    vote: Option<VoteOf<C>>,
    /// Why the body is no snapshot body (found while it streamed in; reported only after the
    /// caller has checked the body is the signed one).
    invalid: Option<String>,
    path: Option<PathBuf>,
    body_sha256: [u8; 32],
    bytes: u64,
}

impl ReceivedSnapshot {
    /// SHA-256 of the whole body as received (to compare with the signed peer header).
    pub fn body_sha256(&self) -> [u8; 32] {
        self.body_sha256
    }

    /// Bytes of the body.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for ReceivedSnapshot {
    fn drop(&mut self) {
        if let Some(p) = self.path.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Receive a snapshot body into `<dir>/snapshot.incoming.<random>` as it streams in: the vote
/// parsed from its head, the rest written through a buffer, the whole hashed; at most `max`
/// bytes. Memory: one chunk and the buffer, whatever the snapshot's size. A head that does not
/// parse stops the writing but not the hashing: the caller first checks the body is the one
/// its header signed, and [`install_received`] then refuses it.
pub async fn receive_snapshot<S, E>(
    dir: &Path,
    mut body: S,
    max: u64,
) -> Result<ReceivedSnapshot, PeerRpcError>
where
    S: futures_util::Stream<Item = Result<bytes::Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    let io = |e: std::io::Error| PeerRpcError::Io(e.to_string());
    let nonce: [u8; 8] = modelforge_proto::random_bytes();
    let name = modelforge_proto::hex(&nonce);
    let path = dir.join(format!("{}{name}", crate::state_machine::INCOMING_PREFIX));
    let file = tokio::fs::File::create(&path).await.map_err(io)?;
    let mut received = ReceivedSnapshot {
        vote: None,
        invalid: None,
        path: Some(path),
        body_sha256: [0; 32],
        bytes: 0,
    };
    let mut out = tokio::io::BufWriter::with_capacity(1 << 20, file);
    let mut hasher = sha2::Sha256::new();
    let mut head: Option<Vec<u8>> = Some(vec![]);
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|e| PeerRpcError::Io(e.to_string()))?;
        received.bytes += chunk.len() as u64;
        if received.bytes > max {
            return Err(PeerRpcError::TooLarge);
        }
        hasher.update(&chunk);
        if received.invalid.is_some() {
            continue;
        }
        match head.as_mut() {
            None => out.write_all(&chunk).await.map_err(io)?,
            Some(h) => {
                h.extend_from_slice(&chunk);
                match parse_vote_prefix(h) {
                    Ok(None) => {}
                    Ok(Some((vote, used))) => {
                        received.vote = Some(vote);
                        out.write_all(&h[used..]).await.map_err(io)?;
                        head = None;
                    }
                    Err(e) => received.invalid = Some(e.to_string()),
                }
            }
        }
    }
    if head.is_some() && received.invalid.is_none() {
        received.invalid = Some("the body ends inside its vote".into());
    }
    out.flush().await.map_err(io)?;
    received.body_sha256 = hasher.finalize().into();
    Ok(received)
}

/// Install a received snapshot: its file checked (checksum, meta) in bounded memory, then
/// handed to openraft, which installs it from disk (see `state_machine`).
pub async fn install_received<A: Application>(
    raft: &Raft<A>,
    mut received: ReceivedSnapshot,
) -> Result<Vec<u8>, PeerRpcError> {
    if let Some(why) = received.invalid.take() {
        return Err(PeerRpcError::Snapshot(why));
    }
    let path = received
        .path
        .take()
        .ok_or_else(|| PeerRpcError::Io("the snapshot was installed already".into()))?;
    let (meta, data) = tokio::task::spawn_blocking(move || SnapshotData::received(path))
        .await
        .map_err(|e| PeerRpcError::Io(e.to_string()))?
        .map_err(|e| PeerRpcError::Snapshot(e.to_string()))?;
    let vote = received
        .vote
        .ok_or_else(|| PeerRpcError::Snapshot("the body ends inside its vote".into()))?;
    let answer = raft
        .install_full_snapshot(
            vote,
            Snapshot {
                meta,
                snapshot: data,
            },
        )
        .await
        .map_err(|e| PeerRpcError::Raft(e.to_string()))?;
    encode_reply(&answer)
}

#[cfg(test)]
mod tests {
    use openraft::testing::blank_ent;
    use openraft::testing::log_id;
    use tokio::sync::mpsc;

    use super::*;

    /// An append of entries `from..=to` (none when `to < from`) after `from - 1`, in term
    /// `term`, carrying commit `commit`.
    fn append(term: u64, from: u64, to: u64, commit: u64) -> AppendReq {
        AppendEntriesRequest {
            vote: VoteOf::<C>::new(term, 1),
            prev_log_id: Some(log_id::<C>(1, 1, from - 1)),
            entries: (from..=to).map(|i| blank_ent::<C>(1, 1, i)).collect(),
            leader_commit: Some(log_id::<C>(1, 1, commit)),
        }
    }

    type Shape = (VoteOf<C>, Option<LogIdOf<C>>, Vec<u64>, Option<LogIdOf<C>>);

    /// What a follower is asked: vote, prev log id, the entries' indexes, commit.
    fn shape(req: &AppendReq) -> Shape {
        let indexes = req.entries.iter().map(|e| e.log_id().index).collect();
        (req.vote, req.prev_log_id, indexes, req.leader_commit)
    }

    /// A request stream fed by the returned sender; each poll that finds nothing says so on the
    /// returned receiver (so a test sends only once `gather` waits).
    fn requests() -> (
        mpsc::UnboundedSender<AppendReq>,
        mpsc::UnboundedReceiver<()>,
        impl futures_util::Stream<Item = AppendReq> + Unpin,
    ) {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let (waiting_tx, waiting) = mpsc::unbounded_channel();
        let stream = futures_util::stream::poll_fn(move |cx| {
            let polled = rx.poll_recv(cx);
            if polled.is_pending() {
                let _ = waiting_tx.send(());
            }
            polled
        });
        (tx, waiting, stream)
    }

    #[test]
    fn consecutive_appends_merge_into_one() {
        let merged = |mut first: AppendReq, next: AppendReq| {
            merge_appends(&mut first, next, 300).unwrap();
            first
        };
        let m = merged(append(1, 2, 3, 1), append(1, 4, 4, 3));
        assert_eq!(m.prev_log_id, Some(log_id::<C>(1, 1, 1)));
        assert_eq!(shape(&m).2, [2, 3, 4]);
        assert_eq!(m.leader_commit, Some(log_id::<C>(1, 1, 3)));
        // A commit advance after entries, and entries after a commit advance.
        let m = merged(append(1, 2, 3, 1), append(1, 4, 3, 3));
        assert_eq!(m.entries.len(), 2);
        assert_eq!(m.leader_commit, Some(log_id::<C>(1, 1, 3)));
        let m = merged(append(1, 4, 3, 3), append(1, 4, 5, 3));
        assert_eq!(m.prev_log_id, Some(log_id::<C>(1, 1, 3)));
        assert_eq!(m.entries.len(), 2);
    }

    #[test]
    fn appends_that_do_not_follow_on_stay_apart() {
        let cases = [
            ("a gap", append(1, 2, 3, 1), append(1, 5, 5, 1), 300),
            ("an overlap", append(1, 2, 3, 1), append(1, 3, 4, 1), 300),
            ("another vote", append(1, 2, 3, 1), append(2, 4, 4, 1), 300),
            ("over the cap", append(1, 2, 3, 1), append(1, 4, 4, 1), 2),
        ];
        for (what, first, next, cap) in cases {
            let (a, b) = (shape(&first), shape(&next));
            let mut first = first;
            let Err(back) = merge_appends(&mut first, next, cap) else {
                panic!("{what}: merged");
            };
            assert_eq!((shape(&first), shape(&back)), (a, b), "{what}: changed");
        }
    }

    /// Requests already generated join the first; one that cannot join is held for next.
    #[tokio::test]
    async fn ready_appends_join_and_the_first_misfit_is_held() {
        let (tx, _waiting, mut input) = requests();
        tx.send(append(1, 4, 4, 2)).unwrap();
        tx.send(append(1, 5, 4, 3)).unwrap();
        tx.send(append(2, 5, 5, 3)).unwrap();
        let gathered = gather(&mut input, append(1, 2, 3, 1), Duration::from_secs(3600));
        let (req, after) = tokio::time::timeout(Duration::from_secs(10), gathered)
            .await
            .expect("ready appends waited for more");
        assert_eq!(req.entries.len(), 3);
        assert_eq!(req.leader_commit, Some(log_id::<C>(1, 1, 3)));
        let After::Held(held) = after else {
            panic!("nothing held: {after:?}");
        };
        assert_eq!(shape(&held), shape(&append(2, 5, 5, 3)));
    }

    /// A full append goes as it is; the next one stays in the stream, unread.
    #[tokio::test]
    async fn a_full_append_reads_no_further() {
        let (tx, _waiting, mut input) = requests();
        let full = MERGE_MAX_ENTRIES as u64;
        tx.send(append(1, full + 2, full + 2, 1)).unwrap();
        let (req, after) = gather(&mut input, append(1, 2, full + 1, 1), COMMIT_LINGER).await;
        assert_eq!(req.entries.len(), MERGE_MAX_ENTRIES);
        assert!(matches!(after, After::Nothing), "{after:?}");
        let next = input.next().await.expect("the next append was read");
        assert_eq!(shape(&next).2, [full + 2]);
    }

    /// An append with entries never waits for more (a linger of an hour would hang the test).
    #[tokio::test]
    async fn an_append_with_entries_goes_at_once() {
        let (_tx, _waiting, mut input) = requests();
        let gathered = gather(&mut input, append(1, 2, 3, 1), Duration::from_secs(3600));
        let (req, after) = tokio::time::timeout(Duration::from_secs(10), gathered)
            .await
            .expect("an append with entries waited");
        assert_eq!(req.entries.len(), 2);
        assert!(matches!(after, After::Nothing), "{after:?}");
    }

    /// A commit advance waits for the next append and rides along with it: one RPC, not two.
    #[tokio::test]
    async fn a_commit_advance_waits_for_the_next_append() {
        let (tx, mut waiting, mut input) = requests();
        let sender = tokio::spawn(async move {
            waiting.recv().await;
            tx.send(append(1, 4, 4, 3)).unwrap();
            tx
        });
        let gathered = gather(&mut input, append(1, 4, 3, 3), Duration::from_secs(3600));
        let (req, after) = tokio::time::timeout(Duration::from_secs(10), gathered)
            .await
            .expect("the next append never joined the commit advance");
        assert_eq!(req.entries.len(), 1, "the commit advance went alone");
        assert_eq!(req.prev_log_id, Some(log_id::<C>(1, 1, 3)));
        assert!(matches!(after, After::Nothing), "{after:?}");
        drop(sender.await.unwrap());
    }

    /// With nothing to ride on, a commit advance goes alone once the linger passes; an ended
    /// input is reported.
    #[tokio::test]
    async fn a_commit_advance_goes_alone_after_the_linger() {
        let (tx, _waiting, mut input) = requests();
        let linger = Duration::from_millis(20);
        let started = std::time::Instant::now();
        let (req, after) = gather(&mut input, append(1, 4, 3, 3), linger).await;
        assert!(started.elapsed() >= linger);
        assert_eq!(shape(&req), shape(&append(1, 4, 3, 3)));
        assert!(matches!(after, After::Nothing), "{after:?}");
        drop(tx);
        let (_, after) = gather(&mut input, append(1, 4, 3, 3), linger).await;
        assert!(matches!(after, After::Ended), "{after:?}");
    }

    fn chunks(
        body: &[u8],
        size: usize,
    ) -> impl futures_util::Stream<Item = Result<bytes::Bytes, std::io::Error>> + Unpin {
        let parts: Vec<Result<bytes::Bytes, std::io::Error>> = body
            .chunks(size)
            .map(|c| Ok(bytes::Bytes::copy_from_slice(c)))
            .collect();
        futures_util::stream::iter(parts)
    }

    fn incoming(dir: &Path) -> usize {
        std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .filter(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with(crate::state_machine::INCOMING_PREFIX)
            })
            .count()
    }

    /// A body arriving in chunks of 3 bytes (its vote split across them) lands on disk as the
    /// snapshot file alone, hashed whole; dropped uninstalled, the file is removed.
    #[tokio::test]
    async fn a_snapshot_body_streams_to_a_file_in_chunks() {
        let dir = tempfile::tempdir().unwrap();
        let mut body = snapshot_head(3, 2);
        let head = body.len();
        body.extend((0..100_000u32).map(|i| (i % 251) as u8));
        let r = receive_snapshot(dir.path(), chunks(&body, 3), 1 << 20)
            .await
            .unwrap();
        assert_eq!(r.bytes(), body.len() as u64);
        let digest: [u8; 32] = sha2::Sha256::digest(&body).into();
        assert_eq!(r.body_sha256(), digest);
        assert_eq!(r.vote, Some(VoteOf::<C>::new(3, 2)));
        let path = r.path.clone().unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), body[head..]);
        drop(r);
        assert_eq!(incoming(dir.path()), 0);
    }

    /// Over the cap, cut inside the vote, or a vote claiming more than a vote can be: refused,
    /// and no file is left behind.
    #[tokio::test]
    async fn an_oversized_or_truncated_snapshot_body_is_refused_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        let mut body = snapshot_head(1, 1);
        body.extend(vec![0u8; 10_000]);
        let e = receive_snapshot(dir.path(), chunks(&body, 1000), 5_000).await;
        assert!(matches!(e, Err(PeerRpcError::TooLarge)));
        let head = snapshot_head(1, 1);
        let r = receive_snapshot(dir.path(), chunks(&head[..head.len() - 1], 2), 5_000)
            .await
            .unwrap();
        assert!(r.invalid.as_deref().unwrap().contains("inside its vote"));
        drop(r);
        let mut huge = (1u32 << 30).to_le_bytes().to_vec();
        huge.extend(vec![0u8; 64]);
        let r = receive_snapshot(dir.path(), chunks(&huge, 8), 5_000)
            .await
            .unwrap();
        // Hashed whole all the same, for the caller's check against the signed header.
        let digest: [u8; 32] = sha2::Sha256::digest(&huge).into();
        assert_eq!(r.body_sha256(), digest);
        assert!(r.invalid.as_deref().unwrap().contains("claims"));
        drop(r);
        assert_eq!(incoming(dir.path()), 0);
    }
}
