//! Heartbeats relayed in batches: a follower sends the agents' heartbeats it holds to the
//! leader in one signed peer call instead of one HTTP exchange each (ARCHITECTURE, "Heartbeats
//! relay in batches"). The leader decides every item exactly as a heartbeat sent to it.

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::extract::Request;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::http::HeaderValue;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::response::Response;
use modelforge_proto::api::ErrorCode;
use serde::Deserialize;
use serde::Serialize;
use tokio::sync::mpsc;
use tokio::sync::oneshot;

use modelforge_raft::codec;

use super::Shared;
use super::extract::ClientAddr;
use super::forward::Relayed;
use crate::error::ApiError;

/// The peer route the leader answers batches on.
pub const HEARTBEATS: &str = "/internal/v1/heartbeats";
/// The most heartbeats in one batch.
const MAX_BATCH: usize = 512;
/// Batches in flight to the leader at once; beside another, only a full one goes ([`batches`]).
const IN_FLIGHT: usize = 4;
/// Heartbeats of a batch decided in one task.
const CHUNK: usize = 16;
/// How long heartbeats answered "leadership is moving" wait before they go again.
const RETRY_PAUSE: Duration = Duration::from_millis(100);
/// Heartbeats waiting for a batch; beyond it a heartbeat is shed like one over capacity.
const QUEUE: usize = 16_384;

/// One agent's heartbeat as the follower received it.
#[derive(Clone, Serialize, Deserialize)]
struct Item {
    /// The node id of the path, unparsed (the leader checks it as it checks a path).
    node_id: String,
    /// The `Authorization` header's bytes, if any.
    #[serde(with = "raw_bytes::option")]
    authorization: Option<Vec<u8>>,
    /// The agent's address (trusted by the leader only from a member's certificate).
    client: IpAddr,
    /// The request body, as received (JSON is UTF-8; any other body is refused where it
    /// arrives, as the leader would refuse it).
    body: String,
    /// The id the agent's request got on the member that received it.
    request_id: Option<String>,
}

/// The leader's answer to one item.
#[derive(Serialize, Deserialize)]
struct Answer {
    status: u16,
    retry_after: Option<u64>,
    #[serde(with = "raw_bytes")]
    body: Vec<u8>,
}

struct Waiting {
    item: Item,
    reply: oneshot::Sender<Answer>,
}

/// The queue of heartbeats this member relays; drained by [`run`].
pub struct HeartbeatRelay {
    tx: mpsc::Sender<Waiting>,
    rx: std::sync::Mutex<Option<mpsc::Receiver<Waiting>>>,
}

impl Default for HeartbeatRelay {
    fn default() -> Self {
        let (tx, rx) = mpsc::channel(QUEUE);
        HeartbeatRelay {
            tx,
            rx: std::sync::Mutex::new(Some(rx)),
        }
    }
}

/// Whether `req` is an agent's heartbeat (`POST /api/v1/agent/nodes/{id}/heartbeat`).
pub fn is_heartbeat(req: &Request) -> bool {
    req.method() == axum::http::Method::POST
        && heartbeat_node(req.uri().path()).is_some()
        && req.uri().query().is_none()
}

fn heartbeat_node(path: &str) -> Option<&str> {
    let id = path
        .strip_prefix("/api/v1/agent/nodes/")?
        .strip_suffix("/heartbeat")?;
    (!id.is_empty() && !id.contains('/')).then_some(id)
}

