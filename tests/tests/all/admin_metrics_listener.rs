//! `/metrics` off the public port: with `server.metrics = false` the client listener answers
//! 404 there and the admin listener serves them (with the admin token); a config that would
//! serve them nowhere is refused.

use switchyard_harness::{Client, Gateway, chat_body};

const TOKEN: &str = "metrics-listener-token-0123456789";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_can_be_served_on_the_admin_listener_only() -> anyhow::Result<()> {
    let (gateway, admin) = Gateway::start_with_admin(
        "[server]\nplaintext = true\nmetrics = false\n[embedded_mockers]\ncount = 1\nspeedup = 50.0\n",
        TOKEN,
    )?;
    let client = Client::plain(gateway.addr);
    let reply = client
        .post_json("/v1/chat/completions", &chat_body("mock", "count me", 2, false))
        .await?;
    anyhow::ensure!(reply.status == 200);
    let public = client.send("GET", "/metrics", "").await?;
    anyhow::ensure!(public.status == 404, "the public port hides them: {}", public.status);
    let (status, text) = admin.get_text("/metrics").await?;
    anyhow::ensure!(status == 200, "{status}: {text}");
    anyhow::ensure!(text.contains("switchyard_requests_total"), "{text}");
    Ok(())
}

#[test]
fn metrics_served_nowhere_is_a_config_error() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("gateway.toml");
    std::fs::write(
        &path,
        "[server]\nplaintext = true\nmetrics = false\n[embedded_mockers]\ncount = 1\n",
    )?;
    let output = std::process::Command::new(switchyard_harness::binary("switchyard")?)
        .args(["--config", &path.display().to_string(), "--listen", "127.0.0.1:0"])
        .output()?;
    anyhow::ensure!(!output.status.success(), "refused");
    let stderr = String::from_utf8_lossy(&output.stderr);
    anyhow::ensure!(stderr.contains("server.metrics"), "the error names the key: {stderr}");
    Ok(())
}
