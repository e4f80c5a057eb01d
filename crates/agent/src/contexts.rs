//! The code contexts of a sandbox: each a python kernel ([`crate::kernel`]) or a bash
//! session, with an id, a language and a directory. The default context of a language is made
//! on first use; at most [`MAX_CONTEXTS`] exist at once.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use opendsec_proto::v1::CodeContext;

use crate::error::AgentError;
use crate::kernel::Kernel;

pub const MAX_CONTEXTS: usize = 32;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Language {
    Python,
    Bash,
}

impl Language {
    pub fn parse(s: &str) -> Result<Language, AgentError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "python" | "python3" => Ok(Language::Python),
            "bash" | "sh" | "shell" => Ok(Language::Bash),
            other => Err(AgentError::Invalid(format!("language {other:?}: python or bash"))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Language::Python => "python",
            Language::Bash => "bash",
        }
    }

    /// The id of the default context of this language.
    pub fn default_id(self) -> String {
        format!("default-{}", self.name())
    }
}

#[derive(Debug)]
pub struct Context {
    pub id: String,
    pub language: Language,
    pub cwd: String,
    pub user: String,
    /// A python context's kernel (None until started, and after a failed restart); one run at
    /// a time holds it.
    pub kernel: tokio::sync::Mutex<Option<Kernel>>,
    /// Runs so far (a bash context's execution count).
    pub runs: std::sync::atomic::AtomicU32,
    /// The current kernel's handle, to kill it while a run holds `kernel`.
    pub handle: Mutex<Option<crate::kernel::KernelHandle>>,
}

impl Context {
    /// Puts `k` in place (its handle too).
    pub fn set_kernel(&self, slot: &mut Option<Kernel>, k: Kernel) {
        *self.handle.lock().unwrap_or_else(|p| p.into_inner()) = Some(k.handle());
        *slot = Some(k);
    }

    /// Kills the current kernel, whoever holds it.
    pub async fn kill_kernel(&self) {
        let h = self.handle.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(h) = h {
            h.kill().await;
        }
    }

    pub fn info(&self) -> CodeContext {
        CodeContext { id: self.id.clone(), language: self.language.name().into(), cwd: self.cwd.clone() }
    }

    /// The shell session a bash context runs in.
    pub fn session(&self) -> String {
        format!("code-{}", self.id)
    }
}

#[derive(Debug, Default)]
pub struct Contexts {
    inner: Mutex<HashMap<String, Arc<Context>>>,
    /// Makes a context's creation one at a time (a default context is made once).
    pub create: tokio::sync::Mutex<()>,
}

impl Contexts {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Context>>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn get(&self, id: &str) -> Result<Arc<Context>, AgentError> {
        self.lock().get(id).cloned().ok_or_else(|| AgentError::UnknownContext(id.chars().take(64).collect()))
    }

    pub fn find(&self, id: &str) -> Option<Arc<Context>> {
        self.lock().get(id).cloned()
    }

    pub fn insert(&self, c: Arc<Context>) -> Result<(), AgentError> {
        let mut g = self.lock();
        if g.len() >= MAX_CONTEXTS {
            return Err(AgentError::Invalid(format!("at most {MAX_CONTEXTS} code contexts per sandbox")));
        }
        g.insert(c.id.clone(), c);
        Ok(())
    }

    pub fn remove(&self, id: &str) -> Option<Arc<Context>> {
        self.lock().remove(id)
    }

    pub fn list(&self) -> Vec<CodeContext> {
        let mut v: Vec<CodeContext> = self.lock().values().map(|c| c.info()).collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }

    pub fn new_id() -> String {
        format!("{:016x}", rand::random::<u64>())
    }
}

/// `code` for a bash context with `env` set around it: each variable's old value (or its
/// absence) is put back after the code, whatever it exited with, and its exit status is kept.
pub fn scoped_env(env: &HashMap<String, String>, code: &str) -> Result<String, AgentError> {
    if env.is_empty() {
        return Ok(code.to_string());
    }
    let mut names: Vec<&String> = env.keys().collect();
    names.sort();
    for n in &names {
        let ok = n.bytes().next().is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
            && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !ok {
            return Err(AgentError::Invalid(format!("env name {n:?} is not a shell variable name")));
        }
    }
    let list = names.iter().map(|n| n.as_str()).collect::<Vec<_>>().join(" ");
    let quote = |v: &str| format!("'{}'", v.replace('\'', "'\\''"));
    let sets = names.iter().map(|n| format!("{n}={}", quote(&env[n.as_str()]))).collect::<Vec<_>>().join(" ");
    Ok(format!(
        "__od_saved=$(declare -p {list} 2>/dev/null); export {sets}\n{code}\n__od_rc=$?; unset {list}; eval \"$__od_saved\"; unset __od_saved; (exit $__od_rc)"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_runs_variables_hold_for_that_run_only() {
        let env = HashMap::from([("FOO".to_string(), "new 'q' $x".to_string()), ("BAR".to_string(), "b".into())]);
        let run = scoped_env(&env, "echo \"$FOO $BAR\"; export MINE=1; false").unwrap();
        let script = format!("FOO=old; export FOO\n{run}\necho \"rc=$? $FOO ${{BAR-unset}} $MINE\"");
        let out = std::process::Command::new("bash").arg("-c").arg(&script).output().unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "new 'q' $x b\nrc=1 old unset 1\n");
        assert!(scoped_env(&HashMap::from([("A B".to_string(), String::new())]), "true").is_err());
        assert_eq!(scoped_env(&HashMap::new(), "echo").unwrap(), "echo");
    }

    #[test]
    fn languages_parse_and_name_their_default() {
        assert_eq!(Language::parse("").unwrap(), Language::Python);
        assert_eq!(Language::parse("Bash").unwrap(), Language::Bash);
        assert!(Language::parse("r").is_err());
        assert_eq!(Language::Bash.default_id(), "default-bash");
    }
}
