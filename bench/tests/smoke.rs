//! The benchmark's smoke profile runs every scenario small against real members: this checks
//! that the benchmark works (every scenario ran and wrote its figures), not how fast anything is.

#[test]
fn the_smoke_profile_runs_every_scenario_and_writes_its_figures() {
    let exe = std::path::PathBuf::from(env!("CARGO_BIN_EXE_modelforge-bench"));
    let server = exe.parent().unwrap().join("modelforge");
    assert!(
        server.exists(),
        "build the server first: cargo build --workspace --bins"
    );
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("bench.json");
    let status = std::process::Command::new(&exe)
        .args(["--profile", "smoke", "--server"])
        .arg(&server)
        .arg("--out")
        .arg(&out)
        .status()
        .unwrap();
    assert!(status.success(), "modelforge-bench --profile smoke failed");
    // The bench's own figures file (bench/src/report.rs builds it as a JSON map, and the bench
    // is a binary this test cannot import types from), not an API answer: read by key.
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    for key in [
        "bare_axum",
        "bare_axum_plain",
        "argon2",
        "enrol_burst",
        "heartbeats_all_to_the_leader",
        "heartbeats_spread_over_3_members",
        "writes_1_clients",
        "writes_16_clients",
        "writes_128_clients",
        "tls_vs_plain",
        "rss_mib_small",
        "heartbeats_open_loop",
        "failover",
        "rss_mib_large",
        "flood",
    ] {
        assert!(!v[key].is_null(), "{key} missing from the figures");
    }
    assert_eq!(
        v["failover"]["never_back"], 0,
        "an agent never got 200 again"
    );
    assert!(v["failover"]["write_ms"].as_f64().unwrap() > 0.0);
    assert!(v["enrol_burst"]["per_s"].as_f64().unwrap() > 0.0);
    let rss = v["rss_mib_large"]["members"].as_array().unwrap();
    assert!(
        rss.iter().all(|m| m.as_f64().unwrap() > 0.0),
        "every member's RSS was read"
    );
    for side in ["tls", "plain"] {
        for path in ["heartbeats", "writes"] {
            assert!(
                v["tls_vs_plain"][path][side]["per_s"].as_f64().unwrap() > 0.0,
                "no {path} over {side}"
            );
        }
    }
    assert!(v["tls_vs_plain"]["heartbeats"]["ratio"].as_f64().unwrap() > 0.0);
    assert!(v["table"].as_array().unwrap().len() >= 15);
    // Where etcd is installed (CI installs it), its reference is measured, never skipped.
    if ["/usr/bin/etcd", "/usr/local/bin/etcd"]
        .iter()
        .any(|p| std::path::Path::new(p).exists())
    {
        for c in [1, 16, 128] {
            assert!(
                !v[format!("etcd_{c}_clients")].is_null(),
                "etcd is installed, yet its {c}-client reference is missing"
            );
        }
    }
}
