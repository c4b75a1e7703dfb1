//! The background loops of a member, each run by `serve_on` until its shutdown switch.

use std::time::Duration;

use modelforge_proto::api;
use modelforge_proto::ids::CredentialId;
use modelforge_proto::ids::HistoryKind;
use modelforge_proto::ids::NodeId;
use modelforge_proto::ids::NodeStatus;
use modelforge_proto::now_ms;
use modelforge_raft::network::PEER_HEADER;

use super::peer::*;
use super::*;
use crate::state::Command;

/// Form the cluster on first start: unless a peer already belongs to one, initialise with the
/// full `--peer` list (identical on every member, which openraft allows on several members).
pub(super) async fn bootstrap(ctx: Shared) {
    if ctx.consensus.is_initialized().await {
        return;
    }
    if !ctx.cfg.join.is_empty() {
        // A joining member never forms a cluster: the leader's first append makes it one.
        tracing::info!(
            join = ?ctx.cfg.join,
            "waiting to be added: run `modelforge admin members add {} {}` against the cluster",
            ctx.cfg.node_id,
            ctx.cfg.advertise
        );
        return;
    }
    for (id, url) in &ctx.cfg.peers {
        if *id == ctx.cfg.node_id {
            continue;
        }
        let url = ctx.peer_url(*id, url);
        let resp = ctx
            .http
            .get(format!("{}{STATUS}", url.trim_end_matches('/')))
            .header(PEER_HEADER, ctx.signer.sign("GET", STATUS, b"", 0))
            .timeout(Duration::from_secs(1))
            .send()
            .await;
        if let Ok(resp) = resp
            && let Ok(v) = resp.json::<api::PeerStatus>().await
            && v.initialized
        {
            tracing::info!(
                peer = id,
                "a peer already belongs to a cluster: waiting to be replicated to"
            );
            return;
        }
    }
    match ctx.consensus.initialize(&ctx.cfg.peers).await {
        Ok(()) => {
            tracing::info!(members = ?ctx.cfg.peers.keys().collect::<Vec<_>>(), "cluster initialised")
        }
        Err(e) => tracing::warn!(error = %e, "cluster initialisation failed"),
    }
}

/// If this member leads and another voter has caught up, hand leadership to the most caught-up
/// reachable one and wait (up to 3 s) until it leads. Called when the member is stopped.
pub(super) async fn hand_over_leadership(ctx: &Shared) {
    if !ctx.consensus.is_leader() {
        return;
    }
    let me = ctx.cfg.node_id;
    let status = ctx.consensus.status();
    let Some(to) = status
        .members
        .iter()
        .filter(|m| m.voter && m.id != me && m.last_ack_ms.is_some_and(|ms| ms < 3_000))
        .max_by_key(|m| m.matched_index.unwrap_or(0))
        .map(|m| m.id)
    else {
        return;
    };
    if let Err(e) = ctx.consensus.transfer_leadership(to).await {
        tracing::warn!(error = %e, "could not hand leadership over");
        return;
    }
    let moved = ctx
        .consensus
        .wait_for(Duration::from_secs(3), |s| {
            s.leader_id.is_some_and(|l| l != me)
        })
        .await;
    tracing::info!(to, moved, "stopping: handed leadership over");
}

