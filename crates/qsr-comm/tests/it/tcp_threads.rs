//! TCP ring with ranks as threads of this process: correctness matrix and handshake refusals.

use qsr_comm::{Collective, ReduceOp};

#[test]
fn matrix_world_sizes_1_2_3_5() {
    crate::common::matrix(|n| crate::common::tcp_group(n, crate::common::test_config()), &[1, 2, 3, 5]);
}

#[test]
fn small_chunks_and_large_buffer() {
    // Tiny blocks stress the pipelining: thousands of frames per call.
    let mut cfg = crate::common::test_config();
    cfg.chunk_bytes = 4096;
    let n = 3;
    let len = 300_001;
    let got = crate::common::on_threads(crate::common::tcp_group(n, cfg), move |mut c| {
        let mut b = crate::common::input(77, c.rank(), len);
        c.all_reduce(&mut b, ReduceOp::Sum).unwrap();
        b
    });
    let inputs: Vec<_> = (0..n).map(|r| crate::common::input(77, r, len)).collect();
    crate::common::check(&inputs, &got, ReduceOp::Sum, "chunk 4096");
}

/// The NCCL unique id travels over the TCP ring exactly as `NcclComm::init` sends it: rank 0's
/// 128 bytes reach every rank, and a failure on rank 0 (no libnccl there) reaches every rank as an
/// error instead of a hang.
#[test]
fn nccl_unique_id_exchange_over_tcp() {
    let id: [u8; 128] = std::array::from_fn(|i| (255 - i) as u8);
    let got = crate::common::on_threads(crate::common::tcp_group(3, crate::common::test_config()), move |mut c| {
        qsr_comm::share_unique_id(&mut c, || Ok(id)).map_err(|e| e.to_string())
    });
    assert!(got.iter().all(|r| r.as_ref() == Ok(&id)), "{got:?}");

    let got = crate::common::on_threads(crate::common::tcp_group(3, crate::common::test_config()), |mut c| {
        let r = qsr_comm::share_unique_id::<128>(&mut c, || Err("cannot load libnccl.so.2".into()));
        // The ring keeps working after a refused id (every rank made the same call).
        let mut x = [c.rank() as f32];
        c.all_reduce(&mut x, ReduceOp::Sum).unwrap();
        (r.map_err(|e| e.to_string()), x[0])
    });
    for (r, sum) in got {
        let e = r.unwrap_err();
        assert!(e.contains("rank 0 could not create the unique id: cannot load libnccl.so.2"), "{e}");
        assert_eq!(sum, 3.0);
    }
}
