//! `modelforge admin doctor <node>`: the runbook's Diagnose step for one node, decided by a
//! plain function over what the API shows ([`diagnose`]), so every verdict is unit-tested.

use std::time::Duration;

use modelforge_proto::api;
use modelforge_proto::gpu_health;
use modelforge_proto::gpu_health::Health;
use modelforge_proto::ids::NodeId;
use modelforge_proto::ids::NodeStatus;
use modelforge_proto::wire::Telemetry;
use serde_json::Value;
use serde_json::json;

use super::AdminArgs;
use super::Fail;
use super::client::Client;
use super::output::emit_or_quiet;

/// What the doctor decided. The exit code is documented in README.md and the runbook.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Healthy,
    CredentialRevoked,
    CredentialForOtherNode,
    AgentSilent,
    HostnameConflict,
    Decommissioned,
    /// Heartbeats go on, but a GPU reports an event that makes it `failed`.
    GpuFailed,
    /// The node went silent after one of its GPUs reported Xid 79 (fallen off the bus).
    GpuFellOffBus,
    /// Heartbeats go on, but they carry no GPU telemetry for a node that has GPUs (NVML hung
    /// or gone).
    TelemetryStopped,
}

impl Verdict {
    pub fn name(self) -> &'static str {
        match self {
            Verdict::Healthy => "healthy",
            Verdict::CredentialRevoked => "credential_revoked",
            Verdict::CredentialForOtherNode => "credential_for_other_node",
            Verdict::AgentSilent => "agent_silent",
            Verdict::HostnameConflict => "hostname_conflict",
            Verdict::Decommissioned => "decommissioned",
            Verdict::GpuFailed => "gpu_failed",
            Verdict::GpuFellOffBus => "gpu_fell_off_bus",
            Verdict::TelemetryStopped => "telemetry_stopped",
        }
    }

    pub fn exit_code(self) -> i32 {
        match self {
            Verdict::Healthy => 0,
            Verdict::CredentialRevoked => 10,
            Verdict::CredentialForOtherNode => 11,
            Verdict::AgentSilent => 12,
            Verdict::HostnameConflict => 13,
            Verdict::Decommissioned => 14,
            Verdict::GpuFailed => 15,
            Verdict::GpuFellOffBus => 16,
            Verdict::TelemetryStopped => 17,
        }
    }
}

/// The last refused agent request naming the node.
#[derive(Clone, Debug)]
pub struct SeenRefusal {
    pub status: u16,
    pub code: String,
    pub at: String,
    pub at_ms: i64,
    pub credential_of_this_node: bool,
}

/// The facts the verdict rests on, read from the node view and its credentials.
#[derive(Clone, Debug)]
pub struct Facts {
    pub node_id: NodeId,
    pub hostname: String,
    pub status: NodeStatus,
    pub decommissioned_at: Option<String>,
    pub last_heartbeat_at: Option<String>,
    pub last_heartbeat_ms: Option<i64>,
    pub last_refusal: Option<SeenRefusal>,
    pub active: u64,
    pub revoked: u64,
    pub active_last_used_at: Option<String>,
    pub hostname_conflicts: Vec<NodeId>,
    pub accelerators: usize,
    pub accelerators_verified: bool,
    pub view_rebuilt_at: Option<String>,
    /// Each GPU of the latest telemetry whose events make it other than healthy.
    pub unhealthy_gpus: Vec<GpuVerdict>,
    /// How many GPUs the latest telemetry reported (None: no telemetry).
    pub telemetry_gpus: Option<usize>,
}

/// A GPU whose reported events make it degraded or failed.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuVerdict {
    pub uuid: String,
    pub health: Health,
    /// The worst event, in words (`xid 79`).
    pub cause: String,
    /// Whether Xid 79 (fallen off the bus) is among its events.
    pub off_bus: bool,
}

fn ms(t: &str) -> Option<i64> {
    super::output::parse_time(t).map(jiff::Timestamp::as_millisecond)
}

