//! A year of a fleet's churn through the real apply (issue 16, "bounded state"): how large
//! the replicated state grows, and which collection grows it.
//!
//! `cargo run --release --example year_of_churn -- [--nodes 10000] [--days 365]`
//!
//! Day 0 enrols the fleet (8 GPUs a node). Every day after: 0.3% of the nodes are re-enrolled
//! (credentials revoked, a new token, the claim, a passing capability smoke), 0.05% are
//! decommissioned (preview, execute) and replaced by new nodes, 10 tokens are cancelled and 10
//! left to expire, 200 allocations are placed and released, every credential's use is touched
//! once (the coalesced writes), and 1% of the nodes change status twice (history events).
//! Every 30 days it prints the encoded state's size and each collection's length.

use std::collections::BTreeMap;
use std::time::Instant;

use modelforge::app::Replicated;
use modelforge::state::Command;
use modelforge::state::Envelope;
use modelforge_proto::api::SmokeCheck;
use modelforge_proto::ids::HistoryKind;
use modelforge_raft::Application;

const DAY_MS: i64 = 86_400_000;
const HASH: &str =
    "$argon2id$v=19$m=19456,t=2,p=1$c2FsdHNhbHRzYWx0$aGFzaGhhc2hoYXNoaGFzaGhhc2hoYXNoaGFzaGhhc2g";

