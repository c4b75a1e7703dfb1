//! A quick load run: the hot paths of a real 3-member cluster on loopback, each next to its
//! reference measured in the same run. Issue 5 grows this into the full benchmark.
//!
//! `cargo build --release --workspace --bins --examples && target/release/examples/loadgen`
//! Options: `--duration-ms N` (per scenario, default 5000), `--agents N` (default 200),
//! `--concurrency N` (heartbeat loops, default 64). Prints a table and writes
//! `target/loadgen.json`. Traffic goes to 127.0.0.1 only; every loop is bounded in time.

use std::process::Child;
use std::process::Command;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering;
use std::time::Duration;
use std::time::Instant;

use modelforge_proto::identity::IdentityKey;
use serde_json::Value;
use serde_json::json;

const ADMIN: &str = "loadgen-admin-token-0123456789abcdef";

fn arg(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Stats {
    ok: usize,
    failed: usize,
    secs: f64,
    lat: Vec<Duration>,
}

impl Stats {
    fn rate(&self) -> f64 {
        self.ok as f64 / self.secs
    }
    fn pct(&self, p: f64) -> f64 {
        if self.lat.is_empty() {
            return 0.0;
        }
        let i = ((self.lat.len() as f64 * p) as usize).min(self.lat.len() - 1);
        self.lat[i].as_secs_f64() * 1000.0
    }
    fn json(&self) -> Value {
        json!({"ok": self.ok, "failed": self.failed, "per_s": self.rate(), "p50_ms": self.pct(0.5), "p99_ms": self.pct(0.99)})
    }
}

/// Run `loops` concurrent loops of `op` for `dur`; each op returns whether it succeeded.
async fn drive<F, Fut>(loops: usize, dur: Duration, op: F) -> Stats
where
    F: Fn(usize, usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    let op = Arc::new(op);
    let start = Instant::now();
    let counter = Arc::new(AtomicUsize::new(0));
    let mut tasks = vec![];
    for l in 0..loops {
        let op = op.clone();
        let counter = counter.clone();
        tasks.push(tokio::spawn(async move {
            let mut lat = vec![];
            let mut failed = 0;
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
    let mut lat = vec![];
    let mut failed = 0;
    for t in tasks {
        let (l, f) = t.await.unwrap();
        lat.extend(l);
        failed += f;
    }
    lat.sort();
    Stats {
        ok: lat.len(),
        failed,
        secs: start.elapsed().as_secs_f64(),
        lat,
    }
}

async fn bare_axum() -> String {
    use axum::routing::post;
    let app = axum::Router::new().route(
        "/hb",
        post(
            |axum::Json(t): axum::Json<modelforge_proto::wire::Telemetry>| async move {
                axum::Json(json!({"status": "ok", "gpus": t.accelerators.len()}))
            },
        ),
    );
    let port = free_port();
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://127.0.0.1:{port}")
}

fn telemetry() -> Value {
    json!({"accelerators": (0..8).map(|i| json!({
        "uuid": format!("GPU-{i:08x}-0000-0000-0000-000000000000"), "utilization_pct": 93.5, "memory_used_mib": 61234.0,
        "temperature_c": 71.0, "power_draw_w": 612.4, "ecc_errors_uncorrected": 0})).collect::<Vec<_>>()})
}

struct Member {
    url: String,
    child: Option<Child>,
}

fn start_cluster(dir: &std::path::Path) -> Vec<Member> {
    let bin = std::env::current_exe()
        .unwrap()
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("modelforge");
    let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let peers: Vec<String> = ports
        .iter()
        .enumerate()
        .map(|(i, p)| format!("{}=http://127.0.0.1:{p}", i + 1))
        .collect();
    (0..3)
        .map(|i| {
            let mut c = Command::new(&bin);
            c.args([
                "serve",
                "--node-id",
                &(i + 1).to_string(),
                "--listen",
                &format!("127.0.0.1:{}", ports[i]),
            ]);
            c.args([
                "--data-dir",
                &dir.join(format!("m{}", i + 1)).display().to_string(),
            ]);
            for p in &peers {
                c.args(["--peer", p]);
            }
            // Extra serve flags for experiments, e.g. LOADGEN_SERVE_ARGS="--raft-election-timeout 250ms".
            if let Ok(extra) = std::env::var("LOADGEN_SERVE_ARGS") {
                c.args(extra.split_whitespace());
            }
            let log = std::fs::File::create(dir.join(format!("m{}.log", i + 1))).unwrap();
            c.env("MODELFORGE_ADMIN_TOKEN", ADMIN)
                .stdout(Stdio::null())
                .stderr(log);
            Member {
                url: format!("http://127.0.0.1:{}", ports[i]),
                child: Some(
                    c.spawn()
                        .expect("start modelforge (build it with --release)"),
                ),
            }
        })
        .collect()
}

async fn leader(http: &reqwest::Client, members: &[Member]) -> Option<usize> {
    for m in members.iter().filter(|m| m.child.is_some()) {
        if let Ok(r) = http
            .get(format!("{}/api/v1/cluster", m.url))
            .bearer_auth(ADMIN)
            .send()
            .await
            && let Ok(v) = r.json::<Value>().await
            && let Some(l) = v["leader_id"].as_u64()
        {
            return Some(l as usize - 1);
        }
    }
    None
}

fn b64(bytes: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = ((b[0] as u32) << 16) | ((b[1] as u32) << 8) | b[2] as u32;
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(T[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Start a 3-member etcd on loopback (killed when the process exits); its client URLs.
async fn start_etcd(dir: &std::path::Path) -> Option<Vec<String>> {
    let bin = ["/usr/bin/etcd", "/usr/local/bin/etcd"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())?;
    let client: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let peer: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let initial: Vec<String> = (0..3)
        .map(|i| format!("e{i}=http://127.0.0.1:{}", peer[i]))
        .collect();
    for i in 0..3 {
        let log = std::fs::File::create(dir.join(format!("etcd{i}.log"))).ok()?;
        let child = Command::new(bin)
            .args([
                "--name",
                &format!("e{i}"),
                "--data-dir",
                &dir.join(format!("etcd{i}")).display().to_string(),
            ])
            .args([
                "--listen-client-urls",
                &format!("http://127.0.0.1:{}", client[i]),
                "--advertise-client-urls",
                &format!("http://127.0.0.1:{}", client[i]),
            ])
            .args([
                "--listen-peer-urls",
                &format!("http://127.0.0.1:{}", peer[i]),
                "--initial-advertise-peer-urls",
                &format!("http://127.0.0.1:{}", peer[i]),
            ])
            .args([
                "--initial-cluster",
                &initial.join(","),
                "--initial-cluster-state",
                "new",
                "--initial-cluster-token",
                "loadgen",
            ])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .ok()?;
        ETCD_PIDS.lock().unwrap().push(child);
    }
    let urls: Vec<String> = client
        .iter()
        .map(|p| format!("http://127.0.0.1:{p}"))
        .collect();
    let http = reqwest::Client::builder().no_proxy().build().ok()?;
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(30) {
        let mut healthy = 0;
        for u in &urls {
            if let Ok(r) = http.get(format!("{u}/health")).send().await
                && r.json::<Value>().await.is_ok_and(|v| v["health"] == "true")
            {
                healthy += 1;
            }
        }
        if healthy == 3 {
            return Some(urls);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

static ETCD_PIDS: std::sync::Mutex<Vec<Child>> = std::sync::Mutex::new(Vec::new());

#[tokio::main]
async fn main() {
    let dur = Duration::from_millis(arg("--duration-ms", 5000));
    let n_agents = arg("--agents", 200) as usize;
    let conc = arg("--concurrency", 64) as usize;
    let http = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(512)
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let mut report = serde_json::Map::new();

    // Reference: a bare axum handler taking the same body.
    let bare = bare_axum().await;
    let body = telemetry();
    let (h, b, u) = (http.clone(), body.clone(), format!("{bare}/hb"));
    let s = drive(conc, dur, move |_, _| {
        let (h, b, u) = (h.clone(), b.clone(), u.clone());
        async move {
            h.post(&u)
                .json(&b)
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
        }
    })
    .await;
    println!(
        "bare axum handler:                {:>8.0}/s  p50 {:>6.2} ms  p99 {:>6.2} ms",
        s.rate(),
        s.pct(0.5),
        s.pct(0.99)
    );
    report.insert("bare_axum".into(), s.json());
    let bare_rate = s.rate();

    let dir = tempfile::tempdir().unwrap();
    let mut members = start_cluster(dir.path());
    let urls: Vec<String> = members.iter().map(|m| m.url.clone()).collect();
    let t0 = Instant::now();
    let l = loop {
        if let Some(l) = leader(&http, &members).await {
            break l;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "no leader");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let leader_url = urls[l].clone();

    // Argon2 bound at the configured (default) parameters.
    let params = argon2::Params::default();
    let a = argon2::Argon2::new(argon2::Algorithm::Argon2id, argon2::Version::V0x13, params);
    let t = Instant::now();
    for _ in 0..5 {
        use argon2::PasswordHasher;
        let _ = a.hash_password(b"mfnc_bench");
    }
    let one = t.elapsed().as_secs_f64() / 5.0;
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let bound = cores as f64 / one;
    println!(
        "argon2id one hash {:.1} ms: bound {:.1} hashes/s on {cores} cores",
        one * 1000.0,
        bound
    );

    // Tokens (one hash each), then a burst of enrolments (one verify + one hash each).
    let t = Instant::now();
    let mut tokens = vec![];
    let mut pending = vec![];
    for i in 0..n_agents {
        let (h, u) = (http.clone(), leader_url.clone());
        pending.push(tokio::spawn(async move {
            let r = h
                .post(format!("{u}/api/v1/admin/node-enrollments"))
                .bearer_auth(ADMIN)
                .json(&json!({"ttl_seconds": 3600}))
                .send()
                .await
                .unwrap();
            r.json::<Value>().await.unwrap()["token"]
                .as_str()
                .unwrap()
                .to_string()
        }));
        if pending.len() >= 8 || i + 1 == n_agents {
            for p in pending.drain(..) {
                tokens.push(p.await.unwrap());
            }
        }
    }
    let token_rate = n_agents as f64 / t.elapsed().as_secs_f64();
    println!(
        "token creation (8 concurrent):    {token_rate:>8.1}/s  ({:.2} of the argon2 bound)",
        token_rate / bound
    );
    let t = Instant::now();
    let mut joins = vec![];
    for (i, tok) in tokens.iter().enumerate() {
        let (h, u, tok) = (http.clone(), urls[i % 3].clone(), tok.clone());
        joins.push(tokio::spawn(async move {
            let key = IdentityKey::generate();
            let host = format!("load-{i}");
            let body = json!({"token": tok, "hostname": host, "identity": key.prove(&tok[5..37], &host, modelforge_proto::now_ms(), None),
                "inventory": {"accelerators": [], "storage_roots": []}});
            let r = h.post(format!("{u}/api/v1/agent/enroll")).json(&body).send().await.unwrap();
            let v: Value = r.json().await.unwrap();
            (v["node_id"].as_str().unwrap_or_default().to_string(), v["credential"].as_str().unwrap_or_default().to_string())
        }));
    }
    let mut agents = vec![];
    for j in joins {
        agents.push(j.await.unwrap());
    }
    let enrol_rate = n_agents as f64 / t.elapsed().as_secs_f64();
    let enrolled = agents.iter().filter(|a| !a.0.is_empty()).count();
    println!(
        "enrolment burst ({n_agents} at once):    {enrol_rate:>8.1}/s  ({:.2} of the argon2 bound; {enrolled} enrolled)",
        enrol_rate / bound
    );
    report.insert(
        "argon2".into(),
        json!({"hash_ms": one * 1000.0, "bound_per_s": bound, "cores": cores}),
    );
    report.insert("token_create_per_s".into(), json!(token_rate));
    report.insert("enrol_burst".into(), json!({"agents": n_agents, "per_s": enrol_rate, "of_bound": enrol_rate / bound, "enrolled": enrolled}));
    let agents = Arc::new(agents);

    // Warm the verified cache (first use of each credential), then heartbeats.
    for (i, (nid, cred)) in agents.iter().enumerate() {
        let _ = http
            .post(format!(
                "{}/api/v1/agent/nodes/{nid}/heartbeat",
                urls[i % 3]
            ))
            .bearer_auth(cred)
            .json(&json!({}))
            .send()
            .await;
    }
    for (name, spread) in [
        ("heartbeats, all to the leader", false),
        ("heartbeats, spread over 3", true),
    ] {
        let (h, b, ag, us, lu) = (
            http.clone(),
            body.clone(),
            agents.clone(),
            urls.clone(),
            leader_url.clone(),
        );
        let s = drive(conc, dur, move |_, n| {
            let (h, b, ag) = (h.clone(), b.clone(), ag.clone());
            let u = if spread {
                us[n % 3].clone()
            } else {
                lu.clone()
            };
            async move {
                let (nid, cred) = &ag[n % ag.len()];
                h.post(format!("{u}/api/v1/agent/nodes/{nid}/heartbeat"))
                    .bearer_auth(cred)
                    .json(&b)
                    .send()
                    .await
                    .is_ok_and(|r| r.status() == 200)
            }
        })
        .await;
        println!(
            "{name:<33} {:>8.0}/s  p50 {:>6.2} ms  p99 {:>6.2} ms  ({:.2} of bare axum; {} failed)",
            s.rate(),
            s.pct(0.5),
            s.pct(0.99),
            s.rate() / bare_rate,
            s.failed
        );
        report.insert(name.replace([',', ' '], "_"), s.json());
    }

    // Replicated writes that hash no secret: revocations (a retried revoke is a real write).
    for c in [1usize, 16, 128] {
        let (h, ag, lu) = (http.clone(), agents.clone(), leader_url.clone());
        let s = drive(c, dur, move |_, n| {
            let (h, ag, lu) = (h.clone(), ag.clone(), lu.clone());
            async move {
                let (nid, _) = &ag[n % ag.len()];
                h.delete(format!("{lu}/api/v1/admin/hardware/nodes/{nid}/credential"))
                    .bearer_auth(ADMIN)
                    .send()
                    .await
                    .is_ok_and(|r| r.status() == 200)
            }
        })
        .await;
        println!(
            "revocations, {c:>3} clients:         {:>8.0}/s  p50 {:>6.2} ms  p99 {:>6.2} ms",
            s.rate(),
            s.pct(0.5),
            s.pct(0.99)
        );
        report.insert(format!("writes_{c}_clients"), s.json());
    }

    // Reference for replicated writes: a 3-member etcd 3.4 on loopback, written through its HTTP
    // gateway with the same concurrency and default durability (Debian: etcd-server).
    if let Some(etcd_urls) = start_etcd(dir.path()).await {
        for c in [1usize, 16, 128] {
            let (h, us) = (http.clone(), etcd_urls.clone());
            let s = drive(c, dur, move |l, n| {
                let (h, u) = (h.clone(), us[l % us.len()].clone());
                async move {
                    // key and value base64-encoded, as the gateway wants them
                    let key = b64(format!("k{n}").as_bytes());
                    let body = json!({"key": key, "value": "dmFsdWU="});
                    h.post(format!("{u}/v3/kv/put"))
                        .json(&body)
                        .send()
                        .await
                        .is_ok_and(|r| r.status() == 200)
                }
            })
            .await;
            println!(
                "etcd puts,   {c:>3} clients:         {:>8.0}/s  p50 {:>6.2} ms  p99 {:>6.2} ms",
                s.rate(),
                s.pct(0.5),
                s.pct(0.99)
            );
            report.insert(format!("etcd_{c}_clients"), s.json());
        }
    } else {
        println!("etcd reference: skipped (no etcd binary; apt-get install etcd-server)");
    }

    // Failover: kill -9 the leader; time to the next acknowledged write through a survivor.
    let nid = agents[0].0.clone();
    let mut child = members[l].child.take().unwrap();
    let t = Instant::now();
    child.kill().unwrap();
    let _ = child.wait();
    let survivors: Vec<String> = urls
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != l)
        .map(|(_, u)| u.clone())
        .collect();
    let mut n = 0;
    let mut elected = None;
    let failover = loop {
        if elected.is_none() && leader(&http, &members).await.is_some_and(|nl| nl != l) {
            elected = Some(t.elapsed());
        }
        let u = &survivors[n % survivors.len()];
        n += 1;
        let r = http
            .delete(format!("{u}/api/v1/admin/hardware/nodes/{nid}/credential"))
            .bearer_auth(ADMIN)
            .timeout(Duration::from_secs(2))
            .send()
            .await;
        if r.is_ok_and(|r| r.status() == 200) {
            break t.elapsed();
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "no write acknowledged within 30 s of the leader's death"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let elected_ms = elected.map(|e| e.as_secs_f64() * 1000.0);
    println!(
        "failover: kill -9 leader -> next acknowledged write: {:.0} ms (new leader seen after {elected_ms:?} ms)",
        failover.as_secs_f64() * 1000.0
    );
    report.insert("failover_ms".into(), json!(failover.as_secs_f64() * 1000.0));

    for m in members.iter_mut() {
        if let Some(mut c) = m.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
    for mut c in ETCD_PIDS.lock().unwrap().drain(..) {
        let _ = c.kill();
        let _ = c.wait();
    }
    let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/loadgen.json");
    std::fs::write(
        &out,
        serde_json::to_string_pretty(&Value::Object(report)).unwrap(),
    )
    .unwrap();
    println!("figures written to {}", out.display());
}
