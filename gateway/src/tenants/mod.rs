//! Clients and tenants: API keys, what each may use, rate limits, monthly quotas, and the
//! tokens each tenant used.
//!
//! With no `[[api_keys]]` and no `[tenants] keys_file` the gateway is open and none of this
//! runs. Otherwise every OpenAI request names a key (`Authorization: Bearer KEY`), looked up
//! by its SHA-256 ([`Tenants::authenticate`]: 401 when missing or unknown). The key's
//! [`Grant`] says which models it may use (403 otherwise) and its priority class; its tenant
//! holds the limits the tenant's keys share: requests and tokens a minute, each a
//! continuously refilled [`bucket::Bucket`], and tokens a calendar month. Admission
//! ([`Tenants::admit`]) answers 429 with `Retry-After` when a limit is reached, and hands out a
//! [`Charge`] that follows the request: it takes the prompt's tokens once they are counted and,
//! when dropped, settles with what the worker reported ([`usage`]), counting the tenant's
//! tokens in `switchyard_tenant_tokens_total{tenant,model,kind}`.

pub(crate) mod bucket;
mod month;
pub(crate) mod usage;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use arc_swap::ArcSwap;
use http::{HeaderMap, StatusCode, header};
use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use sha2::{Digest, Sha256};
use switchyard_protocol::api::{ApiError, Usage};
use tokio::task::JoinHandle;

use crate::config::{ApiKeyConfig, Config, ConfigError, KeysFile, validate_key_lists};
use bucket::Bucket;
use month::{Month, UsageFile};

/// How often changed monthly usage is written to `[tenants] usage_file`.
const SAVE_EVERY: Duration = Duration::from_secs(2);

type Labels = Vec<(&'static str, String)>;

/// The tenants' metric families.
#[derive(Debug, Clone, Default)]
struct TenantMetrics {
    tokens: Family<Labels, Counter>,
    requests: Family<Labels, Counter>,
    refused: Family<Labels, Counter>,
    month_tokens: Family<Labels, Gauge>,
    unauthorized: Family<Labels, Counter>,
    key_reloads: Family<Labels, Counter>,
}

/// What a key may do: its tenant, its models and its priority class.
#[derive(Debug)]
pub(crate) struct Grant {
    tenant: Arc<Tenant>,
    /// Models the key may use; empty: every model.
    models: Vec<String>,
    priority: u8,
}

impl Grant {
    /// The key's tenant.
    pub(crate) fn tenant(&self) -> &str {
        &self.tenant.name
    }

    /// The key's priority class in the admission queue, higher first.
    pub(crate) fn priority(&self) -> u8 {
        self.priority
    }

    /// The tenant's share of the admission queue under `fair-share`.
    pub(crate) fn weight(&self) -> f64 {
        self.tenant.state.lock().weight
    }

    /// Whether the key may use `model`.
    pub(crate) fn allows(&self, model: &str) -> bool {
        self.models.is_empty() || self.models.iter().any(|allowed| allowed == model)
    }

    /// The models of `served` the key may use.
    pub(crate) fn visible<'a>(&self, served: &'a [String]) -> Vec<&'a str> {
        served
            .iter()
            .filter(|model| self.allows(model))
            .map(String::as_str)
            .collect()
    }
}

/// One tenant: the limits its keys share and what it has used.
#[derive(Debug)]
struct Tenant {
    name: String,
    state: Mutex<TenantState>,
}

#[derive(Debug)]
struct TenantState {
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
    monthly_limit: Option<u64>,
    weight: f64,
    month: Month,
    month_tokens: u64,
}

impl TenantState {
    /// Starts the month again at zero when it has turned.
    fn roll(&mut self, wall: SystemTime) {
        let now = Month::of(wall);
        if now != self.month {
            self.month = now;
            self.month_tokens = 0;
        }
    }

