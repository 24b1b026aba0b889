//! The `qsr` command line: plan, train, compare, plot, simulate, device-check, time-step, rendezvous,
//! launch.

use std::io::Write;
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
    Plan(qsr_train::PlanArgs),
    /// Train a recipe with K workers (threads, local processes, or an external launch).
    Train(qsr_train::TrainArgs),
    /// Train one recipe under several sync rules and seeds; print and save a comparison table.
    Compare(qsr_train::CompareArgs),
    /// Draw lr/H, test accuracy and train loss (against step and bytes) for one or more runs.
    Plot(qsr_train::PlotArgs),
    /// Predict wall-clock per sync rule from the round plan and a ring all-reduce cost model.
    Simulate(qsr_train::SimulateArgs),
    /// Check the GPU kernels: bit-exact against the host path, bandwidth against a device copy.
    DeviceCheck(qsr_train::DeviceCheckArgs),
    /// Time one training step of a model on one worker (forward, backward, optimizer), phase by phase.
    TimeStep(qsr_train::TimeStepArgs),
    /// Serve the store of an elastic job (`qsr train --elastic --rendezvous HOST:PORT`) until it finishes.
    Rendezvous(qsr_train::RendezvousArgs),
    /// Start N ranks of your own program with torchrun's environment: `qsr launch --nproc 4 -- ./prog args`.
    Launch(qsr_train::LaunchArgs),
    /// What `qsr launch` runs as each rank: die with the launcher, then become the program.
    #[command(hide = true)]
    ExecRank(qsr_train::ExecRankArgs),
}

/// glibc gives large freed blocks back to the kernel at once, and a training step frees and allocates
/// the same activation sizes every step: the kernel then clears fresh pages for each one (a sixth of
/// the medium GPT step on the CPU). Raising the thresholds to glibc's maximum keeps them for reuse;
/// the process keeps its peak heap, as a caching allocator does. The threads of the workers' compute
/// pools allocate from glibc's per-thread arenas, which unmap a whole 64 MiB heap once it empties
/// (whatever the trim threshold); a top pad of one heap keeps those too (medium GPT: 1.25x).
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets malloc's tunables, and no other thread exists yet to allocate meanwhile.
    unsafe {
        // 32 MiB is the largest mmap threshold glibc accepts on 64-bit targets.
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
        libc::mallopt(libc::M_TOP_PAD, 64 << 20);
    }
}

fn main() -> ExitCode {
    keep_freed_memory();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Plan(args) => qsr_train::run_plan(&args, &mut std::io::stdout().lock()),
        Command::Train(args) => qsr_train::run_train(&args).map(|summary| {
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
        Command::Compare(args) => qsr_train::run_compare(&args).map(|_| ()),
        Command::Plot(args) => qsr_train::plot(&args).map(|files| {
            for f in files {
                println!("{}", f.display());
            }
        }),
        Command::Simulate(args) => qsr_train::run_simulate(&args, &mut std::io::stdout().lock()),
        Command::TimeStep(args) => qsr_train::time_step(&args, &mut std::io::stdout().lock()).map(|_| ()),
        Command::Rendezvous(args) => qsr_train::rendezvous(&args, &mut std::io::stdout().lock()),
        Command::Launch(args) => qsr_train::launch(&args),
        Command::ExecRank(args) => qsr_train::exec_rank(&args),
        Command::DeviceCheck(args) => qsr_train::device_check(&args, &mut std::io::stdout().lock())
            .and_then(|ok| if ok { Ok(()) } else { Err(anyhow::anyhow!("device check failed (see the table above)")) }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One write per message: the workers of a launch share one terminal, and `eprintln!` writes
            // a line in pieces that interleave with theirs.
            let _ = std::io::stderr().write_all(format!("error: {e:#}\n").as_bytes());
            ExitCode::from(qsr_train::exit_code(&e))
        }
    }
}
