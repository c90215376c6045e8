//! Which weights each running job needs at this step, and in which order the engine visits them
//! (Katz's bounded asynchronous LoRA loading, BAL, with in-place patching).
//!
//! The weights hold one LoRA set at a time, so a step runs one batched forward per set among the
//! running jobs, switching the weights between them. A job whose adapters are still loading
//! steps on the base model until it has done its bound of steps (`floor(fraction * steps)`):
//! the early, layout-forming steps, where Katz found a LoRA changes little. At the bound it sits
//! steps out until the adapters are in memory; a bound of 0 is synchronous loading.
use crate::lora::metrics::LoraMetrics;
use crate::lora::{LoadedLora, LoraFailure, LoraSlot};
use diffmesh_model::lora::{LoraAdapter, LoraPatcher, LoraSetKey, PatchStats, WeightedLora};
use diffmesh_model::ModelError;
use std::time::Instant;

/// What one job needs for its next step.
#[derive(Debug, Clone)]
pub(crate) enum LoraNeed {
    /// The base model (for a job with adapters: they are still loading, within its bound).
    Base,
    /// The weights patched with this set.
    Set(LoraSetKey, Vec<LoadedLora>),
    /// Nothing this step: its adapters are late past its bound.
    Wait,
    /// Its adapters cannot be had (the reason).
    Failed(LoraFailure),
}

impl LoraNeed {
    /// The weights this need runs on, if it runs.
    pub(crate) fn key(&self) -> Option<LoraSetKey> {
        match self {
            LoraNeed::Base => Some(LoraSetKey::default()),
            LoraNeed::Set(k, _) => Some(k.clone()),
            LoraNeed::Wait | LoraNeed::Failed(_) => None,
        }
    }
}

/// The weights a set of adapters makes.
pub(crate) fn set_key(set: &[LoadedLora]) -> LoraSetKey {
    LoraSetKey::new(set.iter().map(|l| (l.blob.id.as_str(), l.weight)))
}

/// Steps a job may run on the base model while its adapters load.
pub(crate) fn async_bound(total_steps: usize, fraction: f64) -> usize {
    let f = if fraction.is_finite() {
        fraction.clamp(0.0, 1.0)
    } else {
        0.0
    };
    // A bound at the last step would let a job finish without its adapters.
    ((total_steps as f64 * f).floor() as usize).min(total_steps.saturating_sub(1))
}

/// The need of a job with `slot` (None: no adapters) that has done `done` of `total` steps.
pub(crate) fn need(slot: Option<&LoraSlot>, done: usize, total: usize, fraction: f64) -> LoraNeed {
    let Some(slot) = slot else {
        return LoraNeed::Base;
    };
    match slot.get() {
        Some(Ok(set)) => LoraNeed::Set(set_key(set), set.clone()),
        Some(Err(e)) => LoraNeed::Failed(e.clone()),
        None if done < async_bound(total, fraction) => LoraNeed::Base,
        None => LoraNeed::Wait,
    }
}

/// The weight sets to visit this step, each with the indices of the jobs that run on it: the set
/// the weights hold now first (no switch), then the others in key order (the base model first).
pub(crate) fn visit_order(
    needs: &[LoraNeed],
    current: &LoraSetKey,
) -> Vec<(LoraSetKey, Vec<LoadedLora>, Vec<usize>)> {
    let mut groups: Vec<(LoraSetKey, Vec<LoadedLora>, Vec<usize>)> = Vec::new();
    for (i, n) in needs.iter().enumerate() {
        let Some(key) = n.key() else { continue };
        match groups.iter_mut().find(|g| g.0 == key) {
            Some(g) => g.2.push(i),
            None => {
                let set = match n {
                    LoraNeed::Set(_, set) => set.clone(),
                    _ => Vec::new(),
                };
                groups.push((key, set, vec![i]));
            }
        }
    }
    groups.sort_by(|a, b| (&a.0 != current, &a.0).cmp(&(&b.0 != current, &b.0)));
    groups
}

/// Patch the weights `patcher` holds to `set`, each adapter's tensors read by `read` (the
/// engine thread reads them, and only for a switch); an adapter that cannot be read is an
/// input error naming `loras: <id>`.
pub(crate) fn patch(
    patcher: &mut LoraPatcher,
    set: &[LoadedLora],
    read: impl Fn(&LoadedLora) -> Result<LoraAdapter, String>,
) -> Result<PatchStats, ModelError> {
    let adapters = set
        .iter()
        .map(|l| read(l).map_err(|e| ModelError::input(format!("loras: {}", l.blob.id), e)))
        .collect::<Result<Vec<_>, _>>()?;
    let weighted: Vec<WeightedLora<'_>> = adapters
        .iter()
        .zip(set)
        .map(|(adapter, l)| WeightedLora {
            adapter,
            weight: l.weight,
        })
        .collect();
    patcher.apply(&weighted)
}

