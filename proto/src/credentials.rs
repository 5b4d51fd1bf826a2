//! The credentials both ends of a dflash connection read from files: the
//! bearer token (`authorization: Bearer <token>` on every call) and PEM
//! certificates and keys. The broker (`broker::auth`) checks the token and
//! serves TLS; every client (`dflash_client::security`) sends the token and
//! dials TLS. Both load them here, so a file is read, trimmed and refused
//! the same way on either side.
//!
//! The token comes from a file (a Kubernetes Secret mounts as a file) or
//! from the `DFLASH_TOKEN` environment variable, read directly so that clap
//! never shows its value in `--help`. [`Token`]'s `Debug` prints its length
//! only, so no log or error ever holds it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The environment variable that may hold the token itself.
pub const TOKEN_ENV: &str = "DFLASH_TOKEN";

/// A credential file or value that cannot be used, naming the flag and file.
#[derive(Debug, thiserror::Error)]
pub enum CredentialError {
    #[error("{flag} {path}: {source}")]
    Read {
        flag: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{origin} holds an empty token")]
    EmptyToken { origin: String },
    #[error("{origin}: the token must be printable ASCII without spaces")]
    InvalidToken { origin: String },
    #[error("the token is given twice (--token-file {path} and {TOKEN_ENV}): keep one")]
    TokenTwice { path: PathBuf },
}

/// A bearer token. Compared in constant time; never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(Arc<str>);

impl Token {
    /// The token in `text`, surrounding whitespace (a file's trailing
    /// newline) removed. It must be printable ASCII: it travels as an HTTP
    /// header value, so any other token could never be presented.
    pub fn new(text: &str, origin: &str) -> Result<Token, CredentialError> {
        let trimmed = text.trim();
        if trimmed.is_empty() {
            return Err(CredentialError::EmptyToken {
                origin: origin.to_string(),
            });
        }
        if !trimmed.bytes().all(|byte| byte.is_ascii_graphic()) {
            return Err(CredentialError::InvalidToken {
                origin: origin.to_string(),
            });
        }
        Ok(Token(Arc::from(trimmed)))
    }

    /// The value, for the `authorization` header only.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Whether `candidate` is this token, in time independent of where they
    /// differ.
    pub fn matches(&self, candidate: &[u8]) -> bool {
        let expected = self.0.as_bytes();
        let mut difference = expected.len() ^ candidate.len();
        for (index, byte) in expected.iter().enumerate() {
            let other = candidate.get(index).copied().unwrap_or(!*byte);
            difference |= usize::from(byte ^ other);
        }
        difference == 0
    }
}

impl std::fmt::Debug for Token {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(formatter, "Token(<redacted, {} bytes>)", self.0.len())
    }
}

/// Reads the token from `token_file`, else from `DFLASH_TOKEN`; `None` when
/// neither is set. Both set is an error (which one wins would be a guess).
pub fn load_token(token_file: Option<&Path>) -> Result<Option<Token>, CredentialError> {
    let from_env = std::env::var(TOKEN_ENV)
        .ok()
        .filter(|value| !value.is_empty());
    match (token_file, from_env) {
        (Some(path), Some(_)) => Err(CredentialError::TokenTwice {
            path: path.to_path_buf(),
        }),
        (Some(path), None) => {
            let text = std::fs::read_to_string(path).map_err(|source| CredentialError::Read {
                flag: "--token-file",
                path: path.to_path_buf(),
                source,
            })?;
            Token::new(&text, &format!("--token-file {}", path.display())).map(Some)
        }
        (None, Some(value)) => Token::new(&value, TOKEN_ENV).map(Some),
        (None, None) => Ok(None),
    }
}

/// Reads the PEM file named by `flag`.
pub fn read_pem(flag: &'static str, path: &Path) -> Result<Vec<u8>, CredentialError> {
    std::fs::read(path).map_err(|source| CredentialError::Read {
        flag,
        path: path.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_matches_only_itself_and_never_prints() {
        let token = Token::new(" s3cret\n", "test").unwrap();
        assert_eq!(token.expose(), "s3cret");
        assert!(token.matches(b"s3cret"));
        for other in [&b"s3cre"[..], b"s3cret!", b"S3cret", b""] {
            assert!(!token.matches(other), "{other:?}");
        }
        let printed = format!("{token:?} {:?}", Some(token.clone()));
        assert!(!printed.contains("s3cret"), "{printed}");
    }

    #[test]
    fn empty_and_unprintable_tokens_are_refused_naming_their_origin() {
        let empty = Token::new(" \n", "the file").unwrap_err();
        assert!(matches!(empty, CredentialError::EmptyToken { .. }));
        assert_eq!(empty.to_string(), "the file holds an empty token");
        let spaced = Token::new("two words", TOKEN_ENV).unwrap_err();
        assert!(matches!(spaced, CredentialError::InvalidToken { .. }));
        assert!(spaced.to_string().starts_with(TOKEN_ENV), "{spaced}");
    }

    #[test]
    fn a_missing_file_names_the_flag_and_the_path() {
        let error = read_pem("--tls-ca", Path::new("/nonexistent/ca.pem")).unwrap_err();
        assert!(
            error
                .to_string()
                .starts_with("--tls-ca /nonexistent/ca.pem"),
            "{error}"
        );
        let error = load_token(Some(Path::new("/nonexistent/token"))).unwrap_err();
        assert!(
            error
                .to_string()
                .starts_with("--token-file /nonexistent/token"),
            "{error}"
        );
    }
}
