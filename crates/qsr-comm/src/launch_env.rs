//! Who am I in this job? Rank, world size, local rank and master address from the launcher
//! (documented on [`detect`]).

use serde::{Deserialize, Serialize};

use crate::CommError;

/// Port used when no launcher says otherwise (torchrun's default).
pub const DEFAULT_MASTER_PORT: u16 = 29500;
/// Address used when no launcher says otherwise: loopback, so nothing listens on a public interface
/// by accident.
pub const DEFAULT_MASTER_ADDR: &str = "127.0.0.1";

/// Where the launch information came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Source {
    /// The rank came from an explicit argument (`--rank`), with `--world-size` or a launcher's world size.
    Explicit,
    /// torchrun-style variables: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`.
    Torchrun,
    /// Open MPI's `mpirun`: `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK`.
    OpenMpi,
    /// A PMI launcher (MPICH, Hydra): `PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID` or `PMI_LOCAL_RANK`.
    Pmi,
    /// `srun`: `SLURM_PROCID`, `SLURM_NTASKS` (or `SLURM_NPROCS`), `SLURM_LOCALID`; the master address
    /// defaults to the node list's first host and the port to `29500 + SLURM_JOB_ID % 1000`.
    Slurm,
    /// No launcher and no explicit rank: a single process, rank 0 of 1.
    Single,
}

/// Values given on the command line or in a config; each overrides the environment.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Explicit {
    /// This process's rank (`--rank`); overrides any launcher's.
    pub rank: Option<usize>,
    /// Number of processes K (`--world-size`); overrides any launcher's.
    pub world_size: Option<usize>,
    /// Rank among the processes of this host (`--local-rank`); overrides any launcher's.
    pub local_rank: Option<usize>,
    /// Rank 0's rendezvous host (`--master-addr`); overrides `MASTER_ADDR` and the SLURM node list.
    pub master_addr: Option<String>,
    /// Rank 0's rendezvous port (`--master-port`); overrides `MASTER_PORT`.
    pub master_port: Option<u16>,
}

/// The resolved launch environment of this process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LaunchEnv {
    /// This process's rank, in `0..world_size`.
    pub rank: usize,
    /// Number of processes K, at least 1.
    pub world_size: usize,
    /// Rank among the processes on this host (selects the GPU).
    pub local_rank: usize,
    /// Host rank 0 listens on for the rendezvous (`MASTER_ADDR`; default [`DEFAULT_MASTER_ADDR`]).
    pub master_addr: String,
    /// Port rank 0 listens on for the rendezvous (`MASTER_PORT`; default [`DEFAULT_MASTER_PORT`]); never 0
    /// when `world_size > 1`.
    pub master_port: u16,
    /// Which launcher (or explicit arguments) the rank came from.
    pub source: Source,
}

fn parse_usize(var: &str, value: &str) -> Result<usize, CommError> {
    value.trim().parse::<usize>().map_err(|_| CommError::launch(var, format!("{var}={value} is not an integer")))
}

fn parse_port(var: &str, value: &str) -> Result<u16, CommError> {
    value
        .trim()
        .parse::<u16>()
        .map_err(|_| CommError::launch(var, format!("{var}={value} is not a port number (0..65535)")))
}

/// Rank, world size and local rank as found in the environment, with the variable names used.
struct Found {
    source: Source,
    rank: (String, usize),
    size: (String, usize),
    local: Option<(String, usize)>,
    master_addr: Option<String>,
    master_port: Option<(String, u16)>,
}

fn get_usize(env: &dyn Fn(&str) -> Option<String>, var: &str) -> Result<Option<(String, usize)>, CommError> {
    match env(var) {
        Some(v) => Ok(Some((var.to_string(), parse_usize(var, &v)?))),
        None => Ok(None),
    }
}

fn first_usize(env: &dyn Fn(&str) -> Option<String>, vars: &[&str]) -> Result<Option<(String, usize)>, CommError> {
    for v in vars {
        if let Some(x) = get_usize(env, v)? {
            return Ok(Some(x));
        }
    }
    Ok(None)
}

