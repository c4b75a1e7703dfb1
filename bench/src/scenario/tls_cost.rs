//! What TLS costs the members' hot paths: two 3-member clusters alike in everything but the
//! transport, one serving TLS (the default, certificates from the harness CA) and one started
//! with `--insecure-http`, each with the same number of enrolled agents. Heartbeats to the
//! leader and replicated writes are measured on each alternately (TLS, plain, TLS, plain), so
//! that this shared machine's drift lands on both alike. Issue 14's target: heartbeats over TLS
//! at >= 0.85 of their plain-HTTP rate, which needs the load client's connections kept alive
//! (one pooled client for every loop: a handshake per connection, not per request).
//!
//! Not measured on cluster A: its leader refills its credential pool at the default argon2
//! parameters in the background after the burst, which would land on one side only. Both
//! clusters here hash cheaply and keep no pool, so nothing but the transport differs.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

use super::Bench;
use super::writes;
use crate::cluster::Cluster;
use crate::load;
use crate::load::SimAgent;
use crate::load::Stats;
use crate::load::drive;

/// One of the two clusters, with its enrolled, warmed-up agents.
struct Twin {
    /// Held, not read: dropping it stops the members.
    #[allow(dead_code)]
    cluster: Cluster,
    leader_url: String,
    agents: Arc<Vec<SimAgent>>,
}

impl Twin {
    async fn start(
        http: &reqwest::Client,
        bin: &Path,
        dir: &Path,
        plain: bool,
        agents: usize,
    ) -> Self {
        let mut flags = super::cheap_hashing_flags();
        if plain {
            flags.push("--insecure-http".into());
        }
        let name = if plain { "plain" } else { "tls" };
        let c = Cluster::start(bin, dir, name, &flags).await;
        let urls = c.urls();
        let scheme = if plain { "http://" } else { "https://" };
        assert!(
            urls.iter().all(|u| u.starts_with(scheme)),
            "{name}: {urls:?}"
        );
        let leader_url = c.url(c.wait_leader(Duration::from_secs(30)).await);
        let tokens = load::create_tokens(http, &leader_url, agents, 64).await;
        let (enrolled, failed) = load::enrol(http, &urls, tokens, 0, 128).await;
        assert_eq!(failed, 0, "{name}: {failed} enrolments failed");
        let (warmed, failures) = load::first_heartbeats(http, &urls, &enrolled).await;
        assert_eq!(
            warmed,
            enrolled.len(),
            "{name}: first heartbeats failed: {failures:?}"
        );
        // Where the leader is now (an election may have moved it while the agents enrolled).
        let leader_url = c.url(c.wait_leader(Duration::from_secs(30)).await);
        Twin {
            cluster: c,
            leader_url,
            agents: Arc::new(enrolled),
        }
    }
}

pub async fn run(b: &mut Bench) {
    let (p, http, dir, bin) = (b.p, b.http.clone(), b.dir.clone(), b.bin.clone());
    let n = p.burst;
    let (tls, plain) = tokio::join!(
        Twin::start(&http, &bin, &dir, false, n),
        Twin::start(&http, &bin, &dir, true, n)
    );
    let twin = |plain_side: bool| if plain_side { &plain } else { &tls };

    // Heartbeats, every loop to the leader.
    let (hb_tls, hb_plain) = load::alternate(p.dur, |plain_side, dur| {
        let t = twin(plain_side);
        let (h, ag, lu) = (http.clone(), t.agents.clone(), t.leader_url.clone());
        drive(p.hb_loops, dur, move |_, i| {
            let (h, ag, lu) = (h.clone(), ag.clone(), lu.clone());
            async move { load::heartbeat(&h, &lu, &ag[i % ag.len()]).await == Some(200) }
        })
    })
    .await;
    // Replicated writes (the peers' Raft traffic rides the same transport).
    let clients = p.write_clients[1];
    let (w_tls, w_plain) = load::alternate(p.dur, |plain_side, dur| {
        let t = twin(plain_side);
        let (h, ag, lu) = (http.clone(), t.agents.clone(), t.leader_url.clone());
        async move { writes::measure(&h, &ag, &lu, clients, dur).await }
    })
    .await;
    drop((tls, plain));

    let r = &mut b.r;
    let hb = hb_tls.rate() / hb_plain.rate().max(1e-9);
    let wr = w_tls.rate() / w_plain.rate().max(1e-9);
    let line = |s: &Stats| {
        format!(
            "{:.0}/s p50 {:.2} ms p99 {:.2} ms{}",
            s.rate(),
            s.pct(0.5),
            s.pct(0.99),
            if s.failed > 0 {
                format!(" ({} failed)", s.failed)
            } else {
                String::new()
            }
        )
    };
    r.row(
        &format!(
            "Heartbeats over TLS vs plain HTTP ({} loops to the leader, {n} agents)",
            p.hb_loops
        ),
        format!("{hb:.2} of plain HTTP: TLS {}", line(&hb_tls)),
        format!(
            "plain HTTP {} (twin cluster, --insecure-http)",
            line(&hb_plain)
        ),
        ">= 0.85 of plain HTTP",
        Some(hb >= 0.85),
    );
    r.row(
        &format!("Replicated writes over TLS vs plain HTTP ({clients} clients)"),
        format!("{wr:.2} of plain HTTP: TLS {}", line(&w_tls)),
        format!(
            "plain HTTP {} (twin cluster, --insecure-http)",
            line(&w_plain)
        ),
        "-",
        None,
    );
    r.put(
        "tls_vs_plain",
        json!({
            "agents": n,
            "heartbeats": {"loops": p.hb_loops, "tls": hb_tls.json(), "plain": hb_plain.json(), "ratio": hb},
            "writes": {"clients": clients, "tls": w_tls.json(), "plain": w_plain.json(), "ratio": wr},
        }),
    );
}
