//! Rendezvous and ring setup.
//!
//! 1. Every rank binds its ring listener (ephemeral port on the bind address).
//! 2. Ranks 1..n connect to rank 0 at `MASTER_ADDR:MASTER_PORT` (retrying until the rendezvous
//!    timeout, since rank 0 may start later) and send a registration hello: protocol version,
//!    job token, world size, rank, ring listener address.
//! 3. Rank 0 reads each hello on a helper thread with a short read timeout, so garbage or a
//!    silent connection is dropped without stalling anyone; it refuses a wrong version, token,
//!    world size, out-of-range or duplicate rank with a reply naming the field, and keeps waiting.
//!    Once all n-1 ranks registered it sends everyone the address table.
//! 4. Each rank connects to its right neighbour's ring listener and sends a ring hello, and
//!    accepts its left neighbour (validating token, world size and that it is the expected rank).
//!    Connects complete against the listen backlog, so the order cannot deadlock.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use crate::CommError;
use crate::wire::{self, Field, Hello, PREFIX_LEN, PROTOCOL_VERSION, Purpose, Reply};

use super::TcpConfig;

/// Connections whose hello is being read at once; more are dropped (a flood cannot exhaust us).
const MAX_PENDING_HELLOS: usize = 64;

pub(crate) enum Incoming {
    Hello(Hello, TcpStream, SocketAddr),
    WrongVersion(u32, TcpStream, SocketAddr),
    Garbage(String, SocketAddr),
}

/// Reads one hello, bounded in size and time.
fn read_hello(mut s: TcpStream, peer: SocketAddr, timeout: Duration) -> Incoming {
    let garbage = |what: String| Incoming::Garbage(what, peer);
    if let Err(e) = s
        .set_nonblocking(false)
        .and_then(|_| s.set_read_timeout(Some(timeout)))
    {
        return garbage(format!("socket setup failed: {e}"));
    }
    let mut prefix = [0u8; PREFIX_LEN];
    if let Err(e) = s.read_exact(&mut prefix) {
        return garbage(format!("no complete hello within {timeout:?}: {e}"));
    }
    let p = match wire::decode_prefix(&prefix, &wire::HELLO_MAGIC, wire::MAX_HELLO_BODY) {
        Ok(p) => p,
        Err(e) => return garbage(e.to_string()),
    };
    if p.version != PROTOCOL_VERSION {
        return Incoming::WrongVersion(p.version, s, peer);
    }
    let mut body = vec![0u8; p.body_len];
    if let Err(e) = s.read_exact(&mut body) {
        return garbage(format!("hello body incomplete: {e}"));
    }
    match Hello::decode_body(p.version, &body) {
        Ok(h) => Incoming::Hello(h, s, peer),
        Err(e) => garbage(e.to_string()),
    }
}

/// Accepts connections on a listener and reads their hellos on helper threads.
pub(crate) struct Acceptor<'a> {
    listener: &'a TcpListener,
    tx: mpsc::Sender<Incoming>,
    rx: mpsc::Receiver<Incoming>,
    pending: Arc<AtomicUsize>,
    hello_timeout: Duration,
}

impl<'a> Acceptor<'a> {
    pub(crate) fn new(
        listener: &'a TcpListener,
        hello_timeout: Duration,
    ) -> Result<Self, CommError> {
        listener
            .set_nonblocking(true)
            .map_err(|e| CommError::io("listener setup", e))?;
        let (tx, rx) = mpsc::channel();
        Ok(Acceptor {
            listener,
            tx,
            rx,
            pending: Arc::new(AtomicUsize::new(0)),
            hello_timeout,
        })
    }

