//! The trace-replay tools end to end: `switchyard-bench replay`, `synth` and `compare` run as
//! real processes against real gateways with embedded mockers, on small traces built here.

use std::path::Path;
use std::process::Command;

use switchyard_bench::replay::RequestRecord;
use switchyard_bench::trace::{TraceRequest, read_trace, write_trace};
use switchyard_harness::{Gateway, TestCa};

/// `sessions` conversations of `turns` turns each, interleaved in time: turn k of a session
/// repeats the session's ids so far and adds two new blocks, as the Mooncake conversation trace
/// does; every request starts with the shared block 0.
fn conversation_trace(sessions: u64, turns: u64, gap_ms: u64, output: u32) -> Vec<TraceRequest> {
    let mut requests = Vec::new();
    let mut next_id = 1;
    let mut histories: Vec<Vec<u64>> = vec![vec![0]; sessions as usize];
    for turn in 0..turns {
        for (session, history) in histories.iter_mut().enumerate() {
            history.push(next_id);
            history.push(next_id + 1);
            next_id += 2;
            let blocks = history.len() as u32;
            requests.push(TraceRequest {
                timestamp: (turn * sessions + session as u64) * gap_ms,
                input_length: (blocks - 1) * 64 + 40,
                output_length: output,
                hash_ids: history.clone(),
                media: Vec::new(),
            });
        }
    }
    requests
}

fn bench(args: &[&str]) -> anyhow::Result<std::process::Output> {
    let output = Command::new(env!("CARGO_BIN_EXE_switchyard-bench"))
        .args(args)
        .output()?;
    anyhow::ensure!(
        output.status.success(),
        "switchyard-bench {args:?} failed: {}\n{}",
        String::from_utf8_lossy(&output.stderr),
        String::from_utf8_lossy(&output.stdout)
    );
    Ok(output)
}

fn records(path: &Path) -> anyhow::Result<Vec<RequestRecord>> {
    std::fs::read_to_string(path)?
        .lines()
        .map(|line| Ok(serde_json::from_str(line)?))
        .collect()
}

#[test]
fn replay_streams_every_request_over_tls_on_the_trace_schedule() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    // 24 requests, one every 100 ms of trace time, replayed at 2x: scheduled 50 ms apart.
    let trace = conversation_trace(4, 6, 100, 8);
    let trace_path = dir.path().join("trace.jsonl");
    write_trace(&trace_path, &trace)?;
    let ca = TestCa::new()?;
    let gateway = Gateway::start(&format!(
        "mode = \"production\"\n{}\n[embedded_mockers]\ncount = 2\nspeedup = 4.0\n",
        ca.tls_toml()
    ))?;
    let out = dir.path().join("records.jsonl");
    let output = bench(&[
        "replay",
        trace_path.to_str().unwrap_or_default(),
        "--url",
        &format!("https://localhost:{}", gateway.addr.port()),
        "--ca-cert",
        ca.ca_path.to_str().unwrap_or_default(),
        "--block-tokens",
        "64",
        "--speedup",
        "2",
        "--output",
        out.to_str().unwrap_or_default(),
        "--no-progress",
    ])?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("| TTFT |"), "no summary table: {stdout}");
    assert!(stdout.contains("24 answered in full"), "{stdout}");

    let records = records(&out)?;
    assert_eq!(records.len(), trace.len());
    for (index, (record, request)) in records.iter().zip(&trace).enumerate() {
        assert_eq!(record.index, index);
        assert!(record.ok(), "request {index} failed: {:?}", record.error);
        assert_eq!(record.output_tokens, 8, "request {index}");
        assert!((record.scheduled_ms - request.timestamp as f64 / 2.0).abs() < 1e-6);
        let (ttft, e2e) = (record.ttft_ms.unwrap_or(-1.0), record.e2e_ms.unwrap_or(-1.0));
        assert!(ttft > 0.0 && ttft <= e2e, "request {index}: ttft {ttft} e2e {e2e}");
        assert!(record.itl_ms.is_some_and(|itl| itl >= 0.0));
        assert!(record.worker.as_deref().is_some_and(|w| w.starts_with("embedded-")));
        // The chat template adds a few tokens around the trace's prompt.
        let prompt = record.prompt_tokens.unwrap_or(0);
        assert!(
            prompt >= request.input_length && prompt < request.input_length + 64,
            "{prompt}"
        );
    }
    // Later turns repeat earlier ones' blocks: the workers found some of them cached.
    let cached: u32 = records.iter().filter_map(|r| r.cached_tokens).sum();
    assert!(cached > 0, "no prefix was ever found cached");
    Ok(())
}

