//! A cluster of real `modelforge serve` processes whose peer links run through proxies, so
//! that the nemesis can kill, pause and cut members. Clients (agents, admins) reach members
//! directly, as they would across a partition that only cuts the members from each other.

use std::collections::BTreeMap;
use std::path::Path;
use std::path::PathBuf;
use std::process::Child;
use std::process::Command;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;

use crate::proxy::Proxy;

pub const ADMIN: &str = "chaos-admin-token-0123456789abcdef";

/// Trouble with the harness itself, never to be reported as a pass or as a violation.
#[derive(Debug)]
pub struct HarnessError(pub String);

impl std::fmt::Display for HarnessError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "harness trouble: {}", self.0)
    }
}

pub struct ChaosCluster {
    pub root: PathBuf,
    bin: PathBuf,
    pub n: usize,
    ports: Vec<u16>,
    proxies: BTreeMap<(usize, usize), Proxy>,
    procs: Vec<Option<Child>>,
    paused: Vec<bool>,
    extra: Vec<String>,
    pub http: reqwest::Client,
}

fn free_port() -> Result<u16, HarnessError> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| HarnessError(format!("no free port: {e}")))
}

impl ChaosCluster {
    /// Start `n` members (ids 1..=n) and wait until they agree on a leader.
    pub async fn start(
        bin: &Path,
        root: &Path,
        n: usize,
        extra: &[String],
    ) -> Result<Self, HarnessError> {
        if !bin.exists() {
            return Err(HarnessError(format!(
                "server binary {} not found (build it first)",
                bin.display()
            )));
        }
        let ports: Vec<u16> = (0..n).map(|_| free_port()).collect::<Result<_, _>>()?;
        let mut proxies = BTreeMap::new();
        for i in 0..n {
            for (j, port) in ports.iter().enumerate() {
                if i != j {
                    let p = Proxy::start(*port)
                        .await
                        .map_err(|e| HarnessError(format!("proxy: {e}")))?;
                    proxies.insert((i, j), p);
                }
            }
        }
        let http = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(Duration::from_millis(500))
            .pool_max_idle_per_host(64)
            .build()
            .map_err(|e| HarnessError(e.to_string()))?;
        let mut c = Self {
            root: root.to_path_buf(),
            bin: bin.to_path_buf(),
            n,
            ports,
            proxies,
            procs: (0..n).map(|_| None).collect(),
            paused: vec![false; n],
            extra: extra.to_vec(),
            http,
        };
        for i in 0..n {
            c.start_member(i)?;
        }
        c.wait_leader(Duration::from_secs(60))
            .await
            .ok_or_else(|| HarnessError("the cluster elected no leader within 60 s".into()))?;
        Ok(c)
    }

    pub fn url(&self, i: usize) -> String {
        format!("http://127.0.0.1:{}", self.ports[i])
    }

    pub fn urls(&self) -> Vec<String> {
        (0..self.n).map(|i| self.url(i)).collect()
    }

