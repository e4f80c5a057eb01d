//! The sandbox's seccomp filter: Docker's default profile, compiled with seccompiler.
//!
//! Docker's profile is an allow-list with EPERM for everything else; what is reproduced here
//! (x86_64 only; other architectures get `SeccompError::UnsupportedArch`):
//! - the unconditional allow-list of the profile (syscalls Docker gates on capabilities our
//!   sandboxes never hold, such as `mount`, `bpf`, `setns`, `unshare`, `keyctl`, module loading,
//!   `reboot`, `kexec_*`, `swapon`, `acct`, `settimeofday`, `perf_event_open`, are left out, so
//!   they get EPERM);
//! - `clone` only without namespace flags (argument filter, as Docker does without
//!   CAP_SYS_ADMIN);
//! - `clone3` answers ENOSYS (its flags live in memory, unfilterable; libc falls back to
//!   `clone`), done by a second, stacked filter installed last so its errno wins;
//! - `personality` only with the values Docker allows;
//! - `socket` for every address family but [`DENIED_FAMILIES`]: AF_VSOCK (the host's VM
//!   sockets: microVM agents listen there), AF_PACKET (raw frames, sniffing the sandbox's
//!   link) and AF_ALG (the kernel crypto API, a large attack surface no workload needs).
//!
//! Simplifications against Docker: the arch-specific
//! x32/i386 compat syscalls are not handled (the filter kills nothing; non-native
//! architectures fall through to EPERM via seccompiler's arch check, which kills the process).
use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule,
};

/// Errors building or installing the filter.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("seccomp filters are only built for x86_64")]
    UnsupportedArch,
    #[error("building the seccomp filter: {0}")]
    Build(String),
    #[error("installing the seccomp filter: {0}")]
    Install(String),
}

/// Namespace flags `clone` may not carry.
const CLONE_NS_FLAGS: u64 = (libc::CLONE_NEWNS
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUSER
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET
    | libc::CLONE_NEWCGROUP) as u64;

