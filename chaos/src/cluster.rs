//! A cluster of real `modelforge serve` processes whose peer links run through proxies, so
//! that the nemesis can kill, pause and cut members. Clients (agents, admins) reach members
//! directly, as they would across a partition that only cuts the members from each other.
//!
//! Members sit in slots: a slot has a port and its proxies for good, and a member id that
//! changes when the nemesis replaces its member (removed, then a fresh member with a new id
//! and an empty data dir joins in its place). Slot `i`'s ids are `i + 1`, then `i + 1 + n`,
//! `i + 1 + 2n`, ...: every member is started with a route through the right proxy for every
//! id any other slot will ever have, so partitions cut replaced members too.

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
    /// Each slot's current member id.
    ids: Vec<u64>,
    pub http: reqwest::Client,
}

/// How many members a slot may have over a run (its first and the replacements).
pub const GENERATIONS: u64 = 8;

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
            ids: (1..=n as u64).collect(),
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

    /// Slot `i`'s current member id.
    pub fn id(&self, i: usize) -> u64 {
        self.ids[i]
    }

    /// Start member `i` (in a process group of its own, so that a pause stops all of it),
    /// reaching every other member through its proxy. A slot's first member belongs to the
    /// initial `--peer` list; a replacement joins the running cluster (`--join`).
    pub fn start_member(&mut self, i: usize) -> Result<(), HarnessError> {
        let id = self.ids[i];
        let n = self.n as u64;
        let first = id == i as u64 + 1;
        let peers = if first {
            devkit::peers(&self.ports)
        } else {
            vec![]
        };
        let routes: Vec<(u64, String)> = (0..self.n)
            .filter(|j| *j != i)
            .flat_map(|j| {
                let via = devkit::url(self.proxies[&(i, j)].port);
                (0..GENERATIONS).map(move |g| (j as u64 + 1 + g * n, via.clone()))
            })
            .collect();
        let mut extra = self.extra.clone();
        if !first {
            let others: Vec<String> = (0..self.n)
                .filter(|j| *j != i)
                .map(|j| self.url(j))
                .collect();
            extra.extend(["--join".to_string(), others.join(",")]);
        }
        let data_dir = self.root.join(format!("m{id}"));
        let args = devkit::MemberSpec {
            id,
            port: self.ports[i],
            data_dir: &data_dir,
            peers: &peers,
            routes: &routes,
            extra: &extra,
        }
        .args();
        let log = self.root.join(format!("m{id}.log"));
        let proc = Proc::spawn(
            &self.bin,
            &args,
            &[
                ("MODELFORGE_ADMIN_TOKEN", ADMIN),
                ("MODELFORGE_CLUSTER_SECRET", CLUSTER_SECRET),
                // Paused members and a loaded machine delay the runtime without overload of
                // its own (see tests/common's MEMBER_ENV).
                ("MODELFORGE_SHED_QUEUE_DELAY", "250ms"),
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
        let id = devkit::newest_leader(&views)?;
        self.ids.iter().position(|i| *i == id)
    }

    /// Replace slot `i`'s member: remove it from the cluster (a leader hands leadership over
    /// first), stop it, and add a fresh member with the slot's next id and an empty data dir,
    /// as an operator replaces a lost member. Ok with what happened, Err if the harness could
    /// not get through the change (never a verdict on the system).
    pub async fn replace(&mut self, i: usize) -> Result<String, HarnessError> {
        let old = self.ids[i];
        let new = old + self.n as u64;
        if new > self.n as u64 * GENERATIONS {
            return Ok("skipped: the slot used its fresh ids".into());
        }
        let removed = self
            .admin_until_ok(
                "DELETE",
                &format!("/api/v1/admin/cluster/members/{old}"),
                None,
            )
            .await;
        if let Err(e) = removed {
            return Ok(format!("indeterminate: removing member {old}: {e}"));
        }
        self.kill9(i);
        self.ids[i] = new;
        self.start_member(i)?;
        let body = serde_json::json!({"id": new, "url": self.url(i)});
        match self
            .admin_until_ok("POST", "/api/v1/admin/cluster/members", Some(body))
            .await
        {
            Ok(()) => Ok("installed".into()),
            Err(e) => Err(HarnessError(format!(
                "adding member {new} in slot {}: {e}",
                i + 1
            ))),
        }
    }

    /// An admin write sent to members in turn until one answers 2xx (or, for an add whose
    /// first answer was lost, 409 `member_exists`), for at most 60 s.
    async fn admin_until_ok(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> Result<(), String> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        let mut last = String::new();
        while tokio::time::Instant::now() < deadline {
            for i in 0..self.n {
                if self.paused[i] {
                    continue;
                }
                let mut req = self
                    .http
                    .request(
                        method.parse().expect("method"),
                        format!("{}{path}", self.url(i)),
                    )
                    .bearer_auth(ADMIN)
                    .timeout(Duration::from_secs(30));
                if let Some(b) = &body {
                    req = req.json(b);
                }
                match req.send().await {
                    Ok(r) if r.status().is_success() => return Ok(()),
                    Ok(r) => {
                        let status = r.status();
                        let text = r.text().await.unwrap_or_default();
                        if status == 409 && text.contains("member_exists") {
                            return Ok(());
                        }
                        last = format!("{status} {text}");
                    }
                    Err(e) => last = e.to_string(),
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Err(last)
    }

    /// Each slot's member's own configuration: (id, voter) of every member, sorted; None when
    /// it did not answer.
    pub async fn configurations(&self) -> Vec<Option<Vec<(u64, bool)>>> {
        let mut out = vec![];
        for i in 0..self.n {
            let view =
                devkit::cluster_view(&self.http, &self.url(i), ADMIN, Duration::from_secs(5)).await;
            out.push(view.map(|v| {
                let mut m: Vec<(u64, bool)> = v.members.iter().map(|m| (m.id, m.voter)).collect();
                m.sort();
                m
            }));
        }
        out
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

    /// Every page of a list (`limit=1000`, following `next`), each read as by [`Self::admin_get`]:
    /// the items of `field` in one array.
    pub async fn admin_get_all<T: DeserializeOwned>(
        &self,
        path: &str,
        field: &str,
        timeout: Duration,
    ) -> Result<T, HarnessError> {
        let sep = if path.contains('?') { '&' } else { '?' };
        let mut items = vec![];
        let mut after: Option<String> = None;
        loop {
            let mut page = format!("{path}{sep}limit=1000");
            if let Some(a) = &after {
                page.push_str(&format!("&after={a}"));
            }
            let mut v: Value = self.admin_get(&page, timeout).await?;
            if let Some(Value::Array(a)) = v.get_mut(field).map(Value::take) {
                items.extend(a);
            }
            after = v.get("next").and_then(Value::as_str).map(str::to_string);
            if after.is_none() {
                v[field] = Value::Array(items);
                return serde_json::from_value(v.clone()).map_err(|e| {
                    HarnessError(format!(
                        "GET {path}: the answer is not a {} ({e}): {v}",
                        std::any::type_name::<T>()
                    ))
                });
            }
        }
    }

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
