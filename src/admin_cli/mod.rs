//! `modelforge admin ...`: the operator's CLI over the public HTTP API (any member; failover
//! between `--server` URLs). Every runbook step is one command; `docs/runbooks/` use it and
//! `tests/runbooks.rs` runs them.
//!
//! Exit codes (documented in README.md; scripts may rely on them):
//! 0 ok; 1 refused by the server; 2 usage; 3 no member reachable or ready; 4 confirmation
//! declined; 5 the audit chain does not verify; 10-14 doctor verdicts (see [`doctor::Verdict`]).

pub mod audit;
mod audit_cmd;
pub mod client;
mod cluster_doctor;
mod decommission;
pub mod doctor;
mod enrolments;
mod members;
mod nodes;
mod operators;
mod output;

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use clap::Subcommand;
use modelforge_proto::api;
use serde_json::Value;
use serde_json::json;

use self::audit_cmd::audit_cmd;
use self::audit_cmd::verify_and_report;
use self::client::CallError;
use self::client::Client;
use self::decommission::decommission;
use self::doctor::doctor_cmd;
use self::enrolments::enrollments;
use self::members::members;
use self::nodes::nodes;
use self::nodes::smoke_cmd;
use self::operators::operators;
use self::output::emit;
use self::output::emit_or_quiet;
use self::output::table;

pub const EXIT_OK: i32 = 0;
pub const EXIT_REFUSED: i32 = 1;
pub const EXIT_USAGE: i32 = 2;
pub const EXIT_UNREACHABLE: i32 = 3;
pub const EXIT_DECLINED: i32 = 4;
pub const EXIT_AUDIT_BROKEN: i32 = 5;

#[derive(clap::Args, Debug)]
pub struct AdminArgs {
    /// Member URLs, comma-separated; any member answers, the CLI fails over between them.
    #[arg(
        long,
        global = true,
        env = "MODELFORGE_URL",
        value_delimiter = ',',
        default_value = "https://127.0.0.1:7070"
    )]
    pub server: Vec<String>,
    /// The cluster CA to trust for https:// members (default: ./modelforge-data/tls/ca.pem
    /// when it exists, or <MODELFORGE_DATA_DIR>/tls/ca.pem).
    #[arg(long, global = true, env = "MODELFORGE_CACERT")]
    pub cacert: Option<PathBuf>,
    /// File holding the admin token (else MODELFORGE_ADMIN_TOKEN, else
    /// ./modelforge-data/admin.token when it exists).
    #[arg(long, global = true)]
    pub admin_token_file: Option<PathBuf>,
    /// `table` or `wide` (for people), `json` or `yaml` (for scripts).
    #[arg(long, short = 'o', global = true, value_enum, default_value = "table")]
    pub output: Output,
    /// Print only the primary value (an id, a token), one per line.
    #[arg(long, short = 'q', global = true)]
    pub quiet: bool,
    /// How long to keep trying members that do not answer or have no leader (then exit 3).
    #[arg(long, global = true, default_value = "15s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
    #[command(subcommand)]
    pub command: AdminCmd,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// Tables for people.
    Table,
    /// Tables with more columns (full times, GPUs, reasons, hashes).
    Wide,
    /// The member's answer as sent, for scripts.
    Json,
    /// The same as YAML.
    Yaml,
}

#[derive(Subcommand, Debug)]
pub enum AdminCmd {
    /// The cluster as the first answering member sees it.
    Cluster,
    /// Enrolment tokens: create, list, cancel.
    #[command(subcommand)]
    Enrollments(EnrollmentCmd),
    /// Nodes: list, show, credentials, revoke-credential, cordon, uncordon, drain.
    #[command(subcommand)]
    Nodes(NodeCmd),
    /// Decommission a node: preview, then execute.
    #[command(subcommand)]
    Decommission(DecommissionCmd),
    /// Named operators' admin tokens: create, list, delete (needs the admin role).
    #[command(subcommand)]
    Tokens(TokenCmd),
    /// The audit trail: list, export, verify.
    #[command(subcommand)]
    Audit(AuditCmd),
    /// The cluster's members: list, add (learner, catch up, then voter), remove (needs the
    /// admin role for changes).
    #[command(subcommand)]
    Members(MemberCmd),
    /// Take a consistent backup online from any member (checked, then written atomically).
    Backup {
        /// Where to write it.
        #[arg(long)]
        out: PathBuf,
    },
    /// The scheduler's view: per node, verified, offered, free GPUs, allocations.
    Scheduler,
    /// Run the capability smoke on a node and wait for its verdict (exit 1 if it fails).
    Smoke {
        node_id: String,
        /// How long to wait for the agent's report.
        #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
        wait: Duration,
    },
    /// Diagnose one node and name the runbook case and commands (exit 0 only when healthy);
    /// with --cluster, the cluster itself: quorum margin, unreachable or lagging members, and
    /// the commands that replace one (exit 0 healthy, 20 degraded, 21 quorum at risk, 22 no
    /// leader).
    Doctor {
        #[arg(required_unless_present = "cluster", conflicts_with = "cluster")]
        node_id: Option<String>,
        /// Diagnose the cluster instead of a node.
        #[arg(long)]
        cluster: bool,
        /// Re-check until healthy or this long has passed (e.g. 60s).
        #[arg(long, value_parser = humantime::parse_duration)]
        wait: Option<Duration>,
    },
}

