//! aether: PID 1 of a sandbox (or a plain subreaper process in tests). Serves `Runtime` on a
//! unix socket, reaps every orphan, owns the process API, and routes session calls by session
//! id to that session's chronus, started on first use as the session's user: a re-exec of this
//! binary in its own process group with its own state directory `<state>/sessions/<id>` (0700,
//! owned by the user) and socket. Closing a session stops and kills chronus's whole tree
//! (chronus is a subreaper, so even double-forked daemons stay in it).

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opendsec_proto::v1::runtime_client::RuntimeClient;
use opendsec_proto::v1::runtime_server::Runtime;
use opendsec_proto::v1::*;
use tokio::io::AsyncBufReadExt;
use tokio::sync::{OnceCell, mpsc};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Request, Response, Status, Streaming};

use crate::BoxStream;
use crate::contexts::{Context, Contexts, Language};
use crate::error::{AgentError, check_id};
use crate::kernel::Kernel;
use crate::passwd::{self, User};
use crate::procs::Procs;
use crate::reaper::{Reaper, kill_tree, wait_gone};

/// How long setting or resetting a run's variables in a kernel may take.
const ENV_RUN_LIMIT: Duration = Duration::from_secs(30);

#[derive(Debug)]
pub struct Config {
    pub state_dir: PathBuf,
    pub passwd: PathBuf,
    /// Per-session record budget handed to chronus.
    pub session_bytes: u64,
    /// The user of sessions and processes whose calls name none (the sandbox's spec.user;
    /// empty = root).
    pub default_user: String,
    /// Where sessions start and processes run when their call names no directory (the
    /// sandbox's spec.workdir; empty = the user's home).
    pub workdir: String,
    /// The sandbox's environment (the image's variables, then the spec's): every session and
    /// process gets it, over the default PATH and under the user's HOME, USER and LOGNAME and
    /// its call's own variables.
    pub env: Vec<(String, String)>,
    /// Where `SetIdentity` writes the sandbox's id (`/run/opendsec/sandbox-id` in a sandbox).
    pub identity_file: PathBuf,
}

/// The id file inside a sandbox.
pub const IDENTITY_FILE: &str = "/run/opendsec/sandbox-id";
/// The variable every session and process of a sandbox finds its id in.
pub const IDENTITY_ENV: &str = "OPENDSEC_SANDBOX_ID";

struct Session {
    pid: u32,
    channel: Channel,
}

type Slot = Arc<OnceCell<Session>>;

pub struct Aether {
    cfg: Config,
    exe: PathBuf,
    reaper: Reaper,
    started: Instant,
    sessions: Mutex<HashMap<String, Slot>>,
    procs: Procs,
    contexts: Contexts,
    /// `cfg.env` with what `SetIdentity` gave on top (the sandbox's id, the spec's env).
    env: std::sync::RwLock<Arc<Vec<(String, String)>>>,
}
impl std::fmt::Debug for Aether {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Aether").finish_non_exhaustive()
    }
}

impl Aether {
    pub fn new(cfg: Config, reaper: Reaper) -> std::io::Result<Arc<Self>> {
        std::fs::create_dir_all(cfg.state_dir.join("sessions"))?;
        // Session users must reach their own directory below, nothing else.
        std::fs::set_permissions(&cfg.state_dir, std::fs::Permissions::from_mode(0o711))?;
        std::fs::set_permissions(cfg.state_dir.join("sessions"), std::fs::Permissions::from_mode(0o711))?;
        Ok(Arc::new(Aether {
            exe: std::env::current_exe()?,
            reaper,
            started: Instant::now(),
            sessions: Mutex::new(HashMap::new()),
            procs: Procs::default(),
            contexts: Contexts::default(),
            env: std::sync::RwLock::new(Arc::new(cfg.env.clone())),
            cfg,
        }))
    }

