//! The synchronisation rules of a shared-memory group, apart from the memory they act on, so that
//! the transport ([`super::ShmComm`], on atomics in a mapped file) and a loom model of it (below,
//! on loom's atomics and cells) run the same code with the same memory orderings.
//!
//! The rules: a member writes its data half and the half's call header, then publishes its stage
//! counter with Release; a member that reads a counter at or past a stage with Acquire sees
//! everything the owner wrote before publishing it. Pipeline steps alternate between two halves,
//! so a member writes a half again only after every member completed the stage at which the last
//! reader of that half was done with it. The first failure any member sees is kept in the group's
//! abort word (a compare-and-swap from 0), so every member names the same culprit.

use std::sync::atomic::Ordering;

/// The operations the protocol needs from a 64-bit atomic word.
pub(crate) trait Word {
    fn load(&self, order: Ordering) -> u64;
    fn store(&self, value: u64, order: Ordering);
    fn compare_exchange(&self, current: u64, new: u64, ok: Ordering, fail: Ordering) -> Result<u64, u64>;
}

/// [`Word`] for an atomic type with std's methods (std's for the transport, loom's for the model).
macro_rules! word {
    ($t:ty) => {
        impl Word for $t {
            fn load(&self, order: Ordering) -> u64 {
                self.load(order)
            }
            fn store(&self, value: u64, order: Ordering) {
                self.store(value, order)
            }
            fn compare_exchange(&self, current: u64, new: u64, ok: Ordering, fail: Ordering) -> Result<u64, u64> {
                self.compare_exchange(current, new, ok, fail)
            }
        }
    };
}

word!(std::sync::atomic::AtomicU64);

/// The data half pipeline step `steps` uses.
pub(crate) fn half(steps: u64) -> usize {
    (steps % 2) as usize
}

/// Writes a half's call header; published by the next [`publish`].
pub(crate) fn write_head<W: Word, const N: usize>(slot: &[W; N], words: [u64; N]) {
    slot.iter().zip(words).for_each(|(a, w)| a.store(w, Ordering::Relaxed));
}

/// Reads a peer's call header of a half whose stage [`first_behind`] saw completed.
pub(crate) fn read_head<W: Word, const N: usize>(slot: &[W; N]) -> [u64; N] {
    slot.each_ref().map(|a| a.load(Ordering::Relaxed))
}

/// Publishes that this member completed stage `phase`: what it wrote before is visible to any
/// member that sees the stage.
pub(crate) fn publish<W: Word>(counter: &W, phase: u64) {
    counter.store(phase, Ordering::Release);
}

/// The first member from `from` on (this one, `me`, skipped) that has not completed stage
/// `target`, or `n` when every member has.
pub(crate) fn first_behind<'a, W: Word + 'a>(
    counter: impl Fn(usize) -> &'a W,
    (n, me): (usize, usize),
    from: usize,
    target: u64,
) -> usize {
    (from..n).find(|&q| q != me && counter(q).load(Ordering::Acquire) < target).unwrap_or(n)
}

/// Whether a member dropped its communicator before completing stage `target`. The stage is read
/// again after the flag: a member publishes its last stage before it closes, so one seen behind
/// and then closed may have completed the stage in between (its job done, no failure).
pub(crate) fn closed_behind<W: Word>(counter: &W, flag: &W, target: u64) -> bool {
    flag.load(Ordering::Acquire) != 0 && counter.load(Ordering::Acquire) < target
}

/// Marks this member's communicator dropped.
pub(crate) fn close<W: Word>(flag: &W) {
    flag.store(1, Ordering::Release);
}

/// Records `word` as the group's failure unless one was recorded first; returns the failure that
/// holds.
pub(crate) fn record_abort<W: Word>(abort: &W, word: u64) -> u64 {
    match abort.compare_exchange(0, word, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => word,
        Err(first) => first,
    }
}

/// The group's failure word (0: none).
pub(crate) fn read_abort<W: Word>(abort: &W) -> u64 {
    abort.load(Ordering::Acquire)
}

/// A loom model of the group: members as loom threads, every control word a loom atomic, every
/// data element a loom cell (whose accesses loom checks for races under the protocol's orderings).
/// Each member runs the transport's two-stage all-reduce (write its half, stage, reduce its share
/// in every member's half, stage, read its half back, next half) through the functions above.
#[cfg(test)]
mod model {
    use loom::cell::UnsafeCell;
    use loom::sync::Arc;
    use loom::sync::atomic::AtomicU64;

