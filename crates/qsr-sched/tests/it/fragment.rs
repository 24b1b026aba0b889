//! Streaming schedules: fragments synchronized once per round each, staggered inside the round.

use qsr_sched::{FragmentPlan, LrSchedule, MAX_FRAGMENTS, Plan, ScheduleKind, SyncRule, split_elements, split_tensors};

fn plan(rule: SyncRule) -> Plan {
    Plan::new(LrSchedule::new(ScheduleKind::Cosine, 2_000, 200, 0.1, 1e-4), rule).unwrap()
}

fn fragment_steps(p: &FragmentPlan, fragment: u32) -> Vec<u64> {
    p.syncs().filter(|s| s.fragment == fragment).map(|s| s.step).collect()
}

#[test]
fn each_fragment_syncs_once_per_round_and_the_last_at_the_rounds_end() {
    let base = plan(SyncRule::Qsr { h_base: 2, alpha: 0.02 });
    let p = FragmentPlan::new(base.clone(), 4).unwrap();
    let ends: Vec<u64> = base.cursor().filter(|s| s.sync_after).map(|s| s.step).collect();
    let rounds: Vec<_> = base.rounds().collect();
    assert_eq!(fragment_steps(&p, 3), ends);
    for fragment in 0..4 {
        let steps = fragment_steps(&p, fragment);
        assert_eq!(steps.len(), rounds.len(), "fragment {fragment}: one sync per round");
        for (step, round) in steps.iter().zip(&rounds) {
            assert!((round.start..round.end()).contains(step), "fragment {fragment} leaves round {}", round.index);
        }
    }
    // Where a round has at least 4 steps, its 4 syncs fall on 4 different steps, in fragment order.
    for round in rounds.iter().filter(|r| r.len >= 4) {
        let steps: Vec<u64> = (0..4).map(|f| p.sync_step(round, f)).collect();
        assert!(steps.windows(2).all(|w| w[0] < w[1]), "round {}: {steps:?}", round.index);
    }
    assert_eq!(p.summary().syncs_per_fragment, rounds.len() as u64);
}

#[test]
fn syncs_are_staggered_by_h_over_p_inside_each_round() {
    let schedule = LrSchedule::new(ScheduleKind::Constant, 24, 0, 0.1, 0.0);
    let eights = FragmentPlan::new(Plan::new(schedule.clone(), SyncRule::Constant { h: 8 }).unwrap(), 4).unwrap();
    let steps: Vec<u64> = eights.syncs().map(|s| s.step).collect();
    assert_eq!(steps, [1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23]);
    assert_eq!(eights.summary().min_gap, Some(2));
    // H = 6, P = 4: offsets ceil(6 (p + 1) / 4) = 2, 3, 5, 6.
    let sixes = FragmentPlan::new(Plan::new(schedule, SyncRule::Constant { h: 6 }).unwrap(), 4).unwrap();
    let steps: Vec<u64> = sixes.syncs().take(8).map(|s| s.step).collect();
    assert_eq!(steps, [1, 2, 4, 5, 7, 8, 10, 11]);
    assert_eq!(sixes.summary().min_gap, Some(1));
}

#[test]
fn one_fragment_is_the_plan_itself() {
    let base = plan(SyncRule::Qsr { h_base: 4, alpha: 0.02 });
    let p = FragmentPlan::new(base.clone(), 1).unwrap();
    let ends: Vec<u64> = base.cursor().filter(|s| s.sync_after).map(|s| s.step).collect();
    assert_eq!(p.syncs().map(|s| s.step).collect::<Vec<_>>(), ends);
    assert_eq!(p.peak_elements(&[1_000]), 1_000);
    let s = p.summary();
    assert_eq!((s.max_per_step, s.shared_steps, s.syncs_per_fragment), (1, 0, base.summary().rounds));
}

#[test]
fn rounds_shorter_than_the_fragments_share_steps_and_raise_the_peak() {
    // h_base = 2 < 4 fragments: the warmup's 2-step rounds carry two fragments per step (ceil(4 / 2)).
    let p = FragmentPlan::new(plan(SyncRule::Qsr { h_base: 2, alpha: 0.02 }), 4).unwrap();
    let s = p.summary();
    assert_eq!(s.max_per_step, 2);
    assert!(s.shared_steps > 0);
    assert_eq!(p.peak_elements(&[100; 4]), 200);
    // h_base = 4: every round has at least 4 steps, so one fragment per step.
    let p = FragmentPlan::new(plan(SyncRule::Qsr { h_base: 4, alpha: 0.02 }), 4).unwrap();
    assert_eq!((p.summary().max_per_step, p.summary().shared_steps), (1, 0));
    assert_eq!(p.peak_elements(&[100, 300, 200, 100]), 300);
}

