//! Human-readable tables for list commands: a header row and columns padded to their widest
//! cell (counted in characters, not bytes). `--json` prints the full objects instead; tables are
//! for people and may drop columns a script would want. Cells lose their control characters.

/// A table being built: headers, then rows of the same length.
#[derive(Debug)]
pub struct Table {
    headers: Vec<&'static str>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(headers: &[&'static str]) -> Table {
        Table { headers: headers.to_vec(), rows: Vec::new() }
    }

    /// Adds a row; missing cells print empty, extra cells are dropped. Control characters in
    /// a cell (a process's command line or tag comes from the sandbox) show as `?`: a table
    /// is for a terminal, and must not drive it.
    pub fn row(&mut self, cells: Vec<String>) -> &mut Table {
        let mut cells: Vec<String> = cells
            .into_iter()
            .map(|c| {
                if c.chars().any(char::is_control) {
                    c.chars().map(|ch| if ch.is_control() { '?' } else { ch }).collect()
                } else {
                    c
                }
            })
            .collect();
        cells.resize(self.headers.len(), String::new());
        self.rows.push(cells);
        self
    }

    /// The table as text; `empty` when it has no rows (so a list that found nothing says so
    /// instead of printing a lone header).
    pub fn render(&self, empty: &str) -> String {
        if self.rows.is_empty() {
            return empty.to_string();
        }
        let mut widths: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for r in &self.rows {
            for (w, c) in widths.iter_mut().zip(r) {
                *w = (*w).max(c.chars().count());
            }
        }
        let line = |cells: &mut dyn Iterator<Item = &str>| {
            let mut s = String::new();
            for (i, (c, w)) in cells.zip(&widths).enumerate() {
                if i + 1 == widths.len() {
                    s.push_str(c);
                } else {
                    s.push_str(c);
                    s.extend(std::iter::repeat_n(' ', w - c.chars().count() + 2));
                }
            }
            s.trim_end().to_string()
        };
        let mut out = vec![line(&mut self.headers.iter().copied())];
        for r in &self.rows {
            out.push(line(&mut r.iter().map(String::as_str)));
        }
        out.join("\n")
    }
}

/// A duration in seconds for people: `42s`, `5m`, `3h`, `2d`.
pub fn age(secs: u64) -> String {
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s if s < 172_800 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_align_on_the_widest_cell() {
        let mut t = Table::new(&["ID", "STATE", "IMAGE"]);
        t.row(vec!["a.1".into(), "running".into(), "debian:bookworm".into()]);
        t.row(vec!["edge-long.22".into(), "päused".into()]);
        assert_eq!(
            t.render("none"),
            "ID            STATE    IMAGE\na.1           running  debian:bookworm\nedge-long.22  päused"
        );
    }

    #[test]
    fn an_empty_table_says_so() {
        assert_eq!(Table::new(&["ID"]).render("no sandboxes"), "no sandboxes");
    }

    #[test]
    fn ages() {
        assert_eq!(age(5), "5s");
        assert_eq!(age(600), "10m");
        assert_eq!(age(3 * 3600), "3h");
        assert_eq!(age(3 * 86_400), "3d");
    }
}
