//! DSpark's additions to the DFlash configuration (speculators 0.9.0's
//! `DSparkSpeculatorConfig`): the Markov head, the confidence head and the
//! block alignment, under the keys speculators names them, plus the weight
//! of the confidence loss in training.
//!
//! Apart from `config` so that module can read and write them without a
//! circle: this one knows nothing of the rest of the draft configuration.

use serde_json::{json, Value};

use super::error::DraftError;

/// The Markov head's variant (`markov_head_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MarkovHeadType {
    /// A first-order bias: `W2 · W1[previous token]`.
    #[default]
    Vanilla,
    /// The previous token's embedding gated by the hidden state:
    /// `W2 · (σ(gate([h, W1[prev]])) ⊙ W1[prev])`.
    Gated,
    /// A recurrent state over the block, updated from the previous token's
    /// embedding and the hidden state at each position.
    Rnn,
}

impl MarkovHeadType {
    /// The name speculators' config uses.
    pub fn name(self) -> &'static str {
        match self {
            MarkovHeadType::Vanilla => "vanilla",
            MarkovHeadType::Gated => "gated",
            MarkovHeadType::Rnn => "rnn",
        }
    }

    /// The variant of a `markov_head_type` value.
    pub fn parse(name: &str) -> Result<Self, DraftError> {
        match name {
            "vanilla" => Ok(MarkovHeadType::Vanilla),
            "gated" => Ok(MarkovHeadType::Gated),
            "rnn" => Ok(MarkovHeadType::Rnn),
            other => Err(DraftError::InvalidConfig(format!(
                "markov_head_type {other:?} is not one of \"vanilla\", \"gated\", \"rnn\""
            ))),
        }
    }
}

/// The keys speculators' `DSparkDraftModel` reads on top of DFlash's.
#[derive(Debug, Clone, PartialEq)]
pub struct DsparkConfig {
    /// Rank of the Markov bias `B = W1 @ W2` (`markov_rank`); 0 switches
    /// the Markov head off (plain DFlash drafting with a confidence head).
    pub markov_rank: i64,
    /// `markov_head_type`.
    pub markov_head_type: MarkovHeadType,
    /// Whether the per-position acceptance head exists (`enable_confidence_head`).
    pub enable_confidence_head: bool,
    /// The confidence head reads `[h, W1[prev]]` instead of `h`
    /// (`confidence_head_with_markov`; needs `markov_rank > 0`).
    pub confidence_head_with_markov: bool,
    /// Slot `k` of a block predicts the token after position `anchor + k`
    /// (`sample_from_anchor`, DSpark's and DeepSpec's convention: `block_size`
    /// drafted tokens per block). Only `true` is implemented.
    pub sample_from_anchor: bool,
    /// Training loss = distillation + `confidence_head_alpha` × confidence
    /// BCE (speculators' default 1.0). Not read by speculators' model; kept
    /// in `config.json` so a checkpoint says how it was trained.
    pub confidence_head_alpha: f64,
}

impl Default for DsparkConfig {
    /// speculators 0.9.0's defaults.
    fn default() -> Self {
        DsparkConfig {
            markov_rank: 256,
            markov_head_type: MarkovHeadType::Vanilla,
            enable_confidence_head: true,
            confidence_head_with_markov: true,
            sample_from_anchor: true,
            confidence_head_alpha: 1.0,
        }
    }
}

impl DsparkConfig {
    /// The bounds `DSparkDraftModel.__init__` enforces, and what this
    /// project implements.
    pub fn validate(&self) -> Result<(), DraftError> {
        let invalid = |reason: String| Err(DraftError::InvalidConfig(reason));
        if self.markov_rank < 0 {
            return invalid(format!(
                "markov_rank {} must be positive, or 0 for no Markov head",
                self.markov_rank
            ));
        }
        if self.enable_confidence_head && self.confidence_head_with_markov && self.markov_rank == 0
        {
            return invalid(
                "confidence_head_with_markov true requires markov_rank > 0 (markov_rank is 0)"
                    .to_string(),
            );
        }
        if !self.sample_from_anchor {
            return invalid(
                "sample_from_anchor false is not implemented (DSpark's default true is)"
                    .to_string(),
            );
        }
        if !self.confidence_head_alpha.is_finite() || self.confidence_head_alpha < 0.0 {
            return invalid(format!(
                "confidence_head_alpha {} must be finite and non-negative",
                self.confidence_head_alpha
            ));
        }
        Ok(())
    }

    /// Whether the Markov head exists.
    pub fn has_markov_head(&self) -> bool {
        self.markov_rank > 0
    }