/// The GPUs of the latest telemetry that are not healthy, and how many it reported.
fn gpu_facts(telemetry: &Value) -> (Vec<GpuVerdict>, Option<usize>) {
    if telemetry.is_null() {
        return (vec![], None);
    }
    let Ok(t) = serde_json::from_value::<Telemetry>(telemetry.clone()) else {
        return (vec![], None);
    };
    let unhealthy = t
        .accelerators
        .iter()
        .filter_map(|a| {
            let (health, cause) = gpu_health::worst(&a.events);
            (health != Health::Healthy).then(|| GpuVerdict {
                uuid: a.uuid.clone().unwrap_or_else(|| "?".into()),
                health,
                cause: cause.unwrap_or_default(),
                off_bus: a
                    .events
                    .iter()
                    .any(|e| e.kind == gpu_health::EventKind::Xid && e.code == Some(79)),
            })
        })
        .collect();
    (unhealthy, Some(t.accelerators.len()))
}

impl Facts {
    /// From `GET .../nodes/{id}` and `GET .../nodes/{id}/credentials`.
    pub fn from_api(node: &api::NodeDetail, creds: &api::Credentials) -> Self {
        let n = &node.summary;
        let (unhealthy_gpus, telemetry_gpus) = gpu_facts(&node.telemetry);
        let active_last_used_at = creds
            .credentials
            .iter()
            .filter(|c| c.revoked_at.is_none())
            .filter_map(|c| c.last_used_at.clone())
            .max();
        Facts {
            node_id: n.node_id.clone(),
            hostname: n.hostname.clone(),
            status: n.status,
            decommissioned_at: n.decommissioned_at.clone(),
            last_heartbeat_at: n.last_heartbeat_at.clone(),
            last_heartbeat_ms: n.last_heartbeat_at.as_deref().and_then(ms),
            last_refusal: node.last_refusal.as_ref().map(|r| SeenRefusal {
                status: r.status,
                code: r.code.clone(),
                at: r.at.clone(),
                at_ms: ms(&r.at).unwrap_or(0),
                credential_of_this_node: r.credential_of_this_node,
            }),
            active: creds.active as u64,
            revoked: creds.revoked as u64,
            active_last_used_at,
            hostname_conflicts: n.hostname_conflicts.clone(),
            accelerators: n.accelerators.len(),
            accelerators_verified: n.accelerators_verified,
            view_rebuilt_at: Some(n.view_rebuilt_at.clone()),
            unhealthy_gpus,
            telemetry_gpus,
        }
    }
}

/// The runbook case for `f`, in the runbook's order of precedence.
pub fn diagnose(f: &Facts) -> Verdict {
    if f.status == NodeStatus::Decommissioned || f.decommissioned_at.is_some() {
        return Verdict::Decommissioned;
    }
    // Anyone can make a node's requests be refused, so a refusal is evidence only where it
    // could not be forged. "Revoked" comes from the replicated state alone: no active
    // credential. "Another node's credential" needs a 403 `credential_for_other_node`, which
    // is answered only once the presented secret verified, newer than the last accepted
    // heartbeat, on a node that is not online: a healthy node's verdict never changes.
    if let Some(r) = &f.last_refusal
        && r.status == 403
        && r.code == "credential_for_other_node"
        && f.status != NodeStatus::Online
        && f.last_heartbeat_ms.is_none_or(|hb| r.at_ms > hb)
    {
        return Verdict::CredentialForOtherNode;
    }
    if f.active == 0 {
        return Verdict::CredentialRevoked;
    }
    if f.status != NodeStatus::Online {
        // Silent: the last thing it said may be why.
        if f.unhealthy_gpus.iter().any(|g| g.off_bus) {
            return Verdict::GpuFellOffBus;
        }
        return Verdict::AgentSilent;
    }
    if f.unhealthy_gpus.iter().any(|g| g.health == Health::Failed) {
        return Verdict::GpuFailed;
    }
    if f.accelerators > 0 && f.telemetry_gpus == Some(0) {
        return Verdict::TelemetryStopped;
    }
    if !f.hostname_conflicts.is_empty() {
        return Verdict::HostnameConflict;
    }
    Verdict::Healthy
}