/// Queue an agent's heartbeat for the leader and answer what the leader answered.
pub async fn relay(ctx: &Shared, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, ctx.cfg.max_body_bytes).await else {
        return ApiError::too_large().into_response();
    };
    // The body's buffer becomes the item's: reused when nothing else shares it, else copied
    // once (as `to_vec` always did).
    let body = match String::from_utf8(Vec::from(bytes)) {
        Ok(body) => body,
        Err(e) => {
            let bytes = e.into_bytes();
            return match super::extract::parse_json::<modelforge_proto::wire::Telemetry>(&bytes) {
                Err(e) => e.into_response(),
                Ok(_) => {
                    ApiError::new(ErrorCode::InvalidJson, "the request body is not valid JSON")
                        .into_response()
                }
            };
        }
    };
    let item = Item {
        node_id: heartbeat_node(parts.uri.path())
            .unwrap_or_default()
            .to_string(),
        authorization: parts
            .headers
            .get(axum::http::header::AUTHORIZATION)
            .map(|v| v.as_bytes().to_vec()),
        client: ClientAddr::of(&parts.extensions, &parts.headers).0,
        body,
        request_id: super::observe::current_request_id(),
    };
    let (reply, answer) = oneshot::channel();
    if ctx.heartbeats.tx.try_send(Waiting { item, reply }).is_err() {
        ctx.checks
            .shed
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        return ApiError::over_capacity(ctx.shed_backoff.shed(1)).into_response();
    }
    match answer.await {
        Ok(a) => into_response(a),
        Err(_) => {
            ApiError::new(ErrorCode::NoLeader, "the member is stopping; retry").into_response()
        }
    }
}

