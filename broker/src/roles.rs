//! Who may call what: credentials that carry a role (target, drafter,
//! evaluator, operator) and optionally the one identity they stand for, the checks
//! each RPC makes with them, and the checks on a hello's id itself
//! ([`validate_id`], shared by the broker's and model sync's services).
//! Their refusals are [`RpcError`]s.
//!
//! A credentials file (`--credentials FILE`) has one credential a line:
//!
//! ```text
//! # role     identity   token (or sha256:<hex of the token>)
//! target     target-0   sha256:5e8848...
//! target     target-1   sha256:6b86b2...
//! drafter    *          sha256:d4735e...
//! evaluator  *          sha256:ef2d12...
//! operator   *          sha256:4e0740...
//! ```
//!
//! `*` stands for any identity of the role. Tokens are kept as SHA-256
//! digests (a file may hold the hash only: `printf %s "$token" | sha256sum`),
//! and a presented token is hashed once and compared with every digest in
//! constant time. The single shared token (`--token-file`) still works and
//! grants every role (a trusted single-tenant setup; the broker warns).
//!
//! | RPC | role | identity checked against |
//! |---|---|---|
//! | Produce | target | the hello's `target_id` |
//! | ReportDone | target | the request's `target_id` |
//! | Consume | drafter | the hello's `drafter_id` |
//! | ModelSync.Session | drafter | the hello's `drafter_id` |
//! | Lighthouse.Quorum, Lighthouse.Commit | drafter | the request's `drafter_id` |
//! | ModelSync.ReadModel, ModelSync.ReportTau | evaluator | the request's `evaluator_id` |
//! | GetStatus, WatchStatus | any | — |
//!
//! A refusal is PERMISSION_DENIED and names only the caller's own role and
//! identity, never the state of the target or drafter it asked about; it
//! comes before any other check, so it changes nothing.
//!
//! With mutual TLS (`--tls-client-ca`) a client certificate may carry the
//! role instead of a token: a URI subject alternative name `dflash:ROLE`
//! (any id of the role) or `dflash:ROLE/ID` (that id only), e.g.
//! `dflash:target/target-0`. It is used when the call carries no token; the
//! TLS handshake has already checked the certificate against the client CA.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::rpc_error::RpcError;

/// What a credential lets its holder do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Target,
    Drafter,
    /// Reads the model and reports its τ (online evaluation); takes no
    /// part in training.
    Evaluator,
    Operator,
    /// The shared token, or no credentials configured: every role.
    Any,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Role::Target => "target",
            Role::Drafter => "drafter",
            Role::Evaluator => "evaluator",
            Role::Operator => "operator",
            Role::Any => "any",
        }
    }
}

/// The caller of one RPC, as its credential says (set by the interceptor in
/// the request's extensions).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub role: Role,
    /// The one target or drafter id the credential stands for; `None`: any.
    pub identity: Option<String>,
}

impl Principal {
    /// Every role (the shared token, or no credentials configured).
    pub fn unrestricted() -> Self {
        Principal {
            role: Role::Any,
            identity: None,
        }
    }

    /// The caller as the interceptor recorded it; unrestricted when none was
    /// recorded (no interceptor: an in-process service without security).
    pub fn of(extensions: &http::Extensions) -> Principal {
        extensions
            .get::<Principal>()
            .cloned()
            .unwrap_or_else(Principal::unrestricted)
    }

    /// Whether this caller may act as `role` for `identity` (`action` names
    /// the RPC in the refusal).
    pub fn authorize(
        &self,
        role: Role,
        identity: &str,
        action: &'static str,
    ) -> Result<(), RpcError> {
        if self.role == Role::Any {
            return Ok(());
        }
        if self.role != role {
            return Err(RpcError::WrongRole {
                action,
                needed: role.name(),
                held: self.role.name(),
            });
        }
        match &self.identity {
            Some(own) if own != identity => Err(RpcError::OtherIdentity {
                action,
                role: role.name(),
                own: own.clone(),
                identity: identity.to_string(),
            }),
            _ => Ok(()),
        }
    }
}

/// A credentials file that cannot be used; the message names the file and line.
#[derive(Debug, thiserror::Error)]
pub enum CredentialsError {
    #[error("--credentials {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("--credentials {path} line {line}: {detail}")]
    Line {
        path: PathBuf,
        line: usize,
        detail: String,
    },
    #[error("--credentials {0}: no credential in the file")]
    Empty(PathBuf),
}

struct Credential {
    digest: [u8; 32],
    principal: Principal,
}

