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
