//! Issue 16: a full or failing disk is an alarm, not a corruption. Each test mounts a small
//! tmpfs over a member's data dir, fills it under enrolment traffic, and checks what the
//! member does: under its free-space reserve it refuses writes with 503 `disk_full`, raises an
//! alarm, keeps serving reads and heartbeats, and recovers by itself when space returns; a
//! Raft log write that fails anyway stops the member (exit 74), and nothing it acknowledged is
//! lost when it starts again on the freed disk.

mod common;

use std::io::Write;
use std::path::Path;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering;

use common::*;
use modelforge_proto::api;
use serde_json::json;

/// A tmpfs of `mib` MiB mounted at `at` for as long as this lives.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(at: &Path, mib: u64) -> Self {
        std::fs::create_dir_all(at).unwrap();
        let st = std::process::Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={mib}m,mode=0700"),
                "tmpfs",
            ])
            .arg(at)
            .status()
            .expect("run mount");
        assert!(
            st.success(),
            "mounting a tmpfs failed: these tests need root (CI runs as root)"
        );
        Tmpfs(at.to_path_buf())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

fn free_bytes(dir: &Path) -> u64 {
    modelforge::disk::free_bytes(dir).unwrap()
}

/// Write zeros into `file` until `dir` has at most `leave` bytes free (or the disk is full).
fn fill(dir: &Path, file: &Path, leave: u64) {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(file)
        .unwrap();
    let chunk = vec![0u8; 1 << 20];
    while free_bytes(dir) > leave {
        let want = (free_bytes(dir) - leave).min(chunk.len() as u64) as usize;
        if f.write_all(&chunk[..want.max(1)]).is_err() {
            break;
        }
    }
    let _ = f.flush();
}

/// Enrolment-token creation in a loop until stopped.
struct Traffic {
    task: tokio::task::JoinHandle<()>,
    /// The ids of the tokens whose creation was acknowledged (201).
    acked: Arc<Mutex<Vec<String>>>,
    /// Every answer's status and error code.
    answers: Arc<Mutex<Vec<(u16, String)>>>,
}

/// Start creating tokens against `url` and wait until a few were acknowledged; the switch
/// that stops it.
async fn create_tokens(url: String) -> (Arc<AtomicBool>, Traffic) {
    let stop = Arc::new(AtomicBool::new(false));
    let traffic = spawn_token_creation(url, stop.clone());
    let acked = traffic.acked.clone();
    wait_until("some tokens created", WAIT, || async {
        (acked.lock().unwrap().len() >= 5).then_some(())
    })
    .await;
    (stop, traffic)
}

