//! Byte layouts of every message the TCP backend exchanges, with encoders and decoders.
//!
//! Decoders are pure functions over byte slices: they never panic, never allocate more than the
//! bound the caller states, and report what was wrong. They are fuzzed by a proptest
//! (`tests/it/wire_fuzz.rs`). All integers are little-endian; `f32` payloads are sent as their
//! little-endian bytes.
//!
//! # Handshake (rendezvous and ring connect)
//!
//! ```text
//! Hello  = "QSRHELLO" version:u32 body_len:u32 body            (client -> server)
//!   body = purpose:u8 (1 register at rank 0, 2 ring neighbour)
//!          world_size:u32 rank:u32
//!          token_len:u16 token[token_len]                       (<= 1024 bytes)
//!          host_len:u16  host[host_len]                         (<= 255 bytes, may be empty)
//!          port:u16                                             (the sender's ring listener)
//! Reply  = "QSRREPLY" version:u32 body_len:u32 body            (server -> client)
//!   body = 0:u8 n:u32 n * (host_len:u16 host port:u16)         (accepted; the address table)
//!        | 1:u8 field:u8 msg_len:u16 msg[msg_len]              (refused; which field differs)
//! ```
//! The version sits right after the magic, so a peer speaking another version is refused with a
//! message naming the version before anything else is parsed.
//!
//! # Collective stream (forward direction of each ring connection, rank r -> rank r+1)
//!
//! ```text
//! CallHeader = "QSRH" kind:u8 op:u8 chunk:u16 root:u32 seq:u64 len:u64 sender:u32
//!              tagged:u32 (0 or 1) steps:u64 h:u64 fragment:u32                     (56 bytes)
//! Frame      = tag:u32 a:u32 b:u64                                                 (16 bytes)
//!   "QSRD" data:      a = payload bytes, b = block index; payload follows
//!   "QSRK" keepalive: a = 0, b = 0 (sent while waiting, so a live-but-idle peer is not blamed)
//!   "QSRA" abort:     a = culprit rank, b = reason code
//! ```
//! Each call starts with a header; the receiver compares the sync tag (`tagged`, `steps`, `h`,
//! `fragment`: [`crate::SyncTag`]), kind, op, root, seq, len and the block
//! size (`chunk`, in 4 KiB units; both sides split the buffer with it) with its own call and
//! refuses any difference. A data frame's length must equal the block length both sides
//! derive from the header, so a corrupt length is an error, never an allocation.
//!
//! # Reverse direction (rank r+1 -> rank r on the same connection)
//!
//! ```text
//! Back = "QSRB" type:u32 (1 heartbeat, 2 abort) culprit:u32 reason:u32            (16 bytes)
//! ```
//! Heartbeats tell a sender that its receiver is alive while the sender waits; aborts carry a
//! failure backwards around the ring so every rank can name the lost peer.

use std::fmt;

use crate::SyncTag;

/// Bumped whenever any layout in this module changes.
pub(crate) const PROTOCOL_VERSION: u32 = 3;

/// First 8 bytes of every hello.
pub(crate) const HELLO_MAGIC: [u8; 8] = *b"QSRHELLO";
/// First 8 bytes of every reply.
pub(crate) const REPLY_MAGIC: [u8; 8] = *b"QSRREPLY";
/// magic + version + body_len.
pub(crate) const PREFIX_LEN: usize = 16;
/// Longest job token a hello may carry, in bytes.
pub(crate) const MAX_TOKEN_LEN: usize = 1024;
/// Longest host name a hello or an address table entry may carry, in bytes.
pub const MAX_HOST_LEN: usize = 255;
/// Longest refusal message a reply carries, in bytes (longer messages are cut at a character boundary).
pub(crate) const MAX_MESSAGE_LEN: usize = 1024;
/// Largest hello body: purpose, world, rank, token, host, port.
pub(crate) const MAX_HELLO_BODY: usize = 1 + 4 + 4 + 2 + MAX_TOKEN_LEN + 2 + MAX_HOST_LEN + 2;
/// Largest world size the TCP backend accepts (bounds the address table a client will read).
pub(crate) const MAX_WORLD_SIZE: usize = 1 << 16;

