//! Switchyard's end-to-end tests: the real `switchyard`, `switchyard-mocker`,
//! `switchyard-llm` and `switchyard-encoder` binaries (built by `cargo test --workspace`),
//! TLS and NATS, driven through `switchyard-harness`. One test binary, one module per file,
//! each named by its area so that an area runs alone by its prefix, e.g.
//! `cargo test -p switchyard-e2e --test all -- policy_`:
//!
//! | prefix | area |
//! |---|---|
//! | `gw_` | the gateway serving clients: TLS, HTTP versions, input errors, keys and tenants, admission, latency targets, draining, failover |
//! | `admin_` | the admin API's listeners and the dashboard |
//! | `engine_` | engines Switchyard did not write: their load metrics, busy answers, circuit breakers |
//! | `policy_` | router and batcher policies: hot swaps, rollouts, the watched folder, fallbacks, columns, hostile guests, cost-aware |
//! | `kv_` | KV events (the mockers', vLLM's) and KV-aware routing |
//! | `media_` | multimodal requests, media fetching, encoders failing |
//! | `fleet_` | gateway replicas sharing NATS |
//! | `planner_` | the planner's rules and its process connector |
//! | `native_` | the native LLM worker and encoders behind the gateway |
//! | `stream_` | streams that survive a worker: continued elsewhere from their tokens |
//! | `pd_` | prefill/decode disaggregation: prompts computed on prefill workers, and their failures |
//!
//! Tests of one module run side by side and no other module's beside them, as when each file
//! was a test binary of its own: a harness `Gateway` holds its calling file's turn.
//! One test is a binary of its own, `policy_batcher_hot_swap` (its module doc says why).

mod admin_dashboard;
mod admin_listener_limits;
mod admin_metrics_listener;
mod engine_backpressure;
mod engine_llamacpp_workers;
mod engine_metrics;
mod fleet_policies;
mod fleet_replicas;
mod gw_admission_load;
mod gw_admission_queue;
mod gw_api_keys;
mod gw_bad_input;
mod gw_cert_reload;
mod gw_connection_hygiene;
mod gw_drain;
mod gw_latency_targets;
mod gw_quota_cut_streams;
mod gw_response_ids;
mod gw_tls;
mod gw_worker_failover;
mod kv_routing;
mod kv_vllm_events;
mod media_encoder_failover;
mod media_fetch;
mod media_multimodal;
mod native_multimodal;
mod native_worker;
mod pd_disagg;
mod pd_fallback;
mod pd_native;
mod planner_pd;
mod planner_process;
mod planner_rules;
mod policy_columns;
mod policy_cost_routing;
mod policy_fallbacks;
mod policy_hostile_plugins;
mod policy_hot_swap;
mod policy_last_good;
mod policy_rollout;
mod policy_watch;
mod stream_migration;
