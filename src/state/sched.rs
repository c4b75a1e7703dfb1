//! The replicated part of the scheduler and of the capability smoke.
//!
//! Placement is chosen by the leader from what it has *measured* (accelerators verified by a
//! report since it rebuilt its view; `server/scheduler.rs`); apply re-checks everything that
//! the replicated state can check (node enabled, GPUs in its inventory and free), so that two
//! placements racing for one GPU can never both succeed: the second is refused `no_capacity`.
//!
//! After a restore every allocation is `unconfirmed` and every enabled node needs a passing
//! smoke before it is offered again (`backup::prepare` sets both); the node's first fresh
//! report reconciles its allocations (`Reconcile`): confirmed when its GPUs are present and
//! busy, released when a GPU vanished or nothing runs on them, and GPUs busy without an
//! allocation are marked in use outside the scheduler.

use imbl::OrdMap;
use imbl::OrdSet;
use std::collections::BTreeSet;
use std::sync::Arc;

use serde::Deserialize;
use serde::Serialize;

use modelforge_proto::api::ErrorCode as RefusalCode;

use super::ApplyResult;
use super::Outcome;
use super::Refusal;
use super::State;
use super::push_history;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Allocation {
    pub allocation_id: AllocationId,
    pub node_id: NodeId,
    pub accelerator_uuids: Vec<String>,
    pub owner: String,
    pub created_at_ms: i64,
    /// False after a restore until the node's fresh report confirms it.
    pub confirmed: bool,
    /// The request id made from the Idempotency-Key, when the request had one.
    pub idempotency_key: Option<String>,
    /// What its owner must know: `drained` (its GPUs are released) or `gpu_failed`.
    pub mark: Option<AllocationState>,
}

impl Allocation {
    /// Whether it still holds its GPUs (a drained one does not).
    pub fn holds(&self) -> bool {
        self.mark != Some(AllocationState::Drained)
    }

    /// The state its owner sees.
    pub fn state(&self) -> AllocationState {
        match self.mark {
            Some(mark) => mark,
            None if self.confirmed => AllocationState::Confirmed,
            None => AllocationState::Unconfirmed,
        }
    }
}

/// One check of a smoke (the API's type: it is shown as reported).
pub use modelforge_proto::api::SmokeCheck;
use modelforge_proto::ids::AllocationId;
use modelforge_proto::ids::AllocationState;
use modelforge_proto::ids::HistoryKind;
use modelforge_proto::ids::NodeId;
use modelforge_proto::ids::SmokeId;
pub use modelforge_proto::ids::SmokeState;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Smoke {
    pub smoke_id: SmokeId,
    pub node_id: NodeId,
    pub state: SmokeState,
    pub checks: Vec<SmokeCheck>,
    pub created_at_ms: i64,
    pub finished_at_ms: Option<i64>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Scheduling {
    #[serde(deserialize_with = "super::persist::map")]
    pub allocations: OrdMap<AllocationId, Allocation>,
    /// Request id made from an Idempotency-Key -> allocation id (a retry returns the first
    /// result; the same key with another body is refused).
    #[serde(deserialize_with = "super::persist::map")]
    pub by_key: OrdMap<String, AllocationId>,
    /// node -> GPUs seen busy in its latest report without an allocation.
    #[serde(deserialize_with = "super::persist::map")]
    pub external_busy: OrdMap<NodeId, BTreeSet<String>>,
    /// Nodes that must pass a smoke before they are offered (re-enrolled, or restored).
    #[serde(deserialize_with = "super::persist::set")]
    pub smoke_required: OrdSet<NodeId>,
    #[serde(deserialize_with = "super::persist::map")]
    pub smokes: OrdMap<SmokeId, Smoke>,
}

impl Scheduling {
    /// GPUs of `node_id` held by an allocation.
    pub fn allocated(&self, node_id: &NodeId) -> BTreeSet<&str> {
        self.allocations
            .values()
            .filter(|a| a.node_id == node_id && a.holds())
            .flat_map(|a| a.accelerator_uuids.iter().map(String::as_str))
            .collect()
    }

    /// Of the GPUs a node reports `busy`, those no allocation of the node holds.
    pub fn busy_outside<'a>(
        &self,
        node_id: &NodeId,
        busy: impl IntoIterator<Item = &'a str>,
    ) -> BTreeSet<&'a str> {
        let allocated = self.allocated(node_id);
        busy.into_iter()
            .filter(|u| !allocated.contains(u))
            .collect()
    }

    /// Whether `outside` ([`Self::busy_outside`] of a report) differs from what the state
    /// records as busy outside the scheduler on `node_id` (nothing recorded: empty). Both the
    /// heartbeat's check and the reconcile's apply ask it, without copying either set.
    pub fn busy_outside_changed(&self, node_id: &NodeId, outside: &BTreeSet<&str>) -> bool {
        let recorded = self.external_busy.get(node_id);
        recorded.map_or(0, BTreeSet::len) != outside.len()
            || !recorded
                .into_iter()
                .flatten()
                .map(String::as_str)
                .eq(outside.iter().copied())
    }

    /// GPUs held by any allocation on any node (a uuid names one physical device).
    pub fn allocated_anywhere(&self) -> BTreeSet<&str> {
        self.allocations
            .values()
            .filter(|a| a.holds())
            .flat_map(|a| a.accelerator_uuids.iter().map(String::as_str))
            .collect()
    }

    /// The pending smoke of a node, if any (the oldest).
    pub fn pending_smoke(&self, node_id: &NodeId) -> Option<&Smoke> {
        self.smokes
            .values()
            .filter(|s| s.node_id == node_id && s.state == SmokeState::Pending)
            .min_by_key(|s| s.created_at_ms)
    }

    /// Mark everything restored from a backup as untrusted until measured again.
    pub fn distrust_after_restore(&mut self, enabled_nodes: impl Iterator<Item = NodeId>) {
        self.allocations = std::mem::take(&mut self.allocations)
            .into_iter()
            .map(|(id, a)| {
                (
                    id,
                    Allocation {
                        confirmed: false,
                        ..a
                    },
                )
            })
            .collect();
        self.external_busy.clear();
        self.smoke_required.extend(enabled_nodes);
    }
}

