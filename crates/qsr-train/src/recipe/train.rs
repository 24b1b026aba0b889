//! The full training recipe (documented on [`TrainRecipe`]).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use qsr_data::Split;
use qsr_models::ModelConfig;
use qsr_optim::{DriverConfig, Face, OptimizerConfig, OptimizerKind, OuterConfig, Residency, SyncSettings, check_sync};
use qsr_sched::{LrSchedule, Plan};

use serde::{Deserialize, Serialize};

use qsr_sched::SyncSection;
use toml::{Table, Value};

use super::errors::{check, name_error};

/// Which dataset, and where.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// Images: digits (embedded), fashion-mnist, mnist, cifar10, cifar100, imagefolder. Text (for
    /// `model.kind = "gpt"`): shakespeare (the 38 plays of `scripts/fetch-shakespeare.sh`),
    /// comedy-of-errors (embedded), text (one UTF-8 file at `data.path`).
    pub dataset: String,
    /// Directory of the files (not used by `digits` and `comedy-of-errors`; Fashion-MNIST and Shakespeare
    /// default to the paths their set-up commands install to); the file itself for `text`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// Train-time augmentation (the dataset's default crop/flip); off = normalization only.
    #[serde(default = "yes")]
    pub augment: bool,
    /// Prefetched batches per worker.
    #[serde(default = "three")]
    pub prefetch: usize,
    /// Train on this many training images spread evenly over the training split (every `len / N`-th),
    /// e.g. a long study of many epochs on a small set; default all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_items: Option<usize>,
}

/// Batch sizes, run length, loss.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// K: simulated workers (`--workers`), or the world size a launch must have.
    #[serde(default = "one")]
    pub workers: usize,
    /// B/K: samples per worker per step.
    pub local_batch: usize,
    /// Micro-batch for gradient accumulation (default: the whole local batch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub micro_batch: Option<usize>,
    /// Steps this run performs (default: the schedule's horizon `total_steps`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps: Option<u64>,
    /// Label smoothing of the cross-entropy loss (`train.label_smoothing`), in `[0, 1)`; default 0 (none).
    #[serde(default)]
    pub label_smoothing: f32,
}

/// Evaluation cadence and BatchNorm re-estimation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvalConfig {
    /// Test images per evaluation batch on each worker (`eval.batch_size`); at least 1, default 256.
    #[serde(default = "eval_batch")]
    pub batch_size: usize,
    /// Evaluate at the last synchronization before every `every_epochs`-th epoch boundary (and at the end).
    #[serde(default = "one")]
    pub every_epochs: usize,
    /// Evaluate at the last synchronization before every multiple of this many steps (and at the end)
    /// instead of by epochs; for runs shorter than an epoch, such as a language model's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub every_steps: Option<u64>,
    /// Training images (over all workers) used to re-estimate BatchNorm statistics before an evaluation.
    #[serde(default = "bn_images")]
    pub bn_images: usize,
    /// At most this many held-out items per evaluation, over all workers (test images, or validation
    /// windows of `model.context + 1` tokens from the start of the validation split); default all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_items: Option<usize>,
    /// Also evaluate on this many training images (spread evenly over the training set, without
    /// augmentation) at every evaluation: the train accuracy and loss beside the test's, the
    /// generalization gap; default none (images only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_items: Option<usize>,
    /// The run stops as diverged (exit status 4) at an evaluation whose loss is not finite or above
    /// this many times the loss at the start, `ln(classes)` (a model that predicts every class alike,
    /// where a fresh classifier starts; `ln(vocab_size)` for a language model). Default 3; `inf`
    /// turns the check off.
    #[serde(default = "divergence_factor")]
    pub divergence_factor: f64,
}

impl Default for EvalConfig {
    fn default() -> Self {
        Self {
            batch_size: eval_batch(),
            every_epochs: 1,
            every_steps: None,
            bn_images: bn_images(),
            max_items: None,
            train_items: None,
            divergence_factor: divergence_factor(),
        }
    }
}

fn divergence_factor() -> f64 {
    3.0
}

/// Checkpointing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Write a checkpoint at every evaluation point (a synchronization) and at the end.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// Checkpoints kept on disk (older ones are removed).
    #[serde(default = "two")]
    pub keep: usize,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self { enabled: true, keep: 2 }
    }
}

