//! `modelforge admin nodes ...` and `smoke`: node views, credentials, revocation, the capability
//! smoke.

use std::time::Duration;

use modelforge_proto::api;
use modelforge_proto::ids::SmokeState;
use reqwest::Method;

use super::AdminArgs;
use super::EXIT_OK;
use super::EXIT_REFUSED;
use super::EXIT_UNREACHABLE;
use super::Fail;
use super::NodeCmd;
use super::client::Client;
use super::output::ago;
use super::output::confirm;
use super::output::emit_or_quiet;
use super::output::list_text;
use super::output::opt;
use super::output::table;
use super::output::table_wide;
use super::usage;

/// `modelforge admin smoke <node>`: start the smoke, wait for the agent's report.
pub(super) async fn smoke_cmd(
    args: &AdminArgs,
    c: &mut Client,
    node_id: &str,
    wait: Duration,
) -> Result<i32, Fail> {
    let (started, _): (api::SmokeStarted, _) = c
        .write_typed(
            Method::POST,
            &format!("/api/v1/admin/hardware/nodes/{node_id}/smoke"),
            &api::EmptyRequest {},
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
    let passed = smoke.state == SmokeState::Passed;
    emit_or_quiet(args, &v, vec![smoke.state.to_string()], || {
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

/// The node table (`-o wide` adds the GPU models, driver, CUDA, NVML and enrolment time).
pub(super) fn nodes_table(args: &AdminArgs, nodes: &[api::NodeSummary]) -> String {
    let rows = nodes
        .iter()
        .map(|n| {
            let mut models: Vec<&str> = n
                .accelerators
                .iter()
                .map(|a| a.accelerator.name.as_str())
                .collect();
            models.dedup();
            (
                vec![
                    n.node_id.to_string(),
                    n.hostname.clone(),
                    n.status.to_string(),
                    n.enabled.to_string(),
                    ago(args, &n.last_heartbeat_at),
                    n.accelerators.len().to_string(),
                    n.active_credentials.to_string(),
                    n.hostname_conflicts.join(","),
                ],
                vec![
                    models.join(","),
                    opt(&n.driver_version),
                    opt(&n.cuda_version),
                    opt(&n.nvml),
                    n.enrolled_at.clone(),
                ],
            )
        })
        .collect();
    table_wide(
        args,
        &NODE_HEADERS,
        &["GPU MODELS", "DRIVER", "CUDA", "NVML", "ENROLLED"],
        rows,
    )
}

pub(super) const NODE_HEADERS: [&str; 8] = [
    "NODE",
    "HOSTNAME",
    "STATUS",
    "ENABLED",
    "LAST HEARTBEAT",
    "GPUS",
    "ACTIVE CREDS",
    "HOSTNAME CONFLICTS",
];

pub(super) async fn nodes(args: &AdminArgs, c: &mut Client, cmd: &NodeCmd) -> Result<i32, Fail> {
    match cmd {
        NodeCmd::List {
            hostname,
            enabled,
            watch,
        } => {
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
            if *watch {
                return watch_view(args, c, &path, async |c: &mut Client| {
                    let (list, v): (api::Nodes, _) = c.get_all_typed(&path, "nodes", None).await?;
                    Ok((v, nodes_table(args, &list.nodes)))
                })
                .await;
            }
            let (list, v): (api::Nodes, _) = c.get_all_typed(&path, "nodes", None).await?;
            let ids = list.nodes.iter().map(|n| n.node_id.to_string()).collect();
            emit_or_quiet(args, &v, ids, || nodes_table(args, &list.nodes));
        }
        NodeCmd::Show { node_id, watch } => {
            let path = format!("/api/v1/admin/hardware/nodes/{node_id}");
            if *watch {
                return watch_view(args, c, &path, async |c: &mut Client| {
                    let (d, v): (api::NodeDetail, _) = c.get_typed(&path).await?;
                    Ok((v, node_text(&d)))
                })
                .await;
            }
            let (d, v): (api::NodeDetail, _) = c.get_typed(&path).await?;
            emit_or_quiet(args, &v, vec![node_id.clone()], || node_text(&d));
        }
        NodeCmd::Credentials { node_id } => {
            let (list, v): (api::Credentials, _) = c
                .get_all_typed(
                    &format!("/api/v1/admin/hardware/nodes/{node_id}/credentials"),
                    "credentials",
                    None,
                )
                .await?;
            let creds = &list.credentials;
            let active = creds
                .iter()
                .filter(|c| c.revoked_at.is_none())
                .map(|c| c.credential_id.to_string())
                .collect();
            emit_or_quiet(args, &v, active, || {
                let mut out = format!(
                    "node {node_id}: {} active, {} revoked\n",
                    list.active, list.revoked
                );
                out.push_str(&table_wide(
                    args,
                    &["CREDENTIAL", "CREATED", "LAST USED", "REVOKED", "REASON"],
                    &["ENROLMENT"],
                    creds
                        .iter()
                        .map(|c| {
                            (
                                vec![
                                    c.credential_id.to_string(),
                                    c.created_at.clone(),
                                    ago(args, &c.last_used_at),
                                    opt(&c.revoked_at),
                                    opt(&c.revoked_reason),
                                ],
                                vec![opt(&c.enrollment_id)],
                            )
                        })
                        .collect(),
                ));
                out
            });
        }
        NodeCmd::RevokeCredential {
            node_id,
            reason,
            yes,
        } => {
            confirm(
                &format!(
                    "Revoke every active credential of node {node_id} (reason: {reason})? Its agent \
                     is refused from then on and must enrol again with a new token."
                ),
                *yes,
            )?;
            let body = api::RevokeRequest {
                reason: Some(reason.clone()),
            };
            let (answer, v): (api::Revoked, _) = c
                .write_typed(
                    Method::DELETE,
                    &format!("/api/v1/admin/hardware/nodes/{node_id}/credential"),
                    &body,
                    None,
                )
                .await?;
            let revoked = answer.revoked;
            let ids = revoked.iter().map(ToString::to_string).collect();
            emit_or_quiet(args, &v, ids, || {
                if revoked.is_empty() {
                    format!("node {node_id}: no active credential to revoke\n")
                } else {
                    format!("node {node_id}: revoked {}\n", list_text(&revoked))
                }
            });
        }
        NodeCmd::Cordon { node_id, reason }
        | NodeCmd::Uncordon { node_id, reason }
        | NodeCmd::Drain { node_id, reason }
        | NodeCmd::UncordonGpu {
            node_id, reason, ..
        } => {
            let (path, done) = match cmd {
                NodeCmd::Cordon { .. } => (format!("{node_id}/cordon"), "cordoned"),
                NodeCmd::Uncordon { .. } => (format!("{node_id}/uncordon"), "uncordoned"),
                NodeCmd::Drain { .. } => (format!("{node_id}/drain"), "drained"),
                NodeCmd::UncordonGpu { uuid, .. } => (
                    format!("{node_id}/accelerators/{uuid}/uncordon"),
                    "GPU uncordoned",
                ),
                _ => unreachable!("matched above"),
            };
            let body = api::CordonRequest {
                reason: reason.clone(),
            };
            let (n, v): (api::NodeSummary, _) = c
                .write_typed(
                    Method::POST,
                    &format!("/api/v1/admin/hardware/nodes/{path}"),
                    &body,
                    None,
                )
                .await?;
            emit_or_quiet(args, &v, vec![n.node_id.to_string()], || {
                let gpus = n.accelerators.iter().filter(|a| a.cordoned).count();
                format!(
                    "node {}: {done}; cordoned: {}; health: {}; cordoned GPUs: {gpus}\n",
                    n.node_id,
                    n.cordoned,
                    n.health.as_str()
                )
            });
        }
    }
    Ok(EXIT_OK)
}

/// A node's detail as text.
fn node_text(d: &api::NodeDetail) -> String {
    let n = &d.summary;
    let refusal = d
        .last_refusal
        .as_ref()
        .map(|r| format!("{} at {}", r.status, r.at));
    let fields = [
        ("node_id", n.node_id.to_string()),
        ("hostname", n.hostname.clone()),
        ("status", n.status.to_string()),
        ("enabled", n.enabled.to_string()),
        ("last_heartbeat_at", opt(&n.last_heartbeat_at)),
        ("last_refusal", opt(&refusal)),
        ("active_credentials", n.active_credentials.to_string()),
        ("hostname_conflicts", list_text(&n.hostname_conflicts)),
        ("accelerators_verified", n.accelerators_verified.to_string()),
        ("view_rebuilt_at", n.view_rebuilt_at.clone()),
        ("enrolled_at", n.enrolled_at.clone()),
        ("decommissioned_at", opt(&n.decommissioned_at)),
    ];
    let mut out = String::new();
    for (k, value) in fields {
        out.push_str(&format!("{k:<22} {value}\n"));
    }
    let gpus: Vec<String> = n
        .accelerators
        .iter()
        .map(|a| {
            let h = match a.health {
                modelforge_proto::gpu_health::Health::Healthy => String::new(),
                h => format!(" {}", h.as_str()),
            };
            let c = if a.cordoned { " cordoned" } else { "" };
            format!("{} ({}){h}{c}", a.accelerator.uuid, a.accelerator.name)
        })
        .collect();
    out.push_str(&format!("{:<22} {}\n", "accelerators", gpus.join(", ")));
    out.push_str("history:\n");
    let rows = d
        .history
        .iter()
        .map(|e| {
            vec![
                e.at.clone(),
                e.kind.to_string(),
                e.detail.clone(),
                e.count.to_string(),
            ]
        })
        .collect();
    out.push_str(&table(&["AT", "EVENT", "DETAIL", "COUNT"], rows));
    out
}

/// `--watch`: print the view, then again each time its index moves (a blocking query), until
/// interrupted. JSON is one compact document a line; a table redraws the terminal (or, when
/// stdout is not a terminal, follows a `# index N` line). An error is reported and the watch
/// starts over from index 0 a second later (a leader change, a member restarting).
async fn watch_view(
    args: &AdminArgs,
    c: &mut Client,
    path: &str,
    mut render: impl AsyncFnMut(&mut Client) -> Result<(serde_json::Value, String), Fail>,
) -> Result<i32, Fail> {
    use std::io::IsTerminal;
    use std::io::Write;
    let tty = std::io::stdout().is_terminal();
    let mut index = 0;
    loop {
        let shown = match c.wait_change(path, index).await {
            Ok(now) => {
                index = now;
                render(c).await
            }
            Err(e) => Err(e.into()),
        };
        match shown {
            Ok((v, text)) => {
                let out = match args.output {
                    super::Output::Json => serde_json::to_string(&v).unwrap_or_default() + "\n",
                    super::Output::Yaml => format!("---\n{}", super::output::yaml(&v)),
                    super::Output::Table | super::Output::Wide if tty => {
                        format!("\x1b[H\x1b[2J{}", super::output::printable(&text))
                    }
                    super::Output::Table | super::Output::Wide => {
                        format!("# index {index}\n{}", super::output::printable(&text))
                    }
                };
                print!("{out}");
                let _ = std::io::stdout().flush();
            }
            Err(e) => {
                eprintln!("watch: {}; trying again", super::output::printable(&e.1));
                index = 0;
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}