    use super::*;

    word!(AtomicU64);

    /// The mapping: the abort word, each member's control words, and each member's two halves of
    /// `n` elements (one per member's share).
    struct Group {
        n: usize,
        abort: AtomicU64,
        phase: Vec<AtomicU64>,
        closed: Vec<AtomicU64>,
        call: Vec<[[AtomicU64; 4]; 2]>,
        halves: Vec<[Vec<UnsafeCell<u64>>; 2]>,
    }

    impl Group {
        fn new(n: usize) -> Arc<Group> {
            let words = |_| AtomicU64::new(0);
            let half = || (0..n).map(|_| UnsafeCell::new(0)).collect::<Vec<_>>();
            Arc::new(Group {
                n,
                abort: AtomicU64::new(0),
                phase: (0..n).map(words).collect(),
                closed: (0..n).map(words).collect(),
                call: (0..n).map(|_| std::array::from_fn(|_| std::array::from_fn(words))).collect(),
                halves: (0..n).map(|_| [half(), half()]).collect(),
            })
        }
    }

    fn get(c: &UnsafeCell<u64>) -> u64 {
        // SAFETY: loom checks this read against every other access of the cell.
        c.with(|p| unsafe { *p })
    }

    fn set(c: &UnsafeCell<u64>, v: u64) {
        // SAFETY: loom checks this write against every other access of the cell.
        c.with_mut(|p| unsafe { *p = v })
    }

    /// One member: its rank, stages completed and pipeline steps taken.
    struct Member {
        g: Arc<Group>,
        rank: usize,
        phase: u64,
        steps: u64,
    }

    impl Member {
        fn new(g: &Arc<Group>, rank: usize) -> Member {
            Member { g: g.clone(), rank, phase: 0, steps: 0 }
        }

        /// Publishes the next stage (with the call header `seq` when given) and waits for every
        /// member's, or fails naming a closed member (recorded in the abort word) or the failure
        /// already recorded there.
        fn stage(&mut self, seq: Option<u64>) -> Result<(), u64> {
            let (g, h) = (&self.g, half(self.steps));
            if let Some(s) = seq {
                write_head(&g.call[self.rank][h], [s, 1, 0, g.n as u64]);
            }
            self.phase += 1;
            publish(&g.phase[self.rank], self.phase);
            let mut next = 0;
            loop {
                next = first_behind(|q| &g.phase[q], (g.n, self.rank), next, self.phase);
                if next == g.n {
                    break;
                }
                let failed = read_abort(&g.abort);
                if failed != 0 {
                    return Err(failed);
                }
                if closed_behind(&g.phase[next], &g.closed[next], self.phase) {
                    return Err(record_abort(&g.abort, next as u64 + 1));
                }
                loom::thread::yield_now();
            }
            if let Some(s) = seq {
                for q in 0..g.n {
                    assert_eq!(read_head(&g.call[q][h])[0], s, "rank {} read a stale header of rank {q}", self.rank);
                }
            }
            Ok(())
        }

        /// The two-stage all-reduce of `mine` (one value per element), call number `seq`.
        fn all_reduce(&mut self, seq: u64, mine: u64) -> Result<Vec<u64>, u64> {
            let (g, h) = (self.g.clone(), half(self.steps));
            g.halves[self.rank][h].iter().for_each(|c| set(c, mine));
            self.stage(Some(seq))?;
            // Our share: element `rank` of every half, summed and written back into each.
            let sum: u64 = (0..g.n).map(|q| get(&g.halves[q][h][self.rank])).sum();
            (0..g.n).for_each(|q| set(&g.halves[q][h][self.rank], sum));
            self.stage(None)?;
            let out = g.halves[self.rank][h].iter().map(get).collect();
            self.steps += 1;
            Ok(out)
        }
    }

    fn bounded(preemptions: usize) -> loom::model::Builder {
        let mut b = loom::model::Builder::new();
        b.preemption_bound = Some(preemptions);
        // Waiting members yield in a loop: each yield is a branch.
        b.max_branches = 100_000;
        b
    }

