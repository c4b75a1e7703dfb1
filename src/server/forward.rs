//! Forwarding: a member that is not the leader relays `/api/v1` requests to the leader.
//!
//! The caller's own `Authorization` travels unchanged; the leader authenticates it as usual.
//! A hop counter (trusted only with the peer header) stops loops while leadership moves. A
//! forwarded write whose connection broke after it was sent is answered `outcome_unknown`
//! (retry with the same Idempotency-Key); one that never reached the leader is `no_leader`.

use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::extract::State;
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::IntoResponse;
use axum::response::Response;
use modelforge_raft::network::PEER_HEADER;

use super::Shared;
use super::extract::CLIENT_HEADER;
use super::extract::ClientAddr;
use crate::error::ApiError;
use modelforge_proto::api::ErrorCode;
use modelforge_raft::peer_auth::PeerSigner;
use modelforge_raft::peer_auth::Signed;

use super::peer_auth::HOPS_HEADER;
const MAX_HOPS: u32 = 2;
/// How long a member waits for an election to finish before answering 503.
pub(super) const LEADER_WAIT: Duration = Duration::from_secs(3);
const FORWARD_TIMEOUT: Duration = Duration::from_secs(15);
const FORWARDED_HEADERS: [&str; 5] = [
    "authorization",
    "content-type",
    "idempotency-key",
    "x-request-id",
    "accept",
];

pub async fn leader_gate(State(ctx): State<Shared>, req: Request, next: Next) -> Response {
    if ctx.consensus.is_leader() {
        return next.run(req).await;
    }
    // A request relayed by another member carries its signed peer header: its hop count is
    // trusted only once that verifies (and its body is checked against it in `relay`).
    let signed = if req.headers().contains_key(PEER_HEADER) {
        match super::peer::verify_peer(&ctx, &req) {
            Ok(s) => Some(s),
            Err(e) => return e.into_response(),
        }
    } else {
        None
    };
    let hops = if signed.is_some() {
        super::peer_auth::hops_of(&req)
    } else {
        0
    };
    if hops >= MAX_HOPS {
        return ApiError::new(ErrorCode::NoLeader, "leadership is moving; retry shortly")
            .into_response();
    }
    let Some((leader_id, url)) = current_leader(&ctx).await else {
        return ApiError::new(
            ErrorCode::NoLeader,
            "the cluster has no leader now; retry shortly",
        )
        .into_response();
    };
    if leader_id == ctx.cfg.node_id {
        return next.run(req).await;
    }
    // Heartbeats from agents travel to the leader in batches (`relay_batch`).
    if signed.is_none() && super::relay_batch::is_heartbeat(&req) {
        return super::relay_batch::relay(&ctx, req).await;
    }
    match relay(&ctx, req, signed, leader_id, &url, hops + 1).await {
        Ok(resp) => resp,
        Err(e) => e.into_response(),
    }
}

/// The leader, with the URL this member reaches it by; when this member knows none (or only
/// itself, not leading yet), it waits up to [`LEADER_WAIT`] for an election to end.
pub(super) async fn current_leader(ctx: &super::Ctx) -> Option<(u64, String)> {
    let me = ctx.cfg.node_id;
    if ctx.consensus.leader().is_none_or(|(id, _)| id == me) {
        ctx.consensus
            .wait_for(LEADER_WAIT, |s| {
                s.leader_id.is_some() && (s.leader_id != Some(me) || s.state == "Leader")
            })
            .await;
    }
    LeaderView::leader(ctx)
}

/// Whether resending the request after a cut connection cannot apply it twice: reads,
/// heartbeats and inventory reports (idempotent), and writes carrying an Idempotency-Key
/// (deduplicated by the state machine). Enrolment is not: a retry mints a new credential, so
/// the agent decides (its retry of the same claim lands on the same node id).
fn safe_to_resend(
    method: &axum::http::Method,
    path: &str,
    headers: &axum::http::HeaderMap,
) -> bool {
    method == axum::http::Method::GET
        || method == axum::http::Method::PUT
        || (method == axum::http::Method::POST && path.ends_with("/heartbeat"))
        || headers.contains_key("idempotency-key")
}

