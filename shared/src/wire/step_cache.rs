//! A request's step-cache method on the wire (`GenerationParams::cache_method`).
use serde::{Deserialize, Serialize};

/// A request's step cache (`cache_method`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepCacheMethod {
    /// Probe each step's modulated input before any block; a reused step runs none.
    Teacache,
    /// Run each step's first block and compare its residual; a reused step runs that block
    /// only. Full-compute steps: not for edits of a registered template (mask-aware).
    FirstBlock,
}

impl StepCacheMethod {
    /// The API's name of the method.
    pub fn name(self) -> &'static str {
        match self {
            Self::Teacache => "teacache",
            Self::FirstBlock => "first_block",
        }
    }

    /// The method an API name means (see [`Self::name`]).
    pub fn from_name(name: &str) -> Option<Self> {
        [Self::Teacache, Self::FirstBlock]
            .into_iter()
            .find(|m| m.name() == name)
    }
}