/// The credentials of `--credentials`.
#[derive(Default)]
pub struct Credentials {
    entries: Vec<Credential>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Digests only, and not even those: the count and the roles.
        formatter
            .debug_list()
            .entries(self.entries.iter().map(|entry| &entry.principal))
            .finish()
    }
}

impl Credentials {
    pub fn load(path: &Path) -> Result<Self, CredentialsError> {
        let text = std::fs::read_to_string(path).map_err(|source| CredentialsError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let credentials = Self::parse(&text).map_err(|(line, detail)| CredentialsError::Line {
            path: path.to_path_buf(),
            line,
            detail,
        })?;
        if credentials.entries.is_empty() {
            return Err(CredentialsError::Empty(path.to_path_buf()));
        }
        Ok(credentials)
    }

    /// Parses the file's text; an error is (line number, what is wrong).
    pub fn parse(text: &str) -> Result<Self, (usize, String)> {
        let mut entries: Vec<Credential> = Vec::new();
        for (index, line) in text.lines().enumerate() {
            let number = index + 1;
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [role, identity, token] = fields.as_slice() else {
                return Err((
                    number,
                    format!(
                        "expected three fields (role identity token), got {}",
                        fields.len()
                    ),
                ));
            };
            let role = match *role {
                "target" => Role::Target,
                "drafter" => Role::Drafter,
                "evaluator" => Role::Evaluator,
                "operator" => Role::Operator,
                other => {
                    return Err((
                        number,
                        format!("role {other:?} is not target, drafter, evaluator or operator"),
                    ))
                }
            };
            let identity = match *identity {
                "*" => None,
                id if id.len() <= 256 && !id.chars().any(char::is_control) => Some(id.to_string()),
                id => return Err((number, format!("identity {id:?} is not a valid id"))),
            };
            let digest = match token.strip_prefix("sha256:") {
                Some(hex) => parse_digest(hex).ok_or_else(|| {
                    (
                        number,
                        "sha256: must be followed by 64 hex digits".to_string(),
                    )
                })?,
                None if token.len() >= 16 && token.bytes().all(|byte| byte.is_ascii_graphic()) => {
                    digest_of(token.as_bytes())
                }
                None => {
                    return Err((
                        number,
                        "a token must be at least 16 printable characters (or sha256:<hex>)"
                            .to_string(),
                    ))
                }
            };
            if entries.iter().any(|entry| entry.digest == digest) {
                return Err((number, "the same token is listed twice".to_string()));
            }
            entries.push(Credential {
                digest,
                principal: Principal { role, identity },
            });
        }
        Ok(Credentials { entries })
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The principal of a presented token, if it is one of ours. Every
    /// digest is compared (in constant time each), whichever matches.
    pub fn principal_of(&self, presented: &[u8]) -> Option<Principal> {
        let digest = digest_of(presented);
        let mut found = None;
        for entry in &self.entries {
            if constant_time_equal(&entry.digest, &digest) {
                found = Some(entry.principal.clone());
            }
        }
        found
    }
}

/// The principal a client certificate (DER) names in a `dflash:ROLE[/ID]`
/// URI subject alternative name; `None` when it names none (or cannot be
/// parsed).
pub fn principal_of_certificate(der: &[u8]) -> Option<Principal> {
    let (_, certificate) = x509_parser::parse_x509_certificate(der).ok()?;
    let names = certificate.subject_alternative_name().ok()??;
    names
        .value
        .general_names
        .iter()
        .find_map(|name| match name {
            x509_parser::extensions::GeneralName::URI(uri) => principal_of_uri(uri),
            _ => None,
        })
}

/// `dflash:target/target-0` → a target credential for target-0;
/// `dflash:drafter` → a drafter credential for any drafter id.
fn principal_of_uri(uri: &str) -> Option<Principal> {
    let rest = uri.strip_prefix("dflash:")?;
    let (role, identity) = match rest.split_once('/') {
        Some((role, identity)) if !identity.is_empty() => (role, Some(identity.to_string())),
        Some(_) => return None,
        None => (rest, None),
    };
    let role = match role {
        "target" => Role::Target,
        "drafter" => Role::Drafter,
        "evaluator" => Role::Evaluator,
        "operator" => Role::Operator,
        _ => return None,
    };
    Some(Principal { role, identity })
}

fn digest_of(token: &[u8]) -> [u8; 32] {
    Sha256::digest(token).into()
}

fn parse_digest(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 {
        return None;
    }
    let mut digest = [0u8; 32];
    for (index, byte) in digest.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(index * 2..index * 2 + 2)?, 16).ok()?;
    }
    Some(digest)
}

fn constant_time_equal(left: &[u8; 32], right: &[u8; 32]) -> bool {
    left.iter()
        .zip(right)
        .fold(0u8, |difference, (a, b)| difference | (a ^ b))
        == 0
}