#[tracing::instrument(name = "relay", skip_all, fields(leader = leader_id, hops = hops))]
async fn relay(
    ctx: &Shared,
    req: Request,
    signed: Option<Signed>,
    leader_id: u64,
    leader_url: &str,
    hops: u32,
) -> Result<Response, ApiError> {
    let (parts, body) = req.into_parts();
    let bytes = axum::body::to_bytes(body, ctx.cfg.max_body_bytes)
        .await
        .map_err(|_| ApiError::too_large())?;
    if let Some(signed) = &signed {
        super::peer_auth::require_body(signed, &bytes)?;
    }
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/")
        .to_string();
    let method = reqwest::Method::from_bytes(parts.method.as_str().as_bytes())
        .map_err(|_| ApiError::new(ErrorCode::BadMethod, "unsupported method"))?;
    let relayed = Relayed {
        client: ClientAddr::of(&parts.extensions, &parts.headers).0,
        resendable: safe_to_resend(&parts.method, parts.uri.path(), &parts.headers),
        blocking: super::watch::blocking_time(&parts.method, parts.uri.query()),
        method,
        path,
        headers: parts.headers,
        body: bytes,
        hops,
    };
    let leader = (leader_id, leader_url.to_string());
    send_to_leader(
        &**ctx,
        &ctx.http,
        &ctx.signer,
        &relayed,
        leader,
        LEADER_WAIT,
    )
    .await
}

/// One request as the leader will receive it.
pub(super) struct Relayed {
    pub(super) method: reqwest::Method,
    /// Path and query.
    pub(super) path: String,
    /// The caller's headers; only [`FORWARDED_HEADERS`] travel.
    pub(super) headers: axum::http::HeaderMap,
    pub(super) body: axum::body::Bytes,
    pub(super) hops: u32,
    /// The address the request came from (the leader budgets failed secret checks by it).
    pub(super) client: std::net::IpAddr,
    /// See [`safe_to_resend`].
    pub(super) resendable: bool,
    /// How long the leader may hold a blocking query before it answers.
    pub(super) blocking: Duration,
}

/// What the relay needs to know about leadership while it retries: [`super::Ctx`] in
/// production, a scripted view in the unit tests (so the relay's answers are tested without a
/// cluster).
pub(super) trait LeaderView {
    /// This member's id.
    fn me(&self) -> u64;
    fn is_leader(&self) -> bool;
    /// The leader as this member knows it, with the URL this member reaches it by.
    fn leader(&self) -> Option<(u64, String)>;
    /// Wait at most `within` for leadership to move off `from` (to another member, or here).
    fn wait_moved(&self, from: u64, within: Duration) -> impl Future<Output = ()> + Send;
}

impl LeaderView for super::Ctx {
    fn me(&self) -> u64 {
        self.cfg.node_id
    }

    fn is_leader(&self) -> bool {
        self.consensus.is_leader()
    }

    fn leader(&self) -> Option<(u64, String)> {
        let (id, url) = self.consensus.leader()?;
        let url = self.peer_url(id, &url);
        Some((id, url))
    }

    async fn wait_moved(&self, from: u64, within: Duration) {
        self.consensus
            .wait_for(within, |s| {
                s.leader_id.is_some_and(|l| l != from) || s.state == "Leader"
            })
            .await;
    }
}