#[test]
fn replay_is_open_loop_a_slow_server_does_not_delay_arrivals() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    // Each request takes ~30 ms/token × 20 tokens ≥ 0.5 s, yet they are due 20 ms apart.
    let trace = conversation_trace(10, 1, 20, 20);
    let trace_path = dir.path().join("trace.jsonl");
    write_trace(&trace_path, &trace)?;
    let gateway = Gateway::start("[server]\nplaintext = true\n[embedded_mockers]\ncount = 1\nspeedup = 0.2\n")?;
    let out = dir.path().join("records.jsonl");
    bench(&[
        "replay",
        trace_path.to_str().unwrap_or_default(),
        "--url",
        &format!("http://{}", gateway.addr),
        "--block-tokens",
        "64",
        "--output",
        out.to_str().unwrap_or_default(),
        "--no-progress",
    ])?;
    let records = records(&out)?;
    assert_eq!(records.len(), 10);
    let slowest = records.iter().filter_map(|r| r.e2e_ms).fold(0.0, f64::max);
    assert!(
        slowest > 400.0,
        "the server was not slow ({slowest} ms); the test proves nothing"
    );
    for record in &records {
        assert!(record.ok(), "{:?}", record.error);
        assert!(
            record.lag_ms < 100.0,
            "request {} was sent {} ms late",
            record.index,
            record.lag_ms
        );
    }
    Ok(())
}

#[test]
fn replay_help_documents_every_flag() -> anyhow::Result<()> {
    let output = bench(&["replay", "--help"])?;
    let help = String::from_utf8_lossy(&output.stdout);
    for flag in [
        "--url",
        "--ca-cert",
        "--insecure",
        "--model",
        "--block-tokens",
        "--speedup",
        "--start-ms",
        "--duration-ms",
        "--max-requests",
        "--output",
        "--summary-json",
        "--timeout-s",
        "--no-progress",
    ] {
        let line = help
            .lines()
            .find(|line| line.trim_start().starts_with(flag))
            .unwrap_or_else(|| panic!("{flag} is not in the help:\n{help}"));
        // clap puts the description on the flag's line or the next one; an empty one is a bug.
        let documented = line.trim_start().len() > flag.len() + 12 || help.contains(&format!("{line}\n          "));
        assert!(documented, "{flag} has no description:\n{help}");
    }
    Ok(())
}

#[test]
fn a_bad_trace_line_is_refused_with_its_line_number() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("bad.jsonl");
    std::fs::write(
        &path,
        "{\"timestamp\":0,\"input_length\":10,\"output_length\":1,\"hash_ids\":[0]}\nnot json\n",
    )?;
    let output = Command::new(env!("CARGO_BIN_EXE_switchyard-bench"))
        .args([
            "replay",
            path.to_str().unwrap_or_default(),
            "--url",
            "http://127.0.0.1:9",
        ])
        .output()?;
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("bad.jsonl:2"), "{stderr}");
    Ok(())
}

#[test]
fn synth_writes_a_trace_with_the_sources_shape() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let source = conversation_trace(30, 8, 50, 16);
    let source_path = dir.path().join("source.jsonl");
    write_trace(&source_path, &source)?;
    let out = dir.path().join("synth.jsonl");
    let output = bench(&[
        "synth",
        source_path.to_str().unwrap_or_default(),
        "--output",
        out.to_str().unwrap_or_default(),
        "--block-tokens",
        "64",
        "--num-requests",
        "100",
        "--osl-multiplier",
        "2",
        "--seed",
        "7",
    ])?;
    let synthesized = read_trace(&out)?;
    assert_eq!(synthesized.len(), 100);
    assert!(synthesized.iter().all(|r| r.output_length == 32), "OSL 16 × 2");
    assert!(
        synthesized
            .iter()
            .all(|r| r.hash_ids.first() == Some(&0) || r.hash_ids.is_empty())
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("source") && stdout.contains("synthesized"), "{stdout}");
    Ok(())
}

