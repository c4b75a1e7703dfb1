//! Adapts an [`Application`] to openraft's state machine, with the snapshot kept on disk.
//!
//! The application's state lives in memory; its durable form is the snapshot file plus the
//! log after it. On start the snapshot is loaded and openraft re-applies the committed log
//! after it. Applying an entry and advancing `last_applied` happen under one lock, so a
//! snapshot never holds a state that disagrees with its `last_log_id`.
//!
//! Snapshot file layout: `crc32(le) ++ codec(SnapshotFile)`, written to a temporary file,
//! fsynced and renamed over the old one (then the directory is fsynced).

use std::io;
use std::io::Cursor;
use std::path::Path;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;

use futures_util::Stream;
use futures_util::TryStreamExt;
use openraft::EntryPayload;
use openraft::OptionalSend;
use openraft::RaftSnapshotBuilder;
use openraft::alias::LogIdOf;
use openraft::alias::SnapshotMetaOf;
use openraft::alias::SnapshotOf;
use openraft::alias::StoredMembershipOf;
use openraft::storage::EntryResponder;
use openraft::storage::RaftStateMachine;
use serde::Deserialize;
use serde::Serialize;

use crate::AppResponse;
use crate::Application;
use crate::TypeConfig;
use crate::codec;

type C = TypeConfig;

const SNAPSHOT_FILE: &str = "snapshot.bin";

#[derive(Serialize, Deserialize)]
struct SnapshotFile {
    meta: SnapshotMetaOf<C>,
    data: Vec<u8>,
}

struct Applied {
    last_applied: Option<LogIdOf<C>>,
    membership: StoredMembershipOf<C>,
}

/// The state machine handed to openraft; clones share the application and the lock.
pub struct StateMachine<A: Application> {
    app: Arc<A>,
    applied: Arc<tokio::sync::Mutex<Applied>>,
    dir: PathBuf,
    pacing: Arc<SnapshotPacing>,
}

impl<A: Application> Clone for StateMachine<A> {
    fn clone(&self) -> Self {
        Self {
            app: self.app.clone(),
            applied: self.applied.clone(),
            dir: self.dir.clone(),
            pacing: self.pacing.clone(),
        }
    }
}

/// When snapshots were built, so that building them takes at most a tenth of the time
/// (`crate::pace_snapshots` asks for one only when [`SnapshotPacing::may_start`]).
#[derive(Default)]
pub struct SnapshotPacing {
    inner: std::sync::Mutex<Pacing>,
}

#[derive(Default)]
struct Pacing {
    building: bool,
    requested_at: Option<Instant>,
    last_end: Option<Instant>,
    last_took: Duration,
}

/// How long a request for a snapshot that never started a build blocks the next one.
const REQUEST_STALE: Duration = Duration::from_secs(10);

impl SnapshotPacing {
    fn lock(&self) -> std::sync::MutexGuard<'_, Pacing> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// No build running or requested, and the last one ended at least nine of its durations ago.
    pub fn may_start(&self) -> bool {
        self.may_start_at(Instant::now())
    }

    fn may_start_at(&self, now: Instant) -> bool {
        let p = self.lock();
        !p.building
            && p.requested_at
                .is_none_or(|r| now.saturating_duration_since(r) > REQUEST_STALE)
            && p.last_end
                .is_none_or(|e| now.saturating_duration_since(e) >= p.last_took * 9)
    }

    pub fn requested(&self) {
        self.lock().requested_at = Some(Instant::now());
    }

    /// The duration of the last build, for the logs and the tests.
    pub fn last_took(&self) -> Duration {
        self.lock().last_took
    }

    fn started(&self) -> BuildGuard<'_> {
        let mut p = self.lock();
        p.building = true;
        p.requested_at = None;
        BuildGuard {
            pacing: self,
            started: Instant::now(),
        }
    }
}

/// Ends a build in the pacing record however the build ends.
struct BuildGuard<'a> {
    pacing: &'a SnapshotPacing,
    started: Instant,
}

impl Drop for BuildGuard<'_> {
    fn drop(&mut self) {
        let mut p = self.pacing.lock();
        p.building = false;
        p.last_end = Some(Instant::now());
        p.last_took = self.started.elapsed();
    }
}

