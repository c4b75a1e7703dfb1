//! How the CLI prints: `-o table|wide|json|yaml` (tables by comfy-table; JSON and YAML are the
//! member's answer as sent), `--quiet`, times as people read them (jiff), confirmations and
//! progress bars on a terminal only (indicatif).

use std::io::Write;

use serde_json::Value;

use super::AdminArgs;
use super::Output;

/// An optional text as table text: absent as "-".
pub(super) fn opt<T: std::fmt::Display>(v: &Option<T>) -> String {
    v.as_ref().map_or_else(|| "-".into(), T::to_string)
}

/// A JSON value as table text: strings bare, null as "-".
pub(super) fn s(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(x) => x.clone(),
        other => other.to_string(),
    }
}

pub(super) fn arr(v: &Value) -> Vec<Value> {
    v.as_array().cloned().unwrap_or_default()
}

/// A plain text table: a header row and left-aligned columns two spaces apart, no borders.
pub(super) fn table(headers: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut t = comfy_table::Table::new();
    t.load_style(comfy_table::presets::NOTHING)
        .set_header(headers.to_vec())
        .add_rows(rows);
    for c in t.column_iter_mut() {
        c.set_padding((0, 2));
    }
    t.trim_fmt() + "\n"
}

/// Whether tables carry their wide columns (`-o wide`).
pub(super) fn wide(args: &AdminArgs) -> bool {
    args.output == Output::Wide
}

/// A table with `extra` columns appended under `-o wide`: each row is the narrow cells
/// followed by the wide ones.
pub(super) fn table_wide(
    args: &AdminArgs,
    headers: &[&str],
    extra: &[&str],
    rows: Vec<(Vec<String>, Vec<String>)>,
) -> String {
    if wide(args) {
        let headers: Vec<&str> = headers.iter().chain(extra).copied().collect();
        table(
            &headers,
            rows.into_iter()
                .map(|(mut n, w)| {
                    n.extend(w);
                    n
                })
                .collect(),
        )
    } else {
        table(headers, rows.into_iter().map(|(n, _)| n).collect())
    }
}

/// An RFC 3339 time as the server sends it, read (None for anything else).
pub(super) fn parse_time(s: &str) -> Option<jiff::Timestamp> {
    let s = s.trim();
    s.parse().ok().or_else(|| {
        // A time without an offset is UTC, as before jiff (`2026-12-01T10:00:00`).
        let _: jiff::civil::DateTime = s.parse().ok()?;
        format!("{s}Z").parse().ok()
    })
}

/// How long ago `at` was, for tables: `12s ago`, `5m ago`, `3h ago`, `2d ago` (the time as
/// given when it does not read as one; `-` when absent). `-o wide` shows the time itself.
pub(super) fn ago(args: &AdminArgs, at: &Option<String>) -> String {
    let Some(text) = at else {
        return "-".into();
    };
    if wide(args) {
        return text.clone();
    }
    let Some(t) = parse_time(text) else {
        return text.clone();
    };
    let s = (jiff::Timestamp::now().as_millisecond() - t.as_millisecond()).max(0) / 1000;
    match s {
        0..60 => format!("{s}s ago"),
        60..3600 => format!("{}m ago", s / 60),
        3600..86400 => format!("{}h ago", s / 3600),
        _ => format!("{}d ago", s / 86400),
    }
}

/// Ask `question` on the terminal and go on only on `yes`. Not on a terminal (a script, a
/// pipe), or with `yes` already given, it goes on without asking.
pub(super) fn confirm(question: &str, yes: bool) -> Result<(), super::Fail> {
    use std::io::IsTerminal;
    if yes || !std::io::stdin().is_terminal() {
        return Ok(());
    }
    eprint!("{} Type 'yes': ", printable(question));
    let _ = std::io::stderr().flush();
    let mut answer = String::new();
    let _ = std::io::stdin().read_line(&mut answer);
    if answer.trim() == "yes" {
        Ok(())
    } else {
        Err(super::Fail(
            super::EXIT_DECLINED,
            "not confirmed; nothing changed".into(),
        ))
    }
}

/// The progress bar of this invocation's long operations (a list of many pages, a download, a
/// member catching up), drawn on stderr only when stderr is a terminal and `--quiet` is not
/// given: scripts and logs never see it. Its style is set by the operation that uses it.
pub(super) fn progress(args: &AdminArgs) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    if args.quiet || !std::io::stderr().is_terminal() {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::with_draw_target(None, indicatif::ProgressDrawTarget::stderr())
    }
}

/// Print `v` as JSON or YAML, or the human rendering.
pub(super) fn emit(args: &AdminArgs, v: &Value, human: impl FnOnce() -> String) {
    let text = match args.output {
        Output::Json => serde_json::to_string_pretty(v).unwrap_or_default() + "\n",
        Output::Yaml => yaml(v),
        Output::Table | Output::Wide => printable(&human()),
    };
    print!("{text}");
    let _ = std::io::stdout().flush();
}

/// `--quiet` prints the primary values only, whatever `--output` says.
pub(super) fn emit_or_quiet(
    args: &AdminArgs,
    v: &Value,
    quiet: Vec<String>,
    human: impl FnOnce() -> String,
) {
    if args.quiet {
        for q in quiet {
            println!("{}", printable(&q));
        }
    } else {
        emit(args, v, human);
    }
}

/// `v` as a YAML document (control characters escaped by YAML's own quoting).
pub(super) fn yaml(v: &Value) -> String {
    serde_saphyr::to_string(v).unwrap_or_else(|e| format!("# not representable as YAML: {e}\n"))
}

pub(super) fn list_text<T: std::fmt::Display>(items: &[T]) -> String {
    if items.is_empty() {
        "none".into()
    } else {
        let items: Vec<String> = items.iter().map(T::to_string).collect();
        items.join(", ")
    }
}

/// `text` with every control character but the line break escaped (`\u{1b}`), so nothing a
/// node or a client put into a field (a hostname, a note, an inventory string) can drive the
/// operator's terminal. JSON output is escaped by JSON itself.
pub(super) fn printable(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() && c != '\n' {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn tables_are_left_aligned_two_spaces_apart_without_trailing_blanks() {
        let t = super::table(
            &["NODE", "STATUS"],
            vec![
                vec!["n-1".into(), "online".into()],
                vec!["node-22".into(), "-".into()],
            ],
        );
        assert_eq!(t, "NODE     STATUS\nn-1      online\nnode-22  -\n");
    }

    #[test]
    fn yaml_is_the_answer_as_sent() {
        let v = serde_json::json!({"nodes": [{"node_id": "n-1", "enabled": true}], "next": null});
        let y = super::yaml(&v);
        assert!(y.contains("node_id: n-1"), "{y}");
        assert!(y.contains("enabled: true"), "{y}");
    }

    #[test]
    fn control_characters_are_escaped_and_lines_kept() {
        assert_eq!(
            super::printable("a\u{1b}[31mred\r\nb\u{9b}c"),
            "a\\u{1b}[31mred\\r\nb\\u{9b}c"
        );
    }

    #[test]
    fn times_with_or_without_an_offset() {
        let t = |s| super::parse_time(s).map(|t| t.as_millisecond());
        assert_eq!(t("2026-12-01T10:00:00Z"), Some(1_796_119_200_000));
        assert_eq!(t("2026-12-01T11:00:00+01:00"), Some(1_796_119_200_000));
        assert_eq!(t("2026-12-01T10:00:00"), Some(1_796_119_200_000));
        assert_eq!(t("yesterday"), None);
    }
}
