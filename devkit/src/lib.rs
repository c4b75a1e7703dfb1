//! The one harness that starts real members: free ports, the `serve` command line, member
//! processes (kill -9, SIGSTOP/SIGCONT, exit), and the cluster as its members report it (the
//! typed `GET /api/v1/cluster` and state digest, leader lookup). The real-process tests
//! (`tests/common`), the chaos suite (`chaos/src/cluster.rs`) and the benchmark
//! (`bench/src/cluster.rs`) each keep only what is theirs (proxies, agents, etcd) on top.
//!
//! Every wait here is on a condition with a deadline; nothing sleeps a fixed time to be safe.

use std::path::Path;
use std::process::Child;
use std::process::Command;
use std::process::Stdio;
use std::time::Duration;

use modelforge_proto::api::ClusterView;
use modelforge_proto::api::StateDigest;

/// A free loopback port, never the same one twice in this process (the kernel can hand out a
/// just-released port again, and two members given one port made a member vote for itself
/// twice, which tripped an openraft assertion).
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("bind a loopback port");
        let mut given = GIVEN.lock().unwrap_or_else(|p| p.into_inner());
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// Install ring as the process's rustls provider (before any reqwest client is built).
pub fn install_tls_provider() {
    modelforge_client::tls::install_provider();
}

/// The loopback URL of a member's port (members speak TLS; see [`ca`]).
pub fn url(port: u16) -> String {
    format!("https://127.0.0.1:{port}")
}

/// The harness's cluster CA: one per process, made by the server's own
/// `modelforge cluster init-ca`, shared by every cluster the process starts. Members are
/// started with `--tls-ca`/`--tls-ca-key` ([`MemberSpec::args`]), and [`http`] trusts it.
pub struct Ca {
    pub dir: std::path::PathBuf,
    pub cert: std::path::PathBuf,
    pub key: std::path::PathBuf,
    pub pem: String,
}

static CA: std::sync::OnceLock<Ca> = std::sync::OnceLock::new();

/// The harness CA, made on first use with `server_bin cluster init-ca`.
pub fn ca(server_bin: &Path) -> &'static Ca {
    modelforge_client::tls::install_provider();
    CA.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!(
            "mf-harness-ca-{}-{}",
            std::process::id(),
            modelforge_proto::new_uuid()
        ));
        let out = Command::new(server_bin)
            .args(["cluster", "init-ca", "--out"])
            .arg(&dir)
            .output()
            .expect("run modelforge cluster init-ca");
        assert!(
            out.status.success(),
            "cluster init-ca failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let cert = dir.join("ca.pem");
        let pem = std::fs::read_to_string(&cert).expect("read the harness CA");
        Ca {
            key: dir.join("ca.key"),
            cert,
            dir,
            pem,
        }
    })
}

/// One member's `serve` command line: its id, listener, data dir, the full `--peer` list
/// (id, URL), `--peer-route` overrides, then `extra` flags.
pub struct MemberSpec<'a> {
    pub id: u64,
    pub port: u16,
    pub data_dir: &'a Path,
    pub peers: &'a [(u64, String)],
    pub routes: &'a [(u64, String)],
    pub extra: &'a [String],
}

impl MemberSpec<'_> {
    pub fn args(&self) -> Vec<String> {
        let mut args = vec![
            "serve".to_string(),
            "--node-id".into(),
            self.id.to_string(),
            "--listen".into(),
            format!("127.0.0.1:{}", self.port),
            "--data-dir".into(),
            self.data_dir.display().to_string(),
        ];
        for (id, url) in self.peers {
            args.extend(["--peer".to_string(), format!("{id}={url}")]);
        }
        for (id, url) in self.routes {
            args.extend(["--peer-route".to_string(), format!("{id}={url}")]);
        }
        if let Some(ca) = CA.get()
            && !self.extra.iter().any(|a| a == "--insecure-http")
        {
            args.extend([
                "--tls-ca".to_string(),
                ca.cert.display().to_string(),
                "--tls-ca-key".into(),
                ca.key.display().to_string(),
            ]);
        }
        args.extend(self.extra.iter().cloned());
        args
    }
}

/// The (id, URL) list of members 1..=n on `ports`.
pub fn peers(ports: &[u16]) -> Vec<(u64, String)> {
    ports
        .iter()
        .enumerate()
        .map(|(i, p)| (i as u64 + 1, url(*p)))
        .collect()
}

