//! Processes the benchmark starts: a 3-member ModelForge cluster and a 3-member etcd, all on
//! loopback, all killed when the benchmark ends (also on a panic, through `Drop`).

use std::path::Path;
use std::path::PathBuf;
use std::process::Child;
use std::process::Command;
use std::process::Stdio;
use std::time::Duration;
use std::time::Instant;

use serde_json::Value;

pub const ADMIN: &str = "bench-admin-token-0123456789abcdef";

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind a loopback port")
        .local_addr()
        .expect("local address")
        .port()
}

/// Resident set size of a process, in MiB.
pub fn rss_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map(|kib| kib / 1024.0)
        .unwrap_or(0.0)
}

struct Member {
    url: String,
    command: Vec<String>,
    log: PathBuf,
    child: Option<Child>,
}

pub struct Cluster {
    bin: PathBuf,
    members: Vec<Member>,
}

impl Cluster {
    /// Start 3 members with `extra` serve flags; returns once one of them is leader.
    pub async fn start(bin: &Path, dir: &Path, name: &str, extra: &[String]) -> Self {
        let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let peers: Vec<String> = ports
            .iter()
            .enumerate()
            .map(|(i, p)| format!("{}=http://127.0.0.1:{p}", i + 1))
            .collect();
        let members = (0..3)
            .map(|i| {
                let mut command = vec![
                    "serve".to_string(),
                    "--node-id".into(),
                    (i + 1).to_string(),
                    "--listen".into(),
                    format!("127.0.0.1:{}", ports[i]),
                    "--data-dir".into(),
                    dir.join(format!("{name}-m{}", i + 1)).display().to_string(),
                ];
                for p in &peers {
                    command.extend(["--peer".to_string(), p.clone()]);
                }
                command.extend(extra.iter().cloned());
                Member {
                    url: format!("http://127.0.0.1:{}", ports[i]),
                    command,
                    log: dir.join(format!("{name}-m{}.log", i + 1)),
                    child: None,
                }
            })
            .collect();
        let mut c = Self {
            bin: bin.to_path_buf(),
            members,
        };
        for i in 0..3 {
            c.spawn(i);
        }
        c.wait_leader(Duration::from_secs(60)).await;
        c
    }

    fn spawn(&mut self, i: usize) {
        let m = &mut self.members[i];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&m.log)
            .expect("member log file");
        let child = Command::new(&self.bin)
            .args(&m.command)
            .env("MODELFORGE_ADMIN_TOKEN", ADMIN)
            .env("MODELFORGE_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", self.bin.display()));
        m.child = Some(child);
    }

    pub fn urls(&self) -> Vec<String> {
        self.members.iter().map(|m| m.url.clone()).collect()
    }

    pub fn url(&self, i: usize) -> String {
        self.members[i].url.clone()
    }

    pub fn pid(&self, i: usize) -> Option<u32> {
        self.members[i].child.as_ref().map(|c| c.id())
    }

    /// RSS of each running member, in MiB (0 for a stopped one).
    pub fn rss(&self) -> Vec<f64> {
        (0..3)
            .map(|i| self.pid(i).map(rss_mib).unwrap_or(0.0))
            .collect()
    }

    /// The leader's index (0-based) as the running members report it.
    pub async fn leader(&self, http: &reqwest::Client) -> Option<usize> {
        for (i, m) in self.members.iter().enumerate() {
            if m.child.is_none() {
                continue;
            }
            let Some(v) = self.cluster_view(http, i).await else {
                continue;
            };
            if let Some(l) = v["leader_id"].as_u64()
                && l >= 1
                && self.members[l as usize - 1].child.is_some()
            {
                return Some(l as usize - 1);
            }
        }
        None
    }

    pub async fn cluster_view(&self, http: &reqwest::Client, i: usize) -> Option<Value> {
        http.get(format!("{}/api/v1/cluster", self.members[i].url))
            .bearer_auth(ADMIN)
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .ok()?
            .json()
            .await
            .ok()
    }

    pub async fn wait_leader(&self, timeout: Duration) -> usize {
        let http = reqwest::Client::builder()
            .no_proxy()
            .build()
            .expect("client");
        let t = Instant::now();
        loop {
            if let Some(l) = self.leader(&http).await {
                return l;
            }
            assert!(t.elapsed() < timeout, "no leader within {timeout:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// kill -9 one member.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Start a killed member again on its data dir and wait until it has caught up.
    pub async fn restart(&mut self, i: usize, http: &reqwest::Client) {
        self.spawn(i);
        let t = Instant::now();
        loop {
            if let (Some(l), Some(v)) = (self.leader(http).await, self.cluster_view(http, i).await)
                && let Some(lv) = self.cluster_view(http, l).await
                && v["applied_index"].as_u64() >= lv["commit_index"].as_u64()
            {
                return;
            }
            assert!(
                t.elapsed() < Duration::from_secs(120),
                "member {} did not catch up",
                i + 1
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }
}

/// A 3-member etcd 3.4 (Debian's `etcd-server`) on loopback with its default durability.
pub struct Etcd {
    pub urls: Vec<String>,
    children: Vec<Child>,
}

impl Etcd {
    /// None when no etcd binary is installed or it did not become healthy.
    pub async fn start(dir: &Path) -> Option<Self> {
        let bin = ["/usr/bin/etcd", "/usr/local/bin/etcd"]
            .into_iter()
            .find(|p| Path::new(p).exists())?;
        let client: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let peer: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let initial: Vec<String> = (0..3)
            .map(|i| format!("e{i}=http://127.0.0.1:{}", peer[i]))
            .collect();
        let mut etcd = Etcd {
            urls: client
                .iter()
                .map(|p| format!("http://127.0.0.1:{p}"))
                .collect(),
            children: vec![],
        };
        for (i, peer_port) in peer.iter().enumerate() {
            let log = std::fs::File::create(dir.join(format!("etcd{i}.log"))).ok()?;
            let child = Command::new(bin)
                .args(["--name", &format!("e{i}")])
                .args([
                    "--data-dir",
                    &dir.join(format!("etcd{i}")).display().to_string(),
                ])
                .args(["--listen-client-urls", &etcd.urls[i]])
                .args(["--advertise-client-urls", &etcd.urls[i]])
                .args([
                    "--listen-peer-urls",
                    &format!("http://127.0.0.1:{peer_port}"),
                ])
                .args([
                    "--initial-advertise-peer-urls",
                    &format!("http://127.0.0.1:{peer_port}"),
                ])
                .args(["--initial-cluster", &initial.join(",")])
                .args(["--initial-cluster-state", "new"])
                .args(["--initial-cluster-token", "modelforge-bench"])
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .ok()?;
            etcd.children.push(child);
        }
        let http = reqwest::Client::builder().no_proxy().build().ok()?;
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(30) {
            let mut healthy = 0;
            for u in &etcd.urls {
                if let Ok(r) = http.get(format!("{u}/health")).send().await
                    && r.json::<Value>().await.is_ok_and(|v| v["health"] == "true")
                {
                    healthy += 1;
                }
            }
            if healthy == 3 {
                return Some(etcd);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        None
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Standard base64 (the etcd gateway takes keys and values in it).
pub fn b64(bytes: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = ((b[0] as u32) << 16) | ((b[1] as u32) << 8) | b[2] as u32;
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(T[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}
