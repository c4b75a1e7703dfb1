//! The CLI's HTTP client: any member, failover between the `--server` URLs, one
//! `Idempotency-Key` per invocation so a write moved to another member never applies twice.

use std::time::Duration;

use modelforge_client::Answer;
use modelforge_client::Failover;
use modelforge_client::Request;
use modelforge_client::classify;
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
    /// A member answered 2xx with a body that is not the endpoint's type (another version?).
    BadAnswer(String),
}

pub struct Client {
    cluster: Failover,
    token: String,
    tls: Option<rustls::ClientConfig>,
    /// Sent with every write of this invocation (unless the command names its own key).
    idempotency_key: String,
    /// How long one call keeps trying members that do not answer or answer 503.
    failover_deadline: Duration,
    /// Shows long reads (lists of many pages, downloads); hidden unless stderr is a terminal
    /// (`output::progress`).
    pub progress: indicatif::ProgressBar,
}

impl Client {
    pub fn new(
        urls: Vec<String>,
        token: String,
        failover_deadline: Duration,
        tls: Option<rustls::ClientConfig>,
    ) -> anyhow::Result<Self> {
        let cluster = Failover::new(
            urls,
            Duration::from_secs(1),
            Duration::from_secs(20),
            tls.clone(),
        )
        .map_err(|e| anyhow::anyhow!("--server: {e}"))?;
        Ok(Self {
            cluster,
            token,
            tls,
            idempotency_key: format!("cli-{}", modelforge_proto::new_uuid()),
            failover_deadline,
            progress: indicatif::ProgressBar::hidden(),
        })
    }

    /// A client of this one's token and trust for the member at `url` alone.
    pub fn at(&self, url: &str) -> anyhow::Result<Self> {
        Self::new(
            vec![url.to_string()],
            self.token.clone(),
            self.failover_deadline,
            self.tls.clone(),
        )
    }

    /// The member URLs, as given.
    pub fn urls(&self) -> &[String] {
        self.cluster.urls()
    }

    /// The `X-Modelforge-Index` of the last answer, if it carried one.
    pub fn last_index(&self) -> Option<u64> {
        self.cluster.index()
    }

    /// Wait (a blocking query on `path`, 15 s at a time) until the view's index differs from
    /// `index`; the new index. 0 never matches an index, so it answers at once.
    pub async fn wait_change(&mut self, path: &str, index: u64) -> Result<u64, CallError> {
        let sep = if path.contains('?') { '&' } else { '?' };
        loop {
            self.get(&format!("{path}{sep}index={index}&wait=15s"))
                .await?;
            match self.last_index() {
                Some(now) if now != index => return Ok(now),
                Some(_) => continue,
                None => {
                    return Err(CallError::BadAnswer(format!(
                        "{path}: the answer carries no X-Modelforge-Index"
                    )));
                }
            }
        }
    }

    pub async fn get(&mut self, path: &str) -> Result<Value, CallError> {
        self.call(reqwest::Method::GET, path, None, None).await
    }

    /// A GET answered with the endpoint's type from `modelforge_proto::api`, and the JSON as
    /// the member sent it (what `--output json` prints).
    pub async fn get_typed<T: serde::de::DeserializeOwned>(
        &mut self,
        path: &str,
    ) -> Result<(T, Value), CallError> {
        let v = self.get(path).await?;
        typed(v, path)
    }

    /// Every page of a list (or its first `most` items), following `next` with pages of up to
    /// 1,000: the items of `field` in one array, and `next` null unless `most` cut it short.
    pub async fn get_all_typed<T: serde::de::DeserializeOwned>(
        &mut self,
        path: &str,
        field: &str,
        most: Option<usize>,
    ) -> Result<(T, Value), CallError> {
        let sep = if path.contains('?') { '&' } else { '?' };
        let mut items: Vec<Value> = vec![];
        let mut after: Option<String> = None;
        loop {
            let want = most.map_or(1000, |m| m.saturating_sub(items.len()).clamp(1, 1000));
            let mut page_path = format!("{path}{sep}limit={want}");
            if let Some(a) = &after {
                // Cursors are ids, digits and '.', safe in a query as they are.
                page_path.push_str(&format!("&after={a}"));
            }
            let mut v = self.get(&page_path).await?;
            if let Some(Value::Array(a)) = v.get_mut(field).map(Value::take) {
                items.extend(a);
            }
            after = v.get("next").and_then(Value::as_str).map(str::to_string);
            let full = most.is_some_and(|m| items.len() >= m);
            if after.is_none() || full {
                self.progress.finish_and_clear();
                v[field] = Value::Array(items);
                return typed(v, path);
            }
            // More pages: a counter on the terminal.
            if self.progress.position() == 0 {
                self.progress.set_style(
                    indicatif::ProgressStyle::with_template("{spinner} {msg}: {pos} {elapsed}")
                        .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
                );
                self.progress.set_message(format!("reading {field}"));
            }
            self.progress.set_position(items.len() as u64);
        }
    }

