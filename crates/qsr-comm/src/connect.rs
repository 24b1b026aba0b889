//! Choosing the transport of a launch: shared memory among ranks on one host, TCP between hosts.

use serde::{Deserialize, Serialize};

use crate::shm::{self, ShmConfig};
use crate::util::all_gather_bytes;
use crate::{Collective, CommError, LaunchEnv, TcpComm, TcpConfig};
use qsr_notice::notice;

/// How the ranks of a launch reach each other (`QSR_TRANSPORT`: `auto`, `tcp` or `shm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// Shared memory when every rank runs on one host, the TCP ring otherwise (the default).
    #[default]
    Auto,
    /// The TCP ring, even between ranks of one host (what `cargo xtask netem` shapes).
    Tcp,
    /// Shared memory; an error unless every rank runs on one host.
    Shm,
}

impl Transport {
    /// The value of `QSR_TRANSPORT` that chooses it.
    pub fn name(self) -> &'static str {
        match self {
            Transport::Auto => "auto",
            Transport::Tcp => "tcp",
            Transport::Shm => "shm",
        }
    }

    /// `QSR_TRANSPORT` from `env` (as in [`crate::detect`]); unset means [`Transport::Auto`].
    pub fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<Transport, CommError> {
        match env("QSR_TRANSPORT").as_deref().map(str::trim) {
            None | Some("auto") => Ok(Transport::Auto),
            Some("tcp") => Ok(Transport::Tcp),
            Some("shm") => Ok(Transport::Shm),
            Some(v) => {
                Err(CommError::launch("QSR_TRANSPORT", format!("QSR_TRANSPORT={v} is not one of auto, tcp, shm")))
            }
        }
    }
}

/// This host's identity, which decides which ranks share memory: `QSR_HOST_ID` when set (tests and
/// `cargo xtask netem` give each simulated node its own), else the host name, the kernel's boot id,
/// the device and inode of the shared-memory directory (containers with their own `/dev/shm`
/// differ there) and the pid namespace (ranks must see each other's processes to watch them).
pub fn host_id(env: &dyn Fn(&str) -> Option<String>, cfg: &ShmConfig) -> String {
    use std::os::unix::fs::MetadataExt;
    if let Some(id) = env("QSR_HOST_ID") {
        return id;
    }
    let read = |p: &str| {
        qsr_files::read_text(std::path::Path::new(p), 4096, "kernel file")
            .map(|s| s.trim().to_string())
            .unwrap_or_default()
    };
    let dir = std::fs::metadata(&cfg.dir).map(|m| format!("{}:{}", m.dev(), m.ino())).unwrap_or_default();
    let (host, boot) = (read("/proc/sys/kernel/hostname"), read("/proc/sys/kernel/random/boot_id"));
    format!("{host}/{boot}/{dir}/{}", crate::shm::pid_ns())
}

/// The collective of a launch over our own transports: the TCP rendezvous and ring of
/// [`TcpComm::from_launch`], then, as `transport` says, a shared-memory group when every rank
/// reported the same [`host_id`]. Under [`Transport::Auto`] a shared-memory setup that fails (no
/// `/dev/shm`, not enough room in it) falls back to the ring with a warning naming the cause. A job
/// spread over several hosts, some with several ranks, sums inside each host through shared memory
/// and between hosts over a ring of one leader per host; with one rank per host it keeps the ring.
pub fn connect(env: &LaunchEnv, cfg: TcpConfig, transport: Transport) -> Result<Box<dyn Collective>, CommError> {
    let shm_cfg = ShmConfig { timeout: cfg.timeout, ..ShmConfig::default() };
    let host = host_id(&|k| std::env::var(k).ok(), &shm_cfg);
    let mut boot = TcpComm::from_launch(env, cfg)?;
    if boot.world_size() > 1 {
        // Ranks launched with different transports would go different ways below.
        crate::agree(&mut boot, &serde_json::json!({ "QSR_TRANSPORT": transport.name() }))?;
    }
    over_ring(boot, transport, &host, shm_cfg)
}

