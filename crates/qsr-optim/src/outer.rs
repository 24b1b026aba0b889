//! DiLoCo's outer optimizer: at a synchronization every worker sends its pseudo-gradient, the last
//! global parameters minus its own, the mean of those is one gradient step of an outer SGD with
//! (Nesterov) momentum on the global parameters, and every worker continues from the result.

use qsr_sched::SyncRule;
use serde::{Deserialize, Serialize};

use crate::error::OptimError;

/// The outer optimizer's settings (DiLoCo: lr 0.7, momentum 0.9, Nesterov).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OuterConfig {
    /// Outer learning rate (1 with momentum 0 is plain averaging, up to f32 rounding).
    pub lr: f64,
    /// Momentum of the outer SGD, in `[0, 1)`.
    #[serde(default)]
    pub momentum: f64,
    /// Nesterov momentum (as `torch.optim.SGD(nesterov=True)`).
    #[serde(default)]
    pub nesterov: bool,
}

impl OuterConfig {
    /// DiLoCo's defaults: lr 0.7, Nesterov momentum 0.9, tuned for rounds of about 500 steps.
    pub fn diloco() -> Self {
        Self { lr: 0.7, momentum: 0.9, nesterov: true }
    }

    /// Plain averaging written as an outer step (lr 1, no momentum: `global - mean(global - local)`),
    /// which streaming and quantized syncs use when a recipe has no `[outer]`.
    pub fn averaging() -> Self {
        Self { lr: 1.0, momentum: 0.0, nesterov: false }
    }

    /// DiLoCo's outer lr with Nesterov momentum 0.5, for the short rounds of QSR and constant H (2 to
    /// ~100 steps), where momentum 0.9 overshoots: on digits it drove QSR to chance accuracy while
    /// 0.5 trains (docs/RESULTS.md, section 5). `qsr compare`'s `+outer` rules use it by default.
    pub fn short_rounds() -> Self {
        Self { momentum: 0.5, ..Self::diloco() }
    }

    /// Checks the settings, naming the key (`outer.lr`, `outer.momentum`).
    pub fn validate(&self) -> Result<(), OptimError> {
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(OptimError::Config {
                field: "outer.lr".into(),
                reason: format!("must be > 0, got {}", self.lr),
            });
        }
        if !(0.0..1.0).contains(&self.momentum) {
            return Err(OptimError::Config {
                field: "outer.momentum".into(),
                reason: format!("must be in [0, 1), got {}", self.momentum),
            });
        }
        Ok(())
    }

    /// [`Self::validate`], and refused (naming `outer`) under a rule that never averages parameters,
    /// where an outer step would never run.
    pub fn validate_for(&self, rule: &SyncRule) -> Result<(), OptimError> {
        self.validate()?;
        if rule.syncs_gradients(u64::MAX) {
            return Err(OptimError::Config {
                field: "outer".into(),
                reason: format!("rule `{}` never averages parameters, so an outer optimizer never runs", rule.name()),
            });
        }
        Ok(())
    }
}

/// The outer state: the last global parameters and the momentum buffer, one copy each of the
/// parameters (memory: two more parameter-sized f32 buffers per worker).
#[derive(Debug, Clone)]
pub(crate) struct Outer {
    config: OuterConfig,
    global: Vec<f32>,
    momentum: Vec<f32>,
}

impl Outer {
    /// Starts from `global`, momentum zero.
    pub(crate) fn new(config: OuterConfig, global: &[f32]) -> Self {
        Self { config, global: global.to_vec(), momentum: vec![0.0; global.len()] }
    }

    /// The global parameters and the momentum buffer.
    pub(crate) fn state(&self) -> (&[f32], &[f32]) {
        (&self.global, &self.momentum)
    }

