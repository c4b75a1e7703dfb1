//! Admission control under a flood (issue 15): one member pinned to one CPU and the load
//! generator (this process) pinned to the other, so that the member's capacity is its own and
//! not what is left beside the generator; real agents run on other machines. Its heartbeat
//! capacity is measured closed-loop (fewer loops than its admission limit, so nothing is
//! shed), then every agent heartbeats open-loop, one connection each like a real agent, at
//! twice that rate in all. Target: the admitted heartbeats' p99, from the scheduled send,
//! under 50 ms, the rest shed at once with 503 and `Retry-After`, and the member serving
//! (admin reads during the flood all answered 200).

use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;

use serde_json::json;
use tokio::io::AsyncReadExt;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

use super::Bench;
use crate::cluster::ADMIN;
use crate::cluster::Cluster;
use crate::load;
use crate::load::SimAgent;
use crate::load::Stats;

/// A lean agent connection for the flood: one TLS connection, the heartbeat written by hand
/// as HTTP/1.1, the answer's status read and its body skipped by `content-length`. It costs a
/// fraction of reqwest's CPU a request, so that one CPU of load can offer twice what one CPU
/// of member serves (with reqwest the generator, not the member, was the bottleneck).
struct RawConn {
    tls: TlsStream<TcpStream>,
    buf: Vec<u8>,
}

impl RawConn {
    async fn connect(addr: &str, tls: &tokio_rustls::TlsConnector) -> std::io::Result<Self> {
        let tcp = TcpStream::connect(addr).await?;
        tcp.set_nodelay(true)?;
        let name = rustls_pki_types::ServerName::try_from("127.0.0.1").expect("an IP name");
        Ok(RawConn {
            tls: tls.connect(name, tcp).await?,
            buf: Vec::with_capacity(4096),
        })
    }

    /// Send `req` (a whole HTTP/1.1 request) and read the answer; its status and its
    /// `Retry-After` (seconds), if it has one.
    async fn call(&mut self, req: &[u8]) -> std::io::Result<(u16, Option<u64>)> {
        self.tls.write_all(req).await?;
        self.tls.flush().await?;
        self.buf.clear();
        let bad = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_string());
        let mut chunk = [0u8; 4096];
        let head_end = loop {
            if let Some(i) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let n = self.tls.read(&mut chunk).await?;
            if n == 0 {
                return Err(bad("closed"));
            }
            self.buf.extend_from_slice(&chunk[..n]);
        };
        let head = std::str::from_utf8(&self.buf[..head_end]).map_err(|_| bad("head"))?;
        let status: u16 = head
            .get(9..12)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| bad("status"))?;
        let header = |name: &str| -> Option<u64> {
            head.lines().find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case(name)
                    .then(|| v.trim().parse().ok())?
            })
        };
        let len = header("content-length").ok_or_else(|| bad("no content-length"))? as usize;
        let retry_after = header("retry-after");
        if head.to_ascii_lowercase().contains("connection: close") {
            return Err(bad("closed by the member"));
        }
        while self.buf.len() < head_end + len {
            let n = self.tls.read(&mut chunk).await?;
            if n == 0 {
                return Err(bad("closed"));
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
        Ok((status, retry_after))
    }
}

/// A heartbeat of `a` as bytes on the wire.
fn heartbeat_request(a: &SimAgent) -> Vec<u8> {
    let mut r = format!(
        "POST /api/v1/agent/nodes/{}/heartbeat HTTP/1.1\r\nhost: 127.0.0.1\r\n\
         authorization: Bearer {}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n",
        a.node_id,
        a.credential,
        a.telemetry.len()
    )
    .into_bytes();
    r.extend_from_slice(&a.telemetry);
    r
}

/// (scheduled, written, answered, status) of one flood heartbeat.
type Sent = (Instant, Instant, Instant, Option<u16>);

