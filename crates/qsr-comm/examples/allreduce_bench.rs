//! All-reduce sweep in nccl-tests form (size, count, time, algbw, busbw = algbw * 2(n-1)/n,
//! #wrong), for our transports (`tcp`: the TCP ring; `shm`: shared memory; `auto`: what
//! `qsr_comm::connect` picks), MPI_Allreduce through our MPI backend, and the physical references:
//! raw loopback TCP (every rank streams the same bytes to its right neighbour over a plain socket,
//! no reduction, so its busbw is the per-link bandwidth a ring can at best reach) and `raw-shm`
//! (one memcpy of the buffer per call: what a copy through shared memory costs at least).
//!
//! ```text
//! cargo run -p qsr-comm --release --example allreduce_bench -- --backend tcp --ranks 4
//! cargo run -p qsr-comm --release --example allreduce_bench -- --backend shm --ranks 4
//! cargo run -p qsr-comm --release --example allreduce_bench -- --backend raw-tcp --ranks 4
//! cargo build -p qsr-comm --release --features mpi --example allreduce_bench
//! mpirun --allow-run-as-root --oversubscribe -np 4 target/release/examples/allreduce_bench --backend mpi
//! ```
//! Options: `--min-bytes 4096 --max-bytes 268435456 --iters N --warmup N --json FILE
//! --chunk-bytes N --socket-buffer N --doubling-bytes N --one-stage-bytes N` (the last for `shm`),
//! `--wire int8|fp8` (block-scaled payloads, `Collective::all_reduce_quantized`; sizes stay those of
//! the f32 buffer, `wire_bytes` is what rank 0 sent per call, and `#wrong` counts values further from
//! the exact sum than `ranks` steps of the buffer's largest sum). For `tcp`, `shm` and `auto` the ranks
//! are child processes of this program on 127.0.0.1 (rank 0 is the parent); time is the median of
//! per-call times on rank 0.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use qsr_comm::{Codec, Collective, MasterListener, ReduceOp, ShmConfig, TcpComm, TcpConfig, Transport};

