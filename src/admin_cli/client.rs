//! The CLI's HTTP client: any member, failover between the `--server` URLs, one
//! `Idempotency-Key` per invocation so a write moved to another member never applies twice.

use std::time::Duration;

use modelforge_proto::wire::ErrorBody;
use serde_json::Value;

/// Why a call did not succeed.
#[derive(Debug)]
pub enum CallError {
    /// A member answered with an error: its status, code and message.
    Refused {
        status: u16,
        code: String,
        message: String,
    },
    /// No member answered, or all answered 503 until the deadline.
    Unreachable(String),
}

pub struct Client {
    urls: Vec<String>,
    current: usize,
    token: String,
    http: reqwest::Client,
    /// Sent with every write of this invocation (unless the command names its own key).
    idempotency_key: String,
    /// How long one call keeps trying members that do not answer or answer 503.
    failover_deadline: Duration,
}

impl Client {
    pub fn new(
        urls: Vec<String>,
        token: String,
        failover_deadline: Duration,
    ) -> anyhow::Result<Self> {
        let http = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(Duration::from_secs(1))
            .timeout(Duration::from_secs(20))
            .build()?;
        Ok(Self {
            urls,
            current: 0,
            token,
            http,
            idempotency_key: format!("cli-{}", modelforge_proto::new_uuid()),
            failover_deadline,
        })
    }

    /// The member URLs, as given.
    pub fn urls(&self) -> &[String] {
        &self.urls
    }

    pub async fn get(&mut self, path: &str) -> Result<Value, CallError> {
        self.call(reqwest::Method::GET, path, None, None).await
    }

    /// A write: `key` overrides the invocation's idempotency key.
    pub async fn write(
        &mut self,
        method: reqwest::Method,
        path: &str,
        body: Value,
        key: Option<&str>,
    ) -> Result<Value, CallError> {
        let key = key
            .map(str::to_string)
            .unwrap_or(self.idempotency_key.clone());
        self.call(method, path, Some(body), Some(&key)).await
    }

    async fn call(
        &mut self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
        key: Option<&str>,
    ) -> Result<Value, CallError> {
        let deadline = tokio::time::Instant::now() + self.failover_deadline;
        let mut tried = 0usize;
        loop {
            let url = format!("{}{path}", self.urls[self.current]);
            let mut req = self
                .http
                .request(method.clone(), &url)
                .bearer_auth(&self.token);
            if let Some(b) = &body {
                req = req.json(b);
            }
            if let Some(k) = key {
                req = req.header("Idempotency-Key", k);
            }
            let why = match req.send().await {
                Err(e) => format!("{}: {}", self.urls[self.current], e.without_url()),
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    let v: Value = resp.json().await.unwrap_or(Value::Null);
                    if (200..300).contains(&status) {
                        return Ok(v);
                    }
                    refusal_or_retry(status, v, &self.urls[self.current])?
                }
            };
            tried += 1;
            self.current = (self.current + 1) % self.urls.len();
            if tokio::time::Instant::now() >= deadline {
                return Err(CallError::Unreachable(why));
            }
            if tried.is_multiple_of(self.urls.len()) {
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    }

    /// Download a binary body (a backup) from the first member that answers, reporting
    /// progress on stderr from its length; no failover in the middle of a body.
    pub async fn download(&mut self, path: &str) -> Result<Vec<u8>, CallError> {
        let deadline = tokio::time::Instant::now() + self.failover_deadline;
        loop {
            let url = format!("{}{path}", self.urls[self.current]);
            let resp = self
                .http
                .get(&url)
                .bearer_auth(&self.token)
                .timeout(Duration::from_secs(3600))
                .send()
                .await;
            let why = match resp {
                Err(e) => format!("{}: {}", self.urls[self.current], e.without_url()),
                Ok(mut resp) if resp.status().is_success() => {
                    let total = resp.content_length();
                    let mut out = Vec::with_capacity(total.unwrap_or(0) as usize);
                    let mut shown = 0u64;
                    loop {
                        match resp.chunk().await {
                            Ok(Some(chunk)) => out.extend_from_slice(&chunk),
                            Ok(None) => break,
                            Err(e) => {
                                return Err(CallError::Unreachable(format!(
                                    "{url}: the body broke off after {} bytes: {}",
                                    out.len(),
                                    e.without_url()
                                )));
                            }
                        }
                        let got = out.len() as u64;
                        if got - shown >= 8 << 20 {
                            shown = got;
                            match total {
                                Some(t) => eprintln!(
                                    "  {:.1} of {:.1} MiB ({:.0}%)",
                                    got as f64 / 1048576.0,
                                    t as f64 / 1048576.0,
                                    got as f64 * 100.0 / t.max(1) as f64
                                ),
                                None => eprintln!("  {:.1} MiB", got as f64 / 1048576.0),
                            }
                        }
                    }
                    return Ok(out);
                }
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    let v: Value = resp.json().await.unwrap_or(Value::Null);
                    refusal_or_retry(status, v, &url)?
                }
            };
            self.current = (self.current + 1) % self.urls.len();
            if tokio::time::Instant::now() >= deadline {
                return Err(CallError::Unreachable(why));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

/// An error answer: a refusal to report (Err), or why to try another member (Ok) when the
/// member was busy or had no leader (429, 502, 503, 504).
fn refusal_or_retry(status: u16, body: Value, url: &str) -> Result<String, CallError> {
    let (code, message) = match serde_json::from_value::<ErrorBody>(body) {
        Ok(e) => (e.error.code, e.error.message),
        Err(_) => ("unknown".to_string(), format!("HTTP {status}")),
    };
    if !matches!(status, 429 | 502 | 503 | 504) {
        return Err(CallError::Refused {
            status,
            code,
            message,
        });
    }
    Ok(format!("{url}: {status} {code}: {message}"))
}
