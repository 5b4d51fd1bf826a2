//! # dflash-drafter-server (being written)
