//! The route table: every API route, its handler, and the endpoint label its requests are
//! counted under (`metrics::count_requests`). Nothing but the table lives here.
use actix_web::http::Method;
use actix_web::{web, Resource, Route};

use crate::api::{
    controlnets, events, images, job_list, jobs, loras, models, playground, templates,
};
use crate::openapi;

/// One route of the API.
pub struct ApiRoute {
    pub method: Method,
    pub path: &'static str,
    pub route: Route,
    /// The `endpoint` label of `diffmesh_gateway_requests_total` and
    /// `diffmesh_gateway_request_duration_seconds`; `None`: not counted (the OpenAPI document
    /// and the playground page, which are no API calls).
    pub endpoint: Option<&'static str>,
}

fn route(
    method: Method,
    path: &'static str,
    route: Route,
    endpoint: Option<&'static str>,
) -> ApiRoute {
    ApiRoute {
        method,
        path,
        route,
        endpoint,
    }
}

/// Every API route. `configure` registers exactly these, the request metrics label them by
/// `endpoint`, and the OpenAPI test checks that each one is documented.
pub fn routes() -> Vec<ApiRoute> {
    use Method as M;
    vec![
        route(
            M::POST,
            "/v1/images/edits",
            web::post().to(images::edits),
            Some("edits"),
        ),
        route(
            M::POST,
            "/v1/images/generations",
            web::post().to(images::generations),
            Some("generations"),
        ),
        route(
            M::POST,
            "/v1/images/variations",
            web::post().to(images::variations),
            Some("variations"),
        ),
        route(
            M::GET,
            "/v1/jobs",
            web::get().to(job_list::list_jobs),
            Some("jobs_list"),
        ),
        route(
            M::GET,
            "/v1/jobs/{id}",
            web::get().to(jobs::get_job),
            Some("job"),
        ),
        route(
            M::DELETE,
            "/v1/jobs/{id}",
            web::delete().to(jobs::cancel_job),
            Some("job_cancel"),
        ),
        route(
            M::GET,
            "/v1/jobs/{id}/events",
            web::get().to(events::job_event_stream),
            Some("job_events"),
        ),
        route(
            M::GET,
            "/v1/jobs/{id}/result/{n}",
            web::get().to(jobs::get_result),
            Some("job_result"),
        ),
        route(
            M::POST,
            "/v1/templates",
            web::post().to(templates::create_template),
            Some("templates_create"),
        ),
        route(
            M::GET,
            "/v1/templates",
            web::get().to(templates::list_templates),
            Some("templates_list"),
        ),
        route(
            M::GET,
            "/v1/templates/{id}",
            web::get().to(templates::get_template),
            Some("template"),
        ),
        route(
            M::DELETE,
            "/v1/templates/{id}",
            web::delete().to(templates::delete_template),
            Some("template_delete"),
        ),
        route(
            M::GET,
            "/v1/templates/{id}/image",
            web::get().to(playground::template_image::get_template_image),
            Some("template_image"),
        ),
        route(
            M::POST,
            "/v1/loras",
            web::post().to(loras::create_lora),
            Some("loras_create"),
        ),
        route(
            M::GET,
            "/v1/loras",
            web::get().to(loras::list_loras),
            Some("loras_list"),
        ),
        route(
            M::GET,
            "/v1/loras/{id}",
            web::get().to(loras::get_lora),
            Some("lora"),
        ),
        route(
            M::DELETE,
            "/v1/loras/{id}",
            web::delete().to(loras::delete_lora),
            Some("lora_delete"),
        ),
        route(
            M::GET,
            "/v1/controlnets",
            web::get().to(controlnets::list_controlnets),
            Some("controlnets_list"),
        ),
        route(
            M::GET,
            "/v1/models",
            web::get().to(models::list_models),
            Some("models_list"),
        ),
        route(M::GET, "/openapi.json", web::get().to(openapi::serve), None),
        route(M::GET, "/", web::get().to(playground::page), None),
    ]
}

/// The endpoint label of each counted route, by method and path pattern.
pub fn endpoints() -> Vec<(Method, &'static str, &'static str)> {
    routes()
        .into_iter()
        .filter_map(|r| r.endpoint.map(|e| (r.method, r.path, e)))
        .collect()
}

/// Register `routes()`, one resource per path (so GET and DELETE share `/v1/jobs/{id}`).
pub fn configure(cfg: &mut web::ServiceConfig) {
    let mut by_path: Vec<(&'static str, Resource)> = Vec::new();
    for r in routes() {
        match by_path.iter().position(|(p, _)| *p == r.path) {
            Some(i) => {
                let (p, resource) = by_path.remove(i);
                by_path.insert(i, (p, resource.route(r.route)));
            }
            None => by_path.push((r.path, web::resource(r.path).route(r.route))),
        }
    }
    for (_, resource) in by_path {
        cfg.service(resource);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_path_is_registered_once_per_method() {
        let mut seen = std::collections::HashSet::new();
        for r in routes() {
            assert!(
                seen.insert((r.method.clone(), r.path)),
                "{} {} twice",
                r.method,
                r.path
            );
        }
        assert!(seen.contains(&(Method::DELETE, "/v1/jobs/{id}")));
    }

    #[test]
    fn every_api_call_is_counted_under_a_label_of_its_own() {
        let mut labels = std::collections::HashSet::new();
        for r in routes() {
            if r.path.starts_with("/v1/") {
                let label = r
                    .endpoint
                    .unwrap_or_else(|| panic!("{} is not counted", r.path));
                assert!(labels.insert(label), "{label} twice");
            }
        }
    }
}
