//! SimpleViT against vit-pytorch 1.2.8 itself: a tiny model (non-square 8x12 image, patch 4,
//! dim 16, depth 2, heads 2, dim_head 8, mlp 32, 3 channels, 5 classes) with the reference's
//! weights must give the reference's logits. fixtures/gen_simple_vit.py regenerates the fixture.

use burn::module::Param;
use burn::nn::{LayerNorm, Linear};
use burn::tensor::{Device, Tensor, TensorData};
use qsr_models::{InputSpec, Model, ModelConfig, posemb_sincos_2d};
use serde_json::Value;

fn load() -> Value {
    let s = include_str!("../fixtures/simple_vit_ref.json");
    serde_json::from_str(s).expect("fixture parses")
}

fn tensor<const D: usize>(v: &Value, d: &Device) -> Tensor<D> {
    let shape: Vec<usize> = v["shape"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect();
    let data: Vec<f32> = v["data"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
    Tensor::from_data(TensorData::new(data, shape), d)
}

fn set_ln(ln: &mut LayerNorm, p: &Value, key: &str, d: &Device) {
    ln.gamma = Param::from_tensor(tensor(&p[format!("{key}.weight")], d));
    ln.beta = Some(Param::from_tensor(tensor(&p[format!("{key}.bias")], d)));
}

/// PyTorch stores Linear weights as [out, in], burn as [in, out].
fn set_linear(l: &mut Linear, p: &Value, key: &str, d: &Device) {
    l.weight = Param::from_tensor(tensor::<2>(&p[format!("{key}.weight")], d).transpose());
    l.bias = p.get(format!("{key}.bias")).map(|b| Param::from_tensor(tensor(b, d)));
}

#[test]
fn matches_vit_pytorch_simple_vit() {
    let d = Device::flex();
    let r = load();
    let p = &r["params"];
    let cfg: ModelConfig =
        serde_json::from_str(r#"{"kind":"vit","dim":16,"depth":2,"heads":2,"dim_head":8,"mlp_dim":32,"patch_size":4}"#)
            .unwrap();
    let Model::Vit(mut v) = cfg.init(InputSpec::new(3, 8, 12), 5, &d).unwrap() else { panic!("not a vit") };

    // position embedding
    let pos = tensor::<2>(&r["pos_embedding"], &d);
    let ours = Tensor::<2>::from_data(posemb_sincos_2d(2, 3, 16, 10_000.0), &d);
    ours.clone().into_data().assert_approx_eq::<f32>(&pos.into_data(), burn::tensor::Tolerance::absolute(1e-6));
    ours.into_data()
        .assert_approx_eq::<f32>(&v.pos_embedding.clone().into_data(), burn::tensor::Tolerance::absolute(0.0));

    set_ln(&mut v.patch_norm1, p, "to_patch_embedding.1", &d);
    set_linear(&mut v.patch_linear, p, "to_patch_embedding.2", &d);
    set_ln(&mut v.patch_norm2, p, "to_patch_embedding.3", &d);
    for (i, b) in v.blocks.iter_mut().enumerate() {
        set_ln(&mut b.attn.norm, p, &format!("transformer.layers.{i}.0.norm"), &d);
        set_linear(&mut b.attn.to_qkv, p, &format!("transformer.layers.{i}.0.to_qkv"), &d);
        set_linear(&mut b.attn.to_out, p, &format!("transformer.layers.{i}.0.to_out"), &d);
        set_ln(&mut b.ff.norm, p, &format!("transformer.layers.{i}.1.net.0"), &d);
        set_linear(&mut b.ff.fc1, p, &format!("transformer.layers.{i}.1.net.1"), &d);
        set_linear(&mut b.ff.fc2, p, &format!("transformer.layers.{i}.1.net.3"), &d);
    }
    set_ln(&mut v.head_norm, p, "linear_head.0", &d);
    set_linear(&mut v.head, p, "linear_head.1", &d);
    assert_eq!(
        qsr_models::param_count(&v),
        p.as_object().unwrap().values().map(|t| t["data"].as_array().unwrap().len()).sum::<usize>()
    );

    let y = v.forward(tensor::<4>(&r["input"], &d));
    let expected = tensor::<2>(&r["logits"], &d);
    y.into_data().assert_approx_eq::<f32>(&expected.into_data(), burn::tensor::Tolerance::absolute(1e-4));
}
