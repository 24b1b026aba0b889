//! `cargo xtask netem`: wall-clock of data parallel, constant H and QSR over an emulated network.
//!
//! As root, builds K network namespaces (`qsrnet-w0..`) whose `eth0` is one end of a veth pair; the
//! other ends sit on a bridge inside one more namespace (`qsrnet-br`), so every address (10.77.0.x/24)
//! and every packet stays inside namespaces this command created. Each link is shaped with `tc`: a
//! `tbf` of rate R on the worker side (upload) and on the bridge side (download), i.e. a full-duplex
//! NIC of R per worker, and a `netem delay D` on the worker side (one-way latency D) where the kernel
//! has netem; where it does not (`CONFIG_NET_SCH_NETEM` unset), the delay is the veth's own, measured
//! and reported. Then `qsr train` runs as one process per
//! namespace over the TCP ring, for each rule and each rate (plus an unshaped run, which measures the
//! compute time per step), and the per-epoch and total wall-clock is tabulated.
//!
//! Everything is torn down on the way out, also on errors and panics ([`Topology`]'s and [`Job`]'s
//! `Drop`), and leftovers of an interrupted run are removed at start by their name prefix.

use std::fmt::Write as _;
use std::fs::File;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};

/// Name prefix of everything `cargo xtask netem` creates.
pub(crate) const PREFIX: &str = "qsrnet-";

/// Arguments of `cargo xtask netem`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct NetemArgs {
    /// K: worker namespaces, one `qsr train` process each.
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// Workers per simulated node: consecutive namespaces share a `QSR_HOST_ID`, so inside a node
    /// the ranks talk through shared memory (unshaped) and only the nodes' leaders use the shaped
    /// links. Default 1: every namespace is a host of its own.
    #[arg(long, default_value_t = 1)]
    pub workers_per_node: usize,
    /// Link rates (tc units), comma separated; each gets a full sweep of the rules.
    #[arg(long, value_delimiter = ',', default_value = "1gbit,10gbit")]
    pub rates: Vec<String>,
    /// One-way delay of every worker link (tc units; needs netem in the kernel, else the veth's own
    /// latency is used and reported).
    #[arg(long, default_value = "0.2ms")]
    pub delay: String,
    /// Skip the sweep on the unshaped link (it gives the simulator's compute time per step).
    #[arg(long)]
    pub no_unshaped: bool,
    /// Epochs per run.
    #[arg(long, default_value_t = 3)]
    pub epochs: u64,
    /// Samples per worker per step. Small, so that data parallel is communication-bound on this CPU, as
    /// on the paper's GPUs (compute per step grows with the batch, communication does not).
    #[arg(long, default_value_t = 8)]
    pub local_batch: u64,
    /// Hidden widths of the MLP on digits (the default gives 10,779,658 parameters).
    #[arg(long, value_delimiter = ',', default_value = "4096,2560")]
    pub hidden: Vec<usize>,
    /// Rules to run: dp, `h<N>` (constant H = N), qsr; `l<N>+<rule>` adds a local level averaging
    /// inside each node every N steps (`[sync.local]`), e.g. `l1+qsr`. Suffixes: `/s<P>` streams in P
    /// fragments (`/s<P>d<tau>` with a delay of tau steps, default 1; `[sync.streaming]`), `/int8` or
    /// `/fp8` quantizes the parameter syncs (`driver.wire`), `/outer` makes them DiLoCo's outer step
    /// (lr 0.7, Nesterov momentum 0.5), e.g. `qsr/s4d2/int8`.
    #[arg(long, value_delimiter = ',', default_value = "dp,h4,qsr")]
    pub rules: Vec<String>,
    /// The recipes' seed (model initialization, data order).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// QSR: h_base.
    #[arg(long, default_value_t = 4)]
    pub h_base: u64,
    /// QSR: alpha (default 0.219 = 2.19 x lr_max, the paper's ViT-B ratio 0.0175 / 0.008).
    #[arg(long, default_value_t = 0.219)]
    pub alpha: f64,
    /// Peak lr of the cosine schedule (SGD, momentum 0.9).
    #[arg(long, default_value_t = 0.1)]
    pub lr_max: f64,
    /// The qsr binary (default target/release/qsr; build it first).
    #[arg(long)]
    pub qsr: Option<PathBuf>,
    /// Where recipes, runs and the results table go.
    #[arg(long, default_value = "runs/netem")]
    pub out: PathBuf,
    /// Seconds one training run may take before it is killed.
    #[arg(long, default_value_t = 240)]
    pub timeout: u64,
    /// Only build the namespaces, shape the links at the first rate, measure rate and round trip, tear down.
    #[arg(long)]
    pub check: bool,
    /// Kill a worker mid-training, `kill:<rank>:<step>`, and run each rule three ways: clean; with
    /// `--elastic` and the worker restarted as soon as it dies (it rejoins at a sync); and without, every
    /// worker stopping and the job restarted from its last checkpoint with `--resume`. Recipes then
    /// evaluate and checkpoint every epoch; the table gives the wall-clock each way lost.
    #[arg(long)]
    pub fault: Option<String>,
    /// Evaluate at every epoch's end (not only the last), without checkpoints: the runs' test accuracy
    /// against wall-clock, for `qsr plot` (each evaluation's time counts in its epoch).
    #[arg(long)]
    pub eval_every_epoch: bool,
}

/// A link shape: rate (tc units, e.g. `1gbit`) and one-way delay (tc units, e.g. `0.2ms`; `None`: the
/// veth's own, for kernels built without netem).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Shape {
    pub rate: String,
    pub delay: Option<String>,
}

/// `tbf` arguments for `rate`: a bucket of 1 ms at that rate (at least 128 KiB, so that a 64 KiB GSO
/// packet fits) and a 20 ms queue.
pub(crate) fn tbf_args(rate: &str) -> Result<Vec<String>> {
    let bits = rate_bits(rate)?;
    let burst = ((bits / 8.0 * 1e-3) as u64).max(128 << 10);
    Ok(["tbf", "rate", rate, "burst", &burst.to_string(), "latency", "20ms"].iter().map(|s| s.to_string()).collect())
}

