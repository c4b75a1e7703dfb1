//! Where a member's settings come from: a flag, else its environment variable
//! (`MODELFORGE_<FLAG>`), else the `--config` TOML file (`<flag>` with `-` as `_`), else the
//! default. clap reads flags and the environment; the file's settings are handed to clap as
//! flags only where neither gave one, so the precedence is clap's own and each value is
//! checked by the same parser as its flag.

use std::ffi::OsString;
use std::path::Path;

use anyhow::Context;
use anyhow::bail;
use clap::CommandFactory;
use clap::FromArgMatches;
use clap::parser::ValueSource;

use crate::cli::Cli;

/// The subcommands that take the member's settings (and so `--config`).
const SETTINGS: [&[&str]; 2] = [&["serve"], &["config", "validate"]];

/// The command line's grammar, with an environment variable for every member setting that
/// has no other: `MODELFORGE_` and the flag's name in capitals, `-` as `_`.
pub fn command() -> clap::Command {
    let mut cmd = Cli::command();
    for path in SETTINGS {
        cmd = mut_path(cmd, path, &|sub| sub.mut_args(with_env));
    }
    cmd
}

fn mut_path(
    cmd: clap::Command,
    path: &[&str],
    f: &dyn Fn(clap::Command) -> clap::Command,
) -> clap::Command {
    match path {
        [] => f(cmd),
        [first, rest @ ..] => cmd.mut_subcommand(*first, |sub| mut_path(sub, rest, f)),
    }
}

fn with_env(arg: clap::Arg) -> clap::Arg {
    let Some(long) = arg.get_long().map(str::to_string) else {
        return arg;
    };
    if arg.get_env().is_some() || long == "help" || long == "version" {
        return arg;
    }
    let many = matches!(arg.get_action(), clap::ArgAction::Append);
    let arg = arg.env(env_name(&long));
    // A list from the environment is comma-separated (`MODELFORGE_PEER=1=https://a,2=...`).
    if many { arg.value_delimiter(',') } else { arg }
}

/// The environment variable of `--<long>`.
pub fn env_name(long: &str) -> String {
    format!("MODELFORGE_{}", long.to_uppercase().replace('-', "_"))
}

/// Parse the process's command line, the environment and the `--config` file.
pub fn parse() -> Cli {
    match parse_from(std::env::args_os().collect()) {
        Ok(cli) => cli,
        Err(e) => match e.downcast::<clap::Error>() {
            Ok(e) => e.exit(),
            Err(e) => {
                eprintln!("modelforge: {e:#}");
                std::process::exit(2);
            }
        },
    }
}

/// [`parse`] of `argv` (its first item the program's name).
pub fn parse_from(argv: Vec<OsString>) -> anyhow::Result<Cli> {
    let matches = command().try_get_matches_from(&argv)?;
    let Some((sub, file)) = settings_and_file(&matches) else {
        return Ok(Cli::from_arg_matches(&matches)?);
    };
    let extra = file_flags(&sub, &file)?;
    if extra.is_empty() {
        return Ok(Cli::from_arg_matches(&matches)?);
    }
    let mut argv = argv;
    argv.extend(extra);
    let matches = command()
        .try_get_matches_from(&argv)
        .map_err(|e| anyhow::anyhow!("{}: {}", file.display(), e.render()))?;
    Ok(Cli::from_arg_matches(&matches)?)
}

/// The settings subcommand's matches and the config file it names, if it names one.
fn settings_and_file(matches: &clap::ArgMatches) -> Option<(clap::ArgMatches, std::path::PathBuf)> {
    for path in SETTINGS {
        let mut m = matches;
        let mut found = true;
        for name in path {
            match m.subcommand() {
                Some((n, sub)) if n == *name => m = sub,
                _ => {
                    found = false;
                    break;
                }
            }
        }
        if found {
            let file = m.get_one::<std::path::PathBuf>("config")?.clone();
            return Some((m.clone(), file));
        }
    }
    None
}