fn yes() -> bool {
    true
}
fn one() -> usize {
    1
}
fn two() -> usize {
    2
}
fn three() -> usize {
    3
}
fn eval_batch() -> usize {
    256
}
fn bn_images() -> usize {
    4096
}

/// A resolved recipe.
///
/// The full training recipe: `[model]`, `[data]`, `[train]`, `[optimizer]`, `[schedule]`, `[sync]`,
/// `[driver]`, `[eval]`, `[checkpoint]`, `[outer]`. Every section refuses unknown keys; `--set a.b=value` overrides
/// are applied to the TOML table before anything is validated, so a flag and a key fail the same way.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainRecipe {
    /// The run's name (`name`; default `run`): names the default run directory and the summary.
    pub name: String,
    /// Free text about the recipe (`description`); training does not read it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Seed of the model initialization, the data order and augmentation.
    #[serde(default)]
    pub seed: u64,
    /// The network (`[model]`, selected by `model.kind`); required.
    pub model: ModelConfig,
    /// The dataset (`[data]`); required.
    pub data: DataConfig,
    /// Batch sizes, run length and loss (`[train]`); required.
    pub train: TrainConfig,
    /// The local optimizer and its hyperparameters (`[optimizer]`); required.
    pub optimizer: OptimizerConfig,
    /// The learning-rate schedule (`[schedule]`); required.
    pub schedule: LrSchedule,
    /// The synchronization rule (`[sync]`, selected by `sync.rule`), and the local level of a
    /// two-level run (`[sync.local]`); required.
    pub sync: SyncSection,
    /// Round-driver options (`[driver]`); default [`DriverConfig::default`].
    #[serde(default)]
    pub driver: DriverConfig,
    /// Evaluation cadence and BatchNorm re-estimation (`[eval]`); defaults as documented on [`EvalConfig`].
    #[serde(default)]
    pub eval: EvalConfig,
    /// Checkpointing (`[checkpoint]`); on by default, keeping 2.
    #[serde(default)]
    pub checkpoint: CheckpointConfig,
    /// DiLoCo's outer optimizer at every parameter synchronization (`[outer]`: `lr`, `momentum`,
    /// `nesterov`, `unit`; DiLoCo uses 0.7, 0.9, true, one outer step per round); none by default (a
    /// sync is a plain average).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outer: Option<OuterConfig>,
}

/// The `data.dataset` names of text corpora (for `model.kind = "gpt"`).
pub(crate) const TEXT_DATASETS: [&str; 3] = ["shakespeare", "comedy-of-errors", "text"];

/// Largest `data.prefetch`: batches prepared ahead of training per worker.
pub(crate) const MAX_PREFETCH: usize = 64;

const SECTIONS: [&str; 10] =
    ["model", "data", "train", "optimizer", "schedule", "sync", "driver", "eval", "checkpoint", "outer"];

impl TrainRecipe {
    /// Reads a recipe file, applies overrides, validates every part; errors name the file and key.
    pub fn load(path: &Path, sets: &[String]) -> Result<Self> {
        let mut root = crate::recipe::read_table(path)?;
        super::sets::apply_sets(&mut root, sets)?;
        Self::from_table(root, &format!("recipe {}", path.display()))
    }

    /// Builds a recipe from a TOML table with its overrides already applied: `name` defaults to `run`,
    /// unknown top-level keys are refused, each section is deserialized on its own so that an error names
    /// it, then [`validate`](Self::validate) runs. `origin` (e.g. `recipe PATH`) prefixes every error.
    pub fn from_table(mut root: Table, origin: &str) -> Result<Self> {
        if !root.contains_key("name") {
            root.insert("name".into(), Value::String("run".into()));
        }
        for key in root.keys() {
            if !SECTIONS.contains(&key.as_str()) && !["name", "description", "seed"].contains(&key.as_str()) {
                bail!("{origin}: unknown key `{key}` (expected {}, name, description, seed)", SECTIONS.join(", "));
            }
        }
        fill_vocab_size(&mut root).with_context(|| origin.to_string())?;
        let run_steps = root.get("train").and_then(|t| t.get("steps")).and_then(Value::as_integer);
        let run_steps = run_steps.filter(|n| *n > 0).map(|n| n as u64);
        super::plan::apply_budget(&mut root, run_steps, origin)?;
        // Deserialize section by section first, so an error names its section.
        for section in SECTIONS {
            if let Some(msg) = root.get(section).and_then(|v| section_error(section, v)) {
                bail!("{origin}: {msg}");
            }
        }
        let recipe: TrainRecipe =
            Value::Table(root).try_into().map_err(|e: toml::de::Error| anyhow!("{origin}: {}", e.message().trim()))?;
        recipe.validate().with_context(|| origin.to_string())?;
        Ok(recipe)
    }

