//! `optimizer.kind = "muon"` against PyTorch (crates/qsr-optim/tests/fixtures/torch_muon.json, written
//! by scripts/torch_optim_fixtures.py): torch.optim.Muon on the two weight matrices and
//! torch.optim.AdamW on the rest, four settings (torch's defaults; no Nesterov with Moonshot's lr
//! adjustment; Bernstein's with 3 Newton-Schulz steps and other coefficients; clipping), two seeds,
//! two lr schedules, 6 steps each.
//!
//! Muon's Newton-Schulz iteration runs in bfloat16, and torch's products come from oneDNN's blocked
//! kernels, whose f32 sums may run in another order than ours: on larger matrices an entry of a product
//! can round to the neighbouring bf16 value (2^-8 relative). On the fixture's matrices none does.

use qsr_optim::{AdjustLr, MuonMatrix, Optimizer, OptimizerConfig};
use serde_json::Value;

use crate::torch_fixtures::{flat, floats, strings};

fn fixture() -> Value {
    serde_json::from_str(include_str!("../fixtures/torch_muon.json")).expect("fixture is JSON")
}

fn config(case: &Value) -> OptimizerConfig {
    let o = &case["options"];
    let mut c = OptimizerConfig::muon(o["weight_decay"].as_f64().unwrap());
    c.momentum = o["momentum"].as_f64();
    c.nesterov = o["nesterov"].as_bool();
    c.eps = o["eps"].as_f64();
    c.ns_steps = o["ns_steps"].as_u64().map(|s| s as u32);
    c.ns_coefficients = o["ns_coefficients"].as_array().map(|v| [0, 1, 2].map(|i| v[i].as_f64().unwrap()));
    c.adjust_lr_fn = o["adjust_lr_fn"].as_str().map(|f| serde_json::from_value::<AdjustLr>(f.into()).unwrap());
    c.beta1 = o["betas"][0].as_f64();
    c.beta2 = o["betas"][1].as_f64();
    c.clip_grad_norm = case["clip_grad_norm"].as_f64();
    c
}

/// The largest |qsr - torch| / max(|torch|, 0.1) of one case, over every step: on the matrices
/// (Muon) and on the rest (AdamW).
fn replay(fx: &Value, case: &Value) -> (f64, f64) {
    let order = strings(&fx["order"]);
    let matrices = strings(&fx["matrices"]);
    let data = &fx["data"][case["data"].as_u64().unwrap() as usize];
    let lrs: Vec<f64> = fx["schedules"][case["schedule"].as_str().unwrap()]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    let (mut params, ranges) = flat(&data["params0"], &order);
    let muon: Vec<MuonMatrix> = order
        .iter()
        .zip(&ranges)
        .filter(|(n, _)| matrices.contains(n))
        .map(|(n, r)| {
            let shape = &fx["shapes"][n.as_str()];
            let (rows, cols) = (shape[0].as_u64().unwrap() as usize, shape[1].as_u64().unwrap() as usize);
            MuonMatrix { range: r.clone(), rows, cols, fan_out: rows, fan_in: cols }
        })
        .collect();
    let in_matrix = |i: usize| muon.iter().any(|m| m.range.contains(&i));
    let mut opt = Optimizer::new(config(case), params.len(), &[]).unwrap().with_tensors(&ranges).unwrap();
    opt = opt.with_muon_matrices(muon.clone()).unwrap();
    let (mut on_matrices, mut on_rest) = (0.0f64, 0.0f64);
    for (step, want) in case["trajectory"].as_array().unwrap().iter().enumerate() {
        let (mut grads, _) = flat(&data["grads"][step], &order);
        opt.step(&mut params, &mut grads, lrs[step]);
        let (want, _) = flat(want, &order);
        for (i, (&got, &want)) in params.iter().zip(&want).enumerate() {
            let rel = f64::from((got - want).abs()) / f64::from(want.abs().max(0.1));
            let worst = if in_matrix(i) { &mut on_matrices } else { &mut on_rest };
            *worst = worst.max(rel);
        }
    }
    let first = floats(&case["final_moments"]["first"]);
    for (i, (&got, &want)) in opt.state().first_moment.iter().zip(&first).enumerate() {
        // The momentum buffers see the gradients only: exact on the matrices, AdamW's on the rest.
        if in_matrix(i) {
            assert_eq!(got.to_bits(), want.to_bits(), "{}: momentum buffer element {i}", case["name"]);
        }
    }
    (on_matrices, on_rest)
}