/// Whether the kernel has the netem qdisc (many VM kernels are built without it).
pub(crate) fn netem_available(t: &Topology) -> bool {
    let ns = t.bridge_ns();
    let ok = sh("tc", &["-n", &ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"]).is_ok();
    let _ = sh("tc", &["-n", &ns, "qdisc", "del", "dev", "lo", "root"]);
    ok
}

/// Runs a command, failing with its stderr.
fn sh(program: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("cannot run {program} (install iproute2)"))?;
    if !out.status.success() {
        bail!("{program} {} failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn ip(args: &[&str]) -> Result<String> {
    sh("ip", args)
}

/// Why this machine cannot run netem, if it cannot: not root, `ip`/`tc` missing, namespaces refused.
pub(crate) fn unavailable() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not root (network namespaces and tc need CAP_NET_ADMIN)".into());
    }
    for tool in ["ip", "tc"] {
        let found = Command::new(tool)
            .arg("-V")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !found {
            return Some(format!("`{tool}` not found (apt-get install iproute2)"));
        }
    }
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let probe = format!("qsrprobe-{}-{n}", std::process::id());
    match ip(&["netns", "add", &probe]) {
        Ok(_) => {
            let _ = ip(&["netns", "del", &probe]);
            None
        }
        Err(e) => Some(format!("the kernel refuses network namespaces: {e:#}")),
    }
}

/// Namespaces whose name starts with `prefix`.
pub(crate) fn namespaces_with_prefix(prefix: &str) -> Result<Vec<String>> {
    Ok(ip(&["netns", "list"])?
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(prefix))
        .map(str::to_string)
        .collect())
}

/// Deletes namespaces named `prefix*` (leftovers of an interrupted run), first stopping the processes
/// still inside them (by pid: only ours run there). Deleting a namespace deletes its veths and qdiscs.
pub(crate) fn cleanup_prefix(prefix: &str) -> Result<usize> {
    let names = namespaces_with_prefix(prefix)?;
    for ns in &names {
        if let Ok(pids) = ip(&["netns", "pids", ns]) {
            for pid in pids.split_whitespace().filter_map(|p| p.parse::<i32>().ok()) {
                // SAFETY: kill(2) with a pid listed in our namespace; errors are ignored.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                }
            }
        }
        let _ = ip(&["netns", "del", ns]);
    }
    Ok(names.len())
}

/// K worker namespaces on one bridge; removed on drop.
pub(crate) struct Topology {
    prefix: String,
    workers: usize,
    created: Vec<String>,
}

impl Topology {
    /// Builds `{prefix}br` (the bridge) and `{prefix}w0..w{K-1}`, worker `i` at 10.77.0.(i+1)/24.
    pub(crate) fn create(prefix: &str, workers: usize) -> Result<Topology> {
        if workers == 0 || workers > 200 {
            bail!("--workers {workers}: must be 1..=200");
        }
        let mut t = Topology { prefix: prefix.to_string(), workers, created: Vec::new() };
        let br = t.bridge_ns();
        ip(&["netns", "add", &br])?;
        t.created.push(br.clone());
        ip(&["-n", &br, "link", "set", "lo", "up"])?;
        ip(&["-n", &br, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &br, "link", "set", "br0", "up"])?;
        for i in 0..workers {
            let ns = t.worker_ns(i);
            ip(&["netns", "add", &ns])?;
            t.created.push(ns.clone());
            let port = format!("p{i}");
            // Both ends are created inside our namespaces: nothing appears in the host's.
            ip(&["-n", &ns, "link", "add", "eth0", "type", "veth", "peer", "name", &port, "netns", &br])?;
            ip(&["-n", &br, "link", "set", &port, "master", "br0"])?;
            ip(&["-n", &br, "link", "set", &port, "up"])?;
            ip(&["-n", &ns, "addr", "add", &format!("{}/24", Self::addr(i)), "dev", "eth0"])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(t)
    }

    pub(crate) fn bridge_ns(&self) -> String {
        format!("{}br", self.prefix)
    }

    pub(crate) fn worker_ns(&self, i: usize) -> String {
        format!("{}w{i}", self.prefix)
    }

    pub(crate) fn workers(&self) -> usize {
        self.workers
    }

    /// Address of worker `i`.
    pub(crate) fn addr(i: usize) -> String {
        format!("10.77.0.{}", i + 1)
    }

    /// Shapes every link (`None`: removes the shaping). Rate: `tbf` on the worker side (upload) and on
    /// the bridge side (download). Delay: a `netem delay D` root with the `tbf` as its child, on the
    /// worker side only, so the one-way latency between two workers is D (needs the kernel's netem).
    pub(crate) fn shape(&self, shape: Option<&Shape>) -> Result<()> {
        let br = self.bridge_ns();
        for i in 0..self.workers {
            let ns = self.worker_ns(i);
            let port = format!("p{i}");
            // Start from the default qdisc (deleting it when it is already the default fails: fine).
            let _ = sh("tc", &["-n", &ns, "qdisc", "del", "dev", "eth0", "root"]);
            let _ = sh("tc", &["-n", &br, "qdisc", "del", "dev", &port, "root"]);
            let Some(s) = shape else { continue };
            let tbf = tbf_args(&s.rate)?;
            let tbf: Vec<&str> = tbf.iter().map(String::as_str).collect();
            match &s.delay {
                Some(d) => {
                    sh(
                        "tc",
                        &[
                            "-n", &ns, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "netem", "delay", d,
                            "limit", "100000",
                        ],
                    )?;
                    sh(
                        "tc",
                        &[&["-n", &ns, "qdisc", "add", "dev", "eth0", "parent", "1:1", "handle", "10:"][..], &tbf]
                            .concat(),
                    )?;
                }
                None => {
                    sh("tc", &[&["-n", &ns, "qdisc", "add", "dev", "eth0", "root"][..], &tbf].concat()).map(|_| ())?
                }
            }
            sh("tc", &[&["-n", &br, "qdisc", "add", "dev", &port, "root"][..], &tbf].concat())?;
        }
        Ok(())
    }

    /// The qdisc line of worker `i`'s link, as `tc qdisc show` prints it.
    pub(crate) fn qdisc(&self, i: usize) -> Result<String> {
        sh("tc", &["-n", &self.worker_ns(i), "qdisc", "show", "dev", "eth0"])
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        for ns in self.created.iter().rev() {
            if let Ok(pids) = ip(&["netns", "pids", ns]) {
                for pid in pids.split_whitespace().filter_map(|p| p.parse::<i32>().ok()) {
                    // SAFETY: kill(2) on a process inside a namespace this value created.
                    unsafe {
                        libc::kill(pid, libc::SIGKILL);
                    }
                }
            }
            if let Err(e) = ip(&["netns", "del", ns]) {
                eprintln!("netem: cannot delete namespace {ns}: {e:#}");
            }
        }
    }
}

/// Runs `f` on a thread that has entered network namespace `ns` (the namespace is per thread).
pub(crate) fn in_netns<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> std::thread::JoinHandle<Result<T>> {
    let path = format!("/run/netns/{ns}");
    std::thread::spawn(move || {
        let file = File::open(&path).with_context(|| format!("cannot open {path}"))?;
        // SAFETY: setns on a valid namespace fd; it changes only this thread's network namespace.
        if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            bail!("setns({path}): {}", std::io::Error::last_os_error());
        }
        f()
    })
}