    /// Checks what serde cannot: cross-field constraints, each named.
    pub fn validate(&self) -> Result<()> {
        self.model.validate().map_err(|e| anyhow!("invalid `model.{}`: {e}", e.field()))?;
        self.optimizer.validate()?;
        if self.optimizer.kind == OptimizerKind::Muon && self.driver.residency == Residency::Device {
            bail!(
                "invalid `optimizer.kind`: muon's Newton-Schulz iteration runs on host-resident workers only \
                 (driver.residency = \"host\", or \"auto\" on the CPU)"
            );
        }
        let t = &self.train;
        if t.workers == 0 {
            bail!("invalid `train.workers`: must be at least 1");
        }
        if t.local_batch == 0 {
            bail!("invalid `train.local_batch`: must be at least 1");
        }
        let micro = self.micro_batch();
        if micro == 0 || !t.local_batch.is_multiple_of(micro) {
            bail!("invalid `train.micro_batch`: {micro} must divide train.local_batch ({})", t.local_batch);
        }
        if !(t.label_smoothing.is_finite() && (0.0..1.0).contains(&t.label_smoothing)) {
            bail!("invalid `train.label_smoothing`: must be in [0, 1) (got {})", t.label_smoothing);
        }
        if self.eval.batch_size == 0 {
            bail!("invalid `eval.batch_size`: must be at least 1");
        }
        if self.eval.every_epochs == 0 {
            bail!("invalid `eval.every_epochs`: must be at least 1");
        }
        if self.eval.every_steps == Some(0) {
            bail!("invalid `eval.every_steps`: must be at least 1");
        }
        if self.eval.divergence_factor.is_nan() || self.eval.divergence_factor <= 1.0 {
            bail!(
                "invalid `eval.divergence_factor`: must be above 1 (got {}); it multiplies the loss at the start, and `inf` turns the check off",
                self.eval.divergence_factor
            );
        }
        if self.eval.max_items == Some(0) {
            bail!("invalid `eval.max_items`: must be at least 1 (leave it out to evaluate on the whole split)");
        }
        for (key, n) in [("data.train_items", self.data.train_items), ("eval.train_items", self.eval.train_items)] {
            if n == Some(0) {
                bail!("invalid `{key}`: must be at least 1 (leave it out for all training images)");
            }
        }
        let text = TEXT_DATASETS.contains(&self.data.dataset.as_str());
        if text && (self.data.train_items.is_some() || self.eval.train_items.is_some()) {
            bail!(
                "invalid `data.train_items` / `eval.train_items`: they count images; dataset `{}` is text",
                self.data.dataset
            );
        }
        match (self.model.as_gpt().is_some(), text) {
            (true, false) => bail!(
                "invalid `data.dataset`: model.kind = \"gpt\" trains on text ({}), not `{}`",
                TEXT_DATASETS.join(", "),
                self.data.dataset
            ),
            (false, true) => bail!(
                "invalid `model.kind`: dataset `{}` is text; train it with kind = \"gpt\", not `{}`",
                self.data.dataset,
                self.model.kind()
            ),
            _ => {}
        }
        if !(1..=MAX_PREFETCH).contains(&self.data.prefetch) {
            bail!(
                "invalid `data.prefetch`: must be in 1..={MAX_PREFETCH} (got {}): the loader runs at most this many batches ahead of training, and a deeper queue only holds memory",
                self.data.prefetch
            );
        }
        if self.sync.local.as_ref().and_then(|l| l.workers_per_node) == Some(0) {
            bail!("invalid `sync.local.workers_per_node`: must be at least 1");
        }
        if let Some(refusal) = check_sync(&self.sync_settings()?, Face::Recipe).refusals.into_iter().next() {
            bail!("{refusal}");
        }
        Ok(())
    }

