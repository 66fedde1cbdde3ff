//! Graceful shutdown of a worker's HTTP server: a request in flight when shutdown starts runs
//! to its last token, new connections are refused, and shutdown returns once it is done.

use std::time::Duration;

use switchyard_harness::sse_json;
use switchyard_workers::mocker::{EngineConfig, ServerConfig, WorkerServer, spawn_engine};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_finishes_requests_in_flight_and_takes_no_new_ones() {
    let _turn = switchyard_harness::turn();
    // Real time (speed-up 1): 60 decode steps take about 0.35 s.
    let engine = spawn_engine(EngineConfig {
        speedup: 1.0,
        ..EngineConfig::default()
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("binds");
    let server = WorkerServer::start(listener, engine, ServerConfig::default()).expect("starts");
    let addr = server.addr();
    let client = tokio::spawn(async move {
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connects");
        let body = r#"{"model":"mock","prompt":"drain me","max_tokens":60,"stream":true}"#;
        let request = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).await.expect("writes");
        let mut response = String::new();
        stream.read_to_string(&mut response).await.expect("reads");
        response
    });
    for _ in 0..200 {
        if server.in_flight() > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(server.in_flight(), 1, "the request is running");
    let left = server.shutdown(Duration::from_secs(20)).await;
    assert_eq!(left, 0, "shutdown waited for the request");
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "no new connections after shutdown"
    );
    let response = client.await.expect("client task");
    let events = sse_json(&response);
    assert_eq!(events.len(), 61, "60 tokens and the finish chunk: {response}");
    assert!(response.contains("data: [DONE]"));
}
