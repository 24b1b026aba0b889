//! Configuration parsing and validation: errors name the field, nothing panics.

use burn::tensor::Device;
use qsr_models::{
    CifarResNetConfig, CifarShortcut, CnnConfig, InputSpec, MlpConfig, ModelConfig, ModelError, ResNetConfig,
    VitConfig, VitPreset,
};

fn parse(s: &str) -> Result<ModelConfig, toml::de::Error> {
    #[derive(serde::Deserialize)]
    struct Wrap {
        model: ModelConfig,
    }
    toml::from_str::<Wrap>(&format!("model = {s}")).map(|w| w.model)
}

fn init_err(cfg: &ModelConfig, input: InputSpec, classes: usize) -> ModelError {
    cfg.init(input, classes, &Device::flex()).expect_err("must be rejected")
}

#[test]
fn parses_the_documented_examples() {
    assert_eq!(
        parse(r#"{ kind = "resnet", depth = 18 }"#).unwrap(),
        ModelConfig::Resnet(ResNetConfig { depth: 18, zero_init_residual: false })
    );
    assert_eq!(
        parse(r#"{ kind = "resnet", depth = 50, zero_init_residual = true }"#).unwrap(),
        ModelConfig::Resnet(ResNetConfig { depth: 50, zero_init_residual: true })
    );
    assert_eq!(
        parse(r#"{ kind = "cifar-resnet", depth = 20 }"#).unwrap(),
        ModelConfig::CifarResnet(CifarResNetConfig { depth: 20, shortcut: CifarShortcut::A })
    );
    assert_eq!(
        parse(r#"{ kind = "cifar-resnet", depth = 56, shortcut = "b" }"#).unwrap(),
        ModelConfig::CifarResnet(CifarResNetConfig { depth: 56, shortcut: CifarShortcut::B })
    );
    assert_eq!(
        parse(r#"{ kind = "vit", preset = "b", patch_size = 16, image_size = 224 }"#).unwrap(),
        ModelConfig::Vit(VitConfig::preset(VitPreset::B, 16, 224))
    );
    assert_eq!(parse(r#"{ kind = "vit", preset = "tiny", image_size = 32 }"#).unwrap(), {
        ModelConfig::Vit(VitConfig::preset(VitPreset::Ti, 16, 32))
    });
    assert_eq!(
        parse(r#"{ kind = "cnn" }"#).unwrap(),
        ModelConfig::Cnn(CnnConfig { batch_norm: true, channels: [32, 64] })
    );
    assert_eq!(
        parse(r#"{ kind = "cnn", batch_norm = false }"#).unwrap(),
        ModelConfig::Cnn(CnnConfig { batch_norm: false, channels: [32, 64] })
    );
    assert_eq!(
        parse(r#"{ kind = "mlp", hidden = [256, 256] }"#).unwrap(),
        ModelConfig::Mlp(MlpConfig { hidden: vec![256, 256] })
    );
    assert_eq!(parse(r#"{ kind = "mlp" }"#).unwrap(), ModelConfig::Mlp(MlpConfig::default()));
    // JSON round trip
    let cfg = ModelConfig::Vit(VitConfig::preset(VitPreset::S, 8, 64));
    let json = serde_json::to_string(&cfg).unwrap();
    assert!(json.contains(r#""kind":"vit""#), "{json}");
    assert_eq!(serde_json::from_str::<ModelConfig>(&json).unwrap(), cfg);
}

#[test]
fn unknown_fields_and_kinds_are_rejected_by_name() {
    let e = parse(r#"{ kind = "resnet", depth = 18, zero_init = true }"#).unwrap_err().to_string();
    assert!(e.contains("zero_init"), "{e}");
    let e = parse(r#"{ kind = "cnn", batchnorm = false }"#).unwrap_err().to_string();
    assert!(e.contains("batchnorm"), "{e}");
    let e = parse(r#"{ kind = "mlp", hiden = [3] }"#).unwrap_err().to_string();
    assert!(e.contains("hiden"), "{e}");
    let e = parse(r#"{ kind = "resnet50" }"#).unwrap_err().to_string();
    assert!(e.contains("resnet50"), "{e}");
    let e = parse(r#"{ kind = "vit", preset = "huge" }"#).unwrap_err().to_string();
    assert!(e.contains("huge"), "{e}");
    let e = parse(r#"{ kind = "resnet" }"#).unwrap_err().to_string();
    assert!(e.contains("depth"), "{e}");
}

#[test]
fn bad_values_name_the_field() {
    let img = InputSpec::new(3, 32, 32);
    let e = ModelConfig::Resnet(ResNetConfig { depth: 19, zero_init_residual: false }).validate().unwrap_err();
    assert_eq!(e.field(), "depth");
    let msg = e.to_string();
    assert!(msg.contains("depth") && msg.contains("[18, 34, 50, 101, 152]") && msg.contains("19"), "{msg}");
    assert_eq!(
        init_err(&ModelConfig::Resnet(ResNetConfig { depth: 19, zero_init_residual: false }), img, 10).field(),
        "depth"
    );

    for depth in [0, 2, 19, 21] {
        let e = init_err(&ModelConfig::CifarResnet(CifarResNetConfig { depth, shortcut: CifarShortcut::A }), img, 10);
        assert_eq!(e.field(), "depth");
        assert!(e.to_string().contains("[20, 32, 44, 56, 110]"), "{e}");
    }

    // ViT: image size not divisible by the patch size, in the config or in the input
    let e = ModelConfig::Vit(VitConfig::preset(VitPreset::B, 16, 225)).validate().unwrap_err();
    assert_eq!(e.field(), "image_size");
    assert!(e.to_string().contains("patch_size 16"), "{e}");
    let e = init_err(&ModelConfig::Vit(VitConfig::preset(VitPreset::B, 16, 224)), img, 10);
    assert_eq!(e.field(), "image_size");
    let mut free = VitConfig::preset(VitPreset::Ti, 5, 0);
    free.image_size = None;
    let e = init_err(&ModelConfig::Vit(free.clone()), img, 10);
    assert_eq!(e.field(), "patch_size");
    free.patch_size = 0;
    assert_eq!(init_err(&ModelConfig::Vit(free), img, 10).field(), "patch_size");
    let mut odd = VitConfig::preset(VitPreset::Ti, 16, 32);
    odd.dim = Some(190);
    assert_eq!(init_err(&ModelConfig::Vit(odd), img, 10).field(), "dim");
    let mut zero_heads = VitConfig::preset(VitPreset::Ti, 16, 32);
    zero_heads.heads = Some(0);
    assert_eq!(init_err(&ModelConfig::Vit(zero_heads), img, 10).field(), "heads");
    let custom = parse(r#"{ kind = "vit", dim = 64, depth = 2, heads = 2 }"#).unwrap();
    assert_eq!(init_err(&custom, img, 10).field(), "mlp_dim");
    let custom =
        parse(r#"{ kind = "vit", dim = 64, depth = 2, heads = 2, mlp_dim = 128, dim_head = 16, patch_size = 8 }"#)
            .unwrap();
    assert!(custom.init(img, 10, &Device::flex()).is_ok());

    // small models and inputs
    assert_eq!(
        init_err(&ModelConfig::Cnn(CnnConfig { batch_norm: true, channels: [0, 8] }), img, 10).field(),
        "channels"
    );
    assert_eq!(init_err(&ModelConfig::Cnn(CnnConfig::default()), InputSpec::new(1, 3, 8), 10).field(), "input.height");
    assert_eq!(init_err(&ModelConfig::Mlp(MlpConfig { hidden: vec![8, 0] }), img, 10).field(), "hidden");
    assert_eq!(init_err(&ModelConfig::Mlp(MlpConfig::default()), img, 0).field(), "classes");
    assert_eq!(
        init_err(&ModelConfig::Mlp(MlpConfig::default()), InputSpec::new(0, 8, 8), 10).field(),
        "input.channels"
    );
    assert_eq!(init_err(&ModelConfig::Mlp(MlpConfig::default()), InputSpec::new(1, 8, 0), 10).field(), "input.width");
}

#[test]
fn widths_and_depths_above_the_limits_are_refused_before_allocating() {
    use qsr_models::{MAX_DEPTH, MAX_WIDTH};
    let mlp = ModelConfig::Mlp(MlpConfig { hidden: vec![1_000_000_000] });
    let e = mlp.validate().unwrap_err();
    assert_eq!(e.field(), "hidden");
    assert!(e.to_string().contains(&MAX_WIDTH.to_string()), "{e}");
    let deep = ModelConfig::Mlp(MlpConfig { hidden: vec![4; MAX_DEPTH + 1] });
    assert_eq!(deep.validate().unwrap_err().field(), "hidden");
    let cnn = ModelConfig::Cnn(CnnConfig { batch_norm: true, channels: [8, MAX_WIDTH + 1] });
    assert_eq!(cnn.validate().unwrap_err().field(), "channels");
    let mut vit = VitConfig::preset(VitPreset::Ti, 16, 32);
    vit.mlp_dim = Some(usize::MAX);
    assert_eq!(ModelConfig::Vit(vit).validate().unwrap_err().field(), "mlp_dim");
    // The limits themselves are accepted.
    ModelConfig::Mlp(MlpConfig { hidden: vec![MAX_WIDTH] }).validate().unwrap();
}
