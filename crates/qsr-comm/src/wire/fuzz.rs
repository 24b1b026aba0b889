//! Property tests over the frame and handshake decoders: no input makes them panic, lengths are
//! bounded, and valid messages round-trip.

use proptest::prelude::*;

use super::{self as wire, Back, CallHeader, Field, Frame, Hello, Purpose, Reply};

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, rng_seed: proptest::test_runner::RngSeed::Fixed(0x5152), ..ProptestConfig::default() })]

    #[test]
    fn decoders_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600), entries in 0usize..8) {
        let _ = Hello::decode(&bytes);
        let _ = Hello::decode_body(1, &bytes);
        let _ = Reply::decode(&bytes, entries);
        let _ = Reply::decode_body(&bytes, entries);
        let _ = CallHeader::decode(&bytes);
        let _ = Frame::decode(&bytes);
        let _ = Back::decode(&bytes);
        if let Ok(p) = wire::decode_prefix(&bytes, &wire::HELLO_MAGIC, wire::MAX_HELLO_BODY) {
            prop_assert!(p.body_len <= wire::MAX_HELLO_BODY);
        }
        if let Ok(Reply::Accepted { table }) = Reply::decode_body(&bytes, entries) {
            prop_assert!(table.len() <= entries);
        }
    }

    #[test]
    fn corrupted_valid_messages_never_panic(
        token in proptest::collection::vec(any::<u8>(), 0..64),
        host in "[a-z0-9.-]{0,40}",
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6),
        cut in any::<usize>(),
    ) {
        let h = Hello { version: wire::PROTOCOL_VERSION, purpose: Purpose::Ring, world_size: 9, rank: 4, token, host: host.clone(), port: 7, generation: 3 };
        let good = h.encode();
        prop_assert_eq!(Hello::decode(&good), Ok(h));
        let reply = Reply::Accepted { table: vec![(host, 1), ("x".into(), 2)] };
        prop_assert_eq!(Reply::decode(&reply.encode(), 2), Ok(reply.clone()));
        for msg in [good, reply.encode(), Reply::Refused { field: Field::Rank, message: "m".into() }.encode()] {
            let mut bad = msg.clone();
            for (at, x) in &flips {
                let i = at % bad.len();
                bad[i] ^= x | 1;
            }
            let _ = Hello::decode(&bad);
            let _ = Reply::decode(&bad, 2);
            let _ = Hello::decode(&msg[..cut % msg.len()]);
            let _ = Reply::decode(&msg[..cut % msg.len()], 2);
        }
    }

    #[test]
    fn call_header_and_frames_roundtrip(kind in 1u8..=5, op in prop_oneof![Just(0u8), Just(1), Just(0xff)], chunk in 1u16.., root: u32, seq: u64, len: u64, sender: u32, a: u32, b: u64, tag: Option<(u64, u64, u32)>) {
        let tag = tag.map(|(steps, h, fragment)| crate::SyncTag { steps, h, fragment });
        let h = CallHeader { kind, op, chunk, root, seq, len, sender, tag };
        prop_assert_eq!(CallHeader::decode(&h.encode()), Ok(h));
        for f in [Frame::Data { len: a, block: b }, Frame::Abort { culprit: a, reason: b }] {
            prop_assert_eq!(Frame::decode(&f.encode()), Ok(f));
        }
        let m = Back::Abort { culprit: a, reason: a ^ 1 };
        prop_assert_eq!(Back::decode(&m.encode()), Ok(m));
    }
}