impl<A: Application> StateMachine<A> {
    /// Load the snapshot under `dir`, if any, into `app`.
    pub fn open(dir: &Path, app: Arc<A>) -> io::Result<Self> {
        let mut applied = Applied {
            last_applied: None,
            membership: Default::default(),
        };
        if let Some(file) = read_snapshot_file(dir)? {
            app.restore(&file.data)?;
            applied.last_applied = file.meta.last_log_id;
            applied.membership = file.meta.last_membership.clone();
            tracing::info!(last_log_id = ?file.meta.last_log_id, "loaded snapshot");
        }
        Ok(Self {
            app,
            applied: Arc::new(tokio::sync::Mutex::new(applied)),
            dir: dir.to_path_buf(),
            pacing: Arc::new(SnapshotPacing::default()),
        })
    }

    pub fn pacing(&self) -> Arc<SnapshotPacing> {
        self.pacing.clone()
    }
}

fn read_snapshot_file(dir: &Path) -> io::Result<Option<SnapshotFile>> {
    let path = dir.join(SNAPSHOT_FILE);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    if bytes.len() < 4 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} is truncated", path.display()),
        ));
    }
    let (crc, body) = bytes.split_at(4);
    let crc = u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]);
    if crc32fast::hash(body) != crc {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} fails its checksum", path.display()),
        ));
    }
    Ok(Some(codec::decode(body)?))
}

fn write_snapshot_file(dir: &Path, file: &SnapshotFile) -> io::Result<()> {
    let body = codec::encode(file)?;
    let mut bytes = crc32fast::hash(&body).to_le_bytes().to_vec();
    bytes.extend_from_slice(&body);
    let tmp = dir.join(format!("{SNAPSHOT_FILE}.tmp"));
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&bytes)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, dir.join(SNAPSHOT_FILE))?;
    std::fs::File::open(dir)?.sync_all()?;
    Ok(())
}

impl<A: Application> RaftSnapshotBuilder<C> for StateMachine<A> {
    type SnapshotData = Cursor<Vec<u8>>;

    async fn build_snapshot(&mut self) -> Result<SnapshotOf<C, Cursor<Vec<u8>>>, io::Error> {
        let build = self.pacing.started();
        let (meta, data) = {
            let applied = self.applied.lock().await;
            // Apply waits for this lock; the encode itself must not hold an async worker.
            let app = self.app.clone();
            let data = tokio::task::spawn_blocking(move || app.snapshot())
                .await
                .map_err(io::Error::other)?;
            let meta = SnapshotMetaOf::<C> {
                last_log_id: applied.last_applied,
                last_membership: applied.membership.clone(),
            };
            (meta, data)
        };
        let file = SnapshotFile {
            meta: meta.clone(),
            data,
        };
        let dir = self.dir.clone();
        let file =
            tokio::task::spawn_blocking(move || write_snapshot_file(&dir, &file).map(|_| file))
                .await
                .map_err(io::Error::other)??;
        tracing::info!(
            last_log_id = ?meta.last_log_id,
            bytes = file.data.len(),
            took_ms = build.started.elapsed().as_millis() as u64,
            "built snapshot"
        );
        Ok(SnapshotOf::<C, Cursor<Vec<u8>>> {
            meta,
            snapshot: Cursor::new(file.data),
        })
    }
}

