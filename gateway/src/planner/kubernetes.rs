//! The `kubernetes` connector: a pool is a Deployment or StatefulSet, and its size is the
//! `replicas` of its scale subresource, read and patched through the API server with the pod's
//! service account.
//!
//! Calls: `GET /apis/apps/v1/namespaces/NS/KIND/NAME/scale` once at start (the planner adopts
//! the size it finds, so a gateway restart never shrinks a running pool), then
//! `PATCH` of the same path with `{"spec":{"replicas":N}}` (`application/merge-patch+json`)
//! whenever the desired size changes. Each call reads the token, the CA and the namespace from
//! the service account's folder (they rotate), trusts only that CA, and runs on its own task:
//! the planning loop never waits on the API server. A failed call is logged and tried again at
//! the next metric tick. The pods register with the gateway themselves (NATS or the admin API)
//! and drain on SIGTERM as Kubernetes stops them.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};

use crate::config::PoolConfig;
use crate::planner::connector::{Connector, UnderWay};

/// How long one call to the API server may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Largest answer read from the API server.
const MAX_ANSWER_BYTES: usize = 1 << 20;

/// Where and how to reach the API server.
#[derive(Debug, Clone)]
pub struct KubernetesApi {
    /// `https://HOST:PORT`.
    pub base: String,
    /// The service account's folder: `token`, `ca.crt`, `namespace`.
    pub credentials: PathBuf,
}

impl KubernetesApi {
    fn read(&self, file: &str) -> Result<String, String> {
        let path = self.credentials.join(file);
        std::fs::read_to_string(&path).map_err(|err| format!("cannot read {}: {err}", path.display()))
    }

    fn path(&self, namespace: &str, target: &str) -> String {
        // `target` was checked as KIND/NAME with KIND deployments or statefulsets.
        format!("/apis/apps/v1/namespaces/{namespace}/{target}/scale")
    }

    /// The namespace of `pool`: its own setting, else the service account's.
    fn namespace(&self, pool: &PoolConfig) -> Result<String, String> {
        match &pool.kubernetes_namespace {
            Some(namespace) => Ok(namespace.clone()),
            None => Ok(self.read("namespace")?.trim().to_string()),
        }
    }

    /// One call; answers the scale's `spec.replicas`.
    async fn call(&self, method: http::Method, path: &str, body: Option<String>) -> Result<u32, String> {
        let token = self.read("token")?;
        let ca = self.credentials.join("ca.crt");
        let mut roots = rustls::RootCertStore::empty();
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&ca)
            .map_err(|err| format!("{}: {err}", ca.display()))?
            .collect::<Result<_, _>>()
            .map_err(|err| format!("{}: {err}", ca.display()))?;
        for cert in certs {
            roots.add(cert).map_err(|err| format!("{}: {err}", ca.display()))?;
        }
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|err| err.to_string())?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let uri: http::Uri = self
            .base
            .parse()
            .map_err(|err| format!("kubernetes_api `{}`: {err}", self.base))?;
        let host = uri
            .host()
            .ok_or_else(|| format!("kubernetes_api `{}` has no host", self.base))?;
        let port = uri.port_u16().unwrap_or(443);
        let name = ServerName::try_from(host.trim_matches(['[', ']']).to_string())
            .map_err(|err| format!("kubernetes_api host `{host}`: {err}"))?;
        let answer = tokio::time::timeout(CALL_TIMEOUT, async {
            let tcp = tokio::net::TcpStream::connect((host.trim_matches(['[', ']']), port))
                .await
                .map_err(|err| format!("{}: {err}", self.base))?;
            let stream = tokio_rustls::TlsConnector::from(Arc::new(tls))
                .connect(name, tcp)
                .await
                .map_err(|err| format!("{}: TLS: {err}", self.base))?;
            let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                .await
                .map_err(|err| format!("{}: {err}", self.base))?;
            tokio::spawn(async move {
                let _ = connection.await;
            });
            let mut request = http::Request::builder()
                .method(method)
                .uri(path)
                .header(http::header::HOST, format!("{host}:{port}"))
                .header(http::header::AUTHORIZATION, format!("Bearer {}", token.trim()))
                .header(http::header::ACCEPT, "application/json");
            if body.is_some() {
                request = request.header(http::header::CONTENT_TYPE, "application/merge-patch+json");
            }
            let request = request
                .body(Full::new(Bytes::from(body.unwrap_or_default())))
                .map_err(|err| err.to_string())?;
            let response = sender
                .send_request(request)
                .await
                .map_err(|err| format!("{path}: {err}"))?;
            let status = response.status();
            let bytes = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
                .collect()
                .await
                .map_err(|err| format!("{path}: {err}"))?
                .to_bytes();
            Ok::<_, String>((status, bytes))
        })
        .await
        .map_err(|_| format!("{path}: no answer within {CALL_TIMEOUT:?}"))??;
        let (status, bytes) = answer;
        let json: serde_json::Value =
            serde_json::from_slice(&bytes).map_err(|err| format!("{path}: answered {status} with no JSON ({err})"))?;
        if !status.is_success() {
            // The API server's Status object says why (RBAC, a missing Deployment...).
            let message = json["message"].as_str().unwrap_or("no message");
            return Err(format!("{path}: answered {status}: {message}"));
        }
        json["spec"]["replicas"]
            .as_u64()
            .and_then(|replicas| u32::try_from(replicas).ok())
            .ok_or_else(|| format!("{path}: the answer has no spec.replicas"))
    }

    /// The scale's `spec.replicas` now.
    ///
    /// # Errors
    ///
    /// What went wrong, for the log.
    pub async fn replicas(&self, pool: &PoolConfig) -> Result<u32, String> {
        let target = pool.kubernetes_target.as_deref().unwrap_or_default();
        let path = self.path(&self.namespace(pool)?, target);
        self.call(http::Method::GET, &path, None).await
    }

    /// Sets the scale's `spec.replicas` to `replicas`; answers what the API server stored.
    ///
    /// # Errors
    ///
    /// What went wrong, for the log.
    pub async fn scale(&self, pool: &PoolConfig, replicas: u32) -> Result<u32, String> {
        let target = pool.kubernetes_target.as_deref().unwrap_or_default();
        let path = self.path(&self.namespace(pool)?, target);
        let body = serde_json::json!({"spec": {"replicas": replicas}}).to_string();
        self.call(http::Method::PATCH, &path, Some(body)).await
    }
}

