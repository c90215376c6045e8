//! Which accepted edits read a template, so deleting it waits for them instead of pulling their
//! inputs away mid-job.
//!
//! Each edit by template leaves one message on the stream `subjects::TEMPLATE_USES_STREAM`,
//! subject `diffmesh.template-uses.<template id>.<job id>`, from before its inputs are prepared until its job
//! record ends; the stream keeps one message per subject and forgets them after a day, so a
//! use whose gateway died cannot pin a template for long. Counting a template's uses lists its
//! subjects (stream info with a subject filter, answered by the stream's leader) and keeps only
//! those whose job record has not ended: a job that ended, was cancelled or expired no longer
//! counts, whoever drove it.
//!
//! The edit and the delete each write, then read what the other writes: an edit publishes its
//! use and then re-reads the template's record (it must still be `ready`); a delete marks the
//! record `deleting` and then counts uses. Whichever writes second sees the other's write, so
//! an edit either is refused or is counted. That needs reads answered by the streams' leaders
//! (on a cluster a follower may lag): the record bucket takes no direct reads
//! (`jetstream_layout::TEMPLATE_RECORDS`) and stream info always comes from the leader.
use async_nats::jetstream::{self, stream};
use diffmesh_shared::stores::jetstream_layout::TEMPLATE_USES;
use diffmesh_shared::stores::job::JobStore;
use diffmesh_shared::stores::transient::{self, no_error_settles, ELECTION_WINDOW};
use diffmesh_shared::wire::subjects::{template_use, template_uses_of};
use diffmesh_shared::MeshError;
use futures::TryStreamExt;

use crate::error::ApiError;
use crate::templates::record::ready;
use crate::templates::record::TemplateStore;

fn internal(what: &str, err: impl std::fmt::Display) -> ApiError {
    ApiError::Internal(format!("template uses: {what}: {err}"))
}

/// The uses stream plus what deciding about a use reads: template and job records.
#[derive(Clone)]
pub struct TemplateUses {
    js: jetstream::Context,
    stream: stream::Stream,
    records: TemplateStore,
    jobs: JobStore,
}

impl TemplateUses {
    /// Open (creating when missing) the uses stream.
    pub async fn open(
        js: &jetstream::Context,
        records: TemplateStore,
        jobs: JobStore,
    ) -> Result<Self, MeshError> {
        let stream = TEMPLATE_USES.get_or_create(js).await?;
        Ok(Self {
            js: js.clone(),
            stream,
            records,
            jobs,
        })
    }

    /// Note that `job_id` reads `template_id`, then check the template still takes edits: on
    /// an error the use is gone again and the edit must not run (409 once it is `deleting`).
    pub async fn begin(&self, template_id: &str, job_id: &str) -> Result<(), ApiError> {
        let subject = template_use(template_id, job_id);
        // Publishing again is harmless: the stream keeps one message per subject.
        transient::retried_bounded(
            "template_use.publish",
            ELECTION_WINDOW,
            Some(transient::REQUEST_ATTEMPT_TIMEOUT),
            no_error_settles,
            || async {
                self.js
                    .publish(subject.clone(), job_id.to_string().into())
                    .await
                    .map_err(|e| internal("publish", e))?
                    .await
                    .map_err(|e| internal("publish ack", e))
            },
        )
        .await?;
        let still = match self.records.get(template_id).await {
            Ok(Some(record)) => ready(&record),
            Ok(None) => Err(super::record::not_found(template_id)),
            Err(err) => Err(err),
        };
        if still.is_err() {
            self.end(template_id, job_id).await;
        }
        still
    }

    /// The job no longer reads the template (its record ended). Best effort: a use left
    /// behind stops counting once its job record has ended.
    pub async fn end(&self, template_id: &str, job_id: &str) {
        let subject = template_use(template_id, job_id);
        let purged = transient::retried_bounded(
            "template_use.end",
            ELECTION_WINDOW,
            Some(transient::REQUEST_ATTEMPT_TIMEOUT),
            no_error_settles,
            || {
                let purge = self.stream.purge().filter(subject.clone());
                async move { purge.await }
            },
        )
        .await;
        if let Err(err) = purged {
            tracing::warn!(%template_id, %job_id, error = %err, "could not end a template use");
        }
    }

    /// Jobs that read `template_id` and have not ended. Uses whose job ended (or whose record
    /// is gone) are removed on the way.
    pub async fn in_flight(&self, template_id: &str) -> Result<Vec<String>, ApiError> {
        let job_ids = transient::retried(
            "template_use.list",
            ELECTION_WINDOW,
            no_error_settles,
            || self.use_job_ids(template_id),
        )
        .await?;
        let mut live = Vec::new();
        for job_id in job_ids {
            match self.jobs.get(&job_id).await? {
                Some(record) if !record.state.is_terminal() => live.push(job_id),
                _ => self.end(template_id, &job_id).await,
            }
        }
        live.sort();
        Ok(live)
    }

    /// The job ids of every use of `template_id` the stream holds (ended or not).
    async fn use_job_ids(&self, template_id: &str) -> Result<Vec<String>, ApiError> {
        let mut info = self
            .stream
            .info_with_subjects(template_uses_of(template_id))
            .await
            .map_err(|e| internal("list", e))?;
        let mut job_ids = Vec::new();
        while let Some((subject, _count)) =
            info.try_next().await.map_err(|e| internal("list", e))?
        {
            if let Some(job_id) = subject.rsplit('.').next() {
                job_ids.push(job_id.to_string());
            }
        }
        Ok(job_ids)
    }
}