/// Requires the size variable once the rank variable of a launcher is present.
fn need(found: Option<(String, usize)>, var: &str, because: &str) -> Result<(String, usize), CommError> {
    found.ok_or_else(|| CommError::launch(var, format!("{because} is set but {var} is not")))
}

/// The half of torchrun's RANK/WORLD_SIZE pair that is missing: from an explicit flag, else an
/// error naming the variable.
fn torchrun_pair(
    flag_value: Option<usize>,
    flag: &str,
    var: &str,
    because: &str,
) -> Result<(String, usize), CommError> {
    flag_value.map(|v| (flag.to_string(), v)).ok_or_else(|| {
        CommError::launch(
            var,
            format!(
                "{because} is set but {var} is not (torchrun sets RANK, WORLD_SIZE, \
                 MASTER_ADDR and MASTER_PORT for every process; set {var} too, or pass {flag})"
            ),
        )
    })
}

fn master_addr_env(env: &dyn Fn(&str) -> Option<String>) -> Option<String> {
    env("MASTER_ADDR").filter(|s| !s.trim().is_empty()).map(|s| s.trim().to_string())
}

fn master_port_env(env: &dyn Fn(&str) -> Option<String>) -> Result<Option<(String, u16)>, CommError> {
    match env("MASTER_PORT") {
        Some(v) => Ok(Some(("MASTER_PORT".into(), parse_port("MASTER_PORT", &v)?))),
        None => Ok(None),
    }
}

/// torchrun-style variables; either of RANK and WORLD_SIZE marks the launch, and the other one
/// must then come from the environment or a flag.
fn torchrun(env: &dyn Fn(&str) -> Option<String>, explicit: &Explicit) -> Result<Option<Found>, CommError> {
    let (rank, size) = match (get_usize(env, "RANK")?, get_usize(env, "WORLD_SIZE")?) {
        (None, None) => return Ok(None),
        (Some(r), Some(s)) => (r, s),
        (Some(r), None) => (r, torchrun_pair(explicit.world_size, "--world-size", "WORLD_SIZE", "RANK")?),
        (None, Some(s)) => (torchrun_pair(explicit.rank, "--rank", "RANK", "WORLD_SIZE")?, s),
    };
    Ok(Some(Found {
        source: Source::Torchrun,
        rank,
        size,
        local: get_usize(env, "LOCAL_RANK")?,
        master_addr: master_addr_env(env),
        master_port: master_port_env(env)?,
    }))
}

fn from_env(env: &dyn Fn(&str) -> Option<String>, explicit: &Explicit) -> Result<Option<Found>, CommError> {
    if let Some(found) = torchrun(env, explicit)? {
        return Ok(Some(found));
    }
    let master_addr = master_addr_env(env);
    if let Some(rank) = get_usize(env, "OMPI_COMM_WORLD_RANK")? {
        let size = need(get_usize(env, "OMPI_COMM_WORLD_SIZE")?, "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")?;
        return Ok(Some(Found {
            source: Source::OpenMpi,
            rank,
            size,
            local: get_usize(env, "OMPI_COMM_WORLD_LOCAL_RANK")?,
            master_addr,
            master_port: master_port_env(env)?,
        }));
    }
    if let Some(rank) = get_usize(env, "PMI_RANK")? {
        let size = need(get_usize(env, "PMI_SIZE")?, "PMI_SIZE", "PMI_RANK")?;
        return Ok(Some(Found {
            source: Source::Pmi,
            rank,
            size,
            local: first_usize(env, &["MPI_LOCALRANKID", "PMI_LOCAL_RANK"])?,
            master_addr,
            master_port: master_port_env(env)?,
        }));
    }
    if let Some(rank) = get_usize(env, "SLURM_PROCID")? {
        return slurm(env, rank, master_addr).map(Some);
    }
    Ok(None)
}

