//! The `--config` file of `balancer launch`: TOML read as typed values,
//! every key checked against the flag of the same name and merged under the
//! command line.
//!
//! Owns the file's error messages (`FILE: key 'K': ...`, `FILE:
//! workers[I].FIELD: ...`) and the merge rule: a setting given on the
//! command line (or by its environment variable), or one conflicting with
//! such a setting, wins over the file's, for list flags too. What a key
//! takes is read from clap's description of its flag, the one list of
//! settings: a switch takes a boolean, a repeatable flag an array or a
//! single value, any other flag a string or a number, which goes through
//! the flag's own value parser. What the values mean stays with the flags
//! (`cli`); a checked setting is handed to their parser as
//! `--flag=value`, so a value starting with `-` stays a value.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use anyhow::{Context, anyhow, bail};
use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::parser::ValueSource;
use clap::{Arg, ArgAction, ArgMatches, Command};
use toml::Value;

use balancer_core::spec::WorkerSpec;

/// Flags that only the command line gives: the file itself, and what to
/// do with the configuration.
const COMMAND_LINE_ONLY: [&str; 2] = ["config", "check_config"];

/// The table of workers, which no flag has.
const WORKERS: &str = "workers";

/// A config file, every key checked.
#[derive(Debug)]
pub struct ConfigFile {
    /// The file's path as given, for errors.
    path: PathBuf,
    /// The keys the file sets, in its order.
    settings: Vec<Setting>,
    /// The `[[workers]]` tables, each validated.
    pub workers: Vec<WorkerSpec>,
}

/// One key of the file.
#[derive(Debug)]
struct Setting {
    /// As the file spells it.
    key: String,
    /// Its flag's clap id.
    id: String,
    /// Its arguments for the parser (none: a switch set to false).
    args: Vec<OsString>,
}

impl ConfigFile {
    /// Reads and checks the file at `path` against `command`'s flags.
    pub fn read(path: &Path, command: &Command) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read config file {}", path.display()))?;
        Self::parse(&text, path, command)
    }

    /// [`ConfigFile::read`] on the file's text; `path` names it in errors.
    pub fn parse(text: &str, path: &Path, command: &Command) -> anyhow::Result<Self> {
        let name = path.display();
        let table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
            // One line: where, and what (toml's own rendering quotes the
            // source over several).
            let at = e.span().map_or_else(String::new, |span| {
                let before = &text[..span.start.min(text.len())];
                let line = before.matches('\n').count() + 1;
                let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
                format!(":{line}:{column}")
            });
            anyhow!("{name}{at}: {}", e.message().trim().replace('\n', "; "))
        })?;
        let mut settings: Vec<Setting> = Vec::new();
        let mut workers = Vec::new();
        for (key, value) in &table {
            if key == WORKERS {
                workers = worker_specs(value, path)?;
                continue;
            }
            let arg = settable(command)
                .find(|a| names(a).any(|n| n == key.replace('_', "-")))
                .ok_or_else(|| unknown_key(command, key, path))?;
            let id = arg.get_id().as_str();
            if let Some(other) = settings.iter().find(|s| s.id == id) {
                bail!("{name}: key '{key}': '{}' sets it too", other.key);
            }
            // Two keys whose flags exclude each other: said here, as the
            // file's, rather than by clap as two flags nobody typed.
            let args = arguments(command, arg, value)
                .map_err(|why| anyhow!("{name}: key '{key}': {why}"))?;
            if !args.is_empty()
                && let Some(other) = settings.iter().find(|s| {
                    !s.args.is_empty()
                        && arg_of(command, &s.id).is_some_and(|o| conflict(command, arg, o))
                })
            {
                bail!(
                    "{name}: keys '{}' and '{key}' cannot be used together",
                    other.key
                );
            }
            settings.push(Setting {
                key: key.clone(),
                id: id.to_owned(),
                args,
            });
        }
        Ok(Self {
            path: path.to_owned(),
            settings,
            workers,
        })
    }

    /// `error`, a check of the whole configuration that names flags
    /// (`'--fleet-quorum': must be at least 1`), told as the file's when
    /// the first flag it names that the file sets took the file's value
    /// (`given`, the command line parsed alone, did not set it).
    pub fn blame(
        &self,
        command: &Command,
        error: anyhow::Error,
        given: Option<&ArgMatches>,
    ) -> anyhow::Error {
        let text = format!("{error:#}");
        let mentioned = text.match_indices("--").filter_map(|(at, _)| {
            let name = &text[at + 2..];
            let end = name
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
                .unwrap_or(name.len());
            let long = &name[..end];
            command
                .get_arguments()
                .find(|a| names(a).any(|n| n == long))
        });
        for arg in mentioned {
            let id = arg.get_id().as_str();
            if given_elsewhere(given, id) {
                break;
            }
            if let Some(setting) = self.settings.iter().find(|s| s.id == id) {
                return anyhow!("{}: key '{}': {text}", self.path.display(), setting.key);
            }
        }
        error
    }

    /// The file's arguments for the flags `given` (the command line parsed
    /// alone) leaves to it: neither given there nor in conflict with one
    /// that is.
    pub fn args_under(&self, command: &Command, given: Option<&ArgMatches>) -> Vec<OsString> {
        self.settings
            .iter()
            .filter(|s| {
                let Some(this) = arg_of(command, &s.id) else {
                    return false;
                };
                !given_elsewhere(given, &s.id)
                    && !command.get_arguments().any(|other| {
                        given_elsewhere(given, other.get_id().as_str())
                            && conflict(command, this, other)
                    })
            })
            .flat_map(|s| s.args.iter().cloned())
            .collect()
    }
}