/// First 4 bytes of every [`CallHeader`].
pub(crate) const CALL_MAGIC: [u8; 4] = *b"QSRH";
/// Encoded size of a [`CallHeader`], in bytes.
pub(crate) const CALL_HEADER_LEN: usize = 56;
/// Tag of a [`Frame::Data`].
pub(crate) const TAG_DATA: [u8; 4] = *b"QSRD";
/// Tag of a [`Frame::KeepAlive`].
pub(crate) const TAG_KEEPALIVE: [u8; 4] = *b"QSRK";
/// Tag of a [`Frame::Abort`].
pub(crate) const TAG_ABORT: [u8; 4] = *b"QSRA";
/// Encoded size of a [`Frame`] (its header; a data frame's payload follows), in bytes.
pub(crate) const FRAME_LEN: usize = 16;
/// First 4 bytes of every reverse-direction message ([`Back`]).
pub(crate) const BACK_MAGIC: [u8; 4] = *b"QSRB";
/// Encoded size of a [`Back`] message, in bytes.
pub(crate) const BACK_LEN: usize = 16;

/// What went wrong while decoding; turned into [`crate::CommError::Protocol`] with the peer's name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum WireError {
    /// The bytes do not start with the expected magic (the peer is not a qsr rank, or the stream is out of
    /// step).
    BadMagic {
        /// The message being decoded, e.g. `hello` or `call header`.
        what: &'static str,
    },
    /// The input ended before the message did.
    Truncated {
        /// The message being decoded.
        what: &'static str,
    },
    /// A length field exceeds its bound.
    TooLong {
        /// The field or message, e.g. `job token` or `address table`.
        what: &'static str,
        /// The length the peer announced.
        len: usize,
        /// The largest accepted length.
        max: usize,
    },
    /// A field holds a value outside its range (an unknown kind, op, purpose, status or type).
    BadValue {
        /// The field, e.g. `call kind` or `reduce op`.
        what: &'static str,
        /// The value received.
        value: u64,
    },
    /// A string field is not valid UTF-8.
    NotUtf8 {
        /// The field, e.g. `host`.
        what: &'static str,
    },
    /// Bytes remain after a complete message.
    TrailingBytes {
        /// The message being decoded.
        what: &'static str,
        /// How many bytes remain.
        extra: usize,
    },
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::BadMagic { what } => write!(f, "bad magic in {what} (not a qsr peer?)"),
            WireError::Truncated { what } => write!(f, "{what} is truncated"),
            WireError::TooLong { what, len, max } => {
                write!(f, "{what} length {len} exceeds the bound {max}")
            }
            WireError::BadValue { what, value } => write!(f, "invalid {what} {value}"),
            WireError::NotUtf8 { what } => write!(f, "{what} is not UTF-8"),
            WireError::TrailingBytes { what, extra } => {
                write!(f, "{extra} unexpected bytes after {what}")
            }
        }
    }
}

impl std::error::Error for WireError {}

/// Bounds-checked little-endian reader; every accessor returns `Truncated` instead of panicking.
struct Cursor<'a> {
    buf: &'a [u8],
    what: &'static str,
}

impl<'a> Cursor<'a> {
    fn new(buf: &'a [u8], what: &'static str) -> Self {
        Cursor { buf, what }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.buf.len() < n {
            return Err(WireError::Truncated { what: self.what });
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, WireError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, WireError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, WireError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn bytes16(&mut self, what: &'static str, max: usize) -> Result<&'a [u8], WireError> {
        let len = usize::from(self.u16()?);
        if len > max {
            return Err(WireError::TooLong { what, len, max });
        }
        self.take(len)
    }
    fn string16(&mut self, what: &'static str, max: usize) -> Result<String, WireError> {
        let b = self.bytes16(what, max)?;
        std::str::from_utf8(b).map(str::to_owned).map_err(|_| WireError::NotUtf8 { what })
    }
    fn finish(self) -> Result<(), WireError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(WireError::TrailingBytes { what: self.what, extra: self.buf.len() })
        }
    }
}

fn put_bytes16(out: &mut Vec<u8>, b: &[u8]) {
    // Encoders are only fed values validated against the same bounds; truncating keeps the
    // frame well formed even if a caller ignores that.
    let len = b.len().min(usize::from(u16::MAX));
    out.extend_from_slice(&(len as u16).to_le_bytes());
    out.extend_from_slice(&b[..len]);
}

/// The fixed prefix of a hello or a reply: magic, protocol version, body length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Prefix {
    /// The sender's protocol version (compare with [`PROTOCOL_VERSION`]).
    pub version: u32,
    /// Length of the body that follows the prefix, in bytes, already checked against the caller's bound.
    pub body_len: usize,
}

