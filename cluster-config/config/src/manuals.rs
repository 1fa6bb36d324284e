//! Man pages and shell completions of a command, made from its clap
//! definition (the one `--help` prints), so the three never disagree.
//! Each of the rack's commands writes its own with a hidden `manuals`
//! subcommand; the Debian packages ship what it wrote
//! (`scripts/build-debs.sh`).

use std::io;
use std::path::Path;

use clap::Command;
use clap_complete::Shell;

/// Write `DIR/man/NAME.1` and one page per visible subcommand
/// (`NAME-SUB.1`, as git's), and the completions `DIR/completions/NAME.bash`,
/// `_NAME` (zsh) and `NAME.fish`.
pub fn write(cmd: Command, dir: &Path) -> io::Result<()> {
    let mut cmd = cmd;
    cmd.build();
    let man = dir.join("man");
    std::fs::create_dir_all(&man)?;
    write_pages(&cmd, &man)?;
    let completions = dir.join("completions");
    std::fs::create_dir_all(&completions)?;
    let name = cmd.get_name().to_string();
    for (shell, file) in [
        (Shell::Bash, format!("{name}.bash")),
        (Shell::Zsh, format!("_{name}")),
        (Shell::Fish, format!("{name}.fish")),
    ] {
        let mut out = std::fs::File::create(completions.join(file))?;
        clap_complete::generate(shell, &mut cmd, name.clone(), &mut out);
    }
    Ok(())
}

/// The page of `cmd` and, below it, of each visible subcommand.
fn write_pages(cmd: &Command, dir: &Path) -> io::Result<()> {
    let mut page = Vec::new();
    clap_mangen::Man::new(cmd.clone()).render(&mut page)?;
    let name = cmd.get_display_name().unwrap_or(cmd.get_name());
    std::fs::write(dir.join(format!("{name}.1")), page)?;
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        if sub.get_name() != "help" {
            write_pages(sub, dir)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_and_completions_for_each_visible_subcommand() {
        let cmd = Command::new("tool")
            .about("A tool")
            .subcommand(Command::new("check").about("Check a file"))
            .subcommand(Command::new("secret").hide(true));
        let dir = tempfile::tempdir().expect("tempdir");
        write(cmd, dir.path()).expect("write");
        let page = std::fs::read_to_string(dir.path().join("man/tool.1")).expect("tool.1");
        assert!(page.contains(".TH tool 1"), "{page}");
        let sub = std::fs::read_to_string(dir.path().join("man/tool-check.1")).expect("sub");
        assert!(sub.contains("Check a file"), "{sub}");
        assert!(!dir.path().join("man/tool-secret.1").exists());
        assert!(!dir.path().join("man/tool-help.1").exists());
        for file in ["tool.bash", "_tool", "tool.fish"] {
            let text = std::fs::read_to_string(dir.path().join("completions").join(file))
                .expect("completion");
            assert!(text.contains("check"), "{file}");
        }
    }
}
