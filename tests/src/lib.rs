//! # dflash-system-tests (being written)
