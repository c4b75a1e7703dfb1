//! Real-process harness: members and agents as child processes on loopback, real HTTP, real
//! files, real `kill -9`. Every wait is on a condition with a deadline, never a fixed sleep.
//! On a failing test the scratch folder (data dirs and logs) is kept and its path printed.

#![allow(dead_code)] // each test binary uses a different part of the harness

use std::future::Future;
use std::path::Path;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

pub use modelforge_devkit as devkit;
use modelforge_devkit::Proc;
use modelforge_proto::api;
use modelforge_proto::api::ClusterView;
use modelforge_proto::api::ErrorCode;
use modelforge_proto::wire::ErrorBody;
use serde::de::DeserializeOwned;
use serde_json::Value;
use serde_json::json;

pub const ADMIN: &str = "test-admin-token-0123456789abcdef";
/// The secret members authenticate each other and the backups with (never the admin token).
pub const CLUSTER_SECRET: &str = "test-cluster-secret-0123456789abcdef";
/// What every member is started with. The tests run debug members, several at once on a
/// machine of two cores: a member there is often kept from its CPU for more than the default
/// queue-delay target by the others, which is not its own overload, and a heartbeat shed for
/// it would fail a test about something else (tests of shedding set their own).
pub const MEMBER_ENV: [(&str, &str); 3] = [
    ("MODELFORGE_ADMIN_TOKEN", ADMIN),
    ("MODELFORGE_CLUSTER_SECRET", CLUSTER_SECRET),
    ("MODELFORGE_SHED_QUEUE_DELAY", "250ms"),
];
pub const WAIT: Duration = Duration::from_secs(30);

/// What the leader writes by itself, on timers, put off beyond a test, so that the state digest
/// moves only if a request wrote something: refusals naming a real node are folded into its
/// history by the periodic events write (legitimately: the contract shows them on the node), a
/// silent node's status transitions too, and credential uses are written coalesced.
pub const NO_TIMED_WRITES: &[&str] = &[
    "--events-interval",
    "1h",
    "--touch-interval",
    "1h",
    "--stale-after",
    "1h",
    "--offline-after",
    "2h",
];

/// The `modelforge` binary: cargo's, unless `MF_TEST_BIN_DIR` names a folder holding a copy
/// (for a target dir shared with other builds, whose binaries can change under a test run).
pub fn server_bin() -> PathBuf {
    match std::env::var_os("MF_TEST_BIN_DIR") {
        Some(d) => PathBuf::from(d).join("modelforge"),
        None => PathBuf::from(env!("CARGO_BIN_EXE_modelforge")),
    }
}

/// The agent binary sits beside the server's; build it if this test run has not.
pub fn agent_bin() -> PathBuf {
    let p = server_bin().with_file_name("modelforge-agent");
    if !p.exists() {
        let profile_release = server_bin()
            .parent()
            .is_some_and(|d| d.ends_with("release"));
        let mut c = Command::new(env!("CARGO"));
        c.args(["build", "-p", "modelforge-agent"]);
        if profile_release {
            c.arg("--release");
        }
        let st = c.status().expect("run cargo build for the agent");
        assert!(st.success(), "building modelforge-agent failed");
    }
    p
}

pub use modelforge_devkit::free_port;

/// A client that trusts the harness CA (every member speaks TLS; see `devkit::ca`).
pub fn http() -> reqwest::Client {
    let ca = harness_ca();
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(15))
        .tls_backend_preconfigured(
            modelforge_client::tls::client_config(&ca.pem, None).expect("the harness CA loads"),
        )
        .build()
        .unwrap()
}

/// A client trusting the harness CA that presents a certificate the harness CA issued to member
/// `id` (`None`: no client certificate), as a peer would.
pub fn member_client(id: Option<u64>) -> reqwest::Client {
    let ca = harness_ca();
    let identity = id.map(|id| {
        let key = std::fs::read_to_string(&ca.key).unwrap();
        let (cert, key) =
            modelforge::tls::issue_member(&ca.pem, &key, id, &["127.0.0.1".into()]).unwrap();
        modelforge::tls::load(&ca.pem, &cert, &key)
            .unwrap()
            .identity()
    });
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(10))
        .tls_backend_preconfigured(
            modelforge_client::tls::client_config(&ca.pem, identity).unwrap(),
        )
        .build()
        .unwrap()
}

