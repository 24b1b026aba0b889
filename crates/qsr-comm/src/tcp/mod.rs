//! Our own TCP ring all-reduce, documented on [`TcpComm`].

pub(crate) mod accept;
mod doubling;
pub(crate) mod engine;
pub(crate) mod plan;
pub(crate) mod rendezvous;

use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::launch_env::LaunchEnv;
use crate::wire::{self, CallHeader, PROTOCOL_VERSION};
use crate::{Codec, Collective, CommError, CommStats, ReduceOp};
use qsr_kernels::WIRE_BLOCK;

use engine::{Buf, Call};
pub use rendezvous::WaitProgress;

/// Settings of the TCP backend. `Default` is safe for one host: loopback only, 30 s timeout.
#[derive(Debug, Clone)]
pub struct TcpConfig {
    /// A peer that makes no progress for this long is declared failed (default 30 s).
    pub timeout: Duration,
    /// How long rendezvous and ring setup may take; ranks may start minutes apart on a cluster
    /// (default 300 s).
    pub rendezvous_timeout: Duration,
    /// How long a new connection may take to send its hello before it is dropped (default 5 s).
    pub hello_timeout: Duration,
    /// Address the ring listener binds to (default 127.0.0.1; use 0.0.0.0 or the interface
    /// address for multi-host runs).
    pub bind_ip: IpAddr,
    /// Host name/address other ranks use to reach our ring listener; default: `bind_ip` unless
    /// unspecified, else the address rank 0 sees us connect from.
    pub advertise_host: Option<String>,
    /// Shared secret of the job (at most 1024 bytes; `QSR_JOB_TOKEN` in [`TcpConfig::from_env`]):
    /// every rank must use the same one, and a hello with another token is refused. Empty by
    /// default, which lets any process that reaches the rendezvous port register as a rank; set it
    /// whenever the ports are reachable from other hosts (see [`TcpComm`], "The job token").
    pub token: String,
    /// Largest pipelining block in bytes (default 512 KiB; rounded to 4 KiB units, at most
    /// 256 MiB - 4 KiB). All ranks must use the same value; it is checked in every call.
    pub chunk_bytes: usize,
    /// SO_SNDBUF/SO_RCVBUF for ring sockets; `None` keeps the kernel's autotuning.
    pub socket_buffer: Option<usize>,
    /// All-reduces of at most this many bytes (and of at most `chunk_bytes`, on 3 to 64 ranks, of at
    /// least one value per rank) take recursive doubling, `log2 K` exchanges between pairs instead of the ring's `2 (K-1)`
    /// hops; larger ones take the pipelined ring. Doubling sends the whole buffer `log2 K` times, the
    /// ring `2 (K-1)/K` of it. Default 32 KiB (measurements: docs/BENCHMARKS.md, section
    /// "All-reduce defaults"); 0 keeps every call on the ring. All ranks must use the same value: it
    /// is compared when the pairs form.
    pub doubling_bytes: usize,
    /// The membership generation of an elastic job (qsr-elastic's `Elastic` sets it for every ring it forms;
    /// 0 otherwise): a hello of another generation is refused, naming both.
    pub generation: u64,
    /// Protocol version sent in handshakes; only tests change it, to check refusals.
    #[doc(hidden)]
    pub protocol_version: u32,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            timeout: Duration::from_secs(30),
            rendezvous_timeout: Duration::from_secs(300),
            hello_timeout: Duration::from_secs(5),
            bind_ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
            advertise_host: None,
            token: String::new(),
            chunk_bytes: 512 << 10,
            socket_buffer: None,
            doubling_bytes: 32 << 10,
            generation: 0,
            protocol_version: PROTOCOL_VERSION,
        }
    }
}

impl TcpConfig {
    /// Defaults overridden by `QSR_JOB_TOKEN` (the job's shared secret, [`TcpConfig::token`]),
    /// `QSR_COMM_TIMEOUT_SECS`, `QSR_RENDEZVOUS_TIMEOUT_SECS`, `QSR_BIND_ADDR` and
    /// `QSR_ADVERTISE_HOST` (the env is passed in, as in [`crate::detect`]). Timeouts are seconds in
    /// `(0, 604800]` (a week).
    pub fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<TcpConfig, CommError> {
        let mut cfg = TcpConfig::default();
        if let Some(t) = env("QSR_JOB_TOKEN") {
            cfg.token = t;
        }
        if let Some(v) = env("QSR_COMM_TIMEOUT_SECS") {
            cfg.timeout = seconds("QSR_COMM_TIMEOUT_SECS", &v)?;
        }
        if let Some(v) = env("QSR_RENDEZVOUS_TIMEOUT_SECS") {
            cfg.rendezvous_timeout = seconds("QSR_RENDEZVOUS_TIMEOUT_SECS", &v)?;
        }
        if let Some(v) = env("QSR_BIND_ADDR") {
            cfg.bind_ip = v
                .trim()
                .parse()
                .map_err(|_| CommError::launch("QSR_BIND_ADDR", format!("QSR_BIND_ADDR={v} is not an IP address")))?;
        }
        if let Some(v) = env("QSR_ADVERTISE_HOST") {
            wire::check_host(&v)
                .map_err(|why| CommError::launch("QSR_ADVERTISE_HOST", format!("QSR_ADVERTISE_HOST {why}")))?;
            cfg.advertise_host = Some(v);
        }
        Ok(cfg)
    }
}