fn arg(name: &str, default: usize) -> usize {
    let a: Vec<String> = std::env::args().collect();
    a.iter()
        .position(|x| x == name)
        .and_then(|i| a.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Sim {
    app: Replicated,
    index: u64,
    now_ms: i64,
    /// Answers refused by apply, by code (a simulation that only met refusals would prove
    /// nothing about growth).
    refused: BTreeMap<String, u64>,
    seq: u64,
}

impl Sim {
    /// Apply `command`; whether apply accepted it.
    fn apply(&mut self, command: Command) -> bool {
        self.index += 1;
        self.now_ms += 1;
        let env = Envelope {
            request_id: format!("r{}", self.index),
            now_ms: self.now_ms,
            actor: "sim".into(),
            command,
        };
        let answer = self
            .app
            .apply(self.index, &modelforge_raft::codec::encode(&env).unwrap());
        let result = Replicated::decode_result(&answer);
        if let Err(r) = &result {
            *self.refused.entry(r.code.as_str().to_string()).or_default() += 1;
        }
        result.is_ok()
    }

    fn id(&mut self) -> String {
        self.seq += 1;
        format!("{:032x}", self.seq)
    }

    /// A token, claimed by `key` (a new node, or the node that holds that identity).
    fn enrol(&mut self, key: &str, hostname: &str) {
        let token = self.id();
        let (node, credential) = (self.id(), self.id());
        self.apply(Command::CreateToken {
            token_id: token.clone().into(),
            hash: HASH.into(),
            ttl_ms: 3_600_000,
            note: Some("a new node".into()),
        });
        self.apply(Command::Enroll {
            token_id: token.into(),
            public_key: key.into(),
            hostname: hostname.into(),
            inventory: modelforge_devkit::h200_inventory(8),
            new_node_id: node.into(),
            credential_id: credential.into(),
            credential_hash: HASH.into(),
            proof_signed_at_ms: self.now_ms,
        });
    }

    fn node_of(&self, key: &str) -> Option<modelforge::state::NodeId> {
        self.app.read().identities.get(key).cloned()
    }
}

fn main() {
    let nodes = arg("--nodes", 10_000);
    let days = arg("--days", 365) as i64;
    let mut sim = Sim {
        app: Replicated::default(),
        index: 0,
        now_ms: 1_000_000,
        refused: BTreeMap::new(),
        seq: 0,
    };
    let started = Instant::now();
    let mut keys: Vec<String> = (0..nodes).map(|i| format!("{i:064x}")).collect();
    for (i, key) in keys.clone().iter().enumerate() {
        sim.enrol(key, &format!("gpu-{i}"));
    }
    let mut next_key = nodes;
    println!(
        "{:>4} {:>9} {:>9} {:>11} {:>8} {:>8} {:>9} {:>9} {:>8} {:>9} {:>8} {:>10}",
        "day",
        "state MiB",
        "audit MiB",
        "history MiB",
        "nodes",
        "tokens",
        "creds",
        "audit",
        "smokes",
        "allocs",
        "dedup",
        "history"
    );
    for day in 0..=days {
        sim.now_ms = 1_000_000 + day * DAY_MS;
        if day > 0 {
            // Re-enrolments: revoke, claim a new token with the same identity, smoke.
            for k in 0..(nodes * 3 / 1000).max(1) {
                let key = keys[(day as usize * 7919 + k * 104_729) % keys.len()].clone();
                let Some(node) = sim.node_of(&key) else {
                    continue;
                };
                sim.apply(Command::RevokeCredentials {
                    node_id: node.clone(),
                    reason: "re-enrolment".into(),
                });
                sim.enrol(&key, "ignored");
                let smoke = sim.id();
                sim.apply(Command::StartSmoke {
                    smoke_id: smoke.clone().into(),
                    node_id: node.clone(),
                });
                sim.apply(Command::SmokeResult {
                    smoke_id: smoke.into(),
                    node_id: node,
                    checks: vec![SmokeCheck {
                        name: "matmul".into(),
                        ok: true,
                        detail: "ok".into(),
                    }],
                });
            }
            // Decommissions, each replaced by a new node.
            for k in 0..(nodes / 2000).max(1) {
                let at = (day as usize * 15_485_863 + k * 32_452_843) % keys.len();
                let key = keys[at].clone();
                if let Some(node) = sim.node_of(&key) {
                    let preview = sim.id();
                    sim.apply(Command::PreviewDecommission {
                        preview_id: preview.clone().into(),
                        node_id: node.clone(),
                    });
                    sim.apply(Command::ExecuteDecommission {
                        preview_id: preview.into(),
                        node_id: node,
                        reason: "hardware retired".into(),
                    });
                }
                let fresh = format!("{next_key:064x}");
                sim.enrol(&fresh, &format!("gpu-{next_key}"));
                keys[at] = fresh;
                next_key += 1;
            }
            // Tokens cancelled, and tokens left to expire.
            for k in 0..20 {
                let token = sim.id();
                sim.apply(Command::CreateToken {
                    token_id: token.clone().into(),
                    hash: HASH.into(),
                    ttl_ms: 3_600_000,
                    note: None,
                });
                if k % 2 == 0 {
                    sim.apply(Command::CancelToken {
                        token_id: token.into(),
                        reason: Some("not needed".into()),
                    });
                }
            }
            // Allocations placed and released.
            for k in 0..200 {
                let key = keys[(day as usize * 31 + k * 7_727) % keys.len()].clone();
                let Some(node) = sim.node_of(&key) else {
                    continue;
                };
                let allocation = sim.id();
                let placed = sim.apply(Command::Allocate {
                    allocation_id: allocation.clone().into(),
                    node_id: node,
                    accelerator_uuids: vec![format!(
                        "GPU-{:08x}-0000-4000-8000-000000000000",
                        k % 8
                    )],
                    owner: "training".into(),
                    idempotency_key: None,
                });
                if placed {
                    sim.apply(Command::Release {
                        allocation_id: allocation.into(),
                    });
                }
            }
            // Status changes: offline, then online again.
            let events: Vec<_> = (0..nodes / 100)
                .filter_map(|k| sim.node_of(&keys[(day as usize * 13 + k * 97) % keys.len()]))
                .flat_map(|n| {
                    [
                        (n.clone(), HistoryKind::Status, "offline".to_string(), 1),
                        (n, HistoryKind::Status, "online".to_string(), 1),
                    ]
                })
                .collect();
            sim.apply(Command::RecordEvents { events });
            // Every active credential used today (the coalesced writes).
            let uses: Vec<_> = {
                let s = sim.app.read();
                s.credentials
                    .values()
                    .filter(|c| c.revoked_at_ms.is_none())
                    .map(|c| (c.credential_id.clone(), sim.now_ms))
                    .collect()
            };
            for chunk in uses.chunks(2000) {
                sim.apply(Command::TouchCredentials {
                    uses: chunk.to_vec(),
                });
            }
        }
        if day % 30 == 0 || day == days {
            let s = sim.app.read();
            let bytes = modelforge_raft::codec::encode(&*s).unwrap().len();
            let history: usize = s.nodes.values().map(|n| n.history.len()).sum();
            let mib = |b: usize| b as f64 / (1 << 20) as f64;
            let audit_bytes = modelforge_raft::codec::encode(&s.audit).unwrap().len();
            let history_bytes: usize = s
                .nodes
                .values()
                .map(|n| modelforge_raft::codec::encode(&n.history).unwrap().len())
                .sum();
            println!(
                "{day:>4} {:>9.1} {:>9.1} {:>11.1} {:>8} {:>8} {:>9} {:>9} {:>8} {:>9} {:>8} {:>10}",
                mib(bytes),
                mib(audit_bytes),
                mib(history_bytes),
                s.nodes.len(),
                s.tokens.len(),
                s.credentials.len(),
                s.audit.len(),
                s.sched.smokes.len(),
                s.sched.allocations.len(),
                s.dedup.len(),
                history
            );
        }
    }
    println!(
        "{} commands applied in {:.1} s; refused by apply: {:?}",
        sim.index,
        started.elapsed().as_secs_f64(),
        sim.refused
    );
}
