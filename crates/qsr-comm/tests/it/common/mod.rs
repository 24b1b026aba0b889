//! Helpers shared by the integration tests: seeded inputs, an f64 reference, group builders.
#![allow(dead_code)]

use std::time::Duration;

use qsr_comm::{Collective, CommError, MasterListener, ReduceOp, TcpComm, TcpConfig};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Buffer lengths every backend is tested with for world size `n`: empty, one element, fewer
/// elements than ranks, not divisible by the world size, and several MiB.
pub(crate) fn lengths(n: usize) -> Vec<usize> {
    let mut v = vec![0, 1, n.saturating_sub(1), 1000 * n + 3, (3 << 20) / 4 + 2 * n + 1];
    v.dedup();
    v
}

/// Rank `rank`'s input: seeded, values of mixed sign and magnitude.
pub(crate) fn input(seed: u64, rank: usize, len: usize) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ ((rank as u64 + 1) << 32));
    (0..len).map(|_| rng.random_range(-1.0f32..1.0) * if rng.random_bool(0.1) { 1000.0 } else { 1.0 }).collect()
}

/// Checks `got` (the result on every rank) against an f64 reference of the inputs, bit-identity
/// across ranks, and (for mean) `mean == sum / K` against the sum results.
pub(crate) fn check(inputs: &[Vec<f32>], got: &[Vec<f32>], op: ReduceOp, what: &str) {
    let k = inputs.len();
    let len = inputs[0].len();
    for (r, g) in got.iter().enumerate() {
        assert_eq!(g.len(), len, "{what}: rank {r} length");
        for i in 0..len {
            assert_eq!(g[i].to_bits(), got[0][i].to_bits(), "{what}: rank {r} differs from rank 0 at {i}");
        }
    }
    for i in 0..len {
        let sum: f64 = inputs.iter().map(|x| f64::from(x[i])).sum();
        let abs: f64 = inputs.iter().map(|x| f64::from(x[i]).abs()).sum();
        let want = if op == ReduceOp::Mean { sum / k as f64 } else { sum };
        let scale = if op == ReduceOp::Mean { abs / k as f64 } else { abs };
        let tol = scale * f64::from(f32::EPSILON) * (k as f64 + 1.0) + 1e-30;
        let diff = (f64::from(got[0][i]) - want).abs();
        assert!(diff <= tol, "{what}: element {i}: got {} want {want} (tol {tol})", got[0][i]);
    }
}

