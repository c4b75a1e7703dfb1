//! Adapts an [`Application`] to openraft's state machine, with the snapshot kept on disk.
//!
//! The application's state lives in memory; its durable form is the snapshot file plus the
//! log after it. On start the snapshot is loaded and openraft re-applies the committed log
//! after it. Applying an entry and advancing `last_applied` happen under one lock, so a
//! snapshot never holds a state that disagrees with its `last_log_id`.
//!
//! Snapshot file layout: `crc32(le) ++ codec(SnapshotFile)`, written to a temporary file,
//! fsynced and renamed over the old one (then the directory is fsynced).
//!
//! A snapshot travels as its file ([`SnapshotData`], an open handle): the leader streams it to
//! a follower from disk, and the follower streams it to a file of its own before installing
//! it, so neither holds the snapshot's bytes in memory to send or receive it. Both check it in
//! bounded memory (the checksum over the file, the meta from its head) before anything else.

use std::io;
use std::io::BufReader;
use std::io::Read;
use std::io::Seek;
use std::io::SeekFrom;
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
/// Snapshots being received from the leader: `<prefix><random hex>`, in the member's dir (so
/// that installing one is a rename); leftovers of a crash are removed at open.
pub(crate) const INCOMING_PREFIX: &str = "snapshot.incoming.";

#[derive(Serialize, Deserialize)]
pub(crate) struct SnapshotFile {
    pub(crate) meta: SnapshotMetaOf<C>,
    pub(crate) data: Vec<u8>,
}

/// A snapshot's bytes: an open snapshot file (layout above) and its length. The handle keeps
/// the file readable when a newer snapshot replaces its name, so a leader can stream one while
/// it builds the next. `incoming` names a file received from the leader in this member's dir:
/// installing moves it into place instead of copying it, and dropping it uninstalled removes it.
pub struct SnapshotData {
    file: std::fs::File,
    len: u64,
    incoming: Option<PathBuf>,
}

impl SnapshotData {
    /// The snapshot file's length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Another handle on the same file, positioned at its start (to stream it out).
    pub fn reader(&self) -> io::Result<std::fs::File> {
        let mut f = self.file.try_clone()?;
        f.seek(SeekFrom::Start(0))?;
        Ok(f)
    }

    /// A received snapshot file at `path`: checked (checksum, meta) in bounded memory; its meta
    /// and the data to install. The file is removed if it does not check.
    pub(crate) fn received(path: PathBuf) -> io::Result<(SnapshotMetaOf<C>, Self)> {
        let checked = std::fs::File::open(&path).and_then(|mut f| {
            let (meta, len) = check_snapshot(&mut f)?;
            Ok((meta, f, len))
        });
        match checked {
            Ok((meta, file, len)) => Ok((
                meta,
                SnapshotData {
                    file,
                    len,
                    incoming: Some(path),
                },
            )),
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                Err(e)
            }
        }
    }
}

impl Drop for SnapshotData {
    fn drop(&mut self) {
        if let Some(p) = self.incoming.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Check a snapshot file in bounded memory: its checksum over the whole file, then its meta
/// decoded from the head. Returns the meta and the file's length; the reader is left anywhere.
pub(crate) fn check_snapshot<R: Read + Seek>(r: &mut R) -> io::Result<(SnapshotMetaOf<C>, u64)> {
    let len = r.seek(SeekFrom::End(0))?;
    r.seek(SeekFrom::Start(0))?;
    if len < 5 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the snapshot is truncated",
        ));
    }
    let mut reader = BufReader::with_capacity(1 << 20, &mut *r);
    let mut crc = [0u8; 4];
    reader.read_exact(&mut crc)?;
    let mut hasher = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = reader.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    if hasher.finalize() != u32::from_le_bytes(crc) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the snapshot fails its checksum",
        ));
    }
    drop(reader);
    r.seek(SeekFrom::Start(4))?;
    let meta = codec::decode_from_reader(&mut BufReader::new(&mut *r), len - 4)?;
    Ok((meta, len))
}

