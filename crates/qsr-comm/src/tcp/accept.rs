//! Reading the hellos of new connections, without a thread per connection.
//!
//! One `poll(2)` loop on the caller's thread serves the listener and every connection whose hello
//! is still incomplete. Each connection has `hello_timeout` from its accept to send a complete
//! hello; at most [`MAX_PENDING`] wait at once, and one more evicts the oldest. Idle connections
//! (a port scanner, a stray client, a flood) therefore cannot keep a real rank out: a real rank
//! sends its hello as soon as it connects, and it is read before later connections can evict it.

use std::collections::VecDeque;
use std::io::{ErrorKind, Read};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crate::CommError;
use crate::wire::{self, Hello, PREFIX_LEN, PROTOCOL_VERSION};

/// Connections whose hello is being read at once; one more evicts the oldest.
const MAX_PENDING: usize = 256;
/// Connections accepted per pass, so the hellos of earlier ones are read before later ones can
/// evict them.
const ACCEPT_BATCH: usize = 32;

/// What a new connection turned out to be.
pub(crate) enum Incoming {
    Hello(Hello, TcpStream, SocketAddr),
    WrongVersion(u32, TcpStream, SocketAddr),
    Garbage(String, SocketAddr),
}

/// A connection whose hello is incomplete (non-blocking until it is handed over).
struct Pending {
    s: TcpStream,
    peer: SocketAddr,
    expires: Instant,
    prefix: [u8; PREFIX_LEN],
    /// Sized once the prefix announced the body length.
    body: Vec<u8>,
    /// Bytes read so far, prefix and body together.
    got: usize,
    version: u32,
}

enum Advance {
    More(Pending),
    Done(Incoming),
}

impl Pending {
    fn garbage(self, why: String) -> Advance {
        Advance::Done(Incoming::Garbage(why, self.peer))
    }

    /// The stream back in blocking mode, as the handshake replies expect it.
    fn hand_over(self, make: impl FnOnce(TcpStream, SocketAddr) -> Incoming) -> Advance {
        match self.s.set_nonblocking(false) {
            Ok(()) => Advance::Done(make(self.s, self.peer)),
            Err(e) => self.garbage(format!("socket setup failed: {e}")),
        }
    }

    /// Reads what has arrived; `Done` once the hello is complete or clearly not one.
    fn advance(mut self) -> Advance {
        loop {
            let in_prefix = self.got < PREFIX_LEN;
            let res = if in_prefix {
                (&self.s).read(&mut self.prefix[self.got..])
            } else {
                (&self.s).read(&mut self.body[self.got - PREFIX_LEN..])
            };
            match res {
                Ok(0) => return self.garbage("closed before a complete hello".into()),
                Ok(k) => self.got += k,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Advance::More(self),
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return self.garbage(format!("reading the hello: {e}")),
            }
            if in_prefix && self.got == PREFIX_LEN {
                let max = wire::MAX_HELLO_BODY;
                let p = match wire::decode_prefix(&self.prefix, &wire::HELLO_MAGIC, max) {
                    Ok(p) => p,
                    Err(e) => return self.garbage(e.to_string()),
                };
                if p.version != PROTOCOL_VERSION {
                    return self.hand_over(|s, peer| Incoming::WrongVersion(p.version, s, peer));
                }
                self.version = p.version;
                self.body = vec![0; p.body_len];
            }
            if self.got >= PREFIX_LEN && self.got == PREFIX_LEN + self.body.len() {
                return match Hello::decode_body(self.version, &self.body) {
                    Ok(h) => self.hand_over(|s, peer| Incoming::Hello(h, s, peer)),
                    Err(e) => self.garbage(e.to_string()),
                };
            }
        }
    }
}

/// Accepts connections on a listener and reads their hellos.
pub(crate) struct Acceptor<'a> {
    listener: &'a TcpListener,
    /// Oldest first (all share one timeout, so this is also expiry order).
    pending: VecDeque<Pending>,
    ready: VecDeque<Incoming>,
    hello_timeout: Duration,
    /// After an accept error with nothing to evict (EMFILE), the listener rests until then.
    accept_paused_until: Option<Instant>,
}