#[derive(Subcommand, Debug)]
pub enum MemberCmd {
    /// Each member's role, URL, matched log index and reachability (as the leader reports).
    List,
    /// Add member <id>, started with `modelforge serve --node-id <id> --join ...`: as a
    /// learner, then a voter once it has caught up. Safe to retry.
    Add {
        id: u64,
        /// The URL the new member advertises.
        url: String,
        /// Keep it a learner (no vote).
        #[arg(long)]
        learner: bool,
    },
    /// Remove member <id>, dead or alive; its id is never accepted again.
    Remove { id: u64 },
}

#[derive(Subcommand, Debug)]
pub enum EnrollmentCmd {
    /// Create a one-time enrolment token (shown once).
    Create {
        /// Lifetime, e.g. 10m, 1h (default: the cluster's).
        #[arg(long, value_parser = humantime::parse_duration)]
        ttl: Option<Duration>,
        #[arg(long)]
        note: Option<String>,
    },
    /// List enrolment tokens (never the tokens themselves).
    List,
    /// Cancel an unclaimed token.
    Cancel {
        enrollment_id: String,
        /// Why (kept in the audit trail).
        #[arg(long)]
        reason: String,
    },
}

#[derive(Subcommand, Debug)]
pub enum TokenCmd {
    /// Create a named token (shown once) with a role: viewer, operator or admin.
    Create {
        name: String,
        #[arg(long, value_enum)]
        role: RoleArg,
        /// Why (kept in the audit trail).
        #[arg(long)]
        reason: String,
    },
    /// List the named tokens (never a token or its digest).
    List,
    /// Delete a named token: when this returns, no member accepts it.
    Delete {
        name: String,
        /// Why (kept in the audit trail).
        #[arg(long)]
        reason: String,
    },
}

/// A role as the CLI takes it.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum RoleArg {
    Viewer,
    Operator,
    Admin,
}

impl From<RoleArg> for api::Role {
    fn from(r: RoleArg) -> Self {
        match r {
            RoleArg::Viewer => api::Role::Viewer,
            RoleArg::Operator => api::Role::Operator,
            RoleArg::Admin => api::Role::Admin,
        }
    }
}

#[derive(Subcommand, Debug)]
pub enum NodeCmd {
    /// List nodes; `--hostname H --enabled true` answers "which enabled nodes claim H".
    List {
        #[arg(long)]
        hostname: Option<String>,
        #[arg(long)]
        enabled: Option<bool>,
        /// Print the list again whenever it changes (blocking queries), until interrupted.
        #[arg(long)]
        watch: bool,
    },
    /// One node: status, conflicts, last refusal, history.
    Show {
        node_id: String,
        /// Print the node again whenever it changes (blocking queries), until interrupted.
        #[arg(long)]
        watch: bool,
    },
    /// A node's credentials (no hashes, ever).
    Credentials { node_id: String },
    /// Revoke a node's active credential (permanent).
    /// Asks for confirmation when stdin is a terminal (`--yes` does not).
    RevokeCredential {
        node_id: String,
        /// Why (kept in the audit trail).
        #[arg(long)]
        reason: String,
        /// Do not ask for confirmation on the terminal.
        #[arg(long)]
        yes: bool,
    },
    /// Cordon a node: no new placement on it (its allocations stay).
    Cordon {
        node_id: String,
        /// Why (kept in the audit trail and the node's history).
        #[arg(long)]
        reason: String,
    },
    /// Lift an operator's cordon (GPU cordons stay: see `uncordon-gpu`).
    Uncordon {
        node_id: String,
        #[arg(long)]
        reason: String,
    },
    /// Cordon a node and release its allocations (each marked `drained` for its owner).
    Drain {
        node_id: String,
        #[arg(long)]
        reason: String,
    },
    /// Lift a failed GPU's cordon after it was reset and reports healthy again.
    UncordonGpu {
        node_id: String,
        uuid: String,
        #[arg(long)]
        reason: String,
    },
}