#[test]
fn compare_writes_a_report_and_kv_aware_finds_more_cached_prefixes_than_round_robin() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    // 5 conversations × 6 turns on 3 workers: round-robin scatters each conversation's turns,
    // kv-aware sends a turn where its history is cached. The count of conversations is not a
    // multiple of the workers': with 6, a round-robin turn counter that saw every request in
    // order sent each conversation to the same worker every turn, as sticky as kv-aware.
    let trace = conversation_trace(5, 6, 40, 4);
    let trace_path = dir.path().join("trace.jsonl");
    write_trace(&trace_path, &trace)?;
    let out = dir.path().join("report");
    let output = bench(&[
        "compare",
        trace_path.to_str().unwrap_or_default(),
        "--block-tokens",
        "64",
        "--workers",
        "3",
        "--policies",
        "round-robin,kv-aware",
        "--mocker-speedup",
        "10",
        "--out",
        out.to_str().unwrap_or_default(),
        "--no-progress",
    ])?;
    let report = std::fs::read_to_string(out.join("report.md"))?;
    for needle in [
        "| round-robin |",
        "| kv-aware |",
        "ttft_cdf.svg",
        "latency.svg",
        "load-kv-aware.svg",
        "### What the engines counted",
    ] {
        assert!(report.contains(needle), "report.md lacks {needle}:\n{report}");
    }
    // The engines' own counters came back from the mockers' /metrics: 30 requests of 40 to 200
    // tokens each were admitted, so the row's steps are not 0.
    let engines_row = report
        .lines()
        .skip_while(|line| !line.starts_with("### What the engines counted"))
        .find(|line| line.starts_with("| kv-aware |"))
        .unwrap_or_default();
    let steps: u64 = engines_row
        .trim_end_matches('|')
        .rsplit('|')
        .next()
        .unwrap_or_default()
        .trim()
        .parse()
        .unwrap_or(0);
    assert!(steps > 0, "engine steps in `{engines_row}`:\n{report}");
    for file in [
        "ttft_cdf.svg",
        "latency.svg",
        "load-round-robin.svg",
        "load-kv-aware.svg",
        "records-kv-aware.jsonl",
    ] {
        let text = std::fs::read_to_string(out.join(file))?;
        assert!(!text.is_empty(), "{file} is empty");
    }
    let hit = |policy: &str| -> anyhow::Result<f64> {
        let summary: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join(format!("summary-{policy}.json")))?)?;
        assert_eq!(summary["succeeded"], 30, "{policy}: {summary}");
        Ok(summary["cache_hit_ratio"].as_f64().unwrap_or(0.0))
    };
    let (round_robin, kv_aware) = (hit("round-robin")?, hit("kv-aware")?);
    assert!(
        kv_aware > round_robin + 0.1,
        "kv-aware hit {kv_aware:.3} vs round-robin {round_robin:.3}\n{}",
        String::from_utf8_lossy(&output.stdout)
    );
    Ok(())
}