/// [`connect`] once the ring exists: every rank passes its own `host`.
pub fn over_ring(
    mut boot: TcpComm,
    transport: Transport,
    host: &str,
    shm_cfg: ShmConfig,
) -> Result<Box<dyn Collective>, CommError> {
    if transport == Transport::Tcp || boot.world_size() == 1 {
        return Ok(Box::new(boot));
    }
    let hosts = all_gather_bytes(&mut boot, host.as_bytes())?;
    let groups = by_host(&hosts);
    if groups.len() > 1 && transport == Transport::Shm {
        return Err(CommError::InvalidArgument(format!(
            "QSR_TRANSPORT=shm needs every rank on one host, but the ranks report {} hosts (rank {} is on \
             another host than rank 0)",
            groups.len(),
            groups[1][0]
        )));
    }
    if groups.len() == boot.world_size() {
        return Ok(Box::new(boot)); // one rank per host: nothing to share
    }
    // The shared-memory setup fails on every rank alike, so all fall back together.
    let local = match shm::join(&mut boot, &groups, shm_cfg) {
        Ok(c) => c,
        Err(e) if transport == Transport::Auto => {
            notice(true, &format!("shared memory is not available, using the TCP ring: {e}"));
            return Ok(Box::new(boot));
        }
        Err(e) => return Err(e),
    };
    if groups.len() == 1 {
        return Ok(Box::new(local));
    }
    Ok(Box::new(crate::hier::join(&mut boot, &groups, local)?))
}

/// Splits a launch's ring into sub-communicators, as `MPI_Comm_split`: the ranks that pass the same
/// `color` form one group, ranked by `key` (ties by their rank in `ring`), over the same transports
/// as [`over_ring`] chooses for a launch (shared memory among the members on one host, a ring of their
/// own between hosts, both for a group spread over hosts with several members on some). Every rank
/// of `ring` must call it; the ring stays usable. The new group's ranks are `0..members`, in key
/// order; its errors name the peers by their rank in `ring`, so a culprit reads the same at every
/// level.
///
/// A two-level job splits by node ([`split_by_host`], or `color = rank / workers_per_node`) and keeps
/// the ring for the global level:
///
/// ```no_run
/// # fn main() -> Result<(), qsr_comm::CommError> {
/// use qsr_comm::{ShmConfig, TcpComm, TcpConfig, Transport};
///
/// let env = qsr_comm::detect_from_process_env(&Default::default())?;
/// let mut ring = TcpComm::from_launch(&env, TcpConfig::default())?;
/// let host = qsr_comm::host_id(&|k| std::env::var(k).ok(), &ShmConfig::default());
/// let node = qsr_comm::split_by_host(&mut ring, Transport::Auto, &host, ShmConfig::default())?;
/// let world = qsr_comm::over_ring(ring, Transport::Auto, &host, ShmConfig::default())?;
/// # let _ = (node, world);
/// # Ok(())
/// # }
/// ```
pub fn split(
    ring: &mut TcpComm,
    color: u32,
    key: u32,
    transport: Transport,
    host: &str,
    shm_cfg: ShmConfig,
) -> Result<Box<dyn Collective>, CommError> {
    let cfg = ring.config().clone();
    let (listener, port) = crate::tcp::ring_listener(&cfg)?;
    let mine = [&color.to_le_bytes()[..], &key.to_le_bytes(), &port.to_le_bytes()].concat();
    let all = all_gather_bytes(ring, &mine)?;
    let field = |b: &[u8], at: usize| b.get(at..at + 4).map(|x| u32::from_le_bytes([x[0], x[1], x[2], x[3]]));
    let mut members = Vec::new();
    for (r, b) in all.iter().enumerate() {
        let (Some(c), Some(k), Some(p)) = (field(b, 0), field(b, 4), b.get(8..10)) else {
            return Err(CommError::InvalidArgument(format!("rank {r} sent a malformed split request")));
        };
        if c == color {
            members.push((k, r, u16::from_le_bytes([p[0], p[1]])));
        }
    }
    members.sort_unstable();
    let me = members.iter().position(|&(_, r, _)| r == ring.rank()).expect("this rank passed its own color");
    let table = members.iter().map(|&(_, r, p)| (ring.hosts()[r].clone(), p)).collect();
    let names: Vec<usize> = members.iter().map(|&(_, r, _)| r).collect();
    let rename = |e| crate::status::rename(e, &names);
    let sub = TcpComm::from_table(me, members.len(), cfg, &listener, table).map_err(rename)?;
    let inner = over_ring(sub, transport, host, shm_cfg).map_err(rename)?;
    Ok(Box::new(Split { inner, names }))
}

/// A group made by [`split`]: its collectives, with the peers its errors name given by their rank in
/// the ring it was split from.
struct Split {
    inner: Box<dyn Collective>,
    names: Vec<usize>,
}