/// Track when this member became leader (the grace window of node status starts there).
pub(super) async fn watch_leadership(ctx: Shared) {
    let mut known = None;
    loop {
        // Changes of leader as this member sees them (etcd's leader_changes_seen).
        let leader = ctx.consensus.leader().map(|(id, _)| id);
        if leader.is_some() && leader != known {
            if known.is_some() {
                ctx.metrics.leader_changes.inc();
            }
            known = leader;
        }
        if ctx.consensus.is_leader() {
            let term = ctx.consensus.current_term();
            if ctx.live.on_leader(term, now_ms()) {
                tracing::info!(
                    term,
                    "became leader: node view rebuilt, grace window started"
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Fill the leader's pool of credentials minted ahead (see [`crate::secrets::CredentialMint`]).
pub(super) async fn mint_ahead(ctx: Shared) {
    loop {
        let minted = if ctx.consensus.is_leader() {
            ctx.mint.refill_one(&ctx.hasher).await
        } else {
            None
        };
        match minted {
            Some(took) => {
                let rest = ctx.mint.rest_after(took, now_ms());
                if !rest.is_zero() {
                    tokio::time::sleep(rest).await;
                }
            }
            None => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

/// Measure the data dir's free space every half second; log when the alarm rises and clears.
pub(super) async fn watch_disk(ctx: Shared) {
    ctx.consensus.hold_snapshots(ctx.disk.low());
    loop {
        tokio::time::sleep(crate::disk::CHECK_EVERY).await;
        let Some(low) = ctx.disk.check(now_ms()) else {
            continue;
        };
        ctx.consensus.hold_snapshots(low);
        if low {
            tracing::error!(
                free_mib = ctx.disk.view().free_bytes >> 20,
                reserve_mib = ctx.cfg.disk_reserve_bytes >> 20,
                data_dir = %ctx.cfg.data_dir.display(),
                "disk space under the reserve: writes are refused until space returns"
            );
        } else {
            tracing::info!(
                free_mib = ctx.disk.view().free_bytes >> 20,
                "disk space is back over the reserve: writes are accepted again"
            );
        }
    }
}

/// Write `last_used_at` updates coalesced: at most one write per interval, only for
/// credentials whose replicated value is older than [`TOUCH_MIN_ADVANCE_MS`].
pub(super) async fn write_coalesced_uses(ctx: Shared) {
    loop {
        tokio::time::sleep(ctx.cfg.touch_interval).await;
        if ctx.disk.low() {
            // Kept for when space returns: no write is tried (it would be refused).
            continue;
        }
        let uses = ctx.live.take_uses();
        if uses.is_empty() || !ctx.consensus.is_leader() {
            continue;
        }
        let due: Vec<(CredentialId, i64)> = {
            let s = ctx.app.read();
            uses.into_iter()
                .filter(|(id, at)| {
                    s.credentials.get(id).is_some_and(|c| {
                        c.revoked_at_ms.is_none()
                            && c.last_used_at_ms
                                .is_none_or(|old| at - old >= TOUCH_MIN_ADVANCE_MS)
                    })
                })
                .collect()
        };
        for chunk in due.chunks(TOUCH_BATCH) {
            let cmd = Command::TouchCredentials {
                uses: chunk.to_vec(),
            };
            if let Err(e) = ctx
                .propose("system", modelforge_proto::new_uuid(), cmd)
                .await
            {
                tracing::warn!(
                    code = e.code.as_str(),
                    "coalesced last_used_at write failed"
                );
            }
        }
    }
}

/// Write node events that only the heartbeat-processing member sees, coalesced: status
/// transitions and refused agent requests go into the nodes' histories in at most one write
/// per interval, however many requests were refused (anyone can send those).
pub(super) async fn record_node_events(ctx: Shared) {
    loop {
        tokio::time::sleep(ctx.cfg.events_interval).await;
        if !ctx.consensus.is_leader() || ctx.disk.low() {
            continue;
        }
        let now = now_ms();
        let live = ctx.live.sup.all().await;
        let mut transitions = vec![];
        {
            let s = ctx.app.read();
            for node in s.nodes.values() {
                let Some((l, _)) = live.get(&node.node_id) else {
                    continue;
                };
                let status = admin::status_of(&ctx, &s, node, l, now);
                if status != NodeStatus::NeverSeen && l.recorded_status != Some(status) {
                    transitions.push((node.node_id.clone(), status));
                }
            }
        }
        let refusals = ctx.live.sup.flush(transitions.clone()).await;
        let mut events: Vec<(NodeId, HistoryKind, String, u32)> = transitions
            .into_iter()
            .map(|(n, s)| (n, HistoryKind::Status, s.to_string(), 1))
            .collect();
        events.extend(
            refusals.into_iter().map(|(n, status, count)| {
                (n, HistoryKind::RequestRefused, status.to_string(), count)
            }),
        );
        if events.is_empty() {
            continue;
        }
        if let Err(e) = ctx
            .propose(
                "system",
                modelforge_proto::new_uuid(),
                Command::RecordEvents { events },
            )
            .await
        {
            tracing::warn!(code = e.code.as_str(), "writing node events failed");
        }
    }
}
