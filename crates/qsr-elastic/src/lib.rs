//! The control plane of qsr's elastic jobs: the [`Store`], a server that outlives any worker and
//! settles each generation's membership (`qsr rendezvous`, or a thread of `qsr train --nproc N
//! --elastic`).
//!
//! The workers' side, [`qsr_comm::Elastic`], stays beside the collectives it forms each generation
//! over; the two speak [`qsr_comm::store_protocol`]. A store for 2 workers and one worker of it:
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
//! The protocol and its invariants are on [`qsr_comm::Elastic`] and in docs/architecture/elastic.md.

#![forbid(unsafe_code)]

mod store;

pub use store::{Store, StoreConfig};