/// A measured link: payload goodput and TCP round trip.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LinkProbe {
    pub bits_per_second: f64,
    pub rtt_seconds: f64,
}

/// Sends TCP traffic from worker `from` to worker `to` for `seconds` and measures the receiver's goodput
/// (payload bits per second), then the median round trip of 1-byte ping-pongs.
pub(crate) fn probe_link(t: &Topology, from: usize, to: usize, seconds: f64) -> Result<LinkProbe> {
    let addr = format!("{}:5201", Topology::addr(to));
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
    let server = in_netns(&t.worker_ns(to), move || {
        let listener = TcpListener::bind(&addr).with_context(|| format!("bind {addr}"))?;
        let _ = ready_tx.send(());
        // Goodput: from the first byte to EOF.
        let (mut s, _) = listener.accept()?;
        s.set_read_timeout(Some(Duration::from_secs(20)))?;
        let mut buf = vec![0u8; 1 << 20];
        let n = s.read(&mut buf)?;
        let start = Instant::now();
        let mut total = 0u64;
        loop {
            let n = s.read(&mut buf)?;
            if n == 0 {
                break;
            }
            total += n as u64;
        }
        let rate = total as f64 * 8.0 / start.elapsed().as_secs_f64();
        let _ = n;
        drop(s);
        // Round trip: echo single bytes.
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(Duration::from_secs(20)))?;
        let mut b = [0u8; 1];
        while s.read(&mut b)? == 1 {
            s.write_all(&b)?;
        }
        Ok(rate)
    });
    ready_rx.recv_timeout(Duration::from_secs(10)).map_err(|_| anyhow!("the probe server did not start"))?;
    let target = format!("{}:5201", Topology::addr(to));
    let client = in_netns(&t.worker_ns(from), move || {
        let mut s = TcpStream::connect(&target).with_context(|| format!("connect {target}"))?;
        s.set_read_timeout(Some(Duration::from_secs(20)))?;
        s.set_write_timeout(Some(Duration::from_secs(20)))?;
        let buf = vec![7u8; 1 << 20];
        let end = Instant::now() + Duration::from_secs_f64(seconds);
        while Instant::now() < end {
            s.write_all(&buf)?;
        }
        s.shutdown(std::net::Shutdown::Write)?;
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        let mut s = TcpStream::connect(&target)?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(Duration::from_secs(20)))?;
        let mut rtts = Vec::new();
        let mut b = [1u8; 1];
        for _ in 0..50 {
            let t0 = Instant::now();
            s.write_all(&b)?;
            s.read_exact(&mut b)?;
            rtts.push(t0.elapsed().as_secs_f64());
        }
        rtts.sort_by(f64::total_cmp);
        Ok(rtts[rtts.len() / 2])
    });
    let rtt = client.join().map_err(|_| anyhow!("probe client panicked"))??;
    let rate = server.join().map_err(|_| anyhow!("probe server panicked"))??;
    Ok(LinkProbe { bits_per_second: rate, rtt_seconds: rtt })
}

/// Parses a tc rate (`1gbit`, `500mbit`, `10kbit`, `1e9`) into bits per second.
pub(crate) fn rate_bits(rate: &str) -> Result<f64> {
    let r = rate.trim().to_ascii_lowercase();
    let (num, scale) = if let Some(n) = r.strip_suffix("gbit") {
        (n, 1e9)
    } else if let Some(n) = r.strip_suffix("mbit") {
        (n, 1e6)
    } else if let Some(n) = r.strip_suffix("kbit") {
        (n, 1e3)
    } else if let Some(n) = r.strip_suffix("bit") {
        (n, 1.0)
    } else {
        (r.as_str(), 1.0)
    };
    let v: f64 = num.trim().parse().map_err(|_| anyhow!("rate `{rate}`: expected e.g. 1gbit, 500mbit"))?;
    if !(v.is_finite() && v > 0.0) {
        bail!("rate `{rate}` must be positive");
    }
    Ok(v * scale)
}

/// The `qsr train` recipe of a sweep: an MLP on digits, SGD with momentum, cosine; only `[sync]` differs.
pub(crate) fn recipe_text(args: &NetemArgs, rule: &str) -> Result<String> {
    let spe = 1437 / (args.workers as u64 * args.local_batch.max(1));
    if spe == 0 {
        bail!("--workers {} x --local-batch {}: digits has too few images (1437)", args.workers, args.local_batch);
    }
    let steps = spe * args.epochs;
    // Warmup: a tenth of the run, the paper's ViT-B proportion (10,000 of 93,600 steps).
    let warmup = (steps / 10).max(1);
    let mut parts = rule.split('/');
    let sync = sync_text(args, parts.next().unwrap_or(rule))?;
    let (sync_extra, sections) = modifiers_text(rule, parts)?;
    let sync = format!("{sync}{sync_extra}");
    let hidden: Vec<String> = args.hidden.iter().map(usize::to_string).collect();
    Ok(format!(
        "# cargo xtask netem: MLP on digits, K = {k}, {epochs} epochs of {spe} steps; only [sync] differs between runs.\n\
         name = \"netem-{name}\"\nseed = {seed}\n\n[model]\nkind = \"mlp\"\nhidden = [{hidden}]\n\n\
         [data]\ndataset = \"digits\"\naugment = true\n\n[train]\nworkers = {k}\nlocal_batch = {lb}\n\n\
         [optimizer]\nkind = \"sgd\"\nmomentum = 0.9\nweight_decay = 5e-4\n\n\
         [schedule]\nkind = \"cosine\"\ntotal_steps = {steps}\nwarmup_steps = {warmup}\nlr_max = {lr}\nlr_min = 1e-6\n\n\
         [sync]\n{sync}\n\n{sections}{eval}",
        name = rule.replace('/', "_"),
        seed = args.seed,
        k = args.workers,
        lb = args.local_batch,
        epochs = args.epochs,
        hidden = hidden.join(", "),
        lr = args.lr_max,
        eval = match (args.fault.is_some(), args.eval_every_epoch) {
            (true, _) => "[eval]\nevery_epochs = 1      # a checkpoint every epoch, to restart from\n",
            (false, true) =>
                "[eval]\nevery_epochs = 1      # accuracy against wall-clock\n\n[checkpoint]\nenabled = false\n",
            (false, false) => "[eval]\nevery_epochs = 1000   # only at the end\n\n[checkpoint]\nenabled = false\n",
        },
    ))
}

