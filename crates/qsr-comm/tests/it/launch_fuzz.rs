//! Property tests over the launch parsers: no input makes them panic. (The wire protocol's
//! decoders have theirs beside them, in qsr-comm's `wire/fuzz.rs`.)

use proptest::prelude::*;
use qsr_comm::{Explicit, detect, first_host};

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, rng_seed: proptest::test_runner::RngSeed::Fixed(0x5152), ..ProptestConfig::default() })]

    #[test]
    fn launch_parsing_never_panics(list in "[a-z0-9\\[\\],-]{0,30}", rank in "[0-9a-z-]{0,6}", size in "[0-9]{0,4}", port in "[0-9]{0,6}") {
        let _ = first_host(&list);
        let env = move |k: &str| match k {
            "SLURM_PROCID" => Some(rank.clone()),
            "SLURM_NTASKS" => Some(size.clone()),
            "SLURM_NODELIST" => Some(list.clone()),
            "MASTER_PORT" => Some(port.clone()),
            _ => None,
        };
        if let Ok(e) = detect(&Explicit::default(), &env) {
            prop_assert!(e.rank < e.world_size && e.local_rank < e.world_size);
        }
    }
}
