//! Processes the benchmark starts: a 3-member ModelForge cluster and a 3-member etcd, all on
//! loopback, all killed when the benchmark ends (also on a panic, through `Drop`).

use std::path::Path;
use std::path::PathBuf;
use std::process::Child;
use std::process::Command;
use std::process::Stdio;
use std::time::Duration;
use std::time::Instant;

use modelforge_devkit as devkit;
use modelforge_devkit::Proc;
use modelforge_proto::api::ClusterView;
use serde_json::Value;

pub const ADMIN: &str = "bench-admin-token-0123456789abcdef";
pub const CLUSTER_SECRET: &str = "bench-cluster-secret-0123456789abcdef";

pub use modelforge_devkit::free_port;

/// Resident set size of a process, in MiB.
pub fn rss_mib(pid: u32) -> f64 {
    status_mib(pid, "VmRSS:")
}

/// The CPU seconds each of `pids` used since `before` (read with [`cpu_secs`], same order).
pub fn cpu_since(pids: &[u32], before: &[f64]) -> Vec<f64> {
    pids.iter()
        .zip(before)
        .map(|(&pid, before)| cpu_secs(pid) - before)
        .collect()
}

/// The CPU time the process has used (user and system, all threads), in seconds; 0 when it
/// cannot be read.
pub fn cpu_secs(pid: u32) -> f64 {
    // SAFETY: sysconf reads a constant of the system and has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            // Fields after the command (which may hold spaces) end with ')': state is the
            // first, utime the 12th and stime the 13th (proc(5)'s fields 14 and 15).
            let rest = &s[s.rfind(')')? + 1..];
            let f: Vec<&str> = rest.split_whitespace().collect();
            Some(f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?)
        })
        .map_or(0.0, |t| t / ticks)
}

/// The process's peak RSS since it started (`VmHWM`), in MiB.
pub fn peak_rss_mib(pid: u32) -> f64 {
    status_mib(pid, "VmHWM:")
}

fn status_mib(pid: u32, field: &str) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map(|kib| kib / 1024.0)
        .unwrap_or(0.0)
}

struct Member {
    url: String,
    args: Vec<String>,
    log: PathBuf,
    proc: Option<Proc>,
}

pub struct Cluster {
    bin: PathBuf,
    members: Vec<Member>,
    /// The CPUs the members run on (`taskset -c`), when pinned.
    cpus: Option<String>,
}

impl Cluster {
    /// Start 3 members with `extra` serve flags; returns once one of them is leader. They
    /// speak TLS with the harness CA, or plain HTTP when `extra` holds `--insecure-http`.
    pub async fn start(bin: &Path, dir: &Path, name: &str, extra: &[String]) -> Self {
        Self::start_n(3, bin, dir, name, extra).await
    }

    /// [`Cluster::start`] with `n` members.
    pub async fn start_n(n: usize, bin: &Path, dir: &Path, name: &str, extra: &[String]) -> Self {
        Self::start_pinned(n, None, bin, dir, name, extra).await
    }

    /// [`Cluster::start_n`] with every member on `cpus` (a `taskset -c` list), so that a
    /// load generator pinned elsewhere does not take the members' CPU.
    pub async fn start_pinned(
        n: usize,
        cpus: Option<&str>,
        bin: &Path,
        dir: &Path,
        name: &str,
        extra: &[String],
    ) -> Self {
        devkit::ca(bin);
        let ports: Vec<u16> = (0..n).map(|_| free_port()).collect();
        let insecure = extra.iter().any(|a| a == "--insecure-http");
        let url = |port: u16| {
            if insecure {
                format!("http://127.0.0.1:{port}")
            } else {
                devkit::url(port)
            }
        };
        let peers: Vec<(u64, String)> = (1..)
            .zip(&ports)
            .map(|(id, port)| (id, url(*port)))
            .collect();
        let members = (0..n)
            .map(|i| {
                let data_dir = dir.join(format!("{name}-m{}", i + 1));
                Member {
                    url: url(ports[i]),
                    args: devkit::MemberSpec {
                        id: i as u64 + 1,
                        port: ports[i],
                        data_dir: &data_dir,
                        peers: &peers,
                        routes: &[],
                        extra,
                    }
                    .args(),
                    log: dir.join(format!("{name}-m{}.log", i + 1)),
                    proc: None,
                }
            })
            .collect();
        let mut c = Self {
            bin: bin.to_path_buf(),
            members,
            cpus: cpus.map(str::to_string),
        };
        for i in 0..n {
            c.spawn(i);
        }
        c.wait_leader(Duration::from_secs(60)).await;
        c
    }

    fn spawn(&mut self, i: usize) {
        let m = &mut self.members[i];
        let env = [
            ("MODELFORGE_ADMIN_TOKEN", ADMIN),
            ("MODELFORGE_CLUSTER_SECRET", CLUSTER_SECRET),
            ("MODELFORGE_LOG", "warn"),
        ];
        // taskset execs the member: the pid is the member's.
        let proc = match &self.cpus {
            None => Proc::spawn(&self.bin, &m.args, &env, &m.log, false),
            Some(cpus) => {
                let mut args = vec!["-c".to_string(), cpus.clone()];
                args.push(self.bin.display().to_string());
                args.extend(m.args.iter().cloned());
                Proc::spawn(Path::new("taskset"), &args, &env, &m.log, false)
            }
        }
        .unwrap_or_else(|e| panic!("start {}: {e}", self.bin.display()));
        m.proc = Some(proc);
    }

    pub fn urls(&self) -> Vec<String> {
        self.members.iter().map(|m| m.url.clone()).collect()
    }

