//! `modelforge-chaos`: run one chaos profile and print the report.
//! Exit status: 0 no violation, 1 violations, 2 harness trouble.

use std::path::PathBuf;
use std::time::Duration;

use modelforge_chaos::RunConfig;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    // Re-check a finished run offline: `--check <work dir>` (history.json, final-state.json).
    if let Some(dir) = arg(&args, "--check") {
        let dir = PathBuf::from(dir);
        let ops: Vec<modelforge_chaos::history::Op> =
            serde_json::from_slice(&std::fs::read(dir.join("history.json")).expect("history.json"))
                .expect("history");
        let fin: modelforge_chaos::checker::FinalState = serde_json::from_slice(
            &std::fs::read(dir.join("final-state.json")).expect("final-state.json"),
        )
        .expect("final state");
        let (violations, res) = modelforge_chaos::checker::check(&ops, &fin);
        println!("{} operations, unknown {res:?}", ops.len());
        for v in &violations {
            println!(
                "VIOLATION [{}] {} (operations {:?})",
                v.rule, v.detail, v.ops
            );
        }
        std::process::exit(if violations.is_empty() { 0 } else { 1 });
    }
    let num = |n: &str, d: u64| arg(&args, n).and_then(|v| v.parse().ok()).unwrap_or(d);
    let seed = num("--seed", modelforge_proto::now_ms() as u64);
    let exe = std::env::current_exe().expect("current exe");
    let server = arg(&args, "--server")
        .map(PathBuf::from)
        .unwrap_or_else(|| exe.with_file_name("modelforge"));
    let work = arg(&args, "--work-dir")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join(format!("mf-chaos-{seed}")));
    let cfg = RunConfig {
        seed,
        members: num("--members", 3) as usize,
        duration: Duration::from_secs(num("--duration-s", 60)),
        floors: None,
        agents: num("--agents", 6) as usize,
        heartbeaters: num("--heartbeaters", 4) as usize,
        fault_every: Duration::from_millis(num("--fault-every-ms", 800)),
        membership: args.iter().any(|a| a == "--membership"),
        server_bin: server,
        work_dir: work.clone(),
    };
    println!(
        "chaos: seed {seed}, {} members, {:?}; work dir {}",
        cfg.members,
        cfg.duration,
        work.display()
    );
    match modelforge_chaos::run(&cfg).await {
        Err(e) => {
            eprintln!(
                "{e} (this is not a verdict on the system; logs in {})",
                work.display()
            );
            std::process::exit(2);
        }
        Ok(r) => {
            println!("operations {}: {}", r.operations, r.exercised);
            for f in &r.faults {
                if f.status != "installed" {
                    println!(
                        "fault {} target {:?}: {}",
                        f.kind,
                        f.target.map(|t| t + 1),
                        f.status
                    );
                }
            }
            println!("unknown outcomes {:?}", r.resolution);
            std::fs::write(
                work.join("report.json"),
                serde_json::to_vec_pretty(&r).unwrap_or_default(),
            )
            .ok();
            if r.violations.is_empty() {
                println!("no violations");
            } else {
                for v in &r.violations {
                    println!(
                        "VIOLATION [{}] {} (operations {:?})",
                        v.rule, v.detail, v.ops
                    );
                }
                println!("seed {seed}; replay: {}", r.replay);
                println!("history: {}", work.join("history.json").display());
                std::process::exit(1);
            }
        }
    }
}