#[cfg(target_arch = "x86_64")]
const ALLOWED: &[i64] = &[
    libc::SYS_accept,
    libc::SYS_accept4,
    libc::SYS_access,
    libc::SYS_adjtimex,
    libc::SYS_alarm,
    libc::SYS_arch_prctl,
    libc::SYS_bind,
    libc::SYS_brk,
    libc::SYS_capget,
    libc::SYS_capset,
    libc::SYS_chdir,
    libc::SYS_chmod,
    libc::SYS_chown,
    libc::SYS_chroot,
    libc::SYS_clock_adjtime,
    libc::SYS_clock_getres,
    libc::SYS_clock_gettime,
    libc::SYS_clock_nanosleep,
    libc::SYS_close,
    436, /* close_range */
    libc::SYS_connect,
    libc::SYS_copy_file_range,
    libc::SYS_creat,
    libc::SYS_dup,
    libc::SYS_dup2,
    libc::SYS_dup3,
    libc::SYS_epoll_create,
    libc::SYS_epoll_create1,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_pwait,
    441, /* epoll_pwait2 */
    libc::SYS_epoll_wait,
    libc::SYS_eventfd,
    libc::SYS_eventfd2,
    libc::SYS_execve,
    libc::SYS_execveat,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_faccessat,
    439, /* faccessat2 */
    libc::SYS_fadvise64,
    libc::SYS_fallocate,
    libc::SYS_fanotify_mark,
    libc::SYS_fchdir,
    libc::SYS_fchmod,
    libc::SYS_fchmodat,
    452, /* fchmodat2 */
    libc::SYS_fchown,
    libc::SYS_fchownat,
    libc::SYS_fcntl,
    libc::SYS_fdatasync,
    libc::SYS_fgetxattr,
    libc::SYS_flistxattr,
    libc::SYS_flock,
    libc::SYS_fork,
    libc::SYS_fremovexattr,
    libc::SYS_fsetxattr,
    libc::SYS_fstat,
    libc::SYS_fstatfs,
    libc::SYS_fsync,
    libc::SYS_ftruncate,
    libc::SYS_futex,
    456, /* futex_requeue */
    455, /* futex_wait */
    449, /* futex_waitv */
    454, /* futex_wake */
    libc::SYS_futimesat,
    libc::SYS_getcpu,
    libc::SYS_getcwd,
    libc::SYS_getdents,
    libc::SYS_getdents64,
    libc::SYS_getegid,
    libc::SYS_geteuid,
    libc::SYS_getgid,
    libc::SYS_getgroups,
    libc::SYS_getitimer,
    libc::SYS_getpeername,
    libc::SYS_getpgid,
    libc::SYS_getpgrp,
    libc::SYS_getpid,
    libc::SYS_getppid,
    libc::SYS_getpriority,
    libc::SYS_getrandom,
    libc::SYS_getresgid,
    libc::SYS_getresuid,
    libc::SYS_getrlimit,
    libc::SYS_get_robust_list,
    libc::SYS_getrusage,
    libc::SYS_getsid,
    libc::SYS_getsockname,
    libc::SYS_getsockopt,
    libc::SYS_get_thread_area,
    libc::SYS_gettid,
    libc::SYS_gettimeofday,
    libc::SYS_getuid,
    libc::SYS_getxattr,
    libc::SYS_inotify_add_watch,
    libc::SYS_inotify_init,
    libc::SYS_inotify_init1,
    libc::SYS_inotify_rm_watch,
    libc::SYS_io_cancel,
    libc::SYS_ioctl,
    libc::SYS_io_destroy,
    libc::SYS_io_getevents,
    333, /* io_pgetevents */
    libc::SYS_ioprio_get,
    libc::SYS_ioprio_set,
    libc::SYS_io_setup,
    libc::SYS_io_submit,
    libc::SYS_kill,
    444, /* landlock_create_ruleset */
    445, /* landlock_add_rule */
    446, /* landlock_restrict_self */
    libc::SYS_lchown,
    libc::SYS_lgetxattr,
    libc::SYS_link,
    libc::SYS_linkat,
    libc::SYS_listen,
    libc::SYS_listxattr,
    libc::SYS_llistxattr,
    libc::SYS_lremovexattr,
    libc::SYS_lseek,
    libc::SYS_lsetxattr,
    libc::SYS_lstat,
    libc::SYS_madvise,
    453, /* map_shadow_stack */
    libc::SYS_membarrier,
    libc::SYS_memfd_create,
    447, /* memfd_secret */
    libc::SYS_mincore,
    libc::SYS_mkdir,
    libc::SYS_mkdirat,
    libc::SYS_mknod,
    libc::SYS_mknodat,
    libc::SYS_mlock,
    libc::SYS_mlock2,
    libc::SYS_mlockall,
    libc::SYS_mmap,
    libc::SYS_modify_ldt,
    libc::SYS_mprotect,
    libc::SYS_mq_getsetattr,
    libc::SYS_mq_notify,
    libc::SYS_mq_open,
    libc::SYS_mq_timedreceive,
    libc::SYS_mq_timedsend,
    libc::SYS_mq_unlink,
    libc::SYS_mremap,
    libc::SYS_msgctl,
    libc::SYS_msgget,
    libc::SYS_msgrcv,
    libc::SYS_msgsnd,
    libc::SYS_msync,
    libc::SYS_munlock,
    libc::SYS_munlockall,
    libc::SYS_munmap,
    libc::SYS_name_to_handle_at,
    libc::SYS_nanosleep,
    libc::SYS_newfstatat,
    libc::SYS_open,
    libc::SYS_openat,
    437, /* openat2 */
    libc::SYS_pause,
    434, /* pidfd_open */
    424, /* pidfd_send_signal */
    libc::SYS_pipe,
    libc::SYS_pipe2,
    libc::SYS_pkey_alloc,
    libc::SYS_pkey_free,
    libc::SYS_pkey_mprotect,
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_prctl,
    libc::SYS_pread64,
    libc::SYS_preadv,
    libc::SYS_preadv2,
    libc::SYS_prlimit64,
    448, /* process_mrelease */
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    libc::SYS_pselect6,
    libc::SYS_ptrace,
    libc::SYS_pwrite64,
    libc::SYS_pwritev,
    libc::SYS_pwritev2,
    libc::SYS_read,
    libc::SYS_readahead,
    libc::SYS_readlink,
    libc::SYS_readlinkat,
    libc::SYS_readv,
    libc::SYS_recvfrom,
    libc::SYS_recvmmsg,
    libc::SYS_recvmsg,
    libc::SYS_remap_file_pages,
    libc::SYS_removexattr,
    libc::SYS_rename,
    libc::SYS_renameat,
    libc::SYS_renameat2,
    libc::SYS_restart_syscall,
    libc::SYS_rmdir,
    334, /* rseq */
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigpending,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigqueueinfo,
    libc::SYS_rt_sigreturn,
    libc::SYS_rt_sigsuspend,
    libc::SYS_rt_sigtimedwait,
    libc::SYS_rt_tgsigqueueinfo,
    libc::SYS_sched_getaffinity,
    libc::SYS_sched_getattr,
    libc::SYS_sched_getparam,
    libc::SYS_sched_get_priority_max,
    libc::SYS_sched_get_priority_min,
    libc::SYS_sched_getscheduler,
    libc::SYS_sched_rr_get_interval,
    libc::SYS_sched_setaffinity,
    libc::SYS_sched_setattr,
    libc::SYS_sched_setparam,
    libc::SYS_sched_setscheduler,
    libc::SYS_sched_yield,
    libc::SYS_seccomp,
    libc::SYS_select,
    libc::SYS_semctl,
    libc::SYS_semget,
    libc::SYS_semop,
    libc::SYS_semtimedop,
    libc::SYS_sendfile,
    libc::SYS_sendmmsg,
    libc::SYS_sendmsg,
    libc::SYS_sendto,
    libc::SYS_setfsgid,
    libc::SYS_setfsuid,
    libc::SYS_setgid,
    libc::SYS_setgroups,
    libc::SYS_setitimer,
    libc::SYS_setpgid,
    libc::SYS_setpriority,
    libc::SYS_setregid,
    libc::SYS_setresgid,
    libc::SYS_setresuid,
    libc::SYS_setreuid,
    libc::SYS_setrlimit,
    libc::SYS_set_robust_list,
    libc::SYS_setsid,
    libc::SYS_setsockopt,
    libc::SYS_set_thread_area,
    libc::SYS_set_tid_address,
    libc::SYS_setuid,
    libc::SYS_setxattr,
    libc::SYS_shmat,
    libc::SYS_shmctl,
    libc::SYS_shmdt,
    libc::SYS_shmget,
    libc::SYS_shutdown,
    libc::SYS_sigaltstack,
    libc::SYS_signalfd,
    libc::SYS_signalfd4,
    libc::SYS_socketpair,
    libc::SYS_splice,
    libc::SYS_stat,
    libc::SYS_statfs,
    332, /* statx */
    libc::SYS_symlink,
    libc::SYS_symlinkat,
    libc::SYS_sync,
    libc::SYS_sync_file_range,
    libc::SYS_syncfs,
    libc::SYS_sysinfo,
    libc::SYS_tee,
    libc::SYS_tgkill,
    libc::SYS_time,
    libc::SYS_timer_create,
    libc::SYS_timer_delete,
    libc::SYS_timer_getoverrun,
    libc::SYS_timer_gettime,
    libc::SYS_timer_settime,
    libc::SYS_timerfd_create,
    libc::SYS_timerfd_gettime,
    libc::SYS_timerfd_settime,
    libc::SYS_times,
    libc::SYS_tkill,
    libc::SYS_truncate,
    libc::SYS_umask,
    libc::SYS_uname,
    libc::SYS_unlink,
    libc::SYS_unlinkat,
    libc::SYS_utime,
    libc::SYS_utimensat,
    libc::SYS_utimes,
    libc::SYS_vfork,
    libc::SYS_vmsplice,
    libc::SYS_wait4,
    libc::SYS_waitid,
    libc::SYS_write,
    libc::SYS_writev,
];

