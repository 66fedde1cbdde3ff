//! Hostile guest `refuse`: answers with an error on live traffic.

#![no_std]

use hostile_common::sdk::PolicyError;

hostile_common::hostile_router!(|_req| Err(PolicyError::new("hostile refusal")));
