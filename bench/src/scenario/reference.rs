//! The references every figure is compared with, measured in the same run: a bare axum
//! endpoint taking the heartbeat body (over TLS, as members serve, and over plain HTTP, so that
//! the cost of encryption is known), and the argon2 bound (cores / one hash).

use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering;
use std::time::Instant;

use serde_json::json;

use super::Bench;
use crate::load;
use crate::load::Stats;
use crate::load::drive;
use crate::report::cores;

/// Closed-loop posts of the heartbeat body to a bare axum endpoint: the HTTPS ceiling here
/// (returned: what the members, which serve TLS, are compared with), and the plain-HTTP one,
/// measured alternately. The load client keeps its connections (one pooled client for every
/// loop), so TLS costs the record layer, not a handshake a request.
pub async fn bare_axum(b: &mut Bench) -> Stats {
    let (p, http) = (b.p, b.http.clone());
    let bare = serve_bare_axum(modelforge_devkit::ca(&b.bin)).await;
    let (https_url, http_url) = (&bare.https_url, &bare.http_url);
    let body = serde_json::to_vec(&load::telemetry(0)).expect("body");
    let (tls, plain) = load::alternate(p.dur, |plain, dur| {
        let (h, b) = (http.clone(), body.clone());
        let u = format!("{}/hb", if plain { http_url } else { https_url });
        drive(p.hb_loops, dur, move |_, _| {
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
    })
    .await;
    // Connections opened over both rounds: the loops' own, kept alive (a handshake each).
    let conns = |c: &AtomicUsize| c.load(Ordering::Relaxed);
    let (tls_conns, plain_conns) = (conns(&bare.tls_conns), conns(&bare.plain_conns));
    let r = &mut b.r;
    let mut tls_json = tls.json();
    tls_json["connections"] = json!(tls_conns);
    let mut plain_json = plain.json();
    plain_json["connections"] = json!(plain_conns);
    r.put("bare_axum", tls_json);
    r.put("bare_axum_plain", plain_json);
    println!(
        "bare axum: over TLS {:.0}/s p99 {:.2} ms ({} requests, {tls_conns} connections), plain HTTP {:.0}/s p99 {:.2} ms ({} requests, {plain_conns} connections)",
        tls.rate(),
        tls.pct(0.99),
        tls.ok + tls.failed,
        plain.rate(),
        plain.pct(0.99),
        plain.ok + plain.failed,
    );
    r.row(
        "Bare axum, heartbeat body, over TLS",
        format!(
            "{:.0}/s p50 {:.2} ms p99 {:.2} ms ({tls_conns} connections)",
            tls.rate(),
            tls.pct(0.5),
            tls.pct(0.99)
        ),
        format!(
            "plain HTTP {:.0}/s p50 {:.2} ms p99 {:.2} ms ({:.2})",
            plain.rate(),
            plain.pct(0.5),
            plain.pct(0.99),
            tls.rate() / plain.rate().max(1e-9)
        ),
        "-",
        None,
    );
    tls
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

/// The bare endpoint, served twice.
struct BareAxum {
    https_url: String,
    http_url: String,
    /// Connections each listener accepted (handshaken ones, for TLS).
    tls_conns: Arc<AtomicUsize>,
    plain_conns: Arc<AtomicUsize>,
}

/// Serve the bare endpoint on two loopback listeners: one through the members' own TLS stack
/// (`modelforge::tls`, a certificate issued from the harness CA the load client trusts), one
/// plain.
async fn serve_bare_axum(ca: &modelforge_devkit::Ca) -> BareAxum {
    use axum::routing::post;
    use axum::serve::ListenerExt;
    let app = axum::Router::new().route(
        "/hb",
        post(
            |axum::Json(t): axum::Json<modelforge_proto::wire::Telemetry>| async move {
                axum::Json(json!({"status": "ok", "gpus": t.accelerators.len()}))
            },
        ),
    );
    let ca_key = std::fs::read_to_string(&ca.key).expect("read the harness CA key");
    let (cert, key) = modelforge::tls::issue_member(&ca.pem, &ca_key, 0, &["127.0.0.1".into()])
        .expect("issue the bare endpoint's certificate");
    let material = modelforge::tls::load(&ca.pem, &cert, &key).expect("load it");
    let config = modelforge::tls::server_config(&material).expect("a TLS server config");

    let bind = || async {
        let l = tokio::net::TcpListener::bind(("127.0.0.1", 0))
            .await
            .expect("bind");
        let port = l.local_addr().expect("addr").port();
        (l, port)
    };
    let tls_conns = Arc::new(AtomicUsize::new(0));
    let plain_conns = Arc::new(AtomicUsize::new(0));
    let (tls_listener, tls_port) = bind().await;
    let counter = Arc::clone(&tls_conns);
    let tls_listener = modelforge::tls::TlsListener::new(tls_listener, config).tap_io(move |_| {
        counter.fetch_add(1, Ordering::Relaxed);
    });
    let tls_app = app.clone();
    tokio::spawn(async move {
        axum::serve(tls_listener, tls_app)
            .await
            .expect("bare axum over TLS")
    });
    let (plain_listener, plain_port) = bind().await;
    let counter = Arc::clone(&plain_conns);
    let plain_listener = plain_listener.tap_io(move |tcp| {
        counter.fetch_add(1, Ordering::Relaxed);
        // As the TLS listener does for every connection.
        let _ = tcp.set_nodelay(true);
    });
    tokio::spawn(async move {
        axum::serve(plain_listener, app)
            .await
            .expect("bare axum over plain HTTP")
    });
    BareAxum {
        https_url: format!("https://127.0.0.1:{tls_port}"),
        http_url: format!("http://127.0.0.1:{plain_port}"),
        tls_conns,
        plain_conns,
    }
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