/// One pool's state with the API server.
#[derive(Debug, Default, Clone, Copy)]
struct Synced {
    /// `spec.replicas` as last read or written.
    observed: Option<u32>,
    /// A call is under way.
    busy: bool,
}

/// Pools as Deployments or StatefulSets.
#[derive(Debug)]
pub struct KubernetesConnector {
    api: Arc<KubernetesApi>,
    pools: Arc<Mutex<Vec<Synced>>>,
}

impl KubernetesConnector {
    /// A connector calling `api`.
    pub fn new(api: KubernetesApi) -> KubernetesConnector {
        KubernetesConnector {
            api: Arc::new(api),
            pools: Arc::new(Mutex::new(Vec::new())),
        }
    }
}

impl Connector for KubernetesConnector {
    fn reconcile(
        &self,
        index: usize,
        pool: &PoolConfig,
        desired: u32,
        _registered: &std::collections::HashSet<String>,
    ) -> Result<(), String> {
        let mut pools = self.pools.lock();
        if pools.len() <= index {
            pools.resize(index + 1, Synced::default());
        }
        let synced = pools[index];
        if synced.busy || synced.observed == Some(desired) {
            return Ok(());
        }
        pools[index].busy = true;
        let (api, state, pool) = (self.api.clone(), self.pools.clone(), pool.clone());
        tokio::spawn(async move {
            // First read the size (the planner adopts it); afterwards, write the desired one.
            let answer = match synced.observed {
                None => api.replicas(&pool).await,
                Some(_) => api.scale(&pool, desired).await,
            };
            let mut pools = state.lock();
            pools[index].busy = false;
            match answer {
                Ok(replicas) => {
                    if synced.observed.is_some() {
                        tracing::info!(model = %pool.model, replicas, "planner scaled the Kubernetes pool");
                    }
                    pools[index].observed = Some(replicas);
                }
                Err(err) => {
                    tracing::warn!(model = %pool.model, error = %err, "Kubernetes API call failed; trying again")
                }
            }
        });
        Ok(())
    }

    fn under_way(&self, index: usize, registered: &std::collections::HashSet<String>) -> UnderWay {
        let observed = self.pools.lock().get(index).and_then(|synced| synced.observed);
        let Some(replicas) = observed else {
            return UnderWay::default();
        };
        let ready = registered.len() as u32;
        UnderWay {
            starting: replicas.saturating_sub(ready),
            draining: ready.saturating_sub(replicas),
        }
    }