/// The sections a rule's `/` suffixes add (see [`NetemArgs::rules`]): text to append to `[sync]`
/// (its `[sync.streaming]` table) and whole sections (`[driver]`, `[outer]`).
fn modifiers_text<'a>(rule: &str, suffixes: impl Iterator<Item = &'a str>) -> Result<(String, String)> {
    let (mut sync, mut sections) = (String::new(), String::new());
    for m in suffixes {
        match m {
            "int8" | "fp8" => sections.push_str(&format!("[driver]\nwire = \"{m}\"\n\n")),
            "outer" => sections.push_str("[outer]\nlr = 0.7\nmomentum = 0.5\nnesterov = true\n\n"),
            s if s.starts_with('s') => {
                let (p, d) = s[1..].split_once('d').unwrap_or((&s[1..], "1"));
                let (Ok(p), Ok(d)) = (p.parse::<u32>(), d.parse::<u64>()) else {
                    bail!("`{m}` in `{rule}`: expected s<P> or s<P>d<delay>, e.g. s4d2");
                };
                sync.push_str(&format!("\n\n[sync.streaming]\nfragments = {p}\ndelay = {d}"));
            }
            other => bail!("unknown suffix `/{other}` in `{rule}` (expected /s<P>[d<delay>], /int8, /fp8, /outer)"),
        }
    }
    Ok((sync, sections))
}

/// The `[sync]` section of `rule` (see [`NetemArgs::rules`]).
fn sync_text(args: &NetemArgs, rule: &str) -> Result<String> {
    if let Some((local, global)) = rule.split_once('+') {
        let h = local.strip_prefix('l').and_then(|h| h.parse::<u64>().ok());
        let Some(h) = h.filter(|&h| h > 0) else {
            bail!("unknown local level `{local}` in `{rule}` (expected l<N>+<rule>, e.g. l1+qsr)");
        };
        if global.contains('+') {
            bail!("`{rule}`: one local level at most (l<N>+<rule>)");
        }
        return Ok(format!("{}\n\n[sync.local]\nrule = \"constant\"\nh = {h}", sync_text(args, global)?));
    }
    Ok(match rule {
        "dp" => "rule = \"dp\"".to_string(),
        "qsr" => format!("rule = \"qsr\"\nh_base = {}\nalpha = {}", args.h_base, args.alpha),
        h if h.starts_with('h') && h[1..].parse::<u64>().is_ok() => format!("rule = \"constant\"\nh = {}", &h[1..]),
        other => bail!("unknown rule `{other}` (expected dp, h<N>, qsr, l<N>+<rule>)"),
    })
}

/// The K worker processes of one run; killed (by their pids) if still running on drop.
struct Job {
    children: Vec<(usize, Child)>,
}

impl Drop for Job {
    fn drop(&mut self) {
        for (_, c) in &mut self.children {
            if matches!(c.try_wait(), Ok(None)) {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

/// How the worker processes of one run start: `qsr train` of one recipe into one run directory, one
/// process per namespace.
#[derive(Clone)]
struct Launch<'a> {
    t: &'a Topology,
    qsr: &'a Path,
    recipe: &'a Path,
    out: &'a Path,
    /// Workers per simulated node.
    node: usize,
    token: String,
}

impl Launch<'_> {
    /// Starts `qsr train` for `rank` in its namespace with `extra` arguments and environment; its
    /// output goes to `log` in the run directory.
    fn spawn(&self, rank: usize, extra: &[String], env: &[(&str, &str)], log: &str) -> Result<Child> {
        let log = File::create(self.out.join(log))?;
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.t.worker_ns(rank)]).arg(self.qsr).arg("train");
        c.args(["--recipe"]).arg(self.recipe).arg("--out").arg(self.out).args(extra).arg("--quiet");
        c.env("QSR_JOB_TOKEN", &self.token).env("QSR_BIND_ADDR", Topology::addr(rank));
        c.env("QSR_COMM_TIMEOUT_SECS", "60");
        // Each node (one namespace, or `node` consecutive ones) stands for a host of its own: ranks
        // on different nodes talk over the shaped links, not through this machine's shared memory.
        c.env("QSR_HOST_ID", format!("{}node{}", self.t.prefix, rank / self.node.max(1)));
        for (k, v) in env {
            c.env(k, v);
        }
        c.stdout(log.try_clone()?).stderr(log);
        c.spawn().with_context(|| format!("cannot start rank {rank}"))
    }

    /// Starts `qsr rendezvous` for `workers` in rank 0's namespace, listening on `addr`.
    fn store(&self, addr: &str, workers: usize) -> Result<Child> {
        let log = File::create(self.out.join("store.log"))?;
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.t.worker_ns(0)]).arg(self.qsr).arg("rendezvous");
        c.args(["--listen", addr, "--workers", &workers.to_string(), "--settle-secs", "60"]);
        c.env("QSR_JOB_TOKEN", &self.token).stdout(log.try_clone()?).stderr(log);
        c.spawn().context("cannot start qsr rendezvous")
    }

    fn fresh(&self) -> Result<()> {
        let _ = std::fs::remove_dir_all(self.out);
        Ok(std::fs::create_dir_all(self.out)?)
    }
}

