//! DiLoCo's outer optimizer: at a synchronization every worker sends its pseudo-gradient, the last
//! global parameters minus its own, the mean of those is one gradient step of an outer SGD with
//! (Nesterov) momentum on the global parameters, and every worker continues from the result.
//!
//! Under QSR a round lasts 2 steps early and hundreds late, so one outer step per round gives a
//! 2-step round the momentum of a 500-step one, and a pseudo-gradient grows with the round's summed
//! lr. [`OuterUnit::Step`] and [`OuterUnit::Lr`] take the momentum per inner step and the
//! pseudo-gradient per unit of the round's inner lr: a round of `n` steps with mean inner lr `l`
//! (`Lr`; 1 for `Step`) and mean pseudo-gradient `delta` moves the global parameters by
//!
//! ```text
//! d     = delta / (n l)                       the round's direction per unit of lr
//! buf'  = mu^n buf + d                        the momentum ages by the round's n steps
//! move  = outer_lr n l buf'                   heavy ball
//! move  = outer_lr n l (d + mu^n buf')        Nesterov
//! ```
//!
//! A round of one step is one outer step of the base settings (for `Lr` when the lr holds: the buffer
//! is in gradient units, torch SGD's `lr * buf`); without momentum every unit moves by
//! `outer_lr * delta`; a long round forgets the buffer (`mu^n` vanishes) and moves by about
//! `outer_lr * delta`, where per-round momentum would still add ten times its buffer at 0.9.

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
    /// What one outer step stands for: the whole round (DiLoCo, the default) or each inner step of
    /// it (the momentum then meant per step; see the module docs).
    #[serde(default)]
    pub unit: OuterUnit,
}

/// What one outer step stands for (`[outer] unit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OuterUnit {
    /// One outer step per synchronization, however long the round was (DiLoCo).
    #[default]
    Round,
    /// A round of `n` inner steps is `n` outer steps on its pseudo-gradient per step.
    Step,
    /// As [`Self::Step`] with each step weighted by its inner lr: the pseudo-gradient per unit of the
    /// round's summed lr, the momentum in those units (torch SGD's `lr * buf` across rounds).
    Lr,
}

impl OuterUnit {
    /// The name as `[outer] unit` spells it.
    pub fn name(self) -> &'static str {
        match self {
            OuterUnit::Round => "round",
            OuterUnit::Step => "step",
            OuterUnit::Lr => "lr",
        }
    }
}

impl OuterConfig {
    /// DiLoCo's defaults: lr 0.7, Nesterov momentum 0.9, tuned for rounds of about 500 steps.
    pub fn diloco() -> Self {
        Self { lr: 0.7, momentum: 0.9, nesterov: true, unit: OuterUnit::Round }
    }

    /// Plain averaging written as an outer step (lr 1, no momentum: `global - mean(global - local)`),
    /// which streaming and quantized syncs use when a recipe has no `[outer]`.
    pub fn averaging() -> Self {
        Self { lr: 1.0, momentum: 0.0, nesterov: false, unit: OuterUnit::Round }
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

/// The round an outer step ends: its inner steps and their summed lr (for the per-step units).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub(crate) struct InnerRound {
    pub(crate) steps: u64,
    #[serde(with = "crate::exact")]
    pub(crate) lr_sum: f64,
}

/// The outer state: the last global parameters and the momentum buffer, one copy each of the
/// parameters (memory: two more parameter-sized f32 buffers per worker).
#[derive(Debug, Clone)]
pub(crate) struct Outer {
    config: OuterConfig,
    global: Vec<f32>,
    momentum: Vec<f32>,
}

/// The per-step units' update for one round (see the module docs), as factors of one element:
/// `d = delta * scale`, `move = from_buf * buf + from_d * d`, `buf' = decay * buf + d`.
struct PerStep {
    scale: f32,
    from_buf: f32,
    from_d: f32,
    decay: f32,
}

impl PerStep {
    fn new(config: &OuterConfig, round: InnerRound) -> Self {
        let (eta, n) = (config.lr, round.steps as f64);
        // Lrs that sum to nothing (a round at lr 0) move nothing; their steps count as of lr 1.
        let lr_mean = match config.unit {
            OuterUnit::Lr if round.steps > 0 && round.lr_sum > 0.0 => round.lr_sum / n,
            _ => 1.0,
        };
        let p = config.momentum.powf(n);
        let mass = eta * n * lr_mean;
        let (from_buf, from_d) = if config.nesterov { (mass * p * p, mass * (1.0 + p)) } else { (mass * p, mass) };
        Self {
            scale: if round.steps == 0 { 0.0 } else { (1.0 / (n * lr_mean)) as f32 },
            from_buf: from_buf as f32,
            from_d: from_d as f32,
            decay: p as f32,
        }
    }
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
    /// Nesterov `d + mu * buf`, `global - lr * step`), or under a per-step unit the round's update of
    /// the module docs for the `round` it ends; writes the new global parameters into `delta`.
    pub(crate) fn step(&mut self, delta: &mut [f32], round: InnerRound) {
        if self.config.unit == OuterUnit::Round {
            return self.step_at(0, delta);
        }
        let f = PerStep::new(&self.config, round);
        for (d, (g, m)) in delta.iter_mut().zip(self.global.iter_mut().zip(&mut self.momentum)) {
            let dir = *d * f.scale;
            let moved = f.from_buf.mul_add(*m, f.from_d * dir);
            *m = f.decay.mul_add(*m, dir);
            *g -= moved;
            *d = *g;
        }
    }

