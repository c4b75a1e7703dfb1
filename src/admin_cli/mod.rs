//! `modelforge admin ...`: the operator's CLI over the public HTTP API (any member; failover
//! between `--server` URLs). Every runbook step is one command; `docs/runbooks/` use it and
//! `tests/runbooks.rs` runs them.
//!
//! Exit codes (documented in README.md; scripts may rely on them):
//! 0 ok; 1 refused by the server; 2 usage; 3 no member reachable or ready; 4 confirmation
//! declined; 5 the audit chain does not verify; 10-14 doctor verdicts (see [`doctor::Verdict`]).

pub mod audit;
pub mod client;
pub mod doctor;

use std::io::IsTerminal;
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use clap::Subcommand;
use modelforge_proto::api;
use reqwest::Method;
use serde_json::Value;
use serde_json::json;

use self::client::CallError;
use self::client::Client;

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
        default_value = "http://127.0.0.1:7070"
    )]
    pub server: Vec<String>,
    /// File holding the admin token (else MODELFORGE_ADMIN_TOKEN, else
    /// ./modelforge-data/admin.token when it exists).
    #[arg(long, global = true)]
    pub admin_token_file: Option<PathBuf>,
    /// `table` (for people) or `json` (for scripts).
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
    Table,
    Json,
}

#[derive(Subcommand, Debug)]
pub enum AdminCmd {
    /// The cluster as the first answering member sees it.
    Cluster,
    /// Enrolment tokens: create, list, cancel.
    #[command(subcommand)]
    Enrollments(EnrollmentCmd),
    /// Nodes: list, show, credentials, revoke-credential.
    #[command(subcommand)]
    Nodes(NodeCmd),
    /// Decommission a node: preview, then execute.
    #[command(subcommand)]
    Decommission(DecommissionCmd),
    /// The audit trail: list, export, verify.
    #[command(subcommand)]
    Audit(AuditCmd),
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
    /// Diagnose one node and name the runbook case and commands (exit 0 only when healthy).
    Doctor {
        node_id: String,
        /// Re-check until healthy or this long has passed (e.g. 60s).
        #[arg(long, value_parser = humantime::parse_duration)]
        wait: Option<Duration>,
    },
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
    Cancel { enrollment_id: String },
}