/// Waits for every process of `job`; returns their exit statuses by rank.
fn wait_all(job: &mut Job, start: Instant, timeout: Duration, out: &Path) -> Result<Vec<(usize, ExitStatus)>> {
    let mut done = Vec::new();
    while done.len() < job.children.len() {
        for (rank, c) in &mut job.children {
            if !done.iter().any(|(r, _)| r == rank)
                && let Some(s) = c.try_wait()?
            {
                done.push((*rank, s));
            }
        }
        if start.elapsed() > timeout {
            bail!("the run in {} took longer than {} s (killed)", out.display(), timeout.as_secs());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(done)
}

/// The rank a `kill:<rank>:<step>` fault kills.
fn fault_rank(fault: &str) -> Result<usize> {
    let mut parts = fault.split(':');
    match (parts.next(), parts.next().and_then(|r| r.parse().ok()), parts.next().and_then(|s| s.parse::<u64>().ok())) {
        (Some("kill"), Some(rank), Some(_)) => Ok(rank),
        _ => bail!("--fault {fault}: expected kill:<rank>:<step>"),
    }
}

/// The job with `--elastic` and a `qsr rendezvous` store in rank 0's namespace: the victim is
/// restarted (without the fault) as soon as it dies, and rejoins at a sync. Returns the seconds.
fn run_elastic_job(launch: &Launch, fault: &str, port: u16, timeout: Duration) -> Result<f64> {
    launch.fresh()?;
    let (k, victim) = (launch.t.workers(), fault_rank(fault)?);
    let store = format!("{}:{port}", Topology::addr(0));
    let args = |rank: Option<usize>| -> Vec<String> {
        let mut a: Vec<String> = ["--comm", "tcp", "--elastic", "--rendezvous", &store].map(String::from).into();
        a.extend(rank.map(|r| ["--rank".to_string(), r.to_string()]).into_iter().flatten());
        a
    };
    let start = Instant::now();
    let mut job = Job { children: vec![(k, launch.store(&store, k)?)] };
    for rank in 0..k {
        let child = launch.spawn(rank, &args(Some(rank)), &[("QSR_TEST_FAULT", fault)], &format!("rank{rank}.log"))?;
        job.children.push((rank, child));
    }
    // The victim is restarted once it has died; everything else must succeed.
    let i = job.children.iter().position(|(r, _)| *r == victim).ok_or_else(|| anyhow!("no rank {victim}"))?;
    loop {
        if let Some(s) = job.children[i].1.try_wait()? {
            if s.success() {
                bail!("rank {victim} finished: the fault {fault} never fired (is its step past the run's end?)");
            }
            break;
        }
        if start.elapsed() > timeout {
            bail!("rank {victim} was not killed within {} s", timeout.as_secs());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    job.children.remove(i);
    job.children.push((victim, launch.spawn(victim, &args(None), &[], &format!("rank{victim}-restarted.log"))?));
    for (rank, s) in wait_all(&mut job, start, timeout, launch.out)? {
        if !s.success() {
            bail!("elastic run {}: process {rank} failed ({s}); see its log there", launch.out.display());
        }
    }
    Ok(start.elapsed().as_secs_f64())
}

/// The job without `--elastic`: every worker stops when the victim dies; then the job is restarted at
/// once from its last checkpoint (`--resume`). Returns the seconds of both.
fn run_restart_job(launch: &Launch, fault: &str, port: u16, timeout: Duration) -> Result<f64> {
    launch.fresh()?;
    fault_rank(fault)?;
    let k = launch.t.workers();
    let start = Instant::now();
    let mut job = Job { children: Vec::new() };
    for rank in 0..k {
        let child =
            launch.spawn(rank, &ring_args(rank, k, port), &[("QSR_TEST_FAULT", fault)], &format!("rank{rank}.log"))?;
        job.children.push((rank, child));
    }
    if wait_all(&mut job, start, timeout, launch.out)?.iter().all(|(_, s)| s.success()) {
        bail!("the fault {fault} never fired in {}", launch.out.display());
    }
    let mut job = Job { children: Vec::new() };
    let resume = launch.out.to_string_lossy().into_owned();
    for rank in 0..k {
        let mut a = ring_args(rank, k, port + 1);
        a.extend(["--resume".to_string(), resume.clone()]);
        job.children.push((rank, launch.spawn(rank, &a, &[], &format!("rank{rank}-resumed.log"))?));
    }
    for (rank, s) in wait_all(&mut job, start, timeout, launch.out)? {
        if !s.success() {
            bail!("resumed run {}: rank {rank} failed ({s}); see its log there", launch.out.display());
        }
    }
    Ok(start.elapsed().as_secs_f64())
}

/// One rule under `--fault`: wall-clock and final test accuracy of the clean run, the elastic run and
/// the run restarted from its checkpoint.
pub(crate) struct FaultRow {
    pub link: String,
    pub rule: String,
    pub seconds: [f64; 3],
    pub accuracy: [f64; 3],
    /// Steps trained again by the elastic run (its membership records' `steps_lost`).
    pub steps_lost: u64,
}

fn accuracy_of(dir: &Path) -> Result<f64> {
    let s: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("summary.json"))?)?;
    num(&s, "final_test_accuracy")
}

/// The markdown table of a `--fault` sweep.
pub(crate) fn fault_table(rows: &[FaultRow]) -> String {
    let mut out = String::from(
        "| link | rule | clean (s) | elastic, killed + restarted (s) | lost (s) | checkpoint restart (s) | lost (s) | elastic lost / restart lost | steps redone (elastic) | test acc. clean / elastic / restart |\n|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let [clean, elastic, restart] = r.seconds;
        let (le, lr) = (elastic - clean, restart - clean);
        let [a, b, c] = r.accuracy.map(|x| 100.0 * x);
        let _ = writeln!(
            out,
            "| {} | {} | {clean:.2} | {elastic:.2} | {le:.2} | {restart:.2} | {lr:.2} | {:.2} | {} | {a:.1}% / {b:.1}% / {c:.1}% |",
            r.link,
            r.rule,
            le / lr,
            r.steps_lost
        );
    }
    out
}

/// Runs `rule` clean, elastic with the fault and restarted from a checkpoint, in `out/<link>-<rule>*`.
fn fault_row(launch: Launch, fault: &str, link: &str, rule: &str, port: u16, timeout: Duration) -> Result<FaultRow> {
    let base = launch.out.to_path_buf();
    let dirs = [base.clone(), base.with_extension("elastic"), base.with_extension("restart")];
    let clean = run_job(launch.t, launch.qsr, launch.recipe, &dirs[0], port, timeout, launch.node)?;
    let elastic = run_elastic_job(&Launch { out: &dirs[1], ..launch.clone() }, fault, port + 1, timeout)?;
    let restart = run_restart_job(&Launch { out: &dirs[2], ..launch.clone() }, fault, port + 2, timeout)?;
    let text = std::fs::read_to_string(dirs[1].join("metrics.jsonl"))?;
    let steps_lost = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|r| r.get("membership")?.get("steps_lost")?.as_u64())
        .sum();
    Ok(FaultRow {
        link: link.into(),
        rule: rule.into(),
        seconds: [clean, elastic, restart],
        accuracy: [accuracy_of(&dirs[0])?, accuracy_of(&dirs[1])?, accuracy_of(&dirs[2])?],
        steps_lost,
    })
}

/// The arguments of rank `rank` of a job launched with the rendezvous at rank 0's address.
fn ring_args(rank: usize, k: usize, port: u16) -> Vec<String> {
    let a = ["--comm", "tcp", "--rank", &rank.to_string(), "--world-size", &k.to_string()].map(String::from);
    let b = ["--master-addr", &Topology::addr(0), "--master-port", &port.to_string()].map(String::from);
    a.into_iter().chain(b).collect()
}

/// Runs one `qsr train` job, one process per worker namespace; returns its wall-clock seconds.
fn run_job(
    t: &Topology,
    qsr: &Path,
    recipe: &Path,
    out: &Path,
    port: u16,
    timeout: Duration,
    node: usize,
) -> Result<f64> {
    let _ = std::fs::remove_dir_all(out);
    std::fs::create_dir_all(out)?;
    let launch = Launch { t, qsr, recipe, out, node, token: format!("netem-{}-{port}", std::process::id()) };
    let k = t.workers();
    let mut job = Job { children: Vec::new() };
    let start = Instant::now();
    for rank in 0..k {
        job.children.push((rank, launch.spawn(rank, &ring_args(rank, k, port), &[], &format!("rank{rank}.log"))?));
    }
    let mut left: Vec<usize> = (0..k).collect();
    while !left.is_empty() {
        let mut still = Vec::new();
        for &i in &left {
            match job.children[i].1.try_wait()? {
                Some(s) if !s.success() => {
                    let log = std::fs::read_to_string(out.join(format!("rank{i}.log"))).unwrap_or_default();
                    bail!(
                        "rank {i} failed ({s}); its log:\n{}",
                        log.lines().rev().take(20).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n")
                    );
                }
                Some(_) => {}
                None => still.push(i),
            }
        }
        left = still;
        if start.elapsed() > timeout {
            bail!("the run in {} took longer than {} s (killed)", out.display(), timeout.as_secs());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(start.elapsed().as_secs_f64())
}

/// What one run measured.
#[derive(Debug, Clone)]
pub(crate) struct Measured {
    pub link: String,
    pub rule: String,
    pub steps: u64,
    pub syncs: u64,
    /// Local averages inside the nodes (two-level rules).
    pub local_syncs: u64,
    pub wall_seconds: f64,
    pub comm_seconds: f64,
    pub accuracy: f64,
    /// Wall-clock of each epoch (sync records interpolated at the epoch boundaries).
    pub epoch_seconds: Vec<f64>,
    pub process_seconds: f64,
}

fn num(v: &serde_json::Value, key: &str) -> Result<f64> {
    v.get(key).and_then(serde_json::Value::as_f64).ok_or_else(|| anyhow!("`{key}` missing"))
}

/// Time at which `step` steps were done, interpolated between sync records `(step, wall)`.
pub(crate) fn time_at(records: &[(u64, f64)], step: u64) -> f64 {
    let mut prev = (0u64, 0.0f64);
    for &(s, w) in records {
        if s >= step {
            if s == prev.0 {
                return w;
            }
            return prev.1 + (w - prev.1) * (step - prev.0) as f64 / (s - prev.0) as f64;
        }
        prev = (s, w);
    }
    prev.1
}

/// Reads a finished run's summary and per-epoch times.
pub(crate) fn read_run(dir: &Path, link: &str, rule: &str, process_seconds: f64) -> Result<Measured> {
    let s: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.join("summary.json")).with_context(|| format!("no summary in {}", dir.display()))?,
    )?;
    let spe = num(&s, "steps_per_epoch")? as u64;
    let steps = num(&s, "steps")? as u64;
    let mut records = Vec::new();
    for line in std::fs::read_to_string(dir.join("metrics.jsonl"))?.lines() {
        let r: serde_json::Value = serde_json::from_str(line)?;
        if r.get("kind").and_then(|k| k.as_str()) == Some("sync") {
            records.push((num(&r, "step")? as u64, num(&r, "wall_seconds")?));
        }
    }
    let mut epochs = Vec::new();
    let mut last = 0.0;
    let mut e = 1;
    while e * spe <= steps && spe > 0 {
        let t = time_at(&records, e * spe);
        epochs.push(t - last);
        last = t;
        e += 1;
    }
    Ok(Measured {
        link: link.to_string(),
        rule: rule.to_string(),
        steps,
        syncs: num(&s, "syncs")? as u64,
        local_syncs: s.get("local").map_or(Ok(0.0), |l| num(l, "syncs"))? as u64,
        wall_seconds: num(&s, "wall_seconds")?,
        comm_seconds: num(&s, "comm_seconds")?,
        accuracy: num(&s, "final_test_accuracy")?,
        epoch_seconds: epochs,
        process_seconds,
    })
}

/// The markdown table of a sweep.
pub(crate) fn table(rows: &[Measured]) -> String {
    let mut out = String::from(
        "| link | rule | steps | syncs | epoch times (s) | mean epoch (s) | total (s) | comm (s) | epoch vs dp | test acc. | process (s) |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let dp = rows.iter().find(|d| d.link == r.link && d.rule == "dp");
        let mean = r.epoch_seconds.iter().sum::<f64>() / r.epoch_seconds.len().max(1) as f64;
        let dp_mean = dp.map(|d| d.epoch_seconds.iter().sum::<f64>() / d.epoch_seconds.len().max(1) as f64);
        let epochs: Vec<String> = r.epoch_seconds.iter().map(|e| format!("{e:.2}")).collect();
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {:.2} | {:.2} | {:.2} | {} | {:.1}% | {:.1} |",
            r.link,
            r.rule,
            r.steps,
            if r.local_syncs > 0 { format!("{} + {} local", r.syncs, r.local_syncs) } else { r.syncs.to_string() },
            epochs.join(" / "),
            mean,
            r.wall_seconds,
            r.comm_seconds,
            dp_mean.map_or("-".into(), |d| format!("{:.3}x", mean / d)),
            100.0 * r.accuracy,
            r.process_seconds
        );
    }
    out
}

