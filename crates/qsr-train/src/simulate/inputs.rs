//! What `qsr simulate` prices: the recipes and runs it was given, their models' sizes, payloads,
//! steps per epoch, the cluster and the step time.

use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use qsr_models::ModelConfig;

use super::SimulateArgs;
use super::model::{Cluster, Network, Nodes, SyncPayload, predict, step_seconds_from_wall};
use crate::recipe::TrainRecipe;
use crate::records::Summary;

/// The payload a recipe moves, given its trainable parameter count and BN running-statistic count.
pub(crate) fn recipe_payload(recipe: &TrainRecipe, params: u64, running: u64) -> SyncPayload {
    // The buffer the Worker fills, from the same rule.
    let buffer = qsr_optim::SyncBuffer::new(&recipe.driver, recipe.optimizer.moments(), running > 0);
    SyncPayload {
        gradient_elements: params,
        parameter_elements: buffer.elements(params, running),
        bytes_per_element: 4,
        parameter_encoding: recipe.driver.wire.encoding(),
        local_encoding: recipe.driver.wire.at(qsr_optim::Level::Local).encoding(),
        bucket_elements: recipe.driver.bucket_elems.map(|b| b as u64),
    }
}

/// Positions a sample passes through the weights: ViT tokens (`(image / patch)^2`), else 1.
pub(super) fn tokens_per_sample(model: &ModelConfig) -> u64 {
    match model {
        ModelConfig::Vit(v) => v.image_size.map_or(1, |i| ((i / v.patch_size.max(1)) as u64).pow(2)),
        // A sample is one window: every position predicts a token.
        ModelConfig::Gpt(g) => g.context as u64,
        _ => 1,
    }
}

pub(super) struct Item {
    pub(super) recipe: TrainRecipe,
    pub(super) summary: Option<Summary>,
}

pub(super) fn read_summary(dir: &Path) -> Result<Summary> {
    let path = dir.join("summary.json");
    let bytes = crate::files::read_regular(&path, crate::files::SUMMARY_BYTES, "run summary")
        .context("is the run finished?")?;
    serde_json::from_slice(&bytes).with_context(|| format!("{} is not a qsr summary", path.display()))
}

/// Trainable parameters and BN running statistics of a recipe's model (built on the CPU).
pub(super) fn count_params(recipe: &TrainRecipe) -> Result<(u64, u64)> {
    let device = crate::device_spec::device("cpu")?;
    let model = crate::worker::build_model(recipe, &device).with_context(|| {
        format!("cannot build the model of `{}` to count its parameters (pass --params)", recipe.name)
    })?;
    let trainable = model.trainable_params() as u64;
    let all = model.num_params() as u64;
    Ok((trainable, all.saturating_sub(trainable)))
}

pub(super) fn steps_per_epoch(recipe: &TrainRecipe, world: usize) -> Option<u64> {
    if let Some(gpt) = recipe.model.as_gpt() {
        let corpus = crate::recipe::open_corpus(&recipe.data).ok()?;
        return crate::worker::task::text_steps_per_epoch(recipe, &corpus, gpt.context, world).ok().map(|s| s as u64);
    }
    let set = crate::recipe::open_dataset(&recipe.data, qsr_data::Split::Train).ok()?;
    let per = world * recipe.train.local_batch;
    (per > 0).then(|| (set.len() / per) as u64).filter(|&s| s > 0)
}

/// The one cluster every row is priced on: nodes of `--node-size` workers (or of the first recipe's
/// `sync.local.workers_per_node`) on the intra-node network, or one network between all workers.
/// A two-level recipe needs nodes: its local averages would cost nothing without them.
pub(super) fn cluster_of(
    args: &SimulateArgs,
    items: &[Item],
    inter: Network,
    intra: Network,
    wants: bool,
) -> Result<Cluster> {
    let from_recipe = || items.iter().find_map(|i| i.recipe.sync.local.as_ref().and_then(|l| l.workers_per_node));
    let nodes = match args.node_size.or_else(from_recipe) {
        Some(0) => bail!("--node-size must be at least 1"),
        Some(size) => Some(Nodes { size, intra }),
        None if wants => {
            bail!("the intra-node network needs the node size (--node-size or sync.local.workers_per_node)")
        }
        None => None,
    };
    if let Some(i) = items.iter().find(|i| i.recipe.sync.local.is_some() && nodes.is_none()) {
        bail!("`{}` averages inside nodes ([sync.local]): give --node-size", i.recipe.name);
    }
    Ok(Cluster { inter, nodes })
}

/// The `--recipe` files (with `--set` and `--world-size` applied), then the `--run` directories
/// (their recipe at the world size they ran with, and their summary).
pub(super) fn load_items(args: &SimulateArgs) -> Result<Vec<Item>> {
    let mut items = Vec::new();
    for path in &args.recipes {
        let mut recipe = TrainRecipe::load(path, &args.sets)?;
        if let Some(k) = args.world_size {
            if k == 0 {
                bail!("--world-size must be at least 1");
            }
            recipe.train.workers = k;
        }
        items.push(Item { recipe, summary: None });
    }
    for dir in &args.runs {
        let summary = read_summary(dir)?;
        let mut recipe = TrainRecipe::load(&dir.join("recipe.toml"), &[])?;
        recipe.train.workers = summary.world_size;
        items.push(Item { recipe, summary: Some(summary) });
    }
    Ok(items)
}

