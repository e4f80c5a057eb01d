//! aether started as a child process on a temp unix socket, driven over gRPC.

use std::os::unix::fs::PermissionsExt;
use std::process::{Child, Command};
use std::time::Duration;

use opendsec_agent::unix_client;
use opendsec_proto::v1::runtime_client::RuntimeClient;
use opendsec_proto::v1::*;
use tokio_stream::StreamExt;
use tonic::transport::Channel;

struct Agent {
    child: Child,
    dir: tempfile::TempDir,
}

impl Drop for Agent {
    fn drop(&mut self) {
        // The whole tree: sessions' chronus and their shells too.
        opendsec_agent::reaper::kill_tree(self.child.id() as i32, true);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn agent() -> (Agent, RuntimeClient<Channel>) {
    agent_with(&[]).await
}

async fn agent_with(extra: &[&str]) -> (Agent, RuntimeClient<Channel>) {
    let dir = tempfile::tempdir().unwrap();
    // Session users other than root must traverse to their own state directory.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let sock = dir.path().join("aether.sock");
    let child = Command::new(env!("CARGO_BIN_EXE_opendsec-agent"))
        .arg("aether")
        .arg("--socket")
        .arg(&sock)
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .args(extra)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // The socket's file appears at bind, a moment before the agent listens on it: connect
    // until it answers.
    let mut c = None;
    for _ in 0..500 {
        if sock.exists()
            && let Ok(client) = unix_client(sock.clone()).await
        {
            c = Some(client);
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let c = c.expect("the agent listens on its socket within 5 s");
    (Agent { child, dir }, c)
}

fn req(session: &str, cmd: &str) -> ExecRequest {
    ExecRequest { session_id: session.into(), command: cmd.into(), ..Default::default() }
}

async fn run(c: &mut RuntimeClient<Channel>, session: &str, cmd: &str) -> ExecResult {
    c.exec(req(session, cmd)).await.unwrap().into_inner()
}

fn out(r: &ExecResult) -> String {
    String::from_utf8_lossy(&r.stdout).trim_end().to_string()
}

#[tokio::test]
async fn stateful_session_and_isolation() {
    let (_a, mut c) = agent().await;
    run(&mut c, "s1", "cd /tmp && export FOO=bar && f() { echo \"f:$1\"; }").await;
    let r = run(&mut c, "s1", "pwd; echo $FOO; f x").await;
    assert_eq!(out(&r), "/tmp\nbar\nf:x");
    assert_eq!(r.cwd, "/tmp");
    let r = run(&mut c, "s2", "echo \"[$FOO]\"; type f >/dev/null 2>&1 || echo nof").await;
    assert_eq!(out(&r), "[]\nnof");
    // Exit codes, stderr, syntax errors do not end the shell.
    let r = run(&mut c, "s1", "echo oops >&2; (exit 7)").await;
    assert_eq!((r.exit_code, r.stderr.as_slice()), (7, &b"oops\n"[..]));
    let r = run(&mut c, "s1", "if then fi").await;
    assert_ne!(r.exit_code, 0);
    assert_eq!(out(&run(&mut c, "s1", "echo $FOO").await), "bar");
    // Per-request env and cwd.
    let mut q = req("s1", "echo $X; pwd");
    q.env.insert("X".into(), "it's".into());
    q.cwd = "/".into();
    let r = c.exec(q).await.unwrap().into_inner();
    assert_eq!(out(&r), "it's\n/");
    // `exit` ends the shell; the session goes on with a fresh one.
    let r = run(&mut c, "s1", "exit 3").await;
    assert_eq!(r.exit_code, 3);
    assert_eq!(run(&mut c, "s1", "echo hi").await.stdout, b"hi\n");
}

#[tokio::test]
async fn request_id_dedupe_and_timeout() {
    let (a, mut c) = agent().await;
    let f = a.dir.path().join("count");
    let mut q = req("d", &format!("echo x >> {}; echo done", f.display()));
    q.request_id = "once".into();
    let r1 = c.exec(q.clone()).await.unwrap().into_inner();
    let r2 = c.exec(q).await.unwrap().into_inner();
    assert_eq!((r1.stdout.clone(), r2.stdout), (b"done\n".to_vec(), b"done\n".to_vec()));
    assert_eq!(std::fs::read_to_string(&f).unwrap(), "x\n");
    let mut q = req("d", "echo start; sleep 30");
    q.timeout_ms = 300;
    let r = c.exec(q).await.unwrap().into_inner();
    assert!(r.timed_out);
    assert_eq!(out(&r), "start");
    assert_ne!(r.exit_code, 0);
    assert_eq!(out(&run(&mut c, "d", "echo after").await), "after");
    // A builtin busy loop: the shell itself is replaced.
    let mut q = req("d", "while :; do :; done");
    q.timeout_ms = 200;
    assert!(c.exec(q).await.unwrap().into_inner().timed_out);
    assert_eq!(out(&run(&mut c, "d", "echo alive").await), "alive");
}

#[tokio::test]
async fn output_limits_count_dropped_bytes() {
    let (_a, mut c) = agent().await;
    let mut q = req("o", "head -c 52428800 /dev/zero; head -c 100 /dev/zero >&2; echo end");
    q.limits = Some(OutputLimits { stdout_max_bytes: 1 << 20, stderr_max_bytes: 10 });
    let r = c.exec(q).await.unwrap().into_inner();
    assert_eq!(r.exit_code, 0);
    assert_eq!(r.stdout.len(), 1 << 20);
    assert_eq!(r.stdout_dropped_bytes, 52428800 + 4 - (1 << 20));
    assert_eq!((r.stderr.len(), r.stderr_dropped_bytes), (10, 90));
    // A limit above what one Exec result carries is capped (the rest counted as dropped); a
    // huge GetOutput window is capped the same way.
    let mut q = req("o", "head -c 41943040 /dev/zero");
    q.limits = Some(OutputLimits { stdout_max_bytes: 1 << 40, stderr_max_bytes: 0 });
    let r = c.exec(q).await.unwrap().into_inner();
    let cap = opendsec_agent::chronus::RESULT_MAX;
    assert_eq!((r.stdout.len() as u64, r.stdout_dropped_bytes), (cap, 41943040 - cap));
    let g = GetOutputRequest {
        session_id: "o".into(),
        request_id: r.request_id,
        max_bytes: u64::MAX,
        ..Default::default()
    };
    assert_eq!(c.get_output(g).await.unwrap().into_inner().stdout.len() as u64, cap);
}

async fn collect(
    s: &mut tonic::Streaming<ExecChunk>,
    stop_after: Option<usize>,
) -> (Vec<u8>, Vec<u8>, Option<ExecExit>) {
    let (mut o, mut e, mut n) = (vec![], vec![], 0);
    while let Some(m) = s.next().await {
        match m.unwrap().kind {
            Some(exec_chunk::Kind::Output(d)) => {
                let buf = if d.stream == OutputStream::Stdout as i32 { &mut o } else { &mut e };
                assert_eq!(d.offset, buf.len() as u64);
                buf.extend_from_slice(&d.data);
                n += 1;
                if stop_after.is_some_and(|s| n >= s) {
                    return (o, e, None);
                }
            }
            Some(exec_chunk::Kind::Exit(x)) => return (o, e, Some(x)),
            None => {}
        }
    }
    (o, e, None)
}

#[tokio::test]
async fn exec_stream_resumes_byte_exact_and_get_output() {
    let (_a, mut c) = agent().await;
    let cmd = "for i in $(seq 1 3000); do echo \"line $i\"; echo \"err $i\" >&2; done";
    let mut q = req("st", cmd);
    q.request_id = "s1".into();
    let mut s = c.exec_stream(q.clone()).await.unwrap().into_inner();
    let (o1, e1, _) = collect(&mut s, Some(3)).await;
    drop(s);
    q.stdout_offset = o1.len() as u64;
    q.stderr_offset = e1.len() as u64;
    let mut s = c.exec_stream(q).await.unwrap().into_inner();
    let (o2, e2, exit) = {
        let (mut o, mut e, mut x) = (vec![], vec![], None);
        while let Some(m) = s.next().await {
            match m.unwrap().kind {
                Some(exec_chunk::Kind::Output(d)) => {
                    let (buf, base) =
                        if d.stream == OutputStream::Stdout as i32 { (&mut o, o1.len()) } else { (&mut e, e1.len()) };
                    assert_eq!(d.offset, (base + buf.len()) as u64);
                    buf.extend_from_slice(&d.data);
                }
                Some(exec_chunk::Kind::Exit(ex)) => x = Some(ex),
                None => {}
            }
        }
        (o, e, x)
    };
    assert_eq!(exit.unwrap().exit_code, 0);
    let full_o: Vec<u8> = [o1, o2].concat();
    let full_e: Vec<u8> = [e1, e2].concat();
    let want_o: String = (1..=3000).map(|i| format!("line {i}\n")).collect();
    let want_e: String = (1..=3000).map(|i| format!("err {i}\n")).collect();
    assert_eq!(full_o, want_o.as_bytes());
    assert_eq!(full_e, want_e.as_bytes());

    // Disconnect right away, fetch later by offset.
    let mut q = req("st", "sleep 0.3; echo later");
    q.request_id = "g1".into();
    drop(c.exec_stream(q).await.unwrap());
    let mut g = GetOutputRequest { session_id: "st".into(), request_id: "g1".into(), ..Default::default() };
    let mut got = None;
    for _ in 0..200 {
        let r = c.get_output(g.clone()).await.unwrap().into_inner();
        if r.finished {
            got = Some(r);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let r = got.unwrap();
    assert_eq!((r.stdout.as_slice(), r.stdout_size), (&b"later\n"[..], 6));
    g.stdout_offset = 2;
    assert_eq!(c.get_output(g).await.unwrap().into_inner().stdout, b"ter\n");
    let missing = GetOutputRequest { session_id: "st".into(), request_id: "nope".into(), ..Default::default() };
    assert_eq!(c.get_output(missing).await.unwrap_err().code(), tonic::Code::NotFound);
}

fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !s.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'),
        Err(_) => false,
    }
}

#[tokio::test]
async fn closing_a_session_kills_its_processes() {
    let (_a, mut c) = agent().await;
    let r = run(&mut c, "bg", "sleep 1000 >/dev/null 2>&1 & echo $!").await;
    let pid: i32 = out(&r).parse().unwrap();
    // A double-forked, setsid'd daemon stays in the tree too (chronus is a subreaper).
    let r = run(&mut c, "bg", "(setsid sleep 1001 >/dev/null 2>&1 & echo $!) ").await;
    let pid2: i32 = out(&r).parse().unwrap();
    assert!(alive(pid) && alive(pid2));
    let closed = c
        .close_session(CloseSessionRequest { session_id: "bg".into(), ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    assert!(closed.existed);
    for _ in 0..200 {
        if !alive(pid) && !alive(pid2) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(!alive(pid) && !alive(pid2));
    // The session comes back fresh.
    assert_eq!(out(&run(&mut c, "bg", "echo new").await), "new");
}

#[tokio::test]
async fn session_as_another_user() {
    assert!(rustix::process::geteuid().is_root(), "this test needs root (CI runs as root)");
    // An image's own passwd and group files: nobody is a member of two extra groups.
    let etc = tempfile::tempdir().unwrap();
    std::fs::write(
        etc.path().join("passwd"),
        "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/sh\n",
    )
    .unwrap();
    std::fs::write(etc.path().join("group"), "root:x:0:\nwheel:x:4242:nobody\nstaff:x:4343:alice,nobody\n").unwrap();
    let passwd = etc.path().join("passwd");
    let (_a, mut c) = agent_with(&["--passwd", passwd.to_str().unwrap()]).await;
    let mut q = req("u", "id -u; id -g; id -G");
    q.user = "nobody".into();
    let r = c.exec(q).await.unwrap().into_inner();
    let lines: Vec<String> = out(&r).lines().map(String::from).collect();
    assert_eq!(lines[0], "65534");
    assert!(!lines[2].split(' ').any(|g| g == "0"), "{lines:?}");
    assert_eq!(lines[2], "65534 4242 4343", "{lines:?}");
    assert_eq!(out(&run(&mut c, "r", "id -u").await), "0");
    // Files as that user.
    let err = c
        .write_file(tokio_stream::iter(vec![WriteFileRequest {
            session_id: "u".into(),
            path: "/root/x".into(),
            data: b"x".to_vec(),
            finish: true,
            ..Default::default()
        }]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::PermissionDenied);
    let mut q = req("bad", "true");
    q.user = "no-such-user".into();
    assert_eq!(c.exec(q).await.unwrap_err().code(), tonic::Code::InvalidArgument);
}

#[tokio::test]
async fn file_calls() {
    let (a, mut c) = agent().await;
    let base = a.dir.path().join("files");
    std::fs::create_dir(&base).unwrap();
    run(&mut c, "f", &format!("cd {}", base.display())).await;
    let big: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    let msgs: Vec<WriteFileRequest> = big
        .chunks(100_000)
        .enumerate()
        .map(|(i, d)| WriteFileRequest {
            session_id: if i == 0 { "f".into() } else { String::new() },
            path: if i == 0 { "sub/big.bin".into() } else { String::new() },
            make_parents: i == 0,
            data: d.to_vec(),
            finish: i == 2,
            ..Default::default()
        })
        .collect();
    let w = c.write_file(tokio_stream::iter(msgs)).await.unwrap().into_inner();
    assert_eq!(w.bytes_written, 300_000);
    assert_eq!(std::fs::read(base.join("sub/big.bin")).unwrap(), big);
    // An upload that ends without `finish` writes nothing: not the new file, not over an old one.
    let unfinished = |path: &str| WriteFileRequest {
        session_id: "f".into(),
        path: path.into(),
        data: b"partial".to_vec(),
        ..Default::default()
    };
    let e = c.write_file(tokio_stream::iter(vec![unfinished("sub/new.bin")])).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(!base.join("sub/new.bin").exists());
    c.write_file(tokio_stream::iter(vec![unfinished("sub/big.bin")])).await.unwrap_err();
    assert_eq!(std::fs::read(base.join("sub/big.bin")).unwrap(), big);
    // Overwriting writes in place: the file keeps its mode and inode; nothing is left staged.
    std::fs::write(base.join("keep.txt"), b"old").unwrap();
    std::fs::set_permissions(base.join("keep.txt"), std::fs::Permissions::from_mode(0o600)).unwrap();
    let ino = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(base.join("keep.txt")).unwrap());
    let w = WriteFileRequest { finish: true, data: b"new".to_vec(), ..unfinished("keep.txt") };
    c.write_file(tokio_stream::iter(vec![w])).await.unwrap();
    let md = std::fs::metadata(base.join("keep.txt")).unwrap();
    assert_eq!(
        (std::fs::read(base.join("keep.txt")).unwrap(), md.permissions().mode() & 0o777),
        (b"new".to_vec(), 0o600)
    );
    assert_eq!(std::os::unix::fs::MetadataExt::ino(&md), ino);
    let staged = std::fs::read_dir(a.dir.path().join("state/sessions/f")).unwrap();
    assert!(staged.flatten().all(|e| !e.file_name().to_string_lossy().starts_with("upload-")));
    let mut s = c
        .read_file(ReadFileRequest {
            session_id: "f".into(),
            path: "sub/big.bin".into(),
            offset: 10,
            length: 200_000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut got = vec![];
    while let Some(ch) = s.next().await {
        got.extend(ch.unwrap().data);
    }
    assert_eq!(got, big[10..200_010]);
    c.make_dir(MakeDirRequest { session_id: "f".into(), path: "d1/d2".into(), parents: true, ..Default::default() })
        .await
        .unwrap();
    c.r#move(MoveRequest {
        session_id: "f".into(),
        from: "sub/big.bin".into(),
        to: "d1/moved".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    let l = c
        .list_dir(ListDirRequest { session_id: "f".into(), path: "d1".into(), ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    let names: Vec<_> = l.entries.iter().map(|e| (e.name.as_str(), e.r#type)).collect();
    assert_eq!(names, [("d2", FileType::Dir as i32), ("moved", FileType::File as i32)]);
    let st = c
        .stat(StatRequest { session_id: "f".into(), path: "d1/moved".into(), ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((st.size, st.path), (300_000, base.join("d1/moved").display().to_string()));
    // `..` resolves against the session's directory (the container root is the boundary).
    let st = c
        .stat(StatRequest { session_id: "f".into(), path: "../files/d1".into(), ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.r#type, FileType::Dir as i32);
    // Clear errors: missing files, special files, non-empty directories, empty paths.
    let e =
        c.stat(StatRequest { session_id: "f".into(), path: "nope".into(), ..Default::default() }).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);
    assert!(e.message().contains("nope"), "{}", e.message());
    let e = c
        .read_file(ReadFileRequest { session_id: "f".into(), path: "/dev/zero".into(), ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    run(&mut c, "f", "mkfifo ff").await;
    let e = c
        .write_file(tokio_stream::iter(vec![WriteFileRequest {
            session_id: "f".into(),
            path: "ff".into(),
            data: b"x".to_vec(),
            finish: true,
            ..Default::default()
        }]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    let e =
        c.remove(RemoveRequest { session_id: "f".into(), path: "d1".into(), ..Default::default() }).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    c.remove(RemoveRequest { session_id: "f".into(), path: "d1".into(), recursive: true, ..Default::default() })
        .await
        .unwrap();
    assert!(!base.join("d1").exists());
    let e =
        c.stat(StatRequest { session_id: "f".into(), path: String::new(), ..Default::default() }).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
}

/// A server on 127.0.0.1 that answers one connection with `answer` once it has read the
/// request head, then keeps the connection open (a client that waits for the server to close
/// hangs); returns its port and the request it got.
async fn serve_once(answer: &'static [u8]) -> (u16, tokio::sync::oneshot::Receiver<Vec<u8>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let mut buf = vec![0u8; 4096];
        let mut got = vec![];
        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = s.read(&mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        s.write_all(answer).await.unwrap();
        let _ = tx.send(got);
        tokio::time::sleep(Duration::from_secs(60)).await;
    });
    (port, rx)
}

#[tokio::test]
async fn http_request_inside() {
    let (_a, mut c) = agent().await;
    let req = |port: u16, method: &str| HttpRequestRequest {
        port: port.into(),
        method: method.into(),
        path: "/x".into(),
        timeout_ms: 10_000,
        ..Default::default()
    };
    // A POST with a body; the answer's length framed.
    let (port, got) = serve_once(b"HTTP/1.1 200 OK\r\nX-A: 1\r\nContent-Length: 4\r\n\r\npong").await;
    let r =
        c.http_request(HttpRequestRequest { body: b"ping".to_vec(), ..req(port, "POST") }).await.unwrap().into_inner();
    assert_eq!((r.status, r.body.as_slice(), r.body_dropped_bytes), (200, &b"pong"[..], 0));
    assert!(r.headers.iter().any(|h| h.name == "x-a" && h.value == "1"), "{:?}", r.headers);
    let sent = String::from_utf8(got.await.unwrap()).unwrap();
    assert!(sent.starts_with("POST /x HTTP/1.1\r\n"), "{sent}");
    assert!(sent.to_ascii_lowercase().contains("connection: close"), "{sent}");

    // Chunked, with an informational answer first; the body past the caller's limit is
    // counted, not kept.
    let (port, _) = serve_once(
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n4\r\ndefg\r\n0\r\n\r\n",
    )
    .await;
    let r = c.http_request(HttpRequestRequest { max_body_bytes: 5, ..req(port, "GET") }).await.unwrap().into_inner();
    assert_eq!((r.status, r.body.as_slice(), r.body_dropped_bytes), (201, &b"abcde"[..], 2));

    // HEAD: the Content-Length announces no body to wait for (the server keeps the
    // connection open; waiting for 100 bytes would hang until the timeout).
    let (port, _) = serve_once(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n").await;
    let r = c.http_request(req(port, "HEAD")).await.unwrap().into_inner();
    assert_eq!((r.status, r.body.len()), (200, 0));

    // A broken chunked body is an error, not a body cut short in silence.
    let (port, _) = serve_once(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\nzz\r\n").await;
    let e = c.http_request(req(port, "GET")).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    // As is an answer that is not HTTP, and a body shorter than announced.
    let (port, _) = serve_once(b"SSH-2.0-OpenSSH_9.2\r\n\r\n").await;
    assert_eq!(c.http_request(req(port, "GET")).await.unwrap_err().code(), tonic::Code::Unavailable);
    let (port, _) = serve_once(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort").await;
    let e = c.http_request(HttpRequestRequest { timeout_ms: 500, ..req(port, "GET") }).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    assert!(e.message().contains("timed out"), "{e:?}");
    // Nobody listening: the sandbox's state (a port not open), not an agent that cannot serve.
    let free = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap().port();
    let e = c.http_request(req(free, "GET")).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains(&format!("nothing listens on port {free}")), "{e:?}");
}

#[tokio::test]
async fn process_api() {
    let (_a, mut c) = agent().await;
    let pid = c
        .start_process(StartProcessRequest { cmd: vec!["cat".into()], tag: "cat1".into(), ..Default::default() })
        .await
        .unwrap()
        .into_inner()
        .pid;
    let by_tag = || Some(ProcessSelector { by: Some(process_selector::By::Tag("cat1".into())) });
    c.send_input(SendInputRequest { process: by_tag(), data: b"hello\n".to_vec(), ..Default::default() })
        .await
        .unwrap();
    // Read the first line, break the stream, write more, re-attach from the offset.
    let mut s = c
        .connect_process(ConnectProcessRequest { process: by_tag(), ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    let first = match s.next().await.unwrap().unwrap().kind {
        Some(process_event::Kind::Output(d)) => d.data,
        k => panic!("{k:?}"),
    };
    assert_eq!(first, b"hello\n");
    drop(s);
    c.send_input(SendInputRequest { process: by_tag(), data: b"world\n".to_vec(), eof: true, ..Default::default() })
        .await
        .unwrap();
    let mut s = c
        .connect_process(ConnectProcessRequest {
            process: Some(ProcessSelector { by: Some(process_selector::By::Pid(pid)) }),
            stdout_offset: 6,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut rest = vec![];
    let mut exit = None;
    while let Some(m) = s.next().await {
        match m.unwrap().kind {
            Some(process_event::Kind::Output(d)) => rest.extend(d.data),
            Some(process_event::Kind::Exit(x)) => exit = Some(x),
            None => {}
        }
    }
    assert_eq!(rest, b"world\n");
    assert_eq!(exit.unwrap().exit_code, 0);

    // Signals.
    c.start_process(StartProcessRequest {
        cmd: vec!["sleep".into(), "1000".into()],
        tag: "sl".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    let sel = Some(ProcessSelector { by: Some(process_selector::By::Tag("sl".into())) });
    c.signal_process(SignalProcessRequest { process: sel.clone(), signal: 15, ..Default::default() }).await.unwrap();
    let mut s =
        c.connect_process(ConnectProcessRequest { process: sel, ..Default::default() }).await.unwrap().into_inner();
    let mut exit = None;
    while let Some(m) = s.next().await {
        if let Some(process_event::Kind::Exit(x)) = m.unwrap().kind {
            exit = Some(x);
        }
    }
    assert_eq!(exit.unwrap().signal, 15);
    let l = c.list_processes(ListProcessesRequest::default()).await.unwrap().into_inner();
    assert_eq!(l.processes.len(), 2);
    assert!(l.processes.iter().all(|p| !p.running));
    let e = c
        .start_process(StartProcessRequest { cmd: vec!["/no/such/binary".into()], ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Internal);
    assert!(e.message().contains("No such file"), "the exec's own error: {e:?}");
    // Failed execs while children keep exiting (the reaper busy with waitpid(-1)): each one
    // is its own error, never a child std cannot find, and the agent answers after.
    let mut churn = c.clone();
    let busy = tokio::spawn(async move {
        for _ in 0..40 {
            churn.start_process(StartProcessRequest { cmd: vec!["true".into()], ..Default::default() }).await.unwrap();
        }
    });
    for _ in 0..40 {
        let e = c
            .start_process(StartProcessRequest { cmd: vec!["/no/such/binary".into()], ..Default::default() })
            .await
            .unwrap_err();
        assert!(e.message().contains("No such file"), "{e:?}");
    }
    busy.await.unwrap();
    assert!(!c.list_processes(ListProcessesRequest::default()).await.unwrap().into_inner().processes.is_empty());
}

#[tokio::test]
async fn process_on_a_pty() {
    let (_a, mut c) = agent().await;
    let cmd = "stty size; tty; read line; echo got:$line; exit 4";
    c.start_process(StartProcessRequest {
        cmd: vec!["sh".into(), "-c".into(), cmd.into()],
        tag: "term".into(),
        pty: Some(PtySize { rows: 33, cols: 101 }),
        ..Default::default()
    })
    .await
    .unwrap();
    let sel = || Some(ProcessSelector { by: Some(process_selector::By::Tag("term".into())) });
    c.send_input(SendInputRequest { process: sel(), data: b"hello\n".to_vec(), ..Default::default() }).await.unwrap();
    let mut s =
        c.connect_process(ConnectProcessRequest { process: sel(), ..Default::default() }).await.unwrap().into_inner();
    let (mut out, mut exit) = (Vec::new(), None);
    while let Some(m) = s.next().await {
        match m.unwrap().kind {
            Some(process_event::Kind::Output(d)) => {
                assert_eq!(d.stream, OutputStream::Stdout as i32);
                out.extend(d.data)
            }
            Some(process_event::Kind::Exit(x)) => exit = Some(x),
            None => {}
        }
    }
    let text = String::from_utf8_lossy(&out);
    // The terminal's size, a real terminal, the input echoed, the answer; exit code kept.
    assert!(text.contains("33 101"), "{text:?}");
    assert!(text.contains("/dev/pts/"), "{text:?}");
    assert!(text.contains("got:hello"), "{text:?}");
    assert_eq!(exit.unwrap().exit_code, 4);
}

#[tokio::test]
async fn watch_heartbeats() {
    let (a, mut c) = agent().await;
    let mut s = c.watch(WatchRequest::default()).await.unwrap().into_inner();
    let h1 = s.next().await.unwrap().unwrap();
    let h2 = s.next().await.unwrap().unwrap();
    assert_eq!((h1.seq, h2.seq), (1, 2));
    assert!(h2.uptime_ms >= h1.uptime_ms);
    // The stream breaks when the agent dies: the edge's liveness signal.
    drop(a);
    let end = tokio::time::timeout(Duration::from_secs(10), async { while let Some(Ok(_)) = s.next().await {} }).await;
    assert!(end.is_ok());
}

#[tokio::test]
async fn session_records_are_bounded_earliest_first() {
    let (_a, mut c) = agent_with(&["--session-bytes", "1000"]).await;
    for rid in ["a", "b"] {
        let mut q = req("e", "head -c 800 /dev/zero");
        q.request_id = rid.into();
        assert_eq!(c.exec(q).await.unwrap().into_inner().stdout.len(), 800);
    }
    let get = |rid: &str| GetOutputRequest { session_id: "e".into(), request_id: rid.into(), ..Default::default() };
    let e = c.get_output(get("a")).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::OutOfRange);
    let b = c.get_output(get("b")).await.unwrap().into_inner();
    assert_eq!((b.stdout.len(), b.finished), (800, true));
}
