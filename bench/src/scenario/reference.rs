//! The references every figure is compared with, measured in the same run: a bare axum
//! endpoint taking the heartbeat body, and the argon2 bound (cores / one hash).

use std::time::Instant;

use serde_json::json;

use super::Bench;
use crate::load;
use crate::load::Stats;
use crate::load::drive;
use crate::report::cores;

/// Closed-loop posts of the heartbeat body to a bare axum endpoint: the HTTP ceiling here.
pub async fn bare_axum(b: &mut Bench) -> Stats {
    let (p, http) = (b.p, b.http.clone());
    let r = &mut b.r;
    // ---- Reference: a bare axum endpoint taking the same body.
    let bare = serve_bare_axum().await;
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
    bare_s
}

/// The argon2 bound: the median time of one hash at the default parameters (printed).
pub fn argon2_bound() -> f64 {
    // The argon2 bound, measured while nothing else runs (the members' pools start filling as
    // soon as they start).
    let one = one_hash_secs();
    let bound = cores() as f64 / one;
    println!(
        "argon2id one hash {:.1} ms: bound {bound:.1}/s on {} cores",
        one * 1000.0,
        cores()
    );
    one
}

async fn serve_bare_axum() -> String {
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
pub fn one_hash_secs() -> f64 {
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
