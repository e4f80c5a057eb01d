//! The standalone store's write-ahead log, `iam.wal` beside `iam.redb`.
//!
//! A commit writes its rows (what its transaction writes into redb) as one checksummed frame
//! and syncs it: that is when the commit is durable. redb then takes the rows without a sync
//! of its own. A redb commit writes pages all over its file (about nine for one lease); a frame
//! is one write at the log's end, over zeros written ahead ([`opendsec_common::ahead`]), so
//! its sync writes data only (on this machine's disk, a commit of one lease: 365–450 µs through
//! redb, its frame's sync about 140 µs).
//!
//! Frames are numbered; each redb commit records the number of the last frame whose rows it
//! holds (a commit too large for a frame goes to redb synced, and takes a number of its own).
//! A checkpoint makes redb durable (one synced commit) and then empties the log. On open,
//! the frames are read up to the first that does not check out (only one being written at a
//! crash can be torn, and zeros are no frame); those numbered after what redb holds are
//! written into it in one synced commit, and the log is emptied.
//!
//! Invariants:
//! - a frame's rows reach redb only after the frame is durable;
//! - the log is emptied only after a synced redb commit that holds every frame in it; should
//!   emptying fail, the numbers keep the frames from being written into redb again;
//! - after a failed write the log's end is cut back, and after a failed sync nothing more is
//!   written (the kernel reports a writeback error once: a later sync would succeed over lost
//!   pages); the store must be reopened.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::command::Table;
use crate::error::IamError;

/// The log's file name inside the data dir.
pub const WAL_FILE: &str = "iam.wal";
/// Frame: body length (u32 LE), CRC-32 of the body (u32 LE), then the body: the frame's number
/// (u64 LE), then rows, each the table's name (u8 length, name), the key (u32 length, key) and
/// the value (u32 length + 1, value; 0 for a removal). A header of zeros is no frame.
const HEADER: usize = 8;
/// The largest frame body (a commit of 1,000 admissions is about 1 MB; a restored backup may
/// be far larger: it goes to redb synced instead).
pub const MAX_BODY: usize = 64 << 20;

/// One frame read back: its number and rows.
pub type Frame = (u64, Vec<(Table, String, Option<String>)>);

/// One row as a commit writes it: its table, key and stored JSON (`None`: removed).
pub type RowWrite<'a> = (Table, &'a str, Option<&'a str>);
/// A row encoded, the JSON owned.
pub type EncodedRow<'a> = (Table, &'a str, Option<String>);

#[derive(Debug)]
pub struct Wal {
    file: File,
    path: PathBuf,
    /// Bytes of whole frames.
    len: u64,
    /// Bytes in the file: the frames, then zeros written ahead.
    alloc: u64,
    /// The number the next frame takes.
    next: u64,
    /// Why nothing more is written (a failed sync, a failed cut).
    broken: Option<String>,
}

fn err(op: &'static str) -> impl FnOnce(std::io::Error) -> IamError {
    move |source| IamError::Wal { op, source }
}

/// The size of the body of a frame of `rows`.
pub fn body_size(rows: &[RowWrite<'_>]) -> usize {
    8 + rows.iter().map(|(t, k, v)| 1 + t.name().len() + 4 + k.len() + 4 + v.map_or(0, str::len)).sum::<usize>()
}

/// Frame number `seq`, of `rows`.
fn frame(seq: u64, rows: &[RowWrite<'_>]) -> Vec<u8> {
    let size = body_size(rows);
    let mut out = Vec::with_capacity(HEADER + size);
    out.extend_from_slice(&(size as u32).to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&seq.to_le_bytes());
    for (table, key, value) in rows {
        out.push(table.name().len() as u8);
        out.extend_from_slice(table.name().as_bytes());
        out.extend_from_slice(&(key.len() as u32).to_le_bytes());
        out.extend_from_slice(key.as_bytes());
        match value {
            Some(v) => {
                out.extend_from_slice(&(v.len() as u32 + 1).to_le_bytes());
                out.extend_from_slice(v.as_bytes());
            }
            None => out.extend_from_slice(&0u32.to_le_bytes()),
        }
    }
    let crc = crc32fast::hash(&out[HEADER..]);
    out[4..HEADER].copy_from_slice(&crc.to_le_bytes());
    out
}

/// The number and rows of a frame body, or `None` if it is not one.
fn rows_of(mut body: &[u8]) -> Option<Frame> {
    fn take<'b>(buf: &mut &'b [u8], n: usize) -> Option<&'b [u8]> {
        let (head, rest) = (buf.get(..n)?, buf.get(n..)?);
        *buf = rest;
        Some(head)
    }
    fn u32_of(buf: &mut &[u8]) -> Option<u32> {
        Some(u32::from_le_bytes(take(buf, 4)?.try_into().ok()?))
    }
    let seq = u64::from_le_bytes(take(&mut body, 8)?.try_into().ok()?);
    let mut rows = Vec::new();
    while !body.is_empty() {
        let n = *take(&mut body, 1)?.first()? as usize;
        let table = Table::named(std::str::from_utf8(take(&mut body, n)?).ok()?)?;
        let n = u32_of(&mut body)? as usize;
        let key = std::str::from_utf8(take(&mut body, n)?).ok()?.to_string();
        let value = match u32_of(&mut body)? {
            0 => None,
            n => Some(std::str::from_utf8(take(&mut body, n as usize - 1)?).ok()?.to_string()),
        };
        rows.push((table, key, value));
    }
    (!rows.is_empty()).then_some((seq, rows))
}

