//! `qsr train` on text: a character-level GPT on the embedded Comedy of Errors (the Shakespeare recipes
//! with `data.dataset` swapped, so the shipped recipes are what is tested).

use std::path::Path;

use crate::common::{json, ok, qsr_cmd, refused};

fn final_params(run: &Path) -> Vec<u8> {
    let latest = std::fs::read_to_string(run.join("ckpt/LATEST")).unwrap();
    std::fs::read(run.join("ckpt").join(latest.trim()).join("model.safetensors")).unwrap()
}

const QSR: &str = "recipes/shakespeare-char-qsr.toml";
/// The embedded play, 300 steps (about 8 epochs of its 78,237 training characters for 2 workers).
const COMEDY: [&str; 10] = [
    "--set",
    "data.dataset=comedy-of-errors",
    "--set",
    "schedule.total_steps=300",
    "--set",
    "schedule.warmup_steps=20",
    "--workers",
    "2",
    "--quiet",
    "--set=eval.max_items=64",
];

fn train(recipe: &str, out: &Path, extra: &[&str]) -> String {
    ok(&[&["train", "--recipe", recipe, "--out", out.to_str().unwrap()][..], &COMEDY, extra].concat())
}

/// The validation loss falls well below the unigram entropy (what a model that ignores the context
/// reaches); the run syncs as planned; gradient accumulation and clipping are on.
#[test]
fn char_gpt_learns_below_the_unigram_entropy_and_syncs_as_planned() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let stdout = train(QSR, &run, &["--set", "train.micro_batch=8"]);
    let s = json(&run.join("summary.json"));
    let (loss, entropy) = (s["final_test_loss"].as_f64().unwrap(), s["unigram_entropy"].as_f64().unwrap());
    assert!((entropy - 3.355).abs() < 1e-3, "the Comedy of Errors' unigram entropy is 3.355 nats: {s}");
    assert!(loss < entropy - 0.6, "validation loss {loss} is not well below the unigram entropy {entropy}");
    assert!(stdout.contains("validation loss") && stdout.contains("unigram entropy"), "{stdout}");
    assert_eq!(s["syncs"], s["planned_syncs"]);
    let evals = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    assert!(evals.lines().filter(|l| l.contains("\"eval\"")).count() >= 2);
    let saved = std::fs::read_to_string(run.join("recipe.toml")).unwrap();
    assert!(saved.contains("kind = \"gpt\"") && saved.contains("vocab_size = 80"), "{saved}");
}

/// A text run stopped at a checkpoint and resumed ends bit-identical to a straight run; with DiLoCo's
/// outer optimizer too, whose state (global parameters, momentum) is checkpointed and restored, and
/// whose step changed the run; and with its momentum per inner step (`outer.unit = "lr"`, issue 47).
#[test]
fn text_resume_continues_exactly_with_and_without_the_outer_optimizer() {
    let diloco = ["--set", "outer.lr=0.7", "--set", "outer.momentum=0.9", "--set", "outer.nesterov=true"];
    let (plain, outer) = (resume_continues_exactly_with(&[]), resume_continues_exactly_with(&diloco));
    assert_ne!(plain, outer, "the outer optimizer did not change the run");
    let per_step = resume_continues_exactly_with(&[&diloco[..], &["--set", "outer.unit=lr"]].concat());
    assert_ne!(per_step, outer, "`outer.unit = \"lr\"` did not change the run");
}

/// Trains straight and with a halt plus resume; asserts they end bit-identical; returns the parameters.
fn resume_continues_exactly_with(extra: &[&str]) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let (straight, resumed) = (dir.path().join("straight"), dir.path().join("resumed"));
    let short = [&["--set", "schedule.total_steps=120"][..], extra].concat();
    train(QSR, &straight, &short);
    train(QSR, &resumed, &[&short[..], &["--halt-after", "40"]].concat());
    assert!(!resumed.join("summary.json").exists());
    ok(&["train", "--resume", resumed.to_str().unwrap(), "--quiet", "--workers", "2"]);
    assert_eq!(final_params(&straight), final_params(&resumed));
    let (s, r) = (json(&straight.join("summary.json")), json(&resumed.join("summary.json")));
    assert_eq!(s["final_test_loss"], r["final_test_loss"]);
    assert_eq!(s["syncs"], r["syncs"]);
    final_params(&straight)
}

/// Two processes over the TCP ring train the same model as two threads: the same windows, the same sums;
/// with bf16 parameter syncs too (the in-process group rounds as the ring does), at half the bytes.
#[test]
fn text_over_tcp_equals_threads_in_f32_and_bf16() {
    let dir = tempfile::tempdir().unwrap();
    let short = ["--set", "schedule.total_steps=40"];
    let bf16 = [&short[..], &["--set", "driver.wire=bf16"]].concat();
    for (recipe, extra, name) in [("recipes/shakespeare-char-dp.toml", &short[..], "dp"), (QSR, &bf16[..], "qsr-bf16")]
    {
        let (a, b) = (dir.path().join(format!("{name}-threads")), dir.path().join(format!("{name}-procs")));
        train(recipe, &a, extra);
        let procs = ["train", "--recipe", recipe, "--nproc", "2", "--out", b.to_str().unwrap(), "--quiet"];
        ok(&[&procs[..], &COMEDY[..6], extra].concat());
        assert_eq!(final_params(&a), final_params(&b), "{name}");
    }
    let exact = dir.path().join("qsr-f32");
    train(QSR, &exact, &short);
    let bytes = |run: &str| json(&dir.path().join(run).join("summary.json"))["bytes_per_rank"].as_u64().unwrap();
    assert_eq!(bytes("qsr-bf16-procs") * 2, bytes("qsr-f32"), "TCP bytes of bf16 syncs");
    assert_eq!(bytes("qsr-bf16-threads") * 2, bytes("qsr-f32"), "in-process accounting of bf16 syncs");
}

