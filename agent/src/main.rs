//! `modelforge-agent`: enrols this node with the control plane, then heartbeats with telemetry
//! and reports inventory changes. Exit status: 0 on SIGTERM; non-zero with a one-line reason
//! when it cannot enrol or its credential is refused and it has no token to re-enrol.

mod gpu;
mod smoke;
mod state_dir;
mod trust;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::anyhow;
use clap::Parser;
use modelforge_proto::ids::NodeId;
use modelforge_proto::ids::SmokeId;
use modelforge_proto::wire::EnrollRequest;
use modelforge_proto::wire::EnrollResponse;
use modelforge_proto::wire::Inventory;
use modelforge_proto::wire::Job;
use tracing_subscriber::EnvFilter;

use crate::gpu::GpuSource;
use crate::state_dir::StateDir;

#[derive(Parser, Debug)]
#[command(name = "modelforge-agent", version, about = "ModelForge node agent")]
struct Args {
    /// Control-plane member URLs, comma-separated; the agent fails over between them.
    #[arg(
        long,
        env = "MODELFORGE_CONTROL_PLANE",
        value_delimiter = ',',
        required = true
    )]
    control_plane: Vec<String>,
    /// Holds identity.json and credential.
    #[arg(
        long,
        env = "MODELFORGE_STATE_DIR",
        default_value = "./modelforge-agent"
    )]
    state_dir: PathBuf,
    /// Used only when the agent has no working credential. Prefer --enrollment-token-file:
    /// other users of the machine can read a process's arguments.
    #[arg(long, env = "MODELFORGE_ENROLLMENT_TOKEN", hide_env_values = true, value_parser = parse_token)]
    enrollment_token: Option<Token>,
    /// A file holding the enrolment token (read once at start).
    #[arg(
        long,
        env = "MODELFORGE_ENROLLMENT_TOKEN_FILE",
        conflicts_with = "enrollment_token"
    )]
    enrollment_token_file: Option<PathBuf>,
    /// nvml | simulated:<count> | file:<path>
    #[arg(long, env = "MODELFORGE_GPU_SOURCE", default_value = "nvml")]
    gpu_source: String,
    /// The name this node enrols under (default: the machine's hostname).
    #[arg(long, env = "MODELFORGE_HOSTNAME")]
    hostname: Option<String>,
    #[arg(long, env = "MODELFORGE_HEARTBEAT_INTERVAL", default_value = "10s", value_parser = humantime::parse_duration)]
    heartbeat_interval: Duration,
    /// Storage roots to report, repeatable (default: the state dir).
    #[arg(long = "storage-root")]
    storage_roots: Vec<PathBuf>,
    /// Pin the cluster CA on first contact: `sha256:<hex>` of its certificate (printed by
    /// `modelforge admin enrollments create`). The agent fetches the CA, and exits before
    /// sending any token when the hash differs.
    #[arg(long, env = "MODELFORGE_CA_CERT_HASH")]
    ca_cert_hash: Option<String>,
    /// Trust this CA certificate (PEM) instead of pinning by hash.
    #[arg(long, env = "MODELFORGE_CA_FILE")]
    ca_file: Option<PathBuf>,
    /// How long to keep retrying an enrolment the control plane cannot answer.
    #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
    enroll_timeout: Duration,
}

use modelforge_client::Answer as Reply;
use modelforge_client::redelivery_wait;

/// An enrolment token: redacted from `Debug`, zeroed when dropped.
#[derive(Clone)]
struct Token(secrecy::SecretString);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

impl Token {
    fn expose(&self) -> &str {
        secrecy::ExposeSecret::expose_secret(&self.0)
    }
}

fn parse_token(s: &str) -> Result<Token, String> {
    Ok(Token(s.trim().to_string().into()))
}

/// The token from `--enrollment-token-file`: trimmed, never echoed.
fn read_token_file(path: &std::path::Path) -> anyhow::Result<Token> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow!("read the enrolment token file {}: {e}", path.display()))?;
    let token = parse_token(&text).map_err(|e| anyhow!(e))?;
    if token.expose().is_empty() {
        anyhow::bail!("the enrolment token file {} is empty", path.display());
    }
    Ok(token)
}

/// The control plane, through the failover client the admin CLI uses too.
struct ControlPlane(modelforge_client::Failover);

impl ControlPlane {
    fn new(urls: Vec<String>, ca_pem: Option<&str>) -> anyhow::Result<Self> {
        let tls = match ca_pem {
            Some(pem) => {
                Some(modelforge_client::tls::client_config(pem, None).map_err(anyhow::Error::msg)?)
            }
            None => None,
        };
        modelforge_client::Failover::new(urls, Duration::from_secs(2), Duration::from_secs(20), tls)
            .map(Self)
            .map_err(|e| anyhow::anyhow!("--control-plane: {e}"))
    }

