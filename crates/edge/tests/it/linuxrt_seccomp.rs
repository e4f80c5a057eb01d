//! The sandbox seccomp profile, checked in a forked child of the test (the filter stays there):
//! denied syscalls answer EPERM, clone3 answers ENOSYS, ordinary ones work.
#![cfg(target_arch = "x86_64")]

use opendsec_edge::linuxrt::seccomp;

/// Runs `f` in a forked child with the filters installed; `f` returns the exit code.
fn in_filtered_child(f: fn() -> i32) -> i32 {
    let progs = seccomp::compile().unwrap();
    // SAFETY: the child only makes raw syscalls (no allocation, no locks) and then _exits.
    match unsafe { nix::unistd::fork() }.unwrap() {
        nix::unistd::ForkResult::Child => {
            let code = match seccomp::install(&progs) {
                Ok(()) => f(),
                Err(_) => 100,
            };
            // SAFETY: immediate exit of the forked child.
            unsafe { libc::_exit(code) }
        }
        nix::unistd::ForkResult::Parent { child } => match nix::sys::wait::waitpid(child, None).unwrap() {
            nix::sys::wait::WaitStatus::Exited(_, code) => code,
            other => panic!("child ended with {other:?}"),
        },
    }
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// 0 when `r` failed with `want`, else a code naming the first mismatch.
fn expect(r: libc::c_long, want: i32, code: i32) -> Result<(), i32> {
    if r == -1 && errno() == want { Ok(()) } else { Err(code) }
}

#[test]
fn dangerous_syscalls_are_refused() {
    fn probe() -> i32 {
        // SAFETY: raw syscalls with scalar or null arguments; each is refused by the filter
        // before the kernel looks at the arguments.
        let r = unsafe {
            expect(libc::syscall(libc::SYS_keyctl, 0, 0, 0, 0, 0), libc::EPERM, 1)
                .and(expect(libc::syscall(libc::SYS_add_key, 0, 0, 0, 0, 0), libc::EPERM, 2))
                .and(expect(libc::syscall(libc::SYS_bpf, 0, 0, 0), libc::EPERM, 3))
                .and(expect(libc::syscall(libc::SYS_mount, 0, 0, 0, 0, 0), libc::EPERM, 4))
                .and(expect(libc::syscall(libc::SYS_unshare, libc::CLONE_NEWNS), libc::EPERM, 5))
                .and(expect(libc::syscall(libc::SYS_finit_module, -1, 0, 0), libc::EPERM, 6))
                .and(expect(libc::syscall(libc::SYS_setns, -1, 0), libc::EPERM, 7))
                .and(expect(libc::syscall(libc::SYS_clone, libc::CLONE_NEWUSER, 0, 0, 0, 0), libc::EPERM, 8))
                .and(expect(libc::syscall(435 /* clone3 */, 0, 0), libc::ENOSYS, 9))
                .and(expect(libc::syscall(libc::SYS_personality, 0x0040000), libc::EPERM, 10))
                .and(expect(libc::syscall(libc::SYS_reboot, 0, 0, 0, 0), libc::EPERM, 11))
                .and(expect(libc::syscall(libc::SYS_socket, libc::AF_VSOCK, libc::SOCK_STREAM, 0), libc::EPERM, 12))
                .and(expect(libc::syscall(libc::SYS_socket, libc::AF_PACKET, libc::SOCK_RAW, 0), libc::EPERM, 13))
                .and(expect(libc::syscall(libc::SYS_socket, libc::AF_ALG, libc::SOCK_SEQPACKET, 0), libc::EPERM, 14))
                // High bits set on the family do not slip past the comparison.
                .and(expect(
                    libc::syscall(libc::SYS_socket, (1i64 << 32) | libc::AF_VSOCK as i64, libc::SOCK_STREAM, 0),
                    libc::EPERM,
                    15,
                ))
        };
        if let Err(c) = r {
            return c;
        }
        // Allowed ones still work.
        // SAFETY: as above.
        let ok = unsafe {
            libc::syscall(libc::SYS_getpid) > 0
                && libc::syscall(libc::SYS_personality, 0xffff_ffffu32 as libc::c_long) >= 0
                && libc::syscall(libc::SYS_socket, libc::AF_INET, libc::SOCK_STREAM, 0) >= 0
                && libc::syscall(libc::SYS_socket, libc::AF_UNIX, libc::SOCK_STREAM, 0) >= 0
        };
        if ok { 0 } else { 20 }
    }
    assert_eq!(in_filtered_child(probe), 0);
}
