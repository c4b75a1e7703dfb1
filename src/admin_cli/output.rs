//! How the CLI prints: `--output json` (the member's answer as sent), tables, `--quiet`.

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

/// A plain text table: a header row and left-aligned, padded columns.
pub(super) fn table(headers: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (i, cell) in r.iter().enumerate() {
            widths[i] = widths[i].max(cell.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let mut l = String::new();
        for (i, cell) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                l.push_str(cell);
            } else {
                l.push_str(&format!("{cell:<w$}  ", w = widths[i]));
            }
        }
        l.trim_end().to_string() + "\n"
    };
    let mut out = line(headers.iter().map(|h| h.to_string()).collect());
    for r in rows {
        out.push_str(&line(r));
    }
    out
}

/// Print `v` as JSON, or the human rendering.
pub(super) fn emit(args: &AdminArgs, v: &Value, human: impl FnOnce() -> String) {
    let text = match args.output {
        Output::Json => serde_json::to_string_pretty(v).unwrap_or_default() + "\n",
        Output::Table => printable(&human()),
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
    fn control_characters_are_escaped_and_lines_kept() {
        assert_eq!(
            super::printable("a\u{1b}[31mred\r\nb\u{9b}c"),
            "a\\u{1b}[31mred\\r\nb\\u{9b}c"
        );
    }
}
