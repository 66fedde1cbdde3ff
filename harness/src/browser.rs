//! A real headless browser for the dashboard test: Debian's `chromium`, driven over the Chrome
//! DevTools Protocol (a WebSocket per page; commands are JSON with an id, answers carry it).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

/// The Chromium binary: `$SWITCHYARD_CHROMIUM`, else `chromium` (Debian), `chromium-browser`
/// or `google-chrome` on `PATH`; `None` where there is none.
pub fn chromium() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("SWITCHYARD_CHROMIUM") {
        return Some(PathBuf::from(path));
    }
    let paths = std::env::var_os("PATH")?;
    std::env::split_paths(&paths).find_map(|dir| {
        ["chromium", "chromium-browser", "google-chrome"]
            .iter()
            .map(|name| dir.join(name))
            .find(|path| path.is_file())
    })
}

/// A headless Chromium process with one page open.
#[derive(Debug)]
pub struct Browser {
    child: Child,
    _profile: tempfile::TempDir,
    page: WebSocketStream<MaybeTlsStream<TcpStream>>,
    next_id: u64,
}

impl Browser {
    /// Starts `program` headless and attaches to its first page.
    ///
    /// # Errors
    ///
    /// Fails if the browser does not start or announce its DevTools endpoint within 30 s.
    pub async fn launch(program: &Path) -> anyhow::Result<Browser> {
        let profile = tempfile::tempdir()?;
        let port_file = profile.path().join("DevToolsActivePort");
        let mut child = Command::new(program)
            .args([
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--remote-debugging-port=0",
                &format!("--user-data-dir={}", profile.path().display()),
                "about:blank",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", program.display()))?;
        // Chromium writes its port to the profile once it listens.
        let deadline = Instant::now() + Duration::from_secs(30);
        let port = loop {
            if let Ok(text) = std::fs::read_to_string(&port_file)
                && let Some(port) = text.lines().next().and_then(|line| line.trim().parse::<u16>().ok())
            {
                break port;
            }
            if let Some(status) = child.try_wait()? {
                bail!("chromium exited at start: {status}");
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                bail!("chromium did not open its DevTools port within 30 s");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let targets = list_targets(port).await?;
        let page_url = targets
            .as_array()
            .and_then(|targets| {
                targets
                    .iter()
                    .find(|t| t["type"] == "page")
                    .and_then(|t| t["webSocketDebuggerUrl"].as_str())
            })
            .context("chromium lists no page")?
            .to_string();
        let (page, _) = tokio_tungstenite::connect_async(page_url.as_str()).await?;
        Ok(Browser {
            child,
            _profile: profile,
            page,
            next_id: 1,
        })
    }

    /// Sends one DevTools command to the page and waits for its answer.
    ///
    /// # Errors
    ///
    /// Fails if the page's socket closes or the command answers an error.
    pub async fn call(&mut self, method: &str, params: Value) -> anyhow::Result<Value> {
        let id = self.next_id;
        self.next_id += 1;
        let command = json!({"id": id, "method": method, "params": params});
        self.page.send(Message::text(command.to_string())).await?;
        while let Some(message) = self.page.next().await {
            let Message::Text(text) = message? else { continue };
            let answer: Value = serde_json::from_str(&text)?;
            if answer["id"].as_u64() != Some(id) {
                continue; // an event
            }
            if let Some(error) = answer.get("error") {
                bail!("{method}: {error}");
            }
            return Ok(answer["result"].clone());
        }
        bail!("the page's DevTools socket closed")
    }

    /// Opens `url` in the page.
    ///
    /// # Errors
    ///
    /// As [`Browser::call`].
    pub async fn navigate(&mut self, url: &str) -> anyhow::Result<()> {
        self.call("Page.navigate", json!({"url": url})).await?;
        Ok(())
    }

    /// The value of a JavaScript expression in the page (promises awaited).
    ///
    /// # Errors
    ///
    /// As [`Browser::call`], or if the expression throws.
    pub async fn evaluate(&mut self, expression: &str) -> anyhow::Result<Value> {
        let result = self
            .call(
                "Runtime.evaluate",
                json!({"expression": expression, "returnByValue": true, "awaitPromise": true}),
            )
            .await?;
        if let Some(exception) = result.get("exceptionDetails") {
            bail!("`{expression}` threw: {exception}");
        }
        Ok(result["result"]["value"].clone())
    }

    /// The text of the element with `id` ("" when there is none).
    ///
    /// # Errors
    ///
    /// As [`Browser::evaluate`].
    pub async fn text(&mut self, id: &str) -> anyhow::Result<String> {
        let value = self
            .evaluate(&format!(
                "(document.getElementById({}) || {{}}).textContent || ''",
                Value::String(id.into())
            ))
            .await?;
        Ok(value.as_str().unwrap_or_default().to_string())
    }

    /// Chooses `file` in the file input matched by `selector`, as a user would in its dialog.
    ///
    /// # Errors
    ///
    /// As [`Browser::call`], or if nothing matches.
    pub async fn choose_file(&mut self, selector: &str, file: &Path) -> anyhow::Result<()> {
        let document = self.call("DOM.getDocument", json!({})).await?;
        let root = document["root"]["nodeId"].as_u64().context("no document")?;
        let found = self
            .call("DOM.querySelector", json!({"nodeId": root, "selector": selector}))
            .await?;
        let node = found["nodeId"]
            .as_u64()
            .filter(|id| *id != 0)
            .context("no such element")?;
        self.call(
            "DOM.setFileInputFiles",
            json!({"nodeId": node, "files": [file.display().to_string()]}),
        )
        .await?;
        Ok(())
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `GET /json/list` of the DevTools HTTP endpoint.
async fn list_targets(port: u16) -> anyhow::Result<Value> {
    use http_body_util::{BodyExt, Empty};
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build(hyper_util::client::legacy::connect::HttpConnector::new());
    let uri: http::Uri = format!("http://127.0.0.1:{port}/json/list").parse()?;
    let response = client
        .request(http::Request::get(uri).body(Empty::<bytes::Bytes>::new())?)
        .await?;
    let body = response.into_body().collect().await?.to_bytes();
    Ok(serde_json::from_slice(&body)?)
}
