//! Real-process harness: members and agents as child processes on loopback, real HTTP, real
//! files, real `kill -9`. Every wait is on a condition with a deadline, never a fixed sleep.
//! On a failing test the scratch folder (data dirs and logs) is kept and its path printed.

#![allow(dead_code)] // each test binary uses a different part of the harness

use std::future::Future;
use std::path::Path;
use std::path::PathBuf;
use std::process::Child;
use std::process::Command;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use serde_json::json;

pub const ADMIN: &str = "test-admin-token-0123456789abcdef";
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

/// A free loopback port, never the same one twice in this process (the kernel can hand out a
/// just-released port again, and two members given one port made a member vote for itself
/// twice, which tripped an openraft assertion).
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut given = GIVEN.lock().unwrap_or_else(|p| p.into_inner());
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

pub fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(15))
        .build()
        .unwrap()
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
    match r.send().await {
        Ok(resp) => {
            let s = resp.status().as_u16();
            let v = resp.json().await.unwrap_or(Value::Null);
            (s, v)
        }
        Err(_) => (0, Value::Null),
    }
}

pub async fn raw(method: &str, url: &str, headers: &[(&str, &str)], body: Vec<u8>) -> (u16, Value) {
    let m = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
    let mut r = http().request(m, url).body(body);
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    match r.send().await {
        Ok(resp) => {
            let s = resp.status().as_u16();
            let v = resp.json().await.unwrap_or(Value::Null);
            (s, v)
        }
        Err(_) => (0, Value::Null),
    }
}

pub fn is_error_shape(v: &Value) -> bool {
    v["error"]["code"].is_string() && v["error"]["message"].is_string()
}

/// Poll `f` until it returns `Some`, or panic with `what` after `timeout`.
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

fn spawn(bin: &Path, args: &[String], log: &Path, env: &[(&str, &str)]) -> Child {
    use std::os::unix::process::CommandExt;
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .unwrap();
    let mut c = Command::new(bin);
    c.args(args)
        .stdout(Stdio::from(out.try_clone().unwrap()))
        .stderr(Stdio::from(out))
        .stdin(Stdio::null());
    c.env_remove("MODELFORGE_ENROLLMENT_TOKEN")
        .env_remove("MODELFORGE_ADMIN_TOKEN")
        .env("MODELFORGE_LOG", "info");
    for (k, v) in env {
        c.env(k, v);
    }
    c.process_group(0);
    c.spawn()
        .unwrap_or_else(|e| panic!("spawn {}: {e}", bin.display()))
}

/// Wait for a child to exit by itself; its exit code (-1: a signal).
async fn wait_child_exit(child: &mut Child, what: &str) -> i32 {
    wait_until(what, WAIT, || {
        let r = child
            .try_wait()
            .ok()
            .flatten()
            .map(|s| s.code().unwrap_or(-1));
        async move { r }
    })
    .await
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: plain kill(2) on our own child's process group.
    unsafe {
        libc::kill(-(child.id() as i32), sig);
    }
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
    procs: Vec<Option<Child>>,
    extra: Vec<String>,
    pub scratch: Scratch,
}

impl Cluster {
    /// Start `n` members with the same `--peer` list and wait for a leader and readiness.
    pub async fn start(n: usize) -> Self {
        Self::start_with(n, &[]).await
    }

    pub async fn start_with(n: usize, extra: &[&str]) -> Self {
        let mut c = Cluster {
            ids: (1..=n as u64).collect(),
            ports: (0..n).map(|_| free_port()).collect(),
            procs: (0..n).map(|_| None).collect(),
            extra: extra.iter().map(|s| s.to_string()).collect(),
            scratch: Scratch::new(),
        };
        for id in c.ids.clone() {
            c.start_member(id);
        }
        c.wait_ready().await;
        c
    }

    pub fn root(&self) -> &Path {
        self.scratch.path()
    }

    pub fn url(&self, id: u64) -> String {
        format!("http://127.0.0.1:{}", self.ports[(id - 1) as usize])
    }

    pub fn urls(&self) -> Vec<String> {
        self.ids.iter().map(|i| self.url(*i)).collect()
    }

    pub fn data_dir(&self, id: u64) -> PathBuf {
        self.root().join(format!("m{id}"))
    }

    pub fn start_member(&mut self, id: u64) {
        let mut args = vec![
            "serve".to_string(),
            "--node-id".into(),
            id.to_string(),
            "--listen".into(),
            format!("127.0.0.1:{}", self.ports[(id - 1) as usize]),
            "--data-dir".into(),
            self.data_dir(id).display().to_string(),
        ];
        for j in &self.ids {
            args.push("--peer".into());
            args.push(format!("{j}={}", self.url(*j)));
        }
        args.extend(self.extra.iter().cloned());
        let log = self.root().join(format!("m{id}.log"));
        self.procs[(id - 1) as usize] = Some(spawn(
            &server_bin(),
            &args,
            &log,
            &[("MODELFORGE_ADMIN_TOKEN", ADMIN)],
        ));
    }

