//! Ordinary least squares of one variable: the load and overhead fits of the cost models.
use crate::error::SchedError;
use serde::{Deserialize, Serialize};

/// `y = intercept + slope * x`, with its coefficient of determination.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LinearFit {
    pub slope: f64,
    pub intercept: f64,
    pub r2: f64,
    pub samples: usize,
}

impl LinearFit {
    /// Ordinary least squares of `ys` on `xs`; `what` names the data in errors.
    pub fn fit(what: &str, xs: &[f64], ys: &[f64]) -> Result<Self, SchedError> {
        let fail = |message: &str| SchedError::Fit {
            what: what.to_string(),
            message: message.to_string(),
        };
        if xs.len() != ys.len() {
            return Err(fail("x and y lengths differ"));
        }
        if xs.len() < 2 {
            return Err(fail("need at least 2 samples"));
        }
        if let Some(i) = xs.iter().chain(ys).position(|v| !v.is_finite()) {
            return Err(fail(&format!("sample value {i} is not finite")));
        }
        let n = xs.len() as f64;
        let mx = xs.iter().sum::<f64>() / n;
        let my = ys.iter().sum::<f64>() / n;
        let (mut sxx, mut sxy, mut syy) = (0.0, 0.0, 0.0);
        for (x, y) in xs.iter().zip(ys) {
            sxx += (x - mx) * (x - mx);
            sxy += (x - mx) * (y - my);
            syy += (y - my) * (y - my);
        }
        if sxx <= f64::EPSILON * mx.abs().max(1.0) {
            return Err(fail("all x values are equal"));
        }
        let slope = sxy / sxx;
        let intercept = my - slope * mx;
        let sse: f64 = xs
            .iter()
            .zip(ys)
            .map(|(x, y)| (y - intercept - slope * x).powi(2))
            .sum();
        let r2 = if syy > 0.0 { 1.0 - sse / syy } else { 1.0 };
        Ok(LinearFit {
            slope,
            intercept,
            r2,
            samples: xs.len(),
        })
    }

    /// Predicted latency, never negative.
    pub fn predict(&self, x: f64) -> f64 {
        (self.intercept + self.slope * x).max(0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn exact_line_is_recovered() {
        let xs: Vec<f64> = (0..10).map(|i| i as f64 * 3.5).collect();
        let ys: Vec<f64> = xs.iter().map(|x| 0.25 + 2.0 * x).collect();
        let f = LinearFit::fit("t", &xs, &ys).unwrap();
        assert!((f.slope - 2.0).abs() < 1e-12, "{f:?}");
        assert!((f.intercept - 0.25).abs() < 1e-12, "{f:?}");
        assert!((f.r2 - 1.0).abs() < 1e-12, "{f:?}");
    }

    #[test]
    fn noisy_line_has_high_r2_and_close_coefficients() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let xs: Vec<f64> = (0..400).map(|_| rng.random_range(1e9..1e13)).collect();
        let ys: Vec<f64> = xs
            .iter()
            .map(|x| (2e-4 + x / 4e14) * (1.0 + rng.random_range(-0.03..0.03)))
            .collect();
        let f = LinearFit::fit("t", &xs, &ys).unwrap();
        assert!(f.r2 > 0.99, "{f:?}");
        assert!((f.slope * 4e14 - 1.0).abs() < 0.02, "{f:?}");
    }

    #[test]
    fn pure_noise_has_low_r2() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let xs: Vec<f64> = (0..400).map(|i| i as f64).collect();
        let ys: Vec<f64> = xs.iter().map(|_| rng.random_range(0.0..1.0)).collect();
        let f = LinearFit::fit("t", &xs, &ys).unwrap();
        assert!(f.r2 < 0.1, "{f:?}");
    }

    #[test]
    fn degenerate_inputs_are_rejected_with_the_name() {
        let e = LinearFit::fit("load", &[1.0, 1.0], &[2.0, 3.0]).unwrap_err();
        assert!(e.to_string().contains("load"), "{e}");
        assert!(LinearFit::fit("x", &[1.0], &[2.0]).is_err());
        assert!(LinearFit::fit("x", &[1.0, f64::NAN], &[2.0, 3.0]).is_err());
    }
}
