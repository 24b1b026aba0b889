//! Bootstrapping a device collective (NCCL) over a host collective ([`share_unique_id`]), and loading
//! the shared library it needs with an error a person can act on ([`probe_library`]).

use crate::{Collective, CommError};

/// Status byte in front of the payload: rank 0 says whether it could create the id, so a failure
/// on rank 0 (no libnccl there) reaches every rank as an error instead of leaving them waiting.
const ID_OK: u8 = 1;
const ID_FAILED: u8 = 0;

/// Shares a fixed-size id created by rank 0 with every rank of `bootstrap`.
///
/// This is how a device collective is bootstrapped over a host one: NCCL ranks find each other
/// through a 128-byte unique id that rank 0 creates and every other rank must receive out of band.
/// We send it over whichever host [`Collective`] the launch produced (our TCP rendezvous under
/// `--nproc`, torchrun, mpirun or srun), so NCCL needs no launcher of its own. This logic is plain
/// bytes and is tested without a GPU.
///
/// `create` runs on rank 0 only. Every rank returns the same bytes, or every rank returns an
/// error: rank 0's own creation error, or on the others a [`CommError::Protocol`] naming rank 0
/// when its payload is malformed (wrong length or status).
pub fn share_unique_id<const N: usize>(
    bootstrap: &mut dyn Collective,
    create: impl FnOnce() -> Result<[u8; N], String>,
) -> Result<[u8; N], CommError> {
    let mut payload = Vec::new();
    let mut own_failure = None;
    if bootstrap.rank() == 0 {
        match create() {
            Ok(id) => {
                payload.push(ID_OK);
                payload.extend_from_slice(&id);
            }
            Err(e) => {
                payload.push(ID_FAILED);
                payload.extend_from_slice(e.as_bytes());
                own_failure = Some(e);
            }
        }
    }
    bootstrap.broadcast_bytes(&mut payload, 0)?;
    if let Some(e) = own_failure {
        return Err(CommError::Device(format!("rank 0 could not create the unique id: {e}")));
    }
    match payload.split_first() {
        Some((&ID_OK, id)) if id.len() == N => {
            let mut out = [0u8; N];
            out.copy_from_slice(id);
            Ok(out)
        }
        Some((&ID_FAILED, reason)) => Err(CommError::Device(format!(
            "rank 0 could not create the unique id: {}",
            String::from_utf8_lossy(reason)
        ))),
        Some((&ID_OK, id)) => Err(CommError::Protocol {
            peer: "rank 0".into(),
            detail: format!("unique id has {} bytes, expected {N}", id.len()),
        }),
        Some((status, _)) => Err(CommError::Protocol {
            peer: "rank 0".into(),
            detail: format!("unique id payload has unknown status byte {status}"),
        }),
        None => Err(CommError::Protocol { peer: "rank 0".into(), detail: "empty unique id payload".into() }),
    }
}

/// Checks that one of `candidates` (file names or paths of the shared library `name`) can be
/// loaded, and keeps it loaded for the life of the process when `keep` is set.
///
/// Why: cudarc loads libcuda / libnccl lazily and panics when they are missing; probing first turns
/// that into an error naming the library, every file tried and the fix.
pub fn probe_library(name: &str, candidates: &[String]) -> Result<(), CommError> {
    let mut last = String::new();
    let mut tried: Vec<&str> = Vec::new();
    for c in candidates {
        if tried.contains(&c.as_str()) {
            continue;
        }
        tried.push(c);
        // SAFETY: loading a system library runs its initialisers; the CUDA and NCCL libraries are
        // made to be loaded this way (it is what cudarc does next).
        match unsafe { libloading::Library::new(c) } {
            Ok(lib) => {
                // Leave it loaded: cudarc's own load of the same file is then a refcount bump.
                std::mem::forget(lib);
                return Ok(());
            }
            Err(e) => last = format!("{e:?}"),
        }
    }
    Err(CommError::LibraryMissing { library: name.to_string(), searched: tried.join(", "), last_error: last })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::InProcessGroup;

    fn run<const N: usize>(
        k: usize,
        f: impl Fn() -> Result<[u8; N], String> + Send + Sync + 'static + Clone,
    ) -> Vec<Result<[u8; N], String>> {
        let handles: Vec<_> = InProcessGroup::new(k)
            .into_iter()
            .map(|mut c| {
                let f = f.clone();
                std::thread::spawn(move || share_unique_id(&mut c, f).map_err(|e| e.to_string()))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn every_rank_gets_rank_zeros_id() {
        let id: [u8; 128] = std::array::from_fn(|i| (i * 7 + 3) as u8);
        let got = run(4, move || Ok(id));
        assert!(got.iter().all(|r| r.as_ref() == Ok(&id)), "{got:?}");
    }

    #[test]
    fn rank_zeros_failure_reaches_every_rank() {
        let got = run::<128>(3, || Err("libnccl.so.2: cannot open shared object file".into()));
        for r in got {
            let e = r.unwrap_err();
            assert!(e.contains("rank 0 could not create the unique id") && e.contains("libnccl.so.2"), "{e}");
        }
    }

    #[test]
    fn a_missing_library_names_itself_and_every_file_tried() {
        let candidates = vec!["libqsr-no-such-lib.so.9".to_string(), "/nonexistent/libqsr-no-such-lib.so".to_string()];
        let e = probe_library("qsr-no-such-lib", &candidates).unwrap_err().to_string();
        assert!(e.contains("qsr-no-such-lib") && e.contains("/nonexistent/libqsr-no-such-lib.so"), "{e}");
        assert!(e.contains("LD_LIBRARY_PATH"), "{e}");
    }

    #[test]
    fn a_present_library_loads() {
        // libc is on every Linux machine CI runs on.
        probe_library("c", &["libc.so.6".to_string()]).unwrap();
    }
}