/// A child process whose stderr (and stdout) go to a log file, appended across restarts.
pub struct Proc {
    child: Child,
    own_group: bool,
}

impl Proc {
    /// Start `bin args` with `env`, logging to `log`. With `own_group`, the child leads a
    /// process group of its own (a terminal's Ctrl-C does not reach it; the harness stops it).
    pub fn spawn(
        bin: &Path,
        args: &[String],
        env: &[(&str, &str)],
        log: &Path,
        own_group: bool,
    ) -> std::io::Result<Self> {
        use std::os::unix::process::CommandExt;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)?;
        let mut cmd = Command::new(bin);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file);
        // Secrets reach a child only as the harness passes them, never inherited.
        cmd.env_remove("MODELFORGE_ENROLLMENT_TOKEN")
            .env_remove("MODELFORGE_ADMIN_TOKEN")
            .env_remove("MODELFORGE_CLUSTER_SECRET");
        for (k, v) in env {
            cmd.env(k, v);
        }
        if own_group {
            cmd.process_group(0);
        }
        Ok(Self {
            child: cmd.spawn()?,
            own_group,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether it still runs (reaping it if it exited).
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Send a signal (SIGSTOP, SIGCONT, SIGTERM...) to it, or to its group when it leads
    /// one. Whether it was delivered.
    pub fn signal(&self, sig: i32) -> bool {
        let pid = self.child.id() as i32;
        let target = if self.own_group { -pid } else { pid };
        // SAFETY: kill(2) on our own child (or its group); it is not reaped while we hold it.
        unsafe { libc::kill(target, sig) == 0 }
    }

    /// kill -9 (the whole group when it leads one, stopped or not) and reap.
    pub fn kill9(&mut self) {
        if self.own_group {
            self.signal(libc::SIGCONT);
            self.signal(libc::SIGKILL);
        } else {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }

    /// SIGTERM (a graceful stop), then reap.
    pub fn terminate(&mut self) {
        self.signal(libc::SIGTERM);
        let _ = self.child.wait();
    }

    /// Wait (up to `within`) for it to exit on its own: its exit code (-1 for a signal).
    pub async fn wait_exit(&mut self, within: Duration) -> Option<i32> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Some(st.code().unwrap_or(-1));
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// The harness CA's PEM, when [`ca`] made one (for clients built on rustls directly).
pub fn harness_ca_pem() -> Option<&'static str> {
    CA.get().map(|ca| ca.pem.as_str())
}

/// `b` trusting the harness CA, when [`ca`] made one (the benchmark's load clients).
pub fn with_harness_tls(b: reqwest::ClientBuilder) -> reqwest::ClientBuilder {
    match CA.get() {
        Some(ca) => b.tls_backend_preconfigured(
            modelforge_client::tls::client_config(&ca.pem, None).expect("the harness CA loads"),
        ),
        None => b,
    }
}

/// An HTTP client for harness calls: no proxy from the environment, short connects; it trusts
/// the harness CA (when [`ca`] made one) and nothing else.
pub fn http() -> reqwest::Client {
    modelforge_client::tls::install_provider();
    let b = reqwest::Client::builder()
        .no_proxy()
        .connect_timeout(Duration::from_millis(500))
        .pool_max_idle_per_host(64);
    with_harness_tls(b).build().expect("an HTTP client")
}

/// An admin GET of `path` on the member at `url`, decoded as `T`; None if it did not answer
/// 2xx within `within` or the body is not a `T`.
pub async fn admin_get<T: serde::de::DeserializeOwned>(
    http: &reqwest::Client,
    url: &str,
    path: &str,
    admin: &str,
    within: Duration,
) -> Option<T> {
    let resp = http
        .get(format!("{url}{path}"))
        .bearer_auth(admin)
        .timeout(within)
        .send()
        .await
        .ok()?;
    if !resp.status().is_success() {
        return None;
    }
    resp.json().await.ok()
}

/// `GET /api/v1/cluster` of the member at `url`, typed; None if it did not answer in time.
pub async fn cluster_view(
    http: &reqwest::Client,
    url: &str,
    admin: &str,
    within: Duration,
) -> Option<ClusterView> {
    admin_get(http, url, "/api/v1/cluster", admin, within).await
}

/// The member's state digest and applied index, read locally (never forwarded).
pub async fn state_digest(http: &reqwest::Client, url: &str, admin: &str) -> Option<StateDigest> {
    let path = "/api/v1/cluster/state-digest";
    admin_get(http, url, path, admin, Duration::from_secs(5)).await
}

/// The leader every answering member names, if they all answered and agree on one of them.
pub fn agreed_leader(views: &[Option<ClusterView>], members: &[u64]) -> Option<u64> {
    let mut agreed = None;
    for v in views {
        let l = v.as_ref()?.leader_id?;
        if !members.contains(&l) || agreed.is_some_and(|a| a != l) {
            return None;
        }
        agreed = Some(l);
    }
    agreed
}

/// The leader named by the answering member with the highest term (members that did not
/// answer are skipped: paused or partitioned ones lag behind).
pub fn newest_leader(views: &[Option<ClusterView>]) -> Option<u64> {
    views
        .iter()
        .flatten()
        .filter_map(|v| Some((v.term, v.leader_id?)))
        .max_by_key(|(term, _)| *term)
        .map(|(_, l)| l)
}

/// The inventory of a node with `gpus` H200s, as a real agent reports it: the fleet of the
/// scale examples and benchmarks.
pub fn h200_inventory(gpus: u32) -> modelforge_proto::wire::Inventory {
    use modelforge_proto::wire;
    wire::Inventory {
        accelerators: (0..gpus)
            .map(|i| wire::Accelerator {
                uuid: format!("GPU-{i:08x}-0000-4000-8000-000000000000"),
                name: "NVIDIA H200".into(),
                memory_total_mib: Some(143_771),
                pci_bus_id: Some(format!("00000000:{:02X}:00.0", 0x18 + i)),
                index: Some(i),
                mig_mode: Some("disabled".into()),
                power_limit_w: Some(700),
                compute_capability: Some("9.0".into()),
            })
            .collect(),
        storage_roots: vec![wire::StorageRoot {
            path: "/data".into(),
            capacity_bytes: 1 << 40,
            free_bytes: 1 << 39,
        }],
        driver_version: Some("550.54.15".into()),
        cuda_version: Some("12.4".into()),
        nvml: Some("ok".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(term: u64, leader: Option<u64>) -> Option<ClusterView> {
        Some(ClusterView {
            id: 1,
            leader_id: leader,
            leader_url: None,
            term,
            state: "Follower".into(),
            commit_index: 0,
            applied_index: 0,
            last_log_index: 0,
            snapshot_index: None,
            members: vec![],
            cluster_id: String::new(),
            secret_checks: Default::default(),
            credential_pool: Default::default(),
            admission: Default::default(),
            observed: Default::default(),
            disk: Default::default(),
            audit_archive: Default::default(),
        })
    }

    #[test]
    fn leader_lookup_needs_agreement_or_takes_the_newest_term() {
        let members = [1, 2, 3];
        assert_eq!(
            agreed_leader(&[view(2, Some(2)), view(2, Some(2))], &members),
            Some(2)
        );
        assert_eq!(
            agreed_leader(&[view(2, Some(2)), view(3, Some(3))], &members),
            None
        );
        assert_eq!(agreed_leader(&[view(2, Some(2)), None], &members), None);
        assert_eq!(agreed_leader(&[view(2, Some(9))], &members), None);
        assert_eq!(
            newest_leader(&[view(2, Some(2)), view(3, Some(3)), None]),
            Some(3)
        );
        assert_eq!(newest_leader(&[None, view(1, None)]), None);
    }

    #[test]
    fn ports_are_never_handed_out_twice_and_args_name_every_peer() {
        let ports: Vec<u16> = (0..50).map(|_| free_port()).collect();
        let mut unique = ports.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), ports.len());
        let peers = peers(&ports[..3]);
        let dir = std::path::PathBuf::from("/tmp/x");
        let args = MemberSpec {
            id: 2,
            port: ports[1],
            data_dir: &dir,
            peers: &peers,
            routes: &[(1, "http://127.0.0.1:1".into())],
            extra: &["--x".into()],
        }
        .args();
        assert_eq!(args.iter().filter(|a| *a == "--peer").count(), 3);
        assert!(
            args.windows(2)
                .any(|w| w[0] == "--peer-route" && w[1] == "1=http://127.0.0.1:1")
        );
        assert_eq!(args.last().unwrap(), "--x");
    }
}