#[derive(Subcommand, Debug)]
pub enum NodeCmd {
    /// List nodes; `--hostname H --enabled true` answers "which enabled nodes claim H".
    List {
        #[arg(long)]
        hostname: Option<String>,
        #[arg(long)]
        enabled: Option<bool>,
    },
    /// One node: status, conflicts, last refusal, history.
    Show { node_id: String },
    /// A node's credentials (no hashes, ever).
    Credentials { node_id: String },
    /// Revoke a node's active credential (permanent).
    RevokeCredential {
        node_id: String,
        #[arg(long)]
        reason: Option<String>,
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
            eprintln!("modelforge admin: {}", msg.replace('\n', " "));
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

fn check_id(what: &str, id: &str) -> Result<(), Fail> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_');
    if ok {
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
        AdminCmd::Enrollments(EnrollmentCmd::Cancel { enrollment_id }) => {
            check_id("enrollment_id", enrollment_id)?
        }
        AdminCmd::Nodes(
            NodeCmd::Show { node_id }
            | NodeCmd::Credentials { node_id }
            | NodeCmd::RevokeCredential { node_id, .. },
        )
        | AdminCmd::Decommission(DecommissionCmd::Preview { node_id })
        | AdminCmd::Doctor { node_id, .. }
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
    let mut c = Client::new(urls, token, args.timeout)
        .map_err(|e| Fail(EXIT_UNREACHABLE, e.to_string()))?;
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
        AdminCmd::Audit(cmd) => audit_cmd(&args, &mut c, cmd).await,
        AdminCmd::Doctor { node_id, wait } => doctor_cmd(&args, &mut c, node_id, *wait).await,
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
                            n.node_id.clone(),
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

/// `modelforge admin backup --out F`: download, check the checksum, write atomically.
async fn backup_cmd(args: &AdminArgs, c: &mut Client, out: &std::path::Path) -> Result<i32, Fail> {
    eprintln!("taking a backup from {} ...", c.urls().join(","));
    let bytes = c.download("/api/v1/admin/backup").await?;
    let (h, _) = crate::backup::decode(&bytes).map_err(|e| {
        Fail(
            EXIT_REFUSED,
            format!("the backup received does not check: {e}"),
        )
    })?;
    let tmp = out.with_extension("partial");
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
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

/// `modelforge admin smoke <node>`: start the smoke, wait for the agent's report.
async fn smoke_cmd(
    args: &AdminArgs,
    c: &mut Client,
    node_id: &str,
    wait: Duration,
) -> Result<i32, Fail> {
    let (started, _): (api::SmokeStarted, _) = c
        .write_typed(
            Method::POST,
            &format!("/api/v1/admin/hardware/nodes/{node_id}/smoke"),
            json!({}),
            None,
        )
        .await?;
    let smoke_id = started.smoke_id;
    let deadline = tokio::time::Instant::now() + wait;
    let (smoke, v) = loop {
        let (smoke, v): (api::SmokeView, _) = c
            .get_typed(&format!(
                "/api/v1/admin/hardware/nodes/{node_id}/smoke/{smoke_id}"
            ))
            .await?;
        if smoke.state == "passed" || smoke.state == "failed" {
            break (smoke, v);
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(Fail(
                EXIT_UNREACHABLE,
                format!(
                    "smoke {smoke_id} is still {} after {wait:?}: is the agent heartbeating?",
                    smoke.state
                ),
            ));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let passed = smoke.state == "passed";
    emit_or_quiet(args, &v, vec![smoke.state.clone()], || {
        let rows = smoke
            .checks
            .iter()
            .map(|c| {
                vec![
                    c.name.clone(),
                    if c.ok { "ok".into() } else { "FAILED".into() },
                    c.detail.clone(),
                ]
            })
            .collect();
        format!(
            "smoke {smoke_id} on {node_id}: {}\n{}",
            smoke.state,
            table(&["CHECK", "RESULT", "DETAIL"], rows)
        )
    });
    Ok(if passed { EXIT_OK } else { EXIT_REFUSED })
}

/// An optional text as table text: absent as "-".
fn opt(v: &Option<String>) -> String {
    v.clone().unwrap_or_else(|| "-".into())
}

/// A JSON value as table text: strings bare, null as "-".
fn s(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(x) => x.clone(),
        other => other.to_string(),
    }
}

fn arr(v: &Value) -> Vec<Value> {
    v.as_array().cloned().unwrap_or_default()
}

/// A plain text table: a header row and left-aligned, padded columns.
fn table(headers: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (i, cell) in r.iter().enumerate() {
            widths[i] = widths[i].max(cell.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let mut l = String::new();
        for (i, cell) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                l.push_str(cell);
            } else {
                l.push_str(&format!("{cell:<w$}  ", w = widths[i]));
            }
        }
        l.trim_end().to_string() + "\n"
    };
    let mut out = line(headers.iter().map(|h| h.to_string()).collect());
    for r in rows {
        out.push_str(&line(r));
    }
    out
}

/// Print `v` as JSON, or the human rendering.
fn emit(args: &AdminArgs, v: &Value, human: impl FnOnce() -> String) {
    let text = match args.output {
        Output::Json => serde_json::to_string_pretty(v).unwrap_or_default() + "\n",
        Output::Table => human(),
    };
    print!("{text}");
    let _ = std::io::stdout().flush();
}

/// `--quiet` prints the primary values only, whatever `--output` says.
fn emit_or_quiet(args: &AdminArgs, v: &Value, quiet: Vec<String>, human: impl FnOnce() -> String) {
    if args.quiet {
        for q in quiet {
            println!("{q}");
        }
    } else {
        emit(args, v, human);
    }
}

async fn enrollments(args: &AdminArgs, c: &mut Client, cmd: &EnrollmentCmd) -> Result<i32, Fail> {
    match cmd {
        EnrollmentCmd::Create { ttl, note } => {
            let mut body = json!({});
            if let Some(t) = ttl {
                if t.as_secs() == 0 {
                    return Err(usage("--ttl must be at least 1s"));
                }
                body["ttl_seconds"] = json!(t.as_secs());
            }
            if let Some(n) = note {
                body["note"] = json!(n);
            }
            let (issued, v): (api::TokenIssued, _) = c
                .write_typed(Method::POST, "/api/v1/admin/node-enrollments", body, None)
                .await?;
            emit_or_quiet(args, &v, vec![issued.token.clone()], || {
                format!(
                    "enrollment {} (expires {})\ntoken (shown once): {}\n",
                    issued.enrollment_id, issued.expires_at, issued.token
                )
            });
        }
        EnrollmentCmd::List => {
            let (list, v): (api::Enrollments, _) =
                c.get_typed("/api/v1/admin/node-enrollments").await?;
            let rows = list.enrollments;
            let ids = rows.iter().map(|r| r.enrollment_id.clone()).collect();
            emit_or_quiet(args, &v, ids, || {
                table(
                    &[
                        "ENROLLMENT",
                        "STATE",
                        "CREATED",
                        "EXPIRES",
                        "CLAIMED BY",
                        "NOTE",
                    ],
                    rows.iter()
                        .map(|r| {
                            vec![
                                r.enrollment_id.clone(),
                                r.state.clone(),
                                r.created_at.clone(),
                                r.expires_at.clone(),
                                opt(&r.claimed_node_id),
                                opt(&r.note),
                            ]
                        })
                        .collect(),
                )
            });
        }
        EnrollmentCmd::Cancel { enrollment_id } => {
            let v = c
                .write(
                    Method::DELETE,
                    &format!("/api/v1/admin/node-enrollments/{enrollment_id}"),
                    json!({}),
                    None,
                )
                .await?;
            emit_or_quiet(args, &v, vec![enrollment_id.clone()], || {
                format!("enrollment {enrollment_id} cancelled\n")
            });
        }
    }
    Ok(EXIT_OK)
}

fn node_rows(nodes: &[api::NodeSummary]) -> Vec<Vec<String>> {
    nodes
        .iter()
        .map(|n| {
            vec![
                n.node_id.clone(),
                n.hostname.clone(),
                n.status.clone(),
                n.enabled.to_string(),
                opt(&n.last_heartbeat_at),
                n.accelerators.len().to_string(),
                n.active_credentials.to_string(),
                n.hostname_conflicts.join(","),
            ]
        })
        .collect()
}

const NODE_HEADERS: [&str; 8] = [
    "NODE",
    "HOSTNAME",
    "STATUS",
    "ENABLED",
    "LAST HEARTBEAT",
    "GPUS",
    "ACTIVE CREDS",
    "HOSTNAME CONFLICTS",
];

async fn nodes(args: &AdminArgs, c: &mut Client, cmd: &NodeCmd) -> Result<i32, Fail> {
    match cmd {
        NodeCmd::List { hostname, enabled } => {
            let mut q = vec![];
            if let Some(h) = hostname {
                if !modelforge_proto::valid_hostname(h) {
                    return Err(usage("--hostname is not a valid hostname"));
                }
                q.push(format!("hostname={h}"));
            }
            if let Some(e) = enabled {
                q.push(format!("enabled={e}"));
            }
            let path = if q.is_empty() {
                "/api/v1/admin/hardware/nodes".to_string()
            } else {
                format!("/api/v1/admin/hardware/nodes?{}", q.join("&"))
            };
            let (list, v): (api::Nodes, _) = c.get_typed(&path).await?;
            let ids = list.nodes.iter().map(|n| n.node_id.clone()).collect();
            emit_or_quiet(args, &v, ids, || {
                table(&NODE_HEADERS, node_rows(&list.nodes))
            });
        }
        NodeCmd::Show { node_id } => {
            let v = c
                .get(&format!("/api/v1/admin/hardware/nodes/{node_id}"))
                .await?;
            emit_or_quiet(args, &v, vec![node_id.clone()], || {
                let mut out = String::new();
                for k in [
                    "node_id",
                    "hostname",
                    "status",
                    "enabled",
                    "last_heartbeat_at",
                    "last_refusal",
                    "active_credentials",
                    "hostname_conflicts",
                    "accelerators_verified",
                    "view_rebuilt_at",
                    "enrolled_at",
                    "decommissioned_at",
                ] {
                    out.push_str(&format!("{k:<22} {}\n", s(&v[k])));
                }
                let gpus: Vec<String> = arr(&v["accelerators"])
                    .iter()
                    .map(|a| format!("{} ({})", s(&a["uuid"]), s(&a["name"])))
                    .collect();
                out.push_str(&format!("{:<22} {}\n", "accelerators", gpus.join(", ")));
                out.push_str("history:\n");
                let rows = arr(&v["history"])
                    .iter()
                    .map(|e| vec![s(&e["at"]), s(&e["kind"]), s(&e["detail"]), s(&e["count"])])
                    .collect();
                out.push_str(&table(&["AT", "EVENT", "DETAIL", "COUNT"], rows));
                out
            });
        }
        NodeCmd::Credentials { node_id } => {
            let (list, v): (api::Credentials, _) = c
                .get_typed(&format!(
                    "/api/v1/admin/hardware/nodes/{node_id}/credentials"
                ))
                .await?;
            let creds = &list.credentials;
            let active = creds
                .iter()
                .filter(|c| c.revoked_at.is_none())
                .map(|c| c.credential_id.clone())
                .collect();
            emit_or_quiet(args, &v, active, || {
                let mut out = format!(
                    "node {node_id}: {} active, {} revoked\n",
                    list.active, list.revoked
                );
                out.push_str(&table(
                    &["CREDENTIAL", "CREATED", "LAST USED", "REVOKED", "REASON"],
                    creds
                        .iter()
                        .map(|c| {
                            vec![
                                c.credential_id.clone(),
                                c.created_at.clone(),
                                opt(&c.last_used_at),
                                opt(&c.revoked_at),
                                opt(&c.revoked_reason),
                            ]
                        })
                        .collect(),
                ));
                out
            });
        }
        NodeCmd::RevokeCredential { node_id, reason } => {
            let body = match reason {
                Some(r) => json!({"reason": r}),
                None => json!({}),
            };
            let (answer, v): (api::Revoked, _) = c
                .write_typed(
                    Method::DELETE,
                    &format!("/api/v1/admin/hardware/nodes/{node_id}/credential"),
                    body,
                    None,
                )
                .await?;
            let revoked = answer.revoked;
            emit_or_quiet(args, &v, revoked.clone(), || {
                if revoked.is_empty() {
                    format!("node {node_id}: no active credential to revoke\n")
                } else {
                    format!("node {node_id}: revoked {}\n", revoked.join(", "))
                }
            });
        }
    }
    Ok(EXIT_OK)
}

fn list_text(items: &[String]) -> String {
    if items.is_empty() {
        "none".into()
    } else {
        items.join(", ")
    }
}

async fn decommission(
    args: &AdminArgs,
    c: &mut Client,
    cmd: &DecommissionCmd,
) -> Result<i32, Fail> {
    match cmd {
        DecommissionCmd::Preview { node_id } => {
            let (p, v): (api::DecommissionPreviewView, _) = c
                .write_typed(
                    Method::POST,
                    &format!("/api/v1/admin/hardware/nodes/{node_id}/decommission/preview"),
                    json!({}),
                    None,
                )
                .await?;
            emit_or_quiet(args, &v, vec![p.preview_id.clone()], || {
                let e = &p.effects;
                format!(
                    "preview {} of decommissioning node {} ({}), valid until {}:\n  \
                     disable the node (it stays, with its history, status decommissioned)\n  \
                     ban identity {} from enrolling again\n  \
                     revoke credentials: {}\n  \
                     resolve hostname conflicts with: {}\n  \
                     spend enrolment claims: {}\n  \
                     release allocations: {}\n  \
                     accelerators leaving service: {}\n\
                     execute with: modelforge admin decommission execute {} --preview-id {} --reason \"<why>\"\n",
                    p.preview_id,
                    e.node_id,
                    e.hostname,
                    p.expires_at,
                    e.ban_identity,
                    list_text(&e.credentials_to_revoke),
                    list_text(&e.hostname_conflicts_resolved),
                    list_text(&e.claims_to_spend),
                    list_text(&e.allocations_to_release),
                    list_text(&e.accelerators_leaving_service),
                    node_id,
                    p.preview_id,
                )
            });
        }
        DecommissionCmd::Execute {
            node_id,
            preview_id,
            reason,
            yes,
        } => {
            if !yes {
                if !std::io::stdin().is_terminal() {
                    return Err(usage(
                        "decommission execute asks for confirmation on a terminal; stdin is not one: pass --yes",
                    ));
                }
                eprint!(
                    "Decommission node {node_id} with preview {preview_id} (reason: {reason})? \
                     Its credentials are revoked and its identity can never enrol again. Type 'yes': "
                );
                let mut answer = String::new();
                let _ = std::io::stdin().read_line(&mut answer);
                if answer.trim() != "yes" {
                    return Err(Fail(EXIT_DECLINED, "not confirmed; nothing changed".into()));
                }
            }
            // The key is the preview's: a retry (even from another invocation) gets the first answer.
            let key = format!("decommission-{preview_id}");
            let (d, v): (api::Decommissioned, _) = c
                .write_typed(
                    Method::POST,
                    &format!("/api/v1/admin/hardware/nodes/{node_id}/decommission/execute"),
                    json!({"preview_id": preview_id, "reason": reason}),
                    Some(&key),
                )
                .await?;
            emit_or_quiet(args, &v, vec![node_id.clone()], || {
                format!(
                    "node {} decommissioned at {}; revoked: {}; hostname conflicts resolved: {}; \
                     allocations released: {}\n",
                    d.node_id,
                    d.decommissioned_at,
                    list_text(&d.revoked),
                    list_text(&d.hostname_conflicts_resolved),
                    list_text(&d.allocations_released),
                )
            });
        }
    }
    Ok(EXIT_OK)
}

fn verify_and_report(
    args: &AdminArgs,
    events: &[Value],
    expect_head: Option<&str>,
    server_says: Option<bool>,
) -> Result<i32, Fail> {
    match audit::verify_events(events) {
        Ok(v) => {
            let (seq, hash) = v.head.clone().unwrap_or((0, "0".repeat(64)));
            if let Some(want) = expect_head
                && want != hash
            {
                return Err(Fail(
                    EXIT_AUDIT_BROKEN,
                    format!(
                        "the chain verifies but ends at seq {seq} with head {hash}, not the expected {want}: events were cut from the end or added"
                    ),
                ));
            }
            let out = json!({"verified": true, "events": v.events, "head_seq": seq, "head_hash": hash, "server_chain_verified": server_says});
            emit_or_quiet(args, &out, vec![hash.clone()], || {
                format!(
                    "audit chain verified here: {} events, head seq {seq} hash {hash}\n",
                    v.events
                )
            });
            if server_says == Some(false) {
                return Err(Fail(
                    EXIT_AUDIT_BROKEN,
                    "the events verify here but the server reports its chain broken".into(),
                ));
            }
            Ok(EXIT_OK)
        }
        Err(b) => Err(Fail(
            EXIT_AUDIT_BROKEN,
            format!(
                "audit chain broken at event {} (seq {}): {}",
                b.position,
                b.seq.map_or("?".into(), |s| s.to_string()),
                b.reason
            ),
        )),
    }
}

async fn audit_cmd(args: &AdminArgs, c: &mut Client, cmd: &AuditCmd) -> Result<i32, Fail> {
    match cmd {
        AuditCmd::List {
            node_id,
            since,
            limit,
        } => {
            let mut q = vec![];
            if let Some(n) = node_id {
                q.push(format!("node_id={n}"));
            }
            if let Some(t) = since {
                let utc = since_utc(t).ok_or_else(|| {
                    usage("--since must be an RFC 3339 time, e.g. 2026-12-02T10:00:00Z")
                })?;
                q.push(format!("since={utc}"));
            }
            if let Some(l) = limit {
                q.push(format!("limit={l}"));
            }
            let path = format!("/api/v1/admin/audit?{}", q.join("&"));
            let (page, v): (api::AuditPage, _) = c.get_typed(&path).await?;
            let events = &page.events;
            let seqs = events.iter().map(|e| e.record.seq.to_string()).collect();
            emit_or_quiet(args, &v, seqs, || {
                let mut out = table(
                    &[
                        "SEQ", "AT", "ACTOR", "ACTION", "TARGET", "RESULT", "REQUEST",
                    ],
                    events
                        .iter()
                        .map(|e| {
                            vec![
                                e.record.seq.to_string(),
                                e.at.clone(),
                                e.record.actor.clone(),
                                e.record.action.clone(),
                                e.record.target.clone(),
                                e.record.result.clone(),
                                e.record.request_id.clone(),
                            ]
                        })
                        .collect(),
                );
                out.push_str(&format!(
                    "server reports chain verified: {}\n",
                    page.chain_verified
                ));
                out
            });
            Ok(EXIT_OK)
        }
        AuditCmd::Export { out } => {
            let v = c.get("/api/v1/admin/audit").await?;
            let events = arr(&v["events"]);
            let head = events.last().map(|e| (s(&e["seq"]), s(&e["hash"])));
            let doc = json!({
                "format": audit::EXPORT_FORMAT,
                "exported_at": modelforge_proto::rfc3339_ms(modelforge_proto::now_ms()),
                "server": c.urls(),
                "server_chain_verified": v["chain_verified"],
                "events": events,
            });
            let text = serde_json::to_string_pretty(&doc).unwrap_or_default() + "\n";
            if out.as_os_str() == "-" {
                print!("{text}");
            } else {
                std::fs::write(out, text)
                    .map_err(|e| usage(format!("write {}: {e}", out.display())))?;
                let (seq, hash) = head.unwrap_or(("0".into(), "0".repeat(64)));
                eprintln!(
                    "exported {} events to {} (head seq {seq} hash {hash})",
                    events.len(),
                    out.display()
                );
            }
            Ok(EXIT_OK)
        }
        AuditCmd::Verify { expect_head, .. } => {
            let v = c.get("/api/v1/admin/audit").await?;
            verify_and_report(
                args,
                &arr(&v["events"]),
                expect_head.as_deref(),
                v["chain_verified"].as_bool(),
            )
        }
    }
}

/// An RFC 3339 time (with `Z` or a `±HH:MM` offset) as UTC with `Z`, which the server takes.
fn since_utc(t: &str) -> Option<String> {
    let t = t.trim();
    let (local, offset_s) = match t
        .len()
        .checked_sub(6)
        .filter(|i| t.is_char_boundary(*i))
        .map(|i| t.split_at(i))
    {
        Some((local, off))
            if (off.starts_with('+') || off.starts_with('-')) && off.as_bytes()[3] == b':' =>
        {
            let h: i64 = off[1..3].parse().ok()?;
            let m: i64 = off[4..6].parse().ok()?;
            let sign = if off.starts_with('-') { -1 } else { 1 };
            (local, sign * (h * 3600 + m * 60))
        }
        _ => (t, 0),
    };
    let at = humantime::parse_rfc3339_weak(local).ok()?;
    let at = if offset_s >= 0 {
        at.checked_sub(Duration::from_secs(offset_s as u64))?
    } else {
        at.checked_add(Duration::from_secs((-offset_s) as u64))?
    };
    Some(humantime::format_rfc3339_millis(at).to_string())
}

async fn doctor_cmd(
    args: &AdminArgs,
    c: &mut Client,
    node_id: &str,
    wait: Option<Duration>,
) -> Result<i32, Fail> {
    let deadline = wait.map(|w| tokio::time::Instant::now() + w);
    loop {
        let (node, _): (api::NodeDetail, _) = c
            .get_typed(&format!("/api/v1/admin/hardware/nodes/{node_id}"))
            .await?;
        let (creds, _): (api::Credentials, _) = c
            .get_typed(&format!(
                "/api/v1/admin/hardware/nodes/{node_id}/credentials"
            ))
            .await?;
        let facts = doctor::Facts::from_api(&node, &creds);
        let verdict = doctor::diagnose(&facts);
        let waiting = deadline.is_some_and(|d| tokio::time::Instant::now() < d);
        if verdict == doctor::Verdict::Healthy || !waiting {
            let v = doctor::report_json(&facts, verdict);
            emit_or_quiet(args, &v, vec![verdict.name().to_string()], || {
                doctor::report_text(&facts, verdict)
            });
            return Ok(verdict.exit_code());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::since_utc;

    #[test]
    fn since_takes_utc_and_offsets() {
        assert_eq!(
            since_utc("2026-12-02T10:00:00Z").as_deref(),
            Some("2026-12-02T10:00:00.000Z")
        );
        assert_eq!(
            since_utc("2026-12-02T11:30:00+01:30").as_deref(),
            Some("2026-12-02T10:00:00.000Z")
        );
        assert_eq!(
            since_utc("2026-12-02T08:00:00-02:00").as_deref(),
            Some("2026-12-02T10:00:00.000Z")
        );
        assert_eq!(since_utc("yesterday"), None);
        assert_eq!(since_utc("2026-12-02T10:00:0ééé"), None);
    }
}
