//! The durable Raft log and vote, in one redb file, group-committed by one writer thread.
//!
//! Data flow: openraft calls `append`/`save_vote`/`truncate_after`/`purge`; each call updates an
//! in-memory mirror of the log at once (so replication can read what was just appended) and
//! queues a disk operation. One writer thread drains the queue into a single redb write
//! transaction (`Durability::Immediate`, i.e. fsync), commits, and only then completes the
//! callbacks of every operation in that batch, in order. Under concurrency many appends share
//! one fsync; a lone append costs one. The committed index, which openraft saves after every
//! commit and which needs no durability, never costs an fsync of its own while the log is
//! busy: a batch of nothing else waits up to [`COMMITTED_LINGER`] for the next operation and
//! shares its transaction.
//!
//! Invariants:
//! - an append is reported flushed only after the transaction that holds it committed;
//! - operations reach disk in the order openraft issued them (one queue, one writer);
//! - `save_vote`, `truncate_after` and `purge` return only once durable;
//! - a saved committed index reaches disk with the next operation or within
//!   [`COMMITTED_LINGER`] (a stale one on disk only makes a restart apply less before the
//!   leader says what is committed);
//! - a store that once held a vote and now opens without one refuses to start (a forgotten
//!   vote can elect two leaders in one term), detected with a marker file beside the database.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::io;
use std::ops::RangeBounds;
use std::path::Path;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::RwLock;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::Duration;

use openraft::LogState;
use openraft::OptionalSend;
use openraft::RaftLogReader;
use openraft::alias::EntryOf;
use openraft::alias::LogIdOf;
use openraft::alias::VoteOf;
use openraft::entry::RaftEntry;
use openraft::storage::IOFlushed;
use openraft::storage::RaftLogStorage;
use redb::ReadableDatabase;
use redb::ReadableTable;
use redb::TableDefinition;

use crate::TypeConfig;
use crate::codec;

const LOG: TableDefinition<u64, &[u8]> = TableDefinition::new("log");
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
const KEY_VOTE: &str = "vote";
const KEY_COMMITTED: &str = "committed";
const KEY_PURGED: &str = "purged";
/// The most operations folded into one transaction.
const MAX_BATCH_OPS: usize = 4096;
/// How long a batch that holds only the committed index waits for another operation to share
/// its fsync. At one client a commit's own fsync held the disk while the next write's append
/// queued behind it, on the leader and on each follower.
pub const COMMITTED_LINGER: Duration = Duration::from_millis(100);

type C = TypeConfig;

enum Done {
    Flushed(IOFlushed<C>),
    Reply(tokio::sync::oneshot::Sender<io::Result<()>>),
    Nothing,
}

impl Done {
    fn complete(self, result: &Result<(), String>) {
        let res = result.clone().map_err(io::Error::other);
        match self {
            Done::Flushed(cb) => cb.io_completed(res),
            Done::Reply(tx) => {
                let _ = tx.send(res);
            }
            Done::Nothing => {}
        }
    }
}

enum Op {
    Append(Vec<(u64, Vec<u8>)>),
    Put(&'static str, Vec<u8>),
    /// Remove every entry with index >= this.
    TruncateFrom(u64),
    /// Remove every entry with index <= this, and record the purge point.
    PurgeUpTo(u64, Vec<u8>),
    /// Write what came before, close the database and end the writer (answered once the
    /// database file is released).
    Close,
}

struct Mirror {
    entries: BTreeMap<u64, EntryOf<C>>,
    vote: Option<VoteOf<C>>,
    committed: Option<LogIdOf<C>>,
    purged: Option<LogIdOf<C>>,
}

struct Shared {
    mirror: RwLock<Mirror>,
    tx: mpsc::Sender<(Op, Done)>,
    /// Transactions the writer committed (each one fsync).
    commits: Arc<AtomicU64>,
}

/// The log store handed to openraft; clones share one database and one writer.
#[derive(Clone)]
pub struct LogStore {
    shared: Arc<Shared>,
}

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("raft log {path}: {source}")]
    Db {
        path: PathBuf,
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error(
        "raft log {0} opened without the vote it is known to have held (marker file present): refusing to start, \
         because a forgotten vote or log breaks Raft's safety; restore the data dir or replace this member"
    )]
    LostState(PathBuf),
    #[error("raft log {path}: record does not decode: {source}")]
    Decode {
        path: PathBuf,
        source: codec::CodecError,
    },
}

