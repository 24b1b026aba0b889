//! The sync engine's state, one type for every face: what continues a run beside a replica's
//! parameters and optimizer state. The [`Averager`](crate::Averager)'s saved state, the
//! [`Worker`](crate::Worker)'s [`Snapshot`](crate::Snapshot) and the trainer's checkpoint hold it.

use std::collections::HashMap;

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde::{Deserialize, Serialize};

use crate::error::OptimError;
use crate::outer::InnerRound;
use crate::stream::{InFlight, StreamState};

/// The sync engine's state: DiLoCo's outer optimizer, a streaming worker's averages in flight and
/// error-feedback residual, and the inner steps since the last global parameter sync. Serialized
/// with serde (the [`AveragerState`](crate::AveragerState) JSON carries its fields at its top level).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SyncState {
    /// The outer optimizer's global parameters and momentum.
    #[serde(default)]
    pub(crate) outer: Option<OuterState>,
    /// Streaming: the averages in flight and the error-feedback residual.
    #[serde(default)]
    pub(crate) stream: Option<StreamState>,
    /// The steps and their summed lr since the last global sync, for an outer step per inner step.
    #[serde(default)]
    pub(crate) inner_round: InnerRound,
    /// The fingerprint of the last global average, to be sent with the next (`driver.fingerprint`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) fingerprint: Option<Fingerprint>,
}

/// The fingerprint of the parameters after a global average, which every rank holds the same: a
/// 64-bit checksum of their bits as 11 digits of 6 bits, each an f32 whose square and whose sum over
/// up to 4,096 ranks are exact integers. Sent with the next average (the digits and their squares
/// appended to its buffer, f32), its mean equals a rank's own exactly when every rank's digits are
/// equal: then the sum of each is K times the rank's, and the mean of the squares equals the square
/// of the mean only without spread.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub(crate) struct Fingerprint {
    digits: [f32; DIGITS],
    /// The step of the average it was taken after, as its face counts steps.
    step: u64,
}

/// Digits of a fingerprint.
const DIGITS: usize = 11;

impl Fingerprint {
    /// The fingerprint of `params` after the average at `step`: the sum of each value's bits times an
    /// odd weight (twice its index plus one) beside the plain sum of the bits, each modulo 2^32 (so
    /// it vectorizes), so that a change of any one value, or two values swapped, changes it.
    pub(crate) fn of(params: &[f32], step: u64) -> Self {
        let (weighted, plain) = params.iter().zip(0u32..).fold((0u32, 0u32), |(w, p), (x, i)| {
            let bits = x.to_bits();
            (w.wrapping_add(bits.wrapping_mul(i.wrapping_mul(2) | 1)), p.wrapping_add(bits))
        });
        let sum = (u64::from(weighted) << 32) | u64::from(plain);
        Self { digits: std::array::from_fn(|i| ((sum >> (6 * i)) & 63) as f32), step }
    }

    /// What rides at the end of the next average's buffer: the digits, then their squares.
    pub(crate) fn carried(&self) -> [f32; 2 * DIGITS] {
        std::array::from_fn(|i| if i < DIGITS { self.digits[i] } else { self.digits[i - DIGITS].powi(2) })
    }

    /// Whether `mean`, the all-reduced [`Self::carried`], is this rank's own: every rank's is.
    pub(crate) fn matches(&self, mean: &[f32]) -> bool {
        mean == self.carried()
    }

    /// The step of the average it was taken after.
    pub(crate) fn step(&self) -> u64 {
        self.step
    }
}

impl SyncState {
    /// The outer optimizer's state, if syncs are outer steps.
    pub fn outer(&self) -> Option<&OuterState> {
        self.outer.as_ref()
    }

    /// The streaming state, if syncs stream.
    pub fn stream(&self) -> Option<&StreamState> {
        self.stream.as_ref()
    }

    /// Whether it holds nothing a resume needs beyond the plan's position: no outer state, no
    /// streaming state, no fingerprint waiting to be sent.
    pub fn is_empty(&self) -> bool {
        self.outer.is_none() && self.stream.is_none() && self.fingerprint.is_none()
    }

