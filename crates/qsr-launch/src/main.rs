//! `qsr-launch`: `qsr launch` without the trainer (and without burn), see the crate's docs.

use std::process::ExitCode;

use clap::Parser;
use qsr_launch::{ExecRankArgs, LaunchArgs};

/// Start N ranks of your own program with torchrun's environment: `qsr-launch --nproc 4 -- ./prog args`.
#[derive(Debug, Parser)]
#[command(name = "qsr-launch", version)]
struct Cli {
    #[command(flatten)]
    launch: LaunchArgs,
}

/// What each rank runs: `qsr-launch exec-rank -- PROGRAM` (hidden, as the trainer's `qsr exec-rank`).
#[derive(Debug, Parser)]
#[command(name = "qsr-launch exec-rank")]
struct ExecRank {
    #[command(flatten)]
    args: ExecRankArgs,
}

fn main() -> ExitCode {
    let mut argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let result = if argv.get(1).is_some_and(|a| a == "exec-rank") {
        argv.remove(1);
        qsr_launch::exec_rank(&ExecRank::parse_from(argv).args)
    } else {
        qsr_launch::launch(&Cli::parse_from(argv).launch)
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(qsr_launch::exit_status(&e))
        }
    }
}
