//! Hostile guest `loop`: spins forever on live traffic.

#![no_std]

hostile_common::hostile_router!(|_req| loop {
    core::hint::black_box(0);
});