    /// The environment of sessions and processes started now.
    fn env(&self) -> Arc<Vec<(String, String)>> {
        self.env.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Sets the sandbox's identity: its id (in [`IDENTITY_ENV`] and the identity file) and
    /// `extra` over the sandbox's environment, for what starts from now on.
    fn set_identity(&self, id: &str, extra: &HashMap<String, String>) -> Result<(), AgentError> {
        let ok_id = !id.is_empty()
            && id.len() <= 128
            && id.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b));
        if !ok_id {
            return Err(AgentError::Invalid(format!("bad sandbox id {:?}", id.chars().take(64).collect::<String>())));
        }
        for k in extra.keys() {
            if k.is_empty() || k.contains('=') || k.contains('\0') {
                return Err(AgentError::Invalid(format!("bad env name {k:?}")));
            }
        }
        let mut env: Vec<(String, String)> = self.cfg.env.clone();
        let mut put = |k: &str, v: &str| match env.iter_mut().find(|(ek, _)| ek == k) {
            Some(e) => e.1 = v.to_string(),
            None => env.push((k.to_string(), v.to_string())),
        };
        let mut keys: Vec<&String> = extra.keys().collect();
        keys.sort();
        for k in keys {
            put(k, &extra[k]);
        }
        put(IDENTITY_ENV, id);
        write_identity(&self.cfg.identity_file, id)?;
        *self.env.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(env);
        Ok(())
    }

    fn sessions(&self) -> std::sync::MutexGuard<'_, HashMap<String, Slot>> {
        self.sessions.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn user(&self, name: &str) -> Result<User, AgentError> {
        let name = if name.is_empty() { self.cfg.default_user.as_str() } else { name };
        let text = std::fs::read_to_string(&self.cfg.passwd).unwrap_or_default();
        let mut u = passwd::resolve(&text, name)?;
        let group = std::fs::read_to_string(self.cfg.passwd.with_file_name("group")).unwrap_or_default();
        u.groups = passwd::groups(&group, &u.name, u.gid);
        Ok(u)
    }

    /// The context a run names: by id, else the default one of its language (made now if
    /// it is not there yet).
    async fn context(self: &Arc<Self>, id: &str, language: &str, user: &str) -> Result<Arc<Context>, AgentError> {
        if !id.is_empty() {
            let c = self.contexts.get(id)?;
            if !language.is_empty() && Language::parse(language)? != c.language {
                return Err(AgentError::Invalid(format!("context {id} runs {}, not {language}", c.language.name())));
            }
            return Ok(c);
        }
        let lang = Language::parse(language)?;
        match self.contexts.find(&lang.default_id()) {
            Some(c) => Ok(c),
            None => self.make_context(lang.default_id(), lang, "", user).await,
        }
    }

    async fn make_context(
        self: &Arc<Self>,
        id: String,
        language: Language,
        cwd: &str,
        user: &str,
    ) -> Result<Arc<Context>, AgentError> {
        let _one = self.contexts.create.lock().await;
        if let Some(c) = self.contexts.find(&id) {
            return Ok(c);
        }
        let u = self.user(user)?;
        let cwd = if !cwd.is_empty() {
            cwd.to_string()
        } else if !self.cfg.workdir.is_empty() {
            self.cfg.workdir.clone()
        } else if std::path::Path::new(&u.home).is_dir() {
            u.home.clone()
        } else {
            "/".to_string()
        };
        let kernel = match language {
            Language::Python => Some(self.start_kernel(&id, &u, &cwd).await?),
            Language::Bash => None,
        };
        let handle = kernel.as_ref().map(Kernel::handle);
        let c = Arc::new(Context {
            id,
            language,
            cwd,
            user: u.name.clone(),
            kernel: tokio::sync::Mutex::new(kernel),
            runs: Default::default(),
            handle: Mutex::new(handle),
        });
        if let Err(e) = self.contexts.insert(c.clone()) {
            if let Some(k) = c.kernel.lock().await.take() {
                k.shutdown().await;
            }
            return Err(e);
        }
        Ok(c)
    }

    async fn start_kernel(&self, id: &str, u: &User, cwd: &str) -> Result<Kernel, AgentError> {
        let dir = crate::kernel::kernels_dir(&self.cfg.state_dir).join(id);
        Kernel::start(&self.reaper, &dir, u, std::path::Path::new(cwd), &self.env()).await
    }

    async fn run_python(
        &self,
        c: &Context,
        req: &RunCodeRequest,
        tx: &mpsc::Sender<Result<CodeEvent, Status>>,
    ) -> Result<(), AgentError> {
        let mut g = c.kernel.lock().await;
        if g.as_ref().is_none_or(|k| !k.is_alive()) {
            if let Some(dead) = g.take() {
                dead.shutdown().await;
            }
            let u = self.user(&c.user)?;
            let k = self.start_kernel(&c.id, &u, &c.cwd).await?;
            c.set_kernel(&mut g, k);
        }
        let Some(k) = g.as_mut() else { return Err(AgentError::Kernel("no kernel".into())) };
        let timeout = (req.timeout_ms > 0).then(|| Duration::from_millis(req.timeout_ms));
        let wrap = crate::kernel::env_wrappers(&req.env);
        // Setting and resetting variables is quick; a kernel that hangs there is replaced.
        let mut ok = true;
        if let Some((set, _)) = &wrap {
            ok = k.execute(set, true, Some(ENV_RUN_LIMIT), tx).await?;
        }
        if ok {
            ok = k.execute(&req.code, false, timeout, tx).await?;
        }
        if ok && let Some((_, reset)) = &wrap {
            ok = k.execute(reset, true, Some(ENV_RUN_LIMIT), tx).await?;
        }
        if ok {
            return Ok(());
        }
        // It did not stop when interrupted (or died): a fresh kernel takes its place.
        if let Some(old) = g.take() {
            old.shutdown().await;
        }
        let u = self.user(&c.user)?;
        let k = self.start_kernel(&c.id, &u, &c.cwd).await?;
        c.set_kernel(&mut g, k);
        Ok(())
    }

    async fn run_bash(
        self: &Arc<Self>,
        c: &Context,
        req: RunCodeRequest,
        tx: &mpsc::Sender<Result<CodeEvent, Status>>,
    ) -> Result<(), AgentError> {
        let n = c.runs.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        let mut s = self.session(&c.session(), &c.user).await?;
        // A run's variables hold for that run only (E2B's scoping); what the code itself
        // exports or `cd`s stays, as in any shell.
        let command = crate::contexts::scoped_env(&req.env, &req.code)?;
        // The context's directory on its first run; afterwards wherever its `cd`s left it.
        let exec = ExecRequest {
            session_id: c.session(),
            command,
            timeout_ms: req.timeout_ms,
            env: Default::default(),
            cwd: if n == 1 { c.cwd.clone() } else { String::new() },
            ..Default::default()
        };
        let send = |kind| tx.send(Ok(CodeEvent { kind: Some(kind) }));
        let _ = send(code_event::Kind::ExecutionCount(n)).await;
        let mut out = s
            .exec_stream(exec)
            .await
            .map_err(|e| AgentError::Session(c.session(), e.message().to_string()))?
            .into_inner();
        while let Some(chunk) = out.next().await {
            let chunk = chunk.map_err(|e| AgentError::Session(c.session(), e.message().to_string()))?;
            match chunk.kind {
                Some(exec_chunk::Kind::Output(o)) => {
                    let output = CodeOutput {
                        stderr: o.stream == OutputStream::Stderr as i32,
                        text: String::from_utf8_lossy(&o.data).into_owned(),
                        at_ms: crate::now_ms(),
                    };
                    let _ = send(code_event::Kind::Output(output)).await;
                }
                Some(exec_chunk::Kind::Exit(x)) => {
                    if x.timed_out {
                        let _ = tx
                            .send(Err(Status::deadline_exceeded("the code ran past its timeout and was stopped")))
                            .await;
                    } else if x.exit_code != 0 {
                        let e = CodeError {
                            name: "CommandExitError".into(),
                            value: format!("exit status {}", x.exit_code),
                            traceback: String::new(),
                        };
                        let _ = send(code_event::Kind::Error(e)).await;
                    }
                }
                None => {}
            }
        }
        Ok(())
    }

    /// A client of session `sid`'s chronus, started as `user` on first use.
    async fn session(self: &Arc<Self>, sid: &str, user: &str) -> Result<RuntimeClient<Channel>, AgentError> {
        Ok(crate::runtime_client(self.session_channel(sid, user).await?))
    }

    /// The channel to session `sid`'s chronus, started as `user` on first use.
    async fn session_channel(self: &Arc<Self>, sid: &str, user: &str) -> Result<Channel, AgentError> {
        let sid = if sid.is_empty() { "default" } else { sid };
        check_id("session id", sid)?;
        let slot = self.sessions().entry(sid.to_string()).or_default().clone();
        let s = slot.get_or_try_init(|| self.start_chronus(sid, user, slot.clone())).await?;
        Ok(s.channel.clone())
    }

    async fn start_chronus(self: &Arc<Self>, sid: &str, user: &str, slot: Slot) -> Result<Session, AgentError> {
        let u = self.user(user)?;
        let dir = self.cfg.state_dir.join("sessions").join(sid);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| AgentError::fs("mkdir", &dir, e))?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| AgentError::fs("chmod", &dir, e))?;
        let as_other = rustix::process::geteuid().as_raw() != u.uid || rustix::process::getegid().as_raw() != u.gid;
        if as_other {
            std::os::unix::fs::chown(&dir, Some(u.uid), Some(u.gid)).map_err(|e| AgentError::fs("chown", &dir, e))?;
        }
        let sock = dir.join("chronus.sock");
        let mut c = std::process::Command::new(&self.exe);
        c.arg("chronus")
            .arg("--socket")
            .arg(&sock)
            .arg("--dir")
            .arg(&dir)
            .arg("--session-bytes")
            .arg(self.cfg.session_bytes.to_string());
        passwd::user_env(&mut c, &u, &self.env());
        c.env(crate::chronus::WORKDIR_ENV, &self.cfg.workdir)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .process_group(0);
        passwd::run_as(&mut c, &u, None);
        let spawn_err = |e| AgentError::Spawn { what: format!("chronus for session {sid}"), source: e };
        let mut child = self.reaper.spawn(&mut c).map_err(spawn_err)?;
        let pid = child.id();
        let exit = self.reaper.wait_for(pid);
        // When chronus dies, forget the session so the next call starts a fresh one.
        let me = self.clone();
        let sid_owned = sid.to_string();
        tokio::spawn(async move {
            let _ = exit.await;
            let mut g = me.sessions();
            if g.get(&sid_owned).is_some_and(|s| Arc::ptr_eq(s, &slot)) {
                g.remove(&sid_owned);
            }
        });
        let Some(out) = child.stdout.take() else {
            return Err(spawn_err(std::io::Error::other("no stdout")));
        };
        let out = tokio::net::unix::pipe::Receiver::from_owned_fd(out.into()).map_err(spawn_err)?;
        let mut line = String::new();
        let ready =
            tokio::time::timeout(Duration::from_secs(10), tokio::io::BufReader::new(out).read_line(&mut line)).await;
        if !matches!(ready, Ok(Ok(_))) || line.trim() != "ready" {
            let _ = kill_tree(pid as i32, true);
            return Err(AgentError::Session(
                sid.into(),
                "its shell host did not start (the sandbox may be at its process or memory limit)".into(),
            ));
        }
        let channel = crate::unix_channel(sock).await.map_err(|e| AgentError::Session(sid.into(), e.to_string()))?;
        Ok(Session { pid, channel })
    }

    /// Kills a session's whole tree; false when there was none.
    pub async fn close(&self, sid: &str) -> bool {
        let sid = if sid.is_empty() { "default" } else { sid };
        let Some(slot) = self.sessions().remove(sid) else {
            return false;
        };
        if let Some(s) = slot.get() {
            let pid = s.pid as i32;
            // Return once the session's processes are reaped: until then they hold pids of the
            // sandbox's limit (a fork bomb's thousand zombies would fail the next session).
            let _ = tokio::task::spawn_blocking(move || wait_gone(&kill_tree(pid, true), Duration::from_secs(5))).await;
        }
        let _ = std::fs::remove_dir_all(self.cfg.state_dir.join("sessions").join(sid));
        true
    }
}

