//! The paper's ViT-B communication plan (Local AdamW, Gu et al., ICLR 2024): cosine lr over 93,600 steps
//! with 10,000 warmup steps and lr_max 0.008, synchronized by QSR (h_base 4, alpha 0.0175), next to the
//! constant-H baseline (H = 4) on the same schedule. Prints each plan's rounds and communication as a
//! percentage of data parallel (QSR: 9,711 rounds, 10.4%), then H at a few steps of the run.
//!
//! ```sh
//! cargo run --release -p qsr-sched --example plan_qsr
//! ```

use qsr_sched::{LrSchedule, Plan, ScheduleKind, SyncRule};

fn main() -> Result<(), qsr_sched::ConfigError> {
    let schedule = LrSchedule::new(ScheduleKind::Cosine, 93_600, 10_000, 0.008, 1e-6);
    let qsr = Plan::new(schedule.clone(), SyncRule::Qsr { h_base: 4, alpha: 0.0175 })?;
    let constant = Plan::new(schedule, SyncRule::Constant { h: 4 })?;

    println!("ViT-B, cosine lr 0.008, T = 93,600 steps, 10,000 warmup");
    println!("{:<34} {:>8} {:>9} {:>6}", "rule", "rounds", "% of dp", "max H");
    for plan in [&qsr, &constant] {
        let s = plan.summary();
        println!("{:<34} {:>8} {:>8.1}% {:>6}", plan.sync().describe(), s.rounds, s.comm_percent, s.max_h);
    }

    // H of the round that contains step t (decided from the lr of that round's first step; the last round is
    // clamped to end at step 93,600). Rounds are lazy, O(1) each, so a scan from step 0 is cheap.
    let round_at = |plan: &Plan, t: u64| plan.rounds().find(|r| t < r.end()).expect("t < end_step");
    println!("\n{:>7} {:>10} {:>7} {:>17} {:>11}", "step", "lr", "QSR H", "QSR round start", "constant H");
    for t in [0, 9_999, 10_000, 40_000, 60_000, 80_000, 90_000, 93_000] {
        let (q, c) = (round_at(&qsr, t), round_at(&constant, t));
        println!("{t:>7} {:>10.6} {:>7} {:>17} {:>11}", qsr.lr(t), q.len, q.start, c.len);
    }
    Ok(())
}
