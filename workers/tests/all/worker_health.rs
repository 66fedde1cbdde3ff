//! A worker whose engine died says so: the thread running forward passes panics on its first
//! step, the request in it gets an error, and `/healthz` answers 503 from then on (so the
//! gateway's health checker takes the worker out of rotation) instead of 200 forever.

use std::time::Duration;

use switchyard_harness::Client;
use switchyard_workers::engine::{EngineConfig, Executor, ModelLimits, StepItem, spawn_native};
use switchyard_workers::mocker::{ServerConfig, WorkerServer};

/// An executor with a bug: it panics on its first step.
struct Panics;

impl Executor for Panics {
    fn execute(&mut self, _: &mut [StepItem<'_>]) -> Result<(), String> {
        panic!("a bug in a forward pass (this panic is the test's)")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_engine_fails_the_health_check() {
    let _turn = switchyard_harness::turn();
    let engine =
        spawn_native(EngineConfig::default(), ModelLimits::default(), Panics, "doomed-engine").expect("spawns");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binds");
    let server = WorkerServer::start(listener, engine, ServerConfig::default()).expect("starts");
    let addr = server.addr();
    let client = Client::plain(addr);
    let get = |path: &'static str| {
        let client = client.clone();
        async move {
            let reply = client.send("GET", path, Vec::new()).await.expect("GET");
            (
                reply.status.as_u16(),
                String::from_utf8_lossy(&reply.body()).into_owned(),
            )
        }
    };
    assert_eq!(get("/healthz").await.0, 200, "healthy before any step");
    assert_eq!(
        get("/health").await.0,
        200,
        "the path other routers probe answers the same"
    );

    let body = r#"{"model":"mock","prompt":"step into the bug","max_tokens":4}"#;
    let reply = client.send("POST", "/v1/completions", body).await.expect("POST");
    let (status, answer) = (
        reply.status.as_u16(),
        String::from_utf8_lossy(&reply.body()).into_owned(),
    );
    assert!(status >= 500, "the request in the dead engine fails: {status} {answer}");

    let mut health = 0;
    for _ in 0..100 {
        health = get("/healthz").await.0;
        if health == 503 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(health, 503, "a dead engine is not healthy");
    let (_, text) = get("/healthz").await;
    assert!(text.contains("engine_stopped"), "{text}");
    assert_eq!(get("/health").await.0, 503, "at /health too");
}