    /// Zeroes the error-feedback residual: the state a worker joining a running job takes from
    /// another rank's (the averages in flight are the same on every rank, the residual is not).
    pub fn zero_residual(&mut self) {
        if let Some(residual) = self.stream.as_mut().and_then(|s| s.residual.as_mut()) {
            residual.fill(0.0);
        }
    }
}

/// DiLoCo's outer optimizer state: the last global parameters and the momentum buffer (saved as the
/// pair `[global, momentum]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(from = "(Vec<f32>, Vec<f32>)", into = "(Vec<f32>, Vec<f32>)")]
pub struct OuterState {
    /// The global parameters after the last outer step.
    pub global: Vec<f32>,
    /// The outer momentum buffer.
    pub momentum: Vec<f32>,
}

impl From<(Vec<f32>, Vec<f32>)> for OuterState {
    fn from((global, momentum): (Vec<f32>, Vec<f32>)) -> Self {
        Self { global, momentum }
    }
}

impl From<OuterState> for (Vec<f32>, Vec<f32>) {
    fn from(state: OuterState) -> Self {
        (state.global, state.momentum)
    }
}

/// What a [`SyncState`] file holds beside its tensors: its one metadata entry `sync`.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Header {
    outer: bool,
    stream: Option<StreamHeader>,
    inner_round: InnerRound,
    /// Whether the file carries the rank's own parameters (`params`).
    params: bool,
    /// The fingerprint of the last global average, if it is checked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    fingerprint: Option<Fingerprint>,
    /// The state of the face that saved it (an `AveragerState`'s rounds), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    owner: Option<serde_json::Value>,
}

/// What a sync state file holds: the state, a rank's own parameters, the saving face's state.
pub(crate) struct Decoded {
    pub(crate) state: SyncState,
    pub(crate) params: Option<Vec<f32>>,
    pub(crate) owner: Option<serde_json::Value>,
}

/// A streaming state's averages in flight (their values are tensors) and whether it has a residual.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamHeader {
    in_flight: Vec<InFlightHead>,
    residual: bool,
}

/// An average in flight without its values.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct InFlightHead {
    fragment: u32,
    sent_after: u64,
    apply_after: u64,
    /// Whether `stream.in_flight.<i>.sent` is present.
    sent: bool,
}

impl SyncState {
    /// The state as safetensors bytes: the tensors `outer.global`, `outer.momentum`, `stream.residual`,
    /// `stream.in_flight.<i>` (a mean) and `stream.in_flight.<i>.sent`, with `params` (a streaming
    /// rank's own parameters, which differ between ranks) when given, and one metadata entry `sync`
    /// (JSON) for the rest. Identical states give identical bytes.
    pub fn to_safetensors(&self, params: Option<&[f32]>) -> Result<Vec<u8>, OptimError> {
        self.encode(params, None)
    }

    /// Reads what [`Self::to_safetensors`] wrote for a model of `len` parameters: the state, and the
    /// rank's own parameters if the file has them. Every tensor is checked against `len` before it is
    /// copied (averages in flight against their fragments when the state is restored).
    pub fn from_safetensors(bytes: &[u8], len: usize) -> Result<(Self, Option<Vec<f32>>), OptimError> {
        let Decoded { state, params, .. } = Self::decode(bytes, Some(len))?;
        Ok((state, params))
    }