    pub fn alive(&mut self, id: u64) -> bool {
        match &mut self.procs[(id - 1) as usize] {
            Some(c) => c.try_wait().ok().flatten().is_none(),
            None => false,
        }
    }

    /// `kill -9` a member and reap it.
    pub fn kill9(&mut self, id: u64) {
        if let Some(mut c) = self.procs[(id - 1) as usize].take() {
            signal(&c, libc::SIGKILL);
            let _ = c.wait();
        }
    }

    /// Wait for member `id`'s process to exit by itself; its exit code (-1: a signal).
    pub async fn wait_exit(&mut self, id: u64) -> i32 {
        let child = self.procs[(id - 1) as usize]
            .as_mut()
            .expect("member started");
        let code = wait_child_exit(child, &format!("member {id} to exit")).await;
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

    pub async fn cluster_view(&self, id: u64) -> Option<Value> {
        let (s, v) = call(
            "GET",
            &format!("{}/api/v1/cluster", self.url(id)),
            Some(ADMIN),
            None,
        )
        .await;
        (s == 200).then_some(v)
    }

    /// The leader that every live member agrees on.
    pub async fn leader(&mut self) -> Option<u64> {
        let live = self.live_ids();
        let mut agreed = None;
        for id in &live {
            let v = self.cluster_view(*id).await?;
            let l = v["leader_id"].as_u64()?;
            if !live.contains(&l) || agreed.is_some_and(|a| a != l) {
                return None;
            }
            agreed = Some(l);
        }
        agreed
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
    pub async fn audit_events(&mut self) -> Vec<Value> {
        let (s, v) = self.admin("GET", "/api/v1/admin/audit", None).await;
        assert_eq!(s, 200, "{v}");
        v["events"].as_array().cloned().unwrap_or_default()
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
                return v["token"].as_str().unwrap().to_string();
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "could not create a token: {s} {v}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub async fn node(&mut self, node_id: &str) -> Value {
        let (s, v) = self
            .admin_read(&format!("/api/v1/admin/hardware/nodes/{node_id}"))
            .await;
        assert_eq!(s, 200, "{v}");
        v
    }

    pub async fn credentials(&mut self, node_id: &str) -> Value {
        let (s, v) = self
            .admin_read(&format!(
                "/api/v1/admin/hardware/nodes/{node_id}/credentials"
            ))
            .await;
        assert_eq!(s, 200, "{v}");
        v
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
                let used = v["credentials"]
                    .as_array()
                    .is_some_and(|cs| cs.iter().any(|c| c["last_used_at"].is_string()));
                (s == 200 && used).then_some(())
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
        let (s, v) = call(
            "GET",
            &format!("{}/api/v1/cluster/state-digest", self.url(id)),
            Some(ADMIN),
            None,
        )
        .await;
        (s == 200).then(|| {
            (
                v["digest"].as_str().unwrap_or("").to_string(),
                v["applied_index"].as_u64().unwrap_or(0),
            )
        })
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

impl Drop for Cluster {
    fn drop(&mut self) {
        for c in self.procs.iter_mut().flatten() {
            signal(c, libc::SIGKILL);
            let _ = c.wait();
        }
    }
}

pub struct Agent {
    pub state_dir: PathBuf,
    pub hostname: String,
    urls: Vec<String>,
    gpus: String,
    log: PathBuf,
    child: Option<Child>,
}

impl Agent {
    pub fn new(root: &Path, name: &str, urls: Vec<String>) -> Self {
        Self {
            state_dir: root.join(format!("agent-{name}")),
            hostname: format!("host-{name}"),
            urls,
            gpus: "simulated:2".into(),
            log: root.join(format!("agent-{name}.log")),
            child: None,
        }
    }

    pub fn gpus(mut self, spec: &str) -> Self {
        self.gpus = spec.to_string();
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
            "300ms".into(),
            "--hostname".into(),
            self.hostname.clone(),
            "--enroll-timeout".into(),
            "30s".into(),
        ];
        if let Some(t) = token {
            args.push("--enrollment-token".into());
            args.push(t.to_string());
        }
        self.child = Some(spawn(&agent_bin(), &args, &self.log, &[]));
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            signal(&c, libc::SIGTERM);
            let _ = c.wait();
        }
    }

    pub fn node_id(&self) -> Option<String> {
        let s = std::fs::read_to_string(self.state_dir.join("identity.json")).ok()?;
        let v: Value = serde_json::from_str(&s).ok()?;
        v["node_id"].as_str().map(String::from)
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
        let child = self.child.as_mut().expect("agent started");
        let code = wait_child_exit(child, "the agent to exit").await;
        self.child = None;
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        (code, log.lines().last().unwrap_or("").to_string())
    }

    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().ok().flatten().is_none())
    }

    pub fn wipe(&self) {
        let _ = std::fs::remove_dir_all(&self.state_dir);
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(c) = self.child.as_mut() {
            signal(c, libc::SIGKILL);
            let _ = c.wait();
        }
    }
}