    /// The next connection's hello, or `None` once `deadline` passed.
    pub(crate) fn next(&mut self, deadline: Instant) -> Option<Incoming> {
        loop {
            loop {
                match self.listener.accept() {
                    Ok((s, peer)) => {
                        if self.pending.load(Ordering::SeqCst) >= MAX_PENDING_HELLOS {
                            tracing::warn!(%peer, "too many connections without a hello; dropping");
                            continue;
                        }
                        self.pending.fetch_add(1, Ordering::SeqCst);
                        let (tx, pending, timeout) = (
                            self.tx.clone(),
                            Arc::clone(&self.pending),
                            self.hello_timeout,
                        );
                        let spawned =
                            std::thread::Builder::new()
                                .name("qsr-hello".into())
                                .spawn(move || {
                                    let inc = read_hello(s, peer, timeout);
                                    pending.fetch_sub(1, Ordering::SeqCst);
                                    let _ = tx.send(inc);
                                });
                        if spawned.is_err() {
                            self.pending.fetch_sub(1, Ordering::SeqCst);
                            tracing::warn!(%peer, "cannot spawn a hello reader; dropping connection");
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        // EMFILE and friends: transient, keep serving.
                        tracing::warn!(error = %e, "accept failed");
                        break;
                    }
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            let wait = (deadline - now).min(Duration::from_millis(10));
            match self.rx.recv_timeout(wait) {
                Ok(inc) => return Some(inc),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => return None,
            }
        }
    }
}

/// Byte-wise comparison whose time does not depend on where the tokens differ.
fn same_token(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn send_reply(s: &mut TcpStream, reply: &Reply, timeout: Duration) {
    let _ = s.set_write_timeout(Some(timeout));
    if let Err(e) = s.write_all(&reply.encode()) {
        tracing::warn!(error = %e, "could not send handshake reply");
    }
}

/// Checks a hello against this job; `Err((field, message))` is sent back as a refusal.
fn check_hello(
    h: &Hello,
    purpose: Purpose,
    cfg: &TcpConfig,
    n: usize,
) -> Result<(), (Field, String)> {
    if h.purpose != purpose {
        return Err((
            Field::Other,
            format!("expected a {:?} hello, got {:?}", purpose, h.purpose),
        ));
    }
    if !same_token(&h.token, cfg.token.as_bytes()) {
        return Err((
            Field::Token,
            "job token differs (is this rank from another job or launch?)".into(),
        ));
    }
    if h.world_size as usize != n {
        return Err((
            Field::WorldSize,
            format!(
                "world size differs: this job has {n}, rank {} sent {}",
                h.rank, h.world_size
            ),
        ));
    }
    Ok(())
}

/// Rank 0: collect n-1 registrations and send everyone the ring address table.
pub(crate) fn serve(
    listener: &TcpListener,
    n: usize,
    cfg: &TcpConfig,
    own_ring: (Option<String>, u16),
) -> Result<Vec<(String, u16)>, CommError> {
    let deadline = Instant::now() + cfg.rendezvous_timeout;
    let mut acc = Acceptor::new(listener, cfg.hello_timeout)?;
    let mut slots: Vec<Option<(TcpStream, SocketAddr, String, u16)>> =
        (0..n).map(|_| None).collect();
    let mut registered = 1;
    let mut refusals: Vec<String> = Vec::new();
    let io_timeout = cfg.hello_timeout;
    while registered < n {
        let Some(inc) = acc.next(deadline) else {
            let missing: Vec<usize> = (1..n).filter(|&r| slots[r].is_none()).collect();
            let mut msg = format!(
                "rank 0 waited {:?} at {:?}: {registered} of {n} ranks registered, missing rank(s) {missing:?}",
                cfg.rendezvous_timeout,
                listener.local_addr().ok()
            );
            if !refusals.is_empty() {
                msg.push_str(&format!("; refused: {}", refusals.join("; ")));
            }
            return Err(CommError::Rendezvous(msg));
        };
        match inc {
            Incoming::Garbage(why, peer) => {
                tracing::warn!(%peer, %why, "dropped a connection to the rendezvous port");
            }
            Incoming::WrongVersion(v, mut s, peer) => {
                let message = format!(
                    "protocol version differs: rank 0 speaks {PROTOCOL_VERSION}, {peer} sent {v}"
                );
                tracing::warn!(%peer, "{message}");
                send_reply(
                    &mut s,
                    &Reply::Refused {
                        field: Field::Version,
                        message: message.clone(),
                    },
                    io_timeout,
                );
                refusals.push(message);
            }
            Incoming::Hello(h, mut s, peer) => {
                let r = h.rank as usize;
                let verdict = check_hello(&h, Purpose::Register, cfg, n).and_then(|_| {
                    if r == 0 || r >= n {
                        Err((
                            Field::Rank,
                            format!("rank {r} is out of range 1..{n} for registration"),
                        ))
                    } else if let Some((_, first, _, _)) = &slots[r] {
                        Err((
                            Field::Rank,
                            format!("rank {r} is already registered from {first}"),
                        ))
                    } else {
                        Ok(())
                    }
                });
                match verdict {
                    Err((field, message)) => {
                        tracing::warn!(%peer, rank = r, "refused registration: {message}");
                        send_reply(
                            &mut s,
                            &Reply::Refused {
                                field,
                                message: message.clone(),
                            },
                            io_timeout,
                        );
                        refusals.push(format!("{peer} ({}: {message})", field.name()));
                    }
                    Ok(()) => {
                        let host = if h.host.is_empty() {
                            peer.ip().to_string()
                        } else {
                            h.host.clone()
                        };
                        slots[r] = Some((s, peer, host, h.port));
                        registered += 1;
                    }
                }
            }
        }
    }
    // Rank 0's own ring address as seen by its left neighbour (rank n-1), unless configured.
    let own_host = match own_ring.0 {
        Some(h) => h,
        None => slots[n - 1]
            .as_ref()
            .and_then(|(s, _, _, _)| s.local_addr().ok())
            .map(|a| a.ip().to_string())
            .unwrap_or_else(|| "127.0.0.1".into()),
    };
    let mut table = vec![(own_host, own_ring.1)];
    table.extend(slots.iter().skip(1).map(|s| {
        s.as_ref()
            .map(|(_, _, h, p)| (h.clone(), *p))
            .unwrap_or_default()
    }));
    let reply = Reply::Accepted {
        table: table.clone(),
    };
    for (s, _, _, _) in slots.iter_mut().skip(1).flatten() {
        send_reply(s, &reply, io_timeout);
    }
    Ok(table)
}

fn connect_retry(target: &str, deadline: Instant, what: &str) -> Result<TcpStream, CommError> {
    let mut backoff = Duration::from_millis(20);
    let mut last_err = String::from("no address");
    loop {
        let addrs: Vec<SocketAddr> = match target.to_socket_addrs() {
            Ok(a) => a.collect(),
            Err(e) => {
                last_err = format!("cannot resolve {target}: {e}");
                Vec::new()
            }
        };
        for a in &addrs {
            let left = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1));
            match TcpStream::connect_timeout(a, left.min(Duration::from_secs(5))) {
                Ok(s) => return Ok(s),
                Err(e) => last_err = format!("{a}: {e}"),
            }
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(CommError::Rendezvous(format!(
                "could not connect to {what} at {target}: {last_err}"
            )));
        }
        std::thread::sleep(backoff.min(deadline - now));
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

/// Reads a reply (bounded by the table size we expect) from `peer`.
fn read_reply(
    s: &mut TcpStream,
    peer: &str,
    max_entries: usize,
    deadline: Instant,
) -> Result<Reply, CommError> {
    let timeout = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    s.set_read_timeout(Some(timeout))
        .map_err(|e| CommError::io("socket setup", e))?;
    let proto = |detail: String| CommError::Protocol {
        peer: peer.to_string(),
        detail,
    };
    let mut prefix = [0u8; PREFIX_LEN];
    s.read_exact(&mut prefix).map_err(|e| match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            CommError::Rendezvous(format!("no reply from {peer} within {timeout:?}"))
        }
        _ => proto(format!(
            "connection ended before the handshake reply ({e}); was the rendezvous already complete, \
             or was our hello not understood?"
        )),
    })?;
    let p = wire::decode_prefix(&prefix, &wire::REPLY_MAGIC, Reply::max_body(max_entries))
        .map_err(|e| proto(e.to_string()))?;
    if p.version != PROTOCOL_VERSION {
        return Err(CommError::HandshakeRefused {
            peer: peer.to_string(),
            field: Field::Version.name(),
            detail: format!(
                "{peer} speaks protocol version {}, we speak {PROTOCOL_VERSION}",
                p.version
            ),
        });
    }
    let mut body = vec![0u8; p.body_len];
    s.read_exact(&mut body)
        .map_err(|e| proto(format!("reply body incomplete: {e}")))?;
    Reply::decode_body(&body, max_entries).map_err(|e| proto(e.to_string()))
}

fn hello(
    cfg: &TcpConfig,
    purpose: Purpose,
    n: usize,
    rank: usize,
    host: String,
    port: u16,
) -> Hello {
    Hello {
        version: cfg.protocol_version,
        purpose,
        world_size: n as u32,
        rank: rank as u32,
        token: cfg.token.as_bytes().to_vec(),
        host,
        port,
    }
}

/// Ranks 1..n: register with rank 0 and receive the address table.
pub(crate) fn register(
    master: &str,
    rank: usize,
    n: usize,
    cfg: &TcpConfig,
    own_ring: (String, u16),
) -> Result<Vec<(String, u16)>, CommError> {
    let deadline = Instant::now() + cfg.rendezvous_timeout;
    let mut s = connect_retry(master, deadline, "rank 0 (MASTER_ADDR:MASTER_PORT)")?;
    let peer = format!("rank 0 ({master})");
    s.set_write_timeout(Some(cfg.hello_timeout))
        .map_err(|e| CommError::io("socket setup", e))?;
    s.write_all(&hello(cfg, Purpose::Register, n, rank, own_ring.0, own_ring.1).encode())
        .map_err(|e| CommError::Rendezvous(format!("sending registration to {peer}: {e}")))?;
    match read_reply(&mut s, &peer, n, deadline)? {
        Reply::Refused { field, message } => Err(CommError::HandshakeRefused {
            peer,
            field: field.name(),
            detail: message,
        }),
        Reply::Accepted { table } if table.len() != n => Err(CommError::Protocol {
            peer,
            detail: format!(
                "address table has {} entries for world size {n}",
                table.len()
            ),
        }),
        Reply::Accepted { table } => Ok(table),
    }
}

/// Ring setup: connect to the right neighbour, accept the left one. Returns (left, right).
pub(crate) fn connect_ring(
    listener: &TcpListener,
    rank: usize,
    n: usize,
    table: &[(String, u16)],
    cfg: &TcpConfig,
) -> Result<(TcpStream, TcpStream), CommError> {
    let deadline = Instant::now() + cfg.rendezvous_timeout;
    let right_rank = (rank + 1) % n;
    let left_rank = (rank + n - 1) % n;
    let (host, port) = &table[right_rank];
    let target = if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    let right_name = format!("rank {right_rank} ({target})");
    let mut right = connect_retry(
        &target,
        deadline,
        &format!("ring neighbour rank {right_rank}"),
    )?;
    right
        .set_write_timeout(Some(cfg.hello_timeout))
        .map_err(|e| CommError::io("socket setup", e))?;
    right
        .write_all(&hello(cfg, Purpose::Ring, n, rank, String::new(), 0).encode())
        .map_err(|e| CommError::PeerLost {
            rank: right_rank,
            addr: target.clone(),
            during: "ring setup".into(),
            detail: e.to_string(),
        })?;

    let mut acc = Acceptor::new(listener, cfg.hello_timeout)?;
    let left = loop {
        let Some(inc) = acc.next(deadline) else {
            return Err(CommError::Rendezvous(format!(
                "rank {rank}: left neighbour rank {left_rank} did not connect within {:?}",
                cfg.rendezvous_timeout
            )));
        };
        match inc {
            Incoming::Garbage(why, peer) => {
                tracing::warn!(%peer, %why, "dropped a connection to the ring port")
            }
            Incoming::WrongVersion(v, mut s, peer) => {
                let message = format!(
                    "protocol version differs: rank {rank} speaks {PROTOCOL_VERSION}, {peer} sent {v}"
                );
                send_reply(
                    &mut s,
                    &Reply::Refused {
                        field: Field::Version,
                        message,
                    },
                    cfg.hello_timeout,
                );
            }
            Incoming::Hello(h, mut s, peer) => {
                let verdict = check_hello(&h, Purpose::Ring, cfg, n).and_then(|_| {
                    if h.rank as usize != left_rank {
                        Err((Field::Rank, format!("rank {rank} expects its left neighbour rank {left_rank}, got rank {}", h.rank)))
                    } else {
                        Ok(())
                    }
                });
                match verdict {
                    Err((field, message)) => {
                        tracing::warn!(%peer, "refused ring connection: {message}");
                        send_reply(
                            &mut s,
                            &Reply::Refused { field, message },
                            cfg.hello_timeout,
                        );
                    }
                    Ok(()) => {
                        send_reply(
                            &mut s,
                            &Reply::Accepted { table: Vec::new() },
                            cfg.hello_timeout,
                        );
                        break s;
                    }
                }
            }
        }
    };
    match read_reply(&mut right, &right_name, 0, deadline)? {
        Reply::Accepted { .. } => Ok((left, right)),
        Reply::Refused { field, message } => Err(CommError::HandshakeRefused {
            peer: right_name,
            field: field.name(),
            detail: message,
        }),
    }
}

/// The host others should use for our ring listener: configured, else the bind address unless
/// it is unspecified (then the address rank 0 sees us connect from).
pub(crate) fn advertised_host(cfg: &TcpConfig) -> Option<String> {
    if let Some(h) = &cfg.advertise_host {
        return Some(h.clone());
    }
    match cfg.bind_ip {
        IpAddr::V4(a) if a.is_unspecified() => None,
        IpAddr::V6(a) if a.is_unspecified() => None,
        ip => Some(ip.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_comparison() {
        assert!(same_token(b"abc", b"abc"));
        assert!(!same_token(b"abc", b"abd"));
        assert!(!same_token(b"abc", b"abcd"));
        assert!(same_token(b"", b""));
    }
}
