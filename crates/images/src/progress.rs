//! The import progress display: one bar per layer download (bytes) that turns into a spinner
//! while the layer unpacks.
//!
//! Shown only when asked for and stderr is a terminal; otherwise every call is a no-op, so the
//! import code calls it unconditionally.

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

/// The display of one import.
#[derive(Debug)]
pub struct Progress {
    multi: Option<MultiProgress>,
}

impl Progress {
    pub fn new(enabled: bool) -> Progress {
        let multi = (enabled && std::io::stderr().is_terminal())
            .then(|| MultiProgress::with_draw_target(ProgressDrawTarget::stderr()));
        Progress { multi }
    }

    /// A line for one layer: `label` (a short digest) and its download size.
    pub fn layer(&self, label: &str, total_bytes: u64) -> LayerProgress {
        let bar = self.multi.as_ref().map(|m| {
            let style =
                ProgressStyle::with_template("{prefix:.bold} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} {msg}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar())
                    .progress_chars("=> ");
            let b = m.add(ProgressBar::new(total_bytes).with_style(style).with_prefix(label.to_string()));
            b.set_message("waiting");
            b
        });
        LayerProgress { bar }
    }

    /// A line for a layer already in the store.
    pub fn reused(&self, label: &str) {
        if let Some(m) = &self.multi {
            let b = m.add(ProgressBar::new(0).with_style(spinner_style()).with_prefix(label.to_string()));
            b.finish_with_message("already in the store");
        }
    }
}

fn spinner_style() -> ProgressStyle {
    ProgressStyle::with_template("{prefix:.bold} {spinner} {msg} {elapsed}")
        .unwrap_or_else(|_| ProgressStyle::default_spinner())
}

/// One layer's line; cheap to clone and to update from a download task.
#[derive(Debug, Clone)]
pub struct LayerProgress {
    bar: Option<ProgressBar>,
}

impl LayerProgress {
    /// A line that shows nothing.
    pub fn hidden() -> LayerProgress {
        LayerProgress { bar: None }
    }

    pub fn downloading(&self) {
        if let Some(b) = &self.bar {
            b.set_message("downloading");
        }
    }

    pub fn inc(&self, bytes: u64) {
        if let Some(b) = &self.bar {
            b.inc(bytes);
        }
    }

    pub fn downloaded(&self) {
        if let Some(b) = &self.bar {
            b.set_message("downloaded");
        }
    }

    pub fn unpacking(&self) {
        if let Some(b) = &self.bar {
            b.set_style(spinner_style());
            b.set_message("unpacking");
            b.enable_steady_tick(Duration::from_millis(120));
        }
    }

    pub fn done(&self) {
        if let Some(b) = &self.bar {
            b.finish_with_message("done");
        }
    }

    pub fn failed(&self) {
        if let Some(b) = &self.bar {
            b.abandon_with_message("failed");
        }
    }
}
