use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// qsr: local gradient methods with the Quadratic Synchronization Rule.
#[derive(Debug, Parser)]
#[command(name = "qsr", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the round plan of a recipe: rounds, communication share, H over training.
    #[command(allow_negative_numbers = true)]
    Plan(qsr_train::plan_cmd::PlanArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Plan(args) => qsr_train::plan_cmd::run(&args, &mut std::io::stdout().lock()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
