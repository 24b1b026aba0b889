//! f64 values a resume needs bit for bit, in a saved state's JSON, whatever serde_json's float parser:
//! its exact one is the `float_roundtrip` feature, which a burn program does not have (and which would
//! rebuild burn if qsr turned it on). Written as the shortest text Rust parses back exactly (`NaN` and
//! `inf` included); a JSON number, as older states hold, still reads.

use serde::de::Error;
use serde::{Deserialize, Deserializer, Serializer};

/// What a saved f64 may be: text (now) or a JSON number (older states).
#[derive(Deserialize)]
#[serde(untagged)]
enum Saved {
    Text(String),
    Number(f64),
}

impl Saved {
    fn value<E: Error>(self) -> Result<f64, E> {
        match self {
            Saved::Text(t) => t.parse().map_err(|e| E::custom(format!("not a number `{t}`: {e}"))),
            Saved::Number(v) => Ok(v),
        }
    }
}

/// `#[serde(with = "crate::exact")]` for an `f64`.
pub(crate) fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&format_args!("{v:?}"))
}

/// See [`serialize`].
pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Saved::deserialize(d)?.value()
}

/// `#[serde(with = "crate::exact::option")]` for an `Option<f64>`.
pub(crate) mod option {
    use super::*;

    pub(crate) fn serialize<S: Serializer>(v: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(v) => super::serialize(v, s),
            None => s.serialize_none(),
        }
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
        Option::<Saved>::deserialize(d)?.map(Saved::value).transpose()
    }
}

/// `#[serde(with = "crate::exact::step_and")]` for an `Option<(u64, f64)>`: a step and its value.
pub(crate) mod step_and {
    use super::*;
    use serde::Serialize;

    pub(crate) fn serialize<S: Serializer>(v: &Option<(u64, f64)>, s: S) -> Result<S::Ok, S::Error> {
        v.map(|(step, x)| (step, format!("{x:?}"))).serialize(s)
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<(u64, f64)>, D::Error> {
        Option::<(u64, Saved)>::deserialize(d)?.map(|(step, x)| Ok((step, x.value()?))).transpose()
    }
}

#[cfg(test)]
mod tests {
    use serde::{Deserialize, Serialize};

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Held {
        #[serde(with = "crate::exact")]
        x: f64,
        #[serde(with = "crate::exact::option")]
        first: Option<f64>,
        #[serde(with = "crate::exact::step_and")]
        low: Option<(u64, f64)>,
    }

    /// Regression (issue 57): without serde_json's `float_roundtrip` a parsed f64 may be one unit in
    /// the last place off; text through Rust's parser is exact for every value, NaN and infinities too.
    #[test]
    fn saved_floats_come_back_bit_for_bit() {
        let mut x = 0x3fb9_9999_9999_999a_u64; // 0.1
        let values = (0..2000).map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            f64::from_bits(x)
        });
        for v in values.chain([0.0, -0.0, f64::NAN, f64::INFINITY, f64::MIN_POSITIVE, 0.04281596297313014]) {
            let held = Held { x: v, first: Some(v), low: Some((7, v)) };
            let back: Held = serde_json::from_value(serde_json::to_value(&held).unwrap()).unwrap();
            // Every bit, but a NaN's payload: a NaN comes back as NaN.
            let same = |x: f64| x.to_bits() == v.to_bits() || (x.is_nan() && v.is_nan());
            assert!(same(back.x), "{v:e} came back as {:e}", back.x);
            assert!(back.first.is_some_and(same) && back.low.is_some_and(|(s, x)| s == 7 && same(x)), "{v:e}");
        }
    }

    #[test]
    fn numbers_of_older_states_still_read() {
        let old = serde_json::json!({ "x": 0.25, "first": null, "low": [3, 0.5] });
        let held: Held = serde_json::from_value(old).unwrap();
        assert_eq!(held, Held { x: 0.25, first: None, low: Some((3, 0.5)) });
    }
}