fn slurm(
    env: &dyn Fn(&str) -> Option<String>,
    rank: (String, usize),
    master_addr: Option<String>,
) -> Result<Found, CommError> {
    let size = need(first_usize(env, &["SLURM_NTASKS", "SLURM_NPROCS"])?, "SLURM_NTASKS", "SLURM_PROCID")?;
    let master_addr = match master_addr {
        Some(a) => Some(a),
        None => {
            let mut host = None;
            for var in ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"] {
                if let Some(list) = env(var) {
                    host = Some(first_host(&list).map_err(|e| CommError::launch(var, format!("{var}={list}: {e}")))?);
                    break;
                }
            }
            host
        }
    };
    // Jobs sharing a node must not collide on one port: derive it from the job id unless set.
    let master_port = match master_port_env(env)? {
        Some(p) => Some(p),
        None => get_usize(env, "SLURM_JOB_ID")?.map(|(var, id)| (var, DEFAULT_MASTER_PORT + (id % 1000) as u16)),
    };
    Ok(Found { source: Source::Slurm, rank, size, local: get_usize(env, "SLURM_LOCALID")?, master_addr, master_port })
}

/// No launcher variables: explicit rank and world size (both, or neither for a single process).
/// Rank 0's address without a rank is a launch that lost its RANK/WORLD_SIZE, not a single process.
fn without_launcher(explicit: &Explicit, env: &dyn Fn(&str) -> Option<String>) -> Result<Found, CommError> {
    let (master_addr, master_port) = (master_addr_env(env), master_port_env(env)?);
    let found = |source, rank: (&str, usize), size: (&str, usize)| Found {
        source,
        rank: (rank.0.to_string(), rank.1),
        size: (size.0.to_string(), size.1),
        local: None,
        master_addr: master_addr.clone(),
        master_port: master_port.clone(),
    };
    match (explicit.rank, explicit.world_size) {
        (Some(r), Some(n)) => Ok(found(Source::Explicit, ("--rank", r), ("--world-size", n))),
        (Some(_), None) => Err(CommError::launch(
            "--world-size",
            "--rank is given but --world-size is not (nor any launcher's world size variable)",
        )),
        (None, Some(_)) => Err(CommError::launch(
            "--rank",
            "--world-size is given but --rank is not (nor any launcher's rank variable)",
        )),
        (None, None) => {
            let given = [
                ("MASTER_ADDR", master_addr.is_some()),
                ("MASTER_PORT", master_port.is_some()),
                ("--master-addr", explicit.master_addr.is_some()),
                ("--master-port", explicit.master_port.is_some()),
            ];
            if let Some((var, _)) = given.iter().find(|(_, set)| *set) {
                // Flags are the trainer's; a library user's program (`from_env`) has none to pass.
                let flags = if *explicit == Explicit::default() { "" } else { ", or pass --rank and --world-size" };
                return Err(CommError::launch(
                    "RANK",
                    format!(
                        "{var} is set but RANK and WORLD_SIZE are not, and no launcher was found \
                         (Open MPI, PMI, SLURM); set RANK and WORLD_SIZE (`qsr launch` and torchrun \
                         set both){flags}"
                    ),
                ));
            }
            Ok(found(Source::Single, ("rank", 0), ("world size", 1)))
        }
    }
}

