//! `modelforge-bench`: the hot paths of a real 3-member ModelForge cluster on loopback, each
//! next to a reference measured in the same run (a bare axum endpoint, a 3-member etcd 3.4,
//! the argon2 bound), so that this machine's noise cancels out of the ratios.
//!
//! `cargo run --release -p modelforge-bench` runs the full profile (about 8 minutes on 2
//! cores); `--profile smoke` runs every scenario small (CI checks that it works, not how fast).
//! It builds the server binary it needs, prints a table and writes the figures as JSON
//! (`--out`, default `target/bench.json`).
//!
//! Two clusters: A runs at the default argon2 parameters (enrolment burst, heartbeat
//! throughput, replicated writes); B is the agent population (10,000 and 100,000 nodes,
//! open-loop heartbeats, failover, memory), enrolled with cheap argon2 parameters because a
//! population of 100,000 would otherwise take an hour of hashing here. Cheap parameters would
//! hide an argon2 storm after failover, so that scenario reports how many argon2 verifies the
//! surviving members ran, and what they would have cost at the default parameters.

mod cluster;
mod load;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;

use serde_json::Value;
use serde_json::json;

use cluster::ADMIN;
use cluster::Cluster;
use cluster::Etcd;
use load::Stats;
use load::drive;

struct Profile {
    name: &'static str,
    /// Each closed-loop scenario runs this long.
    dur: Duration,
    hb_loops: usize,
    burst: usize,
    population: [usize; 2],
    /// Offered heartbeat rates of the open-loop steps (agents at 1/s each).
    open_rates: &'static [usize],
    open_secs: u64,
    failover_agents: usize,
    failover_interval: Duration,
    write_clients: [usize; 3],
}

const FULL: Profile = Profile {
    name: "full",
    dur: Duration::from_secs(5),
    hb_loops: 64,
    burst: 1000,
    population: [10_000, 100_000],
    open_rates: &[2_000, 5_000, 10_000],
    open_secs: 8,
    failover_agents: 10_000,
    failover_interval: Duration::from_secs(5),
    write_clients: [1, 16, 128],
};

const SMOKE: Profile = Profile {
    name: "smoke",
    dur: Duration::from_millis(800),
    hb_loops: 16,
    burst: 30,
    population: [200, 400],
    open_rates: &[100, 200],
    open_secs: 2,
    failover_agents: 200,
    failover_interval: Duration::from_secs(1),
    write_clients: [1, 16, 128],
};

struct Args {
    profile: &'static Profile,
    out: PathBuf,
    server: Option<PathBuf>,
    etcd: bool,
}

fn parse_args() -> Args {
    let mut args = Args {
        profile: &FULL,
        out: PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/bench.json"),
        server: None,
        etcd: true,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--profile" => {
                args.profile = match it.next().as_deref() {
                    Some("full") => &FULL,
                    Some("smoke") => &SMOKE,
                    other => usage(&format!("unknown profile {other:?} (full or smoke)")),
                }
            }
            "--out" => {
                args.out = it
                    .next()
                    .unwrap_or_else(|| usage("--out needs a path"))
                    .into()
            }
            "--server" => {
                args.server = Some(
                    it.next()
                        .unwrap_or_else(|| usage("--server needs a path"))
                        .into(),
                )
            }
            "--no-etcd" => args.etcd = false,
            "-h" | "--help" => {
                println!(
                    "modelforge-bench [--profile full|smoke] [--out FILE] [--server PATH] [--no-etcd]"
                );
                std::process::exit(0);
            }
            other => usage(&format!("unknown argument {other}")),
        }
    }
    args
}

fn usage(msg: &str) -> ! {
    eprintln!("modelforge-bench: {msg}");
    std::process::exit(2)
}

