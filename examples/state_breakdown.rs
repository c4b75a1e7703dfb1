//! Where a node's bytes go in the replicated state: live heap bytes per node of each part
//! (inventories, histories, the maps, audit, dedup, indexes), counted by a wrapping global
//! allocator, for nodes enrolled as the cluster benchmark enrols them (8-GPU H200 inventory,
//! argon2id hashes, a token and an enrolment each). Heap bytes as requested: the allocator's
//! own rounding and the supervisors are in `examples/supervisor_scale` (RSS).
//!
//! `cargo run --release --example state_breakdown -- [nodes, default 10000]`

mod common;

use std::alloc::GlobalAlloc;
use std::alloc::Layout;
use std::alloc::System;
use std::sync::atomic::AtomicIsize;
use std::sync::atomic::Ordering::Relaxed;

use modelforge::state::Envelope;
use modelforge::state::State;

struct Counting;
static LIVE: AtomicIsize = AtomicIsize::new(0);
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, Relaxed);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size() as isize, Relaxed);
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        LIVE.fetch_add(n as isize - l.size() as isize, Relaxed);
        unsafe { System.realloc(p, l, n) }
    }
}
#[global_allocator]
static A: Counting = Counting;

fn main() {
    let nodes: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(10_000);
    let base = LIVE.load(Relaxed);
    let mut s = State::default();
    let inv = modelforge_devkit::h200_inventory(8);
    let mut idx = 0u64;
    for i in 0..nodes {
        for cmd in common::enrolment(i, &inv) {
            idx += 1;
            let env = Envelope {
                request_id: format!("{:032x}", idx),
                now_ms: 1_000_000,
                actor: "admin".into(),
                command: cmd,
            };
            s.apply(idx, &env);
        }
    }
    let total = LIVE.load(Relaxed) - base;
    let per = |b: isize| b as f64 / nodes as f64;
    println!(
        "total {:.0} B/node ({:.1} MiB)",
        per(total),
        total as f64 / 1048576.0
    );
    {
        println!(
            "size_of Node {} Token {} Credential {} dedup value {} Accelerator {} AuditEvent {} HistoryEvent {}",
            std::mem::size_of::<modelforge::state::Node>(),
            std::mem::size_of::<modelforge::state::Token>(),
            std::mem::size_of::<modelforge::state::Credential>(),
            std::mem::size_of::<(i64, modelforge::state::ApplyResult)>(),
            std::mem::size_of::<modelforge_proto::wire::Accelerator>(),
            std::mem::size_of::<modelforge::state::AuditEvent>(),
            std::mem::size_of::<modelforge::state::HistoryEvent>()
        );
    }
    // What a member holds after loading a snapshot of this state: decoded plainly (every
    // occurrence of an id its own copy) and as a member decodes it (ids shared while decoding).
    let bytes = modelforge_raft::codec::encode(&s).expect("encode");
    for sharing in [false, true] {
        let before = LIVE.load(Relaxed);
        let copy: State = if sharing {
            modelforge_proto::ids::decode_sharing(|| {
                modelforge_raft::codec::decode::<State>(&bytes).expect("decode")
            })
        } else {
            modelforge_raft::codec::decode(&bytes).expect("decode")
        };
        let held = LIVE.load(Relaxed) - before;
        println!(
            "decoded from a snapshot{}: {:.0} B/node",
            if sharing {
                " as a member does"
            } else {
                " plainly"
            },
            per(held)
        );
        drop(copy);
    }
    drop(bytes);
    let mut measure = |name: &str, f: &mut dyn FnMut(&mut State)| {
        let before = LIVE.load(Relaxed);
        f(&mut s);
        let after = LIVE.load(Relaxed);
        println!("{name:>22}: {:>7.0} B/node", per(before - after));
    };
    measure("inventories", &mut |s| {
        let ids: Vec<_> = s.nodes.keys().cloned().collect();
        for id in ids {
            std::sync::Arc::make_mut(s.nodes.get_mut(&id).unwrap()).inventory = Default::default();
        }
    });
    measure("history", &mut |s| {
        let ids: Vec<_> = s.nodes.keys().cloned().collect();
        for id in ids {
            std::sync::Arc::make_mut(s.nodes.get_mut(&id).unwrap()).history = Default::default();
        }
    });
    measure("nodes (rest)", &mut |s| drop(std::mem::take(&mut s.nodes)));
    measure("tokens", &mut |s| drop(std::mem::take(&mut s.tokens)));
    measure("identities", &mut |s| {
        drop(std::mem::take(&mut s.identities))
    });
    measure("credentials", &mut |s| {
        drop(std::mem::take(&mut s.credentials))
    });
    measure("audit", &mut |s| drop(std::mem::take(&mut s.audit)));
    measure("dedup", &mut |s| drop(std::mem::take(&mut s.dedup)));
    measure("dedup_order", &mut |s| {
        drop(std::mem::take(&mut s.dedup_order))
    });
    measure("enabled_by_hostname", &mut |s| {
        drop(std::mem::take(&mut s.enabled_by_hostname))
    });
    measure("sched", &mut |s| drop(std::mem::take(&mut s.sched)));
    measure("health", &mut |s| drop(std::mem::take(&mut s.health)));
    measure("rest", &mut |s| drop(std::mem::take(s)));
}
