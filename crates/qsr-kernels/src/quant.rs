//! Compressed sync payloads: one byte per value (int8, or fp8 e4m3), half a byte (int4) or a quarter
//! (int2), and one f32 scale per block of values; and error feedback, which carries what quantization
//! dropped into the next payload.
//!
//! Every function is deterministic (no thread-dependent order): a payload decodes to the same f32
//! values on every rank. Decoding adds into an f32 buffer ([`Quantized::add_into`]), so a collective
//! can accumulate payloads in f32 at every hop.

/// How a payload stores each value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    /// A signed byte in `-127..=127` times the block's scale (`max |x| / 127`), rounded to nearest,
    /// ties to even.
    Int8,
    /// An fp8 e4m3 number (OCP's E4M3FN: 4 exponent bits, 3 mantissa bits, largest 448, no infinity)
    /// times the block's scale (`max |x| / 448`), rounded to nearest, ties to even.
    Fp8E4m3,
    /// A signed 4-bit code in `-7..=7` times the block's scale (`max |x| / 7`), rounded to nearest,
    /// ties to even; two codes per byte.
    Int4,
    /// A 2-bit code for one of the four levels `-1.5, -0.5, 0.5, 1.5` times the block's scale
    /// (`max |x| / 1.5`), the nearest (ties to the even code); four codes per byte. No level is zero: at
    /// two bits all four codes carry a magnitude, and error feedback carries what they miss.
    Int2,
}

impl Codec {
    /// Bits of one value's code.
    pub fn bits(self) -> usize {
        match self {
            Codec::Int8 | Codec::Fp8E4m3 => 8,
            Codec::Int4 => 4,
            Codec::Int2 => 2,
        }
    }

    /// Bytes on the wire of a block of `values` values: its scale and the codes, packed.
    pub fn block_bytes_of(self, values: usize) -> usize {
        4 + (values * self.bits()).div_ceil(8)
    }

    /// Bytes on the wire of a full block of [`WIRE_BLOCK`] values (68 for int8 and fp8, 36 for int4,
    /// 20 for int2).
    pub fn block_bytes(self) -> usize {
        self.block_bytes_of(WIRE_BLOCK)
    }

    /// The largest magnitude a code holds, which the block's largest value is scaled to.
    fn max_code_value(self) -> f32 {
        match self {
            Codec::Int8 => 127.0,
            Codec::Fp8E4m3 => 448.0,
            Codec::Int4 => 7.0,
            Codec::Int2 => 1.5,
        }
    }

    /// The code of `v` (in units of the block's scale), in the low `bits` of a byte.
    fn encode(self, v: f32) -> u8 {
        match self {
            Codec::Int8 => round_ties_even(v).clamp(-127.0, 127.0) as i8 as u8,
            Codec::Fp8E4m3 => fp8_encode(v),
            Codec::Int4 => round_ties_even(v).clamp(-7.0, 7.0) as i8 as u8 & 0x0f,
            Codec::Int2 => round_ties_even(v + 1.5).clamp(0.0, 3.0) as u8,
        }
    }

    /// Writes `values` as one block: their scale, then one byte each into `codes`; returns the scale.
    /// A block holding a non-finite value gets a NaN scale, so it decodes to NaN rather than to
    /// numbers (a diverged worker stays visible after a sync).
    fn encode_block(self, values: &[f32], codes: &mut [u8]) -> f32 {
        // The largest magnitude from the bits, one integer pass that vectorizes: a NaN's bits lie
        // above infinity's, so both show as a maximum of at least infinity's.
        let max_bits = values.iter().fold(0u32, |m, v| m.max(v.to_bits() & 0x7fff_ffff));
        let scale = if max_bits >= f32::INFINITY.to_bits() {
            f32::NAN
        } else {
            f32::from_bits(max_bits) / self.max_code_value()
        };
        let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        if inv.is_finite() {
            self.encode_each(values, codes, |v| v * inv);
        } else {
            // A subnormal scale (a block of values below ~1e-36) has no finite inverse: divide.
            self.encode_each(values, codes, |v| v / scale);
        }
        scale
    }

    /// The code of each `scaled(value)`, the codec chosen once, outside the loop: a loop per codec
    /// vectorizes, a match per value does not (the ring's every hop runs it).
    fn encode_each(self, values: &[f32], codes: &mut [u8], scaled: impl Fn(f32) -> f32) {
        fn each(values: &[f32], codes: &mut [u8], code: impl Fn(f32) -> u8) {
            codes.iter_mut().zip(values).for_each(|(c, &v)| *c = code(v));
        }
        match self {
            Codec::Int8 => each(values, codes, |v| Codec::Int8.encode(scaled(v))),
            Codec::Fp8E4m3 => each(values, codes, |v| Codec::Fp8E4m3.encode(scaled(v))),
            Codec::Int4 => each(values, codes, |v| Codec::Int4.encode(scaled(v))),
            Codec::Int2 => each(values, codes, |v| Codec::Int2.encode(scaled(v))),
        }
    }

