//! The GPT decoder: GPT-2 small's parameter count, causality, the tied head, refusals naming the
//! setting, and a small model learning a sequence with burn's AdamW.

use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Int, Tensor, TensorData};
use qsr_models::{GptConfig, ModelError, param_count};

fn tiny(vocab: usize) -> GptConfig {
    GptConfig { vocab_size: vocab, context: 16, layers: 2, heads: 2, width: 32, dropout: 0.0, bias: true }
}

fn tokens(rows: &[&[i64]], device: &Device) -> Tensor<2, Int> {
    let t = rows[0].len();
    let flat: Vec<i64> = rows.iter().flat_map(|r| r.iter().copied()).collect();
    Tensor::from_data(TensorData::new(flat, [rows.len(), t]), device)
}

#[test]
fn gpt2_small_has_124_439_808_parameters_with_the_tied_head() {
    let model = GptConfig::gpt2_small().init(&Device::flex()).unwrap();
    let n = param_count(&model);
    assert_eq!(n, 124_439_808);
    // nanoGPT's printed count leaves out the position embeddings.
    assert_eq!(n - 1_024 * 768, 123_653_376);
}

#[test]
fn logits_at_a_position_do_not_depend_on_later_tokens() {
    let device = Device::flex();
    device.seed(1);
    let model = tiny(11).init(&device).unwrap();
    let a = model.forward(tokens(&[&[1, 2, 3, 4, 5, 6]], &device)).unwrap();
    let b = model.forward(tokens(&[&[1, 2, 3, 4, 9, 10]], &device)).unwrap();
    assert_eq!(a.dims(), [1, 6, 11]);
    let prefix = |x: Tensor<3>| x.narrow(1, 0, 4).into_data().try_to_vec::<f32>().unwrap();
    let (pa, pb) = (prefix(a.clone()), prefix(b.clone()));
    assert!(pa.iter().zip(&pb).all(|(x, y)| (x - y).abs() <= 1e-6), "the first 4 positions saw the future");
    let last = |x: Tensor<3>| x.narrow(1, 5, 1).into_data().try_to_vec::<f32>().unwrap();
    assert_ne!(last(a), last(b), "the last position must see the changed tokens");
}

#[test]
fn sequences_longer_than_the_context_and_bad_widths_are_refused_naming_the_setting() {
    let device = Device::flex();
    let model = tiny(5).init(&device).unwrap();
    let long: Vec<i64> = vec![0; 17];
    let Err(e) = model.forward(tokens(&[&long], &device)) else { panic!("17 tokens into a context of 16") };
    assert!(e.to_string().contains("longer than the context 16"), "{e}");
    let bad = GptConfig { width: 30, heads: 4, ..tiny(5) };
    let Err(ModelError::InvalidConfig { field, .. }) = bad.init(&device) else { panic!("width 30 with 4 heads") };
    assert_eq!(field, "width");
    let huge = GptConfig { vocab_size: 1 << 40, ..tiny(5) };
    assert!(matches!(huge.validate(), Err(ModelError::InvalidConfig { field: "vocab_size", .. })));
}

#[test]
fn a_small_gpt_learns_a_repeating_sequence_with_burns_adamw() {
    let device = Device::flex().autodiff();
    device.seed(3);
    let mut model = tiny(7).init(&device).unwrap();
    let mut optim = AdamWConfig::new().with_weight_decay(0.0).init();
    // Period-7 sequence: every next token is determined by the current one.
    let seq: Vec<i64> = (0..17).map(|i| (i * 3) % 7).collect();
    let (x, y) = (tokens(&[&seq[..16]], &device), tokens(&[&seq[1..]], &device));
    let ce = CrossEntropyLossConfig::new().init(&device);
    let loss_of = |m: &qsr_models::Gpt| {
        let logits = m.forward(x.clone()).unwrap().reshape([16, 7]);
        ce.forward(logits, y.clone().reshape([16]))
    };
    let first: f32 = loss_of(&model).into_scalar();
    for _ in 0..60 {
        let loss = loss_of(&model);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(3e-3, model, grads);
    }
    let last: f32 = loss_of(&model).into_scalar();
    assert!(first > 1.5 && last < 0.2, "loss {first} -> {last}");
}