#[derive(Subcommand, Debug)]
pub enum DecommissionCmd {
    /// Compute every effect and bind it to the current state (audited; expires in 15 min).
    Preview { node_id: String },
    /// Apply a preview if nothing it showed has changed (else exit 1, `preview_stale`).
    Execute {
        node_id: String,
        #[arg(long)]
        preview_id: String,
        #[arg(long)]
        reason: String,
        /// Do not ask for confirmation on the terminal.
        #[arg(long)]
        yes: bool,
    },
}

#[derive(Subcommand, Debug)]
pub enum AuditCmd {
    /// List events, filtered by node and time.
    List {
        #[arg(long)]
        node_id: Option<String>,
        /// RFC 3339 time, e.g. 2026-12-02T10:00:00Z.
        #[arg(long)]
        since: Option<String>,
        /// At most this many events, oldest first (all of them when absent).
        #[arg(long)]
        limit: Option<usize>,
    },
    /// Write the whole trail to a file (or stdout with `--out -`), for verifying later.
    Export {
        #[arg(long, default_value = "-")]
        out: PathBuf,
    },
    /// Recompute the hash chain here: of the live trail, or of an exported file.
    Verify {
        #[arg(long)]
        file: Option<PathBuf>,
        /// The head hash the trail must end with (e.g. printed by an earlier verify).
        #[arg(long)]
        expect_head: Option<String>,
    },
}

/// A failure with its exit code; printed as one line on stderr.
struct Fail(i32, String);

impl From<CallError> for Fail {
    fn from(e: CallError) -> Self {
        match e {
            CallError::Refused {
                status,
                code,
                message,
            } => Fail(EXIT_REFUSED, format!("{code}: {message} (HTTP {status})")),
            CallError::Unreachable(why) => {
                Fail(EXIT_UNREACHABLE, format!("no member answered: {why}"))
            }
            CallError::BadAnswer(why) => {
                Fail(EXIT_UNREACHABLE, format!("the answer does not read: {why}"))
            }
        }
    }
}

fn usage(msg: impl Into<String>) -> Fail {
    Fail(EXIT_USAGE, msg.into())
}

/// Run one admin command; returns the process exit code.
pub async fn run(args: AdminArgs) -> i32 {
    match run_inner(args).await {
        Ok(code) => code,
        Err(Fail(code, msg)) => {
            eprintln!(
                "modelforge admin: {}",
                output::printable(&msg.replace('\n', " "))
            );
            code
        }
    }
}

fn admin_token(file: Option<&PathBuf>) -> Result<String, Fail> {
    if let Ok(t) = std::env::var("MODELFORGE_ADMIN_TOKEN")
        && !t.trim().is_empty()
    {
        return Ok(t.trim().to_string());
    }
    let default = PathBuf::from("modelforge-data/admin.token");
    let path = match file {
        Some(p) => p.clone(),
        None if default.exists() => default,
        None => {
            return Err(usage(
                "no admin token: set MODELFORGE_ADMIN_TOKEN or pass --admin-token-file",
            ));
        }
    };
    let t = std::fs::read_to_string(&path)
        .map_err(|e| usage(format!("read {}: {e}", path.display())))?;
    let t = t.trim().to_string();
    if t.is_empty() {
        return Err(usage(format!("{} is empty", path.display())));
    }
    Ok(t)
}

/// The cluster CA's PEM: `--cacert`/`MODELFORGE_CACERT`, else the local member's
/// `<data dir>/tls/ca.pem` when it exists.
fn cacert(file: Option<&PathBuf>) -> Result<String, Fail> {
    let data_dir =
        std::env::var("MODELFORGE_DATA_DIR").unwrap_or_else(|_| "modelforge-data".into());
    let default = PathBuf::from(data_dir).join("tls/ca.pem");
    let path = match file {
        Some(p) => p.clone(),
        None if default.exists() => default,
        None => {
            return Err(usage(format!(
                "https:// members need the cluster CA: pass --cacert <ca.pem> or set MODELFORGE_CACERT (no {} here)",
                default.display()
            )));
        }
    };
    std::fs::read_to_string(&path).map_err(|e| usage(format!("read {}: {e}", path.display())))
}