/// Every Muon matrix follows torch's bit for bit through 6 steps, in all 16 cases (the products of
/// these 5x4 and 7x9 matrices round to the same bf16 values whatever the order of their f32 sums), its
/// momentum buffer too; the AdamW part stays within AdamW's own bound (6e-7: torch's MKL square root,
/// torch_fixtures.rs).
#[test]
fn muon_trajectories_match_torch_bit_for_bit_on_the_matrices() {
    let fx = fixture();
    let (mut worst_matrix, mut worst_rest) = (0.0f64, 0.0f64);
    for case in fx["cases"].as_array().unwrap() {
        let (m, r) = replay(&fx, case);
        assert_eq!(
            m, 0.0,
            "{} #{} {}: Muon's matrices are {m:.2e} from torch's",
            case["name"], case["data"], case["schedule"]
        );
        worst_matrix = worst_matrix.max(m);
        worst_rest = worst_rest.max(r);
    }
    assert_eq!(fx["cases"].as_array().unwrap().len(), 16);
    assert!(worst_rest <= 6e-7, "Muon's AdamW part is {worst_rest:.2e} from torch's");
}

/// Settings Muon cannot run with are refused naming the key; Muon's own keys on SGD or AdamW too.
#[test]
fn muon_settings_that_cannot_run_are_refused_naming_the_key() {
    let muon = OptimizerConfig::muon(0.1);
    let cases = [
        ("optimizer.ns_steps", OptimizerConfig { ns_steps: Some(0), ..muon.clone() }),
        ("optimizer.ns_steps", OptimizerConfig { ns_steps: Some(100), ..muon.clone() }),
        ("optimizer.eps", OptimizerConfig { eps: Some(0.0), ..muon.clone() }),
        ("optimizer.momentum", OptimizerConfig { momentum: Some(1.0), ..muon.clone() }),
        ("optimizer.dampening", OptimizerConfig { dampening: Some(0.1), ..muon.clone() }),
        ("optimizer.ns_coefficients", OptimizerConfig { ns_coefficients: Some([1.0, f64::NAN, 1.0]), ..muon }),
        ("optimizer.ns_steps", OptimizerConfig { ns_steps: Some(5), ..OptimizerConfig::adamw(0.0) }),
        (
            "optimizer.adjust_lr_fn",
            OptimizerConfig { adjust_lr_fn: Some(AdjustLr::Original), ..OptimizerConfig::sgd(0.9, 0.0) },
        ),
    ];
    for (key, config) in cases {
        let e = config.validate().unwrap_err().to_string();
        assert!(e.contains(key), "{key}: {e}");
    }
}

/// Matrices that overlap, do not fit, or are given to another kind are refused; a model's layout puts
/// every hidden weight matrix under Muon and leaves the head (the last weight, or an embedding it is
/// tied to), biases and norms to AdamW.
#[test]
fn muon_matrices_come_from_the_hidden_weights_and_must_fit() {
    let m = |range: std::ops::Range<usize>, rows, cols| MuonMatrix { range, rows, cols, fan_out: rows, fan_in: cols };
    let opt = || Optimizer::new(OptimizerConfig::muon(0.0), 20, &[]).unwrap();
    assert!(opt().with_muon_matrices(vec![m(0..6, 2, 3), m(4..10, 2, 3)]).is_err(), "overlap");
    assert!(opt().with_muon_matrices(vec![m(16..22, 2, 3)]).is_err(), "past the end");
    assert!(opt().with_muon_matrices(vec![m(0..6, 2, 2)]).is_err(), "wrong size");
    let adamw = Optimizer::new(OptimizerConfig::adamw(0.0), 20, &[]).unwrap();
    assert!(adamw.with_muon_matrices(vec![m(0..6, 2, 3)]).is_err(), "not a Muon optimizer");
    // An MLP 4 -> 16 -> 16 -> 1: two hidden matrices (burn's [in, out]), the head and biases left out.
    let device = burn::tensor::Device::flex();
    let layout = qsr_optim::ParamLayout::of(&crate::common::Mlp3::new(&device));
    let matrices = layout.muon_matrices();
    let shapes: Vec<_> = matrices.iter().map(|m| (m.rows, m.cols, m.fan_out, m.fan_in)).collect();
    assert_eq!(shapes, [(4, 16, 16, 4), (16, 16, 16, 16)]);
    assert!(opt().with_muon_matrices(vec![m(0..6, 2, 3), m(10..16, 3, 2)]).is_ok());
    // qsr's GPT ties its head to the token embedding: every block matrix is a hidden one.
    let gpt =
        qsr_models::GptConfig { vocab_size: 16, context: 8, layers: 2, heads: 2, width: 8, dropout: 0.0, bias: true };
    let layout = qsr_optim::ParamLayout::of(&gpt.init(&device).unwrap());
    let weights = layout.trainable.iter().filter(|e| e.role == qsr_optim::ParamRole::Weight && e.shape.len() == 2);
    assert_eq!(layout.muon_matrices().len(), weights.count());
    assert!(layout.muon_matrices().len() >= 8, "4 matrices per block");
}