#[test]
fn fragments_tile_the_tensors_in_order_and_balance_them() {
    // A GPT block's tensors: ln, c_attn (w, b), c_proj (w, b), ln, c_fc (w, b), c_proj (w, b).
    let sizes = [512, 196_608, 768, 65_536, 256, 512, 262_144, 1_024, 262_144, 256];
    let total: u64 = sizes.iter().sum();
    for fragments in 1..=sizes.len() as u32 {
        let ranges = split_tensors(&sizes, fragments).unwrap();
        assert_eq!(ranges.len(), fragments as usize);
        assert_eq!(ranges[0].start, 0);
        assert_eq!(ranges.last().unwrap().end, sizes.len());
        assert!(ranges.windows(2).all(|w| w[0].end == w[1].start), "{fragments}: not contiguous");
        assert!(ranges.iter().all(|r| !r.is_empty()), "{fragments}: an empty fragment");
        if fragments <= 4 {
            // Cut at shares of the total: no fragment exceeds its share by more than the largest tensor.
            let largest = *sizes.iter().max().unwrap();
            for r in &ranges {
                let size: u64 = sizes[r.clone()].iter().sum();
                assert!(size <= total / u64::from(fragments) + largest, "{fragments}: {r:?} holds {size}");
            }
        }
    }
    let err = split_tensors(&sizes, 11).unwrap_err();
    assert_eq!(err.field, "sync.streaming.fragments");
    assert!(err.reason.contains("1..=10"), "{err}");
    assert_eq!(split_tensors(&sizes, 0).unwrap_err().field, "sync.streaming.fragments");
}

#[test]
fn elements_split_into_ranges_within_one_of_each_other() {
    let ranges = split_elements(1_000_003, 4);
    assert_eq!((ranges[0].start, ranges[3].end), (0, 1_000_003));
    assert!(ranges.windows(2).all(|w| w[0].end == w[1].start));
    let lens: Vec<u64> = ranges.iter().map(|r| r.end - r.start).collect();
    assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1, "{lens:?}");
}

#[test]
fn a_parameter_count_near_u64_max_splits_without_overflow() {
    let ranges = split_elements(u64::MAX, MAX_FRAGMENTS);
    assert_eq!((ranges[0].start, ranges.last().unwrap().end), (0, u64::MAX));
    assert!(ranges.windows(2).all(|w| w[0].end == w[1].start && w[0].start < w[0].end));
}

#[test]
fn bad_fragment_counts_and_gradient_rules_are_refused_naming_the_key() {
    let base = plan(SyncRule::Constant { h: 4 });
    for bad in [0, MAX_FRAGMENTS + 1] {
        let err = FragmentPlan::new(base.clone(), bad).unwrap_err();
        assert_eq!(err.field, "sync.streaming.fragments");
        assert!(err.reason.contains(&format!("got {bad}")), "{err}");
    }
    let err = FragmentPlan::new(plan(SyncRule::Dp), 2).unwrap_err();
    assert_eq!(err.field, "sync.streaming.fragments");
    assert!(err.reason.contains("`dp` all-reduces gradients"), "{err}");
    assert!(FragmentPlan::new(plan(SyncRule::Dp), 1).is_ok());
}

/// A trainer asks `syncs_after` at every step the cursor hands out; its answers are the schedule.
#[test]
fn syncs_after_each_step_reproduce_the_schedule() {
    for (rule, fragments) in [
        (SyncRule::Qsr { h_base: 2, alpha: 0.02 }, 4),
        (SyncRule::Qsr { h_base: 2, alpha: 0.02 }, 3),
        (SyncRule::Constant { h: 5 }, 7),
        (SyncRule::Constant { h: 1 }, 2),
    ] {
        let p = FragmentPlan::new(plan(rule), fragments).unwrap();
        let asked: Vec<(u64, u32)> =
            p.plan().cursor().flat_map(|info| p.syncs_after(&info).map(move |f| (info.step, f))).collect();
        let scheduled: Vec<(u64, u32)> = p.syncs().map(|s| (s.step, s.fragment)).collect();
        assert_eq!(asked, scheduled, "{fragments} fragments");
    }
    // A data-parallel round averages no fragment.
    let dp = FragmentPlan::new(plan(SyncRule::Dp), 1).unwrap();
    assert_eq!(dp.plan().cursor().map(|info| dp.syncs_after(&info).count()).sum::<usize>(), 0);
}

/// A delay past a fragment's next sync is counted: with H = 2 every sync of a fragment comes 2 steps
/// after its previous one, so a delay of 2 lands each average on the next sync (in time) and a delay
/// of 3 lands all but the first fragment syncs' averages early.
#[test]
fn syncs_within_the_delay_are_counted_per_fragment() {
    let schedule = LrSchedule::new(ScheduleKind::Constant, 24, 0, 0.1, 0.0);
    let h2 = FragmentPlan::new(Plan::new(schedule.clone(), SyncRule::Constant { h: 2 }).unwrap(), 4).unwrap();
    assert_eq!(h2.syncs_within(2), 0);
    assert_eq!(h2.syncs_within(3), 4 * 11, "12 rounds: every fragment's 11 later syncs");
    let h8 = FragmentPlan::new(Plan::new(schedule, SyncRule::Constant { h: 8 }).unwrap(), 4).unwrap();
    assert_eq!(h8.syncs_within(8), 0);
    assert_eq!(h8.syncs_within(9), 4 * 2);
}
