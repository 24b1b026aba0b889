//! Max pooling over non-overlapping windows (kernel = stride, no padding), the image models' 2x2 pool:
//! the forward keeps each window's argmax, the backward writes each output's gradient there.

use rayon::prelude::*;

/// Planes of `h x w` pooled by `k` windows: `[planes, h, w]` -> `[planes, h / k[0], w / k[1]]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PoolShape {
    pub(crate) planes: usize,
    pub(crate) h: usize,
    pub(crate) w: usize,
    pub(crate) k: [usize; 2],
}

impl PoolShape {
    pub(crate) fn out_hw(&self) -> [usize; 2] {
        [self.h / self.k[0], self.w / self.k[1]]
    }

    /// Planes per rayon task: enough work per task that the pool's overhead does not dominate.
    fn planes_per_task(&self) -> usize {
        (16_384 / (self.h * self.w).max(1)).max(1)
    }
}

/// Each window's maximum (a NaN wins, as in PyTorch) and its index within the plane.
pub(crate) fn max_pool(x: &[f32], s: PoolShape) -> (Vec<f32>, Vec<u32>) {
    let [ho, wo] = s.out_hw();
    let (plane_in, plane_out, per) = (s.h * s.w, ho * wo, s.planes_per_task());
    let mut out = vec![0.0; s.planes * plane_out];
    let mut arg = vec![0u32; s.planes * plane_out];
    out.par_chunks_mut(per * plane_out)
        .zip(arg.par_chunks_mut(per * plane_out))
        .zip(x.par_chunks(per * plane_in))
        .for_each(|((out, arg), x)| {
            for ((out, arg), x) in out.chunks_mut(plane_out).zip(arg.chunks_mut(plane_out)).zip(x.chunks(plane_in)) {
                for (o, (out, arg)) in out.iter_mut().zip(arg.iter_mut()).enumerate() {
                    let (oy, ox) = (o / wo * s.k[0], o % wo * s.k[1]);
                    let mut best = oy * s.w + ox;
                    for y in oy..oy + s.k[0] {
                        for i in y * s.w + ox..y * s.w + ox + s.k[1] {
                            if x[i] > x[best] || (x[i].is_nan() && !x[best].is_nan()) {
                                best = i;
                            }
                        }
                    }
                    (*out, *arg) = (x[best], best as u32);
                }
            }
        });
    (out, arg)
}

/// The input's gradient: each output's gradient `g` at its window's argmax, zero elsewhere.
pub(crate) fn max_pool_backward(g: &[f32], arg: &[u32], s: PoolShape) -> Vec<f32> {
    let [ho, wo] = s.out_hw();
    let (plane_in, plane_out, per) = (s.h * s.w, ho * wo, s.planes_per_task());
    let mut dx = vec![0.0; s.planes * plane_in];
    dx.par_chunks_mut(per * plane_in).zip(g.par_chunks(per * plane_out).zip(arg.par_chunks(per * plane_out))).for_each(
        |(dx, (g, arg))| {
            for (dx, (g, arg)) in dx.chunks_mut(plane_in).zip(g.chunks(plane_out).zip(arg.chunks(plane_out))) {
                for (&g, &i) in g.iter().zip(arg) {
                    dx[i as usize] = g;
                }
            }
        },
    );
    dx
}
