//! The admin dashboard in a real headless browser (Debian's `chromium`, over the DevTools
//! protocol): the page connects with the admin token, a policy uploaded through its form
//! becomes the active router, and its request counters move while traffic runs.

use std::path::Path;
use std::time::{Duration, Instant};

use switchyard_harness::browser::{Browser, chromium};
use switchyard_harness::{Client, Gateway, chat_body};

const TOKEN: &str = "dashboard-token-0123456789abcdef";

/// Polls the element `id` until `check` accepts its text.
async fn until_text(browser: &mut Browser, id: &str, check: impl Fn(&str) -> bool) -> anyhow::Result<String> {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let text = browser.text(id).await?;
        if check(&text) {
            return Ok(text);
        }
        if Instant::now() > deadline {
            anyhow::bail!("#{id} still reads `{text}`");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_uploads_a_policy_and_shows_traffic() -> anyhow::Result<()> {
    let Some(program) = chromium() else {
        eprintln!(
            "skipping the browser test: chromium is not installed (Debian: `apt-get install chromium`; .ci/run installs it)"
        );
        return Ok(());
    };
    let (gateway, admin) = Gateway::start_with_admin(
        "[server]\nplaintext = true\n[embedded_mockers]\ncount = 2\nspeedup = 50.0\n",
        TOKEN,
    )?;
    // The page itself needs no token; everything it shows does.
    let (status, _) = admin.get_text("/dashboard").await?;
    assert_eq!(status, 200);
    let mut browser = Browser::launch(&program).await?;
    browser
        .navigate(&format!("{}/dashboard#token={TOKEN}", admin.url()))
        .await?;
    until_text(&mut browser, "status", |text| text == "connected").await?;
    until_text(&mut browser, "active-policy", |text| text.starts_with("kv-aware@")).await?;
    let workers = browser
        .evaluate("document.querySelectorAll('#workers tr').length")
        .await?;
    assert_eq!(workers.as_u64(), Some(4), "two workers and two encoders listed");

    // Upload through the form, as a user would: a name, the file, activate, submit.
    let component = Path::new(env!("SWITCHYARD_PLUGINS_DIR")).join("least_load.wasm");
    browser
        .evaluate("document.getElementById('upload-name').value = 'from-browser'")
        .await?;
    browser.choose_file("#upload-file", &component).await?;
    browser
        .evaluate("document.getElementById('upload-button').click()")
        .await?;
    until_text(&mut browser, "upload-result", |text| {
        text.starts_with("active: from-browser@")
    })
    .await?;
    until_text(&mut browser, "active-policy", |text| text.starts_with("from-browser@")).await?;
    assert!(admin.active().await?.starts_with("from-browser"), "the gateway runs it");

    // Traffic moves the counters.
    let before: u64 = browser.text("requests-total").await?.parse()?;
    let client = Client::plain(gateway.addr);
    for i in 0..20 {
        let reply = client
            .post_json(
                "/v1/chat/completions",
                &chat_body("mock", &format!("dashboard {i}"), 2, i % 2 == 0),
            )
            .await?;
        assert_eq!(reply.status, 200);
        assert!(
            reply
                .headers
                .get("x-switchyard-policy")
                .is_some_and(|p| p.as_bytes().starts_with(b"from-browser@"))
        );
    }
    until_text(&mut browser, "requests-total", |text| {
        text.parse::<u64>().is_ok_and(|now| now >= before + 20)
    })
    .await?;
    let answered = browser
        .evaluate(
            "Array.from(document.querySelectorAll('#workers tr')).map(r => Number(r.children[6].textContent)).reduce((a, b) => a + b, 0)",
        )
        .await?;
    assert!(
        answered.as_u64().is_some_and(|n| n >= 20),
        "per-worker counts: {answered}"
    );
    let ttft = browser
        .evaluate("document.querySelector('#workers tr').children[7].textContent")
        .await?;
    assert!(
        ttft.as_str().is_some_and(|t| t.parse::<f64>().is_ok()),
        "a TTFT p50 is shown: {ttft}"
    );
    Ok(())
}