/// A peer header signed as member `from` with the harness clusters' secret (the admin token)
/// for `cluster_id` ("" unless restored): what that member itself would send.
pub fn peer_header(cluster_id: &str, from: u64, method: &str, path: &str, body: &[u8]) -> String {
    let key = modelforge::secrets::peer_token(CLUSTER_SECRET, cluster_id);
    modelforge_raft::peer_auth::PeerSigner::new(key.as_bytes(), from).sign(method, path, body, 0)
}

/// Nothing under `dir` (itself included) is readable, writable or searchable by anyone but
/// its owner: files 0600 at most, directories 0700.
pub fn assert_private(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let mut todo = vec![dir.to_path_buf()];
    let mut seen = 0;
    while let Some(p) = todo.pop() {
        let meta = std::fs::symlink_metadata(&p).unwrap();
        let mode = meta.permissions().mode() & 0o777;
        assert_eq!(mode & 0o077, 0, "{} has mode {mode:o}", p.display());
        seen += 1;
        if meta.is_dir() {
            for e in std::fs::read_dir(&p).unwrap() {
                todo.push(e.unwrap().path());
            }
        }
    }
    assert!(seen > 1, "{} is empty", dir.display());
}

/// A child process killed (and reaped) when the test lets go of it, even on a panic.
pub struct KillOnDrop(pub std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The process's harness CA (made by the server's `cluster init-ca` on first use).
pub fn harness_ca() -> &'static devkit::Ca {
    modelforge_client::tls::install_provider();
    devkit::ca(&server_bin())
}

/// (status, JSON body or Null). Status 0: no answer.
pub async fn call(
    method: &str,
    url: &str,
    token: Option<&str>,
    body: Option<Value>,
) -> (u16, Value) {
    let m = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
    let mut r = http().request(m, url);
    if let Some(t) = token {
        r = r.bearer_auth(t);
    }
    if let Some(b) = body {
        r = r.json(&b);
    }
    answer(r).await
}

pub async fn raw(method: &str, url: &str, headers: &[(&str, &str)], body: Vec<u8>) -> (u16, Value) {
    let m = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
    let mut r = http().request(m, url).body(body);
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    answer(r).await
}

/// Send `r`: (status, JSON body or null); (0, null) when no answer came.
async fn answer(r: reqwest::RequestBuilder) -> (u16, Value) {
    match r.send().await {
        Ok(resp) => {
            let s = resp.status().as_u16();
            let v = resp.json().await.unwrap_or(Value::Null);
            (s, v)
        }
        Err(e) => {
            eprintln!("no answer: {e:?}");
            (0, Value::Null)
        }
    }
}

