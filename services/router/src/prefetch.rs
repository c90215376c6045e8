//! Template cache prefetch: when an edit that reads a template's activation cache is placed,
//! ask the cachestore to promote that cache into its memory tier, so loading it overlaps the
//! job's wait in the denoiser's queue (FlashPS). Fire and forget: a lost prefetch only means the
//! denoiser's first read comes from a lower tier.
use diffmesh_shared::nats::publish_msgpack;
use diffmesh_shared::wire::cachestore::{prefetch_subject, template_keys, CachePrefetch};
use diffmesh_shared::wire::messages::{DenoiseJob, JobKind};

/// The prefetch for `job`, if it is an edit of a captured template.
pub fn template_prefetch(job: &DenoiseJob) -> Option<CachePrefetch> {
    let template = job.template.as_ref()?;
    if job.kind != JobKind::Edit || template.cache_key.is_empty() {
        return None;
    }
    Some(CachePrefetch {
        keys: template_keys(&template.cache_key, template.steps),
    })
}

/// Publish the prefetch for `job` (if any) to the cachestore; failures are logged only.
pub async fn prefetch_template_cache(client: &async_nats::Client, job: &DenoiseJob) {
    let Some(prefetch) = template_prefetch(job) else {
        return;
    };
    let subject = prefetch_subject();
    if let Err(err) = publish_msgpack(client, subject, Some(&job.job_id), &prefetch).await {
        tracing::warn!(job_id = %job.job_id, error = %err, "could not publish a cache prefetch");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diffmesh_shared::testing::generation_job;
    use diffmesh_shared::wire::messages::TemplateRef;

    #[test]
    fn only_edits_of_captured_templates_prefetch() {
        let mut job = generation_job("j1", "a cat", 1, 4);
        assert_eq!(template_prefetch(&job), None);
        job.kind = JobKind::Edit;
        assert_eq!(template_prefetch(&job), None);
        job.template = Some(TemplateRef {
            template_id: "t".into(),
            prompt: String::new(),
            seed: 1,
            steps: 2,
            guidance_scale: 1.0,
            cache_key: String::new(),
        });
        assert_eq!(template_prefetch(&job), None, "not captured yet");
        job.template.as_mut().unwrap().cache_key = "tpl-k".into();
        assert_eq!(
            template_prefetch(&job).unwrap().keys,
            vec!["tpl-k/meta", "tpl-k/s0", "tpl-k/s1"]
        );
        job.kind = JobKind::Capture;
        assert_eq!(template_prefetch(&job), None, "a capture writes the cache");
    }
}