/// The longest timeout a setting may ask for: a week.
pub const MAX_TIMEOUT_SECS: f64 = 604_800.0;

/// A timeout in seconds from a setting named `key`: a number in `(0, MAX_TIMEOUT_SECS]`.
pub fn seconds(key: &str, value: &str) -> Result<Duration, CommError> {
    let secs = value.trim().parse::<f64>().ok().filter(|s| s.is_finite() && *s > 0.0 && *s <= MAX_TIMEOUT_SECS);
    secs.map(Duration::from_secs_f64).ok_or_else(|| {
        CommError::launch(key, format!("{key}={value} is not a number of seconds in (0, {MAX_TIMEOUT_SECS}] (a week)"))
    })
}

/// Whether `host` (an address or a name) only reaches this machine.
fn is_loopback_host(host: &str) -> bool {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = bare.parse::<IpAddr>() {
        return ip.is_loopback();
    }
    match (bare, 0).to_socket_addrs() {
        Ok(addrs) => {
            let addrs: Vec<SocketAddr> = addrs.collect();
            !addrs.is_empty() && addrs.iter().all(|a| a.ip().is_loopback())
        }
        Err(_) => false,
    }
}

/// The warning for a multi-rank launch that any process reaching its ports could join: no job
/// token while rank 0's address or the ring's bind address is not loopback.
fn open_job_warning(env: &LaunchEnv, cfg: &TcpConfig) -> Option<String> {
    if !cfg.token.is_empty() || env.world_size < 2 {
        return None;
    }
    let exposed = if !is_loopback_host(&env.master_addr) {
        format!("MASTER_ADDR={}", env.master_addr)
    } else if !cfg.bind_ip.is_loopback() {
        format!("QSR_BIND_ADDR={}", cfg.bind_ip)
    } else {
        return None;
    };
    Some(format!(
        "QSR_JOB_TOKEN is not set and {exposed} is not a loopback address: any process that can \
         reach this job's ports can register as a rank and stall the job; export the same secret \
         as QSR_JOB_TOKEN on every rank"
    ))
}

/// A fresh random job token (128 bits, hex), for launchers that start all ranks themselves.
pub fn random_token() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// Rank 0's rendezvous listener. Binding it separately lets a launcher (or a test) bind port 0
/// and pass the actual address to the other ranks before rank 0 starts waiting.
pub struct MasterListener {
    listener: TcpListener,
}

impl MasterListener {
    /// Binds `addr` (`host:port`; port 0 picks a free one).
    pub fn bind(addr: &str) -> Result<MasterListener, CommError> {
        let listener =
            TcpListener::bind(addr).map_err(|e| CommError::io(format!("binding the rendezvous port {addr}"), e))?;
        Ok(MasterListener { listener })
    }

    /// The bound address (with the actual port).
    pub fn local_addr(&self) -> Result<SocketAddr, CommError> {
        self.listener.local_addr().map_err(|e| CommError::io("rendezvous listener address", e))
    }
}

/// The two ring connections and the per-connection state that outlives a call.
pub(crate) struct Ring {
    pub left: TcpStream,
    pub right: TcpStream,
    pub left_addr: String,
    pub right_addr: String,
    /// Reverse-channel bytes not yet written to the left.
    pub back_out: Vec<u8>,
    pub back_off: usize,
    /// Partial reverse-channel message read from the right.
    pub back_in: [u8; wire::BACK_LEN],
    pub back_got: usize,
    /// The right closed after our last send of a call; the next call fails on it.
    pub right_closed: bool,
    /// Writing heartbeats to the left failed; the read side reports the cause.
    pub left_back_broken: bool,
}

impl Ring {
    pub(crate) fn back_pending(&self) -> bool {
        self.back_off < self.back_out.len()
    }
}