/// The runbook case a verdict points to, and the exact commands (node id filled in).
pub fn advice(f: &Facts, v: Verdict) -> (String, Vec<String>) {
    let id = &f.node_id;
    let reenrol = vec![
        format!("TOKEN=$(modelforge admin enrollments create --note \"recover node {id}\" -q)"),
        "# on the node (keep identity.json; the agent re-enrols onto the same node id):".into(),
        "MODELFORGE_ENROLLMENT_TOKEN=\"$TOKEN\" modelforge-agent --state-dir \"$AGENT_STATE_DIR\""
            .into(),
        format!("modelforge admin doctor {id} --wait 60s"),
    ];
    match v {
        Verdict::Healthy => (
            "The node still has its credential: nothing to do (RUNBOOK_NODE_RECOVERY.md, case 1)."
                .into(),
            vec![],
        ),
        Verdict::CredentialRevoked => {
            let mut cmds = vec![
                "# If the credential is believed stolen and still active, revoke it first:".into(),
                format!(
                    "modelforge admin nodes revoke-credential {id} --reason \"believed stolen\""
                ),
            ];
            cmds.extend(reenrol);
            (
                "The node has no active credential (revoked): its agent's heartbeats get 401. Re-enrol with a fresh token (RUNBOOK_NODE_RECOVERY.md, cases 2 and 3)."
                    .into(),
                cmds,
            )
        }
        Verdict::CredentialForOtherNode => {
            let mut cmds = vec![
                format!("modelforge admin nodes list --hostname {}", f.hostname),
                "# on the node: stop the agent; identity.json names this node but its credential is another node's".into(),
                "rm \"$AGENT_STATE_DIR/credential\"".into(),
            ];
            cmds.extend(reenrol);
            (
                format!(
                    "Heartbeats get 403: a valid credential of another node is presented for {id} (a copied or mixed-up state dir). Treat that credential as stolen (revoke it on its own node), then re-enrol this node (RUNBOOK_NODE_RECOVERY.md, Diagnose, 403)."
                ),
                cmds,
            )
        }
        Verdict::AgentSilent => {
            let mut cmds = vec![
                "# on the node: is the agent running, and does it reach a member?".into(),
                "curl -s \"$MODELFORGE_URL/healthz\"".into(),
                "modelforge-agent --state-dir \"$AGENT_STATE_DIR\"".into(),
                format!("modelforge admin doctor {id} --wait 60s"),
            ];
            for other in &f.hostname_conflicts {
                cmds.push(format!(
                    "# {other} also claims {}: if this node's identity file was lost, decommission this node:",
                    f.hostname
                ));
                cmds.push(format!("modelforge admin decommission preview {id}"));
            }
            (
                "No requests at all: the agent is down or cannot reach the control plane (RUNBOOK_NODE_RECOVERY.md, Diagnose, no requests)."
                    .into(),
                cmds,
            )
        }
        Verdict::HostnameConflict => {
            let mut cmds = vec![format!(
                "modelforge admin nodes list --hostname {} --enabled true",
                f.hostname
            )];
            for other in &f.hostname_conflicts {
                cmds.push(format!(
                    "PREVIEW_ID=$(modelforge admin decommission preview {other} -q)"
                ));
                cmds.push(format!(
                    "modelforge admin decommission execute {other} --preview-id \"$PREVIEW_ID\" --reason \"identity lost; superseded by {id}\""
                ));
            }
            (
                format!(
                    "Another enabled node claims hostname {}: the identity file was lost and the hardware enrolled again. If the old identity is superseded, decommission it (RUNBOOK_NODE_RECOVERY.md, case 4; RUNBOOK_NODE_DECOMMISSION.md).",
                    f.hostname
                ),
                cmds,
            )
        }
        Verdict::GpuFailed => {
            let failed: Vec<&GpuVerdict> = f
                .unhealthy_gpus
                .iter()
                .filter(|g| g.health == Health::Failed)
                .collect();
            let mut cmds = vec![format!("modelforge admin nodes show {id} -o wide")];
            for g in &failed {
                cmds.push(format!(
                    "# on the node, once GPU {} runs nothing: nvidia-smi -q -i {}; nvidia-smi --gpu-reset -i {}",
                    g.uuid, g.uuid, g.uuid
                ));
            }
            cmds.push(format!("modelforge admin doctor {id}"));
            (
                format!(
                    "The node heartbeats, but {} reported an event that fails it ({}): take its work elsewhere, reset it, and replace it if it recurs (docs/gpu-health.md).",
                    failed.iter().map(|g| format!("GPU {}", g.uuid)).collect::<Vec<_>>().join(", "),
                    failed.iter().map(|g| g.cause.as_str()).collect::<Vec<_>>().join(", ")
                ),
                cmds,
            )
        }
        Verdict::GpuFellOffBus => {
            let gpus: Vec<&str> = f
                .unhealthy_gpus
                .iter()
                .filter(|g| g.off_bus)
                .map(|g| g.uuid.as_str())
                .collect();
            (
                format!(
                    "The node went silent after GPU {} fell off the bus (Xid 79): the machine likely hung or lost the GPU. Reboot it; check power, cooling and the PCIe slot; replace the GPU if it recurs (docs/gpu-health.md).",
                    gpus.join(", ")
                ),
                vec![
                    "# on the node (console or BMC): reboot, then check the kernel log for the Xid".into(),
                    "journalctl -k -b -1 | grep -i xid".into(),
                    "modelforge-agent --state-dir \"$AGENT_STATE_DIR\"".into(),
                    format!("modelforge admin doctor {id} --wait 60s"),
                ],
            )
        }
        Verdict::TelemetryStopped => (
            format!(
                "The node heartbeats but reports no GPU telemetry although it has {} GPU(s): NVML on the node is hung or gone (a driver problem or a GPU lost). Check the driver and restart the agent.",
                f.accelerators
            ),
            vec![
                "# on the node:".into(),
                "nvidia-smi".into(),
                "systemctl restart modelforge-agent".into(),
                format!("modelforge admin doctor {id} --wait 60s"),
            ],
        ),
        Verdict::Decommissioned => (
            format!(
                "The node was decommissioned at {}: nothing to recover. To bring the hardware back, enrol it as a new node with an empty state dir (RUNBOOK_NODE_DECOMMISSION.md).",
                f.decommissioned_at.as_deref().unwrap_or("?")
            ),
            vec![
                "rm -rf \"$AGENT_STATE_DIR\"".into(),
                "TOKEN=$(modelforge admin enrollments create -q)".into(),
                "MODELFORGE_ENROLLMENT_TOKEN=\"$TOKEN\" modelforge-agent --state-dir \"$AGENT_STATE_DIR\"".into(),
            ],
        ),
    }
}

