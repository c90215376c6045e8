//! What a request brings to the Stable Diffusion loop beside its prompt: an image to repaint
//! under a mask ([`InpaintInputs`], `inpaint`) and a template's trajectory to edit
//! mask-aware ([`SdTemplate`], `template`). Plain data below the loop (`stepper`), so the loop
//! and the modules that build its states do not import each other.
use crate::unet::masked::UNetTemplateCache;
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

/// A template's trajectory: per step of its schedule, what its UNet left its edits.
#[derive(Debug)]
pub struct SdTemplate {
    /// Indexed by step; `None` before the step its strength starts at.
    pub steps: Vec<Option<UNetTemplateCache>>,
    /// UNet rows per step (2 when guided).
    pub rows: i64,
}

// SAFETY: a template is written once, by its capture, before it is shared; afterwards every
// use through `&SdTemplate` is a read-only torch op (narrow, cat, conversion), which libtorch
// allows from several threads at once on one tensor (reference counts are atomic). `Tensor` is
// not `Sync` only because it wraps a raw pointer.
unsafe impl Sync for SdTemplate {}

impl SdTemplate {
    /// Bytes the caches hold.
    pub fn bytes(&self) -> u64 {
        self.steps.iter().flatten().map(|c| c.bytes()).sum()
    }

    /// The step the template's trajectory starts at.
    pub fn start(&self) -> usize {
        self.steps.iter().take_while(|s| s.is_none()).count()
    }
}
