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
use crate::tls::TlsSource;

#[derive(Parser, Debug)]
#[command(name = "modelforge", version, about = "ModelForge control plane")]
pub struct Cli {
    /// Log lines on stderr as `text` (for people) or `json` (one object a line, for
    /// journald and log shippers); the level comes from `MODELFORGE_LOG` (default `info`).
    #[arg(long, global = true, env = "MODELFORGE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Cmd,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

/// Send log lines to stderr in `format`, at the level `MODELFORGE_LOG` names.
pub fn init_logs(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("MODELFORGE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,openraft=warn"));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => logs
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
        // Each line carries its innermost span (`span`) and the whole chain (`spans`: request,
        // then relay, propose, argon2_verify or argon2_hash, apply where the line comes from
        // inside them), with their fields (the request id among them).
        LogFormat::Json => logs
            .json()
            .with_current_span(true)
            .with_span_list(true)
            .init(),
    }
}

#[derive(Subcommand, Debug)]
pub enum Cmd {
    /// Run one cluster member (with no flags: a single-member cluster on 127.0.0.1:7070).
    Serve(Box<ServeArgs>),
    /// Print how long one argon2id hash takes at the given parameters, and the bound it sets.
    Argon2Bench(HashArgs),
    /// Prepare a fresh member's data dir from a backup (`GET /api/v1/admin/backup`), re-applying
    /// the revocation journals of the old members. Members started on dirs prepared from the
    /// same backup and journals form the restored cluster; old members cannot join it.
    Restore(RestoreArgs),
    /// Operate a cluster over its HTTP API: enrolments, nodes, decommission, audit, doctor.
    Admin(Box<crate::admin_cli::AdminArgs>),
    /// Cluster setup that needs no running member.
    #[command(subcommand)]
    Cluster(ClusterCmd),
    /// Member settings files (`--config`).
    #[command(subcommand)]
    Config(ConfigCmd),
    /// Print a shell completion script: `modelforge completion bash > /etc/bash_completion.d/modelforge`.
    Completion {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

#[derive(Subcommand, Debug)]
pub enum ConfigCmd {
    /// Check a settings file (and any flags and environment variables given with it) without
    /// starting: print each setting's value and where it came from (flag, environment, file,
    /// default); exit 2 naming the key of an unknown setting or a value of the wrong type.
    Validate(Box<ServeArgs>),
}

#[derive(Subcommand, Debug)]
pub enum ClusterCmd {
    /// Write a new cluster CA (`ca.pem`, and `ca.key` with mode 0600) into `--out`. Members
    /// started with `--tls-ca <dir>/ca.pem --tls-ca-key <dir>/ca.key` each issue their own
    /// certificate from it; agents and the admin CLI trust `ca.pem`.
    InitCa {
        #[arg(long)]
        out: PathBuf,
    },
}

#[derive(clap::Args, Debug)]
pub struct RestoreArgs {
    /// The backup file.
    #[arg(long)]
    pub from: PathBuf,
    /// The data dir to prepare (must not hold a member's state).
    #[arg(long)]
    pub data_dir: PathBuf,
    /// A revocation journal: a journal file or an old member's data dir (repeatable). Give
    /// every one that survived; without any, restore warns what it cannot re-apply.
    #[arg(long = "journal", value_name = "FILE_OR_DATA_DIR")]
    pub journals: Vec<PathBuf>,
    /// The member id this dir is for (only echoed in the `serve` command printed at the end).
    #[arg(long)]
    pub node_id: Option<u64>,
    /// The restored cluster's membership (only echoed in the `serve` command printed).
    #[arg(long = "peer", value_name = "ID=URL")]
    pub peers: Vec<String>,
    /// The cluster secret of the cluster the backup was taken from (else
    /// `MODELFORGE_CLUSTER_SECRET`): the backup's MAC must verify with it. A single member
    /// started without one uses its admin token (`<data-dir>/admin.token`).
    #[arg(long)]
    pub cluster_secret_file: Option<PathBuf>,
}

impl ServeConfig {
    /// A single-member config for in-process tests (`server::serve_on`): the production
    /// defaults, parsed from the same flags `serve` takes, with the data dir, the listener's
    /// address and admin token given, cheap argon2 and short intervals. It serves TLS with a
    /// CA of its own, generated into `<data-dir>/tls/ca.pem` at the first start (clients trust
    /// that file).
    pub fn for_test(
        data_dir: &Path,
        listen: SocketAddr,
        admin_token: &str,
    ) -> anyhow::Result<ServeConfig> {
        std::fs::create_dir_all(data_dir)?;
        let token_file = data_dir.join("test-admin.token");
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&token_file)?;
        std::io::Write::write_all(&mut f, admin_token.as_bytes())?;
        let args = [
            "modelforge".to_string(),
            "serve".into(),
            "--data-dir".into(),
            data_dir.display().to_string(),
            "--listen".into(),
            listen.to_string(),
            "--admin-token-file".into(),
            token_file.display().to_string(),
            "--argon2-m-kib".into(),
            "64".into(),
            "--argon2-t".into(),
            "1".into(),
            "--hash-workers".into(),
            "2".into(),
            "--credential-pool".into(),
            "4".into(),
            "--touch-interval".into(),
            "200ms".into(),
            "--events-interval".into(),
            "200ms".into(),
        ];
        match Cli::try_parse_from(args)?.command {
            Cmd::Serve(serve) => serve.into_config(),
            _ => bail!("not a serve command"),
        }
    }
}

/// `modelforge restore`.
pub fn restore(args: &RestoreArgs) -> anyhow::Result<()> {
    let secret = cluster_secret(args.cluster_secret_file.as_deref())?.ok_or_else(|| {
        anyhow::anyhow!(
            "restore needs the cluster secret the backup was taken with, to check its MAC: set MODELFORGE_CLUSTER_SECRET or pass --cluster-secret-file (a single member started without one uses its admin token file)"
        )
    })?;
    let r = crate::backup::prepare(&args.from, &args.data_dir, &args.journals, &secret)?;
    let b = &r.backup;
    println!(
        "restored backup of cluster {:?} taken at {} (index {}, {} nodes, {} active credentials, {} tokens)",
        b.cluster, b.created_at, b.applied_index, b.nodes, b.active_credentials, b.tokens
    );
    println!(
        "journals: {} ({} facts read, {} re-applied)",
        if r.journals.is_empty() {
            "none".to_string()
        } else {
            r.journals.join(", ")
        },
        r.journal_lines,
        r.reapplied.len()
    );
    for what in &r.reapplied {
        println!("  re-applied: {what}");
    }
    for w in &r.warnings {
        eprintln!("WARNING: {w}");
    }
    println!("new cluster id: {}", r.cluster);
    println!(
        "data dir ready: {} (report in {})",
        args.data_dir.display(),
        args.data_dir.join(crate::backup::REPORT_FILE).display()
    );
    let mut serve = format!("modelforge serve --data-dir {}", args.data_dir.display());
    if let Some(id) = args.node_id {
        serve.push_str(&format!(" --node-id {id}"));
    }
    for p in &args.peers {
        serve.push_str(&format!(" --peer {p}"));
    }
    println!("start it with: {serve}");
    Ok(())
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
    /// A TOML file of settings: any flag below, named with `_` for `-` (`listen =
    /// "0.0.0.0:7070"`, `peer = ["1=https://cp-1:7070", ...]`). A flag beats its environment
    /// variable, which beats the file, which beats the default.
    #[arg(long, env = "MODELFORGE_CONFIG")]
    pub config: Option<PathBuf>,
    /// This member's Raft id (stable for the life of its data dir).
    #[arg(long, env = "MODELFORGE_NODE_ID", default_value_t = 1)]
    pub node_id: u64,
    /// Address to listen on.
    #[arg(long, env = "MODELFORGE_LISTEN", default_value = "127.0.0.1:7070")]
    pub listen: SocketAddr,
    /// How peers and agents reach this member (default https://<listen>, or http:// with
    /// --insecure-http).
    #[arg(long, env = "MODELFORGE_ADVERTISE")]
    pub advertise: Option<String>,
    /// Serve plain HTTP, without TLS: for tests of this flag and local experiments only
    /// (a warning is logged on every start).
    #[arg(long, conflicts_with_all = ["tls_ca", "tls_ca_key", "tls_cert", "tls_key"])]
    pub insecure_http: bool,
    /// The cluster CA certificate (from `modelforge cluster init-ca`, or an outside PKI's CA
    /// with --tls-cert/--tls-key).
    #[arg(long, env = "MODELFORGE_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// The cluster CA's key: the member issues its own certificate from it at start.
    #[arg(long, env = "MODELFORGE_TLS_CA_KEY", requires = "tls_ca", conflicts_with_all = ["tls_cert", "tls_key"])]
    pub tls_ca_key: Option<PathBuf>,
    /// This member's certificate (an outside PKI; with --tls-key and --tls-ca).
    #[arg(long, env = "MODELFORGE_TLS_CERT", requires_all = ["tls_key", "tls_ca"])]
    pub tls_cert: Option<PathBuf>,
    /// This member's private key (with --tls-cert).
    #[arg(long, env = "MODELFORGE_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Where the Raft log, snapshots and generated secrets live.
    #[arg(long, env = "MODELFORGE_DATA_DIR", default_value = "./modelforge-data")]
    pub data_dir: PathBuf,
    /// `<id>=<url>`, repeatable: the full initial membership, this member included.
    #[arg(long = "peer", value_name = "ID=URL")]
    pub peers: Vec<String>,
    /// Join a running cluster: start with an empty data dir and wait to be added (`modelforge
    /// admin members add <id> <advertise url>` against the cluster). The URLs are members of
    /// that cluster, named in the log. Needs the cluster's CA and secrets like any member.
    #[arg(
        long,
        value_name = "URL[,URL...]",
        value_delimiter = ',',
        conflicts_with = "peers"
    )]
    pub join: Vec<String>,
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
    /// Node credentials the leader mints (and argon2-hashes) ahead of demand while idle, so
    /// that a burst of up to this many enrolments pays one argon2 evaluation each instead of
    /// two. Size it to the largest burst expected (a rack or a room powering on); 0 disables.
    #[arg(long, env = "MODELFORGE_CREDENTIAL_POOL", default_value_t = 64)]
    pub credential_pool: usize,
    /// Offer a node recovered by the runbook (re-enrolled, or first seen after a restore) to
    /// the scheduler only after a passing capability smoke.
    #[arg(long, env = "MODELFORGE_REQUIRE_SMOKE", default_value_t = true, action = clap::ArgAction::Set)]
    pub require_smoke: bool,
    /// Raft heartbeat interval.
    #[arg(long, default_value = "50ms", value_parser = humantime::parse_duration)]
    pub raft_heartbeat: Duration,
    /// Raft election timeout, lower bound (the upper bound is 1.5 times this). The leader lease
    /// is the upper bound and a follower's timer runs after its lease, so a dead leader is
    /// replaced 2.5-3 times this after its last heartbeat.
    #[arg(long, default_value = "200ms", value_parser = humantime::parse_duration)]
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
    /// Open connections this member accepts at most; beyond it new ones are closed at once.
    /// Default: the process's open-file limit less 1,024 kept for data files and peers (every
    /// agent keeps a connection open, so size the limit, and `ulimit -n`, to the fleet).
    #[arg(long, env = "MODELFORGE_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// Agent requests (heartbeats, inventory, smoke reports) this member processes at once;
    /// beyond it they are shed at once with 503 `over_capacity` and `Retry-After` (agents back
    /// off with jitter). Default: 64 per core.
    #[arg(long, env = "MODELFORGE_MAX_AGENT_REQUESTS")]
    pub max_agent_requests: Option<usize>,
    /// Agent requests are also shed while requests that are ready wait longer than this for
    /// the member's CPU (measured by a probe every 5 ms): the queue in socket buffers that
    /// `--max-agent-requests` cannot see. `0s` turns it off.
    #[arg(long, env = "MODELFORGE_SHED_QUEUE_DELAY", default_value = "5ms", value_parser = humantime::parse_duration)]
    pub shed_queue_delay: Duration,
    /// At SIGTERM, readiness (`/readyz`) fails at once and the member keeps serving this long
    /// before it stops accepting and drains; set it to the load balancer's check interval.
    #[arg(long, env = "MODELFORGE_SHUTDOWN_DELAY", default_value = "0s", value_parser = humantime::parse_duration)]
    pub shutdown_delay: Duration,
    /// `GET /metrics` asks for an admin token (any role) instead of answering anyone.
    #[arg(long)]
    pub metrics_auth: bool,
    /// A connection that has not sent a complete request head within this is closed (idle
    /// keep-alive connections included).
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub header_read_timeout: Duration,
    /// A request not answered within this (its body read included) gets 503
    /// (`request_timeout` for a read, `outcome_unknown` for a write) and its connection is
    /// closed.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub request_timeout: Duration,
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
    /// Memory for the nodes' recent telemetry samples (up to 32 a node, at least the latest),
    /// in MiB: with many nodes each keeps fewer.
    #[arg(long, default_value_t = 128)]
    pub telemetry_budget_mib: usize,
    /// How often status transitions and refused requests are written to node histories.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    pub events_interval: Duration,
    /// Free space kept on the data dir's filesystem, in MiB: under it the member raises an
    /// alarm and refuses new writes (503 `disk_full`) until space returns. 0 turns it off.
    #[arg(long, default_value_t = 256)]
    pub disk_reserve_mib: u64,
}

