//! The trace-replay benchmark: traces, the load generator, the synthesizer and the report.
//!
//! [`trace`] reads Mooncake-format traces and expands hash ids into prompts; [`replay`] is the
//! open-loop load generator and its figures; [`stats`] measures a trace (lengths, reuse) and
//! [`synth`] derives new traces from one; [`compare`] runs one replay per policy on fresh
//! gateways and writes the report, whose SVG figures [`plots`] draws. The `switchyard-bench`
//! binary's `replay`, `synth` and `compare` subcommands are thin layers over these modules.

pub mod compare;
pub mod plots;
pub mod replay;
pub mod stats;
pub mod synth;
pub mod trace;
pub mod workload;