/// Decodes a 16-byte prefix, checking the magic and bounding the body length by `max_body`.
/// The version is returned, not checked: the caller refuses a different version by name.
pub(crate) fn decode_prefix(bytes: &[u8], magic: &[u8; 8], max_body: usize) -> Result<Prefix, WireError> {
    let what = if magic == &HELLO_MAGIC { "hello" } else { "reply" };
    let mut c = Cursor::new(bytes, what);
    if c.take(8)? != magic {
        return Err(WireError::BadMagic { what });
    }
    let version = c.u32()?;
    let body_len = c.u32()? as usize;
    if body_len > max_body {
        return Err(WireError::TooLong { what, len: body_len, max: max_body });
    }
    Ok(Prefix { version, body_len })
}

fn encode_with_prefix(magic: &[u8; 8], version: u32, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(PREFIX_LEN + body.len());
    out.extend_from_slice(magic);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(body);
    out
}

/// Why a client connects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Purpose {
    /// Register with rank 0 at rendezvous.
    Register = 1,
    /// Open the ring connection to the right neighbour.
    Ring = 2,
}

/// The handshake a rank sends: who it is, which job, and where its ring listener is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hello {
    /// Protocol version the sender speaks ([`PROTOCOL_VERSION`]).
    pub version: u32,
    /// Registration at rank 0 or a ring connection.
    pub purpose: Purpose,
    /// World size K the sender was launched with; must equal the receiver's.
    pub world_size: u32,
    /// The sender's rank.
    pub rank: u32,
    /// The job token (`QSR_JOB_TOKEN`, at most [`MAX_TOKEN_LEN`] bytes; may be empty); must equal the
    /// receiver's.
    pub token: Vec<u8>,
    /// Host of the sender's ring listener; empty means "the address you see me connect from".
    pub host: String,
    /// Port of the sender's ring listener.
    pub port: u16,
    /// The membership generation of an elastic job (0 otherwise); must equal the receiver's, so a
    /// rank of a generation that is over cannot join the ring of the next.
    pub generation: u64,
}

impl Hello {
    /// The complete message: prefix ([`HELLO_MAGIC`], version, body length) and body.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut body = Vec::with_capacity(32 + self.token.len() + self.host.len());
        body.push(self.purpose as u8);
        body.extend_from_slice(&self.world_size.to_le_bytes());
        body.extend_from_slice(&self.rank.to_le_bytes());
        put_bytes16(&mut body, &self.token);
        put_bytes16(&mut body, self.host.as_bytes());
        body.extend_from_slice(&self.port.to_le_bytes());
        body.extend_from_slice(&self.generation.to_le_bytes());
        encode_with_prefix(&HELLO_MAGIC, self.version, &body)
    }

    /// Decodes a hello body (after [`decode_prefix`] accepted the prefix and the version).
    pub(crate) fn decode_body(version: u32, body: &[u8]) -> Result<Hello, WireError> {
        let mut c = Cursor::new(body, "hello");
        let purpose = match c.u8()? {
            1 => Purpose::Register,
            2 => Purpose::Ring,
            v => {
                return Err(WireError::BadValue { what: "hello purpose", value: u64::from(v) });
            }
        };
        let world_size = c.u32()?;
        let rank = c.u32()?;
        let token = c.bytes16("job token", MAX_TOKEN_LEN)?.to_vec();
        let host = c.string16("host", MAX_HOST_LEN)?;
        let port = c.u16()?;
        let generation = c.u64()?;
        c.finish()?;
        Ok(Hello { version, purpose, world_size, rank, token, host, port, generation })
    }

    /// Decodes a complete hello (prefix and body) from one buffer; convenience for tests/fuzzing.
    #[cfg(test)]
    pub(crate) fn decode(bytes: &[u8]) -> Result<Hello, WireError> {
        let prefix = decode_prefix(bytes, &HELLO_MAGIC, MAX_HELLO_BODY)?;
        let body = bytes.get(PREFIX_LEN..).ok_or(WireError::Truncated { what: "hello" })?;
        if body.len() < prefix.body_len {
            return Err(WireError::Truncated { what: "hello" });
        }
        if body.len() > prefix.body_len {
            return Err(WireError::TrailingBytes { what: "hello", extra: body.len() - prefix.body_len });
        }
        Hello::decode_body(prefix.version, body)
    }
}

