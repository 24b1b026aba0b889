//! What several test modules build: a two-layer MLP, and a test run alone in a child process.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::tensor::{Device, Tensor};

/// `inputs` -> 16 (ReLU) -> `outputs`.
#[derive(Module, Debug)]
pub(crate) struct Mlp {
    fc1: Linear,
    act: Relu,
    fc2: Linear,
}

impl Mlp {
    pub(crate) fn new(device: &Device, inputs: usize, outputs: usize) -> Self {
        Self {
            fc1: LinearConfig::new(inputs, 16).init(device),
            act: Relu::new(),
            fc2: LinearConfig::new(16, outputs).init(device),
        }
    }

    pub(crate) fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.fc2.forward(self.act.forward(self.fc1.forward(x)))
    }
}

/// Two hidden layers, for Muon's split: `4 -> 16 -> 16 -> 1`.
#[derive(Module, Debug)]
pub(crate) struct Mlp3 {
    fc1: Linear,
    fc2: Linear,
    head: Linear,
}

impl Mlp3 {
    pub(crate) fn new(device: &Device) -> Self {
        Self {
            fc1: LinearConfig::new(4, 16).init(device),
            fc2: LinearConfig::new(16, 16).init(device),
            head: LinearConfig::new(16, 1).init(device),
        }
    }
}

/// The environment variable that marks a child process running one test alone.
pub(crate) const ALONE: &str = "QSR_TEST_ALONE";

/// Whether this process is the child that [`run_alone`] started.
pub(crate) fn is_alone() -> bool {
    std::env::var_os(ALONE).is_some()
}

/// Runs the test `name` of this binary alone in a child process (for what is process-wide: burn's
/// RNG, a global tracing subscriber); fails unless it passed. Its stderr.
pub(crate) fn run_alone(name: &str) -> String {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads", "1"])
        .env(ALONE, "1")
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && stdout.contains("1 passed"), "{stdout}{stderr}");
    stderr.into_owned()
}