/// Send `req` to the leader and relay its answer. A connection that could not be made is
/// retried (the request certainly did not arrive), and so is a broken one when the request is
/// safe to resend, until `leader_wait` passes; then the answer is `no_leader` if no attempt can
/// have reached a leader, and `outcome_unknown` for a write that may have.
pub(super) async fn send_to_leader(
    view: &impl LeaderView,
    http: &reqwest::Client,
    signer: &PeerSigner,
    req: &Relayed,
    leader: (u64, String),
    leader_wait: Duration,
) -> Result<Response, ApiError> {
    let deadline = tokio::time::Instant::now() + leader_wait;
    let (mut target_id, mut target_url) = leader;
    // Whether any attempt may have reached a leader: then a write's outcome is unknown, even if
    // a later attempt could not connect at all.
    let mut maybe_sent = false;
    let unknown_or = |maybe_sent: bool, certain: ApiError| {
        if maybe_sent && req.method != reqwest::Method::GET {
            ApiError::outcome_unknown(
                "the leader did not answer; the request may or may not have applied (retry with the same Idempotency-Key)",
            )
        } else {
            certain
        }
    };
    loop {
        let mut out = http
            .request(
                req.method.clone(),
                format!("{}{}", target_url.trim_end_matches('/'), req.path),
            )
            .timeout(FORWARD_TIMEOUT + req.blocking)
            .body(req.body.clone());
        for name in FORWARDED_HEADERS {
            if let Some(v) = req.headers.get(name) {
                out = out.header(name, v.as_bytes());
            }
        }
        out = out
            .header(
                PEER_HEADER,
                signer.sign(req.method.as_str(), &req.path, &req.body, req.hops),
            )
            .header(HOPS_HEADER, req.hops.to_string())
            .header(CLIENT_HEADER, req.client.to_string());
        let err = match out.send().await {
            // A later attempt's "cannot decide now" (503: not leader, no leader) says nothing
            // of an earlier attempt that may have reached a leader and applied (found by the
            // chaos checker: a resent cancel answered `not_leader` had applied).
            Ok(resp) if resp.status() == reqwest::StatusCode::SERVICE_UNAVAILABLE && maybe_sent => {
                return Err(unknown_or(
                    maybe_sent,
                    ApiError::new(ErrorCode::NoLeader, "the leader could not decide; retry"),
                ));
            }
            Ok(resp)
                if resp.status() == reqwest::StatusCode::SERVICE_UNAVAILABLE && req.resendable =>
            {
                let (parts, bytes) = answer_bytes(resp).await?;
                if !leadership_moving(&bytes) || tokio::time::Instant::now() >= deadline {
                    return Ok(Response::from_parts(parts, Body::from(bytes)));
                }
                // The member taken for the leader cannot decide now (it lost leadership, or
                // its new term cannot serve yet): a request safe to resend waits for
                // leadership to settle and goes again, as after a cut connection. (Seen in
                // the failover benchmark: hundreds of agents' heartbeats answered `not_leader`
                // in the moments after an election, each costing its agent an interval.)
                None
            }
            Ok(resp) if resp.status() == reqwest::StatusCode::UNAUTHORIZED => {
                // The client's own credential is never checked with the peer header, so a
                // peer refusal is of this member: removed from the configuration (it may never
                // hear of its removal), or not added yet. The client is told to go elsewhere,
                // never that its credential failed (chaos seed 1592590340: agents of a member
                // being replaced were answered 401 and counted their credentials dead).
                let (parts, bytes) = answer_bytes(resp).await?;
                let Some(why) = peer_refusal(&bytes) else {
                    // The leader's own 401, for the client's request.
                    return Ok(Response::from_parts(parts, Body::from(bytes)));
                };
                tracing::warn!(
                    leader = target_id,
                    "the leader refused this member's relay: {why}"
                );
                return Err(unknown_or(
                    maybe_sent,
                    ApiError::new(
                        ErrorCode::NotAMember,
                        format!(
                            "the leader refused this member ({why}); send the request to another member"
                        ),
                    ),
                ));
            }
            Ok(resp) => return relay_answer(resp).await,
            Err(e) => Some(e),
        };
        let connect_failed = err.as_ref().is_some_and(|e| e.is_connect());
        maybe_sent |= err.as_ref().is_some_and(|e| !e.is_connect());
        // The request certainly did not arrive (connect failed), or may be resent safely:
        // wait for leadership to move (or the leader to come back) and try again.
        if (connect_failed || req.resendable) && tokio::time::Instant::now() < deadline {
            let me = view.me();
            view.wait_moved(target_id, Duration::from_millis(200)).await;
            if view.is_leader() && me != target_id {
                return Err(unknown_or(
                    maybe_sent,
                    ApiError::new(
                        ErrorCode::LeaderChanged,
                        "this member became the leader meanwhile; retry",
                    ),
                ));
            }
            if let Some((id, url)) = view.leader().filter(|(id, _)| *id != me) {
                (target_id, target_url) = (id, url);
            }
            continue;
        }
        return Err(unknown_or(
            maybe_sent,
            ApiError::new(
                ErrorCode::NoLeader,
                "the leader could not be reached; retry shortly",
            ),
        ));
    }
}

