//! The data dir's free space, watched (ARCHITECTURE.md, "Durability"): below the reserve the
//! member raises an alarm (`GET /api/v1/cluster`, the cluster doctor) and refuses new writes
//! with 503 `disk_full`, before the disk is actually full, so that no write ever has to fail
//! half-way; it keeps answering reads and heartbeats that need no write, and clears the alarm
//! by itself once space returns. A write or fsync of the Raft log that fails anyway (another
//! process filled the disk between two checks, a failing device) stops the member: its data
//! may not be on disk, and the page cache cannot be trusted after a failed fsync.

use std::path::Path;
use std::path::PathBuf;
use std::sync::atomic::AtomicI64;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;

/// How often free space is measured.
pub const CHECK_EVERY: std::time::Duration = std::time::Duration::from_millis(500);

pub struct DiskWatch {
    path: PathBuf,
    reserve: u64,
    free: AtomicU64,
    /// When the alarm was raised (ms since the epoch), 0 while there is none.
    low_since_ms: AtomicI64,
}

/// Bytes an unprivileged process may still write on the filesystem of `path`.
pub fn free_bytes(path: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a valid out-parameter for the call.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

impl DiskWatch {
    /// Watch the filesystem of `path`, keeping `reserve` bytes free (0: never alarm).
    pub fn new(path: &Path, reserve: u64, now_ms: i64) -> Self {
        let w = Self {
            path: path.to_path_buf(),
            reserve,
            free: AtomicU64::new(u64::MAX),
            low_since_ms: AtomicI64::new(0),
        };
        w.check(now_ms);
        w
    }

    /// Measure now; raise the alarm below the reserve, clear it once free space is back above
    /// the reserve by an eighth (so that it does not flap at the edge). Returns the change:
    /// `Some(true)` raised, `Some(false)` cleared.
    pub fn check(&self, now_ms: i64) -> Option<bool> {
        let free = match free_bytes(&self.path) {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!(path = %self.path.display(), error = %e, "cannot measure free disk space");
                return None;
            }
        };
        self.free.store(free, Ordering::Relaxed);
        self.judge(free, now_ms)
    }

    fn judge(&self, free: u64, now_ms: i64) -> Option<bool> {
        let low = self.low_since_ms.load(Ordering::Relaxed) != 0;
        if !low && free < self.reserve {
            self.low_since_ms.store(now_ms.max(1), Ordering::Relaxed);
            return Some(true);
        }
        if low && free >= self.reserve.saturating_add(self.reserve / 8) {
            self.low_since_ms.store(0, Ordering::Relaxed);
            return Some(false);
        }
        None
    }

    /// Whether new writes are refused now.
    pub fn low(&self) -> bool {
        self.low_since_ms.load(Ordering::Relaxed) != 0
    }

    pub fn view(&self) -> modelforge_proto::api::DiskView {
        let since = self.low_since_ms.load(Ordering::Relaxed);
        modelforge_proto::api::DiskView {
            free_bytes: self.free.load(Ordering::Relaxed),
            reserve_bytes: self.reserve,
            alarm: since != 0,
            alarm_since: (since != 0).then(|| modelforge_proto::rfc3339_ms(since)),
        }
    }

    /// The answer to a write refused for want of space.
    pub fn refusal(&self) -> crate::error::ApiError {
        let mut e = crate::error::ApiError::new(
            modelforge_proto::api::ErrorCode::DiskFull,
            format!(
                "this member's data dir has {} MiB free, under its reserve of {} MiB: writes are refused until space returns",
                self.free.load(Ordering::Relaxed) >> 20,
                self.reserve >> 20
            ),
        );
        e.retry_after_s = Some(CHECK_EVERY.as_secs().max(1) * 2);
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_alarm_rises_under_the_reserve_and_clears_an_eighth_above_it() {
        let w = DiskWatch::new(Path::new("/"), 800, 1);
        w.low_since_ms.store(0, Ordering::Relaxed);
        assert_eq!(w.judge(900, 10), None);
        assert_eq!(w.judge(799, 20), Some(true));
        assert!(w.low());
        assert_eq!(
            w.judge(850, 30),
            None,
            "back over the reserve, not by an eighth"
        );
        assert!(w.low());
        assert_eq!(w.judge(900, 40), Some(false));
        assert!(!w.low());
        assert!(free_bytes(Path::new("/")).unwrap() > 0);
    }
}