/// Resolves the launch environment; `env` looks a variable up (e.g. `|k| std::env::var(k).ok()`).
///
/// Who am I in this job? Rank, world size, local rank and master address from the launcher.
/// Precedence (first match wins, field by field for explicit arguments):
/// explicit arguments > torchrun (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
/// `MASTER_PORT`) > Open MPI (`OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK`) > PMI (`PMI_RANK`,
/// `PMI_SIZE`, MPICH's `MPI_LOCALRANKID`) > SLURM (`SLURM_PROCID`, `SLURM_NTASKS`,
/// `SLURM_LOCALID`, first host of `SLURM_STEP_NODELIST`/`SLURM_JOB_NODELIST`/`SLURM_NODELIST`)
/// \> a single process.
///
/// The environment is passed in as a function so detection is testable without touching the
/// process environment ([`detect_from_process_env`] is the thin wrapper for real use).
///
/// Explicit values override the environment field by field; an explicit rank together with an
/// explicit world size makes the source [`Source::Explicit`] and the launcher variables are then
/// not consulted for rank/size (but `MASTER_ADDR`/`MASTER_PORT` still are).
///
/// A partial launch is an error naming what is missing, never a silent single process: one of
/// torchrun's `RANK`/`WORLD_SIZE` without the other (nor the matching flag), `MASTER_ADDR` or
/// `MASTER_PORT` (or the flags) with no rank from any launcher, and `--rank` without
/// `--world-size` or the reverse when no launcher gives the other. Not errors: `LOCAL_RANK` alone
/// (ignored), Open MPI, PMI and SLURM launches with or without `MASTER_ADDR`/`MASTER_PORT`, and
/// `RANK`/`WORLD_SIZE` without them (one host: [`DEFAULT_MASTER_ADDR`]:[`DEFAULT_MASTER_PORT`]).
/// A master port of 0 is refused for several ranks.
pub fn detect(explicit: &Explicit, env: &dyn Fn(&str) -> Option<String>) -> Result<LaunchEnv, CommError> {
    let found = if explicit.rank.is_some() && explicit.world_size.is_some() { None } else { from_env(env, explicit)? };
    let f = match found {
        Some(f) => f,
        None => without_launcher(explicit, env)?,
    };
    let mut source = f.source;
    let (rank_var, rank) = match explicit.rank {
        Some(r) => {
            source = Source::Explicit;
            ("--rank".to_string(), r)
        }
        None => f.rank.clone(),
    };
    let (size_var, world_size) = match explicit.world_size {
        Some(n) => ("--world-size".to_string(), n),
        None => f.size.clone(),
    };
    if world_size == 0 {
        return Err(CommError::launch(&size_var, format!("{size_var} must be at least 1")));
    }
    if rank >= world_size {
        return Err(CommError::launch(&rank_var, format!("{rank_var} {rank} >= {size_var} {world_size}")));
    }
    // Without a launcher-provided local rank, assume one host: the global rank.
    let (local_var, local_rank) = match (explicit.local_rank, f.local) {
        (Some(l), _) => ("--local-rank".to_string(), l),
        (None, Some((var, l))) => (var, l),
        (None, None) => ("rank".to_string(), rank),
    };
    if local_rank >= world_size {
        return Err(CommError::launch(&local_var, format!("{local_var} {local_rank} >= {size_var} {world_size}")));
    }
    let addr_var = if explicit.master_addr.is_some() { "--master-addr" } else { "MASTER_ADDR" };
    let master_addr = explicit.master_addr.clone().or(f.master_addr).unwrap_or_else(|| DEFAULT_MASTER_ADDR.to_string());
    // Refused at once: ranks would retry a name no resolver takes for the whole rendezvous timeout.
    crate::wire::check_host(&master_addr).map_err(|why| CommError::launch(addr_var, format!("{addr_var} {why}")))?;
    let master_port = resolve_port(explicit, f.master_port, world_size)?;
    Ok(LaunchEnv { rank, world_size, local_rank, master_addr, master_port, source })
}

/// The master port: explicit, else the launcher's, else the default; 0 is refused for several
/// ranks, since rank 0 would listen on a random port that the others cannot know.
fn resolve_port(explicit: &Explicit, env_port: Option<(String, u16)>, world_size: usize) -> Result<u16, CommError> {
    let (var, port) = match (explicit.master_port, env_port) {
        (Some(p), _) => ("--master-port".to_string(), p),
        (None, Some((var, p))) => (var, p),
        (None, None) => return Ok(DEFAULT_MASTER_PORT),
    };
    if port == 0 && world_size > 1 {
        let shown = if var.starts_with("--") { format!("{var} 0") } else { format!("{var}=0") };
        return Err(CommError::launch(
            &var,
            format!(
                "{shown} cannot be used: rank 0 would listen on a random port that the other ranks \
                 cannot know; choose a free port (e.g. {DEFAULT_MASTER_PORT})"
            ),
        ));
    }
    Ok(port)
}