impl ServeArgs {
    /// The Raft timing and retention these flags ask for (their defaults are
    /// `RaftTuning::default()`, which the simulation and the in-process tests run with).
    pub fn raft_tuning(&self) -> modelforge_raft::RaftTuning {
        let election = self.raft_election_timeout.as_millis() as u64;
        modelforge_raft::RaftTuning {
            heartbeat_interval_ms: self.raft_heartbeat.as_millis() as u64,
            election_timeout_min_ms: election,
            election_timeout_max_ms: election * 3 / 2,
            snapshot_every_logs: self.snapshot_every,
            logs_kept_after_snapshot: self.snapshot_keep_logs,
        }
    }

    pub fn into_config(self) -> anyhow::Result<ServeConfig> {
        let scheme = if self.insecure_http { "http" } else { "https" };
        let advertise = self
            .advertise
            .clone()
            .unwrap_or_else(|| format!("{scheme}://{}", self.listen));
        let tls = match (
            &self.tls_ca,
            &self.tls_ca_key,
            &self.tls_cert,
            &self.tls_key,
        ) {
            _ if self.insecure_http => TlsSource::Insecure,
            (Some(ca), Some(ca_key), None, None) => TlsSource::IssueFrom {
                ca: ca.clone(),
                ca_key: ca_key.clone(),
            },
            (Some(ca), None, Some(cert), Some(key)) => TlsSource::Given {
                cert: cert.clone(),
                key: key.clone(),
                ca: ca.clone(),
            },
            (None, None, None, None) => TlsSource::Generated,
            _ => bail!(
                "give --tls-ca with --tls-ca-key (certificates issued from the cluster CA), or --tls-ca with --tls-cert and --tls-key (an outside PKI)"
            ),
        };
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
        let joining = !self.join.is_empty();
        for url in &self.join {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                bail!("--join {url:?}: the url must start with http:// or https://");
            }
        }
        if !peers.contains_key(&self.node_id) {
            bail!(
                "--peer must list this member too (--node-id {})",
                self.node_id
            );
        }
        if tls == TlsSource::Generated && (peers.len() > 1 || joining) {
            bail!(
                "a member of a {}-member cluster needs the shared cluster CA: run `modelforge cluster init-ca --out <dir>` once and start every member with --tls-ca <dir>/ca.pem --tls-ca-key <dir>/ca.key (or --insecure-http for a local experiment)",
                peers.len()
            );
        }
        if self.offline_after <= self.stale_after {
            bail!("--offline-after must be longer than --stale-after");
        }
        private_dir(&self.data_dir)?;
        let admin_token = admin_token(&self.data_dir, self.admin_token_file.as_deref())?;
        let cluster_secret = match cluster_secret(self.cluster_secret_file.as_deref())? {
            Some(s) => s,
            None if peers.len() > 1 || joining => bail!(
                "a member of a {}-member cluster needs a cluster secret of its own, the same on every member: set MODELFORGE_CLUSTER_SECRET or pass --cluster-secret-file",
                peers.len()
            ),
            None => admin_token.clone(),
        };
        if (peers.len() > 1 || joining)
            && crate::secrets::same_secret(&cluster_secret, &admin_token)
        {
            bail!(
                "the cluster secret (MODELFORGE_CLUSTER_SECRET or --cluster-secret-file) must differ from the admin token: whoever holds an operator's token must not be able to speak as a member"
            );
        }
        let tuning = self.raft_tuning();
        Ok(ServeConfig {
            node_id: self.node_id,
            listen: self.listen,
            advertise,
            tls,
            data_dir: self.data_dir,
            peers,
            peer_routes,
            join: self.join.clone(),
            admin_token: admin_token.into(),
            cluster_secret: cluster_secret.into(),
            hash_params: HashParams {
                m_kib: self.hash.argon2_m_kib,
                t: self.hash.argon2_t,
                p: self.hash.argon2_p,
            },
            credential_pool: self.credential_pool,
            require_smoke: self.require_smoke,
            hash_workers: self.hash_workers.unwrap_or_else(|| {
                std::thread::available_parallelism()
                    .map(|n| n.get())
                    .unwrap_or(2)
            }),
            tuning,
            thresholds: StatusThresholds {
                stale_after_ms: self.stale_after.as_millis() as i64,
                offline_after_ms: self.offline_after.as_millis() as i64,
            },
            max_body_bytes: self.max_body_bytes,
            max_agent_requests: self.max_agent_requests.unwrap_or_else(|| {
                64 * std::thread::available_parallelism()
                    .map(|n| n.get())
                    .unwrap_or(2)
            }),
            shed_queue_delay: self.shed_queue_delay,
            shutdown_delay: self.shutdown_delay,
            metrics_auth: self.metrics_auth,
            max_connections: self
                .max_connections
                .unwrap_or_else(crate::server::edge::default_max_connections),
            header_read_timeout: self.header_read_timeout,
            request_timeout: self.request_timeout,
            default_token_ttl_s: self.default_token_ttl,
            max_token_ttl_s: self.max_token_ttl,
            touch_interval: self.touch_interval,
            node_shards: self.node_shards.clamp(1, 1024),
            telemetry_budget_bytes: self.telemetry_budget_mib.saturating_mul(1 << 20),
            events_interval: self.events_interval,
            disk_reserve_bytes: self.disk_reserve_mib.saturating_mul(1 << 20),
        })
    }
}