fn into_response(a: Answer) -> Response {
    let status = StatusCode::from_u16(a.status).unwrap_or(StatusCode::BAD_GATEWAY);
    let mut resp = (status, a.body).into_response();
    let h = resp.headers_mut();
    h.insert(
        axum::http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Some(s) = a.retry_after {
        h.insert(axum::http::header::RETRY_AFTER, HeaderValue::from(s));
    }
    resp
}

/// Drain the queue into batches sent to the leader ([`batches`]).
pub(super) async fn run(ctx: Shared) {
    let Some(rx) = ctx.heartbeats.rx.lock().ok().and_then(|mut r| r.take()) else {
        return;
    };
    batches(rx, MAX_BATCH, IN_FLIGHT, move |batch| {
        let ctx = ctx.clone();
        async move {
            ctx.metrics.relay_batch_size.observe(batch.len() as f64);
            send(&ctx, batch).await;
        }
    })
    .await;
}

/// The batching rule: what is queued goes at once when no batch is in flight; while some are,
/// the next batch keeps gathering until they have all come back or it holds `max` items, and
/// only a full batch goes beside others (at most `in_flight` at once). So a batch goes alone
/// when the leader keeps up and fills behind the one in flight when it does not: each peer
/// call costs both members the same whatever it carries. Returns when the queue closes.
async fn batches<T, F, Fut>(mut rx: mpsc::Receiver<T>, max: usize, in_flight: usize, send: F)
where
    T: Send + 'static,
    F: Fn(Vec<T>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    /// Counts a batch in flight until its send ends, however it ends.
    struct Flying(Arc<(AtomicUsize, tokio::sync::Notify)>);
    impl Drop for Flying {
        fn drop(&mut self) {
            self.0.0.fetch_sub(1, Ordering::AcqRel);
            // One waiter (the loop below); a permit stored when it is not waiting yet.
            self.0.1.notify_one();
        }
    }
    let flying = Arc::new((AtomicUsize::new(0), tokio::sync::Notify::new()));
    let count = |f: &Arc<(AtomicUsize, tokio::sync::Notify)>| f.0.load(Ordering::Acquire);
    loop {
        while count(&flying) >= in_flight {
            flying.1.notified().await;
        }
        let Some(first) = rx.recv().await else {
            return;
        };
        let mut batch = vec![first];
        loop {
            while batch.len() < max {
                match rx.try_recv() {
                    Ok(w) => batch.push(w),
                    Err(_) => break,
                }
            }
            if batch.len() >= max || count(&flying) == 0 {
                break;
            }
            tokio::select! {
                w = rx.recv() => match w {
                    Some(w) => batch.push(w),
                    None => break,
                },
                () = flying.1.notified() => {}
            }
        }
        flying.0.fetch_add(1, Ordering::AcqRel);
        let guard = Flying(flying.clone());
        let fut = send(batch);
        tokio::spawn(async move {
            fut.await;
            drop(guard);
        });
    }
}

/// Send one batch to the leader (or decide it here, if this member leads now) and hand each
/// waiting heartbeat its answer. Heartbeats the leader answered 503 because leadership is moving
/// (a new leader whose term cannot serve yet) go again, once leadership settles, within the
/// wait a relayed request gets (`forward::LEADER_WAIT`): a heartbeat is safe to resend.
async fn send(ctx: &Shared, batch: Vec<Waiting>) {
    let deadline = tokio::time::Instant::now() + super::forward::LEADER_WAIT;
    let (mut items, mut replies): (Vec<Item>, Vec<_>) = batch
        .into_iter()
        .map(|w| {
            let id = w.item.request_id.clone();
            (w.item, (w.reply, id))
        })
        .unzip();
    loop {
        let answers = match ctx.consensus.leader() {
            Some((id, _)) if id == ctx.cfg.node_id && ctx.consensus.is_leader() => {
                decide(ctx, items.clone()).await
            }
            _ => to_leader(ctx, &items).await,
        };
        let answers = match answers {
            Ok(answers) if answers.len() == replies.len() => answers,
            Ok(_) => {
                let e = ApiError::new(
                    ErrorCode::NoLeader,
                    "the leader's answer did not match; retry",
                );
                return answer_all(replies, e.into_response()).await;
            }
            Err(resp) => return answer_all(replies, resp).await,
        };
        let again = tokio::time::Instant::now() < deadline;
        let (mut retry_items, mut retry_replies) = (vec![], vec![]);
        for ((item, reply), a) in items.into_iter().zip(replies).zip(answers) {
            if again && a.status == 503 && super::forward::leadership_moving(&a.body) {
                retry_items.push(item);
                retry_replies.push(reply);
            } else {
                let _ = reply.0.send(a);
            }
        }
        if retry_items.is_empty() {
            return;
        }
        (items, replies) = (retry_items, retry_replies);
        tokio::time::sleep(RETRY_PAUSE).await;
    }
}

/// One answer for every item of a batch (the leader refused it whole, or could not be
/// reached), each error body under its own request's id.
async fn answer_all(replies: Vec<(oneshot::Sender<Answer>, Option<String>)>, resp: Response) {
    let a = answer_of(resp).await;
    let error: Option<modelforge_proto::wire::ErrorBody> = serde_json::from_slice(&a.body).ok();
    for (reply, id) in replies {
        let body = match &error {
            Some(e) => {
                let mut e = e.clone();
                e.error.request_id = id;
                serde_json::to_vec(&e).unwrap_or_else(|_| a.body.clone())
            }
            None => a.body.clone(),
        };
        let _ = reply.send(Answer {
            status: a.status,
            retry_after: a.retry_after,
            body,
        });
    }
}

async fn to_leader(ctx: &Shared, items: &[Item]) -> Result<Vec<Answer>, Response> {
    let body =
        codec::encode(&items).map_err(|e| ApiError::internal(e.to_string()).into_response())?;
    let leader = match super::forward::current_leader(ctx)
        .await
        .filter(|(id, _)| *id != ctx.cfg.node_id)
    {
        Some(l) => l,
        None => {
            return Err(ApiError::new(
                ErrorCode::NoLeader,
                "the cluster has no leader now; retry shortly",
            )
            .into_response());
        }
    };
    let req = Relayed {
        method: reqwest::Method::POST,
        path: HEARTBEATS.to_string(),
        headers: HeaderMap::new(),
        body: body.into(),
        hops: 1,
        client: IpAddr::from([0, 0, 0, 0]),
        resendable: true,
        blocking: Duration::ZERO,
    };
    let resp = super::forward::send_to_leader(
        &**ctx,
        &ctx.http,
        &ctx.signer,
        &req,
        leader,
        super::forward::LEADER_WAIT,
    )
    .await
    .map_err(IntoResponse::into_response)?;
    if resp.status() != StatusCode::OK {
        return Err(resp);
    }
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .map_err(|_| {
            ApiError::new(ErrorCode::NoLeader, "the leader's answer was cut; retry").into_response()
        })?;
    codec::decode(&bytes).map_err(|_| {
        ApiError::new(
            ErrorCode::NoLeader,
            "the leader's answer could not be read; retry",
        )
        .into_response()
    })
}

/// `POST /internal/v1/heartbeats`: the leader decides a batch of relayed heartbeats.
pub(super) async fn peer_heartbeats(
    State(ctx): State<Shared>,
    req: Request,
) -> Result<Response, ApiError> {
    let (parts, body) = req.into_parts();
    // The agents' addresses are trusted only from a member's certificate; without TLS the
    // batch counts against the relaying member's address, as a relayed request does.
    let trusted = parts
        .extensions
        .get::<axum::extract::ConnectInfo<crate::tls::ConnPeer>>()
        .is_some_and(|c| c.0.member.is_some());
    let relayer = ClientAddr::of(&parts.extensions, &HeaderMap::new()).0;
    let bytes = axum::body::to_bytes(body, usize::MAX)
        .await
        .map_err(|_| ApiError::new(ErrorCode::BadPeerBody, "the batch could not be read"))?;
    let mut items: Vec<Item> =
        codec::decode(&bytes).map_err(|e| ApiError::new(ErrorCode::BadPeerBody, e.to_string()))?;
    if items.len() > MAX_BATCH {
        return Err(ApiError::new(
            ErrorCode::BadPeerBody,
            "too many heartbeats in one batch",
        ));
    }
    if !trusted {
        for item in &mut items {
            item.client = relayer;
        }
    }
    if !ctx.consensus.is_leader() {
        return Err(ApiError::new(
            ErrorCode::NotLeader,
            "this member no longer leads; retry",
        ));
    }
    let answers = match decide(&ctx, items).await {
        Ok(a) => a,
        Err(refused) => return Ok(refused),
    };
    let out = codec::encode(&answers).map_err(|e| ApiError::internal(e.to_string()))?;
    Ok(([("content-type", "application/octet-stream")], out).into_response())
}

/// Every item decided as a heartbeat sent to this member, concurrently, answers in order; or
/// the whole batch shed, as a direct heartbeat would be, while this member's run queue is over
/// `--shed-queue-delay` (the relaying member does not admit what it relays).
async fn decide(ctx: &Shared, items: Vec<Item>) -> Result<Vec<Answer>, Response> {
    let n = items.len() as u64;
    if ctx.queue_delay.over_target() {
        ctx.checks
            .shed
            .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        return Err(ApiError::over_capacity(ctx.shed_backoff.shed(n)).into_response());
    }
    ctx.shed_backoff.admitted(n);
    // Items run in tasks of `CHUNK` (interleaved within each): a task an item would put
    // hundreds of tasks in the runtime's queue at once, which `--shed-queue-delay` reads as
    // overload, and one task for the whole batch would hold a worker for its whole length.
    let mut items = items.into_iter();
    let mut chunks = vec![];
    loop {
        let chunk: Vec<Item> = items.by_ref().take(CHUNK).collect();
        if chunk.is_empty() {
            break;
        }
        let ctx = ctx.clone();
        chunks.push(tokio::spawn(async move {
            let each = chunk.into_iter().map(|item| decide_one(&ctx, item));
            futures_util::future::join_all(each).await
        }));
    }
    let mut answers = Vec::new();
    for chunk in chunks {
        match chunk.await {
            Ok(a) => answers.extend(a),
            Err(_) => {
                return Err(ApiError::internal("a batch could not be decided").into_response());
            }
        }
    }
    Ok(answers)
}

/// One relayed heartbeat, decided as if sent to this member, under the id its member gave it.
async fn decide_one(ctx: &Shared, item: Item) -> Answer {
    let id = item.request_id.clone();
    super::observe::with_request_id(id, async move {
        let mut headers = HeaderMap::new();
        if let Some(v) = item
            .authorization
            .and_then(|a| HeaderValue::from_bytes(&a).ok())
        {
            headers.insert(axum::http::header::AUTHORIZATION, v);
        }
        let resp = match super::extract::parse_json(item.body.as_bytes()) {
            Ok(telemetry) => super::agent::heartbeat_core(
                ctx,
                &item.node_id,
                &headers,
                ClientAddr(item.client),
                telemetry,
            )
            .await
            .unwrap_or_else(IntoResponse::into_response),
            Err(e) => e.into_response(),
        };
        answer_of(resp).await
    })
    .await
}

async fn answer_of(resp: Response) -> Answer {
    let status = resp.status().as_u16();
    let retry_after = resp
        .headers()
        .get(axum::http::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let body = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .map(|b| b.to_vec())
        .unwrap_or_default();
    Answer {
        status,
        retry_after,
        body,
    }
}

/// Byte strings on the peer wire as one slice, not as a sequence of numbers: serde's own
/// `Vec<u8>` goes through a visitor call a byte, which was 1-2% of the leader's samples with
/// heartbeats spread (docs/perf/2026-12-07-heartbeats-spread-slow-machine.svg). The bytes on
/// the wire are the same either way (bincode writes the length, then the bytes), so members of
/// either build relay to each other during a rolling upgrade.
mod raw_bytes {
    use serde::Deserializer;
    use serde::Serializer;
    use serde::de::Visitor;

    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(v)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        d.deserialize_byte_buf(Bytes)
    }

    struct Bytes;

    impl<'de> Visitor<'de> for Bytes {
        type Value = Vec<u8>;

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("bytes")
        }

        fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
            Ok(v.to_vec())
        }

        fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
            Ok(v)
        }
    }

    /// The same for an optional byte string.
    pub mod option {
        use serde::Deserializer;
        use serde::Serializer;
        use serde::de::Visitor;

        pub fn serialize<S: Serializer>(v: &Option<Vec<u8>>, s: S) -> Result<S::Ok, S::Error> {
            struct Raw<'a>(&'a [u8]);
            impl serde::Serialize for Raw<'_> {
                fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                    s.serialize_bytes(self.0)
                }
            }
            match v {
                Some(v) => s.serialize_some(&Raw(v)),
                None => s.serialize_none(),
            }
        }

        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
            d.deserialize_option(Opt)
        }

        struct Opt;

        impl<'de> Visitor<'de> for Opt {
            type Value = Option<Vec<u8>>;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("optional bytes")
            }

            fn visit_none<E: serde::de::Error>(self) -> Result<Self::Value, E> {
                Ok(None)
            }

            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
                super::deserialize(d).map(Some)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The peer wire as serde's own `Vec<u8>` writes it: what a member of the previous build
    /// sends and expects.
    #[derive(Serialize, Deserialize, PartialEq, Debug)]
    struct OldItem {
        node_id: String,
        authorization: Option<Vec<u8>>,
        client: IpAddr,
        body: String,
        request_id: Option<String>,
    }

    #[derive(Serialize, Deserialize, PartialEq, Debug)]
    struct OldAnswer {
        status: u16,
        retry_after: Option<u64>,
        body: Vec<u8>,
    }

    #[test]
    fn byte_strings_keep_the_wire_of_serdes_own_vec_and_round_trip() {
        for authorization in [None, Some(vec![]), Some(b"Bearer mfc_\xff\x00".to_vec())] {
            let old = OldItem {
                node_id: "n-1".into(),
                authorization: authorization.clone(),
                client: IpAddr::from([10, 0, 0, 7]),
                body: "{}".into(),
                request_id: Some("r-1".into()),
            };
            let new = Item {
                node_id: old.node_id.clone(),
                authorization: authorization.clone(),
                client: old.client,
                body: old.body.clone(),
                request_id: old.request_id.clone(),
            };
            // A batch goes as a slice (`to_leader`), a sequence with its length.
            let bytes = codec::encode(std::slice::from_ref(&new)).unwrap();
            assert_eq!(bytes, codec::encode(std::slice::from_ref(&old)).unwrap());
            let back: Vec<Item> = codec::decode(&bytes).unwrap();
            assert_eq!(back[0].authorization, authorization);
            assert_eq!(back[0].body, old.body);
            let old_back: Vec<OldItem> = codec::decode(&bytes).unwrap();
            assert_eq!(old_back, [old]);
        }
        let body = br#"{"status":"ok"}"#.to_vec();
        let new = Answer {
            status: 200,
            retry_after: Some(3),
            body: body.clone(),
        };
        let old = OldAnswer {
            status: 200,
            retry_after: Some(3),
            body: body.clone(),
        };
        let bytes = codec::encode(&new).unwrap();
        assert_eq!(bytes, codec::encode(&old).unwrap());
        let back: Answer = codec::decode(&bytes).unwrap();
        assert_eq!(back.body, body);
        assert_eq!(codec::decode::<OldAnswer>(&bytes).unwrap(), old);
    }

    type Started = mpsc::UnboundedReceiver<(Vec<u32>, oneshot::Sender<()>)>;

    /// The batching loop over a queue of numbers, with a send that reports each batch and
    /// holds it in flight until the test lets it go (or panics on a batch holding 99).
    fn start(max: usize, in_flight: usize) -> (mpsc::Sender<u32>, Started) {
        let (tx, rx) = mpsc::channel(64);
        let (started_tx, started) = mpsc::unbounded_channel();
        tokio::spawn(batches(rx, max, in_flight, move |batch: Vec<u32>| {
            let started_tx = started_tx.clone();
            async move {
                let fails = batch.contains(&99);
                let (done, wait) = oneshot::channel();
                started_tx.send((batch, done)).expect("the test listens");
                assert!(!fails, "a send that fails");
                let _ = wait.await;
            }
        }));
        (tx, started)
    }

    /// Queue `k` and let the batching loop run (the test runtime has one thread): a rule
    /// that sent it at once would have done so before this returns.
    async fn queue(tx: &mpsc::Sender<u32>, k: u32) {
        tx.send(k).await.unwrap();
        for _ in 0..8 {
            tokio::task::yield_now().await;
        }
    }

    async fn next(started: &mut Started) -> (Vec<u32>, oneshot::Sender<()>) {
        tokio::time::timeout(Duration::from_secs(10), started.recv())
            .await
            .expect("a batch goes within 10 s")
            .expect("a batch")
    }

    #[tokio::test]
    async fn a_lone_heartbeat_goes_at_once_and_the_next_gather_behind_it() {
        let (tx, mut started) = start(4, 4);
        queue(&tx, 0).await;
        let (b0, done0) = next(&mut started).await;
        assert_eq!(b0, [0]);
        // Slots are free, but a batch is in flight: these wait for it and go as one.
        for k in 1..=3 {
            queue(&tx, k).await;
        }
        done0.send(()).unwrap();
        let (b1, done1) = next(&mut started).await;
        assert_eq!(b1, [1, 2, 3]);
        done1.send(()).unwrap();
        queue(&tx, 4).await;
        assert_eq!(next(&mut started).await.0, [4]);
    }

    #[tokio::test]
    async fn only_full_batches_go_beside_others_and_never_past_the_limit() {
        let (tx, mut started) = start(4, 2);
        queue(&tx, 0).await;
        let (_, done0) = next(&mut started).await;
        for k in 1..=4 {
            queue(&tx, k).await;
        }
        let (b1, done1) = next(&mut started).await;
        assert_eq!(
            b1,
            [1, 2, 3, 4],
            "a full batch goes beside the one in flight"
        );
        // Two in flight, the limit: even a full batch waits for a slot.
        for k in 5..=9 {
            queue(&tx, k).await;
        }
        done0.send(()).unwrap();
        let (b2, done2) = next(&mut started).await;
        assert_eq!(b2, [5, 6, 7, 8]);
        // 9 is not a full batch: it waits until both in flight have come back.
        done1.send(()).unwrap();
        done2.send(()).unwrap();
        assert_eq!(next(&mut started).await.0, [9]);
    }

    #[tokio::test]
    async fn a_send_that_fails_gives_its_slot_back() {
        let (tx, mut started) = start(4, 1);
        queue(&tx, 99).await;
        assert_eq!(next(&mut started).await.0, [99]);
        // 99's send panicked in its task (its `done` is never used): 1 goes once the
        // panicked batch is counted back, or never.
        queue(&tx, 1).await;
        assert_eq!(next(&mut started).await.0, [1]);
    }
}