    /// Takes in `key`'s limits (all of a tenant's keys state the same ones).
    fn limit(&mut self, key: &ApiKeyConfig, now: Instant) {
        fn set(bucket: &mut Option<Bucket>, limit: Option<f64>, now: Instant) {
            *bucket = match (bucket.take(), limit) {
                (_, None) => None,
                (None, Some(limit)) => Some(Bucket::full(limit, now)),
                (Some(mut bucket), Some(limit)) => {
                    bucket.set_limit(limit, now);
                    Some(bucket)
                }
            };
        }
        set(&mut self.requests, key.requests_per_minute.map(f64::from), now);
        set(&mut self.tokens, key.tokens_per_minute.map(|t| t as f64), now);
        self.monthly_limit = key.monthly_tokens;
        self.weight = key.weight.unwrap_or(1.0);
    }
}

/// The keys in force, by the SHA-256 of their text.
type KeyTable = HashMap<[u8; 32], Arc<Grant>>;

/// API keys, tenants and their usage.
#[derive(Debug)]
pub(crate) struct Tenants {
    /// Whether requests need a key.
    required: bool,
    /// The keys written in the gateway's config (they stay across keys-file reloads).
    config_keys: Vec<ApiKeyConfig>,
    keys_file: Option<PathBuf>,
    usage_file: Option<PathBuf>,
    table: ArcSwap<KeyTable>,
    /// Every tenant seen, by name; kept across reloads so their buckets and usage stay.
    registry: Mutex<HashMap<String, Arc<Tenant>>>,
    /// Usage read from the usage file for tenants that have no key now.
    carried: Mutex<(Month, BTreeMap<String, u64>)>,
    /// Whether monthly usage changed since the usage file was written.
    unsaved: Arc<AtomicBool>,
    metrics: TenantMetrics,
}

impl Tenants {
    /// The keys of `config` (and its keys file), with the usage kept in its usage file.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] naming the file when the keys file or the usage file cannot be used.
    pub(crate) fn new(config: &Config) -> Result<Tenants, ConfigError> {
        let settings = &config.tenants;
        let wall = SystemTime::now();
        let mut carried = BTreeMap::new();
        if let Some(path) = &settings.usage_file {
            let saved = UsageFile::load(path).map_err(|message| ConfigError::Parse {
                file: path.clone(),
                message,
            })?;
            if let Some(saved) = saved.filter(|saved| saved.month == Month::of(wall).to_string()) {
                carried = saved.tokens;
            }
        }
        let tenants = Tenants {
            required: !config.api_keys.is_empty() || settings.keys_file.is_some(),
            config_keys: config.api_keys.clone(),
            keys_file: settings.keys_file.clone(),
            usage_file: settings.usage_file.clone(),
            table: ArcSwap::from_pointee(KeyTable::new()),
            registry: Mutex::new(HashMap::new()),
            carried: Mutex::new((Month::of(wall), carried)),
            unsaved: Arc::new(AtomicBool::new(false)),
            metrics: TenantMetrics::default(),
        };
        tenants
            .reload_keys()
            .map_err(|(file, message)| ConfigError::Parse { file, message })?;
        Ok(tenants)
    }

    /// Registers the tenants' metric families: those labelled by tenant among `all`'s tenant
    /// families (the admin listener's only), the key checks and reloads among the public ones.
    pub(crate) fn register_metrics(&self, all: &mut crate::metrics::Metrics) {
        let metrics = &self.metrics;
        // Families that name tenants: the admin listener's only.
        let registry = all.tenant_registry_mut();
        registry.register(
            "tenant_tokens",
            "Tokens used per tenant and model, as the workers reported them, by kind (prompt, completion)",
            metrics.tokens.clone(),
        );
        registry.register(
            "tenant_requests",
            "Requests admitted per tenant and model",
            metrics.requests.clone(),
        );
        registry.register(
            "tenant_refused",
            "Requests refused per tenant, by reason (requests_per_minute, tokens_per_minute, monthly_tokens, model)",
            metrics.refused.clone(),
        );
        registry.register(
            "tenant_month_tokens",
            "Tokens each tenant used this calendar month (UTC), against its monthly_tokens",
            metrics.month_tokens.clone(),
        );
        let registry = all.registry_mut();
        registry.register(
            "unauthorized",
            "Requests refused for want of a known API key, by reason (missing, unknown)",
            metrics.unauthorized.clone(),
        );
        registry.register(
            "api_key_reloads",
            "Reloads of tenants.keys_file after it changed or SIGHUP, by outcome (loaded, refused)",
            metrics.key_reloads.clone(),
        );
    }