/// Which handshake field a refusal is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Field {
    /// The job token differs.
    Token = 1,
    /// The protocol version differs.
    Version = 2,
    /// The world size differs.
    WorldSize = 3,
    /// The rank is out of range, already registered, or not the expected neighbour.
    Rank = 4,
    /// Anything else about the request (e.g. the wrong hello purpose).
    Other = 5,
    /// The membership generation of an elastic job differs.
    Generation = 6,
}

impl Field {
    /// The field's name as error messages show it: `job token`, `protocol version`, `world size`, `rank`
    /// or `request`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Field::Token => "job token",
            Field::Version => "protocol version",
            Field::WorldSize => "world size",
            Field::Rank => "rank",
            Field::Other => "request",
            Field::Generation => "generation",
        }
    }
    fn from_code(v: u8) -> Result<Field, WireError> {
        Ok(match v {
            1 => Field::Token,
            2 => Field::Version,
            3 => Field::WorldSize,
            4 => Field::Rank,
            5 => Field::Other,
            6 => Field::Generation,
            _ => {
                return Err(WireError::BadValue { what: "refusal field", value: u64::from(v) });
            }
        })
    }
}

/// The server's answer to a hello.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Reply {
    /// Accepted; for a registration, the ring listener address of every rank (index = rank).
    Accepted {
        /// `(host, port)` of every rank's ring listener, index = rank; empty for a ring connection.
        table: Vec<(String, u16)>,
    },
    /// Refused because `field` differs; `message` says how.
    Refused {
        /// The field that differs.
        field: Field,
        /// Human-readable reason, at most [`MAX_MESSAGE_LEN`] bytes.
        message: String,
    },
}

impl Reply {
    /// The complete message: prefix ([`REPLY_MAGIC`], [`PROTOCOL_VERSION`], body length) and body.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut body = Vec::new();
        match self {
            Reply::Accepted { table } => {
                body.push(0);
                body.extend_from_slice(&(table.len() as u32).to_le_bytes());
                for (host, port) in table {
                    put_bytes16(&mut body, host.as_bytes());
                    body.extend_from_slice(&port.to_le_bytes());
                }
            }
            Reply::Refused { field, message } => {
                body.push(1);
                body.push(*field as u8);
                let mut m = message.as_bytes();
                if m.len() > MAX_MESSAGE_LEN {
                    let mut end = MAX_MESSAGE_LEN;
                    while !message.is_char_boundary(end) {
                        end -= 1;
                    }
                    m = &m[..end];
                }
                put_bytes16(&mut body, m);
            }
        }
        encode_with_prefix(&REPLY_MAGIC, PROTOCOL_VERSION, &body)
    }

    /// Largest reply body a client expecting `world_size` table entries will read.
    pub(crate) fn max_body(world_size: usize) -> usize {
        (1 + 4 + world_size.min(MAX_WORLD_SIZE) * (2 + MAX_HOST_LEN + 2)).max(1 + 1 + 2 + MAX_MESSAGE_LEN)
    }

    /// Decodes a reply body; an accepted table longer than `max_entries` is an error.
    pub(crate) fn decode_body(body: &[u8], max_entries: usize) -> Result<Reply, WireError> {
        let mut c = Cursor::new(body, "reply");
        let reply = match c.u8()? {
            0 => {
                let n = c.u32()? as usize;
                if n > max_entries {
                    return Err(WireError::TooLong { what: "address table", len: n, max: max_entries });
                }
                let mut table = Vec::with_capacity(n);
                for _ in 0..n {
                    let host = c.string16("host", MAX_HOST_LEN)?;
                    let port = c.u16()?;
                    table.push((host, port));
                }
                Reply::Accepted { table }
            }
            1 => {
                let field = Field::from_code(c.u8()?)?;
                let message = c.string16("refusal message", MAX_MESSAGE_LEN)?;
                Reply::Refused { field, message }
            }
            v => {
                return Err(WireError::BadValue { what: "reply status", value: u64::from(v) });
            }
        };
        c.finish()?;
        Ok(reply)
    }

    /// Decodes a complete reply (prefix and body) from one buffer; for tests/fuzzing.
    #[cfg(test)]
    pub(crate) fn decode(bytes: &[u8], max_entries: usize) -> Result<Reply, WireError> {
        let prefix = decode_prefix(bytes, &REPLY_MAGIC, Reply::max_body(max_entries))?;
        let body = bytes.get(PREFIX_LEN..).ok_or(WireError::Truncated { what: "reply" })?;
        if body.len() != prefix.body_len {
            return Err(WireError::Truncated { what: "reply" });
        }
        Reply::decode_body(body, max_entries)
    }
}

