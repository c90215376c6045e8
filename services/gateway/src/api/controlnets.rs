//! `GET /v1/controlnets`: the ControlNets a generation may name now
//! (`crate::controlnet_directory`).
use actix_web::{web, HttpRequest, HttpResponse};

use crate::controlnet_directory::ControlNetList;
use crate::error::{ApiError, ErrorBody};
use crate::state::ApiState;

#[utoipa::path(
    get,
    path = "/v1/controlnets",
    tag = "images",
    responses(
        (status = 200, description = "The ControlNets a generation's `controlnet.name` may name \
            now, with the denoisers and ControlNet workers that serve each", body = ControlNetList),
        (status = 401, description = "Missing or unknown API key", body = ErrorBody),
    ),
    security((), ("api_key" = []))
)]
pub async fn list_controlnets(
    req: HttpRequest,
    state: web::Data<ApiState>,
) -> Result<HttpResponse, ApiError> {
    state.caller(&req)?;
    Ok(HttpResponse::Ok().json(ControlNetList {
        object: "list".into(),
        data: state.directory.controlnets().await,
    }))
}