    /// Whether requests need a key.
    pub(crate) fn required(&self) -> bool {
        self.required
    }

    /// Reads the keys file again (if there is one) and puts the keys in force; on failure the
    /// keys before stay. Answers how many keys are in force.
    fn reload_keys(&self) -> Result<usize, (PathBuf, String)> {
        let file_keys = match &self.keys_file {
            Some(path) => {
                let keys = KeysFile::load(path).map_err(|err| (path.clone(), err.to_string()))?;
                validate_key_lists(&self.config_keys, &keys.api_keys, path).map_err(|err| (path.clone(), err))?;
                keys.api_keys
            }
            None => Vec::new(),
        };
        let now = Instant::now();
        let wall = SystemTime::now();
        let mut registry = self.registry.lock();
        let mut table = KeyTable::new();
        for key in self.config_keys.iter().chain(&file_keys) {
            let Some(hash) = key.hash() else { continue };
            let tenant = registry
                .entry(key.tenant.clone())
                .or_insert_with(|| self.new_tenant(&key.tenant, wall))
                .clone();
            tenant.state.lock().limit(key, now);
            table.insert(
                hash,
                Arc::new(Grant {
                    tenant,
                    models: key.models.clone(),
                    priority: key.priority,
                }),
            );
        }
        let count = table.len();
        self.table.store(Arc::new(table));
        Ok(count)
    }

    fn new_tenant(&self, name: &str, wall: SystemTime) -> Arc<Tenant> {
        let month = Month::of(wall);
        let carried = {
            let carried = self.carried.lock();
            if carried.0 == month {
                carried.1.get(name).copied().unwrap_or(0)
            } else {
                0
            }
        };
        Arc::new(Tenant {
            name: name.to_string(),
            state: Mutex::new(TenantState {
                requests: None,
                tokens: None,
                monthly_limit: None,
                weight: 1.0,
                month,
                month_tokens: carried,
            }),
        })
    }

    /// Reloads the keys file whenever it changes (or on SIGHUP), and writes the usage file
    /// while usage changes, until the returned tasks are aborted.
    ///
    /// # Errors
    ///
    /// [`crate::reload::WatchError`] if the keys file's folder cannot be watched.
    pub(crate) fn spawn_tasks(self: &Arc<Tenants>) -> Result<Vec<JoinHandle<()>>, crate::reload::WatchError> {
        let mut tasks = Vec::new();
        if let Some(path) = self.keys_file.clone() {
            let tenants = self.clone();
            tasks.push(crate::reload::on_change(&[path], move || {
                let outcome = match tenants.reload_keys() {
                    Ok(keys) => {
                        tracing::info!(keys, "API keys reloaded");
                        "loaded"
                    }
                    Err((file, err)) => {
                        tracing::error!(file = %file.display(), error = %err, "new API keys refused; the keys before stay in force");
                        "refused"
                    }
                };
                tenants
                    .metrics
                    .key_reloads
                    .get_or_create(&vec![("outcome", outcome.to_string())])
                    .inc();
            })?);
        }
        if self.usage_file.is_some() {
            let tenants = self.clone();
            tasks.push(tokio::spawn(async move {
                let mut every = tokio::time::interval(SAVE_EVERY);
                loop {
                    every.tick().await;
                    tenants.save_usage();
                }
            }));
        }
        Ok(tasks)
    }

    /// Writes this month's usage to the usage file if it changed.
    pub(crate) fn save_usage(&self) {
        let Some(path) = &self.usage_file else { return };
        if !self.unsaved.swap(false, Ordering::AcqRel) {
            return;
        }
        let month = Month::of(SystemTime::now());
        let mut tokens = {
            let carried = self.carried.lock();
            if carried.0 == month {
                carried.1.clone()
            } else {
                BTreeMap::new()
            }
        };
        for (name, tenant) in self.registry.lock().iter() {
            let mut state = tenant.state.lock();
            state.roll(SystemTime::now());
            tokens.insert(name.clone(), state.month_tokens);
        }
        let usage = UsageFile {
            month: month.to_string(),
            tokens,
        };
        if let Err(err) = usage.save(path) {
            self.unsaved.store(true, Ordering::Release);
            tracing::warn!(file = %path.display(), error = %err, "cannot write the tenants' monthly usage");
        }
    }

