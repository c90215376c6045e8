//! The bench report: human-readable lines as the measurements go, and one JSON object printed
//! last. Every part of the bench adds its figures with [`Report::insert`] (or through
//! [`Report::fields`] when it takes a plain JSON map), so a new figure is one insertion.
use diffmesh_sched::sim::metrics::percentile;
use serde_json::{json, Map, Value};

pub struct Report {
    /// Figures by name; printed as one JSON line at the end.
    pub fields: Map<String, Value>,
    /// Print only the JSON line (`--json`).
    quiet: bool,
}

impl Report {
    pub fn new(quiet: bool) -> Self {
        Self {
            fields: Map::new(),
            quiet,
        }
    }

    /// One human-readable line (suppressed with `--json`).
    pub fn say(&self, line: impl AsRef<str>) {
        if !self.quiet {
            println!("{}", line.as_ref());
        }
    }

    pub fn insert(&mut self, key: &str, value: impl Into<Value>) {
        self.fields.insert(key.to_string(), value.into());
    }

    pub fn json_line(&self) -> String {
        Value::Object(self.fields.clone()).to_string()
    }
}

/// Percentiles of a set of latencies (seconds).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Latencies {
    pub count: usize,
    pub mean_s: f64,
    pub p50_s: f64,
    pub p95_s: f64,
    pub p99_s: f64,
    pub max_s: f64,
}

impl Latencies {
    /// `None` for an empty set.
    pub fn of(samples: &[f64]) -> Option<Self> {
        if samples.is_empty() {
            return None;
        }
        let mut v = samples.to_vec();
        v.sort_by(f64::total_cmp);
        Some(Self {
            count: v.len(),
            mean_s: v.iter().sum::<f64>() / v.len() as f64,
            p50_s: percentile(&v, 50.0),
            p95_s: percentile(&v, 95.0),
            p99_s: percentile(&v, 99.0),
            max_s: v[v.len() - 1],
        })
    }

    pub fn to_json(self) -> Value {
        json!({
            "count": self.count,
            "mean_s": self.mean_s,
            "p50_s": self.p50_s,
            "p95_s": self.p95_s,
            "p99_s": self.p99_s,
            "max_s": self.max_s,
        })
    }

    pub fn line(&self) -> String {
        format!(
            "p50 {:.3} s, p95 {:.3} s, p99 {:.3} s, mean {:.3} s, max {:.3} s ({} requests)",
            self.p50_s, self.p95_s, self.p99_s, self.mean_s, self.max_s, self.count
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_summary() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        let l = Latencies::of(&v).unwrap();
        assert_eq!((l.p50_s, l.p95_s, l.p99_s), (50.0, 95.0, 99.0));
        let l = Latencies::of(&[4.0, 1.0, 3.0, 2.0]).unwrap();
        assert_eq!((l.p50_s, l.max_s, l.mean_s), (2.0, 4.0, 2.5));
        assert!(Latencies::of(&[]).is_none());
    }

    #[test]
    fn json_line_holds_every_field() {
        let mut r = Report::new(true);
        r.insert("a", 1.5);
        r.insert("b", "x");
        let v: Value = serde_json::from_str(&r.json_line()).unwrap();
        assert_eq!(v["a"], 1.5);
        assert_eq!(v["b"], "x");
    }
}