    /// Everything that shapes the syncs, as [`check_sync`] judges it (`driver.residency = "auto"` as
    /// host: the Worker judges the residency it resolves again).
    pub fn sync_settings(&self) -> Result<SyncSettings> {
        Ok(SyncSettings {
            plan: Some(self.plan()?),
            outer: self.outer,
            streaming: self.sync.streaming,
            wire: self.driver.wire,
            residency: self.driver.residency,
            state: self.driver.state,
            fingerprint: self.driver.fingerprint,
            ..SyncSettings::new(self.sync.rule.clone(), self.train.workers)
        })
    }

    /// Checks that nodes of `sync.local.workers_per_node` ranks tile a world of `world` workers (the
    /// launch's, which `--workers` / `--nproc` or the launcher decide after the recipe is read).
    pub fn check_nodes(&self, world: usize) -> Result<()> {
        match self.sync.local.as_ref().and_then(|l| l.workers_per_node) {
            Some(n) if n == 0 || !world.is_multiple_of(n) => {
                bail!("invalid `sync.local.workers_per_node`: {n} must divide the {world} workers of the run")
            }
            _ => Ok(()),
        }
    }

    /// Samples per forward/backward pass: `train.micro_batch`, or the whole local batch.
    pub fn micro_batch(&self) -> usize {
        self.train.micro_batch.unwrap_or(self.train.local_batch)
    }

    /// Micro-batches accumulated per optimizer step: `train.local_batch / micro_batch`.
    pub fn accumulation_steps(&self) -> usize {
        self.train.local_batch / self.micro_batch().max(1)
    }

    /// The round plan: the schedule and rule over `train.steps` (default the horizon).
    pub fn plan(&self) -> Result<Plan> {
        self.sync.plan(self.schedule.clone(), self.train.steps).map_err(|e| anyhow!("{e}"))
    }

    /// The driver options with the accumulation the batch sizes imply.
    pub fn driver_config(&self) -> DriverConfig {
        DriverConfig { accumulation_steps: self.accumulation_steps(), ..self.driver.clone() }
    }

    /// Recipes must agree on these for a checkpoint of one to resume under the other.
    pub fn resume_key(&self) -> Result<String> {
        let mut r = self.clone();
        // Run length may be extended and evaluation / checkpoint cadence may change on resume.
        r.train.steps = None;
        // The world size is checked on its own, with its own message.
        r.train.workers = 0;
        r.eval = EvalConfig::default();
        r.checkpoint = CheckpointConfig::default();
        r.data.prefetch = 3;
        Ok(serde_json::to_string(&r)?)
    }

    /// The resolved recipe as TOML (what `RUN_DIR/recipe.toml` holds).
    pub fn to_toml(&self) -> Result<String> {
        Ok(toml::to_string_pretty(self)?)
    }
}

/// A `kind = "gpt"` model without `vocab_size` takes its corpus's: the resolved recipe then states it.
fn fill_vocab_size(root: &mut Table) -> Result<()> {
    let Some(Value::Table(model)) = root.get("model") else {
        return Ok(());
    };
    if model.get("kind").and_then(Value::as_str) != Some("gpt") || model.contains_key("vocab_size") {
        return Ok(());
    }
    let data: DataConfig = match root.get("data") {
        Some(v) => v.clone().try_into().map_err(|e: toml::de::Error| anyhow!("[data] {}", e.message().trim()))?,
        None => bail!("`model.vocab_size` is not given and there is no [data] section to take it from"),
    };
    if !TEXT_DATASETS.contains(&data.dataset.as_str()) {
        return Ok(()); // `validate` names the mismatch.
    }
    let corpus = open_corpus(&data).context("`model.vocab_size` is not given, so it is read off the corpus")?;
    let size = i64::try_from(corpus.vocab().len())?;
    if let Some(Value::Table(model)) = root.get_mut("model") {
        model.insert("vocab_size".into(), Value::Integer(size));
    }
    Ok(())
}