/// The frames at the start of `bytes`, up to the first that does not check out, and the
/// bytes they take.
fn scan(bytes: &[u8]) -> (Vec<Frame>, u64) {
    let mut frames = Vec::new();
    let mut at = 0usize;
    while let Some(header) = bytes.get(at..at + HEADER) {
        let len = u32::from_le_bytes(header[0..4].try_into().expect("4 bytes")) as usize;
        let crc = u32::from_le_bytes(header[4..8].try_into().expect("4 bytes"));
        let Some(body) = bytes.get(at + HEADER..at + HEADER + len).filter(|_| len > 0 && len <= MAX_BODY) else {
            break;
        };
        if crc32fast::hash(body) != crc {
            break;
        }
        let Some(rows) = rows_of(body) else { break };
        frames.push(rows);
        at += HEADER + len;
    }
    (frames, at as u64)
}

impl Wal {
    /// Opens (creates) the log in `dir`; answers it with its frames, in order. The caller
    /// writes those numbered after what redb holds into it, syncs it, then [`Wal::empty`]s
    /// the log and says where numbering goes on ([`Wal::number_from`]).
    pub fn open(dir: &Path) -> Result<(Wal, Vec<Frame>), IamError> {
        let path = dir.join(WAL_FILE);
        let file =
            File::options().read(true).write(true).create(true).truncate(false).open(&path).map_err(err("open"))?;
        let size = file.metadata().map_err(err("stat"))?.len();
        let mut bytes = vec![0u8; size as usize];
        file.read_exact_at(&mut bytes, 0).map_err(err("read"))?;
        let (frames, len) = scan(&bytes);
        if len < size {
            if bytes[len as usize..].iter().any(|b| *b != 0) {
                tracing::warn!(path = %path.display(), at = len, size, "iam log: a torn frame after the last whole one is dropped");
            }
            // Cut: frames written later must be followed by zeros, never by what was torn.
            file.set_len(len).map_err(err("cut"))?;
            file.sync_all().map_err(err("sync"))?;
        }
        let next = frames.last().map_or(1, |(seq, _)| seq + 1);
        Ok((Wal { file, path, len, alloc: len, next, broken: None }, frames))
    }

    /// Numbers frames from after `last` on, if that is further than the log's own frames.
    pub fn number_from(&mut self, last: u64) {
        self.next = self.next.max(last + 1);
    }

    /// Takes the next frame's number without a frame: for a commit that goes to redb synced.
    pub fn skip(&mut self) -> u64 {
        self.next += 1;
        self.next - 1
    }

    /// The number the next frame (or commit) takes.
    pub fn next(&self) -> u64 {
        self.next
    }