    /// [`Self::to_safetensors`] with the saving face's own state (`owner`) in the metadata entry.
    pub(crate) fn encode(
        &self,
        params: Option<&[f32]>,
        owner: Option<serde_json::Value>,
    ) -> Result<Vec<u8>, OptimError> {
        let mut named: Vec<(String, &[f32])> = Vec::new();
        if let Some(outer) = &self.outer {
            named.push(("outer.global".into(), &outer.global));
            named.push(("outer.momentum".into(), &outer.momentum));
        }
        let stream = self.stream.as_ref().map(|s| {
            if let Some(residual) = &s.residual {
                named.push(("stream.residual".into(), residual));
            }
            let heads = s.in_flight.iter().enumerate().map(|(i, f)| {
                named.push((format!("stream.in_flight.{i}"), &f.mean));
                if !f.sent.is_empty() {
                    named.push((format!("stream.in_flight.{i}.sent"), &f.sent));
                }
                let (fragment, sent_after, apply_after) = (f.fragment, f.sent_after, f.apply_after);
                InFlightHead { fragment, sent_after, apply_after, sent: !f.sent.is_empty() }
            });
            StreamHeader { in_flight: heads.collect(), residual: s.residual.is_some() }
        });
        if let Some(params) = params {
            named.push(("params".into(), params));
        }
        let (outer, inner_round, has_params) = (self.outer.is_some(), self.inner_round, params.is_some());
        let fingerprint = self.fingerprint;
        let header = Header { outer, stream, inner_round, params: has_params, fingerprint, owner };
        let header = serde_json::to_string(&header).map_err(|e| bad(format!("cannot describe it: {e}")))?;
        let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = named
            .into_iter()
            .map(|(name, v)| (name, vec![v.len()], v.iter().flat_map(|x| x.to_le_bytes()).collect()))
            .collect();
        let views = bytes
            .iter()
            .map(|(name, shape, data)| Ok((name.clone(), TensorView::new(Dtype::F32, shape.clone(), data)?)))
            .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()
            .map_err(|e| bad(e.to_string()))?;
        let meta = HashMap::from([("sync".to_string(), header)]);
        safetensors::serialize(views, Some(meta)).map_err(|e| bad(e.to_string()))
    }

    /// Reads what [`Self::encode`] wrote, for a model of `len` parameters when known (each tensor
    /// then has `len` values or, averages in flight, at most `len`; otherwise the restore checks them).
    pub(crate) fn decode(bytes: &[u8], len: Option<usize>) -> Result<Decoded, OptimError> {
        let st = SafeTensors::deserialize(bytes).map_err(|e| bad(format!("not a safetensors file: {e}")))?;
        let (_, meta) = SafeTensors::read_metadata(bytes).map_err(|e| bad(e.to_string()))?;
        let header =
            meta.metadata().as_ref().and_then(|m| m.get("sync")).ok_or_else(|| bad("no `sync` metadata".into()))?;
        let header: Header = serde_json::from_str(header).map_err(|e| bad(format!("metadata `sync`: {e}")))?;
        let tensor = |name: &str, exact: bool| match len {
            Some(len) => read_f32(&st, name, len, exact),
            None => read_f32(&st, name, bytes.len() / 4, false),
        };
        let outer = match header.outer {
            true => {
                Some(OuterState { global: tensor("outer.global", true)?, momentum: tensor("outer.momentum", true)? })
            }
            false => None,
        };
        let stream = match header.stream {
            Some(s) => {
                if s.in_flight.len() > qsr_sched::MAX_FRAGMENTS as usize {
                    return Err(bad(format!("{} averages in flight, more than fragments can be", s.in_flight.len())));
                }
                let residual = s.residual.then(|| tensor("stream.residual", true)).transpose()?;
                let mut in_flight = Vec::with_capacity(s.in_flight.len());
                for (i, h) in s.in_flight.into_iter().enumerate() {
                    let mean = tensor(&format!("stream.in_flight.{i}"), false)?;
                    let sent = if h.sent { tensor(&format!("stream.in_flight.{i}.sent"), false)? } else { Vec::new() };
                    in_flight.push(InFlight {
                        fragment: h.fragment,
                        sent_after: h.sent_after,
                        apply_after: h.apply_after,
                        mean,
                        sent,
                    });
                }
                Some(StreamState { in_flight, residual })
            }
            None => None,
        };
        let params = header.params.then(|| tensor("params", true)).transpose()?;
        let state = Self { outer, stream, inner_round: header.inner_round, fingerprint: header.fingerprint };
        Ok(Decoded { state, params, owner: header.owner })
    }
}