/// The error code of an answer's contract error body, with its message.
fn error_of(body: &[u8]) -> Option<modelforge_proto::wire::ErrorDetail> {
    serde_json::from_slice::<modelforge_proto::wire::ErrorBody>(body)
        .ok()
        .map(|e| e.error)
}

/// Whether a 503 says leadership is moving (`not_leader`, `no_leader`, `leader_changed`): the
/// request was not decided, and the leader after the move may decide it. (Not a shed request,
/// which is to come back later, nor an `outcome_unknown`.)
pub(super) fn leadership_moving(body: &[u8]) -> bool {
    const MOVING: [ErrorCode; 3] = [
        ErrorCode::NotLeader,
        ErrorCode::NoLeader,
        ErrorCode::LeaderChanged,
    ];
    error_of(body).is_some_and(|e| MOVING.iter().any(|c| c.as_str() == e.code))
}

/// The leader's message when its answer refuses the relaying member (`peer_unauthenticated`).
fn peer_refusal(body: &[u8]) -> Option<String> {
    error_of(body)
        .filter(|e| e.code == ErrorCode::PeerUnauthenticated.as_str())
        .map(|e| e.message)
}

async fn relay_answer(resp: reqwest::Response) -> Result<Response, ApiError> {
    let (parts, body) = answer_bytes(resp).await?;
    Ok(Response::from_parts(parts, Body::from(body)))
}

/// A relayed answer's head (status, content type, watch index) and its body, read whole.
async fn answer_bytes(
    resp: reqwest::Response,
) -> Result<(axum::http::response::Parts, axum::body::Bytes), ApiError> {
    let status = axum::http::StatusCode::from_u16(resp.status().as_u16())
        .unwrap_or(axum::http::StatusCode::BAD_GATEWAY);
    let ctype = resp.headers().get("content-type").cloned();
    let index = resp.headers().get(super::watch::INDEX_HEADER).cloned();
    let body = resp
        .bytes()
        .await
        .map_err(|_| ApiError::outcome_unknown("the leader's answer was cut off"))?;
    let (mut parts, ()) = Response::new(()).into_parts();
    parts.status = status;
    if let Some(ct) = ctype.and_then(|v| HeaderValue::from_bytes(v.as_bytes()).ok()) {
        parts.headers.insert("content-type", ct);
    }
    if let Some(i) = index.and_then(|v| HeaderValue::from_bytes(v.as_bytes()).ok()) {
        parts.headers.insert(super::watch::INDEX_HEADER, i);
    }
    Ok((parts, body))
}

#[cfg(test)]
mod tests {
    //! The relay's answer when the leader's connection breaks, without a cluster: a scripted
    //! leadership view and a fake leader on a loopback socket. Regression for the chaos
    //! checker's finding (fixed in 3bbbd90): a relayed write with an Idempotency-Key whose
    //! connection broke after it was sent was answered `no_leader` ("certainly failed")
    //! although the leader may have applied it.

