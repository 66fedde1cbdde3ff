//! Hostile guest `stack-overflow`: recurses without end on live traffic.

#![no_std]

use hostile_common::sdk::Decision;

hostile_common::hostile_router!(|req| Ok(Decision::to(deep(req.request_id) as usize)));

#[inline(never)]
#[allow(unconditional_recursion)]
fn deep(n: u64) -> u64 {
    let pad = core::hint::black_box([n; 64]);
    deep(pad[3].wrapping_add(1)).wrapping_add(pad[7])
}