    /// The key a request carries, if it is known; `None` when the gateway needs no keys.
    ///
    /// # Errors
    ///
    /// A 401 when the request has no key or an unknown one.
    pub(crate) fn authenticate(&self, headers: &HeaderMap) -> Result<Option<Arc<Grant>>, ApiError> {
        if !self.required {
            return Ok(None);
        }
        let unauthorized = |reason: &str, message: String| {
            self.metrics
                .unauthorized
                .get_or_create(&vec![("reason", reason.to_string())])
                .inc();
            ApiError::new(
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                "invalid_api_key",
                message,
            )
        };
        let key = headers
            .get(header::AUTHORIZATION)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| {
                let (scheme, key) = value.trim().split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then(|| key.trim())
            })
            .filter(|key| !key.is_empty());
        let Some(key) = key else {
            return Err(unauthorized(
                "missing",
                "this gateway needs an API key: send it as `Authorization: Bearer KEY`".into(),
            ));
        };
        let hash: [u8; 32] = Sha256::digest(key.as_bytes()).into();
        match self.table.load().get(&hash) {
            Some(grant) => Ok(Some(grant.clone())),
            None => Err(unauthorized(
                "unknown",
                format!("the API key {} is not known here", redact(key)),
            )),
        }
    }

    /// Admits one request of `grant` for `model` if the tenant is within its limits.
    ///
    /// # Errors
    ///
    /// A 403 when the key may not use `model`; a 429 with `Retry-After` when a rate limit or
    /// the monthly quota is reached.
    pub(crate) fn admit(&self, grant: &Arc<Grant>, model: &str) -> Result<Charge, ApiError> {
        self.admit_at(grant, model, Instant::now(), SystemTime::now())
    }

    fn admit_at(&self, grant: &Arc<Grant>, model: &str, now: Instant, wall: SystemTime) -> Result<Charge, ApiError> {
        let tenant = &grant.tenant;
        let refuse = |reason: &str, err: ApiError| {
            self.metrics
                .refused
                .get_or_create(&vec![("tenant", tenant.name.clone()), ("reason", reason.to_string())])
                .inc();
            err
        };
        if !grant.allows(model) {
            return Err(refuse(
                "model",
                ApiError::new(
                    StatusCode::FORBIDDEN,
                    "invalid_request_error",
                    "model_not_allowed",
                    format!("this API key may not use model `{model}`"),
                )
                .with_param(Some("model".into())),
            ));
        }
        let mut state = tenant.state.lock();
        state.roll(wall);
        if let Some(limit) = state.monthly_limit
            && state.month_tokens >= limit
        {
            let wait = state.month.remaining(wall);
            return Err(refuse(
                "monthly_tokens",
                ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "insufficient_quota",
                    "insufficient_quota",
                    format!(
                        "tenant `{}` has used its {limit} tokens for {}; the quota starts again at the next month (UTC)",
                        tenant.name, state.month
                    ),
                )
                .with_retry_after(wait),
            ));
        }
        let waits = [
            (
                "requests_per_minute",
                "requests",
                state.requests.as_mut().map(|b| b.wait_for(1.0, now)),
            ),
            (
                "tokens_per_minute",
                "tokens",
                state.tokens.as_mut().map(|b| b.wait_for(1.0, now)),
            ),
        ];
        for (reason, what, wait) in waits {
            if let Some(wait) = wait.filter(|wait| !wait.is_zero()) {
                return Err(refuse(
                    reason,
                    ApiError::new(
                        StatusCode::TOO_MANY_REQUESTS,
                        what,
                        "rate_limit_exceeded",
                        format!(
                            "tenant `{}` is over its {reason}; try again in {:.1} s",
                            tenant.name,
                            wait.as_secs_f64()
                        ),
                    )
                    .with_retry_after(wait),
                ));
            }
        }
        if let Some(requests) = &mut state.requests {
            requests.take(1.0, now);
        }
        drop(state);
        self.metrics
            .requests
            .get_or_create(&vec![("tenant", tenant.name.clone()), ("model", model.to_string())])
            .inc();
        Ok(Charge {
            tenant: tenant.clone(),
            model: model.to_string(),
            metrics: self.metrics.clone(),
            unsaved: self.unsaved.clone(),
            prompt_estimate: 0,
            served: false,
            usage: None,
            relayed: 0,
        })
    }
}

