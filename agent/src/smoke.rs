//! The capability smoke: what the runbook's Confirm step asks of a recovered node, checked on
//! the node itself and reported check by check.
//!
//! - `nvml`: the accelerator library answers (`ok`, or the simulated/fixture source);
//! - `accelerator_count`: as many accelerators as the control plane has in the inventory;
//! - `gpu:<uuid>`: each inventoried accelerator is present now and answers a telemetry read;
//! - `storage:<path>`: each storage root takes a 4 KiB file written with fsync, reads it back
//!   and removes it.

use std::io::Read;
use std::io::Write;
use std::path::Path;

use modelforge_proto::wire::Inventory;
use modelforge_proto::wire::SmokeCheckReport;
use modelforge_proto::wire::SmokeReport;

use crate::gpu::GpuSource;

fn check(name: impl Into<String>, ok: bool, detail: impl Into<String>) -> SmokeCheckReport {
    SmokeCheckReport {
        name: name.into(),
        ok,
        detail: detail.into(),
    }
}

/// Write, fsync, read back and remove a probe file under `root`.
fn probe_storage(root: &Path, smoke_id: &str) -> Result<(), String> {
    let path = root.join(format!(".modelforge-smoke-{smoke_id}"));
    let data: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
    let result = (|| -> std::io::Result<bool> {
        let mut f = std::fs::File::create(&path)?;
        f.write_all(&data)?;
        f.sync_all()?;
        let mut back = vec![];
        std::fs::File::open(&path)?.read_to_end(&mut back)?;
        Ok(back == data)
    })();
    let _ = std::fs::remove_file(&path);
    match result {
        Ok(true) => Ok(()),
        Ok(false) => Err("read back different bytes".into()),
        Err(e) => Err(e.to_string()),
    }
}

pub fn run(
    gpus: &GpuSource,
    inventory: &Inventory,
    expected: &[String],
    smoke_id: &str,
) -> SmokeReport {
    let mut checks = vec![];
    let nvml = inventory.nvml.clone().unwrap_or_else(|| "unknown".into());
    let nvml_ok = matches!(nvml.as_str(), "ok" | "simulated" | "fixture");
    checks.push(check("nvml", nvml_ok, format!("nvml: {nvml}")));
    let present: Vec<&str> = inventory
        .accelerators
        .iter()
        .map(|a| a.uuid.as_str())
        .collect();
    checks.push(check(
        "accelerator_count",
        present.len() == expected.len(),
        format!(
            "{} present, {} in the inventory",
            present.len(),
            expected.len()
        ),
    ));
    let telemetry = gpus.telemetry();
    for uuid in expected {
        let here = present.contains(&uuid.as_str());
        let answers = telemetry.accelerators.iter().any(|t| {
            t.uuid.as_deref() == Some(uuid.as_str())
                && (t.utilization_pct.is_some() || t.memory_used_mib.is_some())
        });
        let detail = match (here, answers) {
            (true, true) => "present and answering",
            (true, false) => "present but no telemetry reading",
            (false, _) => "missing",
        };
        checks.push(check(format!("gpu:{uuid}"), here && answers, detail));
    }
    for root in &inventory.storage_roots {
        let r = probe_storage(Path::new(&root.path), smoke_id);
        checks.push(check(
            format!("storage:{}", root.path),
            r.is_ok(),
            r.err()
                .unwrap_or_else(|| "4 KiB written with fsync and read back".into()),
        ));
    }
    SmokeReport { checks }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_simulated_node_passes_and_a_missing_gpu_or_unwritable_root_fails() {
        let gpus = GpuSource::open("simulated:2", "h").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let mut inv = gpus.inventory();
        inv.storage_roots = crate::gpu::storage_roots(&[dir.path().to_path_buf()]);
        let expected: Vec<String> = inv.accelerators.iter().map(|a| a.uuid.clone()).collect();
        let r = run(&gpus, &inv, &expected, "s1");
        assert!(r.checks.iter().all(|c| c.ok), "{r:?}");
        assert_eq!(r.checks.len(), 1 + 1 + 2 + 1);
        let mut more = expected.clone();
        more.push("GPU-gone".into());
        let r = run(&gpus, &inv, &more, "s2");
        assert!(r.checks.iter().any(|c| c.name == "gpu:GPU-gone" && !c.ok));
        assert!(
            r.checks
                .iter()
                .any(|c| c.name == "accelerator_count" && !c.ok)
        );
        inv.storage_roots[0].path = dir.path().join("absent").display().to_string();
        let r = run(&gpus, &inv, &expected, "s3");
        assert!(
            r.checks
                .iter()
                .any(|c| c.name.starts_with("storage:") && !c.ok)
        );
    }
}
