//! Elastic membership over the store: generations form, lose members (closed or stalled), admit new
//! workers, hand over the newest sync, and refuse what is stale.

use std::time::Duration;

use qsr_comm::{Collective, CommError, ReduceOp, ShmConfig, TcpConfig, Transport};
use qsr_elastic::{Elastic, ElasticConfig, ElasticError, LastSync, MAX_SYNC_PAYLOAD, Poll, Store, StoreConfig};

fn store(workers: usize) -> Store {
    let cfg = StoreConfig { settle: Duration::from_secs(1), token: "elastic-test".into(), ..StoreConfig::new(workers) };
    Store::bind("127.0.0.1:0", cfg).unwrap()
}

fn config(store: &Store, order: u64) -> ElasticConfig {
    let tcp = TcpConfig {
        timeout: Duration::from_secs(1),
        rendezvous_timeout: Duration::from_secs(20),
        token: "elastic-test".into(),
        ..TcpConfig::default()
    };
    ElasticConfig {
        store: store.local_addr().to_string(),
        tcp,
        transport: Transport::Tcp,
        shm: ShmConfig::default(),
        host: "test-host".into(),
        order: Some(order),
        settings: serde_json::json!({ "recipe": "r", "seed": 1 }),
    }
}

fn state(step: u64) -> Option<LastSync> {
    Some(LastSync { step, payload: format!("counters at {step}") })
}

/// Sums one value per rank; every rank must get the same total.
fn total(comm: &mut dyn Collective, mine: f32) -> Result<f32, CommError> {
    let mut buf = [mine];
    comm.all_reduce(&mut buf, ReduceOp::Sum)?;
    Ok(buf[0])
}