#[derive(Clone, Debug)]
struct Args {
    backend: String,
    ranks: usize,
    min_bytes: usize,
    max_bytes: usize,
    iters: Option<usize>,
    warmup: usize,
    json: Option<String>,
    chunk_bytes: Option<usize>,
    socket_buffer: Option<usize>,
    one_stage_bytes: Option<usize>,
    doubling_bytes: Option<usize>,
    child_rank: Option<usize>,
    master: Option<String>,
    /// Block-scaled payloads instead of f32 (`--wire int8|fp8`).
    codec: Option<Codec>,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        backend: "tcp".into(),
        ranks: 2,
        min_bytes: 4 << 10,
        max_bytes: 256 << 20,
        iters: None,
        warmup: 3,
        json: None,
        chunk_bytes: None,
        socket_buffer: None,
        one_stage_bytes: None,
        doubling_bytes: None,
        child_rank: None,
        master: None,
        codec: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().ok_or_else(|| format!("{k} needs a value"));
        let num = |s: String| s.parse::<usize>().map_err(|_| format!("bad number {s}"));
        match k.as_str() {
            "--backend" => a.backend = v()?,
            "--ranks" => a.ranks = num(v()?)?,
            "--min-bytes" => a.min_bytes = num(v()?)?,
            "--max-bytes" => a.max_bytes = num(v()?)?,
            "--iters" => a.iters = Some(num(v()?)?),
            "--warmup" => a.warmup = num(v()?)?,
            "--json" => a.json = Some(v()?),
            "--chunk-bytes" => a.chunk_bytes = Some(num(v()?)?),
            "--socket-buffer" => a.socket_buffer = Some(num(v()?)?),
            "--one-stage-bytes" => a.one_stage_bytes = Some(num(v()?)?),
            "--doubling-bytes" => a.doubling_bytes = Some(num(v()?)?),
            "--child-rank" => a.child_rank = Some(num(v()?)?),
            "--master" => a.master = Some(v()?),
            "--wire" => {
                a.codec = match v()?.as_str() {
                    "f32" => None,
                    "int8" => Some(Codec::Int8),
                    "fp8" => Some(Codec::Fp8E4m3),
                    "int4" => Some(Codec::Int4),
                    "int2" => Some(Codec::Int2),
                    w => return Err(format!("--wire {w}: expected f32, int8, fp8, int4 or int2")),
                }
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(a)
}

fn sizes(a: &Args) -> Vec<usize> {
    let mut s = Vec::new();
    let mut b = a.min_bytes.max(4);
    while b <= a.max_bytes {
        s.push(b);
        b *= 4;
    }
    s
}

fn iters_for(a: &Args, bytes: usize) -> usize {
    a.iters.unwrap_or_else(|| ((1usize << 30) / bytes).clamp(5, 100))
}

#[derive(Debug, Clone)]
struct Row {
    bytes: usize,
    count: usize,
    time_us: f64,
    algbw: f64,
    busbw: f64,
    wrong: usize,
    /// Bytes rank 0 sent per call.
    wire_bytes: u64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Input of rank r: small multiples of 0.25, so every sum is exact and #wrong is exact.
fn fill(buf: &mut [f32], rank: usize) {
    for (i, x) in buf.iter_mut().enumerate() {
        *x = (i % 61) as f32 * 0.25 + rank as f32;
    }
}

fn sweep(c: &mut dyn Collective, a: &Args) -> Result<Vec<Row>, String> {
    let n = c.world_size();
    let mut rows = Vec::new();
    for bytes in sizes(a) {
        let count = bytes / 4;
        let mut buf = vec![0f32; count];
        let iters = iters_for(a, bytes);
        let mut times = Vec::with_capacity(iters);
        let (mut wrong, mut wire_bytes) = (0, 0);
        for it in 0..a.warmup + iters {
            fill(&mut buf, c.rank());
            // Refilling is not timed; the barrier keeps one rank's refill out of another's time.
            c.barrier().map_err(|e| e.to_string())?;
            let sent = c.stats().bytes_sent;
            let t = Instant::now();
            match a.codec {
                Some(codec) => c.all_reduce_quantized(&mut buf, ReduceOp::Sum, codec),
                None => c.all_reduce(&mut buf, ReduceOp::Sum),
            }
            .map_err(|e| e.to_string())?;
            let dt = t.elapsed().as_secs_f64();
            wire_bytes = c.stats().bytes_sent - sent;
            if it >= a.warmup {
                times.push(dt);
            }
            if it + 1 == a.warmup + iters {
                wrong = count_wrong(&buf, n, a.codec.is_some());
            }
        }
        let t = median(times);
        let algbw = bytes as f64 / t / 1e9;
        rows.push(Row {
            bytes,
            count,
            time_us: t * 1e6,
            algbw,
            busbw: algbw * 2.0 * (n as f64 - 1.0) / n as f64,
            wrong,
            wire_bytes,
        });
    }
    Ok(rows)
}

/// Values of the sum of [`fill`]'s inputs over `n` ranks that are wrong: not exact in f32, or, for a
/// quantized sum, further off than `n` steps of 1/127 of the largest sum (each hop rounds once).
fn count_wrong(buf: &[f32], n: usize, quantized: bool) -> usize {
    let ranks_sum = (n * (n - 1) / 2) as f32;
    let exact = |i: usize| (i % 61) as f32 * 0.25 * n as f32 + ranks_sum;
    let tolerance = if quantized { n as f32 * (60.0 * 0.25 * n as f32 + ranks_sum) / 127.0 } else { 0.0 };
    buf.iter().enumerate().filter(|&(i, x)| (x - exact(i)).abs() > tolerance || x.is_nan()).count()
}

/// Raw loopback reference: n ranks (a sender and a receiver thread each) in a ring, each streaming
/// messages of `bytes` to the right over a plain TCP socket while receiving from the left.
/// time = sustained time per message on rank 0's link; busbw = bytes / time (the per-link rate).
fn raw_sweep(a: &Args) -> Result<Vec<Row>, String> {
    let n = a.ranks.max(2);
    let listeners: Vec<TcpListener> =
        (0..n).map(|_| TcpListener::bind("127.0.0.1:0")).collect::<Result<_, _>>().map_err(|e| e.to_string())?;
    let addrs: Vec<_> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    let rights: Vec<TcpStream> =
        (0..n).map(|r| TcpStream::connect(addrs[(r + 1) % n])).collect::<Result<_, _>>().map_err(|e| e.to_string())?;
    let lefts: Vec<TcpStream> =
        listeners.iter().map(|l| l.accept().map(|x| x.0)).collect::<Result<_, _>>().map_err(|e| e.to_string())?;
    let sizes = sizes(a);
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(2 * n));
    let mut handles = Vec::new();
    for (r, (mut right, mut left)) in rights.into_iter().zip(lefts).enumerate() {
        for s in [&right, &left] {
            s.set_nodelay(true).map_err(|e| e.to_string())?;
            if let Some(b) = a.socket_buffer {
                let sr = socket2::SockRef::from(s);
                let _ = sr.set_send_buffer_size(b);
                let _ = sr.set_recv_buffer_size(b);
            }
        }
        let (sizes_s, a_s, bar_s) = (sizes.clone(), a.clone(), barrier.clone());
        handles.push(std::thread::spawn(move || -> Vec<f64> {
            // Streaming: after one barrier per size, warmup + iters messages back to back.
            for &bytes in &sizes_s {
                let buf = vec![1u8; bytes];
                bar_s.wait();
                for _ in 0..a_s.warmup + iters_for(&a_s, bytes) {
                    right.write_all(&buf).unwrap();
                }
            }
            Vec::new()
        }));
        let (sizes_r, a_r, bar_r) = (sizes.clone(), a.clone(), barrier.clone());
        handles.push(std::thread::spawn(move || -> Vec<f64> {
            let mut out = Vec::new();
            for &bytes in &sizes_r {
                let mut buf = vec![0u8; bytes];
                let iters = iters_for(&a_r, bytes);
                bar_r.wait();
                for _ in 0..a_r.warmup {
                    left.read_exact(&mut buf).unwrap();
                }
                let t = Instant::now();
                for _ in 0..iters {
                    left.read_exact(&mut buf).unwrap();
                }
                out.push(if r == 0 { t.elapsed().as_secs_f64() / iters as f64 } else { 0.0 });
            }
            out
        }));
    }
    let results: Vec<Vec<f64>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    // Receiver of rank 0 is handle index 1.
    Ok(sizes
        .iter()
        .enumerate()
        .map(|(i, &bytes)| {
            let t = results[1][i];
            let bw = bytes as f64 / t / 1e9;
            Row { bytes, count: bytes / 4, time_us: t * 1e6, algbw: bw, busbw: bw, wrong: 0, wire_bytes: bytes as u64 }
        })
        .collect())
}

fn print(a: &Args, n: usize, rows: &[Row]) {
    println!("# backend {} ranks {n}", a.backend);
    println!(
        "# {:>12} {:>10} {:>12} {:>10} {:>10} {:>7} {:>12}",
        "size", "count", "time_us", "algbw_GB/s", "busbw_GB/s", "#wrong", "wire_bytes"
    );
    for r in rows {
        println!(
            "  {:>12} {:>10} {:>12.1} {:>10.3} {:>10.3} {:>7} {:>12}",
            r.bytes, r.count, r.time_us, r.algbw, r.busbw, r.wrong, r.wire_bytes
        );
    }
    if let Some(path) = &a.json {
        let v: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| {
                serde_json::json!({"backend": a.backend, "ranks": n, "bytes": r.bytes, "count": r.count,
                    "time_us": r.time_us, "algbw_gbs": r.algbw, "busbw_gbs": r.busbw, "wrong": r.wrong,
                    "wire_bytes": r.wire_bytes})
            })
            .collect();
        let text = serde_json::to_string_pretty(&v).unwrap_or_default();
        if let Err(e) = qsr_files::write_atomic(std::path::Path::new(path), text.as_bytes(), "results file") {
            eprintln!("{e}");
        }
    }
}

fn tcp_config(a: &Args) -> TcpConfig {
    let mut cfg = TcpConfig { token: "bench".into(), timeout: Duration::from_secs(60), ..TcpConfig::default() };
    if let Some(c) = a.chunk_bytes {
        cfg.chunk_bytes = c;
    }
    cfg.socket_buffer = a.socket_buffer;
    if let Some(d) = a.doubling_bytes {
        cfg.doubling_bytes = d;
    }
    cfg
}

fn main() {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("allreduce_bench: {e}");
            std::process::exit(2);
        }
    };
    let result = match a.backend.as_str() {
        "raw-tcp" => raw_sweep(&a).map(|rows| print(&a, a.ranks.max(2), &rows)),
        "raw-shm" => {
            print(&a, a.ranks.max(2), &memcpy_sweep(&a));
            Ok(())
        }
        "tcp" => run_ours(&a, Transport::Tcp),
        "shm" => run_ours(&a, Transport::Shm),
        "auto" => run_ours(&a, Transport::Auto),
        "mpi" => run_mpi(&a),
        other => Err(format!("unknown backend {other} (tcp, shm, auto, raw-tcp, raw-shm, mpi)")),
    };
    if let Err(e) = result {
        eprintln!("allreduce_bench: {e}");
        std::process::exit(1);
    }
}

