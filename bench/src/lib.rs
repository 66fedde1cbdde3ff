//! `switchyard-bench`'s library: the trace-replay benchmark's traces, load generator,
//! synthesizer and report. The binary (`src/bin/switchyard-bench/`) adds the overhead, planner
//! and profile programs; both drive the real binaries through `switchyard-harness`.
//!
//! [`trace`] reads Mooncake-format traces and expands hash ids into prompts; [`replay`] is the
//! open-loop load generator and its figures; [`stats`] measures a trace (lengths, reuse) and
//! [`synth`] derives new traces from one, to which [`workload`] adds media; [`compare`] runs one replay per policy on fresh
//! gateways and writes the report, whose SVG figures [`plots`] draws. The `switchyard-bench`
//! binary's `replay`, `synth` and `compare` subcommands are thin layers over these modules.

#![deny(missing_docs, missing_debug_implementations)]

pub mod compare;
pub mod plots;
pub mod replay;
pub mod stats;
pub mod synth;
pub mod trace;
pub mod workload;
