//! A job's inputs read from the object store before it reaches the engine: an edit's template
//! pixels and token mask, a steered generation's control image.
use crate::model::EditInputs;
use crate::service::{Service, MAX_INPUT_BYTES};
use diffmesh_shared::wire::messages::{DenoiseJob, JobKind};

impl Service {
    /// The prepared template and token mask of an edit (None for generations).
    pub(crate) async fn fetch_edit_inputs(
        &self,
        job: &DenoiseJob,
    ) -> Result<Option<EditInputs>, String> {
        if job.kind == JobKind::Generate {
            return Ok(None);
        }
        // A registered template's pixels are kept with it (and held here after the first
        // read); an upload's come with the job.
        let template_rgb =
            match (&job.inputs.template_image_key, &job.inputs.image_key) {
                (Some(key), _) => {
                    let (pixels, lookup) =
                        self.templates.pixels.get(key).await.map_err(|e| {
                            format!("reading `inputs.template_image_key` {key}: {e}")
                        })?;
                    self.metrics
                        .template_pixels_lookups
                        .with_label_values(&[lookup.as_str()])
                        .inc();
                    pixels.to_vec()
                }
                (None, Some(key)) => self.read_input("image_key", key).await?,
                (None, None) => return Err("edit job without `inputs.image_key`".into()),
            };
        if job.kind == JobKind::Capture {
            return Ok(Some(EditInputs {
                template_rgb,
                token_mask: Vec::new(),
            }));
        }
        let mask_key = job
            .inputs
            .token_mask_key
            .as_deref()
            .ok_or("edit job without `inputs.token_mask_key`")?;
        let token_mask = self.read_input("token_mask_key", mask_key).await?;
        Ok(Some(EditInputs {
            template_rgb,
            token_mask,
        }))
    }

    /// The model-resolution control images of a steered generation, one per ControlNet in
    /// `params.controlnets()` order (none when it has no ControlNet); fails, naming the field,
    /// when this denoiser does not hold one of its ControlNets.
    pub(crate) async fn fetch_control_images(
        &self,
        job: &DenoiseJob,
    ) -> Result<Vec<Vec<u8>>, String> {
        let names: Vec<&str> = job.params.controlnets().map(|c| c.name.as_str()).collect();
        if names.is_empty() {
            return Ok(Vec::new());
        }
        let served = self.controlnets_served();
        let listed = names.len() > 1;
        if let Some((i, name)) = names
            .iter()
            .enumerate()
            .find(|(_, n)| !served.iter().any(|s| s == *n))
        {
            let field = match listed {
                true => format!("controlnets[{i}].name"),
                false => "controlnet.name".to_string(),
            };
            return Err(format!("{field}: no ControlNet `{name}` on this denoiser"));
        }
        let keys: Vec<&String> = job
            .inputs
            .control_image_key
            .iter()
            .chain(&job.inputs.extra_control_image_keys)
            .collect();
        if keys.len() != names.len() {
            return Err(format!(
                "a job with {} ControlNets and {} control images (`inputs.control_image_key`, \
                 `inputs.extra_control_image_keys`)",
                names.len(),
                keys.len()
            ));
        }
        let mut images = Vec::with_capacity(keys.len());
        for (i, key) in keys.into_iter().enumerate() {
            let field = match i {
                0 => "control_image_key".to_string(),
                i => format!("extra_control_image_keys[{}]", i - 1),
            };
            images.push(self.read_input(&field, key).await?);
        }
        Ok(images)
    }

    /// The object-store blob a job's `inputs.<field>` names; an error names the field.
    async fn read_input(&self, field: &str, key: &str) -> Result<Vec<u8>, String> {
        self.blobs
            .get_limited(key, MAX_INPUT_BYTES)
            .await
            .map_err(|e| format!("reading `inputs.{field}` {key}: {e}"))
    }
}