    fn manages(&self, _: usize, _: &PoolConfig, _: &str) -> bool {
        true
    }

    fn current_size(&self, index: usize) -> Option<u32> {
        self.pools.lock().get(index).and_then(|synced| synced.observed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::collections::HashSet;

    use http_body_util::BodyExt;
    use hyper::body::Incoming;
    use hyper::service::service_fn;

    /// A `GET .../deployments/llm-workers/scale` answer as an API server (v1.31) gives it.
    const SCALE: &str = r#"{"kind":"Scale","apiVersion":"autoscaling/v1","metadata":{"name":"llm-workers","namespace":"inference","uid":"5b1c3f0e-8f7a-4c1e-9d55-2f0a6c1b7e21","resourceVersion":"184467","creationTimestamp":"2026-11-20T09:12:44Z"},"spec":{"replicas":REPLICAS},"status":{"replicas":2,"selector":"app=llm-workers"}}"#;

    /// The API server's answer when the service account may not patch the scale.
    const FORBIDDEN: &str = r#"{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"deployments.apps \"llm-workers\" is forbidden: User \"system:serviceaccount:inference:switchyard-gateway\" cannot patch resource \"deployments/scale\" in API group \"apps\" in the namespace \"inference\"","reason":"Forbidden","details":{"name":"llm-workers","group":"apps","kind":"deployments"},"code":403}"#;

    /// One request as the fake API server saw it.
    #[derive(Debug, Clone)]
    struct Seen {
        method: String,
        path: String,
        authorization: String,
        content_type: String,
        body: String,
    }

    /// A TLS API server on 127.0.0.1 answering from `SCALE` (or 403 while `forbid` is set), and
    /// a service-account folder that trusts it.
    struct FakeApi {
        base: String,
        credentials: tempfile::TempDir,
        seen: Arc<Mutex<Vec<Seen>>>,
        forbid: Arc<std::sync::atomic::AtomicBool>,
    }

    async fn fake_api() -> FakeApi {
        let ca_key = rcgen::KeyPair::generate().expect("key");
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca_cert = ca_params.self_signed(&ca_key).expect("CA");
        let issuer = rcgen::Issuer::new(ca_params, ca_key);
        let server_key = rcgen::KeyPair::generate().expect("key");
        let server_cert = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])
            .expect("params")
            .signed_by(&server_key, &issuer)
            .expect("server certificate");
        let credentials = tempfile::tempdir().expect("folder");
        std::fs::write(credentials.path().join("ca.crt"), ca_cert.pem()).expect("ca");
        std::fs::write(credentials.path().join("token"), "service-account-token\n").expect("token");
        std::fs::write(credentials.path().join("namespace"), "inference").expect("namespace");
        let key = rustls::pki_types::PrivateKeyDer::try_from(server_key.serialize_der()).expect("key der");
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_no_client_auth()
            .with_single_cert(vec![server_cert.der().clone()], key)
            .expect("server config");
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let base = format!("https://127.0.0.1:{}", listener.local_addr().expect("addr").port());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let forbid = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let replicas = Arc::new(std::sync::atomic::AtomicU32::new(2));
        {
            let (seen, forbid) = (seen.clone(), forbid.clone());
            tokio::spawn(async move {
                loop {
                    let Ok((tcp, _)) = listener.accept().await else { return };
                    let Ok(tls) = acceptor.accept(tcp).await else { continue };
                    let (seen, forbid, replicas) = (seen.clone(), forbid.clone(), replicas.clone());
                    let service = service_fn(move |request: http::Request<Incoming>| {
                        let (seen, forbid, replicas) = (seen.clone(), forbid.clone(), replicas.clone());
                        async move {
                            let header = |name: http::header::HeaderName| {
                                request
                                    .headers()
                                    .get(name)
                                    .and_then(|v| v.to_str().ok())
                                    .unwrap_or_default()
                                    .to_string()
                            };
                            let mut entry = Seen {
                                method: request.method().to_string(),
                                path: request.uri().path().to_string(),
                                authorization: header(http::header::AUTHORIZATION),
                                content_type: header(http::header::CONTENT_TYPE),
                                body: String::new(),
                            };
                            let body = request
                                .into_body()
                                .collect()
                                .await
                                .map(|b| b.to_bytes())
                                .unwrap_or_default();
                            entry.body = String::from_utf8_lossy(&body).to_string();
                            seen.lock().push(entry.clone());
                            let (status, answer) = if forbid.load(std::sync::atomic::Ordering::Relaxed) {
                                (403, FORBIDDEN.to_string())
                            } else {
                                if entry.method == "PATCH"
                                    && let Ok(patch) = serde_json::from_str::<serde_json::Value>(&entry.body)
                                    && let Some(n) = patch["spec"]["replicas"].as_u64()
                                {
                                    replicas.store(n as u32, std::sync::atomic::Ordering::Relaxed);
                                }
                                let n = replicas.load(std::sync::atomic::Ordering::Relaxed);
                                (200, SCALE.replace("REPLICAS", &n.to_string()))
                            };
                            Ok::<_, std::convert::Infallible>(
                                http::Response::builder()
                                    .status(status)
                                    .header(http::header::CONTENT_TYPE, "application/json")
                                    .body(Full::new(Bytes::from(answer)))
                                    .expect("response"),
                            )
                        }
                    });
                    tokio::spawn(async move {
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(TokioIo::new(tls), service)
                            .await;
                    });
                }
            });
        }
        FakeApi {
            base,
            credentials,
            seen,
            forbid,
        }
    }

