//! Elastic jobs, in one crate over qsr-comm's collectives: the [`Store`], a server that outlives any
//! worker and settles each generation's membership (`qsr rendezvous`, or a thread of `qsr train
//! --nproc N --elastic`), the workers' side [`Elastic`], which joins each generation at the store and
//! forms its collective, and the line protocol the two speak (private; its shared types are
//! [`LastSync`] and [`Lost`]). A store for 2 workers:
//!
//! ```no_run
//! # fn main() -> Result<(), qsr_comm::CommError> {
//! use qsr_elastic::{Store, StoreConfig};
//!
//! let store = Store::bind("127.0.0.1:29400", StoreConfig::new(2))?;
//! println!("workers connect to {}", store.local_addr());
//! store.wait_finished(None);
//! # Ok(())
//! # }
//! ```
//!
//! The protocol and its invariants are on [`Elastic`] and in docs/architecture/elastic.md.

#![forbid(unsafe_code)]

mod client;
mod error;
mod protocol;
mod store;

pub use client::{Elastic, ElasticConfig, Membership, Pair, Poll};
pub use error::ElasticError;
pub use protocol::{LastSync, Lost, MAX_SYNC_PAYLOAD};
pub use store::{MAX_WORKERS, Store, StoreConfig};