    use std::sync::Arc;
    use std::sync::Mutex;

    use axum::http::HeaderMap;
    use tokio::io::AsyncReadExt;
    use tokio::net::TcpListener;

    use super::*;

    /// Leadership that never moves while the relay waits: like `Consensus::wait_for`, the wait
    /// ends when its time is up.
    struct Steady {
        leader: (u64, String),
        moved: tokio::sync::Notify,
        /// This member won an election meanwhile (it leads once the relay looks again).
        leads_now: bool,
    }

    impl LeaderView for Steady {
        fn me(&self) -> u64 {
            1
        }
        fn is_leader(&self) -> bool {
            self.leads_now
        }
        fn leader(&self) -> Option<(u64, String)> {
            Some(self.leader.clone())
        }
        async fn wait_moved(&self, _from: u64, within: Duration) {
            let _ = tokio::time::timeout(within, self.moved.notified()).await;
        }
    }

    /// The fake leaders' TLS: a CA of their own and a certificate for 127.0.0.1 (the relay's
    /// client trusts that CA, as a member's trusts the cluster's).
    fn fake_tls() -> &'static (String, tokio_rustls::TlsAcceptor) {
        static TLS: std::sync::OnceLock<(String, tokio_rustls::TlsAcceptor)> =
            std::sync::OnceLock::new();
        TLS.get_or_init(|| {
            let (ca, ca_key) = crate::tls::generate_ca().unwrap();
            let (cert, key) =
                crate::tls::issue_member(&ca, &ca_key, 2, &["127.0.0.1".into()]).unwrap();
            let m = crate::tls::load(&ca, &cert, &key).unwrap();
            let cfg = crate::tls::server_config(&m).unwrap();
            (ca, tokio_rustls::TlsAcceptor::from(cfg))
        })
    }

    /// The relaying member's client, trusting the fake leaders' CA.
    fn fake_client() -> reqwest::Client {
        crate::tls::install_provider();
        reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(Duration::from_millis(500))
            .tls_backend_preconfigured(crate::tls::client_config(&fake_tls().0, None).unwrap())
            .build()
            .unwrap()
    }

    /// Accept one TLS connection on `listener` (None once it fails).
    async fn accept_tls(
        listener: &TcpListener,
    ) -> Option<tokio_rustls::server::TlsStream<tokio::net::TcpStream>> {
        let (sock, _) = listener.accept().await.ok()?;
        fake_tls().1.accept(sock).await.ok()
    }

    /// Read one HTTP/1.1 request (head and `content-length` body) as text.
    async fn read_request(sock: &mut (impl tokio::io::AsyncRead + Unpin)) -> String {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            let text = String::from_utf8_lossy(&buf).to_string();
            if let Some(end) = text.find("\r\n\r\n") {
                let len = text[..end]
                    .lines()
                    .find_map(|l| {
                        let (k, v) = l.split_once(':')?;
                        k.eq_ignore_ascii_case("content-length")
                            .then(|| v.trim().parse::<usize>().ok())?
                    })
                    .unwrap_or(0);
                if buf.len() >= end + 4 + len {
                    return text;
                }
            }
            match sock.read(&mut chunk).await {
                Ok(0) | Err(_) => return String::from_utf8_lossy(&buf).to_string(),
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    }

    /// A leader that reads each request in full and closes the connection without answering;
    /// after `serve` requests it stops listening (it died: connections are refused from then
    /// on). Returns its URL and the requests it read.
    async fn mute_leader(serve: usize) -> (String, Arc<Mutex<Vec<String>>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}", listener.local_addr().unwrap());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        tokio::spawn(async move {
            for _ in 0..serve {
                let Some(mut sock) = accept_tls(&listener).await else {
                    return;
                };
                let request = read_request(&mut sock).await;
                log.lock().unwrap().push(request);
                drop(sock);
            }
        });
        (url, seen)
    }

    /// A URL where nothing listens: every connection is refused.
    async fn nobody() -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}", listener.local_addr().unwrap());
        drop(listener);
        url
    }

    fn request(method: &str, path: &str, key: Option<&str>, body: &str) -> Relayed {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        if let Some(k) = key {
            headers.insert("idempotency-key", HeaderValue::from_str(k).unwrap());
        }
        let m = axum::http::Method::from_bytes(method.as_bytes()).unwrap();
        Relayed {
            resendable: safe_to_resend(&m, path, &headers),
            method: reqwest::Method::from_bytes(method.as_bytes()).unwrap(),
            path: path.to_string(),
            headers,
            body: axum::body::Bytes::from(body.to_string()),
            hops: 1,
            client: std::net::IpAddr::from([127, 0, 0, 1]),
            blocking: Duration::ZERO,
        }
    }

    /// What the relay answers for `req` sent to the leader at `url`: (status, error code).
    async fn relay_to(url: &str, req: &Relayed) -> (u16, &'static str) {
        relay_with(url, req, false).await
    }

    async fn relay_with(url: &str, req: &Relayed, leads_now: bool) -> (u16, &'static str) {
        match send_with(url, req, leads_now, Duration::from_secs(1)).await {
            Ok(r) => panic!(
                "the relay answered {} for a leader that never answers",
                r.status()
            ),
            Err(e) => (e.status.as_u16(), e.code.as_str()),
        }
    }

    /// `req` relayed to the leader at `url` (this member leads meanwhile if `leads_now`).
    async fn send_with(
        url: &str,
        req: &Relayed,
        leads_now: bool,
        leader_wait: Duration,
    ) -> Result<Response, ApiError> {
        let view = Steady {
            leader: (2, url.to_string()),
            moved: tokio::sync::Notify::new(),
            leads_now,
        };
        let signer = PeerSigner::new(b"peer", 1);
        let leader = view.leader.clone();
        send_to_leader(&view, &fake_client(), &signer, req, leader, leader_wait).await
    }

    const ALLOCATE: &str = r#"{"owner": "regression", "accelerators": 1}"#;

    #[tokio::test]
    async fn a_keyed_write_whose_leader_read_it_and_broke_the_connection_is_outcome_unknown() {
        let (url, seen) = mute_leader(usize::MAX).await;
        let req = request("POST", "/api/v1/allocations", Some("k-1"), ALLOCATE);
        assert!(req.resendable);
        assert_eq!(relay_to(&url, &req).await, (503, "outcome_unknown"));
        // It was resent while the deadline allowed, always with its key and body.
        let seen = seen.lock().unwrap();
        assert!(seen.len() >= 2, "resent {} times", seen.len());
        for r in seen.iter() {
            assert!(r.starts_with("POST /api/v1/allocations HTTP/1.1"), "{r}");
            assert!(
                r.to_ascii_lowercase().contains("idempotency-key: k-1"),
                "{r}"
            );
            assert!(r.ends_with(ALLOCATE), "{r}");
        }
    }

    #[tokio::test]
    async fn a_keyed_write_whose_leader_died_after_reading_it_is_outcome_unknown_although_later_attempts_cannot_connect()
     {
        let (url, seen) = mute_leader(1).await;
        let req = request("POST", "/api/v1/allocations", Some("k-2"), ALLOCATE);
        assert_eq!(relay_to(&url, &req).await, (503, "outcome_unknown"));
        assert_eq!(seen.lock().unwrap().len(), 1);
    }

    #[tokio::test]
    async fn an_enrolment_whose_connection_broke_after_sending_is_outcome_unknown_and_not_resent() {
        let (url, seen) = mute_leader(usize::MAX).await;
        let req = request("POST", "/api/v1/agent/enroll", None, r#"{"token": "x"}"#);
        assert!(!req.resendable);
        assert_eq!(relay_to(&url, &req).await, (503, "outcome_unknown"));
        assert_eq!(seen.lock().unwrap().len(), 1, "an enrolment was resent");
    }

    const NOT_LEADER: &str = r#"{"error":{"code":"not_leader","message":"x"}}"#;

    /// Answer one request with `status` and a JSON `body`, and close the connection.
    async fn answer(sock: &mut (impl tokio::io::AsyncWrite + Unpin), status: &str, body: &str) {
        use tokio::io::AsyncWriteExt;
        let head = format!(
            "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        );
        let _ = sock.write_all(format!("{head}{body}").as_bytes()).await;
        let _ = sock.shutdown().await;
    }

    /// A leader that reads the first request and breaks the connection (it may have applied
    /// it), then answers every later one 503 `not_leader` (a new leader not ready yet).
    async fn mute_then_not_leader() -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let mut first = true;
            while let Some(mut sock) = accept_tls(&listener).await {
                read_request(&mut sock).await;
                if !std::mem::take(&mut first) {
                    answer(&mut sock, "503 Service Unavailable", NOT_LEADER).await;
                }
            }
        });
        url
    }

    /// Chaos seed 1592590337: a keyed cancel whose first attempt was cut off after sending was
    /// resent, the new leader answered 503 `not_leader`, and the relay passed that on as a
    /// certain failure, although the first attempt had applied.
    #[tokio::test]
    async fn a_resent_write_answered_not_leader_after_a_cut_attempt_is_outcome_unknown() {
        let url = mute_then_not_leader().await;
        let req = request(
            "DELETE",
            "/api/v1/admin/node-enrollments/t1",
            Some("k-5"),
            "",
        );
        assert!(req.resendable);
        assert_eq!(relay_to(&url, &req).await, (503, "outcome_unknown"));
        // A read changes nothing, so it is never unknown.
        let url = mute_then_not_leader().await;
        let get = request("GET", "/api/v1/admin/hardware/nodes", None, "");
        assert_eq!(relay_to(&url, &get).await, (503, "no_leader"));
    }

    /// The relay's member became the leader after the old leader read the write: the old
    /// leader may still have committed it, so this is not a plain `leader_changed`.
    #[tokio::test]
    async fn a_keyed_write_broken_after_sending_while_this_member_took_over_is_outcome_unknown() {
        let (url, _) = mute_leader(usize::MAX).await;
        let req = request("POST", "/api/v1/allocations", Some("k-4"), ALLOCATE);
        assert_eq!(relay_with(&url, &req, true).await, (503, "outcome_unknown"));
        let url = nobody().await;
        assert_eq!(relay_with(&url, &req, true).await, (503, "leader_changed"));
    }

    /// A leader that answers every request `status` with `body` (JSON).
    async fn answering_leader(status: &'static str, body: &'static str) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            while let Some(mut sock) = accept_tls(&listener).await {
                read_request(&mut sock).await;
                answer(&mut sock, status, body).await;
            }
        });
        url
    }

    /// Chaos seed 1592590340: a member removed from the configuration (and not told) relayed
    /// heartbeats, the leader refused the member, and its 401 `peer_unauthenticated` reached
    /// the agents as if their credentials had failed. A refusal of the member sends the client
    /// to another member; the leader's 401 for the client's own credential still passes.
    #[tokio::test]
    async fn the_leader_refusing_this_member_is_not_a_member_never_the_clients_401() {
        let url = answering_leader(
            "401 Unauthorized",
            r#"{"error":{"code":"peer_unauthenticated","message":"member 3 was removed from the cluster"}}"#,
        )
        .await;
        let beat = request("POST", "/api/v1/agent/nodes/n1/heartbeat", None, "{}");
        assert_eq!(relay_to(&url, &beat).await, (503, "not_a_member"));
        let write = request("POST", "/api/v1/allocations", Some("k-6"), ALLOCATE);
        assert_eq!(relay_to(&url, &write).await, (503, "not_a_member"));

        let url = answering_leader(
            "401 Unauthorized",
            r#"{"error":{"code":"unauthorized","message":"the credential was revoked"}}"#,
        )
        .await;
        // The leader's own 401, for the client's credential, passes as it was given.
        assert_eq!(answered(&url, &beat).await, (401, "unauthorized".into()));
    }

    /// A leader that answers its first request 503 `not_leader` (its new term not ready) and
    /// every later one 200.
    async fn not_ready_then_ok() -> (String, Arc<Mutex<usize>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}", listener.local_addr().unwrap());
        let seen = Arc::new(Mutex::new(0));
        let count = seen.clone();
        tokio::spawn(async move {
            while let Some(mut sock) = accept_tls(&listener).await {
                read_request(&mut sock).await;
                let n = {
                    let mut c = count.lock().unwrap();
                    *c += 1;
                    *c
                };
                if n == 1 {
                    answer(&mut sock, "503 Service Unavailable", NOT_LEADER).await;
                } else {
                    answer(&mut sock, "200 OK", r#"{"status":"ok"}"#).await;
                }
            }
        });
        (url, seen)
    }

    /// What the relay answers for `req`: its status and error code (empty on success).
    async fn answered(url: &str, req: &Relayed) -> (u16, String) {
        match send_with(url, req, false, Duration::from_secs(2)).await {
            Ok(r) => {
                let status = r.status().as_u16();
                let body = axum::body::to_bytes(r.into_body(), usize::MAX)
                    .await
                    .unwrap();
                let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                let code = v["error"]["code"].as_str().unwrap_or("").to_string();
                (status, code)
            }
            Err(e) => (e.status.as_u16(), e.code.as_str().to_string()),
        }
    }

    /// The failover benchmark: in the moments after an election, relayed heartbeats were
    /// answered 503 `not_leader` by the new leader and each cost its agent an interval. A
    /// request safe to resend is sent again once leadership settles; one that is not (an
    /// enrolment) gets the 503 as the leader gave it, and so does a shed request.
    #[tokio::test]
    async fn a_resendable_request_answered_not_leader_is_sent_again_and_others_pass_the_503_on() {
        let (url, seen) = not_ready_then_ok().await;
        let beat = request("POST", "/api/v1/agent/nodes/n1/heartbeat", None, "{}");
        assert_eq!(answered(&url, &beat).await, (200, String::new()));
        assert_eq!(*seen.lock().unwrap(), 2);
        let (url, seen) = not_ready_then_ok().await;
        let enrol = request("POST", "/api/v1/agent/enroll", None, "{}");
        assert_eq!(answered(&url, &enrol).await, (503, "not_leader".into()));
        assert_eq!(*seen.lock().unwrap(), 1);
        let url = answering_leader(
            "503 Service Unavailable",
            r#"{"error":{"code":"over_capacity","message":"x"}}"#,
        )
        .await;
        assert_eq!(answered(&url, &beat).await, (503, "over_capacity".into()));
    }

    /// The control: a write that never reached a leader certainly failed.
    #[tokio::test]
    async fn a_write_that_could_not_connect_to_any_leader_is_no_leader() {
        let url = nobody().await;
        for req in [
            request("POST", "/api/v1/allocations", Some("k-3"), ALLOCATE),
            request("POST", "/api/v1/agent/enroll", None, "{}"),
        ] {
            assert_eq!(relay_to(&url, &req).await, (503, "no_leader"));
        }
    }

    /// A read changes nothing, so a broken read is never an unknown outcome.
    #[tokio::test]
    async fn a_read_whose_connection_broke_is_no_leader() {
        let (url, seen) = mute_leader(usize::MAX).await;
        let req = request("GET", "/api/v1/admin/hardware/nodes", None, "");
        assert_eq!(relay_to(&url, &req).await, (503, "no_leader"));
        assert!(!seen.lock().unwrap().is_empty());
    }
}
