//! Hostile guest `leak`: keeps 24 MiB more of its memory on every live call and answers
//! worker 0, so each instance grows call by call until the memory cap stops it.

#![no_std]

extern crate alloc;

use hostile_common::sdk::Decision;

hostile_common::hostile_router!(|_req| {
    // Written, so the pages are resident, then never freed.
    let hoard = alloc::vec![1u8; 24 << 20];
    core::hint::black_box(alloc::vec::Vec::leak(hoard));
    Ok(Decision::to(0))
});