/// One rank of a TCP ring: our own ring all-reduce, for processes on one or many hosts.
///
/// Setup (`rendezvous.rs`): rank 0 listens at `MASTER_ADDR:MASTER_PORT`, the others register with
/// a handshake (magic, protocol version, job token, world size, rank, ring listener address), rank
/// 0 answers with the address table, and each rank connects to its right neighbour (same
/// handshake) and accepts its left one. A mismatch is refused with a message naming the field.
///
/// Collectives (`plan.rs`, `engine.rs`): a ring reduce-scatter then all-gather, split into blocks
/// of `chunk_bytes` and pipelined: each block is forwarded as soon as it has been received and
/// reduced, and sending right / receiving left progress together on non-blocking sockets, so
/// every link is busy in both the rank's send and receive direction and no message size can
/// deadlock. The reduction order of each element is fixed by the ring, and final values travel
/// as bytes, so all ranks end bit-identical.
///
/// Wire format (`wire.rs`, private to the crate): the byte layouts of the handshake, the call
/// header, data/keepalive/abort frames and reverse-channel messages. Every frame length is checked against what the call header
/// implies before anything is read into memory.
///
/// Failures: a peer that dies (EOF/reset) or makes no progress for [`TcpConfig::timeout`] makes
/// the call fail with an error naming it; the detecting rank forwards an abort notice around the
/// ring both ways so every rank names the same culprit. After a failure the communicator is
/// broken and refuses further calls.
///
/// # The job token (`QSR_JOB_TOKEN`)
///
/// Every handshake carries the job's token ([`TcpConfig::token`], read from `QSR_JOB_TOKEN` by
/// [`TcpConfig::from_env`]), and a rank whose token differs is refused. It is what keeps a process
/// that is not part of the job (another job on the same port, a stray or hostile client) from
/// registering as a rank and stalling or joining the ring. `qsr train --nproc` sets a random one
/// for its workers; for an external launch (torchrun, mpirun, srun with `--comm tcp`) export the
/// same secret on every rank, e.g. `export QSR_JOB_TOKEN=$(openssl rand -hex 16)` before launching.
/// It defaults to empty, which is only safe on loopback: [`TcpComm::from_launch`] warns, naming
/// `QSR_JOB_TOKEN`, when a multi-rank launch has no token and `MASTER_ADDR` (or `QSR_BIND_ADDR`)
/// is not a loopback address. The token is compared in constant time but travels in clear text:
/// it guards against accidents and casual interference, not against an eavesdropper.
pub struct TcpComm {
    rank: usize,
    n: usize,
    cfg: TcpConfig,
    ring: Option<Ring>,
    seq: u64,
    /// The sync the next calls belong to ([`Collective::set_tag`]).
    tag: Option<crate::SyncTag>,
    stats: CommStats,
    broken: Option<String>,
    scratch: Vec<f32>,
    /// The wire copy of a bf16 or quantized all-reduce (kept to reuse its allocation).
    wire: Vec<u8>,
    /// A quantized all-reduce's f32 values padded to whole blocks (kept to reuse its allocation).
    quant_master: Vec<f32>,
    /// Every rank's host as the rendezvous table gave it (empty for a ring of one).
    hosts: Vec<String>,
    /// Called while a call makes progress (a hierarchy's leader tells its host it is alive).
    progress: Option<Arc<dyn Fn() + Send + Sync>>,
    /// The pairs of recursive doubling, formed on the first small all-reduce (more than 2 ranks).
    doubling: Option<Box<doubling::Doubling>>,
    /// Rank 0: answers late registrations on the rendezvous port while we live.
    _late: Option<rendezvous::LateRefuser>,
}

/// The configured block size in 4 KiB units, as carried in call headers.
fn chunk_units(cfg: &TcpConfig) -> u16 {
    (cfg.chunk_bytes / 4096).clamp(1, usize::from(u16::MAX)) as u16
}

/// The block size the plans use: exactly what the header announces.
fn chunk_bytes(cfg: &TcpConfig) -> usize {
    usize::from(chunk_units(cfg)) * 4096
}

fn validate(rank: usize, n: usize, cfg: &TcpConfig) -> Result<(), CommError> {
    if n == 0 || n > wire::MAX_WORLD_SIZE {
        return Err(CommError::InvalidArgument(format!("world size {n} is not in 1..={}", wire::MAX_WORLD_SIZE)));
    }
    if rank >= n {
        return Err(CommError::InvalidArgument(format!("rank {rank} >= world size {n}")));
    }
    if cfg.token.len() > wire::MAX_TOKEN_LEN {
        return Err(CommError::InvalidArgument(format!(
            "job token is {} bytes, at most {}",
            cfg.token.len(),
            wire::MAX_TOKEN_LEN
        )));
    }
    if cfg.timeout.is_zero() {
        return Err(CommError::InvalidArgument("timeout must be positive".into()));
    }
    Ok(())
}

/// A rank's seat in a ring formed by an outside rendezvous (an elastic store): its ring listener,
/// bound first, whose host and port the rendezvous hands to the other ranks, then the ring formed
/// from the address table every rank received.
pub struct RingSeat {
    listener: TcpListener,
    port: u16,
    host: Option<String>,
}

impl RingSeat {
    /// A fresh listener on `cfg.bind_ip`.
    pub fn open(cfg: &TcpConfig) -> Result<RingSeat, CommError> {
        let (listener, port) = ring_listener(cfg)?;
        Ok(RingSeat { listener, port, host: rendezvous::advertised_host(cfg) })
    }

