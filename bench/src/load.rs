//! The load generator: closed loops for throughput, and simulated agents (each with its own
//! Ed25519 identity, credential, heartbeat interval and realistic telemetry body) for open-loop
//! load and failover. Every loop is bounded by a deadline; every URL is loopback.

use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering;
use std::time::Duration;
use std::time::Instant;

use futures_util::StreamExt;
use modelforge_proto::api;
use modelforge_proto::identity::IdentityKey;
use modelforge_proto::wire;
use serde_json::Value;
use serde_json::json;

use crate::cluster::ADMIN;

/// An answer (a `serde_json::Value`) read as its endpoint's type `$t` from `modelforge_proto`;
/// one that does not decode panics with `$what` and the body, so a drifted field is never
/// read as missing. (A macro: the crate does not name serde's traits.)
macro_rules! typed {
    ($t:ty, $what:expr, $v:expr) => {{
        let v: &Value = $v;
        serde_json::from_value::<$t>(v.clone()).unwrap_or_else(|e| {
            panic!(
                "{}: the answer is not a {} ({e}): {v}",
                $what,
                stringify!($t)
            )
        })
    }};
}

/// The code of a refusal, or the whole body when it is not the contract's error body.
fn refusal_code(v: &Value) -> String {
    serde_json::from_value::<wire::ErrorBody>(v.clone())
        .map(|b| b.error.code.to_string())
        .unwrap_or_else(|_| v.to_string())
}

/// The load client: trusts the harness CA when the members speak TLS.
pub fn client() -> reqwest::Client {
    modelforge_devkit::install_tls_provider();
    let b = reqwest::Client::builder()
        .no_proxy()
        // As many idle connections as simulated agents: a real agent keeps its own, and over
        // TLS a connection opened per request would measure handshakes, not heartbeats.
        .pool_max_idle_per_host(16_384)
        // Below the members' header-read timeout, which closes idle connections at 30 s.
        .pool_idle_timeout(Duration::from_secs(20))
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(30));
    modelforge_devkit::with_harness_tls(b)
        .build()
        .expect("http client")
}

/// Latencies and counts of one measured run.
pub struct Stats {
    pub ok: usize,
    pub failed: usize,
    pub secs: f64,
    pub lat: Vec<Duration>,
}

impl Stats {
    pub fn new(mut lat: Vec<Duration>, failed: usize, secs: f64) -> Self {
        lat.sort();
        Self {
            ok: lat.len(),
            failed,
            secs,
            lat,
        }
    }
    pub fn rate(&self) -> f64 {
        self.ok as f64 / self.secs.max(1e-9)
    }
    pub fn pct(&self, p: f64) -> f64 {
        if self.lat.is_empty() {
            return 0.0;
        }
        let i = ((self.lat.len() as f64 * p) as usize).min(self.lat.len() - 1);
        self.lat[i].as_secs_f64() * 1000.0
    }
    /// Two runs of the same thing as one: their answers and failures over their summed time.
    pub fn merge(self, other: Stats) -> Stats {
        let (mut lat, mut more) = (self.lat, other.lat);
        lat.append(&mut more);
        Stats::new(lat, self.failed + other.failed, self.secs + other.secs)
    }
    pub fn json(&self) -> Value {
        json!({"ok": self.ok, "failed": self.failed, "secs": self.secs, "per_s": self.rate(),
               "p50_ms": self.pct(0.5), "p99_ms": self.pct(0.99)})
    }
}

/// Run `loops` concurrent closed loops of `op` for `dur`; `op(loop, n)` says whether it succeeded.
pub async fn drive<F, Fut>(loops: usize, dur: Duration, op: F) -> Stats
where
    F: Fn(usize, usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    let op = Arc::new(op);
    let start = Instant::now();
    let counter = Arc::new(AtomicUsize::new(0));
    let mut tasks = vec![];
    for l in 0..loops {
        let (op, counter) = (op.clone(), counter.clone());
        tasks.push(tokio::spawn(async move {
            let (mut lat, mut failed) = (vec![], 0);
            while start.elapsed() < dur {
                let n = counter.fetch_add(1, Ordering::Relaxed);
                let t = Instant::now();
                if op(l, n).await {
                    lat.push(t.elapsed());
                } else {
                    failed += 1;
                }
            }
            (lat, failed)
        }));
    }
    let (mut lat, mut failed) = (vec![], 0);
    for t in tasks {
        let (l, f) = t.await.expect("load loop");
        lat.extend(l);
        failed += f;
    }
    Stats::new(lat, failed, start.elapsed().as_secs_f64())
}