fn marker_path(path: &Path) -> PathBuf {
    path.with_extension("has-state")
}

impl LogStore {
    /// Open (or create) the log at `path` and start its writer thread.
    pub fn open(path: &Path) -> Result<Self, OpenError> {
        Self::open_with(path, COMMITTED_LINGER)
    }

    fn open_with(path: &Path, linger: Duration) -> Result<Self, OpenError> {
        let db_err = |e: Box<dyn std::error::Error + Send + Sync>| OpenError::Db {
            path: path.to_path_buf(),
            source: e,
        };
        let db = redb::Database::create(path).map_err(|e| db_err(e.into()))?;
        {
            let w = db.begin_write().map_err(|e| db_err(e.into()))?;
            w.open_table(LOG).map_err(|e| db_err(e.into()))?;
            w.open_table(META).map_err(|e| db_err(e.into()))?;
            w.commit().map_err(|e| db_err(e.into()))?;
        }
        let dec = |e| OpenError::Decode {
            path: path.to_path_buf(),
            source: e,
        };
        let mut mirror = Mirror {
            entries: BTreeMap::new(),
            vote: None,
            committed: None,
            purged: None,
        };
        {
            let r = db.begin_read().map_err(|e| db_err(e.into()))?;
            let meta = r.open_table(META).map_err(|e| db_err(e.into()))?;
            if let Some(v) = meta.get(KEY_VOTE).map_err(|e| db_err(e.into()))? {
                mirror.vote = Some(codec::decode(v.value()).map_err(dec)?);
            }
            if let Some(v) = meta.get(KEY_COMMITTED).map_err(|e| db_err(e.into()))? {
                mirror.committed = codec::decode(v.value()).map_err(dec)?;
            }
            if let Some(v) = meta.get(KEY_PURGED).map_err(|e| db_err(e.into()))? {
                mirror.purged = codec::decode(v.value()).map_err(dec)?;
            }
            let log = r.open_table(LOG).map_err(|e| db_err(e.into()))?;
            for item in log.iter().map_err(|e| db_err(e.into()))? {
                let (k, v) = item.map_err(|e| db_err(e.into()))?;
                let entry: EntryOf<C> = codec::decode(v.value()).map_err(dec)?;
                mirror.entries.insert(k.value(), entry);
            }
        }
        let marker = marker_path(path);
        if mirror.vote.is_none() && marker.exists() {
            return Err(OpenError::LostState(path.to_path_buf()));
        }
        let (tx, rx) = mpsc::channel::<(Op, Done)>();
        let has_marker = marker.exists();
        let commits = Arc::new(AtomicU64::new(0));
        let writer_commits = commits.clone();
        std::thread::Builder::new()
            .name("raft-log-writer".into())
            .spawn(move || writer(db, rx, marker, has_marker, linger, &writer_commits))
            .map_err(|e| db_err(e.into()))?;
        Ok(Self {
            shared: Arc::new(Shared {
                mirror: RwLock::new(mirror),
                tx,
                commits,
            }),
        })
    }

    /// Transactions (fsyncs) the writer has committed since the store was opened.
    pub fn commits(&self) -> u64 {
        self.shared.commits.load(Ordering::Relaxed)
    }

    fn submit(&self, op: Op, done: Done) -> io::Result<()> {
        self.shared
            .tx
            .send((op, done))
            .map_err(|_| io::Error::other("raft log writer thread is gone"))
    }

    async fn submit_and_wait(&self, op: Op) -> io::Result<()> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.submit(op, Done::Reply(tx))?;
        rx.await
            .map_err(|_| io::Error::other("raft log writer thread is gone"))?
    }

    /// Write what was submitted, then close the database (its file lock released) and end
    /// the writer thread. Later writes fail. Idempotent.
    pub async fn close(&self) {
        let _ = self.submit_and_wait(Op::Close).await;
    }

    fn mirror(&self) -> std::sync::RwLockReadGuard<'_, Mirror> {
        self.shared.mirror.read().unwrap_or_else(|p| p.into_inner())
    }

    fn mirror_mut(&self) -> std::sync::RwLockWriteGuard<'_, Mirror> {
        self.shared
            .mirror
            .write()
            .unwrap_or_else(|p| p.into_inner())
    }
}

/// The exit code of a member whose Raft log write or fsync failed (sysexits' `EX_IOERR`).
pub const EXIT_LOG_WRITE_FAILED: i32 = 74;

