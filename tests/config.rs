//! Member settings from a `--config` TOML file, the environment and flags: the precedence
//! flag > environment > file > default, `config validate`'s refusals naming the key, every
//! flag's environment variable in `--help`, and a member that serves as its file says.

mod common;

use std::path::Path;

use common::*;

/// `modelforge <args>` with `env` added to a clean environment: exit code, stdout, stderr.
fn modelforge(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut cmd = std::process::Command::new(server_bin());
    cmd.args(args).env_clear();
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("modelforge runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.to_string_lossy().into_owned()
}

/// The `key = value  # source` line `validate` printed for `key`.
fn setting<'a>(out: &'a str, key: &str) -> &'a str {
    out.lines()
        .find(|l| l.starts_with(&format!("{key} = ")))
        .unwrap_or_else(|| panic!("no {key} in:\n{out}"))
}

#[test]
fn a_flag_beats_the_environment_which_beats_the_file_which_beats_the_default() {
    let dir = Scratch::new();
    let file = write(
        dir.path(),
        "member.toml",
        "listen = \"127.0.0.1:1111\"\nstale_after = \"45s\"\npeer = [\"1=https://a:7070\", \"2=https://b:7070\"]\ninsecure_http = true\n",
    );
    let validate = |extra: &[&str], env: &[(&str, &str)]| {
        let mut args = vec!["config", "validate", "--config", file.as_str()];
        args.extend_from_slice(extra);
        let (code, out, err) = modelforge(&args, env);
        assert_eq!(code, 0, "{err}");
        out
    };
    // The file over the defaults.
    let out = validate(&[], &[]);
    assert_eq!(setting(&out, "listen"), "listen = 127.0.0.1:1111  # file");
    assert_eq!(setting(&out, "stale_after"), "stale_after = 45s  # file");
    assert_eq!(
        setting(&out, "peer"),
        "peer = 1=https://a:7070,2=https://b:7070  # file"
    );
    assert_eq!(
        setting(&out, "insecure_http"),
        "insecure_http = true  # file"
    );
    assert_eq!(
        setting(&out, "offline_after"),
        "offline_after = 90s  # default"
    );
    // The environment over the file.
    let env = [
        ("MODELFORGE_LISTEN", "127.0.0.1:2222"),
        ("MODELFORGE_OFFLINE_AFTER", "2m"),
    ];
    let out = validate(&[], &env);
    assert_eq!(
        setting(&out, "listen"),
        "listen = 127.0.0.1:2222  # environment"
    );
    assert_eq!(
        setting(&out, "offline_after"),
        "offline_after = 2m  # environment"
    );
    assert_eq!(setting(&out, "stale_after"), "stale_after = 45s  # file");
    // A flag over both.
    let out = validate(&["--listen", "127.0.0.1:3333"], &env);
    assert_eq!(setting(&out, "listen"), "listen = 127.0.0.1:3333  # flag");
    // No file: the default.
    let (code, out, err) = modelforge(&["config", "validate"], &[]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        setting(&out, "listen"),
        "listen = 127.0.0.1:7070  # default"
    );
}

#[test]
fn unknown_keys_and_wrong_types_are_refused_naming_the_key() {
    let dir = Scratch::new();
    for (text, key) in [
        (
            "listen = \"127.0.0.1:1\"\nlisten_port = 7070\n",
            "listen_port",
        ),
        ("max_body_bytes = \"lots\"\n", "max_body_bytes"),
        ("stale_after = \"soon\"\n", "stale_after"),
        ("insecure_http = \"yes\"\n", "insecure_http"),
        ("peer = [[1, 2]]\n", "peer"),
        ("[serve]\nlisten = \"x\"\n", "serve"),
    ] {
        let file = write(dir.path(), "bad.toml", text);
        let (code, _, err) = modelforge(&["config", "validate", "--config", &file], &[]);
        assert_eq!(code, 2, "{text}: {err}");
        assert!(err.contains(&format!("`{key}`")), "{text}: {err}");
        // `serve` refuses it the same way, before starting anything.
        let (code, _, err) = modelforge(&["serve", "--config", &file], &[]);
        assert_eq!(code, 2, "{text}: {err}");
        assert!(err.contains(&format!("`{key}`")), "{text}: {err}");
    }
    let file = write(dir.path(), "broken.toml", "listen = \n");
    let (code, _, err) = modelforge(&["config", "validate", "--config", &file], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("not TOML"), "{err}");
}

#[test]
fn help_names_the_environment_variable_of_every_flag() {
    let (code, help, _) = modelforge(&["serve", "--help"], &[]);
    assert_eq!(code, 0);
    let mut flags = 0;
    for line in help.lines() {
        let Some(rest) = line.trim_start().strip_prefix("--") else {
            continue;
        };
        let flag: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
            .collect();
        if flag == "help" {
            continue;
        }
        flags += 1;
        let var = format!("MODELFORGE_{}", flag.to_uppercase().replace('-', "_"));
        assert!(
            help.contains(&format!("[env: {var}")),
            "--{flag} has no {var}:\n{help}"
        );
    }
    assert!(flags >= 30, "{flags} flags in:\n{help}");
}

#[tokio::test]
async fn a_member_serves_as_its_settings_file_says() {
    let dir = Scratch::new();
    let port = devkit::free_port();
    let data = dir.path().join("data");
    let file = write(
        dir.path(),
        "member.toml",
        &format!(
            "listen = \"127.0.0.1:{port}\"\ndata_dir = \"{}\"\ninsecure_http = true\nstale_after = \"40s\"\n",
            data.display()
        ),
    );
    let log = dir.path().join("member.log");
    let mut member = spawn(
        &server_bin(),
        &["serve".to_string(), "--config".to_string(), file],
        &log,
        &MEMBER_ENV,
    );
    let url = format!("http://127.0.0.1:{port}");
    wait_until("the member answers on the file's port", WAIT, || {
        let url = url.clone();
        async move {
            let r = http().get(format!("{url}/readyz")).send().await.ok()?;
            (r.status() == 200).then_some(())
        }
    })
    .await;
    assert!(data.join("raft").exists() || data.read_dir().unwrap().next().is_some());
    assert!(member.signal(libc::SIGTERM));
    assert_eq!(wait_exit_of(&mut member, "the member stops").await, 0);
}

#[test]
fn completion_scripts_are_printed_for_each_shell_and_bash_loads_its_own() {
    for (shell, mark) in [
        ("bash", "complete -F _modelforge"),
        ("zsh", "#compdef modelforge"),
        ("fish", "complete -c modelforge"),
    ] {
        let (code, out, err) = modelforge(&["completion", shell], &[]);
        assert_eq!(code, 0, "{shell}: {err}");
        assert!(
            out.contains(mark),
            "{shell}: {}",
            &out[..out.len().min(300)]
        );
        assert!(out.contains("admin") && out.contains("serve"), "{shell}");
    }
    let (code, _, _) = modelforge(&["completion", "tcsh"], &[]);
    assert_eq!(code, 2, "an unknown shell is a usage error");
    // bash itself takes the script and registers the completion.
    let dir = tempfile::tempdir().unwrap();
    let script = write(
        dir.path(),
        "c.bash",
        &modelforge(&["completion", "bash"], &[]).1,
    );
    let out = std::process::Command::new("bash")
        .args(["-c", &format!("source {script} && complete -p modelforge")])
        .output()
        .expect("bash runs");
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("_modelforge"));
}
