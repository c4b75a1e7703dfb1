//! What consensus measures about itself, for `GET /metrics`: proposals, lease reads, the log's
//! fsyncs, snapshots. One set a process (a member is a process; in-process test clusters share it).

use std::sync::LazyLock;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::histogram::exponential_buckets;
use prometheus_client::registry::Registry;
use prometheus_client::registry::Unit;

pub struct RaftMetrics {
    pub proposals_committed: Counter,
    pub proposals_failed: Counter,
    pub proposals_pending: Gauge,
    /// Lease reads the leader decided from openraft's metrics, without its core.
    pub lease_reads_local: Counter,
    /// Lease reads that went to openraft's core (the local check could not prove the lease).
    pub lease_reads_core: Counter,
    /// One observation per group commit of the log writer (the write and its fsync).
    pub fsync: Histogram,
    pub snapshot_build: Histogram,
    pub snapshot_install: Histogram,
    /// AppendEntries RPCs this member sent as leader (openraft's heartbeats among them).
    pub appends_sent: Counter,
    /// AppendEntries requests joined into the one before them instead of sent alone.
    pub appends_merged: Counter,
}

/// The process's consensus metrics.
pub static METRICS: LazyLock<RaftMetrics> = LazyLock::new(|| RaftMetrics {
    proposals_committed: Counter::default(),
    proposals_failed: Counter::default(),
    proposals_pending: Gauge::default(),
    lease_reads_local: Counter::default(),
    lease_reads_core: Counter::default(),
    // 0.25 ms .. 8 s, as etcd's wal_fsync_duration_seconds.
    fsync: Histogram::new(exponential_buckets(0.000_25, 2.0, 16)),
    // 1 ms .. 65 s.
    snapshot_build: Histogram::new(exponential_buckets(0.001, 2.0, 17)),
    snapshot_install: Histogram::new(exponential_buckets(0.001, 2.0, 17)),
    appends_sent: Counter::default(),
    appends_merged: Counter::default(),
});

impl RaftMetrics {
    /// Register every family in `registry` (clones share their values).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "proposals_committed",
            "Proposals committed and applied on this member",
            self.proposals_committed.clone(),
        );
        registry.register(
            "proposals_failed",
            "Proposals that failed on this member (not the leader, discarded, fatal)",
            self.proposals_failed.clone(),
        );
        registry.register(
            "proposals_pending",
            "Proposals waiting to be committed on this member",
            self.proposals_pending.clone(),
        );
        registry.register(
            "lease_reads_local",
            "Lease reads this member decided from Raft's metrics alone",
            self.lease_reads_local.clone(),
        );
        registry.register(
            "lease_reads_core",
            "Lease reads that Raft's core decided (the metrics alone did not prove the lease)",
            self.lease_reads_core.clone(),
        );
        registry.register_with_unit(
            "disk_fsync_duration",
            "Time to write and fsync one group commit of the Raft log",
            Unit::Seconds,
            self.fsync.clone(),
        );
        registry.register_with_unit(
            "snapshot_build_duration",
            "Time to build and write a snapshot",
            Unit::Seconds,
            self.snapshot_build.clone(),
        );
        registry.register_with_unit(
            "snapshot_install_duration",
            "Time to check, decode and install a received snapshot",
            Unit::Seconds,
            self.snapshot_install.clone(),
        );
        registry.register(
            "raft_appends_sent",
            "AppendEntries RPCs this member sent as leader, heartbeats included",
            self.appends_sent.clone(),
        );
        registry.register(
            "raft_appends_merged",
            "AppendEntries requests joined into the one before them instead of sent alone",
            self.appends_merged.clone(),
        );
    }
}

/// `d` in seconds, for a histogram.
pub fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}