fn allocated_outcome(a: &Allocation) -> Outcome {
    Outcome::Allocated {
        allocation_id: a.allocation_id.clone(),
        node_id: a.node_id.clone(),
        accelerator_uuids: a.accelerator_uuids.clone(),
    }
}

impl State {
    pub(super) fn allocate(
        &mut self,
        now: i64,
        allocation_id: &AllocationId,
        node_id: &NodeId,
        uuids: &[String],
        owner: &str,
        key: Option<&String>,
    ) -> ApplyResult {
        if let Some(existing) = key
            .and_then(|k| self.sched.by_key.get(k))
            .and_then(|id| self.sched.allocations.get(id))
        {
            return Ok(allocated_outcome(existing));
        }
        if key.is_some_and(|k| super::idempotency_key_reused(&self.sched.by_key, k)) {
            return Err(super::key_reused());
        }
        let no_capacity = |m: &str| {
            Err(Refusal::with(
                RefusalCode::NoCapacity,
                format!("nothing fits: {m}"),
            ))
        };
        let Some(node) = self.nodes.get(node_id) else {
            return no_capacity("the chosen node does not exist");
        };
        if !node.enabled || node.decommissioned_at_ms.is_some() {
            return no_capacity("the chosen node is not enabled");
        }
        if self.health.cordons.contains_key(node_id) {
            return no_capacity("the chosen node is cordoned");
        }
        if uuids.is_empty() {
            return Err(Refusal::new(RefusalCode::InvalidAllocation));
        }
        let taken = self.sched.allocated_anywhere();
        let busy = self.sched.external_busy.get(node_id);
        let mut seen = BTreeSet::new();
        for u in uuids {
            let in_inventory = node.inventory.accelerators.iter().any(|a| &a.uuid == u);
            if !in_inventory
                || taken.contains(u.as_str())
                || busy.is_some_and(|b| b.contains(u))
                || !self.health.placeable(node_id, u)
                || !seen.insert(u)
            {
                return no_capacity("an accelerator of the placement was taken meanwhile");
            }
        }
        let a = Allocation {
            allocation_id: allocation_id.clone(),
            node_id: node_id.clone(),
            accelerator_uuids: uuids.to_vec(),
            owner: owner.to_string(),
            created_at_ms: now,
            confirmed: true,
            idempotency_key: key.cloned(),
            mark: None,
        };
        let out = allocated_outcome(&a);
        if let Some(k) = key {
            self.sched.by_key.insert(k.clone(), allocation_id.clone());
        }
        self.sched.allocations.insert(allocation_id.clone(), a);
        if let Some(n) = self.nodes.get_mut(node_id).map(Arc::make_mut) {
            push_history(
                n,
                now,
                HistoryKind::AllocationCreated,
                format!("{allocation_id} for {owner}: {}", uuids.join(",")),
            );
        }
        Ok(out)
    }

