//! # dflash-cli (being written)