    pub fn start_member(&mut self, i: usize) -> Result<(), HarnessError> {
        use std::os::unix::process::CommandExt;
        let mut cmd = Command::new(&self.bin);
        cmd.args([
            "serve",
            "--node-id",
            &(i + 1).to_string(),
            "--listen",
            &format!("127.0.0.1:{}", self.ports[i]),
        ]);
        cmd.args([
            "--data-dir",
            &self.root.join(format!("m{}", i + 1)).display().to_string(),
        ]);
        for j in 0..self.n {
            cmd.args(["--peer", &format!("{}={}", j + 1, self.url(j))]);
            if j != i {
                cmd.args([
                    "--peer-route",
                    &format!("{}=http://127.0.0.1:{}", j + 1, self.proxies[&(i, j)].port),
                ]);
            }
        }
        cmd.args(&self.extra);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.root.join(format!("m{}.log", i + 1)))
            .map_err(|e| HarnessError(format!("log file: {e}")))?;
        cmd.env("MODELFORGE_ADMIN_TOKEN", ADMIN)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .process_group(0);
        let child = cmd
            .spawn()
            .map_err(|e| HarnessError(format!("start member {}: {e}", i + 1)))?;
        self.procs[i] = Some(child);
        self.paused[i] = false;
        Ok(())
    }

    pub fn running(&mut self, i: usize) -> bool {
        self.procs[i]
            .as_mut()
            .is_some_and(|c| c.try_wait().ok().flatten().is_none())
    }

    pub fn is_paused(&self, i: usize) -> bool {
        self.paused[i]
    }

    fn signal(&self, i: usize, sig: i32) -> bool {
        match &self.procs[i] {
            // SAFETY: kill(2) on our own child's process group.
            Some(c) => unsafe { libc::kill(-(c.id() as i32), sig) == 0 },
            None => false,
        }
    }

    pub fn kill9(&mut self, i: usize) -> bool {
        if self.paused[i] {
            self.signal(i, libc::SIGCONT);
        }
        let ok = self.signal(i, libc::SIGKILL);
        if let Some(mut c) = self.procs[i].take() {
            let _ = c.wait();
        }
        self.paused[i] = false;
        ok
    }

    pub fn pause(&mut self, i: usize) -> bool {
        let ok = self.signal(i, libc::SIGSTOP);
        self.paused[i] = ok;
        ok
    }

    pub fn resume(&mut self, i: usize) -> bool {
        self.paused[i] = false;
        self.signal(i, libc::SIGCONT)
    }

    /// Cut member `i` off from every other member (both directions).
    pub fn isolate(&self, i: usize) {
        for ((a, b), p) in &self.proxies {
            if *a == i || *b == i {
                p.set_blocked(true);
            }
        }
    }

    pub fn heal(&self) {
        for p in self.proxies.values() {
            p.set_blocked(false);
        }
    }

    pub async fn view(&self, i: usize) -> Option<Value> {
        let r = self
            .http
            .get(format!("{}/api/v1/cluster", self.url(i)))
            .bearer_auth(ADMIN)
            .timeout(Duration::from_millis(800))
            .send()
            .await
            .ok()?;
        r.json().await.ok()
    }

    /// The leader named by the member with the highest term among those that answer.
    pub async fn leader(&mut self) -> Option<usize> {
        let mut best: Option<(u64, usize)> = None;
        for i in 0..self.n {
            if !self.running(i) || self.paused[i] {
                continue;
            }
            if let Some(v) = self.view(i).await
                && let (Some(term), Some(l)) = (v["term"].as_u64(), v["leader_id"].as_u64())
                && best.is_none_or(|(t, _)| term > t)
            {
                best = Some((term, l as usize - 1));
            }
        }
        best.map(|(_, l)| l).filter(|l| *l < self.n)
    }

    pub async fn wait_leader(&mut self, timeout: Duration) -> Option<usize> {
        let deadline = tokio::time::Instant::now() + timeout;
        while tokio::time::Instant::now() < deadline {
            if let Some(l) = self.leader().await
                && self.running(l)
                && !self.paused[l]
            {
                return Some(l);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    }

    /// (digest, applied index) of member `i`, read locally.
    pub async fn digest(&self, i: usize) -> Option<(String, u64)> {
        let r = self
            .http
            .get(format!("{}/api/v1/cluster/state-digest", self.url(i)))
            .bearer_auth(ADMIN)
            .send()
            .await
            .ok()?;
        let v: Value = r.json().await.ok()?;
        Some((
            v["digest"].as_str()?.to_string(),
            v["applied_index"].as_u64()?,
        ))
    }

    /// An admin GET on the leader (through any member), retried until `timeout`.
    pub async fn admin_get(&self, path: &str, timeout: Duration) -> Option<Value> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            for i in 0..self.n {
                if let Ok(r) = self
                    .http
                    .get(format!("{}{path}", self.url(i)))
                    .bearer_auth(ADMIN)
                    .timeout(Duration::from_secs(5))
                    .send()
                    .await
                    && r.status() == 200
                    && let Ok(v) = r.json::<Value>().await
                {
                    return Some(v);
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub fn stop_all(&mut self) {
        for i in 0..self.n {
            self.kill9(i);
        }
    }
}

impl Drop for ChaosCluster {
    fn drop(&mut self) {
        self.stop_all();
    }
}
