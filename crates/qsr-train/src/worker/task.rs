//! What a run trains on: images (classification) or text (next-token prediction). The training loop in
//! `train.rs` is one generic function over [`Task`]; each task owns its data, its loss and its evaluation.

use std::sync::Arc;

use anyhow::{Context, Result, anyhow, bail};
use burn::module::Module;
use burn::nn::loss::{CrossEntropyLoss, CrossEntropyLossConfig};
use burn::tensor::{Device, Int, Tensor, TensorData};
use qsr_comm::ReduceOp;
use qsr_data::{
    Corpus, EvalLoader, HostBatch, Normalize, PrefetchOptions, Prefetcher, SamplerConfig, ShardedSampler, Split,
    TextWindows, TrainLoader, Transform,
};
use qsr_models::{Gpt, GptConfig, InputSpec, Model, fused};
use qsr_optim::{BnPolicy, StepReport, Worker};

use crate::recipe::{TrainRecipe, open_corpus, open_dataset};
use crate::records::Fit;

/// A held-out evaluation: top-1 accuracy (of the class, or of the next token) and mean loss; with
/// `eval.train_items` the same over training images.
pub(crate) struct Eval {
    pub(crate) accuracy: f64,
    pub(crate) loss: f64,
    pub(crate) train: Option<Fit>,
}

/// The sizes of a task's data, the same on every rank of a run.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub(crate) struct DataSize {
    /// Training items (images, or text tokens).
    pub(crate) train: usize,
    /// Held-out items (test images, or validation tokens).
    pub(crate) test: usize,
}

/// One kind of training data with its loss and evaluation.
pub(crate) trait Task {
    /// The network the task trains.
    type Module: Module;
    /// This rank's training batches from a given step on.
    type Batches;
    /// Steps per epoch of this rank's data.
    fn steps_per_epoch(&self) -> usize;
    /// The sizes of the whole data every rank shards (training and held-out items, or text tokens),
    /// which every rank must share.
    fn data_size(&self) -> DataSize;
    /// The batches from `first_step` to `end_step`.
    fn batches(&self, first_step: u64, end_step: u64) -> Result<Self::Batches>;
    /// One optimizer step of `worker` on the next batch, split into the recipe's micro-batches.
    fn train_step(&self, worker: &mut Worker<Self::Module>, batches: &mut Self::Batches) -> Result<StepReport>;
    /// Work before an evaluation after the sync that completed `done_steps` steps (BN re-estimation).
    fn prepare_eval(&self, worker: &mut Worker<Self::Module>, done_steps: u64) -> Result<()>;
    /// The evaluation of the held-out split: every rank its shard, one all-reduce.
    fn evaluate(&self, worker: &mut Worker<Self::Module>) -> Result<Eval>;
    /// The line rank 0 prints after an evaluation.
    fn describe(&self, ev: &Eval) -> String;
    /// The loss of a predictor that ignores its input, when the task defines one (text: the unigram
    /// entropy of the training tokens, in nats).
    fn unigram_entropy(&self) -> Option<f64>;
    /// The loss of a model that predicts every class (or token) alike, `ln(classes)`: where a freshly
    /// initialised model starts, and what divergence is measured against.
    fn chance_loss(&self) -> f64;
    /// A classifier's accuracy at chance, `1 / classes`; `None` for a language model (judged by its loss).
    fn chance_accuracy(&self) -> Option<f64>;
}

/// Image classification: the authors' sharded sampler, augmentation, BN re-estimation, test accuracy.
pub(crate) struct ImageTask {
    recipe: TrainRecipe,
    device: Device,
    loader: TrainLoader,
    eval_loader: EvalLoader,
    /// This rank's shard of the `eval.train_items` training images, without augmentation.
    train_eval_loader: Option<EvalLoader>,
    spe: usize,
    size: DataSize,
    has_bn: bool,
    /// The momentum the model's BatchNorm layers train with, restored after a re-estimation.
    bn_momentum: f64,
    ce: CrossEntropyLoss,
    classes: usize,
}

