//! `GET /v1/jobs`: the caller's jobs, newest first, a page at a time (`limit`, `after`),
//! optionally only those of one `status`, in OpenAI's list shape. It reads the owner index of
//! the job bucket (`stores::job::owner_index`: the key's job ids, not every record), then the
//! listed records, each checked against the caller as `GET /v1/jobs/{id}` checks it.
use std::collections::HashMap;

use actix_web::{web, HttpRequest, HttpResponse};
use diffmesh_shared::wire::messages::FieldError;
use futures::StreamExt;
use serde::Serialize;
use utoipa::ToSchema;

use super::jobs::{parse_job_id, JobStatus, JobView};
use crate::error::{ApiError, ErrorBody};
use crate::state::ApiState;

/// Jobs per page unless `limit` says otherwise, and the most it may say.
const DEFAULT_LIMIT: usize = 20;
const MAX_LIMIT: usize = 100;
/// Records read at once while a page is filled.
const READS_IN_FLIGHT: usize = 16;
/// Most records one page reads (a `status` that few jobs match would read them all): past it
/// the page ends early, `has_more` set and `last_id` the last job looked at.
const MAX_SCANNED: usize = 1000;

/// A page of the caller's jobs.
#[derive(Debug, Serialize, ToSchema)]
pub struct JobList {
    /// Always `list`.
    pub object: String,
    /// Newest first.
    pub data: Vec<JobView>,
    pub first_id: Option<String>,
    /// Give it as `after` for the next page: the page's last job, or, when a `status` filter
    /// ended the page early (after 1000 records looked at), the last job looked at.
    pub last_id: Option<String>,
    /// Whether older jobs remain (with `status`, some may not match it).
    pub has_more: bool,
}

/// What the query asks for, checked.
#[derive(Debug, PartialEq)]
struct Page {
    limit: usize,
    after: Option<String>,
    status: Option<JobStatus>,
}

const STATUSES: [JobStatus; 5] = [
    JobStatus::Queued,
    JobStatus::Running,
    JobStatus::Done,
    JobStatus::Failed,
    JobStatus::Cancelled,
];

fn page(query: &HashMap<String, String>) -> Result<Page, FieldError> {
    let limit = match query.get("limit") {
        None => DEFAULT_LIMIT,
        Some(v) => v
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=MAX_LIMIT).contains(n))
            .ok_or_else(|| {
                FieldError::invalid("limit", format!("must be 1 to {MAX_LIMIT}, got {v:?}"))
            })?,
    };
    let after = match query.get("after") {
        None => None,
        Some(id) => Some(
            parse_job_id(id)
                .map_err(|_| FieldError::invalid("after", format!("{id:?} is not a job id")))?,
        ),
    };
    let status = match query.get("status") {
        None => None,
        Some(s) => Some(
            STATUSES
                .into_iter()
                .find(|x| x.as_str() == s)
                .ok_or_else(|| {
                    let names: Vec<&str> = STATUSES.iter().map(|x| x.as_str()).collect();
                    FieldError::invalid("status", format!("one of {names:?}, got {s:?}"))
                })?,
        ),
    };
    Ok(Page {
        limit,
        after,
        status,
    })
}

#[utoipa::path(
    get,
    path = "/v1/jobs",
    tag = "jobs",
    params(
        ("limit" = Option<u32>, Query, description = "Jobs per page, 1 to 100 (default 20)"),
        ("after" = Option<String>, Query, description = "The `last_id` of the previous page"),
        ("status" = Option<String>, Query,
            description = "Only jobs in this state: queued, running, done, failed, cancelled"),
    ),
    responses(
        (status = 200, description = "The caller's jobs, newest first", body = JobList),
        (status = 400, description = "A bad query parameter, named", body = ErrorBody),
        (status = 401, description = "Missing or unknown API key", body = ErrorBody),
    ),
    security((), ("api_key" = []))
)]
pub async fn list_jobs(
    req: HttpRequest,
    state: web::Data<ApiState>,
    query: web::Query<HashMap<String, String>>,
) -> Result<HttpResponse, ApiError> {
    let caller = state.caller(&req)?;
    let page = page(&query)?;
    let owned = state.mesh.jobs.owned_job_ids(caller.owner()).await?;
    let ids = owned.ids;
    let start = match &page.after {
        None => 0,
        Some(after) => {
            ids.iter().position(|id| id == after).ok_or_else(|| {
                FieldError::invalid(
                    "after",
                    format!("{after} is not a job of this key that is still kept"),
                )
            })? + 1
        }
    };
    let jobs = &state.mesh.jobs;
    let mut records = futures::stream::iter(&ids[start..])
        .map(|id| async move { (id, jobs.get(id).await) })
        .buffered(READS_IN_FLIGHT);
    let mut data = Vec::with_capacity(page.limit);
    let (mut has_more, mut scanned, mut looked_at) = (false, 0, None);
    while let Some((id, record)) = records.next().await {
        if data.len() == page.limit || scanned == MAX_SCANNED {
            has_more = true;
            break;
        }
        scanned += 1;
        looked_at = Some(id.clone());
        // Gone since it was indexed (expired), or indexed under a token another key shares.
        let Some(record) = record?.filter(|r| caller.sees(r)) else {
            continue;
        };
        let view = JobView::of(&record);
        if page.status.is_some_and(|s| s != view.status) {
            continue;
        }
        debug_assert_eq!(&view.id, id);
        data.push(view);
    }
    // The index left older jobs out: say there are more (the listing cannot reach them).
    has_more |= owned.truncated && !has_more && scanned > 0;
    let last_id = match (data.len() < page.limit && has_more, data.last()) {
        (true, _) => looked_at,
        (false, last) => last.map(|j| j.id.clone()),
    };
    Ok(HttpResponse::Ok().json(JobList {
        object: "list".into(),
        first_id: data.first().map(|j| j.id.clone()),
        last_id,
        data,
        has_more,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn the_query_is_checked_naming_the_parameter() {
        assert_eq!(
            page(&query(&[])).unwrap(),
            Page {
                limit: DEFAULT_LIMIT,
                after: None,
                status: None
            }
        );
        let id = "6f1c2e4a-8d1b-4c1e-9f5e-3b2a1d0c9e8f";
        let p = page(&query(&[("limit", "5"), ("after", id), ("status", "done")])).unwrap();
        assert_eq!((p.limit, p.after.as_deref()), (5, Some(id)));
        assert_eq!(p.status, Some(JobStatus::Done));
        for (bad, field) in [
            (("limit", "0"), "limit"),
            (("limit", "101"), "limit"),
            (("limit", "x"), "limit"),
            (("after", "nope"), "after"),
            (("status", "finished"), "status"),
        ] {
            assert_eq!(page(&query(&[bad])).unwrap_err().field, field, "{bad:?}");
        }
    }
}
