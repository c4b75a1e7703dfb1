//! The HTTP edge over real processes: a connection that never finishes its request head is
//! closed (slowloris), a request whose body trickles in is cut off at the request deadline,
//! and connections beyond `--max-connections` are closed at once while the member keeps
//! serving the ones it took.

mod common;

use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;

use common::*;
use tokio::io::AsyncReadExt;
use tokio::io::AsyncWriteExt;

/// The `host:port` of a member's URL.
fn addr(url: &str) -> String {
    url.trim_start_matches("https://").to_string()
}

/// A TLS connection to `url` verified against the harness CA, nothing sent yet.
async fn tls_connect(url: &str) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    try_tls_connect(url)
        .await
        .expect("the TLS handshake failed")
}

/// A TLS connection to `url`, or None when the server closed it during the handshake.
async fn try_tls_connect(
    url: &str,
) -> Option<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let cfg = modelforge_client::tls::client_config(&harness_ca().pem, None).unwrap();
    let tcp = tokio::net::TcpStream::connect(addr(url)).await.unwrap();
    tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(
            rustls_pki_types::ServerName::try_from("127.0.0.1").unwrap(),
            tcp,
        )
        .await
        .ok()
}

/// Read until the server closes (Ok(0) or an error); how long that took, or None if it stayed
/// open for `within`.
async fn closed_within(
    s: &mut (impl tokio::io::AsyncRead + Unpin),
    within: Duration,
) -> Option<Duration> {
    let t = Instant::now();
    let mut buf = [0u8; 1024];
    loop {
        match tokio::time::timeout(within.saturating_sub(t.elapsed()), s.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(t.elapsed()),
            Ok(Ok(_)) => continue,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_never_finishes_its_request_head_is_closed() {
    let c = Cluster::start_with(1, &["--header-read-timeout", "2s"]).await;
    let url = c.url(1);
    // A slowloris: half a request head, then nothing.
    let mut slow = tls_connect(&url).await;
    slow.write_all(b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\nx-slow: ")
        .await
        .unwrap();
    slow.flush().await.unwrap();
    // Meanwhile complete requests are answered.
    let (s, _) = call("GET", &format!("{url}/healthz"), None, None).await;
    assert_eq!(s, 200);
    let took = closed_within(&mut slow, Duration::from_secs(20))
        .await
        .expect("the slow connection was never closed");
    assert!(took >= Duration::from_millis(1500), "closed after {took:?}");
    // A connection that sends nothing at all after its handshake is closed the same way.
    let mut idle = tls_connect(&url).await;
    assert!(
        closed_within(&mut idle, Duration::from_secs(20))
            .await
            .is_some()
    );
}

/// Whether `serve --help` documents `flag` with `[default: <default>]`.
fn assert_serve_default(flag: &str, default: &str) {
    let out = std::process::Command::new(server_bin())
        .args(["serve", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    let line = help.split(flag).nth(1).expect("the flag is documented");
    assert!(
        line.split("--")
            .next()
            .unwrap()
            .contains(&format!("[default: {default}]")),
        "{line}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_header_read_timeout_is_30_seconds() {
    assert_serve_default("--header-read-timeout", "30s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_body_trickles_in_is_cut_off_at_the_request_deadline() {
    let c = Cluster::start_with(1, &["--request-timeout", "2s"]).await;
    let url = c.url(1);
    // A complete, authenticated head announcing 400 bytes of body, then a byte every 300 ms:
    // never slow enough for a read timeout, never done before the deadline.
    let mut slow = tls_connect(&url).await;
    let head = format!(
        "POST /api/v1/admin/node-enrollments HTTP/1.1\r\nhost: 127.0.0.1\r\n\
         authorization: Bearer {ADMIN}\r\ncontent-type: application/json\r\n\
         content-length: 400\r\n\r\n{{"
    );
    slow.write_all(head.as_bytes()).await.unwrap();
    slow.flush().await.unwrap();
    let t = Instant::now();
    let trickle = async {
        loop {
            tokio::time::sleep(Duration::from_millis(300)).await;
            if slow.write_all(b" ").await.is_err() || slow.flush().await.is_err() {
                break;
            }
            let mut buf = [0u8; 4096];
            if let Ok(Ok(n)) =
                tokio::time::timeout(Duration::from_millis(1), slow.read(&mut buf)).await
            {
                return (n, String::from_utf8_lossy(&buf[..n]).to_string());
            }
        }
        (0, String::new())
    };
    let (n, answer) = tokio::time::timeout(Duration::from_secs(20), trickle)
        .await
        .expect("the trickling request was never cut off");
    let took = t.elapsed();
    assert!(n > 0, "the connection closed without an answer");
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(
        answer.to_ascii_lowercase().contains("connection: close"),
        "{answer}"
    );
    assert!(answer.contains("\"outcome_unknown\""), "{answer}");
    assert!(
        took >= Duration::from_millis(1500) && took < Duration::from_secs(10),
        "cut off after {took:?}"
    );
    // Nothing was proposed, and the member serves the next request.
    let (s, v) = call(
        "GET",
        &format!("{url}/api/v1/admin/node-enrollments"),
        Some(ADMIN),
        None,
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["enrollments"].as_array().map(|a| a.len()), Some(0), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_request_timeout_is_60_seconds() {
    assert_serve_default("--request-timeout", "60s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_limit_are_closed_at_once_and_the_member_keeps_serving() {
    let c = Cluster::start_with(1, &["--max-connections", "4"]).await;
    let url = c.url(1);
    // Four connections take every slot. A completed handshake proves its connection holds a
    // slot; one refused means a connection of the harness's start-up polling still held a slot
    // when it arrived (it is freed once the server sees that close), so try again.
    let mut held = vec![];
    let deadline = Instant::now() + Duration::from_secs(10);
    while held.len() < 4 {
        match try_tls_connect(&url).await {
            Some(s) => held.push(s),
            None => assert!(Instant::now() < deadline, "no slot came free"),
        }
    }
    // The fifth is closed at once, before a handshake: the client gets no answer.
    let mut fifth = tokio::net::TcpStream::connect(addr(&url)).await.unwrap();
    let took = closed_within(&mut fifth, Duration::from_secs(5))
        .await
        .expect("a connection beyond the limit was kept");
    assert!(took < Duration::from_secs(5));
    let (s, _) = call("GET", &format!("{url}/healthz"), None, None).await;
    assert_eq!(s, 0, "a request beyond the limit was answered");
    // Slots come back when connections close: the member serves again.
    held.clear();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (s, _) = call("GET", &format!("{url}/healthz"), None, None).await;
        if s == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "the member did not serve again");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        c.log(1).contains("connection limit reached"),
        "the limit was not logged"
    );
}
