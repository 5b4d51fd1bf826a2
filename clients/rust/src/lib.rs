//! # dflash-client (being written)