/// A key as it may be shown back: its first characters, when it is long enough to keep most
/// of it hidden.
fn redact(key: &str) -> String {
    match key.char_indices().nth(6) {
        Some((end, _)) if key.len() >= 20 => format!("`{}…`", &key[..end]),
        _ => "given".into(),
    }
}

/// What one admitted request costs its tenant; settled when dropped.
///
/// The prompt's tokens are taken from the tenant's token bucket once they are counted
/// ([`Charge::prompt`]); when the request ends, what the worker reported replaces that
/// estimate in the bucket and is added to the month and the tenant's metrics. A request no
/// worker answered gives its estimate back; one whose usage never came (the client left a
/// stream before its last chunk) counts its estimate and every chunk relayed to it
/// ([`Charge::relayed`]), one completion token each, so leaving a stream early spares
/// neither the rate limit nor the monthly quota.
#[derive(Debug)]
pub(crate) struct Charge {
    tenant: Arc<Tenant>,
    model: String,
    metrics: TenantMetrics,
    unsaved: Arc<AtomicBool>,
    prompt_estimate: u64,
    served: bool,
    usage: Option<Usage>,
    /// Chunks of a streamed answer relayed so far: its completion tokens if no usage comes.
    relayed: u64,
}

impl Charge {
    /// The tenant charged.
    pub(crate) fn tenant(&self) -> &str {
        &self.tenant.name
    }

    /// Takes the prompt's `tokens`, as the gateway counted them.
    pub(crate) fn prompt(&mut self, tokens: usize) {
        let tokens = tokens as u64;
        let mut state = self.tenant.state.lock();
        if let Some(bucket) = &mut state.tokens {
            bucket.take(tokens as f64 - self.prompt_estimate as f64, Instant::now());
        }
        self.prompt_estimate = tokens;
    }

    /// Notes that a worker answered the request.
    pub(crate) fn served(&mut self) {
        self.served = true;
    }

    /// Notes that `chunks` chunks of a streamed answer have been relayed in all.
    pub(crate) fn relayed(&mut self, chunks: u64) {
        self.relayed = chunks;
    }

