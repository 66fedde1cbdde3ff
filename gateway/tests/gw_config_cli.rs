//! The `switchyard` binary refuses bad configuration at start, naming the file, key and reason.

use std::process::Command;

fn run_with(config: &str) -> (bool, String) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("bad.toml");
    std::fs::write(&path, config).expect("write config");
    let output = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args([
            "--config",
            path.to_str().expect("utf-8 path"),
            "--listen",
            "127.0.0.1:0",
        ])
        .output()
        .expect("run switchyard");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn bad_configs_fail_at_start_naming_file_and_key() {
    let cases = [
        ("[server]\nlisten = \"nowhere\"\n[embedded_mockers]\n", "listen"),
        (
            "[server]\nmax_body_bytes = 0\n[embedded_mockers]\n",
            "server.max_body_bytes",
        ),
        ("[server]\nbogus = 1\n[embedded_mockers]\n", "bogus"),
        ("[[workers]]\nurl = \"not a url\"\nmodel = \"m\"\n", "workers[0].url"),
        ("mode = \"production\"\n[embedded_mockers]\n", "server.tls"),
        (
            "[server.tls]\ncert = \"/nonexistent/cert.pem\"\nkey = \"/nonexistent/key.pem\"\n[embedded_mockers]\n",
            "server.tls.cert",
        ),
        ("this is not toml", "bad.toml"),
        (
            "[server]\nplaintext = true\n[embedded_mockers]\n[media]\nfetch = true\n",
            "media.allow_hosts",
        ),
        (
            "[server]\nplaintext = true\n[embedded_mockers]\n[media]\nfetch = true\nallow_hosts = [\"a\"]\nfetch_ca_file = \"/nonexistent/ca.pem\"\n",
            "fetch_ca_file",
        ),
        (
            "[server]\nplaintext = true\n[embedded_mockers]\n[encoders]\nbatcher = \"nope\"\n",
            "nope",
        ),
    ];
    for (config, key) in cases {
        let (ok, stderr) = run_with(config);
        assert!(!ok, "must refuse: {config}");
        assert!(stderr.contains("bad.toml"), "names the file: {stderr}");
        assert!(stderr.contains(key), "names `{key}`: {stderr}");
    }
}

#[test]
fn a_missing_config_file_is_named() {
    let output = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["--config", "/nonexistent/switchyard.toml"])
        .output()
        .expect("run switchyard");
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("/nonexistent/switchyard.toml"));
}

#[test]
fn the_embedded_default_prints_a_ready_line_with_a_working_curl() {
    use std::io::{BufRead, BufReader};
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../config/dev.toml");
    let mut child = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args([
            "--config",
            config,
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--log",
            "warn",
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("run switchyard");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let ready = lines.next().and_then(Result::ok).unwrap_or_default();
    // Then the certificate's fingerprint, the embedded mockers' addresses, the admin listener
    // with the file holding its generated token and a push command, then the example request.
    let mut mockers = 0;
    let mut admin = String::new();
    let mut push = String::new();
    let curl = lines
        .by_ref()
        .map_while(Result::ok)
        .inspect(|line| {
            mockers += usize::from(line.starts_with("embedded mocker "));
            if line.starts_with("admin API listening on http://127.0.0.1:") {
                admin = line.clone();
            }
            if let Some(command) = line.strip_prefix("swap the router live: ") {
                push = command.to_string();
            }
        })
        .find(|line| line.starts_with("try: "))
        .unwrap_or_default();
    // The push command works as printed: the active router becomes least-load.
    let words: Vec<&str> = push.split_whitespace().collect();
    let pushed = match words.split_first() {
        Some((program, args)) => Command::new(program).args(args).output().expect("run the push"),
        None => panic!("no push example among the ready lines (admin line: {admin:?})"),
    };
    let list = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["policy", "list"])
        .args(&words[words.len() - 4..])
        .output()
        .expect("run policy list");
    // Stdout is a pipe here, as under a supervisor: the generated token is in a file only this
    // user can read, never on stdout.
    let token_file = admin
        .split("(token in ")
        .nth(1)
        .and_then(|rest| rest.strip_suffix(')'))
        .unwrap_or_default()
        .to_string();
    let token = std::fs::read_to_string(&token_file).unwrap_or_default();
    let mode = std::fs::metadata(&token_file).map(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()));
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(token.len(), 32, "{admin}: {token_file} holds {token:?}");
    assert_eq!(mode.ok().map(|mode| mode & 0o777), Some(0o600), "{token_file}");
    assert!(!admin.contains(&token) && !push.contains(&token), "{admin}\n{push}");
    assert!(
        pushed.status.success(),
        "{push}: {}",
        String::from_utf8_lossy(&pushed.stderr)
    );
    let list = String::from_utf8_lossy(&list.stdout);
    let listed: serde_json::Value = serde_json::from_str(&list).expect("policy list is JSON");
    assert_eq!(listed["active"]["name"], "least-load", "{list}");
    assert!(ready.contains("listening on https://127.0.0.1:"), "{ready}");
    assert!(ready.contains("4 workers"), "{ready}");
    assert_eq!(mockers, 4, "one address line per embedded mocker");
    assert!(curl.starts_with("try: curl -N -k https://127.0.0.1:"), "{curl}");
    assert!(
        curl.contains("\"model\":\"mock\"") && curl.contains("\"stream\":true"),
        "{curl}"
    );
}

/// Starts the binary on `config` (written to a file), reads stdout up to the example request,
/// stops it, and returns everything it wrote to stdout and stderr.
fn ready_output(config: &str) -> (String, String) {
    use std::io::{BufRead, BufReader, Read};
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("gateway.toml");
    std::fs::write(&path, config).expect("write config");
    let mut child = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args([
            "--config",
            path.to_str().expect("utf-8 path"),
            "--listen",
            "127.0.0.1:0",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run switchyard");
    let stdout = child.stdout.take().expect("stdout");
    let mut stderr = child.stderr.take().expect("stderr");
    let mut printed = String::new();
    for line in BufReader::new(stdout).lines().map_while(Result::ok) {
        printed.push_str(&line);
        printed.push('\n');
        if line.starts_with("try: ") {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    let mut logged = String::new();
    let _ = stderr.read_to_string(&mut logged);
    (printed, logged)
}

#[test]
fn a_configured_admin_token_is_never_printed() {
    let token = "0123456789abcdef0123";
    let config = format!(
        "mode = \"production\"\n[server]\nplaintext = true\n[embedded_mockers]\ncount = 1\n\
         [admin]\nlisten = \"127.0.0.1:0\"\ntoken = \"{token}\"\n"
    );
    let (stdout, stderr) = ready_output(&config);
    assert!(stdout.contains("admin API listening on http://127.0.0.1:"), "{stdout}");
    assert!(stdout.contains("try: "), "the gateway started: {stdout}{stderr}");
    assert!(!stdout.contains(token), "the token is on stdout: {stdout}");
    assert!(!stderr.contains(token), "the token is on stderr: {stderr}");
}
