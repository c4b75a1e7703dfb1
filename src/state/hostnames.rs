//! The hostname index: hostname -> the enabled nodes claiming it, so that "which enabled nodes
//! claim H" needs no scan of every node (an enrolment asks it, and so does every node view).
//!
//! Invariant (checked by `State::check`): the index equals a recomputation from the nodes. It
//! is maintained wherever a node is created, renamed or disabled.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde::Deserializer;
use serde::Serialize;

use super::State;
use modelforge_proto::ids::NodeId;

/// The enabled nodes claiming one hostname, in id order, without repeats: almost always one,
/// so a sorted `Vec` (24 bytes and one id) rather than a `BTreeSet` (a leaf of eleven slots).
/// It encodes exactly as the `BTreeSet` it replaced (a length, then the ids in order); decoding
/// sorts and drops repeats, so damaged input cannot break the order the lookups rely on.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Claimants(Vec<NodeId>);

impl Claimants {
    pub fn iter(&self) -> std::slice::Iter<'_, NodeId> {
        self.0.iter()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn insert(&mut self, id: NodeId) {
        if let Err(at) = self.0.binary_search(&id) {
            self.0.insert(at, id);
        }
    }

    fn remove(&mut self, id: &NodeId) {
        if let Ok(at) = self.0.binary_search(id) {
            self.0.remove(at);
        }
    }
}

impl<'de> Deserialize<'de> for Claimants {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let mut ids = Vec::<NodeId>::deserialize(d)?;
        ids.sort();
        ids.dedup();
        Ok(Self(ids))
    }
}

impl State {
    /// Enabled nodes claiming `hostname`, in id order.
    pub fn enabled_claimants(&self, hostname: &str) -> Vec<NodeId> {
        self.enabled_by_hostname
            .get(hostname)
            .map(|ids| ids.iter().cloned().collect())
            .unwrap_or_default()
    }

    pub(super) fn index_hostname(&mut self, hostname: &str, node_id: &NodeId) {
        self.enabled_by_hostname
            .entry(hostname.to_string())
            .or_default()
            .insert(node_id.clone());
    }

    pub(super) fn unindex_hostname(&mut self, hostname: &str, node_id: &NodeId) {
        if let Some(ids) = self.enabled_by_hostname.get_mut(hostname) {
            ids.remove(node_id);
            if ids.is_empty() {
                self.enabled_by_hostname.remove(hostname);
            }
        }
    }

    /// The index as the nodes say it should be.
    pub(super) fn hostname_index_recomputed(&self) -> BTreeMap<String, Claimants> {
        let mut expected: BTreeMap<String, Claimants> = BTreeMap::new();
        for n in self.nodes.values().filter(|n| n.enabled) {
            expected
                .entry(n.hostname.clone())
                .or_default()
                .insert(n.node_id.clone());
        }
        expected
    }
}
