//! The HTTP handlers, one module per resource. Each reads the request, calls the layers below
//! (`request` parsing and validation, the job driver, the template and LoRA stores) and answers
//! `Result<HttpResponse, ApiError>`; `metrics::count_requests` counts and times every one.
pub mod controlnets;
pub mod events;
pub mod image_request;
pub mod image_stream;
pub mod images;
pub mod job_list;
pub mod jobs;
pub mod loras;
pub mod models;
pub mod playground;
pub mod templates;
pub mod usage;
pub mod variations;