fn spawn_token_creation(url: String, stop: Arc<AtomicBool>) -> Traffic {
    let acked = Arc::new(Mutex::new(vec![]));
    let answers = Arc::new(Mutex::new(vec![]));
    let (a, b) = (acked.clone(), answers.clone());
    let task = tokio::spawn(async move {
        while !stop.load(Ordering::SeqCst) {
            let (s, v) = call(
                "POST",
                &format!("{url}/api/v1/admin/node-enrollments"),
                Some(ADMIN),
                Some(json!({"ttl_seconds": 600, "note": "x".repeat(200)})),
            )
            .await;
            if s == 201 {
                let t: api::TokenIssued = typed("a new token", &v);
                a.lock().unwrap().push(t.enrollment_id.to_string());
            }
            let code = v["error"]["code"].as_str().unwrap_or("").to_string();
            b.lock().unwrap().push((s, code));
            if s == 0 {
                // The member is gone (the second test stops it on purpose).
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    });
    Traffic {
        task,
        acked,
        answers,
    }
}

async fn every_token_exists(url: &str, ids: &[String]) {
    let (s, v) = call(
        "GET",
        &format!("{url}/api/v1/admin/node-enrollments"),
        Some(ADMIN),
        None,
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let listed: api::Enrollments = typed("the enrolment tokens", &v);
    let listed: std::collections::BTreeSet<String> = listed
        .enrollments
        .iter()
        .map(|e| e.enrollment_id.to_string())
        .collect();
    for id in ids {
        assert!(listed.contains(id), "acknowledged token {id} is missing");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_under_its_reserve_refuses_writes_raises_an_alarm_and_recovers_by_itself() {
    let mut c = Cluster::unstarted(1, &["--disk-reserve-mib", "16"]);
    let dir = c.data_dir(1);
    let _disk = Tmpfs::mount(&dir, 64);
    c.start_all().await;
    let url = c.url(1);
    let (_agent, nid, cred) = c.enrol_one("d").await;
    c.wait_first_use(&nid).await;

    let (stop, traffic) = create_tokens(url.clone()).await;
    let Traffic {
        task: traffic,
        acked,
        answers,
    } = traffic;
    // Leave 8 MiB free: under the reserve of 16.
    let filler = dir.join("filler");
    fill(&dir, &filler, 8 << 20);
    let view = wait_until("the disk alarm", WAIT, || async {
        c.cluster_view(1).await.filter(|v| v.disk.alarm)
    })
    .await;
    assert_eq!(view.disk.reserve_bytes, 16 << 20);
    assert!(view.disk.free_bytes < 16 << 20 && view.disk.alarm_since.is_some());
    wait_until("writes refused with disk_full", WAIT, || async {
        answers
            .lock()
            .unwrap()
            .iter()
            .any(|(s, code)| *s == 503 && code == "disk_full")
            .then_some(())
    })
    .await;
    let (s, v) = call(
        "POST",
        &format!("{url}/api/v1/admin/node-enrollments"),
        Some(ADMIN),
        Some(json!({})),
    )
    .await;
    assert_eq!(refused(s, &v), (503, "disk_full"), "{v}");
    // Reads and heartbeats that need no write are still answered.
    assert_eq!(c.heartbeat_all(&nid, &cred).await, vec![200]);
    let (s, _) = call(
        "GET",
        &format!("{url}/api/v1/admin/hardware/nodes"),
        Some(ADMIN),
        None,
    )
    .await;
    assert_eq!(s, 200);
    // The cluster doctor names the member and its disk.
    let (_, v) = admin_json(&url, &["doctor", "--cluster"]).await;
    assert_eq!(v["disk_alarms"][0]["id"], 1, "{v}");

    // Space returns: the alarm clears by itself and writes are accepted again.
    std::fs::remove_file(&filler).unwrap();
    wait_until("the alarm clears", WAIT, || async {
        c.cluster_view(1).await.filter(|v| !v.disk.alarm)
    })
    .await;
    let before = acked.lock().unwrap().len();
    wait_until("writes accepted again", WAIT, || async {
        (acked.lock().unwrap().len() > before).then_some(())
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    traffic.await.unwrap();
    let answers = answers.lock().unwrap().clone();
    assert!(
        answers
            .iter()
            .all(|(s, code)| *s == 201 || (*s == 503 && code == "disk_full")),
        "an answer other than 201 or 503 disk_full: {:?}",
        answers
            .iter()
            .filter(|(s, _)| *s != 201 && *s != 503)
            .collect::<Vec<_>>()
    );

    // Nothing acknowledged was lost, and the log opens cleanly after a crash.
    let acked = acked.lock().unwrap().clone();
    c.kill9(1);
    c.start_member(1);
    c.wait_ready().await;
    every_token_exists(&url, &acked).await;
    assert!(!c.log(1).contains("panicked"), "{}", c.log(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_raft_log_write_stops_the_member_and_loses_no_acknowledged_write() {
    // No reserve: the disk really fills, and a Raft log write fails.
    let mut c = Cluster::unstarted(1, &["--disk-reserve-mib", "0"]);
    let dir = c.data_dir(1);
    let _disk = Tmpfs::mount(&dir, 48);
    c.start_all().await;
    let url = c.url(1);
    let (stop, traffic) = create_tokens(url.clone()).await;
    let Traffic {
        task: traffic,
        acked,
        ..
    } = traffic;
    let filler = dir.join("filler");
    fill(&dir, &filler, 0);
    // The next write that needs a page it cannot get fails, and the member stops: never a
    // retried fsync, never an acknowledged write that is not on disk.
    let code = c.wait_exit(1).await;
    stop.store(true, Ordering::SeqCst);
    traffic.await.unwrap();
    assert_eq!(code, 74, "{}", c.log(1));
    assert!(
        c.log(1).contains("raft log write or fsync failed"),
        "{}",
        c.log(1)
    );

    // Space returns; the member starts again from its disk with every acknowledged write.
    std::fs::remove_file(&filler).unwrap();
    let acked = acked.lock().unwrap().clone();
    assert!(acked.len() >= 5);
    c.start_member(1);
    c.wait_ready().await;
    every_token_exists(&url, &acked).await;
    let (s, v) = call(
        "POST",
        &format!("{url}/api/v1/admin/node-enrollments"),
        Some(ADMIN),
        Some(json!({})),
    )
    .await;
    assert_eq!(s, 201, "{v}");
}
