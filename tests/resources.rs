//! What a member's work costs it afterwards: memory taken for argon2 (19 MiB a hash at the
//! default parameters) is given back to the system after the hashing, rather than kept by the
//! allocator for the life of the process. glibc keeps it in its arenas (about 600 MiB after
//! a pool of 48 hashes); the member's trim task (`server::tasks::return_freed_memory`, every
//! 10 s) hands it back.

mod common;

use common::*;
use modelforge_proto::api;

/// The resident set of a process, in MiB.
fn rss_mib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .unwrap()
        / 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_taken_for_argon2_is_given_back_once_hashing_is_done() {
    // The leader fills a pool of 48 pre-minted credentials, one argon2id hash each, on its
    // hash workers, at the default parameters.
    let mut c = Cluster::start_with(1, &["--credential-pool", "48"]).await;
    let pid = c.pid(1).unwrap();
    wait_until("the credential pool is full", WAIT, || {
        let c = &c;
        async move {
            let v = c.cluster_view(1).await?;
            (v.credential_pool.ready >= 48).then_some(())
        }
    })
    .await;
    // 48 hashes of 19 MiB went through the workers; what the process keeps, once the trim
    // task has run, is its state and its buffers, not their memory.
    let view: api::ClusterView = c.read_as("/api/v1/cluster").await;
    assert!(view.credential_pool.minted_ahead >= 48, "{view:?}");
    wait_until(
        "the member gives argon2's memory back (RSS under 160 MiB)",
        std::time::Duration::from_secs(25),
        || async move { (rss_mib(pid) < 160).then_some(()) },
    )
    .await;
}
