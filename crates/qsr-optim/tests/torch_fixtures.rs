//! qsr-optim reproduces PyTorch's optimizer trajectories (fixtures written by
//! scripts/torch_optim_fixtures.py with torch.optim.SGD / AdamW, foreach=False).

use std::ops::Range;

use qsr_optim::{Optimizer, OptimizerConfig, OptimizerKind};
use serde_json::Value;

fn fixture() -> Value {
    serde_json::from_str(include_str!("fixtures/torch_optim.json")).expect("fixture is JSON")
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

/// Concatenates the named tensors in fixture order, returning the flat buffer and each tensor's range.
fn flat(obj: &Value, order: &[String]) -> (Vec<f32>, Vec<Range<usize>>) {
    let mut out = Vec::new();
    let mut ranges = Vec::new();
    for name in order {
        let start = out.len();
        out.extend(floats(&obj[name]));
        ranges.push(start..out.len());
    }
    (out, ranges)
}

fn config(case: &Value) -> OptimizerConfig {
    let o = &case["options"];
    let f = |k: &str| o[k].as_f64();
    let mut c = match case["optimizer"].as_str().unwrap() {
        "sgd" => {
            let mut c = OptimizerConfig::sgd(f("momentum").unwrap(), f("weight_decay").unwrap());
            c.dampening = f("dampening");
            c.nesterov = o["nesterov"].as_bool();
            c
        }
        "adamw" => {
            let mut c = OptimizerConfig::adamw(f("weight_decay").unwrap());
            c.beta1 = o["betas"][0].as_f64();
            c.beta2 = o["betas"][1].as_f64();
            c.eps = f("eps");
            assert_eq!(c.kind, OptimizerKind::Adamw);
            c
        }
        other => panic!("unknown optimizer {other}"),
    };
    c.exclude_norm_and_bias = case["exclude_norm_and_bias"].as_bool().unwrap();
    c.clip_grad_norm = case["clip_grad_norm"].as_f64();
    c
}

#[test]
fn every_torch_trajectory_is_reproduced() {
    let fx = fixture();
    let order: Vec<String> = fx["order"].as_array().unwrap().iter().map(|s| s.as_str().unwrap().to_string()).collect();
    let no_decay: Vec<&str> = fx["no_decay"].as_array().unwrap().iter().map(|s| s.as_str().unwrap()).collect();
    let lrs: Vec<f64> = fx["lrs"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    let (params0, ranges) = flat(&fx["params0"], &order);
    let exempt: Vec<Range<usize>> =
        order.iter().zip(&ranges).filter(|(n, _)| no_decay.contains(&n.as_str())).map(|(_, r)| r.clone()).collect();
    let mut checked = 0;
    for case in fx["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let mut opt = Optimizer::new(config(case), params0.len(), &exempt).unwrap();
        let mut params = params0.clone();
        for (step, want) in case["trajectory"].as_array().unwrap().iter().enumerate() {
            let (mut grads, _) = flat(&fx["grads"][step], &order);
            opt.step(&mut params, &mut grads, lrs[step]);
            let (want, _) = flat(want, &order);
            for (i, (&got, &want)) in params.iter().zip(&want).enumerate() {
                // Relative 1e-6, with an absolute floor of 1e-7 for values that cancel towards zero (parameters are O(1)).
                let tol = 1e-6 * want.abs().max(0.1);
                assert!(
                    (got - want).abs() <= tol,
                    "{name}, step {step}, element {i}: qsr {got:e} vs torch {want:e} (|diff| {:e})",
                    (got - want).abs()
                );
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 11 * 6 * (20 + 5 + 3 + 3));
}

#[test]
fn settings_of_the_other_optimizer_are_refused() {
    let mut c = OptimizerConfig::adamw(0.05);
    c.momentum = Some(0.9);
    let e = Optimizer::new(c, 4, &[]).unwrap_err().to_string();
    assert!(e.contains("optimizer.momentum") && e.contains("sgd"), "{e}");
    let mut c = OptimizerConfig::sgd(0.9, 1e-4);
    c.beta2 = Some(0.99);
    assert!(Optimizer::new(c, 4, &[]).unwrap_err().to_string().contains("optimizer.beta2"));
    for (field, c) in [
        ("optimizer.momentum", OptimizerConfig::sgd(1.0, 0.0)),
        ("optimizer.weight_decay", OptimizerConfig::sgd(0.9, -1e-4)),
        ("optimizer.weight_decay", OptimizerConfig::adamw(f64::NAN)),
        ("optimizer.nesterov", OptimizerConfig { nesterov: Some(true), ..OptimizerConfig::sgd(0.0, 0.0) }),
        ("optimizer.eps", OptimizerConfig { eps: Some(0.0), ..OptimizerConfig::adamw(0.0) }),
        ("optimizer.beta1", OptimizerConfig { beta1: Some(1.0), ..OptimizerConfig::adamw(0.0) }),
        ("optimizer.clip_grad_norm", OptimizerConfig { clip_grad_norm: Some(0.0), ..OptimizerConfig::adamw(0.0) }),
    ] {
        let e = Optimizer::new(c, 4, &[]).unwrap_err().to_string();
        assert!(e.contains(field), "expected {field}: {e}");
    }
}
