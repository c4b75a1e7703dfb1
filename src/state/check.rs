//! Every invariant of the replicated state, written once. `apply` asserts them after every
//! command in debug builds (so every test that runs a debug member checks them all the time),
//! and the property test (`proptest.rs`) drives random command sequences through them.

use std::collections::BTreeMap;
use std::collections::BTreeSet;

use super::State;
use super::verify_audit_chain;
use modelforge_proto::ids::NodeId;
use modelforge_proto::ids::TokenId;

impl State {
    /// What `apply` asserts after every command in debug builds: every invariant, except that
    /// the audit chain and the request table are checked at their newest entry only (a full
    /// walk of 200,000 remembered requests after each apply would make debug members quadratic).
    pub fn check_after_apply(&self) -> Result<(), String> {
        self.check_model()?;
        let n = self.audit.len();
        if n > 0 {
            let last = &self.audit[n - 1];
            let prev = match n {
                1 => &self.audit_base.head,
                _ => &self.audit[n - 2].hash,
            };
            let seq = self.audit_base.count + n as u64;
            if last.prev_hash != *prev || last.seq != seq || last.chain_hash() != last.hash {
                return Err(format!("audit chain broken at event {n}"));
            }
        }
        if self.dedup.len() != self.dedup_order.len() {
            return Err(format!(
                "request table holds {} ids, its order {}",
                self.dedup.len(),
                self.dedup_order.len()
            ));
        }
        Ok(())
    }

    /// Check every invariant; the first one broken, in words.
    pub fn check(&self) -> Result<(), String> {
        self.check_model()?;
        if let Err(seq) = verify_audit_chain(&self.audit_base, &self.audit) {
            return Err(format!("audit chain broken at event {seq}"));
        }
        self.check_dedup()
    }

    /// The invariants of nodes, identities, credentials, tokens, hostnames and scheduling.
    fn check_model(&self) -> Result<(), String> {
        self.check_identities()?;
        self.check_credentials()?;
        self.check_tokens()?;
        self.check_operators()?;
        let index = self.hostname_index_recomputed();
        if index.iter().ne(self.enabled_by_hostname.iter()) {
            return Err(format!(
                "hostname index {:?} differs from the nodes' {index:?}",
                self.enabled_by_hostname
            ));
        }
        self.check_scheduling()
    }

    /// One identity maps to exactly one node, and every node's identity maps to it.
    fn check_identities(&self) -> Result<(), String> {
        for (key, node_id) in &self.identities {
            match self.nodes.get(node_id) {
                Some(n) if &n.public_key == key => {}
                Some(_) => return Err(format!("identity maps to node {node_id} of another key")),
                None => return Err(format!("identity maps to unknown node {node_id}")),
            }
        }
        for n in self.nodes.values() {
            if self.identities.get(&n.public_key) != Some(&n.node_id) {
                return Err(format!("node {}'s identity maps elsewhere", n.node_id));
            }
            if n.enabled == n.decommissioned_at_ms.is_some() {
                return Err(format!(
                    "node {} is enabled {} with decommissioned_at {:?}",
                    n.node_id, n.enabled, n.decommissioned_at_ms
                ));
            }
        }
        Ok(())
    }

    /// Credentials belong to the node that lists them; at most one is active per node, and
    /// only on an enabled node.
    fn check_credentials(&self) -> Result<(), String> {
        let mut listed = 0;
        for n in self.nodes.values() {
            let mut active = 0;
            for id in &n.credential_ids {
                let Some(c) = self.credentials.get(id) else {
                    return Err(format!("node {} lists unknown credential {id}", n.node_id));
                };
                if c.node_id != n.node_id {
                    return Err(format!(
                        "credential {id} listed by {} is {}'s",
                        n.node_id, c.node_id
                    ));
                }
                if c.revoked_at_ms.is_none() {
                    active += 1;
                }
                if c.revoked_at_ms.is_some() != c.revoked_reason.is_some() {
                    return Err(format!("credential {id} has a revocation time xor reason"));
                }
                listed += 1;
            }
            if active > 1 {
                return Err(format!(
                    "node {} has {active} active credentials",
                    n.node_id
                ));
            }
            if active > 0 && !n.enabled {
                return Err(format!(
                    "disabled node {} has an active credential",
                    n.node_id
                ));
            }
        }
        if listed != self.credentials.len() {
            return Err(format!(
                "{} credentials, {listed} listed by nodes",
                self.credentials.len()
            ));
        }
        Ok(())
    }

    /// A token mints at most one identity: every credential issued on it is its claimant's.
    fn check_tokens(&self) -> Result<(), String> {
        let mut holders: BTreeMap<&TokenId, BTreeSet<&NodeId>> = BTreeMap::new();
        for c in self.credentials.values() {
            if let Some(t) = &c.token_id {
                holders.entry(t).or_default().insert(&c.node_id);
            }
        }
        for (token_id, nodes) in holders {
            let Some(token) = self.tokens.get(token_id) else {
                return Err(format!("credentials issued on unknown token {token_id}"));
            };
            let Some(claim) = &token.claim else {
                return Err(format!("token {token_id} issued credentials with no claim"));
            };
            if nodes.len() > 1 || !nodes.contains(&claim.node_id) {
                return Err(format!(
                    "token {token_id} claimed by {} issued credentials to {nodes:?}",
                    claim.node_id
                ));
            }
        }
        Ok(())
    }

    /// Allocations sit on enabled nodes, no GPU is in two of them, and only enabled nodes wait
    /// for a smoke.
    fn check_scheduling(&self) -> Result<(), String> {
        let mut gpus = BTreeSet::new();
        for a in self.sched.allocations.values() {
            if !self.nodes.get(&a.node_id).is_some_and(|n| n.enabled) {
                return Err(format!(
                    "allocation {} on node {}, which is not enabled",
                    a.allocation_id, a.node_id
                ));
            }
            // A drained allocation no longer holds its GPUs (its record waits for its owner).
            for u in a.accelerator_uuids.iter().filter(|_| a.holds()) {
                if !gpus.insert(u) {
                    return Err(format!("GPU {u} is in two allocations"));
                }
            }
        }
        for (key, id) in &self.sched.by_key {
            if !self.sched.allocations.contains_key(id) {
                return Err(format!("key {key} names released allocation {id}"));
            }
        }
        for n in &self.sched.smoke_required {
            if !self.nodes.get(n).is_some_and(|n| n.enabled) {
                return Err(format!("node {n} needs a smoke but is not enabled"));
            }
        }
        Ok(())
    }

    /// The request table and its order hold the same ids, oldest first.
    fn check_dedup(&self) -> Result<(), String> {
        if self.dedup.len() != self.dedup_order.len() {
            return Err(format!(
                "request table holds {} ids, its order {}",
                self.dedup.len(),
                self.dedup_order.len()
            ));
        }
        let mut last = i64::MIN;
        for (at, id) in &self.dedup_order {
            if *at < last {
                return Err(format!("request {id} is out of order"));
            }
            last = *at;
            if self.dedup.get(id).map(|(t, _)| t) != Some(at) {
                return Err(format!("request {id} is in the order, not the table"));
            }
        }
        Ok(())
    }
}