/// First bytes of every collective call on the forward stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CallHeader {
    /// Which collective: one of the `KIND_*` constants.
    pub kind: u8,
    /// Reduction: 0 sum (also a barrier's), 1 mean, [`OP_SUM_BF16`] / [`OP_MEAN_BF16`] with a bf16
    /// payload, `OP_*_INT8` / `OP_*_FP8` with a quantized one, [`OP_NONE`] for broadcasts.
    pub op: u8,
    /// Pipelining block size in 4 KiB units (ranks must agree on it to agree on frame lengths).
    pub chunk: u16,
    /// Root rank of a broadcast (0 for calls without a root).
    pub root: u32,
    /// Sequence number of the call on this communicator; every rank's must match.
    pub seq: u64,
    /// Payload length of the call in bytes (the whole buffer, not this link's share).
    pub len: u64,
    /// Rank that sent the header (the receiver's left neighbour).
    pub sender: u32,
    /// The sync the call belongs to ([`crate::Collective::set_tag`]).
    pub tag: Option<SyncTag>,
}

/// [`CallHeader::kind`] of an all-reduce.
pub(crate) const KIND_ALL_REDUCE: u8 = 1;
/// [`CallHeader::kind`] of an `f32` broadcast.
pub(crate) const KIND_BROADCAST: u8 = 2;
/// [`CallHeader::kind`] of a barrier.
pub(crate) const KIND_BARRIER: u8 = 3;
/// [`CallHeader::kind`] of a byte broadcast's payload.
pub(crate) const KIND_BROADCAST_BYTES: u8 = 4;
/// The length announcement that precedes a `broadcast_bytes` payload.
pub(crate) const KIND_BROADCAST_LEN: u8 = 5;
/// `op` value of calls without a reduction.
pub(crate) const OP_NONE: u8 = 0xff;

/// `op` value of a sum whose payload travels as bf16.
pub(crate) const OP_SUM_BF16: u8 = 2;

/// `op` value of a mean whose payload travels as bf16.
pub(crate) const OP_MEAN_BF16: u8 = 3;

/// `op` value of a sum whose payload travels as int8 with block scales.
pub(crate) const OP_SUM_INT8: u8 = 4;

/// `op` value of a mean whose payload travels as int8 with block scales.
pub(crate) const OP_MEAN_INT8: u8 = 5;

/// `op` value of a sum whose payload travels as fp8 e4m3 with block scales.
pub(crate) const OP_SUM_FP8: u8 = 6;

/// `op` value of a mean whose payload travels as fp8 e4m3 with block scales.
pub(crate) const OP_MEAN_FP8: u8 = 7;

/// `op` value of a sum whose payload travels as int4 with block scales.
pub(crate) const OP_SUM_INT4: u8 = 8;

/// `op` value of a mean whose payload travels as int4 with block scales.
pub(crate) const OP_MEAN_INT4: u8 = 9;

/// `op` value of a sum whose payload travels as int2 with block scales.
pub(crate) const OP_SUM_INT2: u8 = 10;

/// `op` value of a mean whose payload travels as int2 with block scales.
pub(crate) const OP_MEAN_INT2: u8 = 11;

/// A reduction's name in messages, from its `op` value: `sum`, `mean (int8 payload)`, `none`.
pub(crate) fn op_label(op: u8) -> String {
    let name = if op.is_multiple_of(2) { "sum" } else { "mean" };
    let payload = match op {
        0 | 1 => "",
        OP_SUM_BF16 | OP_MEAN_BF16 => " (bf16 payload)",
        OP_SUM_INT8 | OP_MEAN_INT8 => " (int8 payload)",
        OP_SUM_FP8 | OP_MEAN_FP8 => " (fp8 payload)",
        OP_SUM_INT4 | OP_MEAN_INT4 => " (int4 payload)",
        OP_SUM_INT2 | OP_MEAN_INT2 => " (int2 payload)",
        _ => return "none".into(),
    };
    format!("{name}{payload}")
}