fn fwd(e: AgentError) -> Status {
    e.into()
}

#[derive(Debug, Clone)]
pub struct AetherService(pub Arc<Aether>);

#[tonic::async_trait]
impl Runtime for AetherService {
    async fn exec(&self, r: Request<ExecRequest>) -> Result<Response<ExecResult>, Status> {
        let req = r.into_inner();
        let mut c = self.0.session(&req.session_id, &req.user).await.map_err(fwd)?;
        c.exec(req).await
    }

    type ExecStreamStream = BoxStream<ExecChunk>;
    async fn exec_stream(&self, r: Request<ExecRequest>) -> Result<Response<Self::ExecStreamStream>, Status> {
        let req = r.into_inner();
        let mut c = self.0.session(&req.session_id, &req.user).await.map_err(fwd)?;
        let s = c.exec_stream(req).await?.into_inner();
        Ok(Response::new(Box::pin(s)))
    }

    async fn get_output(&self, r: Request<GetOutputRequest>) -> Result<Response<GetOutputResponse>, Status> {
        let req = r.into_inner();
        let mut c = self.0.session(&req.session_id, "").await.map_err(fwd)?;
        c.get_output(req).await
    }

    async fn close_session(&self, r: Request<CloseSessionRequest>) -> Result<Response<CloseSessionResponse>, Status> {
        let existed = self.0.close(&r.into_inner().session_id).await;
        Ok(Response::new(CloseSessionResponse { existed }))
    }

