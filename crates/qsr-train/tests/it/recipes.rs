//! Every recipe shipped in recipes/ is a valid training recipe, and its plan is what `qsr plan` reads.

use qsr_train::recipe::TrainRecipe;

#[test]
fn every_shipped_recipe_validates() {
    let dir = crate::common::root().join("recipes");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let r = TrainRecipe::load(&path, &[]).unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
            let stem = path.file_stem().unwrap().to_string_lossy();
            assert_eq!(r.name, stem, "{}: name should match the file", path.display());
            let plan = r.plan().unwrap();
            let from_plan_cmd = qsr_train::recipe::load_plan(Some(&path), &Default::default()).unwrap().plan;
            assert_eq!(plan, from_plan_cmd, "{}", path.display());
            n += 1;
        }
    }
    assert!(n >= 9, "found only {n} recipes");
}

/// Regression: `--set sync.rule=dp` on a QSR recipe failed with "unknown field `alpha`" (the GPU
/// check's data-parallel baseline never ran on the first card it met). Switching the rule with `--set`
/// now drops the old rule's settings, as `qsr plan --sync` does; later `--set`s still apply.
#[test]
fn set_sync_rule_switches_the_rule_and_drops_the_old_rules_settings() {
    let gpu = crate::common::root().join("recipes/fashion-mnist-resnet20-gpu.toml");
    let dp = TrainRecipe::load(&gpu, &["sync.rule=dp".to_string()]).unwrap();
    assert_eq!(dp.sync.rule.name(), "dp");
    let sets = ["sync.rule=constant".to_string(), "sync.h=8".to_string()];
    let constant = TrainRecipe::load(&gpu, &sets).unwrap();
    assert_eq!(constant.sync.rule, qsr_sched::SyncRule::Constant { h: 8 });
    // The same rule keeps its settings.
    let qsr = TrainRecipe::load(&gpu, &["sync.rule=qsr".to_string()]).unwrap();
    assert_eq!(qsr.plan().unwrap(), TrainRecipe::load(&gpu, &[]).unwrap().plan().unwrap());
}

/// Issue 46: `[sync] budget` chooses QSR's alpha as `qsr plan --budget` does (the smallest alpha whose
/// plan stays within the share of data parallel's syncs). Issue 54: budget and alpha are one knob:
/// both, from any source (one recipe, a recipe and `--set`, a recipe and a flag), are refused naming
/// both keys; `--set sync.alpha=` drops a recipe's alpha; the resolved recipe records both and loads.
#[test]
fn a_sync_budget_chooses_alpha_as_the_planners_flag_does() {
    let path = crate::common::root().join("recipes/digits-qsr.toml");
    let sets = ["sync.alpha=".to_string(), "sync.budget=0.2".to_string()];
    let recipe = TrainRecipe::load(&path, &sets).unwrap();
    let qsr_sched::SyncRule::Qsr { h_base, alpha } = recipe.sync.rule.clone() else { panic!("{:?}", recipe.sync.rule) };
    let expected = qsr_sched::alpha_for_budget(&recipe.schedule, h_base, 0.2, recipe.train.steps).unwrap();
    assert_eq!(alpha, expected);
    assert_eq!(recipe.sync.budget, Some(0.2), "the resolved recipe records the budget");
    let share = recipe.plan().unwrap().summary().comm_percent / 100.0;
    assert!(share <= 0.2, "{share}");
    let flags =
        qsr_train::recipe::PlanOverrides { budget: Some(0.2), sets: vec!["sync.alpha=".into()], ..Default::default() };
    assert_eq!(recipe.plan().unwrap(), qsr_train::recipe::load_plan(Some(&path), &flags).unwrap().plan);
    // The resolved recipe (budget and the alpha it chose) loads as it was written.
    let dir = tempfile::tempdir().unwrap();
    let resolved = dir.path().join("resolved.toml");
    std::fs::write(&resolved, recipe.to_toml().unwrap()).unwrap();
    assert_eq!(TrainRecipe::load(&resolved, &[]).unwrap().sync, recipe.sync);
    // Regression: a longer run resumed from it recomputed alpha for its new length and was refused;
    // it keeps the alpha the run used (`sync.from_budget` is a record, not the budget itself).
    let longer = TrainRecipe::load(&resolved, &["train.steps=2000".to_string()]).unwrap();
    assert_eq!(longer.sync, recipe.sync);
    // Both keys, from any source and in any order: refused naming both.
    let text = std::fs::read_to_string(&path).unwrap().replace("[sync]", "[sync]\nbudget = 0.2");
    let both = dir.path().join("both.toml");
    std::fs::write(&both, text).unwrap();
    let budget_only = dir.path().join("budget.toml");
    let text = std::fs::read_to_string(&path).unwrap().replace("alpha = 0.06", "budget = 0.2");
    std::fs::write(&budget_only, text).unwrap();
    let set = |s: &[&str]| s.iter().map(ToString::to_string).collect::<Vec<_>>();
    let refusals = [
        format!("{:#}", TrainRecipe::load(&both, &[]).unwrap_err()),
        format!("{:#}", TrainRecipe::load(&path, &set(&["sync.budget=0.2"])).unwrap_err()),
        format!("{:#}", TrainRecipe::load(&budget_only, &set(&["sync.alpha=0.03"])).unwrap_err()),
        format!("{:#}", TrainRecipe::load(&budget_only, &set(&["sync.alpha=0.03", "sync.budget=0.2"])).unwrap_err()),
        format!("{:#}", TrainRecipe::load(&budget_only, &set(&["sync.budget=0.2", "sync.alpha=0.03"])).unwrap_err()),
    ];
    let flag = qsr_train::recipe::PlanOverrides { alpha: Some(0.03), ..Default::default() };
    let from_flag = format!("{:#}", qsr_train::recipe::load_plan(Some(&budget_only), &flag).unwrap_err());
    for e in refusals.iter().chain([&from_flag]) {
        assert!(e.contains("`sync.budget`") && e.contains("`sync.alpha`") && e.contains("not both"), "{e}");
    }
    // A budget under another rule, from a switch of the rule: refused naming both keys, not dropped.
    let e = format!("{:#}", TrainRecipe::load(&budget_only, &set(&["sync.rule=constant", "sync.h=2"])).unwrap_err());
    assert!(e.contains("`sync.budget`") && e.contains("`sync.rule"), "{e}");
}
