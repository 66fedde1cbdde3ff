//! The TLS certificate is reloaded while the gateway serves: a stream open across the swap
//! finishes, new connections see the new certificate, a broken new pair is refused (the old
//! one stays), and SIGHUP reloads too. The admin listener speaks TLS when asked, and can require
//! client certificates.

use anyhow::Context;
use std::process::Command;
use std::time::Duration;

use rustls::pki_types::CertificateDer;
use switchyard_harness::{Alpn, Client, Gateway, TestCa, chat_body, eventually, metric_sum};

/// The certificate a new connection is served.
async fn served(client: &Client) -> anyhow::Result<CertificateDer<'static>> {
    let tls = client.raw_tls().await?;
    let certs = tls.get_ref().1.peer_certificates().unwrap_or_default();
    let leaf = certs.first().ok_or_else(|| anyhow::anyhow!("no certificate served"))?;
    Ok(leaf.clone().into_owned())
}

async fn reloads(client: &Client, outcome: &str) -> anyhow::Result<f64> {
    let text = String::from_utf8(client.send("GET", "/metrics", "").await?.body())?;
    Ok(metric_sum(
        &text,
        "switchyard_tls_reloads_total",
        &[&format!("outcome=\"{outcome}\"")],
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_are_reloaded_without_dropping_connections() -> anyhow::Result<()> {
    let mut ca = TestCa::new()?;
    let gateway = Gateway::start(&format!(
        "mode = \"production\"\n[server]\nlisten = \"127.0.0.1:0\"\n{}\n\
         [embedded_mockers]\ncount = 1\nmodel = \"mock\"\nspeedup = 1.0\n",
        ca.tls_toml()
    ))?;
    let client = Client::tls(gateway.addr, &ca.ca_der, Alpn::Http1, None)?;
    let first = ca.server_der.clone();
    assert_eq!(served(&client).await?, first);

    // A stream long enough to be open across the swap.
    let tokens = 150;
    let stream = {
        let client = client.clone();
        tokio::spawn(async move {
            client
                .post_json(
                    "/v1/chat/completions",
                    &chat_body("mock", "a long answer", tokens, true),
                )
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;

    let second = ca.reissue()?;
    assert_ne!(second, first);
    let swapped = eventually(Duration::from_secs(10), || {
        let (client, second) = (client.clone(), second.clone());
        async move { served(&client).await.is_ok_and(|cert| cert == second) }
    })
    .await;
    assert!(swapped, "new connections still get the old certificate");
    assert!(
        !stream.is_finished(),
        "the stream ended before the swap; make it longer"
    );

    let reply = stream.await??;
    assert_eq!(reply.status, 200);
    let events = reply.events();
    assert_eq!(
        events.last().map(|(_, data)| data.as_str()),
        Some("[DONE]"),
        "the stream finished"
    );
    let words = events[..events.len() - 1]
        .iter()
        .filter_map(|(_, data)| serde_json::from_str::<serde_json::Value>(data).ok())
        .filter(|chunk| chunk["choices"][0]["delta"]["content"].is_string())
        .count();
    assert_eq!(words, tokens as usize, "every token arrived");

    // A certificate whose key is not in the key file: refused, the second pair stays.
    ca.write_mismatched_certificate()?;
    let refused = eventually(Duration::from_secs(10), || {
        let client = client.clone();
        async move { reloads(&client, "refused").await.unwrap_or(0.0) >= 1.0 }
    })
    .await;
    assert!(refused, "the broken pair was not refused");
    assert_eq!(served(&client).await?, second, "the old pair is kept");

    // A good pair again, picked up from the files; then SIGHUP reloads with no change.
    let third = ca.reissue()?;
    let reloaded = eventually(Duration::from_secs(10), || {
        let (client, third) = (client.clone(), third.clone());
        async move { served(&client).await.is_ok_and(|cert| cert == third) }
    })
    .await;
    assert!(reloaded, "the third certificate was not served");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let loaded_before = reloads(&client, "loaded").await?;
    let status = Command::new("kill")
        .args(["-HUP", &gateway.process.id().to_string()])
        .status()?;
    assert!(status.success());
    let hup = eventually(Duration::from_secs(10), || {
        let client = client.clone();
        async move { reloads(&client, "loaded").await.unwrap_or(0.0) > loaded_before }
    })
    .await;
    assert!(hup, "SIGHUP did not reload the certificate");
    assert_eq!(served(&client).await?, third);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_listener_speaks_tls_and_requires_client_certificates() -> anyhow::Result<()> {
    let ca = TestCa::new()?;
    let gateway = Gateway::start(&format!(
        "[server]\nplaintext = true\n[embedded_mockers]\ncount = 1\n\
         [admin]\nlisten = \"127.0.0.1:0\"\ntoken = \"admin-secret-0123456789\"\n\
         [admin.tls]\ncert = {:?}\nkey = {:?}\nclient_ca = {:?}\n",
        ca.cert_path.display().to_string(),
        ca.key_path.display().to_string(),
        ca.ca_path.display().to_string(),
    ))?;
    let admin_addr = gateway.admin.context("no admin API line")?;

    let (chain, key) = ca.client_identity()?;
    let operator = Client::tls_with_identity(admin_addr, &ca.ca_der, chain, key)?;
    let reply = operator
        .connect()
        .await?
        .send_with_auth("GET", "/admin/policies", Vec::new(), "admin-secret-0123456789")
        .await?;
    assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body()));
    let reply = operator
        .connect()
        .await?
        .send_with_auth("GET", "/admin/policies", Vec::new(), "wrong")
        .await?;
    assert_eq!(reply.status, 401, "a client certificate does not replace the token");

    // No client certificate: the handshake is refused, so no request gets an answer.
    let anonymous = Client::tls(admin_addr, &ca.ca_der, Alpn::Http1, None)?;
    let refused = match anonymous.connect().await {
        Err(_) => true,
        Ok(mut connection) => connection
            .send_with_auth("GET", "/admin/policies", Vec::new(), "admin-secret-0123456789")
            .await
            .is_err(),
    };
    assert!(refused, "an admin client without a certificate was served");

    // Plain HTTP to the TLS listener gets nothing either.
    let plain = Client::plain(admin_addr);
    let answered = plain
        .send("GET", "/admin/policies", "")
        .await
        .is_ok_and(|reply| reply.status == 200);
    assert!(!answered, "plain HTTP was served on the TLS admin listener");
    Ok(())
}
