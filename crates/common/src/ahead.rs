//! Logs written over zeros written ahead of them.
//!
//! A sync after a write that grew a file must commit the new size through the file system's
//! journal (on ext4 a journal commit, about half again the cost of the sync); a sync after a
//! write over bytes already in the file only writes data. A log that writes zeros ahead of its
//! end, a chunk at a time, and its frames over them, pays the first kind once per chunk. A
//! log written this way must read a header of zeros as its end, and may find zeros (or frames
//! written over them and not yet synced) after its last frame after a crash.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

/// Zeros written ahead at least and at most: an eighth of the log between.
pub const AHEAD_MIN: u64 = 64 << 10;
pub const AHEAD_MAX: u64 = 1 << 20;

/// Writes `bytes` at `len` (the end of the log's frames) over zeros written ahead when the
/// file holds enough (`alloc`: its size). When it does not, first more zeros: an eighth of
/// the log, within [`AHEAD_MIN`]..=[`AHEAD_MAX`]; should they not fit on the disk, what was
/// written of them is given back and the bytes are written without them. Updates `alloc`;
/// the caller moves `len` on once the write succeeded, and cuts a failed one off.
pub fn write_at_end(file: &File, len: u64, alloc: &mut u64, bytes: &[u8]) -> io::Result<()> {
    static ZEROS: [u8; 64 << 10] = [0; 64 << 10];
    let end = len + bytes.len() as u64;
    if end > *alloc {
        let target = end + (len / 8).clamp(AHEAD_MIN, AHEAD_MAX);
        let zeros = (*alloc..target).step_by(ZEROS.len()).try_for_each(|at| {
            let n = (target - at).min(ZEROS.len() as u64) as usize;
            file.write_all_at(&ZEROS[..n], at)
        });
        match zeros {
            Ok(()) => *alloc = target,
            // The disk is full: give back what was written ahead, then try the bytes.
            Err(_) => {
                let _ = file.set_len(*alloc);
            }
        }
    }
    file.write_all_at(bytes, len)?;
    *alloc = (*alloc).max(end);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_go_over_zeros_written_ahead_in_chunks() {
        let dir = tempfile::tempdir().unwrap();
        let file =
            File::options().read(true).write(true).create(true).truncate(true).open(dir.path().join("log")).unwrap();
        let (mut len, mut alloc) = (0u64, 0u64);
        let mut grew = 0;
        for i in 0..5_000u32 {
            let frame = vec![(i % 250 + 1) as u8; 300];
            let before = alloc;
            write_at_end(&file, len, &mut alloc, &frame).unwrap();
            grew += usize::from(alloc != before);
            len += frame.len() as u64;
            assert!(alloc >= len + if alloc == before { 0 } else { AHEAD_MIN }, "{len} in {alloc}");
            assert!(alloc <= len + AHEAD_MAX);
            assert_eq!(file.metadata().unwrap().len(), alloc);
        }
        // 1.5 MB of frames in chunks of 64 KiB up to an eighth: far fewer growths than writes.
        assert!((5..=30).contains(&grew), "{grew}");
        let mut read = vec![0u8; alloc as usize];
        file.read_exact_at(&mut read, 0).unwrap();
        assert!(read[len as usize..].iter().all(|b| *b == 0));
        assert_eq!(read[len as usize - 1], (4_999 % 250 + 1) as u8);
    }
}
