//! Block compute latency against FLOPs plus a cost per request:
//! `intercept + slope * flops + per_request * requests + per_cached_request * cached_requests`.
//!
//! FLOPs alone (FlashPS Table 1) fit a CPU, where a block's time is its arithmetic (R^2 0.996+),
//! but not a GPU at these model sizes: there a block is launch-bound, and every request adds
//! kernels of its own (its attention call; for a mask-aware pass also the gathers and merges of
//! its cached keys and values) whatever its FLOPs. The H100 profiles (`sched/profiles/*-h100.json`) fit
//! FLOPs alone to R^2 0.90 (medium) and 0.05 (tiny), and these four terms to 0.99+.
//!
//! Coefficients are non-negative (a request never makes a block faster): non-negative least
//! squares, solved exactly by trying every subset of the four terms (16 small fits) and keeping
//! the best one whose coefficients are all >= 0, the simplest among equals.
use serde::{Deserialize, Serialize};

use crate::cost_model::{ComputeSample, LinearFit};
use crate::error::SchedError;

/// Fitted block compute latency (s), with its coefficient of determination.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ComputeFit {
    /// Seconds per FLOP of the batch.
    pub slope: f64,
    pub intercept: f64,
    /// Seconds per request of the batch, whatever its pass.
    #[serde(default)]
    pub per_request: f64,
    /// Further seconds per request computed mask-aware (reading cached keys and values).
    #[serde(default)]
    pub per_cached_request: f64,
    pub r2: f64,
    pub samples: usize,
}

/// A fit with fewer terms is preferred to one whose SSE is lower by less than this share of
/// the data's variance (rounding, not signal).
const SIMPLER_WITHIN: f64 = 1e-9;

impl ComputeFit {
    /// A FLOPs-only model (no per-request terms).
    pub fn from_line(line: LinearFit) -> Self {
        Self {
            slope: line.slope,
            intercept: line.intercept,
            per_request: 0.0,
            per_cached_request: 0.0,
            r2: line.r2,
            samples: line.samples,
        }
    }

    /// Non-negative least squares of the samples' latencies on the four terms; `what` names
    /// the data in errors.
    pub fn fit(what: &str, samples: &[ComputeSample]) -> Result<Self, SchedError> {
        // The FLOPs line validates the data (sizes, finite values, distinct FLOPs) and names
        // the problem the way every other fit does.
        let xs: Vec<f64> = samples.iter().map(|s| s.flops).collect();
        let ys: Vec<f64> = samples.iter().map(|s| s.latency_s).collect();
        LinearFit::fit(what, &xs, &ys)?;
        let columns: [Vec<f64>; 4] = [
            vec![1.0; samples.len()],
            xs,
            samples.iter().map(|s| s.batch as f64).collect(),
            samples
                .iter()
                .map(|s| if s.is_full() { 0.0 } else { s.batch as f64 })
                .collect(),
        ];
        let mean = ys.iter().sum::<f64>() / ys.len() as f64;
        let syy: f64 = ys.iter().map(|y| (y - mean).powi(2)).sum();
        let tol = SIMPLER_WITHIN * syy;
        let mut best: Option<(f64, usize, [f64; 4])> = None;
        for subset in 1u32..16 {
            let used: Vec<usize> = (0..4).filter(|c| subset & (1 << c) != 0).collect();
            let cols: Vec<&[f64]> = used.iter().map(|&c| columns[c].as_slice()).collect();
            let Some(coef) = least_squares(&cols, &ys) else {
                continue; // collinear terms: another subset covers it
            };
            if coef.iter().any(|&c| c < 0.0) {
                continue;
            }
            let mut full = [0.0; 4];
            for (&c, v) in used.iter().zip(coef) {
                full[c] = v;
            }
            let sse = sse(&columns, &full, &ys);
            let better = match best {
                None => true,
                Some((best_sse, best_terms, _)) => {
                    sse < best_sse - tol || (sse <= best_sse + tol && used.len() < best_terms)
                }
            };
            if better {
                best = Some((sse, used.len(), full));
            }
        }
        let (sse, _, [intercept, slope, per_request, per_cached_request]) =
            best.ok_or_else(|| SchedError::Fit {
                what: what.to_string(),
                message: "no non-negative fit".into(),
            })?;
        Ok(Self {
            slope,
            intercept,
            per_request,
            per_cached_request,
            r2: if syy > 0.0 { 1.0 - sse / syy } else { 1.0 },
            samples: samples.len(),
        })
    }

    /// Predicted latency of one block over a batch of `requests` with `flops` in all, computed
    /// mask-aware (`cached`) or in full; never negative.
    pub fn predict(&self, flops: f64, requests: u32, cached: bool) -> f64 {
        let per_request = self.per_request + if cached { self.per_cached_request } else { 0.0 };
        (self.intercept + self.slope * flops + per_request * requests as f64).max(0.0)
    }
}

fn sse(columns: &[Vec<f64>; 4], coef: &[f64; 4], ys: &[f64]) -> f64 {
    ys.iter()
        .enumerate()
        .map(|(i, y)| {
            let fit: f64 = (0..4).map(|c| coef[c] * columns[c][i]).sum();
            (y - fit).powi(2)
        })
        .sum()
}

