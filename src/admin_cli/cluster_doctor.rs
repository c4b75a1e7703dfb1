//! `modelforge admin doctor --cluster`: the cluster's own health, decided by a plain function
//! over the leader's `GET /api/v1/cluster` ([`diagnose`]), so every verdict is unit-tested.

use modelforge_proto::api;
use serde_json::Value;
use serde_json::json;

use super::AdminArgs;
use super::Fail;
use super::client::Client;
use super::output::emit_or_quiet;

/// A member this far behind the leader's last log index is lagging.
pub const LAG_ENTRIES: u64 = 1_000;

/// What the cluster doctor decided; the exit code is documented in README.md.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClusterVerdict {
    /// Every member reachable and caught up; at least one voter can fail.
    Healthy,
    /// A member is unreachable or lagging, but the cluster survives one more voter failure.
    Degraded,
    /// One more voter failure loses quorum (or a 1- or 2-voter cluster: no margin by design).
    QuorumAtRisk,
    /// No leader is known: writes stop.
    NoLeader,
}

impl ClusterVerdict {
    pub fn name(self) -> &'static str {
        match self {
            ClusterVerdict::Healthy => "healthy",
            ClusterVerdict::Degraded => "degraded",
            ClusterVerdict::QuorumAtRisk => "quorum_at_risk",
            ClusterVerdict::NoLeader => "no_leader",
        }
    }

    pub fn exit_code(self) -> i32 {
        match self {
            ClusterVerdict::Healthy => 0,
            ClusterVerdict::Degraded => 20,
            ClusterVerdict::QuorumAtRisk => 21,
            ClusterVerdict::NoLeader => 22,
        }
    }
}

/// The figures behind a verdict.
#[derive(Clone, Debug, PartialEq)]
pub struct ClusterFacts {
    pub leader: Option<u64>,
    pub voters: usize,
    pub quorum: usize,
    pub reachable_voters: usize,
    /// Voters that may fail before quorum is lost (negative: lost already).
    pub margin: i64,
    pub unreachable: Vec<u64>,
    pub lagging: Vec<(u64, u64)>,
    pub learners: Vec<u64>,
    /// Members whose data dir is under its free-space reserve (they refuse writes).
    pub disk_alarms: Vec<(u64, api::DiskView)>,
}

/// Decide from the leader's view (`members` carry `reachable` and `matched_index` there) and
/// each reachable member's own disk (`disks`).
pub fn diagnose(
    view: &api::ClusterView,
    disks: &[(u64, api::DiskView)],
) -> (ClusterVerdict, ClusterFacts) {
    let voters: Vec<&api::ClusterMember> = view.members.iter().filter(|m| m.voter).collect();
    let quorum = voters.len() / 2 + 1;
    let reachable = |m: &api::ClusterMember| m.reachable != Some(false);
    let reachable_voters = voters.iter().filter(|m| reachable(m)).count();
    let unreachable = view
        .members
        .iter()
        .filter(|m| !reachable(m))
        .map(|m| m.id)
        .collect();
    let lagging = view
        .members
        .iter()
        .filter(|m| reachable(m))
        .filter_map(|m| {
            let behind = view.last_log_index.saturating_sub(m.matched_index?);
            (behind > LAG_ENTRIES).then_some((m.id, behind))
        })
        .collect();
    let learners = view
        .members
        .iter()
        .filter(|m| !m.voter)
        .map(|m| m.id)
        .collect();
    let facts = ClusterFacts {
        leader: view.leader_id,
        voters: voters.len(),
        quorum,
        reachable_voters,
        margin: reachable_voters as i64 - quorum as i64,
        unreachable,
        lagging,
        learners,
        disk_alarms: disks.iter().filter(|(_, d)| d.alarm).cloned().collect(),
    };
    let verdict = if view.leader_id.is_none() {
        ClusterVerdict::NoLeader
    } else if facts.margin < 1 {
        ClusterVerdict::QuorumAtRisk
    } else if !facts.unreachable.is_empty()
        || !facts.lagging.is_empty()
        || !facts.disk_alarms.is_empty()
    {
        ClusterVerdict::Degraded
    } else {
        ClusterVerdict::Healthy
    };
    (verdict, facts)
}

