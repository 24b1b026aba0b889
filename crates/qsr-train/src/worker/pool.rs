//! The rayon pool a worker computes in. burn's CPU backend (flex) splits its ops with rayon; called from
//! a thread outside any pool, every op is handed to the global pool and waited for, and K workers share
//! that one pool. Inside a pool of its own, a worker's ops start on its own thread.

use anyhow::{Context, Result};

/// Intra-op threads of each of `workers` workers in this process: the global pool's threads (the cores,
/// or `RAYON_NUM_THREADS`) shared between them, at least one each.
pub(crate) fn intra_op_threads(workers: usize) -> usize {
    qsr_launch::threads_per_rank(workers)
}

/// Runs `f` on a new rayon pool of `threads` threads, named after `rank`.
pub(crate) fn in_pool<T: Send>(rank: usize, threads: usize, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(move |i| format!("worker-{rank}-{i}"))
        .build()
        .with_context(|| format!("cannot start worker {rank}'s {threads} compute threads"))?;
    pool.install(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_computes_inside_a_pool_of_its_share_of_the_threads() {
        let process = rayon::ThreadPoolBuilder::new().num_threads(4).build().unwrap();
        process.install(|| {
            assert_eq!((intra_op_threads(2), intra_op_threads(3), intra_op_threads(8)), (2, 1, 1));
            let inside = in_pool(3, intra_op_threads(2), || {
                let name = std::thread::current().name().map(String::from);
                Ok((rayon::current_num_threads(), rayon::current_thread_index().is_some(), name))
            })
            .unwrap();
            assert_eq!(inside.0, 2);
            assert!(inside.1, "the worker's code runs on a thread of its pool");
            assert!(inside.2.as_deref().is_some_and(|n| n.starts_with("worker-3-")), "{:?}", inside.2);
        });
    }
}
