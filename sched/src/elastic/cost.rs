//! What a denoising step costs at sequence-parallel degree `k`, per request class: the
//! parallel-cost model the elastic policies and the simulator share.
//!
//! [`StepCost::h100_flux`] is **modelled**, not measured: FLUX.1-dev's step on one GPU from
//! this project's H200 measurement (148.5 ms at 1024x1024, 4096 image tokens, 512 text
//! tokens; docs/BENCHMARKS.md), split into a part linear in tokens and an attention part
//! quadratic in them (75% / 25% at 4096 tokens), and at degree `k`: the image work divided by
//! `k`, the text tokens' linear work on every rank (they are replicated), and four Ulysses
//! all-to-alls per block (57 blocks) over NVLink at 450 GB/s, each with 5 µs of latency plus
//! 2 µs per peer (an all-to-all sends to every other rank), so past some degree a request's
//! step gets slower, sooner the smaller the request.
//!
//! [`StepCost::measured`] instead reads the seconds a step took at each degree from a table
//! `cargo xtask bench sp` measured on this machine's ranks.
use serde::{Deserialize, Serialize};

/// A request class: its image tokens and denoising steps.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Class {
    pub name: &'static str,
    pub image_tokens: f64,
    pub steps: u32,
    /// Deadline = arrival + `slo_factor * slo_scale` x its standalone service time at SP1
    /// (GF-DiT's alpha per class).
    pub slo_factor: f64,
}

/// Per-step seconds by class and degree.
#[derive(Debug, Clone, Serialize)]
pub struct StepCost {
    pub label: String,
    /// Seconds per image or text token per step of the token-linear work, on one rank.
    pub linear_s_per_token: f64,
    /// Seconds per (token^2) of attention per step, on one rank.
    pub attention_s_per_token2: f64,
    pub text_tokens: f64,
    /// Bytes each rank sends per token in one all-to-all (hidden size x 2 bytes).
    pub bytes_per_token: f64,
    pub all_to_alls_per_step: f64,
    pub link_bytes_per_s: f64,
    pub collective_latency_s: f64,
    pub latency_per_peer_s: f64,
    /// Per-step work no degree divides (scheduler step, launch overheads).
    pub fixed_s: f64,
    /// Measured seconds per step by class and degree; when present they replace the model.
    pub measured: Option<MeasuredTable>,
}

/// Step seconds measured per class and degree (`cargo xtask bench sp` writes it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MeasuredTable {
    pub label: String,
    pub classes: Vec<MeasuredClass>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MeasuredClass {
    pub name: String,
    pub image_tokens: f64,
    pub steps: u32,
    pub per_degree: Vec<DegreeCost>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DegreeCost {
    pub degree: u32,
    /// Seconds of a step (with every rank busy, in the tables a node measures).
    pub step_s: f64,
    /// Where measured: seconds of a step by how many of the node's ranks are busy (this
    /// step's included), ascending. Ranks that share a machine's cores (CPU ranks) step
    /// faster while fewer of them run.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub by_busy_ranks: Vec<BusyCost>,
}

/// A step's seconds while `busy_ranks` ranks of the node are busy.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BusyCost {
    pub busy_ranks: u32,
    pub step_s: f64,
}

impl StepCost {
    /// FLUX.1-dev on H100-class GPUs with NVLink (modelled; see the module docs).
    pub fn h100_flux() -> Self {
        let (tokens, text, step) = (4096.0, 512.0, 0.1485);
        let linear = 0.75 * step / (tokens + text);
        let attention = 0.25 * step / ((tokens + text) * (tokens + text));
        Self {
            label: "modelled: FLUX.1-dev step from the H200 measurement, Ulysses over NVLink"
                .into(),
            linear_s_per_token: linear,
            attention_s_per_token2: attention,
            text_tokens: text,
            bytes_per_token: 3072.0 * 2.0,
            all_to_alls_per_step: 57.0 * 4.0,
            link_bytes_per_s: 450e9,
            collective_latency_s: 5e-6,
            latency_per_peer_s: 2e-6,
            fixed_s: 0.001,
            measured: None,
        }
    }

    /// Costs read from a measured table, and its classes (the deadline factors of the image
    /// classes of the same names, 2.0 for others).
    pub fn measured(table: MeasuredTable) -> (Self, Vec<Class>) {
        let factors = image_classes();
        let classes = table
            .classes
            .iter()
            .map(|c| Class {
                // Class names live as long as the run: leaked once per run (three strings).
                name: Box::leak(c.name.clone().into_boxed_str()),
                image_tokens: c.image_tokens,
                steps: c.steps,
                slo_factor: factors
                    .iter()
                    .find(|f| f.name == c.name)
                    .map_or(2.0, |f| f.slo_factor),
            })
            .collect();
        let cost = Self {
            label: table.label.clone(),
            measured: Some(table),
            ..Self::h100_flux()
        };
        (cost, classes)
    }

    /// Seconds of one step of `class` at degree `k` (k >= 1). From a measured table: the
    /// largest measured degree not above `k` (ranks beyond it would idle).
    pub fn step_s(&self, class: &Class, k: u32) -> f64 {
        if let Some(table) = &self.measured {
            let row = table.classes.iter().find(|c| c.name == class.name);
            return row
                .and_then(|c| {
                    c.per_degree
                        .iter()
                        .filter(|d| d.degree <= k.max(1))
                        .max_by_key(|d| d.degree)
                })
                .map_or(f64::INFINITY, |d| d.step_s);
        }
        let k = f64::from(k.max(1));
        let (n, t) = (class.image_tokens, self.text_tokens);
        let compute = self.linear_s_per_token * (n / k + t)
            + self.attention_s_per_token2 * (n + t) * (n + t) / k;
        let comm = if k > 1.0 {
            let bytes = self.bytes_per_token * (n / k) * (k - 1.0) / k;
            let latency = self.collective_latency_s + self.latency_per_peer_s * (k - 1.0);
            self.all_to_alls_per_step * (bytes / self.link_bytes_per_s + latency)
        } else {
            0.0
        };
        self.fixed_s + compute + comm
    }

