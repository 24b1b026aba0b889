//! The `qsr` command line: its commands and what each prints, for the binary (`main.rs`).

use std::io::Write;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// qsr: local gradient methods with the Quadratic Synchronization Rule.
#[derive(Debug, Parser)]
#[command(name = "qsr", version, about)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the round plan of a recipe: rounds, communication share, H over training.
    #[command(allow_negative_numbers = true)]
    Plan(crate::PlanArgs),
    /// Train a recipe with K workers (threads, local processes, or an external launch).
    Train(crate::TrainArgs),
    /// Train one recipe under several sync rules and seeds; print and save a comparison table.
    Compare(crate::CompareArgs),
    /// Draw lr/H, test accuracy and train loss (against step and bytes) for one or more runs.
    Plot(crate::PlotArgs),
    /// Predict wall-clock per sync rule from the round plan and a ring all-reduce cost model.
    Simulate(crate::SimulateArgs),
    /// Check the GPU kernels: bit-exact against the host path, bandwidth against a device copy.
    DeviceCheck(crate::DeviceCheckArgs),
    /// Time one training step of a model on one worker (forward, backward, optimizer), phase by phase.
    TimeStep(crate::TimeStepArgs),
    /// Serve the store of an elastic job (`qsr train --elastic --rendezvous HOST:PORT`) until it finishes.
    Rendezvous(crate::RendezvousArgs),
    /// Start N ranks of your own program with torchrun's environment: `qsr launch --nproc 4 -- ./prog args`.
    Launch(crate::LaunchArgs),
    /// What `qsr launch` runs as each rank: die with the launcher, then become the program.
    #[command(hide = true)]
    ExecRank(crate::ExecRankArgs),
}

/// Runs the command `cli` names: its output on stdout, an error on stderr with its exit status
/// (docs/architecture/train.md, "Exit statuses and divergence").
pub fn run(cli: Cli) -> ExitCode {
    let result = match cli.command {
        Command::Plan(args) => crate::run_plan(&args, &mut std::io::stdout().lock()),
        Command::Train(args) => crate::run_train(&args).map(|summary| {
            if let Some(s) = summary {
                let eval = match s.unigram_entropy {
                    Some(h) => format!(
                        "validation loss {:.4} nats (perplexity {:.2}; unigram entropy {h:.4} nats), next-token accuracy {:.2}%",
                        s.final_test_loss,
                        s.final_test_loss.exp(),
                        100.0 * s.final_test_accuracy
                    ),
                    None => format!("test accuracy {:.2}%", 100.0 * s.final_test_accuracy),
                };
                let local = s.local.as_ref().map_or(String::new(), |l| format!(" + {} inside nodes", l.syncs));
                println!(
                    "{}: {eval}, {} syncs ({:.1}% of data parallel){local}, {:.1} s, {:.1} steps/s",
                    s.name, s.syncs, s.comm_percent, s.wall_seconds, s.steps_per_second
                );
            }
        }),
        Command::Compare(args) => crate::run_compare(&args).map(|_| ()),
        Command::Plot(args) => crate::plot(&args).map(|files| {
            for f in files {
                println!("{}", f.display());
            }
        }),
        Command::Simulate(args) => crate::run_simulate(&args, &mut std::io::stdout().lock()),
        Command::TimeStep(args) => crate::time_step(&args, &mut std::io::stdout().lock()).map(|_| ()),
        Command::Rendezvous(args) => crate::rendezvous(&args, &mut std::io::stdout().lock()),
        Command::Launch(args) => crate::launch(&args),
        Command::ExecRank(args) => crate::exec_rank(&args),
        Command::DeviceCheck(args) => crate::device_check(&args, &mut std::io::stdout().lock())
            .and_then(|ok| if ok { Ok(()) } else { Err(anyhow::anyhow!("device check failed (see the table above)")) }),
    };
    match result {
        Ok(()) => ExitCode::from(crate::Exit::Success as u8),
        Err(e) => {
            // One write per message: the workers of a launch share one terminal, and `eprintln!` writes
            // a line in pieces that interleave with theirs.
            let _ = std::io::stderr().write_all(format!("error: {e:#}\n").as_bytes());
            // For the launcher that started this process, if one did: the peer this error blames.
            qsr_comm::record_failure(e.as_ref());
            ExitCode::from(crate::exit_code(&e))
        }
    }
}
