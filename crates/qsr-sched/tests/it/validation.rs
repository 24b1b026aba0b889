//! Every invalid setting is refused with an error that names the field.

use qsr_sched::{LrSchedule, Plan, ScheduleKind, SyncRule};

fn sched() -> LrSchedule {
    LrSchedule::new(ScheduleKind::Cosine, 1_000, 100, 0.1, 1e-6)
}

fn field_of(s: LrSchedule, r: SyncRule) -> String {
    let err = Plan::new(s, r).expect_err("must be refused");
    assert!(err.to_string().contains(&format!("`{}`", err.field)), "{err}");
    err.field
}

fn qsr() -> SyncRule {
    SyncRule::Qsr { h_base: 2, alpha: 0.02 }
}

#[test]
fn h_base_zero() {
    assert_eq!(field_of(sched(), SyncRule::Qsr { h_base: 0, alpha: 0.02 }), "sync.h_base");
    assert_eq!(field_of(sched(), SyncRule::Power { h_base: 0, alpha: 0.02, power: 1.0 }), "sync.h_base");
    assert_eq!(field_of(sched(), SyncRule::Exponential { h_base: 0, scaler: 1, h_max: 4 }), "sync.h_base");
    assert_eq!(field_of(sched(), SyncRule::Constant { h: 0 }), "sync.h");
}

#[test]
fn alpha_not_positive_or_nan() {
    for alpha in [0.0, -0.1, f64::NAN, f64::INFINITY] {
        assert_eq!(field_of(sched(), SyncRule::Qsr { h_base: 2, alpha }), "sync.alpha", "alpha {alpha}");
        assert_eq!(field_of(sched(), SyncRule::Power { h_base: 2, alpha, power: 3.0 }), "sync.alpha");
    }
    for power in [0.0, -2.0, f64::NAN] {
        assert_eq!(field_of(sched(), SyncRule::Power { h_base: 2, alpha: 0.1, power }), "sync.power");
    }
}

#[test]
fn warmup_not_below_total() {
    let mut s = sched();
    s.warmup_steps = 1_000;
    assert_eq!(field_of(s, qsr()), "schedule.warmup_steps");
    let mut s = sched();
    s.total_steps = 0;
    s.warmup_steps = 0;
    assert_eq!(field_of(s, qsr()), "schedule.total_steps");
}

#[test]
fn lr_min_above_lr_max_or_bad_values() {
    let mut s = sched();
    s.lr_min = 0.2;
    assert_eq!(field_of(s, qsr()), "schedule.lr_min");
    for bad in [-1.0, f64::NAN, f64::INFINITY, 0.0] {
        let mut s = sched();
        s.lr_max = bad;
        assert_eq!(field_of(s, qsr()), "schedule.lr_max", "lr_max {bad}");
    }
    for bad in [-1e-6, f64::NAN, f64::NEG_INFINITY] {
        let mut s = sched();
        s.lr_min = bad;
        assert_eq!(field_of(s, qsr()), "schedule.lr_min", "lr_min {bad}");
    }
    for bad in [0.0, -0.5, 1.5, f64::NAN] {
        let mut s = sched();
        s.kind = ScheduleKind::Step;
        s.decay_gamma = bad;
        assert_eq!(field_of(s, qsr()), "schedule.decay_gamma", "gamma {bad}");
    }
}

#[test]
fn decay_points_out_of_range_or_unordered() {
    for (points, field) in [
        (vec![50], "schedule.decay_points[0]"),
        (vec![100], "schedule.decay_points[0]"),
        (vec![1_000], "schedule.decay_points[0]"),
        (vec![300, 2_000], "schedule.decay_points[1]"),
        (vec![300, 300], "schedule.decay_points[1]"),
        (vec![500, 300], "schedule.decay_points[1]"),
    ] {
        let mut s = sched();
        s.kind = ScheduleKind::Step;
        s.decay_points = points.clone();
        assert_eq!(field_of(s, qsr()), field, "{points:?}");
    }
    let mut s = sched();
    s.decay_points = vec![300];
    assert_eq!(field_of(s, qsr()), "schedule.decay_points", "cosine takes no decay points");
}