/// The report as JSON (`--output json`).
pub fn report_json(f: &Facts, v: Verdict) -> Value {
    let (case, commands) = advice(f, v);
    json!({
        "node_id": f.node_id,
        "verdict": v.name(),
        "exit_code": v.exit_code(),
        "checks": {
            "status": f.status,
            "last_heartbeat_at": f.last_heartbeat_at,
            "last_refusal": f.last_refusal.as_ref().map(|r| json!({
                "status": r.status,
                "code": r.code,
                "at": r.at,
                "credential_of_this_node": r.credential_of_this_node,
            })),
            "credentials_active": f.active,
            "credentials_revoked": f.revoked,
            "active_credential_last_used_at": f.active_last_used_at,
            "hostname": f.hostname,
            "hostname_conflicts": f.hostname_conflicts,
            "accelerators": f.accelerators,
            "accelerators_verified": f.accelerators_verified,
            "view_rebuilt_at": f.view_rebuilt_at,
            "decommissioned_at": f.decommissioned_at,
            "unhealthy_gpus": f.unhealthy_gpus.iter().map(|g| json!({
                "uuid": g.uuid,
                "health": g.health,
                "cause": g.cause,
            })).collect::<Vec<_>>(),
            "telemetry_gpus": f.telemetry_gpus,
        },
        "case": case,
        "commands": commands,
    })
}