/// Whether the command line (or an environment variable), parsed alone as
/// `given`, set the flag `id`: then the file's key gives way.
fn given_elsewhere(given: Option<&ArgMatches>, id: &str) -> bool {
    given.is_some_and(|m| {
        matches!(
            m.value_source(id),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        )
    })
}

/// The flag of clap id `id`.
fn arg_of<'c>(command: &'c Command, id: &str) -> Option<&'c Arg> {
    command.get_arguments().find(|a| a.get_id() == id)
}

/// Whether flags `a` and `b` exclude each other (either way round).
fn conflict(command: &Command, a: &Arg, b: &Arg) -> bool {
    command.get_arg_conflicts_with(a).contains(&b) || command.get_arg_conflicts_with(b).contains(&a)
}

/// The flags a file may set: those taking values or switched on, but not
/// the command line's own.
fn settable(command: &Command) -> impl Iterator<Item = &Arg> {
    command.get_arguments().filter(|a| {
        a.get_long().is_some()
            && !COMMAND_LINE_ONLY.contains(&a.get_id().as_str())
            && matches!(
                a.get_action(),
                ArgAction::Set | ArgAction::Append | ArgAction::SetTrue
            )
    })
}

/// A flag's long name and its aliases.
fn names(arg: &Arg) -> impl Iterator<Item = &str> {
    arg.get_long()
        .into_iter()
        .chain(arg.get_all_aliases().into_iter().flatten())
}

/// `FILE: unknown key 'K'`, with the closest key when one is close.
fn unknown_key(command: &Command, key: &str, path: &Path) -> anyhow::Error {
    let spelled = |long: &str| {
        if key.contains('-') {
            long.to_owned()
        } else {
            long.replace('-', "_")
        }
    };
    let closest = settable(command)
        .filter_map(Arg::get_long)
        .map(|long| (strsim::jaro(key, &spelled(long)), long))
        .filter(|(score, _)| *score > 0.8)
        .max_by(|a, b| a.0.total_cmp(&b.0));
    let hint = closest.map_or_else(String::new, |(_, long)| {
        format!(" (did you mean '{}'?)", spelled(long))
    });
    anyhow!("{}: unknown key '{key}'{hint}", path.display())
}