/// The `modelforge` binary: `--server`, else the one beside this executable, (re)built first
/// when this runs under `cargo run` so that the figures are of the current source.
fn server_bin(args: &Args) -> PathBuf {
    if let Some(p) = &args.server {
        return p.clone();
    }
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().expect("exe dir").to_path_buf();
    if let Ok(cargo) = std::env::var("CARGO") {
        let mut c = std::process::Command::new(cargo);
        c.args(["build", "-p", "modelforge", "--bin", "modelforge"]);
        if dir.ends_with("release") {
            c.arg("--release");
        }
        let ok = c.status().is_ok_and(|s| s.success());
        assert!(ok, "building the modelforge server failed");
    }
    let bin = dir.join("modelforge");
    assert!(
        bin.exists(),
        "{} not found: build it (cargo build --release) or pass --server",
        bin.display()
    );
    bin
}

/// One line of the result table.
struct Row {
    scenario: String,
    figure: String,
    reference: String,
    target: String,
    met: Option<bool>,
}

struct Report {
    rows: Vec<Row>,
    json: serde_json::Map<String, Value>,
}

impl Report {
    fn row(
        &mut self,
        scenario: &str,
        figure: String,
        reference: String,
        target: &str,
        met: Option<bool>,
    ) {
        println!("  {scenario}: {figure}  [{reference}]");
        self.rows.push(Row {
            scenario: scenario.into(),
            figure,
            reference,
            target: target.into(),
            met,
        });
    }
    fn put(&mut self, key: &str, v: Value) {
        self.json.insert(key.into(), v);
    }
}

fn machine() -> Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    let mem_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .next()?
                .split_whitespace()
                .nth(1)?
                .parse::<f64>()
                .ok()
        })
        .map(|kib| kib / 1024.0 / 1024.0)
        .unwrap_or(0.0);
    json!({"cores": cores(), "cpu": cpu, "memory_gib": (mem_gib * 10.0).round() / 10.0})
}

fn cores() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
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
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move { axum::serve(listener, app).await.expect("bare axum") });
    format!("http://127.0.0.1:{port}")
}