fn report_text(f: &ClusterFacts, v: ClusterVerdict, next_id: u64) -> String {
    let mut out = format!(
        "cluster: {}\nleader: {}\nvoters: {} (quorum {}, {} reachable; {} more may fail)\n",
        v.name(),
        f.leader.map_or("none".into(), |l| l.to_string()),
        f.voters,
        f.quorum,
        f.reachable_voters,
        f.margin.max(0)
    );
    if !f.learners.is_empty() {
        out.push_str(&format!("learners: {:?}\n", f.learners));
    }
    for (id, behind) in &f.lagging {
        out.push_str(&format!(
            "member {id} is {behind} entries behind the leader\n"
        ));
    }
    for id in &f.unreachable {
        out.push_str(&format!(
            "member {id} is unreachable. If it is lost for good, replace it (docs/runbooks/RUNBOOK_MEMBER_REPLACEMENT.md):\n  \
             start a new member with an empty data dir: modelforge serve --node-id {next_id} --join <a member's url> ...\n  \
             modelforge admin members add {next_id} <its url>\n  \
             modelforge admin members remove {id}\n"
        ));
    }
    for (id, d) in &f.disk_alarms {
        out.push_str(&format!(
            "member {id}'s disk is under its reserve ({} MiB free of {} MiB kept) since {}: it refuses writes; free space on its data dir's filesystem and it recovers by itself\n",
            d.free_bytes >> 20,
            d.reserve_bytes >> 20,
            d.alarm_since.as_deref().unwrap_or("?")
        ));
    }
    if v == ClusterVerdict::NoLeader {
        out.push_str("no leader: check that a majority of voters runs and can reach each other\n");
    }
    out
}

fn report_json(f: &ClusterFacts, v: ClusterVerdict) -> Value {
    json!({
        "verdict": v.name(), "exit_code": v.exit_code(), "leader": f.leader,
        "voters": f.voters, "quorum": f.quorum, "reachable_voters": f.reachable_voters,
        "margin": f.margin, "unreachable": f.unreachable,
        "lagging": f.lagging.iter().map(|(id, b)| json!({"id": id, "behind": b})).collect::<Vec<_>>(),
        "learners": f.learners,
        "disk_alarms": f.disk_alarms.iter().map(|(id, d)| json!({
            "id": id, "free_bytes": d.free_bytes, "reserve_bytes": d.reserve_bytes,
            "since": d.alarm_since,
        })).collect::<Vec<_>>(),
    })
}