/// Opens a text recipe's corpus; errors name the setting and the path.
pub(crate) fn open_corpus(data: &DataConfig) -> Result<qsr_data::Corpus> {
    let corpus = match data.dataset.as_str() {
        "shakespeare" => qsr_data::Corpus::shakespeare(
            data.path.clone().unwrap_or_else(|| PathBuf::from(qsr_data::SHAKESPEARE_DEFAULT_DIR)),
        )
        .context("`data.dataset` shakespeare (fetch it with scripts/fetch-shakespeare.sh)")?,
        "comedy-of-errors" => qsr_data::Corpus::comedy_of_errors(),
        "text" => {
            let path = data.path.clone().ok_or_else(|| anyhow!("`data.path` is required for dataset `text`"))?;
            let name = path.file_stem().map_or_else(|| "text".to_string(), |s| s.to_string_lossy().into_owned());
            qsr_data::Corpus::from_files(name, &[path]).context("`data.path`")?
        }
        other => {
            bail!("invalid `data.dataset`: `{other}` is not a text corpus (expected {})", TEXT_DATASETS.join(", "))
        }
    };
    Ok(corpus)
}

/// Why a section does not deserialize: ``invalid `sync.streaming.fragments`: message`` where serde
/// names the key, else `[section] message`; a section (or `sync.local`, `sync.streaming`) that is
/// not a table is refused.
fn section_error(section: &str, value: &Value) -> Option<String> {
    // serde would read a struct from an array by position: `--set sync.streaming=[1,2]`.
    let not_table = |at: &str, v: &Value| {
        (!v.is_table()).then(|| format!("`{at}` must be a table ([{at}] and its keys), not {} `{v}`", v.type_str()))
    };
    if let Some(e) = not_table(section, value) {
        return Some(e);
    }
    if section == "sync"
        && let Some(e) =
            ["local", "streaming"].iter().find_map(|k| value.get(*k).and_then(|v| not_table(&format!("sync.{k}"), v)))
    {
        return Some(e);
    }
    if section == "sync" {
        let sub = |key: &str, check: fn(&Value) -> Option<(String, String)>| {
            value.get(key).and_then(check).map(|e| (format!("sync.{key}"), e))
        };
        let failed = sub("local", check::<qsr_sched::LocalSync>)
            .or_else(|| sub("streaming", check::<qsr_sched::StreamingConfig>))
            .or_else(|| check::<SyncSection>(value).map(|e| (section.to_string(), e)));
        return failed.map(|(at, e)| name_error(&at, e));
    }
    let failed = match section {
        "model" => check::<ModelConfig>(value),
        "data" => check::<DataConfig>(value),
        "train" => check::<TrainConfig>(value),
        "optimizer" => check::<OptimizerConfig>(value),
        "schedule" => check::<LrSchedule>(value),
        "driver" => check::<DriverConfig>(value),
        "eval" => check::<EvalConfig>(value),
        "checkpoint" => check::<CheckpointConfig>(value),
        "outer" => check::<OuterConfig>(value),
        _ => None,
    };
    failed.map(|e| name_error(section, e))
}

/// Opens the recipe's dataset split; errors name the setting and the path.
pub(crate) fn open_dataset(data: &DataConfig, split: Split) -> Result<std::sync::Arc<dyn qsr_data::Dataset>> {
    use std::sync::Arc;
    let path = |default: Option<&str>| -> Result<PathBuf> {
        data.path
            .clone()
            .or_else(|| default.map(PathBuf::from))
            .ok_or_else(|| anyhow!("`data.path` is required for dataset `{}`", data.dataset))
    };
    let set: Arc<dyn qsr_data::Dataset> = match data.dataset.as_str() {
        "digits" => Arc::new(qsr_data::digits(split)),
        "fashion-mnist" => Arc::new(qsr_data::fashion_mnist(&path(Some(qsr_data::FASHION_MNIST_DEFAULT_DIR))?, split)?),
        "mnist" => Arc::new(qsr_data::mnist(&path(None)?, split)?),
        "cifar10" => Arc::new(qsr_data::cifar10(&path(None)?, split)?),
        "cifar100" => Arc::new(qsr_data::cifar100(&path(None)?, split)?),
        "imagefolder" => Arc::new(qsr_data::ImageFolder::imagenet(&path(None)?, split)?),
        other => bail!(
            "invalid `data.dataset`: unknown dataset `{other}` (expected digits, fashion-mnist, mnist, cifar10, cifar100, imagefolder; text: {})",
            TEXT_DATASETS.join(", ")
        ),
    };
    match (split, data.train_items) {
        (Split::Train, Some(n)) => {
            Ok(Arc::new(qsr_data::Spread::new(set, n).map_err(|e| anyhow!("invalid `data.train_items`: {e}"))?))
        }
        _ => Ok(set),
    }
}