/// Ordinary least squares of `ys` on `columns` (no implicit intercept), or `None` when the
/// columns are (nearly) collinear. Columns are scaled to unit size first: FLOPs (~1e10) and
/// counts (~1) in one system would otherwise lose the small ones to rounding.
fn least_squares(columns: &[&[f64]], ys: &[f64]) -> Option<Vec<f64>> {
    let k = columns.len();
    let scale: Vec<f64> = columns
        .iter()
        .map(|c| c.iter().map(|v| v * v).sum::<f64>().sqrt())
        .collect();
    if scale.contains(&0.0) {
        return None;
    }
    // Normal equations A x = b over the scaled columns.
    let mut a = vec![vec![0.0; k + 1]; k];
    for i in 0..k {
        for j in 0..k {
            a[i][j] = dot(columns[i], columns[j]) / (scale[i] * scale[j]);
        }
        a[i][k] = dot(columns[i], ys) / scale[i];
    }
    // Gaussian elimination with partial pivoting; a tiny pivot means collinear columns.
    for col in 0..k {
        let pivot = (col..k).max_by(|&r, &s| a[r][col].abs().total_cmp(&a[s][col].abs()))?;
        if a[pivot][col].abs() < 1e-10 {
            return None;
        }
        a.swap(col, pivot);
        let pivot_row = a[col].clone();
        for (r, row) in a.iter_mut().enumerate() {
            if r != col {
                let f = row[col] / pivot_row[col];
                for (v, p) in row.iter_mut().zip(&pivot_row).skip(col) {
                    *v -= f * p;
                }
            }
        }
    }
    Some((0..k).map(|i| a[i][k] / a[i][i] / scale[i]).collect())
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(flops: f64, batch: u32, full: bool, latency_s: f64) -> ComputeSample {
        ComputeSample {
            tokens: if full { 100 } else { 50 },
            batch,
            attended: 100,
            flops,
            latency_s,
        }
    }

    /// Latencies from known non-negative coefficients, every batch in both passes.
    fn exact(coef: [f64; 4]) -> Vec<ComputeSample> {
        let mut out = Vec::new();
        for (i, batch) in [1u32, 2, 4, 8].into_iter().enumerate() {
            for full in [true, false] {
                let flops = 1e9 * (i as f64 + 1.0) * if full { 3.0 } else { 1.0 } * batch as f64;
                let cached = if full { 0.0 } else { batch as f64 };
                let y = coef[0] + coef[1] * flops + coef[2] * batch as f64 + coef[3] * cached;
                out.push(sample(flops, batch, full, y));
            }
        }
        out
    }

    #[test]
    fn recovers_known_coefficients() {
        let fit = ComputeFit::fit("t", &exact([5e-4, 2e-14, 1e-5, 2e-4])).unwrap();
        assert!((fit.intercept - 5e-4).abs() < 1e-12, "{fit:?}");
        assert!((fit.slope - 2e-14).abs() < 1e-20, "{fit:?}");
        assert!((fit.per_request - 1e-5).abs() < 1e-12, "{fit:?}");
        assert!((fit.per_cached_request - 2e-4).abs() < 1e-12, "{fit:?}");
        assert!(fit.r2 > 0.999_999, "{fit:?}");
        assert!((fit.predict(4e9, 2, true) - (5e-4 + 8e-5 + 2e-5 + 4e-4)).abs() < 1e-12);
        assert!((fit.predict(4e9, 2, false) - (5e-4 + 8e-5 + 2e-5)).abs() < 1e-12);
    }

    #[test]
    fn a_pure_flops_line_keeps_no_request_terms() {
        let fit = ComputeFit::fit("t", &exact([1e-3, 1e-11, 0.0, 0.0])).unwrap();
        assert_eq!(
            (fit.per_request, fit.per_cached_request),
            (0.0, 0.0),
            "{fit:?}"
        );
        assert!((fit.slope - 1e-11).abs() < 1e-17, "{fit:?}");
    }

    /// Against brute force: no grid point of non-negative coefficients fits better.
    #[test]
    fn no_non_negative_point_fits_better() {
        // Noisy data whose unconstrained fit wants a negative FLOPs slope.
        let data: Vec<ComputeSample> = [
            (1e9, 1, true, 1.0e-3),
            (2e9, 1, false, 1.3e-3),
            (4e9, 2, true, 1.05e-3),
            (8e9, 2, false, 1.6e-3),
            (1.6e10, 4, true, 0.98e-3),
            (3.2e10, 4, false, 2.1e-3),
        ]
        .into_iter()
        .map(|(f, b, full, y)| sample(f, b, full, y))
        .collect();
        let fit = ComputeFit::fit("t", &data).unwrap();
        let coef = [
            fit.intercept,
            fit.slope,
            fit.per_request,
            fit.per_cached_request,
        ];
        assert!(coef.iter().all(|&c| c >= 0.0), "{fit:?}");
        let loss = |c: [f64; 4]| -> f64 {
            data.iter()
                .map(|s| {
                    let cached = if s.is_full() { 0.0 } else { s.batch as f64 };
                    let y = c[0] + c[1] * s.flops + c[2] * s.batch as f64 + c[3] * cached;
                    (s.latency_s - y).powi(2)
                })
                .sum()
        };
        let best = loss(coef);
        let steps = |max: f64| (0..=20).map(move |i| max * i as f64 / 20.0);
        for a in steps(2e-3) {
            for b in steps(1e-13) {
                for c in steps(5e-4) {
                    for d in steps(5e-4) {
                        assert!(
                            loss([a, b, c, d]) >= best - 1e-15,
                            "{:?} beats {fit:?}",
                            [a, b, c, d]
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn bad_data_is_named() {
        let err = ComputeFit::fit("compute (x)", &[sample(1.0, 1, true, 1.0)]).unwrap_err();
        assert!(err.to_string().contains("compute (x)"), "{err}");
    }
}