    type ReadFileStream = BoxStream<FileChunk>;
    async fn read_file(&self, r: Request<ReadFileRequest>) -> Result<Response<Self::ReadFileStream>, Status> {
        let req = r.into_inner();
        let mut c = self.0.session(&req.session_id, &req.user).await.map_err(fwd)?;
        let s = c.read_file(req).await?.into_inner();
        Ok(Response::new(Box::pin(s)))
    }

    async fn write_file(&self, r: Request<Streaming<WriteFileRequest>>) -> Result<Response<WriteFileResponse>, Status> {
        let mut incoming = r.into_inner();
        let Some(first) = incoming.message().await? else {
            return Err(AgentError::Invalid("empty write stream".into()).into());
        };
        let ch = self.0.session_channel(&first.session_id, &first.user).await.map_err(fwd)?;
        // An error on the caller's stream resets the forwarded one with an error, so chronus
        // never takes a broken upload for a complete file.
        crate::upload_forward(ch, first, incoming).await
    }

    async fn list_dir(&self, r: Request<ListDirRequest>) -> Result<Response<ListDirResponse>, Status> {
        let req = r.into_inner();
        let mut c = self.0.session(&req.session_id, &req.user).await.map_err(fwd)?;
        c.list_dir(req).await
    }

    async fn stat(&self, r: Request<StatRequest>) -> Result<Response<FileInfo>, Status> {
        let req = r.into_inner();
        let mut c = self.0.session(&req.session_id, &req.user).await.map_err(fwd)?;
        c.stat(req).await
    }

