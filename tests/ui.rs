//! The status page (`/ui/`) in headless Chromium (Debian's `chromium`; `.ci/run` installs it),
//! driven over the DevTools protocol: a wrong token is refused, the sign-in form signs in, the
//! node list shows a node online, its detail shows its history, and when its agent stops the
//! same page (no reload: blocking queries) shows it offline. Screenshots go to
//! `target/ui-screenshots/` (CI keeps them as artifacts).

mod common;

use std::net::TcpStream;
use std::path::PathBuf;
use std::time::Duration;

use common::*;
use serde_json::Value;
use serde_json::json;
use tungstenite::Message;
use tungstenite::WebSocket;

fn chromium() -> PathBuf {
    for name in ["chromium", "chromium-browser", "google-chrome"] {
        for dir in std::env::var("PATH").unwrap_or_default().split(':') {
            let p = PathBuf::from(dir).join(name);
            if p.is_file() {
                return p;
            }
        }
    }
    panic!("no Chromium on PATH: `apt-get install chromium` (.ci/run installs it)");
}

/// Headless Chromium with one page, spoken to over the DevTools protocol.
struct Browser {
    child: std::process::Child,
    ws: WebSocket<TcpStream>,
    next_id: u64,
    _profile: tempfile::TempDir,
}

impl Browser {
    async fn start() -> Self {
        let profile = tempfile::tempdir().unwrap();
        let child = std::process::Command::new(chromium())
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                // The test cluster's certificates come from the harness CA, unknown to Chromium.
                "--ignore-certificate-errors",
                "--window-size=1280,960",
                "--remote-debugging-port=0",
                &format!("--user-data-dir={}", profile.path().display()),
                "about:blank",
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start chromium");
        // Chromium writes the port it took into the profile.
        let port_file = profile.path().join("DevToolsActivePort");
        let port: u16 = wait_until("Chromium's DevTools port", WAIT, || {
            let text = std::fs::read_to_string(&port_file).unwrap_or_default();
            async move { text.lines().next()?.trim().parse().ok() }
        })
        .await;
        let pages: Value = wait_until("Chromium's page target", WAIT, || async move {
            let r = reqwest::get(format!("http://127.0.0.1:{port}/json/list"))
                .await
                .ok()?;
            let v: Value = r.json().await.ok()?;
            v.as_array()?
                .iter()
                .any(|t| t["type"] == "page")
                .then_some(v)
        })
        .await;
        let ws_url = pages
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["type"] == "page")
            .unwrap()["webSocketDebuggerUrl"]
            .as_str()
            .unwrap()
            .to_string();
        let stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let (ws, _) = tungstenite::client(ws_url.as_str(), stream).expect("DevTools WebSocket");
        Browser {
            child,
            ws,
            next_id: 1,
            _profile: profile,
        }
    }

    /// One DevTools command; its result (events in between are skipped).
    fn call(&mut self, method: &str, params: Value) -> Value {
        let id = self.next_id;
        self.next_id += 1;
        let msg = json!({"id": id, "method": method, "params": params}).to_string();
        self.ws.send(Message::text(msg)).unwrap();
        loop {
            let m = self.ws.read().expect("a DevTools answer");
            let Message::Text(t) = m else { continue };
            let v: Value = serde_json::from_str(t.as_str()).unwrap();
            if v["id"] == id {
                assert!(v.get("error").is_none(), "{method}: {v}");
                return v["result"].clone();
            }
        }
    }

    /// A JavaScript expression's value in the page.
    fn eval(&mut self, expression: &str) -> Value {
        let r = self.call(
            "Runtime.evaluate",
            json!({"expression": expression, "returnByValue": true, "awaitPromise": true}),
        );
        r["result"]["value"].clone()
    }

    fn navigate(&mut self, url: &str) {
        self.call("Page.navigate", json!({"url": url}));
    }

    fn screenshot(&mut self, name: &str) -> PathBuf {
        let r = self.call("Page.captureScreenshot", json!({"format": "png"}));
        let png = data_encoding::BASE64
            .decode(r["data"].as_str().unwrap().as_bytes())
            .unwrap();
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/ui-screenshots");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, png).unwrap();
        path
    }

    /// Wait until `expression` is true in the page.
    async fn wait_for(&mut self, what: &str, expression: &str) {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            if tokio::task::block_in_place(|| self.eval(expression)) == Value::Bool(true) {
                return;
            }
            if tokio::time::Instant::now() >= deadline {
                let page = tokio::task::block_in_place(|| {
                    self.eval("document.body ? document.body.innerText : ''")
                });
                panic!("the page never showed: {what} ({expression}); it shows:\n{page}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The status of `node` in the page's node list, as JavaScript.
fn row_status(node: &str) -> String {
    format!(
        "(document.querySelector('#nodes tr[data-node=\"{node}\"] .status') || {{}}).textContent"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_signs_in_and_shows_a_node_go_offline_live() {
    let mut c = Cluster::start_with(1, &["--stale-after", "2s", "--offline-after", "4s"]).await;
    let url = c.url(1);
    let (mut agent, nid, _) = c.enrol_one("ui-node").await;

    // The page and its assets need no token, and carry a content security policy; the data
    // calls it makes do need one.
    for (path, ctype) in [
        ("/ui/", "text/html"),
        ("/ui/app.js", "text/javascript"),
        ("/ui/app.css", "text/css"),
    ] {
        let r = http().get(format!("{url}{path}")).send().await.unwrap();
        assert_eq!(r.status(), 200, "{path}");
        let h = r.headers();
        assert!(h["content-type"].to_str().unwrap().starts_with(ctype));
        assert!(
            h["content-security-policy"]
                .to_str()
                .unwrap()
                .contains("script-src 'self'")
        );
    }
    let (s, v) = call(
        "GET",
        &format!("{url}/api/v1/admin/hardware/nodes"),
        None,
        None,
    )
    .await;
    assert_eq!(refused(s, &v).0, 401);

    let mut b = Browser::start().await;
    tokio::task::block_in_place(|| b.navigate(&format!("{url}/ui/")));
    // The page marks itself ready once its handlers are attached.
    b.wait_for(
        "the page ready",
        "document.body && document.body.dataset.ready === '1'",
    )
    .await;

    // A wrong token: refused, still signed out, nothing kept.
    let sign_in = |token: &str| {
        format!(
            "document.getElementById('token').value = {}; document.getElementById('signin-form').requestSubmit(); true",
            json!(token)
        )
    };
    tokio::task::block_in_place(|| b.eval(&sign_in("not-the-admin-token-0123456789")));
    b.wait_for(
        "the refusal",
        "!document.getElementById('signin-error').hidden && document.getElementById('signin-error').textContent.includes('refused')",
    )
    .await;
    assert_eq!(
        tokio::task::block_in_place(|| b.eval("sessionStorage.length + localStorage.length")),
        json!(0)
    );

    // The right one: the cluster and the node, online.
    tokio::task::block_in_place(|| b.eval(&sign_in(ADMIN)));
    b.wait_for(
        "the node online",
        &format!("{} === 'online'", row_status(&nid)),
    )
    .await;
    b.wait_for(
        "the leader and the audit trail",
        "document.querySelectorAll('#members tbody tr').length === 1 && document.querySelectorAll('#audit tbody tr').length > 0",
    )
    .await;
    // The token is in the tab's session only, and the page is marked to prove no reload.
    assert_eq!(
        tokio::task::block_in_place(|| {
            b.eval(
            "window.__same_page = true; localStorage.length === 0 && sessionStorage.getItem('modelforge.token') !== null"
        )
        }),
        json!(true)
    );
    let shot = tokio::task::block_in_place(|| b.screenshot("status-page-online.png"));
    assert!(std::fs::metadata(&shot).unwrap().len() > 10_000);

    // A node's detail: its history and telemetry charts.
    tokio::task::block_in_place(|| {
        b.eval(&format!(
            "document.querySelector('#nodes tr[data-node=\"{nid}\"]').click(); true"
        ))
    });
    b.wait_for(
        "the node's detail",
        &format!(
            "document.getElementById('node-title').textContent.includes('{nid}') && document.querySelectorAll('#history tbody tr').length > 0 && document.querySelectorAll('#charts svg').length > 0"
        ),
    )
    .await;
    tokio::task::block_in_place(|| b.screenshot("status-page-node.png"));

    // The agent stops: the same page shows the node offline, in the list and in its detail.
    agent.stop();
    b.wait_for(
        "the node offline",
        &format!("{} === 'offline'", row_status(&nid)),
    )
    .await;
    b.wait_for(
        "the detail offline",
        "document.querySelector('#node-facts .status').textContent === 'offline'",
    )
    .await;
    assert_eq!(
        tokio::task::block_in_place(|| b.eval("window.__same_page === true")),
        json!(true),
        "the page was reloaded: it must be live"
    );
    tokio::task::block_in_place(|| b.screenshot("status-page-offline.png"));
}
