//! The recipe's network: built once and copied to every worker, after a preflight of its size.

use anyhow::{Result, anyhow, bail};
use burn::module::Module;
use burn::tensor::{Device, Tensor};
use qsr_data::Split;
use qsr_models::{Gpt, GptConfig, InputSpec, Model};
use qsr_optim::{OptimizerKind, ParamLayout};

use super::task::{check_vocab, transform};
use crate::exit::bad_input;
use crate::recipe::{TrainRecipe, open_corpus, open_dataset};

/// A recipe's network, built once and copied to every worker.
// Built once per worker and moved into it at once: boxing would save nothing worth an indirection.
#[allow(clippy::large_enum_variant)]
pub(crate) enum TrainModel {
    /// An image classifier (`model.kind` resnet, cifar-resnet, vit, cnn, mlp).
    Image(Model),
    /// A language model (`model.kind = "gpt"`).
    Language(Gpt),
}

impl TrainModel {
    /// A copy for one more worker (image models get their own BatchNorm state).
    pub(crate) fn replica(&self) -> Self {
        match self {
            TrainModel::Image(m) => TrainModel::Image(m.deep_clone()),
            TrainModel::Language(m) => TrainModel::Language(m.clone()),
        }
    }

    /// Trainable parameters (BN running statistics excluded).
    pub(crate) fn trainable_params(&self) -> usize {
        match self {
            TrainModel::Image(m) => qsr_models::param_count(m),
            TrainModel::Language(m) => qsr_models::param_count(m),
        }
    }

    /// All float values of the module (parameters and BN running statistics).
    pub(crate) fn num_params(&self) -> usize {
        match self {
            TrainModel::Image(m) => m.num_params(),
            TrainModel::Language(m) => m.num_params(),
        }
    }
}

/// Input shape and class count an image recipe's model is built for; an error for a language model.
pub(super) fn input_spec(recipe: &TrainRecipe) -> Result<(InputSpec, usize)> {
    super::task::image_input(recipe)
}

/// Checks a run's inputs before anything large is built: the batch fits the training data for `k`
/// workers, the held-out split fits the model, and `replicas` copies of the model's training state fit
/// in this machine's memory (CPU runs).
pub(crate) fn preflight(recipe: &TrainRecipe, k: usize, replicas: usize, gpu: bool) -> Result<()> {
    let params = match recipe.model.as_gpt() {
        Some(gpt) => {
            let corpus = open_corpus(&recipe.data)?;
            check_vocab(gpt, &corpus)?;
            for rank in 0..k {
                qsr_data::TextWindows::new(&corpus, (gpt.context, recipe.train.local_batch), recipe.seed, rank, k)?;
            }
            super::task::text_steps_per_epoch(recipe, &corpus, gpt.context, k)?;
            if recipe.sync.streaming.is_some() {
                let model = gpt.init(&Device::flex()).map_err(|e| anyhow!("invalid `model.{}`: {e}", e.field()))?;
                check_fragments(recipe, &ParamLayout::of(&model))?;
            }
            gpt_params(gpt)
        }
        None => {
            let model = preflight_images(recipe, k)?;
            check_fragments(recipe, &ParamLayout::of(&model))?;
            model.num_params()
        }
    };
    if !gpu {
        check_memory(recipe, params, replicas)?;
    }
    Ok(())
}

/// Parameters of a GPT config, counted without building it: embeddings, blocks, final LayerNorm.
fn gpt_params(c: &GptConfig) -> usize {
    let (w, b) = (c.width, usize::from(c.bias));
    let block =
        2 * (w + b * w) + (3 * w * w + b * 3 * w) + (w * w + b * w) + (4 * w * w + b * 4 * w) + (4 * w * w + b * w);
    c.vocab_size * w + c.context * w + c.layers * block + (w + b * w)
}

/// The image checks of [`preflight`]; returns the model, built lazily on the host (its parameters
/// have shapes, but no memory yet).
fn preflight_images(recipe: &TrainRecipe, k: usize) -> Result<Model> {
    let train = open_dataset(&recipe.data, Split::Train)?;
    let test = open_dataset(&recipe.data, Split::Test)?;
    if test.is_empty() {
        bail!(
            "`data`: the test split of {} is empty, so the run could never evaluate: give it test images (a run without an evaluation has no result)",
            test.info().name
        );
    }
    super::task::sampler(recipe, train.len(), k, 0)?;
    if let Some(n) = recipe.eval.train_items.filter(|&n| n > train.len()) {
        bail!("invalid `eval.train_items`: {n}, more than the {} training images", train.len());
    }
    let shape = transform(recipe, train.info(), true).output_shape(train.info())?;
    let test_shape = transform(recipe, test.info(), false).output_shape(test.info())?;
    if shape != test_shape {
        bail!(
            "`data`: the test images of {} become {test_shape:?} (channels, height, width) but the training images {shape:?}: the model needs one input shape",
            test.info().name
        );
    }
    if test.classes() > train.classes() {
        bail!(
            "`data`: the test split of {} has {} classes, the training split only {}",
            test.info().name,
            test.classes(),
            train.classes()
        );
    }
    recipe
        .model
        .init(InputSpec::new(shape.0, shape.1, shape.2), train.classes(), &Device::flex())
        .map_err(|e| anyhow!("invalid `model.{}`: {e}", e.field()))
}