    /// Replaces the state (from a checkpoint); both buffers must have the parameters' length.
    pub(crate) fn restore(&mut self, global: &[f32], momentum: &[f32]) -> Result<(), OptimError> {
        if global.len() != self.global.len() || momentum.len() != self.global.len() {
            return Err(OptimError::Layout(format!(
                "outer state of {} + {} values for {} parameters",
                global.len(),
                momentum.len(),
                self.global.len()
            )));
        }
        self.global.copy_from_slice(global);
        self.momentum.copy_from_slice(momentum);
        Ok(())
    }

    /// Restores `outer`'s state from a checkpoint, or refuses naming `outer` when `owner` (a worker, an
    /// averager) has none.
    pub(crate) fn restore_into(
        outer: Option<&mut Outer>,
        global: &[f32],
        momentum: &[f32],
        owner: &str,
    ) -> Result<(), OptimError> {
        match outer {
            Some(outer) => outer.restore(global, momentum),
            None => Err(OptimError::Config {
                field: "outer".into(),
                reason: format!("this {owner} has no outer optimizer"),
            }),
        }
    }

    /// Makes `params` the global parameters (after a data-parallel step, where every worker holds them).
    pub(crate) fn follow(&mut self, params: &[f32]) {
        self.global.copy_from_slice(params);
    }

    /// Replaces a worker's parameters `local` with its pseudo-gradient `global - local`.
    pub(crate) fn pseudo_gradient(&self, local: &mut [f32]) {
        local.iter_mut().zip(&self.global).for_each(|(l, g)| *l = g - *l);
    }

    /// The pseudo-gradient `global - local` of the parameters at `at..at + out.len()`, into `out`
    /// (`local` holding all parameters): one fragment's payload.
    pub(crate) fn pseudo_gradient_of(&self, at: usize, local: &[f32], out: &mut [f32]) {
        let range = at..at + out.len();
        out.iter_mut().zip(&self.global[range.clone()]).zip(&local[range]).for_each(|((o, g), l)| *o = g - l);
    }

    /// One outer step on the mean pseudo-gradient `delta`, in torch SGD's order (`buf = buf * mu + d`,
    /// Nesterov `d + mu * buf`, `global - lr * step`); writes the new global parameters into `delta`.
    pub(crate) fn step(&mut self, delta: &mut [f32]) {
        self.step_at(0, delta);
    }

    /// [`Self::step`] of the parameters at `at..at + delta.len()` only (one fragment; the others'
    /// global values and momentum stay as they are).
    pub(crate) fn step_at(&mut self, at: usize, delta: &mut [f32]) {
        let (lr, mu) = (self.config.lr as f32, self.config.momentum as f32);
        let range = at..at + delta.len();
        let parts = self.global[range.clone()].iter_mut().zip(&mut self.momentum[range]);
        for (d, (g, m)) in delta.iter_mut().zip(parts) {
            let step = if mu == 0.0 {
                *d
            } else {
                *m = *m * mu + *d;
                if self.config.nesterov { m.mul_add(mu, *d) } else { *m }
            };
            *g = step.mul_add(-lr, *g);
            *d = *g;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restored_state_is_the_state_and_a_wrong_length_is_refused() {
        let mut outer = Outer::new(OuterConfig::diloco(), &[1.0, 2.0]);
        outer.restore(&[3.0, 4.0], &[0.5, 0.25]).unwrap();
        assert_eq!(outer.state(), (&[3.0f32, 4.0][..], &[0.5f32, 0.25][..]));
        assert!(matches!(outer.restore(&[1.0], &[0.0, 0.0]), Err(OptimError::Layout(_))));
        // One step from there: m = 0.9 * 0.5 + 1 = 1.45, step = 1 + 0.9 * 1.45, global = 3 - 0.7 step.
        let mut delta = [1.0, 0.0];
        outer.step(&mut delta);
        assert!((delta[0] - (3.0 - 0.7 * (1.0 + 0.9 * 1.45))).abs() < 1e-6, "{delta:?}");
    }
}