    pub(super) fn release(
        &mut self,
        now: i64,
        allocation_id: &AllocationId,
        why: &str,
    ) -> ApplyResult {
        let Some(a) = self.sched.allocations.remove(allocation_id) else {
            return Err(Refusal::new(RefusalCode::AllocationNotFound));
        };
        if let Some(k) = &a.idempotency_key {
            self.sched.by_key.remove(k);
        }
        if let Some(n) = self.nodes.get_mut(&a.node_id).map(Arc::make_mut) {
            push_history(
                n,
                now,
                HistoryKind::AllocationReleased,
                format!("{allocation_id}: {why}"),
            );
        }
        Ok(Outcome::Released {
            allocation_id: allocation_id.clone(),
        })
    }

    /// A fresh report of `node_id`: the GPUs present, and those running something.
    pub(super) fn reconcile(
        &mut self,
        now: i64,
        node_id: &NodeId,
        present: &BTreeSet<String>,
        busy: &BTreeSet<String>,
    ) -> ApplyResult {
        if !self.nodes.contains_key(node_id) {
            return Err(Refusal::new(RefusalCode::NodeNotFound));
        }
        let mut confirmed = vec![];
        let mut released = vec![];
        let ids: Vec<AllocationId> = self
            .sched
            .allocations
            .values()
            .filter(|a| a.node_id == node_id && !a.confirmed && a.holds())
            .map(|a| a.allocation_id.clone())
            .collect();
        for id in ids {
            let a = &self.sched.allocations[&id];
            let vanished = a.accelerator_uuids.iter().find(|u| !present.contains(*u));
            let runs = a.accelerator_uuids.iter().any(|u| busy.contains(u));
            if let Some(u) = vanished {
                let why = format!("GPU {u} vanished (found by the first report after a restore)");
                let _ = self.release(now, &id, &why);
                released.push(id);
            } else if !runs {
                let why = "the node no longer runs it (first report after a restore)";
                let _ = self.release(now, &id, why);
                released.push(id);
            } else if let Some(a) = self.sched.allocations.get_mut(&id) {
                a.confirmed = true;
                confirmed.push(id.clone());
                if let Some(n) = self.nodes.get_mut(node_id).map(Arc::make_mut) {
                    push_history(
                        n,
                        now,
                        HistoryKind::AllocationConfirmed,
                        format!("{id}: measured busy"),
                    );
                }
            }
        }
        let external = self
            .sched
            .busy_outside(node_id, busy.iter().map(String::as_str));
        if self.sched.busy_outside_changed(node_id, &external) {
            if let Some(n) = self.nodes.get_mut(node_id).map(Arc::make_mut) {
                let list: Vec<&str> = external.iter().copied().collect();
                push_history(
                    n,
                    now,
                    HistoryKind::AcceleratorsBusyOutsideScheduler,
                    if list.is_empty() {
                        "none".into()
                    } else {
                        list.join(",")
                    },
                );
            }
            if external.is_empty() {
                self.sched.external_busy.remove(node_id);
            } else {
                let owned = external.into_iter().map(String::from).collect();
                self.sched.external_busy.insert(node_id.clone(), owned);
            }
        }
        Ok(Outcome::Reconciled {
            confirmed,
            released,
        })
    }

    pub(super) fn start_smoke(
        &mut self,
        now: i64,
        smoke_id: &SmokeId,
        node_id: &NodeId,
    ) -> ApplyResult {
        let Some(node) = self.nodes.get_mut(node_id).map(Arc::make_mut) else {
            return Err(Refusal::new(RefusalCode::NodeNotFound));
        };
        if node.decommissioned_at_ms.is_some() {
            return Err(Refusal::new(RefusalCode::NodeDecommissioned));
        }
        if self.sched.smokes.contains_key(smoke_id) {
            return Err(Refusal::new(RefusalCode::SmokeExists));
        }
        push_history(node, now, HistoryKind::SmokeRequested, smoke_id.to_string());
        self.sched.smokes.insert(
            smoke_id.clone(),
            Smoke {
                smoke_id: smoke_id.clone(),
                node_id: node_id.clone(),
                state: SmokeState::Pending,
                checks: vec![],
                created_at_ms: now,
                finished_at_ms: None,
            },
        );
        Ok(Outcome::SmokeStarted {
            smoke_id: smoke_id.clone(),
        })
    }

