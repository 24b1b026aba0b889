//! What every rank of a job agrees on before its first training collective (documented on [`agree`]).

use anyhow::{Context, Result};
use qsr_comm::Collective;
use serde_json::Value;

use crate::recipe::TrainRecipe;

/// What one rank was launched with.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LaunchFacts {
    /// The `qsr` version (`CARGO_PKG_VERSION`).
    pub version: String,
    /// The resolved recipe (every key, after `--set` and launch overrides).
    pub recipe: TrainRecipe,
    /// The checkpoint step this rank resumes from (`None`: a fresh run).
    pub resume_step: Option<u64>,
    /// Rank 0 only: why the run cannot start.
    pub refusal: Option<String>,
}

impl LaunchFacts {
    /// The facts of this process for `recipe`.
    pub(crate) fn new(recipe: &TrainRecipe, resume_step: Option<u64>) -> Self {
        Self { version: env!("CARGO_PKG_VERSION").to_string(), recipe: recipe.clone(), resume_step, refusal: None }
    }

    /// The facts every rank must share, as one JSON object: the recipe's keys plus `qsr_version` and
    /// `start_step` (a recipe has no such keys: unknown keys are refused).
    fn shared(&self) -> Result<Value> {
        let mut v = serde_json::to_value(&self.recipe)?;
        let map = v.as_object_mut().context("a recipe serializes to a JSON object")?;
        map.insert("qsr_version".into(), Value::String(self.version.clone()));
        map.insert("start_step".into(), serde_json::to_value(self.resume_step)?);
        Ok(v)
    }
}

/// Makes every rank agree on rank 0's [`LaunchFacts`] before the first training collective: `Ok` on
/// every rank, or the same error (rank 0's refusal, or the differing ranks and keys) on every rank.
///
/// What every rank of a job agrees on before its first training collective: the binary's version, the
/// resolved recipe, where the run starts, and whether rank 0 may use the run directory.
///
/// Ranks launched with different recipes (a `--set` on one rank only, an edited file on one host) would
/// otherwise train different models and only fail hundreds of collectives later, if at all. Rank 0
/// first broadcasts its refusal, if it has one (the run directory is locked, its inputs are unusable),
/// then every rank checks its [`LaunchFacts`] against rank 0's with [`qsr_comm::agree()`], which names the
/// differing keys on every rank.
pub(crate) fn agree(comm: &mut dyn Collective, mine: &LaunchFacts) -> Result<()> {
    let during = "while the ranks compared their launch settings";
    let mut refusal = if comm.rank() == 0 { mine.refusal.clone().unwrap_or_default().into_bytes() } else { Vec::new() };
    comm.broadcast_bytes(&mut refusal, 0).context(during)?;
    if !refusal.is_empty() {
        return Err(crate::exit::bad_input(anyhow::anyhow!(
            "rank 0 refused to start: {}",
            String::from_utf8_lossy(&refusal)
        )));
    }
    qsr_comm::agree(comm, &mine.shared()?).context(during)?;
    Ok(())
}