    /// `out = decode(codes) * scale`, the codec chosen once, outside the loop.
    fn decode_each(self, codes: &[u8], out: &mut [f32], scale: f32) {
        fn each(codes: &[u8], out: &mut [f32], value: impl Fn(u8) -> f32) {
            out.iter_mut().zip(codes).for_each(|(o, &c)| *o = value(c));
        }
        match self {
            Codec::Int8 => each(codes, out, |c| Codec::Int8.decode(c) * scale),
            Codec::Fp8E4m3 => each(codes, out, |c| Codec::Fp8E4m3.decode(c) * scale),
            Codec::Int4 => each(codes, out, |c| Codec::Int4.decode(c) * scale),
            Codec::Int2 => each(codes, out, |c| Codec::Int2.decode(c) * scale),
        }
    }

    /// Writes `values` as one block of the collectives' payload: the scale as 4 little-endian bytes,
    /// then the codes, packed (`out` holds [`Codec::block_bytes_of`]`(values.len())` bytes; codes below
    /// 8 bits fill each byte from its low bits, the first value lowest).
    ///
    /// # Panics
    ///
    /// If `out` has another length, or a codec below 8 bits gets more than [`WIRE_BLOCK`] values.
    pub fn put_block(self, values: &[f32], out: &mut [u8]) {
        assert_eq!(out.len(), self.block_bytes_of(values.len()), "Codec::put_block: length mismatch");
        let (head, packed) = out.split_at_mut(4);
        let scale = if self.bits() == 8 {
            self.encode_block(values, packed)
        } else {
            let mut codes = [0u8; WIRE_BLOCK];
            let codes = &mut codes[..values.len()];
            let scale = self.encode_block(values, codes);
            let per_byte = 8 / self.bits();
            for (byte, codes) in packed.iter_mut().zip(codes.chunks(per_byte)) {
                *byte = codes.iter().enumerate().fold(0, |b, (i, &c)| b | c << (i * self.bits()));
            }
            scale
        };
        head.copy_from_slice(&scale.to_le_bytes());
    }

    /// The values of a block written by [`Codec::put_block`], into `out`.
    ///
    /// # Panics
    ///
    /// If `bytes` does not hold [`Codec::block_bytes_of`]`(out.len())` bytes.
    pub fn get_block(self, bytes: &[u8], out: &mut [f32]) {
        assert_eq!(bytes.len(), self.block_bytes_of(out.len()), "Codec::get_block: length mismatch");
        let scale = f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        let (bits, packed) = (self.bits(), &bytes[4..]);
        if bits == 8 {
            return self.decode_each(packed, out, scale);
        }
        // Unpacked a block at a time, then decoded as the byte codecs are.
        let (mask, per_byte) = (((1u16 << bits) - 1) as u8, 8 / bits);
        let mut codes = [0u8; WIRE_BLOCK];
        for (out, packed) in out.chunks_mut(WIRE_BLOCK).zip(packed.chunks(WIRE_BLOCK / per_byte)) {
            let codes = &mut codes[..out.len()];
            for (i, c) in codes.iter_mut().enumerate() {
                *c = packed[i / per_byte] >> (i % per_byte * bits) & mask;
            }
            self.decode_each(codes, out, scale);
        }
    }

    /// `values` replaced by what one block of them decodes to: [`Codec::put_block`] then
    /// [`Codec::get_block`], the same bits, without the bytes (a hop of an in-memory collective).
    pub fn round_block(self, values: &mut [f32]) {
        let mut codes = [0u8; WIRE_BLOCK];
        for chunk in values.chunks_mut(WIRE_BLOCK) {
            let codes = &mut codes[..chunk.len()];
            let scale = self.encode_block(chunk, codes);
            self.decode_each(codes, chunk, scale);
        }
    }

    fn decode(self, code: u8) -> f32 {
        match self {
            Codec::Int8 => f32::from(code as i8),
            Codec::Fp8E4m3 => fp8_decode(code),
            // The nibble's sign bit moved to the byte's, shifted back with the sign.
            Codec::Int4 => f32::from((code << 4) as i8 >> 4),
            Codec::Int2 => f32::from(code) - 1.5,
        }
    }
}

/// Values per scale in the collectives' compressed payloads ([`Codec::put_block`]): one scale per 64
/// values is 1/16 byte per value, so an int8 payload is `1 + 4/64` bytes per value, 0.266 of f32 (int4
/// 0.141, int2 0.078).
pub const WIRE_BLOCK: usize = 64;

/// A quantized buffer: `len` values' codes (one per byte here, packed on the wire), and one f32
/// scale per `block` values.
#[derive(Debug, Clone, PartialEq)]
pub struct Quantized {
    codec: Codec,
    block: usize,
    bytes: Vec<u8>,
    scales: Vec<f32>,
}

