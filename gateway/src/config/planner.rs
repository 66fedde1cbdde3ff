//! `[planner]` and `[[planner.pools]]`: the policy that sizes worker pools, how often it runs,
//! its bounds, and the connector that starts and stops workers.

use serde::Deserialize;

/// `[planner]`: the planning loop.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlannerConfig {
    /// The planner: a built-in (`load-based`, `sla-based`) or a path to a `planner` component.
    #[serde(default = "default_policy")]
    pub policy: String,
    /// The planner's own settings (its thresholds), read through the `config` import.
    #[serde(default)]
    pub policy_config: toml::Table,
    /// How often the pools' load is sampled, in milliseconds.
    #[serde(default = "default_metric_interval_ms")]
    pub metric_interval_ms: u64,
    /// How often the planner is asked, in seconds (fractions allowed, for time-compressed
    /// replays).
    #[serde(default = "default_adjustment_interval_s")]
    pub adjustment_interval_s: f64,
    /// GPUs the whole fleet may take (each pool's workers × `gpus_per_worker`); 0: no budget.
    #[serde(default)]
    pub max_gpu_budget: u32,
    /// Log decisions (and export them as metrics) without acting on them.
    #[serde(default)]
    pub no_operation: bool,
    /// What acts on decisions: `process` (start and stop processes on this machine from each
    /// pool's `command`), `kubernetes` (patch each pool's Deployment or StatefulSet scale
    /// through the API server), or `none` (decisions are only logged and exported, as with
    /// `no_operation`).
    #[serde(default = "default_connector")]
    pub connector: String,
    /// The pools.
    #[serde(default)]
    pub pools: Vec<PoolConfig>,
    /// With `[fleet]`: how long the planning lease lasts before another replica may take it
    /// over, in milliseconds.
    #[serde(default = "default_lease_ms")]
    pub lease_ms: u64,
    /// `kubernetes` connector: the API server, `https://HOST:PORT` (default: from the pod's
    /// `KUBERNETES_SERVICE_HOST` and `KUBERNETES_SERVICE_PORT`).
    #[serde(default)]
    pub kubernetes_api: Option<String>,
    /// `kubernetes` connector: the service account's folder (`token`, `ca.crt`, `namespace`).
    #[serde(default = "default_kubernetes_credentials")]
    pub kubernetes_credentials: std::path::PathBuf,
}

fn default_kubernetes_credentials() -> std::path::PathBuf {
    "/var/run/secrets/kubernetes.io/serviceaccount".into()
}

/// One point of a pool's measured profile: one worker's request rate within the targets at
/// one prompt and output length (`switchyard-bench profile` prints these).
#[derive(Debug, Clone, Copy, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ProfilePoint {
    /// Prompt tokens.
    pub isl: f64,
    /// Generated tokens.
    pub osl: f64,
    /// Requests per second one worker served within the pool's targets.
    pub rate: f64,
}

/// `[[planner.pools]]`: one pool of workers (a model and a role).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// The model its workers serve.
    pub model: String,
    /// `aggregated` (the default), `prefill`, `decode` or `encoder`: the pool owns its model's
    /// workers of role `llm`, `prefill`, `decode`, or `vision` and `audio`, respectively, and
    /// its figures are theirs (see [`crate::planner`]).
    #[serde(default = "default_role")]
    pub role: String,
    /// Fewest workers.
    #[serde(default = "default_min_workers")]
    pub min_workers: u32,
    /// Most workers.
    pub max_workers: u32,
    /// GPUs one worker takes.
    #[serde(default = "default_gpus_per_worker")]
    pub gpus_per_worker: u32,
    /// Prompt tokens one worker prefills per second at full load (for a prefill pool's queue
    /// utilization).
    #[serde(default = "default_prefill_tokens_per_s")]
    pub prefill_tokens_per_s: f64,
    /// Measured throughput within the targets, for `sla-based`.
    #[serde(default)]
    pub profile: Vec<ProfilePoint>,
    /// `process` connector: the command that starts one worker, as program and arguments;
    /// `{name}` becomes the worker's name (what it registers as), `{index}` its number.
    #[serde(default)]
    pub command: Vec<String>,
    /// `process` connector: workers are named `PREFIX-N` (default: the model with `-planned`).
    #[serde(default)]
    pub name_prefix: Option<String>,
    /// `kubernetes` connector: `deployments/NAME` or `statefulsets/NAME`.
    #[serde(default)]
    pub kubernetes_target: Option<String>,
    /// `kubernetes` connector: the namespace (default: the pod's own).
    #[serde(default)]
    pub kubernetes_namespace: Option<String>,
}

fn default_policy() -> String {
    "load-based".into()
}

fn default_metric_interval_ms() -> u64 {
    1000
}

