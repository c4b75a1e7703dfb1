//! Cluster B, the agent population (enrolled with cheap argon2 parameters: 100,000 nodes at the
//! default ones would take an hour of hashing here), and its memory once enrolled.

use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;

use serde_json::json;

use super::Bench;
use crate::cluster::Cluster;
use crate::load;
use crate::load::SimAgent;

/// Cluster B with its enrolled agents, and a canary node for the failover write.
pub struct Population {
    pub cluster: Cluster,
    pub urls: Vec<String>,
    pub agents: Arc<Vec<SimAgent>>,
    pub canary: SimAgent,
}

pub async fn enrol(bench: &mut Bench) -> Population {
    let (p, http, dir, bin) = (
        bench.p,
        bench.http.clone(),
        bench.dir.clone(),
        bench.bin.clone(),
    );
    let r = &mut bench.r;
    // ---- Cluster B: the agent population.
    let b_flags = super::cheap_hashing_flags();
    let b = Cluster::start(&bin, &dir, "b", &b_flags).await;
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
    Population {
        cluster: b,
        urls,
        agents,
        canary,
    }
}