/// Measure `a` and `b` alternately, two rounds of `dur / 2` each (a, b, a, b), so that a
/// change of this shared machine's speed meanwhile lands on both alike; each comes back as one
/// run of `dur`. `run(which, dur)` measures `a` when `which` is false and `b` when it is true.
pub async fn alternate<F, Fut>(dur: Duration, run: F) -> (Stats, Stats)
where
    F: Fn(bool, Duration) -> Fut,
    Fut: std::future::Future<Output = Stats>,
{
    let (mut a, mut b) = (None::<Stats>, None::<Stats>);
    for _ in 0..2 {
        for which in [false, true] {
            let s = run(which, dur / 2).await;
            let slot = if which { &mut b } else { &mut a };
            *slot = Some(match slot.take() {
                Some(earlier) => earlier.merge(s),
                None => s,
            });
        }
    }
    (a.expect("measured"), b.expect("measured"))
}

/// A simulated agent: a real identity and credential, and the body it heartbeats with.
#[derive(Clone)]
pub struct SimAgent {
    pub index: usize,
    pub node_id: String,
    pub credential: String,
    /// Serialised once: the load generator must not spend its CPU re-encoding.
    pub telemetry: Vec<u8>,
}

fn gpu_uuid(agent: usize, g: usize) -> String {
    format!("GPU-{agent:08x}-{g:04x}-4a1b-9c2d-{:012x}", agent * 8 + g)
}

/// An inventory like an 8-GPU H100 server's (what NVML reports for one).
pub fn inventory(agent: usize) -> Value {
    json!({
        "accelerators": (0..8).map(|g| json!({
            "uuid": gpu_uuid(agent, g), "name": "NVIDIA H100 80GB HBM3", "memory_total_mib": 81559,
            "pci_bus_id": format!("00000000:{:02X}:00.0", 0x18 + g * 0x10), "index": g,
            "mig_mode": "disabled", "power_limit_w": 700})).collect::<Vec<_>>(),
        "storage_roots": [
            {"path": "/", "capacity_bytes": 1_919_850_000_000u64, "free_bytes": 1_200_000_000_000u64},
            {"path": "/scratch", "capacity_bytes": 30_720_000_000_000u64, "free_bytes": 21_000_000_000_000u64},
        ],
        "driver_version": "550.54.15", "cuda_version": "12.4", "nvml": "ok",
    })
}

/// A heartbeat body like the agent sends: 8 GPUs with utilisation, memory, temperature,
/// power, ECC and one compute process each.
pub fn telemetry(agent: usize) -> Value {
    json!({"accelerators": (0..8).map(|g| json!({
        "uuid": gpu_uuid(agent, g), "utilization_pct": 90.0 + (g as f64) * 0.5,
        "memory_used_mib": 61234.0 + g as f64, "temperature_c": 68.0 + g as f64,
        "power_draw_w": 612.4 + g as f64, "ecc_errors_uncorrected": 0,
        "processes": [{"pid": 4000 + g, "used_memory_mib": 61000.0}]})).collect::<Vec<_>>()})
}