    /// Input width of the confidence head for a hidden size.
    pub fn confidence_input_width(&self, hidden_size: i64) -> i64 {
        if self.confidence_head_with_markov {
            hidden_size + self.markov_rank
        } else {
            hidden_size
        }
    }

    /// The keys as speculators writes them at the top level of `config.json`.
    pub fn json_keys(&self) -> Vec<(&'static str, Value)> {
        vec![
            ("sample_from_anchor", json!(self.sample_from_anchor)),
            ("markov_rank", json!(self.markov_rank)),
            ("markov_head_type", json!(self.markov_head_type.name())),
            ("enable_confidence_head", json!(self.enable_confidence_head)),
            (
                "confidence_head_with_markov",
                json!(self.confidence_head_with_markov),
            ),
            ("confidence_head_alpha", json!(self.confidence_head_alpha)),
        ]
    }

    /// Reads the keys from a speculators `config.json`, each defaulting to
    /// speculators' default when absent (as its pydantic model does); a
    /// present key of the wrong type is refused by name.
    pub fn from_json(value: &Value) -> Result<Self, DraftError> {
        let defaults = DsparkConfig::default();
        let wrong = |name: &str, found: &Value, expected: &str| {
            DraftError::InvalidConfig(format!("config.json: {name} {found} is not {expected}"))
        };
        let boolean = |name: &str, default: bool| -> Result<bool, DraftError> {
            match value.get(name).filter(|found| !found.is_null()) {
                None => Ok(default),
                Some(found) => found
                    .as_bool()
                    .ok_or_else(|| wrong(name, found, "a boolean")),
            }
        };
        let markov_rank = match value.get("markov_rank").filter(|found| !found.is_null()) {
            None => defaults.markov_rank,
            Some(found) => found
                .as_i64()
                .ok_or_else(|| wrong("markov_rank", found, "an integer"))?,
        };
        let markov_head_type = match value
            .get("markov_head_type")
            .filter(|found| !found.is_null())
        {
            None => defaults.markov_head_type,
            Some(found) => MarkovHeadType::parse(
                found
                    .as_str()
                    .ok_or_else(|| wrong("markov_head_type", found, "a string"))?,
            )?,
        };
        let confidence_head_alpha = match value
            .get("confidence_head_alpha")
            .filter(|found| !found.is_null())
        {
            None => defaults.confidence_head_alpha,
            Some(found) => found
                .as_f64()
                .ok_or_else(|| wrong("confidence_head_alpha", found, "a number"))?,
        };
        let config = DsparkConfig {
            markov_rank,
            markov_head_type,
            enable_confidence_head: boolean(
                "enable_confidence_head",
                defaults.enable_confidence_head,
            )?,
            confidence_head_with_markov: boolean(
                "confidence_head_with_markov",
                defaults.confidence_head_with_markov,
            )?,
            sample_from_anchor: boolean("sample_from_anchor", defaults.sample_from_anchor)?,
            confidence_head_alpha,
        };
        config.validate()?;
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_and_default_like_speculators() {
        let config = DsparkConfig {
            markov_rank: 8,
            markov_head_type: MarkovHeadType::Rnn,
            enable_confidence_head: true,
            confidence_head_with_markov: false,
            sample_from_anchor: true,
            confidence_head_alpha: 0.5,
        };
        let json = Value::Object(
            config
                .json_keys()
                .into_iter()
                .map(|(name, value)| (name.to_string(), value))
                .collect(),
        );
        assert_eq!(DsparkConfig::from_json(&json).unwrap(), config);
        assert_eq!(
            DsparkConfig::from_json(&json!({})).unwrap(),
            DsparkConfig::default()
        );
    }

    #[test]
    fn bad_values_are_refused_by_name() {
        let cases = [
            (json!({"markov_head_type": "lstm"}), "\"lstm\""),
            (json!({"markov_rank": -1}), "markov_rank -1"),
            (json!({"markov_rank": 0}), "confidence_head_with_markov"),
            (
                json!({"sample_from_anchor": false}),
                "sample_from_anchor false",
            ),
            (
                json!({"enable_confidence_head": "yes"}),
                "enable_confidence_head \"yes\"",
            ),
            (
                json!({"confidence_head_alpha": -2.0}),
                "confidence_head_alpha -2",
            ),
        ];
        for (json, expected) in cases {
            let error = DsparkConfig::from_json(&json).unwrap_err().to_string();
            assert!(error.contains(expected), "{json}: {error}");
        }
        let without_markov = json!({"markov_rank": 0, "confidence_head_with_markov": false});
        assert!(!DsparkConfig::from_json(&without_markov)
            .unwrap()
            .has_markov_head());
    }
}