/// Our collective over the ring `boot`, on the transport asked for.
fn ours(boot: TcpComm, transport: Transport, a: &Args) -> Result<Box<dyn Collective>, String> {
    let mut shm = ShmConfig { timeout: boot.config().timeout, ..ShmConfig::default() };
    if let Some(b) = a.one_stage_bytes {
        shm.one_stage_bytes = b;
    }
    let host = qsr_comm::host_id(&|k| std::env::var(k).ok(), &shm);
    qsr_comm::over_ring(boot, transport, &host, shm).map_err(|e| e.to_string())
}

/// The memcpy reference: one copy of the buffer per call (median time per copy).
fn memcpy_sweep(a: &Args) -> Vec<Row> {
    sizes(a)
        .into_iter()
        .map(|bytes| {
            let src = vec![1u8; bytes];
            let mut dst = vec![0u8; bytes];
            let times: Vec<f64> = (0..a.warmup + iters_for(a, bytes))
                .map(|_| {
                    let t = Instant::now();
                    dst.copy_from_slice(std::hint::black_box(&src));
                    std::hint::black_box(&mut dst);
                    t.elapsed().as_secs_f64()
                })
                .skip(a.warmup)
                .collect();
            let t = median(times);
            let bw = bytes as f64 / t / 1e9;
            Row { bytes, count: bytes / 4, time_us: t * 1e6, algbw: bw, busbw: bw, wrong: 0, wire_bytes: bytes as u64 }
        })
        .collect()
}