    type WatchDirStream = BoxStream<WatchDirEvent>;
    async fn watch_dir(&self, r: Request<WatchDirRequest>) -> Result<Response<Self::WatchDirStream>, Status> {
        let req = r.into_inner();
        let mut c = self.0.session(&req.session_id, &req.user).await.map_err(fwd)?;
        let s = c.watch_dir(req).await?.into_inner();
        Ok(Response::new(Box::pin(s)))
    }

    async fn create_watcher(&self, r: Request<WatchDirRequest>) -> Result<Response<CreateWatcherResponse>, Status> {
        let req = r.into_inner();
        let mut c = self.0.session(&req.session_id, &req.user).await.map_err(fwd)?;
        c.create_watcher(req).await
    }

    async fn get_watcher_events(
        &self,
        r: Request<GetWatcherEventsRequest>,
    ) -> Result<Response<GetWatcherEventsResponse>, Status> {
        let req = r.into_inner();
        let mut c = self.0.session(&req.session_id, &req.user).await.map_err(fwd)?;
        c.get_watcher_events(req).await
    }

    async fn remove_watcher(
        &self,
        r: Request<RemoveWatcherRequest>,
    ) -> Result<Response<RemoveWatcherResponse>, Status> {
        let req = r.into_inner();
        let mut c = self.0.session(&req.session_id, &req.user).await.map_err(fwd)?;
        c.remove_watcher(req).await
    }