/// The transform of a recipe's images (train-time augmentation or normalization only; evaluation).
pub(crate) fn transform(recipe: &TrainRecipe, info: &qsr_data::DatasetInfo, train: bool) -> Transform {
    if !train {
        Transform::eval_default(info)
    } else if recipe.data.augment {
        Transform::train_default(info)
    } else {
        Transform::normalize_only(Normalize::for_dataset(info))
    }
}

/// This rank's sampler; the error says why the batch does not fit.
pub(crate) fn sampler(recipe: &TrainRecipe, len: usize, k: usize, rank: usize) -> Result<ShardedSampler> {
    ShardedSampler::new(SamplerConfig {
        len,
        world_size: k,
        rank,
        local_batch: recipe.train.local_batch,
        steps_per_epoch: None,
        seed: recipe.seed,
    })
    .with_context(|| format!("`train.local_batch` {} x {k} workers vs {len} training images", recipe.train.local_batch))
}

fn label_smoothing(recipe: &TrainRecipe) -> Option<f32> {
    let s = recipe.train.label_smoothing;
    (s > 0.0).then_some(s)
}

fn cross_entropy(recipe: &TrainRecipe, device: &Device) -> CrossEntropyLoss {
    CrossEntropyLossConfig::new().with_smoothing(label_smoothing(recipe)).init(device)
}

impl ImageTask {
    /// This rank's loaders, and the BatchNorm facts of `model` (read before the worker takes it).
    pub(crate) fn new(recipe: &TrainRecipe, model: &Model, rank: usize, k: usize, device: &Device) -> Result<Self> {
        let train_set = open_dataset(&recipe.data, Split::Train)?;
        let test_set = open_dataset(&recipe.data, Split::Test)?;
        let info = train_set.info().clone();
        let size = DataSize { train: train_set.len(), test: test_set.len() };
        let sampler = sampler(recipe, train_set.len(), k, rank)?;
        let spe = sampler.steps_per_epoch();
        let eval_loader = |set| -> Result<EvalLoader> {
            Ok(EvalLoader::new(set, transform(recipe, &info, false), recipe.eval.batch_size)?.shard(rank, k)?)
        };
        let train_eval_loader = match recipe.eval.train_items {
            Some(n) => Some(eval_loader(Arc::new(
                qsr_data::Spread::new(Arc::clone(&train_set), n)
                    .map_err(|e| anyhow!("invalid `eval.train_items`: {e}"))?,
            ))?),
            None => None,
        };
        let eval_loader = eval_loader(test_set)?;
        let loader = TrainLoader::new(train_set, sampler, transform(recipe, &info, true))?;
        let mut bn_momentum = 0.1;
        model.for_each_batch_norm(|bn| bn_momentum = bn.momentum);
        Ok(Self {
            recipe: recipe.clone(),
            device: device.clone(),
            loader,
            eval_loader,
            train_eval_loader,
            spe,
            size,
            has_bn: model.has_batch_norm(),
            bn_momentum,
            ce: cross_entropy(recipe, device),
            classes: info.classes,
        })
    }

    /// `[correct, loss sum, count]` of this rank's shard of `loader`, at most `limit` items (rounded up
    /// to a whole batch).
    fn score(&self, loader: &EvalLoader, worker: &Worker<Model>, limit: usize) -> Result<[f32; 3]> {
        let model = worker.model().valid();
        let inner = self.device.clone().inner();
        let ce = CrossEntropyLossConfig::new().init(&inner);
        let mut acc = [0.0f32; 3]; // correct, loss sum, count
        for host in loader.iter() {
            if acc[2] as usize >= limit {
                break;
            }
            let host = host?;
            let n = host.len();
            let b = host.into_batch(&inner);
            let logits = model.forward(b.images);
            let loss: f32 = ce.forward(logits.clone(), b.labels.clone()).into_scalar();
            let correct: i64 = logits.argmax(1).squeeze_dim::<1>(1).equal(b.labels).int().sum().into_scalar();
            acc[0] += correct as f32;
            acc[1] += loss * n as f32;
            acc[2] += n as f32;
        }
        Ok(acc)
    }

