//! Connectors: what turns a pool's desired size into workers starting and stopping.
//!
//! [`ProcessConnector`] runs workers as processes on this machine from each pool's `command`
//! (the embedded default's way to grow: `switchyard-mocker` or `switchyard-llm` processes
//! that register themselves over NATS or the admin API). A scale-down sends SIGTERM to the
//! newest worker: it leaves routing at once and drains its streams before it exits, so no
//! stream is cut. Processes stop with the gateway: killed when it drops their handles, and on
//! Linux sent SIGTERM by the kernel when it dies any other way (`PR_SET_PDEATHSIG`). The `kubernetes`
//! connector is in [`crate::planner::kubernetes`]; [`LogOnly`] acts on nothing.

use std::collections::HashSet;

use parking_lot::Mutex;

use crate::config::PoolConfig;

/// How many of a pool's workers a connector has under way.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UnderWay {
    /// Started and not registered yet.
    pub starting: u32,
    /// Told to stop and not gone yet.
    pub draining: u32,
}

/// Acts on the planner's decisions.
pub trait Connector: Send + Sync + std::fmt::Debug {
    /// Brings pool `index` (configured as `pool`) towards `desired` workers; `registered` are
    /// the names of its workers in routing now. Called every metric interval, so it also
    /// notices workers that exited.
    ///
    /// # Errors
    ///
    /// Why a worker could not be started or stopped, for the log.
    fn reconcile(
        &self,
        index: usize,
        pool: &PoolConfig,
        desired: u32,
        registered: &HashSet<String>,
    ) -> Result<(), String>;

    /// What pool `index` has under way, given its registered workers.
    fn under_way(&self, index: usize, registered: &HashSet<String>) -> UnderWay;

    /// Whether `name` is one of the workers this connector manages for pool `index` (the
    /// pool's workers in the registry are those).
    fn manages(&self, index: usize, pool: &PoolConfig, name: &str) -> bool;

    /// The size pool `index` already has outside the gateway (a Deployment's replicas), which
    /// the planner adopts once instead of its minimum; `None` where the connector starts from
    /// nothing.
    fn current_size(&self, index: usize) -> Option<u32> {
        let _ = index;
        None
    }
}

/// One worker process.
#[derive(Debug)]
struct Managed {
    name: String,
    child: tokio::process::Child,
    stopping: bool,
}

/// Workers as processes on this machine.
#[derive(Debug, Default)]
pub struct ProcessConnector {
    pools: Mutex<Vec<Vec<Managed>>>,
    next_index: Mutex<Vec<u64>>,
}

impl ProcessConnector {
    fn start(pool: &PoolConfig, name: &str, index: u64) -> Result<tokio::process::Child, String> {
        let expand = |part: &String| part.replace("{name}", name).replace("{index}", &index.to_string());
        let (program, args) = pool
            .command
            .split_first()
            .ok_or_else(|| "the pool has no command".to_string())?;
        let mut command = tokio::process::Command::new(expand(program));
        command
            .args(args.iter().map(expand))
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .kill_on_drop(true);
        #[cfg(target_os = "linux")]
        // SAFETY: the closure runs in the child between fork and exec and only calls `prctl`,
        // which is async-signal-safe. It asks for SIGTERM when the gateway dies without
        // dropping the child handle (a crash, SIGKILL): the worker then drains and exits
        // instead of running on unplanned.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        command
            .spawn()
            .map_err(|err| format!("cannot start `{}`: {err}", expand(program)))
    }

    fn terminate(child: &tokio::process::Child) -> Result<(), String> {
        let Some(pid) = child.id() else {
            return Ok(());
        };
        #[cfg(unix)]
        {
            let pid = libc::pid_t::try_from(pid).map_err(|_| format!("process id {pid} out of range"))?;
            // SAFETY: `kill` has no memory effects; `pid` is our own child, not yet reaped
            // (`id()` answers `None` once it has been), so it cannot name another process.
            if unsafe { libc::kill(pid, libc::SIGTERM) } != 0 {
                return Err(format!("SIGTERM to {pid}: {}", std::io::Error::last_os_error()));
            }
            Ok(())
        }
        #[cfg(not(unix))]
        {
            Err(format!("stopping process {pid} gracefully needs a Unix system"))
        }
    }
}

impl Connector for ProcessConnector {
    fn reconcile(
        &self,
        index: usize,
        pool: &PoolConfig,
        desired: u32,
        _registered: &HashSet<String>,
    ) -> Result<(), String> {
        let mut pools = self.pools.lock();
        let mut next = self.next_index.lock();
        if pools.len() <= index {
            pools.resize_with(index + 1, Vec::new);
            next.resize(index + 1, 0);
        }
        let workers = &mut pools[index];
        workers.retain_mut(|worker| match worker.child.try_wait() {
            Ok(Some(status)) => {
                if !worker.stopping {
                    tracing::warn!(worker = %worker.name, %status, "planned worker exited on its own");
                }
                false
            }
            _ => true,
        });
        let live = workers.iter().filter(|w| !w.stopping).count() as u32;
        if live < desired {
            for _ in live..desired {
                let number = next[index];
                next[index] += 1;
                let name = format!("{}-{number}", pool.name_prefix());
                let child = ProcessConnector::start(pool, &name, number)?;
                tracing::info!(worker = %name, pid = ?child.id(), "planner started a worker");
                workers.push(Managed {
                    name,
                    child,
                    stopping: false,
                });
            }
        } else if live > desired {
            // The newest go first: the oldest have the warmest caches.
            let mut surplus = live - desired;
            for worker in workers.iter_mut().rev().filter(|w| !w.stopping) {
                if surplus == 0 {
                    break;
                }
                ProcessConnector::terminate(&worker.child)?;
                worker.stopping = true;
                surplus -= 1;
                tracing::info!(worker = %worker.name, "planner stopping a worker (SIGTERM: it drains)");
            }
        }
        Ok(())
    }

    fn under_way(&self, index: usize, registered: &HashSet<String>) -> UnderWay {
        let pools = self.pools.lock();
        let Some(workers) = pools.get(index) else {
            return UnderWay::default();
        };
        UnderWay {
            starting: workers
                .iter()
                .filter(|w| !w.stopping && !registered.iter().any(|r| is_named(r, &w.name)))
                .count() as u32,
            draining: workers.iter().filter(|w| w.stopping).count() as u32,
        }
    }

    fn manages(&self, _index: usize, pool: &PoolConfig, name: &str) -> bool {
        name.strip_prefix(&pool.name_prefix())
            .and_then(|rest| rest.strip_prefix('-'))
            .is_some_and(|rest| !rest.is_empty())
    }
}

/// Whether registered worker `registered` is the process started as `started`: the same
/// name, or the name with an engine number (`switchyard-mocker --name N` registers `N-0`).
fn is_named(registered: &str, started: &str) -> bool {
    registered == started
        || registered
            .strip_prefix(started)
            .and_then(|rest| rest.strip_prefix('-'))
            .is_some_and(|rest| !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit()))
}

/// No connector: decisions are logged and exported, nothing is started or stopped. A pool's
/// workers are every worker of its model and role.
#[derive(Debug, Default)]
pub struct LogOnly;

impl Connector for LogOnly {
    fn reconcile(&self, _: usize, _: &PoolConfig, _: u32, _: &HashSet<String>) -> Result<(), String> {
        Ok(())
    }

    fn under_way(&self, _: usize, _: &HashSet<String>) -> UnderWay {
        UnderWay::default()
    }

    fn manages(&self, _: usize, _: &PoolConfig, _: &str) -> bool {
        true
    }
}