/// `n` workers of `store` on threads, launcher order `0..n`, each connected and running `body`;
/// their results in order.
fn each_worker<T: Send + 'static>(store: &Store, n: u64, body: fn(u64, Elastic) -> T) -> Vec<T> {
    let handles: Vec<_> = (0..n)
        .map(|order| {
            let cfg = config(store, order);
            std::thread::spawn(move || body(order, Elastic::connect(cfg).unwrap()))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn survivors_of_a_lost_worker_form_the_next_generation_with_the_newest_sync() {
    let store = store(3);
    let results = each_worker(&store, 3, |order, mut job| {
        let (mut comm, m) = job.form(None, "start").unwrap();
        assert_eq!((m.generation, m.rank, m.world_size, m.state.clone()), (0, order as usize, 3, None));
        assert_eq!(total(comm.as_mut(), 1.0).unwrap(), 3.0);
        if m.rank == 2 {
            return None; // lost: its connections close
        }
        assert!(total(comm.as_mut(), 1.0).is_err(), "rank {} did not see the loss", m.rank);
        // Rank 1 completed a later sync than rank 0: the new generation continues from it.
        let step = if m.rank == 1 { 20 } else { 10 };
        let (mut comm, m2) = job.form(state(step), "lost a peer").unwrap();
        assert_eq!(total(comm.as_mut(), 1.0).unwrap(), 2.0);
        job.finish().unwrap();
        Some(m2)
    });
    let got: Vec<_> = results.into_iter().flatten().collect();
    assert_eq!(got.len(), 2);
    for (rank, m) in got.iter().enumerate() {
        assert_eq!((m.generation, m.rank, m.world_size, m.previous_rank), (1, rank, 2, Some(rank)));
        assert_eq!((m.source, m.state.clone()), (Some(1), state(20)));
        assert_eq!(m.lost.len(), 1);
        assert_eq!(m.lost[0].rank, 2);
        assert!(m.lost[0].reason.contains("exited"), "{}", m.lost[0].reason);
        assert!(m.joined.is_empty());
    }
    assert!(store.wait_finished(Some(Duration::from_secs(5))));
}

/// `form_pair` gives each generation two groups of the same ranks that reduce at the same time (one
/// on a thread), and a loss breaks both: the next generation forms its own pair.
#[test]
fn a_generation_formed_as_a_pair_reduces_on_both_groups_at_once_and_reforms_both() {
    let store = store(3);
    let sizes = each_worker(&store, 3, |_, mut job| {
        let qsr_elastic::Pair { mut comm, mut side, membership: m } = job.form_pair(None, "start").unwrap();
        assert_eq!((side.rank(), side.world_size()), (m.rank, 3));
        let beside = std::thread::spawn(move || (total(side.as_mut(), 2.0), side));
        assert_eq!(total(comm.as_mut(), 1.0).unwrap(), 3.0);
        let (sum, mut side) = beside.join().unwrap();
        assert_eq!(sum.unwrap(), 6.0);
        if m.rank == 2 {
            return None;
        }
        assert!(total(side.as_mut(), 1.0).is_err(), "rank {}'s side group did not see the loss", m.rank);
        let qsr_elastic::Pair { mut comm, mut side, membership: m2 } = job.form_pair(state(4), "lost a peer").unwrap();
        assert_eq!((total(comm.as_mut(), 1.0).unwrap(), total(side.as_mut(), 3.0).unwrap()), (2.0, 6.0));
        job.finish().unwrap();
        Some(m2.world_size)
    });
    assert_eq!(sizes.into_iter().flatten().collect::<Vec<_>>(), [2, 2]);
    assert!(store.wait_finished(Some(Duration::from_secs(5))));
}

#[test]
fn a_stalled_worker_is_expelled_and_its_later_join_is_refused() {
    let store = store(3);
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let mut handles = Vec::new();
    for order in 0..3u64 {
        let cfg = config(&store, order);
        let tx = tx.clone();
        handles.push(std::thread::spawn(move || -> Option<ElasticError> {
            let mut job = Elastic::connect(cfg).unwrap();
            let (mut comm, m) = job.form(None, "start").unwrap();
            if m.rank == 1 {
                // Stalled: keeps its store connection open and reports nothing until the others re-formed.
                let _ = tx;
                std::thread::sleep(Duration::from_secs(4));
                let late = total(comm.as_mut(), 1.0);
                assert!(late.is_err(), "a stale ring must not complete");
                return job.form(state(0), "late").err();
            }
            assert!(total(comm.as_mut(), 1.0).is_err());
            let (mut comm, m2) = job.form(state(0), "peer stalled").unwrap();
            assert_eq!((m2.generation, m2.world_size), (1, 2));
            assert!(m2.lost[0].reason.contains("did not report"), "{}", m2.lost[0].reason);
            assert_eq!(total(comm.as_mut(), 1.0).unwrap(), 2.0);
            tx.send(()).unwrap();
            std::thread::sleep(Duration::from_secs(5));
            None
        }));
    }
    drop(tx);
    let errors: Vec<_> = handles.into_iter().filter_map(|h| h.join().unwrap()).collect();
    assert_eq!(errors.len(), 1);
    assert!(
        matches!(errors[0], ElasticError::Expelled { generation: 0, current: 1 }),
        "the stale worker got {:?}",
        errors[0]
    );
    assert!(errors[0].to_string().contains("expelled"));
    rx.recv().unwrap();
}

#[test]
fn a_new_worker_joins_when_the_generation_admits_it() {
    let store = store(3);
    let cfg_new = config(&store, 9);
    let mut handles = Vec::new();
    for order in 0..3u64 {
        let cfg = config(&store, order);
        handles.push(std::thread::spawn(move || {
            let mut job = Elastic::connect(cfg).unwrap();
            let (mut comm, m) = job.form(None, "start").unwrap();
            if m.rank == 0 {
                return None;
            }
            assert!(total(comm.as_mut(), 1.0).is_err());
            let (mut comm, m) = job.form(state(8), "lost rank 0").unwrap();
            assert_eq!((m.rank, m.world_size), (m.previous_rank.unwrap() - 1, 2));
            // Poll (one rank decides for all in a trainer; both see the same here) until the joiner waits.
            loop {
                match job.poll().unwrap() {
                    Poll::Steady { waiting: 1 } => break,
                    Poll::Steady { .. } => std::thread::sleep(Duration::from_millis(50)),
                    Poll::Over => panic!("generation 1 ended"),
                }
            }
            assert_eq!(total(comm.as_mut(), 1.0).unwrap(), 2.0);
            let (mut comm, m) = job.form(state(12), "grow").unwrap();
            assert_eq!(total(comm.as_mut(), 1.0).unwrap(), 3.0);
            Some(m)
        }));
    }
    std::thread::sleep(Duration::from_millis(300));
    let joiner = std::thread::spawn(move || {
        let mut job = Elastic::connect(cfg_new).unwrap();
        let (mut comm, m) = job.form(None, "new worker").unwrap();
        assert_eq!(total(comm.as_mut(), 1.0).unwrap(), 3.0);
        m
    });
    let m = joiner.join().unwrap();
    assert_eq!((m.generation, m.rank, m.world_size, m.previous_rank), (2, 2, 3, None));
    assert_eq!((m.source, m.state.clone(), m.joined.clone()), (Some(0), state(12), vec![2]));
    for h in handles {
        if let Some(m) = h.join().unwrap() {
            assert_eq!((m.generation, m.world_size, m.joined.clone()), (2, 3, vec![2]));
        }
    }
}

#[test]
fn a_worker_with_other_settings_is_refused_naming_the_key_once_the_job_formed() {
    let store = store(2);
    // The odd worker comes first: it waits, and does not make the job's settings its own.
    let mut odd = config(&store, 0);
    odd.settings = serde_json::json!({ "recipe": "r", "seed": 2 });
    let early = odd.clone();
    let waiting = std::thread::spawn(move || Elastic::connect(early).unwrap().form(None, "start").err());
    std::thread::sleep(Duration::from_millis(300));
    let members: Vec<_> = (1..3u64)
        .map(|order| {
            let cfg = config(&store, order);
            std::thread::spawn(move || Elastic::connect(cfg).unwrap().form(None, "start").map(|(_, m)| m.world_size))
        })
        .collect();
    for m in members {
        assert_eq!(m.join().unwrap().unwrap(), 2, "the workers that agree form the first generation");
    }
    let err = waiting.join().unwrap().expect("the odd worker is refused once the job formed");
    assert!(err.to_string().contains("`seed` (job: 1, this worker: 2)"), "{err}");
    // From then on a worker with other settings is refused at its hello.
    let err = Elastic::connect(odd.clone()).err().expect("refused");
    assert!(err.to_string().contains("`seed`"), "{err}");
    odd.tcp.token = "another-job".into();
    let err = Elastic::connect(odd).err().expect("refused");
    assert!(err.to_string().contains("job token"), "{err}");
}

#[test]
fn a_stray_first_hello_does_not_fix_the_jobs_settings() {
    use std::io::Write;
    let store = store(2);
    // A client that is not a worker says hello first with the job's token and other settings, then
    // stays connected without joining; another says hello and dies at once.
    let hello = |settings: &str| {
        let mut s = std::net::TcpStream::connect(store.local_addr()).unwrap();
        let line =
            format!("{{\"type\":\"hello\",\"token\":\"elastic-test\",\"settings\":{settings},\"order\":null}}\n");
        s.write_all(line.as_bytes()).unwrap();
        s
    };
    let _idle = hello(r#"{"recipe":"not-a-worker"}"#);
    drop(hello(r#"{"recipe":"died","seed":9}"#));
    std::thread::sleep(Duration::from_millis(200));
    let members: Vec<_> = (0..2u64)
        .map(|order| {
            let cfg = config(&store, order);
            std::thread::spawn(move || Elastic::connect(cfg).unwrap().form(None, "start").map(|(_, m)| m.rank))
        })
        .collect();
    let mut ranks: Vec<usize> = members.into_iter().map(|m| m.join().unwrap().unwrap()).collect();
    ranks.sort_unstable();
    assert_eq!(ranks, vec![0, 1], "the correct workers were refused or blamed");
}

#[test]
fn a_first_generation_short_of_workers_says_how_many_joined() {
    let store = store(3);
    let mut other = config(&store, 2);
    other.settings = serde_json::json!({ "recipe": "r", "seed": 7 });
    let _odd = std::thread::spawn(move || Elastic::connect(other).map(|mut j| j.form(None, "start").is_ok()));
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        store.waiting_for().as_deref(),
        Some("1 of 3 workers have joined the first generation"),
        "the store names its largest group"
    );
    let mut cfg = config(&store, 0);
    cfg.tcp.rendezvous_timeout = Duration::from_secs(2);
    let err = Elastic::connect(cfg).unwrap().form(None, "start").err().expect("short of workers");
    let msg = err.to_string();
    assert!(
        msg.contains(
            "1 of 3 workers have joined the first generation; 1 more joined with other settings (differing in `seed`)"
        ),
        "{msg}"
    );
}

#[test]
fn survivors_reporting_long_after_a_loss_are_not_expelled() {
    // Survivors learn of a loss at their next sync, which may come long after it: the settle time
    // (1 s here) runs from the first report, so neither survivor is left out.
    let store = store(3);
    let handles: Vec<_> = (0..3u64)
        .map(|order| {
            let cfg = config(&store, order);
            std::thread::spawn(move || {
                let mut job = Elastic::connect(cfg).unwrap();
                let (mut comm, m) = job.form(None, "start").unwrap();
                if m.rank == 2 {
                    return None;
                }
                std::thread::sleep(Duration::from_millis(2500)); // a long local round
                assert!(total(comm.as_mut(), 1.0).is_err());
                let (mut comm, m2) = job.form(state(10), "lost a peer").unwrap();
                assert_eq!(total(comm.as_mut(), 1.0).unwrap(), 2.0);
                job.finish().unwrap();
                Some(m2.world_size)
            })
        })
        .collect();
    let sizes: Vec<_> = handles.into_iter().filter_map(|h| h.join().unwrap()).collect();
    assert_eq!(sizes, vec![2, 2]);
    assert!(store.wait_finished(Some(Duration::from_secs(5))));
}

#[test]
fn joiners_of_a_job_that_lost_every_worker_are_refused_naming_the_resume() {
    let store = store(2);
    let members: Vec<_> = (0..2u64)
        .map(|order| {
            let cfg = config(&store, order);
            std::thread::spawn(move || Elastic::connect(cfg).unwrap().form(None, "start").map(|(_, m)| m.rank))
        })
        .collect();
    for h in members {
        h.join().unwrap().unwrap(); // both formed generation 0, then were lost with their connections
    }
    let mut late = Elastic::connect(ElasticConfig { order: None, ..config(&store, 0) }).unwrap();
    let err = late.form(None, "restarted").err().expect("nobody holds the state: the joiner must be refused");
    assert!(err.to_string().contains("--resume"), "{err}");
}

#[test]
fn a_first_generation_short_of_workers_fails_at_the_rendezvous_timeout() {
    let store = store(2);
    let mut cfg = config(&store, 0);
    cfg.tcp.rendezvous_timeout = Duration::from_secs(1);
    let err =
        Elastic::connect(cfg).unwrap().form(None, "start").err().expect("one worker of two must not wait forever");
    assert!(err.to_string().contains("did not form within the rendezvous timeout"), "{err}");
}

/// N3: a survivor below `min_workers` waits for new workers at most its rendezvous timeout (it
/// waited on past it), and the store, its job orphaned, says so.
#[test]
fn a_survivor_below_min_workers_gives_up_at_its_rendezvous_timeout() {
    let cfg = StoreConfig {
        settle: Duration::from_secs(1),
        token: "elastic-test".into(),
        min_workers: 2,
        ..StoreConfig::new(3)
    };
    let store = Store::bind("127.0.0.1:0", cfg).unwrap();
    let handles: Vec<_> = (0..3u64)
        .map(|order| {
            let mut cfg = config(&store, order);
            cfg.tcp.rendezvous_timeout = Duration::from_secs(2);
            std::thread::spawn(move || {
                let mut job = Elastic::connect(cfg).unwrap();
                let (mut comm, m) = job.form(None, "start").unwrap();
                if m.rank != 0 {
                    return None; // two of three lost: one survivor, below min_workers
                }
                assert!(total(comm.as_mut(), 1.0).is_err());
                let start = std::time::Instant::now();
                let err = job.form(state(10), "lost two peers").err().expect("alone below min_workers");
                Some((err.to_string(), start.elapsed()))
            })
        })
        .collect();
    let (msg, took) = handles.into_iter().find_map(|h| h.join().unwrap()).unwrap();
    assert!(msg.contains("no new worker came within the rendezvous timeout of 2s"), "{msg}");
    assert!(msg.contains("at least 2 workers and 1 are ready"), "{msg}");
    assert!(took < Duration::from_secs(8), "gave up after {took:?}");
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while store.orphaned().is_none() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(store.orphaned().is_some(), "the store must see its job orphaned");
}

/// A spare waits for a free slot as long as the job runs, past its rendezvous timeout.
#[test]
fn a_spare_waits_past_its_rendezvous_timeout_for_a_free_slot() {
    let store = store(2);
    let handles: Vec<_> = (0..3u64)
        .map(|order| {
            let mut cfg = config(&store, order);
            cfg.tcp.rendezvous_timeout = Duration::from_secs(1);
            std::thread::spawn(move || {
                let mut job = Elastic::connect(cfg).unwrap();
                let (mut comm, first) = job.form(None, "start").unwrap();
                if first.generation == 0 {
                    std::thread::sleep(Duration::from_millis(2500)); // a long round
                    if first.rank == 1 {
                        return None;
                    }
                    assert!(total(comm.as_mut(), 1.0).is_err());
                    (comm, _) = job.form(state(10), "lost a peer").unwrap();
                }
                assert_eq!(total(comm.as_mut(), 1.0).unwrap(), 2.0);
                job.finish().unwrap();
                Some(first.generation)
            })
        })
        .collect();
    let mut ended: Vec<_> = handles.into_iter().filter_map(|h| h.join().unwrap()).collect();
    ended.sort();
    assert_eq!(ended, vec![0, 1], "the spare joined generation 1 after 2.5 s of a 1 s timeout");
    assert!(store.wait_finished(Some(Duration::from_secs(5))));
}

#[test]
fn a_join_whose_payload_would_not_fit_is_refused_naming_the_field() {
    let store = store(1);
    let mut job = Elastic::connect(config(&store, 0)).unwrap();
    let big = Some(LastSync { step: 0, payload: "x".repeat(MAX_SYNC_PAYLOAD + 1) });
    let err = job.form(big, "start").err().expect("an oversized payload must be refused");
    assert!(err.to_string().contains("`state.payload`"), "{err}");
}

#[test]
fn connections_past_the_limit_are_refused_even_before_their_hello() {
    let cfg = StoreConfig { max_connections: 2, token: "elastic-test".into(), ..StoreConfig::new(1) };
    let store = Store::bind("127.0.0.1:0", cfg).unwrap();
    // Two sockets that never say hello hold the store's two slots.
    let _idle: Vec<_> = (0..2).map(|_| std::net::TcpStream::connect(store.local_addr()).unwrap()).collect();
    // One thread accepts in arrival order, so both are counted before the third is seen.
    let third = std::net::TcpStream::connect(store.local_addr()).unwrap();
    third.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(third), &mut line).unwrap();
    assert!(line.contains("refused") && line.contains("limit of 2 connections"), "{line}");
}

#[test]
fn a_spare_worker_waiting_at_the_store_takes_a_lost_workers_place() {
    // Three workers for a job of two: the first two to join form generation 0, the third waits as a
    // spare and fills the slot of the first worker lost.
    let store = store(2);
    let handles: Vec<_> = (0..3u64)
        .map(|order| {
            let cfg = config(&store, order);
            std::thread::spawn(move || {
                let mut job = Elastic::connect(cfg).unwrap();
                let (mut comm, first) = job.form(None, "start").unwrap();
                if first.generation == 0 {
                    if first.rank == 1 {
                        return None; // lost
                    }
                    assert!(total(comm.as_mut(), 1.0).is_err());
                    (comm, _) = job.form(state(10), "lost a peer").unwrap();
                }
                assert_eq!(total(comm.as_mut(), 1.0).unwrap(), 2.0);
                job.finish().unwrap();
                Some((first.generation, first.joined, job.generation()))
            })
        })
        .collect();
    let mut ended: Vec<_> = handles.into_iter().filter_map(|h| h.join().unwrap()).collect();
    ended.sort();
    // The survivor started in generation 0 (where every rank is new); the spare joined generation 1
    // as rank 1.
    assert_eq!(ended, vec![(0, vec![0, 1], Some(1)), (1, vec![1], Some(1))]);
    assert!(store.wait_finished(Some(Duration::from_secs(5))));
}

#[test]
fn a_worker_reaches_its_store_by_a_name_that_resolves_to_several_addresses() {
    // `localhost` may resolve to ::1 before 127.0.0.1, where the store listens: every address is tried.
    let store = store(1);
    let cfg = ElasticConfig { store: format!("localhost:{}", store.local_addr().port()), ..config(&store, 0) };
    let mut job = Elastic::connect(cfg).unwrap();
    job.form(None, "start").unwrap();
    job.finish().unwrap();
    assert!(store.wait_finished(Some(Duration::from_secs(5))));
}

#[test]
fn a_job_finishes_when_its_members_are_done_or_gone() {
    // A member lost after the last sync (killed before it said it was done) does not hold the job
    // open: the store reports it finished, not orphaned, once the others are done.
    let store = store(3);
    let handles: Vec<_> = (0..3u64)
        .map(|order| {
            let cfg = config(&store, order);
            std::thread::spawn(move || {
                let mut job = Elastic::connect(cfg).unwrap();
                let (mut comm, m) = job.form(None, "start").unwrap();
                assert_eq!(total(comm.as_mut(), 1.0).unwrap(), 3.0);
                if m.rank != 2 {
                    job.finish().unwrap();
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert!(store.wait_finished(Some(Duration::from_secs(5))), "{:?}", store.waiting_for());
    assert_eq!(store.orphaned(), None);
}
