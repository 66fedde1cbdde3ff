//! Hostile guest `huge-return`: returns 65,536 fallbacks (256 KiB) for a table of a few workers on live traffic.

#![no_std]

extern crate alloc;

use hostile_common::sdk::Decision;

hostile_common::hostile_router!(|_req| Ok(Decision {
    worker: 0,
    encoders: alloc::vec::Vec::new(),
    fallbacks: alloc::vec![0; 1 << 16]
}));