/// Create `n` enrolment tokens through `url` with `conc` concurrent requests.
pub async fn create_tokens(
    http: &reqwest::Client,
    url: &str,
    n: usize,
    conc: usize,
) -> Vec<String> {
    let tokens: Vec<Option<String>> = futures_util::stream::iter(0..n)
        .map(|_| {
            let (h, u) = (http.clone(), url.to_string());
            async move {
                for _ in 0..20 {
                    if let Ok(r) = h
                        .post(format!("{u}/api/v1/admin/node-enrollments"))
                        .bearer_auth(ADMIN)
                        .json(&json!({"ttl_seconds": 86400, "note": "bench"}))
                        .send()
                        .await
                        && r.status() == 201
                        && let Ok(v) = r.json::<Value>().await
                    {
                        return Some(typed!(api::TokenIssued, "a new enrolment token", &v).token);
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                None
            }
        })
        .buffer_unordered(conc)
        .collect()
        .await;
    let tokens: Vec<String> = tokens.into_iter().flatten().collect();
    assert_eq!(tokens.len(), n, "could not create every enrolment token");
    tokens
}

/// Enrol one agent per token, `conc` at once, spread over `urls` (each agent its own identity,
/// hostname and 8-GPU inventory). Returns the agents that enrolled, and how many did not.
pub async fn enrol(
    http: &reqwest::Client,
    urls: &[String],
    tokens: Vec<String>,
    first_index: usize,
    conc: usize,
) -> (Vec<SimAgent>, usize) {
    let urls = Arc::new(urls.to_vec());
    let total = tokens.len();
    let agents: Vec<Option<SimAgent>> = futures_util::stream::iter(tokens.into_iter().enumerate())
        .map(|(k, tok)| {
            let (h, urls) = (http.clone(), urls.clone());
            async move {
                let i = first_index + k;
                let key = IdentityKey::generate();
                let host = format!("gpu-{i:06}.bench");
                // Like the agent: on no answer or 5xx try the next member; a retry of the same
                // claim by the same identity is safe, with a proof signed afresh (a member
                // refuses a proof no later than the one it accepted: a replay).
                let mut last = String::from("nothing");
                for attempt in 0..12 {
                    let u = &urls[(i + attempt) % urls.len()];
                    let body = json!({"token": tok, "hostname": host,
                        "identity": key.prove(&tok[5..37], &host, modelforge_proto::now_ms(), None),
                        "inventory": inventory(i)});
                    let r = match h
                        .post(format!("{u}/api/v1/agent/enroll"))
                        .json(&body)
                        .send()
                        .await
                    {
                        Ok(r) => r,
                        Err(e) => {
                            last = format!("no answer ({e})");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            continue;
                        }
                    };
                    let status = r.status().as_u16();
                    let Ok(v) = r.json::<Value>().await else {
                        last = format!("{status} without a JSON body");
                        continue;
                    };
                    last = format!("{status} {}", refusal_code(&v));
                    if status == 201 {
                        let tel = serde_json::to_vec(&telemetry(i)).expect("telemetry");
                        let e = typed!(wire::EnrollResponse, "an enrolment", &v);
                        return Some(SimAgent {
                            index: i,
                            node_id: e.node_id.to_string(),
                            credential: e.credential,
                            telemetry: tel,
                        });
                    }
                    if status < 500 && status != 429 {
                        eprintln!("enrolment {i} refused: {status} {}", refusal_code(&v));
                        return None;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                eprintln!("enrolment {i} not answered after 12 attempts (last: {last})");
                None
            }
        })
        .buffer_unordered(conc)
        .collect()
        .await;
    let agents: Vec<SimAgent> = agents.into_iter().flatten().collect();
    let failed = total - agents.len();
    (agents, failed)
}

/// One heartbeat of `a` to `url`; the HTTP status, or None when nothing answered.
pub async fn heartbeat(http: &reqwest::Client, url: &str, a: &SimAgent) -> Option<u16> {
    heartbeat_answer(http, url, a).await.0
}

/// One heartbeat: its status (None: no answer) and the answer's `Retry-After`, if any.
async fn heartbeat_answer(
    http: &reqwest::Client,
    url: &str,
    a: &SimAgent,
) -> (Option<u16>, Option<Duration>) {
    let resp = http
        .post(format!("{url}/api/v1/agent/nodes/{}/heartbeat", a.node_id))
        .bearer_auth(&a.credential)
        .header("content-type", "application/json")
        .body(a.telemetry.clone())
        .send()
        .await;
    let counting = COUNTING.load(std::sync::atomic::Ordering::Relaxed);
    let Ok(resp) = resp else {
        if counting {
            count_refusal("no answer".into());
        }
        return (None, None);
    };
    let status = resp.status().as_u16();
    let retry_after = resp
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
        .map(|s| Duration::from_secs(s.min(3600)));
    if status != 200 && counting {
        let body: serde_json::Value = resp.json().await.unwrap_or_default();
        let code = body["error"]["code"].as_str().unwrap_or("no error body");
        count_refusal(format!("{status} {code}"));
    }
    (Some(status), retry_after)
}

/// Whether a pass's answer is one the agent takes for "not delivered" (no answer, or a
/// member that cannot decide now).
fn undelivered(status: Option<u16>) -> bool {
    status.is_none_or(modelforge_client::cannot_decide_now)
}

/// Whether [`heartbeat`] counts its refusals (reading their bodies): only while a scenario
/// asks, so that the open-loop steps' load generator does no more than it did.
static COUNTING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Start or stop counting refusals (see [`take_refusals`]).
pub fn count_refusals(on: bool) {
    COUNTING.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// What heartbeat attempts other than 200 got (status and error code, or "no answer"), while
/// counting and since the last [`take_refusals`]: each attempt of [`agent_heartbeat`]'s pass
/// counts.
static REFUSALS: std::sync::Mutex<std::collections::BTreeMap<String, u64>> =
    std::sync::Mutex::new(std::collections::BTreeMap::new());

fn count_refusal(what: String) {
    *REFUSALS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry(what)
        .or_default() += 1;
}

/// The refusals counted since the last call (see [`REFUSALS`]).
pub fn take_refusals() -> std::collections::BTreeMap<String, u64> {
    std::mem::take(&mut *REFUSALS.lock().unwrap_or_else(|p| p.into_inner()))
}

/// One heartbeat as the real agent sends it: to its current member, and on no answer or a 5xx
/// to each of the others once; `current` moves to the member that answered.
pub async fn agent_heartbeat(
    http: &reqwest::Client,
    urls: &[String],
    current: &mut usize,
    a: &SimAgent,
) -> (Option<u16>, Option<Duration>) {
    let mut last = (None, None);
    for _ in 0..urls.len() {
        let (s, retry_after) = heartbeat_answer(http, &urls[*current], a).await;
        if let Some(code) = s
            && (code < 500 && code != 429)
        {
            return (Some(code), None);
        }
        last = (s.or(last.0), retry_after.or(last.1));
        *current = (*current + 1) % urls.len();
    }
    last
}

/// What one simulated agent saw: (scheduled at, answered at, status) per heartbeat.
pub type Trace = Vec<(Instant, Instant, Option<u16>)>;

/// Run every agent's heartbeat loop, open-loop: each agent sends at its own interval (first
/// send spread uniformly over one interval) until `deadline`; at most `in_flight` requests are
/// outstanding in all. Latency counts from the scheduled instant, so a backlog shows in it.
/// Like the agent, a heartbeat that was not delivered goes again after the answer's
/// `Retry-After` and up to as long again, and the agent's interval starts over from there.
pub async fn run_agents(
    http: &reqwest::Client,
    urls: &[String],
    agents: Arc<Vec<SimAgent>>,
    interval: Duration,
    deadline: Instant,
    in_flight: usize,
) -> Vec<Trace> {
    let gate = Arc::new(tokio::sync::Semaphore::new(in_flight));
    let urls = Arc::new(urls.to_vec());
    let n = agents.len();
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(n);
    for k in 0..n {
        let (h, urls, agents, gate) = (http.clone(), urls.clone(), agents.clone(), gate.clone());
        tasks.push(tokio::spawn(async move {
            let a = &agents[k];
            let mut current = a.index % urls.len();
            let mut next = start + interval.mul_f64(k as f64 / n as f64);
            let mut trace = Trace::new();
            while next < deadline {
                tokio::time::sleep_until(next.into()).await;
                let permit = gate.acquire().await.expect("gate");
                let (status, retry_after) = agent_heartbeat(&h, &urls, &mut current, a).await;
                drop(permit);
                trace.push((next, Instant::now(), status));
                next = if undelivered(status) {
                    Instant::now() + modelforge_client::redelivery_wait(retry_after)
                } else {
                    next + interval
                };
            }
            trace
        }));
    }
    let mut out = Vec::with_capacity(n);
    for t in tasks {
        out.push(t.await.expect("agent loop"));
    }
    out
}

/// Send one heartbeat per agent (their first use is written through Raft before the 200),
/// retried like the agent's next tick would; returns how many got 200, and the last status of
/// every one that never did.
pub async fn first_heartbeats(
    http: &reqwest::Client,
    urls: &[String],
    agents: &[SimAgent],
) -> (usize, std::collections::BTreeMap<String, usize>) {
    let results: Vec<Option<u16>> = futures_util::stream::iter(agents.iter())
        .map(|a| {
            let (h, urls) = (http.clone(), urls.to_vec());
            async move {
                let mut current = a.index % urls.len();
                let mut last = None;
                for _ in 0..10 {
                    last = agent_heartbeat(&h, &urls, &mut current, a).await.0;
                    if last == Some(200) {
                        break;
                    }
                    // Shed (the warm-up is itself a burst): back off as an agent does.
                    let wait = if last == Some(503) { 1_000 } else { 200 };
                    let jitter = u64::from(modelforge_proto::random_bytes::<2>()[0]) * 4;
                    tokio::time::sleep(Duration::from_millis(wait + jitter)).await;
                }
                last
            }
        })
        .buffer_unordered(256)
        .collect()
        .await;
    let mut failures = std::collections::BTreeMap::new();
    for r in &results {
        if *r != Some(200) {
            *failures
                .entry(r.map_or("no answer".to_string(), |s| s.to_string()))
                .or_insert(0) += 1;
        }
    }
    (results.len() - failures.values().sum::<usize>(), failures)
}
