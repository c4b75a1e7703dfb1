//! The runbooks in `docs/runbooks/` are executed, so they cannot drift from the product.
//!
//! Convention (the runbooks state it too):
//! - Every fenced block opened with "```sh" is a command block; it is run. Output samples use
//!   "```text". Any other fence language that looks like a shell ("bash", "shell", "console")
//!   fails this test, so no command can hide from it.
//! - The blocks of one document run in document order in ONE bash session with
//!   `set -euo pipefail`, so variables set by one block are seen by the next. A block fails the
//!   test if any command in it fails; each block prints an end marker and the test checks that
//!   every block reached its end.
//! - Before the first block the test sets the documented variables (`MODELFORGE_URL`,
//!   `MODELFORGE_ADMIN_TOKEN`, `NODE_ID`, `NODE_HOSTNAME`, `AGENT_STATE_DIR`, and the agent's
//!   own `MODELFORGE_CONTROL_PLANE`, `MODELFORGE_GPU_SOURCE`, `MODELFORGE_HOSTNAME`,
//!   `MODELFORGE_HEARTBEAT_INTERVAL`), puts `modelforge` and `modelforge-agent` on `PATH`, and
//!   starts an enrolled agent in the background.
//! - Background processes: a block that starts a long-running process (the agent) ends that
//!   command with `&` and stores `$!` in `AGENT_PID` on the next line; it logs to
//!   `$AGENT_STATE_DIR.log`. Later blocks stop it with `kill "$AGENT_PID"` and `wait`. The
//!   session runs in its own process group, which the test kills when it ends, however it ends.
//! - Blocks whose first line is `# rehearsal` simulate a failure on the disposable agent; they
//!   run like every other block.
//! - Exit codes are asserted exactly. Every command must exit 0 (`set -e`), except a step that
//!   ends with the comment `# expect exit N`: that line runs on its own and must exit exactly N
//!   (a doctor verdict, an agent that stops with a reason). No `||` or `&&` in a block: they
//!   would let a step fail, or succeed where a failure is expected, unnoticed (`cmd || true`,
//!   `cmd || test $? -eq 13` also accepting 0).

mod common;

use std::os::unix::process::CommandExt;
use std::time::Duration;

use common::*;

/// The `sh` blocks of a markdown document, in order; panics on a shell-like fence that is not `sh`.
fn sh_blocks(doc: &str) -> Vec<String> {
    let mut blocks = vec![];
    let mut current: Option<String> = None;
    for line in doc.lines() {
        let fence = line.trim_start();
        match &mut current {
            None if fence.starts_with("```") => {
                let lang = fence.trim_start_matches('`').trim();
                assert!(
                    !matches!(lang, "bash" | "shell" | "console" | "zsh"),
                    "a ```{lang} block would not be executed: use ```sh for commands, ```text for output"
                );
                if lang == "sh" {
                    current = Some(String::new());
                } else {
                    current = Some("\u{0}skip".to_string());
                }
            }
            Some(block) if fence.starts_with("```") => {
                if !block.starts_with('\u{0}') {
                    blocks.push(std::mem::take(block));
                }
                current = None;
            }
            Some(block) => {
                block.push_str(line);
                block.push('\n');
            }
            None => {}
        }
    }
    assert!(current.is_none(), "an unclosed code fence");
    blocks
}

/// The marker of a step expected to exit non-zero: `cmd  # expect exit N ...`.
const EXPECT_EXIT: &str = "# expect exit ";

/// `block` with every `# expect exit N` line turned into a check of that exact exit code;
/// panics on a line that would let a failure through unchecked (`||`, `&&`).
fn check_exit_codes(block: &str) -> String {
    let mut out = String::new();
    for (n, line) in block.lines().enumerate() {
        assert!(
            !line.contains("||") && !line.contains("&&"),
            "a runbook step with || or && can pass whatever it exits with; give each command its \
             own line and mark an expected failure with `{EXPECT_EXIT}N`: {line}"
        );
        let Some((command, rest)) = line.split_once(EXPECT_EXIT) else {
            out.push_str(line);
            out.push('\n');
            continue;
        };
        let code: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
        let code: u8 = code
            .parse()
            .unwrap_or_else(|_| panic!("`{EXPECT_EXIT}` needs an exit code: {line}"));
        assert!(
            !command.trim().is_empty(),
            "`{EXPECT_EXIT}` ends a command line: {line}"
        );
        let line_no = n + 1;
        out.push_str(&format!(
            "set +e\n{command}\nmf_rc=$?\nset -e\n\
             if [ \"$mf_rc\" -ne {code} ]; then echo \"::block line {line_no}: expected exit {code}, got $mf_rc\" >&2; exit 1; fi\n"
        ));
    }
    out
}