impl Quantized {
    /// `values` in `codec`, with one scale per `block` values (the last block may be shorter).
    ///
    /// # Panics
    ///
    /// If `block` is 0 (a programming error: the block size is a setting checked where it is read).
    pub fn encode(codec: Codec, values: &[f32], block: usize) -> Self {
        assert!(block > 0, "Quantized::encode: block must be at least 1");
        let mut bytes = vec![0; values.len()];
        let scales = values.chunks(block).zip(bytes.chunks_mut(block)).map(|(v, b)| codec.encode_block(v, b)).collect();
        Self { codec, block, bytes, scales }
    }

    /// How many values the payload holds.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Whether the payload holds no values.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Bytes on the wire: each block's scale and its codes, packed.
    pub fn wire_bytes(&self) -> u64 {
        self.bytes.chunks(self.block).map(|b| self.codec.block_bytes_of(b.len()) as u64).sum()
    }

    /// `acc += decoded payload`, in f32.
    ///
    /// # Panics
    ///
    /// If `acc` does not hold [`Quantized::len`] values.
    pub fn add_into(&self, acc: &mut [f32]) {
        assert_eq!(acc.len(), self.bytes.len(), "Quantized::add_into: length mismatch");
        for ((acc, bytes), &scale) in acc.chunks_mut(self.block).zip(self.bytes.chunks(self.block)).zip(&self.scales) {
            for (a, &b) in acc.iter_mut().zip(bytes) {
                *a += self.codec.decode(b) * scale;
            }
        }
    }

    /// The decoded values.
    pub fn decode(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.bytes.len()];
        self.add_into(&mut out);
        out
    }
}

/// Error feedback for one worker's payloads: each payload quantizes the update plus what earlier
/// payloads dropped, and keeps what this one drops, so the sum of the decoded payloads follows the sum
/// of the updates to within one payload's rounding.
#[derive(Debug, Clone, PartialEq)]
pub struct ErrorFeedback {
    codec: Codec,
    block: usize,
    residual: Vec<f32>,
}

impl ErrorFeedback {
    /// Feedback for updates of `len` values, quantized by `codec` in blocks of `block`.
    pub fn new(codec: Codec, block: usize, len: usize) -> Self {
        Self { codec, block, residual: vec![0.0; len] }
    }

    /// The payload of `update` plus the carried residual; the residual becomes what it drops.
    ///
    /// # Panics
    ///
    /// If `update` does not have the length the feedback was made for.
    pub fn compress(&mut self, update: &[f32]) -> Quantized {
        assert_eq!(update.len(), self.residual.len(), "ErrorFeedback::compress: length mismatch");
        self.residual.iter_mut().zip(update).for_each(|(r, u)| *r += u);
        let payload = Quantized::encode(self.codec, &self.residual, self.block);
        let mut decoded = vec![0.0; update.len()];
        payload.add_into(&mut decoded);
        self.residual.iter_mut().zip(decoded).for_each(|(r, d)| *r -= d);
        payload
    }

    /// What the payloads so far have dropped (the next payload adds it).
    pub fn residual(&self) -> &[f32] {
        &self.residual
    }
}

/// `x` rounded to the nearest integer, ties to even, for `|x| <= 2^22` (larger values come back
/// unchanged or off by their own rounding; the codes clamp them): adding and subtracting 1.5 * 2^23
/// leaves no fraction bits. Two f32 operations that vectorize, where `f32::round` is a libm call on the
/// baseline x86-64 target.
fn round_ties_even(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (x + MAGIC) - MAGIC
}

/// The value of an fp8 e4m3 byte: sign, 4 exponent bits (bias 7), 3 mantissa bits; `0x7f` and `0xff`
/// are NaN, exponent 0 is subnormal.
pub fn fp8_decode(byte: u8) -> f32 {
    let sign = if byte & 0x80 != 0 { -1.0 } else { 1.0 };
    let (exponent, mantissa) = (i32::from((byte >> 3) & 0x0f), f32::from(byte & 0x07));
    if byte & 0x7f == 0x7f {
        return f32::NAN;
    }
    let magnitude = match exponent {
        0 => mantissa / 8.0 * 2f32.powi(-6),
        e => (1.0 + mantissa / 8.0) * 2f32.powi(e - 7),
    };
    sign * magnitude
}

/// `v` as the nearest fp8 e4m3 byte (ties to an even mantissa), magnitudes above 448 saturated to
/// 448 and NaN to 0.
pub fn fp8_encode(v: f32) -> u8 {
    if v.is_nan() {
        return 0;
    }
    let bits = v.to_bits();
    let sign = (bits >> 24) as u8 & 0x80;
    let a = bits & 0x7fff_ffff;
    // Below 2^-6 (the smallest normal) the codes are multiples of 2^-9: code = round(|v| * 2^9).
    if a < 0x3c80_0000 {
        return sign | round_ties_even(f32::from_bits(a) * 512.0) as u8;
    }
    // A normal: f32's exponent and top 3 mantissa bits, rounded to nearest even at the 20 bits below
    // them (a carry moves to the next exponent), rebiased from 127 to 7; above 448 saturates.
    let rounded = (a + 0x7_ffff + ((a >> 20) & 1)) >> 20;
    sign | rounded.saturating_sub(120 << 3).min(0x7e) as u8
}