impl<A: Application> RaftStateMachine<C> for StateMachine<A> {
    type SnapshotData = Cursor<Vec<u8>>;
    type SnapshotBuilder = Self;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogIdOf<C>>, StoredMembershipOf<C>), io::Error> {
        let a = self.applied.lock().await;
        Ok((a.last_applied, a.membership.clone()))
    }

    async fn apply<Strm>(&mut self, mut entries: Strm) -> Result<(), io::Error>
    where
        Strm: Stream<Item = Result<EntryResponder<C>, io::Error>> + Unpin + OptionalSend,
    {
        let mut applied = self.applied.lock().await;
        while let Some((entry, responder)) = entries.try_next().await? {
            let response = match &entry.payload {
                EntryPayload::Blank => AppResponse::default(),
                EntryPayload::Normal(req) => {
                    AppResponse(self.app.apply(entry.log_id.index(), &req.0))
                }
                EntryPayload::Membership(m) => {
                    applied.membership =
                        StoredMembershipOf::<C>::new(Some(entry.log_id), m.clone());
                    AppResponse::default()
                }
            };
            applied.last_applied = Some(entry.log_id);
            if let Some(responder) = responder {
                responder.send(response);
            }
        }
        Ok(())
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMetaOf<C>,
        snapshot: Self::SnapshotData,
    ) -> Result<(), io::Error> {
        let data = snapshot.into_inner();
        let mut applied = self.applied.lock().await;
        self.app.restore(&data)?;
        applied.last_applied = meta.last_log_id;
        applied.membership = meta.last_membership.clone();
        let file = SnapshotFile {
            meta: meta.clone(),
            data,
        };
        let dir = self.dir.clone();
        tokio::task::spawn_blocking(move || write_snapshot_file(&dir, &file))
            .await
            .map_err(io::Error::other)??;
        tracing::info!(last_log_id = ?meta.last_log_id, "installed snapshot");
        Ok(())
    }

    async fn get_current_snapshot(
        &mut self,
    ) -> Result<Option<SnapshotOf<C, Self::SnapshotData>>, io::Error> {
        let dir = self.dir.clone();
        let file = tokio::task::spawn_blocking(move || read_snapshot_file(&dir))
            .await
            .map_err(io::Error::other)??;
        Ok(file.map(|f| SnapshotOf::<C, Cursor<Vec<u8>>> {
            meta: f.meta,
            snapshot: Cursor::new(f.data),
        }))
    }
}

#[cfg(test)]
mod pacing_tests {
    use super::*;

    #[test]
    fn a_snapshot_is_asked_for_only_when_none_runs_and_the_last_took_a_tenth_of_the_time_since() {
        let p = SnapshotPacing::default();
        let now = Instant::now();
        assert!(p.may_start_at(now), "nothing built yet");
        p.requested();
        assert!(!p.may_start_at(now), "one is requested");
        assert!(
            p.may_start_at(now + REQUEST_STALE + Duration::from_secs(1)),
            "a request that never started a build goes stale"
        );
        {
            let _build = p.started();
            assert!(!p.may_start_at(now), "one is building");
        }
        let ended = p.lock().last_end.expect("the build ended");
        p.lock().last_took = Duration::from_secs(3600);
        assert!(
            !p.may_start_at(ended + Duration::from_secs(3600)),
            "one duration later"
        );
        assert!(
            p.may_start_at(ended + Duration::from_secs(9 * 3600)),
            "nine of its durations later"
        );
    }
}

#[cfg(test)]
mod snapshot_order_tests {
    use super::*;

    /// Notes, each time it is asked for its state, what the snapshot file on disk held then.
    struct Probe {
        dir: PathBuf,
        on_disk_when_asked: std::sync::Mutex<Vec<Option<Vec<u8>>>>,
    }

    impl Application for Probe {
        fn apply(&self, _: u64, _: &[u8]) -> Vec<u8> {
            vec![]
        }
        fn snapshot(&self) -> Vec<u8> {
            let on_disk = read_snapshot_file(&self.dir).unwrap().map(|f| f.data);
            let mut seen = self.on_disk_when_asked.lock().unwrap();
            seen.push(on_disk);
            format!("state-{}", seen.len()).into_bytes()
        }
        fn restore(&self, _: &[u8]) -> io::Result<()> {
            Ok(())
        }
    }

    /// The application's `snapshot` runs before the snapshot that holds its answer is on disk
    /// (the revocation journal relies on it: it is fsynced there, before any log entry it
    /// covers can be purged).
    #[tokio::test]
    async fn the_application_is_asked_for_its_state_before_the_snapshot_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let app = Arc::new(Probe {
            dir: dir.path().to_path_buf(),
            on_disk_when_asked: Default::default(),
        });
        let mut sm = StateMachine::open(dir.path(), app.clone()).unwrap();
        sm.build_snapshot().await.unwrap();
        sm.build_snapshot().await.unwrap();
        assert_eq!(
            *app.on_disk_when_asked.lock().unwrap(),
            vec![None, Some(b"state-1".to_vec())],
            "a snapshot was on disk before the application was asked for its state"
        );
        let on_disk = read_snapshot_file(dir.path()).unwrap().unwrap();
        assert_eq!(on_disk.data, b"state-2");
    }
}
