//! The `switchyard` gateway as a child process, and a client of its admin API.
//!
//! [`Gateway::start`] writes a configuration file, starts the binary on a port the kernel picks
//! and reads back what it printed: its address, the admin listener's, and those of its embedded
//! mockers and encoders. [`Admin`] calls the admin API with the bearer token; [`metric_sum`] and
//! [`cached_blocks`] read what the gateway reports.

use std::net::SocketAddr;
use std::panic::Location;
use std::time::Duration;

use anyhow::Context;

use crate::client::Client;
use crate::process::{Process, binary};
use crate::turns::{self, Turn};

/// The `switchyard` gateway running as a child process.
#[derive(Debug)]
pub struct Gateway {
    /// The process.
    pub process: Process,
    /// The address it listens on.
    pub addr: SocketAddr,
    /// Name and address of each embedded mocker, as the gateway printed them.
    pub mockers: Vec<(String, SocketAddr)>,
    /// Name and address of each embedded encoder, as the gateway printed them.
    pub encoders: Vec<(String, SocketAddr)>,
    /// The admin listener's address as the gateway printed it, when `[admin]` is configured.
    pub admin: Option<SocketAddr>,
    /// The folder holding its config file.
    pub dir: tempfile::TempDir,
    /// The calling file's turn, given back after the process is killed (fields drop in order).
    _turn: Turn,
}

impl Gateway {
    /// Writes `config` to a file and starts `switchyard --config FILE --listen 127.0.0.1:0`.
    ///
    /// It first waits for the turn of the file it is called from, and the gateway holds that
    /// turn until it is dropped: tests of one file run side by side, and a test of another file
    /// in the same test binary waits at its first gateway, as if each file were a test binary
    /// of its own (many of these tests load both cores and judge timing).
    ///
    /// # Errors
    ///
    /// Fails if the gateway does not print its ready line.
    #[track_caller]
    pub fn start(config: &str) -> anyhow::Result<Gateway> {
        Gateway::launch(config, turns::take(Location::caller().file()))
    }

    fn launch(config: &str, turn: Turn) -> anyhow::Result<Gateway> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("gateway.toml");
        std::fs::write(&path, config)?;
        let args = vec![
            "--config".to_string(),
            path.display().to_string(),
            "--listen".to_string(),
            "127.0.0.1:0".to_string(),
            "--log".to_string(),
            "warn".to_string(),
        ];
        let (process, lines) = Process::start(
            &binary("switchyard")?,
            &args,
            // The example request is printed last, after the embedded mockers' addresses.
            |line| line.starts_with("try: "),
            Duration::from_secs(30),
        )?;
        let addr = lines
            .iter()
            .find_map(|line| line.split("listening on ").nth(1))
            .and_then(|rest| rest.split_whitespace().next())
            .map(|url| {
                url.trim_start_matches("https://")
                    .trim_start_matches("http://")
                    .to_string()
            })
            .context("no listening line")?
            .parse()
            .context("bad listening address")?;
        let admin = lines
            .iter()
            .find_map(|line| line.strip_prefix("admin API listening on "))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|url| url.split_once("://"))
            .and_then(|(_, addr)| addr.parse().ok());
        let embedded = |prefix: &str| -> Vec<(String, SocketAddr)> {
            lines
                .iter()
                .filter_map(|line| line.strip_prefix(prefix))
                .filter_map(|rest| {
                    let (name, url) = rest.split_once(" at http://")?;
                    Some((name.to_string(), url.trim().parse().ok()?))
                })
                .collect()
        };
        Ok(Gateway {
            process,
            addr,
            mockers: embedded("embedded mocker "),
            encoders: embedded("embedded encoder "),
            admin,
            dir,
            _turn: turn,
        })
    }
}

impl Gateway {
    /// Starts a plain-HTTP gateway from `config` with the admin API enabled on a free loopback
    /// port under `token`; returns it with a client of the admin API. It waits for the calling
    /// file's turn as [`Gateway::start`] does.
    ///
    /// # Errors
    ///
    /// Fails if the gateway does not start.
    #[track_caller]
    pub fn start_with_admin(config: &str, token: &str) -> anyhow::Result<(Gateway, Admin)> {
        Gateway::launch_with_admin(config, token, "", turns::take(Location::caller().file()))
    }

    /// As [`Gateway::start_with_admin`], with `admin_extra` (more `[admin]` keys, one per line,
    /// e.g. `worker_token = "..."`) added to the `[admin]` table.
    ///
    /// # Errors
    ///
    /// Fails if the gateway does not start.
    #[track_caller]
    pub fn start_with_admin_keys(config: &str, token: &str, admin_extra: &str) -> anyhow::Result<(Gateway, Admin)> {
        Gateway::launch_with_admin(config, token, admin_extra, turns::take(Location::caller().file()))
    }