    /// The paper's BatchNorm re-estimation: reset the statistics, run `bn_images / K` training images per
    /// worker with momentum 1/(1+i) for micro-batch i (a cumulative average), then average across workers.
    fn reestimate_bn(&self, worker: &mut Worker<Model>, step: u64) -> Result<()> {
        let per_worker = self.recipe.eval.bn_images.div_ceil(worker.world_size()).max(1);
        let micro = self.recipe.micro_batch();
        let mut model = worker.model().deep_clone();
        model.reset_bn_running_stats();
        let (mut seen, mut i, mut t) = (0usize, 0usize, step);
        while seen < per_worker {
            for part in self.loader.host_batch(t)?.split(micro)? {
                if seen >= per_worker {
                    break;
                }
                model.set_bn_momentum(1.0 / (1.0 + i as f64)).map_err(|e| anyhow!("{e}"))?;
                let _ = model.forward(part.to_batch(&self.device).images);
                seen += part.len();
                i += 1;
            }
            t += 1;
        }
        model.set_bn_momentum(self.bn_momentum).map_err(|e| anyhow!("{e}"))?;
        worker.set_model(model)?;
        worker.average_running_stats()?;
        Ok(())
    }
}

impl Task for ImageTask {
    type Module = Model;
    type Batches = Prefetcher;

    fn steps_per_epoch(&self) -> usize {
        self.spe
    }

    fn data_size(&self) -> DataSize {
        self.size
    }

    fn batches(&self, first_step: u64, end_step: u64) -> Result<Prefetcher> {
        let options = PrefetchOptions { depth: self.recipe.data.prefetch, threads: Some(1), end_step: Some(end_step) };
        Ok(self.loader.prefetch(first_step, options)?)
    }

    fn train_step(&self, worker: &mut Worker<Model>, batches: &mut Prefetcher) -> Result<StepReport> {
        let host = batches.next().ok_or_else(|| anyhow!("the data loader ended early"))??;
        let micro = self.recipe.micro_batch();
        let micros: Vec<HostBatch> = if micro == host.len() { vec![host] } else { host.split(micro)? };
        let report = worker.step(|m: &Model, j| {
            let b = micros[j].to_batch(&self.device);
            Ok(self.ce.forward(m.forward(b.images), b.labels))
        })?;
        Ok(report)
    }

    fn prepare_eval(&self, worker: &mut Worker<Model>, done_steps: u64) -> Result<()> {
        if self.has_bn && self.recipe.driver.bn == BnPolicy::Reestimate {
            self.reestimate_bn(worker, done_steps)?;
        }
        Ok(())
    }

    fn evaluate(&self, worker: &mut Worker<Model>) -> Result<Eval> {
        let limit = self.recipe.eval.max_items.map_or(usize::MAX, |m| m.div_ceil(worker.world_size()));
        let mut ev = reduce_eval(worker, self.score(&self.eval_loader, worker, limit)?)?;
        if let Some(loader) = &self.train_eval_loader {
            let train = reduce_eval(worker, self.score(loader, worker, usize::MAX)?)?;
            ev.train = Some(Fit { accuracy: train.accuracy, loss: train.loss });
        }
        Ok(ev)
    }

    fn describe(&self, ev: &Eval) -> String {
        let train = ev.train.map_or(String::new(), |t| {
            format!("  train accuracy {:.2}%  train loss {:.4}", 100.0 * t.accuracy, t.loss)
        });
        format!("test accuracy {:.2}%  test loss {:.4}{train}", 100.0 * ev.accuracy, ev.loss)
    }

    fn unigram_entropy(&self) -> Option<f64> {
        None
    }

    fn chance_loss(&self) -> f64 {
        (self.classes.max(1) as f64).ln()
    }

    fn chance_accuracy(&self) -> Option<f64> {
        Some(1.0 / self.classes.max(1) as f64)
    }
}

