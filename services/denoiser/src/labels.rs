//! Outcomes the denoiser counts in its metrics, as label values: here, below both the metrics
//! and the services that count them, so neither imports the other.

/// What became of an edit's request to re-capture its template.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecaptureOutcome {
    /// Handed to the engine.
    Started,
    /// Re-captured here recently, or the cache is in the local tier again.
    Recent,
    /// The engine's queue was full, or too many requests waited.
    Busy,
    /// The template's pixels could not be read.
    Failed,
}

impl RecaptureOutcome {
    pub const ALL: [RecaptureOutcome; 4] = [
        RecaptureOutcome::Started,
        RecaptureOutcome::Recent,
        RecaptureOutcome::Busy,
        RecaptureOutcome::Failed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RecaptureOutcome::Started => "started",
            RecaptureOutcome::Recent => "recent",
            RecaptureOutcome::Busy => "busy",
            RecaptureOutcome::Failed => "failed",
        }
    }
}

/// What a denoiser did with one capture broadcast; the label of
/// `diffmesh_denoiser_capture_warmups_total{outcome}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WarmOutcome {
    /// Fetched into the local tier (or joined an edit's fetch of it).
    Loaded,
    /// Already held here.
    Held,
    /// Its own capture.
    Own,
    /// Another model or cache setting: this denoiser's edits would never read it.
    OtherSettings,
    /// It would not fit beside what the tier holds.
    NoRoom,
    /// Gone from the cachestore before it was read (deleted or evicted).
    Missing,
    Failed,
}

impl WarmOutcome {
    pub const ALL: [WarmOutcome; 7] = [
        WarmOutcome::Loaded,
        WarmOutcome::Held,
        WarmOutcome::Own,
        WarmOutcome::OtherSettings,
        WarmOutcome::NoRoom,
        WarmOutcome::Missing,
        WarmOutcome::Failed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            WarmOutcome::Loaded => "loaded",
            WarmOutcome::Held => "held",
            WarmOutcome::Own => "own",
            WarmOutcome::OtherSettings => "other_settings",
            WarmOutcome::NoRoom => "no_room",
            WarmOutcome::Missing => "missing",
            WarmOutcome::Failed => "failed",
        }
    }
}
