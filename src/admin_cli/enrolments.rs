//! `modelforge admin enrollments ...`: create, list and cancel enrolment tokens.

use modelforge_proto::api;
use reqwest::Method;

use super::AdminArgs;
use super::EXIT_OK;
use super::EnrollmentCmd;
use super::Fail;
use super::client::Client;
use super::output::emit_or_quiet;
use super::output::opt;
use super::output::table_wide;
use super::usage;

pub(super) async fn enrollments(
    args: &AdminArgs,
    c: &mut Client,
    cmd: &EnrollmentCmd,
) -> Result<i32, Fail> {
    match cmd {
        EnrollmentCmd::Create { ttl, note } => {
            if ttl.is_some_and(|t| t.as_secs() == 0) {
                return Err(usage("--ttl must be at least 1s"));
            }
            let body = api::CreateEnrollment {
                ttl_seconds: ttl.map(|t| t.as_secs()),
                note: note.clone(),
            };
            let (issued, v): (api::TokenIssued, _) = c
                .write_typed(Method::POST, "/api/v1/admin/node-enrollments", &body, None)
                .await?;
            let pin = issued
                .ca_cert_hash
                .as_ref()
                .map(|h| format!(" --ca-cert-hash {h}"))
                .unwrap_or_default();
            // The token goes through a file (0600), never the agent's argv: other users of
            // the machine can read a process's arguments.
            let agent = format!(
                "(umask 077; echo '{}' > /var/lib/modelforge-agent.token)\n  modelforge-agent --control-plane {} --state-dir /var/lib/modelforge-agent --enrollment-token-file /var/lib/modelforge-agent.token{pin}",
                issued.token,
                c.urls().join(",")
            );
            emit_or_quiet(args, &v, vec![issued.token.clone()], || {
                format!(
                    "enrollment {} (expires {})\ntoken (shown once): {}\non the node, run:\n  {agent}\n",
                    issued.enrollment_id, issued.expires_at, issued.token
                )
            });
        }
        EnrollmentCmd::List => {
            let (list, v): (api::Enrollments, _) = c
                .get_all_typed("/api/v1/admin/node-enrollments", "enrollments", None)
                .await?;
            let rows = list.enrollments;
            let ids = rows.iter().map(|r| r.enrollment_id.to_string()).collect();
            emit_or_quiet(args, &v, ids, || {
                table_wide(
                    args,
                    &[
                        "ENROLLMENT",
                        "STATE",
                        "CREATED",
                        "EXPIRES",
                        "CLAIMED BY",
                        "NOTE",
                    ],
                    &["CLAIMED", "CANCELLED"],
                    rows.iter()
                        .map(|r| {
                            (
                                vec![
                                    r.enrollment_id.to_string(),
                                    r.state.to_string(),
                                    r.created_at.clone(),
                                    r.expires_at.clone(),
                                    opt(&r.claimed_node_id),
                                    opt(&r.note),
                                ],
                                vec![opt(&r.claimed_at), opt(&r.cancelled_at)],
                            )
                        })
                        .collect(),
                )
            });
        }
        EnrollmentCmd::Cancel {
            enrollment_id,
            reason,
        } => {
            let (_, v): (api::EnrollmentCancelled, _) = c
                .write_typed(
                    Method::DELETE,
                    &format!("/api/v1/admin/node-enrollments/{enrollment_id}"),
                    &api::ReasonRequest {
                        reason: Some(reason.clone()),
                    },
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