impl<'a> Acceptor<'a> {
    pub(crate) fn new(listener: &'a TcpListener, hello_timeout: Duration) -> Result<Self, CommError> {
        listener.set_nonblocking(true).map_err(|e| CommError::io("listener setup", e))?;
        Ok(Acceptor {
            listener,
            pending: VecDeque::new(),
            ready: VecDeque::new(),
            hello_timeout,
            accept_paused_until: None,
        })
    }

    /// The next connection's hello, or `None` once `deadline` passed.
    pub(crate) fn next(&mut self, deadline: Instant) -> Option<Incoming> {
        loop {
            if let Some(inc) = self.ready.pop_front() {
                return Some(inc);
            }
            let now = Instant::now();
            self.expire(now);
            if !self.ready.is_empty() {
                continue;
            }
            if now >= deadline {
                return None;
            }
            self.poll_once(now, deadline);
        }
    }

    fn expire(&mut self, now: Instant) {
        while self.pending.front().is_some_and(|p| p.expires <= now) {
            if let Some(p) = self.pending.pop_front() {
                let why = format!("no complete hello within {:?}", self.hello_timeout);
                self.ready.push_back(Incoming::Garbage(why, p.peer));
            }
        }
    }

    /// One `poll` over the listener and the pending connections, then whatever it found.
    fn poll_once(&mut self, now: Instant, deadline: Instant) {
        let mut until = deadline;
        if let Some(p) = self.pending.front() {
            until = until.min(p.expires);
        }
        let listen = match self.accept_paused_until {
            Some(t) if t > now => {
                until = until.min(t);
                false
            }
            _ => true,
        };
        let pollfd = |fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        let mut fds = Vec::with_capacity(1 + self.pending.len());
        fds.push(pollfd(if listen { self.listener.as_raw_fd() } else { -1 }));
        fds.extend(self.pending.iter().map(|p| pollfd(p.s.as_raw_fd())));
        let wait = until.saturating_duration_since(now).as_micros().div_ceil(1000);
        let ms = wait.clamp(1, 1000) as i32;
        // SAFETY: `fds` is a valid array of pollfd structs for the duration of the call.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if rc <= 0 {
            // Timeout or EINTR: `next` re-checks the deadlines.
            return;
        }
        self.read_pending(&fds[1..]);
        if fds[0].revents != 0 {
            self.accept_batch();
        }
    }

    fn read_pending(&mut self, fds: &[libc::pollfd]) {
        let old = std::mem::take(&mut self.pending);
        for (p, fd) in old.into_iter().zip(fds) {
            if fd.revents == 0 {
                self.pending.push_back(p);
                continue;
            }
            match p.advance() {
                Advance::More(p) => self.pending.push_back(p),
                Advance::Done(inc) => self.ready.push_back(inc),
            }
        }
    }

    fn accept_batch(&mut self) {
        for _ in 0..ACCEPT_BATCH {
            match self.listener.accept() {
                Ok((s, peer)) => self.admit(s, peer),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    // EMFILE and friends: free the oldest slot, or rest the listener briefly.
                    tracing::warn!(error = %e, "accept failed");
                    if self.pending.pop_front().is_none() {
                        self.accept_paused_until = Some(Instant::now() + Duration::from_millis(10));
                    }
                    return;
                }
            }
        }
    }

    fn admit(&mut self, s: TcpStream, peer: SocketAddr) {
        if self.pending.len() >= MAX_PENDING
            && let Some(old) = self.pending.pop_front()
        {
            tracing::debug!(peer = %old.peer, "too many pending hellos; dropped the oldest");
        }
        if let Err(e) = s.set_nonblocking(true) {
            tracing::warn!(%peer, error = %e, "cannot set up a new connection; dropped it");
            return;
        }
        let p = Pending {
            s,
            peer,
            expires: Instant::now() + self.hello_timeout,
            prefix: [0; PREFIX_LEN],
            body: Vec::new(),
            got: 0,
            version: 0,
        };
        // A real rank's hello usually arrives with its connection: read it before accepting more.
        match p.advance() {
            Advance::More(p) => self.pending.push_back(p),
            Advance::Done(inc) => self.ready.push_back(inc),
        }
    }
}
