//! Planning cost: proportional to the number of rounds, not steps.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use qsr_sched::{LrSchedule, Plan, ScheduleKind, SyncRule};

fn ten_million_steps(sync: SyncRule) -> Plan {
    Plan::new(LrSchedule::new(ScheduleKind::Cosine, 10_000_000, 100_000, 0.8, 1e-6), sync).unwrap()
}

fn plan(c: &mut Criterion) {
    let mut g = c.benchmark_group("plan_10M_steps");
    g.sample_size(10);
    for (name, sync) in [
        ("qsr", SyncRule::Qsr { h_base: 2, alpha: 0.2 }),
        ("constant_h64", SyncRule::Constant { h: 64 }),
        ("dp", SyncRule::Dp),
    ] {
        let p = ten_million_steps(sync);
        let rounds = p.summary().rounds;
        // Throughput in rounds: criterion reports rounds/s, the inverse of the per-round cost.
        g.throughput(Throughput::Elements(rounds));
        g.bench_with_input(BenchmarkId::new("summary", format!("{name}_{rounds}_rounds")), &p, |b, p| {
            b.iter(|| black_box(p).summary())
        });
    }
    g.finish();

    let p = ten_million_steps(SyncRule::Qsr { h_base: 2, alpha: 0.2 });
    c.bench_function("cursor_advance_1M_steps", |b| {
        b.iter(|| {
            let mut cur = p.cursor();
            let mut syncs = 0u64;
            for _ in 0..1_000_000 {
                syncs += u64::from(cur.advance().is_some_and(|s| s.sync_after));
            }
            black_box(syncs)
        })
    });
}

criterion_group!(benches, plan);
criterion_main!(benches);