fn default_adjustment_interval_s() -> f64 {
    30.0
}

fn default_connector() -> String {
    "process".into()
}

fn default_lease_ms() -> u64 {
    10_000
}

fn default_role() -> String {
    "aggregated".into()
}

fn default_min_workers() -> u32 {
    1
}

fn default_gpus_per_worker() -> u32 {
    1
}

fn default_prefill_tokens_per_s() -> f64 {
    40_000.0
}

/// The roles a pool may have.
pub const POOL_ROLES: [&str; 4] = ["aggregated", "prefill", "decode", "encoder"];

impl PoolConfig {
    /// The prefix of the names the `process` connector gives its workers.
    pub fn name_prefix(&self) -> String {
        self.name_prefix.clone().unwrap_or_else(|| {
            let model: String = self
                .model
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' })
                .collect();
            format!("{model}-planned")
        })
    }
}

impl PlannerConfig {
    /// The API server the `kubernetes` connector calls: `kubernetes_api`, else the pod's
    /// service environment.
    pub fn kubernetes_api(&self) -> Option<String> {
        self.kubernetes_api.clone().or_else(|| {
            let host = std::env::var("KUBERNETES_SERVICE_HOST").ok()?;
            let port = std::env::var("KUBERNETES_SERVICE_PORT").unwrap_or_else(|_| "443".into());
            let host = if host.contains(':') { format!("[{host}]") } else { host };
            Some(format!("https://{host}:{port}"))
        })
    }

    /// Checks the values; answers the offending key and why.
    pub(crate) fn check(&self) -> Result<(), (String, String)> {
        let key = |name: &str| format!("planner.{name}");
        if self.metric_interval_ms == 0 {
            return Err((key("metric_interval_ms"), "must be at least 1".into()));
        }
        if !(self.adjustment_interval_s.is_finite() && self.adjustment_interval_s >= 0.05) {
            return Err((
                key("adjustment_interval_s"),
                format!("must be at least 0.05 seconds, got {}", self.adjustment_interval_s),
            ));
        }
        if self.adjustment_interval_s * 1000.0 < self.metric_interval_ms as f64 {
            return Err((
                key("adjustment_interval_s"),
                format!(
                    "{} s is shorter than metric_interval_ms ({} ms): an interval needs a sample",
                    self.adjustment_interval_s, self.metric_interval_ms
                ),
            ));
        }
        if !["process", "kubernetes", "none"].contains(&self.connector.as_str()) {
            return Err((
                key("connector"),
                format!("`{}`: one of process, kubernetes, none", self.connector),
            ));
        }
        if self.connector == "kubernetes" && !self.no_operation {
            match self.kubernetes_api() {
                None => {
                    return Err((
                        key("kubernetes_api"),
                        "unset, and KUBERNETES_SERVICE_HOST is not set either (not in a pod)".into(),
                    ));
                }
                Some(api) if !api.starts_with("https://") => {
                    return Err((key("kubernetes_api"), format!("`{api}` must be an https:// URL")));
                }
                Some(_) => {}
            }
        }
        if self.lease_ms < 100 {
            return Err((key("lease_ms"), format!("{} ms: at least 100", self.lease_ms)));
        }
        for (index, pool) in self.pools.iter().enumerate() {
            self.check_pool(index, pool)?;
        }
        Ok(())
    }

    /// Checks `pool`, the `index`-th of [`PlannerConfig::pools`], against its connector and
    /// the pools before it; answers the offending key and why.
    fn check_pool(&self, index: usize, pool: &PoolConfig) -> Result<(), (String, String)> {
        let key = |name: &str| format!("planner.pools[{index}].{name}");
        if !POOL_ROLES.contains(&pool.role.as_str()) {
            return Err((
                key("role"),
                format!("`{}`: one of {}", pool.role, POOL_ROLES.join(", ")),
            ));
        }
        if pool.min_workers > pool.max_workers {
            return Err((
                key("min_workers"),
                format!("{} is more than max_workers ({})", pool.min_workers, pool.max_workers),
            ));
        }
        if pool.max_workers == 0 {
            return Err((key("max_workers"), "must be at least 1".into()));
        }
        if !(pool.prefill_tokens_per_s.is_finite() && pool.prefill_tokens_per_s > 0.0) {
            return Err((
                key("prefill_tokens_per_s"),
                format!("must be a positive number, got {}", pool.prefill_tokens_per_s),
            ));
        }
        for (n, point) in pool.profile.iter().enumerate() {
            let finite = [point.isl, point.osl, point.rate]
                .iter()
                .all(|v| v.is_finite() && *v >= 0.0);
            if !finite || point.rate <= 0.0 {
                return Err((
                    key(&format!("profile[{n}]")),
                    "isl and osl must be numbers ≥ 0 and rate > 0".into(),
                ));
            }
        }
        if self.connector == "process" && !self.no_operation && pool.command.is_empty() {
            return Err((
                key("command"),
                "the process connector needs the command that starts one worker".into(),
            ));
        }
        if self.connector == "kubernetes" && !self.no_operation {
            let target = pool.kubernetes_target.as_deref().unwrap_or("");
            let ok = target
                .split_once('/')
                .is_some_and(|(kind, name)| ["deployments", "statefulsets"].contains(&kind) && !name.is_empty());
            if !ok {
                return Err((
                    key("kubernetes_target"),
                    format!("`{target}`: deployments/NAME or statefulsets/NAME"),
                ));
            }
        }
        if self
            .pools
            .iter()
            .take(index)
            .any(|other| other.model == pool.model && other.role == pool.role)
        {
            return Err((
                key("model"),
                format!("a second pool of `{}` ({})", pool.model, pool.role),
            ));
        }
        Ok(())
    }
}

