//! Command-line flags of `modelforge`, validated once into [`ServeConfig`].

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use anyhow::bail;
use clap::Parser;
use clap::Subcommand;

use crate::liveness::StatusThresholds;
use crate::secrets::HashParams;
use crate::server::ServeConfig;

#[derive(Parser, Debug)]
#[command(name = "modelforge", version, about = "ModelForge control plane")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Cmd,
}

#[derive(Subcommand, Debug)]
pub enum Cmd {
    /// Run one cluster member (with no flags: a single-member cluster on 127.0.0.1:7070).
    Serve(Box<ServeArgs>),
    /// Print how long one argon2id hash takes at the given parameters, and the bound it sets.
    Argon2Bench(HashArgs),
    /// Operate a cluster over its HTTP API: enrolments, nodes, decommission, audit, doctor.
    Admin(Box<crate::admin_cli::AdminArgs>),
}

#[derive(clap::Args, Debug, Clone)]
pub struct HashArgs {
    /// argon2id memory cost in KiB.
    #[arg(long, env = "MODELFORGE_ARGON2_M_KIB", default_value_t = argon2::Params::DEFAULT_M_COST)]
    pub argon2_m_kib: u32,
    /// argon2id iterations.
    #[arg(long, env = "MODELFORGE_ARGON2_T", default_value_t = argon2::Params::DEFAULT_T_COST)]
    pub argon2_t: u32,
    /// argon2id lanes.
    #[arg(long, env = "MODELFORGE_ARGON2_P", default_value_t = argon2::Params::DEFAULT_P_COST)]
    pub argon2_p: u32,
}

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// This member's Raft id (stable for the life of its data dir).
    #[arg(long, env = "MODELFORGE_NODE_ID", default_value_t = 1)]
    pub node_id: u64,
    /// Address to listen on.
    #[arg(long, env = "MODELFORGE_LISTEN", default_value = "127.0.0.1:7070")]
    pub listen: SocketAddr,
    /// How peers and agents reach this member (default http://<listen>).
    #[arg(long, env = "MODELFORGE_ADVERTISE")]
    pub advertise: Option<String>,
    /// Where the Raft log, snapshots and generated secrets live.
    #[arg(long, env = "MODELFORGE_DATA_DIR", default_value = "./modelforge-data")]
    pub data_dir: PathBuf,
    /// `<id>=<url>`, repeatable: the full initial membership, this member included.
    #[arg(long = "peer", value_name = "ID=URL")]
    pub peers: Vec<String>,
    /// `<id>=<url>`, repeatable: reach member <id> at this URL instead of its advertised one
    /// (a route through a NAT or proxy; the chaos suite routes peer links through its proxies).
    #[arg(long = "peer-route", value_name = "ID=URL")]
    pub peer_routes: Vec<String>,
    /// File with the admin token (default <data-dir>/admin.token, generated if missing).
    #[arg(long)]
    pub admin_token_file: Option<PathBuf>,
    /// File with the cluster secret for peer traffic (default: the admin token).
    #[arg(long)]
    pub cluster_secret_file: Option<PathBuf>,
    #[command(flatten)]
    pub hash: HashArgs,
    /// Concurrent argon2 computations (default: the number of cores).
    #[arg(long, env = "MODELFORGE_HASH_WORKERS")]
    pub hash_workers: Option<usize>,
    /// Raft heartbeat interval.
    #[arg(long, default_value = "50ms", value_parser = humantime::parse_duration)]
    pub raft_heartbeat: Duration,
    /// Raft election timeout, lower bound (the upper bound is twice this).
    /// The leader lease is the upper bound: a dead leader is replaced after about 2-3 times this.
    #[arg(long, default_value = "250ms", value_parser = humantime::parse_duration)]
    pub raft_election_timeout: Duration,
    /// Take a snapshot every this many log entries.
    #[arg(long, default_value_t = 5000)]
    pub snapshot_every: u64,
    /// Log entries kept behind a snapshot, for lagging followers (openraft issue #1706: keep
    /// this well above what a follower can fall behind during a snapshot install).
    #[arg(long, default_value_t = 5000)]
    pub snapshot_keep_logs: u64,
    /// A node is `stale` after this long without a heartbeat.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub stale_after: Duration,
    /// A node is `offline` after this long without a heartbeat.
    #[arg(long, default_value = "90s", value_parser = humantime::parse_duration)]
    pub offline_after: Duration,
    /// Largest accepted API request body, in bytes.
    #[arg(long, default_value_t = 256 * 1024)]
    pub max_body_bytes: usize,
    /// Default lifetime of an enrolment token, in seconds.
    #[arg(long, default_value_t = 3600)]
    pub default_token_ttl: u64,
    /// Longest allowed lifetime of an enrolment token, in seconds.
    #[arg(long, default_value_t = 30 * 24 * 3600)]
    pub max_token_ttl: u64,
    /// How often coalesced `last_used_at` updates are written.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub touch_interval: Duration,
    /// Shards of the node supervision tree (each an actor owning many nodes).
    #[arg(long, default_value_t = 16)]
    pub node_shards: usize,
    /// How often status transitions and refused requests are written to node histories.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    pub events_interval: Duration,
}