    pub(super) fn smoke_result(
        &mut self,
        now: i64,
        smoke_id: &SmokeId,
        node_id: &NodeId,
        checks: &[SmokeCheck],
    ) -> ApplyResult {
        let Some(smoke) = self.sched.smokes.get_mut(smoke_id) else {
            return Err(Refusal::new(RefusalCode::SmokeNotFound));
        };
        if smoke.node_id != node_id {
            return Err(Refusal::new(RefusalCode::WrongNode));
        }
        if smoke.state != SmokeState::Pending {
            return Ok(Outcome::SmokeFinished {
                passed: smoke.state == SmokeState::Passed,
            });
        }
        let passed = !checks.is_empty() && checks.iter().all(|c| c.ok);
        smoke.state = if passed {
            SmokeState::Passed
        } else {
            SmokeState::Failed
        };
        smoke.checks = checks.to_vec();
        smoke.finished_at_ms = Some(now);
        if passed {
            self.sched.smoke_required.remove(node_id);
        }
        if let Some(n) = self.nodes.get_mut(node_id).map(Arc::make_mut) {
            let failed: Vec<&str> = checks
                .iter()
                .filter(|c| !c.ok)
                .map(|c| c.name.as_str())
                .collect();
            let detail = if passed {
                format!("{smoke_id}: {} checks passed", checks.len())
            } else {
                format!("{smoke_id}: failed {}", failed.join(", "))
            };
            push_history(
                n,
                now,
                if passed {
                    HistoryKind::SmokePassed
                } else {
                    HistoryKind::SmokeFailed
                },
                detail,
            );
        }
        Ok(Outcome::SmokeFinished { passed })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `busy_outside` and `busy_outside_changed` (the heartbeat's check and the reconcile's)
    /// answer as set arithmetic on the masks does, over every combination of 4 GPUs busy,
    /// allocated and recorded, with and without a record for the node, and with a drained
    /// allocation (which holds nothing).
    #[test]
    fn busy_outside_changed_agrees_with_comparing_the_sets() {
        let uuids = ["GPU-a", "GPU-b", "GPU-c", "GPU-d"];
        let pick = |mask: u32| -> Vec<&str> {
            (0..4)
                .filter(|i| mask & (1 << i) != 0)
                .map(|i| uuids[i])
                .collect()
        };
        let node = NodeId::parse("n1").unwrap();
        let other = NodeId::parse("n2").unwrap();
        let mut checked = 0;
        for allocated in 0..16u32 {
            for drained in [false, true] {
                for recorded in 0..17u32 {
                    let mut s = Scheduling::default();
                    let alloc = |node_id: &NodeId, mask: u32, mark| Allocation {
                        allocation_id: AllocationId::random(),
                        node_id: node_id.clone(),
                        accelerator_uuids: pick(mask).into_iter().map(String::from).collect(),
                        owner: "t".into(),
                        created_at_ms: 0,
                        confirmed: true,
                        idempotency_key: None,
                        mark,
                    };
                    let mark = drained.then_some(AllocationState::Drained);
                    let a = alloc(&node, allocated, mark);
                    s.allocations.insert(a.allocation_id.clone(), a);
                    // Another node's allocation of the same uuids changes nothing here.
                    let b = alloc(&other, 15, None);
                    s.allocations.insert(b.allocation_id.clone(), b);
                    if recorded < 16 {
                        let set = pick(recorded).into_iter().map(String::from).collect();
                        s.external_busy.insert(node.clone(), set);
                    }
                    for busy in 0..16u32 {
                        let held = if drained { 0 } else { allocated };
                        let outside_mask = busy & !held;
                        let outside = s.busy_outside(&node, pick(busy));
                        assert_eq!(outside, pick(outside_mask).into_iter().collect());
                        let expected = outside_mask != if recorded < 16 { recorded } else { 0 };
                        assert_eq!(
                            s.busy_outside_changed(&node, &outside),
                            expected,
                            "allocated {allocated:04b} drained {drained} recorded {recorded} busy {busy:04b}"
                        );
                        checked += 1;
                    }
                }
            }
        }
        assert_eq!(checked, 16 * 2 * 17 * 16);
    }
}
