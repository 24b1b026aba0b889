//! Compressed payloads: int8, fp8 e4m3, int4 and int2 with per-block scales, and error feedback.

use qsr_kernels::{Codec, ErrorFeedback, Quantized, fp8_decode, fp8_encode};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn normal_values(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| (rng.random::<f32>() - 0.5) * 4.0 * rng.random::<f32>()).collect()
}

#[test]
fn int8_round_trip_is_within_half_a_step_of_each_blocks_scale() {
    let block = 64;
    let values = normal_values(1_000, 1);
    let q = Quantized::encode(Codec::Int8, &values, block);
    let decoded = q.decode();
    for (chunk, (dec, i)) in values.chunks(block).zip(decoded.chunks(block).zip(0..)) {
        let step = chunk.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0;
        for (x, y) in chunk.iter().zip(dec) {
            assert!((x - y).abs() <= step * 0.5001 + f32::EPSILON, "block {i}: {x} decoded as {y} (step {step})");
        }
    }
    // A block's largest value survives exactly up to its scale's rounding.
    let max = values.iter().take(block).fold(0.0f32, |m, v| m.max(v.abs()));
    assert!(decoded.iter().take(block).any(|v| (v.abs() - max).abs() <= max * 1e-6));
}

/// int8 codes round to nearest with ties to even (a block whose largest value is 127 has scale 1).
#[test]
fn int8_rounds_to_the_nearest_code_ties_to_even() {
    let mut values = [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 3.49, -3.51, 126.5];
    Codec::Int8.round_block(&mut values);
    assert_eq!(values, [127.0, 0.0, 2.0, 2.0, -0.0, -2.0, 3.0, -4.0, 126.0]);
}

/// The bit-level fp8 encoder against a search for the nearest code (ties to the even code), around
/// every code: the codes, their midpoints and one ulp either side, subnormals, 448 and beyond, and a
/// seeded sweep of magnitudes from 2^-14 to 2^10.
#[test]
fn fp8_encode_is_the_nearest_code_ties_to_even() {
    let codes: Vec<f32> = (0..=0x7eu8).map(fp8_decode).collect();
    let nearest = |v: f32| -> u8 {
        let a = v.abs();
        let sign = if v.is_sign_negative() { 0x80 } else { 0 };
        if a >= 448.0 {
            return sign | 0x7e; // saturates (distances to huge values round to ties)
        }
        let best = (0..codes.len())
            .min_by(|&i, &j| {
                let (di, dj) = ((codes[i] - a).abs(), (codes[j] - a).abs());
                di.total_cmp(&dj).then((i % 2).cmp(&(j % 2)))
            })
            .unwrap() as u8;
        sign | best
    };
    let mut probes = vec![0.0, 1e-30, 1e-10, 1e-3, f32::MIN_POSITIVE, 448.0, 449.0, 464.0, 470.0, 1e6, f32::MAX];
    for w in codes.windows(2) {
        let mid = (w[0] + w[1]) / 2.0;
        probes.extend([w[0], mid.next_down(), mid, mid.next_up(), w[1]]);
    }
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    probes.extend((0..20_000).map(|_| 2f32.powf(rng.random_range(-14.0f32..10.0))));
    for a in probes {
        for v in [a, -a] {
            assert_eq!(fp8_encode(v), nearest(v), "{v:e}");
        }
    }
    assert_eq!((fp8_encode(f32::INFINITY), fp8_encode(f32::NEG_INFINITY), fp8_encode(f32::NAN)), (0x7e, 0xfe, 0));
}

#[test]
fn payload_bytes_are_one_per_value_plus_a_scale_per_block() {
    let q = Quantized::encode(Codec::Int8, &vec![1.0; 1_000], 64);
    assert_eq!(q.wire_bytes(), 1_000 + 4 * 16);
    // Against f32: 0.25 + 1 / block, 0.27 or less from blocks of 64.
    assert!(q.wire_bytes() as f64 <= 0.27 * 4.0 * 1_000.0);
    let zeros = Quantized::encode(Codec::Fp8E4m3, &[0.0; 10], 4);
    assert_eq!(zeros.decode(), vec![0.0; 10]);
    assert!(Quantized::encode(Codec::Int8, &[], 8).is_empty());
}

#[test]
fn fp8_e4m3_codes_match_the_format() {
    for (byte, value) in [(0x00, 0.0), (0x01, 2f32.powi(-9)), (0x08, 2f32.powi(-6)), (0x38, 1.0), (0x7e, 448.0)] {
        assert_eq!(fp8_decode(byte), value, "{byte:#04x}");
        assert_eq!(fp8_encode(value), byte, "{value}");
        assert_eq!(fp8_decode(byte | 0x80), -value, "{byte:#04x} negated");
    }
    assert!(fp8_decode(0x7f).is_nan() && fp8_decode(0xff).is_nan());
    // Saturation, and ties to the even mantissa: 1.0625 lies between 1.0 (0x38) and 1.125 (0x39),
    // 1.1875 between 1.125 and 1.25 (0x3a).
    assert_eq!(fp8_encode(1_000.0), 0x7e);
    assert_eq!(fp8_encode(-1_000.0), 0xfe);
    assert_eq!(fp8_encode(1.0625), 0x38);
    assert_eq!(fp8_encode(1.1875), 0x3a);
    assert_eq!((fp8_encode(1.05), fp8_encode(1.07)), (0x38, 0x39));
    // Every code decodes and encodes back to itself.
    for byte in (0u8..=0xff).filter(|b| b & 0x7f != 0x7f) {
        assert_eq!(fp8_encode(fp8_decode(byte)) & 0x7f, byte & 0x7f, "{byte:#04x}");
    }
}

