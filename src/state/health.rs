//! GPU health and cordons, replicated (ARCHITECTURE.md "GPU health").
//!
//! A GPU is absent from [`Fleet::gpus`] while it is healthy, uncordoned and never cleared; an
//! entry holds what differs. Health changes arrive as `GpuHealth` commands proposed by the
//! member that received the report, only on a transition; apply is idempotent (the same
//! health again changes nothing, so racing proposals of one transition record it once).
//! `failed` cordons the GPU and is sticky: only an operator's GPU uncordon lifts it, which
//! also sets the GPU's clearing time (events that have not grown since are not judged again).

use std::collections::BTreeMap;
use std::sync::Arc;

use imbl::OrdMap;
use serde::Deserialize;
use serde::Serialize;

use modelforge_proto::api::ErrorCode as RefusalCode;
use modelforge_proto::gpu_health::Health;
use modelforge_proto::ids::AllocationState;
use modelforge_proto::ids::HistoryKind;
use modelforge_proto::ids::NodeId;

use super::ApplyResult;
use super::Node;
use super::Outcome;
use super::Refusal;
use super::State;
use super::push_history;

/// What the replicated state knows of one GPU beyond "healthy".
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct GpuRecord {
    pub health: Health,
    /// The event that set `health` (`xid 79`), empty when healthy.
    pub cause: String,
    pub since_ms: i64,
    /// Cordoned for health (set by `failed`, lifted only by an operator).
    pub cordoned: bool,
    /// When an operator last uncordoned it: events whose `last_at` is not later are not
    /// judged again (the agent's counts only grow).
    pub cleared_at_ms: Option<i64>,
}

impl GpuRecord {
    fn healthy(now: i64) -> Self {
        GpuRecord {
            health: Health::Healthy,
            cause: String::new(),
            since_ms: now,
            cordoned: false,
            cleared_at_ms: None,
        }
    }
}

/// An operator's node cordon.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Cordon {
    pub reason: String,
    pub at_ms: i64,
    pub by: String,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Fleet {
    /// node -> uuid -> record (only GPUs that are not plainly healthy).
    #[serde(deserialize_with = "super::persist::map")]
    pub gpus: OrdMap<NodeId, BTreeMap<String, GpuRecord>>,
    /// Nodes an operator cordoned (or drained).
    #[serde(deserialize_with = "super::persist::map")]
    pub cordons: OrdMap<NodeId, Cordon>,
}

impl Fleet {
    pub fn gpu(&self, node_id: &NodeId, uuid: &str) -> Option<&GpuRecord> {
        self.gpus.get(node_id).and_then(|g| g.get(uuid))
    }

    /// A GPU's health as recorded (healthy when nothing is).
    pub fn health(&self, node_id: &NodeId, uuid: &str) -> Health {
        self.gpu(node_id, uuid)
            .map_or(Health::Healthy, |g| g.health)
    }

    /// Whether the scheduler may place on this GPU: healthy and not cordoned.
    pub fn placeable(&self, node_id: &NodeId, uuid: &str) -> bool {
        self.gpu(node_id, uuid)
            .is_none_or(|g| g.health == Health::Healthy && !g.cordoned)
    }

    /// When an operator last cleared this GPU (events up to then are not judged again).
    pub fn cleared_at(&self, node_id: &NodeId, uuid: &str) -> Option<i64> {
        self.gpu(node_id, uuid).and_then(|g| g.cleared_at_ms)
    }

    /// The node's worst GPU health among `uuids`.
    pub fn worst<'a>(&self, node_id: &NodeId, uuids: impl Iterator<Item = &'a str>) -> Health {
        uuids
            .map(|u| self.health(node_id, u))
            .max()
            .unwrap_or(Health::Healthy)
    }
}

/// The node, if it exists and is not decommissioned (health and cordons are for nodes in
/// service; a decommissioned node's records are dropped with it). It borrows only the node
/// map, so the caller may still read and change the health records.
fn in_service<'a>(
    nodes: &'a mut OrdMap<NodeId, Arc<Node>>,
    node_id: &NodeId,
) -> Result<&'a mut Node, Refusal> {
    match nodes.get_mut(node_id).map(Arc::make_mut) {
        None => Err(Refusal::new(RefusalCode::NodeNotFound)),
        Some(n) if n.decommissioned_at_ms.is_some() => {
            Err(Refusal::new(RefusalCode::NodeDecommissioned))
        }
        Some(n) => Ok(n),
    }
}

