//! TCP ring with ranks as threads of this process: correctness matrix and handshake refusals.

mod common;

use qsr_comm::{Collective, ReduceOp};

#[test]
fn matrix_world_sizes_1_2_3_5() {
    common::matrix(
        |n| common::tcp_group(n, common::test_config()),
        &[1, 2, 3, 5],
    );
}

#[test]
fn small_chunks_and_large_buffer() {
    // Tiny blocks stress the pipelining: thousands of frames per call.
    let mut cfg = common::test_config();
    cfg.chunk_bytes = 4096;
    let n = 3;
    let len = 300_001;
    let got = common::on_threads(common::tcp_group(n, cfg), move |mut c| {
        let mut b = common::input(77, c.rank(), len);
        c.all_reduce(&mut b, ReduceOp::Sum).unwrap();
        b
    });
    let inputs: Vec<_> = (0..n).map(|r| common::input(77, r, len)).collect();
    common::check(&inputs, &got, ReduceOp::Sum, "chunk 4096");
}