impl CallHeader {
    /// The 56-byte header, starting with [`CALL_MAGIC`].
    pub(crate) fn encode(&self) -> [u8; CALL_HEADER_LEN] {
        let mut out = [0u8; CALL_HEADER_LEN];
        out[0..4].copy_from_slice(&CALL_MAGIC);
        out[4] = self.kind;
        out[5] = self.op;
        out[6..8].copy_from_slice(&self.chunk.to_le_bytes());
        out[8..12].copy_from_slice(&self.root.to_le_bytes());
        out[12..20].copy_from_slice(&self.seq.to_le_bytes());
        out[20..28].copy_from_slice(&self.len.to_le_bytes());
        out[28..32].copy_from_slice(&self.sender.to_le_bytes());
        let tag = self.tag.unwrap_or_default();
        out[32..36].copy_from_slice(&u32::from(self.tag.is_some()).to_le_bytes());
        out[36..44].copy_from_slice(&tag.steps.to_le_bytes());
        out[44..52].copy_from_slice(&tag.h.to_le_bytes());
        out[52..56].copy_from_slice(&tag.fragment.to_le_bytes());
        out
    }

    /// Decodes exactly [`CALL_HEADER_LEN`] bytes, checking the magic, the kind, the op and a non-zero `chunk`.
    pub(crate) fn decode(bytes: &[u8]) -> Result<CallHeader, WireError> {
        let mut c = Cursor::new(bytes, "call header");
        if c.take(4)? != CALL_MAGIC {
            return Err(WireError::BadMagic { what: "call header" });
        }
        let kind = c.u8()?;
        if !(KIND_ALL_REDUCE..=KIND_BROADCAST_LEN).contains(&kind) {
            return Err(WireError::BadValue { what: "call kind", value: u64::from(kind) });
        }
        let op = c.u8()?;
        if op > OP_MEAN_INT2 && op != OP_NONE {
            return Err(WireError::BadValue { what: "reduce op", value: u64::from(op) });
        }
        let chunk = c.u16()?;
        if chunk == 0 {
            return Err(WireError::BadValue { what: "block size", value: 0 });
        }
        let root = c.u32()?;
        let seq = c.u64()?;
        let len = c.u64()?;
        let sender = c.u32()?;
        let tagged = c.u32()?;
        let tag = SyncTag { steps: c.u64()?, h: c.u64()?, fragment: c.u32()? };
        c.finish()?;
        let tag = match tagged {
            0 => None,
            1 => Some(tag),
            v => return Err(WireError::BadValue { what: "sync tag flag", value: u64::from(v) }),
        };
        Ok(CallHeader { kind, op, chunk, root, seq, len, sender, tag })
    }
}

/// One frame of the forward stream after the call header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Frame {
    /// A block of payload, `len` bytes, follows.
    Data {
        /// Payload bytes that follow; must equal the block length both ranks derive from the header.
        len: u32,
        /// Index of the block within the call, in sending order.
        block: u64,
    },
    /// Sent while the sender waits, so a live but idle peer is not blamed for a stall.
    KeepAlive,
    /// A failure notice travelling forwards around the ring, so every rank names the same peer.
    Abort {
        /// Rank blamed for the failure.
        culprit: u32,
        /// What happened, a [`Reason`] code ([`Reason::from_code`]).
        reason: u64,
    },
}

impl Frame {
    /// The 16-byte frame header.
    pub(crate) fn encode(&self) -> [u8; FRAME_LEN] {
        let (tag, a, b) = match *self {
            Frame::Data { len, block } => (TAG_DATA, len, block),
            Frame::KeepAlive => (TAG_KEEPALIVE, 0, 0),
            Frame::Abort { culprit, reason } => (TAG_ABORT, culprit, reason),
        };
        let mut out = [0u8; FRAME_LEN];
        out[0..4].copy_from_slice(&tag);
        out[4..8].copy_from_slice(&a.to_le_bytes());
        out[8..16].copy_from_slice(&b.to_le_bytes());
        out
    }