/// Address families `socket` refuses (EPERM, like every refused call here).
pub const DENIED_FAMILIES: [u64; 3] = [libc::AF_VSOCK as u64, libc::AF_PACKET as u64, libc::AF_ALG as u64];

/// `personality` values Docker allows (PER_LINUX, PER_LINUX32, UNAME26 variants, query).
const PERSONALITIES: [u64; 5] = [0x0, 0x8, 0x20000, 0x20008, 0xffff_ffff];

fn build_err(e: impl std::fmt::Display) -> SeccompError {
    SeccompError::Build(e.to_string())
}

/// Compiles the two filters (main allow-list, then the clone3-ENOSYS one); do this before any
/// point where an allocation failure would be awkward, then `install`.
pub fn compile() -> Result<Vec<BpfProgram>, SeccompError> {
    #[cfg(not(target_arch = "x86_64"))]
    {
        return Err(SeccompError::UnsupportedArch);
    }
    #[cfg(target_arch = "x86_64")]
    {
        let arch = seccompiler::TargetArch::x86_64;
        let mut rules: BTreeMap<i64, Vec<SeccompRule>> = ALLOWED.iter().map(|n| (*n, Vec::new())).collect();
        let cond = |i: u8, op: SeccompCmpOp, v: u64| {
            SeccompCondition::new(i, SeccompCmpArgLen::Qword, op, v).map_err(build_err)
        };
        rules.insert(
            libc::SYS_clone,
            vec![SeccompRule::new(vec![cond(0, SeccompCmpOp::MaskedEq(CLONE_NS_FLAGS), 0)?]).map_err(build_err)?],
        );
        let mut pers = Vec::new();
        for p in PERSONALITIES {
            pers.push(SeccompRule::new(vec![cond(0, SeccompCmpOp::Eq, p)?]).map_err(build_err)?);
        }
        rules.insert(libc::SYS_personality, pers);
        // One rule, all conditions at once: the family is none of the denied ones. The
        // family is an int: compare the low 32 bits only.
        let families = DENIED_FAMILIES
            .iter()
            .map(|f| SeccompCondition::new(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Ne, *f).map_err(build_err))
            .collect::<Result<Vec<_>, _>>()?;
        rules.insert(libc::SYS_socket, vec![SeccompRule::new(families).map_err(build_err)?]);
        let main = SeccompFilter::new(rules, SeccompAction::Errno(libc::EPERM as u32), SeccompAction::Allow, arch)
            .map_err(build_err)?;
        let clone3: BTreeMap<i64, Vec<SeccompRule>> = [(435, Vec::new())].into_iter().collect();
        let enosys = SeccompFilter::new(clone3, SeccompAction::Allow, SeccompAction::Errno(libc::ENOSYS as u32), arch)
            .map_err(build_err)?;
        Ok(vec![main.try_into().map_err(build_err)?, enosys.try_into().map_err(build_err)?])
    }
}