/// Sums `[correct, loss sum, count]` over the ranks into an [`Eval`].
fn reduce_eval<M: Module>(worker: &mut Worker<M>, mut acc: [f32; 3]) -> Result<Eval> {
    let step = worker.cursor().step();
    worker.comm_mut().all_reduce(&mut acc, ReduceOp::Sum).with_context(|| format!("evaluation at step {step}"))?;
    let n = f64::from(acc[2].max(1.0));
    Ok(Eval { accuracy: f64::from(acc[0]) / n, loss: f64::from(acc[1]) / n, train: None })
}

/// Next-token prediction on a character corpus: windows of `context + 1` tokens from the rank's shard,
/// cross-entropy at every position, validation loss on fixed windows of the held-out tail.
pub(crate) struct TextTask {
    recipe: TrainRecipe,
    device: Device,
    corpus: Arc<Corpus>,
    context: usize,
    rank: usize,
    world: usize,
    /// Steps per epoch: the training tokens over the tokens one step of all workers predicts.
    spe: usize,
    size: DataSize,
    /// This rank's validation windows (their start offsets in the validation tokens).
    eval_starts: Vec<usize>,
    /// `train.label_smoothing` of the training loss (evaluation takes none).
    smoothing: Option<f32>,
}

/// Steps per epoch of a text run: training tokens over the tokens a step of all workers predicts.
pub(crate) fn text_steps_per_epoch(recipe: &TrainRecipe, corpus: &Corpus, context: usize, k: usize) -> Result<usize> {
    let per_step = recipe.train.local_batch.saturating_mul(context).saturating_mul(k);
    let spe = corpus.train().len() / per_step.max(1);
    if spe == 0 {
        bail!(
            "`train.local_batch` {} windows x model.context {context} x {k} workers predict more tokens per step than the {} training tokens of {}",
            recipe.train.local_batch,
            corpus.train().len(),
            corpus.name()
        );
    }
    Ok(spe)
}

impl TextTask {
    /// The corpus, this rank's validation windows, and the checks that every rank's windows fit.
    pub(crate) fn new(recipe: &TrainRecipe, gpt: &GptConfig, rank: usize, k: usize, device: &Device) -> Result<Self> {
        let corpus = Arc::new(open_corpus(&recipe.data)?);
        check_vocab(gpt, &corpus)?;
        let context = gpt.context;
        TextWindows::new(&corpus, (context, recipe.train.local_batch), recipe.seed, rank, k)?;
        let size = DataSize { train: corpus.train().len(), test: corpus.valid().len() };
        let spe = text_steps_per_epoch(recipe, &corpus, context, k)?;
        let max = recipe.eval.max_items.unwrap_or(usize::MAX);
        let eval_starts = qsr_data::eval_window_starts(corpus.valid(), context, max, rank, k);
        if qsr_data::eval_window_starts(corpus.valid(), context, max, 0, 1).is_empty() {
            bail!(
                "`data`: the {} validation tokens of {} hold no window of model.context + 1 = {} tokens",
                corpus.valid().len(),
                corpus.name(),
                context + 1
            );
        }
        Ok(Self {
            recipe: recipe.clone(),
            device: device.clone(),
            corpus,
            context,
            rank,
            world: k,
            spe,
            size,
            eval_starts,
            smoothing: label_smoothing(recipe),
        })
    }

    fn windows(&self) -> Result<TextWindows<'_>> {
        let shape = (self.context, self.recipe.train.local_batch);
        Ok(TextWindows::new(&self.corpus, shape, self.recipe.seed, self.rank, self.world)?)
    }

    /// `[rows, context]` token ids of `tokens` (row-major) on `device`.
    fn ids(&self, tokens: &[u32], device: &Device) -> Tensor<2, Int> {
        let ids: Vec<i64> = tokens.iter().map(|&t| i64::from(t)).collect();
        let rows = ids.len() / self.context;
        Tensor::from_data(TensorData::new(ids, [rows, self.context]), device)
    }

    /// Mean next-token loss of `model` on `inputs` / `targets` (`[rows, context]` each) and its logits.
    fn loss(
        &self,
        model: &Gpt,
        smoothing: Option<f32>,
        inputs: &[u32],
        targets: &[u32],
        device: &Device,
    ) -> Result<(Tensor<1>, Tensor<2>)> {
        let logits = model.forward(self.ids(inputs, device))?;
        let [b, t, v] = logits.dims();
        let logits = logits.reshape([b * t, v]);
        let targets = self.ids(targets, device).reshape([b * t]);
        Ok((fused::cross_entropy(logits.clone(), targets, smoothing), logits))
    }
}