    /// Bytes of frames in the log.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends frame number [`Wal::next`] of `rows` (at most [`MAX_BODY`]) and syncs it:
    /// once this returns, the commit is durable.
    pub fn append(&mut self, rows: &[RowWrite<'_>]) -> Result<u64, IamError> {
        if let Some(why) = &self.broken {
            return Err(IamError::Wal { op: "append", source: std::io::Error::other(why.clone()) });
        }
        if body_size(rows) > MAX_BODY {
            return Err(IamError::Invariant("a commit too large for the log was given to it"));
        }
        let bytes = frame(self.next, rows);
        if let Err(e) = opendsec_common::ahead::write_at_end(&self.file, self.len, &mut self.alloc, &bytes) {
            // Cut back: a later frame shorter than this one must not leave a whole stale one
            // after it (a write that failed may have written all of it).
            match self.file.set_len(self.len) {
                Ok(()) => self.alloc = self.len,
                Err(c) => self.broken = Some(format!("a failed write could not be cut back: {c}")),
            }
            return Err(IamError::Wal { op: "write", source: e });
        }
        if let Err(e) = self.file.sync_data() {
            self.broken = Some(format!("a sync failed: {e}"));
            return Err(IamError::Wal { op: "sync", source: e });
        }
        self.len += bytes.len() as u64;
        Ok(self.skip())
    }

    /// Empties the log (after a synced redb commit that holds all its rows).
    pub fn empty(&mut self) -> Result<(), IamError> {
        self.file.set_len(0).map_err(err("truncate"))?;
        (self.len, self.alloc) = (0, 0);
        if let Err(e) = self.file.sync_all() {
            self.broken = Some(format!("a sync failed: {e}"));
            return Err(IamError::Wal { op: "sync", source: e });
        }
        tracing::trace!(path = %self.path.display(), "iam log emptied");
        Ok(())
    }

    /// Whether a failure stopped the log's writes (until the store is reopened).
    pub fn is_broken(&self) -> bool {
        self.broken.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(i: u32) -> Frame {
        (
            u64::from(i) + 1,
            vec![
                (Table::Leases, format!("lease-{i}"), Some(format!("{{\"v\":1,\"n\":{i}}}"))),
                (Table::Meta, "meta".into(), Some("{\"v\":1}".into())),
                (Table::Leases, format!("gone-{i}"), None),
            ],
        )
    }

    fn borrowed(f: &Frame) -> Vec<RowWrite<'_>> {
        f.1.iter().map(|(t, k, v)| (*t, k.as_str(), v.as_deref())).collect()
    }

    fn put(wal: &mut Wal, i: u32) {
        let f = rows(i);
        assert_eq!(wal.next(), f.0);
        assert_eq!(wal.append(&borrowed(&f)).unwrap(), f.0);
    }

    #[test]
    fn frames_come_back_in_order_and_a_torn_one_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let (mut wal, frames) = Wal::open(dir.path()).unwrap();
        assert!(frames.is_empty());
        for i in 0..100 {
            put(&mut wal, i);
        }
        let whole = wal.len();
        // The file holds zeros after the frames.
        assert!(std::fs::metadata(dir.path().join(WAL_FILE)).unwrap().len() > whole);
        drop(wal);
        let (_, frames) = Wal::open(dir.path()).unwrap();
        assert_eq!(frames, (0..100).map(rows).collect::<Vec<_>>());

        // A frame torn at every possible length is dropped, and those before it stay.
        let f = rows(100);
        let last = frame(f.0, &borrowed(&f));
        // (Cut within its trailing zeros, a frame is whole.)
        let torn = last.iter().rposition(|b| *b != 0).unwrap() + 1;
        for cut in 1..torn {
            let f = File::options().write(true).open(dir.path().join(WAL_FILE)).unwrap();
            f.write_all_at(&last[..cut], whole).unwrap();
            f.write_all_at(&vec![0; last.len() - cut], whole + cut as u64).unwrap();
            let (wal, frames) = Wal::open(dir.path()).unwrap();
            assert_eq!((frames.len(), wal.len()), (100, whole), "cut at {cut}");
        }
        // A damaged byte inside a frame ends the log there.
        let f = File::options().write(true).open(dir.path().join(WAL_FILE)).unwrap();
        f.write_all_at(&[0xff], whole / 2).unwrap();
        let (_, frames) = Wal::open(dir.path()).unwrap();
        assert!(frames.len() < 100 && frames[..] == (0..frames.len() as u32).map(rows).collect::<Vec<_>>()[..]);
    }

    #[test]
    fn an_emptied_log_gives_nothing_back_and_takes_new_frames() {
        let dir = tempfile::tempdir().unwrap();
        let (mut wal, _) = Wal::open(dir.path()).unwrap();
        for i in 0..10 {
            put(&mut wal, i);
        }
        wal.empty().unwrap();
        assert!(wal.is_empty());
        // Numbering goes on.
        put(&mut wal, 10);
        drop(wal);
        let (mut wal, frames) = Wal::open(dir.path()).unwrap();
        assert_eq!(frames, vec![rows(10)]);
        assert_eq!(wal.next(), 12);
        wal.empty().unwrap();
        drop(wal);
        // An empty log numbers from where redb says.
        let (mut wal, frames) = Wal::open(dir.path()).unwrap();
        assert!(frames.is_empty());
        wal.number_from(11);
        assert_eq!(wal.next(), 12);
        drop(wal);
        // A torn frame alone is cut off on open: later frames are followed by zeros only.
        let f = rows(20);
        let torn = frame(f.0, &borrowed(&f));
        std::fs::write(dir.path().join(WAL_FILE), &torn[..torn.len() - 5]).unwrap();
        let (mut wal, frames) = Wal::open(dir.path()).unwrap();
        assert!(frames.is_empty());
        assert_eq!(std::fs::metadata(dir.path().join(WAL_FILE)).unwrap().len(), 0);
        put(&mut wal, 0);
        let written = wal.len() as usize;
        let bytes = std::fs::read(dir.path().join(WAL_FILE)).unwrap();
        assert!(bytes[written..].iter().all(|b| *b == 0));
    }

    #[test]
    fn bodies_that_are_not_rows_are_refused() {
        assert_eq!(rows_of(b""), None);
        assert_eq!(rows_of(&7u64.to_le_bytes()), None);
        // A table nobody knows.
        let mut body = 7u64.to_le_bytes().to_vec();
        body.push(5);
        body.extend_from_slice(b"nopes");
        body.extend_from_slice(&0u32.to_le_bytes());
        body.extend_from_slice(&0u32.to_le_bytes());
        assert_eq!(rows_of(&body), None);
        // A key longer than the body.
        let mut body = 7u64.to_le_bytes().to_vec();
        body.push(6);
        body.extend_from_slice(b"leases");
        body.extend_from_slice(&1000u32.to_le_bytes());
        assert_eq!(rows_of(&body), None);
    }
}