/// The flags the file gives for settings that no flag and no environment variable set.
fn file_flags(sub: &clap::ArgMatches, file: &Path) -> anyhow::Result<Vec<OsString>> {
    let text = std::fs::read_to_string(file).with_context(|| format!("read {}", file.display()))?;
    let table: toml::Table = text
        .parse()
        .map_err(|e| anyhow::anyhow!("{}: not TOML: {e}", file.display()))?;
    let serve = serve_command();
    let mut flags = vec![];
    for (key, value) in &table {
        let long = key.replace('_', "-");
        let Some(arg) = serve
            .get_arguments()
            .find(|a| a.get_long() == Some(long.as_str()) && long != "config")
        else {
            bail!(
                "{}: unknown setting `{key}` (the settings are `modelforge serve`'s flags, with `-` as `_`)",
                file.display()
            );
        };
        let id = arg.get_id().as_str();
        if matches!(
            sub.value_source(id),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        ) {
            continue;
        }
        let wrong = |want: &str| {
            anyhow::anyhow!(
                "{}: `{key}` must be {want}, not {}",
                file.display(),
                value.type_str()
            )
        };
        let flag = format!("--{long}");
        match (arg.get_action(), value) {
            (clap::ArgAction::SetTrue, toml::Value::Boolean(b)) => {
                if *b {
                    flags.push(flag.into());
                }
            }
            (clap::ArgAction::SetTrue, _) => return Err(wrong("true or false")),
            (clap::ArgAction::Append, toml::Value::Array(items)) => {
                for item in items {
                    flags.push(flag.clone().into());
                    flags.push(
                        scalar(item)
                            .ok_or_else(|| wrong("a list of values"))?
                            .into(),
                    );
                }
            }
            (_, v) => {
                let text = scalar(v).ok_or_else(|| wrong("a value"))?;
                check_value(&serve, key, &flag, &text, file)?;
                flags.push(flag.into());
                flags.push(text.into());
            }
        }
    }
    Ok(flags)
}

/// Refuse a value its flag's parser refuses, naming the file's key (clap would name the flag).
fn check_value(
    serve: &clap::Command,
    key: &str,
    flag: &str,
    value: &str,
    file: &Path,
) -> anyhow::Result<()> {
    match serve.clone().try_get_matches_from(["serve", flag, value]) {
        Err(e)
            if matches!(
                e.kind(),
                clap::error::ErrorKind::ValueValidation | clap::error::ErrorKind::InvalidValue
            ) =>
        {
            let why = std::error::Error::source(&e)
                .map(|s| s.to_string())
                .unwrap_or_else(|| "not a value it takes".to_string());
            bail!(
                "{}: `{key}` = {value:?} is not valid: {why}",
                file.display()
            )
        }
        _ => Ok(()),
    }
}

/// A TOML scalar as the text of a flag's value (tables and arrays are not scalars).
fn scalar(v: &toml::Value) -> Option<String> {
    match v {
        toml::Value::String(s) => Some(s.clone()),
        toml::Value::Integer(i) => Some(i.to_string()),
        toml::Value::Float(f) => Some(f.to_string()),
        toml::Value::Boolean(b) => Some(b.to_string()),
        _ => None,
    }
}

fn serve_command() -> clap::Command {
    command()
        .find_subcommand("serve")
        .expect("the serve subcommand")
        .clone()
}

/// `modelforge config validate`: each setting's value and where it came from, one
/// `key = value  # source` line each (secrets never pass through flags: only file names).
pub fn describe(argv: Vec<OsString>) -> anyhow::Result<String> {
    let matches = command().try_get_matches_from(&argv)?;
    let matches = match settings_and_file(&matches) {
        Some((sub, file)) => {
            let extra = file_flags(&sub, &file)?;
            let mut argv = argv.clone();
            let n = extra.len();
            argv.extend(extra);
            let m = command()
                .try_get_matches_from(&argv)
                .map_err(|e| anyhow::anyhow!("{}: {}", file.display(), e.render()))?;
            (m, Some((file, n)))
        }
        None => (matches, None),
    };
    let (matches, file) = matches;
    let Some(("config", m)) = matches.subcommand() else {
        bail!("not `config validate`");
    };
    let Some(("validate", m)) = m.subcommand() else {
        bail!("not `config validate`");
    };
    let mut out = String::new();
    let cmd = serve_command();
    for arg in cmd.get_arguments() {
        let (Some(long), id) = (arg.get_long(), arg.get_id().as_str()) else {
            continue;
        };
        if matches!(long, "help" | "version" | "config") {
            continue;
        }
        let Some(values) = m.get_raw(id) else {
            continue;
        };
        let values: Vec<String> = values.map(|v| v.to_string_lossy().into_owned()).collect();
        let source = match m.value_source(id) {
            Some(ValueSource::CommandLine) => match &file {
                // The file's settings reach clap as flags too: those came from the file.
                Some((_, n)) if from_file(&argv, long) && *n > 0 => "file",
                _ => "flag",
            },
            Some(ValueSource::EnvVariable) => "environment",
            Some(ValueSource::DefaultValue) => "default",
            _ => "unknown",
        };
        out.push_str(&format!(
            "{} = {}  # {source}\n",
            long.replace('-', "_"),
            values.join(",")
        ));
    }
    Ok(out)
}

/// Whether `--<long>` is absent from the command line as typed (so a value for it that clap
/// saw on its command line was appended from the file).
fn from_file(argv: &[OsString], long: &str) -> bool {
    let flag = format!("--{long}");
    !argv.iter().any(|a| {
        let a = a.to_string_lossy();
        a == flag || a.starts_with(&format!("{flag}="))
    })
}