    /// The port the other ranks connect to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The host the other ranks connect to: `cfg.advertise_host`, else the bind address; `None` for
    /// an unspecified bind address (the rendezvous then uses the address it sees this rank from).
    pub fn host(&self) -> Option<&str> {
        self.host.as_deref()
    }

    /// Forms the ring as rank `rank` of `table.len()`, from the `(host, port)` of every rank, this
    /// seat's at `rank`.
    pub fn form(self, rank: usize, cfg: TcpConfig, table: Vec<(String, u16)>) -> Result<TcpComm, CommError> {
        self.form_unless(rank, cfg, table, &mut || None)
    }

    /// [`Self::form`], asking `abandon` about twice a second while it waits for its neighbours: a
    /// `Some(why)` ends the formation at once with an error saying why (the rendezvous says a rank
    /// of the table will never come).
    pub fn form_unless(
        self,
        rank: usize,
        cfg: TcpConfig,
        table: Vec<(String, u16)>,
        abandon: &mut dyn FnMut() -> Option<String>,
    ) -> Result<TcpComm, CommError> {
        TcpComm::from_table_unless(rank, table.len(), cfg, &self.listener, (table, abandon))
    }
}

/// A fresh ring listener on `cfg.bind_ip` and its port.
pub(crate) fn ring_listener(cfg: &TcpConfig) -> Result<(TcpListener, u16), CommError> {
    let l = TcpListener::bind((cfg.bind_ip, 0))
        .map_err(|e| CommError::io(format!("binding the ring listener on {}", cfg.bind_ip), e))?;
    let port = l.local_addr().map_err(|e| CommError::io("ring listener address", e))?.port();
    Ok((l, port))
}

fn tune(s: &TcpStream, cfg: &TcpConfig) -> Result<(), CommError> {
    let io = |e| CommError::io("configuring a ring socket", e);
    s.set_nodelay(true).map_err(io)?;
    s.set_read_timeout(None).map_err(io)?;
    s.set_write_timeout(None).map_err(io)?;
    if let Some(b) = cfg.socket_buffer {
        let r = socket2::SockRef::from(s);
        r.set_send_buffer_size(b).map_err(io)?;
        r.set_recv_buffer_size(b).map_err(io)?;
    }
    engine::set_nonblocking(s).map_err(io)
}

impl TcpComm {
    /// Rank 0: waits for the other `world_size - 1` ranks on `listener`, then builds the ring.
    pub fn master(listener: MasterListener, world_size: usize, cfg: TcpConfig) -> Result<TcpComm, CommError> {
        validate(0, world_size, &cfg)?;
        let mut late = None;
        let mut comm = Self::setup(0, world_size, cfg, |cfg, ring_port| {
            let own = (rendezvous::advertised_host(cfg), ring_port);
            let (table, joined) = rendezvous::serve(&listener.listener, world_size, cfg, own)?;
            late = rendezvous::LateRefuser::spawn(listener.listener, world_size, cfg, joined);
            Ok(table)
        })?;
        comm._late = late;
        Ok(comm)
    }

    /// Ranks 1..: registers with rank 0 at `master` (`host:port`), then builds the ring.
    pub fn worker(master: &str, rank: usize, world_size: usize, cfg: TcpConfig) -> Result<TcpComm, CommError> {
        validate(rank, world_size, &cfg)?;
        if rank == 0 {
            return Err(CommError::InvalidArgument("rank 0 is the master; use TcpComm::master".into()));
        }
        let master = master.to_string();
        Self::setup(rank, world_size, cfg, |cfg, ring_port| {
            rendezvous::register(
                &master,
                rank,
                world_size,
                cfg,
                (rendezvous::advertised_host(cfg).unwrap_or_default(), ring_port),
            )
        })
    }

    /// Either role, from a detected launch environment: rank 0 binds
    /// `master_addr:master_port`, the others connect to it. Port 0 is refused (rank 0 would listen
    /// where nobody looks), and a launch without a job token outside loopback is warned about.
    pub fn from_launch(env: &LaunchEnv, cfg: TcpConfig) -> Result<TcpComm, CommError> {
        if env.world_size > 1 && env.master_port == 0 {
            return Err(CommError::launch(
                "MASTER_PORT",
                "MASTER_PORT=0 cannot be used: rank 0 would listen on a random port that the other \
                 ranks cannot know; choose a free port",
            ));
        }
        if let Some(w) = open_job_warning(env, &cfg) {
            qsr_notice::notice(true, &w);
        }
        let host =
            if env.master_addr.contains(':') { format!("[{}]", env.master_addr) } else { env.master_addr.clone() };
        let addr = format!("{host}:{}", env.master_port);
        if env.rank == 0 {
            if env.world_size == 1 {
                return Self::master_single(cfg);
            }
            Self::master(MasterListener::bind(&addr)?, env.world_size, cfg)
        } else {
            Self::worker(&addr, env.rank, env.world_size, cfg)
        }
    }

