//! Helpers the worker binaries' HTTP tests share: start a binary and read the addresses it
//! prints, and a minimal HTTP/1.1 client.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};

/// A running worker binary (killed when dropped) and the addresses it listens on.
pub struct Running(pub Child, pub Vec<SocketAddr>);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `binary` with `args` and reads its stdout until a line starting with `ready`,
/// collecting every `listening on http://ADDR`.
pub fn start(binary: &str, args: &[&str], ready: &str) -> Running {
    let mut child = Command::new(binary)
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the binary");
    let stdout = child.stdout.take().expect("stdout");
    let mut addrs = Vec::new();
    for line in BufReader::new(stdout).lines() {
        let line = line.expect("line");
        if let Some(addr) = line.split("listening on http://").nth(1) {
            addrs.push(addr.trim().parse().expect("address"));
        }
        if line.starts_with(ready) {
            break;
        }
    }
    Running(child, addrs)
}

/// A minimal HTTP/1.1 exchange with `connection: close`; returns status and body.
pub fn post(addr: SocketAddr, path: &str, body: &str) -> (u16, String) {
    request(addr, "POST", path, body)
}

/// `GET path`; returns status and body.
pub fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    request(addr, "GET", path, "")
}

fn request(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).expect("connect");
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("write");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read");
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// The JSON payloads of an SSE body's `data:` lines, `[DONE]` excluded.
pub fn sse_events(body: &str) -> Vec<serde_json::Value> {
    body.lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter(|data| *data != "[DONE]")
        .map(|data| serde_json::from_str(data).expect("an SSE event is JSON"))
        .collect()
}
