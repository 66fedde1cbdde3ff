//! Processes' CPU time from `/proc/PID/stat`, and pinning processes to cores: what
//! `overhead` uses to charge each proxy only for its own work.

use std::process::Command;

use anyhow::Context;

/// Clock ticks per second of `/proc/PID/stat`'s times (`USER_HZ`, 100 on every Linux ABI).
const TICKS_PER_SECOND: f64 = 100.0;

/// The fields of `/proc/PID/stat` after the command name (which may hold spaces and parentheses,
/// so it is cut at the last `)`); field 3 of the file is the first of these.
fn stat_fields(pid: u32) -> Option<Vec<u64>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = text.rsplit_once(')')?;
    // The state is a letter; parse it as 0 so the indices stay the file's.
    Some(
        rest.split_whitespace()
            .map(|field| field.parse().unwrap_or(0))
            .collect(),
    )
}

/// The processes whose parent is `pid`.
pub fn children(pid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&child| stat_fields(child).and_then(|fields| fields.get(1).copied()) == Some(u64::from(pid)))
        .collect()
}

/// CPU seconds (user + system, every thread) `pid` and its direct children have used so far.
pub fn seconds(pid: u32) -> f64 {
    let own = |pid: u32| {
        // Fields 14 and 15 of the file (utime, stime) are 11 and 12 after the name.
        stat_fields(pid)
            .map(|fields| fields.get(11).copied().unwrap_or(0) + fields.get(12).copied().unwrap_or(0))
            .unwrap_or(0)
    };
    let ticks: u64 = own(pid) + children(pid).into_iter().map(own).sum::<u64>();
    ticks as f64 / TICKS_PER_SECOND
}

/// Which cores each side of the benchmark runs on.
#[derive(Debug, Clone)]
pub struct Pinning {
    /// The proxy under test (nginx, or the gateway).
    pub proxy: Vec<usize>,
    /// The mocker behind it.
    pub mocker: Vec<usize>,
    /// This process, the load generator.
    pub load: Vec<usize>,
}

impl Pinning {
    /// Splits `cores` (0..cores) so the proxy has `proxy_cores` to itself; the mocker and the
    /// load generator share the rest on two cores and split it on more. `None` on one core.
    pub fn plan(cores: usize, proxy_cores: usize) -> Option<Pinning> {
        if cores < 2 {
            return None;
        }
        let proxy_cores = proxy_cores.clamp(1, cores - 1);
        let proxy: Vec<usize> = (1..=proxy_cores).collect();
        let rest: Vec<usize> = (0..cores).filter(|core| !proxy.contains(core)).collect();
        if rest.len() == 1 {
            return Some(Pinning {
                proxy,
                mocker: rest.clone(),
                load: rest,
            });
        }
        // Core 0 and what is left after the mocker's half go to the load generator.
        let (load, mocker) = rest.split_at(rest.len() / 2);
        Some(Pinning {
            proxy,
            mocker: mocker.to_vec(),
            load: load.to_vec(),
        })
    }
}

/// A core list as `taskset -c` reads it.
pub fn list(cores: &[usize]) -> String {
    cores.iter().map(usize::to_string).collect::<Vec<_>>().join(",")
}

/// Pins every thread of this process to `cores`; processes started afterwards inherit it (and
/// size their thread pools from it).
///
/// # Errors
///
/// Fails when `taskset` is missing or refuses.
pub fn pin_self(cores: &[usize]) -> anyhow::Result<()> {
    let status = Command::new("taskset")
        .args(["-a", "-p", "-c", &list(cores), &std::process::id().to_string()])
        .stdout(std::process::Stdio::null())
        .status()
        .context("running taskset (util-linux)")?;
    anyhow::ensure!(status.success(), "taskset -a -p -c {} refused: {status}", list(cores));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_cores_give_the_proxy_one_to_itself() {
        let pinning = Pinning::plan(2, 1).expect("a plan");
        assert_eq!(pinning.proxy, vec![1]);
        assert_eq!(pinning.mocker, vec![0]);
        assert_eq!(pinning.load, vec![0]);
        assert!(Pinning::plan(1, 1).is_none());
    }

    #[test]
    fn more_cores_keep_every_side_apart() {
        let pinning = Pinning::plan(8, 2).expect("a plan");
        assert_eq!(pinning.proxy, vec![1, 2]);
        assert_eq!(pinning.load, vec![0, 3, 4]);
        assert_eq!(pinning.mocker, vec![5, 6, 7]);
    }

    #[test]
    fn this_process_has_used_some_cpu() {
        // Spin until the kernel has charged a tick (10 ms), for at most 5 s of wall time.
        let started = std::time::Instant::now();
        let mut sum = 0u64;
        while seconds(std::process::id()) == 0.0 && started.elapsed().as_secs() < 5 {
            for i in 0..1_000_000u64 {
                sum = sum.wrapping_add(std::hint::black_box(i));
            }
        }
        std::hint::black_box(sum);
        assert!(
            seconds(std::process::id()) > 0.0,
            "no CPU time read from /proc/self/stat"
        );
    }
}