    fn master_single(cfg: TcpConfig) -> Result<TcpComm, CommError> {
        validate(0, 1, &cfg)?;
        Ok(TcpComm {
            rank: 0,
            n: 1,
            cfg,
            ring: None,
            seq: 0,
            tag: None,
            stats: CommStats::default(),
            broken: None,
            scratch: Vec::new(),
            wire: Vec::new(),
            quant_master: Vec::new(),
            // Nobody connects to a ring of one; a group split from it is one rank too (N2).
            hosts: vec!["127.0.0.1".into()],
            progress: None,
            doubling: None,
            _late: None,
        })
    }

    fn setup<F>(rank: usize, n: usize, cfg: TcpConfig, rendezvous: F) -> Result<TcpComm, CommError>
    where
        F: FnOnce(&TcpConfig, u16) -> Result<Vec<(String, u16)>, CommError>,
    {
        if n == 1 {
            return Self::master_single(cfg);
        }
        let (ring_listener, port) = ring_listener(&cfg)?;
        let table = rendezvous(&cfg, port)?;
        Self::from_table(rank, n, cfg, &ring_listener, table)
    }

    /// Forms the ring from the address table every rank agreed on, our listener among it.
    pub(crate) fn from_table(
        rank: usize,
        n: usize,
        cfg: TcpConfig,
        ring_listener: &TcpListener,
        table: Vec<(String, u16)>,
    ) -> Result<TcpComm, CommError> {
        Self::from_table_unless(rank, n, cfg, ring_listener, (table, &mut || None))
    }