/// `--reference NAME=HOURS` as `(name, seconds)`; each name must be one of the items'.
pub(super) fn references(args: &SimulateArgs, items: &[Item]) -> Result<Vec<(String, f64)>> {
    let mut references = Vec::new();
    for r in &args.references {
        let (name, hours) = r.split_once('=').ok_or_else(|| anyhow!("--reference {r}: expected NAME=HOURS"))?;
        let hours: f64 = hours
            .trim()
            .parse()
            .ok()
            .filter(|h: &f64| h.is_finite() && *h > 0.0)
            .ok_or_else(|| anyhow!("--reference {r}: `{hours}` is not a positive number of hours"))?;
        if !items.iter().any(|i| i.recipe.name == name.trim()) {
            bail!("--reference {r}: no recipe named `{}`", name.trim());
        }
        references.push((name.trim().to_string(), hours * 3600.0));
    }
    Ok(references)
}

/// `(trainable, running)` parameter counts of each item's model: `--params`, or counted once per
/// distinct model config (building a model is the slow part).
pub(super) fn model_sizes(args: &SimulateArgs, items: &[Item]) -> Result<Vec<(u64, u64)>> {
    let mut counts: Vec<(String, (u64, u64))> = Vec::new();
    let mut sizes = Vec::new();
    for item in items {
        let size = match args.params {
            Some(p) => (p, 0),
            None => {
                let key =
                    serde_json::to_string(&(&item.recipe.model, &item.recipe.data.dataset, &item.recipe.data.path))?;
                match counts.iter().find(|(k, _)| *k == key) {
                    Some((_, c)) => *c,
                    None => {
                        let c = count_params(&item.recipe)?;
                        counts.push((key, c));
                        c
                    }
                }
            }
        };
        sizes.push(size);
    }
    Ok(sizes)
}

/// The world size an item is simulated at: the one its run had, else its recipe's.
pub(super) fn world_of(item: &Item) -> usize {
    item.summary.as_ref().map_or(item.recipe.train.workers, |s| s.world_size)
}

/// Compute seconds per step and where they come from, from the first of `--step-seconds`,
/// `--step-seconds-from`, `--flop-rate`, `--dp-hours` given.
pub(super) fn step_time(
    args: &SimulateArgs,
    items: &[Item],
    sizes: &[(u64, u64)],
    net: &Cluster,
) -> Result<(f64, String)> {
    if let Some(s) = args.step_seconds {
        if !(s.is_finite() && s >= 0.0) {
            bail!("--step-seconds {s}: must be a non-negative number");
        }
        Ok((s, format!("measured: {s} s per step (--step-seconds)")))
    } else if let Some(dir) = &args.step_seconds_from {
        let s = read_summary(dir)?;
        let steps = s.steps.max(1) as f64;
        // Both levels' communication: local averages are not compute either.
        let comm = s.comm_seconds + s.local.as_ref().map_or(0.0, |l| l.comm_seconds);
        let step = (s.wall_seconds - comm).max(0.0) / steps;
        Ok((
            step,
            format!("run {}: (wall {:.2} s - comm {comm:.2} s) / {} steps", dir.display(), s.wall_seconds, s.steps),
        ))
    } else if let Some(rate) = args.flop_rate {
        if !(rate.is_finite() && rate > 0.0) {
            bail!("--flop-rate {rate}: must be positive");
        }
        let item = &items[0];
        let flops =
            args.flops_per_sample.unwrap_or(6.0 * sizes[0].0 as f64 * tokens_per_sample(&item.recipe.model) as f64);
        let step = item.recipe.train.local_batch as f64 * flops / rate;
        Ok((step, format!("{} samples x {flops:.3e} FLOP / {rate:.3e} FLOP/s", item.recipe.train.local_batch)))
    } else if let Some(hours) = args.dp_hours {
        step_time_from_dp_hours(hours, items, sizes, net)
    } else {
        bail!("give one of --step-seconds, --step-seconds-from, --flop-rate, --dp-hours");
    }
}

/// `--dp-hours`: the data-parallel recipe's wall time less its modelled communication, per step.
fn step_time_from_dp_hours(hours: f64, items: &[Item], sizes: &[(u64, u64)], net: &Cluster) -> Result<(f64, String)> {
    let idx = items
        .iter()
        .position(|i| matches!(i.recipe.sync.rule, qsr_sched::SyncRule::Dp))
        .ok_or_else(|| anyhow!("--dp-hours needs a data-parallel recipe (sync.rule = \"dp\") among --recipe"))?;
    let item = &items[idx];
    let payload = recipe_payload(&item.recipe, sizes[idx].0, sizes[idx].1);
    let plan = item.recipe.plan()?;
    let step = step_seconds_from_wall(&plan, hours * 3600.0, &payload, world_of(item), *net)?;
    let comm = predict("", &plan, 0.0, &payload, world_of(item), *net, None).comm_seconds;
    Ok((
        step,
        format!(
            "from {}'s {hours} h: ({:.0} s - modelled DP communication {:.0} s) / {} steps",
            item.recipe.name,
            hours * 3600.0,
            comm,
            plan.end_step()
        ),
    ))
}
