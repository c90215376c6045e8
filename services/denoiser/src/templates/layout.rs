//! What a template cache holds of each block: one format, or K/V beside the hidden stream
//! (FlashPS's Y), which lets the engine's three-way planner read either, block by block, step
//! by step: the Y half the bytes where the copy stream bounds the step, K/V where compute does.
use diffmesh_model::flux::KvFormat;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheLayout {
    /// Every block in one format.
    One(KvFormat),
    /// Every block as K/V (raw or prepared) and as the hidden stream: 1.5x the bytes of K/V
    /// in the tiers, while the copy stream carries only the format a block's plan reads.
    KvAndHidden(KvFormat),
}

impl Default for CacheLayout {
    fn default() -> Self {
        CacheLayout::One(KvFormat::Prepared)
    }
}

impl CacheLayout {
    /// `raw`, `prepared`, `hidden` (`y`), or a K/V format with the hidden stream beside it:
    /// `prepared+hidden`, `raw+hidden` (`+y` also reads).
    pub fn parse(s: &str) -> Result<Self, String> {
        let format = |f: &str| KvFormat::parse(f).map_err(|e| e.to_string());
        match s.split_once('+') {
            None => Ok(CacheLayout::One(format(s)?)),
            Some((kv, hidden)) => match (format(kv)?, format(hidden)?) {
                (KvFormat::Hidden, _) | (_, KvFormat::Raw | KvFormat::Prepared) => Err(format!(
                    "expected a K/V format and hidden (y) after `+`, got {s:?}"
                )),
                (kv, KvFormat::Hidden) => Ok(CacheLayout::KvAndHidden(kv)),
            },
        }
    }

    /// The layout of a cache whose blocks come in `formats`, one layer after another.
    pub fn of_layers(formats: &[KvFormat]) -> Result<Self, String> {
        match formats {
            [one] => Ok(CacheLayout::One(*one)),
            [kv @ (KvFormat::Raw | KvFormat::Prepared), KvFormat::Hidden] => {
                Ok(CacheLayout::KvAndHidden(*kv))
            }
            other => Err(format!(
                "a cache holds one format, or K/V then hidden, not {other:?}"
            )),
        }
    }

    /// The name of flags, cache keys, broadcasts and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            CacheLayout::One(f) => f.as_str(),
            CacheLayout::KvAndHidden(KvFormat::Raw) => "raw+hidden",
            CacheLayout::KvAndHidden(_) => "prepared+hidden",
        }
    }

    /// The formats every block is stored in, in storage order.
    pub fn formats(self) -> Vec<KvFormat> {
        match self {
            CacheLayout::One(f) => vec![f],
            CacheLayout::KvAndHidden(kv) => vec![kv, KvFormat::Hidden],
        }
    }

    /// What a block reads when its plan says K/V: the layout's first format.
    pub fn kv(self) -> KvFormat {
        match self {
            CacheLayout::One(f) | CacheLayout::KvAndHidden(f) => f,
        }
    }

    /// What a block reads when its plan says Y: the hidden stream where the layout holds it,
    /// its one format otherwise.
    pub fn y(self) -> KvFormat {
        match self {
            CacheLayout::One(f) => f,
            CacheLayout::KvAndHidden(_) => KvFormat::Hidden,
        }
    }

    /// Whether a block may read either K/V or Y (the three-way planner's choice).
    pub fn three_way(self) -> bool {
        matches!(self, CacheLayout::KvAndHidden(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_parse_and_name_themselves() {
        for name in ["raw", "prepared", "hidden", "prepared+hidden", "raw+hidden"] {
            assert_eq!(CacheLayout::parse(name).unwrap().as_str(), name);
        }
        assert_eq!(
            CacheLayout::parse("prepared+y").unwrap(),
            CacheLayout::KvAndHidden(KvFormat::Prepared)
        );
        for bad in ["hidden+hidden", "prepared+raw", "kv", "prepared+", ""] {
            assert!(CacheLayout::parse(bad).is_err(), "{bad}");
        }
        let both = CacheLayout::KvAndHidden(KvFormat::Raw);
        assert_eq!(CacheLayout::of_layers(&both.formats()), Ok(both));
        assert!(CacheLayout::of_layers(&[KvFormat::Hidden, KvFormat::Raw]).is_err());
        assert_eq!((both.kv(), both.y()), (KvFormat::Raw, KvFormat::Hidden));
        let one = CacheLayout::One(KvFormat::Prepared);
        assert_eq!(
            (one.kv(), one.y(), one.three_way()),
            (KvFormat::Prepared, KvFormat::Prepared, false)
        );
    }
}