/// Refuses a model whose training state (`replicas` times: module, gradients, flat parameters and
/// gradients, optimizer moments, the outer optimizer's global parameters and momentum) exceeds the memory the kernel says is available.
fn check_memory(recipe: &TrainRecipe, params: usize, replicas: usize) -> Result<()> {
    let Some(available) = mem_available() else {
        return Ok(());
    };
    let o = &recipe.optimizer;
    let moments = match o.kind {
        OptimizerKind::Adamw | OptimizerKind::Muon => 2,
        OptimizerKind::Sgd => usize::from(o.momentum() != 0.0),
    };
    // The outer optimizer keeps the global parameters and a momentum buffer.
    let outer = if recipe.outer.is_some() { 2 } else { 0 };
    let copies = 4 + moments + outer;
    let need = (params as u128) * 4 * copies as u128 * replicas as u128;
    if need > available as u128 {
        let gib = |b: u128| b as f64 / f64::from(1u32 << 30);
        bail!(
            "invalid `model`: {params} parameters need about {:.1} GiB ({replicas} worker(s) x {copies} f32 copies: module, gradients, flat parameters, flat gradients, optimizer moments, outer state), but only {:.1} GiB of memory is available (MemAvailable in /proc/meminfo)",
            gib(need),
            gib(available as u128)
        );
    }
    Ok(())
}

fn mem_available() -> Option<u64> {
    let text = qsr_files::read_text(std::path::Path::new("/proc/meminfo"), 1 << 16, "memory status").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Builds the model of a recipe on `device` (seeded, so every process builds the same one).
pub(crate) fn build_model(recipe: &TrainRecipe, device: &Device) -> Result<TrainModel> {
    device.seed(recipe.seed);
    let bad = |e: qsr_models::ModelError| bad_input(anyhow!("invalid `model.{}`: {e}", e.field()));
    // Parameters are created lazily; one forward materializes them now, under this seed.
    if let Some(gpt) = recipe.model.as_gpt() {
        let model = gpt.init(device).map_err(bad)?;
        let probe = Tensor::<2, burn::tensor::Int>::zeros([1, 1], device);
        model.valid().forward(probe.inner()).map_err(bad)?;
        check_fragments(recipe, &ParamLayout::of(&model))?;
        return Ok(TrainModel::Language(model));
    }
    let (input, classes) = input_spec(recipe)?;
    let model = recipe.model.init(input, classes, device).map_err(bad)?;
    let probe = Tensor::<4>::zeros([1, input.channels, input.height, input.width], device);
    let _ = model.valid().forward(probe.inner());
    check_fragments(recipe, &ParamLayout::of(&model))?;
    Ok(TrainModel::Image(model))
}

/// Refuses more `sync.streaming.fragments` than the model has trainable tensors, as bad input: in
/// [`preflight`], before any worker starts, and in [`build_model`] (the recipe alone does not know
/// the model's tensors).
fn check_fragments(recipe: &TrainRecipe, layout: &ParamLayout) -> Result<()> {
    let Some(streaming) = &recipe.sync.streaming else { return Ok(()) };
    let sizes: Vec<u64> = layout.trainable.iter().map(|e| e.range.len() as u64).collect();
    qsr_sched::split_tensors(&sizes, streaming.fragments).map_err(|e| bad_input(anyhow!("{e}")))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt_params_counts_what_the_built_model_has() {
        for (bias, layers) in [(true, 2), (false, 3)] {
            let c = GptConfig { bias, layers, ..GptConfig::char_small(65) };
            let device = Device::flex();
            let model = c.init(&device).unwrap();
            let _ = model.forward(Tensor::<2, burn::tensor::Int>::zeros([1, 1], &device).inner());
            assert_eq!(gpt_params(&c), qsr_models::param_count(&model), "bias {bias}");
        }
    }
}
