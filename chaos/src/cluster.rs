//! A cluster of real `modelforge serve` processes whose peer links run through proxies, so
//! that the nemesis can kill, pause and cut members. Clients (agents, admins) reach members
//! directly, as they would across a partition that only cuts the members from each other.

use std::collections::BTreeMap;
use std::path::Path;
use std::path::PathBuf;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde_json::Value;

use modelforge_devkit as devkit;
use modelforge_devkit::Proc;

use crate::proxy::Proxy;

pub const ADMIN: &str = "chaos-admin-token-0123456789abcdef";
/// The members' cluster secret (never the admin token); backups are authenticated with it.
pub const CLUSTER_SECRET: &str = "chaos-cluster-secret-0123456789abcdef";

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
    procs: Vec<Option<Proc>>,
    paused: Vec<bool>,
    extra: Vec<String>,
    pub http: reqwest::Client,
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
        devkit::ca(bin);
        let ports: Vec<u16> = (0..n).map(|_| devkit::free_port()).collect();
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
        let mut c = Self {
            root: root.to_path_buf(),
            bin: bin.to_path_buf(),
            n,
            ports,
            proxies,
            procs: (0..n).map(|_| None).collect(),
            paused: vec![false; n],
            extra: extra.to_vec(),
            http: devkit::http(),
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
        devkit::url(self.ports[i])
    }

    pub fn urls(&self) -> Vec<String> {
        (0..self.n).map(|i| self.url(i)).collect()
    }

    /// Start member `i` (in a process group of its own, so that a pause stops all of it),
    /// reaching every other member through its proxy.
    pub fn start_member(&mut self, i: usize) -> Result<(), HarnessError> {
        let peers = devkit::peers(&self.ports);
        let routes: Vec<(u64, String)> = (0..self.n)
            .filter(|j| *j != i)
            .map(|j| (j as u64 + 1, devkit::url(self.proxies[&(i, j)].port)))
            .collect();
        let data_dir = self.root.join(format!("m{}", i + 1));
        let args = devkit::MemberSpec {
            id: i as u64 + 1,
            port: self.ports[i],
            data_dir: &data_dir,
            peers: &peers,
            routes: &routes,
            extra: &self.extra,
        }
        .args();
        let log = self.root.join(format!("m{}.log", i + 1));
        let proc = Proc::spawn(
            &self.bin,
            &args,
            &[
                ("MODELFORGE_ADMIN_TOKEN", ADMIN),
                ("MODELFORGE_CLUSTER_SECRET", CLUSTER_SECRET),
            ],
            &log,
            true,
        )
        .map_err(|e| HarnessError(format!("start member {}: {e}", i + 1)))?;
        self.procs[i] = Some(proc);
        self.paused[i] = false;
        Ok(())
    }

    pub fn running(&mut self, i: usize) -> bool {
        self.procs[i].as_mut().is_some_and(Proc::alive)
    }

    pub fn is_paused(&self, i: usize) -> bool {
        self.paused[i]
    }

    fn signal(&self, i: usize, sig: i32) -> bool {
        self.procs[i].as_ref().is_some_and(|p| p.signal(sig))
    }

    pub fn kill9(&mut self, i: usize) -> bool {
        let killed = self.procs[i].take().map(|mut p| p.kill9()).is_some();
        self.paused[i] = false;
        killed
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

    /// The leader named by the member with the highest term among those that answer.
    pub async fn leader(&mut self) -> Option<usize> {
        let mut views = vec![];
        for i in 0..self.n {
            if self.running(i) && !self.paused[i] {
                let url = self.url(i);
                views.push(
                    devkit::cluster_view(&self.http, &url, ADMIN, Duration::from_millis(800)).await,
                );
            }
        }
        devkit::newest_leader(&views)
            .map(|l| l as usize - 1)
            .filter(|l| *l < self.n)
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
        let d = devkit::state_digest(&self.http, &self.url(i), ADMIN).await?;
        Some((d.digest, d.applied_index))
    }

    /// An admin GET on the leader (through any member), retried until `timeout`.
    /// An admin read answered 200 by any member within `timeout`, as the endpoint's type (from
    /// `modelforge_proto::api`). An answer that does not decode is harness trouble, with the
    /// body: a drifted field is never read as missing.
    pub async fn admin_get<T: DeserializeOwned>(
        &self,
        path: &str,
        timeout: Duration,
    ) -> Result<T, HarnessError> {
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
                    return serde_json::from_value(v.clone()).map_err(|e| {
                        HarnessError(format!(
                            "GET {path}: the answer is not a {} ({e}): {v}",
                            std::any::type_name::<T>()
                        ))
                    });
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(HarnessError(format!(
                    "could not read {path} within {timeout:?}"
                )));
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