impl State {
    /// A reported health transition of one GPU.
    #[allow(clippy::too_many_arguments)] // a transition and the state it was judged from
    pub(super) fn gpu_health(
        &mut self,
        now: i64,
        node_id: &NodeId,
        uuid: &str,
        from: Health,
        cleared_at_ms: Option<i64>,
        health: Health,
        cause: &str,
    ) -> ApplyResult {
        let node = in_service(&mut self.nodes, node_id)?;
        // Judged from a record that has changed since (another transition, an operator's
        // clearing): stale evidence, dropped; the next report judges again.
        let rec = self.health.gpu(node_id, uuid);
        if rec.map_or(Health::Healthy, |r| r.health) != from
            || rec.and_then(|r| r.cleared_at_ms) != cleared_at_ms
        {
            return Ok(Outcome::GpuHealthRecorded { changed: false });
        }
        if !node.inventory.accelerators.iter().any(|a| a.uuid == uuid) {
            return Err(Refusal::with(
                RefusalCode::InvalidBody,
                "no such accelerator in the node's inventory",
            ));
        }
        let gpus = self.health.gpus.entry(node_id.clone()).or_default();
        let rec = gpus
            .entry(uuid.to_string())
            .or_insert_with(|| GpuRecord::healthy(now));
        // `failed` is sticky until an operator uncordons the GPU.
        let sticky = rec.health == Health::Failed && rec.cordoned;
        let changed = !sticky && rec.health != health;
        if changed {
            rec.health = health;
            rec.cause = if health == Health::Healthy {
                String::new()
            } else {
                cause.to_string()
            };
            rec.since_ms = now;
            if health == Health::Failed {
                rec.cordoned = true;
            }
            let detail = if health == Health::Healthy {
                format!("{uuid} healthy")
            } else {
                format!("{uuid} {}: {cause}", health.as_str())
            };
            push_history(node, now, HistoryKind::GpuHealth, detail);
        }
        let drop_entry = *rec == GpuRecord::healthy(rec.since_ms);
        if drop_entry {
            gpus.remove(uuid);
        }
        if gpus.is_empty() {
            self.health.gpus.remove(node_id);
        }
        if changed && health == Health::Failed {
            self.mark_allocations_on(now, node_id, uuid, cause);
        }
        Ok(Outcome::GpuHealthRecorded { changed })
    }

    /// Allocations holding `uuid` learn that it failed (their owners should move them).
    fn mark_allocations_on(&mut self, now: i64, node_id: &NodeId, uuid: &str, cause: &str) {
        let hit: Vec<_> = self
            .sched
            .allocations
            .values()
            .filter(|a| a.node_id == node_id && a.accelerator_uuids.iter().any(|u| u == uuid))
            .filter(|a| a.mark.is_none())
            .map(|a| a.allocation_id.clone())
            .collect();
        for id in hit {
            if let Some(a) = self.sched.allocations.get_mut(&id) {
                a.mark = Some(AllocationState::GpuFailed);
            }
            if let Some(n) = self.nodes.get_mut(node_id).map(Arc::make_mut) {
                push_history(
                    n,
                    now,
                    HistoryKind::AllocationMarked,
                    format!("{id}: gpu_failed (GPU {uuid}: {cause})"),
                );
            }
        }
    }

    /// An operator's cordon (`drain` also releases the node's allocations, marked `drained`).
    pub(super) fn cordon(
        &mut self,
        now: i64,
        actor: &str,
        node_id: &NodeId,
        reason: &str,
        drain: bool,
    ) -> ApplyResult {
        let node = in_service(&mut self.nodes, node_id)?;
        let kind = if drain {
            HistoryKind::Drained
        } else {
            HistoryKind::Cordoned
        };
        push_history(node, now, kind, format!("{reason} (by {actor})"));
        self.health.cordons.insert(
            node_id.clone(),
            Cordon {
                reason: reason.to_string(),
                at_ms: now,
                by: actor.to_string(),
            },
        );
        let mut drained = vec![];
        if drain {
            let ids: Vec<_> = self
                .sched
                .allocations
                .values()
                .filter(|a| a.node_id == node_id && a.mark != Some(AllocationState::Drained))
                .map(|a| a.allocation_id.clone())
                .collect();
            for id in ids {
                if let Some(a) = self.sched.allocations.get_mut(&id) {
                    a.mark = Some(AllocationState::Drained);
                }
                if let Some(n) = self.nodes.get_mut(node_id).map(Arc::make_mut) {
                    push_history(
                        n,
                        now,
                        HistoryKind::AllocationReleased,
                        format!("{id}: drained ({reason})"),
                    );
                }
                drained.push(id);
            }
        }
        Ok(Outcome::Cordoned { drained })
    }

    /// An operator lifts the node's cordon (GPU cordons stay).
    pub(super) fn uncordon(
        &mut self,
        now: i64,
        actor: &str,
        node_id: &NodeId,
        reason: &str,
    ) -> ApplyResult {
        let node = in_service(&mut self.nodes, node_id)?;
        if self.health.cordons.remove(node_id).is_some() {
            push_history(
                node,
                now,
                HistoryKind::Uncordoned,
                format!("{reason} (by {actor})"),
            );
        }
        Ok(Outcome::Cordoned { drained: vec![] })
    }

    /// An operator lifts a GPU's health cordon (after a reset): it is healthy again until
    /// events that grew after now say otherwise.
    pub(super) fn uncordon_gpu(
        &mut self,
        now: i64,
        actor: &str,
        node_id: &NodeId,
        uuid: &str,
        reason: &str,
    ) -> ApplyResult {
        let node = in_service(&mut self.nodes, node_id)?;
        if !node.inventory.accelerators.iter().any(|a| a.uuid == uuid) {
            return Err(Refusal::with(
                RefusalCode::NotFound,
                "the node has no accelerator with that uuid",
            ));
        }
        push_history(
            node,
            now,
            HistoryKind::Uncordoned,
            format!("{uuid}: {reason} (by {actor})"),
        );
        let was = self.health.health(node_id, uuid);
        if was != Health::Healthy {
            push_history(
                node,
                now,
                HistoryKind::GpuHealth,
                format!("{uuid} healthy: cleared by {actor}"),
            );
        }
        let gpus = self.health.gpus.entry(node_id.clone()).or_default();
        gpus.insert(
            uuid.to_string(),
            GpuRecord {
                cleared_at_ms: Some(now),
                ..GpuRecord::healthy(now)
            },
        );
        Ok(Outcome::Cordoned { drained: vec![] })
    }
}
