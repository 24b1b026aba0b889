//! All-reduce across processes: run it as the ranks of a launch (`qsr launch`, torchrun, mpirun,
//! srun); each rank gets its collective from `qsr_comm::from_env()`: shared memory here, all ranks being
//! on this host (`QSR_TRANSPORT=tcp` keeps qsr's TCP ring). Run alone, it is a group of one.
//!
//! ```sh
//! cargo build --release -p qsr-comm --example allreduce_processes && cargo build --release --bin qsr
//! target/release/qsr launch --nproc 2 -- target/release/examples/allreduce_processes
//! ```

use qsr_comm::ReduceOp;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut comm = qsr_comm::from_env()?;
    let k = comm.world_size();
    let mut buf: Vec<f32> = (0..1 << 16).map(|i| (comm.rank() * 10 + i % 7) as f32).collect();
    comm.all_reduce(&mut buf, ReduceOp::Sum)?;
    // Rank r holds 10 r + i % 7: the sum is 10 k (k - 1) / 2 + k (i % 7).
    let expected = |i: usize| (10 * k * (k - 1) / 2 + k * (i % 7)) as f32;
    if let Some(i) = (0..buf.len()).find(|&i| buf[i] != expected(i)) {
        return Err(format!("element {i}: {} instead of {}", buf[i], expected(i)).into());
    }
    println!("rank {} of {k}: sum of {} floats over the {} backend is correct", comm.rank(), buf.len(), comm.backend());
    Ok(())
}