#[test]
fn fp8_round_trip_keeps_three_mantissa_bits_relative_to_the_block() {
    let values = normal_values(512, 2);
    let decoded = Quantized::encode(Codec::Fp8E4m3, &values, 128).decode();
    for (chunk, dec) in values.chunks(128).zip(decoded.chunks(128)) {
        let max = chunk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for (x, y) in chunk.iter().zip(dec) {
            // Half a mantissa step (1/16 relative), or the subnormal step near zero.
            let bound = x.abs() / 16.0 + max / 448.0 * 2f32.powi(-10);
            assert!((x - y).abs() <= bound * 1.0001, "{x} decoded as {y}");
        }
    }
}

#[test]
fn error_feedback_keeps_the_long_run_sum_exact_within_f32_rounding() {
    for codec in ALL {
        let n = 300;
        let mut feedback = ErrorFeedback::new(codec, 64, n);
        let (mut sent, mut exact) = (vec![0.0f64; n], vec![0.0f64; n]);
        for step in 0..200 {
            let update = normal_values(n, 100 + step);
            feedback.compress(&update).decode().iter().zip(&mut sent).for_each(|(d, s)| *s += f64::from(*d));
            update.iter().zip(&mut exact).for_each(|(u, e)| *e += f64::from(*u));
        }
        // What was sent plus what is still held back is what was given, to f32 rounding.
        for ((s, e), r) in sent.iter().zip(&exact).zip(feedback.residual()) {
            assert!((s + f64::from(*r) - e).abs() <= 1e-3, "{codec:?}: {s} + {r} vs {e}");
        }
        // And what is held back is at most one payload's rounding, not the sum of 200 (int2's
        // coarse levels leave more, still far from 200 updates of up to 2).
        let held = feedback.residual().iter().fold(0.0f32, |m, r| m.max(r.abs()));
        let bound = if codec == Codec::Int2 { 4.0 } else { 0.5 };
        assert!(held < bound, "{codec:?}: residual {held}");
    }
}

/// Regression: a block whose largest value is below ~1e-36 has a subnormal scale whose inverse is
/// infinite, and every value decoded to the code's maximum. Such blocks now keep their values.
#[test]
fn a_block_of_tiny_values_keeps_them() {
    // Half a step of the block's scale: int8 1/127, fp8 about 1/16, int4 1/7, int2 1/1.5 of its largest.
    for (codec, half_step) in [(Codec::Int8, 0.07), (Codec::Fp8E4m3, 0.07), (Codec::Int4, 0.08), (Codec::Int2, 0.34)] {
        let values: Vec<f32> = (1..=64).map(|i| i as f32 * 1e-40).collect();
        let mut rounded = values.clone();
        codec.round_block(&mut rounded);
        for (v, r) in values.iter().zip(&rounded) {
            assert!(r.is_finite() && (r - v).abs() <= half_step * 64e-40, "{codec:?}: {v:e} -> {r:e}");
        }
    }
}

const ALL: [Codec; 4] = [Codec::Int8, Codec::Fp8E4m3, Codec::Int4, Codec::Int2];

/// A block's bytes on the wire: its scale and the packed codes (MuLoCo's 2 bits: 1/16 of f32 and the
/// scale).
#[test]
fn packed_blocks_hold_a_scale_and_bits_per_value() {
    let full: Vec<usize> = ALL.iter().map(|c| c.block_bytes()).collect();
    assert_eq!(full, [68, 68, 36, 20]);
    assert_eq!((Codec::Int4.block_bytes_of(3), Codec::Int2.block_bytes_of(5)), (6, 6));
    assert_eq!(Quantized::encode(Codec::Int2, &[1.0; 1_000], 64).wire_bytes(), 15 * 20 + 4 + 10);
}

/// What `put_block` packs, `get_block` unpacks to the values `round_block` gives, for whole and
/// partial blocks of every codec.
#[test]
fn packed_blocks_decode_to_the_rounded_values() {
    for codec in ALL {
        for n in [1, 3, 5, 63, 64] {
            let values = normal_values(n, n as u64);
            let mut bytes = vec![0u8; codec.block_bytes_of(n)];
            codec.put_block(&values, &mut bytes);
            let mut got = vec![0.0f32; n];
            codec.get_block(&bytes, &mut got);
            let mut rounded = values.clone();
            codec.round_block(&mut rounded);
            assert_eq!(got, rounded, "{codec:?}, {n} values");
        }
    }
}

/// int4 codes are the nearest of -7..=7 steps of `max / 7`; int2's the nearest of the four levels
/// ±0.5 and ±1.5 of `max / 1.5` (ties to the even code), so the block's largest survives.
#[test]
fn int4_and_int2_round_to_their_nearest_levels() {
    let mut int4 = [7.0, 0.5, 1.5, -2.5, 3.49, -6.6, 0.0];
    Codec::Int4.round_block(&mut int4);
    assert_eq!(int4, [7.0, 0.0, 2.0, -2.0, 3.0, -7.0, 0.0]);
    let mut int2 = [1.5, 1.1, 0.9, 0.2, 0.0, -0.2, -0.9, -1.5];
    Codec::Int2.round_block(&mut int2);
    assert_eq!(int2, [1.5, 1.5, 0.5, 0.5, 0.5, -0.5, -0.5, -1.5]);
    // A block of zeros stays zero: its scale is 0.
    let mut zeros = [0.0f32; 9];
    Codec::Int2.round_block(&mut zeros);
    assert_eq!(zeros, [0.0; 9]);
}
