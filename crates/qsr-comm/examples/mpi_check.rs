//! Correctness check of the MPI backend, run under mpirun:
//!
//! ```text
//! cargo build -p qsr-comm --release --features mpi --example mpi_check
//! mpirun --allow-run-as-root --oversubscribe -np 3 target/release/examples/mpi_check
//! ```
//!
//! Runs the same matrix as the other backends' tests (buffer lengths 0, 1, fewer than the world
//! size, not divisible by it, several MiB; sum and mean; broadcast from every root; barrier;
//! broadcast_bytes), checks against an f64 reference and bit-identity across ranks, then checks
//! that a diverging length is refused on every rank. Exits non-zero on any failure.

use qsr_comm::{Collective, MpiComm, ReduceOp};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn input(seed: u64, rank: usize, len: usize) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ ((rank as u64 + 1) << 32));
    (0..len).map(|_| rng.random_range(-1.0f32..1.0) * if rng.random_bool(0.1) { 1000.0 } else { 1.0 }).collect()
}

fn hash(v: &[f32]) -> u64 {
    v.iter()
        .flat_map(|x| x.to_bits().to_le_bytes())
        .fold(0xcbf29ce484222325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100000001b3))
}

fn run(c: &mut MpiComm) -> Result<usize, String> {
    let n = c.world_size();
    let r = c.rank();
    let mut cases = 0;
    let mut lengths = vec![0, 1, n.saturating_sub(1), 1000 * n + 3, (3 << 20) / 4 + 2 * n + 1];
    lengths.dedup();
    for (li, &len) in lengths.iter().enumerate() {
        let inputs: Vec<Vec<f32>> = (0..n).map(|j| input(li as u64, j, len)).collect();
        let mut sum = inputs[r].clone();
        c.all_reduce(&mut sum, ReduceOp::Sum).map_err(|e| e.to_string())?;
        let mut mean = inputs[r].clone();
        c.all_reduce(&mut mean, ReduceOp::Mean).map_err(|e| e.to_string())?;
        for i in 0..len {
            let want: f64 = inputs.iter().map(|x| f64::from(x[i])).sum();
            let abs: f64 = inputs.iter().map(|x| f64::from(x[i]).abs()).sum();
            let tol = abs * f64::from(f32::EPSILON) * (n as f64 + 1.0) + 1e-30;
            if (f64::from(sum[i]) - want).abs() > tol {
                return Err(format!("len {len}: sum[{i}] = {} but reference {want}", sum[i]));
            }
            if mean[i].to_bits() != (sum[i] / n as f32).to_bits() {
                return Err(format!("len {len}: mean[{i}] = {} != sum / K = {}", mean[i], sum[i] / n as f32));
            }
        }
        for (what, v) in [("sum", &sum), ("mean", &mean)] {
            let mut h = hash(v).to_le_bytes().to_vec();
            c.broadcast_bytes(&mut h, 0).map_err(|e| e.to_string())?;
            if h != hash(v).to_le_bytes() {
                return Err(format!("len {len}: {what} on rank {r} is not bit-identical to rank 0"));
            }
        }
        cases += 2;
        for root in 0..n {
            let mut b = input(100 + li as u64, r, len);
            c.broadcast(&mut b, root).map_err(|e| e.to_string())?;
            if b != input(100 + li as u64, root, len) {
                return Err(format!("len {len}: broadcast from {root} wrong on rank {r}"));
            }
            cases += 1;
        }
    }
    c.barrier().map_err(|e| e.to_string())?;
    let mut bytes = if r == n - 1 { b"job config".to_vec() } else { Vec::new() };
    c.broadcast_bytes(&mut bytes, n - 1).map_err(|e| e.to_string())?;
    if bytes != b"job config" {
        return Err(format!("broadcast_bytes wrong on rank {r}: {bytes:?}"));
    }
    cases += 2;
    if n > 1 {
        // A rank with a different length must make the call fail everywhere, not hang or mix.
        let mut b = vec![1.0f32; if r == 1 { 11 } else { 10 }];
        match c.all_reduce(&mut b, ReduceOp::Sum) {
            Err(e) if e.to_string().contains("length") => cases += 1,
            Err(e) => {
                return Err(format!("divergence reported without naming the length: {e}"));
            }
            Ok(()) => return Err("diverging lengths were not detected".into()),
        }
    }
    Ok(cases)
}

fn main() {
    let mut c = match MpiComm::init() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("mpi_check: {e}");
            std::process::exit(2);
        }
    };
    let n = c.world_size();
    match run(&mut c) {
        Ok(cases) => {
            if c.rank() == 0 {
                println!("mpi_check: {n} ranks, {cases} cases passed");
            }
        }
        Err(e) => {
            eprintln!("mpi_check: rank {} FAILED: {e}", c.rank());
            std::process::exit(1);
        }
    }
}