impl ServeArgs {
    pub fn into_config(self) -> anyhow::Result<ServeConfig> {
        let advertise = self
            .advertise
            .clone()
            .unwrap_or_else(|| format!("http://{}", self.listen));
        let mut peers = BTreeMap::new();
        for p in &self.peers {
            let (id, url) = p
                .split_once('=')
                .with_context(|| format!("--peer {p:?}: expected <id>=<url>"))?;
            let id: u64 = id
                .parse()
                .with_context(|| format!("--peer {p:?}: the id must be a number"))?;
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                bail!("--peer {p:?}: the url must start with http:// or https://");
            }
            if peers
                .insert(id, url.trim_end_matches('/').to_string())
                .is_some()
            {
                bail!("--peer: id {id} given twice");
            }
        }
        let mut peer_routes = BTreeMap::new();
        for p in &self.peer_routes {
            let (id, url) = p
                .split_once('=')
                .with_context(|| format!("--peer-route {p:?}: expected <id>=<url>"))?;
            let id: u64 = id
                .parse()
                .with_context(|| format!("--peer-route {p:?}: the id must be a number"))?;
            peer_routes.insert(id, url.trim_end_matches('/').to_string());
        }
        if peers.is_empty() {
            peers.insert(self.node_id, advertise.clone());
        }
        if !peers.contains_key(&self.node_id) {
            bail!(
                "--peer must list this member too (--node-id {})",
                self.node_id
            );
        }
        if self.offline_after <= self.stale_after {
            bail!("--offline-after must be longer than --stale-after");
        }
        std::fs::create_dir_all(&self.data_dir)
            .with_context(|| format!("create {}", self.data_dir.display()))?;
        let admin_token = admin_token(&self.data_dir, self.admin_token_file.as_deref())?;
        let cluster_secret = match std::env::var("MODELFORGE_CLUSTER_SECRET") {
            Ok(s) if !s.trim().is_empty() => s.trim().to_string(),
            _ => match &self.cluster_secret_file {
                Some(p) => read_secret_file(p)?,
                None => admin_token.clone(),
            },
        };
        let election = self.raft_election_timeout.as_millis() as u64;
        Ok(ServeConfig {
            node_id: self.node_id,
            listen: self.listen,
            advertise,
            data_dir: self.data_dir,
            peers,
            peer_routes,
            admin_token,
            cluster_secret,
            hash_params: HashParams {
                m_kib: self.hash.argon2_m_kib,
                t: self.hash.argon2_t,
                p: self.hash.argon2_p,
            },
            hash_workers: self.hash_workers.unwrap_or_else(|| {
                std::thread::available_parallelism()
                    .map(|n| n.get())
                    .unwrap_or(2)
            }),
            tuning: modelforge_raft::RaftTuning {
                heartbeat_interval_ms: self.raft_heartbeat.as_millis() as u64,
                election_timeout_min_ms: election,
                election_timeout_max_ms: election * 2,
                snapshot_every_logs: self.snapshot_every,
                logs_kept_after_snapshot: self.snapshot_keep_logs,
            },
            thresholds: StatusThresholds {
                stale_after_ms: self.stale_after.as_millis() as i64,
                offline_after_ms: self.offline_after.as_millis() as i64,
            },
            max_body_bytes: self.max_body_bytes,
            default_token_ttl_s: self.default_token_ttl,
            max_token_ttl_s: self.max_token_ttl,
            touch_interval: self.touch_interval,
            node_shards: self.node_shards.clamp(1, 1024),
            events_interval: self.events_interval,
        })
    }
}

fn read_secret_file(path: &Path) -> anyhow::Result<String> {
    let s = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    let s = s.trim().to_string();
    if s.len() < 16 {
        bail!(
            "{}: a secret must be at least 16 characters",
            path.display()
        );
    }
    Ok(s)
}

/// `MODELFORGE_ADMIN_TOKEN`, else the token file, else a new random token written there (0600).
fn admin_token(data_dir: &Path, file: Option<&Path>) -> anyhow::Result<String> {
    if let Ok(t) = std::env::var("MODELFORGE_ADMIN_TOKEN")
        && !t.trim().is_empty()
    {
        return Ok(t.trim().to_string());
    }
    let path = file
        .map(Path::to_path_buf)
        .unwrap_or_else(|| data_dir.join("admin.token"));
    if path.exists() {
        return read_secret_file(&path);
    }
    let token = format!(
        "mfadm_{}",
        modelforge_proto::hex(&modelforge_proto::random_bytes::<32>())
    );
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("create {}", path.display()))?;
    use std::io::Write;
    f.write_all(format!("{token}\n").as_bytes())?;
    f.sync_all()?;
    tracing::info!(path = %path.display(), "generated an admin token");
    Ok(token)
}

/// `modelforge argon2-bench`: the figure the enrolment target is measured against.
pub fn argon2_bench(args: &HashArgs) -> anyhow::Result<()> {
    let h = crate::secrets::Hasher::new(
        &HashParams {
            m_kib: args.argon2_m_kib,
            t: args.argon2_t,
            p: args.argon2_p,
        },
        1,
        1,
    )?;
    let _ = h.time_one_hash();
    let n = 10;
    let total: Duration = (0..n).map(|_| h.time_one_hash()).sum();
    let one = total / n;
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    println!(
        "argon2id m={} KiB t={} p={}: one hash {:.1} ms; bound {:.1} hashes/s on {cores} cores",
        args.argon2_m_kib,
        args.argon2_t,
        args.argon2_p,
        one.as_secs_f64() * 1000.0,
        cores as f64 / one.as_secs_f64()
    );
    Ok(())
}
