//! Enum fields of status snapshots serialised by name (`BROKER_STATE_RUNNING`)
//! rather than number, for `dflash status --json` and scripts reading it.

use crate::v1::{BrokerState, TargetState};

pub fn broker_state<S: serde::Serializer>(value: &i32, serializer: S) -> Result<S::Ok, S::Error> {
    let name =
        BrokerState::try_from(*value).map_or("BROKER_STATE_UNKNOWN", |state| state.as_str_name());
    serializer.serialize_str(name)
}

pub fn target_state<S: serde::Serializer>(value: &i32, serializer: S) -> Result<S::Ok, S::Error> {
    let name =
        TargetState::try_from(*value).map_or("TARGET_STATE_UNKNOWN", |state| state.as_str_name());
    serializer.serialize_str(name)
}
