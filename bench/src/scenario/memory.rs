//! Memory of cluster B at the large population: the killed member rejoins, the population
//! grows, and RSS is read right after the growth and once settled.

use std::time::Duration;
use std::time::Instant;

use serde_json::json;

use super::Bench;
use super::population::Population;
use crate::load;

pub async fn run(bench: &mut Bench, pop: &mut Population, old: usize) {
    let (p, http) = (bench.p, bench.http.clone());
    let r = &mut bench.r;
    let urls = &pop.urls;
    let b = &mut pop.cluster;
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
            urls,
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
    // every member has applied the same index and no member's snapshot moved for 11 s (a
    // snapshot is built after every 5,000 entries, so one may still be building when the
    // members agree; its encode buffer is what the peak below shows, not the settled state).
    let rss_grown = b.rss();
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(120) {
        let mut applied = vec![];
        for i in 0..3 {
            if let Some(v) = b.cluster_view(&http, i).await {
                applied.push(v.applied_index);
            }
        }
        if applied.len() == 3 && applied.iter().all(|a| *a == applied[0]) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let quiet = Duration::from_secs(11);
    let mut last: Vec<Option<u64>> = vec![];
    let mut since = Instant::now();
    while since.elapsed() < quiet && t.elapsed() < Duration::from_secs(240) {
        let mut snaps = vec![];
        for i in 0..3 {
            snaps.push(
                b.cluster_view(&http, i)
                    .await
                    .and_then(|v| v.snapshot_index),
            );
        }
        if snaps != last {
            last = snaps;
            since = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    if since.elapsed() < quiet {
        println!(
            "  (snapshots still moving after {:.0} s: the settled reading may include one)",
            t.elapsed().as_secs_f64()
        );
    }
    let rss_large = b.rss();
    // The peak includes the snapshots built during the growth (the restarted member's since
    // its restart): what a member's memory limit must allow, beyond the settled figure.
    let peak = b.peak_rss();
    println!(
        "RSS right after the growth {:.0} / {:.0} / {:.0} MiB; settled {:.0} / {:.0} / {:.0} MiB; peak {:.0} / {:.0} / {:.0} MiB",
        rss_grown[0],
        rss_grown[1],
        rss_grown[2],
        rss_large[0],
        rss_large[1],
        rss_large[2],
        peak[0],
        peak[1],
        peak[2]
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
        json!({"nodes": p.population[1], "members": rss_large, "right_after_growth": rss_grown, "peak": peak}),
    );
}