/// Runs `f` on every communicator in its own thread and returns the results in rank order.
pub(crate) fn on_threads<C, T, F>(comms: Vec<C>, f: F) -> Vec<T>
where
    C: Send + 'static,
    T: Send + 'static,
    F: Fn(C) -> T + Send + Sync + 'static,
{
    let f = std::sync::Arc::new(f);
    let handles: Vec<_> = comms
        .into_iter()
        .map(|c| {
            let f = std::sync::Arc::clone(&f);
            std::thread::spawn(move || f(c))
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
}

pub(crate) fn test_config() -> TcpConfig {
    TcpConfig {
        timeout: Duration::from_secs(10),
        rendezvous_timeout: Duration::from_secs(20),
        hello_timeout: Duration::from_secs(2),
        token: "test-token".into(),
        ..TcpConfig::default()
    }
}

/// A TCP ring of `n` ranks over loopback, set up from threads of this process.
pub(crate) fn tcp_group(n: usize, cfg: TcpConfig) -> Vec<TcpComm> {
    let listener = MasterListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let workers: Vec<_> = (1..n)
        .map(|r| {
            let (addr, cfg) = (addr.clone(), cfg.clone());
            std::thread::spawn(move || TcpComm::worker(&addr, r, n, cfg))
        })
        .collect();
    let master = TcpComm::master(listener, n, cfg);
    let mut out = vec![master.expect("rank 0 setup")];
    for (i, w) in workers.into_iter().enumerate() {
        out.push(w.join().expect("join").unwrap_or_else(|e| panic!("rank {} setup: {e}", i + 1)));
    }
    out
}

/// A group of `n` boxed handles: a TCP ring over loopback, or the in-process group.
pub(crate) fn boxed_group(n: usize, tcp: bool) -> Vec<Box<dyn Collective>> {
    if tcp {
        tcp_group(n, test_config()).into_iter().map(|c| Box::new(c) as Box<dyn Collective>).collect()
    } else {
        qsr_comm::InProcessGroup::new(n).into_iter().map(|c| Box::new(c) as Box<dyn Collective>).collect()
    }
}

/// The full correctness matrix for one group (called with the group's handles).
pub(crate) fn matrix<C: Collective + 'static>(make: impl Fn(usize) -> Vec<C>, sizes: &[usize]) {
    for &n in sizes {
        let comms = make(n);
        let results = on_threads(comms, move |mut c| -> Result<Vec<(String, Vec<f32>)>, CommError> {
            let mut out = Vec::new();
            let r = c.rank();
            for (li, len) in lengths(n).into_iter().enumerate() {
                for op in [ReduceOp::Sum, ReduceOp::Mean] {
                    let mut buf = input(li as u64, r, len);
                    c.all_reduce(&mut buf, op)?;
                    out.push((format!("n {n} len {len} {op:?}"), buf));
                }
                for root in [0, n - 1] {
                    let mut buf = input(100 + li as u64, r, len);
                    c.broadcast(&mut buf, root)?;
                    out.push((format!("n {n} len {len} broadcast root {root}"), buf));
                }
            }
            c.barrier()?;
            let mut bytes = if r == n / 2 { b"config: h_base=4".to_vec() } else { vec![7u8; 3] };
            c.broadcast_bytes(&mut bytes, n / 2)?;
            out.push(("bytes".into(), bytes.iter().map(|&b| f32::from(b)).collect()));
            let s = *c.stats();
            assert!(s.calls >= (lengths(n).len() * 4 + 2) as u64, "stats.calls {}", s.calls);
            Ok(out)
        });
        let results: Vec<Vec<(String, Vec<f32>)>> =
            results.into_iter().enumerate().map(|(r, x)| x.unwrap_or_else(|e| panic!("rank {r}: {e}"))).collect();
        let mut idx = 0;
        for (li, len) in lengths(n).into_iter().enumerate() {
            let inputs: Vec<Vec<f32>> = (0..n).map(|r| input(li as u64, r, len)).collect();
            let sum: Vec<Vec<f32>> = results.iter().map(|r| r[idx].1.clone()).collect();
            check(&inputs, &sum, ReduceOp::Sum, &results[0][idx].0);
            let mean: Vec<Vec<f32>> = results.iter().map(|r| r[idx + 1].1.clone()).collect();
            check(&inputs, &mean, ReduceOp::Mean, &results[0][idx + 1].0);
            for i in 0..len {
                assert_eq!(
                    mean[0][i].to_bits(),
                    (sum[0][i] / n as f32).to_bits(),
                    "mean != sum / K at {i} (n {n} len {len})"
                );
            }
            for (j, root) in [0, n - 1].into_iter().enumerate() {
                let want = input(100 + li as u64, root, len);
                for (r, res) in results.iter().enumerate() {
                    assert_eq!(res[idx + 2 + j].1, want, "{} on rank {r}", res[idx + 2 + j].0);
                }
            }
            idx += 4;
        }
        let want: Vec<f32> = b"config: h_base=4".iter().map(|&b| f32::from(b)).collect();
        for (r, res) in results.iter().enumerate() {
            assert_eq!(res[idx].1, want, "broadcast_bytes on rank {r}");
        }
    }
}

/// A phrase a message states twice ("job token differs (job token differs ..."), if any: a
/// repeated pair of words of three or more letters each (so that "rank 1 ... rank 1" in a message
/// naming two ranks, or "block 0 with ..., expected block 0 with", does not count).
pub(crate) fn repeated_phrase(msg: &str) -> Option<String> {
    let words: Vec<String> = msg
        .split_whitespace()
        .map(|w| w.trim_matches(|c: char| "()[]{}:;,.?!'\"".contains(c)).to_lowercase())
        .collect();
    let wordy = |w: &String| w.len() >= 3 && w.chars().all(|c| c.is_alphabetic() || c == '_');
    let mut seen = std::collections::HashSet::new();
    words
        .windows(2)
        .filter(|pair| pair.iter().all(wordy))
        .map(|pair| pair.join(" "))
        .find(|phrase| !seen.insert(phrase.clone()))
}
