//! Workloads for the simulator: mask-ratio files, arrival traces, Poisson arrivals, and the
//! cluster-capacity estimate that turns `--load` into a request rate.
use crate::batching::BatchLimits;
use crate::cost_model::{BatchTotals, CostModels, Footprint, ModelShape};
use crate::error::SchedError;
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use std::path::Path;

/// One request arriving at the router.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Arrival {
    pub time_s: f64,
    /// Per row.
    pub masked_tokens: u32,
    /// Rows and cache streams ([`Footprint::ONE_ROW`] from the readers and generators here;
    /// `diffmesh-sim --true-cfg` makes every request guided).
    pub footprint: Footprint,
    pub steps: u32,
    pub template: Option<u64>,
    /// Steered by a ControlNet (`diffmesh-sim --controlnet-share`; none from the readers and
    /// generators here).
    pub steered: bool,
}

fn read(path: &Path) -> Result<String, SchedError> {
    std::fs::read_to_string(path).map_err(|source| SchedError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn parse_ratio(path: &Path, line: usize, s: &str) -> Result<f64, SchedError> {
    let err = |message: String| SchedError::Parse {
        path: path.to_path_buf(),
        line,
        message,
    };
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|e| err(format!("mask ratio `{s}`: {e}")))?;
    if !(0.0..=1.0).contains(&v) {
        return Err(err(format!("mask ratio {v} outside [0, 1]")));
    }
    Ok(v)
}

/// A mask-ratio file: one ratio in [0, 1] a line; blank lines and `#` comments are skipped.
pub fn read_mask_ratios(path: &Path) -> Result<Vec<f64>, SchedError> {
    let text = read(path)?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let l = line.trim();
        if l.is_empty() || l.starts_with('#') {
            continue;
        }
        out.push(parse_ratio(path, i + 1, l)?);
    }
    if out.is_empty() {
        return Err(SchedError::field(
            "mask-ratios",
            format!("{} holds no ratios", path.display()),
        ));
    }
    Ok(out)
}

/// An arrival trace: CSV lines `arrival_s,mask_ratio[,template_id]`, non-decreasing times;
/// blank lines, `#` comments and a header line starting with `arrival` are skipped.
pub fn read_trace(path: &Path, shape: &ModelShape, steps: u32) -> Result<Vec<Arrival>, SchedError> {
    let text = read(path)?;
    let mut out: Vec<Arrival> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let l = line.trim();
        if l.is_empty() || l.starts_with('#') || l.starts_with("arrival") {
            continue;
        }
        let err = |message: String| SchedError::Parse {
            path: path.to_path_buf(),
            line: i + 1,
            message,
        };
        let cols: Vec<&str> = l.split(',').map(str::trim).collect();
        if cols.len() < 2 || cols.len() > 3 {
            return Err(err("expected `arrival_s,mask_ratio[,template_id]`".into()));
        }
        let time_s: f64 = cols[0]
            .parse()
            .map_err(|e| err(format!("arrival_s `{}`: {e}", cols[0])))?;
        if !time_s.is_finite() || time_s < 0.0 {
            return Err(err(format!("arrival_s {time_s} must be finite and >= 0")));
        }
        if out.last().is_some_and(|a| a.time_s > time_s) {
            return Err(err("arrival_s decreases".into()));
        }
        let ratio = parse_ratio(path, i + 1, cols[1])?;
        let template = match cols.get(2) {
            Some(t) => Some(
                t.parse()
                    .map_err(|e| err(format!("template_id `{t}`: {e}")))?,
            ),
            None => None,
        };
        out.push(Arrival {
            time_s,
            masked_tokens: shape.masked_tokens(ratio),
            footprint: Footprint::ONE_ROW,
            steps,
            template,
            steered: false,
        });
    }
    Ok(out)
}

/// Poisson arrivals at `rps` for `duration_s`, mask ratios drawn uniformly from `ratios`.
pub fn poisson(
    rng: &mut ChaCha8Rng,
    rps: f64,
    duration_s: f64,
    ratios: &[f64],
    shape: &ModelShape,
    steps: u32,
) -> Vec<Arrival> {
    let mut out = Vec::new();
    if rps <= 0.0 || ratios.is_empty() {
        return out;
    }
    let mut t = 0.0;
    loop {
        let u: f64 = 1.0 - rng.random::<f64>();
        t += -u.ln() / rps;
        if t >= duration_s {
            return out;
        }
        let ratio = ratios[rng.random_range(0..ratios.len())];
        out.push(Arrival {
            time_s: t,
            masked_tokens: shape.masked_tokens(ratio),
            footprint: Footprint::ONE_ROW,
            steps,
            template: None,
            steered: false,
        });
    }
}

/// Estimated cluster capacity (requests/s): each worker runs full batches of the mean request
/// of `footprint` (as many as `max_batch` rows and the token budget allow), one request per
/// `steps` steps each.
pub fn capacity_rps(
    model: &CostModels,
    limits: &BatchLimits,
    workers: f64,
    mean_ratio: f64,
    steps: u32,
    footprint: Footprint,
) -> f64 {
    let shape = &model.shape;
    let masked = shape.masked_tokens(mean_ratio);
    let per = shape.request_tokens(masked, footprint).max(1);
    let by_rows = u64::from(limits.max_batch / footprint.rows.max(1));
    let batch = (limits.token_budget / per).clamp(1, by_rows.max(1)) as u32;
    let mut t = BatchTotals::default();
    for _ in 0..batch {
        t.add_request(shape, masked, footprint);
    }
    let step = model.step_latency(&t);
    if step <= 0.0 {
        return f64::INFINITY;
    }
    workers * batch as f64 / (steps.max(1) as f64 * step)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn tmp(name: &str, body: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("diffmesh-sched-wl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, body).unwrap();
        p
    }

    #[test]
    fn mask_ratio_file_parses_and_rejects_bad_lines() {
        let p = tmp("ok.txt", "0.1\n\n# c\n0.25\n");
        assert_eq!(read_mask_ratios(&p).unwrap(), vec![0.1, 0.25]);
        let e = read_mask_ratios(&tmp("bad.txt", "0.1\n1.5\n")).unwrap_err();
        assert!(e.to_string().contains(":2:"), "{e}");
        assert!(read_mask_ratios(&tmp("empty.txt", "\n")).is_err());
    }

    #[test]
    fn shipped_traces_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/mask-ratios");
        for (f, n) in [
            ("production-edit.txt", 970),
            ("controlnet-inpaint.txt", 1918),
        ] {
            let p = dir.join(f);
            if p.exists() {
                assert_eq!(read_mask_ratios(&p).unwrap().len(), n);
            }
        }
    }

    #[test]
    fn trace_file_parses() {
        let shape = crate::synthetic::flux_shape();
        let p = tmp("t.csv", "arrival_s,mask_ratio\n0.5,0.25\n1.0,1.0,42\n");
        let a = read_trace(&p, &shape, 28).unwrap();
        assert_eq!(a.len(), 2);
        assert_eq!(a[0].masked_tokens, 1024);
        assert_eq!(a[1].template, Some(42));
        assert!(read_trace(&tmp("d.csv", "2,0.1\n1,0.1\n"), &shape, 28).is_err());
    }

    #[test]
    fn poisson_rate_is_right() {
        let shape = crate::synthetic::flux_shape();
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let a = poisson(&mut rng, 4.0, 5000.0, &[0.1], &shape, 28);
        let rate = a.len() as f64 / 5000.0;
        assert!((rate - 4.0).abs() < 0.15, "{rate}");
        assert!(a.windows(2).all(|w| w[0].time_s <= w[1].time_s));
    }
}