    /// One pass over the members (see `modelforge_client`).
    async fn call(
        &mut self,
        method: reqwest::Method,
        path: &str,
        bearer: Option<&str>,
        body: &impl serde::Serialize,
    ) -> Reply {
        let body = match serde_json::to_vec(body) {
            Ok(b) => b,
            Err(e) => return Reply::Unavailable(format!("request does not encode: {e}")),
        };
        let req = modelforge_client::Request {
            method,
            path,
            bearer,
            body: Some(body),
            idempotency_key: None,
        };
        self.0.send(&req).await
    }
}

struct Agent {
    args: Args,
    hostname: String,
    state: StateDir,
    gpus: GpuSource,
    cp: ControlPlane,
    token_spent: bool,
    /// Smokes already run and reported (a job repeats until its report lands).
    smokes_done: std::collections::HashSet<SmokeId>,
}

impl Agent {
    fn inventory(&self) -> Inventory {
        let mut inv = self.gpus.inventory();
        let roots = if self.args.storage_roots.is_empty() {
            vec![self.args.state_dir.clone()]
        } else {
            self.args.storage_roots.clone()
        };
        if inv.storage_roots.is_empty() {
            inv.storage_roots = gpu::storage_roots(&roots);
        }
        inv
    }

    /// Enrol with the token; retry what the control plane could not answer (the same claim by
    /// the same identity lands on the same node id), stop on a refusal.
    async fn enroll(&mut self, token: &str) -> anyhow::Result<String> {
        let token_id = token.get(5..37).unwrap_or("").to_string();
        let deadline = tokio::time::Instant::now() + self.args.enroll_timeout;
        let mut backoff = Duration::from_millis(200);
        loop {
            let proof = self.state.key.prove(
                &token_id,
                &self.hostname,
                modelforge_proto::now_ms(),
                self.state.node_id.as_ref().map(ToString::to_string),
            );
            let req = EnrollRequest {
                token: token.to_string(),
                hostname: self.hostname.clone(),
                identity: proof,
                inventory: self.inventory(),
            };
            match self
                .cp
                .call(reqwest::Method::POST, "/api/v1/agent/enroll", None, &req)
                .await
            {
                Reply::Ok(v) => {
                    let resp: EnrollResponse = serde_json::from_value(v)
                        .map_err(|e| anyhow!("enrolment answer unreadable: {e}"))?;
                    self.state.save_credential(&resp.credential)?;
                    self.state.node_id = Some(resp.node_id.clone());
                    self.state.save_identity()?;
                    self.token_spent = true;
                    tracing::info!(node_id = %resp.node_id, reenrolled = resp.reenrolled, "enrolled");
                    return Ok(resp.credential);
                }
                Reply::Refused(status, code, message) => {
                    return Err(anyhow!("enrolment refused ({status} {code}): {message}"));
                }
                Reply::Unavailable(why) => {
                    if tokio::time::Instant::now() >= deadline {
                        return Err(anyhow!("could not enrol: control plane unavailable: {why}"));
                    }
                    tracing::warn!(reason = %why, "enrolment not answered; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(3));
                }
            }
        }
    }

    async fn run(&mut self) -> anyhow::Result<()> {
        let mut credential = self.state.credential();
        let mut sent_inventory: Option<Inventory> = None;
        loop {
            let cred = match credential.take() {
                Some(c) if self.state.node_id.is_some() => c,
                _ => {
                    let token = match (&self.args.enrollment_token, self.token_spent) {
                        (Some(t), false) => t.clone(),
                        _ => {
                            return Err(anyhow!(
                                "no working credential and no enrolment token to enrol with"
                            ));
                        }
                    };
                    let c = self.enroll(token.expose()).await?;
                    sent_inventory = Some(self.inventory());
                    c
                }
            };
            let node_id = self.state.node_id.clone().expect("enrolled");
            match self
                .heartbeat_loop(&node_id, &cred, &mut sent_inventory)
                .await
            {
                Refusal::Unauthorized(why) if why == "node_decommissioned" => {
                    return Err(anyhow!(
                        "node {node_id} was decommissioned (401 node_decommissioned): this identity can never enrol again; to bring the hardware back, enrol it as a new node with an empty state dir"
                    ));
                }
                Refusal::Unauthorized(why) => {
                    self.state.forget_credential();
                    if self.args.enrollment_token.is_none() || self.token_spent {
                        return Err(anyhow!(
                            "credential refused (401 {why}) and no enrolment token to re-enrol with"
                        ));
                    }
                    tracing::warn!(reason = %why, "credential refused: re-enrolling with the token");
                }
                Refusal::Forbidden(why) => {
                    return Err(anyhow!(
                        "credential refused (403 {why}): it is not authorised for node {node_id}"
                    ));
                }
            }
        }
    }

    async fn heartbeat_loop(
        &mut self,
        node_id: &NodeId,
        cred: &str,
        sent: &mut Option<Inventory>,
    ) -> Refusal {
        let path = format!("/api/v1/agent/nodes/{node_id}/heartbeat");
        let mut tick = tokio::time::interval(self.args.heartbeat_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let inv = self.inventory();
            if sent.as_ref() != Some(&inv) {
                let ipath = format!("/api/v1/agent/nodes/{node_id}/inventory");
                match self
                    .cp
                    .call(reqwest::Method::PUT, &ipath, Some(cred), &inv)
                    .await
                {
                    Reply::Ok(..) => *sent = Some(inv),
                    Reply::Refused(401, code, _) => return Refusal::Unauthorized(code),
                    Reply::Refused(403, code, _) => return Refusal::Forbidden(code),
                    Reply::Refused(s, code, m) => {
                        tracing::warn!(status = s, code, message = m, "inventory refused")
                    }
                    Reply::Unavailable(why) => {
                        tracing::warn!(reason = %why, "inventory not delivered")
                    }
                }
            }
            let telemetry = self.gpus.telemetry();
            match self
                .cp
                .call(reqwest::Method::POST, &path, Some(cred), &telemetry)
                .await
            {
                Reply::Ok(v) => {
                    tracing::debug!("heartbeat ok");
                    let jobs: Vec<Job> =
                        serde_json::from_value(v["jobs"].clone()).unwrap_or_default();
                    for job in jobs {
                        let Job::Smoke {
                            smoke_id,
                            expected_uuids,
                        } = job;
                        if self.smokes_done.contains(&smoke_id) {
                            continue;
                        }
                        tracing::info!(smoke_id = %smoke_id, "running the capability smoke");
                        let report = smoke::run(
                            &self.gpus,
                            &self.inventory(),
                            &expected_uuids,
                            smoke_id.as_str(),
                        );
                        let failed = report.checks.iter().filter(|c| !c.ok).count();
                        let rpath = format!("/api/v1/agent/nodes/{node_id}/smoke/{smoke_id}");
                        match self
                            .cp
                            .call(reqwest::Method::POST, &rpath, Some(cred), &report)
                            .await
                        {
                            Reply::Ok(..) => {
                                tracing::info!(smoke_id = %smoke_id, failed, "capability smoke reported");
                                self.smokes_done.insert(smoke_id);
                            }
                            Reply::Refused(401, code, _) => return Refusal::Unauthorized(code),
                            Reply::Refused(403, code, _) => return Refusal::Forbidden(code),
                            Reply::Refused(s, code, m) => {
                                tracing::warn!(
                                    status = s,
                                    code,
                                    message = m,
                                    "smoke report refused"
                                );
                                self.smokes_done.insert(smoke_id);
                            }
                            Reply::Unavailable(why) => {
                                tracing::warn!(reason = %why, "smoke report not delivered; retried with the next heartbeat")
                            }
                        }
                    }
                }
                Reply::Refused(401, code, _) => return Refusal::Unauthorized(code),
                Reply::Refused(403, code, _) => return Refusal::Forbidden(code),
                Reply::Refused(s, code, m) => {
                    tracing::warn!(status = s, code, message = m, "heartbeat refused")
                }
                Reply::Unavailable(why) => {
                    // Shed, overloaded, no leader or unreachable: sent again once the member's
                    // `Retry-After` (or a second) and a random part of as long again have
                    // passed, and the interval starts over from there (ARCHITECTURE.md, "The
                    // HTTP edge").
                    let wait = redelivery_wait(self.cp.0.take_retry_after());
                    tracing::warn!(reason = %why, again_in_ms = wait.as_millis() as u64, "heartbeat not delivered");
                    tokio::time::sleep(wait).await;
                    tick.reset_immediately();
                }
            }
        }
    }
}

enum Refusal {
    Unauthorized(String),
    Forbidden(String),
}

fn machine_hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

async fn start(mut args: Args) -> anyhow::Result<()> {
    if let Some(path) = args.enrollment_token_file.take() {
        args.enrollment_token = Some(read_token_file(&path)?);
    }
    let hostname = args.hostname.clone().unwrap_or_else(machine_hostname);
    if !modelforge_proto::valid_hostname(&hostname) {
        anyhow::bail!("hostname {hostname:?} is not a valid hostname");
    }
    let state = StateDir::open(&args.state_dir)?;
    let gpus = GpuSource::open(&args.gpu_source, &hostname)?;
    let ca = trust::settle(
        &args.control_plane,
        &args.state_dir,
        args.ca_file.as_deref(),
        args.ca_cert_hash.as_deref(),
    )
    .await?;
    let cp = ControlPlane::new(args.control_plane.clone(), ca.as_deref())?;
    let mut agent = Agent {
        args,
        hostname,
        state,
        gpus,
        cp,
        token_spent: false,
        smokes_done: Default::default(),
    };
    agent.run().await
}

#[tokio::main]
async fn main() {
    modelforge_client::tls::install_provider();
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_env("MODELFORGE_LOG").unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let args = Args::parse();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("install SIGTERM handler");
    let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .expect("install SIGINT handler");
    let code = tokio::select! {
        r = start(args) => match r {
            Ok(()) => 0,
            Err(e) => {
                let line = format!("{e:#}").replace('\n', " ");
                eprintln!("modelforge-agent: {line}");
                1
            }
        },
        _ = term.recv() => 0,
        _ = int.recv() => 0,
    };
    std::process::exit(code);
}