impl Split {
    fn named<T>(&self, r: Result<T, CommError>) -> Result<T, CommError> {
        r.map_err(|e| crate::status::rename(e, &self.names))
    }
}

impl Collective for Split {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_reduce(&mut self, buf: &mut [f32], op: crate::ReduceOp) -> Result<(), CommError> {
        let r = self.inner.all_reduce(buf, op);
        self.named(r)
    }
    fn all_reduce_bf16(&mut self, buf: &mut [f32], op: crate::ReduceOp) -> Result<(), CommError> {
        let r = self.inner.all_reduce_bf16(buf, op);
        self.named(r)
    }
    fn supports_bf16(&self) -> bool {
        self.inner.supports_bf16()
    }
    fn all_reduce_quantized(
        &mut self,
        buf: &mut [f32],
        op: crate::ReduceOp,
        codec: crate::Codec,
    ) -> Result<(), CommError> {
        let r = self.inner.all_reduce_quantized(buf, op, codec);
        self.named(r)
    }
    fn supports_quantized(&self) -> bool {
        self.inner.supports_quantized()
    }
    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        let r = self.inner.broadcast(buf, root);
        self.named(r)
    }
    fn broadcast_bytes(&mut self, bytes: &mut Vec<u8>, root: usize) -> Result<(), CommError> {
        let r = self.inner.broadcast_bytes(bytes, root);
        self.named(r)
    }
    fn barrier(&mut self) -> Result<(), CommError> {
        let r = self.inner.barrier();
        self.named(r)
    }
    fn set_tag(&mut self, tag: Option<crate::SyncTag>) {
        self.inner.set_tag(tag)
    }
    fn stats(&self) -> &crate::CommStats {
        self.inner.stats()
    }
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
}

/// [`split`] into one group per host (the ranks that report the same [`host_id`]), as
/// `MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)`: each rank's node, numbered by its first rank.
pub fn split_by_host(
    ring: &mut TcpComm,
    transport: Transport,
    host: &str,
    shm_cfg: ShmConfig,
) -> Result<Box<dyn Collective>, CommError> {
    let hosts = all_gather_bytes(ring, host.as_bytes())?;
    let me = ring.rank();
    let color = by_host(&hosts).iter().position(|g| g.contains(&me)).expect("every rank is in a host group");
    split(ring, color as u32, me as u32, transport, host, shm_cfg)
}

/// Ranks grouped by equal host identity, groups ordered by their first rank.
fn by_host(hosts: &[Vec<u8>]) -> Vec<Vec<usize>> {
    let mut groups: Vec<(&[u8], Vec<usize>)> = Vec::new();
    for (r, h) in hosts.iter().enumerate() {
        match groups.iter_mut().find(|(id, _)| *id == h.as_slice()) {
            Some((_, members)) => members.push(r),
            None => groups.push((h, vec![r])),
        }
    }
    groups.into_iter().map(|(_, m)| m).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transport_from_env() {
        let env = |v: &'static str| move |k: &str| (k == "QSR_TRANSPORT").then(|| v.to_string());
        assert_eq!(Transport::from_env(&|_| None).unwrap(), Transport::Auto);
        assert_eq!(Transport::from_env(&env("shm")).unwrap(), Transport::Shm);
        assert_eq!(Transport::from_env(&env(" tcp ")).unwrap(), Transport::Tcp);
        let e = Transport::from_env(&env("udp")).unwrap_err().to_string();
        assert!(e.contains("QSR_TRANSPORT=udp"), "{e}");
    }

    #[test]
    fn ranks_group_by_host_in_order_of_first_rank() {
        let h = |s: &str| s.as_bytes().to_vec();
        assert_eq!(by_host(&[h("b"), h("a"), h("b"), h("a")]), vec![vec![0, 2], vec![1, 3]]);
        assert_eq!(by_host(&vec![h("x"); 3]), vec![vec![0, 1, 2]]);
    }

    #[test]
    fn host_id_prefers_the_override() {
        let cfg = ShmConfig::default();
        assert_eq!(host_id(&|k| (k == "QSR_HOST_ID").then(|| "node-7".into()), &cfg), "node-7");
        let id = host_id(&|_| None, &cfg);
        assert_eq!(id, host_id(&|_| None, &cfg));
        assert!(id.len() > 2, "{id}");
    }
}
