//! Transport security of the broker: TLS on the gRPC port when a
//! certificate is given (mutual TLS when a client CA is given too), and a
//! bearer token that every RPC must carry when one is configured.
//!
//! The token and the PEM files are read by `dflash_proto::credentials`, the
//! same code every client uses (`--token-file` or `DFLASH_TOKEN`; the
//! token's `Debug` prints its length only). A call without the
//! token or with a wrong one is refused with UNAUTHENTICATED by an
//! interceptor in front of the service, before any handler runs, so it
//! changes nothing. Health and reflection stay open for probes and grpcurl
//! unless `--token-exempt none` says otherwise.

use std::path::PathBuf;
use std::sync::Arc;

use clap::{Args, ValueEnum};
use dflash_proto::credentials::{load_token, read_pem, CredentialError, Token};
use tonic::service::Interceptor;
use tonic::transport::{Certificate, Identity, ServerTlsConfig};
use tracing::warn;

use crate::roles::{principal_of_certificate, Credentials, CredentialsError, Principal};
use crate::rpc_error::RpcError;

/// A configured security value that cannot be used, naming the flag and file.
#[derive(Debug, thiserror::Error)]
pub enum SecurityError {
    #[error(transparent)]
    Credential(#[from] CredentialError),
    #[error(transparent)]
    Credentials(#[from] CredentialsError),
    #[error("{0}")]
    Flags(String),
}

/// The services a caller may use without the token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TokenExempt {
    /// `grpc.health.v1.Health` (Kubernetes gRPC probes, compose health checks).
    Health,
    /// Server reflection v1 and v1alpha (grpcurl `list`/`describe`).
    Reflection,
    /// Nothing: every service needs the token.
    None,
}

/// The broker's TLS and token flags.
#[derive(Debug, Clone, Default, Args)]
pub struct BrokerSecurity {
    /// PEM certificate (chain) the broker presents. With --tls-key the gRPC
    /// port speaks TLS only.
    #[arg(long, env = "DFLASH_BROKER_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,

    /// PEM private key of --tls-cert.
    #[arg(long, env = "DFLASH_BROKER_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,

    /// PEM CA bundle for mutual TLS: every client must present a
    /// certificate signed by it.
    #[arg(long, env = "DFLASH_BROKER_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,

    /// File holding the bearer token every RPC must carry
    /// (`authorization: Bearer <token>`). The DFLASH_TOKEN environment
    /// variable may hold the token instead. No token: no check.
    #[arg(long, env = "DFLASH_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,

    /// File of credentials with roles: one `role identity token` a line
    /// (role target, drafter or operator; identity an id or `*`; the token
    /// or `sha256:<hex>` of it). Each RPC is then authorized by the caller's
    /// role and identity (see `dflash_broker::roles`). May be combined with
    /// --token-file, whose shared token grants every role.
    #[arg(long, env = "DFLASH_CREDENTIALS_FILE")]
    pub credentials: Option<PathBuf>,

    /// Services reachable without the token (comma-separated: health,
    /// reflection, or none).
    #[arg(
        long,
        env = "DFLASH_TOKEN_EXEMPT",
        value_enum,
        value_delimiter = ',',
        default_values = ["health", "reflection"]
    )]
    pub token_exempt: Vec<TokenExempt>,
}

/// The security the server applies, resolved from [`BrokerSecurity`].
#[derive(Debug, Clone, Default)]
pub struct ServerSecurity {
    pub tls: Option<ServerTlsConfig>,
    pub token: Option<Token>,
    /// `--credentials`: tokens with roles (empty without the flag).
    pub credentials: Arc<Credentials>,
    pub health_open: bool,
    pub reflection_open: bool,
}

impl BrokerSecurity {
    /// No TLS, no token (tests and `dflash local`).
    pub fn none() -> Self {
        BrokerSecurity {
            token_exempt: vec![TokenExempt::Health, TokenExempt::Reflection],
            ..BrokerSecurity::default()
        }
    }

    /// Reads the files and the environment.
    pub fn load(&self) -> Result<ServerSecurity, SecurityError> {
        if self.token_exempt.contains(&TokenExempt::None) && self.token_exempt.len() > 1 {
            return Err(SecurityError::Flags(format!(
                "--token-exempt none cannot be combined with other services, got {:?}",
                self.token_exempt
            )));
        }
        let tls = match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => {
                let identity =
                    Identity::from_pem(read_pem("--tls-cert", cert)?, read_pem("--tls-key", key)?);
                let mut tls = ServerTlsConfig::new().identity(identity);
                if let Some(ca) = &self.tls_client_ca {
                    tls =
                        tls.client_ca_root(Certificate::from_pem(read_pem("--tls-client-ca", ca)?));
                }
                Some(tls)
            }
            (None, None) if self.tls_client_ca.is_some() => {
                return Err(SecurityError::Flags(
                    "--tls-client-ca needs --tls-cert and --tls-key".to_string(),
                ))
            }
            (None, None) => None,
            _ => {
                return Err(SecurityError::Flags(
                    "--tls-cert and --tls-key go together".to_string(),
                ))
            }
        };
        let credentials = match &self.credentials {
            Some(path) => Credentials::load(path)?,
            None => Credentials::default(),
        };
        let token = load_token(self.token_file.as_deref())?;
        if token.is_some() && !credentials.is_empty() {
            warn!("--token-file's shared token grants every role beside --credentials: give each pod its own credential");
        } else if token.is_some() {
            warn!("the shared token (--token-file) grants every role to whoever holds it: fine for a trusted single-tenant setup; --credentials gives each role its own");
        }
        Ok(ServerSecurity {
            tls,
            credentials: Arc::new(credentials),
            token,
            health_open: self.token_exempt.contains(&TokenExempt::Health),
            reflection_open: self.token_exempt.contains(&TokenExempt::Reflection),
        })
    }
}

