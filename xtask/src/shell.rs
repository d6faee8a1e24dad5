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

/// A `cargo` command without the variables the outer `cargo run` (what
/// `cargo xtask` is) set for xtask itself. Build scripts such as ring's
/// watch `CARGO_MANIFEST_DIR`, so passing xtask's own value on made every
/// child `cargo build` rebuild them and everything above them. Every place
/// xtask spawns cargo starts from this command.
pub fn cargo() -> Command {
    let mut command = Command::new("cargo");
    for (key, _) in std::env::vars_os() {
        if let Some(key) = key.to_str()
            && set_by_cargo_run(key)
        {
            command.env_remove(key);
        }
    }
    command
}

/// The variables cargo sets for the program it runs (cargo's "environment
/// variables Cargo sets for crates"), none of which a user sets for a build.
/// The user's own settings (RUSTFLAGS, CARGO_TARGET_DIR, CARGO_HOME, ...)
/// are kept: the gateway build must match the one the user runs by hand.
fn set_by_cargo_run(key: &str) -> bool {
    const EXACT: [&str; 9] = [
        "CARGO",
        "CARGO_MANIFEST_DIR",
        "CARGO_MANIFEST_PATH",
        "CARGO_CRATE_NAME",
        "CARGO_BIN_NAME",
        "CARGO_PRIMARY_PACKAGE",
        "CARGO_RUSTC_CURRENT_DIR",
        "CARGO_TARGET_TMPDIR",
        "OUT_DIR",
    ];
    EXACT.contains(&key) || key.starts_with("CARGO_PKG_")
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

#[cfg(test)]
mod tests {
    use std::ffi::OsStr;

    use super::{cargo, set_by_cargo_run};

    #[test]
    fn child_cargo_does_not_inherit_what_cargo_run_set_for_xtask() {
        // `cargo test` sets these for the test binary exactly as `cargo
        // xtask` sets them for xtask.
        assert!(std::env::var_os("CARGO_MANIFEST_DIR").is_some());
        assert!(std::env::var_os("CARGO_PKG_NAME").is_some());
        let command = cargo();
        let removed: Vec<&OsStr> = command
            .get_envs()
            .filter(|(_, value)| value.is_none())
            .map(|(key, _)| key)
            .collect();
        for key in ["CARGO_MANIFEST_DIR", "CARGO_PKG_NAME", "CARGO_PKG_VERSION"] {
            assert!(removed.contains(&OsStr::new(key)), "{key} is passed on");
        }
        assert_eq!(command.get_program(), "cargo");
    }

    #[test]
    fn the_users_build_settings_are_kept() {
        for key in [
            "RUSTFLAGS",
            "CARGO_TARGET_DIR",
            "CARGO_HOME",
            "CARGO_BUILD_JOBS",
            "RUSTUP_TOOLCHAIN",
            "PATH",
        ] {
            assert!(!set_by_cargo_run(key), "{key} should be kept");
        }
    }
}
