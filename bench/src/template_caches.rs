//! Registered templates for the batching bench: one template per step count, captured once by
//! the real engine (a capture job each, as `POST /v1/templates` runs it), so the bench's edits
//! run mask-aware from their template's cache, as production edits by `template_id` do.
use crate::driver::{BenchEngine, BenchModel};
use crate::workload::{denoise_job, BenchRequest};
use anyhow::{Context, Result};
use diffmesh_denoiser::cached_step::TemplateSlot;
use diffmesh_denoiser::engine::{EngineConfig, EngineJob};
use diffmesh_denoiser::model::EditInputs;
use diffmesh_denoiser::templates::TemplateEntry;
use diffmesh_shared::wire::messages::{JobKind, TemplateRef};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;
use std::sync::Arc;

struct BenchTemplate {
    rgb: Vec<u8>,
    reference: TemplateRef,
    entry: Arc<TemplateEntry>,
}

/// A captured template per step count; edits use the one of their own step count.
pub struct BenchTemplates {
    by_steps: HashMap<u32, BenchTemplate>,
    /// Cache bytes over all templates.
    pub bytes: u64,
    pub capture_seconds: f64,
}

impl BenchTemplates {
    /// Capture a random-pixel template for every step count in `steps_min..=steps_max`.
    pub async fn capture(
        model: &BenchModel,
        steps_min: u32,
        steps_max: u32,
        seed: u64,
    ) -> Result<Self> {
        let started = std::time::Instant::now();
        let mut engine = BenchEngine::start(model, EngineConfig::default())?;
        let grid = engine.grid;
        let mut by_steps = HashMap::new();
        for steps in steps_min..=steps_max {
            let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (u64::from(steps) << 32));
            let pixels = (grid.pixels * grid.pixels * 3) as usize;
            let rgb: Vec<u8> = (0..pixels).map(|_| rng.random()).collect();
            let req = BenchRequest {
                id: format!("capture-{steps}"),
                unit_arrival: 0.0,
                steps,
                seed: rng.random(),
                prompt: String::new(),
                mask_ratio: None,
            };
            let mut job = denoise_job(&req, grid, None);
            let reference = TemplateRef {
                template_id: format!("bench-template-{steps}"),
                prompt: req.prompt.clone(),
                seed: req.seed,
                steps,
                guidance_scale: job.params.guidance_scale,
                cache_key: format!("bench-template-{steps}"),
            };
            job.kind = JobKind::Capture;
            job.template = Some(reference.clone());
            let capture = EngineJob {
                control_rgb: Vec::new(),
                prompts: None,
                job,
                edit: Some(EditInputs {
                    template_rgb: rgb.clone(),
                    token_mask: vec![1; grid.tokens() as usize],
                }),
                template: None,
                capture_key: Some(reference.cache_key.clone()),
                lora: None,
            };
            engine.submit(capture).await?;
            let entry = engine
                .next_captured()
                .await
                .with_context(|| format!("capturing the {steps}-step template"))?;
            by_steps.insert(
                steps,
                BenchTemplate {
                    rgb,
                    reference,
                    entry,
                },
            );
        }
        engine.stop().await;
        let bytes = by_steps.values().map(|t| t.entry.bytes()).sum();
        Ok(Self {
            by_steps,
            bytes,
            capture_seconds: started.elapsed().as_secs_f64(),
        })
    }

    /// Make an edit one of its step count's template: the template's pixels, its reference
    /// and its cache (already fetched, as from the denoiser's local tier). Generations, and
    /// edits of a step count without a template, pass unchanged.
    pub fn attach(&self, mut job: EngineJob) -> EngineJob {
        if job.job.kind != JobKind::Edit {
            return job;
        }
        let Some(t) = self.by_steps.get(&job.job.params.num_inference_steps) else {
            return job;
        };
        if let Some(edit) = job.edit.as_mut() {
            edit.template_rgb = t.rgb.clone();
        }
        job.job.template = Some(t.reference.clone());
        // The content hash production edits carry (the engine shares the template's latents by it).
        job.job.inputs.template_id = Some(t.reference.template_id.clone());
        let slot: TemplateSlot = Default::default();
        let _ = slot.set(Some(t.entry.clone()));
        job.template = Some(slot);
        job
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{engine_job, requests, WorkloadSpec};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edits_with_an_attached_template_step_mask_aware() {
        let dir = BenchModel {
            dir: std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../weights/tiny"),
            kind: diffmesh_model::tch::Kind::Float,
            device: diffmesh_model::tch::Device::Cpu,
            masked_attention: Default::default(),
        };
        let templates = BenchTemplates::capture(&dir, 3, 4, 1).await.unwrap();
        assert!(templates.bytes > 0);
        let spec = WorkloadSpec {
            requests: 6,
            edit_fraction: 0.5,
            steps_min: 3,
            steps_max: 4,
            seed: 2,
        };
        let reqs = requests(&spec, &[0.1, 0.3]).unwrap();
        let edits = reqs.iter().filter(|r| r.mask_ratio.is_some()).count();
        assert!(edits > 0 && edits < reqs.len(), "{edits} edits");
        let mut engine = BenchEngine::start(&dir, EngineConfig::default()).unwrap();
        engine.mark_start();
        let mut edit_steps = 0;
        for r in &reqs {
            let job = templates.attach(engine_job(r, engine.grid));
            assert_eq!(job.template.is_some(), r.mask_ratio.is_some());
            if r.mask_ratio.is_some() {
                edit_steps += u64::from(r.steps);
            }
            engine.submit(job).await.unwrap();
        }
        for _ in &reqs {
            engine.next_finished().await.unwrap();
        }
        // Every edit step (and no generation step) ran mask-aware from its template's cache.
        assert_eq!(engine.step_stats().mask_aware_rows, edit_steps);
        engine.stop().await;
    }
}