struct Session {
    child: std::process::Child,
}

impl Drop for Session {
    fn drop(&mut self) {
        // SAFETY: plain kill(2) on the process group of our own child.
        unsafe {
            libc::kill(-(self.child.id() as i32), libc::SIGKILL);
        }
        let _ = self.child.wait();
    }
}

/// Run every `sh` block of `doc_path` after a prelude that enrols an agent; return the output.
async fn run_runbook(doc_path: &str, hostname: &str, min_blocks: usize) {
    let mut c = Cluster::start(3).await;
    // For the member replacement runbook: a follower to lose, and where a new member listens.
    let leader = c.wait_leader().await;
    let lost = (1..=3).find(|id| *id != leader).unwrap();
    let new_port = free_port();
    let doc =
        std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(doc_path))
            .unwrap();
    let blocks = sh_blocks(&doc);
    assert!(
        blocks.len() >= min_blocks,
        "{doc_path}: only {} sh blocks found",
        blocks.len()
    );
    let root = c.root().to_path_buf();
    let bin_dir = server_bin().parent().unwrap().to_path_buf();
    let _ = agent_bin();
    let urls = c.urls().join(",");
    let state_dir = root.join("agent-state");
    let mut script = String::from("set -euo pipefail\n");
    // The prelude: an enrolled agent in the background, and the documented variables.
    script.push_str(
        r#"TOKEN=$(modelforge admin enrollments create --note "runbook test" -q)
MODELFORGE_ENROLLMENT_TOKEN="$TOKEN" modelforge-agent --state-dir "$AGENT_STATE_DIR" >>"$AGENT_STATE_DIR.log" 2>&1 &
AGENT_PID=$!
timeout 60 sh -c 'until modelforge admin nodes list --hostname "$NODE_HOSTNAME" -q | grep -q .; do sleep 0.2; done'
export NODE_ID=$(modelforge admin nodes list --hostname "$NODE_HOSTNAME" -q)
modelforge admin doctor "$NODE_ID" --wait 30s >/dev/null
echo "::prelude done"
"#,
    );
    for (i, b) in blocks.iter().enumerate() {
        let b = check_exit_codes(b);
        script.push_str(&format!(
            "echo '::block {i} start'\n{b}echo '::block {i} done'\n"
        ));
    }
    let script_path = root.join("runbook.sh");
    std::fs::write(&script_path, &script).unwrap();
    let log_path = root.join("runbook-session.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut cmd = std::process::Command::new("bash");
    cmd.arg(&script_path)
        .current_dir(&root)
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .env("PATH", path)
        .env("MODELFORGE_URL", &urls)
        .env("MODELFORGE_CACERT", &harness_ca().cert)
        .env("MODELFORGE_CA_FILE", &harness_ca().cert)
        .env("MODELFORGE_ADMIN_TOKEN", ADMIN)
        .env("MODELFORGE_CONTROL_PLANE", &urls)
        .env("MODELFORGE_GPU_SOURCE", "simulated:2")
        .env("MODELFORGE_HOSTNAME", hostname)
        .env("MODELFORGE_HEARTBEAT_INTERVAL", "300ms")
        .env("MODELFORGE_LOG", "info")
        .env("NODE_HOSTNAME", hostname)
        .env("AGENT_STATE_DIR", &state_dir)
        .env("MODELFORGE_TLS_CA", &harness_ca().cert)
        .env("MODELFORGE_TLS_CA_KEY", &harness_ca().key)
        .env("MODELFORGE_CLUSTER_SECRET", CLUSTER_SECRET)
        .env("LOST_MEMBER_ID", lost.to_string())
        .env("LOST_MEMBER_PID", c.pid(lost).unwrap().to_string())
        .env("LOST_MEMBER_DATA_DIR", c.data_dir(lost))
        .env("NEW_MEMBER_ID", "4")
        .env("NEW_MEMBER_LISTEN", format!("127.0.0.1:{new_port}"))
        .env("NEW_MEMBER_URL", devkit::url(new_port))
        .env_remove("MODELFORGE_ENROLLMENT_TOKEN")
        .process_group(0);
    let mut session = Session {
        child: cmd.spawn().expect("start bash"),
    };
    let status = wait_until(
        "the runbook session to end",
        Duration::from_secs(240),
        || {
            let r = session.child.try_wait().ok().flatten();
            async move { r }
        },
    )
    .await;
    let out = std::fs::read_to_string(&log_path).unwrap_or_default();
    let missing: Vec<usize> = (0..blocks.len())
        .filter(|i| !out.contains(&format!("::block {i} done")))
        .collect();
    if !status.success() || !missing.is_empty() {
        let failed = missing.first().copied();
        panic!(
            "{doc_path}: the session exited with {status}; blocks not completed: {missing:?}\n\
             first failing block:\n{}\n--- session output (last 60 lines):\n{}",
            failed.map(|i| blocks[i].as_str()).unwrap_or("(prelude)"),
            out.lines()
                .rev()
                .take(60)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
    assert!(!out.contains("mfnc_"), "no credential is ever printed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_command_of_the_recovery_runbook_runs() {
    run_runbook(
        "docs/runbooks/RUNBOOK_NODE_RECOVERY.md",
        "gpu-recovery-1",
        10,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_command_of_the_decommission_runbook_runs() {
    run_runbook(
        "docs/runbooks/RUNBOOK_NODE_DECOMMISSION.md",
        "gpu-retired-1",
        5,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_command_of_the_member_replacement_runbook_runs() {
    run_runbook(
        "docs/runbooks/RUNBOOK_MEMBER_REPLACEMENT.md",
        "gpu-member-1",
        5,
    )
    .await;
}

#[test]
fn only_sh_blocks_are_commands() {
    let doc = "x\n```sh\necho a\n```\n```text\nout\n```\n```sh\necho b\necho c\n```\n";
    assert_eq!(sh_blocks(doc), vec!["echo a\n", "echo b\necho c\n"]);
    let hidden = std::panic::catch_unwind(|| sh_blocks("```bash\nrm -rf /\n```\n"));
    assert!(hidden.is_err(), "a bash block would be skipped silently");
}

/// Run `block` as the runbook session would (`set -euo pipefail`, exit codes checked); its
/// exit status.
fn run_checked(block: &str) -> i32 {
    let script = format!("set -euo pipefail\n{}echo done\n", check_exit_codes(block));
    std::process::Command::new("bash")
        .arg("-c")
        .arg(script)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .expect("run bash")
        .code()
        .unwrap_or(-1)
}

#[test]
fn a_step_must_exit_exactly_the_code_it_expects() {
    assert_eq!(
        run_checked("true\nsh -c 'exit 13'  # expect exit 13 (conflict)\ntrue\n"),
        0
    );
    // Exit 0 where 13 is expected fails, and so does another failure code.
    assert_eq!(run_checked("true  # expect exit 13\n"), 1);
    assert_eq!(run_checked("sh -c 'exit 12'  # expect exit 13\n"), 1);
    // An unmarked step must exit 0.
    assert_eq!(run_checked("sh -c 'exit 13'\n"), 13);
    // The check leaves `set -e` on for the steps after it.
    assert_eq!(run_checked("sh -c 'exit 1'  # expect exit 1\nfalse\n"), 1);
    for lax in [
        "modelforge admin doctor x || echo \"exit $?\"\n",
        "modelforge admin doctor x || test $? -eq 13\n",
        "kill \"$AGENT_PID\" && wait \"$AGENT_PID\" || true\n",
    ] {
        let refused = std::panic::catch_unwind(|| check_exit_codes(lax));
        assert!(refused.is_err(), "accepted: {lax}");
    }
}

#[test]
fn the_runbooks_mark_every_expected_failure() {
    for doc in [
        "docs/runbooks/RUNBOOK_NODE_RECOVERY.md",
        "docs/runbooks/RUNBOOK_NODE_DECOMMISSION.md",
    ] {
        let text =
            std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(doc))
                .unwrap();
        for b in sh_blocks(&text) {
            check_exit_codes(&b);
        }
    }
}