    /// One outer step of the whole round (DiLoCo) of the parameters at `at..at + delta.len()` only (one
    /// fragment; the others' global values and momentum stay as they are).
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
        outer.step(&mut delta, InnerRound::default());
        assert!((delta[0] - (3.0 - 0.7 * (1.0 + 0.9 * 1.45))).abs() < 1e-6, "{delta:?}");
    }

    fn config(unit: OuterUnit, nesterov: bool) -> OuterConfig {
        OuterConfig { lr: 0.7, momentum: 0.9, nesterov, unit }
    }

    /// Deterministic pseudo-gradients of 3 parameters, one set per round.
    fn delta(round: usize) -> Vec<f32> {
        (0..3).map(|i| ((round * 3 + i) as f32 * 0.37).sin() * 0.01).collect()
    }

    fn close(a: &[f32], b: &[f32]) -> bool {
        a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-5 * x.abs().max(1.0))
    }

    #[test]
    fn a_round_of_one_step_is_one_outer_step_of_the_base_settings() {
        for nesterov in [false, true] {
            for unit in [OuterUnit::Step, OuterUnit::Lr] {
                let start = [1.0, -0.5, 0.25];
                let (mut base, mut per_step) = (
                    Outer::new(config(OuterUnit::Round, nesterov), &start),
                    Outer::new(config(unit, nesterov), &start),
                );
                for round in 0..6 {
                    let one = InnerRound { steps: 1, lr_sum: 0.05 };
                    let (mut a, mut b) = (delta(round), delta(round));
                    base.step(&mut a, one);
                    per_step.step(&mut b, one);
                    assert!(close(&a, &b), "{unit:?}, nesterov {nesterov}, round {round}: {a:?} vs {b:?}");
                }
            }
        }
    }

    /// A round of 3 steps whose lrs sum to 0.6, by hand: outer lr 0.7, momentum 0.5 (`mu^3` 0.125),
    /// a buffer of 0.4 and a pseudo-gradient of 0.06 on one parameter at 1.0.
    #[test]
    fn a_round_of_n_steps_ages_the_momentum_n_steps_by_hand() {
        // lr: d = 0.06 / 0.6 = 0.1, buf = 0.05 + 0.1 = 0.15, move = 0.7 * 0.6 * buf (Nesterov:
        // 0.42 * (0.1 + 0.125 * 0.15)). step: d = 0.02, buf = 0.07, move = 2.1 * buf (Nesterov:
        // 2.1 * (0.02 + 0.125 * 0.07)).
        for (unit, nesterov, global, buf) in [
            (OuterUnit::Lr, false, 0.937, 0.15),
            (OuterUnit::Lr, true, 0.950125, 0.15),
            (OuterUnit::Step, false, 0.853, 0.07),
            (OuterUnit::Step, true, 0.939625, 0.07),
        ] {
            let mut outer = Outer::new(OuterConfig { lr: 0.7, momentum: 0.5, nesterov, unit }, &[1.0]);
            outer.restore(&[1.0], &[0.4]).unwrap();
            let mut moved = [0.06];
            outer.step(&mut moved, InnerRound { steps: 3, lr_sum: 0.6 });
            assert!(close(&moved, &[global]), "{unit:?}, nesterov {nesterov}: {moved:?}, not {global}");
            assert!(close(&outer.momentum, &[buf]), "{unit:?}, nesterov {nesterov}: {:?}", outer.momentum);
        }
    }

    #[test]
    fn without_momentum_every_unit_moves_by_the_outer_lr_times_the_pseudo_gradient() {
        for unit in [OuterUnit::Round, OuterUnit::Step, OuterUnit::Lr] {
            let mut outer =
                Outer::new(OuterConfig { lr: 0.7, momentum: 0.0, nesterov: false, unit }, &[1.0, -0.5, 0.25]);
            let mut moved = delta(0);
            outer.step(&mut moved, InnerRound { steps: 5, lr_sum: 0.37 });
            let expected: Vec<f32> = [1.0f32, -0.5, 0.25].iter().zip(delta(0)).map(|(g, d)| g - 0.7 * d).collect();
            assert!(close(&moved, &expected), "{unit:?}: {moved:?} vs {expected:?}");
        }
    }

    #[test]
    fn a_round_of_no_steps_moves_nothing() {
        let mut outer = Outer::new(config(OuterUnit::Lr, true), &[1.0, -0.5, 0.25]);
        outer.restore(&[1.0, -0.5, 0.25], &[0.1, 0.2, 0.3]).unwrap();
        let mut moved = vec![0.0; 3];
        outer.step(&mut moved, InnerRound::default());
        assert_eq!(moved, [1.0, -0.5, 0.25]);
        assert_eq!(outer.momentum, [0.1, 0.2, 0.3]);
    }
}
