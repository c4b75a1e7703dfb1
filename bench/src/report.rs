//! The result table (printed, with each figure's reference and target) and the JSON figures.

use std::path::Path;
use std::time::Duration;

use serde_json::Value;
use serde_json::json;

/// One line of the result table.
pub struct Row {
    scenario: String,
    figure: String,
    reference: String,
    target: String,
    met: Option<bool>,
}

#[derive(Default)]
pub struct Report {
    rows: Vec<Row>,
    json: serde_json::Map<String, Value>,
}

impl Report {
    pub fn row(
        &mut self,
        scenario: &str,
        figure: String,
        reference: String,
        target: &str,
        met: Option<bool>,
    ) {
        println!("  {scenario}: {figure}  [{reference}]");
        self.rows.push(Row {
            scenario: scenario.into(),
            figure,
            reference,
            target: target.into(),
            met,
        });
    }
    pub fn put(&mut self, key: &str, v: Value) {
        self.json.insert(key.into(), v);
    }

    /// Print the table and write the figures to `out`.
    pub fn finish(self, out: &Path) {
        let mut r = self;
        // ---- The table.
        println!();
        println!("| Scenario | Result | Reference (same run) | Target | |");
        println!("|---|---|---|---|---|");
        for row in &r.rows {
            let verdict = match row.met {
                Some(true) => "met",
                Some(false) => "**missed**",
                None => "",
            };
            println!(
                "| {} | {} | {} | {} | {verdict} |",
                row.scenario, row.figure, row.reference, row.target
            );
        }
        let rows: Vec<Value> = r
        .rows
        .iter()
        .map(|x| json!({"scenario": x.scenario, "result": x.figure, "reference": x.reference, "target": x.target, "met": x.met}))
        .collect();
        r.put("table", json!(rows));
        if let Some(parent) = out.parent() {
            let _ = std::fs::create_dir_all(parent);
        }
        std::fs::write(
            out,
            serde_json::to_string_pretty(&Value::Object(r.json)).expect("json"),
        )
        .expect("write the figures");
        println!("\nfigures written to {}", out.display());
    }
}

pub fn machine() -> Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    let mem_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .next()?
                .split_whitespace()
                .nth(1)?
                .parse::<f64>()
                .ok()
        })
        .map(|kib| kib / 1024.0 / 1024.0)
        .unwrap_or(0.0);
    json!({"cores": cores(), "cpu": cpu, "memory_gib": (mem_gib * 10.0).round() / 10.0})
}

pub fn cores() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