/// Metrics of one job's need at a step that began at `now` (`has_lora`: the job names
/// adapters): the step counted by how its adapters stood, and once they arrive after it sat
/// out past its bound, how long it sat (`waiting_since` keeps when it began to).
pub(crate) fn observe(
    need: &LoraNeed,
    has_lora: bool,
    waiting_since: &mut Option<Instant>,
    now: Instant,
    metrics: Option<&LoraMetrics>,
) {
    if let Some(m) = metrics.filter(|_| has_lora) {
        match need {
            LoraNeed::Base => m
                .lora_steps
                .with_label_values(&["base_while_loading"])
                .inc(),
            LoraNeed::Set(..) => m.lora_steps.with_label_values(&["patched"]).inc(),
            LoraNeed::Wait | LoraNeed::Failed(_) => {}
        }
    }
    match (need, *waiting_since) {
        (LoraNeed::Wait, None) => *waiting_since = Some(now),
        (LoraNeed::Set(..), Some(since)) => {
            *waiting_since = None;
            if let Some(m) = metrics {
                m.lora_wait_seconds.observe((now - since).as_secs_f64());
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lora::LoraBlob;
    use std::sync::Arc;

    /// A one-adapter set (the blob is a minimal valid LoRA file).
    fn set(id: &str) -> Vec<LoadedLora> {
        let bytes = diffmesh_shared::testing::lora_file(&[("x".into(), 1, 1)], 1, 1.0, 1);
        vec![LoadedLora {
            blob: Arc::new(LoraBlob::new(id, bytes.into()).unwrap()),
            weight: 1.0,
        }]
    }

    #[test]
    fn a_loading_job_steps_on_the_base_model_up_to_its_bound_then_waits() {
        let slot: LoraSlot = Default::default();
        // 20 steps, fraction 0.2: 4 steps may run before the adapters arrive.
        for done in 0..4 {
            assert!(matches!(need(Some(&slot), done, 20, 0.2), LoraNeed::Base));
        }
        assert!(matches!(need(Some(&slot), 4, 20, 0.2), LoraNeed::Wait));
        // Synchronous loading: wait from the first step.
        assert!(matches!(need(Some(&slot), 0, 20, 0.0), LoraNeed::Wait));
        slot.set(Ok(set("a"))).unwrap();
        assert!(matches!(need(Some(&slot), 4, 20, 0.2), LoraNeed::Set(..)));
        let failed: LoraSlot = Default::default();
        failed.set(Err(LoraFailure::internal("gone"))).unwrap();
        assert!(
            matches!(need(Some(&failed), 0, 20, 0.2), LoraNeed::Failed(e) if e.message == "gone")
        );
        assert!(matches!(need(None, 7, 20, 0.2), LoraNeed::Base));
    }

    #[test]
    fn the_bound_never_reaches_the_last_step() {
        assert_eq!(async_bound(20, 0.2), 4);
        assert_eq!(async_bound(5, 1.0), 4);
        assert_eq!(async_bound(1, 0.9), 0);
        assert_eq!(async_bound(10, f64::NAN), 0);
        assert_eq!(async_bound(10, -1.0), 0);
    }

    #[test]
    fn the_set_the_weights_hold_goes_first_and_waiting_jobs_are_left_out() {
        let a = LoraNeed::Set(LoraSetKey::new([("a", 1.0)]), set("a"));
        let b = LoraNeed::Set(LoraSetKey::new([("b", 1.0)]), set("b"));
        let base = LoraNeed::Base;
        let needs = [b.clone(), base.clone(), a.clone(), LoraNeed::Wait, b, base];
        let order = visit_order(&needs, &LoraSetKey::new([("b", 1.0)]));
        let got: Vec<(String, Vec<usize>)> = order
            .iter()
            .map(|g| (g.0.to_string(), g.2.clone()))
            .collect();
        assert_eq!(
            got,
            vec![
                ("b*1".to_string(), vec![0, 4]),
                ("base".to_string(), vec![1, 5]),
                ("a*1".to_string(), vec![2]),
            ]
        );
        let order = visit_order(&needs, &LoraSetKey::default());
        assert_eq!(order[0].0.to_string(), "base");
        assert_eq!(order[0].1.len(), 0);
    }
}
