//! End to end, as root: a cluster whose edge offers `sim` and `container`, a busybox image
//! imported and registered through `opendsecctl image import`, container sandboxes created,
//! used through the public `Runtime` service (sessions, files, processes), paused, resumed,
//! carried over an edge restart and stopped through the public API, checked on the host (its
//! PID 1, cgroup freezer, loop devices, holder file) at each step. PID 1 is the static agent
//! (`make agent`), found by the edge's default lookup from the test binary.
//!
//! The test binary cannot be the setup process, so the edge re-executes the `opendsec` binary
//! (`edge.container_setup_exe`), which branches off into the setup process first thing in main.
//! A guard removes the sandbox's cgroup, processes and loop device if the test fails midway.

use std::path::Path;
use std::time::Duration;

use crate::common::*;
use clap::Parser;
use opendsec_cli::ctl::{Cli, run};
use opendsec_edge::linuxrt::sandbox::Sandbox;
use opendsec_edge::linuxrt::{cgroup, rootfs};
use opendsec_proto::upload::Upload;
use opendsec_proto::v1 as pb;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn container_sandbox_through_the_api_survives_an_edge_restart() {
    let f = fixture().await;
    let (containers, store, addr, admin) = (f.containers.clone(), f.store.clone(), f.addr.clone(), f.admin.clone());
    let mut cluster = f.cluster;
    let mut rt = runtime(&cluster.ca_path, &addr, &cluster.admin_token);
    let spec = container_spec("busybox", 64, 32);
    let s = admin.create_sandbox(spec).await.unwrap();
    assert_eq!(state(&s), pb::SandboxState::Running);
    assert_eq!(s.edge, EDGE);
    let name = opendsec_edge::backend::container::sandbox_name(&containers, &s.id);
    let host = Sandbox::adopt(&containers, &name).unwrap();
    let pid = host.pid;
    assert!(Path::new(&format!("/proc/{pid}")).exists());
    let inuse = store.join("inuse").join(&s.id);
    assert!(inuse.exists(), "no holder file {}", inuse.display());

    let p = admin.pause_sandbox(&s.id).await.unwrap();
    assert_eq!(state(&p), pb::SandboxState::Paused);
    until("frozen", Duration::from_secs(10), || matches!(freezer_state(&host).as_str(), "FROZEN" | "1")).await;
    let r = admin.resume_sandbox(&s.id).await.unwrap();
    assert_eq!(state(&r), pb::SandboxState::Running);
    until("thawed", Duration::from_secs(10), || matches!(freezer_state(&host).as_str(), "THAWED" | "0")).await;

    // A session through the API; a call on a paused sandbox resumes it first, transparently.
    let r = exec_in(&mut rt, &s.id, "main", "cd /tmp && export GREETING=hello && echo started").await;
    assert_eq!((r.exit_code, out(&r).as_str()), (0, "started"), "{r:?}");
    assert_eq!(state(&admin.pause_sandbox(&s.id).await.unwrap()), pb::SandboxState::Paused);
    let r = exec_in(&mut rt, &s.id, "main", "echo $GREETING from $(pwd)").await;
    assert_eq!(out(&r), "hello from /tmp");
    assert_eq!(state(&admin.get_sandbox(&s.id).await.unwrap()), pb::SandboxState::Running);
    until("thawed", Duration::from_secs(10), || matches!(freezer_state(&host).as_str(), "THAWED" | "0")).await;

    // Edge restart: the sandbox keeps running and is adopted by the new edge.
    cluster.stop_edge(EDGE).await.unwrap();
    assert!(Path::new(&format!("/proc/{pid}")).exists());
    cluster.start_edge(EDGE).await.unwrap();
    assert_eq!(state(&admin.get_sandbox(&s.id).await.unwrap()), pb::SandboxState::Running);
    assert_eq!(Sandbox::adopt(&containers, &name).unwrap().pid, pid);
    // The adopted agent answers, and the session kept its shell (directory, variables).
    let r = exec_in(&mut rt, &s.id, "main", "echo $GREETING from $(pwd)").await;
    assert_eq!(out(&r), "hello from /tmp");
    // A lifecycle call after the restart goes through the adopted handle.
    assert_eq!(state(&admin.pause_sandbox(&s.id).await.unwrap()), pb::SandboxState::Paused);
    assert_eq!(state(&admin.resume_sandbox(&s.id).await.unwrap()), pb::SandboxState::Running);

    let st = admin.stop_sandbox(&s.id).await.unwrap();
    assert_eq!(state(&st), pb::SandboxState::Stopped);
    until("PID 1 gone", Duration::from_secs(10), || !Path::new(&format!("/proc/{pid}")).exists()).await;
    assert!(
        cgroup::list(&opendsec_edge::backend::container::sandbox_name(&containers, &format!("{EDGE}.")))
            .unwrap()
            .is_empty()
    );
    assert!(rootfs::loops_under(&containers).is_empty());
    assert!(!containers.join(&name).exists());
    assert!(!inuse.exists());
    // Calls on a stopped sandbox are refused with its state.
    let e = rt
        .exec(pb::ExecRequest { sandbox_id: s.id.clone(), command: "true".into(), ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(reason(&e), "invalid_state", "{e:?}");
    cluster.shutdown().await;
}

/// A principal of `project` holding `perms` there, and its token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_files_and_processes_through_the_api() {
    let f = fixture().await;
    let token = f.cluster.admin_token.clone();
    let mut rt = runtime(&f.ca, &f.addr, &token);
    let s = f.admin.create_sandbox(container_spec("busybox", 64, 32)).await.unwrap();

    // Streamed exec: chunks as they come, then the exit.
    let req = pb::ExecRequest {
        sandbox_id: s.id.clone(),
        command: "echo one; echo two >&2; exit 3".into(),
        ..Default::default()
    };
    let mut stream = rt.exec_stream(req).await.unwrap().into_inner();
    let (mut stdout, mut stderr, mut exit) = (Vec::new(), Vec::new(), None);
    while let Some(c) = stream.message().await.unwrap() {
        match c.kind {
            Some(pb::exec_chunk::Kind::Output(o)) if o.stream == pb::OutputStream::Stdout as i32 => {
                stdout.extend(o.data)
            }
            Some(pb::exec_chunk::Kind::Output(o)) => stderr.extend(o.data),
            Some(pb::exec_chunk::Kind::Exit(e)) => exit = Some(e.exit_code),
            None => {}
        }
    }
    assert_eq!((stdout.as_slice(), stderr.as_slice(), exit), (&b"one\n"[..], &b"two\n"[..], Some(3)));

    // Files: write (parents made), read back, list, stat, move, remove; relative paths resolve
    // against the session's directory.
    let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    assert_eq!(write_all(&mut rt, &s.id, "/work/in/data.bin", &data).await.unwrap(), data.len() as u64);
    assert_eq!(read_all(&mut rt, &s.id, "/work/in/data.bin").await.unwrap(), data);
    let r = exec_in(&mut rt, &s.id, "", "cd /work/in && md5sum data.bin | cut -c1-8 && wc -c < data.bin").await;
    assert!(out(&r).ends_with(&data.len().to_string()), "{r:?}");
    let list = rt
        .list_dir(pb::ListDirRequest { sandbox_id: s.id.clone(), path: "/work/in".into(), ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(list.entries.iter().map(|e| e.name.as_str()).collect::<Vec<_>>(), vec!["data.bin"]);
    let st = rt
        .stat(pb::StatRequest { sandbox_id: s.id.clone(), path: "data.bin".into(), ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((st.size, st.path.as_str()), (data.len() as u64, "/work/in/data.bin"));
    let mv = pb::MoveRequest {
        sandbox_id: s.id.clone(),
        from: "/work/in/data.bin".into(),
        to: "/work/moved.bin".into(),
        ..Default::default()
    };
    rt.r#move(mv).await.unwrap();
    rt.remove(pb::RemoveRequest {
        sandbox_id: s.id.clone(),
        path: "/work".into(),
        recursive: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let e = read_all(&mut rt, &s.id, "/work/moved.bin").await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");

    // opendsecctl: exec passes the command's exit code through; a named session keeps state;
    // cp uploads and downloads byte for byte.
    let ctl = |args: &[&str]| {
        let ca = f.ca.to_str().unwrap();
        let mut argv = vec!["opendsecctl", "--addr", &f.addr, "--token", &token, "--ca", ca];
        argv.extend_from_slice(args);
        run(Cli::try_parse_from(argv).unwrap())
    };
    assert_eq!(ctl(&["exec", &s.id, "--", "sh", "-c", "'exit 7'"]).await.unwrap(), 7);
    assert_eq!(ctl(&["exec", &s.id, "--session", "cli", "--", "cd /etc && X=1"]).await.unwrap(), 0);
    assert_eq!(ctl(&["exec", &s.id, "--session", "cli", "--", "test $(pwd) = /etc"]).await.unwrap(), 0);
    let local = f._dir.path().join("local.bin");
    std::fs::write(&local, &data[..100_000]).unwrap();
    let remote = format!("{}:/cli/copy.bin", s.id);
    assert_eq!(ctl(&["cp", local.to_str().unwrap(), &remote]).await.unwrap(), 0);
    let back = f._dir.path().join("back.bin");
    assert_eq!(ctl(&["cp", &remote, back.to_str().unwrap()]).await.unwrap(), 0);
    assert_eq!(std::fs::read(&back).unwrap(), &data[..100_000]);
    assert_eq!(ctl(&["ps", &s.id]).await.unwrap(), 0);
    let e = ctl(&["exec", "nosuchedge.lease", "--", "true"]).await.unwrap_err();
    assert!(e.to_string().contains("nosuchedge"), "{e}");

    // An upload the client aborts midway fails at every hop and leaves no file, short or temporary.
    let ch = opendsec_common::grpc::channel(&f.addr).unwrap();
    let authed = tonic::service::interceptor::InterceptedService::new(ch, Bearer(token.clone()));
    let msgs = vec![
        Upload::Message(pb::WriteFileRequest {
            sandbox_id: s.id.clone(),
            path: "/up/aborted.bin".into(),
            make_parents: true,
            data: vec![1; 1 << 20],
            ..Default::default()
        }),
        Upload::Message(pb::WriteFileRequest { data: vec![2; 1 << 20], ..Default::default() }),
        Upload::Abort("the client gave up".into()),
    ];
    let e = opendsec_proto::upload::write_file(authed, tokio_stream::iter(msgs)).await.unwrap_err();
    assert_ne!(e.code(), tonic::Code::Ok);
    let r = exec_in(&mut rt, &s.id, "", "find / -xdev -name '*aborted.bin*' | wc -l").await;
    assert_eq!(out(&r), "0", "{r:?}");

    // Processes: started with a tag, listed, fed on stdin, signalled; output by reconnecting.
    let start = pb::StartProcessRequest {
        sandbox_id: s.id.clone(),
        cmd: vec!["sh".into(), "-c".into(), "read line; echo got $line; sleep 600".into()],
        tag: "worker".into(),
        ..Default::default()
    };
    let pid = rt.start_process(start).await.unwrap().into_inner().pid;
    let by_tag = || Some(pb::ProcessSelector { by: Some(pb::process_selector::By::Tag("worker".into())) });
    let input =
        pb::SendInputRequest { sandbox_id: s.id.clone(), process: by_tag(), data: b"ping\n".to_vec(), eof: false };
    rt.send_input(input).await.unwrap();
    let list = rt.list_processes(pb::ListProcessesRequest { sandbox_id: s.id.clone() }).await.unwrap().into_inner();
    assert!(list.processes.iter().any(|p| p.pid == pid && p.tag == "worker" && p.running), "{list:?}");
    let conn = pb::ConnectProcessRequest { sandbox_id: s.id.clone(), process: by_tag(), ..Default::default() };
    let mut events = rt.connect_process(conn.clone()).await.unwrap().into_inner();
    let mut output = Vec::new();
    while !output.ends_with(b"\n") {
        match events.message().await.unwrap().and_then(|e| e.kind) {
            Some(pb::process_event::Kind::Output(o)) => output.extend(o.data),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(String::from_utf8_lossy(&output), "got ping\n");
    // The stream broken, the process lives on; signalled, its exit is seen on a new stream.
    drop(events);
    let sig = pb::SignalProcessRequest { sandbox_id: s.id.clone(), process: by_tag(), signal: 15 };
    rt.signal_process(sig).await.unwrap();
    let mut events =
        rt.connect_process(pb::ConnectProcessRequest { stdout_offset: 9, ..conn }).await.unwrap().into_inner();
    let mut exit = None;
    while let Some(ev) = events.message().await.unwrap() {
        match ev.kind {
            Some(pb::process_event::Kind::Output(o)) => panic!("output again: {o:?}"),
            Some(pb::process_event::Kind::Exit(e)) => exit = Some(e),
            None => {}
        }
    }
    assert_eq!(exit.map(|e| e.signal), Some(15));

    // HTTP to a server inside the sandbox (its own loopback).
    exec_in(&mut rt, &s.id, "", "mkdir -p /www && echo hello-http > /www/index.html").await;
    let httpd = pb::StartProcessRequest {
        sandbox_id: s.id.clone(),
        cmd: vec!["httpd".into(), "-f".into(), "-p".into(), "127.0.0.1:8080".into(), "-h".into(), "/www".into()],
        tag: "web".into(),
        ..Default::default()
    };
    rt.start_process(httpd).await.unwrap();
    let get = pb::HttpRequestRequest {
        sandbox_id: s.id.clone(),
        port: 8080,
        method: "GET".into(),
        path: "/index.html".into(),
        ..Default::default()
    };
    let mut answer = None;
    for _ in 0..100 {
        match rt.http_request(get.clone()).await {
            Ok(r) => {
                answer = Some(r.into_inner());
                break;
            }
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
        }
    }
    let answer = answer.expect("the server inside never answered");
    assert_eq!((answer.status, answer.body.as_slice()), (200, &b"hello-http\n"[..]));

    // Authorization: a principal of another project learns nothing and can do nothing; one
    // with sandbox.view only cannot operate.
    f.admin.create_project(pb::CreateProjectRequest { path: "root/other".into(), quota: None }).await.unwrap();
    let outsider = principal(&f.admin, "outsider", "root/other", &["sandbox.operate"]).await;
    let viewer = principal(&f.admin, "viewer", "root", &["sandbox.view"]).await;
    for tok in [&outsider, &viewer] {
        let mut other = runtime(&f.ca, &f.addr, tok);
        let e = other
            .exec(pb::ExecRequest { sandbox_id: s.id.clone(), command: "true".into(), ..Default::default() })
            .await
            .unwrap_err();
        assert_eq!(reason(&e), "permission_denied", "{e:?}");
    }
    let mut anonymous = runtime(&f.ca, &f.addr, "dsk.nobody.secret");
    let e = anonymous.list_processes(pb::ListProcessesRequest { sandbox_id: s.id.clone() }).await.unwrap_err();
    assert_eq!(reason(&e), "unauthenticated", "{e:?}");
    // Malformed and unknown sandbox ids.
    for (id, want) in [("not an id", "invalid_argument"), ("nosuchedge.lease1", "not_found")] {
        let e = rt.list_processes(pb::ListProcessesRequest { sandbox_id: id.into() }).await.unwrap_err();
        assert_eq!(reason(&e), want, "{id}: {e:?}");
    }
    let e =
        rt.list_processes(pb::ListProcessesRequest { sandbox_id: format!("{EDGE}.nosuchlease") }).await.unwrap_err();
    assert_eq!(reason(&e), "not_found", "{e:?}");
    // A sim sandbox has no agent: a clear refusal.
    let sim = f
        .admin
        .create_sandbox(pb::SandboxSpec { backend: "sim".into(), ..container_spec("scratch", 64, 0) })
        .await
        .unwrap();
    let e = rt.list_processes(pb::ListProcessesRequest { sandbox_id: sim.id.clone() }).await.unwrap_err();
    assert_eq!(reason(&e), "invalid_argument", "{e:?}");
    assert!(e.message().contains("no agent"), "{e:?}");

    f.admin.stop_sandbox(&s.id).await.unwrap();
    f.admin.stop_sandbox(&sim.id).await.unwrap();
    f.cluster.shutdown().await;
}

/// Python run in the sandbox: each probe prints `name=result`.
const PROBES: &str = r#"
import ctypes, os, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
def sc(name, n, *args):
    r = libc.syscall(n, *args)
    print(f"{name}=" + ("ok" if r >= 0 else os.strerror(ctypes.get_errno())))
sc("add_key", 248, b"user", b"k", b"v", 1, ctypes.c_int(-2))
sc("keyctl", 250, 0, ctypes.c_int(-2), 0)
sc("bpf", 321, 5, 0, 0)
sc("init_module", 175, 0, 0, b"")
sc("finit_module", 313, 0, b"", 0)
sc("unshare", 272, 0x20000)
sc("mount", 165, b"none", b"/mnt", b"tmpfs", 0, 0)
sc("mknod", 133, b"/tmp/sda", 0o60600, os.makedev(8, 0))
host = int(sys.argv[1])
print("host_pid_visible=" + str(os.path.exists(f"/proc/{host}")))
sc("ptrace_host", 101, 16, host, 0, 0)
print("procs=" + str(len([p for p in os.listdir("/proc") if p.isdigit()])))
for path, name in [("/proc/sys/vm/swappiness", "procsys"), ("/sys/class/net/lo/mtu", "sys")]:
    try:
        open(path, "w").write("1")
        print(f"{name}=written")
    except OSError as e:
        print(f"{name}={e.strerror}")
print("sysls=" + ",".join(sorted(os.listdir("/sys"))) + ";" + ",".join(sorted(os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else []))
print("devices=" + ",".join(sorted(d for d in os.listdir("/dev") if not d.startswith("."))))
for name, fam, kind, proto in [("af_vsock", 40, 1, 0), ("af_packet", 17, 3, 0), ("af_alg", 38, 5, 0),
                               ("icmp_raw", 2, 3, 1), ("icmp_ping", 2, 2, 1)]:
    try:
        socket.socket(fam, kind, proto).close()
        print(f"{name}=ok")
    except OSError as e:
        print(f"{name}={e.strerror}")
try:
    s = socket.socket()
    s.bind(("127.0.0.1", 80))
    print("bind_80=ok")
except OSError as e:
    print(f"bind_80={e.strerror}")
status = open("/proc/self/status").read().splitlines()
for k in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"]:
    print(k + "=" + [l.split()[1] for l in status if l.startswith(k + ":")][0])
try:
    open("/dev/tty", "w")
    print("tty=opened")
except OSError as e:
    print(f"tty={e.strerror}")
def count(p):
    try:
        return str(len(os.listdir(p)))
    except OSError as e:
        return e.strerror
print("blockdevs=" + "/".join(count(p) for p in ["/sys/block", "/sys/class/block", "/sys/dev/block", "/sys/devices/virtual/block"]))
print("slabinfo=" + str(len(open("/proc/slabinfo").read())))
print("diskstats=" + "/".join(str(len(open(p).read())) for p in ["/proc/diskstats", "/proc/partitions"]))
print("disktrees=" + "/".join(count(p) for p in ["/sys/fs/ext4", "/sys/class/bdi", "/sys/devices/virtual/bdi"]))
for port in sys.argv[2:]:
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect(("127.0.0.1", int(port)))
        print(f"connect_{port}=connected")
    except OSError as e:
        print(f"connect_{port}={e.strerror or e}")
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_workloads_are_contained() {
    let f = fixture().await;
    import(&f.ca, &f.addr, &f.cluster.admin_token, &debian_rootfs(), &f.store, "debian:bookworm").await;
    let mut rt = runtime(&f.ca, &f.addr, &f.cluster.admin_token);
    let a = f.admin.create_sandbox(container_spec("debian:bookworm", 128, 64)).await.unwrap();
    let b = f.admin.create_sandbox(container_spec("debian:bookworm", 128, 64)).await.unwrap();

    // Kernel interfaces, host processes, devices and the control plane's sockets.
    write_all(&mut rt, &a.id, "/tmp/probes.py", PROBES.as_bytes()).await.unwrap();
    let edge = f.cluster.config.edges.iter().find(|e| e.name == EDGE).unwrap();
    let edge_port = edge.address.parse::<std::net::SocketAddr>().unwrap().port();
    let api_port = f.cluster.apiserver_addr.port();
    let cmd = format!("python3 /tmp/probes.py {} {edge_port} {api_port}", std::process::id());
    let r = exec_in(&mut rt, &a.id, "probe", &cmd).await;
    let text = String::from_utf8_lossy(&r.stdout).to_string();
    let get = |k: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{k}=")))
            .unwrap_or_else(|| panic!("no {k} in {text}\n{}", String::from_utf8_lossy(&r.stderr)))
            .to_string()
    };
    for k in ["add_key", "keyctl", "bpf", "init_module", "finit_module", "unshare", "mount", "mknod"] {
        assert_eq!(get(k), "Operation not permitted", "{k}: {text}");
    }
    assert_eq!(get("host_pid_visible"), "False");
    assert_eq!(get("ptrace_host"), "No such process");
    let procs: usize = get("procs").parse().unwrap();
    assert!(procs <= 8, "too many processes visible: {text}");
    assert_eq!(get("procsys"), "Read-only file system");
    assert_eq!(get("sys"), "Read-only file system", "{}", get("sysls"));
    assert_eq!(get("devices"), "fd,full,null,ptmx,pts,random,shm,stderr,stdin,stdout,tty,urandom,zero");
    // VM sockets, raw frames and the kernel crypto API are refused; raw ICMP needs the
    // dropped CAP_NET_RAW while ping sockets work; root binds low ports.
    for k in ["af_vsock", "af_packet", "af_alg", "icmp_raw"] {
        assert_eq!(get(k), "Operation not permitted", "{k}: {text}");
    }
    assert_eq!(get("icmp_ping"), "ok");
    assert_eq!(get("bind_80"), "ok");
    // Root's capabilities: CHOWN, DAC_OVERRIDE, FOWNER, FSETID, KILL, SETGID, SETUID,
    // NET_BIND_SERVICE, SYS_CHROOT; nothing inheritable or ambient.
    for (k, v) in [
        ("CapInh", "0000000000000000"),
        ("CapPrm", "00000000000404fb"),
        ("CapEff", "00000000000404fb"),
        ("CapBnd", "00000000000404fb"),
        ("CapAmb", "0000000000000000"),
    ] {
        assert_eq!(get(k), v, "{k}");
    }
    // No controlling terminal; the block devices (whose loop backing files name every
    // sandbox of the node), the disks' counts and statistics, and the slab statistics are
    // masked.
    assert_eq!(get("tty"), "No such device or address");
    assert_eq!(get("blockdevs"), "0/0/0/0");
    assert_eq!(get("slabinfo"), "0");
    assert_eq!(get("diskstats"), "0/0", "the node's disks are counted and metered in /proc");
    assert_eq!(get("disktrees"), "0/0/0");
    for port in [edge_port, api_port] {
        let v = get(&format!("connect_{port}"));
        assert_ne!(v, "connected", "the sandbox reached port {port}");
    }
    // PID 1 (the agent) cannot be opened through /proc or traced: its fds (the host-side
    // listening socket, once the console log) are out of reach.
    let r =
        exec_in(&mut rt, &a.id, "probe", "echo x > /proc/1/fd/1; echo rc=$?; cat /proc/1/environ; echo rc=$?").await;
    assert_eq!(out(&r), "rc=1\nrc=1", "{r:?}");
    assert!(String::from_utf8_lossy(&r.stderr).contains("Permission denied"), "{r:?}");
    // The agent's socket is on the host, out of the sandbox's sight.
    let r = exec_in(&mut rt, &a.id, "probe", "ls -a /.opendsec; ls /run/opendsec-agent/sessions").await;
    assert_eq!(out(&r).lines().filter(|l| l.ends_with(".sock")).count(), 0, "{r:?}");

    // Root inside is an unprivileged host id outside, another in each sandbox; a file sandbox
    // root makes is owned by that id on the host.
    let r = exec_in(&mut rt, &a.id, "ids", "touch /tmp/made-by-root; sleep 600 & echo $!").await;
    let bg: i32 = out(&r).parse().unwrap();
    let host_pid = |id: &str, ns_pid: i32| {
        let name = opendsec_edge::backend::container::sandbox_name(&f.containers, id);
        let pids = opendsec_edge::linuxrt::cgroup::SandboxCgroup::open(&name).unwrap().pids().unwrap();
        let nspid = |p: &i32| {
            let st = std::fs::read_to_string(format!("/proc/{p}/status")).unwrap_or_default();
            st.lines().find_map(|l| l.strip_prefix("NSpid:")).and_then(|v| v.split_whitespace().last()?.parse().ok())
        };
        *pids.iter().find(|p| nspid(p) == Some(ns_pid)).unwrap_or_else(|| panic!("no pid {ns_pid} in {id}"))
    };
    let uid_of = |pid: i32| -> u32 {
        let st = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        st.lines().find_map(|l| l.strip_prefix("Uid:")).and_then(|v| v.split_whitespace().next()?.parse().ok()).unwrap()
    };
    let (a1, b1) = (host_pid(&a.id, 1), host_pid(&b.id, 1));
    let (ua, ub) = (uid_of(a1), uid_of(b1));
    assert!(
        ua >= opendsec_edge::linuxrt::idmap::DEFAULT_FIRST_ID && ub >= opendsec_edge::linuxrt::idmap::DEFAULT_FIRST_ID
    );
    assert_ne!(ua, ub, "two sandboxes share host ids");
    assert_eq!(uid_of(host_pid(&a.id, bg)), ua, "sandbox root's shell on the host");
    {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(format!("/proc/{a1}/root/tmp/made-by-root")).unwrap();
        assert_eq!((m.uid(), m.gid()), (ua, ua), "a file sandbox root made, seen from the host");
    }
    // Per-user kernel limits are the sandbox's own: inotify instances exhausted in one leave
    // the other's, and host root's, alone.
    let hog = "python3 -c \"import ctypes, os, time\nlibc = ctypes.CDLL(None, use_errno=True)\nn = 0\nwhile libc.inotify_init1(0) >= 0: n += 1\nopen('/tmp/inotify', 'w').write(f'{n} {os.strerror(ctypes.get_errno())}')\ntime.sleep(600)\" > /dev/null 2>&1 & while [ ! -s /tmp/inotify ]; do sleep 0.05; done; cat /tmp/inotify";
    let r = exec_in(&mut rt, &a.id, "inotify", hog).await;
    let (n, why) = out(&r).split_once(' ').map(|(n, w)| (n.parse::<u32>().unwrap(), w.to_string())).unwrap();
    assert!(n > 0 && why == "Too many open files", "{r:?}");
    let one = "python3 -c \"import ctypes; print(ctypes.CDLL(None).inotify_init1(0) >= 0)\"";
    assert_eq!(out(&exec_in(&mut rt, &b.id, "inotify", one).await), "True", "the other sandbox lost its inotify");
    // SAFETY: inotify_init1 takes flags and returns an fd (closed at once) or -1.
    let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC) };
    assert!(fd >= 0, "host root lost its inotify: {}", std::io::Error::last_os_error());
    // SAFETY: closing the fd just made.
    unsafe { libc::close(fd) };
    rt.close_session(pb::CloseSessionRequest { sandbox_id: a.id.clone(), session_id: "inotify".into() }).await.unwrap();

    // A fork bomb stops at the pids limit; the sandbox keeps answering once its session closes.
    let bomb = pb::ExecRequest {
        sandbox_id: a.id.clone(),
        session_id: "bomb".into(),
        command: "bomb() { bomb | bomb & }; bomb; sleep 3".into(),
        timeout_ms: 10_000,
        ..Default::default()
    };
    let _ = rt.exec(bomb).await;
    rt.close_session(pb::CloseSessionRequest { sandbox_id: a.id.clone(), session_id: "bomb".into() }).await.unwrap();
    let r = exec_in(&mut rt, &a.id, "after-bomb", "echo alive").await;
    assert_eq!(out(&r), "alive");

    // A memory hog is OOM-killed in its own cgroup; the agent lives and answers. The workload
    // runs with a raised OOM score, so the kernel picks it before the agent.
    let r = exec_in(&mut rt, &a.id, "hog", "cat /proc/self/oom_score_adj").await;
    assert_eq!(out(&r), "500");
    let r = exec_in(&mut rt, &a.id, "hog", "python3 -c 'b = bytearray(1 << 30); print(len(b))'; echo exit=$?").await;
    assert!(out(&r).ends_with("exit=137"), "{r:?}");
    let r = exec_in(&mut rt, &a.id, "hog", "echo alive").await;
    assert_eq!(out(&r), "alive");
    assert_eq!(state(&f.admin.get_sandbox(&a.id).await.unwrap()), pb::SandboxState::Running);

    // Filling the disk stops at disk_mb.
    let r =
        exec_in(&mut rt, &a.id, "disk", "dd if=/dev/zero of=/big bs=1M count=1000 2>&1 | head -1; rm -f /big").await;
    assert!(out(&r).contains("No space left on device"), "{r:?}");

    // A gigabyte of output is read and dropped beyond the recorded limit.
    let loud = pb::ExecRequest {
        sandbox_id: a.id.clone(),
        session_id: "loud".into(),
        command: "head -c 1073741824 /dev/zero".into(),
        limits: Some(pb::OutputLimits { stdout_max_bytes: 1 << 20, stderr_max_bytes: 0 }),
        ..Default::default()
    };
    let r = rt.exec(loud).await.unwrap().into_inner();
    assert_eq!((r.exit_code, r.stdout.len() as u64, r.stdout_dropped_bytes), (0, 1 << 20, (1 << 30) - (1 << 20)));

    // Overwriting the shell in one sandbox changes nothing in another; the agent is read-only.
    let r =
        exec_in(&mut rt, &a.id, "x", "echo broken > /usr/bin/bash; echo x >> /.opendsec/opendsec-agent; echo $?").await;
    assert_eq!(out(&r).lines().last(), Some("1"), "{r:?}");
    let r = exec_in(&mut rt, &b.id, "x", "bash -c 'echo bash works'").await;
    assert_eq!(out(&r), "bash works");

    // Hostile file-API input: `..` and symlinks resolve inside the sandbox's own root; special
    // files give clear errors; nothing outside the sandbox is touched.
    let marker = format!("opendsec-escape-{}", std::process::id());
    write_all(&mut rt, &a.id, &format!("/../../../../../tmp/{marker}"), b"x").await.unwrap();
    assert!(!Path::new("/tmp").join(&marker).exists(), "a write escaped to the host's /tmp");
    // A symlink aimed at a host directory holding a secret: resolved in the sandbox, it finds
    // nothing.
    let secret_dir = f._dir.path().join("secret");
    std::fs::create_dir_all(&secret_dir).unwrap();
    std::fs::write(secret_dir.join("key"), b"host secret").unwrap();
    let link = format!("ls /tmp/{marker} && ln -s /../../../..{} /escape", secret_dir.display());
    let r = exec_in(&mut rt, &a.id, "x", &link).await;
    assert_eq!(r.exit_code, 0, "{r:?}");
    let e = read_all(&mut rt, &a.id, "/escape/key").await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    let e = write_all(&mut rt, &a.id, "/dev/full", b"data").await.unwrap_err();
    assert!(e.message().contains("not a regular file"), "{e:?}");
    let huge = vec![7u8; 96 << 20];
    let e = write_all(&mut rt, &a.id, "/huge.bin", &huge).await.unwrap_err();
    assert!(e.message().contains("No space left"), "{e:?}");
    // Special files are refused by the file API, not read forever.
    let e = read_all(&mut rt, &a.id, "/dev/zero").await.unwrap_err();
    assert!(e.message().contains("not a regular file"), "{e:?}");

    // The spec's user, working directory and extra masked / read-only paths.
    let spec = pb::SandboxSpec {
        user: "nobody".into(),
        workdir: "/srv/app".into(),
        masked_paths: vec!["/etc/shadow".into()],
        readonly_paths: vec!["/usr".into()],
        ..container_spec("debian:bookworm", 128, 64)
    };
    let c = f.admin.create_sandbox(spec).await.unwrap();
    let r = exec_in(&mut rt, &c.id, "", "id -u; pwd; wc -c < /etc/shadow").await;
    assert_eq!(out(&r), "65534\n/srv/app\n0", "{r:?}");
    let as_root = pb::ExecRequest {
        sandbox_id: c.id.clone(),
        session_id: "root".into(),
        command: "touch /usr/x 2>&1; touch /srv/app/x && echo wrote".into(),
        user: "root".into(),
        ..Default::default()
    };
    let r = rt.exec(as_root).await.unwrap().into_inner();
    assert!(out(&r).contains("Read-only file system") && out(&r).ends_with("wrote"), "{r:?}");
    // A user the image does not have: the creation fails with the reason.
    let bad = pb::SandboxSpec { user: "no-such-user".into(), ..container_spec("debian:bookworm", 128, 64) };
    let e = f.admin.create_sandbox(bad).await.unwrap_err();
    assert!(e.message.contains("no-such-user"), "{e:?}");
    // A disk of 0 MiB would be charged as nothing while a disk is allocated: refused.
    let e = f.admin.create_sandbox(container_spec("debian:bookworm", 128, 0)).await.unwrap_err();
    assert_eq!(e.reason.to_string(), "invalid_argument", "{e:?}");
    assert!(e.message.contains("spec.resources.disk_mb"), "{e:?}");

    f.admin.stop_sandbox(&a.id).await.unwrap();
    f.admin.stop_sandbox(&b.id).await.unwrap();
    f.admin.stop_sandbox(&c.id).await.unwrap();
    f.cluster.shutdown().await;
}

/// The edge's clock is a manual one here: the idle TTL passes when the test moves it, not in
/// real seconds, while the edge's sweep (every 200 ms) keeps looking.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runtime_calls_hold_off_idle_expiry_and_count_as_activity() {
    let clock = opendsec_common::time::Clock::manual(opendsec_common::time::now_ms());
    let f = fixture_with_clock(clock.clone()).await;
    let mut rt = runtime(&f.ca, &f.addr, &f.cluster.admin_token);
    let spec = pb::SandboxSpec { ttl_running_stop_s: 2, ..container_spec("busybox", 64, 16) };
    let s = f.admin.create_sandbox(spec).await.unwrap();
    // A call in flight past the idle TTL is not cut short by it: the command waits for a
    // file the test writes only after moving the clock well past the TTL and letting
    // several sweeps run.
    let call = {
        let (mut rt, id) = (rt.clone(), s.id.clone());
        tokio::spawn(async move {
            let cmd = "touch /tmp/started; while [ ! -e /tmp/go ]; do sleep 0.05; done; echo survived";
            exec_in(&mut rt, &id, "", cmd).await
        })
    };
    // Only once the call is known to be running does the clock move (a slow machine may not
    // have sent it yet).
    for _ in 0..600 {
        if out(&exec_in(&mut rt, &s.id, "probe", "test -e /tmp/started && echo yes").await) == "yes" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    clock.advance(10_000);
    tokio::time::sleep(Duration::from_millis(1000)).await; // five sweeps at 200 ms
    assert_eq!(state(&f.admin.get_sandbox(&s.id).await.unwrap()), pb::SandboxState::Running);
    exec_in(&mut rt, &s.id, "other", "touch /tmp/go").await;
    assert_eq!(out(&call.await.unwrap()), "survived");
    // Calls keep resetting the idle clock: 1.5 s of idleness at a time, never 2.
    for _ in 0..4 {
        clock.advance(1_500);
        exec_in(&mut rt, &s.id, "", "true").await;
    }
    let got = f.admin.get_sandbox(&s.id).await.unwrap();
    assert_eq!(state(&got), pb::SandboxState::Running);
    assert!(got.last_active_ms >= got.created_at_ms + 16_000, "{got:?}");
    // Left alone for the TTL, it idles out.
    clock.advance(2_000);
    let mut ended = None;
    for _ in 0..100 {
        let got = f.admin.get_sandbox(&s.id).await.unwrap();
        if state(&got) == pb::SandboxState::Stopped {
            ended = Some(got.end_reason);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(ended.as_deref(), Some("ttl_running_stop"));
    f.cluster.shutdown().await;
}

/// A sandbox whose agent dies, or goes silent past `edge.agent_silence`, is lost: FAILED, its
/// lease released, and everything of it torn down on the host, a silent agent's still-running
/// workload included (it must not go on using what its released quota no longer covers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_sandbox_is_torn_down_and_its_quota_released() {
    let f = fixture_with(|c| c.edge.agent_silence = std::time::Duration::from_secs(2)).await;
    let (containers, addr, admin) = (f.containers.clone(), f.addr.clone(), f.admin.clone());
    let mut rt = runtime(&f.ca, &addr, &f.cluster.admin_token);
    let mut host = Vec::new();
    for _ in 0..2 {
        let s = admin.create_sandbox(container_spec("busybox", 64, 32)).await.unwrap();
        // A workload that would run on if nothing stopped it.
        let r = exec_in(&mut rt, &s.id, "w", "sleep 1000 >/dev/null 2>&1 & echo started").await;
        assert_eq!(out(&r), "started", "{r:?}");
        let name = opendsec_edge::backend::container::sandbox_name(&containers, &s.id);
        let pid1 = Sandbox::adopt(&containers, &name).unwrap().pid;
        let pids = cgroup::SandboxCgroup::open(&name).unwrap().pids().unwrap();
        assert!(pids.len() >= 3, "agent, shell host, sleep: {pids:?}");
        host.push((s.id, name, pid1, pids));
    }
    let usage =
        |u: pb::GetUsageResponse| u.projects.iter().find(|p| p.path == "root").map(|p| p.usage.unwrap().sandboxes);
    let root_usage = || async { usage(admin.get_usage(pb::GetUsageRequest { project: "root".into() }).await.unwrap()) };
    assert_eq!(root_usage().await, Some(2));

    // The first agent dies; the second hangs (stopped from the host), its workload running.
    // SAFETY: kill takes a pid and a signal number and touches no memory of ours.
    let kill = |pid: i32, sig| unsafe { libc::kill(pid, sig) };
    assert_eq!(kill(host[0].2, libc::SIGKILL), 0);
    assert_eq!(kill(host[1].2, libc::SIGSTOP), 0);

    for (id, name, _, pids) in &host {
        let mut ended = String::new();
        for _ in 0..100 {
            let s = admin.get_sandbox(id).await.unwrap();
            if state(&s) == pb::SandboxState::Failed {
                ended = s.end_reason;
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        assert_eq!(ended, "lost", "{id} was not found lost");
        until("every process of the lost sandbox gone", Duration::from_secs(10), || {
            pids.iter().all(|p| !Path::new(&format!("/proc/{p}")).exists())
        })
        .await;
        assert!(cgroup::list(name).unwrap().is_empty(), "{name}: cgroup left behind");
        assert!(!containers.join(name).exists(), "{name}: directory left behind");
    }
    assert!(rootfs::loops_under(&containers).is_empty());
    let mut released = None;
    for _ in 0..50 {
        released = root_usage().await;
        if released == Some(0) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(released, Some(0), "the lost sandboxes' quota is released");
    // Calls on a lost sandbox fail clearly.
    let e = rt
        .exec(pb::ExecRequest { sandbox_id: host[1].0.clone(), command: "true".into(), ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(reason(&e), "invalid_state", "{e:?}");
}

/// An edge caps the Runtime calls one sandbox has in flight, whichever apiservers they come
/// through (each holds a connection and, for unary calls, a whole answer at the edge).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_caps_a_sandboxs_calls_in_flight() {
    let f = fixture_with(|c| c.edge.max_runtime_calls_per_sandbox = 2).await;
    let sb = f.admin.create_sandbox(container_spec("busybox", 64, 64)).await.unwrap();
    let rt = runtime(&f.ca, &f.addr, &f.cluster.admin_token);
    let slow: Vec<_> = (0..2)
        .map(|i| {
            let (mut rt, id) = (rt.clone(), sb.id.clone());
            tokio::spawn(async move { exec_in(&mut rt, &id, &format!("slow{i}"), "sleep 2; echo done").await })
        })
        .collect();
    // Both are running once their sessions' shells have started them.
    tokio::time::sleep(std::time::Duration::from_millis(1000)).await;
    let mut rt2 = rt.clone();
    let req = pb::ExecRequest {
        sandbox_id: sb.id.clone(),
        session_id: "third".into(),
        command: "true".into(),
        ..Default::default()
    };
    let e = rt2.exec(req).await.unwrap_err();
    assert_eq!(reason(&e), "rate_limited", "{e:?}");
    assert!(e.message().contains("calls in flight"), "the edge refused it: {e:?}");
    for s in slow {
        assert_eq!(out(&s.await.unwrap()), "done");
    }
    assert_eq!(out(&exec_in(&mut rt2, &sb.id, "third", "echo ok").await), "ok");
    f.admin.stop_sandbox(&sb.id).await.unwrap();
    f.cluster.shutdown().await;
}
