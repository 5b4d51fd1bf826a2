//! [`Capture`]: what the run asks this target to add to every sample beyond
//! DFlash's `input_ids`, `loss_mask` and `hidden_states`. The run decides,
//! not the target's flags: the broker says it in every welcome
//! (`ProducerWelcome.capture`, its `--target-capture`), the first one before
//! the compute thread takes its first batch, and a reconnect's welcome must
//! say the same (`crate::stream`).

use dflash_proto::v1::CapturedTensor;

/// The tensors each sample carries beyond DFlash's three.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Capture {
    /// `last_hidden_states` (bf16 `[T, hidden]`): the target's last hidden
    /// state after its final norm, the LM head's input (DSpark drafters).
    pub last_hidden_states: bool,
}

/// The broker's welcome asks for a tensor this target-server cannot add.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CaptureError {
    #[error("the broker's welcome asks for captured tensor {0} (ProducerWelcome.capture), which this target-server does not know: run a target-server as new as the broker")]
    Unknown(i32),
    #[error("the run asks for last_hidden_states (the broker's --target-capture last-hidden-states) and a synthetic model has no last hidden state: run the target on a model directory, or the broker without --target-capture")]
    SyntheticLastHiddenStates,
    #[error("the run's capture changed under this target: its first welcome asked for {before}, the welcome after a reconnect for {after} (was the broker restarted with another --target-capture?); the samples already made would not match, so the target stops: restart it")]
    Changed { before: Capture, after: Capture },
}

impl Capture {
    /// What a welcome's `capture` asks for; a value this build does not know
    /// is an error (a sample without that tensor would fail on every drafter).
    pub fn from_welcome(values: &[i32]) -> Result<Self, CaptureError> {
        let mut capture = Capture::default();
        for &value in values {
            match CapturedTensor::try_from(value) {
                Ok(CapturedTensor::LastHiddenStates) => capture.last_hidden_states = true,
                Ok(CapturedTensor::Unspecified) | Err(_) => {
                    return Err(CaptureError::Unknown(value))
                }
            }
        }
        Ok(capture)
    }
}

/// As the broker's `--target-capture` value: `none` or `last-hidden-states`.
impl std::fmt::Display for Capture {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.last_hidden_states {
            formatter.write_str("last-hidden-states")
        } else {
            formatter.write_str("none")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_welcome_asks_for_known_tensors_only() {
        assert_eq!(Capture::from_welcome(&[]), Ok(Capture::default()));
        let last = CapturedTensor::LastHiddenStates as i32;
        let asked = Capture::from_welcome(&[last, last]).unwrap();
        assert!(asked.last_hidden_states);
        assert_eq!(asked.to_string(), "last-hidden-states");
        assert_eq!(Capture::default().to_string(), "none");
        assert_eq!(
            Capture::from_welcome(&[last, 7]),
            Err(CaptureError::Unknown(7))
        );
        assert_eq!(Capture::from_welcome(&[0]), Err(CaptureError::Unknown(0)));
    }

    #[test]
    fn a_changed_capture_names_both_values() {
        let error = CaptureError::Changed {
            before: Capture {
                last_hidden_states: true,
            },
            after: Capture::default(),
        }
        .to_string();
        assert!(
            error.contains("asked for last-hidden-states")
                && error.contains("after a reconnect for none"),
            "{error}"
        );
    }
}
