//! Properties of the planner and the cursor over random valid configurations.

use proptest::prelude::*;
use qsr_sched::{Cursor, LrSchedule, Plan, ScheduleKind, SyncRule};

fn schedule() -> impl Strategy<Value = LrSchedule> {
    (1u64..3_000, 0.0f64..0.9, 1e-4f64..2.0, 0.0f64..1.0, 0usize..4, 0.05f64..1.0, 0usize..4).prop_flat_map(
        |(total, warm_frac, lr_max, min_frac, kind, gamma, n_points)| {
            let warmup = ((total as f64) * warm_frac) as u64;
            let kind = ScheduleKind::ALL[kind];
            let span = total - warmup;
            let points = if kind == ScheduleKind::Step && span > 1 {
                proptest::collection::btree_set(warmup + 1..total, 0..=n_points)
                    .prop_map(|s| s.into_iter().collect::<Vec<_>>())
                    .boxed()
            } else {
                Just(Vec::new()).boxed()
            };
            points.prop_map(move |decay_points| LrSchedule {
                kind,
                total_steps: total,
                warmup_steps: warmup,
                lr_max,
                lr_min: lr_max * min_frac,
                decay_points,
                decay_gamma: gamma,
            })
        },
    )
}

fn rule(total: u64) -> impl Strategy<Value = SyncRule> {
    prop_oneof![
        Just(SyncRule::Dp),
        (1u64..50).prop_map(|h| SyncRule::Constant { h }),
        (0..=total, 1u64..50).prop_map(|(switch_step, h)| SyncRule::PostLocal { switch_step, h }),
        (1u64..16, 1e-3f64..1.0, 0.25f64..4.0).prop_map(|(h_base, alpha, power)| SyncRule::Power {
            h_base,
            alpha,
            power
        }),
        (1u64..16, 1e-3f64..1.0).prop_map(|(h_base, alpha)| SyncRule::Qsr { h_base, alpha }),
        (1u64..8, 1u64..6, 0u64..64).prop_map(|(h_base, scaler, extra)| SyncRule::Exponential {
            h_base,
            scaler,
            h_max: h_base + extra
        }),
    ]
}

fn plan() -> impl Strategy<Value = Plan> {
    schedule()
        .prop_flat_map(|s| {
            let total = s.total_steps;
            let local =
                prop::option::weighted(0.3, rule(total).prop_filter("parameter rule", |r| !r.syncs_gradients(0)));
            (Just(s), rule(total), prop::option::of(1u64..2 * total + 2), local)
        })
        .prop_map(|(s, r, run, local)| {
            let plan = Plan::from_parts(s, r, run).expect("strategy yields valid plans");
            match local {
                Some(l) => plan.with_local(l).expect("strategy yields valid local rules"),
                None => plan,
            }
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn rounds_tile_the_run_without_gap_or_overlap(p in plan()) {
        let mut next = 0;
        for (i, r) in p.rounds().enumerate() {
            prop_assert_eq!(r.index, i as u64);
            prop_assert_eq!(r.start, next);
            prop_assert!(r.len >= 1);
            next = r.end();
        }
        prop_assert_eq!(next, p.end_step());
    }

    #[test]
    fn h_is_at_least_h_base_except_a_clamped_final_round(p in plan()) {
        let h_base = match *p.sync() {
            SyncRule::Power { h_base, .. } | SyncRule::Qsr { h_base, .. } | SyncRule::Exponential { h_base, .. } => h_base,
            SyncRule::Constant { h } => h,
            SyncRule::PostLocal { .. } | SyncRule::Dp => 1,
        };
        let end = p.end_step();
        for r in p.rounds() {
            prop_assert!(r.len >= h_base || r.end() == end, "round {:?} below h_base {}", r, h_base);
        }
    }

    #[test]
    fn power_rule_h_never_shrinks_after_warmup(p in plan()) {
        prop_assume!(p.sync().power().is_some());
        let end = p.end_step();
        let w = p.schedule().warmup_steps;
        let mut previous = 0;
        for r in p.rounds().filter(|r| r.start >= w && r.end() < end) {
            prop_assert!(r.len >= previous, "H fell from {} to {} at step {}", previous, r.len, r.start);
            previous = r.len;
        }
    }

    #[test]
    fn cursor_agrees_with_the_planner_at_every_step(p in plan()) {
        let mut cursor = p.cursor();
        for r in p.rounds() {
            for t in r.start..r.end() {
                let s = cursor.advance().expect("cursor ended early");
                prop_assert_eq!(s.step, t);
                prop_assert_eq!(s.round, r.index);
                prop_assert_eq!(s.h, r.len);
                prop_assert_eq!(s.lr, p.lr(t));
                prop_assert_eq!(s.sync_after, t + 1 == r.end());
                prop_assert_eq!(s.mode, r.mode);
            }
        }
        prop_assert!(cursor.advance().is_none());
        prop_assert!(cursor.is_done());
    }

    #[test]
    fn local_averages_fall_strictly_inside_global_rounds(p in plan()) {
        let steps: Vec<_> = p.cursor().collect();
        let local = steps.iter().filter(|s| s.local_sync_after).count() as u64;
        prop_assert!(steps.iter().all(|s| !(s.sync_after && s.local_sync_after)));
        match p.summary().local {
            Some(l) => prop_assert_eq!(l.rounds, local),
            None => prop_assert_eq!(local, 0),
        }
        if let Some(SyncRule::Constant { h }) = p.local() {
            // Constant local rounds restart at every global round: the local averages sit h apart from it.
            for s in steps.iter().filter(|s| s.local_sync_after) {
                prop_assert_eq!((s.step + 1 - s.round_start) % h, 0);
            }
        }
    }

    #[test]
    fn serialized_cursor_resumes_identically(p in plan(), frac in 0.0f64..=1.0) {
        let stop = ((p.end_step() as f64) * frac) as u64;
        let mut straight = p.cursor();
        let mut first = p.cursor();
        for _ in 0..stop {
            first.advance();
        }
        let json = serde_json::to_string(&first).unwrap();
        let mut resumed: Cursor = serde_json::from_str(&json).unwrap();
        prop_assert_eq!(&resumed, &first);
        prop_assert_eq!(&p.cursor_at(stop), &first);
        for _ in 0..stop {
            straight.advance();
        }
        let rest_a: Vec<_> = straight.collect();
        let rest_b: Vec<_> = resumed.by_ref().collect();
        prop_assert_eq!(rest_a, rest_b);
    }
}

#[test]
fn a_tampered_cursor_is_refused() {
    let plan = Plan::new(
        LrSchedule::new(ScheduleKind::Cosine, 1_000, 100, 0.1, 1e-6),
        SyncRule::Qsr { h_base: 2, alpha: 0.02 },
    )
    .unwrap();
    let mut c = plan.cursor();
    for _ in 0..500 {
        c.advance();
    }
    let json = serde_json::to_value(&c).unwrap();
    let mut bad = json.clone();
    bad["round"]["len"] = serde_json::json!(3);
    assert!(serde_json::from_value::<Cursor>(bad).unwrap_err().to_string().contains("cursor.round"));
    let mut bad = json.clone();
    bad["step"] = serde_json::json!(5_000);
    assert!(serde_json::from_value::<Cursor>(bad).is_err());
    let mut bad = json;
    bad["plan"]["sync"]["h_base"] = serde_json::json!(0);
    assert!(serde_json::from_value::<Cursor>(bad).unwrap_err().to_string().contains("sync.h_base"));
}
