//! What ControlNets cost a step loop, smoothed, per job and per ControlNet (both engines): the
//! figures heartbeats report so a router can cost a steered job before it runs.
use diffmesh_shared::wire::messages::ControlNetStepCost;

/// An exponentially smoothed per-step cost (the first sample taken as it is).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Smoothed(Option<f64>);

/// Weight of the newest sample.
const SMOOTHING: f64 = 0.2;

impl Smoothed {
    pub(crate) fn observe(&mut self, seconds: f64) {
        if !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        self.0 = Some(match self.0 {
            Some(v) => v + SMOOTHING * (seconds - v),
            None => seconds,
        });
    }

    pub(crate) fn value(self) -> f64 {
        self.0.unwrap_or(0.0)
    }
}

/// Per ControlNet name: the seconds the step loop spends a step on one job it steers (its
/// forward here, or the wait for a ControlNet worker's residuals), so a router can cost a
/// steered job before it runs. A step's ControlNet time is split evenly among the jobs it
/// steered: remote rows compute at once, so a job's own share is not observable.
#[derive(Debug, Default)]
pub(crate) struct ControlCosts(std::collections::BTreeMap<String, Smoothed>);

impl ControlCosts {
    pub(crate) fn observe(&mut self, name: &str, seconds: f64) {
        self.0.entry(name.to_string()).or_default().observe(seconds);
    }

    pub(crate) fn of(&self, name: &str) -> f64 {
        self.0.get(name).map_or(0.0, |s| s.value())
    }

    pub(crate) fn list(&self) -> Vec<ControlNetStepCost> {
        self.0
            .iter()
            .map(|(name, s)| ControlNetStepCost {
                name: name.clone(),
                seconds: s.value(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn costs_smooth_per_controlnet_and_skip_nonsense() {
        let mut costs = ControlCosts::default();
        assert_eq!(costs.of("edges"), 0.0);
        costs.observe("edges", 1.0);
        assert_eq!(costs.of("edges"), 1.0);
        costs.observe("edges", 2.0);
        assert!((costs.of("edges") - 1.2).abs() < 1e-12);
        costs.observe("edges", f64::NAN);
        costs.observe("edges", -1.0);
        assert!((costs.of("edges") - 1.2).abs() < 1e-12);
        costs.observe("depth", 0.5);
        let listed: Vec<(String, f64)> = costs
            .list()
            .into_iter()
            .map(|c| (c.name, c.seconds))
            .collect();
        assert_eq!(listed[0], ("depth".to_string(), 0.5));
        assert_eq!(listed[1].0, "edges");
    }
}
