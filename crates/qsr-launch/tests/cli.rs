//! The `qsr-launch` binary as a user runs it: ranks with torchrun's environment, the rank that
//! failed named, bad flags refused.

use std::process::Command;

fn qsr_launch(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_qsr-launch")).args(args).env_remove("QSR_JOB_TOKEN").output().unwrap()
}

#[test]
fn ranks_get_torchruns_environment_and_their_lines_are_prefixed() {
    let out = qsr_launch(&["--nproc", "2", "--", "sh", "-c", "echo rank $RANK of $WORLD_SIZE local $LOCAL_RANK"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for r in 0..2 {
        assert!(stdout.contains(&format!("[rank {r}] rank {r} of 2 local {r}")), "{stdout}");
    }
}

#[test]
fn the_rank_that_failed_is_named_with_its_status() {
    let out = qsr_launch(&["--nproc", "2", "--", "sh", "-c", "[ $RANK = 1 ] && exit 7; sleep 30"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(7), "{stderr}");
    assert!(stderr.contains("rank 1 failed (exit status 7"), "{stderr}");
}

/// The fifth trial: ranks whose `main` returned their error (`try_run_workers`) all exit 1, and the
/// launcher named rank 0, which only lost rank 2. A rank's failure record that says it lost a peer
/// counts as such whatever its status: rank 2, which failed later for its own reason, is named.
#[test]
fn a_rank_whose_record_says_it_lost_a_peer_is_not_named_whatever_its_status() {
    let script = r#"if [ $RANK = 2 ]; then sleep 1; exit 1; fi
        echo '{"blames":2,"peer_failed":true,"message":"lost rank 2"}' > "$QSR_FAILURE_FILE"; exit 1"#;
    let out = qsr_launch(&["--nproc", "3", "--", "sh", "-c", script]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("rank 2 failed (exit status 1"), "{stderr}");
    assert!(stderr.contains("1 of 3 workers failed, 2 stopped because of it"), "{stderr}");
}

#[test]
fn flags_that_cannot_work_are_refused_with_status_2() {
    let out = qsr_launch(&["--nproc", "0", "--", "true"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--nproc 0: must be in 1..=1024"), "{stderr}");
}
