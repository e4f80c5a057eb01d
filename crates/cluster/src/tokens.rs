//! The administrator's bearer token `cluster up` needs: taken from the config when set there;
//! otherwise read from, or generated into, a file in the state directory (mode 0600), so a
//! restarted cluster keeps it. (Components authenticate each other with certificates, see
//! `opendsec_common::pki`.)

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use opendsec_common::config::{Config, parse_token_shape};
use opendsec_common::grpc::random_secret;

#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("failed to read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("failed to write {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
    #[error("{path} does not hold a token of the form dsk.<id>.<secret>")]
    Malformed { path: PathBuf },
    #[error("{0}")]
    Missing(String),
}

#[derive(Debug)]
pub struct Tokens {
    pub admin_token: String,
    pub admin_token_path: PathBuf,
    /// The same token as an E2B API key (`e2b_` + hex, [`opendsec_common::config::e2b_key`]),
    /// beside it: what `E2B_API_KEY` is set to, so that every E2B SDK release takes it.
    pub admin_e2b_key_path: PathBuf,
}

/// The administrator's token as an E2B API key, in the state directory.
pub const ADMIN_E2B_KEY_FILE: &str = "admin.e2b-key";

/// A new administrator token `dsk.<16 id chars>.<43 secret chars>`.
pub fn new_token() -> String {
    format!("dsk.{}.{}", random_secret(16).to_ascii_lowercase(), random_secret(43))
}

pub fn resolve(config: &Config) -> Result<Tokens, TokenError> {
    let dir = &config.state_dir;
    let admin_token_path = crate::admin_token_path(dir);
    let admin_token = if config.iam.admin_token.is_empty() {
        if !admin_token_path.exists() && opendsec_iam::store::holds_state(&config.iam_data_dir()) {
            return Err(TokenError::Missing(format!(
                "IAM already has state in {} but {} is gone and iam.admin_token is empty: restore the token file or set iam.admin_token",
                config.iam_data_dir().display(),
                admin_token_path.display()
            )));
        }
        let t = read_or_create(&admin_token_path, new_token)?;
        if parse_token_shape(&t).is_none() {
            return Err(TokenError::Malformed { path: admin_token_path });
        }
        t
    } else {
        // Written out too, so tools find it in one place.
        write_secret(&admin_token_path, &config.iam.admin_token)?;
        config.iam.admin_token.clone()
    };
    let admin_e2b_key_path = admin_token_path.with_file_name(ADMIN_E2B_KEY_FILE);
    write_secret(&admin_e2b_key_path, &opendsec_common::config::e2b_key(&admin_token))?;
    Ok(Tokens { admin_token, admin_token_path, admin_e2b_key_path })
}

fn read_or_create(path: &Path, make: impl FnOnce() -> String) -> Result<String, TokenError> {
    match std::fs::read_to_string(path) {
        Ok(s) => Ok(s.trim().to_string()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let t = make();
            write_secret(path, &t)?;
            Ok(t)
        }
        Err(source) => Err(TokenError::Read { path: path.to_path_buf(), source }),
    }
}

fn write_secret(path: &Path, secret: &str) -> Result<(), TokenError> {
    let err = |source| TokenError::Write { path: path.to_path_buf(), source };
    let tmp = path.with_extension("tmp");
    let mut f =
        std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp).map_err(err)?;
    f.write_all(format!("{secret}\n").as_bytes()).map_err(err)?;
    f.sync_all().map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_tokens_are_kept_across_starts() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = Config { state_dir: dir.path().to_path_buf(), ..Config::default() };
        let a = resolve(&cfg).unwrap();
        let b = resolve(&cfg).unwrap();
        assert_eq!(a.admin_token, b.admin_token);
        assert!(parse_token_shape(&a.admin_token).is_some());
        let mode = std::fs::metadata(&a.admin_token_path).unwrap().permissions();
        assert_eq!(std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777, 0o600);
    }

    /// A lost token file is an error only where IAM has a store: an empty IAM directory (a
    /// mount point made ahead, a systemd state directory) is a first start.
    #[test]
    fn a_lost_token_is_refused_only_beside_a_store() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = Config { state_dir: dir.path().to_path_buf(), ..Config::default() };
        std::fs::create_dir_all(cfg.iam_data_dir().join("member-3")).unwrap();
        let first = resolve(&cfg).expect("an empty IAM directory is a first start");
        std::fs::remove_file(&first.admin_token_path).unwrap();
        std::fs::write(cfg.iam_data_dir().join("member-3").join("iam.redb"), b"").unwrap();
        match resolve(&cfg) {
            Err(TokenError::Missing(m)) => assert!(m.contains("is gone"), "{m}"),
            other => panic!("a lost token beside a member's store: {other:?}"),
        }
        std::fs::remove_dir_all(cfg.iam_data_dir().join("member-3")).unwrap();
        std::fs::write(cfg.iam_data_dir().join("iam.redb"), b"").unwrap();
        assert!(matches!(resolve(&cfg), Err(TokenError::Missing(_))), "beside a standalone store");
    }
}
