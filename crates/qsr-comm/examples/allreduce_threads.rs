//! All-reduce across K threads of one process (the in-process group simulated workers use): every rank
//! contributes `rank + i` at index `i`, and every rank ends with the same mean, bit for bit.
//!
//! ```sh
//! cargo run --release -p qsr-comm --example allreduce_threads
//! ```

use qsr_comm::{Collective, ReduceOp};

fn main() {
    let k = 4;
    let results = qsr_comm::run_threads(k, |mut comm| {
        let mut buf: Vec<f32> = (0..1000).map(|i| (comm.rank() + i) as f32).collect();
        comm.all_reduce(&mut buf, ReduceOp::Mean).expect("all-reduce");
        buf
    });
    let expected: Vec<f32> = (0..1000).map(|i| (0..k).map(|r| (r + i) as f32).sum::<f32>() / k as f32).collect();
    assert!(results.iter().all(|b| b == &expected), "every rank holds the mean");
    println!("{k} threads: all-reduce mean of 1000 floats, identical on every rank (buf[0] = {})", results[0][0]);
}