/// The server's rule (`modelforge_proto::ids::is_tame`), checked before anything is sent.
fn check_id(what: &str, id: &str) -> Result<(), Fail> {
    if modelforge_proto::ids::is_tame(id) {
        Ok(())
    } else {
        Err(usage(format!(
            "{what} must be 1 to 64 letters, digits, '-' or '_'"
        )))
    }
}

async fn run_inner(args: AdminArgs) -> Result<i32, Fail> {
    let urls: Vec<String> = args
        .server
        .iter()
        .map(|u| u.trim().trim_end_matches('/').to_string())
        .filter(|u| !u.is_empty())
        .collect();
    if urls.is_empty() {
        return Err(usage("--server needs at least one URL"));
    }
    if let Some(bad) = urls
        .iter()
        .find(|u| !(u.starts_with("http://") || u.starts_with("https://")))
    {
        return Err(usage(format!(
            "--server {bad:?}: a URL must start with http:// or https://"
        )));
    }
    // Validate ids before any network traffic: a usage error is exit 2, never a request.
    match &args.command {
        AdminCmd::Enrollments(EnrollmentCmd::Cancel { enrollment_id, .. }) => {
            check_id("enrollment_id", enrollment_id)?
        }
        AdminCmd::Nodes(
            NodeCmd::Show { node_id, .. }
            | NodeCmd::Credentials { node_id }
            | NodeCmd::RevokeCredential { node_id, .. }
            | NodeCmd::Cordon { node_id, .. }
            | NodeCmd::Uncordon { node_id, .. }
            | NodeCmd::Drain { node_id, .. }
            | NodeCmd::UncordonGpu { node_id, .. },
        )
        | AdminCmd::Decommission(DecommissionCmd::Preview { node_id })
        | AdminCmd::Doctor {
            node_id: Some(node_id),
            ..
        }
        | AdminCmd::Smoke { node_id, .. } => check_id("node_id", node_id)?,
        AdminCmd::Decommission(DecommissionCmd::Execute {
            node_id,
            preview_id,
            ..
        }) => {
            check_id("node_id", node_id)?;
            check_id("preview_id", preview_id)?;
        }
        AdminCmd::Audit(AuditCmd::List {
            node_id: Some(n), ..
        }) => check_id("node_id", n)?,
        AdminCmd::Tokens(TokenCmd::Create { name, .. } | TokenCmd::Delete { name, .. }) => {
            check_id("token name", name)?
        }
        _ => {}
    }
    // Verifying a file needs no server and no token.
    if let AdminCmd::Audit(AuditCmd::Verify {
        file: Some(path),
        expect_head,
    }) = &args.command
    {
        let text = std::fs::read_to_string(path)
            .map_err(|e| usage(format!("read {}: {e}", path.display())))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| {
            Fail(
                EXIT_AUDIT_BROKEN,
                format!("{} is not a readable export: {e}", path.display()),
            )
        })?;
        if v["format"] != audit::EXPORT_FORMAT {
            return Err(Fail(
                EXIT_AUDIT_BROKEN,
                format!("{} is not a {} file", path.display(), audit::EXPORT_FORMAT),
            ));
        }
        let events = v["events"].as_array().cloned().unwrap_or_default();
        return verify_and_report(&args, &events, expect_head.as_deref(), None);
    }
    let token = admin_token(args.admin_token_file.as_ref())?;
    let tls = if urls.iter().any(|u| u.starts_with("https://")) {
        let pem = cacert(args.cacert.as_ref())?;
        Some(modelforge_client::tls::client_config(&pem, None).map_err(usage)?)
    } else {
        None
    };
    let mut c = Client::new(urls, token, args.timeout, tls)
        .map_err(|e| Fail(EXIT_UNREACHABLE, e.to_string()))?;
    c.progress = output::progress(&args);
    match &args.command {
        AdminCmd::Cluster => {
            let (view, v): (api::ClusterView, _) = c.get_typed("/api/v1/cluster").await?;
            emit(&args, &v, || {
                let leader = view
                    .leader_id
                    .map_or_else(|| "null".to_string(), |l| l.to_string());
                let mut out = format!(
                    "member {} sees leader {leader} in term {} (commit {}, applied {})\n",
                    view.id, view.term, view.commit_index, view.applied_index
                );
                let rows = view
                    .members
                    .iter()
                    .map(|m| vec![m.id.to_string(), m.url.clone()])
                    .collect();
                out.push_str(&table(&["MEMBER", "URL"], rows));
                out
            });
            Ok(EXIT_OK)
        }
        AdminCmd::Enrollments(cmd) => enrollments(&args, &mut c, cmd).await,
        AdminCmd::Nodes(cmd) => nodes(&args, &mut c, cmd).await,
        AdminCmd::Decommission(cmd) => decommission(&args, &mut c, cmd).await,
        AdminCmd::Tokens(cmd) => operators(&args, &mut c, cmd).await,
        AdminCmd::Audit(cmd) => audit_cmd(&args, &mut c, cmd).await,
        AdminCmd::Members(cmd) => members(&args, &mut c, cmd).await,
        AdminCmd::Doctor { cluster: true, .. } => {
            cluster_doctor::cluster_doctor(&args, &mut c).await
        }
        AdminCmd::Doctor {
            node_id: Some(node_id),
            wait,
            ..
        } => doctor_cmd(&args, &mut c, node_id, *wait).await,
        AdminCmd::Doctor { node_id: None, .. } => {
            unreachable!("clap requires a node id without --cluster")
        }
        AdminCmd::Backup { out } => backup_cmd(&args, &mut c, out).await,
        AdminCmd::Scheduler => {
            let (view, v): (api::SchedulerView, _) = c.get_typed("/api/v1/admin/scheduler").await?;
            emit(&args, &v, || {
                let rows = view
                    .nodes
                    .iter()
                    .map(|n| {
                        let allocs = n
                            .allocations
                            .iter()
                            .map(|a| format!("{}:{}", a.allocation_id, a.state))
                            .collect::<Vec<_>>()
                            .join(" ");
                        vec![
                            n.node_id.to_string(),
                            n.hostname.clone(),
                            n.verified.to_string(),
                            n.online.to_string(),
                            n.smoke_required.to_string(),
                            n.offered.to_string(),
                            format!("{}/{}", n.free_accelerators, n.accelerators),
                            if allocs.is_empty() {
                                "-".into()
                            } else {
                                allocs
                            },
                        ]
                    })
                    .collect();
                format!(
                    "view rebuilt at {}; smoke required for recovered nodes: {}\n{}",
                    view.view_rebuilt_at,
                    view.require_smoke,
                    table(
                        &[
                            "NODE",
                            "HOSTNAME",
                            "VERIFIED",
                            "ONLINE",
                            "NEEDS SMOKE",
                            "OFFERED",
                            "FREE",
                            "ALLOCATIONS"
                        ],
                        rows
                    )
                )
            });
            Ok(EXIT_OK)
        }
        AdminCmd::Smoke { node_id, wait } => smoke_cmd(&args, &mut c, node_id, *wait).await,
    }
}