    /// [`Self::from_table`], abandoned when `abort` says why ([`RingSeat::form_unless`]).
    fn from_table_unless(
        rank: usize,
        n: usize,
        cfg: TcpConfig,
        ring_listener: &TcpListener,
        (table, abort): (Vec<(String, u16)>, &mut rendezvous::Abort<'_>),
    ) -> Result<TcpComm, CommError> {
        if n == 1 {
            return Self::master_single(cfg);
        }
        let (left, right) = rendezvous::connect_ring(ring_listener, (rank, n), &table, &cfg, abort)?;
        tune(&left, &cfg)?;
        tune(&right, &cfg)?;
        let name = |s: &TcpStream| s.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
        let ring = Ring {
            left_addr: name(&left),
            right_addr: name(&right),
            left,
            right,
            back_out: Vec::new(),
            back_off: 0,
            back_in: [0; wire::BACK_LEN],
            back_got: 0,
            right_closed: false,
            left_back_broken: false,
        };
        tracing::debug!(rank, n, left = %ring.left_addr, right = %ring.right_addr, "tcp ring ready");
        Ok(TcpComm {
            rank,
            n,
            cfg,
            ring: Some(ring),
            seq: 0,
            tag: None,
            stats: CommStats::default(),
            broken: None,
            scratch: Vec::new(),
            wire: Vec::new(),
            quant_master: Vec::new(),
            hosts: table.into_iter().map(|(h, _)| h).collect(),
            progress: None,
            doubling: None,
            _late: None,
        })
    }

    /// Calls `f` whenever a call moves bytes (at most once per wait for the sockets).
    pub(crate) fn set_progress(&mut self, f: Box<dyn Fn() + Send + Sync>) {
        let f: Arc<dyn Fn() + Send + Sync> = Arc::from(f);
        if let Some(d) = &mut self.doubling {
            d.set_progress(&f);
        }
        self.progress = Some(f);
    }

    /// Whether an all-reduce of `len` f32s takes recursive doubling (see [`TcpConfig::doubling_bytes`]).
    /// Not for two ranks, where the ring takes two half-buffer hops against one exchange
    /// (measurements: docs/BENCHMARKS.md, section "All-reduce defaults"), nor for fewer values than
    /// ranks, where most ring segments are empty and cost nothing.
    fn doubles(&self, len: usize) -> bool {
        (3..=doubling::MAX_RANKS).contains(&self.n)
            && len >= self.n
            && len * 4 <= self.cfg.doubling_bytes.min(chunk_bytes(&self.cfg))
    }

    /// One exchange with the other rank of a ring of two: both end with the sum, bit-identical.
    pub(crate) fn exchange(&mut self, buf: &mut [f32]) -> Result<(), CommError> {
        let len = buf.len() * 4;
        let plan = plan::exchange(buf.len());
        self.call(wire::KIND_ALL_REDUCE, ReduceOp::Sum.code(), 0, Buf::F32(buf), len, plan)
    }

    /// A small all-reduce by recursive doubling over the pairs (formed on the first).
    fn all_reduce_small(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        if let Some(b) = &self.broken {
            return Err(CommError::Broken(b.clone()));
        }
        let mut d = match self.doubling.take() {
            Some(d) => d,
            None => {
                let mut d =
                    Box::new(doubling::Doubling::join(self).inspect_err(|e| self.broken = Some(e.to_string()))?);
                if let Some(f) = &self.progress {
                    d.set_progress(f);
                }
                d
            }
        };
        let start = Instant::now();
        d.set_tag(self.tag);
        let res = d.all_reduce(buf, op == ReduceOp::Mean);
        // Accounted as every backend accounts an all-reduce: the ring's bytes, as the plans count them.
        let bytes = crate::ring_allreduce_bytes(buf.len(), 4, self.n);
        self.stats.record(bytes, bytes, start.elapsed().as_secs_f64());
        self.doubling = Some(d);
        if let Err(e) = &res {
            self.broken = Some(e.to_string());
        }
        res
    }

    /// Every rank's host, as the others reach it (for rings formed over this one).
    pub(crate) fn hosts(&self) -> &[String] {
        &self.hosts
    }

    /// The configuration this communicator runs with.
    pub fn config(&self) -> &TcpConfig {
        &self.cfg
    }

    /// Runs one wire call; `plan` is computed from (rank, n, chunk).
    fn call(
        &mut self,
        kind: u8,
        op: u8,
        root: usize,
        buf: Buf<'_>,
        len_bytes: usize,
        plan: plan::Plan,
    ) -> Result<(), CommError> {
        if let Some(b) = &self.broken {
            return Err(CommError::Broken(b.clone()));
        }
        let seq = self.seq;
        self.seq += 1;
        let start = Instant::now();
        let Some(ring) = self.ring.as_mut() else {
            self.stats.record(0, 0, start.elapsed().as_secs_f64());
            return Ok(());
        };
        let name = match kind {
            wire::KIND_ALL_REDUCE => "all_reduce",
            wire::KIND_BROADCAST => "broadcast",
            wire::KIND_BARRIER => "barrier",
            wire::KIND_BROADCAST_LEN => "broadcast_bytes (length)",
            _ => "broadcast_bytes",
        };
        let header = CallHeader {
            kind,
            op,
            chunk: chunk_units(&self.cfg),
            root: root as u32,
            seq,
            len: len_bytes as u64,
            sender: self.rank as u32,
            tag: self.tag,
        };
        let during = format!("{name} seq {seq} ({len_bytes} bytes)");
        let mut call =
            Call::new(ring, self.rank, self.n, self.cfg.timeout, buf, &mut self.scratch, plan, header, during);
        call.progress = self.progress.as_deref();
        let res = call.run();
        let (sent, received) = (call.sent, call.received);
        self.stats.record(sent, received, start.elapsed().as_secs_f64());
        if let Err(e) = &res {
            self.broken = Some(e.to_string());
        }
        res
    }

    fn broadcast_raw(&mut self, kind: u8, buf: &mut [u8], root: usize) -> Result<(), CommError> {
        let plan = if self.n > 1 {
            plan::broadcast(self.rank, self.n, root, buf.len(), chunk_bytes(&self.cfg))
        } else {
            Default::default()
        };
        let len = buf.len();
        self.call(kind, wire::OP_NONE, root, Buf::Bytes(buf), len, plan)
    }
}

impl Collective for TcpComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.n
    }

    fn all_reduce(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        if self.doubles(buf.len()) {
            return self.all_reduce_small(buf, op);
        }
        let plan = if self.n > 1 {
            plan::all_reduce(self.rank, self.n, buf.len(), op == ReduceOp::Mean, chunk_bytes(&self.cfg))
        } else {
            Default::default()
        };
        let len = buf.len() * 4;
        self.call(wire::KIND_ALL_REDUCE, op.code(), 0, Buf::F32(buf), len, plan)
    }

    fn supports_bf16(&self) -> bool {
        true
    }

    fn all_reduce_bf16(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        if self.n == 1 {
            return self.all_reduce(buf, op); // nothing travels: the buffer stays as it is
        }
        let mean = op == ReduceOp::Mean;
        let plan = plan::all_reduce_of(self.rank, self.n, buf.len(), mean, chunk_bytes(&self.cfg), 2);
        let mut wire = std::mem::take(&mut self.wire);
        wire.clear();
        wire.resize(buf.len() * 2, 0);
        buf.iter().zip(wire.chunks_exact_mut(2)).for_each(|(x, w)| engine::put_bf16(*x, w));
        let code = if mean { wire::OP_MEAN_BF16 } else { wire::OP_SUM_BF16 };
        let len = wire.len();
        let res = self.call(wire::KIND_ALL_REDUCE, code, 0, Buf::Bf16 { master: buf, wire: &mut wire }, len, plan);
        if res.is_ok() {
            // Every rank takes the values on the wire, its own segment's too: bit-identical everywhere.
            buf.iter_mut().zip(wire.chunks_exact(2)).for_each(|(x, w)| *x = engine::bf16_at(w));
        }
        self.wire = wire;
        res
    }

    fn supports_quantized(&self) -> bool {
        true
    }

    fn all_reduce_quantized(&mut self, buf: &mut [f32], op: ReduceOp, codec: Codec) -> Result<(), CommError> {
        if self.n == 1 {
            return self.all_reduce(buf, op); // nothing travels: the buffer stays as it is
        }
        let mean = op == ReduceOp::Mean;
        // The ring's elements are whole blocks: every segment and pipelining block ends on one.
        let (blocks, block_bytes) = (buf.len().div_ceil(WIRE_BLOCK), codec.block_bytes());
        let plan = plan::all_reduce_of(self.rank, self.n, blocks, mean, chunk_bytes(&self.cfg), block_bytes);
        let mut master = std::mem::take(&mut self.quant_master);
        master.clear();
        master.extend_from_slice(buf);
        master.resize(blocks * WIRE_BLOCK, 0.0);
        let mut wire = std::mem::take(&mut self.wire);
        wire.clear();
        wire.resize(blocks * block_bytes, 0);
        for (m, w) in master.chunks(WIRE_BLOCK).zip(wire.chunks_mut(block_bytes)) {
            codec.put_block(m, w);
        }
        let code = match codec {
            Codec::Int8 if mean => wire::OP_MEAN_INT8,
            Codec::Int8 => wire::OP_SUM_INT8,
            Codec::Fp8E4m3 if mean => wire::OP_MEAN_FP8,
            Codec::Fp8E4m3 => wire::OP_SUM_FP8,
            Codec::Int4 if mean => wire::OP_MEAN_INT4,
            Codec::Int4 => wire::OP_SUM_INT4,
            Codec::Int2 if mean => wire::OP_MEAN_INT2,
            Codec::Int2 => wire::OP_SUM_INT2,
        };
        // The header carries the f32 buffer's length: ranks whose buffers differ inside one block
        // would otherwise agree on the padded wire length.
        let len = buf.len() * 4;
        let quantized = Buf::Quantized { master: &mut master, wire: &mut wire, codec, len: buf.len() };
        let res = self.call(wire::KIND_ALL_REDUCE, code, 0, quantized, len, plan);
        if res.is_ok() {
            // Every rank takes the values on the wire, its own segment's too: bit-identical everywhere.
            let mut block = [0.0f32; WIRE_BLOCK];
            for (x, w) in buf.chunks_mut(WIRE_BLOCK).zip(wire.chunks(block_bytes)) {
                codec.get_block(w, &mut block);
                x.copy_from_slice(&block[..x.len()]);
            }
        }
        self.wire = wire;
        self.quant_master = master;
        res
    }

    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        crate::inproc::check_root(root, self.n)?;
        self.broadcast_raw(wire::KIND_BROADCAST, crate::util::f32_bytes_mut(buf), root)
    }

    fn broadcast_bytes(&mut self, bytes: &mut Vec<u8>, root: usize) -> Result<(), CommError> {
        crate::inproc::check_root(root, self.n)?;
        let rank = self.rank;
        let raw = |b: &mut [u8], length: bool| {
            let kind = if length { wire::KIND_BROADCAST_LEN } else { wire::KIND_BROADCAST_BYTES };
            self.broadcast_raw(kind, b, root)
        };
        let res = crate::broadcast_sized(bytes, root, rank, raw);
        if let Err(e) = &res {
            self.broken.get_or_insert_with(|| e.to_string());
        }
        res
    }

    fn set_tag(&mut self, tag: Option<crate::SyncTag>) {
        self.tag = tag;
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        let mut one = [1.0f32];
        let plan = if self.n > 1 {
            plan::all_reduce(self.rank, self.n, 1, false, chunk_bytes(&self.cfg))
        } else {
            Default::default()
        };
        self.call(wire::KIND_BARRIER, ReduceOp::Sum.code(), 0, Buf::F32(&mut one), 4, plan)?;
        if one[0] != self.n as f32 {
            let e = format!("barrier counted {} ranks, expected {}", one[0], self.n);
            self.broken = Some(e.clone());
            return Err(CommError::Protocol { peer: "the ring".into(), detail: e });
        }
        Ok(())
    }

    fn stats(&self) -> &CommStats {
        &self.stats
    }

    fn backend(&self) -> &'static str {
        "tcp"
    }
}