fn run_ours(a: &Args, transport: Transport) -> Result<(), String> {
    if let (Some(rank), Some(master)) = (a.child_rank, &a.master) {
        let boot = TcpComm::worker(master, rank, a.ranks, tcp_config(a)).map_err(|e| e.to_string())?;
        return sweep(ours(boot, transport, a)?.as_mut(), a).map(|_| ());
    }
    let listener = MasterListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let master = listener.local_addr().map_err(|e| e.to_string())?.to_string();
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut kids = Vec::new();
    for r in 1..a.ranks {
        let mut cmd = Command::new(&exe);
        cmd.args(std::env::args().skip(1)).args(["--child-rank", &r.to_string(), "--master", &master]);
        cmd.stdout(Stdio::null());
        kids.push(cmd.spawn().map_err(|e| e.to_string())?);
    }
    let boot = TcpComm::master(listener, a.ranks, tcp_config(a)).map_err(|e| e.to_string())?;
    let mut c = ours(boot, transport, a)?;
    eprintln!("allreduce_bench: {} ranks on {}", a.ranks, c.backend());
    let rows = sweep(c.as_mut(), a)?;
    print(a, a.ranks, &rows);
    for mut k in kids {
        let st = k.wait().map_err(|e| e.to_string())?;
        if !st.success() {
            return Err(format!("a child rank failed: {st}"));
        }
    }
    Ok(())
}

#[cfg(feature = "mpi")]
fn run_mpi(a: &Args) -> Result<(), String> {
    let mut c = qsr_comm::MpiComm::init().map_err(|e| e.to_string())?;
    let rows = sweep(&mut c, a)?;
    if c.rank() == 0 {
        print(a, c.world_size(), &rows);
    }
    Ok(())
}

#[cfg(not(feature = "mpi"))]
fn run_mpi(_: &Args) -> Result<(), String> {
    Err("built without the `mpi` feature: cargo build --release --features mpi --example allreduce_bench".into())
}
