//! `modelforge admin tokens ...`: named operators' admin tokens.

use modelforge_proto::api;
use reqwest::Method;

use super::AdminArgs;
use super::EXIT_OK;
use super::Fail;
use super::TokenCmd;
use super::client::Client;
use super::output::emit_or_quiet;
use super::output::opt;
use super::output::table;

pub(super) async fn operators(
    args: &AdminArgs,
    c: &mut Client,
    cmd: &TokenCmd,
) -> Result<i32, Fail> {
    match cmd {
        TokenCmd::Create { name, role, reason } => {
            let body = api::CreateOperatorToken {
                name: name.clone(),
                role: (*role).into(),
                reason: Some(reason.clone()),
            };
            let (created, v): (api::OperatorTokenCreated, _) = c
                .write_typed(Method::POST, "/api/v1/admin/tokens", &body, None)
                .await?;
            emit_or_quiet(args, &v, vec![created.token.clone()], || {
                format!(
                    "token {} (role {}) created\ntoken (shown once): {}\nuse it with MODELFORGE_ADMIN_TOKEN or --admin-token-file\n",
                    created.name,
                    created.role.as_str(),
                    created.token
                )
            });
        }
        TokenCmd::List => {
            let (list, v): (api::OperatorList, _) = c.get_typed("/api/v1/admin/tokens").await?;
            let names = list.tokens.iter().map(|t| t.name.clone()).collect();
            emit_or_quiet(args, &v, names, || {
                table(
                    &["NAME", "ROLE", "CREATED", "CREATED BY"],
                    list.tokens
                        .iter()
                        .map(|t| {
                            vec![
                                t.name.clone(),
                                t.role.as_str().to_string(),
                                if t.builtin {
                                    "(configuration)".to_string()
                                } else {
                                    opt(&t.created_at)
                                },
                                opt(&t.created_by),
                            ]
                        })
                        .collect(),
                )
            });
        }
        TokenCmd::Delete { name, reason } => {
            let (_, v): (api::OperatorDeleted, _) = c
                .write_typed(
                    Method::DELETE,
                    &format!("/api/v1/admin/tokens/{name}"),
                    &api::ReasonRequest {
                        reason: Some(reason.clone()),
                    },
                    None,
                )
                .await?;
            emit_or_quiet(args, &v, vec![name.clone()], || {
                format!("token {name} deleted: no member accepts it now\n")
            });
        }
    }
    Ok(EXIT_OK)
}