pub(super) async fn cluster_doctor(args: &AdminArgs, c: &mut Client) -> Result<i32, Fail> {
    let (mut view, _): (api::ClusterView, _) = c.get_typed("/api/v1/cluster").await?;
    // Reachability and progress are the leader's to report: ask it when another answered.
    if view.leader_id.is_some_and(|l| l != view.id)
        && let Some(url) = view.leader_url.clone()
        && let Ok(mut at_leader) = c.at(&url)
        && let Ok((v, _)) = at_leader
            .get_typed::<api::ClusterView>("/api/v1/cluster")
            .await
    {
        view = v;
    }
    // Each member's disk is its own to report: ask every member that answers.
    let mut disks = vec![(view.id, view.disk.clone())];
    for m in view.members.iter().filter(|m| m.id != view.id) {
        if let Ok(mut at) = c.at(&m.url)
            && let Ok((v, _)) = at.get_typed::<api::ClusterView>("/api/v1/cluster").await
        {
            disks.push((m.id, v.disk));
        }
    }
    let (verdict, facts) = diagnose(&view, &disks);
    let next_id = view.members.iter().map(|m| m.id).max().unwrap_or(0) + 1;
    let v = report_json(&facts, verdict);
    emit_or_quiet(args, &v, vec![verdict.name().to_string()], || {
        report_text(&facts, verdict, next_id)
    });
    Ok(verdict.exit_code())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(
        id: u64,
        voter: bool,
        reachable: Option<bool>,
        matched: Option<u64>,
    ) -> api::ClusterMember {
        api::ClusterMember {
            id,
            url: format!("https://m{id}:7070"),
            voter,
            role: if voter { "voter" } else { "learner" }.into(),
            matched_index: matched,
            reachable,
        }
    }

    fn view(leader: Option<u64>, members: Vec<api::ClusterMember>) -> api::ClusterView {
        api::ClusterView {
            id: 1,
            leader_id: leader,
            leader_url: None,
            term: 3,
            state: "Leader".into(),
            commit_index: 5000,
            applied_index: 5000,
            last_log_index: 5000,
            snapshot_index: None,
            members,
            cluster_id: String::new(),
            secret_checks: Default::default(),
            credential_pool: Default::default(),
            admission: Default::default(),
            observed: Default::default(),
            disk: Default::default(),
            audit_archive: Default::default(),
        }
    }

    #[test]
    fn each_cluster_verdict_from_the_leaders_view() {
        let ok = |id| member(id, true, Some(true), Some(5000));
        let (v, f) = diagnose(&view(Some(1), vec![ok(1), ok(2), ok(3)]), &[]);
        assert_eq!((v, f.margin, f.quorum), (ClusterVerdict::Healthy, 1, 2));
        // Five voters, one down: degraded, one more may fail.
        let down = member(5, true, Some(false), Some(10));
        let (v, f) = diagnose(&view(Some(1), vec![ok(1), ok(2), ok(3), ok(4), down]), &[]);
        assert_eq!(
            (v, f.margin, f.unreachable.clone()),
            (ClusterVerdict::Degraded, 1, vec![5])
        );
        // Three voters, one down: the next failure loses quorum.
        let down = member(3, true, Some(false), None);
        let (v, f) = diagnose(&view(Some(1), vec![ok(1), ok(2), down]), &[]);
        assert_eq!((v, f.margin), (ClusterVerdict::QuorumAtRisk, 0));
        // A lagging learner degrades; a single voter has no margin by design.
        let lagging = member(4, false, Some(true), Some(1000));
        let (v, f) = diagnose(&view(Some(1), vec![ok(1), ok(2), ok(3), lagging]), &[]);
        assert_eq!(
            (v, f.lagging.clone(), f.learners.clone()),
            (ClusterVerdict::Degraded, vec![(4, 4000)], vec![4])
        );
        assert_eq!(
            diagnose(&view(Some(1), vec![ok(1)]), &[]).0,
            ClusterVerdict::QuorumAtRisk
        );
        assert_eq!(
            diagnose(&view(None, vec![ok(1), ok(2), ok(3)]), &[]).0,
            ClusterVerdict::NoLeader
        );
        // The text names the replacement commands for an unreachable member.
        let (v, f) = diagnose(
            &view(
                Some(1),
                vec![ok(1), ok(2), member(3, true, Some(false), None)],
            ),
            &[],
        );
        let text = report_text(&f, v, 4);
        assert!(
            text.contains("members add 4") && text.contains("members remove 3"),
            "{text}"
        );
        // A member whose disk is under its reserve refuses writes: degraded, and named.
        let low = api::DiskView {
            free_bytes: 10 << 20,
            reserve_bytes: 256 << 20,
            alarm: true,
            alarm_since: Some("2026-12-05T05:00:00.000Z".into()),
        };
        let all = vec![ok(1), ok(2), ok(3)];
        let disks = [(1, api::DiskView::default()), (2, low)];
        let (v, f) = diagnose(&view(Some(1), all), &disks);
        assert_eq!(v, ClusterVerdict::Degraded);
        assert_eq!(
            f.disk_alarms.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
            vec![2]
        );
        assert!(report_text(&f, v, 4).contains("member 2's disk is under its reserve"));
    }
}
