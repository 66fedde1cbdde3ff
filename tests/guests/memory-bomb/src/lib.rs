//! Hostile guest `memory-bomb`: allocates until memory runs out on live traffic.

#![no_std]

extern crate alloc;

hostile_common::hostile_router!(|_req| {
    let mut hoard = alloc::vec::Vec::new();
    loop {
        hoard.push(core::hint::black_box(alloc::vec![1u8; 1 << 20]));
    }
});
