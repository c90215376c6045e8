//! What a request brings to the Stable Diffusion loop beside its prompt: an image to repaint
//! under a mask ([`InpaintInputs`], `inpaint`) and a template's trajectory to edit
//! mask-aware ([`SdTemplate`], `template`). Plain data below the loop (`stepper`), so the loop
//! and the modules that build its states do not import each other.
use crate::error::{ModelError, Result};
use crate::unet::masked::UNetTemplateCache;
use std::sync::Arc;
use tch::Tensor;

/// The image to repaint and where.
pub struct InpaintInputs<'a> {
    /// `[1, 3, H, W]` in [-1, 1].
    pub image: &'a Tensor,
    /// `[1, 1, H, W]` in [0, 1]; at least 0.5 is repainted.
    pub mask: &'a Tensor,
    /// In (0, 1]: how much of the schedule runs (diffusers' default 0.9999).
    pub strength: f64,
}

/// A template's trajectory as its edits read it: per step of its schedule, what its UNet left.
/// A capture made in process holds every step ([`SdTemplate`]); a serving engine decodes each
/// step from the stored cache when the step runs, so an edit holds one step's cache at a time
/// instead of the whole trajectory (tens of GB for SDXL at 1024 px, estimated from the shapes).
pub trait TemplateSteps: Send + Sync {
    /// Steps of the template's schedule.
    fn steps(&self) -> usize;
    /// The step its trajectory starts at (the steps before hold nothing).
    fn start(&self) -> usize;
    /// UNet rows per step (2 when guided).
    fn rows(&self) -> i64;
    /// Step `k`'s cache; an error when it holds none.
    fn step(&self, k: usize) -> Result<Arc<UNetTemplateCache>>;
}

/// A template's whole trajectory in memory (what a capture leaves).
#[derive(Debug)]
pub struct SdTemplate {
    /// Indexed by step; `None` before the step its strength starts at.
    pub steps: Vec<Option<Arc<UNetTemplateCache>>>,
    /// UNet rows per step (2 when guided).
    pub rows: i64,
}

impl SdTemplate {
    /// Bytes the caches hold.
    pub fn bytes(&self) -> u64 {
        self.steps.iter().flatten().map(|c| c.bytes()).sum()
    }
}

impl TemplateSteps for SdTemplate {
    fn steps(&self) -> usize {
        self.steps.len()
    }

    fn start(&self) -> usize {
        self.steps.iter().take_while(|s| s.is_none()).count()
    }

    fn rows(&self) -> i64 {
        self.rows
    }

    fn step(&self, k: usize) -> Result<Arc<UNetTemplateCache>> {
        self.steps
            .get(k)
            .cloned()
            .flatten()
            .ok_or_else(|| ModelError::input("template", format!("holds no cache for step {k}")))
    }
}
