//! Tokens per second of one training step of a small GPT (forward, backward, clipping, AdamW) through
//! the round driver on one worker, the model and batch `cargo xtask bench train` also times in PyTorch
//! eager (`benches/peers/gpt_step.py`).
//!
//! `cargo run --release -p qsr-train --example gpt_step -- --steps 30 --json out.json`

use std::time::Instant;

use anyhow::{Result, anyhow};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::{Device, Int, Tensor, TensorData};
use clap::Parser;
use qsr_comm::InProcessGroup;
use qsr_data::{Corpus, TextWindows};
use qsr_models::GptConfig;
use qsr_optim::{DriverConfig, OptimizerConfig, Worker};
use qsr_sched::{LrSchedule, Plan, ScheduleKind, SyncRule};

#[derive(Parser)]
struct Args {
    /// Timed steps (after the warm-up ones).
    #[arg(long, default_value_t = 30)]
    steps: u64,
    /// Untimed steps first.
    #[arg(long, default_value_t = 5)]
    warmup: u64,
    /// Windows per step.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Tokens per window.
    #[arg(long, default_value_t = 64)]
    context: usize,
    #[arg(long, default_value_t = 2)]
    layers: usize,
    #[arg(long, default_value_t = 4)]
    heads: usize,
    #[arg(long, default_value_t = 64)]
    width: usize,
    /// Write {"tokens_per_second": ..., "step_ms_median": ...} here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

fn main() -> Result<()> {
    let a = Args::parse();
    let corpus = Corpus::comedy_of_errors();
    let gpt = GptConfig {
        vocab_size: corpus.vocab().len(),
        context: a.context,
        layers: a.layers,
        heads: a.heads,
        width: a.width,
        dropout: 0.0,
        bias: true,
    };
    let device = Device::flex().autodiff();
    device.seed(0);
    let model = gpt.init(&device)?;
    let total = a.warmup + a.steps;
    let plan =
        Plan::new(LrSchedule::new(ScheduleKind::Constant, total, 0, 1e-3, 1e-3), SyncRule::Constant { h: total })?;
    let optim = OptimizerConfig { clip_grad_norm: Some(1.0), ..OptimizerConfig::adamw(0.1) };
    let comm = Box::new(InProcessGroup::new(1).remove(0));
    let mut worker = Worker::new(model, optim, comm, plan.cursor(), DriverConfig::default())?;
    let windows = TextWindows::new(&corpus, (a.context, a.batch), 0, 0, 1)?;
    let ce = CrossEntropyLossConfig::new().init(&device);
    let ids = |t: &[u32]| {
        let v: Vec<i64> = t.iter().map(|&x| i64::from(x)).collect();
        Tensor::<2, Int>::from_data(TensorData::new(v, [a.batch, a.context]), &device)
    };
    let mut times = Vec::new();
    for step in 0..total {
        let b = windows.batch(step);
        let t0 = Instant::now();
        worker.step(|m, _| {
            let logits = m.forward(ids(&b.inputs))?;
            let [n, t, v] = logits.dims();
            Ok(ce.forward(logits.reshape([n * t, v]), ids(&b.targets).reshape([n * t])))
        })?;
        if step >= a.warmup {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    let median = *times.get(times.len() / 2).ok_or_else(|| anyhow!("--steps must be at least 1"))?;
    let tps = (a.batch * a.context) as f64 / median;
    println!("qsr: {tps:.0} tokens/s ({:.2} ms per step, median of {})", 1e3 * median, times.len());
    if let Some(path) = a.json {
        std::fs::write(
            path,
            serde_json::json!({ "tokens_per_second": tps, "step_ms_median": 1e3 * median }).to_string(),
        )?;
    }
    Ok(())
}