    /// Decodes exactly [`FRAME_LEN`] bytes; an unknown tag or a keepalive with non-zero fields is an error.
    pub(crate) fn decode(bytes: &[u8]) -> Result<Frame, WireError> {
        let mut c = Cursor::new(bytes, "frame");
        let tag = c.take(4)?;
        let a = c.u32()?;
        let b = c.u64()?;
        c.finish()?;
        if tag == TAG_DATA {
            Ok(Frame::Data { len: a, block: b })
        } else if tag == TAG_KEEPALIVE {
            if a != 0 || b != 0 {
                return Err(WireError::BadValue { what: "keepalive payload", value: u64::from(a) | b });
            }
            Ok(Frame::KeepAlive)
        } else if tag == TAG_ABORT {
            Ok(Frame::Abort { culprit: a, reason: b })
        } else {
            Err(WireError::BadMagic { what: "frame" })
        }
    }
}

/// A message on the reverse direction of a ring connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Back {
    /// The receiver is alive (sent while the sender waits on it).
    Heartbeat,
    /// A failure notice travelling backwards around the ring, so every rank names the same peer.
    Abort {
        /// Rank blamed for the failure.
        culprit: u32,
        /// What happened, a [`Reason`] code ([`Reason::from_code`]).
        reason: u32,
    },
}

impl Back {
    /// The 16-byte message, starting with [`BACK_MAGIC`].
    pub(crate) fn encode(&self) -> [u8; BACK_LEN] {
        let (ty, culprit, reason) = match *self {
            Back::Heartbeat => (1u32, 0u32, 0u32),
            Back::Abort { culprit, reason } => (2, culprit, reason),
        };
        let mut out = [0u8; BACK_LEN];
        out[0..4].copy_from_slice(&BACK_MAGIC);
        out[4..8].copy_from_slice(&ty.to_le_bytes());
        out[8..12].copy_from_slice(&culprit.to_le_bytes());
        out[12..16].copy_from_slice(&reason.to_le_bytes());
        out
    }

    /// Decodes exactly [`BACK_LEN`] bytes; an unknown type is an error.
    pub(crate) fn decode(bytes: &[u8]) -> Result<Back, WireError> {
        let mut c = Cursor::new(bytes, "reverse message");
        if c.take(4)? != BACK_MAGIC {
            return Err(WireError::BadMagic { what: "reverse message" });
        }
        let ty = c.u32()?;
        let culprit = c.u32()?;
        let reason = c.u32()?;
        c.finish()?;
        match ty {
            1 => Ok(Back::Heartbeat),
            2 => Ok(Back::Abort { culprit, reason }),
            v => Err(WireError::BadValue { what: "reverse message type", value: u64::from(v) }),
        }
    }
}

/// Why a rank aborted, carried in abort frames so every rank can say what happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reason {
    /// The culprit's connection closed or failed.
    Lost = 1,
    /// The culprit made no progress within the timeout.
    Timeout = 2,
    /// The culprit sent bytes that break the protocol.
    Protocol = 3,
    /// The culprit made a different collective call.
    CallsDiffer = 4,
    /// Any other failure, e.g. a local error of the reporting rank; also any unknown code.
    Other = 5,
}

impl Reason {
    /// The reason of a wire code (1 to 4; anything else is [`Reason::Other`]).
    pub(crate) fn from_code(v: u64) -> Reason {
        match v {
            1 => Reason::Lost,
            2 => Reason::Timeout,
            3 => Reason::Protocol,
            4 => Reason::CallsDiffer,
            _ => Reason::Other,
        }
    }
    /// Short description for error messages, e.g. `connection lost`.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            Reason::Lost => "connection lost",
            Reason::Timeout => "no progress within the timeout",
            Reason::Protocol => "protocol error",
            Reason::CallsDiffer => "different collective calls",
            Reason::Other => "local error",
        }
    }
}

