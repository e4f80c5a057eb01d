//! A VM copy's own start after a restore from another sandbox's memory snapshot (the edge's
//! `PostRestore`, [C 7] "aether/restore"): every copy of one snapshot wakes up as the same
//! machine, with the same hostname, machine-id and, worst of all, the same state of the
//! kernel's random generator, so two copies would draw the same "random" numbers (keys,
//! UUIDs, TLS nonces). This gives it a hostname and machine-id of its own, mixes bytes from the
//! host's random source into the entropy pool and has the kernel reseed its generator from it.
//! It runs as soon as the copy's agent answers: the copy's processes have run on for that long
//! (under a second when it answers at once), and what they drew before, or keep in generators of
//! their own (a process's seeded PRNG, a TLS library's pool), is the source's. QEMU 7.2's
//! microvm has no generation-id device (its ACPI tables carry none) to reseed the kernel at
//! the restore itself. The clock is set by the serial port's handshake.

use std::path::Path;

use crate::error::AgentError;

/// Fewest and most seed bytes the edge may send.
const SEED_BYTES: std::ops::RangeInclusive<usize> = 16..=512;

/// Whether `h` is a hostname the agent sets (one label: letters, digits, '-').
pub fn valid_hostname(h: &str) -> bool {
    !h.is_empty() && h.len() <= 63 && h.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// `/etc/hosts` naming `hostname`, replaced, never written through (it may be a symlink the
/// sandbox planted); an image without `/etc` gets none.
pub fn write_hosts(hostname: &str) -> Result<(), AgentError> {
    let text = format!("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t{hostname}\n");
    replace_in_etc("hosts", text.as_bytes())
}

fn replace_in_etc(name: &str, data: &[u8]) -> Result<(), AgentError> {
    if !Path::new("/etc").is_dir() {
        return Ok(());
    }
    let path = Path::new("/etc").join(name);
    let _ = std::fs::remove_file(&path);
    std::fs::write(&path, data).map_err(|e| AgentError::fs("write", &path, e))
}

/// Checks a request before anything changes.
pub fn check(hostname: &str, machine_id: &str, seed: &[u8]) -> Result<(), AgentError> {
    if !valid_hostname(hostname) {
        return Err(AgentError::Invalid(format!("bad hostname {:?}", hostname.chars().take(64).collect::<String>())));
    }
    if machine_id.len() != 32 || !machine_id.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return Err(AgentError::Invalid("a machine-id is 32 lowercase hex digits".into()));
    }
    if !SEED_BYTES.contains(&seed.len()) {
        return Err(AgentError::Invalid(format!(
            "a random seed is {}..={} bytes, got {}",
            SEED_BYTES.start(),
            SEED_BYTES.end(),
            seed.len()
        )));
    }
    Ok(())
}

/// The copy's own identity (see the module's text). Only in a VM: it sets the kernel's
/// hostname and reseeds its random generator, which a container's agent may not and must not.
pub fn post_restore(hostname: &str, machine_id: &str, seed: &[u8]) -> Result<(), AgentError> {
    check(hostname, machine_id, seed)?;
    reseed(seed)?;
    rustix::system::sethostname(hostname.as_bytes())
        .map_err(|e| AgentError::fs("set", Path::new("/proc/sys/kernel/hostname"), e.into()))?;
    write_hosts(hostname)?;
    replace_in_etc("machine-id", format!("{machine_id}\n").as_bytes())
}

/// `RNDRESEEDCRNG`: `_IO('R', 0x07)`, the kernel's random generator reseeded from its pool now.
const RNDRESEEDCRNG: rustix::ioctl::Opcode = rustix::ioctl::opcode::none(b'R', 0x07);

fn reseed(seed: &[u8]) -> Result<(), AgentError> {
    let dev = Path::new("/dev/urandom");
    // Written bytes are mixed into the input pool (not credited: the host is trusted to be
    // random, the guest need not count on it); the reseed then draws from that pool.
    let f = std::fs::OpenOptions::new().write(true).open(dev).map_err(|e| AgentError::fs("open", dev, e))?;
    std::io::Write::write_all(&mut &f, seed).map_err(|e| AgentError::fs("write", dev, e))?;
    // SAFETY: RNDRESEEDCRNG takes no argument and reads or writes no memory of ours; `f` is an
    // open descriptor of /dev/urandom for the whole call.
    unsafe { rustix::ioctl::ioctl(&f, rustix::ioctl::NoArg::<RNDRESEEDCRNG>::new()) }
        .map_err(|e| AgentError::fs("reseed from", dev, e.into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_requests_are_refused_before_anything_changes() {
        let seed = [7u8; 32];
        let id = "0123456789abcdef0123456789abcdef";
        check("copy-1", id, &seed).unwrap();
        for h in ["", "a.b", "x y", &"a".repeat(64), "caf\u{e9}"] {
            assert!(check(h, id, &seed).is_err(), "{h:?}");
        }
        for m in ["", "0123", &id.to_uppercase(), &format!("{id}0"), "g123456789abcdef0123456789abcdef"] {
            assert!(check("h", m, &seed).is_err(), "{m:?}");
        }
        assert!(check("h", id, &[1u8; 15]).is_err());
        assert!(check("h", id, &[1u8; 513]).is_err());
    }
}