/// Everything a member or a restore writes from here on is readable by its user only: files
/// 0600, directories 0700 (Raft log and vote, snapshots, journal, base state, keys). The data
/// dir itself is made 0700 at start (`into_config`), which also covers files written by older
/// builds.
pub fn private_files() -> anyhow::Result<()> {
    // SAFETY: umask only sets the process's file mode creation mask; it cannot fail.
    unsafe { libc::umask(0o077) };
    Ok(())
}

/// Make `dir` (created if needed) accessible to its owner only.
fn private_dir(dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("make {} private (0700)", dir.display()))
}

/// The shortest secret a member accepts, from a file or the environment alike.
pub const SECRET_MIN_LEN: usize = 16;

fn read_secret_file(path: &Path) -> anyhow::Result<String> {
    let s = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    checked_secret(&path.display().to_string(), &s)
}

/// `value`, trimmed, if it is long enough to be a secret; `source` names where it came from.
fn checked_secret(source: &str, value: &str) -> anyhow::Result<String> {
    let s = value.trim();
    if s.len() < SECRET_MIN_LEN {
        bail!("{source}: a secret must be at least {SECRET_MIN_LEN} characters");
    }
    Ok(s.to_string())
}

/// A secret from the environment variable `var` (set and non-empty), checked like a file's.
fn env_secret(var: &str) -> anyhow::Result<Option<String>> {
    match std::env::var(var) {
        Ok(s) if !s.trim().is_empty() => checked_secret(var, &s).map(Some),
        _ => Ok(None),
    }
}

/// The cluster secret: `MODELFORGE_CLUSTER_SECRET`, else the file, else none.
pub fn cluster_secret(file: Option<&Path>) -> anyhow::Result<Option<String>> {
    if let Some(s) = env_secret("MODELFORGE_CLUSTER_SECRET")? {
        return Ok(Some(s));
    }
    file.map(read_secret_file).transpose()
}

/// `MODELFORGE_ADMIN_TOKEN`, else the token file, else a new random token written there (0600).
fn admin_token(data_dir: &Path, file: Option<&Path>) -> anyhow::Result<String> {
    if let Some(t) = env_secret("MODELFORGE_ADMIN_TOKEN")? {
        return Ok(t);
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Serve {
        #[command(flatten)]
        args: ServeArgs,
    }

    /// `serve`'s Raft flags and `RaftTuning::default()` state the same numbers twice (clap
    /// needs literal defaults): members must run what the simulation and the in-process
    /// tests check.
    #[test]
    fn serve_defaults_are_the_raft_tunings_defaults() {
        let serve = Serve::try_parse_from(["serve", "--data-dir", "/nonexistent"]).unwrap();
        assert_eq!(
            serve.args.raft_tuning(),
            modelforge_raft::RaftTuning::default()
        );
    }
}
