//! `qsr rendezvous`: the store of an elastic job, served until the job finishes.

use std::io::Write;
use std::net::ToSocketAddrs;
use std::time::Duration;

use anyhow::{Result, anyhow};
use qsr_comm::{CommError, TcpConfig};
use qsr_elastic::{ElasticError, Store, StoreConfig};

use crate::exit::bad_input;

/// Arguments of `qsr rendezvous`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct RendezvousArgs {
    /// Address to listen on (`host:port`; port 0 picks one, printed on the first line).
    #[arg(long, default_value = "127.0.0.1:29400")]
    pub listen: String,
    /// Workers of the first generation, and the most any generation admits.
    #[arg(long)]
    pub workers: usize,
    /// The fewest workers a later generation forms with.
    #[arg(long, default_value_t = 1)]
    pub min_workers: usize,
    /// Seconds to wait, once a worker reported a failure, for the others to report before expelling
    /// them (at least the workers' QSR_COMM_TIMEOUT_SECS).
    #[arg(long, default_value_t = 30.0)]
    pub settle_secs: f64,
}

/// Runs `qsr rendezvous`: serves the elastic job's store until every worker of its last generation
/// finished, or until `QSR_RENDEZVOUS_TIMEOUT_SECS` passed without a first generation. The job token
/// is `QSR_JOB_TOKEN`, as for the workers.
pub(crate) fn rendezvous(args: &RendezvousArgs, out: &mut dyn Write) -> Result<()> {
    let secs = args.settle_secs;
    if !(secs.is_finite() && secs > 0.0 && secs <= qsr_comm::MAX_TIMEOUT_SECS) {
        let max = qsr_comm::MAX_TIMEOUT_SECS;
        return Err(bad_input(anyhow!("--settle-secs {secs:e}: expected a number of seconds in (0, {max}] (a week)")));
    }
    let settle = Duration::from_secs_f64(secs);
    let first_within = TcpConfig::from_env(&|k| std::env::var(k).ok()).map_err(bad_input)?.rendezvous_timeout;
    let cfg = StoreConfig {
        workers: args.workers,
        min_workers: args.min_workers,
        settle,
        token: std::env::var("QSR_JOB_TOKEN").unwrap_or_default(),
        ..StoreConfig::new(args.workers)
    };
    if let Err(e) = args.listen.to_socket_addrs() {
        return Err(bad_input(anyhow!("--listen {}: not an address to listen on ({e})", args.listen)));
    }
    let open = cfg.token.is_empty();
    let store = match Store::bind(&args.listen, cfg) {
        Ok(s) => s,
        Err(e @ CommError::InvalidArgument(_)) => return Err(bad_input(e)),
        Err(e) => return Err(anyhow::Error::from(e).context("--listen")),
    };
    if open && !store.local_addr().ip().is_loopback() {
        eprintln!(
            "qsr: warning: QSR_JOB_TOKEN is not set, so any process that reaches {} can join this job; give the store and its workers the same token",
            store.local_addr()
        );
    }
    writeln!(out, "listening on {} for {} workers", store.local_addr(), args.workers)?;
    out.flush()?;
    // Never silent while it waits for workers: a line after the settle time (at most 10 s), then every 10 s.
    let start = std::time::Instant::now();
    let mut next_line = start + Duration::from_secs(10).min(settle);
    while !store.wait_finished(Some(Duration::from_secs(1))) {
        let addr = || store.local_addr().to_string();
        if let Some(why) = store.orphaned() {
            return Err(ElasticError::Store { addr: addr(), detail: format!("the job ended unfinished: {why}") }.into());
        }
        if store.generation().is_none() && start.elapsed() >= first_within {
            let what = store.waiting_for().unwrap_or_default();
            let detail = format!(
                "the first generation did not form within the rendezvous timeout of {first_within:?} (QSR_RENDEZVOUS_TIMEOUT_SECS): {what}"
            );
            return Err(ElasticError::Store { addr: addr(), detail }.into());
        }
        if std::time::Instant::now() >= next_line
            && let Some(what) = store.waiting_for()
        {
            eprintln!("qsr rendezvous: waiting ({} s since start): {what}", start.elapsed().as_secs());
            next_line = std::time::Instant::now() + Duration::from_secs(10);
        }
    }
    writeln!(out, "job finished: generation {}", store.generation().unwrap_or(0))?;
    Ok(())
}