    pub fn url(&self, i: usize) -> String {
        self.members[i].url.clone()
    }

    pub fn pid(&self, i: usize) -> Option<u32> {
        self.members[i].proc.as_ref().map(Proc::pid)
    }

    /// RSS of each running member, in MiB (0 for a stopped one).
    pub fn rss(&self) -> Vec<f64> {
        (0..self.members.len())
            .map(|i| self.pid(i).map(rss_mib).unwrap_or(0.0))
            .collect()
    }

    /// Each member's peak RSS since it started (`VmHWM`).
    pub fn peak_rss(&self) -> Vec<f64> {
        (0..self.members.len())
            .map(|i| self.pid(i).map(peak_rss_mib).unwrap_or(0.0))
            .collect()
    }

    /// The leader's index (0-based) as the running members report it (the newest term's).
    pub async fn leader(&self, http: &reqwest::Client) -> Option<usize> {
        let mut views = vec![];
        for i in 0..self.members.len() {
            if self.members[i].proc.is_some() {
                views.push(self.cluster_view(http, i).await);
            }
        }
        let l = devkit::newest_leader(&views)? as usize;
        (l >= 1 && self.members.get(l - 1)?.proc.is_some()).then_some(l - 1)
    }

    pub async fn cluster_view(&self, http: &reqwest::Client, i: usize) -> Option<ClusterView> {
        devkit::cluster_view(http, &self.members[i].url, ADMIN, Duration::from_secs(2)).await
    }

    pub async fn wait_leader(&self, timeout: Duration) -> usize {
        let http = devkit::http();
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
        if let Some(mut p) = self.members[i].proc.take() {
            p.kill9();
        }
    }

    /// Start a killed member again on its data dir and wait until it has caught up.
    pub async fn restart(&mut self, i: usize, http: &reqwest::Client) {
        self.spawn(i);
        let t = Instant::now();
        loop {
            if let (Some(l), Some(v)) = (self.leader(http).await, self.cluster_view(http, i).await)
                && let Some(lv) = self.cluster_view(http, l).await
                && v.applied_index >= lv.commit_index
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
    /// None when no etcd binary is installed or it did not become healthy. With `ca`, etcd
    /// speaks TLS as the members do: clients over HTTPS (server certificate only, as admin
    /// clients use the members), peers over mutual TLS (`--peer-client-cert-auth`), every
    /// certificate issued from the harness CA the load client trusts.
    pub async fn start(dir: &Path, ca: Option<&devkit::Ca>) -> Option<Self> {
        let bin = ["/usr/bin/etcd", "/usr/local/bin/etcd"]
            .into_iter()
            .find(|p| Path::new(p).exists())?;
        let scheme = if ca.is_some() { "https" } else { "http" };
        let client: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let peer: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let initial: Vec<String> = (0..3)
            .map(|i| format!("e{i}={scheme}://127.0.0.1:{}", peer[i]))
            .collect();
        let mut etcd = Etcd {
            urls: client
                .iter()
                .map(|p| format!("{scheme}://127.0.0.1:{p}"))
                .collect(),
            children: vec![],
        };
        let ca_key = match ca {
            Some(ca) => Some(std::fs::read_to_string(&ca.key).ok()?),
            None => None,
        };
        for (i, peer_port) in peer.iter().enumerate() {
            let log = std::fs::File::create(dir.join(format!("etcd{i}.log"))).ok()?;
            let data_dir = dir.join(format!("etcd{i}-{scheme}"));
            let mut cmd = Command::new(bin);
            cmd.args(["--name", &format!("e{i}")])
                .args(["--data-dir", &data_dir.display().to_string()])
                .args(["--listen-client-urls", &etcd.urls[i]])
                .args(["--advertise-client-urls", &etcd.urls[i]])
                .args([
                    "--listen-peer-urls",
                    &format!("{scheme}://127.0.0.1:{peer_port}"),
                ])
                .args([
                    "--initial-advertise-peer-urls",
                    &format!("{scheme}://127.0.0.1:{peer_port}"),
                ])
                .args(["--initial-cluster", &initial.join(",")])
                .args(["--initial-cluster-state", "new"])
                .args(["--initial-cluster-token", "modelforge-bench"]);
            if let (Some(ca), Some(ca_key)) = (ca, &ca_key) {
                let (cert, key) = modelforge::tls::issue_member(
                    &ca.pem,
                    ca_key,
                    1000 + i as u64,
                    &["127.0.0.1".into(), "localhost".into()],
                )
                .ok()?;
                let cert_file = dir.join(format!("etcd{i}.pem"));
                let key_file = dir.join(format!("etcd{i}.key"));
                std::fs::write(&cert_file, cert).ok()?;
                std::fs::write(&key_file, key).ok()?;
                let (cert_file, key_file, ca_file) = (
                    cert_file.display().to_string(),
                    key_file.display().to_string(),
                    ca.cert.display().to_string(),
                );
                cmd.args(["--cert-file", &cert_file])
                    .args(["--key-file", &key_file])
                    .args(["--peer-cert-file", &cert_file])
                    .args(["--peer-key-file", &key_file])
                    .args(["--peer-trusted-ca-file", &ca_file])
                    .arg("--peer-client-cert-auth");
            }
            let child = cmd.stdout(Stdio::null()).stderr(log).spawn().ok()?;
            etcd.children.push(child);
        }
        let http = devkit::http();
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(30) {
            let mut healthy = 0;
            for u in &etcd.urls {
                // etcd's own health document, not a ModelForge answer: read by key.
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