#[test]
fn compare_repeats_rounds_and_passes_policy_settings() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let trace = conversation_trace(2, 3, 40, 4);
    let trace_path = dir.path().join("trace.jsonl");
    write_trace(&trace_path, &trace)?;
    let out = dir.path().join("report");
    bench(&[
        "compare",
        trace_path.to_str().unwrap_or_default(),
        "--block-tokens",
        "64",
        "--workers",
        "2",
        "--policies",
        "predicted-ttft:impact_weight=8:decode_weight=0",
        "--repeat",
        "2",
        "--mocker-speedup",
        "10",
        "--out",
        out.to_str().unwrap_or_default(),
        "--no-progress",
    ])?;
    let report = std::fs::read_to_string(out.join("report.md"))?;
    assert!(report.contains("### Round by round"), "{report}");
    assert!(
        report.contains("| predicted-ttft:impact_weight=8:decode_weight=0 |"),
        "{report}"
    );
    let stem = "predicted-ttft_impact_weight_8_decode_weight_0";
    for round in [1, 2] {
        let records = std::fs::read_to_string(out.join(format!("records-{stem}-round{round}.jsonl")))?;
        assert_eq!(records.lines().count(), 6, "round {round}");
    }
    let summary: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join(format!("summary-{stem}.json")))?)?;
    assert_eq!(summary["requests"], 12, "both rounds pooled: {summary}");
    assert_eq!(summary["succeeded"], 12, "{summary}");
    // A setting that is not KEY=VALUE is refused before anything starts.
    let refused = bench(&[
        "compare",
        trace_path.to_str().unwrap_or_default(),
        "--policies",
        "kv-aware:weight",
        "--out",
        out.to_str().unwrap_or_default(),
    ]);
    let Err(err) = refused else {
        anyhow::bail!("`kv-aware:weight` was accepted");
    };
    assert!(format!("{err:#}").contains("not KEY=VALUE"), "{err:#}");
    Ok(())
}

#[test]
fn a_multimodal_workload_is_synthesized_replayed_and_reported_by_modality() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let source = conversation_trace(8, 4, 60, 4);
    let source_path = dir.path().join("source.jsonl");
    write_trace(&source_path, &source)?;
    let workload = dir.path().join("multimodal.jsonl");
    let output = bench(&[
        "synth",
        source_path.to_str().unwrap_or_default(),
        "--output",
        workload.to_str().unwrap_or_default(),
        "--block-tokens",
        "64",
        "--image-share",
        "0.4",
        "--audio-share",
        "0.2",
        "--video-share",
        "0.2",
        "--media-repeat",
        "0.5",
        "--video-seconds",
        "1..3",
        "--audio-seconds",
        "1..4",
        "--seed",
        "3",
    ])?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("repeats"), "{stdout}");
    let synthesized = read_trace(&workload)?;
    for modality in ["text", "image", "audio", "video"] {
        assert!(
            synthesized.iter().any(|r| r.modality() == modality),
            "no {modality} request in the workload"
        );
    }
    let out = dir.path().join("report");
    bench(&[
        "compare",
        workload.to_str().unwrap_or_default(),
        "--block-tokens",
        "64",
        "--workers",
        "2",
        "--policies",
        "kv-aware,modality-aware,kv-aware:encoders.blocking=true",
        "--mocker-speedup",
        "10",
        "--out",
        out.to_str().unwrap_or_default(),
        "--no-progress",
    ])?;
    let report = std::fs::read_to_string(out.join("report.md"))?;
    for needle in [
        "### By modality",
        "### What the encoders did",
        "| modality-aware |",
        "| kv-aware:encoders.blocking=true |",
    ] {
        assert!(report.contains(needle), "report.md lacks {needle}:\n{report}");
    }
    let summary: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("summary-modality-aware.json"))?)?;
    assert_eq!(summary["succeeded"], 32, "{summary}");
    assert_eq!(summary["text_only"], 0, "every item encoded: {summary}");
    for modality in ["text", "image", "audio", "video"] {
        assert!(
            summary["ttft_by_modality"][modality]["count"].as_u64().unwrap_or(0) > 0,
            "{modality}: {summary}"
        );
    }
    // The encoders' row: items were encoded, repeats were served from feature caches.
    let row = report
        .lines()
        .skip_while(|line| !line.starts_with("### What the encoders did"))
        .find(|line| line.starts_with("| modality-aware |"))
        .unwrap_or_default()
        .to_string();
    let cells: Vec<&str> = row.split('|').map(str::trim).collect();
    assert!(
        cells.get(2).and_then(|c| c.parse::<u64>().ok()).unwrap_or(0) > 0,
        "{row}"
    );
    assert!(!cells.get(3).unwrap_or(&"0").starts_with('0'), "no cache hit: {row}");
    Ok(())
}
