//! BN helpers the optimizer crate relies on: finding BN layers, running-stat ids, momentum,
//! reset, and replicas with their own running statistics.

use crate::common::images;
use burn::module::Module;
use burn::tensor::Device;
use qsr_models::{
    CifarResNetConfig, CifarShortcut, CnnConfig, InputSpec, Model, ModelConfig, ResNetConfig, bn_running_stat_ids,
    trainable_param_ids,
};

fn means(m: &Model) -> Vec<Vec<f32>> {
    let mut v = Vec::new();
    m.for_each_batch_norm(|bn| v.push(bn.running_mean.value_sync().into_data().try_to_vec::<f32>().unwrap()));
    v
}

fn vars(m: &Model) -> Vec<Vec<f32>> {
    let mut v = Vec::new();
    m.for_each_batch_norm(|bn| v.push(bn.running_var.value_sync().into_data().try_to_vec::<f32>().unwrap()));
    v
}

fn is_reset(m: &Model) -> bool {
    means(m).iter().flatten().all(|&x| x == 0.0) && vars(m).iter().flatten().all(|&x| x == 1.0)
}

#[test]
fn bn_layers_are_found() {
    let d = Device::flex();
    let r18 = ModelConfig::Resnet(ResNetConfig { depth: 18, zero_init_residual: true })
        .init(InputSpec::new(3, 32, 32), 10, &d)
        .unwrap();
    // stem + 8 blocks x 2 + 3 downsample
    assert_eq!(r18.batch_norm_count(), 1 + 16 + 3);
    let r50 = ModelConfig::Resnet(ResNetConfig { depth: 50, zero_init_residual: false })
        .init(InputSpec::new(3, 32, 32), 10, &d)
        .unwrap();
    assert_eq!(r50.batch_norm_count(), 1 + 16 * 3 + 4);
    let c20 = ModelConfig::CifarResnet(CifarResNetConfig { depth: 20, shortcut: CifarShortcut::A })
        .init(InputSpec::new(3, 32, 32), 10, &d)
        .unwrap();
    assert_eq!(c20.batch_norm_count(), 19);
    // zero_init_residual: exactly the last BN of every block starts with gamma = 0
    let mut zero = 0;
    r18.for_each_batch_norm(|bn| {
        if bn.gamma.val().into_data().try_to_vec::<f32>().unwrap().iter().all(|&g| g == 0.0) {
            zero += 1;
        }
    });
    assert_eq!(zero, 8);
    // the id lists partition the visited floats and never overlap
    let stats = bn_running_stat_ids(&c20);
    let params = trainable_param_ids(&c20);
    assert!(stats.iter().all(|id| !params.contains(id)));
}

#[test]
fn running_stats_update_reset_momentum_and_replicas() {
    let d = Device::flex().autodiff();
    d.seed(7);
    let mut m = ModelConfig::Cnn(CnnConfig::default()).init(InputSpec::new(1, 8, 8), 10, &d).unwrap();
    assert!(m.has_batch_norm() && is_reset(&m));
    let ids_before = bn_running_stat_ids(&m);

    let x = images(8, 1, 8, 8, 11, &d);
    let _ = m.forward(x.clone());
    assert!(!is_reset(&m), "a training forward updates the running stats");

    // replicas: clone() shares the running state (burn keeps it behind an Arc), deep_clone() not
    let before = means(&m);
    let mut replica = m.deep_clone();
    replica.reset_bn_running_stats();
    assert!(is_reset(&replica) && !is_reset(&m));
    let _ = replica.forward(x.clone());
    let _ = replica.forward(x.clone());
    assert_eq!(means(&m), before, "a deep clone's updates stay in the deep clone");
    assert_ne!(means(&replica), before);
    let shared = m.clone();
    let _ = shared.forward(x.clone());
    assert_ne!(means(&m), before, "burn's clone() shares running stats");

    // reset keeps ids; momentum 1 makes the running stats the last batch's statistics
    m.reset_bn_running_stats();
    assert!(is_reset(&m));
    assert_eq!(bn_running_stat_ids(&m), ids_before);
    m.set_bn_momentum(1.0).unwrap();
    let _ = m.forward(x.clone());
    let once = means(&m);
    let _ = m.forward(x.clone());
    assert_eq!(means(&m), once);
    let mut momenta = Vec::new();
    m.for_each_batch_norm(|bn| momenta.push(bn.momentum));
    assert_eq!(momenta, vec![1.0, 1.0]);
    assert_eq!(m.set_bn_momentum(1.5).unwrap_err().field(), "momentum");
    assert!(m.set_bn_momentum(f64::NAN).is_err());

    // momentum 0 freezes them
    m.set_bn_momentum(0.0).unwrap();
    let _ = m.forward(images(8, 1, 8, 8, 99, &d));
    assert_eq!(means(&m), once);

    // evaluation uses the running stats and is deterministic
    let eval = m.valid();
    let a = eval.forward(x.clone().without_autodiff()).into_data();
    let b = eval.forward(x.without_autodiff()).into_data();
    assert_eq!(a, b);
}
