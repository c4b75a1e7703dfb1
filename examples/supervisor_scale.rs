//! Scale of the node supervision tree: memory per node and total RSS of a member's replicated
//! state plus supervisors, and the time to rebuild every supervisor (a leader change), at
//! 10,000 and 100,000 enrolled nodes; and apply's longest pause while a snapshot is built,
//! as the member builds it (capture, then encode while apply goes on) and, for comparison, as
//! it did before (the whole encode under the state's lock).
//!
//! `cargo run --release --example supervisor_scale -- [--nodes 10000,100000] [--shards 16]`
//! Each size runs in a fresh child process so that RSS figures do not mix.

mod common;

use std::sync::Arc;
use std::time::Instant;

use modelforge::app::Replicated;
use modelforge::state::Command;
use modelforge::state::Envelope;
use modelforge::supervisor::Supervision;
use modelforge_raft::Application;

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

fn arg(name: &str) -> Option<String> {
    let a: Vec<String> = std::env::args().collect();
    a.iter()
        .position(|x| x == name)
        .and_then(|i| a.get(i + 1))
        .cloned()
}

async fn one(nodes: usize, shards: usize) {
    let base = rss_kib();
    let app = Arc::new(Replicated::default());
    let mut idx = 0u64;
    let inv = modelforge_devkit::h200_inventory(8);
    let t = Instant::now();
    for i in 0..nodes {
        for cmd in common::enrolment(i, &inv) {
            idx += 1;
            let env = Envelope {
                request_id: format!("r{idx}"),
                now_ms: 1_000_000,
                actor: "bench".into(),
                command: cmd,
            };
            app.apply(idx, &modelforge_raft::codec::encode(&env).unwrap());
        }
    }
    let fill = t.elapsed();
    let after_state = rss_kib();
    let t = Instant::now();
    let snapshot_bytes = app.snapshot()().len();
    let encode = t.elapsed();
    let sup = Supervision::start(app.clone(), shards, 2_000_000)
        .await
        .unwrap();
    let t = Instant::now();
    while sup.all().await.len() < nodes {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let first_build = t.elapsed();
    // One sample, as the heartbeat path encodes it (`supervisor::encode_sample`).
    let telemetry: modelforge_proto::wire::Telemetry = serde_json::from_str(r#"{"accelerators":[{"uuid":"GPU-0","utilization_pct":50.0,"memory_used_mib":61234.0,"temperature_c":71.0,"power_draw_w":612.4}]}"#).unwrap();
    let sample = modelforge::supervisor::encode_sample(&telemetry);
    for i in 0..nodes {
        sup.heartbeat(
            &format!("{i:08x}-0000-4000-8000-000000000000").into(),
            2_000_001,
            sample.clone(),
            true,
        );
    }
    let _ = sup.all().await;
    let after_sup = rss_kib();
    // A leader change: every shard rebuilds from the replicated state.
    let t = Instant::now();
    sup.rebuild(3_000_000);
    let _ = sup.all().await; // every shard has processed its rebuild once it answers this
    let rebuild = t.elapsed();
    println!(
        "{nodes:>7} nodes, {shards} shards: state {:.0} MiB, + supervisors {:.0} MiB, total RSS {:.0} MiB ({:.1} KiB/node); fill {:.1} s, first build {:.0} ms, rebuild after a leader change {:.0} ms; snapshot {:.0} MiB encoded in {:.0} ms",
        (after_state.saturating_sub(base)) as f64 / 1024.0,
        (after_sup.saturating_sub(after_state)) as f64 / 1024.0,
        after_sup as f64 / 1024.0,
        (after_sup.saturating_sub(base)) as f64 / nodes as f64,
        fill.as_secs_f64(),
        first_build.as_secs_f64() * 1000.0,
        rebuild.as_secs_f64() * 1000.0,
        snapshot_bytes as f64 / (1 << 20) as f64,
        encode.as_secs_f64() * 1000.0,
    );
    // Last, so that the copies apply makes meanwhile do not count in the figures above.
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1000.0;
    let (floor, floor_999, _) = apply_pauses(&app, idx, Build::None);
    let (max, p999, n) = apply_pauses(&app, idx + 10_000_000, Build::Captured);
    let (locked, _, _) = apply_pauses(&app, idx + 20_000_000, Build::UnderLock);
    println!(
        "{nodes:>7} nodes: apply while a snapshot is built: longest {:.2} ms, p99.9 {:.3} ms over {n} applies (no snapshot: longest {:.2} ms, p99.9 {:.3} ms; the encode under the lock, as before: longest {:.0} ms)",
        ms(max),
        ms(p999),
        ms(floor),
        ms(floor_999),
        ms(locked)
    );
    // The hourly prune runs inside an apply, under the state's lock: a scan that finds nothing
    // to forget, then one a month later that moves every audit event of the fill to the
    // archive, and the archive's write and fsync as a member does it (also under the lock).
    let mut s = app.read().clone();
    let t = Instant::now();
    let none = s.prune_finished(1_000_001);
    let scan = t.elapsed();
    assert!(none.is_empty());
    let t = Instant::now();
    let moved = s.prune_finished(1_000_001 + modelforge::state::RETENTION_MS);
    let archive_move = t.elapsed();
    let dir = std::env::temp_dir().join(format!("mf-scale-archive-{}", std::process::id()));
    let archive = modelforge::archive::Archive::open(&dir).unwrap();
    let t = Instant::now();
    let written = archive.append(&moved).unwrap();
    let write = t.elapsed();
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "{nodes:>7} nodes: hourly prune under the apply lock: a prune that forgets nothing {:.1} ms; a prune a month later (every token past the window, {} audit events archived) {:.1} ms, the archive write and fsync {:.0} ms",
        ms(scan),
        moved.len(),
        ms(archive_move),
        ms(write)
    );
    assert_eq!(written, moved.len());
}

/// How a snapshot is built while apply runs, in [`apply_pauses`].
#[derive(Clone, Copy, PartialEq)]
enum Build {
    /// No snapshot: the noise floor of this machine (scheduling, allocation).
    None,
    /// As the member builds it: capture under the lock, encode outside it.
    Captured,
    /// As before: the whole encode under the state's read lock.
    UnderLock,
}

/// Apply commands back to back on another thread, timing each, while a snapshot is built
/// (`Build::None`: for 700 ms). The longest apply, the 99.9th percentile, and how many ran.
fn apply_pauses(
    app: &Arc<Replicated>,
    first_index: u64,
    build: Build,
) -> (std::time::Duration, std::time::Duration, usize) {
    use std::sync::atomic::Ordering::SeqCst;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let measuring = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (app, stop, measuring) = (app.clone(), stop.clone(), measuring.clone());
        std::thread::spawn(move || {
            let (mut took, mut idx) = (vec![], first_index);
            while !stop.load(SeqCst) {
                idx += 1;
                let env = Envelope {
                    request_id: format!("p{idx}"),
                    now_ms: 1_000_000,
                    actor: "bench".into(),
                    command: Command::TouchCredentials {
                        uses: vec![(
                            format!("{:032x}", (idx % 1000) + (1 << 40)).into(),
                            idx as i64,
                        )],
                    },
                };
                let bytes = modelforge_raft::codec::encode(&env).unwrap();
                let was = measuring.load(SeqCst);
                let t = Instant::now();
                app.apply(idx, &bytes);
                let d = t.elapsed();
                if was || measuring.load(SeqCst) {
                    took.push(d);
                }
            }
            took
        })
    };
    std::thread::sleep(std::time::Duration::from_millis(50));
    measuring.store(true, SeqCst);
    match build {
        Build::None => std::thread::sleep(std::time::Duration::from_millis(700)),
        Build::Captured => assert!(!app.snapshot()().is_empty()),
        Build::UnderLock => {
            assert!(
                !modelforge_raft::codec::encode(&*app.read())
                    .unwrap()
                    .is_empty()
            )
        }
    }
    measuring.store(false, SeqCst);
    stop.store(true, SeqCst);
    let mut took = writer.join().unwrap();
    took.sort();
    let n = took.len();
    (
        took.last().copied().unwrap_or_default(),
        took.get(n.saturating_sub(1) * 999 / 1000)
            .copied()
            .unwrap_or_default(),
        n,
    )
}

#[tokio::main]
async fn main() {
    let shards: usize = arg("--shards").and_then(|s| s.parse().ok()).unwrap_or(16);
    if let Some(n) = arg("--one") {
        one(n.parse().unwrap(), shards).await;
        return;
    }
    let sizes = arg("--nodes").unwrap_or_else(|| "10000,100000".into());
    for n in sizes.split(',') {
        let st = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--one", n, "--shards", &shards.to_string()])
            .status()
            .unwrap();
        assert!(st.success());
    }
}