/// The report for a terminal.
pub fn report_text(f: &Facts, v: Verdict) -> String {
    let (case, commands) = advice(f, v);
    let or = |o: &Option<String>, d: &str| o.clone().unwrap_or_else(|| d.to_string());
    let answered = match (&f.last_refusal, f.last_heartbeat_ms) {
        (Some(r), hb) if hb.is_none_or(|hb| r.at_ms > hb) => format!(
            "{} {} (latest refusal at {}, after the last accepted heartbeat; {})",
            r.status,
            r.code,
            r.at,
            if r.credential_of_this_node {
                "the node's own credential"
            } else {
                "not proven to be the node's credential"
            }
        ),
        (_, Some(_)) => "200".to_string(),
        (_, None) => "nothing: no request seen".to_string(),
    };
    let mut out = String::new();
    out.push_str(&format!("node {} ({})\n", f.node_id, f.hostname));
    out.push_str(&format!("  status:               {}\n", f.status));
    out.push_str(&format!(
        "  last heartbeat:       {}\n",
        or(&f.last_heartbeat_at, "never")
    ));
    out.push_str(&format!("  requests answered:    {answered}\n"));
    out.push_str(&format!(
        "  credentials:          {} active, {} revoked; active one last used {}\n",
        f.active,
        f.revoked,
        or(&f.active_last_used_at, "never")
    ));
    out.push_str(&format!(
        "  hostname conflicts:   {}\n",
        if f.hostname_conflicts.is_empty() {
            "none".to_string()
        } else {
            f.hostname_conflicts.join(", ")
        }
    ));
    out.push_str(&format!(
        "  accelerators:         {} ({} since the view was rebuilt at {})\n",
        f.accelerators,
        if f.accelerators_verified {
            "verified"
        } else {
            "not verified"
        },
        or(&f.view_rebuilt_at, "?")
    ));
    out.push_str(&format!("verdict: {} (exit {})\n", v.name(), v.exit_code()));
    out.push_str(&format!("case: {case}\n"));
    if !commands.is_empty() {
        out.push_str("run:\n");
        for c in commands {
            out.push_str(&format!("  {c}\n"));
        }
    }
    out
}