    fn pool() -> PoolConfig {
        toml::from_str("model = \"llama\"\nmax_workers = 8\nkubernetes_target = \"deployments/llm-workers\"\n")
            .expect("pool")
    }

    async fn settle(connector: &KubernetesConnector) {
        for _ in 0..200 {
            if !connector.pools.lock().first().is_some_and(|synced| synced.busy) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the API call never finished");
    }

    #[tokio::test]
    async fn the_connector_reads_then_patches_the_scale_subresource() {
        let api = fake_api().await;
        let connector = KubernetesConnector::new(KubernetesApi {
            base: api.base.clone(),
            credentials: api.credentials.path().to_path_buf(),
        });
        let pool = pool();
        let none = HashSet::new();
        // First tick: it reads the size, whatever the planner wants, and never shrinks first.
        connector.reconcile(0, &pool, 1, &none).expect("reconcile");
        settle(&connector).await;
        assert_eq!(
            connector.current_size(0),
            Some(2),
            "the Deployment's 2 replicas, adopted"
        );
        // The planner wants 3: one merge patch of the scale.
        connector.reconcile(0, &pool, 3, &none).expect("reconcile");
        settle(&connector).await;
        assert_eq!(connector.current_size(0), Some(3));
        connector.reconcile(0, &pool, 3, &none).expect("reconcile");
        settle(&connector).await;
        let seen = api.seen.lock().clone();
        assert_eq!(seen.len(), 2, "nothing is called while the size is right: {seen:?}");
        let path = "/apis/apps/v1/namespaces/inference/deployments/llm-workers/scale";
        assert_eq!((seen[0].method.as_str(), seen[0].path.as_str()), ("GET", path));
        assert_eq!((seen[1].method.as_str(), seen[1].path.as_str()), ("PATCH", path));
        assert_eq!(seen[1].authorization, "Bearer service-account-token");
        assert_eq!(seen[1].content_type, "application/merge-patch+json");
        assert_eq!(seen[1].body, r#"{"spec":{"replicas":3}}"#);
        let registered: HashSet<String> = ["w-0".to_string()].into();
        assert_eq!(
            connector.under_way(0, &registered),
            UnderWay {
                starting: 2,
                draining: 0
            }
        );

        // Forbidden (RBAC): the size stays as known, and the next tick tries again.
        api.forbid.store(true, std::sync::atomic::Ordering::Relaxed);
        connector.reconcile(0, &pool, 4, &none).expect("reconcile");
        settle(&connector).await;
        assert_eq!(connector.current_size(0), Some(3));
        api.forbid.store(false, std::sync::atomic::Ordering::Relaxed);
        connector.reconcile(0, &pool, 4, &none).expect("reconcile");
        settle(&connector).await;
        assert_eq!(connector.current_size(0), Some(4));
        assert_eq!(api.seen.lock().len(), 4);
    }

    #[tokio::test]
    async fn an_untrusted_api_server_is_refused() {
        let api = fake_api().await;
        let other = fake_api().await;
        // Credentials whose CA did not sign the server's certificate.
        let connector = KubernetesApi {
            base: api.base.clone(),
            credentials: other.credentials.path().to_path_buf(),
        };
        let err = connector.replicas(&pool()).await.expect_err("refused");
        assert!(err.contains("TLS"), "{err}");
        assert!(api.seen.lock().is_empty());
    }
}