/// Decode a whole snapshot file of `len` bytes (checked with [`check_snapshot`] first),
/// reading it once: the state's bytes are the only copy in memory.
pub(crate) fn read_snapshot<R: Read + Seek>(r: &mut R, len: u64) -> io::Result<SnapshotFile> {
    r.seek(SeekFrom::Start(4))?;
    let mut reader = BufReader::with_capacity(1 << 20, &mut *r);
    let file: SnapshotFile = codec::decode_from_reader(&mut reader, len - 4)?;
    let mut extra = [0u8; 1];
    if reader.read(&mut extra)? != 0 {
        return Err(codec::CodecError::Trailing(1).into());
    }
    Ok(file)
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
    held: std::sync::atomic::AtomicBool,
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

    /// Not held, no build running or requested, and the last one ended at least nine of its
    /// durations ago.
    pub fn may_start(&self) -> bool {
        !self.held.load(std::sync::atomic::Ordering::Relaxed) && self.may_start_at(Instant::now())
    }

    /// Hold back new builds (the disk is under its reserve), or let them go again.
    pub fn hold(&self, held: bool) {
        self.held.store(held, std::sync::atomic::Ordering::Relaxed);
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
        if let Ok(entries) = std::fs::read_dir(dir) {
            for e in entries.flatten() {
                if e.file_name().to_string_lossy().starts_with(INCOMING_PREFIX) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
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
    let mut f = match std::fs::File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    check_snapshot(&mut f)
        .and_then(|(_, len)| read_snapshot(&mut f, len))
        .map(Some)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))
}

/// Write `file` as the member's snapshot; a handle on what was written (the same inode,
/// whatever replaces the name later) and its length.
fn write_snapshot_file(dir: &Path, file: &SnapshotFile) -> io::Result<SnapshotData> {
    // The body is `codec::encode(file)`, written as its parts: the state's bytes are the bulk
    // of it (hundreds of MiB at 100,000 nodes), and one copy of them in memory is enough.
    let (head, len_prefix) = snapshot_file_head(file)?;
    let parts = [&head[..], &len_prefix[..], &file.data[..]];
    let mut crc = crc32fast::Hasher::new();
    for part in parts {
        crc.update(part);
    }
    let body_len: usize = parts.iter().map(|p| p.len()).sum();
    let tmp = dir.join(format!("{SNAPSHOT_FILE}.tmp"));
    let f = {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)?;
        f.write_all(&crc.finalize().to_le_bytes())?;
        for part in parts {
            f.write_all(part)?;
        }
        f.sync_all()?;
        f
    };
    std::fs::rename(&tmp, dir.join(SNAPSHOT_FILE))?;
    std::fs::File::open(dir)?.sync_all()?;
    Ok(SnapshotData {
        file: f,
        len: 4 + body_len as u64,
        incoming: None,
    })
}

/// What precedes the state's bytes in `codec::encode(file)`: the format version and the meta,
/// then the data's length as the codec writes a sequence's length (so that the parts, then
/// the data, are exactly that encoding; `snapshot_file_parts_are_its_encoding`).
fn snapshot_file_head(file: &SnapshotFile) -> io::Result<(Vec<u8>, Vec<u8>)> {
    let head = codec::encode(&file.meta)?;
    let mut len_prefix = codec::encode(&(file.data.len() as u64))?;
    len_prefix.remove(0); // its own format version byte: the head carries the file's
    Ok((head, len_prefix))
}

/// Move a received snapshot file into place as the member's snapshot (fsynced, renamed, the
/// directory fsynced).
fn place_received(dir: &Path, data: &mut SnapshotData) -> io::Result<()> {
    data.file.sync_all()?;
    let Some(path) = data.incoming.take() else {
        return Err(io::Error::other("not a received snapshot"));
    };
    std::fs::rename(&path, dir.join(SNAPSHOT_FILE))?;
    std::fs::File::open(dir)?.sync_all()?;
    Ok(())
}

impl<A: Application> RaftSnapshotBuilder<C> for StateMachine<A> {
    type SnapshotData = SnapshotData;

    async fn build_snapshot(&mut self) -> Result<SnapshotOf<C, SnapshotData>, io::Error> {
        let build = self.pacing.started();
        let (meta, encode, paused) = {
            // Apply waits for this lock only while the state is captured (a clone of persistent
            // collections); the encode runs after it is released, off the async workers.
            let applied = self.applied.lock().await;
            let captured = std::time::Instant::now();
            let encode = self.app.snapshot();
            let paused = captured.elapsed();
            let meta = SnapshotMetaOf::<C> {
                last_log_id: applied.last_applied,
                last_membership: applied.membership.clone(),
            };
            (meta, encode, paused)
        };
        let data = tokio::task::spawn_blocking(encode)
            .await
            .map_err(io::Error::other)?;
        let file = SnapshotFile {
            meta: meta.clone(),
            data,
        };
        let dir = self.dir.clone();
        let data = tokio::task::spawn_blocking(move || write_snapshot_file(&dir, &file))
            .await
            .map_err(io::Error::other)??;
        crate::metrics::METRICS
            .snapshot_build
            .observe(crate::metrics::secs(build.started.elapsed()));
        tracing::info!(
            last_log_id = ?meta.last_log_id,
            bytes = data.len(),
            took_ms = build.started.elapsed().as_millis() as u64,
            apply_paused_us = paused.as_micros() as u64,
            "built snapshot"
        );
        Ok(SnapshotOf::<C, SnapshotData> {
            meta,
            snapshot: data,
        })
    }
}

