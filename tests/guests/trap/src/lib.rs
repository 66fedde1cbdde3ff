//! Hostile guest `trap`: panics (traps) on live traffic.

#![no_std]

hostile_common::hostile_router!(|_req| panic!("hostile trap"));
