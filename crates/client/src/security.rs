//! The client side of the broker's transport security: TLS (the CA that
//! signs the broker's certificate, and a client certificate for mutual TLS)
//! and the bearer token sent on every call.
//!
//! [`ClientSecurityArgs`] are the flags every role shares (`--tls-ca`,
//! `--tls-cert`, `--tls-key`, `--tls-domain`, `--token-file`; the token may
//! also come from the `DFLASH_TOKEN` environment variable, read directly so
//! its value never shows in `--help`). The files are read by
//! `dflash_proto::credentials`, the same code the broker uses. [`ClientSecurity`] is what a
//! connection applies; its `Debug` never prints the token.

use std::path::PathBuf;

use dflash_proto::credentials::{load_token, read_pem, CredentialError, Token};
use tonic::metadata::AsciiMetadataValue;
use tonic::service::interceptor::InterceptedService;
use tonic::service::Interceptor;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

/// A channel that carries the token on every call.
pub type AuthChannel = InterceptedService<Channel, TokenInjector>;

/// A security setting that cannot be used, naming the flag and file.
#[derive(Debug, thiserror::Error)]
pub enum SecurityError {
    #[error(transparent)]
    Credential(#[from] CredentialError),
    #[error("--tls-cert and --tls-key go together")]
    HalfKeyPair,
    #[error("TLS is configured but the broker address {address:?} is not https://")]
    PlaintextAddress { address: String },
    #[error("TLS settings for {address}: {detail}")]
    Tls { address: String, detail: String },
}

/// TLS and token flags of every client role (target-server, drafter-server,
/// `dflash status`/`top`).
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct ClientSecurityArgs {
    /// PEM CA bundle that signed the broker's certificate; enables TLS
    /// (the broker address must then be https://). With https:// and no
    /// --tls-ca the system's roots are used.
    #[arg(long, env = "DFLASH_TLS_CA")]
    pub tls_ca: Option<PathBuf>,

    /// PEM client certificate for mutual TLS (with --tls-key).
    #[arg(long, env = "DFLASH_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,

    /// PEM private key of --tls-cert.
    #[arg(long, env = "DFLASH_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,

    /// Name to verify the broker's certificate against, when it is not the
    /// host of the broker address.
    #[arg(long, env = "DFLASH_TLS_DOMAIN")]
    pub tls_domain: Option<String>,

    /// File holding the broker's bearer token. The DFLASH_TOKEN environment
    /// variable may hold the token instead.
    #[arg(long, env = "DFLASH_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
}

impl ClientSecurityArgs {
    /// Reads the files and the environment.
    pub fn load(&self) -> Result<ClientSecurity, SecurityError> {
        let identity = match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Some(Identity::from_pem(
                read_pem("--tls-cert", cert)?,
                read_pem("--tls-key", key)?,
            )),
            (None, None) => None,
            _ => return Err(SecurityError::HalfKeyPair),
        };
        let tls = if self.tls_ca.is_some() || identity.is_some() || self.tls_domain.is_some() {
            let mut tls = ClientTlsConfig::new();
            tls = match &self.tls_ca {
                Some(ca) => tls.ca_certificate(Certificate::from_pem(read_pem("--tls-ca", ca)?)),
                None => tls.with_native_roots(),
            };
            if let Some(identity) = identity {
                tls = tls.identity(identity);
            }
            if let Some(domain) = &self.tls_domain {
                tls = tls.domain_name(domain.clone());
            }
            Some(tls)
        } else {
            None
        };
        Ok(ClientSecurity {
            tls,
            token: load_token(self.token_file.as_deref())?,
        })
    }
}

/// What a connection applies: TLS when configured, the token when given.
#[derive(Clone, Default)]
pub struct ClientSecurity {
    pub tls: Option<ClientTlsConfig>,
    pub token: Option<Token>,
}

impl std::fmt::Debug for ClientSecurity {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("ClientSecurity")
            .field("tls", &self.tls.is_some())
            .field("token", &self.token)
            .finish()
    }
}

impl ClientSecurity {
    /// Applies TLS to `endpoint` for `address`: the configured TLS, the
    /// system roots for an https:// address without it; a TLS setting with
    /// an http:// address is an error rather than a silent plaintext call.
    pub fn apply(&self, endpoint: Endpoint, address: &str) -> Result<Endpoint, SecurityError> {
        let https = address.starts_with("https://");
        let tls = match (&self.tls, https) {
            (Some(tls), true) => tls.clone(),
            (Some(_), false) => {
                return Err(SecurityError::PlaintextAddress {
                    address: address.to_string(),
                })
            }
            (None, true) => ClientTlsConfig::new().with_native_roots(),
            (None, false) => return Ok(endpoint),
        };
        endpoint
            .tls_config(tls)
            .map_err(|error| SecurityError::Tls {
                address: address.to_string(),
                detail: error.to_string(),
            })
    }

    /// The interceptor that adds `authorization: Bearer <token>`.
    pub fn injector(&self) -> TokenInjector {
        TokenInjector {
            header: self.token.as_ref().and_then(|token| {
                AsciiMetadataValue::try_from(format!("Bearer {}", token.expose()))
                    .ok()
                    .map(|mut value| {
                        value.set_sensitive(true);
                        value
                    })
            }),
        }
    }

    /// `channel` with the token on every call.
    pub fn wrap(&self, channel: Channel) -> AuthChannel {
        InterceptedService::new(channel, self.injector())
    }
}

/// Adds the bearer token to every call (nothing without a token).
#[derive(Clone)]
pub struct TokenInjector {
    header: Option<AsciiMetadataValue>,
}

impl Interceptor for TokenInjector {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(header) = &self.header {
            request
                .metadata_mut()
                .insert("authorization", header.clone());
        }
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_goes_in_the_header_and_never_in_debug_output() {
        let security = ClientSecurity {
            tls: None,
            token: Some(Token::new("abc123\n", "test").unwrap()),
        };
        let request = security.injector().call(tonic::Request::new(())).unwrap();
        assert_eq!(
            request.metadata().get("authorization").unwrap(),
            "Bearer abc123"
        );
        assert!(!format!("{security:?}").contains("abc123"));
        let empty = ClientSecurity::default()
            .injector()
            .call(tonic::Request::new(()))
            .unwrap();
        assert!(empty.metadata().get("authorization").is_none());
    }

    #[test]
    fn bad_tokens_and_addresses_are_named() {
        assert!(matches!(
            Token::new("two words", "DFLASH_TOKEN"),
            Err(CredentialError::InvalidToken { .. })
        ));
        assert!(Token::new("\n", "x").is_err());
        let security = ClientSecurity {
            tls: Some(ClientTlsConfig::new()),
            token: None,
        };
        let endpoint = Endpoint::from_static("http://broker:50051");
        let error = security
            .apply(endpoint, "http://broker:50051")
            .unwrap_err()
            .to_string();
        assert!(error.contains("http://broker:50051"), "{error}");
        let error = ClientSecurityArgs {
            tls_ca: Some(PathBuf::from("/nonexistent/ca.pem")),
            ..ClientSecurityArgs::default()
        }
        .load()
        .unwrap_err()
        .to_string();
        assert!(error.starts_with("--tls-ca /nonexistent/ca.pem"), "{error}");
    }
}
