//! All-reduce across two processes: run without arguments, it starts itself twice with the variables
//! torchrun would set (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, and a job token), and each child
//! gets its collective from `qsr_comm::from_env()`: shared memory here, both being on this host
//! (`QSR_TRANSPORT=tcp` keeps qsr's TCP ring).
//!
//! ```sh
//! cargo run --release -p qsr-comm --example allreduce_processes
//! ```

use std::process::Command;

use qsr_comm::ReduceOp;

fn child() -> Result<(), Box<dyn std::error::Error>> {
    let mut comm = qsr_comm::from_env()?;
    let mut buf: Vec<f32> = (0..1 << 16).map(|i| (comm.rank() * 10 + i % 7) as f32).collect();
    comm.all_reduce(&mut buf, ReduceOp::Sum)?;
    // rank 0 holds i % 7, rank 1 holds 10 + i % 7: the sum is 10 + 2 (i % 7).
    assert!(buf.iter().enumerate().all(|(i, &x)| x == (10 + 2 * (i % 7)) as f32));
    println!(
        "rank {} of {}: sum of {} floats over the {} backend is correct",
        comm.rank(),
        comm.world_size(),
        buf.len(),
        comm.backend()
    );
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var("RANK").is_ok() {
        return child();
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port().to_string();
    let token = qsr_comm::random_token();
    let exe = std::env::current_exe()?;
    let children: Vec<_> = (0..2)
        .map(|rank| {
            Command::new(&exe)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("QSR_JOB_TOKEN", &token)
                .spawn()
        })
        .collect::<Result<_, _>>()?;
    for mut c in children {
        if !c.wait()?.success() {
            return Err("a rank failed".into());
        }
    }
    Ok(())
}