/// The writer thread: drain, write one transaction, fsync, then complete callbacks in order.
fn writer(
    db: redb::Database,
    rx: mpsc::Receiver<(Op, Done)>,
    marker: PathBuf,
    mut has_marker: bool,
    linger: Duration,
    commits: &AtomicU64,
) {
    let drain = |batch: &mut Vec<(Op, Done)>| {
        while batch.len() < MAX_BATCH_OPS {
            match rx.try_recv() {
                Ok(op) => batch.push(op),
                Err(_) => break,
            }
        }
    };
    let mut closing = None;
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        drain(&mut batch);
        // Only the committed index: wait for the next operation to share its fsync (on a
        // timeout or a dropped store it is written alone).
        if batch
            .iter()
            .all(|(op, done)| matches!((op, done), (Op::Put(KEY_COMMITTED, _), Done::Nothing)))
            && let Ok(next) = rx.recv_timeout(linger)
        {
            batch.push(next);
            drain(&mut batch);
        }
        // Everything after a close is refused: the store is going away.
        if let Some(at) = batch.iter().position(|(op, _)| matches!(op, Op::Close)) {
            let after = batch.split_off(at + 1);
            closing = batch.pop().map(|(_, done)| done);
            for (_, done) in after {
                done.complete(&Err("the raft log is closed".into()));
            }
        }
        let wrote_vote = batch
            .iter()
            .any(|(op, _)| matches!(op, Op::Put(KEY_VOTE, _)));
        let started = std::time::Instant::now();
        let mut result = write_batch(&db, &batch).map_err(|e| e.to_string());
        commits.fetch_add(1, Ordering::Relaxed);
        crate::metrics::METRICS
            .fsync
            .observe(crate::metrics::secs(started.elapsed()));
        if result.is_ok() && wrote_vote && !has_marker {
            result = write_marker(&marker)
                .map_err(|e| format!("write marker {}: {e}", marker.display()));
            has_marker = result.is_ok();
        }
        if let Err(e) = &result {
            // Never retried, never trusted: after a failed write or fsync the data may not be
            // on disk while the page cache says it is (a retried fsync can succeed over lost
            // pages). Stop here, before any callback acknowledges anything of this batch; a
            // restart reads what is durable, and the other members hold the rest.
            tracing::error!(error = %e, exit_code = EXIT_LOG_WRITE_FAILED, "raft log write or fsync failed: stopping this member");
            eprintln!("modelforge: raft log write or fsync failed ({e}): stopping this member");
            std::process::exit(EXIT_LOG_WRITE_FAILED);
        }
        for (_, done) in batch {
            done.complete(&result);
        }
        if closing.is_some() {
            break;
        }
    }
    drop(db);
    if let Some(done) = closing {
        done.complete(&Ok(()));
    }
}

fn write_marker(path: &Path) -> io::Result<()> {
    let f = std::fs::File::create(path)?;
    f.sync_all()?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

fn write_batch(
    db: &redb::Database,
    batch: &[(Op, Done)],
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let txn = db.begin_write()?;
    {
        let mut log = txn.open_table(LOG)?;
        let mut meta = txn.open_table(META)?;
        for (op, _) in batch {
            match op {
                Op::Append(entries) => {
                    for (index, bytes) in entries {
                        log.insert(*index, bytes.as_slice())?;
                    }
                }
                Op::Put(key, bytes) => {
                    meta.insert(*key, bytes.as_slice())?;
                }
                Op::TruncateFrom(index) => {
                    log.retain_in(*index.., |_, _| false)?;
                }
                Op::PurgeUpTo(index, purged) => {
                    log.retain_in(..=*index, |_, _| false)?;
                    meta.insert(KEY_PURGED, purged.as_slice())?;
                }
                Op::Close => {}
            }
        }
    }
    txn.commit()?;
    Ok(())
}

impl RaftLogReader<C> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<EntryOf<C>>, io::Error> {
        let m = self.mirror();
        Ok(m.entries.range(range).map(|(_, e)| e.clone()).collect())
    }

    async fn read_vote(&mut self) -> Result<Option<VoteOf<C>>, io::Error> {
        Ok(self.mirror().vote)
    }
}