/// Longest accepted target or drafter id.
pub(crate) const MAX_ID_LENGTH: usize = 256;

/// The checks every hello's target or drafter id goes through, in every
/// service, before anything is looked up: at most [`MAX_ID_LENGTH`] bytes,
/// no control characters (an id ends up in logs, metrics labels and
/// file names). Emptiness is the caller's rule (the queue names it).
pub(crate) fn validate_id(field: &'static str, id: &str) -> Result<(), RpcError> {
    if id.len() > MAX_ID_LENGTH {
        return Err(RpcError::IdTooLong {
            field,
            length: id.len(),
            limit: MAX_ID_LENGTH,
        });
    }
    if id.chars().any(char::is_control) {
        return Err(RpcError::IdHasControlCharacters {
            field,
            id: id.to_string(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "\
# role identity token
target   target-0  token-of-target-zero
drafter  *         sha256:8c1f6d3f0b4e3f1c6e4b5c7a9d0e2f4a6b8c0d2e4f6a8b0c2d4e6f8a0b2c4d6e
operator *         token-of-the-operator
";

    #[test]
    fn tokens_map_to_their_role_and_identity() {
        let credentials = Credentials::parse(FILE).unwrap();
        assert_eq!(
            credentials.principal_of(b"token-of-target-zero"),
            Some(Principal {
                role: Role::Target,
                identity: Some("target-0".to_string())
            })
        );
        assert_eq!(
            credentials
                .principal_of(b"token-of-the-operator")
                .map(|principal| principal.role),
            Some(Role::Operator)
        );
        assert_eq!(credentials.principal_of(b"token-of-nobody-at-all"), None);
        // A hashed entry matches the token whose digest it is.
        let hashed = format!(
            "drafter * sha256:{}",
            digest_of(b"drafter-secret-token")
                .iter()
                .map(|byte| format!("{byte:02x}"))
                .collect::<String>()
        );
        let credentials = Credentials::parse(&hashed).unwrap();
        assert_eq!(
            credentials
                .principal_of(b"drafter-secret-token")
                .map(|principal| principal.role),
            Some(Role::Drafter)
        );
    }

    #[test]
    fn certificate_uris_name_a_role_and_maybe_an_id() {
        assert_eq!(
            principal_of_uri("dflash:target/target-0"),
            Some(Principal {
                role: Role::Target,
                identity: Some("target-0".to_string())
            })
        );
        assert_eq!(
            principal_of_uri("dflash:drafter"),
            Some(Principal {
                role: Role::Drafter,
                identity: None
            })
        );
        for refused in [
            "dflash:admin",
            "dflash:target/",
            "https://target",
            "dflash:",
        ] {
            assert_eq!(principal_of_uri(refused), None, "{refused}");
        }
    }

    #[test]
    fn bad_lines_name_their_number_and_fault() {
        for (text, line, fault) in [
            ("target target-0", 1, "three fields"),
            ("\nadmin * token-token-token-token", 2, "\"admin\""),
            ("target t short", 1, "at least 16"),
            ("drafter * sha256:abc", 1, "64 hex"),
            (
                "target a same-token-same-token\ntarget b same-token-same-token",
                2,
                "twice",
            ),
        ] {
            let (number, detail) = Credentials::parse(text).err().unwrap();
            assert_eq!(number, line, "{text:?}");
            assert!(detail.contains(fault), "{text:?}: {detail}");
        }
    }

    #[test]
    fn a_principal_acts_only_as_its_role_and_identity() {
        let target_zero = Principal {
            role: Role::Target,
            identity: Some("target-0".to_string()),
        };
        assert!(target_zero
            .authorize(Role::Target, "target-0", "Produce")
            .is_ok());
        let other = target_zero
            .authorize(Role::Target, "target-1", "ReportDone")
            .unwrap_err();
        let other = tonic::Status::from(other);
        assert_eq!(other.code(), tonic::Code::PermissionDenied);
        assert!(
            other.message().contains("\"target-0\""),
            "{}",
            other.message()
        );
        let drafter = Principal {
            role: Role::Drafter,
            identity: None,
        };
        assert!(drafter
            .authorize(Role::Drafter, "drafter-9", "Consume")
            .is_ok());
        let refused = drafter
            .authorize(Role::Target, "target-0", "ReportDone")
            .unwrap_err();
        assert_eq!(
            tonic::Status::from(refused).code(),
            tonic::Code::PermissionDenied
        );
        assert!(Principal::unrestricted()
            .authorize(Role::Target, "target-3", "Produce")
            .is_ok());
    }
}
