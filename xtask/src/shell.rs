//! Running external commands with their command line shown.

use std::path::PathBuf;
use std::process::{Command, Output};

use anyhow::{Context, Result, bail};

/// Runs `command` with inherited stdio and fails unless it exits with 0.
pub fn run(command: &mut Command) -> Result<()> {
    let shown = display(command);
    eprintln!("$ {shown}");
    let status = command
        .status()
        .with_context(|| format!("starting `{shown}`"))?;
    if !status.success() {
        bail!("`{shown}` failed ({status})");
    }
    Ok(())
}

/// Runs `command` quietly and returns its output; only failing to start it
/// is an error, so callers can read the exit status as an answer.
pub fn capture(command: &mut Command) -> Result<Output> {
    command
        .output()
        .with_context(|| format!("starting `{}`", display(command)))
}

/// Runs `command` quietly and returns its trimmed stdout if it exits with 0.
pub fn stdout_of(command: &mut Command) -> Result<String> {
    let output = capture(command)?;
    if !output.status.success() {
        bail!(
            "`{}` failed ({}): {}",
            display(command),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

/// The command line, for messages.
pub fn display(command: &Command) -> String {
    let mut line = command.get_program().to_string_lossy().into_owned();
    for arg in command.get_args() {
        line.push(' ');
        line.push_str(&arg.to_string_lossy());
    }
    line
}

/// `$CARGO_HOME/bin`, where rustup's proxies and `cargo install` put
/// binaries.
pub fn cargo_bin_dir() -> Option<PathBuf> {
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cargo")))?;
    Some(home.join("bin"))
}

/// A command for `program` with `$CARGO_HOME/bin` first on its PATH, so
/// bpf-linker and the rustup proxies are found even from a shell that never
/// sourced cargo's env file.
pub fn with_cargo_bin(program: &str) -> Command {
    let Some(bin) = cargo_bin_dir() else {
        return Command::new(program);
    };
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut dirs = vec![bin.clone()];
    dirs.extend(std::env::split_paths(&path).filter(|dir| *dir != bin));
    let mut command = if bin.join(program).is_file() {
        Command::new(bin.join(program))
    } else {
        Command::new(program)
    };
    command.env(
        "PATH",
        std::env::join_paths(dirs).expect("PATH entries came from PATH"),
    );
    command
}
