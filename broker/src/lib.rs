//! # dflash-broker (being written)
