//! Which model a request runs on: the request's `model`, else the gateway's `--default-model`,
//! else the mesh's only model; checked against the models denoisers announce. A model stays
//! known for [`REMEMBER_FOR`] after its last denoiser went quiet, so a restarting denoiser does
//! not turn its requests into 400s (they wait for placement like any other).
use std::collections::HashMap;
use std::time::{Duration, Instant};

use diffmesh_shared::wire::messages::{FieldError, Heartbeat};
use diffmesh_shared::wire::models::ModelCard;

/// How long a model no live denoiser holds stays known.
pub const REMEMBER_FOR: Duration = Duration::from_secs(600);
/// Models kept at most (the least recently heard go first).
pub const MAX_MODELS: usize = 256;

/// A model a request may run on.
#[derive(Debug, Clone, PartialEq)]
pub struct ResolvedModel {
    pub id: String,
    /// Its announcement; None from denoisers that announce only the id (older ones).
    pub card: Option<ModelCard>,
}

impl ResolvedModel {
    /// Its family (`flux.1`, `sd`, `sdxl`), when it announced a card.
    pub fn family(&self) -> Option<&str> {
        self.card.as_ref().map(|c| c.family.as_str())
    }
}

/// Why a request has no model.
#[derive(Debug, Clone, PartialEq)]
pub enum NoModel {
    /// No denoiser has announced any model yet (the mesh is starting).
    NoneHeard,
    /// The request named a model nobody serves, or named none where it must.
    Invalid(FieldError),
}

/// The models heard, by id.
#[derive(Debug, Default)]
pub struct ModelCatalogue {
    models: HashMap<String, (Option<ModelCard>, Instant)>,
}

impl ModelCatalogue {
    /// A heartbeat heard at `at` (a draining denoiser still holds its model).
    pub fn record(&mut self, hb: &Heartbeat, at: Instant) {
        if hb.model.is_empty() {
            return;
        }
        let card = hb.model_card().cloned();
        match self.models.get_mut(&hb.model) {
            Some(entry) => {
                if card.is_some() {
                    entry.0 = card;
                }
                entry.1 = entry.1.max(at);
            }
            None => {
                if self.models.len() >= MAX_MODELS {
                    self.forget_oldest();
                }
                self.models.insert(hb.model.clone(), (card, at));
            }
        }
    }

    fn forget_oldest(&mut self) {
        if let Some(oldest) = self
            .models
            .iter()
            .min_by_key(|(_, (_, at))| *at)
            .map(|(id, _)| id.clone())
        {
            self.models.remove(&oldest);
        }
    }

    /// The model of a request that asked for `requested` (None: left out), given the gateway's
    /// default.
    pub fn resolve(
        &mut self,
        requested: Option<&str>,
        default: Option<&str>,
        now: Instant,
    ) -> Result<ResolvedModel, NoModel> {
        self.models
            .retain(|_, (_, at)| now.saturating_duration_since(*at) < REMEMBER_FOR);
        if self.models.is_empty() {
            return Err(NoModel::NoneHeard);
        }
        let mut ids: Vec<&str> = self.models.keys().map(String::as_str).collect();
        ids.sort_unstable();
        let served = ids.join(", ");
        let found = |id: &str| {
            self.models.get(id).map(|(card, _)| ResolvedModel {
                id: id.to_string(),
                card: card.clone(),
            })
        };
        let invalid = |message: String| NoModel::Invalid(FieldError::invalid("model", message));
        match (requested, default) {
            (Some(id), _) => found(id).ok_or_else(|| {
                invalid(format!("unknown model {id:?}; this mesh serves: {served}"))
            }),
            (None, Some(id)) => found(id).ok_or_else(|| {
                invalid(format!(
                    "left out, and the default model {id:?} (--default-model) is not served; \
                     this mesh serves: {served}"
                ))
            }),
            (None, None) if ids.len() == 1 => Ok(found(ids[0]).expect("listed")),
            (None, None) => Err(invalid(format!(
                "required: this mesh serves several models ({served}) and the gateway has no \
                 --default-model"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::directory::heartbeat;

    fn beat(id: &str, model: &str) -> Heartbeat {
        let mut hb = heartbeat(id, &[], &[], false);
        hb.model = model.into();
        hb
    }

    #[test]
    fn the_request_names_the_model_else_the_default_else_the_only_one() {
        let (mut c, now) = (ModelCatalogue::default(), Instant::now());
        assert_eq!(c.resolve(None, None, now), Err(NoModel::NoneHeard));
        c.record(&beat("d1", "tiny"), now);
        assert_eq!(c.resolve(None, None, now).unwrap().id, "tiny");
        c.record(&beat("d2", "flux-dev"), now);
        assert_eq!(
            c.resolve(Some("flux-dev"), None, now).unwrap().id,
            "flux-dev"
        );
        assert_eq!(c.resolve(None, Some("tiny"), now).unwrap().id, "tiny");
        for (requested, default, says) in [
            (
                Some("sdxl"),
                Some("tiny"),
                "unknown model \"sdxl\"; this mesh serves: flux-dev, tiny",
            ),
            (
                None,
                None,
                "required: this mesh serves several models (flux-dev, tiny)",
            ),
            (
                None,
                Some("gone"),
                "the default model \"gone\" (--default-model) is not served",
            ),
        ] {
            match c.resolve(requested, default, now) {
                Err(NoModel::Invalid(e)) => {
                    assert_eq!(e.field, "model");
                    assert!(e.message.contains(says), "{}", e.message);
                }
                other => panic!("{requested:?}/{default:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_model_is_remembered_for_a_while_and_the_store_is_bounded() {
        let (mut c, t0) = (ModelCatalogue::default(), Instant::now());
        c.record(&beat("d1", "tiny"), t0);
        let later = t0 + REMEMBER_FOR / 2;
        assert!(
            c.resolve(Some("tiny"), None, later).is_ok(),
            "a restart is no 400"
        );
        assert_eq!(
            c.resolve(Some("tiny"), None, t0 + REMEMBER_FOR),
            Err(NoModel::NoneHeard)
        );
        for i in 0..MAX_MODELS + 10 {
            c.record(
                &beat("d", &format!("m{i}")),
                t0 + Duration::from_millis(i as u64),
            );
        }
        assert_eq!(c.models.len(), MAX_MODELS);
        assert!(c.models.contains_key(&format!("m{}", MAX_MODELS + 9)));
        assert!(!c.models.contains_key("m0"), "the oldest went first");
    }

    #[test]
    fn a_card_for_another_id_is_not_taken() {
        let (mut c, now) = (ModelCatalogue::default(), Instant::now());
        let mut hb = beat("d1", "tiny");
        hb.card = Some(diffmesh_shared::wire::models::ModelCard {
            id: "other".into(),
            family: "tiny".into(),
            pipeline: "FluxPipeline".into(),
            geometry: diffmesh_shared::wire::models::ModelGeometry {
                token_pixels: 4,
                resolution: diffmesh_shared::wire::models::Resolution::Fixed {
                    width: 64,
                    height: 64,
                },
                default_width: 64,
                default_height: 64,
            },
            features: Default::default(),
        });
        c.record(&hb, now);
        assert_eq!(c.resolve(None, None, now).unwrap().card, None);
    }
}
