//! The browser playground at `/`: one page (HTML, CSS and plain JavaScript embedded in the
//! binary, no external resources, so it works offline) where a person uploads an image or picks
//! a registered template, paints a mask, types a prompt, submits the edit as an async job and
//! watches its Server-Sent Events until the result appears. The page talks only to the public
//! API (`/v1/templates`, `/v1/images/edits`, `/v1/jobs/...`), with the API key a person types
//! when keys are configured.
//!
//! The page is assembled once per variant (keys on or off): the style and script are inlined,
//! and the Content-Security-Policy allows exactly those two by their SHA-256, so nothing else
//! can run or load on the page.
pub mod template_image;

use std::sync::OnceLock;

use actix_web::http::header::{CACHE_CONTROL, CONTENT_SECURITY_POLICY, X_CONTENT_TYPE_OPTIONS};
use actix_web::{web, HttpResponse};
use base64::Engine;
use sha2::{Digest, Sha256};

use crate::state::ApiState;

const INDEX_HTML: &str = include_str!("index.html");
const STYLE_CSS: &str = include_str!("style.css");
const APP_JS: &str = include_str!("app.js");

/// Markers in `index.html` replaced by the style, the script and the key flag.
const STYLE_MARKER: &str = "/* diffmesh:style */";
const SCRIPT_MARKER: &str = "/* diffmesh:script */";
const AUTH_MARKER: &str = "{{auth_required}}";

/// A rendered page and the Content-Security-Policy that lets exactly its inline parts run.
pub struct Page {
    pub html: String,
    pub csp: String,
}

fn csp_hash(text: &str) -> String {
    let digest = Sha256::digest(text.as_bytes());
    format!(
        "'sha256-{}'",
        base64::engine::general_purpose::STANDARD.encode(digest)
    )
}

/// Build the page. `auth_required` shows the API key field from the start (the page also shows
/// it whenever a request answers 401).
pub fn render(auth_required: bool) -> Page {
    // The flag first, so text inside the style or script can never be taken for the marker.
    let html = INDEX_HTML
        .replace(AUTH_MARKER, if auth_required { "true" } else { "false" })
        .replace(STYLE_MARKER, STYLE_CSS)
        .replace(SCRIPT_MARKER, APP_JS);
    let csp = format!(
        "default-src 'none'; script-src {}; style-src {}; img-src 'self' blob: data:; \
         connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
        csp_hash(APP_JS),
        csp_hash(STYLE_CSS)
    );
    Page { html, csp }
}

fn cached(auth_required: bool) -> &'static Page {
    static PAGES: OnceLock<[Page; 2]> = OnceLock::new();
    &PAGES.get_or_init(|| [render(false), render(true)])[usize::from(auth_required)]
}

#[utoipa::path(
    get,
    path = "/",
    tag = "playground",
    responses((status = 200, description = "The browser playground: upload an image or pick a \
        template, paint a mask, type a prompt, watch the async job's progress and see the result",
        content_type = "text/html", body = String)),
)]
pub async fn page(state: web::Data<ApiState>) -> HttpResponse {
    let page = cached(state.keys.is_enabled());
    HttpResponse::Ok()
        .content_type("text/html; charset=utf-8")
        .insert_header((CONTENT_SECURITY_POLICY, page.csp.as_str()))
        .insert_header((X_CONTENT_TYPE_OPTIONS, "nosniff"))
        .insert_header((CACHE_CONTROL, "no-cache"))
        .body(page.html.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_inlines_style_and_script_and_allows_exactly_them() {
        for auth in [false, true] {
            let page = render(auth);
            assert!(!page.html.contains(STYLE_MARKER) && !page.html.contains(SCRIPT_MARKER));
            assert!(!page.html.contains(AUTH_MARKER));
            assert!(page.html.contains(&format!("<script>{APP_JS}</script>")));
            assert!(page.html.contains(&format!("<style>{STYLE_CSS}</style>")));
            assert!(page
                .html
                .contains(&format!("data-auth-required=\"{auth}\"")));
            assert!(page.csp.contains(&csp_hash(APP_JS)));
            assert!(page.csp.contains(&csp_hash(STYLE_CSS)));
            assert!(!page.csp.contains("unsafe-inline"));
        }
    }

    #[test]
    fn page_loads_nothing_from_elsewhere() {
        let page = render(false);
        for needle in [
            "http://",
            "https://",
            "//cdn",
            "<link rel=\"stylesheet\"",
            "src=\"http",
        ] {
            assert!(!page.html.contains(needle), "the page refers to {needle}");
        }
    }

    #[test]
    fn page_uses_the_documented_api() {
        for path in [
            "/v1/templates",
            "/v1/images/edits",
            "respond-async",
            "/image",
            "Authorization",
        ] {
            assert!(APP_JS.contains(path), "app.js never uses {path}");
        }
    }
}