/// `modelforge admin backup --out F`: download, check the framing and checksum (the MAC needs
/// the cluster secret: restore checks it), write atomically and readable by the owner only.
async fn backup_cmd(args: &AdminArgs, c: &mut Client, out: &std::path::Path) -> Result<i32, Fail> {
    eprintln!("taking a backup from {} ...", c.urls().join(","));
    let bytes = c.download("/api/v1/admin/backup").await?;
    let h = crate::backup::inspect(&bytes).map_err(|e| {
        Fail(
            EXIT_REFUSED,
            format!("the backup received does not check: {e}"),
        )
    })?;
    let tmp = out.with_extension("partial");
    let write = || -> std::io::Result<()> {
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(&bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, out)
    };
    write().map_err(|e| Fail(EXIT_REFUSED, format!("write {}: {e}", out.display())))?;
    let v = json!({"file": out.display().to_string(), "bytes": bytes.len(), "header": h});
    emit_or_quiet(args, &v, vec![out.display().to_string()], || {
        format!(
            "backup written to {} ({} bytes, checksum verified)\ncluster {:?}, index {}, taken {} by member {}: {} nodes, {} active credentials, {} tokens\n",
            out.display(),
            bytes.len(),
            h.cluster,
            h.applied_index,
            h.created_at,
            h.taken_by_member,
            h.nodes,
            h.active_credentials,
            h.tokens
        )
    });
    Ok(EXIT_OK)
}
