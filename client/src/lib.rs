//! The one failover client: the agent and the admin CLI talk to "the cluster" through any of
//! its members' URLs. A request goes to the current member; when that member does not answer,
//! or answers that it cannot decide now (429, 502, 503, 504, or 401 `peer_unauthenticated`:
//! its peers refuse it), the next member is tried, each at
//! most once a pass. Any other answer is final: 2xx is the result, anything else a refusal with
//! the contract's error code. A write that may be sent twice must carry an `Idempotency-Key`
//! (the caller's choice: the CLI sends one per invocation; the agent's writes are idempotent or
//! retried by the agent itself with the same claim).

pub mod tls;

use std::time::Duration;

use modelforge_proto::wire::ErrorBody;
use serde_json::Value;

/// What the cluster answered.
#[derive(Debug)]
pub enum Answer {
    /// 2xx, with the JSON body (null when it had none).
    Ok(Value),
    /// A refusal: status, error code, message.
    Refused(u16, String, String),
    /// No member could answer (why, from the last one tried).
    Unavailable(String),
}

/// One request, as sent to whichever member takes it.
pub struct Request<'a> {
    pub method: reqwest::Method,
    pub path: &'a str,
    pub bearer: Option<&'a str>,
    /// A JSON body, already encoded (sent as is on every attempt).
    pub body: Option<Vec<u8>>,
    pub idempotency_key: Option<&'a str>,
}

/// Whether `status` says a member cannot decide now (shed, overloaded, no leader, a gateway
/// failure): the request was not refused, and another member or a later try may take it.
pub fn cannot_decide_now(status: u16) -> bool {
    matches!(status, 429 | 502 | 503 | 504)
}

/// A random duration in `[0, up_to)`.
pub fn jitter(up_to: Duration) -> Duration {
    let r = u64::from_le_bytes(modelforge_proto::random_bytes::<8>());
    up_to.mul_f64((r >> 11) as f64 / (1u64 << 53) as f64)
}

/// How long an agent waits before sending again a request that was not delivered (no member
/// answered, or none could decide now): the member's `Retry-After` (a second when it gave
/// none) plus a random part of as long again, so that a fleet shed at once comes back spread
/// over that window (ARCHITECTURE.md, "The HTTP edge").
pub fn redelivery_wait(retry_after: Option<Duration>) -> Duration {
    let base = retry_after.unwrap_or(Duration::from_secs(1));
    base + jitter(base)
}

/// An answer's status and body: the result, a refusal, or why to try the next member.
pub fn classify(status: u16, body: Value, url: &str) -> Answer {
    if (200..300).contains(&status) {
        return Answer::Ok(body);
    }
    let (code, message) = match serde_json::from_value::<ErrorBody>(body) {
        Ok(e) => (e.error.code, e.error.message),
        Err(_) => ("unknown".to_string(), format!("HTTP {status}")),
    };
    // A member's own refusal by its peers (`peer_unauthenticated`: removed, or not added yet)
    // says nothing of the client's credential: another member may take the request.
    if cannot_decide_now(status) || code == "peer_unauthenticated" {
        Answer::Unavailable(format!("{url}: {status} {code}: {message}"))
    } else {
        Answer::Refused(status, code, message)
    }
}

pub struct Failover {
    urls: Vec<String>,
    current: usize,
    http: reqwest::Client,
    /// The `Retry-After` of the last answer that carried one (a shed or budgeted request).
    retry_after: Option<Duration>,
    /// The `X-Modelforge-Index` of the last answer that carried one (a watchable view).
    index: Option<u64>,
}

impl Failover {
    /// A client for `urls` (trimmed, trailing slashes dropped; at least one).
    /// `tls`: the config to reach `https://` members with (see [`tls::client_config`]); `None`
    /// reaches only `http://` members (`--insecure-http` clusters).
    pub fn new(
        urls: Vec<String>,
        connect_timeout: Duration,
        timeout: Duration,
        tls: Option<rustls::ClientConfig>,
    ) -> Result<Self, String> {
        let urls: Vec<String> = urls
            .into_iter()
            .map(|u| u.trim().trim_end_matches('/').to_string())
            .filter(|u| !u.is_empty())
            .collect();
        if urls.is_empty() {
            return Err("at least one control-plane URL is needed".into());
        }
        if tls.is_none()
            && let Some(u) = urls.iter().find(|u| u.starts_with("https://"))
        {
            return Err(format!(
                "{u} speaks TLS: give the cluster CA (--ca-file, or --ca-cert-hash for an agent; --cacert for the CLI)"
            ));
        }
        tls::install_provider();
        let mut b = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(connect_timeout)
            // Below the members' header-read timeout, which closes idle connections at 30 s.
            .pool_idle_timeout(Duration::from_secs(20))
            .timeout(timeout);
        if let Some(cfg) = tls {
            b = b.tls_backend_preconfigured(cfg);
        }
        let http = b.build().map_err(|e| e.to_string())?;
        Ok(Self {
            urls,
            current: 0,
            http,
            retry_after: None,
            index: None,
        })
    }