impl Drop for TcpComm {
    fn drop(&mut self) {
        if let Some(r) = &self.ring {
            let _ = r.right.shutdown(Shutdown::Write);
            let _ = r.left.shutdown(Shutdown::Write);
            // Closing a socket with unread bytes makes the kernel send RST, and a peer that receives RST
            // can lose what we sent last (an abort notice naming the culprit) and blame us instead.
            // Read until the peers close too, briefly.
            let until = Instant::now() + Duration::from_millis(200);
            drain(&r.right, until);
            drain(&r.left, until);
        }
    }
}

fn drain(s: &TcpStream, until: Instant) {
    use std::io::Read;
    let _ = s.set_nonblocking(false);
    let mut scratch = [0u8; 16 << 10];
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() || s.set_read_timeout(Some(left)).is_err() {
            return;
        }
        match (&*s).read(&mut scratch) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

/// Resolves `host:port` to its first address (for diagnostics and tests).
pub fn resolve(addr: &str) -> Result<SocketAddr, CommError> {
    addr.to_socket_addrs()
        .map_err(|e| CommError::io(format!("resolving {addr}"), e))?
        .next()
        .ok_or_else(|| CommError::InvalidArgument(format!("{addr} resolves to no address")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_from_env() {
        let env = |k: &str| match k {
            "QSR_JOB_TOKEN" => Some("tok".to_string()),
            "QSR_COMM_TIMEOUT_SECS" => Some("2.5".to_string()),
            "QSR_BIND_ADDR" => Some("0.0.0.0".to_string()),
            _ => None,
        };
        let c = TcpConfig::from_env(&env).unwrap();
        assert_eq!(
            (c.token.as_str(), c.timeout, c.bind_ip.to_string()),
            ("tok", Duration::from_millis(2500), "0.0.0.0".to_string())
        );
        let bad = |k: &str| (k == "QSR_COMM_TIMEOUT_SECS").then(|| "-1".to_string());
        assert!(TcpConfig::from_env(&bad).unwrap_err().to_string().contains("QSR_COMM_TIMEOUT_SECS=-1"));
        assert_ne!(random_token(), random_token());
        assert_eq!(random_token().len(), 32);
    }

    #[test]
    fn token_warning_only_for_open_launches() {
        let env = |addr: &str, n| LaunchEnv {
            rank: 1,
            world_size: n,
            local_rank: 0,
            master_addr: addr.into(),
            master_port: 29500,
            source: crate::Source::Torchrun,
        };
        let open = TcpConfig::default();
        let w = open_job_warning(&env("0.0.0.0", 2), &open).expect("open launch");
        assert!(w.contains("QSR_JOB_TOKEN is not set and MASTER_ADDR=0.0.0.0"), "{w}");
        for loopback in ["127.0.0.1", "::1", "[::1]", "localhost"] {
            assert_eq!(open_job_warning(&env(loopback, 2), &open), None, "{loopback}");
        }
        assert_eq!(open_job_warning(&env("0.0.0.0", 1), &open), None);
        let secret = TcpConfig { token: "s".into(), ..TcpConfig::default() };
        assert_eq!(open_job_warning(&env("0.0.0.0", 2), &secret), None);
        let exposed_ring = TcpConfig { bind_ip: IpAddr::V4(Ipv4Addr::UNSPECIFIED), ..TcpConfig::default() };
        let w = open_job_warning(&env("127.0.0.1", 2), &exposed_ring).expect("ring port open");
        assert!(w.contains("QSR_BIND_ADDR=0.0.0.0"), "{w}");
    }

    #[test]
    fn progress_is_reported_by_every_call_even_one_that_never_waits() {
        let listener = MasterListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let worker = std::thread::spawn(move || {
            let mut c = TcpComm::worker(&addr, 1, 2, TcpConfig::default()).unwrap();
            c.all_reduce(&mut vec![1.0; 4 << 20], ReduceOp::Sum).unwrap();
        });
        let mut c = TcpComm::master(listener, 2, TcpConfig::default()).unwrap();
        let beats = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let b = std::sync::Arc::clone(&beats);
        c.set_progress(Box::new(move || {
            b.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }));
        c.all_reduce(&mut vec![1.0; 4 << 20], ReduceOp::Sum).unwrap();
        worker.join().unwrap();
        assert!(beats.load(std::sync::atomic::Ordering::Relaxed) > 0);
    }

    #[test]
    fn single_rank_is_a_no_op() {
        let env = LaunchEnv {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: 0,
            source: crate::Source::Single,
        };
        let mut c = TcpComm::from_launch(&env, TcpConfig::default()).unwrap();
        let mut v = vec![1.5f32, -2.0];
        c.all_reduce(&mut v, ReduceOp::Mean).unwrap();
        c.barrier().unwrap();
        let mut b = b"hi".to_vec();
        c.broadcast_bytes(&mut b, 0).unwrap();
        assert_eq!((v, b, c.stats().calls), (vec![1.5, -2.0], b"hi".to_vec(), 4));
        assert!(c.broadcast(&mut [0.0], 1).is_err());
    }
}

// The ring against a peer that speaks the wire by hand (`fake_peer.rs`).
#[cfg(test)]
mod fake_peer;
