//! Cluster A at the default argon2 parameters: token creation and the enrolment burst, each
//! against the argon2 bound.

use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;

use serde_json::json;

use super::Bench;
use super::reference::one_hash_secs;
use crate::cluster::Cluster;
use crate::load;
use crate::load::SimAgent;
use crate::report::cores;

/// Cluster A with its enrolled, warmed-up agents.
pub struct ClusterA {
    /// Dropping it stops the members.
    pub cluster: Cluster,
    pub urls: Vec<String>,
    pub leader_url: String,
    pub agents: Arc<Vec<SimAgent>>,
}

/// Start cluster A, create the burst's tokens, and enrol every agent at once once the leader's
/// credential pool is full. `one` is the argon2 hash time, refined here.
pub async fn run(b: &mut Bench, one: &mut f64) -> ClusterA {
    let (p, http, dir, bin) = (b.p, b.http.clone(), b.dir.clone(), b.bin.clone());
    let r = &mut b.r;
    // ---- Cluster A: default argon2 parameters, credential pool sized to the burst.
    let a_flags = vec!["--credential-pool".to_string(), p.burst.to_string()];
    let a = Cluster::start(&bin, &dir, "a", &a_flags).await;
    let urls = a.urls();
    let leader_url = a.url(a.wait_leader(Duration::from_secs(30)).await);
    for u in &urls {
        assert!(u.starts_with("https://127.0.0.1:"), "loopback only");
    }

    let t = Instant::now();
    let bound = cores() as f64 / *one;
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
    wait_pool(&a, &http, p.burst).await;
    // The bound again, right before the burst, under the same conditions (this machine is
    // shared: the mean of the two medians is the reference).
    *one = (*one + one_hash_secs()) / 2.0;
    let one = *one;
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
    let pool = a.cluster_view(&http, l).await.map(|v| v.credential_pool);
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
               "credential_pool": pool}),
    );

    let (warmed, failures) = load::first_heartbeats(&http, &urls, &agents_a).await;
    assert_eq!(
        warmed,
        agents_a.len(),
        "first heartbeats failed: {failures:?}"
    );
    let agents_a = Arc::new(agents_a);
    ClusterA {
        cluster: a,
        urls,
        leader_url,
        agents: agents_a,
    }
}

/// Wait until the leader's pool of credentials minted ahead holds `want` (as on a control
/// plane that has been idle a while).
pub async fn wait_pool(a: &Cluster, http: &reqwest::Client, want: usize) {
    let t = Instant::now();
    let pool = loop {
        let l = a.wait_leader(Duration::from_secs(30)).await;
        let ready = a
            .cluster_view(http, l)
            .await
            .map_or(0, |v| v.credential_pool.ready);
        if ready >= want {
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
}