/// The f32 tensor `name` of `st`: `len` values (`exact`) or at most `len`.
fn read_f32(st: &SafeTensors<'_>, name: &str, len: usize, exact: bool) -> Result<Vec<f32>, OptimError> {
    let t = st.tensor(name).map_err(|_| bad(format!("tensor `{name}` is missing")))?;
    let n = t.data().len() / 4;
    let fits = if exact { n == len } else { n <= len };
    if t.dtype() != Dtype::F32 || t.data().len() % 4 != 0 || !fits {
        let want = if exact { "" } else { "at most " };
        return Err(bad(format!(
            "tensor `{name}` has {} bytes of {:?}, expected {want}{len} f32",
            t.data().len(),
            t.dtype()
        )));
    }
    Ok(t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

/// A sync state file that does not fit.
fn bad(reason: String) -> OptimError {
    OptimError::Layout(format!("sync state: {reason}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> SyncState {
        let flight =
            |fragment, sent: Vec<f32>| InFlight { fragment, sent_after: 9, apply_after: 11, mean: vec![0.5; 2], sent };
        SyncState {
            outer: Some(OuterState { global: vec![1.0, -2.0, 3.5, 0.0], momentum: vec![0.25; 4] }),
            stream: Some(StreamState {
                in_flight: vec![flight(0, vec![7.0; 2]), flight(1, Vec::new())],
                residual: Some(vec![1e-7, -3e-8, 0.0, f32::MIN_POSITIVE]),
            }),
            inner_round: InnerRound { steps: 3, lr_sum: 0.1 + 0.2 },
            fingerprint: Some(Fingerprint::of(&[0.5, 0.25], 7)),
        }
    }

    #[test]
    fn a_fingerprint_changes_with_any_value_and_its_digits_are_small_integers() {
        let params = [1.0, -2.5, f32::MIN_POSITIVE, 3e38];
        let f = Fingerprint::of(&params, 3);
        assert!(f.digits.iter().all(|d| d.fract() == 0.0 && (0.0..64.0).contains(d)));
        for i in 0..params.len() {
            let mut nudged = params;
            nudged[i] = nudged[i].next_up();
            assert_ne!(Fingerprint::of(&nudged, 3).digits, f.digits, "an ulp of value {i}");
        }
        // The largest square, summed in f32 over 4,096 ranks and divided by them, comes back exactly;
        // one rank off by one digit does not.
        let mean = |values: &[f32]| values.iter().sum::<f32>() / values.len() as f32;
        let mut squares = vec![63.0f32 * 63.0; 4096];
        assert_eq!(mean(&squares), 3969.0);
        squares[17] = 62.0 * 62.0;
        assert_ne!(mean(&squares), 3969.0);
        let mut swapped = params;
        swapped.swap(0, 1);
        assert_ne!(Fingerprint::of(&swapped, 3).digits, f.digits, "two values swapped");
    }

    #[test]
    fn a_sync_state_round_trips_through_safetensors_bit_exact() {
        let params = [0.1f32, 0.2, 0.3, 0.4];
        let bytes = state().to_safetensors(Some(&params)).unwrap();
        assert_eq!(bytes, state().to_safetensors(Some(&params)).unwrap(), "the same state, the same bytes");
        let (back, own) = SyncState::from_safetensors(&bytes, 4).unwrap();
        assert_eq!(back, state());
        assert_eq!(own.as_deref(), Some(&params[..]));
        let plain = SyncState::default().to_safetensors(None).unwrap();
        assert_eq!(SyncState::from_safetensors(&plain, 4).unwrap(), (SyncState::default(), None));
    }

    #[test]
    fn a_sync_state_file_that_does_not_fit_is_refused_naming_what() {
        let bytes = state().to_safetensors(None).unwrap();
        let err = SyncState::from_safetensors(&bytes, 5).unwrap_err().to_string();
        assert!(err.contains("`outer.global`") && err.contains("expected 5 f32"), "{err}");
        let err = SyncState::from_safetensors(&bytes, 1).unwrap_err().to_string();
        assert!(err.contains("`outer.global`"), "{err}");
        let err = SyncState::from_safetensors(b"\xff\xff\xff\xff\xff\xff\xff\x7fgarbage", 4).unwrap_err().to_string();
        assert!(err.contains("not a safetensors file"), "{err}");
        let unnamed = safetensors::serialize(Vec::<(String, TensorView<'_>)>::new(), None).unwrap();
        let err = SyncState::from_safetensors(&unnamed, 4).unwrap_err().to_string();
        assert!(err.contains("no `sync` metadata"), "{err}");
    }
}
