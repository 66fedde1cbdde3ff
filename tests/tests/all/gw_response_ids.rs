//! Response ids are unique per gateway: the gateway names each answer, whichever worker (of
//! several that each count from 1) produced it, whole or streamed.

use std::collections::HashSet;

use switchyard_harness::{Client, Gateway, chat_body};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_answer_has_an_id_of_its_own() -> anyhow::Result<()> {
    let gateway = Gateway::start("[server]\nplaintext = true\n[embedded_mockers]\ncount = 2\nspeedup = 50.0\n")?;
    let client = Client::plain(gateway.addr);
    let mut ids = HashSet::new();
    for round in 0..4 {
        let whole = client
            .post_json("/v1/chat/completions", &chat_body("mock", "hello", 2, false))
            .await?
            .json()?;
        let id = whole["id"].as_str().unwrap_or_default().to_string();
        assert!(id.starts_with("chatcmpl-"), "{id}");
        assert!(ids.insert(id.clone()), "round {round}: `{id}` came back twice");

        let streamed = client
            .post_json("/v1/chat/completions", &chat_body("mock", "hello", 3, true))
            .await?;
        let chunks: Vec<serde_json::Value> = streamed
            .events()
            .iter()
            .filter(|(_, data)| data != "[DONE]")
            .map(|(_, data)| serde_json::from_str(data))
            .collect::<Result<_, _>>()?;
        let stream_ids: HashSet<&str> = chunks.iter().filter_map(|c| c["id"].as_str()).collect();
        assert_eq!(stream_ids.len(), 1, "one id per stream: {stream_ids:?}");
        let id = stream_ids.into_iter().next().unwrap_or_default().to_string();
        assert!(ids.insert(id.clone()), "round {round}: streamed `{id}` came back twice");

        let completion = client
            .post_json(
                "/v1/completions",
                &serde_json::json!({"model": "mock", "prompt": "once", "max_tokens": 2}),
            )
            .await?
            .json()?;
        let id = completion["id"].as_str().unwrap_or_default().to_string();
        assert!(id.starts_with("cmpl-"), "{id}");
        assert!(ids.insert(id.clone()), "round {round}: `{id}` came back twice");
    }
    Ok(())
}