/// Run `modelforge admin <args>` against `urls`; (exit code, stdout, stderr).
pub async fn admin_cli(urls: &str, args: &[&str]) -> (i32, String, String) {
    let out = tokio::process::Command::new(server_bin())
        .arg("admin")
        .args(args)
        .env("MODELFORGE_URL", urls)
        .env("MODELFORGE_CACERT", &harness_ca().cert)
        .env("MODELFORGE_ADMIN_TOKEN", ADMIN)
        .env("MODELFORGE_LOG", "warn")
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .expect("run modelforge admin");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

pub async fn admin_json(urls: &str, args: &[&str]) -> (i32, Value) {
    let mut a = args.to_vec();
    a.extend(["--output", "json"]);
    let (code, out, err) = admin_cli(urls, &a).await;
    let v = serde_json::from_str(&out).unwrap_or_else(|_| json!({"stdout": out, "stderr": err}));
    (code, v)
}

/// Whether `v` is the contract's error shape, `{"error": {"code": "...", "message": "..."}}`:
/// the raw wire shape is what is under test here, so it is read by key.
pub fn is_error_shape(v: &Value) -> bool {
    v["error"]["code"].is_string() && v["error"]["message"].is_string()
}

/// An answer read as its endpoint's type from `modelforge_proto::api` (or `wire`). A body that
/// does not decode (a drifted field, a refusal where an answer was expected) panics with `what`
/// and the body.
pub fn typed<T: DeserializeOwned>(what: &str, v: &Value) -> T {
    serde_json::from_value(v.clone()).unwrap_or_else(|e| {
        panic!(
            "{what}: the answer is not a {} ({e}): {v}",
            std::any::type_name::<T>()
        )
    })
}

/// The contract's error body of a refusal answered `status` (panics, with both, on any other
/// body).
pub fn error_body(status: u16, v: &Value) -> ErrorBody {
    typed(&format!("a refusal answered {status}"), v)
}

/// (status, code) of a refusal: the code is one of the table's (`api::ErrorCode`). Panics, with
/// the status and the body, when the body is not the contract's error body or names a code
/// the table does not have.
pub fn refused(status: u16, v: &Value) -> (u16, &'static str) {
    let b = error_body(status, v);
    let code = ErrorCode::parse(b.error.code.as_str()).unwrap_or_else(|| {
        panic!("a refusal answered {status} names a code the table does not have: {v}")
    });
    (status, code.as_str())
}

/// Items as text (ids held as `String` or as an id type: both display as the id), to compare
/// with the ids a test holds.
pub fn texts<T: std::fmt::Display>(items: &[T]) -> Vec<String> {
    items.iter().map(ToString::to_string).collect()
}

/// Whether a node's history holds an event of `kind` whose detail contains `detail`.
pub fn has_event(node: &api::NodeDetail, kind: &str, detail: &str) -> bool {
    node.history
        .iter()
        .any(|e| e.kind == kind && e.detail.contains(detail))
}

/// A node's latest telemetry as the heartbeat carried it (`None` before the first one).
pub fn telemetry(node: &api::NodeDetail) -> Option<modelforge_proto::wire::Telemetry> {
    (!node.telemetry.is_null()).then(|| typed("a node's telemetry", &node.telemetry))
}

/// Poll `f` until it returns `Some`, or panic with `what` after `timeout`.
/// A node's view, asked of the first of `urls` that answers 200.
pub async fn node_view(urls: &[String], node_id: &str) -> Option<api::NodeDetail> {
    for u in urls {
        let (s, v) = call(
            "GET",
            &format!("{u}/api/v1/admin/hardware/nodes/{node_id}"),
            Some(ADMIN),
            None,
        )
        .await;
        if s == 200 {
            return Some(typed("a node", &v));
        }
    }
    None
}

pub async fn wait_until<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Start a member or agent in a process group of its own, logging at info.
pub fn spawn(bin: &Path, args: &[String], log: &Path, env: &[(&str, &str)]) -> Proc {
    let mut env = env.to_vec();
    env.push(("MODELFORGE_LOG", "info"));
    Proc::spawn(bin, args, &env, log, true)
        .unwrap_or_else(|e| panic!("spawn {}: {e}", bin.display()))
}

/// Wait for a process to exit by itself; its exit code (-1: a signal).
pub async fn wait_exit_of(proc: &mut Proc, what: &str) -> i32 {
    proc.wait_exit(WAIT)
        .await
        .unwrap_or_else(|| panic!("{what} did not happen within {WAIT:?}"))
}

pub struct Scratch {
    pub dir: Option<tempfile::TempDir>,
}

impl Scratch {
    pub fn new() -> Self {
        Self {
            dir: Some(
                tempfile::Builder::new()
                    .prefix("mf-test-")
                    .tempdir()
                    .unwrap(),
            ),
        }
    }
    pub fn path(&self) -> &Path {
        self.dir.as_ref().unwrap().path()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if std::thread::panicking()
            && let Some(d) = self.dir.take()
        {
            let p = d.keep();
            eprintln!("test failed: logs and data kept in {}", p.display());
            if let Ok(rd) = std::fs::read_dir(&p) {
                for e in rd.flatten() {
                    if e.path().extension().is_some_and(|x| x == "log") {
                        let text = std::fs::read_to_string(e.path()).unwrap_or_default();
                        let tail: Vec<&str> = text.lines().rev().take(15).collect();
                        eprintln!("--- {} (last lines)", e.path().display());
                        for l in tail.into_iter().rev() {
                            eprintln!("{l}");
                        }
                    }
                }
            }
        }
    }
}

pub struct Cluster {
    pub ids: Vec<u64>,
    ports: Vec<u16>,
    procs: Vec<Option<Proc>>,
    extra: Vec<String>,
    /// Environment variables every member gets besides [`MEMBER_ENV`].
    pub env: Vec<(String, String)>,
    pub scratch: Scratch,
}

impl Cluster {
    /// Start `n` members with the same `--peer` list and wait for a leader and readiness.
    pub async fn start(n: usize) -> Self {
        Self::start_with(n, &[]).await
    }

    pub async fn start_with(n: usize, extra: &[&str]) -> Self {
        let mut c = Self::unstarted(n, extra);
        c.start_all().await;
        c
    }

    /// `n` members' ports and directories, none started yet (a test may prepare their data
    /// dirs first, e.g. mount a small filesystem there).
    pub fn unstarted(n: usize, extra: &[&str]) -> Self {
        harness_ca();
        Cluster {
            ids: (1..=n as u64).collect(),
            ports: (0..n).map(|_| free_port()).collect(),
            procs: (0..n).map(|_| None).collect(),
            extra: extra.iter().map(|s| s.to_string()).collect(),
            env: vec![],
            scratch: Scratch::new(),
        }
    }

    /// Start every member and wait for a leader and readiness.
    pub async fn start_all(&mut self) {
        for id in self.ids.clone() {
            self.start_member(id);
        }
        self.wait_ready().await;
    }

    pub fn root(&self) -> &Path {
        self.scratch.path()
    }

    pub fn url(&self, id: u64) -> String {
        devkit::url(self.ports[(id - 1) as usize])
    }

    pub fn urls(&self) -> Vec<String> {
        self.ids.iter().map(|i| self.url(*i)).collect()
    }

    pub fn data_dir(&self, id: u64) -> PathBuf {
        self.root().join(format!("m{id}"))
    }

    pub fn start_member(&mut self, id: u64) {
        let ports: Vec<u16> = self
            .ids
            .iter()
            .map(|i| self.ports[(*i - 1) as usize])
            .collect();
        let data_dir = self.data_dir(id);
        let args = devkit::MemberSpec {
            id,
            port: self.ports[(id - 1) as usize],
            data_dir: &data_dir,
            peers: &devkit::peers(&ports),
            routes: &[],
            extra: &self.extra,
        }
        .args();
        let log = self.root().join(format!("m{id}.log"));
        let mut env: Vec<(&str, &str)> = MEMBER_ENV.to_vec();
        env.extend(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        self.procs[(id - 1) as usize] = Some(spawn(&server_bin(), &args, &log, &env));
    }

    pub fn alive(&mut self, id: u64) -> bool {
        self.procs[(id - 1) as usize]
            .as_mut()
            .is_some_and(Proc::alive)
    }

    /// Send `sig` to member `id`'s process (true when it was delivered).
    /// A running member's process id.
    pub fn pid(&self, id: u64) -> Option<u32> {
        self.procs[(id - 1) as usize].as_ref().map(|p| p.pid())
    }

    pub fn signal(&self, id: u64, sig: i32) -> bool {
        self.procs[(id - 1) as usize]
            .as_ref()
            .is_some_and(|p| p.signal(sig))
    }

    /// `kill -9` a member and reap it.
    pub fn kill9(&mut self, id: u64) {
        if let Some(mut p) = self.procs[(id - 1) as usize].take() {
            p.kill9();
        }
    }

    /// Wait for member `id`'s process to exit by itself; its exit code (-1: a signal).
    pub async fn wait_exit(&mut self, id: u64) -> i32 {
        let proc = self.procs[(id - 1) as usize]
            .as_mut()
            .expect("member started");
        let code = wait_exit_of(proc, &format!("member {id} to exit")).await;
        self.procs[(id - 1) as usize] = None;
        code
    }

    /// What member `id` has logged so far (every start of it, in one file).
    pub fn log(&self, id: u64) -> String {
        std::fs::read_to_string(self.root().join(format!("m{id}.log"))).unwrap_or_default()
    }

    pub fn live_ids(&mut self) -> Vec<u64> {
        self.ids
            .clone()
            .into_iter()
            .filter(|i| self.alive(*i))
            .collect()
    }

    /// Member `id`'s own view of the cluster (`GET /api/v1/cluster`, typed).
    pub async fn cluster_view(&self, id: u64) -> Option<ClusterView> {
        devkit::cluster_view(&http(), &self.url(id), ADMIN, Duration::from_secs(15)).await
    }

    /// The leader that every live member agrees on.
    pub async fn leader(&mut self) -> Option<u64> {
        let live = self.live_ids();
        let mut views = vec![];
        for id in &live {
            views.push(self.cluster_view(*id).await);
        }
        devkit::agreed_leader(&views, &live)
    }

    pub async fn wait_leader(&mut self) -> u64 {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            if let Some(l) = self.leader().await {
                return l;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no agreed leader within {WAIT:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub async fn wait_ready(&mut self) {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let mut ok = true;
            for id in self.live_ids() {
                if call("GET", &format!("{}/readyz", self.url(id)), None, None)
                    .await
                    .0
                    != 200
                {
                    ok = false;
                }
            }
            if ok && self.leader().await.is_some() {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "cluster not ready within {WAIT:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The audit trail's events (from the first live member that answers).
    pub async fn audit_events(&mut self) -> Vec<api::AuditEventView> {
        let mut events = vec![];
        let mut query = "?limit=1000".to_string();
        loop {
            let page = self.audit(&query).await;
            events.extend(page.events);
            match page.next {
                Some(next) => query = format!("?limit=1000&after={next}"),
                None => return events,
            }
        }
    }

    /// `GET /api/v1/admin/audit<query>` (asserting 200).
    pub async fn audit(&mut self, query: &str) -> api::AuditPage {
        self.admin_as("GET", &format!("/api/v1/admin/audit{query}"), None, 200)
            .await
    }

    /// `GET /api/v1/admin/hardware/nodes<query>` (asserting 200): the nodes listed, every
    /// page.
    pub async fn nodes(&mut self, query: &str) -> Vec<api::NodeSummary> {
        let sep = if query.is_empty() { '?' } else { '&' };
        let mut nodes = vec![];
        let mut page_query = format!("{query}{sep}limit=1000");
        loop {
            let path = format!("/api/v1/admin/hardware/nodes{page_query}");
            let page = self.admin_as::<api::Nodes>("GET", &path, None, 200).await;
            nodes.extend(page.nodes);
            match page.next {
                Some(next) => page_query = format!("{query}{sep}limit=1000&after={next}"),
                None => return nodes,
            }
        }
    }

    /// An admin call on the first live member that answers.
    pub async fn admin(&mut self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut last = (0, Value::Null);
        for id in self.live_ids() {
            last = call(
                method,
                &format!("{}{path}", self.url(id)),
                Some(ADMIN),
                body.clone(),
            )
            .await;
            if last.0 != 0 && last.0 != 503 {
                return last;
            }
        }
        last
    }

    /// An admin request that must be answered `status`: its answer, as the endpoint's type.
    pub async fn admin_as<T: DeserializeOwned>(
        &mut self,
        method: &str,
        path: &str,
        body: Option<Value>,
        status: u16,
    ) -> T {
        let (s, v) = self.admin(method, path, body).await;
        assert_eq!(s, status, "{method} {path}: {v}");
        typed(&format!("{method} {path}"), &v)
    }

    /// An admin read, retried while no member can serve it consistently (a failover: the
    /// survivors answer 503 until a leader holds a quorum again). A read changes nothing.
    pub async fn admin_read(&mut self, path: &str) -> (u16, Value) {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let (s, v) = self.admin("GET", path, None).await;
            if (s != 0 && s != 503) || tokio::time::Instant::now() >= deadline {
                return (s, v);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// An admin read (retried across a failover, as [`Cluster::admin_read`]) that must be
    /// answered 200: its answer, as the endpoint's type.
    pub async fn read_as<T: DeserializeOwned>(&mut self, path: &str) -> T {
        let (s, v) = self.admin_read(path).await;
        assert_eq!(s, 200, "GET {path}: {v}");
        typed(&format!("GET {path}"), &v)
    }

    /// One agent named `name`, enrolled with a token of its own: the agent, its node id and
    /// its credential.
    pub async fn enrol_one(&mut self, name: &str) -> (Agent, String, String) {
        let t = self.new_token(600).await;
        let mut a = Agent::new(self.root(), name, self.urls());
        a.start(Some(&t));
        let (nid, cred) = a.wait_enrolled(None).await;
        (a, nid, cred)
    }

    /// Ask for a capability smoke of `node_id` (asserting 202): its answer.
    pub async fn start_smoke(&mut self, node_id: &str) -> api::SmokeStarted {
        let path = format!("/api/v1/admin/hardware/nodes/{node_id}/smoke");
        self.admin_as("POST", &path, None, 202).await
    }

    /// Revoke the credentials of `node_id` (asserting 200): the answer.
    pub async fn revoke(&mut self, node_id: &str) -> api::Revoked {
        let path = format!("/api/v1/admin/hardware/nodes/{node_id}/credential");
        self.admin_as("DELETE", &path, None, 200).await
    }

    /// `n` agents named `<prefix><i>`, each enrolled with a token of its own: the agents and
    /// their (node id, credential).
    pub async fn enrol_agents(
        &mut self,
        prefix: &str,
        n: usize,
    ) -> (Vec<Agent>, Vec<(String, String)>) {
        let mut agents = vec![];
        let mut nodes = vec![];
        for i in 0..n {
            let t = self.new_token(600).await;
            let mut a = Agent::new(self.root(), &format!("{prefix}{i}"), self.urls());
            a.start(Some(&t));
            nodes.push(a.wait_enrolled(None).await);
            agents.push(a);
        }
        (agents, nodes)
    }

    /// A new enrolment token, retried across a failover.
    pub async fn new_token(&mut self, ttl_seconds: u64) -> String {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let (s, v) = self
                .admin(
                    "POST",
                    "/api/v1/admin/node-enrollments",
                    Some(json!({"ttl_seconds": ttl_seconds})),
                )
                .await;
            if s == 201 {
                return typed::<api::TokenIssued>("a new enrolment token", &v).token;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "could not create a token: {s} {v}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub async fn node(&mut self, node_id: &str) -> api::NodeDetail {
        self.read_as(&format!("/api/v1/admin/hardware/nodes/{node_id}"))
            .await
    }

    pub async fn credentials(&mut self, node_id: &str) -> api::Credentials {
        self.read_as(&format!(
            "/api/v1/admin/hardware/nodes/{node_id}/credentials"
        ))
        .await
    }

    /// Wait until the node's credential has its first use replicated: the write an agent's
    /// first heartbeat makes. After it (and with `NO_TIMED_WRITES`), a stopped agent leaves no
    /// write of its own still to land.
    pub async fn wait_first_use(&mut self, node_id: &str) {
        let url = format!(
            "{}/api/v1/admin/hardware/nodes/{node_id}/credentials",
            self.url(1)
        );
        wait_until("the credential's first use is replicated", WAIT, || {
            let url = url.clone();
            async move {
                let (s, v) = call("GET", &url, Some(ADMIN), None).await;
                let used = s == 200
                    && typed::<api::Credentials>("a node's credentials", &v)
                        .credentials
                        .iter()
                        .any(|c| c.last_used_at.is_some());
                used.then_some(())
            }
        })
        .await;
    }

    pub async fn heartbeat_all(&mut self, node_id: &str, credential: &str) -> Vec<u16> {
        let mut out = vec![];
        for id in self.live_ids() {
            let url = format!("{}/api/v1/agent/nodes/{node_id}/heartbeat", self.url(id));
            out.push(
                call("POST", &url, Some(credential), Some(json!({})))
                    .await
                    .0,
            );
        }
        out
    }

    /// The state digest and applied index of one member (read locally, not forwarded).
    pub async fn digest(&self, id: u64) -> Option<(String, u64)> {
        let d = devkit::state_digest(&http(), &self.url(id), ADMIN).await?;
        Some((d.digest, d.applied_index))
    }

    /// Wait until every live member has applied the same state.
    pub async fn wait_converged(&mut self) -> String {
        let ids = self.live_ids();
        let this = &*self;
        wait_until("members converge to one state digest", WAIT, || async {
            let mut digests = vec![];
            for id in &ids {
                digests.push(this.digest(*id).await?);
            }
            let first = digests[0].clone();
            digests.iter().all(|d| *d == first).then_some(first.0)
        })
        .await
    }
}

/// What the tests read of the agent's `identity.json`. The agent's own type for the file is
/// private to it and `modelforge_proto` has none, so this names the one field read.
#[derive(serde::Deserialize)]
struct IdentityFile {
    node_id: Option<String>,
}

pub struct Agent {
    pub state_dir: PathBuf,
    pub hostname: String,
    urls: Vec<String>,
    gpus: String,
    interval: String,
    /// How it trusts the cluster (default: `--ca-file` with the harness CA), and more flags.
    trust: Vec<String>,
    log: PathBuf,
    child: Option<Proc>,
}

impl Agent {
    pub fn new(root: &Path, name: &str, urls: Vec<String>) -> Self {
        Self {
            state_dir: root.join(format!("agent-{name}")),
            hostname: format!("host-{name}"),
            urls,
            gpus: "simulated:2".into(),
            interval: "300ms".into(),
            trust: vec!["--ca-file".into(), harness_ca().cert.display().to_string()],
            log: root.join(format!("agent-{name}.log")),
            child: None,
        }
    }

    /// Replace how the agent trusts the cluster (e.g. `--ca-cert-hash <pin>`), with more flags.
    pub fn trust(mut self, args: &[&str]) -> Self {
        self.trust = args.iter().map(|a| a.to_string()).collect();
        self
    }

    pub fn gpus(mut self, spec: &str) -> Self {
        self.gpus = spec.to_string();
        self
    }

    /// The heartbeat interval (`--heartbeat-interval`; 300ms unless set).
    pub fn interval(mut self, every: &str) -> Self {
        self.interval = every.to_string();
        self
    }

    /// Start (or restart) with an optional token.
    pub fn start(&mut self, token: Option<&str>) {
        self.stop();
        let mut args = vec![
            "--control-plane".to_string(),
            self.urls.join(","),
            "--state-dir".into(),
            self.state_dir.display().to_string(),
            "--gpu-source".into(),
            self.gpus.clone(),
            "--heartbeat-interval".into(),
            self.interval.clone(),
            "--hostname".into(),
            self.hostname.clone(),
            "--enroll-timeout".into(),
            "30s".into(),
        ];
        args.extend(self.trust.iter().cloned());
        if let Some(t) = token {
            // Through a file, as the README says; one test passes it in argv.
            let file = self.state_dir.with_extension("token");
            std::fs::write(&file, format!("{t}\n")).unwrap();
            args.push("--enrollment-token-file".into());
            args.push(file.display().to_string());
        }
        self.child = Some(spawn(&agent_bin(), &args, &self.log, &[]));
    }

    pub fn stop(&mut self) {
        if let Some(mut p) = self.child.take() {
            p.terminate();
        }
    }

    /// The node id in the agent's `identity.json` (`None` before it exists or before the
    /// agent enrolled). The agent writes the file atomically: one that does not decode panics.
    pub fn node_id(&self) -> Option<String> {
        let path = self.state_dir.join("identity.json");
        let s = std::fs::read_to_string(&path).ok()?;
        let f: IdentityFile = serde_json::from_str(&s)
            .unwrap_or_else(|e| panic!("{} does not decode ({e}): {s}", path.display()));
        f.node_id
    }

    pub fn credential(&self) -> Option<String> {
        std::fs::read_to_string(self.state_dir.join("credential"))
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
    }

    /// Wait for a credential other than `previous`; return (node id, credential).
    pub async fn wait_enrolled(&self, previous: Option<&str>) -> (String, String) {
        wait_until("the agent to enrol", WAIT, || async {
            let c = self.credential()?;
            if Some(c.as_str()) == previous {
                return None;
            }
            Some((self.node_id()?, c))
        })
        .await
    }

    /// Wait for the agent to exit; return its status code and its last log line.
    pub async fn wait_exit(&mut self) -> (i32, String) {
        let proc = self.child.as_mut().expect("agent started");
        let code = wait_exit_of(proc, "the agent to exit").await;
        self.child = None;
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        (code, log.lines().last().unwrap_or("").to_string())
    }

    pub fn running(&mut self) -> bool {
        self.child.as_mut().is_some_and(Proc::alive)
    }

    pub fn wipe(&self) {
        let _ = std::fs::remove_dir_all(&self.state_dir);
    }
}
