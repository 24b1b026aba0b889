//! Rank 0 first: [`run_workers`](crate::run_workers)' threads start once rank 0 has communicated,
//! so what rank 0 draws from a RNG the threads share (burn's, for initial weights) depends on its
//! seed alone.

use std::sync::{Arc, Condvar, Mutex, PoisonError};

use crate::collective::{Collective, CommStats, ReduceOp, SyncTag};
use crate::error::CommError;
use qsr_kernels::Codec;

/// Open once rank 0 made its first collective call or returned; the other ranks wait for it.
#[derive(Default)]
pub(crate) struct Latch {
    open: Mutex<bool>,
    opened: Condvar,
}

impl Latch {
    /// Blocks until the latch is open.
    pub(crate) fn wait(&self) {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        while !*open {
            open = self.opened.wait(open).unwrap_or_else(PoisonError::into_inner);
        }
    }

    pub(crate) fn open(&self) {
        *self.open.lock().unwrap_or_else(PoisonError::into_inner) = true;
        self.opened.notify_all();
    }
}

/// Opens the latch when dropped: rank 0 returned (or panicked) without communicating.
pub(crate) struct OpenOnDrop(pub(crate) Arc<Latch>);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.open();
    }
}

/// Rank 0's collective: opens the latch at its first call that communicates.
pub(crate) struct FirstCall<C> {
    inner: C,
    latch: Arc<Latch>,
}

impl<C> FirstCall<C> {
    pub(crate) fn new(inner: C, latch: Arc<Latch>) -> Self {
        Self { inner, latch }
    }

    fn open(&self) {
        self.latch.open();
    }
}

impl<C: Collective> Collective for FirstCall<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_reduce(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        self.open();
        self.inner.all_reduce(buf, op)
    }
    fn all_reduce_bf16(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        self.open();
        self.inner.all_reduce_bf16(buf, op)
    }
    fn supports_bf16(&self) -> bool {
        self.inner.supports_bf16()
    }
    fn all_reduce_quantized(&mut self, buf: &mut [f32], op: ReduceOp, codec: Codec) -> Result<(), CommError> {
        self.open();
        self.inner.all_reduce_quantized(buf, op, codec)
    }
    fn supports_quantized(&self) -> bool {
        self.inner.supports_quantized()
    }
    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        self.open();
        self.inner.broadcast(buf, root)
    }
    fn broadcast_bytes(&mut self, bytes: &mut Vec<u8>, root: usize) -> Result<(), CommError> {
        self.open();
        self.inner.broadcast_bytes(bytes, root)
    }
    fn barrier(&mut self) -> Result<(), CommError> {
        self.open();
        self.inner.barrier()
    }
    fn set_tag(&mut self, tag: Option<SyncTag>) {
        self.inner.set_tag(tag)
    }
    fn stats(&self) -> &CommStats {
        self.inner.stats()
    }
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
}
