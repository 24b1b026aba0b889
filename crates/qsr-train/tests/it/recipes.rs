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