/// Refuses a vocabulary smaller than the corpus's, naming `model.vocab_size`.
pub(crate) fn check_vocab(gpt: &GptConfig, corpus: &Corpus) -> Result<()> {
    if gpt.vocab_size < corpus.vocab().len() {
        bail!(
            "invalid `model.vocab_size`: {} is smaller than the {} characters of {} (leave it out to take the corpus's)",
            gpt.vocab_size,
            corpus.vocab().len(),
            corpus.name()
        );
    }
    Ok(())
}

impl Task for TextTask {
    type Module = Gpt;
    type Batches = ();

    fn steps_per_epoch(&self) -> usize {
        self.spe
    }

    fn data_size(&self) -> DataSize {
        self.size
    }

    fn batches(&self, _first_step: u64, _end_step: u64) -> Result<()> {
        Ok(())
    }

    fn train_step(&self, worker: &mut Worker<Gpt>, _: &mut ()) -> Result<StepReport> {
        let batch = self.windows()?.batch(worker.cursor().step());
        let span = self.recipe.micro_batch() * self.context;
        let report = worker.step(|m: &Gpt, j| {
            let part = j * span..(j + 1) * span;
            let (loss, _) =
                self.loss(m, self.smoothing, &batch.inputs[part.clone()], &batch.targets[part], &self.device)?;
            Ok(loss)
        })?;
        Ok(report)
    }

    fn prepare_eval(&self, _: &mut Worker<Gpt>, _: u64) -> Result<()> {
        Ok(())
    }

    fn evaluate(&self, worker: &mut Worker<Gpt>) -> Result<Eval> {
        let model = worker.model().valid();
        let inner = self.device.clone().inner();
        let valid = self.corpus.valid();
        let mut acc = [0.0f32; 3]; // correct, loss sum, tokens
        for starts in self.eval_starts.chunks(self.recipe.eval.batch_size) {
            let (mut inputs, mut targets) = (Vec::new(), Vec::new());
            for &s in starts {
                inputs.extend_from_slice(&valid[s..s + self.context]);
                targets.extend_from_slice(&valid[s + 1..s + 1 + self.context]);
            }
            let (loss, logits) = self.loss(&model, None, &inputs, &targets, &inner)?;
            let n = targets.len();
            let truth = self.ids(&targets, &inner).reshape([n]);
            let correct: i64 = logits.argmax(1).squeeze_dim::<1>(1).equal(truth).int().sum().into_scalar();
            acc[0] += correct as f32;
            let loss: f32 = loss.into_scalar();
            acc[1] += loss * n as f32;
            acc[2] += n as f32;
        }
        reduce_eval(worker, acc)
    }

    fn describe(&self, ev: &Eval) -> String {
        format!(
            "validation loss {:.4} nats (perplexity {:.2}; unigram entropy {:.4})  next-token accuracy {:.2}%",
            ev.loss,
            ev.loss.exp(),
            self.corpus.unigram_entropy(),
            100.0 * ev.accuracy
        )
    }

    fn unigram_entropy(&self) -> Option<f64> {
        Some(self.corpus.unigram_entropy())
    }

    fn chance_accuracy(&self) -> Option<f64> {
        None
    }

    fn chance_loss(&self) -> f64 {
        let vocab = self.recipe.model.as_gpt().map_or(self.corpus.vocab().len(), |g| g.vocab_size);
        (vocab.max(1) as f64).ln()
    }
}

/// The input shape and class count an image recipe's model is built for.
pub(crate) fn image_input(recipe: &TrainRecipe) -> Result<(InputSpec, usize)> {
    let train = open_dataset(&recipe.data, Split::Train)?;
    let (c, h, w) = transform(recipe, train.info(), true).output_shape(train.info())?;
    Ok((InputSpec::new(c, h, w), train.classes()))
}