/// The rate one worker serves within the targets at `isl`/`osl`, from `profile`: inverse-
/// distance weighted over the measured points (each axis relative to its span), exact at a
/// measured point; 0 without a profile.
pub fn profiled_rate(profile: &[ProfilePoint], isl: f64, osl: f64) -> f64 {
    if profile.is_empty() {
        return 0.0;
    }
    let span = |pick: fn(&ProfilePoint) -> f64| {
        let (low, high) = profile
            .iter()
            .map(pick)
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), v| (l.min(v), h.max(v)));
        (high - low).max(1.0)
    };
    let (isl_span, osl_span) = (span(|p| p.isl), span(|p| p.osl));
    let mut weighted = 0.0;
    let mut weights = 0.0;
    for point in profile {
        let d = ((point.isl - isl) / isl_span).powi(2) + ((point.osl - osl) / osl_span).powi(2);
        if d < 1e-12 {
            return point.rate;
        }
        let w = 1.0 / d;
        weighted += w * point.rate;
        weights += w;
    }
    weighted / weights
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(isl: f64, osl: f64, rate: f64) -> ProfilePoint {
        ProfilePoint { isl, osl, rate }
    }

    fn config(text: &str) -> PlannerConfig {
        toml::from_str(text).expect("parses")
    }

    #[test]
    fn bad_settings_name_their_key() {
        let pool = "[[pools]]\nmodel = \"m\"\nmax_workers = 2\ncommand = [\"w\"]\n";
        assert!(config(pool).check().is_ok());
        let (key, _) = config(&format!(
            "adjustment_interval_s = 0.5\nmetric_interval_ms = 1000\n{pool}"
        ))
        .check()
        .unwrap_err();
        assert_eq!(key, "planner.adjustment_interval_s");
        let k8s = "connector = \"kubernetes\"\nkubernetes_api = \"http://10.0.0.1\"\n[[pools]]\nmodel = \"m\"\nmax_workers = 2\n";
        let (key, _) = config(k8s).check().unwrap_err();
        assert_eq!(key, "planner.kubernetes_api", "not https");
        let (key, _) = config(&k8s.replace("http://", "https://")).check().unwrap_err();
        assert_eq!(key, "planner.pools[0].kubernetes_target");
        let (key, _) = config("connector = \"bogus\"\n").check().unwrap_err();
        assert_eq!(key, "planner.connector");
        let (key, _) = config("[[pools]]\nmodel = \"m\"\nmax_workers = 2\n")
            .check()
            .unwrap_err();
        assert_eq!(key, "planner.pools[0].command", "the process connector needs a command");
        let (key, _) = config("[[pools]]\nmodel = \"m\"\nmin_workers = 3\nmax_workers = 2\ncommand = [\"w\"]\n")
            .check()
            .unwrap_err();
        assert_eq!(key, "planner.pools[0].min_workers");
        let (key, _) = config(&format!(
            "{pool}[[pools]]\nmodel = \"m\"\nmax_workers = 1\ncommand = [\"w\"]\n"
        ))
        .check()
        .unwrap_err();
        assert_eq!(
            key, "planner.pools[1].model",
            "a second pool of the same model and role"
        );
    }

    #[test]
    fn the_profile_is_interpolated_and_exact_at_its_points() {
        let profile = [point(1000.0, 100.0, 8.0), point(4000.0, 100.0, 2.0)];
        assert_eq!(profiled_rate(&profile, 1000.0, 100.0), 8.0);
        let middle = profiled_rate(&profile, 2500.0, 100.0);
        assert!((middle - 5.0).abs() < 1e-9, "{middle}");
        let near = profiled_rate(&profile, 1200.0, 100.0);
        assert!(near > 5.0 && near < 8.0, "{near}");
        assert_eq!(profiled_rate(&[], 1.0, 1.0), 0.0);
    }
}
