//! `modelforge admin audit list|export|verify`: the audit trail, verified on this side too.

use modelforge_proto::api;
use serde_json::Value;
use serde_json::json;

use super::AdminArgs;
use super::AuditCmd;
use super::EXIT_AUDIT_BROKEN;
use super::EXIT_OK;
use super::Fail;
use super::audit;
use super::client::Client;
use super::output::arr;
use super::output::emit_or_quiet;
use super::output::s;
use super::output::table_wide;
use super::usage;

pub(super) fn verify_and_report(
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

pub(super) async fn audit_cmd(
    args: &AdminArgs,
    c: &mut Client,
    cmd: &AuditCmd,
) -> Result<i32, Fail> {
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
                    usage("--since must be an RFC 3339 time (2026-12-02T10:00:00Z) or a duration back from now (2h)")
                })?;
                q.push(format!("since={utc}"));
            }
            let path = if q.is_empty() {
                "/api/v1/admin/audit".to_string()
            } else {
                format!("/api/v1/admin/audit?{}", q.join("&"))
            };
            let (page, v): (api::AuditPage, _) = c.get_all_typed(&path, "events", *limit).await?;
            let events = &page.events;
            let seqs = events.iter().map(|e| e.record.seq.to_string()).collect();
            emit_or_quiet(args, &v, seqs, || {
                let mut out = table_wide(
                    args,
                    &[
                        "SEQ", "AT", "ACTOR", "ACTION", "TARGET", "RESULT", "REQUEST",
                    ],
                    &["REASON", "LOG INDEX", "HASH"],
                    events
                        .iter()
                        .map(|e| {
                            (
                                vec![
                                    e.record.seq.to_string(),
                                    e.at.clone(),
                                    e.record.actor.clone(),
                                    e.record.action.clone(),
                                    e.record.target.clone(),
                                    e.record.result.clone(),
                                    e.record.request_id.clone(),
                                ],
                                vec![
                                    e.record.reason.clone().unwrap_or_else(|| "-".into()),
                                    e.record.log_index.to_string(),
                                    e.record.hash.clone(),
                                ],
                            )
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
            let (_, v): (api::AuditPage, _) = c
                .get_all_typed("/api/v1/admin/audit", "events", None)
                .await?;
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
            let (_, v): (api::AuditPage, _) = c
                .get_all_typed("/api/v1/admin/audit", "events", None)
                .await?;
            verify_and_report(
                args,
                &arr(&v["events"]),
                expect_head.as_deref(),
                v["chain_verified"].as_bool(),
            )
        }
    }
}

/// `--since`: an RFC 3339 time (with `Z` or an offset), or a duration back from now (`90m`,
/// `2h`, `7days`), as the UTC time with `Z` the server takes.
pub(super) fn since_utc(t: &str) -> Option<String> {
    let t = t.trim();
    let at = match super::output::parse_time(t) {
        Some(at) => at,
        None => {
            let back = humantime::parse_duration(t).ok()?;
            let back = jiff::SignedDuration::try_from(back).ok()?;
            jiff::Timestamp::now().checked_sub(back).ok()?
        }
    };
    Some(format!("{at:.3}"))
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
        // A duration back from now.
        let hour_ago = since_utc("1h").unwrap();
        let at: jiff::Timestamp = hour_ago.parse().unwrap();
        let back = jiff::Timestamp::now().as_millisecond() - at.as_millisecond();
        assert!((3_599_000..3_700_000).contains(&back), "{hour_ago}");
        assert_eq!(since_utc("2026-12-02T10:00:0ééé"), None);
    }
}