    pub fn urls(&self) -> &[String] {
        &self.urls
    }

    /// The `Retry-After` (in whole seconds, at most an hour) of the last answer that carried
    /// one since the last call of this, if any.
    pub fn take_retry_after(&mut self) -> Option<Duration> {
        self.retry_after.take()
    }

    /// The `X-Modelforge-Index` of the last answer, if it carried one.
    pub fn index(&self) -> Option<u64> {
        self.index
    }

    /// The member the next request goes to first.
    pub fn current(&self) -> &str {
        &self.urls[self.current]
    }

    /// Move on to the next member.
    pub fn advance(&mut self) {
        self.current = (self.current + 1) % self.urls.len();
    }

    pub fn http(&self) -> &reqwest::Client {
        &self.http
    }

    /// One pass: the current member, then each other one at most once, until one answers
    /// something final.
    pub async fn send(&mut self, req: &Request<'_>) -> Answer {
        self.retry_after = None;
        self.index = None;
        let mut last = Answer::Unavailable("no member was tried".into());
        for _ in 0..self.urls.len() {
            let url = format!("{}{}", self.current(), req.path);
            let mut out = self.http.request(req.method.clone(), &url);
            if let Some(b) = req.bearer {
                out = out.bearer_auth(b);
            }
            if let Some(k) = req.idempotency_key {
                out = out.header("Idempotency-Key", k);
            }
            if let Some(body) = &req.body {
                out = out
                    .header("content-type", "application/json")
                    .body(body.clone());
            }
            last = match out.send().await {
                Err(e) => Answer::Unavailable(format!("{url}: {}", e.without_url())),
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    if let Some(secs) = resp
                        .headers()
                        .get(reqwest::header::RETRY_AFTER)
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.trim().parse::<u64>().ok())
                    {
                        self.retry_after = Some(Duration::from_secs(secs.min(3600)));
                    }
                    self.index = resp
                        .headers()
                        .get("x-modelforge-index")
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.parse().ok());
                    let body = resp.json().await.unwrap_or(Value::Null);
                    // A member shedding load asks the client to come back later, not to move
                    // the load to another member (which would relay it to the same leader).
                    let shed = body["error"]["code"] == "over_capacity";
                    match classify(status, body, &url) {
                        Answer::Unavailable(why) if shed => return Answer::Unavailable(why),
                        Answer::Unavailable(why) => Answer::Unavailable(why),
                        done => return done,
                    }
                }
            };
            self.advance();
        }
        last
    }

    /// Passes of [`Failover::send`], 250 ms apart, until one answers or `within` has passed.
    pub async fn send_within(&mut self, req: &Request<'_>, within: Duration) -> Answer {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            match self.send(req).await {
                Answer::Unavailable(why) if tokio::time::Instant::now() < deadline => {
                    let _ = why;
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                answer => return answer,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    /// An undelivered request goes again after the member's `Retry-After` (a second without
    /// one) and at most as long again: never sooner, never an interval later.
    #[test]
    fn a_request_is_sent_again_after_retry_after_and_at_most_as_long_again() {
        use super::redelivery_wait;
        use std::time::Duration;
        for (given, base) in [
            (None, Duration::from_secs(1)),
            (Some(Duration::from_secs(4)), Duration::from_secs(4)),
        ] {
            let waits: Vec<Duration> = (0..200).map(|_| redelivery_wait(given)).collect();
            assert!(
                waits.iter().all(|w| *w >= base && *w <= base * 2),
                "{waits:?}"
            );
            // Spread, not one instant for the whole fleet.
            let (lo, hi) = (waits.iter().min().unwrap(), waits.iter().max().unwrap());
            assert!(*hi - *lo > base / 2, "{lo:?}..{hi:?}");
        }
    }

    use super::*;

    /// The fake members' TLS: a self-signed certificate for 127.0.0.1 that the client trusts.
    fn fake_tls() -> &'static (String, tokio_rustls::TlsAcceptor) {
        static TLS: std::sync::OnceLock<(String, tokio_rustls::TlsAcceptor)> =
            std::sync::OnceLock::new();
        TLS.get_or_init(|| {
            tls::install_provider();
            let c = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()]).unwrap();
            let key = rustls_pki_types::PrivateKeyDer::Pkcs8(c.signing_key.serialize_der().into());
            let cfg = rustls::ServerConfig::builder()
                .with_no_client_auth()
                .with_single_cert(vec![c.cert.der().clone()], key)
                .unwrap();
            (
                c.cert.pem(),
                tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(cfg)),
            )
        })
    }

    fn client(urls: Vec<String>) -> Result<Failover, String> {
        Failover::new(
            urls,
            Duration::from_millis(500),
            Duration::from_secs(5),
            Some(tls::client_config(&fake_tls().0, None).unwrap()),
        )
    }

    /// A member that answers every request (over TLS) with `status` and the contract's error
    /// body.
    async fn member(status: u16, code: &'static str) -> String {
        use tokio::io::AsyncReadExt;
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            while let Ok((sock, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let Ok(mut s) = fake_tls().1.accept(sock).await else {
                        return;
                    };
                    let (mut head, mut buf) = (Vec::new(), [0u8; 1024]);
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match s.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    let body = format!(r#"{{"error":{{"code":"{code}","message":"m"}}}}"#);
                    // A shed answer says when to come back, as a member's does.
                    let retry = if code == "over_capacity" {
                        "retry-after: 7\r\n"
                    } else {
                        ""
                    };
                    let answer = format!(
                        "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{retry}connection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = s.write_all(answer.as_bytes()).await;
                    let _ = s.shutdown().await;
                });
            }
        });
        url
    }

    async fn nobody() -> String {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        format!("https://{}", l.local_addr().unwrap())
    }

    fn get(path: &str) -> Request<'_> {
        Request {
            method: reqwest::Method::GET,
            path,
            bearer: None,
            body: None,
            idempotency_key: None,
        }
    }

    #[tokio::test]
    async fn a_member_that_cannot_decide_or_answer_passes_the_request_on_and_a_refusal_is_final() {
        let urls = vec![
            nobody().await,
            member(503, "no_leader").await,
            member(429, "overloaded").await,
            // A member its peers refuse (removed, not told yet): not the client's credential.
            member(401, "peer_unauthenticated").await,
            member(404, "node_not_found").await,
            member(200, "unused").await,
        ];
        let mut c = client(urls).unwrap();
        match c.send(&get("/x")).await {
            Answer::Refused(404, code, _) => assert_eq!(code, "node_not_found"),
            other => panic!("{other:?}"),
        }
        // The member that answered is asked first next time.
        assert_eq!(c.current(), c.urls()[4]);
        // A client's own 401 is final.
        let mut c = client(vec![member(401, "unauthorized").await]).unwrap();
        assert!(matches!(c.send(&get("/x")).await, Answer::Refused(401, ..)));
    }

    #[tokio::test]
    async fn no_member_answering_is_unavailable_after_one_pass_and_within_a_deadline() {
        let urls = vec![nobody().await, member(503, "no_leader").await];
        let mut c = client(urls).unwrap();
        assert!(
            matches!(c.send(&get("/x")).await, Answer::Unavailable(why) if why.contains("503 no_leader"))
        );
        let t = std::time::Instant::now();
        assert!(matches!(
            c.send_within(&get("/x"), Duration::from_millis(600)).await,
            Answer::Unavailable(_)
        ));
        assert!(t.elapsed() >= Duration::from_millis(600));
        assert!(client(vec![" / ".into()]).is_err(), "no URL");
        // An https member with no CA to trust it by is refused before any request.
        assert!(
            Failover::new(
                vec![nobody().await],
                Duration::from_secs(1),
                Duration::from_secs(1),
                None
            )
            .is_err()
        );
    }

    /// A shed answer's `Retry-After` is kept for the caller (the agent waits at least that
    /// long before its next heartbeat); the next request forgets it.
    #[tokio::test]
    async fn a_shed_answer_keeps_its_retry_after_until_the_next_request() {
        let shed = member(503, "over_capacity").await;
        let refused = member(400, "invalid_body").await;
        let req = Request {
            method: reqwest::Method::POST,
            path: "/api/v1/agent/nodes/n/heartbeat",
            bearer: None,
            body: Some(b"{}".to_vec()),
            idempotency_key: None,
        };
        let mut c = client(vec![shed]).unwrap();
        assert!(matches!(c.send(&req).await, Answer::Unavailable(_)));
        assert_eq!(c.take_retry_after(), Some(Duration::from_secs(7)));
        assert_eq!(c.take_retry_after(), None);
        let mut c2 = client(vec![refused]).unwrap();
        c2.retry_after = Some(Duration::from_secs(1));
        assert!(matches!(c2.send(&req).await, Answer::Refused(400, ..)));
        assert_eq!(c2.take_retry_after(), None);
    }
}