    /// Seconds of one step of `class` at degree `k` while `busy_ranks` ranks of the node
    /// are busy (its own included): from a table with `by_busy_ranks`, interpolated linearly
    /// between the measured counts (CPU ranks contend for the cores); otherwise
    /// [`StepCost::step_s`] (GPU ranks do not).
    pub fn step_s_loaded(&self, class: &Class, k: u32, busy_ranks: u32) -> f64 {
        let points = self.measured.as_ref().and_then(|table| {
            let row = table.classes.iter().find(|c| c.name == class.name)?;
            let d = row
                .per_degree
                .iter()
                .filter(|d| d.degree <= k.max(1))
                .max_by_key(|d| d.degree)?;
            (!d.by_busy_ranks.is_empty()).then_some(&d.by_busy_ranks)
        });
        let Some(points) = points else {
            return self.step_s(class, k);
        };
        let busy = f64::from(busy_ranks);
        let at = |p: &BusyCost| f64::from(p.busy_ranks);
        match points.iter().position(|p| at(p) >= busy) {
            Some(0) => points[0].step_s,
            Some(i) => {
                let (a, b) = (&points[i - 1], &points[i]);
                a.step_s + (b.step_s - a.step_s) * (busy - at(a)) / (at(b) - at(a)).max(1e-9)
            }
            None => points[points.len() - 1].step_s,
        }
    }

    /// The degree (a power of two up to `max`) with the shortest step; more ranks beyond it
    /// make the step slower.
    pub fn best_degree(&self, class: &Class, max: u32) -> u32 {
        let mut best = 1;
        let mut k = 2;
        while k <= max {
            if self.step_s(class, k) < self.step_s(class, best) {
                best = k;
            }
            k *= 2;
        }
        best
    }
}

/// GF-DiT's image classes (Qwen-Image's 512^2 / 1024^2 / 1536^2 with alpha 1.5 / 2.0 / 6.0),
/// here as FLUX.1 image tokens (a 16x16-pixel patch each) and 28 steps.
pub fn image_classes() -> [Class; 3] {
    [
        Class {
            name: "S",
            image_tokens: 1024.0,
            steps: 28,
            slo_factor: 1.5,
        },
        Class {
            name: "M",
            image_tokens: 4096.0,
            steps: 28,
            slo_factor: 2.0,
        },
        Class {
            name: "L",
            image_tokens: 9216.0,
            steps: 28,
            slo_factor: 6.0,
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn larger_requests_gain_more_from_more_ranks() {
        let cost = StepCost::h100_flux();
        let [s, m, l] = image_classes();
        // The calibration point: a 1024^2 step on one GPU.
        assert!(
            (cost.step_s(&m, 1) - 0.1495).abs() < 1e-3,
            "{}",
            cost.step_s(&m, 1)
        );
        let speedup = |c: &Class| cost.step_s(c, 1) / cost.step_s(c, 8);
        assert!(speedup(&s) < speedup(&m) && speedup(&m) < speedup(&l));
        assert!(
            speedup(&s) < 4.0 && speedup(&l) > 5.0,
            "{} {}",
            speedup(&s),
            speedup(&l)
        );
        assert!(cost.best_degree(&l, 8) == 8 && cost.best_degree(&s, 64) < 64);
    }
}

#[cfg(test)]
mod measured_tests {
    use super::*;

    #[test]
    fn a_measured_table_replaces_the_model() {
        let table = MeasuredTable {
            label: "t".into(),
            classes: vec![MeasuredClass {
                name: "S".into(),
                image_tokens: 256.0,
                steps: 4,
                per_degree: vec![
                    DegreeCost {
                        degree: 1,
                        step_s: 1.0,
                        by_busy_ranks: vec![
                            BusyCost {
                                busy_ranks: 1,
                                step_s: 0.5,
                            },
                            BusyCost {
                                busy_ranks: 3,
                                step_s: 0.9,
                            },
                        ],
                    },
                    DegreeCost {
                        degree: 2,
                        step_s: 0.6,
                        by_busy_ranks: Vec::new(),
                    },
                ],
            }],
        };
        let (cost, classes) = StepCost::measured(table);
        assert_eq!(classes[0].slo_factor, 1.5);
        assert_eq!(cost.step_s(&classes[0], 1), 1.0);
        assert_eq!(cost.step_s(&classes[0], 2), 0.6);
        assert_eq!(
            cost.step_s(&classes[0], 8),
            0.6,
            "past the table: the largest measured"
        );
        assert_eq!(cost.best_degree(&classes[0], 8), 2);
        // Loaded: interpolated between the measured busy counts, clamped outside them.
        let c = &classes[0];
        assert_eq!(cost.step_s_loaded(c, 1, 1), 0.5);
        assert!((cost.step_s_loaded(c, 1, 2) - 0.7).abs() < 1e-12);
        assert_eq!(cost.step_s_loaded(c, 1, 4), 0.9);
        assert_eq!(
            cost.step_s_loaded(c, 2, 2),
            0.6,
            "none measured: the busy figure"
        );
    }
}