/// `cargo xtask netem`.
pub(crate) fn run(args: &NetemArgs, root: &Path) -> Result<()> {
    if let Some(why) = unavailable() {
        bail!("netem cannot run here: {why}");
    }
    let removed = cleanup_prefix(PREFIX)?;
    if removed > 0 {
        eprintln!("netem: removed {removed} leftover namespaces {PREFIX}*");
    }
    for r in &args.rates {
        rate_bits(r)?;
    }
    if args.workers_per_node == 0 || !args.workers.is_multiple_of(args.workers_per_node) {
        bail!("--workers-per-node {} must divide --workers {}", args.workers_per_node, args.workers);
    }
    let topo = Topology::create(PREFIX, args.workers)?;
    let delay_note = if netem_available(&topo) {
        format!("{} one-way (netem)", args.delay)
    } else {
        eprintln!(
            "netem: this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM unset): rate shaping only (tbf), latency is the veth's own"
        );
        "not emulated: this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM unset); latency is the veth's own, see the measured round trips".to_string()
    };
    let delay = netem_available(&topo).then(|| args.delay.clone());
    let shape_of = |rate: &str| Shape { rate: rate.to_string(), delay: delay.clone() };
    if args.check {
        let rate = args.rates.first().ok_or_else(|| anyhow!("--rates is empty"))?;
        topo.shape(Some(&shape_of(rate)))?;
        eprint!("{}", topo.qdisc(0)?);
        let p = probe_link(&topo, 0, 1.min(args.workers - 1), 2.0)?;
        println!(
            "netem check: {rate} configured, {:.3} Gbit/s measured ({:.3}x); round trip {:.3} ms (delay {delay_note})",
            p.bits_per_second / 1e9,
            p.bits_per_second / rate_bits(rate)?,
            p.rtt_seconds * 1e3,
        );
        return Ok(());
    }
    let qsr = args.qsr.clone().unwrap_or_else(|| root.join("target/release/qsr"));
    if !qsr.exists() {
        bail!("{} not found: run `cargo build --release -p qsr-train` first (or pass --qsr)", qsr.display());
    }
    let out = if args.out.is_absolute() { args.out.clone() } else { root.join(&args.out) };
    let recipes = out.join("recipes");
    std::fs::create_dir_all(&recipes)?;
    // A private copy of the binary: a rebuild during the sweep must not change what runs.
    let bin = out.join("qsr");
    std::fs::copy(&qsr, &bin).with_context(|| format!("cannot copy {}", qsr.display()))?;
    let mut paths = Vec::new();
    for rule in &args.rules {
        let p = recipes.join(format!("netem-{}.toml", rule.replace('/', "_")));
        std::fs::write(&p, recipe_text(args, rule)?)?;
        paths.push((rule.clone(), p));
    }
    let mut links: Vec<(String, Option<Shape>)> = Vec::new();
    if !args.no_unshaped {
        links.push(("unshaped".into(), None));
    }
    for r in &args.rates {
        links.push((r.clone(), Some(shape_of(r))));
    }
    let mut rows = Vec::new();
    let mut fault_rows = Vec::new();
    let mut probes = String::new();
    let mut port = 29500;
    for (link, shape) in &links {
        topo.shape(shape.as_ref())?;
        let p = probe_link(&topo, 0, 1.min(args.workers - 1), 1.5)?;
        let line = format!(
            "link {link}: measured {:.3} Gbit/s goodput, round trip {:.3} ms",
            p.bits_per_second / 1e9,
            p.rtt_seconds * 1e3
        );
        eprintln!("netem: {line}");
        let _ = writeln!(probes, "- {line}");
        for (rule, recipe) in &paths {
            let dir = out.join(format!("{link}-{}", rule.replace('/', "_")));
            eprintln!("netem: {link} {rule} -> {}", dir.display());
            port += 4;
            let timeout = Duration::from_secs(args.timeout);
            if let Some(fault) = &args.fault {
                let token = format!("netem-{}-{port}", std::process::id());
                let launch = Launch { t: &topo, qsr: &bin, recipe, out: &dir, node: args.workers_per_node, token };
                let row = fault_row(launch, fault, link, rule, port, timeout)?;
                eprintln!(
                    "netem:   clean / elastic / restart: {:.2} / {:.2} / {:.2} s",
                    row.seconds[0], row.seconds[1], row.seconds[2]
                );
                fault_rows.push(row);
                continue;
            }
            let secs = run_job(&topo, &bin, recipe, &dir, port, timeout, args.workers_per_node)?;
            let m = read_run(&dir, link, rule, secs)?;
            eprintln!("netem:   {:.2} s total, {} syncs, {:.2} s comm", m.wall_seconds, m.syncs, m.comm_seconds);
            rows.push(m);
        }
    }
    drop(topo);
    let _ = std::fs::remove_file(&bin);
    let nodes = match args.workers_per_node {
        1 => String::new(),
        n => format!(" in {} nodes of {n} (shared memory inside a node, shaped links between)", args.workers / n),
    };
    let mut text = format!(
        "K = {} namespaces{nodes}, delay {delay_note}, MLP {:?} on digits, local batch {}, {} epochs; QSR h_base {} alpha {}.\n\n{probes}\n",
        args.workers, args.hidden, args.local_batch, args.epochs, args.h_base, args.alpha
    );
    if let Some(fault) = &args.fault {
        let _ = writeln!(
            text,
            "Fault `{fault}` (QSR_TEST_FAULT): the worker sends itself SIGKILL as it starts that step.\n"
        );
        text.push_str(&fault_table(&fault_rows));
    } else {
        text.push_str(&table(&rows));
    }
    std::fs::write(out.join("results.md"), &text)?;
    println!("{text}");
    println!("runs and recipes under {}", out.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_parse() {
        assert_eq!(rate_bits("1gbit").unwrap(), 1e9);
        assert_eq!(rate_bits("10Gbit").unwrap(), 1e10);
        assert_eq!(rate_bits("250mbit").unwrap(), 2.5e8);
        assert!(rate_bits("fast").is_err());
        assert!(rate_bits("0gbit").is_err());
    }

    #[test]
    fn epoch_times_interpolate_between_syncs() {
        let recs = [(4, 4.0), (8, 8.0), (20, 14.0)];
        assert_eq!(time_at(&recs, 4), 4.0);
        assert_eq!(time_at(&recs, 2), 2.0);
        assert!((time_at(&recs, 14) - 11.0).abs() < 1e-12);
        assert_eq!(time_at(&recs, 30), 14.0);
    }

    #[test]
    fn recipes_differ_only_in_sync() {
        let args = NetemArgs {
            workers: 4,
            workers_per_node: 2,
            rates: vec![],
            delay: "0.2ms".into(),
            no_unshaped: false,
            epochs: 5,
            local_batch: 16,
            hidden: vec![4096, 2560],
            rules: vec![],
            seed: 0,
            h_base: 4,
            alpha: 0.05,
            lr_max: 0.1,
            qsr: None,
            out: PathBuf::from("x"),
            timeout: 1,
            check: false,
            fault: None,
            eval_every_epoch: false,
        };
        let dp = recipe_text(&args, "dp").unwrap();
        let h4 = recipe_text(&args, "h4").unwrap();
        assert!(dp.contains("total_steps = 110") && dp.contains("rule = \"dp\""));
        assert!(h4.contains("rule = \"constant\"\nh = 4"));
        let strip =
            |s: &str| s.split("[sync]").map(|p| p.split("[eval]").last().unwrap().to_string()).collect::<Vec<_>>();
        assert_eq!(strip(&dp)[0].replace("netem-dp", ""), strip(&h4)[0].replace("netem-h4", ""));
        assert!(recipe_text(&args, "sometimes").is_err());
        let two = recipe_text(&args, "l1+qsr").unwrap();
        assert!(two.contains("rule = \"qsr\"") && two.contains("[sync.local]\nrule = \"constant\"\nh = 1"), "{two}");
        assert!(recipe_text(&args, "lx+qsr").is_err() && recipe_text(&args, "l0+dp").is_err());
        // One local level at most (two would write two [sync.local] tables).
        assert!(recipe_text(&args, "l1+l2+qsr").unwrap_err().to_string().contains("one local level at most"));
        let streaming = recipe_text(&args, "qsr/s4d2/int8/outer").unwrap();
        assert!(streaming.contains("name = \"netem-qsr_s4d2_int8_outer\""), "{streaming}");
        assert!(streaming.contains("alpha = 0.05\n\n[sync.streaming]\nfragments = 4\ndelay = 2\n"), "{streaming}");
        assert!(
            streaming.contains("[driver]\nwire = \"int8\"") && streaming.contains("[outer]\nlr = 0.7"),
            "{streaming}"
        );
        assert!(recipe_text(&args, "qsr/s4").unwrap().contains("fragments = 4\ndelay = 1"));
        assert!(recipe_text(&args, "qsr/zip").unwrap_err().to_string().contains("unknown suffix `/zip`"));
        assert!(recipe_text(&args, "qsr/sx").is_err());
        // Under --fault the runs checkpoint every epoch, so the restarted job has somewhere to resume from.
        assert!(dp.contains("enabled = false"));
        let curves = NetemArgs { eval_every_epoch: true, ..args.clone() };
        let qsr = recipe_text(&curves, "qsr").unwrap();
        assert!(qsr.contains("every_epochs = 1 ") && qsr.contains("enabled = false"), "{qsr}");
        let faulty = NetemArgs { fault: Some("kill:2:70".into()), ..args };
        let dp = recipe_text(&faulty, "dp").unwrap();
        assert!(dp.contains("every_epochs = 1 ") && !dp.contains("enabled = false"), "{dp}");
    }

    #[test]
    fn faults_parse_and_their_table_gives_each_recovery_its_loss() {
        assert_eq!(fault_rank("kill:2:70").unwrap(), 2);
        for bad in ["stop:2:70", "kill:x:70", "kill:2", "kill"] {
            assert!(fault_rank(bad).is_err(), "{bad}");
        }
        let row = FaultRow {
            link: "1gbit".into(),
            rule: "qsr".into(),
            seconds: [50.0, 55.0, 70.0],
            accuracy: [0.9, 0.9, 0.9],
            steps_lost: 4,
        };
        let t = fault_table(&[row]);
        assert!(t.contains("| 1gbit | qsr | 50.00 | 55.00 | 5.00 | 70.00 | 20.00 | 0.25 | 4 |"), "{t}");
    }

    /// Namespace pair, a shaped link, its measured rate and round trip, and teardown (also of leftovers).
    #[test]
    fn namespaces_shape_measure_and_tear_down() {
        if let Some(why) = unavailable() {
            println!("skipped: {why}");
            return;
        }
        let prefix = "qsrtst-";
        cleanup_prefix(prefix).unwrap();
        // A leftover of an interrupted run is removed by its prefix.
        ip(&["netns", "add", "qsrtst-leftover"]).unwrap();
        assert_eq!(cleanup_prefix(prefix).unwrap(), 1);
        assert!(namespaces_with_prefix(prefix).unwrap().is_empty());

        for (rate, delay) in [("1gbit", 0.2e-3), ("200mbit", 1e-3)] {
            let t = Topology::create(prefix, 2).unwrap();
            assert_eq!(namespaces_with_prefix(prefix).unwrap().len(), 3);
            let netem = netem_available(&t);
            if !netem {
                println!("netem qdisc missing in this kernel: checking the rate only, not the delay");
            }
            let shape = Shape { rate: rate.into(), delay: netem.then(|| format!("{}ms", delay * 1e3)) };
            t.shape(Some(&shape)).unwrap();
            let q = t.qdisc(0).unwrap();
            assert!(q.contains("tbf") && q.contains(if netem { "netem" } else { "rate" }), "{q}");
            let delay = if netem { delay } else { 0.0 };
            let configured = rate_bits(rate).unwrap();
            // A second try if the first is out of band: other jobs on a small machine can starve a probe.
            let mut p = probe_link(&t, 0, 1, 1.5).unwrap();
            if !(0.80..=1.02).contains(&(p.bits_per_second / configured)) {
                println!("first probe {:.1} Mbit/s out of band, probing again", p.bits_per_second / 1e6);
                p = probe_link(&t, 0, 1, 1.5).unwrap();
            }
            let ratio = p.bits_per_second / configured;
            println!(
                "{rate} {delay} s: goodput {:.1} Mbit/s ({ratio:.3}x), rtt {:.3} ms",
                p.bits_per_second / 1e6,
                p.rtt_seconds * 1e3
            );
            // TCP/IP/Ethernet headers take ~4.4% at MTU 1500; a loaded machine can lose a little more.
            assert!((0.80..=1.02).contains(&ratio), "{rate}: measured {ratio:.3}x the configured rate");
            assert!(p.rtt_seconds >= 2.0 * delay * 0.95, "rtt {} < 2 x {delay}", p.rtt_seconds);
            assert!(p.rtt_seconds < 2.0 * delay + 5e-3, "rtt {} far above 2 x {delay}", p.rtt_seconds);
            drop(t);
            assert!(namespaces_with_prefix(prefix).unwrap().is_empty(), "teardown left namespaces");
        }
    }

    /// A failure half-way through set-up still removes what was created (and only that).
    #[test]
    fn failed_setup_tears_down() {
        if let Some(why) = unavailable() {
            println!("skipped: {why}");
            return;
        }
        let prefix = "qsrtsf-";
        cleanup_prefix(prefix).unwrap();
        // Worker 1's namespace already exists: creation fails after the bridge and worker 0 exist.
        ip(&["netns", "add", "qsrtsf-w1"]).unwrap();
        let err = Topology::create(prefix, 3).err().expect("a clash must fail");
        assert!(format!("{err:#}").contains("qsrtsf-w1"), "{err:#}");
        assert_eq!(namespaces_with_prefix(prefix).unwrap(), vec!["qsrtsf-w1".to_string()]);
        // A shaping failure leaves the topology to its guard.
        let t = Topology::create("qsrtsg-", 2).unwrap();
        assert!(t.shape(Some(&Shape { rate: "notarate".into(), delay: None })).is_err());
        drop(t);
        assert!(namespaces_with_prefix("qsrtsg-").unwrap().is_empty());
        assert!(Topology::create(prefix, 0).is_err());
        assert_eq!(cleanup_prefix(prefix).unwrap(), 1);
        assert!(namespaces_with_prefix(prefix).unwrap().is_empty());
    }
}
