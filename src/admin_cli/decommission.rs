//! `modelforge admin decommission preview|execute`.

use std::io::IsTerminal;

use modelforge_proto::api;
use reqwest::Method;

use super::AdminArgs;
use super::DecommissionCmd;
use super::EXIT_DECLINED;
use super::EXIT_OK;
use super::Fail;
use super::client::Client;
use super::output::emit_or_quiet;
use super::output::list_text;
use super::usage;

pub(super) async fn decommission(
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
                    &api::EmptyRequest {},
                    None,
                )
                .await?;
            emit_or_quiet(args, &v, vec![p.preview_id.to_string()], || {
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
                    &api::ExecuteDecommission {
                        preview_id: preview_id.clone(),
                        reason: reason.clone(),
                    },
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