    /// Members arriving in any order, three calls each: the third reuses the first call's half,
    /// which no member may write while another still reads it (loom fails the model on a race).
    #[test]
    fn every_member_gets_the_sum_and_a_half_is_reused_only_after_its_readers() {
        bounded(2).check(|| {
            let g = Group::new(2);
            let run = |rank: usize| {
                let mut m = Member::new(&g, rank);
                (0..3).map(|seq| m.all_reduce(seq, 10 * seq + rank as u64 + 1).unwrap()).collect::<Vec<_>>()
            };
            let other = loom::thread::spawn({
                let g = g.clone();
                move || {
                    let mut m = Member::new(&g, 1);
                    (0..3).map(|seq| m.all_reduce(seq, 10 * seq + 2).unwrap()).collect::<Vec<_>>()
                }
            });
            let (ours, theirs) = (run(0), other.join().unwrap());
            for (seq, r) in ours.iter().chain(&theirs).enumerate().map(|(i, r)| (i as u64 % 3, r)) {
                assert_eq!(r, &vec![20 * seq + 3; 2], "call {seq}");
            }
        });
    }

    /// How far a dying member gets into its second call before it drops its communicator.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Death {
        /// Before it writes anything.
        AtEntry,
        /// After publishing its data (stage 1), before reducing its share.
        AfterData,
        /// After reducing its share in every half, before publishing stage 2.
        AfterReduce,
        /// After the whole call: a member that leaves once done is not a failure of that call.
        AfterCall,
    }

    /// Member 1 completes a first call, then dies at `death` in the second (closing its
    /// communicator, as a member that unwinds does). Returns member 0's second call.
    fn second_call_with_member_one_dying(death: Death) -> Result<Vec<u64>, u64> {
        let g = Group::new(2);
        let other = loom::thread::spawn({
            let g = g.clone();
            move || {
                let mut m = Member::new(&g, 1);
                assert_eq!(m.all_reduce(0, 2).unwrap(), vec![3, 3]);
                let h = half(m.steps);
                match death {
                    Death::AtEntry => {}
                    Death::AfterData | Death::AfterReduce => {
                        g.halves[1][h].iter().for_each(|c| set(c, 12));
                        write_head(&g.call[1][h], [1, 1, 0, 2]);
                        m.phase += 1;
                        publish(&g.phase[1], m.phase);
                    }
                    Death::AfterCall => {
                        m.all_reduce(1, 12).unwrap();
                    }
                }
                if death == Death::AfterReduce {
                    // Its share needs member 0's data: wait for stage 1 like the transport does.
                    while first_behind(|q| &g.phase[q], (2, 1), 0, m.phase) < 2 {
                        loom::thread::yield_now();
                    }
                    let sum = get(&g.halves[0][h][1]) + get(&g.halves[1][h][1]);
                    (0..2).for_each(|q| set(&g.halves[q][h][1], sum));
                }
                close(&g.closed[1]);
            }
        });
        let mut m = Member::new(&g, 0);
        assert_eq!(m.all_reduce(0, 1).unwrap(), vec![3, 3]);
        let second = m.all_reduce(1, 11);
        other.join().unwrap();
        second
    }

    /// A member dying at any point of a call fails the survivor's call naming it (and recording it
    /// as the group's failure), never hangs it and never hands it a partial sum.
    #[test]
    fn a_member_dying_mid_reduce_fails_the_call_naming_it_and_never_a_partial_sum() {
        for death in [Death::AtEntry, Death::AfterData, Death::AfterReduce] {
            bounded(2).check(move || {
                assert_eq!(second_call_with_member_one_dying(death), Err(2), "{death:?}");
            });
        }
    }

    /// Regression: a waiter read a member's stage behind, then its closed flag set, and failed the
    /// call, though the member had published the stage in between and closed with its job done.
    #[test]
    fn a_member_that_closes_right_after_its_last_stage_is_not_blamed() {
        bounded(2).check(|| {
            assert_eq!(second_call_with_member_one_dying(Death::AfterCall), Ok(vec![23, 23]));
        });
    }

    /// Two members recording different failures at once: both read the first one recorded.
    #[test]
    fn concurrent_failures_agree_on_the_first() {
        loom::model(|| {
            let g = Group::new(2);
            let other = loom::thread::spawn({
                let g = g.clone();
                move || record_abort(&g.abort, 7)
            });
            let ours = record_abort(&g.abort, 5);
            let theirs = other.join().unwrap();
            assert_eq!(ours, theirs);
            assert_eq!(read_abort(&g.abort), ours);
        });
    }
}