impl RaftLogStorage<C> for LogStore {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<C>, io::Error> {
        let m = self.mirror();
        let last = m
            .entries
            .values()
            .next_back()
            .map(|e| e.log_id())
            .or(m.purged);
        Ok(LogState {
            last_purged_log_id: m.purged,
            last_log_id: last,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &VoteOf<C>) -> Result<(), io::Error> {
        let bytes = codec::encode(vote)?;
        self.mirror_mut().vote = Some(*vote);
        self.submit_and_wait(Op::Put(KEY_VOTE, bytes)).await
    }

    async fn save_committed(&mut self, committed: Option<LogIdOf<C>>) -> Result<(), io::Error> {
        let bytes = codec::encode(&committed)?;
        self.mirror_mut().committed = committed;
        // Not awaited: a lost `committed` is only recomputed, never unsafe.
        self.submit(Op::Put(KEY_COMMITTED, bytes), Done::Nothing)
    }

    async fn read_committed(&mut self) -> Result<Option<LogIdOf<C>>, io::Error> {
        Ok(self.mirror().committed)
    }

    async fn append<I>(&mut self, entries: I, callback: IOFlushed<C>) -> Result<(), io::Error>
    where
        I: IntoIterator<Item = EntryOf<C>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut encoded = Vec::new();
        {
            let mut m = self.mirror_mut();
            for entry in entries {
                let index = entry.log_id().index();
                encoded.push((index, codec::encode(&entry)?));
                m.entries.insert(index, entry);
            }
        }
        self.submit(Op::Append(encoded), Done::Flushed(callback))
    }

    async fn truncate_after(&mut self, last_log_id: Option<LogIdOf<C>>) -> Result<(), io::Error> {
        let from = last_log_id.map(|l| l.index() + 1).unwrap_or(0);
        {
            let mut m = self.mirror_mut();
            let _ = m.entries.split_off(&from);
        }
        self.submit_and_wait(Op::TruncateFrom(from)).await
    }

    async fn purge(&mut self, log_id: LogIdOf<C>) -> Result<(), io::Error> {
        let bytes = codec::encode(&Some(log_id))?;
        {
            let mut m = self.mirror_mut();
            let keep = m.entries.split_off(&(log_id.index() + 1));
            m.entries = keep;
            m.purged = Some(log_id);
        }
        self.submit_and_wait(Op::PurgeUpTo(log_id.index(), bytes))
            .await
    }
}

#[cfg(test)]
mod tests {
    use openraft::testing::blank_ent;
    use openraft::testing::log_id;
    use openraft::type_config::TypeConfigExt;

    use super::*;

    async fn append_and_wait(store: &mut LogStore, index: u64) {
        let (tx, rx) = C::oneshot();
        store
            .append([blank_ent::<C>(1, 1, index)], IOFlushed::signal(tx))
            .await
            .unwrap();
        rx.await.unwrap().unwrap();
    }

    /// A store with one entry appended, then the committed index (1, 1, 1) saved: the store,
    /// the commits before the save, and the temporary dir that holds it.
    async fn store_with_committed_saved(
        linger: Duration,
    ) -> (LogStore, u64, PathBuf, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log.redb");
        let mut store = LogStore::open_with(&path, linger).unwrap();
        append_and_wait(&mut store, 1).await;
        let before = store.commits();
        store
            .save_committed(Some(log_id::<C>(1, 1, 1)))
            .await
            .unwrap();
        (store, before, path, dir)
    }

    /// Close `store`, open its file again and check that it holds the saved committed index.
    async fn assert_committed_on_disk(store: LogStore, path: &Path) {
        store.close().await;
        drop(store);
        let mut reopened = LogStore::open(path).unwrap();
        assert_eq!(
            reopened.read_committed().await.unwrap(),
            Some(log_id::<C>(1, 1, 1))
        );
    }

    /// The committed index saved between two appends shares the second append's fsync (a
    /// linger far longer than the test, so that only that sharing can explain one commit).
    #[tokio::test]
    async fn a_saved_committed_index_shares_the_next_append_fsync() {
        let (mut store, before, path, _dir) =
            store_with_committed_saved(Duration::from_secs(3600)).await;
        append_and_wait(&mut store, 2).await;
        assert_eq!(
            store.commits() - before,
            1,
            "the committed index cost an fsync of its own"
        );
        assert_committed_on_disk(store, &path).await;
    }

    /// A committed index that nothing follows is written alone once the linger passes.
    #[tokio::test]
    async fn a_lone_committed_index_is_written_after_the_linger() {
        let (store, before, path, _dir) =
            store_with_committed_saved(Duration::from_millis(20)).await;
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while store.commits() == before {
            assert!(
                std::time::Instant::now() < deadline,
                "the committed index was never written"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_committed_on_disk(store, &path).await;
    }
}