#[test]
fn switch_step_beyond_total() {
    assert_eq!(field_of(sched(), SyncRule::PostLocal { switch_step: 1_001, h: 4 }), "sync.switch_step");
    assert!(Plan::new(sched(), SyncRule::PostLocal { switch_step: 1_000, h: 4 }).is_ok());
}

#[test]
fn exponential_h_max_below_h_base() {
    assert_eq!(field_of(sched(), SyncRule::Exponential { h_base: 8, scaler: 2, h_max: 4 }), "sync.h_max");
    assert_eq!(field_of(sched(), SyncRule::Exponential { h_base: 2, scaler: 0, h_max: 4 }), "sync.scaler");
}

#[test]
fn run_steps_zero() {
    let err = Plan::from_parts(sched(), qsr(), Some(0)).unwrap_err();
    assert_eq!(err.field, "run_steps");
}

#[test]
fn toml_with_unknown_key_or_bad_rule_is_refused() {
    let ok = r#"
        [schedule]
        kind = "cosine"
        total_steps = 100
        warmup_steps = 10
        lr_max = 0.1
        [sync]
        rule = "qsr"
        h_base = 2
        alpha = 0.01
    "#;
    let plan: Plan = toml::from_str(ok).unwrap();
    assert_eq!(plan.sync(), &SyncRule::Qsr { h_base: 2, alpha: 0.01 });

    let typo = ok.replace("h_base", "hbase");
    let err = toml::from_str::<Plan>(&typo).unwrap_err().to_string();
    assert!(err.contains("hbase"), "{err}");

    let bad_rule = ok.replace("\"qsr\"", "\"quadratic\"");
    let err = toml::from_str::<Plan>(&bad_rule).unwrap_err().to_string();
    assert!(err.contains("quadratic"), "{err}");

    // Values the types accept but the plan refuses are refused on deserialization too.
    let zero = ok.replace("h_base = 2", "h_base = 0");
    let err = toml::from_str::<Plan>(&zero).unwrap_err().to_string();
    assert!(err.contains("sync.h_base"), "{err}");
}

#[test]
fn dp_rule_refuses_unknown_keys() {
    let recipe =
        |sync: &str| format!("[schedule]\nkind = \"constant\"\ntotal_steps = 100\nlr_max = 0.1\n[sync]\n{sync}\n");
    let plan: Plan = toml::from_str(&recipe("rule = \"dp\"")).unwrap();
    assert_eq!(plan.sync(), &SyncRule::Dp);
    let alias: Plan = toml::from_str(&recipe("rule = \"data-parallel\"")).unwrap();
    assert_eq!(alias.sync(), &SyncRule::Dp);
    for extra in ["h = 4", "typo_key = 3"] {
        let err = toml::from_str::<Plan>(&recipe(&format!("rule = \"dp\"\n{extra}"))).unwrap_err().to_string();
        let key = extra.split(' ').next().unwrap();
        assert!(err.contains(key), "{extra}: {err}");
    }
    // The serialized form is unchanged.
    assert_eq!(toml::to_string(&SyncRule::Dp).unwrap().trim(), "rule = \"dp\"");
}

#[test]
fn step_counts_beyond_the_bound_are_refused_at_once() {
    let s = LrSchedule::new(ScheduleKind::Constant, qsr_sched::MAX_STEPS + 1, 0, 0.1, 0.0);
    let err = Plan::new(s, SyncRule::Dp).unwrap_err().to_string();
    assert!(err.contains("schedule.total_steps") && err.contains("at most"), "{err}");
    let s = LrSchedule::new(ScheduleKind::Constant, 100, 0, 0.1, 0.0);
    let err = Plan::from_parts(s, SyncRule::Dp, Some(u64::MAX)).unwrap_err().to_string();
    assert!(err.contains("run_steps") && err.contains("at most"), "{err}");
}