/// The median time of one argon2id hash at the default parameters (what cluster A runs).
fn one_hash_secs() -> f64 {
    use argon2::PasswordHasher;
    let argon = argon2::Argon2::new(
        argon2::Algorithm::Argon2id,
        argon2::Version::V0x13,
        argon2::Params::default(),
    );
    let mut samples: Vec<f64> = (0..11)
        .map(|_| {
            let t = Instant::now();
            let _ = argon.hash_password(b"mfnc_benchmark_secret");
            t.elapsed().as_secs_f64()
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

/// Sum of argon2 verifies the running members have done.
async fn argon2_verifies(c: &Cluster, http: &reqwest::Client) -> u64 {
    let mut n = 0;
    for i in 0..3 {
        if c.pid(i).is_some()
            && let Some(v) = c.cluster_view(http, i).await
        {
            n += v["secret_checks"]["argon2_verifies"].as_u64().unwrap_or(0);
        }
    }
    n
}

#[tokio::main]
async fn main() {
    let args = parse_args();
    let p = args.profile;
    let bin = server_bin(&args);
    let http = load::client();
    let dir = tempfile::tempdir().expect("temp dir");
    let mut r = Report {
        rows: vec![],
        json: serde_json::Map::new(),
    };
    r.put("profile", json!(p.name));
    r.put("machine", machine());
    println!("modelforge-bench, profile {} on {}", p.name, machine());

    // ---- Reference: a bare axum endpoint taking the same body.
    let bare = bare_axum().await;
    let body = serde_json::to_vec(&load::telemetry(0)).expect("body");
    let (h, u, b) = (http.clone(), format!("{bare}/hb"), body.clone());
    let bare_s = drive(p.hb_loops, p.dur, move |_, _| {
        let (h, u, b) = (h.clone(), u.clone(), b.clone());
        async move {
            h.post(&u)
                .header("content-type", "application/json")
                .body(b)
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
        }
    })
    .await;
    r.put("bare_axum", bare_s.json());
    println!(
        "bare axum: {:.0}/s p99 {:.2} ms",
        bare_s.rate(),
        bare_s.pct(0.99)
    );

    // The argon2 bound, measured while nothing else runs (the members' pools start filling as
    // soon as they start).
    let mut one = one_hash_secs();
    let bound = cores() as f64 / one;
    println!(
        "argon2id one hash {:.1} ms: bound {bound:.1}/s on {} cores",
        one * 1000.0,
        cores()
    );

    // ---- Cluster A: default argon2 parameters, credential pool sized to the burst.
    let a_flags = vec!["--credential-pool".to_string(), p.burst.to_string()];
    let a = Cluster::start(&bin, dir.path(), "a", &a_flags).await;
    let urls = a.urls();
    let leader_url = a.url(a.wait_leader(Duration::from_secs(30)).await);
    for u in &urls {
        assert!(u.starts_with("http://127.0.0.1:"), "loopback only");
    }

    let t = Instant::now();
    let tokens = load::create_tokens(&http, &leader_url, p.burst, 2 * cores()).await;
    let token_rate = p.burst as f64 / t.elapsed().as_secs_f64();
    r.row(
        "Token creation (one argon2 hash each)",
        format!("{token_rate:.1}/s"),
        format!("argon2 bound {bound:.1}/s ({:.2})", token_rate / bound),
        "-",
        None,
    );
    r.put("token_create_per_s", json!(token_rate));

    // Enrolment burst: wait until the leader's pool of credentials minted ahead is full (as it
    // is on an idle control plane), then every agent at once.
    let t = Instant::now();
    let pool = loop {
        let l = a.wait_leader(Duration::from_secs(30)).await;
        let v = a.cluster_view(&http, l).await.unwrap_or_default();
        let ready = v["credential_pool"]["ready"].as_u64().unwrap_or(0) as usize;
        if ready >= p.burst {
            break ready;
        }
        assert!(
            t.elapsed() < Duration::from_secs(600),
            "credential pool never filled ({ready})"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    println!(
        "credential pool ready: {pool} (after {:.1} s)",
        t.elapsed().as_secs_f64()
    );
    // The bound again, right before the burst, under the same conditions (this machine is
    // shared: the mean of the two medians is the reference).
    one = (one + one_hash_secs()) / 2.0;
    let bound = cores() as f64 / one;
    r.put(
        "argon2",
        json!({"hash_ms": one * 1000.0, "bound_per_s": bound, "cores": cores()}),
    );
    let t = Instant::now();
    let (agents_a, failed) = load::enrol(&http, &urls, tokens, 0, p.burst).await;
    let enrol_rate = agents_a.len() as f64 / t.elapsed().as_secs_f64();
    assert_eq!(failed, 0, "{failed} enrolments of the burst failed");
    let l = a.wait_leader(Duration::from_secs(30)).await;
    let view = a.cluster_view(&http, l).await.unwrap_or_default();
    r.row(
        &format!("Enrolment burst ({} new agents at once)", p.burst),
        format!("{enrol_rate:.1}/s"),
        format!("argon2 bound {bound:.1}/s"),
        ">= 0.8 of the bound",
        Some(enrol_rate / bound >= 0.8),
    );
    r.put(
        "enrol_burst",
        json!({"agents": p.burst, "per_s": enrol_rate, "of_bound": enrol_rate / bound,
               "credential_pool": view["credential_pool"]}),
    );

    let (warmed, failures) = load::first_heartbeats(&http, &urls, &agents_a).await;
    assert_eq!(
        warmed,
        agents_a.len(),
        "first heartbeats failed: {failures:?}"
    );
    let agents_a = Arc::new(agents_a);
    for (name, key, spread) in [
        (
            "Heartbeats, all to the leader",
            "heartbeats_all_to_the_leader",
            false,
        ),
        (
            "Heartbeats, spread over 3 members",
            "heartbeats_spread_over_3_members",
            true,
        ),
    ] {
        let (h, ag, us, lu) = (
            http.clone(),
            agents_a.clone(),
            urls.clone(),
            leader_url.clone(),
        );
        let s = drive(p.hb_loops, p.dur, move |_, n| {
            let (h, ag) = (h.clone(), ag.clone());
            let u = if spread {
                us[n % 3].clone()
            } else {
                lu.clone()
            };
            async move { load::heartbeat(&h, &u, &ag[n % ag.len()]).await == Some(200) }
        })
        .await;
        r.row(
            name,
            format!(
                "{:.0}/s p50 {:.2} ms p99 {:.2} ms",
                s.rate(),
                s.pct(0.5),
                s.pct(0.99)
            ),
            format!(
                "bare axum {:.0}/s ({:.2})",
                bare_s.rate(),
                s.rate() / bare_s.rate()
            ),
            ">= 0.5 of bare axum",
            Some(s.rate() / bare_s.rate() >= 0.5),
        );
        r.put(key, s.json());
    }

    // Replicated writes that hash no secret: revocations and inventory changes alternate.
    let half = agents_a.len() / 2;
    let mut ours = vec![];
    for c in p.write_clients {
        let (h, ag, lu) = (http.clone(), agents_a.clone(), leader_url.clone());
        let s = drive(c, p.dur, move |_, n| {
            let (h, ag, lu) = (h.clone(), ag.clone(), lu.clone());
            async move {
                if n % 2 == 0 {
                    let a = &ag[(n / 2) % half];
                    h.delete(format!(
                        "{lu}/api/v1/admin/hardware/nodes/{}/credential",
                        a.node_id
                    ))
                    .bearer_auth(ADMIN)
                    .send()
                    .await
                    .is_ok_and(|r| r.status() == 200)
                } else {
                    let a = &ag[half + (n / 2) % (ag.len() - half)];
                    let mut inv = load::inventory(a.index);
                    inv["storage_roots"][1]["free_bytes"] = json!(n as u64 * 4096);
                    h.put(format!("{lu}/api/v1/agent/nodes/{}/inventory", a.node_id))
                        .bearer_auth(&a.credential)
                        .json(&inv)
                        .send()
                        .await
                        .is_ok_and(|r| r.status() == 200)
                }
            }
        })
        .await;
        println!(
            "  writes, {c} clients: {:.0}/s p99 {:.2} ms ({} failed)",
            s.rate(),
            s.pct(0.99),
            s.failed
        );
        r.put(&format!("writes_{c}_clients"), s.json());
        ours.push(s);
    }
    let etcd = if args.etcd {
        Etcd::start(dir.path()).await
    } else {
        None
    };
    let mut theirs: Vec<Option<Stats>> = vec![];
    for c in p.write_clients {
        let Some(e) = &etcd else {
            theirs.push(None);
            continue;
        };
        let (h, us) = (http.clone(), e.urls.clone());
        let s = drive(c, p.dur, move |l, n| {
            let (h, u) = (h.clone(), us[l % us.len()].clone());
            async move {
                let body =
                    json!({"key": cluster::b64(format!("k{n}").as_bytes()), "value": "dmFsdWU="});
                h.post(format!("{u}/v3/kv/put"))
                    .json(&body)
                    .send()
                    .await
                    .is_ok_and(|r| r.status() == 200)
            }
        })
        .await;
        r.put(&format!("etcd_{c}_clients"), s.json());
        theirs.push(Some(s));
    }
    drop(etcd);
    for (i, c) in p.write_clients.iter().enumerate() {
        let s = &ours[i];
        let (reference, met) = match &theirs[i] {
            Some(e) => (
                format!(
                    "etcd {:.0}/s p99 {:.2} ms ({:.2}x)",
                    e.rate(),
                    e.pct(0.99),
                    s.rate() / e.rate().max(1e-9)
                ),
                (*c == 128).then(|| s.rate() >= 2.0 * e.rate() && s.pct(0.99) <= e.pct(0.99)),
            ),
            None => (
                "etcd not installed (apt-get install etcd-server)".into(),
                None,
            ),
        };
        r.row(
            &format!("Replicated writes, {c} clients"),
            format!(
                "{:.0}/s p50 {:.2} ms p99 {:.2} ms",
                s.rate(),
                s.pct(0.5),
                s.pct(0.99)
            ),
            reference,
            if *c == 128 {
                ">= 2x etcd, p99 <= etcd's"
            } else {
                "-"
            },
            met,
        );
    }
    drop(a);

    // ---- Cluster B: the agent population.
    let b_flags: Vec<String> = [
        "--argon2-m-kib",
        "1024",
        "--argon2-t",
        "1",
        "--credential-pool",
        "0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut b = Cluster::start(&bin, dir.path(), "b", &b_flags).await;
    let urls = b.urls();
    let lb = b.url(b.wait_leader(Duration::from_secs(30)).await);
    let t = Instant::now();
    let tokens = load::create_tokens(&http, &lb, p.population[0] + 1, 64).await;
    let (mut agents, failed) = load::enrol(&http, &urls, tokens, 0, 128).await;
    assert_eq!(failed, 0, "{failed} enrolments of the population failed");
    println!(
        "population of {} enrolled in {:.1} s",
        agents.len(),
        t.elapsed().as_secs_f64()
    );
    let canary = agents.pop().expect("canary agent");
    let (warmed, failures) = load::first_heartbeats(&http, &urls, &agents).await;
    assert_eq!(
        warmed,
        agents.len(),
        "first heartbeats of the population failed: {failures:?}"
    );
    let rss_small = b.rss();
    r.row(
        &format!("Memory at {} enrolled nodes (8 GPUs each)", p.population[0]),
        format!(
            "RSS {:.0} / {:.0} / {:.0} MiB",
            rss_small[0], rss_small[1], rss_small[2]
        ),
        "-".into(),
        "-",
        None,
    );
    r.put(
        "rss_mib_small",
        json!({"nodes": p.population[0], "members": rss_small}),
    );
    let agents = Arc::new(agents);

    // Open-loop heartbeats: each agent at a 1 s interval through the member it talks to, in
    // steps of offered load (a step past capacity shows how it degrades, not just where).
    let mut steps = vec![];
    for &rate in p.open_rates {
        let open: Arc<Vec<load::SimAgent>> = Arc::new(
            agents
                .iter()
                .take(rate)
                .map(|a| load::SimAgent {
                    index: a.index,
                    node_id: a.node_id.clone(),
                    credential: a.credential.clone(),
                    telemetry: a.telemetry.clone(),
                })
                .collect(),
        );
        let offered = open.len() as f64;
        let start = Instant::now();
        let traces = load::run_agents(
            &http,
            &urls,
            open,
            Duration::from_secs(1),
            start + Duration::from_secs(p.open_secs),
            1024,
        )
        .await;
        let secs = start.elapsed().as_secs_f64();
        let (mut lat, mut failed) = (vec![], 0);
        for (sched, done, status) in traces.iter().flatten() {
            if *status == Some(200) {
                lat.push(*done - *sched);
            } else {
                failed += 1;
            }
        }
        let s = Stats::new(lat, failed, secs);
        r.row(
            &format!("Heartbeats open-loop, {rate} agents at 1/s each"),
            format!(
                "{:.0}/s p50 {:.2} ms p99 {:.2} ms ({} not 200)",
                s.rate(),
                s.pct(0.5),
                s.pct(0.99),
                s.failed
            ),
            "latency from the scheduled send (no coordinated omission)".into(),
            if rate >= 10_000 {
                "p99 < 10 ms at 10,000/s"
            } else {
                "-"
            },
            (rate >= 10_000).then(|| s.pct(0.99) < 10.0 && s.rate() >= 0.95 * offered),
        );
        steps.push(json!({"offered_per_s": offered, "stats": s.json()}));
    }
    r.put("heartbeats_open_loop", json!(steps));

    // Let the previous step's overload drain first (requests the clients gave up on are still
    // being answered): wait until the leader answers a read within 50 ms, for up to 60 s.
    let settle = Instant::now();
    let probe = agents.last().map(|a| a.node_id.clone()).unwrap_or_default();
    while settle.elapsed() < Duration::from_secs(60) {
        let l = b.wait_leader(Duration::from_secs(30)).await;
        let t = Instant::now();
        let ok = http
            .get(format!("{}/api/v1/admin/hardware/nodes/{probe}", b.url(l)))
            .bearer_auth(ADMIN)
            .send()
            .await
            .is_ok_and(|r| r.status() == 200);
        if ok && t.elapsed() < Duration::from_millis(50) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!(
        "settled after the open-loop steps in {:.1} s",
        settle.elapsed().as_secs_f64()
    );

    // Failover: agents heartbeat at their interval; kill -9 the leader; time to the next
    // acknowledged write, and to every agent having had a 200 again.
    let fo: Arc<Vec<load::SimAgent>> = Arc::new(
        agents
            .iter()
            .take(p.failover_agents)
            .map(|a| load::SimAgent {
                index: a.index,
                node_id: a.node_id.clone(),
                credential: a.credential.clone(),
                telemetry: a.telemetry.clone(),
            })
            .collect(),
    );
    let n_fo = fo.len();
    let iv = p.failover_interval;
    let verifies_before = argon2_verifies(&b, &http).await;
    let start = Instant::now();
    let deadline = start + iv * 6;
    let (h, us) = (http.clone(), urls.clone());
    let run = tokio::spawn(async move { load::run_agents(&h, &us, fo, iv, deadline, 4096).await });
    tokio::time::sleep(iv * 2).await; // steady state before the fault
    let old = b.wait_leader(Duration::from_secs(10)).await;
    let killed_at = Instant::now();
    b.kill(old);
    let survivors: Vec<String> = (0..3).filter(|i| *i != old).map(|i| b.url(i)).collect();
    let mut k = 0;
    let write_ms = loop {
        let u = &survivors[k % survivors.len()];
        k += 1;
        let ok = http
            .delete(format!(
                "{u}/api/v1/admin/hardware/nodes/{}/credential",
                canary.node_id
            ))
            .bearer_auth(ADMIN)
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .is_ok_and(|r| r.status() == 200);
        if ok {
            break ms(killed_at.elapsed());
        }
        assert!(
            killed_at.elapsed() < Duration::from_secs(30),
            "no write acknowledged within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let traces = run.await.expect("agents");
    let verifies_after = argon2_verifies(&b, &http).await;
    let mut back = vec![];
    let mut never = 0;
    let mut refused_after = 0;
    for trace in &traces {
        let after: Vec<_> = trace.iter().filter(|(s, _, _)| *s >= killed_at).collect();
        refused_after += after.iter().filter(|(_, _, st)| *st != Some(200)).count();
        match after.iter().find(|(_, _, st)| *st == Some(200)) {
            Some((_, done, _)) => back.push(*done - killed_at),
            None => never += 1,
        }
    }
    back.sort();
    let all_back = back.last().copied().unwrap_or_default();
    let new_verifies = verifies_after.saturating_sub(verifies_before);
    r.row(
        "Failover: kill -9 leader -> next acknowledged write",
        format!("{write_ms:.0} ms"),
        "-".into(),
        "< 1 s",
        Some(write_ms < 1000.0),
    );
    r.row(
        &format!("Failover: every one of {n_fo} agents (interval {iv:?}) gets 200 again"),
        format!(
            "{:.0} ms ({never} never did; {refused_after} heartbeats unanswered or refused)",
            ms(all_back)
        ),
        format!(
            "{new_verifies} argon2 verifies on the survivors (~{:.0} ms of one core at the default parameters)",
            new_verifies as f64 * one * 1000.0
        ),
        "< 2 heartbeat intervals",
        Some(never == 0 && all_back < iv * 2),
    );
    r.put(
        "failover",
        json!({"write_ms": write_ms, "agents": n_fo, "interval_ms": ms(iv), "all_back_ms": ms(all_back),
               "p50_back_ms": ms(back.get(back.len() / 2).copied().unwrap_or_default()),
               "never_back": never, "unanswered_or_refused": refused_after,
               "argon2_verifies_on_survivors": new_verifies}),
    );

    // Memory at the large population: the killed member rejoins, then the population grows.
    b.restart(old, &http).await;
    let lb = b.url(b.wait_leader(Duration::from_secs(30)).await);
    let more = p.population[1] - p.population[0];
    let t = Instant::now();
    let mut grown = 0;
    for chunk in 0..more.div_ceil(10_000) {
        let n = 10_000.min(more - chunk * 10_000);
        let tokens = load::create_tokens(&http, &lb, n, 64).await;
        let (got, failed) = load::enrol(
            &http,
            &urls,
            tokens,
            p.population[0] + 1 + chunk * 10_000,
            128,
        )
        .await;
        if failed > 0 {
            println!("  {failed} enrolments of this chunk failed (see stderr); continuing");
        }
        grown += got.len();
    }
    println!(
        "population grown by {grown} in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    // Measured twice: right after the growth (its transient buffers included), and settled:
    // every member has applied the same index and one malloc_trim period (10 s) has passed.
    let rss_grown = b.rss();
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(120) {
        let mut applied = vec![];
        for i in 0..3 {
            if let Some(v) = b.cluster_view(&http, i).await {
                applied.push(v["applied_index"].as_u64().unwrap_or(0));
            }
        }
        if applied.len() == 3 && applied.iter().all(|a| *a == applied[0]) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(11)).await;
    let rss_large = b.rss();
    println!(
        "RSS right after the growth {:.0} / {:.0} / {:.0} MiB; settled {:.0} / {:.0} / {:.0} MiB",
        rss_grown[0], rss_grown[1], rss_grown[2], rss_large[0], rss_large[1], rss_large[2]
    );
    let max = rss_large.iter().cloned().fold(0.0, f64::max);
    r.row(
        &format!("Memory at {} enrolled nodes (8 GPUs each)", p.population[1]),
        format!(
            "RSS {:.0} / {:.0} / {:.0} MiB",
            rss_large[0], rss_large[1], rss_large[2]
        ),
        "-".into(),
        "< 1 GiB at 100,000",
        (p.population[1] >= 100_000).then_some(max < 1024.0),
    );
    r.put(
        "rss_mib_large",
        json!({"nodes": p.population[1], "members": rss_large, "right_after_growth": rss_grown}),
    );
    drop(b);

    // ---- The table.
    println!();
    println!("| Scenario | Result | Reference (same run) | Target | |");
    println!("|---|---|---|---|---|");
    for row in &r.rows {
        let verdict = match row.met {
            Some(true) => "met",
            Some(false) => "**missed**",
            None => "",
        };
        println!(
            "| {} | {} | {} | {} | {verdict} |",
            row.scenario, row.figure, row.reference, row.target
        );
    }
    let rows: Vec<Value> = r
        .rows
        .iter()
        .map(|x| json!({"scenario": x.scenario, "result": x.figure, "reference": x.reference, "target": x.target, "met": x.met}))
        .collect();
    r.put("table", json!(rows));
    if let Some(parent) = args.out.parent() {
        let _ = std::fs::create_dir_all(parent);
    }
    std::fs::write(
        &args.out,
        serde_json::to_string_pretty(&Value::Object(r.json)).expect("json"),
    )
    .expect("write the figures");
    println!("\nfigures written to {}", args.out.display());
}
