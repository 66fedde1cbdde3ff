//! Hostile guest `bad-answer`: names a worker that does not exist on live traffic.

#![no_std]

use hostile_common::sdk::Decision;

hostile_common::hostile_router!(|_req| Ok(Decision::to(9_999)));