/// Every agent heartbeats over its own [`RawConn`] (all opened first) at `interval` (first sends spread over one
/// interval) until `deadline`, open-loop: a late answer delays only that agent's next send,
/// and its latency counts from the scheduled instant. A failed connection is opened again for
/// the next heartbeat. With `honour_retry_after`, an agent that is shed behaves as
/// `modelforge-agent` does: it sends again after the answer's `Retry-After` plus a random part
/// of as long again (`modelforge_client::redelivery_wait`), and its interval starts over from there;
/// without it, the flood keeps its schedule whatever the member says (a fleet of broken or
/// hostile clients).
async fn flood(
    addr: &str,
    agents: &[SimAgent],
    interval: Duration,
    deadline: Instant,
    honour_retry_after: bool,
) -> Vec<Sent> {
    let pem = modelforge_devkit::harness_ca_pem().expect("the harness CA");
    let cfg = modelforge_client::tls::client_config(pem, None).expect("the harness CA loads");
    let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg));
    let n = agents.len();
    // Every agent's connection is open before the clock starts, as a fleet's are: the flood
    // is of requests, not of TLS handshakes (tests/edge.rs floods connections).
    let mut conns = Vec::with_capacity(n);
    for chunk in agents.chunks(64) {
        let opening = chunk.iter().map(|_| RawConn::connect(addr, &tls));
        conns.extend(
            futures_util::future::join_all(opening)
                .await
                .into_iter()
                .map(Result::ok),
        );
    }
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(n);
    for ((k, a), conn) in agents.iter().enumerate().zip(conns) {
        let (tls, addr, req) = (tls.clone(), addr.to_string(), heartbeat_request(a));
        tasks.push(tokio::spawn(async move {
            let mut conn = conn;
            let mut next = start + interval.mul_f64(k as f64 / n as f64);
            let mut out = vec![];
            while next < deadline {
                tokio::time::sleep_until(next.into()).await;
                if conn.is_none() {
                    conn = RawConn::connect(&addr, &tls).await.ok();
                }
                let written = Instant::now();
                let answer = match conn.as_mut() {
                    Some(c) => c.call(&req).await.ok(),
                    None => None,
                };
                if answer.is_none() {
                    conn = None;
                }
                let done = Instant::now();
                out.push((next, written, done, answer.map(|(s, _)| s)));
                next += interval;
                if let Some((_, Some(after))) = answer.filter(|_| honour_retry_after) {
                    next =
                        done + modelforge_client::redelivery_wait(Some(Duration::from_secs(after)));
                }
            }
            out
        }));
    }
    let mut all = vec![];
    for t in tasks {
        all.extend(t.await.expect("flood agent"));
    }
    all
}

/// Run the calling process's threads on `cpus` only (every thread it has now: the runtime's
/// workers exist already), or on every CPU again with `None`.
fn pin_self(cpus: Option<&[usize]>) {
    // SAFETY: cpu_set_t is plain data; CPU_ZERO/CPU_SET write within it; sched_setaffinity
    // reads it. A thread that exited meanwhile makes the call fail, which is ignored.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_ZERO(&mut set);
        let all: Vec<usize> = (0..libc::CPU_SETSIZE as usize).collect();
        for &c in cpus.unwrap_or(&all) {
            libc::CPU_SET(c, &mut set);
        }
        let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
            return;
        };
        for t in tasks.flatten() {
            if let Some(tid) = t.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) {
                libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set);
            }
        }
    }
}

