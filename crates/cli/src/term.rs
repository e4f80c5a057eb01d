//! What a sandbox's output may do to the terminal it is shown on. A workload's bytes are
//! untrusted, and a terminal obeys escape sequences: some answer with bytes typed as if by the
//! user (device status and window reports), some set the clipboard (OSC 52) or the title, some
//! switch mouse reporting on. When the CLI prints a command's output to a terminal it passes
//! text, tabs, newlines, carriage returns, backspaces and the harmless CSI sequences (colours,
//! cursor movement, erasing the screen but not its scrollback), and drops every other control:
//! other C0 bytes, C1 controls (as UTF-8 `U+0080..U+009F` or as raw bytes), bytes that are no
//! valid UTF-8, lone escapes, and the string sequences (OSC, DCS, SOS, PM, APC) whole. Output that goes to a file or a pipe is passed as it is.

/// The longest CSI sequence passed on; a longer one is dropped.
const MAX_CSI: usize = 64;
/// A string sequence longer than this is taken to be binary garbage rather than a sequence:
/// what follows it is shown again.
const MAX_STRING: usize = 4096;

#[derive(Debug, Default)]
enum State {
    #[default]
    Ground,
    /// After ESC.
    Esc,
    /// Inside `ESC [`: the bytes after the bracket.
    Csi(Vec<u8>),
    /// Inside a string sequence, with how many bytes it has swallowed.
    Str(usize),
    /// After ESC inside a string sequence (ESC \ ends it).
    StrEsc(usize),
    /// After 0xC2, which starts the UTF-8 form of a C1 control or of U+00A0..U+00BF.
    C2,
    /// Inside another UTF-8 sequence: the bytes so far, and how many continuation bytes are
    /// still to come.
    Utf8(Vec<u8>, usize),
}

/// A filter over one output stream; sequences may span the chunks given to [`Self::filter`].
#[derive(Debug, Default)]
pub struct TermFilter {
    state: State,
}

impl TermFilter {
    pub fn new() -> TermFilter {
        TermFilter::default()
    }

    /// What of `input` may reach a terminal.
    pub fn filter(&mut self, input: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(input.len());
        for &b in input {
            self.byte(b, &mut out);
        }
        out
    }

    fn byte(&mut self, b: u8, out: &mut Vec<u8>) {
        match std::mem::take(&mut self.state) {
            State::Ground => self.ground(b, out),
            State::C2 => match b {
                0x80..=0x9f => {}
                0xa0..=0xbf => out.extend_from_slice(&[0xc2, b]),
                _ => self.ground(b, out),
            },
            State::Utf8(mut seq, left) => {
                if (0x80..=0xbf).contains(&b) {
                    seq.push(b);
                    if left == 1 {
                        out.extend_from_slice(&seq);
                    } else {
                        self.state = State::Utf8(seq, left - 1);
                    }
                } else {
                    // A broken sequence is dropped; the byte is read afresh.
                    self.ground(b, out);
                }
            }
            State::Esc => match b {
                b'[' => self.state = State::Csi(Vec::new()),
                b']' | b'P' | b'X' | b'^' | b'_' => self.state = State::Str(0),
                // Any other escape is dropped with the byte after it.
                _ => {}
            },
            State::Csi(mut seq) => match b {
                0x20..=0x3f if seq.len() < MAX_CSI => {
                    seq.push(b);
                    self.state = State::Csi(seq);
                }
                0x40..=0x7e => {
                    if safe_csi(&seq, b) {
                        out.extend_from_slice(b"\x1b[");
                        out.extend_from_slice(&seq);
                        out.push(b);
                    }
                }
                // Too long, or a byte no sequence holds: dropped, the byte read afresh.
                _ => self.ground(b, out),
            },
            State::Str(n) => match b {
                0x07 => {}
                0x1b => self.state = State::StrEsc(n + 1),
                _ if n + 1 >= MAX_STRING => {}
                _ => self.state = State::Str(n + 1),
            },
            State::StrEsc(n) => {
                if b != b'\\' {
                    self.state = State::Str(n + 1);
                }
            }
        }
    }