    async fn make_dir(&self, r: Request<MakeDirRequest>) -> Result<Response<MakeDirResponse>, Status> {
        let req = r.into_inner();
        let mut c = self.0.session(&req.session_id, &req.user).await.map_err(fwd)?;
        c.make_dir(req).await
    }

    async fn remove(&self, r: Request<RemoveRequest>) -> Result<Response<RemoveResponse>, Status> {
        let req = r.into_inner();
        let mut c = self.0.session(&req.session_id, &req.user).await.map_err(fwd)?;
        c.remove(req).await
    }

    async fn r#move(&self, r: Request<MoveRequest>) -> Result<Response<MoveResponse>, Status> {
        let req = r.into_inner();
        let mut c = self.0.session(&req.session_id, &req.user).await.map_err(fwd)?;
        c.r#move(req).await
    }

    async fn http_request(&self, r: Request<HttpRequestRequest>) -> Result<Response<HttpRequestResponse>, Status> {
        let req = r.into_inner();
        let mut c = self.0.session(&req.session_id, &req.user).await.map_err(fwd)?;
        c.http_request(req).await
    }

    async fn start_process(&self, r: Request<StartProcessRequest>) -> Result<Response<StartProcessResponse>, Status> {
        let req = r.into_inner();
        let user = self.0.user(&req.user).map_err(fwd)?;
        let mut req = req;
        if req.cwd.is_empty() {
            req.cwd = self.0.cfg.workdir.clone();
        }
        let pid = self.0.procs.start(&self.0.reaper, req, &user, &self.0.env()).map_err(fwd)?;
        Ok(Response::new(StartProcessResponse { pid }))
    }

    type ConnectProcessStream = BoxStream<ProcessEvent>;
    async fn connect_process(
        &self,
        r: Request<ConnectProcessRequest>,
    ) -> Result<Response<Self::ConnectProcessStream>, Status> {
        let req = r.into_inner();
        let p = self.0.procs.find(req.process).map_err(fwd)?;
        Ok(Response::new(p.connect(req.stdout_offset, req.stderr_offset)))
    }

    async fn send_input(&self, r: Request<SendInputRequest>) -> Result<Response<SendInputResponse>, Status> {
        let req = r.into_inner();
        let p = self.0.procs.find(req.process).map_err(fwd)?;
        p.send_input(&req.data, req.eof).await.map_err(fwd)?;
        Ok(Response::new(SendInputResponse {}))
    }

    async fn signal_process(
        &self,
        r: Request<SignalProcessRequest>,
    ) -> Result<Response<SignalProcessResponse>, Status> {
        let req = r.into_inner();
        let p = self.0.procs.find(req.process).map_err(fwd)?;
        p.signal(req.signal).map_err(fwd)?;
        Ok(Response::new(SignalProcessResponse {}))
    }

    async fn list_processes(
        &self,
        _r: Request<ListProcessesRequest>,
    ) -> Result<Response<ListProcessesResponse>, Status> {
        Ok(Response::new(ListProcessesResponse { processes: self.0.procs.list() }))
    }

    async fn resize_process(
        &self,
        r: Request<ResizeProcessRequest>,
    ) -> Result<Response<ResizeProcessResponse>, Status> {
        let req = r.into_inner();
        let p = self.0.procs.find(req.process).map_err(fwd)?;
        p.resize(&req.size.unwrap_or_default()).map_err(fwd)?;
        Ok(Response::new(ResizeProcessResponse {}))
    }

    type RunCodeStream = BoxStream<CodeEvent>;
    async fn run_code(&self, r: Request<RunCodeRequest>) -> Result<Response<Self::RunCodeStream>, Status> {
        let req = r.into_inner();
        let (tx, rx) = mpsc::channel(64);
        let me = self.0.clone();
        // The stream starts at once: a first run may wait seconds for its kernel to start.
        tokio::spawn(async move {
            let r = match me.context(&req.context_id, &req.language, &req.user).await {
                Err(e) => Err(e),
                Ok(c) => match c.language {
                    Language::Python => me.run_python(&c, &req, &tx).await,
                    Language::Bash => me.run_bash(&c, req, &tx).await,
                },
            };
            if let Err(e) = r {
                let _ = tx.send(Err(e.into())).await;
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn create_code_context(&self, r: Request<CreateCodeContextRequest>) -> Result<Response<CodeContext>, Status> {
        let req = r.into_inner();
        let lang = Language::parse(&req.language).map_err(fwd)?;
        let c = self.0.make_context(Contexts::new_id(), lang, &req.cwd, &req.user).await.map_err(fwd)?;
        Ok(Response::new(c.info()))
    }

    async fn list_code_contexts(
        &self,
        _r: Request<ListCodeContextsRequest>,
    ) -> Result<Response<ListCodeContextsResponse>, Status> {
        Ok(Response::new(ListCodeContextsResponse { contexts: self.0.contexts.list() }))
    }

    async fn restart_code_context(&self, r: Request<CodeContextRequest>) -> Result<Response<CodeContext>, Status> {
        let c = self.0.contexts.get(&r.into_inner().context_id).map_err(fwd)?;
        match c.language {
            Language::Python => {
                // A run in progress holds the kernel: kill it first, so the run ends.
                c.kill_kernel().await;
                let mut g = c.kernel.lock().await;
                if let Some(old) = g.take() {
                    old.shutdown().await;
                }
                let u = self.0.user(&c.user).map_err(fwd)?;
                let k = self.0.start_kernel(&c.id, &u, &c.cwd).await.map_err(fwd)?;
                c.set_kernel(&mut g, k);
            }
            Language::Bash => {
                self.0.close(&c.session()).await;
                c.runs.store(0, std::sync::atomic::Ordering::Relaxed);
            }
        }
        Ok(Response::new(c.info()))
    }

    async fn remove_code_context(
        &self,
        r: Request<CodeContextRequest>,
    ) -> Result<Response<RemoveCodeContextResponse>, Status> {
        let id = r.into_inner().context_id;
        let c = self
            .0
            .contexts
            .remove(&id)
            .ok_or_else(|| fwd(AgentError::UnknownContext(id.chars().take(64).collect())))?;
        match c.language {
            Language::Python => {
                c.kill_kernel().await;
                if let Some(k) = c.kernel.lock().await.take() {
                    k.shutdown().await;
                }
            }
            Language::Bash => {
                self.0.close(&c.session()).await;
            }
        }
        Ok(Response::new(RemoveCodeContextResponse {}))
    }

    type WatchStream = BoxStream<Heartbeat>;
    async fn watch(&self, _r: Request<WatchRequest>) -> Result<Response<Self::WatchStream>, Status> {
        let me = self.0.clone();
        let (tx, rx) = mpsc::channel(2);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            let mut seq = 0u64;
            loop {
                tick.tick().await;
                seq += 1;
                let hb = Heartbeat {
                    uptime_ms: me.started.elapsed().as_millis() as u64,
                    sessions: me.sessions().len() as u32,
                    processes: me.procs.running() as u32,
                    seq,
                };
                if tx.send(Ok(hb)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// Writes the id file whole (a temp file renamed over it), world-readable, its directory made.
fn write_identity(path: &std::path::Path, id: &str) -> Result<(), AgentError> {
    let dir = path.parent().unwrap_or(std::path::Path::new("/"));
    std::fs::create_dir_all(dir).map_err(|e| AgentError::fs("mkdir", dir, e))?;
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, format!("{id}\n")).map_err(|e| AgentError::fs("write", &tmp, e))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o444))
        .map_err(|e| AgentError::fs("chmod", &tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| AgentError::fs("rename", path, e))
}

/// The edge's own calls (`AgentControl`); `vm`: aether is PID 1 of a VM (the guest's kernel
/// is the sandbox's own).
#[derive(Debug)]
pub struct ControlService {
    pub aether: Arc<Aether>,
    pub vm: bool,
}

#[tonic::async_trait]
impl opendsec_proto::v1::agent_control_server::AgentControl for ControlService {
    async fn set_identity(&self, r: Request<SetIdentityRequest>) -> Result<Response<SetIdentityResponse>, Status> {
        let r = r.into_inner();
        if !r.hostname.is_empty() {
            if !crate::restore::valid_hostname(&r.hostname) {
                return Err(fwd(AgentError::Invalid(format!(
                    "bad hostname {:?}",
                    r.hostname.chars().take(64).collect::<String>()
                ))));
            }
            // The edge sets the hostname itself (that needs a capability the sandbox's root
            // does not have); /etc/hosts names it, as at creation.
            crate::restore::write_hosts(&r.hostname).map_err(fwd)?;
        }
        self.aether.set_identity(&r.sandbox_id, &r.env).map_err(fwd)?;
        Ok(Response::new(SetIdentityResponse {}))
    }

    async fn post_restore(&self, r: Request<PostRestoreRequest>) -> Result<Response<PostRestoreResponse>, Status> {
        if !self.vm {
            return Err(fwd(AgentError::Unsupported("PostRestore outside a VM")));
        }
        let r = r.into_inner();
        crate::restore::post_restore(&r.hostname, &r.machine_id, &r.random_seed).map_err(fwd)?;
        Ok(Response::new(PostRestoreResponse {}))
    }
}

/// Where aether serves.
#[derive(Debug)]
pub enum Listen {
    /// Bind a new socket at this path.
    Path(PathBuf),
    /// A listening unix socket inherited at this fd (PID 1 of a container sandbox: the edge
    /// bound it on the host, where nothing inside the sandbox can reach or replace it).
    Fd(i32),
    /// A virtio-serial port (PID 1 of a VM: `vm-init`), one connection at a time.
    Serial(PathBuf),
}

/// `opendsec-agent aether (--socket PATH | --listen-fd N) [--state-dir DIR] [--passwd PATH]`.
pub async fn main(listen: Listen, cfg: Config) -> std::io::Result<()> {
    let reaper = Reaper::start();
    let aether = Aether::new(cfg, reaper)?;
    // A sandbox whose default user is not in its image fails at start, with the reason in
    // the edge's console log, instead of failing every call later.
    aether.user("").map_err(|e| std::io::Error::other(e.to_string()))?;
    // As a container runtime does with WORKDIR: made when the image lacks it.
    if !aether.cfg.workdir.is_empty() {
        std::fs::create_dir_all(&aether.cfg.workdir)?;
    }
    let aether_log = aether.cfg.state_dir.join("aether.log");
    let vm = matches!(listen, Listen::Serial(_));
    let control = opendsec_proto::v1::agent_control_server::AgentControlServer::new(ControlService {
        aether: aether.clone(),
        vm,
    });
    let listener = match listen {
        Listen::Serial(port) => {
            return crate::serve_incoming(crate::serial::incoming(port), AetherService(aether), Some(control)).await;
        }
        Listen::Path(p) => crate::bind_unix(&p)?,
        Listen::Fd(fd) => {
            let l = crate::inherited_listener(fd)?;
            // PID 1 of a sandbox: nothing inside may open our fds through /proc/1/fd or trace
            // us (the sandbox's root has the same uid and no CAP_SYS_PTRACE), and stdout and
            // stderr (the edge's console log, a host file) are left: from here on the agent
            // writes to a log on the sandbox's own disk, bounded by it.
            crate::seal_pid1(&aether_log)?;
            l
        }
    };
    crate::serve_unix_with(listener, AetherService(aether), Some(control)).await
}