/// [`detect`] over the real process environment.
pub fn detect_from_process_env(explicit: &Explicit) -> Result<LaunchEnv, CommError> {
    detect(explicit, &|k| std::env::var(k).ok())
}

/// First host of a SLURM node list: `node[01-04,07]` -> `node01`, `a,b` -> `a`, `gpu-[3,5]` ->
/// `gpu-3`, `host1` -> `host1`, `r[1-2]-n[08-09]` -> `r1-n08`.
pub fn first_host(list: &str) -> Result<String, String> {
    let list = list.trim();
    // The first entry ends at the first comma outside brackets.
    let mut depth = 0usize;
    let mut end = list.len();
    for (i, c) in list.char_indices() {
        match c {
            '[' => {
                if depth > 0 {
                    return Err("nested '[' in node list".into());
                }
                depth += 1;
            }
            ']' => {
                if depth == 0 {
                    return Err("unbalanced ']' in node list".into());
                }
                depth -= 1;
            }
            ',' if depth == 0 => {
                end = i;
                break;
            }
            _ => {}
        }
    }
    let entry = &list[..end];
    if entry.is_empty() {
        return Err("empty node list".into());
    }
    let mut host = String::new();
    let mut rest = entry;
    while let Some(open) = rest.find('[') {
        host.push_str(&rest[..open]);
        let close = rest[open..].find(']').map(|c| open + c).ok_or("unbalanced '[' in node list")?;
        let inner = &rest[open + 1..close];
        let first = inner.split(',').next().unwrap_or("");
        let start = first.split('-').next().unwrap_or("").trim();
        if start.is_empty() || !start.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!("bad range '[{inner}]' in node list"));
        }
        host.push_str(start);
        rest = &rest[close + 1..];
    }
    if rest.contains(']') {
        return Err("unbalanced ']' in node list".into());
    }
    host.push_str(rest);
    Ok(host)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k: &str| map.get(k).cloned()
    }

    fn err(explicit: &Explicit, pairs: &[(&str, &str)]) -> String {
        detect(explicit, &env_of(pairs)).unwrap_err().to_string()
    }

    #[test]
    fn single_process_without_launcher() {
        let e = detect(&Explicit::default(), &env_of(&[])).unwrap();
        assert_eq!(
            e,
            LaunchEnv {
                rank: 0,
                world_size: 1,
                local_rank: 0,
                master_addr: "127.0.0.1".into(),
                master_port: 29500,
                source: Source::Single
            }
        );
    }

    /// D16: a `MASTER_ADDR` no host could have is refused at once, naming the variable and not the
    /// whole value (ranks retried it for the rendezvous timeout, printing it each time).
    #[test]
    fn a_master_addr_no_host_could_have_is_refused_at_once_without_repeating_it() {
        let long = "a".repeat(100_000);
        let env = [("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", long.as_str()), ("MASTER_PORT", "1234")];
        let e = err(&Explicit::default(), &env);
        assert!(e.contains("MASTER_ADDR has 100000 bytes") && e.len() < 300, "{e}");
        let explicit = Explicit { master_addr: Some("bad host".into()), ..Explicit::default() };
        let e = err(&explicit, &env);
        assert!(e.contains("--master-addr `bad host` has the character ' '"), "{e}");
    }

    #[test]
    fn torchrun_variables() {
        let env =
            [("RANK", "3"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "1"), ("MASTER_ADDR", "n0"), ("MASTER_PORT", "1234")];
        let e = detect(&Explicit::default(), &env_of(&env)).unwrap();
        assert_eq!(
            (e.rank, e.world_size, e.local_rank, e.master_addr.as_str(), e.master_port, e.source),
            (3, 8, 1, "n0", 1234, Source::Torchrun)
        );
    }

    #[test]
    fn precedence_explicit_torchrun_ompi_pmi_slurm() {
        let all = [
            ("RANK", "1"),
            ("WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "5"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("PMI_RANK", "3"),
            ("PMI_SIZE", "6"),
            ("SLURM_PROCID", "4"),
            ("SLURM_NTASKS", "7"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODELIST", "gpu[07-09]"),
        ];
        let d = |skip: usize, ex: &Explicit| detect(ex, &env_of(&all[skip..])).unwrap();
        let ex = Explicit { rank: Some(0), world_size: Some(2), ..Default::default() };
        assert_eq!((d(0, &ex).source, d(0, &ex).rank, d(0, &ex).world_size), (Source::Explicit, 0, 2));
        let none = Explicit::default();
        assert_eq!((d(0, &none).source, d(0, &none).rank), (Source::Torchrun, 1));
        assert_eq!((d(2, &none).source, d(2, &none).rank, d(2, &none).world_size), (Source::OpenMpi, 2, 5));
        assert_eq!((d(5, &none).source, d(5, &none).rank, d(5, &none).world_size), (Source::Pmi, 3, 6));
        let s = d(7, &none);
        assert_eq!(
            (s.source, s.rank, s.world_size, s.local_rank, s.master_addr.as_str()),
            (Source::Slurm, 4, 7, 1, "gpu07")
        );
        // explicit fields override single fields of a detected launcher
        let ex =
            Explicit { master_addr: Some("h".into()), master_port: Some(9), local_rank: Some(0), ..Default::default() };
        let e = d(7, &ex);
        assert_eq!(
            (e.source, e.rank, e.master_addr.as_str(), e.master_port, e.local_rank),
            (Source::Slurm, 4, "h", 9, 0)
        );
        // an explicit rank marks the source explicit even when the size comes from the launcher
        let ex = Explicit { rank: Some(2), ..Default::default() };
        let e = d(0, &ex);
        assert_eq!((e.source, e.rank, e.world_size), (Source::Explicit, 2, 4));
    }

    #[test]
    fn explicit_rank_ignores_broken_launcher_variables() {
        let ex = Explicit { rank: Some(1), world_size: Some(2), ..Default::default() };
        let e = detect(&ex, &env_of(&[("RANK", "abc"), ("MASTER_ADDR", "m"), ("MASTER_PORT", "77")])).unwrap();
        assert_eq!((e.rank, e.world_size, e.master_addr.as_str(), e.master_port), (1, 2, "m", 77));
    }

    #[test]
    fn errors_name_the_variable() {
        let none = Explicit::default();
        assert!(err(&none, &[("RANK", "abc"), ("WORLD_SIZE", "4")]).contains("RANK=abc is not an integer"));
        assert!(err(&none, &[("RANK", "4"), ("WORLD_SIZE", "4")]).contains("RANK 4 >= WORLD_SIZE 4"));
        assert!(err(&none, &[("RANK", "0")]).contains("RANK is set but WORLD_SIZE is not"));
        assert!(err(&none, &[("RANK", "0"), ("WORLD_SIZE", "0")]).contains("WORLD_SIZE must be at least 1"));
        assert!(
            err(&none, &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "70000")])
                .contains("MASTER_PORT=70000 is not a port")
        );
        assert!(
            err(&none, &[("OMPI_COMM_WORLD_RANK", "5"), ("OMPI_COMM_WORLD_SIZE", "2")])
                .contains("OMPI_COMM_WORLD_RANK 5 >= OMPI_COMM_WORLD_SIZE 2")
        );
        assert!(
            err(&none, &[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2"), ("SLURM_LOCALID", "2")])
                .contains("SLURM_LOCALID 2 >= SLURM_NTASKS 2")
        );
        assert!(
            err(&none, &[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2"), ("SLURM_NODELIST", "n[1-")])
                .contains("SLURM_NODELIST")
        );
        let ex = Explicit { rank: Some(3), world_size: Some(2), ..Default::default() };
        assert!(err(&ex, &[]).contains("--rank 3 >= --world-size 2"));
    }

    /// The variable a detection error names (for programs) and its message.
    fn refusal(explicit: &Explicit, pairs: &[(&str, &str)]) -> (String, String) {
        match detect(explicit, &env_of(pairs)) {
            Err(e @ CommError::Launch { .. }) => {
                let CommError::Launch { var, .. } = &e else { unreachable!() };
                (var.clone(), e.to_string())
            }
            other => panic!("{pairs:?}: expected a launch error, got {other:?}"),
        }
    }

    #[test]
    fn partial_torchrun_environment_names_the_missing_variable() {
        let none = Explicit::default();
        let (var, msg) = refusal(&none, &[("WORLD_SIZE", "2")]);
        assert_eq!(var, "RANK", "{msg}");
        assert!(msg.contains("WORLD_SIZE is set but RANK is not"), "{msg}");
        let (var, msg) = refusal(&none, &[("RANK", "1"), ("LOCAL_RANK", "1")]);
        assert_eq!(var, "WORLD_SIZE", "{msg}");
        for (set, value) in [("MASTER_ADDR", "n0"), ("MASTER_PORT", "1234")] {
            let (var, msg) = refusal(&none, &[(set, value)]);
            assert_eq!(var, "RANK", "{msg}");
            assert!(msg.contains(&format!("{set} is set but RANK and WORLD_SIZE are not")), "{msg}");
        }
        let ex = Explicit { master_addr: Some("n0".into()), ..Default::default() };
        assert!(refusal(&ex, &[]).1.contains("--master-addr is set"));
    }

    /// A library user's program (`from_env`, no flags) is not told to pass the trainer's flags.
    #[test]
    fn a_programs_launch_error_names_variables_not_the_trainers_flags() {
        let (_, msg) = refusal(&Explicit::default(), &[("MASTER_ADDR", "n0")]);
        assert!(msg.contains("set RANK and WORLD_SIZE") && !msg.contains("--rank"), "{msg}");
        let ex = Explicit { master_port: Some(1234), ..Default::default() };
        assert!(refusal(&ex, &[]).1.contains("pass --rank and --world-size"));
    }

    #[test]
    fn explicit_rank_and_world_size_come_in_pairs() {
        let rank = Explicit { rank: Some(0), ..Default::default() };
        let size = Explicit { world_size: Some(2), ..Default::default() };
        let (var, msg) = refusal(&rank, &[]);
        assert_eq!(var, "--world-size", "{msg}");
        assert!(msg.contains("--rank is given but --world-size is not"), "{msg}");
        let (var, msg) = refusal(&size, &[]);
        assert_eq!(var, "--rank", "{msg}");
        // The other half may come from a launcher.
        let e = detect(&rank, &env_of(&[("WORLD_SIZE", "2")])).unwrap();
        assert_eq!((e.source, e.rank, e.world_size), (Source::Explicit, 0, 2));
        let e = detect(&size, &env_of(&[("RANK", "1")])).unwrap();
        assert_eq!((e.source, e.rank, e.world_size), (Source::Torchrun, 1, 2));
        let ompi = [("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2")];
        let e = detect(&size, &env_of(&ompi)).unwrap();
        assert_eq!((e.source, e.rank, e.world_size), (Source::OpenMpi, 1, 2));
    }

    #[test]
    fn legitimate_partial_sets_are_not_errors() {
        let none = Explicit::default();
        let d = |pairs: &[(&str, &str)]| detect(&none, &env_of(pairs)).unwrap();
        // LOCAL_RANK alone (set by other tools for device selection) is no launch.
        assert_eq!(d(&[("LOCAL_RANK", "3")]).source, Source::Single);
        // Open MPI / PMI / SLURM give no rank 0 address; MASTER_* may come with them, or not.
        let ompi = [("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2"), ("MASTER_ADDR", "n0")];
        assert_eq!(d(&ompi).master_addr, "n0");
        let pmi = [("PMI_RANK", "1"), ("PMI_SIZE", "2"), ("MASTER_PORT", "4000")];
        assert_eq!(d(&pmi).master_port, 4000);
        let slurm = [("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2"), ("MASTER_PORT", "4001")];
        assert_eq!(d(&slurm).master_port, 4001);
        // RANK and WORLD_SIZE on one host: the default rank 0 address.
        let e = d(&[("RANK", "1"), ("WORLD_SIZE", "2")]);
        assert_eq!((e.master_addr.as_str(), e.master_port), (DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT));
    }

    #[test]
    fn master_port_zero_is_refused_naming_the_variable() {
        let none = Explicit::default();
        let env = [("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "0")];
        let (var, msg) = refusal(&none, &env);
        assert_eq!(var, "MASTER_PORT", "{msg}");
        assert!(msg.contains("MASTER_PORT=0 cannot be used"), "{msg}");
        let ex = Explicit { rank: Some(1), world_size: Some(2), master_port: Some(0), ..Default::default() };
        let (var, msg) = refusal(&ex, &[]);
        assert_eq!(var, "--master-port", "{msg}");
        assert!(msg.contains("--master-port 0 cannot be used"), "{msg}");
        // One rank never listens: nothing to refuse.
        let one = [("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_PORT", "0")];
        assert_eq!(detect(&none, &env_of(&one)).unwrap().master_port, 0);
    }

    #[test]
    fn launch_errors_name_the_variable_once() {
        let none = Explicit::default();
        let cases: [(&[(&str, &str)], &str); 4] = [
            (&[("RANK", "abc"), ("WORLD_SIZE", "4")], "RANK="),
            (&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "x")], "MASTER_PORT"),
            (&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2"), ("SLURM_LOCALID", "2")], "SLURM_LOCALID"),
            (&[("RANK", "3"), ("WORLD_SIZE", "2")], "RANK "),
        ];
        for (pairs, var) in cases {
            let msg = err(&none, pairs);
            assert_eq!(msg.matches(var).count(), 1, "{var} in {msg}");
        }
    }

    #[test]
    fn slurm_port_from_job_id_and_master_addr_override() {
        let env =
            [("SLURM_PROCID", "1"), ("SLURM_NTASKS", "2"), ("SLURM_JOB_ID", "123456"), ("SLURM_JOB_NODELIST", "a,b")];
        let e = detect(&Explicit::default(), &env_of(&env)).unwrap();
        assert_eq!((e.master_addr.as_str(), e.master_port, e.local_rank), ("a", 29500 + 456, 1));
        let mut env2 = env.to_vec();
        env2.push(("MASTER_ADDR", "x"));
        env2.push(("MASTER_PORT", "5000"));
        let e = detect(&Explicit::default(), &env_of(&env2)).unwrap();
        assert_eq!((e.master_addr.as_str(), e.master_port), ("x", 5000));
    }

    #[test]
    fn nodelist_first_host() {
        let cases = [
            ("node[01-04,07]", "node01"),
            ("a,b", "a"),
            ("gpu-[3,5]", "gpu-3"),
            ("host1", "host1"),
            ("rack[1-2]-node[08-09]", "rack1-node08"),
            ("node[001-004],login1", "node001"),
            (" n[7] ", "n7"),
        ];
        for (input, want) in cases {
            assert_eq!(first_host(input).as_deref(), Ok(want), "{input}");
        }
        for bad in ["", "n[1-2", "n]1[", "n[]", "n[a-b]", "n[[1]]", ",a"] {
            assert!(first_host(bad).is_err(), "{bad:?} should be rejected");
        }
    }
}