pub async fn run(bench: &mut Bench) {
    let (p, http) = (bench.p, bench.http.clone());
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cpus < 2 {
        println!("flood: skipped (needs 2 CPUs, one for the member and one for the load)");
        return;
    }
    let flags = super::cheap_hashing_flags();
    let member_cpu = (cpus - 1).to_string();
    let c = Cluster::start_pinned(
        1,
        Some(&member_cpu),
        &bench.bin,
        &bench.dir,
        "flood",
        &flags,
    )
    .await;
    let url = c.url(0);
    let tokens = load::create_tokens(&http, &url, p.flood_agents, 64).await;
    let (agents, failed) = load::enrol(&http, std::slice::from_ref(&url), tokens, 0, 128).await;
    assert_eq!(failed, 0, "flood: {failed} enrolments failed");
    let (warmed, failures) =
        load::first_heartbeats(&http, std::slice::from_ref(&url), &agents).await;
    assert_eq!(
        warmed,
        agents.len(),
        "flood: first heartbeats: {failures:?}"
    );
    let agents = Arc::new(agents);
    let generator: Vec<usize> = (0..cpus - 1).collect();
    pin_self(Some(&generator));

    // Capacity, closed-loop: 48 loops, below the member's admission limit (64 per CPU). A
    // window in which nothing was answered 200 (a member starved of its one CPU by the rest of
    // a loaded machine) is measured again, at most twice, instead of offering 0/s.
    let mut tries = 0;
    let cap = loop {
        tries += 1;
        let (h, u, a) = (http.clone(), url.clone(), agents.clone());
        let cap = load::drive(48, p.dur, move |_, n| {
            let (h, u, a) = (h.clone(), u.clone(), a.clone());
            async move { load::heartbeat(&h, &u, &a[n % a.len()]).await == Some(200) }
        })
        .await;
        if cap.rate() > 0.0 || tries == 3 {
            break cap;
        }
        println!("flood: no heartbeat answered 200 while measuring capacity; measuring again");
    };
    let capacity = cap.rate();
    assert!(
        capacity > 0.0,
        "flood: no heartbeat was answered 200 in three capacity windows: {}",
        cap.json()
    );

    // The flood: every agent at its own interval, twice the capacity in all.
    let offered = 2.0 * capacity;
    let interval = Duration::from_secs_f64(agents.len() as f64 / offered);
    let secs = p.flood_secs;
    println!(
        "flood: capacity {capacity:.0}/s; offering {offered:.0}/s for {secs} s from {} agents",
        agents.len()
    );
    let n = agents.len();
    let addr = url.trim_start_matches("https://").to_string();
    for honour in [true, false] {
        let start = Instant::now();
        let deadline = start + Duration::from_secs(secs);
        let probe = tokio::spawn(admin_reads(http.clone(), url.clone(), deadline));
        let sent = flood(&addr, &agents, interval, deadline, honour).await;
        let wall = start.elapsed().as_secs_f64();
        let probe = probe.await.expect("probe");
        if std::env::var_os("FLOOD_DEBUG").is_some() {
            let mut by: std::collections::BTreeMap<u64, (Vec<f64>, Vec<f64>, u32)> =
                Default::default();
            for (sched, written, done, status) in &sent {
                let b = by
                    .entry((*sched - start).as_millis() as u64 / 250)
                    .or_default();
                b.1.push((*written - *sched).as_secs_f64() * 1e3);
                if *status == Some(200) {
                    b.0.push((*done - *sched).as_secs_f64() * 1e3);
                } else {
                    b.2 += 1;
                }
            }
            for (k, (mut l, mut g, sh)) in by {
                l.sort_by(|a, b| a.partial_cmp(b).unwrap());
                g.sort_by(|a, b| a.partial_cmp(b).unwrap());
                let p = |v: &Vec<f64>| v.get(v.len() * 99 / 100).copied().unwrap_or(0.0);
                eprintln!(
                    "{:5} ms: admitted {:6} p99 {:7.1} max {:7.1} lag p99 {:6.1} shed {sh}",
                    k * 250,
                    l.len(),
                    p(&l),
                    l.last().copied().unwrap_or(0.0),
                    p(&g)
                );
            }
        }
        let (mut lat, mut lag, mut failed, mut shed) = (vec![], vec![], 0, 0);
        for (sched, written, done, status) in &sent {
            lag.push(*written - *sched);
            match status {
                Some(200) => lat.push(*done - *sched),
                Some(503) | Some(429) => shed += 1,
                _ => failed += 1,
            }
        }
        let lag = Stats::new(lag, 0, wall);
        let sent = sent.len();
        let s = Stats::new(lat, failed, wall);
        let serving = probe.failed == 0 && s.failed == 0 && s.ok > 0;
        let (name, key, target, met) = if honour {
            (
                "Flood at 2x measured heartbeat capacity, agents honouring Retry-After (1 member on 1 CPU, load on the other)",
                "flood",
                "admitted p99 < 50 ms, member serving",
                Some(s.pct(0.99) < 50.0 && serving),
            )
        } else {
            (
                "Flood at 2x measured heartbeat capacity, clients ignoring Retry-After (same)",
                "flood_ignoring_retry_after",
                "member serving (no latency target: nothing bounds a queue the clients refill)",
                Some(serving),
            )
        };
        bench.r.row(
            name,
            format!(
                "capacity {capacity:.0}/s; scheduled {offered:.0}/s, sent {:.0}/s (send lag p99 {:.1} ms): {:.0}/s admitted, p99 {:.1} ms, {shed} shed, {failed} failed; admin reads {}/{} 200, p99 {:.1} ms",
                sent as f64 / wall,
                lag.pct(0.99),
                s.rate(),
                s.pct(0.99),
                probe.ok,
                probe.ok + probe.failed,
                probe.pct(0.99),
            ),
            format!("{n} agents, one connection each; latency from the scheduled send"),
            target,
            met,
        );
        bench.r.put(
            key,
            json!({"capacity_per_s": capacity, "capacity": cap.json(), "scheduled_per_s": offered,
                   "sent_per_s": sent as f64 / wall, "agents": n, "send_lag": lag.json(),
                   "admitted": s.json(), "shed": shed, "failed": failed, "admin_reads": probe.json()}),
        );
    }
    pin_self(None);
    drop(c);
}

/// An admin read every 100 ms until `deadline`: is the member still serving its operators?
async fn admin_reads(http: reqwest::Client, url: String, deadline: Instant) -> Stats {
    let (mut lat, mut failed) = (vec![], 0);
    let start = Instant::now();
    while Instant::now() < deadline {
        let t = Instant::now();
        let ok = http
            .get(format!("{url}/api/v1/admin/node-enrollments"))
            .bearer_auth(ADMIN)
            .send()
            .await
            .is_ok_and(|r| r.status() == 200);
        if ok {
            lat.push(t.elapsed());
        } else {
            failed += 1;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Stats::new(lat, failed, start.elapsed().as_secs_f64())
}