/// What a value is, for an error: its type, and the value when short.
fn found(value: &Value) -> String {
    match value {
        Value::String(s) => format!("string {s:?}"),
        Value::Integer(i) => format!("integer {i}"),
        Value::Float(f) => format!("float {f}"),
        Value::Boolean(b) => format!("boolean {b}"),
        Value::Datetime(d) => format!("datetime {d}"),
        Value::Array(_) => "an array".to_owned(),
        Value::Table(_) => "a table".to_owned(),
    }
}

/// A value a flag's parser takes as text: a string or a number.
fn scalar(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Integer(i) => Some(i.to_string()),
        Value::Float(f) => Some(f.to_string()),
        _ => None,
    }
}

/// The parser arguments of one key, its value checked by the kind of its
/// flag and by the flag's own value parser.
fn arguments(command: &Command, arg: &Arg, value: &Value) -> Result<Vec<OsString>, String> {
    let long = arg.get_long().unwrap_or_default();
    if matches!(arg.get_action(), ArgAction::SetTrue) {
        return match value {
            Value::Boolean(true) => Ok(vec![format!("--{long}").into()]),
            Value::Boolean(false) => Ok(Vec::new()),
            other => Err(format!("expected a boolean, found {}", found(other))),
        };
    }
    let repeatable = matches!(arg.get_action(), ArgAction::Append)
        || arg.get_num_args().is_some_and(|n| n.max_values() > 1);
    let items = match value {
        Value::Array(items) if repeatable => items
            .iter()
            .map(|item| {
                scalar(item).ok_or_else(|| {
                    format!(
                        "expected an array of strings or numbers, found {} in it",
                        found(item)
                    )
                })
            })
            .collect::<Result<Vec<_>, _>>()?,
        other => match scalar(other) {
            Some(text) => vec![text],
            None if repeatable => {
                return Err(format!(
                    "expected an array, a string or a number, found {}",
                    found(other)
                ));
            }
            None => {
                return Err(format!(
                    "expected a string or a number, found {}",
                    found(other)
                ));
            }
        },
    };
    items
        .into_iter()
        .map(|item| {
            let flag = OsString::from(format!("--{long}={item}"));
            check_value(command, &flag).map_err(|why| format!("invalid value '{item}': {why}"))?;
            Ok(flag)
        })
        .collect()
}

/// Runs `flag` (`--name=value`) through the flag's own parser, alone: a
/// refused value says why; whatever else that parse misses (a flag it
/// requires) is the merged command line's to report.
fn check_value(command: &Command, flag: &OsString) -> Result<(), String> {
    let argv = [OsString::from("balancer launch"), flag.clone()];
    let Err(error) = command.clone().try_get_matches_from(argv) else {
        return Ok(());
    };
    if !matches!(
        error.kind(),
        ErrorKind::InvalidValue | ErrorKind::ValueValidation | ErrorKind::InvalidUtf8
    ) {
        return Ok(());
    }
    if let Some(source) = std::error::Error::source(&error) {
        return Err(source.to_string());
    }
    if let Some(ContextValue::Strings(valid)) = error.get(ContextKind::ValidValue) {
        return Err(format!("possible values: {}", valid.join(", ")));
    }
    Err(error.kind().to_string())
}

/// The `[[workers]]` tables, each read and validated; errors name the
/// worker by its index and the field.
fn worker_specs(value: &Value, path: &Path) -> anyhow::Result<Vec<WorkerSpec>> {
    let name = path.display();
    let Value::Array(tables) = value else {
        bail!(
            "{name}: key '{WORKERS}': expected [[workers]] tables, found {}",
            found(value)
        );
    };
    tables
        .iter()
        .enumerate()
        .map(|(i, table)| {
            let spec: WorkerSpec =
                serde_path_to_error::deserialize(table.clone()).map_err(|e| {
                    let field = e.path().to_string();
                    let at = if field == "." {
                        String::new()
                    } else {
                        format!(".{field}")
                    };
                    anyhow!("{name}: {WORKERS}[{i}]{at}: {}", e.inner().message())
                })?;
            spec.validate()
                .map_err(|e| anyhow!("{name}: {WORKERS}[{i}].{}: {}", e.field, e.message))?;
            Ok(spec)
        })
        .collect()
}
