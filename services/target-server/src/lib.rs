//! # dflash-target-server (being written)
