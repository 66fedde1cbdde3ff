//! The trace-replay benchmark: traces, the load generator, the synthesizer and the report.
//!
//! [`trace`] reads Mooncake-format traces and expands hash ids into prompts. The
//! `switchyard-bench` binary's `replay`, `synth` and `compare` subcommands are thin layers over
//! these modules.

pub mod trace;