/// Refuses a host name or address others could not use: empty, longer than a DNS name may be, or
/// with characters no host name or address has.
pub(crate) fn check_host(host: &str) -> Result<(), String> {
    if host.is_empty() || host.len() > MAX_HOST_LEN {
        return Err(format!("has {} bytes: a host name or address has 1 to {}", host.len(), MAX_HOST_LEN));
    }
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | ':' | '[' | ']' | '%');
    if let Some(c) = host.chars().find(|c| !allowed(*c)) {
        return Err(format!("`{host}` has the character {c:?}, which no host name or address has"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello() -> Hello {
        Hello {
            version: PROTOCOL_VERSION,
            purpose: Purpose::Register,
            world_size: 5,
            rank: 3,
            token: b"secret".to_vec(),
            host: "10.1.2.3".into(),
            port: 40123,
            generation: 7,
        }
    }

    #[test]
    fn hello_roundtrip_and_prefix() {
        let h = hello();
        let bytes = h.encode();
        assert_eq!(Hello::decode(&bytes), Ok(h.clone()));
        let p = decode_prefix(&bytes[..PREFIX_LEN], &HELLO_MAGIC, MAX_HELLO_BODY).unwrap();
        assert_eq!(p.version, PROTOCOL_VERSION);
        assert_eq!(p.body_len, bytes.len() - PREFIX_LEN);
        // a reply magic is not a hello
        assert_eq!(decode_prefix(&bytes, &REPLY_MAGIC, 100), Err(WireError::BadMagic { what: "reply" }));
    }

    #[test]
    fn hello_rejects_oversized_token_and_bad_lengths() {
        let mut bytes = hello().encode();
        // token length field sits after purpose(1) world(4) rank(4) in the body
        let at = PREFIX_LEN + 9;
        bytes[at..at + 2].copy_from_slice(&2000u16.to_le_bytes());
        assert_eq!(Hello::decode(&bytes), Err(WireError::TooLong { what: "job token", len: 2000, max: MAX_TOKEN_LEN }));
        let mut bytes = hello().encode();
        bytes[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(Hello::decode(&bytes), Err(WireError::TooLong { what: "hello", .. })));
        let bytes = hello().encode();
        assert_eq!(Hello::decode(&bytes[..bytes.len() - 1]), Err(WireError::Truncated { what: "hello" }));
    }

    #[test]
    fn reply_roundtrip_and_bounds() {
        let ok = Reply::Accepted { table: vec![("127.0.0.1".into(), 1), ("host-b".into(), 65535)] };
        assert_eq!(Reply::decode(&ok.encode(), 2), Ok(ok.clone()));
        assert!(matches!(Reply::decode(&ok.encode(), 1), Err(WireError::TooLong { what: "address table", .. })));
        let no = Reply::Refused { field: Field::Token, message: "job token differs".into() };
        assert_eq!(Reply::decode(&no.encode(), 0), Ok(no));
        let long = Reply::Refused { field: Field::Other, message: "é".repeat(1000) };
        match Reply::decode(&long.encode(), 0) {
            Ok(Reply::Refused { message, .. }) => assert!(message.len() <= MAX_MESSAGE_LEN),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn call_header_roundtrip_and_validation() {
        let tag = Some(SyncTag { steps: 12, h: 6, fragment: 2 });
        let h = CallHeader { kind: KIND_ALL_REDUCE, op: 1, chunk: 128, root: 0, seq: 77, len: 4096, sender: 2, tag };
        assert_eq!(CallHeader::decode(&h.encode()), Ok(h));
        let untagged = CallHeader { tag: None, ..h };
        assert_eq!(CallHeader::decode(&untagged.encode()), Ok(untagged));
        let mut b = h.encode();
        b[32] = 2;
        assert_eq!(CallHeader::decode(&b), Err(WireError::BadValue { what: "sync tag flag", value: 2 }));
        let mut b = h.encode();
        b[4] = 9;
        assert_eq!(CallHeader::decode(&b), Err(WireError::BadValue { what: "call kind", value: 9 }));
        let mut b = h.encode();
        b[0] = b'X';
        assert_eq!(CallHeader::decode(&b), Err(WireError::BadMagic { what: "call header" }));
        assert_eq!(CallHeader::decode(&h.encode()[..55]), Err(WireError::Truncated { what: "call header" }));
    }

    #[test]
    fn frames_and_back_roundtrip() {
        for f in [Frame::Data { len: 7, block: 3 }, Frame::KeepAlive, Frame::Abort { culprit: 4, reason: 2 }] {
            assert_eq!(Frame::decode(&f.encode()), Ok(f));
        }
        for m in [Back::Heartbeat, Back::Abort { culprit: 1, reason: 1 }] {
            assert_eq!(Back::decode(&m.encode()), Ok(m));
        }
        assert_eq!(Frame::decode(&[0u8; 16]), Err(WireError::BadMagic { what: "frame" }));
        assert_eq!(Reason::from_code(99), Reason::Other);
    }
}

// Property tests of the decoders (`fuzz.rs`).
#[cfg(test)]
mod fuzz;