/// Installs compiled filters on the calling thread, in order, without setting `no_new_privs`
/// (as Docker does): the caller must hold `CAP_SYS_ADMIN` in its user namespace, so it runs
/// before the capabilities are dropped. Setuid programs in the sandbox (`sudo`, which E2B's
/// templates give their user) then work, gaining at most the bounding set's capabilities,
/// over the sandbox's own namespaces.
pub fn install(progs: &[BpfProgram]) -> Result<(), SeccompError> {
    for p in progs {
        install_one(p)?;
    }
    Ok(())
}

#[allow(unsafe_code)]
fn install_one(prog: &BpfProgram) -> Result<(), SeccompError> {
    const SECCOMP_SET_MODE_FILTER: libc::c_ulong = 1;
    let len = u16::try_from(prog.len()).map_err(|_| SeccompError::Install("filter too long".into()))?;
    // seccompiler's instructions have the kernel's `struct sock_filter` layout.
    let fprog = libc::sock_fprog { len, filter: prog.as_ptr() as *mut libc::sock_filter };
    // SAFETY: `fprog` points at `prog`'s instructions, alive for the call; the kernel copies
    // the program and keeps no pointer into our memory.
    let rc = unsafe { libc::syscall(libc::SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0 as libc::c_ulong, &fprog) };
    if rc != 0 {
        return Err(SeccompError::Install(std::io::Error::last_os_error().to_string()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn filters_compile() {
        let progs = super::compile().unwrap();
        assert_eq!(progs.len(), 2);
        assert!(progs.iter().all(|p| !p.is_empty()));
    }
}
