//! Two-level plans: local averages inside a node between the global synchronizations.

use qsr_sched::{Cursor, LrSchedule, Plan, ScheduleKind, SyncRule};

fn schedule() -> LrSchedule {
    LrSchedule::new(ScheduleKind::Cosine, 200, 20, 0.1, 1e-4)
}

fn two_level(global: SyncRule, local: SyncRule) -> Plan {
    Plan::new(schedule(), global).unwrap().with_local(local).unwrap()
}

fn local_steps(p: &Plan) -> Vec<u64> {
    p.cursor().filter(|s| s.local_sync_after).map(|s| s.step).collect()
}

#[test]
fn local_rounds_restart_at_every_global_round() {
    let p = two_level(SyncRule::Constant { h: 5 }, SyncRule::Constant { h: 2 });
    // Global syncs after steps 4, 9, 14, ...; local ones 2 steps into each round, never at its end.
    assert_eq!(&local_steps(&p)[..6], &[1, 3, 6, 8, 11, 13]);
    let s = p.summary();
    assert_eq!(s.rounds, 40);
    let l = s.local.unwrap();
    assert_eq!((l.rule.as_str(), l.rounds, l.max_h), ("constant", 80, 2));
    assert_eq!(l.comm_percent, 40.0);
}

#[test]
fn a_data_parallel_global_rule_leaves_no_local_average() {
    let p = two_level(SyncRule::Dp, SyncRule::Constant { h: 1 });
    assert!(local_steps(&p).is_empty());
    assert_eq!(p.summary().local.unwrap().rounds, 0);
    assert_eq!(p.summary().rounds, 200);
}

#[test]
fn local_qsr_grows_its_rounds_inside_long_global_rounds() {
    let global = SyncRule::Constant { h: 50 };
    let p = two_level(global, SyncRule::Qsr { h_base: 2, alpha: 0.02 });
    let steps: Vec<_> = p.cursor().collect();
    // In warmup the local rule takes h_base; late, with a small lr, one local round fills the global one.
    assert_eq!(steps.iter().filter(|s| s.local_sync_after && s.step < 20).count(), 10);
    let in_round = |r: u64| steps.iter().filter(|s| s.round == r && s.local_sync_after).count();
    assert!(in_round(3) < in_round(1), "{} local averages late, {} early", in_round(3), in_round(1));
    assert!(p.summary().local.unwrap().max_h > 2);
}

#[test]
fn a_two_level_cursor_resumes_from_json_and_from_its_step() {
    let p =
        two_level(SyncRule::Qsr { h_base: 4, alpha: 0.03 }, SyncRule::Exponential { h_base: 1, scaler: 3, h_max: 8 });
    for stop in [0, 1, 7, 33, 120, 199, 200] {
        let mut c = p.cursor();
        c.by_ref().take(stop).for_each(drop);
        assert_eq!(p.cursor_at(stop as u64), c, "cursor_at({stop})");
        let back: Cursor = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);
    }
    let plan_json = serde_json::to_string(&p).unwrap();
    assert!(plan_json.contains("\"local\""), "{plan_json}");
    assert_eq!(serde_json::from_str::<Plan>(&plan_json).unwrap(), p);
}

#[test]
fn a_cursor_whose_local_position_is_tampered_or_missing_is_refused() {
    let p = two_level(SyncRule::Constant { h: 6 }, SyncRule::Constant { h: 2 });
    let mut c = p.cursor();
    c.by_ref().take(3).for_each(drop);
    let json: serde_json::Value = serde_json::to_value(&c).unwrap();
    let mut moved = json.clone();
    moved["local"]["round"]["len"] = 3.into();
    let e = serde_json::from_value::<Cursor>(moved).unwrap_err().to_string();
    assert!(e.contains("cursor.local"), "{e}");
    // A local round moved within its global round (one step later) is refused too.
    let mut shifted = json.clone();
    shifted["local"]["round"]["start"] = 3.into();
    let e = serde_json::from_value::<Cursor>(shifted).unwrap_err().to_string();
    assert!(e.contains("does not follow"), "{e}");
    let mut missing = json;
    missing.as_object_mut().unwrap().remove("local");
    let e = serde_json::from_value::<Cursor>(missing).unwrap_err().to_string();
    assert!(e.contains("no local position"), "{e}");
}

#[test]
fn local_rules_that_average_gradients_or_are_invalid_are_refused_by_key() {
    let plan = Plan::new(schedule(), SyncRule::Qsr { h_base: 2, alpha: 0.02 }).unwrap();
    let e = plan.clone().with_local(SyncRule::Dp).unwrap_err();
    assert_eq!(e.field, "sync.local.rule");
    assert!(e.reason.contains("rule = \"constant\" with h = 1"), "{e}");
    let e = plan.clone().with_local(SyncRule::PostLocal { switch_step: 10, h: 2 }).unwrap_err();
    assert_eq!(e.field, "sync.local.rule");
    assert_eq!(plan.clone().with_local(SyncRule::Constant { h: 0 }).unwrap_err().field, "sync.local.h");
    let e = plan.with_local(SyncRule::Qsr { h_base: 2, alpha: -1.0 }).unwrap_err();
    assert_eq!(e.field, "sync.local.alpha");
}
