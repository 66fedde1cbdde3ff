//! A policy's ranked fallbacks are the retry order: when the chosen worker cannot be reached,
//! the gateway tries the fallbacks the policy named, in its order, before it asks the policy
//! again.

use std::path::PathBuf;

use switchyard_harness::{Client, DeadAddress, Gateway, Mockers, chat_body};

const TOKEN: &str = "fallbacks-test-token-0123456789";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_first_choice_is_retried_on_the_policys_first_fallback() -> anyhow::Result<()> {
    let mockers = Mockers::start(&["--num-workers", "2", "--speedup", "50"])?;
    // A port nothing listens on: connecting to it fails at once.
    let dead_address = DeadAddress::new()?;
    let dead = dead_address.addr;
    let mut config = String::from(
        // A generous deadline (wall-clock time on two busy cores): this test is about what the
        // host does with the policy's answer, which a fallback decision would not exercise.
        "[server]\nplaintext = true\n[policy]\nrouter = \"least-load\"\ndeadline_ms = 100\n\
         [health]\ninterval_ms = 60000\n[forwarding]\nretries = 1\n",
    );
    for (name, addr) in [("dead", dead), ("second", mockers.addrs[0]), ("last", mockers.addrs[1])] {
        config.push_str(&format!(
            "[[workers]]\nname = \"{name}\"\nurl = \"http://{addr}\"\nmodel = \"mock\"\n"
        ));
    }
    let (gateway, admin) = Gateway::start_with_admin(&config, TOKEN)?;
    let path = PathBuf::from(env!("SWITCHYARD_GUESTS_DIR")).join("fallbacks.wasm");
    let wasm = std::fs::read(&path).map_err(|err| anyhow::anyhow!("{}: {err}", path.display()))?;
    let (status, answer) = admin
        .call("PUT", "/admin/policies/fallbacks?activate=true", wasm)
        .await?;
    assert_eq!(status, 200, "{answer}");
    let client = Client::plain(gateway.addr);
    // The policy picks `dead` (first in the table) and names `last`, then `second`, as its
    // fallbacks. Asking the policy again would pick `second`, the first worker left.
    let reply = client
        .post_json("/v1/chat/completions", &chat_body("mock", "retry me", 2, false))
        .await?;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.worker(), "last", "the first fallback serves the retry");
    let policy = reply
        .headers
        .get("x-switchyard-policy")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    assert!(policy.starts_with("fallbacks@"), "chosen by the policy: {policy}");
    // `dead` left the rotation when it could not be reached; the policy now sees `second` first.
    let reply = client
        .post_json("/v1/chat/completions", &chat_body("mock", "again", 2, false))
        .await?;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.worker(), "second");
    Ok(())
}