impl ServerSecurity {
    /// The check for a service: the token when one is configured and the
    /// service is not exempt.
    pub fn check(&self, exempt: bool) -> TokenCheck {
        TokenCheck {
            token: if exempt { None } else { self.token.clone() },
            credentials: if exempt {
                Arc::default()
            } else {
                self.credentials.clone()
            },
        }
    }
}

/// The interceptor in front of each service: with a token or credentials
/// configured, a call whose `authorization` metadata is not `Bearer <token>`
/// of one of them is refused with UNAUTHENTICATED before the handler sees
/// it. An accepted call carries its [`Principal`] (the credential's role and
/// identity) in its extensions, for the handler's authorization.
#[derive(Debug, Clone)]
pub struct TokenCheck {
    token: Option<Token>,
    credentials: Arc<Credentials>,
}

impl Interceptor for TokenCheck {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if self.token.is_none() && self.credentials.is_empty() {
            request.extensions_mut().insert(Principal::unrestricted());
            return Ok(request);
        }
        let presented = request
            .metadata()
            .get("authorization")
            .map(|value| value.as_bytes())
            .and_then(|value| value.strip_prefix(b"Bearer "));
        let principal = match presented {
            Some(candidate) => match &self.token {
                Some(token) if token.matches(candidate) => Some(Principal::unrestricted()),
                _ => self.credentials.principal_of(candidate),
            },
            // No token: a client certificate (checked against the client CA
            // by the handshake) may name the role.
            None => request.peer_certs().and_then(|certificates| {
                certificates
                    .first()
                    .and_then(|leaf| principal_of_certificate(leaf.as_ref()))
            }),
        };
        match (presented, principal) {
            (_, Some(principal)) => {
                request.extensions_mut().insert(principal);
                Ok(request)
            }
            (Some(_), None) => {
                warn!(peer = ?request.remote_addr(), "refused a call with a wrong token");
                Err(RpcError::WrongToken.into())
            }
            (None, None) => {
                warn!(peer = ?request.remote_addr(), "refused a call without a bearer token");
                Err(RpcError::MissingToken.into())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interceptor_refuses_missing_and_wrong_tokens() {
        let security = ServerSecurity {
            token: Some(Token::new("right", "test").unwrap()),
            ..ServerSecurity::default()
        };
        let call = |header: Option<&str>, exempt: bool| {
            let mut request = tonic::Request::new(());
            if let Some(header) = header {
                request
                    .metadata_mut()
                    .insert("authorization", header.parse().unwrap());
            }
            security.check(exempt).call(request).map(|_| ())
        };
        assert!(call(Some("Bearer right"), false).is_ok());
        for refused in [
            None,
            Some("Bearer wrong"),
            Some("right"),
            Some("Basic right"),
        ] {
            let status = call(refused, false).unwrap_err();
            assert_eq!(status.code(), tonic::Code::Unauthenticated, "{refused:?}");
            assert!(!status.message().contains("right"), "{}", status.message());
        }
        assert!(call(None, true).is_ok());
    }

    #[test]
    fn flags_parse_with_their_defaults() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            security: BrokerSecurity,
        }
        let cli = Cli::try_parse_from(["broker"]).unwrap();
        assert_eq!(
            cli.security.token_exempt,
            vec![TokenExempt::Health, TokenExempt::Reflection]
        );
        assert_eq!(cli.security.tls_cert, None);
        let cli = Cli::try_parse_from(["broker", "--token-exempt", "none"]).unwrap();
        assert_eq!(cli.security.token_exempt, vec![TokenExempt::None]);
        let cli = Cli::try_parse_from(["broker", "--token-exempt", "health"]).unwrap();
        let loaded = cli.security.load().unwrap();
        assert!(loaded.health_open && !loaded.reflection_open);
        assert!(Cli::try_parse_from(["broker", "--tls-cert", "cert.pem"]).is_err());
        let mixed = BrokerSecurity {
            token_exempt: vec![TokenExempt::None, TokenExempt::Health],
            ..BrokerSecurity::none()
        };
        assert!(mixed
            .load()
            .unwrap_err()
            .to_string()
            .contains("--token-exempt none"));
    }

    #[test]
    fn half_a_key_pair_is_refused_with_the_flag() {
        let security = BrokerSecurity {
            tls_cert: Some(PathBuf::from("/nonexistent/cert.pem")),
            ..BrokerSecurity::none()
        };
        let error = security.load().unwrap_err().to_string();
        assert!(error.contains("--tls-cert and --tls-key"), "{error}");
        let security = BrokerSecurity {
            tls_cert: Some(PathBuf::from("/nonexistent/cert.pem")),
            tls_key: Some(PathBuf::from("/nonexistent/key.pem")),
            ..BrokerSecurity::none()
        };
        let error = security.load().unwrap_err().to_string();
        assert!(
            error.starts_with("--tls-cert /nonexistent/cert.pem"),
            "{error}"
        );
    }
}