impl<A: Application> RaftStateMachine<C> for StateMachine<A> {
    type SnapshotData = SnapshotData;
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
        let started = std::time::Instant::now();
        // Checked and decoded off the async workers, reading the file once more: the decoded
        // state is the only copy of the snapshot in memory.
        let (mut data, file) = tokio::task::spawn_blocking(move || {
            let mut data = snapshot;
            let mut f = data.file.try_clone()?;
            let (_, len) = check_snapshot(&mut f)?;
            let file = read_snapshot(&mut f, len)?;
            data.len = len;
            Ok::<_, io::Error>((data, file))
        })
        .await
        .map_err(io::Error::other)??;
        if file.meta.last_log_id != meta.last_log_id {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the snapshot's file does not hold the snapshot openraft names",
            ));
        }
        let mut applied = self.applied.lock().await;
        self.app.restore(&file.data)?;
        applied.last_applied = meta.last_log_id;
        applied.membership = meta.last_membership.clone();
        let dir = self.dir.clone();
        // A file received from the leader is moved into place; any other (a snapshot of
        // another store, as openraft's storage suite installs) is written anew.
        tokio::task::spawn_blocking(move || {
            if data.incoming.is_some() {
                place_received(&dir, &mut data)
            } else {
                write_snapshot_file(&dir, &file).map(|_| ())
            }
        })
        .await
        .map_err(io::Error::other)??;
        crate::metrics::METRICS
            .snapshot_install
            .observe(crate::metrics::secs(started.elapsed()));
        tracing::info!(last_log_id = ?meta.last_log_id, "installed snapshot");
        Ok(())
    }

    async fn get_current_snapshot(
        &mut self,
    ) -> Result<Option<SnapshotOf<C, Self::SnapshotData>>, io::Error> {
        let path = self.dir.join(SNAPSHOT_FILE);
        tokio::task::spawn_blocking(move || {
            let mut file = match std::fs::File::open(&path) {
                Ok(f) => f,
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
                Err(e) => return Err(e),
            };
            let (meta, len) = check_snapshot(&mut file)?;
            Ok(Some(SnapshotOf::<C, SnapshotData> {
                meta,
                snapshot: SnapshotData {
                    file,
                    len,
                    incoming: None,
                },
            }))
        })
        .await
        .map_err(io::Error::other)?
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
        fn snapshot(&self) -> crate::SnapshotEncoder {
            let on_disk = read_snapshot_file(&self.dir).unwrap().map(|f| f.data);
            let mut seen = self.on_disk_when_asked.lock().unwrap();
            seen.push(on_disk);
            let state = format!("state-{}", seen.len()).into_bytes();
            Box::new(move || state)
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

#[cfg(test)]
mod snapshot_file_tests {
    use super::*;

    /// The file is written in parts (never a second in-memory copy of the state's bytes), and
    /// the parts are exactly the one encoding older members wrote and every member reads:
    /// checked across the codec's length-prefix sizes (1, 3 and 5 bytes).
    #[test]
    fn snapshot_file_parts_are_its_encoding() {
        let dir = tempfile::tempdir().unwrap();
        for len in [0usize, 5, 250, 251, 300, 65_535, 65_536, 70_000] {
            let file = SnapshotFile {
                meta: SnapshotMetaOf::<C> {
                    last_log_id: None,
                    last_membership: Default::default(),
                },
                data: (0..len).map(|i| (i % 251) as u8).collect(),
            };
            let written = write_snapshot_file(dir.path(), &file).unwrap();
            let raw = std::fs::read(dir.path().join(SNAPSHOT_FILE)).unwrap();
            let whole = codec::encode(&file).unwrap();
            assert_eq!(&raw[4..], &whole[..], "data of {len} bytes");
            assert_eq!(raw[..4], crc32fast::hash(&whole).to_le_bytes());
            assert_eq!(written.len, raw.len() as u64);
            let back = read_snapshot_file(dir.path()).unwrap().unwrap();
            assert_eq!(back.data, file.data);
        }
    }
}