    fn launch_with_admin(config: &str, token: &str, admin_extra: &str, turn: Turn) -> anyhow::Result<(Gateway, Admin)> {
        // Port 0, read back from the gateway's own line: a port found free here and handed over
        // can be taken by any other socket before the gateway binds it.
        let config = format!("{config}\n[admin]\nlisten = \"127.0.0.1:0\"\ntoken = \"{token}\"\n{admin_extra}\n");
        let gateway = Gateway::launch(&config, turn)?;
        let admin_addr = gateway.admin.context("the gateway printed no admin API line")?;
        let admin = Admin {
            client: Client::plain(admin_addr),
            token: token.to_string(),
        };
        Ok((gateway, admin))
    }
}

/// A client of a gateway's admin API.
#[derive(Debug, Clone)]
pub struct Admin {
    /// A plain client of the admin listener.
    pub client: Client,
    token: String,
}

impl Admin {
    /// The admin API's `http://HOST:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.client.addr)
    }

    /// The bearer token.
    pub fn token(&self) -> &str {
        &self.token
    }

    /// A client of the same listener that sends `token` instead (another credential, or a
    /// wrong one).
    pub fn with_token(&self, token: &str) -> Admin {
        Admin {
            client: self.client.clone(),
            token: token.to_string(),
        }
    }

    /// One authenticated request; returns the status and the body as JSON (`null` if it is not).
    ///
    /// # Errors
    ///
    /// Fails on any transport error.
    pub async fn call(&self, method: &str, path: &str, body: Vec<u8>) -> anyhow::Result<(u16, serde_json::Value)> {
        let mut connection = self.client.connect().await?;
        let reply = connection.send_with_auth(method, path, body, &self.token).await?;
        Ok((
            reply.status.as_u16(),
            serde_json::from_slice(&reply.body()).unwrap_or(serde_json::Value::Null),
        ))
    }

    /// `GET path` with the token; the status and the body as text.
    ///
    /// # Errors
    ///
    /// Fails if the admin listener cannot be reached.
    pub async fn get_text(&self, path: &str) -> anyhow::Result<(u16, String)> {
        let mut connection = self.client.connect().await?;
        let reply = connection.send_with_auth("GET", path, Vec::new(), &self.token).await?;
        Ok((
            reply.status.as_u16(),
            String::from_utf8_lossy(&reply.body()).into_owned(),
        ))
    }

    /// `GET /admin/kv`: the KV index summary.
    ///
    /// # Errors
    ///
    /// Fails on a transport error or a status other than 200.
    pub async fn kv_summary(&self) -> anyhow::Result<serde_json::Value> {
        let (status, body) = self.call("GET", "/admin/kv", Vec::new()).await?;
        anyhow::ensure!(status == 200, "GET /admin/kv answered {status}: {body}");
        Ok(body)
    }

    /// The name of the active router policy.
    ///
    /// # Errors
    ///
    /// Fails on any transport error.
    pub async fn active(&self) -> anyhow::Result<String> {
        let (_, list) = self.call("GET", "/admin/policies", Vec::new()).await?;
        Ok(list["active"]["name"].as_str().unwrap_or_default().to_string())
    }

    /// Waits up to 15 s until the KV index lists exactly `count` workers (workers that register
    /// or leave over NATS take a moment to show).
    ///
    /// # Errors
    ///
    /// Fails, showing the last summary, if the index does not list `count` workers in time.
    pub async fn wait_for_workers(&self, count: usize) -> anyhow::Result<()> {
        let registered = crate::eventually(Duration::from_secs(15), || async {
            self.kv_summary()
                .await
                .is_ok_and(|s| s["workers"].as_array().is_some_and(|w| w.len() == count))
        })
        .await;
        anyhow::ensure!(registered, "{count} worker(s) registered: {}", self.kv_summary().await?);
        Ok(())
    }
}

/// How many blocks the index holds for `worker`, from a `GET /admin/kv` summary (0 if absent).
pub fn cached_blocks(summary: &serde_json::Value, worker: &str) -> u64 {
    summary["workers"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|w| w["name"] == worker)
        .and_then(|w| w["cached_blocks"].as_u64())
        .unwrap_or(0)
}

/// The sum of every sample of metric `name` in Prometheus text whose labels contain all of
/// `labels` (`key="value"` strings); 0 when there is none.
pub fn metric_sum(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (metric, rest) = series.split_once('{').unwrap_or((series, ""));
            (metric == name && labels.iter().all(|label| rest.contains(label))).then(|| value.parse::<f64>().ok())?
        })
        .sum()
}