    /// Notes the usage the worker reported.
    pub(crate) fn report(&mut self, usage: Usage) {
        self.usage = Some(usage);
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        let used = match (self.served, self.usage) {
            (_, Some(usage)) => u64::from(usage.prompt_tokens) + u64::from(usage.completion_tokens),
            (true, None) => self.prompt_estimate.saturating_add(self.relayed),
            (false, None) => 0,
        };
        let now = Instant::now();
        let month_tokens = {
            let mut state = self.tenant.state.lock();
            if let Some(bucket) = &mut state.tokens {
                bucket.take(used as f64 - self.prompt_estimate as f64, now);
            }
            state.roll(SystemTime::now());
            state.month_tokens = state.month_tokens.saturating_add(used);
            state.month_tokens
        };
        if used > 0 {
            self.unsaved.store(true, Ordering::Release);
        }
        self.metrics
            .month_tokens
            .get_or_create(&vec![("tenant", self.tenant.name.clone())])
            .set(i64::try_from(month_tokens).unwrap_or(i64::MAX));
        let counted = match (self.served, self.usage) {
            (_, Some(usage)) => Some((u64::from(usage.prompt_tokens), u64::from(usage.completion_tokens))),
            (true, None) => Some((self.prompt_estimate, self.relayed)),
            (false, None) => None,
        };
        if let Some((prompt, completion)) = counted {
            for (kind, tokens) in [("prompt", prompt), ("completion", completion)] {
                self.metrics
                    .tokens
                    .get_or_create(&vec![
                        ("tenant", self.tenant.name.clone()),
                        ("model", self.model.clone()),
                        ("kind", kind.to_string()),
                    ])
                    .inc_by(tokens);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sha(key: &str) -> String {
        Sha256::digest(key.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    fn key(text: &str, tenant: &str) -> ApiKeyConfig {
        ApiKeyConfig {
            key_sha256: sha(text),
            tenant: tenant.into(),
            models: Vec::new(),
            priority: 0,
            requests_per_minute: None,
            tokens_per_minute: None,
            monthly_tokens: None,
            weight: None,
        }
    }

    fn tenants(keys: Vec<ApiKeyConfig>) -> Tenants {
        Tenants::new(&Config {
            api_keys: keys,
            ..Config::default()
        })
        .expect("valid keys")
    }

    fn bearer(key: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::AUTHORIZATION, format!("Bearer {key}").parse().expect("header"));
        headers
    }

    #[test]
    fn no_keys_leaves_the_gateway_open_and_keys_close_it() {
        assert!(
            tenants(Vec::new())
                .authenticate(&HeaderMap::new())
                .expect("open")
                .is_none()
        );
        let closed = tenants(vec![key("sk-right", "acme")]);
        assert_eq!(closed.authenticate(&HeaderMap::new()).unwrap_err().status, 401);
        assert_eq!(closed.authenticate(&bearer("sk-wrong")).unwrap_err().status, 401);
        let grant = closed
            .authenticate(&bearer("sk-right"))
            .expect("known")
            .expect("a grant");
        assert_eq!(grant.tenant(), "acme");
    }

    #[test]
    fn the_request_limit_refuses_with_the_wait_until_the_next_one() {
        let limited = tenants(vec![ApiKeyConfig {
            requests_per_minute: Some(60),
            ..key("k", "acme")
        }]);
        let grant = limited.authenticate(&bearer("k")).expect("known").expect("a grant");
        let (now, wall) = (Instant::now(), SystemTime::now());
        for _ in 0..60 {
            limited.admit_at(&grant, "m", now, wall).expect("within the limit");
        }
        let refused = limited.admit_at(&grant, "m", now, wall).unwrap_err();
        assert_eq!((refused.status.as_u16(), refused.retry_after_s), (429, Some(1)));
        assert!(
            limited
                .admit_at(&grant, "m", now + Duration::from_secs(1), wall)
                .is_ok()
        );
    }

    #[test]
    fn a_stream_left_before_its_usage_is_charged_the_chunks_relayed() {
        let limited = tenants(vec![ApiKeyConfig {
            tokens_per_minute: Some(600),
            monthly_tokens: Some(10_000),
            ..key("k", "acme")
        }]);
        let grant = limited.authenticate(&bearer("k")).expect("known").expect("a grant");
        let mut charge = limited.admit(&grant, "m").expect("admitted");
        charge.prompt(100);
        charge.served();
        charge.relayed(10);
        charge.relayed(600);
        // The client left: no usage came.
        drop(charge);
        assert_eq!(grant.tenant.state.lock().month_tokens, 700);
        // The rate limit holds as if the usage had come: 100 tokens of debt at 10 a second.
        let refused = limited.admit(&grant, "m").unwrap_err();
        assert_eq!(refused.code(), "rate_limit_exceeded");
        assert!((10..=11).contains(&refused.retry_after_s.unwrap_or(0)), "{refused:?}");
        let counted = limited.metrics.tokens.get_or_create(&vec![
            ("tenant", "acme".to_string()),
            ("model", "m".to_string()),
            ("kind", "completion".to_string()),
        ]);
        assert_eq!(counted.get(), 600);
    }

    #[test]
    fn tokens_are_settled_from_the_reported_usage() {
        let limited = tenants(vec![ApiKeyConfig {
            tokens_per_minute: Some(600),
            monthly_tokens: Some(1000),
            ..key("k", "acme")
        }]);
        let grant = limited.authenticate(&bearer("k")).expect("known").expect("a grant");
        let mut charge = limited.admit(&grant, "m").expect("admitted");
        charge.prompt(100);
        charge.served();
        charge.report(Usage {
            prompt_tokens: 120,
            completion_tokens: 580,
            total_tokens: 700,
            prompt_tokens_details: None,
        });
        drop(charge);
        let refused = limited.admit(&grant, "m").unwrap_err();
        assert_eq!(refused.status, 429);
        assert_eq!(refused.code(), "rate_limit_exceeded");
        // 100 tokens of debt at 10 a second: about 10 s.
        assert!((10..=11).contains(&refused.retry_after_s.unwrap_or(0)), "{refused:?}");
        assert_eq!(grant.tenant.state.lock().month_tokens, 700);

        // An unanswered request gives its estimate back.
        let later = Instant::now() + Duration::from_secs(120);
        let mut charge = limited
            .admit_at(&grant, "m", later, SystemTime::now())
            .expect("refilled");
        charge.prompt(300);
        drop(charge);
        assert_eq!(grant.tenant.state.lock().month_tokens, 700);

        grant.tenant.state.lock().month_tokens = 1000;
        let over = limited.admit_at(&grant, "m", later, SystemTime::now()).unwrap_err();
        assert_eq!(over.code(), "insufficient_quota");
        assert!(over.retry_after_s.unwrap_or(0) > 0);
    }

    #[test]
    fn a_key_limited_to_models_is_refused_others() {
        let limited = tenants(vec![ApiKeyConfig {
            models: vec!["small".into()],
            ..key("k", "acme")
        }]);
        let grant = limited.authenticate(&bearer("k")).expect("known").expect("a grant");
        assert!(limited.admit(&grant, "small").is_ok());
        assert_eq!(limited.admit(&grant, "large").unwrap_err().status, 403);
        let served = ["large".to_string(), "small".to_string()];
        assert_eq!(grant.visible(&served), vec!["small"]);
    }

    #[test]
    fn a_reload_keeps_the_tenants_buckets_and_refuses_a_bad_file() {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("keys.toml");
        let entry = |text: &str| {
            format!(
                "[[api_keys]]\nkey_sha256 = \"{}\"\ntenant = \"acme\"\nrequests_per_minute = 2\n",
                sha(text)
            )
        };
        std::fs::write(&file, entry("old")).expect("write");
        let tenants = Tenants::new(&Config {
            tenants: crate::config::TenantsConfig {
                keys_file: Some(file.clone()),
                usage_file: None,
            },
            ..Config::default()
        })
        .expect("loads");
        let old = tenants.authenticate(&bearer("old")).expect("known").expect("a grant");
        tenants.admit(&old, "m").expect("first");
        tenants.admit(&old, "m").expect("second");
        std::fs::write(&file, entry("new")).expect("write");
        assert_eq!(tenants.reload_keys().expect("reloads"), 1);
        assert!(tenants.authenticate(&bearer("old")).is_err(), "the old key is gone");
        let new = tenants.authenticate(&bearer("new")).expect("known").expect("a grant");
        assert_eq!(
            tenants.admit(&new, "m").unwrap_err().status,
            429,
            "the same tenant's bucket"
        );
        std::fs::write(&file, "[[api_keys]]\nkey_sha256 = \"short\"\ntenant = \"acme\"\n").expect("write");
        let (path, err) = tenants.reload_keys().unwrap_err();
        assert_eq!(path, file);
        assert!(err.contains("api_keys[0].key_sha256"), "{err}");
        assert!(tenants.authenticate(&bearer("new")).is_ok(), "the keys before stay");
    }

    #[test]
    fn monthly_usage_survives_a_restart_through_the_usage_file() {
        let dir = tempfile::tempdir().expect("temp dir");
        let config = Config {
            api_keys: vec![ApiKeyConfig {
                monthly_tokens: Some(50),
                ..key("k", "acme")
            }],
            tenants: crate::config::TenantsConfig {
                keys_file: None,
                usage_file: Some(dir.path().join("usage.json")),
            },
            ..Config::default()
        };
        let first = Tenants::new(&config).expect("starts");
        let grant = first.authenticate(&bearer("k")).expect("known").expect("a grant");
        let mut charge = first.admit(&grant, "m").expect("admitted");
        charge.served();
        charge.report(Usage {
            prompt_tokens: 30,
            completion_tokens: 20,
            total_tokens: 50,
            prompt_tokens_details: None,
        });
        drop(charge);
        first.save_usage();
        let second = Tenants::new(&config).expect("restarts");
        let grant = second.authenticate(&bearer("k")).expect("known").expect("a grant");
        assert_eq!(second.admit(&grant, "m").unwrap_err().code(), "insufficient_quota");
    }
}
