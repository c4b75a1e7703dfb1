//! `modelforge admin members ...`: the cluster's members, added and removed online.

use modelforge_proto::api;
use reqwest::Method;

use super::AdminArgs;
use super::EXIT_OK;
use super::Fail;
use super::MemberCmd;
use super::client::Client;
use super::output::emit_or_quiet;
use super::output::table;

fn members_table(members: &[api::ClusterMember]) -> String {
    let opt = |v: Option<String>| v.unwrap_or_else(|| "-".into());
    table(
        &["MEMBER", "ROLE", "URL", "MATCHED", "REACHABLE"],
        members
            .iter()
            .map(|m| {
                vec![
                    m.id.to_string(),
                    m.role.clone(),
                    m.url.clone(),
                    opt(m.matched_index.map(|i| i.to_string())),
                    opt(m
                        .reachable
                        .map(|r| if r { "yes" } else { "no" }.to_string())),
                ]
            })
            .collect(),
    )
}

pub(super) async fn members(
    args: &AdminArgs,
    c: &mut Client,
    cmd: &MemberCmd,
) -> Result<i32, Fail> {
    let (members, v) = match cmd {
        MemberCmd::List => {
            let (view, v): (api::ClusterView, _) = c.get_typed("/api/v1/cluster").await?;
            (view.members, v)
        }
        MemberCmd::Add { id, url, learner } => {
            let body = api::AddMember {
                id: *id,
                url: url.clone(),
                voter: Some(!learner),
            };
            // The answer waits for the new member to catch up (up to 40 s): a spinner meanwhile.
            c.progress.set_style(
                indicatif::ProgressStyle::with_template("{spinner} {msg} {elapsed}")
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
            );
            c.progress
                .set_message(format!("adding member {id}: waiting for it to catch up"));
            c.progress
                .enable_steady_tick(std::time::Duration::from_millis(150));
            let answer = c
                .write_typed(Method::POST, "/api/v1/admin/cluster/members", &body, None)
                .await;
            c.progress.finish_and_clear();
            let (view, v): (api::MembersView, _) = answer?;
            (view.members, v)
        }
        MemberCmd::Remove { id } => {
            let (view, v): (api::MembersView, _) = c
                .write_typed(
                    Method::DELETE,
                    &format!("/api/v1/admin/cluster/members/{id}"),
                    &serde_json::json!({}),
                    None,
                )
                .await?;
            (view.members, v)
        }
    };
    let ids = members.iter().map(|m| m.id.to_string()).collect();
    emit_or_quiet(args, &v, ids, || members_table(&members));
    Ok(EXIT_OK)
}