    /// A write of a request body from `modelforge_proto::api`, answered with the endpoint's
    /// type, and the JSON as sent. `key` overrides the invocation's idempotency key.
    pub async fn write_typed<T: serde::de::DeserializeOwned>(
        &mut self,
        method: reqwest::Method,
        path: &str,
        body: &impl serde::Serialize,
        key: Option<&str>,
    ) -> Result<(T, Value), CallError> {
        let key = key
            .map(str::to_string)
            .unwrap_or(self.idempotency_key.clone());
        let body = serde_json::to_value(body).unwrap_or(Value::Null);
        let v = self.call(method, path, Some(body), Some(&key)).await?;
        typed(v, path)
    }

    async fn call(
        &mut self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
        key: Option<&str>,
    ) -> Result<Value, CallError> {
        let req = Request {
            method,
            path,
            bearer: Some(&self.token),
            body: body.map(|b| b.to_string().into_bytes()),
            idempotency_key: key,
        };
        match self.cluster.send_within(&req, self.failover_deadline).await {
            Answer::Ok(v) => Ok(v),
            Answer::Refused(status, code, message) => Err(CallError::Refused {
                status,
                code,
                message,
            }),
            Answer::Unavailable(why) => Err(CallError::Unreachable(why)),
        }
    }

    /// Download a binary body (a backup) from the first member that answers, reporting
    /// progress on stderr from its length; no failover in the middle of a body.
    pub async fn download(&mut self, path: &str) -> Result<Vec<u8>, CallError> {
        let deadline = tokio::time::Instant::now() + self.failover_deadline;
        loop {
            let url = format!("{}{path}", self.cluster.current());
            let resp = self
                .cluster
                .http()
                .get(&url)
                .bearer_auth(&self.token)
                .timeout(Duration::from_secs(3600))
                .send()
                .await;
            let why = match resp {
                Err(e) => format!("{url}: {}", e.without_url()),
                Ok(mut resp) if resp.status().is_success() => {
                    let total = resp.content_length();
                    let mut out = Vec::with_capacity(total.unwrap_or(0) as usize);
                    self.progress.set_style(
                        indicatif::ProgressStyle::with_template(
                            "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} {eta}",
                        )
                        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                        .progress_chars("=> "),
                    );
                    self.progress.set_message("downloading");
                    if let Some(t) = total {
                        self.progress.set_length(t);
                    }
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
                        self.progress.set_position(out.len() as u64);
                    }
                    self.progress.finish_and_clear();
                    return Ok(out);
                }
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    let v: Value = resp.json().await.unwrap_or(Value::Null);
                    match classify(status, v, &url) {
                        Answer::Refused(status, code, message) => {
                            return Err(CallError::Refused {
                                status,
                                code,
                                message,
                            });
                        }
                        Answer::Unavailable(why) => why,
                        // 2xx is taken above; nothing else classifies as a result.
                        Answer::Ok(_) => format!("{url}: {status}"),
                    }
                }
            };
            self.cluster.advance();
            if tokio::time::Instant::now() >= deadline {
                return Err(CallError::Unreachable(why));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

/// Decode an answer as its endpoint's type, keeping the JSON.
fn typed<T: serde::de::DeserializeOwned>(v: Value, path: &str) -> Result<(T, Value), CallError> {
    match serde_json::from_value(v.clone()) {
        Ok(t) => Ok((t, v)),
        Err(e) => Err(CallError::BadAnswer(format!("{path}: {e}"))),
    }
}
