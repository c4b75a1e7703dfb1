//! The hostname index: hostname -> the enabled nodes claiming it, so that "which enabled nodes
//! claim H" needs no scan of every node (an enrolment asks it, and so does every node view).
//!
//! Invariant (checked by `State::check`): the index equals a recomputation from the nodes. It
//! is maintained wherever a node is created, renamed or disabled.

use std::collections::BTreeMap;
use std::collections::BTreeSet;

use super::State;
use modelforge_proto::ids::NodeId;

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
    pub(super) fn hostname_index_recomputed(&self) -> BTreeMap<String, BTreeSet<NodeId>> {
        let mut expected: BTreeMap<String, BTreeSet<NodeId>> = BTreeMap::new();
        for n in self.nodes.values().filter(|n| n.enabled) {
            expected
                .entry(n.hostname.clone())
                .or_default()
                .insert(n.node_id.clone());
        }
        expected
    }
}