pub(super) async fn doctor_cmd(
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
            .get_all_typed(
                &format!("/api/v1/admin/hardware/nodes/{node_id}/credentials"),
                "credentials",
                None,
            )
            .await?;
        let facts = Facts::from_api(&node, &creds);
        let verdict = diagnose(&facts);
        let waiting = deadline.is_some_and(|d| tokio::time::Instant::now() < d);
        if verdict == Verdict::Healthy || !waiting {
            let v = report_json(&facts, verdict);
            emit_or_quiet(args, &v, vec![verdict.name().to_string()], || {
                report_text(&facts, verdict)
            });
            return Ok(verdict.exit_code());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn healthy() -> Facts {
        Facts {
            node_id: "n1".into(),
            hostname: "gpu-1".into(),
            status: NodeStatus::Online,
            decommissioned_at: None,
            last_heartbeat_at: None,
            last_heartbeat_ms: Some(10_000),
            last_refusal: None,
            active: 1,
            revoked: 0,
            active_last_used_at: None,
            hostname_conflicts: vec![],
            accelerators: 0,
            accelerators_verified: false,
            view_rebuilt_at: None,
            unhealthy_gpus: vec![],
            telemetry_gpus: None,
        }
    }

    /// The doctor's GPU cases from what the telemetry says (issue 18 item 6).
    #[test]
    fn each_gpu_case_has_its_verdict() {
        let telemetry = |events: Value| {
            json!({"accelerators": [
                {"uuid": "GPU-a", "events": events},
                {"uuid": "GPU-b"},
            ]})
        };
        let ev = |code: u64| json!([{"kind": "xid", "code": code, "count": 1, "first_at": "t", "last_at": "t"}]);
        let with = |t: Value| {
            let mut f = healthy();
            f.accelerators = 2;
            (f.unhealthy_gpus, f.telemetry_gpus) = gpu_facts(&t);
            f
        };
        // Application faults and degrading events leave a heartbeating node healthy.
        for code in [13, 31, 43, 63, 94] {
            assert_eq!(
                diagnose(&with(telemetry(ev(code)))),
                Verdict::Healthy,
                "xid {code}"
            );
        }
        // A failed GPU on a node that heartbeats.
        let f = with(telemetry(ev(48)));
        assert_eq!(diagnose(&f), Verdict::GpuFailed);
        let (case, cmds) = advice(&f, Verdict::GpuFailed);
        assert!(case.contains("GPU-a") && case.contains("xid 48"), "{case}");
        assert!(
            cmds.iter().any(|c| c.contains("--gpu-reset -i GPU-a")),
            "{cmds:?}"
        );
        // Silent since an Xid 79; silent after anything else is the usual silence.
        let mut f = with(telemetry(ev(79)));
        f.status = NodeStatus::Offline;
        assert_eq!(diagnose(&f), Verdict::GpuFellOffBus);
        assert!(advice(&f, Verdict::GpuFellOffBus).0.contains("GPU-a"));
        let mut f = with(telemetry(ev(48)));
        f.status = NodeStatus::Offline;
        assert_eq!(diagnose(&f), Verdict::AgentSilent);
        // Heartbeats with no GPU telemetry from a node that has GPUs.
        let f = with(json!({"accelerators": []}));
        assert_eq!(diagnose(&f), Verdict::TelemetryStopped);
        let mut f = with(json!({"accelerators": []}));
        f.accelerators = 0;
        assert_eq!(
            diagnose(&f),
            Verdict::Healthy,
            "a node without GPUs reports none"
        );
        // A revoked credential still comes first.
        let mut f = with(telemetry(ev(79)));
        f.active = 0;
        assert_eq!(diagnose(&f), Verdict::CredentialRevoked);
    }

    #[test]
    fn each_runbook_case_has_its_verdict() {
        assert_eq!(diagnose(&healthy()), Verdict::Healthy);
        let refusal = |status: u16, code: &str, at_ms: i64, ours: bool| {
            Some(SeenRefusal {
                status,
                code: code.into(),
                at: String::new(),
                at_ms,
                credential_of_this_node: ours,
            })
        };
        // No refusal anyone can cause changes a healthy node's verdict: revoked is read from
        // the replicated credentials only.
        let mut f = healthy();
        for (status, code, ours) in [
            (401, "invalid_credential", false),
            (401, "credential_revoked", false),
            (401, "credential_revoked", true),
            (403, "credential_for_other_node", false),
        ] {
            f.last_refusal = refusal(status, code, 11_000, ours);
            assert_eq!(diagnose(&f), Verdict::Healthy, "{status} {code} {ours}");
        }
        // Another node's verified credential presented for a node that is no longer online.
        f.status = NodeStatus::Stale;
        f.last_refusal = refusal(403, "credential_for_other_node", 11_000, false);
        assert_eq!(diagnose(&f), Verdict::CredentialForOtherNode);
        // A refusal older than the last accepted heartbeat is history, not the present.
        f.last_refusal = refusal(403, "credential_for_other_node", 9_000, false);
        assert_eq!(diagnose(&f), Verdict::AgentSilent);
        // A stranger's 401s on a silent node leave it silent.
        f.last_refusal = refusal(401, "invalid_credential", 11_000, false);
        assert_eq!(diagnose(&f), Verdict::AgentSilent);
        let mut f = healthy();
        f.status = NodeStatus::Stale;
        assert_eq!(diagnose(&f), Verdict::AgentSilent);
        f.status = NodeStatus::NeverSeen;
        f.last_heartbeat_ms = None;
        assert_eq!(diagnose(&f), Verdict::AgentSilent);
        let mut f = healthy();
        f.active = 0;
        f.revoked = 2;
        assert_eq!(diagnose(&f), Verdict::CredentialRevoked);
        let mut f = healthy();
        f.hostname_conflicts = vec!["n0".into()];
        assert_eq!(diagnose(&f), Verdict::HostnameConflict);
        let (_, cmds) = advice(&f, Verdict::HostnameConflict);
        assert!(cmds.iter().any(|c| c.contains("decommission preview n0")));
        let mut f = healthy();
        f.status = NodeStatus::Decommissioned;
        f.active = 0;
        assert_eq!(diagnose(&f), Verdict::Decommissioned);
    }

    #[test]
    fn exit_codes_are_distinct_and_zero_only_when_healthy() {
        let all = [
            Verdict::Healthy,
            Verdict::CredentialRevoked,
            Verdict::CredentialForOtherNode,
            Verdict::AgentSilent,
            Verdict::HostnameConflict,
            Verdict::Decommissioned,
            Verdict::GpuFailed,
            Verdict::GpuFellOffBus,
            Verdict::TelemetryStopped,
        ];
        let mut codes: Vec<i32> = all.iter().map(|v| v.exit_code()).collect();
        codes.sort();
        codes.dedup();
        assert_eq!(codes.len(), all.len());
        assert!(
            all.iter()
                .all(|v| (v.exit_code() == 0) == (*v == Verdict::Healthy))
        );
    }

    #[test]
    fn commands_name_the_real_node() {
        let mut f = healthy();
        f.node_id = "abc-123".into();
        let (_, cmds) = advice(&f, Verdict::CredentialRevoked);
        assert!(cmds.iter().any(|c| c.contains("revoke-credential abc-123")));
        assert!(
            cmds.iter()
                .any(|c| c == "modelforge admin doctor abc-123 --wait 60s")
        );
    }
}