    fn ground(&mut self, b: u8, out: &mut Vec<u8>) {
        match b {
            0x1b => self.state = State::Esc,
            b'\t' | b'\n' | b'\r' | 0x08 => out.push(b),
            0x00..=0x1f => {}
            0x20..=0x7f => out.push(b),
            0xc2 => self.state = State::C2,
            0xc3..=0xdf => self.state = State::Utf8(vec![b], 1),
            0xe0..=0xef => self.state = State::Utf8(vec![b], 2),
            0xf0..=0xf4 => self.state = State::Utf8(vec![b], 3),
            // A stray continuation byte (0x80..0x9f act as C1 controls on terminals not in
            // UTF-8 mode) or a byte no UTF-8 has.
            _ => {}
        }
    }
}

/// Colours (SGR), cursor movement and erasing, with plain numeric parameters; nothing that
/// makes the terminal answer, switch modes or report.
fn safe_csi(params: &[u8], last: u8) -> bool {
    params.iter().all(|c| c.is_ascii_digit() || *c == b';' || *c == b':')
        && match last {
            b'm' | b'A' | b'B' | b'C' | b'D' | b'E' | b'F' | b'G' | b'H' | b'f' | b'K' => true,
            // Not 3: the terminal's scrollback (what the operator saw before).
            b'J' => matches!(params, b"" | b"0" | b"1" | b"2"),
            _ => false,
        }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(chunks: &[&[u8]]) -> Vec<u8> {
        let mut f = TermFilter::new();
        chunks.iter().flat_map(|c| f.filter(c)).collect()
    }

    #[test]
    fn text_colours_and_layout_pass() {
        let s = "héllo\tworld\r\n\x1b[1;31mred\x1b[0m \x1b[2K\x1b[10D\x08ok ünïcode \u{00a0}€";
        assert_eq!(run(&[s.as_bytes()]), s.as_bytes());
    }

    #[test]
    fn what_makes_a_terminal_answer_or_remember_is_dropped() {
        // Clipboard (OSC 52, BEL and ST ends), title, device status and attributes reports,
        // window reports, mode switches, DCS, C1 CSI (as UTF-8 and raw), clearing the
        // scrollback, bytes no UTF-8 has, a broken sequence, other C0 bytes and lone escapes.
        let hostile: &[&[u8]] = &[
            b"a\x1b]52;c;aGVsbG8=\x07b",
            b"c\x1b]0;title\x1b\\d",
            b"e\x1b[6nf\x1b[cg\x1b[21th\x1b[?1000hi\x1b[?2004lj",
            b"k\x1bPq#0;2;0;0;0\x1b\\l",
            "m\u{009b}6n".as_bytes(),
            b"\x9b6n\x1b[3J\x1b[2J\xff\xe2\x82",
            b"o\x00\x05\x7fp\x1bcq\x1b7",
        ];
        let out = run(hostile);
        assert_eq!(String::from_utf8(out).unwrap(), "abcdefghijklm6n6n\x1b[2Jo\u{7f}pq");
    }

    #[test]
    fn sequences_split_over_chunks_are_still_seen() {
        assert_eq!(run(&[b"x\x1b", b"]52;c;", b"AAAA\x1b", b"\\y"]), b"xy");
        assert_eq!(run(&[b"\x1b[3", b"1mz"]), b"\x1b[31mz");
        assert_eq!(run(&[b"\xc2", b"\x9b6n"]), b"6n");
        assert_eq!(run(&[b"\xc2", b"\xa0"]), "\u{a0}".as_bytes());
        assert_eq!(run(&[b"\xe2\x82", b"\xac!"]), "€!".as_bytes());
        assert_eq!(run(&[b"\xf0\x9f", b"\x98\x80"]), "😀".as_bytes());
    }

    #[test]
    fn an_unterminated_string_swallows_only_so_much() {
        let mut input = b"\x1b]".to_vec();
        input.extend(std::iter::repeat_n(b'x', MAX_STRING + 10));
        let out = run(&[&input, b"after"]);
        assert!(out.ends_with(b"after"), "{}", String::from_utf8_lossy(&out));
        assert!(out.len() < 100, "{} bytes came out", out.len());
    }
}