/// Each worker computes in a rayon pool of its own, the process's threads (`RAYON_NUM_THREADS`) shared
/// between the workers. How many threads that pool has changes no bit of a run: the GPT (products, the
/// fused ops) and the digits CNN (convolutions, BatchNorm) at 1 and 2 threads per worker.
#[test]
fn runs_give_the_same_bits_at_one_and_two_threads_per_worker() {
    let dir = tempfile::tempdir().unwrap();
    let text = [&COMEDY[..], &["--set", "schedule.total_steps=40"]].concat();
    let image = ["--workers", "2", "--quiet"];
    for (recipe, extra, name) in [(QSR, &text[..], "gpt"), ("recipes/digits-qsr.toml", &image[..], "cnn")] {
        // 2 workers: 2 process threads give each 1, 4 give each 2.
        let run_with = |threads: &str| {
            let out = dir.path().join(format!("{name}-{threads}"));
            let args = [&["train", "--recipe", recipe, "--out", out.to_str().unwrap()][..], extra].concat();
            let o = qsr_cmd(&args).env("RAYON_NUM_THREADS", threads).output().unwrap();
            assert!(o.status.success(), "{name}: {}", String::from_utf8_lossy(&o.stderr));
            final_params(&out)
        };
        assert_eq!(run_with("2"), run_with("4"), "{name}");
    }
}

#[test]
fn text_settings_are_refused_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("r");
    let o = out.to_str().unwrap();
    let base = ["train", "--recipe", QSR, "--out", o, "--quiet"];
    let cases: [(&[&str], &str); 5] = [
        (&["--set", "data.dataset=digits"], "data.dataset"),
        (&["--set", "data.dataset=comedy-of-errors", "--set", "model.vocab_size=10"], "model.vocab_size"),
        (&["--set", "data.dataset=text", "--set", "data.path=/nonexistent/play.txt"], "/nonexistent/play.txt"),
        (&["--set", "data.dataset=comedy-of-errors", "--set", "model.context=60000"], "context"),
        (&["--set", "data.dataset=comedy-of-errors", "--set", "eval.max_items=0"], "eval.max_items"),
    ];
    for (extra, needle) in cases {
        let err = refused(&[&base[..], extra].concat());
        assert!(err.contains(needle), "{extra:?}: expected `{needle}` in: {err}");
    }
    let digits_gpt = refused(&["train", "--recipe", "recipes/digits-qsr.toml", "--out", o, "--set", "model.kind=gpt"]);
    assert!(digits_gpt.contains("model"), "{digits_gpt}");
}

/// `qsr compare` on text: rules with parameters and `+outer` get their own rows and run directories, the
/// table reports validation loss and next-token accuracy, the JSON the outer settings.
#[test]
fn compare_on_text_reports_validation_loss_per_rule_and_outer_variant() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("cmp");
    let stdout = ok(&[
        "compare",
        "--recipe",
        QSR,
        "--seeds",
        "1",
        "--workers",
        "2",
        "--rules",
        "dp,power:power=1;h_base=2,qsr+outer,qsr+outer:outer.unit=lr;outer.momentum=0.9",
        "--out",
        out.to_str().unwrap(),
        "--set",
        "data.dataset=comedy-of-errors",
        "--set",
        "schedule.total_steps=40",
        "--set",
        "schedule.warmup_steps=4",
        "--set",
        "eval.every_steps=20",
        "--set",
        "eval.max_items=32",
    ]);
    assert!(stdout.contains("validation loss (nats)") && stdout.contains("+ outer (lr 0.7, momentum 0.5)"), "{stdout}");
    // Regression: the table's title gave the recipe's K = 4, not the --workers 2 the runs had.
    assert!(stdout.contains("K = 2 workers, 40 steps, 1 seeds"), "{stdout}");
    let rows = json(&out.join("compare.json"));
    let labels: Vec<&str> = rows.as_array().unwrap().iter().map(|r| r["rule"].as_str().unwrap()).collect();
    assert_eq!(labels, ["dp", "power-power=1-h_base=2", "qsr-outer", "qsr-outer-outer.unit=lr-outer.momentum=0.9"]);
    assert!(rows[0]["outer"].is_null() && rows[2]["outer"]["lr"] == 0.7);
    assert_eq!(
        (&rows[3]["outer"]["unit"], &rows[3]["outer"]["momentum"]),
        (&serde_json::json!("lr"), &serde_json::json!(0.9))
    );
    assert!(stdout.contains("+ outer (lr 0.7, momentum 0.9 per lr-weighted step)"), "{stdout}");
    assert_eq!(rows[1]["sync"]["power"], 1.0);
    for r in rows.as_array().unwrap() {
        assert!(r["loss_mean"].as_f64().unwrap() < 4.2, "{r}");
        let run = Path::new(r["runs"][0].as_str().unwrap());
        assert!(run.join("summary.json").exists(), "{}", run.display());
        // every_steps = 20: evaluations at (or at the last sync before) steps 20 and 40.
        let evals = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap().matches("\"eval\"").count();
        assert!(evals >= 2, "{r}: {evals} evaluations");
    }
    assert!(out.join("eval-loss.png").exists());
    let bare = refused(&["compare", "--recipe", QSR, "--rules", "qsr:outer.unit=lr", "--out", out.to_str().unwrap()]);
    assert!(bare.contains("add `+outer`"), "{bare}");
    let bad = refused(&[
        "compare",
        "--recipe",
        QSR,
        "--rules",
        "qsr+outer:outer.unit=hourly",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(bad.contains("unit"), "{bad}");
}
